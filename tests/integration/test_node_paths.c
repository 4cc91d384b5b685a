/*
 * test_node_paths.c: kvfence-node's data paths end to end, with real
 * processes: one kvfence-control and one or two kvfence-node processes on
 * 127.0.0.1, POSIX shm pools made by this process (the engine), filled with
 * canary patterns and checked byte by byte.
 *
 *   - host staging over TCP (n1 --staging host, a ring smaller than the
 *     chunk, so frames wait for buffers and reuse them);
 *   - same-node transfers (source and sink pools both on n1: the local
 *     transport), without and with host staging; the room completes only if
 *     the sink's landed bytes are fed by the local completions;
 *   - an abort while staged ops are in flight: n1 --test-local-hold-file
 *     holds the local copies while the file exists; the room must stay
 *     ABORTING (n1 does not report Drained) until the file is removed.
 *
 * The harness (node processes, shm pools, RPC helpers, waits on observed
 * state) is node_harness.c, with extra node arguments.
 */
#include <fcntl.h>
#include <setjmp.h>
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
#include "kvf_version.h"
#include "node_harness.h"

#define WAIT_MS     10000
#define PAGE_SIZE   65536u /* 4 pages per 256 KiB frame */
#define PAGE_COUNT  64u
#define LEASE_PAGES 32u
#define NODE_TTL_MS "1500"

/* ---- fixture (the harness: node_harness.c) ---------------------------------------- */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2; /* p1: the source pool on n1; p2: the sink pool */
    const char *sink_node; /* "n2", or "n1" for same-node transfers */
    char hold_dir[64];     /* n1's --test-local-hold-file: hold_dir/hold */
    char hold[100];
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
    if (f->hold_dir[0]) {
        char q[120];
        snprintf(q, sizeof q, "%s.queued", f->hold);
        unlink(q);
        unlink(f->hold);
        rmdir(f->hold_dir);
    }
    free(f);
    return rc;
}

/* One participant (rank 0) of a room with one source and one sink. */
static kvf_room_key join(struct fx *f, uint64_t room_id, const char *node, int role,
                         uint32_t pool_id, uint32_t first, uint32_t count)
{
    return nh_join(f->ch, room_id, 1, 1, node, 0, role, pool_id, first, count, WAIT_MS, NULL);
}

/* SubmitChunk of source rank `source_rank` on `np`: p1's pages [sfirst,
 * +count) -> p2's pages [dfirst, +count) on the sink node. The status code. */
static int submit_as(struct fx *f, struct nh_node *np, kvf_room_key k, uint32_t source_rank,
                     uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                     struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.source_rank = source_rank,
                         .seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = f->sink_node,
                         .sink_pool = f->p2.pool_id,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = last};
    return nh_submit(np->local, k, &c, st);
}

/* Waits until `np` has the room's update: a SubmitChunk naming a source rank
 * that is in no lease (99) answers UNAVAILABLE before, FAILED_PRECONDITION
 * after. */
static void wait_node_knows(struct fx *f, struct nh_node *np, kvf_room_key k)
{
    nh_wait_node_knows(np, k, f->p1.pool_id, f->sink_node, f->p2.pool_id, LEASE_PAGES, WAIT_MS);
}

/* Control plane and n1 (with `n1_args`); with `sink_n2`, n2 too and the sink
 * pool on n2, else both pools on n1. */
