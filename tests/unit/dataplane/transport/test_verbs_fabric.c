/*
 * test_verbs_fabric.c: the fake verbs provider in fabric mode, under the real
 * RDMA transport (rdma.c) with real lifetime tables.
 *
 * Side A writes, side B is the sink: each side is a fabric device, a
 * transport and a lifetime table. B's pool sits between two canary pages that
 * are not part of its MR. Bytes really move: between two devices of this
 * process, and (test_across_processes) between this process and a forked
 * child. Every fake is created after any fork and destroyed (threads joined)
 * before the next test.
 *
 * Waiting: the transport's poll does not block, so the tests poll until the
 * completions they expect arrive, with a deadline. One check observes an
 * absence for a bounded time (test_hold: held WRs do not move).
 */
#include <errno.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "lifetime.h"
#include "rdma.h"
#include "transport.h"
#include "verbs.h"

#define PAGE       4096u
#define POOL_PAGES 32u
#define POOL_ID    5u
#define PEER_A     2u /* A as B's peer */
#define PEER_B     1u /* B as A's peer */
#define CANARY     0xccu
#define MAX_XFERS  64u
#define WAIT_MS    10000u

static const kvf_room_key ROOM_0 = {.room_id = 42, .generation = 1}; /* QP 0 */
static const kvf_room_key ROOM_1 = {.room_id = 43, .generation = 1}; /* QP 1 */

struct side {
    struct kvf_verbs_fake *fake;
    struct kvf_transport *t;
    struct kvf_lt_table *tab;
    struct kvf_lt *lt[2]; /* ROOM_0, ROOM_1 */
    uint8_t *mem;         /* canary page, POOL_PAGES pool pages, canary page */
    uint8_t *pool;        /* mem + PAGE: the MR */
    uint32_t rkey;
    struct kvf_rdma_conn_info info;
};

struct fx {
    struct side a;
    struct side b;
    struct kvf_xfer x[MAX_XFERS];
    struct kvf_completion c[MAX_XFERS];
};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void nap(void)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = 200000};
    nanosleep(&ts, NULL);
}

/* The byte A writes at offset `j` of page `i`: differs per page and offset. */
static uint8_t pattern(unsigned i, unsigned j)
{
    return (uint8_t)(i * 31u + j * 7u + 1u);
}

/* Device, transport, pool between canaries and a lifetime table. 0 or -errno
 * (plain returns: the forked child uses it too). */
static int side_init(struct side *s, const char *fabric)
{
    memset(s, 0, sizeof(*s));
    int err = 0;
    s->fake = kvf_verbs_fake_create_fabric(fabric, &err);
    if (!s->fake)
        return err;
    struct kvf_transport_rdma_opts o;
    kvf_transport_rdma_opts_init(&o);
    o.verbs = &kvf_verbs_fake_ops;
    o.verbs_prov = s->fake;
    o.gid_index = 0;
    o.psn_seed = 1;
    o.fence_timeout_ms = WAIT_MS;
    struct kvf_error e = {0};
    s->t = kvf_transport_rdma_create(&o, &e);
    if (!s->t)
        return e.code ? e.code : -EIO;
    s->mem = malloc((size_t)(POOL_PAGES + 2) * PAGE);
    if (!s->mem)
        return -ENOMEM;
    memset(s->mem, CANARY, (size_t)(POOL_PAGES + 2) * PAGE);
    s->pool = s->mem + PAGE;
    memset(s->pool, 0, (size_t)POOL_PAGES * PAGE);
    int rc = kvf_transport_rdma_add_pool(s->t, POOL_ID, s->pool, PAGE, POOL_PAGES, &s->rkey);
    if (rc != 0)
        return rc;
    s->tab = kvf_lt_table_create();
    if (!s->tab)
        return -ENOMEM;
    rc = kvf_lt_table_open(s->tab, ROOM_0, &s->lt[0]);
    if (rc == 0)
        rc = kvf_lt_table_open(s->tab, ROOM_1, &s->lt[1]);
    return rc;
}

static void side_fini(struct side *s)
{
    kvf_transport_destroy(s->t);
    struct kvf_verbs_fake_stats st;
    kvf_verbs_fake_stats(s->fake, &st);
    assert_int_equal(st.objects_live, 0);
    kvf_verbs_fake_destroy(s->fake);
    for (unsigned i = 0; i < 2; i++)
        (void)kvf_lt_close(s->lt[i]);
    assert_true(kvf_lt_table_can_teardown(s->tab));
    kvf_lt_table_destroy(s->tab);
    free(s->mem);
}

