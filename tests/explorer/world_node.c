/*
 * world_node.c: the node side of the simulated cluster (world.c): the node
 * agent, which feeds each node's core (kvf_ncore) room updates, notices and
 * fences and routes its effects (node_apply), the lives of node
 * processes (attach, kill, restart, Resync, reconnect, pause and resume,
 * self-fence and Witness), node -> node TCP frames (a source's written frame
 * waits in the sink's socket buffer until the sink's receiver takes it), and
 * the control plane's crash and recovery, which ends every session.
 *
 * Everything here runs on the explorer's one thread, one action at a time;
 * "threads" of a node (its receiver, its timers) are actions the schedule
 * interleaves.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "world_internal.h"

/* ---- node agent: rooms in the node core ---------------------------------- */

struct nlife *life_find(struct snode *n, kvf_room_key key)
{
    for (int i = 0; i < MAX_LIVES; i++) {
        if (n->lives[i].used && kvf_room_key_eq(n->lives[i].key, key))
            return &n->lives[i];
    }
    return NULL;
}

/* Opens the room in the node core (its lifetime with it); NULL when the core
 * refuses (a late generation, the node's own check comes first). */
static struct nlife *life_open(struct world *w, struct snode *n, kvf_room_key key)
{
    if (kvf_lt_table_is_late(n->tab, key))
        return NULL;
    for (int i = 0; i < MAX_LIVES; i++) {
        struct nlife *l = &n->lives[i];
        if (l->used)
            continue;
        *l = (struct nlife){.used = true, .inc = n->inc, .key = key};
        int rc = kvf_ncore_room_open(n->core, &l->cr, key, l);
        if (rc != 0) {
            l->used = false;
            if (rc != -ESTALE && rc != -EEXIST)
                fail(w, "%s: kvf_ncore_room_open(%llu:%llu) failed: %d (%s)", n->name,
                     (unsigned long long)key.room_id, (unsigned long long)key.generation, rc,
                     kvf_ncore_reason(n->core));
            return NULL;
        }
        return l;
    }
    fail(w, "%s: out of simulated rooms", n->name);
    return NULL;
}

void report(struct snode *n, const struct msg *m)
{
    struct msg r = *m;
    r.inc = n->inc;
    q_push(&n->outbox, &r);
}

/* The slot the node core gives (node `peer`, incarnation `inc`), remembered
 * so that closing every connection to a node finds all its slots. */
int node_peer_slot(struct world *w, int node, int peer, uint64_t inc, uint32_t *idx_p)
{
    struct snode *n = &w->nodes[node];
    int rc = kvf_ncore_peer_get(n->core, w->nodes[peer].name, inc, idx_p, NULL);
    node_apply(w, node); /* a recycled slot is dropped before it is used */
    if (rc != 0) {
        fail(w, "%s: no peer slot for %s incarnation %llu: %s", n->name, w->nodes[peer].name,
             (unsigned long long)inc, kvf_ncore_reason(n->core));
        return rc;
    }
    if (*idx_p >= MAX_SLOTS) {
        fail(w, "%s: peer slot %u beyond the simulated %d", n->name, *idx_p, MAX_SLOTS);
        return -E2BIG;
    }
    n->slot_node[*idx_p] = peer + 1;
    n->slot_inc[*idx_p] = inc;
    return 0;
}

static void peer_refs_drop(struct snode *n, struct nlife *l)
{
    for (int i = 0; i < l->npeer_refs; i++)
        kvf_ncore_peer_unref(n->core, l->peer_refs[i]);
    l->npeer_refs = 0;
}

/* A queued chunk leaves the staging queue (started or dropped). */
static void chunk_unqueue(struct world *w, struct schunk *ch)
{
    ch->used = false;
    w->rooms[ch->room].parts[ch->part].chunks_queued--;
    if (ch->life != NULL)
        kvf_ncore_room_release(&ch->life->cr);
    ch->life = NULL;
}

/* What each effect of the node core means for the simulated node (the
 * daemon's node_core_apply): reports into the outbox, rooms freed. */
