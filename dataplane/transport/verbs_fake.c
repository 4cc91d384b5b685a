/*
 * verbs_fake.c: a software verbs provider for tests and dev runs.
 *
 * It plugs into the same seam as the real provider (verbs.h) and behaves
 * like an RC device as far as the transport can see:
 *
 * - QPs follow the verbs state machine (RESET -> INIT -> RTR -> RTS, and ERR
 *   from any state). modify_qp checks that the mask is exactly the one
 *   rc_pingpong uses for the transition (anything else is -EINVAL, as a strict
 *   driver answers) and records each accepted call.
 * - post_send takes WRs only in RTS (or in ERR, where they are flushed at
 *   once, as hardware does), up to the QP's max_send_wr; each accepted WR
 *   waits in the QP's queue until the test completes it with a status of its
 *   choice, in order or out of order. Nothing ever completes on its own.
 * - Moving a QP to ERR (by modify_qp, or by the test as a fatal error would)
 *   turns every outstanding WR into an IBV_WC_WR_FLUSH_ERR completion, unless
 *   the test holds that QP's flushes.
 * - Chosen calls fail on command; post_send can fail part way through a
 *   chain, with a precise bad_wr or an ambiguous NULL one.
 *
 * Completions go to the QP's send CQ in the order they are made; a CQ that
 * overflows makes poll_cq fail with -EIO (the transport sizes its CQ so that
 * this cannot happen).
 *
 * DESIGN: no locks; the fake is used by one thread (the one driving the
 * transport and the test).
 */
#include "verbs.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_QPN_BASE 0x100u

struct fake_cq {
    struct ibv_cq cq;
    struct ibv_wc *wcs; /* ring of `cap` */
    unsigned cap;
    unsigned head;
    unsigned count;
    bool overflow;
    struct fake_cq *next;
};

struct fake_qp {
    struct ibv_qp qp;
    struct fake_cq *scq;
    enum ibv_qp_state state;
    bool hold_flushes;
    struct kvf_verbs_fake_wr *wrs; /* outstanding, oldest first */
    unsigned count;
    unsigned cap;
    struct kvf_verbs_fake_transition *log;
    unsigned log_count;
    unsigned log_cap;
    struct fake_qp *next;
};

struct kvf_verbs_fake {
    unsigned fail_nth[KVF_FAKE_CALL_COUNT];
    int fail_err[KVF_FAKE_CALL_COUNT];
    bool post_fail_armed;
    unsigned post_fail_after;
    int post_fail_err;
    bool post_fail_ambiguous;

    uint32_t next_qpn;
    uint32_t next_key;
    struct fake_cq *cqs;
    struct fake_qp *qps;
    struct kvf_verbs_fake_stats stats;
};

/* The provider instance of a context/PD is the fake itself: contexts and PDs
 * are plain allocations whose first word points back at it. */
struct fake_ctx {
    struct ibv_context ctx;
    struct kvf_verbs_fake *f;
};

struct fake_pd {
    struct ibv_pd pd;
    struct kvf_verbs_fake *f;
};

#define fake_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

static int fake_injected(struct kvf_verbs_fake *f, enum kvf_verbs_fake_call call)
{
    if (f->fail_nth[call] == 0)
        return 0;
    if (--f->fail_nth[call] != 0)
        return 0;
    return f->fail_err[call];
}

static struct fake_qp *fake_qp_find(const struct kvf_verbs_fake *f, uint32_t qp_num)
{
    for (struct fake_qp *q = f->qps; q; q = q->next) {
        if (q->qp.qp_num == qp_num)
            return q;
    }
    return NULL;
}

