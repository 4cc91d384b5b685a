/*
 * test_tcp.c: the TCP transport over real loopback sockets, two transports
 * (node A, the source, and node B, the sink) in one process.
 *
 * Each node has a lifetime table with one room open, and a pool of malloc'd
 * pages filled with a canary pattern. B's sink-lease check admits a frame
 * only for its room and for pages inside a lease range the test sets, and can
 * be made to wait on a gate (to hold a frame "in the check" while the test
 * fences). The tests check bytes in the pool, completion outcomes, the
 * transport's counters and the lifetimes' in-flight counts; every assertion
 * runs on the main thread.
 */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <dirent.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <cmocka.h>

#include "lifetime.h"
#include "pool.h"
#include "tcp.h"
#include "transport.h"

#define PAGE       (64u * 1024u)
#define POOL_PAGES 256u
#define POOL_BYTES ((size_t)PAGE * POOL_PAGES)
#define POOL_ID    7u
#define NODE_A     101u
#define NODE_B     202u
#define A_PEER_B   3u /* A's index for B */
#define B_PEER_A   5u /* B's index for A */
#define WAIT_MS    10000

struct node {
    struct kvf_transport *t;
    struct kvf_lt_table *tab;
    struct kvf_lt *lt; /* the room's lifetime on this node */
    uint8_t *pool;

    pthread_mutex_t lock; /* lease range */
    uint32_t lease_first;
    uint32_t lease_count;

    pthread_mutex_t gate_lock;
    pthread_cond_t gate_cond;
    bool gate_closed;
    atomic_int in_gate;

    atomic_uint checks;
    atomic_int eagain_left; /* answer -EAGAIN this many times ("room not known yet") */
    atomic_uint frames_ok;
    atomic_uint frames_cut;
    atomic_uint drained_events;
    /* What on_frame said about the frames that landed: the sums of their
     * first pages, page counts and bytes, and how many named another room or
     * pool, or bytes that do not fit their pages. */
    atomic_uint_fast64_t landed_first_sum;
    atomic_uint_fast64_t landed_pages_sum;
    atomic_uint_fast64_t landed_bytes_sum;
    atomic_uint bad_coords;
    /* on_idle: frames and bytes since the last call, the largest batch
     * seen, and the calls. */
    atomic_uint since_idle;
    atomic_uint_fast64_t bytes_since_idle;
    atomic_uint max_batch;
    atomic_uint_fast64_t max_batch_bytes;
    atomic_uint idle_calls;
};

struct pair {
    struct node a;
    struct node b;
};

static const kvf_room_key ROOM = {.room_id = 42, .generation = 1};
static const kvf_room_key OTHER_ROOM = {.room_id = 43, .generation = 1};

/* ---- helpers ------------------------------------------------------------------- */

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {.tv_sec = ms / 1000u, .tv_nsec = (long)(ms % 1000u) * 1000000L};
    nanosleep(&ts, NULL);
}

static uint8_t canary_byte(size_t i)
{
    return (uint8_t)(i * 7u + 0x5au);
}

static void fill_canary(uint8_t *p, size_t len)
{
    for (size_t i = 0; i < len; i++)
        p[i] = canary_byte(i);
}

static bool canary_intact(const uint8_t *p, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        if (p[i] != canary_byte(i))
            return false;
    }
    return true;
}

/* A pattern that differs for every seed and every 8 bytes. */
static void fill_pattern(uint8_t *p, size_t len, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < len; i++) {
        if (i % 8 == 0) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        p[i] = (uint8_t)(x >> (8 * (i % 8)));
    }
}

static int check_cb(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                    uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    struct node *n = ctx;
    atomic_fetch_add(&n->checks, 1);
    if (atomic_load(&n->eagain_left) > 0 && atomic_fetch_sub(&n->eagain_left, 1) > 0)
        return -EAGAIN;
    pthread_mutex_lock(&n->gate_lock);
    if (n->gate_closed) {
        atomic_fetch_add(&n->in_gate, 1);
        while (n->gate_closed)
            pthread_cond_wait(&n->gate_cond, &n->gate_lock);
        atomic_fetch_sub(&n->in_gate, 1);
    }
    pthread_mutex_unlock(&n->gate_lock);

    int rc = -EPERM;
    pthread_mutex_lock(&n->lock);
    if (kvf_room_key_eq(room, ROOM) && pool_id == POOL_ID && first_page >= n->lease_first &&
        (uint64_t)first_page + page_count <= (uint64_t)n->lease_first + n->lease_count)
        rc = kvf_lt_admit(n->lt, op, KVF_LT_OP_TCP_FRAME, peer);
    pthread_mutex_unlock(&n->lock);
    return rc;
}

static void frame_cb(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                     uint32_t first_page, uint32_t page_count, uint64_t bytes, int status,
                     bool drained)
{
    struct node *n = ctx;
    (void)peer;
    if (!kvf_room_key_eq(room, ROOM) || pool_id != POOL_ID || page_count == 0 ||
        (uint64_t)first_page + page_count > POOL_PAGES ||
        (status == 0 &&
         (bytes <= (uint64_t)(page_count - 1) * PAGE || bytes > (uint64_t)page_count * PAGE)))
        atomic_fetch_add(&n->bad_coords, 1);
    if (status == 0) {
        atomic_fetch_add(&n->landed_first_sum, first_page);
        atomic_fetch_add(&n->landed_pages_sum, page_count);
        atomic_fetch_add(&n->landed_bytes_sum, bytes);
    }
    atomic_fetch_add(status == 0 ? &n->frames_ok : &n->frames_cut, 1);
    if (drained)
        atomic_fetch_add(&n->drained_events, 1);
    atomic_fetch_add(&n->since_idle, 1);
    atomic_fetch_add(&n->bytes_since_idle, status == 0 ? bytes : 0);
}

static void idle_cb(void *ctx)
{
    struct node *n = ctx;
    unsigned f = atomic_exchange(&n->since_idle, 0);
    uint64_t b = atomic_exchange(&n->bytes_since_idle, 0);
    if (f > atomic_load(&n->max_batch))
        atomic_store(&n->max_batch, f);
    if (b > atomic_load(&n->max_batch_bytes))
        atomic_store(&n->max_batch_bytes, b);
    atomic_fetch_add(&n->idle_calls, 1);
}

/* node_init with the transport's connect deadline (0: its default). */
static void node_init_connect(struct node *n, uint64_t node_id, uint32_t connect_timeout_ms)
{
    memset(n, 0, sizeof(*n));
    pthread_mutex_init(&n->lock, NULL);
    pthread_mutex_init(&n->gate_lock, NULL);
    pthread_cond_init(&n->gate_cond, NULL);
    n->lease_first = 0;
    n->lease_count = POOL_PAGES;
    n->pool = malloc(POOL_BYTES);
    assert_non_null(n->pool);
    fill_canary(n->pool, POOL_BYTES);
    n->tab = kvf_lt_table_create();
    assert_non_null(n->tab);
    assert_int_equal(kvf_lt_table_open(n->tab, ROOM, &n->lt), 0);

    struct kvf_transport_tcp_opts o;
    kvf_transport_tcp_opts_init(&o);
    o.node_id = node_id;
    o.check = check_cb;
    o.on_frame = frame_cb;
    o.on_idle = idle_cb;
    o.ctx = n;
    if (connect_timeout_ms)
        o.connect_timeout_ms = connect_timeout_ms;
    n->t = kvf_transport_tcp_create(&o);
    assert_non_null(n->t);
    assert_string_equal(kvf_transport_name(n->t), "tcp");
    assert_int_not_equal(kvf_transport_tcp_port(n->t), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(n->t, POOL_ID, n->pool, PAGE, POOL_PAGES), 0);
}

static void node_init(struct node *n, uint64_t node_id)
{
    node_init_connect(n, node_id, 0);
}

static void node_fini(struct node *n)
{
    kvf_transport_destroy(n->t);
    /* Every frame event was followed by on_idle, in batches within bounds. */
    assert_int_equal(atomic_load(&n->since_idle), 0);
    assert_true(atomic_load(&n->max_batch) <= KVF_TCP_IDLE_FRAMES);
    (void)kvf_lt_close(n->lt);
    assert_int_equal(kvf_lt_inflight(n->lt), 0);
    assert_true(kvf_lt_table_can_teardown(n->tab));
    kvf_lt_table_destroy(n->tab);
    free(n->pool);
    pthread_cond_destroy(&n->gate_cond);
    pthread_mutex_destroy(&n->gate_lock);
    pthread_mutex_destroy(&n->lock);
}

/* The pair's secret (the node derives it from the two peer keys). */
static const uint8_t SECRET[KVF_TCP_SECRET_SIZE] = "the secret of the pair A and B..";

static void pair_introduce(struct pair *p, const uint8_t *a_secret, const uint8_t *b_secret)
{
    assert_int_equal(kvf_transport_tcp_add_peer(p->a.t, A_PEER_B, NODE_B), 0);
    assert_int_equal(kvf_transport_tcp_add_peer(p->b.t, B_PEER_A, NODE_A), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->a.t, A_PEER_B, a_secret), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->b.t, B_PEER_A, b_secret), 0);
}

