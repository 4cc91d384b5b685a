/*
 * bench_tcp.c: TCP transport throughput against a plain socket stream on
 * loopback (docs/design.md §8: at least 90% for 1 MiB chunks).
 *
 * For each chunk size (64 KiB and 1 MiB), in one process:
 *   plain     a writer thread send()s the chunks on one loopback TCP
 *             connection and a reader thread recv()s them into a pool
 *             buffer, cycling through it;
 *   transport node A posts the chunks to node B through the TCP transport
 *             (lifetime admission, frame header, sender thread, receiver
 *             thread, sink-lease check, copy into the registered pool,
 *             retirement on both sides), keeping up to 64 xfers in flight.
 * Each is timed from the first byte until the last chunk landed in the pool;
 * the best of `reps` runs is printed with the ratio transport / plain.
 * Usage: bench_tcp [MiB per run, default 1024] [reps, default 3]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "lifetime.h"
#include "tcp.h"
#include "transport.h"
#include "kvf_clock.h"

#define PAGE       (64u * 1024u)
#define POOL_PAGES 1024u /* 64 MiB */
#define POOL_BYTES ((size_t)PAGE * POOL_PAGES)
#define WINDOW     64u

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

static void pause_us(long us)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000L};
    nanosleep(&ts, NULL);
}

/* ---- plain socket stream --------------------------------------------------------- */

struct plain {
    int fd;
    const uint8_t *src;
    uint8_t *pool;
    size_t chunk;
    uint64_t chunks;
    int failed;
};

static void *plain_writer(void *arg)
{
    struct plain *p = arg;
    for (uint64_t i = 0; i < p->chunks; i++) {
        size_t off = 0;
        while (off < p->chunk) {
            ssize_t n = send(p->fd, p->src + off, p->chunk - off, MSG_NOSIGNAL);
            if (n <= 0) {
                p->failed = 1;
                return NULL;
            }
            off += (size_t)n;
        }
    }
    return NULL;
}

static void *plain_reader(void *arg)
{
    struct plain *p = arg;
    size_t slots = POOL_BYTES / p->chunk;
    for (uint64_t i = 0; i < p->chunks; i++) {
        uint8_t *dst = p->pool + (i % slots) * p->chunk;
        size_t off = 0;
        while (off < p->chunk) {
            ssize_t n = recv(p->fd, dst + off, p->chunk - off, 0);
            if (n <= 0) {
                p->failed = 1;
                return NULL;
            }
            off += (size_t)n;
        }
    }
    return NULL;
}

/* Returns bytes per second, or a negative value on failure. */
static double run_plain(const uint8_t *src, uint8_t *pool, size_t chunk, uint64_t chunks)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &len) != 0)
        return -1;
    int cfd = socket(AF_INET, SOCK_STREAM, 0);
    if (cfd < 0 || connect(cfd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        return -1;
    int sfd = accept(lfd, NULL, NULL);
    close(lfd);
    if (sfd < 0)
        return -1;
    int one = 1;
    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));

    struct plain w = {.fd = cfd, .src = src, .chunk = chunk, .chunks = chunks};
    struct plain r = {.fd = sfd, .pool = pool, .chunk = chunk, .chunks = chunks};
    pthread_t tw, tr;
    uint64_t t0 = now_ns();
    pthread_create(&tr, NULL, plain_reader, &r);
    pthread_create(&tw, NULL, plain_writer, &w);
    pthread_join(tw, NULL);
    pthread_join(tr, NULL);
    uint64_t dt = now_ns() - t0;
    close(cfd);
    close(sfd);
    if (w.failed || r.failed)
        return -1;
    return (double)chunk * (double)chunks / ((double)dt / 1e9);
}

/* ---- transport ---------------------------------------------------------------------- */

struct sink {
    struct kvf_lt *lt;
    atomic_uint_fast64_t landed;
};

static int sink_check(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
                      uint32_t first_page, uint32_t page_count, struct kvf_lt_op *op)
{
    struct sink *s = ctx;
    (void)room;
    (void)pool_id;
    (void)first_page;
    (void)page_count;
    return kvf_lt_admit(s->lt, op, KVF_LT_OP_TCP_FRAME, peer);
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
}

