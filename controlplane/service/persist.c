/*
 * persist.c: the control plane's durability, on the store of
 * controlplane/store/ (the embedded write-ahead log by default).
 *
 * The state core is deterministic: given the same inputs, the same `now`
 * values and the same random bytes, it reaches the same state. So the log
 * holds the inputs, not the state: every command that may change the core (a
 * mutating RPC with its request, a node-session message, a session end, a
 * timer tick) becomes one record with the `now` it ran at and the random bytes
 * the core drew while running it (abort tokens, re-send jitter). Recovery
 * restores the newest snapshot (a kvf_cps_snapshot() image) and replays the
 * records after it through the same code, feeding the recorded random bytes
 * back, so every room, lease, token and pending notice comes back exactly, and
 * re-sent notices carry the same tokens (docs/design.md §2.9).
 *
 * An RPC that changed state answers only once its record is durable: the
 * reply is held and sent from the store's completion callback. The effects of
 * a command (notices, releases) are held by the state thread until then too
 * (service.c, drain_effects), and so are the replies of reads.
 *
 * Only accepted changes are logged: a command the core refused (an error
 * reply, no effect emitted, no random byte drawn) changed nothing, and its
 * request never reaches the log (service.c, run_unary).
 *
 * Fail-stop: once an append is refused or a record fails to become durable
 * (disk full, I/O error), the state in memory is ahead of the log and no
 * later change may be acknowledged. persist_fail() records the first
 * failure, logs what the operator must do, and calls the service's fail
 * hook (health NOT_SERVING, every later job refused, the process exits with
 * status 3 so that its supervisor restarts it on the intact log). The
 * failed change itself is answered UNAVAILABLE; after the restart it is
 * there only if its record reached the disk.
 *
 * Time: the service's clock is CLOCK_MONOTONIC plus an offset chosen at start
 * so that it continues from the last recorded `now` (downtime counts as
 * zero: timers only ever escalate, so running them late is safe).
 *
 * Record layout (little-endian): u8 kind, u64 now, u32 random length + bytes,
 * u16 name length + bytes (method or node id), u64 incarnation, u32 payload
 * length + payload (a protobuf request or NodeMessage). Snapshot: "KVFSVC01",
 * u64 now, then the core's image.
 *
 * DESIGN: everything here runs on the state thread, except the completion
 * callbacks (the store's committer thread), which only send held replies.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rpc_server.h"
#include "service_internal.h"
#include "store.h"
#include "wal.h"

#define SNAPSHOT_MAGIC "KVFSVC01"

struct kvf_svc_persist {
    struct kvf_store *store;
    struct kvf_cps_opts opts;
    /* Random bytes of the command being run (recorded) or replayed (fed). */
    uint8_t *random;              /* grows with the command that draws the most */
    const uint8_t *replay_random; /* the record being replayed */
    size_t random_cap;
    size_t random_len, random_pos;
    bool replaying;
    bool overflow;
    kvf_time_ns last_now;
    uint64_t since_snapshot;
    uint64_t snapshot_every;      /* records between snapshots */
    uint64_t last_seq;            /* the last record appended (state thread) */
    _Atomic uint64_t durable_seq; /* every record up to it is durable (committer writes) */
    void (*wake)(void *arg);      /* tells the state thread that durable_seq moved */
    void *wake_arg;
    _Atomic int failed;                 /* 0, or the first append's failure (negative errno) */
    void (*on_fail)(void *arg, int rc); /* the service's fail-stop hook (any thread) */
    void *fail_arg;
    char *data_dir;
};

/* The first failure stops everything: log it once and call the hook. Any
 * thread (state thread or the store's committer). */
static void persist_fail(struct kvf_svc_persist *p, int rc)
{
    int none = 0;
    if (rc >= 0)
        rc = -EIO;
    if (!atomic_compare_exchange_strong(&p->failed, &none, rc))
        return;
    kvf_log("error",
            "the log in %s cannot be written (%s): no further change is acknowledged; "
            "kvfence-control stops with exit status %d: free space in (or repair) the file "
            "system of the data dir, then restart it",
            p->data_dir, strerror(-rc), KVF_SVC_EXIT_STORE_FAILED);
    if (p->on_fail != NULL)
        p->on_fail(p->fail_arg, rc);
}

int kvf_svc_persist_failure(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL ? atomic_load(&ctx->persist->failed) : 0;
}

