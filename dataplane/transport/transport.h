/*
 * transport.h: the data-plane transport interface (post, poll, fence).
 *
 * A transport moves the bytes of one op from host memory on this node into a
 * peer node's registered sink pool (TCP today, RDMA later). It is driven by
 * three verbs, shaped after verbs' post/poll so that an RDMA provider fits the
 * same table:
 *
 *   post_write   queue one write (a struct kvf_xfer); no completion yet;
 *   poll         reap up to `max` completions, never blocking;
 *   fence_peer   make it impossible for a peer to touch this node's memory and
 *                for this node's queued writes to reach it; returns only once
 *                that is true (docs/design.md §1, "fenced").
 *
 * Lifetime accounting (docs/design.md §2.1-2.2): the caller admits every op in the
 * room's lifetime (kvf_lt_admit, kind KVF_LT_OP_TCP_FRAME or KVF_LT_OP_RDMA_WR,
 * towards x->peer) BEFORE post_write, into the struct kvf_lt_op embedded in
 * the xfer. From a successful post_write on, the transport owns that op and
 * retires it (kvf_lt_op_retire) inside poll(), just before it hands the
 * completion back; the completion says whether that retirement drained the
 * lifetime, so the poller can tell the lifetime's owner thread. A post_write
 * that fails posted nothing: the caller undoes the admission with
 * kvf_lt_op_cancel(). Every posted xfer completes exactly once: OK, ERROR (the
 * write failed; it has stopped) or FLUSHED (it was stopped before it finished
 * and did not fail: a fence stopped it, or, where the implementation says so,
 * its lifetime's admission closed before it started and it was never
 * written). Only OK means the bytes were written.
 *
 * Pools (add_pool, remove_pool): the memory peers may write into, host or
 * device pages, registered with every transport by the same call.
 *
 * Waking (wake_fd, wake_ack): a poller that has nothing to do sleeps in
 * poll(2) on the transports' wake descriptors (an eventfd, or an RDMA
 * completion channel) instead of on a timer.
 *
 * DESIGN: the ops table is const and every slot is set. post_write may be
 * called from any thread; ops posted to one peer are written in post order
 * (per calling thread) and never interleave. poll may be called from any one
 * thread at a time. fence_peer and destroy are called from the node's control
 * thread. Each implementation says which threads it runs.
 *
 * Errors: 0 or a negative errno (common/kvf_error.h).
 */
#ifndef KVF_TRANSPORT_H
#define KVF_TRANSPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvf_types.h"
#include "lifetime.h"

struct kvf_transport;
struct kvf_pool;

/* A pool a transport may write into on behalf of its peers (add_pool). */
struct kvf_transport_pool {
    uint32_t id;
    void *base;           /* page 0 in host memory; NULL with dev */
    struct kvf_pool *dev; /* a device pool, written through kvf_pool_write; NULL: host memory */
    uint32_t page_size;
    uint32_t page_count;
};

/*
 * One write: `len` bytes at `src` (host memory, not touched after the
 * completion) into the peer's pool `sink_pool`, starting `offset` bytes into
 * page `first_page`; the write must lie inside pages [first_page, first_page +
 * page_count) and touch every one of them (the receiver checks this against
 * its pool and the room's sink lease). The caller owns the struct and keeps it
 * alive and unchanged until its completion is polled.
 */
struct kvf_xfer {
    struct kvf_lt_op op; /* admitted by the caller, towards `peer` */
    uint32_t peer;       /* node-local peer index */
    kvf_room_key room;
    const void *src;
    uint64_t len;
    uint32_t sink_pool;
    uint32_t first_page;
    uint32_t page_count;
    uint64_t offset; /* bytes from the start of first_page */
    uint32_t layout; /* the source pool's buffer layout (kvf_pool_layout); 0: one span a page */

    /* Transport-private from post_write until the completion is polled. */
    struct kvf_xfer *tnext;
    int tstatus;
    uint8_t toutcome;
};

/* One completion, returned by poll(). The xfer's op is already retired. */
struct kvf_completion {
    struct kvf_xfer *xfer;
    enum kvf_lt_outcome outcome; /* OK, ERROR or FLUSHED (not, or not all, written) */
    int status;                  /* 0, or the -errno of the failure */
    bool drained;                /* retiring the op drained its lifetime */
};

struct kvf_transport_ops {
    const char *name;

