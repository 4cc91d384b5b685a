/*
 * lifetime_table.c: a node's table of lifetimes (room key -> lifetime), its
 * memory of generations it has closed or forgotten (late messages, R10/R13),
 * the quarantine list that a peer fence empties, and the teardown check.
 *
 * DESIGN: the whole table belongs to one owner thread (the node's room thread).
 * Other threads only admit and retire through a lifetime pointer they already
 * hold (lifetime.c), so nothing here is atomic except the reads of a lifetime's
 * word through kvf_lt_state().
 *
 * Forgotten memory. For every room id the table keeps one record: the highest
 * generation seen (open now or forgotten) and how many lifetimes of that id are
 * in the table. A message for a generation that is not open and not newer than
 * that record is late. Room ids are random, so records of ids with no lifetime
 * left would grow without bound: they sit on an LRU list in the order they were
 * forgotten, and when there are more than `forgotten_cap` (default 65,536) the
 * oldest is folded into one table-wide floor, `late_floor` = the highest
 * generation folded so far. Any generation at or below the floor that is not
 * open is late. Generations come from one counter of the control plane, so the
 * floor errs only on the safe side: a room minted long ago whose lifetime is
 * opened on this node only after `forgotten_cap` newer rooms were forgotten here
 * is refused (-ESTALE) and fails; it can never let an old message through.
 */
#include <errno.h>
#include <stdlib.h>

#include "lifetime_internal.h"

#define LT_HMAP_INITIAL_BUCKETS 64u

/* ---- hashing ------------------------------------------------------------- */

/* The splitmix64 finaliser: room ids are random but generations are small
 * consecutive numbers, so mix both. */
static uint64_t lt_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return x;
}

static uint64_t lt_key_hash(kvf_room_key key)
{
    return lt_mix(key.room_id ^ lt_mix(key.generation + UINT64_C(0x9e3779b97f4a7c15)));
}

static uint64_t lt_id_hash(uint64_t room_id)
{
    return lt_mix(room_id);
}

static int lt_hmap_init(struct lt_hmap *m)
{
    m->buckets = calloc(LT_HMAP_INITIAL_BUCKETS, sizeof(*m->buckets));
    if (m->buckets == NULL)
        return -ENOMEM;
    m->mask = LT_HMAP_INITIAL_BUCKETS - 1;
    m->count = 0;
    return 0;
}

/* Doubles the bucket array. On out of memory the map keeps its size: chains get
 * longer, nothing fails. */
static void lt_hmap_grow(struct lt_hmap *m)
{
    size_t n = (m->mask + 1) * 2;
    struct lt_hnode **b = calloc(n, sizeof(*b));
    if (b == NULL)
        return;
    for (size_t i = 0; i <= m->mask; i++) {
        struct lt_hnode *node = m->buckets[i];
        while (node != NULL) {
            struct lt_hnode *next = node->next;
            node->next = b[node->hash & (n - 1)];
            b[node->hash & (n - 1)] = node;
            node = next;
        }
    }
    free(m->buckets);
    m->buckets = b;
    m->mask = n - 1;
}

static void lt_hmap_insert(struct lt_hmap *m, struct lt_hnode *node, uint64_t hash)
{
    if (m->count >= m->mask + 1)
        lt_hmap_grow(m);
    node->hash = hash;
    node->next = m->buckets[hash & m->mask];
    m->buckets[hash & m->mask] = node;
    m->count++;
}

static void lt_hmap_remove(struct lt_hmap *m, struct lt_hnode *node)
{
    struct lt_hnode **pp = &m->buckets[node->hash & m->mask];
    while (*pp != NULL && *pp != node)
        pp = &(*pp)->next;
    if (*pp == node) {
        *pp = node->next;
        node->next = NULL;
        m->count--;
    }
}

#define LT_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

static struct kvf_lt *lt_table_lookup(const struct kvf_lt_table *t, kvf_room_key key)
{
    uint64_t h = lt_key_hash(key);
    for (struct lt_hnode *n = t->lifetimes.buckets[h & t->lifetimes.mask]; n; n = n->next) {
        if (n->hash != h)
            continue;
        struct kvf_lt *lt = LT_CONTAINER_OF(n, struct kvf_lt, hnode);
        if (kvf_room_key_eq(lt->key, key))
            return lt;
    }
    return NULL;
}

