/*
 * control_session.c: the node's session with kvfence-control
 * (NodeSession/Attach): the whole control-plane protocol of the node
 * (control_session.h), receiving, dispatching and sending.
 *
 * The session thread opens the bidirectional stream, hands it to the owner
 * thread (which sends Hello and everything after it: only the owner sends),
 * then receives ControlMessages and posts each one to the owner in arrival
 * order; the owner hands each back to node_session_on_message, which handles
 * the session's own (Welcome, ResyncRequest, HeartbeatAck) and passes the
 * notices that change rooms and peers to the owner's ops. Everything the
 * node reports (Drained, Completed, TransferFailed, acks, pool updates) is
 * built and sent here, on the owner thread. The owner is reached only through
 * its struct node_session_ops, given at node_session_start. When the stream ends it tells the owner
 * to stop sending on it, waits for that to be done, frees the stream and reconnects with backoff
 * (100 ms, doubling, capped at 2 s), re-sending Hello with the same incarnation. A refusal with
 * FAILED_PRECONDITION (no common protocol, an older incarnation) cannot be cured by retrying: it is
 * logged and made the node's fatal error, and main exits non-zero; except a refusal of a LOST
 * incarnation, after which the node self-fences and attaches as a new incarnation.
 *
 * Liveness (owner thread): the control plane answers every heartbeat. A node
 * that heard nothing on a welcomed session for node_ttl minus a margin (a
 * fifth of it, at most 2 s) (the stream broke,
 * or the control plane stopped reading it) knows it is, or is about to be,
 * declared LOST and fenced by its peers: it fences every peer itself, closes
 * every lifetime and takes a new, empty incarnation (ops->self_fence: the
 * owner does it, node.c). After
 * a re-attach with the same incarnation, and on ResyncRequest, it sends
 * Resync: every lifetime of this incarnation, its fenced peers, its pools.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "control_session.h"
#include "devpool.h"
#include "faults.h"
#include "kvf_error.h"
#include "kvf_types.h"
#include "kvf_version.h"
#include "node_log.h"
#include "node_types.h"
#include "xport.h"

#define RECV_SLICE_MS            200
#define BACKOFF_MIN_MS           100
#define BACKOFF_MAX_MS           2000
#define SELF_FENCE_MARGIN_MAX_MS 2000 /* self-fence this long before node_ttl, at most */

/* ---- sending ------------------------------------------------------------------ */

int node_session_send(struct kvf_node *n, const Kvfence__V1__NodeMessage *m)
{
    if (!n->session)
        return -ENOTCONN;
    if (node_fault_drop_report(n, (int)m->msg_case))
        return 0; /* as if sent and lost */
    size_t len = kvfence__v1__node_message__get_packed_size(m);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return -ENOMEM;
    kvfence__v1__node_message__pack(m, buf);
    int rc = kvf_rpc_client_stream_send(n->session, buf, len);
    free(buf);
    return rc;
}

void node_session_send_drained(struct kvf_node *n, const struct node_room *r)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = r->key.room_id;
    k.generation = r->key.generation;
    Kvfence__V1__AbortToken t = KVFENCE__V1__ABORT_TOKEN__INIT;
    t.hi = r->core.token.hi;
    t.lo = r->core.token.lo;
    Kvfence__V1__Drained d = KVFENCE__V1__DRAINED__INIT;
    d.room = &k;
    d.token = &t;
    d.notice_id = r->core.notice_id;
    /* A lifetime of an incarnation this process gave up (self-fence): its
     * token, sent to that incarnation only, proves it. */
    d.incarnation = r->incarnation != n->incarnation ? r->incarnation : 0;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED;
    m.drained = &d;
    int rc = node_session_send(n, &m);
    node_log("info", &r->key, "drained%s", rc == 0 ? "" : " (not sent: no session)");
}

