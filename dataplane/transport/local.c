/*
 * local.c: the same-host transport (local.h): worker threads memcpy queued
 * writes into registered pools; poll() retires and hands back completions.
 *
 * DESIGN: see local.h. Every record moves queue -> copying -> done (or queue
 * -> done, FLUSHED, on a fence or destroy) under `lock`, linked through the
 * xfer's transport-private `tnext`. A worker copies outside the lock; the
 * copying list is what a fence waits on and what the overlap rule reads.
 */
#include "local.h"

#include "pool.h"
#include "kvf_log.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LOCAL_MAX_THREADS 16u
/* Device to device: copied through a worker's host buffer in steps of this. */
#define LOCAL_BOUNCE_SIZE (256u * 1024u)

struct local_pool {
    uint32_t id;
    struct kvf_pool *dev; /* a device pool: kvf_pool_read/kvf_pool_write only */
    uint8_t *base;
    uint32_t page_size;
    uint32_t page_count;
};

struct local {
    struct kvf_transport base; /* first */
    struct kvf_transport_local_opts opts;

    pthread_mutex_t lock;
    pthread_cond_t work; /* queue changed, hold released, stop */
    pthread_cond_t idle; /* a copy finished */
    struct kvf_xfer *q_head, *q_tail;
    struct kvf_xfer *copying; /* unordered */
    struct kvf_xfer *d_head, *d_tail;
    int d_wake; /* eventfd: the done list became non-empty (wake_fd) */
    bool hold, stop;

    struct local_pool *pools;
    uint32_t npools;
    uint8_t *peer_known; /* max_peers */
    uint8_t *peer_fenced;

    struct kvf_transport_local_stats st;

    unsigned nthreads;
    pthread_t threads[];
};

static struct local *local_of(struct kvf_transport *t)
{
    return (struct local *)t;
}

static const struct local_pool *pool_find(const struct local *l, uint32_t id)
{
    for (uint32_t i = 0; i < l->npools; i++)
        if (l->pools[i].id == id)
            return &l->pools[i];
    return NULL;
}

/* The destination of `x`, or NULL when it does not lie exactly on its pages
 * (the rule of tcp.h: the named pages are exactly the pages written). Lock
 * held. */
static uint8_t *dest_of(const struct local *l, const struct kvf_xfer *x)
{
    const struct local_pool *p = pool_find(l, x->sink_pool);
    if (!p || x->page_count == 0 || x->len == 0 || x->offset >= p->page_size ||
        (uint64_t)x->first_page + x->page_count > p->page_count)
        return NULL;
    uint64_t end = x->offset + x->len;
    if (end <= (uint64_t)(x->page_count - 1) * p->page_size ||
        end > (uint64_t)x->page_count * p->page_size)
        return NULL;
    return p->base + (uint64_t)x->first_page * p->page_size + x->offset;
}

static void done_push(struct local *l, struct kvf_xfer *x, enum kvf_lt_outcome outcome)
{
    x->toutcome = (uint8_t)outcome;
    x->tstatus = outcome == KVF_LT_DONE_OK ? 0 : -ECANCELED;
    x->tnext = NULL;
    if (l->d_tail) {
        l->d_tail->tnext = x;
    } else {
        l->d_head = x;
        kvf_wake_signal(l->d_wake); /* the poller may be asleep */
    }
    l->d_tail = x;
    l->st.done++;
}

/* The device pool whose pages hold `src` .. `src + len`, or NULL (host
 * memory). Lock held. */
static const struct local_pool *src_device_pool(const struct local *l, const uint8_t *src,
                                                uint64_t len)
{
    /* By address: a CUDA pool's device pointers never alias host memory (UVA). */
    uintptr_t a = (uintptr_t)src;
    for (uint32_t i = 0; i < l->npools; i++) {
        const struct local_pool *p = &l->pools[i];
        uint64_t size = (uint64_t)p->page_size * p->page_count;
        uintptr_t b = (uintptr_t)p->base;
        if (p->dev && a >= b && (uint64_t)(a - b) <= size && len <= size - (uint64_t)(a - b))
            return p;
    }
    return NULL;
}

/* One write, outside the lock. A device side goes through the pool's copy
 * functions, device to device through `*bounce` (allocated on first use). */
