/*
 * node_svc.c: the node session (kvfence.v1.NodeSession/Attach) and the
 * engines' release stream (kvfence.v1.Control/WatchLeases), and the routing of
 * the state core's effects to them.
 *
 * A node holds one bidirectional Attach stream. Its first message is Hello:
 * the state thread attaches the node in the core (versions and features
 * negotiated there; an incompatible node is refused with FAILED_PRECONDITION
 * and the stream ends) and answers Welcome. After that the node's reports
 * (Drained, Completed, TransferFailed, PeerFenced, PoolUpdate) go into the
 * core, and the core's effects addressed to the node (RoomUpdate, AbortNotice,
 * FencePeer) go out on its stream. The core decides when a notice is re-sent
 * (backoff with jitter, and at once on re-attach); this file only delivers
 * what the core emits, and drops what is addressed to a node without a
 * session. When a stream ends, the node is detached in the core (SUSPECT; its
 * ttl starts there). A newer session of the same node replaces the older one,
 * which is finished with ABORTED.
 *
 * WatchLeases streams get every LeaseEvent.released that matches their filter
 * (node, ranks, lease ids) and, when asked, every room state change.
 *
 * DESIGN: stream callbacks run on CQ threads. They decode messages there and
 * post jobs to the state thread; the session registry, the watcher list and
 * the core are touched by the state thread alone. A session is reference
 * counted: one reference for its stream (dropped by the job that handles the
 * stream's end) and one while it is in the registry. Jobs of one stream run
 * in the order its callbacks posted them (the job queue is FIFO and the
 * callbacks of one stream never run concurrently), so the end-of-stream job is
 * the last one to touch a session through its stream.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cp_map.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_server.h"
#include "service_internal.h"
#include "kvf_clock.h"

#define HEARTBEAT_INTERVAL_MS 1000u

struct node_sess {
    atomic_int refs;
    _Atomic uint64_t last_seen_ns; /* CLOCK_MONOTONIC of the last message (CQ threads) */
    struct kvf_svc *svc;
    struct kvf_rpc_stream *stream; /* one stream reference, released at free */
    /* State thread only: */
    bool attached; /* Hello accepted: in the registry */
    bool replaced; /* a newer session of the node took over */
    bool closed;   /* the stream ended */
    char node_id[129];
    uint64_t incarnation;
    /* With mutual TLS: the node the client certificate names; a Hello for
     * any other node id is refused. Empty without mutual TLS. Set at open. */
    char cert_node_id[KVF_AUTHZ_NODE_ID_MAX + 1];
    Kvfence__V1__Hello *hello; /* endpoints and capabilities, for peers' room updates */
    struct node_sess *next;    /* in the registry */
};

struct lease_watch {
    struct kvf_rpc_stream *stream; /* one stream reference */
    Kvfence__V1__WatchLeasesRequest *rq;
    bool closed;
    /* In the registry's list, which then owns it: set by the state thread,
     * read by watch_job_drop only once the state thread has stopped. */
    bool listed;
    struct lease_watch *next;
};

struct kvf_svc_sessions {
    struct node_sess *nodes;     /* attached sessions, one per node id */
    struct kvf_map by_id;        /* node id -> its session in `nodes` */
    struct lease_watch *watches; /* open WatchLeases streams */
    char (*resync_asked)[129];   /* node ids sent a ResyncRequest since recovery */
    size_t nresync_asked;
};

/*
 * Notice ids are derived from what the notice is about, so that a re-send
 * carries the same id with a higher attempt (node.proto): the top two bits say
 * the kind, the rest is the room generation (room updates, abort notices; a
 * generation is unique per room) or a hash of the fenced node and incarnation.
 */
#define NOTICE_ROOM_UPDATE (1ull << 62)
#define NOTICE_ABORT       (2ull << 62)
#define NOTICE_FENCE       (3ull << 62)
#define NOTICE_VALUE_MASK  ((1ull << 62) - 1)

static uint64_t fence_notice_id(const char *node_id, uint64_t incarnation)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)node_id; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    for (int i = 0; i < 8; i++)
        h = (h ^ ((incarnation >> (8 * i)) & 0xff)) * 1099511628211ull;
    return NOTICE_FENCE | (h & NOTICE_VALUE_MASK);
}

/* ---- sessions ------------------------------------------------------------ */

static void sess_unref(struct node_sess *s)
{
    if (atomic_fetch_sub(&s->refs, 1) != 1)
        return;
    if (s->hello != NULL)
        protobuf_c_message_free_unpacked(&s->hello->base, NULL);
    kvf_rpc_stream_unref(s->stream);
    free(s);
}

/* Per node message and per participant of a room update: a hash lookup, not
 * a walk of every attached node. */
static struct node_sess *registry_find(struct kvf_svc_sessions *reg, const char *node_id)
{
    return cp_map_get_str(&reg->by_id, node_id);
}

static void registry_remove(struct kvf_svc_sessions *reg, struct node_sess *gone)
{
    for (struct node_sess **pp = &reg->nodes; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == gone) {
            *pp = gone->next;
            if (cp_map_get_str(&reg->by_id, gone->node_id) == gone)
                (void)cp_map_del_str(&reg->by_id, gone->node_id);
            gone->attached = false;
            sess_unref(gone);
            return;
        }
    }
}

/* Packs and queues one ControlMessage on a session's stream. */
static void sess_send(struct node_sess *s, const Kvfence__V1__ControlMessage *cm)
{
    size_t len = protobuf_c_message_get_packed_size(&cm->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        kvf_log("error", "node %s: out of memory packing a message; the core will re-send",
                s->node_id);
        return;
    }
    protobuf_c_message_pack(&cm->base, buf);
    kvf_rpc_stream_send(s->stream, buf, len);
    free(buf);
}

/* ---- building room updates ------------------------------------------------ */

struct room_update_buf {
    Kvfence__V1__ControlMessage cm;
    Kvfence__V1__RoomUpdate ru;
    Kvfence__V1__RoomKey key;
    size_t nmembers, npeers;
    Kvfence__V1__RoomMember *mv;
    Kvfence__V1__RoomMember **mp;
    Kvfence__V1__Pool *pv;
    struct kvf_svc_lease_buf *lb;
    Kvfence__V1__PeerNode *peerv;
    Kvfence__V1__PeerNode **peerp;
};

/* One PeerNode per distinct node other than the addressee, with what its
 * Hello said. */
