/*
 * test_node_session_e2e.c: kvfence-node's session with kvfence-control, end
 * to end with real processes. Each test starts one kvfence-control and two
 * kvfence-node processes (n1, n2; node_harness.c) on 127.0.0.1, plays
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"

#define WAIT_MS     15000
#define PAGE_SIZE   4096u
#define PAGE_COUNT  64u
#define NODE_TTL_MS 1500
/* The node self-fences after node_ttl minus a fifth of silence; its last word
 * came up to a heartbeat interval (a fifth) before the cut: at the earliest
 * 3/5 of node_ttl after the cut (less 100 ms of slack). */
#define SELF_FENCE_MIN_MS (NODE_TTL_MS * 3 / 5 - 100)

/* ---- fixture (the harness: node_harness.c) ---------------------------------------- */

struct fx {
    struct kvf_proc cp;
    char cp_port[16];
    char data_dir[96]; /* durable tests */
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2, p3;
};

static int shm_create(struct nh_pool *p, const char *tag, nh_canary_fn fill)
{
    return nh_pool_create(p, "se2e", tag, PAGE_SIZE, PAGE_COUNT, fill);
}

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
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
    /* nh_teardown sends SIGCONT to the control plane first (a test may have
     * stopped it); the directory holds its data too: removed here. */
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    struct nh_pool *pools[] = {&f->p1, &f->p2, &f->p3};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 8000, pools, 3, NULL);
    if (f->dir[0])
        nftw(f->dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(f);
    return rc;
}

static int unregister_pool(struct nh_node *np, uint32_t pool_id, struct kvf_rpc_status *st)
{
    Kvfence__V1__UnregisterPoolRequest req = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    req.pool_id = pool_id;
    return nh_call(np->local, "/kvfence.v1.NodeLocal/UnregisterPool", &req.base, NULL, NULL, st);
}

/* Joins one participant (rank 0) of a room with one source and one sink;
 * *lease_p gets the lease id when not NULL. */
static kvf_room_key join(struct fx *f, uint64_t room_id, const char *node, int role,
                         uint32_t pool_id, uint32_t first, uint32_t count, uint64_t *lease_p)
{
    return nh_join(f->ch, room_id, 1, 1, node, 0, role, pool_id, first, count, WAIT_MS, lease_p);
}

/* The control plane's view of a node (free it); NULL when unknown. */
static Kvfence__V1__NodeInfo *get_node(struct fx *f, const char *id)
{
    Kvfence__V1__GetNodeRequest req = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    req.node_id = (char *)id;
    uint8_t *resp;
    size_t len;
    struct kvf_rpc_status st;
    int code = nh_call(f->ch, "/kvfence.v1.Admin/GetNode", &req.base, &resp, &len, &st);
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
    int64_t end = nh_now_ms() + WAIT_MS;
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
        if (nh_now_ms() > end)
            fail_msg("node %s: state %d, not ATTACHED at a new incarnation", id, s);
        nh_sleep_ms(20);
    }
}

/* SubmitChunk of source rank `source_rank` on `np`: n1's pages [sfirst,
 * +count) -> n2's pages [dfirst, +count). Returns the status code. */
static int submit_v(struct fx *f, struct nh_node *np, kvf_room_key k, uint32_t source_rank,
                    uint64_t seq, uint32_t sfirst, uint32_t dfirst, uint32_t count, bool last,
                    uint64_t source_lease_pages, struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.source_rank = source_rank,
                         .seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_pool = f->p2.pool_id,
                         .sfirst = {sfirst},
                         .dfirst = {dfirst},
                         .count = {count},
                         .last = last,
                         .source_lease_pages = source_lease_pages};
    return nh_submit(np->local, k, &c, st);
}

static int submit(struct fx *f, struct nh_node *np, kvf_room_key k, uint64_t seq, uint32_t sfirst,
                  uint32_t dfirst, uint32_t count, bool last, struct kvf_rpc_status *st)
{
    return submit_v(f, np, k, 0, seq, sfirst, dfirst, count, last, 0, st);
}

/* A SubmitChunk naming a source rank in no lease (99): UNAVAILABLE before
 * the node has the room's update, FAILED_PRECONDITION while the room is open
 * on the node, ABORTED once its admission is closed. */
static int probe(struct fx *f, struct nh_node *np, kvf_room_key k, struct kvf_rpc_status *st)
{
    return submit_v(f, np, k, 99, 1, 0, 16, 1, false, 0, st);
}

