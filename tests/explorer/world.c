/*
 * world.c: the simulated cluster that the schedule explorer drives.
 *
 * Real parts: the control-plane core (kvf_cps) and one node rules core
 * (kvf_ncore, with its lifetime table) per node. Simulated parts: engines (page allocators), node
 * agents (what kvfence-node does on a notice, a completion, a fence, a lost
 * session), native ops in flight, the node -> node connections that carry TCP
 * frames, and the links between nodes and the control plane. See world.h for
 * the action model. This file holds the engines, the control plane's effects,
 * the invariants, the step and the quiesce phase; world_node.c the node side.
 *
 * The faults: control-plane -> node messages lost, delayed and taken out of
 * order; node -> control-plane reports lost and duplicated; node -> node
 * frames reordered and duplicated; sessions dropped; a node process paused
 * (it takes no step: its ops stay in flight, its socket buffers keep their
 * frames, its session drops and the core may declare it LOST; when it resumes
 * any of its threads may run before its overdue self-fence: the receiver takes
 * what waits in its sockets), killed and restarted; a node fencing itself
 * after its session was down for node_ttl minus a margin (it keeps the old
 * incarnation's lifetimes, comes back as a new incarnation and sends Witness
 * for the old one once they all drained); the control plane crashing and
 * recovering its state from its own image (kvf_cps_snapshot/kvf_cps_restore:
 * what the store's snapshot plus log replay rebuild), with every session gone.
 *
 * What "touching a page" means here: a transfer op counted on a source node
 * reads that node's source pages and writes the sink's pages on the peer node;
 * a sink-local op (a CUDA scatter) and a receive in progress (a TCP frame taken
 * off the socket and admitted) write the sink's own pages. An op stops
 * touching a peer's pages once that peer fenced the op's node incarnation, and
 * stops touching anything when its process dies. A LOST node's own pages stay
 * touched while its process lives (a paused process resumes): only its own
 * drain or a proof from its host frees them (docs/state-cores.md, "Pages on
 * host H"). A restarted node witnesses its predecessor's death in its Hello
 * (the host lock of kvfence-node); a self-fenced one sends Witness.
 *
 * The invariants checked after every action (names shared with the Promela
 * model, tests/model):
 *   I1 no lease is RELEASED (in the core, or by an effect) while a live,
 *      unfenced op touches its pages;
 *   I2 no node admits an op (a transfer, a local copy, a frame landing) for a
 *      room whose abort notice it processed;
 *   I3 no op is admitted on a RELEASED lease, and no overlapping write lease is
 *      ever granted (a failed join changes nothing);
 *   I4 each lease is released exactly once and the core's lease state agrees
 *      with the effects seen; abort returns one token per room-generation;
 *   I5 stale, tokenless and foreign reports change nothing;
 *   I7 a room with a participant lacking QUIESCE_V1 never sends a room update;
 *   I8 the frames from one node to another for one room land in the order
 *      they were sent, each at most once (one the receiver refused is lost:
 *      the sink's completion rule sees its bytes missing);
 *   room states move only along the state machine (OPENING -> ACTIVE ->
 *   COMPLETED, or -> ABORTING -> ABORTED).
 * And at the end (world_quiesce): every room terminal, every lease released,
 * every page back with its engine, every lifetime drained.
 *
 * The node side is the node core. Each snode holds a kvf_ncore, and the node
 * agent (world_node.c, and admit_op, op_retire and check_completion here)
 * only feeds it what kvfence-node feeds it: room updates (kvf_ncore_room_open,
 * kvf_ncore_room_members), abort notices (kvf_ncore_room_abort/_end), every
 * point where a room may have drained (kvf_ncore_room_check), sink progress
 * (kvf_ncore_sink_ready) and participant completion (kvf_ncore_part_completed),
 * chunks (kvf_ncore_chunk_state/_order; a queued chunk holds its room), the end
 * of each turn (kvf_ncore_collect) and peer slots (kvf_ncore_peer_get, _ref,
 * _unref, _fenced, _peers_reset). The core's effects are routed like the
 * control plane's (node_apply, as route_effects): reports into the outbox,
 * ROOM_FREE frees the simulated room. What stays simulated is what the daemon
 * has around its core: native ops (the sop array, retired into the core's
 * lifetimes), sockets (frame_send, and node_recv with the TCP transport's
 * per-stream sequence check), and the links to the control plane (report()).
 * No lifetime call is made here that the daemon does not make.
 */
#include "world.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state.h"
#include "lifetime.h"

#include "world_internal.h"

/* ---- small helpers ------------------------------------------------------ */

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void world_random(void *ctx, void *buf, size_t len)
{
    struct world *w = ctx;
    unsigned char *p = buf;
    while (len > 0) {
        uint64_t r = splitmix(&w->rng);
        size_t n = len < 8 ? len : 8;
        memcpy(p, &r, n);
        p += n;
        len -= n;
    }
}

void fail(struct world *w, const char *fmt, ...)
{
    if (w->failed)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->failure, sizeof(w->failure), fmt, ap);
    va_end(ap);
    w->failed = true;
}

bool q_push(struct queue *q, const struct msg *m)
{
    if (q->len == QCAP)
        return false;
    q->m[(q->head + q->len) % QCAP] = *m;
    q->len++;
    return true;
}

static bool q_pop(struct queue *q, struct msg *m_p)
{
    if (q->len == 0)
        return false;
    if (m_p != NULL)
        *m_p = q->m[q->head];
    q->head = (q->head + 1) % QCAP;
    q->len--;
    return true;
}

static int node_by_name(const struct world *w, const char *name)
{
    for (int i = 0; i < NODES; i++) {
        if (strcmp(w->nodes[i].name, name) == 0)
            return i;
    }
    return -1;
}

int room_by_key(const struct world *w, kvf_room_key key)
{
    for (int i = w->nrooms - 1; i >= 0; i--) {
        if (w->rooms[i].used && kvf_room_key_eq(w->rooms[i].key, key))
            return i;
    }
    return -1;
}

static int part_by_lease(const struct sroom *r, uint64_t lease_id)
{
    for (int p = 0; p < r->nparts; p++) {
        if (r->parts[p].joined && r->parts[p].lease_id == lease_id)
            return p;
    }
    return -1;
}

static bool room_terminal_state(int s)
{
    return s == KVF_CPS_ROOM_COMPLETED || s == KVF_CPS_ROOM_ABORTED;
}

/* The core's view of a room: its state, or 0 when the core no longer has it. */
static int cp_room_state(const struct world *w, kvf_room_key key)
{
    struct kvf_cps_room_view v;
    if (key.generation == 0 || kvf_cps_room_get(w->cps, key, &v) != 0)
        return 0;
    return (int)v.state;
}

static int cp_lease_state(const struct world *w, const struct sroom *r, int p)
{
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(w->cps, r->key, &v) != 0)
        return 0;
    for (size_t i = 0; i < v.participant_count; i++) {
        struct kvf_cps_participant_view pv;
        if (kvf_cps_room_participant(w->cps, r->key, i, &pv) == 0 &&
            pv.lease_id == r->parts[p].lease_id)
            return (int)pv.lease_state;
    }
    return 0;
}

static bool cp_node_lost(const struct world *w, int node, uint64_t inc)
{
    struct kvf_cps_node_view v;
    if (kvf_cps_node_get(w->cps, w->nodes[node].name, &v) != 0)
        return false;
    return v.incarnation != inc || v.state == KVF_CPS_NODE_LOST;
}

/* ---- ops ----------------------------------------------------------------- */

static bool op_touches(const struct sop *o, int room, int part)
{
    return o->room == room && (o->src_part == part || o->sink_part == part);
}

