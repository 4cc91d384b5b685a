/*
 * test_staging.c: staging engines and the staging buffer ring.
 *
 * The R9 tests step the fake engine by hand (no threads): a room acquires a
 * buffer, its copy is held "in flight" by the fake and its RDMA is simulated
 * (the test reports the transport side done whenever it likes); the room
 * aborts; the test then finishes the two sides in both orders and checks
 * after every step that the buffer is still owned, the ring's watermark has
 * not moved, no other room can get the slot, and the lifetime is not drained
 * until both sides are done. The host engine test pushes real bytes through
 * its worker threads and the ring (wrapping it many times) and compares them.
 * The CUDA test runs only with a device and says so when it skips.
 */
#include <errno.h>
#include <fcntl.h>
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

#ifdef KVF_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "lifetime.h"
#include "pool.h"
#include "staging.h"
#include "staging_fake.h"

#define PEER 3u

struct fixture {
    struct kvf_lt_table *t;
    struct kvf_lt *a; /* the room that aborts */
    struct kvf_lt *b; /* another room */
    struct kvf_staging *eng;
    struct kvf_staging_ring *ring;
};

static kvf_room_key key(uint64_t room, uint64_t gen)
{
    kvf_room_key k = {.room_id = room, .generation = gen};
    return k;
}

static struct fixture *fixture_new(uint32_t bufs, size_t buf_size)
{
    struct fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->t = kvf_lt_table_create();
    assert_non_null(f->t);
    assert_int_equal(kvf_lt_table_open(f->t, key(11, 1), &f->a), 0);
    assert_int_equal(kvf_lt_table_open(f->t, key(12, 1), &f->b), 0);
    f->eng = kvf_staging_fake_create();
    assert_non_null(f->eng);
    struct kvf_staging_ring_opts ro;
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = bufs;
    ro.buf_size = buf_size;
    f->ring = kvf_staging_ring_create(&ro);
    assert_non_null(f->ring);
    return f;
}

static void fixture_free(struct fixture *f)
{
    assert_int_equal(kvf_staging_destroy(f->eng), 0);
    assert_int_equal(kvf_staging_ring_destroy(f->ring), 0);
    kvf_lt_close(f->a);
    kvf_lt_close(f->b);
    assert_true(kvf_lt_table_can_teardown(f->t));
    kvf_lt_table_destroy(f->t);
    free(f);
}

/* Admits and submits a copy of `len` bytes into buffer `buf` for `lt`. */
static void submit_copy(struct fixture *f, struct kvf_lt *lt, struct kvf_stage_copy *c,
                        struct kvf_staging_buf *buf, const void *src, size_t len)
{
    memset(c, 0, sizeof(*c));
    c->dst = buf->data;
    c->src = src;
    c->len = len;
    c->buf = buf;
    assert_int_equal(kvf_lt_admit(lt, &c->op, KVF_LT_OP_CUDA_COPY, PEER), 0);
    assert_int_equal(kvf_staging_copy_async(f->eng, c), 0);
}

/* ---- the ring alone -------------------------------------------------------- */

static void test_ring_order_and_watermark(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(3, 64);
    struct kvf_staging_buf *b[4];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &b[i]), 0);
        assert_int_equal(b[i]->seq, (uint64_t)i);
        assert_int_equal(b[i]->index, (uint32_t)i);
    }
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &b[3]), -EAGAIN);
    assert_int_equal(kvf_lt_inflight_kind(f->b, KVF_LT_OP_STAGING), 3);

    /* Buffer 1 returns first: the watermark stays behind buffer 0. */
    assert_false(kvf_staging_ring_copy_done(b[1], NULL));
    assert_true(kvf_staging_ring_transport_done(b[1], NULL));
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);
    assert_int_equal(kvf_staging_ring_owned(f->ring), 2);
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &b[3]), -EAGAIN);

    /* Buffer 0 returns: the watermark passes 0 and 1, stops at 2 (owned). */
    assert_false(kvf_staging_ring_transport_done(b[0], NULL));
    assert_true(kvf_staging_ring_copy_done(b[0], NULL));
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 2);

    /* A side reported twice, or for a buffer not owned, is ignored. */
    assert_false(kvf_staging_ring_copy_done(b[0], NULL));
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 2);

    /* The ring wraps: positions 3 and 4 take slots 0 and 1. */
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &b[3]), 0);
    assert_int_equal(b[3]->seq, 3);
    assert_int_equal(b[3]->index, 0);
    assert_int_equal(kvf_staging_ring_destroy(f->ring), -EBUSY);
    kvf_staging_ring_copy_done(b[2], NULL);
    kvf_staging_ring_transport_done(b[2], NULL);
    kvf_staging_ring_copy_done(b[3], NULL);
    kvf_staging_ring_transport_done(b[3], NULL);
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 4);
    assert_int_equal(kvf_staging_ring_head(f->ring), 4);
    assert_int_equal(kvf_lt_inflight(f->b), 0);
    fixture_free(f);
}