void node_apply(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    struct kvf_ncore_fx fx;
    while (n->core != NULL && kvf_ncore_fx_take(n->core, &fx)) {
        struct nlife *l = fx.user;
        int ri = room_by_key(w, fx.room);
        switch (fx.kind) {
        case KVF_NCORE_FX_ROOM_DRAINED:
            peer_refs_drop(n, l); /* it sends to no peer again */
            break;
        case KVF_NCORE_FX_SEND_DRAINED:
            /* An older incarnation's room (kept after a self-fence) reports
             * nothing: the Witness of that incarnation is its proof. */
            if (l->inc == n->inc && !(w->mutation == MUT_NO_REREPORT && l->rereport_muted))
                report(n, &(struct msg){.type = R_DRAINED, .key = fx.room, .token = l->cr.token});
            break;
        case KVF_NCORE_FX_SEND_COMPLETED:
        case KVF_NCORE_FX_SEND_FAILED: {
            enum kvf_cps_role role = fx.kind == KVF_NCORE_FX_SEND_COMPLETED && fx.sink
                                         ? KVF_CPS_ROLE_SINK
                                         : KVF_CPS_ROLE_SOURCE;
            struct spart *sp = NULL;
            for (int p = 0; ri >= 0 && p < w->rooms[ri].nparts; p++) {
                struct spart *c = &w->rooms[ri].parts[p];
                if (c->node == node && c->rank == fx.rank && c->role == role)
                    sp = c;
            }
            if (sp == NULL) {
                fail(w, "%s: the node core named no local participant (rank %u)", n->name, fx.rank);
                break;
            }
            if (fx.kind == KVF_NCORE_FX_SEND_COMPLETED) {
                sp->completed_sent = true;
                report(n, &(struct msg){
                              .type = R_COMPLETED, .key = fx.room, .rank = fx.rank, .role = role});
            } else {
                sp->failed = true;
                report(n, &(struct msg){.type = R_FAILED, .key = fx.room});
            }
            break;
        }
        case KVF_NCORE_FX_CLOSE_PEERS:
        case KVF_NCORE_FX_ROOM_ABORTING:
            break; /* no peer channel and no watch stream in the simulation */
        case KVF_NCORE_FX_ROOM_FREE:
            if (l->cr.holds != 0)
                fail(w, "%s: the node core freed a held room", n->name);
            peer_refs_drop(n, l);
            l->used = false;
            w->stats.rooms_forgotten++;
            break;
        case KVF_NCORE_FX_PEER_RECYCLE:
            for (int i = 0; i < MAX_OPS; i++) {
                const struct sop *o = &w->ops[i];
                if (o->used && o->node == node && !o->unaccounted && o->op.peer == fx.peer)
                    fail(w, "%s: peer slot %u recycled while an op towards it is in flight",
                         n->name, fx.peer);
            }
            if (fx.peer < MAX_SLOTS)
                n->slot_node[fx.peer] = 0;
            w->stats.peers_recycled++;
            break;
        }
    }
}

/* The end of a turn of the node's owner loop: queued chunks of a room whose
 * admission is shut are dropped (the daemon's staging queue refuses them when
 * it takes them), then the core forgets terminal rooms beyond its count. */
void node_collect(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (n->core == NULL)
        return;
    for (int i = 0; i < MAX_CHUNKS; i++) {
        struct schunk *ch = &w->chunks[i];
        if (ch->used && ch->node == node && !kvf_lt_is_open(ch->life->cr.lt))
            chunk_unqueue(w, ch);
    }
    kvf_ncore_collect(n->core);
    node_apply(w, node);
}

/* The drain decision for every room of the node (the daemon checks a room
 * after each completion that may have drained it). */
void node_take_drains(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    for (int i = 0; i < MAX_LIVES; i++) {
        if (n->lives[i].used)
            kvf_ncore_room_check(n->core, &n->lives[i].cr);
    }
    node_apply(w, node);
}

/* A source's TCP frame was written: it waits in the sink's socket buffer,
 * unless the connection is closed (either side fenced the other, the sink's
 * process is gone or self-fenced since the op was posted, or the sink's
 * receiver closed the stream on a bad sequence number). */
