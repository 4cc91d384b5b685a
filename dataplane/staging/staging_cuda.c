/*
 * staging_cuda.c: the CUDA staging engine (built only with KVF_HAVE_CUDA).
 * Each copy is one cudaMemcpyAsync (cudaMemcpyDefault: either side may be
 * device memory or pinned host memory, unified addressing tells them apart)
 * on one of a few dedicated non-blocking streams, followed by a cudaEvent
 * recorded on the same stream. poll asks each stream's oldest event with
 * cudaEventQuery and hands back the copies whose events completed; a stream
 * runs its work in order, so the first event not ready ends that stream's
 * scan. Events are recycled through a free list. Pinned staging memory comes
 * from cudaHostAlloc (kvf_staging_cuda_host_alloc).
 *
 * Plain C against the CUDA runtime API (no .cu file, no nvcc).
 *
 * DESIGN: one owner thread submits and polls (the runtime calls are thread
 * safe, the per-stream queues and the event free list are not shared). Each
 * entry point sets the calling thread's current device first. An error from
 * cudaMemcpyAsync or cudaEventRecord before anything was queued returns -EIO
 * (the caller cancels the op). An error reported by cudaEventQuery (a sticky
 * context error) means the stream's work is dead, i.e. stopped: the copy is
 * handed back as an error. Destroy runs with nothing in flight, synchronises
 * the streams anyway, and frees events and streams.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "staging_internal.h"
#include "kvf_log.h"

#define CUDA_MAX_STREAMS 16u

struct cuda_event_node {
    cudaEvent_t ev;
    struct cuda_event_node *next;
};

struct cuda_stream_q {
    cudaStream_t stream;
    struct kvf_stage_copy *head; /* FIFO linked by snext; spriv = its event node */
    struct kvf_stage_copy *tail;
};

struct staging_cuda {
    struct kvf_staging base; /* first */
    int device;
    unsigned nstreams;
    unsigned next_stream;
    struct cuda_event_node *free_events;
    struct cuda_stream_q q[];
};

static int cuda_set_device(struct staging_cuda *g, const char *what)
{
    cudaError_t ce = cudaSetDevice(g->device);
    if (ce != cudaSuccess) {
        kvf_log("error", "staging cuda %s: cudaSetDevice(%d): %s", what, g->device,
                cudaGetErrorString(ce));
        return -EIO;
    }
    return 0;
}

static struct cuda_event_node *cuda_event_get(struct staging_cuda *g)
{
    struct cuda_event_node *n = g->free_events;
    if (n != NULL) {
        g->free_events = n->next;
        return n;
    }
    n = calloc(1, sizeof(*n));
    if (n == NULL)
        return NULL;
    cudaError_t ce = cudaEventCreateWithFlags(&n->ev, cudaEventDisableTiming);
    if (ce != cudaSuccess) {
        kvf_log("error", "staging cuda: cudaEventCreate: %s", cudaGetErrorString(ce));
        free(n);
        return NULL;
    }
    return n;
}

static void cuda_event_put(struct staging_cuda *g, struct cuda_event_node *n)
{
    n->next = g->free_events;
    g->free_events = n;
}

static int cuda_copy_async(struct kvf_staging *s, struct kvf_stage_copy *c)
{
    struct staging_cuda *g = (struct staging_cuda *)s;
    int rc = cuda_set_device(g, "copy");
    if (rc != 0)
        return rc;
    struct cuda_event_node *en = cuda_event_get(g);
    if (en == NULL)
        return -ENOMEM;
    struct cuda_stream_q *q = &g->q[g->next_stream];
    g->next_stream = (g->next_stream + 1) % g->nstreams;

    cudaError_t ce = cudaSuccess;
    if (c->len > 0)
        ce = cudaMemcpyAsync(c->dst, c->src, c->len, cudaMemcpyDefault, q->stream);
    if (ce == cudaSuccess)
        ce = cudaEventRecord(en->ev, q->stream);
    if (ce != cudaSuccess) {
        /* An enqueue error: nothing of this call runs (a copy queued before a
         * failed record would still be covered by the next event on the stream,
         * which the caller's later copies or destroy's synchronize wait for). */
        kvf_log("error", "staging cuda: enqueue of %zu bytes: %s", c->len, cudaGetErrorString(ce));
        cuda_event_put(g, en);
        return -EIO;
    }
    c->spriv = en;
    c->snext = NULL;
    if (q->tail != NULL)
        q->tail->snext = c;
    else
        q->head = c;
    q->tail = c;
    return 0;
}

