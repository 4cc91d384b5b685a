/*
 * test_node_channels.c: kvfence-node's data channels admit only the peer
 * incarnations the control plane introduced (issue 13; docs/design.md §4,
 * "Identity"). Each test starts one kvfence-control and two kvfence-node
 * processes (n1: source, n2: sink) on 127.0.0.1 (node_harness.c) and plays a
 * third party that knows everything public: both node ids and incarnations and
 * their endpoints (from the nodes' start lines), n2's peer-channel public key
 * when it logs one, the room, the pool ids and the sink lease.
 *
 * - Data port: a frame for the sink's leased pages sent behind a hello that
 *   names n1 (the version-1 hello: two ids, both public), and one behind a
 *   version-2 hello with a made-up proof, never land in n2's pool; n2 closes
 *   both connections and logs the refusal.
 * - Peer channel: AuxData and TransferStatus(ok=false) stamped as n1's, pushed
 *   to n2's peer endpoint from a plain ZeroMQ socket and from a CURVE socket
 *   with a key pair of its own, never reach n2's Watch.
 * In both, n1's own transfer of the room then lands and completes well, with
 * n1's aux bytes and an ok transfer_done.
 * KVF_TEST_FILTER=<cmocka pattern> runs only the matching tests.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmocka.h>
#include <zmq.h>

#include "kvf_error.h"
#include "kvfence/v1/peer.pb-c.h"
#include "node_harness.h"

#define WAIT_MS    10000
#define PAGE_SIZE  4096u
#define PAGE_COUNT 64u
#define FIRST      16u /* the room's lease: pages [FIRST, FIRST + COUNT) on both nodes */
#define COUNT      8u

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    struct nh_node n1, n2;
    struct nh_pool p1, p2;
};

/* What a node's start line says ("kvfence-node <id> incarnation <n>: data tcp
 * <host>:<port>, peer <endpoint>, ..."), and its peer key when it logs one. */
struct seen_node {
    uint64_t incarnation;
    uint16_t data_port;
    char peer_ep[96];
    char peer_key[48]; /* Z85, "" when the node does not log one */
};

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static int teardown(void **state)
{
    struct fx *f = *state;
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    struct nh_pool *pools[] = {&f->p1, &f->p2};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 20000, pools, 2, f->dir);
    free(f);
    return rc;
}

static void fx_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "chan");
    assert_int_equal(nh_node_start(&f->n1, f->dir, "n1", "n1", f->cp.target, NULL, NH_LOG_FILE), 0);
    assert_int_equal(nh_node_start(&f->n2, f->dir, "n2", "n2", f->cp.target, NULL, NH_LOG_FILE), 0);
    assert_int_equal(nh_pool_create(&f->p1, "chan", "n1", PAGE_SIZE, PAGE_COUNT, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&f->p2, "chan", "n2", PAGE_SIZE, PAGE_COUNT, nh_canary2), 0);
    f->p1.pool_id = nh_register_pool(&f->n1, &f->p1);
    f->p2.pool_id = nh_register_pool(&f->n2, &f->p2);
}

static void seen_node_read(const struct nh_node *np, const char *id, struct seen_node *out)
{
    memset(out, 0, sizeof *out);
    char needle[64];
    snprintf(needle, sizeof needle, "kvfence-node %s incarnation ", id);
    FILE *fp = fopen(np->log, "r");
    assert_non_null(fp);
    char *line = NULL;
    size_t cap = 0;
    bool found = false;
    while (!found && getline(&line, &cap, fp) >= 0) {
        const char *p = strstr(line, needle);
        if (!p)
            continue;
        unsigned port = 0;
        char ep[96] = "";
        if (sscanf(p + strlen(needle), "%" SCNu64 ": data tcp %*[^:]:%u, peer %95[^,]",
                   &out->incarnation, &port, ep) != 3)
            continue;
        out->data_port = (uint16_t)port;
        snprintf(out->peer_ep, sizeof out->peer_ep, "%s", ep);
        /* Z85: the scanset names all 85 characters (']' must come first). */
        const char *k = strstr(p, "peer key ");
        if (k)
            (void)sscanf(k + 9, "%40[]0-9a-zA-Z.:+=^!/*?&<>()@%{}$#[-]", out->peer_key);
        found = true;
    }
    free(line);
    fclose(fp);
    if (!found)
        fail_msg("node %s: no start line in %s", id, np->log);
}

