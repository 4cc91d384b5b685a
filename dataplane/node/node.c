/*
 * node.c: the owner thread of kvfence-node: the lifetime table, the room map,
 * the registered pools, the TCP transport's control side and the self-fence.
 * The control-plane protocol (receiving, the session's own messages, every
 * report sent) is control_session.c's: node.c hands it a table of what the
 * owner does (struct node_session_ops) and calls its senders.
 *
 * SCOPE OF THIS VERSION (the first vertical slice):
 * - transfers over TCP, or the local transport for a sink on this node, with
 *   optional host or CUDA staging (xport.c), or RDMA writes towards a peer
 *   whose RDMA link is up (rdma_link.c; not with staging);
 * - host shared-memory pools (dataplane/pool, kvf_pool_open_shm);
 * - NodeLocal: RegisterPool, UnregisterPool (pool_admin.c), SubmitChunk and
 *   Watch (watch.c);
 * - the peer channel (peer_link.c) carries AuxData and TransferStatus from a
 *   source to its sink node, ChunkNotice for RDMA chunks and the RDMA link
 *   messages (rdma_link.c; no staging messages);
 * - lifetimes are never forgotten while the process runs (one small record per
 *   room), so that every late message for a room stays recognisable;
 * - Resync and the decision to self-fence after node_ttl without a session:
 *   control_session.c; the self-fence itself: node_self_fence here.
 *
 * Completion rules (documented decisions):
 * - a source participant is Completed once every (source, sink) pair it
 *   opened had its last chunk (last_chunk=true, per sink rank) admitted, every
 *   frame of every chunk it submitted completed OK (the bytes are in the
 *   socket; the sink side attests that they landed), and each pair's AuxData
 *   and TransferStatus were handed to the peer channel. An engine feeding
 *   several sinks opens every pair before the last chunk of any completes;
 * - a sink participant is Completed when whole-page frames that landed have
 *   covered every page of its lease (one page bitmap per sink lease, fed by
 *   the TCP receivers' frame events, the local copies' completions and the
 *   RDMA sources' checked ChunkNotice messages (rdma_link.c): a page
 *   written twice counts once; a frame shorter than its pages covers none)
 *   AND the ok TransferStatus messages of its sources account for every
 *   landed byte (sum of their `bytes` == bytes landed): every source that
 *   wrote into it finished, and its aux bytes (sent before its status, in
 *   order on the channel) reached Watch before the room can complete. A
 *   source that transfers fewer pages than the sink leased, or whose status
 *   is lost, leaves the sink incomplete (the room then ends by abort or join
 *   timeout, never by a clock release);
 * - once every local participant of a room has completed, the node closes
 *   the room's admission: nothing may start for it afterwards.
 *
 * DESIGN (threads): see node_types.h. The owner loop sleeps in poll(2)
 * on wake descriptors: the job queue's eventfd (written by a post to an empty
 * queue) and each transport's (written when a completion lands on its empty
 * list), until the next deadline the node knows (heartbeat, self-fence, stop,
 * or a short one while a part without a descriptor has work in flight: see
 * owner_timeout); there is no fixed tick. Each turn it runs every job it
 * finds, polls the transports' completions (never blocking), sends a
 * heartbeat when one is due, and during a stop watches the lifetimes drain. Everything the node
 * sends to the control plane is sent from this thread, so reports for one room leave in the order
 * the node decided them.
 */
#include "host_lock.h"
#include "local_svc.h"
#include "node_health.h"
#include "node_log.h"
#include "node_metrics.h"
#include "node_owner.h"
#include "node_types.h"
#include "peer_link.h"
#include "pool_admin.h"
#include "submit_stream.h"
#include "watch.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "control_session.h"
#include "devpool.h"
#include "faults.h"
#include "kvf_error.h"
#include "kvf_version.h"
#include "rdma_link.h"
#include "tcp.h"
#include "xport.h"

/* The fault file is re-read, and faults held by time released, at this
 * pace while --fault-file is set (tests only). */
#define OWNER_FAULT_TICK_MS 5

/* The owner's actions: the other modules reach them through node_owner.h
 * (struct node_owner_ops, owner_ops below); node.c calls them directly. */
static void owner_part_completed(struct kvf_node *n, struct node_room *r, struct node_member *m);
static void owner_core_apply(struct kvf_node *n);
static void owner_check_drained(struct kvf_node *n, struct node_room *r);
static void owner_check_sink_complete(struct kvf_node *n, struct node_room *r,
                                      struct node_member *m);
static void owner_check_sinks(struct kvf_node *n, struct node_room *r);
static void owner_sink_landed(struct kvf_node *n, struct node_room *r, uint32_t rank,
                              uint32_t first_page, uint32_t page_count, uint64_t bytes);
static int owner_ensure_peer(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                             uint32_t *idx_p);
static void owner_fail_unknown_room(struct kvf_node *n, kvf_room_key key, const char *why);
static void node_core_collect(struct kvf_node *n);
static void node_peers_reset(struct kvf_node *n);
static void node_poll_completions(struct kvf_node *n);
static struct kvf_transport *node_tcp_create(struct kvf_node *n, uint64_t incarnation,
                                             uint16_t port);

static const struct node_owner_ops owner_ops = {
    .part_completed = owner_part_completed,
    .core_apply = owner_core_apply,
    .check_drained = owner_check_drained,
    .check_sink_complete = owner_check_sink_complete,
    .check_sinks = owner_check_sinks,
    .sink_landed = owner_sink_landed,
    .ensure_peer = owner_ensure_peer,
    .fail_unknown_room = owner_fail_unknown_room,
    .frame_end = node_local_frame_end, /* local_svc.c */
    .completion = node_local_completion,
};

/* ---- completions and the rules core's effects -------------------------------- */

static void owner_part_completed(struct kvf_node *n, struct node_room *r, struct node_member *mb)
{
    if (mb->completed)
        return;
    if (kvf_ncore_part_completed(n->core, &r->core, mb->rank,
                                 mb->role == KVFENCE__V1__ROLE__ROLE_SINK) != 0)
        return; /* aborting: nothing completes */
    mb->completed = true;
    owner_core_apply(n);
}

/* The local participant of `r` the core named in a SEND_COMPLETED effect. */
static struct node_member *local_part(struct node_room *r, uint32_t rank, bool sink)
{
    int role = sink ? KVFENCE__V1__ROLE__ROLE_SINK : KVFENCE__V1__ROLE__ROLE_SOURCE;
    for (size_t i = 0; i < r->nmembers; i++)
        if (r->members[i].local && r->members[i].rank == rank && r->members[i].role == role)
            return &r->members[i];
    return NULL;
}

static void room_free(struct kvf_node *n, struct node_room *r);
static void peer_refs_drop(struct kvf_node *n, struct node_room *r);
static void node_peer_recycle(struct kvf_node *n, uint32_t idx, bool fence);

/* The core's ROOM_DRAINED effect, once per room: the peer channel says LATE
 * for it and forgets its sequence state (later messages are LATE), and the
 * watchers see DRAINED. */
static void room_drained(struct kvf_node *n, struct node_room *r)
{
    node_peer_close_room(n, r);
    if (n->peerch)
        (void)kvf_peer_forget_room(n->peerch, r->key);
    node_watch_room_state(n, r);
}

/* What each effect of the rules core means for the daemon (node_core.h). */
static void owner_core_apply(struct kvf_node *n)
{
    struct kvf_ncore_fx fx;
    while (kvf_ncore_fx_take(n->core, &fx)) {
        struct node_room *r = fx.user;
        switch (fx.kind) {
        case KVF_NCORE_FX_ROOM_DRAINED:
            /* Admission is shut for good and nothing is in flight: the room
             * sends to no peer again, so it holds no peer slot. */
            peer_refs_drop(n, r);
            room_drained(n, r);
            if (r->incarnation != n->incarnation)
                node_session_maybe_witness(n);
            break;
        case KVF_NCORE_FX_SEND_DRAINED:
            node_session_send_drained(n, r);
            break;
        case KVF_NCORE_FX_SEND_COMPLETED: {
            struct node_member *m = local_part(r, fx.rank, fx.sink);
            if (m)
                node_session_send_completed(n, r, m);
            break;
        }
        case KVF_NCORE_FX_CLOSE_PEERS:
            node_peer_close_room(n, r);
            break;
        case KVF_NCORE_FX_ROOM_ABORTING:
            r->state = KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING;
            node_watch_room_state(n, r);
            break;
        case KVF_NCORE_FX_ROOM_FREE:
            room_free(n, r);
            break;
        case KVF_NCORE_FX_PEER_RECYCLE:
            node_peer_recycle(n, fx.peer, fx.fence);
            break;
        case KVF_NCORE_FX_SEND_FAILED: {
            struct node_member *m = local_part(r, fx.rank, fx.sink);
            if (m)
                m->failed = true;
            node_session_send_transfer_failed(
                n, r, fx.rank,
                fx.sink ? KVFENCE__V1__ROLE__ROLE_SINK : KVFENCE__V1__ROLE__ROLE_SOURCE, fx.reason);
            break;
        }
        }
    }
}

