/*
 * test_node_metrics_unit.c: kvfence-node's metrics hooks (node_metrics.h)
 * without a node: each hook moves exactly its series, unknown transports and
 * NULL handles are ignored, every series is present at 0 from the start, and
 * the rooms collector shows what its callback counts, or the last counts when
 * the callback fails (the owner has stopped). The rendered text is read back
 * through the registry, as a scrape would.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvfence/v1/types.pb-c.h"
#include "metrics.h"
#include "node_metrics.h"
#include "scrape.h"

#define TCP   KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_TCP
#define RDMA  KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA
#define LOCAL KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_LOCAL

struct rooms_fake {
    int rc;
    uint64_t counts[NODE_ROOM_STATES];
    int calls;
};

static int rooms_cb(void *ctx, uint64_t *counts)
{
    struct rooms_fake *f = ctx;
    f->calls++;
    if (f->rc == 0)
        memcpy(counts, f->counts, sizeof f->counts);
    return f->rc;
}

static char *render(struct node_metrics *m)
{
    char *text = NULL;
    assert_int_equal(kvf_metrics_render(node_metrics_registry(m), &text, NULL), 0);
    return text;
}

/* The value of sample `series` in `text`; fails when absent. */
static double sample(const char *text, const char *series)
{
    double v = -1;
    if (scrape_sample(text, series, &v) != 0)
        fail_msg("no %s", series);
    return v;
}

static double value(struct node_metrics *m, const char *series)
{
    char *t = render(m);
    double v = sample(t, series);
    free(t);
    return v;
}

static void hooks_move_their_series(void **state)
{
    (void)state;
    struct rooms_fake rf = {0};
    struct node_metrics *m = node_metrics_create("9.9.9", rooms_cb, &rf);
    assert_non_null(m);
    char *t = render(m);
    /* Everything is there at 0 before anything happened. */
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"rdma\",direction=\"received\"}") ==
                0);
    assert_true(sample(t, "kvfence_node_chunk_latency_seconds_count{transport=\"local\"}") == 0);
    assert_true(sample(t, "kvfence_node_frames_refused_total{reason=\"not_source\"}") == 0);
    assert_true(sample(t, "kvfence_node_rooms{state=\"QUARANTINED\"}") == 0);
    assert_true(sample(t, "kvfence_build_info{version=\"9.9.9\"}") == 1);
    free(t);

    node_metrics_sent(m, TCP, 4096);
    node_metrics_sent(m, TCP, 100);
    node_metrics_sent(m, 0, 1 << 20); /* UNSPECIFIED: ignored */
    node_metrics_sent(m, 99, 1 << 20);
    node_metrics_received(m, RDMA, 3, 12288);
    node_metrics_received(m, LOCAL, 1, 8);
    t = render(m);
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"tcp\",direction=\"sent\"}") ==
                4196);
    assert_true(sample(t, "kvfence_node_frames_total{transport=\"tcp\",direction=\"sent\"}") == 2);
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"tcp\",direction=\"received\"}") ==
                0);
    assert_true(sample(t, "kvfence_node_frames_total{transport=\"rdma\",direction=\"received\"}") ==
                3);
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"rdma\",direction=\"received\"}") ==
                12288);
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"local\",direction=\"received\"}") ==
                8);
    assert_true(sample(t, "kvfence_node_bytes_total{transport=\"local\",direction=\"sent\"}") == 0);
    free(t);

    /* A chunk: in flight from start to end, one latency observation; a
     * chunk dropped before any post leaves the gauge, unobserved. */
    uint64_t t0 = node_metrics_chunk_start(m, RDMA);
    assert_true(t0 > 0);
    uint64_t t1 = node_metrics_chunk_start(m, RDMA);
    assert_true(value(m, "kvfence_node_ops_in_flight{transport=\"rdma\"}") == 2);
    node_metrics_chunk_end(m, RDMA, t0, true, true);
    node_metrics_chunk_end(m, RDMA, t1, false, false);
    t = render(m);
    assert_true(sample(t, "kvfence_node_ops_in_flight{transport=\"rdma\"}") == 0);
    assert_true(sample(t, "kvfence_node_chunk_latency_seconds_count{transport=\"rdma\"}") == 1);
    assert_true(sample(t, "kvfence_node_chunks_total{transport=\"rdma\",outcome=\"ok\"}") == 1);
    assert_true(sample(t, "kvfence_node_chunks_total{transport=\"rdma\",outcome=\"failed\"}") == 0);
    assert_true(sample(t, "kvfence_node_chunk_latency_seconds_count{transport=\"tcp\"}") == 0);
    free(t);
    uint64_t t2 = node_metrics_chunk_start(m, TCP);
    node_metrics_chunk_end(m, TCP, t2, false, true);
    assert_true(value(m, "kvfence_node_chunks_total{transport=\"tcp\",outcome=\"failed\"}") == 1);

    node_metrics_frame_refused(m, NODE_REFUSED_OUTSIDE_LEASE);
    node_metrics_frame_refused(m, NODE_REFUSED_REASONS); /* out of range: ignored */
    node_metrics_frame_late(m);
    node_metrics_frame_late(m);
    node_metrics_peers_fenced(m, 3);
    node_metrics_self_fence(m);
    node_metrics_owner_publish(m, 5, true);
    t = render(m);
    assert_true(sample(t, "kvfence_node_frames_refused_total{reason=\"outside_lease\"}") == 1);
    assert_true(sample(t, "kvfence_node_frames_refused_total{reason=\"unknown_room\"}") == 0);
    assert_true(sample(t, "kvfence_node_frames_late_total") == 2);
    assert_true(sample(t, "kvfence_node_peers_fenced_total") == 3);
    assert_true(sample(t, "kvfence_node_self_fences_total") == 1);
    assert_true(sample(t, "kvfence_node_pools") == 5);
    assert_true(sample(t, "kvfence_node_session_connected") == 1);
    free(t);
    node_metrics_owner_publish(m, 0, false);
    assert_true(value(m, "kvfence_node_session_connected") == 0);
    node_metrics_destroy(m);
}

