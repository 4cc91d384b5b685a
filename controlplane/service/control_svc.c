/*
 * control_svc.c: kvfence.v1.Control (JoinRoom, ExtendLease, CompleteRoom,
 * AbortRoom) over the state core. Validators run on CQ threads; the run
 * functions on the state thread (service.c). JoinRoom and ExtendLease take
 * their pages as ranges or as a page set (svc_convert.c decodes it on the
 * state thread: a malformed set is refused there, changing nothing, and a
 * refusal is never logged).
 *
 * WatchLeases is not served in this version (UNIMPLEMENTED).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kvfence/v1/control.pb-c.h"
#include "rpc_server.h"
#include "service_internal.h"

#define DETAIL_MAX 256u

/* ---- JoinRoom ------------------------------------------------------------------- */

static int join_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__JoinRoomRequest *rq = (const Kvfence__V1__JoinRoomRequest *)m;
    int rc = kvf_svc_check_room_id("room_id", rq->room_id, err);
    if (rc < 0) {
        return rc;
    }
    if (rq->expected_sources == 0) {
        return kvf_error_set(err, -EINVAL, "expected_sources: must be >= 1");
    }
    if (rq->expected_sinks == 0) {
        return kvf_error_set(err, -EINVAL, "expected_sinks: must be >= 1");
    }
    if (!rq->participant) {
        return kvf_error_set(err, -EINVAL, "participant: required");
    }
    if (!rq->participant->node_id || !rq->participant->node_id[0]) {
        return kvf_error_set(err, -EINVAL, "participant.node_id: required");
    }
    rc = kvf_svc_check_len("participant.node_id", rq->participant->node_id, KVF_SVC_ID_MAX, err);
    if (rc < 0) {
        return rc;
    }
    if (rq->participant->role != KVFENCE__V1__ROLE__ROLE_SOURCE &&
        rq->participant->role != KVFENCE__V1__ROLE__ROLE_SINK) {
        return kvf_error_set(err, -EINVAL, "participant.role: must be ROLE_SOURCE or ROLE_SINK");
    }
    if (!rq->engine_capabilities) {
        return kvf_error_set(err, -EINVAL, "engine_capabilities: required");
    }
    const Kvfence__V1__CapabilitySet *caps = rq->engine_capabilities;
    if (caps->n_features > KVF_SVC_FEATURES_MAX) {
        return kvf_error_set(err, -EINVAL, "engine_capabilities.features: more than %u names",
                             KVF_SVC_FEATURES_MAX);
    }
    for (size_t i = 0; i < caps->n_features; i++) {
        if (strnlen(caps->features[i], KVF_SVC_FEATURE_NAME_MAX + 1) > KVF_SVC_FEATURE_NAME_MAX) {
            return kvf_error_set(err, -EINVAL,
                                 "engine_capabilities.features[%zu]: longer than %u bytes", i,
                                 KVF_SVC_FEATURE_NAME_MAX);
        }
    }
    return kvf_svc_pages_check(rq->ranges, rq->n_ranges, rq->page_set, err);
}

