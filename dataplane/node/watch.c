/*
 * watch.c: NodeLocal.Watch, the engines' event stream (node.proto
 * WatchRequest / NodeEvent).
 *
 * Events, all decided on the owner thread, so the events of one room reach
 * every watcher in the order the owner decided them:
 * - room_state: a RoomUpdate opened or changed a room, an AbortNotice arrived
 *   (first one), the room's lifetime drained here;
 * - chunk_done (include_chunks only): a chunk of a local source finished, or
 *   (sink) an RDMA ChunkNotice was accepted; with the transport it took. It
 *   is packed only while some watcher asked for chunks (watchers_chunks);
 * - aux: AuxData arrived for a local sink rank;
 * - transfer_done: a source's TransferStatus arrived for a local sink rank.
 *   ok=false goes out at once; ok=true is held (peer_link.c) until the sink
 *   rank's landed bytes cover its lease and are all accounted for by ok
 *   statuses, i.e. every chunk arrived, then sent just before its Completed.
 * A stream starts with one room_state per matching room whose lifetime has
 * not drained (its current state), sent by the owner when it runs the
 * new watcher's job; live events reach a watcher only after its snapshot.
 *
 * Filters: rooms (generation 0: any generation of the id), ranks (local
 * ranks: a chunk_done's source rank, an aux's or transfer_done's sink rank;
 * a room_state passes when the room has a local participant of one of them,
 * or no members known yet). Invalid filters end the stream with
 * INVALID_ARGUMENT naming the field.
 *
 * DESIGN (threads, backpressure): watchers are in a list under watch_lock.
 * on_open and on_closed (gRPC CQ threads) add and remove them; the owner
 * sends under the lock. kvf_rpc_stream_send only queues, so the owner never
 * waits for a reader. The queue is bounded per watcher: when
 * WATCH_QUEUE_MAX messages are still unwritten, the stream is ended with
 * RESOURCE_EXHAUSTED (the engine watches again and reads the snapshot). At
 * shutdown, once the owner exited, every stream ends with UNAVAILABLE; the
 * server's shutdown then closes them and on_closed frees the watchers.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node_log.h"
#include "node_owner.h"
#include "node_types.h"
#include "watch.h"

#define WATCH_QUEUE_MAX  256 /* unwritten events per watcher (an aux: <= 1 MiB) */
#define WATCH_MAX        64  /* watchers per node */
#define WATCH_FILTER_MAX 256 /* rooms or ranks in one filter */

struct node_watcher {
    struct kvf_rpc_stream *stream;
    kvf_room_key *rooms;
    size_t nrooms;
    uint32_t *ranks;
    size_t nranks;
    bool include_chunks;
    bool snapshot_due; /* no event before the snapshot */
    bool ended;        /* finish was called */
    struct node_watcher *next;
};

static void watcher_free(struct node_watcher *w)
{
    free(w->rooms);
    free(w->ranks);
    free(w);
}

/* ---- stream callbacks (CQ threads) ----------------------------------------------------- */

/* Owner thread: a new watcher's job (no argument): the snapshots due go out. */
static void watch_add_run(struct kvf_node *n, void *arg)
{
    (void)arg;
    node_watch_snapshot(n);
}

