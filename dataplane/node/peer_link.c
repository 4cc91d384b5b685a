/*
 * peer_link.c: kvfence-node's use of the ZeroMQ peer channel
 * (dataplane/peer): the source side sends AuxData then TransferStatus to the
 * sink node when a (source rank, sink rank) pair ended; the sink side admits
 * envelopes against its room map and hands the delivered ones to the owner
 * thread, which turns them into Watch events and sink completion. It also
 * carries ChunkNotice (an RDMA chunk landed, rdma_link.c) and the RDMA link
 * messages, which the channel thread only packs into jobs for the owner.
 *
 * DESIGN (threads): the channel's callbacks run on the channel's own thread.
 * Admission (peer_accept) reads the room map under rooms_lock (read), like
 * the TCP receivers' check: ACCEPT for a room with members whose admission is
 * open here and whose members include the sender's node id and incarnation;
 * LATE for a room this node closed (aborting, completed, drained) or an older
 * generation of an id it knows; UNKNOWN otherwise (a stranger, or a room not
 * known here). The control plane introduces every peer of a room in the
 * node's first update and tells a source the sink's pages only after the
 * sink's node acknowledged that update, so a sender never knows a room
 * before this node does: an envelope for a room not known here is a
 * protocol violation, dropped at once, and the owner fails the room
 * (TransferFailed). Nothing waits for an update.
 * A delivered envelope is copied into a job (peer_msg_run); the owner checks the
 * room again (it may have been aborted meanwhile: then nothing reaches Watch).
 * An OUT_OF_ORDER drop (a lost message) becomes a job (peer_gap_run): the owner
 * reports TransferFailed for the room. When a room's lifetime drained the
 * owner asks the channel to forget its sequence state (room_drained, node.c).
 *
 * Pairs: chunk_seq, last_chunk and aux are per (source rank, sink rank)
 * (node.proto SubmitChunkRequest). A pair's AuxData (when its last chunk
 * carried aux bytes) and TransferStatus go out once its last chunk and every
 * earlier chunk completed, in that order, on the channel (one sequence per
 * room and node pair, so the sink sees them in that order). A failed chunk
 * sends TransferStatus ok=false at once. Nothing is sent for an aborting
 * room. A send the channel refuses (no PEER_ZMQ endpoint known for the sink,
 * queue full) fails the transfer: the sink could never complete without it.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/crypto.h>

#include "kvf_error.h"
#include "control_session.h"
#include "node_log.h"
#include "node_owner.h"
#include "node_types.h"
#include "peer_link.h"
#include "watch.h"
#include "rdma_link.h"
#include "tcp.h"

static void done_pending_free(struct node_room *r);

/* ---- channel callbacks (channel thread) ----------------------------------------- */

/* One look at the room map; *unseen: the room is not in it yet (its update
 * may still be on its way). */
static enum kvf_peer_verdict verdict_of(struct kvf_node *n, kvf_room_key key, const char *sender,
                                        uint64_t sender_incarnation, bool *unseen)
{
    enum kvf_peer_verdict v = KVF_PEER_UNKNOWN;
    *unseen = false;
    pthread_rwlock_rdlock(&n->rooms_lock);
    struct node_room *r = node_room_find(n, key);
    if (!r) {
        *unseen = true;
        /* A newer generation of the id is known here: this one is over. */
        for (struct node_room *o = n->rooms; o; o = o->next)
            if (o->key.room_id == key.room_id && o->key.generation > key.generation) {
                v = KVF_PEER_LATE;
                *unseen = false;
            }
    } else if (r->peer_closed) {
        v = KVF_PEER_LATE;
    } else if (r->have_update) {
        /* A member, or a node the update introduced (its members may be
         * published here after its first envelope). */
        for (size_t i = 0; i < r->nmembers; i++)
            if (r->members[i].incarnation == sender_incarnation &&
                strcmp(r->members[i].node_id, sender) == 0)
                v = KVF_PEER_ACCEPT;
        for (size_t i = 0; i < r->nintro; i++)
            if (r->intro[i].incarnation == sender_incarnation &&
                strcmp(r->intro[i].node_id, sender) == 0)
                v = KVF_PEER_ACCEPT;
    } else {
        /* Published by the owner's RoomUpdate, its members not yet: the
         * update is under way (dropping here lost a message: a gap). */
        *unseen = true;
    }
    pthread_rwlock_unlock(&n->rooms_lock);
    return v;
}

