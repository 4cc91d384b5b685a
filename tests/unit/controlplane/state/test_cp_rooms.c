/*
 * test_cp_rooms.c: rooms of the control-plane state core, end to end.
 *
 * Each test is one race scenario (R1..R13, tests/README.md) or one rule of
 * docs/state-cores.md, driven by hand with an explicit clock and a
 * deterministic random source: join, ACTIVE, completion, abort, tokens and
 * generations, the drain barrier, re-sends, join timeout, capabilities and
 * tombstones. Every test checks the invariant it is named for (no early
 * release, exactly once, tokens prove, all or nothing, no mixed protocol), so
 * it fails if the core breaks it. Node loss and fences are in test_cp_nodes.c,
 * page overlap and bad inputs in test_cp_pages.c.
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

static int drained(struct fixture *f, const char *node, kvf_room_key key, kvf_token token)
{
    kvf_error_clear(&f->err);
    int rc = kvf_cps_report_drained(f->st, node, 1, key, token, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static int completed(struct fixture *f, const char *node, kvf_room_key key, uint32_t rank,
                     enum kvf_cps_role role)
{
    int rc = kvf_cps_report_completed(f->st, node, 1, key, rank, role, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static kvf_token abort_room(struct fixture *f, kvf_room_key key)
{
    kvf_token t = {0, 0};
    assert_int_equal(kvf_cps_room_abort(f->st, key, KVF_CPS_ABORT_ENGINE, f->now, &t, &f->err), 0);
    fx_collect(f);
    assert_false(kvf_token_is_zero(t));
    return t;
}

static struct kvf_cps_stats stats(const struct fixture *f)
{
    struct kvf_cps_stats s;
    kvf_cps_stats_get(f->st, &s);
    return s;
}

static void success_lifecycle_releases_each_lease_exactly_once(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 42);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    assert_int_equal(stats(f).leases_by_state[KVF_CPS_LEASE_ACTIVE], 2);
    fx_reset(f);

    assert_int_equal(completed(f, "n1", key, 0, SRC), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    assert_int_equal(completed(f, "n1", key, 0, SRC), 0); /* a duplicate counts once */
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);

    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_COMPLETED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    const struct kvf_cps_effect *a = fx_find(f, KVF_CPS_FX_LEASE_RELEASED, NULL, 0);
    const struct kvf_cps_effect *b = fx_find(f, KVF_CPS_FX_LEASE_RELEASED, NULL, 1);
    assert_true(a->lease_id != b->lease_id);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);

    /* Late reports and aborts change nothing and release nothing again. */
    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    kvf_token t = {1, 1};
    assert_int_equal(kvf_cps_room_abort(f->st, key, KVF_CPS_ABORT_ENGINE, f->now, &t, &f->err),
                     -EPERM);
    assert_true(kvf_token_is_zero(t));
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, NULL), 0);

    struct kvf_cps_stats s = stats(f);
    assert_int_equal(s.rooms_by_state[KVF_CPS_ROOM_COMPLETED], 1);
    assert_int_equal(s.rooms_by_state[KVF_CPS_ROOM_ACTIVE], 0);
    assert_int_equal(s.leases_by_state[KVF_CPS_LEASE_RELEASED], 2);
    assert_int_equal(s.leases_by_state[KVF_CPS_LEASE_ACTIVE], 0);
    assert_int_equal(s.generation, key.generation);
    assert_int_equal(s.notices_pending, 0);
    fixture_free(f);
}

static void abort_before_all_joined_refuses_later_join(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f, &(struct join_args){.room_id = 5, .node = "n1", .role = SRC, .count = 4}, &r), 0);
    assert_int_equal(r.room_state, KVF_CPS_ROOM_OPENING);
    abort_room(f, r.key);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(lease_state(f, r.key, 0), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);

    assert_int_equal(
        join(f, &(struct join_args){.room_id = 5, .node = "n2", .role = SNK, .count = 4}, NULL),
        -ECANCELED);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, r.key, &v), 0);
    assert_int_equal(v.participant_count, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0); /* no page address left */
    fixture_free(f);
}

static void abort_is_idempotent_same_token_one_state_change(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 9);
    fx_reset(f);
    kvf_token t1 = abort_room(f, key);
    kvf_token t2 = abort_room(f, key);
    kvf_token t3 = {0, 0};
    assert_int_equal(
        kvf_cps_room_abort(f->st, (kvf_room_key){9, 0}, KVF_CPS_ABORT_ADMIN, f->now, &t3, &f->err),
        0);
    fx_collect(f);
    assert_true(kvf_token_eq(t1, t2));
    assert_true(kvf_token_eq(t1, t3));
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_STATE, NULL), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"), 1);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), 0);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_ENGINE); /* the first reason stays */
    assert_int_equal(stats(f).notices_sent, 2);
    fixture_free(f);
}

