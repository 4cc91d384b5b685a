/*
 * test_node_peer_slots.c: a kvfence-node keeps fencing peers however many
 * incarnations they go through (issue 15): a node has a bounded number of
 * peer slots (64), and the slot of an incarnation that was fenced and that
 * no open room names any more is given to the next one.
 *
 * One kvfence-control, one real kvfence-node n1 (the source side) with a shm
 * pool, and a fake node n2 (fake_node.c) that restarts over and over: for
 * each incarnation k of n2, a room joins n1 and n2@k (ACTIVE, n1 learned the
 * room and n2@k as its peer), then n2 comes back as k+1 without a goodbye.
 * Its new Hello makes n2@k LOST: the room aborts and the control plane asks
 * n1 to fence n2@k. The room's n2 participant must show as fenced (n1 said
 * PeerFenced) every time, for 80 incarnations: more than the slots. Before
 * recycling, n1 answered "cannot fence peer n2: Argument list too long" from
 * the 65th on, and the room stayed ABORTING.
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fake_node.h"
#include "kvfence/v1/control.pb-c.h"
#include "node_harness.h"

#define WAIT_MS      10000
#define PAGE_SIZE    4096u
#define PAGE_COUNT   128u
#define INCARNATIONS 80u /* > 64 peer slots */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1;
    struct nh_pool p1;
    struct fake_node *n2;
    struct fake_node *peers[INCARNATIONS]; /* test_unreferenced_peers_are_recycled */
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    if (f->n2)
        fake_node_vanish(f->n2);
    for (unsigned i = 0; i < INCARNATIONS; i++)
        if (f->peers[i])
            fake_node_vanish(f->peers[i]);
    struct nh_node *nodes[] = {&f->n1};
    struct nh_pool *pools[] = {&f->p1};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 1, 20000, pools, 1, f->dir);
    free(f);
    return rc;
}

/* n1 learns n2's sink lease only once n2 acknowledged the RoomUpdate that
 * carries it (docs/state-cores.md, "Ordered room updates"), and the fake n2
 * acknowledges an update when it reads it: read n2's stream until n1's
 * probe says it knows the sink (nh_wait_node_knows: FAILED_PRECONDITION for
 * a source rank in no lease, UNAVAILABLE before). */
static void n1_learns_sink(struct fx *f, struct fake_node *sink, const char *sink_id,
                           kvf_room_key k, uint32_t page)
{
    struct nh_chunk probe = {.source_rank = 99,
                             .seq = 1,
                             .source_pool = f->p1.pool_id,
                             .sink_node = sink_id,
                             .sink_pool = FAKE_NODE_POOL_ID,
                             .sfirst = {0},
                             .dfirst = {page},
                             .count = {1}};
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_rpc_status st;
        int code = nh_submit(f->n1.local, k, &probe, &st);
        if (code == KVF_GRPC_FAILED_PRECONDITION)
            return;
        if (code != KVF_GRPC_UNAVAILABLE || nh_now_ms() > end)
            fail_msg("n1 does not learn %s's sink: %d %s", sink_id, code, st.message);
        Kvfence__V1__ControlMessage *m = NULL;
        if (fake_node_recv(sink, 10, &m, &st) == 0)
            kvfence__v1__control_message__free_unpacked(m, NULL);
    }
}

/* Whether every other node fenced n2's participant in room `k`. */
static bool n2_fenced(struct fx *f, kvf_room_key k)
{
    Kvfence__V1__RoomInfo *ri = nh_get_room(f->ch, k);
    bool fenced = false;
    for (size_t i = 0; i < ri->n_participants; i++) {
        const Kvfence__V1__ParticipantInfo *p = ri->participants[i];
        if (p->participant && p->participant->node_id && strcmp(p->participant->node_id, "n2") == 0)
            fenced = p->fenced;
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    return fenced;
}

static void test_fence_peer_never_runs_out_of_slots(void **state)
{
    struct fx *f = *state;
    const char *args[] = {"--threads", "2", "--resend-ms", "100", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "slots");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, NH_LOG_FILE), 0);
    assert_int_equal(nh_pool_create(&f->p1, "slots", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);

    f->n2 = fake_node_attach(f->ch, "n2", 1);
    assert_non_null(f->n2);
    for (uint64_t inc = 1; inc <= INCARNATIONS; inc++) {
        /* Each room its own pages: n2's old leases wait for a proof from its
         * host, which this fake never gives. */
        uint32_t page = (uint32_t)inc;
        kvf_room_key k = nh_join_pair(f->ch, 1000 + inc, "n1", f->p1.pool_id, page, "n2",
                                      FAKE_NODE_POOL_ID, page, 1, WAIT_MS);
        n1_learns_sink(f, f->n2, "n2", k, page);

        /* n2 restarts: n2@inc is LOST, n1 must fence it. */
        fake_node_vanish(f->n2);
        f->n2 = fake_node_attach(f->ch, "n2", inc + 1);
        assert_non_null(f->n2);
        int64_t end = nh_now_ms() + WAIT_MS;
        while (!n2_fenced(f, k)) {
            if (nh_now_ms() > end) {
                nh_node_dump_log(&f->n1);
                fail_msg("incarnation %" PRIu64 " of n2: n1 did not fence it", inc);
            }
            nh_sleep_ms(10);
        }
    }
    /* n1 is well and recycled slots: it said so. */
    assert_true(nh_log_count(&f->n1, "forgotten", NULL) > 0);
    assert_int_equal(nh_log_count(&f->n1, "cannot fence peer", NULL), 0);
}

/* Peers that no live room names need no slot, fenced or not: 80 nodes
 * (more than the 64 slots), each the sink of one room with n1 that is
 * aborted at once; n1's lifetime drains (nothing in flight), so the room
 * names its peer no more, while the control plane never asks n1 to fence
 * anyone (every node stays attached; the rooms wait for the fakes' Drained).
 * n1 must still learn every new peer. Before, only a fenced peer's slot was
 * recycled: from the 65th node on n1 logged "cannot add peer" and never
 * learned the sink. */
static void test_unreferenced_peers_are_recycled(void **state)
{
    struct fx *f = *state;
    const char *args[] = {"--threads", "2", "--resend-ms", "100", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "slots");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, NH_LOG_FILE), 0);
    assert_int_equal(nh_pool_create(&f->p1, "slots", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    for (unsigned i = 0; i < INCARNATIONS; i++) {
        char id[16];
        snprintf(id, sizeof id, "p%u", i);
        f->peers[i] = fake_node_attach(f->ch, id, 1);
        assert_non_null(f->peers[i]);
        uint32_t page = i + 1;
        kvf_room_key k = nh_join_pair(f->ch, 2000 + i, "n1", f->p1.pool_id, page, id,
                                      FAKE_NODE_POOL_ID, page, 1, WAIT_MS);
        n1_learns_sink(f, f->peers[i], id, k, page);
        nh_abort_room(f->ch, k, "the next peer");
    }
    assert_int_equal(nh_log_count(&f->n1, "cannot add peer", NULL), 0);
    assert_true(nh_log_count(&f->n1, "unreferenced", NULL) > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_fence_peer_never_runs_out_of_slots, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unreferenced_peers_are_recycled, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