void frame_send(struct world *w, const struct sop *o)
{
    struct snode *src = &w->nodes[o->node], *dst = &w->nodes[o->peer];
    /* The last chunk's status tells the sink how many frames to wait for. */
    w->rooms[o->room].parts[o->sink_part].frames_expected++;
    bool closed = !dst->alive || dst->inc != o->peer_inc ||
                  (src->fenced_inc[o->peer] != 0 && src->fenced_inc[o->peer] == dst->inc) ||
                  (dst->fenced_inc[o->node] != 0 && dst->fenced_inc[o->node] == src->inc) ||
                  (dst->conn_rx_inc[o->node] == src->inc && dst->conn_broken[o->node]);
    if (closed || dst->nrx == RXCAP) {
        w->stats.frames_dropped++;
        return;
    }
    if (src->conn_tx_inc[o->peer] != dst->inc) {
        src->conn_tx_inc[o->peer] = dst->inc; /* a new stream to the new process */
        src->conn_tx[o->peer] = 0;
    }
    uint64_t seq = ++w->seq_sent[o->room][o->node][o->peer];
    dst->rx[dst->nrx++] = (struct frame){.room = o->room,
                                         .src = o->src_part,
                                         .sink = o->sink_part,
                                         .from = o->node,
                                         .from_inc = src->inc,
                                         .seq = seq,
                                         .conn_seq = ++src->conn_tx[o->peer]};
}

/* ---- node agent: messages from the control plane ------------------------- */

/* A room update: the room opens in the core (once), which learns how many
 * of its participants are local, and the room references its peers' slots. */
static void node_room_update(struct world *w, int node, const struct msg *m)
{
    struct snode *n = &w->nodes[node];
    int ri = room_by_key(w, m->key);
    struct nlife *l = life_find(n, m->key);
    if (l == NULL)
        l = life_open(w, n, m->key);
    if (l == NULL || ri < 0)
        return;
    struct sroom *r = &w->rooms[ri];
    uint32_t nlocal = 0, ndone = 0;
    for (int p = 0; p < r->nparts; p++) {
        const struct spart *sp = &r->parts[p];
        if (!sp->joined || sp->refused)
            continue;
        if (sp->node == node && sp->inc == n->inc) {
            nlocal++;
            ndone += sp->completed_sent;
        }
        bool known = false;
        for (int k = 0; k < l->npeer_refs; k++)
            known |= n->slot_node[l->peer_refs[k]] == sp->node + 1 &&
                     n->slot_inc[l->peer_refs[k]] == sp->inc;
        uint32_t idx;
        if (!known && !l->cr.drained_seen && sp->node != node && l->npeer_refs < NODES * 2 &&
            node_peer_slot(w, node, sp->node, sp->inc, &idx) == 0) {
            kvf_ncore_peer_ref(n->core, idx);
            l->peer_refs[l->npeer_refs++] = idx;
        }
    }
    kvf_ncore_room_members(n->core, &l->cr, nlocal, ndone);
    l->have_update = true;
    l->known_parts |= m->published;
    node_apply(w, node);
    /* Applied: the control plane may now publish this node's leases to the
     * room's other nodes (node.c's RoomUpdateAck). */
    report(n, &(struct msg){.type = R_UPDATE_ACK, .key = m->key, .version = m->version});
    check_completion(w, ri);
}

static void node_abort_notice(struct world *w, int node, const struct msg *m)
{
    struct snode *n = &w->nodes[node];
    struct nlife *l = life_find(n, m->key);
    int ri = room_by_key(w, m->key);
    if (ri >= 0 && !kvf_token_is_zero(m->token))
        w->rooms[ri].abort_seen[node] = true;
    if (kvf_token_is_zero(m->token)) {
        /* A Resync's answer for an ended or forgotten room: close, no
         * report (kvfence-node does the same). */
        if (l != NULL) {
            kvf_ncore_room_end(n->core, &l->cr);
            node_apply(w, node);
        }
        return;
    }
    if (l == NULL && w->mutation == MUT_ABORT_NO_OPEN) {
        /* Nothing to drain here, says the mutated node, and forgets the
         * generation: a room update behind it opens it again. */
        report(n, &(struct msg){.type = R_DRAINED, .key = m->key, .token = m->token});
        return;
    }
    if (l == NULL)
        l = life_open(w, n, m->key); /* abort before any metadata */
    if (l == NULL) {
        /* Late (forgotten after it drained): never runs anything here again,
         * drained by construction; the answer is the same report. */
        w->stats.late_answers++;
        report(n, &(struct msg){.type = R_DRAINED, .key = m->key, .token = m->token});
        return;
    }
    /* MUT_NO_REREPORT: a repeated notice of a drained room goes unanswered
     * (the core's Drained for it is dropped on the way out). */
    l->rereport_muted = l->cr.drained_sent;
    kvf_ncore_room_abort(n->core, &l->cr, m->token, 0);
    node_apply(w, node);
    l->rereport_muted = false;
}