static void test_ring_bad_opts(void **state)
{
    (void)state;
    struct kvf_staging_ring_opts ro;
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = 0;
    assert_null(kvf_staging_ring_create(&ro));
    kvf_staging_ring_opts_init(&ro);
    ro.buf_size = 0;
    assert_null(kvf_staging_ring_create(&ro));
    ro.buf_size = SIZE_MAX / 2;
    ro.buf_count = 4;
    assert_null(kvf_staging_ring_create(&ro));
    assert_null(kvf_staging_ring_create(NULL));
    assert_int_equal(kvf_staging_ring_destroy(NULL), 0);
    assert_int_equal(kvf_staging_destroy(NULL), 0);

    /* Caller-provided memory is used in place and not freed by the ring. */
    static uint8_t mem[4 * 128];
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = 4;
    ro.buf_size = 128;
    ro.mem = mem;
    struct kvf_staging_ring *r = kvf_staging_ring_create(&ro);
    assert_non_null(r);
    assert_int_equal(kvf_staging_ring_count(r), 4);
    assert_int_equal(kvf_staging_ring_buf_size(r), 128);
    assert_int_equal(kvf_staging_ring_destroy(r), 0);
}

/* ---- R9: abort with RDMA and copy in flight -------------------------------- */

enum order { COPY_FIRST, TRANSPORT_FIRST };

static void r9_abort_in_flight(enum order order)
{
    struct fixture *f = fixture_new(1, 256); /* one slot: any reuse would be visible */
    uint8_t src[256];
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (uint8_t)i;

    struct kvf_staging_buf *buf = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->a, PEER, &buf), 0);
    struct kvf_stage_copy c;
    submit_copy(f, f->a, &c, buf, src, sizeof(src));
    /* The RDMA write of the buffer is "posted" too (simulated: its transport
     * side is reported later), and the room aborts. */
    assert_false(kvf_lt_close(f->a));
    assert_int_equal(kvf_lt_state(f->a), KVF_LT_CLOSED);

    /* Late staging request for the aborted room: refused, ring unchanged. */
    struct kvf_staging_buf *late = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->a, PEER, &late), -ECANCELED);
    assert_null(late);
    assert_int_equal(kvf_staging_ring_head(f->ring), 1);
    /* Another room cannot get the slot. */
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &late), -EAGAIN);

    bool drained = true;
    struct kvf_stage_copy *done[4];
    if (order == COPY_FIRST) {
        assert_int_equal(kvf_staging_fake_complete(f->eng, &c, 0), 0);
        assert_int_equal(kvf_staging_poll(f->eng, 4, done), 1);
        assert_ptr_equal(done[0], &c);
        assert_int_equal(c.outcome, KVF_LT_DONE_OK);
        assert_false(c.drained); /* the buffer is still counted */
        assert_false(kvf_staging_ring_copy_done(c.buf, &drained));
        assert_false(drained);
    } else {
        assert_false(kvf_staging_ring_transport_done(buf, &drained));
        assert_false(drained);
    }
    /* One side done: not returned, watermark still, slot still refused. */
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);
    assert_int_equal(kvf_staging_ring_owned(f->ring), 1);
    assert_int_equal(kvf_lt_inflight_kind(f->a, KVF_LT_OP_STAGING), 1);
    assert_int_equal(kvf_lt_state(f->a), KVF_LT_CLOSED);
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &late), -EAGAIN);
    assert_false(kvf_lt_take_drained(f->a));

    if (order == COPY_FIRST) {
        assert_true(kvf_staging_ring_transport_done(buf, &drained));
        assert_true(drained);
    } else {
        /* The copy is still in flight after the RDMA finished. */
        assert_int_equal(kvf_staging_poll(f->eng, 4, done), 0);
        assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);
        assert_int_equal(kvf_staging_fake_complete(f->eng, &c, 0), 0);
        assert_int_equal(kvf_staging_poll(f->eng, 4, done), 1);
        assert_false(c.drained); /* the STAGING op keeps the lifetime open */
        assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);
        assert_true(kvf_staging_ring_copy_done(c.buf, &drained));
        assert_true(drained);
    }
    /* Both sides done: returned, watermark advanced, lifetime drained once. */
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 1);
    assert_int_equal(kvf_staging_ring_owned(f->ring), 0);
    assert_int_equal(kvf_lt_state(f->a), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(f->a));
    assert_false(kvf_lt_take_drained(f->a));
    assert_memory_equal(buf->data, src, sizeof(src));

    /* The slot now goes to the other room. */
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &late), 0);
    assert_ptr_equal(late, buf);
    kvf_staging_ring_copy_done(late, NULL);
    kvf_staging_ring_transport_done(late, NULL);
    fixture_free(f);
}

