/*
 * test_api.c: the generated wire code and the embedded descriptor set.
 *
 * Round-trips one message of each conversation (engine -> control plane,
 * node -> control plane, node -> node) through pack/unpack, checks that a
 * truncated buffer is refused, and walks the embedded FileDescriptorSet to find
 * the four kvfence files by name.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvf_api_descriptors.h"
#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "kvfence/v1/peer.pb-c.h"
#include "kvfence/v1/types.pb-c.h"

/* Packs `msg` into a fresh buffer; the caller frees it. */
static uint8_t *pack_message(const ProtobufCMessage *msg, size_t *len_p)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    assert_int_equal(protobuf_c_message_pack(msg, buf), len);
    *len_p = len;
    return buf;
}

static void join_room_request_round_trips(void **state)
{
    (void)state;
    Kvfence__V1__Participant who = KVFENCE__V1__PARTICIPANT__INIT;
    who.node_id = "node-a";
    who.rank = 3;
    who.role = KVFENCE__V1__ROLE__ROLE_SINK;

    char *features[] = {"QUIESCE_V1", "FENCE_V1", "TCP"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.protocol_max = 2;
    caps.n_features = 3;
    caps.features = features;

    Kvfence__V1__PageRange r0 = KVFENCE__V1__PAGE_RANGE__INIT;
    Kvfence__V1__PageRange r1 = KVFENCE__V1__PAGE_RANGE__INIT;
    r0.first = 0;
    r0.count = 16;
    r1.first = 4096;
    r1.count = 1;
    Kvfence__V1__PageRange *ranges[] = {&r0, &r1};

    Kvfence__V1__JoinRoomRequest req = KVFENCE__V1__JOIN_ROOM_REQUEST__INIT;
    req.room_id = UINT64_C(0x7fffffffffffffff);
    req.expected_sources = 8;
    req.expected_sinks = 8;
    req.participant = &who;
    req.engine_capabilities = &caps;
    req.pool_id = 7;
    req.n_ranges = 2;
    req.ranges = ranges;

    size_t len;
    uint8_t *buf = pack_message(&req.base, &len);
    Kvfence__V1__JoinRoomRequest *out = kvfence__v1__join_room_request__unpack(NULL, len, buf);
    assert_non_null(out);
    assert_true(out->room_id == UINT64_C(0x7fffffffffffffff));
    assert_int_equal(out->expected_sources, 8);
    assert_int_equal(out->expected_sinks, 8);
    assert_non_null(out->participant);
    assert_string_equal(out->participant->node_id, "node-a");
    assert_int_equal(out->participant->rank, 3);
    assert_int_equal(out->participant->role, KVFENCE__V1__ROLE__ROLE_SINK);
    assert_non_null(out->engine_capabilities);
    assert_int_equal(out->engine_capabilities->protocol_max, 2);
    assert_int_equal(out->engine_capabilities->n_features, 3);
    assert_string_equal(out->engine_capabilities->features[0], "QUIESCE_V1");
    assert_string_equal(out->engine_capabilities->features[2], "TCP");
    assert_int_equal(out->pool_id, 7);
    assert_int_equal(out->n_ranges, 2);
    assert_int_equal(out->ranges[1]->first, 4096);
    assert_int_equal(out->ranges[1]->count, 1);
    kvfence__v1__join_room_request__free_unpacked(out, NULL);
    free(buf);
}

static void node_message_drained_round_trips(void **state)
{
    (void)state;
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 42;
    key.generation = 9;
    Kvfence__V1__AbortToken token = KVFENCE__V1__ABORT_TOKEN__INIT;
    token.hi = UINT64_C(0xdeadbeefcafef00d);
    token.lo = UINT64_C(0x0123456789abcdef);

    Kvfence__V1__Drained drained = KVFENCE__V1__DRAINED__INIT;
    drained.room = &key;
    drained.token = &token;
    drained.notice_id = 1001;

    Kvfence__V1__NodeMessage msg = KVFENCE__V1__NODE_MESSAGE__INIT;
    msg.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED;
    msg.drained = &drained;

    size_t len;
    uint8_t *buf = pack_message(&msg.base, &len);
    Kvfence__V1__NodeMessage *out = kvfence__v1__node_message__unpack(NULL, len, buf);
    assert_non_null(out);
    assert_int_equal(out->msg_case, KVFENCE__V1__NODE_MESSAGE__MSG_DRAINED);
    assert_non_null(out->drained);
    assert_non_null(out->drained->room);
    assert_int_equal(out->drained->room->room_id, 42);
    assert_int_equal(out->drained->room->generation, 9);
    assert_non_null(out->drained->token);
    assert_true(out->drained->token->hi == UINT64_C(0xdeadbeefcafef00d));
    assert_true(out->drained->token->lo == UINT64_C(0x0123456789abcdef));
    assert_int_equal(out->drained->notice_id, 1001);
    kvfence__v1__node_message__free_unpacked(out, NULL);

    /* A token of zero halves is still present on the wire as a message: the
     * receiver tells "no token" from "token absent" only by the message. */
    Kvfence__V1__AbortToken zero = KVFENCE__V1__ABORT_TOKEN__INIT;
    drained.token = &zero;
    free(buf);
    buf = pack_message(&msg.base, &len);
    out = kvfence__v1__node_message__unpack(NULL, len, buf);
    assert_non_null(out);
    assert_non_null(out->drained->token);
    assert_true(out->drained->token->hi == 0 && out->drained->token->lo == 0);
    kvfence__v1__node_message__free_unpacked(out, NULL);
    free(buf);
}

static void peer_envelope_round_trips_in_a_frame(void **state)
{
    (void)state;
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 5;
    key.generation = 77;
    Kvfence__V1__PageRange range = KVFENCE__V1__PAGE_RANGE__INIT;
    range.first = 128;
    range.count = 32;
    Kvfence__V1__PageRange *ranges[] = {&range};

    Kvfence__V1__ChunkNotice notice = KVFENCE__V1__CHUNK_NOTICE__INIT;
    notice.source_rank = 1;
    notice.sink_rank = 2;
    notice.chunk_seq = 3;
    notice.sink_pool_id = 4;
    notice.n_sink_ranges = 1;
    notice.sink_ranges = ranges;
    notice.length = UINT64_C(32) << 16;
    notice.transport = KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA;

    Kvfence__V1__PeerEnvelope env = KVFENCE__V1__PEER_ENVELOPE__INIT;
    env.room = &key;
    env.sender_node_id = "node-src";
    env.sender_incarnation = 11;
    env.receiver_node_id = "node-dst";
    env.receiver_incarnation = 12;
    env.seq = 1;
    env.body_case = KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE;
    env.chunk_notice = &notice;

    Kvfence__V1__PeerFrame frame = KVFENCE__V1__PEER_FRAME__INIT;
    frame.frame_case = KVFENCE__V1__PEER_FRAME__FRAME_ENVELOPE;
    frame.envelope = &env;

    size_t len;
    uint8_t *buf = pack_message(&frame.base, &len);
    Kvfence__V1__PeerFrame *out = kvfence__v1__peer_frame__unpack(NULL, len, buf);
    assert_non_null(out);
    assert_int_equal(out->frame_case, KVFENCE__V1__PEER_FRAME__FRAME_ENVELOPE);
    const Kvfence__V1__PeerEnvelope *e = out->envelope;
    assert_non_null(e);
    assert_int_equal(e->room->room_id, 5);
    assert_int_equal(e->room->generation, 77);
    assert_string_equal(e->sender_node_id, "node-src");
    assert_int_equal(e->sender_incarnation, 11);
    assert_string_equal(e->receiver_node_id, "node-dst");
    assert_int_equal(e->receiver_incarnation, 12);
    assert_int_equal(e->seq, 1);
    assert_int_equal(e->body_case, KVFENCE__V1__PEER_ENVELOPE__BODY_CHUNK_NOTICE);
    assert_int_equal(e->chunk_notice->chunk_seq, 3);
    assert_int_equal(e->chunk_notice->n_sink_ranges, 1);
    assert_int_equal(e->chunk_notice->sink_ranges[0]->first, 128);
    assert_true(e->chunk_notice->length == UINT64_C(32) << 16);
    assert_int_equal(e->chunk_notice->transport, KVFENCE__V1__TRANSPORT_KIND__TRANSPORT_KIND_RDMA);
    assert_null(e->chunk_notice->staging);
    kvfence__v1__peer_frame__free_unpacked(out, NULL);
    free(buf);
}

static void truncated_buffers_are_refused(void **state)
{
    (void)state;
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 1000;
    key.generation = 2000;
    Kvfence__V1__AbortRoomRequest req = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    req.room = &key;
    req.detail = "engine gave up";

    size_t len;
    uint8_t *buf = pack_message(&req.base, &len);
    assert_true(len > 4);
    /* Every strict prefix that cuts a field short must fail; a prefix that
     * ends exactly between two fields is a valid (shorter) message, so only
     * check the cut points inside the last field and inside the nested key. */
    Kvfence__V1__AbortRoomRequest *whole = kvfence__v1__abort_room_request__unpack(NULL, len, buf);
    assert_non_null(whole);
    kvfence__v1__abort_room_request__free_unpacked(whole, NULL);
    assert_null(kvfence__v1__abort_room_request__unpack(NULL, len - 1, buf));
    assert_null(kvfence__v1__abort_room_request__unpack(NULL, 3, buf));
    assert_null(kvfence__v1__abort_room_request__unpack(NULL, 1, buf));

    /* A fixed64 token cut in half. */
    Kvfence__V1__AbortToken token = KVFENCE__V1__ABORT_TOKEN__INIT;
    token.hi = 1;
    token.lo = 2;
    free(buf);
    buf = pack_message(&token.base, &len);
    assert_int_equal(len, 18);
    assert_null(kvfence__v1__abort_token__unpack(NULL, 13, buf));

    /* A length that points past the end of the buffer. */
    const uint8_t bogus[] = {0x0a, 0x7f, 0x08, 0x01};
    assert_null(kvfence__v1__abort_room_request__unpack(NULL, sizeof(bogus), bogus));
    free(buf);
}

/* Reads a base-128 varint at *pos; returns 0 past the end or on overflow. */
static int read_varint(const uint8_t *buf, size_t len, size_t *pos, uint64_t *value_p)
{
    uint64_t value = 0;
    for (unsigned shift = 0; shift < 64 && *pos < len; shift += 7) {
        uint8_t byte = buf[(*pos)++];
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *value_p = value;
            return 1;
        }
    }
    return 0;
}