void node_handle(struct world *w, int node, const struct msg *m)
{
    struct snode *n = &w->nodes[node];
    switch (m->type) {
    case M_ROOM_UPDATE:
        node_room_update(w, node, m);
        break;
    case M_ABORT:
        node_abort_notice(w, node, m);
        break;
    case M_FENCE: {
        int peer = m->peer;
        if (peer < 0)
            break;
        uint32_t slot;
        if (node_peer_slot(w, node, peer, m->peer_inc, &slot) != 0)
            break;
        n->fenced_inc[peer] = m->peer_inc;
        /* Our queue pairs to the peer go to the error state: every op posted
         * towards it flushes; quarantined ones are retired by the fence. */
        for (int i = 0; i < MAX_OPS; i++) {
            struct sop *o = &w->ops[i];
            if (o->used && o->node == node && o->peer == peer && peer != node && !o->quarantined &&
                (o->unaccounted || o->op.peer == slot))
                op_retire(w, o, KVF_LT_DONE_FLUSHED);
        }
        kvf_ncore_peer_fenced(n->core, slot);
        kvf_lt_table_peer_fenced(n->tab, slot);
        for (int i = 0; i < MAX_OPS; i++) {
            struct sop *o = &w->ops[i];
            if (o->used && o->node == node && o->peer == peer && peer != node && o->quarantined &&
                o->op.peer == slot)
                op_free(o);
        }
        /* Nothing the fenced incarnation does can reach our memory any more. */
        for (int i = 0; i < MAX_OPS; i++) {
            struct sop *o = &w->ops[i];
            if (o->used && o->node == peer && w->nodes[peer].inc == m->peer_inc)
                o->neutral[node] = true;
        }
        node_take_drains(w, node);
        w->stats.fences++;
        report(n, &(struct msg){.type = R_FENCED, .peer = peer, .peer_inc = m->peer_inc});
        break;
    }
    default:
        fail(w, "a report was delivered to a node");
    }
}

/* ---- nodes come and go ---------------------------------------------------- */

static int node_attach_inc(struct world *w, int node, uint64_t inc, uint64_t witnessed_gone)
{
    struct snode *n = &w->nodes[node];
    struct kvf_cps_pool pool = {
        .pool_id = 1, .page_size = 4096, .page_count = POOL_PAGES, .key = n->name};
    struct kvf_cps_node_hello h = {
        .node_id = n->name,
        .incarnation = inc,
        .protocol_min = KVF_PROTOCOL_MIN,
        .protocol_max = KVF_PROTOCOL_MAX,
        .features = n->old ? KVF_FEATURE_TCP
                           : (KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_FENCE_V1 | KVF_FEATURE_TCP |
                              KVF_FEATURE_RDMA),
        .pools = &pool,
        .pool_count = 1,
        .witnessed_gone = witnessed_gone,
    };
    uint32_t version;
    int rc = kvf_cps_node_attach(w->cps, &h, w->now, &version, NULL);
    if (rc == 0 && inc == n->inc) {
        n->connected = true;
        n->down = n->racing = false;
    }
    route_effects(w);
    return rc;
}

static int node_attach(struct world *w, int node, uint64_t witnessed_gone)
{
    return node_attach_inc(w, node, w->nodes[node].inc, witnessed_gone);
}

/* The newest incarnation this node id had (a phantom one included). */
static uint64_t node_top_inc(const struct snode *n)
{
    return n->phantom_inc > n->inc ? n->phantom_inc : n->inc;
}

/* Nothing a peer posted can land in `node`'s memory any more: its connections
 * are closed and its memory registrations are gone (death) or its queue pairs
 * are in error (self-fence). */
static void neutralise_inbound(struct world *w, int node)
{
    for (int i = 0; i < MAX_OPS; i++) {
        if (w->ops[i].used && w->ops[i].node != node)
            w->ops[i].neutral[node] = true;
    }
}

