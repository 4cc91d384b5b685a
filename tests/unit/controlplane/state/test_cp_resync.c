/*
 * test_cp_resync.c: a node's Resync reconciled by the control-plane state core
 * (kvf_cps_node_resync), pool removal (kvf_cps_node_remove_pool) and whole
 * PoolUpdates (kvf_cps_node_update_pools: all or nothing).
 *
 * A Resync repeats what lost reports said: a DRAINED lifetime with the room's
 * current token counts as Drained, a fenced peer as PeerFenced, the pool list
 * replaces the node's pools (leased pools stay). A lifetime the node still
 * holds open for a terminal or forgotten room gets one abort notice. Nothing
 * else changes, and a malformed Resync changes nothing at all. Each test is
 * driven step by step with the fixture's clock.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
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

static int resync(struct fixture *f, const char *node, const struct kvf_cps_resync *rs,
                  struct kvf_cps_resync_result *res)
{
    kvf_error_clear(&f->err);
    int rc = kvf_cps_node_resync(f->st, node, 1, rs, f->now, res, &f->err);
    fx_collect(f);
    return rc;
}

static size_t pool_count(const struct fixture *f, const char *node)
{
    struct kvf_cps_node_view v;
    assert_int_equal(kvf_cps_node_get(f->st, node, &v), 0);
    return v.pool_count;
}

static const struct kvf_cps_pool POOL1 = {.pool_id = 1, .page_size = 65536, .page_count = 1024};

static void drained_lifetime_with_current_token_counts_as_drained(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 1);
    kvf_token tok = abort_room(f, key);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, key, tok, f->now, &f->err), 0);
    fx_reset(f);
    /* n1's Drained was lost with its session; its Resync says it again. */
    struct kvf_cps_resync_lifetime lt = {key, KVF_CPS_LT_DRAINED, tok, 0};
    struct kvf_cps_resync rs = {
        .lifetimes = &lt, .lifetime_count = 1, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.drained, 1);
    assert_int_equal(res.notices, 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    /* Again: nothing more happens. */
    fx_reset(f);
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.drained, 0);
    assert_int_equal(res.notices, 0); /* DRAINED lifetimes of terminal rooms need nothing */
    assert_int_equal(f->nfx, 0);
    fixture_free(f);
}

static void stale_token_or_open_lifetime_of_aborting_room_changes_nothing(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 2);
    kvf_token tok = abort_room(f, key);
    fx_reset(f);
    kvf_token other = {tok.hi ^ 1, tok.lo};
    struct kvf_cps_resync_lifetime lts[2] = {{key, KVF_CPS_LT_DRAINED, other, 0},
                                             {key, KVF_CPS_LT_OPEN, {0, 0}, 3}};
    struct kvf_cps_resync rs = {
        .lifetimes = lts, .lifetime_count = 2, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.drained, 0);
    assert_int_equal(res.ignored, 2);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(f->nfx, 0); /* the pending notice follows its own backoff */
    fixture_free(f);
}

static void open_lifetimes_of_terminal_or_forgotten_rooms_get_one_notice(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key aborted = join_pair(f, 3);
    kvf_token tok = abort_room(f, aborted);
    assert_int_equal(kvf_cps_report_drained(f->st, "n1", 1, aborted, tok, f->now, &f->err), 0);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, aborted, tok, f->now, &f->err), 0);
    assert_int_equal(room_state(f, aborted), KVF_CPS_ROOM_ABORTED);
    kvf_room_key done = join_pair(f, 4);
    assert_int_equal(kvf_cps_report_completed(f->st, "n1", 1, done, 0, SRC, f->now, &f->err), 0);
    assert_int_equal(kvf_cps_report_completed(f->st, "n2", 1, done, 0, SNK, f->now, &f->err), 0);
    assert_int_equal(room_state(f, done), KVF_CPS_ROOM_COMPLETED);
    kvf_room_key forgotten = {99, 12345};
    kvf_room_key old_gen = {done.room_id, done.generation - 1};
    fx_collect(f);
    fx_reset(f);
    struct kvf_cps_resync_lifetime lts[5] = {
        {aborted, KVF_CPS_LT_CLOSED, {0, 0}, 1}, {done, KVF_CPS_LT_OPEN, {0, 0}, 0},
        {forgotten, KVF_CPS_LT_OPEN, {0, 0}, 0}, {old_gen, KVF_CPS_LT_QUARANTINED, {0, 0}, 1},
        {aborted, KVF_CPS_LT_DRAINED, tok, 0}, /* drained already: nothing */
    };
    struct kvf_cps_resync rs = {
        .lifetimes = lts, .lifetime_count = 5, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.notices, 4);
    assert_int_equal(res.ignored, 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n1"), 4);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, "n2"), 0);
    for (size_t i = 0; i < 4; i++) {
        const struct kvf_cps_effect *e = fx_find(f, KVF_CPS_FX_ABORT_NOTICE, "n1", i);
        assert_int_equal(e->incarnation, 1);
        if (kvf_room_key_eq(e->key, aborted))
            assert_true(kvf_token_eq(e->token, tok)); /* the ABORTED room's token */
        else
            assert_true(kvf_token_is_zero(e->token)); /* nothing to prove */
    }
    /* One shot: no re-send is pending for them. */
    fx_reset(f);
    advance(f, 30 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ABORT_NOTICE, NULL), 0);
    /* A live room is not touched: its own rules apply. */
    kvf_room_key live = join_pair(f, 5);
    fx_reset(f);
    struct kvf_cps_resync_lifetime one = {live, KVF_CPS_LT_CLOSED, {0, 0}, 0};
    struct kvf_cps_resync rs2 = {
        .lifetimes = &one, .lifetime_count = 1, .pools = &POOL1, .pool_count = 1};
    assert_int_equal(resync(f, "n2", &rs2, &res), 0);
    assert_int_equal(res.ignored, 1);
    assert_int_equal(f->nfx, 0);
    assert_int_equal(room_state(f, live), KVF_CPS_ROOM_ACTIVE);
    fixture_free(f);
}