/* True when B's canary pages are intact. */
static bool canaries_ok(const struct side *s)
{
    for (unsigned j = 0; j < PAGE; j++) {
        if (s->mem[j] != CANARY || s->pool[(size_t)POOL_PAGES * PAGE + j] != CANARY)
            return false;
    }
    return true;
}

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (p[i] != 0)
            return false;
    }
    return true;
}

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    assert_int_equal(side_init(&f->a, "kvf-test"), 0);
    assert_int_equal(side_init(&f->b, "kvf-test"), 0);
    /* A's source pages carry the pattern. */
    for (unsigned i = 0; i < POOL_PAGES; i++) {
        for (unsigned j = 0; j < PAGE; j++)
            f->a.pool[(size_t)i * PAGE + j] = pattern(i, j);
    }
    assert_int_equal(kvf_transport_rdma_local_info(f->a.t, PEER_B, &f->a.info), 0);
    assert_int_equal(kvf_transport_rdma_local_info(f->b.t, PEER_A, &f->b.info), 0);
    /* RoCE-like: no LID, a GID per device. */
    assert_int_equal(f->a.info.lid, 0);
    assert_memory_not_equal(f->a.info.gid, f->b.info.gid, 16);
    assert_int_equal(kvf_transport_rdma_connect(f->a.t, PEER_B, &f->b.info), 0);
    assert_int_equal(kvf_transport_rdma_connect(f->b.t, PEER_A, &f->a.info), 0);
    assert_int_equal(kvf_transport_rdma_add_remote_pool(f->a.t, PEER_B, POOL_ID,
                                                        (uint64_t)(uintptr_t)f->b.pool, PAGE,
                                                        POOL_PAGES, f->b.rkey),
                     0);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    side_fini(&f->a);
    side_fini(&f->b);
    free(f);
    return 0;
}

/* Admits and fills xfer `i`: A's page `src_page` to page `dst_page` of remote
 * pool `pool`, in `room`. */
static struct kvf_xfer *mk(struct fx *f, unsigned i, kvf_room_key room, unsigned src_page,
                           uint32_t pool, unsigned dst_page)
{
    struct kvf_xfer *x = &f->x[i];
    memset(x, 0, sizeof(*x));
    assert_int_equal(kvf_lt_admit(f->a.lt[room.room_id % 2], &x->op, KVF_LT_OP_RDMA_WR, PEER_B), 0);
    x->peer = PEER_B;
    x->room = room;
    x->src = f->a.pool + (size_t)src_page * PAGE;
    x->len = PAGE;
    x->sink_pool = pool;
    x->first_page = dst_page;
    x->page_count = 1;
    return x;
}

/* Polls A until `want` completions came or the deadline passed. */
static unsigned poll_until(struct fx *f, unsigned want)
{
    unsigned n = 0;
    uint64_t deadline = now_ms() + WAIT_MS;
    while (n < want && now_ms() < deadline) {
        int r = kvf_transport_poll(f->a.t, want - n, &f->c[n]);
        assert_true(r >= 0);
        n += (unsigned)r;
        if (r == 0)
            nap();
    }
    return n;
}

static void close_drained(struct side *s, unsigned room)
{
    assert_true(kvf_lt_close(s->lt[room]));
    assert_int_equal(kvf_lt_state(s->lt[room]), KVF_LT_DRAINED);
}

/* ---- tests ----------------------------------------------------------------- */

/* Writes on both QPs, single posts and a chain: every byte lands where it was
 * sent, nothing else changes, and the lifetimes drain. */
