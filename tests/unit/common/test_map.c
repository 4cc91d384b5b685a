/*
 * test_map.c: kvf_map against a naive reference (an array searched linearly)
 * under long random sequences of put/get/del for each key kind, plus the
 * bounds, the allocation failures and iteration.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvf_map.h"

/* xorshift64*: the same sequence on every run, so a failure replays. */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

/* ---- the reference -------------------------------------------------------- */

#define REF_MAX 4096

struct ref_entry {
    kvf_room_key key; /* U64: room_id only; STR: index into a name table */
    void *val;
};

struct ref {
    struct ref_entry e[REF_MAX];
    size_t n;
};

static struct ref_entry *ref_find(struct ref *r, kvf_room_key key)
{
    for (size_t i = 0; i < r->n; i++)
        if (kvf_room_key_eq(r->e[i].key, key))
            return &r->e[i];
    return NULL;
}

/* ---- one random run for a kind -------------------------------------------- */

static char names[REF_MAX][24];

static int do_put(struct kvf_map *m, enum kvf_map_kind kind, kvf_room_key k, void *v)
{
    switch (kind) {
    case KVF_MAP_U64:
        return kvf_map_put_u64(m, k.room_id, v);
    case KVF_MAP_ROOM:
        return kvf_map_put_room(m, k, v);
    case KVF_MAP_STR:
        return kvf_map_put_str(m, names[k.room_id], v);
    }
    return -EINVAL;
}

static void *do_get(const struct kvf_map *m, enum kvf_map_kind kind, kvf_room_key k)
{
    switch (kind) {
    case KVF_MAP_U64:
        return kvf_map_get_u64(m, k.room_id);
    case KVF_MAP_ROOM:
        return kvf_map_get_room(m, k);
    case KVF_MAP_STR:
        return kvf_map_get_str(m, names[k.room_id]);
    }
    return NULL;
}

static void *do_del(struct kvf_map *m, enum kvf_map_kind kind, kvf_room_key k)
{
    switch (kind) {
    case KVF_MAP_U64:
        return kvf_map_del_u64(m, k.room_id);
    case KVF_MAP_ROOM:
        return kvf_map_del_room(m, k);
    case KVF_MAP_STR:
        return kvf_map_del_str(m, names[k.room_id]);
    }
    return NULL;
}

/* A key from a small space, so that puts hit existing keys and deletes find
 * something. ROOM keys share ids across generations (a room reused); U64 keys
 * are multiples of 1024 half the time (the same low bits). */
static kvf_room_key random_key(uint64_t *s, enum kvf_map_kind kind, uint64_t space)
{
    uint64_t x = rng_next(s) % space;
    kvf_room_key k = {0, 0};
    switch (kind) {
    case KVF_MAP_U64:
        k.room_id = (x & 1) ? (x << 10) : x;
        break;
    case KVF_MAP_ROOM:
        k.room_id = x / 4;
        k.generation = 1 + x % 4;
        break;
    case KVF_MAP_STR:
        k.room_id = x; /* names[x] */
        break;
    }
    return k;
}

static void check_all(struct kvf_map *m, enum kvf_map_kind kind, struct ref *r)
{
    assert_int_equal(kvf_map_count(m), r->n);
    for (size_t i = 0; i < r->n; i++)
        assert_ptr_equal(do_get(m, kind, r->e[i].key), r->e[i].val);
    /* Iteration visits every value exactly once. */
    size_t pos = 0, seen = 0;
    void *v;
    while ((v = kvf_map_next(m, &pos)) != NULL) {
        bool found = false;
        for (size_t i = 0; i < r->n; i++)
            found |= r->e[i].val == v;
        assert_true(found);
        seen++;
    }
    assert_int_equal(seen, r->n);
}

