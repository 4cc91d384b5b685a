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
 *   HELLO_SENT --(no answer)--> the hello again after 100 ms, doubling to
 *        5 s; after 10 hellos back to NONE.
 *   UP or ACCEPTED --(an error completion: a QP broke)--> NONE: LinkClose
 *        (reconnect) to the peer, our QPs drained and destroyed
 *        (reset_peer); the next chunk starts a new link with fresh QPs.
 *   any --(LinkClose in)--> its QPs reset; NONE with reconnect (a
 *        HELLO_SENT or NONE link ignores that one: it is about an older
 *        link), else DEAD.
 *   any --(fence)--> DEAD for good: that incarnation never gets RDMA back
 *        (LinkClose sent best effort; also to every linked peer at stop).
 * Pools registered or removed later go to every linked peer as LinkPools.
 * Link messages and envelopes to one peer share one ordered ZeroMQ socket.
 *
 * Source side: a chunk routed to RDMA is cut into slices of at most
 * KVF_RDMA_MAX_SLICE bytes (local_svc.c); its slices wait in the FIFO of
 * their QP (peer, room_id % 2) and are posted as chains (one chain per chunk
 * run, at most the free WR slots of that QP), each slice admitted (RDMA_WR
 * towards the peer) right before the post. A QP without free slots stops
 * only its own FIFO until completions come back. post_chain's
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
#include <time.h>

#include "devpool.h"
#include "faults.h"
#include "kvfence/v1/types.pb-c.h"
#include "peer_channel.h"
#include "rdma.h"
#include "verbs.h"
#include "xport.h"
#include "xport_class.h"
#include "xport_registry.h"
#include "control_session.h"
#include "node_log.h"
#include "node_metrics.h"
#include "node_owner.h"
#include "peer_link.h"
#include "watch.h"

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
    uint32_t page_count;
    uint32_t rkey;
    uint64_t base_addr;
};

struct rlink {
    enum rlink_state st;
    bool accept_due; /* LinkAccept not sent yet (endpoint unknown, queue full) */
    bool ready_due;
    bool page_note; /* "pages larger than a slice: TCP" said once */
    bool fenced;    /* fence_peer returned 0: nothing of it lands any more */
    /* HELLO_SENT: hellos sent, the wait before the next one, when it is due. */
    uint32_t hello_tries, hello_wait_ms;
    int64_t hello_next_ms;
    struct rpool rpools[NODE_MAX_POOLS];
    uint32_t nrpools;
};

/* An unanswered LinkHello is sent again (lost, or the peer was not ready):
 * after 100 ms, doubling up to 5 s, 10 hellos in all; then the link goes back
 * to NONE and the next chunk routed to the peer starts over. */
#define HELLO_FIRST_MS 100
#define HELLO_MAX_MS   5000
#define HELLO_TRIES    10
/* No completion channel: the owner reaps the CQs at this pace while work
 * requests are outstanding, and looks at links with a message due at
 * RDMA_DUE_MS (node_rdma_next_ms). */
#define RDMA_REAP_MS 1
#define RDMA_DUE_MS  10

