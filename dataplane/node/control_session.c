/*
 * control_session.c: the node's session with kvfence-control
 * (NodeSession/Attach), the receive side.
 *
 * The session thread opens the bidirectional stream, hands it to the owner
 * thread (which sends Hello and everything after it: only the owner sends),
 * then receives ControlMessages and posts each one to the owner in arrival
 * order. When the stream ends it tells the owner to stop sending on it, waits
 * for that to be done, frees the stream and reconnects with backoff (100 ms,
 * doubling, capped at 2 s), re-sending Hello with the same incarnation. A
 * refusal with FAILED_PRECONDITION (no common protocol, an older incarnation)
 * cannot be cured by retrying: it is logged and made the node's fatal error,
 * and main exits non-zero; except a refusal of a LOST incarnation, after
 * which the node self-fences and attaches as a new incarnation.
 *
 * Liveness (owner thread): the control plane answers every heartbeat. A node
 * that heard nothing on a welcomed session for node_ttl minus a margin (a
 * fifth of it, at most 2 s) (the stream broke,
 * or the control plane stopped reading it) knows it is, or is about to be,
 * declared LOST and fenced by its peers: it fences every peer itself, closes
 * every lifetime and takes a new, empty incarnation (node_self_fence). After
 * a re-attach with the same incarnation, and on ResyncRequest, it sends
 * Resync: every lifetime of this incarnation, its fenced peers, its pools.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvf_error.h"
#include "kvf_types.h"
#include "devpool.h"
#include "faults.h"
#include "host_lock.h"
#include "kvf_version.h"
#include "node_internal.h"
#include "rdma_link.h"
#include "tcp.h"
#include "xport.h"

#define RECV_SLICE_MS            200
#define BACKOFF_MIN_MS           100
#define BACKOFF_MAX_MS           2000
#define SELF_FENCE_MARGIN_MAX_MS 2000 /* self-fence this long before node_ttl, at most */

int node_session_send_hello(struct kvf_node *n, struct kvf_rpc_client_stream *cs)
{
    (void)cs; /* n->session is cs: node_ctl_send uses it */
    const char *features[8];
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = KVF_PROTOCOL_MIN;
    caps.protocol_max = KVF_PROTOCOL_MAX;
    caps.n_features = node_xport_features(n, features, 8);
    caps.features = (char **)features;

    /* The transports' endpoints (xport_registry.h), then the node's own. */
    struct node_xport_endpoint xep[4];
    size_t nx = node_xport_endpoints(n, xep, 4);
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
    int rc = node_ctl_send(n, &m);
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
    int rc = node_resync_emit(n, node_ctl_send, &nlt, &nmsg);
    node_log(rc == 0 ? "info" : "warn", NULL,
             "resync (%s): %zu lifetimes in %zu messages, %u pools%s%s", why, nlt, nmsg, n->npools,
             rc == 0 ? "" : ": not all sent: ", rc == 0 ? "" : strerror(-rc));
}

/* ---- liveness and self-fencing --------------------------------------------------- */

void node_session_on_welcome(struct kvf_node *n, const Kvfence__V1__Welcome *w)
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
            node_send_drained(n, r);
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
    if (node_ctl_send(n, &m) != 0)
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
    if (n->node_ttl_ms == 0 || n->last_contact_ms == 0)
        return INT64_MAX;
    if (n->session && n->session_welcomed && !n->cp_acks_heartbeats)
        return INT64_MAX; /* the open stream counts: nothing to decide */
    int64_t ttl = (int64_t)n->node_ttl_ms;
    int64_t margin = ttl / 5 < SELF_FENCE_MARGIN_MAX_MS ? ttl / 5 : SELF_FENCE_MARGIN_MAX_MS;
    return n->last_contact_ms + ttl - margin;
}

void node_session_tick(struct kvf_node *n, int64_t now_ms)
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
    node_self_fence(n, why);
}

