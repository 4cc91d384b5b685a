/*
 * cp_room.c: rooms, their participants and leases, abort, the node reports
 * and the drain barrier.
 *
 * A room-generation is OPENING while its participants join, ACTIVE once every
 * expected participant joined (only then do nodes learn each other's leases),
 * ABORTING from the first abort (one token, every lease RELEASING, a notice to
 * each node of the room, re-sent with backoff until that node drains), and
 * terminal (COMPLETED or ABORTED) with every lease RELEASED exactly once. The
 * barrier unit is the room-node (struct cp_rnode): a room is ABORTED when each
 * of its nodes drained with the current token or is fenced off (every other
 * live node of the room fenced it). No timer releases anything: the drain
 * deadline only escalates and asks for fences.
 *
 * Every call validates all of its input before it changes anything, reserves
 * what it will allocate (maps, heap slots, effects), and only then commits;
 * the page index marks are applied last and undone on conflict. The one
 * documented exception is a capability refusal, which also aborts the room.
 *
 * A room id maps to one room: its current generation. A join to an id whose
 * room is terminal replaces that tombstone with the next generation; messages
 * for the old generation then fail the generation check (R13).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

static const char *role_name(int role)
{
    return role == KVF_CPS_ROLE_SOURCE ? "source" : "sink";
}

bool cp_room_terminal(const struct cp_room *room)
{
    return room->state == KVF_CPS_ROOM_COMPLETED || room->state == KVF_CPS_ROOM_ABORTED;
}

struct cp_room *cp_room_lookup(const struct kvf_cps *st, kvf_room_key key)
{
    struct cp_room *room = cp_map_get(&st->rooms, key.room_id);
    if (room == NULL || (key.generation != 0 && key.generation != room->key.generation))
        return NULL;
    return room;
}

void cp_room_set_state(struct kvf_cps *st, struct cp_room *room, enum kvf_cps_room_state s,
                       kvf_time_ns now)
{
    int old = room->state;
    kvf_time_ns old_since = old != 0 ? room->state_since : 0;
    if (old != 0)
        st->stats.rooms_by_state[old]--;
    st->stats.rooms_by_state[s]++;
    room->state = (uint8_t)s;
    room->state_since = now;
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_ROOM_STATE);
    fx->key = room->key;
    fx->old_state = old;
    fx->new_state = s;
    fx->old_since = old_since;
    fx->since = now;
    if (s == KVF_CPS_ROOM_ABORTING || s == KVF_CPS_ROOM_ABORTED)
        fx->reason = (enum kvf_cps_abort_reason)room->reason;
}

static void lease_set(struct kvf_cps *st, struct cp_part *part, enum kvf_cps_lease_state s)
{
    st->stats.leases_by_state[part->lease_state]--;
    st->stats.leases_by_state[s]++;
    part->lease_state = (uint8_t)s;
}

/* The only place a lease becomes RELEASED: its pages leave the index and the
 * engine is told, once. */
static void lease_release(struct kvf_cps *st, struct cp_part *part)
{
    if (part->lease_state == KVF_CPS_LEASE_RELEASED)
        return;
    cp_pages_release(part->pool, part);
    lease_set(st, part, KVF_CPS_LEASE_RELEASED);
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_LEASE_RELEASED);
    fx->key = part->room->key;
    cp_fx_set_node(fx, part->rn->node);
    fx->lease_id = part->lease_id;
    fx->rank = part->rank;
    fx->role = (enum kvf_cps_role)part->role;
}

/*
 * Room updates are ordered by acknowledgements, not by time (docs/state-cores.md,
 * "Ordered room updates"). Every update sent to a node gets the room's next
 * version; the update carries the node's own leases as they are and the other
 * nodes' leases only as far as those nodes acknowledged them. When a node
 * acknowledges the newest update it was sent, its leases are published and
 * every other node of the room gets a new update with them.
 */
static void room_update_emit(struct kvf_cps *st, struct cp_rnode *rn)
{
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_ROOM_UPDATE);
    fx->key = rn->room->key;
    cp_fx_set_node(fx, rn->node);
    fx->version = rn->update_sent;
}

static void room_update_send(struct kvf_cps *st, struct cp_rnode *rn)
{
    rn->update_sent = ++rn->room->update_version;
    room_update_emit(st, rn);
}

/* The room went ACTIVE: each node learns its own leases and its peers. */
static void room_updates(struct kvf_cps *st, struct cp_room *room)
{
    for (uint32_t i = 0; i < room->nrnodes; i++)
        room_update_send(st, room->rnodes[i]);
}

void cp_room_update_reattach(struct kvf_cps *st, struct cp_rnode *rn)
{
    struct cp_room *room = rn->room;
    bool was_active =
        room->nsources == room->expected_sources && room->nsinks == room->expected_sinks;
    if (!was_active || (room->state != KVF_CPS_ROOM_ACTIVE && room->state != KVF_CPS_ROOM_ABORTING))
        return;
    /* The same version again (the node answers a duplicate again), or a new
     * one after a restore, where nothing is known acknowledged. */
    if (rn->update_sent == 0)
        room_update_send(st, rn);
    else
        room_update_emit(st, rn);
}

