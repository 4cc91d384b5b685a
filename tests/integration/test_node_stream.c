/*
 * test_node_stream.c: NodeLocal.SubmitChunks (pipelined chunk submission on
 * one bidi stream) end to end, with real processes: one kvfence-control
 * and two kvfence-node processes (n1, n2) on 127.0.0.1 with
 * their NodeLocal sockets in a temporary directory; this process plays the
 * engine (POSIX shm pools filled with canary patterns, registered over
 * NodeLocal, rooms joined over Control.JoinRoom, followed with Admin.GetRoom)
 * and submits chunks to n1 on SubmitChunks streams. The harness is
 * node_harness.c.
 *
 * Covered: many chunks in flight on one stream land byte for byte and the
 * room completes; refused requests in the middle (pages outside the lease, a
 * repeated chunk_seq, chunk_seq 0, an undecodable message) each get their own
 * result in order and the later chunks still go; after an abort the
 * remaining chunks of the stream get ABORTED and the sink's canary holds
 * once the leases are RELEASED; a stream still open at node shutdown ends
 * with UNAVAILABLE and the node exits 0 (under ASan: no leak); the flow
 * control bounds: a client past 64 (+8) outstanding requests gets
 * RESOURCE_EXHAUSTED and nothing of the refused requests runs (n1 holds the
 * requests with its fault file: hold_stream), and a 65th stream per node is
 * refused with RESOURCE_EXHAUSTED.
 *
 * Waits are on observed state with timeouts. Teardown stops every process:
 * they must exit 0 on SIGTERM, and the shm objects are unlinked.
 */
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS      10000
#define PAGE_SIZE    4096u
#define PAGE_COUNT   128u
#define STREAM_PAGES 32u /* lease of the pipelined test: n1 [0, 32) -> n2 [32, 64) */
#define NODE_TTL_MS  "1500"
/* The node's bound on outstanding requests per stream (submit_stream.c:
 * SUBSTREAM_WINDOW 64 plus SUBSTREAM_SLACK 8; docs/node.md). */
#define STREAM_BOUND 72u

/* ---- fixture (the harness: node_harness.c) ---------------------------------------- */

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
    struct nh_pool *pools[] = {&f->p1, &f->p2};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 8000, pools, 2, f->dir);
    free(f);
    return rc;
}

/* Waits until `np` has the room's update: a SubmitChunk naming a source rank
 * that is in no lease (99) answers UNAVAILABLE before, FAILED_PRECONDITION
 * after. */
static void wait_node_knows(struct fx *f, struct nh_node *np, kvf_room_key k)
{
    nh_wait_node_knows(np, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
}

/* Control plane, two nodes (n1 with `n1_flags`: NH_LOG_FILE, NH_FAULT_FILE),
 * two pools registered. */
static void fx_start_flags(struct fx *f, unsigned n1_flags)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", NODE_TTL_MS, "--resend-ms",
                          "50",        NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "sst");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, n1_flags), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, 0), 0);
    assert_int_equal(nh_pool_create(&f->p1, "sst", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "sst", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static void fx_start(struct fx *f)
{
    fx_start_flags(f, 0);
}

/* A room: n1's source rank 0 leases pages [0, count), n2's sink rank 0
 * pages [dfirst, dfirst + count); waits until both nodes have its update. */
static kvf_room_key join_pair(struct fx *f, uint64_t room_id, uint32_t dfirst, uint32_t count)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id,
                                  dfirst, count, WAIT_MS);
    wait_node_knows(f, &f->n2, k);
    wait_node_knows(f, &f->n1, k);
    return k;
}

/* n2's pool: pages [dfirst, dfirst + count) hold n1's pages [0, count);
 * every other byte still holds its canary. */
static void check_n2_pool(struct fx *f, uint32_t dfirst, uint32_t count)
{
    nh_check_pool(&f->p2, nh_canary2, dfirst, count, nh_canary1, 0, "n2");
}

/* ---- SubmitChunks helpers ------------------------------------------------------------- */

#define M_STREAM "/kvfence.v1.NodeLocal/SubmitChunks"

static struct kvf_rpc_client_stream *stream_open(struct kvf_rpc_channel *ch)
{
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(ch, M_STREAM, 30000);
    assert_non_null(cs);
    return cs;
}

/* Sends one request: source rank 0, n1's pages [sfirst, +count) -> n2's pages
 * [dfirst, +count). kvf_rpc_client_stream_send's result. */
