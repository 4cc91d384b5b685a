/*
 * test_svc_shutdown.c: kvfence-control's shutdown order, in one process: a
 * real service (kvf_svc, memory only) on a real kvf_rpc server bound to
 * 127.0.0.1, and a kvf_rpc client.
 *
 * When the service stops, the jobs still queued for its state thread are
 * dropped instead of run. A dropped job must not free what an earlier job
 * already handed to a registry. Under load this happened to WatchLeases: the
 * stream's open job had listed the watch, its closing job was still queued
 * when kvf_svc_stop() took the queue, the drop freed the watch, and
 * kvf_svc_destroy() then walked the freed entry (heap-use-after-free under
 * ASan, a crash or an abort on a double free otherwise).
 *
 * The test makes that interleaving certain instead of likely: a gate job
 * holds the state thread while the stream ends (its closing job queues
 * behind the gate) and is released only once kvf_svc_stop() has taken the
 * queue, which a probe job posted from another thread observes: post drops a
 * job at once, on the posting thread, once the service is stopping.
 */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"
#include "rpc_server.h"
#include "service.h"
#include "service_internal.h"
#include "kvf_clock.h"

#define WAIT_MS 10000

static int64_t now_ms(void)
{
    return kvf_clock_mono_ms();
}

/* ---- the gate: a job that holds the state thread until released --------- */

struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool running;
    bool released;
};

static struct gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false};

static void gate_run(struct kvf_svc_ctx *ctx, void *arg, kvf_time_ns now)
{
    (void)ctx;
    (void)arg;
    (void)now;
    pthread_mutex_lock(&gate.mu);
    gate.running = true;
    pthread_cond_broadcast(&gate.cv);
    while (!gate.released)
        pthread_cond_wait(&gate.cv, &gate.mu);
    pthread_mutex_unlock(&gate.mu);
}

static void gate_drop(void *arg)
{
    (void)arg;
}

static void gate_release(void)
{
    pthread_mutex_lock(&gate.mu);
    gate.released = true;
    pthread_cond_broadcast(&gate.cv);
    pthread_mutex_unlock(&gate.mu);
}

/* ---- the probe: tells when kvf_svc_stop() has taken the queue ------------ */

static _Thread_local bool in_probe_post;
static _Thread_local bool probe_dropped_at_once;

static void probe_run(struct kvf_svc_ctx *ctx, void *arg, kvf_time_ns now)
{
    (void)ctx;
    (void)arg;
    (void)now;
}

static void probe_drop(void *arg)
{
    (void)arg;
    if (in_probe_post)
        probe_dropped_at_once = true;
}

struct releaser {
    struct kvf_svc *svc;
    bool saw_stopping;
};

/* Posts probes until one is dropped at once (the service is stopping and has
 * taken its queue), then opens the gate. Opens it anyway after WAIT_MS so
 * that a failing test ends. */
static void *releaser_main(void *arg)
{
    struct releaser *r = arg;
    int64_t end = now_ms() + WAIT_MS;
    while (now_ms() < end) {
        in_probe_post = true;
        kvf_svc_post(r->svc, probe_run, probe_drop, NULL);
        in_probe_post = false;
        if (probe_dropped_at_once) {
            r->saw_stopping = true;
            break;
        }
        usleep(1000);
    }
    gate_release();
    return NULL;
}

/* ---- the test ---------------------------------------------------------- */

static void test_watch_close_dropped_at_stop(void **state)
{
    (void)state;
    struct kvf_svc *svc = kvf_svc_create(NULL);
    assert_non_null(svc);
    struct kvf_rpc_server_opts opts;
    kvf_rpc_server_opts_init(&opts);
    opts.listen_addr = "127.0.0.1:0";
    opts.cq_threads = 2;
    struct kvf_rpc_server *srv = kvf_rpc_server_create(&opts);
    assert_non_null(srv);
    assert_int_equal(kvf_svc_register(svc, srv), 0);
    int port = kvf_rpc_server_start(srv);
    assert_true(port > 0);

    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    struct kvf_rpc_channel *ch = kvf_rpc_channel_create(target, &co);
    assert_non_null(ch);

    /* A watch, read up to `synced`: its open job has run, it is listed. */
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(ch, "/kvfence.v1.Control/WatchLeases", KVF_RPC_NO_TIMEOUT);
    assert_non_null(cs);
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.node_id = (char *)"n1";
    uint8_t buf[64];
    size_t len = kvfence__v1__watch_leases_request__pack(&rq, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    bool synced = false;
    while (!synced) {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st;
        assert_int_equal(kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &mlen, &st), 0);
        Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
        free(msg);
        assert_non_null(ev);
        synced = ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED;
        kvfence__v1__lease_event__free_unpacked(ev, NULL);
    }

    /* Hold the state thread. */
    kvf_svc_post(svc, gate_run, gate_drop, NULL);
    pthread_mutex_lock(&gate.mu);
    while (!gate.running)
        pthread_cond_wait(&gate.cv, &gate.mu);
    pthread_mutex_unlock(&gate.mu);

    /* End the stream: on_closed posts the closing job (behind the gate) before
     * the server lets the call go. */
    kvf_rpc_client_stream_close(cs);
    int64_t end = now_ms() + WAIT_MS;
    while (kvf_rpc_server_calls_in_flight(srv) > 0 && now_ms() < end)
        usleep(1000);
    assert_int_equal(kvf_rpc_server_calls_in_flight(srv), 0);
    kvf_rpc_channel_destroy(ch);

    /* main.c's order. kvf_svc_stop() takes the queue (the closing job with
     * it) while the gate still holds the state thread, and drops it. */
    kvf_svc_not_serving(svc);
    kvf_rpc_server_shutdown(srv, 0);
    struct releaser r = {svc, false};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, releaser_main, &r), 0);
    kvf_svc_stop(svc);
    pthread_join(t, NULL);
    assert_true(r.saw_stopping);
    kvf_svc_destroy(svc); /* walked a freed watch before the fix */
    kvf_rpc_server_destroy(srv);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_watch_close_dropped_at_stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