static void fx_start_flags(struct fx *f, const char *const *n1_args, bool sink_n2,
                           unsigned n1_flags)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", NODE_TTL_MS, "--resend-ms",
                          "50",        NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "paths");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, n1_args, n1_flags), 0);
    if (sink_n2)
        assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, 0), 0);
    f->sink_node = sink_n2 ? "n2" : "n1";
    assert_int_equal(nh_pool_create(&f->p1, "paths", "src", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "paths", "sink", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(sink_n2 ? &f->n2 : &f->n1, &f->p2);
}

static void fx_start(struct fx *f, const char *const *n1_args, bool sink_n2)
{
    fx_start_flags(f, n1_args, sink_n2, 0);
}

/* Source n1 pool p1 pages [0, 32) -> sink pool p2 pages [32, 64). */
static kvf_room_key join_pair(struct fx *f, uint64_t room_id)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, 0, f->sink_node,
                                  f->p2.pool_id, LEASE_PAGES, LEASE_PAGES, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    if (strcmp(f->sink_node, "n2") == 0)
        wait_node_knows(f, &f->n2, k);
    return k;
}

/* The sink pool: pages [32, 64) hold p1's pages [0, 32) when `copied`; every
 * other byte still holds its canary. Byte by byte. */
static void check_sink_pool(struct fx *f, bool copied)
{
    nh_check_pool(&f->p2, nh_canary2, LEASE_PAGES, copied ? LEASE_PAGES : 0, nh_canary1, 0, "sink");
}

static void submit_ok(struct fx *f, kvf_room_key k, uint64_t seq, uint32_t sfirst, uint32_t count,
                      bool last)
{
    struct kvf_rpc_status st;
    int code = submit_as(f, &f->n1, k, 0, seq, sfirst, LEASE_PAGES + sfirst, count, last, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk %llu: %d %s", (unsigned long long)seq, code, st.message);
}

/* Waits until n1 has processed the room's abort notice: the probe of
 * wait_node_knows answers ABORTED ("aborting on this node") from then on. */
static void wait_n1_aborting(struct fx *f, kvf_room_key k)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_rpc_status st;
        int code = submit_as(f, &f->n1, k, 99, 1, 0, LEASE_PAGES, 1, false, &st);
        if (code == KVF_GRPC_ABORTED)
            return;
        if (nh_now_ms() > end)
            fail_msg("n1 never saw the abort (%d %s)", code, st.message);
        nh_sleep_ms(10);
    }
}

/* Waits until n1 says (in <hold>.queued) that `want` local copies are held. */
static void wait_held(struct fx *f, unsigned want)
{
    char path[120];
    snprintf(path, sizeof path, "%s.queued", f->hold);
    int64_t end = nh_now_ms() + WAIT_MS;
    unsigned got = 0;
    for (;;) {
        FILE *fp = fopen(path, "r");
        if (fp) {
            if (fscanf(fp, "%u", &got) != 1)
                got = 0;
            fclose(fp);
        }
        if (got == want)
            return;
        if (nh_now_ms() > end)
            fail_msg("n1 holds %u local copies, want %u", got, want);
        nh_sleep_ms(5);
    }
}

static Kvfence__V1__RoomState room_state(struct fx *f, kvf_room_key k)
{
    Kvfence__V1__RoomInfo *ri = nh_get_room(f->ch, k);
    Kvfence__V1__RoomState s = ri->state;
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    return s;
}

/* ---- tests ----------------------------------------------------------------------- */

static void test_host_staging_over_tcp_is_byte_exact(void **state)
{
    struct fx *f = *state;
    /* Two buffers for eight frames: frames wait for the ring and reuse it. */
    const char *n1_args[] = {"--staging", "host", "--staging-buffers", "2", NULL};
    fx_start(f, n1_args, true);
    kvf_room_key k = join_pair(f, 501);
    submit_ok(f, k, 1, 0, LEASE_PAGES / 2, false);
    submit_ok(f, k, 2, LEASE_PAGES / 2, LEASE_PAGES / 2, true);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_sink_pool(f, true);
}

/* Whether n1's Hello advertised `feature` (Admin.GetNode; it does not report
 * endpoints). */
