/*
 * service_internal.h: what service.c shares with control_svc.c and
 * admin_svc.c. Not part of the service's API.
 */
#ifndef KVF_SERVICE_INTERNAL_H
#define KVF_SERVICE_INTERNAL_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cp_state.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvf_error.h"
#include "kvf_types.h"
#include "service.h"

struct kvf_rpc_call;

struct kvf_svc_sessions;
struct kvf_rpc_server;
struct kvf_svc;

/* What a job sees of the service: the core, the node sessions and lease
 * watchers (node_svc.c), and the service's start time. State thread only. */
struct kvf_svc_persist;
struct kvf_svc_metrics;
struct kvf_store;
struct kvf_metrics;

struct kvf_svc_ctx {
    struct kvf_cps *cps;
    struct kvf_svc_sessions *sessions;
    struct kvf_svc_persist *persist; /* NULL: state in memory only */
    kvf_time_ns clock_offset;        /* service time = CLOCK_MONOTONIC + this */
    kvf_time_ns started_at;          /* CLOCK_MONOTONIC ns */
    kvf_time_ns node_ttl;            /* as configured in the core */
    struct kvf_svc_metrics *metrics; /* NULL: none (svc_metrics.c) */
    bool recovered;                  /* state came from a durable log: ask nodes to resync */
};

/* A job for the state thread that is not a unary call (stream events): `run`
 * runs there; `drop` frees `arg` instead when the service is stopping. */
typedef void (*kvf_svc_job_fn)(struct kvf_svc_ctx *ctx, void *arg, kvf_time_ns now);
void kvf_svc_post(struct kvf_svc *svc, kvf_svc_job_fn run, void (*drop)(void *arg), void *arg);

/* node_svc.c: the NodeSession/Attach and Control/WatchLeases streams. */
struct kvf_svc_sessions *kvf_svc_sessions_create(void);
void kvf_svc_sessions_destroy(struct kvf_svc_sessions *reg);
int kvf_svc_register_streams(struct kvf_svc *svc, struct kvf_rpc_server *srv);
/* Ends the session of every node that sent nothing (not even a heartbeat)
 * for `timeout_ns` (0: never); `mono_now` is CLOCK_MONOTONIC. State thread. */
void kvf_svc_sessions_sweep(struct kvf_svc_ctx *ctx, uint64_t mono_now, uint64_t timeout_ns);
/* The attached session of `node_id` at `incarnation`, for the admin views:
 * its Hello (endpoints, capabilities, software version; owned by the
 * session, valid until the state thread's next job) and, in
 * *last_seen_ms_p, the time since its last message in ms rounded up (>= 1).
 * NULL when that incarnation has no attached session. `mono_now` is
 * CLOCK_MONOTONIC. State thread. */
struct Kvfence__V1__Hello;
const struct Kvfence__V1__Hello *kvf_svc_session_view(struct kvf_svc_ctx *ctx, const char *node_id,
                                                      uint64_t incarnation, uint64_t mono_now,
                                                      uint64_t *last_seen_ms_p);
/* Delivers one core effect to the node sessions and lease watchers. */
void kvf_svc_route_effect(struct kvf_svc_ctx *ctx, const struct kvf_cps_effect *e);

/* ---- replies held until durable (service.c) ---------------------------- */

/* While a capture is active on the state thread, kvf_svc_reply() and
 * kvf_svc_fail() store the reply here instead of sending it. */
struct kvf_svc_reply_capture {
    bool set;
    int code; /* enum kvf_grpc_code */
    char *msg;
    uint8_t *bytes;
    size_t len;
};
void kvf_svc_capture_start(struct kvf_svc_reply_capture *cap);
void kvf_svc_capture_stop(void);
/* Sends a captured reply on `call` (any thread). */
void kvf_svc_capture_send(struct kvf_rpc_call *call, const struct kvf_svc_reply_capture *cap);
void kvf_svc_capture_free(struct kvf_svc_reply_capture *cap);

/* ---- durability (persist.c) ----------------------------------------------- */

enum kvf_svc_rec_kind {
    KVF_SVC_REC_UNARY = 1,      /* name: method; payload: request */
    KVF_SVC_REC_NODE_MSG = 2,   /* name: node id (empty for hello); payload: NodeMessage */
    KVF_SVC_REC_NODE_END = 3,   /* name: node id; the session ended */
    KVF_SVC_REC_TICK = 4,       /* timers fired */
    KVF_SVC_REC_DETACH_ALL = 5, /* start-up: no session survived the restart */
};

/* Opens the store in `data_dir`, restores the snapshot and replays the log
 * into ctx->cps (replacing it). A snapshot is written every `snapshot_every`
 * records (0: 4096). `on_fail` (may be NULL) is the fail-stop hook: called
 * once, from any thread, when the log cannot be written. */
int kvf_svc_persist_open(struct kvf_svc_ctx *ctx, const char *data_dir, uint64_t snapshot_every,
                         const struct kvf_cps_opts *opts, void (*on_fail)(void *arg, int rc),
                         void *fail_arg, struct kvf_error *err);
