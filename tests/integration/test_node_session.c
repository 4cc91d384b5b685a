/*
 * test_node_session.c: kvfence-control's node sessions end to end. Every test
 * starts its own kvfence-control (KVF_CONTROL_BIN, kvf_proc.c) with short
 * timers, attaches fake nodes (fake_node.c) over NodeSession/Attach, plays the
 * engine with unary Control calls, and watches releases with
 * Control/WatchLeases. Waits are on events with timeouts; fixed waits are used
 * only to check that nothing arrives within a window.
 *
 * The teardown closes every stream and stops the control plane with SIGTERM:
 * it must exit 0 (under the sanitizer build, that includes no leak report).
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include <cmocka.h>

#include "fake_node.h"
#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "rpc_client.h"

#define CALL_TIMEOUT_MS  5000
#define EVENT_TIMEOUT_MS 5000
#define MAX_NODES        4
#define MAX_WATCHES      4
#define MAX_EVENTS       64

/* ---- fixture ------------------------------------------------------------- */

struct watch {
    struct kvf_rpc_client_stream *cs;
    uint64_t released[MAX_EVENTS]; /* lease ids, in arrival order */
    size_t nreleased;
    Kvfence__V1__RoomStateChange *states[MAX_EVENTS]; /* owned */
    size_t nstates;
};

struct fx {
    struct kvf_proc proc;
    struct kvf_rpc_channel *ch;
    struct fake_node *nodes[MAX_NODES];
    struct watch *watches[MAX_WATCHES];
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

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof *f);
    if (!f) {
        return -1;
    }
    *state = f;
    return 0;
}

static void watch_close(struct watch *w)
{
    if (!w) {
        return;
    }
    kvf_rpc_client_stream_close(w->cs);
    for (size_t i = 0; i < w->nstates; i++) {
        kvfence__v1__room_state_change__free_unpacked(w->states[i], NULL);
    }
    free(w);
}

static int teardown(void **state)
{
    struct fx *f = *state;
    int rc = 0;
    for (size_t i = 0; i < MAX_NODES; i++) {
        fake_node_vanish(f->nodes[i]);
    }
    for (size_t i = 0; i < MAX_WATCHES; i++) {
        watch_close(f->watches[i]);
    }
    kvf_rpc_channel_destroy(f->ch);
    if (f->proc.pid > 0) {
        int status = kvf_proc_stop(&f->proc, 10000);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "kvfence-control did not exit 0 on SIGTERM (status 0x%x)\n", status);
            rc = -1;
        }
    }
    kvf_proc_kill(&f->proc);
    free(f);
    return rc;
}

/* Starts kvfence-control with "--threads 2" and the given NULL-terminated
 * arguments, and a channel to it. */
static void fx_start(struct fx *f, ...)
{
    const char *args[32] = {"--threads", "2"};
    size_t n = 2;
    va_list ap;
    va_start(ap, f);
    const char *a;
    while ((a = va_arg(ap, const char *)) != NULL && n < 31) {
        args[n++] = a;
    }
    va_end(ap);
    args[n] = NULL;
    assert_int_equal(kvf_proc_start(&f->proc, KVF_CONTROL_BIN, args), 0);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    f->ch = kvf_rpc_channel_create(f->proc.target, &co);
    assert_non_null(f->ch);
}

/* Attaches node `id` (incarnation `inc`) into slot `slot`. */
static struct fake_node *fx_attach(struct fx *f, size_t slot, const char *id, uint64_t inc)
{
    assert_true(slot < MAX_NODES);
    assert_null(f->nodes[slot]);
    f->nodes[slot] = fake_node_attach(f->ch, id, inc);
    if (!f->nodes[slot]) {
        fail_msg("node %s incarnation %llu could not attach", id, (unsigned long long)inc);
    }
    return f->nodes[slot];
}

/* ---- unary calls ------------------------------------------------------------- */

static int call(struct fx *f, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp_p,
                struct kvf_rpc_status *st)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    int rc = kvf_rpc_unary(f->ch, method, buf, len, CALL_TIMEOUT_MS, &resp, &resp_len, st);
    free(buf);
    if (rc == 0 && resp_desc && resp_p) {
        *resp_p = protobuf_c_message_unpack(resp_desc, NULL, resp_len, resp);
        assert_non_null(*resp_p);
    }
    free(resp);
    return rc;
}

/* JoinRoom of (node, rank 0, role) with pages [first, first + count) of pool 1
 * and engine capabilities {1, 1, [QUIESCE_V1]}. Returns the kvf_rpc_unary
 * result; *resp_p on OK. */
static int join(struct fx *f, uint64_t room_id, const char *node, Kvfence__V1__Role role,
                uint32_t first, uint32_t count, Kvfence__V1__JoinRoomResponse **resp_p,
                struct kvf_rpc_status *st)
{
    Kvfence__V1__Participant p = KVFENCE__V1__PARTICIPANT__INIT;
    p.node_id = (char *)node;
    p.rank = 0;
    p.role = role;
    char *features[1] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 1;
    caps.n_features = 1;
    caps.features = features;
    Kvfence__V1__PageRange r = KVFENCE__V1__PAGE_RANGE__INIT;
    r.first = first;
    r.count = count;
    Kvfence__V1__PageRange *rs[1] = {&r};
    Kvfence__V1__JoinRoomRequest rq = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    rq.room_id = room_id;
    rq.expected_sources = 1;
    rq.expected_sinks = 1;
    rq.participant = &p;
    rq.engine_capabilities = &caps;
    rq.pool_id = FAKE_NODE_POOL_ID;
    rq.n_ranges = 1;
    rq.ranges = rs;
    ProtobufCMessage *m = NULL;
    int rc = call(f, "/kvfence.v1.Control/JoinRoom", &rq.base,
                  &kvfence__v1__join_room_response__descriptor, &m, st);
    if (resp_p) {
        *resp_p = (Kvfence__V1__JoinRoomResponse *)m;
    } else if (m) {
        protobuf_c_message_free_unpacked(m, NULL);
    }
    return rc;
}

static Kvfence__V1__RoomInfo *get_room(struct fx *f, uint64_t room_id, uint64_t generation)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = room_id;
    key.generation = generation;
    Kvfence__V1__GetRoomRequest rq = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    rq.room = &key;
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;
    if (call(f, "/kvfence.v1.Admin/GetRoom", &rq.base, &kvfence__v1__room_info__descriptor, &m,
             &st) != 0) {
        fail_msg("GetRoom %llu: code %d (%s)", (unsigned long long)room_id, st.code, st.message);
    }
    return (Kvfence__V1__RoomInfo *)m;
}

static Kvfence__V1__Stats *get_stats(struct fx *f)
{
    Kvfence__V1__GetStatsRequest rq = KVFENCE__V1__GET_STATS_REQUEST__INIT;
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;
    if (call(f, "/kvfence.v1.Admin/GetStats", &rq.base, &kvfence__v1__stats__descriptor, &m, &st) !=
        0) {
        fail_msg("GetStats: code %d (%s)", st.code, st.message);
    }
    return (Kvfence__V1__Stats *)m;
}

/* The node's state, or 0 when GetNode says NOT_FOUND. */
static int node_state(struct fx *f, const char *node_id)
{
    Kvfence__V1__GetNodeRequest rq = KVFENCE__V1__GET_NODE_REQUEST__INIT;
    rq.node_id = (char *)node_id;
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;
    int rc = call(f, "/kvfence.v1.Admin/GetNode", &rq.base, &kvfence__v1__node_info__descriptor, &m,
                  &st);
    if (rc != 0) {
        if (st.code == KVF_GRPC_NOT_FOUND) {
            return 0;
        }
        fail_msg("GetNode %s: code %d (%s)", node_id, st.code, st.message);
    }
    int s = ((Kvfence__V1__NodeInfo *)m)->state;
    protobuf_c_message_free_unpacked(m, NULL);
    return s;
}

