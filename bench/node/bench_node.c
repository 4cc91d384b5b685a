/*
 * bench_node.c: kvfence-node end to end on loopback, through the real
 * daemons: one kvfence-control and two kvfence-node processes (n1, n2) on
 * 127.0.0.1; this program plays the engine (POSIX shm pools registered over
 * NodeLocal, rooms joined over Control.JoinRoom, chunks submitted to n1 on
 * one NodeLocal.SubmitChunks stream per room with up to --window requests
 * outstanding (--submit stream, the default) or with one unary
 * NodeLocal.SubmitChunk call each, in sequence (--submit unary)) and follows rooms on one
 * Control.WatchLeases stream (include_room_states), timestamping each event when it is received.
 *
 *   tput   bytes/s from the first SubmitChunk until the watch reports the room
 *          COMPLETED, for 64 KiB and 1 MiB chunks, against a plain loopback
 *          TCP stream between this process and a forked child (same chunk
 *          size, same bytes, same shm pools) measured in the same repetition;
 *   abort  one SubmitChunk of N frames of 256 KiB (the node's largest frame),
 *          then AbortRoom; latency from the AbortRoom call until the watch
 *          has reported both leases RELEASED. The room cannot complete by
 *          itself (the leases hold one frame more than is sent);
 *   ops    chunks of one page each (one frame, one lifetime op per side)
 *          from T threads, a room each (same --submit mode); ops/s from the
 *          first submit until the last room is COMPLETED;
 *   rss    (only with --only rss) N rooms of one page each, T threads with
 *          rooms one after another; both nodes' RSS at every tenth.
 *
 * Honesty: every configuration checks the sink pool byte for byte against
 * the source (tput, ops) or frame by frame (abort: each frame landed whole or
 * not at all, nothing outside the lease), and the program exits 1 with a
 * message when a call fails, a room does not complete or a check fails.
 * Logs of the three daemons go to files in a temporary directory, kept (and
 * named) on failure.
 *
 * Usage: bench_node [--mib N] [--reps R] [--abort-reps R] [--ops N]
 *                   [--threads T] [--rooms R] [--only tput|abort|ops|rss]
 *                   [--rss-rooms N]
 *                   [--submit stream|unary] [--window W<=64]
 *                   [--control BIN] [--node BIN]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvf_types.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"
#include "kvf_clock.h"

#define PAGE         4096u
#define POOL_PAGES   65536u /* 256 MiB per pool */
#define POOL_BYTES   ((size_t)PAGE * POOL_PAGES)
#define FRAME_PAGES  64u /* the node's largest TCP frame: 256 KiB */
#define CALL_MS      10000
#define ROOM_WAIT_MS 60000
#define MAX_ROOMS    8192
#define MAX_THREADS  16

#define M_JOIN   "/kvfence.v1.Control/JoinRoom"
#define M_ABORT  "/kvfence.v1.Control/AbortRoom"
#define M_WATCH  "/kvfence.v1.Control/WatchLeases"
#define M_REG    "/kvfence.v1.NodeLocal/RegisterPool"
#define M_SUBMIT "/kvfence.v1.NodeLocal/SubmitChunk"
#define M_STREAM "/kvfence.v1.NodeLocal/SubmitChunks"

/* ---- basics -------------------------------------------------------------------- */

static char g_dir[64];
static atomic_bool g_failed;
static bool g_unary;      /* --submit unary */
static int g_window = 64; /* --window: requests outstanding per stream */

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "bench_node: FAILED: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    if (g_dir[0])
        fprintf(stderr, "bench_node: daemon logs kept in %s\n", g_dir);
    atomic_store(&g_failed, true);
    /* The children die with us (PDEATHSIG); shm names are unlinked at setup. */
    exit(1);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of v[0..n) (sorted in place). */
static double pct(double *v, size_t n, double p)
{
    qsort(v, n, sizeof *v, cmp_double);
    size_t k = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (k < 1)
        k = 1;
    if (k > n)
        k = n;
    return v[k - 1];
}

/* ---- processes ------------------------------------------------------------------ */

struct node_proc {
    pid_t pid;
    char id[8];
    char sock[128];
    struct kvf_rpc_channel *local;
};

static struct kvf_proc g_cp;
static struct node_proc g_n1, g_n2;
static struct kvf_rpc_channel *g_ch; /* Control + watch */
static const char *g_control_bin = KVF_CONTROL_BIN;
static const char *g_node_bin = KVF_NODE_BIN;

/* Runs `fn` with stderr sent to `log` (the children inherit it). */
static int with_stderr_to(const char *log, int (*fn)(void *), void *arg)
{
    fflush(stderr);
    int saved = dup(2);
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (saved < 0 || fd < 0)
        die("cannot open %s", log);
    dup2(fd, 2);
    close(fd);
    int rc = fn(arg);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    return rc;
}

static int start_cp(void *arg)
{
    (void)arg;
    const char *args[] = {"--threads", "2", NULL};
    return kvf_proc_start(&g_cp, g_control_bin, args);
}

