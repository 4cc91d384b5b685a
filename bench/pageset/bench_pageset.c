/*
 * bench_pageset.c: page sets for scattered pages (types.proto PageSet), end
 * to end.
 *
 * In process, for each shape (32,768 pages: every other page, random pages
 * in random order, the same sorted; 1,048,576 pages in 4,096-page runs):
 *   encode    kvf_page_set_encode (libkvfence), the form it picks, its bytes;
 *   decode    what kvfence-control does with it (kvf_pageset_decode_*);
 *   core      kvf_cps_join of the decoded runs on a pure state core (the
 *             page index marks, the disjointness check, the lease's copy),
 *             next to a one-range join;
 *   update    the RoomUpdate that carries such a lease to the nodes (types
 *             .proto Lease keeps ranges): its size, protobuf-c pack (control
 *             plane) and unpack (node) times;
 *   node      the node's check that a chunk's pages lie in such a lease
 *             (node_ranges_cover), per chunk of k scattered pages.
 * With --target HOST:PORT, against a running kvfence-control: a fake node
 * (tests/integration/fake_node.c) attaches and adds a pool of 2^21 pages;
 * then JoinRoom through libkvfence for each shape (page set, and the same
 * pages as ranges where they fit the limit) next to a one-range join, each
 * join followed (untimed) by an abort, the node's Drained, the release and a
 * 3 ms pause, so that no cycle's tail overlaps the next timed join.
 *
 * A benchmark, run by hand (bench/README.md), never by ctest.
 *
 * usage: bench_pageset [--target HOST:PORT] [--reps N] [--only core]
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_pageset.h"
#include "fake_node.h"
#include "kvf_clock.h"
#include "kvf_pageset.h"
#include "kvfence/kvfence.h"
#include "rpc_client.h"

#define POOL_ID    BENCH_POOL_ID
#define POOL_PAGES BENCH_POOL_PAGES
#define SET_PAGES  32768u
#define BIG_PAGES  (1u << 20)

static uint64_t rng = 0x9e3779b97f4a7c15ull;

uint64_t bench_rng_next(void)
{
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return rng * 0x2545f4914f6cdd1dull;
}

double bench_now_us(void)
{
    return (double)kvf_clock_mono_ns() / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Median and 99th percentile of `n` samples (sorts them). */