static void wait_node_state(struct fx *f, const char *node_id, int want, int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    int s;
    while ((s = node_state(f, node_id)) != want) {
        if (now_ms() > end) {
            fail_msg("node %s: state %d after %lld ms, want %d", node_id, s, (long long)timeout_ms,
                     want);
        }
        sleep_ms(10);
    }
}

static Kvfence__V1__AbortRoomResponse *abort_room(struct fx *f, uint64_t room_id,
                                                  uint64_t generation)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = room_id;
    key.generation = generation;
    Kvfence__V1__AbortRoomRequest rq = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    rq.room = &key;
    rq.detail = "test";
    struct kvf_rpc_status st;
    ProtobufCMessage *m = NULL;
    if (call(f, "/kvfence.v1.Control/AbortRoom", &rq.base,
             &kvfence__v1__abort_room_response__descriptor, &m, &st) != 0) {
        fail_msg("AbortRoom %llu: code %d (%s)", (unsigned long long)room_id, st.code, st.message);
    }
    return (Kvfence__V1__AbortRoomResponse *)m;
}

/* The participant of `node_id` in a GetRoom answer. */
static Kvfence__V1__ParticipantInfo *room_part(Kvfence__V1__RoomInfo *ri, const char *node_id)
{
    for (size_t i = 0; i < ri->n_participants; i++) {
        if (ri->participants[i]->participant &&
            strcmp(ri->participants[i]->participant->node_id, node_id) == 0) {
            return ri->participants[i];
        }
    }
    fail_msg("room %llu has no participant on %s",
             (unsigned long long)(ri->room ? ri->room->room_id : 0), node_id);
    return NULL;
}

/* Polls GetRoom until the participant on `node_id` shows drained. */
static void wait_drained(struct fx *f, uint64_t room_id, uint64_t gen, const char *node_id)
{
    int64_t end = now_ms() + EVENT_TIMEOUT_MS;
    for (;;) {
        Kvfence__V1__RoomInfo *ri = get_room(f, room_id, gen);
        bool drained = room_part(ri, node_id)->drained;
        protobuf_c_message_free_unpacked(&ri->base, NULL);
        if (drained) {
            return;
        }
        if (now_ms() > end) {
            fail_msg("room %llu: %s not drained after %d ms", (unsigned long long)room_id, node_id,
                     EVENT_TIMEOUT_MS);
        }
        sleep_ms(5);
    }
}

/* Stats without the uptime, packed, for "nothing changed" comparisons. */
static size_t stats_image(struct fx *f, uint8_t *buf, size_t cap)
{
    Kvfence__V1__Stats *s = get_stats(f);
    s->uptime_ms = 0;
    size_t len = kvfence__v1__stats__get_packed_size(s);
    assert_true(len <= cap);
    kvfence__v1__stats__pack(s, buf);
    kvfence__v1__stats__free_unpacked(s, NULL);
    return len;
}

/* ---- node messages ----------------------------------------------------------- */

static const char *msg_case_name(Kvfence__V1__ControlMessage__MsgCase c)
{
    switch (c) {
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_WELCOME:
        return "welcome";
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE:
        return "room_update";
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE:
        return "abort_notice";
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER:
        return "fence_peer";
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_RESYNC_REQUEST:
        return "resync_request";
    case KVFENCE__V1__CONTROL_MESSAGE__MSG_HEARTBEAT_ACK:
        return "heartbeat_ack";
    default:
        return "?";
    }
}

static uint64_t msg_room_id(const Kvfence__V1__ControlMessage *m)
{
    const Kvfence__V1__RoomKey *k = NULL;
    if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE) {
        k = m->room_update->room;
    } else if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE) {
        k = m->abort_notice->room;
    }
    return k ? k->room_id : 0;
}

/* Receives until a message of kind `want` (for room `room_id` unless 0)
 * arrives, skipping others; fails after `timeout_ms`. */
static Kvfence__V1__ControlMessage *node_wait(struct fake_node *n,
                                              Kvfence__V1__ControlMessage__MsgCase want,
                                              uint64_t room_id, int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    for (;;) {
        int64_t left = end - now_ms();
        Kvfence__V1__ControlMessage *m = NULL;
        struct kvf_rpc_status st;
        int rc = fake_node_recv(n, left > 0 ? left : 0, &m, &st);
        if (rc == -ETIMEDOUT) {
            fail_msg("node %s: no %s for room %llu within %lld ms", fake_node_id(n),
                     msg_case_name(want), (unsigned long long)room_id, (long long)timeout_ms);
        }
        if (rc != 0) {
            fail_msg("node %s: recv %d (status %d: %s) while waiting for %s", fake_node_id(n), rc,
                     rc == KVF_RPC_STREAM_END ? st.code : 0,
                     rc == KVF_RPC_STREAM_END ? st.message : "", msg_case_name(want));
        }
        if (m->msg_case == want && (room_id == 0 || msg_room_id(m) == room_id)) {
            return m;
        }
        kvfence__v1__control_message__free_unpacked(m, NULL);
    }
}

/* Fails if a message of kind `unwanted` (any room) arrives within `ms`;
 * others are skipped. */
static void node_expect_none(struct fake_node *n, Kvfence__V1__ControlMessage__MsgCase unwanted,
                             int64_t ms)
{
    int64_t end = now_ms() + ms;
    for (int64_t left; (left = end - now_ms()) > 0;) {
        Kvfence__V1__ControlMessage *m = NULL;
        int rc = fake_node_recv(n, left, &m, NULL);
        if (rc == -ETIMEDOUT) {
            return;
        }
        assert_int_equal(rc, 0);
        Kvfence__V1__ControlMessage__MsgCase c = m->msg_case;
        uint32_t attempt =
            c == KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE ? m->abort_notice->attempt : 0;
        kvfence__v1__control_message__free_unpacked(m, NULL);
        if (c == unwanted) {
            fail_msg("node %s: unexpected %s (attempt %u) %lld ms before the end of the window",
                     fake_node_id(n), msg_case_name(c), attempt, (long long)left);
        }
    }
}

static bool token_eq(const Kvfence__V1__AbortToken *a, const Kvfence__V1__AbortToken *b)
{
    return a && b && a->hi == b->hi && a->lo == b->lo;
}

/* ---- WatchLeases ------------------------------------------------------------- */

/* Opens a watch of `node_id`'s leases with room states and reads up to the
 * `synced` marker. */
static struct watch *watch_open(struct fx *f, const char *node_id)
{
    size_t slot = 0;
    while (slot < MAX_WATCHES && f->watches[slot]) {
        slot++;
    }
    assert_true(slot < MAX_WATCHES);
    struct watch *w = calloc(1, sizeof *w);
    assert_non_null(w);
    f->watches[slot] = w;
    w->cs =
        kvf_rpc_client_stream_open(f->ch, "/kvfence.v1.Control/WatchLeases", KVF_RPC_NO_TIMEOUT);
    assert_non_null(w->cs);
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.node_id = (char *)node_id;
    rq.include_room_states = true;
    uint8_t buf[256];
    size_t len = kvfence__v1__watch_leases_request__pack(&rq, buf);
    assert_int_equal(kvf_rpc_client_stream_send(w->cs, buf, len), 0);
    assert_int_equal(kvf_rpc_client_stream_half_close(w->cs), 0);
    int64_t end = now_ms() + EVENT_TIMEOUT_MS;
    for (;;) {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st;
        int64_t left = end - now_ms();
        int rc = kvf_rpc_client_stream_recv(w->cs, left > 0 ? left : 0, &msg, &mlen, &st);
        if (rc != 0) {
            fail_msg("WatchLeases %s: recv %d before synced (status %d: %s)", node_id, rc,
                     rc == KVF_RPC_STREAM_END ? st.code : 0,
                     rc == KVF_RPC_STREAM_END ? st.message : "");
        }
        Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
        free(msg);
        assert_non_null(ev);
        bool synced = ev->event_case == KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED;
        kvfence__v1__lease_event__free_unpacked(ev, NULL);
        if (synced) {
            return w;
        }
    }
}