int kvf_cps_room_update_acked(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              kvf_room_key key, uint64_t version, kvf_time_ns now,
                              struct kvf_error *err)
{
    (void)now;
    struct cp_node *node;
    int rc = cp_node_for_report(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    struct cp_room *room = cp_map_get(&st->rooms, key.room_id);
    struct cp_rnode *rn = NULL;
    if (room != NULL && room->key.generation == key.generation)
        rn = cp_room_rnode(room, node);
    if (rn == NULL) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT,
                             "room_update_ack.room: node %s has no room %" PRIu64 ":%" PRIu64,
                             node_id, key.room_id, key.generation);
    }
    if (version == 0 || version > rn->update_sent) {
        st->stats.reports_stale++;
        return kvf_error_set(err, -ESTALE,
                             "room_update_ack.version: %" PRIu64 " was not sent to node %s "
                             "(last sent %" PRIu64 ")",
                             version, node_id, rn->update_sent);
    }
    /* A duplicate, an update a newer one replaced (its ack follows), or a
     * room past ACTIVE (nothing left to publish): nothing to do. */
    if (version <= rn->update_acked || version < rn->update_sent ||
        room->state != KVF_CPS_ROOM_ACTIVE) {
        st->stats.acks_ignored++;
        return 0;
    }
    if (cp_fx_reserve(st, room->nrnodes) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    rn->update_acked = version;
    /* The newest update sent to this node carried its leases as they are
     * now (any change since would have sent a newer one). */
    bool changed = false;
    for (uint32_t i = 0; i < room->nparts; i++) {
        struct cp_part *p = room->parts[i];
        if (p->rn != rn || (p->published && p->pub_nranges == p->nranges))
            continue;
        p->published = true;
        p->pub_nranges = p->nranges;
        changed = true;
    }
    for (uint32_t i = 0; changed && i < room->nrnodes; i++) {
        if (room->rnodes[i] != rn)
            room_update_send(st, room->rnodes[i]);
    }
    return 0;
}

bool cp_rnode_host_proven(const struct cp_rnode *rn)
{
    return rn->drained || rn->node->gone;
}

bool cp_part_awaiting(const struct cp_part *p)
{
    return p->lease_state == KVF_CPS_LEASE_RELEASING && cp_room_terminal(p->room);
}

/*
 * Terminal: every lease whose pages are proven safe on their own host is
 * RELEASED. A COMPLETED room's every node attested its ops finished; in an
 * ABORTED room a node that drained proved it, and so did an incarnation
 * witnessed gone. What is left is the lease of a LOST node that its peers
 * fenced (their pages are safe) but that may only be paused: it stays
 * RELEASING until its host proves it stopped (cp_rnode_host_proof), and the
 * room stays as it is, tombstone timer unarmed, until then. A lease with no
 * pages holds nothing.
 */
static void room_enter_terminal(struct kvf_cps *st, struct cp_room *room, enum kvf_cps_room_state s,
                                kvf_time_ns now)
{
    if (room->escalated && room->state == KVF_CPS_ROOM_ABORTING)
        st->stats.rooms_past_deadline--;
    cp_room_set_state(st, room, s, now);
    for (uint32_t i = 0; i < room->nrnodes; i++)
        room->rnodes[i]->node->room_count--;
    for (uint32_t i = 0; i < room->nparts; i++) {
        struct cp_part *p = room->parts[i];
        if (s == KVF_CPS_ROOM_COMPLETED || p->nranges == 0 || cp_rnode_host_proven(p->rn)) {
            lease_release(st, p);
        } else {
            room->nawaiting++;
            st->stats.leases_awaiting_host_proof++;
        }
    }
    if (room->nawaiting == 0)
        cp_heap_arm(&st->timers, &room->timer, now + st->opts.tombstone_ttl);
    else
        cp_heap_cancel(&st->timers, &room->timer); /* the drain deadline is moot now */
}

void cp_rnode_host_proof(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now)
{
    struct cp_room *room = rn->room;
    if (room->state == KVF_CPS_ROOM_ABORTING) {
        cp_room_try_finish(st, room, now);
        return;
    }
    if (!cp_room_terminal(room) || room->nawaiting == 0 || !cp_rnode_host_proven(rn))
        return;
    for (uint32_t i = 0; i < room->nparts; i++) {
        struct cp_part *p = room->parts[i];
        if (p->rn != rn || p->lease_state != KVF_CPS_LEASE_RELEASING)
            continue;
        lease_release(st, p);
        room->nawaiting--;
        st->stats.leases_awaiting_host_proof--;
    }
    if (room->nawaiting == 0)
        cp_heap_arm(&st->timers, &room->timer, now + st->opts.tombstone_ttl);
}

/* ---- the barrier ---------------------------------------------------------- */

/* A LOST incarnation that a newer one replaced: its process is gone, and
 * with it its queue pairs, sockets and memory registrations. */
static bool node_dead(const struct cp_node *n)
{
    return n->state == KVF_CPS_NODE_LOST && !n->current;
}

/* Every other node of the room has fenced this one, or is dead. */
bool cp_rnode_fenced(const struct cp_rnode *rn)
{
    const struct cp_node *node = rn->node;
    for (uint32_t i = 0; i < rn->room->nrnodes; i++) {
        const struct cp_node *peer = rn->room->rnodes[i]->node;
        if (peer == node || node_dead(peer))
            continue;
        if (!cp_node_fenced_by(node, peer))
            return false;
    }
    return true;
}

/*
 * When a node of a room has stopped touching pages, as far as the control
 * plane can prove:
 *  - it drained with the current token; or
 *  - it is LOST (ttl passed, or replaced by a newer incarnation) and every
 *    other node of the room fenced it or is dead. A replaced incarnation is
 *    not trusted to be gone (a rollout may overlap two processes): its live
 *    peers still fence it. A LOST peer that may still be alive cannot fence,
 *    so two nodes cut off together hold the room until they come back
 *    (restart), one after the other.
 * Fenced never counts for an ATTACHED or SUSPECT node: it may have local work
 * running on its own pages (a CUDA scatter into a sink page, a TCP receive)
 * that its peers' fences do not stop, so it must drain, however long it takes.
 * The drain deadline fences it to protect the peers, and that is all.
 * (A LOST node's own local work is the node's to stop: docs/state-cores.md,
 * "self-fencing".)
 */
bool cp_rnode_quiescent(const struct cp_rnode *rn)
{
    if (rn->drained)
        return true;
    return rn->node->state == KVF_CPS_NODE_LOST && cp_rnode_fenced(rn);
}