void kvf_svc_persist_failure_msg(const struct kvf_svc_ctx *ctx, char *buf, size_t size)
{
    int rc = kvf_svc_persist_failure(ctx);
    snprintf(buf, size,
             "the control plane's log cannot be written (%s): this change is not acknowledged "
             "and kvfence-control stops; free space in its data dir (or repair its disk) and "
             "restart it",
             strerror(rc < 0 ? -rc : EIO));
}

/* ---- the random source ------------------------------------------------------ */

void kvf_svc_random(void *vctx, void *buf, size_t len)
{
    struct kvf_svc_ctx *ctx = vctx;
    struct kvf_svc_persist *p = ctx->persist;
    if (p != NULL && p->replaying) {
        if (p->random_pos + len > p->random_len) {
            /* The record has fewer bytes than the replay asks for: the code
             * changed between writing and reading the log. Continue with
             * fresh bytes, loudly. */
            kvf_log("error", "replay: a record holds fewer random bytes than it needs");
            kvf_svc_random_os(buf, len);
            return;
        }
        memcpy(buf, p->replay_random + p->random_pos, len);
        p->random_pos += len;
        return;
    }
    kvf_svc_random_os(buf, len);
    if (p != NULL) {
        /* A command may draw any number of bytes (a re-attach that re-sends a
         * thousand notices draws jitter for each): grow the buffer. */
        if (p->random_len + len > p->random_cap) {
            size_t cap = p->random_cap ? p->random_cap : 256;
            while (cap < p->random_len + len)
                cap *= 2;
            uint8_t *r = realloc(p->random, cap);
            if (r == NULL) {
                p->overflow = true;
                return;
            }
            p->random = r;
            p->random_cap = cap;
        }
        memcpy(p->random + p->random_len, buf, len);
        p->random_len += len;
    }
}

/* ---- records ---------------------------------------------------------------- */

struct rec {
    uint8_t kind;
    kvf_time_ns now;
    const uint8_t *random;
    size_t random_len;
    const char *name;
    size_t name_len;
    uint64_t incarnation;
    const uint8_t *payload;
    size_t payload_len;
};

static uint8_t *put(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        *p++ = (uint8_t)(v >> (8 * i));
    return p;
}