static int pair_setup(void **state)
{
    struct pair *p = calloc(1, sizeof(*p));
    assert_non_null(p);
    node_init(&p->a, NODE_A);
    node_init(&p->b, NODE_B);
    pair_introduce(p, SECRET, SECRET);
    assert_int_equal(
        kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", kvf_transport_tcp_port(p->b.t)),
        0);
    assert_int_equal(
        kvf_transport_tcp_connect(p->b.t, B_PEER_A, "127.0.0.1", kvf_transport_tcp_port(p->a.t)),
        0);
    *state = p;
    return 0;
}

static int pair_teardown(void **state)
{
    struct pair *p = *state;
    node_fini(&p->a);
    node_fini(&p->b);
    free(p);
    return 0;
}

/* Admits and posts one frame from A to B; returns post_write's answer (the
 * admission is undone when it fails). */
static int post(struct node *a, struct kvf_xfer *x, kvf_room_key room, const void *src,
                uint64_t len, uint32_t first_page, uint32_t page_count, uint64_t offset)
{
    struct kvf_lt *lt = kvf_room_key_eq(room, ROOM) ? a->lt : kvf_lt_table_find(a->tab, room);
    memset(x, 0, sizeof(*x));
    int rc = kvf_lt_admit(lt, &x->op, KVF_LT_OP_TCP_FRAME, A_PEER_B);
    if (rc != 0)
        return rc;
    x->peer = A_PEER_B;
    x->room = room;
    x->src = src;
    x->len = len;
    x->sink_pool = POOL_ID;
    x->first_page = first_page;
    x->page_count = page_count;
    x->offset = offset;
    rc = kvf_transport_post_write(a->t, x);
    if (rc != 0)
        (void)kvf_lt_op_cancel(&x->op);
    return rc;
}

struct reaped {
    unsigned n;
    unsigned by_outcome[4];
    unsigned drained;
};

/* Polls `t` until `want` completions came back (fails the test after
 * WAIT_MS). */
static void reap(struct kvf_transport *t, unsigned want, struct reaped *r)
{
    struct kvf_completion c[16];
    uint64_t deadline = now_ms() + WAIT_MS;
    while (r->n < want) {
        int n = kvf_transport_poll(t, 16, c);
        assert_true(n >= 0);
        for (int i = 0; i < n; i++) {
            assert_true(c[i].outcome >= KVF_LT_DONE_OK && c[i].outcome <= KVF_LT_DONE_FLUSHED);
            assert_true((c[i].outcome == KVF_LT_DONE_OK) == (c[i].status == 0));
            r->by_outcome[c[i].outcome]++;
            r->drained += c[i].drained;
        }
        r->n += (unsigned)n;
        if (n == 0) {
            assert_true(now_ms() < deadline);
            sleep_ms(1);
        }
    }
}

static void wait_count(atomic_uint *v, unsigned want)
{
    uint64_t deadline = now_ms() + WAIT_MS;
    while (atomic_load(v) < want) {
        assert_true(now_ms() < deadline);
        sleep_ms(1);
    }
}

static void wait_stat(struct kvf_transport *t, size_t field_off, uint64_t want)
{
    uint64_t deadline = now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_transport_tcp_stats s;
        kvf_transport_tcp_stats(t, &s);
        uint64_t v;
        memcpy(&v, (const char *)&s + field_off, sizeof(v));
        if (v >= want)
            return;
        assert_true(now_ms() < deadline);
        sleep_ms(1);
    }
}

#define WAIT_STAT(t, field, want) \
    wait_stat((t), offsetof(struct kvf_transport_tcp_stats, field), (want))

/* ---- tests ----------------------------------------------------------------------- */

/* Many frames of 64 KiB and 1 MiB, plus an unaligned one, land byte-exact in
 * the named pages and nowhere else; every op completes OK and is retired. */
static void test_transfer_byte_exact(void **state)
{
    struct pair *p = *state;
    enum { ROUNDS = 4, SMALL = 64, BIG = 16 };
    uint8_t *expect = malloc(POOL_BYTES);
    uint8_t *src = malloc(POOL_BYTES + 3 * (size_t)PAGE);
    struct kvf_xfer *x = calloc(SMALL + 1, sizeof(*x));
    assert_non_null(expect);
    assert_non_null(src);
    assert_non_null(x);
    fill_canary(expect, POOL_BYTES);
    unsigned frames = 0;
    uint64_t first_sum = 0, pages_sum = 0, bytes_sum = 0;

    for (unsigned round = 0; round < ROUNDS; round++) {
        unsigned posted = 0;
        if (round % 2 == 0) {
            /* 64 KiB frames into every fourth page (and the pages between keep
             * what they had). */
            for (unsigned i = 0; i < SMALL; i++) {
                uint32_t page = i * 4 + round % 4;
                uint8_t *s = src + (size_t)i * PAGE;
                fill_pattern(s, PAGE, round * 1000u + i);
                memcpy(expect + (size_t)page * PAGE, s, PAGE);
                assert_int_equal(post(&p->a, &x[posted++], ROOM, s, PAGE, page, 1, 0), 0);
            }
        } else {
            /* 1 MiB frames over 16 pages each. */
            for (unsigned i = 0; i < BIG; i++) {
                uint32_t page = i * 16;
                uint8_t *s = src + (size_t)page * PAGE;
                fill_pattern(s, 16 * PAGE, round * 1000u + i);
                memcpy(expect + (size_t)page * PAGE, s, 16 * PAGE);
                assert_int_equal(post(&p->a, &x[posted++], ROOM, s, 16 * PAGE, page, 16, 0), 0);
            }
        }
        /* One frame that starts inside a page and ends inside the next two. */
        uint64_t off = 100, len = 2 * (uint64_t)PAGE + 4000;
        uint8_t *s = src + POOL_BYTES; /* its own source: the others are in flight */
        fill_pattern(s, len, round * 1000u + 999u);
        memcpy(expect + (size_t)10 * PAGE + off, s, len);
        assert_int_equal(post(&p->a, &x[posted++], ROOM, s, len, 10, 3, off), 0);

        struct reaped r = {0};
        reap(p->a.t, posted, &r);
        assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], posted);
        assert_int_equal(r.drained, 0);
        for (unsigned i = 0; i < posted; i++) {
            first_sum += x[i].first_page;
            pages_sum += x[i].page_count;
            bytes_sum += x[i].len;
        }
        frames += posted;
        wait_count(&p->b.frames_ok, frames);
        assert_memory_equal(p->b.pool, expect, POOL_BYTES);
    }

    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->a.t, &s);
    assert_int_equal(s.frames_sent, frames);
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.frames_received, frames);
    assert_int_equal(s.frames_rejected + s.frames_malformed + s.frames_cut, 0);
    assert_int_equal(s.conns_accepted, 1);
    assert_int_equal(atomic_load(&p->b.checks), frames);
    /* on_frame named each frame's own room, pool, pages and bytes. */
    assert_int_equal(atomic_load(&p->b.bad_coords), 0);
    assert_int_equal(atomic_load(&p->b.landed_first_sum), first_sum);
    assert_int_equal(atomic_load(&p->b.landed_pages_sum), pages_sum);
    assert_int_equal(atomic_load(&p->b.landed_bytes_sum), bytes_sum);

    /* Draining the sink's lifetime: closed with nothing in flight. */
    assert_true(kvf_lt_close(p->b.lt));
    assert_true(kvf_lt_take_drained(p->b.lt));
    free(x);
    free(src);
    free(expect);
}

/* A burst of frame events is followed by on_idle once the receiver finds its
 * socket empty, with no further traffic; no batch passes the bounds. */
static void test_frame_events_end_with_idle(void **state)
{
    struct pair *p = *state;
    enum { N = 100 };
    uint8_t *src = malloc((size_t)N * PAGE);
    struct kvf_xfer *x = calloc(N, sizeof(*x));
    assert_non_null(src);
    assert_non_null(x);
    fill_pattern(src, (size_t)N * PAGE, 7);
    for (unsigned i = 0; i < N; i++)
        assert_int_equal(post(&p->a, &x[i], ROOM, src + (size_t)i * PAGE, PAGE, i, 1, 0), 0);
    struct reaped r = {0};
    reap(p->a.t, N, &r);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], N);
    wait_count(&p->b.frames_ok, N);

    /* Nothing more is sent: the last batch is handed on by itself. */
    uint64_t deadline = now_ms() + WAIT_MS;
    while (atomic_load(&p->b.since_idle) != 0) {
        assert_true(now_ms() < deadline);
        sleep_ms(1);
    }
    assert_true(atomic_load(&p->b.idle_calls) >=
                (N + KVF_TCP_IDLE_FRAMES - 1) / KVF_TCP_IDLE_FRAMES);
    assert_true(atomic_load(&p->b.max_batch) <= KVF_TCP_IDLE_FRAMES);
    assert_true(atomic_load(&p->b.max_batch_bytes) <= KVF_TCP_IDLE_BYTES);
    assert_memory_equal(p->b.pool, src, (size_t)N * PAGE);
    free(x);
    free(src);
}