/* Receives one event within `timeout_ms` and records it. Returns 0 or
 * -ETIMEDOUT; fails when the stream ends. */
static int watch_pump(struct watch *w, int64_t timeout_ms)
{
    uint8_t *msg = NULL;
    size_t mlen = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(w->cs, timeout_ms > 0 ? timeout_ms : 0, &msg, &mlen, &st);
    if (rc == -ETIMEDOUT) {
        return rc;
    }
    if (rc != 0) {
        fail_msg("WatchLeases: recv %d (status %d: %s)", rc, rc == KVF_RPC_STREAM_END ? st.code : 0,
                 rc == KVF_RPC_STREAM_END ? st.message : "");
    }
    static const uint8_t empty[1];
    Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg ? msg : empty);
    free(msg);
    assert_non_null(ev);
    switch (ev->event_case) {
    case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED:
        assert_true(w->nreleased < MAX_EVENTS);
        assert_non_null(ev->released);
        assert_int_equal(ev->released->state, KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED);
        w->released[w->nreleased++] = ev->released->lease_id;
        break;
    case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE:
        assert_true(w->nstates < MAX_EVENTS);
        w->states[w->nstates++] = ev->room_state;
        ev->room_state = NULL;
        ev->event_case = KVFENCE__V1__LEASE_EVENT__EVENT__NOT_SET;
        break;
    default:
        fail_msg("WatchLeases: unexpected event case %d", (int)ev->event_case);
    }
    kvfence__v1__lease_event__free_unpacked(ev, NULL);
    return 0;
}

static size_t watch_count_released(const struct watch *w, uint64_t lease_id)
{
    size_t n = 0;
    for (size_t i = 0; i < w->nreleased; i++) {
        n += w->released[i] == lease_id;
    }
    return n;
}

static void watch_wait_released(struct watch *w, uint64_t lease_id, int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    while (watch_count_released(w, lease_id) == 0) {
        if (watch_pump(w, end - now_ms()) == -ETIMEDOUT) {
            fail_msg("WatchLeases: lease %llu not released within %lld ms",
                     (unsigned long long)lease_id, (long long)timeout_ms);
        }
    }
}

/* The recorded state change of `room_id` into `new_state`, waiting for it. */
static const Kvfence__V1__RoomStateChange *watch_wait_state(struct watch *w, uint64_t room_id,
                                                            Kvfence__V1__RoomState new_state,
                                                            int64_t timeout_ms)
{
    int64_t end = now_ms() + timeout_ms;
    for (size_t seen = 0;;) {
        for (; seen < w->nstates; seen++) {
            const Kvfence__V1__RoomStateChange *c = w->states[seen];
            if (c->room && c->room->room_id == room_id && c->new_state == new_state) {
                return c;
            }
        }
        if (watch_pump(w, end - now_ms()) == -ETIMEDOUT) {
            fail_msg("WatchLeases: room %llu did not enter state %d within %lld ms",
                     (unsigned long long)room_id, (int)new_state, (long long)timeout_ms);
        }
    }
}

/* Fails if any event arrives within `ms`. */
static void watch_expect_nothing(struct watch *w, int64_t ms)
{
    size_t r = w->nreleased, s = w->nstates;
    if (watch_pump(w, ms) == 0) {
        if (w->nreleased > r) {
            fail_msg("WatchLeases: lease %llu released too early",
                     (unsigned long long)w->released[r]);
        }
        fail_msg("WatchLeases: unexpected room state of room %llu: %d -> %d",
                 (unsigned long long)(w->states[s]->room ? w->states[s]->room->room_id : 0),
                 (int)w->states[s]->old_state, (int)w->states[s]->new_state);
    }
}

/* Reads for `ms` more and checks every lease of `ids` was released exactly
 * once on `w`. */
static void watch_check_once(struct watch *w, const uint64_t *ids, size_t n, int64_t ms)
{
    int64_t end = now_ms() + ms;
    while (end - now_ms() > 0 && watch_pump(w, end - now_ms()) == 0) {
    }
    for (size_t i = 0; i < n; i++) {
        if (watch_count_released(w, ids[i]) != 1) {
            fail_msg("lease %llu released %zu times, want exactly once", (unsigned long long)ids[i],
                     watch_count_released(w, ids[i]));
        }
    }
}

/* ---- rooms ----------------------------------------------------------------------- */

struct room {
    uint64_t id, gen;
    uint64_t src_lease, sink_lease;
    const char *src, *sink;
};

/* Joins `src` as source and `sink` as sink of room `room_id`, pages 0..15
 * each; the room is ACTIVE after the second join. */
