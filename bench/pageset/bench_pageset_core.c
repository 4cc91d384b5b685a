/*
 * bench_pageset_core.c: the in-process half of bench_pageset (bench_pageset.h):
 * what kvfence-control's state core pays for a lease of scattered pages (the
 * page index, the disjointness check, the lease's copy of its runs), and the
 * RoomUpdate that carries such a lease to the nodes (types.proto Lease keeps
 * ranges). A benchmark, run by hand (bench/README.md).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_pageset.h"
#include "cp_state.h"
#include "kvf_pageset.h"
#include "kvfence/v1/node.pb-c.h"

#define POOL_ID    BENCH_POOL_ID
#define POOL_PAGES BENCH_POOL_PAGES
#define SET_PAGES  32768u

static void bench_random(void *ctx, void *buf, size_t len)
{
    (void)ctx;
    for (size_t i = 0; i < len; i++)
        ((unsigned char *)buf)[i] = (unsigned char)bench_rng_next();
}

/* ---- the state core --------------------------------------------------------------- */

static void drain(struct kvf_cps *st)
{
    size_t n;
    kvf_cps_effects_take(st, &n);
}

void bench_pageset_core(const uint32_t *const *pages, const size_t *counts,
                        const char *const *names, size_t nshapes, unsigned reps)
{
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.random_fn = bench_random;
    struct kvf_cps *st = kvf_cps_create(&o);
    if (!st)
        bench_die("kvf_cps_create", "failed");
    struct kvf_cps_pool pool = {.pool_id = POOL_ID, .page_size = 4096, .page_count = POOL_PAGES};
    struct kvf_cps_node_hello h = {.node_id = "n",
                                   .incarnation = 1,
                                   .protocol_min = KVF_PROTOCOL_MIN,
                                   .protocol_max = KVF_PROTOCOL_MAX,
                                   .features = KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_TCP,
                                   .pools = &pool,
                                   .pool_count = 1};
    struct kvf_error err;
    uint32_t version;
    kvf_time_ns now = KVF_NS_PER_S;
    if (kvf_cps_node_attach(st, &h, now, &version, &err) != 0)
        bench_die("attach", err.msg);
    drain(st);
    printf("\nstate thread: the request's runs decoded (or copied) into a fresh array, then "
           "kvf_cps_join adopting it (sink lease, pool of %u pages; each join then aborted and "
           "drained, untimed)\n",
           POOL_PAGES);
    printf("%-26s %8s %16s %12s\n", "shape", "runs", "decode/copy us", "join us");
    double *t = malloc(reps * sizeof(*t)), *td = malloc(reps * sizeof(*td));
    static uint64_t room_id = 1;
    for (int s = -2; s < (int)nshapes; s++) {
        struct kvf_pageset_enc e = {0};
        if (s >= 0 && kvf_pageset_encode(pages[s], counts[s], &e, NULL) != 0)
            bench_die("encode", "failed");
        size_t nruns = s < 0 ? 1 : e.nruns;
        for (unsigned r = 0; r < reps; r++) {
            /* What the service does on the state thread: decode (or copy the
             * ranges) into a fresh array, which the join adopts. */
            double t0 = bench_now_us();
            struct kvf_page_run *runs = NULL;
            size_t n = 0;
            if (s < 0 || e.form == KVF_PAGESET_RANGES) {
                n = nruns;
                runs = malloc(n * sizeof(*runs));
                if (!runs)
                    bench_die("copy", "out of memory");
                if (s < 0)
                    runs[0] = (struct kvf_page_run){0, s == -2 ? 16 : SET_PAGES};
                else
                    memcpy(runs, e.runs, n * sizeof(*runs));
            } else if (e.form == KVF_PAGESET_BITMAP) {
                kvf_pageset_decode_bitmap(e.bytes, e.nbytes, e.bitmap_first, SIZE_MAX, "b", &runs,
                                          &n, NULL);
            } else {
                kvf_pageset_decode_deltas(e.bytes, e.nbytes, SIZE_MAX, "d", &runs, &n, NULL);
            }
            double t1 = bench_now_us();
            struct kvf_cps_page_range *v = (struct kvf_cps_page_range *)(void *)runs;
            struct kvf_cps_join j = {.room_id = room_id++,
                                     .expected_sources = 1,
                                     .expected_sinks = 1,
                                     .node_id = "n",
                                     .role = KVF_CPS_ROLE_SINK,
                                     .engine_protocol_min = KVF_PROTOCOL_MIN,
                                     .engine_protocol_max = KVF_PROTOCOL_MAX,
                                     .engine_features = KVF_FEATURE_QUIESCE_V1,
                                     .pool_id = POOL_ID,
                                     .ranges = v,
                                     .range_count = n,
                                     .pages_field = "page_set.deltas",
                                     .ranges_adopt_p = &v};
            struct kvf_cps_join_result res;
            if (kvf_cps_join(st, &j, now, &res, &err) != 0)
                bench_die("kvf_cps_join", err.msg);
            t[r] = bench_now_us() - t1;
            td[r] = t1 - t0;
            free(v); /* NULL: adopted */
            kvf_token tok;
            if (kvf_cps_room_abort(st, res.key, KVF_CPS_ABORT_ENGINE, now, &tok, &err) != 0 ||
                kvf_cps_report_drained(st, "n", 1, res.key, tok, now, &err) != 0)
                bench_die("abort", err.msg);
            drain(st);
        }
        double m, p, dm, dp;
        bench_stats(t, reps, &m, &p);
        bench_stats(td, reps, &dm, &dp);
        printf("%-26s %8zu %5.0f (p99 %4.0f) %5.0f (p99 %4.0f)\n",
               s == -2   ? "1 range of 16 pages"
               : s == -1 ? "1 range of 32768 pages"
                         : names[s],
               nruns, dm, dp, m, p);
        kvf_pageset_enc_free(&e);
    }
    free(td);
    free(t);
    kvf_cps_destroy(st);
}

