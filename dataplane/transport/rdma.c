/*
 * rdma.c: the RDMA transport: RDMA WRITE work requests on RC QPs, counted one
 * lifetime op per WR, fenced by moving the peer's QPs to ERR and reaping
 * until a drain marker proves every WR came back.
 *
 * The rules (QP choice, outcomes, post_send failures, fence) are in rdma.h.
 * This file owns the device context, PD and the one CQ shared by all QPs (send
 * and receive side; nothing is ever posted to a receive queue), the local
 * pools' MRs, the remote pools named per peer, two QPs per peer with a fixed
 * table of KVF_RDMA_MAX_WR_PER_QP tags each, and the list of reaped
 * completions that poll hands out.
 *
 * Tags: every WR's wr_id points at the `tag` of a struct rdma_wr (an xfer
 * slot of one QP) or at the `drain` tag of a struct rdma_qp (the fence's
 * marker); a completion's tag says which, and container_of recovers the
 * struct. A slot is busy from post to completion, so the free slots of a QP
 * are its remaining send budget (-EAGAIN when none).
 *
 * DESIGN: one owner thread (rdma.h); no locks. The verbs provider is called
 * only from that thread.
 */
#include "rdma.h"
#include "kvf_log.h"
#include "kvf_clock.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RDMA_SQ_DEPTH (KVF_RDMA_MAX_WR_PER_QP + 1u) /* + the fence's marker */

#define rdma_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

enum rdma_tag_kind {
    RDMA_TAG_XFER = 1,  /* struct rdma_wr */
    RDMA_TAG_DRAIN = 2, /* struct rdma_qp's drain marker */
};

struct rdma_tag {
    uint8_t kind;
};

struct rdma_qp;

/* One WR slot of a QP. */
struct rdma_wr {
    struct rdma_tag tag;
    bool busy;        /* posted (or of unknown fate), no completion yet */
    bool unknown;     /* an ambiguous post_send: maybe never posted */
    bool quarantined; /* this transport quarantined its op */
    struct rdma_qp *qp;
    struct kvf_xfer *x;
    struct rdma_wr *next_free;
};

enum rdma_qp_state {
    RDMA_QP_INIT = 1,
    RDMA_QP_RTR = 2,
    RDMA_QP_RTS = 3,
    RDMA_QP_ERR = 4,
};

struct rdma_qp {
    struct ibv_qp *qp;
    enum rdma_qp_state state;
    uint32_t psn;
    bool broken; /* an error completion put it in ERR */
    struct rdma_tag drain;
    bool drain_posted;
    bool drain_done;
    unsigned outstanding; /* busy slots */
    unsigned unknown;     /* busy slots of unknown fate */
    struct rdma_wr *free;
    struct rdma_wr wrs[KVF_RDMA_MAX_WR_PER_QP];
};

struct rdma_rpool {
    uint32_t id;
    uint64_t addr;
    uint64_t page_size;
    uint64_t page_count;
    uint32_t rkey;
};

struct rdma_lpool {
    uint32_t id;
    uint8_t *base;
    uint64_t page_size;
    uint64_t page_count;
    struct ibv_mr *mr;
};

struct rdma_peer {
    struct rdma_qp *qp[KVF_RDMA_QPS_PER_PEER]; /* NULL until local_info */
    bool connected;
    bool fenced;
    struct rdma_rpool *rpools; /* max_pools entries, allocated on first add */
    uint32_t rpool_count;
};

struct rdma {
    struct kvf_transport base;
    struct kvf_transport_rdma_opts opts;
    const struct kvf_verbs_ops *v;
    void *prov;

    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_port_attr port;
    union ibv_gid gid;
    uint32_t psn_state;

    struct rdma_lpool *lpools;
    uint32_t lpool_count;
    struct rdma_peer *peers;

    struct kvf_xfer *ready_head; /* reaped, not handed out yet */
    struct kvf_xfer *ready_tail;
    unsigned ready_count;

    struct ibv_send_wr chain[KVF_RDMA_MAX_WR_PER_QP]; /* post scratch */
    struct ibv_sge sges[KVF_RDMA_MAX_WR_PER_QP];

    struct kvf_transport_rdma_stats st;
};

static struct rdma *rdma_of(struct kvf_transport *base)
{
    return rdma_container_of(base, struct rdma, base);
}

static const struct rdma *rdma_of_const(const struct kvf_transport *base)
{
    return (const struct rdma *)((const char *)base - offsetof(struct rdma, base));
}

static uint32_t rdma_next_psn(struct rdma *t)
{
    t->psn_state = t->psn_state * 1103515245u + 12345u;
    return (t->psn_state >> 8) & 0xffffffu;
}

static uint64_t rdma_now_ms(void)
{
    return (uint64_t)kvf_clock_mono_ms();
}

/* ---- completions ------------------------------------------------------------ */