/* ---- jobs for the owner thread ------------------------------------------------------ */

/* A delivered envelope (peer_msg_run), a link message (peer_link_run) or a
 * message lost or refused (peer_gap_run), for the owner thread. */
struct peer_job {
    kvf_room_key room;
    uint32_t member;          /* a gap: the sink rank, for the report */
    struct node_peer_msg *pm; /* owned (a gap: may be NULL); NULL once the owner kept it */
};

static void peer_msg_run(struct kvf_node *n, void *arg);
static void peer_gap_run(struct kvf_node *n, void *arg);

/* The RDMA link takes link messages (node.c set n->link_msg_in). */
static void peer_link_run(struct kvf_node *n, void *arg)
{
    const struct peer_job *a = arg;
    n->link_msg_in(n, a->pm);
}

static void peer_job_free(void *arg)
{
    struct peer_job *a = arg;
    free(a->pm);
    free(a);
}

/* A job of `run` with a new argument; NULL when out of memory. */
static struct node_job *peer_job_new(void (*run)(struct kvf_node *n, void *arg), kvf_room_key room,
                                     uint32_t member, struct node_peer_msg *pm)
{
    struct peer_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(run, a, peer_job_free) : NULL;
    if (!j) {
        free(a);
        return NULL;
    }
    a->room = room;
    a->member = member;
    a->pm = pm;
    return j;
}

/* One look, no wait (see the top of this file): a room not known here
 * fails at once. */
static enum kvf_peer_verdict peer_accept(void *ctx, kvf_room_key key, const char *sender,
                                         uint64_t sender_incarnation)
{
    struct kvf_node *n = ctx;
    bool unseen;
    enum kvf_peer_verdict v = verdict_of(n, key, sender, sender_incarnation, &unseen);
    if (unseen && v == KVF_PEER_UNKNOWN && !atomic_load(&n->peer_stopping)) {
        struct node_peer_msg *pm = calloc(1, sizeof *pm + 1);
        struct node_job *j = pm ? peer_job_new(peer_gap_run, key, 0, pm) : NULL;
        if (!j) {
            free(pm);
            return v;
        }
        snprintf(pm->sender, sizeof pm->sender, "%s", sender);
        snprintf(pm->error, sizeof pm->error,
                 "peer channel: a message from %s for a room this node does not know: refused "
                 "(protocol violation)",
                 sender);
        if (node_post(n, j) != 0)
            node_job_free(j);
    }
    return v;
}