static int dummy_check(void *ctx, uint32_t peer, kvf_room_key room, uint32_t pool_id,
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

static double run_transport(const uint8_t *src, uint8_t *pool, size_t chunk, uint64_t chunks)
{
    const kvf_room_key room = {.room_id = 1, .generation = 1};
    struct kvf_lt_table *ta = kvf_lt_table_create(), *tb = kvf_lt_table_create();
    struct kvf_lt *la, *lb;
    if (!ta || !tb || kvf_lt_table_open(ta, room, &la) != 0 ||
        kvf_lt_table_open(tb, room, &lb) != 0)
        return -1;
    struct sink s = {.lt = lb};
    atomic_init(&s.landed, 0);

    struct kvf_transport_tcp_opts o;
    kvf_transport_tcp_opts_init(&o);
    o.node_id = 1;
    o.check = dummy_check;
    struct kvf_transport *a = kvf_transport_tcp_create(&o);
    o.node_id = 2;
    o.check = sink_check;
    o.on_frame = sink_frame;
    o.ctx = &s;
    struct kvf_transport *b = kvf_transport_tcp_create(&o);
    if (!a || !b || kvf_transport_tcp_add_pool(b, 0, pool, PAGE, POOL_PAGES) != 0 ||
        kvf_transport_tcp_add_peer(a, 0, 2) != 0 || kvf_transport_tcp_add_peer(b, 0, 1) != 0 ||
        kvf_transport_tcp_connect(a, 0, "127.0.0.1", kvf_transport_tcp_port(b)) != 0)
        return -1;

    struct kvf_xfer *x = calloc(WINDOW, sizeof(*x));
    struct kvf_xfer **free_list = calloc(WINDOW, sizeof(*free_list));
    struct kvf_completion c[WINDOW];
    unsigned nfree = WINDOW;
    for (unsigned i = 0; i < WINDOW; i++)
        free_list[i] = &x[i];
    uint32_t pages = (uint32_t)(chunk / PAGE);
    uint64_t slots = POOL_PAGES / pages;
    uint64_t posted = 0, failed = 0;

    uint64_t t0 = now_ns();
    while (posted < chunks) {
        bool progress = false;
        while (nfree > 0 && posted < chunks) {
            struct kvf_xfer *xf = free_list[--nfree];
            memset(xf, 0, sizeof(*xf));
            kvf_lt_admit(la, &xf->op, KVF_LT_OP_TCP_FRAME, 0);
            xf->room = room;
            xf->src = src;
            xf->len = chunk;
            xf->first_page = (uint32_t)((posted % slots) * pages);
            xf->page_count = pages;
            if (kvf_transport_post_write(a, xf) != 0) {
                kvf_lt_op_cancel(&xf->op);
                failed++;
                free_list[nfree++] = xf;
                break;
            }
            posted++;
            progress = true;
        }
        int n = kvf_transport_poll(a, WINDOW, c);
        for (int i = 0; i < n; i++) {
            if (c[i].outcome != KVF_LT_DONE_OK)
                failed++;
            free_list[nfree++] = c[i].xfer;
        }
        if (failed)
            break;
        if (n == 0 && !progress)
            pause_us(20);
    }
    while (!failed && atomic_load_explicit(&s.landed, memory_order_acquire) < chunks)
        pause_us(20);
    uint64_t dt = now_ns() - t0;

    kvf_transport_destroy(a);
    kvf_transport_destroy(b);
    free(free_list);
    free(x);
    kvf_lt_close(la);
    kvf_lt_close(lb);
    kvf_lt_table_destroy(ta);
    kvf_lt_table_destroy(tb);
    if (failed)
        return -1;
    return (double)chunk * (double)chunks / ((double)dt / 1e9);
}

int main(int argc, char **argv)
{
    uint64_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 1024;
    int reps = argc > 2 ? atoi(argv[2]) : 3;
    if (mib == 0 || reps <= 0) {
        fprintf(stderr, "usage: bench_tcp [MiB per run] [reps]\n");
        return 2;
    }
    uint8_t *src = malloc(1u << 20);
    uint8_t *pool = malloc(POOL_BYTES);
    if (!src || !pool)
        return 1;
    for (size_t i = 0; i < (1u << 20); i++)
        src[i] = (uint8_t)(i * 31u);
    memset(pool, 0, POOL_BYTES);

    const size_t chunks[] = {64u * 1024u, 1024u * 1024u};
    printf("%-8s %12s %12s %8s\n", "chunk", "plain GB/s", "tcp GB/s", "ratio");
    for (size_t k = 0; k < sizeof(chunks) / sizeof(chunks[0]); k++) {
        size_t chunk = chunks[k];
        uint64_t n = (mib << 20) / chunk;
        double best_plain = 0, best_tcp = 0;
        for (int r = 0; r < reps; r++) {
            /* Alternate so that neither side always runs on a warmer machine. */
            double bp = run_plain(src, pool, chunk, n);
            double bt = run_transport(src, pool, chunk, n);
            if (bp < 0 || bt < 0) {
                fprintf(stderr, "bench_tcp: a run failed\n");
                return 1;
            }
            best_plain = bp > best_plain ? bp : best_plain;
            best_tcp = bt > best_tcp ? bt : best_tcp;
        }
        printf("%-8s %12.2f %12.2f %7.1f%%\n", chunk == PAGE ? "64KiB" : "1MiB", best_plain / 1e9,
               best_tcp / 1e9, 100.0 * best_tcp / best_plain);
    }
    free(pool);
    free(src);
    return 0;
}