static void wait_node_knows(struct fx *f, struct nh_node *np, kvf_room_key k)
{
    nh_wait_node_knows(np, k, f->p1.pool_id, "n2", f->p2.pool_id, 16, WAIT_MS);
}

/* Waits until `np` has closed the room's admission (probe: ABORTED). */
static int64_t wait_node_closed(struct fx *f, struct nh_node *np, kvf_room_key k,
                                int64_t timeout_ms)
{
    int64_t t0 = nh_now_ms(), end = t0 + timeout_ms;
    for (;;) {
        struct kvf_rpc_status st;
        int code = probe(f, np, k, &st);
        if (code == KVF_GRPC_ABORTED)
            return nh_now_ms() - t0;
        if (code != KVF_GRPC_FAILED_PRECONDITION)
            fail_msg("node %s: unexpected probe answer %d: %s", np->id, code, st.message);
        if (nh_now_ms() > end)
            fail_msg("node %s never closed room %llu (%d %s)", np->id,
                     (unsigned long long)k.room_id, code, st.message);
        nh_sleep_ms(10);
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
static uint16_t node_data_port(const struct nh_node *np)
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
    int64_t end = nh_now_ms() + ms;
    for (int64_t left; (left = end - nh_now_ms()) > 0;) {
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
    nh_tmpdir(f->dir, sizeof f->dir, "se2e");
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
    nh_control_start(&f->cp, &f->ch, args);
    const char *colon = strrchr(f->cp.target, ':');
    assert_non_null(colon);
    snprintf(f->cp_port, sizeof f->cp_port, "%s", colon + 1);
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, 0), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, 0), 0);
    assert_int_equal(shm_create(&f->p1, "n1", nh_canary1), 0);
    assert_int_equal(shm_create(&f->p2, "n2", nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
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
    return nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, 0, "n2", f->p2.pool_id, 16, 8,
                        WAIT_MS);
}

/* n2's pool: pages [16, 24) hold n1's pages [0, 8) when `copied`; every other
 * byte still holds its canary. */
static void check_n2_pool(struct fx *f, bool copied)
{
    nh_check_pool(&f->p2, nh_canary2, 16, copied ? 8 : 0, nh_canary1, 0, "n2");
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
    assert_int_equal(shm_create(&f->p3, "n1b", nh_canary1), 0);
    f->p3.pool_id = nh_register_pool(&f->n1, &f->p3);
    kvf_room_key k = join_pair(f, 101);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    uint64_t inc1 = node_incarnation(f, "n1");
    Kvfence__V1__NodeInfo *ni;
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) { /* the PoolUpdate is on its way */
        ni = get_node(f, "n1");
        assert_non_null(ni);
        bool has = node_has_pool(ni, f->p3.pool_id);
        kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (has)
            break;
        if (nh_now_ms() > end)
            fail_msg("the control plane never learnt pool %u", f->p3.pool_id);
        nh_sleep_ms(20);
    }

    kvf_proc_kill(&f->cp);
    struct kvf_rpc_status st;
    assert_int_equal(unregister_pool(&f->n1, f->p3.pool_id, &st), KVF_GRPC_OK);
    cp_restart(f);

    /* Same incarnation (no self-fence: back well within node_ttl), and the
     * pool is gone from the control plane's view once the Resync is in. */
    end = nh_now_ms() + WAIT_MS;
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
        if (nh_now_ms() > end)
            fail_msg("n1: pool %u still known to the restarted control plane", f->p3.pool_id);
        nh_sleep_ms(20);
    }
    wait_node_attached(f, "n2", 0);
    /* The room survived the restart on both sides. */
    end = nh_now_ms() + WAIT_MS;
    int code;
    while ((code = submit(f, &f->n1, k, 1, 0, 16, 8, true, &st)) == KVF_GRPC_UNAVAILABLE &&
           nh_now_ms() < end)
        nh_sleep_ms(20);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk after the restart: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);

    /* The Resync is in the log: a second restart, with the nodes held still
     * so that none re-attaches yet, recovers the pool list without it. */
    assert_int_equal(kill(f->n1.pid, SIGSTOP), 0);
    assert_int_equal(kill(f->n2.pid, SIGSTOP), 0);
    cp_restart(f);
    end = nh_now_ms() + WAIT_MS;
    while ((ni = get_node(f, "n1")) == NULL && nh_now_ms() < end)
        nh_sleep_ms(20); /* the channel reconnects */
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
 * incarnations transfers. The port file follows: it names the new
 * incarnation's data port, where the node takes its new peer. */
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
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    check_n2_pool(f, false);
    /* The old room stays closed on the node. */
    code = submit(f, &f->n1, k, 2, 0, 16, 8, true, &st);
    assert_int_equal(code, KVF_GRPC_ABORTED);

    /* The new incarnations work: a new room transfers end to end. */
    kvf_room_key k2 = join_pair(f, 203);
    wait_node_knows(f, &f->n1, k2);
    wait_node_knows(f, &f->n2, k2);

    /* n2's new incarnation listens on a new port (--data-port 0): its port
     * file is rewritten after the Welcome, and n2 takes its peer of room k2
     * there as the new incarnation. */
    int64_t end = nh_now_ms() + WAIT_MS;
    while (node_data_port(&f->n2) == port2 && nh_now_ms() < end)
        nh_sleep_ms(20);
    uint16_t new_port = node_data_port(&f->n2);
    if (new_port == port2)
        fail_msg("n2's port file still names %u, the port of its old incarnation", port2);
    int fresh = tcp_dial(new_port);
    if (fresh < 0)
        fail_msg("n2's port file names %u: %s", new_port, strerror(errno));
    tcp_hello(fresh, tcp_id("n1", new1), tcp_id("n2", new2));
    assert_false(tcp_closed_within(fresh, 300));
    close(fresh);
    code = submit(f, &f->n1, k2, 1, 0, 16, 8, true, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk in the new incarnation: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
}