/* Frames for a room the sink does not admit, or for pages outside its lease,
 * land nowhere and are counted; the connection stays usable. */
static void test_refused_frames_land_nowhere(void **state)
{
    struct pair *p = *state;
    struct kvf_lt *other;
    assert_int_equal(kvf_lt_table_open(p->a.tab, OTHER_ROOM, &other), 0);
    pthread_mutex_lock(&p->b.lock);
    p->b.lease_first = 0;
    p->b.lease_count = 8;
    pthread_mutex_unlock(&p->b.lock);

    uint8_t *src = malloc(4 * PAGE);
    assert_non_null(src);
    fill_pattern(src, 4 * PAGE, 1);
    struct kvf_xfer x[4];
    assert_int_equal(post(&p->a, &x[0], OTHER_ROOM, src, PAGE, 0, 1, 0), 0); /* wrong room */
    assert_int_equal(post(&p->a, &x[1], ROOM, src, 2 * PAGE, 7, 2, 0), 0);   /* past lease */
    assert_int_equal(post(&p->a, &x[2], ROOM, src, 4 * PAGE, 100, 4, 0), 0); /* outside lease */
    struct reaped r = {0};
    reap(p->a.t, 3, &r);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], 3);
    WAIT_STAT(p->b.t, frames_rejected, 3);
    assert_true(canary_intact(p->b.pool, POOL_BYTES));
    assert_int_equal(atomic_load(&p->b.frames_ok), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);

    /* The same connection still carries a good frame. */
    assert_int_equal(post(&p->a, &x[3], ROOM, src, PAGE, 3, 1, 0), 0);
    reap(p->a.t, 4, &r);
    wait_count(&p->b.frames_ok, 1);
    assert_memory_equal(p->b.pool + 3 * (size_t)PAGE, src, PAGE);
    assert_true(canary_intact(p->b.pool, 3 * (size_t)PAGE));
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.frames_rejected, 3);
    assert_int_equal(s.frames_malformed, 0);
    assert_int_equal(s.frames_received, 1);
    assert_int_equal(kvf_lt_inflight(other), 0);
    (void)kvf_lt_close(other);
    free(src);
}

/* The source may learn a room before the sink does: a check that answers
 * -EAGAIN ("not known here yet") is asked again until it admits the frame,
 * which then lands; one that keeps answering -EAGAIN past check_wait_ms gets
 * the frame refused, and nothing lands. */
static void test_unknown_room_is_waited_for_then_refused(void **state)
{
    struct pair *p = *state;
    pthread_mutex_lock(&p->b.lock);
    p->b.lease_first = 0;
    p->b.lease_count = 8;
    pthread_mutex_unlock(&p->b.lock);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 5);
    struct kvf_xfer x[2];
    struct reaped r = {0};

    atomic_store(&p->b.eagain_left, 30);
    assert_int_equal(post(&p->a, &x[0], ROOM, src, PAGE, 2, 1, 0), 0);
    reap(p->a.t, 1, &r);
    wait_count(&p->b.frames_ok, 1);
    assert_true(atomic_load(&p->b.checks) >= 31);
    assert_memory_equal(p->b.pool + 2 * (size_t)PAGE, src, PAGE);

    atomic_store(&p->b.eagain_left, 1000000); /* never known: refused after ~2 s */
    assert_int_equal(post(&p->a, &x[1], ROOM, src, PAGE, 4, 1, 0), 0);
    reap(p->a.t, 2, &r);
    WAIT_STAT(p->b.t, frames_rejected, 1);
    assert_true(canary_intact(p->b.pool + 4 * (size_t)PAGE, PAGE));
    assert_int_equal(atomic_load(&p->b.frames_ok), 1);
    atomic_store(&p->b.eagain_left, 0);
    free(src);
}

/* A header whose pages do not fit the pool, or whose length does not match
 * its pages, closes the connection before the check runs or any byte lands;
 * later writes on that connection fail. */
static void check_malformed(struct pair *p, uint32_t first_page, uint32_t page_count,
                            uint64_t offset, uint64_t len)
{
    uint8_t *src = malloc(len);
    assert_non_null(src);
    fill_pattern(src, len, 7);
    struct kvf_xfer x[2];
    assert_int_equal(post(&p->a, &x[0], ROOM, src, len, first_page, page_count, offset), 0);
    struct reaped r = {0};
    reap(p->a.t, 1, &r); /* OK: it was written; the receiver refuses it */
    WAIT_STAT(p->b.t, frames_malformed, 1);
    sleep_ms(50); /* let the close reach A */

    int rc = post(&p->a, &x[1], ROOM, src, PAGE < len ? PAGE : len, 0, 1, 0);
    if (rc == 0) {
        /* Posted before the sender saw the close: the write itself fails. */
        reap(p->a.t, 2, &r);
        assert_int_equal(r.by_outcome[KVF_LT_DONE_ERROR], 1);
    } else {
        assert_int_equal(rc, -EIO);
    }
    assert_int_equal(atomic_load(&p->b.checks), 0);
    assert_true(canary_intact(p->b.pool, POOL_BYTES));
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.frames_malformed, 1);
    assert_int_equal(s.frames_received, 0);
    free(src);
}

static void test_malformed_range_past_pool(void **state)
{
    check_malformed(*state, POOL_PAGES - 1, 2, 0, 2 * (uint64_t)PAGE);
}

static void test_malformed_length_mismatch(void **state)
{
    /* Three pages named, but the bytes fit in one. */
    check_malformed(*state, 0, 3, 0, PAGE);
}

static void test_malformed_offset_past_page(void **state)
{
    check_malformed(*state, 4, 1, PAGE, 16);
}

/* A connection whose hello names a node this transport does not know is
 * refused; so is a hello addressed to another node. */
static void test_unknown_node_refused(void **state)
{
    struct pair *p = *state;
    for (int i = 0; i < 2; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        assert_true(fd >= 0);
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons(kvf_transport_tcp_port(p->b.t))};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
        uint8_t hello[KVF_TCP_HELLO_SIZE] = {0}; /* a zero nonce */
        uint32_t magic = KVF_TCP_MAGIC_HELLO;    /* the test runs little-endian */
        uint16_t version = KVF_TCP_VERSION;
        uint64_t from = i == 0 ? 999 : NODE_A, to = i == 0 ? NODE_B : 998;
        memcpy(hello, &magic, 4);
        memcpy(hello + 4, &version, 2);
        memcpy(hello + 8, &from, 8);
        memcpy(hello + 16, &to, 8);
        assert_int_equal(send(fd, hello, sizeof(hello), MSG_NOSIGNAL), (ssize_t)sizeof(hello));
        WAIT_STAT(p->b.t, conns_refused, (uint64_t)i + 1);
        WAIT_STAT(p->b.t, conns_unknown, 1);
        char c;
        assert_true(recv(fd, &c, 1, 0) <= 0); /* closed by B */
        close(fd);
    }
}

/* The threads of this process (/proc/self/task). */
static unsigned thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    unsigned n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Issue 13: thousands of connections that never finish a hello start no
 * thread each, and the data port drops every one of them at the hello
 * deadline. As many as the descriptor limit allows, up to 6,000 (each takes
 * two descriptors in this process). */
static void test_idle_connections_make_no_threads(void **state)
{
    struct pair *p = *state;
    struct rlimit rl;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max < 20000 ? rl.rlim_max : 20000;
        (void)setrlimit(RLIMIT_NOFILE, &rl);
        assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    }
    /* A's own connection finishes its handshake first: a flood evicts the
     * oldest pending handshake, and a peer's would be one (it reconnects). */
    WAIT_STAT(p->b.t, conns_accepted, 1);
    unsigned n = 6000;
    if ((rl.rlim_cur - 256) / 2 < n)
        n = (unsigned)((rl.rlim_cur - 256) / 2);
    int *fds = calloc(n, sizeof(*fds));
    assert_non_null(fds);
    unsigned before = thread_count();
    unsigned peak = before;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(kvf_transport_tcp_port(p->b.t))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    uint64_t t0 = now_ms();
    for (unsigned i = 0; i < n; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        assert_true(fds[i] >= 0);
        assert_int_equal(connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)), 0);
        if (i % 500 == 0) {
            unsigned c = thread_count();
            peak = c > peak ? c : peak;
        }
    }
    sleep_ms(200);
    unsigned c = thread_count();
    peak = c > peak ? c : peak;
    print_message("%u idle connections in %llu ms: %u threads before, %u at the peak\n", n,
                  (unsigned long long)(now_ms() - t0), before, peak);
    if (peak > before + 4)
        fail_msg("%u idle connections made %u threads", n, peak - before);

    /* Every one is closed by the data port within the deadline (plus slack). */
    unsigned closed = 0;
    uint64_t end = now_ms() + 10000;
    while (closed < n && now_ms() < end) {
        for (unsigned i = 0; i < n; i++) {
            if (fds[i] < 0)
                continue;
            struct pollfd pf = {.fd = fds[i], .events = POLLIN};
            if (poll(&pf, 1, 0) == 1) {
                char b;
                if (recv(fds[i], &b, 1, MSG_DONTWAIT) <= 0) {
                    close(fds[i]);
                    fds[i] = -1;
                    closed++;
                }
            }
        }
        sleep_ms(20);
    }
    for (unsigned i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
    if (closed < n)
        fail_msg("%u of %u idle connections still open 10 s after connecting", n - closed, n);
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_true(s.conns_refused >= n);
    /* Each one was dropped, evicted for a newer one (max_pending 64) or at
     * the hello deadline; which of the two for the last ones depends on how
     * the accepts were batched. */
    if (s.conns_over_cap < n - 64 || s.conns_over_cap + s.conns_timed_out < n)
        fail_msg("%u idle connections: refused %llu, over cap %llu, timed out %llu, bad hello "
                 "%llu, unknown %llu",
                 n, (unsigned long long)s.conns_refused, (unsigned long long)s.conns_over_cap,
                 (unsigned long long)s.conns_timed_out, (unsigned long long)s.conns_bad_hello,
                 (unsigned long long)s.conns_unknown);
    assert_int_equal(s.conns_accepted, 1); /* A's own */
}

