/*
 * test_rdma.c: the RDMA transport through the fake verbs provider, with a
 * real lifetime table; and the real provider's no-device path.
 *
 * Every test builds one transport on a fake device, connects peer PEER's two
 * QPs to made-up remote connection details, registers a local pool and
 * names a remote pool. Room ROOM_A (even id) uses QP 0, ROOM_B (odd id) QP 1.
 * The fake holds every posted WR until the test completes, fails or flushes
 * it; the tests check the lifetimes' counts and states after each step. All
 * on one thread, as the transport's DESIGN requires.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lifetime.h"
#include "rdma.h"
#include "transport.h"
#include "verbs.h"

#define PEER        3u
#define PAGE        4096u
#define POOL_PAGES  64u
#define POOL_ID     7u
#define REMOTE_BASE 0x7f0000000000ull
#define REMOTE_RKEY 0xabcdu
#define MAX_XFERS   300u

static const kvf_room_key ROOM_A = {.room_id = 42, .generation = 1};
static const kvf_room_key ROOM_B = {.room_id = 43, .generation = 1};
static const struct kvf_rdma_conn_info REMOTE = {
    .lid = 9, .gid = {0}, .qp_num = {0x900, 0x901}, .psn = {0x111, 0x222}};

struct fx {
    struct kvf_verbs_fake *fake;
    struct kvf_transport *t;
    struct kvf_lt_table *tab;
    struct kvf_lt *lt_a;
    struct kvf_lt *lt_b;
    uint8_t *pool;
    struct kvf_rdma_conn_info local;
    struct kvf_xfer x[MAX_XFERS];
    struct kvf_completion c[MAX_XFERS];
};

static uint32_t qpn_of(const struct fx *f, kvf_room_key room)
{
    return f->local.qp_num[room.room_id % 2];
}

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->fake = kvf_verbs_fake_create();
    assert_non_null(f->fake);
    struct kvf_transport_rdma_opts o;
    kvf_transport_rdma_opts_init(&o);
    o.verbs = &kvf_verbs_fake_ops;
    o.verbs_prov = f->fake;
    o.psn_seed = 1;
    o.fence_timeout_ms = 50;
    struct kvf_error err = {0};
    f->t = kvf_transport_rdma_create(&o, &err);
    assert_non_null(f->t);
    assert_string_equal(kvf_transport_name(f->t), "rdma");

    f->pool = calloc(POOL_PAGES, PAGE);
    assert_non_null(f->pool);
    uint32_t rkey = 0;
    assert_int_equal(kvf_transport_rdma_add_pool(f->t, POOL_ID, f->pool, PAGE, POOL_PAGES, &rkey),
                     0);
    assert_int_not_equal(rkey, 0);
    assert_int_equal(kvf_transport_rdma_add_remote_pool(f->t, PEER, POOL_ID, REMOTE_BASE, PAGE,
                                                        POOL_PAGES, REMOTE_RKEY),
                     0);
    assert_int_equal(kvf_transport_rdma_local_info(f->t, PEER, &f->local), 0);
    assert_int_equal(kvf_transport_rdma_connect(f->t, PEER, &REMOTE), 0);

    f->tab = kvf_lt_table_create();
    assert_non_null(f->tab);
    assert_int_equal(kvf_lt_table_open(f->tab, ROOM_A, &f->lt_a), 0);
    assert_int_equal(kvf_lt_table_open(f->tab, ROOM_B, &f->lt_b), 0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    kvf_transport_destroy(f->t);
    struct kvf_verbs_fake_stats st;
    kvf_verbs_fake_stats(f->fake, &st);
    assert_int_equal(st.objects_live, 0); /* every verbs object freed */
    kvf_verbs_fake_destroy(f->fake);
    (void)kvf_lt_close(f->lt_a);
    (void)kvf_lt_close(f->lt_b);
    assert_true(kvf_lt_table_can_teardown(f->tab)); /* destroy left nothing counted */
    kvf_lt_table_destroy(f->tab);
    free(f->pool);
    free(f);
    return 0;
}

/* Admits and fills xfer `i` of `room`: one page, page i % POOL_PAGES. */
static struct kvf_xfer *mk(struct fx *f, unsigned i, kvf_room_key room)
{
    struct kvf_xfer *x = &f->x[i];
    struct kvf_lt *lt = room.room_id == ROOM_A.room_id ? f->lt_a : f->lt_b;
    memset(x, 0, sizeof(*x));
    assert_int_equal(kvf_lt_admit(lt, &x->op, KVF_LT_OP_RDMA_WR, PEER), 0);
    x->peer = PEER;
    x->room = room;
    x->src = f->pool + (size_t)(i % POOL_PAGES) * PAGE;
    x->len = PAGE;
    x->sink_pool = POOL_ID;
    x->first_page = i % POOL_PAGES;
    x->page_count = 1;
    return x;
}

