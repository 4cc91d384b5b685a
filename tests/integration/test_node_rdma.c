/*
 * test_node_rdma.c: kvfence-node's RDMA data path end to end, with real
 * processes on 127.0.0.1: one kvfence-control and two kvfence-node (n1,
 * source; n2, sink) started with --rdma fake (the fake verbs fabric, which
 * really moves the RDMA WRITE bytes between the two processes over Unix
 * sockets and checks rkeys, bounds and QP states like an RC responder) on a
 * fabric name unique to the test run, each with its log in a file and a
 * --fault-file (rdma_hold=1 holds the posted writes in flight).
 *
 * What is checked: a multi-chunk room lands byte-exact over RDMA (proof: the
 * sink's Watch shows a chunk_done per chunk, which only an RDMA ChunkNotice
 * produces on a sink node, and the counters both nodes log at exit name the
 * writes, notices and bytes), aux exact, the room COMPLETED and its leases
 * RELEASED once, canaries after the release; a peer with --rdma off gets TCP
 * and the room still lands byte-exact; an abort while RDMA writes are held:
 * no release until they were let go and completed, then exactly once; a
 * kill -9 of the source with writes outstanding: the sink fences it (its QPs
 * to ERR), the room ABORTED and released, nothing landed; a fence of the live
 * source (Admin.FenceNode) sends it LinkClose and nothing of it lands after;
 * one QP held (rdma_hold_odd=1) does not stop a room on the other QP (the
 * per-QP slice FIFOs); and the rest named at each test. The lease watch and
 * the log and fault-file helpers are node_harness.c's.
 *
 * The first chunk towards a peer goes over TCP while the RDMA link is set up
 * (docs/node.md); each test first runs a warm-up room and waits for the link
 * in both logs. Waits are on observed state with timeouts.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS    15000
#define PAGE_SIZE  4096u
#define PAGE_COUNT 64u

#define SEED_N1 11u
#define SEED_N2 77u

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    char fabric[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2, p3, p4;
    struct nh_watch w; /* WatchLeases: the releases of every lease */
};

/* ---- logs (the harness reads them too: nh_wait_log)
 * ----------------------------------------------------------------- */

/* The value of `key` ("notices_in=") in the node's "rdma stats:" line (logged
 * at exit); -1 when there is none. */
static long long rdma_stat(const struct nh_node *np, const char *key)
{
    FILE *fp = fopen(np->log, "r");
    if (!fp)
        return -1;
    char line[4096];
    long long v = -1;
    while (fgets(line, sizeof line, fp)) {
        if (!strstr(line, "rdma stats:"))
            continue;
        const char *p = strstr(line, key);
        if (p)
            v = strtoll(p + strlen(key), NULL, 10);
    }
    fclose(fp);
    return v;
}

/* ---- fixture ------------------------------------------------------------------------- */

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    nh_watch_close(&f->w);
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    struct nh_pool *pools[] = {&f->p1, &f->p2, &f->p3, &f->p4};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 20000, pools, 4, f->dir);
    free(f);
    return rc;
}

/* n2_rdma: "fake" or "off". */
static void fx_start(struct fx *f, const char *n2_rdma)
{
    static unsigned runs;
    /* A fabric of this run only: parallel tests never meet. */
    snprintf(f->fabric, sizeof f->fabric, "kvft-%d-%u", (int)getpid(), runs++);
    const char *args[] = {"--threads",   "2",  "--node-ttl-ms",          "1500",
                          "--resend-ms", "50", "--heartbeat-timeout-ms", "2500",
                          NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "rdma");
    const char *a1[] = {"--rdma", "fake", "--rdma-fabric", f->fabric, NULL};
    const char *a2[] = {"--rdma", n2_rdma, "--rdma-fabric", f->fabric, NULL};
    unsigned fl = NH_LOG_FILE | NH_FAULT_FILE;
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, a1, fl), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, a2, fl), 0);
    nh_wait_log(&f->n1, "RDMA on: fake:", NULL, 1, WAIT_MS);
    assert_int_equal(nh_pool_create(&f->p1, "rdma", "n1", PAGE_SIZE, PAGE_COUNT, NULL), 0);
    assert_int_equal(nh_pool_create(&f->p2, "rdma", "n2", PAGE_SIZE, PAGE_COUNT, NULL), 0);
    nh_seed_fill(&f->p1, 0, PAGE_COUNT, SEED_N1);
    nh_seed_fill(&f->p2, 0, PAGE_COUNT, SEED_N2);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
    nh_watch_open(&f->w, f->ch, WAIT_MS);
}

/* ---- rooms and chunks ------------------------------------------------------------------ */

static kvf_room_key join_pair(struct fx *f, uint64_t room_id, uint32_t sfirst, uint32_t dfirst,
                              uint32_t count)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, sfirst, "n2", f->p2.pool_id,
                                  dfirst, count, WAIT_MS);
    nh_wait_log(&f->n2, "room update", &k, 1, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, dfirst, WAIT_MS);
    return k;
}

