/*
 * test_cp_pages.c: page leases in the control-plane state core.
 *
 * docs/design.md §2.3: a page is in at most one write lease at a time and never in
 * a write lease of one room and a read lease of another; every page lies in
 * its pool. Source pages stay held until their room is released (R8), also
 * the pages that chunked prefill added with lease_extend. Bad input (fields,
 * bounds, overlaps, oversized lists) is refused with a message naming what is
 * wrong and leaves the state exactly as it was, with no effect emitted.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
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

static void two_nodes(struct fixture *f)
{
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach(f, "n2", 1), 0);
}

static void r8_source_pages_held_until_drained(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_join_result a;
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 1, .node = "n1", .role = SRC, .first = 0, .count = 8},
             &a),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 1, .node = "n2", .role = SNK, .first = 0, .count = 8},
             &a),
        0);
    kvf_token t = abort_room(f, a.key);

    /* A new room wants to write n1's source pages while the gather may still read them. */
    struct join_args b_sink = {.room_id = 2, .node = "n1", .role = SNK, .first = 4, .count = 8};
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 2, .node = "n2", .role = SRC, .first = 500, .count = 8},
             NULL),
        0);
    assert_int_equal(join(f, &b_sink, NULL), -EBUSY);
    char want[64];
    snprintf(want, sizeof(want), "read by room 1:%llu", (unsigned long long)a.key.generation);
    assert_non_null(strstr(f->err.msg, want));
    assert_non_null(strstr(f->err.msg, "page 4"));
    assert_int_equal(kvf_cps_report_drained(f->st, "n1", 1, a.key, t, f->now, &f->err), 0);
    assert_int_equal(join(f, &b_sink, NULL), -EBUSY); /* n2 has not drained yet */
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, a.key, t, f->now, &f->err), 0);
    assert_int_equal(room_state(f, a.key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(join(f, &b_sink, NULL), 0);
    fixture_free(f);
}

static void write_write_overlap_across_rooms_refused_naming_page_and_room(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_join_result a;
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 77, .node = "n2", .role = SNK, .first = 10, .count = 10},
                          &a),
                     0);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 78, .node = "n2", .role = SNK, .first = 15, .count = 2},
             NULL),
        -EBUSY);
    char want[64];
    snprintf(want, sizeof(want), "written by room 77:%llu", (unsigned long long)a.key.generation);
    assert_non_null(strstr(f->err.msg, want));
    assert_non_null(strstr(f->err.msg, "page 15"));
    /* Adjacent pages are fine. */
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 78, .node = "n2", .role = SNK, .first = 20, .count = 2},
             NULL),
        0);
    /* The same pages on another node are other pages. */
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 79, .node = "n1", .role = SNK, .first = 10, .count = 10},
                          NULL),
                     0);
    fixture_free(f);
}

static void read_read_overlap_is_allowed(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    for (uint64_t room = 1; room <= 3; room++)
        assert_int_equal(
            join(f,
                 &(struct join_args){
                     .room_id = room, .node = "n1", .role = SRC, .first = 0, .count = 64},
                 NULL),
            0);
    /* Shared prefix pages are still not writable by anyone. */
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 4, .node = "n1", .role = SNK, .first = 63, .count = 1},
             NULL),
        -EBUSY);
    fixture_free(f);
}

static void write_versus_read_of_another_room_refused_both_ways(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_join_result r, w;
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 5, .node = "n1", .role = SRC, .first = 0, .count = 8},
             &r),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 6, .node = "n1", .role = SNK, .first = 7, .count = 2},
             NULL),
        -EBUSY);
    assert_non_null(strstr(f->err.msg, "page 7"));
    assert_non_null(strstr(f->err.msg, "read by room 5:"));
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 7, .node = "n1", .role = SNK, .first = 20, .count = 10},
             &w),
        0);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 8, .node = "n1", .role = SRC, .first = 25, .count = 1},
             NULL),
        -EBUSY);
    assert_non_null(strstr(f->err.msg, "page 25"));
    assert_non_null(strstr(f->err.msg, "written by room 7:"));
    fixture_free(f);
}