static struct kvf_xfer *post(struct fx *f, unsigned i, kvf_room_key room)
{
    struct kvf_xfer *x = mk(f, i, room);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    return x;
}

/* Polls until `want` completions came (the fake queues them synchronously). */
static int poll_all(struct fx *f, unsigned want)
{
    int n = 0;
    for (int rounds = 0; rounds < 64 && (unsigned)n < want; rounds++) {
        int r = kvf_transport_poll(f->t, want - (unsigned)n, &f->c[n]);
        assert_true(r >= 0);
        n += r;
    }
    return n;
}

/* ---- tests -------------------------------------------------------------------- */

static void test_accounting(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < 10; i++)
        post(f, i, ROOM_A);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 10);
    assert_int_equal(kvf_lt_inflight_kind(f->lt_a, KVF_LT_OP_RDMA_WR), 10);
    assert_int_equal(kvf_verbs_fake_outstanding(f->fake, qpn_of(f, ROOM_A)), 10);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 10);

    /* The WR as posted: RDMA WRITE, signaled, remote address from the page. */
    struct kvf_verbs_fake_wr w;
    assert_int_equal(kvf_verbs_fake_peek_wr(f->fake, qpn_of(f, ROOM_A), 3, &w), 0);
    assert_int_equal(w.opcode, IBV_WR_RDMA_WRITE);
    assert_true(w.send_flags & IBV_SEND_SIGNALED);
    assert_int_equal(w.remote_addr, REMOTE_BASE + 3u * PAGE);
    assert_int_equal(w.rkey, REMOTE_RKEY);
    assert_int_equal(w.length, PAGE);
    assert_int_equal(w.local_addr, (uint64_t)(uintptr_t)(f->pool + 3u * PAGE));
    assert_int_not_equal(w.wr_id, 0); /* points at the transport's tag */

    /* Nothing completes on its own. */
    assert_int_equal(kvf_transport_poll(f->t, 16, f->c), 0);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 10);

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 10, IBV_WC_SUCCESS), 10);
    assert_int_equal(poll_all(f, 10), 10);
    for (unsigned i = 0; i < 10; i++) {
        assert_ptr_equal(f->c[i].xfer, &f->x[i]); /* in order on one QP */
        assert_int_equal(f->c[i].outcome, KVF_LT_DONE_OK);
        assert_int_equal(f->c[i].status, 0);
        assert_false(f->c[i].drained); /* admission still open */
    }
    assert_int_equal(kvf_lt_inflight(f->lt_a), 0);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 0);
    assert_true(kvf_lt_close(f->lt_a));
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_DRAINED);
}

static void test_any_order(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < 3; i++) {
        post(f, i, ROOM_A);      /* QP 0 */
        post(f, 10 + i, ROOM_B); /* QP 1 */
    }
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 3);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 1), 3);

    /* QP 1 first, then QP 0 out of order: 2, 0, 1. */
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_B), 3, IBV_WC_SUCCESS), 3);
    assert_int_equal(poll_all(f, 3), 3);
    for (unsigned i = 0; i < 3; i++)
        assert_ptr_equal(f->c[i].xfer, &f->x[10 + i]);
    assert_int_equal(kvf_lt_inflight(f->lt_b), 0);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 3);

    const unsigned order[3] = {2, 0, 1};
    unsigned idx_left[3] = {0, 1, 2}; /* fake index of each xfer still queued */
    for (unsigned k = 0; k < 3; k++) {
        unsigned want = order[k];
        unsigned fidx = idx_left[want];
        assert_int_equal(
            kvf_verbs_fake_complete_at(f->fake, qpn_of(f, ROOM_A), fidx, IBV_WC_SUCCESS), 0);
        for (unsigned j = 0; j < 3; j++) {
            if (idx_left[j] > fidx && idx_left[j] != UINT32_MAX)
                idx_left[j]--;
        }
        idx_left[want] = UINT32_MAX;
        assert_int_equal(poll_all(f, 1), 1);
        assert_ptr_equal(f->c[0].xfer, &f->x[want]);
        assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);
        assert_int_equal(kvf_lt_inflight(f->lt_a), 2 - k);
    }
}