static void add_peer(struct room_update_buf *b, struct kvf_svc_ctx *ctx,
                     const struct kvf_cps_participant_view *pv, const char *addressee)
{
    bool seen = strcmp(pv->node_id, addressee) == 0;
    for (size_t k = 0; k < b->npeers && !seen; k++)
        seen = strcmp(b->peerv[k].node_id, pv->node_id) == 0;
    if (seen)
        return;
    Kvfence__V1__PeerNode *p = &b->peerv[b->npeers];
    kvfence__v1__peer_node__init(p);
    p->node_id = (char *)pv->node_id;
    p->incarnation = pv->incarnation;
    struct node_sess *s = registry_find(ctx->sessions, pv->node_id);
    if (s != NULL && s->incarnation == pv->incarnation && s->hello != NULL) {
        p->n_endpoints = s->hello->n_endpoints;
        p->endpoints = s->hello->endpoints;
        p->capabilities = s->hello->capabilities;
        /* The introduction (docs/security.md, "Data channels"): the
         * addressee admits this incarnation on its data channels by this
         * public key alone. Kept with the session only, never logged to
         * disk: every incarnation says it again in its Hello. */
        p->peer_key = s->hello->peer_key;
    }
    b->peerp[b->npeers++] = p;
}

static void room_update_free(struct room_update_buf *b)
{
    for (size_t i = 0; b->lb != NULL && i < b->nmembers; i++)
        kvf_svc_lease_free(&b->lb[i]);
    free(b->mv);
    free(b->mp);
    free(b->pv);
    free(b->lb);
    free(b->peerv);
    free(b->peerp);
}

/* The room's leases and the endpoints of its nodes other than `addressee`,
 * as RoomUpdate `version`. The addressee's own leases go in whole; another
 * node's only as far as that node acknowledged them (the core's `published`):
 * the order that makes a frame for pages its receiver does not know a
 * protocol violation (docs/state-cores.md, "Ordered room updates"). Every
 * other node is introduced (PeerNode) from the first update on. */
static int room_update_build(struct room_update_buf *b, struct kvf_svc_ctx *ctx, kvf_room_key key,
                             const char *addressee, uint64_t addressee_incarnation,
                             uint64_t version)
{
    memset(b, 0, sizeof(*b));
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(ctx->cps, key, &v) != 0)
        return -ENOENT;
    size_t n = v.participant_count;
    b->mv = calloc(n ? n : 1, sizeof(*b->mv));
    b->mp = calloc(n ? n : 1, sizeof(*b->mp));
    b->pv = calloc(n ? n : 1, sizeof(*b->pv));
    b->lb = calloc(n ? n : 1, sizeof(*b->lb));
    b->peerv = calloc(n ? n : 1, sizeof(*b->peerv));
    b->peerp = calloc(n ? n : 1, sizeof(*b->peerp));
    if (!b->mv || !b->mp || !b->pv || !b->lb || !b->peerv || !b->peerp)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        struct kvf_cps_participant_view pv;
        if (kvf_cps_room_participant(ctx->cps, v.key, i, &pv) != 0)
            continue;
        bool own = strcmp(pv.node_id, addressee) == 0 && pv.incarnation == addressee_incarnation;
        if (!own && !pv.published) {
            add_peer(b, ctx, &pv, addressee);
            continue;
        }
        if (!own)
            pv.range_count = pv.published_range_count;
        if (kvf_svc_lease_fill(&b->lb[b->nmembers], v.key, &pv) != 0)
            return -ENOMEM;
        Kvfence__V1__RoomMember *m = &b->mv[b->nmembers];
        kvfence__v1__room_member__init(m);
        kvfence__v1__pool__init(&b->pv[b->nmembers]);
        b->pv[b->nmembers].pool_id = pv.pool_id;
        /* A source sizes its frames by the sink pool's pages (node.proto). */
        b->pv[b->nmembers].page_size = pv.pool_page_size;
        b->pv[b->nmembers].page_count = pv.pool_page_count;
        m->lease = &b->lb[b->nmembers].lease;
        m->pool = &b->pv[b->nmembers];
        m->node_incarnation = pv.incarnation;
        b->mp[b->nmembers] = m;
        b->nmembers++;
        add_peer(b, ctx, &pv, addressee);
    }
    kvfence__v1__control_message__init(&b->cm);
    kvfence__v1__room_update__init(&b->ru);
    kvfence__v1__room_key__init(&b->key);
    b->key.room_id = v.key.room_id;
    b->key.generation = v.key.generation;
    b->ru.notice_id = NOTICE_ROOM_UPDATE | (v.key.generation & NOTICE_VALUE_MASK);
    b->ru.room = &b->key;
    b->ru.state = (Kvfence__V1__RoomState)v.state;
    b->ru.protocol_version = v.protocol_version;
    b->ru.n_members = b->nmembers;
    b->ru.members = b->mp;
    b->ru.n_peers = b->npeers;
    b->ru.peers = b->peerp;
    b->ru.version = version;
    b->cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE;
    b->cm.room_update = &b->ru;
    return 0;
}

static void send_room_update(struct kvf_svc_ctx *ctx, struct node_sess *s, kvf_room_key key,
                             uint64_t version)
{
    struct room_update_buf b;
    int rc = room_update_build(&b, ctx, key, s->node_id, s->incarnation, version);
    if (rc == 0)
        sess_send(s, &b.cm);
    else if (rc == -ENOMEM)
        kvf_log("error", "room %" PRIu64 ":%" PRIu64 ": out of memory building its update for %s",
                key.room_id, key.generation, s->node_id);
    room_update_free(&b);
}

/* ---- effects --------------------------------------------------------------- */

static struct node_sess *addressee(struct kvf_svc_ctx *ctx, const struct kvf_cps_effect *e)
{
    struct node_sess *s = registry_find(ctx->sessions, e->node_id);
    if (s == NULL || s->incarnation != e->incarnation || s->closed)
        return NULL; /* no session: the core re-sends on re-attach */
    return s;
}

/* Does a watcher want the lease of (node, rank, lease id)? No filter: yes. */
static bool watch_wants_lease(const Kvfence__V1__WatchLeasesRequest *rq, const char *node_id,
                              uint32_t rank, uint64_t lease_id)
{
    if (rq->node_id != NULL && rq->node_id[0] != '\0' && strcmp(rq->node_id, node_id) != 0)
        return false;
    if (rq->n_ranks > 0) {
        bool hit = false;
        for (size_t i = 0; i < rq->n_ranks && !hit; i++)
            hit = rq->ranks[i] == rank;
        if (!hit)
            return false;
    }
    if (rq->n_lease_ids > 0) {
        bool hit = false;
        for (size_t i = 0; i < rq->n_lease_ids && !hit; i++)
            hit = rq->lease_ids[i] == lease_id;
        if (!hit)
            return false;
    }
    return true;
}

/* Does a watcher want the state changes of a room: one of its leases matches. */
static bool watch_wants_room(const struct kvf_cps *cps, const Kvfence__V1__WatchLeasesRequest *rq,
                             kvf_room_key key)
{
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(cps, key, &v) != 0)
        return false;
    for (size_t i = 0; i < v.participant_count; i++) {
        struct kvf_cps_participant_view pv;
        if (kvf_cps_room_participant(cps, v.key, i, &pv) == 0 &&
            watch_wants_lease(rq, pv.node_id, pv.rank, pv.lease_id))
            return true;
    }
    return false;
}

