/*
 * test_cp_proof.c: pages on a host are released only on a proof from that
 * host (docs/design.md §4, "Lost node"; issue 12).
 *
 * Peers' fences prove that a LOST node can no longer touch the peers' pages;
 * they prove nothing about its own host, where a paused process resumes and
 * lands what is in its socket buffers. A lease on the LOST node's host stays
 * RELEASING until that incarnation's own Drained (with the token) or its
 * death witnessed on its host (a new incarnation that took its lock) comes in.
 * No timer stands in for either. And pools outlive node processes: the same
 * memory registered again by a restarted node (same pool key) keeps the pages
 * that the old incarnation's leases still hold.
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

static int drained(struct fixture *f, const char *node, uint64_t inc, kvf_room_key key,
                   kvf_token token)
{
    int rc = kvf_cps_report_drained(f->st, node, inc, key, token, f->now, &f->err);
    fx_collect(f);
    return rc;
}

static int fenced(struct fixture *f, const char *fencer, const char *node, uint64_t inc)
{
    int rc = kvf_cps_report_fenced(f->st, fencer, 1, node, inc, f->now, &f->err);
    fx_collect(f);
    return rc;
}

/*
 * n1 (source) and n2 (sink) share a room; the engine aborts it while n2 is
 * frozen. n1 drains, n2 goes LOST, n1 fences n2: n1's pages are safe and its
 * lease is RELEASED; n2's own pages are not, and its lease stays RELEASING,
 * however long the clock runs. Returns the room.
 */