static int cuda_poll(struct kvf_staging *s, unsigned max, struct kvf_stage_copy **done)
{
    struct staging_cuda *g = (struct staging_cuda *)s;
    if (cuda_set_device(g, "poll") != 0)
        return 0;
    unsigned n = 0;
    for (unsigned i = 0; i < g->nstreams && n < max; i++) {
        struct cuda_stream_q *q = &g->q[(g->next_stream + i) % g->nstreams];
        while (q->head != NULL && n < max) {
            struct kvf_stage_copy *c = q->head;
            struct cuda_event_node *en = c->spriv;
            cudaError_t ce = cudaEventQuery(en->ev);
            if (ce == cudaErrorNotReady)
                break;
            c->status = ce == cudaSuccess ? 0 : -EIO;
            if (ce != cudaSuccess)
                kvf_log("error", "staging cuda: copy of %zu bytes failed: %s", c->len,
                        cudaGetErrorString(ce));
            q->head = c->snext;
            if (q->head == NULL)
                q->tail = NULL;
            c->snext = NULL;
            c->spriv = NULL;
            cuda_event_put(g, en);
            done[n++] = c;
        }
    }
    return (int)n;
}

static void cuda_free_all(struct staging_cuda *g, unsigned streams_made)
{
    for (unsigned i = 0; i < streams_made; i++) {
        cudaError_t ce = cudaStreamSynchronize(g->q[i].stream);
        if (ce == cudaSuccess)
            ce = cudaStreamDestroy(g->q[i].stream);
        if (ce != cudaSuccess)
            kvf_log("error", "staging cuda destroy: stream %u: %s", i, cudaGetErrorString(ce));
    }
    while (g->free_events != NULL) {
        struct cuda_event_node *en = g->free_events;
        g->free_events = en->next;
        cudaEventDestroy(en->ev);
        free(en);
    }
    free(g);
}

static void cuda_destroy(struct kvf_staging *s)
{
    struct staging_cuda *g = (struct staging_cuda *)s;
    cuda_set_device(g, "destroy");
    cuda_free_all(g, g->nstreams);
}

static const struct kvf_staging_ops cuda_ops = {
    .name = "cuda",
    .copy_async = cuda_copy_async,
    .poll = cuda_poll,
    .destroy = cuda_destroy,
};

void kvf_staging_cuda_opts_init(struct kvf_staging_cuda_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->device = 0;
    opts->streams = 2;
}

struct kvf_staging *kvf_staging_cuda_create(const struct kvf_staging_cuda_opts *opts)
{
    struct kvf_staging_cuda_opts def;
    if (opts == NULL) {
        kvf_staging_cuda_opts_init(&def);
        opts = &def;
    }
    if (opts->streams == 0 || opts->streams > CUDA_MAX_STREAMS || opts->device < 0) {
        kvf_log("error", "kvf_staging_cuda_create: streams must be 1..%u and device >= 0",
                CUDA_MAX_STREAMS);
        return NULL;
    }
    int ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess || ndev <= opts->device) {
        kvf_log("error", "kvf_staging_cuda_create: no CUDA device %d (%s, %d devices)",
                opts->device, ce != cudaSuccess ? cudaGetErrorString(ce) : "ok", ndev);
        return NULL;
    }
    struct staging_cuda *g = calloc(1, sizeof(*g) + opts->streams * sizeof(struct cuda_stream_q));
    if (g == NULL) {
        kvf_log("error", "kvf_staging_cuda_create: out of memory");
        return NULL;
    }
    staging_base_init(&g->base, &cuda_ops);
    g->device = opts->device;
    g->nstreams = opts->streams;
    if (cuda_set_device(g, "create") != 0)
        goto err_free;
    unsigned made = 0;
    for (; made < g->nstreams; made++) {
        ce = cudaStreamCreateWithFlags(&g->q[made].stream, cudaStreamNonBlocking);
        if (ce != cudaSuccess) {
            kvf_log("error", "kvf_staging_cuda_create: cudaStreamCreate: %s",
                    cudaGetErrorString(ce));
            goto err_destroy_streams;
        }
    }
    return &g->base;

err_destroy_streams:
    cuda_free_all(g, made);
    return NULL;
err_free:
    free(g);
    return NULL;
}

int kvf_staging_cuda_host_alloc(size_t size, void **mem_p)
{
    void *p = NULL;
    cudaError_t ce = cudaHostAlloc(&p, size, cudaHostAllocPortable);
    if (ce != cudaSuccess) {
        kvf_log("error", "kvf_staging_cuda_host_alloc: %zu bytes: %s", size,
                cudaGetErrorString(ce));
        return -ENOMEM;
    }
    *mem_p = p;
    return 0;
}

void kvf_staging_cuda_host_free(void *mem)
{
    if (mem == NULL)
        return;
    cudaError_t ce = cudaFreeHost(mem);
    if (ce != cudaSuccess)
        kvf_log("error", "kvf_staging_cuda_host_free: %s", cudaGetErrorString(ce));
}