/* A connection that knows both ids but not the pair's secret: A and B hold
 * different secrets. B's challenge does not prove A's, so A's sender never
 * writes a frame (its frames complete ERROR); a third party that sends a
 * proof it made up, then a frame, is refused at the proof; nothing lands. */
static void test_wrong_secret_refused_nothing_lands(void **state)
{
    (void)state;
    struct pair *p = calloc(1, sizeof(*p));
    assert_non_null(p);
    node_init(&p->a, NODE_A);
    node_init(&p->b, NODE_B);
    uint8_t other[KVF_TCP_SECRET_SIZE];
    memcpy(other, SECRET, sizeof(other));
    other[0] ^= 1;
    pair_introduce(p, other, SECRET);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->b.t, B_PEER_A, other), -EEXIST);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->b.t, B_PEER_A, SECRET), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->b.t, 9, SECRET), -ENOENT);
    assert_int_equal(
        kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", kvf_transport_tcp_port(p->b.t)),
        0);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 7);
    struct kvf_xfer x;
    /* The handshake runs on its own: it may fail before the post (then the
     * post is refused) or after it (then the frame completes ERROR). Either
     * way no byte is written. */
    int prc = post(&p->a, &x, ROOM, src, PAGE, 3, 1, 0);
    if (prc == 0) {
        struct reaped r = {0};
        reap(p->a.t, 1, &r);
        assert_int_equal(r.by_outcome[KVF_LT_DONE_ERROR], 1);
    } else {
        assert_int_equal(prc, -EIO);
    }
    WAIT_STAT(p->a.t, handshakes_failed, 1);
    WAIT_STAT(p->b.t, conns_bad_hello, 1);

    /* A third party: a right hello, a made-up proof, a frame. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons(kvf_transport_tcp_port(p->b.t))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    uint8_t hello[KVF_TCP_HELLO_SIZE] = {0};
    uint32_t magic = KVF_TCP_MAGIC_HELLO, pmagic = KVF_TCP_MAGIC_PROOF;
    uint16_t version = KVF_TCP_VERSION;
    uint64_t from = NODE_A, to = NODE_B;
    memcpy(hello, &magic, 4);
    memcpy(hello + 4, &version, 2);
    memcpy(hello + 8, &from, 8);
    memcpy(hello + 16, &to, 8);
    uint8_t proof[KVF_TCP_PROOF_SIZE];
    memset(proof, 0x42, sizeof(proof));
    memcpy(proof, &pmagic, 4);
    uint8_t hdr[KVF_TCP_HEADER_SIZE] = {0};
    uint32_t dmagic = KVF_TCP_MAGIC_DATA, pool = POOL_ID, page = 5, count = 1;
    uint64_t seq = 1, len = PAGE;
    memcpy(hdr, &dmagic, 4);
    memcpy(hdr + 4, &version, 2);
    memcpy(hdr + 8, &ROOM.room_id, 8);
    memcpy(hdr + 16, &ROOM.generation, 8);
    memcpy(hdr + 24, &seq, 8);
    memcpy(hdr + 32, &pool, 4);
    memcpy(hdr + 36, &page, 4);
    memcpy(hdr + 40, &count, 4);
    memcpy(hdr + 56, &len, 8);
    assert_int_equal(send(fd, hello, sizeof(hello), MSG_NOSIGNAL), (ssize_t)sizeof(hello));
    assert_int_equal(send(fd, proof, sizeof(proof), MSG_NOSIGNAL), (ssize_t)sizeof(proof));
    (void)send(fd, hdr, sizeof(hdr), MSG_NOSIGNAL);
    (void)send(fd, src, PAGE, MSG_NOSIGNAL);
    WAIT_STAT(p->b.t, conns_bad_hello, 2);
    close(fd);

    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.conns_accepted, 0);
    assert_int_equal(s.frames_received, 0);
    assert_int_equal(atomic_load(&p->b.checks), 0); /* not even a lease check */
    assert_true(canary_intact(p->b.pool, POOL_BYTES));
    free(src);
    node_fini(&p->a);
    node_fini(&p->b);
    free(p);
}

/* A connection whose handshake failed is not kept: B did not know A yet (its
 * introduction came late), so B refused A's hello after its wait and A's
 * posts failed -EIO; once B knows A, the next connect replaces the dead
 * connection and the frame lands. (Before, the dead one was kept and every
 * later post to B failed -EIO for good.) */
static void test_dead_connection_replaced(void **state)
{
    (void)state;
    struct pair *p = calloc(1, sizeof(*p));
    assert_non_null(p);
    node_init(&p->a, NODE_A);
    node_init(&p->b, NODE_B);
    assert_int_equal(kvf_transport_tcp_add_peer(p->a.t, A_PEER_B, NODE_B), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->a.t, A_PEER_B, SECRET), 0);
    uint16_t port = kvf_transport_tcp_port(p->b.t);
    assert_int_equal(kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", port), 0);
    WAIT_STAT(p->a.t, handshakes_failed, 1); /* B's wait for the peer ran out */
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 9);
    struct kvf_xfer x;
    assert_int_equal(post(&p->a, &x, ROOM, src, PAGE, 2, 1, 0), -EIO);

    assert_int_equal(kvf_transport_tcp_add_peer(p->b.t, B_PEER_A, NODE_A), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(p->b.t, B_PEER_A, SECRET), 0);
    assert_int_equal(kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", port), 0);
    assert_int_equal(post(&p->a, &x, ROOM, src, PAGE, 2, 1, 0), 0);
    struct reaped r = {0};
    reap(p->a.t, 1, &r);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], 1);
    WAIT_STAT(p->b.t, frames_received, 1);
    assert_memory_equal(p->b.pool + 2 * (size_t)PAGE, src, PAGE);
    /* A live connection is kept. */
    assert_int_equal(kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", port), -EEXIST);
    free(src);
    node_fini(&p->a);
    node_fini(&p->b);
    free(p);
}

/* Frees are watched: the test binary is linked with -Wl,--wrap=free
 * (CMakeLists.txt), so every free of the transport (and of anything else
 * linked statically) comes here first. While `watch_freed_secret` is set, the
 * block, still allocated, is searched for SECRET before it goes back to
 * malloc; a hit counts in `freed_with_secret`. No freed memory is read. */
static atomic_bool watch_freed_secret;
static atomic_uint freed_with_secret;

void __real_free(void *ptr);
void __wrap_free(void *ptr);
void __wrap_free(void *ptr)
{
    if (ptr && atomic_load(&watch_freed_secret) &&
        memmem(ptr, malloc_usable_size(ptr), SECRET, sizeof(SECRET)) != NULL)
        atomic_fetch_add(&freed_with_secret, 1);
    __real_free(ptr);
}

/* The pair secret never goes back to malloc: destroying both transports,
 * with a proven connection A -> B (a frame landed) and a handshake at B left
 * half-way (a right hello from A's node id, the challenge read, no proof:
 * B's pending slot holds the secret), frees no block that still holds it.
 * Before, the table of pending handshakes was freed with the secret in it. */
static void test_destroy_frees_no_secret(void **state)
{
    (void)state;
    struct pair *p = calloc(1, sizeof(*p));
    assert_non_null(p);
    node_init(&p->a, NODE_A);
    node_init(&p->b, NODE_B);
    pair_introduce(p, SECRET, SECRET);
    uint16_t port = kvf_transport_tcp_port(p->b.t);
    assert_int_equal(kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", port), 0);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 11);
    struct kvf_xfer x;
    assert_int_equal(post(&p->a, &x, ROOM, src, PAGE, 2, 1, 0), 0);
    struct reaped r = {0};
    reap(p->a.t, 1, &r);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], 1);
    WAIT_STAT(p->b.t, frames_received, 1);

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    uint8_t hello[KVF_TCP_HELLO_SIZE] = {0};
    uint32_t magic = KVF_TCP_MAGIC_HELLO; /* the test runs little-endian */
    uint16_t version = KVF_TCP_VERSION;
    uint64_t from = NODE_A, to = NODE_B;
    memcpy(hello, &magic, 4);
    memcpy(hello + 4, &version, 2);
    memcpy(hello + 8, &from, 8);
    memcpy(hello + 16, &to, 8);
    assert_int_equal(send(fd, hello, sizeof(hello), MSG_NOSIGNAL), (ssize_t)sizeof(hello));
    uint8_t ch[KVF_TCP_CHALLENGE_SIZE];
    size_t got = 0;
    while (got < sizeof(ch)) {
        ssize_t n = recv(fd, ch + got, sizeof(ch) - got, 0);
        if (n <= 0)
            fail_msg("B sent no challenge (%zd after %zu bytes)", n, got);
        got += (size_t)n;
    }

    atomic_store(&freed_with_secret, 0);
    atomic_store(&watch_freed_secret, true);
    node_fini(&p->b);
    node_fini(&p->a);
    atomic_store(&watch_freed_secret, false);
    close(fd);
    free(src);
    free(p);
    unsigned hits = atomic_load(&freed_with_secret);
    if (hits != 0)
        fail_msg("%u freed blocks still held the pair secret", hits);
}

