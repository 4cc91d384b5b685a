/*
 * test_node_peer.c: kvfence-node's peer channel and NodeLocal.Watch, end to
 * end. Each test starts one kvfence-control and two kvfence-node processes
 * (n1: sources, n2: sinks) on 127.0.0.1 (the node harness: node_harness.c),
 * one POSIX shm pool per node, and plays the engines: JoinRoom over Control,
 * SubmitChunk to n1 over NodeLocal, and NodeLocal.Watch streams on the nodes.
 *
 * What is checked: aux bytes reach the sink's Watch byte-exact, before the
 * pair's transfer_done; TP fan-in and fan-out with aux per pair and the
 * ranks filter; a message lost on the channel (delay fault: a sequence gap)
 * fails the room and nothing of it reaches Watch, and the held message
 * arriving after the abort is dropped; a status delayed past an engine abort
 * is dropped; 8 threads submitting last chunks of 32 rooms at once get every
 * aux whole and in order per room; bad filters answer INVALID_ARGUMENT
 * naming the field; a node's shutdown ends its Watch streams with
 * UNAVAILABLE and the node exits 0; a 65th watcher is refused with
 * RESOURCE_EXHAUSTED until one of the 64 leaves; a message that reaches the sink before
 * its RoomUpdate (held by n2's fault file) waits for it: accepted when it
 * comes within the wait, dropped as UNKNOWN (then a sequence gap fails the
 * room) when it does not.
 *
 * Waits are on observed state with timeouts (GetRoom polls, Watch events).
 * "Nothing for room A" is proven by order: the channel carries messages of
 * one node pair in order, so once the later room's transfer_done arrived, the
 * earlier room's messages were received (and dropped) before it.
 * KVF_TEST_FILTER=<cmocka pattern> runs only the matching tests.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS    10000
#define PAGE_SIZE  4096u
#define PAGE_COUNT 64u

#define SOURCE KVFENCE__V1__ROLE__ROLE_SOURCE
#define SINK   KVFENCE__V1__ROLE__ROLE_SINK

/* ---- fixture (the harness: node_harness.c, plus --peer-fault) ---------------------- */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2;
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    /* 20 s: a node whose NodeLocal writes hit a full socket (a Watch client
     * reading slowly) in its last seconds exits up to 10 s late: gRPC's TCP
     * backup poller runs on its executor in 10 s polls, and grpc_shutdown()
     * joins it. */
    struct nh_pool *pools[] = {&f->p1, &f->p2};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 20000, pools, 2, f->dir);
    free(f);
    return rc;
}

/* Joins one participant of a room with `nsrc` sources and `nsink` sinks;
 * retries while the node's pool is not yet known to the control plane. */
static kvf_room_key join(struct fx *f, uint64_t room_id, uint32_t nsrc, uint32_t nsink,
                         const char *node, uint32_t rank, int role, uint32_t pool_id,
                         uint32_t first, uint32_t count)
{
    return nh_join(f->ch, room_id, nsrc, nsink, node, rank, role, pool_id, first, count, WAIT_MS,
                   NULL);
}

struct chunk {
    uint32_t src_rank;
    uint64_t seq;
    uint32_t sfirst;
    uint32_t sink_rank;
    uint32_t dfirst;
    uint32_t count;
    bool last;
    const uint8_t *aux;
    size_t aux_len;
};

/* SubmitChunk on n1: n1's pages -> n2's. Returns the status code (no cmocka
 * assertion: safe from threads). */
static int submit(struct fx *f, kvf_room_key k, const struct chunk *c, struct kvf_rpc_status *st)
{
    struct nh_chunk nc = {.source_rank = c->src_rank,
                          .seq = c->seq,
                          .source_pool = f->p1.pool_id,
                          .sink_node = "n2",
                          .sink_rank = c->sink_rank,
                          .sink_pool = f->p2.pool_id,
                          .sfirst = {c->sfirst},
                          .dfirst = {c->dfirst},
                          .count = {c->count},
                          .last = c->last,
                          .aux = c->aux,
                          .aux_len = c->aux_len};
    return nh_submit(f->n1.local, k, &nc, st);
}

static void submit_ok(struct fx *f, kvf_room_key k, const struct chunk *c)
{
    struct kvf_rpc_status st;
    int code = submit(f, k, c, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk rank %u -> %u seq %llu: %d %s", c->src_rank, c->sink_rank,
                 (unsigned long long)c->seq, code, st.message);
}

/* Waits until `np` has the room's update: a SubmitChunk naming source rank
 * 99, in no lease, answers UNAVAILABLE before, FAILED_PRECONDITION after.
 * The probe goes to `np`'s NodeLocal. */
static void wait_node_knows(struct fx *f, struct nh_node *np, kvf_room_key k)
{
    nh_wait_node_knows(np, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, WAIT_MS);
}