static void rdma_ready_push(struct rdma *t, struct kvf_xfer *x, enum kvf_lt_outcome outcome,
                            int status)
{
    x->toutcome = (uint8_t)outcome;
    x->tstatus = status;
    x->tnext = NULL;
    if (t->ready_tail)
        t->ready_tail->tnext = x;
    else
        t->ready_head = x;
    t->ready_tail = x;
    t->ready_count++;
}

static void rdma_slot_release(struct rdma_qp *q, struct rdma_wr *w)
{
    if (w->unknown)
        q->unknown--;
    w->busy = false;
    w->unknown = false;
    w->quarantined = false;
    w->x = NULL;
    w->next_free = q->free;
    q->free = w;
    q->outstanding--;
}

/* A slot's WR ended (completion, or proof that it was never posted). */
static void rdma_slot_done(struct rdma *t, struct rdma_wr *w, enum kvf_lt_outcome outcome,
                           int status)
{
    struct kvf_xfer *x = w->x;
    if (outcome == KVF_LT_DONE_OK)
        t->st.wrs_ok++;
    else if (outcome == KVF_LT_DONE_ERROR)
        t->st.wrs_error++;
    else
        t->st.wrs_flushed++;
    rdma_slot_release(w->qp, w);
    rdma_ready_push(t, x, outcome, status);
}

/* The marker of `q` came back: every WR posted before it has completed, so a
 * slot still busy holds a WR that was never posted (an ambiguous post). */
static void rdma_drain_done(struct rdma *t, struct rdma_qp *q)
{
    q->drain_done = true;
    for (unsigned i = 0; i < KVF_RDMA_MAX_WR_PER_QP && q->outstanding > 0; i++) {
        if (q->wrs[i].busy)
            rdma_slot_done(t, &q->wrs[i], KVF_LT_DONE_FLUSHED, -ECANCELED);
    }
}

static void rdma_handle_wc(struct rdma *t, const struct ibv_wc *wc)
{
    struct rdma_tag *tag = (struct rdma_tag *)(uintptr_t)wc->wr_id;
    if (tag->kind == RDMA_TAG_DRAIN) {
        rdma_drain_done(t, rdma_container_of(tag, struct rdma_qp, drain));
        return;
    }
    struct rdma_wr *w = rdma_container_of(tag, struct rdma_wr, tag);
    if (!w->busy)
        return; /* already resolved (cannot happen on a conforming device) */
    if (wc->status == IBV_WC_SUCCESS) {
        rdma_slot_done(t, w, KVF_LT_DONE_OK, 0);
    } else if (wc->status == IBV_WC_WR_FLUSH_ERR) {
        rdma_slot_done(t, w, KVF_LT_DONE_FLUSHED, -ECANCELED);
    } else {
        kvf_log("error", "kvf_rdma: qp %u: wr error %s (vendor 0x%x)", wc->qp_num,
                ibv_wc_status_str(wc->status), wc->vendor_err);
        w->qp->broken = true;
        w->qp->state = RDMA_QP_ERR;
        rdma_slot_done(t, w, KVF_LT_DONE_ERROR, -EIO);
    }
}

/* Reaps one batch of at most `budget` (<= KVF_RDMA_POLL_BATCH) completions
 * into the ready list. Returns how many, or -errno. */
static int rdma_reap(struct rdma *t, unsigned budget)
{
    struct ibv_wc wc[KVF_RDMA_POLL_BATCH];
    if (budget > KVF_RDMA_POLL_BATCH)
        budget = KVF_RDMA_POLL_BATCH;
    int n = t->v->poll_cq(t->prov, t->cq, (int)budget, wc);
    if (n < 0)
        return n;
    for (int i = 0; i < n; i++)
        rdma_handle_wc(t, &wc[i]);
    return n;
}

static int rdma_poll(struct kvf_transport *base, unsigned max, struct kvf_completion *out)
{
    struct rdma *t = rdma_of(base);
    if (max == 0)
        return 0;
    if (!out)
        return -EINVAL;
    int rc = 0;
    while (t->ready_count < max) {
        rc = rdma_reap(t, KVF_RDMA_POLL_BATCH);
        if (rc < (int)KVF_RDMA_POLL_BATCH)
            break;
    }
    if (rc < 0 && t->ready_count == 0)
        return rc;

    unsigned n = 0;
    while (n < max && t->ready_head) {
        struct kvf_xfer *x = t->ready_head;
        t->ready_head = x->tnext;
        if (!t->ready_head)
            t->ready_tail = NULL;
        t->ready_count--;
        x->tnext = NULL;
        enum kvf_lt_outcome outcome = (enum kvf_lt_outcome)x->toutcome;
        out[n].xfer = x;
        out[n].outcome = outcome;
        out[n].status = x->tstatus;
        out[n].drained = kvf_lt_op_retire(&x->op, outcome);
        n++;
    }
    return (int)n;
}