void node_self_fence(struct kvf_node *n, const char *why)
{
    uint64_t old = n->incarnation;
    /* The control plane has declared (or will declare) this incarnation LOST:
     * nothing more is said as it. The session thread drops its stream. */
    if (n->session)
        atomic_store(&n->reset_stream, n->session);
    n->session = NULL;
    n->session_welcomed = false;
    pthread_mutex_lock(&n->qlock);
    n->welcomed = false;
    pthread_mutex_unlock(&n->qlock);

    /* Admission first: nothing new starts while the peers are fenced. The
     * engines watching a room that was open see it close. */
    size_t open = 0;
    for (struct node_room *r = n->rooms; r; r = r->next)
        open += kvf_lt_state(r->core.lt) == KVF_LT_OPEN;
    struct node_room **was_open = calloc(open ? open : 1, sizeof *was_open);
    size_t k = 0;
    for (struct node_room *r = n->rooms; r && was_open; r = r->next)
        if (kvf_lt_state(r->core.lt) == KVF_LT_OPEN)
            was_open[k++] = r;
    (void)kvf_lt_table_close_all(n->lts);
    for (size_t i = 0; i < k; i++)
        node_watch_room_state(n, was_open[i]);
    free(was_open);
    uint32_t fenced = 0;
    for (uint32_t i = 0; i < n->npeers; i++) {
        if (n->peers[i].fenced)
            continue;
        int rc = node_xport_fence_peer(n, i); /* every transport; held faults flushed too */
        if (rc != 0) {
            node_log("error", NULL, "self-fence: cannot fence peer %s: %s", n->peers[i].node_id,
                     strerror(-rc));
            continue;
        }
        n->peers[i].fenced = true;
        (void)kvf_lt_table_peer_fenced(n->lts, i);
        fenced++;
    }
    /* Same-node copies: flushed or waited for, and a fresh local transport
     * whose peer indices start over with the peer table below. */
    int lrc = node_xport_renew_local(n);
    if (lrc != 0)
        node_log("error", NULL, "self-fence: local transport: %s", strerror(-lrc));
    node_poll_completions(n);
    size_t undrained = 0;
    for (struct node_room *r = n->rooms; r; r = r->next) {
        node_check_drained(n, r);
        undrained += kvf_lt_state(r->core.lt) != KVF_LT_DRAINED;
    }

    /* A new incarnation with nothing in it: a fresh TCP identity (peers know
     * the old one as fenced), the same pools, no peers. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t inc = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    if (inc <= old)
        inc = old + 1;
    /* The new transport exists before the old one goes, so that the node
     * always has one (its peers all fenced if it must stay the old one). */
    struct kvf_transport *fresh = node_tcp_create(n, inc, 0);
    if (!fresh) {
        node_log("error", NULL,
                 "self-fence: cannot create a tcp transport for a new incarnation: stopping "
                 "(every peer stays fenced)");
        atomic_store(&n->fatal, -EIO);
        pthread_mutex_lock(&n->qlock);
        pthread_cond_broadcast(&n->qdone);
        pthread_mutex_unlock(&n->qlock);
        return;
    }
    node_faults_unwrap(n);
    kvf_transport_destroy(n->tcp);
    n->tcp = fresh;
    if (n->opts.data_port != 0) {
        /* A fixed data port (firewalls, host ports): take it back. */
        struct kvf_transport *fixed = node_tcp_create(n, inc, n->opts.data_port);
        if (fixed) {
            kvf_transport_destroy(n->tcp);
            n->tcp = fixed;
        } else {
            node_log("warn", NULL, "self-fence: data port %u not free again: using %u",
                     n->opts.data_port, kvf_transport_tcp_port(n->tcp));
        }
    }
    n->data_port = kvf_transport_tcp_port(n->tcp);
    if (node_faults_wrap(n) != 0)
        node_log("error", NULL, "self-fence: fault injection off: out of memory");
    for (uint32_t i = 0; i < n->npools; i++) {
        int rc = node_devpool_add_tcp(n->tcp, &n->pools[i]);
        if (rc != 0)
            node_log("error", NULL, "self-fence: pool %u not re-added to tcp: %s", n->pools[i].id,
                     strerror(-rc));
    }
    node_peers_reset(n);
    /* New keys for the new incarnation: the old pair secrets and the old
     * CURVE key die with it. */
    struct kvf_peer_keypair fresh_keys;
    if (kvf_peer_keypair_generate(&fresh_keys) != 0) {
        node_log("error", NULL, "self-fence: no peer keys for the new incarnation: stopping");
        atomic_store(&n->fatal, -EIO);
        pthread_mutex_lock(&n->qlock);
        pthread_cond_broadcast(&n->qdone);
        pthread_mutex_unlock(&n->qlock);
        return;
    }
    kvf_peer_keypair_wipe(&n->keys);
    n->keys = fresh_keys;
    kvf_peer_keypair_wipe(&fresh_keys);
    n->incarnation = old == inc ? inc + 1 : inc;
    int prc = node_peer_renew(n); /* stamped with the new incarnation */
    if (prc != 0) {
        node_log("error", NULL, "self-fence: peer channel for the new incarnation: %s: stopping",
                 strerror(-prc));
        atomic_store(&n->fatal, prc);
        pthread_mutex_lock(&n->qlock);
        pthread_cond_broadcast(&n->qdone);
        pthread_mutex_unlock(&n->qlock);
    }
    n->welcomed_before = false;
    n->last_contact_ms = 0;
    n->cp_acks_heartbeats = false;
    n->self_fences++;
    /* The host lock names the live incarnation; the old one is witnessed once
     * its lifetimes are all drained (node_session_maybe_witness). */
    n->retired_incarnation = old;
    n->retired_witness_sent = false;
    if (n->host_lock_fd >= 0 && node_host_lock_record(n->host_lock_fd, n->incarnation) != 0)
        node_log("warn", NULL, "self-fence: host lock %s: cannot record incarnation %" PRIu64,
                 n->host_lock_path, n->incarnation);
    node_log("warn", NULL,
             "self-fence: %s: fenced %u peers, closed admission on %zu open lifetimes (%zu not "
             "drained); incarnation %" PRIu64 " is given up, re-attaching as incarnation %" PRIu64
             " with no lifetimes",
             why, fenced, open, undrained, old, n->incarnation);
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

/* Posts a synchronous session job; false when the owner is gone. */
static bool post_session_job(struct kvf_node *n, enum node_job_kind kind,
                             struct kvf_rpc_client_stream *cs)
{
    struct node_job j;
    memset(&j, 0, sizeof j);
    j.kind = kind;
    j.stream = cs;
    j.sync = true;
    return node_post(n, &j) == 0;
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
        if (!post_session_job(n, JOB_SESSION_OPEN, cs)) {
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
            struct node_job *j = calloc(1, sizeof *j);
            if (!j) {
                kvfence__v1__control_message__free_unpacked(cm, NULL);
                continue; /* the control plane re-sends notices */
            }
            j->kind = JOB_CONTROL_MSG;
            j->cm = cm;
            j->stream = cs; /* the owner drops messages of a stream it gave up */
            if (node_post(n, j) != 0)
                node_job_free(j);
        }
        bool owner_alive = post_session_job(n, JOB_SESSION_CLOSED, cs);
        struct kvf_rpc_client_stream *gone = cs; /* never match a later stream at this address */
        atomic_compare_exchange_strong(&n->reset_stream, &gone, NULL);
        kvf_rpc_client_stream_close(cs);
        if (st.code == KVF_GRPC_FAILED_PRECONDITION && st.message[0] &&
            strstr(st.message, "is LOST") && !atomic_load(&n->stopping)) {
            /* This incarnation was declared LOST while we were away: its
             * peers fence it. Never pretend to be it: self-fence and come
             * back as a new incarnation (node.proto, Attach). */
            node_log("warn", NULL, "control plane refused this incarnation: %s", st.message);
            struct node_job j;
            memset(&j, 0, sizeof j);
            j.kind = JOB_SESSION_LOST;
            j.sync = true;
            if (node_post(n, &j) != 0)
                break;
            backoff = BACKOFF_MIN_MS;
            continue;
        }
        if (st.code == KVF_GRPC_FAILED_PRECONDITION) {
            node_log("error", NULL, "control plane refused the node: %s", st.message);
            atomic_store(&n->fatal, -EPERM);
            pthread_mutex_lock(&n->qlock);
            pthread_cond_broadcast(&n->qdone);
            pthread_mutex_unlock(&n->qlock);
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

int node_session_start(struct kvf_node *n)
{
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