struct squeue {
    struct node_frame *head, *tail;
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
    /* Slices waiting for a free WR slot, one FIFO per QP (peer, room_id % 2):
     * a full QP holds back only its own queue. */
    struct squeue sq[NODE_MAX_PEERS][KVF_RDMA_QPS_PER_PEER];
    /* Counters (logged at exit). */
    uint64_t links_up, links_down, closes_sent, closes_in;
    uint64_t notices_sent, notices_in, notice_bytes_in, notices_refused;
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
    for (uint32_t p = 0; p < NODE_MAX_PEERS; p++) {
        for (unsigned q = 0; q < KVF_RDMA_QPS_PER_PEER; q++) {
            struct squeue *sq = &rd->sq[p][q];
            while (sq->head) {
                struct node_frame *f = sq->head;
                sq->head = f->pnext;
                if (report) {
                    node_frame_end(n, f, false);
                } else if (++f->chunk->ndone == f->chunk->nframes) {
                    free(f->chunk);
                }
            }
            sq->tail = NULL;
        }
    }
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
             "rdma stats: links_up=%" PRIu64 " links_down=%" PRIu64 " closes_sent=%" PRIu64
             " closes_in=%" PRIu64 " peer_resets=%" PRIu64 " chunks_posted=%" PRIu64
             " wrs_posted=%" PRIu64 " wrs_ok=%" PRIu64 " wrs_error=%" PRIu64 " wrs_flushed=%" PRIu64
             " wrs_quarantined=%" PRIu64 " fences=%" PRIu64 " notices_sent=%" PRIu64
             " notices_in=%" PRIu64 " notice_bytes_in=%" PRIu64 " notices_refused=%" PRIu64
             " fabric_writes_in=%" PRIu64 " fabric_bytes_in=%" PRIu64 " fabric_refused_in=%" PRIu64
             " fabric_writes_out=%" PRIu64 " fabric_bytes_out=%" PRIu64,
             rd->links_up, rd->links_down, rd->closes_sent, rd->closes_in, st.peer_resets,
             rd->chunks_posted, st.wrs_posted, st.wrs_ok, st.wrs_error, st.wrs_flushed,
             st.wrs_quarantined, st.fences_done, rd->notices_sent, rd->notices_in,
             rd->notice_bytes_in, rd->notices_refused, fs.writes_in, fs.bytes_in, fs.refused_in,
             fs.writes_out, fs.bytes_out);
    kvf_transport_destroy(rd->t); /* fences every peer, retires what nobody polled */
    kvf_verbs_fake_destroy(rd->fake);
    free(rd);
    n->rdma = NULL;
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