static void node_core_collect(struct kvf_node *n)
{
    if (kvf_ncore_collect(n->core) > 0)
        owner_core_apply(n);
}

/* ---- rooms ------------------------------------------------------------------- */

/* Grows the index, if needed, so that one more room keeps it at about one
 * room per bucket; -ENOMEM leaves it as it was. Owner thread. */
static int room_index_reserve(struct kvf_node *n)
{
    if (n->room_count + 1 > n->room_index_cap) {
        size_t cap = n->room_index_cap ? n->room_index_cap * 2 : 256;
        struct node_room **idx = calloc(cap, sizeof *idx);
        if (!idx)
            return -ENOMEM;
        pthread_rwlock_wrlock(&n->rooms_lock);
        for (struct node_room *o = n->rooms; o; o = o->next) {
            size_t b = node_room_bucket(o->key, cap);
            o->hnext = idx[b];
            idx[b] = o;
        }
        free(n->room_index);
        n->room_index = idx;
        n->room_index_cap = cap;
        pthread_rwlock_unlock(&n->rooms_lock);
    }
    return 0;
}

/* Opens the lifetime of `key` and publishes an empty room. NULL (logged) when
 * the table refuses (late generation, out of memory). */
static struct node_room *room_open(struct kvf_node *n, kvf_room_key key)
{
    if (node_fault_refuse_room_open(n)) {
        node_log("warn", &key, "cannot open lifetime: refused by the fault file");
        return NULL;
    }
    struct node_room *r = calloc(1, sizeof *r);
    if (!r || room_index_reserve(n) != 0) {
        node_log("error", &key, "out of memory for the room");
        free(r);
        return NULL;
    }
    int rc = kvf_ncore_room_open(n->core, &r->core, key, r);
    if (rc != 0) {
        node_log("warn", &key, "cannot open lifetime: %s", kvf_ncore_reason(n->core));
        free(r);
        return NULL;
    }
    r->key = key;
    r->incarnation = n->incarnation;
    pthread_rwlock_wrlock(&n->rooms_lock);
    size_t b = node_room_bucket(key, n->room_index_cap);
    r->hnext = n->room_index[b];
    n->room_index[b] = r;
    n->room_count++;
    r->next = n->rooms;
    n->rooms = r;
    pthread_rwlock_unlock(&n->rooms_lock);
    return r;
}

static void members_free(struct node_member *m, size_t count)
{
    for (size_t i = 0; m && i < count; i++) {
        free(m[i].ranges);
        free(m[i].landed_map);
    }
    free(m);
}

static void peer_refs_drop(struct kvf_node *n, struct node_room *r)
{
    for (size_t i = 0; i < r->npeer_refs; i++)
        kvf_ncore_peer_unref(n->core, r->peer_refs[i]);
    free(r->peer_refs);
    r->peer_refs = NULL;
    r->npeer_refs = 0;
}

/* The core forgot `r` (terminal, beyond the retention count): unlinked
 * under rooms_lock (write), so no receiver holds it, then freed with
 * everything it owns. Its lifetime is gone (the table remembers it as
 * late). */
static void room_free(struct kvf_node *n, struct node_room *r)
{
    pthread_rwlock_wrlock(&n->rooms_lock);
    struct node_room **pp = &n->room_index[node_room_bucket(r->key, n->room_index_cap)];
    while (*pp && *pp != r)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = r->hnext;
    for (pp = &n->rooms; *pp && *pp != r; pp = &(*pp)->next)
        ;
    if (*pp)
        *pp = r->next;
    n->room_count--;
    pthread_rwlock_unlock(&n->rooms_lock);
    node_log("info", &r->key, "room freed (ended, drained, beyond the %" PRIu64 " retained)",
             n->opts.retain_rooms);
    node_peer_close_room(n, r); /* frees statuses still held, if any */
    members_free(r->members, r->nmembers);
    free(r->intro);
    node_pairs_free(r);
    peer_refs_drop(n, r);
    free(r);
}

static void owner_check_drained(struct kvf_node *n, struct node_room *r)
{
    kvf_ncore_room_check(n->core, &r->core);
    owner_core_apply(n);
}

/* A local sink whose every lease page was covered, and whose landed bytes
 * are all named by ok TransferStatus messages, is complete (see the top of
 * this file). */
static void owner_check_sink_complete(struct kvf_node *n, struct node_room *r,
                                      struct node_member *m)
{
    if (!m->local || m->role != KVFENCE__V1__ROLE__ROLE_SINK || m->completed || r->core.aborting)
        return;
    if (m->rx_closed)
        return; /* decided already */
    /* Sink completion is a drain proof: no op of the room that may write
     * into these pages may be in flight (a TCP receive, a same-node copy),
     * and none may start after the decision. Receives are admitted under
     * rooms_lock (read), same-node copies on this thread, so under the write
     * lock the count cannot grow, and rx_closed makes the check refuse later
     * frames for this sink. The count is the room's (its TCP sends and
     * staging copies too): conservative, and every completion re-checks
     * (node_completion, on_frame). */
    struct kvf_ncore_sink s = {
        .pages = m->pages,
        .pages_landed = m->pages_landed,
        .bytes_landed = m->bytes_landed,
        .status_bytes = m->status_bytes,
    };
    /* Called for every landed frame: the lock is taken only once the pages
     * and the statuses say yes (they change on this thread only). */
    if (!kvf_ncore_sink_ready(&s))
        return;
    pthread_rwlock_wrlock(&n->rooms_lock);
    s.rx_inflight = (uint32_t)(kvf_lt_inflight_kind(r->core.lt, KVF_LT_OP_TCP_FRAME) +
                               kvf_lt_inflight_kind(r->core.lt, KVF_LT_OP_CUDA_COPY));
    bool ready = kvf_ncore_sink_ready(&s);
    if (ready)
        m->rx_closed = true;
    pthread_rwlock_unlock(&n->rooms_lock);
    if (ready) {
        node_peer_sink_done(n, r, m);
        owner_part_completed(n, r, m);
    }
}

static void owner_check_sinks(struct kvf_node *n, struct node_room *r)
{
    for (size_t i = 0; i < r->nmembers; i++)
        owner_check_sink_complete(n, r, &r->members[i]);
}

/* The span [first, end) of `m`'s ranges. */
static void lease_span(const struct node_member *m, uint32_t *first_p, uint32_t *pages_p)
{
    uint64_t lo = UINT64_MAX, hi = 0;
    for (size_t i = 0; i < m->nranges; i++) {
        if (m->ranges[i].count == 0)
            continue;
        lo = m->ranges[i].first < lo ? m->ranges[i].first : lo;
        uint64_t end = (uint64_t)m->ranges[i].first + m->ranges[i].count;
        hi = end > hi ? end : hi;
    }
    *first_p = lo == UINT64_MAX ? 0 : (uint32_t)lo;
    *pages_p = lo == UINT64_MAX ? 0 : (uint32_t)(hi - lo);
}

static bool map_test(const uint64_t *map, uint32_t bit)
{
    return (map[bit / 64] >> (bit % 64)) & 1u;
}

/* Sets m's bit for each page of [first, first + count) in its span; counts
 * the new ones. -ENOMEM if the map cannot be allocated. */
static int mark_landed(struct node_member *m, uint32_t first, uint32_t count)
{
    if (!m->landed_map) {
        lease_span(m, &m->map_first, &m->map_pages);
        m->landed_map = calloc((m->map_pages + 63u) / 64u + 1u, sizeof *m->landed_map);
        if (!m->landed_map)
            return -ENOMEM;
    }
    for (uint64_t pg = first; pg < (uint64_t)first + count; pg++) {
        if (pg < m->map_first || pg >= (uint64_t)m->map_first + m->map_pages)
            continue;
        uint32_t bit = (uint32_t)(pg - m->map_first);
        if (!map_test(m->landed_map, bit)) {
            m->landed_map[bit / 64] |= 1ull << (bit % 64);
            m->pages_landed++;
        }
    }
    return 0;
}

/* A room update replaced `old` by `m` (same participant; the lease may have
 * grown): carry the pages landed over to m's span. */