void node_kill(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (!n->alive)
        return;
    neutralise_inbound(w, node);
    if (n->connected)
        kvf_cps_node_detach(w->cps, n->name, n->inc, w->now, NULL);
    for (int i = 0; i < MAX_OPS; i++) {
        if (w->ops[i].used && w->ops[i].node == node)
            op_free(&w->ops[i]); /* the process died: its queue pairs went with it */
    }
    for (int i = 0; i < MAX_CHUNKS; i++) {
        if (w->chunks[i].used && w->chunks[i].node == node)
            chunk_unqueue(w, &w->chunks[i]);
    }
    kvf_ncore_destroy(n->core); /* and its lifetime table */
    n->core = NULL;
    n->tab = NULL;
    memset(n->slot_node, 0, sizeof(n->slot_node));
    memset(n->lives, 0, sizeof(n->lives));
    n->inbox.len = n->outbox.len = 0;
    n->nrx = 0; /* its socket buffers died with it */
    n->alive = n->connected = n->paused = n->down = n->racing = false;
    n->pending_witness = 0; /* the next process witnesses every older one */
    route_effects(w);
}

void node_start(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    struct kvf_ncore_opts co;
    kvf_ncore_opts_init(&co);
    co.retain_max = RETAIN;
    co.max_peers = MAX_SLOTS;
    n->core = kvf_ncore_create(&co);
    if (n->core == NULL) {
        fail(w, "kvf_ncore_create failed");
        return;
    }
    n->tab = kvf_ncore_lts(n->core);
    memset(n->slot_node, 0, sizeof(n->slot_node));
    memset(n->conn_tx, 0, sizeof(n->conn_tx));
    memset(n->conn_rx, 0, sizeof(n->conn_rx));
    memset(n->conn_tx_inc, 0, sizeof(n->conn_tx_inc));
    memset(n->conn_rx_inc, 0, sizeof(n->conn_rx_inc));
    memset(n->conn_broken, 0, sizeof(n->conn_broken));
    n->inc = node_top_inc(n) + 1;
    n->alive = true;
    memset(n->fenced_inc, 0, sizeof(n->fenced_inc));
    /* It took the host lock its dead predecessor held: it witnesses it. */
    if (node_attach(w, node, n->inc - 1) != 0)
        fail(w, "%s could not attach with a new incarnation", n->name);
}

/* After a re-attach with the same incarnation the node says its whole state
 * (node.proto Resync): its lifetimes, the peers it fenced, its pool. What it
 * says is true at this moment; the core must stay safe with it. */
static void node_resync(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    static struct kvf_cps_resync_lifetime lts[MAX_LIVES];
    struct kvf_cps_resync_peer peers[NODES];
    size_t nl = 0, np = 0;
    for (int i = 0; i < MAX_LIVES; i++) {
        const struct nlife *l = &n->lives[i];
        if (!l->used || l->inc != n->inc)
            continue; /* an older incarnation's lifetimes are not this one's to report */
        lts[nl].key = l->key;
        lts[nl].state = (enum kvf_cps_lifetime_state)kvf_lt_state(l->cr.lt);
        lts[nl].token = l->cr.token;
        lts[nl].ops_in_flight = kvf_lt_inflight(l->cr.lt);
        nl++;
    }
    for (int i = 0; i < NODES; i++) {
        if (n->fenced_inc[i] != 0) {
            peers[np].node_id = w->nodes[i].name;
            peers[np].incarnation = n->fenced_inc[i];
            np++;
        }
    }
    struct kvf_cps_pool pool = {
        .pool_id = 1, .page_size = 4096, .page_count = POOL_PAGES, .key = n->name};
    struct kvf_cps_resync rs = {.lifetimes = lts,
                                .lifetime_count = nl,
                                .fenced = peers,
                                .fenced_count = np,
                                .pools = &pool,
                                .pool_count = 1};
    int rc = kvf_cps_node_resync(w->cps, n->name, n->inc, &rs, w->now, NULL, NULL);
    if (rc != 0)
        fail(w, "%s: resync refused: %d", n->name, rc);
    route_effects(w);
}