/* pthread_create fails with EAGAIN off the main thread while
 * `fail_thread_create` is set: the test binary is linked with
 * -Wl,--wrap=pthread_create (CMakeLists.txt), and off the main thread the
 * transport creates only the data port's receiver threads. */
static atomic_bool fail_thread_create;
static pthread_t main_thread;
int __real_pthread_create(pthread_t *th, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg);
int __wrap_pthread_create(pthread_t *th, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg);
int __wrap_pthread_create(pthread_t *th, const pthread_attr_t *attr, void *(*fn)(void *), void *arg)
{
    if (atomic_load(&fail_thread_create) && !pthread_equal(pthread_self(), main_thread))
        return EAGAIN;
    return __real_pthread_create(th, attr, fn, arg);
}

/* A connection that proved the secret but for which the data port cannot
 * start a receiver thread is refused and counted as a lack of resources,
 * not as over a cap (no cap was reached). */
static void test_no_receiver_thread_is_counted_as_no_resource(void **state)
{
    (void)state;
    struct pair *p = calloc(1, sizeof(*p));
    assert_non_null(p);
    node_init(&p->a, NODE_A);
    node_init(&p->b, NODE_B);
    pair_introduce(p, SECRET, SECRET);
    atomic_store(&fail_thread_create, true);
    assert_int_equal(
        kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", kvf_transport_tcp_port(p->b.t)),
        0);
    WAIT_STAT(p->b.t, conns_refused, 1);
    atomic_store(&fail_thread_create, false);
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.conns_accepted, 0);
    assert_int_equal(s.conns_no_resource, 1);
    assert_int_equal(s.conns_over_cap, 0);
    node_fini(&p->a);
    node_fini(&p->b);
    free(p);
}

/* The wake descriptor (transport.h): readable once a frame completes, so a
 * poller sleeps in poll(2) instead of on a timer; cleared and polled empty,
 * it stays quiet until the next completion. */
static void test_wake_fd_wakes_the_poller(void **state)
{
    struct pair *p = *state;
    int fd = kvf_transport_wake_fd(p->a.t);
    assert_true(fd >= 0);
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 0), 0);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 4);
    for (unsigned round = 0; round < 3; round++) {
        struct kvf_xfer x;
        assert_int_equal(post(&p->a, &x, ROOM, src, PAGE, round, 1, 0), 0);
        assert_int_equal(poll(&pf, 1, WAIT_MS), 1);
        kvf_transport_wake_ack(p->a.t);
        struct reaped r = {0};
        reap(p->a.t, 1, &r);
        assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], 1);
        struct kvf_completion c;
        assert_int_equal(kvf_transport_poll(p->a.t, 1, &c), 0);
        assert_int_equal(poll(&pf, 1, 0), 0);
    }
    WAIT_STAT(p->b.t, frames_received, 3);
    free(src);
}

/* A blackholed peer address on loopback: a listener with a backlog of 0
 * that never accepts, its accept queue filled by two connects of ours, so the
 * kernel drops every further SYN and a connect to it never completes. The
 * two fillers' descriptors go to fill[2]; returns the listener. */
static int blackhole_listen(uint16_t *port_p, int fill[2])
{
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(lfd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 0), 0);
    socklen_t len = sizeof(sa);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&sa, &len), 0);
    for (int i = 0; i < 2; i++) {
        fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        assert_true(fill[i] >= 0);
        int rc = connect(fill[i], (struct sockaddr *)&sa, sizeof(sa));
        assert_true(rc == 0 || errno == EINPROGRESS);
    }
    /* The first one is in the accept queue once it is writable. */
    struct pollfd pf = {.fd = fill[0], .events = POLLOUT};
    assert_int_equal(poll(&pf, 1, WAIT_MS), 1);
    *port_p = ntohs(sa.sin_port);
    return lfd;
}

static void blackhole_close(int lfd, const int fill[2])
{
    close(fill[0]);
    close(fill[1]);
    close(lfd);
}

/* Issue 12 (item 5): a connect to a peer that never answers returns at once
 * (the node's owner thread calls it); the frame posted meanwhile waits in the
 * queue and fails -ETIMEDOUT at the connect deadline, counted; the next
 * connect starts over. A fence of a peer whose connect is pending returns at
 * once with its frame FLUSHED, and destroy does not wait for the network
 * either. Before, connect() blocked in the kernel's SYN retries (minutes). */
static void test_blackholed_peer_connect_does_not_block(void **state)
{
    (void)state;
    enum { DEADLINE_MS = 600 };
    int fill[2];
    uint16_t port;
    int lfd = blackhole_listen(&port, fill);
    struct node a;
    node_init_connect(&a, NODE_A, DEADLINE_MS);
    assert_int_equal(kvf_transport_tcp_add_peer(a.t, A_PEER_B, NODE_B), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(a.t, A_PEER_B, SECRET), 0);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 3);

    uint64_t t0 = now_ms();
    assert_int_equal(kvf_transport_tcp_connect(a.t, A_PEER_B, "127.0.0.1", port), 0);
    assert_true(now_ms() - t0 < 200);
    /* Connecting: alive, so a second connect keeps it. */
    assert_int_equal(kvf_transport_tcp_connect(a.t, A_PEER_B, "127.0.0.1", port), -EEXIST);
    struct kvf_xfer x;
    assert_int_equal(post(&a, &x, ROOM, src, PAGE, 0, 1, 0), 0);
    assert_int_equal(kvf_lt_inflight(a.lt), 1); /* queued, waiting for the connection */
    struct kvf_completion c;
    uint64_t deadline = now_ms() + WAIT_MS;
    int got;
    while ((got = kvf_transport_poll(a.t, 1, &c)) == 0) {
        assert_true(now_ms() < deadline);
        sleep_ms(5);
    }
    assert_int_equal(got, 1);
    uint64_t waited = now_ms() - t0;
    assert_ptr_equal(c.xfer, &x);
    assert_int_equal(c.outcome, KVF_LT_DONE_ERROR);
    assert_int_equal(c.status, -ETIMEDOUT);
    assert_true(waited >= DEADLINE_MS - 50);
    struct kvf_transport_tcp_stats st;
    kvf_transport_tcp_stats(a.t, &st);
    assert_int_equal(st.connects_started, 1);
    assert_int_equal(st.connects_failed, 1);
    assert_int_equal(st.connects_timed_out, 1);
    assert_int_equal(st.frames_sent, 0);

    /* The dead connection is replaced by the next connect, which waits too;
     * a fence while it waits returns at once, the frame FLUSHED. */
    assert_int_equal(kvf_transport_tcp_connect(a.t, A_PEER_B, "127.0.0.1", port), 0);
    assert_int_equal(post(&a, &x, ROOM, src, PAGE, 0, 1, 0), 0);
    t0 = now_ms();
    assert_int_equal(kvf_transport_fence_peer(a.t, A_PEER_B), 0);
    assert_true(now_ms() - t0 < DEADLINE_MS / 2);
    assert_int_equal(kvf_transport_poll(a.t, 1, &c), 1);
    assert_int_equal(c.outcome, KVF_LT_DONE_FLUSHED);
    kvf_transport_tcp_stats(a.t, &st);
    assert_int_equal(st.connects_started, 2);
    assert_int_equal(st.connects_timed_out, 1);
    node_fini(&a);

    /* Destroy while a connect is pending (default deadline, 10 s). */
    struct node b;
    node_init(&b, NODE_B);
    assert_int_equal(kvf_transport_tcp_add_peer(b.t, B_PEER_A, NODE_A), 0);
    assert_int_equal(kvf_transport_tcp_set_peer_key(b.t, B_PEER_A, SECRET), 0);
    assert_int_equal(kvf_transport_tcp_connect(b.t, B_PEER_A, "127.0.0.1", port), 0);
    t0 = now_ms();
    node_fini(&b);
    assert_true(now_ms() - t0 < 2000);
    free(src);
    blackhole_close(lfd, fill);
}

/* R1/R12: the sink fences the source in the middle of a stream. Once
 * fence_peer returns no byte of the pool changes any more, the receive ops are
 * all retired, and the source's ops all complete and drain its lifetime. */