/* ---- the RoomUpdate a node receives -------------------------------------------------- */

void bench_pageset_room_update(unsigned reps)
{
    printf("\nRoomUpdate to a node: one member whose lease has N one-page ranges\n");
    printf("%8s %10s %10s %12s\n", "ranges", "bytes", "pack us", "unpack us");
    size_t sizes[] = {1, SET_PAGES, 65536};
    double *tp = malloc(reps * sizeof(*tp)), *tu = malloc(reps * sizeof(*tu));
    for (size_t k = 0; k < 3; k++) {
        size_t n = sizes[k];
        Kvfence__V1__PageRange *rv = calloc(n, sizeof(*rv));
        Kvfence__V1__PageRange **rp = calloc(n, sizeof(*rp));
        for (size_t i = 0; i < n; i++) {
            kvfence__v1__page_range__init(&rv[i]);
            rv[i].first = (uint32_t)(2 * i + 1000000);
            rv[i].count = 1;
            rp[i] = &rv[i];
        }
        Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
        key.room_id = 1;
        key.generation = 1;
        Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
        part.node_id = "decode-0";
        part.role = KVFENCE__V1__ROLE__ROLE_SINK;
        Kvfence__V1__Lease lease = KVFENCE__V1__LEASE__INIT;
        lease.lease_id = 7;
        lease.room = &key;
        lease.participant = &part;
        lease.pool_id = POOL_ID;
        lease.n_ranges = n;
        lease.ranges = rp;
        Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT;
        pool.pool_id = POOL_ID;
        pool.page_size = 4096;
        pool.page_count = POOL_PAGES;
        Kvfence__V1__RoomMember mem = KVFENCE__V1__ROOM_MEMBER__INIT, *mp = &mem;
        mem.lease = &lease;
        mem.pool = &pool;
        Kvfence__V1__RoomUpdate ru = KVFENCE__V1__ROOM_UPDATE__INIT;
        ru.room = &key;
        ru.n_members = 1;
        ru.members = &mp;
        size_t len = kvfence__v1__room_update__get_packed_size(&ru);
        uint8_t *buf = malloc(len);
        for (unsigned r = 0; r < reps; r++) {
            double t0 = bench_now_us();
            kvfence__v1__room_update__pack(&ru, buf);
            tp[r] = bench_now_us() - t0;
            t0 = bench_now_us();
            Kvfence__V1__RoomUpdate *u = kvfence__v1__room_update__unpack(NULL, len, buf);
            /* what the node does with it (dataplane/node/node.c on_room_update) */
            struct {
                uint32_t first, count;
            } *copy = calloc(n, sizeof(*copy));
            for (size_t i = 0; u && copy && i < u->members[0]->lease->n_ranges; i++) {
                copy[i].first = u->members[0]->lease->ranges[i]->first;
                copy[i].count = u->members[0]->lease->ranges[i]->count;
            }
            tu[r] = bench_now_us() - t0;
            free(copy);
            if (!u)
                bench_die("unpack", "failed");
            kvfence__v1__room_update__free_unpacked(u, NULL);
        }
        double pm, pp, um, up;
        bench_stats(tp, reps, &pm, &pp);
        bench_stats(tu, reps, &um, &up);
        printf("%8zu %10zu %5.0f (p99 %4.0f) %5.0f (p99 %4.0f)\n", n, len, pm, pp, um, up);
        free(buf);
        free(rv);
        free(rp);
    }
    free(tp);
    free(tu);
}
