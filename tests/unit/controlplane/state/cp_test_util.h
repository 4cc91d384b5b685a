/*
 * cp_test_util.h: small helpers shared by the control-plane state core tests:
 * a deterministic random source, a fixture that owns one kvf_cps and the
 * effects of its last call, and one-line ways to attach a node or join a room.
 */
#ifndef CP_TEST_UTIL_H
#define CP_TEST_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cp_state.h"

#define FX_MAX 4096

struct fixture {
    struct kvf_cps *st;
    uint64_t rng;
    kvf_time_ns now;
    struct kvf_cps_effect fx[FX_MAX]; /* effects of the calls since the last fx_reset */
    size_t nfx;
    struct kvf_error err;
};

/* Deterministic xorshift64* random source (ctx: uint64_t state). */
void test_random(void *ctx, void *buf, size_t len);

/* Creates the state with `opts` (NULL: defaults) and the test random source. */
struct fixture *fixture_new(const struct kvf_cps_opts *opts);
void fixture_free(struct fixture *f);

/* Appends the effects emitted since the last call to f->fx. */
void fx_collect(struct fixture *f);
void fx_reset(struct fixture *f);
/* Counts collected effects of `kind` addressed to `node` (NULL: any node). */
size_t fx_count(const struct fixture *f, enum kvf_cps_effect_kind kind, const char *node);
/* The n-th collected effect of `kind` to `node` (NULL: any), or NULL. */
const struct kvf_cps_effect *fx_find(const struct fixture *f, enum kvf_cps_effect_kind kind,
                                     const char *node, size_t n);

/* Attaches `id` at `inc`, protocol 1..1, QUIESCE_V1|FENCE_V1, pool 1 of 1024 pages. */
int attach(struct fixture *f, const char *id, uint64_t inc);
int attach_caps(struct fixture *f, const char *id, uint64_t inc, uint32_t pmin, uint32_t pmax,
                uint32_t features);

struct join_args {
    uint64_t room_id;
    uint32_t sources, sinks;
    const char *node;
    uint32_t rank;
    enum kvf_cps_role role;
    uint32_t first, count; /* one range; count 0: no range (dummy rank) */
    uint32_t pool_id;      /* 0 means pool 1 */
    uint32_t pmin, pmax;   /* 0 means 1..1 */
    uint32_t features;     /* 0 means QUIESCE_V1 */
};

int join(struct fixture *f, const struct join_args *a, struct kvf_cps_join_result *res);

/* Attaches n1 and n2 (if not yet) and joins room `room_id`: n1 source rank 0
 * pages [0,8), n2 sink rank 0 pages [0,8). Asserts the room is ACTIVE. */
kvf_room_key join_pair(struct fixture *f, uint64_t room_id);

/* Advances the clock by `dt` and ticks. */
void advance(struct fixture *f, kvf_time_ns dt);

enum kvf_cps_room_state room_state(const struct fixture *f, kvf_room_key key);
enum kvf_cps_lease_state lease_state(const struct fixture *f, kvf_room_key key, size_t idx);
kvf_token room_token(const struct fixture *f, kvf_room_key key);

#endif /* CP_TEST_UTIL_H */