void act_reconnect(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (!n->alive || n->connected || n->paused)
        return;
    if (n->racing) {
        /* Resumed past its margin: its self-fence is due before any session. */
        node_self_fence(w, node);
        return;
    }
    int rc = node_attach(w, node, 0);
    if (rc == 0)
        node_resync(w, node);
    else
        node_self_fence(w, node); /* refused (LOST, or a newer incarnation exists) */
}

/* ---- pause, self-fence, witness --------------------------------------------- */

/* How long a node's session may be down before it fences itself: node_ttl
 * minus a margin, by its own clock (docs/state-cores.md, "Self-fencing"). */
kvf_time_ns self_fence_after(const struct world *w)
{
    return w->co.node_ttl - w->co.node_ttl / 4;
}

void node_down(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (n->connected) {
        kvf_cps_node_detach(w->cps, n->name, n->inc, w->now, NULL);
        n->connected = false;
        n->inbox.len = 0; /* what was on the wire is gone */
        route_effects(w);
    }
    if (!n->down) {
        n->down = true;
        n->down_since = w->now;
    }
}

void node_pause(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (!n->alive || n->paused)
        return;
    n->paused = true;
    w->stats.pauses++;
    node_down(w, node); /* it sends no heartbeat: the control plane drops the session */
}

void node_resume(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (!n->alive || !n->paused)
        return;
    n->paused = false;
    /* Its timers are overdue, but any thread may run first: the receiver may
     * take what waits in its sockets before the self-fence runs. */
    n->racing = n->down && w->now - n->down_since >= self_fence_after(w);
}

/* Retires (flushes) every op `node` posted towards `peer`: its queue pairs to
 * the peer are in the error state or its connection to the peer is closed.
 * Receives in progress are joined by the caller, or keep running. */
static void flush_ops_towards(struct world *w, int node, int peer, bool receives_too)
{
    struct snode *n = &w->nodes[node];
    if (peer == node)
        return; /* local copies are not stopped by closing connections */
    for (int i = 0; i < MAX_OPS; i++) {
        struct sop *o = &w->ops[i];
        if (o->used && o->node == node && o->peer == peer && peer != node && !o->quarantined &&
            (receives_too || !o->recv))
            op_retire(w, o, KVF_LT_DONE_FLUSHED);
    }
    for (uint32_t slot = 0; slot < MAX_SLOTS; slot++) {
        if (n->slot_node[slot] == peer + 1)
            kvf_lt_table_peer_fenced(n->tab, slot);
    }
    for (int i = 0; i < MAX_OPS; i++) {
        struct sop *o = &w->ops[i];
        if (o->used && o->node == node && o->peer == peer && peer != node && o->quarantined)
            op_free(o);
    }
}

/* A node whose session was down for its margin (or that was refused as LOST)
 * fences itself: admission shut on every lifetime, queued chunks dropped, its
 * peer connections closed (socket buffers dropped, posted transfers flushed;
 * receives and local copies in progress keep running), then it comes back as
 * a new incarnation that keeps the old lifetimes and witnesses the old
 * incarnation once they all drained (node_maybe_witness). */
void node_self_fence(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (!n->alive || n->paused)
        return;
    if (n->connected)
        kvf_cps_node_detach(w->cps, n->name, n->inc, w->now, NULL);
    n->connected = false;
    kvf_lt_table_close_all(n->tab);
    for (int i = 0; i < MAX_CHUNKS; i++) {
        if (w->chunks[i].used && w->chunks[i].node == node)
            chunk_unqueue(w, &w->chunks[i]); /* its staging queue is dropped */
    }
    neutralise_inbound(w, node);
    n->nrx = 0;
    n->inbox.len = n->outbox.len = 0; /* the old session's queues are gone */
    for (int peer = 0; peer < NODES; peer++)
        flush_ops_towards(w, node, peer, false);
    node_take_drains(w, node);
    /* The new incarnation starts with no peers: every room drops its slot
     * references, and every slot is free again. */
    for (int i = 0; i < MAX_LIVES; i++) {
        if (n->lives[i].used)
            peer_refs_drop(n, &n->lives[i]);
    }
    kvf_ncore_peers_reset(n->core);
    memset(n->slot_node, 0, sizeof(n->slot_node));
    uint64_t old = node_top_inc(n); /* a phantom incarnation ran nothing here */
    n->inc = old + 1;
    n->pending_witness = old;
    memset(n->fenced_inc, 0, sizeof(n->fenced_inc));
    memset(n->conn_tx, 0, sizeof(n->conn_tx));
    memset(n->conn_rx, 0, sizeof(n->conn_rx));
    memset(n->conn_tx_inc, 0, sizeof(n->conn_tx_inc));
    memset(n->conn_rx_inc, 0, sizeof(n->conn_rx_inc));
    memset(n->conn_broken, 0, sizeof(n->conn_broken));
    w->stats.self_fences++;
    if (node_attach(w, node, 0) != 0)
        fail(w, "%s could not attach as a new incarnation after its self-fence", n->name);
    if (w->mutation == MUT_WITNESS_EARLY && !w->failed) {
        kvf_cps_node_witness(w->cps, n->name, n->inc, old, w->now, NULL);
        n->pending_witness = 0;
        route_effects(w);
    }
}