void node_session_send_completed(struct kvf_node *n, const struct node_room *r,
                                 const struct node_member *mb)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = r->key.room_id;
    k.generation = r->key.generation;
    Kvfence__V1__Completed c = KVFENCE__V1__COMPLETED__INIT;
    c.room = &k;
    c.rank = mb->rank;
    c.role = (Kvfence__V1__Role)mb->role;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_COMPLETED;
    m.completed = &c;
    int rc = node_session_send(n, &m);
    node_log("info", &r->key, "participant rank %u %s completed%s", mb->rank,
             mb->role == KVFENCE__V1__ROLE__ROLE_SOURCE ? "source" : "sink",
             rc == 0 ? "" : " (report waits for the session)");
}

static void send_failed(struct kvf_node *n, kvf_room_key key, uint32_t rank, int role,
                        const char *reason)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = key.room_id;
    k.generation = key.generation;
    Kvfence__V1__TransferFailed f = KVFENCE__V1__TRANSFER_FAILED__INIT;
    f.room = &k;
    f.reason = (char *)reason;
    f.rank = rank;
    f.role = (Kvfence__V1__Role)role;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_TRANSFER_FAILED;
    m.transfer_failed = &f;
    node_session_send(n, &m);
    node_log("warn", &key, "transfer failed: %s", reason);
}

void node_session_send_transfer_failed(struct kvf_node *n, const struct node_room *r, uint32_t rank,
                                       int role, const char *reason)
{
    if (r->core.aborting)
        return; /* the room is failing already */
    send_failed(n, r->key, rank, role, reason);
}

void node_session_send_room_failed(struct kvf_node *n, kvf_room_key key, const char *reason)
{
    send_failed(n, key, 0, KVFENCE__V1__ROLE__ROLE_SINK, reason);
}

void node_session_send_ack(struct kvf_node *n, uint64_t notice_id)
{
    Kvfence__V1__Ack a = KVFENCE__V1__ACK__INIT;
    a.notice_id = notice_id;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_ACK;
    m.ack = &a;
    node_session_send(n, &m);
}

void node_session_send_room_update_ack(struct kvf_node *n, kvf_room_key key, uint64_t version)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = key.room_id;
    k.generation = key.generation;
    Kvfence__V1__RoomUpdateAck a = KVFENCE__V1__ROOM_UPDATE_ACK__INIT;
    a.room = &k;
    a.version = version;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_ROOM_UPDATE_ACK;
    m.room_update_ack = &a;
    node_session_send(n, &m);
}

void node_session_send_peer_fenced(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                                   uint64_t notice_id)
{
    Kvfence__V1__PeerFenced pf = KVFENCE__V1__PEER_FENCED__INIT;
    pf.node_id = (char *)node_id;
    pf.incarnation = incarnation;
    pf.notice_id = notice_id;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_PEER_FENCED;
    m.peer_fenced = &pf;
    node_session_send(n, &m);
}

void node_session_send_pool_added(struct kvf_node *n, const Kvfence__V1__Pool *added)
{
    Kvfence__V1__Pool *pp = (Kvfence__V1__Pool *)added;
    Kvfence__V1__PoolUpdate pu = KVFENCE__V1__POOL_UPDATE__INIT;
    pu.n_upserted = 1;
    pu.upserted = &pp;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_POOL_UPDATE;
    m.pool_update = &pu;
    node_session_send(n, &m); /* or the next Hello / Resync says it */
}

void node_session_send_pool_removed(struct kvf_node *n, uint32_t removed_id)
{
    uint32_t ids[1] = {removed_id};
    Kvfence__V1__PoolUpdate pu = KVFENCE__V1__POOL_UPDATE__INIT;
    pu.n_removed_pool_ids = 1;
    pu.removed_pool_ids = ids;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_POOL_UPDATE;
    m.pool_update = &pu;
    node_session_send(n, &m); /* or the next Hello / Resync says it */
}

