/*
 * test_lifetime.c: the node lifetime core, stepped by hand on one thread.
 *
 * Each test is one race scenario of tests/README.md (the race it closes is
 * named in its comment). A test holds ops "in flight" for as long as it likes
 * and fires completions in the order it wants; after every step it checks what
 * the node would do: whether it may report drained, release pages or staging
 * buffers, admit new work, or tear down.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "lifetime.h"
#include "lifetime_internal.h"

#define PEER_A 1u
#define PEER_B 2u

static kvf_room_key key(uint64_t room_id, uint64_t generation)
{
    kvf_room_key k = {.room_id = room_id, .generation = generation};
    return k;
}

/* A chunk as the transfer pipeline would embed it. */
struct fixture {
    struct kvf_lt_table *t;
    struct kvf_lt *lt;
};

static int setup(void **state)
{
    static struct fixture f;
    f.t = kvf_lt_table_create();
    if (f.t == NULL)
        return -1;
    if (kvf_lt_table_open(f.t, key(7, 10), &f.lt) != 0)
        return -1;
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    kvf_lt_table_destroy(f->t);
    return 0;
}

/* No drained event yet: the node must not report, release or forget. */
static void assert_not_drained(struct kvf_lt_table *t, struct kvf_lt *lt)
{
    assert_int_not_equal(kvf_lt_state(lt), KVF_LT_DRAINED);
    assert_false(kvf_lt_take_drained(lt));
    assert_false(kvf_lt_table_can_teardown(t));
    assert_int_equal(kvf_lt_table_forget(t, kvf_lt_key(lt)), -EBUSY);
}

/* ---- abort flows ---------------------------------------------------------- */

/* R1: a native write is blocked in flight when the abort arrives. Nothing may be
 * reported until it completes; then exactly one drained event. */
static void blocked_native_write_then_abort_drains_only_after_last_retire(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op w1, w2;
    assert_int_equal(kvf_lt_admit(f->lt, &w1, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(f->lt, &w2, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_ptr_equal(w1.lt, f->lt);
    assert_true(kvf_lt_is_open(f->lt));

    assert_false(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_CLOSED);
    assert_false(kvf_lt_is_open(f->lt));
    assert_int_equal(kvf_lt_inflight(f->lt), 2);
    assert_not_drained(f->t, f->lt);

    assert_false(kvf_lt_op_retire(&w1, KVF_LT_DONE_OK));
    assert_not_drained(f->t, f->lt);

    assert_true(kvf_lt_op_retire(&w2, KVF_LT_DONE_OK)); /* the last one is the drain */
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt));
    assert_false(kvf_lt_take_drained(f->lt)); /* exactly once */
    assert_true(kvf_lt_table_can_teardown(f->t));
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), 0);
    assert_null(kvf_lt_table_find(f->t, key(7, 10)));
}

/* Abort before the room has metadata: the fresh lifetime drains at the close
 * itself, and any later admission (metadata, chunk, staging) is refused. */
static void
abort_between_metadata_and_first_chunk_drains_at_once_and_refuses_admission(void **state)
{
    struct fixture *f = *state;
    assert_false(kvf_lt_take_drained(f->lt)); /* open: nothing to take */
    assert_true(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt));

    struct kvf_lt_op op;
    struct kvf_lt_staging s;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_TCP_FRAME, PEER_A), -ECANCELED);
    assert_int_equal(kvf_lt_staging_acquire(f->lt, &s, PEER_A), -ECANCELED);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    assert_true(kvf_lt_table_is_late(f->t, key(7, 10)));
}

/* Abort before any metadata: the notice is the first the node hears of the
 * room. It opens the lifetime only to close it, so that the room update that
 * arrives afterwards is recognised as late and opens nothing. */
static void abort_before_metadata_makes_the_later_metadata_late(void **state)
{
    struct fixture *f = *state;
    kvf_room_key k = key(9, 20);
    assert_false(kvf_lt_table_is_late(f->t, k));
    struct kvf_lt *lt;
    assert_int_equal(kvf_lt_table_open(f->t, k, &lt), 0);
    assert_true(kvf_lt_close(lt));
    assert_true(kvf_lt_take_drained(lt));
    assert_false(kvf_lt_take_drained(lt));
    /* The room update arrives now. */
    assert_true(kvf_lt_table_is_late(f->t, k));
    struct kvf_lt *again;
    assert_int_equal(kvf_lt_table_open(f->t, k, &again), -EEXIST);
    assert_int_equal(kvf_lt_table_forget(f->t, k), 0);
    assert_true(kvf_lt_table_is_late(f->t, k));
    assert_int_equal(kvf_lt_table_open(f->t, k, &again), -ESTALE);
}

