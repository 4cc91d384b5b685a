/*
 * staging.h: staging engines and the staging buffer ring.
 *
 * Staging moves KV bytes between pool pages and fixed-size staging buffers
 * when a transfer cannot go page-to-page (domain.md, "staging"): the source
 * gathers into a buffer, the transport writes the buffer into the peer's
 * staging ring, the sink scatters from the buffer into its pages. Two pieces:
 *
 * 1. An engine (struct kvf_staging) runs copies asynchronously behind a const
 *    ops table whose slots are all set: the host engine (worker threads doing
 *    memcpy), the CUDA engine (cudaMemcpyAsync on dedicated streams, events
 *    polled; only in builds with CUDA) and the fake engine of the tests
 *    (staging_fake.h), which holds every copy until the test completes it.
 *    Callers use the kvf_staging_* wrappers below, never the table directly:
 *    the wrappers keep the in-flight count and the lifetime accounting, so
 *    every engine gets them right the same way.
 *
 * 2. A ring (struct kvf_staging_ring) of N buffers handed out in order. A
 *    buffer acquired for a room is a KVF_LT_OP_STAGING op of the room's
 *    lifetime (kvf_lt_staging_acquire) and returns to the ring only when the
 *    lifetime says both its transport side and its copy side completed (R9:
 *    an aborted room's RDMA may still be landing in it after the copy failed
 *    or was never run, and a copy may still read it after the RDMA finished).
 *    The ring's watermark (the count of buffers given back, in order) advances
 *    only over returned buffers and never past one still owned, so the peer
 *    that writes into the ring (told the watermark) never reuses a region an
 *    aborted room still owns.
 *
 * Lifetime accounting of copies (docs/design.md §2.1-2.2), as for transports: the
 * caller admits each copy's op (kvf_lt_admit, kind KVF_LT_OP_CUDA_COPY) before
 * kvf_staging_copy_async; from a successful submit on, the copy belongs to the
 * engine until kvf_staging_poll hands it back, with its op already retired and
 * `drained` saying whether that drained the lifetime. A failed submit posted
 * nothing: the caller undoes the admission with kvf_lt_op_cancel(). A copy
 * whose op.lt is NULL is not accounted (self-tests, warm-up).
 *
 * DESIGN: an engine has one owner thread (the node's transfer pipeline thread,
 * or a test) that submits and polls; poll never blocks. Engines say which
 * threads they run inside. A ring belongs to one owner thread too, the same
 * one that reports both sides of its buffers done (lifetime.h requires that
 * the two done calls for one buffer never run concurrently).
 *
 * Errors: 0 or a negative errno (common/kvf_error.h).
 */
#ifndef KVF_STAGING_H
#define KVF_STAGING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lifetime.h"

struct kvf_pool;

struct kvf_staging;
struct kvf_staging_ring;
struct kvf_staging_buf;

/*
 * One copy of `len` bytes from `src` to `dst`. For the CUDA engine either side
 * may be device memory (a CUDA pool page) or pinned host memory; for the host
 * and fake engines both are host memory, except that a source in a device pool
 * is named by `src_pool` (then `src` is still its page address, which the CUDA
 * engine copies from, and the host and fake engines read the bytes with
 * kvf_pool_read at `src_offset` instead of dereferencing it). The caller owns
 * the struct and keeps it, both regions and the pool alive and unchanged until
 * the copy is polled.
 */
struct kvf_stage_copy {
    struct kvf_lt_op op; /* admitted by the caller (KVF_LT_OP_CUDA_COPY), or op.lt NULL */
    void *dst;
    const void *src;
    size_t len;
    struct kvf_pool *src_pool;   /* NULL, or the device pool `src` lies in */
    uint64_t src_offset;         /* with src_pool: src's byte offset from its page 0 */
    struct kvf_staging_buf *buf; /* the staging buffer this copy fills or drains, or NULL:
                                    the caller's, the engine never looks at it */
    void *user;                  /* the caller's */

    /* Results, valid once the copy came back from kvf_staging_poll. */
    int status;                  /* 0 or the -errno of the failure */
    enum kvf_lt_outcome outcome; /* KVF_LT_DONE_OK or KVF_LT_DONE_ERROR: it has stopped */
    bool drained;                /* retiring the op drained its lifetime */

    /* Engine-private from submit until polled. */
    struct kvf_stage_copy *snext;
    void *spriv;
};

/*
 * The engine table. Every slot is set. Called only through the wrappers
 * below, on the engine's owner thread.
 *   copy_async  starts one copy (the wrapper checked the arguments); 0 once it
 *               is posted, or a -errno when nothing was posted.
 *   poll        hands back up to `max` finished copies in `done`, their
 *               status and outcome set (the wrapper retires their ops); never
 *               blocks; returns how many (0 when none finished yet).
 *   destroy     frees the engine; the wrapper calls it only when no copy is in
 *               flight (submitted and not yet polled).
 */
struct kvf_staging_ops {
    const char *name;
    int (*copy_async)(struct kvf_staging *s, struct kvf_stage_copy *c);
    int (*poll)(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done);
    void (*destroy)(struct kvf_staging *s);
};

/* ---- engines ------------------------------------------------------------ */

struct kvf_staging_host_opts {
    unsigned threads; /* worker threads doing memcpy (default 2, at most 64) */
};
void kvf_staging_host_opts_init(struct kvf_staging_host_opts *opts);

