/*
 * kvf_pageset.c: the page-set encoder and decoders (kvf_pageset.h).
 *
 * The encoder makes three linear passes over the (sorted) pages: one to find
 * the runs and the size of every form, one to write the form it keeps; a
 * radix sort (two to four byte passes) comes first when the input is not
 * ascending. 32,768 pages encode in well under a millisecond (bench/pageset).
 *
 * The decoders make one pass each (the bitmap a 64-bit word at a time), into
 * an array sized from the encoding and capped at the run limit (below).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_pageset.h"

/* PageSet field tags (types.proto): each one byte on the wire. */
#define TAG_BYTES 1u

static size_t varint_size(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static size_t range_wire_size(uint32_t first, uint32_t count)
{
    size_t body = (first ? TAG_BYTES + varint_size(first) : 0) + TAG_BYTES + varint_size(count);
    return TAG_BYTES + varint_size(body) + body;
}

size_t kvf_pageset_ranges_wire_size(const struct kvf_page_run *runs, size_t nruns)
{
    size_t s = 0;
    for (size_t i = 0; i < nruns; i++)
        s += range_wire_size(runs[i].first, runs[i].count);
    return s;
}

/* ---- encoding ------------------------------------------------------------------ */

/* LSD radix sort of `a` (n values), one pass per byte that the largest value
 * needs. */
static int radix_sort(uint32_t *a, size_t n)
{
    uint32_t *tmp = malloc(n * sizeof(*tmp));
    if (tmp == NULL)
        return -ENOMEM;
    uint32_t max = 0;
    for (size_t i = 0; i < n; i++)
        max = a[i] > max ? a[i] : max;
    uint32_t *src = a, *dst = tmp;
    for (unsigned shift = 0; shift < 32 && (shift == 0 || (max >> shift) != 0); shift += 8) {
        size_t count[256] = {0};
        for (size_t i = 0; i < n; i++)
            count[(src[i] >> shift) & 0xff]++;
        size_t pos = 0;
        for (unsigned b = 0; b < 256; b++) {
            size_t c = count[b];
            count[b] = pos;
            pos += c;
        }
        for (size_t i = 0; i < n; i++)
            dst[count[(src[i] >> shift) & 0xff]++] = src[i];
        uint32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, n * sizeof(*a));
    free(tmp);
    return 0;
}

static int duplicate(const uint32_t *pages, size_t n, uint32_t page, struct kvf_error *err)
{
    size_t first = SIZE_MAX, second = SIZE_MAX;
    for (size_t i = 0; i < n && second == SIZE_MAX; i++) {
        if (pages[i] != page)
            continue;
        if (first == SIZE_MAX)
            first = i;
        else
            second = i;
    }
    return kvf_error_set(err, -EINVAL,
                         "pages[%zu]: page %" PRIu32 " is listed twice (also pages[%zu])", second,
                         page, first);
}

static uint8_t *put_varint(uint8_t *o, uint32_t v)
{
    while (v >= 0x80) {
        *o++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *o++ = (uint8_t)v;
    return o;
}

static int encode_sorted(const uint32_t *p, size_t n, struct kvf_pageset_enc *e)
{
    size_t nruns = 0, ranges_size = 0, delta_bytes = 0;
    uint32_t run_first = p[0];
    for (size_t i = 0; i < n; i++) {
        uint32_t gap = i == 0 ? p[0] : p[i] - p[i - 1] - 1;
        delta_bytes += varint_size(gap);
        if (i > 0 && gap != 0) {
            ranges_size += range_wire_size(run_first, p[i - 1] - run_first + 1);
            nruns++;
            run_first = p[i];
        }
    }
    ranges_size += range_wire_size(run_first, p[n - 1] - run_first + 1);
    nruns++;

    uint64_t span = (uint64_t)p[n - 1] - p[0] + 1;
    size_t bm_bytes = (size_t)((span + 7) / 8);
    size_t bitmap_size =
        TAG_BYTES + varint_size(bm_bytes) + bm_bytes + (p[0] ? TAG_BYTES + varint_size(p[0]) : 0);
    size_t deltas_size = TAG_BYTES + varint_size(delta_bytes) + delta_bytes;

    e->pages = n;
    e->nruns = nruns;
    if (ranges_size <= deltas_size && ranges_size <= bitmap_size) {
        e->runs = malloc(nruns * sizeof(*e->runs));
        if (e->runs == NULL)
            return -ENOMEM;
        size_t r = 0;
        e->runs[0] = (struct kvf_page_run){p[0], 1};
        for (size_t i = 1; i < n; i++) {
            if (p[i] == p[i - 1] + 1)
                e->runs[r].count++;
            else
                e->runs[++r] = (struct kvf_page_run){p[i], 1};
        }
        e->form = KVF_PAGESET_RANGES;
        e->wire_size = ranges_size;
    } else if (deltas_size <= bitmap_size) {
        e->bytes = malloc(delta_bytes);
        if (e->bytes == NULL)
            return -ENOMEM;
        uint8_t *o = put_varint(e->bytes, p[0]);
        for (size_t i = 1; i < n; i++)
            o = put_varint(o, p[i] - p[i - 1] - 1);
        e->nbytes = delta_bytes;
        e->form = KVF_PAGESET_DELTAS;
        e->wire_size = deltas_size;
    } else {
        e->bytes = calloc(bm_bytes, 1);
        if (e->bytes == NULL)
            return -ENOMEM;
        uint32_t base = p[0];
        for (size_t i = 0; i < n; i++) {
            uint32_t bit = p[i] - base;
            e->bytes[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        }
        e->nbytes = bm_bytes;
        e->bitmap_first = base;
        e->form = KVF_PAGESET_BITMAP;
        e->wire_size = bitmap_size;
    }
    return 0;
}

int kvf_pageset_encode(const uint32_t *pages, size_t n, struct kvf_pageset_enc *enc_p,
                       struct kvf_error *err)
{
    memset(enc_p, 0, sizeof(*enc_p));
    if (n == 0)
        return 0;
    if (pages == NULL)
        return kvf_error_set(err, -EINVAL, "pages: missing");
    size_t i = 1;
    while (i < n && pages[i - 1] < pages[i])
        i++;
    uint32_t *sorted = NULL;
    const uint32_t *p = pages;
    if (i < n) {
        if (pages[i - 1] == pages[i])
            return duplicate(pages, n, pages[i], err);
        sorted = malloc(n * sizeof(*sorted));
        if (sorted != NULL)
            memcpy(sorted, pages, n * sizeof(*sorted));
        if (sorted == NULL || radix_sort(sorted, n) < 0) {
            free(sorted);
            return kvf_error_set(err, -ENOMEM, "pages: out of memory");
        }
        for (size_t j = 1; j < n; j++) {
            if (sorted[j - 1] == sorted[j]) {
                uint32_t page = sorted[j];
                free(sorted);
                return duplicate(pages, n, page, err);
            }
        }
        p = sorted;
    }
    struct kvf_pageset_enc e = {0};
    int rc = encode_sorted(p, n, &e);
    free(sorted);
    if (rc < 0) {
        kvf_pageset_enc_free(&e);
        return kvf_error_set(err, rc, "pages: out of memory");
    }
    *enc_p = e;
    return 0;
}

void kvf_pageset_enc_free(struct kvf_pageset_enc *enc)
{
    if (enc == NULL)
        return;
    free(enc->runs);
    free(enc->bytes);
    memset(enc, 0, sizeof(*enc));
}

/* ---- decoding ------------------------------------------------------------------ */

/*
 * Both decoders make one pass. The runs array is sized from the encoding
 * itself before the pass (a bitmap byte holds at most 4 runs, a delta byte
 * starts at most one) and capped at max_runs, so a hostile encoding can make
 * the decoder allocate no more than 32 bytes per byte it sent (and never
 * beyond the run limit). The pass stops at the first run past the limit:
 * a hostile set of 2 MiB costs the state thread no more than a set at the
 * limit does, and the refusal says "at least" that many runs.
 */

/* Appends the run [first, first + count) to `d`, coalescing with the last
 * one; past d->cap it only counts. */
struct run_sink {
    struct kvf_page_run *runs;
    size_t n, cap;
    uint64_t next; /* the page after the last run; UINT64_MAX: none yet */
};

static inline void sink_add(struct run_sink *d, uint64_t first, uint64_t count)
{
    if (d->n > 0 && d->next == first) {
        if (d->n <= d->cap)
            d->runs[d->n - 1].count += (uint32_t)count;
    } else {
        if (d->n < d->cap)
            d->runs[d->n] = (struct kvf_page_run){(uint32_t)first, (uint32_t)count};
        d->n++;
    }
    d->next = first + count;
}

static int sink_open(struct run_sink *d, size_t bound, size_t max_runs, const char *field,
                     struct kvf_error *err)
{
    d->cap = bound < max_runs ? bound : max_runs;
    d->n = 0;
    d->next = UINT64_MAX;
    d->runs = malloc((d->cap ? d->cap : 1) * sizeof(*d->runs));
    if (d->runs == NULL)
        return kvf_error_set(err, -ENOMEM, "%s: out of memory for %zu runs", field, d->cap);
    return 0;
}

static int sink_close(struct run_sink *d, size_t max_runs, const char *field,
                      struct kvf_page_run **runs_p, size_t *nruns_p, struct kvf_error *err)
{
    if (d->n > max_runs) {
        free(d->runs);
        return kvf_error_set(err, -E2BIG, "%s: at least %zu runs of pages, limit %zu", field, d->n,
                             max_runs);
    }
    /* The array was sized from the encoding; a set of long runs gives most of
     * it back (the control plane keeps it as the lease's runs). */
    if (d->n > 0 && d->n < d->cap / 2) {
        struct kvf_page_run *v = realloc(d->runs, d->n * sizeof(*v));
        if (v != NULL)
            d->runs = v;
    }
    *runs_p = d->runs;
    *nruns_p = d->n;
    return 0;
}

int kvf_pageset_decode_bitmap(const uint8_t *bitmap, size_t len, uint32_t bitmap_first,
                              size_t max_runs, const char *field, struct kvf_page_run **runs_p,
                              size_t *nruns_p, struct kvf_error *err)
{
    size_t last = len;
    while (last > 0 && bitmap[last - 1] == 0)
        last--;
    if (last == 0)
        return kvf_error_set(err, -EINVAL, "%s: names no page (no bit set)", field);
    unsigned top = 7;
    while (!(bitmap[last - 1] & (1u << top)))
        top--;
    uint64_t high = (uint64_t)bitmap_first + 8 * (uint64_t)(last - 1) + top;
    if (high > UINT32_MAX)
        return kvf_error_set(err, -EINVAL,
                             "%s: bit %" PRIu64 " from page %" PRIu32 " is past page 2^32-1", field,
                             8 * (uint64_t)(last - 1) + top, bitmap_first);
    struct run_sink d;
    int rc = sink_open(&d, 4 * last, max_runs, field, err);
    if (rc < 0)
        return rc;
    for (size_t j = 0; j < last; j += 8) {
        uint64_t w = 0;
        size_t take = last - j < 8 ? last - j : 8;
        for (size_t k = 0; k < take; k++) /* little-endian: bit i of byte k is bit 8k+i */
            w |= (uint64_t)bitmap[j + k] << (8 * k);
        uint64_t base = (uint64_t)bitmap_first + 8 * (uint64_t)j;
        while (w != 0) {
            unsigned tz = (unsigned)__builtin_ctzll(w);
            uint64_t rest = ~(w >> tz);
            unsigned ones = rest == 0 ? 64 - tz : (unsigned)__builtin_ctzll(rest);
            sink_add(&d, base + tz, ones);
            w = tz + ones >= 64 ? 0 : w & ~(((1ull << ones) - 1) << tz);
        }
        if (d.n > max_runs)
            break;
    }
    return sink_close(&d, max_runs, field, runs_p, nruns_p, err);
}

int kvf_pageset_decode_deltas(const uint8_t *deltas, size_t len, size_t max_runs, const char *field,
                              struct kvf_page_run **runs_p, size_t *nruns_p, struct kvf_error *err)
{
    if (len == 0)
        return kvf_error_set(err, -EINVAL, "%s: names no page (empty)", field);
    struct run_sink d;
    int rc = sink_open(&d, len, max_runs, field, err);
    if (rc < 0)
        return rc;
    const uint8_t *p = deltas;
    uint64_t next = 0; /* the page after the previous one; the first delta is the page */
    size_t pos = 0;
    while (pos < len) {
        size_t start = pos;
        uint64_t v;
        if (p[pos] < 0x80) { /* one byte: gaps under 128 */
            v = p[pos++];
        } else {
            v = 0;
            for (unsigned k = 0;; k++) {
                if (pos >= len) {
                    free(d.runs);
                    return kvf_error_set(err, -EINVAL, "%s: varint at byte %zu is truncated", field,
                                         start);
                }
                uint8_t b = p[pos++];
                if (k == 4 && (b & 0xf0)) {
                    free(d.runs);
                    return kvf_error_set(
                        err, -EINVAL,
                        "%s: varint at byte %zu is over 2^32-1 or longer than 5 bytes", field,
                        start);
                }
                v |= (uint64_t)(b & 0x7f) << (7 * k);
                if (!(b & 0x80))
                    break;
            }
        }
        uint64_t pg = next + v;
        if (pg > UINT32_MAX) {
            free(d.runs);
            return kvf_error_set(err, -EINVAL,
                                 "%s: varint at byte %zu names page %" PRIu64 ", past 2^32-1",
                                 field, start, pg);
        }
        sink_add(&d, pg, 1);
        next = pg + 1;
        if (d.n > max_runs)
            break;
    }
    return sink_close(&d, max_runs, field, runs_p, nruns_p, err);
}
