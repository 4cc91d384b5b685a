/*
 * test_local.c: the same-host transport (local.h) with real worker threads.
 *
 * One lifetime table with one room open, a source buffer and a sink pool of
 * malloc'd pages with canary patterns. The tests check the bytes in the pool,
 * the completions (outcome, order, drained flag), the transport's counters
 * and the lifetime's in-flight count. "In flight" is held with the
 * transport's hold control, never with a sleep; waits poll observed state
 * with a timeout.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "lifetime.h"
#include "local.h"
#include "pool.h"
#include "transport.h"

#define PAGE       4096u
#define POOL_PAGES 64u
#define POOL_ID    3u
#define SELF       5u /* the node's own peer index */
#define WAIT_MS    10000

struct fx {
    struct kvf_transport *t;
    struct kvf_lt_table *tab;
    struct kvf_lt *lt;
    uint8_t *pool;
    uint8_t *src;
    struct kvf_xfer x[16];
};

static uint8_t canary(size_t i)
{
    return (uint8_t)(0x5a ^ (i * 13u));
}

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static struct fx *fx_new(unsigned threads, size_t src_bytes)
{
    struct fx *f = calloc(1, sizeof *f);
    assert_non_null(f);
    struct kvf_transport_local_opts o;
    kvf_transport_local_opts_init(&o);
    o.threads = threads;
    f->t = kvf_transport_local_create(&o);
    assert_non_null(f->t);
    assert_string_equal(kvf_transport_name(f->t), "local");
    f->tab = kvf_lt_table_create();
    assert_non_null(f->tab);
    assert_int_equal(kvf_lt_table_open(f->tab, (kvf_room_key){1, 1}, &f->lt), 0);
    f->pool = malloc((size_t)PAGE * POOL_PAGES);
    assert_non_null(f->pool);
    for (size_t i = 0; i < (size_t)PAGE * POOL_PAGES; i++)
        f->pool[i] = canary(i);
    f->src = malloc(src_bytes);
    assert_non_null(f->src);
    for (size_t i = 0; i < src_bytes; i++)
        f->src[i] = (uint8_t)(i * 7u + 1u);
    assert_int_equal(kvf_transport_local_add_pool(f->t, POOL_ID, f->pool, PAGE, POOL_PAGES), 0);
    assert_int_equal(kvf_transport_local_add_peer(f->t, SELF), 0);
    return f;
}

static void fx_free(struct fx *f)
{
    kvf_transport_destroy(f->t);
    kvf_lt_table_destroy(f->tab);
    free(f->pool);
    free(f->src);
    free(f);
}

/* Admits and posts write `i`: `pages` pages from src + soff into page `first`. */
static int post(struct fx *f, unsigned i, size_t soff, uint32_t first, uint32_t pages)
{
    struct kvf_xfer *x = &f->x[i];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->room = (kvf_room_key){1, 1};
    x->src = f->src + soff;
    x->len = (uint64_t)pages * PAGE;
    x->sink_pool = POOL_ID;
    x->first_page = first;
    x->page_count = pages;
    int rc = kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF);
    if (rc != 0)
        return rc;
    rc = kvf_transport_post_write(f->t, x);
    if (rc != 0)
        (void)kvf_lt_op_cancel(&x->op);
    return rc;
}

/* Polls until `want` completions came back (in order into `out`). */
static void reap(struct fx *f, unsigned want, struct kvf_completion *out)
{
    unsigned got = 0;
    int64_t end = now_ms() + WAIT_MS;
    while (got < want) {
        int n = kvf_transport_poll(f->t, want - got, out + got);
        assert_true(n >= 0);
        got += (unsigned)n;
        if (now_ms() > end)
            fail_msg("%u of %u completions after %d ms", got, want, WAIT_MS);
    }
    struct kvf_completion extra;
    assert_int_equal(kvf_transport_poll(f->t, 1, &extra), 0);
}

static struct kvf_transport_local_stats stats(struct fx *f)
{
    struct kvf_transport_local_stats s;
    kvf_transport_local_stats(f->t, &s);
    return s;
}

