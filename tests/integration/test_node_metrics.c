/*
 * test_node_metrics.c: kvfence-node's /metrics during real transfers
 * (docs/metrics.md, "Node metrics"). One kvfence-control and two
 * kvfence-node processes (n1, n2; node_harness.c) on 127.0.0.1, each serving
 * /metrics on --metrics-listen 127.0.0.1:0 with its port in a
 * --metrics-port-file; the test plays the engine (shm pools, JoinRoom,
 * SubmitChunk) and scrapes every daemon over plain HTTP before, during and
 * after:
 *
 *   - a TCP transfer n1 -> n2: bytes and frames grow on both sides by exactly
 *     the chunk's bytes, the chunk latency count by one, ops in flight come
 *     back to 0, and the rooms by state move ACTIVE -> DRAINED on both nodes
 *     (and to COMPLETED on the control plane);
 *   - a same-node transfer on n1 (the local transport): local sent and
 *     received both grow by the chunk's bytes;
 *   - a transfer over the fake RDMA fabric (once the link is up): rdma sent
 *     on the source, rdma received on the sink (its checked ChunkNotice);
 *   - a frame held in the source's transport, released after the sink
 *     closed the room (the source kept its abort notice back): an op in
 *     flight on the source, then late on the sink (nothing received);
 *   - the control plane killed: the nodes' session gauge drops to 0 and,
 *     past node_ttl, each node counts a self-fence.
 *
 * Waits are on scraped values with timeouts, never a fixed sleep.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"
#include "scrape.h"

#define WAIT_MS     10000
#define PAGE_SIZE   4096u
#define PAGE_COUNT  64u
#define NODE_TTL_MS "1500"

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    char cp_mport[128], n1_mport[128], n2_mport[128];
    int cp_port, n1_port, n2_port; /* metrics ports */
    struct nh_node n1, n2;
    struct nh_pool p1, p2, p1b;
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    struct nh_pool *pools[] = {&f->p1, &f->p2, &f->p1b};
    unlink(f->cp_mport);
    unlink(f->n1_mport);
    unlink(f->n2_mport);
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 8000, pools, 3, f->dir);
    free(f);
    return rc;
}

/* ---- scraping ------------------------------------------------------------------- */

/* The port in a metrics port file, waiting up to 10 s for it. */
static int read_port(const char *path)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        FILE *fp = fopen(path, "r");
        int port = 0;
        if (fp) {
            if (fscanf(fp, "%d", &port) != 1)
                port = 0;
            fclose(fp);
        }
        if (port > 0)
            return port;
        if (nh_now_ms() > end)
            fail_msg("no metrics port in %s", path);
        nh_sleep_ms(20);
    }
}

/* GET /metrics on 127.0.0.1:port: the body (malloc'd), or NULL when the
 * server does not answer 200. */
static char *scrape(int port)
{
    char *body = NULL;
    if (scrape_get(port, "/metrics", &body) != 200) {
        free(body);
        return NULL;
    }
    return body;
}

/* The value of the sample `series` (the whole name with its labels, as
 * rendered) in `text`; fails the test when it is absent. */
static double sample(const char *text, const char *series)
{
    double v = -1;
    if (scrape_sample(text, series, &v) != 0)
        fail_msg("no sample %s in:\n%s", series, text);
    return v;
}

/* One sample, scraped now. */
static double value(int port, const char *series)
{
    char *t = scrape(port);
    if (!t)
        fail_msg("no answer from /metrics on port %d", port);
    double v = sample(t, series);
    free(t);
    return v;
}

/* Scrapes until `series` equals `want`, up to 10 s. */
static void wait_value(int port, const char *series, double want)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    double v;
    while ((v = value(port, series)) != want) {
        if (nh_now_ms() > end)
            fail_msg("%s on port %d: %g, want %g", series, port, v, want);
        nh_sleep_ms(20);
    }
}

/* ---- fixture ---------------------------------------------------------------------- */

/* `rdma`: both nodes on the fake verbs fabric (a name of this run), with log
 * files (the link's coming up is read from them). */
