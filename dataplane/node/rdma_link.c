/*
 * rdma_link.c: the RDMA transport wired into kvfence-node (rdma_link.h).
 *
 * Device (--rdma): auto opens the first real verbs device whose port 1 is
 * active (none: "RDMA off", as before); fake uses the fake fabric provider
 * (verbs.h, tests only; --rdma-fabric names the fabric so that parallel
 * tests do not meet); off and --staging host|cuda use no RDMA at all (the
 * staging ring is not a registered region: decided, docs/node.md). The GID
 * index: --rdma-gid-index, else 0 on an Ethernet (RoCE) port and on the
 * fake fabric, -1 (LID routing) on InfiniBand.
 *
 * Links. RDMA addresses travel over the peer channel, never through the
 * control plane: rkeys change with every incarnation and only mean something
 * to a peer whose QPs are connected. Per peer index (one node incarnation):
 *   NONE --(a chunk is routed to it)--> HELLO_SENT: LinkHello with both QPs
 *        (local_info) and our pools (base_addr, rkey); that chunk and the
 *        next ones go over TCP until the link is up.
 *   NONE or HELLO_SENT --(LinkHello in)--> ACCEPTED: our QPs connected to
 *        the hello's (RTS), its pools learnt, LinkAccept (our QPs, pools) sent
 *        (as soon as the peer's PEER_ZMQ endpoint is known). When both ends
 *        sent a hello, the node with the smaller id wins: it ignores the
 *        other's hello and the other accepts its own.
 *   HELLO_SENT --(LinkAccept in)--> UP: connected, LinkReady sent at once.
 *   ACCEPTED --(LinkReady in)--> UP. An acceptor never writes before
 *        LinkReady: the initiator's QPs are not ready to receive before.
 *   any --(fence)--> DEAD for good: that incarnation never gets RDMA back.
 * Pools registered or removed later go to every linked peer as LinkPools.
 * Link messages and envelopes to one peer share one ordered ZeroMQ socket.
 *
 * Source side: a chunk routed to RDMA is cut into slices of at most
 * KVF_RDMA_MAX_SLICE bytes (local_svc.c); its slices wait in one FIFO and
 * are posted as chains (one chain per chunk run, at most the free WR slots
 * of the room's QP), each slice admitted (RDMA_WR towards the peer) right
 * before the post. A QP without free slots stops the FIFO until completions
 * come back (head of line, across peers too: kept simple). post_chain's
 * failure contract (rdma.h): the unposted ones have their admissions
 * cancelled and fail their chunk; ambiguous ones are quarantined by the
 * transport and complete through poll. When every slice completed OK the
 * source sends ChunkNotice before the pair's AuxData / TransferStatus.
 *
 * Sink side: an RDMA write lands without the sink seeing it. What protects
 * the sink: the source's admission check against the sink lease before each
 * post; the control plane releases the sink's pages only after the source
 * drained or was fenced; a fence moves the peer's QPs to ERR so nothing
 * lands afterwards. The ChunkNotice is checked (sender is a source of the
 * room with an RDMA link here, the pool and pages inside the sink lease,
 * whole pages) and then counted exactly like landed TCP frames (page bitmap,
 * bytes), with a Watch chunk_done. A notice outside the lease fails the room
 * (counted, logged): the bytes themselves cannot be refused.
 */
#include "rdma_link.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "faults.h"
#include "rdma.h"
#include "verbs.h"
#include "xport.h"

enum rlink_state {
    RL_NONE = 0,
    RL_HELLO_SENT,
    RL_ACCEPTED, /* we accepted its hello; it may write; we wait for LinkReady */
    RL_UP,
    RL_DEAD, /* fenced (or a failed connect): TCP only */
};

struct rpool {
    uint32_t id;
    uint32_t page_size;
};

struct rlink {
    enum rlink_state st;
    bool accept_due; /* LinkAccept not sent yet (endpoint unknown, queue full) */
    bool ready_due;
    bool page_note; /* "pages larger than a slice: TCP" said once */
    bool fenced;    /* fence_peer returned 0: nothing of it lands any more */
    struct rpool rpools[NODE_MAX_POOLS];
    uint32_t nrpools;
};

struct lpool {
    uint32_t id;
    uint32_t rkey;
};

struct node_rdma {
    struct kvf_transport *t;
    struct kvf_transport_rdma_opts ro;
    struct kvf_verbs_fake *fake; /* --rdma fake */
    char device[64];
    char ep[96];
    uint32_t mtu; /* bytes, for RdmaQpInfo (informational) */
    struct lpool lpools[NODE_MAX_POOLS];
    uint32_t nlpools;
    struct rlink links[NODE_MAX_PEERS];
    bool due; /* some link has a message due */
    struct node_frame *qhead, *qtail;
    /* Counters (logged at exit). */
    uint64_t links_up, notices_sent, notices_in, notice_bytes_in, notices_refused;
    uint64_t chunks_posted;
};

static uint32_t mtu_bytes(enum ibv_mtu m)
{
    switch (m) {
    case IBV_MTU_256:
        return 256;
    case IBV_MTU_512:
        return 512;
    case IBV_MTU_1024:
        return 1024;
    case IBV_MTU_2048:
        return 2048;
    default:
        return 4096;
    }
}

