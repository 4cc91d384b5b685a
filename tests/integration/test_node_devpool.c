/*
 * test_node_devpool.c: device memory pools in kvfence-node, with real
 * processes (one kvfence-control, one or two kvfence-node on 127.0.0.1) and
 * real shm. This machine has no GPU, so the device path runs on the test-only
 * fake device pool (--test-fake-device-pools PREFIX: a host_shm pool whose
 * name starts with PREFIX is copied only through kvf_pool_read/kvf_pool_write,
 * exactly as a CUDA IPC pool is, and those copies are counted). The node logs
 * the counts when a device pool is unregistered; the tests read them to prove
 * that every frame took the device path.
 *
 *   - a device sink over TCP: byte-exact, one device write per frame,
 *     canaries intact;
 *   - a device source with --staging host: byte-exact, one device read per
 *     frame; with --staging none the chunk is refused FAILED_PRECONDITION
 *     naming the pool and nothing moves;
 *   - same node (local transport): device to device, host to device;
 *   - an abort while a frame towards a device sink is held (--fault-file
 *     hold=1): the room ends ABORTED with every lease RELEASED, the frame is
 *     refused at the sink, no device write, canaries intact;
 *   - RegisterPool cuda_ipc on this machine: the exact refusal (built without
 *     CUDA, or no CUDA device), a bad handle INVALID_ARGUMENT, and nothing
 *     registered afterwards.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS     10000
#define PAGE_SIZE   65536u /* 4 pages per 256 KiB frame */
#define PAGE_COUNT  64u
#define LEASE_PAGES 32u
#define FRAMES      (LEASE_PAGES / 4u)
#define LEASE_BYTES ((uint64_t)LEASE_PAGES * PAGE_SIZE)
#define DEV_PREFIX  "/kvf-devpool-" /* nh_pool_create(.., "devpool", ..) names */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2, p3; /* p1: source on n1; p2: sink; p3: a second source */
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    struct nh_pool *pools[] = {&f->p1, &f->p2, &f->p3};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 8000, pools, 3, f->dir);
    free(f);
    return rc;
}

static void cp_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "1500", "--resend-ms", "50", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "devpool");
}

static void node_start(struct fx *f, struct nh_node *np, const char *tag, const char *const *extra,
                       unsigned flags)
{
    assert_int_equal(nh_node_start(np, f->dir, tag, tag, f->cp.target, extra, NH_LOG_FILE | flags),
                     0);
}

/* A pool: `device` names it under DEV_PREFIX (a fake device pool on a node
 * started with --test-fake-device-pools DEV_PREFIX). */
static void pool_create(struct nh_pool *p, bool device, const char *tag, nh_canary_fn fill)
{
    assert_int_equal(
        nh_pool_create(p, device ? "devpool" : "hostpool", tag, PAGE_SIZE, PAGE_COUNT, fill), 0);
    assert_int_equal(strncmp(p->name, DEV_PREFIX, strlen(DEV_PREFIX)) == 0, device);
    if (device) {
        /* The node picks fake device pools by name: registered by name, so
         * the object must be one every caller of the 0660 socket (the
         * node's group) could open (docs/security.md, NodeLocal). */
        char path[96];
        snprintf(path, sizeof path, "/dev/shm%s", p->name);
        assert_int_equal(chmod(path, 0660), 0);
        p->by_name = true;
    }
}

/* Unregisters device pool `pool_id` of `np` and checks the copy counts the
 * node logs for it. */
static void expect_device_io(struct nh_node *np, uint32_t pool_id, uint64_t writes,
                             uint64_t write_bytes, uint64_t reads, uint64_t read_bytes)
{
    nh_unregister_pool(np, pool_id, WAIT_MS);
    char want[200];
    snprintf(want, sizeof want,
             "device pool %u (fake device (test)): writes=%llu write_bytes=%llu reads=%llu "
             "read_bytes=%llu",
             pool_id, (unsigned long long)writes, (unsigned long long)write_bytes,
             (unsigned long long)reads, (unsigned long long)read_bytes);
    char any[64];
    snprintf(any, sizeof any, "device pool %u (", pool_id);
    nh_wait_log(np, any, NULL, 1, WAIT_MS);
    if (nh_log_count(np, want, NULL) != 1) {
        nh_node_dump_log(np);
        fail_msg("node %s: want the log line '%s'", np->id, want);
    }
}

