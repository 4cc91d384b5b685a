/*
 * node_harness.c: see node_harness.h.
 */
#include "node_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
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
#include "kvf_fdpass.h"
#include "kvf_file.h"

#define NH_MAX_ARGS 48

int64_t nh_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void nh_sleep_ms(long ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int nh_fx_alloc(void **state, size_t size)
{
    void *f = calloc(1, size);
    if (!f)
        return -1;
    *state = f;
    return 0;
}

void nh_tmpdir(char *dir, size_t size, const char *prefix)
{
    snprintf(dir, size, "/tmp/kvf-%s-XXXXXX", prefix);
    assert_non_null(mkdtemp(dir));
}

/* ---- a kvfence-node child -------------------------------------------------------- */

int nh_node_start(struct nh_node *np, const char *dir, const char *tag, const char *node_id,
                  const char *control, const char *const *extra, unsigned flags)
{
    memset(np, 0, sizeof *np);
    snprintf(np->id, sizeof np->id, "%s", tag);
    snprintf(np->sock, sizeof np->sock, "%s/%s.sock", dir, tag);
    snprintf(np->port_file, sizeof np->port_file, "%s/%s.port", dir, tag);
    if (flags & NH_FAULT_FILE)
        snprintf(np->fault_file, sizeof np->fault_file, "%s/%s.faults", dir, tag);
    if (flags & NH_LOG_FILE)
        snprintf(np->log, sizeof np->log, "%s/%s.log", dir, tag);
    const char *argv[NH_MAX_ARGS] = {
        KVF_NODE_BIN,     "--control",   control,       "--node-id",          node_id,
        "--local-socket", np->sock,      "--port-file", np->port_file,        "--data-host",
        "127.0.0.1",      "--data-port", "0",           "--drain-timeout-ms", "3000"};
    int k = 15;
    if (flags & NH_FAULT_FILE) {
        argv[k++] = "--fault-file";
        argv[k++] = np->fault_file;
    }
    for (int i = 0; extra && extra[i]; i++) {
        if (k >= NH_MAX_ARGS - 1) {
            fprintf(stderr, "kvfence-node %s: too many arguments\n", node_id);
            return -1;
        }
        argv[k++] = extra[i];
    }
    argv[k] = NULL;
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
        if (np->log[0]) {
            int fd = open(np->log, O_CREAT | O_WRONLY | O_APPEND, 0600);
            if (fd >= 0)
                dup2(fd, 2);
        }
        execv(KVF_NODE_BIN, (char *const *)argv);
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
            fprintf(stderr, "kvfence-node %s exited early (0x%x)\n", node_id, st);
            np->pid = 0;
            return -1;
        }
        nh_sleep_ms(10);
    }
    fprintf(stderr, "kvfence-node %s: no port file after 10 s\n", node_id);
    return -1;
}

int nh_node_stop(struct nh_node *np, long ms)
{
    kvf_rpc_channel_destroy(np->local);
    np->local = NULL;
    if (np->pid <= 0)
        return -1;
    int st = -1;
    kill(np->pid, SIGCONT);
    kill(np->pid, SIGTERM);
    int64_t end = nh_now_ms() + ms;
    while (nh_now_ms() < end) {
        if (waitpid(np->pid, &st, WNOHANG) == np->pid) {
            np->pid = 0;
            return st;
        }
        nh_sleep_ms(10);
    }
    kill(np->pid, SIGKILL);
    waitpid(np->pid, &st, 0);
    np->pid = 0;
    return -2;
}

void nh_node_kill9(struct nh_node *np)
{
    /* Its process is gone, and so is what its channel reaches; a restart
     * (nh_node_start) makes a new one. */
    kvf_rpc_channel_destroy(np->local);
    np->local = NULL;
    if (np->pid > 0) {
        int st;
        kill(np->pid, SIGKILL);
        waitpid(np->pid, &st, 0);
        np->pid = 0;
    }
    np->any_exit = true;
}

int nh_nodes_stop(struct nh_node *const *nodes, size_t n, long ms)
{
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        struct nh_node *np = nodes[i];
        if (np->pid <= 0) {
            kvf_rpc_channel_destroy(np->local);
            np->local = NULL;
            continue;
        }
        int st = nh_node_stop(np, ms);
        if (!np->any_exit && (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
            fprintf(stderr, "kvfence-node %s did not exit 0 on SIGTERM (status %d)\n", np->id, st);
            rc = -1;
        }
    }
    return rc;
}