/* R4: one sibling op ends in error while another is still running. The error
 * stops only the failed op; the room drains when the running one retires. */
static void one_sibling_fails_while_another_is_held_no_drain_until_it_retires(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op layer0, layer1;
    assert_int_equal(kvf_lt_admit(f->lt, &layer0, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(f->lt, &layer1, KVF_LT_OP_CUDA_COPY, PEER_A), 0);

    assert_false(kvf_lt_op_retire(&layer0, KVF_LT_DONE_ERROR));
    assert_false(kvf_lt_close(f->lt)); /* the failure aborts the room */
    assert_not_drained(f->t, f->lt);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_CUDA_COPY), 1);

    assert_true(kvf_lt_op_retire(&layer1, KVF_LT_DONE_OK));
    assert_true(kvf_lt_take_drained(f->lt));
}

/* R3: an error return while work may still be posted proves nothing. The op is
 * quarantined (admission shut at once) until its terminal completion. */
static void error_return_with_work_posted_is_quarantined_until_terminal_completion(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    kvf_lt_op_quarantine(&op);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_QUARANTINED);
    assert_false(kvf_lt_is_open(f->lt));
    struct kvf_lt_op late;
    assert_int_equal(kvf_lt_admit(f->lt, &late, KVF_LT_OP_RDMA_WR, PEER_A), -ECANCELED);
    assert_false(kvf_lt_close(f->lt)); /* the abort notice that follows */
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_QUARANTINED);
    assert_not_drained(f->t, f->lt);

    assert_true(kvf_lt_op_retire(&op, KVF_LT_DONE_ERROR)); /* terminal completion */
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt));
    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_A), 0); /* nothing left to fence */
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

/* R3 with no terminal completion ever: only the fence of the op's own peer
 * retires it. Fencing another peer changes nothing. */
static void quarantined_op_is_retired_by_the_fence_of_its_peer_only(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_TCP_FRAME, PEER_A), 0);
    kvf_lt_op_quarantine(&op);
    assert_false(kvf_lt_close(f->lt));

    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_B), 0);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_QUARANTINED);
    assert_not_drained(f->t, f->lt);

    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_A), 1);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt));
    assert_false(kvf_lt_take_drained(f->lt));
    /* A stray completion after the fence is ignored, not counted twice. */
    assert_false(kvf_lt_op_retire(&op, KVF_LT_DONE_FLUSHED));
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

