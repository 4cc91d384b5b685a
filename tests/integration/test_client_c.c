/*
 * test_client_c.c: libkvfence (clients/c) against a real kvfence-control and
 * two real kvfence-node processes on 127.0.0.1, with POSIX shm pools, every
 * call going through the public header only.
 *
 * Covered: join both sides, register pools, submit a chunk, complete, wait
 * for the release (kvf_wait_released and a kvf_watch_leases callback);
 * abort; extend; error paths: bad pages (INVALID_ARGUMENT naming the page),
 * unknown room (NOT_FOUND), server down (UNAVAILABLE in bounded time),
 * deadline exceeded, TLS mismatch (client TLS, server plaintext), bad
 * arguments; page sets (kvf_page_set_encode): a join of 32,768 scattered
 * pages on each side (a bitmap and deltas), an extension, a chunk between
 * scattered pages, the release with every run.
 */
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_proc.h"
#include "kvfence/kvfence.h"

#define WAIT_MS    10000
#define PAGE_SIZE  4096u
#define PAGE_COUNT 64u

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

/* ---- processes ---------------------------------------------------------------- */

struct node_proc {
    pid_t pid;
    char id[16];
    char sock[160];
    char port_file[160];
    kvf_node_client *nc;
};

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
            struct kvf_status st;
            int rc = kvf_node_client_create(np->sock, NULL, &np->nc, &st);
            if (rc)
                fprintf(stderr, "kvf_node_client_create: %s\n", st.message);
            return rc ? -1 : 0;
        }
        int stat;
        if (waitpid(np->pid, &stat, WNOHANG) == np->pid) {
            np->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    return -1;
}

static int node_stop(struct node_proc *np, long ms)
{
    kvf_node_client_destroy(np->nc);
    np->nc = NULL;
    if (np->pid <= 0)
        return 0;
    int stat = -1;
    kill(np->pid, SIGTERM);
    int64_t end = now_ms() + ms;
    while (now_ms() < end) {
        if (waitpid(np->pid, &stat, WNOHANG) == np->pid) {
            np->pid = 0;
            return stat;
        }
        sleep_ms(10);
    }
    kill(np->pid, SIGKILL);
    waitpid(np->pid, &stat, 0);
    np->pid = 0;
    return -2;
}

struct shm_pool {
    char name[64];
    uint8_t *mem;
    uint32_t pool_id;
    uint32_t page_size, page_count;
};

static int shm_create_sized(struct shm_pool *p, const char *tag, uint8_t fill, uint32_t page_size,
                            uint32_t page_count)
{
    snprintf(p->name, sizeof p->name, "/kvf-cc-%d-%s", (int)getpid(), tag);
    int fd = shm_open(p->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
        return -1;
    p->page_size = page_size;
    p->page_count = page_count;
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
    for (size_t i = 0; i < len; i++)
        p->mem[i] = (uint8_t)(fill ^ (i / page_size) ^ (i / page_size >> 8));
    return 0;
}

static int shm_create(struct shm_pool *p, const char *tag, uint8_t fill)
{
    return shm_create_sized(p, tag, fill, PAGE_SIZE, PAGE_COUNT);
}

static void shm_destroy(struct shm_pool *p)
{
    if (p->mem)
        munmap(p->mem, (size_t)p->page_size * p->page_count);
    p->mem = NULL;
    if (p->name[0])
        shm_unlink(p->name);
    p->name[0] = '\0';
}

/* ---- fixture ------------------------------------------------------------------ */

struct fx {
    struct kvf_proc cp;
    kvf_client *c;
    char dir[64];
    struct node_proc n1, n2;
    struct shm_pool p1, p2, big1, big2;
    kvf_watch *watch;
};

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
    kvf_watch_stop(f->watch);
    struct node_proc *nodes[2] = {&f->n1, &f->n2};
    for (int i = 0; i < 2; i++) {
        if (nodes[i]->pid > 0) {
            int stat = node_stop(nodes[i], 8000);
            if (stat < 0 || !WIFEXITED(stat) || WEXITSTATUS(stat) != 0) {
                fprintf(stderr, "kvfence-node %s: status %d on SIGTERM\n", nodes[i]->id, stat);
                rc = -1;
            }
        } else {
            node_stop(nodes[i], 0);
        }
    }
    kvf_client_destroy(f->c);
    if (f->cp.pid > 0) {
        kill(f->cp.pid, SIGCONT); /* test_deadline_exceeded stops it */
        int stat = kvf_proc_stop(&f->cp, 10000);
        if (!WIFEXITED(stat) || WEXITSTATUS(stat) != 0) {
            fprintf(stderr, "kvfence-control: status 0x%x on SIGTERM\n", stat);
            rc = -1;
        }
    }
    kvf_proc_kill(&f->cp);
    shm_destroy(&f->p1);
    shm_destroy(&f->p2);
    shm_destroy(&f->big1);
    shm_destroy(&f->big2);
    if (f->dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
        if (system(cmd) != 0)
            rc = -1;
    }
    free(f);
    return rc;
}

static void cp_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "1500", "--resend-ms", "50", NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    struct kvf_client_opts o;
    kvf_client_opts_init(&o);
    struct kvf_status st;
    int rc = kvf_client_create(f->cp.target, &o, &f->c, &st);
    if (rc)
        fail_msg("kvf_client_create: %s", st.message);
}

static uint32_t register_pool(struct node_proc *np, struct shm_pool *p)
{
    struct kvf_shm_pool sp = {.shm_name = p->name,
                              .size = (uint64_t)p->page_size * p->page_count,
                              .page_size = p->page_size,
                              .page_count = p->page_count};
    struct kvf_status st;
    uint32_t id = 0;
    int rc = kvf_register_pool_shm(np->nc, &sp, &id, &st);
    if (rc)
        fail_msg("kvf_register_pool_shm on %s: %s %s", np->id, kvf_status_name(rc), st.message);
    assert_int_equal(st.code, KVF_STATUS_OK);
    return id;
}

