/*
 * health_rpc.c: the gRPC edge of the health registry. Check decodes nothing
 * itself: kvf_health_check() takes the request bytes and says which status
 * code to finish with. A Watch stream is one registry watch whose context is
 * the stream; the stream's user pointer marks that the watch was added, so
 * on_closed removes only what on_open added.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#include "health_rpc.h"
#include "kvf_error.h"

/* protobuf-c and gRPC want a pointer even for 0 bytes. */
static const uint8_t empty_msg[1];

static void health_check(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct kvf_health *h = ctx;
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    int code = 0;
    int rc = kvf_health_check(h, req ? req : empty_msg, len, &resp, &resp_len, &code);
    if (rc < 0) {
        kvf_rpc_call_fail(
            call, rc == -ENOMEM ? KVF_GRPC_RESOURCE_EXHAUSTED : KVF_GRPC_INVALID_ARGUMENT,
            rc == -ENOMEM ? "out of memory" : "request: does not decode as HealthCheckRequest");
        return;
    }
    if (code == KVF_GRPC_OK)
        kvf_rpc_call_reply(call, resp, resp_len);
    else
        kvf_rpc_call_fail(call, code, "service: not registered with the health service");
    free(resp);
}

/* Runs with the registry's mutex held: only queue the bytes. */
static void health_watch_cb(void *ctx, const uint8_t *resp, size_t len)
{
    struct kvf_rpc_stream *stream = ctx;
    kvf_rpc_stream_send(stream, len ? resp : empty_msg, len);
}

static void health_watch_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req,
                              size_t len)
{
    struct kvf_health *h = ctx;
    int rc = kvf_health_watch_add_request(h, req ? req : empty_msg, len, health_watch_cb, stream);
    if (rc < 0) {
        kvf_rpc_stream_finish(
            stream, rc == -ENOMEM ? KVF_GRPC_RESOURCE_EXHAUSTED : KVF_GRPC_INVALID_ARGUMENT,
            rc == -ENOMEM ? "out of memory" : "request: does not decode as HealthCheckRequest");
        return;
    }
    kvf_rpc_stream_set_user(stream, h);
}

static void health_watch_closed(void *ctx, struct kvf_rpc_stream *stream,
                                enum kvf_rpc_close_reason reason)
{
    struct kvf_health *h = ctx;
    (void)reason;
    if (kvf_rpc_stream_user(stream)) {
        kvf_health_watch_remove(h, health_watch_cb, stream);
        kvf_rpc_stream_set_user(stream, NULL);
    }
}

int kvf_health_rpc_register(struct kvf_rpc_server *srv, struct kvf_health *h)
{
    int rc = kvf_rpc_server_add_unary(srv, "/grpc.health.v1.Health/Check", health_check, h);
    if (rc < 0)
        return rc;
    const struct kvf_rpc_stream_callbacks watch = {.on_open = health_watch_open,
                                                   .on_closed = health_watch_closed};
    return kvf_rpc_server_add_stream(srv, "/grpc.health.v1.Health/Watch", KVF_RPC_SERVER_STREAMING,
                                     &watch, h);
}