/* Quarantined ops of several rooms to one peer: one fence drains them all. */
static void one_fence_drains_every_room_quarantined_on_that_peer(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt *other;
    assert_int_equal(kvf_lt_table_open(f->t, key(8, 11), &other), 0);
    struct kvf_lt_op a1, a2, b1;
    assert_int_equal(kvf_lt_admit(f->lt, &a1, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(f->lt, &a2, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(other, &b1, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    kvf_lt_op_quarantine(&a1);
    kvf_lt_op_quarantine(&a2);
    kvf_lt_op_quarantine(&b1);
    kvf_lt_op_quarantine(&b1); /* repeated: no double count */
    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_A), 2);
    assert_true(kvf_lt_take_drained(f->lt));
    assert_true(kvf_lt_take_drained(other));
    assert_true(kvf_lt_table_can_teardown(f->t));
}

/* A fence of a peer also flushes the ops that were not quarantined: their
 * flush completions retire them through the ordinary path. */
static void flush_completions_on_fence_retire_normally(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op posted[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvf_lt_admit(f->lt, &posted[i], KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_false(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_A), 0); /* none quarantined */
    assert_int_equal(kvf_lt_inflight(f->lt), 3); /* the fence alone proves nothing here */
    assert_false(kvf_lt_op_retire(&posted[0], KVF_LT_DONE_FLUSHED));
    assert_false(kvf_lt_op_retire(&posted[1], KVF_LT_DONE_FLUSHED));
    assert_not_drained(f->t, f->lt);
    assert_true(kvf_lt_op_retire(&posted[2], KVF_LT_DONE_FLUSHED));
    assert_true(kvf_lt_take_drained(f->lt));
}

/* A duplicated abort notice changes nothing: one drained event in total. */
static void duplicate_close_is_idempotent_and_drains_once(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_TCP_FRAME, PEER_A), 0);
    assert_false(kvf_lt_close(f->lt));
    assert_false(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_inflight(f->lt), 1);
    assert_true(kvf_lt_op_retire(&op, KVF_LT_DONE_OK));
    assert_false(kvf_lt_close(f->lt)); /* after the drain too */
    assert_true(kvf_lt_take_drained(f->lt));
    assert_false(kvf_lt_close(f->lt));
    assert_false(kvf_lt_take_drained(f->lt));

    /* A fresh lifetime closed twice: the first close is the drain, not the second. */
    struct kvf_lt *fresh;
    assert_int_equal(kvf_lt_table_open(f->t, key(9, 12), &fresh), 0);
    assert_true(kvf_lt_close(fresh));
    assert_false(kvf_lt_close(fresh));
    assert_true(kvf_lt_take_drained(fresh));
    assert_false(kvf_lt_take_drained(fresh));
}

/* ---- staging (R9) ---------------------------------------------------------- */

static void staging_abort_with_rdma_in_flight(struct fixture *f, bool transport_first)
{
    struct kvf_lt_staging s;
    bool drained = true;
    assert_int_equal(kvf_lt_staging_acquire(f->lt, &s, PEER_A), 0);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_STAGING), 1);
    assert_false(kvf_lt_close(f->lt)); /* abort while RDMA lands in the buffer */

    if (transport_first)
        assert_false(kvf_lt_staging_transport_done(&s, &drained));
    else
        assert_false(kvf_lt_staging_copy_done(&s, &drained));
    assert_false(drained); /* the buffer must not go back to its ring yet */
    assert_not_drained(f->t, f->lt);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_STAGING), 1);

    if (transport_first)
        assert_true(kvf_lt_staging_copy_done(&s, &drained));
    else
        assert_true(kvf_lt_staging_transport_done(&s, &drained));
    assert_true(drained); /* both done: the buffer may go back, and the room drained */
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_STAGING), 0);
    assert_true(kvf_lt_take_drained(f->lt));
}

static void staging_abort_with_rdma_in_flight_transport_then_copy(void **state)
{
    staging_abort_with_rdma_in_flight(*state, true);
}

static void staging_abort_with_rdma_in_flight_copy_then_transport(void **state)
{
    staging_abort_with_rdma_in_flight(*state, false);
}

/* Reporting one side twice is ignored: it never stands in for the other side. */
static void staging_same_side_twice_is_ignored(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_staging s;
    bool drained = true;
    assert_int_equal(kvf_lt_staging_acquire(f->lt, &s, PEER_A), 0);
    assert_false(kvf_lt_staging_copy_done(&s, &drained));
    assert_false(kvf_lt_staging_copy_done(&s, &drained));
    assert_false(drained);
    assert_int_equal(kvf_lt_inflight(f->lt), 1);
    assert_true(kvf_lt_staging_transport_done(&s, NULL));
    assert_false(kvf_lt_staging_transport_done(&s, &drained)); /* after release: ignored */
    assert_false(drained);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_OPEN); /* a finished buffer drains nothing */
}

/* Quarantine is about network ops: a staging buffer is not retired by a fence,
 * since a fence does not stop the CUDA copy into it. */
static void fence_never_releases_a_staging_buffer(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_staging s;
    assert_int_equal(kvf_lt_staging_acquire(f->lt, &s, PEER_A), 0);
    kvf_lt_op_quarantine(&s.op); /* ignored for STAGING */
    assert_false(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_A), 0);
    assert_not_drained(f->t, f->lt);
    assert_false(kvf_lt_staging_transport_done(&s, NULL));
    assert_true(kvf_lt_staging_copy_done(&s, NULL));
    assert_true(kvf_lt_take_drained(f->lt));
}

/* ---- late messages (R10, R13) --------------------------------------------- */