static void fx_start(struct fx *f)
{
    cp_start(f);
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-cc-XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    assert_int_equal(node_start(&f->n1, f->dir, "n1", f->cp.target), 0);
    assert_int_equal(node_start(&f->n2, f->dir, "n2", f->cp.target), 0);
    assert_int_equal(shm_create(&f->p1, "n1", 0x11), 0);
    assert_int_equal(shm_create(&f->p2, "n2", 0x22), 0);
    f->p1.pool_id = register_pool(&f->n1, &f->p1);
    f->p2.pool_id = register_pool(&f->n2, &f->p2);
}

/* Joins, retrying NOT_FOUND while the pool update reaches the control plane. */
static struct kvf_join_result join(struct fx *f, uint64_t room_id, const char *node,
                                   enum kvf_role role, uint32_t pool_id, uint32_t first,
                                   uint32_t count)
{
    struct kvf_page_range pr = {.first = first, .count = count};
    struct kvf_join j = {.room_id = room_id,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = node,
                         .rank = 0,
                         .role = role,
                         .pool_id = pool_id,
                         .ranges = &pr,
                         .n_ranges = 1};
    struct kvf_join_result r;
    struct kvf_status st;
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        int rc = kvf_join_room(f->c, &j, &r, &st);
        if (rc == 0) {
            assert_int_equal(st.code, 0);
            assert_true(r.lease_id >= 1);
            assert_int_equal(r.room.room_id, room_id);
            return r;
        }
        assert_int_equal(rc, -st.code);
        if (now_ms() > end)
            fail_msg("kvf_join_room %s: %s %s", node, kvf_status_name(rc), st.message);
        sleep_ms(20);
    }
}

static struct kvf_chunk chunk_of(struct fx *f, struct kvf_room_key room, uint32_t source_rank,
                                 uint64_t seq, const struct kvf_page_range *s,
                                 const struct kvf_page_range *d, bool last)
{
    struct kvf_chunk c = {.room = room,
                          .chunk_seq = seq,
                          .source_rank = source_rank,
                          .source_pool_id = f->p1.pool_id,
                          .source_ranges = s,
                          .n_source_ranges = 1,
                          .sink_node_id = "n2",
                          .sink_rank = 0,
                          .sink_pool_id = f->p2.pool_id,
                          .sink_ranges = d,
                          .n_sink_ranges = 1,
                          .last_chunk = last};
    return c;
}

/* Waits until `np` knows the room: a chunk of a rank in no lease (99) is
 * UNAVAILABLE before, FAILED_PRECONDITION after. */
static void wait_node_knows(struct fx *f, struct node_proc *np, struct kvf_room_key room)
{
    struct kvf_page_range s = {0, 1}, d = {16, 1};
    struct kvf_chunk c = chunk_of(f, room, 99, 1, &s, &d, false);
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        struct kvf_status st;
        int rc = kvf_submit_chunk(np->nc, &c, &st);
        if (rc == -KVF_STATUS_FAILED_PRECONDITION)
            return;
        if (rc != -KVF_STATUS_UNAVAILABLE)
            fail_msg("node %s: probe answered %s: %s", np->id, kvf_status_name(rc), st.message);
        if (now_ms() > end)
            fail_msg("node %s never learned the room", np->id);
        sleep_ms(10);
    }
}

/* What the watch callback saw (on the library thread). */
struct seen {
    pthread_mutex_t mu;
    uint64_t released[16];
    int n_released;
    int synced;
    int room_states;
    int malformed;
    pthread_t cb_thread;
};

static void on_event(const struct kvf_lease_event *ev, void *ctx)
{
    struct seen *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->cb_thread = pthread_self();
    if (ev->kind == KVF_LEASE_EVENT_RELEASED && s->n_released < 16) {
        if (!ev->node_id || ev->n_ranges == 0 || !ev->ranges)
            s->malformed++; /* checked on the test's thread (no cmocka here) */
        s->released[s->n_released++] = ev->lease_id;
    } else if (ev->kind == KVF_LEASE_EVENT_SYNCED) {
        s->synced++;
    } else if (ev->kind == KVF_LEASE_EVENT_ROOM_STATE) {
        s->room_states++;
    }
    pthread_mutex_unlock(&s->mu);
}

static bool seen_released(struct seen *s, uint64_t lease_id)
{
    bool found = false;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->n_released; i++)
        found = found || s->released[i] == lease_id;
    pthread_mutex_unlock(&s->mu);
    return found;
}

static void wait_seen(struct seen *s, uint64_t lease_id)
{
    int64_t end = now_ms() + WAIT_MS;
    while (!seen_released(s, lease_id)) {
        if (now_ms() > end)
            fail_msg("the watch callback never saw lease %llu released",
                     (unsigned long long)lease_id);
        sleep_ms(10);
    }
}

/* ---- tests -------------------------------------------------------------------- */