/* ---- start / stop ------------------------------------------------------------- */

/* --rdma auto: a real device with port 1 active, and its link layer. */
static bool detect_real(struct kvf_node *n, struct node_rdma *rd)
{
    struct ibv_context *ctx = NULL;
    int rc = kvf_verbs_real_ops.open_device(NULL, NULL, &ctx);
    if (rc != 0) {
        node_log("info", NULL, "RDMA off: %s; data goes over TCP (and local copies on this node)",
                 rc == -ENODEV ? "no RDMA device" : strerror(-rc));
        return false;
    }
    struct ibv_port_attr pa;
    memset(&pa, 0, sizeof pa);
    rc = kvf_verbs_real_ops.query_port(NULL, ctx, 1, &pa);
    const char *name = ctx->device ? ibv_get_device_name(ctx->device) : NULL;
    snprintf(rd->device, sizeof rd->device, "%s", name ? name : "?");
    bool up = rc == 0 && pa.state == IBV_PORT_ACTIVE;
    if (up) {
        rd->ro.gid_index = n->opts.rdma_gid_set                       ? n->opts.rdma_gid_index
                           : pa.link_layer == IBV_LINK_LAYER_ETHERNET ? 0
                                                                      : -1;
        rd->mtu = mtu_bytes(pa.active_mtu);
        snprintf(rd->ep, sizeof rd->ep, "%s:1", rd->device);
    } else {
        node_log("info", NULL, "RDMA off: device %s port 1 is not active (%s)", rd->device,
                 rc == 0 ? "port down" : strerror(-rc));
    }
    kvf_verbs_real_ops.close_device(NULL, ctx);
    return up;
}

static struct kvf_transport *transport_new(struct node_rdma *rd)
{
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_transport *t = kvf_transport_rdma_create(&rd->ro, &err);
    if (!t)
        node_log("error", NULL, "RDMA transport: %s", err.msg);
    return t;
}

int node_rdma_start(struct kvf_node *n)
{
    const char *mode = n->opts.rdma && n->opts.rdma[0] ? n->opts.rdma : "auto";
    bool fake = strcmp(mode, "fake") == 0;
    if (strcmp(mode, "off") == 0) {
        node_log("info", NULL, "RDMA off: --rdma off");
        return 0;
    }
    if (!fake && strcmp(mode, "auto") != 0) {
        node_log("error", NULL, "rdma: \"%s\" is not auto, off or fake", mode);
        return -EINVAL;
    }
    if (n->opts.staging && n->opts.staging[0] && strcmp(n->opts.staging, "none") != 0) {
        node_log("info", NULL, "RDMA off: not used with --staging %s (docs/node.md)",
                 n->opts.staging);
        return fake ? -EINVAL : 0;
    }
    struct node_rdma *rd = calloc(1, sizeof *rd);
    if (!rd)
        return -ENOMEM;
    kvf_transport_rdma_opts_init(&rd->ro);
    rd->ro.max_peers = NODE_MAX_PEERS;
    rd->ro.max_pools = NODE_MAX_POOLS;
    if (fake) {
        const char *fabric =
            n->opts.rdma_fabric && n->opts.rdma_fabric[0] ? n->opts.rdma_fabric : "kvf";
        int err = 0;
        rd->fake = kvf_verbs_fake_create_fabric(fabric, &err);
        if (!rd->fake) {
            node_log("error", NULL, "rdma fake: fabric %s: %s", fabric, strerror(-err));
            free(rd);
            return err ? err : -EIO;
        }
        rd->ro.verbs = &kvf_verbs_fake_ops;
        rd->ro.verbs_prov = rd->fake;
        rd->ro.gid_index = n->opts.rdma_gid_set ? n->opts.rdma_gid_index : 0;
        rd->mtu = 4096;
        snprintf(rd->device, sizeof rd->device, "fake");
        snprintf(rd->ep, sizeof rd->ep, "fake:%s", fabric);
    } else {
        if (!detect_real(n, rd)) {
            free(rd);
            return 0;
        }
        rd->ro.verbs = &kvf_verbs_real_ops;
        rd->ro.device = rd->device;
    }
    rd->t = transport_new(rd);
    if (!rd->t) {
        kvf_verbs_fake_destroy(rd->fake);
        free(rd);
        if (fake)
            return -EIO;
        node_log("info", NULL, "RDMA off: the transport could not start; TCP only");
        return 0;
    }
    n->rdma = rd;
    if (rd->fake)
        kvf_verbs_fake_fabric_hold(rd->fake, node_fault_rdma_hold(n));
    node_log(fake ? "warn" : "info", NULL,
             "RDMA on: %s (%s), gid index %d: chunks to peers with RDMA go as RDMA writes%s",
             rd->ep, fake ? "the fake fabric, tests only" : "verbs", rd->ro.gid_index,
             fake ? "" : " (never run on hardware by the project's tests)");
    return 0;
}