static int start_node(void *arg)
{
    struct node_proc *np = arg;
    char port_file[160];
    snprintf(np->sock, sizeof np->sock, "%s/%s.sock", g_dir, np->id);
    snprintf(port_file, sizeof port_file, "%s/%s.port", g_dir, np->id);
    pid_t parent = getpid();
    np->pid = fork();
    if (np->pid < 0)
        return -1;
    if (np->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        execl(g_node_bin, g_node_bin, "--control", g_cp.target, "--node-id", np->id,
              "--local-socket", np->sock, "--port-file", port_file, "--data-host", "127.0.0.1",
              "--data-port", "0", "--drain-timeout-ms", "3000",
              /* The pools are this user's 0600 shm objects, named by
               * host_shm: the socket must admit this user only. */
              "--local-socket-mode", "0600", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 1000; i++) {
        if (access(port_file, R_OK) == 0) {
            char target[200];
            snprintf(target, sizeof target, "unix:%s", np->sock);
            struct kvf_rpc_channel_opts co;
            kvf_rpc_channel_opts_init(&co);
            co.wait_for_ready = true;
            np->local = kvf_rpc_channel_create(target, &co);
            return np->local ? 0 : -1;
        }
        int st;
        if (waitpid(np->pid, &st, WNOHANG) == np->pid) {
            np->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    return -1;
}

static int stop_node(struct node_proc *np)
{
    kvf_rpc_channel_destroy(np->local);
    np->local = NULL;
    if (np->pid <= 0)
        return -1;
    kill(np->pid, SIGTERM);
    int st = -1;
    for (int i = 0; i < 1000; i++) {
        if (waitpid(np->pid, &st, WNOHANG) == np->pid) {
            np->pid = 0;
            return st;
        }
        sleep_ms(10);
    }
    kill(np->pid, SIGKILL);
    waitpid(np->pid, &st, 0);
    np->pid = 0;
    return -2;
}

/* ---- RPC helpers ----------------------------------------------------------------- */

static int call(struct kvf_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                uint8_t **resp_p, size_t *len_p, struct kvf_rpc_status *st)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t stackbuf[512];
    uint8_t *buf = len <= sizeof stackbuf ? stackbuf : malloc(len);
    if (!buf)
        die("out of memory");
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    int rc = kvf_rpc_unary(ch, method, buf, len, CALL_MS, &resp, &rlen, st);
    if (buf != stackbuf)
        free(buf);
    if (rc != 0) {
        free(resp);
        return st->code ? st->code : KVF_GRPC_INTERNAL;
    }
    if (resp_p) {
        *resp_p = resp;
        *len_p = rlen;
    } else {
        free(resp);
    }
    return KVF_GRPC_OK;
}

struct shm_pool {
    char name[64];
    uint8_t *mem;
    uint32_t pool_id;
};

static struct shm_pool g_p1, g_p2;

static void shm_create(struct shm_pool *p, const char *tag)
{
    snprintf(p->name, sizeof p->name, "/kvf-bench-%d-%s", (int)getpid(), tag);
    int fd = shm_open(p->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        die("shm_open %s: %s", p->name, strerror(errno));
    if (ftruncate(fd, (off_t)POOL_BYTES) != 0)
        die("ftruncate %s: %s", p->name, strerror(errno));
    p->mem = mmap(NULL, POOL_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p->mem == MAP_FAILED)
        die("mmap %s: %s", p->name, strerror(errno));
    memset(p->mem, 0, POOL_BYTES); /* fault every page in now, not during a run */
}

static void shm_destroy(struct shm_pool *p)
{
    if (p->mem)
        munmap(p->mem, POOL_BYTES);
    p->mem = NULL;
    if (p->name[0])
        shm_unlink(p->name);
    p->name[0] = '\0';
}

static uint32_t register_pool(struct node_proc *np, const struct shm_pool *p)
{
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)p->name;
    shm.size = POOL_BYTES;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = PAGE;
    req.page_count = POOL_PAGES;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = call(np->local, M_REG, &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        die("RegisterPool on %s: %s: %s", np->id, kvf_grpc_code_name(code), st.message);
    Kvfence__V1__RegisterPoolResponse *r =
        kvfence__v1__register_pool_response__unpack(NULL, len, resp);
    free(resp);
    if (!r || !r->pool)
        die("RegisterPool on %s: undecodable reply", np->id);
    uint32_t id = r->pool->pool_id;
    kvfence__v1__register_pool_response__free_unpacked(r, NULL);
    return id;
}

struct joined {
    kvf_room_key key;
    uint64_t lease;
    int state;
};

/* Joins one participant (1 source + 1 sink per room); retries while the pool
 * is not yet known to the control plane (its PoolUpdate races the join). */
static struct joined join(uint64_t room_id, const char *node, int role, uint32_t pool_id,
                          uint32_t first, uint32_t count)
{
    static const char *features[] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = (char **)features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)node;
    part.role = (Kvfence__V1__Role)role;
    Kvfence__V1__PageRange pr = KVFENCE__V1__PAGE_RANGE__INIT;
    pr.first = first;
    pr.count = count;
    Kvfence__V1__PageRange *prs[1] = {&pr};
    Kvfence__V1__JoinRoomRequest req = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    req.room_id = room_id;
    req.expected_sources = 1;
    req.expected_sinks = 1;
    req.participant = &part;
    req.engine_capabilities = &caps;
    req.pool_id = pool_id;
    req.n_ranges = 1;
    req.ranges = prs;
    uint64_t end = now_ns() + 10000000000ull;
    for (;;) {
        uint8_t *resp;
        size_t len;
        struct kvf_rpc_status st;
        int code = call(g_ch, M_JOIN, &req.base, &resp, &len, &st);
        if (code == KVF_GRPC_OK) {
            Kvfence__V1__JoinRoomResponse *r =
                kvfence__v1__join_room_response__unpack(NULL, len, resp);
            free(resp);
            if (!r || !r->room)
                die("JoinRoom: undecodable reply");
            struct joined j = {{r->room->room_id, r->room->generation}, r->lease_id, r->state};
            kvfence__v1__join_room_response__free_unpacked(r, NULL);
            return j;
        }
        if (now_ns() > end)
            die("JoinRoom room %" PRIu64 " on %s: %s: %s", room_id, node, kvf_grpc_code_name(code),
                st.message);
        sleep_ms(10);
    }
}

/* Packs a SubmitChunkRequest into buf (256 bytes); returns its length. */
static size_t pack_submit(uint8_t *buf, kvf_room_key k, uint32_t source_rank, uint64_t seq,
                          uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange s = KVFENCE__V1__PAGE_RANGE__INIT, d = KVFENCE__V1__PAGE_RANGE__INIT;
    s.first = sfirst;
    s.count = count;
    d.first = dfirst;
    d.count = count;
    Kvfence__V1__PageRange *sv[1] = {&s}, *dv[1] = {&d};
    Kvfence__V1__SubmitChunkRequest req = KVFENCE__V1__SUBMIT_CHUNK_REQUEST__INIT;
    req.room = &rk;
    req.chunk_seq = seq;
    req.source_rank = source_rank;
    req.source_pool_id = g_p1.pool_id;
    req.n_source_ranges = 1;
    req.source_ranges = sv;
    req.sink_node_id = (char *)"n2";
    req.sink_pool_id = g_p2.pool_id;
    req.n_sink_ranges = 1;
    req.sink_ranges = dv;
    req.last_chunk = last;
    size_t len = kvfence__v1__submit_chunk_request__get_packed_size(&req);
    if (len > 256)
        die("SubmitChunkRequest of %zu bytes", len);
    kvfence__v1__submit_chunk_request__pack(&req, buf);
    return len;
}

static int submit(struct node_proc *np, kvf_room_key k, uint32_t source_rank, uint64_t seq,
                  uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                  struct kvf_rpc_status *st)
{
    uint8_t buf[256];
    size_t len = pack_submit(buf, k, source_rank, seq, sfirst, dfirst, count, last);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    int rc = kvf_rpc_unary(np->local, M_SUBMIT, buf, len, CALL_MS, &resp, &rlen, st);
    free(resp);
    if (rc != 0)
        return st->code ? st->code : KVF_GRPC_INTERNAL;
    return KVF_GRPC_OK;
}

/* Reads the next SubmitChunks result; dies unless it is OK for `seq`. */
static void stream_result(struct kvf_rpc_client_stream *cs, kvf_room_key k, uint64_t seq)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, CALL_MS, &msg, &len, &st);
    if (rc != 0)
        die("SubmitChunks of room %" PRIu64 ": recv %d (%s: %s)", k.room_id, rc,
            rc == KVF_RPC_STREAM_END ? kvf_grpc_code_name(st.code) : "-",
            rc == KVF_RPC_STREAM_END ? st.message : "");
    Kvfence__V1__SubmitChunkResult *r = kvfence__v1__submit_chunk_result__unpack(NULL, len, msg);
    free(msg);
    if (!r || r->chunk_seq != seq || r->code != KVF_GRPC_OK)
        die("SubmitChunks of room %" PRIu64 ": chunk %" PRIu64 ": %s: %s", k.room_id,
            r ? r->chunk_seq : 0, r ? kvf_grpc_code_name((int)r->code) : "undecodable",
            r ? r->message : "");
    kvfence__v1__submit_chunk_result__free_unpacked(r, NULL);
}