/* Makes every record durable (their held replies are sent) and closes. */
void kvf_svc_persist_close(struct kvf_svc_ctx *ctx);
/* True when commands must be logged (a store is open and not replaying). */
bool kvf_svc_persist_enabled(const struct kvf_svc_ctx *ctx);
/* Before running a command that may change the core: forget the random bytes
 * of the previous one. */
void kvf_svc_persist_begin(struct kvf_svc_ctx *ctx);
/* Logs the command just run. With `call`, the reply held in `cap` is sent once
 * the record is durable (and `cap` is emptied). Returns 0 or a negative errno
 * (then nothing was logged and `cap` is untouched). */
int kvf_svc_persist_commit(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                           const char *name, uint64_t incarnation, const uint8_t *payload,
                           size_t payload_len, struct kvf_rpc_call *call,
                           struct kvf_svc_reply_capture *cap);
kvf_time_ns kvf_svc_persist_last_now(const struct kvf_svc_ctx *ctx);
/* The seq of the last record appended, and whether a seq is durable yet (true
 * when no store is open). The state thread holds back the effects of a
 * command until its record is durable; `wake` (called on the store's thread)
 * tells it that more records became durable. */
uint64_t kvf_svc_persist_last_seq(const struct kvf_svc_ctx *ctx);
bool kvf_svc_persist_is_durable(const struct kvf_svc_ctx *ctx, uint64_t seq);
void kvf_svc_persist_set_wake(struct kvf_svc_ctx *ctx, void (*wake)(void *arg), void *arg);
/* Fail-stop (persist.c): once an append fails or a record does not become
 * durable, the open's `on_fail` is called once (state thread or the store's
 * thread) and kvf_svc_persist_failure() returns that negative errno (0
 * before, and with no store). The message tells a client what happened and
 * what to do. */
int kvf_svc_persist_failure(const struct kvf_svc_ctx *ctx);
void kvf_svc_persist_failure_msg(const struct kvf_svc_ctx *ctx, char *buf, size_t size);
/* Whether the command being run drew random bytes (it changed the core). */
bool kvf_svc_persist_drew_random(const struct kvf_svc_ctx *ctx);
/* The open store (its stats are readable from any thread), NULL if none. */
struct kvf_store *kvf_svc_persist_store(const struct kvf_svc_ctx *ctx);
/* The core's random source (ctx = the struct kvf_svc_ctx): records what it
 * draws, or feeds back what a replayed record drew. */
void kvf_svc_random(void *ctx, void *buf, size_t len);
/* Fresh random bytes from the kernel. */
void kvf_svc_random_os(void *buf, size_t len);
/* Re-runs one logged command (service.c). */
int kvf_svc_replay(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                   const char *name, uint64_t incarnation, const uint8_t *payload, size_t len);
/* Detaches every attached node (start-up). */
void kvf_svc_detach_all(struct kvf_svc_ctx *ctx, kvf_time_ns now);
/* node_svc.c: applies one node message to the core, without a session. */
int kvf_svc_node_apply(struct kvf_svc_ctx *ctx, const char *node_id, uint64_t incarnation,
                       const uint8_t *payload, size_t len, kvf_time_ns now);

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
    bool mutates; /* may change the core: logged, answered once durable */
};

/* With mutual TLS: may the peer that `id` describes call `method`? Returns
 * 0 and the peer's roles (and node id) in *peer_p; or -ENOKEY (no verified
 * certificate: UNAUTHENTICATED) or -EACCES (PERMISSION_DENIED), with the
 * reason in `why`, logged. Any thread. */
int kvf_svc_authorize(struct kvf_svc *svc, const struct kvf_rpc_identity *id, const char *method,
                      struct kvf_authz_peer *peer_p, char *why, size_t cap);
const struct kvf_authz_opts *kvf_svc_authz(const struct kvf_svc *svc);

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

/* ---- metrics (svc_metrics.c) ------------------------------------------------ */

/* Creates the service's registry, its families and its collector, seeds the
 * abort-latency map from the core's ABORTING rooms and publishes the core's
 * stats once. Before the state thread starts. `store` (NULL: none) must
 * outlive the registry's HTTP server. Returns NULL on out of memory. */
struct kvf_svc_metrics *kvf_svc_metrics_create(struct kvf_svc_ctx *ctx, struct kvf_store *store);
/* Frees it; no scrape may run (the HTTP server is stopped). Accepts NULL. */
void kvf_svc_metrics_destroy(struct kvf_svc_metrics *m);
/* The registry to serve (NULL for a NULL `m`). */
struct kvf_metrics *kvf_svc_metrics_registry(struct kvf_svc_metrics *m);
/* State thread: copies the core's stats for the collector (after each job and
 * tick). Accepts a NULL `m`. */
