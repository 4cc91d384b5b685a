/*
 * node_metrics.h: kvfence-node's Prometheus metrics (docs/metrics.md, "Node
 * metrics"): one registry (common/metrics/metrics.h) that main.c serves over
 * HTTP with --metrics-listen, and the hooks the node's modules call where
 * the counted thing happens, each at one place.
 *
 * DESIGN (threads): every hook is lock-free and may be called from any
 * thread: the owner thread (frames sent, chunks, pools, session), TCP
 * receiver threads (frames received, refused, late) and the HTTP thread
 * reads them when it renders. Children of every labelled family are looked
 * up once, at create, for every label value the node uses (the transports,
 * the refusal reasons, the chunk outcomes), so the hot path is one relaxed
 * atomic add on a handle, and every series is present (at 0) from the first
 * scrape. The gauges the owner thread alone changes (pools, session) are
 * atomics it writes once per turn of its loop and the HTTP thread reads.
 * Rooms by state are not kept on the hot path at all: at each scrape the
 * collector (HTTP thread) asks the node's `rooms` callback, which posts a
 * synchronous job to the owner thread that counts its rooms; when the owner
 * has stopped, the last counts are shown.
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

/* The node's own view of a room, for kvfence_node_rooms{state}. */
enum node_metrics_room {
    NODE_ROOM_OPENING,     /* known, not yet ACTIVE here (members not all published) */
    NODE_ROOM_ACTIVE,      /* admission open: engines may submit */
    NODE_ROOM_ABORTING,    /* aborting, not yet drained */
    NODE_ROOM_CLOSED,      /* admission closed (its local participants completed, or
                              the node is stopping), ops still draining */
    NODE_ROOM_DRAINED,     /* closed and nothing in flight: kept until retention frees it */
    NODE_ROOM_QUARANTINED, /* an op failed without proof that it stopped */
    NODE_ROOM_STATES,      /* (count) */
};

/* Fills counts[NODE_ROOM_STATES] (zeroed by the caller) with the rooms as
 * the owner sees them now. 0, or -errno (the last counts are shown). Called
 * on the HTTP thread. */
typedef int (*node_metrics_rooms_fn)(void *ctx, uint64_t *counts);

/* Creates the registry, its families and their children, the
 * kvfence_build_info / process_* families (common/metrics/process.h), and
 * the collector of the rooms by state, which calls rooms(ctx, counts) at
 * every scrape. NULL (logged) on out of memory. Before the node's threads
 * start. */
struct node_metrics *node_metrics_create(const char *version, node_metrics_rooms_fn rooms,
                                         void *ctx);

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

/* The owner's gauges, once per turn of its loop: pools registered, and
 * whether a welcomed session with the control plane is up. */
void node_metrics_owner_publish(struct node_metrics *m, uint32_t pools, bool session_connected);

#endif /* KVF_NODE_METRICS_H */
