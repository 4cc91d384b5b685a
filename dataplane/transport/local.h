/*
 * local.h: the same-host transport (struct kvf_transport_ops "local").
 *
 * A write whose sink pool is on this node is a memcpy from the source bytes
 * into a pool registered with this transport. It keeps the transport.h
 * contract so that the node's submit path treats it like TCP: the caller
 * admits the op before post_write, the transport retires it inside poll(),
 * and every posted xfer completes exactly once (OK, FLUSHED by a fence, or
 * ERROR when a device pool's copy failed).
 *
 * The "peer" of a local write is this node itself: the node gives it a peer
 * index (kvf_transport_local_add_peer) so the lifetime core can fence it like
 * any other. fence_peer stops what is queued for that peer (FLUSHED), waits
 * for a copy in progress to finish (a memcpy cannot be stopped half way, so
 * the fence proves it stopped by waiting; it lasts one copy of at most a
 * frame), and refuses later posts with -ESTALE.
 *
 * Order: one worker takes the oldest queued write whose destination does not
 * overlap a write still being copied, so overlapping writes land in post
 * order and never interleave; with more than one worker, writes to disjoint
 * pages run side by side and may complete out of post order.
 *
 * DESIGN (threads): `threads` worker threads do the copies. The submit queue,
 * the done list, the pools and peers are under one mutex, held only to link
 * or unlink records (never during a memcpy). post_write may be called from any
 * thread; poll from one thread at a time; fence_peer, destroy and the
 * controls below from the node's owner thread (or the test).
 */
#ifndef KVF_TRANSPORT_LOCAL_H
#define KVF_TRANSPORT_LOCAL_H

#include <stdbool.h>
#include <stdint.h>

#include "transport.h"

struct kvf_pool;

struct kvf_transport_local_opts {
    unsigned threads;   /* copy workers, 1..16 (default 1) */
    uint32_t max_peers; /* peer indices 0..max_peers-1 (default 64) */
    uint32_t max_pools; /* default 64 */
};

void kvf_transport_local_opts_init(struct kvf_transport_local_opts *opts);

/* NULL (logged) on bad options or out of resources. */
struct kvf_transport *kvf_transport_local_create(const struct kvf_transport_local_opts *opts);

/* A sink pool: `page_count` pages of `page_size` bytes at `mem`. -EEXIST,
 * -E2BIG (max_pools), -EINVAL. */
int kvf_transport_local_add_pool(struct kvf_transport *t, uint32_t pool_id, void *mem,
                                 uint32_t page_size, uint32_t page_count);

/*
 * A device pool (kvf_pool_is_device), as a sink and as a source: a write
 * into it goes through kvf_pool_write, a write whose `src` lies in its pages
 * through kvf_pool_read, device to device through a worker's host buffer;
 * its pages are never dereferenced here. A copy that fails completes ERROR
 * with its -errno. The pool must stay open until removed. Same errors.
 */
int kvf_transport_local_add_device_pool(struct kvf_transport *t, uint32_t pool_id,
                                        struct kvf_pool *pool);

/* Unregisters a sink pool: later posts naming it are refused (-EINVAL).
 * The caller guarantees that no write into it is queued or being copied (the
 * node removes a pool only once every lifetime that could use it drained).
 * -ENOENT. */
int kvf_transport_local_remove_pool(struct kvf_transport *t, uint32_t pool_id);

/* Makes `peer` known (normally the node's own index). -EINVAL beyond
 * max_peers; idempotent. */
int kvf_transport_local_add_peer(struct kvf_transport *t, uint32_t peer);

/* While held, no worker starts a queued write (a test holds ops "in flight");
 * a fence still flushes them. Releasing lets the workers go on. */
void kvf_transport_local_set_hold(struct kvf_transport *t, bool hold);

struct kvf_transport_local_stats {
    uint64_t posted;  /* post_write calls that queued a write */
    uint64_t copied;  /* writes copied (OK) */
    uint64_t failed;  /* writes whose device-pool copy failed (ERROR) */
    uint64_t flushed; /* writes a fence or destroy stopped before their copy */
    uint64_t queued;  /* now: posted, no copy started */
    uint64_t copying; /* now: a worker is copying */
    uint64_t done;    /* now: completed, not yet polled */
};

void kvf_transport_local_stats(struct kvf_transport *t, struct kvf_transport_local_stats *out);

#endif /* KVF_TRANSPORT_LOCAL_H */
