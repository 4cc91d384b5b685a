/*
 * bench_pageset_node.c: what a node pays, per chunk, to check that a chunk's
 * pages lie in a lease of scattered pages: node_ranges_cover (dataplane/node,
 * node_owner.c), called once per chunk range by the submit path and the
 * sink's frame checks. The lease is 32,768 one-page ranges (every other page,
 * as a RoomUpdate delivers a page-set lease); a chunk is k one-page ranges at
 * random pages of the lease. A benchmark, run by hand (bench/README.md).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_pageset.h"
#include "node_owner.h"
#include "node_types.h"

void bench_pageset_node_cover(unsigned reps)
{
    enum { LEASE = 32768 };
    struct node_range *lease = malloc(LEASE * sizeof(*lease));
    if (!lease)
        bench_die("node cover", "out of memory");
    for (uint32_t i = 0; i < LEASE; i++)
        lease[i] = (struct node_range){2 * i, 1};
    printf("\nnode: node_ranges_cover for a chunk of k one-page ranges against a lease of %d "
           "one-page ranges\n",
           LEASE);
    printf("%8s %14s %14s\n", "k", "us per chunk", "ns per range");
    unsigned ks[] = {1, 64, 1024};
    double *t = malloc(reps * sizeof(*t));
    for (size_t x = 0; x < 3; x++) {
        unsigned k = ks[x];
        uint32_t *pages = malloc(k * sizeof(*pages));
        volatile unsigned ok = 0;
        for (unsigned r = 0; r < reps; r++) {
            for (unsigned i = 0; i < k; i++)
                pages[i] = 2 * (uint32_t)(bench_rng_next() % LEASE);
            double t0 = bench_now_us();
            for (unsigned i = 0; i < k; i++)
                ok += node_ranges_cover(lease, LEASE, pages[i], 1);
            t[r] = bench_now_us() - t0;
        }
        if (ok != reps * k)
            bench_die("node cover", "a page of the lease was not covered");
        double m, p;
        bench_stats(t, reps, &m, &p);
        printf("%8u %7.0f (p99 %4.0f) %8.0f\n", k, m, p, m * 1000.0 / k);
        free(pages);
    }
    free(t);
    free(lease);
}
