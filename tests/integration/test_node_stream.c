/*
 * test_node_stream.c: NodeLocal.SubmitChunks (pipelined chunk submission on
 * one bidi stream) end to end, with real processes: one kvfence-control
 * (kvf_proc.c) and two kvfence-node processes (n1, n2) on 127.0.0.1 with
 * their NodeLocal sockets in a temporary directory; this process plays the
 * engine (POSIX shm pools filled with canary patterns, registered over
 * NodeLocal, rooms joined over Control.JoinRoom, followed with Admin.GetRoom)
 * and submits chunks to n1 on SubmitChunks streams. The harness is
 * test_node_e2e.c's.
 *
 * Covered: many chunks in flight on one stream land byte for byte and the
 * room completes; refused requests in the middle (pages outside the lease, a
 * repeated chunk_seq, chunk_seq 0, an undecodable message) each get their own
 * result in order and the later chunks still go; after an abort the
 * remaining chunks of the stream get ABORTED and the sink's canary holds
 * once the leases are RELEASED; a stream still open at node shutdown ends
 * with UNAVAILABLE and the node exits 0 (under ASan: no leak).
 *
 * Waits are on observed state with timeouts. Teardown stops every process:
 * they must exit 0 on SIGTERM, and the shm objects are unlinked.
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
#define STREAM_PAGES    32u /* lease of the pipelined test: n1 [0, 32) -> n2 [32, 64) */
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
    snprintf(p->name, sizeof p->name, "/kvf-sst-%d-%s", (int)getpid(), tag);
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
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-sst-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    assert_int_equal(node_start(&f->n1, f->dir, "n1", f->cp.target), 0);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", f->cp.target), 0);
    assert_int_equal(shm_create(&f->p1, "n1", canary1), 0);
    assert_int_equal(shm_create(&f->p2, "n2", canary2), 0);
    f->p1.pool_id = register_pool(&f->n1, &f->p1);
    f->p2.pool_id = register_pool(&f->n2, &f->p2);
}

/* A room: n1's source rank 0 leases pages [0, count), n2's sink rank 0
 * pages [dfirst, dfirst + count); waits until both nodes have its update. */
static kvf_room_key join_pair(struct fx *f, uint64_t room_id, uint32_t dfirst, uint32_t count)
{
    kvf_room_key k1 =
        join(f, room_id, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, count);
    kvf_room_key k2 =
        join(f, room_id, "n2", KVFENCE__V1__ROLE__ROLE_SINK, f->p2.pool_id, dfirst, count);
    assert_true(k1.room_id == k2.room_id && k1.generation == k2.generation);
    wait_room_state(f, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n2, k1);
    wait_node_knows(f, &f->n1, k1);
    return k1;
}

/* n2's pool: pages [dfirst, dfirst + count) hold n1's pages [0, count);
 * every other byte still holds its canary. */
static void check_n2_pool(struct fx *f, uint32_t dfirst, uint32_t count)
{
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        for (uint32_t i = 0; i < PAGE_SIZE; i++) {
            uint8_t got = f->p2.mem[(size_t)pg * PAGE_SIZE + i];
            uint8_t want = canary2(pg, i);
            if (pg >= dfirst && pg < dfirst + count)
                want = canary1(pg - dfirst, i);
            if (got != want)
                fail_msg("n2 page %u byte %u: 0x%02x, want 0x%02x", pg, i, got, want);
        }
    }
}

/* ---- SubmitChunks helpers ------------------------------------------------------------- */

#define M_STREAM "/kvfence.v1.NodeLocal/SubmitChunks"

static struct kvf_rpc_client_stream *stream_open(struct kvf_rpc_channel *ch)
{
    struct kvf_rpc_client_stream *cs = kvf_rpc_client_stream_open(ch, M_STREAM, 30000);
    assert_non_null(cs);
    return cs;
}

/* Sends one request: source rank 0, n1's pages [sfirst, +count) -> n2's pages
 * [dfirst, +count). */