/* The version-1 data-port id: a public hash of the node id and incarnation. */
static uint64_t v1_tcp_id(const char *node_id, uint64_t incarnation)
{
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)node_id; *p; p++) {
        h ^= *p;
        h *= 1099511628211ull;
    }
    h ^= incarnation * 0x9e3779b97f4a7c15ull;
    return h ? h : 1;
}

static void put_le(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* A 64-byte data frame header (tcp.h): one page of pool `pool`. */
static void frame_header(uint8_t h[64], kvf_room_key k, uint32_t pool, uint32_t page)
{
    memset(h, 0, 64);
    put_le(h, 0x4446564bu, 4);
    put_le(h + 4, 1, 2);
    put_le(h + 8, k.room_id, 8);
    put_le(h + 16, k.generation, 8);
    put_le(h + 24, 1, 8); /* seq */
    put_le(h + 32, pool, 4);
    put_le(h + 36, page, 4);
    put_le(h + 40, 1, 4);
    put_le(h + 48, 0, 8);
    put_le(h + 56, PAGE_SIZE, 8);
}

static int connect_local(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    return fd;
}

/* Sends `len` bytes; a refusal may already have closed the connection. */
static void send_some(int fd, const void *buf, size_t len)
{
    (void)send(fd, buf, len, MSG_NOSIGNAL);
}

/* True once the peer closed the connection (EOF or reset) within `ms`; bytes
 * it sends (a challenge) are read and dropped. */
static bool closed_within(int fd, int ms)
{
    int64_t end = nh_now_ms() + ms;
    for (;;) {
        int64_t left = end - nh_now_ms();
        if (left <= 0)
            return false;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, (int)left) <= 0)
            continue;
        uint8_t buf[256];
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n <= 0)
            return true;
    }
}

static bool page_is(const struct nh_pool *p, uint32_t page, nh_canary_fn canary)
{
    for (uint32_t i = 0; i < PAGE_SIZE; i++)
        if (p->mem[(size_t)page * PAGE_SIZE + i] != canary(page, i))
            return false;
    return true;
}

static bool page_untouched_for(const struct nh_pool *p, uint32_t page, int ms)
{
    int64_t end = nh_now_ms() + ms;
    do {
        if (!page_is(p, page, nh_canary2))
            return false;
        nh_sleep_ms(10);
    } while (nh_now_ms() < end);
    return true;
}

/* ---- Watch ---------------------------------------------------------------------------- */

static struct kvf_rpc_client_stream *watch_open(struct nh_node *np, kvf_room_key k)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    Kvfence__V1__RoomKey *rkp[1] = {&rk};
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__WatchRequest req = KVFENCE__V1__WATCH_REQUEST__INIT;
    req.n_rooms = 1;
    req.rooms = rkp;
    uint8_t buf[64];
    size_t len = kvfence__v1__watch_request__get_packed_size(&req);
    assert_true(len <= sizeof buf);
    kvfence__v1__watch_request__pack(&req, buf);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(np->local, "/kvfence.v1.NodeLocal/Watch", 60000);
    assert_non_null(cs);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(cs), 0);
    return cs;
}

static Kvfence__V1__NodeEvent *watch_must(struct kvf_rpc_client_stream *cs)
{
    uint8_t *msg;
    size_t len;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, WAIT_MS, &msg, &len, &st);
    if (rc != 0)
        fail_msg("watch: no event within %d ms (%d)", WAIT_MS, rc);
    Kvfence__V1__NodeEvent *ev = kvfence__v1__node_event__unpack(NULL, len, msg);
    free(msg);
    assert_non_null(ev);
    return ev;
}

/* Waits for the room's ACTIVE room_state: from then on Watch is live. */
static void watch_sync(struct kvf_rpc_client_stream *cs)
{
    for (;;) {
        Kvfence__V1__NodeEvent *ev = watch_must(cs);
        bool hit = ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_ROOM_STATE &&
                   ev->room_state->state == KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE;
        kvfence__v1__node_event__free_unpacked(ev, NULL);
        if (hit)
            return;
    }
}

static const uint8_t LEGIT_AUX[] = "aux bytes from n1 itself";
static const uint8_t FORGED_AUX[] = "forged aux bytes";

/* n1 sends the room's pages with LEGIT_AUX on the last chunk; n2's Watch must
 * show exactly that aux, then an ok transfer_done, and the pages land. */
