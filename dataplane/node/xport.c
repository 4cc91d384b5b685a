/*
 * xport.c: transport choice, the local transport's wiring and the staging
 * pipeline for kvfence-node (xport.h); the RDMA side is rdma_link.c.
 *
 * Transport choice per sink: a sink participant of this node (same node id
 * and incarnation) gets the local transport (memcpy workers, local.h) with the
 * node's own peer index; another node gets RDMA when both ends have it and
 * their RDMA link is up (rdma_link.c: the link starts with the first chunk
 * routed to that peer, which goes over TCP meanwhile), else TCP.
 *
 * Staging (opts.staging "host" or "cuda"): each frame acquires a buffer of
 * the ring (in ring order; a frame waits in a FIFO while none is free), the
 * engine copies the source pages into it, and once the copy completed the
 * frame's transport op is admitted and posted from the buffer. The buffer is
 * reported transport-done when that op completes (or when nothing was posted
 * for it) and copy-done when the copy completed; the ring takes it back only
 * after both. Admission is asked at every step: a frame of a room whose
 * admission closed meanwhile posts nothing more and ends as failed.
 *
 * Test knob (opts.test_local_hold_file): while that file exists the local
 * transport starts no copy (kvf_transport_local_set_hold), so a test can hold
 * same-node ops in flight across an abort. It is looked at before every local
 * post and on every owner loop turn; while it holds, the node writes the
 * number of held copies to "<file>.queued" whenever it changes, so the test
 * knows when its ops are posted.
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
#include "kvf_file.h"
#include "local.h"
#include "rdma_link.h"
#include "tcp.h"

#define STAGE_POLL_BATCH 64
/* The staging engine has no wake descriptor: while copies are in flight the
 * owner polls it at this pace; the test hold knob's file is looked at at
 * HOLD_CHECK_MS. */
#define STAGE_POLL_MS 1
#define HOLD_CHECK_MS 5

struct node_xport {
    struct kvf_transport *local;
    bool self_known;
    uint32_t self_peer;
    struct kvf_staging *eng;
    struct kvf_staging_ring *ring;
    void *ring_mem; /* pinned, for the CUDA engine */
    bool staging_cuda;
    struct node_frame *pend_head, *pend_tail;
    bool held;
    uint64_t held_written; /* last count written to <hold file>.queued, +1 */
};

/* ---- start / stop ------------------------------------------------------------------ */

/* The local transport with the node's limits (at start, and when renewed). */
static struct kvf_transport *local_create(void)
{
    struct kvf_transport_local_opts lo;
    kvf_transport_local_opts_init(&lo);
    lo.max_peers = NODE_MAX_PEERS;
    lo.max_pools = NODE_MAX_POOLS;
    return kvf_transport_local_create(&lo);
}

int node_xport_start(struct kvf_node *n)
{
    struct node_xport *xp = calloc(1, sizeof *xp);
    if (!xp)
        return -ENOMEM;
    n->xp = xp;
    xp->local = local_create();
    if (!xp->local)
        return -ENOMEM;

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
    return node_rdma_start(n);
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
    node_rdma_stop(n);
    kvf_transport_destroy(xp->local);
    xp->local = NULL;
    if (kvf_staging_destroy(xp->eng) != 0)
        node_log("error", NULL, "staging engine: copies still in flight at exit: left running");
    else if (kvf_staging_ring_destroy(xp->ring) != 0)
        node_log("error", NULL, "staging ring: buffers still owned at exit: left allocated");
    else if (xp->ring_mem)
        kvf_staging_cuda_host_free(xp->ring_mem);
    free(xp);
    n->xp = NULL;
}

int node_xport_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    int rc = node_devpool_add_local(n->xp->local, p);
    if (rc == 0)
        node_rdma_add_pool(n, p); /* not a device pool (no GPUDirect RDMA): rdma_link.c */
    return rc;
}

int node_xport_remove_pool(struct kvf_node *n, uint32_t pool_id)
{
    node_rdma_remove_pool(n, pool_id);
    return kvf_transport_local_remove_pool(n->xp->local, pool_id);
}

bool node_xport_staging(const struct kvf_node *n)
{
    return n->xp->ring != NULL;
}

size_t node_xport_features(const struct kvf_node *n, const char **out, size_t max,
                           const char **rdma_ep)
{
    static const char *base[] = {"QUIESCE_V1", "FENCE_V1", "TCP", "LOCAL"};
    size_t k = 0;
    for (size_t i = 0; i < sizeof base / sizeof base[0] && k < max; i++)
        out[k++] = base[i];
    if (node_rdma_advertised(n, rdma_ep) && k < max)
        out[k++] = "RDMA";
    if (n->xp->staging_cuda && k < max)
        out[k++] = "CUDA_STAGING";
    return k;
}

/* ---- transport choice ----------------------------------------------------------------- */

static void write_held(struct node_xport *xp, const char *path)
{
    struct kvf_transport_local_stats st;
    kvf_transport_local_stats(xp->local, &st);
    if (st.queued + 1 == xp->held_written)
        return;
    char dst[300];
    snprintf(dst, sizeof dst, "%s.queued", path);
    if (kvf_file_printf(dst, 0, "%" PRIu64 "\n", st.queued) == 0)
        xp->held_written = st.queued + 1;
}

static void update_hold(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    const char *path = n->opts.test_local_hold_file;
    if (!path || !path[0])
        return;
    bool hold = access(path, F_OK) == 0;
    if (hold != xp->held) {
        xp->held = hold;
        xp->held_written = 0;
        kvf_transport_local_set_hold(xp->local, hold);
        node_log("info", NULL, "test: local copies %s", hold ? "held" : "released");
    }
    if (hold)
        write_held(xp, path);
}