static int copy_one(const struct kvf_xfer *x, uint8_t *dst, struct local_pool dpool,
                    struct local_pool spool, uint8_t **bounce)
{
    uint64_t dat = (uint64_t)(dst - dpool.base);
    uint64_t sat = spool.dev ? (uint64_t)((const uint8_t *)x->src - spool.base) : 0;
    if (!dpool.dev && !spool.dev) {
        memcpy(dst, x->src, x->len);
        return 0;
    }
    if (!spool.dev)
        return kvf_pool_write(dpool.dev, dat, x->src, x->len);
    if (!dpool.dev)
        return kvf_pool_read(spool.dev, sat, dst, x->len);
    if (!*bounce && !(*bounce = malloc(LOCAL_BOUNCE_SIZE)))
        return -ENOMEM;
    for (uint64_t done = 0; done < x->len;) {
        size_t n = x->len - done < LOCAL_BOUNCE_SIZE ? (size_t)(x->len - done) : LOCAL_BOUNCE_SIZE;
        int rc = kvf_pool_read(spool.dev, sat + done, *bounce, n);
        if (rc == 0)
            rc = kvf_pool_write(dpool.dev, dat + done, *bounce, n);
        if (rc != 0)
            return rc;
        done += n;
    }
    return 0;
}

static bool overlaps_copying(const struct local *l, const struct kvf_xfer *x)
{
    const uint8_t *a = dest_of(l, x);
    for (const struct kvf_xfer *c = l->copying; c; c = c->tnext) {
        const uint8_t *b = dest_of(l, c);
        if (a < b + c->len && b < a + x->len)
            return true;
    }
    return false;
}

static void *worker(void *arg)
{
    struct local *l = arg;
    uint8_t *bounce = NULL;
    pthread_mutex_lock(&l->lock);
    for (;;) {
        struct kvf_xfer *x = l->q_head;
        if (l->stop)
            break;
        if (!x || l->hold || overlaps_copying(l, x)) {
            pthread_cond_wait(&l->work, &l->lock);
            continue;
        }
        l->q_head = x->tnext;
        if (!l->q_head)
            l->q_tail = NULL;
        l->st.queued--;
        x->tnext = l->copying;
        l->copying = x;
        l->st.copying++;
        /* Copies of the pool records: the pools stay registered while a
         * write into them runs (local.h), the array may change. The
         * destination's bounds were checked at post (dest_of). */
        struct local_pool dpool = *pool_find(l, x->sink_pool);
        uint8_t *dst = dpool.base + (uint64_t)x->first_page * dpool.page_size + x->offset;
        const struct local_pool *sp = src_device_pool(l, x->src, x->len);
        struct local_pool spool = sp ? *sp : (struct local_pool){0};
        pthread_mutex_unlock(&l->lock);

        int rc = copy_one(x, dst, dpool, spool, &bounce);

        pthread_mutex_lock(&l->lock);
        for (struct kvf_xfer **pp = &l->copying; *pp; pp = &(*pp)->tnext) {
            if (*pp == x) {
                *pp = x->tnext;
                break;
            }
        }
        l->st.copying--;
        if (rc == 0) {
            l->st.copied++;
            done_push(l, x, KVF_LT_DONE_OK);
        } else {
            l->st.failed++;
            done_push(l, x, KVF_LT_DONE_ERROR);
            x->tstatus = rc;
        }
        pthread_cond_broadcast(&l->idle);
        pthread_cond_broadcast(&l->work); /* an overlapping write may go now */
    }
    pthread_mutex_unlock(&l->lock);
    free(bounce);
    return NULL;
}

/* Moves every queued write of `peer` (all of them when `all`) to the done
 * list as FLUSHED. Lock held. */
static void flush_queued(struct local *l, uint32_t peer, bool all)
{
    struct kvf_xfer **pp = &l->q_head;
    struct kvf_xfer *last = NULL;
    while (*pp) {
        struct kvf_xfer *x = *pp;
        if (all || x->peer == peer) {
            *pp = x->tnext;
            l->st.queued--;
            l->st.flushed++;
            done_push(l, x, KVF_LT_DONE_FLUSHED);
        } else {
            last = x;
            pp = &x->tnext;
        }
    }
    l->q_tail = last;
}

static int local_post_write(struct kvf_transport *t, struct kvf_xfer *x)
{
    struct local *l = local_of(t);
    int rc = 0;
    pthread_mutex_lock(&l->lock);
    if (l->stop)
        rc = -ESHUTDOWN;
    else if (x->peer >= l->opts.max_peers || !l->peer_known[x->peer])
        rc = -ENOENT;
    else if (l->peer_fenced[x->peer])
        rc = -ESTALE;
    else if (!x->src)
        rc = -EINVAL;
    else if (!pool_find(l, x->sink_pool))
        rc = -ENOENT;
    else if (!dest_of(l, x))
        rc = -EINVAL;
    if (rc == 0) {
        x->tnext = NULL;
        if (l->q_tail)
            l->q_tail->tnext = x;
        else
            l->q_head = x;
        l->q_tail = x;
        l->st.queued++;
        l->st.posted++;
        pthread_cond_signal(&l->work);
    }
    pthread_mutex_unlock(&l->lock);
    return rc;
}