static void make_active(struct fx *f, uint64_t room_id, const char *src, const char *sink,
                        struct room *r)
{
    struct kvf_rpc_status st;
    Kvfence__V1__JoinRoomResponse *a = NULL, *b = NULL;
    if (join(f, room_id, src, KVFENCE__V1__ROLE__ROLE_SOURCE, 0, 16, &a, &st) != 0) {
        fail_msg("JoinRoom source %s: code %d (%s)", src, st.code, st.message);
    }
    assert_int_equal(a->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_OPENING);
    if (join(f, room_id, sink, KVFENCE__V1__ROLE__ROLE_SINK, 0, 16, &b, &st) != 0) {
        fail_msg("JoinRoom sink %s: code %d (%s)", sink, st.code, st.message);
    }
    assert_int_equal(b->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    assert_non_null(a->room);
    assert_non_null(b->room);
    assert_int_equal(a->room->room_id, room_id);
    assert_int_equal(b->room->generation, a->room->generation);
    assert_true(a->room->generation >= 1);
    assert_true(a->lease_id >= 1 && b->lease_id >= 1 && a->lease_id != b->lease_id);
    assert_int_equal(b->protocol_version, 1);
    *r = (struct room){room_id, a->room->generation, a->lease_id, b->lease_id, src, sink};
    kvfence__v1__join_room_response__free_unpacked(a, NULL);
    kvfence__v1__join_room_response__free_unpacked(b, NULL);
}

/* Waits for `n`'s RoomUpdate of `r` and checks it: ACTIVE, both members with
 * their leases. */
static void expect_room_update(struct fake_node *n, const struct room *r)
{
    Kvfence__V1__ControlMessage *m =
        node_wait(n, KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r->id, EVENT_TIMEOUT_MS);
    /* The other node's member comes once that node acknowledged its own
     * update (fake_node_recv acknowledges each one, when the test reads it):
     * the first update carries this node's member, and the other one only if
     * that node acknowledged already (docs/state-cores.md, "Ordered room
     * updates"). */
    const Kvfence__V1__RoomUpdate *ru = m->room_update;
    assert_int_equal(ru->room->generation, r->gen);
    assert_int_equal(ru->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    assert_int_equal(ru->protocol_version, 1);
    assert_true(ru->notice_id > 0);
    assert_true(ru->n_members == 1 || ru->n_members == 2);
    bool seen_src = false, seen_sink = false;
    for (size_t i = 0; i < ru->n_members; i++) {
        const Kvfence__V1__RoomMember *mb = ru->members[i];
        const Kvfence__V1__Lease *l = mb->lease;
        assert_non_null(l);
        assert_non_null(l->participant);
        assert_non_null(l->room);
        assert_int_equal(l->room->room_id, r->id);
        assert_int_equal(l->room->generation, r->gen);
        assert_int_equal(l->pool_id, FAKE_NODE_POOL_ID);
        assert_int_equal(l->state, KVFENCE__V1__LEASE_STATE__LEASE_STATE_ACTIVE);
        assert_int_equal(l->n_ranges, 1);
        assert_int_equal(l->ranges[0]->first, 0);
        assert_int_equal(l->ranges[0]->count, 16);
        assert_non_null(mb->pool);
        assert_int_equal(mb->pool->pool_id, FAKE_NODE_POOL_ID);
        assert_int_equal(mb->node_incarnation, 1);
        if (l->participant->role == KVFENCE__V1__ROLE__ROLE_SOURCE) {
            assert_false(seen_src);
            seen_src = true;
            assert_int_equal(l->lease_id, r->src_lease);
            assert_string_equal(l->participant->node_id, r->src);
            assert_int_equal(l->mode, KVFENCE__V1__LEASE_MODE__LEASE_MODE_READ);
        } else {
            assert_int_equal(l->participant->role, KVFENCE__V1__ROLE__ROLE_SINK);
            assert_false(seen_sink);
            seen_sink = true;
            assert_int_equal(l->lease_id, r->sink_lease);
            assert_string_equal(l->participant->node_id, r->sink);
            assert_int_equal(l->mode, KVFENCE__V1__LEASE_MODE__LEASE_MODE_WRITE);
        }
    }
    const char *self = fake_node_id(n);
    assert_true(seen_src || strcmp(r->src, self) != 0);
    assert_true(seen_sink || strcmp(r->sink, self) != 0);
    assert_true(seen_src || seen_sink);
    kvfence__v1__control_message__free_unpacked(m, NULL);
}

/* Waits for `n`'s AbortNotice of `r` and checks its token (when given);
 * returns its attempt. */
static uint32_t expect_notice(struct fake_node *n, const struct room *r,
                              const Kvfence__V1__AbortToken *token, int64_t timeout_ms)
{
    Kvfence__V1__ControlMessage *m =
        node_wait(n, KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, r->id, timeout_ms);
    const Kvfence__V1__AbortNotice *an = m->abort_notice;
    assert_int_equal(an->room->generation, r->gen);
    if (token && !token_eq(an->token, token)) {
        fail_msg("node %s: abort notice with another token", fake_node_id(n));
    }
    uint32_t attempt = an->attempt;
    kvfence__v1__control_message__free_unpacked(m, NULL);
    return attempt;
}

/* n1 (source) and n2 (sink) attached, watchers on both, room ACTIVE with the
 * room updates received. */
static void active_pair(struct fx *f, uint64_t room_id, struct room *r, struct watch **wa,
                        struct watch **wb)
{
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    *wa = watch_open(f, "n1");
    *wb = watch_open(f, "n2");
    make_active(f, room_id, "n1", "n2", r);
    expect_room_update(f->nodes[0], r);
    expect_room_update(f->nodes[1], r);
}

static Kvfence__V1__AbortToken abort_token(Kvfence__V1__AbortRoomResponse *ar)
{
    assert_non_null(ar->token);
    Kvfence__V1__AbortToken t = *ar->token;
    assert_true(t.hi != 0 || t.lo != 0);
    return t;
}

/* ---- tests ------------------------------------------------------------------------ */

static void test_success_lifecycle_over_the_wire(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 101, &r, &wa, &wb);

    assert_int_equal(
        fake_node_send_completed(f->nodes[0], r.id, r.gen, 0, KVFENCE__V1__ROLE__ROLE_SOURCE), 0);
    assert_int_equal(
        fake_node_send_completed(f->nodes[1], r.id, r.gen, 0, KVFENCE__V1__ROLE__ROLE_SINK), 0);

    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    const Kvfence__V1__RoomStateChange *c =
        watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, EVENT_TIMEOUT_MS);
    assert_int_equal(c->old_state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    assert_int_equal(c->room->generation, r.gen);
    c = watch_wait_state(wb, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, EVENT_TIMEOUT_MS);
    assert_int_equal(c->old_state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    watch_check_once(wa, &r.src_lease, 1, 300);
    watch_check_once(wb, &r.sink_lease, 1, 0);
    assert_int_equal(watch_count_released(wa, r.sink_lease), 0); /* n1's watch: n1's lease only */
    assert_int_equal(watch_count_released(wb, r.src_lease), 0);

    Kvfence__V1__RoomInfo *ri = get_room(f, r.id, 0);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED);
    assert_int_equal(ri->room->generation, r.gen);
    assert_int_equal(ri->n_participants, 2);
    for (size_t i = 0; i < 2; i++) {
        assert_true(ri->participants[i]->completed);
        assert_int_equal(ri->participants[i]->lease->state,
                         KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED);
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);

    /* Nothing to abort: no notice, no token. */
    for (size_t i = 0; i < 2; i++) {
        node_expect_none(f->nodes[i], KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, i ? 0 : 200);
    }
}

static void test_abort_waits_for_every_drain_then_releases_once(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 102, &r, &wa, &wb);

    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    Kvfence__V1__AbortToken tok = abort_token(ar);
    assert_false(ar->already_aborting);
    assert_int_equal(ar->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    assert_int_equal(ar->reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_ENGINE);
    assert_int_equal(ar->room->generation, r.gen);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);

    assert_int_equal(expect_notice(f->nodes[0], &r, &tok, EVENT_TIMEOUT_MS), 0);
    assert_int_equal(expect_notice(f->nodes[1], &r, &tok, EVENT_TIMEOUT_MS), 0);
    const Kvfence__V1__RoomStateChange *c =
        watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    assert_int_equal(c->old_state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ACTIVE);
    assert_int_equal(c->reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_ENGINE);
    assert_true(token_eq(c->token, &tok));
    watch_wait_state(wb, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);

    /* n1 drains: nothing is released while n2 has not. */
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &tok), 0);
    watch_expect_nothing(wa, 300);
    watch_expect_nothing(wb, 0);
    Kvfence__V1__RoomInfo *ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    assert_true(token_eq(ri->token, &tok));
    assert_true(room_part(ri, "n1")->drained);
    assert_false(room_part(ri, "n2")->drained);
    for (size_t i = 0; i < ri->n_participants; i++) {
        assert_int_equal(ri->participants[i]->lease->state,
                         KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASING);
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);

    /* A second abort: same token, already aborting, nothing changes. */
    ar = abort_room(f, r.id, 0);
    assert_true(token_eq(ar->token, &tok));
    assert_true(ar->already_aborting);
    assert_int_equal(ar->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    watch_expect_nothing(wa, 100);

    /* n2 drains: both leases released, exactly once. */
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    c = watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, EVENT_TIMEOUT_MS);
    assert_int_equal(c->old_state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    /* A repeated drain changes nothing. */
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);
    watch_check_once(wa, &r.src_lease, 1, 300);
    watch_check_once(wb, &r.sink_lease, 1, 0);

    ar = abort_room(f, r.id, r.gen);
    assert_true(token_eq(ar->token, &tok));
    assert_true(ar->already_aborting);
    assert_int_equal(ar->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    for (size_t i = 0; i < ri->n_participants; i++) {
        assert_int_equal(ri->participants[i]->lease->state,
                         KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASED);
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);
}