static void peer_on_message(void *ctx, const Kvfence__V1__PeerEnvelope *env)
{
    struct kvf_node *n = ctx;
    kvf_room_key key = {env->room->room_id, env->room->generation};
    size_t len = 0;
    if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA)
        len = env->aux_data->data.len;
    else if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE)
        len = env->chunk_notice->n_sink_ranges * sizeof(struct node_range);
    else if (env->body_case != KVFENCE__V1__PEER_ENVELOPE__BODY_TRANSFER_STATUS)
        return; /* StagingWatermark: not used in this version */
    struct node_peer_msg *pm = calloc(1, sizeof *pm + (len ? len : 1));
    struct node_job *j = pm ? peer_job_new(peer_msg_run, key, 0, pm) : NULL;
    if (!j) {
        free(pm);
        node_log("error", &key, "out of memory for a peer message from %s: lost",
                 env->sender_node_id);
        return;
    }
    pm->room = key;
    snprintf(pm->sender, sizeof pm->sender, "%s", env->sender_node_id);
    pm->sender_incarnation = env->sender_incarnation;
    pm->body = (int)env->body_case;
    if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA) {
        const Kvfence__V1__AuxData *a = env->aux_data;
        pm->source_rank = a->source_rank;
        pm->sink_rank = a->sink_rank;
        pm->chunk_seq = a->chunk_seq;
        pm->len = len;
        if (len)
            memcpy(pm->data, a->data.data, len);
    } else if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE) {
        const Kvfence__V1__ChunkNotice *c = env->chunk_notice;
        pm->source_rank = c->source_rank;
        pm->sink_rank = c->sink_rank;
        pm->chunk_seq = c->chunk_seq;
        pm->pool_id = c->sink_pool_id;
        pm->transport = (int)c->transport;
        pm->bytes = c->length;
        struct node_range *rv = (struct node_range *)(void *)pm->data;
        for (size_t i = 0; i < c->n_sink_ranges; i++)
            rv[i] = (struct node_range){c->sink_ranges[i]->first, c->sink_ranges[i]->count};
        pm->len = len;
    } else {
        const Kvfence__V1__TransferStatus *t = env->transfer_status;
        pm->source_rank = t->source_rank;
        pm->sink_rank = t->sink_rank;
        pm->ok = t->ok;
        pm->chunks = t->chunks;
        pm->last_chunk_seq = t->last_chunk_seq;
        pm->bytes = t->bytes;
        snprintf(pm->error, sizeof pm->error, "%s", t->error ? t->error : "");
    }
    if (node_post(n, j) != 0)
        node_job_free(j); /* stopping */
}

/* A link message (RDMA queue pairs and pools, rdma_link.c): packed again
 * for the owner thread, which alone drives the RDMA transport. */
static void peer_on_link(void *ctx, const Kvfence__V1__LinkMessage *msg)
{
    struct kvf_node *n = ctx;
    size_t len = kvfence__v1__link_message__get_packed_size(msg);
    struct node_peer_msg *pm = calloc(1, sizeof *pm + (len ? len : 1));
    struct node_job *j = pm ? peer_job_new(peer_link_run, (kvf_room_key){0, 0}, 0, pm) : NULL;
    if (!j) {
        free(pm);
        node_log("error", NULL, "out of memory for a link message: lost");
        return;
    }
    snprintf(pm->sender, sizeof pm->sender, "%s", msg->sender_node_id ? msg->sender_node_id : "");
    pm->sender_incarnation = msg->sender_incarnation;
    pm->len = kvfence__v1__link_message__pack(msg, pm->data);
    if (node_post(n, j) != 0)
        node_job_free(j);
}

static uint32_t sink_rank_of(const Kvfence__V1__PeerEnvelope *env)
{
    if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA)
        return env->aux_data->sink_rank;
    if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_TRANSFER_STATUS)
        return env->transfer_status->sink_rank;
    if (env->body_case == KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE)
        return env->chunk_notice->sink_rank;
    return 0;
}

static void peer_on_drop(void *ctx, enum kvf_peer_drop_reason reason,
                         const Kvfence__V1__PeerEnvelope *env)
{
    struct kvf_node *n = ctx;
    kvf_room_key key = {0, 0};
    if (env && env->room)
        key = (kvf_room_key){env->room->room_id, env->room->generation};
    node_log(reason == KVF_PEER_DROP_LATE ? "info" : "warn", env ? &key : NULL,
             "peer channel: dropped a message from %s: %s",
             env && env->sender_node_id ? env->sender_node_id : "?",
             kvf_peer_drop_reason_name(reason));
    if (reason != KVF_PEER_DROP_OUT_OF_ORDER || !env)
        return;
    struct node_peer_msg *pm = calloc(1, sizeof *pm + 1);
    /* The sink rank, for the report. */
    struct node_job *j = peer_job_new(peer_gap_run, key, sink_rank_of(env), pm);
    if (!j) {
        free(pm);
        return;
    }
    if (pm)
        snprintf(pm->sender, sizeof pm->sender, "%s",
                 env->sender_node_id ? env->sender_node_id : "?");
    if (node_post(n, j) != 0)
        node_job_free(j);
}