/* R4: one WR fails; its siblings stay counted until their own completions. */
static void test_error_completion_siblings(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < 3; i++)
        post(f, i, ROOM_A);
    assert_false(kvf_lt_close(f->lt_a)); /* abort: ops still in flight */

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_REM_ACCESS_ERR),
                     1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_ptr_equal(f->c[0].xfer, &f->x[0]);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(f->c[0].status, -EIO);
    assert_false(f->c[0].drained);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 2); /* the siblings are still posted */
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_CLOSED);
    assert_int_equal(kvf_transport_poll(f->t, 8, f->c), 0);

    /* The QP is broken: a new post (another room on that QP) fails with -EIO. */
    struct kvf_lt *lt_c = NULL;
    kvf_room_key room_c = {.room_id = 44, .generation = 1};
    assert_int_equal(kvf_lt_table_open(f->tab, room_c, &lt_c), 0);
    struct kvf_xfer *xc = &f->x[50];
    memset(xc, 0, sizeof(*xc));
    assert_int_equal(kvf_lt_admit(lt_c, &xc->op, KVF_LT_OP_RDMA_WR, PEER), 0);
    xc->peer = PEER;
    xc->room = room_c;
    xc->src = f->pool;
    xc->len = 100;
    xc->sink_pool = POOL_ID;
    xc->page_count = 1;
    assert_int_equal(kvf_transport_post_write(f->t, xc), -EIO);
    assert_true(kvf_lt_close(lt_c) == false);
    assert_true(kvf_lt_op_cancel(&xc->op));

    /* The device flushes the WRs behind the error: now it drains. */
    assert_int_equal(kvf_verbs_fake_set_qp_error(f->fake, qpn_of(f, ROOM_A)), 0);
    assert_int_equal(poll_all(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_false(f->c[0].drained);
    assert_true(f->c[1].drained);
    assert_true(kvf_lt_take_drained(f->lt_a));
    struct kvf_transport_rdma_stats st;
    kvf_transport_rdma_stats(f->t, &st);
    assert_int_equal(st.wrs_error, 1);
    assert_int_equal(st.wrs_flushed, 2);
}

/* post_send fails with a bad_wr in the middle of a chain. */
static void test_post_fails_mid_chain(void **state)
{
    struct fx *f = *state;
    struct kvf_xfer *xs[5];
    for (unsigned i = 0; i < 5; i++)
        xs[i] = mk(f, i, ROOM_A);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 5);

    kvf_verbs_fake_fail_post_after(f->fake, 2, -ENOMEM, false);
    unsigned posted = 99;
    assert_int_equal(kvf_transport_rdma_post_chain(f->t, xs, 5, &posted), -ENOMEM);
    assert_int_equal(posted, 2);
    struct kvf_verbs_fake_stats fst;
    kvf_verbs_fake_stats(f->fake, &fst);
    assert_int_equal(fst.wrs_posted, 2); /* native work: only the posted part */
    assert_int_equal(fst.wrs_refused, 3);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 2);

    /* The caller cancels the unposted rest: proof that they never started. */
    for (unsigned i = posted; i < 5; i++)
        assert_false(kvf_lt_op_cancel(&xs[i]->op));
    assert_int_equal(kvf_lt_inflight(f->lt_a), 2); /* the posted part stays counted */
    assert_false(kvf_lt_close(f->lt_a));
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_CLOSED);

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 2, IBV_WC_SUCCESS), 2);
    assert_int_equal(poll_all(f, 2), 2);
    assert_ptr_equal(f->c[0].xfer, xs[0]);
    assert_ptr_equal(f->c[1].xfer, xs[1]);
    assert_true(f->c[1].drained);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_DRAINED);

    /* A single post_write refused by the provider posted nothing. */
    struct kvf_xfer *x = mk(f, 20, ROOM_B);
    kvf_verbs_fake_fail_post_after(f->fake, 0, -EINVAL, false);
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 1), 0);
    assert_false(kvf_lt_op_cancel(&x->op));
    assert_int_equal(kvf_lt_inflight(f->lt_b), 0);
}

