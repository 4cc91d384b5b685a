/*
 * test_cp_reports.c: reports that must move nothing in the control-plane state
 * core, each one a rule that no other test broke on its own (issue 12, "close
 * the mutation gaps"):
 *
 * - a Completed of an earlier generation of a reused room id is stale: it
 *   neither counts for the current generation nor completes it (the
 *   generation check every report passes, room_for_report in cp_room.c);
 * - a Resync counts a lifetime as drained only when it says DRAINED and carries
 *   the current token: a CLOSED, QUARANTINED or OPEN lifetime that carries the
 *   token (the node processed the notice, and ops are still in flight) counts
 *   for nothing (resync_lifetime in cp_resync.c).
 *
 * Each test was run with its check deleted and failed (tests/README.md,
 * "Mutation checks"). Driven by hand with the fixture's clock.
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

static const struct kvf_cps_pool POOL1 = {.pool_id = 1, .page_size = 65536, .page_count = 1024};

static int completed(struct fixture *f, const char *node, kvf_room_key key, uint32_t rank,
                     enum kvf_cps_role role)
{
    kvf_error_clear(&f->err);
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

static uint64_t reports_stale(const struct fixture *f)
{
    struct kvf_cps_stats s;
    kvf_cps_stats_get(f->st, &s);
    return s.reports_stale;
}

static bool participant_completed(const struct fixture *f, kvf_room_key key, size_t idx)
{
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, key, idx, &p), 0);
    return p.completed;
}

/* The id is reused after its first generation completed. Both nodes' late
 * Completed reports of the first generation arrive while the second one is
 * ACTIVE and its transfer runs: they are stale, counted as such, and the
 * second generation stays ACTIVE with its leases held. Without the generation
 * check they completed it and released its pages under the transfer. */
static void completed_of_an_earlier_generation_is_stale(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key old = join_pair(f, 21);
    assert_int_equal(completed(f, "n1", old, 0, SRC), 0);
    assert_int_equal(completed(f, "n2", old, 0, SNK), 0);
    assert_int_equal(room_state(f, old), KVF_CPS_ROOM_COMPLETED);

    kvf_room_key cur = join_pair(f, 21);
    assert_true(cur.generation > old.generation);
    fx_reset(f);
    uint64_t stale = reports_stale(f);

    /* The same reports again, late (a retry, a duplicate from the network). */
    assert_int_equal(completed(f, "n1", old, 0, SRC), -ESTALE);
    assert_int_equal(completed(f, "n2", old, 0, SNK), -ESTALE);
    assert_int_equal(reports_stale(f), stale + 2);
    assert_int_equal(room_state(f, cur), KVF_CPS_ROOM_ACTIVE);
    assert_false(participant_completed(f, cur, 0));
    assert_false(participant_completed(f, cur, 1));
    assert_int_equal(lease_state(f, cur, 0), KVF_CPS_LEASE_ACTIVE);
    assert_int_equal(lease_state(f, cur, 1), KVF_CPS_LEASE_ACTIVE);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    assert_int_equal(f->nfx, 0);

    /* One stale report next to a current one still counts for nothing. */
    assert_int_equal(completed(f, "n1", cur, 0, SRC), 0);
    assert_int_equal(completed(f, "n2", old, 0, SNK), -ESTALE);
    assert_int_equal(room_state(f, cur), KVF_CPS_ROOM_ACTIVE);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    assert_int_equal(completed(f, "n2", cur, 0, SNK), 0);
    assert_int_equal(room_state(f, cur), KVF_CPS_ROOM_COMPLETED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    fixture_free(f);
}

static int resync_one(struct fixture *f, const char *node, const struct kvf_cps_resync_lifetime *lt,
                      struct kvf_cps_resync_result *res)
{
    struct kvf_cps_resync rs = {
        .lifetimes = lt, .lifetime_count = 1, .pools = &POOL1, .pool_count = 1};
    kvf_error_clear(&f->err);
    int rc = kvf_cps_node_resync(f->st, node, 1, &rs, f->now, res, &f->err);
    fx_collect(f);
    return rc;
}

/* n1 processed the abort notice (its lifetime carries the token) but still has
 * ops in flight: CLOSED, or QUARANTINED after a native error that proved
 * nothing, or (a node that says OPEN with a token is wrong, but must not be
 * believed either) OPEN. Its Resync says so after a reconnect. None of these
 * is a drain: the room stays ABORTING and nothing is released. Only DRAINED
 * with the token counts. */
static void resync_counts_only_a_drained_lifetime_with_the_token(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 22);
    kvf_token tok = abort_room(f, key);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, key, tok, f->now, &f->err), 0);
    fx_reset(f);

    static const enum kvf_cps_lifetime_state undrained[] = {
        KVF_CPS_LT_CLOSED, KVF_CPS_LT_QUARANTINED, KVF_CPS_LT_OPEN};
    for (size_t i = 0; i < sizeof(undrained) / sizeof(undrained[0]); i++) {
        struct kvf_cps_resync_lifetime lt = {key, undrained[i], tok, 2};
        struct kvf_cps_resync_result res;
        assert_int_equal(resync_one(f, "n1", &lt, &res), 0);
        assert_int_equal(res.drained, 0);
        assert_int_equal(res.ignored, 1);
        assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING);
        assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASING);
        assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
        assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
        struct kvf_cps_participant_view p;
        assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &p), 0);
        assert_false(p.node_drained);
    }

    /* The ops retired: DRAINED with the token is the proof. */
    struct kvf_cps_resync_lifetime lt = {key, KVF_CPS_LT_DRAINED, tok, 0};
    struct kvf_cps_resync_result res;
    assert_int_equal(resync_one(f, "n1", &lt, &res), 0);
    assert_int_equal(res.drained, 1);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 2);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(completed_of_an_earlier_generation_is_stale),
        cmocka_unit_test(resync_counts_only_a_drained_lifetime_with_the_token),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
