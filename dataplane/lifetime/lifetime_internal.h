/*
 * lifetime_internal.h: what lifetime.c and lifetime_table.c share, and the one
 * tuning knob the tests use. Nothing outside dataplane/lifetime/ (and its unit
 * tests) includes this.
 *
 * DESIGN: a lifetime's first cache line holds what any thread may touch: the
 * admission word and the per-kind statistics. Everything after it belongs to the
 * table's owner thread. Lifetimes are allocated 64-byte aligned so that two
 * rooms never share that line (no false sharing between rooms on the hot path).
 */
#ifndef KVF_LIFETIME_INTERNAL_H
#define KVF_LIFETIME_INTERNAL_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_map.h"
#include "lifetime.h"

/* The admission word: bit 63 says admission is closed, the low 63 bits count
 * the ops in flight. "Drained" is the word being exactly LT_WORD_CLOSED. */
#define LT_WORD_CLOSED   (UINT64_C(1) << 63)
#define LT_WORD_COUNT(w) ((w) & ~LT_WORD_CLOSED)
#define LT_CACHE_LINE    64

/* How many room ids whose lifetimes were all forgotten the table remembers by
 * default (see lifetime_table.c, "forgotten memory"). */
#define LT_FORGOTTEN_CAP_DEFAULT 65536u

struct kvf_lt {
    /* ---- any thread ---- */
    alignas(LT_CACHE_LINE) _Atomic uint64_t word;
    _Atomic uint64_t kind_inflight[KVF_LT_OP_KIND_COUNT]; /* statistics, relaxed */

    /* ---- owner thread ---- */
    alignas(LT_CACHE_LINE) kvf_room_key key;
    struct kvf_lt_table *table;
    uint64_t quarantined; /* ops of this lifetime on the table's quarantine list */
    bool drained_taken;
};

/* What the table remembers about one room id. */
struct lt_id {
    uint64_t room_id;
    uint64_t max_generation; /* highest generation seen: open now or forgotten */
    size_t live;             /* lifetimes of this id in the table */
    struct lt_id *lru_prev;  /* forgotten-only ids, oldest first (live == 0) */
    struct lt_id *lru_next;
};

struct kvf_lt_table {
    struct kvf_map lifetimes; /* room key -> struct kvf_lt */
    struct kvf_map ids;       /* room id -> struct lt_id */
    struct lt_id *lru_head;   /* oldest forgotten-only id */
    struct lt_id *lru_tail;
    size_t forgotten_count; /* ids on the lru list */
    size_t forgotten_cap;
    uint64_t late_floor;          /* every generation <= this that is not open is late */
    struct kvf_lt_op *quarantine; /* quarantined ops of every lifetime, owner thread */
};

/* lifetime.c: allocation and release of one lifetime (the table links it). */
struct kvf_lt *lt_create(struct kvf_lt_table *t, kvf_room_key key);
void lt_free(struct kvf_lt *lt);

/* lifetime.c: marks an op that a peer fence retired, so that a stray later
 * retire of it is ignored. */
void lt_op_mark_fenced(struct kvf_lt_op *op);

/* lifetime_table.c: links a quarantined op on its table's list, and unlinks it. */
void lt_table_unquarantine(struct kvf_lt_table *t, struct kvf_lt_op *op);
void lt_table_quarantine(struct kvf_lt_table *t, struct kvf_lt_op *op);

/*
 * Sets how many forgotten-only room ids the table remembers before it folds the
 * oldest into its late floor (at least 1). Tests use a small cap to reach the
 * pruning path; the node keeps the default.
 */
void lt_table_set_forgotten_cap(struct kvf_lt_table *t, size_t cap);

#endif /* KVF_LIFETIME_INTERNAL_H */