static void watch_send(struct lease_watch *w, const Kvfence__V1__LeaseEvent *ev)
{
    size_t len = protobuf_c_message_get_packed_size(&ev->base);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL) {
        kvf_log("error", "out of memory packing a lease event");
        return;
    }
    protobuf_c_message_pack(&ev->base, buf);
    kvf_rpc_stream_send(w->stream, buf, len);
    free(buf);
}

static void route_lease_released(struct kvf_svc_ctx *ctx, const struct kvf_cps_effect *e)
{
    struct kvf_cps_participant_view pv;
    struct kvf_svc_lease_buf lb;
    bool have = kvf_svc_find_lease(ctx->cps, e->key, e->lease_id, &pv) == 0 &&
                kvf_svc_lease_fill(&lb, e->key, &pv) == 0;
    if (!have) {
        kvf_log("error", "lease %" PRIu64 ": released but not found in room %" PRIu64 ":%" PRIu64,
                e->lease_id, e->key.room_id, e->key.generation);
        return;
    }
    Kvfence__V1__LeaseEvent ev = KVFENCE__V1__LEASE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED;
    ev.released = &lb.lease;
    for (struct lease_watch *w = ctx->sessions->watches; w != NULL; w = w->next) {
        if (!w->closed && watch_wants_lease(w->rq, e->node_id, e->rank, e->lease_id))
            watch_send(w, &ev);
    }
    kvf_svc_lease_free(&lb);
}

static void route_room_state(struct kvf_svc_ctx *ctx, const struct kvf_cps_effect *e)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = e->key.room_id;
    key.generation = e->key.generation;
    Kvfence__V1__RoomStateChange ch = KVFENCE__V1__ROOM_STATE_CHANGE__INIT;
    ch.room = &key;
    ch.old_state = (Kvfence__V1__RoomState)e->old_state;
    ch.new_state = (Kvfence__V1__RoomState)e->new_state;
    ch.reason = (Kvfence__V1__AbortReason)e->reason;
    Kvfence__V1__AbortToken tok = KVFENCE__V1__ABORT_TOKEN__INIT;
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(ctx->cps, e->key, &v) == 0 && !kvf_token_is_zero(v.token)) {
        tok.hi = v.token.hi;
        tok.lo = v.token.lo;
        ch.token = &tok;
    }
    Kvfence__V1__LeaseEvent ev = KVFENCE__V1__LEASE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE;
    ev.room_state = &ch;
    for (struct lease_watch *w = ctx->sessions->watches; w != NULL; w = w->next) {
        if (!w->closed && w->rq->include_room_states && watch_wants_room(ctx->cps, w->rq, e->key))
            watch_send(w, &ev);
    }
}

void kvf_svc_route_effect(struct kvf_svc_ctx *ctx, const struct kvf_cps_effect *e)
{
    struct node_sess *s;
    switch (e->kind) {
    case KVF_CPS_FX_ROOM_UPDATE:
        if ((s = addressee(ctx, e)) != NULL)
            send_room_update(ctx, s, e->key, e->version);
        break;
    case KVF_CPS_FX_ABORT_NOTICE:
        if ((s = addressee(ctx, e)) != NULL) {
            Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
            key.room_id = e->key.room_id;
            key.generation = e->key.generation;
            Kvfence__V1__AbortToken tok = KVFENCE__V1__ABORT_TOKEN__INIT;
            tok.hi = e->token.hi;
            tok.lo = e->token.lo;
            Kvfence__V1__AbortNotice an = KVFENCE__V1__ABORT_NOTICE__INIT;
            an.notice_id = NOTICE_ABORT | (e->key.generation & NOTICE_VALUE_MASK);
            an.room = &key;
            an.token = &tok;
            an.attempt = e->attempt;
            struct kvf_cps_room_view v;
            if (kvf_cps_room_get(ctx->cps, e->key, &v) == 0)
                an.reason = (Kvfence__V1__AbortReason)v.abort_reason;
            Kvfence__V1__ControlMessage cm = KVFENCE__V1__CONTROL_MESSAGE__INIT;
            cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE;
            cm.abort_notice = &an;
            sess_send(s, &cm);
        }
        break;
    case KVF_CPS_FX_FENCE_PEER:
        if ((s = addressee(ctx, e)) != NULL) {
            Kvfence__V1__FencePeer fp = KVFENCE__V1__FENCE_PEER__INIT;
            fp.notice_id = fence_notice_id(e->peer_node, e->peer_incarnation);
            fp.node_id = (char *)e->peer_node;
            fp.incarnation = e->peer_incarnation;
            fp.attempt = e->attempt;
            Kvfence__V1__ControlMessage cm = KVFENCE__V1__CONTROL_MESSAGE__INIT;
            cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER;
            cm.fence_peer = &fp;
            sess_send(s, &cm);
        }
        break;
    case KVF_CPS_FX_LEASE_RELEASED:
        route_lease_released(ctx, e);
        break;
    case KVF_CPS_FX_ROOM_STATE:
        route_room_state(ctx, e);
        break;
    default:
        break;
    }
}

/* ---- node messages (state thread) ---------------------------------------- */

static void log_command(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                        const char *node_id, uint64_t incarnation, const uint8_t *raw,
                        size_t raw_len);

struct sess_job {
    struct node_sess *s;
    bool half_close;               /* the node said goodbye (no msg) */
    Kvfence__V1__NodeMessage *msg; /* NULL (and not half_close): the stream ended */
    uint8_t *raw;                  /* the message's bytes, for the log */
    size_t raw_len;
};

static void sess_finish(struct node_sess *s, int neg_errno, const struct kvf_error *err)
{
    enum kvf_grpc_code code = kvf_errno_to_grpc_code(neg_errno);
    kvf_rpc_stream_finish(s->stream, (int)code,
                          err && err->msg[0] ? err->msg : kvf_grpc_code_name(code));
}

static int pools_from_wire(Kvfence__V1__Pool *const *in, size_t n, struct kvf_cps_pool **out_p)
{
    struct kvf_cps_pool *out = calloc(n ? n : 1, sizeof(*out));
    if (out == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        out[i].pool_id = in[i]->pool_id;
        out[i].page_size = in[i]->page_size;
        out[i].page_count = in[i]->page_count;
        out[i].key = in[i]->pool_key; /* "" when absent */
    }
    *out_p = out;
    return 0;
}

/* After a recovery from the durable log, the control plane may have missed
 * reports that the node sent while it was down (or that were not yet
 * durable): every node that attaches is asked once for its full state. */