static void test_fence_sink_side_mid_stream(void **state)
{
    struct pair *p = *state;
    enum { FRAMES = 3000, SRCS = 61 };
    uint8_t *src = malloc((size_t)SRCS * PAGE);
    struct kvf_xfer *x = calloc(FRAMES, sizeof(*x));
    uint8_t *snap = malloc(POOL_BYTES);
    assert_non_null(src);
    assert_non_null(x);
    assert_non_null(snap);
    for (unsigned i = 0; i < SRCS; i++)
        fill_pattern(src + (size_t)i * PAGE, PAGE, 5000u + i);

    unsigned posted = 0;
    for (unsigned i = 0; i < FRAMES; i++) {
        int rc = post(&p->a, &x[posted], ROOM, src + (size_t)(i % SRCS) * PAGE, PAGE,
                      i % POOL_PAGES, 1, 0);
        assert_int_equal(rc, 0);
        posted++;
    }
    wait_count(&p->b.frames_ok, 200);
    assert_int_equal(kvf_transport_fence_peer(p->b.t, B_PEER_A), 0);

    /* From here on nothing may land. */
    unsigned landed = atomic_load(&p->b.frames_ok) + atomic_load(&p->b.frames_cut);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    memcpy(snap, p->b.pool, POOL_BYTES);
    sleep_ms(300);
    assert_memory_equal(snap, p->b.pool, POOL_BYTES);
    assert_int_equal(atomic_load(&p->b.frames_ok) + atomic_load(&p->b.frames_cut), landed);
    assert_true(landed < FRAMES);

    /* The source's writes fail (connection reset) or are flushed by its own
     * fence of the sink; either way each completes once and is retired. */
    assert_int_equal(kvf_transport_fence_peer(p->a.t, A_PEER_B), 0);
    struct reaped r = {0};
    reap(p->a.t, posted, &r);
    assert_int_equal(r.n, posted);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_OK] + r.by_outcome[KVF_LT_DONE_ERROR] +
                         r.by_outcome[KVF_LT_DONE_FLUSHED],
                     posted);
    assert_true(r.by_outcome[KVF_LT_DONE_OK] < posted);
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    struct kvf_completion c;
    assert_int_equal(kvf_transport_poll(p->a.t, 1, &c), 0);

    /* Both lifetimes drain on close, with nothing in flight. */
    assert_true(kvf_lt_close(p->a.lt));
    assert_true(kvf_lt_close(p->b.lt));

    /* Fenced stays fenced: no posts, no reconnects. */
    struct kvf_xfer y;
    assert_int_equal(
        kvf_lt_table_open(p->a.tab, (kvf_room_key){.room_id = 42, .generation = 2}, &p->a.lt), 0);
    assert_int_equal(post(&p->a, &y, ROOM, src, PAGE, 0, 1, 0), -ESTALE);
    assert_int_equal(
        kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", kvf_transport_tcp_port(p->b.t)),
        -ESTALE);
    assert_int_equal(kvf_transport_fence_peer(p->b.t, B_PEER_A), 0); /* idempotent */
    assert_int_equal(kvf_transport_fence_peer(p->b.t, 9), -ENOENT);
    free(snap);
    free(x);
    free(src);
}

/* The source fences the sink while its writes are queued behind a full
 * socket (the sink's receiver is held in its check): the frame being written
 * and every queued one complete FLUSHED, and the lifetime drains. */
static void test_fence_source_side_flushes(void **state)
{
    struct pair *p = *state;
    enum { FRAMES = 64, BIG = 16 * PAGE };
    uint8_t *src = malloc(BIG);
    struct kvf_xfer *x = calloc(FRAMES, sizeof(*x));
    assert_non_null(src);
    assert_non_null(x);
    fill_pattern(src, BIG, 77);

    pthread_mutex_lock(&p->b.gate_lock);
    p->b.gate_closed = true;
    pthread_mutex_unlock(&p->b.gate_lock);

    for (unsigned i = 0; i < FRAMES; i++)
        assert_int_equal(post(&p->a, &x[i], ROOM, src, BIG, (i % 16) * 16, 16, 0), 0);
    uint64_t deadline = now_ms() + WAIT_MS;
    while (atomic_load(&p->b.in_gate) == 0) {
        assert_true(now_ms() < deadline);
        sleep_ms(1);
    }
    sleep_ms(100); /* the sender fills the socket buffers and blocks */

    assert_int_equal(kvf_transport_fence_peer(p->a.t, A_PEER_B), 0);
    struct reaped r = {0};
    reap(p->a.t, FRAMES, &r);
    assert_true(r.by_outcome[KVF_LT_DONE_FLUSHED] > FRAMES / 2);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_ERROR], 0);
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_true(kvf_lt_close(p->a.lt));
    assert_true(kvf_lt_take_drained(p->a.lt));
    assert_int_equal(kvf_transport_post_write(p->a.t, &x[0]), -ESTALE);

    /* Let the sink's receiver go: it ends with the connection, retiring
     * whatever it admitted; its own fence then joins it. */
    pthread_mutex_lock(&p->b.gate_lock);
    p->b.gate_closed = false;
    pthread_cond_broadcast(&p->b.gate_cond);
    pthread_mutex_unlock(&p->b.gate_lock);
    assert_int_equal(kvf_transport_fence_peer(p->b.t, B_PEER_A), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    free(x);
    free(src);
}

/* Holds B's receiver in its check (B reads nothing more): A's sender fills the
 * socket buffers and blocks part way through a frame. */
static void gate_hold(struct pair *p)
{
    pthread_mutex_lock(&p->b.gate_lock);
    p->b.gate_closed = true;
    pthread_mutex_unlock(&p->b.gate_lock);
}

static void gate_wait_held(struct pair *p)
{
    uint64_t deadline = now_ms() + WAIT_MS;
    while (atomic_load(&p->b.in_gate) == 0) {
        assert_true(now_ms() < deadline);
        sleep_ms(1);
    }
}

static void gate_open(struct pair *p)
{
    pthread_mutex_lock(&p->b.gate_lock);
    p->b.gate_closed = false;
    pthread_cond_broadcast(&p->b.gate_cond);
    pthread_mutex_unlock(&p->b.gate_lock);
}

/* Waits until B has seen (checked) every frame A wrote before now: A sends a
 * marker frame for a room B refuses, and frames on one connection arrive in
 * order. Returns B's check count without the marker. */
static unsigned b_checks_after_marker(struct pair *p, struct kvf_xfer *marker, const void *src,
                                      uint64_t rejected_before)
{
    struct kvf_lt *other = kvf_lt_table_find(p->a.tab, OTHER_ROOM);
    if (!other)
        assert_int_equal(kvf_lt_table_open(p->a.tab, OTHER_ROOM, &other), 0);
    assert_true(kvf_lt_is_open(other));
    assert_int_equal(post(&p->a, marker, OTHER_ROOM, src, PAGE, 0, 1, 0), 0);
    WAIT_STAT(p->b.t, frames_rejected, rejected_before + 1);
    return atomic_load(&p->b.checks) - 1;
}

/* An abort while many frames are queued behind a slow reader: the frames the
 * sender had not started when the room's lifetime closed complete FLUSHED
 * without a byte written (the sink never sees them), the one on the wire is
 * finished whole, and the lifetime drains without waiting for the queue. */
