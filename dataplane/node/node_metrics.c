/*
 * node_metrics.c: kvfence-node's metrics registry and its hooks
 * (node_metrics.h; the families are listed in docs/metrics.md).
 *
 * Each family is registered at create and every child the node will use is
 * looked up then: transports tcp, rdma and local (x sent and received), the
 * refusal reasons, the chunk outcomes. Rooms by state come from a collector
 * that asks the owner (node_metrics.h). The hooks index those
 * handles by a small table lookup and do one atomic update; a transport or
 * state value the table does not know is ignored rather than trusted as an
 * index.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvf_log.h"
#include "kvfence/v1/types.pb-c.h"
#include "metrics.h"
#include "node_metrics.h"
#include "process.h"

enum { XP_TCP, XP_RDMA, XP_LOCAL, XP_COUNT };
enum { DIR_SENT, DIR_RECEIVED, DIR_COUNT };
enum fam_type { FAM_COUNTER, FAM_GAUGE, FAM_HISTOGRAM };

static const char *const xp_names[XP_COUNT] = {"tcp", "rdma", "local"};
static const char *const dir_names[DIR_COUNT] = {"sent", "received"};
static const char *const room_state_names[NODE_ROOM_STATES] = {
    [NODE_ROOM_OPENING] = "OPENING",   [NODE_ROOM_ACTIVE] = "ACTIVE",
    [NODE_ROOM_ABORTING] = "ABORTING", [NODE_ROOM_CLOSED] = "CLOSED",
    [NODE_ROOM_DRAINED] = "DRAINED",   [NODE_ROOM_QUARANTINED] = "QUARANTINED",
};
static const char *const refusal_names[NODE_REFUSED_REASONS] = {
    [NODE_REFUSED_UNKNOWN_ROOM] = "unknown_room",
    [NODE_REFUSED_NOT_SOURCE] = "not_source",
    [NODE_REFUSED_OUTSIDE_LEASE] = "outside_lease",
    [NODE_REFUSED_RDMA_NOTICE] = "rdma_notice",
};

/* 10 µs .. 10 s */
static const double chunk_bounds[] = {10e-6,  25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3,
                                      2.5e-3, 5e-3,  10e-3, 25e-3,  50e-3,  100e-3, 250e-3,
                                      500e-3, 1.0,   2.5,   5.0,    10.0};

struct node_metrics {
    struct kvf_metrics *reg;
    struct kvf_metric *bytes[XP_COUNT][DIR_COUNT];
    struct kvf_metric *frames[XP_COUNT][DIR_COUNT];
    struct kvf_metric *in_flight[XP_COUNT];
    struct kvf_metric *latency[XP_COUNT];
    struct kvf_metric *chunks[XP_COUNT][2]; /* [ok] */
    struct kvf_metric *refused[NODE_REFUSED_REASONS];
    struct kvf_metric *late;
    struct kvf_metric *peers_fenced;
    struct kvf_metric *self_fences;
    struct kvf_metric *pools;
    struct kvf_metric *session;
    /* The rooms collector (HTTP thread only: renders are serialised). */
    node_metrics_rooms_fn rooms_fn;
    void *rooms_ctx;
    uint64_t rooms_last[NODE_ROOM_STATES];
    bool collector_added;
};

/* A TransportKind's index, or -1. */
static int xp_index(int transport)
{
    switch (transport) {
    case KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP:
        return XP_TCP;
    case KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA:
        return XP_RDMA;
    case KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_LOCAL:
        return XP_LOCAL;
    default:
        return -1;
    }
}

/* One metric family of the node: its type, name and help, its label names
 * (NULL-terminated; NULL: none), `rows` rows of `nlabels` label values, and
 * where the child of each row goes (out[row]). */
struct family_row {
    enum fam_type type;
    const char *name, *help;
    const char *const *labels;
    const char *const *values;
    size_t nlabels, rows;
    struct kvf_metric **out;
};