static void late_messages_after_abort_are_recognised(void **state)
{
    struct fixture *f = *state;
    kvf_room_key k = key(7, 10);
    assert_false(kvf_lt_table_is_late(f->t, k)); /* open: current */
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_false(kvf_lt_close(f->lt));
    assert_true(kvf_lt_table_is_late(f->t, k)); /* closed */
    assert_true(kvf_lt_op_retire(&op, KVF_LT_DONE_OK));
    assert_true(kvf_lt_table_is_late(f->t, k)); /* drained */
    assert_int_equal(kvf_lt_table_forget(f->t, k), 0);
    assert_true(kvf_lt_table_is_late(f->t, k));           /* forgotten */
    assert_true(kvf_lt_table_is_late(f->t, key(7, 9)));   /* an older generation */
    assert_true(kvf_lt_table_is_late(f->t, key(7, 1)));   /* much older */
    assert_true(kvf_lt_table_is_late(f->t, key(7, 0)));   /* generation 0 names nothing */
    assert_false(kvf_lt_table_is_late(f->t, key(7, 11))); /* a later generation may come */
    assert_false(kvf_lt_table_is_late(f->t, key(99, 3))); /* never seen */
    /* A forgotten generation cannot come back. */
    struct kvf_lt *again;
    assert_int_equal(kvf_lt_table_open(f->t, k, &again), -ESTALE);
}

/* R13: the id is reused with a new generation while the old one still drains.
 * The new one is current; messages for the old one stay late. */
static void new_generation_of_a_reused_id_is_not_late(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op old_op;
    assert_int_equal(kvf_lt_admit(f->lt, &old_op, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_false(kvf_lt_close(f->lt));

    struct kvf_lt *reused;
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 25), &reused), 0);
    assert_false(kvf_lt_table_is_late(f->t, key(7, 25)));
    assert_true(kvf_lt_table_is_late(f->t, key(7, 10)));
    assert_true(kvf_lt_table_is_late(f->t, key(7, 24))); /* older than one known */

    /* The old generation's completion drains the old one only. */
    assert_true(kvf_lt_op_retire(&old_op, KVF_LT_DONE_OK));
    assert_true(kvf_lt_take_drained(f->lt));
    assert_false(kvf_lt_take_drained(reused));
    assert_int_equal(kvf_lt_state(reused), KVF_LT_OPEN);
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), 0);
    assert_false(kvf_lt_table_is_late(f->t, key(7, 25)));
    assert_true(kvf_lt_table_is_late(f->t, key(7, 10)));
    /* And after both are forgotten, a third generation is still welcome. */
    assert_true(kvf_lt_close(reused));
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 25)), 0);
    assert_false(kvf_lt_table_is_late(f->t, key(7, 26)));
    struct kvf_lt *third;
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 26), &third), 0);
}

/* Forgotten-generation memory is bounded: past the cap, the oldest ids fold into
 * one floor, and everything at or below it stays late. */
static void forgotten_memory_is_bounded_and_stays_late(void **state)
{
    struct fixture *f = *state;
    lt_table_set_forgotten_cap(f->t, 2);
    assert_true(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), 0);
    for (uint64_t id = 100; id < 104; id++) {
        struct kvf_lt *lt;
        assert_int_equal(kvf_lt_table_open(f->t, key(id, id), &lt), 0);
        assert_true(kvf_lt_close(lt));
        assert_int_equal(kvf_lt_table_forget(f->t, key(id, id)), 0);
    }
    assert_int_equal(f->t->forgotten_count, 2);
    assert_int_equal(f->t->ids.count, 2);
    assert_int_equal(f->t->late_floor, 101);
    for (uint64_t id = 100; id < 104; id++)
        assert_true(kvf_lt_table_is_late(f->t, key(id, id)));
    assert_true(kvf_lt_table_is_late(f->t, key(7, 10)));
    assert_true(kvf_lt_table_is_late(f->t, key(555, 50))); /* below the floor: late */
    assert_false(kvf_lt_table_is_late(f->t, key(555, 104)));
    struct kvf_lt *lt;
    assert_int_equal(kvf_lt_table_open(f->t, key(100, 100), &lt), -ESTALE);
    assert_int_equal(kvf_lt_table_open(f->t, key(100, 105), &lt), 0);
    assert_int_equal(f->t->forgotten_count, 2); /* a live id is not forgotten-only */
}