static void submit_ok(struct fx *f, kvf_room_key k, uint64_t seq, uint32_t sfirst, uint32_t dfirst,
                      uint32_t count, bool last, const uint8_t *aux, size_t aux_len)
{
    struct nh_chunk c = {.source_rank = 0,
                         .seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_pool = f->p2.pool_id,
                         .n = 1,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = last,
                         .aux = aux,
                         .aux_len = aux_len};
    struct kvf_rpc_status st;
    int code = nh_submit(f->n1.local, k, &c, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk %llu: %d %s", (unsigned long long)seq, code, st.message);
}

/* The only chunk (seq 1, last) of a room: pages [sfirst, +count) of n1's
 * `src_pool` -> pages [dfirst, +count) of `sink_pool` on `sink_node`. The
 * status code. */
static int submit_one(struct fx *f, kvf_room_key k, uint32_t src_pool, const char *sink_node,
                      uint32_t sink_pool, uint32_t sfirst, uint32_t dfirst, uint32_t count,
                      struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.seq = 1,
                         .source_pool = src_pool,
                         .sink_node = sink_node,
                         .sink_pool = sink_pool,
                         .n = 1,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = true};
    return nh_submit(f->n1.local, k, &c, st);
}

static void submit_one_ok(struct fx *f, kvf_room_key k, uint32_t src_pool, const char *sink_node,
                          uint32_t sink_pool, uint32_t sfirst, uint32_t dfirst, uint32_t count)
{
    struct kvf_rpc_status st;
    int code = submit_one(f, k, src_pool, sink_node, sink_pool, sfirst, dfirst, count, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
}

/* A one-chunk room n1 [s, +count) -> n2 [d, +count) that completes and lands. */
static void room_lands(struct fx *f, uint64_t room_id, uint32_t s, uint32_t d, uint32_t count,
                       uint32_t seed)
{
    nh_seed_fill(&f->p1, s, count, seed);
    kvf_room_key k = join_pair(f, room_id, s, d, count);
    submit_ok(f, k, 1, s, d, count, true, NULL, 0);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, d, count, seed, s);
}

/* The first chunk to n2 goes over TCP and opens the RDMA link: waits for it. */
static void warm_up_link(struct fx *f, uint64_t room_id)
{
    room_lands(f, room_id, 60, 60, 4, 5);
    nh_wait_log(&f->n1, "rdma link to n2 incarnation", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n1, "up (initiator)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 1, WAIT_MS);
}

/* Both nodes up, the link warmed up by room `room_id`, then fault rdma_hold=1
 * at n1: the RDMA writes it posts from now on stay in flight. */
static void start_linked_held(struct fx *f, uint64_t room_id)
{
    fx_start(f, "fake");
    warm_up_link(f, room_id);
    nh_set_faults(&f->n1, "rdma_hold=1\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: rdma writes held", NULL, 1, WAIT_MS);
}

/* ---- NodeLocal.Watch on the sink -------------------------------------------------------- */

static struct kvf_rpc_client_stream *nwatch_open_ex(struct nh_node *np, kvf_room_key k, bool chunks)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__RoomKey *rkp = &rk;
    Kvfence__V1__WatchRequest req = KVFENCE__V1__WATCH_REQUEST__INIT;
    req.n_rooms = 1;
    req.rooms = &rkp;
    req.include_chunks = chunks;
    uint8_t buf[128];
    size_t len = kvfence__v1__watch_request__pack(&req, buf);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(np->local, "/kvfence.v1.NodeLocal/Watch", 120000);
    assert_non_null(cs);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    return cs;
}

static struct kvf_rpc_client_stream *nwatch_open(struct nh_node *np, kvf_room_key k)
{
    return nwatch_open_ex(np, k, true);
}

static Kvfence__V1__NodeEvent *nwatch_must(struct kvf_rpc_client_stream *cs)
{
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    if (rc != 0)
        fail_msg("watch: no event (%d %s)", rc, rc == KVF_RPC_STREAM_END ? st.message : "");
    Kvfence__V1__NodeEvent *ev = kvfence__v1__node_event__unpack(NULL, len, msg);
    free(msg);
    assert_non_null(ev);
    return ev;
}

static void nwatch_close(struct kvf_rpc_client_stream *cs)
{
    kvf_rpc_client_stream_cancel(cs);
    kvf_rpc_client_stream_close(cs);
}

/* Waits for the room_state ACTIVE of the watched room: live events follow.
 * The snapshot may say OPENING first: the node hears that every participant
 * is published in a later RoomUpdate than the one that opened the room, and
 * JoinRoom's reply can reach the test before it. */
static void nwatch_sync(struct kvf_rpc_client_stream *cs)
{
    for (;;) {
        Kvfence__V1__NodeEvent *ev = nwatch_must(cs);
        assert_int_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE);
        Kvfence__V1__RoomState st = ev->room_state->state;
        kvfence__v1__node_event__free_unpacked(ev, NULL);
        if (st == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE)
            return;
        assert_int_equal(st, KVFENCE__V1__ROOM_STATE__ROOM_STATE_OPENING);
    }
}

/* Reads events until `n` chunk_done, seqs 1..n in order, each ok and with
 * `transport` (how the bytes travelled). */
