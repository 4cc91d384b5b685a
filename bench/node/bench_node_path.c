/*
 * bench_node_path.c: the node's per-frame path in one process, without the
 * daemons: source side admits each frame into the room's lifetime
 * (kvf_lt_admit), posts it on the TCP transport and retires it in poll; the
 * sink side's check callback looks the room up under a read lock, checks the
 * pages against the lease and admits the frame into the sink's lifetime (as
 * kvfence-node's tcp_check does), and its frame callback counts the landed
 * frame (the node posts a job to its owner thread there instead). Two TCP
 * transports on 127.0.0.1, one connection.
 *
 * Reports ops/s of 1-page (4 KiB) frames with `window` frames in flight (64,
 * and 1: one frame's round trip through both sides), each run timed from the
 * first admit until the last frame landed in the sink pool, best and median
 * of `reps`. The sink pool is checked byte for byte against the source after
 * every run.
 * Usage: bench_node_path [ops per run, default 200000] [reps, default 5]
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lifetime.h"
#include "tcp.h"
#include "transport.h"
#include "kvf_clock.h"

#define PAGE       4096u
#define POOL_PAGES 16384u /* 64 MiB */
#define MAX_WINDOW 64u

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

struct sink {
    pthread_rwlock_t lock;
    kvf_room_key room;
    struct kvf_lt *lt;
    uint32_t first, count; /* the sink lease */
    atomic_uint_fast64_t landed;
    atomic_uint_fast64_t refused;
};

static int sink_check(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                      uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    struct sink *s = ctx;
    int rc = -ENOENT;
    pthread_rwlock_rdlock(&s->lock);
    if (pool_id == 0 && room.room_id == s->room.room_id && room.generation == s->room.generation &&
        first_page >= s->first &&
        (uint64_t)first_page + page_count <= (uint64_t)s->first + s->count)
        rc = kvf_lt_admit(s->lt, op, KVF_LT_OP_TCP_FRAME, peer);
    pthread_rwlock_unlock(&s->lock);
    return rc;
}

static void sink_frame(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                       uint32_t first_page, uint32_t page_count, uint64_t bytes, int status,
                       bool drained)
{
    struct sink *s = ctx;
    (void)peer;
    (void)room;
    (void)pool_id;
    (void)first_page;
    (void)page_count;
    (void)bytes;
    (void)drained;
    if (status == 0)
        atomic_fetch_add_explicit(&s->landed, 1, memory_order_release);
    else
        atomic_fetch_add_explicit(&s->refused, 1, memory_order_relaxed);
}

static int src_check(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                     uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    (void)ctx;
    (void)peer;
    (void)room;
    (void)pool_id;
    (void)first_page;
    (void)page_count;
    (void)op;
    return -EPERM;
}

