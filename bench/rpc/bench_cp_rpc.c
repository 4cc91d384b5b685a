/*
 * bench_cp_rpc.c: closed-loop load on a running kvfence-control, over gRPC.
 *
 * Setup: 4 fake nodes (bench-n0..bench-n3), each one NodeSession/Attach
 * stream with a reader thread that answers every AbortNotice at once with
 * Drained (same room, same token); and one WatchLeases stream (no filter)
 * whose reader timestamps every released lease and wakes the worker waiting
 * for it. Then, from T worker threads:
 *   1. lifecycles for D seconds: JoinRoom source + JoinRoom sink (-> ACTIVE),
 *      both nodes report Completed, wait until both leases are RELEASED;
 *   2. bare calls: Admin.Ping, as many calls as phase 1 made unary RPCs
 *      (2 joins per lifecycle), to compare lifecycle cost with bare-call cost;
 *   3. aborts: R rooms of 16 participants (8 sources + 8 sinks, 4 per node),
 *      all joined, nothing in flight; AbortRoom at t0, t1 = the last of the
 *      16 leases RELEASED (as timestamped by the watch reader);
 *   4. (--open-rooms N) N ACTIVE rooms left open: server RSS before/after.
 * With --server-pid, the server's CPU time and RSS (/proc) after each phase.
 * Any failed RPC or ended stream prints the status and exits 1.
 *
 * This is a benchmark, run by hand (bench/rpc/run.sh, bench/README.md).
 *
 * usage: bench_cp_rpc --target HOST:PORT [--server-pid PID] [--threads T]
 *        [--duration S] [--abort-rooms R] [--open-rooms N] [--timeout-ms MS]
 *        [--no-pings]
 * After phase 1 a "RESULT lifecycle ..." line (rooms/s, p50, server CPU and
 * room updates per lifecycle) for bench/rpc/ratio.sh, which compares it with
 * bench_rpc_echo's bare calls run alternately.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "kvfence/v1/types.pb-c.h"
#include "rpc_client.h"
#include "kvf_clock.h"

#define N_NODES          4
#define PAGES_PER_LEASE  16u
#define POOL_ID          1u
#define ABORT_PER_NODE   4u /* participants per node in an abort room */
#define ABORT_PARTS      (N_NODES * ABORT_PER_NODE)
#define LEASE_TABLE_BITS 18u

#define M_JOIN     "/kvfence.v1.Control/JoinRoom"
#define M_ABORT    "/kvfence.v1.Control/AbortRoom"
#define M_WATCH    "/kvfence.v1.Control/WatchLeases"
#define M_ATTACH   "/kvfence.v1.NodeSession/Attach"
#define M_PING     "/kvfence.v1.Admin/Ping"
#define M_GETSTATS "/kvfence.v1.Admin/GetStats"

/* ---- settings and small helpers ----------------------------------------------- */

static struct {
    const char *target;
    long server_pid;
    unsigned threads;
    double duration_s;
    unsigned abort_rooms;
    unsigned open_rooms;
    int64_t timeout_ms;
    bool no_pings; /* --no-pings: phase 2 skipped (bench/rpc/ratio.sh runs bench_rpc_echo) */
} cfg = {NULL, 0, 8, 5.0, 2000, 0, 10000, false};

static struct kvf_rpc_channel *g_ch;
static atomic_bool g_stop;
static atomic_uint_fast64_t g_next_room = 1;

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "bench_cp_rpc: FAILED: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stdout);
    fflush(stderr);
    _exit(1);
}

static void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (p == NULL)
        die("out of memory");
    return p;
}

/* ---- latency samples ------------------------------------------------------------ */

struct lat {
    uint64_t *v;
    size_t n, cap;
};

static void lat_add(struct lat *l, uint64_t ns)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 4096;
        l->v = realloc(l->v, l->cap * sizeof(*l->v));
        if (l->v == NULL)
            die("out of memory");
    }
    l->v[l->n++] = ns;
}

