/*
 * svc_metrics.c: kvfence-control's Prometheus metrics (docs/metrics.md lists
 * every one). The service owns one registry (common/metrics/metrics.h); main.c
 * serves it over HTTP (http.h).
 *
 * Where each metric comes from, and on which thread:
 *
 *   - RPC counts and latencies: the kvf_rpc server's call observer
 *     (kvf_svc_metrics_rpc_done), on CQ threads; registered families updated
 *     with the registry's lock-free hot path.
 *   - The state core's gauges and counters (rooms, leases and nodes by state,
 *     notices, rejected reports, fences, generation): the core belongs to the
 *     state thread and is never read from the HTTP thread. The state thread
 *     copies struct kvf_cps_stats (O(1), one struct copy) into `snap` under
 *     `mu` after every job and tick (kvf_svc_metrics_publish); the collector,
 *     on the HTTP thread, reads only that copy.
 *   - kvfence_abort_to_released_seconds: the state thread watches the core's
 *     ROOM_STATE effects. When a room enters ABORTING it remembers the core's
 *     state_since for that room-generation (a small hash map keyed by room
 *     key); when the room goes ABORTING -> ABORTED it observes the ABORTED
 *     state_since minus that, and forgets the room. Both times are the core's
 *     service time, so the latency is the core's own view. Rooms already
 *     ABORTING at start-up (recovered from the data dir) are seeded from the
 *     core in kvf_svc_metrics_create.
 *   - WAL: kvf_store_stats() is documented as readable from any thread, so the
 *     collector calls it directly. The metrics writer has no histogram-shaped
 *     families, so the store's own fsync-latency buckets are published as a
 *     cumulative counter family kvfence_wal_fsync_latency_bucket{le=...} plus
 *     kvfence_wal_fsync_latency_count (histogram_quantile() works on them);
 *     there is no _sum because the store keeps none.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics.h"
#include "rpc_server.h"
#include "service_internal.h"
#include "store.h"

/* 50 µs .. 5 s */
static const double rpc_bounds[] = {50e-6, 100e-6, 250e-6, 500e-6, 1e-3,   2.5e-3, 5e-3, 10e-3,
                                    25e-3, 50e-3,  100e-3, 250e-3, 500e-3, 1.0,    2.5,  5.0};
/* 100 µs .. 60 s */
static const double abort_bounds[] = {100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3,
                                      10e-3,  25e-3,  50e-3,  0.1,  0.25,   0.5,
                                      1.0,    2.5,    5.0,    10.0, 30.0,   60.0};

/* One room-generation that is ABORTING, and since when (service time). */
struct aborting_slot {
    kvf_room_key key;
    kvf_time_ns since;
    bool used;
};

struct kvf_svc_metrics {
    struct kvf_metrics *reg;
    struct kvf_metric_vec *rpc_requests; /* {method, code} */
    struct kvf_metric_vec *rpc_latency;  /* {method} */
    struct kvf_metric *abort_to_released;
    struct kvf_store *store; /* NULL: memory only; outlives the registry's use */
    bool collector_added;

    pthread_mutex_t mu;        /* guards snap */
    struct kvf_cps_stats snap; /* the core's stats as of the last job or tick */

    /* State thread only: rooms now ABORTING (open addressing, linear probing,
     * backward-shift deletion; at most half full). */
    struct aborting_slot *slots;
    size_t n_slots; /* a power of two */
    size_t n_used;
};

/* ---- the ABORTING map (state thread) ------------------------------------- */

static size_t key_hash(kvf_room_key k)
{
    uint64_t x = k.room_id * 0x9E3779B97F4A7C15ull ^ k.generation;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (size_t)x;
}

static struct aborting_slot *map_find(struct kvf_svc_metrics *m, kvf_room_key key)
{
    if (m->n_slots == 0)
        return NULL;
    size_t mask = m->n_slots - 1;
    for (size_t i = key_hash(key) & mask;; i = (i + 1) & mask) {
        struct aborting_slot *s = &m->slots[i];
        if (!s->used)
            return NULL;
        if (kvf_room_key_eq(s->key, key))
            return s;
    }
}

static int map_grow(struct kvf_svc_metrics *m)
{
    size_t n = m->n_slots ? m->n_slots * 2 : 64;
    struct aborting_slot *slots = calloc(n, sizeof(*slots));
    if (!slots)
        return -ENOMEM;
    for (size_t j = 0; j < m->n_slots; j++) {
        if (!m->slots[j].used)
            continue;
        size_t i = key_hash(m->slots[j].key) & (n - 1);
        while (slots[i].used)
            i = (i + 1) & (n - 1);
        slots[i] = m->slots[j];
    }
    free(m->slots);
    m->slots = slots;
    m->n_slots = n;
    return 0;
}