static void maybe_request_resync(struct kvf_svc_ctx *ctx, struct node_sess *s)
{
    struct kvf_svc_sessions *reg = ctx->sessions;
    if (!ctx->recovered)
        return;
    for (size_t i = 0; i < reg->nresync_asked; i++) {
        if (strcmp(reg->resync_asked[i], s->node_id) == 0)
            return;
    }
    char(*v)[129] = realloc(reg->resync_asked, (reg->nresync_asked + 1) * sizeof(*v));
    if (v == NULL)
        return; /* the node's own Resync after a re-attach covers it */
    reg->resync_asked = v;
    snprintf(v[reg->nresync_asked++], sizeof(*v), "%s", s->node_id);
    Kvfence__V1__ResyncRequest rq = KVFENCE__V1__RESYNC_REQUEST__INIT;
    rq.reason = (char *)"control plane recovered from its log";
    Kvfence__V1__ControlMessage cm = KVFENCE__V1__CONTROL_MESSAGE__INIT;
    cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_RESYNC_REQUEST;
    cm.resync_request = &rq;
    sess_send(s, &cm);
    kvf_log_node("info", s->node_id, s->incarnation,
                 "node %s incarnation %" PRIu64 ": resync requested (recovered state)", s->node_id,
                 s->incarnation);
}

/* The core's part of a Hello: checks and attaches. 0 or a negative errno
 * with `err` set. Also used to replay the log. */