static void test_r9_copy_then_transport(void **state)
{
    (void)state;
    r9_abort_in_flight(COPY_FIRST);
}

static void test_r9_transport_then_copy(void **state)
{
    (void)state;
    r9_abort_in_flight(TRANSPORT_FIRST);
}

/* The aborted room's buffer sits before another room's in the ring: the other
 * room's return must not carry the watermark past the aborted room's slot. */
static void test_r9_watermark_never_passes_owned(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(2, 64);
    uint8_t src[64] = {1};
    struct kvf_staging_buf *ba = NULL, *bb = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->a, PEER, &ba), 0);
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &bb), 0);
    struct kvf_stage_copy ca, cb;
    submit_copy(f, f->a, &ca, ba, src, sizeof(src));
    submit_copy(f, f->b, &cb, bb, src, sizeof(src));
    assert_false(kvf_lt_close(f->a));

    /* Room b finishes everything. */
    assert_int_equal(kvf_staging_fake_complete(f->eng, &cb, 0), 0);
    struct kvf_stage_copy *done[4];
    assert_int_equal(kvf_staging_poll(f->eng, 4, done), 1);
    assert_ptr_equal(done[0], &cb);
    kvf_staging_ring_copy_done(bb, NULL);
    assert_true(kvf_staging_ring_transport_done(bb, NULL));
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);

    /* Room a's copy fails (it stopped), its RDMA is still landing. */
    assert_int_equal(kvf_staging_fake_complete(f->eng, &ca, -EIO), 0);
    assert_int_equal(kvf_staging_poll(f->eng, 4, done), 1);
    assert_int_equal(ca.outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(ca.status, -EIO);
    assert_false(kvf_staging_ring_copy_done(ba, NULL));
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 0);
    struct kvf_staging_buf *x = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->b, PEER, &x), -EAGAIN);

    bool drained = false;
    assert_true(kvf_staging_ring_transport_done(ba, &drained));
    assert_true(drained);
    assert_int_equal(kvf_staging_ring_watermark(f->ring), 2);
    fixture_free(f);
}

