/*
 * bench_rpc_echo.c: bare gRPC core unary calls, the yardstick of a room
 * lifecycle (bench/rpc/ratio.sh, bench/README.md).
 *
 * Two modes of one program:
 *   --serve: a server on the project's own glue (common/rpc/rpc_server.c:
 *     the completion queues, CQ threads and call handling kvfence-control
 *     runs on, one CQ thread per core unless --cq-threads) with one method,
 *     /kvfence.bench.Echo/Echo, that answers every request with its own
 *     bytes from the CQ thread that got it: nothing but gRPC's own cost;
 *   client (--target): T threads (8) in a closed loop of kvf_rpc_unary()
 *     calls on one channel (rpc_client.c, as bench_cp_rpc and the clients
 *     call the control plane), each with a --payload byte request (64: about
 *     a JoinRoom's), for --duration seconds; prints calls/s, the latencies
 *     and, with --server-pid, the server's CPU per call, then a "RESULT" line
 *     that ratio.sh reads.
 *
 * DESIGN: the server's CQ threads answer the calls themselves (no state
 * thread: that is what is being measured against); the main thread only
 * waits for SIGTERM/SIGINT with sigwait(), blocked before gRPC starts its
 * threads (rpc_server.h, "Signals"). The client's threads share nothing but
 * the channel and an atomic stop flag; each keeps its own latency samples,
 * merged after they are joined.
 *
 * This is a benchmark, run by hand, never by ctest.
 *
 * usage: bench_rpc_echo --serve [--listen ADDR] [--port-file F] [--cq-threads N]
 *        bench_rpc_echo --target HOST:PORT [--server-pid PID] [--threads T]
 *                       [--duration S] [--payload BYTES]
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvf_clock.h"
#include "rpc_client.h"
#include "rpc_server.h"

#define M_ECHO "/kvfence.bench.Echo/Echo"

static struct {
    bool serve;
    const char *listen;
    const char *port_file;
    unsigned cq_threads;
    const char *target;
    long server_pid;
    unsigned threads;
    double duration_s;
    size_t payload;
} cfg = {false, "127.0.0.1:0", NULL, 0, NULL, 0, 8, 5.0, 64};

static void die(const char *msg)
{
    fprintf(stderr, "bench_rpc_echo: FAILED: %s\n", msg);
    exit(1);
}

/* ---- server ----------------------------------------------------------------- */

static void echo_handler(void *ctx, struct kvf_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx;
    (void)kvf_rpc_call_reply(call, req, len);
}

static int serve(void)
{
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);

    struct kvf_rpc_server_opts o;
    kvf_rpc_server_opts_init(&o);
    o.listen_addr = cfg.listen;
    o.cq_threads = cfg.cq_threads;
    struct kvf_rpc_server *srv = kvf_rpc_server_create(&o);
    if (srv == NULL)
        die("cannot create the server");
    if (kvf_rpc_server_add_unary(srv, M_ECHO, echo_handler, NULL) != 0)
        die("cannot register the echo method");
    int port = kvf_rpc_server_start(srv);
    if (port <= 0)
        die("cannot start the server");
    if (cfg.port_file != NULL) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", cfg.port_file);
        FILE *f = fopen(tmp, "w");
        if (f == NULL || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0 ||
            rename(tmp, cfg.port_file) != 0)
            die("cannot write the port file");
    }
    fprintf(stderr, "bench_rpc_echo: serving on port %d\n", port);
    int sig = 0;
    sigwait(&sigs, &sig);
    kvf_rpc_server_shutdown(srv, 1000);
    kvf_rpc_server_destroy(srv);
    return 0;
}

/* ---- client ----------------------------------------------------------------- */

static struct kvf_rpc_channel *g_ch;
static uint64_t g_end_ns;