static int local_poll(struct kvf_transport *t, unsigned max, struct kvf_completion *out)
{
    struct local *l = local_of(t);
    unsigned n = 0;
    pthread_mutex_lock(&l->lock);
    while (n < max && l->d_head) {
        struct kvf_xfer *x = l->d_head;
        l->d_head = x->tnext;
        if (!l->d_head)
            l->d_tail = NULL;
        l->st.done--;
        out[n].xfer = x;
        out[n].outcome = (enum kvf_lt_outcome)x->toutcome;
        out[n].status = x->tstatus;
        n++;
    }
    pthread_mutex_unlock(&l->lock);
    /* Retire outside the lock: the drained flag goes to the poller. */
    for (unsigned i = 0; i < n; i++)
        out[i].drained = kvf_lt_op_retire(&out[i].xfer->op, out[i].outcome);
    return (int)n;
}

static int local_fence_peer(struct kvf_transport *t, uint32_t peer)
{
    struct local *l = local_of(t);
    pthread_mutex_lock(&l->lock);
    if (peer >= l->opts.max_peers || !l->peer_known[peer]) {
        pthread_mutex_unlock(&l->lock);
        return -ENOENT;
    }
    l->peer_fenced[peer] = 1;
    flush_queued(l, peer, false);
    for (;;) {
        bool busy = false;
        for (const struct kvf_xfer *c = l->copying; c && !busy; c = c->tnext)
            busy = c->peer == peer;
        if (!busy)
            break;
        pthread_cond_wait(&l->idle, &l->lock);
    }
    pthread_mutex_unlock(&l->lock);
    return 0;
}

static void stop_workers(struct local *l, unsigned started)
{
    pthread_mutex_lock(&l->lock);
    l->stop = true;
    pthread_cond_broadcast(&l->work);
    pthread_mutex_unlock(&l->lock);
    for (unsigned i = 0; i < started; i++)
        pthread_join(l->threads[i], NULL);
}

static void local_free(struct local *l)
{
    kvf_wake_close(l->d_wake);
    pthread_cond_destroy(&l->idle);
    pthread_cond_destroy(&l->work);
    pthread_mutex_destroy(&l->lock);
    free(l->pools);
    free(l->peer_known);
    free(l->peer_fenced);
    free(l);
}

static void local_destroy(struct kvf_transport *t)
{
    if (!t)
        return;
    struct local *l = local_of(t);
    /* A worker finishes the copy it is in before it sees `stop`: joined, no
     * write can run any more. Then what is queued is flushed and every
     * completion nobody polled is retired. */
    stop_workers(l, l->nthreads);
    pthread_mutex_lock(&l->lock);
    flush_queued(l, 0, true);
    pthread_mutex_unlock(&l->lock);
    struct kvf_completion c[32];
    while (local_poll(t, 32, c) > 0) {
    }
    local_free(l);
}

static int local_wake_fd(struct kvf_transport *t)
{
    return local_of(t)->d_wake;
}

static void local_wake_ack(struct kvf_transport *t)
{
    kvf_wake_clear(local_of(t)->d_wake);
}

static int local_ops_add_pool(struct kvf_transport *t, const struct kvf_transport_pool *p,
                              uint64_t *key_p)
{
    int rc = p->dev ? kvf_transport_local_add_device_pool(t, p->id, p->dev)
                    : kvf_transport_local_add_pool(t, p->id, p->base, p->page_size, p->page_count);
    if (rc == 0 && key_p)
        *key_p = 0;
    return rc;
}

static const struct kvf_transport_ops local_ops = {
    .name = "local",
    .post_write = local_post_write,
    .poll = local_poll,
    .fence_peer = local_fence_peer,
    .destroy = local_destroy,
    .wake_fd = local_wake_fd,
    .wake_ack = local_wake_ack,
    .add_pool = local_ops_add_pool,
    .remove_pool = kvf_transport_local_remove_pool,
};

void kvf_transport_local_opts_init(struct kvf_transport_local_opts *opts)
{
    memset(opts, 0, sizeof *opts);
    opts->threads = 1;
    opts->max_peers = 64;
    opts->max_pools = 64;
}

