/*
 * test_node_health.c: kvfence-node serves grpc.health.v1 on its unix socket
 * (docs/node.md, "Health"). One kvfence-control, one kvfence-node
 * (node_harness.c); the test asks the node's socket, as a probe would:
 *
 *  - attached: Check "" and "kvfence.v1.NodeLocal" answer SERVING, an unknown
 *    service NOT_FOUND, and `kvfence-node --probe` exits 0;
 *  - the control plane killed: a Watch opened while attached sees SERVING,
 *    then NOT_SERVING; Check says NOT_SERVING and the probe exits 1.
 *
 * Before the node served health, every call here answered UNIMPLEMENTED.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS 10000

#define SERVING     GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
#define NOT_SERVING GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1;
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    struct nh_node *nodes[] = {&f->n1};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 1, 8000, NULL, 0, f->dir);
    free(f);
    return rc;
}

static void fx_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "1500", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "health");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, 0), 0);
}

/* Check `service` on the node's socket: the gRPC code; the status in *st_p on OK. */
static int check(struct nh_node *np, const char *service, int *status_p)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    uint8_t *resp = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int code = nh_call(np->local, "/grpc.health.v1.Health/Check", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK) {
        fprintf(stderr, "Check(\"%s\"): %s: %s\n", service,
                kvf_grpc_code_name((enum kvf_grpc_code)code), st.message);
        return code;
    }
    Grpc__Health__V1__HealthCheckResponse *r =
        grpc__health__v1__health_check_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(r);
    *status_p = (int)r->status;
    grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    return code;
}

/* Waits up to WAIT_MS for Check(service) to answer OK with `want`. */
static void wait_status(struct nh_node *np, const char *service, int want)
{
    int64_t end = nh_now_ms() + WAIT_MS;
    int status = -1;
    for (;;) {
        int code = check(np, service, &status);
        assert_int_equal(code, KVF_GRPC_OK);
        if (status == want)
            return;
        if (nh_now_ms() > end)
            fail_msg("Check(\"%s\"): status %d, want %d after %d ms", service, status, want,
                     WAIT_MS);
        nh_sleep_ms(20);
    }
}

/* Runs `kvfence-node --probe --local-socket SOCK`: its exit status, -1 if it
 * did not exit normally. */
static int run_probe(const struct nh_node *np)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        execl(KVF_NODE_BIN, KVF_NODE_BIN, "--probe", "--local-socket", np->sock,
              "--probe-timeout-ms", "2000", (char *)NULL);
        _exit(127);
    }
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static void test_attached_node_is_serving(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    wait_status(&f->n1, "", SERVING);
    wait_status(&f->n1, "kvfence.v1.NodeLocal", SERVING);
    int status = -1;
    assert_int_equal(check(&f->n1, "no.such.Service", &status), KVF_GRPC_NOT_FOUND);
    assert_int_equal(run_probe(&f->n1), 0);
}

static void test_node_without_control_plane_is_not_serving(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    wait_status(&f->n1, "", SERVING);

    /* A Watch opened while attached: SERVING first, NOT_SERVING once the
     * session is gone. */
    uint8_t empty[1];
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(f->n1.local, "/grpc.health.v1.Health/Watch", WAIT_MS);
    assert_non_null(cs);
    assert_int_equal(kvf_rpc_client_stream_send(cs, empty, 0), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    int seen[2] = {-1, -1};
    unsigned nseen = 0;
    struct kvf_rpc_status st;
    int64_t end = nh_now_ms() + WAIT_MS;
    while (nseen < 2 && nh_now_ms() < end) {
        if (nseen == 1)
            kvf_proc_kill(&f->cp); /* after the first status: the session ends */
        uint8_t *msg = NULL;
        size_t len = 0;
        int rc = kvf_rpc_client_stream_recv(cs, 200, &msg, &len, &st);
        if (rc == -ETIMEDOUT)
            continue;
        if (rc != 0)
            fail_msg("Watch ended: %s: %s", kvf_grpc_code_name((enum kvf_grpc_code)st.code),
                     st.message);
        Grpc__Health__V1__HealthCheckResponse *r =
            grpc__health__v1__health_check_response__unpack(NULL, len, msg ? msg : empty);
        free(msg);
        assert_non_null(r);
        seen[nseen++] = (int)r->status;
        grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    }
    kvf_rpc_client_stream_cancel(cs);
    kvf_rpc_client_stream_close(cs);
    assert_int_equal(nseen, 2);
    assert_int_equal(seen[0], SERVING);
    assert_int_equal(seen[1], NOT_SERVING);

    wait_status(&f->n1, "", NOT_SERVING);
    wait_status(&f->n1, "kvfence.v1.NodeLocal", NOT_SERVING);
    assert_int_equal(run_probe(&f->n1), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_attached_node_is_serving, setup, teardown),
        cmocka_unit_test_setup_teardown(test_node_without_control_plane_is_not_serving, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
