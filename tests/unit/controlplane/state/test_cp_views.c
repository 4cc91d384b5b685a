/*
 * test_cp_views.c: what the admin views read from the core beyond its rules
 * (cp_state.h, "views"): the fences of a participant's node (node_fences: 0
 * where no fence happened, also in a single-node room where node_fenced holds
 * with nobody to ask), the abort notices sent to it, a node's detail (notices
 * and fence requests pending, fenced by, fences pending), its advertised
 * protocol range and when it entered its state.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "cp_test_util.h"

static struct kvf_cps_participant_view part(struct fixture *f, kvf_room_key k, size_t i)
{
    struct kvf_cps_participant_view v;
    assert_int_equal(kvf_cps_room_participant(f->st, k, i, &v), 0);
    return v;
}

static void test_fences_and_notices(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key pair = join_pair(f, 10);
    /* A single-node room: node_fenced holds vacuously, no fence happened. */
    struct join_args a = {.room_id = 20,
                          .sources = 1,
                          .sinks = 1,
                          .node = "n1",
                          .role = KVF_CPS_ROLE_SOURCE,
                          .first = 100,
                          .count = 4};
    struct kvf_cps_join_result jr;
    assert_int_equal(join(f, &a, &jr), 0);
    kvf_room_key solo = {.room_id = 20};
    struct kvf_cps_room_view rv;
    assert_int_equal(kvf_cps_room_get(f->st, solo, &rv), 0);
    solo = rv.key;
    struct kvf_cps_participant_view v = part(f, solo, 0);
    assert_true(v.node_fenced);
    assert_int_equal(v.node_fences, 0);
    assert_int_equal(v.notice_attempts, 0);

    /* Abort the pair: one notice to each node, none fenced yet. */
    kvf_token tok;
    assert_int_equal(kvf_cps_room_abort(f->st, pair, KVF_CPS_ABORT_ADMIN, f->now, &tok, &f->err),
                     0);
    v = part(f, pair, 0);
    assert_int_equal(v.notice_attempts, 1);
    assert_false(v.node_fenced);
    assert_int_equal(v.node_fences, 0);
    struct kvf_cps_node_detail d;
    assert_int_equal(kvf_cps_node_detail_get(f->st, "n1", &d), 0);
    assert_int_equal(d.notices_pending, 1);
    assert_int_equal(d.fenced_by, 0);
    assert_int_equal(d.fences_pending, 0);

    /* n2 is asked to fence n1 and does: n1 is fenced by one peer in the pair,
     * still by none in the single-node room. */
    assert_int_equal(kvf_cps_admin_fence(f->st, "n1", f->now, &f->err), 0);
    assert_int_equal(kvf_cps_node_detail_get(f->st, "n1", &d), 0);
    assert_int_equal(d.fences_pending, 1);
    assert_int_equal(kvf_cps_node_detail_get(f->st, "n2", &d), 0);
    assert_int_equal(d.notices_pending, 2); /* its abort notice and the fence request */
    assert_int_equal(kvf_cps_report_fenced(f->st, "n2", 1, "n1", 1, f->now, &f->err), 0);
    v = part(f, pair, 0);
    assert_true(v.node_fenced);
    assert_int_equal(v.node_fences, 1);
    v = part(f, solo, 0);
    assert_int_equal(v.node_fences, 0);
    assert_int_equal(kvf_cps_node_detail_get(f->st, "n1", &d), 0);
    assert_int_equal(d.fenced_by, 1);
    assert_int_equal(d.fences_pending, 0);

    /* A re-send counts; draining keeps the count and ends the pending one. */
    advance(f, 10 * KVF_NS_PER_S);
    v = part(f, pair, 1);
    assert_true(v.notice_attempts >= 2);
    uint32_t sent = v.notice_attempts;
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, pair, tok, f->now, &f->err), 0);
    v = part(f, pair, 1);
    assert_int_equal(v.notice_attempts, sent);
    assert_int_equal(kvf_cps_node_detail_get(f->st, "n2", &d), 0);
    assert_int_equal(d.notices_pending, 0);
    assert_int_equal(kvf_cps_node_detail_get(f->st, "nobody", &d), -ENOENT);
    fixture_free(f);
}

static void test_node_state_since_and_range(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach_caps(f, "n1", 1, 1, 3, KVF_FEATURE_QUIESCE_V1), 0);
    struct kvf_cps_node_view nv;
    assert_int_equal(kvf_cps_node_get(f->st, "n1", &nv), 0);
    assert_int_equal(nv.state_since, f->now);
    assert_true(nv.protocol_min >= 1 && nv.protocol_min <= nv.protocol_version);
    assert_true(nv.protocol_version <= nv.protocol_max && nv.protocol_max <= 3);
    kvf_time_ns attached_at = f->now;
    advance(f, 5 * KVF_NS_PER_S);
    assert_int_equal(kvf_cps_node_detach(f->st, "n1", 1, f->now, &f->err), 0);
    assert_int_equal(kvf_cps_node_get(f->st, "n1", &nv), 0);
    assert_int_equal(nv.state, KVF_CPS_NODE_SUSPECT);
    assert_true(nv.state_since == attached_at + 5 * KVF_NS_PER_S);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fences_and_notices),
        cmocka_unit_test(test_node_state_since_and_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