static void fx_start_flags(struct fx *f, bool rdma, unsigned flags)
{
    nh_tmpdir(f->dir, sizeof f->dir, "nmetrics");
    snprintf(f->cp_mport, sizeof f->cp_mport, "%s/cp.mport", f->dir);
    snprintf(f->n1_mport, sizeof f->n1_mport, "%s/n1.mport", f->dir);
    snprintf(f->n2_mport, sizeof f->n2_mport, "%s/n2.mport", f->dir);
    const char *args[] = {
        "--threads",        "2",           "--node-ttl-ms",       NODE_TTL_MS, "--resend-ms", "50",
        "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", f->cp_mport, NULL};
    nh_control_start(&f->cp, &f->ch, args);
    f->cp_port = read_port(f->cp_mport);
    char fabric[64];
    snprintf(fabric, sizeof fabric, "kvfm-%d", (int)getpid());
    const char *x1[] = {"--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                        f->n1_mport,        "--rdma",      rdma ? "fake" : "off",
                        "--rdma-fabric",    fabric,        NULL};
    const char *x2[] = {"--metrics-listen", "127.0.0.1:0", "--metrics-port-file",
                        f->n2_mport,        "--rdma",      rdma ? "fake" : "off",
                        "--rdma-fabric",    fabric,        NULL};
    unsigned fl = flags | (rdma ? NH_LOG_FILE : 0);
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, x1, fl), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, x2, fl), 0);
    f->n1_port = read_port(f->n1_mport);
    f->n2_port = read_port(f->n2_mport);
    assert_int_equal(nh_pool_create(&f->p1, "nm", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "nm", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static void fx_start_with(struct fx *f, bool rdma)
{
    fx_start_flags(f, rdma, 0);
}

static void fx_start(struct fx *f)
{
    fx_start_with(f, false);
}

#define TCP_SENT     "kvfence_node_bytes_total{transport=\"tcp\",direction=\"sent\"}"
#define TCP_RECV     "kvfence_node_bytes_total{transport=\"tcp\",direction=\"received\"}"
#define TCP_FSENT    "kvfence_node_frames_total{transport=\"tcp\",direction=\"sent\"}"
#define TCP_FRECV    "kvfence_node_frames_total{transport=\"tcp\",direction=\"received\"}"
#define TCP_LAT_N    "kvfence_node_chunk_latency_seconds_count{transport=\"tcp\"}"
#define TCP_OK       "kvfence_node_chunks_total{transport=\"tcp\",outcome=\"ok\"}"
#define TCP_INFLIGHT "kvfence_node_ops_in_flight{transport=\"tcp\"}"
#define ROOMS(s)     "kvfence_node_rooms{state=\"" s "\"}"

/* ---- tests ------------------------------------------------------------------------ */

static void test_tcp_transfer_moves_both_nodes(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* Attached, a pool each, nothing moved yet. */
    wait_value(f->n1_port, "kvfence_node_session_connected", 1);
    wait_value(f->n2_port, "kvfence_node_session_connected", 1);
    wait_value(f->n1_port, "kvfence_node_pools", 1);
    wait_value(f->n2_port, "kvfence_node_pools", 1);
    assert_true(value(f->n1_port, TCP_SENT) == 0);
    assert_true(value(f->n2_port, TCP_RECV) == 0);
    assert_true(value(f->n1_port, TCP_LAT_N) == 0);
    assert_true(value(f->n1_port, ROOMS("ACTIVE")) == 0);

    kvf_room_key k =
        nh_join_pair(f->ch, 301, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id, 16, 8, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    wait_value(f->n1_port, ROOMS("ACTIVE"), 1);
    wait_value(f->n2_port, ROOMS("ACTIVE"), 1);
    assert_true(value(f->n1_port, ROOMS("DRAINED")) == 0);

    nh_submit_one_ok(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, 16, 8);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_check_pool(&f->p2, nh_canary2, 16, 8, nh_canary1, 0, "n2");

    const double bytes = 8.0 * PAGE_SIZE;
    wait_value(f->n1_port, TCP_SENT, bytes);
    wait_value(f->n2_port, TCP_RECV, bytes);
    assert_true(value(f->n1_port, TCP_FSENT) >= 1);
    assert_true(value(f->n2_port, TCP_FRECV) == value(f->n1_port, TCP_FSENT));
    /* The source sent, the sink received: not the other way round. */
    assert_true(value(f->n1_port, TCP_RECV) == 0);
    assert_true(value(f->n2_port, TCP_SENT) == 0);
    assert_true(value(f->n1_port, TCP_LAT_N) == 1);
    assert_true(value(f->n1_port, TCP_OK) == 1);
    assert_true(value(f->n1_port, TCP_INFLIGHT) == 0);
    assert_true(value(f->n2_port, TCP_LAT_N) == 0);
    /* Rooms by state moved on both nodes, and on the control plane. */
    wait_value(f->n1_port, ROOMS("DRAINED"), 1);
    wait_value(f->n2_port, ROOMS("DRAINED"), 1);
    assert_true(value(f->n1_port, ROOMS("ACTIVE")) == 0);
    assert_true(value(f->n2_port, ROOMS("ACTIVE")) == 0);
    wait_value(f->cp_port, "kvfence_rooms{state=\"COMPLETED\"}", 1);
    assert_true(value(f->n1_port, "kvfence_node_frames_late_total") == 0);
    assert_true(value(f->n2_port, "kvfence_node_frames_refused_total{reason=\"unknown_room\"}") ==
                0);
}

static void test_local_transfer_and_lost_control_plane(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    /* A second pool on n1: a room whose source and sink are both on n1. */
    assert_int_equal(nh_pool_create(&f->p1b, "nm", "n1b", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1b.pool_id = nh_register_pool(&f->n1, &f->p1b);
    wait_value(f->n1_port, "kvfence_node_pools", 2);
    kvf_room_key k =
        nh_join_pair(f->ch, 302, "n1", f->p1.pool_id, 0, "n1", f->p1b.pool_id, 4, 4, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n1", f->p1b.pool_id, 4, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->p1.pool_id, "n1", f->p1b.pool_id, 0, 4, 4);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    const double bytes = 4.0 * PAGE_SIZE;
    wait_value(f->n1_port, "kvfence_node_bytes_total{transport=\"local\",direction=\"sent\"}",
               bytes);
    wait_value(f->n1_port, "kvfence_node_bytes_total{transport=\"local\",direction=\"received\"}",
               bytes);
    assert_true(
        value(f->n1_port, "kvfence_node_chunk_latency_seconds_count{transport=\"local\"}") == 1);
    assert_true(value(f->n1_port, TCP_SENT) == 0);
    assert_true(value(f->n2_port, "kvfence_node_bytes_total{transport=\"local\",direction="
                                  "\"received\"}") == 0);

    /* The control plane goes: the sessions drop, and past node_ttl each
     * node fences itself (a new incarnation). */
    assert_true(value(f->n1_port, "kvfence_node_self_fences_total") == 0);
    kvf_proc_kill(&f->cp);
    wait_value(f->n1_port, "kvfence_node_session_connected", 0);
    wait_value(f->n2_port, "kvfence_node_session_connected", 0);
    wait_value(f->n1_port, "kvfence_node_self_fences_total", 1);
    wait_value(f->n2_port, "kvfence_node_self_fences_total", 1);
}

/* Over the fake RDMA fabric: the first room opens the link (its chunk goes
 * over TCP), the second moves by RDMA writes, counted as rdma on both sides. */
static void test_rdma_transfer_counts_rdma(void **state)
{
    struct fx *f = *state;
    fx_start_with(f, true);
    kvf_room_key k =
        nh_join_pair(f->ch, 303, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id, 0, 4, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, 0, 4);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_wait_log(&f->n1, "up (initiator)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 1, WAIT_MS);
    wait_value(f->n1_port, TCP_SENT, 4.0 * PAGE_SIZE); /* the warm-up went over TCP */

    k = nh_join_pair(f->ch, 304, "n1", f->p1.pool_id, 16, "n2", f->p2.pool_id, 16, 8, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, 16, 8);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    /* The pages landed (the warm-up's pages 0..3 changed too). */
    assert_memory_equal(f->p2.mem + (size_t)16 * PAGE_SIZE, f->p1.mem + (size_t)16 * PAGE_SIZE,
                        (size_t)8 * PAGE_SIZE);
    const double bytes = 8.0 * PAGE_SIZE;
    wait_value(f->n1_port, "kvfence_node_bytes_total{transport=\"rdma\",direction=\"sent\"}",
               bytes);
    wait_value(f->n2_port, "kvfence_node_bytes_total{transport=\"rdma\",direction=\"received\"}",
               bytes);
    assert_true(value(f->n2_port,
                      "kvfence_node_frames_total{transport=\"rdma\",direction=\"received\"}") >= 1);
    assert_true(value(f->n1_port, "kvfence_node_chunk_latency_seconds_count{transport=\"rdma\"}") ==
                1);
    assert_true(value(f->n1_port, TCP_SENT) == 4.0 * PAGE_SIZE); /* nothing more over TCP */
    assert_true(value(f->n2_port, "kvfence_node_frames_refused_total{reason=\"rdma_notice\"}") ==
                0);
}

/* A frame that reaches n2 after n2 closed the room: n1 holds its frame
 * (fault hold=1) and drops the abort notices (drop_abort), so its own
 * lifetime stays open while n2's drains; released then, the frame goes out
 * and n2 drops it as late (nothing received). While held it is an op in
 * flight on n1. */
static void test_frame_after_abort_is_late(void **state)
{
    struct fx *f = *state;
    fx_start_flags(f, false, NH_LOG_FILE | NH_FAULT_FILE);
    nh_set_faults(&f->n1, "hold=1\ndrop_abort=1000\n", WAIT_MS);
    kvf_room_key k =
        nh_join_pair(f->ch, 305, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id, 16, 8, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, 16, 8);
    nh_wait_log(&f->n1, "fault: hold frame", &k, 1, WAIT_MS);
    wait_value(f->n1_port, TCP_INFLIGHT, 1);
    assert_true(value(f->n1_port, TCP_LAT_N) == 0);
    nh_abort_room(f->ch, k, "metrics test abort");
    /* n2 has nothing in flight: it drains at once; n1 does not hear of it. */
    wait_value(f->n2_port, ROOMS("DRAINED"), 1);
    assert_true(value(f->n1_port, ROOMS("ACTIVE")) == 1);
    nh_set_faults(&f->n1, "drop_abort=1000\n", WAIT_MS); /* the frame goes out */
    wait_value(f->n2_port, "kvfence_node_frames_late_total", 1);
    wait_value(f->n1_port, TCP_LAT_N, 1);
    wait_value(f->n1_port, TCP_INFLIGHT, 0);
    assert_true(value(f->n1_port, TCP_SENT) == 8.0 * PAGE_SIZE); /* in the socket */
    assert_true(value(f->n2_port, TCP_RECV) == 0);
    assert_true(value(f->n2_port, TCP_FRECV) == 0);
    assert_true(value(f->n2_port, "kvfence_node_frames_refused_total{reason=\"outside_lease\"}") ==
                0);
    nh_check_pool(&f->p2, nh_canary2, 16, 0, nh_canary1, 0, "n2"); /* nothing landed */
    /* The abort reaches n1 now: the room ends. */
    nh_set_faults(&f->n1, "", WAIT_MS);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    wait_value(f->n1_port, ROOMS("DRAINED"), 1);
    wait_value(f->cp_port, "kvfence_rooms{state=\"ABORTED\"}", 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_tcp_transfer_moves_both_nodes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_local_transfer_and_lost_control_plane, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_rdma_transfer_counts_rdma, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frame_after_abort_is_late, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