static kvf_room_key lost_sink_fenced_by_its_peer(struct fixture *f, kvf_token *token_p)
{
    kvf_room_key key = join_pair(f, 1);
    kvf_token t = abort_room(f, key);
    assert_int_equal(drained(f, "n1", 1, key, t), 0);
    assert_int_equal(kvf_cps_node_detach(f->st, "n2", 1, f->now, &f->err), 0);
    advance(f, 11 * KVF_NS_PER_S);
    assert_int_equal(fenced(f, "n1", "n2", 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(lease_state(f, key, 0), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n1"), 1);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 0);
    /* A day of ticks, past every deadline and the tombstone ttl: nothing. */
    for (int i = 0; i < 8640; i++)
        advance(f, 10 * KVF_NS_PER_S);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 0);
    *token_p = t;
    return key;
}

static struct kvf_cps_participant_view participant(const struct fixture *f, kvf_room_key key,
                                                   size_t idx)
{
    struct kvf_cps_participant_view p;
    assert_int_equal(kvf_cps_room_participant(f->st, key, idx, &p), 0);
    return p;
}

static uint64_t awaiting(const struct fixture *f)
{
    struct kvf_cps_stats s;
    kvf_cps_stats_get(f->st, &s);
    return s.leases_awaiting_host_proof;
}

/* Attaches `id` at `inc` with pool 1 (1024 pages) named by `key` (NULL: none)
 * and the witness `gone`. */
static int attach_keyed(struct fixture *f, const char *id, uint64_t inc, const char *key,
                        uint64_t gone)
{
    struct kvf_cps_pool pool = {.pool_id = 1, .page_size = 65536, .page_count = 1024, .key = key};
    struct kvf_cps_node_hello h = {
        .node_id = id,
        .incarnation = inc,
        .protocol_min = 1,
        .protocol_max = 1,
        .features = KVF_FEATURE_QUIESCE_V1 | KVF_FEATURE_FENCE_V1,
        .pools = key != NULL ? &pool : NULL,
        .pool_count = key != NULL ? 1 : 0,
        .witnessed_gone = gone,
    };
    int rc = kvf_cps_node_attach(f->st, &h, f->now, NULL, &f->err);
    fx_collect(f);
    return rc;
}

static void lost_nodes_own_lease_waits_for_a_proof_from_its_host(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_token t;
    kvf_room_key key = lost_sink_fenced_by_its_peer(f, &t);
    /* It says why, and the gauge counts it. */
    assert_true(participant(f, key, 1).awaiting_host_proof);
    assert_false(participant(f, key, 0).awaiting_host_proof);
    assert_int_equal(awaiting(f), 1);
    /* The room id cannot be reused while the lease waits. */
    assert_int_equal(
        join(f,
             &(struct join_args){.room_id = 1, .node = "n1", .role = SRC, .first = 500, .count = 8},
             NULL),
        -EBUSY);
    fixture_free(f);
}

static void witness_of_the_new_incarnation_releases_the_lost_nodes_lease(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_token t;
    kvf_room_key key = lost_sink_fenced_by_its_peer(f, &t);
    /* A restart alone proves nothing: the new incarnation saw no lock. */
    assert_int_equal(attach(f, "n2", 2), 0);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    /* Bad witnesses change nothing. */
    assert_int_equal(kvf_cps_node_witness(f->st, "n2", 2, 2, f->now, &f->err), -EINVAL);
    assert_int_equal(kvf_cps_node_witness(f->st, "n2", 1, 1, f->now, &f->err), -ESTALE);
    assert_int_equal(kvf_cps_node_witness(f->st, "n1", 1, 1, f->now, &f->err), -EINVAL);
    fx_collect(f);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    /* The node took n2:1's host lock: n2:1 is dead. */
    fx_reset(f);
    assert_int_equal(kvf_cps_node_witness(f->st, "n2", 2, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 1);
    assert_int_equal(awaiting(f), 0);
    struct kvf_cps_node_view nv;
    assert_int_equal(kvf_cps_node_get(f->st, "n2", &nv), 0);
    assert_false(nv.gone); /* the current one is not */
    /* Exactly once; then the tombstone runs out as usual. */
    fx_reset(f);
    assert_int_equal(kvf_cps_node_witness(f->st, "n2", 2, 1, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, NULL), 0);
    advance(f, 601 * KVF_NS_PER_S);
    struct kvf_cps_room_view v;
    assert_int_equal(kvf_cps_room_get(f->st, key, &v), -ENOENT);
    fixture_free(f);
}

static void witness_in_the_hello_releases_at_attach(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_token t;
    kvf_room_key key = lost_sink_fenced_by_its_peer(f, &t);
    assert_int_equal(attach_keyed(f, "n2", 3, NULL, 3), -EINVAL); /* not below itself */
    fx_reset(f);
    assert_int_equal(attach_keyed(f, "n2", 3, NULL, 2), 0); /* up to 2: 1 included */
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 1);
    fixture_free(f);
}

static void drained_of_the_lost_incarnation_releases_its_lease(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_token t;
    kvf_room_key key = lost_sink_fenced_by_its_peer(f, &t);
    /* The LOST incarnation cannot report on its own... */
    assert_int_equal(drained(f, "n2", 1, key, t), -ESTALE);
    /* ...its process self-fenced and came back as n2:2 with its old lifetimes. */
    assert_int_equal(attach(f, "n2", 2), 0);
    kvf_token bad = {t.hi, t.lo + 1};
    assert_int_equal(kvf_cps_report_drained_of(f->st, "n2", 2, 1, key, bad, f->now, &f->err),
                     -ESTALE);
    assert_int_equal(kvf_cps_report_drained_of(f->st, "n2", 2, 7, key, t, f->now, &f->err),
                     -EINVAL);
    assert_int_equal(kvf_cps_report_drained_of(f->st, "n1", 1, 1, key, bad, f->now, &f->err),
                     -ESTALE);
    fx_collect(f);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    fx_reset(f);
    assert_int_equal(kvf_cps_report_drained_of(f->st, "n2", 2, 1, key, t, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 1);
    assert_true(participant(f, key, 1).node_drained);
    assert_int_equal(kvf_cps_report_drained_of(f->st, "n2", 2, 1, key, t, f->now, &f->err), 0);
    fx_collect(f);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 1);
    fixture_free(f);
}

static int snap_write(void *ctx, const void *buf, size_t len)
{
    struct {
        unsigned char *p;
        size_t len;
    } *b = ctx;
    unsigned char *np = realloc(b->p, b->len + len);
    if (np == NULL)
        return -ENOMEM;
    memcpy(np + b->len, buf, len);
    b->p = np;
    b->len += len;
    return 0;
}

static void a_restart_of_the_control_plane_keeps_the_wait_and_the_witness(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    kvf_token t;
    kvf_room_key key = lost_sink_fenced_by_its_peer(f, &t);
    struct {
        unsigned char *p;
        size_t len;
    } img = {NULL, 0};
    assert_int_equal(kvf_cps_snapshot(f->st, f->now, snap_write, &img), 0);
    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    opts.random_fn = test_random;
    opts.random_ctx = &f->rng;
    struct kvf_cps *r = kvf_cps_restore(&opts, img.p, img.len, 5, &f->err);
    assert_non_null(r);
    free(img.p);
    kvf_cps_destroy(f->st);
    f->st = r;
    f->now = 5;
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    assert_true(participant(f, key, 1).awaiting_host_proof);
    assert_int_equal(awaiting(f), 1);
    for (int i = 0; i < 100; i++)
        advance(f, 10 * KVF_NS_PER_S);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    fx_reset(f);
    assert_int_equal(attach_keyed(f, "n2", 2, NULL, 1), 0);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(fx_count(f, KVF_CPS_FX_LEASE_RELEASED, "n2"), 1);
    fixture_free(f);
}

/*
 * Issue 12, item 3: n2 restarts while its old incarnation's sink lease is
 * RELEASING (n1 has not drained); its engine registers the same memory again
 * as a pool with another id. The pages the old lease holds stay out of every
 * new lease; other pages are free.
 */
static void a_pool_registered_again_keeps_the_pages_old_leases_hold(void **state)
{
    (void)state;
    struct fixture *f = fixture_new(NULL);
    assert_int_equal(attach(f, "n1", 1), 0);
    assert_int_equal(attach_keyed(f, "n2", 1, "shm:/kv-n2", 0), 0);
    kvf_room_key key = join_pair(f, 1); /* n2 sink pages [8, 16) of pool 1 */
    abort_room(f, key);
    /* n2 restarts; its Hello lists no pool yet (the engine registers later). */
    assert_int_equal(attach_keyed(f, "n2", 2, NULL, 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTING); /* n1 not drained */
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASING);
    /* The same memory under id 3, with another size: refused. */
    struct kvf_cps_pool other = {
        .pool_id = 3, .page_size = 65536, .page_count = 512, .key = "shm:/kv-n2"};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n2", 2, &other, 1, NULL, 0, &f->err),
                     -EBUSY);
    struct kvf_cps_pool again = {
        .pool_id = 3, .page_size = 65536, .page_count = 1024, .key = "shm:/kv-n2"};
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n2", 2, &again, 1, NULL, 0, &f->err), 0);
    /* Twice the same memory in one node: refused. */
    struct kvf_cps_pool twice = again;
    twice.pool_id = 4;
    assert_int_equal(kvf_cps_node_update_pools(f->st, "n2", 2, &twice, 1, NULL, 0, &f->err),
                     -EEXIST);
    /* A sink of a new room on the held pages: refused, naming the old room. */
    struct kvf_cps_join_result r;
    kvf_error_clear(&f->err);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 2, .node = "n2", .role = SNK, .first = 12, .count = 8, .pool_id = 3},
             &r),
        -EBUSY);
    assert_non_null(strstr(f->err.msg, "room 1:"));
    /* Pages the old lease does not hold are free. */
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 2, .node = "n2", .role = SNK, .first = 16, .count = 8, .pool_id = 3},
             &r),
        0);
    /* The pool cannot go while the old lease holds it. */
    assert_int_equal(kvf_cps_node_remove_pool(f->st, "n2", 2, 3, &f->err), -EBUSY);
    /* Once n1 drained and fenced n2:1, the lease is released (n2:2 witnessed
     * n2:1 in its Hello) and the pages are free again. */
    kvf_token t = room_token(f, key);
    assert_int_equal(drained(f, "n1", 1, key, t), 0);
    assert_int_equal(fenced(f, "n1", "n2", 1), 0);
    assert_int_equal(room_state(f, key), KVF_CPS_ROOM_ABORTED);
    assert_int_equal(lease_state(f, key, 1), KVF_CPS_LEASE_RELEASED);
    assert_int_equal(
        join(f,
             &(struct join_args){
                 .room_id = 3, .node = "n2", .role = SNK, .first = 8, .count = 8, .pool_id = 3},
             &r),
        0);
    fixture_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(lost_nodes_own_lease_waits_for_a_proof_from_its_host),
        cmocka_unit_test(witness_of_the_new_incarnation_releases_the_lost_nodes_lease),
        cmocka_unit_test(witness_in_the_hello_releases_at_attach),
        cmocka_unit_test(drained_of_the_lost_incarnation_releases_its_lease),
        cmocka_unit_test(a_restart_of_the_control_plane_keeps_the_wait_and_the_witness),
        cmocka_unit_test(a_pool_registered_again_keeps_the_pages_old_leases_hold),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