void bench_stats(double *v, size_t n, double *med_p, double *p99_p)
{
    qsort(v, n, sizeof(*v), cmp_double);
    *med_p = v[n / 2];
    *p99_p = v[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
}

void bench_die(const char *what, const char *why)
{
    fprintf(stderr, "bench_pageset: %s: %s\n", what, why);
    exit(1);
}

/* ---- shapes ------------------------------------------------------------------- */

struct shape {
    const char *name;
    uint32_t *pages;
    size_t n;
};

static struct shape shapes[4];

static void make_shapes(void)
{
    uint32_t *eo = malloc(SET_PAGES * sizeof(*eo));
    uint32_t *rnd = malloc(SET_PAGES * sizeof(*rnd));
    uint32_t *srt = malloc(SET_PAGES * sizeof(*srt));
    uint32_t *big = malloc(BIG_PAGES * sizeof(*big));
    uint8_t *taken = calloc(BIG_PAGES, 1);
    if (!eo || !rnd || !srt || !big || !taken)
        bench_die("shapes", "out of memory");
    for (uint32_t i = 0; i < SET_PAGES; i++)
        eo[i] = 2 * i;
    for (uint32_t i = 0; i < SET_PAGES;) { /* 32k random pages of a 1M-page span */
        uint32_t pg = (uint32_t)(bench_rng_next() % BIG_PAGES);
        if (!taken[pg]) {
            taken[pg] = 1;
            rnd[i++] = pg;
        }
    }
    memcpy(srt, rnd, SET_PAGES * sizeof(*srt));
    qsort(srt, SET_PAGES, sizeof(*srt), cmp_u32);
    for (uint32_t i = 0; i < BIG_PAGES; i++)
        big[i] = (i / 4096) * 8192 + i % 4096;
    free(taken);
    shapes[0] = (struct shape){"32k every other page", eo, SET_PAGES};
    shapes[1] = (struct shape){"32k random, random order", rnd, SET_PAGES};
    shapes[2] = (struct shape){"32k random, sorted", srt, SET_PAGES};
    shapes[3] = (struct shape){"1M in 4k-page runs", big, BIG_PAGES};
}

static const char *form_name(int f)
{
    static const char *names[] = {"empty", "ranges", "bitmap", "deltas"};
    return f >= 0 && f <= 3 ? names[f] : "?";
}

/* ---- encode and decode ---------------------------------------------------------- */

static void bench_codec(unsigned reps)
{
    printf("%-26s %-7s %9s %7s %12s %12s\n", "shape", "form", "bytes", "runs", "encode us",
           "decode us");
    double *t = malloc(reps * sizeof(*t));
    double *d = malloc(reps * sizeof(*d));
    for (size_t s = 0; s < 4; s++) {
        kvf_page_set *set = NULL;
        struct kvf_status st;
        struct kvf_pageset_enc e;
        for (unsigned r = 0; r < reps; r++) {
            double t0 = bench_now_us();
            if (kvf_page_set_encode(shapes[s].pages, shapes[s].n, &set, &st) != 0)
                bench_die("kvf_page_set_encode", st.message);
            t[r] = bench_now_us() - t0;
            if (r + 1 < reps)
                kvf_page_set_destroy(set);
        }
        if (kvf_pageset_encode(shapes[s].pages, shapes[s].n, &e, NULL) != 0)
            bench_die("kvf_pageset_encode", "failed");
        for (unsigned r = 0; r < reps; r++) {
            struct kvf_page_run *runs = NULL;
            size_t nruns = 0;
            double t0 = bench_now_us();
            int rc = 0;
            if (e.form == KVF_PAGESET_BITMAP)
                rc = kvf_pageset_decode_bitmap(e.bytes, e.nbytes, e.bitmap_first, SIZE_MAX, "b",
                                               &runs, &nruns, NULL);
            else if (e.form == KVF_PAGESET_DELTAS)
                rc = kvf_pageset_decode_deltas(e.bytes, e.nbytes, SIZE_MAX, "d", &runs, &nruns,
                                               NULL);
            else { /* ranges: the service copies them */
                runs = malloc(e.nruns * sizeof(*runs));
                if (runs)
                    memcpy(runs, e.runs, e.nruns * sizeof(*runs));
                nruns = e.nruns;
            }
            d[r] = bench_now_us() - t0;
            if (rc != 0 || nruns != e.nruns)
                bench_die("decode", "wrong runs");
            free(runs);
        }
        double tm, tp, dm, dp;
        bench_stats(t, reps, &tm, &tp);
        bench_stats(d, reps, &dm, &dp);
        printf("%-26s %-7s %9zu %7zu %5.0f (p99 %4.0f) %5.0f (p99 %4.0f)\n", shapes[s].name,
               form_name(kvf_page_set_form(set)), kvf_page_set_wire_size(set), e.nruns, tm, tp, dm,
               dp);
        kvf_page_set_destroy(set);
        kvf_pageset_enc_free(&e);
    }
    free(t);
    free(d);
}

/* ---- JoinRoom over gRPC ------------------------------------------------------------------ */

static struct fake_node *g_node;

/* Answers abort notices (and skips other messages) until the room's notice
 * came and was answered. */
static void node_drain(uint64_t room_id)
{
    for (;;) {
        Kvfence__V1__ControlMessage *m = NULL;
        struct kvf_rpc_status st;
        int rc = fake_node_recv(g_node, 10000, &m, &st);
        if (rc != 0)
            bench_die("fake node", "no abort notice within 10 s");
        bool done = false;
        if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE) {
            Kvfence__V1__AbortNotice *a = m->abort_notice;
            fake_node_send_drained(g_node, a->room->room_id, a->room->generation, a->token);
            done = a->room->room_id == room_id;
        }
        kvfence__v1__control_message__free_unpacked(m, NULL);
        if (done)
            return;
    }
}