static void lat_merge(struct lat *into, const struct lat *from)
{
    for (size_t i = 0; i < from->n; i++)
        lat_add(into, from->v[i]);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void lat_sort(struct lat *l)
{
    qsort(l->v, l->n, sizeof(*l->v), cmp_u64);
}

/* Nearest-rank percentile of a sorted set, in microseconds. */
static double lat_pct_us(const struct lat *l, double p)
{
    if (l->n == 0)
        return 0;
    size_t k = (size_t)(p / 100.0 * (double)l->n + 0.999999);
    if (k < 1)
        k = 1;
    if (k > l->n)
        k = l->n;
    return (double)l->v[k - 1] / 1e3;
}

static double lat_mean_us(const struct lat *l)
{
    double s = 0;
    for (size_t i = 0; i < l->n; i++)
        s += (double)l->v[i];
    return l->n ? s / (double)l->n / 1e3 : 0;
}

static void lat_print(const char *what, struct lat *l)
{
    lat_sort(l);
    printf("  %-28s n=%-8zu p50 %8.1f us   p99 %8.1f us   max %8.1f us   mean %8.1f us\n", what,
           l->n, lat_pct_us(l, 50), lat_pct_us(l, 99), lat_pct_us(l, 100), lat_mean_us(l));
}

/* ---- server and own resource use --------------------------------------------------- */

struct usage {
    double srv_cpu_s; /* utime + stime of the server */
    long srv_rss_kib;
    long srv_hwm_kib;
    double self_cpu_s;
};

static void usage_read(struct usage *u)
{
    memset(u, 0, sizeof(*u));
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        u->self_cpu_s = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
                        (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    if (cfg.server_pid <= 0)
        return;
    char path[64], buf[4096];
    snprintf(path, sizeof(path), "/proc/%ld/stat", cfg.server_pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        die("cannot read %s: %s (is the server gone?)", path, strerror(errno));
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    /* After "pid (comm)": field 3 is the state; utime and stime are 14, 15. */
    if (p == NULL ||
        sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        die("cannot parse %s", path);
    u->srv_cpu_s = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
    snprintf(path, sizeof(path), "/proc/%ld/status", cfg.server_pid);
    f = fopen(path, "r");
    if (f == NULL)
        die("cannot read %s: %s", path, strerror(errno));
    while (fgets(buf, sizeof(buf), f) != NULL) {
        if (strncmp(buf, "VmRSS:", 6) == 0)
            u->srv_rss_kib = strtol(buf + 6, NULL, 10);
        else if (strncmp(buf, "VmHWM:", 6) == 0)
            u->srv_hwm_kib = strtol(buf + 6, NULL, 10);
    }
    fclose(f);
}

/* Prints the resources used since `*prev`, then makes `*prev` the present. */
static void usage_print(const char *phase, struct usage *prev, double units, const char *unit)
{
    struct usage u;
    usage_read(&u);
    double cpu = u.srv_cpu_s - prev->srv_cpu_s;
    if (cfg.server_pid > 0) {
        printf("  server: CPU %.2f s this phase (%.2f s total)", cpu, u.srv_cpu_s);
        if (units > 0)
            printf(", %.1f us CPU per %s", cpu * 1e6 / units, unit);
        printf("; RSS %.1f MiB (peak %.1f MiB) at the end of %s\n", (double)u.srv_rss_kib / 1024.0,
               (double)u.srv_hwm_kib / 1024.0, phase);
    }
    printf("  bench client: CPU %.2f s this phase\n", u.self_cpu_s - prev->self_cpu_s);
    *prev = u;
}

/* ---- unary calls ---------------------------------------------------------------- */

/* Packs `req`, calls `method`, dies on any failure, and returns the unpacked
 * reply (free with protobuf_c_message_free_unpacked). `*lat_ns` (may be NULL)
 * receives the call's latency. */
static ProtobufCMessage *call(const char *method, const ProtobufCMessage *req,
                              const ProtobufCMessageDescriptor *rdesc, uint64_t *lat_ns)
{
    uint8_t stackbuf[512];
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = len <= sizeof(stackbuf) ? stackbuf : xcalloc(1, len);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    struct kvf_rpc_status st;
    uint64_t t0 = now_ns();
    int rc = kvf_rpc_unary(g_ch, method, buf, len, cfg.timeout_ms, &resp, &rlen, &st);
    uint64_t t1 = now_ns();
    if (buf != stackbuf)
        free(buf);
    if (rc != 0)
        die("%s: rc %d, status %s (%d): %s", method, rc, kvf_grpc_code_name(st.code), st.code,
            st.message);
    static const uint8_t empty[1];
    ProtobufCMessage *m = protobuf_c_message_unpack(rdesc, NULL, rlen, rlen ? resp : empty);
    free(resp);
    if (m == NULL)
        die("%s: the reply does not decode as %s", method, rdesc->name);
    if (lat_ns != NULL)
        *lat_ns = t1 - t0;
    return m;
}

/* ---- fake nodes ------------------------------------------------------------------- */

struct node {
    char id[32];
    uint64_t incarnation;
    struct kvf_rpc_client_stream *cs;
    pthread_mutex_t send_mu; /* one sender at a time on the stream */
    pthread_t reader;
    atomic_uint_fast64_t room_updates, room_update_acks, abort_notices, fence_peers, other_msgs;
};

static struct node g_nodes[N_NODES];
static uint32_t g_page_count;

static pthread_mutex_t g_start_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_start_cv = PTHREAD_COND_INITIALIZER;
static unsigned g_welcomed;
static bool g_synced;

static void node_send(struct node *n, const Kvfence__V1__NodeMessage *m)
{
    uint8_t stackbuf[256];
    size_t len = kvfence__v1__node_message__get_packed_size(m);
    uint8_t *buf = len <= sizeof(stackbuf) ? stackbuf : xcalloc(1, len);
    kvfence__v1__node_message__pack(m, buf);
    pthread_mutex_lock(&n->send_mu);
    int rc = kvf_rpc_client_stream_send(n->cs, buf, len);
    pthread_mutex_unlock(&n->send_mu);
    if (buf != stackbuf)
        free(buf);
    if (rc != 0 && !atomic_load(&g_stop)) /* at the end the sessions close under the readers */
        die("node %s: send on the session failed: %s", n->id, strerror(-rc));
}

static void node_send_completed(struct node *n, uint64_t room, uint64_t gen, uint32_t rank,
                                Kvfence__V1__Role role)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = room;
    key.generation = gen;
    Kvfence__V1__Completed c = KVFENCE__V1__COMPLETED__INIT;
    c.room = &key;
    c.rank = rank;
    c.role = role;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_COMPLETED;
    m.completed = &c;
    node_send(n, &m);
}

static void node_answer_abort(struct node *n, const Kvfence__V1__AbortNotice *an)
{
    Kvfence__V1__Drained d = KVFENCE__V1__DRAINED__INIT;
    d.room = an->room; /* same room-generation, same token */
    d.token = an->token;
    d.notice_id = an->notice_id;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED;
    m.drained = &d;
    node_send(n, &m);
}

/* As a real node does once it applied an update: the control plane tells
 * the room's other nodes this node's leases only after it (node.proto
 * RoomUpdateAck), so the lifecycle measured includes the acks. An update
 * marked ack_not_needed is not acknowledged, as node.c does not. */
static void node_ack_update(struct node *n, const Kvfence__V1__RoomUpdate *ru)
{
    Kvfence__V1__RoomUpdateAck a = KVFENCE__V1__ROOM_UPDATE_ACK__INIT;
    a.room = ru->room;
    a.version = ru->version;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_ROOM_UPDATE_ACK;
    m.room_update_ack = &a;
    node_send(n, &m);
}

static void *node_reader(void *arg)
{
    struct node *n = arg;
    for (;;) {
        uint8_t *bytes = NULL;
        size_t len = 0;
        struct kvf_rpc_status st;
        int rc = kvf_rpc_client_stream_recv(n->cs, 200, &bytes, &len, &st);
        if (rc == -ETIMEDOUT) {
            if (atomic_load(&g_stop))
                break;
            continue;
        }
        if (rc == KVF_RPC_STREAM_END) {
            if (atomic_load(&g_stop))
                break;
            die("node %s: the session ended: status %s (%d): %s", n->id,
                kvf_grpc_code_name(st.code), st.code, st.message);
        }
        if (rc != 0)
            die("node %s: receive failed: %s", n->id, strerror(-rc));
        static const uint8_t empty[1];
        Kvfence__V1__ControlMessage *cm =
            kvfence__v1__control_message__unpack(NULL, len, len ? bytes : empty);
        free(bytes);
        if (cm == NULL)
            die("node %s: a message does not decode as ControlMessage", n->id);
        switch (cm->msg_case) {
        case KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME:
            pthread_mutex_lock(&g_start_mu);
            g_welcomed++;
            pthread_cond_broadcast(&g_start_cv);
            pthread_mutex_unlock(&g_start_mu);
            break;
        case KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE:
            atomic_fetch_add(&n->room_updates, 1);
            if (!cm->room_update->ack_not_needed) { /* as node.c */
                atomic_fetch_add(&n->room_update_acks, 1);
                node_ack_update(n, cm->room_update);
            }
            break;
        case KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE:
            atomic_fetch_add(&n->abort_notices, 1);
            node_answer_abort(n, cm->abort_notice);
            break;
        case KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER:
            atomic_fetch_add(&n->fence_peers, 1);
            break;
        default:
            atomic_fetch_add(&n->other_msgs, 1);
            break;
        }
        protobuf_c_message_free_unpacked(&cm->base, NULL);
    }
    return NULL;
}

static void nodes_open(void)
{
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    for (unsigned i = 0; i < N_NODES; i++) {
        struct node *n = &g_nodes[i];
        snprintf(n->id, sizeof(n->id), "bench-n%u", i);
        n->incarnation = (uint64_t)rt.tv_sec * 1000000000ull + (uint64_t)rt.tv_nsec;
        pthread_mutex_init(&n->send_mu, NULL);
        n->cs = kvf_rpc_client_stream_open(g_ch, M_ATTACH, KVF_RPC_NO_TIMEOUT);
        if (n->cs == NULL)
            die("node %s: cannot open %s", n->id, M_ATTACH);
        char *features[] = {(char *)"QUIESCE_V1"};
        Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
        caps.protocol_min = 1;
        caps.protocol_max = 1;
        caps.n_features = 1;
        caps.features = features;
        Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT;
        pool.pool_id = POOL_ID;
        pool.kind = KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
        pool.page_size = 4096;
        pool.page_count = g_page_count;
        Kvfence__V1__Pool *pools[] = {&pool};
        Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
        h.node_id = n->id;
        h.incarnation = n->incarnation;
        h.capabilities = &caps;
        h.n_pools = 1;
        h.pools = pools;
        h.software_version = (char *)"bench_cp_rpc";
        Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
        m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HELLO;
        m.hello = &h;
        node_send(n, &m);
        if (pthread_create(&n->reader, NULL, node_reader, n) != 0)
            die("pthread_create failed");
    }
}

/* ---- the lease watch ----------------------------------------------------------- */

/* Released leases that a worker waits for, by lease id (open addressing,
 * linear probing, backward-shift deletion), under g_lt_mu. */
struct lt_ent {
    uint64_t id; /* 0: empty */
    uint64_t released_ns;
    unsigned owner;
};

struct worker;
static struct worker *g_workers;
static pthread_mutex_t g_lt_mu = PTHREAD_MUTEX_INITIALIZER;
static struct lt_ent *g_lt;
static size_t g_lt_count;
static const size_t g_lt_mask = (1u << LEASE_TABLE_BITS) - 1;
static uint64_t g_unexpected_releases, g_releases_seen;
static struct kvf_rpc_client_stream *g_watch;
static pthread_t g_watch_reader;

static size_t lt_slot(uint64_t id)
{
    return (size_t)((id * 0x9E3779B97F4A7C15ull) >> (64 - LEASE_TABLE_BITS));
}

static struct lt_ent *lt_find(uint64_t id)
{
    for (size_t i = lt_slot(id);; i = (i + 1) & g_lt_mask) {
        if (g_lt[i].id == id)
            return &g_lt[i];
        if (g_lt[i].id == 0)
            return NULL;
    }
}

static void lt_insert(uint64_t id, unsigned owner)
{
    if (g_lt_count + 1 > g_lt_mask / 4 * 3)
        die("lease table full (%zu leases waited for)", g_lt_count);
    size_t i = lt_slot(id);
    while (g_lt[i].id != 0) {
        if (g_lt[i].id == id)
            die("lease %" PRIu64 " granted twice", id);
        i = (i + 1) & g_lt_mask;
    }
    g_lt[i] = (struct lt_ent){id, 0, owner};
    g_lt_count++;
}

static void lt_remove(uint64_t id)
{
    struct lt_ent *e = lt_find(id);
    if (e == NULL)
        return;
    size_t i = (size_t)(e - g_lt);
    size_t j = i;
    for (;;) {
        j = (j + 1) & g_lt_mask;
        if (g_lt[j].id == 0)
            break;
        size_t k = lt_slot(g_lt[j].id);
        /* Move j back into the hole at i unless its home k lies in (i, j]. */
        bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            g_lt[i] = g_lt[j];
            i = j;
        }
    }
    g_lt[i].id = 0;
    g_lt_count--;
}

struct worker {
    unsigned idx;
    pthread_t th;
    pthread_cond_t cv; /* with g_lt_mu */
    unsigned pending;  /* leases registered and not yet released (g_lt_mu) */
    uint64_t lifecycles, rpcs, rooms;
    struct lat life, join, complete_to_release, ping, abort_rel, abort_rpc, fill_join;
};

static void *watch_reader(void *arg)
{
    (void)arg;
    for (;;) {
        uint8_t *bytes = NULL;
        size_t len = 0;
        struct kvf_rpc_status st;
        int rc = kvf_rpc_client_stream_recv(g_watch, 200, &bytes, &len, &st);
        uint64_t t = now_ns();
        if (rc == -ETIMEDOUT) {
            if (atomic_load(&g_stop))
                break;
            continue;
        }
        if (rc == KVF_RPC_STREAM_END) {
            if (atomic_load(&g_stop))
                break;
            die("WatchLeases ended: status %s (%d): %s", kvf_grpc_code_name(st.code), st.code,
                st.message);
        }
        if (rc != 0)
            die("WatchLeases: receive failed: %s", strerror(-rc));
        static const uint8_t empty[1];
        Kvfence__V1__LeaseEvent *ev =
            kvfence__v1__lease_event__unpack(NULL, len, len ? bytes : empty);
        free(bytes);
        if (ev == NULL)
            die("WatchLeases: an event does not decode as LeaseEvent");
        if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED) {
            pthread_mutex_lock(&g_start_mu);
            g_synced = true;
            pthread_cond_broadcast(&g_start_cv);
            pthread_mutex_unlock(&g_start_mu);
        } else if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED) {
            uint64_t id = ev->released->lease_id;
            pthread_mutex_lock(&g_lt_mu);
            g_releases_seen++;
            struct lt_ent *e = lt_find(id);
            if (e == NULL || e->released_ns != 0) {
                g_unexpected_releases++;
            } else {
                e->released_ns = t;
                struct worker *w = &g_workers[e->owner];
                if (--w->pending == 0)
                    pthread_cond_signal(&w->cv);
            }
            pthread_mutex_unlock(&g_lt_mu);
        }
        protobuf_c_message_free_unpacked(&ev->base, NULL);
    }
    return NULL;
}