static void check_pages(struct fx *f, uint32_t first, uint32_t pages, size_t soff)
{
    for (size_t i = 0; i < (size_t)pages * PAGE; i++) {
        size_t pi = (size_t)first * PAGE + i;
        if (f->pool[pi] != f->src[soff + i])
            fail_msg("pool byte %zu: 0x%02x, want 0x%02x", pi, f->pool[pi], f->src[soff + i]);
    }
}

static void check_canary(struct fx *f, uint32_t first, uint32_t pages)
{
    for (size_t i = (size_t)first * PAGE; i < (size_t)(first + pages) * PAGE; i++)
        if (f->pool[i] != canary(i))
            fail_msg("pool byte %zu changed", i);
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_accounting_and_drain(void **state)
{
    (void)state;
    struct fx *f = fx_new(1, (size_t)PAGE * 8);
    for (unsigned i = 0; i < 4; i++)
        assert_int_equal(post(f, i, (size_t)i * 2 * PAGE, 10 + i * 2, 2), 0);
    assert_int_equal(stats(f).posted, 4);
    /* Counted from admission until poll retires them, not when copied. */
    assert_int_equal(kvf_lt_inflight(f->lt), 4);
    int64_t end = now_ms() + WAIT_MS;
    while (stats(f).done < 4)
        assert_true(now_ms() < end);
    assert_int_equal(kvf_lt_inflight(f->lt), 4);
    /* Close with everything in flight: the last retirement drains. */
    assert_false(kvf_lt_close(f->lt));
    struct kvf_completion c[4];
    reap(f, 4, c);
    for (unsigned i = 0; i < 4; i++) {
        assert_ptr_equal(c[i].xfer, &f->x[i]); /* one worker: post order */
        assert_int_equal(c[i].outcome, KVF_LT_DONE_OK);
        assert_int_equal(c[i].status, 0);
        assert_int_equal(c[i].drained, i == 3);
    }
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    check_pages(f, 10, 8, 0);
    check_canary(f, 0, 10);
    check_canary(f, 18, POOL_PAGES - 18);
    struct kvf_transport_local_stats s = stats(f);
    assert_int_equal(s.copied, 4);
    assert_int_equal(s.flushed, 0);
    assert_int_equal(s.queued + s.copying + s.done, 0);
    fx_free(f);
}

/* The wake descriptor (transport.h): a sleeping poller wakes in poll(2) when
 * a copy completes, with no timer; cleared, then polled empty, it sleeps
 * again until the next completion. */
static void test_wake_fd_wakes_the_poller(void **state)
{
    (void)state;
    struct fx *f = fx_new(1, (size_t)PAGE * 4);
    int fd = kvf_transport_wake_fd(f->t);
    assert_true(fd >= 0);
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 0), 0); /* nothing done yet */
    for (unsigned round = 0; round < 3; round++) {
        assert_int_equal(post(f, round, 0, round, 1), 0);
        assert_int_equal(poll(&pf, 1, WAIT_MS), 1);
        kvf_transport_wake_ack(f->t);
        struct kvf_completion c;
        reap(f, 1, &c);
        assert_int_equal(c.outcome, KVF_LT_DONE_OK);
        assert_int_equal(poll(&pf, 1, 0), 0); /* asleep again until the next one */
    }
    fx_free(f);
}

/* Pools through the ops table (transport.h add_pool/remove_pool), as the
 * node's registry registers them: a write lands in a pool added that way;
 * after its removal a post to it is refused and nothing lands. */
static void test_pool_through_the_ops_table(void **state)
{
    (void)state;
    struct fx *f = fx_new(1, (size_t)PAGE * 2);
    uint8_t *mem = malloc((size_t)PAGE * 4);
    assert_non_null(mem);
    memset(mem, 0xee, (size_t)PAGE * 4);
    struct kvf_transport_pool p = {.id = 8, .base = mem, .page_size = PAGE, .page_count = 4};
    uint64_t key = 1;
    assert_int_equal(kvf_transport_add_pool(f->t, &p, &key), 0);
    assert_int_equal(key, 0);
    assert_int_equal(kvf_transport_add_pool(f->t, &p, NULL), -EEXIST);
    struct kvf_xfer *x = &f->x[0];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->room = (kvf_room_key){1, 1};
    x->src = f->src;
    x->len = PAGE;
    x->sink_pool = 8;
    x->first_page = 2;
    x->page_count = 1;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    struct kvf_completion c;
    reap(f, 1, &c);
    assert_int_equal(c.outcome, KVF_LT_DONE_OK);
    assert_memory_equal(mem + 2 * (size_t)PAGE, f->src, PAGE);
    assert_int_equal(kvf_transport_remove_pool(f->t, 8), 0);
    assert_int_equal(kvf_transport_remove_pool(f->t, 8), -ENOENT);
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->src = f->src;
    x->len = PAGE;
    x->sink_pool = 8;
    x->page_count = 1;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    free(mem);
    fx_free(f);
}

