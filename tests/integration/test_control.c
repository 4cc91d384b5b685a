/*
 * test_control.c: kvfence-control end to end. The group setup starts the real
 * binary (KVF_CONTROL_BIN) on 127.0.0.1 port 0 with --port-file through
 * kvf_proc.c, and the tests talk to it through kvf_rpc's blocking client and
 * protobuf-c. The last test sends SIGTERM and checks the exit status; the
 * group teardown kills the child if it is still running.
 *
 * No node attaches here, so JoinRoom is checked only for its refusals; node
 * sessions are tested end to end in test_node_session.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "grpc/health/v1/health.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"

#define CALL_TIMEOUT_MS 5000

struct fixture {
    struct kvf_proc proc;
    struct kvf_rpc_channel *ch;
};

static int group_setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    if (!f) {
        return -1;
    }
    *state = f;
    static const char *const args[] = {"--threads", "2", NULL};
    if (kvf_proc_start(&f->proc, KVF_CONTROL_BIN, args) != 0) {
        return -1;
    }
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    f->ch = kvf_rpc_channel_create(f->proc.target, &co);
    return f->ch ? 0 : -1;
}

static int group_teardown(void **state)
{
    struct fixture *f = *state;
    if (!f) {
        return 0;
    }
    kvf_rpc_channel_destroy(f->ch);
    kvf_proc_kill(&f->proc);
    free(f);
    return 0;
}

/* Packs `req`, calls `method`, returns the kvf_rpc_unary result; the reply
 * (OK only) is unpacked with `resp_desc` into *resp_p when both are given. */
static int call(struct fixture *f, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp_p,
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
    if (rc == 0 && resp_desc && resp_p) {
        *resp_p = protobuf_c_message_unpack(resp_desc, NULL, resp_len, resp);
        assert_non_null(*resp_p);
    }
    free(resp);
    return rc;
}

static void test_ping(void **state)
{
    struct fixture *f = *state;
    Kvfence__V1__PingRequest rq = KVFENCE__V1__PING_REQUEST__INIT;
    struct kvf_rpc_status st;
    ProtobufCMessage *rs = NULL;
    assert_int_equal(call(f, "/kvfence.v1.Admin/Ping", &rq.base,
                          &kvfence__v1__ping_response__descriptor, &rs, &st),
                     0);
    assert_int_equal(st.code, KVF_GRPC_OK);
    protobuf_c_message_free_unpacked(rs, NULL);
}

static void fill_join(Kvfence__V1__JoinRoomRequest *rq, Kvfence__V1__Participant *p,
                      Kvfence__V1__CapabilitySet *caps, char **features, uint64_t room_id,
                      const char *node)
{
    kvfence__v1__join_room_request__init(rq);
    kvfence__v1__participant__init(p);
    kvfence__v1__capability_set__init(caps);
    p->node_id = (char *)node;
    p->rank = 0;
    p->role = KVFENCE__V1__ROLE__ROLE_SOURCE;
    features[0] = "QUIESCE_V1";
    caps->protocol_min = 1;
    caps->protocol_max = 1;
    caps->n_features = 1;
    caps->features = features;
    rq->room_id = room_id;
    rq->expected_sources = 1;
    rq->expected_sinks = 1;
    rq->participant = p;
    rq->engine_capabilities = caps;
    rq->pool_id = 1;
}

static void test_join_unknown_node(void **state)
{
    struct fixture *f = *state;
    Kvfence__V1__JoinRoomRequest rq;
    Kvfence__V1__Participant p;
    Kvfence__V1__CapabilitySet caps;
    char *features[1];
    fill_join(&rq, &p, &caps, features, 42, "node-nowhere-7");
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Control/JoinRoom", &rq.base, NULL, NULL, &st),
                     -EREMOTEIO);
    if (st.code != KVF_GRPC_NOT_FOUND && st.code != KVF_GRPC_FAILED_PRECONDITION) {
        fail_msg("JoinRoom of an unknown node: code %d (%s)", st.code, st.message);
    }
    if (!strstr(st.message, "node-nowhere-7")) {
        fail_msg("message does not name the node: '%s'", st.message);
    }
}

static void test_join_room_id_zero(void **state)
{
    struct fixture *f = *state;
    Kvfence__V1__JoinRoomRequest rq;
    Kvfence__V1__Participant p;
    Kvfence__V1__CapabilitySet caps;
    char *features[1];
    fill_join(&rq, &p, &caps, features, 0, "node-a");
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Control/JoinRoom", &rq.base, NULL, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    if (!strstr(st.message, "room_id")) {
        fail_msg("message does not name room_id: '%s'", st.message);
    }

    /* A missing participant is named too. */
    rq.room_id = 5;
    rq.participant = NULL;
    assert_int_equal(call(f, "/kvfence.v1.Control/JoinRoom", &rq.base, NULL, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "participant"));
}

