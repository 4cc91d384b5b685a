/*
 * test_node_rules.c: rooms that can no longer complete fail through the
 * token path instead of staying ACTIVE (issue 12, item 4, node side).
 *
 * One kvfence-control and two kvfence-node processes on 127.0.0.1
 * (node_harness.c): n1 holds the source, n2 the sink(s).
 * - A chunk for a new pair after the source completed: the source reported
 *   Completed when the pairs it had ended, so the new pair's sink can never
 *   complete. SubmitChunk answers FAILED_PRECONDITION (docs/node.md) and the
 *   room ends ABORTED (n1 reports TransferFailed). Before: ABORTED ("room is
 *   closed on this node") and the room stayed ACTIVE.
 * - ExtendLease is ordered by the protocol: the sink lease grows while n2
 *   holds its RoomUpdates back (fault file); n1 does not learn the new pages
 *   until n2 acknowledged them, so it sends nothing n2 could not place, and
 *   the room completes. Before: n1 learned the pages at once and n2 dropped
 *   the frame silently (the room stayed ACTIVE). A frame for a room the sink
 *   has no update for fails the room at once (test_node_peer.c).
 * - Sink completion is a drain proof: two sources write the same sink pages,
 *   one from another node (TCP), one from the sink's own node (a same-node
 *   copy, held in flight with --test-local-hold-file). The remote source's
 *   frames cover the lease and its ok status accounts for every landed byte,
 *   but the held copy is an op in flight into those pages: the sink must not
 *   report Completed until it retired. Before: Completed at once.
 * - Bounded memory: with --retain-rooms 2, after 6 rooms completed each node
 *   has freed the 4 oldest (logged), and a SubmitChunk for a freed room is
 *   answered ABORTED as late (its generation is remembered). Before: rooms
 *   were never freed.
 */
#include <inttypes.h>
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

#define WAIT_MS    10000
#define PAGE_SIZE  4096u
#define PAGE_COUNT 64u

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
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 20000, pools, 2, f->dir);
    free(f);
    return rc;
}

/* Control plane, n1 (`n1_flags`: with NH_FAULT_FILE when the test needs
 * it) and n2 (with a fault file), a registered pool on each. */
static void fx_start_flags(struct fx *f, const char *const *extra, unsigned n1_flags)
{
    const char *args[] = {"--threads", "2", "--resend-ms", "200", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "rules");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, extra, n1_flags), 0);
    assert_int_equal(
        nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, extra, NH_LOG_FILE | NH_FAULT_FILE),
        0);
    assert_int_equal(nh_pool_create(&f->p1, "rules", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "rules", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static void fx_start_with(struct fx *f, const char *const *extra)
{
    fx_start_flags(f, extra, NH_LOG_FILE);
}

static void fx_start(struct fx *f)
{
    fx_start_with(f, NULL);
}

/* One chunk from n1's source rank 0 to n2's sink `sink_rank`. */
static int submit(struct fx *f, kvf_room_key k, uint32_t sink_rank, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, uint64_t sink_lease_pages,
                  struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.source_rank = 0,
                         .seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_rank = sink_rank,
                         .sink_pool = f->p2.pool_id,
                         .n = 1,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = true};
    (void)sink_lease_pages;
    return nh_submit(f->n1.local, k, &c, st);
}

/* Waits until n1's source participant of `k` is reported complete. */
static void wait_source_completed(struct fx *f, kvf_room_key k)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__RoomInfo *ri = nh_get_room(f->ch, k);
        bool done = false;
        for (size_t i = 0; i < ri->n_participants; i++) {
            const Kvfence__V1__ParticipantInfo *p = ri->participants[i];
            if (p->participant && p->participant->role == KVFENCE__V1__ROLE__ROLE_SOURCE)
                done = p->completed;
        }
        kvfence__v1__room_info__free_unpacked(ri, NULL);
        if (done)
            return;
        if (nh_now_ms() > end)
            fail_msg("the source never completed");
        nh_sleep_ms(10);
    }
}