static void test_bad_writes_post_nothing(void **state)
{
    (void)state;
    struct fx *f = fx_new(1, (size_t)PAGE * 4);
    struct kvf_xfer *x = &f->x[0];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->src = f->src;
    x->sink_pool = POOL_ID;
    x->first_page = POOL_PAGES - 1;
    x->page_count = 2; /* past the pool */
    x->len = 2 * PAGE;
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->first_page = 0;
    x->page_count = 2;
    x->len = PAGE; /* does not touch page 2 of 2 */
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->len = 2 * PAGE;
    x->sink_pool = 99;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    x->sink_pool = POOL_ID;
    x->src = NULL;
    assert_int_equal(kvf_transport_post_write(f->t, x), -EINVAL);
    x->src = f->src;
    x->peer = SELF + 1;
    assert_int_equal(kvf_transport_post_write(f->t, x), -ENOENT);
    assert_int_equal(kvf_transport_fence_peer(f->t, SELF + 1), -ENOENT);
    assert_int_equal(stats(f).posted, 0);
    check_canary(f, 0, POOL_PAGES);
    fx_free(f);
}

static void test_overlapping_writes_land_in_post_order(void **state)
{
    (void)state;
    /* Two workers; eight writes, all to pages [4, 8), each from its own source
     * region: the last one posted must be what stays, never a mix. */
    struct fx *f = fx_new(2, (size_t)PAGE * 4 * 8);
    for (unsigned i = 0; i < 8; i++)
        assert_int_equal(post(f, i, (size_t)i * 4 * PAGE, 4, 4), 0);
    struct kvf_completion c[8];
    reap(f, 8, c);
    for (unsigned i = 0; i < 8; i++)
        assert_int_equal(c[i].outcome, KVF_LT_DONE_OK);
    check_pages(f, 4, 4, (size_t)7 * 4 * PAGE);
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    fx_free(f);
}

static void test_fence_flushes_queued_and_refuses_later_posts(void **state)
{
    (void)state;
    struct fx *f = fx_new(2, (size_t)PAGE * 6);
    kvf_transport_local_set_hold(f->t, true);
    for (unsigned i = 0; i < 3; i++)
        assert_int_equal(post(f, i, (size_t)i * 2 * PAGE, 20 + i * 2, 2), 0);
    assert_int_equal(stats(f).queued, 3);
    assert_int_equal(kvf_transport_fence_peer(f->t, SELF), 0);
    assert_int_equal(kvf_transport_fence_peer(f->t, SELF), 0); /* idempotent */
    assert_int_equal(kvf_lt_close(f->lt), false);
    struct kvf_completion c[3];
    reap(f, 3, c);
    for (unsigned i = 0; i < 3; i++) {
        assert_ptr_equal(c[i].xfer, &f->x[i]);
        assert_int_equal(c[i].outcome, KVF_LT_DONE_FLUSHED);
        assert_int_not_equal(c[i].status, 0);
        assert_int_equal(c[i].drained, i == 2);
    }
    kvf_transport_local_set_hold(f->t, false);
    check_canary(f, 0, POOL_PAGES); /* nothing landed */
    assert_int_equal(stats(f).flushed, 3);
    assert_int_equal(stats(f).copied, 0);
    /* Fenced: a later post is refused and nothing is counted. */
    struct kvf_lt *lt2;
    assert_int_equal(kvf_lt_table_open(f->tab, (kvf_room_key){2, 1}, &lt2), 0);
    f->lt = lt2;
    assert_int_equal(post(f, 3, 0, 30, 1), -ESTALE);
    assert_int_equal(kvf_lt_inflight(lt2), 0);
    fx_free(f);
}