static void nwatch_chunks(struct kvf_rpc_client_stream *cs, unsigned n, int transport)
{
    unsigned seen = 0;
    while (seen < n) {
        Kvfence__V1__NodeEvent *ev = nwatch_must(cs);
        if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE) {
            assert_true(ev->chunk_done->ok);
            assert_int_equal(ev->chunk_done->chunk_seq, seen + 1);
            assert_int_equal(ev->chunk_done->transport, transport);
            seen++;
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
}

/* The "watch stats:" value of `key` logged at exit; -1 when none. */
static long long watch_stat(const struct nh_node *np, const char *key)
{
    FILE *fp = fopen(np->log, "r");
    if (!fp)
        return -1;
    char line[4096];
    long long v = -1;
    while (fgets(line, sizeof line, fp)) {
        const char *p = strstr(line, "watch stats:");
        if (p && (p = strstr(p, key)) != NULL)
            v = strtoll(p + strlen(key), NULL, 10);
    }
    fclose(fp);
    return v;
}

static void fill_aux(uint8_t *buf, size_t len)
{
    for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)(i * 13u + (i >> 8) + 3u);
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_rdma_room_lands_byte_exact(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 100);

    /* 40 pages in three chunks: 20 pages (two slices: 64 KiB + 16 KiB), 12
     * and 8 (one slice each), the last with aux bytes. */
    kvf_room_key k = join_pair(f, 101, 8, 8, 40);
    struct kvf_rpc_client_stream *w2 = nwatch_open(&f->n2, k);
    nwatch_sync(w2);
    struct kvf_rpc_client_stream *w1 = nwatch_open(&f->n1, k);
    nwatch_sync(w1);
    uint8_t aux[3000];
    fill_aux(aux, sizeof aux);
    submit_ok(f, k, 1, 8, 8, 20, false, NULL, 0);
    submit_ok(f, k, 2, 28, 28, 12, false, NULL, 0);
    submit_ok(f, k, 3, 40, 40, 8, true, aux, sizeof aux);

    /* The sink's chunk_done events come only from RDMA ChunkNotices. */
    unsigned chunks = 0;
    bool aux_seen = false, done = false;
    while (!done) {
        Kvfence__V1__NodeEvent *ev = nwatch_must(w2);
        switch (ev->event_case) {
        case KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE:
            assert_true(ev->chunk_done->ok);
            assert_false(aux_seen);
            assert_int_equal(ev->chunk_done->chunk_seq, chunks + 1);
            assert_int_equal(ev->chunk_done->transport,
                             KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
            chunks++;
            break;
        case KVFENCE__V1__NODE_EVENT__EVENT_AUX:
            assert_int_equal(chunks, 3);
            assert_int_equal(ev->aux->data.len, sizeof aux);
            assert_memory_equal(ev->aux->data.data, aux, sizeof aux);
            aux_seen = true;
            break;
        case KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE:
            assert_true(ev->transfer_done->ok);
            assert_true(aux_seen);
            done = true;
            break;
        default:
            break;
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    nwatch_close(w2);
    /* The source's events name the transport too. */
    nwatch_chunks(w1, 3, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 8, 40, SEED_N1, 8);
    nh_seed_check(&f->p2, 0, 8, SEED_N2, 0);
    nh_seed_check(&f->p2, 48, 12, SEED_N2, 48);

    /* The engine owns the pages again: nothing of the room lands later. */
    nh_seed_fill(&f->p2, 8, 40, 303);
    room_lands(f, 102, 48, 48, 8, 304); /* over RDMA too */
    nh_seed_check(&f->p2, 8, 40, 303, 8);

    /* The counters at exit: 4 RDMA chunks (5 slices, 48 pages) went n1 -> n2. */
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 4);
    assert_int_equal(rdma_stat(&f->n1, "wrs_ok="), 5);
    assert_int_equal(rdma_stat(&f->n1, "wrs_error="), 0);
    assert_int_equal(rdma_stat(&f->n1, "fabric_bytes_out="), 48 * PAGE_SIZE);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 4);
    assert_int_equal(rdma_stat(&f->n2, "notice_bytes_in="), 48 * PAGE_SIZE);
    assert_int_equal(rdma_stat(&f->n2, "fabric_writes_in="), 5);
    assert_int_equal(rdma_stat(&f->n2, "fabric_bytes_in="), 48 * PAGE_SIZE);
    assert_int_equal(rdma_stat(&f->n2, "notices_refused="), 0);
}

static void test_rdma_off_peer_gets_tcp(void **state)
{
    struct fx *f = *state;
    fx_start(f, "off");
    nh_wait_log(&f->n2, "RDMA off: --rdma off", NULL, 1, WAIT_MS);
    kvf_room_key k = join_pair(f, 201, 0, 16, 24);
    struct kvf_rpc_client_stream *w1 = nwatch_open(&f->n1, k);
    nwatch_sync(w1);
    submit_ok(f, k, 1, 0, 16, 16, false, NULL, 0);
    submit_ok(f, k, 2, 16, 32, 8, true, NULL, 0);
    nwatch_chunks(w1, 2, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 16, 24, SEED_N1, 0);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
    nh_seed_check(&f->p2, 40, 24, SEED_N2, 40);
    /* A watcher without include_chunks: the chunk's event is not even packed. */
    kvf_room_key k2 = join_pair(f, 202, 48, 48, 8);
    struct kvf_rpc_client_stream *w1b = nwatch_open_ex(&f->n1, k2, false);
    nwatch_sync(w1b);
    nh_seed_fill(&f->p1, 48, 8, 305);
    submit_ok(f, k2, 1, 48, 48, 8, true, NULL, 0);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, 48, 8, 305, 48);
    nwatch_close(w1b);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "links_up="), 0);
    assert_int_equal(rdma_stat(&f->n1, "wrs_posted="), 0);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), -1); /* no RDMA at all there */
    assert_int_equal(nh_log_count(&f->n1, "rdma link to", NULL), 0);
    assert_int_equal(watch_stat(&f->n1, "chunk_done="), 3);
    assert_int_equal(watch_stat(&f->n1, "chunk_done_packed="), 2); /* room 202's: not packed */
}