static void r6_two_ranks_abort_same_room_both_get_the_token(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 6, .sources = 1, .sinks = 2, .node = "n1", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 6,
                                              .sources = 1,
                                              .sinks = 2,
                                              .node = "n2",
                                              .rank = 0,
                                              .role = SNK,
                                              .first = 0,
                                              .count = 4},
                          &r),
                     0);
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 6,
                                              .sources = 1,
                                              .sinks = 2,
                                              .node = "n2",
                                              .rank = 1,
                                              .role = SNK,
                                              .first = 4,
                                              .count = 4},
                          &r),
                     0);
    assert_int_equal(r.room_state, KVF_CPS_ROOM_ACTIVE);
    fx_reset(f);
    /* Both decode ranks abort; then one reports a failed transfer too. */
    kvf_token t0 = abort_room(f, r.key);
    kvf_token t1 = abort_room(f, r.key);
    kvf_token t2 = {0, 0};
    assert_int_equal(kvf_cps_report_failed(f->st, "n2", 1, r.key, f->now, &t2, &f->err), 0);
    fx_collect(f);
    assert_true(kvf_token_eq(t0, t1));
    assert_true(kvf_token_eq(t0, t2));
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_STATE, NULL), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"),
                     1); /* one per node, not per rank */
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);
    assert_true(kvf_token_eq(fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n2", 0)->token, t0));
    /* The one drained report of n2 covers both of its ranks. */
    assert_int_equal(drained(f, "n2", r.key, t0), 0);
    assert_int_equal(drained(f, "n1", r.key, t0), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 3);
    fixture_free(f);
}

static void drained_without_token_is_not_counted(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 10);
    abort_room(f, key);
    assert_int_equal(drained(f, "n1", key, (kvf_token){0, 0}), -EINVAL);
    assert_int_equal(drained(f, "n2", key, (kvf_token){0, 0}), -EINVAL);
    assert_int_equal(stats(f).reports_tokenless, 2);
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &p), 0);
    assert_false(p.node_drained);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    fixture_free(f);
}

static void drained_with_stale_token_is_not_counted(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 11);
    kvf_token t = abort_room(f, key);
    kvf_token bad = t;
    bad.lo ^= 1;
    assert_int_equal(drained(f, "n1", key, bad), -ESTALE);
    assert_int_equal(drained(f, "n2", key, bad), -ESTALE);
    assert_int_equal(stats(f).reports_stale, 2);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    /* A drained report for a room that was never aborted has no token to match. */
    kvf_room_key key2 = join_pair(f, 12);
    assert_int_equal(drained(f, "n1", key2, t), -ESTALE);
    assert_int_equal(room_state(f, key2), KVF_CPS_ROOM_ACTIVE);
    fixture_free(f);
}

static void r13_reused_room_id_old_generation_report_not_counted(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key old = join_pair(f, 13);
    kvf_token old_token = abort_room(f, old);
    assert_int_equal(drained(f, "n1", old, old_token), 0);
    assert_int_equal(drained(f, "n2", old, old_token), 0);
    assert_int_equal(room_state(f, old), KVF_CPS_ROOM_ABORTED);

    /* The router reuses id 13 while the tombstone is still there. */
    kvf_room_key cur = join_pair(f, 13);
    assert_int_equal(cur.room_id, old.room_id);
    assert_true(cur.generation > old.generation);
    kvf_token cur_token = abort_room(f, cur);
    assert_false(kvf_token_eq(cur_token, old_token));
    uint64_t stale_before = stats(f).reports_stale;

    /* A late drained report of the old generation, with its own token. */
    assert_int_equal(drained(f, "n1", old, old_token), -ESTALE);
    /* The old token under the new generation. */
    assert_int_equal(drained(f, "n1", cur, old_token), -ESTALE);
    assert_int_equal(stats(f).reports_stale, stale_before + 2);
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, cur, 0, &p), 0);
    assert_false(p.node_drained);
    assert_int_equal(room_state(f, cur), KVF_CPS_ROOM_ABORTING);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, old, &v), -ENOENT);
    fixture_free(f);
}

static void drained_from_node_not_in_room_is_not_counted(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 14);
    assert_int_equal(attach(f, "n3", 1), 0);
    kvf_token t = abort_room(f, key);
    assert_int_equal(drained(f, "n3", key, t), -ENOENT);
    assert_int_equal(drained(f, "nobody", key, t), -ENOENT);
    assert_int_equal(stats(f).reports_unknown, 2);
    assert_int_equal(drained(f, "n1", key, t), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    fixture_free(f);
}

