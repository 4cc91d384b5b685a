/*
 * cp_map.c: the hash maps of the control-plane state core (room id -> room,
 * lease id -> lease, node id -> node).
 *
 * Open addressing with linear probing and backward-shift deletion, so there
 * are no deleted markers and a lookup stops at the first empty slot. The table
 * doubles when it would be more than 3/4 full; it never shrinks (a control
 * plane that once held 100,000 rooms will again). Values are non-NULL
 * pointers; a string map keeps a pointer to the key, owned by the value.
 * Every operation is O(1) expected.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state_internal.h"

#define CP_MAP_MIN_CAP 16

static uint64_t mix64(uint64_t x)
{
    /* splitmix64 finaliser: room ids come from a router's PRNG, lease ids
     * count up; either way the low bits must spread. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s != '\0'; s++) {
        h ^= (unsigned char)*s;
        h *= 0x100000001b3ull;
    }
    return h;
}

void cp_map_init(struct cp_map *m, bool str)
{
    memset(m, 0, sizeof(*m));
    m->str = str;
}

void cp_map_fini(struct cp_map *m)
{
    free(m->slots);
    m->slots = NULL;
    m->cap = 0;
    m->count = 0;
}

static size_t home_of(const struct cp_map *m, uint64_t hash)
{
    return (size_t)mix64(hash) & (m->cap - 1);
}

static bool slot_matches(const struct cp_map *m, const struct cp_map_slot *s, uint64_t hash,
                         const char *skey)
{
    if (s->hash != hash)
        return false;
    if (!m->str)
        return true;
    return skey != NULL && strcmp(s->skey, skey) == 0;
}

static int find_slot(const struct cp_map *m, uint64_t hash, const char *skey, size_t *pos_p)
{
    if (m->cap == 0)
        return -ENOENT;
    size_t i = home_of(m, hash);
    for (;;) {
        const struct cp_map_slot *s = &m->slots[i];
        if (s->val == NULL) {
            *pos_p = i;
            return -ENOENT;
        }
        if (slot_matches(m, s, hash, skey)) {
            *pos_p = i;
            return 0;
        }
        i = (i + 1) & (m->cap - 1);
    }
}

static int rehash(struct cp_map *m, size_t cap)
{
    struct cp_map_slot *slots = calloc(cap, sizeof(*slots));
    if (slots == NULL)
        return -ENOMEM;
    struct cp_map_slot *old = m->slots;
    size_t old_cap = m->cap;
    m->slots = slots;
    m->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (old[i].val == NULL)
            continue;
        size_t j = home_of(m, old[i].hash);
        while (slots[j].val != NULL)
            j = (j + 1) & (cap - 1);
        slots[j] = old[i];
    }
    free(old);
    return 0;
}

int cp_map_reserve(struct cp_map *m, size_t extra)
{
    size_t need = m->count + extra;
    size_t cap = m->cap == 0 ? CP_MAP_MIN_CAP : m->cap;
    while (need > cap - cap / 4)
        cap *= 2;
    if (cap == m->cap)
        return 0;
    return rehash(m, cap);
}

void *cp_map_get(const struct cp_map *m, uint64_t key)
{
    size_t pos = 0; /* written by find_slot on success; gcc cannot tell */
    return find_slot(m, key, NULL, &pos) == 0 ? m->slots[pos].val : NULL;
}

void *cp_map_get_str(const struct cp_map *m, const char *key)
{
    size_t pos = 0;
    return find_slot(m, hash_str(key), key, &pos) == 0 ? m->slots[pos].val : NULL;
}

static int put(struct cp_map *m, uint64_t hash, const char *skey, void *val)
{
    size_t pos = 0;
    if (find_slot(m, hash, skey, &pos) == 0) {
        m->slots[pos].val = val;
        m->slots[pos].skey = skey;
        return 0;
    }
    int rc = cp_map_reserve(m, 1);
    if (rc != 0)
        return rc;
    find_slot(m, hash, skey, &pos);
    m->slots[pos] = (struct cp_map_slot){.hash = hash, .skey = skey, .val = val};
    m->count++;
    return 0;
}

int cp_map_put(struct cp_map *m, uint64_t key, void *val)
{
    return put(m, key, NULL, val);
}

int cp_map_put_str(struct cp_map *m, const char *key, void *val)
{
    return put(m, hash_str(key), key, val);
}

static void *del(struct cp_map *m, uint64_t hash, const char *skey)
{
    size_t pos = 0;
    if (find_slot(m, hash, skey, &pos) != 0)
        return NULL;
    void *val = m->slots[pos].val;
    /* Backward shift: pull later members of the cluster into the hole when
     * their home slot does not lie (cyclically) between the hole and them. */
    size_t hole = pos;
    size_t i = (pos + 1) & (m->cap - 1);
    while (m->slots[i].val != NULL) {
        size_t home = home_of(m, m->slots[i].hash);
        size_t dist_i = (i - home) & (m->cap - 1);
        size_t dist_hole = (hole - home) & (m->cap - 1);
        if (dist_hole < dist_i) {
            m->slots[hole] = m->slots[i];
            hole = i;
        }
        i = (i + 1) & (m->cap - 1);
    }
    m->slots[hole] = (struct cp_map_slot){0};
    m->count--;
    return val;
}

void *cp_map_del(struct cp_map *m, uint64_t key)
{
    return del(m, key, NULL);
}

void *cp_map_del_str(struct cp_map *m, const char *key)
{
    return del(m, hash_str(key), key);
}

void *cp_map_next(const struct cp_map *m, size_t *pos)
{
    while (*pos < m->cap) {
        void *val = m->slots[*pos].val;
        (*pos)++;
        if (val != NULL)
            return val;
    }
    return NULL;
}