static void legit_transfer(struct fx *f, kvf_room_key k, struct kvf_rpc_client_stream *w2)
{
    struct nh_chunk c = {.source_rank = 0,
                         .seq = 1,
                         .source_pool = f->p1.pool_id,
                         .sink_node = "n2",
                         .sink_rank = 0,
                         .sink_pool = f->p2.pool_id,
                         .n = 1,
                         .sfirst = {FIRST},
                         .dfirst = {FIRST},
                         .count = {COUNT},
                         .last = true,
                         .aux = LEGIT_AUX,
                         .aux_len = sizeof LEGIT_AUX};
    struct kvf_rpc_status st;
    int code = nh_submit(f->n1.local, k, &c, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk: %d %s", code, st.message);
    bool aux = false;
    for (;;) {
        Kvfence__V1__NodeEvent *ev = watch_must(w2);
        if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_AUX) {
            if (aux || ev->aux->data.len != sizeof LEGIT_AUX ||
                memcmp(ev->aux->data.data, LEGIT_AUX, sizeof LEGIT_AUX) != 0)
                fail_msg("n2's Watch showed aux bytes n1 did not send (%zu bytes)",
                         ev->aux->data.len);
            aux = true;
        } else if (ev->event_case == KVFENCE__V1__NODE_EVENT__EVENT_TRANSFER_DONE) {
            if (!aux || !ev->transfer_done->ok)
                fail_msg("transfer_done ok=%d (%s) before/without n1's aux", ev->transfer_done->ok,
                         ev->transfer_done->error ? ev->transfer_done->error : "");
            kvfence__v1__node_event__free_unpacked(ev, NULL);
            break;
        }
        kvfence__v1__node_event__free_unpacked(ev, NULL);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    for (uint32_t pg = FIRST; pg < FIRST + COUNT; pg++)
        if (!page_is(&f->p2, pg, nh_canary1))
            fail_msg("n2 page %u does not hold n1's bytes", pg);
}

static kvf_room_key room_pair(struct fx *f, uint64_t room_id)
{
    kvf_room_key k = nh_join_pair(f->ch, room_id, "n1", f->p1.pool_id, FIRST, "n2", f->p2.pool_id,
                                  FIRST, COUNT, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->p1.pool_id, "n2", f->p2.pool_id, 0, WAIT_MS);
    return k;
}

/* ---- tests ------------------------------------------------------------------------------- */

static void test_forged_data_port_frame_lands_nowhere(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = room_pair(f, 701);
    struct seen_node s1, s2;
    seen_node_read(&f->n1, "n1", &s1);
    seen_node_read(&f->n2, "n2", &s2);
    struct kvf_rpc_client_stream *w2 = watch_open(&f->n2, k);
    watch_sync(w2);

    uint8_t payload[PAGE_SIZE];
    memset(payload, 0xEE, sizeof payload);
    uint8_t hdr[64];

    /* The version-1 hello: magic, version 1, flags, from n1, to n2. */
    int fd = connect_local(s2.data_port);
    uint8_t hello[24] = {0};
    put_le(hello, 0x4846564bu, 4);
    put_le(hello + 4, 1, 2);
    put_le(hello + 8, v1_tcp_id("n1", s1.incarnation), 8);
    put_le(hello + 16, v1_tcp_id("n2", s2.incarnation), 8);
    send_some(fd, hello, sizeof hello);
    frame_header(hdr, k, f->p2.pool_id, FIRST);
    send_some(fd, hdr, sizeof hdr);
    send_some(fd, payload, sizeof payload);
    bool closed = closed_within(fd, 1000);
    close(fd);
    if (!page_untouched_for(&f->p2, FIRST, 200))
        fail_msg("a third party's frame (version-1 hello naming n1) landed in n2's page %u", FIRST);
    assert_true(closed);

    /* A version-2 hello (a nonce), then a proof it cannot have computed. */
    fd = connect_local(s2.data_port);
    uint8_t hello2[56] = {0};
    put_le(hello2, 0x4846564bu, 4);
    put_le(hello2 + 4, 2, 2);
    put_le(hello2 + 8, v1_tcp_id("n1", s1.incarnation), 8);
    put_le(hello2 + 16, v1_tcp_id("n2", s2.incarnation), 8);
    memset(hello2 + 24, 0x5a, 32);
    send_some(fd, hello2, sizeof hello2);
    uint8_t proof[36] = {0};
    put_le(proof, 0x5046564bu, 4);
    memset(proof + 4, 0xa5, 32);
    send_some(fd, proof, sizeof proof);
    frame_header(hdr, k, f->p2.pool_id, FIRST + 1);
    send_some(fd, hdr, sizeof hdr);
    send_some(fd, payload, sizeof payload);
    closed = closed_within(fd, 3000);
    close(fd);
    if (!page_untouched_for(&f->p2, FIRST + 1, 200))
        fail_msg("a third party's frame (made-up proof) landed in n2's page %u", FIRST + 1);
    assert_true(closed);
    nh_wait_log(&f->n2, "data port: refused", NULL, 2, WAIT_MS);

    legit_transfer(f, k, w2);
    kvf_rpc_client_stream_close(w2);
}

/* One PeerFrame{envelope} from n1 (as `s1` says) to n2, packed into buf. */
static size_t forged_envelope(uint8_t *buf, size_t cap, kvf_room_key k, const struct seen_node *s1,
                              const struct seen_node *s2, uint64_t seq, bool aux)
{
    Kvfence__V1__RoomKey rk = KVFENCE__V1__ROOM_KEY__INIT;
    rk.room_id = k.room_id;
    rk.generation = k.generation;
    Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
    env.room = &rk;
    env.sender_node_id = (char *)"n1";
    env.sender_incarnation = s1->incarnation;
    env.receiver_node_id = (char *)"n2";
    env.receiver_incarnation = s2->incarnation;
    env.seq = seq;
    Kvfence__V1__AuxData ad = KVFENCE__V1__AUX_DATA__INIT;
    Kvfence__V1__TransferStatus ts = KVFENCE__V1__TRANSFER_STATUS__INIT;
    if (aux) {
        ad.chunk_seq = 1;
        ad.data.data = (uint8_t *)FORGED_AUX;
        ad.data.len = sizeof FORGED_AUX;
        env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_AUX_DATA;
        env.aux_data = &ad;
    } else {
        ts.ok = false;
        ts.error = (char *)"forged failure";
        env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_TRANSFER_STATUS;
        env.transfer_status = &ts;
    }
    Kvfence__V1__PeerFrame fr = KVFENCE__V1__PEER_FRAME__INIT;
    fr.frame_case = KVFENCE__V1__PEER_FRAME__FRAME_ENVELOPE;
    fr.envelope = &env;
    size_t len = kvfence__v1__peer_frame__get_packed_size(&fr);
    assert_true(len <= cap);
    kvfence__v1__peer_frame__pack(&fr, buf);
    return len;
}

/* Pushes AuxData (seq 1) and TransferStatus ok=false (seq 2) as n1's; with
 * `curve`, from a CURVE client with a key pair of its own. */
static void forge_peer(void *zctx, kvf_room_key k, const struct seen_node *s1,
                       const struct seen_node *s2, bool curve)
{
    void *s = zmq_socket(zctx, ZMQ_PUSH);
    assert_non_null(s);
    int linger = 500;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (curve) {
        char pub[41], sec[41];
        assert_int_equal(zmq_curve_keypair(pub, sec), 0);
        assert_int_equal(zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, s2->peer_key, 40), 0);
        assert_int_equal(zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, pub, 40), 0);
        assert_int_equal(zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec, 40), 0);
    }
    assert_int_equal(zmq_connect(s, s2->peer_ep), 0);
    uint8_t buf[512];
    for (uint64_t seq = 1; seq <= 2; seq++) {
        size_t len = forged_envelope(buf, sizeof buf, k, s1, s2, seq, seq == 1);
        assert_true(zmq_send(s, buf, len, 0) >= 0); /* queued; nobody may deliver it */
    }
    zmq_close(s);
}

