/*
 * test_cp_nodes.c: nodes, incarnations and fences in the control-plane state
 * core.
 *
 * A SUSPECT node (session lost) must not abort or release anything (R12); it
 * gets its pending notices again at once when it re-attaches. A LOST node (ttl
 * passed, or replaced by a new incarnation) aborts its rooms, and its peers are
 * asked to fence it, once per pair, until they report it; only then are the
 * peers' leases released (the lost node's own wait for its host's proof:
 * test_cp_proof.c). The drain deadline escalates and asks for fences but never
 * releases, however far the clock runs. Each test fails if that rule breaks.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "cp_test_util.h"

#define SRC KVF_CPS_ROLE_SOURCE
#define SNK KVF_CPS_ROLE_SINK

static kvf_token abort_room(struct fixture *f, kvf_room_key key)
{
    kvf_token t = {0, 0};
    assert_int_equal(kvf_cps_room_abort(f->st, key, KVF_CPS_ABORT_ENGINE, f->now, &t, &f->err), 0);
    fx_collect(f);
    return t;
}

static int drained(struct fixture *f, const char *node, kvf_room_key key, kvf_token token)
{
    int rc = kvf_cps_report_drained(f->st, node, 1, key, token, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static int fenced(struct fixture *f, const char *fencer, const char *node, uint64_t inc)
{
    int rc = kvf_cps_report_fenced(f->st, fencer, 1, node, inc, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static int detach(struct fixture *f, const char *node)
{
    int rc = kvf_cps_node_detach(f->st, node, 1, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static enum kvf_cps_node_state node_state(const struct fixture *f, const char *id)
{
    struct kvf_cps_node_view v;
    assert_int_equal(kvf_cps_node_get(f->st, id, &v), 0);
    return v.state;
}

static struct kvf_cps_stats stats(const struct fixture *f)
{
    struct kvf_cps_stats s;
    kvf_cps_stats_get(f->st, &s);
    return s;
}

static void r12_suspect_node_aborts_and_releases_nothing(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 1);
    fx_reset(f);
    assert_int_equal(detach(f, "n1"), 0);
    assert_int_equal(node_state(f, "n1"), KVF_CPS_NODE_SUSPECT);
    assert_int_equal(stats(f).nodes_by_state[KVF_CPS_NODE_SUSPECT], 1);
    advance(f, 9 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_ACTIVE);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_STATE, NULL), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, NULL), 0);
    /* The session comes back within the ttl: nothing happened to the room. */
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(node_state(f, "n1"), KVF_CPS_NODE_ATTACHED);
    advance(f, 60 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    fixture_free(f);
}

static void reattach_of_suspect_node_reemits_pending_notices_at_once(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key a = join_pair(f, 2);
    kvf_room_key b = join_pair(f, 3);
    assert_int_equal(detach(f, "n1"), 0);
    kvf_token ta = abort_room(f, a);
    kvf_token tb = abort_room(f, b);
    /* Emitted anyway while SUSPECT (the sender drops them), still pending. */
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 2);
    assert_int_equal(room_state(f, a), KVF_CPS_ROOM_ABORTING);
    fx_reset(f);
    f->now += 50 * KVF_NS_PER_MS; /* well before the first re-send */
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"), 0);
    for (size_t i = 0; i < 2; i++) {
        const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n1", i);
        assert_int_equal(e->attempt, 1);
        kvf_token want = kvf_room_key_eq(e->key, a) ? ta : tb;
        assert_true(kvf_token_eq(e->token, want));
    }
    /* Drained notices are not re-sent on re-attach. */
    assert_int_equal(drained(f, "n1", a, ta), 0);
    assert_int_equal(detach(f, "n1"), 0);
    fx_reset(f);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);
    assert_true(kvf_room_key_eq(fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n1", 0)->key, b));
    fixture_free(f);
}

static void lost_node_after_ttl_aborts_room_released_after_peer_fenced(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 4);
    assert_int_equal(detach(f, "n2"), 0);
    fx_reset(f);
    advance(f, 10 * KVF_NS_PER_S + 1);
    assert_int_equal(node_state(f, "n2"), KVF_CPS_NODE_LOST);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    assert_int_equal(v.state, KVF_CPS_ROOM_ABORTING);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_NODE_LOST);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"), 0); /* a LOST node gets none */
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1"), 1);
    const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_FENCE_PEER, "n1", 0);
    assert_string_equal(e->peer_node, "n2");
    assert_int_equal(e->peer_incarnation, 1);
    assert_int_equal(e->attempt, 0);

    /* n1 drains, but n2 may still be writing into n1's pages. */
    assert_int_equal(drained(f, "n1", key, v.token), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    fx_reset(f);
    advance(f, 1 * KVF_NS_PER_S);
    assert_true(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1") >= 1); /* re-sent */
    assert_true(fx_find(f, KVF_CPS_FX_FENCE_PEER, "n1", 0)->attempt >= 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);

    assert_int_equal(fenced(f, "n1", "n2", 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    /* n1's pages are safe; n2's own pages wait for a proof from n2's host
     * (test_cp_proof.c). */
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n1"), 1);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(stats(f).notices_pending, 0);
    fx_reset(f);
    advance(f, 30 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, NULL), 0);
    fixture_free(f);
}

static void lost_node_released_only_after_every_peer_fenced(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    const char *nodes[3] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++)
        assert_int_equal(attach(f, nodes[i], 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 5, .sources = 2, .sinks = 1, .node = "a", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 5, .sources = 2, .sinks = 1, .node = "b", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 5, .sources = 2, .sinks = 1, .node = "c", .role = SNK, .count = 8},
             &r),
        0);
    assert_int_equal(detach(f, "c"), 0);
    advance(f, 11 * KVF_NS_PER_S);
    kvf_token t = room_token(f, r.key);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "a"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "b"), 1);
    assert_int_equal(drained(f, "a", r.key, t), 0);
    assert_int_equal(drained(f, "b", r.key, t), 0);
    assert_int_equal(fenced(f, "a", "c", 1), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, r.key, 2, &p), 0);
    assert_false(p.node_fenced);
    assert_int_equal(fenced(f, "a", "c", 1), 0); /* duplicate counts once */
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fenced(f, "b", "c", 1), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2); /* c's waits for c's host */
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "c"), 0);
    fixture_free(f);
}

