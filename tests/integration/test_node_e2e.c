/*
 * test_node_e2e.c: kvfence-node end to end. Each test starts one
 * kvfence-control (kvf_proc.c) and two kvfence-node processes (n1, n2) on
 * 127.0.0.1 with their NodeLocal sockets in a temporary directory, and plays
 * the engine in this process: it creates one POSIX shm pool per node, filled
 * with canary patterns, registers them over NodeLocal, joins rooms over
 * Control.JoinRoom, follows the room with Admin.GetRoom, and submits chunks to
 * n1 over NodeLocal.SubmitChunk.
 *
 * Waits are on observed state with timeouts (poll GetRoom; probe a node's
 * knowledge of a room with a SubmitChunk it must refuse with
 * FAILED_PRECONDITION once it has the room's update, UNAVAILABLE before).
 * Teardown stops every process: the nodes and the control plane must exit 0
 * on SIGTERM (a node killed by the test is only reaped), and the shm objects
 * are unlinked.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
#define WAIT_MS         10000
#define PAGE_SIZE       4096u
#define PAGE_COUNT      64u
#define NODE_TTL_MS     "1500"

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

static void node_kill9(struct node_proc *np)
{
    if (np->pid > 0) {
        int st;
        kill(np->pid, SIGKILL);
        waitpid(np->pid, &st, 0);
        np->pid = 0;
    }
}

/* ---- fixture ------------------------------------------------------------------ */

struct shm_pool {
    char name[64];
    uint8_t *mem;
    uint32_t pool_id;
};

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct node_proc n1, n2;
    struct shm_pool p1, p2;
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
    snprintf(p->name, sizeof p->name, "/kvf-e2e-%d-%s", (int)getpid(), tag);
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

static int teardown(void **state)
{
    struct fx *f = *state;
    int rc = 0;
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
    if (f->dir[0]) {
        char path[200];
        snprintf(path, sizeof path, "%s/n1.port", f->dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/n2.port", f->dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/n1.sock", f->dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/n2.sock", f->dir);
        unlink(path);
        rmdir(f->dir);
    }
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

static uint32_t register_pool(struct node_proc *np, const struct shm_pool *p)
{
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)p->name;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = PAGE_SIZE;
    req.page_count = PAGE_COUNT;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        fprintf(stderr, "RegisterPool on %s: %d %s\n", np->id, code, st.message);
    assert_int_equal(code, KVF_GRPC_OK);
    Kvfence__V1__RegisterPoolResponse *r =
        kvfence__v1__register_pool_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(r);
    assert_non_null(r->pool);
    uint32_t id = r->pool->pool_id;
    kvfence__v1__register_pool_response__free_unpacked(r, NULL);
    return id;
}

/* Joins one participant; retries while the node's pool is not yet known to
 * the control plane (the PoolUpdate races the engine's JoinRoom). */
static kvf_room_key join(struct fx *f, uint64_t room_id, const char *node, int role,
                         uint32_t pool_id, uint32_t first, uint32_t count)
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
            kvfence__v1__join_room_response__free_unpacked(r, NULL);
            return k;
        }
        if (now_ms() > end) {
            fprintf(stderr, "JoinRoom %s: %d %s\n", node, code, st.message);
            fail();
        }
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
    if (code != KVF_GRPC_OK) {
        fprintf(stderr, "GetRoom: %d %s\n", code, st.message);
        fail();
    }
    Kvfence__V1__RoomInfo *ri = kvfence__v1__room_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ri);
    return ri;
}

static void wait_room_state(struct fx *f, kvf_room_key k, Kvfence__V1__RoomState want,
                            int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    int last = -1;
    for (;;) {
        Kvfence__V1__RoomInfo *ri = get_room(f, k);
        last = ri->state;
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
        if (now_ms() > end) {
            fprintf(stderr, "room %llu:%llu: state %d (want %d), leases released %d\n",
                    (unsigned long long)k.room_id, (unsigned long long)k.generation, last,
                    (int)want, released);
            fail();
        }
        sleep_ms(20);
    }
}

