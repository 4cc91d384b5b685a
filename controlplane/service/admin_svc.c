/*
 * admin_svc.c: kvfence.v1.Admin (Ping, GetStats, GetRoom, ListRooms, GetNode,
 * ListNodes, ListLeases, FenceNode, AdminAbortRoom) over the state core's
 * views. The listings page by offset (page_token; 100 per page by default).
 * GetNode and ListNodes fill a NodeInfo the same way (node_info_fill): what
 * struct kvf_cps_node_view and kvf_cps_node_detail_get() hold, the pools' ids,
 * sizes and keys (the core keeps no RDMA addressing: nodes exchange it over
 * their peer link), and from the node's attached session (node_svc.c) its
 * endpoints, advertised capabilities, software version and the age of its
 * last message. What is not known (a node restored from a snapshot has no
 * state_age_ms; a node without a session no last_seen_ms) stays 0, which
 * JSON printers omit. Every handler runs on the state thread.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_server.h"
#include "service_internal.h"

static uint64_t age_ms(kvf_time_ns now, kvf_time_ns then)
{
    return now > then ? (now - then) / KVF_NS_PER_MS : 0;
}

/* ---- Ping --------------------------------------------------------------------- */

static void ping_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call, const ProtobufCMessage *m,
                     kvf_time_ns now)
{
    (void)ctx;
    (void)m;
    (void)now;
    Kvfence__V1__PingResponse rs = KVFENCE__V1__PING_RESPONSE__INIT;
    kvf_svc_reply(call, &rs.base);
}

/* ---- GetStats ---------------------------------------------------------------- */

static void stats_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call, const ProtobufCMessage *m,
                      kvf_time_ns now)
{
    (void)m;
    struct kvf_cps_stats s;
    kvf_cps_stats_get(ctx->cps, &s);
    Kvfence__V1__RoomCounts rooms = KVFENCE__V1__ROOM_COUNTS__INIT;
    rooms.opening = s.rooms_by_state[KVF_CPS_ROOM_OPENING];
    rooms.active = s.rooms_by_state[KVF_CPS_ROOM_ACTIVE];
    rooms.aborting = s.rooms_by_state[KVF_CPS_ROOM_ABORTING];
    rooms.completed = s.rooms_by_state[KVF_CPS_ROOM_COMPLETED];
    rooms.aborted = s.rooms_by_state[KVF_CPS_ROOM_ABORTED];
    Kvfence__V1__LeaseCounts leases = KVFENCE__V1__LEASE_COUNTS__INIT;
    leases.active = s.leases_by_state[KVF_CPS_LEASE_ACTIVE];
    leases.releasing = s.leases_by_state[KVF_CPS_LEASE_RELEASING];
    leases.released = s.leases_by_state[KVF_CPS_LEASE_RELEASED];
    Kvfence__V1__NodeCounts nodes = KVFENCE__V1__NODE_COUNTS__INIT;
    nodes.attached = s.nodes_by_state[KVF_CPS_NODE_ATTACHED];
    nodes.suspect = s.nodes_by_state[KVF_CPS_NODE_SUSPECT];
    nodes.lost = s.nodes_by_state[KVF_CPS_NODE_LOST];
    Kvfence__V1__Stats rs = KVFENCE__V1__STATS__INIT;
    rs.rooms = &rooms;
    rs.leases = &leases;
    rs.nodes = &nodes;
    rs.notices_pending = s.notices_pending;
    rs.notices_sent = s.notices_sent;
    rs.notices_resent = s.notices_resent;
    rs.reports_stale = s.reports_stale;
    rs.reports_tokenless = s.reports_tokenless;
    rs.reports_unknown = s.reports_unknown;
    rs.rooms_past_deadline = s.rooms_past_deadline;
    rs.fences_requested = s.fences_requested;
    rs.generation = s.generation;
    rs.leases_awaiting_host_proof = s.leases_awaiting_host_proof;
    rs.uptime_ms = age_ms(now, ctx->started_at);
    kvf_svc_reply(call, &rs.base);
}

/* ---- RoomInfo ------------------------------------------------------------------ */

/* Everything one RoomInfo points to, freed by room_info_free(). */
struct room_info_buf {
    Kvfence__V1__RoomInfo info;
    Kvfence__V1__RoomKey key;
    Kvfence__V1__AbortToken token;
    size_t n;
    Kvfence__V1__ParticipantInfo **pp;
    struct part_buf *parts;
};