/* Frames still queued: nothing native was done for them. */
static void queue_drop(struct kvf_node *n, struct node_rdma *rd, bool report)
{
    while (rd->qhead) {
        struct node_frame *f = rd->qhead;
        rd->qhead = f->pnext;
        if (report) {
            node_frame_end(n, f, false);
        } else if (++f->chunk->ndone == f->chunk->nframes) {
            free(f->chunk);
        }
    }
    rd->qtail = NULL;
}

void node_rdma_stop(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    if (!rd)
        return;
    queue_drop(n, rd, false); /* the session is gone: no report */
    struct kvf_transport_rdma_stats st;
    memset(&st, 0, sizeof st);
    if (rd->t)
        kvf_transport_rdma_stats(rd->t, &st);
    struct kvf_verbs_fake_fabric_stats fs;
    memset(&fs, 0, sizeof fs);
    if (rd->fake)
        kvf_verbs_fake_fabric_stats(rd->fake, &fs);
    node_log("info", NULL,
             "rdma stats: links_up=%" PRIu64 " chunks_posted=%" PRIu64 " wrs_posted=%" PRIu64
             " wrs_ok=%" PRIu64 " wrs_error=%" PRIu64 " wrs_flushed=%" PRIu64
             " wrs_quarantined=%" PRIu64 " fences=%" PRIu64 " notices_sent=%" PRIu64
             " notices_in=%" PRIu64 " notice_bytes_in=%" PRIu64 " notices_refused=%" PRIu64
             " fabric_writes_in=%" PRIu64 " fabric_bytes_in=%" PRIu64 " fabric_refused_in=%" PRIu64
             " fabric_writes_out=%" PRIu64 " fabric_bytes_out=%" PRIu64,
             rd->links_up, rd->chunks_posted, st.wrs_posted, st.wrs_ok, st.wrs_error,
             st.wrs_flushed, st.wrs_quarantined, st.fences_done, rd->notices_sent, rd->notices_in,
             rd->notice_bytes_in, rd->notices_refused, fs.writes_in, fs.bytes_in, fs.refused_in,
             fs.writes_out, fs.bytes_out);
    kvf_transport_destroy(rd->t); /* fences every peer, retires what nobody polled */
    kvf_verbs_fake_destroy(rd->fake);
    free(rd);
    n->rdma = NULL;
}

bool node_rdma_advertised(const struct kvf_node *n, const char **ep)
{
    *ep = n->rdma ? n->rdma->ep : "";
    return n->rdma != NULL;
}

void node_rdma_set_hold(struct kvf_node *n, bool hold)
{
    if (!n->rdma || !n->rdma->fake)
        return;
    kvf_verbs_fake_fabric_hold(n->rdma->fake, hold);
    node_log("info", NULL, "fault: rdma writes %s", hold ? "held" : "released");
}

/* ---- link messages (out) ----------------------------------------------------------- */

static bool link_live(const struct rlink *L)
{
    return L->st == RL_HELLO_SENT || L->st == RL_ACCEPTED || L->st == RL_UP;
}

static int link_send(struct kvf_node *n, uint32_t peer, Kvfence__V1__LinkMessage *m)
{
    struct node_peer *pe = &n->peers[peer];
    if (!n->peerch || !pe->peer_ep[0])
        return -EHOSTUNREACH;
    m->receiver_node_id = pe->node_id;
    m->receiver_incarnation = pe->incarnation;
    return kvf_peer_send_link(n->peerch, pe->peer_ep, m);
}

/* Our pools as write targets (base address and rkey). */
static size_t pools_wire(struct kvf_node *n, Kvfence__V1__Pool *pv, Kvfence__V1__Pool **pp)
{
    struct node_rdma *rd = n->rdma;
    size_t k = 0;
    for (uint32_t i = 0; i < rd->nlpools; i++) {
        const struct node_pool *p = node_pool_find(n, rd->lpools[i].id);
        if (!p)
            continue;
        node_pool_to_wire(p, &pv[k]);
        pv[k].base_addr = (uint64_t)(uintptr_t)p->base;
        pv[k].rkey = rd->lpools[i].rkey;
        pp[k] = &pv[k];
        k++;
    }
    return k;
}

/* Our QPs for `peer` (created if needed). */
static int qps_wire(struct kvf_node *n, uint32_t peer, Kvfence__V1__RdmaQpInfo *qv,
                    Kvfence__V1__RdmaQpInfo **qp, struct kvf_rdma_conn_info *ci)
{
    struct node_rdma *rd = n->rdma;
    int rc = kvf_transport_rdma_local_info(rd->t, peer, ci);
    if (rc != 0)
        return rc;
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        kvfence__v1__rdma_qp_info__init(&qv[i]);
        qv[i].qp_num = ci->qp_num[i];
        qv[i].psn = ci->psn[i];
        qv[i].gid.data = ci->gid;
        qv[i].gid.len = sizeof ci->gid;
        qv[i].lid = ci->lid;
        qv[i].port_num = rd->ro.port;
        qv[i].mtu = rd->mtu;
        qp[i] = &qv[i];
    }
    return 0;
}