/* Registers the family of `f` and looks up one child per row. 0 or -errno. */
static int family(struct kvf_metrics *reg, const struct family_row *f)
{
    struct kvf_metric_vec *vec;
    int rc;
    if (f->type == FAM_COUNTER)
        rc = kvf_metrics_counter_vec(reg, f->name, f->help, f->labels, &vec);
    else if (f->type == FAM_GAUGE)
        rc = kvf_metrics_gauge_vec(reg, f->name, f->help, f->labels, &vec);
    else
        rc = kvf_metrics_histogram_vec(reg, f->name, f->help, f->labels, chunk_bounds,
                                       sizeof chunk_bounds / sizeof *chunk_bounds, &vec);
    for (size_t i = 0; rc == 0 && i < f->rows; i++)
        rc = kvf_metric_child(vec, f->nlabels ? f->values + i * f->nlabels : NULL, &f->out[i]);
    return rc;
}

/* Rooms by state, asked of the owner at each scrape (HTTP thread). */
static void collect_rooms(void *ctx, struct kvf_metrics_writer *w)
{
    struct node_metrics *m = ctx;
    uint64_t counts[NODE_ROOM_STATES] = {0};
    if (m->rooms_fn(m->rooms_ctx, counts) == 0)
        memcpy(m->rooms_last, counts, sizeof counts);
    for (int s = 0; s < NODE_ROOM_STATES; s++) {
        const char *labels[] = {"state", room_state_names[s], NULL};
        kvf_metrics_write_gauge(w, "kvfence_node_rooms",
                                "Rooms this node knows, by its own view of each (OPENING, ACTIVE, "
                                "ABORTING, CLOSED, DRAINED, QUARANTINED); ended rooms count as "
                                "DRAINED until the retention count frees them.",
                                labels, (double)m->rooms_last[s]);
    }
}

struct node_metrics *node_metrics_create(const char *version, node_metrics_rooms_fn rooms,
                                         void *ctx)
{
    struct node_metrics *m = calloc(1, sizeof *m);
    if (!m || !(m->reg = kvf_metrics_create(NULL)))
        goto err_free;
    static const char *const td[] = {"transport", "direction", NULL};
    static const char *const t[] = {"transport", NULL};
    static const char *const to[] = {"transport", "outcome", NULL};
    static const char *const reason[] = {"reason", NULL};
    const char *tdv[XP_COUNT * DIR_COUNT * 2], *tov[XP_COUNT * 2 * 2];
    for (int x = 0; x < XP_COUNT; x++) {
        for (int d = 0; d < DIR_COUNT; d++) {
            tdv[(x * DIR_COUNT + d) * 2] = xp_names[x];
            tdv[(x * DIR_COUNT + d) * 2 + 1] = dir_names[d];
        }
        for (int ok = 0; ok < 2; ok++) {
            tov[(x * 2 + ok) * 2] = xp_names[x];
            tov[(x * 2 + ok) * 2 + 1] = ok ? "ok" : "failed";
        }
    }
    struct kvf_metrics *reg = m->reg;
    int rc = kvf_metrics_process_add(reg, version);
    const struct family_row families[] = {
        {FAM_COUNTER, "kvfence_node_bytes_total",
         "Payload bytes moved: sent = source frames completed OK, received = frames "
         "that landed in a local sink's pages.",
         td, tdv, 2, XP_COUNT * DIR_COUNT, &m->bytes[0][0]},
        {FAM_COUNTER, "kvfence_node_frames_total",
         "Frames moved (RDMA received: page ranges of checked ChunkNotices).", td, tdv, 2,
         XP_COUNT * DIR_COUNT, &m->frames[0][0]},
        {FAM_GAUGE, "kvfence_node_ops_in_flight",
         "Chunks accepted by SubmitChunk whose frames have not all ended.", t, xp_names, 1,
         XP_COUNT, m->in_flight},
        {FAM_HISTOGRAM, "kvfence_node_chunk_latency_seconds",
         "Time from a chunk's SubmitChunk to the end of its last frame, on the source "
         "node.",
         t, xp_names, 1, XP_COUNT, m->latency},
        {FAM_COUNTER, "kvfence_node_chunks_total",
         "Chunks that ended, by transport and outcome (failed: a frame failed).", to, tov, 2,
         XP_COUNT * 2, &m->chunks[0][0]},
        {FAM_COUNTER, "kvfence_node_frames_refused_total",
         "Incoming frames (and RDMA ChunkNotices) refused, by reason; each fails its "
         "room.",
         reason, refusal_names, 1, NODE_REFUSED_REASONS, m->refused},
        {FAM_COUNTER, "kvfence_node_frames_late_total",
         "Incoming frames dropped because their room's admission had closed (aborting, "
         "drained) or their sink had completed.",
         NULL, NULL, 0, 1, &m->late},
        {FAM_COUNTER, "kvfence_node_peers_fenced_total",
         "Peers this node fenced (FencePeer requests, and the peers of a self-fence).", NULL, NULL,
         0, 1, &m->peers_fenced},
        {FAM_COUNTER, "kvfence_node_self_fences_total",
         "Times this node fenced itself and took a new incarnation (node_ttl passed "
         "without a session).",
         NULL, NULL, 0, 1, &m->self_fences},
        {FAM_GAUGE, "kvfence_node_pools", "Memory pools registered.", NULL, NULL, 0, 1, &m->pools},
        {FAM_GAUGE, "kvfence_node_session_connected",
         "1 while a session with the control plane is up and welcomed, else 0.", NULL, NULL, 0, 1,
         &m->session},
    };
    for (size_t i = 0; rc == 0 && i < sizeof families / sizeof families[0]; i++)
        rc = family(reg, &families[i]);
    m->rooms_fn = rooms;
    m->rooms_ctx = ctx;
    if (rc == 0 && rooms)
        rc = kvf_metrics_add_collector(reg, collect_rooms, m);
    m->collector_added = rc == 0 && rooms;
    if (rc != 0) {
        kvf_log("error", "node metrics: cannot register: %s", strerror(-rc));
        goto err_free;
    }
    return m;
err_free:
    node_metrics_destroy(m);
    return NULL;
}

