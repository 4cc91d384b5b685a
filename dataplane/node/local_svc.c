/*
 * local_svc.c: NodeLocal, the engines' API on the node's unix socket
 * (RegisterPool, SubmitChunk; Watch is in watch.c), and the source side of a
 * transfer: a chunk is checked against the room's leases, split into frames,
 * each admitted into the room's lifetime and posted through the transport
 * xport.c picks (local for a sink on this node, TCP otherwise), or first
 * staged (xport.c); completions retire the frames, feed a local sink's landed
 * pages, and a source participant whose pairs all ended well is reported
 * Completed.
 *
 * DESIGN: the handlers run on gRPC CQ threads; they decode and check the
 * request's shape only, then post a job. The owner thread does the rest
 * (register_pool_run, submit_chunk_run) and completes the call; a job dropped
 * unrun fails its call UNAVAILABLE when its argument is freed.
 * The checks and the admission of a chunk are node_submit_chunk, which the
 * pipelined SubmitChunks stream (submit_stream.c) calls too.
 * Admission is per frame, just before its post: a frame is never posted for a
 * room whose admission is closed (docs/design.md §2.2). A chunk is admitted or
 * refused as a whole only when its first frame is; if admission closes or a
 * post fails part way, the frames already posted run to completion (they are
 * counted in the lifetime), the chunk counts as failed and the node reports
 * TransferFailed unless the room is aborting already. A staged or queued
 * frame may end inside node_submit_chunk itself (its copy or post failed at
 * once): the chunk is then ended there, after its bookkeeping, never by the
 * frame (node_chunk.submitting), and the call answers the failure.
 *
 * A chunk belongs to the pair (source rank, sink rank) it names
 * (struct node_pair, peer_link.c): chunk_seq rises per pair and last_chunk
 * ends the pair; the last chunk's aux bytes are kept with the pair and sent,
 * then the pair's TransferStatus, once its chunks completed.
 *
 * Device pools (CUDA IPC, or the tests' fake ones) and multi-buffer pools
 * are opened in devpool.c; a chunk from one towards another node needs
 * staging (its pages are copied to a host buffer before TCP sends them: for
 * a multi-buffer pool gathered from every buffer's slots), without it
 * FAILED_PRECONDITION.
 * UnregisterPool is in pool_admin.c. A sink pool whose page size (RoomUpdate) differs from
 * the source pool's is refused.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "devpool.h"
#include "kvf_error.h"
#include "kvf_fdpass.h"
#include "control_session.h"
#include "local_access.h"
#include "local_svc.h"
#include "node_log.h"
#include "node_metrics.h"
#include "node_owner.h"
#include "node_types.h"
#include "peer_link.h"
#include "watch.h"
#include "rdma.h"
#include "rdma_link.h"
#include "tcp.h"
#include "xport.h"
#include "xport_registry.h"

#define LOCAL_CQ_THREADS 2

/* ---- replies ------------------------------------------------------------------ */

/* A unary call's job argument: the decoded request, and the call until it
 * is answered. Freed after the owner ran it, or dropped unrun (the owner
 * stopped, or refused the post): then the call fails UNAVAILABLE. */
struct register_job {
    struct kvf_rpc_call *call; /* NULL once answered */
    Kvfence__V1__RegisterPoolRequest *reg;
};

struct submit_job {
    struct kvf_rpc_call *call; /* NULL once answered */
    Kvfence__V1__SubmitChunkRequest *submit;
};

