/*
 * test_rpc.c: the gRPC glue of common/rpc/ end to end: a real server on
 * 127.0.0.1 port 0 in this process and the real blocking client. Each test
 * starts and stops its own server; teardown checks that the thread count is
 * back to where it was (gRPC's own threads included).
 */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "rpc_client.h"
#include "rpc_server.h"
#include "kvf_clock.h"

#define M_ECHO       "/kvf.test.T/Echo"
#define M_ASYNC_ECHO "/kvf.test.T/AsyncEcho"
#define M_FAIL       "/kvf.test.T/Fail"
#define M_HOLD       "/kvf.test.T/Hold"
#define M_META       "/kvf.test.T/Meta"
#define M_COUNT      "/kvf.test.T/Count"
#define M_BIDI_ECHO  "/kvf.test.T/BidiEcho"
#define M_ABORT      "/kvf.test.T/Abort"

#define MAX_HELD  16
#define MAX_DELAY 4096
#define MAX_SEEN  16

/* One call the server's observer reported. */
struct seen_call {
    char method[64];
    int code;
    uint64_t latency_ns;
};

/* A reply the worker thread sends later. */
struct delayed {
    struct kvf_rpc_call *call;
    uint8_t *bytes;
    size_t len;
    int64_t due_ns;
};

struct fixture {
    struct kvf_rpc_server *srv;
    struct kvf_rpc_channel *ch;
    int port;
    char target[256];
    int threads_before;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* Hold: calls kept unanswered. */
    struct kvf_rpc_call *held[MAX_HELD];
    int n_held;
    /* AsyncEcho: the worker's queue. */
    pthread_t worker;
    bool worker_stop;
    struct delayed queue[MAX_DELAY];
    int q_head, q_len;
    int64_t async_delay_ms;
    /* Echo: what the handler saw. */
    char peer[128];
    int64_t deadline_ns;
    /* Streams. */
    struct kvf_rpc_stream *last_stream; /* a reference, dropped at teardown */
    int n_closed;
    enum kvf_rpc_close_reason last_reason;
    int n_half_closed;
    /* The observer (setup_observed). */
    struct seen_call seen[MAX_SEEN];
    int n_seen;
};

/* The throwaway CA and certificates of the TLS tests (made once). */
static char tls_dir[64];

static int64_t now_ns(void)
{
    return kvf_clock_mono_ns();
}

static int thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d)
        return -1;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

/* --- handlers ----------------------------------------------------------- */

static void echo_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct fixture *f = ctx;
    char peer[128];
    if (kvf_rpc_call_peer(call, peer, sizeof(peer)) == 0) {
        pthread_mutex_lock(&f->mu);
        snprintf(f->peer, sizeof(f->peer), "%s", peer);
        f->deadline_ns = kvf_rpc_call_deadline_ns(call);
        pthread_mutex_unlock(&f->mu);
    }
    kvf_rpc_call_reply(call, req, len);
}

static void async_echo_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct fixture *f = ctx;
    uint8_t *copy = malloc(len ? len : 1);
    memcpy(copy, req, len);
    pthread_mutex_lock(&f->mu);
    if (f->q_len == MAX_DELAY) {
        pthread_mutex_unlock(&f->mu);
        free(copy);
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "test queue full");
        return;
    }
    struct delayed *d = &f->queue[(f->q_head + f->q_len++) % MAX_DELAY];
    d->call = call;
    d->bytes = copy;
    d->len = len;
    d->due_ns = now_ns() + f->async_delay_ms * 1000000LL;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* The owner thread of async replies: answers each call when it is due. */
static void *worker_main(void *arg)
{
    struct fixture *f = arg;
    pthread_mutex_lock(&f->mu);
    for (;;) {
        while (!f->worker_stop && f->q_len == 0)
            pthread_cond_wait(&f->cv, &f->mu);
        if (f->q_len == 0)
            break;
        struct delayed d = f->queue[f->q_head];
        f->q_head = (f->q_head + 1) % MAX_DELAY;
        f->q_len--;
        pthread_mutex_unlock(&f->mu);
        int64_t wait = d.due_ns - now_ns();
        if (wait > 0) {
            struct timespec ts = {.tv_sec = wait / 1000000000LL, .tv_nsec = wait % 1000000000LL};
            nanosleep(&ts, NULL);
        }
        kvf_rpc_call_reply(d.call, d.bytes, d.len);
        free(d.bytes);
        pthread_mutex_lock(&f->mu);
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static void fail_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx;
    (void)req;
    (void)len;
    kvf_rpc_call_fail(call, kvf_errno_to_grpc_code(-EBUSY), "room 7: pages owned by room 3");
}

static void hold_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    struct fixture *f = ctx;
    (void)req;
    (void)len;
    pthread_mutex_lock(&f->mu);
    if (f->n_held == MAX_HELD) {
        pthread_mutex_unlock(&f->mu);
        kvf_rpc_call_fail(call, KVF_GRPC_RESOURCE_EXHAUSTED, "too many held");
        return;
    }
    f->held[f->n_held++] = call;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void meta_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx;
    (void)req;
    (void)len;
    char value[64];
    size_t vlen;
    if (kvf_rpc_call_metadata(call, "x-kvf-token", value, sizeof(value), &vlen) == 0)
        kvf_rpc_call_reply(call, (const uint8_t *)value, strlen(value));
    else
        kvf_rpc_call_fail(call, KVF_GRPC_UNAUTHENTICATED, "no token");
}