static void watch_open(void)
{
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    size_t len = kvfence__v1__watch_leases_request__get_packed_size(&rq);
    uint8_t buf[16];
    kvfence__v1__watch_leases_request__pack(&rq, buf);
    g_watch = kvf_rpc_client_stream_open(g_ch, M_WATCH, KVF_RPC_NO_TIMEOUT);
    if (g_watch == NULL)
        die("cannot open %s", M_WATCH);
    int rc = kvf_rpc_client_stream_send(g_watch, buf, len);
    if (rc == 0)
        rc = kvf_rpc_client_stream_half_close(g_watch);
    if (rc != 0)
        die("WatchLeases: cannot send the request: %s", strerror(-rc));
    if (pthread_create(&g_watch_reader, NULL, watch_reader, NULL) != 0)
        die("pthread_create failed");
}

/* Makes worker `w` wait for the release of these leases (before whatever
 * releases them is sent). */
static void leases_register(struct worker *w, const uint64_t *ids, size_t n)
{
    pthread_mutex_lock(&g_lt_mu);
    for (size_t i = 0; i < n; i++)
        lt_insert(ids[i], w->idx);
    w->pending += (unsigned)n;
    pthread_mutex_unlock(&g_lt_mu);
}

/* Waits until every registered lease of `w` is released; returns the time
 * the last of `ids` was seen released, and forgets them. */