void cp_room_try_finish(struct kvf_cps *st, struct cp_room *room, kvf_time_ns now)
{
    if (room->state != KVF_CPS_ROOM_ABORTING)
        return;
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        if (!cp_rnode_quiescent(room->rnodes[i]))
            return;
    }
    for (uint32_t i = 0; i < room->nrnodes; i++)
        cp_notice_cancel(st, room->rnodes[i]);
    room_enter_terminal(st, room, KVF_CPS_ROOM_ABORTED, now);
}

/* ---- notices ------------------------------------------------------------- */

static void notice_emit(struct kvf_cps *st, struct cp_rnode *rn)
{
    struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_ABORT_NOTICE);
    fx->key = rn->room->key;
    cp_fx_set_node(fx, rn->node);
    fx->token = rn->room->token;
    fx->attempt = rn->attempt;
    if (rn->attempt == 0)
        st->stats.notices_sent++;
    else
        st->stats.notices_resent++;
}

void cp_notice_fire(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now)
{
    if (!rn->notice_pending)
        return;
    rn->attempt++;
    notice_emit(st, rn);
    cp_heap_arm(&st->timers, &rn->timer, now + cp_backoff(st, rn->attempt));
}

void cp_notice_resend_now(struct kvf_cps *st, struct cp_rnode *rn, kvf_time_ns now)
{
    cp_notice_fire(st, rn, now);
}

void cp_notice_cancel(struct kvf_cps *st, struct cp_rnode *rn)
{
    if (!rn->notice_pending)
        return;
    rn->notice_pending = false;
    st->stats.notices_pending--;
    cp_heap_cancel(&st->timers, &rn->timer);
}

/* ---- abort --------------------------------------------------------------- */

static kvf_token mint_token(struct kvf_cps *st)
{
    kvf_token t = {0, 0};
    /* All zero means "no token": draw again (a broken source cannot hang us). */
    for (int i = 0; i < 64 && kvf_token_is_zero(t); i++)
        st->opts.random_fn(st->opts.random_ctx, &t, sizeof(t));
    if (kvf_token_is_zero(t))
        t.lo = 1;
    return t;
}

int cp_room_abort(struct kvf_cps *st, struct cp_room *room, enum kvf_cps_abort_reason reason,
                  kvf_time_ns now)
{
    if (room->state != KVF_CPS_ROOM_OPENING && room->state != KVF_CPS_ROOM_ACTIVE)
        return 0;
    if (cp_fx_reserve(st, (size_t)room->nrnodes + room->nparts + 3) != 0 ||
        cp_heap_reserve(&st->timers, (size_t)room->nrnodes + 1) != 0)
        return -ENOMEM;
    room->token = mint_token(st);
    room->reason = (uint8_t)reason;
    cp_room_set_state(st, room, KVF_CPS_ROOM_ABORTING, now);
    for (uint32_t i = 0; i < room->nparts; i++)
        lease_set(st, room->parts[i], KVF_CPS_LEASE_RELEASING);
    cp_heap_arm(&st->timers, &room->timer, now + st->opts.drain_deadline);
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        struct cp_rnode *rn = room->rnodes[i];
        if (rn->node->state == KVF_CPS_NODE_LOST)
            continue; /* its peers fence it instead */
        /* A SUSPECT node gets its notice too: the sender drops it while the
         * session is down, and the re-attach re-sends it at once. */
        rn->notice_pending = true;
        rn->attempt = 0;
        st->stats.notices_pending++;
        notice_emit(st, rn);
        cp_heap_arm(&st->timers, &rn->timer, now + cp_backoff(st, 0));
    }
    cp_room_try_finish(st, room, now);
    return 0;
}

static void room_escalate(struct kvf_cps *st, struct cp_room *room, kvf_time_ns now)
{
    room->escalated = true;
    st->stats.rooms_past_deadline++;
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        struct cp_rnode *rn = room->rnodes[i];
        if (cp_rnode_quiescent(rn))
            continue;
        struct kvf_cps_effect *fx = cp_fx_push(st, KVF_CPS_FX_ESCALATION);
        fx->key = room->key;
        cp_fx_set_node(fx, rn->node);
        for (uint32_t j = 0; j < room->nrnodes; j++)
            cp_fence_request(st, room->rnodes[j]->node, rn->node, now);
    }
}

void cp_room_timer_fire(struct kvf_cps *st, struct cp_room *room, kvf_time_ns now)
{
    switch (room->state) {
    case KVF_CPS_ROOM_OPENING:
        if (cp_room_abort(st, room, KVF_CPS_ABORT_JOIN_TIMEOUT, now) != 0)
            cp_heap_arm(&st->timers, &room->timer, now + st->opts.resend_initial);
        break;
    case KVF_CPS_ROOM_ABORTING:
        room_escalate(st, room, now);
        break;
    case KVF_CPS_ROOM_COMPLETED:
    case KVF_CPS_ROOM_ABORTED:
        if (room->nawaiting == 0) /* never armed while a lease waits: no timer releases */
            cp_room_free(st, room);
        break;
    default:
        break;
    }
}

void cp_room_free(struct kvf_cps *st, struct cp_room *room)
{
    if (cp_map_get(&st->rooms, room->key.room_id) == room)
        cp_map_del(&st->rooms, room->key.room_id);
    cp_heap_cancel(&st->timers, &room->timer);
    bool live = !cp_room_terminal(room);
    st->stats.leases_awaiting_host_proof -= room->nawaiting;
    for (uint32_t i = 0; i < room->nparts; i++) {
        struct cp_part *p = room->parts[i];
        if (p->lease_state != KVF_CPS_LEASE_RELEASED)
            cp_pages_release(p->pool, p);
        st->stats.leases_by_state[p->lease_state]--;
        cp_map_del(&st->leases, p->lease_id);
        cp_pool_free(p->pool);
        free(p->ranges);
        free(p);
    }
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        struct cp_rnode *rn = room->rnodes[i];
        struct cp_node *node = rn->node;
        cp_notice_cancel(st, rn);
        cp_node_unlink_rnode(node, rn);
        if (live)
            node->room_count--;
        free(rn);
        cp_node_maybe_free(st, node);
    }
    st->stats.rooms_by_state[room->state]--;
    free(room->parts);
    free(room->rnodes);
    free(room);
}