/* Waits until `np` has the room's update: a SubmitChunk naming a source rank
 * that is in no lease (99) answers UNAVAILABLE before, FAILED_PRECONDITION
 * after. */
static void wait_node_knows(struct node_proc *np, kvf_room_key k)
{
    uint64_t end = now_ns() + 10000000000ull;
    for (;;) {
        struct kvf_rpc_status st;
        int code = submit(np, k, 99, 1, 0, 0, 1, false, &st);
        if (code == KVF_GRPC_FAILED_PRECONDITION)
            return;
        if (code != KVF_GRPC_UNAVAILABLE)
            die("node %s: unexpected probe answer %s: %s", np->id, kvf_grpc_code_name(code),
                st.message);
        if (now_ns() > end)
            die("node %s never got the update of room %" PRIu64, np->id, k.room_id);
        sleep_ms(1);
    }
}

/* ---- the watch ------------------------------------------------------------------- */

struct room_ev {
    uint64_t completed_ns, aborted_ns, aborting_ns, last_release_ns;
    unsigned releases;
};

static pthread_mutex_t g_wmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wcv = PTHREAD_COND_INITIALIZER;
static struct room_ev g_rooms[MAX_ROOMS];
static bool g_synced;
static atomic_bool g_stop;
static struct kvf_rpc_client_stream *g_watch;
static pthread_t g_watch_th;
static atomic_uint_fast64_t g_next_room = 1;

static void *watch_main(void *arg)
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
                return NULL;
            continue;
        }
        if (rc == KVF_RPC_STREAM_END) {
            if (atomic_load(&g_stop))
                return NULL;
            die("WatchLeases ended: %s: %s", kvf_grpc_code_name(st.code), st.message);
        }
        if (rc != 0)
            die("WatchLeases: receive failed: %s", strerror(-rc));
        static const uint8_t empty[1];
        Kvfence__V1__LeaseEvent *ev =
            kvfence__v1__lease_event__unpack(NULL, len, len ? bytes : empty);
        free(bytes);
        if (!ev)
            die("WatchLeases: undecodable event");
        pthread_mutex_lock(&g_wmu);
        if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED) {
            g_synced = true;
        } else if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED) {
            const Kvfence__V1__Lease *l = ev->released;
            if (l->room) {
                g_rooms[l->room->room_id % MAX_ROOMS].releases++;
                g_rooms[l->room->room_id % MAX_ROOMS].last_release_ns = t;
            }
        } else if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE) {
            const Kvfence__V1__RoomStateChange *rs = ev->room_state;
            if (rs->room) {
                struct room_ev *re = &g_rooms[rs->room->room_id % MAX_ROOMS];
                if (rs->new_state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED)
                    re->completed_ns = t;
                else if (rs->new_state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED)
                    re->aborted_ns = t;
                else if (rs->new_state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING)
                    re->aborting_ns = t;
            }
        }
        pthread_cond_broadcast(&g_wcv);
        pthread_mutex_unlock(&g_wmu);
        protobuf_c_message_free_unpacked(&ev->base, NULL);
    }
}

static void watch_open(void)
{
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.include_room_states = true;
    uint8_t buf[16];
    size_t len = kvfence__v1__watch_leases_request__get_packed_size(&rq);
    kvfence__v1__watch_leases_request__pack(&rq, buf);
    g_watch = kvf_rpc_client_stream_open(g_ch, M_WATCH, KVF_RPC_NO_TIMEOUT);
    if (!g_watch)
        die("cannot open %s", M_WATCH);
    int rc = kvf_rpc_client_stream_send(g_watch, buf, len);
    if (rc == 0)
        rc = kvf_rpc_client_stream_half_close(g_watch);
    if (rc != 0)
        die("WatchLeases: cannot send the request: %s", strerror(-rc));
    if (pthread_create(&g_watch_th, NULL, watch_main, NULL) != 0)
        die("pthread_create failed");
    uint64_t end = now_ns() + 10000000000ull;
    pthread_mutex_lock(&g_wmu);
    while (!g_synced) {
        pthread_mutex_unlock(&g_wmu);
        if (now_ns() > end)
            die("WatchLeases: no WatchSynced after 10 s");
        sleep_ms(5);
        pthread_mutex_lock(&g_wmu);
    }
    pthread_mutex_unlock(&g_wmu);
}