/* A submission that fails posted nothing: the caller cancels its admission. */
static void test_submit_failure_and_bad_args(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(1, 64);
    uint8_t src[64] = {0};
    struct kvf_staging_buf *buf = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->a, PEER, &buf), 0);
    struct kvf_stage_copy c;
    memset(&c, 0, sizeof(c));
    c.dst = buf->data;
    c.src = src;
    c.len = sizeof(src);
    assert_int_equal(kvf_lt_admit(f->a, &c.op, KVF_LT_OP_CUDA_COPY, PEER), 0);
    kvf_staging_fake_fail_next_submit(f->eng, -EIO);
    assert_int_equal(kvf_staging_copy_async(f->eng, &c), -EIO);
    assert_int_equal(kvf_staging_fake_submits(f->eng), 1);
    assert_int_equal(kvf_staging_inflight(f->eng), 0);
    assert_int_equal(kvf_staging_fake_held(f->eng), 0);
    assert_false(kvf_lt_op_cancel(&c.op));
    assert_int_equal(kvf_lt_inflight_kind(f->a, KVF_LT_OP_CUDA_COPY), 0);

    c.src = NULL;
    assert_int_equal(kvf_staging_copy_async(f->eng, &c), -EINVAL);
    assert_int_equal(kvf_staging_fake_submits(f->eng), 1); /* never reached the engine */
    assert_int_equal(kvf_staging_fake_complete(f->eng, &c, 0), -ENOENT);
    assert_string_equal(kvf_staging_name(f->eng), "fake");

    /* Nothing was posted for the buffer: both sides are reported done. */
    kvf_staging_ring_copy_done(buf, NULL);
    assert_true(kvf_staging_ring_transport_done(buf, NULL));
    fixture_free(f);
}

/* Destroy refuses while copies are in flight; after they are polled it frees
 * everything (ASan checks for leaks and use after free). */
static void test_destroy_with_copies_in_flight(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(2, 64);
    uint8_t src[64] = {9};
    struct kvf_staging_buf *buf = NULL;
    assert_int_equal(kvf_staging_ring_acquire(f->ring, f->a, PEER, &buf), 0);
    struct kvf_stage_copy c;
    submit_copy(f, f->a, &c, buf, src, sizeof(src));
    assert_int_equal(kvf_staging_destroy(f->eng), -EBUSY);
    assert_int_equal(kvf_staging_ring_destroy(f->ring), -EBUSY);
    assert_int_equal(kvf_staging_fake_complete_all(f->eng, 0), 1);
    assert_int_equal(kvf_staging_destroy(f->eng), -EBUSY); /* completed, not yet polled */
    struct kvf_stage_copy *done[2];
    assert_int_equal(kvf_staging_poll(f->eng, 2, done), 1);
    kvf_staging_ring_copy_done(buf, NULL);
    kvf_staging_ring_transport_done(buf, NULL);
    fixture_free(f);
}

/* ---- host engine ------------------------------------------------------------ */

static void poll_until(struct kvf_staging *s, unsigned want, struct kvf_stage_copy **out)
{
    unsigned got = 0;
    struct timespec nap = {0, 100000};
    for (int spins = 0; got < want; spins++) {
        assert_true(spins < 200000); /* 20 s */
        unsigned n = kvf_staging_poll(s, want - got, out + got);
        if (n == 0)
            nanosleep(&nap, NULL);
        got += n;
    }
}

#define HOST_BUFS     8u
#define HOST_BUF_SIZE (64u * 1024u + 13u) /* not a power of two */
#define HOST_CHUNKS   100u