/* ---- teardown (R12) -------------------------------------------------------- */

static void teardown_waits_for_every_lifetime_to_drain(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt *closed_busy, *quarantined;
    assert_int_equal(kvf_lt_table_open(f->t, key(8, 11), &closed_busy), 0);
    assert_int_equal(kvf_lt_table_open(f->t, key(9, 12), &quarantined), 0);
    struct kvf_lt_op busy, stuck;
    assert_int_equal(kvf_lt_admit(closed_busy, &busy, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(quarantined, &stuck, KVF_LT_OP_RDMA_WR, PEER_B), 0);
    kvf_lt_op_quarantine(&stuck);
    assert_int_equal(kvf_lt_table_count(f->t), 3);

    /* Node SIGTERM: close everything. Only the idle open one drains at once. */
    assert_false(kvf_lt_table_can_teardown(f->t));
    assert_int_equal(kvf_lt_table_close_all(f->t), 1);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_int_equal(kvf_lt_state(closed_busy), KVF_LT_CLOSED);
    assert_int_equal(kvf_lt_state(quarantined), KVF_LT_QUARANTINED);
    assert_false(kvf_lt_table_can_teardown(f->t));

    assert_true(kvf_lt_op_retire(&busy, KVF_LT_DONE_OK));
    assert_false(kvf_lt_table_can_teardown(f->t)); /* the quarantined one still holds */
    assert_int_equal(kvf_lt_table_forget(f->t, key(9, 12)), -EBUSY);
    assert_int_equal(kvf_lt_table_peer_fenced(f->t, PEER_B), 1);
    assert_true(kvf_lt_table_can_teardown(f->t));
    assert_int_equal(kvf_lt_table_close_all(f->t), 0); /* idempotent */
    assert_int_equal(kvf_lt_table_forget(f->t, key(8, 11)), 0);
    assert_int_equal(kvf_lt_table_forget(f->t, key(8, 11)), -ENOENT);
    assert_int_equal(kvf_lt_table_count(f->t), 2);
}

static void teardown_is_refused_while_a_lifetime_is_open(void **state)
{
    struct fixture *f = *state;
    assert_false(kvf_lt_table_can_teardown(f->t)); /* open, even with nothing in flight */
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), -EBUSY);
    assert_true(kvf_lt_close(f->lt));
    assert_true(kvf_lt_table_can_teardown(f->t));
    struct kvf_lt_table *empty = kvf_lt_table_create();
    assert_non_null(empty);
    assert_true(kvf_lt_table_can_teardown(empty));
    kvf_lt_table_destroy(empty);
    kvf_lt_table_destroy(NULL);
}

/* ---- admission and accounting --------------------------------------------- */

static void admission_after_close_is_refused_for_every_kind(void **state)
{
    struct fixture *f = *state;
    assert_true(kvf_lt_close(f->lt));
    for (int k = 0; k < KVF_LT_OP_KIND_COUNT; k++) {
        struct kvf_lt_op op;
        assert_int_equal(kvf_lt_admit(f->lt, &op, (enum kvf_lt_op_kind)k, PEER_A), -ECANCELED);
        assert_int_equal(kvf_lt_inflight_kind(f->lt, (enum kvf_lt_op_kind)k), 0);
    }
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
}

