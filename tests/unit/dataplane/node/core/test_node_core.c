/*
 * test_node_core.c: the node's rules core (dataplane/node/core), stepped by
 * hand: no threads, no clock, no I/O. Each test drives the core with calls
 * and checks the effects it emits, in order.
 *
 * Checked: an abort with ops in flight drains only when the last op retires
 * and reports Drained once, again for a repeated notice; a tokenless end
 * reports nothing; the room's drained event is emitted once; completion
 * of every local participant closes admission and drains; a sink is not
 * ready while a receive is in flight or bytes are unaccounted for; terminal
 * rooms beyond retain_max are forgotten oldest first (lifetime gone, later
 * messages late) and live rooms never are; peer slots of fenced,
 * unreferenced incarnations are recycled so that 200 incarnations fit in 4
 * slots, and a referenced or unfenced slot is never taken; chunk admission:
 * a chunk for a new pair after the source completed is refused and fails the
 * room once, the pair's order, a missing room late or not yet known; a held
 * terminal room is not forgotten until released.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "node_core.h"

static struct kvf_ncore *core_new(size_t retain, uint32_t peers)
{
    struct kvf_ncore_opts o;
    kvf_ncore_opts_init(&o);
    o.retain_max = retain;
    o.max_peers = peers;
    struct kvf_ncore *c = kvf_ncore_create(&o);
    assert_non_null(c);
    return c;
}

/* The next effect must be of `kind`; returns it. */
static struct kvf_ncore_fx expect_fx(struct kvf_ncore *c, enum kvf_ncore_fx_kind kind)
{
    struct kvf_ncore_fx f;
    assert_true(kvf_ncore_fx_take(c, &f));
    assert_int_equal(f.kind, kind);
    return f;
}

static void expect_no_fx(struct kvf_ncore *c)
{
    struct kvf_ncore_fx f;
    bool got = kvf_ncore_fx_take(c, &f);
    if (got)
        fail_msg("unexpected effect %d", (int)f.kind);
}

static void test_abort_drains_after_last_op(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 4);
    struct kvf_ncore_room r;
    kvf_room_key key = {7, 1};
    assert_int_equal(kvf_ncore_room_open(c, &r, key, &r), 0);
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_admit(r.lt, &op, KVF_LT_OP_TCP_FRAME, 0), 0);

    kvf_token tok = {1, 2};
    kvf_ncore_room_abort(c, &r, tok, 11);
    expect_fx(c, KVF_NCORE_FX_CLOSE_PEERS);
    struct kvf_ncore_fx f = expect_fx(c, KVF_NCORE_FX_ROOM_ABORTING);
    assert_ptr_equal(f.user, &r);
    expect_no_fx(c); /* an op is in flight: no Drained */
    kvf_ncore_room_check(c, &r);
    expect_no_fx(c);
    assert_false(kvf_ncore_room_terminal(&r));

    assert_true(kvf_lt_op_retire(&op, KVF_LT_DONE_OK));
    kvf_ncore_room_check(c, &r);
    expect_fx(c, KVF_NCORE_FX_ROOM_DRAINED);
    f = expect_fx(c, KVF_NCORE_FX_SEND_DRAINED);
    assert_true(kvf_room_key_eq(f.room, key));
    assert_true(kvf_token_eq(r.token, tok));
    assert_int_equal(r.notice_id, 11);
    expect_no_fx(c);
    kvf_ncore_room_check(c, &r); /* asked again: nothing new */
    expect_no_fx(c);
    assert_true(kvf_ncore_room_terminal(&r));

    /* A repeated notice is answered again, the drained event is not. */
    kvf_ncore_room_abort(c, &r, tok, 12);
    expect_fx(c, KVF_NCORE_FX_SEND_DRAINED);
    expect_no_fx(c);
    assert_int_equal(r.notice_id, 12);
    kvf_ncore_destroy(c);
}