/* Waits until `pred` holds for room `id`; dies after ROOM_WAIT_MS. Returns a
 * copy of the room's events. */
static struct room_ev wait_room(uint64_t id, bool (*pred)(const struct room_ev *), const char *what)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += ROOM_WAIT_MS / 1000;
    struct room_ev *re = &g_rooms[id % MAX_ROOMS];
    pthread_mutex_lock(&g_wmu);
    while (!pred(re)) {
        if (pthread_cond_timedwait(&g_wcv, &g_wmu, &dl) == ETIMEDOUT && !pred(re)) {
            struct room_ev e = *re;
            pthread_mutex_unlock(&g_wmu);
            die("room %" PRIu64 " not %s after %d ms (watch saw: completed %d, aborting %d, "
                "aborted %d, %u leases released)",
                id, what, ROOM_WAIT_MS, e.completed_ns != 0, e.aborting_ns != 0, e.aborted_ns != 0,
                e.releases);
        }
    }
    struct room_ev e = *re;
    pthread_mutex_unlock(&g_wmu);
    return e;
}

static bool is_completed(const struct room_ev *e)
{
    return e->completed_ns != 0;
}

static bool is_aborted(const struct room_ev *e)
{
    return e->aborted_ns != 0;
}

static bool is_released(const struct room_ev *e)
{
    return e->releases >= 2;
}

/* A room of 1 source on n1 (pages [sfirst, sfirst + count) of pool 1) and 1
 * sink on n2 (the same pages of pool 2), ACTIVE and known to both nodes. */
static kvf_room_key room_open(uint32_t first, uint32_t count)
{
    /* Room events live in a ring of MAX_ROOMS slots: far more than rooms in
     * flight at once (one per thread), so a slot is free when reused. */
    uint64_t id = atomic_fetch_add(&g_next_room, 1);
    pthread_mutex_lock(&g_wmu);
    g_rooms[id % MAX_ROOMS] = (struct room_ev){0};
    pthread_mutex_unlock(&g_wmu);
    struct joined a = join(id, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, g_p1.pool_id, first, count);
    struct joined b = join(id, "n2", KVFENCE__V1__ROLE__ROLE_SINK, g_p2.pool_id, first, count);
    if (a.key.generation != b.key.generation ||
        b.state != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE)
        die("room %" PRIu64 ": joins disagree or the room is not ACTIVE (%d)", id, b.state);
    wait_node_knows(&g_n2, b.key);
    wait_node_knows(&g_n1, b.key);
    return b.key;
}

/* ---- data patterns ----------------------------------------------------------------- */

static void fill(uint8_t *mem, size_t bytes, uint64_t seed)
{
    uint64_t *w = (uint64_t *)mem;
    for (size_t i = 0; i < bytes / 8; i++)
        w[i] = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
}

/* Byte-exact: the sink's [off, off + bytes) equals the source's. */
static void check_same(size_t off, size_t bytes, const char *what)
{
    if (memcmp(g_p1.mem + off, g_p2.mem + off, bytes) == 0)
        return;
    for (size_t i = 0; i < bytes; i++)
        if (g_p1.mem[off + i] != g_p2.mem[off + i])
            die("%s: sink byte %zu is 0x%02x, source 0x%02x", what, off + i, g_p2.mem[off + i],
                g_p1.mem[off + i]);
}

struct ops_thread {
    pthread_t th;
    kvf_room_key key;
    uint32_t first, count, chunk_pages;
    uint64_t t0, t_end_submit;
    pthread_barrier_t *bar;
};

static void *ops_main(void *arg)
{
    struct ops_thread *o = arg;
    pthread_barrier_wait(o->bar);
    o->t0 = now_ns();
    uint64_t seq = 0;
    if (!g_unary) {
        /* One stream per room, up to g_window requests outstanding. */
        struct kvf_rpc_client_stream *cs =
            kvf_rpc_client_stream_open(g_n1.local, M_STREAM, KVF_RPC_NO_TIMEOUT);
        if (!cs)
            die("SubmitChunks: cannot open the stream");
        uint64_t acked = 0;
        for (uint32_t p = 0; p < o->count && !atomic_load(&g_failed); p += o->chunk_pages) {
            uint32_t n = o->count - p < o->chunk_pages ? o->count - p : o->chunk_pages;
            if (seq - acked >= (uint64_t)g_window)
                stream_result(cs, o->key, ++acked);
            uint8_t buf[256];
            size_t len = pack_submit(buf, o->key, 0, ++seq, o->first + p, o->first + p, n,
                                     p + n == o->count);
            if (kvf_rpc_client_stream_send(cs, buf, len) != 0)
                die("SubmitChunks of room %" PRIu64 ": send of chunk %" PRIu64 " failed",
                    o->key.room_id, seq);
        }
        (void)kvf_rpc_client_stream_half_close(cs);
        while (acked < seq)
            stream_result(cs, o->key, ++acked);
        struct kvf_rpc_status st;
        uint8_t *msg = NULL;
        size_t len = 0;
        int rc = kvf_rpc_client_stream_recv(cs, CALL_MS, &msg, &len, &st);
        free(msg);
        if (rc != KVF_RPC_STREAM_END || st.code != KVF_GRPC_OK)
            die("SubmitChunks of room %" PRIu64 ": end %d %s", o->key.room_id, rc,
                rc == KVF_RPC_STREAM_END ? st.message : "(a result too many)");
        kvf_rpc_client_stream_close(cs);
        o->t_end_submit = now_ns();
        return NULL;
    }
    for (uint32_t p = 0; p < o->count && !atomic_load(&g_failed); p += o->chunk_pages) {
        uint32_t n = o->count - p < o->chunk_pages ? o->count - p : o->chunk_pages;
        struct kvf_rpc_status st;
        int code =
            submit(&g_n1, o->key, 0, ++seq, o->first + p, o->first + p, n, p + n == o->count, &st);
        if (code != KVF_GRPC_OK)
            die("SubmitChunk %" PRIu64 " of room %" PRIu64 ": %s: %s", seq, o->key.room_id,
                kvf_grpc_code_name(code), st.message);
    }
    o->t_end_submit = now_ns();
    return NULL;
}

