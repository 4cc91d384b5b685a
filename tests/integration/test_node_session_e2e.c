/*
 * test_node_session_e2e.c: kvfence-node's session with kvfence-control, end
 * to end with real processes. Each test starts one kvfence-control
 * (kvf_proc.c) and two kvfence-node processes (n1, n2) on 127.0.0.1, plays
 * the engine in this process (POSIX shm pools with canary patterns, NodeLocal
 * and Control calls) and follows the control plane's view with Admin.GetRoom
 * and Admin.GetNode:
 *  - Resync after a durable control plane is killed and restarted on the same
 *    port and data directory: a pool unregistered while it was down is gone
 *    from its view (only the Resync says so), and the room goes on;
 *  - self-fencing: the control plane stopped (SIGSTOP) past node_ttl, or the
 *    node itself stopped past it (the control plane declares it LOST and
 *    refuses the old incarnation): the node closes its rooms, refuses
 *    SubmitChunk, and comes back as a new incarnation that works;
 *  - UnregisterPool: NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION while a
 *    lease uses the pool, then removal seen by the control plane;
 *  - page-size mismatch refused; a lease version newer than the node's copy
 *    answered UNAVAILABLE.
 * Waits are on observed state with timeouts. Teardown stops every process
 * (the nodes and the control plane must exit 0 on SIGTERM) and unlinks the
 * shm objects.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvf_types.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"

#define CALL_TIMEOUT_MS 5000
#define WAIT_MS         15000
#define PAGE_SIZE       4096u
#define PAGE_COUNT      64u
#define NODE_TTL_MS     1500
/* The node self-fences after node_ttl minus a fifth of silence; its last word
 * came up to a heartbeat interval (a fifth) before the cut: at the earliest
 * 3/5 of node_ttl after the cut (less 100 ms of slack). */
#define SELF_FENCE_MIN_MS (NODE_TTL_MS * 3 / 5 - 100)

/* ---- a kvfence-node child ----------------------------------------------------- */

struct node_proc {
    pid_t pid;
    char id[16];
    char sock[160];
    char port_file[160];
    struct kvf_rpc_channel *local; /* NodeLocal */
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Starts kvfence-node `id` against `control`; waits up to 10 s for its port
 * file (written once the control plane welcomed it). 0 or -1. */
static int node_start(struct node_proc *np, const char *dir, const char *id, const char *control)
{
    memset(np, 0, sizeof *np);
    snprintf(np->id, sizeof np->id, "%s", id);
    snprintf(np->sock, sizeof np->sock, "%s/%s.sock", dir, id);
    snprintf(np->port_file, sizeof np->port_file, "%s/%s.port", dir, id);
    pid_t parent = getpid();
    np->pid = fork();
    if (np->pid < 0) {
        np->pid = 0;
        return -1;
    }
    if (np->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        execl(KVF_NODE_BIN, KVF_NODE_BIN, "--control", control, "--node-id", id, "--local-socket",
              np->sock, "--port-file", np->port_file, "--data-host", "127.0.0.1", "--data-port",
              "0", "--drain-timeout-ms", "3000", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 1000; i++) {
        if (access(np->port_file, R_OK) == 0) {
            char target[200];
            snprintf(target, sizeof target, "unix:%s", np->sock);
            np->local = kvf_rpc_channel_create(target, NULL);
            return np->local ? 0 : -1;
        }
        int st;
        if (waitpid(np->pid, &st, WNOHANG) == np->pid) {
            fprintf(stderr, "kvfence-node %s exited early (0x%x)\n", id, st);
            np->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "kvfence-node %s: no port file after 10 s\n", id);
    return -1;
}

/* SIGTERM, wait up to `ms`, then SIGKILL. Returns the wait status, -1 if none. */
static int node_stop(struct node_proc *np, long ms)
{
    kvf_rpc_channel_destroy(np->local);
    np->local = NULL;
    if (np->pid <= 0)
        return -1;
    int st = -1;
    kill(np->pid, SIGCONT);
    kill(np->pid, SIGTERM);
    int64_t end = now_ms() + ms;
    while (now_ms() < end) {
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

/* ---- fixture ------------------------------------------------------------------ */

struct shm_pool {
    char name[64];
    uint8_t *mem;
    uint32_t pool_id;
};

struct fx {
    struct kvf_proc cp;
    char cp_port[16];
    char data_dir[96]; /* durable tests */
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct node_proc n1, n2;
    struct shm_pool p1, p2, p3;
};

static uint8_t canary1(uint32_t page, uint32_t i)
{
    return (uint8_t)(page * 31u + i * 7u + 1u);
}

static uint8_t canary2(uint32_t page, uint32_t i)
{
    return (uint8_t)(0xa5u ^ page ^ (i >> 3));
}

static int shm_create(struct shm_pool *p, const char *tag, uint8_t (*fill)(uint32_t, uint32_t))
{
    snprintf(p->name, sizeof p->name, "/kvf-se2e-%d-%s", (int)getpid(), tag);
    int fd = shm_open(p->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return -1;
    size_t len = (size_t)PAGE_SIZE * PAGE_COUNT;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        return -1;
    }
    p->mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p->mem == MAP_FAILED) {
        p->mem = NULL;
        return -1;
    }
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
        for (uint32_t i = 0; i < PAGE_SIZE; i++)
            p->mem[(size_t)pg * PAGE_SIZE + i] = fill(pg, i);
    return 0;
}

static void shm_destroy(struct shm_pool *p)
{
    if (p->mem)
        munmap(p->mem, (size_t)PAGE_SIZE * PAGE_COUNT);
    p->mem = NULL;
    if (p->name[0])
        shm_unlink(p->name);
    p->name[0] = '\0';
}

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    *state = f;
    return 0;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static int teardown(void **state)
{
    struct fx *f = *state;
    int rc = 0;
    if (f->cp.pid > 0)
        kill(f->cp.pid, SIGCONT); /* a test may have stopped it */
    struct node_proc *nodes[2] = {&f->n1, &f->n2};
    for (int i = 0; i < 2; i++) {
        if (nodes[i]->pid <= 0) {
            kvf_rpc_channel_destroy(nodes[i]->local);
            nodes[i]->local = NULL;
            continue;
        }
        int st = node_stop(nodes[i], 8000);
        if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "kvfence-node %s did not exit 0 on SIGTERM (status %d)\n", nodes[i]->id,
                    st);
            rc = -1;
        }
    }
    kvf_rpc_channel_destroy(f->ch);
    if (f->cp.pid > 0) {
        int st = kvf_proc_stop(&f->cp, 10000);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "kvfence-control did not exit 0 on SIGTERM (0x%x)\n", st);
            rc = -1;
        }
    }
    kvf_proc_kill(&f->cp);
    shm_destroy(&f->p1);
    shm_destroy(&f->p2);
    shm_destroy(&f->p3);
    if (f->dir[0])
        nftw(f->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(f);
    return rc;
}

/* ---- RPC helpers ------------------------------------------------------------- */

/* One unary call; returns the status code, *resp_p (free it) on OK. */
static int call(struct kvf_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                uint8_t **resp_p, size_t *len_p, struct kvf_rpc_status *st)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    memset(st, 0, sizeof *st);
    int rc = kvf_rpc_unary(ch, method, buf, len, CALL_TIMEOUT_MS, &resp, &rlen, st);
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

static int register_pool_sized(struct node_proc *np, const struct shm_pool *p, uint32_t page_size,
                               uint32_t *id_p, struct kvf_rpc_status *st)
{
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)p->name;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = page_size;
    req.page_count = (uint32_t)(shm.size / page_size);
    uint8_t *resp;
    size_t len;
    int code = call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, &resp, &len, st);
    if (code != KVF_GRPC_OK)
        return code;
    Kvfence__V1__RegisterPoolResponse *r =
        kvfence__v1__register_pool_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(r);
    assert_non_null(r->pool);
    *id_p = r->pool->pool_id;
    kvfence__v1__register_pool_response__free_unpacked(r, NULL);
    return KVF_GRPC_OK;
}

