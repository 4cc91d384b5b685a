/*
 * test_pageset.c: the page-set encoder and decoders (common/kvf_pageset.c).
 *
 * Round trips against a reference (the sorted pages, coalesced into runs by
 * the plainest loop) for random sets of every density and order; the form
 * the encoder picks for the shapes engines send; the encoder's wire size
 * against protobuf-c's packed size of the same PageSet message; duplicates;
 * edge pages (0, 2^32-1); hostile encodings (truncated and overlong varints,
 * pages past 2^32-1, empty sets, run limits); random bytes into both
 * decoders.
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

#include "kvf_pageset.h"
#include "kvfence/v1/types.pb-c.h"

/* xorshift64*: the same sequence on every run, so a failure replays. */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The reference: sorted pages coalesced into runs. */
static size_t ref_runs(const uint32_t *pages, size_t n, struct kvf_page_run *out)
{
    uint32_t *s = malloc((n ? n : 1) * sizeof(*s));
    assert_non_null(s);
    memcpy(s, pages, n * sizeof(*s));
    qsort(s, n, sizeof(*s), cmp_u32);
    size_t r = 0;
    for (size_t i = 0; i < n; i++) {
        if (r > 0 && (uint64_t)out[r - 1].first + out[r - 1].count == s[i])
            out[r - 1].count++;
        else
            out[r++] = (struct kvf_page_run){s[i], 1};
    }
    free(s);
    return r;
}

/* Decodes an encoded set back to runs, whatever its form. */
static size_t decode_any(const struct kvf_pageset_enc *e, struct kvf_page_run **runs_p)
{
    struct kvf_error err;
    size_t n = 0;
    switch (e->form) {
    case KVF_PAGESET_RANGES:
        *runs_p = malloc(e->nruns * sizeof(**runs_p));
        assert_non_null(*runs_p);
        memcpy(*runs_p, e->runs, e->nruns * sizeof(**runs_p));
        return e->nruns;
    case KVF_PAGESET_BITMAP:
        assert_int_equal(kvf_pageset_decode_bitmap(e->bytes, e->nbytes, e->bitmap_first, SIZE_MAX,
                                                   "page_set.bitmap", runs_p, &n, &err),
                         0);
        return n;
    case KVF_PAGESET_DELTAS:
        assert_int_equal(kvf_pageset_decode_deltas(e->bytes, e->nbytes, SIZE_MAX, "page_set.deltas",
                                                   runs_p, &n, &err),
                         0);
        return n;
    default:
        *runs_p = NULL;
        return 0;
    }
}

/* protobuf-c's size of the PageSet that `e` describes. */
static size_t packed_size(const struct kvf_pageset_enc *e)
{
    Kvfence__V1__PageSet ps = KVFENCE__V1__PAGE_SET__INIT;
    Kvfence__V1__PageRange *rv = NULL, **rp = NULL;
    if (e->form == KVF_PAGESET_RANGES) {
        rv = calloc(e->nruns, sizeof(*rv));
        rp = calloc(e->nruns, sizeof(*rp));
        assert_non_null(rv);
        assert_non_null(rp);
        for (size_t i = 0; i < e->nruns; i++) {
            kvfence__v1__page_range__init(&rv[i]);
            rv[i].first = e->runs[i].first;
            rv[i].count = e->runs[i].count;
            rp[i] = &rv[i];
        }
        ps.n_ranges = e->nruns;
        ps.ranges = rp;
    } else if (e->form == KVF_PAGESET_BITMAP) {
        ps.bitmap.data = e->bytes;
        ps.bitmap.len = e->nbytes;
        ps.bitmap_first = e->bitmap_first;
    } else if (e->form == KVF_PAGESET_DELTAS) {
        ps.deltas.data = e->bytes;
        ps.deltas.len = e->nbytes;
    }
    size_t s = kvfence__v1__page_set__get_packed_size(&ps);
    free(rv);
    free(rp);
    return s;
}