/* ---- start / stop ------------------------------------------------------------------ */

/* "drop_nth=N,duplicate_nth=N,delay_nth=N,delay_after=M" -> *f. */
static int parse_fault(const char *s, struct kvf_peer_fault *f)
{
    memset(f, 0, sizeof *f);
    while (s && *s) {
        const char *eq = strchr(s, '=');
        if (!eq)
            return -EINVAL;
        char *end;
        unsigned long long v = strtoull(eq + 1, &end, 10);
        if (end == eq + 1 || (*end && *end != ','))
            return -EINVAL;
        size_t kl = (size_t)(eq - s);
        if (kl == 8 && strncmp(s, "drop_nth", kl) == 0)
            f->drop_nth = v;
        else if (kl == 13 && strncmp(s, "duplicate_nth", kl) == 0)
            f->duplicate_nth = v;
        else if (kl == 9 && strncmp(s, "delay_nth", kl) == 0)
            f->delay_nth = v;
        else if (kl == 11 && strncmp(s, "delay_after", kl) == 0 && v <= UINT32_MAX)
            f->delay_after = (uint32_t)v;
        else
            return -EINVAL;
        s = *end ? end + 1 : end;
    }
    if (f->delay_nth && !f->delay_after)
        f->delay_after = 1;
    return 0;
}

int node_peer_start(struct kvf_node *n)
{
    struct kvf_peer_channel_opts o;
    kvf_peer_channel_opts_init(&o);
    if (parse_fault(n->opts.peer_fault, &o.fault) != 0) {
        node_log("error", NULL,
                 "peer fault \"%s\": want drop_nth=N,duplicate_nth=N,delay_nth=N,delay_after=M",
                 n->opts.peer_fault);
        return -EINVAL;
    }
    char bind[96];
    snprintf(bind, sizeof bind, "tcp://%s:%u", n->data_host, n->opts.peer_port);
    o.node_id = n->node_id;
    o.incarnation = n->incarnation;
    o.public_key = n->keys.pub;
    o.secret_key = n->keys.sec;
    o.bind_endpoint = bind;
    o.on_message = peer_on_message;
    o.accept = peer_accept;
    o.on_drop = peer_on_drop;
    o.on_link = peer_on_link;
    o.ctx = n;
    n->peerch = kvf_peer_channel_create(&o);
    if (!n->peerch) {
        node_log("error", NULL, "peer channel: cannot bind %s", bind);
        return -EIO;
    }
    snprintf(n->peer_ep, sizeof n->peer_ep, "%s", kvf_peer_channel_endpoint(n->peerch));
    /* Same-node rooms: the node sends its aux and status to itself. */
    int rc = kvf_peer_channel_introduce(n->peerch, n->node_id, n->incarnation, n->keys.pub);
    if (rc != 0) {
        node_log("error", NULL, "peer channel: cannot introduce this node to itself: %s",
                 strerror(-rc));
        kvf_peer_channel_destroy(n->peerch);
        n->peerch = NULL;
        return rc;
    }
    if (n->opts.peer_fault && n->opts.peer_fault[0])
        node_log("warn", NULL, "peer channel fault injection on: %s", n->opts.peer_fault);
    return 0;
}

void node_peer_stop(struct kvf_node *n)
{
    if (!n->peerch)
        return;
    atomic_store(&n->peer_stopping, true); /* no admission waits from now on */
    struct kvf_peer_stats st;
    kvf_peer_channel_stats(n->peerch, &st);
    node_log("info", NULL,
             "peer channel: %" PRIu64 " sent, %" PRIu64 " delivered, %" PRIu64 " late, %" PRIu64
             " unknown, %" PRIu64 " out of order, %" PRIu64 " discarded, %" PRIu64
             " unauthenticated, %" PRIu64 " connections refused (not an introduced key)",
             st.sent, st.delivered, st.late, st.unknown, st.out_of_order, st.discarded,
             st.unauthenticated, st.zap_refused);
    kvf_peer_channel_destroy(n->peerch);
    n->peerch = NULL;
}