static void send_heartbeat(struct kvf_node *n)
{
    uint32_t open = 0;
    uint64_t ops = 0;
    for (struct node_room *r = n->rooms; r; r = r->next) {
        if (kvf_lt_state(r->core.lt) != KVF_LT_DRAINED)
            open++;
        ops += kvf_lt_inflight(r->core.lt);
    }
    Kvfence__V1__Heartbeat h = KVFENCE__V1__HEARTBEAT__INIT;
    h.seq = ++n->hb_seq;
    h.open_lifetimes = open;
    h.ops_in_flight = ops;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT;
    m.heartbeat = &h;
    node_session_send(n, &m);
}

/* Builds and sends Hello on the current stream. */
static int send_hello(struct kvf_node *n)
{
    const char *features[8];
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = KVF_PROTOCOL_MIN;
    caps.protocol_max = KVF_PROTOCOL_MAX;
    caps.n_features = n->session_ops->features(n->session_ctx, features, 8);
    caps.features = (char **)features;

    /* The transports' endpoints (xport_registry.h), then the node's own. */
    struct node_xport_endpoint xep[4];
    size_t nx = n->session_ops->endpoints(n->session_ctx, xep, 4);
    char local_addr[300];
    snprintf(local_addr, sizeof local_addr, "unix:%s", n->local_socket);
    Kvfence__V1__Endpoint ep[6];
    Kvfence__V1__Endpoint *eps[6];
    for (size_t i = 0; i < 6; i++) {
        kvfence__v1__endpoint__init(&ep[i]);
        eps[i] = &ep[i];
    }
    size_t nep = 0;
    for (size_t i = 0; i < nx; i++) {
        ep[nep].kind = (Kvfence__V1__EndpointKind)xep[i].kind;
        ep[nep++].address = xep[i].address;
    }
    ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_NODE_LOCAL;
    ep[nep++].address = local_addr;
    if (n->peer_ep[0]) {
        ep[nep].kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ;
        ep[nep++].address = n->peer_ep;
    }

    Kvfence__V1__Pool pv[NODE_MAX_POOLS];
    Kvfence__V1__Pool *pp[NODE_MAX_POOLS];
    node_pools_to_wire(n, pv, pp);

    Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
    h.node_id = n->node_id;
    h.incarnation = n->incarnation;
    h.capabilities = &caps;
    h.n_endpoints = nep;
    h.endpoints = eps;
    h.n_pools = n->npools;
    h.pools = pp;
    h.software_version = (char *)KVF_VERSION_STRING;
    h.witnessed_gone = n->witnessed_gone < n->incarnation ? n->witnessed_gone : 0;
    h.peer_key.data = n->keys.pub;
    h.peer_key.len = KVF_PEER_KEY_SIZE;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HELLO;
    m.hello = &h;
    int rc = node_session_send(n, &m);
    if (rc != 0)
        node_log("warn", NULL, "hello not sent: %s", strerror(-rc));
    return rc;
}

/* ---- Resync ------------------------------------------------------------------ */

/* Whether a lifetime goes into a Resync. A DRAINED lifetime that was never
 * aborted has nothing left to say (its Completed reports are re-sent on
 * re-attach); lifetimes are never forgotten while the process runs, so
 * leaving those out keeps the message to what the control plane can use. */
static bool resync_wants(const struct kvf_node *n, const struct node_room *r, bool drained_pass)
{
    if (r->incarnation != n->incarnation)
        return false; /* an older incarnation's rooms are not this one's to report */
    bool drained = kvf_lt_state(r->core.lt) == KVF_LT_DRAINED;
    return drained_pass ? drained && r->core.aborting : !drained;
}