struct part_buf {
    Kvfence__V1__ParticipantInfo pi;
    struct kvf_svc_lease_buf lb;
};

static void room_info_free(struct room_info_buf *b)
{
    for (size_t i = 0; b->parts && i < b->n; i++)
        kvf_svc_lease_free(&b->parts[i].lb);
    free(b->parts);
    free(b->pp);
}

static void room_info_fill(struct room_info_buf *b, const struct kvf_cps_room_view *v,
                           kvf_time_ns now)
{
    kvfence__v1__room_info__init(&b->info);
    kvfence__v1__room_key__init(&b->key);
    kvfence__v1__abort_token__init(&b->token);
    b->key.room_id = v->key.room_id;
    b->key.generation = v->key.generation;
    b->info.room = &b->key;
    b->info.state = (Kvfence__V1__RoomState)v->state;
    if (v->state == KVF_CPS_ROOM_ABORTING || v->state == KVF_CPS_ROOM_ABORTED) {
        b->info.abort_reason = (Kvfence__V1__AbortReason)v->abort_reason;
        b->token.hi = v->token.hi;
        b->token.lo = v->token.lo;
        b->info.token = &b->token;
    }
    b->info.expected_sources = v->expected_sources;
    b->info.expected_sinks = v->expected_sinks;
    b->info.protocol_version = v->protocol_version;
    b->info.age_ms = age_ms(now, v->created_at);
    b->info.state_age_ms = age_ms(now, v->state_since);
    b->info.past_drain_deadline = v->escalated;
    b->info.participant_count = (uint32_t)v->participant_count;
}

/* Adds the participants (GetRoom). Returns 0 or -ENOMEM. */
static int room_info_participants(struct room_info_buf *b, const struct kvf_cps *cps,
                                  const struct kvf_cps_room_view *v)
{
    size_t n = v->participant_count;
    b->parts = calloc(n ? n : 1, sizeof *b->parts);
    b->pp = calloc(n ? n : 1, sizeof *b->pp);
    if (!b->parts || !b->pp) {
        return -ENOMEM;
    }
    b->n = n;
    for (size_t i = 0; i < n; i++) {
        struct part_buf *p = &b->parts[i];
        struct kvf_cps_participant_view pv;
        kvfence__v1__participant_info__init(&p->pi);
        b->pp[i] = &p->pi;
        if (kvf_cps_room_participant(cps, v->key, i, &pv) < 0)
            continue;
        if (kvf_svc_lease_fill(&p->lb, v->key, &pv) != 0)
            return -ENOMEM;
        p->pi.participant = &p->lb.part;
        p->pi.lease = &p->lb.lease;
        p->pi.node_incarnation = pv.incarnation;
        p->pi.completed = pv.completed;
        p->pi.drained = pv.node_drained;
        /* Only where a fence happened: node_fenced alone also holds in a
         * room with no other node to fence with. */
        p->pi.fenced = pv.node_fenced && pv.node_fences > 0;
        p->pi.notice_attempts = pv.notice_attempts;
    }
    b->info.n_participants = n;
    b->info.participants = b->pp;
    return 0;
}

/* ---- GetRoom ------------------------------------------------------------------ */

static int get_room_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    return kvf_svc_check_room_key(((const Kvfence__V1__GetRoomRequest *)m)->room, false, err);
}

static void get_room_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                         const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__GetRoomRequest *rq = (const Kvfence__V1__GetRoomRequest *)m;
    kvf_room_key k = {.room_id = rq->room->room_id, .generation = rq->room->generation};
    struct kvf_cps_room_view v;
    struct kvf_error err;
    kvf_error_clear(&err);
    if (kvf_cps_room_get(ctx->cps, k, &v) < 0) {
        if (k.generation) {
            kvf_error_set(&err, -ENOENT, "room %" PRIu64 ":%" PRIu64 ": unknown", k.room_id,
                          k.generation);
        } else {
            kvf_error_set(&err, -ENOENT, "room %" PRIu64 ": unknown", k.room_id);
        }
        kvf_svc_fail(call, -ENOENT, &err);
        return;
    }
    struct room_info_buf b = {0};
    room_info_fill(&b, &v, now);
    if (room_info_participants(&b, ctx->cps, &v) < 0) {
        room_info_free(&b);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    kvf_svc_reply(call, &b.info.base);
    room_info_free(&b);
}

