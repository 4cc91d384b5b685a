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
 * Fabric mode (kvf_verbs_fake_create_fabric, verbs.h) adds MR checks and
 * two kinds of threads: a sender that executes the WRs of QPs in RTS over
 * Unix sockets (fab_sender_main), and a responder (an accept thread plus one
 * thread per incoming connection) that checks and copies incoming writes.
 * Wire format, host byte order (both ends are on one host): a u32 length,
 * then a struct fab_req and the payload; the answer is a u32 length and a
 * struct fab_rep.
 *
 * DESIGN: one mutex per device (`mu`) guards every object of it; ops and
 * control calls take it, and so do the fabric threads while they look at or
 * change state (never while they block on a socket). The responder checks and
 * copies under it, so modify_qp(ERR), destroy_qp and dereg_mr order strictly
 * before or after each incoming write.
 */
#include "verbs.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define FAKE_QPN_BASE 0x100u
#define FAB_NAME_MAX  48u
#define FAB_MAX_LEN   (64u << 20) /* largest WR the fabric carries */
#define FAB_MAGIC     0x6b764642u /* "kvFB" */

enum fab_status {
    FAB_OK = 0,
    FAB_ACCESS = 1, /* bad rkey, access or bounds: REM_ACCESS_ERR */
    FAB_NAK = 2,    /* no such QP, wrong state or not ours: RETRY_EXC_ERR */
};

/* One RDMA WRITE on the wire (followed by `length` payload bytes). */
struct fab_req {
    uint32_t magic;
    uint32_t src_qpn;
    uint32_t dst_qpn;
    uint32_t rkey;
    uint32_t length;
    uint32_t pad;
    uint8_t src_gid[16];
    uint64_t remote_addr;
    uint64_t seq;
};
_Static_assert(sizeof(struct fab_req) == 56, "fab_req has no padding");

struct fab_rep {
    uint64_t seq;
    uint32_t status; /* enum fab_status */
    uint32_t pad;
};
_Static_assert(sizeof(struct fab_rep) == 16, "fab_rep has no padding");

struct fake_cq {
    struct ibv_cq cq;
    struct ibv_wc *wcs; /* ring of `cap` */
    unsigned cap;
    unsigned head;
    unsigned count;
    bool overflow;
    struct fake_cq *next;
};

struct fake_wr {
    struct kvf_verbs_fake_wr pub;
    uint64_t seq; /* unique per device: finds the WR again after a send */
};

struct fake_qp {
    struct ibv_qp qp;
    struct fake_cq *scq;
    enum ibv_qp_state state;
    bool hold_flushes;
    bool hold_send;      /* fabric: its WRs stay outstanding (kvf_verbs_fake_fabric_hold_qp) */
    int access;          /* qp_access_flags given at INIT */
    bool connected;      /* RTR given: rgid and rqpn are set */
    union ibv_gid rgid;  /* the remote GID */
    uint32_t rqpn;       /* the remote QP */
    bool inflight;       /* wrs[0] is on the wire (fabric) */
    struct fake_wr *wrs; /* outstanding, oldest first */
    unsigned count;
    unsigned cap;
    struct kvf_verbs_fake_transition *log;
    unsigned log_count;
    unsigned log_cap;
    struct fake_qp *next;
};

struct fake_mr {
    struct ibv_mr mr;
    int access;
    struct fake_mr *next;
};

/* An incoming connection and the thread serving it. */
struct fab_conn {
    int fd;
    pthread_t thread;
    bool done; /* the thread has finished (join it) */
    struct kvf_verbs_fake *f;
    struct fab_conn *next;
};

/* A cached outgoing connection to a remote device. */
struct fab_out {
    union ibv_gid gid;
    int fd;
    struct fab_out *next;
};

struct kvf_verbs_fake {
    pthread_mutex_t mu;
    unsigned fail_nth[KVF_FAKE_CALL_COUNT];
    int fail_err[KVF_FAKE_CALL_COUNT];
    bool post_fail_armed;
    unsigned post_fail_after;
    int post_fail_err;
    bool post_fail_ambiguous;

    uint32_t next_qpn;
    uint32_t next_key;
    uint64_t next_seq;
    struct fake_cq *cqs;
    struct fake_qp *qps;
    struct fake_mr *mrs;
    struct kvf_verbs_fake_stats stats;