static void pages_outside_pool_refused_naming_page_and_pool_size(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 9, .node = "n1", .role = SNK, .first = 1020, .count = 8},
                          NULL),
                     -EINVAL);
    assert_non_null(strstr(f->err.msg, "page 1024"));
    assert_non_null(strstr(f->err.msg, "1024 pages"));
    assert_non_null(strstr(f->err.msg, "pool 1"));
    assert_int_equal(join(f,
                          &(struct join_args){.room_id = 9,
                                              .node = "n1",
                                              .role = SNK,
                                              .first = 4000000000u,
                                              .count = 1000000000u},
                          NULL),
                     -EINVAL);
    assert_non_null(strstr(f->err.msg, "page 4000000000"));
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 9, .node = "n1", .role = SNK, .count = 1, .pool_id = 9},
             NULL),
        -ENOENT);
    assert_non_null(strstr(f->err.msg, "no pool 9"));
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 9, .node = "n1", .role = SNK, .first = 1016, .count = 8},
                          NULL),
                     0);
    fixture_free(f);
}

static void oversized_lists_refused_with_the_limit(void **state)
{
    (void)state;
    struct kvf_cps_opts o;
    kvf_cps_opts_init(&o);
    o.max_ranges_per_call = 4;
    o.max_participants = 8;
    struct fixture *f = fixture_new(&o);
    two_nodes(f);
    struct kvf_cps_page_range ranges[5] = {{0, 1}, {2, 1}, {4, 1}, {6, 1}, {8, 1}};
    struct kvf_cps_join j = {.room_id = 10,
                             .expected_sources = 1,
                             .expected_sinks = 1,
                             .node_id = "n1",
                             .role = SNK,
                             .engine_protocol_min = 1,
                             .engine_protocol_max = 1,
                             .engine_features = KVF_FEATURE_QUIESCE_V1,
                             .pool_id = 1,
                             .ranges = ranges,
                             .range_count = 5};
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, NULL, &f->err), -E2BIG);
    assert_non_null(strstr(f->err.msg, "limit 4"));
    j.range_count = 3;
    j.expected_sources = 5;
    j.expected_sinks = 4;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, NULL, &f->err), -E2BIG);
    assert_non_null(strstr(f->err.msg, "limit 8"));
    j.expected_sources = 1;
    j.expected_sinks = 1;
    struct kvf_cps_join_result r;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &r, &f->err), 0);
    /* A lease grows by extend only up to the same limit. */
    assert_int_equal(kvf_cps_lease_extend(f->st, r.key, r.lease_id, &ranges[3], 2, f->now, &f->err),
                     -E2BIG);
    assert_non_null(strstr(f->err.msg, "limit 4"));
    assert_int_equal(kvf_cps_lease_extend(f->st, r.key, r.lease_id, &ranges[3], 1, f->now, &f->err),
                     0);
    fixture_free(f);
}