void node_metrics_destroy(struct node_metrics *m)
{
    if (!m)
        return;
    if (m->collector_added)
        kvf_metrics_remove_collector(m->reg, collect_rooms, m);
    kvf_metrics_destroy(m->reg);
    free(m);
}

struct kvf_metrics *node_metrics_registry(struct node_metrics *m)
{
    return m ? m->reg : NULL;
}

uint64_t node_metrics_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void node_metrics_sent(struct node_metrics *m, int transport, uint64_t bytes)
{
    int x = xp_index(transport);
    if (!m || x < 0)
        return;
    kvf_counter_inc(m->frames[x][DIR_SENT]);
    kvf_counter_add(m->bytes[x][DIR_SENT], bytes);
}

void node_metrics_received(struct node_metrics *m, int transport, uint64_t frames, uint64_t bytes)
{
    int x = xp_index(transport);
    if (!m || x < 0)
        return;
    kvf_counter_add(m->frames[x][DIR_RECEIVED], frames);
    kvf_counter_add(m->bytes[x][DIR_RECEIVED], bytes);
}

uint64_t node_metrics_chunk_start(struct node_metrics *m, int transport)
{
    int x = xp_index(transport);
    if (!m || x < 0)
        return 0;
    kvf_gauge_add(m->in_flight[x], 1.0);
    return node_metrics_now_ns();
}

void node_metrics_chunk_end(struct node_metrics *m, int transport, uint64_t start_ns, bool ok,
                            bool timed)
{
    int x = xp_index(transport);
    if (!m || x < 0)
        return;
    kvf_gauge_add(m->in_flight[x], -1.0);
    if (!timed)
        return;
    uint64_t now = node_metrics_now_ns();
    kvf_histogram_observe(m->latency[x], now > start_ns ? (double)(now - start_ns) / 1e9 : 0.0);
    kvf_counter_inc(m->chunks[x][ok ? 1 : 0]);
}

void node_metrics_frame_refused(struct node_metrics *m, enum node_metrics_refusal why)
{
    if (m && (unsigned)why < NODE_REFUSED_REASONS)
        kvf_counter_inc(m->refused[why]);
}

void node_metrics_frame_late(struct node_metrics *m)
{
    if (m)
        kvf_counter_inc(m->late);
}

void node_metrics_peers_fenced(struct node_metrics *m, uint64_t count)
{
    if (m)
        kvf_counter_add(m->peers_fenced, count);
}

void node_metrics_self_fence(struct node_metrics *m)
{
    if (m)
        kvf_counter_inc(m->self_fences);
}

void node_metrics_owner_publish(struct node_metrics *m, uint32_t pools, bool session_connected)
{
    if (!m)
        return;
    kvf_gauge_set(m->pools, (double)pools);
    kvf_gauge_set(m->session, session_connected ? 1.0 : 0.0);
}