static void fake_cq_push(struct kvf_verbs_fake *f, struct fake_cq *cq,
                         const struct kvf_verbs_fake_wr *wr, uint32_t qp_num,
                         enum ibv_wc_status status)
{
    f->stats.completions++;
    if (status == IBV_WC_WR_FLUSH_ERR)
        f->stats.flushes++;
    if (cq->count == cq->cap) {
        cq->overflow = true;
        return;
    }
    struct ibv_wc *wc = &cq->wcs[(cq->head + cq->count) % cq->cap];
    memset(wc, 0, sizeof(*wc));
    wc->wr_id = wr->wr_id;
    wc->status = status;
    wc->opcode = IBV_WC_RDMA_WRITE;
    wc->qp_num = qp_num;
    wc->byte_len = status == IBV_WC_SUCCESS ? wr->length : 0;
    cq->count++;
}

/* Completes outstanding WR `index` of `q` with `status`. */
static void fake_qp_complete_one(struct kvf_verbs_fake *f, struct fake_qp *q, unsigned index,
                                 enum ibv_wc_status status)
{
    fake_cq_push(f, q->scq, &q->wrs[index], q->qp.qp_num, status);
    memmove(&q->wrs[index], &q->wrs[index + 1], (q->count - index - 1) * sizeof(q->wrs[0]));
    q->count--;
    if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR)
        q->state = IBV_QPS_ERR; /* an RC error completion breaks the QP */
}

static void fake_qp_flush(struct kvf_verbs_fake *f, struct fake_qp *q)
{
    if (q->state != IBV_QPS_ERR || q->hold_flushes)
        return;
    while (q->count > 0)
        fake_qp_complete_one(f, q, 0, IBV_WC_WR_FLUSH_ERR);
}

/* ---- ops ------------------------------------------------------------------ */

static int fake_open_device(void *prov, const char *dev_name, struct ibv_context **ctx_p)
{
    struct kvf_verbs_fake *f = prov;
    if (!f)
        return -EINVAL;
    int rc = fake_injected(f, KVF_FAKE_OPEN_DEVICE);
    if (rc != 0)
        return rc;
    if (dev_name && strcmp(dev_name, "fake0") != 0)
        return -ENODEV;
    struct fake_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->f = f;
    f->stats.objects_live++;
    *ctx_p = &c->ctx;
    return 0;
}

static void fake_close_device(void *prov, struct ibv_context *ctx)
{
    struct kvf_verbs_fake *f = prov;
    f->stats.objects_live--;
    free(fake_container_of(ctx, struct fake_ctx, ctx));
}

static int fake_query_port(void *prov, struct ibv_context *ctx, uint8_t port,
                           struct ibv_port_attr *attr_p)
{
    (void)prov;
    (void)ctx;
    if (port != 1)
        return -EINVAL;
    memset(attr_p, 0, sizeof(*attr_p));
    attr_p->state = IBV_PORT_ACTIVE;
    attr_p->max_mtu = IBV_MTU_4096;
    attr_p->active_mtu = IBV_MTU_4096;
    attr_p->lid = 7;
    attr_p->link_layer = IBV_LINK_LAYER_INFINIBAND;
    return 0;
}

static int fake_query_gid(void *prov, struct ibv_context *ctx, uint8_t port, int index,
                          union ibv_gid *gid_p)
{
    (void)prov;
    (void)ctx;
    if (port != 1 || index < 0 || index > 15)
        return -EINVAL;
    memset(gid_p, 0, sizeof(*gid_p));
    gid_p->raw[15] = 7;
    return 0;
}

static int fake_alloc_pd(void *prov, struct ibv_context *ctx, struct ibv_pd **pd_p)
{
    struct kvf_verbs_fake *f = prov;
    int rc = fake_injected(f, KVF_FAKE_ALLOC_PD);
    if (rc != 0)
        return rc;
    struct fake_pd *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    p->pd.context = ctx;
    p->f = f;
    f->stats.objects_live++;
    *pd_p = &p->pd;
    return 0;
}

static void fake_dealloc_pd(void *prov, struct ibv_pd *pd)
{
    struct kvf_verbs_fake *f = prov;
    f->stats.objects_live--;
    free(fake_container_of(pd, struct fake_pd, pd));
}