static void random_run(enum kvf_map_kind kind, uint64_t seed, uint64_t space, int steps)
{
    static struct ref r;
    static int tokens[1 << 16]; /* values are addresses in here */
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, kind);
    struct kvf_map m;
    kvf_map_init(&m, &opts);
    memset(&r, 0, sizeof r);
    uint64_t s = seed;

    for (int step = 0; step < steps; step++) {
        kvf_room_key k = random_key(&s, kind, space);
        struct ref_entry *e = ref_find(&r, k);
        uint64_t op = rng_next(&s) % 10;
        if (op < 5) {
            void *v = &tokens[rng_next(&s) % (sizeof tokens / sizeof tokens[0])];
            assert_int_equal(do_put(&m, kind, k, v), 0);
            if (e != NULL) {
                e->val = v;
            } else {
                assert_true(r.n < REF_MAX);
                r.e[r.n++] = (struct ref_entry){.key = k, .val = v};
            }
        } else if (op < 8) {
            void *got = do_del(&m, kind, k);
            assert_ptr_equal(got, e != NULL ? e->val : NULL);
            if (e != NULL)
                *e = r.e[--r.n];
        } else {
            assert_ptr_equal(do_get(&m, kind, k), e != NULL ? e->val : NULL);
        }
        if (step % 997 == 0)
            check_all(&m, kind, &r);
    }
    check_all(&m, kind, &r);
    /* Empty it by removal: every key comes out once, then the map is empty. */
    while (r.n > 0) {
        struct ref_entry e = r.e[--r.n];
        assert_ptr_equal(do_del(&m, kind, e.key), e.val);
        assert_null(do_get(&m, kind, e.key));
    }
    assert_int_equal(kvf_map_count(&m), 0);
    size_t pos = 0;
    assert_null(kvf_map_next(&m, &pos));
    kvf_map_fini(&m);
}

static void u64_map_matches_reference(void **state)
{
    (void)state;
    random_run(KVF_MAP_U64, 0x1234567ull, 64, 20000);    /* small, dense */
    random_run(KVF_MAP_U64, 0xfeedfaceull, 3000, 60000); /* grows to thousands */
}

static void room_map_matches_reference(void **state)
{
    (void)state;
    random_run(KVF_MAP_ROOM, 0xabcdefull, 64, 20000);
    random_run(KVF_MAP_ROOM, 0x5eed5ull, 3000, 60000);
}

static void str_map_matches_reference(void **state)
{
    (void)state;
    for (int i = 0; i < REF_MAX; i++)
        snprintf(names[i], sizeof names[i], "node-%d", i);
    random_run(KVF_MAP_STR, 0x77ull, 64, 20000);
    random_run(KVF_MAP_STR, 0x99ull, 3000, 60000);
}

/* Room keys that differ only in generation are different keys. */
static void room_generations_are_distinct(void **state)
{
    (void)state;
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, KVF_MAP_ROOM);
    struct kvf_map m;
    kvf_map_init(&m, &opts);
    int a, b;
    assert_int_equal(kvf_map_put_room(&m, (kvf_room_key){7, 1}, &a), 0);
    assert_int_equal(kvf_map_put_room(&m, (kvf_room_key){7, 2}, &b), 0);
    assert_int_equal(kvf_map_count(&m), 2);
    assert_ptr_equal(kvf_map_get_room(&m, (kvf_room_key){7, 1}), &a);
    assert_ptr_equal(kvf_map_get_room(&m, (kvf_room_key){7, 2}), &b);
    assert_null(kvf_map_get_room(&m, (kvf_room_key){7, 3}));
    assert_ptr_equal(kvf_map_del_room(&m, (kvf_room_key){7, 1}), &a);
    assert_ptr_equal(kvf_map_get_room(&m, (kvf_room_key){7, 2}), &b);
    kvf_map_fini(&m);
}

static void bad_arguments_are_refused(void **state)
{
    (void)state;
    struct kvf_map m;
    kvf_map_init(&m, NULL); /* U64 */
    int a;
    assert_int_equal(kvf_map_put_u64(&m, 1, NULL), -EINVAL);
    assert_int_equal(kvf_map_put_room(&m, (kvf_room_key){1, 1}, &a), -EINVAL);
    assert_int_equal(kvf_map_put_str(&m, "x", &a), -EINVAL);
    assert_int_equal(kvf_map_count(&m), 0);
    assert_int_equal(kvf_map_put_u64(&m, 1, &a), 0);
    assert_null(kvf_map_get_str(&m, "x"));
    assert_null(kvf_map_del_room(&m, (kvf_room_key){1, 0}));
    assert_int_equal(kvf_map_count(&m), 1);
    kvf_map_fini(&m);

    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, KVF_MAP_STR);
    kvf_map_init(&m, &opts);
    assert_int_equal(kvf_map_put_str(&m, NULL, &a), -EINVAL);
    assert_null(kvf_map_get_str(&m, NULL));
    kvf_map_fini(&m);
}

