/*
 * bench_cp_state.c: cost of the control-plane state core.
 *
 * Fills the core with N open rooms (two participants each on two nodes, each
 * with a 16-page lease, ACTIVE), measures the memory that took (malloc'd bytes
 * by mallinfo2, and RSS), then times full room lifecycles on top of them:
 *   - success: two joins, two completions, leases released;
 *   - abort:   two joins, an abort, two drained reports, leases released.
 * Effects are drained after every call, as the service layer will. This is a
 * benchmark, run by hand (bench/README.md), never by ctest.
 *
 * usage: bench_cp_state [--open N] [--cycles M]
 */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cp_state.h"
#include "kvf_clock.h"

static uint64_t rng = 88172645463325252ull;

static void bench_random(void *ctx, void *buf, size_t len)
{
    (void)ctx;
    unsigned char *p = buf;
    for (size_t i = 0; i < len; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        p[i] = (unsigned char)rng;
    }
}

static double now_s(void)
{
    return (double)kvf_clock_mono_ns() / 1e9;
}

static long rss_kib(void)
{
    long pages = 0, rss = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f == NULL)
        return 0;
    if (fscanf(f, "%ld %ld", &pages, &rss) != 2)
        rss = 0;
    fclose(f);
    return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

static void drain(struct kvf_cps *st)
{
    size_t n;
    kvf_cps_effects_take(st, &n);
}

static void must(int rc, const char *what, const struct kvf_error *err)
{
    if (rc != 0) {
        fprintf(stderr, "bench: %s failed: %d %s\n", what, rc, err ? err->msg : "");
        exit(1);
    }
}

#define PAGES_PER_LEASE 16

/* Joins both participants of room `id`, with pages at `slot` of each pool. */
static kvf_room_key join_pair(struct kvf_cps *st, uint64_t id, uint32_t slot, kvf_time_ns now)
{
    struct kvf_error err;
    struct kvf_cps_join_result res;
    struct kvf_cps_page_range rg = {slot * PAGES_PER_LEASE, PAGES_PER_LEASE};
    struct kvf_cps_join j = {
        .room_id = id,
        .expected_sources = 1,
        .expected_sinks = 1,
        .node_id = "prefill-0",
        .rank = 0,
        .role = KVF_CPS_ROLE_SOURCE,
        .engine_protocol_min = KVF_PROTOCOL_MIN,
        .engine_protocol_max = KVF_PROTOCOL_MAX,
        .engine_features = KVF_FEATURE_QUIESCE_V1,
        .pool_id = 1,
        .ranges = &rg,
        .range_count = 1,
    };
    must(kvf_cps_join(st, &j, now, &res, &err), "join source", &err);
    j.node_id = "decode-0";
    j.role = KVF_CPS_ROLE_SINK;
    must(kvf_cps_join(st, &j, now, &res, &err), "join sink", &err);
    drain(st);
    return res.key;
}