static int send_hello_or_accept(struct kvf_node *n, uint32_t peer, bool hello)
{
    Kvfence__V1__RdmaQpInfo qv[KVF_RDMA_QPS_PER_PEER];
    Kvfence__V1__RdmaQpInfo *qp[KVF_RDMA_QPS_PER_PEER];
    struct kvf_rdma_conn_info ci;
    int rc = qps_wire(n, peer, qv, qp, &ci);
    if (rc != 0)
        return rc;
    Kvfence__V1__Pool pv[NODE_MAX_POOLS];
    Kvfence__V1__Pool *pp[NODE_MAX_POOLS];
    size_t np = pools_wire(n, pv, pp);
    Kvfence__V1__LinkMessage m = KVFENCE__V1__LINK_MESSAGE__INIT;
    Kvfence__V1__LinkHello h = KVFENCE__V1__LINK_HELLO__INIT;
    Kvfence__V1__LinkAccept a = KVFENCE__V1__LINK_ACCEPT__INIT;
    if (hello) {
        h.n_rdma_qps = KVF_RDMA_QPS_PER_PEER;
        h.rdma_qps = qp;
        h.n_pools = np;
        h.pools = pp;
        m.body_case = KVFENCE__V1__LINK_MESSAGE__BODY_HELLO;
        m.hello = &h;
    } else {
        a.n_rdma_qps = KVF_RDMA_QPS_PER_PEER;
        a.rdma_qps = qp;
        a.n_pools = np;
        a.pools = pp;
        m.body_case = KVFENCE__V1__LINK_MESSAGE__BODY_ACCEPT;
        m.accept = &a;
    }
    return link_send(n, peer, &m);
}

static int send_ready(struct kvf_node *n, uint32_t peer)
{
    Kvfence__V1__LinkReady r = KVFENCE__V1__LINK_READY__INIT;
    Kvfence__V1__LinkMessage m = KVFENCE__V1__LINK_MESSAGE__INIT;
    m.body_case = KVFENCE__V1__LINK_MESSAGE__BODY_READY;
    m.ready = &r;
    return link_send(n, peer, &m);
}

/* LinkPools to every live link: one pool upserted, or removed. */
static void announce_pool(struct kvf_node *n, const struct node_pool *p, uint32_t rkey,
                          uint32_t removed_id)
{
    struct node_rdma *rd = n->rdma;
    Kvfence__V1__Pool pv;
    Kvfence__V1__Pool *pp = &pv;
    Kvfence__V1__LinkPools lp = KVFENCE__V1__LINK_POOLS__INIT;
    if (p) {
        node_pool_to_wire(p, &pv);
        pv.base_addr = (uint64_t)(uintptr_t)p->base;
        pv.rkey = rkey;
        lp.n_upserted = 1;
        lp.upserted = &pp;
    } else {
        lp.n_removed_pool_ids = 1;
        lp.removed_pool_ids = &removed_id;
    }
    Kvfence__V1__LinkMessage m = KVFENCE__V1__LINK_MESSAGE__INIT;
    m.body_case = KVFENCE__V1__LINK_MESSAGE__BODY_POOLS;
    m.pools = &lp;
    for (uint32_t i = 0; i < n->npeers; i++) {
        if (!link_live(&rd->links[i]))
            continue;
        int rc = link_send(n, i, &m);
        if (rc != 0)
            node_log("warn", NULL, "rdma link to %s: pool %u change not sent: %s",
                     n->peers[i].node_id, p ? p->id : removed_id, strerror(-rc));
    }
}

/* Messages that could not go when due (endpoint unknown yet, queue full). */
static void link_tick(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    if (!rd->due)
        return;
    rd->due = false;
    for (uint32_t i = 0; i < n->npeers; i++) {
        struct rlink *L = &rd->links[i];
        if (L->accept_due && n->peers[i].peer_ep[0] && L->st == RL_ACCEPTED) {
            int rc = send_hello_or_accept(n, i, false);
            if (rc == 0)
                L->accept_due = false;
            else if (rc != -EAGAIN)
                node_log("warn", NULL, "rdma link to %s: accept not sent: %s", n->peers[i].node_id,
                         strerror(-rc));
        }
        if (L->ready_due && send_ready(n, i) == 0)
            L->ready_due = false;
        rd->due = rd->due || L->accept_due || L->ready_due;
    }
}

/* ---- pools ----------------------------------------------------------------------- */

void node_rdma_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    struct node_rdma *rd = n->rdma;
    if (!rd || rd->nlpools >= NODE_MAX_POOLS || kvf_pool_is_device(p->pool))
        return; /* device pools: no GPUDirect RDMA, their peers write over TCP */
    uint32_t rkey = 0;
    int rc = kvf_transport_rdma_add_pool(rd->t, p->id, p->base, p->page_size, p->page_count, &rkey);
    if (rc != 0) {
        node_log("warn", NULL, "pool %u: not registered for RDMA (%s): peers write it over TCP",
                 p->id, strerror(-rc));
        return;
    }
    rd->lpools[rd->nlpools++] = (struct lpool){p->id, rkey};
    announce_pool(n, p, rkey, 0);
}

