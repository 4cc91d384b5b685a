/*
 * service.c: the state thread, the job queue, and the wiring of every method
 * (Control, Admin, grpc.health.v1, grpc.reflection v1/v1alpha) onto kvf_rpc.
 *
 * Admin methods are in admin_svc.c, Control in control_svc.c, node sessions
 * and WatchLeases in node_svc.c, the write-ahead log and snapshots (with
 * --data-dir) in persist.c, metrics in svc_metrics.c.
 *
 * Threads: CQ threads decode and validate requests and post jobs to a
 * mutex+condvar queue; the state thread alone touches the struct kvf_cps. It
 * runs each job, drains the effects, and fires the core's timers when
 * kvf_cps_next_deadline() passes (CLOCK_MONOTONIC, the clock of `now`). In
 * memory mode it drains once per turn (the jobs that were queued, at most
 * KVF_SVC_TURN_JOBS), so that room updates replaced or ended within the
 * turn are never sent (issue 24).
 *
 * With --data-dir the state never shows more than the log holds: a mutating
 * call is answered once its record is durable (persist.c), the effects of a
 * command are routed once its record is durable (drain_effects), and a read
 * (a non-mutating call) is answered once every record appended before it is
 * durable, so no reply reveals a change that a crash could still take back.
 * If the log fails (persist.c: fail-stop) the service turns NOT_SERVING at
 * once, refuses every call, drops what it held back, and tells its owner to
 * exit (kvf_svc_opts.on_store_failed).
 */
#include "service.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "health.h"
#include "health_rpc.h"
#include "kvf_api_descriptors.h"
#include "reflection.h"
#include "rpc_server.h"
#include "metrics.h"
#include "service_internal.h"
#include "kvf_clock.h"

/* ---- types ----------------------------------------------------------------- */

struct kvf_svc;

struct kvf_svc_binding {
    struct kvf_svc *svc;
    const struct kvf_svc_method *m;
};

/* A unary call (m, call, req) or a stream event (run, drop, arg). */
struct kvf_svc_job {
    struct kvf_svc_job *next;
    const struct kvf_svc_method *m;
    struct kvf_rpc_call *call;
    ProtobufCMessage *req;
    uint8_t *raw; /* the request's bytes, for the log (mutating methods) */
    size_t raw_len;
    kvf_svc_job_fn run;
    void (*drop)(void *arg);
    void *arg;
};

struct kvf_svc {
    struct kvf_svc_ctx ctx; /* state thread only */
    struct kvf_health *health;
    struct kvf_reflection *refl;

    struct kvf_svc_binding *bindings;
    size_t n_bindings;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct kvf_svc_job *head; /* under mu */
    struct kvf_svc_job *tail;
    bool stopping;      /* under mu */
    bool durable_moved; /* under mu: the store made more records durable */
    bool thread_started;
    pthread_t thread;

    /* State thread: effects held back until the record of the command that
     * caused them is durable (with --data-dir), in the order they came. */
    struct fx_batch *held_head, *held_tail;
    void (*on_store_failed)(void *arg);
    void *on_store_failed_arg;
    kvf_time_ns heartbeat_timeout; /* 0: sessions are never swept */
    kvf_time_ns next_sweep;        /* mono time of the next session sweep */

    /* Who may call what; fixed at create, read by CQ threads. */
    struct kvf_authz_opts authz;
    char *authz_strs[3];
};

/* In memory mode, the most jobs whose effects are routed together (a turn of
 * the state thread): bounds how long the first job's effects wait. */
#define KVF_SVC_TURN_JOBS 8u

/* The effects of one command, or the held reply of one read, released once
 * record `seq` is durable. */
struct fx_batch {
    struct fx_batch *next;
    uint64_t seq;
    struct kvf_rpc_call *call; /* a read's call (its reply in `cap`), or NULL */
    struct kvf_svc_reply_capture cap;
    size_t n;
    struct kvf_cps_effect fx[];
};

static const char *const kvf_svc_service_names[] = {"kvfence.v1.Control", "kvfence.v1.Admin",
                                                    "kvfence.v1.NodeSession"};

static kvf_time_ns mono_now(void)
{
    return (kvf_time_ns)kvf_clock_mono_ns();
}

void kvf_svc_random_os(void *buf, size_t len)
{
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = getrandom(p, len, 0);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            /* getrandom(2) cannot fail otherwise on Linux >= 3.17 with these
             * flags; abort rather than mint a predictable token. */
            kvf_log("error", "getrandom failed: %s", strerror(errno));
            abort();
        }
        p += n;
        len -= (size_t)n;
    }
}

/* ---- replies ------------------------------------------------------------- */

/* The state thread's active capture (see kvf_svc_capture_start). */
static _Thread_local struct kvf_svc_reply_capture *capture;