/* Runs `nt` rooms side by side, a thread each, room t over pages [t * per,
 * (t + 1) * per) in chunks of `cp` pages. Returns the time from the first
 * submit until the last room was seen COMPLETED; *sub_ns: until the last
 * submit returned. */
static uint64_t run_rooms(int nt, uint32_t per, uint32_t cp, uint64_t *sub_ns)
{
    struct ops_thread th[MAX_THREADS];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)nt);
    for (int t = 0; t < nt; t++) {
        th[t] = (struct ops_thread){
            .first = (uint32_t)t * per, .count = per, .chunk_pages = cp, .bar = &bar};
        th[t].key = room_open(th[t].first, per);
    }
    for (int t = 0; t < nt; t++)
        if (pthread_create(&th[t].th, NULL, ops_main, &th[t]) != 0)
            die("pthread_create failed");
    uint64_t t0 = UINT64_MAX, t_done = 0, t_sub = 0;
    for (int t = 0; t < nt; t++) {
        pthread_join(th[t].th, NULL);
        t0 = th[t].t0 < t0 ? th[t].t0 : t0;
        t_sub = th[t].t_end_submit > t_sub ? th[t].t_end_submit : t_sub;
    }
    for (int t = 0; t < nt; t++) {
        struct room_ev e = wait_room(th[t].key.room_id, is_completed, "COMPLETED");
        t_done = e.completed_ns > t_done ? e.completed_ns : t_done;
    }
    pthread_barrier_destroy(&bar);
    *sub_ns = t_sub - t0;
    return t_done - t0;
}

/* ---- 1: throughput --------------------------------------------------------------- */

/* The plain stream: this process send()s `total` bytes from pool 1 in
 * `chunk`-sized calls on one loopback TCP connection; a forked child recv()s
 * them into pool 2 (chunk-sized calls) and answers one byte. Bytes/s from the
 * first send (the connection up, the reader's pages faulted in) to the
 * answer. */
static double run_plain(size_t chunk, size_t total)
{
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t slen = sizeof sa;
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 1) != 0 ||
        getsockname(lfd, (struct sockaddr *)&sa, &slen) != 0)
        die("plain: listen: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
        die("fork: %s", strerror(errno));
    if (pid == 0) {
        /* A forked child maps the shared pool afresh: fault its pages in
         * before the clock starts (the nodes mapped theirs long ago). */
        for (size_t off = 0; off < total; off += PAGE)
            ((volatile uint8_t *)g_p2.mem)[off] = 0;
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0)
            _exit(2);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char ready = 'r';
        if (send(fd, &ready, 1, MSG_NOSIGNAL) != 1)
            _exit(5);
        size_t got = 0;
        while (got < total) {
            size_t want = total - got < chunk ? total - got : chunk;
            ssize_t n = recv(fd, g_p2.mem + got, want, 0);
            if (n <= 0)
                _exit(3);
            got += (size_t)n;
        }
        char ack = 'k';
        if (send(fd, &ack, 1, MSG_NOSIGNAL) != 1)
            _exit(4);
        close(fd);
        _exit(0);
    }
    close(lfd);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
        die("plain: connect: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char ready;
    if (recv(fd, &ready, 1, 0) != 1)
        die("plain: the reader never said ready");
    uint64_t t0 = now_ns();
    for (size_t off = 0; off < total; off += chunk) {
        size_t n = total - off < chunk ? total - off : chunk;
        size_t sent = 0;
        while (sent < n) {
            ssize_t r = send(fd, g_p1.mem + off + sent, n - sent, MSG_NOSIGNAL);
            if (r <= 0)
                die("plain: send: %s", strerror(errno));
            sent += (size_t)r;
        }
    }
    char ack;
    if (recv(fd, &ack, 1, 0) != 1)
        die("plain: no answer from the reader");
    uint64_t dt = now_ns() - t0;
    close(fd);
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        die("plain: reader exited with status 0x%x", st);
    return (double)total / ((double)dt / 1e9);
}

/* The node: `rooms` rooms side by side (1: one room over [0, total) on both
 * pools), chunks of `chunk` submitted in sequence per room (a SubmitChunk
 * returns once its frames are posted). Bytes/s from the first submit until
 * the watch sees the last room COMPLETED. */
static double run_node(size_t chunk, size_t total, int rooms, double *submit_s)
{
    uint32_t per = (uint32_t)(total / PAGE / (size_t)rooms);
    uint64_t sub_ns, dt = run_rooms(rooms, per, (uint32_t)(chunk / PAGE), &sub_ns);
    *submit_s = (double)sub_ns / 1e9;
    return (double)per * (size_t)rooms * PAGE / ((double)dt / 1e9);
}

static void bench_tput(size_t mib, int reps, int rooms)
{
    size_t total = mib << 20;
    if (total > POOL_BYTES)
        die("--mib: at most %zu", POOL_BYTES >> 20);
    printf("\n[1] throughput n1 -> n2, %zu MiB per run in %d room(s) side by side, %d reps "
           "(median), one plain stream measured in the same rep\n",
           mib, rooms, reps);
    printf("%-7s %4s %11s %11s %8s %12s\n", "chunk", "rep", "plain GB/s", "node GB/s", "ratio",
           "submits s");
    const size_t chunks[] = {64u * 1024u, 1024u * 1024u};
    for (size_t c = 0; c < 2; c++) {
        double plain[64], node[64], ratio[64];
        for (int r = 0; r < reps; r++) {
            uint64_t seed = ((uint64_t)c << 32) | (uint64_t)(r + 1);
            /* Alternate the order so neither side always runs second. */
            double sub_s = 0;
            for (int side = 0; side < 2; side++) {
                bool do_node = (side == 0) == (r % 2 == 1);
                fill(g_p1.mem, total, seed ^ (do_node ? 0x1111 : 0x2222));
                memset(g_p2.mem, 0, total);
                if (do_node) {
                    node[r] = run_node(chunks[c], total, rooms, &sub_s);
                    check_same(0, total, "node run");
                } else {
                    plain[r] = run_plain(chunks[c], total);
                    check_same(0, total, "plain run");
                }
            }
            ratio[r] = node[r] / plain[r];
            printf("%-7s %4d %11.3f %11.3f %7.1f%% %12.3f\n", c ? "1MiB" : "64KiB", r + 1,
                   plain[r] / 1e9, node[r] / 1e9, 100.0 * ratio[r], sub_s);
            fflush(stdout);
        }
        double mp = pct(plain, (size_t)reps, 50), mn = pct(node, (size_t)reps, 50),
               mr = pct(ratio, (size_t)reps, 50);
        printf("%-7s  med %11.3f %11.3f %7.1f%%   (ratio of medians %.1f%%; target >= 90%%)\n",
               c ? "1MiB" : "64KiB", mp / 1e9, mn / 1e9, 100.0 * mr, 100.0 * mn / mp);
    }
}