static void carry_landed(struct node_member *m, struct node_member *old)
{
    if (!old->landed_map)
        return;
    uint32_t first, pages;
    lease_span(m, &first, &pages);
    if (first == old->map_first && pages == old->map_pages) {
        m->landed_map = old->landed_map;
        m->map_first = first;
        m->map_pages = pages;
        m->pages_landed = old->pages_landed;
        old->landed_map = NULL;
        return;
    }
    for (uint32_t b = 0; b < old->map_pages; b++)
        if (map_test(old->landed_map, b) && mark_landed(m, old->map_first + b, 1) != 0)
            return; /* out of memory: those pages are counted again when they land */
}

/* A frame of `bytes` landed in pages [first_page, first_page + page_count)
 * of sink member `m`: whole-page frames mark their pages covered (a shorter
 * frame covers no page for certain); the sink completes once all are. */
static void node_member_landed(struct kvf_node *n, struct node_room *r, struct node_member *m,
                               uint32_t first_page, uint32_t page_count, uint64_t bytes)
{
    m->bytes_landed += bytes;
    const struct node_pool *p = node_pool_find(n, m->pool_id);
    if (p && bytes == (uint64_t)page_count * p->page_size &&
        mark_landed(m, first_page, page_count) != 0)
        node_log("error", &r->key, "out of memory for the sink's page map");
    owner_check_sink_complete(n, r, m);
}

static void owner_sink_landed(struct kvf_node *n, struct node_room *r, uint32_t rank,
                              uint32_t first_page, uint32_t page_count, uint64_t bytes)
{
    struct node_member *m = node_local_sink(r, rank);
    if (m)
        node_member_landed(n, r, m, first_page, page_count, bytes);
}

/* ---- peers ------------------------------------------------------------------- */

static uint64_t tcp_id_of(const char *node_id, uint64_t incarnation)
{
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)node_id; *p; p++) {
        h ^= *p;
        h *= 1099511628211ull;
    }
    h ^= incarnation * 0x9e3779b97f4a7c15ull;
    return h ? h : 1;
}

/* The core gives slot `idx` to a new incarnation: the old one was fenced
 * and no room names it any more; its transport state goes. */
static void node_peer_recycle(struct kvf_node *n, uint32_t idx, bool fence)
{
    struct node_peer *p = &n->peers[idx];
    if (fence && !p->fenced) {
        /* No room talks to it; the transports forget only a fenced peer. */
        int frc = node_xport_fence_peer(n, idx);
        if (frc != 0)
            node_log("warn", NULL, "peer slot %u: fencing %s incarnation %" PRIu64 ": %s", idx,
                     p->node_id, p->incarnation, strerror(-frc));
        if (n->peerch)
            (void)kvf_peer_channel_forget_peer(n->peerch, p->node_id, p->incarnation);
    }
    node_log("info", NULL, "peer slot %u: %s %s incarnation %" PRIu64 " forgotten", idx,
             fence ? "unreferenced" : "fenced", p->node_id, p->incarnation);
    int rc = kvf_transport_tcp_forget_peer(n->tcp, idx);
    if (rc != 0)
        node_log("warn", NULL, "peer slot %u: the transport kept the old peer: %s", idx,
                 strerror(-rc));
    memset(p, 0, sizeof *p);
}

static void node_peers_reset(struct kvf_node *n)
{
    for (struct node_room *r = n->rooms; r; r = r->next)
        peer_refs_drop(n, r);
    kvf_ncore_peers_reset(n->core);
    memset(n->peers, 0, sizeof n->peers);
    n->npeers = 0;
}

static int owner_ensure_peer(struct kvf_node *n, const char *node_id, uint64_t incarnation,
                             uint32_t *idx_p)
{
    uint32_t i;
    bool fresh;
    int rc = kvf_ncore_peer_get(n->core, node_id, incarnation, &i, &fresh);
    owner_core_apply(n); /* a recycled slot's old peer goes first */
    if (rc != 0)
        return rc;
    if (!fresh) {
        *idx_p = i;
        return 0;
    }
    struct node_peer *p = &n->peers[i];
    memset(p, 0, sizeof *p);
    snprintf(p->node_id, sizeof p->node_id, "%s", node_id);
    p->incarnation = incarnation;
    p->tcp_id = tcp_id_of(node_id, incarnation);
    rc = kvf_transport_tcp_add_peer(n->tcp, i, p->tcp_id);
    if (rc != 0) {
        kvf_ncore_peer_fenced(n->core, i); /* unusable: free for the next one */
        return rc;
    }
    if (i >= n->npeers)
        n->npeers = i + 1;
    *idx_p = i;
    return 0;
}

static void peer_set_endpoint(struct node_peer *p, const Kvfence__V1__PeerNode *pn)
{
    for (size_t f = 0; pn->capabilities && f < pn->capabilities->n_features; f++)
        if (strcmp(pn->capabilities->features[f], "RDMA") == 0)
            p->rdma = true;
    for (size_t e = 0; e < pn->n_endpoints; e++) {
        const Kvfence__V1__Endpoint *ep = pn->endpoints[e];
        if (ep->kind != KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_DATA_TCP || !ep->address)
            continue;
        const char *a = ep->address;
        if (strncmp(a, "tcp://", 6) == 0)
            a += 6;
        const char *colon = strrchr(a, ':');
        if (!colon || (size_t)(colon - a) >= sizeof p->host)
            continue;
        memcpy(p->host, a, (size_t)(colon - a));
        p->host[colon - a] = '\0';
        p->port = (uint16_t)strtoul(colon + 1, NULL, 10);
    }
}

/* ---- control messages ----------------------------------------------------------- */

static kvf_room_key key_of(const Kvfence__V1__RoomKey *k)
{
    kvf_room_key key = {0, 0};
    if (k) {
        key.room_id = k->room_id;
        key.generation = k->generation;
    }
    return key;
}

/* Whether the update names member `m` (same node, rank and role). */
static bool member_in_update(const struct node_member *m, const Kvfence__V1__RoomUpdate *ru)
{
    for (size_t i = 0; i < ru->n_members; i++) {
        const Kvfence__V1__Lease *l = ru->members[i]->lease;
        if (l && l->participant && l->participant->rank == m->rank &&
            (int)l->participant->role == m->role &&
            strcmp(l->participant->node_id ? l->participant->node_id : "", m->node_id) == 0)
            return true;
    }
    return false;
}

/* A RoomUpdate this node opened the room for but cannot apply: nothing of it
 * is kept. The control plane does not send a room's update again until it
 * changes, and without a RoomUpdateAck it never publishes this node's
 * members, so the room fails (TransferFailed) unless it is aborting already.
 * Acknowledged: the notice reached us. */
static void room_update_refused(struct kvf_node *n, struct node_room *r, uint64_t notice_id,
                                const char *why)
{
    node_log("error", &r->key, "room update refused: %s", why);
    node_session_send_ack(n, notice_id);
    if (!r->core.aborting)
        node_session_send_room_failed(n, r->key, why);
}