/* n2 with `n2_flags` (NH_LOG_FILE, NH_FAULT_FILE). */
static void fx_start_n2(struct fx *f, const char *n1_fault, unsigned n2_flags)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "3000", "--resend-ms", "50", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "peer");
    const char *n1_args[] = {"--peer-fault", n1_fault ? n1_fault : "", NULL};
    const char *n2_args[] = {"--peer-fault", "", NULL};
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, n1_args, 0), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, n2_args, n2_flags), 0);
    assert_int_equal(nh_pool_create(&f->p1, "peer", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "peer", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static void fx_start(struct fx *f, const char *n1_fault)
{
    fx_start_n2(f, n1_fault, 0);
}

/* One source (n1 rank 0, pages [first, +count)) and one sink (n2 rank 0, the
 * same pages); ACTIVE and known to both nodes. */
static kvf_room_key room_pair(struct fx *f, uint64_t room_id, uint32_t first, uint32_t count)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, first, "n2", f->p2.pool_id,
                                  first, count, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    return k;
}

/* ---- Watch -------------------------------------------------------------------------- */

static struct kvf_rpc_client_stream *watch_open(struct nh_node *np, const kvf_room_key *rooms,
                                                size_t nrooms, const uint32_t *ranks, size_t nranks,
                                                bool include_chunks)
{
    Kvfence__V1__RoomKey rkv[8];
    Kvfence__V1__RoomKey *rkp[8];
    assert_true(nrooms <= 8);
    for (size_t i = 0; i < nrooms; i++) {
        kvfence__v1__room_key__init(&rkv[i]);
        rkv[i].room_id = rooms[i].room_id;
        rkv[i].generation = rooms[i].generation;
        rkp[i] = &rkv[i];
    }
    Kvfence__V1__WatchRequest req = KVFENCE__V1__WATCH_REQUEST__INIT;
    req.n_rooms = nrooms;
    req.rooms = rkp;
    req.n_ranks = nranks;
    req.ranks = (uint32_t *)ranks;
    req.include_chunks = include_chunks;
    size_t len = kvfence__v1__watch_request__get_packed_size(&req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    kvfence__v1__watch_request__pack(&req, buf);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(np->local, "/kvfence.v1.NodeLocal/Watch", 120000);
    assert_non_null(cs);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    free(buf);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    return cs;
}

/* The next event (free it), or NULL when the stream ended (status in *st). */
static Kvfence__V1__NodeEvent *watch_next(struct kvf_rpc_client_stream *cs, int64_t timeout_ms,
                                          struct kvf_rpc_status *st)
{
    uint8_t *msg;
    size_t len;
    int rc = kvf_rpc_client_stream_recv(cs, timeout_ms, &msg, &len, st);
    if (rc == KVF_RPC_STREAM_END)
        return NULL;
    if (rc != 0)
        fail_msg("watch: no event within %lld ms (%d)", (long long)timeout_ms, rc);
    Kvfence__V1__NodeEvent *ev = kvfence__v1__node_event__unpack(NULL, len, msg);
    free(msg);
    assert_non_null(ev);
    assert_non_null(ev->room);
    return ev;
}

static Kvfence__V1__NodeEvent *watch_must(struct kvf_rpc_client_stream *cs)
{
    struct kvf_rpc_status st;
    Kvfence__V1__NodeEvent *ev = watch_next(cs, WAIT_MS, &st);
    if (!ev)
        fail_msg("watch ended: %d %s", st.code, st.message);
    return ev;
}

static bool ev_room(const Kvfence__V1__NodeEvent *ev, kvf_room_key k)
{
    return ev->room->room_id == k.room_id && ev->room->generation == k.generation;
}

/* Waits for the room_state ACTIVE of `k` (the stream's snapshot when the
 * node knows the room as published, else a live event after an OPENING
 * snapshot: the node hears that every participant is published in a later
 * RoomUpdate than the one that opened the room): from then on the watcher gets
 * every live event. Watch's server side registers a stream asynchronously, so
 * a test that submits right after opening would race it. Only room_state
 * events may come before. */
static void watch_sync(struct kvf_rpc_client_stream *cs, kvf_room_key k)
{
    for (;;) {
        Kvfence__V1__NodeEvent *ev = watch_must(cs);
        assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        bool hit = ev_room(ev, k);
        bool active = false;
        if (hit) {
            active = ev->room_state->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE;
            if (!active)
                assert_int_equal(ev->room_state->state,
                                 KVFENCE__V1__ROOM_STATE__ROOM_STATE_OPENING);
            assert_int_equal(ev->room_state->lifetime,
                             KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_OPEN);
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
        if (active)
            return;
    }
}

static void fill_aux(uint8_t *buf, size_t len, uint32_t tag)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)(tag * 131u + i * 7u + (i >> 8));
}

static void check_aux(const Kvfence__V1__NodeEvent *ev, size_t len, uint32_t tag)
{
    assert_int_equal(ev->aux->data.len, len);
    uint8_t *want = malloc(len ? len : 1);
    assert_non_null(want);
    fill_aux(want, len, tag);
    int diff = memcmp(ev->aux->data.data, want, len);
    free(want);
    if (diff != 0)
        fail_msg("aux of tag %u: bytes differ", tag);
}

/* Per (source rank, sink rank) of one room: what Watch showed. */
struct pair_seen {
    bool aux, done, done_ok;
};

/* Reads events of `cs` until every pair in `want` (count) of room `k` has its
 * transfer_done; checks each aux (tag = src * 16 + sink, length `aux_len(tag)`)
 * came whole and before its pair's transfer_done, and that no aux or
 * transfer_done of room `bad` (if its id is not 0) was seen. */
static void read_pairs(struct kvf_rpc_client_stream *cs, kvf_room_key k, struct pair_seen *seen,
                       size_t want, size_t (*aux_len)(uint32_t tag), kvf_room_key bad)
{
    size_t done = 0;
    while (done < want) {
        Kvfence__V1__NodeEvent *ev = watch_must(cs);
        if (bad.room_id && ev_room(ev, bad) &&
            ev->event_case != KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE)
            fail_msg("an event (%d) of the aborted room reached Watch", (int)ev->event_case);
        if (ev_room(ev, k) && ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_AUX) {
            uint32_t tag = ev->aux->source_rank * 16 + ev->aux->sink_rank;
            assert_true(tag < 64);
            assert_false(seen[tag].aux);
            assert_false(seen[tag].done);
            check_aux(ev, aux_len(tag), tag);
            seen[tag].aux = true;
        }
        if (ev_room(ev, k) && ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE) {
            uint32_t tag = ev->transfer_done->source_rank * 16 + ev->transfer_done->sink_rank;
            assert_true(tag < 64);
            assert_false(seen[tag].done);
            assert_string_equal(ev->transfer_done->source_node_id, "n1");
            seen[tag].done = true;
            seen[tag].done_ok = ev->transfer_done->ok;
            done++;
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
}

static size_t aux_len_3000(uint32_t tag)
{
    return 3000 + tag;
}

/* ---- tests ----------------------------------------------------------------------- */

static void test_aux_reaches_sink_watch_then_room_completes(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    kvf_room_key k = room_pair(f, 101, 16, 8);
    struct kvf_rpc_client_stream *w2 = watch_open(&f->n2, NULL, 0, NULL, 0, false);
    struct kvf_rpc_client_stream *w1 = watch_open(&f->n1, NULL, 0, NULL, 0, true);
    watch_sync(w2, k); /* ACTIVE, lifetime OPEN */
    watch_sync(w1, k);

    uint8_t aux[3000];
    fill_aux(aux, sizeof aux, 0);
    struct chunk c1 = {0, 1, 16, 0, 16, 4, false, NULL, 0};
    struct chunk c2 = {0, 2, 20, 0, 20, 4, true, aux, sizeof aux};
    submit_ok(f, k, &c1);
    submit_ok(f, k, &c2);

    /* n2: aux, then transfer_done ok. */
    struct pair_seen seen[64] = {{0}};
    while (!seen[0].done) {
        Kvfence__V1__NodeEvent *ev = watch_must(w2);
        assert_true(ev_room(ev, k));
        if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_AUX) {
            assert_false(seen[0].aux);
            assert_int_equal(ev->aux->source_rank, 0);
            assert_int_equal(ev->aux->sink_rank, 0);
            check_aux(ev, sizeof aux, 0);
            seen[0].aux = true;
        } else if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE) {
            assert_true(seen[0].aux);
            assert_true(ev->transfer_done->ok);
            assert_string_equal(ev->transfer_done->source_node_id, "n1");
            seen[0].done = true;
            /* ok promises every chunk arrived: the pages hold n1's bytes now. */
            for (uint32_t pg = 16; pg < 24; pg++)
                for (uint32_t i = 0; i < PAGE_SIZE; i++)
                    if (f->p2.mem[(size_t)pg * PAGE_SIZE + i] != nh_canary1(pg, i))
                        fail_msg("transfer_done before n2 page %u byte %u landed", pg, i);
        } else {
            fail_msg("unexpected event %d on n2", (int)ev->event_case);
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
        for (uint32_t i = 0; i < PAGE_SIZE; i += 97) {
            uint8_t want = pg >= 16 && pg < 24 ? nh_canary1(pg, i) : nh_canary2(pg, i);
            if (f->p2.mem[(size_t)pg * PAGE_SIZE + i] != want)
                fail_msg("n2 page %u byte %u differs", pg, i);
        }
    /* n2's lifetime drains after its Completed: the last room_state. */
    for (;;) {
        Kvfence__V1__NodeEvent *ev = watch_must(w2);
        bool drained =
            ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE &&
            ev->room_state->lifetime == KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_DRAINED;
        assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        kvfence__v1__node_event__free_unpacked(ev, NULL);
        if (drained)
            break;
    }
    /* n1 (include_chunks): both chunks done ok, in order. */
    uint64_t next_seq = 1;
    while (next_seq <= 2) {
        Kvfence__V1__NodeEvent *ev = watch_must(w1);
        if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE) {
            assert_int_equal(ev->chunk_done->chunk_seq, next_seq);
            assert_true(ev->chunk_done->ok);
            next_seq++;
        } else {
            assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    kvf_rpc_client_stream_close(w1);
    kvf_rpc_client_stream_close(w2);
}

static void test_tp_fan_in_and_fan_out_aux_per_pair(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    uint8_t aux[4][3100];

    /* Fan-in: n1 ranks 0 and 1 feed n2 rank 0 (pages [0, 8)). */
    kvf_room_key a = join(f, 201, 2, 1, "n1", 0, SOURCE, f->p1.pool_id, 0, 4);
    join(f, 201, 2, 1, "n1", 1, SOURCE, f->p1.pool_id, 4, 4);
    join(f, 201, 2, 1, "n2", 0, SINK, f->p2.pool_id, 0, 8);
    nh_wait_room_state(f->ch, a, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, a);
    wait_node_knows(f, &f->n2, a);
    kvf_room_key wa[1] = {{a.room_id, 0}}; /* any generation of the id */
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, wa, 1, NULL, 0, false);
    watch_sync(w, a);
    fill_aux(aux[0], aux_len_3000(0), 0);
    fill_aux(aux[1], aux_len_3000(16), 16);
    struct chunk ca0 = {0, 1, 0, 0, 0, 4, true, aux[0], aux_len_3000(0)};
    struct chunk ca1 = {1, 1, 4, 0, 4, 4, true, aux[1], aux_len_3000(16)};
    submit_ok(f, a, &ca0);
    submit_ok(f, a, &ca1);
    struct pair_seen seen[64] = {{0}};
    read_pairs(w, a, seen, 2, aux_len_3000, (kvf_room_key){0, 0});
    assert_true(seen[0].aux && seen[0].done_ok && seen[16].aux && seen[16].done_ok);
    nh_wait_room_state(f->ch, a, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kvf_rpc_client_stream_close(w);

    /* Fan-out: n1 rank 0 feeds n2 ranks 0 and 1 (pages [16, 24)). Every pair
     * is opened before any last chunk: a source completes once every pair it
     * opened ended. */
    kvf_room_key b = join(f, 202, 1, 2, "n1", 0, SOURCE, f->p1.pool_id, 16, 8);
    join(f, 202, 1, 2, "n2", 0, SINK, f->p2.pool_id, 16, 4);
    join(f, 202, 1, 2, "n2", 1, SINK, f->p2.pool_id, 20, 4);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, b);
    wait_node_knows(f, &f->n2, b);
    struct kvf_rpc_client_stream *wall = watch_open(&f->n2, &b, 1, NULL, 0, false);
    uint32_t rank1[1] = {1};
    struct kvf_rpc_client_stream *w1 = watch_open(&f->n2, &b, 1, rank1, 1, false);
    watch_sync(wall, b);
    watch_sync(w1, b);
    fill_aux(aux[2], aux_len_3000(0), 0);
    fill_aux(aux[3], aux_len_3000(1), 1);
    struct chunk cb[4] = {
        {0, 1, 16, 0, 16, 2, false, NULL, 0},
        {0, 1, 20, 1, 20, 2, false, NULL, 0},
        {0, 2, 18, 0, 18, 2, true, aux[2], aux_len_3000(0)},
        {0, 2, 22, 1, 22, 2, true, aux[3], aux_len_3000(1)},
    };
    for (int i = 0; i < 4; i++)
        submit_ok(f, b, &cb[i]);
    memset(seen, 0, sizeof seen);
    read_pairs(wall, b, seen, 2, aux_len_3000, (kvf_room_key){0, 0});
    assert_true(seen[0].aux && seen[0].done_ok && seen[1].aux && seen[1].done_ok);
    /* The ranks filter: only sink rank 1's aux and transfer_done. */
    memset(seen, 0, sizeof seen);
    read_pairs(w1, b, seen, 1, aux_len_3000, (kvf_room_key){0, 0});
    assert_true(seen[1].aux && seen[1].done_ok);
    assert_false(seen[0].aux || seen[0].done);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kvf_rpc_client_stream_close(wall);
    kvf_rpc_client_stream_close(w1);
}

/* n1's 1st peer message is held until 2 more went to n2: room A's aux is
 * held, its status arrives first (a sequence gap: n2 reports TransferFailed,
 * the room aborts); the held aux arrives after the abort (late: dropped). */
static void test_lost_message_fails_room_and_late_aux_is_dropped(void **state)
{
    struct fx *f = *state;
    fx_start(f, "delay_nth=1,delay_after=2");
    kvf_room_key a = room_pair(f, 301, 0, 4);
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, NULL, 0, NULL, 0, false);
    watch_sync(w, a);
    uint8_t aux_a[3000];
    fill_aux(aux_a, sizeof aux_a, 0);
    struct chunk ca = {0, 1, 0, 0, 0, 4, true, aux_a, sizeof aux_a};
    submit_ok(f, a, &ca);
    int reason = nh_wait_room_state(f->ch, a, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);

    kvf_room_key b = room_pair(f, 302, 8, 4);
    uint8_t aux_b[3000];
    fill_aux(aux_b, sizeof aux_b, 0);
    struct chunk cbk = {0, 1, 8, 0, 8, 4, true, aux_b, sizeof aux_b};
    submit_ok(f, b, &cbk);
    /* Wire order: A status, B aux, A aux (late), B status. */
    struct pair_seen seen[64] = {{0}};
    read_pairs(w, b, seen, 1, aux_len_3000, a);
    assert_true(seen[0].aux && seen[0].done_ok);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kvf_rpc_client_stream_close(w);
}

/* Room A's status (n1's 1st peer message) is held past an engine abort of A;
 * it reaches n2 between room B's aux and status, and is dropped as late. */
static void test_status_after_abort_is_dropped(void **state)
{
    struct fx *f = *state;
    fx_start(f, "delay_nth=1,delay_after=1");
    kvf_room_key a = room_pair(f, 401, 0, 4);
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, NULL, 0, NULL, 0, false);
    struct kvf_rpc_client_stream *w1 = watch_open(&f->n1, NULL, 0, NULL, 0, true);
    watch_sync(w, a);
    watch_sync(w1, a);
    struct chunk ca = {0, 1, 0, 0, 0, 4, true, NULL, 0};
    submit_ok(f, a, &ca);
    /* Once n1's chunk_done is out, A's status went to the channel (held):
     * n1 decides both in one step. The sink has the bytes but not the
     * status, so A cannot complete; the engine aborts it. */
    for (bool chunk_done = false; !chunk_done;) {
        Kvfence__V1__NodeEvent *ev = watch_must(w1);
        chunk_done = ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE;
        if (chunk_done)
            assert_true(ev->chunk_done->ok);
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    kvf_rpc_client_stream_close(w1);
    nh_abort_room(f->ch, a, "test abort");
    nh_wait_room_state(f->ch, a, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);

    kvf_room_key b = room_pair(f, 402, 8, 4);
    uint8_t aux_b[3000];
    fill_aux(aux_b, sizeof aux_b, 0);
    struct chunk cbk = {0, 1, 8, 0, 8, 4, true, aux_b, sizeof aux_b};
    submit_ok(f, b, &cbk);
    struct pair_seen seen[64] = {{0}};
    read_pairs(w, b, seen, 1, aux_len_3000, a);
    assert_true(seen[0].aux && seen[0].done_ok);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kvf_rpc_client_stream_close(w);
}

/* The two nodes introduced by an earlier room (aborted at once), so that
 * n2 admits n1's connections before the room under test. */
static void introduce(struct fx *f, uint64_t room_id)
{
    kvf_room_key intro = room_pair(f, room_id, PAGE_COUNT - 1, 1);
    nh_abort_room(f->ch, intro, "an introduction only");
    nh_wait_room_state(f->ch, intro, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
}

/* Room updates are ordered by the protocol, not by waits (docs/node.md,
 * "Ordered room updates"): n2 holds its RoomUpdates (fault hold_room_update),
 * so it has not acknowledged the room, and the control plane does not tell
 * n1 the sink's pages: n1 refuses the chunk as retryable (UNAVAILABLE) and
 * sends nothing, for as long as n2 holds. Once n2 applied its update, n1
 * learns the sink, the chunk goes, and the room completes. On the code
 * before this order n1 learned the sink at once, sent, and n2 waited up to
 * 2 s for its own update. */
static void test_held_sink_update_source_sends_nothing(void **state)
{
    struct fx *f = *state;
    fx_start_n2(f, NULL, NH_LOG_FILE | NH_FAULT_FILE);
    introduce(f, 1601);
    nh_set_faults(&f->n2, "hold_room_update=1\n", WAIT_MS);
    kvf_room_key k =
        nh_join_pair(f->ch, 601, "n1", f->p1.pool_id, 8, "n2", f->p2.pool_id, 8, 4, WAIT_MS);
    nh_wait_log(&f->n2, "fault: holding a RoomUpdate", NULL, 1, WAIT_MS);
    kvf_room_key wk[1] = {{k.room_id, 0}};
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, wk, 1, NULL, 0, false);
    uint8_t aux[3000];
    fill_aux(aux, sizeof aux, 0);
    struct chunk c = {0, 1, 8, 0, 8, 4, true, aux, sizeof aux};
    struct kvf_rpc_status st;
    /* Not a race: however long n2 holds, n1 does not know where to write. */
    int64_t until = nh_now_ms() + 500;
    int tries = 0;
    do {
        int code = submit(f, k, &c, &st);
        if (code != KVF_GRPC_UNAVAILABLE)
            fail_msg("SubmitChunk while n2 holds its RoomUpdate: %d %s (want UNAVAILABLE)", code,
                     st.message);
        tries++;
        nh_sleep_ms(20);
    } while (nh_now_ms() < until);
    assert_true(tries > 1);
    nh_set_faults(&f->n2, "", WAIT_MS); /* the held RoomUpdates go through */
    int code;
    int64_t end = nh_now_ms() + WAIT_MS;
    while ((code = submit(f, k, &c, &st)) == KVF_GRPC_UNAVAILABLE && nh_now_ms() < end)
        nh_sleep_ms(5);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk after n2 applied its update: %d %s", code, st.message);
    struct pair_seen seen[64] = {{0}};
    read_pairs(w, k, seen, 1, aux_len_3000, (kvf_room_key){0, 0});
    assert_true(seen[0].aux && seen[0].done_ok);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_check_pool(&f->p2, nh_canary2, 8, 4, nh_canary1, 8, "n2");
    assert_int_equal(nh_log_count(&f->n2, "peer channel: dropped a message", &k), 0);
    assert_int_equal(nh_log_count(&f->n2, "does not know", &k), 0);
    kvf_rpc_client_stream_close(w);
}

/* A node that breaks the order (fault ack_drop_room_update: it acknowledges
 * its RoomUpdates and drops them unapplied): the control plane tells n1 the
 * sink's pages, n1 sends, and n2 gets a frame and envelopes for a room it
 * does not know. That is a protocol violation: refused at once, nothing
 * lands, and n2 fails the room (TransferFailed) well before the 2 s that the
 * old code waited (after which it dropped a TCP frame silently and left the
 * room ACTIVE). */
static void test_frame_for_unknown_room_fails_room_at_once(void **state)
{
    struct fx *f = *state;
    fx_start_n2(f, NULL, NH_LOG_FILE | NH_FAULT_FILE);
    introduce(f, 1602);
    nh_set_faults(&f->n2, "ack_drop_room_update=100\n", WAIT_MS);
    kvf_room_key k =
        nh_join_pair(f->ch, 602, "n1", f->p1.pool_id, 8, "n2", f->p2.pool_id, 8, 4, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    uint8_t aux[3000];
    fill_aux(aux, sizeof aux, 0);
    struct chunk c = {0, 1, 8, 0, 8, 4, true, aux, sizeof aux};
    int64_t t0 = nh_now_ms();
    submit_ok(f, k, &c);
    int reason = nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);
    int64_t took = nh_now_ms() - t0;
    if (took >= 2000)
        fail_msg("the room failed %lld ms after the submit: not at once", (long long)took);
    assert_true(nh_log_count(&f->n2, "for a room this node does not know", &k) > 0);
    nh_check_pool(&f->p2, nh_canary2, 0, 0, nh_canary1, 0, "n2");
}

/* A node that cannot open a room for its RoomUpdate (fault refuse_room_open:
 * the lifetime table refuses, as when out of memory) fails the room through
 * the token path: TransferFailed, the control plane aborts the room, both
 * nodes drain (n2 opens the lifetime for the abort notice) and every lease is
 * released. Before, n2 acknowledged the notice and sent no RoomUpdateAck, so
 * n2's members were never published to n1 and the room stayed ACTIVE until
 * someone aborted it. Nothing landed. */
static void test_refused_room_open_fails_room(void **state)
{
    struct fx *f = *state;
    fx_start_n2(f, NULL, NH_LOG_FILE | NH_FAULT_FILE);
    introduce(f, 1603);
    nh_set_faults(&f->n2, "refuse_room_open=1\n", WAIT_MS);
    /* Not nh_join_pair: the room may fail before anyone sees it ACTIVE. */
    kvf_room_key k = join(f, 603, 1, 1, "n1", 0, SOURCE, f->p1.pool_id, 8, 4);
    kvf_room_key k2 = join(f, 603, 1, 1, "n2", 0, SINK, f->p2.pool_id, 8, 4);
    assert_true(k.room_id == k2.room_id && k.generation == k2.generation);
    nh_wait_log(&f->n2, "fault: refused to open a room", NULL, 1, WAIT_MS);
    int64_t t0 = nh_now_ms();
    int st = KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE;
    while (nh_now_ms() - t0 < 5000 && (st = nh_room_state(f->ch, k, NULL, NULL)) !=
                                          KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED)
        nh_sleep_ms(20);
    if (st != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED)
        fail_msg("room %llu:%llu is in state %d 5 s after n2 refused to open it: not aborted",
                 (unsigned long long)k.room_id, (unsigned long long)k.generation, st);
    int reason = nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);
    assert_true(nh_log_count(&f->n2, "cannot open lifetime", &k) > 0);
    nh_check_pool(&f->p2, nh_canary2, 0, 0, nh_canary1, 0, "n2");
}

#define MT_THREADS 8
#define MT_ROOMS   32 /* 2 pages each */

struct mt {
    struct fx *f;
    kvf_room_key rooms[MT_ROOMS];
    int thread;
    int code;
    char msg[300];
};

static size_t mt_aux_len(uint32_t room)
{
    return 1000 + (room * 523u) % 60000u;
}

static void *mt_main(void *arg)
{
    struct mt *m = arg;
    for (int i = m->thread; i < MT_ROOMS; i += MT_THREADS) {
        size_t len = mt_aux_len((uint32_t)i);
        uint8_t *aux = malloc(len);
        if (!aux) {
            m->code = -1;
            return NULL;
        }
        fill_aux(aux, len, (uint32_t)i);
        uint32_t pg = 2u * (uint32_t)i;
        struct chunk c1 = {0, 1, pg, 0, pg, 1, false, NULL, 0};
        struct chunk c2 = {0, 2, pg + 1, 0, pg + 1, 1, true, aux, len};
        struct kvf_rpc_status st;
        int code = submit(m->f, m->rooms[i], &c1, &st);
        if (code == KVF_GRPC_OK)
            code = submit(m->f, m->rooms[i], &c2, &st);
        free(aux);
        if (code != KVF_GRPC_OK) {
            m->code = code;
            snprintf(m->msg, sizeof m->msg, "room %d: %s", i, st.message);
            return NULL;
        }
    }
    return NULL;
}

static void test_many_threads_every_aux_whole_and_in_order(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    static struct mt ms[MT_THREADS];
    kvf_room_key rooms[MT_ROOMS];
    for (uint32_t i = 0; i < MT_ROOMS; i++)
        rooms[i] = room_pair(f, 1000 + i, 2 * i, 2);
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, NULL, 0, NULL, 0, false);
    watch_sync(w, rooms[0]); /* the other rooms' snapshot events are skipped below */
    pthread_t th[MT_THREADS];
    for (int t = 0; t < MT_THREADS; t++) {
        memset(&ms[t], 0, sizeof ms[t]);
        ms[t].f = f;
        ms[t].thread = t;
        memcpy(ms[t].rooms, rooms, sizeof rooms);
        assert_int_equal(pthread_create(&th[t], NULL, mt_main, &ms[t]), 0);
    }
    for (int t = 0; t < MT_THREADS; t++)
        pthread_join(th[t], NULL);
    for (int t = 0; t < MT_THREADS; t++)
        if (ms[t].code != 0)
            fail_msg("thread %d: SubmitChunk %d: %s", t, ms[t].code, ms[t].msg);
    bool aux_seen[MT_ROOMS] = {false}, done_seen[MT_ROOMS] = {false};
    int done = 0;
    while (done < MT_ROOMS) {
        Kvfence__V1__NodeEvent *ev = watch_must(w);
        uint64_t i = ev->room->room_id - 1000;
        assert_true(i < MT_ROOMS);
        assert_int_equal(ev->room->generation, rooms[i].generation);
        if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_AUX) {
            assert_false(aux_seen[i]);
            assert_false(done_seen[i]);
            check_aux(ev, mt_aux_len((uint32_t)i), (uint32_t)i);
            aux_seen[i] = true;
        } else if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE) {
            if (!aux_seen[i])
                fail_msg("room %llu: transfer_done before its aux", (unsigned long long)i);
            assert_false(done_seen[i]);
            assert_true(ev->transfer_done->ok);
            done_seen[i] = true;
            done++;
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    for (uint32_t i = 0; i < MT_ROOMS; i++)
        nh_wait_room_state(f->ch, rooms[i], KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kvf_rpc_client_stream_close(w);
}

static void expect_watch_refused(struct nh_node *np, const kvf_room_key *rooms, size_t nrooms,
                                 const uint32_t *ranks, size_t nranks, const char *field)
{
    struct kvf_rpc_client_stream *cs = watch_open(np, rooms, nrooms, ranks, nranks, false);
    struct kvf_rpc_status st;
    Kvfence__V1__NodeEvent *ev = watch_next(cs, WAIT_MS, &st);
    if (ev)
        fail_msg("watch with a bad %s sent an event", field);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    if (!strstr(st.message, field))
        fail_msg("message \"%s\" does not name %s", st.message, field);
    kvf_rpc_client_stream_close(cs);
}

static void test_watch_bad_filters_and_shutdown(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    kvf_room_key zero[2] = {{7, 0}, {0, 1}};
    expect_watch_refused(&f->n2, zero, 2, NULL, 0, "rooms[1].room_id");
    kvf_room_key huge[1] = {{(uint64_t)INT64_MAX + 1, 1}};
    expect_watch_refused(&f->n2, huge, 1, NULL, 0, "rooms[0].room_id");
    static uint32_t many[300];
    expect_watch_refused(&f->n2, NULL, 0, many, 300, "ranks");

    /* A room the watcher joins late: the snapshot gives its state. */
    kvf_room_key k = room_pair(f, 501, 0, 4);
    struct kvf_rpc_client_stream *w = watch_open(&f->n2, &k, 1, NULL, 0, false);
    Kvfence__V1__NodeEvent *ev = watch_must(w);
    assert_true(ev_room(ev, k));
    assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
    assert_int_equal(ev->room_state->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    kvfence__v1__node_event__free_unpacked(ev, NULL);
    /* An abort: ABORTING, then the drained lifetime. */
    nh_abort_room(f->ch, k, "test abort");
    bool aborting = false, drained = false;
    while (!drained) {
        ev = watch_must(w);
        assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        if (ev->room_state->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING) {
            assert_int_equal(ev->room_state->reason,
                             KVFENCE__V1__ABORT_REASON__ABORT_REASON_ENGINE);
            aborting = true;
        }
        drained = ev->room_state->lifetime == KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_DRAINED;
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    assert_true(aborting);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);

    /* The node's shutdown ends the stream with UNAVAILABLE; it exits 0. */
    kill(f->n2.pid, SIGTERM);
    struct kvf_rpc_status st;
    while ((ev = watch_next(w, WAIT_MS, &st)) != NULL) {
        assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    kvf_rpc_client_stream_close(w);
    int status = nh_node_stop(&f->n2, 8000);
    assert_true(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* The node serves at most 64 Watch streams: the 65th ends at once with
 * RESOURCE_EXHAUSTED naming the limit, the 64 keep their events, and once one
 * of them closes a new watcher is served again. */
static void test_watchers_bounded_per_node(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    enum { LIMIT = 64 };
    kvf_room_key k = room_pair(f, 701, 0, 4);
    struct kvf_rpc_client_stream *w[LIMIT];
    for (int i = 0; i < LIMIT; i++) {
        w[i] = watch_open(&f->n2, &k, 1, NULL, 0, false);
        watch_sync(w[i], k); /* registered: its snapshot came */
    }
    struct kvf_rpc_client_stream *extra = watch_open(&f->n2, &k, 1, NULL, 0, false);
    struct kvf_rpc_status st;
    Kvfence__V1__NodeEvent *ev = watch_next(extra, WAIT_MS, &st);
    if (ev)
        fail_msg("watcher %d was served (event %d)", LIMIT + 1, (int)ev->event_case);
    assert_int_equal(st.code, KVF_GRPC_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(st.message, "watchers: limit 64"));
    kvf_rpc_client_stream_close(extra);

    /* One leaves; its slot is free once the node saw the stream close. */
    kvf_rpc_client_stream_close(w[0]);
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        w[0] = watch_open(&f->n2, &k, 1, NULL, 0, false);
        ev = watch_next(w[0], WAIT_MS, &st);
        if (ev) {
            assert_true(ev_room(ev, k));
            kvfence__v1__node_event__free_unpacked(ev, NULL);
            break;
        }
        assert_int_equal(st.code, KVF_GRPC_RESOURCE_EXHAUSTED);
        kvf_rpc_client_stream_close(w[0]);
        if (nh_now_ms() > end)
            fail_msg("no Watch slot came free after a watcher closed");
        nh_sleep_ms(10);
    }
    /* Every watcher still gets live events: the abort's ABORTING. */
    nh_abort_room(f->ch, k, "test abort");
    for (int i = 0; i < LIMIT; i++) {
        bool aborting = false;
        while (!aborting) {
            ev = watch_must(w[i]);
            assert_true(ev_room(ev, k));
            aborting = ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE &&
                       ev->room_state->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING;
            kvfence__v1__node_event__free_unpacked(ev, NULL);
        }
    }
    for (int i = 0; i < LIMIT; i++)
        kvf_rpc_client_stream_close(w[i]);
}

/* The slow watcher: this executable run as "watch-child SOCKET", a separate
 * process so that the test can SIGSTOP it: stopped, its gRPC transport grants
 * no more flow-control window, and the node's sends to it stay queued. It
 * watches with include_chunks, says "ready" on stdout after its first event,
 * then reads to the end and exits with the stream's status code. */
static int watch_child(const char *sock)
{
    char target[200];
    snprintf(target, sizeof target, "unix:%s", sock);
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, NULL);
    if (!ch)
        return 100;
    Kvfence__V1__WatchRequest req = KVFENCE__V1__WATCH_REQUEST__INIT;
    req.include_chunks = true;
    uint8_t buf[16];
    size_t len = kvfence__v1__watch_request__pack(&req, buf);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(ch, "/kvfence.v1.NodeLocal/Watch", 120000);
    if (!cs || kvf_rpc_client_stream_send(cs, buf, len) != 0 ||
        kvf_rpc_client_stream_half_close(cs) != 0)
        return 101;
    size_t got = 0;
    struct kvf_rpc_status st;
    for (;;) {
        uint8_t *msg;
        size_t mlen;
        int rc = kvf_rpc_client_stream_recv(cs, 60000, &msg, &mlen, &st);
        if (rc != 0)
            break;
        free(msg);
        if (++got == 1) {
            printf("ready\n");
            fflush(stdout);
        }
    }
    fprintf(stderr, "watch-child: %zu events, then %d %s\n", got, st.code, st.message);
    int code = strstr(st.message, "slow") ? st.code : 102;
    kvf_rpc_client_stream_close(cs);
    kvf_rpc_channel_destroy(ch);
    return code;
}

/* A watcher that stops reading: once its unwritten events pass the node's
 * bound, its stream ends with RESOURCE_EXHAUSTED; the owner never waits for
 * it (every SubmitChunk is answered meanwhile) and the room still completes. */
static void test_slow_watcher_ends_with_resource_exhausted(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    kvf_room_key k = room_pair(f, 601, 0, 8);
    int out[2];
    assert_int_equal(pipe(out), 0);
    pid_t parent = getpid();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        dup2(out[1], 1);
        close(out[0]);
        close(out[1]);
        execl("/proc/self/exe", "test_node_peer", "watch-child", f->n1.sock, (char *)NULL);
        _exit(127);
    }
    close(out[1]);
    char line[16] = "";
    ssize_t r = read(out[0], line, sizeof line - 1); /* blocks until "ready" */
    close(out[0]);
    if (r <= 0 || strncmp(line, "ready", 5) != 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        fail_msg("watch child did not get ready");
    }
    kill(pid, SIGSTOP);
    enum { N = 2000 };
    for (uint32_t i = 1; i <= N; i++) {
        struct chunk c = {0, i, i % 8, 0, i % 8, 1, i == N, NULL, 0};
        submit_ok(f, k, &c);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    kill(pid, SIGCONT);
    int st = 0;
    int64_t end = nh_now_ms() + WAIT_MS;
    while (waitpid(pid, &st, WNOHANG) != pid) {
        if (nh_now_ms() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            fail_msg("watch child did not end");
        }
        nh_sleep_ms(10);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != KVF_GRPC_RESOURCE_EXHAUSTED)
        fail_msg("watch child: status 0x%x (want exit %d)", st, KVF_GRPC_RESOURCE_EXHAUSTED);
    /* n1 must still exit 0 on SIGTERM (after up to 10 s: see teardown). */
    st = nh_node_stop(&f->n1, 20000);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("n1 did not exit 0 on SIGTERM (status %d)", st);
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "watch-child") == 0)
        return watch_child(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_aux_reaches_sink_watch_then_room_completes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_tp_fan_in_and_fan_out_aux_per_pair, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lost_message_fails_room_and_late_aux_is_dropped, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_status_after_abort_is_dropped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_held_sink_update_source_sends_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_frame_for_unknown_room_fails_room_at_once, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_refused_room_open_fails_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_many_threads_every_aux_whole_and_in_order, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_watch_bad_filters_and_shutdown, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watchers_bounded_per_node, setup, teardown),
        cmocka_unit_test_setup_teardown(test_slow_watcher_ends_with_resource_exhausted, setup,
                                        teardown),
    };
    if (getenv("KVF_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVF_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