/* ---- 2: abort -> drained ------------------------------------------------------------ */

static void bench_abort(int reps)
{
    printf("\n[2] AbortRoom -> both leases RELEASED (watch receipt time), one SubmitChunk of N "
           "frames of 256 KiB just before, %d reps\n",
           reps);
    printf("%5s %9s %9s %9s %9s %14s %14s %8s\n", "N", "p50 ms", "p99 ms", "max ms", "->ABORTED",
           "unlanded@abort", "landed after", "AB first");
    const uint32_t ns[] = {1, 16, 256};
    for (size_t c = 0; c < 3; c++) {
        uint32_t n = ns[c];
        uint32_t frames_pages = n * FRAME_PAGES;
        /* One frame more in the lease than is sent: the sink never completes. */
        uint32_t lease = frames_pages + FRAME_PAGES;
        size_t lease_bytes = (size_t)lease * PAGE;
        double *lat = calloc((size_t)reps, sizeof *lat);
        double *lat_ab = calloc((size_t)reps, sizeof *lat_ab);
        double *unl = calloc((size_t)reps, sizeof *unl);
        double *landed = calloc((size_t)reps, sizeof *landed);
        int aborted_first = 0;
        if (!lat || !lat_ab || !unl || !landed)
            die("out of memory");
        for (int r = 0; r < reps; r++) {
            uint64_t seed = 0xab0000ull + ((uint64_t)c << 16) + (uint64_t)r;
            fill(g_p1.mem, lease_bytes + (size_t)FRAME_PAGES * PAGE, seed);
            memset(g_p2.mem, 0, lease_bytes + (size_t)FRAME_PAGES * PAGE);
            kvf_room_key k = room_open(0, lease);
            struct kvf_rpc_status st;
            int code = submit(&g_n1, k, 0, 1, 0, 0, frames_pages, false, &st);
            if (code != KVF_GRPC_OK)
                die("SubmitChunk (N=%u): %s: %s", n, kvf_grpc_code_name(code), st.message);
            /* Frames not all landed yet: an upper bound of those in flight. */
            uint32_t unlanded = 0;
            for (uint32_t f = 0; f < n; f++) {
                size_t last = ((size_t)(f + 1) * FRAME_PAGES * PAGE) - 1;
                if (g_p2.mem[last] != g_p1.mem[last])
                    unlanded++;
            }
            Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
            rk.room_id = k.room_id;
            rk.generation = k.generation;
            Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
            req.room = &rk;
            req.detail = (char *)"bench";
            uint64_t t0 = now_ns();
            code = call(g_ch, M_ABORT, &req.base, NULL, NULL, &st);
            if (code != KVF_GRPC_OK)
                die("AbortRoom: %s: %s", kvf_grpc_code_name(code), st.message);
            struct room_ev e = wait_room(k.room_id, is_released, "RELEASED (2 leases)");
            lat[r] = (double)(e.last_release_ns - t0) / 1e6;
            /* The room's ABORTED event: before or after the releases. */
            e = wait_room(k.room_id, is_aborted, "ABORTED");
            lat_ab[r] = (double)(e.aborted_ns - t0) / 1e6;
            if (e.aborted_ns < e.last_release_ns)
                aborted_first++;
            unl[r] = unlanded;
            /* Each frame landed whole or not at all; nothing past the frames sent. */
            uint32_t got = 0;
            for (uint32_t f = 0; f < n; f++) {
                size_t off = (size_t)f * FRAME_PAGES * PAGE, len = (size_t)FRAME_PAGES * PAGE;
                if (memcmp(g_p2.mem + off, g_p1.mem + off, len) == 0) {
                    got++;
                    continue;
                }
                for (size_t i = 0; i < len; i++)
                    if (g_p2.mem[off + i] != 0)
                        die("abort N=%u rep %d: frame %u landed in part (byte %zu)", n, r, f,
                            off + i);
            }
            for (size_t i = (size_t)frames_pages * PAGE;
                 i < lease_bytes + (size_t)FRAME_PAGES * PAGE; i++)
                if (g_p2.mem[i] != 0)
                    die("abort N=%u: byte %zu past the frames sent was written", n, i);
            landed[r] = got;
        }
        double *ab = lat_ab;
        printf("%5u %9.3f %9.3f %9.3f %9.3f %14.1f %14.1f %5d/%d\n", n, pct(lat, (size_t)reps, 50),
               pct(lat, (size_t)reps, 99), pct(lat, (size_t)reps, 100), pct(ab, (size_t)reps, 50),
               pct(unl, (size_t)reps, 50), pct(landed, (size_t)reps, 50), aborted_first, reps);
        fflush(stdout);
        free(lat);
        free(lat_ab);
        free(unl);
        free(landed);
    }
    printf("  (ms from the AbortRoom call to the receipt of the 2nd lease's RELEASED event on "
           "the watch;\n   ->ABORTED: p50 to the room's ABORTED event; unlanded@abort: median "
           "frames not fully in the sink\n   when AbortRoom was sent, an upper bound of those in "
           "flight; landed after: median frames in the sink;\n   AB first: reps where the "
           "room's ABORTED event came before its last lease's RELEASED)\n");
}

/* ---- 3: ops/s ------------------------------------------------------------------------- */