/* SubmitChunk of source rank 0 on `np`: n1's pages [sfirst, +count) ->
 * n2's pages [dfirst, +count). Returns the status code. */
static int submit_as(struct fx *f, struct node_proc *np, kvf_room_key k, uint32_t source_rank,
                     uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                     struct kvf_rpc_status *st)
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
    return call(np->local, "/kvfence.v1.NodeLocal/SubmitChunk", &req.base, NULL, NULL, st);
}

static int submit(struct fx *f, struct node_proc *np, kvf_room_key k, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, bool last, struct kvf_rpc_status *st)
{
    return submit_as(f, np, k, 0, seq, sfirst, dfirst, count, last, st);
}

/* Waits until `np` has the room's update: a SubmitChunk naming a source rank
 * that is in no lease (99) answers UNAVAILABLE before, FAILED_PRECONDITION
 * after. */
static void wait_node_knows(struct fx *f, struct node_proc *np, kvf_room_key k)
{
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_rpc_status st;
        int code = submit_as(f, np, k, 99, 1, 0, 16, 1, false, &st);
        if (code == KVF_GRPC_FAILED_PRECONDITION)
            return;
        if (code != KVF_GRPC_UNAVAILABLE)
            fail_msg("node %s: unexpected probe answer %d: %s", np->id, code, st.message);
        if (now_ms() > end)
            fail_msg("node %s never got the room update (%d %s)", np->id, code, st.message);
        sleep_ms(10);
    }
}

/* Control plane, two nodes, two pools registered. */
static void fx_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", NODE_TTL_MS, "--resend-ms",
                          "50",        NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    f->ch = kvf_rpc_channel_create(f->cp.target, &co);
    assert_non_null(f->ch);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-e2e-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    assert_int_equal(node_start(&f->n1, f->dir, "n1", f->cp.target), 0);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", f->cp.target), 0);
    assert_int_equal(shm_create(&f->p1, "n1", canary1), 0);
    assert_int_equal(shm_create(&f->p2, "n2", canary2), 0);
    f->p1.pool_id = register_pool(&f->n1, &f->p1);
    f->p2.pool_id = register_pool(&f->n2, &f->p2);
}

static kvf_room_key join_pair(struct fx *f, uint64_t room_id)
{
    kvf_room_key k1 = join(f, room_id, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8);
    kvf_room_key k2 = join(f, room_id, "n2", KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, 16, 8);
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

static void test_chunk_lands_and_room_completes(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 101);
    wait_node_knows(f, &f->n2, k);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
    /* Nothing more for a completed room. */
    code = submit(f, &f->n1, k, 2, 0, 16, 8, true, &st);
    assert_int_not_equal(code, KVF_GRPC_OK);
}

static void test_abort_before_any_chunk_drains_and_refuses(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 202);
    wait_node_knows(f, &f->n2, k);
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.detail = (char *)"test abort";
    struct kvf_rpc_status st;
    assert_int_equal(call(f->ch, "/kvfence.v1.Control/AbortRoom", &req.base, NULL, NULL, &st),
                     KVF_GRPC_OK);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_ABORTED && code != KVF_GRPC_FAILED_PRECONDITION)
        fail_msg("late SubmitChunk answered %d: %s", code, st.message);
    sleep_ms(100); /* a window for a stray byte to land (there must be none) */
    check_n2_pool(f, false);
}

static void test_killed_sink_node_is_fenced_then_aborted(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 303);
    wait_node_knows(f, &f->n2, k);
    node_kill9(&f->n2);
    /* node ttl 1.5 s -> LOST -> abort, n1 drains and fences n2 -> ABORTED. */
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    struct kvf_rpc_status st;
    int code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st);
    assert_int_not_equal(code, KVF_GRPC_OK);
}