static void chunked_prefill_extend_adds_pages_and_updates_peers(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 11); /* pages 88..95 */
    struct kvf_cps_participant_view src;
    assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &src), 0);
    assert_int_equal(src.role, SRC);
    fx_reset(f);
    struct kvf_cps_page_range chunk2 = {200, 8};
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, &chunk2, 1, f->now, &f->err),
                     0);
    fx_collect(f);
    /* The lease's own node first; n2 once n1 acknowledged the new pages. */
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 0);
    uint64_t v = fx_find(f, KVF_CPS_FX_ROOM_UPDATE, "n1", 0)->version;
    assert_int_equal(kvf_cps_room_update_acked(f->st, "n1", 1, key, v, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, "n2"), 1);
    assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &src), 0);
    assert_int_equal(src.range_count, 2);
    assert_int_equal(src.ranges[1].first, 200);

    /* Overlap rules apply to added pages: another room writes 300..309 on n1. */
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 50, .node = "n1", .role = SNK, .first = 300, .count = 10},
                          NULL),
                     0);
    struct kvf_cps_page_range bad[2] = {{220, 4}, {305, 1}};
    fx_reset(f);
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, bad, 2, f->now, &f->err),
                     -EBUSY);
    assert_non_null(strstr(f->err.msg, "page 305"));
    fx_collect(f);
    assert_int_equal(f->nfx, 0);
    assert_int_equal(kvf_cps_room_participant(f->st, key, 0, &src), 0);
    assert_int_equal(src.range_count, 2);
    /* The rolled-back 220..223 is free for a writer. */
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 51, .node = "n1", .role = SNK, .first = 220, .count = 4},
                          NULL),
                     0);

    /* Wrong generation, wrong lease, then ABORTING. */
    kvf_room_key stale = {key.room_id, key.generation + 100};
    assert_int_equal(kvf_cps_lease_extend(f->st, stale, src.lease_id, &chunk2, 1, f->now, &f->err),
                     -ESTALE);
    assert_int_equal(kvf_cps_lease_extend(f->st, key, 999999, &chunk2, 1, f->now, &f->err),
                     -ENOENT);
    kvf_token t = abort_room(f, key);
    struct kvf_cps_page_range chunk3 = {400, 8};
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, &chunk3, 1, f->now, &f->err),
                     -ECANCELED);

    /* Chunk 2's pages stay held until the room is released (R8 with chunks). */
    struct join_args w = {.room_id = 52, .node = "n1", .role = SNK, .first = 204, .count = 1};
    assert_int_equal(join(f, &w, NULL), -EBUSY);
    assert_int_equal(kvf_cps_report_drained(f->st, "n1", 1, key, t, f->now, &f->err), 0);
    assert_int_equal(kvf_cps_report_drained(f->st, "n2", 1, key, t, f->now, &f->err), 0);
    assert_int_equal(join(f, &w, NULL), 0);
    fixture_free(f);
}

static void extend_in_opening_room_emits_no_update(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_join_result r;
    assert_int_equal(
        join(f, &(struct join_args){.room_id = 12, .node = "n1", .role = SRC, .count = 4}, &r), 0);
    fx_reset(f);
    struct kvf_cps_page_range more = {4, 4};
    assert_int_equal(kvf_cps_lease_extend(f->st, r.key, r.lease_id, &more, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_ROOM_UPDATE, NULL), 0);
    fixture_free(f);
}

static void failed_join_rolls_back_pages_of_earlier_ranges(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 13, .node = "n1", .role = SNK, .first = 50, .count = 1},
             NULL),
        0);
    struct kvf_cps_page_range ranges[2] = {{10, 10}, {45, 10}}; /* the second hits page 50 */
    struct kvf_cps_join j = {.room_id = 14,
                             .expected_sources = 1,
                             .expected_sinks = 1,
                             .node_id = "n1",
                             .role = SNK,
                             .engine_protocol_min = 1,
                             .engine_protocol_max = 1,
                             .engine_features = KVF_FEATURE_QUIESCE_V1,
                             .pool_id = 1,
                             .ranges = ranges,
                             .range_count = 2};
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, NULL, &f->err), -EBUSY);
    assert_non_null(strstr(f->err.msg, "ranges[1]"));
    assert_non_null(strstr(f->err.msg, "page 50"));
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, (kvf_room_key){14, 0}, &v), -ENOENT);
    /* Pages 10..19 and 45..49 were not left marked. */
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 15, .node = "n1", .role = SNK, .first = 10, .count = 10},
                          NULL),
                     0);
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 16, .node = "n1", .role = SNK, .first = 45, .count = 5},
             NULL),
        0);
    /* No lease lists a page twice: a malformed request, refused before any
     * page is marked, for write and read leases alike. */
    struct kvf_cps_page_range twice[2] = {{100, 4}, {102, 1}};
    j.room_id = 17;
    j.ranges = twice;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, NULL, &f->err), -EINVAL);
    assert_non_null(strstr(f->err.msg, "ranges[1]: page 102 is listed twice"));
    j.role = KVF_CPS_ROLE_SOURCE;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, NULL, &f->err), -EINVAL);
    assert_non_null(strstr(f->err.msg, "listed twice"));
    j.role = KVF_CPS_ROLE_SINK;
    assert_int_equal(join(f,
                          &(struct join_args){
                              .room_id = 18, .node = "n1", .role = SNK, .first = 100, .count = 4},
                          NULL),
                     0);
    fixture_free(f);
}