static void test_closed_lifetime_skips_queued_frames(void **state)
{
    struct pair *p = *state;
    /* 64 MiB of 1 MiB frames into pages 0-15 (more than loopback's socket
     * buffers hold), then a tail of 1-page frames, each into its own page. */
    enum { FILL = 64, BIG = 16 * PAGE, TAIL = POOL_PAGES - 16, FRAMES = FILL + TAIL };
    uint8_t *big = malloc(BIG);
    uint8_t *tail = malloc((size_t)TAIL * PAGE);
    struct kvf_xfer *x = calloc(FRAMES + 1, sizeof(*x));
    assert_non_null(big);
    assert_non_null(tail);
    assert_non_null(x);
    fill_pattern(big, BIG, 31);
    fill_pattern(tail, (size_t)TAIL * PAGE, 32);

    gate_hold(p);
    for (unsigned i = 0; i < FILL; i++)
        assert_int_equal(post(&p->a, &x[i], ROOM, big, BIG, 0, 16, 0), 0);
    for (unsigned i = 0; i < TAIL; i++)
        assert_int_equal(
            post(&p->a, &x[FILL + i], ROOM, tail + (size_t)i * PAGE, PAGE, 16 + i, 1, 0), 0);
    gate_wait_held(p);

    /* The abort: admission closes on the source; ops are still in flight. */
    assert_false(kvf_lt_close(p->a.lt));
    assert_int_equal(kvf_lt_inflight(p->a.lt), FRAMES);
    gate_open(p);

    /* Reap one by one, in order: OKs first (the frames started before the
     * close), then only FLUSHED ones; exactly one retirement drains. */
    struct kvf_completion c;
    unsigned ok = 0, flushed = 0, drained = 0;
    uint64_t deadline = now_ms() + WAIT_MS;
    for (unsigned i = 0; i < FRAMES;) {
        int n = kvf_transport_poll(p->a.t, 1, &c);
        assert_true(n >= 0);
        if (n == 0) {
            assert_true(now_ms() < deadline);
            sleep_ms(1);
            continue;
        }
        assert_ptr_equal(c.xfer, &x[i]); /* completions in post order */
        if (c.outcome == KVF_LT_DONE_OK) {
            assert_int_equal(flushed, 0); /* nothing written after a skip */
            ok++;
        } else {
            assert_int_equal(c.outcome, KVF_LT_DONE_FLUSHED);
            assert_int_equal(c.status, -ECANCELED);
            flushed++;
        }
        drained += c.drained;
        assert_int_equal(c.drained, i == FRAMES - 1);
        i++;
    }
    assert_true(ok >= 1);   /* the frame on the wire when the room closed */
    assert_true(ok < FILL); /* the socket buffers cannot hold all the filler */
    assert_int_equal(ok + flushed, FRAMES);
    assert_int_equal(drained, 1);
    assert_int_equal(kvf_lt_state(p->a.lt), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(p->a.lt));

    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->a.t, &s);
    assert_int_equal(s.frames_sent, ok);
    assert_int_equal(s.frames_skipped, flushed);
    assert_int_equal(s.bytes_sent, (uint64_t)ok * BIG);

    /* The sink saw exactly the frames written, whole, and none of the tail. */
    unsigned seen = b_checks_after_marker(p, &x[FRAMES], tail, 0);
    assert_int_equal(seen, ok);
    wait_count(&p->b.frames_ok, ok);
    assert_memory_equal(p->b.pool, big, BIG);
    assert_true(canary_intact(p->b.pool + BIG, (size_t)TAIL * PAGE));
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.frames_received, ok);
    assert_int_equal(s.frames_malformed + s.frames_cut, 0);
    struct reaped r = {0};
    reap(p->a.t, 1, &r); /* the marker */
    assert_true(kvf_lt_close(kvf_lt_table_find(p->a.tab, OTHER_ROOM)));
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    free(x);
    free(tail);
    free(big);
}

/* Skipping the frames of a closed room keeps the connection's order and
 * sequence: frames of another, open room queued between them are all
 * written, in order, and land byte-exact. */
static void test_skip_keeps_other_rooms_in_order(void **state)
{
    struct pair *p = *state;
    enum { PAIRS = 64, BIG = 16 * PAGE };
    struct kvf_lt *closing;
    assert_int_equal(kvf_lt_table_open(p->a.tab, OTHER_ROOM, &closing), 0);
    uint8_t *big = malloc(BIG);
    uint8_t *small = malloc((size_t)PAIRS * PAGE);
    struct kvf_xfer *x = calloc(2 * PAIRS + 1, sizeof(*x));
    assert_non_null(big);
    assert_non_null(small);
    assert_non_null(x);
    fill_pattern(big, BIG, 41);
    fill_pattern(small, (size_t)PAIRS * PAGE, 42);

    gate_hold(p);
    /* B refuses OTHER_ROOM (drained to scratch) and admits ROOM. */
    for (unsigned i = 0; i < PAIRS; i++) {
        assert_int_equal(post(&p->a, &x[2 * i], OTHER_ROOM, big, BIG, 0, 16, 0), 0);
        assert_int_equal(
            post(&p->a, &x[2 * i + 1], ROOM, small + (size_t)i * PAGE, PAGE, 16 + i, 1, 0), 0);
    }
    gate_wait_held(p);
    assert_false(kvf_lt_close(closing));
    gate_open(p);

    struct reaped r = {0};
    reap(p->a.t, 2 * PAIRS, &r);
    assert_int_equal(r.by_outcome[KVF_LT_DONE_ERROR], 0);
    assert_true(r.by_outcome[KVF_LT_DONE_FLUSHED] > 0);
    assert_true(r.by_outcome[KVF_LT_DONE_FLUSHED] < PAIRS);
    assert_int_equal(r.drained, 1); /* the closed room's, once its last frame retired */
    assert_int_equal(kvf_lt_state(closing), KVF_LT_DRAINED);
    assert_true(kvf_lt_take_drained(closing));

    /* Every frame of the open room was written and landed. */
    wait_count(&p->b.frames_ok, PAIRS);
    assert_memory_equal(p->b.pool + 16 * (size_t)PAGE, small, (size_t)PAIRS * PAGE);
    assert_true(canary_intact(p->b.pool, 16 * (size_t)PAGE));
    struct kvf_transport_tcp_stats s;
    kvf_transport_tcp_stats(p->a.t, &s);
    assert_int_equal(s.frames_skipped, r.by_outcome[KVF_LT_DONE_FLUSHED]);
    assert_int_equal(s.frames_sent, 2 * PAIRS - r.by_outcome[KVF_LT_DONE_FLUSHED]);
    uint64_t written_other = PAIRS - r.by_outcome[KVF_LT_DONE_FLUSHED];
    WAIT_STAT(p->b.t, frames_rejected, written_other);
    kvf_transport_tcp_stats(p->b.t, &s);
    assert_int_equal(s.frames_received, PAIRS);
    assert_int_equal(s.frames_malformed + s.frames_cut, 0);
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    free(x);
    free(small);
    free(big);
}

/* R11: many threads post to one peer at once; every frame lands whole. */
enum { POSTERS = 8, PER_POSTER = 8, FRAME_PAGES = 4, MT_ROUNDS = 3 };

struct poster {
    struct pair *p;
    unsigned id;
    unsigned round;
    uint8_t *src;
    struct kvf_xfer x[PER_POSTER];
    atomic_int failures;
};

static void *poster_main(void *arg)
{
    struct poster *w = arg;
    for (unsigned i = 0; i < PER_POSTER; i++) {
        uint32_t page = (w->id * PER_POSTER + i) * FRAME_PAGES;
        uint8_t *s = w->src + (size_t)i * FRAME_PAGES * PAGE;
        if (post(&w->p->a, &w->x[i], ROOM, s, (uint64_t)FRAME_PAGES * PAGE, page, FRAME_PAGES, 0) !=
            0)
            atomic_fetch_add(&w->failures, 1);
    }
    return NULL;
}

static void test_many_posters_never_interleave(void **state)
{
    struct pair *p = *state;
    static struct poster w[POSTERS];
    unsigned total = 0;
    for (unsigned round = 0; round < MT_ROUNDS; round++) {
        pthread_t th[POSTERS];
        for (unsigned k = 0; k < POSTERS; k++) {
            w[k].p = p;
            w[k].id = k;
            w[k].round = round;
            atomic_init(&w[k].failures, 0);
            if (!w[k].src)
                w[k].src = malloc((size_t)PER_POSTER * FRAME_PAGES * PAGE);
            assert_non_null(w[k].src);
            for (unsigned i = 0; i < PER_POSTER; i++)
                fill_pattern(w[k].src + (size_t)i * FRAME_PAGES * PAGE, (size_t)FRAME_PAGES * PAGE,
                             (round * POSTERS + k) * 100u + i);
        }
        for (unsigned k = 0; k < POSTERS; k++)
            assert_int_equal(pthread_create(&th[k], NULL, poster_main, &w[k]), 0);
        for (unsigned k = 0; k < POSTERS; k++)
            assert_int_equal(pthread_join(th[k], NULL), 0);
        for (unsigned k = 0; k < POSTERS; k++)
            assert_int_equal(atomic_load(&w[k].failures), 0);

        struct reaped r = {0};
        reap(p->a.t, POSTERS * PER_POSTER, &r);
        assert_int_equal(r.by_outcome[KVF_LT_DONE_OK], POSTERS * PER_POSTER);
        total += POSTERS * PER_POSTER;
        wait_count(&p->b.frames_ok, total);
        for (unsigned k = 0; k < POSTERS; k++) {
            for (unsigned i = 0; i < PER_POSTER; i++) {
                size_t page = (size_t)(k * PER_POSTER + i) * FRAME_PAGES;
                assert_memory_equal(p->b.pool + page * PAGE,
                                    w[k].src + (size_t)i * FRAME_PAGES * PAGE,
                                    (size_t)FRAME_PAGES * PAGE);
            }
        }
    }
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    for (unsigned k = 0; k < POSTERS; k++) {
        free(w[k].src);
        w[k].src = NULL;
    }
}

/* A removed pool takes no more bytes: a frame for it is malformed (the
 * connection closes) and the old memory keeps its canary. Removing it again
 * is -ENOENT; the id may be registered again. */
static void test_removed_pool_lands_nowhere(void **state)
{
    struct pair *p = *state;
    pthread_mutex_lock(&p->b.lock);
    p->b.lease_first = 0;
    p->b.lease_count = 8;
    pthread_mutex_unlock(&p->b.lock);
    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), 0);
    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), -ENOENT);
    uint8_t *src = malloc(PAGE);
    assert_non_null(src);
    fill_pattern(src, PAGE, 9);
    struct kvf_xfer x;
    assert_int_equal(post(&p->a, &x, ROOM, src, PAGE, 2, 1, 0), 0);
    struct reaped r = {0};
    reap(p->a.t, 1, &r);
    WAIT_STAT(p->b.t, frames_malformed, 1);
    assert_true(canary_intact(p->b.pool, POOL_BYTES));
    assert_int_equal(atomic_load(&p->b.frames_ok), 0);
    assert_int_equal(atomic_load(&p->b.checks), 0); /* refused before the lease check */
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(p->b.t, POOL_ID, p->b.pool, PAGE, POOL_PAGES), 0);
    free(src);
}

