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

/* ---- lookups ------------------------------------------------------------- */

/* Both maps are kvf_map (room keys, and room ids); they never hold NULL. */
static struct kvf_lt *lt_table_lookup(const struct kvf_lt_table *t, kvf_room_key key)
{
    return kvf_map_get_room(&t->lifetimes, key);
}

static struct lt_id *lt_id_lookup(const struct kvf_lt_table *t, uint64_t room_id)
{
    return kvf_map_get_u64(&t->ids, room_id);
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
        kvf_map_del_u64(&t->ids, oldest->room_id);
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
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, KVF_MAP_ROOM);
    kvf_map_init(&t->lifetimes, &opts);
    kvf_map_opts_init(&opts, KVF_MAP_U64);
    kvf_map_init(&t->ids, &opts);
    t->forgotten_cap = LT_FORGOTTEN_CAP_DEFAULT;
    return t;
}

void kvf_lt_table_destroy(struct kvf_lt_table *t)
{
    if (t == NULL)
        return;
    /* Freeing values leaves the maps unchanged, so iterating stays valid. */
    size_t pos = 0;
    struct kvf_lt *lt;
    while ((lt = kvf_map_next(&t->lifetimes, &pos)) != NULL)
        lt_free(lt);
    kvf_map_fini(&t->lifetimes);
    pos = 0;
    struct lt_id *id;
    while ((id = kvf_map_next(&t->ids, &pos)) != NULL)
        free(id);
    kvf_map_fini(&t->ids);
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

    /* Room in both maps first, so that nothing below can fail half-way. */
    if (kvf_map_reserve(&t->lifetimes, 1) != 0 || (id == NULL && kvf_map_reserve(&t->ids, 1) != 0))
        return -ENOMEM;
    struct kvf_lt *lt = lt_create(t, key);
    if (lt == NULL)
        return -ENOMEM;
    if (id == NULL) {
        id = calloc(1, sizeof(*id));
        if (id == NULL)
            goto err_free_lt;
        id->room_id = key.room_id;
        (void)kvf_map_put_u64(&t->ids, key.room_id, id); /* reserved */
    } else if (id->live == 0) {
        lt_lru_unlink(t, id);
    }
    id->live++;
    id->max_generation = key.generation;
    (void)kvf_map_put_room(&t->lifetimes, key, lt); /* reserved */
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
    if (kvf_lt_state(lt) != KVF_LT_DRAINED)
        return -EBUSY;
    kvf_map_del_room(&t->lifetimes, key);
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

size_t kvf_lt_table_close_all(struct kvf_lt_table *t)
{
    size_t drained = 0;
    size_t pos = 0;
    struct kvf_lt *lt;
    while ((lt = kvf_map_next(&t->lifetimes, &pos)) != NULL) {
        if (kvf_lt_close(lt))
            drained++;
    }
    return drained;
}

bool kvf_lt_table_can_teardown(const struct kvf_lt_table *t)
{
    size_t pos = 0;
    const struct kvf_lt *lt;
    while ((lt = kvf_map_next(&t->lifetimes, &pos)) != NULL) {
        if (kvf_lt_state(lt) != KVF_LT_DRAINED)
            return false;
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
    return kvf_map_count(&t->lifetimes);
}