int node_peer_renew(struct kvf_node *n)
{
    if (!n->peerch)
        return 0;
    /* The channel stamps every envelope with this node's incarnation and
     * accepts only envelopes addressed to it: a new incarnation needs a new
     * channel. Nothing of the old one is worth keeping (its rooms closed). */
    atomic_store(&n->peer_stopping, true); /* no admission waits from now on */
    kvf_peer_channel_destroy(n->peerch);
    n->peerch = NULL;
    n->peer_ep[0] = '\0';
    atomic_store(&n->peer_stopping, false);
    return node_peer_start(n);
}

/*
 * The peer's key, as the control plane introduced it (PeerNode.peer_key, from
 * the peer's Hello): its pair secret goes to the TCP transport and its public
 * key to the peer channel, so both admit this incarnation and nobody else.
 * One key per incarnation: a different one later is refused and logged (the
 * first stays). Without a key the peer cannot be reached, nor reach us.
 */
static void peer_introduce(struct kvf_node *n, struct node_peer *p, const Kvfence__V1__PeerNode *pn)
{
    if (pn->peer_key.len != KVF_PEER_KEY_SIZE) {
        if (!p->have_key)
            node_log("warn", NULL,
                     "peer %s incarnation %" PRIu64 " has no peer key (%zu bytes): not reachable",
                     p->node_id, p->incarnation, pn->peer_key.len);
        return;
    }
    if (p->have_key) {
        if (memcmp(p->key, pn->peer_key.data, KVF_PEER_KEY_SIZE) != 0)
            node_log("error", NULL,
                     "peer %s incarnation %" PRIu64 ": another peer key than before: ignored",
                     p->node_id, p->incarnation);
        return;
    }
    uint8_t secret[KVF_TCP_SECRET_SIZE];
    int rc = kvf_peer_pair_secret(&n->keys, pn->peer_key.data, secret);
    if (rc == 0)
        rc = kvf_transport_tcp_set_peer_key(n->tcp, (uint32_t)(p - n->peers), secret);
    OPENSSL_cleanse(secret, sizeof secret);
    if (rc == 0 && n->peerch)
        rc = kvf_peer_channel_introduce(n->peerch, p->node_id, p->incarnation, pn->peer_key.data);
    if (rc != 0) {
        node_log("error", NULL, "peer %s incarnation %" PRIu64 ": cannot introduce it: %s",
                 p->node_id, p->incarnation, strerror(-rc));
        return;
    }
    memcpy(p->key, pn->peer_key.data, KVF_PEER_KEY_SIZE);
    p->have_key = true;
}

void node_peer_learn(struct kvf_node *n, struct node_peer *p, const Kvfence__V1__PeerNode *pn)
{
    for (size_t e = 0; e < pn->n_endpoints; e++) {
        const Kvfence__V1__Endpoint *ep = pn->endpoints[e];
        if (ep->kind == KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ && ep->address &&
            strlen(ep->address) < sizeof p->peer_ep)
            snprintf(p->peer_ep, sizeof p->peer_ep, "%s", ep->address);
    }
    peer_introduce(n, p, pn);
}

void node_peer_close_room(struct kvf_node *n, struct node_room *r)
{
    done_pending_free(r); /* aborting, or every local sink flushed its own */
    if (r->peer_closed)
        return;
    pthread_rwlock_wrlock(&n->rooms_lock);
    r->peer_closed = true;
    pthread_rwlock_unlock(&n->rooms_lock);
}

/* ---- sink side (owner) ------------------------------------------------------------- */

