/*
 * staging.c: the engine-independent half of staging: the kvf_staging_*
 * wrappers around an engine's ops table (argument checks, the in-flight count,
 * retirement of each polled copy's lifetime op) and the staging buffer ring.
 *
 * The ring: N slots, acquired strictly in ring order. Position p (a 64-bit
 * count that never wraps) lives in slot p % N. `head` is the next position to
 * hand out, `watermark` the lowest position not yet given back; positions in
 * [watermark, head) are OWNED by a room or RETURNED out of order and waiting
 * for the ones before them. A buffer becomes RETURNED only when the room's
 * lifetime says both of its sides completed; the watermark then moves over
 * every leading RETURNED slot (making them FREE) and stops at the first one
 * still OWNED. Acquire needs head - watermark < N. That is the whole of R9:
 * the peer writes only below watermark + N, so a slot an aborted room still
 * owns is never handed out again, whichever side finished last.
 *
 * DESIGN: engine wrappers run on the engine's owner thread; the ring and its
 * buffers belong to the ring's owner thread (see staging.h). Nothing here
 * locks; the in-flight count is atomic only so that other threads may read it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "staging_internal.h"

#include "pool.h"
#include "kvf_log.h"

/* ---- engine wrappers ------------------------------------------------------ */

int kvf_staging_copy_async(struct kvf_staging *s, struct kvf_stage_copy *c)
{
    if (c == NULL || (c->len > 0 && (c->dst == NULL || c->src == NULL)))
        return -EINVAL;
    c->status = 0;
    c->outcome = 0;
    c->drained = false;
    c->snext = NULL;
    c->spriv = NULL;
    atomic_fetch_add_explicit(&s->inflight, 1, memory_order_relaxed);
    int rc = s->ops->copy_async(s, c);
    if (rc != 0)
        atomic_fetch_sub_explicit(&s->inflight, 1, memory_order_relaxed);
    return rc;
}

unsigned kvf_staging_poll(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done)
{
    if (max == 0)
        return 0;
    int n = s->ops->poll(s, max, done);
    if (n <= 0)
        return 0;
    for (int i = 0; i < n; i++) {
        struct kvf_stage_copy *c = done[i];
        if (c->outcome != KVF_LT_DONE_OK && c->outcome != KVF_LT_DONE_ERROR)
            c->outcome = c->status == 0 ? KVF_LT_DONE_OK : KVF_LT_DONE_ERROR;
        c->drained = c->op.lt != NULL ? kvf_lt_op_retire(&c->op, c->outcome) : false;
    }
    atomic_fetch_sub_explicit(&s->inflight, (uint64_t)n, memory_order_relaxed);
    return (unsigned)n;
}

uint64_t kvf_staging_inflight(const struct kvf_staging *s)
{
    return atomic_load_explicit(&s->inflight, memory_order_relaxed);
}

const char *kvf_staging_name(const struct kvf_staging *s)
{
    return s->ops->name;
}

int kvf_staging_destroy(struct kvf_staging *s)
{
    if (s == NULL)
        return 0;
    if (kvf_staging_inflight(s) != 0)
        return -EBUSY;
    s->ops->destroy(s);
    return 0;
}

/* ---- the ring ------------------------------------------------------------ */

enum ring_slot_state {
    RING_FREE = 0,     /* below the watermark: may be acquired */
    RING_OWNED = 1,    /* a room owns it (its STAGING op is counted) */
    RING_RETURNED = 2, /* both sides done; waits for the watermark to pass it */
};

struct kvf_staging_ring {
    uint32_t count;
    size_t buf_size;
    uint64_t head;
    uint64_t watermark;
    uint32_t owned;
    void *mem;
    bool own_mem;
    struct kvf_staging_buf bufs[];
};

void kvf_staging_ring_opts_init(struct kvf_staging_ring_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->buf_count = 16;
    opts->buf_size = 4u << 20;
}