static void test_writes_land(void **state)
{
    struct fx *f = *state;
    const unsigned n = 24;
    assert_true(all_zero(f->b.pool, (size_t)POOL_PAGES * PAGE)); /* else the check proves nothing */
    /* Page i goes to page (i * 5) % POOL_PAGES: not the identity. */
    for (unsigned i = 0; i < 16; i++) {
        struct kvf_xfer *x = mk(f, i, i % 2 ? ROOM_1 : ROOM_0, i, POOL_ID, (i * 5) % POOL_PAGES);
        assert_int_equal(kvf_transport_post_write(f->a.t, x), 0);
    }
    struct kvf_xfer *chain[8];
    for (unsigned i = 16; i < n; i++)
        chain[i - 16] = mk(f, i, ROOM_0, i, POOL_ID, (i * 5) % POOL_PAGES);
    unsigned posted = 0;
    assert_int_equal(kvf_transport_rdma_post_chain(f->a.t, chain, 8, &posted), 0);
    assert_int_equal(posted, 8);

    assert_int_equal(poll_until(f, n), n);
    const struct kvf_xfer *last_room0 = NULL;
    for (unsigned k = 0; k < n; k++) {
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_OK);
        assert_int_equal(f->c[k].status, 0);
        /* One QP completes in post order. */
        if (f->c[k].xfer->room.room_id == ROOM_0.room_id) {
            assert_true(!last_room0 || f->c[k].xfer > last_room0);
            last_room0 = f->c[k].xfer;
        }
    }
    for (unsigned i = 0; i < POOL_PAGES; i++) {
        const uint8_t *dst = f->b.pool + (size_t)i * PAGE;
        bool written = false;
        for (unsigned k = 0; k < n; k++) {
            if ((k * 5) % POOL_PAGES == i) {
                assert_memory_equal(dst, f->a.pool + (size_t)k * PAGE, PAGE);
                written = true;
            }
        }
        if (!written)
            assert_true(all_zero(dst, PAGE));
    }
    /* By construction a wrong byte is seen: page 0 holds pattern(0, .). */
    assert_int_equal(f->b.pool[1], pattern(0, 1));
    assert_int_not_equal(pattern(0, 1), pattern(1, 1));
    assert_true(canaries_ok(&f->b));

    struct kvf_verbs_fake_fabric_stats sa, sb;
    kvf_verbs_fake_fabric_stats(f->a.fake, &sa);
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sa.writes_out, n);
    assert_int_equal(sa.bytes_out, (uint64_t)n * PAGE);
    assert_int_equal(sb.writes_in, n);
    assert_int_equal(sb.bytes_in, (uint64_t)n * PAGE);
    assert_int_equal(sb.refused_in, 0);
    assert_int_equal(sa.writes_in, 0);
    close_drained(&f->a, 0);
    close_drained(&f->a, 1);
}

/* A bad rkey: the first WR ends in ERROR, the ones behind it FLUSHED, the QP
 * is broken, and B's memory is untouched. */
static void test_bad_rkey(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_transport_rdma_add_remote_pool(f->a.t, PEER_B, 9,
                                                        (uint64_t)(uintptr_t)f->b.pool, PAGE,
                                                        POOL_PAGES, f->b.rkey + 1000u),
                     0);
    kvf_verbs_fake_fabric_hold(f->a.fake, true); /* all three are queued before any is sent */
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 0, ROOM_0, 0, 9, 0)), 0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 1, ROOM_0, 1, POOL_ID, 1)), 0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 2, ROOM_0, 2, POOL_ID, 2)), 0);
    kvf_verbs_fake_fabric_hold(f->a.fake, false);
    assert_int_equal(poll_until(f, 3), 3);
    assert_ptr_equal(f->c[0].xfer, &f->x[0]);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(f->c[0].status, -EIO);
    for (unsigned k = 1; k < 3; k++) {
        assert_ptr_equal(f->c[k].xfer, &f->x[k]);
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_FLUSHED);
    }
    assert_int_equal(kvf_verbs_fake_qp_state(f->a.fake, f->a.info.qp_num[0]), IBV_QPS_ERR);
    /* Later posts to that QP are refused; the other QP still works. */
    struct kvf_xfer *x = mk(f, 3, ROOM_0, 3, POOL_ID, 3);
    assert_int_equal(kvf_transport_post_write(f->a.t, x), -EIO);
    assert_false(kvf_lt_op_cancel(&x->op));
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 4, ROOM_1, 4, POOL_ID, 4)), 0);
    assert_int_equal(poll_until(f, 1), 1);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);

    assert_true(all_zero(f->b.pool, (size_t)4 * PAGE));
    assert_memory_equal(f->b.pool + (size_t)4 * PAGE, f->a.pool + (size_t)4 * PAGE, PAGE);
    assert_true(canaries_ok(&f->b));
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sb.refused_in, 1);
    assert_int_equal(sb.writes_in, 1);
    close_drained(&f->a, 0);
    close_drained(&f->a, 1);
}

/* Writes outside B's MR (into a canary page, or straddling its end) are
 * refused whole: no byte outside, and none inside, is written. */
static void test_outside_mr(void **state)
{
    struct fx *f = *state;
    /* Pool 3 names B's memory from the leading canary on: page 0 of it is
     * outside the MR, page POOL_PAGES is the MR's last page. */
    assert_int_equal(kvf_transport_rdma_add_remote_pool(f->a.t, PEER_B, 3,
                                                        (uint64_t)(uintptr_t)f->b.mem, PAGE,
                                                        POOL_PAGES + 2, f->b.rkey),
                     0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 0, ROOM_0, 0, 3, 0)), 0);
    struct kvf_xfer *x = mk(f, 1, ROOM_1, 1, 3, POOL_PAGES);
    x->len = 2u * PAGE; /* the MR's last page and the trailing canary */
    x->page_count = 2;
    assert_int_equal(kvf_transport_post_write(f->a.t, x), 0);
    assert_int_equal(poll_until(f, 2), 2);
    for (unsigned k = 0; k < 2; k++)
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_ERROR);
    assert_true(canaries_ok(&f->b));
    assert_true(all_zero(f->b.pool, (size_t)POOL_PAGES * PAGE));
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sb.refused_in, 2);
    assert_int_equal(sb.writes_in, 0);
    close_drained(&f->a, 0);
    close_drained(&f->a, 1);
}