static int stream_send(struct fx *f, struct kvf_rpc_client_stream *cs, kvf_room_key k, uint64_t seq,
                       uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange s = KVFENCE__V1__PAGE_RANGE__INIT, d = KVFENCE__V1__PAGE_RANGE__INIT;
    s.first = sfirst;
    s.count = count;
    d.first = dfirst;
    d.count = count;
    Kvfence__V1__PageRange *sv[1] = {&s}, *dv[1] = {&d};
    Kvfence__V1__SubmitChunkRequest req = KVFENCE__V1__SUBMIT_CHUNK_REQUEST__INIT;
    req.room = &rk;
    req.chunk_seq = seq;
    req.source_rank = 0;
    req.source_pool_id = f->p1.pool_id;
    req.n_source_ranges = 1;
    req.source_ranges = sv;
    req.sink_node_id = (char *)"n2";
    req.sink_rank = 0;
    req.sink_pool_id = f->p2.pool_id;
    req.n_sink_ranges = 1;
    req.sink_ranges = dv;
    req.last_chunk = last;
    uint8_t buf[256];
    size_t len = kvfence__v1__submit_chunk_request__get_packed_size(&req);
    assert_true(len <= sizeof buf);
    kvfence__v1__submit_chunk_request__pack(&req, buf);
    return kvf_rpc_client_stream_send(cs, buf, len);
}

/* The same; the send must be taken. */
static void stream_submit(struct fx *f, struct kvf_rpc_client_stream *cs, kvf_room_key k,
                          uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last)
{
    assert_int_equal(stream_send(f, cs, k, seq, sfirst, dfirst, count, last), 0);
}

/* The next result: its chunk_seq must be `seq` and its code `code`; a
 * refusal's message must contain `needle` (NULL: any). */
static void expect_result(struct kvf_rpc_client_stream *cs, uint64_t seq, int code,
                          const char *needle)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    if (rc != 0)
        fail_msg("result for chunk %llu: recv %d (status %d %s)", (unsigned long long)seq, rc,
                 rc == KVF_RPC_STREAM_END ? st.code : 0,
                 rc == KVF_RPC_STREAM_END ? st.message : "");
    Kvfence__V1__SubmitChunkResult *r = kvfence__v1__submit_chunk_result__unpack(NULL, len, msg);
    free(msg);
    assert_non_null(r);
    if (r->chunk_seq != seq || (int)r->code != code ||
        (needle && !strstr(r->message ? r->message : "", needle)) ||
        (code == KVF_GRPC_OK && r->message && r->message[0]))
        fail_msg("result: chunk %llu code %u \"%s\", want chunk %llu code %d (\"%s\")",
                 (unsigned long long)r->chunk_seq, r->code, r->message ? r->message : "",
                 (unsigned long long)seq, code, needle ? needle : "");
    kvfence__v1__submit_chunk_result__free_unpacked(r, NULL);
}

/* The stream's end: no more results, status `code`, its message containing
 * `needle` (NULL: any). */
static void expect_end(struct kvf_rpc_client_stream *cs, int code, const char *needle)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    free(msg);
    if (rc != KVF_RPC_STREAM_END)
        fail_msg("stream: recv %d, want its end", rc);
    if (st.code != code || (needle && !strstr(st.message, needle)))
        fail_msg("stream ended with %d (%s), want %d (%s)", st.code, st.message, code,
                 needle ? needle : "");
}

/* ---- tests ----------------------------------------------------------------------- */

/* STREAM_PAGES one-page chunks, all sent before the first result is read:
 * every result OK in order, the stream ends OK after half-close, the room
 * completes and the sink pool holds the source pages byte for byte. */
static void test_pipelined_chunks_land_and_room_completes(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 501, 32, STREAM_PAGES);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    for (uint32_t i = 0; i < STREAM_PAGES; i++)
        stream_submit(f, cs, k, i + 1, i, 32 + i, 1, i + 1 == STREAM_PAGES);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    for (uint32_t i = 0; i < STREAM_PAGES; i++)
        expect_result(cs, i + 1, KVF_GRPC_OK, NULL);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 32, STREAM_PAGES);
}

/* Refused requests in the middle of a stream get their own results, with
 * SubmitChunk's codes, and do not stop the requests after them. */