    /* fabric mode */
    bool fabric;
    char fabric_name[FAB_NAME_MAX + 1];
    union ibv_gid gid;
    bool hold;
    bool stopping;
    pthread_cond_t cv; /* the sender waits on it for work */
    int listen_fd;
    int stop_pipe[2]; /* readable once stopping: wakes every poll */
    pthread_t sender;
    pthread_t acceptor;
    bool sender_started;
    bool acceptor_started;
    uint32_t last_qpn; /* the sender's round robin */
    struct fab_conn *conns;
    struct fab_out *outs;
    struct kvf_verbs_fake_fabric_stats fstats;
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

/* The control calls that only read take a const fake; the mutex is not part
 * of what they promise to leave alone. */
static void fake_lock(const struct kvf_verbs_fake *f)
{
    pthread_mutex_lock((pthread_mutex_t *)&f->mu);
}

static void fake_unlock(const struct kvf_verbs_fake *f)
{
    pthread_mutex_unlock((pthread_mutex_t *)&f->mu);
}

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
    fake_cq_push(f, q->scq, &q->wrs[index].pub, q->qp.qp_num, status);
    memmove(&q->wrs[index], &q->wrs[index + 1], (q->count - index - 1) * sizeof(q->wrs[0]));
    q->count--;
    if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR) {
        q->state = IBV_QPS_ERR; /* an RC error completion breaks the QP */
        q->qp.state = IBV_QPS_ERR;
    }
}

/* A WR on the wire completes first (completions come in post order); the
 * sender flushes the rest when it is back. */
static void fake_qp_flush(struct kvf_verbs_fake *f, struct fake_qp *q)
{
    if (q->state != IBV_QPS_ERR || q->hold_flushes || q->inflight)
        return;
    while (q->count > 0)
        fake_qp_complete_one(f, q, 0, IBV_WC_WR_FLUSH_ERR);
}

static struct fake_mr *fake_mr_find(const struct kvf_verbs_fake *f, const struct ibv_pd *pd,
                                    uint32_t key, bool remote)
{
    for (struct fake_mr *m = f->mrs; m; m = m->next) {
        if (m->mr.pd == pd && (remote ? m->mr.rkey : m->mr.lkey) == key)
            return m;
    }
    return NULL;
}

static bool fake_mr_holds(const struct fake_mr *m, uint64_t addr, uint64_t len)
{
    uint64_t base = (uint64_t)(uintptr_t)m->mr.addr;
    return addr >= base && addr - base <= m->mr.length && len <= m->mr.length - (addr - base);
}

/* ---- ops ------------------------------------------------------------------ */

static int fake_open_device(void *prov, const char *dev_name, struct ibv_context **ctx_p)
{
    struct kvf_verbs_fake *f = prov;
    if (!f)
        return -EINVAL;
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_OPEN_DEVICE);
    if (rc == 0 && dev_name && strcmp(dev_name, "fake0") != 0)
        rc = -ENODEV;
    struct fake_ctx *c = NULL;
    if (rc == 0) {
        c = calloc(1, sizeof(*c));
        rc = c ? 0 : -ENOMEM;
    }
    if (rc == 0) {
        c->f = f;
        f->stats.objects_live++;
        *ctx_p = &c->ctx;
    }
    fake_unlock(f);
    return rc;
}

static void fake_close_device(void *prov, struct ibv_context *ctx)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    f->stats.objects_live--;
    fake_unlock(f);
    free(fake_container_of(ctx, struct fake_ctx, ctx));
}

static int fake_query_port(void *prov, struct ibv_context *ctx, uint8_t port,
                           struct ibv_port_attr *attr_p)
{
    struct kvf_verbs_fake *f = prov;
    (void)ctx;
    if (port != 1)
        return -EINVAL;
    memset(attr_p, 0, sizeof(*attr_p));
    attr_p->state = IBV_PORT_ACTIVE;
    attr_p->max_mtu = IBV_MTU_4096;
    attr_p->active_mtu = IBV_MTU_4096;
    if (f->fabric) { /* RoCE-like: no LID, routed by GID */
        attr_p->lid = 0;
        attr_p->link_layer = IBV_LINK_LAYER_ETHERNET;
    } else {
        attr_p->lid = 7;
        attr_p->link_layer = IBV_LINK_LAYER_INFINIBAND;
    }
    return 0;
}

static int fake_query_gid(void *prov, struct ibv_context *ctx, uint8_t port, int index,
                          union ibv_gid *gid_p)
{
    struct kvf_verbs_fake *f = prov;
    (void)ctx;
    if (f->fabric) {
        if (port != 1 || index != 0)
            return -EINVAL;
        *gid_p = f->gid; /* immutable after create */
        return 0;
    }
    if (port != 1 || index < 0 || index > 15)
        return -EINVAL;
    memset(gid_p, 0, sizeof(*gid_p));
    gid_p->raw[15] = 7;
    return 0;
}

static int fake_alloc_pd(void *prov, struct ibv_context *ctx, struct ibv_pd **pd_p)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_ALLOC_PD);
    struct fake_pd *p = NULL;
    if (rc == 0) {
        p = calloc(1, sizeof(*p));
        rc = p ? 0 : -ENOMEM;
    }
    if (rc == 0) {
        p->pd.context = ctx;
        p->f = f;
        f->stats.objects_live++;
        *pd_p = &p->pd;
    }
    fake_unlock(f);
    return rc;
}