void node_rdma_remove_pool(struct kvf_node *n, uint32_t pool_id)
{
    struct node_rdma *rd = n->rdma;
    if (!rd)
        return;
    for (uint32_t i = 0; i < rd->nlpools; i++) {
        if (rd->lpools[i].id != pool_id)
            continue;
        /* Its lifetimes drained (pool_admin.c): no WR reads from it, and the
         * peers' writes into it are refused once its region is gone. */
        int rc = kvf_transport_rdma_remove_pool(rd->t, pool_id);
        if (rc != 0)
            node_log("error", NULL, "pool %u: RDMA region not removed: %s", pool_id, strerror(-rc));
        rd->lpools[i] = rd->lpools[--rd->nlpools];
        announce_pool(n, NULL, 0, pool_id);
        return;
    }
}

static const struct rpool *rpool_find(const struct rlink *L, uint32_t id)
{
    for (uint32_t i = 0; i < L->nrpools; i++)
        if (L->rpools[i].id == id)
            return &L->rpools[i];
    return NULL;
}

static void rpool_remove(struct node_rdma *rd, uint32_t peer, uint32_t id)
{
    struct rlink *L = &rd->links[peer];
    for (uint32_t i = 0; i < L->nrpools; i++) {
        if (L->rpools[i].id != id)
            continue;
        (void)kvf_transport_rdma_remove_remote_pool(rd->t, peer, id);
        L->rpools[i] = L->rpools[--L->nrpools];
        return;
    }
}

static void rpools_learn(struct kvf_node *n, uint32_t peer, Kvfence__V1__Pool **pv, size_t np)
{
    struct node_rdma *rd = n->rdma;
    struct rlink *L = &rd->links[peer];
    for (size_t i = 0; i < np; i++) {
        const Kvfence__V1__Pool *p = pv[i];
        if (!p->rkey || !p->base_addr)
            continue;
        rpool_remove(rd, peer, p->pool_id); /* an upsert replaces */
        if (L->nrpools >= NODE_MAX_POOLS)
            break;
        int rc = kvf_transport_rdma_add_remote_pool(rd->t, peer, p->pool_id, p->base_addr,
                                                    p->page_size, p->page_count, p->rkey);
        if (rc != 0) {
            node_log("warn", NULL, "rdma link to %s: its pool %u refused: %s",
                     n->peers[peer].node_id, p->pool_id, strerror(-rc));
            continue;
        }
        L->rpools[L->nrpools++] = (struct rpool){p->pool_id, p->page_size};
    }
}

/* ---- link messages (in) ------------------------------------------------------------- */

static int conn_of(Kvfence__V1__RdmaQpInfo **qv, size_t nq, struct kvf_rdma_conn_info *ci)
{
    if (nq != KVF_RDMA_QPS_PER_PEER)
        return -EINVAL;
    memset(ci, 0, sizeof *ci);
    for (unsigned i = 0; i < KVF_RDMA_QPS_PER_PEER; i++) {
        if (qv[i]->gid.len != sizeof ci->gid ||
            (i > 0 && (qv[i]->lid != qv[0]->lid ||
                       memcmp(qv[i]->gid.data, qv[0]->gid.data, sizeof ci->gid) != 0)))
            return -EINVAL;
        ci->qp_num[i] = qv[i]->qp_num;
        ci->psn[i] = qv[i]->psn;
    }
    ci->lid = (uint16_t)qv[0]->lid;
    memcpy(ci->gid, qv[0]->gid.data, sizeof ci->gid);
    return 0;
}

/* Connects our QPs for `peer` to `qv`. On failure the link is dead (TCP). */
static int link_connect(struct kvf_node *n, uint32_t peer, Kvfence__V1__RdmaQpInfo **qv, size_t nq)
{
    struct node_rdma *rd = n->rdma;
    struct kvf_rdma_conn_info remote, mine;
    int rc = conn_of(qv, nq, &remote);
    if (rc == 0)
        rc = kvf_transport_rdma_local_info(rd->t, peer, &mine);
    if (rc == 0)
        rc = kvf_transport_rdma_connect(rd->t, peer, &remote);
    if (rc != 0) {
        rd->links[peer].st = RL_DEAD;
        node_log("warn", NULL, "rdma link to %s: connect failed (%s): TCP only",
                 n->peers[peer].node_id, strerror(-rc));
    }
    return rc;
}

static void link_up(struct kvf_node *n, uint32_t peer, const char *how)
{
    struct node_rdma *rd = n->rdma;
    rd->links[peer].st = RL_UP;
    rd->links_up++;
    node_log("info", NULL, "rdma link to %s incarnation %" PRIu64 " up (%s), %u pools",
             n->peers[peer].node_id, n->peers[peer].incarnation, how, rd->links[peer].nrpools);
}