static int apply_hello(struct kvf_svc_ctx *ctx, const Kvfence__V1__Hello *h, kvf_time_ns now,
                       uint32_t *version_p, struct kvf_error *err)
{
    if (h->node_id == NULL || h->node_id[0] == '\0' || strlen(h->node_id) > KVF_NODE_ID_MAX)
        return kvf_error_set(err, -EINVAL, "hello.node_id: must be 1..%d bytes", KVF_NODE_ID_MAX);
    if (h->capabilities == NULL)
        return kvf_error_set(err, -EINVAL, "hello.capabilities: missing");
    struct kvf_cps_pool *pools;
    if (pools_from_wire(h->pools, h->n_pools, &pools) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    struct kvf_cps_node_hello ch = {
        .node_id = h->node_id,
        .incarnation = h->incarnation,
        .protocol_min = h->capabilities->protocol_min,
        .protocol_max = h->capabilities->protocol_max,
        .features =
            kvf_svc_features_from_names(h->capabilities->features, h->capabilities->n_features),
        .pools = pools,
        .pool_count = h->n_pools,
        .witnessed_gone = h->witnessed_gone,
    };
    uint32_t features_missing = kvf_features_first_missing(ch.features, KVF_FEATURES_REQUIRED);
    int rc;
    if (features_missing != 0)
        rc = kvf_error_set(err, -ENOTSUP,
                           "hello.capabilities.features: node %s does not advertise %s; this "
                           "control plane refuses nodes without it",
                           h->node_id, kvf_feature_name(features_missing));
    else
        rc = kvf_cps_node_attach(ctx->cps, &ch, now, version_p, err);
    free(pools);
    return rc;
}

static void handle_hello(struct kvf_svc_ctx *ctx, struct node_sess *s, Kvfence__V1__NodeMessage *m,
                         const uint8_t *raw, size_t raw_len, kvf_time_ns now)
{
    Kvfence__V1__Hello *h = m->hello;
    struct kvf_error err;
    kvf_error_clear(&err);
    if (s->attached) {
        kvf_error_set(&err, -EINVAL, "hello: this session already said hello");
        sess_finish(s, -EINVAL, &err);
        return;
    }
    /* Everything this session reports is taken as the word of the node its
     * Hello names: with mutual TLS that must be the certificate's node. */
    if (s->cert_node_id[0] != '\0' && strcmp(h->node_id, s->cert_node_id) != 0) {
        kvf_error_set(&err, -EACCES,
                      "hello.node_id: '%.128s' is not the node the client certificate names "
                      "('%s')",
                      h->node_id, s->cert_node_id);
        kvf_log("warn", "refused: %s", err.msg);
        sess_finish(s, -EACCES, &err);
        return;
    }
    /* The registry entry cannot fail after the core accepted the node. */
    if (cp_map_reserve(&ctx->sessions->by_id, 1) != 0) {
        kvf_error_set(&err, -ENOMEM, "out of memory registering the node");
        sess_finish(s, -ENOMEM, &err);
        return;
    }
    uint32_t version = 0;
    kvf_svc_persist_begin(ctx);
    int rc = apply_hello(ctx, h, now, &version, &err);
    log_command(ctx, KVF_SVC_REC_NODE_MSG, now, h->node_id, 0, raw, raw_len);
    if (rc != 0) {
        kvf_log_node("warn", h->node_id, h->incarnation,
                     "node %s incarnation %" PRIu64 " refused: %s", h->node_id, h->incarnation,
                     err.msg);
        sess_finish(s, rc, &err);
        return;
    }
    struct node_sess *old = registry_find(ctx->sessions, h->node_id);
    if (old != NULL) {
        struct kvf_error why;
        kvf_error_set(&why, -ECANCELED, "replaced by a newer session of node %s", h->node_id);
        old->replaced = true;
        sess_finish(old, -ECANCELED, &why);
        registry_remove(ctx->sessions, old);
    }
    snprintf(s->node_id, sizeof(s->node_id), "%s", h->node_id);
    s->incarnation = h->incarnation;
    s->hello = h;
    m->hello = NULL; /* the session keeps the Hello */
    m->msg_case = KVFENCE__V1__NODE_MESSAGE__MSG__NOT_SET;
    s->attached = true;
    atomic_fetch_add(&s->refs, 1);
    s->next = ctx->sessions->nodes;
    ctx->sessions->nodes = s;
    (void)cp_map_put_str(&ctx->sessions->by_id, s->node_id, s); /* reserved above */

    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    char *names[KVF_FEATURE_COUNT];
    caps.protocol_min = KVF_PROTOCOL_MIN;
    caps.protocol_max = KVF_PROTOCOL_MAX;
    /* Every feature this build knows. */
    caps.n_features = kvf_svc_features_to_names((1u << KVF_FEATURE_COUNT) - 1, names);
    caps.features = names;
    Kvfence__V1__Welcome w = KVFENCE__V1__WELCOME__INIT;
    w.negotiated_version = version;
    w.capabilities = &caps;
    w.heartbeat_interval_ms = HEARTBEAT_INTERVAL_MS;
    w.node_ttl_ms = (uint32_t)(ctx->node_ttl / KVF_NS_PER_MS);
    w.control_plane_id = (char *)"kvfence-control";
    Kvfence__V1__ControlMessage cm = KVFENCE__V1__CONTROL_MESSAGE__INIT;
    cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME;
    cm.welcome = &w;
    sess_send(s, &cm);
    kvf_log_node("info", s->node_id, s->incarnation,
                 "node %s incarnation %" PRIu64 " attached, protocol %" PRIu32, s->node_id,
                 s->incarnation, version);
    /* The room updates this node has not acknowledged (all of them after a
     * recovery) were emitted by the core at attach and follow the Welcome. */
    maybe_request_resync(ctx, s);
}

static bool key_from_wire(const Kvfence__V1__RoomKey *k, kvf_room_key *out)
{
    if (k == NULL)
        return false;
    out->room_id = k->room_id;
    out->generation = k->generation;
    return true;
}

/* Logs a command when a store is open (persist.c). */
static void log_command(struct kvf_svc_ctx *ctx, enum kvf_svc_rec_kind kind, kvf_time_ns now,
                        const char *node_id, uint64_t incarnation, const uint8_t *raw,
                        size_t raw_len)
{
    if (!kvf_svc_persist_enabled(ctx))
        return;
    int rc = kvf_svc_persist_commit(ctx, kind, now, node_id, incarnation, raw, raw_len, NULL, NULL);
    if (rc != 0)
        kvf_log("error", "node %s: cannot log a session event: %s", node_id ? node_id : "?",
                strerror(-rc));
}

/* A Resync from the wire, checked and applied by the core. Returns 0, or a
 * negative errno with `err` set. */
static int apply_resync(struct kvf_svc_ctx *ctx, const char *node_id, uint64_t incarnation,
                        const Kvfence__V1__Resync *r, kvf_time_ns now,
                        struct kvf_cps_resync_result *res, struct kvf_error *err)
{
    struct kvf_cps_resync rs;
    memset(&rs, 0, sizeof(rs));
    struct kvf_cps_resync_lifetime *lts = calloc(r->n_lifetimes ? r->n_lifetimes : 1, sizeof(*lts));
    struct kvf_cps_resync_peer *peers =
        calloc(r->n_fenced_peers ? r->n_fenced_peers : 1, sizeof(*peers));
    struct kvf_cps_pool *pools = NULL;
    int rc = 0;
    if (lts == NULL || peers == NULL || pools_from_wire(r->pools, r->n_pools, &pools) != 0)
        rc = kvf_error_set(err, -ENOMEM, "out of memory");
    for (size_t i = 0; rc == 0 && i < r->n_lifetimes; i++) {
        const Kvfence__V1__LifetimeInfo *li = r->lifetimes[i];
        if (!key_from_wire(li->room, &lts[i].key)) {
            rc = kvf_error_set(err, -EINVAL, "resync.lifetimes[%zu].room: missing", i);
            break;
        }
        lts[i].state = (enum kvf_cps_lifetime_state)li->state;
        if (li->token != NULL)
            lts[i].token = (kvf_token){li->token->hi, li->token->lo};
        lts[i].ops_in_flight = li->ops_in_flight;
    }
    for (size_t i = 0; rc == 0 && i < r->n_fenced_peers; i++) {
        peers[i].node_id = r->fenced_peers[i]->node_id ? r->fenced_peers[i]->node_id : "";
        peers[i].incarnation = r->fenced_peers[i]->incarnation;
    }
    if (rc == 0) {
        rs.lifetimes = lts;
        rs.lifetime_count = r->n_lifetimes;
        rs.fenced = peers;
        rs.fenced_count = r->n_fenced_peers;
        rs.pools = pools;
        rs.pool_count = r->n_pools;
        rc = kvf_cps_node_resync(ctx->cps, node_id, incarnation, &rs, now, res, err);
    }
    free(lts);
    free(peers);
    free(pools);
    return rc;
}

/* The core's part of a report from node `node_id`. Returns 0, or a negative
 * errno with `err` and `what_p` set (the core counted a refused report). */
static int apply_report(struct kvf_svc_ctx *ctx, const char *node_id, uint64_t incarnation,
                        const Kvfence__V1__NodeMessage *m, kvf_time_ns now, kvf_room_key *key_p,
                        const char **what_p, struct kvf_error *err)
{
    kvf_room_key key = {0, 0};
    int rc = 0;
    const char *what = "message";
    switch (m->msg_case) {
    case KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT:
    case KVFENCE__V1__NODE_MESSAGE__MSG_ACK:
        return 0; /* liveness is the stream itself; acks prove nothing */
    case KVFENCE__V1__NODE_MESSAGE__MSG_RESYNC: {
        what = "resync";
        struct kvf_cps_resync_result res;
        rc = apply_resync(ctx, node_id, incarnation, m->resync, now, &res, err);
        if (rc == 0)
            kvf_log_node("info", node_id, incarnation,
                         "node %s resync: %u lifetimes, %" PRIu32 " counted as drained, %" PRIu32
                         " abort notices for ended rooms, %" PRIu32 " ignored; %" PRIu32
                         " fenced peers (%" PRIu32 " unknown); pools: %" PRIu32
                         " upserted, %" PRIu32 " removed, %" PRIu32 " kept (leased), %" PRIu32
                         " refused",
                         node_id, (unsigned)m->resync->n_lifetimes, res.drained, res.notices,
                         res.ignored, res.fenced, res.fenced_unknown, res.pools_upserted,
                         res.pools_removed, res.pools_kept, res.pools_refused);
        break;
    }
    case KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED: {
        what = "drained";
        kvf_token tok = {0, 0};
        if (m->drained->token != NULL)
            tok = (kvf_token){m->drained->token->hi, m->drained->token->lo};
        if (!key_from_wire(m->drained->room, &key))
            rc = kvf_error_set(err, -EINVAL, "drained.room: missing");
        else
            rc = kvf_cps_report_drained_of(ctx->cps, node_id, incarnation, m->drained->incarnation,
                                           key, tok, now, err);
        break;
    }
    case KVFENCE__V1__NODE_MESSAGE__MSG_ROOM_UPDATE_ACK:
        what = "room_update_ack";
        if (!key_from_wire(m->room_update_ack->room, &key))
            rc = kvf_error_set(err, -EINVAL, "room_update_ack.room: missing");
        else
            rc = kvf_cps_room_update_acked(ctx->cps, node_id, incarnation, key,
                                           m->room_update_ack->version, now, err);
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_WITNESS:
        what = "witness";
        rc = kvf_cps_node_witness(ctx->cps, node_id, incarnation, m->witness->gone_incarnation, now,
                                  err);
        if (rc == 0)
            kvf_log_node("info", node_id, incarnation,
                         "node %s witnesses that its incarnations up to %" PRIu64
                         " are gone: their leases waiting for this host are released",
                         node_id, m->witness->gone_incarnation);
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_COMPLETED:
        what = "completed";
        if (!key_from_wire(m->completed->room, &key))
            rc = kvf_error_set(err, -EINVAL, "completed.room: missing");
        else
            rc = kvf_cps_report_completed(ctx->cps, node_id, incarnation, key, m->completed->rank,
                                          (enum kvf_cps_role)m->completed->role, now, err);
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_TRANSFER_FAILED: {
        what = "transfer_failed";
        kvf_token tok;
        if (!key_from_wire(m->transfer_failed->room, &key))
            rc = kvf_error_set(err, -EINVAL, "transfer_failed.room: missing");
        else
            rc = kvf_cps_report_failed(ctx->cps, node_id, incarnation, key, now, &tok, err);
        break;
    }
    case KVFENCE__V1__NODE_MESSAGE__MSG_PEER_FENCED:
        what = "peer_fenced";
        rc = kvf_cps_report_fenced(ctx->cps, node_id, incarnation,
                                   m->peer_fenced->node_id ? m->peer_fenced->node_id : "",
                                   m->peer_fenced->incarnation, now, err);
        break;
    case KVFENCE__V1__NODE_MESSAGE__MSG_POOL_UPDATE: {
        what = "pool_update";
        const Kvfence__V1__PoolUpdate *pu = m->pool_update;
        struct kvf_cps_pool *up = calloc(pu->n_upserted ? pu->n_upserted : 1, sizeof(*up));
        if (up == NULL) {
            rc = kvf_error_set(err, -ENOMEM, "out of memory");
            break;
        }
        for (size_t i = 0; i < pu->n_upserted; i++)
            up[i] = (struct kvf_cps_pool){pu->upserted[i]->pool_id, pu->upserted[i]->page_size,
                                          pu->upserted[i]->page_count, pu->upserted[i]->pool_key};
        /* One change: a refused removal leaves the upserts unapplied too. */
        rc = kvf_cps_node_update_pools(ctx->cps, node_id, incarnation, up, pu->n_upserted,
                                       pu->removed_pool_ids, pu->n_removed_pool_ids, err);
        free(up);
        break;
    }
    default:
        rc = kvf_error_set(err, -EINVAL, "message: empty or unknown kind");
        break;
    }
    *key_p = key;
    *what_p = what;
    return rc;
}

int kvf_svc_node_apply(struct kvf_svc_ctx *ctx, const char *node_id, uint64_t incarnation,
                       const uint8_t *payload, size_t len, kvf_time_ns now)
{
    static const uint8_t empty[1];
    Kvfence__V1__NodeMessage *m =
        kvfence__v1__node_message__unpack(NULL, len, len ? payload : empty);
    if (m == NULL)
        return -EBADMSG;
    struct kvf_error err;
    kvf_error_clear(&err);
    if (m->msg_case == KVFENCE__V1__NODE_MESSAGE__MSG_HELLO) {
        uint32_t version;
        apply_hello(ctx, m->hello, now, &version, &err);
    } else {
        kvf_room_key key;
        const char *what;
        apply_report(ctx, node_id, incarnation, m, now, &key, &what, &err);
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
    return 0;
}

static void handle_report(struct kvf_svc_ctx *ctx, struct node_sess *s,
                          const Kvfence__V1__NodeMessage *m, const uint8_t *raw, size_t raw_len,
                          kvf_time_ns now)
{
    if (m->msg_case == KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT) {
        /* The node's proof that this control plane is alive and reading:
         * without it a node self-fences after node_ttl (node.proto). */
        Kvfence__V1__HeartbeatAck ha = KVFENCE__V1__HEARTBEAT_ACK__INIT;
        ha.seq = m->heartbeat->seq;
        Kvfence__V1__ControlMessage cm = KVFENCE__V1__CONTROL_MESSAGE__INIT;
        cm.msg_case = KVFENCE__V1__CONTROL_MESSAGE__MSG_HEARTBEAT_ACK;
        cm.heartbeat_ack = &ha;
        sess_send(s, &cm);
        return; /* nothing for the core, nothing to log */
    }
    if (m->msg_case == KVFENCE__V1__NODE_MESSAGE__MSG_ACK)
        return; /* nothing for the core, nothing to log */
    struct kvf_error err;
    kvf_error_clear(&err);
    kvf_room_key key;
    const char *what;
    kvf_svc_persist_begin(ctx);
    int rc = apply_report(ctx, s->node_id, s->incarnation, m, now, &key, &what, &err);
    /* A room update ack is not logged: it says what the node's memory holds,
     * which a restarted control plane asks again rather than assumes
     * (docs/state-cores.md, "Ordered room updates"). */
    if (m->msg_case != KVFENCE__V1__NODE_MESSAGE__MSG_ROOM_UPDATE_ACK)
        log_command(ctx, KVF_SVC_REC_NODE_MSG, now, s->node_id, s->incarnation, raw, raw_len);
    /* A refused report changes nothing and is counted by the core (stale,
     * tokenless, late): log it; the session goes on. */
    if (rc != 0)
        kvf_log_room("warn", key, s->node_id,
                     "node %s: %s report for room %" PRIu64 ":%" PRIu64 " refused (%s): %s",
                     s->node_id, what, key.room_id, key.generation,
                     kvf_grpc_code_name(kvf_errno_to_grpc_code(rc)), err.msg);
}

static void sess_job_run(struct kvf_svc_ctx *ctx, void *arg, kvf_time_ns now)
{
    struct sess_job *j = arg;
    struct node_sess *s = j->s;
    if (j->half_close) {
        /* After every message the node sent before it (jobs are FIFO): a
         * refusal already ended the stream, and this finish is then moot. */
        if (!s->closed)
            kvf_rpc_stream_finish(s->stream, KVF_GRPC_OK, NULL);
        free(j);
        return;
    }
    if (j->msg == NULL) { /* the stream ended */
        s->closed = true;
        if (s->attached && !s->replaced) {
            kvf_svc_persist_begin(ctx);
            kvf_cps_node_detach(ctx->cps, s->node_id, s->incarnation, now, NULL);
            log_command(ctx, KVF_SVC_REC_NODE_END, now, s->node_id, s->incarnation, NULL, 0);
            kvf_log_node("info", s->node_id, s->incarnation,
                         "node %s incarnation %" PRIu64 ": session ended", s->node_id,
                         s->incarnation);
        }
        if (s->attached)
            registry_remove(ctx->sessions, s);
        sess_unref(s); /* the stream's reference */
        free(j);
        return;
    }
    if (!s->closed && !s->replaced && j->raw_len > KVF_SVC_CHANGE_MAX) {
        /* Refused before it is applied or logged: a log record stays bounded. */
        struct kvf_error err;
        kvf_error_set(&err, -EINVAL, "message: %zu bytes, more than the %u a node message may take",
                      j->raw_len, KVF_SVC_CHANGE_MAX);
        sess_finish(s, -EINVAL, &err);
    } else if (!s->closed && !s->replaced) {
        if (j->msg->msg_case == KVFENCE__V1__NODE_MESSAGE__MSG_HELLO) {
            handle_hello(ctx, s, j->msg, j->raw, j->raw_len, now);
        } else if (!s->attached) {
            struct kvf_error err;
            kvf_error_set(&err, -EINVAL, "message: the first message of a session is hello");
            sess_finish(s, -EINVAL, &err);
        } else {
            handle_report(ctx, s, j->msg, j->raw, j->raw_len, now);
        }
    }
    protobuf_c_message_free_unpacked(&j->msg->base, NULL);
    free(j->raw);
    free(j);
}

static void sess_job_drop(void *arg)
{
    struct sess_job *j = arg;
    if (j->msg != NULL)
        protobuf_c_message_free_unpacked(&j->msg->base, NULL);
    else if (!j->half_close)
        sess_unref(j->s);
    free(j->raw);
    free(j);
}

/* ---- Attach stream callbacks (CQ threads) --------------------------------- */

/* With mutual TLS: refuses a stream whose certificate lacks `method`'s role
 * (the stream is finished, nothing else happens). Returns false then. */
static bool authorize_stream(struct kvf_svc *svc, struct kvf_rpc_stream *stream, const char *method,
                             struct kvf_authz_peer *peer_p)
{
    memset(peer_p, 0, sizeof *peer_p);
    if (!kvf_svc_authz(svc)->enforce)
        return true;
    struct kvf_rpc_identity id;
    char why[KVF_RPC_NAME_MAX + 160];
    int rc = kvf_rpc_stream_identity(stream, &id);
    if (rc != 0) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_UNAUTHENTICATED, "the stream ended");
        return false;
    }
    rc = kvf_svc_authorize(svc, &id, method, peer_p, why, sizeof why);
    if (rc != 0) {
        kvf_rpc_stream_finish(stream, kvf_errno_to_grpc_code(rc), why);
        return false;
    }
    return true;
}

