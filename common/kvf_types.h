/*
 * kvf_types.h: the few value types every kvfence layer shares.
 *
 * A room is named by the router's 63-bit room id; the control plane adds a
 * generation so that a reused id never matches an old room's messages
 * (docs/design.md §1). Generations come from one counter per control plane, so they
 * only grow, across ids and across restarts (the counter is part of the
 * durable state).
 *
 * Nothing here does I/O or reads a clock: the state cores include this header.
 */
#ifndef KVF_TYPES_H
#define KVF_TYPES_H

#include <stdbool.h>
#include <stdint.h>

/* Largest room id the router may mint (63 bits). */
#define KVF_ROOM_ID_MAX ((uint64_t)INT64_MAX)

/* Longest node id, in bytes (ids are 1..KVF_NODE_ID_MAX bytes): one limit for
 * the control plane's state, its service and certificate checks, and the node. */
#define KVF_NODE_ID_MAX 128

/* One room-generation. Generation 0 is never minted: it means "unknown". */
typedef struct kvf_room_key {
    uint64_t room_id;
    uint64_t generation;
} kvf_room_key;

static inline bool kvf_room_key_eq(kvf_room_key a, kvf_room_key b)
{
    return a.room_id == b.room_id && a.generation == b.generation;
}

/* A 128-bit abort token, minted once per aborted room-generation. All zero
 * means "no token" and never proves anything. */
typedef struct kvf_token {
    uint64_t hi;
    uint64_t lo;
} kvf_token;

static inline bool kvf_token_is_zero(kvf_token t)
{
    return t.hi == 0 && t.lo == 0;
}

static inline bool kvf_token_eq(kvf_token a, kvf_token b)
{
    return a.hi == b.hi && a.lo == b.lo;
}

/* Time as the state cores see it: nanoseconds on a monotonic clock that the
 * caller reads and passes in. The cores never read a clock themselves. */
typedef uint64_t kvf_time_ns;

#define KVF_NS_PER_MS 1000000ull
#define KVF_NS_PER_S  1000000000ull

/* Protocol versions this build speaks (docs/design.md §5). */
#define KVF_PROTOCOL_MIN 1u
#define KVF_PROTOCOL_MAX 1u

/* Feature bits. The wire carries names (api/kvfence/v1/types.proto); these
 * bits are their in-memory form. kvf_feature_name() maps one to the other. */
enum kvf_feature {
    KVF_FEATURE_QUIESCE_V1 = 1u << 0,   /* drain/abort protocol with tokens: required */
    KVF_FEATURE_FENCE_V1 = 1u << 1,     /* can fence a peer on request */
    KVF_FEATURE_RDMA = 1u << 2,         /* libibverbs RC transport */
    KVF_FEATURE_TCP = 1u << 3,          /* TCP transport */
    KVF_FEATURE_CUDA_STAGING = 1u << 4, /* CUDA staging buffers */
    KVF_FEATURE_LOCAL = 1u << 5,        /* same-host copies */
};
#define KVF_FEATURE_COUNT 6

/* Features every participant of a room must advertise. */
#define KVF_FEATURES_REQUIRED ((uint32_t)KVF_FEATURE_QUIESCE_V1)

/* Returns the wire name of one feature bit ("QUIESCE_V1"), or NULL. */
const char *kvf_feature_name(uint32_t bit);

/* Parses a wire name; returns its bit, or 0 for a name this build does not
 * know (unknown features are ignored, never an error). */
uint32_t kvf_feature_from_name(const char *name);

/* Returns the lowest bit of `required` missing from `have`, or 0. */
static inline uint32_t kvf_features_first_missing(uint32_t have, uint32_t required)
{
    uint32_t missing = required & ~have;
    return missing & (~missing + 1u);
}

#endif /* KVF_TYPES_H */