/* A source that writes the same sink pages twice (a retry with a new
 * chunk_seq, or an engine bug) must not make the sink Completed: completion
 * counts the lease pages covered, not the bytes received. n1's pages [0, 4)
 * then [4, 8) both go to n2's pages [16, 20) (8 pages of bytes, the size of
 * the lease); the sink must still accept [4, 8) -> [20, 24), and the room
 * completes only with every sink page written. */
static void test_pages_written_twice_count_once(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 404);
    wait_node_knows(f, &f->n2, k);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    assert_int_equal(submit_as(f, &f->n1, k, 0, 1, 0, 16, 4, false, &st), KVF_GRPC_OK);
    assert_int_equal(submit_as(f, &f->n1, k, 0, 2, 4, 16, 4, false, &st), KVF_GRPC_OK);
    /* The second write landed (n1's pages 4.. in n2's 16..) ... */
    int64_t end = now_ms() + WAIT_MS;
    while (f->p2.mem[(size_t)16 * PAGE_SIZE] != canary1(4, 0) ||
           f->p2.mem[(size_t)20 * PAGE_SIZE - 1] != canary1(7, PAGE_SIZE - 1)) {
        if (now_ms() > end)
            fail_msg("the second write never landed in n2's pool");
        sleep_ms(1);
    }
    /* ... and n2's owner ran past its frame event (its jobs run in order):
     * the sink must still be open, not Completed with pages 20.. unwritten. */
    wait_node_knows(f, &f->n2, k);
    int code = submit_as(f, &f->n1, k, 0, 3, 4, 20, 4, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk 3: %d %s", code, st.message);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        for (uint32_t i = 0; i < PAGE_SIZE; i++) {
            uint8_t want = pg >= 16 && pg < 24 ? canary1(4 + (pg - 16) % 4, i) : canary2(pg, i);
            uint8_t got = f->p2.mem[(size_t)pg * PAGE_SIZE + i];
            if (got != want)
                fail_msg("n2 page %u byte %u: 0x%02x, want 0x%02x", pg, i, got, want);
        }
    }
}

/* RegisterPool refuses bad input with the right code and a message naming the
 * field, and registers nothing: the good pool registered afterwards gets the
 * next id (1 past the fixture's). */
static void expect_register(struct node_proc *np, Kvfence__V1__RegisterPoolRequest *req, int want,
                            const char *field)
{
    struct kvf_rpc_status st;
    int code = call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req->base, NULL, NULL, &st);
    if (code != want || !strstr(st.message, field))
        fail_msg("RegisterPool: %d '%s', want %d naming '%s'", code, st.message, want, field);
}

static void test_register_pool_bad_input(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = f->p1.name;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.page_size = PAGE_SIZE;
    req.page_count = PAGE_COUNT;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "memory");

    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = 0;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "page_size");
    req.page_size = PAGE_SIZE;
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT - 1;
    expect_register(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "host_shm.size");
    shm.size = (uint64_t)PAGE_SIZE * PAGE_COUNT;
    shm.shm_name = (char *)"/kvf-e2e-no-such-object";
    expect_register(&f->n1, &req, KVF_GRPC_NOT_FOUND, "host_shm");

    Kvfence__V1__CudaIpcMemory cuda = KVFENCE__V1__CUDA_IPC_MEMORY__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC;
    req.cuda_ipc = &cuda;
    expect_register(&f->n1, &req, KVF_GRPC_UNIMPLEMENTED, "cuda_ipc");

    /* Nothing was half-registered: the next good pool is the fixture's + 1. */
    assert_int_equal(register_pool(&f->n1, &f->p1), f->p1.pool_id + 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_chunk_lands_and_room_completes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_before_any_chunk_drains_and_refuses, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_killed_sink_node_is_fenced_then_aborted, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_pages_written_twice_count_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_register_pool_bad_input, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