/* ---- join ---------------------------------------------------------------- */

static int validate_ranges(const struct kvf_cps *st, const struct kvf_cps_page_range *ranges,
                           size_t n, const char *field, struct kvf_error *err)
{
    char name[CP_RUN_NAME_MAX];
    if (n > st->opts.max_ranges_per_call)
        return kvf_error_set(err, -E2BIG, "%s: %zu ranges, limit %" PRIu32,
                             field ? field : "ranges", n, st->opts.max_ranges_per_call);
    if (n > 0 && ranges == NULL)
        return kvf_error_set(err, -EINVAL, "%s: missing", field ? field : "ranges");
    for (size_t i = 0; i < n; i++) {
        if (ranges[i].count == 0)
            return kvf_error_set(err, -EINVAL, "%s.count: must be > 0",
                                 cp_pages_run_name(name, field, i));
    }
    return 0;
}

static int validate_room_id(uint64_t room_id, struct kvf_error *err)
{
    if (room_id == 0 || room_id > KVF_ROOM_ID_MAX)
        return kvf_error_set(err, -EINVAL, "room_id: %" PRIu64 " is outside 1..2^63-1", room_id);
    return 0;
}

static int validate_join(const struct kvf_cps *st, const struct kvf_cps_join *j,
                         struct kvf_error *err)
{
    if (j == NULL)
        return kvf_error_set(err, -EINVAL, "join: missing");
    int rc = validate_room_id(j->room_id, err);
    if (rc != 0)
        return rc;
    if (j->expected_sources == 0)
        return kvf_error_set(err, -EINVAL, "expected_sources: must be > 0");
    if (j->expected_sinks == 0)
        return kvf_error_set(err, -EINVAL, "expected_sinks: must be > 0");
    uint64_t total = (uint64_t)j->expected_sources + j->expected_sinks;
    if (total > st->opts.max_participants)
        return kvf_error_set(err, -E2BIG,
                             "expected_sources + expected_sinks: %" PRIu64
                             " participants, limit %" PRIu32,
                             total, st->opts.max_participants);
    if (j->node_id == NULL || j->node_id[0] == '\0' ||
        strnlen(j->node_id, CP_NODE_ID_MAX + 1) > CP_NODE_ID_MAX)
        return kvf_error_set(err, -EINVAL, "node_id: must be 1..%d bytes", CP_NODE_ID_MAX);
    if (j->role != KVF_CPS_ROLE_SOURCE && j->role != KVF_CPS_ROLE_SINK)
        return kvf_error_set(err, -EINVAL, "role: %d is not SOURCE or SINK", (int)j->role);
    if (j->engine_protocol_min == 0 || j->engine_protocol_min > j->engine_protocol_max)
        return kvf_error_set(err, -EINVAL, "engine_protocol: bad range %" PRIu32 "..%" PRIu32,
                             j->engine_protocol_min, j->engine_protocol_max);
    return validate_ranges(st, j->ranges, j->range_count, j->pages_field, err);
}

static struct cp_part *find_part(const struct cp_room *room, const struct cp_node *node,
                                 uint32_t rank, int role)
{
    for (uint32_t i = 0; i < room->nparts; i++) {
        struct cp_part *p = room->parts[i];
        if (p->rn->node == node && p->rank == rank && p->role == role)
            return p;
    }
    return NULL;
}

struct cp_rnode *cp_room_rnode(const struct cp_room *room, const struct cp_node *node)
{
    for (uint32_t i = 0; i < room->nrnodes; i++) {
        if (room->rnodes[i]->node == node)
            return room->rnodes[i];
    }
    return NULL;
}

static uint32_t max_u32(uint32_t a, uint32_t b)
{
    return a > b ? a : b;
}

static uint32_t min_u32(uint32_t a, uint32_t b)
{
    return a < b ? a : b;
}

/* The node's and the engine's capabilities, then the room's common version.
 * On success *lo_p..*hi_p is the participant's range (with the control plane). */
static int check_caps(const struct kvf_cps *st, const struct cp_room *room,
                      const struct cp_node *node, const struct kvf_cps_join *j, uint32_t *lo_p,
                      uint32_t *hi_p, struct kvf_error *err)
{
    char who[200];
    snprintf(who, sizeof(who), "participant (node %s, rank %" PRIu32 ", %s)", node->id, j->rank,
             role_name(j->role));
    uint32_t missing = kvf_features_first_missing(node->features, KVF_FEATURES_REQUIRED);
    if (missing != 0)
        return kvf_error_set(err, -ENOTSUP, "%s: node does not advertise %s", who,
                             kvf_feature_name(missing));
    missing = kvf_features_first_missing(j->engine_features, KVF_FEATURES_REQUIRED);
    if (missing != 0)
        return kvf_error_set(err, -ENOTSUP, "%s: engine does not advertise %s", who,
                             kvf_feature_name(missing));
    uint32_t lo = max_u32(max_u32(node->pmin, j->engine_protocol_min), st->opts.protocol_min);
    uint32_t hi = min_u32(min_u32(node->pmax, j->engine_protocol_max), st->opts.protocol_max);
    if (lo > hi)
        return kvf_error_set(err, -ENOTSUP,
                             "%s: no common protocol version: node %" PRIu32 "..%" PRIu32
                             ", engine %" PRIu32 "..%" PRIu32,
                             who, node->pmin, node->pmax, j->engine_protocol_min,
                             j->engine_protocol_max);
    if (room != NULL && room->nparts > 0 && (max_u32(lo, room->pmin) > min_u32(hi, room->pmax)))
        return kvf_error_set(
            err, -ENOTSUP,
            "%s: protocol %" PRIu32 "..%" PRIu32 " has no version in common with room %" PRIu64
            ":%" PRIu64 " (%" PRIu32 "..%" PRIu32 ")",
            who, lo, hi, room->key.room_id, room->key.generation, room->pmin, room->pmax);
    *lo_p = lo;
    *hi_p = hi;
    return 0;
}