static void stream_submit(struct fx *f, struct kvf_rpc_client_stream *cs, kvf_room_key k,
                          uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last)
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
    req.source_rank = 0;
    req.source_pool_id = f->p1.pool_id;
    req.n_source_ranges = 1;
    req.source_ranges = sv;
    req.sink_node_id = (char *)"n2";
    req.sink_rank = 0;
    req.sink_pool_id = f->p2.pool_id;
    req.n_sink_ranges = 1;
    req.sink_ranges = dv;
    req.last_chunk = last;
    uint8_t buf[256];
    size_t len = kvfence__v1__submit_chunk_request__get_packed_size(&req);
    assert_true(len <= sizeof buf);
    kvfence__v1__submit_chunk_request__pack(&req, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
}

/* The next result: its chunk_seq must be `seq` and its code `code`; a
 * refusal's message must contain `needle` (NULL: any). */
static void expect_result(struct kvf_rpc_client_stream *cs, uint64_t seq, int code,
                          const char *needle)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    if (rc != 0)
        fail_msg("result for chunk %llu: recv %d (status %d %s)", (unsigned long long)seq, rc,
                 rc == KVF_RPC_STREAM_END ? st.code : 0,
                 rc == KVF_RPC_STREAM_END ? st.message : "");
    Kvfence__V1__SubmitChunkResult *r = kvfence__v1__submit_chunk_result__unpack(NULL, len, msg);
    free(msg);
    assert_non_null(r);
    if (r->chunk_seq != seq || (int)r->code != code ||
        (needle && !strstr(r->message ? r->message : "", needle)) ||
        (code == KVF_GRPC_OK && r->message && r->message[0]))
        fail_msg("result: chunk %llu code %u \"%s\", want chunk %llu code %d (\"%s\")",
                 (unsigned long long)r->chunk_seq, r->code, r->message ? r->message : "",
                 (unsigned long long)seq, code, needle ? needle : "");
    kvfence__v1__submit_chunk_result__free_unpacked(r, NULL);
}

/* The stream's end: no more results, status `code`, its message containing
 * `needle` (NULL: any). */
static void expect_end(struct kvf_rpc_client_stream *cs, int code, const char *needle)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    free(msg);
    if (rc != KVF_RPC_STREAM_END)
        fail_msg("stream: recv %d, want its end", rc);
    if (st.code != code || (needle && !strstr(st.message, needle)))
        fail_msg("stream ended with %d (%s), want %d (%s)", st.code, st.message, code,
                 needle ? needle : "");
}

static void abort_room(struct fx *f, kvf_room_key k)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.detail = (char *)"test abort";
    struct kvf_rpc_status st;
    assert_int_equal(call(f->ch, "/kvfence.v1.Control/AbortRoom", &req.base, NULL, NULL, &st),
                     KVF_GRPC_OK);
}

/* ---- tests ----------------------------------------------------------------------- */

/* STREAM_PAGES one-page chunks, all sent before the first result is read:
 * every result OK in order, the stream ends OK after half-close, the room
 * completes and the sink pool holds the source pages byte for byte. */
static void test_pipelined_chunks_land_and_room_completes(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 501, 32, STREAM_PAGES);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    for (uint32_t i = 0; i < STREAM_PAGES; i++)
        stream_submit(f, cs, k, i + 1, i, 32 + i, 1, i + 1 == STREAM_PAGES);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    for (uint32_t i = 0; i < STREAM_PAGES; i++)
        expect_result(cs, i + 1, KVF_GRPC_OK, NULL);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 32, STREAM_PAGES);
}

/* Refused requests in the middle of a stream get their own results, with
 * SubmitChunk's codes, and do not stop the requests after them. */