/* ---- every bad input leaves state unchanged ----------------------------- */

struct snapshot {
    struct kvf_cps_stats stats;
    struct kvf_cps_room_view room;
    struct kvf_cps_participant_view parts[2];
    struct kvf_cps_page_range ranges[2][4];
};

static void take_snapshot(const struct fixture *f, kvf_room_key key, struct snapshot *s)
{
    memset(s, 0, sizeof(*s));
    kvf_cps_stats_get(f->st, &s->stats);
    assert_int_equal(kvf_cps_room_get(f->st, key, &s->room), 0);
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(kvf_cps_room_participant(f->st, key, i, &s->parts[i]), 0);
        assert_true(s->parts[i].range_count <= 4);
        memcpy(s->ranges[i], s->parts[i].ranges, s->parts[i].range_count * sizeof(s->ranges[i][0]));
        s->parts[i].ranges = NULL;
    }
}

static void assert_unchanged(struct fixture *f, kvf_room_key key, const struct snapshot *before,
                             const char *what)
{
    struct snapshot after;
    take_snapshot(f, key, &after);
    size_t n = 0;
    kvf_cps_effects_take(f->st, &n);
    if (n != 0 || memcmp(&before->stats, &after.stats, sizeof(after.stats)) != 0 ||
        memcmp(&before->room, &after.room, sizeof(after.room)) != 0 ||
        memcmp(before->parts, after.parts, sizeof(after.parts)) != 0 ||
        memcmp(before->ranges, after.ranges, sizeof(after.ranges)) != 0)
        fail_msg("%s changed the state or emitted %zu effects", what, n);
}