static void test_fence_waits_for_the_copy_in_progress(void **state)
{
    (void)state;
    /* One 64 MiB copy into a pool of its own: the fence starts while the
     * worker copies it and must not return before every byte is in place. */
    struct fx *f = fx_new(1, (size_t)PAGE);
    const uint32_t big_page = 1u << 20, big_pages = 64;
    size_t big = (size_t)big_page * big_pages;
    uint8_t *from = malloc(big), *to = calloc(1, big);
    assert_non_null(from);
    assert_non_null(to);
    for (size_t i = 0; i < big; i++)
        from[i] = (uint8_t)(i * 29u + 3u);
    assert_int_equal(kvf_transport_local_add_pool(f->t, POOL_ID + 1, to, big_page, big_pages), 0);
    struct kvf_xfer *x = &f->x[0];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->src = from;
    x->len = big;
    x->sink_pool = POOL_ID + 1;
    x->page_count = big_pages;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    int64_t end = now_ms() + WAIT_MS;
    struct kvf_transport_local_stats s;
    do {
        s = stats(f);
        assert_true(now_ms() < end);
    } while (s.copying == 0 && s.done == 0);
    assert_int_equal(kvf_transport_fence_peer(f->t, SELF), 0);
    s = stats(f);
    assert_int_equal(s.copying, 0);
    assert_int_equal(s.copied, 1);
    assert_memory_equal(to, from, big);
    struct kvf_completion c;
    reap(f, 1, &c);
    assert_int_equal(c.outcome, KVF_LT_DONE_OK); /* it had started: it finished */
    fx_free(f);
    free(from);
    free(to);
}

static void test_destroy_retires_queued_writes(void **state)
{
    (void)state;
    struct fx *f = fx_new(1, (size_t)PAGE * 4);
    kvf_transport_local_set_hold(f->t, true);
    for (unsigned i = 0; i < 4; i++)
        assert_int_equal(post(f, i, (size_t)i * PAGE, 40 + i, 1), 0);
    assert_false(kvf_lt_close(f->lt));
    assert_int_equal(kvf_lt_inflight(f->lt), 4);
    kvf_transport_destroy(f->t);
    f->t = NULL;
    /* Every op retired (flushed, no byte written): the room drained. */
    assert_int_equal(kvf_lt_inflight(f->lt), 0);
    assert_int_equal(kvf_lt_state(f->lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->lt));
    check_canary(f, 0, POOL_PAGES);
    fx_free(f);
}

/* ---- device pools -------------------------------------------------------------- */

/* A fake device pool (pool.h) over a new shm object of POOL_PAGES pages
 * filled with `seed`'s pattern; the object is unlinked at once (the mapping
 * keeps it). */
