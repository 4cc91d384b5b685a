/*
 * cp_map.h: the hash map of the control-plane state core (cp_map.c), also
 * used by the service for its registry of attached node sessions.
 *
 * DESIGN: no locking; each map belongs to one thread (the state thread).
 */
#ifndef KVF_CP_MAP_H
#define KVF_CP_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* An open-addressing map (linear probing, backward-shift deletion) from a u64
 * key or a string key to a non-NULL pointer. A string map stores the key
 * pointer, which the value must keep alive while it is in the map. */
struct cp_map_slot {
    uint64_t hash; /* the u64 key itself, or the hash of skey */
    const char *skey;
    void *val; /* NULL: empty slot */
};

struct cp_map {
    struct cp_map_slot *slots;
    size_t cap; /* 0 or a power of two */
    size_t count;
    bool str;
};

void cp_map_init(struct cp_map *m, bool str);
void cp_map_fini(struct cp_map *m);
/* Makes room for `extra` more entries, so that the next puts cannot fail. */
int cp_map_reserve(struct cp_map *m, size_t extra);
void *cp_map_get(const struct cp_map *m, uint64_t key);
void *cp_map_get_str(const struct cp_map *m, const char *key);
/* Inserts or replaces. Fails only with -ENOMEM (never after a reserve). */
int cp_map_put(struct cp_map *m, uint64_t key, void *val);
int cp_map_put_str(struct cp_map *m, const char *key, void *val);
void *cp_map_del(struct cp_map *m, uint64_t key);
void *cp_map_del_str(struct cp_map *m, const char *key);
/* Iterates: start with *pos = 0; returns NULL at the end. */
void *cp_map_next(const struct cp_map *m, size_t *pos);

#endif /* KVF_CP_MAP_H */