static void count_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    (void)ctx;
    uint32_t n = 0;
    if (len == sizeof(n))
        memcpy(&n, req, sizeof(n));
    for (uint32_t i = 0; i < n; i++)
        kvf_rpc_stream_send(stream, (const uint8_t *)&i, sizeof(i));
    kvf_rpc_stream_finish(stream, KVF_GRPC_OK, NULL);
}

static void bidi_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    struct fixture *f = ctx;
    (void)req;
    (void)len;
    kvf_rpc_stream_ref(stream);
    pthread_mutex_lock(&f->mu);
    struct kvf_rpc_stream *old = f->last_stream;
    f->last_stream = stream;
    pthread_mutex_unlock(&f->mu);
    kvf_rpc_stream_unref(old);
}

static void bidi_message(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *msg, size_t len)
{
    (void)ctx;
    kvf_rpc_stream_send(stream, msg, len);
}

static void bidi_half_close(void *ctx, struct kvf_rpc_stream *stream)
{
    struct fixture *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->n_half_closed++;
    pthread_mutex_unlock(&f->mu);
    kvf_rpc_stream_finish(stream, KVF_GRPC_OK, NULL);
}

static void stream_closed(void *ctx, struct kvf_rpc_stream *stream,
                          enum kvf_rpc_close_reason reason)
{
    struct fixture *f = ctx;
    (void)stream;
    pthread_mutex_lock(&f->mu);
    f->n_closed++;
    f->last_reason = reason;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static void abort_open(void *ctx, struct kvf_rpc_stream *stream, const uint8_t *req, size_t len)
{
    (void)ctx;
    (void)req;
    (void)len;
    kvf_rpc_stream_finish(stream, KVF_GRPC_ABORTED, "room 7 aborted");
}

/* --- observer ----------------------------------------------------------- */

static void observe_call(void *ctx, const char *method, int code, uint64_t latency_ns)
{
    struct fixture *f = ctx;
    pthread_mutex_lock(&f->mu);
    if (f->n_seen < MAX_SEEN) {
        struct seen_call *c = &f->seen[f->n_seen++];
        snprintf(c->method, sizeof(c->method), "%s", method);
        c->code = code;
        c->latency_ns = latency_ns;
    }
    pthread_mutex_unlock(&f->mu);
}

/* --- fixture ------------------------------------------------------------ */

static struct kvf_rpc_server *make_server(struct fixture *f, const struct kvf_rpc_server_opts *o)
{
    struct kvf_rpc_server *srv = kvf_rpc_server_create(o);
    assert_non_null(srv);
    static const struct kvf_rpc_stream_callbacks count_cbs = {.on_open = count_open,
                                                              .on_closed = stream_closed};
    static const struct kvf_rpc_stream_callbacks bidi_cbs = {.on_open = bidi_open,
                                                             .on_message = bidi_message,
                                                             .on_half_close = bidi_half_close,
                                                             .on_closed = stream_closed};
    static const struct kvf_rpc_stream_callbacks abort_cbs = {.on_open = abort_open,
                                                              .on_closed = stream_closed};
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_ECHO, echo_handler, f), 0);
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_ASYNC_ECHO, async_echo_handler, f), 0);
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_FAIL, fail_handler, f), 0);
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_HOLD, hold_handler, f), 0);
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_META, meta_handler, f), 0);
    assert_int_equal(
        kvf_rpc_server_add_stream(srv, M_COUNT, KVF_RPC_SERVER_STREAMING, &count_cbs, f), 0);
    assert_int_equal(kvf_rpc_server_add_stream(srv, M_BIDI_ECHO, KVF_RPC_BIDI, &bidi_cbs, f), 0);
    assert_int_equal(kvf_rpc_server_add_stream(srv, M_ABORT, KVF_RPC_BIDI, &abort_cbs, f), 0);
    assert_int_equal(kvf_rpc_server_add_unary(srv, M_ECHO, echo_handler, f), -EEXIST);
    assert_int_equal(kvf_rpc_server_add_unary(srv, "no-slash", echo_handler, f), -EINVAL);
    return srv;
}