static void test_chunk_complete_and_release(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    static struct seen seen = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct kvf_watch_filter wf = {.include_room_states = true};
    struct kvf_status st;
    assert_int_equal(kvf_watch_leases(f->c, &wf, on_event, &seen, &f->watch, &st), 0);

    struct kvf_join_result src = join(f, 101, "n1", KVF_ROLE_SOURCE, f->p1.pool_id, 0, 8);
    struct kvf_join_result snk = join(f, 101, "n2", KVF_ROLE_SINK, f->p2.pool_id, 16, 8);
    assert_int_equal(src.room.generation, snk.room.generation);
    assert_int_equal(snk.state, KVF_ROOM_ACTIVE);
    assert_int_not_equal(src.lease_id, snk.lease_id);
    wait_node_knows(f, &f->n1, src.room);
    wait_node_knows(f, &f->n2, src.room);

    /* Not released yet: a short wait times out. */
    int64_t t0 = now_ms();
    assert_int_equal(kvf_wait_released(f->c, src.lease_id, 100, &st),
                     -KVF_STATUS_DEADLINE_EXCEEDED);
    assert_int_equal(st.code, KVF_STATUS_DEADLINE_EXCEEDED);
    assert_true(now_ms() - t0 >= 90 && now_ms() - t0 < 3000);

    struct kvf_page_range s = {0, 8}, d = {16, 8};
    struct kvf_chunk c = chunk_of(f, src.room, 0, 1, &s, &d, true);
    /* A sink lease version newer than the node's copy (as right after an
     * ExtendLease): UNAVAILABLE naming the field, nothing admitted. */
    c.sink_lease_pages = 9;
    assert_int_equal(kvf_submit_chunk(f->n1.nc, &c, &st), -KVF_STATUS_UNAVAILABLE);
    assert_non_null(strstr(st.message, "sink_lease_pages"));
    c.sink_lease_pages = 8;
    c.source_lease_pages = 8;
    int rc = kvf_submit_chunk(f->n1.nc, &c, &st);
    if (rc)
        fail_msg("kvf_submit_chunk: %s %s", kvf_status_name(rc), st.message);

    struct kvf_participant ps = {.node_id = "n1", .rank = 0, .role = KVF_ROLE_SOURCE};
    struct kvf_participant pk = {.node_id = "n2", .rank = 0, .role = KVF_ROLE_SINK};
    enum kvf_room_state rs;
    rc = kvf_complete_room(f->c, src.room, &ps, &rs, &st);
    if (rc)
        fail_msg("kvf_complete_room (source): %s %s", kvf_status_name(rc), st.message);
    rc = kvf_complete_room(f->c, src.room, &pk, &rs, &st);
    if (rc)
        fail_msg("kvf_complete_room (sink): %s %s", kvf_status_name(rc), st.message);

    rc = kvf_wait_released(f->c, src.lease_id, WAIT_MS, &st);
    if (rc)
        fail_msg("kvf_wait_released (source): %s %s", kvf_status_name(rc), st.message);
    rc = kvf_wait_released(f->c, snk.lease_id, WAIT_MS, &st);
    if (rc)
        fail_msg("kvf_wait_released (sink): %s %s", kvf_status_name(rc), st.message);
    /* Already released: at once, from the replay. */
    t0 = now_ms();
    assert_int_equal(kvf_wait_released(f->c, snk.lease_id, WAIT_MS, &st), 0);
    assert_true(now_ms() - t0 < 2000);

    wait_seen(&seen, src.lease_id);
    wait_seen(&seen, snk.lease_id);
    pthread_mutex_lock(&seen.mu);
    assert_true(seen.synced >= 1);
    assert_true(seen.room_states >= 1);
    assert_int_equal(seen.malformed, 0);
    assert_false(pthread_equal(seen.cb_thread, pthread_self()));
    pthread_mutex_unlock(&seen.mu);

    /* The data landed: n2 pages 16..23 hold n1 pages 0..7. */
    assert_memory_equal(f->p2.mem + (size_t)16 * PAGE_SIZE, f->p1.mem, (size_t)8 * PAGE_SIZE);

    /* The room is over: no more chunks. */
    c.chunk_seq = 2;
    assert_int_not_equal(kvf_submit_chunk(f->n1.nc, &c, &st), 0);
    assert_int_not_equal(st.code, KVF_STATUS_OK);
    kvf_watch_stop(f->watch);
    f->watch = NULL;
}

/* kvf_chunk_stream_*: pipelined chunks, a refused one in the middle with its
 * own result, the room completes with the data in place; then the window: 64
 * outstanding chunks are accepted by the node, the 65th is refused by the
 * library until a result was read. */
