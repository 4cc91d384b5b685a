/*
 * probe.c: `kvfence-node --probe`: one grpc.health.v1 Check against a
 * running node's unix socket, the answer as an exit status. It starts no
 * node: a blocking channel, one unary call, done.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kvf_error.h"
#include "probe.h"
#include "rpc_client.h"

int kvf_node_probe(const char *local_socket, int64_t timeout_ms)
{
    char target[300];
    snprintf(target, sizeof target, "unix:%s", local_socket);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, &co);
    if (!ch) {
        fprintf(stderr, "kvfence-node --probe: %s: cannot create a channel\n", target);
        return 1;
    }
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = "";
    uint8_t buf[16]; /* an empty service name packs to 0 bytes */
    size_t len = grpc__health__v1__health_check_request__pack(&req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_unary(ch, "/grpc.health.v1.Health/Check", buf, len, timeout_ms, &resp,
                           &resp_len, &st);
    kvf_rpc_channel_destroy(ch);
    if (rc != 0) {
        fprintf(stderr, "kvfence-node --probe: %s: %s: %s\n", target,
                kvf_grpc_code_name((enum kvf_grpc_code)st.code), st.message);
        return 1;
    }
    Grpc__Health__V1__HealthCheckResponse *r =
        grpc__health__v1__health_check_response__unpack(NULL, resp_len, resp);
    free(resp);
    if (!r) {
        fprintf(stderr, "kvfence-node --probe: %s: undecodable HealthCheckResponse\n", target);
        return 1;
    }
    bool serving = r->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
        &grpc__health__v1__health_check_response__serving_status__descriptor, (int)r->status);
    printf("%s\n", v ? v->name : "UNKNOWN");
    grpc__health__v1__health_check_response__free_unpacked(r, NULL);
    return serving ? 0 : 1;
}
