/*
 * node_metrics.h: kvfence-node's Prometheus metrics (docs/metrics.md, "Node
 * metrics"): one registry (common/metrics/metrics.h) that main.c serves over
 * HTTP with --metrics-listen, and the hooks the node's modules call where
 * the counted thing happens, each at one place.
 *
 * DESIGN (threads): every hook is lock-free and may be called from any
 * thread: the owner thread (frames sent, chunks, rooms, pools, session), TCP
 * receiver threads (frames received, refused, late) and the HTTP thread
 * reads them when it renders. Children of every labelled family are looked
 * up once, at create, for every label value the node uses (the transports,
 * the room states, the refusal reasons), so the hot path is one relaxed
 * atomic add on a handle, and every series is present (at 0) from the first
 * scrape. The gauges the owner thread alone changes (pools, session, rooms
 * by state) are atomics it writes and the HTTP thread reads; nothing here
 * reads the node's own state, so a scrape never waits for the owner.
 *
 * Every hook accepts a NULL `m` (no metrics: a no-op). This module calls no
 * other module of the node (the bottom layer, docs/node.md).
 */
#ifndef KVF_NODE_METRICS_H
#define KVF_NODE_METRICS_H

#include <stdbool.h>
#include <stdint.h>

struct kvf_metrics;
struct node_metrics;

/* Why a TCP frame (or an RDMA ChunkNotice) was refused. */
enum node_metrics_refusal {
    NODE_REFUSED_UNKNOWN_ROOM,  /* a room this node does not know: a protocol violation */
    NODE_REFUSED_NOT_SOURCE,    /* the sender is not a source of the room (nor introduced) */
    NODE_REFUSED_OUTSIDE_LEASE, /* pages outside this node's sink lease */
    NODE_REFUSED_RDMA_NOTICE,   /* an RDMA ChunkNotice that failed its checks */
    NODE_REFUSED_REASONS,       /* (count) */
};

/* Creates the registry, its families and their children, and the
 * kvfence_build_info / process_* families (common/metrics/process.h). NULL
 * (logged) on out of memory. Before the node's threads start. */
struct node_metrics *node_metrics_create(const char *version);

/* Frees it; accepts NULL. No thread may use it any more (the HTTP server is
 * stopped, the node's threads joined). */
void node_metrics_destroy(struct node_metrics *m);

/* The registry to serve (kvf_metrics_http_start); NULL for NULL. */
struct kvf_metrics *node_metrics_registry(struct node_metrics *m);

/* The monotonic clock in ns, for node_metrics_chunk_end's `start_ns`. */
uint64_t node_metrics_now_ns(void);

/* `transport` below is a Kvfence__V1__TransportKind (RDMA, TCP or LOCAL);
 * any other value is ignored. */

/* A source frame of `bytes` completed OK on `transport` (owner thread). */
void node_metrics_sent(struct node_metrics *m, int transport, uint64_t bytes);

/* `frames` frames (RDMA: the ranges of one ChunkNotice) of `bytes` in all
 * landed in a local sink's pages through `transport`. */
void node_metrics_received(struct node_metrics *m, int transport, uint64_t frames, uint64_t bytes);

/* A chunk was accepted for `transport` (SubmitChunk, owner thread): one
 * more op in flight. Returns the start time to hand to node_metrics_chunk_end
 * (0 for a NULL m). */
uint64_t node_metrics_chunk_start(struct node_metrics *m, int transport);

/* A chunk started with node_metrics_chunk_start ended: the op leaves the
 * in-flight gauge; when `timed`, its latency (now - start_ns) is observed
 * and it counts as ok or failed. A chunk dropped before any of its frames
 * was posted ends with timed = false (owner thread). */
void node_metrics_chunk_end(struct node_metrics *m, int transport, uint64_t start_ns, bool ok,
                            bool timed);

/* A frame refused, or one that came late (its room's admission is closed,
 * or its sink already completed: dropped as the rules say, not an error). */
void node_metrics_frame_refused(struct node_metrics *m, enum node_metrics_refusal why);
void node_metrics_frame_late(struct node_metrics *m);

/* `count` peers fenced (a FencePeer, or the peers of a self-fence). */
void node_metrics_peers_fenced(struct node_metrics *m, uint64_t count);

/* The node fenced itself (a new incarnation). */
void node_metrics_self_fence(struct node_metrics *m);

/* A room moved from `old_state` to `new_state` (Kvfence__V1__RoomState;
 * UNSPECIFIED = known, no update yet); -1 as old: it was opened, -1 as new:
 * it was freed (owner thread). */
void node_metrics_room_state(struct node_metrics *m, int old_state, int new_state);

/* The owner's gauges, once per turn of its loop: pools registered, and
 * whether a welcomed session with the control plane is up. */
void node_metrics_owner_publish(struct node_metrics *m, uint32_t pools, bool session_connected);

#endif /* KVF_NODE_METRICS_H */