/* A delivered envelope for a local sink. */
static void peer_msg_run(struct kvf_node *n, void *arg)
{
    struct peer_job *j = arg;
    const struct node_peer_msg *pm = j->pm;
    struct node_room *r = node_room_find(n, pm->room);
    /* Aborted (or closed) since the channel admitted it: nothing reaches Watch. */
    if (!r || r->core.aborting || kvf_lt_state(r->core.lt) != KVF_LT_OPEN) {
        node_log("info", &pm->room, "peer message from %s dropped: the room is closed here",
                 pm->sender);
        return;
    }
    struct node_member *m = node_local_sink(r, pm->sink_rank);
    if (!m) {
        node_log("warn", &pm->room, "peer message from %s for sink rank %u: no such sink here",
                 pm->sender, pm->sink_rank);
        return;
    }
    if (pm->body == KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE) {
        n->chunk_notice_in(n, r, m, pm); /* the RDMA link's (node.c set it) */
        return;
    }
    if (pm->body == KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA) {
        node_watch_aux(n, r, pm);
        return;
    }
    node_log(pm->ok ? "info" : "warn", &pm->room,
             "transfer status from %s rank %u to rank %u: %s, %" PRIu64 " chunks, %" PRIu64
             " bytes%s%s",
             pm->sender, pm->source_rank, pm->sink_rank, pm->ok ? "ok" : "failed", pm->chunks,
             pm->bytes, pm->error[0] ? ": " : "", pm->error);
    if (!pm->ok) {
        node_watch_transfer_done(n, r, pm);
        return;
    }
    /* transfer_done ok promises that every chunk arrived: it waits until the
     * sink's landed bytes cover its lease and are all accounted for (the
     * frames of one node pair share one ordered TCP connection, but a status
     * does not say which landed bytes are its own). */
    m->status_bytes += pm->bytes;
    struct node_peer_msg **tail = &r->done_pending;
    while (*tail)
        tail = &(*tail)->next;
    *tail = j->pm;
    j->pm = NULL; /* the room's now */
    node_check_sink_complete(n, r, m);
}

void node_peer_sink_done(struct kvf_node *n, struct node_room *r, const struct node_member *m)
{
    struct node_peer_msg **pp = &r->done_pending;
    while (*pp) {
        struct node_peer_msg *pm = *pp;
        if (pm->sink_rank != m->rank) {
            pp = &pm->next;
            continue;
        }
        *pp = pm->next;
        node_watch_transfer_done(n, r, pm);
        free(pm);
    }
}

static void done_pending_free(struct node_room *r)
{
    while (r->done_pending) {
        struct node_peer_msg *pm = r->done_pending;
        r->done_pending = pm->next;
        free(pm);
    }
}

/* A message lost (sequence gap) or for a room not known here. */
static void peer_gap_run(struct kvf_node *n, void *arg)
{
    const struct peer_job *j = arg;
    if (j->pm && j->pm->error[0]) { /* an envelope for a room not known here */
        node_fail_unknown_room(n, j->room, j->pm->error);
        return;
    }
    struct node_room *r = node_room_find(n, j->room);
    if (!r)
        return;
    char why[200];
    snprintf(why, sizeof why, "peer channel: a message from %s was lost (sequence gap)",
             j->pm ? j->pm->sender : "?");
    node_session_send_transfer_failed(n, r, j->member, KVFENCE__V1__ROLE__ROLE_SINK, why);
}

/* ---- source side (owner) ----------------------------------------------------------- */

struct node_pair *node_pair_get(struct node_room *r, uint32_t src_rank,
                                const struct node_member *sink, bool create)
{
    for (struct node_pair *p = r->pairs; p; p = p->next)
        if (p->src_rank == src_rank && p->sink_rank == sink->rank &&
            strcmp(p->sink_node, sink->node_id) == 0)
            return p;
    if (!create)
        return NULL;
    struct node_pair *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->src_rank = src_rank;
    p->sink_rank = sink->rank;
    snprintf(p->sink_node, sizeof p->sink_node, "%s", sink->node_id);
    p->sink_incarnation = sink->incarnation;
    p->next = r->pairs;
    r->pairs = p;
    return p;
}

bool node_pairs_done(const struct node_room *r, uint32_t rank)
{
    bool any = false;
    for (const struct node_pair *p = r->pairs; p; p = p->next) {
        if (p->src_rank != rank)
            continue;
        if (!p->status_sent || p->failed)
            return false;
        any = true;
    }
    return any;
}