static void test_tokenless_end_reports_nothing(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 4);
    struct kvf_ncore_room r;
    assert_int_equal(kvf_ncore_room_open(c, &r, (kvf_room_key){3, 2}, NULL), 0);
    kvf_ncore_room_end(c, &r);
    expect_fx(c, KVF_NCORE_FX_CLOSE_PEERS);
    expect_fx(c, KVF_NCORE_FX_ROOM_DRAINED);
    expect_no_fx(c);
    assert_true(kvf_ncore_room_terminal(&r));
    kvf_ncore_destroy(c);
}

static void test_completion_closes_and_drains(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 4);
    struct kvf_ncore_room r;
    assert_int_equal(kvf_ncore_room_open(c, &r, (kvf_room_key){5, 1}, NULL), 0);
    kvf_ncore_room_members(c, &r, 2, 0);

    assert_int_equal(kvf_ncore_part_completed(c, &r, 0, false), 0);
    struct kvf_ncore_fx f = expect_fx(c, KVF_NCORE_FX_SEND_COMPLETED);
    assert_int_equal(f.rank, 0);
    assert_false(f.sink);
    expect_no_fx(c);
    assert_int_equal(kvf_lt_state(r.lt), KVF_LT_OPEN); /* one participant left */

    assert_int_equal(kvf_ncore_part_completed(c, &r, 1, true), 0);
    f = expect_fx(c, KVF_NCORE_FX_SEND_COMPLETED);
    assert_int_equal(f.rank, 1);
    assert_true(f.sink);
    expect_fx(c, KVF_NCORE_FX_CLOSE_PEERS);
    expect_fx(c, KVF_NCORE_FX_ROOM_DRAINED);
    expect_no_fx(c); /* never aborted: no Drained report */
    assert_true(kvf_ncore_room_terminal(&r));

    /* An aborting room completes nothing. */
    struct kvf_ncore_room a;
    assert_int_equal(kvf_ncore_room_open(c, &a, (kvf_room_key){6, 1}, NULL), 0);
    kvf_ncore_room_members(c, &a, 1, 0);
    kvf_ncore_room_abort(c, &a, (kvf_token){1, 1}, 1);
    while (kvf_ncore_fx_take(c, &f))
        ;
    assert_int_equal(kvf_ncore_part_completed(c, &a, 0, true), -ECANCELED);
    assert_string_equal(kvf_ncore_reason(c), "room is aborting");
    expect_no_fx(c);
    kvf_ncore_destroy(c);
}

static void test_sink_ready_rule(void **state)
{
    (void)state;
    struct kvf_ncore_sink s = {
        .pages = 4, .pages_landed = 4, .bytes_landed = 100, .status_bytes = 100, .rx_inflight = 0};
    assert_true(kvf_ncore_sink_ready(&s));
    s.rx_inflight = 1; /* a receive is landing bytes: not complete */
    assert_false(kvf_ncore_sink_ready(&s));
    s.rx_inflight = 0;
    s.pages_landed = 3;
    assert_false(kvf_ncore_sink_ready(&s));
    s.pages_landed = 4;
    s.status_bytes = 60; /* a source has not said it is done */
    assert_false(kvf_ncore_sink_ready(&s));
}

/* Opens room `id`, ends it and drains it: terminal. */
static void terminal_room(struct kvf_ncore *c, struct kvf_ncore_room *r, uint64_t id)
{
    assert_int_equal(kvf_ncore_room_open(c, r, (kvf_room_key){id, 1}, r), 0);
    kvf_ncore_room_end(c, r);
}