static void drained_from_old_incarnation_is_stale(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 15);
    kvf_token t = abort_room(f, key);
    assert_int_equal(attach(f, "n2", 2), 0); /* n2 restarted */
    uint64_t stale = stats(f).reports_stale;
    assert_int_equal(drained(f, "n2", key, t), -ESTALE); /* incarnation 1 */
    assert_int_equal(stats(f).reports_stale, stale + 1);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 2, key, t, f->now, &f->err), -ENOENT);
    fixture_free(f);
}

static void no_release_until_every_node_drained(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    const char *nodes[3] = {"n1", "n2", "n3"};
    for (int i = 0; i < 3; i++)
        assert_int_equal(attach(f, nodes[i], 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 16, .sources = 2, .sinks = 1, .node = "n1", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 16, .sources = 2, .sinks = 1, .node = "n2", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 16, .sources = 2, .sinks = 1, .node = "n3", .role = SNK, .count = 8},
             &r),
        0);
    assert_int_equal(r.room_state, KVF_CPS_ROOM_ACTIVE);
    kvf_token t = abort_room(f, r.key);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
        assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
        for (size_t p = 0; p < 3; p++)
            assert_int_equal(lease_state(f, r.key, p), KVF_CPS_LEASE_RELEASING);
        assert_int_equal(drained(f, nodes[i], r.key, t), 0);
    }
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 3);
    assert_int_equal(stats(f).notices_pending, 0);
    fixture_free(f);
}

static void duplicate_drained_reports_count_once(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 17);
    kvf_time_ns t_abort = f->now;
    kvf_token t = abort_room(f, key);
    assert_int_equal(stats(f).notices_pending, 2);
    assert_int_equal(drained(f, "n1", key, t), 0);
    assert_int_equal(drained(f, "n1", key, t), 0);
    assert_int_equal(drained(f, "n1", key, t), 0);
    assert_int_equal(stats(f).notices_pending, 1);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    f->now += 7 * KVF_NS_PER_MS;
    assert_int_equal(drained(f, "n2", key, t), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    /* The ABORTING -> ABORTED effect says how long the room was ABORTING
     * (the control plane's abort -> released metric reads it). */
    const struct kvf_cps_effect *end = NULL;
    for (unsigned i = 0; fx_find(f, KVF_CPS_FX_ROOM_STATE, NULL, i) != NULL; i++) {
        const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_ROOM_STATE, NULL, i);
        if (e->new_state == KVF_CPS_ROOM_ABORTED)
            end = e;
    }
    assert_non_null(end);
    assert_int_equal(end->old_state, KVF_CPS_ROOM_ABORTING);
    assert_int_equal(end->old_since, t_abort);
    assert_int_equal(end->since, f->now);
    assert_int_equal(drained(f, "n2", key, t), 0); /* late duplicate after ABORTED */
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_STATE, NULL),
                     4); /* open, active, aborting, aborted */
    fixture_free(f);
}

static void notice_resent_with_backoff_until_drained(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 18);
    fx_reset(f);
    kvf_token t = abort_room(f, key);
    kvf_time_ns sent[32];
    uint32_t nsent = 0;
    sent[nsent++] = f->now;
    assert_int_equal(fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n1", 0)->attempt, 0);
    fx_reset(f);
    /* Step 10 ms at a time for 12 s and record every re-send to n1. */
    for (int step = 0; step < 1200; step++) {
        advance(f, 10 * KVF_NS_PER_MS);
        const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n1", 0);
        if (e == NULL)
            continue;
        assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);
        assert_int_equal(e->attempt, nsent); /* 1, 2, 3, ... */
        assert_true(kvf_token_eq(e->token, t));
        assert_true(kvf_room_key_eq(e->key, key));
        assert_true(nsent < 32);
        sent[nsent++] = f->now;
        fx_reset(f);
    }
    assert_true(nsent >= 6);
    /* Gaps double (jitter shortens by at most a quarter) up to the 5 s cap. */
    for (uint32_t i = 1; i + 1 < nsent && i < 5; i++)
        assert_true(sent[i + 1] - sent[i] > sent[i] - sent[i - 1]);
    assert_true(sent[1] - sent[0] >= 150 * KVF_NS_PER_MS);
    assert_true(sent[1] - sent[0] <= 210 * KVF_NS_PER_MS);
    for (uint32_t i = 1; i < nsent; i++)
        assert_true(sent[i] - sent[i - 1] <= 5 * KVF_NS_PER_S + 10 * KVF_NS_PER_MS);
    assert_true(stats(f).notices_resent >= 2 * (nsent - 1));

    /* After n1 drains, only n2 hears again. */
    assert_int_equal(drained(f, "n1", key, t), 0);
    fx_reset(f);
    advance(f, 30 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 0);
    assert_true(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2") >= 1);
    assert_int_equal(drained(f, "n2", key, t), 0);
    fx_reset(f);
    advance(f, 30 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, NULL), 0);
    fixture_free(f);
}