static void fail(struct kvf_rpc_call **call, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail(struct kvf_rpc_call **call, int code, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvf_rpc_call_fail(*call, code, msg);
    *call = NULL;
}

static void register_job_free(void *arg)
{
    struct register_job *j = arg;
    if (j->call)
        kvf_rpc_call_fail(j->call, KVF_GRPC_UNAVAILABLE, "node shutting down");
    kvfence__v1__register_pool_request__free_unpacked(j->reg, NULL);
    free(j);
}

static void submit_job_free(void *arg)
{
    struct submit_job *j = arg;
    if (j->call)
        kvf_rpc_call_fail(j->call, KVF_GRPC_UNAVAILABLE, "node shutting down");
    kvfence__v1__submit_chunk_request__free_unpacked(j->submit, NULL);
    free(j);
}

/* ---- RegisterPool ------------------------------------------------------------- */

/* Owner thread: a RegisterPool job. */
static void register_pool_run(struct kvf_node *n, void *arg)
{
    struct register_job *j = arg;
    const Kvfence__V1__RegisterPoolRequest *req = j->reg;
    if (n->npools >= NODE_MAX_POOLS) {
        fail(&j->call, KVF_GRPC_RESOURCE_EXHAUSTED, "pools per node: limit %u", NODE_MAX_POOLS);
        return;
    }
    struct node_pool *p = &n->pools[n->npools];
    memset(p, 0, sizeof *p);
    char why[300];
    int rc = node_devpool_open(n, req, &p->pool, p->key, sizeof p->key, why, sizeof why);
    if (rc != 0) {
        fail(&j->call, rc, "%s", why);
        return;
    }
    p->base = kvf_pool_page(p->pool, 0);
    /* The memory's identity, stable across restarts of this node: the
     * control plane maps the memory registered again to the pages that
     * leases of an older incarnation still hold. Host memory is named by the
     * kernel (devpool.h), whatever the engine says: an engine cannot give
     * one memory two names and lease a page twice. Device memory has no such
     * name: there the engine's key is what there is. */
    if (p->key[0] == '\0' && req->pool_key && req->pool_key[0])
        snprintf(p->key, sizeof p->key, "%s", req->pool_key);
    for (uint32_t i = 0; i < n->npools && p->key[0]; i++) {
        if (strcmp(n->pools[i].key, p->key) == 0) {
            kvf_pool_close(p->pool);
            fail(&j->call, KVF_GRPC_ALREADY_EXISTS, "pool_key: memory '%s' is already pool %u",
                 p->key, n->pools[i].id);
            return;
        }
    }
    p->id = n->next_pool_id;
    p->page_size = kvf_pool_page_size(p->pool); /* of a multi-buffer pool: the sum */
    p->page_count = kvf_pool_page_count(p->pool);
    p->rank = req->rank;
    rc = node_xport_add_pool(n, p); /* every transport, or none */
    if (rc != 0) {
        kvf_pool_close(p->pool);
        fail(&j->call, KVF_GRPC_INTERNAL, "a transport refused the pool: %s", strerror(-rc));
        return;
    }
    n->next_pool_id++;
    n->npools++;
    char bufs[32];
    snprintf(bufs, sizeof bufs, "(%zu buffers)", req->n_buffers);
    node_log("info", NULL, "pool %u registered: %s %s, %u pages of %u bytes, rank %u", p->id,
             node_devpool_kind_name(p),
             req->n_buffers > 0 ? bufs
             : req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM
                 ? req->host_shm->shm_name
             : req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD
                 ? "(a descriptor handed over)"
                 : "(device memory)",
             p->page_count, p->page_size, p->rank);

    Kvfence__V1__Pool pool;
    node_pool_to_wire(p, &pool);
    /* The control plane learns the pool now, or from the next Hello. */
    node_session_send_pool_added(n, &pool);

    Kvfence__V1__RegisterPoolResponse resp = KVFENCE__V1__REGISTER_POOL_RESPONSE__INIT;
    resp.pool = &pool;
    /* The pool's key makes the answer as long as the key is: pack it in a
     * buffer of its size. */
    size_t len = kvfence__v1__register_pool_response__get_packed_size(&resp);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        fail(&j->call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory answering RegisterPool");
        return;
    }
    kvfence__v1__register_pool_response__pack(&resp, buf);
    kvf_rpc_call_reply(j->call, buf, len);
    free(buf);
    j->call = NULL;
}

/* ---- SubmitChunk --------------------------------------------------------------- */

static struct node_member *member_find(struct node_room *r, const char *node_id, uint32_t rank,
                                       int role)
{
    for (size_t i = 0; i < r->nmembers; i++) {
        struct node_member *m = &r->members[i];
        if (m->rank == rank && m->role == role && strcmp(m->node_id, node_id) == 0)
            return m;
    }
    return NULL;
}

/* Whether `node_id` is a node the room's update introduced none of whose
 * members is known here yet (published once it acknowledged the room). */
static bool sink_unpublished(const struct node_room *r, const char *node_id)
{
    bool introduced = false;
    for (size_t i = 0; i < r->nintro && !introduced; i++)
        introduced = strcmp(r->intro[i].node_id, node_id) == 0;
    for (size_t i = 0; introduced && i < r->nmembers; i++)
        if (strcmp(r->members[i].node_id, node_id) == 0)
            return false;
    return introduced;
}

static uint64_t pages_of(Kvfence__V1__PageRange **rv, size_t n)
{
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += rv[i]->count;
    return s;
}

/* Pages of `rv` inside `m`'s lease; -1 names the first range that is not. */
static ssize_t ranges_outside(const struct node_member *m, Kvfence__V1__PageRange **rv, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (rv[i]->count == 0 ||
            !node_ranges_cover(m->ranges, m->nranges, rv[i]->first, rv[i]->count))
            return (ssize_t)i;
    return -1;
}

/* Walks source and sink ranges together and calls `emit` once per frame: a run
 * of pages contiguous on both sides, at most `max_pages` long. */
struct walk {
    Kvfence__V1__PageRange **src, **dst;
    size_t nsrc, ndst, si, di;
    uint32_t soff, doff;
};

static bool walk_next(struct walk *w, uint32_t max_pages, uint32_t *sfirst, uint32_t *dfirst,
                      uint32_t *count)
{
    if (w->si >= w->nsrc || w->di >= w->ndst)
        return false;
    uint32_t sleft = w->src[w->si]->count - w->soff;
    uint32_t dleft = w->dst[w->di]->count - w->doff;
    uint32_t c = sleft < dleft ? sleft : dleft;
    if (c > max_pages)
        c = max_pages;
    *sfirst = w->src[w->si]->first + w->soff;
    *dfirst = w->dst[w->di]->first + w->doff;
    *count = c;
    w->soff += c;
    w->doff += c;
    if (w->soff == w->src[w->si]->count) {
        w->si++;
        w->soff = 0;
    }
    if (w->doff == w->dst[w->di]->count) {
        w->di++;
        w->doff = 0;
    }
    return true;
}

/* The chunk record and its frames (one per walk step), nothing admitted. */
static struct node_chunk *chunk_new(struct node_room *r, const struct node_member *src,
                                    const struct node_member *sink, const struct node_pool *pool,
                                    const Kvfence__V1__SubmitChunkRequest *req,
                                    const struct node_route *rt)
{
    /* RDMA: one slice per WR (its own lifetime op), at most KVF_RDMA_MAX_SLICE.
     * From a multi-buffer pool one slice per buffer and run of pages (its
     * slots are back to back in the buffer, and in the sink's buffer), the
     * run bounded by the largest slot. */
    uint32_t frame_max = rt->kind == KVF_LT_OP_RDMA_WR ? KVF_RDMA_MAX_SLICE : NODE_FRAME_MAX;
    uint32_t nb = rt->kind == KVF_LT_OP_RDMA_WR ? kvf_pool_buffer_count(pool->pool) : 0;
    uint32_t unit = pool->page_size;
    for (uint32_t k = 0; k < nb; k++)
        unit = k == 0 || kvf_pool_page_size(kvf_pool_buffer(pool->pool, k)) > unit
                   ? kvf_pool_page_size(kvf_pool_buffer(pool->pool, k))
                   : unit;
    uint32_t per = nb ? nb : 1; /* frames per walk step */
    uint32_t max_pages = frame_max / unit;
    if (max_pages == 0)
        max_pages = 1;
    struct walk w = {
        req->source_ranges, req->sink_ranges, req->n_source_ranges, req->n_sink_ranges, 0, 0, 0, 0};
    uint32_t nframes = 0, a, b, c;
    struct walk w2 = w;
    while (walk_next(&w2, max_pages, &a, &b, &c))
        nframes += per;
    struct node_chunk *ch = calloc(1, sizeof *ch + nframes * sizeof(struct node_frame));
    if (!ch)
        return NULL;
    ch->room = r;
    ch->src_rank = src->rank;
    ch->sink_rank = sink->rank;
    ch->sink_local = sink->local;
    ch->seq = req->chunk_seq;
    ch->nframes = nframes;
    for (uint32_t i = 0; i < nframes && walk_next(&w, max_pages, &a, &b, &c); i += per) {
        for (uint32_t k = 0; k < per; k++) {
            struct node_frame *f = &ch->frames[i + k];
            f->chunk = ch;
            f->t = rt->t;
            f->kind = rt->kind;
            struct kvf_xfer *x = &f->x;
            x->peer = rt->peer;
            x->room = r->key;
            x->first_page = b;
            x->page_count = c;
            x->offset = 0;
            x->layout = kvf_pool_layout(pool->pool); /* the sink refuses another layout (tcp.h) */
            if (nb) { /* buffer k's slots of pages [a, a + c), read by the NIC itself */
                const struct kvf_pool *buf = kvf_pool_buffer(pool->pool, k);
                f->src = (uint8_t *)kvf_pool_page(buf, a);
                x->src = f->src;
                x->len = (uint64_t)c * kvf_pool_page_size(buf);
                x->sink_pool = NODE_RDMA_SUB_ID(sink->pool_id, k);
                continue;
            }
            f->src = pool->base + (uint64_t)a * pool->page_size;
            if (node_devpool_is(pool)) { /* staged through kvf_pool_read (xport.c) */
                f->src_dev = pool->pool;
                f->src_offset = (uint64_t)a * pool->page_size;
            }
            x->src = f->src;
            x->len = (uint64_t)c * pool->page_size;
            x->sink_pool = sink->pool_id;
        }
    }
    return ch;
}

static void chunk_end(struct kvf_node *n, struct node_chunk *ch);

/* The chunk's source participant failed: report it once. */
static void source_failed(struct kvf_node *n, struct node_chunk *ch, const char *why)
{
    struct node_member *src =
        member_find(ch->room, n->node_id, ch->src_rank, KVFENCE__V1__ROLE__ROLE_SOURCE);
    if (!src || src->failed)
        return;
    src->failed = true;
    node_session_send_transfer_failed(n, ch->room, src->rank, src->role, why);
}

/* A refused (or partly admitted) chunk: its code and message. */
static void refuse(struct node_submit_out *o, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void refuse(struct node_submit_out *o, int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->msg, sizeof o->msg, fmt, ap);
    va_end(ap);
    o->err = err;
    o->code = node_local_status(err);
}

int node_local_status(int err)
{
    switch (err) {
    case 0:
        return KVF_GRPC_OK;
    case -EINVAL:
        return KVF_GRPC_INVALID_ARGUMENT; /* the request itself is wrong */
    case -ENOENT:
        return KVF_GRPC_NOT_FOUND;
    case -EPERM:
        return KVF_GRPC_PERMISSION_DENIED;
    case -EEXIST:
        return KVF_GRPC_ALREADY_EXISTS; /* a chunk_seq seen already */
    case -EAGAIN:
        return KVF_GRPC_UNAVAILABLE; /* the node will know more soon: retry */
    case -ECANCELED:
    case -ESTALE:
        return KVF_GRPC_ABORTED; /* the room is aborting, closed or late here */
    case -EPROTO:
        return KVF_GRPC_FAILED_PRECONDITION; /* the room's state does not allow it */
    case -ENOMEM:
        return KVF_GRPC_RESOURCE_EXHAUSTED;
    default:
        return KVF_GRPC_INTERNAL;
    }
}

int node_submit_chunk(struct kvf_node *n, const Kvfence__V1__SubmitChunkRequest *req,
                      struct node_submit_out *o)
{
    o->msg[0] = '\0';
    kvf_room_key key = {req->room->room_id, req->room->generation};
    struct node_room *r = node_room_find(n, key);
    if (!r) {
        refuse(o, kvf_ncore_chunk_no_room(n->core, key, n->stop_requested), "%s",
               kvf_ncore_reason(n->core));
        return o->code;
    }
    /* The room's rules (node_core.h); the lease geometry is checked below. */
    const char *sink_node = req->sink_node_id ? req->sink_node_id : "";
    struct node_member *src = r->have_update ? member_find(r, n->node_id, req->source_rank,
                                                           KVFENCE__V1__ROLE__ROLE_SOURCE)
                                             : NULL;
    struct node_member *sink =
        r->have_update ? member_find(r, sink_node, req->sink_rank, KVFENCE__V1__ROLE__ROLE_SINK)
                       : NULL;
    struct node_pair *pair =
        src && sink && src->local ? node_pair_get(r, src->rank, sink, false) : NULL;
    struct kvf_ncore_chunk q = {
        .have_update = r->have_update,
        .src_local = src && src->local,
        .src_completed = src && src->completed,
        .src_failed = src && src->failed,
        .sink_known = sink != NULL,
        .sink_unpublished = !sink && r->have_update && sink_unpublished(r, sink_node),
        .pair_exists = pair != NULL,
        .pair_last_submitted = pair && pair->last_submitted,
        .pair_last_seq = pair ? pair->last_seq : 0,
        .seq = req->chunk_seq,
        .src_rank = req->source_rank,
        .sink_rank = req->sink_rank,
        .sink_node = sink_node,
    };
    int rc = kvf_ncore_chunk_state(n->core, &r->core, &q);
    if (rc != 0) {
        refuse(o, rc, "%s", kvf_ncore_reason(n->core));
        node_core_apply(n); /* a TransferFailed when the chunk dooms the room */
        return o->code;
    }
    if (req->source_pool_id != src->pool_id || req->sink_pool_id != sink->pool_id) {
        refuse(o, -EPROTO, "pools: the leases are in source pool %u and sink pool %u", src->pool_id,
               sink->pool_id);
        return o->code;
    }
    /* Right after ExtendLease the engine may know a lease version (its page
     * count) that this node's RoomUpdate has not brought yet: retryable. */
    if (req->source_lease_pages > src->pages || req->sink_lease_pages > sink->pages) {
        bool s_old = req->source_lease_pages > src->pages;
        refuse(o, -EAGAIN,
               "%s: the node's copy of the lease has %" PRIu64 " pages, the request names %" PRIu64
               ": its room update is on the way: retry",
               s_old ? "source_lease_pages" : "sink_lease_pages", s_old ? src->pages : sink->pages,
               s_old ? req->source_lease_pages : req->sink_lease_pages);
        return o->code;
    }
    ssize_t bad = ranges_outside(src, req->source_ranges, req->n_source_ranges);
    if (bad >= 0) {
        refuse(o, -EPROTO, "source_ranges[%zd]: outside the read lease", bad);
        return o->code;
    }
    bad = ranges_outside(sink, req->sink_ranges, req->n_sink_ranges);
    if (bad >= 0) {
        refuse(o, -EPROTO, "sink_ranges[%zd]: outside the write lease", bad);
        return o->code;
    }
    uint64_t npages = pages_of(req->source_ranges, req->n_source_ranges);
    if (npages != pages_of(req->sink_ranges, req->n_sink_ranges) || npages == 0) {
        refuse(o, -EINVAL, "source and sink sizes differ (or are 0)");
        return o->code;
    }
    rc = kvf_ncore_chunk_order(n->core, &q);
    if (rc != 0) {
        refuse(o, rc, "%s", kvf_ncore_reason(n->core));
        return o->code;
    }
    const struct node_pool *pool = node_pool_find(n, src->pool_id);
    if (!pool) {
        refuse(o, -EPROTO, "source pool %u is not registered", src->pool_id);
        return o->code;
    }
    /* Frames carry whole pages of the source's size: the sink's pages must
     * be the same size (an older control plane does not say: 0). */
    if (sink->page_size != 0 && sink->page_size != pool->page_size) {
        refuse(o, -EPROTO,
               "page_size: source pool %u has %u-byte pages, sink pool %u %u-byte pages", pool->id,
               pool->page_size, sink->pool_id, sink->page_size);
        return o->code;
    }
    /* Same page size, other buffers: the pages would land scrambled. A
     * sink on this node is checked here; another node refuses the frames
     * (the TCP header carries the source's layout, tcp.h). */
    const struct node_pool *sink_pool = sink->local ? node_pool_find(n, sink->pool_id) : NULL;
    if (sink_pool && kvf_pool_layout(pool->pool) && kvf_pool_layout(sink_pool->pool) &&
        kvf_pool_layout(pool->pool) != kvf_pool_layout(sink_pool->pool)) {
        refuse(o, -EPROTO,
               "page_size: source pool %u and sink pool %u have %u-byte pages made of other "
               "buffers (slot sizes or their order differ)",
               pool->id, sink_pool->id, pool->page_size);
        return o->code;
    }
    struct node_route rt;
    char why[96];
    if (node_xport_route(n, sink, &rt, why, sizeof why) != 0) {
        refuse(o, -EPROTO, "no transport to the sink node %s (%s)", sink->node_id, why);
        return o->code;
    }
    /* A multi-buffer pool of host buffers goes over RDMA to a sink with a
     * region per buffer of the same layout (rdma_link.h), never to a sink
     * pool of one region (its slots are not one span); else over TCP. */
    bool rdma_bufs = false;
    if (!sink->local && kvf_pool_kind(pool->pool) == KVF_POOL_MULTI) {
        struct node_route rb;
        if (!node_xport_staging(n) &&
            node_rdma_route_buffers(n, rt.peer, sink->pool_id, pool->pool, &rb)) {
            rt = rb;
            rdma_bufs = true;
        } else if (rt.kind == KVF_LT_OP_RDMA_WR) {
            uint32_t peer = rt.peer;
            if (node_xport_tcp_class.route(n, peer, sink, &rt, why, sizeof why) <= 0) {
                refuse(o, -EPROTO, "no transport to the sink node %s (%s)", sink->node_id, why);
                return o->code;
            }
            rt.cls = &node_xport_tcp_class;
        }
    }
    /* Device pages reach another node only through a staging buffer (a
     * same-node copy reads them through the pool itself: local.h). */
    if (node_devpool_is(pool) && rt.kind != KVF_LT_OP_CUDA_COPY && !rdma_bufs &&
        !node_xport_staging(n)) {
        refuse(o, -EPROTO,
               "source pool %u: %s pool %u needs --staging cuda or host (this node runs "
               "--staging none)",
               pool->id, kvf_pool_kind(pool->pool) == KVF_POOL_MULTI ? "multi-buffer" : "device",
               pool->id);
        return o->code;
    }
    /* A staged frame is copied into one staging buffer (NODE_FRAME_MAX): a
     * page must fit it (frames carry whole pages). Many-layer multi-buffer
     * pools reach that size. */
    if (node_xport_staging(n) && pool->page_size > NODE_FRAME_MAX) {
        refuse(o, -EPROTO,
               "page_size: source pool %u has %u-byte pages, more than a staging buffer (%u "
               "bytes)",
               pool->id, pool->page_size, NODE_FRAME_MAX);
        return o->code;
    }
    struct node_chunk *ch = chunk_new(r, src, sink, pool, req, &rt);
    uint8_t *aux = NULL;
    if (ch && req->aux.len) {
        aux = malloc(req->aux.len);
        if (aux)
            memcpy(aux, req->aux.data, req->aux.len);
    }
    if (ch && !pair)
        pair = node_pair_get(r, src->rank, sink, true);
    if (!ch || !pair || (req->aux.len && !aux)) {
        free(ch);
        free(aux);
        refuse(o, -ENOMEM, "out of memory");
        return o->code;
    }
    ch->pair = pair;
    /* The chunk points at the room until it ends: the room is not freed
     * meanwhile (a staged frame may wait with nothing admitted yet). */
    kvf_ncore_room_hold(&r->core);
    ch->metrics_t0 = node_metrics_chunk_start(n->metrics, node_chunk_transport(ch));
    uint32_t nframes = ch->nframes;
    int err = 0;
    /* Frames may end inside the calls below (staging and queued posts fail
     * some at once): the chunk is not ended by them (frame_end) but below,
     * after its bookkeeping, so it is neither read after its free nor
     * counted open after it ended. */
    ch->submitting = true;
    if (node_xport_staging(n)) {
        /* Every frame starts (or is dropped) in the pipeline: the chunk is
         * accepted whole, its frames end one by one. */
        node_xport_stage_chunk(n, ch);
    } else if (node_xport_queues_chunks(&rt)) {
        /* The same for a transport that queues (RDMA slices): admitted one
         * by one at their post. */
        node_xport_post_chunk(n, &rt, ch);
    } else {
        ch->nframes = 0; /* counts the frames posted */
        for (uint32_t i = 0; i < nframes; i++) {
            struct kvf_xfer *x = &ch->frames[i].x;
            err = kvf_lt_admit(r->core.lt, &x->op, rt.kind, rt.peer);
            if (err != 0)
                break;
            err = kvf_transport_post_write(rt.t, x);
            if (err != 0) {
                if (kvf_lt_op_cancel(&x->op))
                    node_check_drained(n, r);
                break;
            }
            ch->nframes++;
        }
        if (ch->nframes == 0) {
            node_metrics_chunk_end(n->metrics, node_chunk_transport(ch), 0, false, false);
            kvf_ncore_room_release(&r->core);
            free(ch);
            free(aux);
            if (err == -ECANCELED)
                refuse(o, -ECANCELED, "room admission is closed");
            else
                refuse(o, -EPROTO, "post to sink node %s failed: %s", sink->node_id,
                       strerror(-err));
            return o->code;
        }
    }
    src->last_seq = req->chunk_seq;
    src->chunks_open++;
    pair->last_seq = req->chunk_seq;
    pair->chunks++;
    pair->open++;
    for (uint32_t i = 0; i < ch->nframes; i++)
        pair->bytes += ch->frames[i].x.len;
    if (req->last_chunk) {
        pair->last_submitted = true;
        pair->aux = aux;
        pair->aux_len = req->aux.len;
    } else {
        free(aux);
    }
    ch->submitting = false;
    /* Only the staged and queued paths end frames inside the calls above
     * (err is 0 there); posted frames end at a later poll. */
    bool ended = ch->ndone == ch->nframes;
    if (err == 0 && (ended || ch->nfail > 0)) {
        uint32_t nfail = ch->nfail;
        bool closed = r->core.aborting;
        if (ended)
            chunk_end(n, ch); /* ch is freed */
        if (nfail == 0) {
            o->err = 0;
            o->code = KVF_GRPC_OK;
            return 0;
        }
        /* Their source is reported already (TransferFailed): the engine is
         * told too, as for a post that fails part-way. */
        if (closed)
            refuse(o, -ECANCELED, "chunk %" PRIu64 ": room admission is closed", req->chunk_seq);
        else
            refuse(o, -EIO, "chunk %" PRIu64 ": %u of %u frames failed at submission",
                   req->chunk_seq, nfail, nframes);
        return o->code;
    }
    if (err != 0) {
        /* Part of the chunk is in flight: it completes, and the chunk fails;
         * the room is failed now, not once the posted frames completed. */
        ch->nfail++;
        char what[128];
        snprintf(what, sizeof what,
                 "chunk %" PRIu64 ": submission failed after %u of %u frames: %s", req->chunk_seq,
                 ch->nframes, nframes, strerror(-err));
        source_failed(n, ch, what);
        refuse(o, err == -ECANCELED ? -ECANCELED : -EIO,
               "chunk %" PRIu64 " admitted in part (%u of %u frames): %s", req->chunk_seq,
               ch->nframes, nframes, strerror(-err));
        return o->code;
    }
    o->err = 0;
    o->code = KVF_GRPC_OK;
    return 0;
}

/* Owner thread: a SubmitChunk job. */
static void submit_chunk_run(struct kvf_node *n, void *arg)
{
    struct submit_job *j = arg;
    struct node_submit_out o;
    if (node_submit_chunk(n, j->submit, &o) != 0) {
        kvf_rpc_call_fail(j->call, o.code, o.msg);
        j->call = NULL;
        return;
    }
    Kvfence__V1__SubmitChunkResponse resp = KVFENCE__V1__SUBMIT_CHUNK_RESPONSE__INIT;
    resp.chunk_seq = j->submit->chunk_seq;
    uint8_t buf[32];
    size_t len = kvfence__v1__submit_chunk_response__get_packed_size(&resp);
    kvfence__v1__submit_chunk_response__pack(&resp, buf);
    kvf_rpc_call_reply(j->call, buf, len);
    j->call = NULL;
}

/* A chunk's last frame ended: source progress and its report. */
static void chunk_end(struct kvf_node *n, struct node_chunk *ch)
{
    struct node_room *r = ch->room;
    char why[96] = "";
    if (ch->rdma && ch->nfail == 0 && !r->core.aborting) {
        /* One-sided writes: the sink learns its pages landed from this, in
         * the pair's order on the channel, before its AuxData/TransferStatus. */
        int rc = node_rdma_send_notice(n, ch);
        if (rc != 0) {
            ch->nfail++;
            snprintf(why, sizeof why, "chunk %" PRIu64 ": ChunkNotice not sent: %s", ch->seq,
                     strerror(-rc));
            source_failed(n, ch, why);
        }
    }
    if (ch->nfail && !why[0])
        snprintf(why, sizeof why, "chunk %" PRIu64 ": %u of %u frames failed", ch->seq, ch->nfail,
                 ch->nframes);
    node_watch_chunk_done(n, r, ch->src_rank, ch->pair->sink_rank, ch->seq, ch->nfail == 0, why,
                          node_chunk_transport(ch));
    /* AuxData and TransferStatus leave before Completed is decided. */
    node_pair_chunk_done(n, r, ch->pair, ch->seq, ch->nfail == 0, why);
    struct node_member *src =
        member_find(r, n->node_id, ch->src_rank, KVFENCE__V1__ROLE__ROLE_SOURCE);
    if (src) {
        if (src->chunks_open)
            src->chunks_open--;
        if (ch->nfail) {
            src->failed = true; /* reported when its first frame failed */
        } else if (ch->pair->failed) {
            src->failed = true; /* the status could not be sent: reported there */
        } else if (src->chunks_open == 0 && node_pairs_done(r, src->rank) && !src->failed &&
                   !src->completed && !r->core.aborting) {
            node_part_completed(n, r, src);
        }
    }
    node_metrics_chunk_end(n->metrics, node_chunk_transport(ch), ch->metrics_t0, ch->nfail == 0,
                           true);
    kvf_ncore_room_release(&r->core);
    free(ch);
}

/* A frame ended; `status`, when not 0, is its transport's -errno (named in
 * the report: e.g. a connect that timed out). */
static void frame_end(struct kvf_node *n, struct node_frame *f, bool ok, int status)
{
    struct node_chunk *ch = f->chunk;
    ch->ndone++;
    if (ok)
        node_metrics_sent(n->metrics, node_chunk_transport(ch), f->x.len);
    if (!ok) {
        /* At once: a sibling frame may stay blocked for long (R4), and the
         * room must abort meanwhile. */
        ch->nfail++;
        char why[96];
        if (status < 0 && status != -ECANCELED)
            snprintf(why, sizeof why, "chunk %" PRIu64 ": a frame failed: %s: %s", ch->seq,
                     kvf_transport_name(f->t), strerror(-status));
        else
            snprintf(why, sizeof why, "chunk %" PRIu64 ": a frame failed", ch->seq);
        source_failed(n, ch, why);
    }
    if (ch->ndone == ch->nframes && !ch->submitting)
        chunk_end(n, ch);
}

void node_local_frame_end(struct kvf_node *n, struct node_frame *f, bool ok)
{
    frame_end(n, f, ok, 0);
}

void node_local_completion(struct kvf_node *n, const struct kvf_completion *c)
{
    struct node_frame *f = (struct node_frame *)((char *)c->xfer - offsetof(struct node_frame, x));
    struct node_chunk *ch = f->chunk;
    struct node_room *r = ch->room;
    if (c->drained)
        node_check_drained(n, r);
    if (f->buf) {
        /* The transport side of its staging buffer is done (the copy side
         * was, before the post): the ring takes it back now. */
        bool drained = false;
        (void)kvf_staging_ring_transport_done(f->buf, &drained);
        f->buf = NULL;
        if (drained)
            node_check_drained(n, r);
    }
    bool ok = c->outcome == KVF_LT_DONE_OK;
    if (ok && ch->sink_local) {
        node_metrics_received(n->metrics, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_LOCAL, 1,
                              c->xfer->len);
        node_sink_landed(n, r, ch->sink_rank, c->xfer->first_page, c->xfer->page_count,
                         c->xfer->len);
    }
    frame_end(n, f, ok, c->status); /* may free the chunk; the room stays until the job ends */
    /* An op of the room retired: a local sink that waited for the room's
     * ops in flight may complete now. */
    node_check_sinks(n, r);
}

/* ---- handlers (CQ threads) ------------------------------------------------------ */

static void h_register_pool(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct kvf_node *n = ctx;
    static const uint8_t empty[1];
    Kvfence__V1__RegisterPoolRequest *r =
        kvfence__v1__register_pool_request__unpack(NULL, len, len ? req : empty);
    if (!r) {
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, "undecodable RegisterPoolRequest");
        return;
    }
    const char *why = NULL;
    int code = KVF_GRPC_INVALID_ARGUMENT;
    char bwhy[200];
    if (r->n_buffers > 0) {
        why = node_devpool_check_buffers(r, bwhy, sizeof bwhy); /* opened on the owner thread */
    } else if (r->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC) {
        why = node_devpool_check_cuda_request(r); /* opened on the owner thread (devpool.c) */
    } else if (r->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD) {
        if (r->page_size == 0 || r->page_count == 0)
            why = "page_size and page_count must be >= 1";
        else if (r->host_fd->handle.len != KVF_FDPASS_HANDLE_SIZE)
            why = "host_fd.handle: must be the 16 bytes the fd socket answered";
        else if (r->host_fd->size < (uint64_t)r->page_size * r->page_count)
            why = "host_fd.size: smaller than page_size x page_count";
    } else if (r->memory_case != KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM) {
        why = "memory: none given";
    } else if (r->page_size == 0 || r->page_count == 0) {
        why = "page_size and page_count must be >= 1";
    } else if (r->host_shm->size < (uint64_t)r->page_size * r->page_count) {
        why = "host_shm.size: smaller than page_size x page_count";
    } else if (!r->host_shm->shm_name || !r->host_shm->shm_name[0]) {
        why = "host_shm.shm_name: empty";
    }
    if (why) {
        kvfence__v1__register_pool_request__free_unpacked(r, NULL);
        kvf_rpc_call_fail(call, code, why);
        return;
    }
    struct register_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(register_pool_run, a, register_job_free) : NULL;
    if (!j) {
        free(a);
        kvfence__v1__register_pool_request__free_unpacked(r, NULL);
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    a->call = call;
    a->reg = r;
    node_post_or_fail(n, j);
}

const char *node_submit_shape(const Kvfence__V1__SubmitChunkRequest *r)
{
    if (!r->room || r->room->generation == 0)
        return "room: missing or generation 0";
    if (r->chunk_seq == 0)
        return "chunk_seq: must be >= 1";
    if (r->aux.len && !r->last_chunk)
        return "aux: only on the last chunk";
    if (r->aux.len > 1024 * 1024)
        return "aux: more than 1 MiB";
    if (r->n_source_ranges == 0 || r->n_sink_ranges == 0)
        return "source_ranges and sink_ranges: empty";
    return NULL;
}

static void h_submit_chunk(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct kvf_node *n = ctx;
    static const uint8_t empty[1];
    Kvfence__V1__SubmitChunkRequest *r =
        kvfence__v1__submit_chunk_request__unpack(NULL, len, len ? req : empty);
    if (!r) {
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, "undecodable SubmitChunkRequest");
        return;
    }
    const char *why = node_submit_shape(r);
    if (why) {
        kvfence__v1__submit_chunk_request__free_unpacked(r, NULL);
        kvf_rpc_call_fail(call, KVF_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    struct submit_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(submit_chunk_run, a, submit_job_free) : NULL;
    if (!j) {
        free(a);
        kvfence__v1__submit_chunk_request__free_unpacked(r, NULL);
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    a->call = call;
    a->submit = r;
    node_post_or_fail(n, j);
}

int node_local_start(struct kvf_node *n, const node_local_register_fn *extra, size_t nextra)
{
    char dir[256];
    snprintf(dir, sizeof dir, "%s", n->local_socket);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = '\0';
        (void)mkdir(dir, 0755);
    }
    node_access_init(&n->access, n->opts.local_socket_mode, n->opts.local_socket_gid);
    /* gRPC binds in a private 0700 directory; the socket gets its mode and
     * group there and is renamed into place (replacing a stale one): no
     * window where it is more open than configured, whatever the umask. */
    char priv[300], tmp[320], addr[330];
    int rc = node_access_private_dir(n->local_socket, priv, sizeof priv);
    if (rc != 0)
        return rc;
    snprintf(tmp, sizeof tmp, "%s/s", priv);
    snprintf(addr, sizeof addr, "unix:%s", tmp);
    struct kvf_rpc_server_opts so;
    kvf_rpc_server_opts_init(&so);
    so.listen_addr = addr;
    so.cq_threads = LOCAL_CQ_THREADS;
    n->local_srv = kvf_rpc_server_create(&so);
    if (!n->local_srv) {
        (void)rmdir(priv);
        return -EIO;
    }
    rc = kvf_rpc_server_add_unary(n->local_srv, "/kvfence.v1.NodeLocal/RegisterPool",
                                  h_register_pool, n);
    if (rc == 0)
        rc = kvf_rpc_server_add_unary(n->local_srv, "/kvfence.v1.NodeLocal/SubmitChunk",
                                      h_submit_chunk, n);
    for (size_t i = 0; rc == 0 && i < nextra; i++)
        rc = extra[i](n); /* SubmitChunks, Watch, UnregisterPool, Health (node.c) */
    if (rc == 0) {
        rc = kvf_rpc_server_start(n->local_srv);
        if (rc > 0)
            rc = 0;
    }
    if (rc == 0)
        rc = node_access_place(&n->access, tmp, n->local_socket);
    (void)unlink(tmp); /* only when something failed: else renamed already */
    (void)rmdir(priv);
    if (rc != 0) {
        node_log("error", NULL, "NodeLocal on %s: cannot start: %s", n->local_socket,
                 strerror(-rc));
        return rc;
    }
    char fds[300];
    rc = kvf_fdpass_path(n->local_socket, fds, sizeof fds);
    if (rc == 0) {
        n->gate = node_gate_start(fds, &n->access);
        if (!n->gate)
            rc = -EIO;
    }
    if (rc != 0) {
        node_log("error", NULL, "NodeLocal: the fd socket %s.fds cannot start", n->local_socket);
        return rc;
    }
    node_log("info", NULL, "NodeLocal on %s and %s: mode %04o group %u", n->local_socket, fds,
             (unsigned)n->access.mode, (unsigned)n->access.gid);
    return 0;
}

void node_local_stop(struct kvf_node *n)
{
    node_gate_stop(n->gate);
    n->gate = NULL;
    if (!n->local_srv)
        return;
    kvf_rpc_server_shutdown(n->local_srv, 1000);
    kvf_rpc_server_destroy(n->local_srv);
    n->local_srv = NULL;
    (void)unlink(n->local_socket);
}
