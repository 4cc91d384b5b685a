/*
 * test_node_e2e.c: kvfence-node end to end. Each test starts one
 * kvfence-control and two kvfence-node processes (n1, n2; node_harness.c) on
 * 127.0.0.1 with their NodeLocal sockets in a temporary directory, and plays
 * the engine in this process: it creates one POSIX shm pool per node, filled
 * with canary patterns, registers them over NodeLocal, joins rooms over
 * Control.JoinRoom, follows the room with Admin.GetRoom, and submits chunks to
 * n1 over NodeLocal.SubmitChunk.
 *
 * Waits are on observed state with timeouts (poll GetRoom; probe a node's
 * knowledge of a room with a SubmitChunk it must refuse with
 * FAILED_PRECONDITION once it has the room's update, UNAVAILABLE before).
 * Teardown stops every process: the nodes and the control plane must exit 0
 * on SIGTERM (a node killed by the test is only reaped), and the shm objects
 * are unlinked.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS     10000
#define PAGE_SIZE   4096u
#define PAGE_COUNT  64u
#define NODE_TTL_MS "1500"

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

/* SubmitChunk of source rank `source_rank` on `np`: n1's pages [sfirst,
 * +count) -> n2's pages [dfirst, +count). Returns the status code. */
static int submit_as(struct fx *f, struct nh_node *np, kvf_room_key k, uint32_t source_rank,
                     uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                     struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.source_rank = source_rank,
                         .seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_pool = f->p2.pool_id,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = last};
    return nh_submit(np->local, k, &c, st);
}

static int submit(struct fx *f, struct nh_node *np, kvf_room_key k, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, bool last, struct kvf_rpc_status *st)
{
    return submit_as(f, np, k, 0, seq, sfirst, dfirst, count, last, st);
}

/* Waits until `np` has the room's update: a SubmitChunk naming a source rank
 * that is in no lease (99) answers UNAVAILABLE before, FAILED_PRECONDITION
 * after. */
static void wait_node_knows(struct fx *f, struct nh_node *np, kvf_room_key k)
{
    nh_wait_node_knows(np, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
}

/* Control plane, two nodes, two pools registered. */
static void fx_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", NODE_TTL_MS, "--resend-ms",
                          "50",        NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "e2e");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, 0), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, 0), 0);
    assert_int_equal(nh_pool_create(&f->p1, "e2e", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "e2e", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static kvf_room_key join_pair(struct fx *f, uint64_t room_id)
{
    return nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id, 16, 8,
                        WAIT_MS);
}
static void check_n2_pool(struct fx *f, bool copied)
{
    nh_check_pool(&f->p2, nh_canary2, 16, copied ? 8 : 0, nh_canary1, 0, "n2");
}

/* ---- tests ----------------------------------------------------------------------- */

static void test_chunk_lands_and_room_completes(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 101);
    wait_node_knows(f, &f->n2, k);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
    /* Nothing more for a completed room. */
    code = submit(f, &f->n1, k, 2, 0, 16, 8, true, &st);
    assert_int_not_equal(code, KVF_GRPC_OK);
}

static void test_abort_before_any_chunk_drains_and_refuses(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 202);
    wait_node_knows(f, &f->n2, k);
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.detail = (char *)"test abort";
    struct kvf_rpc_status st;
    assert_int_equal(nh_call(f->ch, "/kvfence.v1.Control/AbortRoom", &req.base, NULL, NULL, &st),
                     KVF_GRPC_OK);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_ABORTED && code != KVF_GRPC_FAILED_PRECONDITION)
        fail_msg("late SubmitChunk answered %d: %s", code, st.message);
    nh_sleep_ms(100); /* a window for a stray byte to land (there must be none) */
    check_n2_pool(f, false);
}

static void test_killed_sink_node_is_fenced_then_aborted(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 303);
    wait_node_knows(f, &f->n2, k);
    nh_node_kill9(&f->n2);
    /* node ttl 1.5 s -> LOST -> abort, n1 drains and fences n2 -> ABORTED;
     * n1's lease is released, n2's own waits for a proof from n2's host. */
    int64_t end = nh_now_ms() + WAIT_MS;
    unsigned released = 0, leases = 0;
    while (nh_room_state(f->ch, k, &released, &leases) !=
               KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED ||
           released != 1) {
        if (nh_now_ms() > end)
            fail_msg("room 303: not ABORTED with n1's lease released (%u of %u)", released, leases);
        nh_sleep_ms(20);
    }
    nh_sleep_ms(500);
    assert_int_equal(nh_room_state(f->ch, k, &released, &leases),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    assert_int_equal(released, 1); /* no timer releases n2's */
    /* n2 restarts: it takes the host lock the dead process held and
     * witnesses it in its Hello; n2's lease is released. */
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, 0), 0);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    assert_int_not_equal(code, KVF_GRPC_OK);
}