static void test_rdma_abort_with_writes_held(void **state)
{
    struct fx *f = *state;
    start_linked_held(f, 300);

    kvf_room_key k = join_pair(f, 301, 0, 16, 24);
    submit_ok(f, k, 1, 0, 16, 24, true, NULL, 0); /* two slices, posted and held */
    nh_abort_room(f->ch, k, "rdma test abort");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, WAIT_MS);
    nh_wait_log(&f->n2, "drained", &k, 1, WAIT_MS);
    nh_wait_log(&f->n1, "abort notice", &k, 1, WAIT_MS);
    assert_int_equal(nh_log_count(&f->n1, "drained", &k), 0);
    nh_watch_none_released(&f->w, f->ch, k, "RDMA writes are held");
    nh_seed_check(&f->p2, 0, PAGE_COUNT - 4, SEED_N2, 0); /* the writes are held at n1 */

    /* Let go: the writes complete (into the sink lease, still held), then
     * n1 drains and the leases are released once. */
    nh_set_faults(&f->n1, "rdma_hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: rdma writes released", NULL, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
    nh_seed_check(&f->p2, 40, 20, SEED_N2, 40);

    /* The engine owns the pages again: a following room lands, they stay. */
    nh_seed_fill(&f->p2, 16, 24, 306);
    room_lands(f, 302, 48, 48, 8, 307);
    nh_seed_check(&f->p2, 16, 24, 306, 16);
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "wrs_ok="), 3); /* 2 held + 1 of room 302 */
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 1);
}

/* The RDMA twin of test_node_rules' test_frame_before_source_is_published_lands:
 * n2 applied its own update (n1 introduced, n1's members not yet published
 * there: n1 has not acknowledged) when n1's RDMA writes and chunk notice
 * arrive. n1 is a node the room introduced, so the notice counts (the sink
 * lease check still applies) and the room completes. Before: n2 refused the
 * notice ("the sender is not that source of the room") and failed the room;
 * seen under load in the ASan suite as a TRANSFER_FAILED abort. */
static void test_rdma_notice_before_source_is_published_lands(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 900);
    nh_seed_fill(&f->p1, 0, 8, 901);

    nh_set_faults(&f->n1, "hold_room_update=1\n", WAIT_MS);
    kvf_room_key k = nh_join(f->ch, 902, 1, 1, "n1", 0, KVFENCE__V1__ROLE__ROLE_SOURCE,
                             f->p1.pool_id, 0, 8, WAIT_MS, NULL);
    (void)nh_join(f->ch, 902, 1, 1, "n2", 0, KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 8,
                  WAIT_MS, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    nh_wait_log(&f->n2, "room update", &k, 1, WAIT_MS);
    /* n2's next update (naming n1's source) waits for n1's ack: n2 holds it. */
    nh_set_faults(&f->n2, "hold_room_update=1\n", WAIT_MS);
    nh_set_faults(&f->n1, "hold_room_update=0\n", WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_wait_log(&f->n2, "fault: holding a RoomUpdate", NULL, 1, WAIT_MS);
    submit_ok(f, k, 1, 0, 16, 8, true, NULL, 0);
    nh_sleep_ms(300); /* the writes and the notice reach n2 while it holds the update */
    assert_int_equal(nh_log_count(&f->n2, "transfer failed", &k), 0);
    nh_set_faults(&f->n2, "hold_room_update=0\n", WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, 16, 8, 901, 0);
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n2, "notices_refused="), 0);
    assert_true(rdma_stat(&f->n2, "notices_in=") >= 1); /* this room came over RDMA */
}