static void dummy_rank_with_empty_lease_joins_and_drains(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    assert_int_equal(attach(f, "n3", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 19, .sources = 1, .sinks = 2, .node = "n1", .role = SRC, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 19, .sources = 1, .sinks = 2, .node = "n2", .role = SNK, .count = 8},
             &r),
        0);
    /* A dummy CP rank: no pages, still a participant. */
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 19,
                                              .sources = 1,
                                              .sinks = 2,
                                              .node = "n3",
                                              .rank = 1,
                                              .role = SNK,
                                              .count = 0},
                          &r),
                     0);
    assert_int_equal(r.room_state, KVF_CPS_ROOM_ACTIVE);
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, r.key, 2, &p), 0);
    assert_int_equal(p.range_count, 0);
    assert_string_equal(p.node_id, "n3");
    kvf_token t = abort_room(f, r.key);
    assert_int_equal(drained(f, "n3", r.key, t), 0); /* nothing in flight: at once */
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(drained(f, "n1", r.key, t), 0);
    assert_int_equal(drained(f, "n2", r.key, t), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 3);
    fixture_free(f);
}

static void tp_cp_barrier_one_failure_aborts_whole_room(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    const char *nodes[4] = {"p1", "p2", "d1", "d2"};
    for (int i = 0; i < 4; i++)
        assert_int_equal(attach(f, nodes[i], 1), 0);
    struct kvf_cps_join_result r;
    for (uint32_t rank = 0; rank < 4; rank++) {
        assert_int_equal(join(f,
                              &(struct join_args){.room_id = 20,
                                                  .sources = 4,
                                                  .sinks = 4,
                                                  .node = nodes[rank / 2],
                                                  .rank = rank,
                                                  .role = SRC,
                                                  .first = rank * 16,
                                                  .count = 16},
                              &r),
                         0);
        assert_int_equal(join(f,
                              &(struct join_args){.room_id = 20,
                                                  .sources = 4,
                                                  .sinks = 4,
                                                  .node = nodes[2 + rank / 2],
                                                  .rank = rank,
                                                  .role = SNK,
                                                  .first = rank * 16,
                                                  .count = 16},
                              &r),
                         0);
    }
    assert_int_equal(r.room_state, KVF_CPS_ROOM_ACTIVE);
    for (int i = 0; i < 4; i++)
        assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, nodes[i]), 1);
    /* One sink rank finished well before the failure: it still waits. */
    assert_int_equal(completed(f, "d1", r.key, 0, SNK), 0);
    fx_reset(f);

    kvf_token t = {0, 0};
    assert_int_equal(kvf_cps_report_failed(f->st, "d2", 1, r.key, f->now, &t, &f->err), 0);
    fx_collect(f);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, r.key, &v), 0);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_TRANSFER_FAILED);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, nodes[i]), 1);
        assert_true(kvf_token_eq(fx_find(f, KVF_CPS_FX_ABORT_NOTICE, nodes[i], 0)->token, t));
    }
    for (size_t p = 0; p < 8; p++)
        assert_int_equal(lease_state(f, r.key, p), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(completed(f, "d2", r.key, 2, SNK), -ECANCELED);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(drained(f, nodes[i], r.key, t), 0);
        assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
        assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    }
    assert_int_equal(drained(f, "d2", r.key, t), 0);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 8);
    fixture_free(f);
}

static void mixed_versions_refused_before_any_page_address_leaves(void **state)
{
    (void)state;
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.protocol_min = 1;
    o.protocol_max = 3;
    struct fixture *f = fixture_new(&o);
    uint32_t feats = KVF_FEATURE_QUIESCE_V1;
    assert_int_equal(attach_caps(f, "old", 1, 1, 1, feats), 0);
    assert_int_equal(attach_caps(f, "new", 1, 2, 3, feats), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f, &(struct join_args){.room_id = 21, .node = "old", .role = SRC, .count = 8}, &r), 0);
    int rc = join(
        f,
        &(struct join_args){
            .room_id = 21, .node = "new", .rank = 3, .role = SNK, .count = 8, .pmin = 2, .pmax = 3},
        NULL);
    assert_int_equal(rc, -ENOTSUP);
    assert_non_null(strstr(f->err.msg, "node new"));
    assert_non_null(strstr(f->err.msg, "rank 3"));
    assert_non_null(strstr(f->err.msg, "sink"));
    assert_non_null(strstr(f->err.msg, "2..3"));
    assert_non_null(strstr(f->err.msg, "1..1"));
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, r.key, &v), 0);
    assert_int_equal(v.state, KVF_CPS_ROOM_ABORTING);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_CAPABILITY);
    assert_int_equal(v.participant_count, 1); /* nothing granted to the refused one */
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "old"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "new"), 0);
    fixture_free(f);
}