static void rooms_from_the_callback_or_the_last_counts(void **state)
{
    (void)state;
    struct rooms_fake rf = {0};
    rf.counts[NODE_ROOM_ACTIVE] = 2;
    rf.counts[NODE_ROOM_DRAINED] = 7;
    struct node_metrics *m = node_metrics_create("1", rooms_cb, &rf);
    assert_non_null(m);
    char *t = render(m);
    assert_int_equal(rf.calls, 1); /* once per scrape */
    assert_true(sample(t, "kvfence_node_rooms{state=\"ACTIVE\"}") == 2);
    assert_true(sample(t, "kvfence_node_rooms{state=\"DRAINED\"}") == 7);
    assert_true(sample(t, "kvfence_node_rooms{state=\"OPENING\"}") == 0);
    free(t);
    /* The owner has stopped: the last counts stay. */
    rf.rc = -ESHUTDOWN;
    rf.counts[NODE_ROOM_ACTIVE] = 100;
    assert_true(value(m, "kvfence_node_rooms{state=\"ACTIVE\"}") == 2);
    rf.rc = 0;
    assert_true(value(m, "kvfence_node_rooms{state=\"ACTIVE\"}") == 100);
    node_metrics_destroy(m);
}

static void null_handle_is_a_noop(void **state)
{
    (void)state;
    node_metrics_sent(NULL, TCP, 1);
    node_metrics_received(NULL, TCP, 1, 1);
    assert_true(node_metrics_chunk_start(NULL, TCP) == 0);
    node_metrics_chunk_end(NULL, TCP, 0, true, true);
    node_metrics_frame_refused(NULL, NODE_REFUSED_UNKNOWN_ROOM);
    node_metrics_frame_late(NULL);
    node_metrics_peers_fenced(NULL, 1);
    node_metrics_self_fence(NULL);
    node_metrics_owner_publish(NULL, 1, true);
    assert_null(node_metrics_registry(NULL));
    node_metrics_destroy(NULL);
    /* Without a rooms callback there is no rooms family. */
    struct node_metrics *m = node_metrics_create("1", NULL, NULL);
    char *t = render(m);
    assert_null(strstr(t, "kvfence_node_rooms"));
    free(t);
    node_metrics_destroy(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(hooks_move_their_series),
        cmocka_unit_test(rooms_from_the_callback_or_the_last_counts),
        cmocka_unit_test(null_handle_is_a_noop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