static void join_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call, const ProtobufCMessage *m,
                     kvf_time_ns now)
{
    const Kvfence__V1__JoinRoomRequest *rq = (const Kvfence__V1__JoinRoomRequest *)m;
    struct kvf_error err;
    kvf_error_clear(&err);

    struct kvf_svc_pages pages;
    int rc = kvf_svc_pages_decode(rq->ranges, rq->n_ranges, rq->page_set,
                                  kvf_cps_max_ranges(ctx->cps), &pages, &err);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }
    struct kvf_cps_join j = {
        .room_id = rq->room_id,
        .expected_sources = rq->expected_sources,
        .expected_sinks = rq->expected_sinks,
        .node_id = rq->participant->node_id,
        .rank = rq->participant->rank,
        .role = (enum kvf_cps_role)rq->participant->role,
        .engine_protocol_min = rq->engine_capabilities->protocol_min,
        .engine_protocol_max = rq->engine_capabilities->protocol_max,
        .engine_features = kvf_svc_features_from_names(rq->engine_capabilities->features,
                                                       rq->engine_capabilities->n_features),
        .pool_id = rq->pool_id,
        .ranges = pages.v,
        .range_count = pages.n,
        .pages_field = pages.field,
        .ranges_adopt_p = &pages.v, /* the lease keeps the decoded runs: no copy */
    };
    struct kvf_cps_join_result res;
    rc = kvf_cps_join(ctx->cps, &j, now, &res, &err);
    kvf_svc_pages_free(&pages);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }
    struct kvf_cps_room_view view;
    uint32_t version = 0;
    if (kvf_cps_room_get(ctx->cps, res.key, &view) == 0) {
        version = view.protocol_version;
    }
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = res.key.room_id;
    key.generation = res.key.generation;
    Kvfence__V1__JoinRoomResponse rs = KVFENCE__V1__JOIN_ROOM_RESPONSE__INIT;
    rs.room = &key;
    rs.lease_id = res.lease_id;
    rs.state = (Kvfence__V1__RoomState)res.room_state;
    rs.protocol_version = version;
    kvf_svc_reply(call, &rs.base);
}

/* ---- ExtendLease --------------------------------------------------------------- */

static int extend_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__ExtendLeaseRequest *rq = (const Kvfence__V1__ExtendLeaseRequest *)m;
    int rc = kvf_svc_check_room_key(rq->room, true, err);
    if (rc < 0) {
        return rc;
    }
    if (rq->lease_id == 0) {
        return kvf_error_set(err, -EINVAL, "lease_id: required (> 0)");
    }
    return kvf_svc_pages_check(rq->ranges, rq->n_ranges, rq->page_set, err);
}

static void extend_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                       const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__ExtendLeaseRequest *rq = (const Kvfence__V1__ExtendLeaseRequest *)m;
    struct kvf_error err;
    kvf_error_clear(&err);
    kvf_room_key k = {.room_id = rq->room->room_id, .generation = rq->room->generation};

    struct kvf_svc_pages pages;
    int rc = kvf_svc_pages_decode(rq->ranges, rq->n_ranges, rq->page_set,
                                  kvf_cps_max_ranges(ctx->cps), &pages, &err);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }
    rc = kvf_cps_lease_extend_named(ctx->cps, k, rq->lease_id, pages.v, pages.n, pages.field, now,
                                    &err);
    kvf_svc_pages_free(&pages);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }

    /* Return the lease whole. */
    struct kvf_cps_participant_view pv;
    if (kvf_svc_find_lease(ctx->cps, k, rq->lease_id, &pv) != 0) {
        kvf_error_set(&err, -EIO, "lease %" PRIu64 ": extended but not found afterwards",
                      rq->lease_id);
        kvf_svc_fail(call, -EIO, &err);
        return;
    }
    struct kvf_svc_lease_buf lb;
    if (kvf_svc_lease_fill(&lb, k, &pv) != 0) {
        kvf_svc_fail(call, -ENOMEM, NULL);
        return;
    }
    Kvfence__V1__ExtendLeaseResponse rs = KVFENCE__V1__EXTEND_LEASE_RESPONSE__INIT;
    rs.lease = &lb.lease;
    kvf_svc_reply(call, &rs.base);
    kvf_svc_lease_free(&lb);
}

/* ---- CompleteRoom ------------------------------------------------------------ */

/*
 * The engine's CompleteRoom is a declaration, not a proof (control.proto): the
 * room completes only when every participant's node attests completion
 * (kvf_cps_report_completed, from its node session).
 * So this checks the declaration against the core (room, generation,
 * participant, state), records nothing, and answers the room's state.
 */
static int complete_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__CompleteRoomRequest *rq = (const Kvfence__V1__CompleteRoomRequest *)m;
    int rc = kvf_svc_check_room_key(rq->room, true, err);
    if (rc < 0) {
        return rc;
    }
    if (!rq->participant) {
        return kvf_error_set(err, -EINVAL, "participant: required");
    }
    if (!rq->participant->node_id || !rq->participant->node_id[0]) {
        return kvf_error_set(err, -EINVAL, "participant.node_id: required");
    }
    if (rq->participant->role != KVFENCE__V1__ROLE__ROLE_SOURCE &&
        rq->participant->role != KVFENCE__V1__ROLE__ROLE_SINK) {
        return kvf_error_set(err, -EINVAL, "participant.role: must be ROLE_SOURCE or ROLE_SINK");
    }
    return 0;
}