static void fenced_peers_count_as_peer_fenced(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 6);
    assert_int_equal(kvf_cps_node_detach(f->st, "n2", 1, f->now, &f->err), 0);
    advance(f, 10 * KVF_NS_PER_S + 1); /* n2 LOST: n1 is asked to fence it */
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1"), 1);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    fx_reset(f);
    struct kvf_cps_resync_peer peers[2] = {{"n2", 1}, {"nobody", 7}};
    struct kvf_cps_resync rs = {
        .fenced = peers, .fenced_count = 2, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.fenced, 1);
    assert_int_equal(res.fenced_unknown, 1);
    /* n1 never drained, but its only peer is fenced and n2 is dead: n1 still
     * has to drain (its own lifetime); the fence settles the request only. */
    fx_reset(f);
    advance(f, 30 * KVF_NS_PER_S);
    assert_int_equal(fx_count(f, KVF_CPS_FX_FENCE_PEER, "n1"), 0); /* no re-send */
    fixture_free(f);
}

static void pools_are_upserted_and_unlisted_ones_removed_unless_leased(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    struct kvf_cps_pool p2 = {.pool_id = 2, .page_size = 4096, .page_count = 16};
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &p2, &f->err), 0);
    assert_int_equal(pool_count(f, "n1"), 2);
    kvf_room_key key = join_pair(f, 7); /* leases in pool 1 of n1 and n2 */
    struct kvf_cps_pool list[2] = {{.pool_id = 3, .page_size = 8192, .page_count = 8},
                                   {.pool_id = 1, .page_size = 4096, .page_count = 8}};
    struct kvf_cps_resync rs = {.pools = list, .pool_count = 2};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.pools_upserted, 1); /* pool 3 */
    assert_int_equal(res.pools_refused, 1);  /* pool 1 is leased: keeps its size */
    assert_int_equal(res.pools_removed, 1);  /* pool 2 */
    assert_int_equal(pool_count(f, "n1"), 2);
    /* The leased pool missing from the list stays. */
    rs.pool_count = 1; /* pool 3 only */
    assert_int_equal(resync(f, "n1", &rs, &res), 0);
    assert_int_equal(res.pools_kept, 1);
    assert_int_equal(res.pools_removed, 0);
    assert_int_equal(pool_count(f, "n1"), 2);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ACTIVE);
    /* Join into the new pool 3 works: it is really there. */
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 8, .node = "n1", .role = SRC, .pool_id = 3, .first = 0, .count = 8},
             NULL),
        0);
    fixture_free(f);
}