static void test_chunk_for_new_pair_after_source_completed_fails_room(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* One source (pages 0..7), two sinks on n2 (ranks 0 and 1). */
    kvf_room_key k = nh_join(f->ch, 701, 1, 2, "n1", 0, KVFENCE__V1__ROLE__ROLE_SOURCE,
                             f->p1.pool_id, 0, 8, WAIT_MS, NULL);
    (void)nh_join(f->ch, 701, 1, 2, "n2", 0, KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 4,
                  WAIT_MS, NULL);
    (void)nh_join(f->ch, 701, 1, 2, "n2", 1, KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 32, 4,
                  WAIT_MS, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    struct kvf_rpc_status st;
    int code = KVF_GRPC_UNAVAILABLE;
    int64_t end = nh_now_ms() + WAIT_MS;
    while ((code = submit(f, k, 0, 1, 0, 16, 4, 0, &st)) == KVF_GRPC_UNAVAILABLE &&
           nh_now_ms() < end)
        nh_sleep_ms(5);
    assert_int_equal(code, KVF_GRPC_OK);
    wait_source_completed(f, k); /* its only pair ended: Completed */

    code = submit(f, k, 1, 1, 4, 32, 4, 0, &st);
    if (code != KVF_GRPC_FAILED_PRECONDITION)
        fail_msg("chunk for a new pair after completion: code %d (%s), want FAILED_PRECONDITION",
                 code, st.message);
    assert_non_null(strstr(st.message, "completed"));
    int reason = nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_TRANSFER_FAILED);
    nh_check_pool(&f->p2, nh_canary2, 16, 4, nh_canary1, 0, "sink rank 0");
}

/* ExtendLease is ordered by the protocol (docs/node.md, "Ordered room
 * updates"): the sink's node learns the new pages and acknowledges before
 * the source's node learns them. n2 holds its RoomUpdates while the sink
 * lease grows by pages 20..23: n1 keeps refusing a chunk into them (it does
 * not know them) and sends nothing n2 could not place; once n2 applied its
 * update, n1 learns the pages, the chunk lands and the room completes. On the
 * code before this order n1 learned the pages at once and its frame was
 * refused by n2, failing the room. */
static void test_extended_sink_pages_reach_source_after_sink(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    uint64_t sink_lease = 0;
    kvf_room_key k = nh_join(f->ch, 702, 1, 1, "n1", 0, KVFENCE__V1__ROLE__ROLE_SOURCE,
                             f->p1.pool_id, 0, 8, WAIT_MS, NULL);
    (void)nh_join(f->ch, 702, 1, 1, "n2", 0, KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 4,
                  WAIT_MS, &sink_lease);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p2.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);

    nh_set_faults(&f->n2, "hold_room_update=1\n", WAIT_MS);
    nh_extend_lease(f->ch, k, sink_lease, 20, 4);
    struct kvf_rpc_status st;
    nh_wait_log(&f->n2, "fault: holding a RoomUpdate", NULL, 1, WAIT_MS);

    /* However long n2 holds, n1 does not know pages 20..23. */
    int code;
    int64_t until = nh_now_ms() + 500;
    do {
        code = submit(f, k, 0, 1, 0, 16, 8, 0, &st);
        if (code == KVF_GRPC_OK)
            fail_msg("n1 took a chunk into sink pages n2 does not know yet");
        nh_sleep_ms(20);
    } while (nh_now_ms() < until);
    nh_set_faults(&f->n2, "hold_room_update=0\n", WAIT_MS);
    int64_t end = nh_now_ms() + WAIT_MS;
    while ((code = submit(f, k, 0, 1, 0, 16, 8, 0, &st)) != KVF_GRPC_OK && nh_now_ms() < end)
        nh_sleep_ms(5);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk after n2 applied the extension: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    assert_int_equal(nh_log_count(&f->n2, "outside this node's sink lease", &k), 0);
    nh_check_pool(&f->p2, nh_canary2, 16, 8, nh_canary1, 0, "sink pool");
}