static bool n1_advertises(struct fx *f, const char *feature)
{
    Kvfence__V1__GetNodeRequest req = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    req.node_id = (char *)"n1";
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(nh_call(f->ch, "/kvfence.v1.Admin/GetNode", &req.base, &resp, &len, &st),
                     KVF_GRPC_OK);
    Kvfence__V1__NodeInfo *ni = kvfence__v1__node_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ni);
    assert_non_null(ni->capabilities);
    bool has = false;
    for (size_t i = 0; i < ni->capabilities->n_features; i++)
        has |= strcmp(ni->capabilities->features[i], feature) == 0;
    kvfence__v1__node_info__free_unpacked(ni, NULL);
    return has;
}

static void test_same_node_transfer_is_byte_exact(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL, false);
    /* Transport features as advertised: LOCAL and TCP always; RDMA only with
     * a device (none where /sys/class/infiniband is absent). */
    assert_true(n1_advertises(f, "LOCAL"));
    assert_true(n1_advertises(f, "TCP"));
    if (access("/sys/class/infiniband", F_OK) != 0)
        assert_false(n1_advertises(f, "RDMA"));
    kvf_room_key k = join_pair(f, 502);
    submit_ok(f, k, 1, 0, LEASE_PAGES, true);
    /* COMPLETED needs the sink's Completed too: fed by the local completions. */
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_sink_pool(f, true);
    struct kvf_rpc_status st;
    int code = submit_as(f, &f->n1, k, 0, 2, 0, LEASE_PAGES, 1, true, &st);
    assert_int_not_equal(code, KVF_GRPC_OK);
}

static void test_same_node_with_host_staging_is_byte_exact(void **state)
{
    struct fx *f = *state;
    const char *n1_args[] = {"--staging", "host", "--staging-buffers", "3", NULL};
    fx_start(f, n1_args, false);
    kvf_room_key k = join_pair(f, 503);
    submit_ok(f, k, 1, 0, LEASE_PAGES, true);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_sink_pool(f, true);
}

/* After test_abort_waits_for_staged_op_in_flight: the sink pool's pages
 * [32, 64) hold p1's [0, 32) (room A) and [0, 32) hold p1's [32, 64) (room B). */
static void check_sink_pool_two_rooms(struct fx *f)
{
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        uint32_t from = pg < LEASE_PAGES ? pg + LEASE_PAGES : pg - LEASE_PAGES;
        for (uint32_t i = 0; i < PAGE_SIZE; i++) {
            uint8_t got = f->p2.mem[(size_t)pg * PAGE_SIZE + i];
            if (got != nh_canary1(from, i))
                fail_msg("sink page %u byte %u: 0x%02x, want 0x%02x (p1 page %u)", pg, i, got,
                         nh_canary1(from, i), from);
        }
    }
}