static void bench_ops(uint32_t ops, int max_threads, int reps)
{
    printf("\n[3] chunks of 1 page (4 KiB, one frame) end to end: %u ops per run, a room per "
           "thread, %d reps (median)\n",
           ops, reps);
    printf("%7s %12s %14s %14s\n", "threads", "ops/s", "submit-only/s", "us per op");
    for (int nt = 1; nt <= max_threads; nt *= 2) {
        uint32_t per = ops / (uint32_t)nt;
        if ((uint64_t)per * (uint32_t)nt > POOL_PAGES)
            die("--ops: at most %u", POOL_PAGES);
        double *rate = calloc((size_t)reps, sizeof *rate),
               *srate = calloc((size_t)reps, sizeof *srate);
        if (!rate || !srate)
            die("out of memory");
        for (int r = 0; r < reps; r++) {
            size_t bytes = (size_t)per * (uint32_t)nt * PAGE;
            fill(g_p1.mem, bytes, 0x5000ull + (uint64_t)(nt * 100 + r));
            memset(g_p2.mem, 0, bytes);
            uint64_t sub_ns, dt = run_rooms(nt, per, 1, &sub_ns);
            check_same(0, bytes, "ops run");
            double total = (double)per * nt;
            rate[r] = total / ((double)dt / 1e9);
            srate[r] = total / ((double)sub_ns / 1e9);
        }
        double m = pct(rate, (size_t)reps, 50);
        printf("%7d %12.0f %14.0f %14.1f\n", nt, m, pct(srate, (size_t)reps, 50), 1e6 / m);
        fflush(stdout);
        free(rate);
        free(srate);
    }
}

/* ---- 4: memory over many rooms ---------------------------------------------------- */

/* VmRSS of a process in KiB, from /proc; -1 when unreadable. */
static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long kib = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

struct rss_thread {
    pthread_t th;
    uint32_t page; /* this thread's page in both pools */
    uint64_t rooms;
};

static atomic_uint_fast64_t g_rooms_done;

/* Rooms one after another on one page: open (both nodes know it), one
 * chunk of one page with last_chunk, COMPLETED, both leases RELEASED (only
 * then may the next room lease the page), the sink page checked. */
static void *rss_main(void *arg)
{
    struct rss_thread *o = arg;
    for (uint64_t i = 0; i < o->rooms && !atomic_load(&g_failed); i++) {
        kvf_room_key k = room_open(o->page, 1);
        fill(g_p1.mem + (size_t)o->page * PAGE, PAGE, k.room_id);
        struct kvf_rpc_status st;
        int code = submit(&g_n1, k, 0, 1, o->page, o->page, 1, true, &st);
        if (code != KVF_GRPC_OK)
            die("SubmitChunk of room %" PRIu64 ": %s: %s", k.room_id, kvf_grpc_code_name(code),
                st.message);
        (void)wait_room(k.room_id, is_completed, "COMPLETED");
        (void)wait_room(k.room_id, is_released, "RELEASED");
        check_same((size_t)o->page * PAGE, PAGE, "rss run");
        atomic_fetch_add(&g_rooms_done, 1);
    }
    return NULL;
}

/* Node memory over `total` rooms from `nt` threads: both nodes' RSS at every
 * tenth of the run. The node keeps terminal rooms for a bounded count
 * (--retain-rooms) and frees them, so after the warm-up RSS must stay flat. */
static void bench_rss(uint64_t total, int nt)
{
    printf("\n[4] node RSS over %" PRIu64 " rooms (1 page each, %d threads, rooms one after "
           "another per thread)\n",
           total, nt);
    printf("%10s %10s %12s %12s %10s\n", "rooms", "seconds", "n1 RSS MiB", "n2 RSS MiB", "rooms/s");
    struct rss_thread th[MAX_THREADS];
    uint64_t t0 = now_ns();
    printf("%10d %10.1f %12.1f %12.1f %10s\n", 0, 0.0, rss_kib(g_n1.pid) / 1024.0,
           rss_kib(g_n2.pid) / 1024.0, "-");
    for (int t = 0; t < nt; t++) {
        th[t] = (struct rss_thread){.page = (uint32_t)t,
                                    .rooms = total / (uint64_t)nt +
                                             ((uint64_t)t < total % (uint64_t)nt ? 1 : 0)};
        if (pthread_create(&th[t].th, NULL, rss_main, &th[t]) != 0)
            die("pthread_create failed");
    }
    uint64_t step = total / 10 ? total / 10 : 1, next = step, last_n = 0, last_t = t0;
    while (next <= total) {
        uint64_t done = atomic_load(&g_rooms_done);
        if (done < next) {
            sleep_ms(20);
            continue;
        }
        uint64_t t = now_ns();
        printf("%10" PRIu64 " %10.1f %12.1f %12.1f %10.0f\n", done, (double)(t - t0) / 1e9,
               rss_kib(g_n1.pid) / 1024.0, rss_kib(g_n2.pid) / 1024.0,
               (double)(done - last_n) / ((double)(t - last_t) / 1e9));
        fflush(stdout);
        last_n = done;
        last_t = t;
        next += step;
    }
    for (int t = 0; t < nt; t++)
        pthread_join(th[t].th, NULL);
}

/* Latency floors of one SubmitChunk call (1 thread): refused by n1's gRPC
 * handler itself (chunk_seq 0: INVALID_ARGUMENT, no owner thread), and
 * refused by the owner thread after the room lookup (a source rank with no
 * lease: FAILED_PRECONDITION). */
static void bench_call_floor(int calls)
{
    kvf_room_key k = room_open(0, 1);
    const struct {
        const char *what;
        uint64_t seq;
        int want;
    } kinds[] = {
        {"refused by the gRPC handler (INVALID_ARGUMENT)", 0, KVF_GRPC_INVALID_ARGUMENT},
        {"refused by the owner thread (FAILED_PRECONDITION)", 1, KVF_GRPC_FAILED_PRECONDITION},
    };
    double *v = calloc((size_t)calls, sizeof *v);
    if (!v)
        die("out of memory");
    printf("\n    one SubmitChunk call, %d calls, 1 thread: p50 / p99 us\n", calls);
    for (int c = 0; c < 200; c++) { /* warm up */
        struct kvf_rpc_status st;
        (void)submit(&g_n1, k, 99, 1, 0, 0, 1, false, &st);
    }
    for (size_t i = 0; i < 2; i++) {
        for (int c = 0; c < calls; c++) {
            struct kvf_rpc_status st;
            uint64_t t0 = now_ns();
            int code = submit(&g_n1, k, 99, kinds[i].seq, 0, 0, 1, false, &st);
            v[c] = (double)(now_ns() - t0) / 1e3;
            if (code != kinds[i].want)
                die("%s: got %s: %s", kinds[i].what, kvf_grpc_code_name(code), st.message);
        }
        printf("    %-52s %8.1f / %8.1f\n", kinds[i].what, pct(v, (size_t)calls, 50),
               pct(v, (size_t)calls, 99));
    }
    free(v);
}

