/*
 * xport.c: the node's data path below SubmitChunk, generic over the
 * transport registry (xport_registry.h): transport choice, pools, fences and
 * new incarnations, the owner loop's polling, wake descriptors and deadlines,
 * and the Hello's features and endpoints are each one walk over
 * node_xport_classes[]; no transport is named here. Plus the staging
 * pipeline, which sits in front of whichever transport a frame goes through.
 *
 * Transport choice per sink: the first class (in registry order) whose route
 * claims it: a sink participant of this node gets the local transport;
 * another node RDMA when both ends have it and their RDMA link is up (the
 * link starts with the first chunk routed to that peer, which goes over TCP
 * meanwhile), else TCP.
 *
 * Staging (opts.staging "host" or "cuda"): each frame acquires a buffer of
 * the ring (in ring order; a frame waits in a FIFO while none is free), the
 * engine copies the source pages into it, and once the copy completed the
 * frame's transport op is admitted and posted from the buffer. The buffer is
 * reported transport-done when that op completes (or when nothing was posted
 * for it) and copy-done when the copy completed; the ring takes it back only
 * after both. Admission is asked at every step: a frame of a room whose
 * admission closed meanwhile posts nothing more and ends as failed. The
 * staging engine has no wake descriptor: while copies are in flight the
 * owner polls it every STAGE_POLL_MS.
 */
#include "xport.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "devpool.h"
#include "faults.h"
#include "xport_internal.h"
#include "xport_registry.h"
#include "node_log.h"
#include "node_owner.h"

#define STAGE_POLL_BATCH 64
#define STAGE_POLL_MS    1

/* ---- start / stop ------------------------------------------------------------------ */

static int staging_start(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    const char *mode = n->opts.staging && n->opts.staging[0] ? n->opts.staging : "none";
    uint32_t nbufs = n->opts.staging_buffers ? n->opts.staging_buffers : 16;
    struct kvf_staging_ring_opts ro;
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = nbufs;
    ro.buf_size = NODE_FRAME_MAX;
    if (strcmp(mode, "host") == 0) {
        struct kvf_staging_host_opts ho;
        kvf_staging_host_opts_init(&ho);
        xp->eng = kvf_staging_host_create(&ho);
    } else if (strcmp(mode, "cuda") == 0) {
        struct kvf_staging_cuda_opts co;
        kvf_staging_cuda_opts_init(&co);
        xp->eng = kvf_staging_cuda_create(&co);
        int rc = xp->eng
                     ? kvf_staging_cuda_host_alloc((size_t)nbufs * NODE_FRAME_MAX, &xp->ring_mem)
                     : -ENODEV;
        if (rc != 0) {
            node_log("error", NULL, "staging cuda: no engine or no pinned memory: %s",
                     strerror(-rc));
            return rc;
        }
        ro.mem = xp->ring_mem;
        xp->staging_cuda = true;
    } else if (strcmp(mode, "none") != 0) {
        node_log("error", NULL, "staging: \"%s\" is not none, host or cuda", mode);
        return -EINVAL;
    }
    if (strcmp(mode, "none") != 0) {
        if (!xp->eng)
            return -ENODEV;
        xp->ring = kvf_staging_ring_create(&ro);
        if (!xp->ring)
            return -ENOMEM;
        node_log("info", NULL, "staging: %s engine, %u buffers of %u bytes", mode, nbufs,
                 NODE_FRAME_MAX);
    }
    return 0;
}

int node_xport_start(struct kvf_node *n)
{
    struct node_xport *xp = calloc(1, sizeof *xp);
    if (!xp)
        return -ENOMEM;
    n->xp = xp;
    int rc = staging_start(n);
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        if (rc != 0)
            break;
        rc = (*c)->start(n);
        if (rc != 0)
            node_log("error", NULL, "transport %s: cannot start: %s", (*c)->name, strerror(-rc));
    }
    return rc;
}

void node_xport_stop(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    if (!xp)
        return;
    /* Frames that never got a buffer (a drain timeout at stop): nothing
     * native was done for them; the session is gone, so no report. */
    while (xp->pend_head) {
        struct node_frame *f = xp->pend_head;
        xp->pend_head = f->pnext;
        if (++f->chunk->ndone == f->chunk->nframes)
            free(f->chunk);
    }
    xp->pend_tail = NULL;
    for (uint32_t i = 0; i < n->npools; i++)
        node_devpool_log_stats(&n->pools[i]);
    size_t k = 0;
    while (node_xport_classes[k])
        k++;
    while (k-- > 0) /* in reverse: each stops with what it started on still there */
        node_xport_classes[k]->stop(n);
    if (kvf_staging_destroy(xp->eng) != 0)
        node_log("error", NULL, "staging engine: copies still in flight at exit: left running");
    else if (kvf_staging_ring_destroy(xp->ring) != 0)
        node_log("error", NULL, "staging ring: buffers still owned at exit: left allocated");
    else if (xp->ring_mem)
        kvf_staging_cuda_host_free(xp->ring_mem);
    free(xp);
    n->xp = NULL;
}