static int fake_reg_mr(void *prov, struct ibv_pd *pd, void *addr, size_t length, int access,
                       struct ibv_mr **mr_p)
{
    struct kvf_verbs_fake *f = prov;
    int rc = fake_injected(f, KVF_FAKE_REG_MR);
    if (rc != 0)
        return rc;
    if (!addr || length == 0 || !(access & IBV_ACCESS_LOCAL_WRITE))
        return -EINVAL;
    struct ibv_mr *mr = calloc(1, sizeof(*mr));
    if (!mr)
        return -ENOMEM;
    mr->pd = pd;
    mr->context = pd->context;
    mr->addr = addr;
    mr->length = length;
    mr->lkey = ++f->next_key;
    mr->rkey = 0x10000u + f->next_key;
    f->stats.objects_live++;
    *mr_p = mr;
    return 0;
}

static void fake_dereg_mr(void *prov, struct ibv_mr *mr)
{
    struct kvf_verbs_fake *f = prov;
    f->stats.objects_live--;
    free(mr);
}

static int fake_create_cq(void *prov, struct ibv_context *ctx, int cqe, struct ibv_cq **cq_p)
{
    struct kvf_verbs_fake *f = prov;
    int rc = fake_injected(f, KVF_FAKE_CREATE_CQ);
    if (rc != 0)
        return rc;
    if (cqe < 1)
        return -EINVAL;
    struct fake_cq *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->wcs = calloc((size_t)cqe, sizeof(*c->wcs));
    if (!c->wcs) {
        free(c);
        return -ENOMEM;
    }
    c->cap = (unsigned)cqe;
    c->cq.context = ctx;
    c->cq.cqe = cqe;
    c->next = f->cqs;
    f->cqs = c;
    f->stats.objects_live++;
    *cq_p = &c->cq;
    return 0;
}

static void fake_destroy_cq(void *prov, struct ibv_cq *cq)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_cq *c = fake_container_of(cq, struct fake_cq, cq);
    for (struct fake_cq **pp = &f->cqs; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    f->stats.objects_live--;
    free(c->wcs);
    free(c);
}

static int fake_create_qp(void *prov, struct ibv_pd *pd, struct ibv_qp_init_attr *init,
                          struct ibv_qp **qp_p)
{
    struct kvf_verbs_fake *f = prov;
    int rc = fake_injected(f, KVF_FAKE_CREATE_QP);
    if (rc != 0)
        return rc;
    if (init->qp_type != IBV_QPT_RC || !init->send_cq || init->cap.max_send_wr == 0)
        return -EINVAL;
    struct fake_qp *q = calloc(1, sizeof(*q));
    if (!q)
        return -ENOMEM;
    q->wrs = calloc(init->cap.max_send_wr, sizeof(*q->wrs));
    if (!q->wrs) {
        free(q);
        return -ENOMEM;
    }
    q->cap = init->cap.max_send_wr;
    q->scq = fake_container_of(init->send_cq, struct fake_cq, cq);
    q->state = IBV_QPS_RESET;
    q->qp.context = pd->context;
    q->qp.pd = pd;
    q->qp.send_cq = init->send_cq;
    q->qp.recv_cq = init->recv_cq;
    q->qp.qp_type = IBV_QPT_RC;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_num = FAKE_QPN_BASE + f->next_qpn++;
    q->next = f->qps;
    f->qps = q;
    f->stats.objects_live++;
    *qp_p = &q->qp;
    return 0;
}

/* The exact mask rc_pingpong gives each transition. */
static int fake_required_mask(enum ibv_qp_state from, enum ibv_qp_state to)
{
    if (to == IBV_QPS_ERR || to == IBV_QPS_RESET)
        return IBV_QP_STATE;
    if (from == IBV_QPS_RESET && to == IBV_QPS_INIT)
        return IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    if (from == IBV_QPS_INIT && to == IBV_QPS_RTR)
        return IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (from == IBV_QPS_RTR && to == IBV_QPS_RTS)
        return IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
               IBV_QP_MAX_QP_RD_ATOMIC;
    return -1; /* not a legal transition */
}