static void complete_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                         const ProtobufCMessage *m, kvf_time_ns now)
{
    const Kvfence__V1__CompleteRoomRequest *rq = (const Kvfence__V1__CompleteRoomRequest *)m;
    struct kvf_error err;
    kvf_error_clear(&err);
    (void)now;
    kvf_room_key k = {.room_id = rq->room->room_id, .generation = rq->room->generation};
    kvf_room_key cur = {.room_id = rq->room->room_id, .generation = 0};
    struct kvf_cps_room_view view;

    if (kvf_cps_room_get(ctx->cps, k, &view) < 0) {
        if (kvf_cps_room_get(ctx->cps, cur, &view) == 0) {
            kvf_error_set(&err, -ESTALE,
                          "room.generation: %" PRIu64 " is stale, room %" PRIu64
                          " is at generation %" PRIu64,
                          k.generation, k.room_id, view.key.generation);
            kvf_svc_fail(call, -ESTALE, &err);
        } else {
            kvf_error_set(&err, -ENOENT, "room %" PRIu64 ":%" PRIu64 ": unknown", k.room_id,
                          k.generation);
            kvf_svc_fail(call, -ENOENT, &err);
        }
        return;
    }
    if (kvf_cps_room_get(ctx->cps, cur, &view) == 0 && view.key.generation != k.generation) {
        kvf_error_set(&err, -ESTALE,
                      "room.generation: %" PRIu64 " is stale, room %" PRIu64
                      " is at generation %" PRIu64,
                      k.generation, k.room_id, view.key.generation);
        kvf_svc_fail(call, -ESTALE, &err);
        return;
    }
    kvf_cps_room_get(ctx->cps, k, &view);
    bool member = false;
    for (size_t i = 0; i < view.participant_count; i++) {
        struct kvf_cps_participant_view pv;
        if (kvf_cps_room_participant(ctx->cps, k, i, &pv) == 0 &&
            strcmp(pv.node_id, rq->participant->node_id) == 0 && pv.rank == rq->participant->rank &&
            (int)pv.role == (int)rq->participant->role) {
            member = true;
            break;
        }
    }
    if (!member) {
        kvf_error_set(&err, -ENOENT,
                      "participant: (%s, rank %" PRIu32 ", %s) is not in room %" PRIu64 ":%" PRIu64,
                      rq->participant->node_id, rq->participant->rank,
                      rq->participant->role == KVFENCE__V1__ROLE__ROLE_SOURCE ? "source" : "sink",
                      k.room_id, k.generation);
        kvf_svc_fail(call, -ENOENT, &err);
        return;
    }
    switch (view.state) {
    case KVF_CPS_ROOM_OPENING:
        kvf_error_set(&err, -EPERM, "room %" PRIu64 ":%" PRIu64 ": still OPENING", k.room_id,
                      k.generation);
        kvf_svc_fail(call, -EPERM, &err);
        return;
    case KVF_CPS_ROOM_ABORTING:
    case KVF_CPS_ROOM_ABORTED:
        kvf_error_set(&err, -ECANCELED,
                      "room %" PRIu64 ":%" PRIu64 ": %s; the pages come back through WatchLeases",
                      k.room_id, k.generation, kvf_cps_room_state_name(view.state));
        kvf_svc_fail(call, -ECANCELED, &err);
        return;
    default:
        break;
    }
    Kvfence__V1__CompleteRoomResponse rs = KVFENCE__V1__COMPLETE_ROOM_RESPONSE__INIT;
    rs.state = (Kvfence__V1__RoomState)view.state;
    kvf_svc_reply(call, &rs.base);
}

/* ---- AbortRoom (shared with Admin.AdminAbortRoom) -------------------------------- */

