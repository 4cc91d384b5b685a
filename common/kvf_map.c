/*
 * kvf_map.c: open-addressing hash map (contract in kvf_map.h).
 *
 * A slot is empty when its value is NULL. A key lives in the cluster that
 * starts at its home slot (hash & (cap - 1)); lookups walk forward from home
 * to the first empty slot. Removal keeps that invariant without tombstones:
 * later members of the cluster move back into the hole unless their home lies
 * cyclically after the hole (moving them would put them before their home).
 *
 * Slots are `stride` bytes, by kind: a U64 slot holds only the hash and the
 * value, because the hash of a u64 key (mix64) is a bijection.
 */
#include "kvf_map.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define KVF_MAP_MIN_CAP 16u

/* splitmix64's finaliser: ids that count up or share low bits still spread
 * over the whole table. Every step is invertible, so it is a bijection. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t hash_room(kvf_room_key key)
{
    return mix64(key.room_id ^ mix64(key.generation + 0x9e3779b97f4a7c15ull));
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then mixed */
    for (; *s != '\0'; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    return mix64(h);
}

static size_t stride_of(enum kvf_map_kind kind)
{
    switch (kind) {
    case KVF_MAP_ROOM:
        return sizeof(struct kvf_map_slot) + 2 * sizeof(union kvf_map_key_word);
    case KVF_MAP_STR:
        return sizeof(struct kvf_map_slot) + sizeof(union kvf_map_key_word);
    case KVF_MAP_U64:
        break;
    }
    return sizeof(struct kvf_map_slot);
}

void kvf_map_opts_init(struct kvf_map_opts *opts, enum kvf_map_kind kind)
{
    memset(opts, 0, sizeof(*opts));
    opts->kind = kind;
}

void kvf_map_init(struct kvf_map *m, const struct kvf_map_opts *opts)
{
    memset(m, 0, sizeof(*m));
    if (opts != NULL)
        m->opts = *opts;
    else
        kvf_map_opts_init(&m->opts, KVF_MAP_U64);
    m->stride = stride_of(m->opts.kind);
}

void kvf_map_fini(struct kvf_map *m)
{
    free(m->table);
    m->table = NULL;
    m->cap = 0;
    m->count = 0;
}

size_t kvf_map_count(const struct kvf_map *m)
{
    return m->count;
}

static struct kvf_map_slot *slot_at(const struct kvf_map *m, size_t i)
{
    return (struct kvf_map_slot *)(void *)(m->table + i * m->stride);
}

/* A probe: the key being looked for. */
struct probe {
    uint64_t hash;
    kvf_room_key room; /* ROOM */
    const char *skey;  /* STR */
};

static bool slot_matches(const struct kvf_map *m, const struct kvf_map_slot *s,
                         const struct probe *p)
{
    if (s->hash != p->hash)
        return false;
    switch (m->opts.kind) {
    case KVF_MAP_U64:
        return true;
    case KVF_MAP_ROOM:
        return s->key[0].u64 == p->room.room_id && s->key[1].u64 == p->room.generation;
    case KVF_MAP_STR:
        return strcmp(s->key[0].skey, p->skey) == 0;
    }
    return false;
}

static void slot_set_key(const struct kvf_map *m, struct kvf_map_slot *s, const struct probe *p)
{
    s->hash = p->hash;
    if (m->opts.kind == KVF_MAP_ROOM) {
        s->key[0].u64 = p->room.room_id;
        s->key[1].u64 = p->room.generation;
    } else if (m->opts.kind == KVF_MAP_STR) {
        s->key[0].skey = p->skey;
    }
}

/* 0 and the key's slot, or -ENOENT and the empty slot where it would go
 * (-ENOENT and nothing when the map has no table). */
static int find_slot(const struct kvf_map *m, const struct probe *p, size_t *pos_p)
{
    if (m->cap == 0)
        return -ENOENT;
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)p->hash & mask;; i = (i + 1) & mask) {
        const struct kvf_map_slot *s = slot_at(m, i);
        if (s->val == NULL) {
            *pos_p = i;
            return -ENOENT;
        }
        if (slot_matches(m, s, p)) {
            *pos_p = i;
            return 0;
        }
    }
}

/* The table size that holds `count` entries at most 3/4 full; 0 if that
 * many slots of `stride` bytes cannot be addressed. */
static size_t cap_for(size_t count, size_t stride)
{
    size_t cap = KVF_MAP_MIN_CAP;
    while (count > cap - cap / 4) {
        if (cap > SIZE_MAX / 2 / stride)
            return 0;
        cap *= 2;
    }
    return cap;
}

static int rehash(struct kvf_map *m, size_t cap)
{
    void *(*alloc)(size_t, size_t) = m->opts.alloc != NULL ? m->opts.alloc : calloc;
    unsigned char *table = alloc(cap, m->stride);
    if (table == NULL)
        return -ENOMEM;
    struct kvf_map bigger = *m;
    bigger.table = table;
    bigger.cap = cap;
    size_t mask = cap - 1;
    for (size_t i = 0; i < m->cap; i++) {
        const struct kvf_map_slot *s = slot_at(m, i);
        if (s->val == NULL)
            continue;
        size_t j = (size_t)s->hash & mask;
        while (slot_at(&bigger, j)->val != NULL)
            j = (j + 1) & mask;
        memcpy(slot_at(&bigger, j), s, m->stride);
    }
    free(m->table);
    m->table = table;
    m->cap = cap;
    return 0;
}