/* Encodes, checks the size and the round trip, returns the form. */
static enum kvf_pageset_form round_trip(const uint32_t *pages, size_t n)
{
    struct kvf_pageset_enc e;
    struct kvf_error err;
    assert_int_equal(kvf_pageset_encode(pages, n, &e, &err), 0);
    assert_int_equal(e.pages, n);
    struct kvf_page_run *want = malloc((n ? n : 1) * sizeof(*want));
    assert_non_null(want);
    size_t nwant = ref_runs(pages, n, want);
    assert_int_equal(e.nruns, nwant);
    struct kvf_page_run *got = NULL;
    size_t ngot = decode_any(&e, &got);
    assert_int_equal(ngot, nwant);
    if (nwant > 0)
        assert_memory_equal(got, want, nwant * sizeof(*want));
    assert_int_equal(e.wire_size, packed_size(&e));
    enum kvf_pageset_form form = e.form;
    free(got);
    free(want);
    kvf_pageset_enc_free(&e);
    return form;
}

static void shuffle(uint32_t *v, size_t n, uint64_t *s)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(rng_next(s) % i);
        uint32_t t = v[i - 1];
        v[i - 1] = v[j];
        v[j] = t;
    }
}

/* ---- tests --------------------------------------------------------------------- */

static void test_shapes_pick_the_smallest_form(void **state)
{
    (void)state;
    enum { N = 32768 };
    uint32_t *v = malloc(1048576 * sizeof(*v));
    assert_non_null(v);
    /* Every other page: the bitmap (4 KiB) beats 32k one-page ranges. */
    for (uint32_t i = 0; i < N; i++)
        v[i] = 2 * i;
    assert_int_equal(round_trip(v, N), KVF_PAGESET_BITMAP);
    /* A sparse random scatter (gaps ~ 100): the deltas. */
    uint64_t s = 42;
    uint32_t pg = 0;
    for (uint32_t i = 0; i < N; i++) {
        pg += 1 + (uint32_t)(rng_next(&s) % 200);
        v[i] = pg;
    }
    assert_int_equal(round_trip(v, N), KVF_PAGESET_DELTAS);
    shuffle(v, N, &s); /* the same set in random order: the same form */
    assert_int_equal(round_trip(v, N), KVF_PAGESET_DELTAS);
    /* 1M pages in 4k-page runs with gaps: 256 ranges. */
    for (uint32_t i = 0; i < 1048576; i++)
        v[i] = (i / 4096) * 8192 + i % 4096;
    assert_int_equal(round_trip(v, 1048576), KVF_PAGESET_RANGES);
    /* One long run: one range. */
    for (uint32_t i = 0; i < 1048576; i++)
        v[i] = 1000 + i;
    assert_int_equal(round_trip(v, 1048576), KVF_PAGESET_RANGES);
    free(v);
}

static void test_random_round_trips(void **state)
{
    (void)state;
    uint64_t s = 7;
    uint32_t *v = malloc(20000 * sizeof(*v));
    uint8_t *seen = malloc(1u << 20);
    assert_non_null(v);
    assert_non_null(seen);
    for (int iter = 0; iter < 300; iter++) {
        size_t n = (size_t)(rng_next(&s) % 20000);
        uint32_t span = 1u << (1 + rng_next(&s) % 20); /* 2 .. 1M */
        if (n > span)
            n = span;
        uint32_t base =
            (uint32_t)(rng_next(&s) % 3 == 0 ? UINT32_MAX - span + 1 : rng_next(&s) % 100000);
        memset(seen, 0, span);
        size_t k = 0;
        bool runs = rng_next(&s) % 2;
        while (k < n) {
            uint32_t off = (uint32_t)(rng_next(&s) % span);
            uint32_t len = runs ? 1 + (uint32_t)(rng_next(&s) % 64) : 1;
            for (uint32_t j = 0; j < len && k < n && off + j < span; j++) {
                if (!seen[off + j]) {
                    seen[off + j] = 1;
                    v[k++] = base + off + j;
                }
            }
        }
        if (rng_next(&s) % 2)
            qsort(v, n, sizeof(*v), cmp_u32);
        else
            shuffle(v, n, &s);
        round_trip(v, n);
    }
    free(v);
    free(seen);
}