/* A source that writes the same sink pages twice (a retry with a new
 * chunk_seq, or an engine bug) must not make the sink Completed: completion
 * counts the lease pages covered, not the bytes received. n1's pages [0, 4)
 * then [4, 8) both go to n2's pages [16, 20) (8 pages of bytes, the size of
 * the lease); the sink must still accept [4, 8) -> [20, 24), and the room
 * completes only with every sink page written. */
static void test_pages_written_twice_count_once(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 404);
    wait_node_knows(f, &f->n2, k);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    assert_int_equal(submit_as(f, &f->n1, k, 0, 1, 0, 16, 4, false, &st), KVF_GRPC_OK);
    assert_int_equal(submit_as(f, &f->n1, k, 0, 2, 4, 16, 4, false, &st), KVF_GRPC_OK);
    /* The second write landed (n1's pages 4.. in n2's 16..) ... */
    int64_t end = nh_now_ms() + WAIT_MS;
    while (f->p2.mem[(size_t)16 * PAGE_SIZE] != nh_canary1(4, 0) ||
           f->p2.mem[(size_t)20 * PAGE_SIZE - 1] != nh_canary1(7, PAGE_SIZE - 1)) {
        if (nh_now_ms() > end)
            fail_msg("the second write never landed in n2's pool");
        nh_sleep_ms(1);
    }
    /* ... and n2's owner ran past its frame event (its jobs run in order):
     * the sink must still be open, not Completed with pages 20.. unwritten. */
    wait_node_knows(f, &f->n2, k);
    int code = submit_as(f, &f->n1, k, 0, 3, 4, 20, 4, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk 3: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        for (uint32_t i = 0; i < PAGE_SIZE; i++) {
            uint8_t want =
                pg >= 16 && pg < 24 ? nh_canary1(4 + (pg - 16) % 4, i) : nh_canary2(pg, i);
            uint8_t got = f->p2.mem[(size_t)pg * PAGE_SIZE + i];
            if (got != want)
                fail_msg("n2 page %u byte %u: 0x%02x, want 0x%02x", pg, i, got, want);
        }
    }
}

/* RegisterPool refuses bad input with the right code and a message naming the
 * field, and registers nothing: the good pool registered afterwards gets the
 * next id (1 past the fixture's). */
static void expect_register(struct nh_node *np, Kvfence__V1__RegisterPoolRequest *req, int want,
                            const char *field)
{
    struct kvf_rpc_status st;
    int code =
        nh_call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req->base, NULL, NULL, &st);
    if (code != want || !strstr(st.message, field))
        fail_msg("RegisterPool: %d '%s', want %d naming '%s'", code, st.message, want, field);
}

static void test_register_pool_bad_input(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = f->p1.name;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.page_size = PAGE_SIZE;
    req.page_count = PAGE_COUNT;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "memory");

    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = 0;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "page_size");
    req.page_size = PAGE_SIZE;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT - 1;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "host_shm.size");
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    shm.shm_name = (char *)"/kvf-e2e-no-such-object";
    expect_register(&f->n1, &req, KVF_GRPC_NOT_FOUND, "host_shm");

    Kvfence__V1__CudaIpcMemory cuda = KVFENCE__V1__CUDA_IPC_MEMORY__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC;
    req.cuda_ipc = &cuda;
    /* An empty handle (test_node_devpool covers a well-formed one). */
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "cuda_ipc.ipc_handle");

    /* The same memory twice on one node: two pools could lease one page
     * twice. Its key is the kernel's name of the memory, so another key from
     * the engine changes nothing. */
    uint32_t id = 0;
    struct kvf_rpc_status st;
    int code = nh_register_pool_sized(&f->n1, &f->p1, PAGE_SIZE, &id, &st);
    if (code != KVF_GRPC_ALREADY_EXISTS || !strstr(st.message, "already pool"))
        fail_msg("the same memory again: %d '%s'", code, st.message);
    /* Nothing was half-registered: other memory gets the fixture's id + 1. */
    uint32_t first = f->p1.pool_id;
    assert_int_equal(nh_register_pool(&f->n1, &f->p2), first + 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_chunk_lands_and_room_completes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_before_any_chunk_drains_and_refuses, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_killed_sink_node_is_fenced_then_aborted, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_pages_written_twice_count_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_register_pool_bad_input, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