static void test_chunk_stream(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    struct kvf_join_result src = join(f, 111, "n1", KVF_ROLE_SOURCE, f->p1.pool_id, 0, 8);
    struct kvf_join_result snk = join(f, 111, "n2", KVF_ROLE_SINK, f->p2.pool_id, 16, 8);
    wait_node_knows(f, &f->n1, src.room);
    wait_node_knows(f, &f->n2, src.room);
    struct kvf_status st;
    kvf_chunk_stream *cs = NULL;
    assert_int_equal(kvf_chunk_stream_open(f->n1.nc, &cs, &st), 0);
    struct kvf_page_range s[5] = {{0, 1}, {1, 1}, {2, 1}, {2, 1}, {3, 5}};
    struct kvf_page_range d[5] = {{16, 1}, {17, 1}, {40, 1}, {18, 1}, {19, 5}};
    for (int i = 0; i < 5; i++) {
        struct kvf_chunk c = chunk_of(f, src.room, 0, (uint64_t)i + 1, &s[i], &d[i], i == 4);
        int rc = kvf_chunk_stream_send(cs, &c, &st);
        if (rc)
            fail_msg("kvf_chunk_stream_send %d: %s %s", i, kvf_status_name(rc), st.message);
    }
    assert_int_equal(kvf_chunk_stream_outstanding(cs), 5);
    assert_int_equal(kvf_chunk_stream_close_send(cs, &st), 0);
    /* Closed for sending: refused, and not counted as outstanding. */
    struct kvf_chunk late = chunk_of(f, src.room, 0, 6, &s[0], &d[0], false);
    assert_int_equal(kvf_chunk_stream_send(cs, &late, &st), -KVF_STATUS_FAILED_PRECONDITION);
    assert_int_equal(kvf_chunk_stream_outstanding(cs), 5);
    for (int i = 0; i < 5; i++) {
        struct kvf_chunk_result r;
        assert_int_equal(kvf_chunk_stream_result(cs, WAIT_MS, &r, &st), 1);
        assert_int_equal(r.chunk_seq, (uint64_t)i + 1);
        if (i == 2) {
            assert_int_equal(r.status.code, KVF_STATUS_FAILED_PRECONDITION);
            assert_non_null(strstr(r.status.message, "sink_ranges"));
        } else if (r.status.code != KVF_STATUS_OK) {
            fail_msg("chunk %d: %s %s", i + 1, kvf_status_name(r.status.code), r.status.message);
        }
    }
    struct kvf_chunk_result r;
    assert_int_equal(kvf_chunk_stream_result(cs, WAIT_MS, &r, &st), 0); /* ended OK */
    assert_int_equal(kvf_chunk_stream_outstanding(cs), 0);
    kvf_chunk_stream_destroy(cs);

    struct kvf_participant ps = {.node_id = "n1", .rank = 0, .role = KVF_ROLE_SOURCE};
    struct kvf_participant pk = {.node_id = "n2", .rank = 0, .role = KVF_ROLE_SINK};
    enum kvf_room_state rs;
    assert_int_equal(kvf_complete_room(f->c, src.room, &ps, &rs, &st), 0);
    assert_int_equal(kvf_complete_room(f->c, src.room, &pk, &rs, &st), 0);
    assert_int_equal(kvf_wait_released(f->c, src.lease_id, WAIT_MS, &st), 0);
    assert_int_equal(kvf_wait_released(f->c, snk.lease_id, WAIT_MS, &st), 0);
    assert_memory_equal(f->p2.mem + (size_t)16 * PAGE_SIZE, f->p1.mem, (size_t)8 * PAGE_SIZE);

    /* The window: chunks of a rank in no lease, each refused by the node. */
    assert_int_equal(kvf_chunk_stream_open(f->n1.nc, &cs, &st), 0);
    /* Nothing sent yet: a bounded wait for a result times out. */
    assert_int_equal(kvf_chunk_stream_result(cs, 50, &r, &st), -KVF_STATUS_DEADLINE_EXCEEDED);
    struct kvf_page_range s1 = {0, 1}, d1 = {16, 1};
    for (uint64_t i = 1; i <= KVF_CHUNK_STREAM_WINDOW; i++) {
        struct kvf_chunk c = chunk_of(f, src.room, 99, i, &s1, &d1, false);
        assert_int_equal(kvf_chunk_stream_send(cs, &c, &st), 0);
    }
    struct kvf_chunk c = chunk_of(f, src.room, 99, 100, &s1, &d1, false);
    assert_int_equal(kvf_chunk_stream_send(cs, &c, &st), -KVF_STATUS_RESOURCE_EXHAUSTED);
    assert_int_equal(kvf_chunk_stream_result(cs, WAIT_MS, &r, &st), 1);
    assert_int_equal(r.chunk_seq, 1);
    assert_int_not_equal(r.status.code, KVF_STATUS_OK);
    assert_int_equal(kvf_chunk_stream_send(cs, &c, &st), 0);
    for (uint64_t i = 2; i <= KVF_CHUNK_STREAM_WINDOW; i++) {
        assert_int_equal(kvf_chunk_stream_result(cs, WAIT_MS, &r, &st), 1);
        assert_int_equal(r.chunk_seq, i);
    }
    assert_int_equal(kvf_chunk_stream_result(cs, WAIT_MS, &r, &st), 1);
    assert_int_equal(r.chunk_seq, 100);
    kvf_chunk_stream_destroy(cs); /* cancels: not half-closed */
}

static void test_abort_releases(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    struct kvf_join_result src = join(f, 202, "n1", KVF_ROLE_SOURCE, f->p1.pool_id, 0, 8);
    struct kvf_join_result snk = join(f, 202, "n2", KVF_ROLE_SINK, f->p2.pool_id, 16, 8);
    wait_node_knows(f, &f->n2, src.room);
    struct kvf_abort_result ar;
    struct kvf_status st;
    int rc = kvf_abort_room(f->c, src.room, "test abort", &ar, &st);
    if (rc)
        fail_msg("kvf_abort_room: %s %s", kvf_status_name(rc), st.message);
    assert_int_equal(ar.room.generation, src.room.generation);
    assert_false(ar.already_aborting);
    assert_true(ar.token_hi != 0 || ar.token_lo != 0);
    /* Idempotent: same token. */
    struct kvf_abort_result ar2;
    assert_int_equal(kvf_abort_room(f->c, src.room, NULL, &ar2, &st), 0);
    assert_true(ar2.already_aborting);
    assert_true(ar2.token_hi == ar.token_hi && ar2.token_lo == ar.token_lo);

    rc = kvf_wait_released(f->c, src.lease_id, WAIT_MS, &st);
    if (rc)
        fail_msg("kvf_wait_released: %s %s", kvf_status_name(rc), st.message);
    assert_int_equal(kvf_wait_released(f->c, snk.lease_id, WAIT_MS, &st), 0);

    struct kvf_page_range s = {0, 8}, d = {16, 8};
    struct kvf_chunk c = chunk_of(f, src.room, 0, 1, &s, &d, true);
    rc = kvf_submit_chunk(f->n1.nc, &c, &st);
    assert_true(rc == -KVF_STATUS_ABORTED || rc == -KVF_STATUS_FAILED_PRECONDITION);
    /* Completing an aborted room: ABORTED. */
    struct kvf_participant ps = {.node_id = "n1", .rank = 0, .role = KVF_ROLE_SOURCE};
    assert_int_equal(kvf_complete_room(f->c, src.room, &ps, NULL, &st), -KVF_STATUS_ABORTED);
}