struct kvf_staging_ring *kvf_staging_ring_create(const struct kvf_staging_ring_opts *opts)
{
    if (opts == NULL || opts->buf_count == 0 || opts->buf_size == 0 ||
        opts->buf_size > SIZE_MAX / opts->buf_count) {
        kvf_log("error", "kvf_staging_ring_create: buf_count and buf_size must be >= 1 and "
                         "their product must fit in memory");
        return NULL;
    }
    struct kvf_staging_ring *r =
        calloc(1, sizeof(*r) + (size_t)opts->buf_count * sizeof(struct kvf_staging_buf));
    if (r == NULL)
        goto err_oom;
    size_t total = (size_t)opts->buf_count * opts->buf_size;
    if (opts->mem != NULL) {
        r->mem = opts->mem;
    } else {
        size_t align = (size_t)sysconf(_SC_PAGESIZE);
        size_t rounded = (total + align - 1) / align * align;
        r->mem = aligned_alloc(align, rounded);
        if (r->mem == NULL)
            goto err_free_ring;
        r->own_mem = true;
    }
    r->count = opts->buf_count;
    r->buf_size = opts->buf_size;
    for (uint32_t i = 0; i < r->count; i++) {
        struct kvf_staging_buf *b = &r->bufs[i];
        b->ring = r;
        b->data = (uint8_t *)r->mem + (size_t)i * r->buf_size;
        b->size = r->buf_size;
        b->index = i;
        b->state = RING_FREE;
    }
    return r;

err_free_ring:
    free(r);
err_oom:
    kvf_log("error", "kvf_staging_ring_create: out of memory (%u x %zu bytes)", opts->buf_count,
            opts->buf_size);
    return NULL;
}

int kvf_staging_ring_destroy(struct kvf_staging_ring *r)
{
    if (r == NULL)
        return 0;
    if (r->owned != 0)
        return -EBUSY;
    if (r->own_mem)
        free(r->mem);
    free(r);
    return 0;
}

int kvf_staging_ring_acquire(struct kvf_staging_ring *r, struct kvf_lt *lt, uint32_t peer,
                             struct kvf_staging_buf **buf_p)
{
    /* A closed room is told so even when the ring is full: its request is
     * late and must be rejected, not retried. */
    if (r->head - r->watermark >= r->count)
        return kvf_lt_state(lt) == KVF_LT_OPEN ? -EAGAIN : -ECANCELED;
    struct kvf_staging_buf *b = &r->bufs[r->head % r->count];
    int rc = kvf_lt_staging_acquire(lt, &b->lts, peer);
    if (rc != 0)
        return rc;
    b->seq = r->head++;
    b->state = RING_OWNED;
    r->owned++;
    *buf_p = b;
    return 0;
}

/* Both sides of `b` are done: mark it returned and move the watermark over
 * every leading returned slot, stopping at the first one still owned. */
static void ring_return(struct kvf_staging_ring *r, struct kvf_staging_buf *b)
{
    b->state = RING_RETURNED;
    r->owned--;
    while (r->watermark < r->head) {
        struct kvf_staging_buf *t = &r->bufs[r->watermark % r->count];
        if (t->state != RING_RETURNED)
            break;
        t->state = RING_FREE;
        r->watermark++;
    }
}

static bool ring_side_done(struct kvf_staging_buf *b, bool transport, bool *drained_p)
{
    if (b->state != RING_OWNED) { /* a caller bug: a side of a buffer it does not own */
        if (drained_p != NULL)
            *drained_p = false;
        return false;
    }
    bool both = transport ? kvf_lt_staging_transport_done(&b->lts, drained_p)
                          : kvf_lt_staging_copy_done(&b->lts, drained_p);
    if (both)
        ring_return(b->ring, b);
    return both;
}

bool kvf_staging_ring_transport_done(struct kvf_staging_buf *buf, bool *drained_p)
{
    return ring_side_done(buf, true, drained_p);
}

bool kvf_staging_ring_copy_done(struct kvf_staging_buf *buf, bool *drained_p)
{
    return ring_side_done(buf, false, drained_p);
}

uint64_t kvf_staging_ring_watermark(const struct kvf_staging_ring *r)
{
    return r->watermark;
}

uint64_t kvf_staging_ring_head(const struct kvf_staging_ring *r)
{
    return r->head;
}

uint32_t kvf_staging_ring_owned(const struct kvf_staging_ring *r)
{
    return r->owned;
}

uint32_t kvf_staging_ring_count(const struct kvf_staging_ring *r)
{
    return r->count;
}

size_t kvf_staging_ring_buf_size(const struct kvf_staging_ring *r)
{
    return r->buf_size;
}

int staging_host_copy(struct kvf_stage_copy *c)
{
    if (c->len == 0)
        return 0;
    if (c->src_pool)
        return kvf_pool_read(c->src_pool, c->src_offset, c->dst, c->len);
    memcpy(c->dst, c->src, c->len);
    return 0;
}