/* ---- ListRooms ---------------------------------------------------------------- */

static int page_validate(uint32_t page_size, const char *page_token, struct kvf_error *err)
{
    if (page_size > KVF_SVC_PAGE_SIZE_MAX) {
        return kvf_error_set(err, -EINVAL, "page_size: at most %u, got %" PRIu32,
                             KVF_SVC_PAGE_SIZE_MAX, page_size);
    }
    int rc = kvf_svc_check_len("page_token", page_token, KVF_SVC_PAGE_TOKEN_MAX, err);
    if (rc < 0) {
        return rc;
    }
    if (page_token && page_token[0]) {
        char *end = NULL;
        errno = 0;
        unsigned long long off = strtoull(page_token, &end, 10);
        (void)off;
        if (errno || !end || *end || page_token[0] < '0' || page_token[0] > '9') {
            return kvf_error_set(err, -EINVAL, "page_token: not a token this server issued");
        }
    }
    return 0;
}

/* The filters of a listing: a node id and a list of states, bounded. */
static int list_filter_validate(const char *node_id, size_t n_states, struct kvf_error *err)
{
    if (n_states > KVF_SVC_FILTER_MAX) {
        return kvf_error_set(err, -EINVAL, "states: more than %u filters", KVF_SVC_FILTER_MAX);
    }
    return kvf_svc_check_len("node_id", node_id, KVF_SVC_ID_MAX, err);
}

static int list_rooms_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__ListRoomsRequest *rq = (const Kvfence__V1__ListRoomsRequest *)m;
    int rc = list_filter_validate(rq->node_id, rq->n_states, err);
    if (rc < 0) {
        return rc;
    }
    for (size_t i = 0; i < rq->n_states; i++) {
        if (rq->states[i] < KVFENCE__V1__ROOM_STATE__ROOM_STATE_OPENING ||
            rq->states[i] > KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED) {
            return kvf_error_set(err, -EINVAL, "states[%zu]: not a room state", i);
        }
    }
    return page_validate(rq->page_size, rq->page_token, err);
}

struct room_list {
    struct kvf_cps_room_view *v;
    size_t n, cap;
};

static int collect_room(void *vctx, const struct kvf_cps_room_view *view)
{
    struct room_list *l = vctx;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        struct kvf_cps_room_view *nv = realloc(l->v, cap * sizeof *nv);
        if (!nv) {
            return -ENOMEM;
        }
        l->v = nv;
        l->cap = cap;
    }
    l->v[l->n++] = *view;
    return 0;
}

static int room_cmp(const void *a, const void *b)
{
    const struct kvf_cps_room_view *x = a, *y = b;
    if (x->created_at != y->created_at) {
        return x->created_at < y->created_at ? -1 : 1;
    }
    if (x->key.room_id != y->key.room_id) {
        return x->key.room_id < y->key.room_id ? -1 : 1;
    }
    if (x->key.generation != y->key.generation) {
        return x->key.generation < y->key.generation ? -1 : 1;
    }
    return 0;
}

static bool room_matches(const struct kvf_cps *cps, const Kvfence__V1__ListRoomsRequest *rq,
                         const struct kvf_cps_room_view *v, kvf_time_ns now)
{
    if (rq->n_states) {
        bool ok = false;
        for (size_t i = 0; i < rq->n_states; i++) {
            ok = ok || (int)rq->states[i] == (int)v->state;
        }
        if (!ok) {
            return false;
        }
    }
    if (rq->min_age_ms && age_ms(now, v->created_at) < rq->min_age_ms) {
        return false;
    }
    if (rq->node_id && rq->node_id[0]) {
        for (size_t i = 0; i < v->participant_count; i++) {
            struct kvf_cps_participant_view pv;
            if (kvf_cps_room_participant(cps, v->key, i, &pv) == 0 &&
                strcmp(pv.node_id, rq->node_id) == 0) {
                return true;
            }
        }
        return false;
    }
    return true;
}

/*
 * Paging: the token is the offset into the filtered list, oldest first. It is
 * not stable across changes (a room created or expired between two pages
 * shifts the rest); good enough for an operator's listing in this version.
 */