static void every_bad_input_leaves_state_unchanged(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_room_key key = join_pair(f, 20); /* pages 160..167 */
    assert_int_equal(attach(f, "n3", 1), 0);
    fx_reset(f);
    struct snapshot before;
    take_snapshot(f, key, &before);
    struct kvf_cps_participant_view src = before.parts[0];
    struct kvf_error *e = &f->err;
    kvf_time_ns now = f->now;
    struct kvf_cps_page_range in_use = {160, 1}, outside = {1023, 2}, empty = {5, 0}, ok = {600, 1};

    struct {
        struct join_args a;
        int rc;
    } joins[] = {
        {{.room_id = 0, .node = "n1", .role = SRC, .count = 1}, -EINVAL},
        {{.room_id = KVF_ROOM_ID_MAX + 1, .node = "n1", .role = SRC, .count = 1}, -EINVAL},
        {{.room_id = 20, .node = "n3", .role = SRC, .count = 1}, -EINVAL}, /* room full */
        {{.room_id = 20, .sources = 2, .node = "n3", .role = SRC, .count = 1}, -EINVAL}, /* shape */
        {{.room_id = 21, .node = "ghost", .role = SRC, .count = 1}, -ENOENT},
        {{.room_id = 21, .node = "n3", .role = (enum kvf_cps_role)7, .count = 1}, -EINVAL},
        {{.room_id = 21, .node = "n2", .role = SNK, .first = 160, .count = 4}, -EBUSY},
        {{.room_id = 21, .node = "n3", .role = SNK, .first = 1023, .count = 2}, -EINVAL},
        {{.room_id = 21, .node = "n3", .role = SNK, .count = 1, .pool_id = 3}, -ENOENT},
        {{.room_id = 21, .node = "n3", .role = SNK, .count = 1, .pmin = 3, .pmax = 2}, -EINVAL},
        {{.room_id = 20, .node = "n1", .role = SRC, .first = 0, .count = 3}, -EEXIST},
    };
    for (size_t i = 0; i < sizeof(joins) / sizeof(joins[0]); i++) {
        char what[32];
        snprintf(what, sizeof(what), "joins[%zu]", i);
        assert_int_equal(join(f, &joins[i].a, NULL), joins[i].rc);
        assert_true(strlen(f->err.msg) > 0);
        assert_int_equal(f->nfx, 0); /* no effect either */
        assert_unchanged(f, key, &before, what);
    }
    kvf_room_key none = {9999, 1}, stale = {20, key.generation + 1}, zero_gen = {20, 0};
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, &in_use, 0, now, e), -EINVAL);
    assert_unchanged(f, key, &before, "extend empty");
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, &empty, 1, now, e), -EINVAL);
    assert_unchanged(f, key, &before, "extend zero count");
    assert_int_equal(kvf_cps_lease_extend(f->st, key, src.lease_id, &outside, 1, now, e), -EINVAL);
    assert_unchanged(f, key, &before, "extend outside");
    assert_int_equal(kvf_cps_lease_extend(f->st, none, src.lease_id, &ok, 1, now, e), -ENOENT);
    assert_int_equal(kvf_cps_lease_extend(f->st, stale, src.lease_id, &ok, 1, now, e), -ESTALE);
    assert_int_equal(kvf_cps_lease_extend(f->st, zero_gen, src.lease_id, &ok, 1, now, e), -EINVAL);
    assert_int_equal(kvf_cps_lease_extend(f->st, key, before.parts[1].lease_id + 7, &ok, 1, now, e),
                     -ENOENT);
    assert_unchanged(f, key, &before, "extend bad key");
    kvf_token t;
    assert_int_equal(kvf_cps_room_abort(f->st, none, KVF_CPS_ABORT_ADMIN, now, &t, e), -ENOENT);
    assert_int_equal(kvf_cps_room_abort(f->st, stale, KVF_CPS_ABORT_ADMIN, now, &t, e), -ESTALE);
    assert_int_equal(kvf_cps_room_abort(f->st, key, (enum kvf_cps_abort_reason)0, now, &t, e),
                     -EINVAL);
    assert_unchanged(f, key, &before, "abort");
    assert_int_equal(kvf_cps_report_completed(f->st, "n1", 1, key, 5, SRC, now, e), -ENOENT);
    assert_int_equal(kvf_cps_report_completed(f->st, "n1", 1, key, 0, (enum kvf_cps_role)0, now, e),
                     -EINVAL);
    assert_int_equal(kvf_cps_report_failed(f->st, "n3", 1, key, now, &t, e), -ENOENT);
    assert_int_equal(kvf_cps_report_failed(f->st, "n1", 1, stale, now, &t, e), -ESTALE);
    assert_int_equal(kvf_cps_report_failed(f->st, "n1", 0, key, now, &t, e), -ESTALE);
    assert_int_equal(kvf_cps_node_detach(f->st, "ghost", 1, now, e), -ENOENT);
    assert_int_equal(kvf_cps_node_detach(f->st, "n1", 2, now, e), -ESTALE);
    assert_int_equal(kvf_cps_report_fenced(f->st, "n1", 1, "n1", 1, now, e), -EINVAL);
    assert_int_equal(kvf_cps_report_fenced(f->st, "n1", 1, "n2", 9, now, e), -ENOENT);
    /* The report counters are the one documented change: put them back. */
    struct kvf_cps_stats s;
    kvf_cps_stats_get(f->st, &s);
    assert_int_equal(s.reports_unknown, before.stats.reports_unknown + 3);
    assert_int_equal(s.reports_stale, before.stats.reports_stale + 2);
    before.stats.reports_unknown = s.reports_unknown;
    before.stats.reports_stale = s.reports_stale;
    assert_unchanged(f, key, &before, "reports");
    fixture_free(f);
}

