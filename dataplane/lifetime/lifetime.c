/*
 * lifetime.c: one room-generation's lifetime on a node: admission, in-flight
 * accounting, the drained event and staging buffers. The table that names
 * lifetimes by room key, remembers forgotten generations and fences peers is in
 * lifetime_table.c.
 *
 * DESIGN: admission and retirement are the hot path and may run on any thread.
 * They touch one atomic 64-bit word per lifetime: bit 63 says admission is
 * closed, the low 63 bits count the ops in flight. Admission is a CAS loop that
 * refuses once the closed bit is set; retirement is one fetch_sub. Once the
 * closed bit is set the count can only go down, so the word becomes exactly
 * "closed, zero" once, and the one call that makes it so (the last retirement,
 * or the close itself when nothing was in flight) is the only one that reports
 * "drained". A retiring thread touches nothing of the lifetime after its
 * fetch_sub, because the owner may free the lifetime as soon as it is drained.
 * Per-kind counts are relaxed atomics next to the word (statistics; the word is
 * the proof). Everything else (quarantine, staging flags, the taken-drained
 * flag) belongs to the owner thread.
 */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "lifetime_internal.h"

/* op->quarantined values. */
#define LT_OP_NORMAL      0
#define LT_OP_QUARANTINED 1
#define LT_OP_FENCED      2 /* retired by a peer fence; a stray later retire is ignored */

struct kvf_lt *lt_create(struct kvf_lt_table *t, kvf_room_key key)
{
    size_t size = (sizeof(struct kvf_lt) + LT_CACHE_LINE - 1) / LT_CACHE_LINE * LT_CACHE_LINE;
    struct kvf_lt *lt = aligned_alloc(LT_CACHE_LINE, size);
    if (lt == NULL)
        return NULL;
    memset(lt, 0, size);
    atomic_init(&lt->word, 0);
    for (int k = 0; k < KVF_LT_OP_KIND_COUNT; k++)
        atomic_init(&lt->kind_inflight[k], 0);
    lt->key = key;
    lt->table = t;
    return lt;
}

void lt_free(struct kvf_lt *lt)
{
    if (lt == NULL)
        return;
    free(lt);
}

kvf_room_key kvf_lt_key(const struct kvf_lt *lt)
{
    return lt->key;
}

enum kvf_lt_state kvf_lt_state(const struct kvf_lt *lt)
{
    uint64_t w = atomic_load_explicit(&lt->word, memory_order_acquire);
    if ((w & LT_WORD_CLOSED) == 0)
        return KVF_LT_OPEN;
    if (LT_WORD_COUNT(w) == 0)
        return KVF_LT_DRAINED;
    return lt->quarantined > 0 ? KVF_LT_QUARANTINED : KVF_LT_CLOSED;
}

bool kvf_lt_is_open(const struct kvf_lt *lt)
{
    return (atomic_load_explicit(&lt->word, memory_order_acquire) & LT_WORD_CLOSED) == 0;
}

uint64_t kvf_lt_inflight(const struct kvf_lt *lt)
{
    return LT_WORD_COUNT(atomic_load_explicit(&lt->word, memory_order_acquire));
}

uint64_t kvf_lt_inflight_kind(const struct kvf_lt *lt, enum kvf_lt_op_kind kind)
{
    if ((unsigned)kind >= KVF_LT_OP_KIND_COUNT)
        return 0;
    return atomic_load_explicit(&lt->kind_inflight[kind], memory_order_relaxed);
}

/* ---- hot path ------------------------------------------------------------ */

int kvf_lt_admit(struct kvf_lt *lt, struct kvf_lt_op *op, enum kvf_lt_op_kind kind, uint32_t peer)
{
    if ((unsigned)kind >= KVF_LT_OP_KIND_COUNT)
        return -EINVAL;
    uint64_t w = atomic_load_explicit(&lt->word, memory_order_relaxed);
    do {
        if (w & LT_WORD_CLOSED)
            return -ECANCELED;
        assert(LT_WORD_COUNT(w + 1) != 0); /* 2^63 ops in flight: cannot happen */
    } while (!atomic_compare_exchange_weak_explicit(&lt->word, &w, w + 1, memory_order_acquire,
                                                    memory_order_relaxed));
    atomic_fetch_add_explicit(&lt->kind_inflight[kind], 1, memory_order_relaxed);
    op->lt = lt;
    op->peer = peer;
    op->kind = (uint8_t)kind;
    op->quarantined = LT_OP_NORMAL;
    op->qnext = NULL;
    op->qprev = NULL;
    return 0;
}

/* The accounting shared by retire and cancel. Returns true when this call
 * drained the lifetime. Touches nothing of `lt` after the fetch_sub. */
