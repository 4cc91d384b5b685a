/*
 * test_node_races.c: the races of the domain, end to end with real processes:
 * one kvfence-control and two kvfence-node (n1, source; n2, sink) on
 * 127.0.0.1, each node started with --fault-file (the test drives its faults
 * by rewriting that file, docs/node.md) and its log in a file the test reads
 * to follow what the node did. The test plays the engine: POSIX shm pools,
 * NodeLocal RegisterPool / SubmitChunk, Control.JoinRoom / AbortRoom,
 * Admin.GetRoom / ListLeases, and a Control.WatchLeases stream that counts the
 * releases of every lease. The process, RPC and lease-watch (nh_watch_*)
 * helpers are node_harness.c.
 *
 * Every test ends with the canary check: after the room's leases are
 * RELEASED, the test (the engine, owning the pages again) refills them with a
 * fresh pattern, lets the system run on until observed state says the nodes'
 * work has settled (a following room between the same nodes completes and
 * lands byte-exactly, or the node that could still send has exited), and
 * checks that not one byte of the refilled pages changed. Each lease must be
 * released exactly once on the watch.
 *
 * Waits are on observed state (room states, lease states, log lines, bytes)
 * with timeouts. Teardown stops every process (a node must exit 0 on SIGTERM
 * unless the test killed, stopped or cut it off) and removes the shm objects.
 */
#include <errno.h>
#include <fcntl.h>
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

/* ---- fixture state, node logs and faults (the harness: node_harness.c) --------- */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_node n1b; /* a second incarnation of n1 (a new process) */
    struct nh_pool p1, p2, p3;
    struct nh_node *src; /* the source node the test submits to: n1 or n1b */
    uint32_t src_pool;   /* its pool */
    const uint8_t *aux;  /* aux bytes of the next last chunk (NULL: none) */
    size_t aux_len;
    struct nh_watch w; /* WatchLeases: the releases of every lease */
};

/* Starts kvfence-node `node_id`; its files in `dir` are named after `tag`. */
static int node_start(struct nh_node *np, const char *dir, const char *tag, const char *node_id,
                      const char *control)
{
    return nh_node_start(np, dir, tag, node_id, control, NULL, NH_LOG_FILE | NH_FAULT_FILE);
}

/* ---- pools and canaries ------------------------------------------------------------ */

static int shm_create(struct nh_pool *p, const char *tag, uint32_t seed)
{
    if (nh_pool_create(p, "races", tag, PAGE_SIZE, PAGE_COUNT, NULL) != 0)
        return -1;
    nh_seed_fill(p, 0, PAGE_COUNT, seed);
    return 0;
}

/* ---- RPC helpers ------------------------------------------------------------------- */

/* SubmitChunk of source rank 0 on n1 into n2's pool: `n` source ranges of
 * n1's pool, each `counts[i]` pages at `sfirst[i]`, into n2's pages at
 * `dfirst[i]`. The status code; the status in `st`. */
static int submit(struct fx *f, kvf_room_key k, uint32_t source_rank, uint64_t seq, unsigned n,
                  const uint32_t *sfirst, const uint32_t *dfirst, const uint32_t *counts, bool last,
                  struct kvf_rpc_status *st)
{
    assert_true(n >= 1 && n <= 4);
    struct nh_chunk c = {.source_rank = source_rank,
                         .seq = seq,
                         .source_pool = f->src_pool,
                         .sink_node = "n2",
                         .sink_pool = f->p2.pool_id,
                         .n = n,
                         .last = last};
    for (unsigned i = 0; i < n; i++) {
        c.sfirst[i] = sfirst[i];
        c.dfirst[i] = dfirst[i];
        c.count[i] = counts[i];
    }
    if (last && f->aux) {
        c.aux = f->aux;
        c.aux_len = f->aux_len;
    }
    return nh_submit(f->src->local, k, &c, st);
}

static void submit_ok(struct fx *f, kvf_room_key k, uint64_t seq, uint32_t sfirst, uint32_t dfirst,
                      uint32_t count, bool last)
{
    struct kvf_rpc_status st;
    int code = submit(f, k, 0, seq, 1, &sfirst, &dfirst, &count, last, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk %llu: %d %s", (unsigned long long)seq, code, st.message);
}

/* Waits until both nodes have the room's update: the source is probed with a
 * SubmitChunk for a source rank in no lease (UNAVAILABLE before the update,
 * FAILED_PRECONDITION after), the sink by its log. */
static void wait_nodes_know(struct fx *f, kvf_room_key k)
{
    nh_wait_log(&f->n2, "room update", &k, 1, WAIT_MS);
    nh_wait_node_knows(f->src, k, f->src_pool, "n2", f->p2.pool_id, 16, WAIT_MS);
}

static kvf_room_key join_pair(struct fx *f, uint64_t room_id, uint32_t sfirst, uint32_t dfirst,
                              uint32_t count)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->src_pool, sfirst, "n2", f->p2.pool_id,
                                  dfirst, count, WAIT_MS);
    wait_nodes_know(f, k);
    return k;
}