static void test_edges(void **state)
{
    (void)state;
    struct kvf_pageset_enc e;
    struct kvf_error err;
    assert_int_equal(kvf_pageset_encode(NULL, 0, &e, &err), 0);
    assert_int_equal(e.form, KVF_PAGESET_EMPTY);
    assert_int_equal(e.pages, 0);
    kvf_pageset_enc_free(&e);
    uint32_t one[] = {0};
    round_trip(one, 1);
    uint32_t top[] = {UINT32_MAX};
    round_trip(top, 1);
    uint32_t both[] = {UINT32_MAX, 0};
    round_trip(both, 2);
    uint32_t high[] = {UINT32_MAX - 2, UINT32_MAX, UINT32_MAX - 4};
    round_trip(high, 3);
}

static void test_duplicates_refused(void **state)
{
    (void)state;
    struct kvf_pageset_enc e;
    struct kvf_error err;
    uint32_t ascending[] = {1, 2, 2, 5};
    kvf_error_clear(&err);
    assert_int_equal(kvf_pageset_encode(ascending, 4, &e, &err), -EINVAL);
    assert_string_equal(err.msg, "pages[2]: page 2 is listed twice (also pages[1])");
    assert_int_equal(e.form, KVF_PAGESET_EMPTY);
    uint32_t unsorted[] = {9, 3, 7, 3, 1};
    assert_int_equal(kvf_pageset_encode(unsorted, 5, &e, &err), -EINVAL);
    assert_string_equal(err.msg, "pages[3]: page 3 is listed twice (also pages[1])");
    assert_null(e.runs);
    assert_null(e.bytes);
}

static void test_hostile_deltas(void **state)
{
    (void)state;
    struct kvf_page_run *runs = NULL;
    size_t n = 0;
    struct kvf_error err;
    const char *f = "page_set.deltas";
    assert_int_equal(kvf_pageset_decode_deltas((const uint8_t *)"", 0, 10, f, &runs, &n, &err),
                     -EINVAL);
    assert_string_equal(err.msg, "page_set.deltas: names no page (empty)");
    const uint8_t trunc[] = {0x05, 0x80};
    assert_int_equal(kvf_pageset_decode_deltas(trunc, 2, 10, f, &runs, &n, &err), -EINVAL);
    assert_string_equal(err.msg, "page_set.deltas: varint at byte 1 is truncated");
    const uint8_t six[] = {0x80, 0x80, 0x80, 0x80, 0x80, 0x01};
    assert_int_equal(kvf_pageset_decode_deltas(six, 6, 10, f, &runs, &n, &err), -EINVAL);
    assert_string_equal(err.msg,
                        "page_set.deltas: varint at byte 0 is over 2^32-1 or longer than 5 bytes");
    const uint8_t big[] = {0xff, 0xff, 0xff, 0xff, 0x1f};
    assert_int_equal(kvf_pageset_decode_deltas(big, 5, 10, f, &runs, &n, &err), -EINVAL);
    /* 2^32-1, then the next page would be 2^32. */
    const uint8_t wrap[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x00};
    assert_int_equal(kvf_pageset_decode_deltas(wrap, 6, 10, f, &runs, &n, &err), -EINVAL);
    assert_string_equal(err.msg,
                        "page_set.deltas: varint at byte 5 names page 4294967296, past 2^32-1");
    assert_int_equal(kvf_pageset_decode_deltas(wrap, 5, 10, f, &runs, &n, &err), 0);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].first, UINT32_MAX);
    free(runs);
    /* 0, 2, 4, ... 20: 11 runs; limit 10 refuses before storing anything. */
    uint8_t alt[11] = {0};
    memset(alt + 1, 1, 10);
    runs = NULL;
    assert_int_equal(kvf_pageset_decode_deltas(alt, 11, 10, f, &runs, &n, &err), -E2BIG);
    assert_string_equal(err.msg, "page_set.deltas: at least 11 runs of pages, limit 10");
    assert_null(runs);
    assert_int_equal(kvf_pageset_decode_deltas(alt, 11, 11, f, &runs, &n, &err), 0);
    assert_int_equal(n, 11);
    assert_int_equal(runs[10].first, 20);
    free(runs);
    /* Zero gaps coalesce: 5, 6, 7, 8. */
    const uint8_t run[] = {5, 0, 0, 0};
    assert_int_equal(kvf_pageset_decode_deltas(run, 4, 1, f, &runs, &n, &err), 0);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].first, 5);
    assert_int_equal(runs[0].count, 4);
    free(runs);
}