/* A self-fenced node sends Witness for its old incarnation once every
 * lifetime of it is drained (admission shut for good, nothing in flight). */
void node_maybe_witness(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    if (n->pending_witness == 0 || !n->alive || n->paused || !n->connected)
        return;
    for (int i = 0; i < MAX_LIVES; i++) {
        const struct nlife *l = &n->lives[i];
        if (l->used && l->inc <= n->pending_witness && kvf_lt_state(l->cr.lt) != KVF_LT_DRAINED)
            return;
    }
    int rc = kvf_cps_node_witness(w->cps, n->name, n->inc, n->pending_witness, w->now, NULL);
    if (rc != 0)
        fail(w, "%s: its witness of incarnation %llu was refused: %d", n->name,
             (unsigned long long)n->pending_witness, rc);
    n->pending_witness = 0;
    route_effects(w);
}

/* MUT_PAUSED_WITNESSED: a supervisor takes the paused process for dead and
 * starts a new one, which "witnesses" the old incarnation without holding the
 * host lock (a pid probe, say). The new process never runs here: the core
 * knows its incarnation; the old, paused process is what resumes. */
void phantom_start(struct world *w, int node)
{
    struct snode *n = &w->nodes[node];
    uint64_t inc = node_top_inc(n) + 1;
    n->phantom_inc = inc;
    node_attach_inc(w, node, inc, inc - 1);
}

/* ---- node -> node frames ---------------------------------------------------- */

/* The sink's receiver takes a frame off its socket (with `any`, not the first:
 * reordering), checks its sequence and its lifetime's admission, and lands it
 * as an op in the sink's pages. */