static void test_rdma_kill9_source_with_writes_outstanding(void **state)
{
    struct fx *f = *state;
    start_linked_held(f, 400);

    kvf_room_key k = join_pair(f, 401, 0, 16, 24);
    submit_ok(f, k, 1, 0, 16, 24, true, NULL, 0);
    nh_node_kill9(&f->n1);
    /* LOST after the ttl: the room aborts, n2 fences n1 (its QPs to ERR). */
    nh_wait_log(&f->n2, "fenced peer n1", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "rdma: peer n1 incarnation", NULL, 1, WAIT_MS);
    /* n2's lease is released; n1's own waits for a proof from n1's host
     * (nothing restarts n1 here to witness the dead process). */
    unsigned rel = 0;
    int64_t end = nh_now_ms() + WAIT_MS;
    while (nh_room_state(f->ch, k, &rel, NULL) != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED ||
           rel != 1) {
        if (nh_now_ms() > end)
            fail_msg("room 401: not ABORTED with n2's lease released (%u)", rel);
        nh_sleep_ms(20);
    }
    uint64_t ids[2];
    assert_int_equal(nh_room_leases(f->ch, k, ids), 2);
    /* Released, and not one byte of the held writes landed: they died with
     * n1, and n2's QPs towards it are in ERR (logged above), so no write of
     * that incarnation can land from now on. */
    nh_seed_check(&f->p2, 0, PAGE_COUNT - 4, SEED_N2, 0);
    struct nh_node *nodes[] = {&f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 1, 20000), 0);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 0);
    assert_int_equal(rdma_stat(&f->n2, "fabric_writes_in="), 0);
}

/* A pool the sink registers after the link came up reaches the source in a
 * LinkPools message: a room into it goes over RDMA; once the sink removed it
 * (UnregisterPool), the source forgets it. */
static void test_rdma_pool_registered_after_link(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 600);
    assert_int_equal(nh_pool_create(&f->p3, "rdma", "n2b", PAGE_SIZE, 16, NULL), 0);
    nh_seed_fill(&f->p3, 0, 16, SEED_N2);
    f->p3.pool_id = nh_register_pool(&f->n2, &f->p3);
    nh_wait_log(&f->n1, "rdma link to n2: 1 pools announced, 2 known", NULL, 1, WAIT_MS);

    nh_seed_fill(&f->p1, 0, 8, 311);
    kvf_room_key k =
        nh_join_pair(f->ch, 601, "n1", f->p1.pool_id, 0, "n2", f->p3.pool_id, 4, 8, WAIT_MS);
    nh_wait_log(&f->n2, "room update", &k, 1, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p3.pool_id, 4, WAIT_MS);
    submit_one_ok(f, k, f->p1.pool_id, "n2", f->p3.pool_id, 0, 4, 8);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p3, 4, 8, 311, 0);
    nh_seed_check(&f->p3, 0, 4, SEED_N2, 0);
    nh_seed_check(&f->p3, 12, 4, SEED_N2, 12);

    Kvfence__V1__UnregisterPoolRequest req = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    req.pool_id = f->p3.pool_id;
    struct kvf_rpc_status st;
    int code =
        nh_call(f->n2.local, "/kvfence.v1.NodeLocal/UnregisterPool", &req.base, NULL, NULL, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("UnregisterPool: %d %s", code, st.message);
    char line[64];
    snprintf(line, sizeof line, "rdma link to n2: its pool %u removed", f->p3.pool_id);
    nh_wait_log(&f->n1, line, NULL, 1, WAIT_MS);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notice_bytes_in="), 8 * PAGE_SIZE);
}

/* The control plane stops (SIGSTOP) past node_ttl with the link up: both
 * nodes self-fence, which fences the RDMA peers and replaces the transport
 * (new regions and rkeys, no links); back, as new incarnations, the first
 * chunk goes over TCP again, a new link comes up and RDMA lands byte-exact. */
static void test_rdma_self_fence_renews_transport(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 500);
    assert_int_equal(kill(f->cp.pid, SIGSTOP), 0);
    nh_wait_log(&f->n1, "a fresh RDMA transport, 1 of 1 pools registered", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "a fresh RDMA transport, 1 of 1 pools registered", NULL, 1, WAIT_MS);
    assert_int_equal(kill(f->cp.pid, SIGCONT), 0);
    nh_wait_log(&f->n1, "attached to control plane", NULL, 2, WAIT_MS);
    nh_wait_log(&f->n2, "attached to control plane", NULL, 2, WAIT_MS);

    room_lands(f, 501, 56, 56, 4, 9); /* TCP: it opens the new incarnations' link */
    nh_wait_log(&f->n1, "up (initiator)", NULL, 2, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 2, WAIT_MS);
    nh_seed_fill(&f->p2, 0, 24, SEED_N2);
    room_lands(f, 502, 0, 0, 24, 310); /* two slices over the new link */
    nh_seed_check(&f->p2, 24, 32, SEED_N2, 24);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    /* Counters of the incarnation that ran last: its own transport. */
    assert_int_equal(rdma_stat(&f->n1, "wrs_ok="), 2);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notice_bytes_in="), 24 * PAGE_SIZE);
}

/* Fault rdma_bad_notice=1 at the source: its next ChunkNotice names pages
 * outside the sink lease. The sink refuses it (counted, logged), fails the
 * room (TransferFailed: ABORTED), the leases are released once, the pages
 * outside the lease are untouched; the link stays up for the next room. */