static void map_put(struct kvf_svc_metrics *m, kvf_room_key key, kvf_time_ns since)
{
    struct aborting_slot *s = map_find(m, key);
    if (s) {
        s->since = since;
        return;
    }
    if ((m->n_used + 1) * 2 > m->n_slots && map_grow(m) < 0)
        return; /* out of memory: this room's latency is not observed */
    size_t mask = m->n_slots - 1;
    size_t i = key_hash(key) & mask;
    while (m->slots[i].used)
        i = (i + 1) & mask;
    m->slots[i] = (struct aborting_slot){.key = key, .since = since, .used = true};
    m->n_used++;
}

static void map_remove(struct kvf_svc_metrics *m, struct aborting_slot *s)
{
    size_t mask = m->n_slots - 1;
    size_t hole = (size_t)(s - m->slots);
    m->slots[hole].used = false;
    m->n_used--;
    /* Backward shift: move later entries of the run into the hole when their
     * home slot is not between the hole and them. */
    for (size_t i = (hole + 1) & mask; m->slots[i].used; i = (i + 1) & mask) {
        size_t home = key_hash(m->slots[i].key) & mask;
        bool stays = hole <= i ? (hole < home && home <= i) : (hole < home || home <= i);
        if (stays)
            continue;
        m->slots[hole] = m->slots[i];
        m->slots[i].used = false;
        hole = i;
    }
}

static int seed_aborting(void *ctx, const struct kvf_cps_room_view *v)
{
    if (v->state == KVF_CPS_ROOM_ABORTING)
        map_put(ctx, v->key, v->state_since);
    return 0;
}

/* ---- the collector (HTTP thread) ------------------------------------------- */

static void write_by_state(struct kvf_metrics_writer *w, const char *name, const char *help,
                           const uint64_t *counts, int first, int last,
                           const char *(*state_name)(int))
{
    for (int s = first; s <= last; s++) {
        const char *labels[] = {"state", state_name(s), NULL};
        kvf_metrics_write_gauge(w, name, help, labels, (double)counts[s]);
    }
}

static const char *room_state_name(int s)
{
    return kvf_cps_room_state_name((enum kvf_cps_room_state)s);
}

static const char *lease_state_name(int s)
{
    return kvf_cps_lease_state_name((enum kvf_cps_lease_state)s);
}

static const char *node_state_name(int s)
{
    return kvf_cps_node_state_name((enum kvf_cps_node_state)s);
}

static void collect_store(struct kvf_store *store, struct kvf_metrics_writer *w)
{
    struct kvf_store_stats st;
    memset(&st, 0, sizeof(st));
    kvf_store_stats(store, &st);
    kvf_metrics_write_counter(w, "kvfence_wal_records_total", "Records made durable in the WAL.",
                              NULL, (double)st.records);
    kvf_metrics_write_counter(w, "kvfence_wal_bytes_total",
                              "Bytes written to the WAL, record headers included.", NULL,
                              (double)st.bytes);
    kvf_metrics_write_counter(w, "kvfence_wal_commits_total",
                              "Group commits (write and sync of one batch of records).", NULL,
                              (double)st.commits);
    kvf_metrics_write_counter(w, "kvfence_wal_fsyncs_total",
                              "Syncs that made WAL records durable (0 in a no-sync mode).", NULL,
                              (double)st.fsyncs);
    kvf_metrics_write_gauge(w, "kvfence_wal_last_fsync_seconds",
                            "Latency of the last group commit's final sync.", NULL,
                            (double)st.last_fsync_ns / 1e9);
    /* The store's buckets: bucket i counts commits that took < 2^(i+4) µs, the
     * last one the rest. Published cumulatively, Prometheus style. */
    static const char help_bucket[] =
        "Group commits whose final sync took less than le seconds (cumulative; the "
        "store's power-of-two buckets from 16 us).";
    uint64_t cum = 0;
    for (int i = 0; i < KVF_STORE_LAT_BUCKETS; i++) {
        cum += st.fsync_lat_us[i];
        char le[32];
        if (i == KVF_STORE_LAT_BUCKETS - 1) {
            snprintf(le, sizeof(le), "+Inf");
        } else {
            /* 2^(i+4) µs, exactly, in seconds ("0.000016", "1.048576"). */
            uint64_t us = 1ull << (i + 4);
            int n =
                snprintf(le, sizeof(le), "%" PRIu64 ".%06" PRIu64, us / 1000000u, us % 1000000u);
            while (n > 0 && le[n - 1] == '0')
                le[--n] = '\0';
            if (n > 0 && le[n - 1] == '.')
                le[--n] = '\0';
        }
        const char *labels[] = {"le", le, NULL};
        kvf_metrics_write_counter(w, "kvfence_wal_fsync_latency_bucket", help_bucket, labels,
                                  (double)cum);
    }
    kvf_metrics_write_counter(w, "kvfence_wal_fsync_latency_count",
                              "Group commits counted in kvfence_wal_fsync_latency_bucket.", NULL,
                              (double)cum);
    kvf_metrics_write_gauge(w, "kvfence_wal_queued_records",
                            "Records appended to the WAL and not yet durable.", NULL,
                            (double)st.queued);
    kvf_metrics_write_gauge(w, "kvfence_wal_durable_seq",
                            "Every WAL record up to this sequence number is durable.", NULL,
                            (double)st.durable_seq);
    kvf_metrics_write_counter(w, "kvfence_wal_snapshots_total",
                              "Snapshots written since the store was opened.", NULL,
                              (double)st.snapshots);
    kvf_metrics_write_gauge(w, "kvfence_wal_snapshot_seq",
                            "Sequence number covered by the newest snapshot (0: none).", NULL,
                            (double)st.snapshot_seq);
    kvf_metrics_write_gauge(w, "kvfence_wal_segments", "Live WAL segment files.", NULL,
                            (double)st.segments);
    kvf_metrics_write_gauge(w, "kvfence_wal_failed",
                            "1 when the store has failed and refuses appends (restart needed).",
                            NULL, st.failed ? 1.0 : 0.0);
}