static void on_room_update(struct kvf_node *n, const Kvfence__V1__RoomUpdate *ru)
{
    kvf_room_key key = key_of(ru->room);
    if (node_fault_ack_drop_room_update(n)) { /* a node that breaks the order (tests) */
        node_session_send_ack(n, ru->notice_id);
        node_session_send_room_update_ack(n, key, ru->version);
        return;
    }
    struct node_room *r = node_room_find(n, key);
    if (!r && kvf_lt_table_is_late(n->lts, key)) {
        node_log("info", &key, "late room update ignored");
        node_session_send_ack(n, ru->notice_id);
        return;
    }
    if (!r && (n->stop_requested || !(r = room_open(n, key)))) {
        /* No lifetime, so no RoomUpdateAck: this node's members would never
         * be published and the room would stay ACTIVE. Fail it through the
         * token path instead, like every other refusal: the control plane
         * aborts it, and its AbortNotice finds nothing run here (Drained at
         * once, on_abort_notice). */
        node_session_send_ack(n, ru->notice_id);
        node_session_send_room_failed(n, key,
                                      n->stop_requested
                                          ? "room update refused: the node is stopping"
                                          : "room update refused: cannot open the room's lifetime");
        return;
    }
    /* An update names another node's members only as far as that node
     * acknowledged them (a control plane that restarted asks again): a
     * member known here and missing from the update is kept. */
    size_t cnt = ru->n_members, kept = 0;
    for (size_t o = 0; o < r->nmembers; o++)
        kept += !member_in_update(&r->members[o], ru);
    struct node_member *mv = calloc(cnt + kept ? cnt + kept : 1, sizeof *mv);
    if (!mv) {
        room_update_refused(n, r, ru->notice_id, "out of memory applying the room update");
        return;
    }
    for (size_t i = 0; i < cnt; i++) {
        const Kvfence__V1__RoomMember *rm = ru->members[i];
        struct node_member *m = &mv[i];
        const Kvfence__V1__Lease *l = rm->lease;
        m->incarnation = rm->node_incarnation;
        m->page_size = rm->pool ? rm->pool->page_size : 0;
        if (l) {
            if (l->participant) {
                snprintf(m->node_id, sizeof m->node_id, "%s",
                         l->participant->node_id ? l->participant->node_id : "");
                m->rank = l->participant->rank;
                m->role = (int)l->participant->role;
            }
            m->pool_id = l->pool_id;
            m->ranges = calloc(l->n_ranges ? l->n_ranges : 1, sizeof *m->ranges);
            if (!m->ranges) {
                members_free(mv, cnt);
                room_update_refused(n, r, ru->notice_id, "out of memory applying the room update");
                return;
            }
            m->nranges = l->n_ranges;
            for (size_t k = 0; k < l->n_ranges; k++) {
                m->ranges[k].first = l->ranges[k]->first;
                m->ranges[k].count = l->ranges[k]->count;
                m->pages += l->ranges[k]->count;
            }
        }
        m->local = strcmp(m->node_id, n->node_id) == 0 && m->incarnation == n->incarnation;
        /* Keep the progress of a participant we knew already. */
        for (size_t o = 0; o < r->nmembers; o++) {
            const struct node_member *old = &r->members[o];
            if (old->rank == m->rank && old->role == m->role &&
                strcmp(old->node_id, m->node_id) == 0) {
                m->last_seq = old->last_seq;
                m->chunks_open = old->chunks_open;
                m->last_submitted = old->last_submitted;
                m->failed = old->failed;
                m->bytes_landed = old->bytes_landed;
                carry_landed(m, &r->members[o]);
                m->status_bytes = old->status_bytes;
                m->completed = old->completed;
                m->rx_closed = old->rx_closed;
            }
        }
    }
    for (size_t o = 0; o < r->nmembers; o++) {
        if (member_in_update(&r->members[o], ru))
            continue;
        mv[cnt++] = r->members[o]; /* moved: the old array gives up its buffers */
        r->members[o].ranges = NULL;
        r->members[o].landed_map = NULL;
    }
    /* The room names these peer incarnations now: their slots are not
     * recycled while it lives (the old names are let go below). */
    uint32_t *refs = calloc(ru->n_peers ? ru->n_peers : 1, sizeof *refs);
    size_t nrefs = 0;
    for (size_t i = 0; i < ru->n_peers; i++) {
        const Kvfence__V1__PeerNode *pn = ru->peers[i];
        uint32_t idx;
        if (!pn->node_id || owner_ensure_peer(n, pn->node_id, pn->incarnation, &idx) != 0) {
            node_log("warn", &key, "cannot add peer %s", pn->node_id ? pn->node_id : "?");
            continue;
        }
        peer_set_endpoint(&n->peers[idx], pn);
        node_peer_learn(n, &n->peers[idx], pn);
        if (refs && !r->core.drained_seen) {
            kvf_ncore_peer_ref(n->core, idx);
            refs[nrefs++] = idx;
        }
    }
    peer_refs_drop(n, r);
    r->peer_refs = refs;
    r->npeer_refs = nrefs;
    uint32_t nlocal = 0, ndone = 0;
    for (size_t i = 0; i < cnt; i++) {
        nlocal += mv[i].local;
        ndone += mv[i].local && mv[i].completed;
    }
    kvf_ncore_room_members(n->core, &r->core, nlocal, ndone);
    struct node_intro *intro = calloc(ru->n_peers ? ru->n_peers : 1, sizeof *intro);
    size_t nintro = 0;
    for (size_t i = 0; intro && i < ru->n_peers; i++) {
        if (!ru->peers[i]->node_id)
            continue;
        snprintf(intro[nintro].node_id, sizeof intro[nintro].node_id, "%s", ru->peers[i]->node_id);
        intro[nintro++].incarnation = ru->peers[i]->incarnation;
    }
    bool had_update = r->have_update;
    int old_state = r->state;
    pthread_rwlock_wrlock(&n->rooms_lock);
    struct node_member *old = r->members;
    size_t oldn = r->nmembers;
    struct node_intro *old_intro = r->intro;
    r->members = mv;
    r->nmembers = cnt;
    if (intro) {
        r->intro = intro;
        r->nintro = nintro;
        old_intro = old_intro == intro ? NULL : old_intro;
    } else {
        old_intro = NULL; /* out of memory: keep the earlier introductions */
    }
    r->have_update = true;
    pthread_rwlock_unlock(&n->rooms_lock);
    members_free(old, oldn);
    free(old_intro);
    node_log("info", &key, "room update %" PRIu64 ": %zu members, %zu peers", ru->version, cnt,
             ru->n_peers);
    node_session_send_ack(n, ru->notice_id);
    /* An update that only publishes other nodes' leases: the control plane
     * has nothing of ours to publish on an ack (issue 24). */
    if (!ru->ack_not_needed)
        node_session_send_room_update_ack(n, key, ru->version);
    if (!r->core.aborting)
        r->state = (int)ru->state;
    /* A re-sent update changes nothing: no event for it. */
    if (!r->core.drained_seen && (!had_update || r->state != old_state || cnt != oldn))
        node_watch_room_state(n, r);
    for (size_t i = 0; i < r->nmembers; i++)
        owner_check_sink_complete(n, r, &r->members[i]);
}

static void on_abort_notice(struct kvf_node *n, const Kvfence__V1__AbortNotice *an)
{
    kvf_room_key key = key_of(an->room);
    kvf_token tok = {0, 0};
    if (an->token)
        tok = (kvf_token){an->token->hi, an->token->lo};
    struct node_room *r = node_room_find(n, key);
    if (kvf_token_is_zero(tok)) {
        /* The answer to a Resync for a room that completed or that the
         * control plane forgot: close admission, nothing to prove. */
        node_log("info", &key, "tokenless abort notice (room ended or unknown): admission closed");
        if (r) {
            kvf_ncore_room_end(n->core, &r->core);
            owner_core_apply(n);
        }
        return;
    }
    if (!r && !n->stop_requested && !kvf_lt_table_is_late(n->lts, key))
        r = room_open(n, key); /* abort before metadata */
    if (!r) {
        /* Never ran anything here for it: drained by construction. */
        struct node_room tmp;
        memset(&tmp, 0, sizeof tmp);
        tmp.incarnation = n->incarnation;
        tmp.key = key;
        tmp.core.token = tok;
        tmp.core.notice_id = an->notice_id;
        node_session_send_drained(n, &tmp);
        return;
    }
    if (!r->core.aborting) {
        node_log("info", &key, "abort notice (reason %d): closing admission", (int)an->reason);
        r->abort_reason = (int)an->reason; /* for the ROOM_ABORTING event */
    }
    /* The core closes admission and the peer channel, and reports Drained
     * once proven (again for a repeated notice). */
    kvf_ncore_room_abort(n->core, &r->core, tok, an->notice_id);
    owner_core_apply(n);
}

static void node_poll_completions(struct kvf_node *n)
{
    node_xport_poll(n); /* every transport, and staging */
}

static void on_fence_peer(struct kvf_node *n, const Kvfence__V1__FencePeer *fp)
{
    const char *id = fp->node_id ? fp->node_id : "";
    uint32_t idx;
    int rc = owner_ensure_peer(n, id, fp->incarnation, &idx);
    if (rc == 0 && !n->peers[idx].fenced) {
        rc = node_xport_fence_peer(n, idx); /* every transport (RDMA: QPs to ERR, WRs back) */
        if (rc == 0) {
            n->peers[idx].fenced = true;
            kvf_ncore_peer_fenced(n->core, idx);
            /* Its messages still on the way are dropped from now on. */
            if (n->peerch)
                (void)kvf_peer_channel_forget_peer(n->peerch, id, fp->incarnation);
            size_t drained = kvf_lt_table_peer_fenced(n->lts, idx);
            node_metrics_peers_fenced(n->metrics, 1);
            node_log("info", NULL, "fenced peer %s incarnation %" PRIu64 " (%zu lifetimes drained)",
                     id, fp->incarnation, drained);
        }
    }
    if (rc != 0) {
        node_log("error", NULL, "cannot fence peer %s: %s", id, strerror(-rc));
        return; /* no PeerFenced: the control plane re-sends */
    }
    node_poll_completions(n);
    for (struct node_room *r = n->rooms; r; r = r->next)
        owner_check_drained(n, r);
    node_session_send_peer_fenced(n, id, fp->incarnation, fp->notice_id);
}

/* ---- the owner, as the control session sees it (control_session.h) ---------- */

/* The self-fence (control_session.h, ops->self_fence; a LOST refusal): fences
 * every peer, closes every lifetime and takes a new incarnation with no
 * peers and no lifetimes, the same pools. Owner thread. */