/* Finds field 1 (name, a string) of a FileDescriptorProto; writes at most
 * cap-1 bytes and a NUL into name. Returns 1 if found. */
static int file_descriptor_name(const uint8_t *buf, size_t len, char *name, size_t cap)
{
    size_t pos = 0;
    while (pos < len) {
        uint64_t key = 0, n = 0;
        if (!read_varint(buf, len, &pos, &key))
            return 0;
        switch (key & 7) {
        case 0: /* varint */
            if (!read_varint(buf, len, &pos, &n))
                return 0;
            break;
        case 1: /* fixed64 */
            pos += 8;
            break;
        case 5: /* fixed32 */
            pos += 4;
            break;
        case 2: /* length-delimited */
            if (!read_varint(buf, len, &pos, &n) || n > len - pos)
                return 0;
            if (key >> 3 == 1) {
                size_t copy = n < cap - 1 ? (size_t)n : cap - 1;
                memcpy(name, buf + pos, copy);
                name[copy] = '\0';
                return 1;
            }
            pos += (size_t)n;
            break;
        default:
            return 0;
        }
    }
    return 0;
}

static void descriptor_set_holds_the_four_files(void **state)
{
    (void)state;
    static const char *const wanted[] = {
        "kvfence/v1/control.proto",
        "kvfence/v1/node.proto",
        "kvfence/v1/peer.proto",
        "kvfence/v1/types.proto",
    };
    int found[4] = {0};
    size_t files = 0;
    const uint8_t *set = kvf_api_descriptor_set;
    size_t len = kvf_api_descriptor_set_len;
    assert_true(len > 0);

    size_t pos = 0;
    while (pos < len) {
        uint64_t n = 0;
        assert_int_equal(set[pos++], 0x0a); /* field 1 (file), length-delimited */
        assert_true(read_varint(set, len, &pos, &n));
        assert_true(n <= len - pos);
        char name[256];
        assert_true(file_descriptor_name(set + pos, (size_t)n, name, sizeof(name)));
        for (size_t i = 0; i < 4; i++)
            if (strcmp(name, wanted[i]) == 0)
                found[i]++;
        files++;
        pos += (size_t)n;
    }
    assert_int_equal(pos, len);
    for (size_t i = 0; i < 4; i++)
        assert_int_equal(found[i], 1);
    assert_true(files >= 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(join_room_request_round_trips),
        cmocka_unit_test(node_message_drained_round_trips),
        cmocka_unit_test(peer_envelope_round_trips_in_a_frame),
        cmocka_unit_test(truncated_buffers_are_refused),
        cmocka_unit_test(descriptor_set_holds_the_four_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