static void malformed_or_unattached_resync_changes_nothing(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 9);
    kvf_token tok = abort_room(f, key);
    fx_reset(f);
    struct kvf_cps_resync_lifetime lt = {key, KVF_CPS_LT_DRAINED, tok, 0};
    struct kvf_cps_pool dup[2] = {POOL1, POOL1};
    struct kvf_cps_resync rs = {
        .lifetimes = &lt, .lifetime_count = 1, .pools = dup, .pool_count = 2};
    assert_int_equal(resync(f, "n1", &rs, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "pools[1].pool_id"));
    struct kvf_cps_resync_lifetime bad = {{9, 0}, KVF_CPS_LT_DRAINED, tok, 0};
    struct kvf_cps_resync rs2 = {.lifetimes = &bad, .lifetime_count = 1};
    assert_int_equal(resync(f, "n1", &rs2, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "lifetimes[0].room"));
    struct kvf_cps_pool empty = {.pool_id = 3, .page_size = 4096, .page_count = 0};
    struct kvf_cps_resync rs3 = {.pools = &empty, .pool_count = 1};
    assert_int_equal(resync(f, "n1", &rs3, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "pools[0].page_count"));
    struct kvf_cps_resync_peer nameless = {.node_id = "", .incarnation = 1};
    struct kvf_cps_resync rs4 = {.fenced = &nameless, .fenced_count = 1};
    assert_int_equal(resync(f, "n1", &rs4, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "fenced_peers[0].node_id"));
    struct kvf_cps_resync rs5 = {.fenced_count = 1};
    assert_int_equal(resync(f, "n1", &rs5, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "a list is missing"));
    assert_int_equal(resync(f, "n1", NULL, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "resync: missing"));
    struct kvf_cps_resync_lifetime stateless = {key, 0, tok, 0};
    struct kvf_cps_resync rs6 = {.lifetimes = &stateless, .lifetime_count = 1};
    assert_int_equal(resync(f, "n1", &rs6, NULL), -EINVAL);
    assert_non_null(strstr(f->err.msg, "lifetimes[0].state"));
    static struct kvf_cps_pool many[65]; /* default max_pools_per_node: 64 */
    struct kvf_cps_resync rs7 = {.pools = many, .pool_count = 65};
    assert_int_equal(resync(f, "n1", &rs7, NULL), -E2BIG);
    assert_non_null(strstr(f->err.msg, "pools: 65 pools"));
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(pool_count(f, "n1"), 1);
    assert_int_equal(f->nfx, 0);
    /* A SUSPECT node has no session to resync on. */
    assert_int_equal(kvf_cps_node_detach(f->st, "n1", 1, f->now, &f->err), 0);
    rs.pool_count = 1;
    assert_int_equal(resync(f, "n1", &rs, NULL), -EPERM);
    assert_int_equal(kvf_cps_node_resync(f->st, "n1", 2, &rs, f->now, NULL, &f->err), -ESTALE);
    assert_int_equal(kvf_cps_node_resync(f->st, "zz", 1, &rs, f->now, NULL, &f->err), -ENOENT);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    fixture_free(f);
}

static void remove_pool_refuses_unknown_and_leased_pools(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 10);
    struct kvf_cps_pool p2 = {.pool_id = 2, .page_size = 4096, .page_count = 16};
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &p2, &f->err), 0);
    assert_int_equal(kvf_cps_node_remove_pool(f->st, "n1", 1, 7, &f->err), -ENOENT);
    assert_non_null(strstr(f->err.msg, "pool 7"));
    assert_int_equal(kvf_cps_node_remove_pool(f->st, "n1", 1, 1, &f->err), -EBUSY);
    assert_int_equal(kvf_cps_node_remove_pool(f->st, "n1", 1, 2, &f->err), 0);
    assert_int_equal(pool_count(f, "n1"), 1);
    /* Once the lease is RELEASED the pool may go. */
    kvf_token tok = abort_room(f, key);
    assert_int_equal(kvf_cps_report_drained(f->st, "n1", 1, key, tok, f->now, &f->err), 0);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, key, tok, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(kvf_cps_node_remove_pool(f->st, "n1", 1, 1, &f->err), 0);
    assert_int_equal(pool_count(f, "n1"), 0);
    /* The tombstone still names the pool; the state stays consistent. */
    struct kvf_cps_participant_view pv;
    assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &pv), 0);
    advance(f, 11 * 60 * KVF_NS_PER_S); /* tombstone expiry frees the last reference */
    fixture_free(f);
}

/* A PoolUpdate is one change: a refused removal (a leased pool) or a refused
 * resize leaves the other upserts and removals of the same update unapplied. */
static void update_pools_all_or_nothing(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    join_pair(f, 11); /* a lease in pool 1 of n1 */
    struct kvf_cps_pool p2 = {.pool_id = 2, .page_size = 4096, .page_count = 16};
    assert_int_equal(kvf_cps_node_set_pool(f->st, "n1", 1, &p2, &f->err), 0);
    struct kvf_cps_pool up[2] = {{.pool_id = 3, .page_size = 4096, .page_count = 8},
                                 {.pool_id = 2, .page_size = 8192, .page_count = 16}};
    uint32_t rm_leased[1] = {1};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n1", 1, up, 2, rm_leased, 1, &f->err),
                     -EBUSY);
    assert_non_null(strstr(f->err.msg, "pool 1"));
    assert_int_equal(pool_count(f, "n1"), 2); /* pool 3 not added */
    struct kvf_cps_pool got;
    assert_int_equal(kvf_cps_node_pool_get(f->st, "n1", 1, &got), 0);
    assert_int_equal(got.page_size, 4096); /* pool 2 not resized */
    uint32_t rm_unknown[2] = {2, 9};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n1", 1, up, 1, rm_unknown, 2, &f->err),
                     -ENOENT);
    assert_int_equal(pool_count(f, "n1"), 2); /* pool 2 not removed, 3 not added */
    uint32_t rm_both[1] = {3};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n1", 1, up, 1, rm_both, 1, &f->err),
                     -EINVAL);
    assert_non_null(strstr(f->err.msg, "upserted[0].pool_id"));
    /* Accepted: pool 3 added and pool 2 resized at once; then 2 removed. */
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n1", 1, up, 2, NULL, 0, &f->err), 0);
    assert_int_equal(pool_count(f, "n1"), 3);
    uint32_t rm_two[1] = {2};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n1", 1, NULL, 0, rm_two, 1, &f->err), 0);
    assert_int_equal(pool_count(f, "n1"), 2);
    fixture_free(f);
}