/* ---- main ------------------------------------------------------------------------------ */

static void cleanup(void)
{
    shm_destroy(&g_p1);
    shm_destroy(&g_p2);
}

int main(int argc, char **argv)
{
    size_t mib = 256;
    int reps = 5, abort_reps = 50, max_threads = 4, tput_rooms = 1;
    uint32_t ops = 20000;
    uint64_t rss_rooms = 100000;
    const char *only = NULL;
    for (int i = 1; i < argc; i += 2) { /* "--name value" pairs */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v)
            goto usage;
        if (strcmp(a, "--mib") == 0)
            mib = strtoull(v, NULL, 10);
        else if (strcmp(a, "--reps") == 0)
            reps = atoi(v);
        else if (strcmp(a, "--abort-reps") == 0)
            abort_reps = atoi(v);
        else if (strcmp(a, "--ops") == 0)
            ops = (uint32_t)strtoul(v, NULL, 10);
        else if (strcmp(a, "--rooms") == 0)
            tput_rooms = atoi(v);
        else if (strcmp(a, "--rss-rooms") == 0)
            rss_rooms = strtoull(v, NULL, 10);
        else if (strcmp(a, "--threads") == 0)
            max_threads = atoi(v);
        else if (strcmp(a, "--only") == 0)
            only = v;
        else if (strcmp(a, "--submit") == 0 &&
                 (strcmp(v, "stream") == 0 || strcmp(v, "unary") == 0))
            g_unary = strcmp(v, "unary") == 0;
        else if (strcmp(a, "--window") == 0)
            g_window = atoi(v);
        else if (strcmp(a, "--control") == 0)
            g_control_bin = v;
        else if (strcmp(a, "--node") == 0)
            g_node_bin = v;
        else
            goto usage;
    }
    if (mib == 0 || reps <= 0 || reps > 64 || abort_reps <= 0 || ops == 0 || max_threads <= 0 ||
        rss_rooms == 0 || max_threads > MAX_THREADS || tput_rooms <= 0 ||
        tput_rooms > MAX_THREADS || g_window <= 0 || g_window > 64)
        goto usage;
    signal(SIGPIPE, SIG_IGN);

    snprintf(g_dir, sizeof g_dir, "/tmp/kvf-bench-node-XXXXXX");
    if (!mkdtemp(g_dir))
        die("mkdtemp: %s", strerror(errno));
    char log[128];
    snprintf(log, sizeof log, "%s/control.log", g_dir);
    if (with_stderr_to(log, start_cp, NULL) != 0)
        die("kvfence-control did not start (%s)", g_control_bin);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    g_ch = kvf_rpc_channel_create(g_cp.target, &co);
    if (!g_ch)
        die("no channel to %s", g_cp.target);
    snprintf(g_n1.id, sizeof g_n1.id, "n1");
    snprintf(g_n2.id, sizeof g_n2.id, "n2");
    snprintf(log, sizeof log, "%s/n1.log", g_dir);
    if (with_stderr_to(log, start_node, &g_n1) != 0)
        die("kvfence-node n1 did not start (%s)", g_node_bin);
    snprintf(log, sizeof log, "%s/n2.log", g_dir);
    if (with_stderr_to(log, start_node, &g_n2) != 0)
        die("kvfence-node n2 did not start (%s)", g_node_bin);
    atexit(cleanup);
    shm_create(&g_p1, "n1");
    shm_create(&g_p2, "n2");
    g_p1.pool_id = register_pool(&g_n1, &g_p1);
    g_p2.pool_id = register_pool(&g_n2, &g_p2);
    watch_open();
    printf("bench_node: kvfence-control %s, kvfence-node n1 + n2, pools of %u x %u B in shm\n",
           g_cp.target, POOL_PAGES, PAGE);
    if (g_unary)
        printf("submit: unary SubmitChunk calls, one at a time per room\n");
    else
        printf("submit: one SubmitChunks stream per room, up to %d requests outstanding\n",
               g_window);

    if (!only || strcmp(only, "tput") == 0)
        bench_tput(mib, reps, tput_rooms);
    if (!only || strcmp(only, "abort") == 0)
        bench_abort(abort_reps);
    if (!only || strcmp(only, "ops") == 0) {
        bench_ops(ops, max_threads, reps);
        bench_call_floor(2000);
    }
    if (only && strcmp(only, "rss") == 0) /* long: only when asked for */
        bench_rss(rss_rooms, max_threads);

    /* Teardown: the daemons must stop cleanly (exit 0 on SIGTERM). */
    atomic_store(&g_stop, true);
    kvf_rpc_client_stream_cancel(g_watch);
    pthread_join(g_watch_th, NULL);
    kvf_rpc_client_stream_close(g_watch);
    int s1 = stop_node(&g_n1), s2 = stop_node(&g_n2);
    kvf_rpc_channel_destroy(g_ch);
    int sc = kvf_proc_stop(&g_cp, 10000);
    if (s1 < 0 || !WIFEXITED(s1) || WEXITSTATUS(s1) != 0 || s2 < 0 || !WIFEXITED(s2) ||
        WEXITSTATUS(s2) != 0 || sc < 0 || !WIFEXITED(sc) || WEXITSTATUS(sc) != 0)
        die("a daemon did not exit 0 on SIGTERM (n1 0x%x, n2 0x%x, control 0x%x)", s1, s2, sc);
    char path[160];
    const char *files[] = {"control.log", "n1.log", "n2.log", "n1.port", "n2.port"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", g_dir, files[i]);
        unlink(path);
    }
    rmdir(g_dir);
    g_dir[0] = '\0';
    return 0;

usage:
    fprintf(stderr, "usage: bench_node [--mib N<=256] [--reps R<=64] [--abort-reps R] [--ops N] "
                    "[--threads T<=16] [--rooms R<=16] [--only tput|abort|ops|rss] [--rss-rooms N] "
                    "[--submit stream|unary] "
                    "[--window W<=64] [--control BIN] [--node BIN]\n");
    return 2;
}