static void inflight_is_counted_per_kind(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op ops[10];
    const enum kvf_lt_op_kind kinds[10] = {
        KVF_LT_OP_RDMA_WR,   KVF_LT_OP_RDMA_WR,   KVF_LT_OP_RDMA_WR,   KVF_LT_OP_RDMA_WR,
        KVF_LT_OP_TCP_FRAME, KVF_LT_OP_TCP_FRAME, KVF_LT_OP_TCP_FRAME, KVF_LT_OP_CUDA_COPY,
        KVF_LT_OP_CUDA_COPY, KVF_LT_OP_STAGING};
    for (int i = 0; i < 10; i++)
        assert_int_equal(kvf_lt_admit(f->lt, &ops[i], kinds[i], PEER_A), 0);
    assert_int_equal(kvf_lt_inflight(f->lt), 10);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_RDMA_WR), 4);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_TCP_FRAME), 3);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_CUDA_COPY), 2);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_STAGING), 1);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_KIND_COUNT), 0);
    assert_int_equal(kvf_lt_admit(f->lt, &ops[0], KVF_LT_OP_KIND_COUNT, PEER_A), -EINVAL);
    assert_false(kvf_lt_op_retire(&ops[0], KVF_LT_DONE_OK));
    assert_false(kvf_lt_op_retire(&ops[5], KVF_LT_DONE_ERROR));
    assert_false(kvf_lt_op_retire(&ops[9], KVF_LT_DONE_FLUSHED));
    assert_int_equal(kvf_lt_inflight(f->lt), 7);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_RDMA_WR), 3);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_TCP_FRAME), 2);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_CUDA_COPY), 2);
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_STAGING), 0);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_OPEN);
    for (int i = 1; i < 9; i++) {
        if (i != 5)
            assert_false(kvf_lt_op_retire(&ops[i], KVF_LT_DONE_OK));
    }
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    assert_false(kvf_lt_take_drained(f->lt)); /* open and idle is not drained */
}

/* ibv_post_send refused the ops from bad_wr on: nothing was posted for them, so
 * their admission is undone. A cancel can be the drain. */
static void cancel_undoes_an_admission(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op posted, refused;
    assert_int_equal(kvf_lt_admit(f->lt, &posted, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_int_equal(kvf_lt_admit(f->lt, &refused, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    assert_false(kvf_lt_op_cancel(&refused));
    assert_int_equal(kvf_lt_inflight_kind(f->lt, KVF_LT_OP_RDMA_WR), 1);
    assert_false(kvf_lt_close(f->lt));
    assert_not_drained(f->t, f->lt);
    assert_true(kvf_lt_op_retire(&posted, KVF_LT_DONE_OK));
    assert_true(kvf_lt_take_drained(f->lt));

    /* A cancel as the last op standing drains. */
    struct kvf_lt *other;
    struct kvf_lt_op op;
    assert_int_equal(kvf_lt_table_open(f->t, key(8, 11), &other), 0);
    assert_int_equal(kvf_lt_admit(other, &op, KVF_LT_OP_TCP_FRAME, PEER_A), 0);
    assert_false(kvf_lt_close(other));
    assert_true(kvf_lt_op_cancel(&op));
    assert_true(kvf_lt_take_drained(other));
}

/* A quarantine shuts admission at once (no new op starts after the failure);
 * the abort notice's close that follows is not a new drain. */
static void quarantine_shuts_admission_and_a_later_close_is_no_new_drain(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt_op op, late;
    assert_int_equal(kvf_lt_admit(f->lt, &op, KVF_LT_OP_RDMA_WR, PEER_A), 0);
    kvf_lt_op_quarantine(&op);
    assert_int_equal(kvf_lt_admit(f->lt, &late, KVF_LT_OP_TCP_FRAME, PEER_A), -ECANCELED);
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), -EBUSY); /* the op is counted */
    assert_true(kvf_lt_op_retire(&op, KVF_LT_DONE_ERROR));
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_false(kvf_lt_close(f->lt)); /* already shut: not a new drain */
    assert_true(kvf_lt_take_drained(f->lt));
    assert_int_equal(kvf_lt_table_forget(f->t, key(7, 10)), 0);
}

/* ---- table ------------------------------------------------------------------ */

static void table_open_refuses_duplicate_and_stale_generations(void **state)
{
    struct fixture *f = *state;
    struct kvf_lt *lt = NULL;
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 10), &lt), -EEXIST);
    assert_null(lt); /* written only on success */
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 9), &lt), -ESTALE); /* older than known */
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 0), &lt), -EINVAL);
    assert_int_equal(kvf_lt_table_open(f->t, key(KVF_ROOM_ID_MAX + 1, 3), &lt), -EINVAL);
    assert_null(lt);
    assert_int_equal(kvf_lt_table_open(f->t, key(7, 11), &lt), 0); /* newer: welcome */
    assert_ptr_equal(kvf_lt_table_find(f->t, key(7, 11)), lt);
    assert_ptr_equal(kvf_lt_table_find(f->t, key(7, 10)), f->lt);
    assert_null(kvf_lt_table_find(f->t, key(7, 12)));
    assert_int_equal(kvf_lt_table_count(f->t), 2);
    kvf_room_key k = kvf_lt_key(lt);
    assert_true(kvf_room_key_eq(k, key(7, 11)));
}