int node_resync_emit(struct kvf_node *n, node_resync_send_fn send, size_t *lifetimes_p,
                     size_t *messages_p)
{
    *lifetimes_p = 0;
    *messages_p = 0;
    /* Open, closed and quarantined lifetimes first, then drained aborted ones
     * (their Drained may have been lost), newest first. */
    size_t nrooms = 0;
    for (struct node_room *r = n->rooms; r; r = r->next)
        nrooms += resync_wants(n, r, false) || resync_wants(n, r, true);
    struct node_room **rooms = calloc(nrooms ? nrooms : 1, sizeof *rooms);
    size_t batch = nrooms < NODE_RESYNC_MAX ? nrooms : NODE_RESYNC_MAX;
    Kvfence__V1__LifetimeInfo *lv = calloc(batch ? batch : 1, sizeof *lv);
    Kvfence__V1__LifetimeInfo **lp = calloc(batch ? batch : 1, sizeof *lp);
    Kvfence__V1__RoomKey *kv = calloc(batch ? batch : 1, sizeof *kv);
    Kvfence__V1__AbortToken *tv = calloc(batch ? batch : 1, sizeof *tv);
    int rc = 0;
    if (!rooms || !lv || !lp || !kv || !tv) {
        rc = -ENOMEM;
        goto out;
    }
    size_t k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (struct node_room *r = n->rooms; r; r = r->next)
            if (resync_wants(n, r, pass == 1))
                rooms[k++] = r;

    Kvfence__V1__FencedPeer fv[NODE_MAX_PEERS];
    Kvfence__V1__FencedPeer *fp[NODE_MAX_PEERS];
    size_t nf = 0;
    for (uint32_t p = 0; p < n->npeers; p++) {
        if (!n->peers[p].fenced)
            continue;
        kvfence__v1__fenced_peer__init(&fv[nf]);
        fv[nf].node_id = n->peers[p].node_id;
        fv[nf].incarnation = n->peers[p].incarnation;
        fp[nf] = &fv[nf];
        nf++;
    }
    Kvfence__V1__Pool pv[NODE_MAX_POOLS];
    Kvfence__V1__Pool *pp[NODE_MAX_POOLS];
    node_pools_to_wire(n, pv, pp);

    /* Over the cap, more messages rather than fewer lifetimes: the control
     * plane reconciles each lifetime on its own and takes the (repeated) pool
     * list as a whole each time, so a split Resync reconciles like one; one
     * left out could keep admission open on a room it forgot. */
    size_t done = 0;
    do {
        size_t i = 0;
        for (; i < batch && done + i < nrooms; i++) {
            const struct node_room *r = rooms[done + i];
            kvfence__v1__lifetime_info__init(&lv[i]);
            kvfence__v1__room_key__init(&kv[i]);
            kv[i].room_id = r->key.room_id;
            kv[i].generation = r->key.generation;
            lv[i].room = &kv[i];
            /* kvf_lt_state numbers its states as node.proto's LifetimeState. */
            lv[i].state = (Kvfence__V1__LifetimeState)kvf_lt_state(r->core.lt);
            lv[i].ops_in_flight = kvf_lt_inflight(r->core.lt);
            if (r->core.aborting) {
                kvfence__v1__abort_token__init(&tv[i]);
                tv[i].hi = r->core.token.hi;
                tv[i].lo = r->core.token.lo;
                lv[i].token = &tv[i];
            }
            lp[i] = &lv[i];
        }
        Kvfence__V1__Resync rs = KVFENCE__V1__RESYNC__INIT;
        rs.n_lifetimes = i;
        rs.lifetimes = lp;
        rs.n_fenced_peers = done == 0 ? nf : 0; /* said once */
        rs.fenced_peers = fp;
        rs.n_pools = n->npools;
        rs.pools = pp;
        Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
        m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_RESYNC;
        m.resync = &rs;
        rc = send(n, &m);
        if (rc != 0)
            break;
        done += i;
        ++*messages_p;
    } while (done < nrooms);
    *lifetimes_p = done;
out:
    free(rooms);
    free(lv);
    free(lp);
    free(kv);
    free(tv);
    return rc;
}