static uint64_t leases_wait(struct worker *w, const uint64_t *ids, size_t n)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += cfg.timeout_ms / 1000;
    dl.tv_nsec += (cfg.timeout_ms % 1000) * 1000000;
    if (dl.tv_nsec >= 1000000000) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&g_lt_mu);
    while (w->pending > 0) {
        int rc = pthread_cond_timedwait(&w->cv, &g_lt_mu, &dl);
        if (rc == ETIMEDOUT && w->pending > 0) {
            uint64_t missing = 0;
            for (size_t i = 0; i < n && missing == 0; i++) {
                struct lt_ent *e = lt_find(ids[i]);
                if (e != NULL && e->released_ns == 0)
                    missing = ids[i];
            }
            die("%u of %zu leases (e.g. lease %" PRIu64 ") not RELEASED after %" PRId64 " ms",
                w->pending, n, missing, cfg.timeout_ms);
        }
    }
    uint64_t last = 0;
    for (size_t i = 0; i < n; i++) {
        struct lt_ent *e = lt_find(ids[i]);
        if (e->released_ns > last)
            last = e->released_ns;
        lt_remove(ids[i]);
    }
    pthread_mutex_unlock(&g_lt_mu);
    return last;
}

/* ---- Control calls ----------------------------------------------------------------- */

