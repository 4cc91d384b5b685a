/*
 * cp_test_util.c: helpers for the control-plane state core tests (see
 * cp_test_util.h). Every helper asserts what it needs with cmocka, so a test
 * reads as its scenario.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cp_test_util.h"

void test_random(void *ctx, void *buf, size_t len)
{
    uint64_t *s = ctx;
    unsigned char *out = buf;
    for (size_t i = 0; i < len; i++) {
        *s ^= *s >> 12;
        *s ^= *s << 25;
        *s ^= *s >> 27;
        out[i] = (unsigned char)((*s * 0x2545f4914f6cdd1dull) >> 56);
    }
}

struct fixture *fixture_new(const struct kvf_cps_opts *opts)
{
    struct fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->rng = 0x9e3779b97f4a7c15ull;
    f->now = 1000 * KVF_NS_PER_S;
    struct kvf_cps_opts o;
    if (opts != NULL)
        o = *opts;
    else
        kvf_cps_opts_init(&o);
    o.random_fn = test_random;
    o.random_ctx = &f->rng;
    f->st = kvf_cps_create(&o);
    assert_non_null(f->st);
    return f;
}

void fixture_free(struct fixture *f)
{
    kvf_cps_destroy(f->st);
    free(f);
}

void fx_collect(struct fixture *f)
{
    size_t n = 0;
    const struct kvf_cps_effect *fx = kvf_cps_effects_take(f->st, &n);
    assert_true(f->nfx + n <= FX_MAX);
    if (n > 0)
        memcpy(&f->fx[f->nfx], fx, n * sizeof(*fx));
    f->nfx += n;
}

void fx_reset(struct fixture *f)
{
    fx_collect(f);
    f->nfx = 0;
}

const struct kvf_cps_effect *fx_find(const struct fixture *f, enum kvf_cps_effect_kind kind,
                                     const char *node, size_t n)
{
    for (size_t i = 0; i < f->nfx; i++) {
        const struct kvf_cps_effect *e = &f->fx[i];
        if (e->kind != kind || (node != NULL && strcmp(e->node_id, node) != 0))
            continue;
        if (n-- == 0)
            return e;
    }
    return NULL;
}

size_t fx_count(const struct fixture *f, enum kvf_cps_effect_kind kind, const char *node)
{
    size_t c = 0;
    while (fx_find(f, kind, node, c) != NULL)
        c++;
    return c;
}

int attach_caps(struct fixture *f, const char *id, uint64_t inc, uint32_t pmin, uint32_t pmax,
                uint32_t features)
{
    struct kvf_cps_pool pool = {.pool_id = 1, .page_size = 65536, .page_count = 1024};
    struct kvf_cps_node_hello h = {
        .node_id = id,
        .incarnation = inc,
        .protocol_min = pmin,
        .protocol_max = pmax,
        .features = features,
        .pools = &pool,
        .pool_count = 1,
    };
    uint32_t version = 0;
    int rc = kvf_cps_node_attach(f->st, &h, f->now, &version, &f->err);
    fx_collect(f);
    return rc;
}

int attach(struct fixture *f, const char *id, uint64_t inc)
{
    return attach_caps(f, id, inc, 1, 1, KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_FENCE_V1);
}

int join(struct fixture *f, const struct join_args *a, struct kvf_cps_join_result *res)
{
    struct kvf_cps_page_range r = {.first = a->first, .count = a->count};
    struct kvf_cps_join j = {
        .room_id = a->room_id,
        .expected_sources = a->sources ? a->sources : 1,
        .expected_sinks = a->sinks ? a->sinks : 1,
        .node_id = a->node,
        .rank = a->rank,
        .role = a->role,
        .engine_protocol_min = a->pmin ? a->pmin : 1,
        .engine_protocol_max = a->pmax ? a->pmax : 1,
        .engine_features = a->features ? a->features : KVF_FEATURE_QUIESCE_V1,
        .pool_id = a->pool_id ? a->pool_id : 1,
        .ranges = a->count > 0 ? &r : NULL,
        .range_count = a->count > 0 ? 1 : 0,
    };
    struct kvf_cps_join_result tmp;
    kvf_error_clear(&f->err);
    int rc = kvf_cps_join(f->st, &j, f->now, res != NULL ? res : &tmp, &f->err);
    fx_collect(f);
    return rc;
}

kvf_room_key join_pair(struct fixture *f, uint64_t room_id)
{
    struct kvf_cps_node_view v;
    if (kvf_cps_node_get(f->st, "n1", &v) != 0)
        assert_int_equal(attach(f, "n1", 1), 0);
    if (kvf_cps_node_get(f->st, "n2", &v) != 0)
        assert_int_equal(attach(f, "n2", 1), 0);
    struct kvf_cps_join_result r1, r2;
    uint32_t first = (uint32_t)(room_id % 127) * 8; /* rooms of one test do not overlap */
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = room_id,
                                              .node = "n1",
                                              .role = KVF_CPS_ROLE_SOURCE,
                                              .first = first,
                                              .count = 8},
                          &r1),
                     0);
    assert_int_equal(r1.room_state, KVF_CPS_ROOM_OPENING);
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = room_id,
                                              .node = "n2",
                                              .role = KVF_CPS_ROLE_SINK,
                                              .first = first,
                                              .count = 8},
                          &r2),
                     0);
    assert_int_equal(r2.room_state, KVF_CPS_ROOM_ACTIVE);
    assert_true(kvf_room_key_eq(r1.key, r2.key));
    return r2.key;
}

void advance(struct fixture *f, kvf_time_ns dt)
{
    f->now += dt;
    kvf_cps_tick(f->st, f->now);
    fx_collect(f);
}

enum kvf_cps_room_state room_state(const struct fixture *f, kvf_room_key key)
{
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    return v.state;
}

enum kvf_cps_lease_state lease_state(const struct fixture *f, kvf_room_key key, size_t idx)
{
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, key, idx, &p), 0);
    return p.lease_state;
}

kvf_token room_token(const struct fixture *f, kvf_room_key key)
{
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    return v.token;
}