/* Starts f->srv with `o` and a plaintext channel to it. */
static void start_with(struct fixture *f, const struct kvf_rpc_server_opts *o,
                       const struct kvf_rpc_channel_opts *co)
{
    f->srv = make_server(f, o);
    f->port = kvf_rpc_server_start(f->srv);
    assert_true(f->port > 0);
    assert_int_equal(kvf_rpc_server_add_unary(f->srv, "/kvf.test.T/Late", echo_handler, f), -EPERM);
    snprintf(f->target, sizeof(f->target), "127.0.0.1:%d", f->port);
    f->ch = kvf_rpc_channel_create(f->target, co);
    assert_non_null(f->ch);
}

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof(*f));
    if (!f)
        return -1;
    f->threads_before = thread_count();
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (pthread_create(&f->worker, NULL, worker_main, f) != 0)
        return -1;
    *state = f;
    return 0;
}

/* Plain server: 2 CQ threads, plaintext channel. */
static int setup_plain(void **state)
{
    if (setup(state) != 0)
        return -1;
    struct fixture *f = *state;
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 2;
    start_with(f, &o, NULL);
    return 0;
}

/* Plain server with the call observer. */
static int setup_observed(void **state)
{
    if (setup(state) != 0)
        return -1;
    struct fixture *f = *state;
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 2;
    o.on_call_done = observe_call;
    o.observer_ctx = f;
    start_with(f, &o, NULL);
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    kvf_rpc_channel_destroy(f->ch);
    kvf_rpc_server_destroy(f->srv);
    pthread_mutex_lock(&f->mu);
    f->worker_stop = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->worker, NULL);
    for (int i = 0; i < f->n_held; i++) /* late owners: a harmless no-op */
        kvf_rpc_call_reply(f->held[i], NULL, 0);
    kvf_rpc_stream_unref(f->last_stream);
    int left = 0;
    for (int i = 0; i < 200; i++) { /* gRPC's threads may take a moment to exit */
        left = thread_count() - f->threads_before;
        if (left <= 0)
            break;
        usleep(10000);
    }
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f);
    if (left > 0) {
        fprintf(stderr, "teardown: %d threads left running\n", left);
        return -1;
    }
    return 0;
}

static void wait_held(struct fixture *f, int n)
{
    int64_t until = now_ns() + 5000000000LL;
    pthread_mutex_lock(&f->mu);
    while (f->n_held < n && now_ns() < until) {
        pthread_mutex_unlock(&f->mu);
        usleep(2000);
        pthread_mutex_lock(&f->mu);
    }
    int got = f->n_held;
    pthread_mutex_unlock(&f->mu);
    assert_int_equal(got, n);
}

static void wait_closed(struct fixture *f, int n)
{
    int64_t until = now_ns() + 5000000000LL;
    pthread_mutex_lock(&f->mu);
    while (f->n_closed < n && now_ns() < until) {
        pthread_mutex_unlock(&f->mu);
        usleep(2000);
        pthread_mutex_lock(&f->mu);
    }
    int got = f->n_closed;
    pthread_mutex_unlock(&f->mu);
    assert_int_equal(got, n);
}

static int call_str(struct fixture *f, struct kvf_rpc_channel *ch, const char *method,
                    const char *req, int64_t timeout_ms, char *resp, size_t cap,
                    struct kvf_rpc_status *st)
{
    (void)f;
    uint8_t *out = NULL;
    size_t out_len = 0;
    int rc = kvf_rpc_unary(ch, method, (const uint8_t *)req, strlen(req), timeout_ms, &out,
                           &out_len, st);
    if (rc == 0) {
        snprintf(resp, cap, "%.*s", (int)out_len, (const char *)out);
        free(out);
    }
    return rc;
}

/* --- unary -------------------------------------------------------------- */

static void unary_echo_sync_reply(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    int64_t before = now_ns();
    assert_int_equal(call_str(f, f->ch, M_ECHO, "hello room", 5000, resp, sizeof(resp), &st), 0);
    assert_int_equal(st.code, KVF_GRPC_OK);
    assert_string_equal(resp, "hello room");
    /* The handler saw a peer and a deadline about 5 s out. */
    assert_non_null(strstr(f->peer, "127.0.0.1"));
    assert_true(f->deadline_ns > before + 4000000000LL);
    assert_true(f->deadline_ns < now_ns() + 5100000000LL);
    /* An empty message is a message. */
    assert_int_equal(call_str(f, f->ch, M_ECHO, "", 5000, resp, sizeof(resp), &st), 0);
    assert_string_equal(resp, "");
}