static void link_msg(struct kvf_node *n, const Kvfence__V1__LinkMessage *m)
{
    struct node_rdma *rd = n->rdma;
    const char *from = m->sender_node_id ? m->sender_node_id : "";
    if (!rd) {
        node_log("info", NULL, "link message from %s ignored: RDMA is off here", from);
        return;
    }
    uint32_t peer;
    /* A hello may come before the RoomUpdate that names its sender: the slot
     * is the one that update will find (same id and incarnation). */
    if (!from[0] || node_ensure_peer(n, from, m->sender_incarnation, &peer) != 0) {
        node_log("warn", NULL, "link message from %s: no peer slot: ignored", from);
        return;
    }
    struct rlink *L = &rd->links[peer];
    if (n->peers[peer].fenced || L->st == RL_DEAD) {
        node_log("info", NULL, "link message from %s incarnation %" PRIu64 ": fenced or dead here",
                 from, m->sender_incarnation);
        return;
    }
    switch (m->body_case) {
    case KVFENCE__V1__LINK_MESSAGE__BODY_HELLO:
        if (L->st == RL_HELLO_SENT && strcmp(n->node_id, from) < 0) {
            node_log("info", NULL, "rdma link to %s: both sent a hello; ours wins", from);
            return;
        }
        if (L->st == RL_ACCEPTED || L->st == RL_UP) {
            node_log("info", NULL, "rdma link to %s: hello again ignored", from);
            return;
        }
        if (link_connect(n, peer, m->hello->rdma_qps, m->hello->n_rdma_qps) != 0)
            return;
        rpools_learn(n, peer, m->hello->pools, m->hello->n_pools);
        L->st = RL_ACCEPTED;
        L->accept_due = true;
        rd->due = true;
        link_tick(n);
        return;
    case KVFENCE__V1__LINK_MESSAGE__BODY_ACCEPT:
        if (L->st != RL_HELLO_SENT) {
            node_log("info", NULL, "rdma link to %s: unexpected accept ignored", from);
            return;
        }
        if (link_connect(n, peer, m->accept->rdma_qps, m->accept->n_rdma_qps) != 0)
            return;
        rpools_learn(n, peer, m->accept->pools, m->accept->n_pools);
        link_up(n, peer, "initiator");
        if (send_ready(n, peer) != 0) {
            L->ready_due = true;
            rd->due = true;
        }
        return;
    case KVFENCE__V1__LINK_MESSAGE__BODY_READY:
        if (L->st == RL_ACCEPTED && !L->accept_due)
            link_up(n, peer, "acceptor");
        return;
    case KVFENCE__V1__LINK_MESSAGE__BODY_POOLS:
        if (!link_live(L))
            return;
        rpools_learn(n, peer, m->pools->upserted, m->pools->n_upserted);
        for (size_t i = 0; i < m->pools->n_removed_pool_ids; i++) {
            rpool_remove(rd, peer, m->pools->removed_pool_ids[i]);
            node_log("info", NULL, "rdma link to %s: its pool %u removed", from,
                     m->pools->removed_pool_ids[i]);
        }
        if (m->pools->n_upserted)
            node_log("info", NULL, "rdma link to %s: %zu pools announced, %u known", from,
                     m->pools->n_upserted, L->nrpools);
        return;
    default:
        node_log("info", NULL, "link message %d from %s ignored", (int)m->body_case, from);
        return;
    }
}

void node_rdma_link_job(struct kvf_node *n, struct node_job *j)
{
    if (!j->pmsg)
        return;
    Kvfence__V1__LinkMessage *m =
        kvfence__v1__link_message__unpack(NULL, j->pmsg->len, j->pmsg->data);
    if (!m) {
        node_log("warn", NULL, "link message from %s: undecodable", j->pmsg->sender);
        return;
    }
    link_msg(n, m);
    kvfence__v1__link_message__free_unpacked(m, NULL);
}

/* ---- route, post, poll ---------------------------------------------------------------- */

bool node_rdma_route(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                     struct node_route *rt)
{
    struct node_rdma *rd = n->rdma;
    struct node_peer *pe = &n->peers[peer];
    if (!rd || !pe->rdma || pe->fenced)
        return false;
    struct rlink *L = &rd->links[peer];
    if (L->st == RL_NONE && pe->peer_ep[0]) {
        int rc = send_hello_or_accept(n, peer, true);
        if (rc == 0) {
            L->st = RL_HELLO_SENT;
            node_log("info", NULL, "rdma link to %s: hello sent; TCP until it is up", pe->node_id);
        } else if (rc != -EAGAIN) {
            L->st = RL_DEAD;
            node_log("warn", NULL, "rdma link to %s: hello not sent (%s): TCP only", pe->node_id,
                     strerror(-rc));
        }
    }
    if (L->st != RL_UP)
        return false;
    const struct rpool *rp = rpool_find(L, sink->pool_id);
    if (!rp)
        return false;
    if (rp->page_size > KVF_RDMA_MAX_SLICE) {
        if (!L->page_note)
            node_log("info", NULL,
                     "rdma link to %s: pool %u pages are larger than an RDMA slice (%u): TCP",
                     pe->node_id, rp->id, KVF_RDMA_MAX_SLICE);
        L->page_note = true;
        return false;
    }
    *rt = (struct node_route){rd->t, peer, KVF_LT_OP_RDMA_WR};
    return true;
}