static void test_host_engine_byte_exact(void **state)
{
    (void)state;
    struct kvf_lt_table *t = kvf_lt_table_create();
    struct kvf_lt *lt = NULL;
    assert_int_equal(kvf_lt_table_open(t, key(21, 1), &lt), 0);
    struct kvf_staging_host_opts ho;
    kvf_staging_host_opts_init(&ho);
    ho.threads = 3;
    struct kvf_staging *eng = kvf_staging_host_create(&ho);
    assert_non_null(eng);
    assert_string_equal(kvf_staging_name(eng), "host");
    struct kvf_staging_ring_opts ro;
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = HOST_BUFS;
    ro.buf_size = HOST_BUF_SIZE;
    struct kvf_staging_ring *ring = kvf_staging_ring_create(&ro);
    assert_non_null(ring);

    size_t total = (size_t)HOST_CHUNKS * HOST_BUF_SIZE;
    uint8_t *src = malloc(total);
    uint8_t *dst = calloc(1, total);
    assert_non_null(src);
    assert_non_null(dst);
    uint32_t x = 0x12345678u;
    for (size_t i = 0; i < total; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        src[i] = (uint8_t)x;
    }

    /* Gather src -> staging buffer, then scatter buffer -> dst, HOST_BUFS
     * chunks at a time, so the ring wraps many times. */
    struct kvf_stage_copy gather[HOST_BUFS], scatter[HOST_BUFS];
    struct kvf_stage_copy *done[HOST_BUFS];
    for (uint32_t base = 0; base < HOST_CHUNKS; base += HOST_BUFS) {
        uint32_t n = HOST_CHUNKS - base < HOST_BUFS ? HOST_CHUNKS - base : HOST_BUFS;
        for (uint32_t i = 0; i < n; i++) {
            struct kvf_staging_buf *b = NULL;
            assert_int_equal(kvf_staging_ring_acquire(ring, lt, PEER, &b), 0);
            memset(&gather[i], 0, sizeof(gather[i]));
            gather[i].dst = b->data;
            gather[i].src = src + (size_t)(base + i) * HOST_BUF_SIZE;
            gather[i].len = HOST_BUF_SIZE;
            gather[i].buf = b;
            assert_int_equal(kvf_lt_admit(lt, &gather[i].op, KVF_LT_OP_CUDA_COPY, PEER), 0);
            assert_int_equal(kvf_staging_copy_async(eng, &gather[i]), 0);
        }
        poll_until(eng, n, done);
        for (uint32_t i = 0; i < n; i++) {
            struct kvf_stage_copy *g = done[i];
            assert_int_equal(g->status, 0);
            uint32_t chunk = (uint32_t)(g - gather) + base;
            /* The "transport" side: the buffer is read into the destination by
             * the scatter copy (standing in for the RDMA write). */
            struct kvf_stage_copy *s = &scatter[g - gather];
            memset(s, 0, sizeof(*s));
            s->dst = dst + (size_t)chunk * HOST_BUF_SIZE;
            s->src = g->buf->data;
            s->len = HOST_BUF_SIZE;
            s->buf = g->buf;
            assert_int_equal(kvf_lt_admit(lt, &s->op, KVF_LT_OP_CUDA_COPY, PEER), 0);
            assert_int_equal(kvf_staging_copy_async(eng, s), 0);
            assert_false(kvf_staging_ring_copy_done(g->buf, NULL));
        }
        poll_until(eng, n, done);
        for (uint32_t i = 0; i < n; i++)
            assert_true(kvf_staging_ring_transport_done(done[i]->buf, NULL));
        assert_int_equal(kvf_staging_ring_watermark(ring), kvf_staging_ring_head(ring));
    }
    assert_memory_equal(dst, src, total);
    assert_int_equal(kvf_lt_inflight(lt), 0);
    assert_int_equal(kvf_staging_ring_head(ring), HOST_CHUNKS);

    free(src);
    free(dst);
    assert_int_equal(kvf_staging_ring_destroy(ring), 0);
    assert_int_equal(kvf_staging_destroy(eng), 0);
    assert_true(kvf_lt_close(lt));
    kvf_lt_table_destroy(t);
}

/* A copy whose source is a device pool (here the tests' fake one): the host
 * engine reads it with kvf_pool_read (counted), never through `src`, which
 * the test points at an unmapped address to prove it. */