static void max_count_bounds_growth(void **state)
{
    (void)state;
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, KVF_MAP_U64);
    opts.max_count = 100;
    struct kvf_map m;
    kvf_map_init(&m, &opts);
    int v[101];
    for (uint64_t i = 0; i < 100; i++)
        assert_int_equal(kvf_map_put_u64(&m, i, &v[i]), 0);
    size_t cap = m.cap;
    assert_int_equal(kvf_map_put_u64(&m, 100, &v[100]), -E2BIG);
    assert_null(kvf_map_get_u64(&m, 100));
    assert_int_equal(kvf_map_count(&m), 100);
    assert_int_equal(m.cap, cap);
    assert_true(m.cap <= 256); /* 100 entries at most 3/4 full: 256 slots */
    /* Replacing an existing key is not growth. */
    assert_int_equal(kvf_map_put_u64(&m, 5, &v[100]), 0);
    assert_ptr_equal(kvf_map_get_u64(&m, 5), &v[100]);
    assert_int_equal(kvf_map_reserve(&m, 1), -E2BIG);
    /* After a removal there is room again. */
    assert_ptr_equal(kvf_map_del_u64(&m, 7), &v[7]);
    assert_int_equal(kvf_map_put_u64(&m, 100, &v[100]), 0);
    kvf_map_fini(&m);
}

/* Fails every allocation from the Nth on. */
static int alloc_left;

static void *failing_calloc(size_t nmemb, size_t size)
{
    if (alloc_left <= 0)
        return NULL;
    alloc_left--;
    return calloc(nmemb, size);
}

static void failed_growth_leaves_the_map_unchanged(void **state)
{
    (void)state;
    static int v[1000];
    for (int budget = 0; budget < 8; budget++) {
        struct kvf_map_opts opts;
        kvf_map_opts_init(&opts, KVF_MAP_U64);
        opts.alloc = failing_calloc;
        struct kvf_map m;
        kvf_map_init(&m, &opts);
        alloc_left = budget;
        size_t stored = 0;
        for (uint64_t i = 0; i < 1000; i++) {
            int rc = kvf_map_put_u64(&m, i, &v[i]);
            if (rc == -ENOMEM)
                break;
            assert_int_equal(rc, 0);
            stored++;
        }
        /* 16 slots hold 12, each doubling holds twice as many. */
        size_t expect = budget == 0 ? 0 : (size_t)12 << (budget - 1);
        if (expect > 1000)
            expect = 1000;
        assert_int_equal(stored, expect);
        assert_int_equal(kvf_map_count(&m), stored);
        for (uint64_t i = 0; i < stored; i++)
            assert_ptr_equal(kvf_map_get_u64(&m, i), &v[i]);
        assert_null(kvf_map_get_u64(&m, stored));
        /* Removal never allocates. */
        if (stored > 0)
            assert_ptr_equal(kvf_map_del_u64(&m, 0), &v[0]);
        /* With memory again, the put that failed goes through. */
        alloc_left = 100;
        assert_int_equal(kvf_map_put_u64(&m, stored, &v[stored % 1000]), 0);
        kvf_map_fini(&m);
    }
}

static void reserve_makes_puts_infallible(void **state)
{
    (void)state;
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, KVF_MAP_ROOM);
    opts.alloc = failing_calloc;
    struct kvf_map m;
    kvf_map_init(&m, &opts);
    alloc_left = 1;
    assert_int_equal(kvf_map_reserve(&m, 500), 0);
    /* 500 need 1024 slots, which hold 768 at 3/4: those puts allocate nothing. */
    static int v[768];
    for (uint64_t i = 0; i < 768; i++)
        assert_int_equal(kvf_map_put_room(&m, (kvf_room_key){i, i + 1}, &v[i]), 0);
    assert_int_equal(kvf_map_put_room(&m, (kvf_room_key){999, 1}, &v[0]), -ENOMEM);
    assert_int_equal(kvf_map_count(&m), 768);
    assert_null(kvf_map_get_room(&m, (kvf_room_key){999, 1}));
    kvf_map_fini(&m);
    kvf_map_fini(&m); /* fini twice is harmless */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(u64_map_matches_reference),
        cmocka_unit_test(room_map_matches_reference),
        cmocka_unit_test(str_map_matches_reference),
        cmocka_unit_test(room_generations_are_distinct),
        cmocka_unit_test(bad_arguments_are_refused),
        cmocka_unit_test(max_count_bounds_growth),
        cmocka_unit_test(failed_growth_leaves_the_map_unchanged),
        cmocka_unit_test(reserve_makes_puts_infallible),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