void node_recv(struct world *w, int node, bool any, uint32_t pick)
{
    struct snode *n = &w->nodes[node];
    if (n->nrx == 0 || !n->alive || n->paused)
        return;
    int idx = any ? (int)(pick % (uint32_t)n->nrx) : 0;
    struct frame f = n->rx[idx];
    memmove(&n->rx[idx], &n->rx[idx + 1], (size_t)(n->nrx - idx - 1) * sizeof(n->rx[0]));
    n->nrx--;
    struct sroom *r = &w->rooms[f.room];
    if (w->mutation != MUT_NO_SEQ) {
        /* The transport's check (tcp.c): one stream per sending process,
         * frames numbered from 1; a frame out of sequence closes the stream
         * and what waits behind it on that socket is lost with it. */
        if (f.from_inc < n->conn_rx_inc[f.from]) {
            w->stats.frames_dropped++; /* a stream of a process that is gone */
            return;
        }
        if (f.from_inc > n->conn_rx_inc[f.from]) {
            n->conn_rx_inc[f.from] = f.from_inc; /* a new stream */
            n->conn_rx[f.from] = 0;
            n->conn_broken[f.from] = false;
        }
        if (n->conn_broken[f.from] || f.conn_seq != n->conn_rx[f.from] + 1) {
            w->stats.frames_dropped++;
            n->conn_broken[f.from] = true;
            int k = 0;
            for (int i = 0; i < n->nrx; i++) {
                if (n->rx[i].from == f.from && n->rx[i].from_inc == f.from_inc)
                    w->stats.frames_dropped++;
                else
                    n->rx[k++] = n->rx[i];
            }
            n->nrx = k;
            return;
        }
        n->conn_rx[f.from]++;
    }
    struct nlife *l = life_find(n, r->key);
    if (l == NULL) {
        w->stats.frames_dropped++; /* no room here: an unknown or late room */
        return;
    }
    struct sop *o;
    if (w->mutation == MUT_RECV_NOT_OP) {
        o = kvf_lt_is_open(l->cr.lt) ? op_alloc(w) : NULL;
        if (o != NULL)
            *o = (struct sop){.used = true,
                              .unaccounted = true,
                              .kind = KVF_LT_OP_TCP_FRAME,
                              .node = node,
                              .peer = f.from,
                              .peer_inc = w->nodes[f.from].inc,
                              .room = f.room,
                              .src_part = -1,
                              .sink_part = f.sink};
    } else {
        o = admit_op(w, node, f.room, -1, f.sink, KVF_LT_OP_TCP_FRAME, f.from, f.from_inc);
    }
    if (o == NULL) {
        w->stats.frames_dropped++; /* refused: the lifetime is shut */
        return;
    }
    o->recv = true;
    uint64_t *last = &w->seq_landed[f.room][f.from][node];
    /* A frame the receiver refused (no room yet, admission shut) is lost: the
     * sink's completion rule sees the bytes missing. What lands is in order,
     * each frame once. */
    if (f.seq <= *last)
        fail(w,
             "I8: frame %llu from %s lands in room %llu:%llu on %s after frame %llu (out of "
             "order or twice)",
             (unsigned long long)f.seq, w->nodes[f.from].name, (unsigned long long)r->key.room_id,
             (unsigned long long)r->key.generation, n->name, (unsigned long long)*last);
    if (f.seq > *last)
        *last = f.seq;
}

/* ---- control-plane crash ---------------------------------------------------- */

static int image_write(void *ctx, const void *buf, size_t len)
{
    struct image *im = ctx;
    if (im->len + len > im->cap) {
        size_t cap = im->cap ? im->cap : 65536;
        while (cap < im->len + len)
            cap *= 2;
        unsigned char *b = realloc(im->buf, cap);
        if (b == NULL)
            return -ENOMEM;
        im->buf = b;
        im->cap = cap;
    }
    memcpy(im->buf + im->len, buf, len);
    im->len += len;
    return 0;
}

int image_take(struct world *w, struct image *im)
{
    im->len = 0;
    return kvf_cps_snapshot(w->cps, w->now, image_write, im);
}

/* The control plane dies and comes back with what its log holds: every call
 * whose effects left it (replies are held until the log record is durable).
 * The core is rebuilt from its own image, as snapshot plus log replay would
 * rebuild it; every node session is gone and every ATTACHED node is detached
 * (the service does so right after recovery). */
void cp_crash(struct world *w, uint32_t back_at_once)
{
    struct image *im = &w->img;
    if (w->mutation == MUT_ACK_EARLY && w->img_older.len > 0)
        im = &w->img_older; /* the last step's effects left before it was logged */
    else if (image_take(w, im) != 0) {
        fail(w, "kvf_cps_snapshot failed");
        return;
    }
    struct kvf_error err;
    kvf_error_clear(&err);
    struct kvf_cps *st = kvf_cps_restore(&w->co, im->buf, im->len, w->now, &err);
    if (st == NULL) {
        fail(w, "the control plane could not recover its state: %s", err.msg);
        return;
    }
    kvf_cps_destroy(w->cps);
    w->cps = st;
    w->stats.cp_crashes++;
    for (int i = 0; i < NODES; i++) {
        struct snode *n = &w->nodes[i];
        kvf_cps_node_detach(w->cps, n->name, n->inc, w->now, NULL);
        if (n->phantom_inc > n->inc)
            kvf_cps_node_detach(w->cps, n->name, n->phantom_inc, w->now, NULL);
        if (n->alive && n->connected) {
            n->connected = false;
            n->inbox.len = 0;
            if (!n->down) {
                n->down = true;
                n->down_since = w->now;
            }
        }
    }
    route_effects(w);
    /* Most nodes are back within their retry backoff; the others later. */
    for (int i = 0; i < NODES && !w->failed; i++) {
        if ((back_at_once >> i) % 4 != 0)
            act_reconnect(w, i);
    }
}
