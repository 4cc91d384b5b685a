/*
 * test_fault_transport.c: the fault-injecting transport wrapper
 * (dataplane/transport/fault.h) around a fake inner transport that records
 * posts and completes them OK when the test says so. Real lifetimes account
 * every op: each test checks that every accepted op completed exactly once
 * and the lifetime drained.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fault.h"
#include "lifetime.h"

/* ---- the fake inner transport ---------------------------------------------------- */

struct fake {
    struct kvf_transport base;
    struct kvf_xfer *posted[16];
    unsigned nposted;
    unsigned ncompleted; /* posted[0 .. ncompleted) were handed back */
    unsigned ready;      /* posted[0 .. ready) may complete OK */
    int fenced_peer;
    int post_rc;         /* what post_write returns */
    uint32_t pool_added; /* the last pool id add_pool saw, 0: none */
    uint32_t pool_removed;
};

static int fake_post(struct kvf_transport *t, struct kvf_xfer *x)
{
    struct fake *f = (struct fake *)t;
    if (f->post_rc)
        return f->post_rc;
    assert_true(f->nposted < 16);
    f->posted[f->nposted++] = x;
    return 0;
}

static int fake_poll(struct kvf_transport *t, unsigned max, struct kvf_completion *out)
{
    struct fake *f = (struct fake *)t;
    unsigned got = 0;
    while (got < max && f->ncompleted < f->ready && f->ncompleted < f->nposted) {
        struct kvf_xfer *x = f->posted[f->ncompleted++];
        out[got].xfer = x;
        out[got].outcome = KVF_LT_DONE_OK;
        out[got].status = 0;
        out[got].drained = kvf_lt_op_retire(&x->op, KVF_LT_DONE_OK);
        got++;
    }
    return (int)got;
}

static int fake_fence(struct kvf_transport *t, uint32_t peer)
{
    ((struct fake *)t)->fenced_peer = (int)peer;
    return 0;
}

static void fake_destroy(struct kvf_transport *t)
{
    (void)t;
}

static int fake_add_pool(struct kvf_transport *t, const struct kvf_transport_pool *p,
                         uint64_t *key_p)
{
    ((struct fake *)t)->pool_added = p->id;
    if (key_p)
        *key_p = 0xabcd;
    return 0;
}

static int fake_remove_pool(struct kvf_transport *t, uint32_t pool_id)
{
    ((struct fake *)t)->pool_removed = pool_id;
    return pool_id == 9 ? -ENOENT : 0;
}

static const struct kvf_transport_ops fake_ops = {
    .name = "fake",
    .post_write = fake_post,
    .poll = fake_poll,
    .fence_peer = fake_fence,
    .destroy = fake_destroy,
    .wake_fd = kvf_transport_no_wake_fd,
    .wake_ack = kvf_transport_no_wake_ack,
    .add_pool = fake_add_pool,
    .remove_pool = fake_remove_pool,
};

/* ---- fixture --------------------------------------------------------------------- */

struct fx {
    struct fake inner;
    struct kvf_transport *t;
    struct kvf_lt_table *lts;
    struct kvf_lt *lt;
    struct kvf_xfer x[8];
    unsigned logged;
    char last_what[16];
};

static void log_fn(void *ctx, const char *what, const struct kvf_xfer *x, int rc)
{
    struct fx *f = ctx;
    (void)x;
    (void)rc;
    f->logged++;
    strncpy(f->last_what, what, sizeof f->last_what - 1);
}

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->inner.base.ops = &fake_ops;
    f->inner.fenced_peer = -1;
    f->t = kvf_transport_fault_create(&f->inner.base, log_fn, f);
    assert_non_null(f->t);
    assert_true(kvf_transport_is_fault(f->t));
    assert_false(kvf_transport_is_fault(&f->inner.base));
    f->lts = kvf_lt_table_create();
    assert_non_null(f->lts);
    assert_int_equal(kvf_lt_table_open(f->lts, (kvf_room_key){1, 1}, &f->lt), 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    kvf_transport_destroy(f->t);
    kvf_lt_table_destroy(f->lts);
    free(f);
    return 0;
}

/* Admits x[i] towards `peer` and posts it; returns post_write's answer
 * (cancelling the admission on an error, as the node does). */
static int post(struct fx *f, unsigned i, uint32_t peer)
{
    struct kvf_xfer *x = &f->x[i];
    memset(x, 0, sizeof *x);
    x->peer = peer;
    x->room = (kvf_room_key){1, 1};
    x->first_page = i;
    x->page_count = 1;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_TCP_FRAME, peer), 0);
    int rc = kvf_transport_post_write(f->t, x);
    if (rc != 0)
        (void)kvf_lt_op_cancel(&x->op);
    return rc;
}

static int poll_all(struct fx *f, struct kvf_completion *c, unsigned max)
{
    int got = kvf_transport_poll(f->t, max, c);
    assert_true(got >= 0);
    return got;
}

/* ---- tests ----------------------------------------------------------------------- */

static void no_knobs_passes_through(void **state)
{
    struct fx *f = *state;
    assert_int_equal(post(f, 0, 3), 0);
    assert_int_equal(f->inner.nposted, 1);
    f->inner.ready = 1;
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 1);
    assert_ptr_equal(c[0].xfer, &f->x[0]);
    assert_int_equal(c[0].outcome, KVF_LT_DONE_OK);
    assert_int_equal(f->logged, 0);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