static uint32_t register_pool(struct node_proc *np, const struct shm_pool *p)
{
    uint32_t id = 0;
    struct kvf_rpc_status st;
    int code = register_pool_sized(np, p, PAGE_SIZE, &id, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("RegisterPool on %s: %d %s", np->id, code, st.message);
    return id;
}

static int unregister_pool(struct node_proc *np, uint32_t pool_id, struct kvf_rpc_status *st)
{
    Kvfence__V1__UnregisterPoolRequest req = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    req.pool_id = pool_id;
    return call(np->local, "/kvfence.v1.NodeLocal/UnregisterPool", &req.base, NULL, NULL, st);
}

/* Joins one participant (rank 0); retries while the node's pool is not yet
 * known to the control plane (the PoolUpdate races the engine's JoinRoom).
 * *lease_p gets the lease id when not NULL. */
static kvf_room_key join(struct fx *f, uint64_t room_id, const char *node, int role,
                         uint32_t pool_id, uint32_t first, uint32_t count, uint64_t *lease_p)
{
    static const char *features[] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = (char **)features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)node;
    part.rank = 0;
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
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        uint8_t *resp;
        size_t len;
        struct kvf_rpc_status st;
        int code = call(f->ch, "/kvfence.v1.Control/JoinRoom", &req.base, &resp, &len, &st);
        if (code == KVF_GRPC_OK) {
            Kvfence__V1__JoinRoomResponse *r =
                kvfence__v1__join_room_response__unpack(NULL, len, resp);
            free(resp);
            assert_non_null(r);
            assert_non_null(r->room);
            kvf_room_key k = {r->room->room_id, r->room->generation};
            if (lease_p)
                *lease_p = r->lease_id;
            kvfence__v1__join_room_response__free_unpacked(r, NULL);
            return k;
        }
        if (now_ms() > end)
            fail_msg("JoinRoom %s: %d %s", node, code, st.message);
        sleep_ms(20);
    }
}

/* The room as the control plane sees it (free it). */
static Kvfence__V1__RoomInfo *get_room(struct fx *f, kvf_room_key k)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__GetRoomRequest req = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    req.room = &rk;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = call(f->ch, "/kvfence.v1.Admin/GetRoom", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("GetRoom: %d %s", code, st.message);
    Kvfence__V1__RoomInfo *ri = kvfence__v1__room_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ri);
    return ri;
}