static void node_self_fence(struct kvf_node *n, const char *why)
{
    uint64_t old = n->incarnation;
    node_session_give_up(n); /* nothing more is said as this incarnation */
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
        owner_check_drained(n, r);
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
    node_session_new_incarnation(n, old); /* witnessed once its lifetimes drained */
    n->self_fences++;
    node_metrics_peers_fenced(n->metrics, fenced);
    node_metrics_self_fence(n->metrics);
    /* The host lock names the live incarnation. */
    if (n->host_lock_fd >= 0 && node_host_lock_record(n->host_lock_fd, n->incarnation) != 0)
        node_log("warn", NULL, "self-fence: host lock %s: cannot record incarnation %" PRIu64,
                 n->host_lock_path, n->incarnation);
    node_log("warn", NULL,
             "self-fence: %s: fenced %u peers, closed admission on %zu open lifetimes (%zu not "
             "drained); incarnation %" PRIu64 " is given up, re-attaching as incarnation %" PRIu64
             " with no lifetimes",
             why, fenced, open, undrained, old, n->incarnation);
}

/* A received control message, for the owner thread. */
struct control_msg_job {
    struct kvf_rpc_client_stream *stream; /* the owner drops messages of a stream it gave up */
    Kvfence__V1__ControlMessage *cm;      /* owned */
};

static void control_msg_run(struct kvf_node *n, void *arg)
{
    const struct control_msg_job *a = arg;
    if (!node_session_is_current(n, a->stream))
        return; /* a stream given up by a self-fence */
    node_session_on_message(n, a->cm);
}

static void control_msg_free(void *arg)
{
    struct control_msg_job *a = arg;
    if (a->cm)
        kvfence__v1__control_message__free_unpacked(a->cm, NULL);
    free(a);
}

/* A RoomUpdate's job (hold_room_update): kept back by the fault module
 * unless its stream was given up (then it runs, and drops it). */
static bool control_msg_hold(struct kvf_node *n, struct node_job *j)
{
    const struct control_msg_job *a = j->arg;
    return node_session_is_current(n, a->stream) && node_fault_hold_control(n, j);
}

static int session_post_message(void *ctx, struct kvf_rpc_client_stream *cs,
                                Kvfence__V1__ControlMessage *cm)
{
    struct kvf_node *n = ctx;
    struct control_msg_job *a = calloc(1, sizeof *a);
    struct node_job *j = a ? node_job_new(control_msg_run, a, control_msg_free) : NULL;
    if (!j) {
        free(a);
        return -ENOMEM;
    }
    a->cm = cm;
    a->stream = cs;
    if (cm->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE)
        j->hold = control_msg_hold;
    int rc = node_post(n, j);
    if (rc != 0) {
        a->cm = NULL; /* the caller's again */
        node_job_free(j);
    }
    return rc;
}

/* The session's stream events: synchronous jobs, their argument the stream. */
static void session_open_run(struct kvf_node *n, void *arg)
{
    node_session_opened(n, arg);
}

static void session_closed_run(struct kvf_node *n, void *arg)
{
    node_session_closed(n, arg);
}

static void session_lost_run(struct kvf_node *n, void *arg)
{
    (void)arg;
    node_self_fence(n, "the control plane refused this incarnation as LOST");
}

static bool session_post_event(void *ctx, enum node_session_event ev,
                               struct kvf_rpc_client_stream *cs)
{
    struct kvf_node *n = ctx;
    struct node_job j;
    memset(&j, 0, sizeof j);
    j.run = ev == NODE_SESSION_OPEN     ? session_open_run
            : ev == NODE_SESSION_CLOSED ? session_closed_run
                                        : session_lost_run;
    j.arg = cs;
    j.sync = true;
    return node_post(n, &j) == 0;
}

static void session_refused(void *ctx, int err)
{
    struct kvf_node *n = ctx;
    atomic_store(&n->fatal, err);
    pthread_mutex_lock(&n->qlock);
    pthread_cond_broadcast(&n->qdone);
    pthread_mutex_unlock(&n->qlock);
}

static void session_welcomed(void *ctx)
{
    struct kvf_node *n = ctx;
    pthread_mutex_lock(&n->qlock);
    n->welcomed = true;
    n->welcomes++;
    n->welcomed_port = n->data_port;
    pthread_cond_broadcast(&n->qdone);
    pthread_mutex_unlock(&n->qlock);
}

static void session_room_update(void *ctx, const Kvfence__V1__RoomUpdate *ru)
{
    on_room_update(ctx, ru);
}

static void session_abort_notice(void *ctx, const Kvfence__V1__AbortNotice *an)
{
    on_abort_notice(ctx, an);
}

static void session_fence_peer(void *ctx, const Kvfence__V1__FencePeer *fp)
{
    on_fence_peer(ctx, fp);
}

static void session_self_fence(void *ctx, const char *why)
{
    node_self_fence(ctx, why);
}

static size_t session_features(void *ctx, const char **out, size_t max)
{
    return node_xport_features(ctx, out, max);
}

static size_t session_endpoints(void *ctx, struct node_xport_endpoint *out, size_t max)
{
    return node_xport_endpoints(ctx, out, max);
}

static const struct node_session_ops node_session_ops = {
    .post_message = session_post_message,
    .post_event = session_post_event,
    .refused = session_refused,
    .welcomed = session_welcomed,
    .room_update = session_room_update,
    .abort_notice = session_abort_notice,
    .fence_peer = session_fence_peer,
    .features = session_features,
    .endpoints = session_endpoints,
    .self_fence = session_self_fence,
};
/* ---- TCP receive side (receiver threads) --------------------------------------- */

/* The local sink member whose lease in `pool_id` covers the pages (a page is
 * in at most one write lease, so there is at most one), as the room's members
 * are now. The owner, or a receiver holding rooms_lock (tcp_check). */
static struct node_member *sink_member_of(struct node_room *r, uint32_t pool_id,
                                          uint32_t first_page, uint32_t page_count)
{
    for (size_t i = 0; i < r->nmembers; i++) {
        struct node_member *m = &r->members[i];
        if (m->local && m->role == KVFENCE__V1__ROLE__ROLE_SINK && m->pool_id == pool_id &&
            node_ranges_cover(m->ranges, m->nranges, first_page, page_count))
            return m;
    }
    return NULL;
}

static void tcp_on_frame(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                         uint32_t first_page, uint32_t page_count, uint64_t bytes, int status,
                         bool drained);

static int tcp_check(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                     uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    struct kvf_node *n = ctx;
    int rc = -ENOENT;
    bool outside = false;  /* the room's source sent pages this node's sink lease lacks */
    bool stranger = false; /* the sender is no source of the room */
    pthread_rwlock_rdlock(&n->rooms_lock);
    struct node_room *r = node_room_find(n, room);
    /* A room not known here: the control plane never tells a source the
     * sink's pages before this node acknowledged them, so this is a protocol
     * violation, refused at once; the owner fails the room. */
    bool unknown = (!r || (!r->have_update && !r->core.aborting)) && peer < NODE_MAX_PEERS;
    if (r && r->have_update && peer < NODE_MAX_PEERS) {
        const struct node_peer *from = &n->peers[peer];
        bool from_source = node_room_may_send(r, from->node_id, from->incarnation);
        rc = from_source ? -EPERM : -ENOENT;
        stranger = !from_source;
        const struct node_member *m =
            from_source ? sink_member_of(r, pool_id, first_page, page_count) : NULL;
        if (m && m->rx_closed)
            rc = -ECANCELED; /* the sink completed: nothing more lands in its pages */
        else if (m)
            rc = kvf_lt_admit(r->core.lt, op, KVF_LT_OP_TCP_FRAME, peer);
        else if (from_source)
            outside = !r->core.aborting;
    }
    pthread_rwlock_unlock(&n->rooms_lock);
    /* Counted once here: refused (the room fails), or late (its admission
     * closed or its sink completed: dropped as the rules say). */
    if (rc != 0 && (unknown || outside || stranger))
        node_metrics_frame_refused(n->metrics, unknown   ? NODE_REFUSED_UNKNOWN_ROOM
                                               : outside ? NODE_REFUSED_OUTSIDE_LEASE
                                                         : NODE_REFUSED_NOT_SOURCE);
    else if (rc != 0)
        node_metrics_frame_late(n->metrics);
    /* The frame is dropped (docs/node.md, "a refused frame"): its pages can
     * never land, so the sink can never complete. The owner fails the room
     * (TransferFailed: the control plane aborts it, the abort token drains
     * it) instead of leaving it ACTIVE. */
    if (outside || unknown)
        tcp_on_frame(n, peer, room, pool_id, first_page, page_count, 0, -ENOENT, false);
    return rc;
}

