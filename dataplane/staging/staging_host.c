/*
 * staging_host.c: the host staging engine. Copies are plain memcpy between
 * host regions, run by a few worker threads so that the pipeline thread that
 * submits never waits for a multi-megabyte copy. It serves nodes without CUDA
 * (host shared-memory pools) and the tests.
 *
 * DESIGN: three kinds of state, three owners.
 * - The submit queue (FIFO, mutex + condition variable) is shared by the owner
 *   thread, which appends in copy_async, and the workers, which take from it.
 *   The lock is held only to link or unlink one record.
 * - The done stack is a lock-free LIFO (one atomic pointer): a worker pushes a
 *   finished copy with a CAS; poll takes the whole stack with one exchange, so
 *   poll never blocks behind a worker.
 * - The ready list (what poll took but could not return yet, oldest first)
 *   belongs to the owner thread alone.
 * Ordering: copies may finish in any order (several workers); each is handed
 * back exactly once. A worker touches a copy for the last time in its push;
 * after that only the owner thread does. Destroy (called by the wrapper only
 * with nothing in flight) stops and joins the workers before freeing.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "staging_internal.h"
#include "kvf_log.h"

#define HOST_MAX_THREADS 64u

struct staging_host {
    struct kvf_staging base; /* first */

    pthread_mutex_t lock; /* submit queue and `stop` */
    pthread_cond_t cond;
    struct kvf_stage_copy *q_head;
    struct kvf_stage_copy *q_tail;
    bool stop;

    _Atomic(struct kvf_stage_copy *) done; /* LIFO pushed by workers */

    struct kvf_stage_copy *ready_head; /* owner thread: taken from `done`, FIFO */
    struct kvf_stage_copy *ready_tail;

    unsigned nthreads;
    pthread_t threads[];
};

static void *host_worker(void *arg)
{
    struct staging_host *h = arg;
    for (;;) {
        pthread_mutex_lock(&h->lock);
        while (h->q_head == NULL && !h->stop)
            pthread_cond_wait(&h->cond, &h->lock);
        struct kvf_stage_copy *c = h->q_head;
        if (c == NULL) { /* stop, and nothing left to copy */
            pthread_mutex_unlock(&h->lock);
            return NULL;
        }
        h->q_head = c->snext;
        if (h->q_head == NULL)
            h->q_tail = NULL;
        pthread_mutex_unlock(&h->lock);

        c->status = staging_host_copy(c);

        struct kvf_stage_copy *top = atomic_load_explicit(&h->done, memory_order_relaxed);
        do {
            c->snext = top;
        } while (!atomic_compare_exchange_weak_explicit(&h->done, &top, c, memory_order_release,
                                                        memory_order_relaxed));
    }
}

static int host_copy_async(struct kvf_staging *s, struct kvf_stage_copy *c)
{
    struct staging_host *h = (struct staging_host *)s;
    c->snext = NULL;
    pthread_mutex_lock(&h->lock);
    if (h->q_tail != NULL)
        h->q_tail->snext = c;
    else
        h->q_head = c;
    h->q_tail = c;
    pthread_cond_signal(&h->cond);
    pthread_mutex_unlock(&h->lock);
    return 0;
}

static int host_poll(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done)
{
    struct staging_host *h = (struct staging_host *)s;
    struct kvf_stage_copy *stack = atomic_exchange_explicit(&h->done, NULL, memory_order_acquire);
    /* The stack is newest first: reverse it, then append to the ready list. */
    struct kvf_stage_copy *fifo = NULL;
    struct kvf_stage_copy *last = stack;
    while (stack != NULL) {
        struct kvf_stage_copy *next = stack->snext;
        stack->snext = fifo;
        fifo = stack;
        stack = next;
    }
    if (fifo != NULL) {
        if (h->ready_tail != NULL)
            h->ready_tail->snext = fifo;
        else
            h->ready_head = fifo;
        h->ready_tail = last;
    }
    unsigned n = 0;
    while (n < max && h->ready_head != NULL) {
        struct kvf_stage_copy *c = h->ready_head;
        h->ready_head = c->snext;
        if (h->ready_head == NULL)
            h->ready_tail = NULL;
        c->snext = NULL;
        done[n++] = c;
    }
    return (int)n;
}

static void host_stop_and_join(struct staging_host *h, unsigned started)
{
    pthread_mutex_lock(&h->lock);
    h->stop = true;
    pthread_cond_broadcast(&h->cond);
    pthread_mutex_unlock(&h->lock);
    for (unsigned i = 0; i < started; i++)
        pthread_join(h->threads[i], NULL);
}

static void host_destroy(struct kvf_staging *s)
{
    struct staging_host *h = (struct staging_host *)s;
    host_stop_and_join(h, h->nthreads);
    pthread_cond_destroy(&h->cond);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

static const struct kvf_staging_ops host_ops = {
    .name = "host",
    .copy_async = host_copy_async,
    .poll = host_poll,
    .destroy = host_destroy,
};

void kvf_staging_host_opts_init(struct kvf_staging_host_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->threads = 2;
}

struct kvf_staging *kvf_staging_host_create(const struct kvf_staging_host_opts *opts)
{
    struct kvf_staging_host_opts def;
    if (opts == NULL) {
        kvf_staging_host_opts_init(&def);
        opts = &def;
    }
    if (opts->threads == 0 || opts->threads > HOST_MAX_THREADS) {
        kvf_log("error", "kvf_staging_host_create: threads must be 1..%u, not %u", HOST_MAX_THREADS,
                opts->threads);
        return NULL;
    }
    struct staging_host *h = calloc(1, sizeof(*h) + opts->threads * sizeof(pthread_t));
    if (h == NULL) {
        kvf_log("error", "kvf_staging_host_create: out of memory");
        return NULL;
    }
    staging_base_init(&h->base, &host_ops);
    atomic_init(&h->done, NULL);
    if (pthread_mutex_init(&h->lock, NULL) != 0)
        goto err_free;
    if (pthread_cond_init(&h->cond, NULL) != 0)
        goto err_destroy_lock;
    unsigned started = 0;
    for (; started < opts->threads; started++) {
        int rc = pthread_create(&h->threads[started], NULL, host_worker, h);
        if (rc != 0) {
            kvf_log("error", "kvf_staging_host_create: pthread_create: %s", strerror(rc));
            goto err_join_workers;
        }
    }
    h->nthreads = opts->threads;
    return &h->base;

err_join_workers:
    host_stop_and_join(h, started);
    pthread_cond_destroy(&h->cond);
err_destroy_lock:
    pthread_mutex_destroy(&h->lock);
err_free:
    free(h);
    return NULL;
}