static void test_refused_chunks_get_results_and_stream_goes_on(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 502, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 1, false);
    stream_submit(f, cs, k, 2, 1, 17, 1, false);
    stream_submit(f, cs, k, 3, 2, 40, 1, false); /* sink page outside the lease */
    stream_submit(f, cs, k, 0, 2, 18, 1, false); /* chunk_seq 0 */
    static const uint8_t junk[] = {0xff, 0xff, 0xff};
    assert_int_equal(kvf_rpc_client_stream_send(cs, junk, sizeof junk), 0);
    stream_submit(f, cs, k, 4, 2, 18, 1, false);
    stream_submit(f, cs, k, 4, 3, 19, 1, false); /* chunk_seq repeated */
    stream_submit(f, cs, k, 5, 3, 19, 4, false);
    stream_submit(f, cs, k, 6, 7, 23, 1, true);
    /* After the last chunk (right after: the source may also have completed
     * by then; both are FAILED_PRECONDITION). */
    stream_submit(f, cs, k, 7, 0, 16, 1, false);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    expect_result(cs, 2, KVF_GRPC_OK, NULL);
    expect_result(cs, 3, KVF_GRPC_FAILED_PRECONDITION, "sink_ranges[0]");
    expect_result(cs, 0, KVF_GRPC_INVALID_ARGUMENT, "chunk_seq");
    expect_result(cs, 0, KVF_GRPC_INVALID_ARGUMENT, "undecodable");
    expect_result(cs, 4, KVF_GRPC_OK, NULL);
    expect_result(cs, 4, KVF_GRPC_ALREADY_EXISTS, "chunk_seq 4");
    expect_result(cs, 5, KVF_GRPC_OK, NULL);
    expect_result(cs, 6, KVF_GRPC_OK, NULL);
    expect_result(cs, 7, KVF_GRPC_FAILED_PRECONDITION, NULL);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 16, 8);
}

/* A room aborted while its stream is open: the chunks sent after get ABORTED
 * results, nothing of them lands, and the sink's canary holds once every
 * lease is RELEASED. */
static void test_abort_mid_stream_refuses_the_rest(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 503, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 1, false);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    /* Chunk 1 landed whole before the abort (one frame: whole or nothing). */
    int64_t end = nh_now_ms() + WAIT_MS;
    while (memcmp(f->p2.mem + (size_t)16 * PAGE_SIZE, f->p1.mem, PAGE_SIZE) != 0) {
        if (nh_now_ms() > end)
            fail_msg("chunk 1 never landed in n2's pool");
        nh_sleep_ms(1);
    }
    nh_abort_room(f->ch, k, "test abort");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    /* n1 has the abort: its room stopped admitting (it drained before the
     * leases were released). */
    for (uint32_t i = 1; i < 8; i++)
        stream_submit(f, cs, k, i + 1, i, 16 + i, 1, i == 7);
    for (uint32_t i = 1; i < 8; i++)
        expect_result(cs, i + 1, KVF_GRPC_ABORTED, NULL);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    check_n2_pool(f, 16, 1);
}

/* A stream still open when its node stops ends with UNAVAILABLE, and the
 * node exits 0 (the ASan build fails the exit on a leak). */
static void test_stream_ends_at_node_shutdown(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 504, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 8, true);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 16, 8);
    /* SIGTERM with the stream open, not half-closed. */
    assert_int_equal(kill(f->n1.pid, SIGTERM), 0);
    /* The node's own end, not the server's shutdown cancelling the call. */
    expect_end(cs, KVF_GRPC_UNAVAILABLE, "node shutting down");
    kvf_rpc_client_stream_close(cs);
    int st = -1;
    int64_t end = nh_now_ms() + 8000;
    while (waitpid(f->n1.pid, &st, WNOHANG) != f->n1.pid) {
        if (nh_now_ms() > end)
            fail_msg("n1 did not exit within 8 s of SIGTERM");
        nh_sleep_ms(10);
    }
    f->n1.pid = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("n1 exited with status 0x%x, want 0", st);
}

/* Flow control: n1 keeps every SubmitChunks request back (fault
 * hold_stream), so none gets a result; a client that pipelines past the
 * node's bound (STREAM_BOUND requests without a result) has its stream ended
 * with RESOURCE_EXHAUSTED at the first request over it. The requests taken
 * before run whole once released (their results are dropped: the stream
 * ended); the refused one and those after it are not run: a new stream goes
 * on from the refused chunk_seq with every result OK, in order, and the room
 * completes byte for byte. */