static void fake_dealloc_pd(void *prov, struct ibv_pd *pd)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    f->stats.objects_live--;
    fake_unlock(f);
    free(fake_container_of(pd, struct fake_pd, pd));
}

static int fake_reg_mr(void *prov, struct ibv_pd *pd, void *addr, size_t length, int access,
                       struct ibv_mr **mr_p)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_REG_MR);
    if (rc == 0 && (!addr || length == 0 || !(access & IBV_ACCESS_LOCAL_WRITE)))
        rc = -EINVAL;
    struct fake_mr *m = NULL;
    if (rc == 0) {
        m = calloc(1, sizeof(*m));
        rc = m ? 0 : -ENOMEM;
    }
    if (rc == 0) {
        m->mr.pd = pd;
        m->mr.context = pd->context;
        m->mr.addr = addr;
        m->mr.length = length;
        m->mr.lkey = ++f->next_key;
        m->mr.rkey = 0x10000u + f->next_key;
        m->access = access;
        m->next = f->mrs;
        f->mrs = m;
        f->stats.objects_live++;
        *mr_p = &m->mr;
    }
    fake_unlock(f);
    return rc;
}

static void fake_mr_unlink_free(struct kvf_verbs_fake *f, struct fake_mr *m)
{
    for (struct fake_mr **pp = &f->mrs; *pp; pp = &(*pp)->next) {
        if (*pp == m) {
            *pp = m->next;
            break;
        }
    }
    f->stats.objects_live--;
    free(m);
}

/* Under the lock: no incoming write is being copied into it once this returns. */
static void fake_dereg_mr(void *prov, struct ibv_mr *mr)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    fake_mr_unlink_free(f, fake_container_of(mr, struct fake_mr, mr));
    fake_unlock(f);
}

static int fake_create_cq(void *prov, struct ibv_context *ctx, int cqe, struct ibv_cq **cq_p)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_CREATE_CQ);
    if (rc == 0 && cqe < 1)
        rc = -EINVAL;
    struct fake_cq *c = NULL;
    if (rc == 0) {
        c = calloc(1, sizeof(*c));
        if (c)
            c->wcs = calloc((size_t)cqe, sizeof(*c->wcs));
        if (!c || !c->wcs) {
            free(c);
            rc = -ENOMEM;
        }
    }
    if (rc == 0) {
        c->cap = (unsigned)cqe;
        c->cq.context = ctx;
        c->cq.cqe = cqe;
        c->next = f->cqs;
        f->cqs = c;
        f->stats.objects_live++;
        *cq_p = &c->cq;
    }
    fake_unlock(f);
    return rc;
}

static void fake_cq_unlink_free(struct kvf_verbs_fake *f, struct fake_cq *c)
{
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

static void fake_destroy_cq(void *prov, struct ibv_cq *cq)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    fake_cq_unlink_free(f, fake_container_of(cq, struct fake_cq, cq));
    fake_unlock(f);
}

static int fake_create_qp(void *prov, struct ibv_pd *pd, struct ibv_qp_init_attr *init,
                          struct ibv_qp **qp_p)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_CREATE_QP);
    if (rc == 0 && (init->qp_type != IBV_QPT_RC || !init->send_cq || init->cap.max_send_wr == 0))
        rc = -EINVAL;
    struct fake_qp *q = NULL;
    if (rc == 0) {
        q = calloc(1, sizeof(*q));
        if (q)
            q->wrs = calloc(init->cap.max_send_wr, sizeof(*q->wrs));
        if (!q || !q->wrs) {
            free(q);
            rc = -ENOMEM;
        }
    }
    if (rc == 0) {
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
    }
    fake_unlock(f);
    return rc;
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

static int fake_modify_qp_locked(struct kvf_verbs_fake *f, struct fake_qp *q,
                                 struct ibv_qp_attr *attr, int attr_mask)
{
    int rc = fake_injected(f, KVF_FAKE_MODIFY_QP);
    if (rc != 0)
        return rc;
    if (!(attr_mask & IBV_QP_STATE) || attr_mask != fake_required_mask(q->state, attr->qp_state))
        return -EINVAL;
    /* RoCE has no LIDs: a connection names the remote GID. */
    if (f->fabric && attr->qp_state == IBV_QPS_RTR && !attr->ah_attr.is_global)
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
    if (attr->qp_state == IBV_QPS_INIT)
        q->access = (int)attr->qp_access_flags;
    if (attr->qp_state == IBV_QPS_RTR) {
        q->connected = true;
        q->rgid = attr->ah_attr.grh.dgid;
        q->rqpn = attr->dest_qp_num;
    }
    q->state = attr->qp_state;
    q->qp.state = q->state;
    if (q->state == IBV_QPS_RESET) {
        q->count = 0; /* RESET discards the queue without completions */
        q->inflight = false;
        q->connected = false;
    }
    fake_qp_flush(f, q);
    return 0;
}

/* Under the lock: after a move to ERR no incoming write for this QP is being
 * copied, and none will be. */