static void test_fence(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < 2; i++) {
        post(f, i, ROOM_A);
        post(f, 10 + i, ROOM_B);
    }
    /* One of them had already finished, unpolled. */
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_SUCCESS), 1);
    assert_false(kvf_lt_close(f->lt_a));
    assert_false(kvf_lt_close(f->lt_b));

    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    /* When it returns: QPs in ERR, nothing outstanding on the device or here. */
    for (unsigned q = 0; q < 2; q++) {
        assert_int_equal(kvf_verbs_fake_qp_state(f->fake, f->local.qp_num[q]), IBV_QPS_ERR);
        assert_int_equal(kvf_verbs_fake_outstanding(f->fake, f->local.qp_num[q]), 0);
        assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, q), 0);
        struct kvf_verbs_fake_transition tr[8];
        unsigned n = kvf_verbs_fake_transitions(f->fake, f->local.qp_num[q], tr, 8);
        assert_int_equal(n, 4);
        assert_int_equal(tr[3].attr.qp_state, IBV_QPS_ERR);
        assert_int_equal(tr[3].mask, IBV_QP_STATE);
    }
    /* The ops are still counted until poll hands the completions back. */
    assert_int_equal(kvf_lt_inflight(f->lt_a), 2);
    assert_int_equal(poll_all(f, 4), 4);
    unsigned ok = 0, flushed = 0, drained = 0;
    for (unsigned i = 0; i < 4; i++) {
        ok += f->c[i].outcome == KVF_LT_DONE_OK;
        flushed += f->c[i].outcome == KVF_LT_DONE_FLUSHED;
        drained += f->c[i].drained;
    }
    assert_int_equal(ok, 1);
    assert_int_equal(flushed, 3);
    assert_int_equal(drained, 2);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_DRAINED);
    assert_int_equal(kvf_lt_state(f->lt_b), KVF_LT_DRAINED);
    assert_int_equal(kvf_transport_poll(f->t, 8, f->c), 0); /* the markers are not handed out */

    /* Fenced for good: posts fail -ESTALE; a second fence is a no-op. */
    struct kvf_lt *lt_c = NULL;
    kvf_room_key room_c = {.room_id = 44, .generation = 1};
    assert_int_equal(kvf_lt_table_open(f->tab, room_c, &lt_c), 0);
    struct kvf_xfer *x = &f->x[60];
    memset(x, 0, sizeof(*x));
    assert_int_equal(kvf_lt_admit(lt_c, &x->op, KVF_LT_OP_RDMA_WR, PEER), 0);
    x->peer = PEER;
    x->room = room_c;
    x->src = f->pool;
    x->len = 1;
    x->sink_pool = POOL_ID;
    x->page_count = 1;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ESTALE);
    assert_false(kvf_lt_op_cancel(&x->op));
    assert_true(kvf_lt_close(lt_c));
    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    assert_int_equal(kvf_transport_fence_peer(f->t, 100000), -ENOENT);
    assert_int_equal(kvf_transport_rdma_local_info(f->t, PEER, &f->local), -ESTALE);
    struct kvf_transport_rdma_stats st;
    kvf_transport_rdma_stats(f->t, &st);
    assert_int_equal(st.fences_done, 2);
}

/* After an error completion the peer's QPs are broken; reset_peer drains and
 * destroys them, and local_info + connect make fresh ones that carry writes
 * again. A fenced peer cannot be reset. */
static void test_reset_peer_after_error(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < 3; i++)
        post(f, i, ROOM_A);
    assert_false(kvf_transport_rdma_peer_broken(f->t, PEER));
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_REM_ACCESS_ERR),
                     1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_ERROR);
    assert_true(kvf_transport_rdma_peer_broken(f->t, PEER));
    assert_false(kvf_transport_rdma_peer_broken(f->t, PEER + 1));

    struct kvf_rdma_conn_info old = f->local;
    assert_int_equal(kvf_transport_rdma_reset_peer(f->t, PEER), 0);
    /* The WRs behind the error came back (flushed), the old QPs are gone. */
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 0);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 1), 0);
    assert_int_equal(poll_all(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 0);
    for (unsigned q = 0; q < 2; q++)
        assert_int_equal(kvf_verbs_fake_qp_state(f->fake, old.qp_num[q]), IBV_QPS_UNKNOWN);
    assert_false(kvf_transport_rdma_peer_broken(f->t, PEER));
    assert_int_equal(kvf_transport_rdma_reset_peer(f->t, PEER), 0); /* no QPs: nothing to do */

    /* Not connected until a new exchange. */
    struct kvf_xfer *x = mk(f, 5, ROOM_B);
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    assert_true(kvf_lt_op_cancel(&x->op) == false);
    assert_int_equal(kvf_transport_rdma_local_info(f->t, PEER, &f->local), 0);
    for (unsigned q = 0; q < 2; q++) {
        assert_int_not_equal(f->local.qp_num[q], old.qp_num[q]);
        assert_int_equal(kvf_verbs_fake_qp_state(f->fake, f->local.qp_num[q]), IBV_QPS_INIT);
    }
    assert_int_equal(kvf_transport_rdma_connect(f->t, PEER, &REMOTE), 0);
    post(f, 6, ROOM_B);
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_B), 1, IBV_WC_SUCCESS), 1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);
    assert_int_equal(kvf_lt_inflight(f->lt_b), 0);
    struct kvf_transport_rdma_stats st;
    kvf_transport_rdma_stats(f->t, &st);
    assert_int_equal(st.peer_resets, 1);
    assert_int_equal(st.wrs_error, 1);
    assert_int_equal(st.wrs_ok, 1);

    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    assert_int_equal(kvf_transport_rdma_reset_peer(f->t, PEER), -ESTALE);
    assert_int_equal(kvf_transport_rdma_reset_peer(f->t, 100000), -ENOENT);
}