static void list_rooms_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                           const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__ListRoomsRequest *rq = (const Kvfence__V1__ListRoomsRequest *)m;
    struct room_list l = {0};
    if (kvf_cps_room_foreach(ctx->cps, collect_room, &l) != 0) {
        free(l.v);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    if (l.n > 1) {
        qsort(l.v, l.n, sizeof *l.v, room_cmp);
    }
    size_t kept = 0;
    for (size_t i = 0; i < l.n; i++) {
        if (room_matches(ctx->cps, rq, &l.v[i], now)) {
            l.v[kept++] = l.v[i];
        }
    }
    size_t off = (rq->page_token && rq->page_token[0]) ? strtoull(rq->page_token, NULL, 10) : 0;
    if (off > kept) {
        off = kept;
    }
    size_t page = rq->page_size ? rq->page_size : KVF_SVC_PAGE_SIZE_DEFAULT;
    size_t n = kept - off < page ? kept - off : page;
    struct room_info_buf *bufs = calloc(n ? n : 1, sizeof *bufs);
    Kvfence__V1__RoomInfo **infos = calloc(n ? n : 1, sizeof *infos);
    if (!bufs || !infos) {
        free(bufs);
        free(infos);
        free(l.v);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        room_info_fill(&bufs[i], &l.v[off + i], now);
        infos[i] = &bufs[i].info;
    }
    char next[32] = "";
    if (off + n < kept) {
        snprintf(next, sizeof next, "%zu", off + n);
    }
    Kvfence__V1__ListRoomsResponse rs = KVFENCE__V1__LIST_ROOMS_RESPONSE__INIT;
    rs.n_rooms = n;
    rs.rooms = infos;
    rs.next_page_token = next;
    kvf_svc_reply(call, &rs.base);
    free(bufs);
    free(infos);
    free(l.v);
}

/* ---- GetNode ------------------------------------------------------------------ */

static int require_node_id(const char *node_id, struct kvf_error *err)
{
    if (!node_id || !node_id[0]) {
        return kvf_error_set(err, -EINVAL, "node_id: required");
    }
    return kvf_svc_check_len("node_id", node_id, KVF_SVC_ID_MAX, err);
}

static int get_node_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    return require_node_id(((const Kvfence__V1__GetNodeRequest *)m)->node_id, err);
}

/* Everything one NodeInfo points to, freed by node_info_free(). */
struct node_info_buf {
    Kvfence__V1__NodeInfo info;
    Kvfence__V1__CapabilitySet caps;
    char *names[KVF_FEATURE_COUNT];
    Kvfence__V1__Pool *pools;
    Kvfence__V1__Pool **pp;
};

static void node_info_free(struct node_info_buf *b)
{
    free(b->pools);
    free(b->pp);
}

/*
 * Fills b->info for the view `v` (whose node_id must outlive the reply).
 * Points into the core's pools and the session's Hello: reply before the
 * state thread's next job. Returns 0 or -ENOMEM.
 */