static void test_stale_and_tokenless_reports_change_nothing(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 103, &r, &wa, &wb);
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    Kvfence__V1__AbortToken tok = abort_token(ar);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    expect_notice(f->nodes[0], &r, &tok, EVENT_TIMEOUT_MS);
    watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    watch_wait_state(wb, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);

    Kvfence__V1__Stats *s0 = get_stats(f);
    Kvfence__V1__AbortToken wrong = tok;
    wrong.lo ^= 1;
    Kvfence__V1__AbortToken zero = KVFENCE__V1__ABORT_TOKEN__INIT;
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &wrong), 0);
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, NULL), 0);
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &zero), 0);
    /* The right token with a generation that is not the room's. */
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen + 1000, &tok), 0);

    int64_t end = now_ms() + EVENT_TIMEOUT_MS;
    for (;;) {
        Kvfence__V1__Stats *s = get_stats(f);
        bool done =
            s->reports_stale >= s0->reports_stale + 1 &&
            s->reports_tokenless >= s0->reports_tokenless + 2 &&
            s->reports_stale + s->reports_unknown >= s0->reports_stale + s0->reports_unknown + 2;
        if (done) {
            assert_int_equal(s->reports_tokenless, s0->reports_tokenless + 2);
            assert_int_equal(s->reports_stale + s->reports_unknown,
                             s0->reports_stale + s0->reports_unknown + 2);
            assert_int_equal(s->rooms->aborting, 1);
            assert_int_equal(s->rooms->aborted, 0);
            assert_int_equal(s->leases->releasing, 2);
            assert_int_equal(s->leases->released, 0);
            kvfence__v1__stats__free_unpacked(s, NULL);
            break;
        }
        if (now_ms() > end) {
            fail_msg(
                "stats: stale %llu -> %llu, tokenless %llu -> %llu, unknown %llu -> %llu",
                (unsigned long long)s0->reports_stale, (unsigned long long)s->reports_stale,
                (unsigned long long)s0->reports_tokenless, (unsigned long long)s->reports_tokenless,
                (unsigned long long)s0->reports_unknown, (unsigned long long)s->reports_unknown);
        }
        kvfence__v1__stats__free_unpacked(s, NULL);
        sleep_ms(10);
    }
    kvfence__v1__stats__free_unpacked(s0, NULL);

    Kvfence__V1__RoomInfo *ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    assert_false(room_part(ri, "n1")->drained);
    assert_false(room_part(ri, "n2")->drained);
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    watch_expect_nothing(wa, 100);
    watch_expect_nothing(wb, 0);

    /* The notices are still pending: n1 is re-sent one. */
    expect_notice(f->nodes[0], &r, &tok, EVENT_TIMEOUT_MS);

    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &tok), 0);
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    watch_check_once(wa, &r.src_lease, 1, 200);
    watch_check_once(wb, &r.sink_lease, 1, 0);
}

static void test_notice_is_resent_until_drained(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "2000", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 104, &r, &wa, &wb);
    int64_t t0 = now_ms();
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    Kvfence__V1__AbortToken tok = abort_token(ar);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);

    /* n1 does not answer: attempt 0, then 1 and 2 (backoff 100 ms, 200 ms,
     * each shortened by at most a quarter). */
    assert_int_equal(expect_notice(f->nodes[0], &r, &tok, 1000), 0);
    assert_int_equal(expect_notice(f->nodes[0], &r, &tok, 1000 - (now_ms() - t0)), 1);
    assert_int_equal(expect_notice(f->nodes[0], &r, &tok, 1000 - (now_ms() - t0)), 2);
    assert_true(now_ms() - t0 < 1000);

    /* It drains: the re-sends to n1 stop. */
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &tok), 0);
    wait_drained(f, r.id, r.gen, "n1");
    node_expect_none(f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, 500);

    /* n2 never answered: it has been re-sent its notice all along. */
    uint32_t max_attempt = 0;
    for (;;) {
        Kvfence__V1__ControlMessage *m = NULL;
        int rc = fake_node_recv(f->nodes[1], 0, &m, NULL);
        if (rc != 0) {
            break;
        }
        if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE) {
            assert_true(token_eq(m->abort_notice->token, &tok));
            if (m->abort_notice->attempt > max_attempt) {
                max_attempt = m->abort_notice->attempt;
            }
        }
        kvfence__v1__control_message__free_unpacked(m, NULL);
    }
    assert_true(max_attempt >= 2);
    Kvfence__V1__Stats *s = get_stats(f);
    assert_true(s->notices_resent >= 4);
    assert_int_equal(s->notices_pending, 1); /* n2's */
    kvfence__v1__stats__free_unpacked(s, NULL);

    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    wait_drained(f, r.id, r.gen, "n2");
    node_expect_none(f->nodes[1], KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, 500);
}

static void test_incompatible_node_is_refused(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);

    static const char *const no_quiesce[] = {"FENCE_V1", "TCP"};
    struct fake_node_hello h = {"old-node", 1, no_quiesce, 2, 1, 1};
    struct fake_node *n = NULL;
    struct kvf_rpc_status st;
    assert_int_equal(fake_node_open(f->ch, &h, EVENT_TIMEOUT_MS, &n, NULL, &st),
                     KVF_RPC_STREAM_END);
    assert_null(n);
    assert_int_equal(st.code, KVF_GRPC_FAILED_PRECONDITION);
    if (!strstr(st.message, "QUIESCE_V1")) {
        fail_msg("refusal does not name QUIESCE_V1: '%s'", st.message);
    }
    assert_int_equal(node_state(f, "old-node"), 0);

    static const char *const all[] = {"QUIESCE_V1", "FENCE_V1"};
    struct fake_node_hello h2 = {"future-node", 1, all, 2, 5, 6};
    assert_int_equal(fake_node_open(f->ch, &h2, EVENT_TIMEOUT_MS, &n, NULL, &st),
                     KVF_RPC_STREAM_END);
    assert_null(n);
    assert_int_equal(st.code, KVF_GRPC_FAILED_PRECONDITION);
    assert_int_equal(node_state(f, "future-node"), 0);

    /* A compatible node is still welcome, with the negotiated version. */
    struct fake_node_hello h3 = {"good-node", 1, all, 2, 1, 6};
    Kvfence__V1__Welcome *w = NULL;
    assert_int_equal(fake_node_open(f->ch, &h3, EVENT_TIMEOUT_MS, &f->nodes[0], &w, &st), 0);
    assert_int_equal(w->negotiated_version, 1);
    assert_int_equal(w->node_ttl_ms, 500);
    kvfence__v1__welcome__free_unpacked(w, NULL);
    assert_int_equal(node_state(f, "good-node"), KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED);
}