/* A fence whose flushes do not come back in time: -ETIMEDOUT, nothing pretended. */
static void test_fence_timeout(void **state)
{
    struct fx *f = *state;
    uint32_t qpn = qpn_of(f, ROOM_A);
    post(f, 0, ROOM_A);
    post(f, 1, ROOM_A);
    assert_int_equal(kvf_verbs_fake_hold_flushes(f->fake, qpn, true), 0);

    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), -ETIMEDOUT);
    assert_int_equal(kvf_verbs_fake_qp_state(f->fake, qpn), IBV_QPS_ERR);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 2); /* still counted */
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_QUARANTINED);
    assert_false(kvf_lt_table_can_teardown(f->tab));
    assert_int_equal(kvf_transport_poll(f->t, 8, f->c), 0);

    /* The flushes arrive late: their terminal completions retire the ops. */
    assert_int_equal(kvf_verbs_fake_hold_flushes(f->fake, qpn, false), 0);
    assert_int_equal(poll_all(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_true(f->c[1].drained);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_DRAINED);
    /* The marker came back with them: the fence completes now. */
    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    struct kvf_transport_rdma_stats st;
    kvf_transport_rdma_stats(f->t, &st);
    assert_int_equal(st.fences_timed_out, 1);
    assert_int_equal(st.wrs_quarantined, 2);
}

/* An ambiguous post_send (bad_wr NULL): fate unknown, quarantined until a
 * terminal completion, or until the fence proves the rest never posted. */
static void test_quarantine_until_completion_or_fence(void **state)
{
    struct fx *f = *state;
    uint32_t qpn = qpn_of(f, ROOM_A);
    struct kvf_xfer *xs[3];
    for (unsigned i = 0; i < 3; i++)
        xs[i] = mk(f, i, ROOM_A);
    kvf_verbs_fake_fail_post_after(f->fake, 1, -EIO, true); /* 1 posted, nobody can tell */
    unsigned posted = 0;
    assert_int_equal(kvf_transport_rdma_post_chain(f->t, xs, 3, &posted), 0);
    assert_int_equal(posted, 3); /* all owned by the transport */
    assert_int_equal(kvf_verbs_fake_outstanding(f->fake, qpn), 1);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 3);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_QUARANTINED);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 3);
    assert_false(kvf_lt_table_can_teardown(f->tab));

    /* The one that was posted completes: that op is retired (terminal). */
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn, 1, IBV_WC_SUCCESS), 1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_ptr_equal(f->c[0].xfer, xs[0]);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 2);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_QUARANTINED);

    /* The other two: only a fence can tell. Its marker proves they never ran. */
    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_QUARANTINED); /* until poll or peer_fenced */
    assert_int_equal(kvf_lt_table_peer_fenced(f->tab, PEER), 1);
    assert_int_equal(kvf_lt_state(f->lt_a), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt_a));
    /* The xfers still come back through poll (the caller frees them there);
     * the lifetime ignores the retirement of fenced ops. */
    assert_int_equal(poll_all(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_false(f->c[0].drained);
    assert_false(f->c[1].drained);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 0);
    assert_int_equal(kvf_lt_state(f->lt_b), KVF_LT_OPEN); /* another room: untouched */
}

