/*
 * test_node_owner.c: the node's owner loop (node.c) never blocks and never
 * spins.
 *
 * test_idle_owner_sleeps (issue 15): an attached node with nothing to do
 * wakes its owner thread ("kvf-owner") only for what is due (heartbeats, the
 * control plane's acks): its voluntary context switches over 3 s stay in the
 * tens. Before, the owner waited on a 2 ms timed condition variable: about
 * 1500 wake-ups in 3 s.
 *
 * test_blackholed_peer_keeps_heartbeats (issue 12, item 5): a chunk towards
 * a peer whose data port never answers does not stop the node.
 *
 * One kvfence-control, one kvfence-node n1 (node_harness.c) and a fake node
 * n2 (fake_node.c) whose Hello names, as its TCP data endpoint, a blackholed
 * address on loopback: a listener with a backlog of 0 that never accepts, its
 * accept queue filled first, so the kernel drops every further SYN and a
 * connect to it hangs in SYN retries (minutes). The test joins a room (n1
 * source, n2 sink) and submits one chunk on n1. Then:
 *  - the SubmitChunk call is answered at once (the chunk is queued);
 *  - for longer than the control plane needs to find a silent node SUSPECT
 *    (heartbeat timeout) and LOST (node ttl), n1 stays ATTACHED and does not
 *    fence itself: its owner thread kept heartbeating while the connect was
 *    pending;
 *  - at the connect deadline (--data-connect-timeout-ms) the chunk fails with
 *    a clear error in the log, and the room leaves ACTIVE (a timer failed the
 *    chunk; no page was released by it).
 * Before, n1's owner thread blocked in connect() inside SubmitChunk: the call
 * ran into its deadline, heartbeats stopped and n1 went SUSPECT, then LOST.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <dirent.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmocka.h>

#include "fake_node.h"
#include "kvf_error.h"
#include "kvfence/v1/control.pb-c.h"
#include "node_harness.h"

#define CONNECT_DEADLINE_MS "8000"
#define WATCH_MS            6000 /* > heartbeat timeout + node ttl of the control plane */

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1;
    struct nh_pool p1;
    int lfd;
    int fill[2];
    struct fake_node *n2;
    pthread_t n2_thread;
    bool n2_running;
    atomic_bool n2_stop;
};

static int setup(void **state)
{
    int rc = nh_fx_alloc(state, sizeof(struct fx));
    if (rc == 0) {
        struct fx *f = *state;
        f->lfd = f->fill[0] = f->fill[1] = -1;
    }
    return rc;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    if (f->n2_running) {
        atomic_store(&f->n2_stop, true);
        pthread_join(f->n2_thread, NULL);
    }
    fake_node_close(f->n2);
    struct nh_node *nodes[] = {&f->n1};
    struct nh_pool *pools[] = {&f->p1};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 1, 8000, pools, 1, f->dir);
    for (int i = 0; i < 2; i++)
        if (f->fill[i] >= 0)
            close(f->fill[i]);
    if (f->lfd >= 0)
        close(f->lfd);
    free(f);
    return rc;
}

/* The blackholed address: listen(fd, 0), never accept, two connects of ours
 * in its queue. Returns its port. */
static uint16_t blackhole(struct fx *f)
{
    f->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(f->lfd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(f->lfd, 0), 0);
    socklen_t len = sizeof sa;
    assert_int_equal(getsockname(f->lfd, (struct sockaddr *)&sa, &len), 0);
    for (int i = 0; i < 2; i++) {
        f->fill[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        assert_true(f->fill[i] >= 0);
        int rc = connect(f->fill[i], (struct sockaddr *)&sa, sizeof sa);
        assert_true(rc == 0 || errno == EINPROGRESS);
    }
    struct pollfd pf = {.fd = f->fill[0], .events = POLLOUT};
    assert_int_equal(poll(&pf, 1, 5000), 1);
    return ntohs(sa.sin_port);
}

/* n2 heartbeats every 200 ms and reads (and drops) what it is sent. */
static void *n2_main(void *arg)
{
    struct fx *f = arg;
    uint64_t seq = 0;
    while (!atomic_load(&f->n2_stop)) {
        Kvfence__V1__Heartbeat h = KVFENCE__V1__HEARTBEAT__INIT;
        h.seq = ++seq;
        Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
        m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT;
        m.heartbeat = &h;
        (void)fake_node_send(f->n2, &m);
        int64_t until = nh_now_ms() + 200;
        while (nh_now_ms() < until && !atomic_load(&f->n2_stop)) {
            Kvfence__V1__ControlMessage *cm = NULL;
            if (fake_node_recv(f->n2, 50, &cm, NULL) == 0)
                kvfence__v1__control_message__free_unpacked(cm, NULL);
            else
                nh_sleep_ms(20);
        }
    }
    return NULL;
}

/* The control plane's state of node `id`. */
static int node_state(struct fx *f, const char *id)
{
    Kvfence__V1__GetNodeRequest req = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    req.node_id = (char *)id;
    uint8_t *resp = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    int code = nh_call(f->ch, "/kvfence.v1.Admin/GetNode", &req.base, &resp, &len, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("GetNode %s: %s: %s", id, kvf_grpc_code_name((enum kvf_grpc_code)code),
                 st.message);
    Kvfence__V1__NodeInfo *ni = kvfence__v1__node_info__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(ni);
    int s = (int)ni->state;
    kvfence__v1__node_info__free_unpacked(ni, NULL);
    return s;
}

/* The voluntary context switches of node `pid`'s thread named `name` so far;
 * fails the test when there is no such thread. */
static long thread_switches(pid_t pid, const char *name)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    assert_non_null(d);
    long found = -1;
    struct dirent *e;
    while ((e = readdir(d)) && found < 0) {
        if (e->d_name[0] == '.')
            continue;
        char path[384], comm[32] = "";
        snprintf(path, sizeof path, "%s/%s/comm", dir, e->d_name);
        FILE *fp = fopen(path, "r");
        if (!fp)
            continue;
        if (!fgets(comm, sizeof comm, fp))
            comm[0] = '\0';
        fclose(fp);
        comm[strcspn(comm, "\n")] = '\0';
        if (strcmp(comm, name) != 0)
            continue;
        snprintf(path, sizeof path, "%s/%s/status", dir, e->d_name);
        fp = fopen(path, "r");
        assert_non_null(fp);
        char line[256];
        while (fgets(line, sizeof line, fp))
            if (sscanf(line, "voluntary_ctxt_switches: %ld", &found) == 1)
                break;
        fclose(fp);
    }
    closedir(d);
    if (found < 0)
        fail_msg("node %d has no thread named %s", (int)pid, name);
    return found;
}

static void test_idle_owner_sleeps(void **state)
{
    struct fx *f = *state;
    const char *args[] = {"--threads", "2", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "owner");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, 0), 0);
    nh_sleep_ms(500); /* past the first heartbeat exchange */
    long before = thread_switches(f->n1.pid, "kvf-owner");
    nh_sleep_ms(3000);
    long woke = thread_switches(f->n1.pid, "kvf-owner") - before;
    fprintf(stderr, "idle owner thread: %ld wake-ups in 3 s\n", woke);
    /* Heartbeats (1/s) and their acks, with room to spare; a timer tick of
     * even 10 ms would be 300. */
    assert_true(woke < 60);
}

