/*
 * test_metrics_http.c: kvfence-control's Prometheus endpoint end to end. Each
 * test starts the real binary (KVF_CONTROL_BIN, through kvf_proc.c) with
 * --metrics-listen 127.0.0.1:0 --metrics-port-file, makes a few gRPC calls and
 * reads GET /metrics over a plain TCP socket (HTTP/1.0, so the server closes
 * the connection after the answer).
 *
 * The RPC observer runs when gRPC lets a call go, which may be just after the
 * client has its answer: the checks poll /metrics until the counts show up.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_node.h"
#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"
#include "scrape.h"

#define CALL_TIMEOUT_MS 5000

struct fixture {
    struct kvf_proc proc;
    struct kvf_rpc_channel *ch;
    char dir[64]; /* our temp dir: metrics port file, data dir */
    char mport_file[128];
    char data_dir[128];
    int mport; /* 0: no metrics port file */
};

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

/* Starts the binary with the metrics flags, `with_data_dir` adding --data-dir,
 * `metrics_listen` the --metrics-listen value. */
static int start(struct fixture *f, bool with_data_dir, const char *metrics_listen)
{
    memset(f, 0, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-test-metrics-XXXXXX");
    if (!mkdtemp(f->dir)) {
        f->dir[0] = '\0';
        return -1;
    }
    snprintf(f->mport_file, sizeof f->mport_file, "%s/metrics-port", f->dir);
    snprintf(f->data_dir, sizeof f->data_dir, "%s/data", f->dir);
    const char *args[16];
    size_t n = 0;
    args[n++] = "--threads";
    args[n++] = "2";
    args[n++] = "--metrics-listen";
    args[n++] = metrics_listen;
    args[n++] = "--metrics-port-file";
    args[n++] = f->mport_file;
    if (with_data_dir) {
        args[n++] = "--data-dir";
        args[n++] = f->data_dir;
    }
    args[n] = NULL;
    if (kvf_proc_start(&f->proc, KVF_CONTROL_BIN, args) != 0) {
        return -1;
    }
    /* The metrics port file is written before the gRPC one. */
    FILE *pf = fopen(f->mport_file, "r");
    if (pf) {
        if (fscanf(pf, "%d", &f->mport) != 1) {
            f->mport = 0;
        }
        fclose(pf);
    }
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    f->ch = kvf_rpc_channel_create(f->proc.target, &co);
    return f->ch ? 0 : -1;
}

static int teardown(void **state);

/* Starts a fixture; on failure cleans up (cmocka skips the teardown of a
 * failed setup). */
static int setup_with(void **state, bool with_data_dir, const char *metrics_listen)
{
    struct fixture *f = malloc(sizeof *f);
    *state = f;
    if (!f) {
        return -1;
    }
    if (start(f, with_data_dir, metrics_listen) != 0) {
        teardown(state);
        *state = NULL;
        return -1;
    }
    return 0;
}

static int setup_durable(void **state)
{
    return setup_with(state, true, "127.0.0.1:0");
}

static int setup_memory(void **state)
{
    return setup_with(state, false, "127.0.0.1:0");
}

static int setup_disabled(void **state)
{
    return setup_with(state, false, "");
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    if (!f) {
        return 0;
    }
    kvf_rpc_channel_destroy(f->ch);
    int status = kvf_proc_stop(&f->proc, 5000);
    if (f->dir[0]) {
        nftw(f->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    free(f);
    /* A clean exit: the HTTP server stopped before the registry went. */
    if (status != -1 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        fprintf(stderr, "kvfence-control exited with status 0x%x\n", status);
        return -1;
    }
    return 0;
}

/* The value of the sample whose line starts with `series` followed by a
 * space; -1 when absent. */
static double sample(const char *text, const char *series)
{
    double v;
    return scrape_sample(text, series, &v) == 0 ? v : -1;
}

/* Scrapes until `series` has at least `want`, up to 5 s; returns the last
 * scrape (the caller frees it). */
static char *scrape_until(struct fixture *f, const char *series, double want)
{
    char *body = NULL;
    for (int i = 0; i < 500; i++) {
        free(body);
        assert_int_equal(scrape_get(f->mport, "/metrics", &body), 200);
        if (sample(body, series) >= want) {
            return body;
        }
        sleep_ms(10);
    }
    fail_msg("%s never reached %g; last scrape:\n%s", series, want, body);
    return body;
}

static int call(struct fixture *f, const char *method, const ProtobufCMessage *req,
                struct kvf_rpc_status *st)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    int rc = kvf_rpc_unary(f->ch, method, buf, len, CALL_TIMEOUT_MS, &resp, &resp_len, st);
    free(buf);
    free(resp);
    return rc;
}

static void ping(struct fixture *f)
{
    Kvfence__V1__PingRequest rq = KVFENCE__V1__PING_REQUEST__INIT;
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Admin/Ping", &rq.base, &st), 0);
}

/* A JoinRoom of a node that never attached: refused by the state thread. */
static void join_unknown_node(struct fixture *f)
{
    Kvfence__V1__JoinRoomRequest rq;
    Kvfence__V1__Participant p;
    Kvfence__V1__CapabilitySet caps;
    char *features[1] = {"QUIESCE_V1"};
    kvfence__v1__join_room_request__init(&rq);
    kvfence__v1__participant__init(&p);
    kvfence__v1__capability_set__init(&caps);
    p.node_id = "node-nowhere-9";
    p.role = KVFENCE__V1__ROLE__ROLE_SOURCE;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    rq.room_id = 42;
    rq.expected_sources = 1;
    rq.expected_sinks = 1;
    rq.participant = &p;
    rq.engine_capabilities = &caps;
    rq.pool_id = 1;
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Control/JoinRoom", &rq.base, &st), -EREMOTEIO);
    assert_int_not_equal(st.code, KVF_GRPC_OK);
}

static void unknown_method(struct fixture *f)
{
    struct kvf_rpc_status st;
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    assert_int_equal(kvf_rpc_unary(f->ch, "/kvfence.v1.Admin/NoSuchMethod", (const uint8_t *)"", 0,
                                   CALL_TIMEOUT_MS, &resp, &resp_len, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNIMPLEMENTED);
    free(resp);
}

static void assert_has(const char *text, const char *what)
{
    if (!strstr(text, what)) {
        fail_msg("no \"%s\" in:\n%s", what, text);
    }
}

/* A line for JoinRoom with a code other than OK. */
static void assert_join_failure_line(const char *text)
{
    static const char prefix[] =
        "kvfence_rpc_requests_total{method=\"/kvfence.v1.Control/JoinRoom\",code=\"";
    for (const char *p = strstr(text, prefix); p; p = strstr(p + 1, prefix)) {
        if (strncmp(p + strlen(prefix), "OK\"", 3) != 0) {
            return;
        }
    }
    fail_msg("no failed JoinRoom line in:\n%s", text);
}

static void metrics_rpc_state_and_wal(void **state)
{
    struct fixture *f = *state;
    assert_true(f->mport > 0);
    for (int i = 0; i < 3; i++) {
        ping(f);
    }
    join_unknown_node(f);
    unknown_method(f);

    char *m = scrape_until(
        f, "kvfence_rpc_requests_total{method=\"/kvfence.v1.Admin/Ping\",code=\"OK\"}", 3);
    free(m);
    m = scrape_until(f, "kvfence_rpc_requests_total{method=\"unknown\",code=\"UNIMPLEMENTED\"}", 1);
    assert_has(m, "kvfence_rpc_requests_total{method=\"/kvfence.v1.Admin/Ping\",code=\"OK\"} 3\n");
    assert_join_failure_line(m);
    /* Histograms. */
    assert_has(m, "# TYPE kvfence_rpc_latency_seconds histogram\n");
    assert_has(m,
               "kvfence_rpc_latency_seconds_bucket{method=\"/kvfence.v1.Admin/Ping\",le=\"+Inf\"} "
               "3\n");
    assert_has(m, "kvfence_rpc_latency_seconds_count{method=\"/kvfence.v1.Admin/Ping\"} 3\n");
    assert_has(m, "kvfence_rpc_latency_seconds_sum{method=\"/kvfence.v1.Admin/Ping\"} ");
    assert_has(m, "# TYPE kvfence_abort_to_released_seconds histogram\n");
    assert_has(m, "kvfence_abort_to_released_seconds_count 0\n");
    /* The state core's gauges and counters. */
    assert_has(m, "kvfence_rooms{state=\"ACTIVE\"} 0\n");
    assert_has(m, "kvfence_rooms{state=\"ABORTING\"} 0\n");
    assert_has(m, "kvfence_leases{state=\"ACTIVE\"} 0\n");
    assert_has(m, "kvfence_nodes{state=\"ATTACHED\"} 0\n");
    assert_has(m, "kvfence_notices_pending 0\n");
    assert_has(m, "kvfence_notices_sent_total 0\n");
    assert_has(m, "kvfence_notices_resent_total 0\n");
    assert_has(m, "kvfence_reports_rejected_total{reason=\"stale\"} 0\n");
    assert_has(m, "kvfence_reports_rejected_total{reason=\"tokenless\"} 0\n");
    assert_has(m, "kvfence_reports_rejected_total{reason=\"unknown\"} 0\n");
    assert_has(m, "kvfence_late_messages_total 0\n");
    assert_has(m, "kvfence_fences_requested_total 0\n");
    assert_has(m, "kvfence_rooms_past_drain_deadline 0\n");
    assert_has(m, "# TYPE kvfence_generation gauge\n");
    /* The WAL: the start-up record at least is durable. */
    assert_has(m, "# TYPE kvfence_wal_records_total counter\n");
    assert_true(sample(m, "kvfence_wal_records_total") >= 1);
    assert_true(sample(m, "kvfence_wal_fsyncs_total") >= 1);
    /* A histogram-typed family (promtool refused the old counter typing). */
    assert_has(m, "# TYPE kvfence_wal_fsync_latency_seconds histogram\n");
    double fsync_count = sample(m, "kvfence_wal_fsync_latency_seconds_count");
    assert_true(fsync_count >= 1);
    assert_true(sample(m, "kvfence_wal_fsync_latency_seconds_bucket{le=\"+Inf\"}") == fsync_count);
    assert_true(sample(m, "kvfence_wal_fsync_latency_seconds_bucket{le=\"1.6e-05\"}") >= 0);
    /* Every daemon: its build and its process. */
    assert_has(m, "kvfence_build_info{version=\"");
    assert_true(sample(m, "process_cpu_seconds_total") >= 0);
    assert_true(sample(m, "process_resident_memory_bytes") > 0);
    assert_true(sample(m, "process_open_fds") > 0);
    assert_true(sample(m, "process_start_time_seconds") > 1.7e9);
    assert_true(sample(m, "kvfence_wal_last_fsync_seconds") >= 0);
    assert_has(m, "kvfence_wal_snapshots_total ");
    free(m);

    char *body = NULL;
    assert_int_equal(scrape_get(f->mport, "/healthz", &body), 200);
    free(body);
    assert_int_equal(scrape_get(f->mport, "/nope", &body), 404);
    free(body);
}

static void metrics_memory_only_has_no_wal(void **state)
{
    struct fixture *f = *state;
    assert_true(f->mport > 0);
    ping(f);
    char *m = scrape_until(
        f, "kvfence_rpc_requests_total{method=\"/kvfence.v1.Admin/Ping\",code=\"OK\"}", 1);
    assert_has(m, "kvfence_rooms{state=\"OPENING\"} 0\n");
    assert_null(strstr(m, "kvfence_wal_"));
    free(m);
}

/* One node joins a room as its source, the room is aborted, the node drains:
 * ABORTING -> ABORTED is observed once; refused reports are counted by
 * reason and as late messages. */
static void metrics_abort_to_released_and_rejected_reports(void **state)
{
    struct fixture *f = *state;
    assert_true(f->mport > 0);
    struct fake_node *n = fake_node_attach(f->ch, "m1", 1);
    assert_non_null(n);

    Kvfence__V1__JoinRoomRequest rq;
    Kvfence__V1__Participant p;
    Kvfence__V1__CapabilitySet caps;
    Kvfence__V1__PageRange r = KVFENCE__V1__PAGE_RANGE__INIT;
    Kvfence__V1__PageRange *rs[1] = {&r};
    char *features[1] = {"QUIESCE_V1"};
    kvfence__v1__join_room_request__init(&rq);
    kvfence__v1__participant__init(&p);
    kvfence__v1__capability_set__init(&caps);
    p.node_id = "m1";
    p.role = KVFENCE__V1__ROLE__ROLE_SOURCE;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    r.first = 0;
    r.count = 4;
    rq.room_id = 77;
    rq.expected_sources = 1;
    rq.expected_sinks = 1;
    rq.participant = &p;
    rq.engine_capabilities = &caps;
    rq.pool_id = FAKE_NODE_POOL_ID;
    rq.n_ranges = 1;
    rq.ranges = rs;
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Control/JoinRoom", &rq.base, &st), 0);

    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 77;
    Kvfence__V1__AbortRoomRequest ab = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    ab.room = &key;
    ab.detail = "metrics test";
    size_t len = protobuf_c_message_get_packed_size(&ab.base);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    protobuf_c_message_pack(&ab.base, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    assert_int_equal(kvf_rpc_unary(f->ch, "/kvfence.v1.Control/AbortRoom", buf, len,
                                   CALL_TIMEOUT_MS, &resp, &resp_len, &st),
                     0);
    free(buf);
    Kvfence__V1__AbortRoomResponse *ar =
        kvfence__v1__abort_room_response__unpack(NULL, resp_len, resp);
    free(resp);
    assert_non_null(ar);
    assert_non_null(ar->token);
    assert_non_null(ar->room);
    Kvfence__V1__AbortToken tok = *ar->token;
    uint64_t gen = ar->room->generation;
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);

    char *m = scrape_until(f, "kvfence_rooms{state=\"ABORTING\"}", 1);
    free(m);
    /* Refused: a foreign token (stale), no token, an unknown room. */
    Kvfence__V1__AbortToken bad = tok;
    bad.lo ^= 1;
    assert_int_equal(fake_node_send_drained(n, 77, gen, &bad), 0);
    assert_int_equal(fake_node_send_drained(n, 77, gen, NULL), 0);
    assert_int_equal(fake_node_send_drained(n, 999, 1, &tok), 0);
    /* The real drain: every lease released, the room ABORTED. */
    assert_int_equal(fake_node_send_drained(n, 77, gen, &tok), 0);

    m = scrape_until(f, "kvfence_abort_to_released_seconds_count", 1);
    assert_has(m, "kvfence_abort_to_released_seconds_count 1\n");
    assert_true(sample(m, "kvfence_abort_to_released_seconds_bucket{le=\"+Inf\"}") == 1);
    assert_true(sample(m, "kvfence_abort_to_released_seconds_sum") >= 0);
    assert_has(m, "kvfence_rooms{state=\"ABORTING\"} 0\n");
    assert_has(m, "kvfence_rooms{state=\"ABORTED\"} 1\n");
    assert_has(m, "kvfence_leases{state=\"RELEASED\"} 1\n");
    assert_has(m, "kvfence_nodes{state=\"ATTACHED\"} 1\n");
    assert_true(sample(m, "kvfence_notices_sent_total") >= 1);
    assert_has(m, "kvfence_reports_rejected_total{reason=\"stale\"} 1\n");
    assert_has(m, "kvfence_reports_rejected_total{reason=\"tokenless\"} 1\n");
    assert_has(m, "kvfence_reports_rejected_total{reason=\"unknown\"} 1\n");
    assert_has(m, "kvfence_late_messages_total 2\n");
    assert_true(sample(m, "kvfence_generation") >= 1);
    assert_has(
        m, "kvfence_rpc_requests_total{method=\"/kvfence.v1.Control/AbortRoom\",code=\"OK\"} 1\n");
    assert_has(m, "kvfence_insecure 1\n"); /* plaintext: nobody is authenticated */
    free(m);
    fake_node_close(n);
}

static void metrics_disabled_by_empty_listen(void **state)
{
    struct fixture *f = *state;
    assert_int_equal(f->mport, 0);
    assert_int_not_equal(access(f->mport_file, F_OK), 0);
    ping(f); /* gRPC serves regardless */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(metrics_rpc_state_and_wal, setup_durable, teardown),
        cmocka_unit_test_setup_teardown(metrics_memory_only_has_no_wal, setup_memory, teardown),
        cmocka_unit_test_setup_teardown(metrics_abort_to_released_and_rejected_reports,
                                        setup_memory, teardown),
        cmocka_unit_test_setup_teardown(metrics_disabled_by_empty_listen, setup_disabled, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