int node_xport_route(struct kvf_node *n, const struct node_member *sink, struct node_route *rt,
                     char *why, size_t why_len)
{
    struct node_xport *xp = n->xp;
    uint32_t peer;
    int rc = node_ensure_peer(n, sink->node_id, sink->incarnation, &peer);
    if (rc != 0) {
        snprintf(why, why_len, "no peer slot: %s", strerror(-rc));
        return rc;
    }
    struct node_peer *pe = &n->peers[peer];
    if (sink->local) {
        /* Idempotent; a new incarnation of this node gets a new index. */
        rc = kvf_transport_local_add_peer(xp->local, peer);
        if (rc != 0) {
            snprintf(why, why_len, "local transport: %s", strerror(-rc));
            return rc;
        }
        xp->self_known = true;
        xp->self_peer = peer;
        update_hold(n);
        *rt = (struct node_route){xp->local, peer, KVF_LT_OP_CUDA_COPY};
        return 0;
    }
    if (node_rdma_route(n, peer, sink, rt))
        return 0;
    /* Every chunk asks: -EEXIST for a live connection, a new one in place of
     * a connection that died (tcp.h), so a peer is never given up for good. */
    if (!pe->fenced && pe->port) {
        rc = kvf_transport_tcp_connect(n->tcp, peer, pe->host, pe->port);
        pe->connected = rc == 0 || rc == -EEXIST;
    }
    if (!pe->connected || pe->fenced) {
        snprintf(why, why_len, "%s", pe->fenced ? "fenced" : "not connected");
        return -ENOTCONN;
    }
    *rt = (struct node_route){n->tcp_io, peer, KVF_LT_OP_TCP_FRAME};
    return 0;
}

int node_xport_fence_local(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    if (!xp->self_known)
        return 0; /* no local copy was ever posted */
    int rc = kvf_transport_fence_peer(xp->local, xp->self_peer);
    if (rc == 0)
        node_xport_poll(n); /* hand the flushed copies back to their chunks */
    return rc;
}

int node_xport_renew_local(struct kvf_node *n)
{
    struct node_xport *xp = n->xp;
    int rc = node_xport_fence_local(n);
    if (rc != 0)
        return rc;
    struct kvf_transport *fresh = local_create();
    if (!fresh)
        return -ENOMEM;
    for (uint32_t i = 0; i < n->npools && rc == 0; i++)
        rc = node_devpool_add_local(fresh, &n->pools[i]);
    if (rc != 0) {
        kvf_transport_destroy(fresh);
        return rc;
    }
    kvf_transport_destroy(xp->local);
    xp->local = fresh;
    xp->self_known = false;
    xp->held = false; /* the test knob is applied again to the new transport */
    /* RDMA: every peer fenced (QPs to ERR), then new PD, regions and rkeys. */
    return node_rdma_renew(n);
}

/* ---- the owner loop's waits ---------------------------------------------------------- */

static void wake_add(struct kvf_transport *t, struct pollfd *pfd, struct kvf_transport **who,
                     size_t max, size_t *k)
{
    if (!t || *k == max)
        return;
    int fd = kvf_transport_wake_fd(t);
    if (fd < 0)
        return;
    pfd[*k] = (struct pollfd){.fd = fd, .events = POLLIN};
    who[*k] = t;
    (*k)++;
}

size_t node_xport_wake_fds(struct kvf_node *n, struct pollfd *pfd, struct kvf_transport **who,
                           size_t max)
{
    size_t k = 0;
    wake_add(n->tcp_io, pfd, who, max, &k);
    if (n->xp)
        wake_add(n->xp->local, pfd, who, max, &k);
    wake_add(node_rdma_transport(n), pfd, who, max, &k);
    return k;
}

int64_t node_xport_next_ms(struct kvf_node *n, int64_t now)
{
    struct node_xport *xp = n->xp;
    int64_t at = node_rdma_next_ms(n, now);
    if (!xp)
        return at;
    if (xp->eng && (xp->pend_head || kvf_staging_inflight(xp->eng) > 0) && now + STAGE_POLL_MS < at)
        at = now + STAGE_POLL_MS;
    if (n->opts.test_local_hold_file && n->opts.test_local_hold_file[0] && now + HOLD_CHECK_MS < at)
        at = now + HOLD_CHECK_MS;
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
        int rc = kvf_staging_ring_acquire(xp->ring, r->lt, f->x.peer, &buf);
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
        rc = kvf_lt_admit(r->lt, &f->copy.op, KVF_LT_OP_CUDA_COPY, f->x.peer);
        if (rc == 0) {
            rc = kvf_staging_copy_async(xp->eng, &f->copy);
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
        rc = kvf_lt_admit(r->lt, &f->x.op, f->kind, f->x.peer);
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
    update_hold(n);
    struct kvf_completion c[NODE_POLL_BATCH];
    int got;
    while ((got = kvf_transport_poll(xp->local, NODE_POLL_BATCH, c)) > 0)
        for (int i = 0; i < got; i++)
            node_local_completion(n, &c[i]);
    node_rdma_poll(n);
    if (!xp->eng)
        return;
    struct kvf_stage_copy *done[STAGE_POLL_BATCH];
    unsigned k;
    while ((k = kvf_staging_poll(xp->eng, STAGE_POLL_BATCH, done)) > 0)
        for (unsigned i = 0; i < k; i++)
            copy_done(n, done[i]);
    pump(n);
}