static void test_forged_peer_envelopes_never_reach_watch(void **state)
{
    struct fx *f = *state;
    fx_start(f);
    kvf_room_key k = room_pair(f, 702);
    struct seen_node s1, s2;
    seen_node_read(&f->n1, "n1", &s1);
    seen_node_read(&f->n2, "n2", &s2);
    struct kvf_rpc_client_stream *w2 = watch_open(&f->n2, k);
    watch_sync(w2);

    void *zctx = zmq_ctx_new();
    assert_non_null(zctx);
    forge_peer(zctx, k, &s1, &s2, false);
    if (s2.peer_key[0])
        forge_peer(zctx, k, &s1, &s2, true);
    zmq_ctx_term(zctx); /* waits up to the linger for the frames to go out */
    nh_sleep_ms(500);   /* what was accepted would be delivered by now */
    if (s2.peer_key[0])
        nh_wait_log(&f->n2, "peer channel: refused", NULL, 1, WAIT_MS);

    /* Watch must show n1's aux first, then an ok transfer_done. */
    legit_transfer(f, k, w2);
    kvf_rpc_client_stream_close(w2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_forged_data_port_frame_lands_nowhere, setup, teardown),
        cmocka_unit_test_setup_teardown(test_forged_peer_envelopes_never_reach_watch, setup,
                                        teardown),
    };
    if (getenv("KVF_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVF_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