struct kvf_transport *kvf_transport_local_create(const struct kvf_transport_local_opts *opts)
{
    struct kvf_transport_local_opts def;
    if (!opts) {
        kvf_transport_local_opts_init(&def);
        opts = &def;
    }
    if (opts->threads == 0 || opts->threads > LOCAL_MAX_THREADS || opts->max_peers == 0 ||
        opts->max_pools == 0) {
        kvf_log("error", "kvf_transport_local_create: threads 1..%u, max_peers and max_pools >= 1",
                LOCAL_MAX_THREADS);
        return NULL;
    }
    struct local *l = calloc(1, sizeof *l + opts->threads * sizeof(pthread_t));
    if (!l)
        return NULL;
    l->base.ops = &local_ops;
    l->opts = *opts;
    l->pools = calloc(opts->max_pools, sizeof *l->pools);
    l->peer_known = calloc(opts->max_peers, 1);
    l->peer_fenced = calloc(opts->max_peers, 1);
    l->d_wake = kvf_wake_open();
    pthread_mutex_init(&l->lock, NULL);
    pthread_cond_init(&l->work, NULL);
    pthread_cond_init(&l->idle, NULL);
    if (!l->pools || !l->peer_known || !l->peer_fenced || l->d_wake < 0) {
        local_free(l);
        return NULL;
    }
    unsigned started = 0;
    for (; started < opts->threads; started++) {
        int rc = pthread_create(&l->threads[started], NULL, worker, l);
        if (rc != 0) {
            kvf_log("error", "kvf_transport_local_create: pthread_create: %s", strerror(rc));
            stop_workers(l, started);
            local_free(l);
            return NULL;
        }
    }
    l->nthreads = opts->threads;
    return &l->base;
}

static int local_add_pool(struct kvf_transport *t, uint32_t pool_id, void *mem,
                          struct kvf_pool *dev, uint32_t page_size, uint32_t page_count)
{
    struct local *l = local_of(t);
    if (!mem || page_size == 0 || page_count == 0 ||
        (uint64_t)page_size * page_count > (uint64_t)SIZE_MAX)
        return -EINVAL;
    int rc = 0;
    pthread_mutex_lock(&l->lock);
    if (pool_find(l, pool_id))
        rc = -EEXIST;
    else if (l->npools == l->opts.max_pools)
        rc = -E2BIG;
    else
        l->pools[l->npools++] = (struct local_pool){pool_id, dev, mem, page_size, page_count};
    pthread_mutex_unlock(&l->lock);
    return rc;
}

int kvf_transport_local_add_pool(struct kvf_transport *t, uint32_t pool_id, void *mem,
                                 uint32_t page_size, uint32_t page_count)
{
    return local_add_pool(t, pool_id, mem, NULL, page_size, page_count);
}

int kvf_transport_local_add_device_pool(struct kvf_transport *t, uint32_t pool_id,
                                        struct kvf_pool *pool)
{
    if (!pool)
        return -EINVAL;
    return local_add_pool(t, pool_id, kvf_pool_page(pool, 0), pool, kvf_pool_page_size(pool),
                          kvf_pool_page_count(pool));
}

int kvf_transport_local_remove_pool(struct kvf_transport *t, uint32_t pool_id)
{
    struct local *l = local_of(t);
    int rc = -ENOENT;
    pthread_mutex_lock(&l->lock);
    for (uint32_t i = 0; i < l->npools; i++) {
        if (l->pools[i].id == pool_id) {
            l->pools[i] = l->pools[--l->npools];
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&l->lock);
    return rc;
}

int kvf_transport_local_add_peer(struct kvf_transport *t, uint32_t peer)
{
    struct local *l = local_of(t);
    if (peer >= l->opts.max_peers)
        return -EINVAL;
    pthread_mutex_lock(&l->lock);
    l->peer_known[peer] = 1;
    pthread_mutex_unlock(&l->lock);
    return 0;
}

void kvf_transport_local_set_hold(struct kvf_transport *t, bool hold)
{
    struct local *l = local_of(t);
    pthread_mutex_lock(&l->lock);
    l->hold = hold;
    pthread_cond_broadcast(&l->work);
    pthread_mutex_unlock(&l->lock);
}

void kvf_transport_local_stats(struct kvf_transport *t, struct kvf_transport_local_stats *out)
{
    struct local *l = local_of(t);
    pthread_mutex_lock(&l->lock);
    *out = l->st;
    pthread_mutex_unlock(&l->lock);
}