/* Checks the shape and the participant against an existing live room. Returns
 * 1 (with *same_p) when the participant already joined. */
static int check_room(const struct cp_room *room, const struct cp_node *node,
                      const struct kvf_cps_join *j, struct cp_part **same_p, struct kvf_error *err)
{
    if (room->state == KVF_CPS_ROOM_ABORTING)
        return kvf_error_set(err, -ECANCELED, "room %" PRIu64 ":%" PRIu64 " is ABORTING",
                             room->key.room_id, room->key.generation);
    if (j->expected_sources != room->expected_sources)
        return kvf_error_set(err, -EINVAL,
                             "expected_sources: room %" PRIu64 " expects %" PRIu32
                             ", join says %" PRIu32,
                             room->key.room_id, room->expected_sources, j->expected_sources);
    if (j->expected_sinks != room->expected_sinks)
        return kvf_error_set(err, -EINVAL,
                             "expected_sinks: room %" PRIu64 " expects %" PRIu32
                             ", join says %" PRIu32,
                             room->key.room_id, room->expected_sinks, j->expected_sinks);
    struct cp_part *p = find_part(room, node, j->rank, j->role);
    if (p != NULL) {
        bool same = p->pool->pool_id == j->pool_id && p->nranges == j->range_count &&
                    (j->range_count == 0 ||
                     memcmp(p->ranges, j->ranges, j->range_count * sizeof(*j->ranges)) == 0);
        if (!same)
            return kvf_error_set(err, -EEXIST,
                                 "participant (node %s, rank %" PRIu32
                                 ", %s) already joined room %" PRIu64 ":%" PRIu64
                                 " with lease %" PRIu64,
                                 node->id, j->rank, role_name(j->role), room->key.room_id,
                                 room->key.generation, p->lease_id);
        *same_p = p;
        return 1;
    }
    uint32_t have = j->role == KVF_CPS_ROLE_SOURCE ? room->nsources : room->nsinks;
    uint32_t want = j->role == KVF_CPS_ROLE_SOURCE ? room->expected_sources : room->expected_sinks;
    if (have >= want)
        return kvf_error_set(err, -EINVAL,
                             "role: room %" PRIu64 ":%" PRIu64 " already has its %" PRIu32 " %ss",
                             room->key.room_id, room->key.generation, want, role_name(j->role));
    return 0;
}

static int grow_ptrs(void ***v, uint32_t n, uint32_t *cap)
{
    if (n < *cap)
        return 0;
    uint32_t ncap = *cap == 0 ? 2 : *cap * 2;
    void **nv = realloc(*v, ncap * sizeof(*nv));
    if (nv == NULL)
        return -ENOMEM;
    *v = nv;
    *cap = ncap;
    return 0;
}

static struct cp_room *room_new(void)
{
    struct cp_room *room = calloc(1, sizeof(*room));
    if (room != NULL)
        cp_timer_init(&room->timer, CP_TIMER_ROOM);
    return room;
}

static void fill_result(const struct cp_room *room, const struct cp_part *p,
                        struct kvf_cps_join_result *result_p)
{
    if (result_p == NULL)
        return;
    result_p->key = room->key;
    result_p->lease_id = p->lease_id;
    result_p->room_state = (enum kvf_cps_room_state)room->state;
}

int kvf_cps_join(struct kvf_cps *st, const struct kvf_cps_join *join, kvf_time_ns now,
                 struct kvf_cps_join_result *result_p, struct kvf_error *err)
{
    int rc = validate_join(st, join, err);
    if (rc != 0)
        return rc;
    struct cp_node *node = cp_node_current(st, join->node_id);
    if (node == NULL)
        return kvf_error_set(err, -ENOENT, "node_id: node %s is not attached", join->node_id);
    if (node->state == KVF_CPS_NODE_LOST)
        return kvf_error_set(err, -ENOENT, "node_id: node %s incarnation %" PRIu64 " is LOST",
                             node->id, node->incarnation);
    if (node->state == KVF_CPS_NODE_SUSPECT)
        return kvf_error_set(err, -EAGAIN,
                             "node_id: node %s is SUSPECT (session down); retry when it is back",
                             node->id);

    struct cp_room *room = cp_map_get(&st->rooms, join->room_id);
    struct cp_room *live = room != NULL && !cp_room_terminal(room) ? room : NULL;
    if (live != NULL) {
        struct cp_part *same = NULL;
        rc = check_room(live, node, join, &same, err);
        if (rc < 0)
            return rc;
        if (rc == 1) {
            fill_result(live, same, result_p); /* the same join again */
            return 0;
        }
    }
    uint32_t lo = 0, hi = 0;
    rc = check_caps(st, live, node, join, &lo, &hi, err);
    if (rc != 0) {
        /* All or nothing: the room cannot form, so it aborts now, before any
         * page address left a node (it never was ACTIVE). */
        if (live != NULL)
            cp_room_abort(st, live, KVF_CPS_ABORT_CAPABILITY, now);
        return rc;
    }
    struct cp_pool *pool = cp_node_pool(node, join->pool_id);
    if (pool == NULL)
        return kvf_error_set(err, -ENOENT, "pool_id: node %s has no pool %" PRIu32, node->id,
                             join->pool_id);
    rc = cp_pages_check_bounds(node, pool, join->ranges, join->range_count, join->pages_field, err);
    if (rc == 0)
        rc = cp_pages_check_disjoint(NULL, join->ranges, join->range_count, join->pages_field, err);
    if (rc != 0)
        return rc;