static void test_lost_node_is_fenced_by_its_peers_before_release(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 106, &r, &wa, &wb);

    int64_t t0 = now_ms();
    fake_node_vanish(f->nodes[1]);
    f->nodes[1] = NULL;

    const Kvfence__V1__RoomStateChange *c =
        watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    assert_true(now_ms() - t0 >= 400); /* not before the ttl */
    assert_int_equal(c->reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_NODE_LOST);
    assert_non_null(c->token);
    Kvfence__V1__AbortToken tok = *c->token;
    c = watch_wait_state(wb, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    assert_int_equal(c->reason, KVFENCE__V1__ABORT_REASON__ABORT_REASON_NODE_LOST);
    assert_int_equal(node_state(f, "n2"), KVFENCE__V1__NODE_STATE__NODE_STATE_LOST);

    /* n1 is told to drain and to fence n2, in either order. */
    bool got_notice = false, got_fence = false;
    int64_t end = now_ms() + EVENT_TIMEOUT_MS;
    while (!got_notice || !got_fence) {
        Kvfence__V1__ControlMessage *m = NULL;
        int64_t left = end - now_ms();
        int rc = fake_node_recv(f->nodes[0], left > 0 ? left : 0, &m, NULL);
        if (rc != 0) {
            fail_msg("n1: recv %d; notice %d fence %d", rc, got_notice, got_fence);
        }
        if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE) {
            assert_int_equal(m->abort_notice->room->room_id, r.id);
            assert_true(token_eq(m->abort_notice->token, &tok));
            assert_int_equal(m->abort_notice->reason,
                             KVFENCE__V1__ABORT_REASON__ABORT_REASON_NODE_LOST);
            got_notice = true;
        } else if (m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER) {
            assert_string_equal(m->fence_peer->node_id, "n2");
            assert_int_equal(m->fence_peer->incarnation, 1);
            got_fence = true;
        }
        kvfence__v1__control_message__free_unpacked(m, NULL);
    }

    /* n1 drains: n2 is LOST but not fenced, so nothing is released. */
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &tok), 0);
    wait_drained(f, r.id, r.gen, "n1");
    watch_expect_nothing(wa, 300);
    watch_expect_nothing(wb, 0);
    Kvfence__V1__RoomInfo *ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    assert_false(room_part(ri, "n2")->fenced);
    for (size_t i = 0; i < ri->n_participants; i++) {
        assert_int_equal(ri->participants[i]->lease->state,
                         KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASING);
    }
    kvfence__v1__room_info__free_unpacked(ri, NULL);

    /* n1 fenced n2: n1's lease is released, once; n2's own pages wait for a
     * proof from n2's host (n2 may only be paused). */
    assert_int_equal(fake_node_send_peer_fenced(f->nodes[0], "n2", 1), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    c = watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, EVENT_TIMEOUT_MS);
    assert_int_equal(c->old_state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    watch_check_once(wa, &r.src_lease, 1, 300);
    watch_check_once(wb, &r.sink_lease, 0, 0);
    ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    assert_true(room_part(ri, "n2")->fenced);
    assert_int_equal(room_part(ri, "n2")->lease->state,
                     KVFENCE__V1__LEASE_STATE__LEASE_STATE_RELEASING);
    assert_true(room_part(ri, "n2")->lease->awaiting_host_proof);
    kvfence__v1__room_info__free_unpacked(ri, NULL);
    /* n2 restarts on its host and witnesses its old incarnation gone. */
    f->nodes[1] = fake_node_attach(f->ch, "n2", 2);
    assert_non_null(f->nodes[1]);
    Kvfence__V1__Witness wit = KVFENCE__V1__WITNESS__INIT;
    wit.gone_incarnation = 1;
    Kvfence__V1__NodeMessage wm = KVFENCE__V1__NODE_MESSAGE__INIT;
    wm.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_WITNESS;
    wm.witness = &wit;
    assert_int_equal(fake_node_send(f->nodes[1], &wm), 0);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    watch_check_once(wb, &r.sink_lease, 1, 0);
    /* The fence request is settled: no more re-sends. */
    node_expect_none(f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_FENCE_PEER, 0);
    Kvfence__V1__Stats *s = get_stats(f);
    assert_int_equal(s->notices_pending, 0);
    kvfence__v1__stats__free_unpacked(s, NULL);
}

static void test_reconnect_gets_pending_notices_at_once(void **state)
{
    struct fx *f = *state;
    /* First re-send after 2.25..3 s: a notice within 1 s of the re-attach
     * can only be the re-attach's. */
    fx_start(f, "--node-ttl-ms", "5000", "--resend-ms", "3000", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 107, &r, &wa, &wb);
    int64_t t0 = now_ms();
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    Kvfence__V1__AbortToken tok = abort_token(ar);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    assert_int_equal(expect_notice(f->nodes[0], &r, &tok, EVENT_TIMEOUT_MS), 0);

    /* n1 says goodbye before draining, and comes back within the ttl. */
    fake_node_close(f->nodes[0]);
    f->nodes[0] = NULL;
    wait_node_state(f, "n1", KVFENCE__V1__NODE_STATE__NODE_STATE_SUSPECT, EVENT_TIMEOUT_MS);
    fx_attach(f, 0, "n1", 1);
    int64_t t1 = now_ms();
    uint32_t attempt = expect_notice(f->nodes[0], &r, &tok, 1000);
    int64_t t2 = now_ms();
    assert_true(attempt >= 1);
    if (t2 - t0 >= 2000) {
        fail_msg("pending notice came %lld ms after the abort (%lld after the re-attach): not at "
                 "once",
                 (long long)(t2 - t0), (long long)(t2 - t1));
    }
    assert_int_equal(node_state(f, "n1"), KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED);

    /* The new session drains for n1; with n2 the room is released. */
    assert_int_equal(fake_node_send_drained(f->nodes[0], r.id, r.gen, &tok), 0);
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    watch_check_once(wa, &r.src_lease, 1, 200);
    watch_check_once(wb, &r.sink_lease, 1, 0);
}

static void expect_stats_unchanged(struct fx *f, const uint8_t *before, size_t len,
                                   const char *what)
{
    uint8_t after[512];
    size_t alen = stats_image(f, after, sizeof after);
    if (alen != len || memcmp(before, after, len) != 0) {
        fail_msg("%s changed GetStats", what);
    }
}

