/*
 * fuzz_services.c: every request of kvfence-control's services decoded and
 * handled through the pure path, the one a durable control plane replays:
 * protobuf-c unpack of the method's request type, the method's `validate` (as
 * the CQ thread runs it), then its `run` on the state core
 * (controlplane/state) with the reply captured instead of sent. Node-session
 * messages go through kvf_svc_node_apply (Hello, reports), and the script can
 * end sessions and move the clock, so timers and notices run too. Effects are
 * taken and routed (to no session) after each step.
 *
 * Input: a script of steps until the bytes run out; each step is one byte:
 *   b < M (M = Control + Admin methods): call method b with a u16-prefixed
 *     request;
 *   b == M: a NodeMessage from node byte%4 ("n0".."n3"), incarnation
 *     1 + byte%3, u16-prefixed;
 *   b == M+1: that node's session ends (kvf_cps_node_detach);
 *   b == M+2: the clock moves u16 * 10 ms and timers fire (kvf_cps_tick);
 *   other bytes: the method (b mod M).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "service_internal.h"

#define MAX_STEPS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fixed_random(void *ctx, void *buf, size_t len)
{
    uint64_t *state = ctx;
    uint8_t *p = buf;
    for (size_t i = 0; i < len; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = (uint8_t)(*state >> 56);
    }
}

static const struct kvf_svc_method *method_at(size_t i)
{
    if (i < kvf_svc_control_method_count)
        return &kvf_svc_control_methods[i];
    return &kvf_svc_admin_methods[i - kvf_svc_control_method_count];
}

static void unary(struct kvf_svc_ctx *ctx, const struct kvf_svc_method *m, const uint8_t *p,
                  size_t len, kvf_time_ns now)
{
    static const uint8_t empty[1];
    ProtobufCMessage *req = protobuf_c_message_unpack(m->req_desc, NULL, len, len ? p : empty);
    if (!req)
        return; /* INVALID_ARGUMENT at the edge */
    struct kvf_error err;
    kvf_error_clear(&err);
    if (!m->validate || m->validate(req, &err) == 0) {
        struct kvf_svc_reply_capture cap;
        kvf_svc_capture_start(&cap);
        m->run(ctx, NULL, req, now);
        kvf_svc_capture_stop();
        if (!cap.set)
            abort(); /* every run completes its call exactly once */
        kvf_svc_capture_free(&cap);
    }
    protobuf_c_message_free_unpacked(req, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const nodes[] = {"n0", "n1", "n2", "n3"};
    uint64_t rnd = 42;
    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    opts.random_fn = fixed_random;
    opts.random_ctx = &rnd;
    struct kvf_svc_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.cps = kvf_cps_create(&opts);
    ctx.sessions = kvf_svc_sessions_create();
    ctx.node_ttl = opts.node_ttl;
    if (!ctx.cps || !ctx.sessions)
        abort();

    const size_t nm = kvf_svc_control_method_count + kvf_svc_admin_method_count;
    kvf_time_ns now = 1000000000;
    struct fz_in in = {data, size};
    for (int step = 0; step < MAX_STEPS && in.left; step++) {
        size_t b = fz_u8(&in);
        size_t len = 0;
        if (b == nm) {
            uint8_t who = fz_u8(&in);
            const uint8_t *p = fz_chunk(&in, &len);
            (void)kvf_svc_node_apply(&ctx, nodes[who % 4], 1 + who % 3, p, len, now);
        } else if (b == nm + 1) {
            uint8_t who = fz_u8(&in);
            (void)kvf_cps_node_detach(ctx.cps, nodes[who % 4], 1 + who % 3, now, NULL);
        } else if (b == nm + 2) {
            now += (kvf_time_ns)fz_u16(&in) * 10000000;
            kvf_cps_tick(ctx.cps, now);
        } else {
            const uint8_t *p = fz_chunk(&in, &len);
            unary(&ctx, method_at(b % nm), p, len, now);
        }
        size_t n = 0;
        const struct kvf_cps_effect *fx = kvf_cps_effects_take(ctx.cps, &n);
        for (size_t i = 0; i < n; i++)
            kvf_svc_route_effect(&ctx, &fx[i]);
        now += 1000000;
    }
    kvf_svc_sessions_destroy(ctx.sessions);
    kvf_cps_destroy(ctx.cps);
    return 0;
}