static void test_get_stats_empty(void **state)
{
    struct fixture *f = *state;
    Kvfence__V1__GetStatsRequest rq = KVFENCE__V1__GET_STATS_REQUEST__INIT;
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;
    assert_int_equal(
        call(f, "/kvfence.v1.Admin/GetStats", &rq.base, &kvfence__v1__stats__descriptor, &m, &st),
        0);
    Kvfence__V1__Stats *s = (Kvfence__V1__Stats *)m;
    if (s->rooms) { /* an all-zero sub-message may be omitted */
        assert_int_equal(s->rooms->opening + s->rooms->active + s->rooms->aborting +
                             s->rooms->completed + s->rooms->aborted,
                         0);
    }
    assert_int_equal(s->generation, 0);
    protobuf_c_message_free_unpacked(m, NULL);
}

static void test_abort_unknown_room(void **state)
{
    struct fixture *f = *state;
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 9999;
    Kvfence__V1__AbortRoomRequest rq = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    rq.room = &key;
    rq.detail = "test";
    struct kvf_rpc_status st;
    assert_int_equal(call(f, "/kvfence.v1.Control/AbortRoom", &rq.base, NULL, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_NOT_FOUND);
    assert_non_null(strstr(st.message, "9999"));

    /* room_id 0 is INVALID_ARGUMENT, naming the field. */
    key.room_id = 0;
    assert_int_equal(call(f, "/kvfence.v1.Control/AbortRoom", &rq.base, NULL, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "room_id"));
}

static void test_unknown_method(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    uint8_t *resp = NULL;
    size_t len = 0;
    assert_int_equal(kvf_rpc_unary(f->ch, "/kvfence.v1.Control/NoSuchMethod", NULL, 0,
                                   CALL_TIMEOUT_MS, &resp, &len, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNIMPLEMENTED);
    free(resp);
}

static void test_health_check(void **state)
{
    struct fixture *f = *state;
    const char *services[] = {"", "kvfence.v1.Control"};
    for (size_t i = 0; i < 2; i++) {
        Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        rq.service = (char *)services[i];
        struct kvf_rpc_status st;
        ProtobufCMessage *m = NULL;
        assert_int_equal(call(f, "/grpc.health.v1.Health/Check", &rq.base,
                              &grpc__health__v1__health_check_response__descriptor, &m, &st),
                         0);
        Grpc__Health__V1__HealthCheckResponse *rs = (Grpc__Health__V1__HealthCheckResponse *)m;
        assert_int_equal(rs->status,
                         GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
        protobuf_c_message_free_unpacked(m, NULL);
    }
}

static void test_reflection_list_services(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(
        f->ch, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", CALL_TIMEOUT_MS);
    assert_non_null(cs);
    Grpc__Reflection__V1alpha__ServerReflectionRequest rq =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__INIT;
    rq.message_request_case =
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES;
    rq.list_services = "*";
    uint8_t buf[64];
    size_t len = grpc__reflection__v1alpha__server_reflection_request__pack(&rq, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);

    uint8_t *msg = NULL;
    size_t msg_len = 0;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, CALL_TIMEOUT_MS, &msg, &msg_len, &st), 0);
    Grpc__Reflection__V1alpha__ServerReflectionResponse *rs =
        grpc__reflection__v1alpha__server_reflection_response__unpack(NULL, msg_len, msg);
    free(msg);
    assert_non_null(rs);
    assert_int_equal(
        rs->message_response_case,
        GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE);
    bool control = false, admin = false;
    for (size_t i = 0; i < rs->list_services_response->n_service; i++) {
        const char *name = rs->list_services_response->service[i]->name;
        control = control || strcmp(name, "kvfence.v1.Control") == 0;
        admin = admin || strcmp(name, "kvfence.v1.Admin") == 0;
    }
    assert_true(control);
    assert_true(admin);
    grpc__reflection__v1alpha__server_reflection_response__free_unpacked(rs, NULL);

    /* Half-close: the server finishes the stream with OK. */
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    assert_int_equal(kvf_rpc_client_stream_recv(cs, CALL_TIMEOUT_MS, &msg, &msg_len, &st),
                     KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_OK);
    kvf_rpc_client_stream_close(cs);
}

static void test_admin_views_empty(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;

    Kvfence__V1__ListRoomsRequest lr = KVFENCE__V1__LIST_ROOMS_REQUEST__INIT;
    assert_int_equal(call(f, "/kvfence.v1.Admin/ListRooms", &lr.base,
                          &kvfence__v1__list_rooms_response__descriptor, &m, &st),
                     0);
    assert_int_equal(((Kvfence__V1__ListRoomsResponse *)m)->n_rooms, 0);
    protobuf_c_message_free_unpacked(m, NULL);
    lr.page_size = 5000;
    assert_int_equal(call(f, "/kvfence.v1.Admin/ListRooms", &lr.base, NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "page_size"));

    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 77;
    Kvfence__V1__GetRoomRequest gr = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    gr.room = &key;
    assert_int_equal(call(f, "/kvfence.v1.Admin/GetRoom", &gr.base, NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_NOT_FOUND);

    Kvfence__V1__GetNodeRequest gn = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    gn.node_id = "node-b";
    assert_int_equal(call(f, "/kvfence.v1.Admin/GetNode", &gn.base, NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_NOT_FOUND);
    assert_non_null(strstr(st.message, "node-b"));
}

static void test_health_watch(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(f->ch, "/grpc.health.v1.Health/Watch", CALL_TIMEOUT_MS);
    assert_non_null(cs);
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    rq.service = "kvfence.v1.Admin";
    uint8_t buf[64];
    size_t len = grpc__health__v1__health_check_request__pack(&rq, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    uint8_t *msg = NULL;
    size_t msg_len = 0;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, CALL_TIMEOUT_MS, &msg, &msg_len, &st), 0);
    Grpc__Health__V1__HealthCheckResponse *rs =
        grpc__health__v1__health_check_response__unpack(NULL, msg_len, msg);
    free(msg);
    assert_non_null(rs);
    assert_int_equal(rs->status, GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
    grpc__health__v1__health_check_response__free_unpacked(rs, NULL);
    kvf_rpc_client_stream_cancel(cs);
    kvf_rpc_client_stream_close(cs);
}

/* Runs kvfence-control with `args` (settings from a config file holding
 * `conf`), its output in a temporary file; returns the exit status (-1: did
 * not exit within 10 s) and the output in `out`. */
static int run_once(const char *conf, const char *const *args, char *out, size_t cap)
{
    char cpath[] = "/tmp/kvf_test_control_confXXXXXX";
    char opath[] = "/tmp/kvf_test_control_outXXXXXX";
    int cfd = mkstemp(cpath);
    int ofd = mkstemp(opath);
    assert_true(cfd >= 0 && ofd >= 0);
    assert_int_equal(write(cfd, conf, strlen(conf)), (ssize_t)strlen(conf));
    close(cfd);
    const char *argv[16] = {KVF_CONTROL_BIN, "--config", cpath};
    size_t n = 3;
    for (size_t i = 0; args[i] != NULL && n < 15; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(ofd, 1);
        dup2(ofd, 2);
        execv(KVF_CONTROL_BIN, (char *const *)argv);
        _exit(127);
    }
    int status = -1;
    for (int i = 0; i < 1000; i++) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid)
            break;
        status = -1;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (status == -1) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    ssize_t got = pread(ofd, out, cap - 1, 0);
    out[got > 0 ? got : 0] = '\0';
    close(ofd);
    unlink(cpath);
    unlink(opath);
    return status;
}

/* Settings refused after a config file was read: exit 2 naming the settings,
 * and (ASan build) nothing the config module kept is leaked. */
static void test_bad_settings_exit_2(void **state)
{
    (void)state;
    char out[4096];
    static const char *const none[] = {NULL};
    int st = run_once("listen = 127.0.0.1:0\ntls-cert = /nonexistent.pem\n", none, out, sizeof out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 2);
    assert_non_null(strstr(out, "--tls-cert and --tls-key go together"));

    st = run_once("tls-client-ca = /nonexistent.pem\n", none, out, sizeof out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 2);
    assert_non_null(strstr(out, "--tls-client-ca needs"));

    st = run_once("listen = 127.0.0.1:0\nlisen = x\n", none, out, sizeof out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 2);
    assert_non_null(strstr(out, "lisen"));
}

/* --version and --help after a config file was read: exit 0, nothing leaked. */
static void test_version_and_help_exit_0(void **state)
{
    (void)state;
    char out[16384];
    static const char *const version[] = {"--version", NULL};
    static const char *const help[] = {"--help", NULL};
    int st = run_once("listen = 127.0.0.1:0\n", version, out, sizeof out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_non_null(strstr(out, "kvfence-control "));
    st = run_once("listen = 127.0.0.1:0\n", help, out, sizeof out);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_non_null(strstr(out, "--tombstone-ttl-ms"));
}

/* Last: SIGTERM makes the process exit 0 within a few seconds. */
static void test_sigterm_exits_zero(void **state)
{
    struct fixture *f = *state;
    int status = kvf_proc_stop(&f->proc, 10000);
    assert_int_not_equal(status, -1);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ping),
        cmocka_unit_test(test_join_unknown_node),
        cmocka_unit_test(test_join_room_id_zero),
        cmocka_unit_test(test_get_stats_empty),
        cmocka_unit_test(test_abort_unknown_room),
        cmocka_unit_test(test_unknown_method),
        cmocka_unit_test(test_health_check),
        cmocka_unit_test(test_health_watch),
        cmocka_unit_test(test_admin_views_empty),
        cmocka_unit_test(test_reflection_list_services),
        cmocka_unit_test(test_bad_settings_exit_2),
        cmocka_unit_test(test_version_and_help_exit_0),
        cmocka_unit_test(test_sigterm_exits_zero),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