static void test_retention_is_bounded_oldest_first(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(3, 4);
    struct kvf_ncore_room live;
    assert_int_equal(kvf_ncore_room_open(c, &live, (kvf_room_key){1, 1}, &live), 0);
    struct kvf_ncore_room r[6];
    for (int i = 0; i < 6; i++)
        terminal_room(c, &r[i], (uint64_t)(10 + i));
    struct kvf_ncore_fx f;
    while (kvf_ncore_fx_take(c, &f))
        ;
    struct kvf_ncore_stats st;
    kvf_ncore_stats(c, &st);
    assert_int_equal(st.retained, 6);
    assert_int_equal(st.lifetimes, 7);

    assert_int_equal(kvf_ncore_collect(c), 3);
    for (int i = 0; i < 3; i++) {
        f = expect_fx(c, KVF_NCORE_FX_ROOM_FREE);
        assert_ptr_equal(f.user, &r[i]); /* oldest first */
        assert_true(kvf_lt_table_is_late(kvf_ncore_lts(c), (kvf_room_key){(uint64_t)(10 + i), 1}));
        assert_null(kvf_lt_table_find(kvf_ncore_lts(c), (kvf_room_key){(uint64_t)(10 + i), 1}));
    }
    expect_no_fx(c);
    kvf_ncore_stats(c, &st);
    assert_int_equal(st.retained, 3);
    assert_int_equal(st.lifetimes, 4); /* the live room and the three retained */
    assert_int_equal(st.rooms_forgotten, 3);
    assert_int_equal(kvf_ncore_collect(c), 0);
    /* A late generation cannot be opened again. */
    struct kvf_ncore_room again;
    assert_int_equal(kvf_ncore_room_open(c, &again, (kvf_room_key){10, 1}, NULL), -ESTALE);
    assert_string_equal(kvf_ncore_reason(c), "room generation is late here");
    /* The live room stays however many end after it. */
    assert_non_null(kvf_lt_table_find(kvf_ncore_lts(c), (kvf_room_key){1, 1}));
    kvf_ncore_destroy(c);
}

static void test_peer_slots_recycle_fenced_unreferenced(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 4);
    uint32_t idx, held;
    bool fresh;
    /* Slot 0: a live peer that a room references, never fenced. */
    assert_int_equal(kvf_ncore_peer_get(c, "live", 1, &held, &fresh), 0);
    assert_true(fresh);
    kvf_ncore_peer_ref(c, held);
    /* 200 incarnations of one peer, each fenced after use, fit in 3 slots. */
    for (uint64_t inc = 1; inc <= 200; inc++) {
        assert_int_equal(kvf_ncore_peer_get(c, "n2", inc, &idx, &fresh), 0);
        assert_true(fresh);
        assert_int_not_equal(idx, held);
        struct kvf_ncore_fx f;
        if (inc > 3) {
            f = expect_fx(c, KVF_NCORE_FX_PEER_RECYCLE);
            assert_int_equal(f.peer, idx);
        }
        expect_no_fx(c);
        assert_int_equal(kvf_ncore_peer_get(c, "n2", inc, &idx, &fresh), 0);
        assert_false(fresh); /* found, not taken again */
        kvf_ncore_peer_fenced(c, idx);
    }
    struct kvf_ncore_stats st;
    kvf_ncore_stats(c, &st);
    assert_int_equal(st.peers_recycled, 197);
    assert_int_equal(kvf_ncore_peer_find(c, "live", 1, &idx), 0);

    /* Fenced but still referenced by a room: not recycled. */
    kvf_ncore_peer_fenced(c, held);
    for (uint64_t inc = 1000; inc < 1003; inc++) {
        assert_int_equal(kvf_ncore_peer_get(c, "n3", inc, &idx, NULL), 0);
        kvf_ncore_peer_ref(c, idx); /* live and referenced */
    }
    assert_int_equal(kvf_ncore_peer_get(c, "n4", 1, &idx, NULL), -E2BIG);
    assert_non_null(strstr(kvf_ncore_reason(c), "peer slot"));
    kvf_ncore_peer_unref(c, held); /* the room that named it is gone */
    while (kvf_ncore_fx_take(c, &(struct kvf_ncore_fx){0}))
        ;
    assert_int_equal(kvf_ncore_peer_get(c, "n4", 1, &idx, NULL), 0);
    assert_int_equal(idx, held);
    assert_int_equal(kvf_ncore_peer_find(c, "live", 1, &idx), -ENOENT);
    assert_int_equal(kvf_ncore_peer_get(c, "", 1, &idx, NULL), -EINVAL);
    kvf_ncore_destroy(c);
}