struct worker {
    pthread_t th;
    uint64_t calls;
    uint64_t *lat;
    size_t nlat, caplat;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    uint8_t *req = calloc(1, cfg.payload ? cfg.payload : 1);
    if (req == NULL)
        die("out of memory");
    for (size_t i = 0; i < cfg.payload; i++)
        req[i] = (uint8_t)(i * 31 + 7);
    while ((uint64_t)kvf_clock_mono_ns() < g_end_ns) {
        uint8_t *resp = NULL;
        size_t rlen = 0;
        struct kvf_rpc_status st;
        uint64_t t0 = (uint64_t)kvf_clock_mono_ns();
        int rc = kvf_rpc_unary(g_ch, M_ECHO, req, cfg.payload, 10000, &resp, &rlen, &st);
        uint64_t t1 = (uint64_t)kvf_clock_mono_ns();
        if (rc != 0 || rlen != cfg.payload || (rlen > 0 && memcmp(resp, req, rlen) != 0)) {
            fprintf(stderr, "bench_rpc_echo: FAILED: echo call: rc %d, status %d: %s\n", rc,
                    st.code, st.message);
            exit(1);
        }
        free(resp);
        if (w->nlat == w->caplat) {
            w->caplat = w->caplat ? w->caplat * 2 : 4096;
            w->lat = realloc(w->lat, w->caplat * sizeof(*w->lat));
            if (w->lat == NULL)
                die("out of memory");
        }
        w->lat[w->nlat++] = t1 - t0;
        w->calls++;
    }
    free(req);
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* utime + stime of `pid` in seconds, -1 if unreadable. */
static double proc_cpu_s(long pid)
{
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static int client(void)
{
    struct kvf_rpc_channel_opts copts;
    kvf_rpc_channel_opts_init(&copts);
    copts.wait_for_ready = true;
    g_ch = kvf_rpc_channel_create(cfg.target, &copts);
    if (g_ch == NULL)
        die("cannot create the channel");
    /* One call first: the connection is up before the clock starts. */
    uint8_t one = 1, *resp = NULL;
    size_t rlen = 0;
    struct kvf_rpc_status st;
    if (kvf_rpc_unary(g_ch, M_ECHO, &one, 1, 10000, &resp, &rlen, &st) != 0)
        die("the first echo call failed");
    free(resp);

    struct worker *w = calloc(cfg.threads, sizeof(*w));
    if (w == NULL)
        die("out of memory");
    double cpu0 = cfg.server_pid > 0 ? proc_cpu_s(cfg.server_pid) : -1;
    uint64_t t0 = (uint64_t)kvf_clock_mono_ns();
    g_end_ns = t0 + (uint64_t)(cfg.duration_s * 1e9);
    for (unsigned i = 0; i < cfg.threads; i++)
        if (pthread_create(&w[i].th, NULL, worker_main, &w[i]) != 0)
            die("pthread_create failed");
    uint64_t calls = 0;
    size_t nlat = 0;
    for (unsigned i = 0; i < cfg.threads; i++) {
        pthread_join(w[i].th, NULL);
        calls += w[i].calls;
        nlat += w[i].nlat;
    }
    double el = (double)((uint64_t)kvf_clock_mono_ns() - t0) / 1e9;
    double cpu1 = cfg.server_pid > 0 ? proc_cpu_s(cfg.server_pid) : -1;
    uint64_t *all = calloc(nlat ? nlat : 1, sizeof(*all));
    if (all == NULL)
        die("out of memory");
    size_t k = 0;
    for (unsigned i = 0; i < cfg.threads; i++) {
        memcpy(all + k, w[i].lat, w[i].nlat * sizeof(*all));
        k += w[i].nlat;
        free(w[i].lat);
    }
    qsort(all, nlat, sizeof(*all), cmp_u64);
    double p50 = nlat ? (double)all[nlat / 2] / 1e3 : 0;
    double p99 = nlat ? (double)all[(size_t)((double)nlat * 0.99)] / 1e3 : 0;
    double cpu_us = cpu0 >= 0 && cpu1 >= 0 && calls ? (cpu1 - cpu0) * 1e6 / (double)calls : 0;
    printf("bare gRPC echo (%zu-byte request and reply), %u threads, %.1f s: %" PRIu64
           " calls, %.0f calls/s, p50 %.1f us, p99 %.1f us",
           cfg.payload, cfg.threads, el, calls, (double)calls / el, p50, p99);
    if (cfg.server_pid > 0)
        printf(", server CPU %.1f us per call", cpu_us);
    printf("\nRESULT echo calls_per_s=%.1f p50_us=%.1f srv_cpu_us=%.2f\n", (double)calls / el, p50,
           cpu_us);
    free(all);
    free(w);
    kvf_rpc_channel_destroy(g_ch);
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_rpc_echo --serve [--listen ADDR] [--port-file F] "
                    "[--cq-threads N]\n"
                    "       bench_rpc_echo --target HOST:PORT [--server-pid PID] [--threads T (8)]"
                    " [--duration S (5)] [--payload BYTES (64)]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--serve") == 0) {
            cfg.serve = true;
            continue;
        }
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (strcmp(a, "--listen") == 0)
            cfg.listen = v;
        else if (strcmp(a, "--port-file") == 0)
            cfg.port_file = v;
        else if (strcmp(a, "--cq-threads") == 0)
            cfg.cq_threads = (unsigned)strtoul(v, NULL, 10);
        else if (strcmp(a, "--target") == 0)
            cfg.target = v;
        else if (strcmp(a, "--server-pid") == 0)
            cfg.server_pid = strtol(v, NULL, 10);
        else if (strcmp(a, "--threads") == 0)
            cfg.threads = (unsigned)strtoul(v, NULL, 10);
        else if (strcmp(a, "--duration") == 0)
            cfg.duration_s = strtod(v, NULL);
        else if (strcmp(a, "--payload") == 0)
            cfg.payload = strtoul(v, NULL, 10);
        else
            usage();
    }
    if (cfg.serve)
        return serve();
    if (cfg.target == NULL || cfg.threads == 0 || cfg.threads > 256 || cfg.duration_s <= 0 ||
        cfg.payload > 1024 * 1024)
        usage();
    return client();
}