static void wait_room_state(struct fx *f, kvf_room_key k, Kvfence__V1__RoomState want,
                            int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        Kvfence__V1__RoomInfo *ri = get_room(f, k);
        int last = ri->state;
        bool released = true;
        for (size_t i = 0; i < ri->n_participants; i++)
            if (!ri->participants[i]->lease ||
                ri->participants[i]->lease->state != KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED)
                released = false;
        kvfence__v1__room_info__free_unpacked(ri, NULL);
        bool terminal = want == KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED ||
                        want == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED;
        if (last == (int)want && (!terminal || released))
            return;
        if (now_ms() > end)
            fail_msg("room %llu:%llu: state %d (want %d), leases released %d",
                     (unsigned long long)k.room_id, (unsigned long long)k.generation, last,
                     (int)want, released);
        sleep_ms(20);
    }
}

/* The control plane's view of a node (free it); NULL when unknown. */
static Kvfence__V1__NodeInfo *get_node(struct fx *f, const char *id)
{
    Kvfence__V1__GetNodeRequest req = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    req.node_id = (char *)id;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = call(f->ch, "/kvfence.v1.Admin/GetNode", &req.base, &resp, &len, &st);
    if (code == KVF_GRPC_NOT_FOUND || code == KVF_GRPC_UNAVAILABLE ||
        code == KVF_GRPC_DEADLINE_EXCEEDED)
        return NULL;
    if (code != KVF_GRPC_OK)
        fail_msg("GetNode %s: %d %s", id, code, st.message);
    Kvfence__V1__NodeInfo *ni = kvfence__v1__node_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ni);
    return ni;
}

static bool node_has_pool(const Kvfence__V1__NodeInfo *ni, uint32_t pool_id)
{
    for (size_t i = 0; i < ni->n_pools; i++)
        if (ni->pools[i]->pool_id == pool_id)
            return true;
    return false;
}

static uint64_t node_incarnation(struct fx *f, const char *id)
{
    Kvfence__V1__NodeInfo *ni = get_node(f, id);
    assert_non_null(ni);
    uint64_t inc = ni->incarnation;
    kvfence__v1__node_info__free_unpacked(ni, NULL);
    return inc;
}

/* Waits until the control plane sees `id` ATTACHED with an incarnation other
 * than `not_inc` (0: any); returns it. */
static uint64_t wait_node_attached(struct fx *f, const char *id, uint64_t not_inc)
{
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__NodeInfo *ni = get_node(f, id);
        uint64_t inc = 0;
        if (ni && ni->state == KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED &&
            ni->incarnation != not_inc)
            inc = ni->incarnation;
        int s = ni ? (int)ni->state : -1;
        if (ni)
            kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (inc)
            return inc;
        if (now_ms() > end)
            fail_msg("node %s: state %d, not ATTACHED at a new incarnation", id, s);
        sleep_ms(20);
    }
}

/* SubmitChunk of source rank `source_rank` on `np`: n1's pages [sfirst,
 * +count) -> n2's pages [dfirst, +count). Returns the status code. */
static int submit_v(struct fx *f, struct node_proc *np, kvf_room_key k, uint32_t source_rank,
                    uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                    uint64_t source_lease_pages, struct kvf_rpc_status *st)
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
    req.source_pool_id = f->p1.pool_id;
    req.n_source_ranges = 1;
    req.source_ranges = sv;
    req.sink_node_id = (char *)"n2";
    req.sink_rank = 0;
    req.sink_pool_id = f->p2.pool_id;
    req.n_sink_ranges = 1;
    req.sink_ranges = dv;
    req.last_chunk = last;
    req.source_lease_pages = source_lease_pages;
    return call(np->local, "/kvfence.v1.NodeLocal/SubmitChunk", &req.base, NULL, NULL, st);
}

static int submit(struct fx *f, struct node_proc *np, kvf_room_key k, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, bool last, struct kvf_rpc_status *st)
{
    return submit_v(f, np, k, 0, seq, sfirst, dfirst, count, last, 0, st);
}

/* A SubmitChunk naming a source rank in no lease (99): UNAVAILABLE before
 * the node has the room's update, FAILED_PRECONDITION while the room is open
 * on the node, ABORTED once its admission is closed. */
static int probe(struct fx *f, struct node_proc *np, kvf_room_key k, struct kvf_rpc_status *st)
{
    return submit_v(f, np, k, 99, 1, 0, 16, 1, false, 0, st);
}

static void wait_node_knows(struct fx *f, struct node_proc *np, kvf_room_key k)
{
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_rpc_status st;
        int code = probe(f, np, k, &st);
        if (code == KVF_GRPC_FAILED_PRECONDITION)
            return;
        if (code != KVF_GRPC_UNAVAILABLE)
            fail_msg("node %s: unexpected probe answer %d: %s", np->id, code, st.message);
        if (now_ms() > end)
            fail_msg("node %s never got the room update (%d %s)", np->id, code, st.message);
        sleep_ms(10);
    }
}