int main(int argc, char **argv)
{
    uint32_t open_rooms = 100000, cycles = 200000;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--open") == 0)
            open_rooms = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--cycles") == 0)
            cycles = (uint32_t)strtoul(argv[i + 1], NULL, 10);
    }
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.random_fn = bench_random;
    long rss0 = rss_kib();
    struct kvf_cps *st = kvf_cps_create(&o);
    if (st == NULL)
        return 1;
    /* Pools big enough for every open room plus one slot for the cycles. */
    uint32_t slots = open_rooms + 1;
    struct kvf_cps_pool pool = {
        .pool_id = 1, .page_size = 65536, .page_count = slots * PAGES_PER_LEASE};
    struct kvf_error err;
    uint32_t version;
    kvf_time_ns now = KVF_NS_PER_S;
    for (int n = 0; n < 2; n++) {
        struct kvf_cps_node_hello h = {
            .node_id = n == 0 ? "prefill-0" : "decode-0",
            .incarnation = 1,
            .protocol_min = KVF_PROTOCOL_MIN,
            .protocol_max = KVF_PROTOCOL_MAX,
            .features = KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_TCP,
            .pools = &pool,
            .pool_count = 1,
        };
        must(kvf_cps_node_attach(st, &h, now, &version, &err), "attach", &err);
    }
    drain(st);
    struct mallinfo2 m1 = mallinfo2();
    long rss1 = rss_kib();

    double t0 = now_s();
    for (uint32_t i = 0; i < open_rooms; i++)
        join_pair(st, 1 + i, i, now);
    double t_fill = now_s() - t0;
    struct mallinfo2 m2 = mallinfo2();
    long rss2 = rss_kib();

    /* Success lifecycles at `open_rooms` open rooms. */
    uint64_t base_id = 1ull << 40;
    t0 = now_s();
    for (uint32_t i = 0; i < cycles; i++) {
        kvf_room_key key = join_pair(st, base_id + i, open_rooms, now);
        must(kvf_cps_report_completed(st, "prefill-0", 1, key, 0, KVF_CPS_ROLE_SOURCE, now, &err),
             "complete source", &err);
        must(kvf_cps_report_completed(st, "decode-0", 1, key, 0, KVF_CPS_ROLE_SINK, now, &err),
             "complete sink", &err);
        drain(st);
        if ((i & 1023) == 0) {
            now += KVF_NS_PER_MS; /* let tombstones expire as they would */
            kvf_cps_tick(st, now);
            drain(st);
        }
    }
    double t_ok = now_s() - t0;

    /* Abort lifecycles: joins, abort, both drained. */
    base_id = 2ull << 40;
    t0 = now_s();
    for (uint32_t i = 0; i < cycles; i++) {
        kvf_room_key key = join_pair(st, base_id + i, open_rooms, now);
        kvf_token tok;
        must(kvf_cps_room_abort(st, key, KVF_CPS_ABORT_ENGINE, now, &tok, &err), "abort", &err);
        drain(st);
        must(kvf_cps_report_drained(st, "prefill-0", 1, key, tok, now, &err), "drained", &err);
        must(kvf_cps_report_drained(st, "decode-0", 1, key, tok, now, &err), "drained", &err);
        drain(st);
        if ((i & 1023) == 0) {
            now += KVF_NS_PER_MS;
            kvf_cps_tick(st, now);
            drain(st);
        }
    }
    double t_abort = now_s() - t0;

    struct kvf_cps_stats s;
    kvf_cps_stats_get(st, &s);
    printf("control-plane core, %u open rooms (2 participants, %d pages each), %u cycles each\n",
           open_rooms, PAGES_PER_LEASE, cycles);
    printf("  fill:               %.3f s (%.0f ns per room, 2 joins)\n", t_fill,
           t_fill * 1e9 / open_rooms);
    printf("  success lifecycle:  %.0f ns (2 joins + 2 completions + release)\n",
           t_ok * 1e9 / cycles);
    printf("  abort lifecycle:    %.0f ns (2 joins + abort + 2 drained + release)\n",
           t_abort * 1e9 / cycles);
    printf("  memory per open room: %.0f bytes malloc'd by rooms and leases, %.0f bytes RSS "
           "(RSS includes the pools' page index, 16 bytes per page)\n",
           (double)(m2.uordblks - m1.uordblks) / open_rooms,
           (double)(rss2 - rss1) * 1024.0 / open_rooms);
    printf("  rss at the end: %ld KiB (start %ld KiB); rooms active %llu, completed %llu, "
           "aborted %llu\n",
           rss_kib(), rss0, (unsigned long long)s.rooms_by_state[KVF_CPS_ROOM_ACTIVE],
           (unsigned long long)s.rooms_by_state[KVF_CPS_ROOM_COMPLETED],
           (unsigned long long)s.rooms_by_state[KVF_CPS_ROOM_ABORTED]);
    kvf_cps_destroy(st);
    return 0;
}