static void collect(void *ctx, struct kvf_metrics_writer *w)
{
    struct kvf_svc_metrics *m = ctx;
    struct kvf_cps_stats s;
    pthread_mutex_lock(&m->mu);
    s = m->snap;
    pthread_mutex_unlock(&m->mu);

    write_by_state(w, "kvfence_rooms",
                   "Room-generations by state (terminal ones count until their tombstone "
                   "expires).",
                   s.rooms_by_state, KVF_CPS_ROOM_OPENING, KVF_CPS_ROOM_ABORTED, room_state_name);
    write_by_state(w, "kvfence_leases", "Leases by state.", s.leases_by_state, KVF_CPS_LEASE_ACTIVE,
                   KVF_CPS_LEASE_RELEASED, lease_state_name);
    write_by_state(w, "kvfence_nodes", "Node incarnations by state.", s.nodes_by_state,
                   KVF_CPS_NODE_ATTACHED, KVF_CPS_NODE_LOST, node_state_name);
    kvf_metrics_write_gauge(w, "kvfence_notices_pending",
                            "Abort notices and fence requests not yet acknowledged.", NULL,
                            (double)s.notices_pending);
    kvf_metrics_write_gauge(w, "kvfence_rooms_past_drain_deadline",
                            "ABORTING rooms past their drain deadline.", NULL,
                            (double)s.rooms_past_deadline);
    kvf_metrics_write_counter(w, "kvfence_notices_sent_total",
                              "Abort notices and fence requests sent for the first time.", NULL,
                              (double)s.notices_sent);
    kvf_metrics_write_counter(w, "kvfence_notices_resent_total",
                              "Abort notices and fence requests sent again (not acknowledged "
                              "in time).",
                              NULL, (double)s.notices_resent);
    static const char help_rej[] =
        "Node reports refused: stale (old generation, token or incarnation), tokenless, or "
        "unknown (room or node).";
    const char *stale[] = {"reason", "stale", NULL};
    const char *tokenless[] = {"reason", "tokenless", NULL};
    const char *unknown[] = {"reason", "unknown", NULL};
    kvf_metrics_write_counter(w, "kvfence_reports_rejected_total", help_rej, stale,
                              (double)s.reports_stale);
    kvf_metrics_write_counter(w, "kvfence_reports_rejected_total", help_rej, tokenless,
                              (double)s.reports_tokenless);
    kvf_metrics_write_counter(w, "kvfence_reports_rejected_total", help_rej, unknown,
                              (double)s.reports_unknown);
    kvf_metrics_write_counter(w, "kvfence_late_messages_total",
                              "Node messages that arrived too late to count: reports refused as "
                              "stale or unknown (the sum of those two reasons).",
                              NULL, (double)(s.reports_stale + s.reports_unknown));
    kvf_metrics_write_counter(w, "kvfence_fences_requested_total",
                              "Fence requests issued to nodes (one per peer asked to fence a "
                              "node).",
                              NULL, (double)s.fences_requested);
    kvf_metrics_write_gauge(w, "kvfence_generation", "The last room generation minted.", NULL,
                            (double)s.generation);
    if (m->store)
        collect_store(m->store, w);
}

/* ---- life cycle ---------------------------------------------------------------- */