static void test_hostile_bitmap(void **state)
{
    (void)state;
    struct kvf_page_run *runs = NULL;
    size_t n = 0;
    struct kvf_error err;
    const char *f = "page_set.bitmap";
    assert_int_equal(kvf_pageset_decode_bitmap((const uint8_t *)"", 0, 0, 10, f, &runs, &n, &err),
                     -EINVAL);
    assert_string_equal(err.msg, "page_set.bitmap: names no page (no bit set)");
    const uint8_t zeros[64] = {0};
    assert_int_equal(kvf_pageset_decode_bitmap(zeros, 64, 0, 10, f, &runs, &n, &err), -EINVAL);
    const uint8_t ff = 0xff;
    assert_int_equal(kvf_pageset_decode_bitmap(&ff, 1, UINT32_MAX - 3, 10, f, &runs, &n, &err),
                     -EINVAL);
    assert_string_equal(err.msg, "page_set.bitmap: bit 7 from page 4294967292 is past page 2^32-1");
    /* Trailing zero bytes past 2^32 are harmless. */
    const uint8_t low[3] = {0x01, 0, 0};
    assert_int_equal(kvf_pageset_decode_bitmap(low, 3, UINT32_MAX, 10, f, &runs, &n, &err), 0);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].first, UINT32_MAX);
    free(runs);
    const uint8_t alt[3] = {0x55, 0x55, 0x05}; /* 10 runs */
    runs = NULL;
    assert_int_equal(kvf_pageset_decode_bitmap(alt, 3, 0, 9, f, &runs, &n, &err), -E2BIG);
    assert_string_equal(err.msg, "page_set.bitmap: at least 10 runs of pages, limit 9");
    assert_null(runs);
    /* Full bytes coalesce across byte borders: 0xf0 0xff 0x0f = pages 4..19. */
    const uint8_t mid[3] = {0xf0, 0xff, 0x0f};
    assert_int_equal(kvf_pageset_decode_bitmap(mid, 3, 100, 1, f, &runs, &n, &err), 0);
    assert_int_equal(n, 1);
    assert_int_equal(runs[0].first, 104);
    assert_int_equal(runs[0].count, 16);
    free(runs);
}

/* Random bytes: either refused or ascending, disjoint, non-empty runs. */
static void check_runs(const struct kvf_page_run *r, size_t n)
{
    assert_true(n > 0);
    for (size_t i = 0; i < n; i++) {
        assert_true(r[i].count > 0);
        assert_true((uint64_t)r[i].first + r[i].count <= (uint64_t)UINT32_MAX + 1);
        if (i > 0)
            assert_true((uint64_t)r[i - 1].first + r[i - 1].count < r[i].first);
    }
}

static void test_random_bytes(void **state)
{
    (void)state;
    uint64_t s = 99;
    uint8_t buf[256];
    int accepted = 0;
    for (int iter = 0; iter < 20000; iter++) {
        size_t len = (size_t)(rng_next(&s) % sizeof buf);
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)rng_next(&s);
        struct kvf_page_run *runs = NULL;
        size_t n = 0;
        struct kvf_error err;
        int rc = kvf_pageset_decode_deltas(buf, len, 64, "d", &runs, &n, &err);
        assert_true(rc == 0 || rc == -EINVAL || rc == -E2BIG);
        if (rc == 0) {
            check_runs(runs, n);
            accepted++;
        }
        free(runs);
        runs = NULL;
        uint32_t first = (uint32_t)rng_next(&s);
        rc = kvf_pageset_decode_bitmap(buf, len, first, 64, "b", &runs, &n, &err);
        assert_true(rc == 0 || rc == -EINVAL || rc == -E2BIG);
        if (rc == 0)
            check_runs(runs, n);
        free(runs);
    }
    assert_true(accepted > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shapes_pick_the_smallest_form),
        cmocka_unit_test(test_random_round_trips),
        cmocka_unit_test(test_edges),
        cmocka_unit_test(test_duplicates_refused),
        cmocka_unit_test(test_hostile_deltas),
        cmocka_unit_test(test_hostile_bitmap),
        cmocka_unit_test(test_random_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