/* Quarantined op whose own flush retires it (no peer_fenced call). */
static void test_quarantine_retired_by_flush(void **state)
{
    struct fx *f = *state;
    struct kvf_xfer *xs[2];
    for (unsigned i = 0; i < 2; i++)
        xs[i] = mk(f, i, ROOM_B);
    kvf_verbs_fake_fail_post_after(f->fake, 1, -EIO, true);
    unsigned posted = 0;
    assert_int_equal(kvf_transport_rdma_post_chain(f->t, xs, 2, &posted), 0);
    assert_int_equal(kvf_lt_state(f->lt_b), KVF_LT_QUARANTINED);
    assert_int_equal(kvf_transport_fence_peer(f->t, PEER), 0);
    assert_int_equal(poll_all(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_FLUSHED);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_true(f->c[1].drained);
    assert_int_equal(kvf_lt_state(f->lt_b), KVF_LT_DRAINED);
}

static void test_wr_limit(void **state)
{
    struct fx *f = *state;
    for (unsigned i = 0; i < KVF_RDMA_MAX_WR_PER_QP; i++)
        post(f, i, ROOM_A);
    assert_int_equal(kvf_transport_rdma_outstanding(f->t, PEER, 0), 256);
    struct kvf_xfer *x = mk(f, 256, ROOM_A);
    assert_int_equal(kvf_transport_post_write(f->t, x), -EAGAIN);
    /* The other QP is not full. */
    post(f, 257, ROOM_B);

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_SUCCESS), 1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0); /* a slot is free again */
    struct kvf_xfer *xs[2] = {mk(f, 258, ROOM_A), mk(f, 259, ROOM_A)};
    unsigned posted = 9;
    assert_int_equal(kvf_transport_rdma_post_chain(f->t, xs, 2, &posted), -EAGAIN);
    assert_int_equal(posted, 0);
    assert_false(kvf_lt_op_cancel(&xs[0]->op));
    assert_false(kvf_lt_op_cancel(&xs[1]->op));
    assert_int_equal(kvf_lt_inflight(f->lt_a), 256);

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 256, IBV_WC_SUCCESS), 256);
    assert_int_equal(poll_all(f, 256), 256);
    assert_int_equal(kvf_lt_inflight(f->lt_a), 0);
    /* lt_b's xfer stays posted: destroy (teardown) fences and retires it. */
}

static void test_qp_transitions(void **state)
{
    struct fx *f = *state;
    for (unsigned q = 0; q < 2; q++) {
        struct kvf_verbs_fake_transition tr[8];
        assert_int_equal(kvf_verbs_fake_transitions(f->fake, f->local.qp_num[q], tr, 8), 3);
        assert_int_equal(kvf_verbs_fake_qp_state(f->fake, f->local.qp_num[q]), IBV_QPS_RTS);

        assert_int_equal(tr[0].from, IBV_QPS_RESET);
        assert_int_equal(tr[0].attr.qp_state, IBV_QPS_INIT);
        assert_int_equal(tr[0].mask,
                         IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        assert_int_equal(tr[0].attr.port_num, 1);
        assert_true(tr[0].attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE);

        assert_int_equal(tr[1].from, IBV_QPS_INIT);
        assert_int_equal(tr[1].attr.qp_state, IBV_QPS_RTR);
        assert_int_equal(tr[1].mask, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                         IBV_QP_MIN_RNR_TIMER);
        assert_int_equal(tr[1].attr.dest_qp_num, REMOTE.qp_num[q]);
        assert_int_equal(tr[1].attr.rq_psn, REMOTE.psn[q]);
        assert_int_equal(tr[1].attr.ah_attr.dlid, REMOTE.lid);
        assert_int_equal(tr[1].attr.path_mtu, IBV_MTU_4096);

        assert_int_equal(tr[2].from, IBV_QPS_RTR);
        assert_int_equal(tr[2].attr.qp_state, IBV_QPS_RTS);
        assert_int_equal(tr[2].mask, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                         IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                         IBV_QP_MAX_QP_RD_ATOMIC);
        assert_int_equal(tr[2].attr.sq_psn, f->local.psn[q]);
        assert_true(f->local.psn[q] <= 0xffffffu);
    }
    assert_int_equal(f->local.lid, 7);
    assert_int_not_equal(f->local.qp_num[0], f->local.qp_num[1]);
    /* local_info again answers the same; a second connect is refused. */
    struct kvf_rdma_conn_info again;
    assert_int_equal(kvf_transport_rdma_local_info(f->t, PEER, &again), 0);
    assert_memory_equal(&again, &f->local, sizeof(again));
    assert_int_equal(kvf_transport_rdma_connect(f->t, PEER, &REMOTE), -EEXIST);
}

static void test_post_validation(void **state)
{
    struct fx *f = *state;
    struct kvf_xfer *x = mk(f, 0, ROOM_A);
    x->len = KVF_RDMA_MAX_SLICE + 1; /* the caller splits into <= 64 KiB slices */
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->len = PAGE;
    x->page_count = 2; /* names a page it does not write */
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->page_count = 1;
    x->first_page = POOL_PAGES; /* outside the remote pool */
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->first_page = 0;
    x->sink_pool = 99;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    x->sink_pool = POOL_ID;
    uint8_t stray[16];
    x->src = stray; /* not registered */
    x->len = sizeof(stray);
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->src = f->pool;
    x->peer = PEER + 1; /* never connected */
    x->op.peer = PEER + 1;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    x->peer = PEER;
    x->op.peer = PEER;
    struct kvf_verbs_fake_stats st;
    kvf_verbs_fake_stats(f->fake, &st);
    assert_int_equal(st.post_calls, 0); /* nothing reached the provider */
    assert_false(kvf_lt_op_cancel(&x->op));

    /* A slice of 64 KiB spanning 16 pages is fine. */
    x = mk(f, 1, ROOM_A);
    x->len = KVF_RDMA_MAX_SLICE;
    x->page_count = KVF_RDMA_MAX_SLICE / PAGE;
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_SUCCESS), 1);
    assert_int_equal(poll_all(f, 1), 1);
}