/* ---- posting ------------------------------------------------------------------ */

static const struct rdma_rpool *rdma_rpool_find(const struct rdma_peer *p, uint32_t id)
{
    for (uint32_t i = 0; i < p->rpool_count; i++) {
        if (p->rpools[i].id == id)
            return &p->rpools[i];
    }
    return NULL;
}

static const struct rdma_lpool *rdma_lpool_find_addr(const struct rdma *t, const void *src,
                                                     uint64_t len)
{
    uintptr_t a = (uintptr_t)src;
    for (uint32_t i = 0; i < t->lpool_count; i++) {
        const struct rdma_lpool *lp = &t->lpools[i];
        uintptr_t b = (uintptr_t)lp->base;
        uint64_t size = lp->page_size * lp->page_count;
        if (a >= b && a - b <= size && len <= size - (a - b))
            return lp;
    }
    return NULL;
}

/* Checks one xfer and fills its WR and SGE. 0 or -errno. */
static int rdma_build_wr(struct rdma *t, const struct rdma_peer *p, struct kvf_xfer *x,
                         struct ibv_send_wr *wr, struct ibv_sge *sge)
{
    if (!x->src || x->len == 0 || x->len > KVF_RDMA_MAX_SLICE || x->page_count == 0 || !x->op.lt ||
        x->op.peer != x->peer || x->op.kind != KVF_LT_OP_RDMA_WR)
        return -EINVAL;
    const struct rdma_rpool *rp = rdma_rpool_find(p, x->sink_pool);
    if (!rp)
        return -ENOENT;
    if (x->offset >= rp->page_size || (uint64_t)x->first_page + x->page_count > rp->page_count)
        return -EINVAL;
    uint64_t end = x->offset + x->len;
    if (end <= (uint64_t)(x->page_count - 1) * rp->page_size ||
        end > (uint64_t)x->page_count * rp->page_size)
        return -EINVAL; /* the named pages must be exactly the pages written */
    const struct rdma_lpool *lp = rdma_lpool_find_addr(t, x->src, x->len);
    if (!lp)
        return -EINVAL; /* source not in a registered pool */

    memset(sge, 0, sizeof(*sge));
    sge->addr = (uint64_t)(uintptr_t)x->src;
    sge->length = (uint32_t)x->len;
    sge->lkey = lp->mr->lkey;
    memset(wr, 0, sizeof(*wr));
    wr->sg_list = sge;
    wr->num_sge = 1;
    wr->opcode = IBV_WR_RDMA_WRITE;
    wr->send_flags = IBV_SEND_SIGNALED;
    wr->wr.rdma.remote_addr = rp->addr + (uint64_t)x->first_page * rp->page_size + x->offset;
    wr->wr.rdma.rkey = rp->rkey;
    return 0;
}

int kvf_transport_rdma_post_chain(struct kvf_transport *base, struct kvf_xfer *const *xs,
                                  unsigned n, unsigned *posted_p)
{
    struct rdma *t = rdma_of(base);
    unsigned dummy;
    if (!posted_p)
        posted_p = &dummy;
    *posted_p = 0;
    if (!xs || n == 0 || n > KVF_RDMA_MAX_WR_PER_QP || !xs[0])
        return -EINVAL;
    uint32_t peer = xs[0]->peer;
    kvf_room_key room = xs[0]->room;
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    if (p->fenced)
        return -ESTALE;
    if (!p->connected)
        return -ENOENT;
    struct rdma_qp *q = p->qp[room.room_id % KVF_RDMA_QPS_PER_PEER];
    if (q->broken || q->state != RDMA_QP_RTS)
        return -EIO;

    for (unsigned i = 0; i < n; i++) {
        if (!xs[i] || xs[i]->peer != peer || !kvf_room_key_eq(xs[i]->room, room))
            return -EINVAL;
        int rc = rdma_build_wr(t, p, xs[i], &t->chain[i], &t->sges[i]);
        if (rc != 0)
            return rc;
        t->chain[i].next = i + 1 < n ? &t->chain[i + 1] : NULL;
    }
    if (KVF_RDMA_MAX_WR_PER_QP - q->outstanding < n)
        return -EAGAIN;

    /* Take the slots; they are counted as outstanding from here on. */
    struct rdma_wr *slots[KVF_RDMA_MAX_WR_PER_QP];
    for (unsigned i = 0; i < n; i++) {
        struct rdma_wr *w = q->free;
        q->free = w->next_free;
        w->next_free = NULL;
        w->busy = true;
        w->x = xs[i];
        q->outstanding++;
        slots[i] = w;
        t->chain[i].wr_id = (uint64_t)(uintptr_t)&w->tag;
    }

    struct ibv_send_wr *bad = NULL;
    int rc = t->v->post_send(t->prov, q->qp, &t->chain[0], &bad);
    if (rc == 0) {
        t->st.wrs_posted += n;
        *posted_p = n;
        return 0;
    }

    unsigned k = n; /* index of bad_wr in the chain; n: not in it */
    for (unsigned i = 0; i < n; i++) {
        if (bad == &t->chain[i]) {
            k = i;
            break;
        }
    }
    if (k < n) {
        /* Proof: [0, k) posted, [k, n) not. Give back the slots of the rest;
         * the caller cancels their admissions. */
        for (unsigned i = k; i < n; i++)
            rdma_slot_release(q, slots[i]);
        t->st.wrs_posted += k;
        t->st.posts_failed++;
        *posted_p = k;
        return rc;
    }

    /* No proof either way: keep every WR as outstanding, of unknown fate. */
    kvf_log("error", "kvf_rdma: post_send failed (%d) without a usable bad_wr: %u WRs quarantined",
            rc, n);
    for (unsigned i = 0; i < n; i++) {
        slots[i]->unknown = true;
        slots[i]->quarantined = true;
        q->unknown++;
        kvf_lt_op_quarantine(&xs[i]->op);
    }
    t->st.wrs_posted += n;
    t->st.posts_unknown++;
    t->st.wrs_quarantined += n;
    *posted_p = n;
    return 0;
}