void kvf_svc_capture_start(struct kvf_svc_reply_capture *cap)
{
    memset(cap, 0, sizeof(*cap));
    capture = cap;
}

void kvf_svc_capture_stop(void)
{
    capture = NULL;
}

void kvf_svc_capture_send(struct kvf_rpc_call *call, const struct kvf_svc_reply_capture *cap)
{
    if (call == NULL) {
        return;
    }
    if (!cap->set) {
        kvf_rpc_call_fail(call, KVF_GRPC_INTERNAL, "the handler produced no reply");
    } else if (cap->code == KVF_GRPC_OK) {
        kvf_rpc_call_reply(call, cap->bytes, cap->len);
    } else {
        kvf_rpc_call_fail(call, cap->code, cap->msg ? cap->msg : kvf_grpc_code_name(cap->code));
    }
}

void kvf_svc_capture_free(struct kvf_svc_reply_capture *cap)
{
    free(cap->bytes);
    free(cap->msg);
    memset(cap, 0, sizeof(*cap));
}

static void fail_code(struct kvf_rpc_call *call, int code, const char *msg)
{
    if (capture != NULL) {
        capture->set = true;
        capture->code = code;
        capture->msg = strdup(msg);
        return;
    }
    if (call != NULL) {
        kvf_rpc_call_fail(call, code, msg);
    }
}

void kvf_svc_reply(struct kvf_rpc_call *call, const ProtobufCMessage *msg)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        fail_code(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory packing the reply");
        return;
    }
    protobuf_c_message_pack(msg, buf);
    if (capture != NULL) {
        capture->set = true;
        capture->code = KVF_GRPC_OK;
        capture->bytes = buf;
        capture->len = len;
        return;
    }
    if (call != NULL) {
        kvf_rpc_call_reply(call, buf, len);
    }
    free(buf);
}

void kvf_svc_fail(struct kvf_rpc_call *call, int neg_errno, const struct kvf_error *err)
{
    enum kvf_grpc_code code = kvf_errno_to_grpc_code(neg_errno);
    if (code == KVF_GRPC_OK) {
        code = KVF_GRPC_INTERNAL;
    }
    const char *msg = (err && err->msg[0]) ? err->msg : kvf_grpc_code_name(code);
    fail_code(call, (int)code, msg);
}

/* ---- the state thread ------------------------------------------------------ */

/* Sends what the core asked for: notices to node sessions, releases and room
 * states to watchers. */
static void route_effects(struct kvf_svc *svc, const struct kvf_cps_effect *fx, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        kvf_svc_route_effect(&svc->ctx, &fx[i]);
    }
}

static void hold_batch(struct kvf_svc *svc, struct fx_batch *b)
{
    b->next = NULL;
    if (svc->held_tail) {
        svc->held_tail->next = b;
    } else {
        svc->held_head = b;
    }
    svc->held_tail = b;
}

/* Frees a held batch, failing its read (if any) with `code` and `msg`. */
static void drop_batch(struct fx_batch *b, int code, const char *msg)
{
    if (b->call) {
        kvf_rpc_call_fail(b->call, code, msg);
    }
    kvf_svc_capture_free(&b->cap);
    free(b);
}

/* Routes every held batch whose record is durable now, in order. After a
 * failure of the log nothing held is released: reads are refused, effects
 * dropped (their records may never reach the disk). */
static void release_held_effects(struct kvf_svc *svc)
{
    if (kvf_svc_persist_failure(&svc->ctx) != 0) {
        char msg[256];
        kvf_svc_persist_failure_msg(&svc->ctx, msg, sizeof msg);
        while (svc->held_head) {
            struct fx_batch *b = svc->held_head;
            svc->held_head = b->next;
            drop_batch(b, KVF_GRPC_UNAVAILABLE, msg);
        }
        svc->held_tail = NULL;
        return;
    }
    while (svc->held_head && kvf_svc_persist_is_durable(&svc->ctx, svc->held_head->seq)) {
        struct fx_batch *b = svc->held_head;
        svc->held_head = b->next;
        if (!svc->held_head) {
            svc->held_tail = NULL;
        }
        route_effects(svc, b->fx, b->n);
        if (b->call) {
            kvf_svc_capture_send(b->call, &b->cap);
            kvf_svc_capture_free(&b->cap);
        }
        free(b);
    }
}

/* The log failed (persist.c; any thread): NOT_SERVING at once, wake the state
 * thread to refuse what it holds, and tell the owner to stop. */
