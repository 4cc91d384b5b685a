/*
 * xport.h: the node's data path below SubmitChunk: which transport a chunk
 * goes through (the registry's classes: xport_registry.h), the frames (RDMA:
 * slices) of a chunk, and the staging pipeline (pool -> staging buffer ->
 * transport). Nothing here names a transport.
 *
 * DESIGN (threads): everything here runs on the owner thread (node.c),
 * except the transports' and staging engine's own worker threads. A frame is
 * one transport op (struct kvf_xfer); with staging it first owns a staging
 * buffer (a STAGING op of the room's lifetime) and a copy into it (a copy op);
 * the buffer goes back to its ring only when both the copy and the transport
 * op completed (docs/state-cores.md), so an abort that finds a transport op
 * in flight from a buffer leaves the buffer owned, and the room undrained,
 * until that op completes.
 */
#ifndef KVF_NODE_XPORT_H
#define KVF_NODE_XPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "node_types.h"
#include "staging.h"

struct node_chunk;

struct node_frame {
    struct kvf_xfer x; /* the transport op */
    struct node_chunk *chunk;
    struct kvf_transport *t;     /* where x is posted */
    enum kvf_lt_op_kind kind;    /* x's lifetime kind */
    const uint8_t *src;          /* the source pages */
    struct kvf_pool *src_dev;    /* the source pool when it is a device pool, else NULL */
    uint64_t src_offset;         /* with src_dev: src's offset from the pool's page 0 */
    struct kvf_staging_buf *buf; /* staging: x is posted from it; NULL once returned */
    struct kvf_stage_copy copy;  /* staging: src -> buf */
    struct node_frame *pnext;    /* staging: waiting for a buffer */
};

struct node_chunk {
    struct node_room *room;
    struct node_pair *pair; /* (source rank, sink rank); lives as long as the room */
    uint32_t src_rank;
    uint32_t sink_rank;
    bool sink_local; /* the sink is on this node: completions feed its bytes */
    bool rdma;       /* RDMA slices: a ChunkNotice goes to the sink once all are OK */
    uint64_t seq;
    uint32_t nframes; /* frames that each end exactly once (node_frame_end) */
    uint32_t ndone;
    uint32_t nfail;
    /* node_submit_chunk is still running: a frame ending inside it (a
     * staging copy or a queued post that fails at once) does not end the
     * chunk; node_submit_chunk does, once its bookkeeping is done. */
    bool submitting;
    uint64_t metrics_t0; /* node_metrics_chunk_start's time */
    struct node_frame frames[];
};

struct node_xport_class;

/* Where a chunk towards one sink goes. */
struct node_route {
    struct kvf_transport *t;
    uint32_t peer;
    enum kvf_lt_op_kind kind;
    const struct node_xport_class *cls; /* the class that claimed it (node_xport_route) */
};

/* Node start: the staging engine and ring (opts.staging), then every
 * registered transport's start. 0, or -errno (logged). */
int node_xport_start(struct kvf_node *n);

/* After the owner thread stopped: frees what node_xport_start made. Staged
 * frames still waiting for a buffer are dropped. */
void node_xport_stop(struct kvf_node *n);

/* A pool was registered: every transport may write into it. 0, or -errno
 * (logged) and no transport keeps it. */
int node_xport_add_pool(struct kvf_node *n, const struct node_pool *p);

/* A pool is unregistered (every lifetime that could use it drained): no
 * transport writes into it once this returns. */
void node_xport_remove_pool(struct kvf_node *n, uint32_t pool_id);

/* Picks the transport towards `sink`: the first registered class that
 * claims it (same node: local; else RDMA when both ends have it and their
 * link is up, else TCP), which connects it without blocking. 0, or -errno
 * with `why` filled. */
int node_xport_route(struct kvf_node *n, const struct node_member *sink, struct node_route *rt,
                     char *why, size_t why_len);

/* True when chunks routed by `rt` are queued and posted by their transport
 * (node_xport_post_chunk: each frame admitted right before its post); false
 * when the submit path admits and posts every frame itself. */
bool node_xport_queues_chunks(const struct node_route *rt);
void node_xport_post_chunk(struct kvf_node *n, const struct node_route *rt, struct node_chunk *ch);

/* FencePeer and the self-fence: fences `peer` on every transport, in
 * registry order; 0, or the first -errno (logged; the peer is not fenced). */
int node_xport_fence_peer(struct kvf_node *n, uint32_t peer);

/* Self-fencing, when the node takes a new incarnation and starts its peer
 * table over: every transport fences what the old incarnation's peers could
 * still reach and replaces it (the local transport with a fresh one holding
 * the same pools, so that the new incarnation's local index is not a fenced
 * one; RDMA with new regions and rkeys). 0 or -errno (that transport stays,
 * fenced). */
int node_xport_renew_local(struct kvf_node *n);

/* True when frames go through a staging buffer. */
bool node_xport_staging(const struct kvf_node *n);

/* Queues the frames of `ch` (all filled in) for staging and starts what the
 * ring allows. */
void node_xport_stage_chunk(struct kvf_node *n, struct node_chunk *ch);

/* Owner loop: reaps every transport and the staging engine, posts staged
 * frames whose copy is done, starts waiting frames. */
void node_xport_poll(struct kvf_node *n);

/* Owner loop: the wake descriptors of the node's transports (transport.h,
 * wake_fd), at most `max`: pfd[i] (POLLIN) and who[i], the transport to
 * acknowledge (kvf_transport_wake_ack) when it was readable. Returns how
 * many. */
#define NODE_XPORT_MAX_WAKE 4
struct pollfd;
size_t node_xport_wake_fds(struct kvf_node *n, struct pollfd *pfd, struct kvf_transport **who,
                           size_t max);

/* Owner loop: by when (node_now_ms time) the data path must be polled again
 * although no descriptor woke the owner: parts without a wake descriptor
 * that have work in flight (staging copies, RDMA work requests, RDMA link
 * messages due) or the test hold knob; INT64_MAX when none. */
int64_t node_xport_next_ms(struct kvf_node *n, int64_t now);

/* Hello: fills `out` with the feature names (at most `max`); returns how
 * many. */
size_t node_xport_features(const struct kvf_node *n, const char **out, size_t max);

/* Hello: the transports' endpoints (at most `max`); returns how many. */
struct node_xport_endpoint {
    int kind; /* Kvfence__V1__EndpointKind */
    char address[128];
};
size_t node_xport_endpoints(const struct kvf_node *n, struct node_xport_endpoint *out, size_t max);

#endif /* KVF_NODE_XPORT_H */