static void unary_async_reply_after_delay(void **state)
{
    struct fixture *f = *state;
    f->async_delay_ms = 100;
    struct kvf_rpc_status st;
    char resp[64];
    int64_t t0 = now_ns();
    assert_int_equal(call_str(f, f->ch, M_ASYNC_ECHO, "later", 5000, resp, sizeof(resp), &st), 0);
    int64_t took_ms = (now_ns() - t0) / 1000000;
    assert_string_equal(resp, "later");
    assert_true(took_ms >= 90);
    assert_true(took_ms < 3000);
}

struct load_arg {
    struct fixture *f;
    int id;
    int calls;
    int ok;
};

static void *load_main(void *arg)
{
    struct load_arg *a = arg;
    for (int i = 0; i < a->calls; i++) {
        char req[64], resp[64];
        struct kvf_rpc_status st;
        snprintf(req, sizeof(req), "client %d call %d", a->id, i);
        const char *method = i % 4 == 3 ? M_ASYNC_ECHO : M_ECHO;
        if (call_str(a->f, a->f->ch, method, req, 10000, resp, sizeof(resp), &st) == 0 &&
            strcmp(req, resp) == 0)
            a->ok++;
        else
            fprintf(stderr, "call %d/%d: code %d %s\n", a->id, i, st.code, st.message);
    }
    return NULL;
}

static void unary_many_concurrent_calls(void **state)
{
    struct fixture *f = *state;
    f->async_delay_ms = 0;
    pthread_t t[4];
    struct load_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (struct load_arg){.f = f, .id = i, .calls = 500};
        assert_int_equal(pthread_create(&t[i], NULL, load_main, &a[i]), 0);
    }
    int ok = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        ok += a[i].ok;
    }
    assert_int_equal(ok, 2000);
}

static void unary_failure_code_and_message(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    assert_int_equal(call_str(f, f->ch, M_FAIL, "x", 5000, resp, sizeof(resp), &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_FAILED_PRECONDITION);
    assert_string_equal(st.message, "room 7: pages owned by room 3");
}

static void unary_unknown_method_unimplemented(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    int64_t t0 = now_ns();
    for (int i = 0; i < 3; i++) { /* the generic request is reposted */
        assert_int_equal(call_str(f, f->ch, "/kvf.test.T/Nope", "x", 5000, resp, sizeof(resp), &st),
                         -EREMOTEIO);
        assert_int_equal(st.code, KVF_GRPC_UNIMPLEMENTED);
    }
    assert_true((now_ns() - t0) / 1000000 < 1000);
}

/* Waits until the observer has seen `n` calls (it runs when gRPC lets a call
 * go, which may be just after the client has its answer). */
static void wait_seen(struct fixture *f, int n)
{
    int64_t until = now_ns() + 5000000000LL;
    pthread_mutex_lock(&f->mu);
    while (f->n_seen < n && now_ns() < until) {
        pthread_mutex_unlock(&f->mu);
        usleep(2000);
        pthread_mutex_lock(&f->mu);
    }
    int got = f->n_seen;
    pthread_mutex_unlock(&f->mu);
    assert_int_equal(got, n);
}

static void unary_observer_sees_method_code_latency(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    assert_int_equal(call_str(f, f->ch, M_ECHO, "hi", 5000, resp, sizeof(resp), &st), 0);
    wait_seen(f, 1);
    assert_int_equal(call_str(f, f->ch, M_FAIL, "x", 5000, resp, sizeof(resp), &st), -EREMOTEIO);
    wait_seen(f, 2);
    assert_int_equal(call_str(f, f->ch, "/kvf.test.T/Nope", "x", 5000, resp, sizeof(resp), &st),
                     -EREMOTEIO);
    wait_seen(f, 3);
    f->async_delay_ms = 50;
    assert_int_equal(call_str(f, f->ch, M_ASYNC_ECHO, "later", 5000, resp, sizeof(resp), &st), 0);
    wait_seen(f, 4);

    assert_string_equal(f->seen[0].method, M_ECHO);
    assert_int_equal(f->seen[0].code, KVF_GRPC_OK);
    assert_string_equal(f->seen[1].method, M_FAIL);
    assert_int_equal(f->seen[1].code, KVF_GRPC_FAILED_PRECONDITION);
    assert_string_equal(f->seen[2].method, "unknown");
    assert_int_equal(f->seen[2].code, KVF_GRPC_UNIMPLEMENTED);
    assert_string_equal(f->seen[3].method, M_ASYNC_ECHO);
    assert_int_equal(f->seen[3].code, KVF_GRPC_OK);
    for (int i = 0; i < 4; i++) {
        assert_true(f->seen[i].latency_ns > 0);
        assert_true(f->seen[i].latency_ns < 5000000000ULL);
    }
    /* The latency runs from arrival to the end: the 50 ms the owner waited. */
    assert_true(f->seen[3].latency_ns >= 45000000ULL);

    /* A stream reports once, with its final code. */
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_BIDI_ECHO, 5000);
    assert_non_null(cs);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    uint8_t *msg;
    size_t len;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_OK);
    kvf_rpc_client_stream_close(cs);
    wait_seen(f, 5);
    assert_string_equal(f->seen[4].method, M_BIDI_ECHO);
    assert_int_equal(f->seen[4].code, KVF_GRPC_OK);
    usleep(20000);
    assert_int_equal(f->n_seen, 5); /* once per call */
}