static void missing_quiesce_v1_refused_naming_participant_and_feature(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach_caps(f, "legacy", 1, 1, 1, KVF_FEATURE_RDMA), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f, &(struct join_args){.room_id = 22, .node = "n1", .role = SRC, .count = 8}, &r), 0);
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 22, .node = "legacy", .rank = 1, .role = SNK, .count = 8},
                          NULL),
                     -ENOTSUP);
    assert_non_null(strstr(f->err.msg, "node legacy"));
    assert_non_null(strstr(f->err.msg, "rank 1"));
    assert_non_null(strstr(f->err.msg, "QUIESCE_V1"));
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);

    /* The engine's own feature set is checked too (a fresh room). */
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 23, .node = "n1", .role = SRC, .first = 100, .count = 8},
                          &r),
                     0);
    assert_int_equal(attach(f, "n2", 1), 0);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 23, .node = "n2", .role = SNK, .count = 8, .features = KVF_FEATURE_TCP},
             NULL),
        -ENOTSUP);
    assert_non_null(strstr(f->err.msg, "engine does not advertise QUIESCE_V1"));
    assert_non_null(strstr(f->err.msg, "node n2"));
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    fixture_free(f);
}

static void join_timeout_aborts_an_opening_room(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f, &(struct join_args){.room_id = 24, .node = "n1", .role = SRC, .count = 8}, &r), 0);
    assert_int_equal(kvf_cps_next_deadline(f->st), f->now + 30 * KVF_NS_PER_S);
    advance(f, 29 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, r.key), KVF_CPS_ROOM_OPENING);
    advance(f, 2 * KVF_NS_PER_S);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, r.key, &v), 0);
    assert_int_equal(v.state, KVF_CPS_ROOM_ABORTING);
    assert_int_equal(v.abort_reason, KVF_CPS_ABORT_JOIN_TIMEOUT);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 1);
    /* An ACTIVE room has no join timer. */
    kvf_room_key key = join_pair(f, 25);
    advance(f, 3600 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    fixture_free(f);
}

static void tombstone_expires_after_ttl(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 26);
    kvf_token t = abort_room(f, key);
    assert_int_equal(drained(f, "n1", key, t), 0);
    assert_int_equal(drained(f, "n2", key, t), 0);
    assert_int_equal(stats(f).rooms_by_state[KVF_CPS_ROOM_ABORTED], 1);
    advance(f, 599 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(drained(f, "n1", key, t), 0); /* still recognised */
    advance(f, 2 * KVF_NS_PER_S);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), -ENOENT);
    struct kvf_cps_stats s = stats(f);
    assert_int_equal(s.rooms_by_state[KVF_CPS_ROOM_ABORTED], 0);
    assert_int_equal(s.leases_by_state[KVF_CPS_LEASE_RELEASED], 0);
    assert_int_equal(kvf_cps_next_deadline(f->st), UINT64_MAX);
    uint64_t unknown = s.reports_unknown;
    assert_int_equal(drained(f, "n1", key, t), -ENOENT);
    assert_int_equal(stats(f).reports_unknown, unknown + 1);
    /* The id is free again; the next generation is still new. */
    kvf_room_key again = join_pair(f, 26);
    assert_true(again.generation > key.generation);
    fixture_free(f);
}

static void repeated_join_is_idempotent_other_lease_refused(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    struct kvf_cps_join_result a, b;
    struct join_args ja = {.room_id = 27, .node = "n1", .role = SRC, .count = 8};
    assert_int_equal(join(f, &ja, &a), 0);
    assert_int_equal(join(f, &ja, &b), 0);
    assert_int_equal(a.lease_id, b.lease_id);
    assert_true(kvf_room_key_eq(a.key, b.key));
    ja.count = 9;
    assert_int_equal(join(f, &ja, NULL), -EEXIST);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, a.key, &v), 0);
    assert_int_equal(v.participant_count, 1);
    /* Completion before the room is ACTIVE is refused. */
    assert_int_equal(completed(f, "n1", a.key, 0, SRC), -EPERM);
    fixture_free(f);
}

static int count_rooms(void *ctx, const struct kvf_cps_room_view *v)
{
    (void)v;
    (*(int *)ctx)++;
    return 0;
}

static void many_rooms_stay_small_and_independent(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    /* 2,000 open rooms: each op touches only its own room. */
    for (uint32_t i = 0; i < 2000; i++) {
        assert_int_equal(join(f,
                              &(struct join_args){.room_id = 1000 + i,
                                                  .node = "n1",
                                                  .role = SRC,
                                                  .first = (i % 128) * 8,
                                                  .count = 8},
                              NULL),
                         0);
        assert_int_equal(
            join(f,
                 &(struct join_args){
                     .room_id = 1000 + i, .node = "n2", .role = SNK, .first = 0, .count = 0},
                 NULL),
            0);
        fx_reset(f);
    }
    int n = 0;
    assert_int_equal(kvf_cps_room_foreach(f->st, count_rooms, &n), 0);
    assert_int_equal(n, 2000);
    assert_int_equal(stats(f).rooms_by_state[KVF_CPS_ROOM_ACTIVE], 2000);
    struct kvf_cps_node_view nv;
    assert_int_equal(kvf_cps_node_get(f->st, "n1", &nv), 0);
    assert_int_equal(nv.room_count, 2000);
    fixture_free(f);
}

