/*
 * test_pbjson.c: the CLI's proto3 JSON / YAML printer (clients/cli/pbjson.h)
 * on messages the Admin replies do not exercise: bytes (base64 with
 * padding), a oneof member holding only defaults, an enum number the
 * descriptor does not know, escapes, 64-bit values at their limits, empty
 * messages, and YAML's quoting. The expected JSON strings are what
 * google.protobuf.json_format prints for the same messages (UTF-8 passed
 * through where Python writes \u escapes: the same JSON value).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvfence/v1/control.pb-c.h"
#include "kvfence/v1/node.pb-c.h"
#include "pbjson.h"

/* Prints `m` into a malloc'd string. */
static char *print(const ProtobufCMessage *m, enum cli_pb_form form,
                   const struct cli_pb_extra *extra)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    assert_int_equal(cli_pb_print(f, m, form, extra), 0);
    fclose(f);
    return buf;
}

static void check(const ProtobufCMessage *m, enum cli_pb_form form, const char *want)
{
    char *got = print(m, form, NULL);
    if (strcmp(got, want) != 0) {
        fail_msg("got:\n%s\nwant:\n%s", got, want);
    }
    free(got);
}

static void test_bytes_escapes_and_lists(void **state)
{
    (void)state;
    uint8_t key[4] = {0, 1, 2, 0xff};
    char *features[1] = {"QUIESCE_V1"};
    Kvfence__V1__CapabilitySet caps = KVFENCE__V1__CAPABILITY_SET__INIT;
    caps.protocol_min = 1;
    caps.n_features = 1;
    caps.features = features;
    Kvfence__V1__Endpoint ep = KVFENCE__V1__ENDPOINT__INIT;
    ep.kind = KVFENCE__V1__ENDPOINT_KIND__ENDPOINT_KIND_PEER_ZMQ;
    ep.address = "tcp://x:1";
    Kvfence__V1__Endpoint *eps[1] = {&ep};
    Kvfence__V1__Hello h = KVFENCE__V1__HELLO__INIT;
    h.node_id = "n\"1\n\x01\xc3\xa9";
    h.incarnation = 7;
    h.capabilities = &caps;
    h.n_endpoints = 1;
    h.endpoints = eps;
    h.witnessed_gone = 3;
    h.peer_key.data = key;
    h.peer_key.len = sizeof key;
    check(&h.base, CLI_PB_JSON,
          "{\"nodeId\":\"n\\\"1\\n\\u0001\xc3\xa9\",\"incarnation\":\"7\",\"capabilities\":{"
          "\"protocolMin\":1,\"features\":[\"QUIESCE_V1\"]},\"endpoints\":[{\"kind\":"
          "\"ENDPOINT_KIND_PEER_ZMQ\",\"address\":\"tcp://x:1\"}],\"witnessedGone\":\"3\","
          "\"peerKey\":\"AAEC/w==\"}\n");
    check(&h.base, CLI_PB_YAML,
          "nodeId: \"n\\\"1\\n\\u0001\xc3\xa9\"\n"
          "incarnation: \"7\"\n"
          "capabilities:\n"
          "  protocolMin: 1\n"
          "  features:\n"
          "  - QUIESCE_V1\n"
          "endpoints:\n"
          "- kind: ENDPOINT_KIND_PEER_ZMQ\n"
          "  address: \"tcp://x:1\"\n"
          "witnessedGone: \"3\"\n"
          "peerKey: \"AAEC/w==\"\n");
    /* Padding of one and two bytes. */
    Kvfence__V1__Hello h1 = KVFENCE__V1__HELLO__INIT;
    h1.peer_key.data = (uint8_t *)"ab";
    h1.peer_key.len = 1;
    check(&h1.base, CLI_PB_JSON, "{\"peerKey\":\"YQ==\"}\n");
    h1.peer_key.len = 2;
    check(&h1.base, CLI_PB_JSON, "{\"peerKey\":\"YWI=\"}\n");
}

static void test_oneof_defaults_and_empty(void **state)
{
    (void)state;
    /* A oneof member that holds only defaults is still the one set. */
    Kvfence__V1__Heartbeat hb = KVFENCE__V1__HEARTBEAT__INIT;
    Kvfence__V1__NodeMessage m = KVFENCE__V1__NODE_MESSAGE__INIT;
    m.msg_case = KVFENCE__V1__NODE_MESSAGE__MSG_HEARTBEAT;
    m.heartbeat = &hb;
    check(&m.base, CLI_PB_JSON, "{\"heartbeat\":{}}\n");
    check(&m.base, CLI_PB_YAML, "heartbeat: {}\n");
    /* Nothing set: an empty document. */
    Kvfence__V1__NodeMessage none = KVFENCE__V1__NODE_MESSAGE__INIT;
    check(&none.base, CLI_PB_JSON, "{}\n");
    check(&none.base, CLI_PB_YAML, "{}\n");
    /* Defaults omitted: 0, false, "", enum 0, empty lists, absent messages. */
    Kvfence__V1__RoomInfo r = KVFENCE__V1__ROOM_INFO__INIT;
    Kvfence__V1__RoomKey k = KVFENCE__V1__ROOM_KEY__INIT;
    k.room_id = UINT64_MAX;
    r.room = &k;
    r.past_drain_deadline = 1;
    check(&r.base, CLI_PB_JSON,
          "{\"room\":{\"roomId\":\"18446744073709551615\"},\"pastDrainDeadline\":true}\n");
}