static struct kvf_pool *dev_pool(const char *tag, uint8_t seed)
{
    char name[64];
    snprintf(name, sizeof name, "/kvf-test-local-%d-%s", (int)getpid(), tag);
    shm_unlink(name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    size_t bytes = (size_t)PAGE * POOL_PAGES;
    assert_int_equal(ftruncate(fd, (off_t)bytes), 0);
    uint8_t *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    for (size_t i = 0; i < bytes; i++)
        m[i] = (uint8_t)(seed + i * 3u);
    munmap(m, bytes);
    close(fd);
    struct kvf_pool *p = NULL;
    assert_int_equal(kvf_pool_open_fake_device(name, 0, bytes, PAGE, POOL_PAGES, &p, NULL), 0);
    shm_unlink(name);
    return p;
}

static uint8_t dev_byte(struct kvf_pool *p, uint64_t off)
{
    uint8_t b = 0;
    assert_int_equal(kvf_pool_read(p, off, &b, 1), 0);
    return b;
}

/* Host -> device, device -> host and device -> device copies all go through
 * the pools' copy functions (their counters say so) and land byte-exact. */
static void test_device_pools_copy_through_the_pool(void **state)
{
    (void)state;
    struct fx *f = fx_new(2, (size_t)PAGE * 8);
    struct kvf_pool *dsink = dev_pool("sink", 0x10);
    struct kvf_pool *dsrc = dev_pool("src", 0x90);
    assert_int_equal(kvf_transport_local_add_device_pool(f->t, 7, dsink), 0);
    assert_int_equal(kvf_transport_local_add_device_pool(f->t, 8, dsrc), 0);
    /* 0: host src -> device pool 7 pages [4, 6). */
    struct kvf_xfer *x = &f->x[0];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->room = (kvf_room_key){1, 1};
    x->src = f->src;
    x->len = 2u * PAGE;
    x->sink_pool = 7;
    x->first_page = 4;
    x->page_count = 2;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    /* 1: device pool 8 pages [10, 13) -> host pool pages [20, 23). */
    x = &f->x[1];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->room = (kvf_room_key){1, 1};
    x->src = (const uint8_t *)kvf_pool_page(dsrc, 10);
    x->len = 3u * PAGE;
    x->sink_pool = POOL_ID;
    x->first_page = 20;
    x->page_count = 3;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);
    /* 2: device pool 8 pages [0, 2) -> device pool 7 pages [30, 32). */
    x = &f->x[2];
    memset(x, 0, sizeof *x);
    x->peer = SELF;
    x->room = (kvf_room_key){1, 1};
    x->src = (const uint8_t *)kvf_pool_page(dsrc, 0);
    x->len = 2u * PAGE;
    x->sink_pool = 7;
    x->first_page = 30;
    x->page_count = 2;
    assert_int_equal(kvf_lt_admit(f->lt, &x->op, KVF_LT_OP_CUDA_COPY, SELF), 0);
    assert_int_equal(kvf_transport_post_write(f->t, x), 0);

    struct kvf_completion c[3];
    reap(f, 3, c);
    for (unsigned i = 0; i < 3; i++)
        assert_int_equal(c[i].outcome, KVF_LT_DONE_OK);

    for (size_t i = 0; i < 2u * PAGE; i++)
        assert_int_equal(dev_byte(dsink, 4u * PAGE + i), f->src[i]);
    for (size_t i = 0; i < 3u * PAGE; i++)
        assert_int_equal(f->pool[20u * PAGE + i], (uint8_t)(0x90 + (10u * PAGE + i) * 3u));
    for (size_t i = 0; i < 2u * PAGE; i++)
        assert_int_equal(dev_byte(dsink, 30u * PAGE + i), (uint8_t)(0x90 + i * 3u));
    /* Neighbours untouched. */
    assert_int_equal(dev_byte(dsink, 4u * PAGE - 1), (uint8_t)(0x10 + (4u * PAGE - 1) * 3u));
    assert_int_equal(dev_byte(dsink, 6u * PAGE), (uint8_t)(0x10 + 6u * PAGE * 3u));
    check_canary(f, 0, 20);
    check_canary(f, 23, POOL_PAGES - 23);

    /* Through the pools: the sink got two writes, the source two reads (the
     * test's own reads above were of the sink only). */
    struct kvf_pool_io_stats ss, rs;
    kvf_pool_io_stats(dsrc, &rs);
    assert_int_equal(rs.reads, 2);
    assert_int_equal(rs.read_bytes, 5u * PAGE);
    assert_int_equal(rs.writes, 0);
    kvf_pool_io_stats(dsink, &ss);
    assert_int_equal(ss.writes, 2);
    assert_int_equal(ss.write_bytes, 4u * PAGE);

    fx_free(f);
    assert_int_equal(kvf_pool_close(dsink), 0);
    assert_int_equal(kvf_pool_close(dsrc), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_accounting_and_drain),
        cmocka_unit_test(test_wake_fd_wakes_the_poller),
        cmocka_unit_test(test_pool_through_the_ops_table),
        cmocka_unit_test(test_bad_writes_post_nothing),
        cmocka_unit_test(test_overlapping_writes_land_in_post_order),
        cmocka_unit_test(test_fence_flushes_queued_and_refuses_later_posts),
        cmocka_unit_test(test_fence_waits_for_the_copy_in_progress),
        cmocka_unit_test(test_destroy_retires_queued_writes),
        cmocka_unit_test(test_device_pools_copy_through_the_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