/* Waits until `np` has closed the room's admission (probe: ABORTED). */
static int64_t wait_node_closed(struct fx *f, struct node_proc *np, kvf_room_key k,
                                int64_t timeout_ms)
{
    int64_t t0 = now_ms(), end = t0 + timeout_ms;
    for (;;) {
        struct kvf_rpc_status st;
        int code = probe(f, np, k, &st);
        if (code == KVF_GRPC_ABORTED)
            return now_ms() - t0;
        if (code != KVF_GRPC_FAILED_PRECONDITION)
            fail_msg("node %s: unexpected probe answer %d: %s", np->id, code, st.message);
        if (now_ms() > end)
            fail_msg("node %s never closed room %llu (%d %s)", np->id,
                     (unsigned long long)k.room_id, code, st.message);
        sleep_ms(10);
    }
}

/* ---- a raw TCP peer (tcp.h wire format) ------------------------------------------ */

/* The id a node incarnation carries in TCP hellos (node.c's tcp_id_of). */
static uint64_t tcp_id(const char *node_id, uint64_t incarnation)
{
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)node_id; *p; p++) {
        h ^= *p;
        h *= 1099511628211ull;
    }
    h ^= incarnation * 0x9e3779b97f4a7c15ull;
    return h ? h : 1;
}

/* The data port a node wrote in its port file. */
static uint16_t node_data_port(const struct node_proc *np)
{
    FILE *fp = fopen(np->port_file, "r");
    assert_non_null(fp);
    unsigned port = 0;
    assert_int_equal(fscanf(fp, "%u", &port), 1);
    fclose(fp);
    return (uint16_t)port;
}