static int submit(struct fx *f, struct nh_node *np, kvf_room_key k, uint32_t src_pool,
                  const char *sink_node, uint32_t sink_pool, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, bool last, struct kvf_rpc_status *st)
{
    (void)f;
    struct nh_chunk c = {.source_rank = 0,
                         .seq = seq,
                         .source_pool = src_pool,
                         .sink_node = sink_node,
                         .sink_pool = sink_pool,
                         .n = 1,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = last};
    return nh_submit(np->local, k, &c, st);
}

/* A room: n1's `src_pool` pages [0, 32) -> `sink_node`'s `sink_pool` pages
 * [32, 64), both nodes knowing it. */
static kvf_room_key room(struct fx *f, uint64_t id, uint32_t src_pool, const char *sink_node,
                         struct nh_node *sink_np, uint32_t sink_pool)
{
    kvf_room_key k = nh_join_pair(f->ch, id, "n1", src_pool, 0, sink_node, sink_pool, LEASE_PAGES,
                                  LEASE_PAGES, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, src_pool, sink_node, sink_pool, LEASE_PAGES, WAIT_MS);
    if (sink_np != &f->n1)
        nh_wait_node_knows(sink_np, k, src_pool, sink_node, sink_pool, LEASE_PAGES, WAIT_MS);
    return k;
}

/* Two chunks of 16 pages, the room completes, the sink holds the copy and
 * every other byte its canary. */
static void transfer(struct fx *f, kvf_room_key k, uint32_t src_pool, const char *sink_node,
                     struct nh_pool *sink, nh_canary_fn sink_canary, nh_canary_fn src_canary)
{
    for (uint32_t c = 0; c < 2; c++) {
        struct kvf_rpc_status st;
        uint32_t s = c * (LEASE_PAGES / 2);
        int code = submit(f, &f->n1, k, src_pool, sink_node, sink->pool_id, c + 1, s,
                          LEASE_PAGES + s, LEASE_PAGES / 2, c == 1, &st);
        if (code != KVF_GRPC_OK)
            fail_msg("SubmitChunk %u: %d %s", c + 1, code, st.message);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_check_pool(sink, sink_canary, LEASE_PAGES, LEASE_PAGES, src_canary, 0, "sink");
}

/* A control plane, n1 (source, with `n1_args` and `n1_flags`) and n2 (sink,
 * with `n2_args`), pool p1 on n1 and p2 on n2, each a fake device pool when
 * asked, both registered. */
static void two_nodes(struct fx *f, const char *const *n1_args, unsigned n1_flags,
                      const char *const *n2_args, bool src_device, bool sink_device)
{
    cp_start(f);
    node_start(f, &f->n1, "n1", n1_args, n1_flags);
    node_start(f, &f->n2, "n2", n2_args, 0);
    pool_create(&f->p1, src_device, "src", nh_canary1);
    pool_create(&f->p2, sink_device, "sink", nh_canary2);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

/* ---- tests ---------------------------------------------------------------------------- */

static void test_device_sink_over_tcp(void **state)
{
    struct fx *f = *state;
    const char *n2_args[] = {"--test-fake-device-pools", DEV_PREFIX, NULL};
    two_nodes(f, NULL, 0, n2_args, false, true);
    nh_wait_log(&f->n2, "fake device (test)", NULL, 1, WAIT_MS);
    kvf_room_key k = room(f, 701, f->p1.pool_id, "n2", &f->n2, f->p2.pool_id);
    transfer(f, k, f->p1.pool_id, "n2", &f->p2, nh_canary2, nh_canary1);
    /* Every frame (256 KiB: one bounce buffer) was one device write. */
    expect_device_io(&f->n2, f->p2.pool_id, FRAMES, LEASE_BYTES, 0, 0);
    nh_check_pool(&f->p2, nh_canary2, LEASE_PAGES, LEASE_PAGES, nh_canary1, 0, "sink after");
}

static void test_device_source_with_host_staging(void **state)
{
    struct fx *f = *state;
    const char *n1_args[] = {
        "--staging", "host", "--staging-buffers", "2", "--test-fake-device-pools",
        DEV_PREFIX,  NULL};
    two_nodes(f, n1_args, 0, NULL, true, false);
    kvf_room_key k = room(f, 702, f->p1.pool_id, "n2", &f->n2, f->p2.pool_id);
    transfer(f, k, f->p1.pool_id, "n2", &f->p2, nh_canary2, nh_canary1);
    /* Each staged frame read its pages with one device read. */
    expect_device_io(&f->n1, f->p1.pool_id, 0, 0, FRAMES, LEASE_BYTES);
    nh_check_pool(&f->p1, nh_canary1, 0, 0, nh_canary1, 0, "source");
}

static void test_device_source_without_staging_refused(void **state)
{
    struct fx *f = *state;
    const char *n1_args[] = {"--test-fake-device-pools", DEV_PREFIX, NULL};
    two_nodes(f, n1_args, 0, NULL, true, false);
    kvf_room_key k = room(f, 703, f->p1.pool_id, "n2", &f->n2, f->p2.pool_id);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 1, 0, LEASE_PAGES,
                      LEASE_PAGES, true, &st);
    assert_int_equal(code, KVF_GRPC_FAILED_PRECONDITION);
    char want[64];
    snprintf(want, sizeof want, "device pool %u needs --staging cuda", f->p1.pool_id);
    if (!strstr(st.message, want))
        fail_msg("message '%s' does not say '%s'", st.message, want);
    /* Refused as a whole: the same seq is still free, nothing moved. */
    nh_abort_room(f->ch, k, "test: refused chunk");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_check_pool(&f->p2, nh_canary2, 0, 0, nh_canary1, 0, "sink");
    expect_device_io(&f->n1, f->p1.pool_id, 0, 0, 0, 0);
}

static void test_same_node_device_pools(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *n1_args[] = {"--test-fake-device-pools", DEV_PREFIX, NULL};
    node_start(f, &f->n1, "n1", n1_args, 0);
    pool_create(&f->p1, true, "src", nh_canary1);
    pool_create(&f->p2, true, "sink", nh_canary2);
    pool_create(&f->p3, false, "hsrc", nh_canary1);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n1, &f->p2);
    f->p3.pool_id = nh_register_pool(&f->n1, &f->p3);