void node_session_send_resync(struct kvf_node *n, const char *why)
{
    if (!n->session)
        return;
    size_t nlt = 0, nmsg = 0;
    int rc = node_resync_emit(n, node_session_send, &nlt, &nmsg);
    node_log(rc == 0 ? "info" : "warn", NULL,
             "resync (%s): %zu lifetimes in %zu messages, %u pools%s%s", why, nlt, nmsg, n->npools,
             rc == 0 ? "" : ": not all sent: ", rc == 0 ? "" : strerror(-rc));
}

/* ---- liveness and self-fencing --------------------------------------------------- */

static void on_welcome(struct kvf_node *n, const Kvfence__V1__Welcome *w)
{
    n->node_ttl_ms = w->node_ttl_ms;
    n->cp_acks_heartbeats = false; /* learnt from the first HeartbeatAck */
    n->last_contact_ms = node_now_ms();
    /* Several heartbeats per ttl, whatever the control plane's interval: the
     * acks are what keeps this node from self-fencing. */
    if (n->node_ttl_ms && n->hb_interval_ms > n->node_ttl_ms / 5)
        n->hb_interval_ms = n->node_ttl_ms / 5 ? n->node_ttl_ms / 5 : 1;
    n->next_hb_ms = node_now_ms(); /* at once: the first ack proves the loop */
    if (n->welcomed_before)
        node_session_send_resync(n, "re-attached with the same incarnation");
    n->welcomed_before = true;
    /* The lifetimes of incarnations this process gave up: their Drained went
     * out on a session the control plane had closed. Say it again, under
     * their incarnation, then witness them once all are drained. */
    for (struct node_room *r = n->rooms; r; r = r->next)
        if (r->incarnation != n->incarnation && r->core.aborting && r->core.drained_sent)
            node_session_send_drained(n, r);
    node_session_maybe_witness(n);
}

void node_session_maybe_witness(struct kvf_node *n)
{
    if (n->retired_incarnation == 0 || n->retired_witness_sent || !n->session ||
        !n->session_welcomed)
        return;
    for (struct node_room *r = n->rooms; r; r = r->next)
        if (r->incarnation != n->incarnation && kvf_lt_state(r->core.lt) != KVF_LT_DRAINED)
            return; /* an op of a given-up incarnation may still touch a page */
    Kvfence__V1__Witness w = KVFENCE__V1__WITNESS__INIT;
    w.gone_incarnation = n->retired_incarnation;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_WITNESS;
    m.witness = &w;
    if (node_session_send(n, &m) != 0)
        return; /* the next welcome tries again */
    n->retired_witness_sent = true;
    if (n->retired_incarnation > n->witnessed_gone)
        n->witnessed_gone = n->retired_incarnation;
    node_log("info", NULL,
             "witness: incarnation %" PRIu64 " of this process is gone (self-fenced, every "
             "lifetime drained); its leases waiting for this host can be released",
             n->retired_incarnation);
}

int64_t node_session_next_ms(const struct kvf_node *n)
{
    int64_t hb = n->session && n->session_welcomed ? n->next_hb_ms : INT64_MAX;
    if (n->node_ttl_ms == 0 || n->last_contact_ms == 0)
        return hb;
    if (n->session && n->session_welcomed && !n->cp_acks_heartbeats)
        return hb; /* the open stream counts: nothing to decide */
    int64_t ttl = (int64_t)n->node_ttl_ms;
    int64_t margin = ttl / 5 < SELF_FENCE_MARGIN_MAX_MS ? ttl / 5 : SELF_FENCE_MARGIN_MAX_MS;
    int64_t fence = n->last_contact_ms + ttl - margin;
    return fence < hb ? fence : hb;
}