/* Pools go away: a local one only when no outstanding WR reads from it, a
 * remote one at once (later posts to it are refused). */
static void test_remove_pools(void **state)
{
    struct fx *f = *state;
    uint8_t other[PAGE];
    assert_int_equal(kvf_transport_rdma_add_pool(f->t, 8, other, PAGE, 1, NULL), 0);
    post(f, 0, ROOM_A); /* reads from POOL_ID */
    assert_int_equal(kvf_transport_rdma_remove_pool(f->t, POOL_ID), -EBUSY);
    assert_int_equal(kvf_transport_rdma_remove_pool(f->t, 99), -ENOENT);
    struct kvf_verbs_fake_stats st0;
    kvf_verbs_fake_stats(f->fake, &st0);
    assert_int_equal(kvf_transport_rdma_remove_pool(f->t, 8), 0); /* nothing reads from it */
    struct kvf_verbs_fake_stats st;
    kvf_verbs_fake_stats(f->fake, &st);
    assert_int_equal(st.objects_live, st0.objects_live - 1); /* its MR is gone */
    assert_int_equal(kvf_transport_rdma_remove_pool(f->t, 8), -ENOENT);

    assert_int_equal(kvf_verbs_fake_complete(f->fake, qpn_of(f, ROOM_A), 1, IBV_WC_SUCCESS), 1);
    assert_int_equal(poll_all(f, 1), 1);
    assert_int_equal(kvf_transport_rdma_remove_pool(f->t, POOL_ID), 0);
    kvf_verbs_fake_stats(f->fake, &st);
    assert_int_equal(st.objects_live, st0.objects_live - 2);
    struct kvf_xfer *x = mk(f, 1, ROOM_A);
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL); /* source not registered */

    /* Re-registered, the source is fine again; now forget the remote pool. */
    assert_int_equal(kvf_transport_rdma_add_pool(f->t, POOL_ID, f->pool, PAGE, POOL_PAGES, NULL),
                     0);
    assert_int_equal(kvf_transport_rdma_remove_remote_pool(f->t, PEER, 99), -ENOENT);
    assert_int_equal(kvf_transport_rdma_remove_remote_pool(f->t, 1000, POOL_ID), -ENOENT);
    assert_int_equal(kvf_transport_rdma_remove_remote_pool(f->t, PEER, POOL_ID), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    assert_int_equal(kvf_transport_rdma_remove_remote_pool(f->t, PEER, POOL_ID), -ENOENT);
    assert_false(kvf_lt_op_cancel(&x->op));
    kvf_verbs_fake_stats(f->fake, &st);
    assert_int_equal(st.wrs_posted, 1); /* only the first post reached the provider */
}

/* destroy with WRs still posted: it fences, and nothing stays counted. */
static void test_destroy_with_outstanding(void **state)
{
    struct fx *f = *state;
    post(f, 0, ROOM_A);
    post(f, 1, ROOM_B);
    kvf_transport_destroy(f->t);
    f->t = NULL;
    assert_int_equal(kvf_lt_inflight(f->lt_a), 0);
    assert_int_equal(kvf_lt_inflight(f->lt_b), 0);
}

/* The real provider on a machine without an RDMA device. */
static void test_real_provider_no_device(void **state)
{
    (void)state;
    struct ibv_context *ctx = NULL;
    int rc = kvf_verbs_real_ops.open_device(NULL, NULL, &ctx);
    if (rc == 0) {
        /* An RDMA device exists here after all: the real path works. */
        kvf_verbs_real_ops.close_device(NULL, ctx);
        skip();
    }
    assert_int_equal(rc, -ENODEV);
    assert_null(ctx);
    assert_int_equal(kvf_verbs_real_ops.open_device(NULL, "no_such_dev", &ctx), -ENODEV);

    struct kvf_transport_rdma_opts o;
    kvf_transport_rdma_opts_init(&o);
    o.verbs = &kvf_verbs_real_ops;
    struct kvf_error err = {0};
    assert_null(kvf_transport_rdma_create(&o, &err));
    assert_int_equal(err.code, -ENODEV);
}