void node_rdma_set_hold_odd(struct kvf_node *n, bool hold)
{
    struct node_rdma *rd = n->rdma;
    if (!rd || !rd->fake)
        return;
    unsigned links = 0;
    for (uint32_t i = 0; i < n->npeers && i < NODE_MAX_PEERS; i++) {
        struct kvf_rdma_conn_info ci;
        if (!link_live(&rd->links[i]) || kvf_transport_rdma_local_info(rd->t, i, &ci) != 0)
            continue;
        if (kvf_verbs_fake_fabric_hold_qp(rd->fake, ci.qp_num[1], hold) == 0)
            links++;
    }
    node_log("info", NULL, "fault: rdma writes on QP 1 %s (%u links)", hold ? "held" : "released",
             links);
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

/* Pool `p` as a write target: its wire form with base address and rkey. */
static void pool_wire(const struct node_pool *p, uint32_t rkey, Kvfence__V1__Pool *pv)
{
    node_pool_to_wire(p, pv);
    pv->base_addr = (uint64_t)(uintptr_t)p->base;
    pv->rkey = rkey;
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
        pool_wire(p, rd->lpools[i].rkey, &pv[k]);
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

/* LinkClose to `peer`, best effort: a fence or a reset never waits for it. */
static void send_close(struct kvf_node *n, uint32_t peer, const char *why, bool reconnect)
{
    Kvfence__V1__LinkClose c = KVFENCE__V1__LINK_CLOSE__INIT;
    c.reason = (char *)why;
    c.reconnect = reconnect;
    Kvfence__V1__LinkMessage m = KVFENCE__V1__LINK_MESSAGE__INIT;
    m.body_case = KVFENCE__V1__LINK_MESSAGE__BODY_CLOSE;
    m.close = &c;
    int rc = link_send(n, peer, &m);
    if (rc == 0)
        n->rdma->closes_sent++;
    else
        node_log("info", NULL, "rdma link to %s: LinkClose not sent (%s)", n->peers[peer].node_id,
                 strerror(-rc));
}

/* The link to `peer` goes down (an error completion here, or its LinkClose):
 * its QPs are drained and destroyed (reset_peer), so nothing of the old link
 * lands any more; chunks routed to it go over TCP, and with `relink` the next
 * one starts a new link with fresh QPs. Slices still queued for it fail at
 * their post (not connected). */
static void link_down(struct kvf_node *n, uint32_t peer, const char *why, bool relink)
{
    struct node_rdma *rd = n->rdma;
    struct rlink *L = &rd->links[peer];
    const struct node_peer *pe = &n->peers[peer];
    L->accept_due = L->ready_due = false;
    L->hello_tries = 0;
    rd->links_down++;
    int rc = kvf_transport_rdma_reset_peer(rd->t, peer);
    if (rc != 0) {
        L->st = RL_DEAD;
        node_log("warn", NULL,
                 "rdma link to %s incarnation %" PRIu64 " down (%s); queue pairs not reset (%s): "
                 "TCP only",
                 pe->node_id, pe->incarnation, why, strerror(-rc));
        return;
    }
    L->st = relink ? RL_NONE : RL_DEAD;
    node_log("warn", NULL, "rdma link to %s incarnation %" PRIu64 " down (%s): TCP %s", pe->node_id,
             pe->incarnation, why, relink ? "until a new link is up" : "only");
}

/* After an error completion: every link whose QP broke goes down and is made
 * again (the peer is told, so that it drops its side too). */
static void links_check(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    for (uint32_t i = 0; i < n->npeers; i++) {
        if (rd->links[i].st == RL_DEAD || n->peers[i].fenced ||
            !kvf_transport_rdma_peer_broken(rd->t, i))
            continue;
        send_close(n, i, "an RDMA write completed in error", true);
        link_down(n, i, "an RDMA write completed in error", true);
    }
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
        pool_wire(p, rkey, &pv);
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

/* A LinkHello (or, under fault rdma_drop_hello, none: as if lost). */
static int send_hello(struct kvf_node *n, uint32_t peer)
{
    if (node_fault_rdma_take(n, NODE_FAULT_RDMA_DROP_HELLO))
        return 0;
    return send_hello_or_accept(n, peer, true);
}

/* HELLO_SENT with no answer yet: the next hello when it is due. */
static void hello_again(struct kvf_node *n, uint32_t peer, int64_t now)
{
    struct rlink *L = &n->rdma->links[peer];
    struct node_peer *pe = &n->peers[peer];
    if (now < L->hello_next_ms)
        return;
    if (L->hello_tries >= HELLO_TRIES) {
        L->st = RL_NONE; /* the next chunk routed to it starts over */
        node_log("warn", NULL, "rdma link to %s: %u hellos unanswered: TCP until a later chunk",
                 pe->node_id, L->hello_tries);
        return;
    }
    int rc = send_hello(n, peer);
    if (rc != 0 && rc != -EAGAIN) {
        L->st = RL_DEAD;
        node_log("warn", NULL, "rdma link to %s: hello not sent (%s): TCP only", pe->node_id,
                 strerror(-rc));
        return;
    }
    if (rc == 0) {
        L->hello_tries++;
        node_log("info", NULL, "rdma link to %s: no answer in %u ms: hello sent again (%u)",
                 pe->node_id, L->hello_wait_ms, L->hello_tries);
    }
    L->hello_wait_ms = L->hello_wait_ms * 2 > HELLO_MAX_MS ? HELLO_MAX_MS : L->hello_wait_ms * 2;
    L->hello_next_ms = now + L->hello_wait_ms;
}

/* Messages that could not go when due (endpoint unknown yet, queue full),
 * and hellos to send again. */
static void link_tick(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    if (!rd->due)
        return;
    rd->due = false;
    int64_t now = node_now_ms();
    for (uint32_t i = 0; i < n->npeers; i++) {
        struct rlink *L = &rd->links[i];
        if (L->st == RL_HELLO_SENT && !n->peers[i].fenced) {
            hello_again(n, i, now);
            rd->due = rd->due || L->st == RL_HELLO_SENT;
        }
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
        L->rpools[L->nrpools++] =
            (struct rpool){p->pool_id, p->page_size, p->page_count, p->rkey, p->base_addr};
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
    if (rc == 0) /* creates our QPs when an acceptor has none yet (connect needs them) */
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
        if (L->st == RL_ACCEPTED) {
            /* Its hello again: our accept may be lost; same QPs, so the
             * same accept once more. */
            node_log("info", NULL, "rdma link to %s: hello again: accept again", from);
            L->accept_due = true;
            rd->due = true;
            link_tick(n);
            return;
        }
        if (L->st == RL_UP) {
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
    case KVFENCE__V1__LINK_MESSAGE__BODY_CLOSE: {
        const char *why = m->close->reason && m->close->reason[0] ? m->close->reason : "no reason";
        bool relink = m->close->reconnect;
        rd->closes_in++;
        node_log("info", NULL, "rdma link to %s incarnation %" PRIu64 ": LinkClose (%s)", from,
                 m->sender_incarnation, why);
        if (relink && (L->st == RL_NONE || L->st == RL_HELLO_SENT))
            return; /* about a link before our hello: that one is gone here already */
        link_down(n, peer, why, relink);
        return;
    }
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

void node_rdma_link_msg(struct kvf_node *n, const struct node_peer_msg *pm)
{
    if (!pm)
        return;
    Kvfence__V1__LinkMessage *m = kvfence__v1__link_message__unpack(NULL, pm->len, pm->data);
    if (!m) {
        node_log("warn", NULL, "link message from %s: undecodable", pm->sender);
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
        int rc = send_hello(n, peer);
        if (rc == 0) {
            L->st = RL_HELLO_SENT;
            L->hello_tries = 1;
            L->hello_wait_ms = HELLO_FIRST_MS;
            L->hello_next_ms = node_now_ms() + HELLO_FIRST_MS;
            rd->due = true; /* link_tick sends it again if unanswered */
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
    *rt = (struct node_route){rd->t, peer, KVF_LT_OP_RDMA_WR, NULL};
    return true;
}

/* Fault rdma_wr_error: the peer's pool is named with a wrong rkey from now
 * on, so the responder refuses the write (REM_ACCESS_ERR). The link goes
 * down on that error; a new link learns the real rkey again. */
static void fault_bad_rkey(struct kvf_node *n, uint32_t peer, uint32_t pool_id)
{
    struct node_rdma *rd = n->rdma;
    const struct rpool *rp = rpool_find(&rd->links[peer], pool_id);
    if (!rp)
        return;
    (void)kvf_transport_rdma_remove_remote_pool(rd->t, peer, pool_id);
    (void)kvf_transport_rdma_add_remote_pool(rd->t, peer, rp->id, rp->base_addr, rp->page_size,
                                             rp->page_count, rp->rkey ^ 0x5a5a5au);
}

static struct node_frame *sq_pop(struct squeue *sq)
{
    struct node_frame *f = sq->head;
    sq->head = f->pnext;
    if (!sq->head)
        sq->tail = NULL;
    return f;
}

/* Posts the slices of one queue while its QP takes them. */
static void pump_queue(struct kvf_node *n, struct squeue *sq)
{
    struct node_rdma *rd = n->rdma;
    struct kvf_xfer *xs[KVF_RDMA_MAX_WR_PER_QP];
    while (sq->head) {
        struct node_frame *f0 = sq->head;
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
            arc = kvf_lt_admit(r->core.lt, &f->x.op, KVF_LT_OP_RDMA_WR, peer);
            if (arc != 0)
                break;
            xs[k++] = &f->x;
        }
        if (k && xs[0] == &ch->frames[0].x && node_fault_rdma_take(n, NODE_FAULT_RDMA_WR_ERROR))
            fault_bad_rkey(n, peer, xs[0]->sink_pool);
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
            struct node_frame *f = sq_pop(sq);
            if (i < posted)
                continue; /* it completes through poll */
            if (kvf_lt_op_cancel(&f->x.op))
                node_check_drained(n, r);
            node_frame_end(n, f, false);
        }
        if (arc != 0 && (rc == 0 || k == 0)) {
            /* Admission closed: the slice is dropped before any native call. */
            node_frame_end(n, sq_pop(sq), false);
        }
    }
}

/* Posts queued slices while the QPs take them. */
static void pump(struct kvf_node *n)
{
    struct node_rdma *rd = n->rdma;
    for (uint32_t p = 0; p < n->npeers && p < NODE_MAX_PEERS; p++)
        for (unsigned q = 0; q < KVF_RDMA_QPS_PER_PEER; q++)
            if (rd->sq[p][q].head)
                pump_queue(n, &rd->sq[p][q]);
}

void node_rdma_post_chunk(struct kvf_node *n, struct node_chunk *ch)
{
    struct node_rdma *rd = n->rdma;
    ch->rdma = true;
    rd->chunks_posted++;
    if (ch->nframes == 0)
        return;
    struct squeue *sq =
        &rd->sq[ch->frames[0].x.peer][ch->room->key.room_id % KVF_RDMA_QPS_PER_PEER];
    for (uint32_t i = 0; i < ch->nframes; i++) {
        struct node_frame *f = &ch->frames[i];
        f->pnext = NULL;
        if (sq->tail)
            sq->tail->pnext = f;
        else
            sq->head = f;
        sq->tail = f;
    }
    pump_queue(n, sq);
}

static void reap(struct kvf_node *n)
{
    struct kvf_completion c[NODE_POLL_BATCH];
    int got;
    bool error = false;
    while ((got = kvf_transport_poll(n->rdma->t, NODE_POLL_BATCH, c)) > 0)
        for (int i = 0; i < got; i++) {
            error = error || c[i].outcome == KVF_LT_DONE_ERROR;
            node_completion(n, &c[i]);
        }
    if (error)
        links_check(n);
}

struct kvf_transport *node_rdma_transport(struct kvf_node *n)
{
    return n->rdma ? n->rdma->t : NULL;
}

int64_t node_rdma_next_ms(struct kvf_node *n, int64_t now)
{
    struct node_rdma *rd = n->rdma;
    if (!rd)
        return INT64_MAX;
    for (uint32_t p = 0; p < n->npeers && p < NODE_MAX_PEERS; p++)
        for (unsigned q = 0; q < KVF_RDMA_QPS_PER_PEER; q++)
            if (rd->sq[p][q].head || kvf_transport_rdma_outstanding(rd->t, p, q) > 0)
                return now + RDMA_REAP_MS;
    return rd->due ? now + RDMA_DUE_MS : INT64_MAX;
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
    if (link_live(L))
        send_close(n, peer, "fenced", false);
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

void node_rdma_close_all(struct kvf_node *n, const char *why)
{
    struct node_rdma *rd = n->rdma;
    if (!rd || !n->peerch)
        return;
    struct kvf_peer_stats st;
    kvf_peer_channel_stats(n->peerch, &st);
    uint64_t want = st.sent;
    for (uint32_t i = 0; i < n->npeers; i++) {
        struct rlink *L = &rd->links[i];
        if (!link_live(L) || n->peers[i].fenced)
            continue;
        uint64_t before = rd->closes_sent;
        send_close(n, i, why, false);
        want += rd->closes_sent - before;
        L->st = RL_DEAD;
    }
    /* The channel drops what it has not handed to ZeroMQ when it stops: give
     * the closes a moment (bounded) to leave. */
    int64_t end = node_now_ms() + 200;
    while (st.sent < want && node_now_ms() < end) {
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
        kvf_peer_channel_stats(n->peerch, &st);
    }
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

int node_chunk_transport(const struct node_chunk *ch)
{
    if (ch->rdma)
        return KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA;
    return ch->sink_local ? KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_LOCAL
                          : KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP;
}

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
    if (nr && node_fault_rdma_take(n, NODE_FAULT_RDMA_BAD_NOTICE))
        rv[0].first = UINT32_MAX - rv[0].count; /* no lease reaches that far */
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
    node_metrics_frame_refused(n->metrics, NODE_REFUSED_RDMA_NOTICE);
    char why[256];
    snprintf(why, sizeof why,
             "rdma chunk notice from %s (source rank %u, chunk %" PRIu64 "): %s; the bytes of an "
             "RDMA write cannot be refused, the room fails",
             pm->sender, pm->source_rank, pm->chunk_seq, what);
    node_log("error", &r->key, "%s", why);
    m->failed = true;
    node_session_send_transfer_failed(n, r, m->rank, m->role, why);
}

void node_rdma_notice_in(struct kvf_node *n, struct node_room *r, struct node_member *m,
                         const struct node_peer_msg *pm)
{
    struct node_rdma *rd = n->rdma;
    if (!rd) {
        /* Cannot happen from a well-behaved source: we never linked. */
        node_log("error", &r->key, "chunk notice from %s while RDMA is off here", pm->sender);
        m->failed = true;
        node_session_send_transfer_failed(n, r, m->rank, m->role, "chunk notice without RDMA");
        return;
    }
    if (pm->transport != KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA) {
        notice_refused(n, r, m, pm, "transport is not RDMA");
        return;
    }
    uint32_t peer;
    if (!node_find_peer(n, pm->sender, pm->sender_incarnation, &peer) ||
        (rd->links[peer].st != RL_UP && rd->links[peer].st != RL_ACCEPTED)) {
        notice_refused(n, r, m, pm, "no RDMA link with the sender here");
        return;
    }
    /* The same rule as a TCP frame's (tcp_check). */
    if (!node_room_may_send(r, pm->sender, pm->sender_incarnation)) {
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
    node_metrics_received(n->metrics, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA, nr,
                          pm->bytes);
    /* The event before the pages count: they may complete the sink. */
    node_watch_chunk_done(n, r, pm->source_rank, pm->sink_rank, pm->chunk_seq, true, "",
                          KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
    for (size_t i = 0; i < nr; i++)
        node_sink_landed(n, r, m->rank, rv[i].first, rv[i].count,
                         (uint64_t)rv[i].count * p->page_size);
}

/* ---- the registry's class (xport_registry.h) ------------------------------------------- */

static void rdma_class_stop(struct kvf_node *n)
{
    node_rdma_stop(n);
}

static int rdma_class_add_pool(struct kvf_node *n, const struct node_pool *p)
{
    node_rdma_add_pool(n, p); /* never refuses a pool: TCP carries what RDMA cannot */
    return 0;
}

static int rdma_class_route(struct kvf_node *n, uint32_t peer, const struct node_member *sink,
                            struct node_route *rt, char *why, size_t why_len)
{
    (void)why;
    (void)why_len;
    return node_rdma_route(n, peer, sink, rt) ? 1 : 0;
}

static const char *rdma_class_feature(const struct kvf_node *n)
{
    return n->rdma ? "RDMA" : NULL;
}

static bool rdma_class_endpoint(const struct kvf_node *n, int *kind_p, char *addr, size_t addr_len)
{
    if (!n->rdma || !n->rdma->ep[0]) /* only with a device */
        return false;
    *kind_p = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_RDMA;
    snprintf(addr, addr_len, "%s", n->rdma->ep);
    return true;
}

const struct node_xport_class node_xport_rdma_class = {
    .name = "rdma",
    .start = node_rdma_start,
    .stop = rdma_class_stop,
    .add_pool = rdma_class_add_pool,
    .remove_pool = node_rdma_remove_pool,
    .route = rdma_class_route,
    .post_chunk = node_rdma_post_chunk,
    .fence_peer = node_rdma_fence_peer,
    .renew = node_rdma_renew,
    .poll = node_rdma_poll,
    .waker = node_rdma_transport,
    .next_ms = node_rdma_next_ms,
    .feature = rdma_class_feature,
    .endpoint = rdma_class_endpoint,
};