static int node_info_fill(struct kvf_svc_ctx *ctx, const struct kvf_cps_node_view *v,
                          const char *node_id, kvf_time_ns now, struct node_info_buf *b)
{
    memset(b, 0, sizeof *b);
    kvfence__v1__node_info__init(&b->info);
    kvfence__v1__capability_set__init(&b->caps);
    Kvfence__V1__NodeInfo *ni = &b->info;
    ni->node_id = (char *)node_id;
    ni->incarnation = v->incarnation;
    ni->state = (Kvfence__V1__NodeState)v->state;
    ni->protocol_version = v->protocol_version;
    ni->room_count = (uint32_t)v->room_count;
    if (v->state_since != 0) { /* rounded up: 0 on the wire is "unknown" */
        uint64_t ns = now > v->state_since ? now - v->state_since : 0;
        uint64_t ms = (ns + KVF_NS_PER_MS - 1) / KVF_NS_PER_MS;
        ni->state_age_ms = ms ? ms : 1;
    }

    uint64_t last_seen_ms = 0;
    const Kvfence__V1__Hello *hello = kvf_svc_session_view(
        ctx, node_id, v->incarnation, (uint64_t)(now - ctx->clock_offset), &last_seen_ms);
    if (hello != NULL) {
        ni->last_seen_ms = last_seen_ms;
        ni->n_endpoints = hello->n_endpoints;
        ni->endpoints = hello->endpoints;
        ni->software_version = hello->software_version;
    }
    if (hello != NULL && hello->capabilities != NULL) {
        ni->capabilities = hello->capabilities;
    } else {
        b->caps.protocol_min = v->protocol_min;
        b->caps.protocol_max = v->protocol_max;
        b->caps.n_features = kvf_svc_features_to_names(v->features, b->names);
        b->caps.features = b->names;
        ni->capabilities = &b->caps;
    }

    struct kvf_cps_node_detail d;
    if (kvf_cps_node_detail_get(ctx->cps, node_id, &d) == 0) {
        ni->notices_pending = d.notices_pending;
        ni->fenced_by = d.fenced_by;
        ni->fences_pending = d.fences_pending;
    }

    /* The pools as the core holds them (sizes; addressing is the node's). */
    size_t n = v->pool_count;
    b->pools = calloc(n ? n : 1, sizeof *b->pools);
    b->pp = calloc(n ? n : 1, sizeof *b->pp);
    if (b->pools == NULL || b->pp == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        struct kvf_cps_pool cp;
        if (kvf_cps_node_pool_get(ctx->cps, node_id, i, &cp) != 0)
            break;
        Kvfence__V1__Pool *pl = &b->pools[i];
        kvfence__v1__pool__init(pl);
        pl->pool_id = cp.pool_id;
        pl->page_size = cp.page_size;
        pl->page_count = cp.page_count;
        pl->pool_key = cp.key != NULL ? (char *)cp.key : "";
        b->pp[ni->n_pools++] = pl;
    }
    ni->pools = b->pp;
    return 0;
}

static void get_node_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                         const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__GetNodeRequest *rq = (const Kvfence__V1__GetNodeRequest *)m;
    struct kvf_cps_node_view v;
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_cps_node_get(ctx->cps, rq->node_id, &v);
    if (rc < 0) {
        kvf_error_set(&err, rc, "node_id: node %s is unknown", rq->node_id);
        kvf_svc_fail(call, rc, &err);
        return;
    }
    struct node_info_buf b;
    if (node_info_fill(ctx, &v, rq->node_id, now, &b) != 0) {
        node_info_free(&b);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    kvf_svc_reply(call, &b.info.base);
    node_info_free(&b);
}

/* ---- ListNodes ------------------------------------------------------------------ */

struct node_list {
    struct kvf_cps_node_view *v;
    char (*ids)[129]; /* the views' ids, copied: views are valid during foreach only */
    size_t n, cap;
};

static int collect_node(void *vctx, const struct kvf_cps_node_view *view)
{
    struct node_list *l = vctx;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        struct kvf_cps_node_view *v = realloc(l->v, cap * sizeof *v);
        if (!v) {
            return -ENOMEM;
        }
        l->v = v;
        char(*ids)[129] = realloc(l->ids, cap * sizeof *ids);
        if (!ids) {
            return -ENOMEM;
        }
        l->ids = ids;
        l->cap = cap;
    }
    l->v[l->n] = *view;
    snprintf(l->ids[l->n], sizeof l->ids[l->n], "%s", view->node_id);
    l->n++;
    return 0;
}

static int list_nodes_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__ListNodesRequest *rq = (const Kvfence__V1__ListNodesRequest *)m;
    int rc = list_filter_validate(NULL, rq->n_states, err);
    if (rc < 0) {
        return rc;
    }
    return page_validate(rq->page_size, rq->page_token, err);
}