/* Self-fences once the session is gone for node_ttl (minus the margin). */
static void check_liveness(struct kvf_node *n, int64_t now_ms)
{
    if (n->node_ttl_ms == 0 || n->last_contact_ms == 0)
        return; /* never welcomed in this incarnation: nothing to fence */
    if (n->session && n->session_welcomed && !n->cp_acks_heartbeats) {
        n->last_contact_ms = now_ms; /* a control plane without acks: the open stream counts */
        return;
    }
    /* Before the control plane can have declared it LOST (docs/state-cores.md:
     * node_ttl minus a margin): its ttl starts when it sees the session end,
     * which is after the last word this node heard, but the word took time to
     * arrive, and the peers fence as soon as they are told. */
    int64_t ttl = (int64_t)n->node_ttl_ms;
    int64_t margin = ttl / 5 < SELF_FENCE_MARGIN_MAX_MS ? ttl / 5 : SELF_FENCE_MARGIN_MAX_MS;
    int64_t silent = now_ms - n->last_contact_ms;
    if (silent < ttl - margin)
        return;
    char why[160];
    snprintf(why, sizeof why,
             "no word from the control plane for %" PRId64 " ms (node_ttl %u ms, margin %" PRId64
             " ms)",
             silent, n->node_ttl_ms, margin);
    n->session_ops->self_fence(n->session_ctx, why);
}

void node_session_tick(struct kvf_node *n, int64_t now_ms)
{
    check_liveness(n, now_ms);
    if (n->session && n->session_welcomed && now_ms >= n->next_hb_ms) {
        send_heartbeat(n);
        n->next_hb_ms = now_ms + (int64_t)n->hb_interval_ms;
    }
}

void node_session_goodbye(struct kvf_node *n)
{
    if (n->session) {
        send_heartbeat(n);
        kvf_rpc_client_stream_half_close(n->session); /* deregister */
    }
}

bool node_session_up(const struct kvf_node *n)
{
    return n->session && n->session_welcomed;
}

void node_session_give_up(struct kvf_node *n)
{
    /* The control plane has declared (or will declare) this incarnation LOST:
     * nothing more is said as it. The session thread drops its stream. */
    if (n->session)
        atomic_store(&n->reset_stream, n->session);
    n->session = NULL;
    n->session_welcomed = false;
}

void node_session_new_incarnation(struct kvf_node *n, uint64_t old)
{
    n->welcomed_before = false;
    n->last_contact_ms = 0;
    n->cp_acks_heartbeats = false;
    /* The old incarnation is witnessed once its lifetimes are all drained
     * (node_session_maybe_witness). */
    n->retired_incarnation = old;
    n->retired_witness_sent = false;
}

/* ---- the owner's side of the stream ----------------------------------------------- */

void node_session_opened(struct kvf_node *n, struct kvf_rpc_client_stream *cs)
{
    n->session = cs;
    n->session_welcomed = false;
    n->hb_seq = 0;
    if (send_hello(n) != 0)
        return;
    /* Completions reported while the session was down are said again. */
    for (struct node_room *r = n->rooms; r; r = r->next)
        for (size_t i = 0; i < r->nmembers && !r->core.aborting && r->incarnation == n->incarnation;
             i++)
            if (r->members[i].local && r->members[i].completed)
                node_session_send_completed(n, r, &r->members[i]);
}

void node_session_closed(struct kvf_node *n, struct kvf_rpc_client_stream *cs)
{
    if (n->session == cs) {
        n->session = NULL;
        n->session_welcomed = false;
    }
}

bool node_session_is_current(const struct kvf_node *n, const struct kvf_rpc_client_stream *cs)
{
    return cs == n->session;
}