static void test_rdma_bad_notice_fails_room(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 700);
    nh_set_faults(&f->n1, "rdma_bad_notice=1\n", WAIT_MS);
    nh_seed_fill(&f->p1, 0, 8, 321);
    kvf_room_key k = join_pair(f, 701, 0, 16, 8);
    struct kvf_rpc_client_stream *w2 = nwatch_open(&f->n2, k);
    nwatch_sync(w2);
    submit_ok(f, k, 1, 0, 16, 8, true, NULL, 0);
    nh_wait_log(&f->n1, "fault: a bad ChunkNotice", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "pages outside the sink lease", &k, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    /* No chunk_done on the sink for a refused notice; the failed transfer is. */
    for (;;) {
        Kvfence__V1__NodeEvent *ev = nwatch_must(w2);
        bool end = ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE ||
                   (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE &&
                    ev->room_state->state != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
        assert_int_not_equal(ev->event_case, KVFENCE__V1__NODE_EVENT__EVENT_CHUNK_DONE);
        kvfence__v1__node_event__free_unpacked(ev, NULL);
        if (end)
            break;
    }
    nwatch_close(w2);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
    nh_seed_check(&f->p2, 24, 36, SEED_N2, 24);
    room_lands(f, 702, 48, 48, 8, 322); /* the link still carries the next room */
    nh_seed_check(&f->p2, 24, 24, SEED_N2, 24);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 2);
    assert_int_equal(rdma_stat(&f->n2, "notices_refused="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notice_bytes_in="), 8 * PAGE_SIZE);
}

/* A lost LinkHello (fault rdma_drop_hello=1 at n1): the first room goes over
 * TCP, n1 sends the hello again after 100 ms, the link comes up and the next
 * room goes over RDMA (its chunk_done on n1 says so, n2 counts the notice). */
static void test_rdma_lost_hello_is_sent_again(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    nh_set_faults(&f->n1, "rdma_drop_hello=1\n", WAIT_MS);
    room_lands(f, 800, 60, 60, 4, 5); /* TCP; its route sends the (dropped) hello */
    nh_wait_log(&f->n1, "fault: a LinkHello dropped", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n1, "hello sent again (2)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n1, "up (initiator)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 1, WAIT_MS);

    nh_seed_fill(&f->p1, 0, 8, 331);
    kvf_room_key k = join_pair(f, 801, 0, 8, 8);
    struct kvf_rpc_client_stream *w1 = nwatch_open(&f->n1, k);
    nwatch_sync(w1);
    submit_ok(f, k, 1, 0, 8, 8, true, NULL, 0);
    nwatch_chunks(w1, 1, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, 8, 8, 331, 0);
    nh_seed_check(&f->p2, 0, 8, SEED_N2, 0);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "links_up="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 1);
}

/* Fault rdma_wr_error=1 at n1: its next RDMA chunk names the sink pool with a
 * wrong rkey, n2's fabric end refuses the write and n1's WR completes in
 * error (its QP to ERR). The room fails cleanly (ABORTED, leases released
 * once, nothing landed), n1 takes the link down, tells n2 (LinkClose), both
 * reset their QPs; the next room goes over TCP and opens a new link with
 * fresh QPs, and the one after lands byte-exact over RDMA again. */
static void test_rdma_wr_error_link_rebuilt(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 900);
    nh_set_faults(&f->n1, "rdma_wr_error=1\n", WAIT_MS);
    nh_seed_fill(&f->p1, 0, 8, 341);
    kvf_room_key k = join_pair(f, 901, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true, NULL, 0);
    nh_wait_log(&f->n1, "fault: an RDMA chunk with a wrong rkey", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n1, "down (an RDMA write completed in error): TCP until a new link is up", NULL,
                1, WAIT_MS);
    nh_wait_log(&f->n2, "LinkClose (an RDMA write completed in error)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "down (an RDMA write completed in error): TCP until a new link is up", NULL,
                1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, PAGE_COUNT - 4, SEED_N2, 0); /* the refused write landed nowhere */

    /* TCP while the new link is made, then RDMA over fresh QPs. */
    kvf_room_key k2 = join_pair(f, 902, 48, 48, 8);
    struct kvf_rpc_client_stream *w1 = nwatch_open(&f->n1, k2);
    nwatch_sync(w1);
    nh_seed_fill(&f->p1, 48, 8, 342);
    submit_ok(f, k2, 1, 48, 48, 8, true, NULL, 0);
    nwatch_chunks(w1, 1, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, 48, 8, 342, 48);
    nh_wait_log(&f->n1, "up (initiator)", NULL, 2, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 2, WAIT_MS);

    kvf_room_key k3 = join_pair(f, 903, 8, 24, 16);
    w1 = nwatch_open(&f->n1, k3);
    nwatch_sync(w1);
    nh_seed_fill(&f->p1, 8, 16, 343);
    submit_ok(f, k3, 1, 8, 24, 16, true, NULL, 0);
    nwatch_chunks(w1, 1, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k3, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k3, WAIT_MS);
    nh_seed_check(&f->p2, 24, 16, 343, 8);
    nh_seed_check(&f->p2, 0, 24, SEED_N2, 0);
    nh_seed_check(&f->p2, 40, 8, SEED_N2, 40);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "links_up="), 2);
    assert_int_equal(rdma_stat(&f->n1, "links_down="), 1);
    assert_int_equal(rdma_stat(&f->n1, "peer_resets="), 1);
    assert_int_equal(rdma_stat(&f->n1, "wrs_error="), 1);
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 1);
    assert_int_equal(rdma_stat(&f->n2, "links_up="), 2);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 1);
    assert_int_equal(rdma_stat(&f->n2, "fabric_refused_in="), 1);
}