static int rdma_post_write(struct kvf_transport *base, struct kvf_xfer *x)
{
    unsigned posted = 0;
    if (!x)
        return -EINVAL;
    return kvf_transport_rdma_post_chain(base, &x, 1, &posted);
}

/* ---- QP setup: RESET -> INIT -> RTR -> RTS, as in rc_pingpong ---------------------- */

static int rdma_qp_to_init(struct rdma *t, struct rdma_qp *q)
{
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = t->opts.port;
    attr.qp_access_flags =
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    int rc = t->v->modify_qp(t->prov, q->qp, &attr,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc == 0)
        q->state = RDMA_QP_INIT;
    return rc;
}

static int rdma_qp_to_rtr(struct rdma *t, struct rdma_qp *q, const struct kvf_rdma_conn_info *r,
                          unsigned i)
{
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = t->port.active_mtu;
    attr.dest_qp_num = r->qp_num[i];
    attr.rq_psn = r->psn[i];
    attr.max_dest_rd_atomic = 1;
    attr.min_rnr_timer = 12;
    attr.ah_attr.is_global = 0;
    attr.ah_attr.dlid = r->lid;
    attr.ah_attr.sl = 0;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.port_num = t->opts.port;
    if (t->opts.gid_index >= 0) {
        attr.ah_attr.is_global = 1;
        memcpy(attr.ah_attr.grh.dgid.raw, r->gid, sizeof(r->gid));
        attr.ah_attr.grh.sgid_index = (uint8_t)t->opts.gid_index;
        attr.ah_attr.grh.hop_limit = 1;
    }
    int rc = t->v->modify_qp(t->prov, q->qp, &attr,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
    if (rc == 0)
        q->state = RDMA_QP_RTR;
    return rc;
}

static int rdma_qp_to_rts(struct rdma *t, struct rdma_qp *q)
{
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.sq_psn = q->psn;
    attr.max_rd_atomic = 1;
    int rc = t->v->modify_qp(t->prov, q->qp, &attr,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
    if (rc == 0)
        q->state = RDMA_QP_RTS;
    return rc;
}

static int rdma_qp_to_err(struct rdma *t, struct rdma_qp *q)
{
    struct ibv_qp_attr attr;
    memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_ERR;
    int rc = t->v->modify_qp(t->prov, q->qp, &attr, IBV_QP_STATE);
    if (rc == 0)
        q->state = RDMA_QP_ERR;
    return rc;
}

/* Destroys a QP. Slots still busy after the QP is gone are stopped (the device
 * no longer touches memory for it): they come back FLUSHED. */
static void rdma_qp_free(struct rdma *t, struct rdma_qp *q)
{
    if (!q)
        return;
    int rc = t->v->destroy_qp(t->prov, q->qp);
    if (rc != 0) {
        kvf_log("error", "kvf_rdma: destroy_qp: %s; %u WRs stay counted", strerror(-rc),
                q->outstanding);
        return; /* leak the tags on purpose: their ops still count */
    }
    for (unsigned i = 0; i < KVF_RDMA_MAX_WR_PER_QP && q->outstanding > 0; i++) {
        if (q->wrs[i].busy)
            rdma_slot_done(t, &q->wrs[i], KVF_LT_DONE_FLUSHED, -ECANCELED);
    }
    free(q);
}

static int rdma_qp_create(struct rdma *t, struct rdma_qp **q_p)
{
    struct rdma_qp *q = calloc(1, sizeof(*q));
    if (!q)
        return -ENOMEM;
    q->drain.kind = RDMA_TAG_DRAIN;
    for (unsigned i = KVF_RDMA_MAX_WR_PER_QP; i-- > 0;) {
        q->wrs[i].tag.kind = RDMA_TAG_XFER;
        q->wrs[i].qp = q;
        q->wrs[i].next_free = q->free;
        q->free = &q->wrs[i];
    }
    struct ibv_qp_init_attr init;
    memset(&init, 0, sizeof(init));
    init.send_cq = t->cq;
    init.recv_cq = t->cq;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = 1;
    init.cap.max_send_wr = RDMA_SQ_DEPTH;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    int rc = t->v->create_qp(t->prov, t->pd, &init, &q->qp);
    if (rc != 0)
        goto err_free_q;
    rc = rdma_qp_to_init(t, q);
    if (rc != 0)
        goto err_destroy_qp;
    q->psn = rdma_next_psn(t);
    *q_p = q;
    return 0;

err_destroy_qp:
    (void)t->v->destroy_qp(t->prov, q->qp);
err_free_q:
    free(q);
    return rc;
}

int kvf_transport_rdma_local_info(struct kvf_transport *base, uint32_t peer,
                                  struct kvf_rdma_conn_info *info_p)
{
    struct rdma *t = rdma_of(base);
    if (!info_p)
        return -EINVAL;
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    if (p->fenced)
        return -ESTALE;
    if (!p->qp[0]) {
        struct rdma_qp *q[KVF_RDMA_QPS_PER_PEER] = {NULL};
        int rc = rdma_qp_create(t, &q[0]);
        if (rc != 0)
            return rc;
        rc = rdma_qp_create(t, &q[1]);
        if (rc != 0) {
            rdma_qp_free(t, q[0]);
            return rc;
        }
        p->qp[0] = q[0];
        p->qp[1] = q[1];
    }
    struct kvf_rdma_conn_info info;
    memset(&info, 0, sizeof(info));
    info.lid = t->port.lid;
    memcpy(info.gid, t->gid.raw, sizeof(info.gid));
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        info.qp_num[i] = p->qp[i]->qp->qp_num;
        info.psn[i] = p->qp[i]->psn;
    }
    *info_p = info;
    return 0;
}

int kvf_transport_rdma_connect(struct kvf_transport *base, uint32_t peer,
                               const struct kvf_rdma_conn_info *remote)
{
    struct rdma *t = rdma_of(base);
    if (!remote)
        return -EINVAL;
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    if (p->fenced)
        return -ESTALE;
    if (!p->qp[0])
        return -ENOENT;
    if (p->connected)
        return -EEXIST;
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        if (remote->qp_num[i] == 0 || remote->qp_num[i] > 0xffffffu || remote->psn[i] > 0xffffffu)
            return -EINVAL;
    }
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        struct rdma_qp *q = p->qp[i];
        int rc = 0;
        if (q->state == RDMA_QP_INIT)
            rc = rdma_qp_to_rtr(t, q, remote, i);
        if (rc == 0 && q->state == RDMA_QP_RTR)
            rc = rdma_qp_to_rts(t, q);
        if (rc != 0) {
            kvf_log("error", "kvf_rdma: peer %u qp %u: connect: %s", peer, i, strerror(-rc));
            return rc;
        }
    }
    p->connected = true;
    return 0;
}