static int fake_modify_qp(void *prov, struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    int rc = fake_modify_qp_locked(f, fake_container_of(qp, struct fake_qp, qp), attr, attr_mask);
    fake_unlock(f);
    return rc;
}

static void fake_qp_unlink_free(struct kvf_verbs_fake *f, struct fake_qp *q)
{
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
}

static int fake_destroy_qp(void *prov, struct ibv_qp *qp)
{
    struct kvf_verbs_fake *f = prov;
    fake_lock(f);
    fake_qp_unlink_free(f, fake_container_of(qp, struct fake_qp, qp));
    fake_unlock(f);
    return 0;
}

static int fake_post_send(void *prov, struct ibv_qp *qp, struct ibv_send_wr *wr,
                          struct ibv_send_wr **bad_wr)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_qp *q = fake_container_of(qp, struct fake_qp, qp);
    fake_lock(f);
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
        else if (f->fabric && wr->num_sge == 1 && wr->sg_list[0].length > FAB_MAX_LEN)
            rc = -EINVAL;
        if (rc != 0)
            break;
        struct fake_wr *fw = &q->wrs[q->count++];
        memset(fw, 0, sizeof(*fw));
        fw->seq = ++f->next_seq;
        struct kvf_verbs_fake_wr *w = &fw->pub;
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
    if (f->fabric && i > 0)
        pthread_cond_broadcast(&f->cv);
    if (rc != 0) {
        for (struct ibv_send_wr *w = wr; w; w = w->next)
            f->stats.wrs_refused++;
        *bad_wr = armed && f->post_fail_ambiguous ? NULL : wr;
    }
    fake_unlock(f);
    return rc;
}