static struct lt_id *lt_id_lookup(const struct kvf_lt_table *t, uint64_t room_id)
{
    uint64_t h = lt_id_hash(room_id);
    for (struct lt_hnode *n = t->ids.buckets[h & t->ids.mask]; n; n = n->next) {
        if (n->hash != h)
            continue;
        struct lt_id *id = LT_CONTAINER_OF(n, struct lt_id, hnode);
        if (id->room_id == room_id)
            return id;
    }
    return NULL;
}

/* ---- forgotten memory ---------------------------------------------------- */

static void lt_lru_append(struct kvf_lt_table *t, struct lt_id *id)
{
    id->lru_next = NULL;
    id->lru_prev = t->lru_tail;
    if (t->lru_tail != NULL)
        t->lru_tail->lru_next = id;
    else
        t->lru_head = id;
    t->lru_tail = id;
    t->forgotten_count++;
}

static void lt_lru_unlink(struct kvf_lt_table *t, struct lt_id *id)
{
    if (id->lru_prev != NULL)
        id->lru_prev->lru_next = id->lru_next;
    else
        t->lru_head = id->lru_next;
    if (id->lru_next != NULL)
        id->lru_next->lru_prev = id->lru_prev;
    else
        t->lru_tail = id->lru_prev;
    id->lru_prev = NULL;
    id->lru_next = NULL;
    t->forgotten_count--;
}

/* Folds the oldest forgotten-only ids into the late floor until at most
 * `forgotten_cap` remain. */
static void lt_prune_forgotten(struct kvf_lt_table *t)
{
    while (t->forgotten_count > t->forgotten_cap) {
        struct lt_id *oldest = t->lru_head;
        if (oldest->max_generation > t->late_floor)
            t->late_floor = oldest->max_generation;
        lt_lru_unlink(t, oldest);
        lt_hmap_remove(&t->ids, &oldest->hnode);
        free(oldest);
    }
}

void lt_table_set_forgotten_cap(struct kvf_lt_table *t, size_t cap)
{
    t->forgotten_cap = cap > 0 ? cap : 1;
    lt_prune_forgotten(t);
}

/* ---- quarantine list ----------------------------------------------------- */

void lt_table_quarantine(struct kvf_lt_table *t, struct kvf_lt_op *op)
{
    op->qprev = NULL;
    op->qnext = t->quarantine;
    if (t->quarantine != NULL)
        t->quarantine->qprev = op;
    t->quarantine = op;
}

void lt_table_unquarantine(struct kvf_lt_table *t, struct kvf_lt_op *op)
{
    if (op->qprev != NULL)
        op->qprev->qnext = op->qnext;
    else
        t->quarantine = op->qnext;
    if (op->qnext != NULL)
        op->qnext->qprev = op->qprev;
    op->qnext = NULL;
    op->qprev = NULL;
}

/* ---- table --------------------------------------------------------------- */

struct kvf_lt_table *kvf_lt_table_create(void)
{
    struct kvf_lt_table *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    if (lt_hmap_init(&t->lifetimes) != 0)
        goto err_free_table;
    if (lt_hmap_init(&t->ids) != 0)
        goto err_free_lifetimes;
    t->forgotten_cap = LT_FORGOTTEN_CAP_DEFAULT;
    return t;

err_free_lifetimes:
    free(t->lifetimes.buckets);
err_free_table:
    free(t);
    return NULL;
}

void kvf_lt_table_destroy(struct kvf_lt_table *t)
{
    if (t == NULL)
        return;
    if (t->lifetimes.buckets != NULL) {
        for (size_t i = 0; i <= t->lifetimes.mask; i++) {
            struct lt_hnode *n = t->lifetimes.buckets[i];
            while (n != NULL) {
                struct lt_hnode *next = n->next;
                lt_free(LT_CONTAINER_OF(n, struct kvf_lt, hnode));
                n = next;
            }
        }
        free(t->lifetimes.buckets);
    }
    if (t->ids.buckets != NULL) {
        for (size_t i = 0; i <= t->ids.mask; i++) {
            struct lt_hnode *n = t->ids.buckets[i];
            while (n != NULL) {
                struct lt_hnode *next = n->next;
                free(LT_CONTAINER_OF(n, struct lt_id, hnode));
                n = next;
            }
        }
        free(t->ids.buckets);
    }
    free(t);
}

static bool lt_key_valid(kvf_room_key key)
{
    return key.generation != 0 && key.room_id <= KVF_ROOM_ID_MAX;
}

