/*
 * service_internal.h: what service.c shares with control_svc.c and
 * admin_svc.c. Not part of the service's API.
 */
#ifndef KVF_SERVICE_INTERNAL_H
#define KVF_SERVICE_INTERNAL_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

#include "cp_state.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvf_error.h"
#include "kvf_types.h"
#include "service.h"

struct kvf_rpc_call;

/* What a job sees of the service: the core and the service's start time. */
struct kvf_svc_ctx {
    struct kvf_cps *cps;
    kvf_time_ns started_at; /* CLOCK_MONOTONIC ns */
};

/*
 * One unary method. `validate` runs on the CQ thread on the decoded request
 * and returns 0 or -EINVAL with a message naming the field (may be NULL).
 * `run` runs on the state thread and completes `call` exactly once.
 */
struct kvf_svc_method {
    const char *name; /* "/kvfence.v1.Control/JoinRoom" */
    const ProtobufCMessageDescriptor *req_desc;
    int (*validate)(const ProtobufCMessage *req, struct kvf_error *err);
    void (*run)(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call, const ProtobufCMessage *req,
                kvf_time_ns now);
};

extern const struct kvf_svc_method kvf_svc_control_methods[];
extern const size_t kvf_svc_control_method_count;
extern const struct kvf_svc_method kvf_svc_admin_methods[];
extern const size_t kvf_svc_admin_method_count;

/* Packs `msg` and replies OK; INTERNAL if packing fails. */
void kvf_svc_reply(struct kvf_rpc_call *call, const ProtobufCMessage *msg);

/* Fails `call` with the gRPC code of `neg_errno` and `err`'s message (or the
 * code's name when the message is empty). */
void kvf_svc_fail(struct kvf_rpc_call *call, int neg_errno, const struct kvf_error *err);

/* AbortRoom and AdminAbortRoom (control_svc.c). */
int kvf_svc_abort_validate(const Kvfence__V1__RoomKey *room, const char *detail,
                           struct kvf_error *err);
void kvf_svc_abort_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                       const Kvfence__V1__RoomKey *room, const char *detail,
                       enum kvf_cps_abort_reason reason, kvf_time_ns now);

/* Conversions shared by both services. */
#define KVF_SVC_PAGE_SIZE_DEFAULT 100u
#define KVF_SVC_PAGE_SIZE_MAX     1000u

#endif /* KVF_SERVICE_INTERNAL_H */