int kvf_svc_abort_validate(const Kvfence__V1__RoomKey *room, const char *detail,
                           struct kvf_error *err)
{
    int rc = kvf_svc_check_room_key(room, false, err);
    if (rc < 0) {
        return rc;
    }
    if (detail && strlen(detail) > DETAIL_MAX) {
        return kvf_error_set(err, -EINVAL, "detail: longer than %u bytes", DETAIL_MAX);
    }
    return 0;
}

void kvf_svc_abort_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call,
                       const Kvfence__V1__RoomKey *room, const char *detail,
                       enum kvf_cps_abort_reason reason, kvf_time_ns now)
{
    struct kvf_error err;
    kvf_error_clear(&err);
    kvf_room_key k = {.room_id = room->room_id, .generation = room->generation};
    struct kvf_cps_room_view before;
    bool already = false;
    if (kvf_cps_room_get(ctx->cps, k, &before) == 0) {
        already = before.state == KVF_CPS_ROOM_ABORTING || before.state == KVF_CPS_ROOM_ABORTED;
        k = before.key; /* generation filled in */
    }
    kvf_token token = {0, 0};
    int rc = kvf_cps_room_abort(ctx->cps, k, reason, now, &token, &err);
    if (rc < 0) {
        kvf_svc_fail(call, rc, &err);
        return;
    }
    struct kvf_cps_room_view after;
    if (kvf_cps_room_get(ctx->cps, k, &after) < 0) {
        kvf_error_set(&err, -EIO, "room %" PRIu64 ": aborted but not found afterwards", k.room_id);
        kvf_svc_fail(call, -EIO, &err);
        return;
    }
    if (!already) {
        kvf_log("info", "room %" PRIu64 ":%" PRIu64 " aborted (%s)%s%s", after.key.room_id,
                after.key.generation, kvf_cps_abort_reason_name(reason),
                detail && detail[0] ? ": " : "", detail ? detail : "");
    }
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = after.key.room_id;
    key.generation = after.key.generation;
    Kvfence__V1__AbortToken tok = KVFENCE__V1__ABORT_TOKEN__INIT;
    tok.hi = token.hi;
    tok.lo = token.lo;
    Kvfence__V1__AbortRoomResponse rs = KVFENCE__V1__ABORT_ROOM_RESPONSE__INIT;
    rs.room = &key;
    rs.token = &tok;
    rs.state = (Kvfence__V1__RoomState)after.state;
    rs.already_aborting = already;
    rs.reason = (Kvfence__V1__AbortReason)after.abort_reason;
    kvf_svc_reply(call, &rs.base);
}

static int abort_validate(const ProtobufCMessage *m, struct kvf_error *err)
{
    const Kvfence__V1__AbortRoomRequest *rq = (const Kvfence__V1__AbortRoomRequest *)m;
    return kvf_svc_abort_validate(rq->room, rq->detail, err);
}

static void abort_run(struct kvf_svc_ctx *ctx, struct kvf_rpc_call *call, const ProtobufCMessage *m,
                      kvf_time_ns now)
{
    const Kvfence__V1__AbortRoomRequest *rq = (const Kvfence__V1__AbortRoomRequest *)m;
    kvf_svc_abort_run(ctx, call, rq->room, rq->detail, KVF_CPS_ABORT_ENGINE, now);
}

const struct kvf_svc_method kvf_svc_control_methods[] = {
    {"/kvfence.v1.Control/JoinRoom", &kvfence__v1__join_room_request__descriptor, join_validate,
     join_run, true},
    {"/kvfence.v1.Control/ExtendLease", &kvfence__v1__extend_lease_request__descriptor,
     extend_validate, extend_run, true},
    {"/kvfence.v1.Control/CompleteRoom", &kvfence__v1__complete_room_request__descriptor,
     complete_validate, complete_run},
    {"/kvfence.v1.Control/AbortRoom", &kvfence__v1__abort_room_request__descriptor, abort_validate,
     abort_run, true},
};
const size_t kvf_svc_control_method_count =
    sizeof kvf_svc_control_methods / sizeof kvf_svc_control_methods[0];