/* May `o` still touch the pages of rooms[room].parts[part]? */
static bool op_harms(const struct world *w, const struct sop *o, int room, int part)
{
    if (!o->used || !op_touches(o, room, part))
        return false;
    int page_node = w->rooms[room].parts[part].node;
    if (page_node == o->node)
        return true; /* a live op on its own host: only its end or its process's death stops it */
    return !o->neutral[page_node];
}

void op_free(struct sop *o)
{
    o->used = false;
}

/* Live ops whose process runs (a paused node completes nothing); for a
 * quarantine, only ops counted in a lifetime and not quarantined yet. */
static int live_ops(const struct world *w, int *idx, bool for_quarantine)
{
    int n = 0;
    for (int i = 0; i < MAX_OPS; i++) {
        const struct sop *o = &w->ops[i];
        if (o->used && !w->nodes[o->node].paused &&
            (!for_quarantine || (!o->quarantined && !o->unaccounted)))
            idx[n++] = i;
    }
    return n;
}

void op_retire(struct world *w, struct sop *o, enum kvf_lt_outcome outcome)
{
    struct snode *n = &w->nodes[o->node];
    int room = o->room;
    if (outcome == KVF_LT_DONE_ERROR) {
        int p = o->src_part >= 0 ? o->src_part : o->sink_part;
        struct sroom *r = &w->rooms[room];
        r->parts[p].failed = true;
        report(n, &(struct msg){.type = R_FAILED, .key = r->key});
    }
    if (outcome == KVF_LT_DONE_OK && o->src_part >= 0 && o->kind == KVF_LT_OP_TCP_FRAME &&
        o->peer != o->node)
        frame_send(w, o);
    if (o->recv && outcome == KVF_LT_DONE_OK) {
        w->rooms[room].parts[o->sink_part].frames_in++;
        w->stats.frames_landed++;
    }
    if (!o->unaccounted)
        kvf_lt_op_retire(&o->op, outcome);
    int node = o->node;
    op_free(o);
    node_take_drains(w, node);
    check_completion(w, room);
}

/* ---- effects -------------------------------------------------------------- */

/* The sim parts whose leases a room update sent now to `node` carries: its
 * own, and the other nodes' once the control plane published them. */
static uint32_t update_parts(const struct world *w, int ri, int node)
{
    uint32_t mask = 0;
    if (ri < 0)
        return 0;
    const struct sroom *r = &w->rooms[ri];
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(w->cps, r->key, &v) != 0)
        return 0;
    for (size_t i = 0; i < v.participant_count; i++) {
        struct kvf_cps_participant_view pv;
        if (kvf_cps_room_participant(w->cps, r->key, i, &pv) != 0)
            continue;
        for (int p = 0; p < r->nparts; p++) {
            const struct spart *sp = &r->parts[p];
            if (sp->rank == pv.rank && sp->role == pv.role &&
                strcmp(w->nodes[sp->node].name, pv.node_id) == 0 &&
                (sp->node == node || pv.published))
                mask |= 1u << p;
        }
    }
    return mask;
}

static bool legal_transition(int from, int to)
{
    switch (from) {
    case 0:
        return to == KVF_CPS_ROOM_OPENING || to == KVF_CPS_ROOM_ACTIVE ||
               to == KVF_CPS_ROOM_ABORTING;
    case KVF_CPS_ROOM_OPENING:
        return to == KVF_CPS_ROOM_ACTIVE || to == KVF_CPS_ROOM_ABORTING;
    case KVF_CPS_ROOM_ACTIVE:
        return to == KVF_CPS_ROOM_COMPLETED || to == KVF_CPS_ROOM_ABORTING;
    case KVF_CPS_ROOM_ABORTING:
        return to == KVF_CPS_ROOM_ABORTED;
    default:
        return false;
    }
}