/* B fences A: A's later writes end in error and B's memory stays as it was. */
static void test_fence_by_sink(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 0, ROOM_0, 0, POOL_ID, 0)), 0);
    assert_int_equal(poll_until(f, 1), 1);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);
    assert_memory_equal(f->b.pool, f->a.pool, PAGE);

    /* Held: these are queued before the fence, sent after it. */
    kvf_verbs_fake_fabric_hold(f->a.fake, true);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 1, ROOM_0, 1, POOL_ID, 1)), 0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 2, ROOM_0, 2, POOL_ID, 2)), 0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 3, ROOM_1, 3, POOL_ID, 3)), 0);
    assert_int_equal(kvf_transport_fence_peer(f->b.t, PEER_A), 0);
    assert_int_equal(kvf_verbs_fake_qp_state(f->b.fake, f->b.info.qp_num[0]), IBV_QPS_ERR);
    kvf_verbs_fake_fabric_hold(f->a.fake, false);
    assert_int_equal(poll_until(f, 3), 3);
    unsigned errors = 0, flushed = 0;
    for (unsigned k = 0; k < 3; k++) {
        assert_int_not_equal(f->c[k].outcome, KVF_LT_DONE_OK);
        errors += f->c[k].outcome == KVF_LT_DONE_ERROR;
        flushed += f->c[k].outcome == KVF_LT_DONE_FLUSHED;
    }
    assert_int_equal(errors, 2); /* the first WR of each QP */
    assert_int_equal(flushed, 1);
    assert_memory_equal(f->b.pool, f->a.pool, PAGE); /* the write before the fence stays */
    assert_true(all_zero(f->b.pool + PAGE, (size_t)(POOL_PAGES - 1) * PAGE));
    assert_true(canaries_ok(&f->b));
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sb.writes_in, 1);
    assert_int_equal(sb.refused_in, 2);
    close_drained(&f->a, 0);
    close_drained(&f->a, 1);
}

/* Held WRs stay outstanding and do not move; released, they go in order. */
static void test_hold(void **state)
{
    struct fx *f = *state;
    kvf_verbs_fake_fabric_hold(f->a.fake, true);
    for (unsigned i = 0; i < 5; i++)
        assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, i, ROOM_0, i, POOL_ID, i)), 0);
    assert_int_equal(kvf_verbs_fake_outstanding(f->a.fake, f->a.info.qp_num[0]), 5);
    /* A bounded look at an absence: nothing completes, nothing lands. */
    uint64_t until = now_ms() + 100;
    while (now_ms() < until) {
        assert_int_equal(kvf_transport_poll(f->a.t, 5, f->c), 0);
        nap();
    }
    assert_int_equal(kvf_transport_rdma_outstanding(f->a.t, PEER_B, 0), 5);
    assert_int_equal(kvf_verbs_fake_outstanding(f->a.fake, f->a.info.qp_num[0]), 5);
    assert_true(all_zero(f->b.pool, (size_t)POOL_PAGES * PAGE));
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sb.writes_in, 0);
    /* The explicit completion controls make no sense here. */
    assert_int_equal(kvf_verbs_fake_complete(f->a.fake, f->a.info.qp_num[0], 1, IBV_WC_SUCCESS), 0);
    assert_int_equal(kvf_verbs_fake_complete_at(f->a.fake, f->a.info.qp_num[0], 0, IBV_WC_SUCCESS),
                     -EINVAL);

    kvf_verbs_fake_fabric_hold(f->a.fake, false);
    assert_int_equal(poll_until(f, 5), 5);
    for (unsigned k = 0; k < 5; k++) {
        assert_ptr_equal(f->c[k].xfer, &f->x[k]);
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_OK);
    }
    assert_memory_equal(f->b.pool, f->a.pool, (size_t)5 * PAGE);
    assert_int_equal(kvf_verbs_fake_outstanding(f->a.fake, f->a.info.qp_num[0]), 0);
    close_drained(&f->a, 0);
}

/* One QP held (kvf_verbs_fake_fabric_hold_qp): its WRs stay outstanding
 * while the other QP of the device sends and completes; released, the held
 * ones go in order. An unknown QP number is -ENOENT. */