static void dispatch(struct kvf_node *n, const Kvfence__V1__ControlMessage *cm)
{
    const struct node_session_ops *ops = n->session_ops;
    switch (cm->msg_case) {
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME:
        n->session_welcomed = true;
        n->hb_interval_ms =
            cm->welcome->heartbeat_interval_ms ? cm->welcome->heartbeat_interval_ms : 1000;
        n->next_hb_ms = node_now_ms() + (int64_t)n->hb_interval_ms;
        node_log("info", NULL, "attached to control plane %s (protocol %u)",
                 cm->welcome->control_plane_id ? cm->welcome->control_plane_id : "?",
                 cm->welcome->negotiated_version);
        ops->welcomed(n->session_ctx);
        on_welcome(n, cm->welcome);
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_RESYNC_REQUEST:
        node_session_send_resync(n,
                                 cm->resync_request->reason ? cm->resync_request->reason : "asked");
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_HEARTBEAT_ACK:
        n->cp_acks_heartbeats = true; /* the contact itself is noted below */
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE:
        ops->room_update(n->session_ctx, cm->room_update);
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE:
        ops->abort_notice(n->session_ctx, cm->abort_notice);
        break;
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER:
        ops->fence_peer(n->session_ctx, cm->fence_peer);
        break;
    default:
        break; /* unknown to this version */
    }
}

void node_session_on_message(struct kvf_node *n, const Kvfence__V1__ControlMessage *cm)
{
    if (!node_fault_drop_control(n, (int)cm->msg_case))
        dispatch(n, cm); /* (dropped: unacknowledged, the control plane sends it again) */
    if (n->session_welcomed)
        n->last_contact_ms = node_now_ms();
}

static void sleep_interruptible(struct kvf_node *n, int ms)
{
    while (ms > 0 && !atomic_load(&n->stopping)) {
        int step = ms < 50 ? ms : 50;
        struct timespec ts = {0, (long)step * 1000000L};
        nanosleep(&ts, NULL);
        ms -= step;
    }
}

/* Posts a session event and waits for the owner; false when it is gone. */
static bool post_event(struct kvf_node *n, enum node_session_event ev,
                       struct kvf_rpc_client_stream *cs)
{
    return n->session_ops->post_event(n->session_ctx, ev, cs);
}

/* The channel to kvfence-control, with the TLS files as they are now. */
static struct kvf_rpc_channel *session_channel(const struct kvf_node *n)
{
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.tls_root_ca_path = n->opts.control_tls_ca;
    co.tls_cert_path = n->opts.control_tls_cert;
    co.tls_key_path = n->opts.control_tls_key;
    co.tls_target_name = n->opts.control_tls_server_name;
    return kvf_rpc_channel_create(n->opts.control_addr, &co);
}

/* Before a reconnect: a channel made from the TLS files as they are now, so
 * that a rotated certificate is used. Keeps the old channel when the new
 * files do not load (a rotation half done), and says so. Session thread. */
static void session_reload_tls(struct kvf_node *n)
{
    if (n->opts.control_tls_ca == NULL)
        return;
    struct kvf_rpc_channel *fresh = session_channel(n);
    if (fresh == NULL) {
        node_log("error", NULL,
                 "control TLS files (%s, %s, %s) do not load: reconnecting with the ones loaded "
                 "before",
                 n->opts.control_tls_ca, n->opts.control_tls_cert ? n->opts.control_tls_cert : "-",
                 n->opts.control_tls_key ? n->opts.control_tls_key : "-");
        return;
    }
    kvf_rpc_channel_destroy(n->channel);
    n->channel = fresh;
}