static int fake_modify_qp(void *prov, struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_qp *q = fake_container_of(qp, struct fake_qp, qp);
    int rc = fake_injected(f, KVF_FAKE_MODIFY_QP);
    if (rc != 0)
        return rc;
    if (!(attr_mask & IBV_QP_STATE) || attr_mask != fake_required_mask(q->state, attr->qp_state))
        return -EINVAL;
    if (q->log_count == q->log_cap) {
        unsigned cap = q->log_cap ? q->log_cap * 2 : 8;
        struct kvf_verbs_fake_transition *log = realloc(q->log, cap * sizeof(*log));
        if (!log)
            return -ENOMEM;
        q->log = log;
        q->log_cap = cap;
    }
    struct kvf_verbs_fake_transition *rec = &q->log[q->log_count++];
    rec->from = q->state;
    rec->attr = *attr;
    rec->mask = attr_mask;
    q->state = attr->qp_state;
    qp->state = q->state;
    if (q->state == IBV_QPS_RESET)
        q->count = 0; /* RESET discards the queue without completions */
    fake_qp_flush(f, q);
    return 0;
}

static int fake_destroy_qp(void *prov, struct ibv_qp *qp)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_qp *q = fake_container_of(qp, struct fake_qp, qp);
    for (struct fake_qp **pp = &f->qps; *pp; pp = &(*pp)->next) {
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    }
    f->stats.objects_live--;
    free(q->log);
    free(q->wrs);
    free(q);
    return 0;
}

static int fake_post_send(void *prov, struct ibv_qp *qp, struct ibv_send_wr *wr,
                          struct ibv_send_wr **bad_wr)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_qp *q = fake_container_of(qp, struct fake_qp, qp);
    f->stats.post_calls++;
    bool armed = f->post_fail_armed;
    f->post_fail_armed = false;

    unsigned i = 0;
    int rc = 0;
    for (; wr; wr = wr->next, i++) {
        if (armed && i == f->post_fail_after)
            rc = f->post_fail_err;
        else if (q->state != IBV_QPS_RTS && q->state != IBV_QPS_ERR)
            rc = -EINVAL;
        else if (q->count == q->cap)
            rc = -ENOMEM;
        else if (wr->num_sge > 1 || wr->opcode != IBV_WR_RDMA_WRITE)
            rc = -EINVAL;
        if (rc != 0)
            break;
        struct kvf_verbs_fake_wr *w = &q->wrs[q->count++];
        memset(w, 0, sizeof(*w));
        w->wr_id = wr->wr_id;
        w->opcode = wr->opcode;
        w->send_flags = wr->send_flags;
        if (wr->num_sge == 1) {
            w->local_addr = wr->sg_list[0].addr;
            w->length = wr->sg_list[0].length;
            w->lkey = wr->sg_list[0].lkey;
        }
        w->remote_addr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        f->stats.wrs_posted++;
    }
    fake_qp_flush(f, q); /* a WR posted to a QP in ERR is flushed at once */
    if (rc == 0)
        return 0;
    for (struct ibv_send_wr *w = wr; w; w = w->next)
        f->stats.wrs_refused++;
    *bad_wr = armed && f->post_fail_ambiguous ? NULL : wr;
    return rc;
}

static int fake_poll_cq(void *prov, struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_cq *c = fake_container_of(cq, struct fake_cq, cq);
    int rc = fake_injected(f, KVF_FAKE_POLL_CQ);
    if (rc != 0)
        return rc;
    if (c->overflow)
        return -EIO;
    int n = 0;
    while (n < num_entries && c->count > 0) {
        wc[n++] = c->wcs[c->head];
        c->head = (c->head + 1) % c->cap;
        c->count--;
    }
    return n;
}