static void test_hold_one_qp(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_verbs_fake_fabric_hold_qp(f->a.fake, 0xdeadu, true), -ENOENT);
    assert_int_equal(kvf_verbs_fake_fabric_hold_qp(f->a.fake, f->a.info.qp_num[1], true), 0);
    for (unsigned i = 0; i < 3; i++) /* QP 1: held */
        assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, i, ROOM_1, i, POOL_ID, i)), 0);
    for (unsigned i = 3; i < 5; i++) /* QP 0: runs */
        assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, i, ROOM_0, i, POOL_ID, i)), 0);
    assert_int_equal(poll_until(f, 2), 2);
    for (unsigned k = 0; k < 2; k++) {
        assert_ptr_equal(f->c[k].xfer, &f->x[3 + k]);
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_OK);
    }
    assert_memory_equal(f->b.pool + (size_t)3 * PAGE, f->a.pool + (size_t)3 * PAGE,
                        (size_t)2 * PAGE);
    /* QP 1's writes did not move while QP 0's went through. */
    assert_int_equal(kvf_verbs_fake_outstanding(f->a.fake, f->a.info.qp_num[1]), 3);
    assert_int_equal(kvf_transport_poll(f->a.t, 3, f->c), 0);
    assert_true(all_zero(f->b.pool, (size_t)3 * PAGE));
    close_drained(&f->a, 0);

    assert_int_equal(kvf_verbs_fake_fabric_hold_qp(f->a.fake, f->a.info.qp_num[1], false), 0);
    assert_int_equal(poll_until(f, 3), 3);
    for (unsigned k = 0; k < 3; k++) {
        assert_ptr_equal(f->c[k].xfer, &f->x[k]);
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_OK);
    }
    assert_memory_equal(f->b.pool, f->a.pool, (size_t)3 * PAGE);
    assert_true(canaries_ok(&f->b));
    close_drained(&f->a, 1);
}

/* A's own fence (QP to ERR) while WRs are held: all of them flush, none is
 * sent later. */
static void test_fence_by_source_flushes_held(void **state)
{
    struct fx *f = *state;
    kvf_verbs_fake_fabric_hold(f->a.fake, true);
    for (unsigned i = 0; i < 4; i++)
        assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, i, ROOM_0, i, POOL_ID, i)), 0);
    assert_int_equal(kvf_transport_fence_peer(f->a.t, PEER_B), 0);
    assert_int_equal(poll_until(f, 4), 4);
    for (unsigned k = 0; k < 4; k++)
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_FLUSHED);
    kvf_verbs_fake_fabric_hold(f->a.fake, false);
    struct kvf_verbs_fake_stats st;
    kvf_verbs_fake_stats(f->a.fake, &st);
    assert_int_equal(st.flushes, 4 + 2); /* the WRs and the two drain markers */
    struct kvf_verbs_fake_fabric_stats sa;
    kvf_verbs_fake_fabric_stats(f->a.fake, &sa);
    assert_int_equal(sa.writes_out, 0);
    assert_true(all_zero(f->b.pool, (size_t)POOL_PAGES * PAGE));
    close_drained(&f->a, 0);
}

/* RoCE needs a GID: an RTR without is_global is refused. A fabric name too
 * long for a socket address is refused. */
static void test_rtr_needs_gid(void **state)
{
    (void)state;
    int err = 0;
    struct kvf_verbs_fake *fk = kvf_verbs_fake_create_fabric(NULL, &err);
    assert_non_null(fk);
    struct kvf_transport_rdma_opts o;
    kvf_transport_rdma_opts_init(&o);
    o.verbs = &kvf_verbs_fake_ops;
    o.verbs_prov = fk;
    o.gid_index = -1; /* route by LID: not on this fabric */
    struct kvf_transport *t = kvf_transport_rdma_create(&o, NULL);
    assert_non_null(t);
    struct kvf_rdma_conn_info mine;
    assert_int_equal(kvf_transport_rdma_local_info(t, 0, &mine), 0);
    assert_int_equal(kvf_transport_rdma_connect(t, 0, &mine), -EINVAL);
    kvf_transport_destroy(t);
    kvf_verbs_fake_destroy(fk);

    char longname[80];
    memset(longname, 'x', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    assert_null(kvf_verbs_fake_create_fabric(longname, &err));
    assert_int_equal(err, -EINVAL);
}

/* A device that went away: writes to it end in RETRY_EXC (ERROR) and the
 * ones behind in FLUSH, not in a hang. */
static void test_unreachable(void **state)
{
    struct fx *f = *state;
    /* B's device goes away (its transport first: it fences and frees). */
    side_fini(&f->b);
    assert_int_equal(side_init(&f->b, "kvf-test"), 0); /* a new device, new GID */
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 0, ROOM_0, 0, POOL_ID, 0)), 0);
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 1, ROOM_0, 1, POOL_ID, 1)), 0);
    assert_int_equal(poll_until(f, 2), 2);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
    assert_true(all_zero(f->b.pool, (size_t)POOL_PAGES * PAGE));
    close_drained(&f->a, 0);
}