static void new_incarnation_makes_old_one_lost(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 6);
    fx_reset(f);
    assert_int_equal(attach(f, "n2", 2), 0); /* n2 restarted */
    struct kvf_cps_node_view nv;
    assert_int_equal(kvf_cps_node_get(f->st, "n2", &nv), 0);
    assert_int_equal(nv.incarnation, 2);
    assert_int_equal(nv.state, KVF_CPS_NODE_ATTACHED);
    assert_int_equal(nv.room_count, 0);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    assert_int_equal(v.state, KVF_CPS_ROOM_ABORTING);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_NODE_LOST);
    const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_FENCE_PEER, "n1", 0);
    assert_non_null(e);
    assert_string_equal(e->peer_node, "n2");
    assert_int_equal(e->peer_incarnation, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"), 0);
    /* The old incarnation can neither come back nor report. */
    assert_int_equal(attach(f, "n2", 1), -ESTALE);
    assert_int_equal(drained(f, "n2", key, v.token), -ESTALE);
    assert_int_equal(drained(f, "n1", key, v.token), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fenced(f, "n1", "n2", 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    /* Being replaced proves nothing about n2:1's own host (a rollout may
     * overlap two processes); the new incarnation's witness does. */
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 1);
    assert_int_equal(kvf_cps_node_witness(f->st, "n2", 2, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    /* Expiring the tombstone frees the old incarnation; reports about it are unknown. */
    advance(f, 601 * KVF_NS_PER_S);
    assert_int_equal(fenced(f, "n1", "n2", 1), -ENOENT);
    assert_int_equal(stats(f).nodes_by_state[KVF_CPS_NODE_LOST], 0);
    fixture_free(f);
}

static void fence_requested_once_per_pair_across_rooms(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    join_pair(f, 7);
    join_pair(f, 8);
    join_pair(f, 9);
    fx_reset(f);
    assert_int_equal(detach(f, "n2"), 0);
    advance(f, 11 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1"), 1);
    assert_int_equal(stats(f).fences_requested, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_STATE, NULL), 3);
    fixture_free(f);
}

static void drain_deadline_escalates_and_fences_but_never_releases(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 10);
    kvf_token t = abort_room(f, key);
    assert_int_equal(drained(f, "n1", key, t), 0);
    fx_reset(f);
    advance(f, 59 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ESCALATION, NULL), 0);
    advance(f, 2 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ESCALATION, NULL), 1);
    assert_non_null(fx_find(f, KVF_CPS_FX_ESCALATION, "n2", 0));
    const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_FENCE_PEER, "n1", 0);
    assert_non_null(e);
    assert_string_equal(e->peer_node, "n2");
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    assert_true(v.escalated);
    assert_int_equal(stats(f).rooms_past_deadline, 1);
    /* A day later, in 10 s steps: still no release. */
    for (int i = 0; i < 8640; i++) {
        advance(f, 10 * KVF_NS_PER_S);
        fx_reset(f);
    }
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(stats(f).leases_by_state[KVF_CPS_LEASE_RELEASED], 0);
    /* n1 cut n2 off, which protects n1's pages; but n2 is still attached
     * and may still run local work on its own pages, so only its own drain
     * (or its loss) ends the room. */
    assert_int_equal(fenced(f, "n1", "n2", 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(stats(f).leases_by_state[KVF_CPS_LEASE_RELEASED], 0);
    assert_int_equal(drained(f, "n2", key, t), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    assert_int_equal(stats(f).rooms_past_deadline, 0);
    fixture_free(f);
}

static void single_host_room_of_a_lost_host_is_quiescent_at_once(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "solo", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 11, .node = "solo", .role = SRC, .first = 0, .count = 8},
                          &r),
                     0);
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 11, .node = "solo", .role = SNK, .first = 8, .count = 8},
                          &r),
                     0);
    assert_int_equal(r.room_state, KVF_CPS_ROOM_ACTIVE);
    assert_int_equal(detach(f, "solo"), 0);
    advance(f, 11 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    /* No peer to protect; its own pages wait for its host's proof. */
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "solo"), 0);
    assert_int_equal(attach(f, "solo", 2), 0);
    assert_int_equal(kvf_cps_node_witness(f->st, "solo", 2, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "solo"), 2);
    fixture_free(f);
}