/* ---- pools, routes, fences --------------------------------------------------------- */

int node_xport_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    size_t k = 0;
    int rc = 0;
    for (; node_xport_classes[k]; k++) {
        rc = node_xport_classes[k]->add_pool(n, p);
        if (rc != 0) {
            node_log("warn", NULL, "pool %u: transport %s refused it: %s", p->id,
                     node_xport_classes[k]->name, strerror(-rc));
            break;
        }
    }
    if (rc != 0) /* nothing half-applied: no transport keeps a pool about to be unmapped */
        while (k-- > 0)
            node_xport_classes[k]->remove_pool(n, p->id);
    return rc;
}

void node_xport_remove_pool(struct kvf_node *n, uint32_t pool_id)
{
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++)
        (*c)->remove_pool(n, pool_id);
}

bool node_xport_staging(const struct kvf_node *n)
{
    return n->xp->ring != NULL;
}

size_t node_xport_features(const struct kvf_node *n, const char **out, size_t max)
{
    static const char *base[] = {"QUIESCE_V1", "FENCE_V1"};
    size_t k = 0;
    for (size_t i = 0; i < sizeof base / sizeof base[0] && k < max; i++)
        out[k++] = base[i];
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        const char *f = (*c)->feature(n);
        if (f && k < max)
            out[k++] = f;
    }
    if (n->xp->staging_cuda && k < max)
        out[k++] = "CUDA_STAGING";
    return k;
}

size_t node_xport_endpoints(const struct kvf_node *n, struct node_xport_endpoint *out, size_t max)
{
    size_t k = 0;
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        if (k < max && (*c)->endpoint(n, &out[k].kind, out[k].address, sizeof out[k].address))
            k++;
    }
    return k;
}

int node_xport_route(struct kvf_node *n, const struct node_member *sink, struct node_route *rt,
                     char *why, size_t why_len)
{
    uint32_t peer;
    int rc = node_ensure_peer(n, sink->node_id, sink->incarnation, &peer);
    if (rc != 0) {
        snprintf(why, why_len, "no peer slot: %s", strerror(-rc));
        return rc;
    }
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        rc = (*c)->route(n, peer, sink, rt, why, why_len);
        if (rc > 0) {
            rt->cls = *c;
            return 0;
        }
        if (rc < 0)
            return rc;
    }
    snprintf(why, why_len, "no transport reaches it");
    return -ENOTCONN;
}

bool node_xport_queues_chunks(const struct node_route *rt)
{
    return rt->cls && rt->cls->post_chunk;
}

void node_xport_post_chunk(struct kvf_node *n, const struct node_route *rt, struct node_chunk *ch)
{
    rt->cls->post_chunk(n, ch);
}

int node_xport_fence_peer(struct kvf_node *n, uint32_t peer)
{
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        int rc = (*c)->fence_peer(n, peer);
        if (rc != 0) {
            node_log("error", NULL, "transport %s: cannot fence peer %u: %s", (*c)->name, peer,
                     strerror(-rc));
            return rc;
        }
    }
    return 0;
}

int node_xport_renew_local(struct kvf_node *n)
{
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        int rc = (*c)->renew(n);
        if (rc != 0) {
            node_log("error", NULL, "transport %s: not renewed: %s", (*c)->name, strerror(-rc));
            return rc;
        }
    }
    return 0;
}

/* ---- the owner loop's waits ---------------------------------------------------------- */

size_t node_xport_wake_fds(struct kvf_node *n, struct pollfd *pfd, struct kvf_transport **who,
                           size_t max)
{
    size_t k = 0;
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        struct kvf_transport *t = k < max ? (*c)->waker(n) : NULL;
        int fd = t ? kvf_transport_wake_fd(t) : -1;
        if (fd < 0)
            continue;
        pfd[k] = (struct pollfd){.fd = fd, .events = POLLIN};
        who[k++] = t;
    }
    return k;
}