    if (live == NULL && room != NULL && room->nawaiting > 0)
        return kvf_error_set(err, -EBUSY,
                             "room_id: room %" PRIu64 ":%" PRIu64 " is %s but %" PRIu32
                             " of its leases still wait for a proof from their node's host; its "
                             "id cannot be reused until they are released",
                             room->key.room_id, room->key.generation,
                             kvf_cps_room_state_name(room->state), room->nawaiting);
    /* Reserve and allocate everything; nothing is visible yet. */
    struct cp_room *target = live;
    struct cp_room *fresh = NULL;
    struct cp_rnode *new_rn = NULL;
    struct cp_part *part = NULL;
    /* The caller's array becomes the lease's runs (kvf_cps_join.ranges_adopt_p). */
    bool adopt = join->range_count > 0 && join->ranges_adopt_p != NULL &&
                 *join->ranges_adopt_p == join->ranges;
    size_t nodes_after = live != NULL ? live->nrnodes + 1 : 1;
    if (cp_map_reserve(&st->rooms, 1) != 0 || cp_map_reserve(&st->leases, 1) != 0 ||
        cp_heap_reserve(&st->timers, 1) != 0 || cp_fx_reserve(st, nodes_after + 2) != 0)
        goto err_nomem;
    if (target == NULL) {
        fresh = room_new();
        if (fresh == NULL)
            goto err_nomem;
        target = fresh;
    }
    if (grow_ptrs((void ***)&target->parts, target->nparts, &target->capparts) != 0 ||
        grow_ptrs((void ***)&target->rnodes, target->nrnodes, &target->caprnodes) != 0)
        goto err_free;
    struct cp_rnode *rn = cp_room_rnode(target, node);
    if (rn == NULL) {
        new_rn = calloc(1, sizeof(*new_rn));
        if (new_rn == NULL)
            goto err_free;
        new_rn->room = target;
        new_rn->node = node;
        cp_timer_init(&new_rn->timer, CP_TIMER_NOTICE);
        rn = new_rn;
    }
    part = calloc(1, sizeof(*part));
    if (part == NULL)
        goto err_free;
    if (adopt) {
        part->ranges = *join->ranges_adopt_p; /* kept only if the join succeeds */
    } else if (join->range_count > 0) {
        part->ranges = malloc(join->range_count * sizeof(*part->ranges));
        if (part->ranges == NULL)
            goto err_free;
        memcpy(part->ranges, join->ranges, join->range_count * sizeof(*part->ranges));
    }
    part->room = target;
    part->rn = rn;
    part->rank = join->rank;
    part->role = (uint8_t)join->role;
    part->lease_state = KVF_CPS_LEASE_ACTIVE;
    part->lease_id = st->next_lease_id;
    part->pool = pool;
    cp_pool_ref(pool);
    part->nranges = part->capranges = (uint32_t)join->range_count;
    rc = cp_pages_acquire(pool, part, join->ranges, join->range_count, join->pages_field, err);
    if (rc != 0)
        goto err_free_rc;

    /* Commit. */
    if (fresh != NULL) {
        if (room != NULL)
            cp_room_free(st, room); /* the tombstone of the previous generation */
        fresh->key.room_id = join->room_id;
        fresh->key.generation = ++st->stats.generation;
        fresh->expected_sources = join->expected_sources;
        fresh->expected_sinks = join->expected_sinks;
        fresh->pmin = lo;
        fresh->pmax = hi;
        fresh->created_at = now;
        cp_map_put(&st->rooms, fresh->key.room_id, fresh);
        cp_room_set_state(st, fresh, KVF_CPS_ROOM_OPENING, now);
        cp_heap_arm(&st->timers, &fresh->timer, now + st->opts.join_timeout);
    } else {
        target->pmin = max_u32(target->pmin, lo);
        target->pmax = min_u32(target->pmax, hi);
    }
    if (new_rn != NULL) {
        target->rnodes[target->nrnodes++] = new_rn;
        cp_node_link_rnode(node, new_rn);
        node->room_count++;
    }
    rn->nparts++;
    st->next_lease_id++;
    cp_map_put(&st->leases, part->lease_id, part);
    cp_pool_link(pool, part);
    target->parts[target->nparts++] = part;
    st->stats.leases_by_state[KVF_CPS_LEASE_ACTIVE]++;
    if (part->role == KVF_CPS_ROLE_SOURCE)
        target->nsources++;
    else
        target->nsinks++;
    if (target->nsources == target->expected_sources && target->nsinks == target->expected_sinks) {
        cp_heap_cancel(&st->timers, &target->timer);
        cp_room_set_state(st, target, KVF_CPS_ROOM_ACTIVE, now);
        room_updates(st, target);
    }
    if (adopt)
        *join->ranges_adopt_p = NULL;
    fill_result(target, part, result_p);
    return 0;

err_nomem:
    rc = kvf_error_set(err, -ENOMEM, "out of memory");
    goto err_free_rc;
err_free:
    rc = kvf_error_set(err, -ENOMEM, "out of memory");
err_free_rc:
    if (part != NULL) {
        cp_pool_free(part->pool);
        if (!adopt)
            free(part->ranges);
        free(part);
    }
    free(new_rn);
    if (fresh != NULL) {
        free(fresh->parts);
        free(fresh->rnodes);
        free(fresh);
    }
    return rc;
}

/* ---- extend, abort ------------------------------------------------------- */

/* The room of a call that names a room-generation (not a report). */
static int room_for_call(struct kvf_cps *st, kvf_room_key key, bool any_generation,
                         struct cp_room **room_p, struct kvf_error *err)
{
    int rc = validate_room_id(key.room_id, err);
    if (rc != 0)
        return rc;
    if (key.generation == 0 && !any_generation)
        return kvf_error_set(err, -EINVAL, "key.generation: must be > 0");
    struct cp_room *room = cp_map_get(&st->rooms, key.room_id);
    if (room == NULL)
        return kvf_error_set(err, -ENOENT, "room %" PRIu64 ": unknown", key.room_id);
    if (key.generation != 0 && key.generation != room->key.generation)
        return kvf_error_set(
            err, -ESTALE, "room %" PRIu64 ": generation %" PRIu64 " is not current (%" PRIu64 ")",
            key.room_id, key.generation, room->key.generation);
    *room_p = room;
    return 0;
}

