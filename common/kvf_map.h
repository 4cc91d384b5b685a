/*
 * kvf_map.h: the one hash map of kvfence, from a key to a non-NULL pointer.
 *
 * Keys come in three kinds, fixed when the map is initialised:
 *   KVF_MAP_U64   a 64-bit id (room id, lease id, incarnation)
 *   KVF_MAP_ROOM  a kvf_room_key (room id and generation)
 *   KVF_MAP_STR   a NUL-terminated string; the map keeps the pointer, not a
 *                 copy, so the key must live as long as its entry (usually
 *                 it lives inside the value)
 * Calling a function of another kind than the map's returns -EINVAL (or NULL).
 *
 * Open addressing with linear probing; removal shifts later members of the
 * cluster back, so there are no tombstones and lookups stay short after any
 * mix of puts and removals. The table doubles when it would be more than 3/4
 * full and never shrinks. Every operation is O(1) expected. A slot costs 16
 * bytes for a u64 key, 24 for a string, 32 for a room key.
 *
 * Bounds: with opts.max_count set, a put of a new key into a map that holds
 * max_count entries fails with -E2BIG, and the table never grows beyond what
 * max_count needs. A failed allocation leaves the map as it was (-ENOMEM).
 *
 * Pure: no I/O, no clock, no threads, so the state cores may use it. A map is
 * owned by one thread (or guarded by its owner's lock); it is not thread-safe.
 * The struct is public so that it can be embedded by value; its fields are
 * private to kvf_map.c.
 */
#ifndef KVF_MAP_H
#define KVF_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

enum kvf_map_kind {
    KVF_MAP_U64 = 0,
    KVF_MAP_ROOM = 1,
    KVF_MAP_STR = 2,
};

struct kvf_map_opts {
    enum kvf_map_kind kind;
    size_t max_count; /* most entries; 0: no bound but memory */
    /* calloc-like allocator for the table; NULL: calloc. Tests use it to
     * fail allocations. The table is freed with free(). */
    void *(*alloc)(size_t nmemb, size_t size);
};

/* A slot: the hash and the value, then the key words the kind needs. U64
 * keys need none: their hash is a bijection of the key, so equal hashes mean
 * equal keys. Slots are 16 (U64), 24 (STR) or 32 (ROOM) bytes. */
union kvf_map_key_word {
    uint64_t u64;     /* ROOM: room_id, then generation */
    const char *skey; /* STR: the key */
};

struct kvf_map_slot {
    uint64_t hash;
    void *val; /* NULL: the slot is empty */
    union kvf_map_key_word key[];
};

struct kvf_map {
    unsigned char *table; /* cap slots of `stride` bytes */
    size_t cap;           /* 0 or a power of two */
    size_t count;
    size_t stride;
    struct kvf_map_opts opts;
};

/* Fills `opts` with the defaults for `kind`: no bound, calloc. */
void kvf_map_opts_init(struct kvf_map_opts *opts, enum kvf_map_kind kind);

/* Initialises an empty map; allocates nothing (the first put does). `opts`
 * may be NULL for a KVF_MAP_U64 map with the defaults. */
void kvf_map_init(struct kvf_map *m, const struct kvf_map_opts *opts);

/* Frees the table (not the values). The map is empty and usable again.
 * Accepts a map that was never used. */
void kvf_map_fini(struct kvf_map *m);

/* Number of entries. */
size_t kvf_map_count(const struct kvf_map *m);

/* Makes room for `extra` more entries, so that as many puts of new keys
 * cannot fail with -ENOMEM. Returns 0, -ENOMEM, or -E2BIG when count + extra
 * exceeds max_count. */
int kvf_map_reserve(struct kvf_map *m, size_t extra);

/* Puts key -> val, replacing the value of a key already there (the map then
 * does not grow). Returns 0, -EINVAL (val NULL, a NULL string key, or a map
 * of another kind), -E2BIG (a new key and the map is at max_count) or -ENOMEM;
 * on error the map is unchanged. */
int kvf_map_put_u64(struct kvf_map *m, uint64_t key, void *val);
int kvf_map_put_room(struct kvf_map *m, kvf_room_key key, void *val);
int kvf_map_put_str(struct kvf_map *m, const char *key, void *val);

/* The value of `key`, or NULL when absent (or the map is of another kind). */
void *kvf_map_get_u64(const struct kvf_map *m, uint64_t key);
void *kvf_map_get_room(const struct kvf_map *m, kvf_room_key key);
void *kvf_map_get_str(const struct kvf_map *m, const char *key);

/* Removes `key` and returns its value, or NULL when absent. Never fails and
 * never allocates. */
void *kvf_map_del_u64(struct kvf_map *m, uint64_t key);
void *kvf_map_del_room(struct kvf_map *m, kvf_room_key key);
void *kvf_map_del_str(struct kvf_map *m, const char *key);

/* Iteration, in no particular order:
 *     size_t pos = 0;
 *     void *v;
 *     while ((v = kvf_map_next(m, &pos)) != NULL) ...
 * Returns the next value, or NULL at the end. The map must not change during
 * an iteration (collect, then remove). */
void *kvf_map_next(const struct kvf_map *m, size_t *pos);

#endif /* KVF_MAP_H */