struct kvf_svc_metrics *kvf_svc_metrics_create(struct kvf_svc_ctx *ctx, struct kvf_store *store)
{
    struct kvf_svc_metrics *m = calloc(1, sizeof(*m));
    if (!m)
        return NULL;
    pthread_mutex_init(&m->mu, NULL);
    m->store = store;
    m->reg = kvf_metrics_create(NULL);
    if (!m->reg)
        goto fail;
    static const char *const method_code[] = {"method", "code", NULL};
    static const char *const method_only[] = {"method", NULL};
    if (kvf_metrics_counter_vec(m->reg, "kvfence_rpc_requests_total",
                                "gRPC calls and streams finished, by method and status code "
                                "(method=\"unknown\" for methods not served).",
                                method_code, &m->rpc_requests) < 0 ||
        kvf_metrics_histogram_vec(m->reg, "kvfence_rpc_latency_seconds",
                                  "Time from a call's arrival to its end (reply sent, or the "
                                  "call cancelled), by method.",
                                  method_only, rpc_bounds, sizeof(rpc_bounds) / sizeof(*rpc_bounds),
                                  &m->rpc_latency) < 0 ||
        kvf_metrics_histogram(m->reg, "kvfence_abort_to_released_seconds",
                              "Time a room-generation spent ABORTING before it was ABORTED "
                              "(every lease released), in the core's service time.",
                              abort_bounds, sizeof(abort_bounds) / sizeof(*abort_bounds),
                              &m->abort_to_released) < 0)
        goto fail;
    if (kvf_metrics_add_collector(m->reg, collect, m) < 0)
        goto fail;
    m->collector_added = true;
    /* Still single-threaded (the state thread has not started). */
    if (ctx->cps) {
        kvf_cps_room_foreach(ctx->cps, seed_aborting, m);
        kvf_svc_metrics_publish(m, ctx);
    }
    return m;
fail:
    kvf_svc_metrics_destroy(m);
    return NULL;
}

void kvf_svc_metrics_destroy(struct kvf_svc_metrics *m)
{
    if (!m)
        return;
    if (m->collector_added)
        kvf_metrics_remove_collector(m->reg, collect, m);
    kvf_metrics_destroy(m->reg);
    free(m->slots);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

struct kvf_metrics *kvf_svc_metrics_registry(struct kvf_svc_metrics *m)
{
    return m ? m->reg : NULL;
}

/* ---- feeds ---------------------------------------------------------------------- */

void kvf_svc_metrics_publish(struct kvf_svc_metrics *m, const struct kvf_svc_ctx *ctx)
{
    if (!m || !ctx->cps)
        return;
    struct kvf_cps_stats s;
    kvf_cps_stats_get(ctx->cps, &s);
    pthread_mutex_lock(&m->mu);
    m->snap = s;
    pthread_mutex_unlock(&m->mu);
}

void kvf_svc_metrics_effect(struct kvf_svc_metrics *m, const struct kvf_svc_ctx *ctx,
                            const struct kvf_cps_effect *e)
{
    if (!m || e->kind != KVF_CPS_FX_ROOM_STATE)
        return;
    if (e->new_state == KVF_CPS_ROOM_ABORTING) {
        /* The view may already be past ABORTING when several transitions come
         * in one batch; they all happened at the same `now` then. */
        struct kvf_cps_room_view v;
        if (kvf_cps_room_get(ctx->cps, e->key, &v) == 0)
            map_put(m, e->key, v.state_since);
        return;
    }
    if (e->old_state != KVF_CPS_ROOM_ABORTING)
        return;
    struct aborting_slot *s = map_find(m, e->key);
    if (!s)
        return; /* not seen entering ABORTING (out of memory at the time) */
    kvf_time_ns since = s->since;
    map_remove(m, s);
    struct kvf_cps_room_view v;
    if (e->new_state != KVF_CPS_ROOM_ABORTED || kvf_cps_room_get(ctx->cps, e->key, &v) != 0)
        return;
    kvf_time_ns end = v.state_since;
    kvf_histogram_observe(m->abort_to_released, end > since ? (double)(end - since) / 1e9 : 0.0);
}

void kvf_svc_metrics_rpc_done(void *ctx, const char *method, int grpc_code, uint64_t latency_ns)
{
    struct kvf_svc_metrics *m = ctx;
    const char *code = kvf_grpc_code_name((enum kvf_grpc_code)grpc_code);
    const char *mc[] = {method, code ? code : "UNKNOWN"};
    const char *mo[] = {method};
    /* The label sets are bounded (registered methods + "unknown", 17 codes);
     * the lookups take the registry's mutex, a short hash probe. */
    struct kvf_metric *req = NULL, *lat = NULL;
    if (kvf_metric_child(m->rpc_requests, mc, &req) == 0)
        kvf_counter_inc(req);
    if (kvf_metric_child(m->rpc_latency, mo, &lat) == 0)
        kvf_histogram_observe(lat, (double)latency_ns / 1e9);
}