static void list_nodes_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                           const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__ListNodesRequest *rq = (const Kvfence__V1__ListNodesRequest *)m;
    struct node_list l = {0};
    if (kvf_cps_node_foreach(ctx->cps, collect_node, &l) != 0) {
        free(l.v);
        free(l.ids);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    /* Sorted by id (insertion sort: node counts are small), filtered by state. */
    size_t kept = 0;
    for (size_t i = 0; i < l.n; i++) {
        bool want = rq->n_states == 0;
        for (size_t k = 0; k < rq->n_states && !want; k++) {
            want = (int)rq->states[k] == (int)l.v[i].state;
        }
        if (!want) {
            continue;
        }
        size_t j = kept++;
        struct kvf_cps_node_view v = l.v[i];
        char id[129];
        memcpy(id, l.ids[i], sizeof id);
        while (j > 0 && strcmp(l.ids[j - 1], id) > 0) {
            l.v[j] = l.v[j - 1];
            memcpy(l.ids[j], l.ids[j - 1], sizeof id);
            j--;
        }
        l.v[j] = v;
        memcpy(l.ids[j], id, sizeof id);
    }
    size_t off = (rq->page_token && rq->page_token[0]) ? strtoull(rq->page_token, NULL, 10) : 0;
    if (off > kept) {
        off = kept;
    }
    size_t page = rq->page_size ? rq->page_size : KVF_SVC_PAGE_SIZE_DEFAULT;
    size_t n = kept - off < page ? kept - off : page;
    struct node_info_buf *bufs = calloc(n ? n : 1, sizeof *bufs);
    Kvfence__V1__NodeInfo **ip = calloc(n ? n : 1, sizeof *ip);
    int fill_rc = bufs != NULL && ip != NULL ? 0 : -ENOMEM;
    for (size_t i = 0; fill_rc == 0 && i < n; i++) {
        fill_rc = node_info_fill(ctx, &l.v[off + i], l.ids[off + i], now, &bufs[i]);
        ip[i] = &bufs[i].info;
    }
    if (fill_rc != 0) {
        for (size_t i = 0; bufs != NULL && i < n; i++)
            node_info_free(&bufs[i]);
        free(bufs);
        free(ip);
        free(l.v);
        free(l.ids);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    char next[32] = "";
    if (off + n < kept) {
        snprintf(next, sizeof next, "%zu", off + n);
    }
    Kvfence__V1__ListNodesResponse rs = KVFENCE__V1__LIST_NODES_RESPONSE__INIT;
    rs.n_nodes = n;
    rs.nodes = ip;
    rs.next_page_token = next;
    kvf_svc_reply(call, &rs.base);
    for (size_t i = 0; i < n; i++)
        node_info_free(&bufs[i]);
    free(bufs);
    free(ip);
    free(l.v);
    free(l.ids);
}

/* ---- ListLeases ----------------------------------------------------------------- */

static int list_leases_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__ListLeasesRequest *rq = (const Kvfence__V1__ListLeasesRequest *)m;
    int rc = list_filter_validate(rq->node_id, rq->n_states, err);
    if (rc < 0) {
        return rc;
    }
    return page_validate(rq->page_size, rq->page_token, err);
}

static bool lease_matches(const Kvfence__V1__ListLeasesRequest *rq,
                          const struct kvf_cps_participant_view *pv)
{
    if (rq->node_id && rq->node_id[0] && strcmp(rq->node_id, pv->node_id) != 0) {
        return false;
    }
    bool want = rq->n_states == 0;
    for (size_t k = 0; k < rq->n_states && !want; k++) {
        want = (int)rq->states[k] == (int)pv->lease_state;
    }
    return want;
}