static void attach_open(void *vctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    (void)req;
    (void)len;
    struct kvf_authz_peer peer;
    if (!authorize_stream(vctx, stream, "/kvfence.v1.NodeSession/Attach", &peer))
        return;
    struct node_sess *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    atomic_init(&s->refs, 1);
    atomic_init(&s->last_seen_ns, (uint64_t)kvf_clock_mono_ns());
    s->svc = vctx;
    snprintf(s->cert_node_id, sizeof s->cert_node_id, "%s", peer.node_id);
    kvf_rpc_stream_ref(stream);
    s->stream = stream;
    kvf_rpc_stream_set_user(stream, s);
}

static void attach_post(struct node_sess *s, Kvfence__V1__NodeMessage *msg, const uint8_t *raw,
                        size_t raw_len)
{
    struct sess_job *j = calloc(1, sizeof(*j));
    if (j != NULL && raw_len > 0) {
        j->raw = malloc(raw_len);
        if (j->raw == NULL) {
            free(j);
            j = NULL;
        } else {
            memcpy(j->raw, raw, raw_len);
            j->raw_len = raw_len;
        }
    }
    if (j == NULL) {
        if (msg != NULL)
            protobuf_c_message_free_unpacked(&msg->base, NULL);
        else
            sess_unref(s);
        return;
    }
    j->s = s;
    j->msg = msg;
    kvf_svc_post(s->svc, sess_job_run, sess_job_drop, j);
}