static void test_blackholed_peer_keeps_heartbeats(void **state)
{
    struct fx *f = *state;
    uint16_t hole = blackhole(f);
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "1500", "--heartbeat-timeout-ms",
                          "2500",      NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "connect");
    const char *extra[] = {"--data-connect-timeout-ms", CONNECT_DEADLINE_MS, NULL};
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, extra, NH_LOG_FILE),
                     0);

    static const uint8_t key[32] = {0x8d, 0x2a, 0x51, 0x07, 0xe3, 0x66, 0x1c, 0x9b,
                                    0x40, 0x75, 0xaf, 0x12, 0xd8, 0x3e, 0x94, 0x61,
                                    0x0b, 0xc7, 0x58, 0x2f, 0xe1, 0x7a, 0x36, 0x9d,
                                    0x45, 0x13, 0xbe, 0x60, 0x29, 0xf4, 0x87, 0x5c};
    static const char *const features[] = {"QUIESCE_V1", "FENCE_V1", "TCP"};
    struct fake_node_hello h = {.node_id = "n2",
                                .incarnation = 7,
                                .features = features,
                                .n_features = 3,
                                .data_port = hole,
                                .peer_key = key};
    struct kvf_rpc_status st;
    assert_int_equal(fake_node_open(f->ch, &h, 5000, &f->n2, NULL, &st), 0);
    assert_int_equal(pthread_create(&f->n2_thread, NULL, n2_main, f), 0);
    f->n2_running = true;

    assert_int_equal(nh_pool_create(&f->p1, "conn", "p1", FAKE_NODE_PAGE_SIZE, 16, nh_canary1), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    kvf_room_key k =
        nh_join_pair(f->ch, 1, "n1", f->p1.pool_id, 0, "n2", FAKE_NODE_POOL_ID, 0, 4, 10000);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", FAKE_NODE_POOL_ID, 0, 10000);

    struct nh_chunk c = {.source_rank = 0,
                         .seq = 1,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_pool = FAKE_NODE_POOL_ID,
                         .sfirst = {0},
                         .dfirst = {0},
                         .count = {4},
                         .last = true};
    int64_t t0 = nh_now_ms();
    int code = nh_submit(f->n1.local, k, &c, &st);
    int64_t answered = nh_now_ms() - t0;

    /* The node stays attached while its connect waits. */
    while (nh_now_ms() - t0 < WATCH_MS) {
        int s = node_state(f, "n1");
        if (s != KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED)
            fail_msg("n1 is in state %d %lld ms after the chunk to a blackholed peer (want "
                     "ATTACHED: its heartbeats stopped)",
                     s, (long long)(nh_now_ms() - t0));
        assert_int_equal(nh_log_count(&f->n1, "self-fenc", NULL), 0);
        nh_sleep_ms(100);
    }
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %s: %s", kvf_grpc_code_name((enum kvf_grpc_code)code), st.message);
    assert_true(answered < 2000);
    assert_int_equal(nh_room_state(f->ch, k, NULL, NULL),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);

    /* At the deadline the chunk fails, naming why; the room stops. */
    nh_wait_log(&f->n1, "Connection timed out", NULL, 1, 10000);
    nh_wait_log(&f->n1, "a frame failed: tcp: Connection timed out", &k, 1, 5000);
    int64_t end = nh_now_ms() + 10000;
    while (nh_room_state(f->ch, k, NULL, NULL) == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE) {
        assert_true(nh_now_ms() < end);
        nh_sleep_ms(50);
    }
    assert_int_equal(node_state(f, "n1"), KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_idle_owner_sleeps, setup, teardown),
        cmocka_unit_test_setup_teardown(test_blackholed_peer_keeps_heartbeats, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