static void list_leases_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                            const ProtobufCMessage *m, kvf_time_ns now)
{
    (void)now;
    const Kvfence__V1__ListLeasesRequest *rq = (const Kvfence__V1__ListLeasesRequest *)m;
    /* Rooms in the order ListRooms gives them, then participants in order. */
    struct room_list l = {0};
    if (kvf_cps_room_foreach(ctx->cps, collect_room, &l) != 0) {
        free(l.v);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    if (l.n > 1) {
        qsort(l.v, l.n, sizeof *l.v, room_cmp);
    }
    size_t off = (rq->page_token && rq->page_token[0]) ? strtoull(rq->page_token, NULL, 10) : 0;
    size_t page = rq->page_size ? rq->page_size : KVF_SVC_PAGE_SIZE_DEFAULT;
    struct kvf_svc_lease_buf *lb = calloc(page, sizeof *lb);
    Kvfence__V1__Lease **lp = calloc(page, sizeof *lp);
    if (!lb || !lp) {
        free(lb);
        free(lp);
        free(l.v);
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    size_t seen = 0, n = 0;
    bool more = false;
    for (size_t i = 0; i < l.n && !more; i++) {
        if (rq->room_id && l.v[i].key.room_id != rq->room_id) {
            continue;
        }
        for (size_t p = 0; p < l.v[i].participant_count; p++) {
            struct kvf_cps_participant_view pv;
            if (kvf_cps_room_participant(ctx->cps, l.v[i].key, p, &pv) != 0 ||
                !lease_matches(rq, &pv)) {
                continue;
            }
            if (seen++ < off) {
                continue;
            }
            if (n == page) {
                more = true;
                break;
            }
            if (kvf_svc_lease_fill(&lb[n], l.v[i].key, &pv) != 0) {
                more = true; /* out of memory: stop here; the token resumes */
                break;
            }
            lp[n] = &lb[n].lease;
            n++;
        }
    }
    char next[32] = "";
    if (more) {
        snprintf(next, sizeof next, "%zu", off + n);
    }
    Kvfence__V1__ListLeasesResponse rs = KVFENCE__V1__LIST_LEASES_RESPONSE__INIT;
    rs.n_leases = n;
    rs.leases = lp;
    rs.next_page_token = next;
    kvf_svc_reply(call, &rs.base);
    for (size_t i = 0; i < n; i++) {
        kvf_svc_lease_free(&lb[i]);
    }
    free(lb);
    free(lp);
    free(l.v);
}

/* ---- FenceNode -------------------------------------------------------------------- */

static int fence_node_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    return require_node_id(((const Kvfence__V1__FenceNodeRequest *)m)->node_id, err);
}

static void fence_node_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                           const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__FenceNodeRequest *rq = (const Kvfence__V1__FenceNodeRequest *)m;
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_cps_stats before, after;
    kvf_cps_stats_get(ctx->cps, &before);
    int rc = kvf_cps_admin_fence(ctx->cps, rq->node_id, now, &err);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }
    kvf_cps_stats_get(ctx->cps, &after);
    struct kvf_cps_node_view v;
    Kvfence__V1__FenceNodeResponse rs = KVFENCE__V1__FENCE_NODE_RESPONSE__INIT;
    if (kvf_cps_node_get(ctx->cps, rq->node_id, &v) == 0) {
        rs.incarnation = v.incarnation;
    }
    rs.fencers = (uint32_t)(after.fences_requested - before.fences_requested);
    kvf_svc_reply(call, &rs.base);
}

/* ---- AdminAbortRoom ------------------------------------------------------------- */

static int admin_abort_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__AdminAbortRoomRequest *rq = (const Kvfence__V1__AdminAbortRoomRequest *)m;
    return kvf_svc_abort_validate(rq->room, rq->detail, err);
}

static void admin_abort_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                            const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__AdminAbortRoomRequest *rq = (const Kvfence__V1__AdminAbortRoomRequest *)m;
    kvf_svc_abort_run(ctx, call, rq->room, rq->detail, KVF_CPS_ABORT_ADMIN, now);
}

const struct kvf_svc_method kvf_svc_admin_methods[] = {
    {"/kvfence.v1.Admin/Ping", &kvfence__v1__ping_request__descriptor, NULL, ping_run},
    {"/kvfence.v1.Admin/GetStats", &kvfence__v1__get_stats_request__descriptor, NULL, stats_run},
    {"/kvfence.v1.Admin/GetRoom", &kvfence__v1__get_room_request__descriptor, get_room_validate,
     get_room_run},
    {"/kvfence.v1.Admin/ListRooms", &kvfence__v1__list_rooms_request__descriptor,
     list_rooms_validate, list_rooms_run},
    {"/kvfence.v1.Admin/GetNode", &kvfence__v1__get_node_request__descriptor, get_node_validate,
     get_node_run},
    {"/kvfence.v1.Admin/AdminAbortRoom", &kvfence__v1__admin_abort_room_request__descriptor,
     admin_abort_validate, admin_abort_run, true},
    {"/kvfence.v1.Admin/ListNodes", &kvfence__v1__list_nodes_request__descriptor,
     list_nodes_validate, list_nodes_run},
    {"/kvfence.v1.Admin/ListLeases", &kvfence__v1__list_leases_request__descriptor,
     list_leases_validate, list_leases_run},
    {"/kvfence.v1.Admin/FenceNode", &kvfence__v1__fence_node_request__descriptor,
     fence_node_validate, fence_node_run, true},
};
const size_t kvf_svc_admin_method_count =
    sizeof kvf_svc_admin_methods / sizeof kvf_svc_admin_methods[0];