/* ---- fence --------------------------------------------------------------------- */

/* Posts the drain marker to `q` (in ERR, so it is flushed behind every WR
 * posted before it). */
static void rdma_post_drain(struct rdma *t, struct rdma_qp *q)
{
    struct ibv_send_wr wr;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = (uint64_t)(uintptr_t)&q->drain;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.num_sge = 0;
    wr.send_flags = IBV_SEND_SIGNALED;
    struct ibv_send_wr *bad = NULL;
    int rc = t->v->post_send(t->prov, q->qp, &wr, &bad);
    if (rc == 0)
        q->drain_posted = true;
    else
        kvf_log("error", "kvf_rdma: drain marker: %s; waiting for the WRs themselves",
                strerror(-rc));
}

/* True when every WR posted to `q` has come back. */
static bool rdma_qp_drained(const struct rdma_qp *q)
{
    if (q->drain_posted)
        return q->drain_done;
    return q->outstanding == 0; /* no marker: only provable with no unknowns */
}

/* Both QPs of `p` to ERR, their markers posted, then reaps until every WR
 * posted to them came back (or quarantines the open ones at the timeout).
 * The fence and the reset share it. */
static int rdma_drain_peer(struct rdma *t, uint32_t peer, struct rdma_peer *p)
{
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        struct rdma_qp *q = p->qp[i];
        if (q->state != RDMA_QP_ERR) { /* a broken QP is in ERR already */
            int rc = rdma_qp_to_err(t, q);
            if (rc != 0) {
                kvf_log("error", "kvf_rdma: peer %u qp %u: to ERR: %s", peer, i, strerror(-rc));
                return rc; /* not fenced: everything stays counted */
            }
        }
        if (!q->drain_posted)
            rdma_post_drain(t, q);
    }

    uint64_t deadline = rdma_now_ms() + t->opts.fence_timeout_ms;
    for (;;) {
        bool done = true;
        for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++)
            done = done && rdma_qp_drained(p->qp[i]);
        if (done)
            break;
        int n = rdma_reap(t, KVF_RDMA_POLL_BATCH);
        if (n > 0)
            continue;
        if (n < 0 || rdma_now_ms() >= deadline) {
            /* No proof: quarantine every WR whose fate is open. */
            for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
                struct rdma_qp *q = p->qp[i];
                for (unsigned j = 0; j < KVF_RDMA_MAX_WR_PER_QP; j++) {
                    struct rdma_wr *w = &q->wrs[j];
                    if (w->busy && !w->quarantined) {
                        w->quarantined = true;
                        kvf_lt_op_quarantine(&w->x->op);
                        t->st.wrs_quarantined++;
                    }
                }
            }
            t->st.fences_timed_out++;
            kvf_log("error", "kvf_rdma: peer %u: fence %s; %u+%u WRs quarantined", peer,
                    n < 0 ? "failed to poll" : "timed out", p->qp[0]->outstanding,
                    p->qp[1]->outstanding);
            return n < 0 ? n : -ETIMEDOUT;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 100000};
        nanosleep(&ts, NULL);
    }
    return 0;
}

