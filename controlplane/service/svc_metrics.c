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
 *     ROOM_STATE effects: an ABORTING -> ABORTED effect carries when the room
 *     entered ABORTING and when it left it (the core's service time, so the
 *     latency is the core's own view; a room recovered from the data dir
 *     ABORTING keeps its recovered time), and is observed as is.
 *   - WAL: kvf_store_stats() is documented as readable from any thread, so the
 *     collector calls it directly. The store keeps its own fsync-latency
 *     buckets; they are published as the histogram
 *     kvfence_wal_fsync_latency_seconds (kvf_metrics_write_histogram: _bucket
 *     with cumulative counts, _count), without _sum because the store keeps
 *     none.
 *   - kvfence_build_info and process_*: common/metrics/process.h.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_version.h"
#include "metrics.h"
#include "process.h"
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
struct kvf_svc_metrics {
    struct kvf_metrics *reg;
    struct kvf_metric_vec *rpc_requests; /* {method, code} */
    struct kvf_metric_vec *rpc_latency;  /* {method} */
    struct kvf_metric *abort_to_released;
    struct kvf_store *store; /* NULL: memory only; outlives the registry's use */
    bool collector_added;

    pthread_mutex_t mu;        /* guards snap */
    struct kvf_cps_stats snap; /* the core's stats as of the last job or tick */
};

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
     * last one the rest: bounds 2^(i+4) µs in seconds, exact in binary
     * (16e-6 is not, but 2^(i+4) / 1e6 prints as "1.6e-05" all the same). */
    double bounds[KVF_STORE_LAT_BUCKETS - 1];
    uint64_t cum[KVF_STORE_LAT_BUCKETS - 1];
    uint64_t total = 0;
    for (int i = 0; i < KVF_STORE_LAT_BUCKETS; i++) {
        total += st.fsync_lat_us[i];
        if (i < KVF_STORE_LAT_BUCKETS - 1) {
            bounds[i] = (double)(1ull << (i + 4)) / 1e6;
            cum[i] = total;
        }
    }
    kvf_metrics_write_histogram(w, "kvfence_wal_fsync_latency_seconds",
                                "Final sync latency of each WAL group commit (the store's "
                                "power-of-two buckets from 16 us; no _sum: the store keeps none).",
                                NULL, bounds, cum, KVF_STORE_LAT_BUCKETS - 1, total, NAN);
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
    kvf_metrics_write_gauge(w, "kvfence_leases_awaiting_host_proof",
                            "RELEASING leases of ended rooms that wait for a proof from their "
                            "lost node's host (its Drained, or its death witnessed there). No "
                            "timer ends the wait: kill the frozen kvfence-node (deploy/README.md).",
                            NULL, (double)s.leases_awaiting_host_proof);
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
    if (kvf_metrics_process_add(m->reg, KVF_VERSION_STRING) < 0)
        goto fail;
    if (kvf_metrics_add_collector(m->reg, collect, m) < 0)
        goto fail;
    m->collector_added = true;
    /* Still single-threaded (the state thread has not started). */
    if (ctx->cps)
        kvf_svc_metrics_publish(m, ctx);
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
    (void)ctx;
    if (!m || e->kind != KVF_CPS_FX_ROOM_STATE || e->old_state != KVF_CPS_ROOM_ABORTING ||
        e->new_state != KVF_CPS_ROOM_ABORTED)
        return;
    kvf_histogram_observe(m->abort_to_released,
                          e->since > e->old_since ? (double)(e->since - e->old_since) / 1e9 : 0.0);
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