static void unary_deadline_exceeded_late_reply(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    int64_t t0 = now_ns();
    assert_int_equal(call_str(f, f->ch, M_HOLD, "x", 200, resp, sizeof(resp), &st), -EREMOTEIO);
    int64_t took_ms = (now_ns() - t0) / 1000000;
    assert_int_equal(st.code, KVF_GRPC_DEADLINE_EXCEEDED);
    assert_true(took_ms >= 150 && took_ms < 2000);
    wait_held(f, 1);
    /* The server lets its side go on its own... */
    for (int i = 0; i < 500 && kvf_rpc_server_calls_in_flight(f->srv) > 0; i++)
        usleep(2000);
    assert_int_equal(kvf_rpc_server_calls_in_flight(f->srv), 0);
    /* ...and the owner's late reply is a harmless no-op that frees the call. */
    assert_int_equal(kvf_rpc_call_reply(f->held[0], (const uint8_t *)"late", 4), -ECANCELED);
    f->n_held = 0;
    /* The server still serves. */
    assert_int_equal(call_str(f, f->ch, M_ECHO, "after", 5000, resp, sizeof(resp), &st), 0);
}

static void unary_large_message_round_trip(void **state)
{
    struct fixture *f = *state;
    size_t len = 8u << 20;
    uint8_t *req = malloc(len);
    assert_non_null(req);
    for (size_t i = 0; i < len; i++)
        req[i] = (uint8_t)(i * 2654435761u >> 13);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, req, len, 20000, &resp, &resp_len, &st), 0);
    assert_int_equal(resp_len, len);
    assert_memory_equal(resp, req, len);
    free(resp);
    /* Through the async path too (the handler copies it). */
    assert_int_equal(kvf_rpc_unary(f->ch, M_ASYNC_ECHO, req, len, 20000, &resp, &resp_len, &st), 0);
    assert_int_equal(resp_len, len);
    assert_memory_equal(resp, req, len);
    free(resp);
    free(req);
}

/* max_receive_bytes: a request one byte over it is refused by gRPC itself
 * (RESOURCE_EXHAUSTED) and never reaches a handler; one at it does; replies
 * may still be as big as max_message_bytes. */
static int setup_small_receive(void **state)
{
    if (setup(state) != 0)
        return -1;
    struct fixture *f = *state;
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 2;
    o.max_receive_bytes = 1024;
    o.on_call_done = observe_call;
    o.observer_ctx = f;
    start_with(f, &o, NULL);
    return 0;
}

static void unary_over_receive_limit_refused_before_handler(void **state)
{
    struct fixture *f = *state;
    uint8_t req[1025];
    memset(req, 'r', sizeof(req));
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, req, sizeof(req), 5000, &resp, &resp_len, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_RESOURCE_EXHAUSTED);
    print_message("refused: %s\n", st.message);
    assert_null(resp);
    pthread_mutex_lock(&f->mu);
    assert_string_equal(f->peer, ""); /* echo_handler never ran */
    pthread_mutex_unlock(&f->mu);
    assert_int_equal(kvf_rpc_unary(f->ch, M_ECHO, req, 1024, 5000, &resp, &resp_len, &st), 0);
    assert_int_equal(resp_len, 1024);
    free(resp);
}

static void unary_metadata_reaches_handler(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_status st;
    char resp[64];
    struct kvf_rpc_metadata md[] = {{"x-kvf-token", "tok-123"}};
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.metadata = md;
    co.n_metadata = 1;
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(f->target, &co);
    assert_non_null(ch);
    assert_int_equal(call_str(f, ch, M_META, "x", 5000, resp, sizeof(resp), &st), 0);
    assert_string_equal(resp, "tok-123");
    kvf_rpc_channel_destroy(ch);
    assert_int_equal(call_str(f, f->ch, M_META, "x", 5000, resp, sizeof(resp), &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNAUTHENTICATED);
    /* Keys that would poison calls are refused up front (pitfall 2). */
    struct kvf_rpc_metadata bad[][1] = {
        {{"X-Kvf-Token", "v"}}, {{"grpc-timeout", "1S"}}, {{"x-kvf", "line\nbreak"}}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        co.metadata = bad[i];
        assert_null(kvf_rpc_channel_create(f->target, &co));
    }
}

/* --- streams ------------------------------------------------------------ */

static void server_streaming_in_order(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_COUNT, 10000);
    assert_non_null(cs);
    uint32_t n = 1000;
    assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&n, sizeof(n)), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    struct kvf_rpc_status st;
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *msg;
        size_t len;
        assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), 0);
        assert_int_equal(len, sizeof(uint32_t));
        uint32_t v;
        memcpy(&v, msg, sizeof(v));
        free(msg);
        assert_int_equal(v, i);
    }
    uint8_t *msg;
    size_t len;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_OK);
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    kvf_rpc_client_stream_close(cs);
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_FINISHED);
}