static void test_abort_waits_for_staged_op_in_flight(void **state)
{
    struct fx *f = *state;
    snprintf(f->hold_dir, sizeof f->hold_dir, "/tmp/kvf-hold-XXXXXX");
    assert_non_null(mkdtemp(f->hold_dir));
    snprintf(f->hold, sizeof f->hold, "%s/hold", f->hold_dir);
    /* Eight buffers: room A's eight frames own the whole ring. */
    const char *n1_args[] = {
        "--staging", "host", "--staging-buffers", "8", "--test-local-hold-file", f->hold, NULL};
    fx_start(f, n1_args, false);
    kvf_room_key a = join_pair(f, 504);

    /* Held: every frame gets a buffer and its copy, then its local op waits. */
    int fd = open(f->hold, O_CREAT | O_WRONLY, 0600);
    assert_true(fd >= 0);
    close(fd);
    submit_ok(f, a, 1, 0, LEASE_PAGES, true);
    /* Abort only once all eight frames are posted from their buffers (a copy
     * still running at the abort would end its frame unposted). */
    wait_held(f, LEASE_PAGES / 4);
    nh_abort_room(f->ch, a, "test abort");
    wait_n1_aborting(f, a);
    /* n1 processed the abort with ops in flight from staging buffers: it must
     * not report Drained, so the room stays ABORTING and no sink byte moved. */
    assert_int_equal(room_state(f, a), KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    check_sink_pool(f, false);

    /* Room B (p1 [32, 64) -> p2 [0, 32)) is accepted, but its frames must wait
     * for the ring: a buffer handed back before A's op read it would be
     * refilled with B's bytes, and A's sink pages would show them. */
    kvf_room_key b =
        join(f, 505, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, LEASE_PAGES, LEASE_PAGES);
    (void)join(f, 505, "n1", KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 0, LEASE_PAGES);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, b);
    struct kvf_rpc_status st;
    int code = submit_as(f, &f->n1, b, 0, 1, LEASE_PAGES, 0, LEASE_PAGES, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk of room B: %d %s", code, st.message);
    assert_int_equal(room_state(f, a), KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);

    /* Released: A's ops run to completion (they were admitted before the
     * abort, so their bytes land), its buffers return, A drains; then B's
     * frames get the buffers and B completes. */
    assert_int_equal(unlink(f->hold), 0);
    nh_wait_room_state(f->ch, a, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_wait_room_state(f->ch, b, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_sink_pool_two_rooms(f);
}

/* A staged chunk whose every frame fails inside its SubmitChunk (fault
 * stage_fail: each staging copy fails to start, so every frame ends before
 * node_xport_stage_chunk returns, and the chunk with it). The call answers
 * INTERNAL naming the chunk, the room fails (TransferFailed: ABORTED, every
 * lease released), no sink byte moved, and the node is sound afterwards: a
 * second room completes and the node exits 0 at teardown. Before, the chunk
 * was freed by its last frame's end and node_submit_chunk then read it
 * (ASan build: heap-use-after-free in the node, which died; the plain build:
 * SubmitChunk OK for a chunk that had already failed). */
static void test_staged_chunk_failing_at_submission(void **state)
{
    struct fx *f = *state;
    const char *n1_args[] = {"--staging", "host", "--staging-buffers", "8", NULL};
    fx_start_flags(f, n1_args, true, NH_LOG_FILE | NH_FAULT_FILE);
    kvf_room_key k = join_pair(f, 506);
    nh_set_faults(&f->n1, "stage_fail=1000\n", WAIT_MS);
    struct kvf_rpc_status st;
    /* Eight pages: two frames, both with a buffer at once. */
    int code = submit_as(f, &f->n1, k, 0, 1, 0, LEASE_PAGES, 8, false, &st);
    if (code != KVF_GRPC_INTERNAL || !strstr(st.message, "chunk 1"))
        fail_msg(
            "SubmitChunk with every staged frame failing: %d %s (want INTERNAL naming chunk 1)",
            code, st.message);
    int reason = nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);
    assert_true(nh_log_count(&f->n1, "fault: a staging copy not started", NULL) >= 2);
    check_sink_pool(f, false);
    nh_set_faults(&f->n1, "", WAIT_MS);
    kvf_room_key k2 = join_pair(f, 507);
    submit_ok(f, k2, 1, 0, LEASE_PAGES, true);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_sink_pool(f, true);
}

static void test_bad_staging_setting_exits_2(void **state)
{
    (void)state;
    const char *bad[] = {"bogus", KVF_HAVE_CUDA_BUILD ? NULL : "cuda"};
    for (size_t i = 0; i < 2; i++) {
        if (!bad[i])
            continue;
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            execl(KVF_NODE_BIN, KVF_NODE_BIN, "--control", "127.0.0.1:1", "--staging", bad[i],
                  (char *)NULL);
            _exit(127);
        }
        int st = 0;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_host_staging_over_tcp_is_byte_exact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_same_node_transfer_is_byte_exact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_same_node_with_host_staging_is_byte_exact, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_abort_waits_for_staged_op_in_flight, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_chunk_failing_at_submission, setup, teardown),
        cmocka_unit_test(test_bad_staging_setting_exits_2),
    };
    if (getenv("KVF_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVF_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