int kvf_map_reserve(struct kvf_map *m, size_t extra)
{
    if (extra > SIZE_MAX - m->count)
        return -ENOMEM;
    size_t need = m->count + extra;
    if (m->opts.max_count != 0 && need > m->opts.max_count)
        return -E2BIG;
    size_t cap = cap_for(need, m->stride);
    if (cap == 0)
        return -ENOMEM;
    if (cap <= m->cap)
        return 0;
    return rehash(m, cap);
}

static int put(struct kvf_map *m, const struct probe *p, void *val)
{
    if (val == NULL)
        return -EINVAL;
    size_t pos = 0; /* written by find_slot whenever it is read */
    if (find_slot(m, p, &pos) == 0) {
        /* The new value owns the key now (a string key lives in it). */
        slot_set_key(m, slot_at(m, pos), p);
        slot_at(m, pos)->val = val;
        return 0;
    }
    int rc = kvf_map_reserve(m, 1);
    if (rc != 0)
        return rc;
    find_slot(m, p, &pos);
    struct kvf_map_slot *s = slot_at(m, pos);
    slot_set_key(m, s, p);
    s->val = val;
    m->count++;
    return 0;
}

static void *get(const struct kvf_map *m, const struct probe *p)
{
    size_t pos = 0;
    return find_slot(m, p, &pos) == 0 ? slot_at(m, pos)->val : NULL;
}

static void *del(struct kvf_map *m, const struct probe *p)
{
    size_t pos = 0;
    if (find_slot(m, p, &pos) != 0)
        return NULL;
    void *val = slot_at(m, pos)->val;
    size_t mask = m->cap - 1;
    size_t hole = pos;
    for (size_t i = (pos + 1) & mask; slot_at(m, i)->val != NULL; i = (i + 1) & mask) {
        size_t home = (size_t)slot_at(m, i)->hash & mask;
        /* Move i into the hole unless its home lies after the hole, up to i. */
        if (((i - home) & mask) >= ((i - hole) & mask)) {
            memcpy(slot_at(m, hole), slot_at(m, i), m->stride);
            hole = i;
        }
    }
    memset(slot_at(m, hole), 0, m->stride);
    m->count--;
    return val;
}

static struct probe probe_u64(uint64_t key)
{
    return (struct probe){.hash = mix64(key)};
}

static struct probe probe_room(kvf_room_key key)
{
    return (struct probe){.hash = hash_room(key), .room = key};
}

static struct probe probe_str(const char *key)
{
    return (struct probe){.hash = hash_str(key), .skey = key};
}

int kvf_map_put_u64(struct kvf_map *m, uint64_t key, void *val)
{
    if (m->opts.kind != KVF_MAP_U64)
        return -EINVAL;
    struct probe p = probe_u64(key);
    return put(m, &p, val);
}

int kvf_map_put_room(struct kvf_map *m, kvf_room_key key, void *val)
{
    if (m->opts.kind != KVF_MAP_ROOM)
        return -EINVAL;
    struct probe p = probe_room(key);
    return put(m, &p, val);
}

int kvf_map_put_str(struct kvf_map *m, const char *key, void *val)
{
    if (m->opts.kind != KVF_MAP_STR || key == NULL)
        return -EINVAL;
    struct probe p = probe_str(key);
    return put(m, &p, val);
}

void *kvf_map_get_u64(const struct kvf_map *m, uint64_t key)
{
    if (m->opts.kind != KVF_MAP_U64)
        return NULL;
    struct probe p = probe_u64(key);
    return get(m, &p);
}

void *kvf_map_get_room(const struct kvf_map *m, kvf_room_key key)
{
    if (m->opts.kind != KVF_MAP_ROOM)
        return NULL;
    struct probe p = probe_room(key);
    return get(m, &p);
}

void *kvf_map_get_str(const struct kvf_map *m, const char *key)
{
    if (m->opts.kind != KVF_MAP_STR || key == NULL)
        return NULL;
    struct probe p = probe_str(key);
    return get(m, &p);
}

void *kvf_map_del_u64(struct kvf_map *m, uint64_t key)
{
    if (m->opts.kind != KVF_MAP_U64)
        return NULL;
    struct probe p = probe_u64(key);
    return del(m, &p);
}

void *kvf_map_del_room(struct kvf_map *m, kvf_room_key key)
{
    if (m->opts.kind != KVF_MAP_ROOM)
        return NULL;
    struct probe p = probe_room(key);
    return del(m, &p);
}

void *kvf_map_del_str(struct kvf_map *m, const char *key)
{
    if (m->opts.kind != KVF_MAP_STR || key == NULL)
        return NULL;
    struct probe p = probe_str(key);
    return del(m, &p);
}

void *kvf_map_next(const struct kvf_map *m, size_t *pos)
{
    while (*pos < m->cap) {
        void *val = slot_at(m, *pos)->val;
        (*pos)++;
        if (val != NULL)
            return val;
    }
    return NULL;
}