/* The host engine: copies run on worker threads, completions are reaped by
 * poll. NULL (logged) on bad options or out of resources. */
struct kvf_staging *kvf_staging_host_create(const struct kvf_staging_host_opts *opts);

struct kvf_staging_cuda_opts {
    int device;       /* CUDA device ordinal (default 0) */
    unsigned streams; /* dedicated streams copies are spread over (default 2, at most 16) */
};
void kvf_staging_cuda_opts_init(struct kvf_staging_cuda_opts *opts);

/* The CUDA engine: cudaMemcpyAsync on dedicated non-blocking streams, one
 * event recorded after each copy, events polled with cudaEventQuery. NULL
 * (logged) without a device, or in a build without CUDA. */
struct kvf_staging *kvf_staging_cuda_create(const struct kvf_staging_cuda_opts *opts);

/* Pinned host memory for staging rings used with the CUDA engine
 * (cudaHostAlloc, portable). -ENOTSUP without CUDA, -ENOMEM. `*mem_p` written
 * only on success. */
int kvf_staging_cuda_host_alloc(size_t size, void **mem_p);
void kvf_staging_cuda_host_free(void *mem);

/* ---- using an engine ----------------------------------------------------- */

/* Submits a copy (see the top of this file for the op). -EINVAL for NULL
 * regions with len > 0; otherwise what the engine said. Owner thread. */
int kvf_staging_copy_async(struct kvf_staging *s, struct kvf_stage_copy *c);

/* Reaps up to `max` finished copies into `done` (oldest first per engine
 * queue), retires their ops, and returns how many. Never blocks. Owner thread. */
unsigned kvf_staging_poll(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done);

/* Copies submitted and not yet polled. */
uint64_t kvf_staging_inflight(const struct kvf_staging *s);

const char *kvf_staging_name(const struct kvf_staging *s);

/* Frees the engine. -EBUSY (nothing changes) while copies are in flight:
 * poll them out first (they complete by themselves; the fake engine's when
 * the test completes them), because freeing an engine under a running copy
 * would leave it writing into memory nobody accounts for. Accepts NULL. */
int kvf_staging_destroy(struct kvf_staging *s);

/* ---- the buffer ring ------------------------------------------------------ */

/* One staging buffer. Fields are the ring's; callers read `data`, `size`,
 * `seq` and `index`, and pass the buffer back to the ring's done calls. */
struct kvf_staging_buf {
    struct kvf_lt_staging lts; /* the room's STAGING op while acquired */
    struct kvf_staging_ring *ring;
    void *data;
    size_t size;
    uint64_t seq;   /* the ring position it was acquired at */
    uint32_t index; /* slot: seq % buf_count */
    uint8_t state;  /* ring-private */
};

struct kvf_staging_ring_opts {
    uint32_t buf_count; /* N buffers, >= 1 (default 16) */
    size_t buf_size;    /* bytes per buffer, >= 1 (default 4 MiB) */
    void *mem;          /* buf_count x buf_size bytes the caller owns and frees after the
                           ring (e.g. from kvf_staging_cuda_host_alloc), or NULL: the ring
                           allocates page-aligned host memory */
};
void kvf_staging_ring_opts_init(struct kvf_staging_ring_opts *opts);

/* NULL (logged) on bad options or out of memory. */
struct kvf_staging_ring *kvf_staging_ring_create(const struct kvf_staging_ring_opts *opts);

/* Frees the ring. -EBUSY (nothing changes) while any buffer is owned by a
 * room. Accepts NULL. Owner thread. */
int kvf_staging_ring_destroy(struct kvf_staging_ring *r);

/*
 * Acquires the next buffer in ring order for the room of `lt`, towards `peer`
 * (kvf_lt_staging_acquire). Returns 0 and writes `*buf_p`, or -ECANCELED when
 * the room's admission is closed (a late staging request: reject and count
 * it; the ring does not move; also when the ring is full), or -EAGAIN when all
 * N buffers are owned or not yet passed by the watermark. Owner thread.
 */
int kvf_staging_ring_acquire(struct kvf_staging_ring *r, struct kvf_lt *lt, uint32_t peer,
                             struct kvf_staging_buf **buf_p);

/*
 * The transport side (the RDMA or TCP op that reads or writes the buffer) or
 * the copy side (the copy into or out of it) of `buf` completed, in either
 * order. A side with no work (nothing was posted for it) is reported done too.
 * Returns true when this call returned the buffer to its ring (both sides
 * done); the watermark may have advanced. `*drained_p` (may be NULL) says
 * whether the release drained the room's lifetime. Owner thread.
 */
bool kvf_staging_ring_transport_done(struct kvf_staging_buf *buf, bool *drained_p);
bool kvf_staging_ring_copy_done(struct kvf_staging_buf *buf, bool *drained_p);

/* The watermark: every buffer acquired at a position below it has returned and
 * its slot may be reused. Starts at 0; only grows. */
uint64_t kvf_staging_ring_watermark(const struct kvf_staging_ring *r);

/* Positions handed out so far (the next acquire takes position `head`). */
uint64_t kvf_staging_ring_head(const struct kvf_staging_ring *r);

/* Buffers owned by rooms right now (acquired, not yet returned). */
uint32_t kvf_staging_ring_owned(const struct kvf_staging_ring *r);

uint32_t kvf_staging_ring_count(const struct kvf_staging_ring *r);
size_t kvf_staging_ring_buf_size(const struct kvf_staging_ring *r);

#endif /* KVF_STAGING_H */