/* SubmitChunk of n1's source rank 0 (pool p1, pages [0, 8)) to a sink on n1
 * itself (pool p3, pages [16, 24)): the local transport. */
static int submit_local(struct fx *f, kvf_room_key k, uint64_t seq, struct kvf_rpc_status *st)
{
    struct nh_chunk c = {.seq = seq,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n1",
                         .sink_pool = f->p3.pool_id,
                         .sfirst = {0},
                         .dfirst = {16},
                         .count = {8},
                         .last = true};
    return nh_submit(f->n1.local, k, &c, st);
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
    assert_int_equal(shm_create(&f->p3, "n1c", nh_canary2), 0);
    f->p3.pool_id = nh_register_pool(&f->n1, &f->p3);
    kvf_room_key k = join(f, 909, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 909, "n1", KVFENCE__V1__ROLE__ROLE_SINK, f->p3.pool_id, 16, 8, NULL);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    struct kvf_rpc_status st;
    int code = submit_local(f, k, 1, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("same-node SubmitChunk: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
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
            f->p3.mem[(size_t)pg * PAGE_SIZE + i] = nh_canary2(pg, i);
    kvf_room_key k3 = join(f, 910, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 910, "n1", KVFENCE__V1__ROLE__ROLE_SINK, f->p3.pool_id, 16, 8, NULL);
    nh_wait_room_state(f->ch, k3, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k3);
    code = submit_local(f, k3, 1, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("same-node SubmitChunk in the new incarnation: %d %s", code, st.message);
    nh_wait_room_state(f->ch, k3, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = 16; pg < 24; pg++)
        for (uint32_t i = 0; i < PAGE_SIZE; i++)
            if (f->p3.mem[(size_t)pg * PAGE_SIZE + i] != nh_canary1(pg - 16, i))
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
    /* LOST: the room aborts and ends once n2 fenced n1; n2's lease is
     * released, n1's own waits for a proof from n1's host. */
    unsigned rel = 0;
    int64_t end = nh_now_ms() + WAIT_MS;
    while (nh_room_state(f->ch, k, &rel, NULL) != KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED ||
           rel != 1) {
        if (nh_now_ms() > end)
            fail_msg("room 303: not ABORTED with n2's lease released (%u)", rel);
        nh_sleep_ms(20);
    }
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);
    /* The same process, self-fenced: its old lifetime drained, its Witness
     * releases n1's lease. */
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
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
    int64_t t0 = nh_now_ms();
    char listen[48];
    snprintf(listen, sizeof listen, "127.0.0.1:%s", f->cp_port);
    kvf_proc_kill(&f->cp);
    const char *args[] = {"--threads",  "2",         "--node-ttl-ms", "300",  "--resend-ms", "50",
                          "--data-dir", f->data_dir, "--listen",      listen, NULL};
    assert_int_equal(kvf_proc_start(&f->cp, KVF_CONTROL_BIN, args), 0);
    int64_t end = nh_now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__NodeInfo *ni = get_node(f, "n1");
        bool lost =
            ni && ni->incarnation == inc1 && ni->state == KVFENCE__V1__NODE_STATE__NODE_STATE_LOST;
        if (ni)
            kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (lost)
            break;
        if (nh_now_ms() > end)
            fail_msg("n1 never LOST at the restarted control plane");
        nh_sleep_ms(10);
    }
    assert_int_equal(kill(f->n1.pid, SIGCONT), 0);
    uint64_t new1 = wait_node_attached(f, "n1", inc1);
    assert_true(new1 > inc1);
    int64_t took = nh_now_ms() - t0;
    if (took >= 6000 * 3 / 5 - 100) /* its own self-fence could be due */
        fail_msg("n1 came back after %lld ms: not by the refusal", (long long)took);
    int st_child;
    assert_int_equal(waitpid(f->n1.pid, &st_child, WNOHANG), 0); /* still running */
    struct kvf_rpc_status st;
    assert_int_equal(submit(f, &f->n1, k, 1, 0, 16, 8, true, &st), KVF_GRPC_ABORTED);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
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
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    check_n2_pool(f, true);
    /* The sink's lifetime drains when its bytes landed and it completed. */
    int64_t end = nh_now_ms() + WAIT_MS;
    while ((code = unregister_pool(&f->n2, f->p2.pool_id, &st)) == KVF_GRPC_FAILED_PRECONDITION &&
           nh_now_ms() < end)
        nh_sleep_ms(20);
    if (code != KVF_GRPC_OK)
        fail_msg("UnregisterPool after completion: %d %s", code, st.message);
    assert_int_equal(unregister_pool(&f->n2, f->p2.pool_id, &st), KVF_GRPC_NOT_FOUND);
    end = nh_now_ms() + WAIT_MS;
    for (;;) {
        Kvfence__V1__NodeInfo *ni = get_node(f, "n2");
        assert_non_null(ni);
        bool gone = !node_has_pool(ni, f->p2.pool_id);
        kvfence__v1__node_info__free_unpacked(ni, NULL);
        if (gone)
            break;
        if (nh_now_ms() > end)
            fail_msg("the control plane still lists n2's pool %u", f->p2.pool_id);
        nh_sleep_ms(20);
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
    assert_int_equal(shm_create(&f->p3, "n2b", nh_canary2), 0);
    uint32_t big = 0;
    struct kvf_rpc_status st;
    assert_int_equal(nh_register_pool_sized(&f->n2, &f->p3, 2 * PAGE_SIZE, &big, &st), KVF_GRPC_OK);
    kvf_room_key k1 = join(f, 505, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, f->p1.pool_id, 0, 8, NULL);
    (void)join(f, 505, "n2", KVFENCE__V1__ROLE__ROLE_SINK, big, 16, 8, NULL);
    nh_wait_room_state(f->ch, k1, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k1);
    f->p2.pool_id = big; /* submit() names the sink pool from p2 */
    int code = submit(f, &f->n1, k1, 1, 0, 16, 8, true, &st);
    assert_int_equal(code, KVF_GRPC_FAILED_PRECONDITION);
    assert_non_null(strstr(st.message, "page_size"));
    nh_sleep_ms(100); /* a window for a stray byte to land (there must be none) */
    for (size_t i = 0; i < (size_t)PAGE_SIZE * PAGE_COUNT; i++)
        if (f->p3.mem[i] != nh_canary2((uint32_t)(i / PAGE_SIZE), (uint32_t)(i % PAGE_SIZE)))
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
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE, WAIT_MS);
    wait_node_knows(f, &f->n1, k);
    wait_node_knows(f, &f->n2, k);
    struct kvf_rpc_status st;
    /* A version the node does not have: UNAVAILABLE, naming the field. */
    int code = submit_v(f, &f->n1, k, 0, 1, 0, 16, 4, false, 8, &st);
    assert_int_equal(code, KVF_GRPC_UNAVAILABLE);
    assert_non_null(strstr(st.message, "source_lease_pages"));
    /* Extend to 8 pages and submit the new pages at once with the version. */
    nh_extend_lease(f->ch, k, lease, 4, 4);
    int64_t end = nh_now_ms() + WAIT_MS;
    int unavailable = 0;
    while ((code = submit_v(f, &f->n1, k, 0, 1, 0, 16, 8, true, 8, &st)) == KVF_GRPC_UNAVAILABLE &&
           nh_now_ms() < end) {
        unavailable++;
        nh_sleep_ms(5);
    }
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk of the extended lease: %d %s (after %d UNAVAILABLE)", code,
                 st.message, unavailable);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
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