static bool lt_op_release(struct kvf_lt_op *op)
{
    struct kvf_lt *lt = op->lt;
    if (op->quarantined != LT_OP_NORMAL) {
        if (op->quarantined == LT_OP_FENCED)
            return false; /* already retired by the fence of its peer */
        lt_table_unquarantine(lt->table, op);
        lt->quarantined--;
        op->quarantined = LT_OP_NORMAL;
    }
    atomic_fetch_sub_explicit(&lt->kind_inflight[op->kind], 1, memory_order_relaxed);
    uint64_t prev = atomic_fetch_sub_explicit(&lt->word, 1, memory_order_acq_rel);
    assert(LT_WORD_COUNT(prev) != 0);
    return prev == (LT_WORD_CLOSED | 1);
}

bool kvf_lt_op_retire(struct kvf_lt_op *op, enum kvf_lt_outcome outcome)
{
    /* Every outcome proves the op stopped; they differ only for the caller. */
    assert(outcome == KVF_LT_DONE_OK || outcome == KVF_LT_DONE_ERROR ||
           outcome == KVF_LT_DONE_FLUSHED);
    (void)outcome;
    return lt_op_release(op);
}

bool kvf_lt_op_cancel(struct kvf_lt_op *op)
{
    return lt_op_release(op);
}

/* ---- owner thread -------------------------------------------------------- */

void kvf_lt_op_quarantine(struct kvf_lt_op *op)
{
    struct kvf_lt *lt = op->lt;
    if (op->quarantined != LT_OP_NORMAL || op->kind == KVF_LT_OP_STAGING)
        return;
    op->quarantined = LT_OP_QUARANTINED;
    lt->quarantined++;
    lt_table_quarantine(lt->table, op);
    /* A failed op dooms the room (docs/design.md §2.6): shut admission now. The
     * op is still counted, so this cannot be the drain. */
    atomic_fetch_or_explicit(&lt->word, LT_WORD_CLOSED, memory_order_acq_rel);
}

void lt_op_mark_fenced(struct kvf_lt_op *op)
{
    op->quarantined = LT_OP_FENCED;
}

bool kvf_lt_close(struct kvf_lt *lt)
{
    uint64_t prev = atomic_fetch_or_explicit(&lt->word, LT_WORD_CLOSED, memory_order_acq_rel);
    if (prev & LT_WORD_CLOSED)
        return false;
    return prev == 0;
}

bool kvf_lt_take_drained(struct kvf_lt *lt)
{
    if (lt->drained_taken)
        return false;
    if (atomic_load_explicit(&lt->word, memory_order_acquire) != LT_WORD_CLOSED)
        return false;
    lt->drained_taken = true;
    return true;
}

/* ---- staging buffers ----------------------------------------------------- */

int kvf_lt_staging_acquire(struct kvf_lt *lt, struct kvf_lt_staging *s, uint32_t peer)
{
    int rc = kvf_lt_admit(lt, &s->op, KVF_LT_OP_STAGING, peer);
    if (rc != 0)
        return rc;
    s->transport_done = 0;
    s->copy_done = 0;
    return 0;
}

/* Marks one side done; retires the STAGING op when the other side is done too.
 * A repeated call for the same side is ignored (returns false). */
static bool lt_staging_side_done(struct kvf_lt_staging *s, uint8_t *mine, uint8_t other,
                                 bool *drained_p)
{
    bool drained = false;
    bool both = false;
    if (*mine == 0) {
        *mine = 1;
        if (other != 0) {
            both = true;
            drained = lt_op_release(&s->op);
        }
    }
    if (drained_p != NULL)
        *drained_p = drained;
    return both;
}

bool kvf_lt_staging_transport_done(struct kvf_lt_staging *s, bool *drained_p)
{
    return lt_staging_side_done(s, &s->transport_done, s->copy_done, drained_p);
}

bool kvf_lt_staging_copy_done(struct kvf_lt_staging *s, bool *drained_p)
{
    return lt_staging_side_done(s, &s->copy_done, s->transport_done, drained_p);
}

/* ---- names --------------------------------------------------------------- */

const char *kvf_lt_state_name(enum kvf_lt_state s)
{
    switch (s) {
    case KVF_LT_OPEN:
        return "OPEN";
    case KVF_LT_CLOSED:
        return "CLOSED";
    case KVF_LT_DRAINED:
        return "DRAINED";
    case KVF_LT_QUARANTINED:
        return "QUARANTINED";
    }
    return "UNKNOWN";
}

const char *kvf_lt_op_kind_name(enum kvf_lt_op_kind k)
{
    switch (k) {
    case KVF_LT_OP_RDMA_WR:
        return "RDMA_WR";
    case KVF_LT_OP_TCP_FRAME:
        return "TCP_FRAME";
    case KVF_LT_OP_CUDA_COPY:
        return "CUDA_COPY";
    case KVF_LT_OP_STAGING:
        return "STAGING";
    case KVF_LT_OP_KIND_COUNT:
        break;
    }
    return "UNKNOWN";
}