/* Many rooms: the map grows and every lifetime stays reachable. */
static void table_holds_many_rooms(void **state)
{
    struct fixture *f = *state;
    for (uint64_t i = 1; i <= 5000; i++) {
        struct kvf_lt *lt;
        assert_int_equal(kvf_lt_table_open(f->t, key(i * 0x10001, 100 + i), &lt), 0);
    }
    assert_int_equal(kvf_lt_table_count(f->t), 5001);
    for (uint64_t i = 1; i <= 5000; i += 7) {
        struct kvf_lt *lt = kvf_lt_table_find(f->t, key(i * 0x10001, 100 + i));
        assert_non_null(lt);
        assert_true(kvf_room_key_eq(kvf_lt_key(lt), key(i * 0x10001, 100 + i)));
    }
    assert_int_equal(kvf_lt_table_close_all(f->t), 5001);
    for (uint64_t i = 1; i <= 5000; i++)
        assert_int_equal(kvf_lt_table_forget(f->t, key(i * 0x10001, 100 + i)), 0);
    assert_int_equal(kvf_lt_table_count(f->t), 1);
}

static void names_are_stable(void **state)
{
    (void)state;
    assert_string_equal(kvf_lt_state_name(KVF_LT_OPEN), "OPEN");
    assert_string_equal(kvf_lt_state_name(KVF_LT_CLOSED), "CLOSED");
    assert_string_equal(kvf_lt_state_name(KVF_LT_DRAINED), "DRAINED");
    assert_string_equal(kvf_lt_state_name(KVF_LT_QUARANTINED), "QUARANTINED");
    assert_string_equal(kvf_lt_state_name((enum kvf_lt_state)0), "UNKNOWN");
    assert_string_equal(kvf_lt_op_kind_name(KVF_LT_OP_RDMA_WR), "RDMA_WR");
    assert_string_equal(kvf_lt_op_kind_name(KVF_LT_OP_TCP_FRAME), "TCP_FRAME");
    assert_string_equal(kvf_lt_op_kind_name(KVF_LT_OP_CUDA_COPY), "CUDA_COPY");
    assert_string_equal(kvf_lt_op_kind_name(KVF_LT_OP_STAGING), "STAGING");
    assert_string_equal(kvf_lt_op_kind_name(KVF_LT_OP_KIND_COUNT), "UNKNOWN");
}

#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(blocked_native_write_then_abort_drains_only_after_last_retire),
        T(abort_between_metadata_and_first_chunk_drains_at_once_and_refuses_admission),
        T(abort_before_metadata_makes_the_later_metadata_late),
        T(one_sibling_fails_while_another_is_held_no_drain_until_it_retires),
        T(error_return_with_work_posted_is_quarantined_until_terminal_completion),
        T(quarantined_op_is_retired_by_the_fence_of_its_peer_only),
        T(one_fence_drains_every_room_quarantined_on_that_peer),
        T(flush_completions_on_fence_retire_normally),
        T(duplicate_close_is_idempotent_and_drains_once),
        T(staging_abort_with_rdma_in_flight_transport_then_copy),
        T(staging_abort_with_rdma_in_flight_copy_then_transport),
        T(staging_same_side_twice_is_ignored),
        T(fence_never_releases_a_staging_buffer),
        T(late_messages_after_abort_are_recognised),
        T(new_generation_of_a_reused_id_is_not_late),
        T(forgotten_memory_is_bounded_and_stays_late),
        T(teardown_waits_for_every_lifetime_to_drain),
        T(teardown_is_refused_while_a_lifetime_is_open),
        T(admission_after_close_is_refused_for_every_kind),
        T(inflight_is_counted_per_kind),
        T(cancel_undoes_an_admission),
        T(quarantine_shuts_admission_and_a_later_close_is_no_new_drain),
        T(table_open_refuses_duplicate_and_stale_generations),
        T(table_holds_many_rooms),
        cmocka_unit_test(names_are_stable),
    };
    return cmocka_run_group_tests_name("lifetime", tests, NULL, NULL);
}