    /* Device to device: a read and a write (through a host buffer) per frame. */
    kvf_room_key a = room(f, 704, f->p1.pool_id, "n1", &f->n1, f->p2.pool_id);
    transfer(f, a, f->p1.pool_id, "n1", &f->p2, nh_canary2, nh_canary1);

    /* Host to device: sink pages [32, 64) again, from the host pool whose
     * pages differ from p1's by being fresh: zero them on the sink first so a
     * missing write shows. */
    for (uint32_t pg = LEASE_PAGES; pg < PAGE_COUNT; pg++)
        memset(f->p2.mem + (size_t)pg * PAGE_SIZE, 0, PAGE_SIZE);
    kvf_room_key b = room(f, 705, f->p3.pool_id, "n1", &f->n1, f->p2.pool_id);
    transfer(f, b, f->p3.pool_id, "n1", &f->p2, nh_canary2, nh_canary1);

    expect_device_io(&f->n1, f->p1.pool_id, 0, 0, FRAMES, LEASE_BYTES);
    expect_device_io(&f->n1, f->p2.pool_id, 2 * FRAMES, 2 * LEASE_BYTES, 0, 0);
}

static void test_same_node_host_staging_into_device(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *n1_args[] = {
        "--staging", "host", "--staging-buffers", "3", "--test-fake-device-pools",
        DEV_PREFIX,  NULL};
    node_start(f, &f->n1, "n1", n1_args, 0);
    pool_create(&f->p1, true, "src", nh_canary1);
    pool_create(&f->p2, true, "sink", nh_canary2);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n1, &f->p2);
    kvf_room_key k = room(f, 706, f->p1.pool_id, "n1", &f->n1, f->p2.pool_id);
    transfer(f, k, f->p1.pool_id, "n1", &f->p2, nh_canary2, nh_canary1);
    /* Staged: the staging copy reads the device source, the local transport
     * writes the staging buffer into the device sink. */
    expect_device_io(&f->n1, f->p1.pool_id, 0, 0, FRAMES, LEASE_BYTES);
    expect_device_io(&f->n1, f->p2.pool_id, FRAMES, LEASE_BYTES, 0, 0);
}