static void *session_main(void *arg)
{
    struct kvf_node *n = arg;
    int backoff = BACKOFF_MIN_MS;
    bool first = true;
    while (!atomic_load(&n->stopping)) {
        if (!first)
            session_reload_tls(n);
        first = false;
        struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(
            n->channel, "/kvfence.v1.NodeSession/Attach", KVF_RPC_NO_TIMEOUT);
        if (!cs) {
            sleep_interruptible(n, backoff);
            continue;
        }
        if (!post_event(n, NODE_SESSION_OPEN, cs)) {
            kvf_rpc_client_stream_close(cs);
            break;
        }
        bool cancelled = false;
        struct kvf_rpc_status st;
        memset(&st, 0, sizeof st);
        for (;;) {
            uint8_t *bytes = NULL;
            size_t len = 0;
            int rc = kvf_rpc_client_stream_recv(cs, RECV_SLICE_MS, &bytes, &len, &st);
            if (!cancelled && atomic_load(&n->reset_stream) == cs) {
                kvf_rpc_client_stream_cancel(cs); /* the owner self-fenced */
                cancelled = true;
            }
            if (rc == -ETIMEDOUT) {
                if (atomic_load(&n->stopping) && !cancelled) {
                    kvf_rpc_client_stream_cancel(cs);
                    cancelled = true;
                }
                continue;
            }
            if (rc != 0)
                break;
            static const uint8_t empty[1];
            Kvfence__V1__ControlMessage *cm =
                kvfence__v1__control_message__unpack(NULL, len, bytes ? bytes : empty);
            free(bytes);
            if (!cm) {
                node_log("error", NULL, "undecodable control message: dropping the session");
                kvf_rpc_client_stream_cancel(cs);
                cancelled = true;
                continue;
            }
            if (cm->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME)
                backoff = BACKOFF_MIN_MS;
            /* The owner drops messages of a stream it gave up. Not posted
             * (out of memory, the owner gone): the control plane re-sends
             * its notices. */
            if (n->session_ops->post_message(n->session_ctx, cs, cm) != 0)
                kvfence__v1__control_message__free_unpacked(cm, NULL);
        }
        bool owner_alive = post_event(n, NODE_SESSION_CLOSED, cs);
        struct kvf_rpc_client_stream *gone = cs; /* never match a later stream at this address */
        atomic_compare_exchange_strong(&n->reset_stream, &gone, NULL);
        kvf_rpc_client_stream_close(cs);
        if (st.code == KVF_GRPC_FAILED_PRECONDITION && st.message[0] &&
            strstr(st.message, "is LOST") && !atomic_load(&n->stopping)) {
            /* This incarnation was declared LOST while we were away: its
             * peers fence it. Never pretend to be it: self-fence and come
             * back as a new incarnation (node.proto, Attach). */
            node_log("warn", NULL, "control plane refused this incarnation: %s", st.message);
            if (!post_event(n, NODE_SESSION_LOST, NULL))
                break;
            backoff = BACKOFF_MIN_MS;
            continue;
        }
        if (st.code == KVF_GRPC_FAILED_PRECONDITION) {
            node_log("error", NULL, "control plane refused the node: %s", st.message);
            n->session_ops->refused(n->session_ctx, -EPERM);
            break;
        }
        if (!owner_alive || atomic_load(&n->stopping))
            break;
        node_log("warn", NULL, "control session ended (%s: %s): reconnecting in %d ms",
                 kvf_grpc_code_name((enum kvf_grpc_code)st.code), st.message, backoff);
        sleep_interruptible(n, backoff);
        backoff = backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2;
    }
    return NULL;
}

int node_session_start(struct kvf_node *n, const struct node_session_ops *ops, void *ctx)
{
    n->session_ops = ops;
    n->session_ctx = ctx;
    n->channel = session_channel(n);
    if (!n->channel)
        return -EIO;
    if (n->opts.control_tls_ca == NULL)
        node_log("warn", NULL,
                 "INSECURE: plaintext session to kvfence-control at %s: anything on the path can "
                 "read and change it; set --control-tls-ca, --control-tls-cert and "
                 "--control-tls-key outside a test bed",
                 n->opts.control_addr);
    if (pthread_create(&n->session_thread, NULL, session_main, n) != 0) {
        kvf_rpc_channel_destroy(n->channel);
        n->channel = NULL;
        return -EAGAIN;
    }
    n->session_started = true;
    return 0;
}

void node_session_join(struct kvf_node *n)
{
    atomic_store(&n->stopping, true);
    if (n->session_started) {
        pthread_join(n->session_thread, NULL);
        n->session_started = false;
    }
    kvf_rpc_channel_destroy(n->channel);
    n->channel = NULL;
}