static void attach_message(void *vctx, struct kvf_rpc_stream *stream, const uint8_t *msg,
                           size_t len)
{
    (void)vctx;
    struct node_sess *s = kvf_rpc_stream_user(stream);
    if (s == NULL)
        return;
    static const uint8_t empty[1];
    atomic_store(&s->last_seen_ns, (uint64_t)kvf_clock_mono_ns());
    Kvfence__V1__NodeMessage *m =
        kvfence__v1__node_message__unpack(NULL, len, msg != NULL ? msg : empty);
    if (m == NULL) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_INVALID_ARGUMENT,
                              "message: does not decode as kvfence.v1.NodeMessage");
        return;
    }
    attach_post(s, m, msg, len);
}

/* A node that half-closes is saying goodbye: end the session cleanly, once
 * the messages it sent before have been handled. */
static void attach_half_close(void *vctx, struct kvf_rpc_stream *stream)
{
    (void)vctx;
    struct node_sess *s = kvf_rpc_stream_user(stream);
    if (s == NULL)
        return;
    struct sess_job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_OK, NULL);
        return;
    }
    j->s = s;
    j->half_close = true;
    kvf_svc_post(s->svc, sess_job_run, sess_job_drop, j);
}

static void attach_closed(void *vctx, struct kvf_rpc_stream *stream,
                          enum kvf_rpc_close_reason reason)
{
    (void)vctx;
    (void)reason;
    struct node_sess *s = kvf_rpc_stream_user(stream);
    if (s == NULL)
        return;
    kvf_rpc_stream_set_user(stream, NULL);
    attach_post(s, NULL, NULL, 0);
}

/* ---- WatchLeases (CQ threads post, the state thread owns the list) -------- */

struct watch_job {
    struct lease_watch *w;
    bool closing;
};

static void watch_free(struct lease_watch *w)
{
    if (w->rq != NULL)
        protobuf_c_message_free_unpacked(&w->rq->base, NULL);
    kvf_rpc_stream_unref(w->stream);
    free(w);
}

struct replay_ctx {
    struct kvf_svc_ctx *ctx;
    struct lease_watch *w;
    uint64_t replayed;
};

static int replay_room(void *vctx, const struct kvf_cps_room_view *v)
{
    struct replay_ctx *rc = vctx;
    if (v->state != KVF_CPS_ROOM_COMPLETED && v->state != KVF_CPS_ROOM_ABORTED)
        return 0;
    for (size_t i = 0; i < v->participant_count; i++) {
        struct kvf_cps_participant_view pv;
        struct kvf_svc_lease_buf lb;
        if (kvf_cps_room_participant(rc->ctx->cps, v->key, i, &pv) != 0 ||
            pv.lease_state != KVF_CPS_LEASE_RELEASED ||
            !watch_wants_lease(rc->w->rq, pv.node_id, pv.rank, pv.lease_id) ||
            kvf_svc_lease_fill(&lb, v->key, &pv) != 0)
            continue;
        Kvfence__V1__LeaseEvent ev = KVFENCE__V1__LEASE_EVENT__INIT;
        ev.event_case = KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED;
        ev.released = &lb.lease;
        watch_send(rc->w, &ev);
        kvf_svc_lease_free(&lb);
        rc->replayed++;
    }
    return 0;
}