static void test_join_refusals_over_the_wire(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "10000", "--resend-ms", "100", NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    fx_attach(f, 2, "n3", 1);
    uint8_t before[512];
    size_t len;
    struct kvf_rpc_status st;

    /* Pages outside the pool. */
    len = stats_image(f, before, sizeof before);
    assert_int_equal(join(f, 10, "n1", KVFENCE__V1__ROLE__ROLE_SOURCE, 2000, 1, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_INVALID_ARGUMENT);
    if (!strstr(st.message, "2000")) {
        fail_msg("out-of-pool refusal does not name page 2000: '%s'", st.message);
    }
    expect_stats_unchanged(f, before, len, "an out-of-pool join");

    /* Overlap with the write lease of a live room. */
    struct room r;
    make_active(f, 20, "n1", "n2", &r);
    expect_room_update(f->nodes[0], &r);
    expect_room_update(f->nodes[1], &r);
    len = stats_image(f, before, sizeof before);
    assert_int_equal(join(f, 21, "n2", KVFENCE__V1__ROLE__ROLE_SINK, 8, 2, NULL, &st), -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_FAILED_PRECONDITION);
    if (!strstr(st.message, "room 20")) {
        fail_msg("conflict refusal does not name room 20: '%s'", st.message);
    }
    /* Reading a page another room writes is a conflict too. */
    assert_int_equal(join(f, 21, "n2", KVFENCE__V1__ROLE__ROLE_SOURCE, 15, 4, NULL, &st),
                     -EREMOTEIO);
    assert_int_equal(st.code, KVF_GRPC_FAILED_PRECONDITION);
    if (!strstr(st.message, "room 20")) {
        fail_msg("conflict refusal does not name room 20: '%s'", st.message);
    }
    expect_stats_unchanged(f, before, len, "a conflicting join");

    /* A SUSPECT node: retry later. */
    fake_node_close(f->nodes[2]);
    f->nodes[2] = NULL;
    wait_node_state(f, "n3", KVFENCE__V1__NODE_STATE__NODE_STATE_SUSPECT, EVENT_TIMEOUT_MS);
    len = stats_image(f, before, sizeof before);
    assert_int_equal(join(f, 30, "n3", KVFENCE__V1__ROLE__ROLE_SOURCE, 0, 4, NULL, &st),
                     -EREMOTEIO);
    if (st.code != KVF_GRPC_UNAVAILABLE) {
        fail_msg("JoinRoom on a SUSPECT node: code %d (%s), want UNAVAILABLE", st.code, st.message);
    }
    expect_stats_unchanged(f, before, len, "a join on a SUSPECT node");
}

/* ---- checks of the wire contract that the service does not meet yet ---------- */

/* Ordered room updates (node.proto RoomUpdate.version, RoomUpdateAck): the
 * source's node first learns its own lease and its peers only; the sink's
 * lease reaches it only after the sink's node acknowledged the update that
 * carries it (fake_node_recv acknowledges an update when the test reads it,
 * so n2 acknowledges nothing until the test reads n2). On the code before,
 * n1's first update carried both leases. */
static void test_sink_lease_reaches_source_only_after_sink_acked(void **state)
{
    struct fx *f = *state;
    fx_start(f, NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    struct room r;
    make_active(f, 121, "n1", "n2", &r);
    Kvfence__V1__ControlMessage *m = node_wait(
        f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r.id, EVENT_TIMEOUT_MS);
    assert_true(m->room_update->version > 0);
    assert_int_equal(m->room_update->n_members, 1);
    assert_string_equal(m->room_update->members[0]->lease->participant->node_id, "n1");
    assert_int_equal(m->room_update->n_peers, 1); /* n2 is introduced all the same */
    assert_string_equal(m->room_update->peers[0]->node_id, "n2");
    kvfence__v1__control_message__free_unpacked(m, NULL);
    /* However long n2 does not acknowledge, n1 learns nothing of the sink. */
    int64_t end = now_ms() + 300;
    for (int64_t left; (left = end - now_ms()) > 0;) {
        struct kvf_rpc_status st;
        m = NULL;
        int rc = fake_node_recv(f->nodes[0], left, &m, &st);
        if (rc == -ETIMEDOUT)
            break;
        assert_int_equal(rc, 0);
        bool update = m->msg_case == KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE;
        kvfence__v1__control_message__free_unpacked(m, NULL);
        if (update)
            fail_msg("n1 got a second room update before n2 acknowledged its own");
    }
    /* n2 reads (and acknowledges) its updates: its first, then the one that
     * brings n1's source (n1 acknowledged above), which replaced the first:
     * the ack of that one publishes the sink, and n1 learns it. */
    for (size_t members = 0; members < 2;) {
        m = node_wait(f->nodes[1], KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r.id,
                      EVENT_TIMEOUT_MS);
        members = m->room_update->n_members;
        kvfence__v1__control_message__free_unpacked(m, NULL);
    }
    m = node_wait(f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r.id,
                  EVENT_TIMEOUT_MS);
    const Kvfence__V1__RoomUpdate *ru = m->room_update;
    bool sink = false;
    for (size_t i = 0; i < ru->n_members; i++)
        sink = sink || ru->members[i]->lease->participant->role == KVFENCE__V1__ROLE__ROLE_SINK;
    assert_true(sink);
    assert_int_equal(ru->n_members, 2);
    kvfence__v1__control_message__free_unpacked(m, NULL);
}

/* node.proto, RoomUpdate.peers: "Every node of the room except the
 * addressee." */
static void test_room_update_peers_exclude_the_addressee(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    struct room r;
    make_active(f, 109, "n1", "n2", &r);
    for (size_t i = 0; i < 2; i++) {
        Kvfence__V1__ControlMessage *m = node_wait(
            f->nodes[i], KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r.id, EVENT_TIMEOUT_MS);
        const Kvfence__V1__RoomUpdate *ru = m->room_update;
        const char *self = i ? "n2" : "n1", *other = i ? "n1" : "n2";
        bool has_self = false, has_other = false;
        for (size_t k = 0; k < ru->n_peers; k++) {
            has_self = has_self || strcmp(ru->peers[k]->node_id, self) == 0;
            has_other = has_other || strcmp(ru->peers[k]->node_id, other) == 0;
        }
        size_t n_peers = ru->n_peers;
        kvfence__v1__control_message__free_unpacked(m, NULL);
        if (has_self || !has_other || n_peers != 1) {
            fail_msg("RoomUpdate to %s: %zu peers, addressee listed: %d, %s listed: %d (want only "
                     "%s)",
                     self, n_peers, has_self, other, has_other, other);
        }
    }
}

/* node.proto, NodeSession: a notice "is re-sent (same id, higher attempt)";
 * AbortNotice.notice_id "Identifies this notice across re-sends." */
static void test_abort_notice_id_is_kept_across_resends(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "2000", "--resend-ms", "100", NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    struct room r;
    make_active(f, 110, "n1", "n2", &r);
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    uint64_t ids[2];
    uint32_t attempts[2];
    for (size_t i = 0; i < 2; i++) {
        Kvfence__V1__ControlMessage *m = node_wait(
            f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, r.id, EVENT_TIMEOUT_MS);
        ids[i] = m->abort_notice->notice_id;
        attempts[i] = m->abort_notice->attempt;
        kvfence__v1__control_message__free_unpacked(m, NULL);
    }
    assert_int_equal(attempts[0], 0);
    assert_int_equal(attempts[1], 1);
    if (ids[0] != ids[1]) {
        fail_msg("AbortNotice re-send has notice_id %llu, the first send had %llu",
                 (unsigned long long)ids[1], (unsigned long long)ids[0]);
    }
}

/* control.proto, WatchLeases: "Errors: INVALID_ARGUMENT (no filter)";
 * WatchLeasesRequest: "At least one of node_id and lease_ids must be set". */
/* control.proto, WatchLeases: a request with no filter watches everything
 * (operators and tools); it gets `synced` first, like any other watcher. */
static void test_watch_without_filter_sees_everything(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(f->ch, "/kvfence.v1.Control/WatchLeases", CALL_TIMEOUT_MS);
    assert_non_null(cs);
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.include_room_states = true;
    uint8_t buf[16];
    size_t len = kvfence__v1__watch_leases_request__pack(&rq, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    kvf_rpc_client_stream_half_close(cs);
    uint8_t *msg = NULL;
    size_t mlen = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, 2000, &msg, &mlen, &st);
    assert_int_equal(rc, 0);
    Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
    free(msg);
    assert_non_null(ev);
    assert_int_equal(ev->event_case, KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED);
    kvfence__v1__lease_event__free_unpacked(ev, NULL);
    kvf_rpc_client_stream_close(cs);
}

/* control.proto, WatchLeasesRequest.include_room_states: "a ROOM_STATE event
 * for every state change of a room that has a matching lease". */
static void test_watch_room_states_follow_the_filter(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    struct watch *other = watch_open(f, "n9"); /* a node with no lease anywhere */
    struct room r;
    make_active(f, 111, "n1", "n2", &r);
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    watch_expect_nothing(other, 300);
}

/* node.proto, Attach: "INVALID_ARGUMENT (first message not Hello, ...)". */
static void test_first_message_must_be_hello(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "500", "--resend-ms", "100", NULL);
    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(f->ch, "/kvfence.v1.NodeSession/Attach", CALL_TIMEOUT_MS);
    assert_non_null(cs);
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 1;
    key.generation = 1;
    Kvfence__V1__Drained d = KVFENCE__V1__DRAINED__INIT;
    d.room = &key;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED;
    m.drained = &d;
    uint8_t buf[64];
    size_t len = kvfence__v1__node_message__pack(&m, buf);
    assert_int_equal(kvf_rpc_client_stream_send(cs, buf, len), 0);
    uint8_t *msg = NULL;
    size_t mlen = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_client_stream_recv(cs, 2000, &msg, &mlen, &st);
    free(msg);
    kvf_rpc_client_stream_close(cs);
    assert_int_equal(rc, KVF_RPC_STREAM_END);
    if (st.code != KVF_GRPC_INVALID_ARGUMENT) {
        fail_msg("Attach whose first message is not Hello: status %d (%s), want INVALID_ARGUMENT",
                 st.code, st.message);
    }
}

/* node.proto, Attach: on attach the control plane "sends a RoomUpdate for
 * every non-terminal room the node is in"; RoomUpdate.state: "ACTIVE, or
 * ABORTING when re-sent during an abort". */
static void test_reattach_resends_room_update_of_aborting_room(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "5000", "--resend-ms", "3000", NULL);
    fx_attach(f, 0, "n1", 1);
    fx_attach(f, 1, "n2", 1);
    struct room r;
    make_active(f, 113, "n1", "n2", &r);
    expect_room_update(f->nodes[0], &r);
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    expect_notice(f->nodes[0], &r, NULL, EVENT_TIMEOUT_MS);
    fake_node_close(f->nodes[0]);
    f->nodes[0] = NULL;
    wait_node_state(f, "n1", KVFENCE__V1__NODE_STATE__NODE_STATE_SUSPECT, EVENT_TIMEOUT_MS);
    fx_attach(f, 0, "n1", 1);
    Kvfence__V1__ControlMessage *m =
        node_wait(f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ROOM_UPDATE, r.id, 1000);
    assert_int_equal(m->room_update->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    kvfence__v1__control_message__free_unpacked(m, NULL);
}

/* Heartbeats drive SUSPECT: a node whose stream stays open but says nothing
 * (a hung process) loses its session after --heartbeat-timeout-ms, like a
 * dropped connection; a node that heartbeats keeps it. */
static void test_silent_node_goes_suspect_heartbeating_node_stays(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--heartbeat-timeout-ms", "700", "--node-ttl-ms", "60000", NULL);
    fx_attach(f, 0, "quiet", 1);
    fx_attach(f, 1, "chatty", 1);
    Kvfence__V1__Heartbeat hb = KVFENCE__V1__HEARTBEAT__INIT;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT;
    m.heartbeat = &hb;
    for (int i = 0; i < 10; i++) { /* 2 s of heartbeats, one every 200 ms */
        hb.seq = (uint64_t)i + 1;
        assert_int_equal(fake_node_send(f->nodes[1], &m), 0);
        struct timespec ts = {0, 200 * 1000000L};
        nanosleep(&ts, NULL);
    }
    wait_node_state(f, "quiet", KVFENCE__V1__NODE_STATE__NODE_STATE_SUSPECT, 3000);
    wait_node_state(f, "chatty", KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED, 100);
    /* Every heartbeat is answered, in order: the node's proof of liveness. */
    for (uint64_t want = 1; want <= 10; want++) {
        Kvfence__V1__ControlMessage *ack = NULL;
        struct kvf_rpc_status ast;
        assert_int_equal(fake_node_recv(f->nodes[1], 2000, &ack, &ast), 0);
        assert_int_equal(ack->msg_case, KVFENCE__V1__CONTROL_MESSAGE__MSG_HEARTBEAT_ACK);
        assert_int_equal(ack->heartbeat_ack->seq, want);
        kvfence__v1__control_message__free_unpacked(ack, NULL);
    }
    /* The quiet node's stream was ended by the server. */
    Kvfence__V1__ControlMessage *cm = NULL;
    struct kvf_rpc_status st;
    int rc;
    do {
        cm = NULL;
        rc = fake_node_recv(f->nodes[0], 2000, &cm, &st);
        if (cm != NULL)
            kvfence__v1__control_message__free_unpacked(cm, NULL);
    } while (rc == 0);
    assert_int_equal(rc, KVF_RPC_STREAM_END);
    assert_int_equal(st.code, KVF_GRPC_UNAVAILABLE);
    assert_non_null(strstr(st.message, "heartbeat"));
}

/* A node's Resync over the wire: its DRAINED lifetime with the current token
 * counts as Drained (the room is released), an open lifetime of a room the
 * control plane never knew gets one AbortNotice with an all-zero token, and
 * a malformed Resync (a repeated pool id) changes nothing and keeps the
 * session. */
static void test_resync_counts_drained_and_closes_unknown_rooms(void **state)
{
    struct fx *f = *state;
    fx_start(f, "--node-ttl-ms", "5000", "--resend-ms", "100", NULL);
    struct room r;
    struct watch *wa, *wb;
    active_pair(f, 130, &r, &wa, &wb);
    Kvfence__V1__AbortRoomResponse *ar = abort_room(f, r.id, 0);
    Kvfence__V1__AbortToken tok = abort_token(ar);
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    watch_wait_state(wb, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, EVENT_TIMEOUT_MS);
    assert_int_equal(fake_node_send_drained(f->nodes[1], r.id, r.gen, &tok), 0);

    Kvfence__V1__Pool pool = KVFENCE__V1__POOL__INIT;
    pool.pool_id = FAKE_NODE_POOL_ID;
    pool.page_size = FAKE_NODE_PAGE_SIZE;
    pool.page_count = FAKE_NODE_PAGE_COUNT;
    Kvfence__V1__Pool *pools[2] = {&pool, &pool};
    Kvfence__V1__RoomKey k1 = KVFENCE__V1__ROOM_KEY__INIT, k2 = KVFENCE__V1__ROOM_KEY__INIT;
    k1.room_id = r.id;
    k1.generation = r.gen;
    k2.room_id = 999;
    k2.generation = 7;
    Kvfence__V1__LifetimeInfo l1 = KVFENCE__V1__LIFETIME_INFO__INIT;
    Kvfence__V1__LifetimeInfo l2 = KVFENCE__V1__LIFETIME_INFO__INIT;
    l1.room = &k1;
    l1.state = KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_DRAINED;
    l1.token = &tok;
    l2.room = &k2;
    l2.state = KVFENCE__V1__LIFETIME_STATE__LIFETIME_STATE_OPEN;
    Kvfence__V1__LifetimeInfo *lts[2] = {&l1, &l2};
    Kvfence__V1__Resync rs = KVFENCE__V1__RESYNC__INIT;
    rs.n_lifetimes = 2;
    rs.lifetimes = lts;
    rs.n_pools = 2; /* repeated: refused as a whole */
    rs.pools = pools;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_RESYNC;
    m.resync = &rs;
    assert_int_equal(fake_node_send(f->nodes[0], &m), 0);
    watch_expect_nothing(wa, 300);
    Kvfence__V1__RoomInfo *ri = get_room(f, r.id, r.gen);
    assert_int_equal(ri->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    kvfence__v1__room_info__free_unpacked(ri, NULL);

    rs.n_pools = 1;
    assert_int_equal(fake_node_send(f->nodes[0], &m), 0);
    watch_wait_released(wa, r.src_lease, EVENT_TIMEOUT_MS);
    watch_wait_released(wb, r.sink_lease, EVENT_TIMEOUT_MS);
    watch_wait_state(wa, r.id, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, EVENT_TIMEOUT_MS);
    Kvfence__V1__ControlMessage *cm = node_wait(
        f->nodes[0], KVFENCE__V1__CONTROL_MESSAGE__MSG_ABORT_NOTICE, 999, EVENT_TIMEOUT_MS);
    assert_int_equal(cm->abort_notice->room->generation, 7);
    assert_non_null(cm->abort_notice->token);
    assert_true(cm->abort_notice->token->hi == 0 && cm->abort_notice->token->lo == 0);
    kvfence__v1__control_message__free_unpacked(cm, NULL);
    wait_node_state(f, "n1", KVFENCE__V1__NODE_STATE__NODE_STATE_ATTACHED, 100);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_success_lifecycle_over_the_wire, setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_waits_for_every_drain_then_releases_once, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_stale_and_tokenless_reports_change_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_notice_is_resent_until_drained, setup, teardown),
        cmocka_unit_test_setup_teardown(test_incompatible_node_is_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lost_node_is_fenced_by_its_peers_before_release, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_reconnect_gets_pending_notices_at_once, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_join_refusals_over_the_wire, setup, teardown),
        cmocka_unit_test_setup_teardown(test_room_update_peers_exclude_the_addressee, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_sink_lease_reaches_source_only_after_sink_acked, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_abort_notice_id_is_kept_across_resends, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_watch_without_filter_sees_everything, setup, teardown),
        cmocka_unit_test_setup_teardown(test_watch_room_states_follow_the_filter, setup, teardown),
        cmocka_unit_test_setup_teardown(test_first_message_must_be_hello, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reattach_resends_room_update_of_aborting_room, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_resync_counts_drained_and_closes_unknown_rooms, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_silent_node_goes_suspect_heartbeating_node_stays,
                                        setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
