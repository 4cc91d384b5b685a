/*
 * kvf_pageset.h: the page-set encoding of kvfence.v1.PageSet (types.proto):
 * a set of page indices of one pool in the smallest of three forms.
 *
 *   RANGES  runs [first, first + count), as repeated PageRange (the old form);
 *           pays when pages come in runs.
 *   BITMAP  bit i of byte j (least significant bit first) set means page
 *           bitmap_first + 8 * j + i; pays for a dense scatter (every other
 *           page: 2 bits a page).
 *   DELTAS  the pages in ascending order as unsigned LEB128 varints: the
 *           first is the page itself, each later one the gap to the page
 *           before minus one (1 byte a page while gaps stay under 128); pays
 *           for a sparse scatter.
 *
 * A set names each page once: the encoder refuses a page given twice, and the
 * bitmap and delta forms cannot express one. The encoder computes the exact
 * wire size of each form and keeps the smallest (a tie keeps RANGES, then
 * DELTAS). Encoding sorts (an LSD radix sort when the pages are not already
 * ascending), so the order of the input is not kept: a set is a set.
 *
 * The decoders turn BITMAP and DELTAS into ascending, coalesced runs (the
 * control plane keeps a lease as runs), checking every byte: a truncated or
 * overlong varint, a page past 2^32-1, a bitmap running past 2^32 pages, no
 * page at all (-EINVAL), more than `max_runs` runs (-E2BIG, found at the
 * first run past the limit; the decoder never allocates more than max_runs
 * runs, nor more than 32 bytes per byte of the encoding). Messages name the field
 * ("page_set.deltas: varint at byte 7 is truncated").
 *
 * Pure: no I/O, no clock, no threads; the state cores and libkvfence link it.
 */
#ifndef KVF_PAGESET_H
#define KVF_PAGESET_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

enum kvf_pageset_form {
    KVF_PAGESET_EMPTY = 0, /* no page: nothing to send */
    KVF_PAGESET_RANGES = 1,
    KVF_PAGESET_BITMAP = 2,
    KVF_PAGESET_DELTAS = 3,
};

/* Pages [first, first + count); count >= 1. Same layout as the control
 * plane's kvf_cps_page_range and libkvfence's kvf_page_range. */
struct kvf_page_run {
    uint32_t first;
    uint32_t count;
};

/* An encoded set, ready to be put in a PageSet message. */
struct kvf_pageset_enc {
    enum kvf_pageset_form form;
    struct kvf_page_run *runs; /* RANGES: ascending, coalesced */
    size_t nruns;              /* the set's runs, whatever the form */
    uint8_t *bytes;            /* BITMAP or DELTAS */
    size_t nbytes;
    uint32_t bitmap_first; /* BITMAP: the page of bit 0 (the lowest page) */
    size_t pages;          /* pages in the set */
    size_t wire_size;      /* bytes of the PageSet message (its body) */
};

/* Encodes `n` page indices (any order, each at most once; n may be 0, then
 * form is EMPTY) into *enc_p, choosing the smallest form. Returns 0, -EINVAL
 * (a page listed twice: the message names it and its two positions) or
 * -ENOMEM. On error *enc_p is left empty (nothing to free). */
int kvf_pageset_encode(const uint32_t *pages, size_t n, struct kvf_pageset_enc *enc_p,
                       struct kvf_error *err);

/* Frees what an encode allocated and empties `enc`. Accepts an empty one. */
void kvf_pageset_enc_free(struct kvf_pageset_enc *enc);

/* Bytes of the PageSet body for each form, given the set's ascending runs
 * (for the RANGES form: the repeated PageRange). */
size_t kvf_pageset_ranges_wire_size(const struct kvf_page_run *runs, size_t nruns);

/* Decodes a BITMAP form to ascending, coalesced runs in *runs_p (malloc'd;
 * the caller frees it) and their number in *nruns_p. `field` names the bytes
 * in messages ("page_set.bitmap"). Returns 0, -EINVAL (no bit set, or bits
 * past page 2^32-1), -E2BIG (more than max_runs runs) or -ENOMEM. */
int kvf_pageset_decode_bitmap(const uint8_t *bitmap, size_t len, uint32_t bitmap_first,
                              size_t max_runs, const char *field, struct kvf_page_run **runs_p,
                              size_t *nruns_p, struct kvf_error *err);

/* Decodes a DELTAS form likewise. -EINVAL: empty, a truncated varint, a
 * varint of more than 5 bytes or over 2^32-1, a page past 2^32-1. */
int kvf_pageset_decode_deltas(const uint8_t *deltas, size_t len, size_t max_runs, const char *field,
                              struct kvf_page_run **runs_p, size_t *nruns_p, struct kvf_error *err);

#endif /* KVF_PAGESET_H */