/* A receiver thread's frame events not yet posted: handed to the owner in
 * one post (one wake-up) when the transport says the receiver is about to
 * wait (tcp_on_idle), at once for a drain or a failed read, and at the
 * latest after a bounded batch (tcp.h), so a busy stream does not wake the
 * owner once per frame. */
static _Thread_local struct {
    struct kvf_node *n;
    struct node_job *head, *tail;
} rx_batch;

static void rx_batch_flush(void)
{
    struct node_job *head = rx_batch.head;
    if (!head)
        return;
    rx_batch.head = NULL;
    if (node_post_list(rx_batch.n, head, rx_batch.tail) != 0) {
        while (head) {
            struct node_job *next = head->next;
            node_job_free(head);
            head = next;
        }
    }
}

static void tcp_on_idle(void *ctx)
{
    (void)ctx;
    rx_batch_flush();
}

/* A TCP frame that landed or was cut, for the owner thread (on_frame). */
struct frame_job {
    kvf_room_key room;
    uint32_t peer;
    uint32_t pool_id;                /* the frame's pool */
    uint32_t first_page, page_count; /* its pages (its sink member is found by pool and pages
                                        on the owner thread) */
    uint64_t bytes;
    int status;
    bool drained;
};

static void on_frame(struct kvf_node *n, void *arg);

/* The frame's own coordinates go to the owner thread: nothing is carried
 * from check to here, since two connections of one peer (a reconnect) may
 * overlap and a RoomUpdate may replace the members in between. */
static void tcp_on_frame(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                         uint32_t first_page, uint32_t page_count, uint64_t bytes, int status,
                         bool drained)
{
    struct kvf_node *n = ctx;
    if (status == 0 && bytes > 0)
        node_metrics_received(n->metrics, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP, 1,
                              bytes);
    if (rx_batch.head && rx_batch.n != n)
        rx_batch_flush(); /* not expected: a receiver serves one node */
    struct frame_job *fe = calloc(1, sizeof *fe);
    struct node_job *j = fe ? node_job_new(on_frame, fe, free) : NULL;
    if (!j) {
        free(fe);
        node_log("error", &room, "out of memory posting a frame event: lost");
        return;
    }
    fe->room = room;
    fe->peer = peer;
    fe->pool_id = pool_id;
    fe->first_page = first_page;
    fe->page_count = page_count;
    fe->bytes = bytes;
    fe->status = status;
    fe->drained = drained;
    j->next = NULL;
    if (rx_batch.head)
        rx_batch.tail->next = j;
    else
        rx_batch.head = j;
    rx_batch.tail = j;
    rx_batch.n = n;
    if (drained || status != 0)
        rx_batch_flush(); /* the owner acts on these now */
}

static void owner_fail_unknown_room(struct kvf_node *n, kvf_room_key key, const char *why)
{
    struct node_room *r = node_room_find(n, key);
    if (kvf_lt_table_is_late(n->lts, key) || (r && (r->have_update || r->core.aborting)))
        return; /* closed here, or known by now: the usual rules apply */
    node_session_send_room_failed(n, key, why);
}

static void on_frame(struct kvf_node *n, void *arg)
{
    const struct frame_job *fe = arg;
    struct node_room *r = node_room_find(n, fe->room);
    if ((!r || !r->have_update) && fe->status == -ENOENT && fe->bytes == 0) {
        char why[NODE_ID_MAX + 96];
        snprintf(why, sizeof why,
                 "tcp frame from %s for a room this node does not know: refused (protocol "
                 "violation)",
                 fe->peer < n->npeers ? n->peers[fe->peer].node_id : "?");
        owner_fail_unknown_room(n, fe->room, why);
        return;
    }
    if (!r)
        return;
    struct node_member *m = sink_member_of(r, fe->pool_id, fe->first_page, fe->page_count);
    if (!m && fe->status == -ENOENT) {
        /* Refused by the check: this node's copy of the sink lease lacks the
         * pages (an ExtendLease whose RoomUpdate is not here, or a source
         * that is wrong). The room fails through the token path. */
        struct node_member *sink = NULL;
        for (size_t i = 0; i < r->nmembers && !sink; i++)
            if (r->members[i].local && r->members[i].role == KVFENCE__V1__ROLE__ROLE_SINK &&
                r->members[i].pool_id == fe->pool_id)
                sink = &r->members[i];
        char why[NODE_ID_MAX + 128];
        snprintf(
            why, sizeof why,
            "tcp frame from %s for pool %u pages %u+%u refused: outside this node's sink lease",
            fe->peer < n->npeers ? n->peers[fe->peer].node_id : "?", fe->pool_id, fe->first_page,
            fe->page_count);
        if (sink && !sink->failed) {
            sink->failed = true;
            node_session_send_transfer_failed(n, r, sink->rank, sink->role, why);
        } else if (!sink) {
            node_log("error", &r->key, "%s (no local sink in that pool to report it)", why);
        }
    } else if (!m) {
        /* Not expected: the check found a sink lease covering these pages, and
         * a RoomUpdate keeps each participant with its lease grown. Its pages
         * go uncounted, so the sink cannot complete: say why here. */
        node_log("error", &r->key,
                 "tcp frame (pool %u, pages %u+%u, status %d) matches no local sink member",
                 fe->pool_id, fe->first_page, fe->page_count, fe->status);
    } else {
        if (fe->status == 0) {
            node_member_landed(n, r, m, fe->first_page, fe->page_count, fe->bytes);
        } else {
            m->failed = true;
            char why[NODE_ID_MAX + 128];
            if (fe->status == -EPROTO) /* tcp.h: another buffer layout */
                snprintf(why, sizeof why,
                         "tcp frame from %s refused: its pool's buffer layout differs from sink "
                         "pool %u's (same page size, other slots)",
                         fe->peer < n->npeers ? n->peers[fe->peer].node_id : "?", fe->pool_id);
            else
                snprintf(why, sizeof why, "tcp receive from %s cut: %s",
                         fe->peer < n->npeers ? n->peers[fe->peer].node_id : "?",
                         strerror(-fe->status));
            node_session_send_transfer_failed(n, r, m->rank, m->role, why);
        }
    }
    /* A receive retired: a sink that waited for it may complete now. */
    owner_check_sinks(n, r);
    if (fe->drained)
        owner_check_drained(n, r);
}

/* The TCP transport of incarnation `incarnation` (its id in TCP hellos). */
static struct kvf_transport *node_tcp_create(struct kvf_node *n, uint64_t incarnation,
                                             uint16_t port)
{
    struct kvf_transport_tcp_opts to;
    kvf_transport_tcp_opts_init(&to);
    /* No wait for a room or a peer not known here: the control plane tells a
     * source a sink's pages only after the sink's node acknowledged them,
     * and introduces every peer in the first update (docs/node.md, "Ordered
     * room updates"), so a frame or hello that finds neither is refused. */
    to.check_wait_ms = 0;
    to.node_id = tcp_id_of(n->node_id, incarnation);
    to.bind_host = n->data_host;
    to.port = port;
    to.max_peers = NODE_MAX_PEERS;
    to.max_pools = NODE_MAX_POOLS;
    to.check = tcp_check;
    to.on_frame = tcp_on_frame;
    to.on_idle = tcp_on_idle;
    to.ctx = n;
    if (n->opts.data_connect_timeout_ms)
        to.connect_timeout_ms = n->opts.data_connect_timeout_ms;
    return kvf_transport_tcp_create(&to);
}

/* ---- what the fault module may do (faults.h) -------------------------------- */

static void fault_run_stream(void *ctx, struct node_job *j)
{
    j->run(ctx, j->arg); /* not freed: the fault module frees it after */
}

static int fault_repost(void *ctx, struct node_job *j)
{
    return node_post(ctx, j);
}

static void fault_job_free(void *ctx, struct node_job *j)
{
    (void)ctx;
    node_job_free(j);
}

static void fault_rdma_hold(void *ctx, bool on)
{
    node_rdma_set_hold(ctx, on); /* no-op before RDMA started */
}

static void fault_rdma_hold_odd(void *ctx, bool on)
{
    node_rdma_set_hold_odd(ctx, on);
}

static const struct node_fault_hooks node_fault_hooks = {
    .run_stream = fault_run_stream,
    .repost = fault_repost,
    .job_free = fault_job_free,
    .rdma_hold = fault_rdma_hold,
    .rdma_hold_odd = fault_rdma_hold_odd,
};

/* ---- the owner loop ------------------------------------------------------------ */

/* kvf_node_stop's job: admission closes everywhere; the loop ends once
 * every lifetime drained, or at the drain timeout. */