static int rdma_fence_peer(struct kvf_transport *base, uint32_t peer)
{
    struct rdma *t = rdma_of(base);
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    p->fenced = true; /* no post from here on */
    if (!p->qp[0])
        return 0; /* no QP: nothing of this peer can reach our memory */
    int rc = rdma_drain_peer(t, peer, p);
    if (rc != 0)
        return rc;
    t->st.fences_done++;
    return 0;
}

int kvf_transport_rdma_reset_peer(struct kvf_transport *base, uint32_t peer)
{
    struct rdma *t = rdma_of(base);
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    if (p->fenced)
        return -ESTALE;
    if (!p->qp[0])
        return 0; /* nothing to reset */
    int rc = rdma_drain_peer(t, peer, p);
    if (rc != 0) {
        /* Not proven empty: no fresh QP may stand in for these ones. */
        p->fenced = true;
        return rc;
    }
    /* Every WR came back: the QPs can go (their slots are all free). */
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        rdma_qp_free(t, p->qp[i]);
        p->qp[i] = NULL;
    }
    p->connected = false;
    t->st.peer_resets++;
    return 0;
}

bool kvf_transport_rdma_peer_broken(const struct kvf_transport *base, uint32_t peer)
{
    const struct rdma *t = rdma_of_const(base);
    if (peer >= t->opts.max_peers)
        return false;
    const struct rdma_peer *p = &t->peers[peer];
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++)
        if (p->qp[i] && p->qp[i]->broken)
            return true;
    return false;
}

/* ---- create / destroy -------------------------------------------------------- */

static void rdma_destroy(struct kvf_transport *base)
{
    if (!base)
        return;
    struct rdma *t = rdma_of(base);

    for (uint32_t i = 0; t->peers && i < t->opts.max_peers; i++) {
        if (t->peers[i].qp[0]) {
            int rc = rdma_fence_peer(base, i);
            if (rc != 0)
                kvf_log("error", "kvf_rdma: destroy: fence of peer %u: %s", i, strerror(-rc));
        }
    }
    for (uint32_t i = 0; t->peers && i < t->opts.max_peers; i++) {
        for (unsigned j = 0; j < KVF_RDMA_QPS_PER_PEER; j++)
            rdma_qp_free(t, t->peers[i].qp[j]);
        free(t->peers[i].rpools);
    }
    /* Nobody will poll any more: retire what is left so no op stays counted. */
    for (struct kvf_xfer *x = t->ready_head; x;) {
        struct kvf_xfer *next = x->tnext;
        (void)kvf_lt_op_retire(&x->op, (enum kvf_lt_outcome)x->toutcome);
        x = next;
    }
    for (uint32_t i = 0; t->lpools && i < t->lpool_count; i++)
        t->v->dereg_mr(t->prov, t->lpools[i].mr);
    if (t->cq)
        t->v->destroy_cq(t->prov, t->cq);
    if (t->pd)
        t->v->dealloc_pd(t->prov, t->pd);
    if (t->ctx)
        t->v->close_device(t->prov, t->ctx);
    free(t->lpools);
    free(t->peers);
    free(t);
}