/* Pages decoded from a page set (the service passes the form's field name):
 * every refusal names that field, without an index for a bitmap or deltas
 * and with one for page_set.ranges; ascending runs are checked without a
 * copy, including an extension above what the lease holds, and overlaps are
 * still found on every path (ascending but touching, below the held pages,
 * inside them). Nothing changes on a refusal. */
static void page_set_fields_named_and_ascending_runs_checked(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_page_range runs[] = {{10, 1}, {12, 1}, {14, 2}};
    struct kvf_cps_join j = {.room_id = 40,
                             .expected_sources = 1,
                             .expected_sinks = 1,
                             .node_id = "n1",
                             .role = SNK,
                             .engine_protocol_min = 1,
                             .engine_protocol_max = 1,
                             .engine_features = KVF_FEATURE_QUIESCE_V1,
                             .pool_id = 1,
                             .ranges = runs,
                             .range_count = 3,
                             .pages_field = "page_set.bitmap"};
    struct kvf_cps_join_result res;
    /* Past the pool (1024 pages): the field, not a range index. */
    struct kvf_cps_page_range past[] = {{10, 1}, {1023, 2}};
    j.ranges = past;
    j.range_count = 2;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res, &f->err), -EINVAL);
    assert_string_equal(f->err.msg,
                        "page_set.bitmap: page 1024 is outside pool 1 of node n1 (1024 pages)");
    /* Ascending but touching runs (page_set.ranges is indexed). */
    struct kvf_cps_page_range touch[] = {{10, 4}, {13, 1}};
    j.ranges = touch;
    j.pages_field = "page_set.ranges";
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res, &f->err), -EINVAL);
    assert_string_equal(f->err.msg, "page_set.ranges[1]: page 13 is listed twice (ranges overlap)");
    struct kvf_cps_room_view rv;
    assert_int_equal(kvf_cps_room_get(f->st, (kvf_room_key){40, 0}, &rv), -ENOENT);
    j.ranges = runs;
    j.range_count = 3;
    j.pages_field = "page_set.deltas";
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res, &f->err), 0);
    fx_collect(f);
    /* Another room's write lease: named by the field. */
    struct kvf_cps_page_range other[] = {{11, 1}, {15, 1}};
    j.room_id = 41;
    j.ranges = other;
    j.range_count = 2;
    struct kvf_cps_join_result res2;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res2, &f->err), -EBUSY);
    assert_non_null(
        strstr(f->err.msg, "page_set.deltas: page 15 of pool 1 is written by room 40:"));
    /* Extensions: above the held pages (no copy), then below, inside, touching. */
    struct kvf_cps_page_range above[] = {{20, 1}, {22, 1}};
    assert_int_equal(kvf_cps_lease_extend_named(f->st, res.key, res.lease_id, above, 2,
                                                "page_set.deltas", f->now, &f->err),
                     0);
    fx_collect(f);
    struct kvf_cps_page_range below[] = {{5, 1}, {12, 1}};
    assert_int_equal(kvf_cps_lease_extend_named(f->st, res.key, res.lease_id, below, 2,
                                                "page_set.bitmap", f->now, &f->err),
                     -EINVAL);
    assert_string_equal(f->err.msg, "page_set.bitmap: page 12 is already in this lease");
    struct kvf_cps_page_range touching[] = {{22, 3}};
    assert_int_equal(kvf_cps_lease_extend_named(f->st, res.key, res.lease_id, touching, 1,
                                                "page_set.bitmap", f->now, &f->err),
                     -EINVAL);
    assert_string_equal(f->err.msg, "page_set.bitmap: page 22 is already in this lease");
    struct kvf_cps_page_range fine[] = {{5, 1}, {11, 1}, {30, 4}};
    assert_int_equal(kvf_cps_lease_extend_named(f->st, res.key, res.lease_id, fine, 3,
                                                "page_set.bitmap", f->now, &f->err),
                     0);
    fx_collect(f);
    struct kvf_cps_participant_view pv;
    assert_int_equal(kvf_cps_room_participant(f->st, res.key, 0, &pv), 0);
    assert_int_equal(pv.range_count, 8);
    /* The old field is still "ranges", indexed. */
    struct kvf_cps_page_range dup[] = {{40, 1}, {40, 1}};
    assert_int_equal(kvf_cps_lease_extend(f->st, res.key, res.lease_id, dup, 2, f->now, &f->err),
                     -EINVAL);
    assert_string_equal(f->err.msg, "ranges[1]: page 40 is listed twice (ranges overlap)");
    fixture_free(f);
}