/* Every failing call of create and local_info unwinds cleanly. */
static void test_setup_failures(void **state)
{
    (void)state;
    const enum kvf_verbs_fake_call calls[] = {KVF_FAKE_OPEN_DEVICE, KVF_FAKE_ALLOC_PD,
                                              KVF_FAKE_CREATE_CQ};
    for (unsigned i = 0; i < 3; i++) {
        struct kvf_verbs_fake *fake = kvf_verbs_fake_create();
        kvf_verbs_fake_fail_call(fake, calls[i], 1, -ENOMEM);
        struct kvf_transport_rdma_opts o;
        kvf_transport_rdma_opts_init(&o);
        o.verbs = &kvf_verbs_fake_ops;
        o.verbs_prov = fake;
        struct kvf_error err = {0};
        assert_null(kvf_transport_rdma_create(&o, &err));
        assert_int_equal(err.code, -ENOMEM);
        struct kvf_verbs_fake_stats st;
        kvf_verbs_fake_stats(fake, &st);
        assert_int_equal(st.objects_live, 0);
        kvf_verbs_fake_destroy(fake);
    }

    /* QP creation or a transition failing: the half-made QPs are destroyed. */
    const struct {
        enum kvf_verbs_fake_call call;
        unsigned nth;
    } qfail[] = {{KVF_FAKE_CREATE_QP, 1},
                 {KVF_FAKE_CREATE_QP, 2},
                 {KVF_FAKE_MODIFY_QP, 1},
                 {KVF_FAKE_MODIFY_QP, 2},
                 {KVF_FAKE_REG_MR, 1}};
    for (unsigned i = 0; i < 5; i++) {
        struct kvf_verbs_fake *fake = kvf_verbs_fake_create();
        struct kvf_transport_rdma_opts o;
        kvf_transport_rdma_opts_init(&o);
        o.verbs = &kvf_verbs_fake_ops;
        o.verbs_prov = fake;
        struct kvf_transport *t = kvf_transport_rdma_create(&o, NULL);
        assert_non_null(t);
        struct kvf_verbs_fake_stats before;
        kvf_verbs_fake_stats(fake, &before);
        kvf_verbs_fake_fail_call(fake, qfail[i].call, qfail[i].nth, -EIO);
        if (qfail[i].call == KVF_FAKE_REG_MR) {
            uint8_t buf[64];
            assert_int_equal(kvf_transport_rdma_add_pool(t, 1, buf, 64, 1, NULL), -EIO);
        } else {
            struct kvf_rdma_conn_info info;
            assert_int_equal(kvf_transport_rdma_local_info(t, 0, &info), -EIO);
        }
        struct kvf_verbs_fake_stats after;
        kvf_verbs_fake_stats(fake, &after);
        assert_int_equal(after.objects_live, before.objects_live);
        kvf_transport_destroy(t);
        kvf_verbs_fake_stats(fake, &after);
        assert_int_equal(after.objects_live, 0);
        kvf_verbs_fake_destroy(fake);
    }

    /* A transition failing in connect: refused, and it can be retried. */
    struct kvf_verbs_fake *fake = kvf_verbs_fake_create();
    struct kvf_transport_rdma_opts o;
    kvf_transport_rdma_opts_init(&o);
    o.verbs = &kvf_verbs_fake_ops;
    o.verbs_prov = fake;
    struct kvf_transport *t = kvf_transport_rdma_create(&o, NULL);
    struct kvf_rdma_conn_info info;
    assert_int_equal(kvf_transport_rdma_local_info(t, 0, &info), 0);
    kvf_verbs_fake_fail_call(fake, KVF_FAKE_MODIFY_QP, 3, -EIO); /* qp 1's RTR */
    assert_int_equal(kvf_transport_rdma_connect(t, 0, &REMOTE), -EIO);
    assert_int_equal(kvf_transport_rdma_connect(t, 0, &REMOTE), 0);
    assert_int_equal(kvf_verbs_fake_qp_state(fake, info.qp_num[1]), IBV_QPS_RTS);
    kvf_transport_destroy(t);
    kvf_verbs_fake_destroy(fake);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_accounting, setup, teardown),
        cmocka_unit_test_setup_teardown(test_any_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_completion_siblings, setup, teardown),
        cmocka_unit_test_setup_teardown(test_post_fails_mid_chain, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fence, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fence_timeout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reset_peer_after_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_quarantine_until_completion_or_fence, setup, teardown),
        cmocka_unit_test_setup_teardown(test_quarantine_retired_by_flush, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wr_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_qp_transitions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_post_validation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_remove_pools, setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroy_with_outstanding, setup, teardown),
        cmocka_unit_test(test_real_provider_no_device),
        cmocka_unit_test(test_setup_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