void nh_node_dump_log(const struct nh_node *np)
{
    if (!np->log[0])
        return;
    FILE *fp = fopen(np->log, "r");
    if (!fp)
        return;
    fprintf(stderr, "---- log of %s ----\n", np->id);
    char line[2048];
    while (fgets(line, sizeof line, fp))
        fputs(line, stderr);
    fclose(fp);
}

unsigned nh_log_count(const struct nh_node *np, const char *needle, const kvf_room_key *k)
{
    FILE *fp = np->log[0] ? fopen(np->log, "r") : NULL;
    if (!fp)
        return 0;
    char tag[64] = "";
    if (k)
        snprintf(tag, sizeof tag, "\"room\":\"%llu:%llu\"", (unsigned long long)k->room_id,
                 (unsigned long long)k->generation);
    /* getline: a long line is one line (fgets would split it and could count
     * it twice or miss a needle cut in two). */
    char *line = NULL;
    size_t cap = 0;
    unsigned n = 0;
    while (getline(&line, &cap, fp) >= 0)
        n += strstr(line, needle) && (!k || strstr(line, tag));
    free(line);
    fclose(fp);
    return n;
}

void nh_wait_log(const struct nh_node *np, const char *needle, const kvf_room_key *k, unsigned min,
                 int64_t timeout_ms)
{
    int64_t end = nh_now_ms() + timeout_ms;
    unsigned got;
    while ((got = nh_log_count(np, needle, k)) < min) {
        if (nh_now_ms() > end)
            fail_msg("node %s: %u log lines '%s'%s after %lld ms, want %u", np->id, got, needle,
                     k ? " for the room" : "", (long long)timeout_ms, min);
        nh_sleep_ms(5);
    }
}

void nh_fault_file_write(const struct nh_node *np, const char *text)
{
    assert_true(np->fault_file[0] != '\0'); /* started with NH_FAULT_FILE */
    assert_int_equal(kvf_file_write(np->fault_file, text, strlen(text), 0), 0);
}

void nh_set_faults(const struct nh_node *np, const char *text, int64_t timeout_ms)
{
    unsigned before = nh_log_count(np, "fault: config loaded", NULL);
    nh_fault_file_write(np, text);
    int64_t end = nh_now_ms() + timeout_ms;
    while (nh_log_count(np, "fault: config loaded", NULL) <= before) {
        if (nh_now_ms() > end)
            fail_msg("node %s did not load its fault file within %lld ms: %s", np->id,
                     (long long)timeout_ms, text);
        nh_sleep_ms(5);
    }
}

void nh_node_remove_files(const struct nh_node *np)
{
    const char *paths[] = {np->port_file, np->sock, np->fault_file, np->log};
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++)
        if (paths[i][0])
            unlink(paths[i]);
    if (np->fault_file[0]) {
        char tmp[200];
        snprintf(tmp, sizeof tmp, "%s.tmp", np->fault_file);
        unlink(tmp);
    }
}

/* ---- the control plane ------------------------------------------------------------- */

void nh_control_start(struct kvf_proc *cp, struct kvf_rpc_channel **ch, const char *const *args)
{
    assert_int_equal(kvf_proc_start(cp, KVF_CONTROL_BIN, args), 0);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    *ch = kvf_rpc_channel_create(cp->target, &co);
    assert_non_null(*ch);
}

int nh_control_stop(struct kvf_proc *cp)
{
    int rc = 0;
    if (cp->pid > 0) {
        int st = kvf_proc_stop(cp, 10000);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            fprintf(stderr, "kvfence-control did not exit 0 on SIGTERM (0x%x)\n", st);
            rc = -1;
        }
    }
    kvf_proc_kill(cp);
    return rc;
}

/* ---- shm pools ------------------------------------------------------------------- */

uint8_t nh_canary1(uint32_t page, uint32_t i)
{
    return (uint8_t)(page * 31u + i * 7u + 1u);
}

uint8_t nh_canary2(uint32_t page, uint32_t i)
{
    return (uint8_t)(0xa5u ^ page ^ (i >> 3));
}