/* A device that A's QPs are not connected to (C) writes into B with B's
 * rkey: B refuses it (RETRY_EXC at C) and its memory stays as it was. */
static void test_stranger(void **state)
{
    struct fx *f = *state;
    struct side c;
    assert_int_equal(side_init(&c, "kvf-test"), 0);
    struct kvf_rdma_conn_info ci;
    assert_int_equal(kvf_transport_rdma_local_info(c.t, PEER_B, &ci), 0);
    assert_int_equal(kvf_transport_rdma_connect(c.t, PEER_B, &f->b.info), 0); /* B's QPs are A's */
    assert_int_equal(kvf_transport_rdma_add_remote_pool(c.t, PEER_B, POOL_ID,
                                                        (uint64_t)(uintptr_t)f->b.pool, PAGE,
                                                        POOL_PAGES, f->b.rkey),
                     0);
    memset(c.pool, 0x5a, PAGE);
    struct kvf_xfer x;
    memset(&x, 0, sizeof(x));
    assert_int_equal(kvf_lt_admit(c.lt[0], &x.op, KVF_LT_OP_RDMA_WR, PEER_B), 0);
    x.peer = PEER_B;
    x.room = ROOM_0;
    x.src = c.pool;
    x.len = PAGE;
    x.sink_pool = POOL_ID;
    x.page_count = 1;
    assert_int_equal(kvf_transport_post_write(c.t, &x), 0);
    struct kvf_completion cp;
    int n = 0;
    for (uint64_t deadline = now_ms() + WAIT_MS; n == 0 && now_ms() < deadline;) {
        n = kvf_transport_poll(c.t, 1, &cp);
        if (n == 0)
            nap();
    }
    assert_int_equal(n, 1);
    assert_int_equal(cp.outcome, KVF_LT_DONE_ERROR);
    assert_true(all_zero(f->b.pool, PAGE));
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(f->b.fake, &sb);
    assert_int_equal(sb.refused_in, 1);
    assert_int_equal(sb.writes_in, 0);
    /* A, which B's QPs are connected to, gets through. */
    assert_int_equal(kvf_transport_post_write(f->a.t, mk(f, 0, ROOM_0, 0, POOL_ID, 0)), 0);
    assert_int_equal(poll_until(f, 1), 1);
    assert_int_equal(f->c[0].outcome, KVF_LT_DONE_OK);
    assert_memory_equal(f->b.pool, f->a.pool, PAGE);
    close_drained(&c, 0);
    side_fini(&c);
    close_drained(&f->a, 0);
}

/* A scripted responder: a socket at the fabric address of a made-up GID,
 * speaking the fake's wire format (verbs_fake.c: a u32 length, a 56-byte
 * request whose seq is the last u64, the payload; the answer is a u32 length
 * and {u64 seq, u32 status, u32 pad}). It lets the test hold a WR on the
 * wire while its QP goes to ERR. */
static int scripted_listen(const uint8_t gid[16])
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    int n = snprintf(sa.sun_path + 1, sizeof(sa.sun_path) - 1, "kvf-fabric/kvf-test/");
    for (unsigned i = 0; i < 16; i++)
        n += snprintf(sa.sun_path + 1 + n, sizeof(sa.sun_path) - 1 - (size_t)n, "%02x", gid[i]);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa,
                          (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)),
                     0);
    assert_int_equal(listen(fd, 4), 0);
    return fd;
}

static int xfer_full(int fd, void *buf, size_t len, bool wr);

/* Reads one request; returns its seq. */
static uint64_t scripted_read(int fd)
{
    uint32_t len = 0;
    assert_int_equal(xfer_full(fd, &len, sizeof(len), false), 0);
    assert_true(len >= 56 && len <= 56 + PAGE);
    uint8_t buf[56 + PAGE];
    assert_int_equal(xfer_full(fd, buf, len, false), 0);
    uint64_t seq;
    memcpy(&seq, buf + 48, sizeof(seq));
    return seq;
}

static void scripted_answer(int fd, uint64_t seq, uint32_t status)
{
    uint8_t out[4 + 16] = {0};
    uint32_t len = 16;
    memcpy(out, &len, 4);
    memcpy(out + 4, &seq, 8);
    memcpy(out + 12, &status, 4);
    assert_int_equal(xfer_full(fd, out, sizeof(out), true), 0);
}