static void stop_run(struct kvf_node *n, void *arg)
{
    (void)arg;
    if (n->stop_requested)
        return;
    n->stop_requested = true;
    n->stop_deadline_ms = node_now_ms() + (int64_t)n->opts.drain_timeout_ms;
    size_t d = kvf_lt_table_close_all(n->lts);
    node_log("info", NULL, "stopping: admission closed on %zu lifetimes (%zu drained at once)",
             kvf_lt_table_count(n->lts), d);
    for (struct node_room *r = n->rooms; r; r = r->next)
        owner_check_drained(n, r);
}

/* One job, then the rooms the core forgot are freed: no room pointer is
 * held between jobs. */
static void run_job(struct kvf_node *n, struct node_job *j)
{
    if (j->hold && j->hold(n, j))
        j->kept = true; /* the fault module's now: it runs, reposts or frees it */
    else
        j->run(n, j->arg);
    node_core_collect(n);
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* How long the owner may sleep: until the earliest deadline the node knows
 * (the next heartbeat, the self-fence, the end of a stop's drain wait, the
 * data path's parts without a wake descriptor), -1 (for ever) when there is
 * none. A descriptor ends the sleep earlier. */
static int owner_timeout(struct kvf_node *n)
{
    int64_t now = node_now_ms();
    int64_t at = INT64_MAX;
    at = min64(at, node_session_next_ms(n)); /* heartbeat, self-fence */
    if (n->stop_requested)
        at = min64(at, n->stop_deadline_ms);
    at = min64(at, node_xport_next_ms(n, now));
    if (n->faults)
        at = min64(at, now + OWNER_FAULT_TICK_MS);
    if (at == INT64_MAX)
        return -1;
    if (at <= now)
        return 0;
    return at - now > INT_MAX ? INT_MAX : (int)(at - now);
}

/* Sleeps until a wake descriptor is readable or owner_timeout passes, and
 * clears the descriptors that were (before the turn polls what they
 * announced). */
static void owner_wait(struct kvf_node *n)
{
    struct pollfd pfd[1 + NODE_XPORT_MAX_WAKE];
    struct kvf_transport *who[NODE_XPORT_MAX_WAKE];
    pfd[0] = (struct pollfd){.fd = n->qwake, .events = POLLIN};
    size_t nw = node_xport_wake_fds(n, pfd + 1, who, NODE_XPORT_MAX_WAKE);
    int pr = poll(pfd, 1 + nw, owner_timeout(n));
    if (pr <= 0)
        return; /* the deadline, or EINTR: the turn checks everything anyway */
    if (pfd[0].revents)
        kvf_wake_clear(n->qwake);
    for (size_t i = 0; i < nw; i++)
        if (pfd[1 + i].revents)
            kvf_transport_wake_ack(who[i]);
}

static void *owner_main(void *arg)
{
    struct kvf_node *n = arg;
    (void)pthread_setname_np(pthread_self(), "kvf-owner"); /* for ps, top and the tests */
    for (;;) {
        owner_wait(n);
        pthread_mutex_lock(&n->qlock);
        struct node_job *list = n->qhead;
        n->qhead = n->qtail = NULL;
        pthread_mutex_unlock(&n->qlock);

        while (list) {
            struct node_job *j = list;
            list = j->next;
            run_job(n, j);
            if (j->sync) {
                pthread_mutex_lock(&n->qlock);
                j->done = true;
                pthread_cond_broadcast(&n->qdone);
                pthread_mutex_unlock(&n->qlock);
            } else if (!j->kept) {
                node_job_free(j);
            }
        }
        node_faults_tick(n);
        node_poll_completions(n);
        int64_t now = node_now_ms();
        node_session_tick(n, now); /* heartbeat, self-fence */
        node_health_update(n);
        node_metrics_owner_publish(n->metrics, n->npools, n->session_welcomed);
        if (n->stop_requested) {
            bool done = kvf_lt_table_can_teardown(n->lts);
            if (done || now >= n->stop_deadline_ms) {
                n->stop_result = done ? 0 : -ETIMEDOUT;
                if (!done)
                    node_log("error", NULL, "drain timeout: lifetimes still undrained at stop");
                node_rdma_close_all(n, "node shutting down");
                node_session_goodbye(n);
                break;
            }
        }
    }
    /* Jobs posted meanwhile are refused from now on; answer those queued. */
    /* Under the lock until the end: a synchronous job's waiter frees its job
     * as soon as it sees owner_exit, so each job is read before that. */
    pthread_mutex_lock(&n->qlock);
    n->owner_exit = true;
    struct node_job *list = n->qhead;
    n->qhead = n->qtail = NULL;
    while (list) {
        struct node_job *j = list;
        list = j->next;
        if (!j->sync)
            node_job_free(j); /* free_arg answers what it owes (a call: UNAVAILABLE) */
    }
    pthread_cond_broadcast(&n->qdone);
    pthread_mutex_unlock(&n->qlock);
    return NULL;
}

/* ---- metrics: rooms by state, counted at each scrape ------------------------------ */

struct rooms_count {
    uint64_t *counts;
};

/* The node's view of a room (node_metrics.h, enum node_metrics_room). */
static enum node_metrics_room room_metrics_state(const struct node_room *r)
{
    switch (kvf_lt_state(r->core.lt)) {
    case KVF_LT_DRAINED:
        return NODE_ROOM_DRAINED;
    case KVF_LT_QUARANTINED:
        return NODE_ROOM_QUARANTINED;
    default:
        break;
    }
    if (r->core.aborting)
        return NODE_ROOM_ABORTING;
    if (kvf_lt_state(r->core.lt) == KVF_LT_CLOSED)
        return NODE_ROOM_CLOSED;
    return r->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE ? NODE_ROOM_ACTIVE
                                                                  : NODE_ROOM_OPENING;
}

static void rooms_count_run(struct kvf_node *n, void *arg)
{
    struct rooms_count *rc = arg;
    for (struct node_room *r = n->rooms; r; r = r->next)
        rc->counts[room_metrics_state(r)]++;
}

/* The metrics' rooms callback (HTTP thread): a synchronous job, so the
 * owner walks its own rooms (O(rooms) once per scrape, nothing on the hot
 * path). -ESHUTDOWN once the owner has exited. */
static int rooms_count(void *ctx, uint64_t *counts)
{
    struct kvf_node *n = ctx;
    struct rooms_count rc = {.counts = counts};
    struct node_job j;
    memset(&j, 0, sizeof j);
    j.run = rooms_count_run;
    j.arg = &rc;
    j.sync = true;
    return node_post(n, &j);
}

/* ---- public API ---------------------------------------------------------------- */

struct kvf_metrics *kvf_node_metrics(struct kvf_node *n)
{
    return n ? node_metrics_registry(n->metrics) : NULL;
}

void kvf_node_opts_init(struct kvf_node_opts *opts)
{
    memset(opts, 0, sizeof *opts);
    opts->data_host = "127.0.0.1";
    opts->drain_timeout_ms = 10000;
    opts->retain_rooms = 1024;
    opts->local_socket_gid = -1;
}

/* The node's exclusive host lock (host_lock.h): a live holder means another
 * kvfence-node of this host runs with this run directory, and this one must
 * not start; a recorded predecessor is witnessed gone in every Hello. */
static int take_host_lock(struct kvf_node *n)
{
    if (n->opts.run_dir && n->opts.run_dir[0])
        snprintf(n->host_lock_path, sizeof n->host_lock_path, "%s/kvfence-node-%s.lock",
                 n->opts.run_dir, n->node_id);
    else
        snprintf(n->host_lock_path, sizeof n->host_lock_path, "%s.lock", n->local_socket);
    uint64_t prev = 0;
    int rc = node_host_lock_take(n->host_lock_path, &n->host_lock_fd, &prev);
    if (rc == -EWOULDBLOCK) {
        node_log("error", NULL,
                 "host lock %s is held by a live process (another kvfence-node with this run "
                 "directory): not starting",
                 n->host_lock_path);
        return rc;
    }
    if (rc != 0) {
        node_log("error", NULL, "host lock %s: %s", n->host_lock_path, strerror(-rc));
        return rc;
    }
    if (prev >= n->incarnation) /* incarnations only grow on a host, whatever the clock does */
        n->incarnation = prev + 1;
    n->witnessed_gone = prev;
    rc = node_host_lock_record(n->host_lock_fd, n->incarnation);
    if (rc != 0) {
        node_log("error", NULL, "host lock %s: cannot record incarnation: %s", n->host_lock_path,
                 strerror(-rc));
        close(n->host_lock_fd);
        n->host_lock_fd = -1;
        return rc;
    }
    if (prev != 0)
        node_log("info", NULL,
                 "host lock %s taken: incarnation %" PRIu64
                 " (and every earlier one) is gone, witnessed to the control plane",
                 n->host_lock_path, prev);
    return 0;
}

struct kvf_node *kvf_node_start(const struct kvf_node_opts *opts)
{
    if (!opts->control_addr || !opts->node_id || !opts->node_id[0] ||
        strlen(opts->node_id) > NODE_ID_MAX || !opts->local_socket ||
        strlen(opts->local_socket) >= 256) {
        node_log("error", NULL, "node: control address, node id and local socket are required");
        return NULL;
    }
    struct kvf_node *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    n->owner_ops = &owner_ops; /* node_owner.h: how the other modules reach the owner */
    n->chunk_notice_in = node_rdma_notice_in; /* what peer_link hands a ChunkNotice to */
    n->link_msg_in = node_rdma_link_msg;      /* and a link message */
    n->opts = *opts;
    snprintf(n->node_id, sizeof n->node_id, "%s", opts->node_id);
    snprintf(n->local_socket, sizeof n->local_socket, "%s", opts->local_socket);
    snprintf(n->data_host, sizeof n->data_host, "%s",
             opts->data_host && opts->data_host[0] ? opts->data_host : "127.0.0.1");
    n->opts.node_id = n->node_id;
    n->opts.local_socket = n->local_socket;
    n->opts.data_host = n->data_host;
    n->host_lock_fd = -1;
    n->incarnation = opts->incarnation;
    if (!n->incarnation) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        n->incarnation = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
    }
    if (take_host_lock(n) != 0) {
        free(n);
        return NULL;
    }
    /* NULL (logged): the node runs without metrics, its hooks are no-ops. */
    n->metrics = node_metrics_create(KVF_VERSION_STRING, rooms_count, n);
    n->next_pool_id = 1;
    n->hb_interval_ms = 1000;
    pthread_mutex_init(&n->qlock, NULL);
    n->qwake = kvf_wake_open();
    pthread_cond_init(&n->qdone, NULL);
    pthread_rwlock_init(&n->rooms_lock, NULL);
    pthread_mutex_init(&n->watch_lock, NULL);

    if (n->qwake < 0) {
        node_log("error", NULL, "node: job queue eventfd: %s", strerror(-n->qwake));
        goto err_destroy;
    }
    struct kvf_ncore_opts co;
    kvf_ncore_opts_init(&co);
    co.retain_max = n->opts.retain_rooms;
    co.max_peers = NODE_MAX_PEERS;
    n->core = kvf_ncore_create(&co);
    n->lts = n->core ? kvf_ncore_lts(n->core) : NULL;
    if (!n->lts)
        goto err_destroy;
    /* This incarnation's peer keys: the secret half never leaves the process. */
    if (kvf_peer_keypair_generate(&n->keys) != 0)
        goto err_destroy;
    n->tcp = node_tcp_create(n, n->incarnation, opts->data_port);
    if (!n->tcp)
        goto err_destroy;
    n->data_port = kvf_transport_tcp_port(n->tcp);
    n->tcp_io = n->tcp;
    if (opts->fault_file && opts->fault_file[0] &&
        node_faults_start(n, opts->fault_file, &node_fault_hooks, n) != 0)
        goto err_destroy;
    if (node_xport_start(n) != 0)
        goto err_destroy;
    if (node_peer_start(n) != 0)
        goto err_destroy;

    if (pthread_create(&n->owner, NULL, owner_main, n) != 0)
        goto err_destroy;
    n->owner_started = true;
    static const node_local_register_fn local_services[] = {
        node_substream_register,  /* SubmitChunks */
        node_watch_register,      /* Watch */
        node_pool_admin_register, /* UnregisterPool */
        node_health_register,     /* grpc.health.v1.Health */
    };
    if (node_local_start(n, local_services, sizeof local_services / sizeof local_services[0]) != 0)
        goto err_destroy;
    if (node_session_start(n, &node_session_ops, n) != 0)
        goto err_destroy;
    char z85[KVF_PEER_Z85_SIZE];
    kvf_peer_key_z85(n->keys.pub, z85);
    node_log("info", NULL,
             "kvfence-node %s incarnation %" PRIu64
             ": data tcp %s:%u, peer %s, peer key %s, local socket %s, control %s",
             n->node_id, n->incarnation, n->data_host, n->data_port, n->peer_ep, z85,
             n->local_socket, opts->control_addr);
    return n;

err_destroy:
    kvf_node_destroy(n);
    return NULL;
}

int kvf_node_fatal(const struct kvf_node *n)
{
    return atomic_load(&n->fatal);
}

uint16_t kvf_node_data_port(const struct kvf_node *n)
{
    return n->data_port;
}

uint64_t kvf_node_welcomed(struct kvf_node *n, uint16_t *data_port_p)
{
    pthread_mutex_lock(&n->qlock);
    uint64_t w = n->welcomes;
    *data_port_p = n->welcomed_port;
    pthread_mutex_unlock(&n->qlock);
    return w;
}

int kvf_node_wait_ready(struct kvf_node *n, int64_t timeout_ms)
{
    int64_t end = node_now_ms() + timeout_ms;
    pthread_mutex_lock(&n->qlock);
    while (!n->welcomed && !atomic_load(&n->fatal) && node_now_ms() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&n->qdone, &n->qlock, &ts);
    }
    int rc = n->welcomed ? 0 : atomic_load(&n->fatal) ? atomic_load(&n->fatal) : -ETIMEDOUT;
    pthread_mutex_unlock(&n->qlock);
    return rc;
}

