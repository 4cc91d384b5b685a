/*
 * bench_lifetime.c: cost of lifetime accounting (docs/design.md §8: under 50 ns per
 * op admitted and retired on one thread, and no lock shared between rooms).
 *
 * Three runs, each timed with CLOCK_MONOTONIC around a loop of admit + retire:
 *   1. one thread, one room;
 *   2. two threads, each on its own room: if rooms shared a lock or a cache
 *      line, this would be much slower per op than run 1;
 *   3. two threads on the same room, for contrast (they share the room's word).
 * Usage: bench_lifetime [ops per thread, default 20000000]
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "lifetime.h"
#include "kvf_clock.h"

struct worker {
    struct kvf_lt *lt;
    uint64_t ops;
    uint32_t peer;
    double ns;
    uint64_t failures;
};

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

static void *run_worker(void *arg)
{
    struct worker *w = arg;
    struct kvf_lt_op op;
    uint64_t failures = 0;
    uint64_t start = now_ns();
    for (uint64_t i = 0; i < w->ops; i++) {
        if (kvf_lt_admit(w->lt, &op, (enum kvf_lt_op_kind)(i & 3), w->peer) != 0) {
            failures++;
            continue;
        }
        if (kvf_lt_op_retire(&op, KVF_LT_DONE_OK))
            failures++; /* an open room never drains */
    }
    w->ns = (double)(now_ns() - start);
    w->failures = failures;
    return NULL;
}

/* Runs `n` workers at once and returns the mean ns per op over all of them. */
static int run_parallel(struct worker *w, int n)
{
    pthread_t th[2];
    for (int i = 0; i < n; i++) {
        if (pthread_create(&th[i], NULL, run_worker, &w[i]) != 0) {
            fprintf(stderr, "bench_lifetime: pthread_create failed\n");
            return -1;
        }
    }
    for (int i = 0; i < n; i++)
        pthread_join(th[i], NULL);
    return 0;
}

static kvf_room_key key(uint64_t room_id, uint64_t generation)
{
    kvf_room_key k = {.room_id = room_id, .generation = generation};
    return k;
}

int main(int argc, char **argv)
{
    uint64_t ops = argc > 1 ? strtoull(argv[1], NULL, 10) : 20000000ull;
    if (ops == 0)
        ops = 1;
    struct kvf_lt_table *t = kvf_lt_table_create();
    struct kvf_lt *a, *b;
    if (t == NULL || kvf_lt_table_open(t, key(1, 1), &a) != 0 ||
        kvf_lt_table_open(t, key(2, 2), &b) != 0) {
        fprintf(stderr, "bench_lifetime: setup failed\n");
        return 1;
    }

    /* Warm up. */
    struct worker warm = {.lt = a, .ops = ops / 10 + 1};
    run_worker(&warm);

    struct worker one = {.lt = a, .ops = ops};
    run_worker(&one);
    double one_ns = one.ns / (double)ops;

    struct worker own[2] = {{.lt = a, .ops = ops, .peer = 1}, {.lt = b, .ops = ops, .peer = 2}};
    if (run_parallel(own, 2) != 0)
        return 1;
    struct worker same[2] = {{.lt = a, .ops = ops, .peer = 1}, {.lt = a, .ops = ops, .peer = 2}};
    if (run_parallel(same, 2) != 0)
        return 1;

    uint64_t failures =
        one.failures + own[0].failures + own[1].failures + same[0].failures + same[1].failures;
    printf("lifetime accounting: admit + retire, %llu ops per thread\n", (unsigned long long)ops);
    printf("  1 thread,  1 room          : %6.1f ns/op   (target < 50 ns)  %s\n", one_ns,
           one_ns < 50.0 ? "ok" : "OVER TARGET");
    printf("  2 threads, own room each   : %6.1f / %6.1f ns/op per thread\n",
           own[0].ns / (double)ops, own[1].ns / (double)ops);
    printf("  2 threads, same room       : %6.1f / %6.1f ns/op per thread (shared word, for "
           "contrast)\n",
           same[0].ns / (double)ops, same[1].ns / (double)ops);
    printf("  rooms share no lock: own-room threads should stay near the 1-thread figure;\n"
           "  the same-room run shows what sharing one cache line costs.\n");
    printf("  in flight after runs: %llu, %llu; failures: %llu\n",
           (unsigned long long)kvf_lt_inflight(a), (unsigned long long)kvf_lt_inflight(b),
           (unsigned long long)failures);

    kvf_lt_close(a);
    kvf_lt_close(b);
    kvf_lt_table_destroy(t);
    return failures == 0 ? 0 : 1;
}