int nh_pool_create(struct nh_pool *p, const char *prefix, const char *tag, uint32_t page_size,
                   uint32_t page_count, nh_canary_fn fill)
{
    snprintf(p->name, sizeof p->name, "/kvf-%s-%d-%s", prefix, (int)getpid(), tag);
    p->page_size = page_size;
    p->page_count = page_count;
    int fd = shm_open(p->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
        p->name[0] = '\0';
        return -1;
    }
    size_t len = (size_t)page_size * page_count;
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
    if (fill)
        for (uint32_t pg = 0; pg < page_count; pg++)
            for (uint32_t i = 0; i < page_size; i++)
                p->mem[(size_t)pg * page_size + i] = fill(pg, i);
    return 0;
}

void nh_pool_destroy(struct nh_pool *p)
{
    if (p->mem)
        munmap(p->mem, (size_t)p->page_size * p->page_count);
    p->mem = NULL;
    if (p->name[0])
        shm_unlink(p->name);
    p->name[0] = '\0';
}

uint8_t nh_seed_byte(uint32_t seed, uint32_t page, uint32_t i)
{
    return (uint8_t)(seed * 157u + page * 31u + i * 7u + (i >> 8) + 1u);
}

void nh_seed_fill(struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed)
{
    for (uint32_t pg = first; pg < first + count; pg++)
        for (uint32_t i = 0; i < p->page_size; i++)
            p->mem[(size_t)pg * p->page_size + i] = nh_seed_byte(seed, pg, i);
}

bool nh_seed_holds(const struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed,
                   uint32_t as_first, char *why, size_t whylen)
{
    for (uint32_t k = 0; k < count; k++)
        for (uint32_t i = 0; i < p->page_size; i++) {
            uint8_t got = p->mem[(size_t)(first + k) * p->page_size + i];
            uint8_t want = nh_seed_byte(seed, as_first + k, i);
            if (got != want) {
                snprintf(why, whylen, "%s page %u byte %u: 0x%02x, want 0x%02x", p->name, first + k,
                         i, got, want);
                return false;
            }
        }
    return true;
}

void nh_seed_check(const struct nh_pool *p, uint32_t first, uint32_t count, uint32_t seed,
                   uint32_t as_first)
{
    char why[200];
    if (!nh_seed_holds(p, first, count, seed, as_first, why, sizeof why))
        fail_msg("canary: %s", why);
}

void nh_check_pool(const struct nh_pool *sink, nh_canary_fn sink_canary, uint32_t dfirst,
                   uint32_t count, nh_canary_fn src_canary, uint32_t sfirst, const char *label)
{
    for (uint32_t pg = 0; pg < sink->page_count; pg++) {
        bool copied = pg >= dfirst && pg - dfirst < count;
        for (uint32_t i = 0; i < sink->page_size; i++) {
            uint8_t got = sink->mem[(size_t)pg * sink->page_size + i];
            uint8_t want = copied ? src_canary(sfirst + pg - dfirst, i) : sink_canary(pg, i);
            if (got != want)
                fail_msg("%s page %u byte %u: 0x%02x, want 0x%02x", label, pg, i, got, want);
        }
    }
}

/* ---- RPCs ------------------------------------------------------------------------- */

int nh_call(struct kvf_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
            uint8_t **resp_p, size_t *len_p, struct kvf_rpc_status *st)
{
    memset(st, 0, sizeof *st);
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf)
        return KVF_GRPC_RESOURCE_EXHAUSTED;
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t rlen = 0;
    int rc = kvf_rpc_unary(ch, method, buf, len, NH_CALL_TIMEOUT_MS, &resp, &rlen, st);
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