int64_t node_xport_next_ms(struct kvf_node *n, int64_t now)
{
    struct node_xport *xp = n->xp;
    int64_t at = INT64_MAX;
    if (!xp)
        return at;
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++) {
        int64_t t = (*c)->next_ms(n, now);
        if (t < at)
            at = t;
    }
    if (xp->eng && (xp->pend_head || kvf_staging_inflight(xp->eng) > 0) && now + STAGE_POLL_MS < at)
        at = now + STAGE_POLL_MS;
    return at;
}

/* ---- staging pipeline --------------------------------------------------------------------- */

/* Both sides of a buffer that did no work (or whose copy failed) are done. */
static void buf_return(struct kvf_node *n, struct node_frame *f, bool copy_side)
{
    bool d = false;
    if (copy_side && kvf_staging_ring_copy_done(f->buf, &d) && d)
        node_check_drained(n, f->chunk->room);
    d = false;
    (void)kvf_staging_ring_transport_done(f->buf, &d);
    if (d)
        node_check_drained(n, f->chunk->room);
    f->buf = NULL;
}

/* Starts waiting frames, in order, while the ring has buffers. */
static void pump(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    while (xp->pend_head) {
        struct node_frame *f = xp->pend_head;
        struct node_room *r = f->chunk->room;
        struct kvf_staging_buf *buf;
        int rc = kvf_staging_ring_acquire(xp->ring, r->core.lt, f->x.peer, &buf);
        if (rc == -EAGAIN)
            return; /* every buffer is owned: wait for a completion */
        xp->pend_head = f->pnext;
        if (!xp->pend_head)
            xp->pend_tail = NULL;
        if (rc != 0) { /* admission closed: dropped before any native call */
            node_frame_end(n, f, false);
            continue;
        }
        f->buf = buf;
        memset(&f->copy, 0, sizeof f->copy);
        f->copy.dst = buf->data;
        f->copy.src = f->src;
        f->copy.src_pool = f->src_dev; /* host engine: kvf_pool_read, never *src */
        f->copy.src_offset = f->src_offset;
        f->copy.len = f->x.len;
        f->copy.buf = buf;
        f->copy.user = f;
        rc = kvf_lt_admit(r->core.lt, &f->copy.op, KVF_LT_OP_CUDA_COPY, f->x.peer);
        if (rc == 0) {
            rc = node_fault_stage_fail(n) ? -EIO : kvf_staging_copy_async(xp->eng, &f->copy);
            if (rc != 0 && kvf_lt_op_cancel(&f->copy.op))
                node_check_drained(n, r);
        }
        if (rc != 0) {
            node_log("warn", &r->key, "staging copy not started: %s", strerror(-rc));
            buf_return(n, f, true);
            node_frame_end(n, f, false);
        }
    }
}

void node_xport_stage_chunk(struct kvf_node *n, struct node_chunk *ch)
{
    struct node_xport *xp = n->xp;
    for (uint32_t i = 0; i < ch->nframes; i++) {
        struct node_frame *f = &ch->frames[i];
        f->pnext = NULL;
        if (xp->pend_tail)
            xp->pend_tail->pnext = f;
        else
            xp->pend_head = f;
        xp->pend_tail = f;
    }
    pump(n);
}

/* A staging copy came back: post the frame from its buffer, or end it. */
static void copy_done(struct kvf_node *n, struct kvf_stage_copy *c)
{
    struct node_frame *f = c->user;
    struct node_room *r = f->chunk->room;
    if (c->drained)
        node_check_drained(n, r);
    bool d = false;
    if (kvf_staging_ring_copy_done(f->buf, &d) && d)
        node_check_drained(n, r); /* cannot return yet: transport side pending */
    int rc = c->status;
    if (rc == 0) {
        f->x.src = f->buf->data;
        rc = kvf_lt_admit(r->core.lt, &f->x.op, f->kind, f->x.peer);
        if (rc == 0) {
            rc = kvf_transport_post_write(f->t, &f->x);
            if (rc != 0 && kvf_lt_op_cancel(&f->x.op))
                node_check_drained(n, r);
        }
    }
    if (rc != 0) {
        if (rc != -ECANCELED)
            node_log("warn", &r->key, "staged frame not posted: %s", strerror(-rc));
        buf_return(n, f, false);
        node_frame_end(n, f, false);
    }
}

void node_xport_poll(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    if (!xp)
        return;
    for (const struct node_xport_class *const *c = node_xport_classes; *c; c++)
        (*c)->poll(n);
    if (!xp->eng)
        return;
    struct kvf_stage_copy *done[STAGE_POLL_BATCH];
    unsigned k;
    while ((k = kvf_staging_poll(xp->eng, STAGE_POLL_BATCH, done)) > 0)
        for (unsigned i = 0; i < k; i++)
            copy_done(n, done[i]);
    pump(n);
}
