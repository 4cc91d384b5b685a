/*
 * service.h: kvfence-control's services on top of kvf_rpc (kvf_svc_*).
 *
 * A struct kvf_svc owns the control-plane state core (one struct kvf_cps) and
 * the thread that runs it (the state thread), the health registry and the
 * reflection index. kvf_svc_register() puts Control, Admin, grpc.health.v1 and
 * grpc.reflection (v1 and v1alpha) onto a kvf_rpc server.
 *
 * RPC handlers run on the server's CQ threads: they decode and check the
 * request's shape (INVALID_ARGUMENT naming the field) and post a job to the
 * state thread, which runs it against the core, drains the core's effects,
 * encodes the reply and completes the call. The state thread also wakes at
 * kvf_cps_next_deadline() to fire the core's timers.
 *
 * Lifecycle (from one thread, the one that owns the server):
 *   kvf_svc_create -> kvf_svc_register(srv) -> kvf_rpc_server_start
 *   ... signal ... -> kvf_svc_not_serving -> kvf_rpc_server_shutdown
 *   -> kvf_svc_stop -> kvf_rpc_server_destroy -> kvf_svc_destroy.
 */
#ifndef KVF_SERVICE_H
#define KVF_SERVICE_H

struct kvf_svc;
struct kvf_rpc_server;
struct kvf_rpc_server_opts;
struct kvf_metrics;

#include "authz.h"
#include "kvf_log.h" /* the service logs with kvf_log, kvf_log_room, kvf_log_node */
#include "kvf_types.h"

/* The core's timers (cp_state.h); 0 keeps the core's default. */
struct kvf_svc_opts {
    kvf_time_ns node_ttl;
    kvf_time_ns join_timeout;
    kvf_time_ns drain_deadline;
    kvf_time_ns resend_initial;
    kvf_time_ns tombstone_ttl;
    const char *data_dir;          /* NULL or "": no durability (state in memory only) */
    uint64_t snapshot_every;       /* records between snapshots; 0: 4096 */
    kvf_time_ns heartbeat_timeout; /* end a silent node session after this; 0: never */
    struct kvf_authz_opts authz;   /* who may call what (authz.h); strings are copied */
    /* Fail-stop: called once (from any thread) when the log cannot be written;
     * the service is NOT_SERVING and refuses every call from then on, and the
     * caller should shut down and exit with KVF_SVC_EXIT_STORE_FAILED. */
    void (*on_store_failed)(void *arg);
    void *on_store_failed_arg;
};

/* Exit status of kvfence-control when its log cannot be written. */
#define KVF_SVC_EXIT_STORE_FAILED 3

/* The largest request or node message the service takes (bytes on the wire).
 * kvfence-control gives it to the gRPC server as its receive limit
 * (kvf_rpc_server_opts.max_receive_bytes), so a bigger one is refused with
 * RESOURCE_EXHAUSTED by the transport, before it is decoded. */
#define KVF_SVC_REQUEST_MAX (2u << 20)

/* kvfence-control --repair-wal: checks the log in `data_dir` and, where a
 * record is damaged or missing, copies the affected files to a backup folder
 * in it and cuts the log at the damage. Prints what it did (and how many
 * records were dropped) on stdout. 0, or a negative errno (logged). */
int kvf_svc_repair_wal(const char *data_dir);

/* Creates the state core, health registry and reflection index, and starts
 * the state thread. `opts` may be NULL. Returns NULL (and logs why). */
struct kvf_svc *kvf_svc_create(const struct kvf_svc_opts *opts);

/* Registers every method on `srv` (before kvf_rpc_server_start). Returns 0
 * or the negative errno of the first registration that failed. */
int kvf_svc_register(struct kvf_svc *svc, struct kvf_rpc_server *srv);

/* The service's metrics registry (docs/metrics.md), to serve with
 * kvf_metrics_http_start(); NULL if it could not be created. Valid until
 * kvf_svc_destroy(): stop the HTTP server before that. */
struct kvf_metrics *kvf_svc_metrics(struct kvf_svc *svc);

/* Sets the call observer of `opts` (before kvf_rpc_server_create) so that the
 * server feeds the RPC metrics. Does nothing without a registry. */
void kvf_svc_rpc_observer(struct kvf_svc *svc, struct kvf_rpc_server_opts *opts);

/* Health: every service NOT_SERVING (watchers are told), for shutdown. */
void kvf_svc_not_serving(struct kvf_svc *svc);

/* Stops the state thread. Jobs still queued, and jobs posted later, fail
 * with UNAVAILABLE. Idempotent. */
void kvf_svc_stop(struct kvf_svc *svc);

/* Stops (if needed) and frees everything. Call after the server is shut down
 * (no stream may still use the health registry). Accepts NULL. */
void kvf_svc_destroy(struct kvf_svc *svc);

#endif /* KVF_SERVICE_H */