/* A node sends at most 4096 lifetimes per Resync message and more messages
 * beyond (node_resync_emit, dataplane/node/control_session.c). The core has
 * no cap of its own: a Resync over 4096 lifetimes is reconciled whole, and the
 * same lifetimes split in two messages (each with the whole pool list, the
 * fenced peers in the first) reconcile like one: every notice, the drain, the
 * pools kept. */
#define BIG_RESYNC 4100u

static size_t take_notices(struct fixture *f)
{
    size_t n = 0, notices = 0;
    const struct kvf_cps_effect *fx = kvf_cps_effects_take(f->st, &n);
    for (size_t i = 0; i < n; i++)
        notices += fx[i].kind == KVF_CPS_FX_ABORT_NOTICE;
    return notices;
}

static void resync_over_4096_lifetimes_whole_or_split(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 8);
    kvf_token tok = abort_room(f, key);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, key, tok, f->now, &f->err), 0);
    fx_reset(f);
    struct kvf_cps_resync_lifetime *lts = calloc(BIG_RESYNC + 1, sizeof *lts);
    assert_non_null(lts);
    for (uint32_t i = 0; i < BIG_RESYNC; i++) /* open lifetimes of forgotten rooms */
        lts[i] = (struct kvf_cps_resync_lifetime){{1000 + i, 1}, KVF_CPS_LT_OPEN, {0, 0}, 0};
    lts[BIG_RESYNC] = (struct kvf_cps_resync_lifetime){key, KVF_CPS_LT_DRAINED, tok, 0};

    /* Whole: every open lifetime gets its notice. */
    struct kvf_cps_resync rs = {
        .lifetimes = lts, .lifetime_count = BIG_RESYNC, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync_result res;
    assert_int_equal(kvf_cps_node_resync(f->st, "n1", 1, &rs, f->now, &res, &f->err), 0);
    assert_int_equal(res.notices, BIG_RESYNC);
    assert_int_equal(take_notices(f), BIG_RESYNC);

    /* Split as the node sends it: 4096, then the rest with the drained one. */
    struct kvf_cps_resync first = {
        .lifetimes = lts, .lifetime_count = 4096, .pools = &POOL1, .pool_count = 1};
    struct kvf_cps_resync rest = {.lifetimes = lts + 4096,
                                  .lifetime_count = BIG_RESYNC + 1 - 4096,
                                  .pools = &POOL1,
                                  .pool_count = 1};
    assert_int_equal(kvf_cps_node_resync(f->st, "n1", 1, &first, f->now, &res, &f->err), 0);
    assert_int_equal(res.notices, 4096);
    assert_int_equal(take_notices(f), 4096);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
    assert_int_equal(kvf_cps_node_resync(f->st, "n1", 1, &rest, f->now, &res, &f->err), 0);
    assert_int_equal(res.notices, BIG_RESYNC - 4096);
    assert_int_equal(res.drained, 1);
    assert_int_equal(take_notices(f), BIG_RESYNC - 4096);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED); /* n1's drain was in the rest */
    assert_int_equal(pool_count(f, "n1"), 1);
    free(lts);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(drained_lifetime_with_current_token_counts_as_drained),
        cmocka_unit_test(stale_token_or_open_lifetime_of_aborting_room_changes_nothing),
        cmocka_unit_test(open_lifetimes_of_terminal_or_forgotten_rooms_get_one_notice),
        cmocka_unit_test(fenced_peers_count_as_peer_fenced),
        cmocka_unit_test(pools_are_upserted_and_unlisted_ones_removed_unless_leased),
        cmocka_unit_test(malformed_or_unattached_resync_changes_nothing),
        cmocka_unit_test(remove_pool_refuses_unknown_and_leased_pools),
        cmocka_unit_test(update_pools_all_or_nothing),
        cmocka_unit_test(resync_over_4096_lifetimes_whole_or_split),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