/* Posts queued slices while the QPs take them. */
static void pump(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    struct kvf_xfer *xs[KVF_RDMA_MAX_WR_PER_QP];
    while (rd->qhead) {
        struct node_frame *f0 = rd->qhead;
        struct node_chunk *ch = f0->chunk;
        struct node_room *r = ch->room;
        uint32_t peer = f0->x.peer;
        unsigned qp = (unsigned)(r->key.room_id % KVF_RDMA_QPS_PER_PEER);
        unsigned used = kvf_transport_rdma_outstanding(rd->t, peer, qp);
        unsigned room = used < KVF_RDMA_MAX_WR_PER_QP ? KVF_RDMA_MAX_WR_PER_QP - used : 0;
        if (room == 0)
            return; /* a completion frees a slot */
        unsigned k = 0;
        int arc = 0;
        for (struct node_frame *f = f0; f && f->chunk == ch && k < room; f = f->pnext) {
            arc = kvf_lt_admit(r->lt, &f->x.op, KVF_LT_OP_RDMA_WR, peer);
            if (arc != 0)
                break;
            xs[k++] = &f->x;
        }
        unsigned posted = 0;
        int rc = k ? kvf_transport_rdma_post_chain(rd->t, xs, k, &posted) : 0;
        if (rc == -EAGAIN) {
            for (unsigned i = 0; i < k; i++)
                if (kvf_lt_op_cancel(&xs[i]->op))
                    node_check_drained(n, r);
            return;
        }
        if (rc != 0)
            node_log("warn", &r->key, "rdma post to %s: %u of %u slices posted: %s",
                     n->peers[peer].node_id, posted, k, strerror(-rc));
        for (unsigned i = 0; i < k; i++) {
            struct node_frame *f = rd->qhead;
            rd->qhead = f->pnext;
            if (!rd->qhead)
                rd->qtail = NULL;
            if (i < posted)
                continue; /* it completes through poll */
            if (kvf_lt_op_cancel(&f->x.op))
                node_check_drained(n, r);
            node_frame_end(n, f, false);
        }
        if (arc != 0 && (rc == 0 || k == 0)) {
            /* Admission closed: the slice is dropped before any native call. */
            struct node_frame *f = rd->qhead;
            rd->qhead = f->pnext;
            if (!rd->qhead)
                rd->qtail = NULL;
            node_frame_end(n, f, false);
        }
    }
}

void node_rdma_post_chunk(struct kvf_node *n, struct node_chunk *ch)
{
    struct node_rdma *rd = n->rdma;
    ch->rdma = true;
    rd->chunks_posted++;
    for (uint32_t i = 0; i < ch->nframes; i++) {
        struct node_frame *f = &ch->frames[i];
        f->pnext = NULL;
        if (rd->qtail)
            rd->qtail->pnext = f;
        else
            rd->qhead = f;
        rd->qtail = f;
    }
    pump(n);
}

static void reap(struct kvf_node *n)
{
    struct kvf_completion c[NODE_POLL_BATCH];
    int got;
    while ((got = kvf_transport_poll(n->rdma->t, NODE_POLL_BATCH, c)) > 0)
        for (int i = 0; i < got; i++)
            node_local_completion(n, &c[i]);
}

void node_rdma_poll(struct kvf_node *n)
{
    if (!n->rdma)
        return;
    reap(n);
    pump(n);
    link_tick(n);
}

/* ---- fences ---------------------------------------------------------------------------- */

int node_rdma_fence_peer(struct kvf_node *n, uint32_t peer)
{
    struct node_rdma *rd = n->rdma;
    if (!rd)
        return 0;
    struct rlink *L = &rd->links[peer];
    L->st = RL_DEAD;
    L->accept_due = L->ready_due = false;
    if (L->fenced)
        return 0; /* a self-fence after a FencePeer: done already */
    int rc = kvf_transport_fence_peer(rd->t, peer);
    if (rc != 0)
        return rc;
    L->fenced = true;
    node_log("info", NULL,
             "rdma: peer %s incarnation %" PRIu64 " fenced: its QPs are in ERR, every WR back",
             n->peers[peer].node_id, n->peers[peer].incarnation);
    return 0;
}

int node_rdma_renew(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    if (!rd)
        return 0;
    int rc = 0;
    for (uint32_t i = 0; i < n->npeers; i++) {
        int frc = node_rdma_fence_peer(n, i);
        if (frc != 0) {
            node_log("error", NULL, "self-fence: rdma fence of %s: %s", n->peers[i].node_id,
                     strerror(-frc));
            rc = frc;
        }
    }
    queue_drop(n, rd, true); /* admission is closed: nothing queued may start */
    reap(n);
    if (rc != 0)
        return rc; /* the old transport stays, its peers fenced */
    struct kvf_transport *fresh = transport_new(rd);
    if (!fresh)
        return -EIO;
    kvf_transport_destroy(rd->t);
    rd->t = fresh;
    memset(rd->links, 0, sizeof rd->links);
    rd->due = false;
    uint32_t old = rd->nlpools;
    rd->nlpools = 0;
    for (uint32_t i = 0; i < n->npools; i++)
        node_rdma_add_pool(n, &n->pools[i]);
    node_log("info", NULL, "self-fence: a fresh RDMA transport, %u of %u pools registered",
             rd->nlpools, old);
    return 0;
}

/* ---- ChunkNotice ---------------------------------------------------------------------- */