int nh_register_pool_sized(struct nh_node *np, const struct nh_pool *p, uint32_t page_size,
                           uint32_t *id_p, struct kvf_rpc_status *st)
{
    Kvfence__V1__HostShmMemory shm = KVFENCE__V1__HOST_SHM_MEMORY__INIT;
    shm.shm_name = (char *)p->name;
    shm.size = (uint64_t)p->page_size * p->page_count;
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm;
    req.page_size = page_size;
    req.page_count = (uint32_t)(shm.size / page_size);
    Kvfence__V1__HostFdMemory hfd = KVFENCE__V1__HOST_FD_MEMORY__INIT;
    uint8_t handle[KVF_FDPASS_HANDLE_SIZE];
    if (!p->by_name) {
        char fds[200];
        int fd = shm_open(p->name, O_RDWR, 0);
        assert_true(fd >= 0);
        assert_int_equal(kvf_fdpass_path(np->sock, fds, sizeof fds), 0);
        struct kvf_error err;
        kvf_error_clear(&err);
        int rc = kvf_fdpass_send(fds, fd, handle, &err);
        close(fd);
        if (rc != 0)
            fail_msg("%s", err.msg);
        hfd.handle.data = handle;
        hfd.handle.len = sizeof handle;
        hfd.size = shm.size;
        req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD;
        req.host_fd = &hfd;
    }
    uint8_t *resp;
    size_t len;
    int code = nh_call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, &resp, &len, st);
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

uint32_t nh_register_pool(struct nh_node *np, const struct nh_pool *p)
{
    uint32_t id = 0;
    struct kvf_rpc_status st;
    int code = nh_register_pool_sized(np, p, p->page_size, &id, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("RegisterPool on %s: %d %s", np->id, code, st.message);
    return id;
}

void nh_unregister_pool(struct nh_node *np, uint32_t pool_id, int64_t timeout_ms)
{
    Kvfence__V1__UnregisterPoolRequest req = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    req.pool_id = pool_id;
    int64_t end = nh_now_ms() + timeout_ms;
    for (;;) {
        struct kvf_rpc_status st;
        int code =
            nh_call(np->local, "/kvfence.v1.NodeLocal/UnregisterPool", &req.base, NULL, NULL, &st);
        if (code == KVF_GRPC_OK)
            return;
        if (code != KVF_GRPC_FAILED_PRECONDITION || nh_now_ms() > end)
            fail_msg("UnregisterPool %u on %s: %d %s", pool_id, np->id, code, st.message);
        nh_sleep_ms(20);
    }
}

kvf_room_key nh_join(struct kvf_rpc_channel *ch, uint64_t room_id, uint32_t nsrc, uint32_t nsink,
                     const char *node, uint32_t rank, int role, uint32_t pool_id, uint32_t first,
                     uint32_t count, int64_t timeout_ms, uint64_t *lease_p)
{
    static const char *features[] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = (char **)features;
    Kvfence__V1__Participant part = KVFENCE__V1__PARTICIPANT__INIT;
    part.node_id = (char *)node;
    part.rank = rank;
    part.role = (Kvfence__V1__Role)role;
    Kvfence__V1__PageRange pr = KVFENCE__V1__PAGE_RANGE__INIT;
    pr.first = first;
    pr.count = count;
    Kvfence__V1__PageRange *prs[1] = {&pr};
    Kvfence__V1__JoinRoomRequest req = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    req.room_id = room_id;
    req.expected_sources = nsrc;
    req.expected_sinks = nsink;
    req.participant = &part;
    req.engine_capabilities = &caps;
    req.pool_id = pool_id;
    req.n_ranges = 1;
    req.ranges = prs;
    int64_t end = nh_now_ms() + timeout_ms;
    for (;;) {
        uint8_t *resp;
        size_t len;
        struct kvf_rpc_status st;
        int code = nh_call(ch, "/kvfence.v1.Control/JoinRoom", &req.base, &resp, &len, &st);
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
        if (nh_now_ms() > end)
            fail_msg("JoinRoom %s rank %u: %d %s", node, rank, code, st.message);
        nh_sleep_ms(20);
    }
}

kvf_room_key nh_join_pair(struct kvf_rpc_channel *ch, uint64_t room_id, const char *src_node,
                          uint32_t src_pool, uint32_t sfirst, const char *sink_node,
                          uint32_t sink_pool, uint32_t dfirst, uint32_t count, int64_t timeout_ms)
{
    kvf_room_key k1 = nh_join(ch, room_id, 1, 1, src_node, 0, KVFENCE__V1__ROLE__ROLE_SOURCE,
                              src_pool, sfirst, count, timeout_ms, NULL);
    kvf_room_key k2 = nh_join(ch, room_id, 1, 1, sink_node, 0, KVFENCE__V1__ROLE__ROLE_SINK,
                              sink_pool, dfirst, count, timeout_ms, NULL);
    assert_true(k1.room_id == k2.room_id && k1.generation == k2.generation);
    nh_wait_room_state(ch, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, timeout_ms);
    return k1;
}

Kvfence__V1__RoomInfo *nh_get_room(struct kvf_rpc_channel *ch, kvf_room_key k)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__GetRoomRequest req = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    req.room = &rk;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = nh_call(ch, "/kvfence.v1.Admin/GetRoom", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("GetRoom: %d %s", code, st.message);
    Kvfence__V1__RoomInfo *ri = kvfence__v1__room_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ri);
    return ri;
}