/* Connects to 127.0.0.1:port; -1 (errno set) when refused. */
static int tcp_dial(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void put64(uint8_t *b, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
}

/* Sends the 24-byte hello "from -> to". */
static void tcp_hello(int fd, uint64_t from, uint64_t to)
{
    uint8_t b[24] = {0x4b, 0x56, 0x46, 0x48, 1, 0, 0, 0};
    put64(b + 8, from);
    put64(b + 16, to);
    assert_int_equal(send(fd, b, sizeof b, MSG_NOSIGNAL), (ssize_t)sizeof b);
}

/* True when the peer closed `fd` (EOF or reset) within `ms`. */
static bool tcp_closed_within(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int64_t end = now_ms() + ms;
    for (int64_t left; (left = end - now_ms()) > 0;) {
        int rc = poll(&p, 1, (int)left);
        if (rc > 0) {
            uint8_t c;
            ssize_t got = recv(fd, &c, 1, 0);
            if (got <= 0)
                return true;
        }
    }
    return false;
}

/* Control plane (extra args), two nodes, two pools registered. */
static void fx_start(struct fx *f, bool durable)
{
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-se2e-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%d", durable ? 6000 : NODE_TTL_MS);
    snprintf(f->data_dir, sizeof f->data_dir, "%s/data", f->dir);
    /* A stopped node's stream stays open: heartbeats reveal it. */
    const char *args[] = {"--threads",
                          "2",
                          "--node-ttl-ms",
                          ttl,
                          "--resend-ms",
                          "50",
                          "--heartbeat-timeout-ms",
                          "1000",
                          durable ? "--data-dir" : NULL,
                          f->data_dir,
                          NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    const char *colon = strrchr(f->cp.target, ':');
    assert_non_null(colon);
    snprintf(f->cp_port, sizeof f->cp_port, "%s", colon + 1);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    f->ch = kvf_rpc_channel_create(f->cp.target, &co);
    assert_non_null(f->ch);
    assert_int_equal(node_start(&f->n1, f->dir, "n1", f->cp.target), 0);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", f->cp.target), 0);
    assert_int_equal(shm_create(&f->p1, "n1", canary1), 0);
    assert_int_equal(shm_create(&f->p2, "n2", canary2), 0);
    f->p1.pool_id = register_pool(&f->n1, &f->p1);
    f->p2.pool_id = register_pool(&f->n2, &f->p2);
}

/* Kills the durable control plane and starts it again on the same port and
 * data directory. */
static void cp_restart(struct fx *f)
{
    char listen[48];
    snprintf(listen, sizeof listen, "127.0.0.1:%s", f->cp_port);
    kvf_proc_kill(&f->cp);
    const char *args[] = {"--threads",
                          "2",
                          "--node-ttl-ms",
                          "6000",
                          "--resend-ms",
                          "50",
                          "--heartbeat-timeout-ms",
                          "1000",
                          "--data-dir",
                          f->data_dir,
                          "--listen",
                          listen,
                          NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
}

static kvf_room_key join_pair(struct fx *f, uint64_t room_id)
{
    kvf_room_key k1 =
        join(f, room_id, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    kvf_room_key k2 =
        join(f, room_id, "n2", KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 8, NULL);
    assert_true(k1.room_id == k2.room_id && k1.generation == k2.generation);
    wait_room_state(f, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    return k1;
}

/* n2's pool: pages [16, 24) hold n1's pages [0, 8) when `copied`; every other
 * byte still holds its canary. */
static void check_n2_pool(struct fx *f, bool copied)
{
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        for (uint32_t i = 0; i < PAGE_SIZE; i++) {
            uint8_t got = f->p2.mem[(size_t)pg * PAGE_SIZE + i];
            uint8_t want = canary2(pg, i);
            if (copied && pg >= 16 && pg < 24)
                want = canary1(pg - 16, i);
            if (got != want)
                fail_msg("n2 page %u byte %u: 0x%02x, want 0x%02x", pg, i, got, want);
        }
    }
}

/* ---- tests ----------------------------------------------------------------------- */

/* A durable control plane killed and restarted: the nodes re-attach with the
 * same incarnation, are asked for a Resync (and send one), and the control
 * plane's view follows the node's: a pool unregistered while it was down is
 * gone (a re-attach Hello alone keeps pools it does not name). The room
 * lives on and completes. The Resync was logged: a second restart recovers
 * its effect before any node is back. */
static void test_durable_restart_resync_reconciles_pools_room_goes_on(void **state)
{
    struct fx *f = *state;
    fx_start(f, true);
    assert_int_equal(shm_create(&f->p3, "n1b", canary1), 0);
    f->p3.pool_id = register_pool(&f->n1, &f->p3);
    kvf_room_key k = join_pair(f, 101);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    Kvfence__V1__NodeInfo *ni;
    int64_t end = now_ms() + WAIT_MS;
    for (;;) { /* the PoolUpdate is on its way */
        ni = get_node(f, "n1");
        assert_non_null(ni);
        bool has = node_has_pool(ni, f->p3.pool_id);
        kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (has)
            break;
        if (now_ms() > end)
            fail_msg("the control plane never learnt pool %u", f->p3.pool_id);
        sleep_ms(20);
    }

    kvf_proc_kill(&f->cp);
    struct kvf_rpc_status st;
    assert_int_equal(unregister_pool(&f->n1, f->p3.pool_id, &st), KVF_GRPC_OK);
    cp_restart(f);

    /* Same incarnation (no self-fence: back well within node_ttl), and the
     * pool is gone from the control plane's view once the Resync is in. */
    end = now_ms() + WAIT_MS;
    for (;;) {
        ni = get_node(f, "n1");
        bool done = ni && ni->state == KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED &&
                    !node_has_pool(ni, f->p3.pool_id) && node_has_pool(ni, f->p1.pool_id);
        uint64_t inc = ni ? ni->incarnation : 0;
        if (ni)
            kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (done) {
            assert_int_equal(inc, inc1);
            break;
        }
        if (now_ms() > end)
            fail_msg("n1: pool %u still known to the restarted control plane", f->p3.pool_id);
        sleep_ms(20);
    }
    wait_node_attached(f, "n2", 0);
    /* The room survived the restart on both sides. */
    end = now_ms() + WAIT_MS;
    int code;
    while ((code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st)) == KVF_GRPC_UNAVAILABLE &&
           now_ms() < end)
        sleep_ms(20);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk after the restart: %d %s", code, st.message);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);

    /* The Resync is in the log: a second restart, with the nodes held still
     * so that none re-attaches yet, recovers the pool list without it. */
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    assert_int_equal(kill(f->n2.pid, SIGSTOP), 0);
    cp_restart(f);
    end = now_ms() + WAIT_MS;
    while ((ni = get_node(f, "n1")) == NULL && now_ms() < end)
        sleep_ms(20); /* the channel reconnects */
    assert_non_null(ni);
    assert_int_equal(ni->incarnation, inc1);
    assert_int_equal(ni->state, KVFENCE__V1__NODE_STATE__NODE_STATE_SUSPECT);
    assert_false(node_has_pool(ni, f->p3.pool_id));
    assert_true(node_has_pool(ni, f->p1.pool_id));
    kvfence__v1__node_info__free_unpacked(ni, NULL);
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    assert_int_equal(kill(f->n2.pid, SIGCONT), 0);
    assert_int_equal(wait_node_attached(f, "n1", 0), inc1);
}

/* The control plane stops reading (SIGSTOP) past node_ttl while the nodes
 * hold an ACTIVE room: each node self-fences (its peers, every lifetime), so
 * a TCP peer connected to it is cut off and refused, the room's SubmitChunk
 * is refused and no byte reaches the sink; once the
 * control plane runs again the nodes attach as new incarnations, the old ones
 * are LOST, the room ends ABORTED, and a new room between the new
 * incarnations transfers. */
static void test_stopped_control_plane_nodes_self_fence_and_come_back_new(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    kvf_room_key k = join_pair(f, 202);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    uint64_t inc2 = node_incarnation(f, "n2");
    /* A TCP connection into n2 as its peer n1 (which has not connected yet):
     * accepted while n2 is n2. */
    uint16_t port2 = node_data_port(&f->n2);
    int peer = tcp_dial(port2);
    assert_true(peer >= 0);
    tcp_hello(peer, tcp_id("n1", inc1), tcp_id("n2", inc2));
    assert_false(tcp_closed_within(peer, 300));

    assert_int_equal(kill(f->cp.pid, SIGSTOP), 0);
    int64_t waited = wait_node_closed(f, &f->n1, k, WAIT_MS);
    (void)wait_node_closed(f, &f->n2, k, WAIT_MS);
    /* n2 fenced its peers: the connection is cut, and the old incarnation's
     * data endpoint takes no one. */
    assert_true(tcp_closed_within(peer, WAIT_MS));
    close(peer);
    int again = tcp_dial(port2);
    if (again >= 0) {
        /* The port was taken again (a fixed or reused port): the new
         * incarnation refuses a hello to the old one. */
        tcp_hello(again, tcp_id("n1", inc1), tcp_id("n2", inc2));
        assert_true(tcp_closed_within(again, WAIT_MS));
        close(again);
    }
    /* Driven by node_ttl: not before the node can have been without a word
     * for node_ttl minus its margin (acks come every node_ttl / 5). */
    if (waited < SELF_FENCE_MIN_MS)
        fail_msg("n1 closed the room %lld ms after the stop, node_ttl is %d ms", (long long)waited,
                 NODE_TTL_MS);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_ABORTED)
        fail_msg("SubmitChunk after the self-fence: %d %s", code, st.message);
    assert_int_equal(kill(f->cp.pid, SIGCONT), 0);

    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    uint64_t new2 = wait_node_attached(f, "n2", inc2);
    assert_true(new1 > inc1);
    assert_true(new2 > inc2);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    check_n2_pool(f, false);
    /* The old room stays closed on the node. */
    code = submit(f, &f->n1, k, 2, 0, 16, 8, true, &st);
    assert_int_equal(code, KVF_GRPC_ABORTED);

    /* The new incarnations work: a new room transfers end to end. */
    kvf_room_key k2 = join_pair(f, 203);
    wait_node_knows(f, &f->n1, k2);
    wait_node_knows(f, &f->n2, k2);
    code = submit(f, &f->n1, k2, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk in the new incarnation: %d %s", code, st.message);
    wait_room_state(f, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
}

/* SubmitChunk of n1's source rank 0 (pool p1, pages [0, 8)) to a sink on n1
 * itself (pool p3, pages [16, 24)): the local transport. */
static int submit_local(struct fx *f, kvf_room_key k, uint64_t seq, struct kvf_rpc_status *st)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange s = KVFENCE__V1__PAGE_RANGE__INIT, d = KVFENCE__V1__PAGE_RANGE__INIT;
    s.first = 0;
    s.count = 8;
    d.first = 16;
    d.count = 8;
    Kvfence__V1__PageRange *sv[1] = {&s}, *dv[1] = {&d};
    Kvfence__V1__SubmitChunkRequest req = KVFENCE__V1__SUBMIT_CHUNK_REQUEST__INIT;
    req.room = &rk;
    req.chunk_seq = seq;
    req.source_pool_id = f->p1.pool_id;
    req.n_source_ranges = 1;
    req.source_ranges = sv;
    req.sink_node_id = (char *)"n1";
    req.sink_pool_id = f->p3.pool_id;
    req.n_sink_ranges = 1;
    req.sink_ranges = dv;
    req.last_chunk = true;
    return call(f->n1.local, "/kvfence.v1.NodeLocal/SubmitChunk", &req.base, NULL, NULL, st);
}

/* Same-node rooms across a self-fence: the node's local copies go through a
 * peer index of its own incarnation; the self-fence fences it and renews the
 * local transport, so that a same-node room of the new incarnation transfers
 * (it would be refused as fenced if the new incarnation reused the old,
 * fenced index). */
static void test_self_fence_then_same_node_room_transfers(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    assert_int_equal(shm_create(&f->p3, "n1c", canary2), 0);
    f->p3.pool_id = register_pool(&f->n1, &f->p3);
    kvf_room_key k = join(f, 909, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 909, "n1", KVFENCE__V1__ROLE__ROLE_SINK, f->p3.pool_id, 16, 8, NULL);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    int code = submit_local(f, k, 1, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("same-node SubmitChunk: %d %s", code, st.message);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    uint64_t inc1 = node_incarnation(f, "n1");

    /* An open room with n2 shows when n1 has self-fenced (its probe turns
     * ABORTED). */
    kvf_room_key open_room = join_pair(f, 911);
    wait_node_knows(f, &f->n1, open_room);
    assert_int_equal(kill(f->cp.pid, SIGSTOP), 0);
    (void)wait_node_closed(f, &f->n1, open_room, WAIT_MS);
    assert_int_equal(kill(f->cp.pid, SIGCONT), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);

    /* Fresh canaries in the sink pages, then a same-node room of the new
     * incarnation. */
    for (uint32_t pg = 16; pg < 24; pg++)
        for (uint32_t i = 0; i < PAGE_SIZE; i++)
            f->p3.mem[(size_t)pg * PAGE_SIZE + i] = canary2(pg, i);
    kvf_room_key k3 = join(f, 910, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 910, "n1", KVFENCE__V1__ROLE__ROLE_SINK, f->p3.pool_id, 16, 8, NULL);
    wait_room_state(f, k3, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k3);
    code = submit_local(f, k3, 1, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("same-node SubmitChunk in the new incarnation: %d %s", code, st.message);
    wait_room_state(f, k3, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = 16; pg < 24; pg++)
        for (uint32_t i = 0; i < PAGE_SIZE; i++)
            if (f->p3.mem[(size_t)pg * PAGE_SIZE + i] != canary1(pg - 16, i))
                fail_msg("sink page %u byte %u not copied", pg, i);
}

/* The node itself is stopped past node_ttl: the control plane ends its
 * session (heartbeats stop), declares it LOST after node_ttl and aborts its
 * room. When the node runs again it must not come back as the LOST
 * incarnation (refused with FAILED_PRECONDITION "is LOST"): it self-fences
 * and attaches as a new incarnation, and keeps running. */
static void test_lost_node_comes_back_as_new_incarnation(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    kvf_room_key k = join_pair(f, 303);
    wait_node_knows(f, &f->n1, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    /* LOST: the room aborts and ends once n2 fenced n1. */
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);
    int st_child;
    assert_int_equal(waitpid(f->n1.pid, &st_child, WNOHANG), 0); /* still running */
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    assert_int_equal(code, KVF_GRPC_ABORTED);
    check_n2_pool(f, false);
}

/* The control plane is killed (no --data-dir) while the nodes hold a room:
 * the stream breaks, reconnecting fails, and after node_ttl the node
 * self-fences: the room's SubmitChunk is refused. A control plane started
 * again on the same port (knowing nothing) gets the node as a new
 * incarnation. */
static void test_killed_control_plane_node_self_fences(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    kvf_room_key k = join_pair(f, 707);
    wait_node_knows(f, &f->n1, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    kvf_proc_kill(&f->cp);
    int64_t waited = wait_node_closed(f, &f->n1, k, WAIT_MS);
    if (waited < SELF_FENCE_MIN_MS)
        fail_msg("n1 closed the room %lld ms after the kill, node_ttl is %d ms", (long long)waited,
                 NODE_TTL_MS);
    struct kvf_rpc_status st;
    assert_int_equal(submit(f, &f->n1, k, 1, 0, 16, 8, true, &st), KVF_GRPC_ABORTED);
    char listen[48];
    snprintf(listen, sizeof listen, "127.0.0.1:%s", f->cp_port);
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%d", NODE_TTL_MS);
    const char *args[] = {"--threads", "2", "--node-ttl-ms", ttl, "--listen", listen, NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);
    check_n2_pool(f, false);
}

/* A durable control plane restarts with a node_ttl shorter than the one the
 * node knows, while n1 is stopped: n1 is LOST before its own clock says so.
 * When n1 runs again it re-attaches as the old incarnation, is refused
 * (FAILED_PRECONDITION "is LOST"), and answers that by self-fencing and
 * attaching as a new incarnation at once, before its own clock (node_ttl 6 s
 * less the margin) would have made it. The room ends ABORTED. */
static void test_lost_refusal_makes_node_self_fence_at_once(void **state)
{
    struct fx *f = *state;
    fx_start(f, true); /* node_ttl 6 s */
    kvf_room_key k = join_pair(f, 808);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    int64_t t0 = now_ms();
    char listen[48];
    snprintf(listen, sizeof listen, "127.0.0.1:%s", f->cp_port);
    kvf_proc_kill(&f->cp);
    const char *args[] = {"--threads",  "2",         "--node-ttl-ms", "300",  "--resend-ms", "50",
                          "--data-dir", f->data_dir, "--listen",      listen, NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__NodeInfo *ni = get_node(f, "n1");
        bool lost =
            ni && ni->incarnation == inc1 && ni->state == KVFENCE__V1__NODE_STATE__NODE_STATE_LOST;
        if (ni)
            kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (lost)
            break;
        if (now_ms() > end)
            fail_msg("n1 never LOST at the restarted control plane");
        sleep_ms(10);
    }
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);
    int64_t took = now_ms() - t0;
    if (took >= 6000 * 3 / 5 - 100) /* its own self-fence could be due */
        fail_msg("n1 came back after %lld ms: not by the refusal", (long long)took);
    int st_child;
    assert_int_equal(waitpid(f->n1.pid, &st_child, WNOHANG), 0); /* still running */
    struct kvf_rpc_status st;
    assert_int_equal(submit(f, &f->n1, k, 1, 0, 16, 8, true, &st), KVF_GRPC_ABORTED);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    check_n2_pool(f, false);
}

/* UnregisterPool: field checks, refusal while a lease of an undrained room
 * uses the pool (naming it), removal once the room completed, seen by the
 * control plane. */
static void test_unregister_pool(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    struct kvf_rpc_status st;
    assert_int_equal(unregister_pool(&f->n1, 0, &st), KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "pool_id"));
    assert_int_equal(unregister_pool(&f->n1, 777, &st), KVF_GRPC_NOT_FOUND);
    assert_non_null(strstr(st.message, "pool_id"));
    assert_non_null(strstr(st.message, "777"));

    kvf_room_key k = join_pair(f, 404);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    assert_int_equal(unregister_pool(&f->n1, f->p1.pool_id, &st), KVF_GRPC_FAILED_PRECONDITION);
    char want[32];
    snprintf(want, sizeof want, "pool %u", f->p1.pool_id);
    assert_non_null(strstr(st.message, want));
    assert_non_null(strstr(st.message, "404"));
    assert_int_equal(unregister_pool(&f->n2, f->p2.pool_id, &st), KVF_GRPC_FAILED_PRECONDITION);

    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
    /* The sink's lifetime drains when its bytes landed and it completed. */
    int64_t end = now_ms() + WAIT_MS;
    while ((code = unregister_pool(&f->n2, f->p2.pool_id, &st)) == KVF_GRPC_FAILED_PRECONDITION &&
           now_ms() < end)
        sleep_ms(20);
    if (code != KVF_GRPC_OK)
        fail_msg("UnregisterPool after completion: %d %s", code, st.message);
    assert_int_equal(unregister_pool(&f->n2, f->p2.pool_id, &st), KVF_GRPC_NOT_FOUND);
    end = now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__NodeInfo *ni = get_node(f, "n2");
        assert_non_null(ni);
        bool gone = !node_has_pool(ni, f->p2.pool_id);
        kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (gone)
            break;
        if (now_ms() > end)
            fail_msg("the control plane still lists n2's pool %u", f->p2.pool_id);
        sleep_ms(20);
    }
    /* A join into the removed pool is refused by the control plane. */
    Kvfence__V1__NodeInfo *ni = get_node(f, "n2");
    assert_int_equal(ni->n_pools, 0);
    kvfence__v1__node_info__free_unpacked(ni, NULL);
}

/* The sink pool's page size comes with the RoomUpdate: a mismatch with the
 * source pool is refused, naming page_size, and nothing lands. */
static void test_page_size_mismatch_refused(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    assert_int_equal(shm_create(&f->p3, "n2b", canary2), 0);
    uint32_t big = 0;
    struct kvf_rpc_status st;
    assert_int_equal(register_pool_sized(&f->n2, &f->p3, 2 * PAGE_SIZE, &big, &st), KVF_GRPC_OK);
    kvf_room_key k1 = join(f, 505, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 505, "n2", KVFENCE__V1__ROLE__ROLE_SINK, big, 16, 8, NULL);
    wait_room_state(f, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k1);
    f->p2.pool_id = big; /* submit() names the sink pool from p2 */
    int code = submit(f, &f->n1, k1, 1, 0, 16, 8, true, &st);
    assert_int_equal(code, KVF_GRPC_FAILED_PRECONDITION);
    assert_non_null(strstr(st.message, "page_size"));
    sleep_ms(100); /* a window for a stray byte to land (there must be none) */
    for (size_t i = 0; i < (size_t)PAGE_SIZE * PAGE_COUNT; i++)
        if (f->p3.mem[i] != canary2((uint32_t)(i / PAGE_SIZE), (uint32_t)(i % PAGE_SIZE)))
            fail_msg("sink pool byte %zu changed", i);
}

/* Right after ExtendLease the engine knows a lease version (its page count)
 * that the node may not have yet: naming it gets UNAVAILABLE (retryable)
 * until the node's RoomUpdate brings it, never FAILED_PRECONDITION. */
static void test_extended_lease_version_unavailable_then_ok(void **state)
{
    struct fx *f = *state;
    fx_start(f, false);
    uint64_t lease = 0;
    kvf_room_key k =
        join(f, 606, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 4, &lease);
    (void)join(f, 606, "n2", KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 8, NULL);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    struct kvf_rpc_status st;
    /* A version the node does not have: UNAVAILABLE, naming the field. */
    int code = submit_v(f, &f->n1, k, 0, 1, 0, 16, 4, false, 8, &st);
    assert_int_equal(code, KVF_GRPC_UNAVAILABLE);
    assert_non_null(strstr(st.message, "source_lease_pages"));
    /* Extend to 8 pages and submit the new pages at once with the version. */
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange pr = KVFENCE__V1__PAGE_RANGE__INIT;
    pr.first = 4;
    pr.count = 4;
    Kvfence__V1__PageRange *prs[1] = {&pr};
    Kvfence__V1__ExtendLeaseRequest ex = KVFENCE__V1__EXTEND_LEASE_REQUEST__INIT;
    ex.room = &rk;
    ex.lease_id = lease;
    ex.n_ranges = 1;
    ex.ranges = prs;
    assert_int_equal(call(f->ch, "/kvfence.v1.Control/ExtendLease", &ex.base, NULL, NULL, &st),
                     KVF_GRPC_OK);
    int64_t end = now_ms() + WAIT_MS;
    int unavailable = 0;
    while ((code = submit_v(f, &f->n1, k, 0, 1, 0, 16, 8, true, 8, &st)) == KVF_GRPC_UNAVAILABLE &&
           now_ms() < end) {
        unavailable++;
        sleep_ms(5);
    }
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk of the extended lease: %d %s (after %d UNAVAILABLE)", code,
                 st.message, unavailable);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_durable_restart_resync_reconciles_pools_room_goes_on,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            test_stopped_control_plane_nodes_self_fence_and_come_back_new, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lost_node_comes_back_as_new_incarnation, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_killed_control_plane_node_self_fences, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_lost_refusal_makes_node_self_fence_at_once, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_self_fence_then_same_node_room_transfers, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_unregister_pool, setup, teardown),
        cmocka_unit_test_setup_teardown(test_page_size_mismatch_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_extended_lease_version_unavailable_then_ok, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