/* A node that stops sends LinkClose to its linked peers (best effort): the
 * peer tears its side down (QPs reset) and links no more to that incarnation. */
static void test_rdma_link_close_on_shutdown(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    warm_up_link(f, 1000);
    struct nh_node *first[] = {&f->n1};
    assert_int_equal(nh_nodes_stop(first, 1, 20000), 0);
    nh_wait_log(&f->n2, "LinkClose (node shutting down)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "down (node shutting down): TCP only", NULL, 1, WAIT_MS);
    struct nh_node *second[] = {&f->n2};
    assert_int_equal(nh_nodes_stop(second, 1, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "closes_sent="), 1);
    assert_int_equal(rdma_stat(&f->n2, "closes_in="), 1);
    assert_int_equal(rdma_stat(&f->n2, "peer_resets="), 1);
}

/* Admin.FenceNode n1 while both nodes run and n1 has RDMA writes held: the
 * control plane has n2 fence n1 (FencePeer), n2 moves its QPs to n1 to ERR
 * and sends LinkClose (reconnect false); n1, alive, takes the link down for
 * good and resets its QPs (the held writes come back flushed: the room fails,
 * its leases are released once). Nothing n1 writes lands on n2 afterwards,
 * and n1 never links to that n2 incarnation again: a later room to n2 sends
 * no hello (it goes over TCP, which n2 refuses for the fenced n1). */
static void test_rdma_fence_sends_link_close(void **state)
{
    struct fx *f = *state;
    start_linked_held(f, 1200);
    nh_seed_fill(&f->p1, 0, 8, 361);
    kvf_room_key k = join_pair(f, 1201, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true, NULL, 0); /* posted over RDMA, held at n1 */

    Kvfence__V1__FenceNodeRequest req = KVFENCE__V1__FENCE_NODE_REQUEST__INIT;
    req.node_id = (char *)"n1";
    uint8_t *resp = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int code = nh_call(f->ch, "/kvfence.v1.Admin/FenceNode", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("FenceNode: %d %s", code, st.message);
    Kvfence__V1__FenceNodeResponse *fr = kvfence__v1__fence_node_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(fr);
    assert_int_equal(fr->fencers, 1); /* n2, the room's other node */
    kvfence__v1__fence_node_response__free_unpacked(fr, NULL);

    nh_wait_log(&f->n2, "rdma: peer n1 incarnation", NULL, 1, WAIT_MS); /* its QPs in ERR */
    nh_wait_log(&f->n1, "LinkClose (fenced)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n1, "down (fenced): TCP only", NULL, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, PAGE_COUNT - 4, SEED_N2, 0); /* the held writes landed nowhere */

    /* n1 lives on as the same incarnation: its next room to n2 finds the link
     * dead (no hello), and nothing of it lands on n2. */
    nh_set_faults(&f->n1, "rdma_hold=0\n", WAIT_MS);
    nh_seed_fill(&f->p2, 0, 16, 362);
    nh_seed_fill(&f->p1, 40, 8, 363);
    kvf_room_key k2 = join_pair(f, 1202, 40, 40, 8);
    /* Refused at once or failed on the way: either way the room fails. */
    (void)submit_one(f, k2, f->p1.pool_id, "n2", f->p2.pool_id, 40, 40, 8, &st);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k2, WAIT_MS);
    nh_seed_check(&f->p2, 0, 16, 362, 0);
    nh_seed_check(&f->p2, 16, PAGE_COUNT - 20, SEED_N2, 16);
    assert_int_equal(nh_log_count(&f->n1, "rdma link to n2: hello sent", NULL), 1);
    assert_int_equal(nh_log_count(&f->n1, "up (initiator)", NULL), 1);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n2, "closes_sent="), 1);
    assert_int_equal(rdma_stat(&f->n1, "closes_in="), 1);
    assert_int_equal(rdma_stat(&f->n1, "closes_sent="), 0); /* dead link: none at its stop */
    assert_int_equal(rdma_stat(&f->n1, "peer_resets="), 1);
    assert_int_equal(rdma_stat(&f->n1, "wrs_flushed="), 1); /* the held write, back at the reset */
    assert_int_equal(rdma_stat(&f->n2, "fences="), 1);
    assert_int_equal(rdma_stat(&f->n2, "notices_in="), 0); /* the warm-up room went over TCP */
    assert_int_equal(rdma_stat(&f->n2, "fabric_writes_in="), 0);
}

/* One slice FIFO per QP (peer, room_id % 2): fault rdma_hold_odd=1 at n1
 * holds its QP 1 to n2 (rooms with odd ids) in the fake fabric. Room 1301
 * (odd) sends 260 pages of 64 KiB, one slice each: 256 fill QP 1's WR slots
 * (held), 4 wait in that QP's FIFO. Room 1302 (even: QP 0), submitted after
 * it, completes and lands while 1301 is held; behind one FIFO per peer its
 * slices would wait for QP 1. Let go, 1301 completes byte-exact. */