static uint64_t get(const uint8_t *p, int bytes)
{
    uint64_t v = 0;
    for (int i = 0; i < bytes; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int rec_decode(const uint8_t *b, size_t len, struct rec *r)
{
    size_t off = 0;
#define NEED(n)                      \
    do {                             \
        if (len - off < (size_t)(n)) \
            return -EBADMSG;         \
    } while (0)
    NEED(1 + 8 + 4);
    r->kind = b[off];
    r->now = get(b + off + 1, 8);
    r->random_len = get(b + off + 9, 4);
    off += 13;
    NEED(r->random_len + 2);
    r->random = b + off;
    off += r->random_len;
    r->name_len = get(b + off, 2);
    off += 2;
    NEED(r->name_len + 8 + 4);
    r->name = (const char *)b + off;
    off += r->name_len;
    r->incarnation = get(b + off, 8);
    r->payload_len = get(b + off + 8, 4);
    off += 12;
    NEED(r->payload_len);
    r->payload = b + off;
    off += r->payload_len;
#undef NEED
    return off == len ? 0 : -EBADMSG;
}

/* What waits for one record to be durable: the held reply of its RPC, if
 * any, and the effects the state thread holds back until then. */
struct held_reply {
    struct kvf_svc_persist *p;
    struct kvf_rpc_call *call; /* NULL: no reply to send */
    struct kvf_svc_reply_capture cap;
};

static void reply_when_durable(void *vctx, uint64_t seq, int status)
{
    struct held_reply *h = vctx;
    if (status != 0)
        persist_fail(h->p, status); /* health NOT_SERVING before the refusal goes out */
    if (h->call != NULL) {
        if (status != 0) {
            char msg[256];
            struct kvf_svc_ctx view = {.persist = h->p};
            kvf_svc_persist_failure_msg(&view, msg, sizeof(msg));
            kvf_rpc_call_fail(h->call, KVF_GRPC_UNAVAILABLE, msg);
        } else {
            kvf_svc_capture_send(h->call, &h->cap);
        }
    }
    kvf_svc_capture_free(&h->cap);
    /* Completions come in seq order. A failed store stops every later
     * append, so effects held behind a failed record are never released. */
    if (status == 0) {
        atomic_store(&h->p->durable_seq, seq);
        if (h->p->wake != NULL)
            h->p->wake(h->p->wake_arg);
    }
    free(h);
}

void kvf_svc_persist_set_wake(struct kvf_svc_ctx *ctx, void (*wake)(void *arg), void *arg)
{
    if (ctx->persist != NULL) {
        ctx->persist->wake = wake;
        ctx->persist->wake_arg = arg;
    }
}

bool kvf_svc_persist_drew_random(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL && ctx->persist->random_len > 0;
}

bool kvf_svc_persist_is_durable(const struct kvf_svc_ctx *ctx, uint64_t seq)
{
    return ctx->persist == NULL || atomic_load(&ctx->persist->durable_seq) >= seq;
}

uint64_t kvf_svc_persist_last_seq(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL ? ctx->persist->last_seq : 0;
}

bool kvf_svc_persist_enabled(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL && !ctx->persist->replaying;
}

void kvf_svc_persist_begin(struct kvf_svc_ctx *ctx)
{
    struct kvf_svc_persist *p = ctx->persist;
    if (p != NULL && !p->replaying) {
        p->random_len = 0;
        p->overflow = false;
    }
}

static int snapshot_write(void *vctx, const void *buf, size_t len)
{
    return kvf_store_sink_write(vctx, buf, len);
}

struct snap_ctx {
    struct kvf_svc_ctx *ctx;
    kvf_time_ns now;
};

static int snapshot_produce(void *vctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)seq;
    struct snap_ctx *sc = vctx;
    uint8_t head[16];
    memcpy(head, SNAPSHOT_MAGIC, 8);
    put(head + 8, sc->now, 8);
    int rc = kvf_store_sink_write(sink, head, sizeof(head));
    if (rc != 0)
        return rc;
    return kvf_cps_snapshot(sc->ctx->cps, sc->now, snapshot_write, sink);
}

static void maybe_snapshot(struct kvf_svc_ctx *ctx, kvf_time_ns now)
{
    struct kvf_svc_persist *p = ctx->persist;
    if (++p->since_snapshot < p->snapshot_every)
        return;
    p->since_snapshot = 0;
    struct snap_ctx sc = {ctx, now};
    struct kvf_error err;
    kvf_error_clear(&err);
    uint64_t seq;
    int rc =
        kvf_store_write_snapshot(p->store, KVF_STORE_SEQ_LAST, snapshot_produce, &sc, &seq, &err);
    if (rc != 0)
        kvf_log("error", "snapshot failed (the log keeps everything): %s", err.msg);
}

int kvf_svc_persist_commit(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                           const char *name, uint64_t incarnation, const uint8_t *payload,
                           size_t payload_len, struct kvf_rpc_call *call,
                           struct kvf_svc_reply_capture *cap)
{
    struct kvf_svc_persist *p = ctx->persist;
    size_t name_len = name != NULL ? strlen(name) : 0;
    int failed = atomic_load(&p->failed);
    if (failed != 0)
        return failed;
    if (p->overflow) {
        kvf_log("error", "out of memory recording a command's random bytes; it cannot be logged");
        persist_fail(p, -ENOMEM);
        return -ENOMEM;
    }
    size_t len = 1 + 8 + 4 + p->random_len + 2 + name_len + 8 + 4 + payload_len;
    uint8_t *b = malloc(len);
    struct held_reply *h = calloc(1, sizeof(*h));
    if (b == NULL || h == NULL) {
        free(b);
        free(h);
        persist_fail(p, -ENOMEM);
        return -ENOMEM;
    }
    uint8_t *q = b;
    *q++ = (uint8_t)kind;
    q = put(q, now, 8);
    q = put(q, p->random_len, 4);
    if (p->random_len > 0)
        memcpy(q, p->random, p->random_len); /* the buffer is NULL until first used */
    q += p->random_len;
    q = put(q, name_len, 2);
    if (name_len > 0)
        memcpy(q, name, name_len); /* name may be NULL (ticks, detach-all) */
    q += name_len;
    q = put(q, incarnation, 8);
    q = put(q, payload_len, 4);
    if (payload_len > 0)
        memcpy(q, payload, payload_len);
    h->p = p;
    if (call != NULL) {
        h->call = call;
        h->cap = *cap; /* the held reply now belongs to the callback */
        memset(cap, 0, sizeof(*cap));
    }
    uint64_t seq;
    int rc = kvf_store_append(p->store, b, len, reply_when_durable, h, &seq);
    free(b);
    if (rc != 0) {
        if (call != NULL)
            *cap = h->cap;
        free(h);
        kvf_log("error", "a change of %zu bytes cannot be appended to the log: %s", len,
                strerror(-rc));
        persist_fail(p, rc);
        return rc;
    }
    p->last_seq = seq;
    p->last_now = now;
    maybe_snapshot(ctx, now);
    return 0;
}

/* ---- recovery ---------------------------------------------------------------- */

static int on_snapshot(void *vctx, const void *bytes, size_t len, uint64_t seq)
{
    struct kvf_svc_ctx *ctx = vctx;
    const uint8_t *b = bytes;
    if (len < 16 || memcmp(b, SNAPSHOT_MAGIC, 8) != 0) {
        kvf_log("error", "snapshot %" PRIu64 ": not a kvfence-control snapshot", seq);
        return -EBADMSG;
    }
    kvf_time_ns now = get(b + 8, 8);
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_cps *cps = kvf_cps_restore(&ctx->persist->opts, b + 16, len - 16, now, &err);
    if (cps == NULL) {
        kvf_log("error", "snapshot %" PRIu64 " does not restore: %s", seq, err.msg);
        return err.code != 0 ? err.code : -EBADMSG;
    }
    kvf_cps_destroy(ctx->cps);
    ctx->cps = cps;
    ctx->persist->last_now = now;
    return 0;
}

static int on_record(void *vctx, uint64_t seq, const void *bytes, size_t len)
{
    struct kvf_svc_ctx *ctx = vctx;
    struct kvf_svc_persist *p = ctx->persist;
    struct rec r;
    if (rec_decode(bytes, len, &r) != 0) {
        kvf_log("error", "record %" PRIu64 ": malformed", seq);
        return -EBADMSG;
    }
    p->replay_random = r.random;
    p->random_len = r.random_len;
    p->random_pos = 0;
    char name[256];
    snprintf(name, sizeof(name), "%.*s", (int)r.name_len, r.name);
    int rc = kvf_svc_replay(ctx, (enum kvf_svc_rec_kind)r.kind, r.now, name, r.incarnation,
                            r.payload, r.payload_len);
    size_t n;
    kvf_cps_effects_take(ctx->cps, &n); /* nobody to tell during replay */
    if (rc != 0) {
        kvf_log("error", "record %" PRIu64 ": cannot be replayed (kind %u, %s)", seq, r.kind, name);
        return rc;
    }
    if (r.now > p->last_now)
        p->last_now = r.now;
    return 0;
}

static void store_log(void *vctx, enum kvf_store_log_level level, const char *msg)
{
    (void)vctx;
    kvf_log(level == KVF_STORE_LOG_ERROR  ? "error"
            : level == KVF_STORE_LOG_WARN ? "warn"
                                          : "info",
            "store: %s", msg);
}

struct detach_ctx {
    struct kvf_svc_ctx *ctx;
    kvf_time_ns now;
};

static int detach_node(void *vctx, const struct kvf_cps_node_view *v)
{
    struct detach_ctx *dc = vctx;
    if (v->state == KVF_CPS_NODE_ATTACHED)
        kvf_cps_node_detach(dc->ctx->cps, v->node_id, v->incarnation, dc->now, NULL);
    return 0;
}

void kvf_svc_detach_all(struct kvf_svc_ctx *ctx, kvf_time_ns now)
{
    struct detach_ctx dc = {ctx, now};
    kvf_cps_node_foreach(ctx->cps, detach_node, &dc);
}

int kvf_svc_persist_open(struct kvf_svc_ctx *ctx, const char *data_dir, uint64_t snapshot_every,
                         const struct kvf_cps_opts *opts, void (*on_fail)(void *arg, int rc),
                         void *fail_arg, struct kvf_error *err)
{
    struct kvf_svc_persist *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    p->opts = *opts;
    p->on_fail = on_fail;
    p->fail_arg = fail_arg;
    p->data_dir = strdup(data_dir);
    if (p->data_dir == NULL) {
        free(p);
        return kvf_error_set(err, -ENOMEM, "out of memory");
    }
    p->snapshot_every = snapshot_every > 0 ? snapshot_every : 4096;
    struct kvf_store_wal_opts wo;
    kvf_store_wal_opts_init(&wo);
    wo.data_dir = data_dir;
    wo.log_fn = store_log;
    p->store = kvf_store_wal_create(&wo);
    if (p->store == NULL) {
        free(p->data_dir);
        free(p);
        return kvf_error_set(err, -EINVAL, "data-dir %s: cannot create the store", data_dir);
    }
    ctx->persist = p;
    p->replaying = true;
    struct kvf_store_recovery info;
    int rc = kvf_store_recover(p->store, on_snapshot, on_record, ctx, &info, err);
    p->replaying = false;
    p->random_len = 0;
    if (rc != 0) {
        kvf_svc_persist_close(ctx);
        return rc;
    }
    if (info.new_cluster)
        kvf_log("info", "data-dir %s holds no state: this is a new cluster", data_dir);
    else
        ctx->recovered = true; /* node_svc.c asks every node that attaches for a Resync */
    if (!info.new_cluster)
        kvf_log("info",
                "recovered from %s: snapshot seq %" PRIu64 ", %" PRIu64
                " records replayed, in %.1f ms",
                data_dir, info.snapshot_seq, info.records, (double)info.elapsed_ns / 1e6);
    /* No node session survives a restart: every attached node is SUSPECT now
     * (its ttl runs from here) until it re-attaches. This is a command too. */
    kvf_svc_persist_begin(ctx);
    kvf_svc_detach_all(ctx, p->last_now);
    size_t n;
    kvf_cps_effects_take(ctx->cps, &n);
    return kvf_svc_persist_commit(ctx, KVF_SVC_REC_DETACH_ALL, p->last_now, NULL, 0, NULL, 0, NULL,
                                  NULL);
}

kvf_time_ns kvf_svc_persist_last_now(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL ? ctx->persist->last_now : 0;
}

struct kvf_store *kvf_svc_persist_store(const struct kvf_svc_ctx *ctx)
{
    return ctx->persist != NULL ? ctx->persist->store : NULL;
}

void kvf_svc_persist_close(struct kvf_svc_ctx *ctx)
{
    struct kvf_svc_persist *p = ctx->persist;
    if (p == NULL)
        return;
    kvf_store_destroy(p->store); /* makes every queued record durable first */
    free(p->random);
    free(p->data_dir);
    free(p);
    ctx->persist = NULL;
}

/* ---- --repair-wal --------------------------------------------------------------- */

int kvf_svc_repair_wal(const char *data_dir)
{
    struct kvf_store_wal_opts wo;
    kvf_store_wal_opts_init(&wo);
    wo.data_dir = data_dir;
    wo.log_fn = store_log;
    wo.repair = true;
    struct kvf_store *store = kvf_store_wal_create(&wo);
    if (store == NULL)
        return -EINVAL;
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_store_recovery info;
    /* No consumer: the log is checked record by record (CRC, seq chain,
     * files), not replayed; the next start replays it. */
    int rc = kvf_store_recover(store, NULL, NULL, NULL, &info, &err);
    if (rc != 0) {
        kvf_log("error", "repair of %s failed: %s", data_dir, err.msg[0] ? err.msg : strerror(-rc));
        fprintf(stdout, "kvfence-control: repair of %s failed: %s\n", data_dir,
                err.msg[0] ? err.msg : strerror(-rc));
    } else if (info.repaired) {
        if (info.repair_dropped_unknown)
            fprintf(stdout,
                    "kvfence-control: repaired %s: %s; dropped at least %" PRIu64
                    " records: a deleted file held every record from seq %" PRIu64
                    " on, how many nothing on disk says (the log now ends before seq %" PRIu64
                    ")\n",
                    data_dir, info.repair_what, info.repair_dropped, info.repair_lost_from,
                    info.next_seq);
        else
            fprintf(stdout,
                    "kvfence-control: repaired %s: %s; dropped %" PRIu64
                    " records (the log now ends before seq %" PRIu64 ")\n",
                    data_dir, info.repair_what, info.repair_dropped, info.next_seq);
        if (info.repair_backup[0])
            fprintf(stdout, "kvfence-control: the files as they were are in %s/%s\n", data_dir,
                    info.repair_backup);
    } else {
        fprintf(stdout,
                "kvfence-control: the log in %s is intact%s; dropped 0 records; nothing "
                "repaired\n",
                data_dir, info.tail_cut ? " (a torn tail of unacknowledged records was cut)" : "");
    }
    kvf_store_destroy(store);
    return rc;
}