static int fake_poll_cq(void *prov, struct ibv_cq *cq, int num_entries, struct ibv_wc *wc)
{
    struct kvf_verbs_fake *f = prov;
    struct fake_cq *c = fake_container_of(cq, struct fake_cq, cq);
    fake_lock(f);
    int rc = fake_injected(f, KVF_FAKE_POLL_CQ);
    if (rc == 0 && c->overflow)
        rc = -EIO;
    int n = 0;
    while (rc == 0 && n < num_entries && c->count > 0) {
        wc[n++] = c->wcs[c->head];
        c->head = (c->head + 1) % c->cap;
        c->count--;
    }
    fake_unlock(f);
    return rc != 0 ? rc : n;
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

/* ---- the fabric: socket helpers -------------------------------------------- */

/* The device's address: an abstract Unix socket named by fabric and GID. */
static socklen_t fab_addr(const char *fabric, const union ibv_gid *gid, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    char *p = sa->sun_path + 1; /* sun_path[0] = 0: abstract namespace */
    int n = snprintf(p, sizeof(sa->sun_path) - 1, "kvf-fabric/%s/", fabric);
    for (unsigned i = 0; i < 16; i++)
        n += snprintf(p + n, sizeof(sa->sun_path) - 1 - (size_t)n, "%02x", gid->raw[i]);
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Reads exactly `len` bytes; gives up when `stop_fd` turns readable. 0, or
 * -ECONNRESET (EOF or error), -ECANCELED (stopping). */
static int fab_read_full(int fd, void *buf, size_t len, int stop_fd)
{
    uint8_t *p = buf;
    while (len > 0) {
        struct pollfd pfd[2] = {{.fd = fd, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
        int pr = poll(pfd, 2, -1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0)
            return -ECONNRESET;
        if (pfd[1].revents)
            return -ECANCELED;
        ssize_t r = recv(fd, p, len, 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (r <= 0)
            return -ECONNRESET;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

static int fab_write_full(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -ECONNRESET;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* ---- the fabric: responder ------------------------------------------------- */

/* Checks and applies one incoming write, under the device lock. */
static enum fab_status fab_apply(struct kvf_verbs_fake *f, const struct fab_req *rq,
                                 const uint8_t *payload)
{
    enum fab_status st = FAB_OK;
    fake_lock(f);
    struct fake_qp *q = fake_qp_find(f, rq->dst_qpn);
    if (!q || (q->state != IBV_QPS_RTR && q->state != IBV_QPS_RTS) || !q->connected ||
        q->rqpn != rq->src_qpn || memcmp(q->rgid.raw, rq->src_gid, 16) != 0) {
        st = FAB_NAK; /* a real responder drops it: the requester retries out */
    } else if (rq->length > 0) {
        struct fake_mr *m = fake_mr_find(f, q->qp.pd, rq->rkey, true);
        if (!m || !(m->access & IBV_ACCESS_REMOTE_WRITE) ||
            !(q->access & IBV_ACCESS_REMOTE_WRITE) ||
            !fake_mr_holds(m, rq->remote_addr, rq->length))
            st = FAB_ACCESS;
        else
            memcpy((void *)(uintptr_t)rq->remote_addr, payload, rq->length);
    }
    if (st == FAB_OK) {
        f->fstats.writes_in++;
        f->fstats.bytes_in += rq->length;
    } else {
        f->fstats.refused_in++;
    }
    fake_unlock(f);
    return st;
}

static void *fab_conn_main(void *arg)
{
    struct fab_conn *c = arg;
    struct kvf_verbs_fake *f = c->f;
    uint8_t *buf = NULL;
    for (;;) {
        uint32_t len = 0;
        struct fab_req rq;
        if (fab_read_full(c->fd, &len, sizeof(len), f->stop_pipe[0]) != 0)
            break;
        if (len < sizeof(rq) || len - sizeof(rq) > FAB_MAX_LEN)
            break; /* not our protocol: drop the connection */
        if (fab_read_full(c->fd, &rq, sizeof(rq), f->stop_pipe[0]) != 0)
            break;
        if (rq.magic != FAB_MAGIC || rq.length != len - sizeof(rq))
            break;
        free(buf);
        buf = rq.length ? malloc(rq.length) : NULL;
        if (rq.length && !buf)
            break;
        if (fab_read_full(c->fd, buf, rq.length, f->stop_pipe[0]) != 0)
            break;
        /* The answer: a u32 length, then the fab_rep (no padding between). */
        uint8_t out[sizeof(uint32_t) + sizeof(struct fab_rep)];
        struct fab_rep rep;
        memset(&rep, 0, sizeof(rep));
        rep.seq = rq.seq;
        rep.status = fab_apply(f, &rq, buf);
        uint32_t rlen = sizeof(rep);
        memcpy(out, &rlen, sizeof(rlen));
        memcpy(out + sizeof(rlen), &rep, sizeof(rep));
        if (fab_write_full(c->fd, out, sizeof(out)) != 0)
            break;
    }
    free(buf);
    fake_lock(f);
    c->done = true;
    fake_unlock(f);
    return NULL;
}

static void fab_conn_free(struct fab_conn *c)
{
    pthread_join(c->thread, NULL);
    close(c->fd);
    free(c);
}

static void *fab_accept_main(void *arg)
{
    struct kvf_verbs_fake *f = arg;
    for (;;) {
        struct pollfd pfd[2] = {{.fd = f->listen_fd, .events = POLLIN},
                                {.fd = f->stop_pipe[0], .events = POLLIN}};
        int pr = poll(pfd, 2, -1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr < 0 || pfd[1].revents)
            break;
        int fd = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue; /* EINTR, ECONNABORTED, ...: the peer retries as a new connection */
        struct fab_conn *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->f = f;
        /* Reap the connections whose threads ended, then add this one. */
        struct fab_conn *dead = NULL;
        fake_lock(f);
        for (struct fab_conn **pp = &f->conns; *pp;) {
            struct fab_conn *d = *pp;
            if (d->done) {
                *pp = d->next;
                d->next = dead;
                dead = d;
            } else {
                pp = &d->next;
            }
        }
        bool ok = pthread_create(&c->thread, NULL, fab_conn_main, c) == 0;
        if (ok) {
            c->next = f->conns;
            f->conns = c;
        }
        fake_unlock(f);
        if (!ok) {
            close(fd);
            free(c);
        }
        while (dead) {
            struct fab_conn *d = dead;
            dead = d->next;
            fab_conn_free(d);
        }
    }
    return NULL;
}

/* ---- the fabric: sender ------------------------------------------------------ */

/* The connection to device `gid`, opened on first use. -1 if unreachable. */
static int fab_out_get(struct kvf_verbs_fake *f, const union ibv_gid *gid)
{
    fake_lock(f);
    for (struct fab_out *o = f->outs; o; o = o->next) {
        if (memcmp(o->gid.raw, gid->raw, 16) == 0) {
            int fd = o->fd;
            fake_unlock(f);
            return fd;
        }
    }
    fake_unlock(f);
    struct sockaddr_un sa;
    socklen_t sl = fab_addr(f->fabric_name, gid, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int rc;
    do {
        rc = connect(fd, (struct sockaddr *)&sa, sl);
    } while (rc < 0 && errno == EINTR);
    struct fab_out *o = rc == 0 ? calloc(1, sizeof(*o)) : NULL;
    if (!o) {
        close(fd);
        return -1;
    }
    o->gid = *gid;
    o->fd = fd;
    fake_lock(f);
    o->next = f->outs;
    f->outs = o;
    fake_unlock(f);
    return fd;
}

/* Forgets a broken connection (a later WR reconnects). */
static void fab_out_drop(struct kvf_verbs_fake *f, int fd)
{
    struct fab_out *gone = NULL;
    fake_lock(f);
    for (struct fab_out **pp = &f->outs; *pp; pp = &(*pp)->next) {
        if ((*pp)->fd == fd) {
            gone = *pp;
            *pp = gone->next;
            break;
        }
    }
    fake_unlock(f);
    if (gone) {
        close(gone->fd);
        free(gone);
    }
}

/* Sends one write and waits for its answer. Called without the lock. */
static enum ibv_wc_status fab_send(struct kvf_verbs_fake *f, const union ibv_gid *dgid,
                                   const struct fab_req *rq, const uint8_t *payload)
{
    int fd = fab_out_get(f, dgid);
    if (fd < 0)
        return IBV_WC_RETRY_EXC_ERR; /* nobody there: no ack, the requester gives up */
    uint32_t len = (uint32_t)sizeof(*rq) + rq->length;
    int rc = fab_write_full(fd, &len, sizeof(len));
    if (rc == 0)
        rc = fab_write_full(fd, rq, sizeof(*rq));
    if (rc == 0 && rq->length)
        rc = fab_write_full(fd, payload, rq->length);
    uint32_t rlen = 0;
    struct fab_rep rep;
    if (rc == 0)
        rc = fab_read_full(fd, &rlen, sizeof(rlen), f->stop_pipe[0]);
    if (rc == 0 && rlen != sizeof(rep))
        rc = -EPROTO;
    if (rc == 0)
        rc = fab_read_full(fd, &rep, sizeof(rep), f->stop_pipe[0]);
    if (rc == 0 && rep.seq != rq->seq)
        rc = -EPROTO;
    if (rc != 0) {
        fab_out_drop(f, fd);
        return IBV_WC_RETRY_EXC_ERR;
    }
    switch (rep.status) {
    case FAB_OK:
        return IBV_WC_SUCCESS;
    case FAB_ACCESS:
        return IBV_WC_REM_ACCESS_ERR;
    default:
        return IBV_WC_RETRY_EXC_ERR;
    }
}

/* The next QP with a WR to send (round robin by QP number), or NULL. */
static struct fake_qp *fab_pick(struct kvf_verbs_fake *f)
{
    struct fake_qp *best = NULL;
    struct fake_qp *first = NULL;
    for (struct fake_qp *q = f->qps; q; q = q->next) {
        if (q->state != IBV_QPS_RTS || q->inflight || q->count == 0 || q->hold_send)
            continue;
        uint32_t n = q->qp.qp_num;
        if (!first || n < first->qp.qp_num)
            first = q;
        if (n > f->last_qpn && (!best || n < best->qp.qp_num))
            best = q;
    }
    return best ? best : first;
}

static void *fab_sender_main(void *arg)
{
    struct kvf_verbs_fake *f = arg;
    fake_lock(f);
    while (!f->stopping) {
        struct fake_qp *q = f->hold ? NULL : fab_pick(f);
        if (!q) {
            pthread_cond_wait(&f->cv, &f->mu);
            continue;
        }
        f->last_qpn = q->qp.qp_num;
        const struct fake_wr *w = &q->wrs[0];
        struct fab_req rq;
        memset(&rq, 0, sizeof(rq));
        rq.magic = FAB_MAGIC;
        rq.src_qpn = q->qp.qp_num;
        rq.dst_qpn = q->rqpn;
        rq.rkey = w->pub.rkey;
        rq.length = w->pub.length;
        memcpy(rq.src_gid, f->gid.raw, 16);
        rq.remote_addr = w->pub.remote_addr;
        rq.seq = w->seq;
        union ibv_gid dgid = q->rgid;
        uint32_t qpn = q->qp.qp_num;

        /* The payload is read now, under the lock: the local MR cannot go
         * away under the copy. */
        enum ibv_wc_status st = IBV_WC_SUCCESS;
        uint8_t *payload = NULL;
        if (rq.length > 0) {
            struct fake_mr *m = fake_mr_find(f, q->qp.pd, w->pub.lkey, false);
            if (!m || !fake_mr_holds(m, w->pub.local_addr, rq.length))
                st = IBV_WC_LOC_PROT_ERR;
            else if (!(payload = malloc(rq.length)))
                st = IBV_WC_LOC_QP_OP_ERR;
            else
                memcpy(payload, (const void *)(uintptr_t)w->pub.local_addr, rq.length);
        }
        q->inflight = true;
        if (st == IBV_WC_SUCCESS) {
            fake_unlock(f);
            st = fab_send(f, &dgid, &rq, payload);
            fake_lock(f);
        }
        free(payload);
        if (st == IBV_WC_SUCCESS) {
            f->fstats.writes_out++;
            f->fstats.bytes_out += rq.length;
        }
        /* The QP may have been reset or destroyed meanwhile: then the WR is
         * gone and nobody waits for it. */
        q = fake_qp_find(f, qpn);
        if (!q || !q->inflight)
            continue;
        q->inflight = false;
        if (q->count > 0 && q->wrs[0].seq == rq.seq) {
            /* Went to ERR while on the wire: done if acked, else flushed. */
            if (q->state == IBV_QPS_ERR && st != IBV_WC_SUCCESS)
                st = IBV_WC_WR_FLUSH_ERR;
            fake_qp_complete_one(f, q, 0, st);
        }
        fake_qp_flush(f, q);
    }
    fake_unlock(f);
    return NULL;
}

/* ---- test control ---------------------------------------------------------- */

static struct kvf_verbs_fake *fake_alloc(void)
{
    struct kvf_verbs_fake *f = calloc(1, sizeof(*f));
    if (!f)
        return NULL;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->listen_fd = -1;
    f->stop_pipe[0] = -1;
    f->stop_pipe[1] = -1;
    return f;
}

struct kvf_verbs_fake *kvf_verbs_fake_create(void)
{
    return fake_alloc();
}

static void fab_make_gid(union ibv_gid *gid)
{
    static atomic_uint counter;
    memset(gid, 0, sizeof(*gid));
    gid->raw[0] = 0xfe; /* link-local, as a RoCE GID built from a MAC */
    gid->raw[1] = 0x80;
    uint8_t rnd[6] = {0};
    if (getrandom(rnd, sizeof(rnd), GRND_NONBLOCK) != (ssize_t)sizeof(rnd)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        memcpy(rnd, &ts.tv_nsec,
               sizeof(rnd) < sizeof(ts.tv_nsec) ? sizeof(rnd) : sizeof(ts.tv_nsec));
    }
    memcpy(&gid->raw[2], rnd, sizeof(rnd));
    uint32_t pid = (uint32_t)getpid();
    uint32_t n = atomic_fetch_add(&counter, 1u);
    for (unsigned i = 0; i < 4; i++) {
        gid->raw[8 + i] = (uint8_t)(pid >> (24 - 8 * i));
        gid->raw[12 + i] = (uint8_t)(n >> (24 - 8 * i));
    }
}

struct kvf_verbs_fake *kvf_verbs_fake_create_fabric(const char *fabric, int *err_p)
{
    if (!fabric || !*fabric)
        fabric = "kvf";
    if (strlen(fabric) > FAB_NAME_MAX || strchr(fabric, '/')) {
        if (err_p)
            *err_p = -EINVAL;
        return NULL;
    }
    int rc = -ENOMEM;
    struct kvf_verbs_fake *f = fake_alloc();
    if (!f)
        goto fail;
    f->fabric = true;
    strcpy(f->fabric_name, fabric);
    fab_make_gid(&f->gid);

    struct sockaddr_un sa;
    socklen_t sl = fab_addr(f->fabric_name, &f->gid, &sa);
    f->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (f->listen_fd < 0 || bind(f->listen_fd, (struct sockaddr *)&sa, sl) != 0 ||
        listen(f->listen_fd, 64) != 0 || pipe2(f->stop_pipe, O_CLOEXEC) != 0) {
        rc = -errno;
        goto fail;
    }
    rc = -pthread_create(&f->acceptor, NULL, fab_accept_main, f);
    if (rc != 0)
        goto fail;
    f->acceptor_started = true;
    rc = -pthread_create(&f->sender, NULL, fab_sender_main, f);
    if (rc != 0)
        goto fail;
    f->sender_started = true;
    return f;

fail:
    kvf_verbs_fake_destroy(f);
    if (err_p)
        *err_p = rc;
    return NULL;
}

/* Stops the fabric threads and closes every socket. */
static void fab_stop(struct kvf_verbs_fake *f)
{
    fake_lock(f);
    f->stopping = true;
    for (struct fab_out *o = f->outs; o; o = o->next)
        shutdown(o->fd, SHUT_RDWR); /* a blocked send returns */
    pthread_cond_broadcast(&f->cv);
    fake_unlock(f);
    if (f->stop_pipe[1] >= 0) {
        ssize_t w;
        do {
            w = write(f->stop_pipe[1], "x", 1);
        } while (w < 0 && errno == EINTR);
    }
    if (f->sender_started)
        pthread_join(f->sender, NULL);
    if (f->acceptor_started)
        pthread_join(f->acceptor, NULL);
    /* No new connection can come now. */
    fake_lock(f);
    for (struct fab_conn *c = f->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    fake_unlock(f);
    while (f->conns) {
        struct fab_conn *c = f->conns;
        f->conns = c->next;
        fab_conn_free(c);
    }
    while (f->outs) {
        struct fab_out *o = f->outs;
        f->outs = o->next;
        close(o->fd);
        free(o);
    }
    if (f->listen_fd >= 0)
        close(f->listen_fd);
    for (unsigned i = 0; i < 2; i++) {
        if (f->stop_pipe[i] >= 0)
            close(f->stop_pipe[i]);
    }
}

void kvf_verbs_fake_destroy(struct kvf_verbs_fake *f)
{
    if (!f)
        return;
    if (f->fabric)
        fab_stop(f);
    while (f->qps)
        fake_qp_unlink_free(f, f->qps);
    while (f->cqs)
        fake_cq_unlink_free(f, f->cqs);
    while (f->mrs)
        fake_mr_unlink_free(f, f->mrs);
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void kvf_verbs_fake_fabric_hold(struct kvf_verbs_fake *f, bool hold)
{
    fake_lock(f);
    f->hold = hold;
    pthread_cond_broadcast(&f->cv);
    fake_unlock(f);
}

int kvf_verbs_fake_fabric_hold_qp(struct kvf_verbs_fake *f, uint32_t qp_num, bool hold)
{
    fake_lock(f);
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (q) {
        q->hold_send = hold;
        pthread_cond_broadcast(&f->cv);
    }
    fake_unlock(f);
    return q ? 0 : -ENOENT;
}

void kvf_verbs_fake_fabric_stats(const struct kvf_verbs_fake *f,
                                 struct kvf_verbs_fake_fabric_stats *out)
{
    fake_lock(f);
    *out = f->fstats;
    fake_unlock(f);
}

void kvf_verbs_fake_fail_call(struct kvf_verbs_fake *f, enum kvf_verbs_fake_call call, unsigned nth,
                              int err)
{
    if ((unsigned)call >= KVF_FAKE_CALL_COUNT)
        return;
    fake_lock(f);
    f->fail_nth[call] = nth;
    f->fail_err[call] = err;
    fake_unlock(f);
}

void kvf_verbs_fake_fail_post_after(struct kvf_verbs_fake *f, unsigned n, int err, bool ambiguous)
{
    fake_lock(f);
    f->post_fail_armed = true;
    f->post_fail_after = n;
    f->post_fail_err = err;
    f->post_fail_ambiguous = ambiguous;
    fake_unlock(f);
}

/* Fabric mode: 0, the fabric completes WRs itself. */
unsigned kvf_verbs_fake_complete(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned n,
                                 enum ibv_wc_status status)
{
    fake_lock(f);
    struct fake_qp *q = f->fabric ? NULL : fake_qp_find(f, qp_num);
    unsigned done = 0;
    while (q && done < n && q->count > 0) {
        fake_qp_complete_one(f, q, 0, status);
        done++;
    }
    fake_unlock(f);
    return done;
}

/* Fabric mode: -EINVAL. */
int kvf_verbs_fake_complete_at(struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                               enum ibv_wc_status status)
{
    fake_lock(f);
    int rc = 0;
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (f->fabric)
        rc = -EINVAL;
    else if (!q || index >= q->count)
        rc = -ENOENT;
    else
        fake_qp_complete_one(f, q, index, status);
    fake_unlock(f);
    return rc;
}

int kvf_verbs_fake_set_qp_error(struct kvf_verbs_fake *f, uint32_t qp_num)
{
    fake_lock(f);
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (q) {
        q->state = IBV_QPS_ERR;
        q->qp.state = IBV_QPS_ERR;
        fake_qp_flush(f, q);
    }
    fake_unlock(f);
    return q ? 0 : -ENOENT;
}

int kvf_verbs_fake_hold_flushes(struct kvf_verbs_fake *f, uint32_t qp_num, bool hold)
{
    fake_lock(f);
    struct fake_qp *q = fake_qp_find(f, qp_num);
    if (q) {
        q->hold_flushes = hold;
        fake_qp_flush(f, q);
    }
    fake_unlock(f);
    return q ? 0 : -ENOENT;
}

unsigned kvf_verbs_fake_outstanding(const struct kvf_verbs_fake *f, uint32_t qp_num)
{
    fake_lock(f);
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    unsigned n = q ? q->count : 0;
    fake_unlock(f);
    return n;
}

int kvf_verbs_fake_peek_wr(const struct kvf_verbs_fake *f, uint32_t qp_num, unsigned index,
                           struct kvf_verbs_fake_wr *out)
{
    fake_lock(f);
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    int rc = -ENOENT;
    if (q && index < q->count) {
        *out = q->wrs[index].pub;
        rc = 0;
    }
    fake_unlock(f);
    return rc;
}

enum ibv_qp_state kvf_verbs_fake_qp_state(const struct kvf_verbs_fake *f, uint32_t qp_num)
{
    fake_lock(f);
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    enum ibv_qp_state st = q ? q->state : IBV_QPS_UNKNOWN;
    fake_unlock(f);
    return st;
}

unsigned kvf_verbs_fake_transitions(const struct kvf_verbs_fake *f, uint32_t qp_num,
                                    struct kvf_verbs_fake_transition *out, unsigned max)
{
    fake_lock(f);
    const struct fake_qp *q = fake_qp_find(f, qp_num);
    unsigned n = 0;
    if (q) {
        for (unsigned i = 0; i < q->log_count && i < max; i++)
            out[i] = q->log[i];
        n = q->log_count;
    }
    fake_unlock(f);
    return n;
}

void kvf_verbs_fake_stats(const struct kvf_verbs_fake *f, struct kvf_verbs_fake_stats *out)
{
    fake_lock(f);
    *out = f->stats;
    fake_unlock(f);
}