/* ---- ordered room updates (docs/state-cores.md) ---------------------------- */

/* The version of the last room update to `node` collected, 0 if none. */
static uint64_t last_update(const struct fixture *f, const char *node)
{
    size_t n = fx_count(f, KVF_CPS_FX_ROOM_UPDATE, node);
    return n ? fx_find(f, KVF_CPS_FX_ROOM_UPDATE, node, n - 1)->version : 0;
}

static int ack(struct fixture *f, const char *node, kvf_room_key key, uint64_t version)
{
    int rc = kvf_cps_room_update_acked(f->st, node, 1, key, version, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static struct kvf_cps_participant_view member(const struct fixture *f, kvf_room_key key, size_t i)
{
    struct kvf_cps_participant_view v;
    assert_int_equal(kvf_cps_room_participant(f->st, key, i, &v), 0);
    return v;
}

static void sink_lease_reaches_source_node_only_after_sink_node_acked(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    fx_reset(f);
    kvf_room_key key = join_pair(f, 21); /* n1 source (index 0), n2 sink (index 1) */
    fx_collect(f);
    /* Each node learns its own lease first; nobody's is published yet. */
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    assert_false(member(f, key, 0).published);
    assert_false(member(f, key, 1).published);
    uint64_t v1 = last_update(f, "n1"), v2 = last_update(f, "n2");
    assert_true(v1 > 0 && v2 > 0 && v1 != v2);

    /* The source's node acknowledges: the sink's node is told the source;
     * the source's node still knows no sink pages. */
    fx_reset(f);
    assert_int_equal(ack(f, "n1", key, v1), 0);
    assert_true(member(f, key, 0).published);
    assert_false(member(f, key, 1).published);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    uint64_t v2b = last_update(f, "n2");
    assert_true(v2b > v2);

    /* n2 acknowledges its first update: a newer one (n1's publication)
     * followed it, but it carried n2's lease as it is: now (and only now)
     * n1 learns the sink. */
    fx_reset(f);
    assert_int_equal(ack(f, "n2", key, v2), 0);
    struct kvf_cps_participant_view sink = member(f, key, 1);
    assert_true(sink.published);
    assert_int_equal(sink.published_range_count, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 0);

    /* n2 acks the newest: it only published n1's lease; nothing. */
    uint64_t v1b = last_update(f, "n1");
    fx_reset(f);
    struct kvf_cps_stats s0, s1;
    kvf_cps_stats_get(f->st, &s0);
    assert_int_equal(ack(f, "n2", key, v2b), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    kvf_cps_stats_get(f->st, &s1);
    assert_int_equal(s1.acks_ignored, s0.acks_ignored + 1);

    /* n1 acks that update: its own lease did not change, nothing is sent. */
    fx_reset(f);
    assert_int_equal(ack(f, "n1", key, v1b), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    assert_int_equal(ack(f, "n1", key, 0), -ESTALE);
    /* A duplicate is ignored and counted; a version never sent is stale. */
    kvf_cps_stats_get(f->st, &s0);
    assert_int_equal(ack(f, "n2", key, v2b), 0);
    kvf_cps_stats_get(f->st, &s1);
    assert_int_equal(s1.acks_ignored, s0.acks_ignored + 1);
    assert_int_equal(ack(f, "n2", key, 999), -ESTALE);
    kvf_cps_stats_get(f->st, &s0);
    assert_int_equal(s0.reports_stale, s1.reports_stale + 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    /* From a node not in the room, or for another generation: unknown. */
    assert_int_equal(attach(f, "n3", 1), 0);
    assert_int_equal(ack(f, "n3", key, 1), -ENOENT);
    kvf_room_key other = {key.room_id, key.generation + 1};
    assert_int_equal(ack(f, "n2", other, v2b), -ENOENT);
    fixture_free(f);
}

static void extended_sink_pages_reach_source_node_only_after_sink_node_acked(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 22);
    fx_collect(f);
    /* Both nodes acknowledge whatever they are sent until nothing moves. */
    uint64_t before = 0; /* the last update n2 was sent */
    for (int round = 0; round < 4; round++) {
        uint64_t a = last_update(f, "n1"), b = last_update(f, "n2");
        before = b ? b : before;
        fx_reset(f);
        (void)ack(f, "n1", key, a);
        (void)ack(f, "n2", key, b);
    }
    assert_true(member(f, key, 1).published);
    assert_int_equal(member(f, key, 1).published_range_count, 1);

    /* ExtendLease of the sink: only the sink's node is told. */
    fx_reset(f);
    struct kvf_cps_page_range more = {600, 4};
    uint64_t sink_lease = member(f, key, 1).lease_id;
    assert_int_equal(kvf_cps_lease_extend(f->st, key, sink_lease, &more, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    assert_int_equal(member(f, key, 1).range_count, 2);
    assert_int_equal(member(f, key, 1).published_range_count, 1); /* not for n1 yet */
    /* An ack of an update from before the extension publishes nothing new:
     * that update did not carry the new ranges. */
    assert_true(before > 0);
    assert_int_equal(ack(f, "n2", key, before), 0);
    assert_int_equal(member(f, key, 1).published_range_count, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 0);

    /* The sink's node re-attaches before it acknowledged: asked again, same
     * version. */
    uint64_t v = last_update(f, "n2");
    fx_reset(f);
    assert_int_equal(kvf_cps_node_detach(f->st, "n2", 1, f->now, &f->err), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    assert_int_equal(last_update(f, "n2"), v);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 0);

    fx_reset(f);
    assert_int_equal(ack(f, "n2", key, v), 0);
    assert_int_equal(member(f, key, 1).published_range_count, 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    fixture_free(f);
}

/*
 * The cost of the ordering (issue 24): how many room updates a two-node
 * lifecycle sends, counted from the core's effects, in the two orders a node
 * report can take. Before issue 24 an ack of an update that a publication
 * had replaced was ignored, so a node's leases needed a second ack round
 * (5 updates, 4 acks, 2.5 round trips to ACTIVE everywhere), and a node whose
 * participants had all completed was still sent the others' leases (the
 * benchmark's 2.9 updates per lifecycle, where nodes complete at once).
 */

/* Real nodes: each acknowledges what it is sent, then completes. Each node
 * acknowledges its first update once, and that ack is enough: its leases are
 * published on it, the other node learns them, and nothing more is sent when
 * the node acknowledges the publication update. 4 updates, one per node at
 * ACTIVE and one publication each: the floor under the rule (a node learns
 * another's leases only after that one acknowledged them). */
static void each_node_is_published_by_the_ack_of_its_first_update(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    fx_reset(f);
    kvf_room_key key = join_pair(f, 23);
    uint64_t v1 = last_update(f, "n1"), v2 = last_update(f, "n2");
    assert_int_equal(ack(f, "n1", key, v1), 0);
    assert_int_equal(ack(f, "n2", key, v2), 0);
    /* One ack each: both published, each node was sent the other's lease. */
    assert_true(member(f, key, 0).published);
    assert_true(member(f, key, 1).published);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 2);
    /* The publication updates carried no lease of their addressee's own:
     * their acks change nothing and send nothing. */
    struct kvf_cps_stats s0 = stats(f);
    assert_int_equal(ack(f, "n1", key, last_update(f, "n1")), 0);
    assert_int_equal(ack(f, "n2", key, last_update(f, "n2")), 0);
    assert_int_equal(stats(f).acks_ignored, s0.acks_ignored + 2);
    assert_int_equal(completed(f, "n1", key, 0, SRC), 0);
    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 4);
    fixture_free(f);
}

/* Nodes whose reports overtake their acks (bench_cp_rpc's fake nodes
 * complete at once; a sink that received everything before the source's ack
 * was read): a node whose participants in the room all completed needs no
 * other node's leases and is sent none. 2 updates per lifecycle, as before
 * ordered updates (3 before issue 24: n2 was sent n1's lease). */
static void completed_node_is_sent_no_publication(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    fx_reset(f);
    kvf_room_key key = join_pair(f, 24);
    uint64_t v1 = last_update(f, "n1"), v2 = last_update(f, "n2");
    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    assert_int_equal(ack(f, "n1", key, v1), 0);
    assert_true(member(f, key, 0).published);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1); /* the ACTIVE one only */
    assert_int_equal(completed(f, "n1", key, 0, SRC), 0);
    assert_int_equal(ack(f, "n2", key, v2), 0);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 2);
    fixture_free(f);
}

/* An update that carries nothing of its addressee's own leases that is not
 * published already needs no RoomUpdateAck (RoomUpdate.ack_not_needed): the
 * service asks the core when it routes the update. Before its own ack a
 * node's updates want one; its publication update, routed after its ack,
 * does not; after a re-attach that follows a restore (nothing published)
 * one is wanted again. */
static void publication_update_wants_no_ack_once_the_node_acked(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    fx_reset(f);
    kvf_room_key key = join_pair(f, 25);
    uint64_t v1 = last_update(f, "n1"), v2 = last_update(f, "n2");
    bool want = false;
    assert_true(kvf_cps_room_update_current(f->st, key, "n1", 1, v1, &want));
    assert_true(want);
    assert_int_equal(ack(f, "n1", key, v1), 0);
    uint64_t v2b = last_update(f, "n2"); /* n1's lease for n2 */
    assert_true(v2b > v2);
    /* v2 is replaced; v2b still carries n2's unpublished lease. */
    assert_false(kvf_cps_room_update_current(f->st, key, "n2", 1, v2, &want));
    assert_true(kvf_cps_room_update_current(f->st, key, "n2", 1, v2b, &want));
    assert_true(want);
    assert_int_equal(ack(f, "n2", key, v2), 0);
    uint64_t v1b = last_update(f, "n1"); /* n2's lease for n1 */
    assert_true(kvf_cps_room_update_current(f->st, key, "n1", 1, v1b, &want));
    assert_false(want); /* n1's own lease is published: nothing to acknowledge */
    assert_true(kvf_cps_room_update_current(f->st, key, "n2", 1, v2b, &want));
    assert_false(want);
    /* Another incarnation, another generation, a terminal room: not current. */
    assert_false(kvf_cps_room_update_current(f->st, key, "n1", 2, v1b, &want));
    kvf_room_key other = {key.room_id, key.generation + 1};
    assert_false(kvf_cps_room_update_current(f->st, other, "n1", 1, v1b, &want));
    assert_int_equal(completed(f, "n1", key, 0, SRC), 0);
    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    assert_false(kvf_cps_room_update_current(f->st, key, "n1", 1, v1b, NULL));
    fixture_free(f);
}

/* A publication update whose addressee's participants all completed before
 * it was routed is not worth sending (the service asks at routing time; in
 * durable mode the update waits for the fsync of the record before it, and a
 * Completed often comes meanwhile). The addressee's own update is: it is
 * what it completed on. */
static void publication_to_a_node_that_completed_meanwhile_is_not_sent(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    fx_reset(f);
    kvf_room_key key = join_pair(f, 26);
    uint64_t v1 = last_update(f, "n1"), v2 = last_update(f, "n2");
    assert_int_equal(ack(f, "n1", key, v1), 0);
    uint64_t v2b = last_update(f, "n2"); /* publishes n1's source to n2 */
    assert_true(v2b > v2);
    assert_true(kvf_cps_room_update_current(f->st, key, "n2", 1, v2b, NULL));
    assert_int_equal(completed(f, "n2", key, 0, SNK), 0);
    assert_false(kvf_cps_room_update_current(f->st, key, "n2", 1, v2b, NULL));
    /* n1 is still open: its own update stays current until replaced. */
    assert_true(kvf_cps_room_update_current(f->st, key, "n1", 1, v1, NULL));
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(success_lifecycle_releases_each_lease_exactly_once),
        cmocka_unit_test(abort_before_all_joined_refuses_later_join),
        cmocka_unit_test(abort_is_idempotent_same_token_one_state_change),
        cmocka_unit_test(r6_two_ranks_abort_same_room_both_get_the_token),
        cmocka_unit_test(drained_without_token_is_not_counted),
        cmocka_unit_test(drained_with_stale_token_is_not_counted),
        cmocka_unit_test(r13_reused_room_id_old_generation_report_not_counted),
        cmocka_unit_test(drained_from_node_not_in_room_is_not_counted),
        cmocka_unit_test(drained_from_old_incarnation_is_stale),
        cmocka_unit_test(no_release_until_every_node_drained),
        cmocka_unit_test(duplicate_drained_reports_count_once),
        cmocka_unit_test(notice_resent_with_backoff_until_drained),
        cmocka_unit_test(dummy_rank_with_empty_lease_joins_and_drains),
        cmocka_unit_test(tp_cp_barrier_one_failure_aborts_whole_room),
        cmocka_unit_test(mixed_versions_refused_before_any_page_address_leaves),
        cmocka_unit_test(missing_quiesce_v1_refused_naming_participant_and_feature),
        cmocka_unit_test(join_timeout_aborts_an_opening_room),
        cmocka_unit_test(tombstone_expires_after_ttl),
        cmocka_unit_test(repeated_join_is_idempotent_other_lease_refused),
        cmocka_unit_test(many_rooms_stay_small_and_independent),
        cmocka_unit_test(sink_lease_reaches_source_node_only_after_sink_node_acked),
        cmocka_unit_test(extended_sink_pages_reach_source_node_only_after_sink_node_acked),
        cmocka_unit_test(each_node_is_published_by_the_ack_of_its_first_update),
        cmocka_unit_test(completed_node_is_sent_no_publication),
        cmocka_unit_test(publication_update_wants_no_ack_once_the_node_acked),
        cmocka_unit_test(publication_to_a_node_that_completed_meanwhile_is_not_sent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