static void expect_echo(struct kvf_rpc_client_stream *cs, uint32_t want)
{
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), 0);
    assert_int_equal(len, sizeof(uint32_t));
    uint32_t v;
    memcpy(&v, msg, sizeof(v));
    free(msg);
    assert_int_equal(v, want);
}

static void bidi_echo_in_order(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_BIDI_ECHO, 10000);
    assert_non_null(cs);
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    /* Nothing to read yet: a short recv times out and leaves the stream as is. */
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 20, &msg, &len, &st), -ETIMEDOUT);
    for (uint32_t i = 0; i < 100; i++) { /* lock step */
        assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&i, sizeof(i)), 0);
        expect_echo(cs, i);
    }
    for (uint32_t i = 100; i < 300; i++) /* pipelined */
        assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&i, sizeof(i)), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), -EALREADY);
    assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)"x", 1), -EPIPE);
    for (uint32_t i = 100; i < 300; i++)
        expect_echo(cs, i);
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_OK);
    kvf_rpc_client_stream_close(cs);
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_FINISHED);
    assert_int_equal(f->n_half_closed, 1);
    /* The owner's reference outlives the stream: sends are refused. */
    assert_int_equal(kvf_rpc_stream_send(f->last_stream, (const uint8_t *)"x", 1), -ECANCELED);
    assert_int_equal(kvf_rpc_stream_finish(f->last_stream, KVF_GRPC_OK, NULL), -ECANCELED);
}

static void bidi_client_cancel_seen_by_server(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_BIDI_ECHO, 10000);
    assert_non_null(cs);
    uint32_t v = 7;
    assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&v, sizeof(v)), 0);
    expect_echo(cs, 7);
    kvf_rpc_client_stream_cancel(cs);
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_CANCELLED);
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_CANCELLED);
    assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&v, sizeof(v)), -ECANCELED);
    kvf_rpc_client_stream_close(cs);
    assert_int_equal(kvf_rpc_stream_send(f->last_stream, (const uint8_t *)"x", 1), -ECANCELED);
}

static void bidi_server_finish_code_reaches_client(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_ABORT, 10000);
    assert_non_null(cs);
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_ABORTED);
    assert_string_equal(st.message, "room 7 aborted");
    kvf_rpc_client_stream_close(cs);
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_FINISHED);
}

static void stream_deadline_reported(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_BIDI_ECHO, 200);
    assert_non_null(cs);
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_DEADLINE_EXCEEDED);
    kvf_rpc_client_stream_close(cs);
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_DEADLINE);
}

/* --- shutdown and binding ----------------------------------------------- */

struct held_arg {
    struct fixture *f;
    int rc;
    struct kvf_rpc_status st;
};

static void *held_call_main(void *arg)
{
    struct held_arg *a = arg;
    char resp[16];
    a->rc = call_str(a->f, a->f->ch, M_HOLD, "x", 10000, resp, sizeof(resp), &a->st);
    return NULL;
}

static void shutdown_with_calls_in_flight(void **state)
{
    struct fixture *f = *state;
    pthread_t t[4];
    struct held_arg a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (struct held_arg){.f = f};
        assert_int_equal(pthread_create(&t[i], NULL, held_call_main, &a[i]), 0);
    }
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(f->ch, M_BIDI_ECHO, 10000);
    assert_non_null(cs);
    uint32_t v = 1;
    assert_int_equal(kvf_rpc_client_stream_send(cs, (const uint8_t *)&v, sizeof(v)), 0);
    expect_echo(cs, 1);
    wait_held(f, 4);

    int64_t t0 = now_ns();
    kvf_rpc_server_shutdown(f->srv, 200);
    int64_t took_ms = (now_ns() - t0) / 1000000;
    assert_true(took_ms >= 150);
    assert_true(took_ms < 2200);
    kvf_rpc_server_shutdown(f->srv, 200); /* idempotent */
    wait_closed(f, 1);
    assert_int_equal(f->last_reason, KVF_RPC_CLOSED_SHUTDOWN);

    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(a[i].rc, -EREMOTEIO);
        assert_true(a[i].st.code == KVF_GRPC_UNAVAILABLE || a[i].st.code == KVF_GRPC_CANCELLED);
    }
    assert_true((now_ns() - t0) / 1000000 < 3000);
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    assert_int_equal(kvf_rpc_client_stream_recv(cs, 5000, &msg, &len, &st), KVF_RPC_STREAM_END);
    assert_true(st.code == KVF_GRPC_UNAVAILABLE || st.code == KVF_GRPC_CANCELLED);
    kvf_rpc_client_stream_close(cs);
    /* The owners answer after the fact: each reply is dropped and frees its call. */
    for (int i = 0; i < f->n_held; i++)
        assert_int_equal(kvf_rpc_call_reply(f->held[i], (const uint8_t *)"late", 4), -ECANCELED);
    f->n_held = 0;
}