/* A WR on the wire when its QP goes to ERR completes once: SUCCESS if the
 * remote acked it, FLUSH if not; the WRs behind it flush after it, never
 * before. */
static void test_err_while_on_the_wire(void **state)
{
    struct fx *f = *state;
    struct side *a = &f->a;
    struct kvf_rdma_conn_info fake_remote = {.lid = 0, .qp_num = {0x900, 0x901}, .psn = {1, 2}};
    uint32_t pid = (uint32_t)getpid(); /* unique while runs of this test overlap */
    for (unsigned i = 0; i < 16; i++)
        fake_remote.gid[i] = i < 4 ? (uint8_t)(pid >> (8 * i)) : (uint8_t)(0xa0 + i);
    int lfd = scripted_listen(fake_remote.gid);
    const uint32_t peer = 7;
    struct kvf_rdma_conn_info ai;
    assert_int_equal(kvf_transport_rdma_local_info(a->t, peer, &ai), 0);
    assert_int_equal(kvf_transport_rdma_connect(a->t, peer, &fake_remote), 0);
    assert_int_equal(kvf_transport_rdma_add_remote_pool(a->t, peer, 1, 0x10000, PAGE, 4, 0x77), 0);

    const uint32_t status_of[2] = {0 /* acked */, 2 /* not acked */};
    const enum kvf_lt_outcome first[2] = {KVF_LT_DONE_OK, KVF_LT_DONE_FLUSHED};
    int cfd = -1;
    for (unsigned qp = 0; qp < 2; qp++) {
        kvf_room_key room = qp ? ROOM_1 : ROOM_0;
        for (unsigned k = 0; k < 2; k++) {
            struct kvf_xfer *x = mk(f, 2 * qp + k, room, k, 1, k);
            x->peer = peer;
            x->op.peer = peer;
            assert_int_equal(kvf_transport_post_write(a->t, x), 0);
        }
        if (cfd < 0) {
            struct pollfd pfd = {.fd = lfd, .events = POLLIN};
            assert_int_equal(poll(&pfd, 1, (int)WAIT_MS), 1);
            cfd = accept(lfd, NULL, NULL);
            assert_true(cfd >= 0);
        }
        uint64_t seq = scripted_read(cfd); /* the first WR is on the wire */
        assert_int_equal(kvf_verbs_fake_set_qp_error(a->fake, ai.qp_num[qp]), 0);
        /* Nothing may complete before the WR on the wire does. */
        assert_int_equal(kvf_transport_poll(a->t, 4, f->c), 0);
        assert_int_equal(kvf_verbs_fake_outstanding(a->fake, ai.qp_num[qp]), 2);
        scripted_answer(cfd, seq, status_of[qp]);
        assert_int_equal(poll_until(f, 2), 2);
        assert_ptr_equal(f->c[0].xfer, &f->x[2 * qp]);
        assert_int_equal(f->c[0].outcome, first[qp]);
        assert_ptr_equal(f->c[1].xfer, &f->x[2 * qp + 1]);
        assert_int_equal(f->c[1].outcome, KVF_LT_DONE_FLUSHED);
        assert_int_equal(kvf_transport_poll(a->t, 4, f->c), 0); /* once each */
    }
    close(cfd);
    close(lfd);
    close_drained(a, 0);
    close_drained(a, 1);
}

/* ---- across processes ---------------------------------------------------------- */

struct hello {
    struct kvf_rdma_conn_info info;
    uint64_t addr;
    uint32_t rkey;
};