/* The pool is removed, and its id given to other memory, while a frame for
 * it waits in the check (after the receiver looked the pool up): the
 * receiver looks again after the admission and refuses the frame (on_frame
 * -ENOENT, the op retired), so neither the old nor the new memory takes a
 * byte, and the connection carries on. */
static void test_pool_removed_during_check_lands_nowhere(void **state)
{
    struct pair *p = *state;
    uint8_t *other = malloc(POOL_BYTES);
    uint8_t *src = malloc(PAGE);
    assert_non_null(other);
    assert_non_null(src);
    fill_canary(other, POOL_BYTES);
    fill_pattern(src, PAGE, 11);

    gate_hold(p);
    struct kvf_xfer x[2];
    assert_int_equal(post(&p->a, &x[0], ROOM, src, PAGE, 3, 1, 0), 0);
    gate_wait_held(p);
    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(p->b.t, POOL_ID, other, PAGE, POOL_PAGES), 0);
    gate_open(p);
    wait_count(&p->b.frames_cut, 1);
    WAIT_STAT(p->b.t, frames_rejected, 1);
    assert_int_equal(atomic_load(&p->b.frames_ok), 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);
    assert_true(canary_intact(p->b.pool, POOL_BYTES));
    assert_true(canary_intact(other, POOL_BYTES));

    /* The same connection still delivers, into the memory now registered. */
    assert_int_equal(post(&p->a, &x[1], ROOM, src, PAGE, 3, 1, 0), 0);
    wait_count(&p->b.frames_ok, 1);
    assert_memory_equal(other + 3 * (size_t)PAGE, src, PAGE);
    struct reaped r = {0};
    reap(p->a.t, 2, &r);

    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(p->b.t, POOL_ID, p->b.pool, PAGE, POOL_PAGES), 0);
    free(other);
    free(src);
}

/* B's pool replaced by a fake device pool (pool.h): frames land through the
 * receiver's bounce buffer and kvf_pool_write (one write per 256 KiB of
 * payload), byte-exact; a refused frame writes nothing. */
static void test_device_pool_lands_through_the_pool(void **state)
{
    struct pair *p = *state;
    char name[64];
    snprintf(name, sizeof name, "/kvf-test-tcp-%d", (int)getpid());
    shm_unlink(name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)POOL_BYTES), 0);
    uint8_t *m = mmap(NULL, POOL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    close(fd);
    fill_canary(m, POOL_BYTES);
    struct kvf_pool *dev = NULL;
    assert_int_equal(kvf_pool_open_fake_device(name, 0, POOL_BYTES, PAGE, POOL_PAGES, &dev, NULL),
                     0);
    shm_unlink(name);
    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), 0);
    assert_int_equal(kvf_transport_tcp_add_device_pool(p->b.t, POOL_ID, dev), 0);
    assert_int_equal(kvf_transport_tcp_add_device_pool(p->b.t, POOL_ID, dev), -EEXIST);
    pthread_mutex_lock(&p->b.lock);
    p->b.lease_first = 0;
    p->b.lease_count = 64;
    pthread_mutex_unlock(&p->b.lock);

    uint8_t *expect = malloc(POOL_BYTES);
    uint8_t *src = malloc(20 * (size_t)PAGE);
    assert_non_null(expect);
    assert_non_null(src);
    memcpy(expect, m, POOL_BYTES);
    struct kvf_xfer x[3];
    /* 1 MiB into pages [16, 32): four bounce-buffer writes. */
    fill_pattern(src, 16 * (size_t)PAGE, 51);
    memcpy(expect + 16 * (size_t)PAGE, src, 16 * (size_t)PAGE);
    assert_int_equal(post(&p->a, &x[0], ROOM, src, 16 * (uint64_t)PAGE, 16, 16, 0), 0);
    /* An unaligned one over pages [40, 42). */
    uint64_t off = 300, len = (uint64_t)PAGE + 5000;
    fill_pattern(src + 16 * (size_t)PAGE, len, 52);
    memcpy(expect + 40 * (size_t)PAGE + off, src + 16 * (size_t)PAGE, len);
    assert_int_equal(post(&p->a, &x[1], ROOM, src + 16 * (size_t)PAGE, len, 40, 2, off), 0);
    /* Outside B's lease: refused by the check, nothing written. */
    assert_int_equal(post(&p->a, &x[2], ROOM, src, PAGE, 100, 1, 0), 0);
    struct reaped r = {0};
    reap(p->a.t, 3, &r);
    wait_count(&p->b.frames_ok, 2);
    WAIT_STAT(p->b.t, frames_rejected, 1);
    assert_memory_equal(m, expect, POOL_BYTES);
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(dev, &st);
    assert_int_equal(st.writes, 4 + 1);
    assert_int_equal(st.write_bytes, 16 * (uint64_t)PAGE + len);
    assert_int_equal(st.reads, 0);
    assert_int_equal(kvf_lt_inflight(p->b.lt), 0);

    /* Put B's host pool back for the teardown's checks. */
    assert_int_equal(kvf_transport_tcp_remove_pool(p->b.t, POOL_ID), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(p->b.t, POOL_ID, p->b.pool, PAGE, POOL_PAGES), 0);
    assert_int_equal(kvf_pool_close(dev), 0);
    munmap(m, POOL_BYTES);
    free(src);
    free(expect);
}

/* Bad arguments are refused before anything is queued. */
static void test_post_checks_arguments(void **state)
{
    struct pair *p = *state;
    uint8_t buf[16];
    struct kvf_xfer x;
    memset(&x, 0, sizeof(x));
    x.peer = A_PEER_B;
    x.src = buf;
    x.len = sizeof(buf);
    x.page_count = 1;
    assert_int_equal(kvf_transport_post_write(p->a.t, &x), -EINVAL); /* not admitted */
    assert_int_equal(post(&p->a, &x, ROOM, buf, 0, 0, 1, 0), -EINVAL);
    assert_int_equal(post(&p->a, &x, ROOM, buf, sizeof(buf), 0, 0, 0), -EINVAL);
    assert_int_equal(kvf_lt_admit(p->a.lt, &x.op, KVF_LT_OP_TCP_FRAME, 9), 0);
    x.page_count = 1;
    x.peer = 9; /* registered nowhere */
    assert_int_equal(kvf_transport_post_write(p->a.t, &x), -ENOENT);
    x.peer = 1000;
    assert_int_equal(kvf_transport_post_write(p->a.t, &x), -EINVAL); /* op.peer differs */
    (void)kvf_lt_op_cancel(&x.op);
    assert_int_equal(kvf_lt_inflight(p->a.lt), 0);
    assert_int_equal(kvf_transport_tcp_add_pool(p->b.t, POOL_ID, buf, PAGE, 1), -EEXIST);
    assert_int_equal(kvf_transport_tcp_add_peer(p->b.t, 6, NODE_A), -EEXIST);
    assert_int_equal(kvf_transport_tcp_add_peer(p->b.t, B_PEER_A, 555), -EEXIST);
    assert_int_equal(
        kvf_transport_tcp_connect(p->a.t, A_PEER_B, "127.0.0.1", kvf_transport_tcp_port(p->b.t)),
        -EEXIST);
    struct kvf_completion c;
    assert_int_equal(kvf_transport_poll(p->a.t, 1, &c), 0);
}

int main(void)
{
    main_thread = pthread_self();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_transfer_byte_exact, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_frame_events_end_with_idle, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_refused_frames_land_nowhere, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_malformed_range_past_pool, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_malformed_length_mismatch, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_malformed_offset_past_page, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_unknown_node_refused, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_idle_connections_make_no_threads, pair_setup,
                                        pair_teardown),
        cmocka_unit_test(test_wrong_secret_refused_nothing_lands),
        cmocka_unit_test(test_dead_connection_replaced),
        cmocka_unit_test(test_destroy_frees_no_secret),
        cmocka_unit_test_setup_teardown(test_wake_fd_wakes_the_poller, pair_setup, pair_teardown),
        cmocka_unit_test(test_blackholed_peer_connect_does_not_block),
        cmocka_unit_test_setup_teardown(test_unknown_room_is_waited_for_then_refused, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_fence_sink_side_mid_stream, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_fence_source_side_flushes, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_many_posters_never_interleave, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_closed_lifetime_skips_queued_frames, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_skip_keeps_other_rooms_in_order, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_post_checks_arguments, pair_setup, pair_teardown),
        cmocka_unit_test(test_no_receiver_thread_is_counted_as_no_resource),
        cmocka_unit_test_setup_teardown(test_removed_pool_lands_nowhere, pair_setup, pair_teardown),
        cmocka_unit_test_setup_teardown(test_pool_removed_during_check_lands_nowhere, pair_setup,
                                        pair_teardown),
        cmocka_unit_test_setup_teardown(test_device_pool_lands_through_the_pool, pair_setup,
                                        pair_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