static void test_extend_and_bad_pages(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    struct kvf_join_result src = join(f, 303, "n1", KVF_ROLE_SOURCE, f->p1.pool_id, 0, 4);
    assert_int_equal(src.state, KVF_ROOM_OPENING);
    struct kvf_status st;
    struct kvf_page_range more = {4, 4};
    int rc = kvf_extend_lease(f->c, src.room, src.lease_id, &more, 1, &st);
    if (rc)
        fail_msg("kvf_extend_lease: %s %s", kvf_status_name(rc), st.message);

    /* Pages outside the pool on join: INVALID_ARGUMENT naming the page. */
    struct kvf_page_range bad = {.first = PAGE_COUNT + 5, .count = 2};
    struct kvf_join j = {.room_id = 304,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = "n1",
                         .role = KVF_ROLE_SOURCE,
                         .pool_id = f->p1.pool_id,
                         .ranges = &bad,
                         .n_ranges = 1};
    rc = kvf_join_room(f->c, &j, NULL, &st);
    assert_int_equal(rc, -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(st.code, KVF_STATUS_INVALID_ARGUMENT);
    fprintf(stderr, "bad pages: %s\n", st.message);
    assert_non_null(strstr(st.message, "69"));

    /* Extend with pages outside the pool: refused, names the page. */
    struct kvf_page_range bad2 = {.first = 1000, .count = 1};
    rc = kvf_extend_lease(f->c, src.room, src.lease_id, &bad2, 1, &st);
    assert_true(rc == -KVF_STATUS_INVALID_ARGUMENT || rc == -KVF_STATUS_FAILED_PRECONDITION);
    fprintf(stderr, "bad extend: %s\n", st.message);
    assert_non_null(strstr(st.message, "1000"));

    /* Unknown pool on a known node: NOT_FOUND. */
    struct kvf_page_range ok = {0, 1};
    j.room_id = 305;
    j.pool_id = 9999;
    j.ranges = &ok;
    assert_int_equal(kvf_join_room(f->c, &j, NULL, &st), -KVF_STATUS_NOT_FOUND);

    /* A shm pool that does not exist: the node refuses, cleanly. */
    struct kvf_shm_pool sp = {.shm_name = "/kvf-cc-no-such-shm",
                              .size = PAGE_SIZE,
                              .page_size = PAGE_SIZE,
                              .page_count = 1};
    uint32_t id;
    rc = kvf_register_pool_shm(f->n1.nc, &sp, &id, &st);
    assert_true(rc < 0);
    assert_int_equal(rc, -st.code);
    assert_int_equal(kvf_abort_room(f->c, src.room, "cleanup", NULL, &st), 0);
}

static void test_unknown_room(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    struct kvf_status st;
    struct kvf_room_key room = {.room_id = 987654, .generation = 3};
    int rc = kvf_abort_room(f->c, room, "nothing", NULL, &st);
    assert_int_equal(rc, -KVF_STATUS_NOT_FOUND);
    assert_int_equal(st.code, KVF_STATUS_NOT_FOUND);
    assert_true(st.message[0] != '\0');
    struct kvf_page_range pr = {0, 1};
    assert_int_equal(kvf_extend_lease(f->c, room, 77, &pr, 1, &st), -KVF_STATUS_NOT_FOUND);
    struct kvf_participant p = {.node_id = "n1", .rank = 0, .role = KVF_ROLE_SOURCE};
    assert_int_equal(kvf_complete_room(f->c, room, &p, NULL, &st), -KVF_STATUS_NOT_FOUND);
    /* An unknown node on join: NOT_FOUND. */
    struct kvf_join j = {.room_id = 5,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = "ghost",
                         .role = KVF_ROLE_SINK,
                         .pool_id = 1,
                         .ranges = &pr,
                         .n_ranges = 1};
    assert_int_equal(kvf_join_room(f->c, &j, NULL, &st), -KVF_STATUS_NOT_FOUND);
}

/* A TCP port where nothing listens (bound, then closed). */
static int dead_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

static void test_server_down(void **state)
{
    (void)state;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", dead_port());
    kvf_client *c;
    struct kvf_status st;
    assert_int_equal(kvf_client_create(target, NULL, &c, &st), 0);
    struct kvf_page_range pr = {0, 1};
    struct kvf_join j = {.room_id = 1,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = "n1",
                         .role = KVF_ROLE_SOURCE,
                         .pool_id = 1,
                         .ranges = &pr,
                         .n_ranges = 1};
    int64_t t0 = now_ms();
    assert_int_equal(kvf_join_room(c, &j, NULL, &st), -KVF_STATUS_UNAVAILABLE);
    assert_int_equal(st.code, KVF_STATUS_UNAVAILABLE);
    assert_true(now_ms() - t0 < 5000);
    struct kvf_room_key room = {1, 0};
    assert_int_equal(kvf_abort_room(c, room, NULL, NULL, &st), -KVF_STATUS_UNAVAILABLE);
    /* A wait against a dead server ends at its deadline, saying why. */
    t0 = now_ms();
    assert_int_equal(kvf_wait_released(c, 1, 300, &st), -KVF_STATUS_DEADLINE_EXCEEDED);
    assert_true(now_ms() - t0 < 3000);
    fprintf(stderr, "server down wait: %s\n", st.message);
    /* A watch against a dead server reports disconnections, stops cleanly. */
    static struct seen seen = {.mu = PTHREAD_MUTEX_INITIALIZER};
    kvf_watch *w;
    assert_int_equal(kvf_watch_leases(c, NULL, on_event, &seen, &w, &st), 0);
    sleep_ms(200);
    kvf_watch_stop(w);
    kvf_client_destroy(c);

    /* The node's socket missing: UNAVAILABLE. */
    kvf_node_client *n;
    assert_int_equal(kvf_node_client_create("/tmp/kvf-cc-no-such.sock", NULL, &n, &st), 0);
    struct kvf_shm_pool sp = {.shm_name = "/x", .size = 4096, .page_size = 4096, .page_count = 1};
    uint32_t id;
    assert_int_equal(kvf_register_pool_shm(n, &sp, &id, &st), -KVF_STATUS_UNAVAILABLE);
    kvf_node_client_destroy(n);
}

/* Waits until every thread of `pid` is stopped (state T in /proc). */
static void wait_stopped(pid_t pid)
{
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        char cmd[160];
        snprintf(cmd, sizeof cmd,
                 "cat /proc/%d/task/*/stat 2>/dev/null | awk '{print $3}' | grep -qv '^[tT]$'",
                 (int)pid);
        if (system(cmd) != 0)
            return;
        if (now_ms() > end)
            fail_msg("process %d did not stop", (int)pid);
        sleep_ms(5);
    }
}