static void test_refused_chunks_get_results_and_stream_goes_on(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 502, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 1, false);
    stream_submit(f, cs, k, 2, 1, 17, 1, false);
    stream_submit(f, cs, k, 3, 2, 40, 1, false); /* sink page outside the lease */
    stream_submit(f, cs, k, 0, 2, 18, 1, false); /* chunk_seq 0 */
    static const uint8_t junk[] = {0xff, 0xff, 0xff};
    assert_int_equal(kvf_rpc_client_stream_send(cs, junk, sizeof junk), 0);
    stream_submit(f, cs, k, 4, 2, 18, 1, false);
    stream_submit(f, cs, k, 4, 3, 19, 1, false); /* chunk_seq repeated */
    stream_submit(f, cs, k, 5, 3, 19, 4, false);
    stream_submit(f, cs, k, 6, 7, 23, 1, true);
    /* After the last chunk (right after: the source may also have completed
     * by then; both are FAILED_PRECONDITION). */
    stream_submit(f, cs, k, 7, 0, 16, 1, false);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    expect_result(cs, 2, KVF_GRPC_OK, NULL);
    expect_result(cs, 3, KVF_GRPC_FAILED_PRECONDITION, "sink_ranges[0]");
    expect_result(cs, 0, KVF_GRPC_INVALID_ARGUMENT, "chunk_seq");
    expect_result(cs, 0, KVF_GRPC_INVALID_ARGUMENT, "undecodable");
    expect_result(cs, 4, KVF_GRPC_OK, NULL);
    expect_result(cs, 4, KVF_GRPC_ALREADY_EXISTS, "chunk_seq 4");
    expect_result(cs, 5, KVF_GRPC_OK, NULL);
    expect_result(cs, 6, KVF_GRPC_OK, NULL);
    expect_result(cs, 7, KVF_GRPC_FAILED_PRECONDITION, NULL);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 16, 8);
}

/* A room aborted while its stream is open: the chunks sent after get ABORTED
 * results, nothing of them lands, and the sink's canary holds once every
 * lease is RELEASED. */
static void test_abort_mid_stream_refuses_the_rest(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 503, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 1, false);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    /* Chunk 1 landed whole before the abort (one frame: whole or nothing). */
    int64_t end = now_ms() + WAIT_MS;
    while (memcmp(f->p2.mem + (size_t)16 * PAGE_SIZE, f->p1.mem, PAGE_SIZE) != 0) {
        if (now_ms() > end)
            fail_msg("chunk 1 never landed in n2's pool");
        sleep_ms(1);
    }
    abort_room(f, k);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    /* n1 has the abort: its room stopped admitting (it drained before the
     * leases were released). */
    for (uint32_t i = 1; i < 8; i++)
        stream_submit(f, cs, k, i + 1, i, 16 + i, 1, i == 7);
    for (uint32_t i = 1; i < 8; i++)
        expect_result(cs, i + 1, KVF_GRPC_ABORTED, NULL);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    expect_end(cs, KVF_GRPC_OK, NULL);
    kvf_rpc_client_stream_close(cs);
    check_n2_pool(f, 16, 1);
}

/* A stream still open when its node stops ends with UNAVAILABLE, and the
 * node exits 0 (the ASan build fails the exit on a leak). */
static void test_stream_ends_at_node_shutdown(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = join_pair(f, 504, 16, 8);
    struct kvf_rpc_client_stream *cs = stream_open(f->n1.local);
    stream_submit(f, cs, k, 1, 0, 16, 8, true);
    expect_result(cs, 1, KVF_GRPC_OK, NULL);
    wait_room_state(f, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, 16, 8);
    /* SIGTERM with the stream open, not half-closed. */
    assert_int_equal(kill(f->n1.pid, SIGTERM), 0);
    /* The node's own end, not the server's shutdown cancelling the call. */
    expect_end(cs, KVF_GRPC_UNAVAILABLE, "node shutting down");
    kvf_rpc_client_stream_close(cs);
    int st = -1;
    int64_t end = now_ms() + 8000;
    while (waitpid(f->n1.pid, &st, WNOHANG) != f->n1.pid) {
        if (now_ms() > end)
            fail_msg("n1 did not exit within 8 s of SIGTERM");
        sleep_ms(10);
    }
    f->n1.pid = 0;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fail_msg("n1 exited with status 0x%x, want 0", st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_pipelined_chunks_land_and_room_completes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_refused_chunks_get_results_and_stream_goes_on, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_abort_mid_stream_refuses_the_rest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_ends_at_node_shutdown, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