static void test_enums(void **state)
{
    (void)state;
    Kvfence__V1__RoomInfo r = KVFENCE__V1__ROOM_INFO__INIT;
    r.state = KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING;
    r.abort_reason = KVFENCE__V1__ABORT_REASON__ABORT_REASON_ADMIN;
    check(&r.base, CLI_PB_JSON,
          "{\"state\":\"ROOM_STATE_ABORTING\",\"abortReason\":\"ABORT_REASON_ADMIN\"}\n");
    /* A number this build does not know prints as a number, as protobuf does. */
    r.state = (Kvfence__V1__RoomState)99;
    r.abort_reason = 0;
    check(&r.base, CLI_PB_JSON, "{\"state\":99}\n");
    check(&r.base, CLI_PB_YAML, "state: 99\n");
}

static void test_yaml_quoting_and_nesting(void **state)
{
    (void)state;
    /* Strings YAML would read as something else are quoted. */
    static const struct {
        const char *s, *yaml;
    } cases[] = {
        {"cli-n1", "nodeId: cli-n1\n"},
        {"yes", "nodeId: \"yes\"\n"},
        {"No", "nodeId: \"No\"\n"},
        {"null", "nodeId: \"null\"\n"},
        {"123", "nodeId: \"123\"\n"},
        {"a: b", "nodeId: \"a: b\"\n"},
        {"-x", "nodeId: \"-x\"\n"},
        {"#x", "nodeId: \"#x\"\n"},
        {"gpu.node_7", "nodeId: gpu.node_7\n"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Kvfence__V1__GetNodeRequest rq = KVFENCE__V1__GET_NODE_REQUEST__INIT;
        rq.node_id = (char *)cases[i].s;
        check(&rq.base, CLI_PB_YAML, cases[i].yaml);
    }
    /* Lists of messages inside list items, as RoomInfo.participants nests. */
    Kvfence__V1__PageRange r1 = KVFENCE__V1__PAGE_RANGE__INIT, r2 = KVFENCE__V1__PAGE_RANGE__INIT;
    r1.count = 4;
    r2.first = 8;
    r2.count = 2;
    Kvfence__V1__PageRange *rs[2] = {&r1, &r2};
    Kvfence__V1__Lease l = KVFENCE__V1__LEASE__INIT;
    l.lease_id = 1;
    l.n_ranges = 2;
    l.ranges = rs;
    Kvfence__V1__Participant who = KVFENCE__V1__PARTICIPANT__INIT;
    who.node_id = "n1";
    Kvfence__V1__ParticipantInfo p = KVFENCE__V1__PARTICIPANT_INFO__INIT;
    p.participant = &who;
    p.lease = &l;
    Kvfence__V1__ParticipantInfo empty = KVFENCE__V1__PARTICIPANT_INFO__INIT;
    Kvfence__V1__ParticipantInfo *ps[2] = {&p, &empty};
    Kvfence__V1__RoomInfo ri = KVFENCE__V1__ROOM_INFO__INIT;
    ri.n_participants = 2;
    ri.participants = ps;
    check(&ri.base, CLI_PB_YAML,
          "participants:\n"
          "- participant:\n"
          "    nodeId: n1\n"
          "  lease:\n"
          "    leaseId: \"1\"\n"
          "    ranges:\n"
          "    - count: 4\n"
          "    - first: 8\n"
          "      count: 2\n"
          "- {}\n");
    check(&ri.base, CLI_PB_JSON,
          "{\"participants\":[{\"participant\":{\"nodeId\":\"n1\"},\"lease\":{\"leaseId\":\"1\","
          "\"ranges\":[{\"count\":4},{\"first\":8,\"count\":2}]}},{}]}\n");
}

static void test_extra_member(void **state)
{
    (void)state;
    Kvfence__V1__WatchSynced s = KVFENCE__V1__WATCH_SYNCED__INIT;
    Kvfence__V1__LeaseEvent ev = KVFENCE__V1__LEASE_EVENT__INIT;
    ev.event_case = KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED;
    ev.synced = &s;
    struct cli_pb_extra x = {.key = "receivedUnixMs", .value = "1700000000000"};
    char *got = print(&ev.base, CLI_PB_JSON, &x);
    assert_string_equal(got, "{\"receivedUnixMs\":\"1700000000000\",\"synced\":{}}\n");
    free(got);
    got = print(&ev.base, CLI_PB_YAML, &x);
    assert_string_equal(got, "receivedUnixMs: \"1700000000000\"\nsynced: {}\n");
    free(got);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bytes_escapes_and_lists),
        cmocka_unit_test(test_oneof_defaults_and_empty),
        cmocka_unit_test(test_enums),
        cmocka_unit_test(test_yaml_quoting_and_nesting),
        cmocka_unit_test(test_extra_member),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