static int rdma_ops_add_pool(struct kvf_transport *base, const struct kvf_transport_pool *p,
                             uint64_t *key_p)
{
    if (p->dev)
        return -EOPNOTSUPP; /* no GPUDirect RDMA: device pools are written over TCP */
    uint32_t rkey = 0;
    int rc = kvf_transport_rdma_add_pool(base, p->id, p->base, p->page_size, p->page_count, &rkey);
    if (rc == 0 && key_p)
        *key_p = rkey;
    return rc;
}

static const struct kvf_transport_ops rdma_ops = {
    .name = "rdma",
    .post_write = rdma_post_write,
    .poll = rdma_poll,
    .fence_peer = rdma_fence_peer,
    .destroy = rdma_destroy,
    /* No completion channel yet: the poller reaps the CQs while WRs are
     * outstanding (kvf_transport_rdma_outstanding). */
    .wake_fd = kvf_transport_no_wake_fd,
    .wake_ack = kvf_transport_no_wake_ack,
    .add_pool = rdma_ops_add_pool,
    .remove_pool = kvf_transport_rdma_remove_pool,
};

void kvf_transport_rdma_opts_init(struct kvf_transport_rdma_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->port = 1;
    opts->gid_index = -1;
    opts->max_peers = 64;
    opts->max_pools = 64;
    opts->fence_timeout_ms = 5000;
}

static bool rdma_ops_complete(const struct kvf_verbs_ops *v)
{
    return v->open_device && v->close_device && v->query_port && v->query_gid && v->alloc_pd &&
           v->dealloc_pd && v->reg_mr && v->dereg_mr && v->create_cq && v->destroy_cq &&
           v->create_qp && v->modify_qp && v->destroy_qp && v->post_send && v->poll_cq;
}

struct kvf_transport *kvf_transport_rdma_create(const struct kvf_transport_rdma_opts *opts,
                                                struct kvf_error *err)
{
    if (!opts || !opts->verbs || !rdma_ops_complete(opts->verbs) || opts->max_peers == 0 ||
        opts->max_peers > 4096 || opts->max_pools == 0 || opts->port == 0 ||
        opts->fence_timeout_ms == 0) {
        kvf_error_set(err, -EINVAL, "rdma: bad options");
        return NULL;
    }
    struct rdma *t = calloc(1, sizeof(*t));
    if (!t) {
        kvf_error_set(err, -ENOMEM, "rdma: out of memory");
        return NULL;
    }
    t->base.ops = &rdma_ops;
    t->opts = *opts;
    t->opts.device = NULL; /* not kept: the caller's string */
    t->v = opts->verbs;
    t->prov = opts->verbs_prov;
    t->psn_state = opts->psn_seed ? opts->psn_seed : (uint32_t)rdma_now_ms() ^ 0x5bd1e995u;

    const char *what = "out of memory";
    int rc = -ENOMEM;
    t->peers = calloc(opts->max_peers, sizeof(*t->peers));
    t->lpools = calloc(opts->max_pools, sizeof(*t->lpools));
    if (!t->peers || !t->lpools)
        goto err_destroy;

    what = "open device";
    rc = t->v->open_device(t->prov, opts->device, &t->ctx);
    if (rc != 0)
        goto err_destroy;
    what = "query port";
    rc = t->v->query_port(t->prov, t->ctx, opts->port, &t->port);
    if (rc != 0)
        goto err_destroy;
    if (opts->gid_index >= 0) {
        what = "query gid";
        rc = t->v->query_gid(t->prov, t->ctx, opts->port, opts->gid_index, &t->gid);
        if (rc != 0)
            goto err_destroy;
    }
    what = "alloc pd";
    rc = t->v->alloc_pd(t->prov, t->ctx, &t->pd);
    if (rc != 0)
        goto err_destroy;
    what = "create cq";
    rc = t->v->create_cq(t->prov, t->ctx,
                         (int)(opts->max_peers * KVF_RDMA_QPS_PER_PEER * RDMA_SQ_DEPTH), &t->cq);
    if (rc != 0)
        goto err_destroy;
    return &t->base;

err_destroy:
    kvf_error_set(err, rc, "rdma: %s%s%s: %s", what, opts->device ? " " : "",
                  opts->device ? opts->device : "", strerror(-rc));
    kvf_log("error", "kvf_rdma: create: %s: %s", what, strerror(-rc));
    rdma_destroy(&t->base); /* accepts the half-built transport */
    return NULL;
}

/* ---- pools and introspection ----------------------------------------------------- */