static void bench_rpc(const char *target, unsigned reps)
{
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, &co);
    if (!ch)
        bench_die("channel", target);
    /* A new incarnation each run: the last run's is LOST by now. */
    g_node = fake_node_attach(ch, "bench-pageset", (uint64_t)kvf_clock_mono_ns());
    if (!g_node)
        bench_die("fake node", "attach failed");
    Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT, *pp = &pool;
    pool.pool_id = POOL_ID;
    pool.kind = KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
    pool.page_size = 4096;
    pool.page_count = POOL_PAGES;
    Kvfence__V1__PoolUpdate pu = KVFENCE__V1__POOL_UPDATE__INIT;
    pu.n_upserted = 1;
    pu.upserted = &pp;
    Kvfence__V1__NodeMessage nm = KVFENCE__V1__NODE_MESSAGE__INIT;
    nm.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_POOL_UPDATE;
    nm.pool_update = &pu;
    if (fake_node_send(g_node, &nm) != 0)
        bench_die("fake node", "pool update");

    kvf_client *c = NULL;
    struct kvf_status st;
    if (kvf_client_create(target, NULL, &c, &st) != 0)
        bench_die("kvf_client_create", st.message);
    printf("\nJoinRoom over gRPC to %s (libkvfence; encode not included; %u joins each)\n", target,
           reps);
    printf("%-34s %8s %12s %9s\n", "request", "bytes", "join us", "x 1-range");
    double *t = malloc(reps * sizeof(*t));
    double base = 0;
    static uint64_t room_id = 1u << 30;
    for (int s = -1; s < 8; s++) {
        /* -1: one range; 0..3: page set of shape s; 4..7: the same as ranges */
        int sh = s < 0 ? 0 : s % 4;
        bool as_ranges = s >= 4;
        kvf_page_set *set = NULL;
        struct kvf_page_range one = {0, 16}, *rv = &one;
        size_t nrv = 1, bytes = 0;
        struct kvf_pageset_enc e = {0};
        if (s >= 0) {
            if (kvf_page_set_encode(shapes[sh].pages, shapes[sh].n, &set, &st) != 0)
                bench_die("encode", st.message);
            bytes = kvf_page_set_wire_size(set);
            if (as_ranges) {
                if (kvf_pageset_encode(shapes[sh].pages, shapes[sh].n, &e, NULL) != 0)
                    bench_die("encode", "failed");
                if (e.form != KVF_PAGESET_RANGES) { /* runs of the set, as ranges */
                    struct kvf_page_run *runs = NULL;
                    size_t n = 0;
                    if (e.form == KVF_PAGESET_BITMAP)
                        kvf_pageset_decode_bitmap(e.bytes, e.nbytes, e.bitmap_first, SIZE_MAX, "b",
                                                  &runs, &n, NULL);
                    else
                        kvf_pageset_decode_deltas(e.bytes, e.nbytes, SIZE_MAX, "d", &runs, &n,
                                                  NULL);
                    free(e.runs);
                    e.runs = runs;
                }
                rv = (struct kvf_page_range *)e.runs;
                nrv = e.nruns;
                bytes = kvf_pageset_ranges_wire_size(e.runs, e.nruns);
            }
        }
        if (s == 2 || s == 6 || s == 7) { /* the same request as another row */
            kvf_page_set_destroy(set);
            kvf_pageset_enc_free(&e);
            continue;
        }
        unsigned n = sh == 3 ? (reps < 20 ? reps : 20) : reps;
        for (unsigned r = 0; r < n; r++) {
            struct kvf_join j = {.room_id = room_id++,
                                 .expected_sources = 1,
                                 .expected_sinks = 1,
                                 .node_id = "bench-pageset",
                                 .role = KVF_ROLE_SINK,
                                 .pool_id = POOL_ID};
            if (set == NULL || as_ranges) {
                j.ranges = rv;
                j.n_ranges = nrv;
            }
            struct kvf_join_result jr;
            int rc;
            double t0;
            for (int tries = 0;; tries++) {
                t0 = bench_now_us();
                rc = set != NULL && !as_ranges ? kvf_join_room_pages(c, &j, set, &jr, &st)
                                               : kvf_join_room(c, &j, &jr, &st);
                if (rc != -KVF_STATUS_NOT_FOUND || tries > 100)
                    break;
                struct timespec ts = {0, 10000000};
                nanosleep(&ts, NULL);
            }
            t[r] = bench_now_us() - t0;
            if (rc != 0)
                bench_die("JoinRoom", st.message);
            if (kvf_abort_room(c, jr.room, "bench", NULL, &st) != 0)
                bench_die("AbortRoom", st.message);
            node_drain(jr.room.room_id);
            if (kvf_wait_released(c, jr.lease_id, 10000, &st) != 0)
                bench_die("wait_released", st.message);
            /* Let the server finish this cycle (the release event, the watch
             * stream's end) before the next timed join. */
            struct timespec settle = {0, 3000000};
            nanosleep(&settle, NULL);
        }
        double m, p;
        bench_stats(t, n, &m, &p);
        if (s < 0)
            base = m;
        char label[64];
        snprintf(label, sizeof label, "%s%s", s < 0 ? "1 range of 16 pages" : shapes[sh].name,
                 s < 0       ? ""
                 : as_ranges ? " (ranges)"
                             : " (page set)");
        printf("%-34s %8zu %5.0f (p99 %4.0f) %8.2f\n", label, s < 0 ? (size_t)6 : bytes, m, p,
               base > 0 ? m / base : 0);
        kvf_page_set_destroy(set);
        kvf_pageset_enc_free(&e);
    }
    free(t);
    kvf_client_destroy(c);
    fake_node_close(g_node);
    kvf_rpc_channel_destroy(ch);
}

int main(int argc, char **argv)
{
    const char *target = NULL, *only = NULL;
    unsigned reps = 200;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--target") == 0)
            target = argv[i + 1];
        else if (strcmp(argv[i], "--reps") == 0)
            reps = (unsigned)strtoul(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--only") == 0)
            only = argv[i + 1];
    }
    if (reps == 0)
        reps = 1;
    make_shapes();
    if (only && strcmp(only, "core") == 0) { /* for a profiler */
        const uint32_t *pg[1] = {shapes[0].pages};
        size_t cnt[1] = {shapes[0].n};
        const char *nm[1] = {shapes[0].name};
        bench_pageset_core(pg, cnt, nm, 1, reps);
        return 0;
    }
    bench_codec(reps);
    const uint32_t *pages[4];
    size_t counts[4];
    const char *names[4];
    for (int i = 0; i < 4; i++) {
        pages[i] = shapes[i].pages;
        counts[i] = shapes[i].n;
        names[i] = shapes[i].name;
    }
    bench_pageset_core(pages, counts, names, 4, reps < 50 ? reps : 50);
    bench_pageset_room_update(reps < 50 ? reps : 50);
    bench_pageset_node_cover(reps < 50 ? reps : 50);
    if (target)
        bench_rpc(target, reps);
    return 0;
}
