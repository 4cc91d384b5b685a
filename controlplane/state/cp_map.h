/*
 * cp_map.h: the hash maps of the control-plane state core (room id -> room,
 * lease id -> lease, node id -> node), also used by the service for its
 * registry of attached node sessions.
 *
 * They are kvfence's one hash map, kvf_map (common/kvf_map.h): these inline
 * functions only keep the core's short names and its choice, made at init,
 * between a u64 map and a string map. The map is pure, so the core stays
 * free of I/O.
 *
 * DESIGN: no locking; each map belongs to one thread (the state thread).
 */
#ifndef KVF_CP_MAP_H
#define KVF_CP_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_map.h"

/* A u64 map (`str` false) or a string map whose key pointer the value keeps
 * alive while it is in the map. */
static inline void cp_map_init(struct kvf_map *m, bool str)
{
    struct kvf_map_opts opts;
    kvf_map_opts_init(&opts, str ? KVF_MAP_STR : KVF_MAP_U64);
    kvf_map_init(m, &opts);
}

static inline void cp_map_fini(struct kvf_map *m)
{
    kvf_map_fini(m);
}

/* Makes room for `extra` more entries, so that the next puts cannot fail. */
static inline int cp_map_reserve(struct kvf_map *m, size_t extra)
{
    return kvf_map_reserve(m, extra);
}

static inline void *cp_map_get(const struct kvf_map *m, uint64_t key)
{
    return kvf_map_get_u64(m, key);
}

static inline void *cp_map_get_str(const struct kvf_map *m, const char *key)
{
    return kvf_map_get_str(m, key);
}

/* Inserts or replaces. Fails only with -ENOMEM (never after a reserve). */
static inline int cp_map_put(struct kvf_map *m, uint64_t key, void *val)
{
    return kvf_map_put_u64(m, key, val);
}

static inline int cp_map_put_str(struct kvf_map *m, const char *key, void *val)
{
    return kvf_map_put_str(m, key, val);
}

static inline void *cp_map_del(struct kvf_map *m, uint64_t key)
{
    return kvf_map_del_u64(m, key);
}

static inline void *cp_map_del_str(struct kvf_map *m, const char *key)
{
    return kvf_map_del_str(m, key);
}

/* Iterates: start with *pos = 0; returns NULL at the end. */
static inline void *cp_map_next(const struct kvf_map *m, size_t *pos)
{
    return kvf_map_next(m, pos);
}

#endif /* KVF_CP_MAP_H */