void kvf_svc_metrics_publish(struct kvf_svc_metrics *m, const struct kvf_svc_ctx *ctx);
/* State thread: one drained core effect (abort-to-released latency). */
void kvf_svc_metrics_effect(struct kvf_svc_metrics *m, const struct kvf_svc_ctx *ctx,
                            const struct kvf_cps_effect *e);
/* The kvf_rpc server's call observer (ctx = the struct kvf_svc_metrics). */
void kvf_svc_metrics_rpc_done(void *ctx, const char *method, int grpc_code, uint64_t latency_ns);

/* ---- conversions (svc_convert.c) ------------------------------------------ */

/* Feature names on the wire -> enum kvf_feature bits (unknown names ignored). */
uint32_t kvf_svc_features_from_names(char *const *names, size_t n);
/* Enum kvf_feature bits -> their wire names (the strings are static); returns
 * how many were written. */
size_t kvf_svc_features_to_names(uint32_t bits, char *names[KVF_FEATURE_COUNT]);

/* A Lease message built from a participant view, with the storage it points
 * at. The view's strings must outlive the message (until the next mutating
 * call into the core). */
struct kvf_svc_lease_buf {
    Kvfence__V1__Lease lease;
    Kvfence__V1__Participant part;
    Kvfence__V1__RoomKey key;
    Kvfence__V1__PageRange *rv;
    Kvfence__V1__PageRange **rp;
};

/* Fills `b` (0 or -ENOMEM, then nothing to free). */
int kvf_svc_lease_fill(struct kvf_svc_lease_buf *b, kvf_room_key key,
                       const struct kvf_cps_participant_view *pv);
void kvf_svc_lease_free(struct kvf_svc_lease_buf *b);

/* The pages of a JoinRoom or ExtendLease request: the old `ranges` or a
 * `page_set` (types.proto), never both. kvf_svc_pages_check (CQ thread) checks
 * the shape: at most one of the two, exactly one form in a page set that is
 * present, bitmap_first only with a bitmap, well-formed ranges
 * (INVALID_ARGUMENT naming the field). kvf_svc_pages_decode (state thread)
 * turns them into runs for the core: ranges as given, a bitmap or deltas as
 * ascending coalesced runs, at most `max_runs` of them (-E2BIG, found at
 * the first run past the limit, with no more than the limit allocated);
 * `field` names the form for the core's messages (NULL for the old ranges).
 * The array `v` may be handed to kvf_cps_join (ranges_adopt_p), which then
 * keeps it and sets `v` to NULL; kvf_svc_pages_free frees what is left. */
struct kvf_svc_pages {
    struct kvf_cps_page_range *v; /* malloc'd; NULL when n is 0 */
    size_t n;
    const char *field;
};
int kvf_svc_pages_check(Kvfence__V1__PageRange *const *ranges, size_t n_ranges,
                        const Kvfence__V1__PageSet *page_set, struct kvf_error *err);
int kvf_svc_pages_decode(Kvfence__V1__PageRange *const *ranges, size_t n_ranges,
                         const Kvfence__V1__PageSet *page_set, size_t max_runs,
                         struct kvf_svc_pages *pages_p, struct kvf_error *err);
void kvf_svc_pages_free(struct kvf_svc_pages *pages);

/* Request checks shared by the services: a room id in 1 .. 2^63-1 (`field`
 * names it), and a room key that is present (with a generation when asked). */
int kvf_svc_check_room_id(const char *field, uint64_t room_id, struct kvf_error *err);
int kvf_svc_check_room_key(const Kvfence__V1__RoomKey *room, bool need_generation,
                           struct kvf_error *err);

/* The participant that holds `lease_id` in room `key`: 0 or -ENOENT. */
int kvf_svc_find_lease(const struct kvf_cps *cps, kvf_room_key key, uint64_t lease_id,
                       struct kvf_cps_participant_view *pv_p);

/* Conversions shared by both services. */
/* Size limits of one request, checked before anything runs: a field over them
 * is INVALID_ARGUMENT naming the field; KVF_SVC_CHANGE_MAX bounds the bytes of
 * any request or node message that may be logged (far below the log's record
 * limit, 16 MiB). */
#define KVF_SVC_ID_MAX           ((size_t)KVF_NODE_ID_MAX) /* node ids */
#define KVF_SVC_FEATURES_MAX     32u                       /* capability feature names */
#define KVF_SVC_FEATURE_NAME_MAX 64u
#define KVF_SVC_PAGE_TOKEN_MAX   32u
#define KVF_SVC_FILTER_MAX       16u /* state filters of the listings */
#define KVF_SVC_CHANGE_MAX       KVF_SVC_REQUEST_MAX

/* "<field>: longer than <max> bytes" (-EINVAL) if `s` is; 0 otherwise. */
int kvf_svc_check_len(const char *field, const char *s, size_t max, struct kvf_error *err);

#define KVF_SVC_PAGE_SIZE_DEFAULT 100u
#define KVF_SVC_PAGE_SIZE_MAX     1000u

#endif /* KVF_SERVICE_INTERNAL_H */