static void second_server_same_port_fails(void **state)
{
    struct fixture *f = *state;
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 1;
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", f->port);
    o.listen_addr = addr;
    struct kvf_rpc_server *other = kvf_rpc_server_create(&o);
    assert_non_null(other);
    assert_int_equal(kvf_rpc_server_add_unary(other, M_ECHO, echo_handler, f), 0);
    assert_true(kvf_rpc_server_start(other) < 0);
    kvf_rpc_server_destroy(other);
    /* The first one is untouched. */
    struct kvf_rpc_status st;
    char resp[16];
    assert_int_equal(call_str(f, f->ch, M_ECHO, "still", 5000, resp, sizeof(resp), &st), 0);
}

static void unix_socket_server(void **state)
{
    struct fixture *f = *state;
    char dir[] = "/tmp/kvf-rpc-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char addr[128];
    snprintf(addr, sizeof(addr), "unix:%s/s.sock", dir);
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 1;
    o.listen_addr = addr;
    f->srv = make_server(f, &o);
    assert_int_equal(kvf_rpc_server_start(f->srv), 0);
    f->ch = kvf_rpc_channel_create(addr, NULL);
    assert_non_null(f->ch);
    struct kvf_rpc_status st;
    char resp[16];
    assert_int_equal(call_str(f, f->ch, M_ECHO, "unix", 5000, resp, sizeof(resp), &st), 0);
    assert_string_equal(resp, "unix");
    char path[128];
    snprintf(path, sizeof(path), "%s/s.sock", dir);
    kvf_rpc_channel_destroy(f->ch);
    f->ch = NULL;
    kvf_rpc_server_destroy(f->srv);
    f->srv = NULL;
    unlink(path);
    rmdir(dir);
}

static void client_fail_fast_or_wait_for_ready(void **state)
{
    struct fixture *f = *state;
    /* A port nobody listens on any more. */
    char target[sizeof(f->target)];
    snprintf(target, sizeof(target), "%s", f->target);
    kvf_rpc_channel_destroy(f->ch);
    f->ch = NULL;
    kvf_rpc_server_destroy(f->srv);
    f->srv = NULL;
    struct kvf_rpc_status st;
    char resp[16];
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, NULL);
    assert_non_null(ch);
    int64_t t0 = now_ns();
    assert_int_equal(call_str(f, ch, M_ECHO, "x", 3000, resp, sizeof(resp), &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    assert_true((now_ns() - t0) / 1000000 < 2000);
    kvf_rpc_channel_destroy(ch);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    ch = kvf_rpc_channel_create(target, &co);
    assert_non_null(ch);
    t0 = now_ns();
    assert_int_equal(call_str(f, ch, M_ECHO, "x", 300, resp, sizeof(resp), &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_DEADLINE_EXCEEDED);
    assert_true((now_ns() - t0) / 1000000 >= 250);
    kvf_rpc_channel_destroy(ch);
}

/* --- TLS ---------------------------------------------------------------- */

static int make_certs(void **state)
{
    (void)state;
    snprintf(tls_dir, sizeof(tls_dir), "/tmp/kvf-tls-XXXXXX");
    if (!mkdtemp(tls_dir))
        return -1;
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "set -e; cd %s; "
             "K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'; "
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=kvf-test-ca; "
             "openssl req $K -keyout other-ca.key -out other-ca.pem -x509 -days 2 "
             "  -subj /CN=kvf-other-ca; "
             "openssl req $K -keyout server.key -out server.csr -subj /CN=localhost; "
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext; "
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out server.pem -days 2 -extfile server.ext; "
             "openssl req $K -keyout client.key -out client.csr -subj /CN=kvf-node-1; "
             "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out client.pem -days 2",
             tls_dir);
    char quiet[4200];
    snprintf(quiet, sizeof(quiet), "(%s) >/dev/null 2>&1", cmd);
    return system(quiet) == 0 ? 0 : -1;
}

static int remove_certs(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tls_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static void tls_path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tls_dir, name);
}