static void watch_job_run(struct kvf_svc_ctx *ctx, void *arg, kvf_time_ns now)
{
    (void)now;
    struct watch_job *j = arg;
    struct lease_watch *w = j->w;
    if (!j->closing) {
        w->next = ctx->sessions->watches;
        ctx->sessions->watches = w;
        w->listed = true;
        /* First the releases still held as tombstones, then `synced`: from
         * here on every release reaches the watcher. */
        struct replay_ctx rc = {ctx, w, 0};
        kvf_cps_room_foreach(ctx->cps, replay_room, &rc);
        Kvfence__V1__WatchSynced sy = KVFENCE__V1__WATCH_SYNCED__INIT;
        sy.replayed = rc.replayed;
        Kvfence__V1__LeaseEvent ev = KVFENCE__V1__LEASE_EVENT__INIT;
        ev.event_case = KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED;
        ev.synced = &sy;
        watch_send(w, &ev);
    } else {
        for (struct lease_watch **pp = &ctx->sessions->watches; *pp != NULL; pp = &(*pp)->next) {
            if (*pp == w) {
                *pp = w->next;
                break;
            }
        }
        watch_free(w);
    }
    free(j);
}

/* A job the stopping service did not run. kvf_svc_stop drops the queue after
 * joining the state thread, and the CQ threads that post these jobs are gone
 * by then (main.c), so `listed` is stable here. A watch whose open job ran is
 * in the list, which frees it (kvf_svc_sessions_destroy): freeing it here too
 * left a dangling entry there (heap-use-after-free at exit). */
static void watch_job_drop(void *arg)
{
    struct watch_job *j = arg;
    if (j->closing && !j->w->listed)
        watch_free(j->w);
    free(j);
}

static void watch_post(struct kvf_svc *svc, struct lease_watch *w, bool closing)
{
    struct watch_job *j = calloc(1, sizeof(*j));
    if (j == NULL) {
        kvf_log("error", "out of memory queuing a WatchLeases event");
        return;
    }
    j->w = w;
    j->closing = closing;
    kvf_svc_post(svc, watch_job_run, watch_job_drop, j);
}

static void watch_open(void *vctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    static const uint8_t empty[1];
    struct kvf_authz_peer peer;
    if (!authorize_stream(vctx, stream, "/kvfence.v1.Control/WatchLeases", &peer))
        return;
    Kvfence__V1__WatchLeasesRequest *rq =
        kvfence__v1__watch_leases_request__unpack(NULL, len, req != NULL ? req : empty);
    if (rq == NULL) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_INVALID_ARGUMENT,
                              "request: does not decode as kvfence.v1.WatchLeasesRequest");
        return;
    }
    struct lease_watch *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        protobuf_c_message_free_unpacked(&rq->base, NULL);
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    kvf_rpc_stream_ref(stream);
    w->stream = stream;
    w->rq = rq;
    kvf_rpc_stream_set_user(stream, w);
    watch_post(vctx, w, false);
}

static void watch_closed(void *vctx, struct kvf_rpc_stream *stream,
                         enum kvf_rpc_close_reason reason)
{
    (void)reason;
    struct lease_watch *w = kvf_rpc_stream_user(stream);
    if (w == NULL)
        return;
    kvf_rpc_stream_set_user(stream, NULL);
    watch_post(vctx, w, true);
}

/* ---- heartbeats ---------------------------------------------------------------- */

void kvf_svc_sessions_sweep(struct kvf_svc_ctx *ctx, uint64_t mono_now, uint64_t timeout_ns)
{
    if (timeout_ns == 0)
        return;
    for (struct node_sess *s = ctx->sessions->nodes; s != NULL; s = s->next) {
        uint64_t seen = atomic_load(&s->last_seen_ns);
        if (s->closed || s->replaced || mono_now < seen || mono_now - seen < timeout_ns)
            continue;
        /* A live stream that says nothing is a hung node: end the session, so
         * that the node goes SUSPECT (and LOST after node_ttl) as if its
         * connection had dropped. Its stream's end detaches it. */
        char why[256];
        snprintf(why, sizeof(why),
                 "no message from node %s for %" PRIu64 " ms (heartbeats stopped)", s->node_id,
                 (uint64_t)((mono_now - seen) / KVF_NS_PER_MS));
        kvf_log_node("warn", s->node_id, s->incarnation, "%s", why);
        kvf_rpc_stream_finish(s->stream, KVF_GRPC_UNAVAILABLE, why);
        atomic_store(&s->last_seen_ns, UINT64_MAX / 2); /* once */
    }
}

/* ---- admin views ------------------------------------------------------------- */

const Kvfence__V1__Hello *kvf_svc_session_view(struct kvf_svc_ctx *ctx, const char *node_id,
                                               uint64_t incarnation, uint64_t mono_now,
                                               uint64_t *last_seen_ms_p)
{
    struct node_sess *s = registry_find(ctx->sessions, node_id);
    if (s == NULL || !s->attached || s->closed || s->replaced || s->incarnation != incarnation)
        return NULL;
    uint64_t seen = atomic_load(&s->last_seen_ns);
    if (seen == UINT64_MAX / 2)
        return NULL; /* swept for silence: its stream is ending */
    /* Rounded up, at least 1 ms: 0 on the wire means "no session". A CQ
     * thread may have stamped a message after mono_now was read. */
    uint64_t age = mono_now > seen ? mono_now - seen : 0;
    uint64_t ms = (age + KVF_NS_PER_MS - 1) / KVF_NS_PER_MS;
    *last_seen_ms_p = ms ? ms : 1;
    return s->hello;
}

/* ---- lifecycle --------------------------------------------------------------- */

struct kvf_svc_sessions *kvf_svc_sessions_create(void)
{
    struct kvf_svc_sessions *reg = calloc(1, sizeof(struct kvf_svc_sessions));
    if (reg != NULL)
        cp_map_init(&reg->by_id, true);
    return reg;
}

void kvf_svc_sessions_destroy(struct kvf_svc_sessions *reg)
{
    if (reg == NULL)
        return;
    while (reg->nodes != NULL)
        registry_remove(reg, reg->nodes);
    while (reg->watches != NULL) {
        struct lease_watch *w = reg->watches;
        reg->watches = w->next;
        watch_free(w);
    }
    free(reg->resync_asked);
    cp_map_fini(&reg->by_id);
    free(reg);
}

int kvf_svc_register_streams(struct kvf_svc *svc, struct kvf_rpc_server *srv)
{
    const struct kvf_rpc_stream_callbacks attach = {.on_open = attach_open,
                                                    .on_message = attach_message,
                                                    .on_half_close = attach_half_close,
                                                    .on_closed = attach_closed};
    int rc = kvf_rpc_server_add_stream(srv, "/kvfence.v1.NodeSession/Attach", KVF_RPC_BIDI, &attach,
                                       svc);
    if (rc != 0)
        return rc;
    const struct kvf_rpc_stream_callbacks watch = {.on_open = watch_open,
                                                   .on_closed = watch_closed};
    return kvf_rpc_server_add_stream(srv, "/kvfence.v1.Control/WatchLeases",
                                     KVF_RPC_SERVER_STREAMING, &watch, svc);
}