int kvf_cps_lease_extend(struct kvf_cps *st, kvf_room_key key, uint64_t lease_id,
                         const struct kvf_cps_page_range *ranges, size_t range_count,
                         kvf_time_ns now, struct kvf_error *err)
{
    return kvf_cps_lease_extend_named(st, key, lease_id, ranges, range_count, NULL, now, err);
}

int kvf_cps_lease_extend_named(struct kvf_cps *st, kvf_room_key key, uint64_t lease_id,
                               const struct kvf_cps_page_range *ranges, size_t range_count,
                               const char *field, kvf_time_ns now, struct kvf_error *err)
{
    (void)now;
    const char *base = field ? field : "ranges";
    if (range_count == 0)
        return kvf_error_set(err, -EINVAL, "%s: empty", base);
    int rc = validate_ranges(st, ranges, range_count, field, err);
    if (rc != 0)
        return rc;
    struct cp_room *room = NULL;
    rc = room_for_call(st, key, false, &room, err);
    if (rc != 0)
        return rc;
    struct cp_part *part = cp_map_get(&st->leases, lease_id);
    if (part == NULL || part->room != room)
        return kvf_error_set(err, -ENOENT,
                             "lease_id: lease %" PRIu64 " is not in room %" PRIu64 ":%" PRIu64,
                             lease_id, key.room_id, key.generation);
    if (room->state == KVF_CPS_ROOM_ABORTING || room->state == KVF_CPS_ROOM_ABORTED)
        return kvf_error_set(err, -ECANCELED, "room %" PRIu64 ":%" PRIu64 " is %s", key.room_id,
                             key.generation, kvf_cps_room_state_name(room->state));
    if (room->state == KVF_CPS_ROOM_COMPLETED)
        return kvf_error_set(err, -EPERM, "room %" PRIu64 ":%" PRIu64 " is COMPLETED", key.room_id,
                             key.generation);
    if (part->completed)
        return kvf_error_set(err, -EPERM,
                             "lease_id: lease %" PRIu64 " belongs to a participant that already "
                             "completed; its pages cannot grow",
                             lease_id);
    size_t total = (size_t)part->nranges + range_count;
    if (total > st->opts.max_ranges_per_call)
        return kvf_error_set(err, -E2BIG,
                             "%s: lease %" PRIu64 " would hold %zu ranges, limit %" PRIu32, base,
                             lease_id, total, st->opts.max_ranges_per_call);
    rc = cp_pages_check_bounds(part->rn->node, part->pool, ranges, range_count, field, err);
    if (rc == 0)
        rc = cp_pages_check_disjoint(part, ranges, range_count, field, err);
    if (rc != 0)
        return rc;
    if (total > part->capranges) {
        struct kvf_cps_page_range *v = realloc(part->ranges, total * sizeof(*v));
        if (v == NULL)
            return kvf_error_set(err, -ENOMEM, "out of memory");
        part->ranges = v;
        part->capranges = (uint32_t)total;
    }
    if (cp_fx_reserve(st, room->nrnodes) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    rc = cp_pages_acquire(part->pool, part, ranges, range_count, field, err);
    if (rc != 0)
        return rc;
    memcpy(part->ranges + part->nranges, ranges, range_count * sizeof(*ranges));
    part->nranges = (uint32_t)total;
    /* The lease's own node first; the others once it acknowledged. */
    if (room->state == KVF_CPS_ROOM_ACTIVE)
        room_update_send(st, part->rn);
    return 0;
}

int kvf_cps_room_abort(struct kvf_cps *st, kvf_room_key key, enum kvf_cps_abort_reason reason,
                       kvf_time_ns now, kvf_token *token_p, struct kvf_error *err)
{
    if (reason < KVF_CPS_ABORT_ENGINE || reason > KVF_CPS_ABORT_CAPABILITY)
        return kvf_error_set(err, -EINVAL, "reason: %d is not a known reason", (int)reason);
    struct cp_room *room = NULL;
    int rc = room_for_call(st, key, true, &room, err);
    if (rc != 0)
        return rc;
    if (room->state == KVF_CPS_ROOM_COMPLETED) {
        if (token_p != NULL)
            *token_p = (kvf_token){0, 0};
        return kvf_error_set(err, -EPERM, "room %" PRIu64 ":%" PRIu64 " is COMPLETED",
                             room->key.room_id, room->key.generation);
    }
    if (cp_room_abort(st, room, reason, now) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    if (token_p != NULL)
        *token_p = room->token;
    return 0;
}

/* ---- reports ------------------------------------------------------------- */

/* The room and room-node of a node report; unknown and stale ones are counted. */
static int room_for_report(struct kvf_cps *st, const struct cp_node *node, kvf_room_key key,
                           struct cp_room **room_p, struct cp_rnode **rn_p, struct kvf_error *err)
{
    struct cp_room *room = cp_map_get(&st->rooms, key.room_id);
    if (room == NULL) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT, "room %" PRIu64 ": unknown", key.room_id);
    }
    if (key.generation != room->key.generation) {
        st->stats.reports_stale++;
        return kvf_error_set(
            err, -ESTALE, "room %" PRIu64 ": generation %" PRIu64 " is not current (%" PRIu64 ")",
            key.room_id, key.generation, room->key.generation);
    }
    struct cp_rnode *rn = cp_room_rnode(room, node);
    if (rn == NULL) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT, "node %s is not in room %" PRIu64 ":%" PRIu64, node->id,
                             key.room_id, key.generation);
    }
    *room_p = room;
    *rn_p = rn;
    return 0;
}

/* The node, room and (room, node) record a report names: the checks every
 * report shares (room id, current incarnation, the node is in the room). */