static void start_tls(struct fixture *f, bool mutual)
{
    char cert[128], key[128], ca[128];
    tls_path(cert, sizeof(cert), "server.pem");
    tls_path(key, sizeof(key), "server.key");
    tls_path(ca, sizeof(ca), "ca.pem");
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.cq_threads = 1;
    o.tls_cert_path = cert;
    o.tls_key_path = key;
    o.tls_client_ca_path = mutual ? ca : NULL;
    f->srv = make_server(f, &o);
    f->port = kvf_rpc_server_start(f->srv);
    assert_true(f->port > 0);
    snprintf(f->target, sizeof(f->target), "127.0.0.1:%d", f->port);
}

static int tls_try(struct fixture *f, const char *root, const char *cert, const char *key,
                   struct kvf_rpc_status *st)
{
    char root_p[128], cert_p[128], key_p[128];
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    if (root) {
        tls_path(root_p, sizeof(root_p), root);
        co.tls_root_ca_path = root_p;
    }
    if (cert) {
        tls_path(cert_p, sizeof(cert_p), cert);
        tls_path(key_p, sizeof(key_p), key);
        co.tls_cert_path = cert_p;
        co.tls_key_path = key_p;
    }
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(f->target, &co);
    assert_non_null(ch);
    char resp[16];
    int rc = call_str(f, ch, M_ECHO, "secret", 3000, resp, sizeof(resp), st);
    if (rc == 0)
        assert_string_equal(resp, "secret");
    kvf_rpc_channel_destroy(ch);
    return rc;
}

static void tls_server_authenticated(void **state)
{
    struct fixture *f = *state;
    start_tls(f, false);
    struct kvf_rpc_status st;
    /* Verified against the CA, by the IP in the certificate's SAN. */
    assert_int_equal(tls_try(f, "ca.pem", NULL, NULL, &st), 0);
    /* Plaintext against TLS fails. */
    assert_int_equal(tls_try(f, NULL, NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    /* A server certificate from a CA we do not trust fails. */
    assert_int_equal(tls_try(f, "other-ca.pem", NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    /* The target name override: "localhost" is in the SAN too. */
    char ca[128];
    tls_path(ca, sizeof(ca), "ca.pem");
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.tls_root_ca_path = ca;
    co.tls_target_name = "localhost";
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(f->target, &co);
    assert_non_null(ch);
    char resp[16];
    assert_int_equal(call_str(f, ch, M_ECHO, "named", 3000, resp, sizeof(resp), &st), 0);
    kvf_rpc_channel_destroy(ch);
}

static void tls_mutual_needs_client_cert(void **state)
{
    struct fixture *f = *state;
    start_tls(f, true);
    struct kvf_rpc_status st;
    assert_int_equal(tls_try(f, "ca.pem", NULL, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    assert_int_equal(tls_try(f, "ca.pem", "client.pem", "client.key", &st), 0);
    assert_int_equal(st.code, KVF_GRPC_OK);
}

static void bad_options_refused(void **state)
{
    (void)state;
    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.tls_cert_path = "/nonexistent/cert.pem";
    assert_null(kvf_rpc_server_create(&o)); /* key missing */
    o.tls_key_path = "/nonexistent/key.pem";
    assert_null(kvf_rpc_server_create(&o)); /* unreadable */
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.tls_root_ca_path = "/nonexistent/ca.pem";
    assert_null(kvf_rpc_channel_create("127.0.0.1:1", &co));
    kvf_rpc_server_destroy(NULL);
    kvf_rpc_channel_destroy(NULL);
    kvf_rpc_client_stream_close(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(unary_echo_sync_reply, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_async_reply_after_delay, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_many_concurrent_calls, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_failure_code_and_message, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_unknown_method_unimplemented, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_deadline_exceeded_late_reply, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_observer_sees_method_code_latency, setup_observed,
                                        teardown),
        cmocka_unit_test_setup_teardown(unary_large_message_round_trip, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unary_over_receive_limit_refused_before_handler,
                                        setup_small_receive, teardown),
        cmocka_unit_test_setup_teardown(unary_metadata_reaches_handler, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(server_streaming_in_order, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(bidi_echo_in_order, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(bidi_client_cancel_seen_by_server, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(bidi_server_finish_code_reaches_client, setup_plain,
                                        teardown),
        cmocka_unit_test_setup_teardown(stream_deadline_reported, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(shutdown_with_calls_in_flight, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(second_server_same_port_fails, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(client_fail_fast_or_wait_for_ready, setup_plain, teardown),
        cmocka_unit_test_setup_teardown(unix_socket_server, setup, teardown),
        cmocka_unit_test_setup_teardown(tls_server_authenticated, setup, teardown),
        cmocka_unit_test_setup_teardown(tls_mutual_needs_client_cert, setup, teardown),
        cmocka_unit_test_setup_teardown(bad_options_refused, setup, teardown),
    };
    return cmocka_run_group_tests(tests, make_certs, remove_certs);
}