void node_pairs_free(struct node_room *r)
{
    struct node_pair *p = r->pairs;
    while (p) {
        struct node_pair *next = p->next;
        free(p->aux);
        free(p);
        p = next;
    }
    r->pairs = NULL;
    done_pending_free(r);
}

static const char *sink_endpoint(struct kvf_node *n, const struct node_pair *p)
{
    /* A sink on this node: through our own channel, so that aux and status
     * take the same ordered, admitted path as from any other node. */
    if (p->sink_incarnation == n->incarnation && strcmp(p->sink_node, n->node_id) == 0)
        return n->peer_ep[0] ? n->peer_ep : NULL;
    for (uint32_t i = 0; i < n->npeers; i++)
        if (n->peers[i].incarnation == p->sink_incarnation &&
            strcmp(n->peers[i].node_id, p->sink_node) == 0)
            return n->peers[i].peer_ep[0] ? n->peers[i].peer_ep : NULL;
    return NULL;
}

int node_peer_send_env(struct kvf_node *n, struct node_room *r, const struct node_pair *p,
                       Kvfence__V1__PeerEnvelope *env)
{
    const char *ep = sink_endpoint(n, p);
    if (!ep)
        return -EHOSTUNREACH;
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = r->key.room_id;
    k.generation = r->key.generation;
    env->room = &k;
    env->receiver_node_id = (char *)p->sink_node;
    env->receiver_incarnation = p->sink_incarnation;
    return kvf_peer_send(n->peerch, ep, env);
}

void node_pair_chunk_done(struct kvf_node *n, struct node_room *r, struct node_pair *p,
                          uint64_t seq, bool ok, const char *error)
{
    (void)seq;
    if (p->open)
        p->open--;
    if (!ok && !p->failed) {
        p->failed = true;
        snprintf(p->error, sizeof p->error, "%s", error ? error : "chunk failed");
    }
    if (p->status_sent || r->core.aborting || !n->peerch)
        return;
    if (!p->failed && !(p->last_submitted && p->open == 0))
        return;
    p->status_sent = true; /* one status per pair, whatever happens below */
    int rc = 0;
    if (!p->failed && p->aux_len) {
        Kvfence__V1__AuxData a = KVFENCE__V1__AUX_DATA__INIT;
        a.source_rank = p->src_rank;
        a.sink_rank = p->sink_rank;
        a.chunk_seq = p->last_seq;
        a.data.data = p->aux;
        a.data.len = p->aux_len;
        Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
        env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA;
        env.aux_data = &a;
        rc = node_peer_send_env(n, r, p, &env);
    }
    free(p->aux);
    p->aux = NULL;
    if (rc == 0) {
        Kvfence__V1__TransferStatus t = KVFENCE__V1__TRANSFER_STATUS__INIT;
        t.source_rank = p->src_rank;
        t.sink_rank = p->sink_rank;
        t.ok = !p->failed;
        t.chunks = p->chunks;
        t.last_chunk_seq = p->last_seq;
        t.bytes = p->bytes;
        t.error = p->failed ? p->error : (char *)"";
        Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
        env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_TRANSFER_STATUS;
        env.transfer_status = &t;
        rc = node_peer_send_env(n, r, p, &env);
    }
    if (rc != 0 && !p->failed) {
        /* Without the status the sink can never complete: fail the transfer. */
        p->failed = true;
        char why[sizeof p->error + NODE_ID_MAX + 64];
        snprintf(p->error, sizeof p->error, "%s",
                 rc == -EHOSTUNREACH ? "no PEER_ZMQ endpoint announced" : strerror(-rc));
        snprintf(why, sizeof why, "peer channel: cannot send aux/status to %s: %s", p->sink_node,
                 p->error);
        node_session_send_transfer_failed(n, r, p->src_rank, KVFENCE__V1__ROLE__ROLE_SOURCE, why);
    }
}
