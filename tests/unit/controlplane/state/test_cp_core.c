/*
 * test_cp_core.c: the two containers under the control-plane state core, the
 * hash map (cp_map.c) and the timer heap (cp_timer.c), checked against simple
 * reference models under long deterministic random sequences: every lookup
 * agrees with the model after every insert and delete (including backward-shift
 * deletion across wrap-around), and timers pop in (deadline, arming) order
 * whatever was moved or cancelled in between.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cp_state_internal.h"
#include "cp_test_util.h"

#define N_KEYS 512

static uint64_t next(uint64_t *s)
{
    uint64_t v;
    test_random(s, &v, sizeof(v));
    return v;
}

static void map_agrees_with_model_under_random_ops(void **state)
{
    (void)state;
    struct kvf_map m;
    cp_map_init(&m, false);
    static int vals[N_KEYS];
    bool present[N_KEYS] = {false};
    size_t count = 0;
    uint64_t rng = 7;
    for (int step = 0; step < 200000; step++) {
        uint64_t k = next(&rng) % N_KEYS;
        /* Keys that collide in the low bits exercise probing. */
        uint64_t key = k << 40;
        if (next(&rng) % 3 != 0) {
            assert_int_equal(cp_map_put(&m, key, &vals[k]), 0);
            if (!present[k])
                count++;
            present[k] = true;
        } else {
            void *v = cp_map_del(&m, key);
            assert_true(v == (present[k] ? &vals[k] : NULL));
            if (present[k])
                count--;
            present[k] = false;
        }
        if (step % 997 == 0) {
            for (uint64_t j = 0; j < N_KEYS; j++)
                assert_true(cp_map_get(&m, j << 40) == (present[j] ? &vals[j] : NULL));
        }
        assert_int_equal(m.count, count);
    }
    size_t pos = 0, seen = 0;
    while (cp_map_next(&m, &pos) != NULL)
        seen++;
    assert_int_equal(seen, count);
    cp_map_fini(&m);
}

static void string_map_finds_each_key(void **state)
{
    (void)state;
    struct kvf_map m;
    cp_map_init(&m, true);
    static char keys[300][16];
    for (int i = 0; i < 300; i++) {
        snprintf(keys[i], sizeof(keys[i]), "node-%d", i);
        assert_int_equal(cp_map_put_str(&m, keys[i], keys[i]), 0);
    }
    for (int i = 0; i < 300; i += 2)
        assert_ptr_equal(cp_map_del_str(&m, keys[i]), keys[i]);
    for (int i = 0; i < 300; i++) {
        char probe[16];
        snprintf(probe, sizeof(probe), "node-%d", i);
        assert_true(cp_map_get_str(&m, probe) == (i % 2 ? keys[i] : NULL));
    }
    cp_map_fini(&m);
}

static void heap_pops_in_deadline_then_arming_order(void **state)
{
    (void)state;
    struct cp_heap h;
    cp_heap_init(&h);
    static struct cp_timer t[400];
    for (int i = 0; i < 400; i++)
        cp_timer_init(&t[i], CP_TIMER_ROOM);
    uint64_t rng = 11;
    for (int round = 0; round < 200; round++) {
        for (int op = 0; op < 400; op++) {
            struct cp_timer *x = &t[next(&rng) % 400];
            if (next(&rng) % 4 == 0)
                cp_heap_cancel(&h, x);
            else
                assert_int_equal(cp_heap_arm(&h, x, next(&rng) % 50), 0);
        }
        kvf_time_ns last_when = 0;
        uint64_t last_seq = 0;
        uint32_t armed = 0;
        for (int i = 0; i < 400; i++)
            armed += cp_timer_armed(&t[i]);
        assert_int_equal(armed, h.n);
        struct cp_timer *top;
        while ((top = cp_heap_top(&h)) != NULL) {
            assert_true(top->when > last_when || (top->when == last_when && top->seq > last_seq));
            last_when = top->when;
            last_seq = top->seq;
            cp_heap_cancel(&h, top);
            assert_false(cp_timer_armed(top));
        }
    }
    cp_heap_fini(&h);
}

static void per_room_memory_is_small(void **state)
{
    (void)state;
    /* A 2-participant room on 2 nodes: the room, 2 participants, 2 room-nodes,
     * 2 pointer arrays of 2, a range each, map slots for room and 2 leases.
     * malloc adds up to 16 bytes per block. */
    size_t bytes = sizeof(struct cp_room) + 2 * sizeof(struct cp_part) +
                   2 * sizeof(struct cp_rnode) + 4 * sizeof(void *) +
                   2 * sizeof(struct kvf_cps_page_range) + 3 * 2 * sizeof(struct kvf_map_slot) +
                   9 * 16;
    print_message("bytes per 2-participant room: %zu\n", bytes);
    assert_true(bytes < 1024);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(map_agrees_with_model_under_random_ops),
        cmocka_unit_test(string_map_finds_each_key),
        cmocka_unit_test(heap_pops_in_deadline_then_arming_order),
        cmocka_unit_test(per_room_memory_is_small),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