static void test_abort_with_frame_held_into_device_sink(void **state)
{
    struct fx *f = *state;
    const char *n2_args[] = {"--test-fake-device-pools", DEV_PREFIX, NULL};
    two_nodes(f, NULL, NH_FAULT_FILE, n2_args, false, true);
    kvf_room_key k = room(f, 707, f->p1.pool_id, "n2", &f->n2, f->p2.pool_id);

    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    struct kvf_rpc_status st;
    int code =
        submit(f, &f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 1, 0, LEASE_PAGES, 4, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    nh_wait_log(&f->n1, "fault: hold frame", NULL, 1, WAIT_MS);
    nh_abort_room(f->ch, k, "test abort");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, WAIT_MS);
    /* The source holds an admitted frame: nothing may be released yet. */
    unsigned released = 9;
    (void)nh_room_state(f->ch, k, &released, NULL);
    assert_int_equal(released, 0);
    nh_check_pool(&f->p2, nh_canary2, 0, 0, nh_canary1, 0, "sink while held");

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: release frame", NULL, 1, WAIT_MS);
    /* ABORTED with every participant's lease RELEASED (nh_wait_room_state). */
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    unsigned leases = 0;
    assert_int_equal(nh_room_state(f->ch, k, &released, &leases),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    assert_int_equal(released, 2);
    assert_int_equal(leases, 2);
    /* The held frame's lifetime closed before it went out: not written (the
     * sender skips it, or n2 refuses it before any byte moves), so no device
     * write and the canaries are intact. */
    nh_check_pool(&f->p2, nh_canary2, 0, 0, nh_canary1, 0, "sink after release");
    expect_device_io(&f->n2, f->p2.pool_id, 0, 0, 0, 0);
}

static int register_cuda(struct nh_node *np, size_t handle_len, struct kvf_rpc_status *st)
{
    uint8_t handle[64] = {0};
    Kvfence__V1__CudaIpcMemory cm = KVFENCE__V1__CUDA_IPC_MEMORY__INIT;
    cm.ipc_handle.data = handle;
    cm.ipc_handle.len = handle_len;
    cm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    cm.device = 0;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC;
    req.cuda_ipc = &cm;
    req.page_size = PAGE_SIZE;
    req.page_count = PAGE_COUNT;
    uint8_t *resp = NULL;
    size_t len = 0;
    int code = nh_call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, &resp, &len, st);
    free(resp);
    return code;
}

static void test_register_cuda_ipc_refused_here(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    node_start(f, &f->n1, "n1", NULL, 0);
    struct kvf_rpc_status st;
    assert_int_equal(register_cuda(&f->n1, 10, &st), KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "cuda_ipc.ipc_handle"));
    int code = register_cuda(&f->n1, 64, &st);
    printf("  RegisterPool cuda_ipc: %d %s\n", code, st.message);
#ifdef KVF_TEST_HAVE_CUDA
    /* Built with CUDA: no device here (FAILED_PRECONDITION naming the device
     * field); on a host with one, the all-zero handle is refused. */
    if (code == KVF_GRPC_FAILED_PRECONDITION)
        assert_non_null(strstr(st.message, "cuda_ipc.device"));
    else if (code == KVF_GRPC_INVALID_ARGUMENT)
        assert_non_null(strstr(st.message, "cuda_ipc.ipc_handle"));
    else
        fail_msg("RegisterPool cuda_ipc: %d %s", code, st.message);
#else
    assert_int_equal(code, KVF_GRPC_FAILED_PRECONDITION);
    assert_string_equal(st.message, "cuda_ipc: this kvfence-node was built without CUDA");
#endif
    /* Nothing registered: no pool 1, and the next pool gets id 1. */
    Kvfence__V1__UnregisterPoolRequest ur = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    ur.pool_id = 1;
    uint8_t *resp = NULL;
    size_t len = 0;
    assert_int_equal(
        nh_call(f->n1.local, "/kvfence.v1.NodeLocal/UnregisterPool", &ur.base, &resp, &len, &st),
        KVF_GRPC_NOT_FOUND);
    free(resp);
    pool_create(&f->p1, false, "src", nh_canary1);
    assert_int_equal(nh_register_pool(&f->n1, &f->p1), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_device_sink_over_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_source_with_host_staging, setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_source_without_staging_refused, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_same_node_device_pools, setup, teardown),
        cmocka_unit_test_setup_teardown(test_same_node_host_staging_into_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_with_frame_held_into_device_sink, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_register_cuda_ipc_refused_here, setup, teardown),
    };
    return cmocka_run_group_tests_name("node_devpool", tests, NULL, NULL);
}