/* A peer that restarts or fences itself is never fenced here (no FencePeer
 * names it when no live room shares it), and a peer no room talks to any
 * more needs no slot: unreferenced slots are recycled too, an older
 * incarnation of the same node first, and the caller is told to fence them
 * before it forgets them. */
static void test_peer_slots_recycle_unfenced_unreferenced(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 3);
    uint32_t idx, held, other;
    struct kvf_ncore_fx f;
    assert_int_equal(kvf_ncore_peer_get(c, "live", 1, &held, NULL), 0);
    kvf_ncore_peer_ref(c, held);
    assert_int_equal(kvf_ncore_peer_get(c, "n3", 1, &other, NULL), 0);
    /* 100 restarts of n2, none fenced here, in the one slot left over. */
    uint32_t n2_slot = UINT32_MAX;
    for (uint64_t inc = 1; inc <= 100; inc++) {
        assert_int_equal(kvf_ncore_peer_get(c, "n2", inc, &idx, NULL), 0);
        if (inc > 1) {
            f = expect_fx(c, KVF_NCORE_FX_PEER_RECYCLE);
            assert_int_equal(f.peer, idx);
            assert_true(f.fence);
            assert_int_equal(idx, n2_slot); /* its own old slot, not n3's */
        }
        expect_no_fx(c);
        n2_slot = idx;
    }
    assert_int_equal(kvf_ncore_peer_find(c, "n3", 1, &idx), 0);
    /* A new peer takes an unreferenced slot (n3: no room names it). */
    kvf_ncore_peer_ref(c, n2_slot);
    assert_int_equal(kvf_ncore_peer_get(c, "n4", 1, &idx, NULL), 0);
    assert_int_equal(idx, other);
    f = expect_fx(c, KVF_NCORE_FX_PEER_RECYCLE);
    assert_true(f.fence);
    expect_no_fx(c);
    /* Every slot referenced: refused, nothing recycled. */
    kvf_ncore_peer_ref(c, idx);
    assert_int_equal(kvf_ncore_peer_get(c, "n5", 1, &idx, NULL), -E2BIG);
    expect_no_fx(c);
    kvf_ncore_destroy(c);
}

static void test_effect_queue_grows(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(1000, 4);
    static struct kvf_ncore_room r[100];
    for (int i = 0; i < 100; i++)
        terminal_room(c, &r[i], (uint64_t)(i + 1));
    assert_int_equal(kvf_ncore_fx_pending(c), 200);
    for (int i = 0; i < 100; i++) {
        expect_fx(c, KVF_NCORE_FX_CLOSE_PEERS);
        struct kvf_ncore_fx f = expect_fx(c, KVF_NCORE_FX_ROOM_DRAINED);
        assert_int_equal(f.room.room_id, (uint64_t)(i + 1));
    }
    expect_no_fx(c);
    kvf_ncore_destroy(c);
}

static struct kvf_ncore_chunk chunk_ok(void)
{
    struct kvf_ncore_chunk q = {.have_update = true,
                                .src_local = true,
                                .sink_known = true,
                                .seq = 1,
                                .src_rank = 0,
                                .sink_rank = 1,
                                .sink_node = "n2"};
    return q;
}