/* The source's node may learn the sink's lease (the sink's node acknowledged
 * it) before the sink's node learns the source's members (the control plane
 * publishes those after the source's node acknowledged). A frame that arrives
 * in between comes from a node the room introduced and lands. n1 holds its
 * updates until n2 applied its own, then n2 holds the update that would name
 * n1's source while n1's frame arrives. Before: n2 dropped the frame
 * silently (not from a known source) and the room stayed ACTIVE. */
static void test_frame_before_source_is_published_lands(void **state)
{
    struct fx *f = *state;
    fx_start_flags(f, NULL, NH_LOG_FILE | NH_FAULT_FILE);

    nh_set_faults(&f->n1, "hold_room_update=1\n", WAIT_MS);
    kvf_room_key k = nh_join(f->ch, 704, 1, 1, "n1", 0, KVFENCE__V1__ROLE__ROLE_SOURCE,
                             f->p1.pool_id, 0, 4, WAIT_MS, NULL);
    (void)nh_join(f->ch, 704, 1, 1, "n2", 0, KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 4,
                  WAIT_MS, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p2.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    /* n1 has not acknowledged yet, so n2's update naming n1's source comes
     * only after n1 lets its updates through: n2 holds it. */
    nh_set_faults(&f->n2, "hold_room_update=1\n", WAIT_MS);
    nh_set_faults(&f->n1, "hold_room_update=0\n", WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_wait_log(&f->n2, "fault: holding a RoomUpdate", NULL, 1, WAIT_MS);
    struct kvf_rpc_status st;
    int code = submit(f, k, 0, 1, 0, 16, 4, 0, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    nh_sleep_ms(300); /* the frame reaches n2 while it holds the update */
    nh_set_faults(&f->n2, "hold_room_update=0\n", WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_check_pool(&f->p2, nh_canary2, 16, 4, nh_canary1, 0, "sink pool");
}

static void test_ended_rooms_are_freed_beyond_retention(void **state)
{
    struct fx *f = *state;
    const char *extra[] = {"--retain-rooms", "2", NULL};
    fx_start_with(f, extra);
    kvf_room_key first = {0, 0};
    for (uint32_t i = 0; i < 6; i++) {
        kvf_room_key k = nh_join_pair(f->ch, 801 + i, "n1", f->p1.pool_id, i, "n2", f->p2.pool_id,
                                      16 + i, 1, WAIT_MS);
        if (i == 0)
            first = k;
        nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16 + i, WAIT_MS);
        struct kvf_rpc_status st;
        int code;
        int64_t end = nh_now_ms() + WAIT_MS;
        while ((code = submit(f, k, 0, 1, i, 16 + i, 1, 0, &st)) == KVF_GRPC_UNAVAILABLE &&
               nh_now_ms() < end)
            nh_sleep_ms(5);
        assert_int_equal(code, KVF_GRPC_OK);
        nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    }
    /* Each node freed the 4 oldest (the 5th and 6th stay retained). */
    nh_wait_log(&f->n1, "room freed", NULL, 4, WAIT_MS);
    nh_wait_log(&f->n2, "room freed", NULL, 4, WAIT_MS);
    nh_sleep_ms(100);
    assert_int_equal(nh_log_count(&f->n1, "room freed", NULL), 4);
    assert_int_equal(nh_log_count(&f->n1, "room freed", &first), 1);
    /* The freed room is still known as late. */
    struct kvf_rpc_status st;
    int code = submit(f, first, 0, 2, 0, 16, 1, 0, &st);
    if (code != KVF_GRPC_ABORTED)
        fail_msg("SubmitChunk for a freed room: %d (%s), want ABORTED", code, st.message);
    assert_non_null(strstr(st.message, "late"));
    nh_check_pool(&f->p2, nh_canary2, 16, 6, nh_canary1, 0, "sink pool");
}

/* Whether the participant (`node`, rank, role) of `k` is complete. */
static bool part_completed(struct fx *f, kvf_room_key k, const char *node, uint32_t rank, int role)
{
    Kvfence__V1__RoomInfo *ri = nh_get_room(f->ch, k);
    bool done = false;
    for (size_t i = 0; i < ri->n_participants; i++) {
        const Kvfence__V1__ParticipantInfo *p = ri->participants[i];
        if (p->participant && p->participant->node_id &&
            strcmp(p->participant->node_id, node) == 0 && p->participant->rank == rank &&
            (int)p->participant->role == role)
            done = p->completed;
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    return done;
}

static void test_sink_waits_for_op_in_flight_into_its_pages(void **state)
{
    struct fx *f = *state;
    const char *args[] = {"--threads", "2", "--resend-ms", "200", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "rules");
    char hold[128];
    snprintf(hold, sizeof hold, "%s/hold", f->dir);
    FILE *hf = fopen(hold, "w");
    assert_non_null(hf);
    fclose(hf);
    const char *extra1[] = {"--test-local-hold-file", hold, NULL};
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, extra1, NH_LOG_FILE),
                     0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, NH_LOG_FILE), 0);
    assert_int_equal(nh_pool_create(&f->p1, "rules", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "rules", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);

    /* Sources: n2 rank 0 and n1 rank 1, pages 0..3 of their pools; the sink:
     * n1 rank 0, pages 16..19 of n1's pool. */
    const int SRC = KVFENCE__V1__ROLE__ROLE_SOURCE, SINK = KVFENCE__V1__ROLE__ROLE_SINK;
    kvf_room_key k = nh_join(f->ch, 901, 2, 1, "n2", 0, SRC, f->p2.pool_id, 0, 4, WAIT_MS, NULL);
    (void)nh_join(f->ch, 901, 2, 1, "n1", 1, SRC, f->p1.pool_id, 0, 4, WAIT_MS, NULL);
    (void)nh_join(f->ch, 901, 2, 1, "n1", 0, SINK, f->p1.pool_id, 16, 4, WAIT_MS, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n1", f->p1.pool_id, 16, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p2.pool_id, "n1", f->p1.pool_id, 16, WAIT_MS);

    /* The same-node copy: posted, held in flight. */
    struct nh_chunk local = {.source_rank = 1,
                             .seq = 1,
                             .source_pool = f->p1.pool_id,
                             .sink_node = "n1",
                             .sink_rank = 0,
                             .sink_pool = f->p1.pool_id,
                             .n = 1,
                             .sfirst = {0},
                             .dfirst = {16},
                             .count = {4},
                             .last = true};
    struct kvf_rpc_status st;
    assert_int_equal(nh_submit(f->n1.local, k, &local, &st), KVF_GRPC_OK);
    nh_wait_log(&f->n1, "test: local copies held", NULL, 1, WAIT_MS);

    /* The remote source covers every sink page and reports ok. */
    struct nh_chunk remote = local;
    remote.source_rank = 0;
    remote.source_pool = f->p2.pool_id;
    int code;
    int64_t end = nh_now_ms() + WAIT_MS;
    while ((code = nh_submit(f->n2.local, k, &remote, &st)) == KVF_GRPC_UNAVAILABLE &&
           nh_now_ms() < end)
        nh_sleep_ms(5);
    assert_int_equal(code, KVF_GRPC_OK);
    end = nh_now_ms() + WAIT_MS;
    while (!part_completed(f, k, "n2", 0, SRC)) {
        if (nh_now_ms() > end)
            fail_msg("the remote source never completed");
        nh_sleep_ms(10);
    }
    /* Its status reaches n1 right after; the held copy keeps the sink open. */
    nh_sleep_ms(500);
    if (part_completed(f, k, "n1", 0, SINK))
        fail_msg("the sink reported Completed while a copy into its pages was in flight");
    assert_int_equal(nh_log_count(&f->n1, "sink completed", &k), 0);

    /* The copy runs: the sink completes, then the room. */
    assert_int_equal(unlink(hold), 0);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_chunk_for_new_pair_after_source_completed_fails_room,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_extended_sink_pages_reach_source_after_sink, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_frame_before_source_is_published_lands, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_sink_waits_for_op_in_flight_into_its_pages, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_ended_rooms_are_freed_beyond_retention, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