    /* Queues `x` (its op admitted). 0, or -errno and nothing was posted. */
    int (*post_write)(struct kvf_transport *t, struct kvf_xfer *x);

    /* Writes up to `max` completions into `out`; returns how many (>= 0) or
     * -errno. Never blocks on I/O. */
    int (*poll)(struct kvf_transport *t, unsigned max, struct kvf_completion *out);

    /* Fences `peer`: when it returns 0, no byte from that peer can land in
     * this node's pools any more, and every write posted to it has completed
     * (they are waiting in poll, FLUSHED unless they had finished). The peer
     * stays fenced: later posts to it fail with -ESTALE. -ENOENT for an
     * unknown peer. Idempotent. */
    int (*fence_peer)(struct kvf_transport *t, uint32_t peer);

    /* Fences every peer, retires any completions nobody polled, and frees
     * the transport. Accepts NULL. */
    void (*destroy)(struct kvf_transport *t);

    /* The wake descriptor: readable (POLLIN) once a completion may be
     * waiting in poll, so that a poller can sleep in poll(2) instead of
     * polling on a timer. -1 when the transport has none (its poller must
     * poll it on a schedule of its own while it has work in flight). The
     * descriptor lives as long as the transport and belongs to it. */
    int (*wake_fd)(struct kvf_transport *t);

    /* Called by the poller after wake_fd was readable and BEFORE it polls
     * the completions: clears the descriptor. A completion that arrives
     * after the clear makes it readable again, so a poller that clears,
     * then polls until empty, then sleeps never misses one. */
    void (*wake_ack)(struct kvf_transport *t);

    /* Registers a pool its peers may write into; *key_p (may be NULL) gets
     * what a peer needs to address it (RDMA: the region's rkey; 0 where a
     * transport needs nothing). 0, or -errno: -EEXIST (id taken), -E2BIG (no
     * room), -EINVAL, -EOPNOTSUPP (this transport cannot reach that memory:
     * RDMA and a device pool). Control thread. */
    int (*add_pool)(struct kvf_transport *t, const struct kvf_transport_pool *p, uint64_t *key_p);

    /* Unregisters a pool: no byte lands in it through this transport once
     * this returns (each transport says what its caller must guarantee about
     * ops in flight). -ENOENT for an unknown id. Control thread. */
    int (*remove_pool)(struct kvf_transport *t, uint32_t pool_id);
};

/* The base every transport embeds first. */
struct kvf_transport {
    const struct kvf_transport_ops *ops;
};

static inline int kvf_transport_post_write(struct kvf_transport *t, struct kvf_xfer *x)
{
    return t->ops->post_write(t, x);
}

static inline int kvf_transport_poll(struct kvf_transport *t, unsigned max,
                                     struct kvf_completion *out)
{
    return t->ops->poll(t, max, out);
}

static inline int kvf_transport_fence_peer(struct kvf_transport *t, uint32_t peer)
{
    return t->ops->fence_peer(t, peer);
}

static inline void kvf_transport_destroy(struct kvf_transport *t)
{
    if (t)
        t->ops->destroy(t);
}

static inline int kvf_transport_wake_fd(struct kvf_transport *t)
{
    return t->ops->wake_fd(t);
}

static inline void kvf_transport_wake_ack(struct kvf_transport *t)
{
    t->ops->wake_ack(t);
}

/* For transports without a wake descriptor: wake_fd -1, wake_ack nothing. */
int kvf_transport_no_wake_fd(struct kvf_transport *t);
void kvf_transport_no_wake_ack(struct kvf_transport *t);

/* An eventfd wake descriptor for a transport's completion list (wake.c):
 * `kvf_wake_signal` from any thread that put a completion on an empty list,
 * `kvf_wake_clear` from the poller (wake_ack). -1 / no-ops on a closed one. */
int kvf_wake_open(void);
void kvf_wake_signal(int fd);
void kvf_wake_clear(int fd);
void kvf_wake_close(int fd);

static inline int kvf_transport_add_pool(struct kvf_transport *t,
                                         const struct kvf_transport_pool *p, uint64_t *key_p)
{
    return t->ops->add_pool(t, p, key_p);
}

static inline int kvf_transport_remove_pool(struct kvf_transport *t, uint32_t pool_id)
{
    return t->ops->remove_pool(t, pool_id);
}

static inline const char *kvf_transport_name(const struct kvf_transport *t)
{
    return t->ops->name;
}

#endif /* KVF_TRANSPORT_H */