static void hold_keeps_ops_counted_until_release_in_order(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.hold = true};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    assert_int_equal(post(f, 1, 1), 0);
    assert_int_equal(f->inner.nposted, 0);
    assert_int_equal(kvf_lt_inflight(f->lt), 2);
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 0);
    /* Closing admission does not drain while ops are held. */
    assert_false(kvf_lt_close(f->lt));
    struct kvf_fault_stats st;
    kvf_transport_fault_stats(f->t, &st);
    assert_int_equal(st.held, 2);

    k.hold = false;
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(f->inner.nposted, 2);
    assert_ptr_equal(f->inner.posted[0], &f->x[0]);
    assert_ptr_equal(f->inner.posted[1], &f->x[1]);
    f->inner.ready = 2;
    int got = poll_all(f, c, 4);
    assert_int_equal(got, 2);
    assert_false(c[0].drained);
    assert_true(c[1].drained);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    kvf_transport_fault_stats(f->t, &st);
    assert_int_equal(st.held, 0);
    assert_int_equal(st.released, 2);
}

static void fail_post_nth_refuses_only_that_post(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.fail_post_nth = 2};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    assert_int_equal(post(f, 1, 1), -EIO);
    assert_int_equal(post(f, 2, 1), 0);
    assert_int_equal(f->inner.nposted, 2);
    assert_string_equal(f->last_what, "fail_post");
    assert_int_equal(kvf_lt_inflight(f->lt), 2);
    /* A new setting counts from 1 again. */
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 3, 1), 0);
    assert_int_equal(post(f, 4, 1), -EIO);
    f->inner.ready = 3;
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 3);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

static void error_nth_completes_error_while_sibling_held(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.hold = true, .error_nth = 1};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    assert_int_equal(post(f, 1, 1), 0);
    assert_int_equal(f->inner.nposted, 0);
    assert_false(kvf_lt_close(f->lt));
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 1);
    assert_ptr_equal(c[0].xfer, &f->x[0]);
    assert_int_equal(c[0].outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(c[0].status, -EIO);
    assert_false(c[0].drained); /* the held sibling still counts */
    assert_int_equal(kvf_lt_inflight(f->lt), 1);
    k.hold = false;
    kvf_transport_fault_set(f->t, &k);
    f->inner.ready = 1;
    assert_int_equal(poll_all(f, c, 4), 1);
    assert_true(c[0].drained);
}

static void fence_flushes_held_ops_of_that_peer_only(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.hold = true};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    assert_int_equal(post(f, 1, 2), 0);
    assert_int_equal(post(f, 2, 1), 0);
    assert_int_equal(kvf_transport_fence_peer(f->t, 1), 0);
    assert_int_equal(f->inner.fenced_peer, 1);
    /* Both ops to peer 1 wait in poll, FLUSHED, before fence_peer returned. */
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 2);
    assert_ptr_equal(c[0].xfer, &f->x[0]);
    assert_ptr_equal(c[1].xfer, &f->x[2]);
    assert_int_equal(c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(kvf_lt_inflight(f->lt), 1);
    /* Later posts to the fenced peer fail; peer 2's op is released. */
    assert_int_equal(post(f, 3, 1), -ESTALE);
    k.hold = false;
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(f->inner.nposted, 1);
    assert_ptr_equal(f->inner.posted[0], &f->x[1]);
    f->inner.ready = 1;
    assert_int_equal(poll_all(f, c, 4), 1);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

static void release_refused_by_inner_completes_error(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.hold = true};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    f->inner.post_rc = -ENOTCONN;
    k.hold = false;
    kvf_transport_fault_set(f->t, &k);
    struct kvf_completion c[4];
    assert_int_equal(poll_all(f, c, 4), 1);
    assert_int_equal(c[0].outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(c[0].status, -ENOTCONN);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

static void destroy_retires_held_ops(void **state)
{
    struct fx *f = *state;
    struct kvf_fault_knobs k = {.hold = true};
    kvf_transport_fault_set(f->t, &k);
    assert_int_equal(post(f, 0, 1), 0);
    assert_int_equal(kvf_lt_inflight(f->lt), 1);
    kvf_transport_destroy(f->t);
    f->t = NULL;
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
}

/* Pools and the wake descriptor are the inner transport's: the wrapper
 * forwards them (the node registers pools through it). */
static void pools_and_wake_go_to_the_inner_transport(void **state)
{
    struct fx *f = *state;
    uint8_t mem[64];
    struct kvf_transport_pool p = {.id = 4, .base = mem, .page_size = 16, .page_count = 4};
    uint64_t key = 0;
    assert_int_equal(kvf_transport_add_pool(f->t, &p, &key), 0);
    assert_int_equal(f->inner.pool_added, 4);
    assert_int_equal(key, 0xabcd);
    assert_int_equal(kvf_transport_remove_pool(f->t, 4), 0);
    assert_int_equal(f->inner.pool_removed, 4);
    assert_int_equal(kvf_transport_remove_pool(f->t, 9), -ENOENT);
    assert_int_equal(kvf_transport_wake_fd(f->t), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(no_knobs_passes_through, setup, teardown),
        cmocka_unit_test_setup_teardown(pools_and_wake_go_to_the_inner_transport, setup, teardown),
        cmocka_unit_test_setup_teardown(hold_keeps_ops_counted_until_release_in_order, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(fail_post_nth_refuses_only_that_post, setup, teardown),
        cmocka_unit_test_setup_teardown(error_nth_completes_error_while_sibling_held, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(fence_flushes_held_ops_of_that_peer_only, setup, teardown),
        cmocka_unit_test_setup_teardown(release_refused_by_inner_completes_error, setup, teardown),
        cmocka_unit_test_setup_teardown(destroy_retires_held_ops, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