int kvf_node_stop(struct kvf_node *n)
{
    int rc = 0;
    node_health_shutdown(n); /* probes see NOT_SERVING before the drain */
    if (n->owner_started) {
        /* Synchronous, on the stack: a stop needs no allocation. */
        struct node_job j;
        memset(&j, 0, sizeof j);
        j.run = stop_run;
        j.sync = true;
        (void)node_post(n, &j);
        pthread_join(n->owner, NULL);
        n->owner_started = false;
        rc = n->stop_result;
    }
    /* Nobody handles a delivered message any more: the channel goes, and the
     * Watch streams end with UNAVAILABLE before the server stops. */
    node_peer_stop(n);
    node_watch_end_all(n);
    node_substream_end_all(n);
    atomic_store(&n->stopping, true);
    node_session_join(n);
    node_local_stop(n);
    node_health_free(n);
    node_watch_free_all(n);
    return rc;
}

void kvf_node_destroy(struct kvf_node *n)
{
    if (!n)
        return;
    if (n->owner_started || n->session_started || n->local_srv || n->peerch)
        (void)kvf_node_stop(n);
    bool can_free = !n->lts || kvf_lt_table_can_teardown(n->lts);
    /* destroy fences every peer and retires the completions nobody polled. */
    node_faults_stop(n);
    if (n->tcp) {
        struct kvf_transport_tcp_stats ts;
        kvf_transport_tcp_stats(n->tcp, &ts);
        node_log("info", NULL,
                 "data port: %" PRIu64 " connections accepted, %" PRIu64 " refused (%" PRIu64
                 " bad hello or proof, %" PRIu64 " not introduced or fenced, %" PRIu64
                 " timed out, %" PRIu64 " over the caps, %" PRIu64
                 " out of memory or threads), %" PRIu64 " outbound handshakes failed",
                 ts.conns_accepted, ts.conns_refused, ts.conns_bad_hello, ts.conns_unknown,
                 ts.conns_timed_out, ts.conns_over_cap, ts.conns_no_resource, ts.handshakes_failed);
    }
    kvf_transport_destroy(n->tcp);
    n->tcp = NULL;
    node_xport_stop(n); /* local transport, staging engine and ring */
    if (can_free || kvf_lt_table_can_teardown(n->lts)) {
        for (uint32_t i = 0; i < n->npools; i++)
            kvf_pool_close(n->pools[i].pool);
        kvf_ncore_destroy(n->core); /* and its lifetime table */
    } else {
        node_log("error", NULL, "lifetimes undrained at exit: pools left mapped");
    }
    struct node_room *r = n->rooms;
    while (r) {
        struct node_room *next = r->next;
        members_free(r->members, r->nmembers);
        free(r->intro);
        node_pairs_free(r);
        free(r->peer_refs);
        free(r);
        r = next;
    }
    free(n->room_index);
    pthread_rwlock_destroy(&n->rooms_lock);
    pthread_mutex_destroy(&n->watch_lock);
    pthread_cond_destroy(&n->qdone);
    kvf_wake_close(n->qwake);
    pthread_mutex_destroy(&n->qlock);
    if (n->host_lock_fd >= 0)
        close(n->host_lock_fd); /* the process is ending: the next one may take it */
    kvf_peer_keypair_wipe(&n->keys);
    node_metrics_destroy(n->metrics); /* main.c stopped its HTTP server */
    free(n);
}