int node_rdma_send_notice(struct kvf_node *n, struct node_chunk *ch)
{
    struct node_rdma *rd = n->rdma;
    Kvfence__V1__PageRange *rv = calloc(ch->nframes ? ch->nframes : 1, sizeof *rv);
    Kvfence__V1__PageRange **rp = calloc(ch->nframes ? ch->nframes : 1, sizeof *rp);
    if (!rv || !rp) {
        free(rv);
        free(rp);
        return -ENOMEM;
    }
    size_t nr = 0;
    uint64_t len = 0;
    for (uint32_t i = 0; i < ch->nframes; i++) {
        const struct kvf_xfer *x = &ch->frames[i].x;
        len += x->len;
        if (nr && rv[nr - 1].first + rv[nr - 1].count == x->first_page) {
            rv[nr - 1].count += x->page_count;
            continue;
        }
        kvfence__v1__page_range__init(&rv[nr]);
        rv[nr].first = x->first_page;
        rv[nr].count = x->page_count;
        rp[nr] = &rv[nr];
        nr++;
    }
    Kvfence__V1__ChunkNotice cn = KVFENCE__V1__CHUNK_NOTICE__INIT;
    cn.source_rank = ch->src_rank;
    cn.sink_rank = ch->sink_rank;
    cn.chunk_seq = ch->seq;
    cn.sink_pool_id = ch->nframes ? ch->frames[0].x.sink_pool : 0;
    cn.n_sink_ranges = nr;
    cn.sink_ranges = rp;
    cn.length = len;
    cn.transport = KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA;
    Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
    env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE;
    env.chunk_notice = &cn;
    int rc = node_peer_send_env(n, ch->room, ch->pair, &env);
    free(rv);
    free(rp);
    if (rc == 0)
        rd->notices_sent++;
    return rc;
}

static void notice_refused(struct kvf_node *n, struct node_room *r, struct node_member *m,
                           const struct node_peer_msg *pm, const char *what)
{
    n->rdma->notices_refused++;
    char why[256];
    snprintf(why, sizeof why,
             "rdma chunk notice from %s (source rank %u, chunk %" PRIu64 "): %s; the bytes of an "
             "RDMA write cannot be refused, the room fails",
             pm->sender, pm->source_rank, pm->chunk_seq, what);
    node_log("error", &r->key, "%s", why);
    m->failed = true;
    node_send_transfer_failed(n, r, m->rank, m->role, why);
}

void node_rdma_notice_in(struct kvf_node *n, struct node_room *r, struct node_member *m,
                         const struct node_peer_msg *pm)
{
    struct node_rdma *rd = n->rdma;
    if (!rd) {
        /* Cannot happen from a well-behaved source: we never linked. */
        node_log("error", &r->key, "chunk notice from %s while RDMA is off here", pm->sender);
        m->failed = true;
        node_send_transfer_failed(n, r, m->rank, m->role, "chunk notice without RDMA");
        return;
    }
    if (pm->transport != KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA) {
        notice_refused(n, r, m, pm, "transport is not RDMA");
        return;
    }
    uint32_t peer = UINT32_MAX;
    for (uint32_t i = 0; i < n->npeers; i++)
        if (n->peers[i].incarnation == pm->sender_incarnation &&
            strcmp(n->peers[i].node_id, pm->sender) == 0)
            peer = i;
    if (peer == UINT32_MAX || (rd->links[peer].st != RL_UP && rd->links[peer].st != RL_ACCEPTED)) {
        notice_refused(n, r, m, pm, "no RDMA link with the sender here");
        return;
    }
    bool src_ok = false;
    for (size_t i = 0; i < r->nmembers && !src_ok; i++)
        src_ok = r->members[i].role == KVFENCE__V1__ROLE__ROLE_SOURCE &&
                 r->members[i].rank == pm->source_rank &&
                 r->members[i].incarnation == pm->sender_incarnation &&
                 strcmp(r->members[i].node_id, pm->sender) == 0;
    if (!src_ok) {
        notice_refused(n, r, m, pm, "the sender is not that source of the room");
        return;
    }
    const struct node_pool *p = node_pool_find(n, m->pool_id);
    if (pm->pool_id != m->pool_id || !p) {
        notice_refused(n, r, m, pm, "not the sink lease's pool");
        return;
    }
    const struct node_range *rv = (const struct node_range *)(const void *)pm->data;
    size_t nr = pm->len / sizeof *rv;
    uint64_t pages = 0;
    for (size_t i = 0; i < nr; i++) {
        if (rv[i].count == 0 ||
            !node_ranges_cover(m->ranges, m->nranges, rv[i].first, rv[i].count)) {
            notice_refused(n, r, m, pm, "pages outside the sink lease");
            return;
        }
        pages += rv[i].count;
    }
    if (nr == 0 || pages * p->page_size != pm->bytes) {
        notice_refused(n, r, m, pm, "length is not the whole pages named");
        return;
    }
    rd->notices_in++;
    rd->notice_bytes_in += pm->bytes;
    /* The event before the pages count: they may complete the sink. */
    node_watch_chunk_done(n, r, pm->source_rank, pm->sink_rank, pm->chunk_seq, true, "");
    for (size_t i = 0; i < nr; i++)
        node_sink_landed(n, r, m->rank, rv[i].first, rv[i].count,
                         (uint64_t)rv[i].count * p->page_size);
}