int nh_room_state(struct kvf_rpc_channel *ch, kvf_room_key k, unsigned *released_p,
                  unsigned *leases_p)
{
    Kvfence__V1__RoomInfo *ri = nh_get_room(ch, k);
    int s = ri->state;
    unsigned rel = 0;
    for (size_t i = 0; i < ri->n_participants; i++)
        if (ri->participants[i]->lease &&
            ri->participants[i]->lease->state == KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED)
            rel++;
    if (released_p)
        *released_p = rel;
    if (leases_p)
        *leases_p = (unsigned)ri->n_participants;
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    return s;
}

int nh_wait_room_state(struct kvf_rpc_channel *ch, kvf_room_key k, Kvfence__V1__RoomState want,
                       int64_t timeout_ms)
{
    int64_t end = nh_now_ms() + timeout_ms;
    bool terminal = want == KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED ||
                    want == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED;
    for (;;) {
        Kvfence__V1__RoomInfo *ri = nh_get_room(ch, k);
        int s = ri->state;
        int reason = ri->abort_reason;
        unsigned rel = 0, n = (unsigned)ri->n_participants;
        for (size_t i = 0; i < ri->n_participants; i++)
            if (ri->participants[i]->lease &&
                ri->participants[i]->lease->state == KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED)
                rel++;
        kvfence__v1__room_info__free_unpacked(ri, NULL);
        if (s == (int)want && (!terminal || rel == n))
            return reason;
        if (nh_now_ms() > end)
            fail_msg("room %llu:%llu: state %d (want %d), %u of %u leases released",
                     (unsigned long long)k.room_id, (unsigned long long)k.generation, s, (int)want,
                     rel, n);
        nh_sleep_ms(20);
    }
}

void nh_abort_room(struct kvf_rpc_channel *ch, kvf_room_key k, const char *detail)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &rk;
    req.detail = (char *)detail;
    struct kvf_rpc_status st;
    int code = nh_call(ch, "/kvfence.v1.Control/AbortRoom", &req.base, NULL, NULL, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("AbortRoom: %d %s", code, st.message);
}

void nh_extend_lease(struct kvf_rpc_channel *ch, kvf_room_key k, uint64_t lease_id, uint32_t first,
                     uint32_t count)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange pr = KVFENCE__V1__PAGE_RANGE__INIT;
    pr.first = first;
    pr.count = count;
    Kvfence__V1__PageRange *prs[1] = {&pr};
    Kvfence__V1__ExtendLeaseRequest ex = KVFENCE__V1__EXTEND_LEASE_REQUEST__INIT;
    ex.room = &rk;
    ex.lease_id = lease_id;
    ex.n_ranges = 1;
    ex.ranges = prs;
    struct kvf_rpc_status st;
    int code = nh_call(ch, "/kvfence.v1.Control/ExtendLease", &ex.base, NULL, NULL, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("ExtendLease: %d %s", code, st.message);
}