static int report_target(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                         kvf_room_key key, struct cp_node **node_p, struct cp_room **room_p,
                         struct cp_rnode **rn_p, struct kvf_error *err)
{
    int rc = validate_room_id(key.room_id, err);
    if (rc != 0)
        return rc;
    rc = cp_node_for_report(st, node_id, incarnation, node_p, err);
    if (rc != 0)
        return rc;
    return room_for_report(st, *node_p, key, room_p, rn_p, err);
}

int kvf_cps_report_completed(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                             kvf_room_key key, uint32_t rank, enum kvf_cps_role role,
                             kvf_time_ns now, struct kvf_error *err)
{
    if (role != KVF_CPS_ROLE_SOURCE && role != KVF_CPS_ROLE_SINK)
        return kvf_error_set(err, -EINVAL, "role: %d is not SOURCE or SINK", (int)role);
    struct cp_node *node;
    struct cp_room *room = NULL;
    struct cp_rnode *rn;
    int rc = report_target(st, node_id, incarnation, key, &node, &room, &rn, err);
    if (rc != 0)
        return rc;
    struct cp_part *p = find_part(room, node, rank, role);
    if (p == NULL) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -ENOENT,
                             "participant (node %s, rank %" PRIu32 ", %s) is not in room %" PRIu64
                             ":%" PRIu64,
                             node->id, rank, role_name(role), key.room_id, key.generation);
    }
    switch (room->state) {
    case KVF_CPS_ROOM_OPENING:
        return kvf_error_set(err, -EPERM, "room %" PRIu64 ":%" PRIu64 " is OPENING", key.room_id,
                             key.generation);
    case KVF_CPS_ROOM_ABORTING:
    case KVF_CPS_ROOM_ABORTED:
        return kvf_error_set(err, -ECANCELED, "room %" PRIu64 ":%" PRIu64 " is %s", key.room_id,
                             key.generation, kvf_cps_room_state_name(room->state));
    case KVF_CPS_ROOM_COMPLETED:
        return 0;
    default:
        break;
    }
    if (p->completed)
        return 0;
    if (cp_fx_reserve(st, (size_t)room->nparts + 1) != 0 || cp_heap_reserve(&st->timers, 1) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    p->completed = true;
    room->ncompleted++;
    if (room->ncompleted == room->nparts)
        room_enter_terminal(st, room, KVF_CPS_ROOM_COMPLETED, now);
    return 0;
}

int kvf_cps_report_failed(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                          kvf_room_key key, kvf_time_ns now, kvf_token *token_p,
                          struct kvf_error *err)
{
    struct cp_node *node;
    struct cp_room *room = NULL;
    struct cp_rnode *rn;
    int rc = report_target(st, node_id, incarnation, key, &node, &room, &rn, err);
    if (rc != 0)
        return rc;
    if (room->state == KVF_CPS_ROOM_COMPLETED)
        return kvf_error_set(err, -EPERM, "room %" PRIu64 ":%" PRIu64 " is COMPLETED", key.room_id,
                             key.generation);
    if (cp_room_abort(st, room, KVF_CPS_ABORT_TRANSFER_FAILED, now) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    if (token_p != NULL)
        *token_p = room->token;
    return 0;
}

/* The drained report of lifetime incarnation `of` of node `node_id`, sent by
 * its current incarnation `incarnation` (equal for a report of its own). */
int kvf_cps_report_drained_of(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                              uint64_t of, kvf_room_key key, kvf_token token, kvf_time_ns now,
                              struct kvf_error *err)
{
    int rc = validate_room_id(key.room_id, err);
    if (rc != 0)
        return rc;
    if (kvf_token_is_zero(token)) {
        st->stats.reports_tokenless++;
        return kvf_error_set(err, -EINVAL,
                             "token: missing; a drained report without it proves nothing");
    }
    struct cp_node *node;
    rc = cp_node_for_report(st, node_id, incarnation, &node, err);
    if (rc != 0)
        return rc;
    if (of > incarnation) {
        st->stats.reports_unknown++;
        return kvf_error_set(err, -EINVAL,
                             "incarnation: lifetime incarnation %" PRIu64
                             " is newer than the reporter's %" PRIu64,
                             of, incarnation);
    }
    if (of != incarnation && of != 0) {
        /* A process that self-fenced reports its old incarnation's lifetimes:
         * the token, sent to that incarnation only, proves whose they are. */
        struct cp_node *old = node->older;
        while (old != NULL && old->incarnation != of)
            old = old->older;
        if (old == NULL) {
            st->stats.reports_unknown++;
            return kvf_error_set(err, -ENOENT, "node %s incarnation %" PRIu64 " is unknown",
                                 node_id, of);
        }
        node = old;
    }
    struct cp_room *room = NULL;
    struct cp_rnode *rn;
    rc = room_for_report(st, node, key, &room, &rn, err);
    if (rc != 0)
        return rc;
    if (kvf_token_is_zero(room->token) || !kvf_token_eq(token, room->token)) {
        st->stats.reports_stale++;
        return kvf_error_set(err, -ESTALE,
                             "token: not the abort token of room %" PRIu64 ":%" PRIu64, key.room_id,
                             key.generation);
    }
    if (rn->drained)
        return 0;
    if (cp_fx_reserve(st, (size_t)room->nparts + 2) != 0 || cp_heap_reserve(&st->timers, 1) != 0)
        return kvf_error_set(err, -ENOMEM, "out of memory");
    rn->drained = true;
    cp_notice_cancel(st, rn);
    cp_rnode_host_proof(st, rn, now);
    return 0;
}

int kvf_cps_report_drained(struct kvf_cps *st, const char *node_id, uint64_t incarnation,
                           kvf_room_key key, kvf_token token, kvf_time_ns now,
                           struct kvf_error *err)
{
    return kvf_cps_report_drained_of(st, node_id, incarnation, incarnation, key, token, now, err);
}