/* ---- fixture ------------------------------------------------------------------------- */

#define SEED_N1   11u
#define SEED_N2   77u
#define SETTLE_S  32u /* the settle room: n1 [32, 40) -> n2 [40, 48) */
#define SETTLE_D  40u
#define SETTLE_PG 8u

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    nh_watch_close(&f->w);
    /* nh_teardown dumps each node's log to stderr (ctest shows it on failure). */
    struct nh_node *nodes[] = {&f->n1, &f->n2, &f->n1b};
    struct nh_pool *pools[] = {&f->p1, &f->p2, &f->p3};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 3, 8000, pools, 3, f->dir);
    free(f);
    return rc;
}

static void fx_start(struct fx *f)
{
    /* Short node ttl and heartbeat timeout: a killed or stopped node is LOST
     * in about 1.5 to 4 s. */
    const char *args[] = {"--threads",   "2",  "--node-ttl-ms",          "1500",
                          "--resend-ms", "50", "--heartbeat-timeout-ms", "2500",
                          NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "races");
    assert_int_equal(node_start(&f->n1, f->dir, "n1", "n1", f->cp.target), 0);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", "n2", f->cp.target), 0);
    nh_wait_log(&f->n1, "fault injection on", NULL, 1, WAIT_MS);
    assert_int_equal(shm_create(&f->p1, "n1", SEED_N1), 0);
    assert_int_equal(shm_create(&f->p2, "n2", SEED_N2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
    f->src = &f->n1;
    f->src_pool = f->p1.pool_id;
    nh_watch_open(&f->w, f->ch, WAIT_MS);
}

/* A following room on other pages between the same nodes completes and lands
 * byte-exactly: the n1 -> n2 path carried everything sent before it. */
static void settle_with_room(struct fx *f, uint64_t room_id)
{
    nh_seed_fill(f->src == &f->n1b ? &f->p3 : &f->p1, SETTLE_S, SETTLE_PG, 200);
    kvf_room_key k = join_pair(f, room_id, SETTLE_S, SETTLE_D, SETTLE_PG);
    submit_ok(f, k, 1, SETTLE_S, SETTLE_D, SETTLE_PG, true);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_seed_check(&f->p2, SETTLE_D, SETTLE_PG, 200, SETTLE_S);
}

/* The room aborts (any cause) while n1 holds a frame: once the sink drained,
 * nothing is released; n1 still holds. */
static void expect_held_abort(struct fx *f, kvf_room_key k)
{
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, WAIT_MS);
    nh_wait_log(&f->n2, "drained", &k, 1, WAIT_MS);
    nh_wait_log(&f->n1, "abort notice", &k, 1, WAIT_MS);
    assert_int_equal(nh_log_count(&f->n1, "drained", &k), 0);
    nh_watch_none_released(&f->w, f->ch, k, "an op is in flight");
}

/* ---- tests ----------------------------------------------------------------------------- */

static void test_abort_while_transfer_held(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 1001, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    nh_abort_room(f->ch, k, "race test abort");
    expect_held_abort(f, k);
    nh_seed_check(&f->p2, 0, PAGE_COUNT, SEED_N2, 0); /* nothing left n1 */

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: release frame", &k, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    /* The frame reached n2 after its admission closed: refused, not landed. */
    nh_seed_check(&f->p2, 0, PAGE_COUNT, SEED_N2, 0);
    /* The engine owns the pages again: fresh patterns, then run on. */
    nh_seed_fill(&f->p1, 0, 8, 301);
    nh_seed_fill(&f->p2, 16, 8, 302);
    settle_with_room(f, 1002);
    nh_seed_check(&f->p2, 16, 8, 302, 16);
    nh_seed_check(&f->p1, 0, 8, 301, 0);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
}

static void test_one_op_fails_while_sibling_held(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* Frame 1 fails (completion ERROR), frame 2 is held. */
    nh_set_faults(&f->n1, "hold=1\nop_error=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 2001, 0, 16, 8);
    uint32_t s[2] = {0, 4}, d[2] = {16, 20}, c[2] = {4, 4};
    struct kvf_rpc_status st;
    int code = submit(f, k, 0, 1, 2, s, d, c, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    nh_wait_log(&f->n1, "fault: error frame", &k, 1, WAIT_MS);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    /* The failure alone aborts the room; the held sibling keeps it from draining. */
    expect_held_abort(f, k);

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: release frame", &k, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, PAGE_COUNT, SEED_N2, 0); /* neither frame landed */
    nh_seed_fill(&f->p1, 0, 8, 311);
    nh_seed_fill(&f->p2, 16, 8, 312);
    settle_with_room(f, 2002);
    nh_seed_check(&f->p2, 16, 8, 312, 16);
    nh_seed_check(&f->p1, 0, 8, 311, 0);
}

static void test_submission_fails_part_way(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* Three frames: the first is posted (held), the second's post fails. */
    nh_set_faults(&f->n1, "hold=1\npost_fail=2\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 3001, 0, 16, 8);
    uint32_t s[3] = {0, 2, 4}, d[3] = {16, 18, 20}, c[3] = {2, 2, 4};
    struct kvf_rpc_status st;
    int code = submit(f, k, 0, 1, 3, s, d, c, true, &st);
    if (code == KVF_GRPC_OK)
        fail_msg("SubmitChunk succeeded although its second post failed");
    if (!strstr(st.message, "chunk 1") || !strstr(st.message, "1 of 3"))
        fail_msg("SubmitChunk error does not name the chunk and its posted frames: %d %s", code,
                 st.message);
    assert_int_equal(nh_log_count(&f->n1, "fault: fail_post frame", &k), 1);
    expect_held_abort(f, k);

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: release frame", &k, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, PAGE_COUNT, SEED_N2, 0); /* the posted frame came too late */
    nh_seed_fill(&f->p2, 16, 8, 322);
    settle_with_room(f, 3002);
    nh_seed_check(&f->p2, 16, 8, 322, 16);
}

static void test_abort_between_chunks_keeps_source_pages(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 4001, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 4, false);
    /* Chunk 1 landed. */
    int64_t end = nh_now_ms() + WAIT_MS;
    char why[200];
    while (!nh_seed_holds(&f->p2, 16, 4, SEED_N1, 0, why, sizeof why)) {
        if (nh_now_ms() > end)
            fail_msg("chunk 1 never landed: %s", why);
        nh_sleep_ms(10);
    }
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    submit_ok(f, k, 2, 4, 20, 4, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    nh_abort_room(f->ch, k, "race test abort");
    expect_held_abort(f, k);

    /* n1's read lease still covers chunk 1's pages [0, 4) and is not released. */
    Kvfence__V1__ListLeasesRequest lr = KVFENCE__V1__LIST_LEASES_REQUEST__INIT;
    lr.node_id = (char *)"n1";
    lr.room_id = k.room_id;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(nh_call(f->ch, "/kvfence.v1.Admin/ListLeases", &lr.base, &resp, &len, &st),
                     KVF_GRPC_OK);
    Kvfence__V1__ListLeasesResponse *ll =
        kvfence__v1__list_leases_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ll);
    assert_int_equal(ll->n_leases, 1);
    const Kvfence__V1__Lease *l = ll->leases[0];
    assert_int_not_equal(l->state, KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED);
    assert_int_equal(l->n_ranges, 1);
    assert_int_equal(l->ranges[0]->first, 0);
    assert_int_equal(l->ranges[0]->count, 8);
    kvfence__v1__list_leases_response__free_unpacked(ll, NULL);

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 16, 4, SEED_N1, 0);  /* chunk 1 */
    nh_seed_check(&f->p2, 20, 4, SEED_N2, 20); /* chunk 2 was refused */
    nh_seed_fill(&f->p1, 0, 8, 331);
    nh_seed_fill(&f->p2, 16, 8, 332);
    settle_with_room(f, 4002);
    nh_seed_check(&f->p1, 0, 8, 331, 0);
    nh_seed_check(&f->p2, 16, 8, 332, 16);
}

/* Room `k` ended ABORTED with the live peer's lease released, while the lost
 * node's own lease stays RELEASING: its pages wait for a proof from its host
 * (its Drained or its witnessed death; docs/design.md §4), whatever the clock does. */
static void wait_aborted_lost_lease_waits(struct fx *f, kvf_room_key k)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    unsigned rel = 0, n = 0;
    while (nh_room_state(f->ch, k, &rel, &n) != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED ||
           rel != 1) {
        if (nh_now_ms() > end)
            fail_msg("room %llu: not ABORTED with one lease released (%u of %u)",
                     (unsigned long long)k.room_id, rel, n);
        nh_sleep_ms(20);
    }
    nh_sleep_ms(300);
    assert_int_equal(nh_room_state(f->ch, k, &rel, &n),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    assert_int_equal(rel, 1);
}

static void test_killed_source_with_held_transfer(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 5001, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    nh_node_kill9(&f->n1);
    /* LOST after the ttl; n2 fences n1 and drains; the room ends, n1's own
     * lease waits until n1 restarts and witnesses the dead process. */
    wait_aborted_lost_lease_waits(f, k);
    assert_true(nh_log_count(&f->n2, "fenced peer n1", NULL) >= 1);
    assert_int_equal(node_start(&f->n1, f->dir, "n1", "n1", f->cp.target), 0);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_fill(&f->p2, 16, 8, 342);
    /* Settled: n2 fenced the dead node, and the dead node cannot send. */
    nh_seed_check(&f->p2, 16, 8, 342, 16);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
}

static void test_killed_sink_with_held_transfer(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 5101, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    nh_node_kill9(&f->n2);
    /* n1 fences n2: the held frame completes FLUSHED, n1 drains; n2's own
     * lease waits until n2 restarts and witnesses the dead process. */
    wait_aborted_lost_lease_waits(f, k);
    assert_int_equal(nh_log_count(&f->n1, "fault: flush frame", &k), 1);
    assert_true(nh_log_count(&f->n1, "fenced peer n2", NULL) >= 1);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", "n2", f->cp.target), 0);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_fill(&f->p1, 0, 8, 351);
    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS); /* nothing is held any more */
    nh_seed_check(&f->p1, 0, 8, 351, 0);
}

static void test_stopped_node_cut_off_then_resumed(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 6001, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    f->n1.any_exit = true;
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    /* Heartbeats stop: the session ends, n1 is LOST, n2 fences it. n2's
     * lease is released; n1's own waits for a proof from n1's host. */
    wait_aborted_lost_lease_waits(f, k);
    assert_true(nh_log_count(&f->n2, "fenced peer n1", NULL) >= 1);
    nh_seed_fill(&f->p2, 16, 8, 362);

    /* n1 comes back and sends what it held; it self-fences, its old
     * lifetime drains, and its Witness releases its lease. */
    nh_fault_file_write(&f->n1, "hold=0\n");
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    nh_wait_log(&f->n1, "fault: release frame", &k, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    /* Settled: n1 ends (its drain waits for the released frame's completion). */
    int st = nh_node_stop(&f->n1, 8000);
    assert_int_not_equal(st, -2);
    nh_seed_check(&f->p2, 16, 8, 362, 16);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
    nh_seed_check(&f->p2, 24, PAGE_COUNT - 24, SEED_N2, 24);
}

static void test_reused_room_id_new_generation(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k1 = join_pair(f, 7001, 0, 16, 8);
    submit_ok(f, k1, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k1, 1, WAIT_MS);
    nh_abort_room(f->ch, k1, "race test abort");
    expect_held_abort(f, k1);
    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_room_state(f->ch, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k1, WAIT_MS);

    /* The same id again: new source content, fresh sink pages. */
    nh_seed_fill(&f->p1, 0, 8, 371);
    nh_seed_fill(&f->p2, 16, 8, 372);
    kvf_room_key k2 = join_pair(f, 7001, 0, 16, 8);
    assert_true(k2.room_id == k1.room_id);
    assert_true(k2.generation > k1.generation);
    submit_ok(f, k2, 1, 0, 16, 8, true);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k2, WAIT_MS);
    nh_seed_check(&f->p2, 16, 8, 371, 0); /* exactly the new generation's bytes */
    nh_seed_fill(&f->p2, 16, 8, 373);
    settle_with_room(f, 7002);
    nh_seed_check(&f->p2, 16, 8, 373, 16);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
}

static void test_dropped_notice_and_report_are_resent(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* n1 loses the first AbortNotice and its first Drained report. */
    nh_set_faults(&f->n1, "hold=1\ndrop_abort=1\ndrop_drained=1\n", WAIT_MS);
    kvf_room_key k = join_pair(f, 8001, 0, 16, 8);
    submit_ok(f, k, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    nh_abort_room(f->ch, k, "race test abort");
    nh_wait_log(&f->n1, "fault: dropped a AbortNotice", NULL, 1, WAIT_MS);
    expect_held_abort(f, k); /* the re-sent notice got through */

    /* Released: the first Drained is lost, the re-sent notice gets another. */
    nh_set_faults(&f->n1, "hold=0\ndrop_drained=1\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: did not send a Drained", NULL, 1, WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_true(nh_log_count(&f->n1, "drained", &k) >= 2);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_check(&f->p2, 0, PAGE_COUNT, SEED_N2, 0);
    nh_seed_fill(&f->p2, 16, 8, 382);
    settle_with_room(f, 8002);
    nh_seed_check(&f->p2, 16, 8, 382, 16);
}

static void test_old_incarnation_cannot_write_into_new_generation(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* Generation 1: n1 holds its frame and is cut off (SIGSTOP) until LOST. */
    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    kvf_room_key k1 = join_pair(f, 9001, 0, 16, 8);
    submit_ok(f, k1, 1, 0, 16, 8, true);
    nh_wait_log(&f->n1, "fault: hold frame", &k1, 1, WAIT_MS);
    f->n1.any_exit = true;
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    wait_aborted_lost_lease_waits(f, k1); /* n1's own lease waits for its host */

    /* n1 restarts as a new incarnation with a new pool; the zombie lives on. */
    assert_int_equal(node_start(&f->n1b, f->dir, "n1b", "n1", f->cp.target), 0);
    assert_int_equal(shm_create(&f->p3, "n1b", 391), 0);
    f->p3.pool_id = nh_register_pool(&f->n1b, &f->p3);
    f->src = &f->n1b;
    f->src_pool = f->p3.pool_id;
    nh_seed_fill(&f->p2, 16, 8, 392);
    /* Room 9001 cannot be reused while the zombie's lease waits: the next
     * room writes the same sink pages under another id. */
    kvf_room_key k2 = join_pair(f, 9003, 0, 16, 8);
    assert_true(k2.generation > k1.generation);

    /* While generation 2 is ACTIVE on the same sink pages, the zombie sends
     * the frame it held, then ends. */
    nh_fault_file_write(&f->n1, "hold=0\n");
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    nh_wait_log(&f->n1, "fault: release frame", &k1, 1, WAIT_MS);
    assert_int_not_equal(nh_node_stop(&f->n1, 8000), -2);
    nh_seed_check(&f->p2, 16, 8, 392, 16);

    submit_ok(f, k2, 1, 0, 16, 8, true);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_watch_released_once(&f->w, f->ch, k2, WAIT_MS);
    nh_seed_check(&f->p2, 16, 8, 391, 0); /* exactly generation 2's bytes */
    nh_seed_fill(&f->p2, 16, 8, 393);
    settle_with_room(f, 9002);
    nh_seed_check(&f->p2, 16, 8, 393, 16);
    nh_seed_check(&f->p2, 0, 16, SEED_N2, 0);
}

static void test_peer_message_dropped_by_fault_file(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* n1's first peer message (the aux of the room's pair) is lost: its
     * status arrives after a gap, the sink fails the room. */
    nh_set_faults(&f->n1, "peer_drop=1\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: peer channel faults set: drop_nth=1", NULL, 1, WAIT_MS);
    kvf_room_key k = join_pair(f, 10001, 0, 16, 8);
    uint8_t aux[2000];
    for (size_t i = 0; i < sizeof aux; i++)
        aux[i] = (uint8_t)(i * 13u);
    f->aux = aux;
    f->aux_len = sizeof aux;
    submit_ok(f, k, 1, 0, 16, 8, true);
    f->aux = NULL;
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    Kvfence__V1__RoomInfo *ri = nh_get_room(f->ch, k);
    int reason = ri->abort_reason;
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);
    nh_watch_released_once(&f->w, f->ch, k, WAIT_MS);
    nh_seed_fill(&f->p2, 16, 8, 402);
    settle_with_room(f, 10002);
    nh_seed_check(&f->p2, 16, 8, 402, 16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_abort_while_transfer_held, setup, teardown),
        cmocka_unit_test_setup_teardown(test_one_op_fails_while_sibling_held, setup, teardown),
        cmocka_unit_test_setup_teardown(test_submission_fails_part_way, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_between_chunks_keeps_source_pages, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_killed_source_with_held_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_killed_sink_with_held_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stopped_node_cut_off_then_resumed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reused_room_id_new_generation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_dropped_notice_and_report_are_resent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_old_incarnation_cannot_write_into_new_generation,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_peer_message_dropped_by_fault_file, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
