/*
 * bench_pageset.h: the in-process half of bench_pageset (bench_pageset_core.c:
 * the state core and the RoomUpdate), kept in its own translation unit
 * because the state core's headers and libkvfence's public header both
 * define struct kvf_room_key.
 */
#ifndef KVF_BENCH_PAGESET_H
#define KVF_BENCH_PAGESET_H

#include <stddef.h>
#include <stdint.h>

#define BENCH_POOL_ID    2u
#define BENCH_POOL_PAGES (1u << 21)

/* kvf_cps_join of each shape's runs next to one-range joins; prints a table. */
void bench_pageset_core(const uint32_t *const *pages, const size_t *counts,
                        const char *const *names, size_t nshapes, unsigned reps);
/* Size, pack and unpack of a RoomUpdate with 1, 32768 and 65536 ranges. */
void bench_pageset_room_update(unsigned reps);

/* node_ranges_cover (dataplane/node) for chunks against a 32k-range lease
 * (bench_pageset_node.c). */
void bench_pageset_node_cover(unsigned reps);

/* Shared helpers (bench_pageset.c). */
double bench_now_us(void);
void bench_stats(double *v, size_t n, double *med_p, double *p99_p);
void bench_die(const char *what, const char *why) __attribute__((noreturn));
uint64_t bench_rng_next(void);

#endif /* KVF_BENCH_PAGESET_H */