static void test_pipelining_past_the_window_resource_exhausted(void **state)
{
    struct fx *f = *state;
    fx_start_flags(f, NH_LOG_FILE | NH_FAULT_FILE);
    kvf_room_key k = join_pair(f, 505, 0, PAGE_COUNT);
    nh_set_faults(&f->n1, "hold_stream=1\n", WAIT_MS);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    for (uint32_t i = 0; i < STREAM_BOUND + 1; i++)
        stream_submit(f, cs, k, i + 1, i, i, 1, false);
    /* More after the refused one: the stream has ended (or is about to). */
    for (uint32_t i = STREAM_BOUND + 1; i < STREAM_BOUND + 8; i++) {
        int rc = stream_send(f, cs, k, i + 1, i, i, 1, false);
        if (rc != 0 && rc != -ECANCELED)
            fail_msg("send of chunk %u: %d", i + 1, rc);
    }
    /* No result came (all held), only the end. */
    expect_end(cs, KVF_GRPC_RESOURCE_EXHAUSTED, "outstanding");
    kvf_rpc_client_stream_close(cs);
    check_n2_pool(f, 0, 0); /* held: nothing posted yet */

    /* Released: the STREAM_BOUND requests taken run, in order. */
    nh_set_faults(&f->n1, "hold_stream=0\n", WAIT_MS);
    int64_t end = nh_now_ms() + WAIT_MS;
    while (memcmp(f->p2.mem, f->p1.mem, (size_t)STREAM_BOUND * PAGE_SIZE) != 0) {
        if (nh_now_ms() > end)
            fail_msg("the %u requests taken before the refusal never landed", STREAM_BOUND);
        nh_sleep_ms(5);
    }
    /* A new stream goes on from the refused request: had it (or a later one)
     * run, its chunk_seq would be ALREADY_EXISTS. */
    cs = stream_open(f->n1.local);
    for (uint32_t i = STREAM_BOUND; i < PAGE_COUNT; i++)
        stream_submit(f, cs, k, i + 1, i, i, 1, i + 1 == PAGE_COUNT);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    for (uint32_t i = STREAM_BOUND; i < PAGE_COUNT; i++)
        expect_result(cs, i + 1, KVF_GRPC_OK, NULL);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 0, PAGE_COUNT);
}

/* At most 64 SubmitChunks streams per node (submit_stream.c SUBSTREAM_MAX):
 * 64 open streams each answer a request; the 65th ends at once with
 * RESOURCE_EXHAUSTED naming the limit; once one of the 64 ended, a new stream
 * is taken. Each stream's request is refused (chunk_seq 0): a result proves
 * the node registered the stream, and nothing is submitted. */
#define STREAMS_MAX 64

static void test_stream_count_bound_per_node(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 506, 16, 8);
    struct kvf_rpc_client_stream *cs[STREAMS_MAX];
    for (int i = 0; i < STREAMS_MAX; i++) {
        cs[i] = stream_open(f->n1.local);
        stream_submit(f, cs[i], k, 0, 0, 16, 1, false);
        expect_result(cs[i], 0, KVF_GRPC_INVALID_ARGUMENT, "chunk_seq");
    }
    struct kvf_rpc_client_stream *over = stream_open(f->n1.local);
    expect_end(over, KVF_GRPC_RESOURCE_EXHAUSTED, "limit 64 per node");
    kvf_rpc_client_stream_close(over);
    /* One ends (half-close: OK); its place is free again. The node forgets a
     * stream when gRPC reports it closed: retry until then. */
    assert_int_equal(kvf_rpc_client_stream_half_close(cs[0]), 0);
    expect_end(cs[0], KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs[0]);
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_rpc_client_stream *again = stream_open(f->n1.local);
        if (stream_send(f, again, k, 1, 0, 16, 8, true) == 0) {
            uint8_t *msg = NULL;
            size_t len = 0;
            struct kvf_rpc_status st;
            int rc = kvf_rpc_client_stream_recv(again, WAIT_MS, &msg, &len, &st);
            free(msg);
            if (rc == 0) { /* taken: chunk 1 is the room's whole transfer */
                assert_int_equal(kvf_rpc_client_stream_half_close(again), 0);
                expect_end(again, KVF_GRPC_OK, NULL);
                kvf_rpc_client_stream_close(again);
                break;
            }
            if (rc != KVF_RPC_STREAM_END || st.code != KVF_GRPC_RESOURCE_EXHAUSTED)
                fail_msg("a stream after one ended: recv %d status %d %s", rc, st.code, st.message);
        }
        kvf_rpc_client_stream_close(again);
        if (nh_now_ms() > end)
            fail_msg("no stream taken after one of %d ended", STREAMS_MAX);
        nh_sleep_ms(10);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 16, 8);
    for (int i = 1; i < STREAMS_MAX; i++) {
        assert_int_equal(kvf_rpc_client_stream_half_close(cs[i]), 0);
        expect_end(cs[i], KVF_GRPC_OK, NULL);
        kvf_rpc_client_stream_close(cs[i]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_pipelined_chunks_land_and_room_completes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_refused_chunks_get_results_and_stream_goes_on, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_abort_mid_stream_refuses_the_rest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_ends_at_node_shutdown, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pipelining_past_the_window_resource_exhausted, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_stream_count_bound_per_node, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