/* Ops per second, or -1 after printing why. */
static double run(const uint8_t *src, uint8_t *pool, uint64_t ops, unsigned window, uint64_t run_id)
{
    const kvf_room_key room = {.room_id = run_id, .generation = 1};
    struct kvf_lt_table *ta = kvf_lt_table_create(), *tb = kvf_lt_table_create();
    struct kvf_lt *la, *lb;
    if (!ta || !tb || kvf_lt_table_open(ta, room, &la) != 0 ||
        kvf_lt_table_open(tb, room, &lb) != 0)
        return -1;
    struct sink s = {.room = room, .lt = lb, .first = 0, .count = POOL_PAGES};
    pthread_rwlock_init(&s.lock, NULL);
    atomic_init(&s.landed, 0);
    atomic_init(&s.refused, 0);

    struct kvf_transport_tcp_opts o;
    kvf_transport_tcp_opts_init(&o);
    o.node_id = 1;
    o.check = src_check;
    struct kvf_transport *a = kvf_transport_tcp_create(&o);
    o.node_id = 2;
    o.check = sink_check;
    o.on_frame = sink_frame;
    o.ctx = &s;
    struct kvf_transport *b = kvf_transport_tcp_create(&o);
    if (!a || !b || kvf_transport_tcp_add_pool(b, 0, pool, PAGE, POOL_PAGES) != 0 ||
        kvf_transport_tcp_add_peer(a, 0, 2) != 0 || kvf_transport_tcp_add_peer(b, 0, 1) != 0 ||
        kvf_transport_tcp_connect(a, 0, "127.0.0.1", kvf_transport_tcp_port(b)) != 0) {
        fprintf(stderr, "bench_node_path: transport setup failed\n");
        return -1;
    }

    struct kvf_xfer x[MAX_WINDOW];
    struct kvf_xfer *free_list[MAX_WINDOW];
    struct kvf_completion c[MAX_WINDOW];
    unsigned nfree = window;
    for (unsigned i = 0; i < window; i++)
        free_list[i] = &x[i];
    uint64_t posted = 0, failed = 0;

    uint64_t t0 = now_ns();
    while (posted < ops && !failed) {
        while (nfree > 0 && posted < ops) {
            struct kvf_xfer *xf = free_list[--nfree];
            memset(xf, 0, sizeof *xf);
            if (kvf_lt_admit(la, &xf->op, KVF_LT_OP_TCP_FRAME, 0) != 0) {
                failed++;
                break;
            }
            uint32_t pg = (uint32_t)(posted % POOL_PAGES);
            xf->room = room;
            xf->src = src + (size_t)pg * PAGE;
            xf->len = PAGE;
            xf->first_page = pg;
            xf->page_count = 1;
            if (kvf_transport_post_write(a, xf) != 0) {
                kvf_lt_op_cancel(&xf->op);
                failed++;
                break;
            }
            posted++;
        }
        /* The node's owner thread polls without blocking, between jobs. */
        int n = kvf_transport_poll(a, MAX_WINDOW, c);
        for (int i = 0; i < n; i++) {
            if (c[i].outcome != KVF_LT_DONE_OK)
                failed++;
            free_list[nfree++] = c[i].xfer;
        }
        if (n == 0)
            sched_yield(); /* 2 cores: leave them to the sender and receiver */
    }
    uint64_t spins = 0;
    while (!failed && atomic_load_explicit(&s.landed, memory_order_acquire) < ops) {
        if (atomic_load(&s.refused) || ++spins > 100000000ull)
            failed++;
        sched_yield();
    }
    uint64_t dt = now_ns() - t0;

    kvf_transport_destroy(a);
    kvf_transport_destroy(b);
    kvf_lt_close(la);
    kvf_lt_close(lb);
    kvf_lt_table_destroy(ta);
    kvf_lt_table_destroy(tb);
    pthread_rwlock_destroy(&s.lock);
    if (failed) {
        fprintf(stderr, "bench_node_path: %llu frames failed or were refused\n",
                (unsigned long long)failed);
        return -1;
    }
    return (double)ops / ((double)dt / 1e9);
}

static int cmp_double(const void *p, const void *q)
{
    double x = *(const double *)p, y = *(const double *)q;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    uint64_t ops = argc > 1 ? strtoull(argv[1], NULL, 10) : 200000;
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    if (ops == 0 || reps <= 0 || reps > 100) {
        fprintf(stderr, "usage: bench_node_path [ops per run] [reps <= 100]\n");
        return 2;
    }
    size_t bytes = (size_t)PAGE * POOL_PAGES;
    uint8_t *src = malloc(bytes), *pool = malloc(bytes);
    if (!src || !pool)
        return 1;
    printf("%-7s %12s %12s %12s\n", "window", "best ops/s", "median", "us per op");
    const unsigned windows[] = {MAX_WINDOW, 1};
    uint64_t run_id = 1;
    for (size_t w = 0; w < 2; w++) {
        uint64_t n = windows[w] == 1 ? ops / 10 : ops; /* a round trip per op: fewer */
        double v[100];
        for (int r = 0; r < reps; r++) {
            for (size_t i = 0; i < bytes; i++)
                src[i] = (uint8_t)(i * 131u + run_id * 7u);
            memset(pool, 0, bytes);
            v[r] = run(src, pool, n, windows[w], run_id++);
            if (v[r] < 0)
                return 1;
            /* Byte-exact: every page written (or, for a short run, the pages
             * written) equals the source. */
            size_t check = n < POOL_PAGES ? (size_t)n * PAGE : bytes;
            if (memcmp(src, pool, check) != 0) {
                fprintf(stderr, "bench_node_path: sink pool differs from the source\n");
                return 1;
            }
        }
        qsort(v, (size_t)reps, sizeof v[0], cmp_double);
        double med = v[reps / 2];
        printf("%-7u %12.0f %12.0f %12.2f\n", windows[w], v[reps - 1], med, 1e6 / med);
    }
    free(pool);
    free(src);
    return 0;
}