const struct kvf_verbs_ops kvf_verbs_fake_ops = {
    .name = "fake",
    .open_device = fake_open_device,
    .close_device = fake_close_device,
    .query_port = fake_query_port,
    .query_gid = fake_query_gid,
    .alloc_pd = fake_alloc_pd,
    .dealloc_pd = fake_dealloc_pd,
    .reg_mr = fake_reg_mr,
    .dereg_mr = fake_dereg_mr,
    .create_cq = fake_create_cq,
    .destroy_cq = fake_destroy_cq,
    .create_qp = fake_create_qp,
    .modify_qp = fake_modify_qp,
    .destroy_qp = fake_destroy_qp,
    .post_send = fake_post_send,
    .poll_cq = fake_poll_cq,
};

/* ---- test control ---------------------------------------------------------- */

struct kvf_verbs_fake *kvf_verbs_fake_create(void)
{
    return calloc(1, sizeof(struct kvf_verbs_fake));
}

void kvf_verbs_fake_destroy(struct kvf_verbs_fake *f)
{
    if (!f)
        return;
    while (f->qps)
        (void)fake_destroy_qp(f, &f->qps->qp);
    while (f->cqs)
        fake_destroy_cq(f, &f->cqs->cq);
    free(f);
}

void kvf_verbs_fake_fail_call(struct kvf_verbs_fake *f, enum kvf_verbs_fake_call call, unsigned nth,
                              int err)
{
    if ((unsigned)call >= KVF_FAKE_CALL_COUNT)
        return;
    f->fail_nth[call] = nth;
    f->fail_err[call] = err;
}

void kvf_verbs_fake_fail_post_after(struct kvf_verbs_fake *f, unsigned n, int err, bool ambiguous)
{
    f->post_fail_armed = true;
    f->post_fail_after = n;
    f->post_fail_err = err;
    f->post_fail_ambiguous = ambiguous;
}

unsigned kvf_verbs_fake_complete(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned n,
                                 enum ibv_wc_status status)
{
    struct fake_qp *q = fake_qp_find(f, qp_num);
    unsigned done = 0;
    while (q && done < n && q->count > 0) {
        fake_qp_complete_one(f, q, 0, status);
        done++;
    }
    return done;
}

int kvf_verbs_fake_complete_at(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                               enum ibv_wc_status status)
{
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (!q || index >= q->count)
        return -ENOENT;
    fake_qp_complete_one(f, q, index, status);
    return 0;
}

int kvf_verbs_fake_set_qp_error(struct kvf_verbs_fake *f, uint32_t qp_num)
{
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (!q)
        return -ENOENT;
    q->state = IBV_QPS_ERR;
    q->qp.state = IBV_QPS_ERR;
    fake_qp_flush(f, q);
    return 0;
}

int kvf_verbs_fake_hold_flushes(struct kvf_verbs_fake *f, uint32_t qp_num, bool hold)
{
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (!q)
        return -ENOENT;
    q->hold_flushes = hold;
    fake_qp_flush(f, q);
    return 0;
}

unsigned kvf_verbs_fake_outstanding(const struct kvf_verbs_fake *f, uint32_t qp_num)
{
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    return q ? q->count : 0;
}

int kvf_verbs_fake_peek_wr(const struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                           struct kvf_verbs_fake_wr *out)
{
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    if (!q || index >= q->count)
        return -ENOENT;
    *out = q->wrs[index];
    return 0;
}

enum ibv_qp_state kvf_verbs_fake_qp_state(const struct kvf_verbs_fake *f, uint32_t qp_num)
{
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    return q ? q->state : IBV_QPS_UNKNOWN;
}

unsigned kvf_verbs_fake_transitions(const struct kvf_verbs_fake *f, uint32_t qp_num,
                                    struct kvf_verbs_fake_transition *out, unsigned max)
{
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    if (!q)
        return 0;
    for (unsigned i = 0; i < q->log_count && i < max; i++)
        out[i] = q->log[i];
    return q->log_count;
}

void kvf_verbs_fake_stats(const struct kvf_verbs_fake *f, struct kvf_verbs_fake_stats *out)
{
    *out = f->stats;
}