static void test_deadline_exceeded(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    struct kvf_status st;
    /* A lease that does not exist is never released. */
    int64_t t0 = now_ms();
    assert_int_equal(kvf_wait_released(f->c, 424242, 150, &st), -KVF_STATUS_DEADLINE_EXCEEDED);
    int64_t took = now_ms() - t0;
    assert_true(took >= 140 && took < 3000);
    /* A unary call to a server that does not answer (stopped): its
     * deadline fires. */
    struct kvf_client_opts o;
    kvf_client_opts_init(&o);
    o.call_timeout_ms = 200;
    kvf_client *c;
    assert_int_equal(kvf_client_create(f->cp.target, &o, &c, &st), 0);
    struct kvf_room_key room = {1, 0};
    assert_int_equal(kvf_abort_room(c, room, NULL, NULL, &st), -KVF_STATUS_NOT_FOUND);
    assert_int_equal(kill(f->cp.pid, SIGSTOP), 0);
    wait_stopped(f->cp.pid);
    t0 = now_ms();
    int rc = kvf_abort_room(c, room, NULL, NULL, &st);
    took = now_ms() - t0;
    kill(f->cp.pid, SIGCONT);
    fprintf(stderr, "stopped server: %s %s (%lld ms)\n", kvf_status_name(rc), st.message,
            (long long)took);
    assert_int_equal(rc, -KVF_STATUS_DEADLINE_EXCEEDED);
    assert_int_equal(st.code, KVF_STATUS_DEADLINE_EXCEEDED);
    assert_true(took >= 190 && took < 3000);
    kvf_client_destroy(c);
}

static char tls_dir[64];