struct joined {
    uint64_t generation, lease_id;
    Kvfence__V1__RoomState state;
};

static struct joined join(uint64_t room, uint32_t nsrc, uint32_t nsink, const struct node *n,
                          uint32_t rank, Kvfence__V1__Role role, uint32_t first, uint64_t *lat_ns)
{
    char *features[] = {(char *)"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    Kvfence__V1__Participant p = KVFENCE__V1__PARTICIPANT__INIT;
    p.node_id = (char *)n->id;
    p.rank = rank;
    p.role = role;
    Kvfence__V1__PageRange rg = KVFENCE__V1__PAGE_RANGE__INIT;
    rg.first = first;
    rg.count = PAGES_PER_LEASE;
    Kvfence__V1__PageRange *rgs[] = {&rg};
    Kvfence__V1__JoinRoomRequest rq = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    rq.room_id = room;
    rq.expected_sources = nsrc;
    rq.expected_sinks = nsink;
    rq.participant = &p;
    rq.engine_capabilities = &caps;
    rq.pool_id = POOL_ID;
    rq.n_ranges = 1;
    rq.ranges = rgs;
    Kvfence__V1__JoinRoomResponse *rs = (Kvfence__V1__JoinRoomResponse *)call(
        M_JOIN, &rq.base, &kvfence__v1__join_room_response__descriptor, lat_ns);
    struct joined j = {rs->room ? rs->room->generation : 0, rs->lease_id, rs->state};
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    if (j.generation == 0 || j.lease_id == 0)
        die("JoinRoom of room %" PRIu64 ": reply without a generation or a lease id", room);
    return j;
}

static void expect_active(uint64_t room, const struct joined *last)
{
    if (last->state != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE)
        die("room %" PRIu64 ": the last join left it in state %d, not ACTIVE", room,
            (int)last->state);
}

/* ---- the phases --------------------------------------------------------------------- */

static uint64_t g_phase_end_ns;
static atomic_uint_fast64_t g_ticket; /* phases 2-4: next unit of work */
static uint64_t g_ticket_max;

/* Page layout of each node's pool: phase 1 at [0, 16T), phase 3 at
 * [16T, 80T), phase 4 after that. */
static uint32_t ph3_base(void)
{
    return cfg.threads * PAGES_PER_LEASE;
}

static uint32_t ph4_base(void)
{
    return ph3_base() + cfg.threads * ABORT_PER_NODE * PAGES_PER_LEASE;
}

static void *phase_lifecycles(void *arg)
{
    struct worker *w = arg;
    uint32_t first = w->idx * PAGES_PER_LEASE; /* one room in flight per thread */
    for (unsigned it = 0; now_ns() < g_phase_end_ns; it++) {
        uint64_t room = atomic_fetch_add(&g_next_room, 1);
        struct node *na = &g_nodes[(w->idx + it) % N_NODES];
        struct node *nb = &g_nodes[(w->idx + it + 1) % N_NODES];
        uint64_t t0 = now_ns(), l1, l2;
        struct joined src = join(room, 1, 1, na, 0, KVFENCE__V1__ROLE__ROLE_SOURCE, first, &l1);
        struct joined snk = join(room, 1, 1, nb, 0, KVFENCE__V1__ROLE__ROLE_SINK, first, &l2);
        expect_active(room, &snk);
        uint64_t ids[2] = {src.lease_id, snk.lease_id};
        leases_register(w, ids, 2);
        uint64_t tc = now_ns();
        node_send_completed(na, room, src.generation, 0, KVFENCE__V1__ROLE__ROLE_SOURCE);
        node_send_completed(nb, room, snk.generation, 0, KVFENCE__V1__ROLE__ROLE_SINK);
        leases_wait(w, ids, 2);
        uint64_t t1 = now_ns();
        lat_add(&w->join, l1);
        lat_add(&w->join, l2);
        lat_add(&w->life, t1 - t0);
        lat_add(&w->complete_to_release, t1 - tc);
        w->lifecycles++;
        w->rpcs += 2;
    }
    return NULL;
}

static void *phase_pings(void *arg)
{
    struct worker *w = arg;
    Kvfence__V1__PingRequest rq = KVFENCE__V1__PING_REQUEST__INIT;
    while (atomic_fetch_add(&g_ticket, 1) < g_ticket_max) {
        uint64_t l;
        ProtobufCMessage *rs = call(M_PING, &rq.base, &kvfence__v1__ping_response__descriptor, &l);
        protobuf_c_message_free_unpacked(rs, NULL);
        lat_add(&w->ping, l);
    }
    return NULL;
}

static void *phase_aborts(void *arg)
{
    struct worker *w = arg;
    while (atomic_fetch_add(&g_ticket, 1) < g_ticket_max) {
        uint64_t room = atomic_fetch_add(&g_next_room, 1);
        uint64_t ids[ABORT_PARTS];
        struct joined j = {0, 0, 0};
        for (unsigned k = 0; k < ABORT_PARTS; k++) {
            unsigned node = k / ABORT_PER_NODE, slot = k % ABORT_PER_NODE;
            Kvfence__V1__Role role = slot < ABORT_PER_NODE / 2 ? KVFENCE__V1__ROLE__ROLE_SOURCE
                                                               : KVFENCE__V1__ROLE__ROLE_SINK;
            uint32_t first = ph3_base() + (w->idx * ABORT_PER_NODE + slot) * PAGES_PER_LEASE;
            j = join(room, ABORT_PARTS / 2, ABORT_PARTS / 2, &g_nodes[node], k, role, first, NULL);
            ids[k] = j.lease_id;
        }
        expect_active(room, &j);
        leases_register(w, ids, ABORT_PARTS);
        Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
        key.room_id = room;
        key.generation = j.generation;
        Kvfence__V1__AbortRoomRequest rq = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
        rq.room = &key;
        rq.detail = (char *)"bench_cp_rpc";
        uint64_t t0 = now_ns(), l;
        ProtobufCMessage *rs =
            call(M_ABORT, &rq.base, &kvfence__v1__abort_room_response__descriptor, &l);
        protobuf_c_message_free_unpacked(rs, NULL);
        uint64_t t1 = leases_wait(w, ids, ABORT_PARTS);
        lat_add(&w->abort_rel, t1 - t0);
        lat_add(&w->abort_rpc, l);
        w->rooms++;
    }
    return NULL;
}

static void *phase_open_rooms(void *arg)
{
    struct worker *w = arg;
    uint64_t i;
    while ((i = atomic_fetch_add(&g_ticket, 1)) < g_ticket_max) {
        uint64_t room = atomic_fetch_add(&g_next_room, 1);
        uint32_t first = ph4_base() + (uint32_t)(i / N_NODES) * 2 * PAGES_PER_LEASE;
        uint64_t l1, l2;
        join(room, 1, 1, &g_nodes[i % N_NODES], 0, KVFENCE__V1__ROLE__ROLE_SOURCE, first, &l1);
        struct joined snk = join(room, 1, 1, &g_nodes[(i + 1) % N_NODES], 0,
                                 KVFENCE__V1__ROLE__ROLE_SINK, first + PAGES_PER_LEASE, &l2);
        expect_active(room, &snk);
        lat_add(&w->fill_join, l1);
        lat_add(&w->fill_join, l2);
        w->rooms++;
        if (w->idx == 0 && w->rooms % 5000 == 0)
            fprintf(stderr, "  ... %" PRIu64 " of %" PRIu64 " open rooms\n",
                    (uint64_t)atomic_load(&g_ticket), g_ticket_max);
    }
    return NULL;
}

static double run_workers(void *(*fn)(void *))
{
    uint64_t t0 = now_ns();
    for (unsigned i = 0; i < cfg.threads; i++)
        if (pthread_create(&g_workers[i].th, NULL, fn, &g_workers[i]) != 0)
            die("pthread_create failed");
    for (unsigned i = 0; i < cfg.threads; i++)
        pthread_join(g_workers[i].th, NULL);
    return (double)(now_ns() - t0) / 1e9;
}

static void stats_print(void)
{
    Kvfence__V1__GetStatsRequest rq = KVFENCE__V1__GET_STATS_REQUEST__INIT;
    Kvfence__V1__Stats *s =
        (Kvfence__V1__Stats *)call(M_GETSTATS, &rq.base, &kvfence__v1__stats__descriptor, NULL);
    if (s->rooms != NULL)
        printf("  rooms: opening %" PRIu64 ", active %" PRIu64 ", aborting %" PRIu64
               ", completed %" PRIu64 ", aborted %" PRIu64 "\n",
               s->rooms->opening, s->rooms->active, s->rooms->aborting, s->rooms->completed,
               s->rooms->aborted);
    if (s->leases != NULL)
        printf("  leases: active %" PRIu64 ", releasing %" PRIu64 ", released %" PRIu64 "\n",
               s->leases->active, s->leases->releasing, s->leases->released);
    printf("  notices sent %" PRIu64 ", re-sent %" PRIu64 ", pending %" PRIu64
           "; reports stale %" PRIu64 ", tokenless %" PRIu64 ", unknown %" PRIu64
           "; fences requested %" PRIu64 "\n",
           s->notices_sent, s->notices_resent, s->notices_pending, s->reports_stale,
           s->reports_tokenless, s->reports_unknown, s->fences_requested);
    protobuf_c_message_free_unpacked(&s->base, NULL);
    uint64_t ru = 0, an = 0, fp = 0, other = 0;
    for (unsigned i = 0; i < N_NODES; i++) {
        ru += atomic_load(&g_nodes[i].room_updates);
        an += atomic_load(&g_nodes[i].abort_notices);
        fp += atomic_load(&g_nodes[i].fence_peers);
        other += atomic_load(&g_nodes[i].other_msgs);
    }
    pthread_mutex_lock(&g_lt_mu);
    printf("  fake nodes got: %" PRIu64 " room updates, %" PRIu64 " abort notices (each answered),"
           " %" PRIu64 " fence requests, %" PRIu64 " other; watch: %" PRIu64 " releases, %" PRIu64
           " not waited for\n",
           ru, an, fp, other, g_releases_seen, g_unexpected_releases);
    pthread_mutex_unlock(&g_lt_mu);
}

static void usage_exit(const char *argv0)
{
    fprintf(stderr,
            "usage: %s --target HOST:PORT [--server-pid PID] [--threads T (8)]\n"
            "          [--duration SECONDS (5)] [--abort-rooms R (2000)] [--open-rooms N (0)]\n"
            "          [--timeout-ms MS (10000)] [--no-pings]\n",
            argv0);
    exit(2);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* the report and stderr's progress in order */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            usage_exit(argv[0]);
        if (strcmp(a, "--no-pings") == 0) {
            cfg.no_pings = true;
            continue;
        }
        if (i + 1 >= argc)
            usage_exit(argv[0]);
        const char *v = argv[++i];
        if (strcmp(a, "--target") == 0)
            cfg.target = v;
        else if (strcmp(a, "--server-pid") == 0)
            cfg.server_pid = strtol(v, NULL, 10);
        else if (strcmp(a, "--threads") == 0)
            cfg.threads = (unsigned)strtoul(v, NULL, 10);
        else if (strcmp(a, "--duration") == 0)
            cfg.duration_s = strtod(v, NULL);
        else if (strcmp(a, "--abort-rooms") == 0)
            cfg.abort_rooms = (unsigned)strtoul(v, NULL, 10);
        else if (strcmp(a, "--open-rooms") == 0)
            cfg.open_rooms = (unsigned)strtoul(v, NULL, 10);
        else if (strcmp(a, "--timeout-ms") == 0)
            cfg.timeout_ms = strtoll(v, NULL, 10);
        else
            usage_exit(argv[0]);
    }
    if (cfg.target == NULL || cfg.threads == 0 || cfg.threads > 256 || cfg.duration_s <= 0 ||
        cfg.timeout_ms <= 0 || cfg.open_rooms > 10000000)
        usage_exit(argv[0]);

    uint64_t pages = (uint64_t)ph4_base() +
                     ((uint64_t)cfg.open_rooms + N_NODES - 1) / N_NODES * 2 * PAGES_PER_LEASE;
    g_page_count = (uint32_t)(pages < 1024 ? 1024 : pages);
    g_workers = xcalloc(cfg.threads, sizeof(*g_workers));
    for (unsigned i = 0; i < cfg.threads; i++) {
        g_workers[i].idx = i;
        pthread_cond_init(&g_workers[i].cv, NULL);
    }
    g_lt = xcalloc(g_lt_mask + 1, sizeof(*g_lt));

    struct kvf_rpc_channel_opts copts;
    kvf_rpc_channel_opts_init(&copts);
    copts.wait_for_ready = true;
    g_ch = kvf_rpc_channel_create(cfg.target, &copts);
    if (g_ch == NULL)
        die("cannot create a channel to %s", cfg.target);

    printf("kvfence control-plane RPC benchmark: target %s, server pid %ld, %u threads, "
           "%d fake nodes (pool of %" PRIu32 " pages each)\n",
           cfg.target, cfg.server_pid, cfg.threads, N_NODES, g_page_count);
    struct usage u0, prev;
    usage_read(&u0);
    prev = u0;
    printf("  server at start: RSS %.1f MiB, CPU %.2f s\n", (double)u0.srv_rss_kib / 1024.0,
           u0.srv_cpu_s);

    /* Setup: nodes attached, the watch synced. */
    watch_open();
    nodes_open();
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += 10;
    pthread_mutex_lock(&g_start_mu);
    while (g_welcomed < N_NODES || !g_synced) {
        if (pthread_cond_timedwait(&g_start_cv, &g_start_mu, &dl) == ETIMEDOUT)
            die("setup: %u of %d nodes welcomed, watch %s after 10 s", g_welcomed, N_NODES,
                g_synced ? "synced" : "not synced");
    }
    pthread_mutex_unlock(&g_start_mu);

    /* Phase 1: lifecycles. */
    printf("\n[1] room lifecycles for %.1f s (2 joins, 2 Completed, 2 leases RELEASED)\n",
           cfg.duration_s);
    g_phase_end_ns = now_ns() + (uint64_t)(cfg.duration_s * 1e9);
    double el1 = run_workers(phase_lifecycles);
    struct lat life = {0}, joinl = {0}, c2r = {0};
    uint64_t lifecycles = 0, rpcs = 0;
    for (unsigned i = 0; i < cfg.threads; i++) {
        lat_merge(&life, &g_workers[i].life);
        lat_merge(&joinl, &g_workers[i].join);
        lat_merge(&c2r, &g_workers[i].complete_to_release);
        lifecycles += g_workers[i].lifecycles;
        rpcs += g_workers[i].rpcs;
    }
    printf("  %" PRIu64 " lifecycles in %.2f s: %.0f rooms/s (%" PRIu64 " JoinRoom RPCs, %.0f/s)\n",
           lifecycles, el1, (double)lifecycles / el1, rpcs, (double)rpcs / el1);
    lat_print("lifecycle", &life);
    lat_print("JoinRoom RPC", &joinl);
    lat_print("Completed sent -> RELEASED", &c2r);
    double cpu_before = prev.srv_cpu_s;
    usage_print("phase 1", &prev, (double)lifecycles, "lifecycle");
    {
        uint64_t ru = 0, acks = 0;
        for (unsigned i = 0; i < N_NODES; i++) {
            ru += atomic_load(&g_nodes[i].room_updates);
            acks += atomic_load(&g_nodes[i].room_update_acks);
        }
        double per = lifecycles ? (double)ru / (double)lifecycles : 0;
        double acks_per = lifecycles ? (double)acks / (double)lifecycles : 0;
        printf("  room updates: %" PRIu64 ", %.2f per lifecycle; RoomUpdateAcks sent (none for "
               "an update marked ack_not_needed) %.2f per lifecycle\n",
               ru, per, acks_per);
        printf("RESULT lifecycle lifecycles_per_s=%.1f p50_us=%.1f srv_cpu_us=%.2f "
               "updates_per_lifecycle=%.3f acks_per_lifecycle=%.3f\n",
               (double)lifecycles / el1, lat_pct_us(&life, 50),
               lifecycles ? (prev.srv_cpu_s - cpu_before) * 1e6 / (double)lifecycles : 0, per,
               acks_per);
    }

    /* Phase 2: as many bare unary calls as phase 1 made RPCs. */
    if (!cfg.no_pings) {
        printf("\n[2] bare calls: %" PRIu64 " Admin.Ping (= phase 1's unary RPC count)\n", rpcs);
        atomic_store(&g_ticket, 0);
        g_ticket_max = rpcs;
        double el2 = run_workers(phase_pings);
        struct lat ping = {0};
        for (unsigned i = 0; i < cfg.threads; i++)
            lat_merge(&ping, &g_workers[i].ping);
        printf("  %zu calls in %.2f s: %.0f calls/s\n", ping.n, el2, (double)ping.n / el2);
        lat_print("Admin.Ping RPC", &ping);
        usage_print("phase 2", &prev, (double)ping.n, "call");
        {
            double per_life = el1 / (double)lifecycles; /* wall time per lifecycle, T in flight */
            double per_call = el2 / (double)ping.n;     /* wall time per bare call, T in flight */
            double p50_ratio2 = lat_pct_us(&life, 50) / (2 * lat_pct_us(&ping, 50));
            double p50_ratio4 = lat_pct_us(&life, 50) / (4 * lat_pct_us(&ping, 50));
            printf("  cost ratio, lifecycle / bare calls (target <= 1.5x):\n");
            printf("    per RPC (1 lifecycle vs 2 Pings, its 2 unary RPCs):   throughput %.2fx, "
                   "p50 latency %.2fx   <- the ratio compared with the target\n",
                   per_life / (2 * per_call), p50_ratio2);
            printf("    per operation (1 lifecycle vs 4 Pings: 2 joins + 2 node messages): "
                   "throughput %.2fx, p50 latency %.2fx\n",
                   per_life / (4 * per_call), p50_ratio4);
        }
    }

    /* Phase 3: aborts. */
    if (cfg.abort_rooms > 0) {
        printf("\n[3] aborts: %u rooms of %u participants (%u per node, %u sources + %u sinks), "
               "AbortRoom -> all %u leases RELEASED\n",
               cfg.abort_rooms, ABORT_PARTS, ABORT_PER_NODE, ABORT_PARTS / 2, ABORT_PARTS / 2,
               ABORT_PARTS);
        atomic_store(&g_ticket, 0);
        g_ticket_max = cfg.abort_rooms;
        double el3 = run_workers(phase_aborts);
        struct lat arel = {0}, arpc = {0};
        for (unsigned i = 0; i < cfg.threads; i++) {
            lat_merge(&arel, &g_workers[i].abort_rel);
            lat_merge(&arpc, &g_workers[i].abort_rpc);
        }
        printf("  %zu rooms in %.2f s (%u JoinRoom + 1 AbortRoom each)\n", arel.n, el3,
               ABORT_PARTS);
        lat_print("abort -> RELEASED", &arel);
        lat_print("AbortRoom RPC", &arpc);
        printf("  abort -> RELEASED p99 %.3f ms (target < 2 ms): %s\n", lat_pct_us(&arel, 99) / 1e3,
               lat_pct_us(&arel, 99) < 2000 ? "met" : "NOT met");
        usage_print("phase 3", &prev, (double)arel.n, "aborted room");
    }

    /* Phase 4: open rooms. */
    if (cfg.open_rooms > 0) {
        printf("\n[4] %u open ACTIVE rooms (2 participants, 16 pages each), not completed\n",
               cfg.open_rooms);
        struct usage before;
        usage_read(&before);
        atomic_store(&g_ticket, 0);
        g_ticket_max = cfg.open_rooms;
        double el4 = run_workers(phase_open_rooms);
        struct lat fj = {0};
        for (unsigned i = 0; i < cfg.threads; i++)
            lat_merge(&fj, &g_workers[i].fill_join);
        struct usage after;
        usage_read(&after);
        printf("  filled in %.2f s: %.0f rooms/s\n", el4, (double)cfg.open_rooms / el4);
        lat_print("JoinRoom RPC (fill)", &fj);
        if (cfg.server_pid > 0) {
            double d = (double)(after.srv_rss_kib - before.srv_rss_kib) * 1024.0;
            printf("  server RSS %.1f MiB before, %.1f MiB after (+%.1f MiB, %.0f B per open room);"
                   " target < 1 GiB at 100,000 rooms: %s\n",
                   (double)before.srv_rss_kib / 1024.0, (double)after.srv_rss_kib / 1024.0,
                   d / 1048576.0, d / (double)cfg.open_rooms,
                   after.srv_rss_kib < 1024L * 1024L ? "met" : "NOT met");
        }
        usage_print("phase 4", &prev, (double)cfg.open_rooms, "open room");
    }

    printf("\nserver stats (Admin.GetStats):\n");
    stats_print();

    atomic_store(&g_stop, true);
    kvf_rpc_client_stream_cancel(g_watch);
    for (unsigned i = 0; i < N_NODES; i++)
        kvf_rpc_client_stream_cancel(g_nodes[i].cs);
    pthread_join(g_watch_reader, NULL);
    for (unsigned i = 0; i < N_NODES; i++)
        pthread_join(g_nodes[i].reader, NULL);
    kvf_rpc_client_stream_close(g_watch);
    for (unsigned i = 0; i < N_NODES; i++)
        kvf_rpc_client_stream_close(g_nodes[i].cs);
    kvf_rpc_channel_destroy(g_ch);
    fflush(stdout);
    return 0;
}