static void single_host_room_of_a_live_host_waits_for_its_drain(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "solo", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 13, .node = "solo", .role = SRC, .first = 0, .count = 8},
                          &r),
                     0);
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 13, .node = "solo", .role = SNK, .first = 8, .count = 8},
                          &r),
                     0);
    kvf_token t = abort_room(f, r.key);
    advance(f, 3600 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(kvf_cps_report_drained(f->st, "solo", 1, r.key, t, f->now, &f->err), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    fixture_free(f);
}

static void admin_fence_asks_every_peer_once(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 14);
    fx_reset(f);
    assert_int_equal(kvf_cps_admin_fence(f->st, "n2", f->now, &f->err), 0);
    assert_int_equal(kvf_cps_admin_fence(f->st, "n2", f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n2"), 0);
    assert_int_equal(kvf_cps_admin_fence(f->st, "ghost", f->now, &f->err), -ENOENT);
    /* A fence alone aborts nothing. */
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    fixture_free(f);
}

static void attach_validates_hello(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach_caps(f, "future", 1, 5, 7, KVF_FEATURE_QUIESCE_V1), -ENOTSUP);
    assert_non_null(strstr(f->err.msg, "5..7"));
    assert_int_equal(attach(f, "", 1), -EINVAL);
    assert_int_equal(attach(f, "n1", 0), -EINVAL);
    assert_int_equal(attach(f, "n1", 5), 0);
    assert_int_equal(attach(f, "n1", 4), -ESTALE);
    struct kvf_cps_pool pools[3] = {{1, 4096, 16}, {2, 4096, 16}, {3, 4096, 16}};
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.max_pools_per_node = 2;
    struct fixture *g = fixture_new(&o);
    struct kvf_cps_node_hello h = {.node_id = "x",
                                   .incarnation = 1,
                                   .protocol_min = 1,
                                   .protocol_max = 1,
                                   .features = KVF_FEATURE_QUIESCE_V1,
                                   .pools = pools,
                                   .pool_count = 3};
    assert_int_equal(kvf_cps_node_attach(g->st, &h, g->now, NULL, &g->err), -E2BIG);
    assert_non_null(strstr(g->err.msg, "limit 2"));
    pools[1].pool_id = 1;
    h.pool_count = 2;
    assert_int_equal(kvf_cps_node_attach(g->st, &h, g->now, NULL, &g->err), -EINVAL);
    struct kvf_cps_node_view v;
    assert_int_equal(kvf_cps_node_get(g->st, "x", &v), -ENOENT);
    fixture_free(g);
    fixture_free(f);
}

static void pool_with_leases_keeps_its_size(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    join_pair(f, 15);
    struct kvf_cps_pool bigger = {.pool_id = 1, .page_size = 65536, .page_count = 2048};
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &bigger, &f->err), -EBUSY);
    struct kvf_cps_pool other = {.pool_id = 2, .page_size = 4096, .page_count = 10};
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &other, &f->err), 0);
    other.page_count = 20; /* no leases yet: may change */
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &other, &f->err), 0);
    struct kvf_cps_node_view v;
    assert_int_equal(kvf_cps_node_get(f->st, "n1", &v), 0);
    assert_int_equal(v.pool_count, 2);
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 2, &other, &f->err), -ESTALE);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(r12_suspect_node_aborts_and_releases_nothing),
        cmocka_unit_test(reattach_of_suspect_node_reemits_pending_notices_at_once),
        cmocka_unit_test(lost_node_after_ttl_aborts_room_released_after_peer_fenced),
        cmocka_unit_test(lost_node_released_only_after_every_peer_fenced),
        cmocka_unit_test(new_incarnation_makes_old_one_lost),
        cmocka_unit_test(fence_requested_once_per_pair_across_rooms),
        cmocka_unit_test(drain_deadline_escalates_and_fences_but_never_releases),
        cmocka_unit_test(single_host_room_of_a_lost_host_is_quiescent_at_once),
        cmocka_unit_test(single_host_room_of_a_live_host_waits_for_its_drain),
        cmocka_unit_test(admin_fence_asks_every_peer_once),
        cmocka_unit_test(attach_validates_hello),
        cmocka_unit_test(pool_with_leases_keeps_its_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