static void test_host_engine_reads_device_pool(void **state)
{
    (void)state;
    enum { PG = 4096, NPG = 8 };
    char name[64];
    snprintf(name, sizeof name, "/kvf-test-staging-%d", (int)getpid());
    shm_unlink(name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, PG * NPG), 0);
    uint8_t *m = mmap(NULL, PG * NPG, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    close(fd);
    for (size_t i = 0; i < PG * NPG; i++)
        m[i] = (uint8_t)(i * 11u + 3u);
    struct kvf_pool *dev = NULL;
    assert_int_equal(kvf_pool_open_fake_device(name, 0, PG * NPG, PG, NPG, &dev, NULL), 0);
    shm_unlink(name);

    struct kvf_staging *eng = kvf_staging_host_create(NULL);
    assert_non_null(eng);
    /* An address nobody mapped: dereferencing it would crash the test. */
    void *hole = mmap(NULL, PG * NPG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(hole != MAP_FAILED);
    uint8_t dst[3 * PG];
    struct kvf_stage_copy c;
    memset(&c, 0, sizeof c);
    c.dst = dst;
    c.src = (uint8_t *)hole + 2 * PG;
    c.len = sizeof dst;
    c.src_pool = dev;
    c.src_offset = 2 * PG;
    assert_int_equal(kvf_staging_copy_async(eng, &c), 0);
    struct kvf_stage_copy *done[1];
    poll_until(eng, 1, done);
    assert_ptr_equal(done[0], &c);
    assert_int_equal(c.status, 0);
    assert_memory_equal(dst, m + 2 * PG, sizeof dst);
    /* Past the pool's end: the pool refuses, the copy fails (ERROR). */
    memset(&c, 0, sizeof c);
    c.dst = dst;
    c.src = hole;
    c.len = sizeof dst;
    c.src_pool = dev;
    c.src_offset = 6 * PG;
    assert_int_equal(kvf_staging_copy_async(eng, &c), 0);
    poll_until(eng, 1, done);
    assert_int_equal(c.status, -ERANGE);
    assert_int_equal(c.outcome, KVF_LT_DONE_ERROR);
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(dev, &st);
    assert_int_equal(st.reads, 1);
    assert_int_equal(st.read_bytes, sizeof dst);

    assert_int_equal(kvf_staging_destroy(eng), 0);
    munmap(hole, PG * NPG);
    munmap(m, PG * NPG);
    assert_int_equal(kvf_pool_close(dev), 0);
}

/* Destroying the host engine with copies still running is refused; once they
 * are polled the workers are joined and nothing leaks. */
static void test_host_destroy_in_flight(void **state)
{
    (void)state;
    struct kvf_staging *eng = kvf_staging_host_create(NULL);
    assert_non_null(eng);
    enum { N = 16, LEN = 1 << 20 };
    uint8_t *a = malloc((size_t)N * LEN);
    uint8_t *b = malloc((size_t)N * LEN);
    assert_non_null(a);
    assert_non_null(b);
    memset(a, 0x3C, (size_t)N * LEN);
    struct kvf_stage_copy c[N];
    for (int i = 0; i < N; i++) {
        memset(&c[i], 0, sizeof(c[i]));
        c[i].dst = b + (size_t)i * LEN;
        c[i].src = a + (size_t)i * LEN;
        c[i].len = LEN;
        assert_int_equal(kvf_staging_copy_async(eng, &c[i]), 0); /* op.lt NULL: not accounted */
    }
    assert_int_equal(kvf_staging_destroy(eng), -EBUSY);
    struct kvf_stage_copy *done[N];
    poll_until(eng, N, done);
    assert_int_equal(kvf_staging_inflight(eng), 0);
    assert_memory_equal(a, b, (size_t)N * LEN);
    assert_int_equal(kvf_staging_destroy(eng), 0);
    free(a);
    free(b);

    struct kvf_staging_host_opts ho;
    kvf_staging_host_opts_init(&ho);
    ho.threads = 0;
    assert_null(kvf_staging_host_create(&ho));
}

/* ---- CUDA engine ------------------------------------------------------------ */

#ifndef KVF_HAVE_CUDA
static void test_cuda_engine(void **state)
{
    (void)state;
    assert_null(kvf_staging_cuda_create(NULL));
    void *p = NULL;
    assert_int_equal(kvf_staging_cuda_host_alloc(4096, &p), -ENOTSUP);
    assert_null(p);
    printf("  built without CUDA: the CUDA engine is refused\n");
}
#else
static void test_cuda_engine(void **state)
{
    (void)state;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("  SKIPPED: CUDA staging engine test: no CUDA device on this host\n");
        skip();
    }
    enum { BUFS = 4, LEN = 1 << 20 };
    struct kvf_lt_table *t = kvf_lt_table_create();
    struct kvf_lt *lt = NULL;
    assert_int_equal(kvf_lt_table_open(t, key(31, 1), &lt), 0);
    struct kvf_staging *eng = kvf_staging_cuda_create(NULL);
    assert_non_null(eng);
    assert_string_equal(kvf_staging_name(eng), "cuda");
    void *pinned = NULL;
    assert_int_equal(kvf_staging_cuda_host_alloc((size_t)BUFS * LEN, &pinned), 0);
    struct kvf_staging_ring_opts ro;
    kvf_staging_ring_opts_init(&ro);
    ro.buf_count = BUFS;
    ro.buf_size = LEN;
    ro.mem = pinned;
    struct kvf_staging_ring *ring = kvf_staging_ring_create(&ro);
    assert_non_null(ring);
    uint8_t *dev = NULL;
    assert_int_equal(cudaMalloc((void **)&dev, (size_t)BUFS * LEN), cudaSuccess);
    uint8_t *src = malloc((size_t)BUFS * LEN);
    uint8_t *back = calloc(1, (size_t)BUFS * LEN);
    for (size_t i = 0; i < (size_t)BUFS * LEN; i++)
        src[i] = (uint8_t)(i * 13u + 1u);

    /* Pinned buffer -> device ("scatter"), then device -> pinned buffer. */
    struct kvf_staging_buf *b[BUFS];
    struct kvf_stage_copy c[BUFS];
    struct kvf_stage_copy *done[BUFS];
    for (int i = 0; i < BUFS; i++) {
        assert_int_equal(kvf_staging_ring_acquire(ring, lt, PEER, &b[i]), 0);
        memcpy(b[i]->data, src + (size_t)i * LEN, LEN);
        memset(&c[i], 0, sizeof(c[i]));
        c[i].dst = dev + (size_t)i * LEN;
        c[i].src = b[i]->data;
        c[i].len = LEN;
        c[i].buf = b[i];
        assert_int_equal(kvf_lt_admit(lt, &c[i].op, KVF_LT_OP_CUDA_COPY, PEER), 0);
        assert_int_equal(kvf_staging_copy_async(eng, &c[i]), 0);
    }
    poll_until(eng, BUFS, done);
    for (int i = 0; i < BUFS; i++) {
        assert_int_equal(done[i]->status, 0);
        memset(done[i]->buf->data, 0, LEN);
        struct kvf_stage_copy *r = done[i];
        struct kvf_staging_buf *buf = r->buf;
        size_t off = (size_t)(buf->index) * LEN;
        memset(r, 0, sizeof(*r));
        r->dst = buf->data;
        r->src = dev + off;
        r->len = LEN;
        r->buf = buf;
        assert_int_equal(kvf_lt_admit(lt, &r->op, KVF_LT_OP_CUDA_COPY, PEER), 0);
        assert_int_equal(kvf_staging_copy_async(eng, r), 0);
    }
    poll_until(eng, BUFS, done);
    for (int i = 0; i < BUFS; i++) {
        struct kvf_staging_buf *buf = done[i]->buf;
        assert_int_equal(done[i]->status, 0);
        memcpy(back + (size_t)buf->index * LEN, buf->data, LEN);
        kvf_staging_ring_copy_done(buf, NULL);
        assert_true(kvf_staging_ring_transport_done(buf, NULL));
    }
    assert_memory_equal(back, src, (size_t)BUFS * LEN);
    assert_int_equal(kvf_lt_inflight(lt), 0);

    free(src);
    free(back);
    cudaFree(dev);
    assert_int_equal(kvf_staging_ring_destroy(ring), 0);
    kvf_staging_cuda_host_free(pinned);
    assert_int_equal(kvf_staging_destroy(eng), 0);
    kvf_lt_close(lt);
    kvf_lt_table_destroy(t);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ring_order_and_watermark),
        cmocka_unit_test(test_ring_bad_opts),
        cmocka_unit_test(test_r9_copy_then_transport),
        cmocka_unit_test(test_r9_transport_then_copy),
        cmocka_unit_test(test_r9_watermark_never_passes_owned),
        cmocka_unit_test(test_submit_failure_and_bad_args),
        cmocka_unit_test(test_destroy_with_copies_in_flight),
        cmocka_unit_test(test_host_engine_byte_exact),
        cmocka_unit_test(test_host_destroy_in_flight),
        cmocka_unit_test(test_host_engine_reads_device_pool),
        cmocka_unit_test(test_cuda_engine),
    };
    return cmocka_run_group_tests_name("staging", tests, NULL, NULL);
}