static void test_rdma_qp_fifos_independent(void **state)
{
    struct fx *f = *state;
    const uint32_t big = 65536, npages = 272;
    fx_start(f, "fake");
    assert_int_equal(nh_pool_create(&f->p3, "rdma", "n1big", big, npages, NULL), 0);
    assert_int_equal(nh_pool_create(&f->p4, "rdma", "n2big", big, npages, NULL), 0);
    nh_seed_fill(&f->p3, 0, npages, 371);
    nh_seed_fill(&f->p4, 0, npages, SEED_N2);
    f->p3.pool_id = nh_register_pool(&f->n1, &f->p3);
    warm_up_link(f, 1300);
    f->p4.pool_id = nh_register_pool(&f->n2, &f->p4);
    nh_wait_log(&f->n1, "rdma link to n2: 1 pools announced, 2 known", NULL, 1, WAIT_MS);
    nh_set_faults(&f->n1, "rdma_hold_odd=1\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: rdma writes on QP 1 held (1 links)", NULL, 1, WAIT_MS);

    kvf_room_key ka =
        nh_join_pair(f->ch, 1301, "n1", f->p3.pool_id, 0, "n2", f->p4.pool_id, 0, 260, WAIT_MS);
    kvf_room_key kb =
        nh_join_pair(f->ch, 1302, "n1", f->p3.pool_id, 260, "n2", f->p4.pool_id, 260, 8, WAIT_MS);
    nh_wait_log(&f->n2, "room update", &kb, 1, WAIT_MS);
    nh_wait_node_knows(&f->n1, ka, f->p3.pool_id, "n2", f->p4.pool_id, 0, WAIT_MS);
    nh_wait_node_knows(&f->n1, kb, f->p3.pool_id, "n2", f->p4.pool_id, 260, WAIT_MS);
    submit_one_ok(f, ka, f->p3.pool_id, "n2", f->p4.pool_id, 0, 0, 260);
    submit_one_ok(f, kb, f->p3.pool_id, "n2", f->p4.pool_id, 260, 260, 8);
    nh_wait_room_state(f->ch, kb, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, kb, WAIT_MS);
    nh_seed_check(&f->p4, 260, 8, 371, 260);
    /* Room 1301 is still held: ACTIVE, nothing released, nothing landed. */
    unsigned rel;
    assert_int_equal(nh_room_state(f->ch, ka, &rel, NULL),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    nh_watch_none_released(&f->w, f->ch, ka, "its QP is held");
    nh_seed_check(&f->p4, 0, 260, SEED_N2, 0);

    nh_set_faults(&f->n1, "rdma_hold_odd=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: rdma writes on QP 1 released (1 links)", NULL, 1, WAIT_MS);
    nh_wait_room_state(f->ch, ka, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, ka, WAIT_MS);
    nh_seed_check(&f->p4, 0, 268, 371, 0);
    nh_seed_check(&f->p4, 268, 4, SEED_N2, 268);

    struct nh_node *nodes[] = {&f->n1, &f->n2};
    assert_int_equal(nh_nodes_stop(nodes, 2, 20000), 0);
    assert_int_equal(rdma_stat(&f->n1, "wrs_ok="), 268);
    assert_int_equal(rdma_stat(&f->n1, "notices_sent="), 2);
    assert_int_equal(rdma_stat(&f->n2, "notice_bytes_in="), 268ll * big);
}

/* A sink on the same node: the chunk is a local copy, and its chunk_done on
 * the source's Watch says LOCAL. */
static void test_rdma_local_sink_chunk_says_local(void **state)
{
    struct fx *f = *state;
    fx_start(f, "fake");
    assert_int_equal(nh_pool_create(&f->p3, "rdma", "n1b", PAGE_SIZE, 16, NULL), 0);
    nh_seed_fill(&f->p3, 0, 16, SEED_N2);
    f->p3.pool_id = nh_register_pool(&f->n1, &f->p3);
    nh_seed_fill(&f->p1, 0, 8, 351);
    kvf_room_key k =
        nh_join_pair(f->ch, 1101, "n1", f->p1.pool_id, 0, "n1", f->p3.pool_id, 4, 8, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n1", f->p3.pool_id, 4, WAIT_MS);
    struct kvf_rpc_client_stream *w1 = nwatch_open(&f->n1, k);
    nwatch_sync(w1);
    submit_one_ok(f, k, f->p1.pool_id, "n1", f->p3.pool_id, 0, 4, 8);
    nwatch_chunks(w1, 1, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_LOCAL);
    nwatch_close(w1);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p3, 4, 8, 351, 0);
    nh_seed_check(&f->p3, 0, 4, SEED_N2, 0);
    nh_seed_check(&f->p3, 12, 4, SEED_N2, 12);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_rdma_room_lands_byte_exact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_off_peer_gets_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_abort_with_writes_held, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_notice_before_source_is_published_lands, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_rdma_kill9_source_with_writes_outstanding, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_rdma_pool_registered_after_link, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_self_fence_renews_transport, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_bad_notice_fails_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_lost_hello_is_sent_again, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_wr_error_link_rebuilt, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_link_close_on_shutdown, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_fence_sends_link_close, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_qp_fifos_independent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rdma_local_sink_chunk_says_local, setup, teardown),
    };
    const char *filter = getenv("KVF_TEST_FILTER");
    if (filter && filter[0])
        cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