static int xfer_full(int fd, void *buf, size_t len, bool wr)
{
    uint8_t *p = buf;
    while (len > 0) {
        if (!wr) {
            struct pollfd pfd = {.fd = fd, .events = POLLIN};
            if (poll(&pfd, 1, (int)WAIT_MS) <= 0)
                return -ETIMEDOUT;
        }
        ssize_t r = wr ? write(fd, p, len) : read(fd, p, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -EIO;
        p += r;
        len -= (size_t)r;
    }
    return 0;
}

#define XP_PAGES 8u

/* The child: a sink. Exit 0 when every byte the parent wrote is right and
 * nothing else changed; a distinct code per failed check. */
static int child_main(int sock)
{
    struct side b;
    if (side_init(&b, "kvf-xproc") != 0)
        return 10;
    struct hello mine, theirs;
    memset(&mine, 0, sizeof(mine));
    if (kvf_transport_rdma_local_info(b.t, PEER_A, &mine.info) != 0)
        return 11;
    mine.addr = (uint64_t)(uintptr_t)b.pool;
    mine.rkey = b.rkey;
    if (xfer_full(sock, &mine, sizeof(mine), true) != 0 ||
        xfer_full(sock, &theirs, sizeof(theirs), false) != 0)
        return 12;
    if (kvf_transport_rdma_connect(b.t, PEER_A, &theirs.info) != 0)
        return 13;
    uint8_t go = 0;
    if (xfer_full(sock, &mine, 1, true) != 0 || xfer_full(sock, &go, 1, false) != 0)
        return 14; /* connected / the parent's writes all completed */
    /* The stats take the device lock the responder copied under: this
     * thread then sees the copies (the parent's message is no ordering the
     * thread sanitizer can see across processes). */
    struct kvf_verbs_fake_fabric_stats sb;
    kvf_verbs_fake_fabric_stats(b.fake, &sb);
    int code = 0;
    for (unsigned i = 0; i < POOL_PAGES && code == 0; i++) {
        for (unsigned j = 0; j < PAGE; j++) {
            uint8_t want = i < XP_PAGES ? pattern(i, j) : 0;
            if (b.pool[(size_t)i * PAGE + j] != want) {
                code = 20;
                break;
            }
        }
    }
    if (code == 0 && !canaries_ok(&b))
        code = 21;
    if (code == 0 && (sb.writes_in != XP_PAGES || sb.bytes_in != (uint64_t)XP_PAGES * PAGE))
        code = 22;
    kvf_transport_destroy(b.t);
    kvf_verbs_fake_destroy(b.fake);
    for (unsigned i = 0; i < 2; i++)
        (void)kvf_lt_close(b.lt[i]);
    kvf_lt_table_destroy(b.tab);
    free(b.mem);
    return code;
}

/* Runs the cross-process exchange; the child checks the bytes it got. With
 * `corrupt`, page 0's source changes after the pattern was fixed: the child
 * must notice (the check can fail). */
static int run_across(bool corrupt)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    fflush(NULL);
    pid_t pid = fork(); /* no fake exists here yet: no threads across fork */
    assert_true(pid >= 0);
    if (pid == 0) {
        close(sv[0]);
        _exit(child_main(sv[1]));
    }
    close(sv[1]);
    struct fx *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    assert_int_equal(side_init(&f->a, "kvf-xproc"), 0);
    for (unsigned i = 0; i < POOL_PAGES; i++) {
        for (unsigned j = 0; j < PAGE; j++)
            f->a.pool[(size_t)i * PAGE + j] = pattern(i, j);
    }
    if (corrupt)
        f->a.pool[PAGE / 2] ^= 0x01;
    struct hello mine, theirs;
    memset(&mine, 0, sizeof(mine));
    assert_int_equal(kvf_transport_rdma_local_info(f->a.t, PEER_B, &mine.info), 0);
    assert_int_equal(xfer_full(sv[0], &theirs, sizeof(theirs), false), 0);
    assert_int_equal(xfer_full(sv[0], &mine, sizeof(mine), true), 0);
    assert_int_equal(kvf_transport_rdma_connect(f->a.t, PEER_B, &theirs.info), 0);
    assert_int_equal(kvf_transport_rdma_add_remote_pool(f->a.t, PEER_B, POOL_ID, theirs.addr, PAGE,
                                                        POOL_PAGES, theirs.rkey),
                     0);
    uint8_t b = 0;
    assert_int_equal(xfer_full(sv[0], &b, 1, false), 0); /* the child is connected too */
    for (unsigned i = 0; i < XP_PAGES; i++) {
        struct kvf_xfer *x = mk(f, i, i % 2 ? ROOM_1 : ROOM_0, i, POOL_ID, i);
        assert_int_equal(kvf_transport_post_write(f->a.t, x), 0);
    }
    assert_int_equal(poll_until(f, XP_PAGES), XP_PAGES);
    for (unsigned k = 0; k < XP_PAGES; k++)
        assert_int_equal(f->c[k].outcome, KVF_LT_DONE_OK);
    assert_int_equal(xfer_full(sv[0], &b, 1, true), 0);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    close(sv[0]);
    close_drained(&f->a, 0);
    close_drained(&f->a, 1);
    side_fini(&f->a);
    free(f);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

static void test_across_processes(void **state)
{
    (void)state;
    assert_int_equal(run_across(false), 0);
    assert_int_equal(run_across(true), 20); /* a wrong byte is seen */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_writes_land, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_rkey, setup, teardown),
        cmocka_unit_test_setup_teardown(test_outside_mr, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fence_by_sink, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hold, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hold_one_qp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fence_by_source_flushes_held, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unreachable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stranger, setup, teardown),
        cmocka_unit_test_setup_teardown(test_err_while_on_the_wire, setup, teardown),
        cmocka_unit_test(test_rtr_needs_gid),
        cmocka_unit_test(test_across_processes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
