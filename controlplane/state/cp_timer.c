/*
 * cp_timer.c: the one timer heap of the control-plane state core.
 *
 * A binary min-heap of pointers to timers embedded in rooms, room-node entries,
 * nodes and fence records, ordered by (deadline, arming sequence) so that
 * timers due at the same instant fire in the order they were armed and a test
 * replays exactly. Each timer stores its own heap index, so arming, moving and
 * cancelling are O(log n) and need no search. The heap reads no clock: the
 * caller of kvf_cps_tick() says what time it is.
 */
#include <errno.h>
#include <stdlib.h>

#include "cp_state_internal.h"

void cp_timer_init(struct cp_timer *t, enum cp_timer_kind kind)
{
    t->when = 0;
    t->seq = 0;
    t->idx = CP_TIMER_IDLE;
    t->kind = (uint8_t)kind;
}

void cp_heap_init(struct cp_heap *h)
{
    h->v = NULL;
    h->n = 0;
    h->cap = 0;
    h->seq = 0;
}

void cp_heap_fini(struct cp_heap *h)
{
    free(h->v);
    cp_heap_init(h);
}

int cp_heap_reserve(struct cp_heap *h, size_t extra)
{
    size_t need = (size_t)h->n + extra;
    if (need <= h->cap)
        return 0;
    if (need >= CP_TIMER_IDLE)
        return -ENOMEM;
    size_t cap = h->cap == 0 ? 64 : h->cap;
    while (cap < need)
        cap *= 2;
    if (cap >= CP_TIMER_IDLE)
        cap = CP_TIMER_IDLE - 1;
    struct cp_timer **v = realloc(h->v, cap * sizeof(*v));
    if (v == NULL)
        return -ENOMEM;
    h->v = v;
    h->cap = (uint32_t)cap;
    return 0;
}

static bool before(const struct cp_timer *a, const struct cp_timer *b)
{
    return a->when < b->when || (a->when == b->when && a->seq < b->seq);
}

static void place(struct cp_heap *h, struct cp_timer *t, uint32_t i)
{
    h->v[i] = t;
    t->idx = i;
}

static void sift_up(struct cp_heap *h, uint32_t i)
{
    struct cp_timer *t = h->v[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!before(t, h->v[parent]))
            break;
        place(h, h->v[parent], i);
        i = parent;
    }
    place(h, t, i);
}

static void sift_down(struct cp_heap *h, uint32_t i)
{
    struct cp_timer *t = h->v[i];
    for (;;) {
        uint32_t child = 2 * i + 1;
        if (child >= h->n)
            break;
        if (child + 1 < h->n && before(h->v[child + 1], h->v[child]))
            child++;
        if (!before(h->v[child], t))
            break;
        place(h, h->v[child], i);
        i = child;
    }
    place(h, t, i);
}

int cp_heap_arm(struct cp_heap *h, struct cp_timer *t, kvf_time_ns when)
{
    if (cp_timer_armed(t))
        cp_heap_cancel(h, t);
    int rc = cp_heap_reserve(h, 1);
    if (rc != 0)
        return rc;
    t->when = when;
    t->seq = ++h->seq;
    place(h, t, h->n++);
    sift_up(h, t->idx);
    return 0;
}

int cp_heap_restore(struct cp_heap *h, struct cp_timer *t, kvf_time_ns when, uint64_t seq)
{
    if (cp_timer_armed(t))
        cp_heap_cancel(h, t);
    int rc = cp_heap_reserve(h, 1);
    if (rc != 0)
        return rc;
    t->when = when;
    t->seq = seq;
    place(h, t, h->n++);
    sift_up(h, t->idx);
    return 0;
}

void cp_heap_cancel(struct cp_heap *h, struct cp_timer *t)
{
    if (!cp_timer_armed(t))
        return;
    uint32_t i = t->idx;
    t->idx = CP_TIMER_IDLE;
    h->n--;
    if (i == h->n)
        return;
    struct cp_timer *last = h->v[h->n];
    place(h, last, i);
    /* The moved timer may belong above or below its new slot. */
    sift_up(h, i);
    if (last->idx == i)
        sift_down(h, i);
}

struct cp_timer *cp_heap_top(const struct cp_heap *h)
{
    return h->n > 0 ? h->v[0] : NULL;
}