static void test_chunk_rules(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(8, 4);
    struct kvf_ncore_room r;
    assert_int_equal(kvf_ncore_room_open(c, &r, (kvf_room_key){9, 1}, &r), 0);
    struct kvf_ncore_chunk q = chunk_ok();
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), 0);
    assert_int_equal(kvf_ncore_chunk_order(c, &q), 0);
    expect_no_fx(c);

    q.have_update = false;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EAGAIN);
    q = chunk_ok();
    q.src_local = false;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EPROTO);
    assert_non_null(strstr(kvf_ncore_reason(c), "source_rank"));
    q = chunk_ok();
    q.sink_known = false;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EPROTO);
    assert_non_null(strstr(kvf_ncore_reason(c), "sink"));

    /* Order within a pair. */
    q = chunk_ok();
    q.pair_exists = true;
    q.pair_last_seq = 4;
    q.seq = 4;
    assert_int_equal(kvf_ncore_chunk_order(c, &q), -EEXIST);
    assert_non_null(strstr(kvf_ncore_reason(c), "chunk_seq"));
    q.seq = 5;
    assert_int_equal(kvf_ncore_chunk_order(c, &q), 0);
    q.pair_last_submitted = true;
    assert_int_equal(kvf_ncore_chunk_order(c, &q), -EPROTO);

    /* The source completed: an old pair is refused, a new pair fails the room,
     * once. */
    q = chunk_ok();
    q.src_completed = true;
    q.pair_exists = true;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EPROTO);
    expect_no_fx(c);
    q.pair_exists = false;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EPROTO);
    assert_non_null(strstr(kvf_ncore_reason(c), "the room fails"));
    struct kvf_ncore_fx f = expect_fx(c, KVF_NCORE_FX_SEND_FAILED);
    assert_int_equal(f.rank, 0);
    assert_false(f.sink);
    assert_non_null(strstr(f.reason, "sink n2 rank 1"));
    expect_no_fx(c);
    q.src_failed = true; /* reported already */
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -EPROTO);
    expect_no_fx(c);

    /* Aborting, then closed. */
    q = chunk_ok();
    kvf_ncore_room_abort(c, &r, (kvf_token){1, 1}, 1);
    while (kvf_ncore_fx_take(c, &f))
        ;
    assert_int_equal(kvf_ncore_chunk_state(c, &r, &q), -ECANCELED);
    assert_non_null(strstr(kvf_ncore_reason(c), "aborting"));
    struct kvf_ncore_room r2;
    assert_int_equal(kvf_ncore_room_open(c, &r2, (kvf_room_key){10, 2}, &r2), 0);
    kvf_ncore_room_end(c, &r2);
    while (kvf_ncore_fx_take(c, &f))
        ;
    assert_int_equal(kvf_ncore_chunk_state(c, &r2, &q), -ECANCELED);
    assert_non_null(strstr(kvf_ncore_reason(c), "closed"));

    /* No room: late once forgotten or older, else not yet known. */
    assert_int_equal(kvf_ncore_chunk_no_room(c, (kvf_room_key){11, 3}, false), -EAGAIN);
    assert_int_equal(kvf_ncore_chunk_no_room(c, (kvf_room_key){11, 3}, true), -ESTALE);
    assert_int_equal(kvf_ncore_chunk_no_room(c, (kvf_room_key){10, 1}, false), -ESTALE);
    kvf_ncore_destroy(c);
}

static void test_held_room_is_not_forgotten(void **state)
{
    (void)state;
    struct kvf_ncore *c = core_new(0, 4);
    struct kvf_ncore_room a, b;
    terminal_room(c, &a, 1);
    terminal_room(c, &b, 2);
    kvf_ncore_room_hold(&a);
    struct kvf_ncore_fx f;
    while (kvf_ncore_fx_take(c, &f))
        ;
    assert_int_equal(kvf_ncore_collect(c), 1);
    f = expect_fx(c, KVF_NCORE_FX_ROOM_FREE);
    assert_ptr_equal(f.user, &b);
    expect_no_fx(c);
    kvf_ncore_room_release(&a);
    assert_int_equal(kvf_ncore_collect(c), 1);
    f = expect_fx(c, KVF_NCORE_FX_ROOM_FREE);
    assert_ptr_equal(f.user, &a);
    kvf_ncore_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_abort_drains_after_last_op),
        cmocka_unit_test(test_tokenless_end_reports_nothing),
        cmocka_unit_test(test_completion_closes_and_drains),
        cmocka_unit_test(test_sink_ready_rule),
        cmocka_unit_test(test_retention_is_bounded_oldest_first),
        cmocka_unit_test(test_peer_slots_recycle_fenced_unreferenced),
        cmocka_unit_test(test_peer_slots_recycle_unfenced_unreferenced),
        cmocka_unit_test(test_effect_queue_grows),
        cmocka_unit_test(test_chunk_rules),
        cmocka_unit_test(test_held_room_is_not_forgotten),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