static void engine_lease_released(struct world *w, const struct kvf_cps_effect *e)
{
    int ri = room_by_key(w, e->key);
    if (ri < 0) {
        fail(w, "LEASE_RELEASED for unknown room %llu:%llu", (unsigned long long)e->key.room_id,
             (unsigned long long)e->key.generation);
        return;
    }
    struct sroom *r = &w->rooms[ri];
    int p = part_by_lease(r, e->lease_id);
    if (p < 0) {
        fail(w, "LEASE_RELEASED for unknown lease %llu", (unsigned long long)e->lease_id);
        return;
    }
    struct spart *sp = &r->parts[p];
    if (sp->released) {
        fail(w, "I4: lease %llu of room %llu:%llu released twice", (unsigned long long)e->lease_id,
             (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation);
        return;
    }
    if (!room_terminal_state(cp_room_state(w, r->key)))
        fail(w, "I1: lease %llu released while room %llu:%llu is not terminal",
             (unsigned long long)e->lease_id, (unsigned long long)r->key.room_id,
             (unsigned long long)r->key.generation);
    for (int i = 0; i < MAX_OPS; i++) {
        if (op_harms(w, &w->ops[i], ri, p))
            fail(w,
                 "I1: lease %llu of room %llu:%llu released while op %d on %s still touches "
                 "its pages",
                 (unsigned long long)e->lease_id, (unsigned long long)r->key.room_id,
                 (unsigned long long)r->key.generation, i, w->nodes[w->ops[i].node].name);
    }
    sp->released = true;
    w->stats.leases_released++;
    struct snode *n = &w->nodes[sp->node];
    uint32_t owner = (uint32_t)(ri * MAX_PARTS + p + 1);
    for (int pg = 0; pg < POOL_PAGES; pg++) {
        if (n->page_owner[pg] == owner)
            n->page_owner[pg] = 0;
    }
}

void route_effects(struct world *w)
{
    size_t count;
    const struct kvf_cps_effect *fx = kvf_cps_effects_take(w->cps, &count);
    for (size_t i = 0; i < count; i++) {
        const struct kvf_cps_effect *e = &fx[i];
        if (w->trace)
            printf(
                "    fx kind=%d key=%llu:%llu node=%s/%llu peer=%s/%llu lease=%llu state %d->%d\n",
                e->kind, (unsigned long long)e->key.room_id, (unsigned long long)e->key.generation,
                e->node_id, (unsigned long long)e->incarnation, e->peer_node,
                (unsigned long long)e->peer_incarnation, (unsigned long long)e->lease_id,
                e->old_state, e->new_state);
        int node = node_by_name(w, e->node_id);
        struct snode *n = node >= 0 ? &w->nodes[node] : NULL;
        bool reachable = n != NULL && n->alive && n->connected && n->inc == e->incarnation;
        switch (e->kind) {
        case KVF_CPS_FX_ROOM_UPDATE: {
            int ri = room_by_key(w, e->key);
            if (ri >= 0 && w->rooms[ri].has_old)
                fail(w,
                     "I7: room %llu:%llu with a participant lacking QUIESCE_V1 sent a room "
                     "update",
                     (unsigned long long)e->key.room_id, (unsigned long long)e->key.generation);
            if (reachable)
                q_push(&n->inbox, &(struct msg){.type = M_ROOM_UPDATE,
                                                .key = e->key,
                                                .version = e->version,
                                                .published = update_parts(w, ri, node)});
            break;
        }
        case KVF_CPS_FX_ABORT_NOTICE: {
            /* Tokenless only in the answer to a Resync, for a room that
             * completed or that the core no longer has. */
            int cs = cp_room_state(w, e->key);
            if (kvf_token_is_zero(e->token) && cs != 0 && cs != KVF_CPS_ROOM_COMPLETED)
                fail(w, "an abort notice for a %s room carries no token",
                     kvf_cps_room_state_name(cs));
            if (reachable)
                q_push(&n->inbox, &(struct msg){.type = M_ABORT, .key = e->key, .token = e->token});
            break;
        }
        case KVF_CPS_FX_FENCE_PEER:
            if (reachable)
                q_push(&n->inbox, &(struct msg){.type = M_FENCE,
                                                .peer = node_by_name(w, e->peer_node),
                                                .peer_inc = e->peer_incarnation});
            break;
        case KVF_CPS_FX_LEASE_RELEASED:
            engine_lease_released(w, e);
            break;
        case KVF_CPS_FX_ROOM_STATE: {
            int ri = room_by_key(w, e->key);
            if (ri < 0)
                break; /* a room the engines never saw succeed a join */
            struct sroom *r = &w->rooms[ri];
            if (!legal_transition(r->state, e->new_state))
                fail(w, "room %llu:%llu moved %s -> %s", (unsigned long long)e->key.room_id,
                     (unsigned long long)e->key.generation,
                     r->state ? kvf_cps_room_state_name(r->state) : "(none)",
                     kvf_cps_room_state_name(e->new_state));
            r->state = e->new_state;
            if (e->new_state == KVF_CPS_ROOM_COMPLETED)
                w->stats.rooms_completed++;
            if (e->new_state == KVF_CPS_ROOM_ABORTED)
                w->stats.rooms_aborted++;
            break;
        }
        case KVF_CPS_FX_NODE_STATE:
        case KVF_CPS_FX_ESCALATION:
            break;
        }
    }
}

/* ---- invariants after every step ------------------------------------------ */

static void check_invariants(struct world *w)
{
    for (int ri = 0; ri < w->nrooms && !w->failed; ri++) {
        struct sroom *r = &w->rooms[ri];
        if (!r->used || r->dead || r->key.generation == 0)
            continue;
        int state = cp_room_state(w, r->key);
        bool all_released = true;
        for (int p = 0; p < r->nparts; p++) {
            struct spart *sp = &r->parts[p];
            if (!sp->joined)
                continue;
            int ls = state ? cp_lease_state(w, r, p) : KVF_CPS_LEASE_RELEASED;
            if ((ls == KVF_CPS_LEASE_RELEASED) != sp->released)
                fail(w, "I4: lease %llu of room %llu:%llu is %s in the core but the engine %s told",
                     (unsigned long long)sp->lease_id, (unsigned long long)r->key.room_id,
                     (unsigned long long)r->key.generation, kvf_cps_lease_state_name(ls),
                     sp->released ? "was" : "was not");
            if (ls == KVF_CPS_LEASE_RELEASED) {
                for (int i = 0; i < MAX_OPS; i++) {
                    if (op_harms(w, &w->ops[i], ri, p))
                        fail(w, "I1: lease %llu is RELEASED while op %d on %s touches its pages",
                             (unsigned long long)sp->lease_id, i, w->nodes[w->ops[i].node].name);
                }
            }
            all_released = all_released && sp->released;
        }
        if (state != 0 && state != r->state && !(r->state == 0 && state == KVF_CPS_ROOM_OPENING))
            fail(w, "room %llu:%llu is %s in the core but its last effect said %s",
                 (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation,
                 kvf_cps_room_state_name(state),
                 r->state ? kvf_cps_room_state_name(r->state) : "(none)");
        if ((state == 0 || room_terminal_state(state)) && all_released && r->state != 0 &&
            room_terminal_state(r->state))
            r->dead = true;
    }
}

/* ---- completion ---------------------------------------------------------- */

static bool part_has_ops(const struct world *w, int room, int part)
{
    for (int i = 0; i < MAX_OPS; i++) {
        if (w->ops[i].used && op_touches(&w->ops[i], room, part) &&
            (w->ops[i].src_part == part || w->ops[i].node == w->rooms[room].parts[part].node))
            return true;
    }
    return false;
}

/* A local participant is complete when the node core says so: a sink by its
 * completion rule (kvf_ncore_sink_ready: here one "page", covered once every
 * source completed; each frame landed is named by its source's status; no
 * receive or local copy of the room in flight), a source once every chunk it
 * planned started and its ops finished. The core reports Completed and
 * closes admission after the last local participant. */
void check_completion(struct world *w, int room)
{
    struct sroom *r = &w->rooms[room];
    if (r->key.generation == 0)
        return;
    bool sources_done = true;
    for (int p = 0; p < r->nparts; p++) {
        struct spart *sp = &r->parts[p];
        if (sp->role == KVF_CPS_ROLE_SOURCE && !sp->completed_sent)
            sources_done = false;
    }
    for (int p = 0; p < r->nparts; p++) {
        struct spart *sp = &r->parts[p];
        struct snode *n = &w->nodes[sp->node];
        if (!sp->joined || sp->completed_sent || sp->failed || !n->alive || n->paused)
            continue;
        struct nlife *l = life_find(n, r->key);
        if (l == NULL || !l->have_update || kvf_lt_state(l->cr.lt) != KVF_LT_OPEN)
            continue;
        bool done;
        if (sp->role == KVF_CPS_ROLE_SOURCE) {
            done = sp->chunks_sent == sp->chunks_planned && sp->chunks_queued == 0 &&
                   !part_has_ops(w, room, p);
        } else {
            struct kvf_ncore_sink s = {
                .pages = 1,
                .pages_landed = sources_done ? 1 : 0,
                .bytes_landed = (uint64_t)sp->frames_in,
                .status_bytes = sources_done ? (uint64_t)sp->frames_expected : 0,
                .rx_inflight = (uint32_t)(kvf_lt_inflight_kind(l->cr.lt, KVF_LT_OP_TCP_FRAME) +
                                          kvf_lt_inflight_kind(l->cr.lt, KVF_LT_OP_CUDA_COPY)),
            };
            if (w->mutation == MUT_SINK_RX_UNCOUNTED)
                s.rx_inflight = 0;
            done = kvf_ncore_sink_ready(&s);
        }
        if (!done)
            continue;
        if (kvf_ncore_part_completed(n->core, &l->cr, sp->rank, sp->role == KVF_CPS_ROLE_SINK) != 0)
            continue; /* aborting: nothing completes */
        node_apply(w, sp->node);
        if (sp->role == KVF_CPS_ROLE_SOURCE)
            check_completion(w, room);
    }
}

/* ---- engines ------------------------------------------------------------- */

static bool alloc_pages(struct snode *n, int npages, uint32_t owner, struct kvf_cps_page_range *rg)
{
    for (int start = 0; start + npages <= POOL_PAGES; start++) {
        int k = 0;
        while (k < npages && n->page_owner[start + k] == 0)
            k++;
        if (k == npages) {
            for (k = 0; k < npages; k++)
                n->page_owner[start + k] = owner;
            rg->first = (uint32_t)start;
            rg->count = (uint32_t)npages;
            return true;
        }
    }
    return false;
}

static void free_range(struct snode *n, const struct kvf_cps_page_range *rg)
{
    for (uint32_t k = 0; k < rg->count; k++)
        n->page_owner[rg->first + k] = 0;
}

static int new_room(struct world *w, uint64_t room_id, uint32_t b, uint32_t c)
{
    if (w->nrooms == MAX_ROOMS)
        return -1;
    int ri = w->nrooms++;
    struct sroom *r = &w->rooms[ri];
    memset(r, 0, sizeof(*r));
    r->used = true;
    r->room_id = room_id;
    r->nsrc = 1 + (int)(b % 3);
    r->nsink = 1 + (int)((b >> 3) % 2);
    r->nparts = r->nsrc + r->nsink;
    uint64_t s = ((uint64_t)b << 32) | c;
    for (int p = 0; p < r->nparts; p++) {
        struct spart *sp = &r->parts[p];
        uint64_t x = splitmix(&s);
        sp->role = p < r->nsrc ? KVF_CPS_ROLE_SOURCE : KVF_CPS_ROLE_SINK;
        sp->rank = (uint32_t)(p < r->nsrc ? p : p - r->nsrc);
        sp->node = (int)(x % NODES);
        if (sp->node == OLD_NODE && w->nodes[OLD_NODE].old && (x >> 8) % 4 != 0)
            sp->node = (int)((x >> 8) % 4); /* keep refused rooms a minority */
        if (w->nodes[sp->node].old)
            r->has_old = true;
        int pages = (int)((x >> 16) % 7); /* 0: a dummy rank */
        sp->chunks_planned = pages == 0 ? 0 : 1 + (int)((x >> 24) % 3);
        sp->ranges[0].count = (uint32_t)pages;
    }
    w->current[room_id] = ri;
    w->stats.rooms_created++;
    return ri;
}

static void act_join(struct world *w, const struct action *act)
{
    uint64_t room_id = 1 + act->a % ROOM_IDS;
    if (act->b % 4 != 0) {
        /* Mostly, engines join rooms that are waiting for them. */
        uint64_t waiting[ROOM_IDS];
        int nw = 0;
        for (uint64_t id = 1; id <= ROOM_IDS; id++) {
            int k = w->current[id];
            if (k < 0)
                continue;
            for (int p = 0; p < w->rooms[k].nparts; p++) {
                if (!w->rooms[k].parts[p].joined && !w->rooms[k].parts[p].refused) {
                    waiting[nw++] = id;
                    break;
                }
            }
        }
        if (nw > 0)
            room_id = waiting[act->a % (uint32_t)nw];
    }
    int ri = w->current[room_id];
    if (ri >= 0) {
        struct sroom *r = &w->rooms[ri];
        bool pending = false;
        for (int p = 0; p < r->nparts; p++)
            pending = pending || (!r->parts[p].joined && !r->parts[p].refused);
        int state = cp_room_state(w, r->key);
        if (pending && r->key.generation != 0 && state != KVF_CPS_ROOM_OPENING) {
            /* The room left OPENING (timed out, aborted) before everyone
             * joined: the late engines give up on it. */
            for (int p = 0; p < r->nparts; p++)
                r->parts[p].refused = r->parts[p].refused || !r->parts[p].joined;
            pending = false;
        }
        if (!pending && (r->key.generation == 0 || state == 0 || room_terminal_state(state)))
            ri = -1;
        else if (!pending)
            return; /* the room is still running: wait for it */
    }
    if (ri < 0)
        ri = new_room(w, room_id, act->b, act->c);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    int p = 0;
    while (p < r->nparts && (r->parts[p].joined || r->parts[p].refused))
        p++;
    if (p == r->nparts)
        return;
    struct spart *sp = &r->parts[p];
    struct snode *n = &w->nodes[sp->node];
    if (!(n->alive && n->connected) && act->c % 8 != 0)
        return; /* the engine mostly waits for its node to be back */
    struct kvf_cps_page_range rg = {0, 0};
    int pages = (int)sp->ranges[0].count;
    if (pages > 0 && !alloc_pages(n, pages, (uint32_t)(ri * MAX_PARTS + p + 1), &rg))
        return; /* the engine has no free pages now; it tries again later */
    struct kvf_cps_join j = {
        .room_id = room_id,
        .expected_sources = (uint32_t)r->nsrc,
        .expected_sinks = (uint32_t)r->nsink,
        .node_id = n->name,
        .rank = sp->rank,
        .role = sp->role,
        .engine_protocol_min = KVF_PROTOCOL_MIN,
        .engine_protocol_max = KVF_PROTOCOL_MAX,
        .engine_features = KVF_FEATURE_QUIESCE_V1,
        .pool_id = 1,
        .ranges = &rg,
        .range_count = pages > 0 ? 1 : 0,
    };
    struct kvf_cps_join_result res;
    struct kvf_error err;
    int rc = kvf_cps_join(w->cps, &j, w->now, &res, &err);
    if (rc != 0) {
        if (pages > 0)
            free_range(n, &rg);
        sp->refused = true;
        w->stats.joins_refused++;
        if (n->old && n->alive && n->connected && rc != -ENOTSUP)
            fail(w, "I7: join from %s (no QUIESCE_V1) got %d, not -ENOTSUP: %s", n->name, rc,
                 err.msg);
        route_effects(w);
        return;
    }
    if (n->old)
        fail(w, "I7: join from %s (no QUIESCE_V1) was accepted", n->name);
    if (r->key.generation != 0 && !kvf_room_key_eq(r->key, res.key))
        fail(w, "joins of one room got two keys: %llu:%llu and %llu:%llu",
             (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation,
             (unsigned long long)res.key.room_id, (unsigned long long)res.key.generation);
    r->key = res.key;
    sp->joined = true;
    sp->inc = n->inc;
    sp->lease_id = res.lease_id;
    sp->ranges[0] = rg;
    sp->nranges = pages > 0 ? 1 : 0;
    route_effects(w);
}

/* Picks the `k`-th room that has a key and is not dead, or -1. With
 * `active`, only rooms last seen ACTIVE (transfers mostly target those). */
static int pick_room_in(const struct world *w, uint32_t k, bool active)
{
    int cand[MAX_ROOMS];
    int n = 0;
    for (int i = 0; i < w->nrooms; i++) {
        const struct sroom *r = &w->rooms[i];
        if (r->used && !r->dead && r->key.generation != 0 &&
            (!active || r->state == KVF_CPS_ROOM_ACTIVE))
            cand[n++] = i;
    }
    return n == 0 ? -1 : cand[k % (uint32_t)n];
}

static int pick_room(const struct world *w, uint32_t k)
{
    return pick_room_in(w, k, false);
}

static void act_extend(struct world *w, const struct action *act)
{
    int ri = pick_room(w, act->a);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    struct spart *sp = &r->parts[act->b % (uint32_t)r->nparts];
    int p = (int)(sp - r->parts);
    if (!sp->joined || sp->nranges == 0 || sp->nranges == MAX_RANGES || sp->completed_sent)
        return;
    struct snode *n = &w->nodes[sp->node];
    struct kvf_cps_page_range rg;
    if (!alloc_pages(n, 1 + (int)(act->c % 3), (uint32_t)(ri * MAX_PARTS + p + 1), &rg))
        return;
    int rc = kvf_cps_lease_extend(w->cps, r->key, sp->lease_id, &rg, 1, w->now, NULL);
    if (rc != 0) {
        free_range(n, &rg);
    } else {
        sp->ranges[sp->nranges++] = rg;
        if (sp->role == KVF_CPS_ROLE_SOURCE)
            sp->chunks_planned++;
    }
    route_effects(w);
}

struct sop *op_alloc(struct world *w)
{
    for (int i = 0; i < MAX_OPS; i++) {
        if (!w->ops[i].used)
            return &w->ops[i];
    }
    return NULL;
}

/* A node admits one op for a chunk; NULL when admission refused it. */
struct sop *admit_op(struct world *w, int node, int ri, int src, int sink, enum kvf_lt_op_kind kind,
                     int peer, uint64_t peer_inc)
{
    struct snode *n = &w->nodes[node];
    struct nlife *l = life_find(n, w->rooms[ri].key);
    struct sop *o = op_alloc(w);
    uint32_t slot;
    if (l == NULL || o == NULL || node_peer_slot(w, node, peer, peer_inc, &slot) != 0)
        return NULL;
    int rc = kvf_lt_admit(l->cr.lt, &o->op, kind, slot);
    if (rc != 0) {
        w->stats.ops_refused++;
        return NULL;
    }
    if (w->rooms[ri].abort_seen[node])
        fail(w, "I2: %s admitted an op for room %llu:%llu after processing its abort notice",
             n->name, (unsigned long long)w->rooms[ri].key.room_id,
             (unsigned long long)w->rooms[ri].key.generation);
    *o = (struct sop){.used = true,
                      .op = o->op,
                      .kind = kind,
                      .node = node,
                      .peer = peer,
                      .peer_inc = peer_inc,
                      .room = ri,
                      .src_part = src,
                      .sink_part = sink};
    for (int i = 0; i < NODES; i++)
        o->neutral[i] = w->nodes[i].fenced_inc[node] == n->inc;
    /* The sink's node is a newer process or incarnation than the one that
     * holds those pages: no connection of this op reaches them. */
    if (src >= 0 && sink >= 0 && peer != node && w->nodes[peer].inc != w->rooms[ri].parts[sink].inc)
        o->neutral[peer] = true;
    /* A lease it can reach must not be RELEASED (a peer that fenced this
     * node, or a newer process of the peer, cannot be reached by it). */
    struct sroom *r = &w->rooms[ri];
    if ((src >= 0 && cp_lease_state(w, r, src) == KVF_CPS_LEASE_RELEASED &&
         op_harms(w, o, ri, src)) ||
        (sink >= 0 && cp_lease_state(w, r, sink) == KVF_CPS_LEASE_RELEASED &&
         op_harms(w, o, ri, sink)))
        fail(w, "I3: %s admitted an op on a RELEASED lease of room %llu:%llu", n->name,
             (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation);
    w->stats.ops_admitted++;
    return o;
}

static void act_submit(struct world *w, const struct action *act)
{
    int ri = pick_room_in(w, act->a, act->c % 8 != 0);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    int src = (int)(act->b % (uint32_t)r->nsrc);
    struct spart *sp = &r->parts[src];
    struct snode *n = &w->nodes[sp->node];
    if (!sp->joined || sp->completed_sent || !n->alive || n->paused)
        return; /* a participant that reported completion submits nothing more */
    if (!n->racing && cp_node_lost(w, sp->node, n->inc))
        return; /* it self-fenced before it was declared LOST: admission is shut
                 * (a resumed process may still run before its self-fence) */
    struct nlife *l = life_find(n, r->key);
    if (l == NULL)
        return; /* no room update yet: the node knows no sink lease */
    /* A queued chunk starts first (a chunk of a room whose admission shut
     * is dropped by the staging queue); else a new chunk is queued or
     * started, as the node core admits it. */
    struct schunk *qc = NULL;
    for (int i = 0; i < MAX_CHUNKS && qc == NULL; i++) {
        if (w->chunks[i].used && w->chunks[i].node == sp->node && w->chunks[i].room == ri)
            qc = &w->chunks[i];
    }
    int sink;
    if (qc != NULL) {
        bool open = kvf_lt_is_open(l->cr.lt);
        src = qc->part;
        sink = qc->sink;
        qc->used = false;
        r->parts[qc->part].chunks_queued--;
        kvf_ncore_room_release(&l->cr);
        if (!open)
            return;
    } else {
        if (sp->chunks_sent >= sp->chunks_planned)
            return;
        sink = r->nsrc + (int)(act->c % (uint32_t)r->nsink);
        if (!r->parts[sink].joined || r->parts[sink].nranges == 0)
            return; /* a dummy sink receives nothing */
        uint64_t seq = l->pair_seq[sink] + 1;
        struct kvf_ncore_chunk q = {
            .have_update = l->have_update,
            .src_local = true,
            .src_completed = sp->completed_sent,
            .src_failed = sp->failed,
            .sink_known = (l->known_parts >> sink) & 1,
            .sink_unpublished = !((l->known_parts >> sink) & 1),
            .pair_exists = l->pair_seq[sink] != 0,
            .pair_last_submitted = false,
            .pair_last_seq = l->pair_seq[sink],
            .seq = seq,
            .src_rank = sp->rank,
            .sink_rank = r->parts[sink].rank,
            .sink_node = w->nodes[r->parts[sink].node].name,
        };
        int rc = kvf_ncore_chunk_state(n->core, &l->cr, &q);
        if (rc == 0)
            rc = kvf_ncore_chunk_order(n->core, &q);
        node_apply(w, sp->node);
        if (rc != 0) {
            w->stats.chunks_refused++;
            return;
        }
        l->pair_seq[sink] = seq;
        sp->chunks_sent++;
        if (act->c % 4 == 0) {
            for (int i = 0; i < MAX_CHUNKS; i++) {
                if (!w->chunks[i].used) {
                    w->chunks[i] = (struct schunk){.used = true,
                                                   .node = sp->node,
                                                   .room = ri,
                                                   .part = src,
                                                   .sink = sink,
                                                   .life = l};
                    kvf_ncore_room_hold(&l->cr);
                    sp->chunks_queued++;
                    return;
                }
            }
            return;
        }
    }
    int peer = r->parts[sink].node;
    if (n->fenced_inc[peer] != 0 && n->fenced_inc[peer] == w->nodes[peer].inc)
        return; /* this node fenced that peer: its queue pairs are in error */
    enum kvf_lt_op_kind kind = act->b % 2 ? KVF_LT_OP_RDMA_WR : KVF_LT_OP_TCP_FRAME;
    admit_op(w, sp->node, ri, src, sink, kind, peer, w->nodes[peer].inc);
}

static void act_sink_op(struct world *w, const struct action *act)
{
    int ri = pick_room_in(w, act->a, act->c % 8 != 0);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    int sink = r->nsrc + (int)(act->b % (uint32_t)r->nsink);
    struct spart *sp = &r->parts[sink];
    if (!sp->joined || sp->nranges == 0 || sp->completed_sent || !w->nodes[sp->node].alive ||
        w->nodes[sp->node].paused)
        return;
    admit_op(w, sp->node, ri, -1, sink, KVF_LT_OP_CUDA_COPY, sp->node, w->nodes[sp->node].inc);
}

static void act_complete(struct world *w, const struct action *act, enum kvf_lt_outcome outcome)
{
    int idx[MAX_OPS];
    int n = live_ops(w, idx, false);
    if (n == 0)
        return;
    op_retire(w, &w->ops[idx[act->a % (uint32_t)n]], outcome);
}

static void act_quarantine(struct world *w, const struct action *act)
{
    int idx[MAX_OPS];
    int n = live_ops(w, idx, true);
    if (n == 0)
        return;
    struct sop *o = &w->ops[idx[act->a % (uint32_t)n]];
    kvf_lt_op_quarantine(&o->op);
    o->quarantined = true;
    /* An error that proves nothing is still a failed transfer: report it. */
    report(&w->nodes[o->node], &(struct msg){.type = R_FAILED, .key = w->rooms[o->room].key});
    if (kvf_lt_state(o->op.lt) == KVF_LT_DRAINED)
        fail(w, "R3: a lifetime with a quarantined op reads DRAINED");
}

static void act_abort(struct world *w, const struct action *act, bool admin)
{
    int ri = pick_room(w, act->a);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    kvf_token tok;
    kvf_room_key key = admin ? (kvf_room_key){r->key.room_id, 0} : r->key;
    if (admin && w->current[r->key.room_id] != ri)
        return; /* generation 0 names the current room of the id only */
    int rc = kvf_cps_room_abort(w->cps, key, admin ? KVF_CPS_ABORT_ADMIN : KVF_CPS_ABORT_ENGINE,
                                w->now, &tok, NULL);
    if (rc == 0) {
        if (kvf_token_is_zero(tok))
            fail(w, "abort returned an all-zero token");
        if (r->have_token && !kvf_token_eq(tok, r->token))
            fail(w, "I4: a second abort of room %llu:%llu returned another token",
                 (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation);
        r->have_token = true;
        r->token = tok;
    }
    route_effects(w);
}

static void deliver_report(struct world *w, int node, const struct msg *m)
{
    struct snode *n = &w->nodes[node];
    int rc = 0;
    kvf_token tok;
    switch (m->type) {
    case R_DRAINED:
        rc = kvf_cps_report_drained(w->cps, n->name, m->inc, m->key, m->token, w->now, NULL);
        break;
    case R_COMPLETED:
        rc = kvf_cps_report_completed(w->cps, n->name, m->inc, m->key, m->rank, m->role, w->now,
                                      NULL);
        break;
    case R_FAILED:
        rc = kvf_cps_report_failed(w->cps, n->name, m->inc, m->key, w->now, &tok, NULL);
        break;
    case R_UPDATE_ACK:
        rc = kvf_cps_room_update_acked(w->cps, n->name, m->inc, m->key, m->version, w->now, NULL);
        break;
    case R_FENCED:
        if (m->peer >= 0)
            rc = kvf_cps_report_fenced(w->cps, n->name, m->inc, w->nodes[m->peer].name, m->peer_inc,
                                       w->now, NULL);
        break;
    default:
        fail(w, "a notice was delivered to the control plane");
    }
    if (rc != 0)
        w->stats.reports_rejected++;
    route_effects(w);
}

static int pick_node(const struct world *w, uint32_t k, bool want_inbox)
{
    for (int i = 0; i < NODES; i++) {
        int node = (int)((k + (uint32_t)i) % NODES);
        const struct snode *n = &w->nodes[node];
        const struct queue *q = want_inbox ? &n->inbox : &n->outbox;
        if (n->alive && n->connected && q->len > 0)
            return node;
    }
    return -1;
}

/* ---- stale reports and bad joins ------------------------------------------ */

struct room_snapshot {
    int state;
    bool drained[MAX_PARTS];
    uint64_t rooms_by_state[6];
};

static void snapshot(const struct world *w, const struct sroom *r, struct room_snapshot *s)
{
    memset(s, 0, sizeof(*s));
    s->state = cp_room_state(w, r->key);
    struct kvf_cps_room_view v;
    if (kvf_cps_room_get(w->cps, r->key, &v) == 0) {
        for (size_t i = 0; i < v.participant_count && i < MAX_PARTS; i++) {
            struct kvf_cps_participant_view pv;
            if (kvf_cps_room_participant(w->cps, r->key, i, &pv) == 0)
                s->drained[i] = pv.node_drained;
        }
    }
    struct kvf_cps_stats st;
    kvf_cps_stats_get(w->cps, &st);
    memcpy(s->rooms_by_state, st.rooms_by_state, sizeof(s->rooms_by_state));
}

static void act_stale_report(struct world *w, const struct action *act)
{
    int ri = pick_room(w, act->a);
    if (ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    struct spart *sp = &r->parts[act->b % (uint32_t)r->nparts];
    if (!sp->joined)
        return;
    struct snode *n = &w->nodes[sp->node];
    struct room_snapshot before, after;
    snapshot(w, r, &before);
    kvf_token tok = r->token;
    kvf_room_key key = r->key;
    const char *from = n->name;
    uint64_t inc = n->inc;
    bool must_fail = true;
    switch (act->c % 5) {
    case 0: /* no token */
        tok = (kvf_token){0, 0};
        break;
    case 1: /* a token nobody minted */
        tok.hi ^= 0x5a5a5a5a5a5a5a5aull;
        tok.lo += 1;
        break;
    case 2: /* the current token on the previous generation of the id (R13) */
        if (key.generation < 2)
            return;
        key.generation--;
        must_fail = room_by_key(w, key) < 0; /* a real older room may accept its own */
        break;
    case 3: { /* a node that is not in the room */
        int other = -1;
        for (int i = 0; i < 4 && other < 0; i++) {
            bool in = false;
            for (int p = 0; p < r->nparts; p++)
                in = in || r->parts[p].node == i;
            if (!in)
                other = i;
        }
        if (other < 0)
            return;
        from = w->nodes[other].name;
        inc = w->nodes[other].inc;
        break;
    }
    default: /* an old incarnation of the right node */
        if (inc < 2)
            return;
        inc--;
        break;
    }
    if (!r->have_token && act->c % 5 != 0)
        tok = (kvf_token){0x1234, 0x5678};
    int rc = kvf_cps_report_drained(w->cps, from, inc, key, tok, w->now, NULL);
    if (must_fail && rc == 0)
        fail(w, "I5: a stale drained report (variant %u) for room %llu:%llu was accepted",
             act->c % 5, (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation);
    w->stats.reports_rejected += rc != 0;
    route_effects(w);
    snapshot(w, r, &after);
    if (memcmp(&before, &after, sizeof(before)) != 0)
        fail(w, "I5: a stale drained report (variant %u) changed room %llu:%llu", act->c % 5,
             (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation);
}

static void act_bad_join(struct world *w, const struct action *act)
{
    struct snode *n = &w->nodes[act->a % 4];
    int pg = (int)(act->b % POOL_PAGES);
    if (n->page_owner[pg] == 0 || !n->alive || !n->connected)
        return;
    uint32_t owner = n->page_owner[pg] - 1;
    struct sroom *r = &w->rooms[owner / MAX_PARTS];
    struct spart *sp = &r->parts[owner % MAX_PARTS];
    if (!sp->joined || sp->released)
        return; /* allocated for a join in progress, or freed */
    struct kvf_cps_page_range rg = {(uint32_t)pg, 1};
    uint64_t room_id = w->next_bad_id++;
    struct kvf_cps_join j = {
        .room_id = room_id,
        .expected_sources = 1,
        .expected_sinks = 1,
        .node_id = n->name,
        .rank = 0,
        .role = KVF_CPS_ROLE_SINK,
        .engine_protocol_min = KVF_PROTOCOL_MIN,
        .engine_protocol_max = KVF_PROTOCOL_MAX,
        .engine_features = KVF_FEATURE_QUIESCE_V1,
        .pool_id = 1,
        .ranges = &rg,
        .range_count = 1,
    };
    struct kvf_cps_stats before, after;
    kvf_cps_stats_get(w->cps, &before);
    struct kvf_cps_join_result res;
    struct kvf_error err;
    int rc = kvf_cps_join(w->cps, &j, w->now, &res, &err);
    route_effects(w);
    kvf_cps_stats_get(w->cps, &after);
    struct kvf_cps_room_view v;
    if (rc == 0)
        fail(w,
             "I3: a write lease on %s page %d was granted to room %llu while room %llu:%llu "
             "holds it",
             n->name, pg, (unsigned long long)room_id, (unsigned long long)r->key.room_id,
             (unsigned long long)r->key.generation);
    else if (rc != -EBUSY)
        fail(w, "I3: an overlapping join got %d, not -EBUSY: %s", rc, err.msg);
    else if (kvf_cps_room_get(w->cps, (kvf_room_key){room_id, 0}, &v) != -ENOENT ||
             memcmp(before.rooms_by_state, after.rooms_by_state, sizeof(before.rooms_by_state)) !=
                 0 ||
             memcmp(before.leases_by_state, after.leases_by_state,
                    sizeof(before.leases_by_state)) != 0)
        fail(w, "I3: a refused join left state behind");
    w->stats.joins_refused++;
}

/* ---- the step ----------------------------------------------------------- */

/* Before each action: a running node whose session has been down for its
 * margin fences itself now (its timer fires on time; a resumed node that was
 * paused past it is the exception: it races, see node_resume). With
 * MUT_ACK_EARLY the images of the last two steps are kept for the crash. */
static void before_step(struct world *w)
{
    for (int i = 0; i < NODES && !w->failed; i++) {
        struct snode *n = &w->nodes[i];
        if (n->alive && !n->paused && !n->connected && n->down && !n->racing &&
            w->now - n->down_since >= self_fence_after(w))
            node_self_fence(w, i);
    }
    if (w->mutation == MUT_ACK_EARLY) {
        struct image t = w->img_older;
        w->img_older = w->img_old;
        w->img_old = t;
        if (image_take(w, &w->img_old) != 0)
            fail(w, "kvf_cps_snapshot failed");
    }
}

/* The end of a turn of every running node's owner loop: the core forgets
 * terminal rooms beyond its count; a self-fenced node may witness. */
static void after_step(struct world *w)
{
    for (int i = 0; i < NODES && !w->failed; i++) {
        if (w->nodes[i].alive && !w->nodes[i].paused)
            node_collect(w, i);
        node_maybe_witness(w, i);
    }
}

/* The first node (from k on) that is alive, runs and has a frame waiting. */
static int pick_rx_node(const struct world *w, uint32_t k)
{
    for (int i = 0; i < NODES; i++) {
        int node = (int)((k + (uint32_t)i) % NODES);
        const struct snode *n = &w->nodes[node];
        if (n->alive && !n->paused && n->nrx > 0)
            return node;
    }
    return -1;
}

bool world_step(struct world *w, const struct action *act)
{
    if (w->failed)
        return false;
    if (w->trace)
        printf("  %s a=%u b=%u c=%u\n", act_name(act->kind), act->a, act->b, act->c);
    before_step(w);
    switch ((enum act_kind)act->kind) {
    case ACT_JOIN:
        act_join(w, act);
        break;
    case ACT_EXTEND:
        act_extend(w, act);
        break;
    case ACT_SUBMIT:
        act_submit(w, act);
        break;
    case ACT_SINK_OP:
        act_sink_op(w, act);
        break;
    case ACT_COMPLETE_OK:
        act_complete(w, act, KVF_LT_DONE_OK);
        break;
    case ACT_COMPLETE_ERR:
        act_complete(w, act, KVF_LT_DONE_ERROR);
        break;
    case ACT_QUARANTINE:
        act_quarantine(w, act);
        break;
    case ACT_ABORT:
        act_abort(w, act, false);
        break;
    case ACT_ADMIN_ABORT:
        act_abort(w, act, true);
        break;
    case ACT_DELIVER_CP: {
        int node = pick_node(w, act->a, true);
        struct msg m;
        if (node >= 0 && q_pop(&w->nodes[node].inbox, &m))
            node_handle(w, node, &m);
        break;
    }
    case ACT_DELIVER_NODE: {
        int node = pick_node(w, act->a, false);
        struct msg m;
        if (node >= 0 && q_pop(&w->nodes[node].outbox, &m))
            deliver_report(w, node, &m);
        break;
    }
    case ACT_DROP_CP: {
        int node = pick_node(w, act->a, true);
        if (node >= 0)
            q_pop(&w->nodes[node].inbox, NULL);
        break;
    }
    case ACT_DUP_NODE: {
        int node = pick_node(w, act->a, false);
        if (node >= 0) {
            struct queue *q = &w->nodes[node].outbox;
            q_push(q, &q->m[q->head]);
        }
        break;
    }
    case ACT_STALE_REPORT:
        act_stale_report(w, act);
        break;
    case ACT_BAD_JOIN:
        act_bad_join(w, act);
        break;
    case ACT_DISCONNECT: {
        int node = (int)(act->a % NODES);
        if (w->nodes[node].alive && w->nodes[node].connected)
            node_down(w, node);
        break;
    }
    case ACT_RECONNECT:
        act_reconnect(w, (int)(act->a % NODES));
        break;
    case ACT_KILL:
        node_kill(w, (int)(act->a % NODES));
        break;
    case ACT_RESTART: {
        int node = (int)(act->a % NODES);
        if (!w->nodes[node].alive)
            node_start(w, node);
        else if (w->mutation == MUT_PAUSED_WITNESSED && w->nodes[node].paused)
            phantom_start(w, node);
        break;
    }
    case ACT_ADMIN_FENCE:
        kvf_cps_admin_fence(w->cps, w->nodes[act->a % NODES].name, w->now, NULL);
        route_effects(w);
        break;
    case ACT_TICK: {
        kvf_time_ns d;
        if (act->a % 32 < 29)
            d = (act->b % 300) * KVF_NS_PER_MS;
        else if (act->a % 32 < 31)
            d = (1 + act->b % 15) * KVF_NS_PER_S;
        else
            d = 61 * KVF_NS_PER_S;
        w->now += d;
        kvf_cps_tick(w->cps, w->now);
        route_effects(w);
        break;
    }
    case ACT_PAUSE:
        node_pause(w, (int)(act->a % NODES));
        break;
    case ACT_RESUME:
        node_resume(w, (int)(act->a % NODES));
        break;
    case ACT_RECV: {
        int node = pick_rx_node(w, act->a);
        if (node >= 0)
            node_recv(w, node, act->b % 4 == 0, act->c);
        break;
    }
    case ACT_DUP_FRAME: {
        int node = pick_rx_node(w, act->a);
        struct snode *n = node >= 0 ? &w->nodes[node] : NULL;
        if (n != NULL && n->nrx < RXCAP) {
            n->rx[n->nrx] = n->rx[act->b % (uint32_t)n->nrx];
            n->nrx++;
        }
        break;
    }
    case ACT_DROP_NODE: {
        int node = pick_node(w, act->a, false);
        if (node >= 0)
            q_pop(&w->nodes[node].outbox, NULL);
        break;
    }
    case ACT_REORDER_CP: {
        int node = pick_node(w, act->a, true);
        struct queue *q = node >= 0 ? &w->nodes[node].inbox : NULL;
        if (q != NULL && q->len >= 2) {
            unsigned k = (q->head + 1 + act->b % (q->len - 1)) % QCAP;
            struct msg t = q->m[q->head];
            q->m[q->head] = q->m[k];
            q->m[k] = t;
            struct msg m;
            q_pop(q, &m);
            node_handle(w, node, &m);
        }
        break;
    }
    case ACT_SELF_FENCE: {
        int node = (int)(act->a % NODES);
        struct snode *n = &w->nodes[node];
        if (n->alive && !n->paused && !n->connected && n->down &&
            w->now - n->down_since >= self_fence_after(w))
            node_self_fence(w, node);
        break;
    }
    case ACT_CP_CRASH:
        cp_crash(w, act->b);
        break;
    default:
        break;
    }
    if (!w->failed)
        after_step(w);
    if (!w->failed)
        check_invariants(w);
    return !w->failed;
}

/* ---- quiesce and the end-state checks -------------------------------------- */

static bool world_settled(struct world *w)
{
    for (int i = 0; i < MAX_OPS; i++) {
        if (w->ops[i].used)
            return false;
    }
    for (int i = 0; i < NODES; i++) {
        if (w->nodes[i].inbox.len > 0 || w->nodes[i].outbox.len > 0 || w->nodes[i].nrx > 0 ||
            w->nodes[i].pending_witness != 0)
            return false;
    }
    for (int ri = 0; ri < w->nrooms; ri++) {
        struct sroom *r = &w->rooms[ri];
        if (!r->used || r->dead || r->key.generation == 0)
            continue;
        return false;
    }
    return true;
}

bool world_quiesce(struct world *w)
{
    for (int iter = 0; iter < 400 && !w->failed; iter++) {
        for (int i = 0; i < NODES; i++) {
            if (w->nodes[i].paused)
                node_resume(w, i);
            if (!w->nodes[i].alive)
                node_start(w, i);
            else if (!w->nodes[i].connected)
                act_reconnect(w, i);
        }
        for (int round = 0; round < 64 && !w->failed; round++) {
            bool moved = false;
            for (int i = 0; i < NODES; i++) {
                struct msg m;
                while (!w->failed && w->nodes[i].alive && w->nodes[i].connected &&
                       q_pop(&w->nodes[i].inbox, &m)) {
                    node_handle(w, i, &m);
                    moved = true;
                }
                while (!w->failed && w->nodes[i].alive && w->nodes[i].connected &&
                       q_pop(&w->nodes[i].outbox, &m)) {
                    deliver_report(w, i, &m);
                    moved = true;
                }
            }
            for (int i = 0; i < NODES && !w->failed; i++) {
                while (!w->failed && w->nodes[i].nrx > 0) {
                    node_recv(w, i, false, 0);
                    moved = true;
                }
            }
            for (int i = 0; i < MAX_OPS; i++) {
                if (w->ops[i].used) {
                    op_retire(w, &w->ops[i], KVF_LT_DONE_OK);
                    moved = true;
                }
            }
            for (int i = 0; i < NODES && !w->failed; i++) {
                uint64_t before = w->nodes[i].pending_witness;
                if (w->nodes[i].alive && !w->nodes[i].paused)
                    node_collect(w, i);
                node_maybe_witness(w, i);
                moved = moved || before != w->nodes[i].pending_witness;
            }
            if (!moved)
                break;
        }
        if (world_settled(w))
            break;
        /* Routers give up on what is still open (after a grace for the
         * completions above to land). */
        if (iter >= 2) {
            for (int ri = 0; ri < w->nrooms; ri++) {
                struct sroom *r = &w->rooms[ri];
                int s = r->used && !r->dead ? cp_room_state(w, r->key) : 0;
                if (s == KVF_CPS_ROOM_OPENING || s == KVF_CPS_ROOM_ACTIVE) {
                    kvf_token tok;
                    kvf_cps_room_abort(w->cps, r->key, KVF_CPS_ABORT_ENGINE, w->now, &tok, NULL);
                    route_effects(w);
                }
            }
        }
        w->now += 500 * KVF_NS_PER_MS;
        kvf_cps_tick(w->cps, w->now);
        route_effects(w);
        if (!w->failed)
            check_invariants(w);
    }
    if (w->failed)
        return false;
    /* The end state. */
    for (int ri = 0; ri < w->nrooms; ri++) {
        struct sroom *r = &w->rooms[ri];
        if (!r->used || r->key.generation == 0)
            continue;
        int s = cp_room_state(w, r->key);
        if (s != 0 && !room_terminal_state(s))
            fail(w, "liveness: room %llu:%llu is still %s after quiesce",
                 (unsigned long long)r->key.room_id, (unsigned long long)r->key.generation,
                 kvf_cps_room_state_name(s));
        for (int p = 0; p < r->nparts; p++) {
            if (r->parts[p].joined && !r->parts[p].released)
                fail(w, "liveness: lease %llu of room %llu:%llu (%s) was never released",
                     (unsigned long long)r->parts[p].lease_id, (unsigned long long)r->key.room_id,
                     (unsigned long long)r->key.generation,
                     s ? kvf_cps_room_state_name(s) : "gone");
        }
    }
    for (int i = 0; i < NODES; i++) {
        struct snode *n = &w->nodes[i];
        for (int pg = 0; pg < POOL_PAGES; pg++) {
            if (n->page_owner[pg] != 0) {
                fail(w, "liveness: page %d of %s never went back to its engine", pg, n->name);
                break;
            }
        }
        if (n->alive) {
            for (int k = 0; k < MAX_LIVES; k++) {
                struct nlife *l = &n->lives[k];
                if (l->used && kvf_lt_state(l->cr.lt) != KVF_LT_OPEN &&
                    kvf_lt_state(l->cr.lt) != KVF_LT_DRAINED)
                    fail(w, "liveness: %s lifetime %llu:%llu is %s", n->name,
                         (unsigned long long)l->key.room_id, (unsigned long long)l->key.generation,
                         kvf_lt_state_name(kvf_lt_state(l->cr.lt)));
            }
        }
    }
    return !w->failed;
}

/* ---- create / destroy ---------------------------------------------------- */

struct world *world_create(uint64_t seed, const struct world_opts *opts)
{
    struct world *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return NULL;
    w->rng = seed;
    w->trace = opts != NULL && opts->trace;
    w->mutation = opts != NULL ? opts->mutation : MUT_NONE;
    w->now = KVF_NS_PER_S;
    w->next_bad_id = 1000000;
    for (int i = 0; i <= ROOM_IDS; i++)
        w->current[i] = -1;
    struct kvf_cps_opts co;
    kvf_cps_opts_init(&co);
    co.random_fn = world_random;
    co.node_ttl = 2 * KVF_NS_PER_S; /* shorter than the default: more nodes get LOST */
    co.random_ctx = w;
    w->co = co;
    w->cps = kvf_cps_create(&co);
    if (w->cps == NULL) {
        free(w);
        return NULL;
    }
    for (int i = 0; i < NODES; i++) {
        struct snode *n = &w->nodes[i];
        snprintf(n->name, sizeof(n->name), "n%d", i);
        n->old = i == OLD_NODE && opts != NULL && opts->with_old_node;
        node_start(w, i);
    }
    return w;
}

void world_destroy(struct world *w)
{
    if (w == NULL)
        return;
    for (int i = 0; i < NODES; i++)
        kvf_ncore_destroy(w->nodes[i].core); /* and its lifetime table */
    kvf_cps_destroy(w->cps);
    free(w->img.buf);
    free(w->img_old.buf);
    free(w->img_older.buf);
    free(w);
}

const char *world_failure(const struct world *w)
{
    return w->failed ? w->failure : NULL;
}

void world_stats(const struct world *w, struct world_stats *out)
{
    *out = w->stats;
}

const char *act_name(enum act_kind k)
{
    static const char *const names[ACT_KIND_COUNT] = {
        "join",       "extend",       "submit",      "sink_op",    "complete_ok",  "complete_err",
        "quarantine", "abort",        "admin_abort", "deliver_cp", "deliver_node", "drop_cp",
        "dup_node",   "stale_report", "bad_join",    "disconnect", "reconnect",    "kill",
        "restart",    "admin_fence",  "tick",        "pause",      "resume",       "recv",
        "dup_frame",  "drop_node",    "reorder_cp",  "self_fence", "cp_crash",
    };
    return (unsigned)k < ACT_KIND_COUNT ? names[k] : "?";
}

static const char *const mutation_names[MUT_COUNT] = {
    [MUT_NONE] = "none",
    [MUT_PAUSED_WITNESSED] = "paused-witnessed",
    [MUT_RECV_NOT_OP] = "recv-not-op",
    [MUT_NO_SEQ] = "no-seq",
    [MUT_ABORT_NO_OPEN] = "abort-no-open",
    [MUT_NO_REREPORT] = "no-rereport",
    [MUT_ACK_EARLY] = "ack-early",
    [MUT_WITNESS_EARLY] = "witness-early",
    [MUT_SINK_RX_UNCOUNTED] = "sink-rx-uncounted",
};

int world_mutation_by_name(const char *name)
{
    for (int m = 0; m < MUT_COUNT; m++) {
        if (strcmp(mutation_names[m], name) == 0)
            return m;
    }
    return -1;
}

const char *world_mutation_name(enum world_mutation m)
{
    return (unsigned)m < MUT_COUNT ? mutation_names[m] : "?";
}