static void w_on_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    struct kvf_node *n = ctx;
    static const uint8_t empty[1];
    Kvfence__V1__WatchRequest *wr =
        kvfence__v1__watch_request__unpack(NULL, len, len ? req : empty);
    if (!wr) {
        kvf_rpc_stream_finish(stream, KVF_GRPC_INVALID_ARGUMENT, "undecodable WatchRequest");
        return;
    }
    char why[128] = "";
    if (wr->n_rooms > WATCH_FILTER_MAX)
        snprintf(why, sizeof why, "rooms: more than %d", WATCH_FILTER_MAX);
    else if (wr->n_ranks > WATCH_FILTER_MAX)
        snprintf(why, sizeof why, "ranks: more than %d", WATCH_FILTER_MAX);
    for (size_t i = 0; !why[0] && i < wr->n_rooms; i++) {
        if (wr->rooms[i]->room_id == 0 || wr->rooms[i]->room_id > KVF_ROOM_ID_MAX)
            snprintf(why, sizeof why, "rooms[%zu].room_id: must be 1..%" PRIu64, i,
                     (uint64_t)KVF_ROOM_ID_MAX);
    }
    if (why[0]) {
        kvfence__v1__watch_request__free_unpacked(wr, NULL);
        kvf_rpc_stream_finish(stream, KVF_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    struct node_watcher *w = calloc(1, sizeof *w);
    if (w) {
        w->rooms = calloc(wr->n_rooms ? wr->n_rooms : 1, sizeof *w->rooms);
        w->ranks = calloc(wr->n_ranks ? wr->n_ranks : 1, sizeof *w->ranks);
    }
    if (!w || !w->rooms || !w->ranks) {
        if (w)
            watcher_free(w);
        kvfence__v1__watch_request__free_unpacked(wr, NULL);
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    w->stream = stream;
    w->nrooms = wr->n_rooms;
    for (size_t i = 0; i < wr->n_rooms; i++)
        w->rooms[i] = (kvf_room_key){wr->rooms[i]->room_id, wr->rooms[i]->generation};
    w->nranks = wr->n_ranks;
    if (wr->n_ranks)
        memcpy(w->ranks, wr->ranks, wr->n_ranks * sizeof *w->ranks);
    w->include_chunks = wr->include_chunks;
    w->snapshot_due = true;
    kvfence__v1__watch_request__free_unpacked(wr, NULL);

    pthread_mutex_lock(&n->watch_lock);
    size_t count = 0;
    for (struct node_watcher *o = n->watchers; o; o = o->next)
        count++;
    if (count >= WATCH_MAX) {
        pthread_mutex_unlock(&n->watch_lock);
        watcher_free(w);
        char msg[64];
        snprintf(msg, sizeof msg, "watchers: limit %d per node", WATCH_MAX);
        kvf_rpc_stream_finish(stream, KVF_GRPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    w->next = n->watchers;
    n->watchers = w;
    if (w->include_chunks)
        n->watchers_chunks++;
    kvf_rpc_stream_set_user(stream, w);
    pthread_mutex_unlock(&n->watch_lock);

    struct node_job *j = node_job_new(watch_add_run, NULL, NULL);
    const char *refused = j ? NULL : "out of memory";
    if (j && node_post(n, j) != 0) {
        node_job_free(j);
        refused = "node shutting down";
    }
    if (refused) {
        /* The watcher stays listed until on_closed frees it. */
        pthread_mutex_lock(&n->watch_lock);
        if (!w->ended) {
            w->ended = true;
            kvf_rpc_stream_finish(stream, KVF_GRPC_UNAVAILABLE, refused);
        }
        pthread_mutex_unlock(&n->watch_lock);
    }
}

static void w_on_closed(void *ctx, struct kvf_rpc_stream *stream, enum kvf_rpc_close_reason why)
{
    (void)why;
    struct kvf_node *n = ctx;
    pthread_mutex_lock(&n->watch_lock);
    struct node_watcher *w = kvf_rpc_stream_user(stream);
    for (struct node_watcher **pp = &n->watchers; w && *pp; pp = &(*pp)->next) {
        if (*pp == w) {
            *pp = w->next;
            if (w->include_chunks)
                n->watchers_chunks--;
            break;
        }
    }
    kvf_rpc_stream_set_user(stream, NULL);
    pthread_mutex_unlock(&n->watch_lock);
    if (w)
        watcher_free(w);
}

int node_watch_register(struct kvf_node *n)
{
    struct kvf_rpc_stream_callbacks cbs = {0};
    cbs.on_open = w_on_open;
    cbs.on_closed = w_on_closed;
    return kvf_rpc_server_add_stream(n->local_srv, "/kvfence.v1.NodeLocal/Watch",
                                     KVF_RPC_SERVER_STREAMING, &cbs, n);
}

/* ---- sending (owner thread, watch_lock held) ---------------------------------------------- */

static bool room_match(const struct node_watcher *w, kvf_room_key k)
{
    if (w->nrooms == 0)
        return true;
    for (size_t i = 0; i < w->nrooms; i++)
        if (w->rooms[i].room_id == k.room_id &&
            (w->rooms[i].generation == 0 || w->rooms[i].generation == k.generation))
            return true;
    return false;
}

static bool rank_match(const struct node_watcher *w, uint32_t rank)
{
    if (w->nranks == 0)
        return true;
    for (size_t i = 0; i < w->nranks; i++)
        if (w->ranks[i] == rank)
            return true;
    return false;
}

static bool room_rank_match(const struct node_watcher *w, const struct node_room *r)
{
    if (w->nranks == 0 || r->nmembers == 0)
        return true;
    for (size_t i = 0; i < r->nmembers; i++)
        if (r->members[i].local && rank_match(w, r->members[i].rank))
            return true;
    return false;
}

static void w_send(struct node_watcher *w, const uint8_t *buf, size_t len)
{
    if (w->ended)
        return;
    if (kvf_rpc_stream_queued(w->stream) >= WATCH_QUEUE_MAX) {
        w->ended = true;
        char msg[160];
        snprintf(msg, sizeof msg,
                 "watch: %d events unread: the watcher reads too slowly; stream ended (watch "
                 "again)",
                 WATCH_QUEUE_MAX);
        kvf_rpc_stream_finish(w->stream, KVF_GRPC_RESOURCE_EXHAUSTED, msg);
        node_log("warn", NULL, "%s", msg);
        return;
    }
    if (kvf_rpc_stream_send(w->stream, buf, len) != 0)
        w->ended = true; /* closed: on_closed frees it */
}

static uint8_t *pack_event(const Kvfence__V1__NodeEvent *ev, size_t *len_p)
{
    size_t len = kvfence__v1__node_event__get_packed_size(ev);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf)
        kvfence__v1__node_event__pack(ev, buf);
    *len_p = len;
    return buf;
}

static int lifetime_wire(enum kvf_lt_state s)
{
    switch (s) {
    case KVF_LT_OPEN:
        return KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_OPEN;
    case KVF_LT_CLOSED:
        return KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_CLOSED;
    case KVF_LT_DRAINED:
        return KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_DRAINED;
    default:
        return KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_QUARANTINED;
    }
}

/* Whether every node the room's update introduced has a member known here:
 * the control plane publishes a node's leases only after that node
 * acknowledged the room (docs/node.md, "Ordered room updates"). */
static bool all_published(const struct node_room *r)
{
    for (size_t i = 0; i < r->nintro; i++) {
        bool known = false;
        for (size_t j = 0; j < r->nmembers && !known; j++)
            known = strcmp(r->members[j].node_id, r->intro[i].node_id) == 0;
        if (!known)
            return false;
    }
    return true;
}

static uint8_t *pack_room_state(const struct node_room *r, size_t *len_p)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = r->key.room_id;
    k.generation = r->key.generation;
    Kvfence__V1__NodeRoomEvent re = KVFENCE__V1__NODE_ROOM_EVENT__INIT;
    re.state = (Kvfence__V1__RoomState)r->state;
    /* ACTIVE on this node means its engines may submit: every participant's
     * lease is known here. Until the last node is published the room is
     * still OPENING for this node's watchers. */
    if (r->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE && !all_published(r))
        re.state = KVFENCE__V1__ROOM_STATE__ROOM_STATE_OPENING;
    re.lifetime = (Kvfence__V1__LifetimeState)lifetime_wire(kvf_lt_state(r->core.lt));
    re.reason = (Kvfence__V1__AbortReason)r->abort_reason;
    Kvfence__V1__NodeEvent ev = KVFENCE__V1__NODE_EVENT__INIT;
    ev.room = &k;
    ev.event_case = KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE;
    ev.room_state = &re;
    return pack_event(&ev, len_p);
}

void node_watch_snapshot(struct kvf_node *n)
{
    pthread_mutex_lock(&n->watch_lock);
    for (struct node_watcher *w = n->watchers; w; w = w->next) {
        if (!w->snapshot_due)
            continue;
        w->snapshot_due = false;
        for (struct node_room *r = n->rooms; r; r = r->next) {
            if (r->core.drained_seen || !room_match(w, r->key) || !room_rank_match(w, r))
                continue;
            size_t len;
            uint8_t *buf = pack_room_state(r, &len);
            if (buf)
                w_send(w, buf, len);
            free(buf);
        }
    }
    pthread_mutex_unlock(&n->watch_lock);
}

enum ev_rank { EV_ROOM, EV_CHUNK, EV_SINK };

/* Sends `buf` to every watcher that wants an event of `r` (and `rank`). */
static void broadcast(struct kvf_node *n, const struct node_room *r, enum ev_rank kind,
                      uint32_t rank, const uint8_t *buf, size_t len)
{
    pthread_mutex_lock(&n->watch_lock);
    for (struct node_watcher *w = n->watchers; w; w = w->next) {
        if (w->snapshot_due || w->ended || !room_match(w, r->key))
            continue;
        if (kind == EV_CHUNK && !w->include_chunks)
            continue;
        if (kind == EV_ROOM ? !room_rank_match(w, r) : !rank_match(w, rank))
            continue;
        w_send(w, buf, len);
    }
    pthread_mutex_unlock(&n->watch_lock);
}

static bool any_watcher(struct kvf_node *n)
{
    pthread_mutex_lock(&n->watch_lock);
    bool any = n->watchers != NULL;
    pthread_mutex_unlock(&n->watch_lock);
    return any;
}

/* Chunk events are one per chunk: not built at all unless someone wants them. */
static bool any_chunk_watcher(struct kvf_node *n)
{
    pthread_mutex_lock(&n->watch_lock);
    bool any = n->watchers_chunks != 0;
    pthread_mutex_unlock(&n->watch_lock);
    return any;
}

/* Sends event `ev` of room `r` (its key filled in here) like broadcast. */
static void emit(struct kvf_node *n, const struct node_room *r, Kvfence__V1__NodeEvent *ev,
                 enum ev_rank kind, uint32_t rank)
{
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = r->key.room_id;
    k.generation = r->key.generation;
    ev->room = &k;
    size_t len;
    uint8_t *buf = pack_event(ev, &len);
    if (buf)
        broadcast(n, r, kind, rank, buf, len);
    free(buf);
}

void node_watch_room_state(struct kvf_node *n, struct node_room *r)
{
    if (!any_watcher(n))
        return;
    size_t len;
    uint8_t *buf = pack_room_state(r, &len);
    if (!buf)
        return;
    broadcast(n, r, EV_ROOM, 0, buf, len);
    free(buf);
}

void node_watch_chunk_done(struct kvf_node *n, struct node_room *r, uint32_t src_rank,
                           uint32_t sink_rank, uint64_t seq, bool ok, const char *error,
                           int transport)
{
    n->watch_chunk_calls++;
    if (!any_chunk_watcher(n))
        return;
    n->watch_chunk_packed++;
    Kvfence__V1__ChunkDoneEvent cd = KVFENCE__V1__CHUNK_DONE_EVENT__INIT;
    cd.source_rank = src_rank;
    cd.sink_rank = sink_rank;
    cd.chunk_seq = seq;
    cd.ok = ok;
    cd.error = (char *)(error ? error : "");
    cd.transport = (Kvfence__V1__TransportKind)transport;
    Kvfence__V1__NodeEvent ev = KVFENCE__V1__NODE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE;
    ev.chunk_done = &cd;
    emit(n, r, &ev, EV_CHUNK, src_rank);
}

void node_watch_aux(struct kvf_node *n, struct node_room *r, const struct node_peer_msg *pm)
{
    if (!any_watcher(n))
        return;
    Kvfence__V1__AuxEvent a = KVFENCE__V1__AUX_EVENT__INIT;
    a.source_rank = pm->source_rank;
    a.sink_rank = pm->sink_rank;
    a.data.data = (uint8_t *)pm->data;
    a.data.len = pm->len;
    Kvfence__V1__NodeEvent ev = KVFENCE__V1__NODE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__NODE_EVENT__EVENT_AUX;
    ev.aux = &a;
    emit(n, r, &ev, EV_SINK, pm->sink_rank);
}

void node_watch_transfer_done(struct kvf_node *n, struct node_room *r,
                              const struct node_peer_msg *pm)
{
    if (!any_watcher(n))
        return;
    Kvfence__V1__TransferDoneEvent td = KVFENCE__V1__TRANSFER_DONE_EVENT__INIT;
    td.source_node_id = (char *)pm->sender;
    td.source_rank = pm->source_rank;
    td.sink_rank = pm->sink_rank;
    td.ok = pm->ok;
    td.error = (char *)pm->error;
    Kvfence__V1__NodeEvent ev = KVFENCE__V1__NODE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE;
    ev.transfer_done = &td;
    emit(n, r, &ev, EV_SINK, pm->sink_rank);
}

/* ---- shutdown -------------------------------------------------------------------------------- */

void node_watch_end_all(struct kvf_node *n)
{
    pthread_mutex_lock(&n->watch_lock);
    for (struct node_watcher *w = n->watchers; w; w = w->next) {
        if (!w->ended) {
            w->ended = true;
            kvf_rpc_stream_finish(w->stream, KVF_GRPC_UNAVAILABLE, "node shutting down");
        }
    }
    pthread_mutex_unlock(&n->watch_lock);
}

void node_watch_free_all(struct kvf_node *n)
{
    /* The server stopped: every on_closed ran; anything left is unreachable. */
    pthread_mutex_lock(&n->watch_lock);
    struct node_watcher *w = n->watchers;
    n->watchers = NULL;
    n->watchers_chunks = 0;
    pthread_mutex_unlock(&n->watch_lock);
    node_log("info", NULL, "watch stats: chunk_done=%" PRIu64 " chunk_done_packed=%" PRIu64,
             n->watch_chunk_calls, n->watch_chunk_packed);
    while (w) {
        struct node_watcher *next = w->next;
        watcher_free(w);
        w = next;
    }
}