int kvf_lt_table_open(struct kvf_lt_table *t, kvf_room_key key, struct kvf_lt **lt_p)
{
    if (!lt_key_valid(key))
        return -EINVAL;
    if (lt_table_lookup(t, key) != NULL)
        return -EEXIST;
    if (key.generation <= t->late_floor)
        return -ESTALE;
    struct lt_id *id = lt_id_lookup(t, key.room_id);
    /* Not open, so an equal generation was forgotten; a newer one is known. */
    if (id != NULL && key.generation <= id->max_generation)
        return -ESTALE;

    struct kvf_lt *lt = lt_create(t, key);
    if (lt == NULL)
        return -ENOMEM;
    if (id == NULL) {
        id = calloc(1, sizeof(*id));
        if (id == NULL)
            goto err_free_lt;
        id->room_id = key.room_id;
        lt_hmap_insert(&t->ids, &id->hnode, lt_id_hash(key.room_id));
    } else if (id->live == 0) {
        lt_lru_unlink(t, id);
    }
    id->live++;
    id->max_generation = key.generation;
    lt_hmap_insert(&t->lifetimes, &lt->hnode, lt_key_hash(key));
    *lt_p = lt;
    return 0;

err_free_lt:
    lt_free(lt);
    return -ENOMEM;
}

struct kvf_lt *kvf_lt_table_find(struct kvf_lt_table *t, kvf_room_key key)
{
    return lt_table_lookup(t, key);
}

int kvf_lt_table_forget(struct kvf_lt_table *t, kvf_room_key key)
{
    struct kvf_lt *lt = lt_table_lookup(t, key);
    if (lt == NULL)
        return -ENOENT;
    if (kvf_lt_state(lt) != KVF_LT_DRAINED || lt_has_queued_chunks(lt))
        return -EBUSY;
    lt_hmap_remove(&t->lifetimes, &lt->hnode);
    struct lt_id *id = lt_id_lookup(t, key.room_id);
    if (id != NULL && --id->live == 0) {
        lt_lru_append(t, id);
        lt_prune_forgotten(t);
    }
    lt_free(lt);
    return 0;
}

bool kvf_lt_table_is_late(const struct kvf_lt_table *t, kvf_room_key key)
{
    if (!lt_key_valid(key))
        return true; /* generation 0 names no room: nothing can be current for it */
    const struct kvf_lt *lt = lt_table_lookup(t, key);
    if (lt != NULL)
        return kvf_lt_state(lt) != KVF_LT_OPEN;
    if (key.generation <= t->late_floor)
        return true;
    const struct lt_id *id = lt_id_lookup(t, key.room_id);
    return id != NULL && key.generation <= id->max_generation;
}

size_t kvf_lt_table_close_all(struct kvf_lt_table *t,
                              void (*drop_fn)(void *ctx, struct kvf_lt_chunk *c), void *ctx)
{
    size_t drained = 0;
    for (size_t i = 0; i <= t->lifetimes.mask; i++) {
        for (struct lt_hnode *n = t->lifetimes.buckets[i]; n; n = n->next) {
            if (kvf_lt_close(LT_CONTAINER_OF(n, struct kvf_lt, hnode), drop_fn, ctx))
                drained++;
        }
    }
    return drained;
}

bool kvf_lt_table_can_teardown(const struct kvf_lt_table *t)
{
    for (size_t i = 0; i <= t->lifetimes.mask; i++) {
        for (const struct lt_hnode *n = t->lifetimes.buckets[i]; n; n = n->next) {
            if (kvf_lt_state(LT_CONTAINER_OF(n, struct kvf_lt, hnode)) != KVF_LT_DRAINED)
                return false;
        }
    }
    return true;
}

size_t kvf_lt_table_peer_fenced(struct kvf_lt_table *t, uint32_t peer)
{
    size_t drained = 0;
    struct kvf_lt_op *op = t->quarantine;
    while (op != NULL) {
        struct kvf_lt_op *next = op->qnext; /* retiring unlinks op only */
        if (op->peer == peer) {
            if (kvf_lt_op_retire(op, KVF_LT_DONE_FLUSHED))
                drained++;
            lt_op_mark_fenced(op);
        }
        op = next;
    }
    return drained;
}

size_t kvf_lt_table_count(const struct kvf_lt_table *t)
{
    return t->lifetimes.count;
}