/* kvf_cps_join.ranges_adopt_p: a join that succeeds keeps the caller's array
 * as the lease's runs (and says so by clearing the pointer); one that fails
 * leaves it to the caller (the ASan build checks that nothing leaks and
 * nothing is freed twice). */
static void join_adopts_the_callers_runs_only_on_success(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    two_nodes(f);
    struct kvf_cps_page_range *v = malloc(3 * sizeof(*v));
    assert_non_null(v);
    v[0] = (struct kvf_cps_page_range){1, 1};
    v[1] = (struct kvf_cps_page_range){3, 2};
    v[2] = (struct kvf_cps_page_range){2000, 1}; /* outside the pool: refused */
    struct kvf_cps_page_range *keep = v;
    struct kvf_cps_join j = {.room_id = 50,
                             .expected_sources = 1,
                             .expected_sinks = 1,
                             .node_id = "n1",
                             .role = SNK,
                             .engine_protocol_min = 1,
                             .engine_protocol_max = 1,
                             .engine_features = KVF_FEATURE_QUIESCE_V1,
                             .pool_id = 1,
                             .ranges = v,
                             .range_count = 3,
                             .pages_field = "page_set.deltas",
                             .ranges_adopt_p = &v};
    struct kvf_cps_join_result res;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res, &f->err), -EINVAL);
    assert_ptr_equal(v, keep); /* still the caller's */
    j.range_count = 2;
    assert_int_equal(kvf_cps_join(f->st, &j, f->now, &res, &f->err), 0);
    fx_collect(f);
    assert_null(v); /* the lease's now */
    struct kvf_cps_participant_view pv;
    assert_int_equal(kvf_cps_room_participant(f->st, res.key, 0, &pv), 0);
    assert_int_equal(pv.range_count, 2);
    assert_int_equal(pv.ranges[1].first, 3);
    assert_int_equal(pv.ranges[1].count, 2);
    /* The lease grows from the adopted array and frees it with the room. */
    struct kvf_cps_page_range more = {10, 1};
    assert_int_equal(kvf_cps_lease_extend(f->st, res.key, res.lease_id, &more, 1, f->now, &f->err),
                     0);
    fx_collect(f);
    free(v);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(r8_source_pages_held_until_drained),
        cmocka_unit_test(write_write_overlap_across_rooms_refused_naming_page_and_room),
        cmocka_unit_test(read_read_overlap_is_allowed),
        cmocka_unit_test(write_versus_read_of_another_room_refused_both_ways),
        cmocka_unit_test(pages_outside_pool_refused_naming_page_and_pool_size),
        cmocka_unit_test(oversized_lists_refused_with_the_limit),
        cmocka_unit_test(chunked_prefill_extend_adds_pages_and_updates_peers),
        cmocka_unit_test(extend_in_opening_room_emits_no_update),
        cmocka_unit_test(failed_join_rolls_back_pages_of_earlier_ranges),
        cmocka_unit_test(every_bad_input_leaves_state_unchanged),
        cmocka_unit_test(page_set_fields_named_and_ascending_runs_checked),
        cmocka_unit_test(join_adopts_the_callers_runs_only_on_success),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