static void test_tls_mismatch(void **state)
{
    struct fx *f = *state;
    cp_start(f); /* plaintext */
    snprintf(tls_dir, sizeof tls_dir, "/tmp/kvf-cc-tls-XXXXXX");
    assert_non_null(mkdtemp(tls_dir));
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
             "-days 2 -subj /CN=kvf-test-ca >/dev/null 2>&1",
             tls_dir);
    if (system(cmd) != 0) {
        snprintf(cmd, sizeof cmd, "rm -rf %s", tls_dir);
        (void)system(cmd);
        skip();
    }
    char ca[128];
    snprintf(ca, sizeof ca, "%s/ca.pem", tls_dir);
    struct kvf_client_opts o;
    kvf_client_opts_init(&o);
    o.tls_root_ca_path = ca;
    o.call_timeout_ms = 3000;
    kvf_client *c;
    struct kvf_status st;
    assert_int_equal(kvf_client_create(f->cp.target, &o, &c, &st), 0);
    struct kvf_room_key room = {1, 0};
    int64_t t0 = now_ms();
    int rc = kvf_abort_room(c, room, NULL, NULL, &st);
    fprintf(stderr, "TLS to plaintext: %s %s\n", kvf_status_name(rc), st.message);
    assert_true(rc == -KVF_STATUS_UNAVAILABLE || rc == -KVF_STATUS_DEADLINE_EXCEEDED);
    assert_true(now_ms() - t0 < 5000);
    kvf_client_destroy(c);

    /* Unreadable CA, half a key pair: refused at create. */
    o.tls_root_ca_path = "/nonexistent/ca.pem";
    assert_int_equal(kvf_client_create(f->cp.target, &o, &c, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_null(c);
    o.tls_root_ca_path = ca;
    o.tls_cert_path = ca;
    assert_int_equal(kvf_client_create(f->cp.target, &o, &c, &st), -KVF_STATUS_INVALID_ARGUMENT);
    snprintf(cmd, sizeof cmd, "rm -rf %s", tls_dir);
    assert_int_equal(system(cmd), 0);
}

/* ---- page sets ------------------------------------------------------------------- */

#define BIG_PAGE   8u
#define BIG1_PAGES 65536u  /* the source pool: every other page is 32,768 */
#define BIG2_PAGES 524288u /* the sink pool: 32,768 random pages of it */
#define SET_PAGES  32768u

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545f4914f6cdd1dull;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Joins with a page set, retrying NOT_FOUND while the pool update lands. */
static struct kvf_join_result join_pages(struct fx *f, uint64_t room_id, const char *node,
                                         enum kvf_role role, uint32_t pool_id,
                                         const kvf_page_set *set)
{
    struct kvf_join j = {.room_id = room_id,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = node,
                         .role = role,
                         .pool_id = pool_id};
    struct kvf_join_result r;
    struct kvf_status st;
    int64_t end = now_ms() + WAIT_MS;
    for (;;) {
        int rc = kvf_join_room_pages(f->c, &j, set, &r, &st);
        if (rc == 0)
            return r;
        if (rc != -KVF_STATUS_NOT_FOUND || now_ms() > end)
            fail_msg("kvf_join_room_pages %s: %s %s", node, kvf_status_name(rc), st.message);
        sleep_ms(20);
    }
}

struct released {
    pthread_mutex_t mu;
    uint64_t lease_id;
    size_t n_ranges, pages;
    bool sorted;
};

static void on_released(const struct kvf_lease_event *ev, void *ctx)
{
    struct released *r = ctx;
    if (ev->kind != KVF_LEASE_EVENT_RELEASED)
        return;
    pthread_mutex_lock(&r->mu);
    if (ev->lease_id == r->lease_id) {
        r->n_ranges = ev->n_ranges;
        r->pages = 0;
        r->sorted = true;
        for (size_t i = 0; i < ev->n_ranges; i++) {
            r->pages += ev->ranges[i].count;
            if (i > 0 && ev->ranges[i - 1].first + ev->ranges[i - 1].count >= ev->ranges[i].first)
                r->sorted = false;
        }
    }
    pthread_mutex_unlock(&r->mu);
}

/* 32,768 scattered pages on each side of a room, through the public header:
 * every other page of the source pool (a bitmap), 32,768 random pages of the
 * sink pool in random order (deltas); the source's lease extended by a page
 * set; a chunk between scattered pages lands where the pages say; the
 * released sink lease carries every page as ascending runs. */
static void test_page_sets_32k(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    assert_int_equal(shm_create_sized(&f->big1, "big1", 0x31, BIG_PAGE, BIG1_PAGES), 0);
    assert_int_equal(shm_create_sized(&f->big2, "big2", 0x42, BIG_PAGE, BIG2_PAGES), 0);
    f->big1.pool_id = register_pool(&f->n1, &f->big1);
    f->big2.pool_id = register_pool(&f->n2, &f->big2);
    struct kvf_status st;

    uint32_t *src = malloc(SET_PAGES * sizeof(*src));
    uint32_t *dst = malloc(SET_PAGES * sizeof(*dst));
    uint8_t *taken = calloc(BIG2_PAGES, 1);
    assert_non_null(src);
    assert_non_null(dst);
    assert_non_null(taken);
    for (uint32_t i = 0; i < SET_PAGES; i++)
        src[i] = 2 * i + 2; /* 2, 4, ..., 65536 - 0: page 0 is left for the extension */
    src[SET_PAGES - 1] = 0;
    uint64_t seed = 11;
    for (uint32_t i = 0; i < SET_PAGES;) {
        uint32_t pg = (uint32_t)(rng_next(&seed) % BIG2_PAGES);
        if (!taken[pg]) {
            taken[pg] = 1;
            dst[i++] = pg;
        }
    }
    kvf_page_set *sset = NULL, *dset = NULL, *more = NULL;
    assert_int_equal(kvf_page_set_encode(src, SET_PAGES, &sset, &st), 0);
    assert_int_equal(kvf_page_set_encode(dst, SET_PAGES, &dset, &st), 0);
    assert_int_equal(kvf_page_set_form(sset), KVF_PAGE_SET_BITMAP);
    assert_int_equal(kvf_page_set_form(dset), KVF_PAGE_SET_DELTAS);
    assert_int_equal(kvf_page_set_page_count(sset), SET_PAGES);
    assert_int_equal(kvf_page_set_run_count(sset), SET_PAGES);
    fprintf(stderr, "page sets: source %zu bytes (bitmap), sink %zu bytes (deltas)\n",
            kvf_page_set_wire_size(sset), kvf_page_set_wire_size(dset));
    assert_true(kvf_page_set_wire_size(sset) < 8300);
    assert_true(kvf_page_set_wire_size(dset) < 40000);

    struct kvf_join_result sj = join_pages(f, 901, "n1", KVF_ROLE_SOURCE, f->big1.pool_id, sset);
    assert_int_equal(sj.state, KVF_ROOM_OPENING);
    uint32_t odd[] = {3, 1};
    assert_int_equal(kvf_page_set_encode(odd, 2, &more, &st), 0);
    int rc = kvf_extend_lease_pages(f->c, sj.room, sj.lease_id, more, &st);
    if (rc)
        fail_msg("kvf_extend_lease_pages: %s %s", kvf_status_name(rc), st.message);
    /* A page the lease holds already: refused, naming the form and the page. */
    rc = kvf_extend_lease_pages(f->c, sj.room, sj.lease_id, more, &st);
    assert_int_equal(rc, -KVF_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "page_set.deltas")); /* {1, 3}: 2 bytes */
    assert_non_null(strstr(st.message, "already in this lease"));

    static struct released rel = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct kvf_join_result dj = join_pages(f, 901, "n2", KVF_ROLE_SINK, f->big2.pool_id, dset);
    assert_int_equal(dj.state, KVF_ROOM_ACTIVE);
    rel.lease_id = dj.lease_id;
    struct kvf_watch_filter wf = {0};
    assert_int_equal(kvf_watch_leases(f->c, &wf, on_released, &rel, &f->watch, &st), 0);

    /* A chunk from source pages 0, 1, 3 (the extension's and the set's) to
     * the sink's three lowest pages. Both nodes learn the room first: the
     * source's node answers UNAVAILABLE until it knows the sink's lease. */
    qsort(dst, SET_PAGES, sizeof(*dst), cmp_u32);
    struct kvf_page_range s[2] = {{0, 2}, {3, 1}};
    struct kvf_page_range d[3] = {{dst[0], 1}, {dst[1], 1}, {dst[2], 1}};
    struct kvf_chunk c = {.room = sj.room,
                          .chunk_seq = 1,
                          .source_pool_id = f->big1.pool_id,
                          .source_ranges = s,
                          .n_source_ranges = 2,
                          .sink_node_id = "n2",
                          .sink_pool_id = f->big2.pool_id,
                          .sink_ranges = d,
                          .n_sink_ranges = 3,
                          .last_chunk = true};
    uint32_t from[3] = {0, 1, 3};
    for (int i = 0; i < 3; i++) /* not there before the chunk */
        assert_memory_not_equal(f->big2.mem + (size_t)dst[i] * BIG_PAGE,
                                f->big1.mem + (size_t)from[i] * BIG_PAGE, BIG_PAGE);
    int64_t end = now_ms() + WAIT_MS;
    while ((rc = kvf_submit_chunk(f->n1.nc, &c, &st)) == -KVF_STATUS_UNAVAILABLE && now_ms() < end)
        sleep_ms(20);
    if (rc)
        fail_msg("kvf_submit_chunk: %s %s", kvf_status_name(rc), st.message);
    /* The bytes land in the sink's scattered pages (a sink completes only
     * when its whole lease landed, so the room is aborted afterwards). */
    end = now_ms() + WAIT_MS;
    for (int i = 0; i < 3;) {
        if (memcmp(f->big2.mem + (size_t)dst[i] * BIG_PAGE,
                   f->big1.mem + (size_t)from[i] * BIG_PAGE, BIG_PAGE) == 0) {
            i++;
            continue;
        }
        if (now_ms() > end)
            fail_msg("sink page %u never received source page %u", dst[i], from[i]);
        sleep_ms(10);
    }
    assert_int_equal(kvf_abort_room(f->c, sj.room, "page-set test", NULL, &st), 0);
    rc = kvf_wait_released(f->c, dj.lease_id, WAIT_MS, &st);
    if (rc)
        fail_msg("kvf_wait_released: %s %s", kvf_status_name(rc), st.message);
    assert_int_equal(kvf_wait_released(f->c, sj.lease_id, WAIT_MS, &st), 0);

    end = now_ms() + WAIT_MS;
    for (;;) {
        pthread_mutex_lock(&rel.mu);
        size_t pages = rel.pages, nr = rel.n_ranges;
        bool sorted = rel.sorted;
        pthread_mutex_unlock(&rel.mu);
        if (pages > 0) {
            assert_int_equal(pages, SET_PAGES);
            assert_true(nr > SET_PAGES / 2);
            assert_true(sorted);
            break;
        }
        if (now_ms() > end)
            fail_msg("no release event for the sink lease");
        sleep_ms(20);
    }
    kvf_watch_stop(f->watch);
    f->watch = NULL;

    /* Refused before a call: a page twice, pages with ranges. */
    uint32_t twice[] = {5, 9, 5};
    kvf_page_set *bad = NULL;
    assert_int_equal(kvf_page_set_encode(twice, 3, &bad, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_null(bad);
    assert_non_null(strstr(st.message, "page 5 is listed twice"));
    struct kvf_page_range r0 = {0, 1};
    struct kvf_join j = {.room_id = 902,
                         .expected_sources = 1,
                         .expected_sinks = 1,
                         .node_id = "n1",
                         .role = KVF_ROLE_SOURCE,
                         .pool_id = f->big1.pool_id,
                         .ranges = &r0,
                         .n_ranges = 1};
    assert_int_equal(kvf_join_room_pages(f->c, &j, sset, NULL, &st), -KVF_STATUS_INVALID_ARGUMENT);
    kvf_page_set_destroy(sset);
    kvf_page_set_destroy(dset);
    kvf_page_set_destroy(more);
    free(src);
    free(dst);
    free(taken);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    struct kvf_status st;
    kvf_client *c = (kvf_client *)1;
    assert_int_equal(kvf_client_create(NULL, NULL, &c, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_null(c);
    assert_int_equal(kvf_client_create("127.0.0.1:1", NULL, NULL, &st),
                     -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_join_room(NULL, NULL, NULL, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_join_room(NULL, NULL, NULL, NULL), -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_wait_released(NULL, 1, 1, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_submit_chunk(NULL, NULL, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_watch_leases(NULL, NULL, NULL, NULL, NULL, &st),
                     -KVF_STATUS_INVALID_ARGUMENT);
    assert_string_equal(kvf_status_name(-KVF_STATUS_NOT_FOUND), "NOT_FOUND");
    assert_int_equal(kvf_client_create("127.0.0.1:1", NULL, &c, &st), 0);
    struct kvf_join j = {.room_id = 1, .node_id = "n1", .ranges = NULL, .n_ranges = 3};
    assert_int_equal(kvf_join_room(c, &j, NULL, &st), -KVF_STATUS_INVALID_ARGUMENT);
    assert_int_equal(kvf_wait_released(c, 0, 1, &st), -KVF_STATUS_INVALID_ARGUMENT);
    kvf_client_destroy(c);
    kvf_client_destroy(NULL);
    kvf_node_client_destroy(NULL);
    kvf_watch_stop(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_chunk_complete_and_release, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chunk_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_releases, setup, teardown),
        cmocka_unit_test_setup_teardown(test_extend_and_bad_pages, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_room, setup, teardown),
        cmocka_unit_test_setup_teardown(test_server_down, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deadline_exceeded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tls_mismatch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_arguments, setup, teardown),
        cmocka_unit_test_setup_teardown(test_page_sets_32k, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