int nh_submit(struct kvf_rpc_channel *local, kvf_room_key k, const struct nh_chunk *c,
              struct kvf_rpc_status *st)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PageRange s[4], d[4];
    Kvfence__V1__PageRange *sv[4], *dv[4];
    unsigned n = c->n ? c->n : 1;
    if (n > 4) {
        memset(st, 0, sizeof *st);
        snprintf(st->message, sizeof st->message, "nh_submit: %u ranges, at most 4", n);
        return KVF_GRPC_INVALID_ARGUMENT;
    }
    for (unsigned i = 0; i < n; i++) {
        kvfence__v1__page_range__init(&s[i]);
        kvfence__v1__page_range__init(&d[i]);
        s[i].first = c->sfirst[i];
        s[i].count = c->count[i];
        d[i].first = c->dfirst[i];
        d[i].count = c->count[i];
        sv[i] = &s[i];
        dv[i] = &d[i];
    }
    Kvfence__V1__SubmitChunkRequest req = KVFENCE__V1__SUBMIT_CHUNK_REQUEST__INIT;
    req.room = &rk;
    req.chunk_seq = c->seq;
    req.source_rank = c->source_rank;
    req.source_pool_id = c->source_pool;
    req.n_source_ranges = n;
    req.source_ranges = sv;
    req.sink_node_id = (char *)c->sink_node;
    req.sink_rank = c->sink_rank;
    req.sink_pool_id = c->sink_pool;
    req.n_sink_ranges = n;
    req.sink_ranges = dv;
    req.last_chunk = c->last;
    req.aux.data = (uint8_t *)c->aux;
    req.aux.len = c->aux_len;
    req.source_lease_pages = c->source_lease_pages;
    return nh_call(local, "/kvfence.v1.NodeLocal/SubmitChunk", &req.base, NULL, NULL, st);
}