static void store_failed(void *arg, int rc)
{
    struct kvf_svc *svc = arg;
    (void)rc;
    kvf_health_shutdown(svc->health);
    pthread_mutex_lock(&svc->mu);
    svc->durable_moved = true;
    pthread_cond_signal(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
    if (svc->on_store_failed) {
        svc->on_store_failed(svc->on_store_failed_arg);
    }
}

/* Called on the store's thread: more records are durable. */
static void durable_wake(void *arg)
{
    struct kvf_svc *svc = arg;
    pthread_mutex_lock(&svc->mu);
    svc->durable_moved = true;
    pthread_cond_signal(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
}

/*
 * Takes the core's effects after a command: logs and counts them at once, and
 * routes them once the command's record is durable. Holding them back is what
 * makes a release (an engine told its pages are free) never precede the
 * record that proves it: after a crash the replayed log reaches the same
 * release, and no engine was told of one the log does not hold.
 */
static void drain_effects(struct kvf_svc *svc)
{
    size_t n = 0;
    const struct kvf_cps_effect *fx = kvf_cps_effects_take(svc->ctx.cps, &n);
    if (n > 0 && kvf_svc_persist_enabled(&svc->ctx)) {
        struct fx_batch *b = calloc(1, sizeof(*b) + n * sizeof(b->fx[0]));
        if (b) {
            b->seq = kvf_svc_persist_last_seq(&svc->ctx);
            b->n = n;
            memcpy(b->fx, fx, n * sizeof(fx[0]));
            hold_batch(svc, b);
        } else {
            /* Out of memory: the core re-sends notices; releases and room
             * states for watchers are lost (logged). */
            kvf_log("error", "out of memory holding %zu effects; they are dropped", n);
        }
    }
    for (size_t i = 0; i < n; i++) {
        const struct kvf_cps_effect *e = &fx[i];
        switch (e->kind) {
        case KVF_CPS_FX_ROOM_STATE:
            kvf_log_room(
                "info", e->key, NULL, "room %" PRIu64 ":%" PRIu64 " %s -> %s%s%s", e->key.room_id,
                e->key.generation,
                e->old_state ? kvf_cps_room_state_name((enum kvf_cps_room_state)e->old_state)
                             : "NONE",
                kvf_cps_room_state_name((enum kvf_cps_room_state)e->new_state),
                e->new_state == KVF_CPS_ROOM_ABORTING ? " reason " : "",
                e->new_state == KVF_CPS_ROOM_ABORTING ? kvf_cps_abort_reason_name(e->reason) : "");
            break;
        case KVF_CPS_FX_NODE_STATE:
            kvf_log_node("info", e->node_id, e->incarnation,
                         "node %s incarnation %" PRIu64 " -> %s", e->node_id, e->incarnation,
                         kvf_cps_node_state_name((enum kvf_cps_node_state)e->new_state));
            break;
        case KVF_CPS_FX_ESCALATION:
            kvf_log_room("warn", e->key, e->node_id,
                         "room %" PRIu64 ":%" PRIu64 ": node %s has not drained by the deadline",
                         e->key.room_id, e->key.generation, e->node_id);
            break;
        default:
            break;
        }
        kvf_svc_metrics_effect(svc->ctx.metrics, &svc->ctx, e);
    }
    if (!kvf_svc_persist_enabled(&svc->ctx)) {
        route_effects(svc, fx, n);
    }
    release_held_effects(svc);
}

static void fail_job(struct kvf_svc_job *job, int code, const char *msg)
{
    if (job->run != NULL) {
        job->drop(job->arg);
    } else {
        kvf_rpc_call_fail(job->call, code, msg);
        protobuf_c_message_free_unpacked(job->req, NULL);
        free(job->raw);
    }
    free(job);
}

static kvf_time_ns svc_now(const struct kvf_svc *svc)
{
    return mono_now() + svc->ctx.clock_offset;
}

/* A read with --data-dir: answered at once if every record appended so far
 * is durable, else held (in order with the effects) until it is. */
static void run_read(struct kvf_svc *svc, struct kvf_svc_job *job, kvf_time_ns now)
{
    uint64_t seq = kvf_svc_persist_last_seq(&svc->ctx);
    if (kvf_svc_persist_is_durable(&svc->ctx, seq)) {
        job->m->run(&svc->ctx, job->call, job->req, now);
        return;
    }
    struct fx_batch *b = calloc(1, sizeof(*b));
    if (!b) {
        kvf_rpc_call_fail(job->call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    kvf_svc_capture_start(&b->cap);
    job->m->run(&svc->ctx, job->call, job->req, now);
    kvf_svc_capture_stop();
    b->seq = seq;
    b->call = job->call;
    hold_batch(svc, b);
}

/* A change: checked for size, run with its reply captured, and logged only if
 * the core accepted it (an OK reply) or changed anything (effects emitted,
 * random bytes drawn; a capability refusal aborts the room). Its reply is
 * sent once its record is durable (persist.c); a refusal that changed
 * nothing is answered at once and never reaches the log. */
static void run_change(struct kvf_svc *svc, struct kvf_svc_job *job, kvf_time_ns now)
{
    if (job->raw_len > KVF_SVC_CHANGE_MAX) {
        char msg[160];
        snprintf(msg, sizeof msg, "request: %zu bytes, more than the %u bytes one change may take",
                 job->raw_len, KVF_SVC_CHANGE_MAX);
        kvf_rpc_call_fail(job->call, KVF_GRPC_INVALID_ARGUMENT, msg);
        return;
    }
    struct kvf_svc_reply_capture cap;
    kvf_svc_persist_begin(&svc->ctx);
    kvf_svc_capture_start(&cap);
    job->m->run(&svc->ctx, job->call, job->req, now);
    kvf_svc_capture_stop();
    bool changed = (cap.set && cap.code == KVF_GRPC_OK) ||
                   kvf_cps_effects_pending(svc->ctx.cps) > 0 ||
                   kvf_svc_persist_drew_random(&svc->ctx);
    if (!changed) {
        kvf_svc_capture_send(job->call, &cap);
        kvf_svc_capture_free(&cap);
        return;
    }
    int rc = kvf_svc_persist_commit(&svc->ctx, KVF_SVC_REC_UNARY, now, job->m->name, 0, job->raw,
                                    job->raw_len, job->call, &cap);
    if (rc < 0) {
        /* Applied but not logged: the service has failed (fail-stop) and
         * nothing of this change is shown to anyone. */
        char msg[256];
        kvf_svc_persist_failure_msg(&svc->ctx, msg, sizeof msg);
        kvf_rpc_call_fail(job->call, KVF_GRPC_UNAVAILABLE, msg);
    }
    kvf_svc_capture_free(&cap);
}

/* A unary call on the state thread. */
static void run_unary(struct kvf_svc *svc, struct kvf_svc_job *job)
{
    kvf_time_ns now = svc_now(svc);
    if (!kvf_svc_persist_enabled(&svc->ctx)) {
        job->m->run(&svc->ctx, job->call, job->req, now);
    } else if (job->m->mutates) {
        run_change(svc, job, now);
    } else {
        run_read(svc, job, now);
    }
    protobuf_c_message_free_unpacked(job->req, NULL);
    free(job->raw);
}

int kvf_svc_replay(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                   const char *name, uint64_t incarnation, const uint8_t *payload, size_t len)
{
    static const uint8_t empty[1];
    switch (kind) {
    case KVF_SVC_REC_UNARY: {
        const struct kvf_svc_method *m = NULL;
        for (size_t i = 0; i < kvf_svc_control_method_count && !m; i++) {
            if (strcmp(kvf_svc_control_methods[i].name, name) == 0) {
                m = &kvf_svc_control_methods[i];
            }
        }
        for (size_t i = 0; i < kvf_svc_admin_method_count && !m; i++) {
            if (strcmp(kvf_svc_admin_methods[i].name, name) == 0) {
                m = &kvf_svc_admin_methods[i];
            }
        }
        if (!m) {
            return -EBADMSG;
        }
        ProtobufCMessage *req =
            protobuf_c_message_unpack(m->req_desc, NULL, len, len ? payload : empty);
        if (!req) {
            return -EBADMSG;
        }
        struct kvf_svc_reply_capture cap;
        kvf_svc_capture_start(&cap);
        m->run(ctx, NULL, req, now);
        kvf_svc_capture_stop();
        kvf_svc_capture_free(&cap);
        protobuf_c_message_free_unpacked(req, NULL);
        return 0;
    }
    case KVF_SVC_REC_NODE_MSG:
        return kvf_svc_node_apply(ctx, name, incarnation, payload, len, now);
    case KVF_SVC_REC_NODE_END:
        kvf_cps_node_detach(ctx->cps, name, incarnation, now, NULL);
        return 0;
    case KVF_SVC_REC_TICK:
        kvf_cps_tick(ctx->cps, now);
        return 0;
    case KVF_SVC_REC_DETACH_ALL:
        kvf_svc_detach_all(ctx, now);
        return 0;
    }
    return -EBADMSG;
}

/* Whether another job waits (any thread). */
static bool jobs_queued(struct kvf_svc *svc)
{
    pthread_mutex_lock(&svc->mu);
    bool more = svc->head != NULL;
    pthread_mutex_unlock(&svc->mu);
    return more;
}

static void *state_thread(void *arg)
{
    struct kvf_svc *svc = arg;
    unsigned turn_jobs = 0; /* jobs run since the effects were last drained */

    pthread_mutex_lock(&svc->mu);
    while (!svc->stopping) {
        struct kvf_svc_job *job = svc->head;
        if (job) {
            svc->head = job->next;
            if (!svc->head) {
                svc->tail = NULL;
            }
        }
        pthread_mutex_unlock(&svc->mu);

        if (job && kvf_svc_persist_failure(&svc->ctx) != 0) {
            /* Fail-stop: the state may be ahead of the log; show nothing. */
            char msg[256];
            kvf_svc_persist_failure_msg(&svc->ctx, msg, sizeof msg);
            fail_job(job, KVF_GRPC_UNAVAILABLE, msg);
            job = NULL;
            release_held_effects(svc);
        } else if (job) {
            if (job->run != NULL) {
                job->run(&svc->ctx, job->arg, svc_now(svc));
            } else {
                run_unary(svc, job);
            }
            /* In memory the effects of a turn (the jobs queued, up to
             * KVF_SVC_TURN_JOBS) are routed together, after its last job:
             * room updates replaced or ended within the turn are not sent,
             * and the rest leave back to back. With a log, each command's
             * effects wait for its own record (drain_effects). */
            if (kvf_svc_persist_enabled(&svc->ctx) || ++turn_jobs >= KVF_SVC_TURN_JOBS ||
                !jobs_queued(svc)) {
                drain_effects(svc);
                turn_jobs = 0;
            }
            free(job);
        }
        kvf_time_ns now = svc_now(svc);
        kvf_time_ns dl = kvf_cps_next_deadline(svc->ctx.cps);
        if (dl <= now && kvf_svc_persist_failure(&svc->ctx) != 0) {
            dl = UINT64_MAX; /* failed: no timer runs any more */
        } else if (dl <= now) {
            if (turn_jobs > 0) { /* the turn's effects first, in order */
                drain_effects(svc);
                turn_jobs = 0;
            }
            kvf_svc_persist_begin(&svc->ctx);
            kvf_cps_tick(svc->ctx.cps, now);
            if (kvf_svc_persist_enabled(&svc->ctx)) {
                int prc = kvf_svc_persist_commit(&svc->ctx, KVF_SVC_REC_TICK, now, NULL, 0, NULL, 0,
                                                 NULL, NULL);
                if (prc < 0) {
                    kvf_log("error", "cannot log a timer tick: %s", strerror(-prc));
                }
            }
            drain_effects(svc);
            dl = kvf_cps_next_deadline(svc->ctx.cps);
        }
        /* Every job and tick (and spurious wake-up): one struct copy. */
        kvf_svc_metrics_publish(svc->ctx.metrics, &svc->ctx);
        /* The condvar waits on CLOCK_MONOTONIC: back to its time base. */
        if (dl != UINT64_MAX) {
            dl = dl > svc->ctx.clock_offset ? dl - svc->ctx.clock_offset : 0;
        }
        now = mono_now();

        release_held_effects(svc);
        /* Walks every session: once a second (the wake-up below), not after every job. */
        if (now >= svc->next_sweep) {
            kvf_svc_sessions_sweep(&svc->ctx, now, svc->heartbeat_timeout);
            svc->next_sweep = now + KVF_NS_PER_S;
        }
        /* Wake at least every second while silent sessions are being watched. */
        if (svc->heartbeat_timeout && (dl == UINT64_MAX || dl > now + KVF_NS_PER_S)) {
            dl = now + KVF_NS_PER_S;
        }
        pthread_mutex_lock(&svc->mu);
        if (job || svc->head || svc->stopping || svc->durable_moved) {
            svc->durable_moved = false;
            continue;
        }
        if (dl == UINT64_MAX) {
            pthread_cond_wait(&svc->cv, &svc->mu);
        } else if (dl > now) {
            struct timespec abs = {.tv_sec = (time_t)(dl / KVF_NS_PER_S),
                                   .tv_nsec = (long)(dl % KVF_NS_PER_S)};
            pthread_cond_timedwait(&svc->cv, &svc->mu, &abs);
        }
    }
    pthread_mutex_unlock(&svc->mu);
    if (turn_jobs > 0)
        drain_effects(svc); /* stopping in the middle of a turn */
    return NULL;
}

static void post_job(struct kvf_svc *svc, struct kvf_svc_job *job)
{
    pthread_mutex_lock(&svc->mu);
    if (svc->stopping) {
        pthread_mutex_unlock(&svc->mu);
        fail_job(job, KVF_GRPC_UNAVAILABLE, "the control plane is shutting down");
        return;
    }
    job->next = NULL;
    if (svc->tail) {
        svc->tail->next = job;
    } else {
        svc->head = job;
    }
    svc->tail = job;
    pthread_cond_signal(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
}

void kvf_svc_post(struct kvf_svc *svc, kvf_svc_job_fn run, void (*drop)(void *arg), void *arg)
{
    struct kvf_svc_job *job = calloc(1, sizeof *job);
    if (!job) {
        kvf_log("error", "out of memory queuing a stream event");
        drop(arg);
        return;
    }
    job->run = run;
    job->drop = drop;
    job->arg = arg;
    post_job(svc, job);
}

/* ---- unary glue ------------------------------------------------------------ */

static const uint8_t empty_msg[1];

int kvf_svc_authorize(struct kvf_svc *svc, const struct kvf_rpc_identity *id, const char *method,
                      struct kvf_authz_peer *peer_p, char *why, size_t cap)
{
    struct kvf_authz_peer peer;
    kvf_authz_classify(&svc->authz, id, &peer);
    unsigned need = kvf_authz_method_roles(method);
    if (need == 0 || (peer.roles & need) != 0) {
        *peer_p = peer;
        return 0;
    }
    const char *who = id->n_names > 0 ? id->names[0] : "(no name)";
    int rc = id->verified ? -EACCES : -ENOKEY;
    snprintf(why, cap, "%s: the client certificate %s is not a%s %s identity", method, who,
             need == KVF_AUTHZ_ADMIN || need == (KVF_AUTHZ_ENGINE | KVF_AUTHZ_ADMIN) ? "n" : "",
             kvf_authz_roles_name(need));
    kvf_log("warn", "refused: %s", why);
    return rc;
}

/* With mutual TLS, a call whose certificate lacks the method's role is
 * refused before its request is even decoded: it leaves no trace but a log
 * line. Returns false when the call was answered. */
static bool authorize_call(struct kvf_svc *svc, struct kvf_rpc_call *call, const char *method)
{
    if (!svc->authz.enforce)
        return true;
    struct kvf_rpc_identity id;
    struct kvf_authz_peer peer;
    char why[KVF_RPC_NAME_MAX + 160];
    int rc = kvf_rpc_call_identity(call, &id);
    if (rc == 0)
        rc = kvf_svc_authorize(svc, &id, method, &peer, why, sizeof why);
    else
        snprintf(why, sizeof why, "%s: the call ended before it was authorized", method);
    if (rc == 0)
        return true;
    kvf_rpc_call_fail(call, kvf_errno_to_grpc_code(rc == -ECANCELED ? -ENOKEY : rc), why);
    return false;
}

const struct kvf_authz_opts *kvf_svc_authz(const struct kvf_svc *svc)
{
    return &svc->authz;
}

static void unary_handler(void *vctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct kvf_svc_binding *b = vctx;
    if (!authorize_call(b->svc, call, b->m->name))
        return;
    ProtobufCMessage *msg =
        protobuf_c_message_unpack(b->m->req_desc, NULL, len, req ? req : empty_msg);
    if (!msg) {
        char text[160];
        snprintf(text, sizeof text, "request: does not decode as %s", b->m->req_desc->name);
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, text);
        return;
    }
    if (b->m->validate) {
        struct kvf_error err;
        kvf_error_clear(&err);
        int rc = b->m->validate(msg, &err);
        if (rc < 0) {
            kvf_svc_fail(call, rc, &err);
            protobuf_c_message_free_unpacked(msg, NULL);
            return;
        }
    }
    struct kvf_svc_job *job = calloc(1, sizeof *job);
    if (!job) {
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        protobuf_c_message_free_unpacked(msg, NULL);
        return;
    }
    job->m = b->m;
    job->call = call;
    job->req = msg;
    if (b->m->mutates && len > 0) {
        job->raw = malloc(len);
        if (!job->raw) {
            kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
            protobuf_c_message_free_unpacked(msg, NULL);
            free(job);
            return;
        }
        memcpy(job->raw, req, len);
        job->raw_len = len;
    }
    post_job(b->svc, job);
}

/* ---- reflection ---------------------------------------------------------------- */

static void refl_open(void *vctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    (void)vctx;
    (void)stream;
    (void)req;
    (void)len;
}

static void refl_message(void *vctx, struct kvf_rpc_stream *stream, const uint8_t *msg, size_t len)
{
    struct kvf_svc *svc = vctx;
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    int rc = kvf_reflection_handle(svc->refl, msg ? msg : empty_msg, len, &resp, &resp_len);
    if (rc < 0) {
        kvf_rpc_stream_finish(
            stream, rc == -ENOMEM ? KVF_GRPC_RESOURCE_EXHAUSTED : KVF_GRPC_INVALID_ARGUMENT,
            rc == -ENOMEM ? "out of memory"
                          : "request: does not decode as ServerReflectionRequest");
        return;
    }
    kvf_rpc_stream_send(stream, resp_len ? resp : empty_msg, resp_len);
    free(resp);
}

static void refl_half_close(void *vctx, struct kvf_rpc_stream *stream)
{
    (void)vctx;
    kvf_rpc_stream_finish(stream, KVF_GRPC_OK, NULL);
}

/* ---- lifecycle ------------------------------------------------------------------ */

struct kvf_svc *kvf_svc_create(const struct kvf_svc_opts *sopts)
{
    struct kvf_svc *svc = calloc(1, sizeof *svc);
    if (!svc) {
        kvf_log("error", "out of memory creating the service");
        return NULL;
    }
    pthread_mutex_init(&svc->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&svc->cv, &ca);
    pthread_condattr_destroy(&ca);

    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    opts.random_fn = kvf_svc_random;
    opts.random_ctx = &svc->ctx;
    if (sopts != NULL) {
        if (sopts->node_ttl)
            opts.node_ttl = sopts->node_ttl;
        if (sopts->join_timeout)
            opts.join_timeout = sopts->join_timeout;
        if (sopts->drain_deadline)
            opts.drain_deadline = sopts->drain_deadline;
        if (sopts->resend_initial)
            opts.resend_initial = sopts->resend_initial;
        if (sopts->tombstone_ttl)
            opts.tombstone_ttl = sopts->tombstone_ttl;
    }
    svc->ctx.cps = kvf_cps_create(&opts);
    svc->ctx.sessions = kvf_svc_sessions_create();
    svc->ctx.started_at = mono_now();
    svc->ctx.node_ttl = opts.node_ttl;
    svc->heartbeat_timeout = sopts != NULL ? sopts->heartbeat_timeout : 0;
    if (sopts != NULL) {
        const char *strs[3] = {sopts->authz.node_prefix, sopts->authz.engine_prefix,
                               sopts->authz.admin_names};
        const char **dst[3] = {&svc->authz.node_prefix, &svc->authz.engine_prefix,
                               &svc->authz.admin_names};
        svc->authz.enforce = sopts->authz.enforce;
        for (int i = 0; i < 3; i++) {
            if (strs[i] == NULL)
                continue;
            svc->authz_strs[i] = strdup(strs[i]);
            if (svc->authz_strs[i] == NULL) {
                kvf_log("error", "cannot create the service: out of memory");
                kvf_svc_destroy(svc);
                return NULL;
            }
            *dst[i] = svc->authz_strs[i];
        }
        svc->on_store_failed = sopts->on_store_failed;
        svc->on_store_failed_arg = sopts->on_store_failed_arg;
    }
    /* Health before the store: a failure of the log right after recovery
     * (store_failed, on the store's thread) turns it NOT_SERVING. */
    svc->health = kvf_health_create();
    for (size_t i = 0;
         svc->health && i < sizeof kvf_svc_service_names / sizeof *kvf_svc_service_names; i++) {
        kvf_health_set(svc->health, kvf_svc_service_names[i], KVF_HEALTH_SERVING);
    }
    if (svc->ctx.cps && svc->health && sopts != NULL && sopts->data_dir != NULL &&
        sopts->data_dir[0] != '\0') {
        struct kvf_error err;
        kvf_error_clear(&err);
        int prc = kvf_svc_persist_open(&svc->ctx, sopts->data_dir, sopts->snapshot_every, &opts,
                                       store_failed, svc, &err);
        if (prc < 0) {
            kvf_log("error", "cannot recover from data-dir %s: %s", sopts->data_dir,
                    err.msg[0] ? err.msg : strerror(-prc));
            kvf_svc_destroy(svc);
            return NULL;
        }
        kvf_svc_persist_set_wake(&svc->ctx, durable_wake, svc);
        /* Service time continues from the last time the log saw. */
        kvf_time_ns last = kvf_svc_persist_last_now(&svc->ctx), mono = mono_now();
        svc->ctx.clock_offset = last > mono ? last - mono : 0;
    } else if (svc->ctx.cps) {
        kvf_log("warn", "no data-dir: the state lives in memory only and is lost on restart");
    }
    svc->refl = kvf_reflection_create(kvf_api_descriptor_set, kvf_api_descriptor_set_len,
                                      kvf_svc_service_names,
                                      sizeof kvf_svc_service_names / sizeof *kvf_svc_service_names);
    svc->n_bindings = kvf_svc_control_method_count + kvf_svc_admin_method_count;
    svc->bindings = calloc(svc->n_bindings, sizeof *svc->bindings);
    if (!svc->ctx.cps || !svc->ctx.sessions || !svc->health || !svc->refl || !svc->bindings) {
        kvf_log("error", "cannot create the service (state core, health, reflection or memory)");
        kvf_svc_destroy(svc);
        return NULL;
    }
    svc->ctx.metrics = kvf_svc_metrics_create(&svc->ctx, kvf_svc_persist_store(&svc->ctx));
    if (!svc->ctx.metrics) {
        kvf_log("error", "cannot create the metrics registry (out of memory)");
        kvf_svc_destroy(svc);
        return NULL;
    }
    /* Plaintext (or TLS without client certificates) is a test bed's mode:
     * a metric says so, for an alert, besides the INSECURE line at start. */
    struct kvf_metric *insecure = NULL;
    if (kvf_metrics_gauge(kvf_svc_metrics_registry(svc->ctx.metrics), "kvfence_insecure",
                          "1 when callers are not authenticated (no mutual TLS): anyone who "
                          "reaches the port can attach as any node and call Admin.",
                          &insecure) >= 0)
        kvf_gauge_set(insecure, svc->authz.enforce ? 0 : 1);
    int rc = pthread_create(&svc->thread, NULL, state_thread, svc);
    if (rc != 0) {
        kvf_log("error", "cannot start the state thread: %s", strerror(rc));
        kvf_svc_destroy(svc);
        return NULL;
    }
    svc->thread_started = true;
    return svc;
}

int kvf_svc_register(struct kvf_svc *svc, struct kvf_rpc_server *srv)
{
    size_t k = 0;
    int rc;
    for (size_t i = 0; i < kvf_svc_control_method_count; i++, k++) {
        svc->bindings[k].svc = svc;
        svc->bindings[k].m = &kvf_svc_control_methods[i];
    }
    for (size_t i = 0; i < kvf_svc_admin_method_count; i++, k++) {
        svc->bindings[k].svc = svc;
        svc->bindings[k].m = &kvf_svc_admin_methods[i];
    }
    for (size_t i = 0; i < svc->n_bindings; i++) {
        rc = kvf_rpc_server_add_unary(srv, svc->bindings[i].m->name, unary_handler,
                                      &svc->bindings[i]);
        if (rc < 0) {
            kvf_log("error", "cannot register %s: %s", svc->bindings[i].m->name, strerror(-rc));
            return rc;
        }
    }
    rc = kvf_svc_register_streams(svc, srv);
    if (rc < 0) {
        return rc;
    }
    rc = kvf_health_rpc_register(srv, svc->health);
    if (rc < 0) {
        return rc;
    }
    const struct kvf_rpc_stream_callbacks refl = {
        .on_open = refl_open, .on_message = refl_message, .on_half_close = refl_half_close};
    rc = kvf_rpc_server_add_stream(srv, "/" KVF_REFLECTION_SERVICE_V1 "/ServerReflectionInfo",
                                   KVF_RPC_BIDI, &refl, svc);
    if (rc < 0) {
        return rc;
    }
    return kvf_rpc_server_add_stream(
        srv, "/" KVF_REFLECTION_SERVICE_V1ALPHA "/ServerReflectionInfo", KVF_RPC_BIDI, &refl, svc);
}

struct kvf_metrics *kvf_svc_metrics(struct kvf_svc *svc)
{
    return svc ? kvf_svc_metrics_registry(svc->ctx.metrics) : NULL;
}

void kvf_svc_rpc_observer(struct kvf_svc *svc, struct kvf_rpc_server_opts *opts)
{
    if (svc && svc->ctx.metrics && opts) {
        opts->on_call_done = kvf_svc_metrics_rpc_done;
        opts->observer_ctx = svc->ctx.metrics;
    }
}

void kvf_svc_not_serving(struct kvf_svc *svc)
{
    if (svc && svc->health) {
        kvf_health_shutdown(svc->health);
    }
}

void kvf_svc_stop(struct kvf_svc *svc)
{
    if (!svc) {
        return;
    }
    pthread_mutex_lock(&svc->mu);
    svc->stopping = true;
    struct kvf_svc_job *rest = svc->head;
    svc->head = svc->tail = NULL;
    pthread_cond_signal(&svc->cv);
    pthread_mutex_unlock(&svc->mu);
    if (svc->thread_started) {
        pthread_join(svc->thread, NULL);
        svc->thread_started = false;
    }
    while (rest) {
        struct kvf_svc_job *next = rest->next;
        fail_job(rest, KVF_GRPC_UNAVAILABLE, "the control plane is shutting down");
        rest = next;
    }
}

void kvf_svc_destroy(struct kvf_svc *svc)
{
    if (!svc) {
        return;
    }
    kvf_svc_stop(svc);
    kvf_svc_metrics_destroy(svc->ctx.metrics);
    svc->ctx.metrics = NULL;
    kvf_reflection_destroy(svc->refl);
    kvf_svc_persist_close(&svc->ctx);
    while (svc->held_head) { /* effects and reads whose records never became durable */
        struct fx_batch *b = svc->held_head;
        svc->held_head = b->next;
        drop_batch(b, KVF_GRPC_UNAVAILABLE, "the control plane is shutting down");
    }
    kvf_health_destroy(svc->health);
    kvf_svc_sessions_destroy(svc->ctx.sessions);
    kvf_cps_destroy(svc->ctx.cps);
    free(svc->bindings);
    for (int i = 0; i < 3; i++)
        free(svc->authz_strs[i]);
    pthread_cond_destroy(&svc->cv);
    pthread_mutex_destroy(&svc->mu);
    free(svc);
}