int kvf_transport_rdma_add_pool(struct kvf_transport *base, uint32_t pool_id, void *pool_base,
                                uint32_t page_size, uint32_t page_count, uint32_t *rkey_p)
{
    struct rdma *t = rdma_of(base);
    if (!pool_base || page_size == 0 || page_count == 0 ||
        (uint64_t)page_size * page_count > (uint64_t)SIZE_MAX)
        return -EINVAL;
    for (uint32_t i = 0; i < t->lpool_count; i++) {
        if (t->lpools[i].id == pool_id)
            return -EEXIST;
    }
    if (t->lpool_count == t->opts.max_pools)
        return -E2BIG;
    struct ibv_mr *mr = NULL;
    int rc = t->v->reg_mr(t->prov, t->pd, pool_base, (size_t)page_size * page_count,
                          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
                          &mr);
    if (rc != 0)
        return rc;
    struct rdma_lpool *lp = &t->lpools[t->lpool_count++];
    lp->id = pool_id;
    lp->base = pool_base;
    lp->page_size = page_size;
    lp->page_count = page_count;
    lp->mr = mr;
    if (rkey_p)
        *rkey_p = mr->rkey;
    return 0;
}

int kvf_transport_rdma_add_remote_pool(struct kvf_transport *base, uint32_t peer, uint32_t pool_id,
                                       uint64_t remote_addr, uint32_t page_size,
                                       uint32_t page_count, uint32_t rkey)
{
    struct rdma *t = rdma_of(base);
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    if (page_size == 0 || page_count == 0 ||
        remote_addr + (uint64_t)page_size * page_count < remote_addr)
        return -EINVAL;
    struct rdma_peer *p = &t->peers[peer];
    if (rdma_rpool_find(p, pool_id))
        return -EEXIST;
    if (!p->rpools) {
        p->rpools = calloc(t->opts.max_pools, sizeof(*p->rpools));
        if (!p->rpools)
            return -ENOMEM;
    }
    if (p->rpool_count == t->opts.max_pools)
        return -E2BIG;
    struct rdma_rpool *rp = &p->rpools[p->rpool_count++];
    rp->id = pool_id;
    rp->addr = remote_addr;
    rp->page_size = page_size;
    rp->page_count = page_count;
    rp->rkey = rkey;
    return 0;
}

unsigned kvf_transport_rdma_outstanding(const struct kvf_transport *base, uint32_t peer,
                                        unsigned qp)
{
    const struct rdma *t = rdma_of_const(base);
    if (peer >= t->opts.max_peers || qp >= KVF_RDMA_QPS_PER_PEER || !t->peers[peer].qp[qp])
        return 0;
    return t->peers[peer].qp[qp]->outstanding;
}

void kvf_transport_rdma_stats(const struct kvf_transport *base,
                              struct kvf_transport_rdma_stats *out)
{
    *out = rdma_of_const(base)->st;
}

int kvf_transport_rdma_remove_pool(struct kvf_transport *base, uint32_t pool_id)
{
    struct rdma *t = rdma_of(base);
    uint32_t k = t->lpool_count;
    for (uint32_t i = 0; i < t->lpool_count && k == t->lpool_count; i++) {
        if (t->lpools[i].id == pool_id)
            k = i;
    }
    if (k == t->lpool_count)
        return -ENOENT;
    const struct rdma_lpool *lp = &t->lpools[k];
    uintptr_t b = (uintptr_t)lp->base;
    uint64_t size = lp->page_size * lp->page_count;
    /* A busy slot (of unknown fate too) may still be read by the device. */
    for (uint32_t i = 0; i < t->opts.max_peers; i++) {
        for (unsigned j = 0; j < KVF_RDMA_QPS_PER_PEER; j++) {
            const struct rdma_qp *q = t->peers[i].qp[j];
            for (unsigned s = 0; q && q->outstanding > 0 && s < KVF_RDMA_MAX_WR_PER_QP; s++) {
                if (!q->wrs[s].busy)
                    continue;
                uintptr_t a = (uintptr_t)q->wrs[s].x->src;
                if (a >= b && a - b < size)
                    return -EBUSY;
            }
        }
    }
    t->v->dereg_mr(t->prov, lp->mr);
    memmove(&t->lpools[k], &t->lpools[k + 1], (t->lpool_count - k - 1) * sizeof(t->lpools[0]));
    t->lpool_count--;
    return 0;
}

int kvf_transport_rdma_remove_remote_pool(struct kvf_transport *base, uint32_t peer,
                                          uint32_t pool_id)
{
    struct rdma *t = rdma_of(base);
    if (peer >= t->opts.max_peers)
        return -ENOENT;
    struct rdma_peer *p = &t->peers[peer];
    const struct rdma_rpool *rp = rdma_rpool_find(p, pool_id);
    if (!rp)
        return -ENOENT;
    /* WRs already posted to it keep going: the rkey is the peer's to revoke. */
    uint32_t k = (uint32_t)(rp - p->rpools);
    memmove(&p->rpools[k], &p->rpools[k + 1], (p->rpool_count - k - 1) * sizeof(p->rpools[0]));
    p->rpool_count--;
    return 0;
}