void nh_submit_one_ok(struct nh_node *np, kvf_room_key k, uint32_t source_pool,
                      const char *sink_node, uint32_t sink_pool, uint32_t sfirst, uint32_t dfirst,
                      uint32_t count)
{
    struct nh_chunk c = {.seq = 1,
                         .source_pool = source_pool,
                         .sink_node = sink_node,
                         .sink_pool = sink_pool,
                         .n = 1,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = true};
    struct kvf_rpc_status st;
    int code = nh_submit(np->local, k, &c, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk on %s: %d %s", np->id, code, st.message);
}

void nh_wait_node_knows(struct nh_node *np, kvf_room_key k, uint32_t source_pool,
                        const char *sink_node, uint32_t sink_pool, uint32_t dfirst,
                        int64_t timeout_ms)
{
    struct nh_chunk probe = {.source_rank = 99,
                             .seq = 1,
                             .source_pool = source_pool,
                             .sink_node = sink_node,
                             .sink_pool = sink_pool,
                             .sfirst = {0},
                             .dfirst = {dfirst},
                             .count = {1}};
    int64_t end = nh_now_ms() + timeout_ms;
    for (;;) {
        struct kvf_rpc_status st;
        int code = nh_submit(np->local, k, &probe, &st);
        if (code == KVF_GRPC_FAILED_PRECONDITION)
            return;
        if (code != KVF_GRPC_UNAVAILABLE)
            fail_msg("node %s: unexpected probe answer %d: %s", np->id, code, st.message);
        if (nh_now_ms() > end)
            fail_msg("node %s never got the room update (%d %s)", np->id, code, st.message);
        nh_sleep_ms(10);
    }
}

/* ---- the lease watch (Control.WatchLeases) ------------------------------------------ */

void nh_watch_open(struct nh_watch *w, struct kvf_rpc_channel *ch, int64_t timeout_ms)
{
    w->cs = kvf_rpc_client_stream_open(ch, "/kvfence.v1.Control/WatchLeases", KVF_RPC_NO_TIMEOUT);
    assert_non_null(w->cs);
    Kvfence__V1__WatchLeasesRequest req = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    uint8_t buf[16];
    size_t len = kvfence__v1__watch_leases_request__pack(&req, buf);
    assert_int_equal(kvf_rpc_client_stream_send(w->cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(w->cs), 0);
    int64_t end = nh_now_ms() + timeout_ms;
    for (;;) {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st;
        int rc = kvf_rpc_client_stream_recv(w->cs, 200, &msg, &mlen, &st);
        if (rc == 0) {
            Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
            free(msg);
            assert_non_null(ev);
            bool synced = ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED;
            kvfence__v1__lease_event__free_unpacked(ev, NULL);
            if (synced)
                return;
        } else if (rc != -ETIMEDOUT) {
            fail_msg("WatchLeases ended before synced (%d)", rc);
        }
        if (nh_now_ms() > end)
            fail_msg("WatchLeases: no synced event");
    }
}

void nh_watch_close(struct nh_watch *w)
{
    if (!w->cs)
        return;
    kvf_rpc_client_stream_cancel(w->cs);
    kvf_rpc_client_stream_close(w->cs);
    w->cs = NULL;
}

void nh_watch_pump(struct nh_watch *w, int64_t ms)
{
    int64_t end = nh_now_ms() + ms;
    do {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st;
        int rc = kvf_rpc_client_stream_recv(w->cs, 20, &msg, &mlen, &st);
        if (rc == -ETIMEDOUT)
            continue;
        if (rc != 0)
            fail_msg("WatchLeases ended (%d)", rc);
        Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
        free(msg);
        assert_non_null(ev);
        if (ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED && ev->released) {
            uint64_t id = ev->released->lease_id;
            unsigned i = 0;
            while (i < w->n && w->ids[i] != id)
                i++;
            if (i == w->n && w->n < NH_WATCH_MAX) {
                w->ids[w->n] = id;
                w->counts[w->n++] = 0;
            }
            if (i < NH_WATCH_MAX)
                w->counts[i]++;
        }
        kvfence__v1__lease_event__free_unpacked(ev, NULL);
    } while (nh_now_ms() < end);
}

unsigned nh_watch_count(const struct nh_watch *w, uint64_t id)
{
    for (unsigned i = 0; i < w->n; i++)
        if (w->ids[i] == id)
            return w->counts[i];
    return 0;
}

unsigned nh_room_leases(struct kvf_rpc_channel *ch, kvf_room_key k, uint64_t ids[2])
{
    Kvfence__V1__RoomInfo *ri = nh_get_room(ch, k);
    unsigned n = 0;
    for (size_t i = 0; i < ri->n_participants && n < 2; i++)
        if (ri->participants[i]->lease)
            ids[n++] = ri->participants[i]->lease->lease_id;
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    return n;
}

void nh_watch_released_once(struct nh_watch *w, struct kvf_rpc_channel *ch, kvf_room_key k,
                            int64_t timeout_ms)
{
    uint64_t ids[2];
    unsigned n = nh_room_leases(ch, k, ids);
    assert_int_equal(n, 2);
    int64_t end = nh_now_ms() + timeout_ms;
    while (nh_watch_count(w, ids[0]) == 0 || nh_watch_count(w, ids[1]) == 0) {
        if (nh_now_ms() > end)
            fail_msg("WatchLeases: no release of lease %llu or %llu", (unsigned long long)ids[0],
                     (unsigned long long)ids[1]);
        nh_watch_pump(w, 50);
    }
    nh_watch_pump(w, 100); /* a duplicate would come now */
    for (unsigned i = 0; i < n; i++)
        if (nh_watch_count(w, ids[i]) != 1)
            fail_msg("lease %llu released %u times on the watch", (unsigned long long)ids[i],
                     nh_watch_count(w, ids[i]));
}

void nh_watch_none_released(struct nh_watch *w, struct kvf_rpc_channel *ch, kvf_room_key k,
                            const char *what)
{
    uint64_t ids[2];
    unsigned n = nh_room_leases(ch, k, ids);
    nh_watch_pump(w, 50);
    for (unsigned i = 0; i < n; i++)
        if (nh_watch_count(w, ids[i]) != 0)
            fail_msg("lease %llu released while %s", (unsigned long long)ids[i], what);
    unsigned rel;
    int s = nh_room_state(ch, k, &rel, NULL);
    if (rel != 0)
        fail_msg("%u leases RELEASED while %s (room state %d)", rel, what, s);
}

/* ---- teardown --------------------------------------------------------------------- */

int nh_teardown(struct kvf_proc *cp, struct kvf_rpc_channel *ch, struct nh_node *const *nodes,
                size_t nnodes, long node_ms, struct nh_pool *const *pools, size_t npools,
                const char *dir)
{
    if (cp->pid > 0)
        kill(cp->pid, SIGCONT);
    int rc = nh_nodes_stop(nodes, nnodes, node_ms);
    kvf_rpc_channel_destroy(ch);
    if (nh_control_stop(cp) != 0)
        rc = -1;
    for (size_t i = 0; i < npools; i++)
        nh_pool_destroy(pools[i]);
    if (dir && dir[0]) {
        for (size_t i = 0; i < nnodes; i++) {
            if (!nodes[i]->id[0])
                continue;
            nh_node_dump_log(nodes[i]);
            nh_node_remove_files(nodes[i]);
        }
        rmdir(dir);
    }
    return rc;
}
