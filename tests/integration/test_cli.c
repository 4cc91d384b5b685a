/*
 * test_cli.c: the kvfence admin CLI (KVF_CLI_BIN) end to end. One
 * kvfence-control (KVF_CONTROL_BIN) for the group, with a known state built
 * by fake nodes and unary Control calls:
 *
 *   nodes cli-n1, cli-n2 (incarnation 1, ATTACHED)
 *   room 100: source cli-n1 pages 0+16, sink cli-n2 pages 0+16, ACTIVE
 *   room 200: source cli-n1 pages 100+8, sink cli-n2 pages 100+8, ABORTING
 *             (aborted by the engine; the fake nodes never drain)
 *
 * Each subcommand runs as the real binary (popen), in table and JSON form;
 * the checks look for the header, row content and JSON members, and the
 * exit codes (0 ok, 2 usage, 3 unreachable, 4 not found). The tests run in
 * order: the later ones (fence, watch) change the state.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "fake_node.h"
#include "kvf_error.h"
#include "kvf_proc.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"

#define CALL_TIMEOUT_MS 5000
#define OUT_MAX         65536

struct fx {
    struct kvf_proc proc;
    struct kvf_rpc_channel *ch;
    struct fake_node *n1, *n2;
    uint64_t gen100, gen200;
    char token200[33]; /* 32 hex digits */
    uint64_t token200_hi, token200_lo;
};

static struct fx *g;

/* ---- running the CLI ------------------------------------------------------ */

/* Runs "KVF_CLI_BIN --server TARGET <args>" through the shell, stdout into
 * `out` (and stderr too when `merge`). Returns the exit code. */
static int vrun(char *out, size_t cap, bool merge, bool with_server, const char *fmt, va_list ap)
{
    char args[2048], cmd[4096];
    vsnprintf(args, sizeof args, fmt, ap);
    if (with_server) {
        snprintf(cmd, sizeof cmd, "%s --server %s %s%s", KVF_CLI_BIN, g->proc.target, args,
                 merge ? " 2>&1" : "");
    } else {
        snprintf(cmd, sizeof cmd, "%s %s%s", KVF_CLI_BIN, args, merge ? " 2>&1" : "");
    }
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = 0;
    size_t got;
    while (n + 1 < cap && (got = fread(out + n, 1, cap - 1 - n, p)) > 0) {
        n += got;
    }
    out[n] = '\0';
    int status = pclose(p);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

static int run(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vrun(out, OUT_MAX, false, true, fmt, ap);
    va_end(ap);
    return rc;
}

/* The same with stderr merged into `out`. */
static int run2(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run2(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vrun(out, OUT_MAX, true, true, fmt, ap);
    va_end(ap);
    return rc;
}

/* Without --server. */
static int run_raw(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run_raw(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vrun(out, OUT_MAX, true, false, fmt, ap);
    va_end(ap);
    return rc;
}

/* run() into a caller's buffer of `cap` bytes. */
static int run_cap(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int run_cap(char *buf, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = vrun(buf, cap, false, true, fmt, ap);
    va_end(ap);
    return rc;
}

/* Runs `cmdline` through the shell (no --server added), stdout into `buf`
 * (stderr too when `merge`). Returns the exit code. */
static int run_sh(char *buf, size_t cap, bool merge, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int run_sh(char *buf, size_t cap, bool merge, const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    if (merge) {
        strncat(cmd, " 2>&1", sizeof cmd - strlen(cmd) - 1);
    }
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = 0, got;
    while (n + 1 < cap && (got = fread(buf + n, 1, cap - 1 - n, p)) > 0) {
        n += got;
    }
    buf[n] = '\0';
    int status = pclose(p);
    assert_true(WIFEXITED(status));
    return WEXITSTATUS(status);
}

#define assert_has(hay, needle)                                    \
    do {                                                           \
        if (!strstr((hay), (needle))) {                            \
            fail_msg("output lacks \"%s\":\n%s", (needle), (hay)); \
        }                                                          \
    } while (0)

#define assert_lacks(hay, needle)                                \
    do {                                                         \
        if (strstr((hay), (needle))) {                           \
            fail_msg("output has \"%s\":\n%s", (needle), (hay)); \
        }                                                        \
    } while (0)

/* One JSON document: starts with '{', ends with "}\n", nothing after, braces
 * and brackets balanced outside strings. */
static void assert_json_doc(const char *s)
{
    size_t len = strlen(s);
    if (len < 3 || s[0] != '{' || s[len - 1] != '\n' || s[len - 2] != '}') {
        fail_msg("not one JSON document:\n%s", s);
    }
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i + 1 < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') {
                i++;
            } else if (c == '"') {
                in_str = false;
            }
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            depth--;
            if (depth == 0 && i + 2 != len) {
                fail_msg("trailing data after the JSON document:\n%s", s);
            }
        } else if (c == '\n') {
            fail_msg("newline inside the JSON document:\n%s", s);
        }
    }
    assert_int_equal(depth, 0);
}

/* The line of `s` that starts with `prefix`, copied into `line`. */
static bool find_line(const char *s, const char *prefix, char *line, size_t cap)
{
    size_t pl = strlen(prefix);
    for (const char *p = s; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (strncmp(p, prefix, pl) == 0) {
            const char *e = strchr(p, '\n');
            size_t n = e ? (size_t)(e - p) : strlen(p);
            if (n >= cap) {
                n = cap - 1;
            }
            memcpy(line, p, n);
            line[n] = '\0';
            return true;
        }
    }
    return false;
}

/* The number of whitespace separated words of `line`, into words[]. */
static size_t split(char *line, char **words, size_t max)
{
    size_t n = 0;
    char *save = NULL;
    for (char *w = strtok_r(line, " \t\n", &save); w && n < max;
         w = strtok_r(NULL, " \t\n", &save)) {
        words[n++] = w;
    }
    return n;
}

/* ---- building the state ---------------------------------------------------- */

static int call(const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st;
    int rc = kvf_rpc_unary(g->ch, method, buf, len, CALL_TIMEOUT_MS, &resp, &resp_len, &st);
    free(buf);
    if (rc != 0) {
        free(resp);
        fail_msg("%s: %s: %s", method, kvf_grpc_code_name(st.code), st.message);
    }
    *resp_p = protobuf_c_message_unpack(rd, NULL, resp_len, resp);
    free(resp);
    assert_non_null(*resp_p);
    return rc;
}

/* Joins (node, rank 0, role) to `room_id` with pages [first, first+count);
 * returns the generation. */
static uint64_t join(uint64_t room_id, const char *node, Kvfence__V1__Role role, uint32_t first,
                     uint32_t count)
{
    Kvfence__V1__Participant p = KVFENCE__V1__PARTICIPANT__INIT;
    p.node_id = (char *)node;
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
    call("/kvfence.v1.Control/JoinRoom", &rq.base, &kvfence__v1__join_room_response__descriptor,
         &m);
    Kvfence__V1__JoinRoomResponse *jr = (Kvfence__V1__JoinRoomResponse *)m;
    uint64_t gen = jr->room->generation;
    kvfence__v1__join_room_response__free_unpacked(jr, NULL);
    return gen;
}

/* Both nodes join `room_id` (ACTIVE). */
static uint64_t make_room(uint64_t room_id, uint32_t first, uint32_t count)
{
    uint64_t gen = join(room_id, "cli-n1", KVFENCE__V1__ROLE__ROLE_SOURCE, first, count);
    assert_int_equal(join(room_id, "cli-n2", KVFENCE__V1__ROLE__ROLE_SINK, first, count), gen);
    return gen;
}

static int group_setup(void **state)
{
    (void)state;
    g = calloc(1, sizeof *g);
    assert_non_null(g);
    /* The fake nodes send no heartbeats: their sessions must not be ended for
     * silence (15 s by default) however slow the machine runs the group. */
    const char *args[] = {"--threads", "2", "--heartbeat-timeout-ms", "0", NULL};
    assert_int_equal(kvf_proc_start(&g->proc, KVF_CONTROL_BIN, args), 0);
    struct kvf_rpc_channel_opts co;
    kvf_rpc_channel_opts_init(&co);
    co.wait_for_ready = true;
    g->ch = kvf_rpc_channel_create(g->proc.target, &co);
    assert_non_null(g->ch);
    g->n1 = fake_node_attach(g->ch, "cli-n1", 1);
    g->n2 = fake_node_attach(g->ch, "cli-n2", 1);
    assert_non_null(g->n1);
    assert_non_null(g->n2);

    g->gen100 = make_room(100, 0, 16);
    g->gen200 = make_room(200, 100, 8);

    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = 200;
    Kvfence__V1__AbortRoomRequest rq = KVFENCE__V1__ABORT_ROOM_REQUEST__INIT;
    rq.room = &key;
    rq.detail = "test_cli";
    ProtobufCMessage *m = NULL;
    call("/kvfence.v1.Control/AbortRoom", &rq.base, &kvfence__v1__abort_room_response__descriptor,
         &m);
    Kvfence__V1__AbortRoomResponse *ar = (Kvfence__V1__AbortRoomResponse *)m;
    assert_int_equal(ar->state, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING);
    snprintf(g->token200, sizeof g->token200, "%016llx%016llx", (unsigned long long)ar->token->hi,
             (unsigned long long)ar->token->lo);
    g->token200_hi = ar->token->hi;
    g->token200_lo = ar->token->lo;
    kvfence__v1__abort_room_response__free_unpacked(ar, NULL);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    int rc = 0;
    fake_node_vanish(g->n1);
    fake_node_vanish(g->n2);
    kvf_rpc_channel_destroy(g->ch);
    if (g->proc.pid > 0) {
        int status = kvf_proc_stop(&g->proc, 10000);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "kvfence-control did not exit 0 on SIGTERM (status 0x%x)\n", status);
            rc = -1;
        }
    }
    kvf_proc_kill(&g->proc);
    free(g);
    g = NULL;
    return rc;
}

/* ---- tests ------------------------------------------------------------------- */

static char out[OUT_MAX];

static void test_help_and_version(void **state)
{
    (void)state;
    assert_int_equal(run_raw(out, "--help"), 0);
    assert_has(out, "Usage: kvfence");
    assert_has(out, "Exit codes:");
    assert_has(out, "4  not found");
    assert_int_equal(run_raw(out, "-h"), 0);
    static const char *const cmds[] = {"nodes", "rooms", "room",  "leases",
                                       "stats", "abort", "fence", "watch"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char want[64];
        assert_int_equal(run_raw(out, "%s --help", cmds[i]), 0);
        snprintf(want, sizeof want, "Usage: kvfence %s", cmds[i]);
        assert_has(out, want);
    }
    assert_int_equal(run_raw(out, "rooms -h"), 0);
    assert_has(out, "--min-age-ms");
    assert_int_equal(run_raw(out, "--version"), 0);
    assert_has(out, "kvfence ");
}

static void test_usage_errors(void **state)
{
    (void)state;
    assert_int_equal(run_raw(out, "%s", ""), 2);
    assert_int_equal(run_raw(out, "bogus"), 2);
    assert_has(out, "unknown command 'bogus'");
    assert_int_equal(run2(out, "room"), 2);
    assert_int_equal(run2(out, "room abc"), 2);
    assert_int_equal(run2(out, "room 0"), 2);
    assert_int_equal(run2(out, "room 1 2"), 2);
    assert_int_equal(run2(out, "rooms --state nope"), 2);
    assert_has(out, "unknown state 'nope'");
    assert_int_equal(run2(out, "rooms --bogus"), 2);
    assert_int_equal(run2(out, "nodes --generation 3"), 2);
    assert_int_equal(run2(out, "-o xml nodes"), 2);
    assert_int_equal(run2(out, "--timeout 0 nodes"), 2);
    assert_int_equal(run2(out, "watch --count x"), 2);
    assert_int_equal(run2(out, "--tls-cert c.pem nodes"), 2);
    assert_int_equal(run2(out, "fence"), 2);
    assert_int_equal(run2(out, "--tls-ca /nonexistent/ca.pem nodes"), 2);
}

static void test_nodes(void **state)
{
    (void)state;
    char line[512], *w[16];
    assert_int_equal(run(out, "nodes"), 0);
    assert_true(find_line(out, "NODE ", line, sizeof line));
    assert_has(line, "INCARNATION");
    assert_has(line, "STATE");
    assert_has(line, "LAST_SEEN");
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_true(split(line, w, 16) >= 9);
    assert_string_equal(w[1], "1");
    assert_string_equal(w[2], "ATTACHED");
    assert_string_equal(w[4], "2");     /* rooms */
    assert_string_equal(w[5], "1");     /* pools */
    assert_string_not_equal(w[7], "-"); /* STATE_AGE: since it attached */
    assert_string_not_equal(w[8], "-"); /* LAST_SEEN: its session's last message */
    assert_true(find_line(out, "cli-n2 ", line, sizeof line));

    /* proto3 JSON: lowerCamelCase, 64-bit integers as strings, enums by
     * name, defaults (notices_pending 0) omitted. */
    assert_int_equal(run(out, "nodes -o json"), 0);
    assert_json_doc(out);
    assert_has(out, "{\"nodes\":[{\"nodeId\":\"cli-n1\",\"incarnation\":\"1\","
                    "\"state\":\"NODE_STATE_ATTACHED\",\"protocolVersion\":1,");
    assert_has(out, "\"nodeId\":\"cli-n2\"");
    assert_has(out, "\"endpoints\":[{\"kind\":\"ENDPOINT_KIND_PEER_ZMQ\",\"address\":\"tcp://");
    assert_has(out, "\"softwareVersion\":\"fake-node\"");
    assert_has(out, "\"pools\":[{\"poolId\":1,");
    assert_has(out, "\"roomCount\":2,\"stateAgeMs\":\"");
    assert_has(out, "\"lastSeenMs\":\"");
    assert_lacks(out, "node_id");
}

static void test_rooms(void **state)
{
    (void)state;
    char line[512], *w[16];
    assert_int_equal(run(out, "rooms"), 0);
    assert_true(find_line(out, "ROOM ", line, sizeof line));
    assert_has(line, "GENERATION");
    assert_has(line, "PARTICIPANTS");
    assert_has(line, "TOKEN");
    assert_true(find_line(out, "100 ", line, sizeof line));
    assert_true(split(line, w, 16) >= 9);
    assert_int_equal(strtoull(w[1], NULL, 10), g->gen100);
    assert_string_equal(w[2], "ACTIVE");
    assert_string_equal(w[3], "2/2");
    assert_string_equal(w[8], "-");
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_true(split(line, w, 16) >= 9);
    assert_string_equal(w[2], "ABORTING");
    assert_string_equal(w[6], "ENGINE");
    assert_string_equal(w[8], g->token200);

    assert_int_equal(run(out, "rooms --state aborting"), 0);
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_false(find_line(out, "100 ", line, sizeof line));
    assert_int_equal(run(out, "rooms --state ACTIVE,aborting --node cli-n2 --min-age-ms 0"), 0);
    assert_true(find_line(out, "100 ", line, sizeof line));
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_int_equal(run(out, "rooms --node nobody"), 0);
    assert_false(find_line(out, "100 ", line, sizeof line));
    assert_true(find_line(out, "ROOM ", line, sizeof line)); /* header even when empty */
    assert_int_equal(run(out, "rooms --min-age-ms 3600000"), 0);
    assert_false(find_line(out, "100 ", line, sizeof line));

    assert_int_equal(run(out, "-o json rooms"), 0);
    assert_json_doc(out);
    assert_has(out, "{\"rooms\":[{\"room\":{\"roomId\":\"100\",");
    assert_has(out, "\"state\":\"ROOM_STATE_ACTIVE\",\"expectedSources\":1");
    assert_has(out, "\"roomId\":\"200\",");
    char want[160];
    snprintf(want, sizeof want,
             "\"state\":\"ROOM_STATE_ABORTING\",\"abortReason\":\"ABORT_REASON_ENGINE\","
             "\"token\":{\"hi\":\"%llu\",\"lo\":\"%llu\"}",
             (unsigned long long)g->token200_hi, (unsigned long long)g->token200_lo);
    assert_has(out, want);
    assert_has(out, "\"participantCount\":2");
    assert_lacks(out, "pastDrainDeadline"); /* false: omitted */

    assert_int_equal(run(out, "rooms --state active -o json"), 0);
    assert_json_doc(out);
    assert_has(out, "\"roomId\":\"100\",");
    assert_lacks(out, "\"roomId\":\"200\",");
    assert_int_equal(run(out, "rooms --state completed -o json"), 0);
    assert_string_equal(out, "{}\n");
}

static void test_room(void **state)
{
    (void)state;
    char line[512], *w[16];
    assert_int_equal(run(out, "room 200"), 0);
    assert_true(find_line(out, "state:", line, sizeof line));
    assert_has(line, "ABORTING");
    assert_true(find_line(out, "token:", line, sizeof line));
    assert_has(line, g->token200);
    assert_true(find_line(out, "abort reason:", line, sizeof line));
    assert_has(line, "ENGINE");
    assert_true(find_line(out, "age:", line, sizeof line));
    assert_true(find_line(out, "NODE ", line, sizeof line));
    assert_has(line, "RANK");
    assert_has(line, "LEASE");
    assert_has(line, "PAGES");
    assert_has(line, "DRAINED");
    assert_has(line, "FENCED");
    assert_has(line, "NOTICES");
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_true(split(line, w, 16) == 12);
    assert_string_equal(w[1], "1");      /* incarnation */
    assert_string_equal(w[2], "0");      /* rank */
    assert_string_equal(w[3], "SOURCE"); /* role */
    assert_string_equal(w[7], "8");      /* pages */
    assert_string_equal(w[8], "no");     /* completed */
    assert_string_equal(w[9], "no");     /* drained */
    assert_string_equal(w[10], "no");    /* fenced */
    /* w[11]: notice attempts; GetRoom reports 0 for now (admin_svc.c). */
    assert_true(find_line(out, "cli-n2 ", line, sizeof line));
    assert_has(line, "SINK");

    assert_int_equal(run(out, "room 200 -o json"), 0);
    assert_json_doc(out);
    assert_has(out, "{\"room\":{\"roomId\":\"200\",");
    char want[128];
    snprintf(want, sizeof want, "\"token\":{\"hi\":\"%llu\",\"lo\":\"%llu\"}",
             (unsigned long long)g->token200_hi, (unsigned long long)g->token200_lo);
    assert_has(out, want);
    /* rank 0 omitted: the default */
    assert_has(out,
               "\"participants\":[{\"participant\":{\"nodeId\":\"cli-n1\","
               "\"role\":\"ROLE_SOURCE\"},\"nodeIncarnation\":\"1\",\"lease\":{\"leaseId\":\"");
    assert_has(out, "\"ranges\":[{\"first\":100,\"count\":8}]");
    assert_has(out, "\"noticeAttempts\":");
    assert_lacks(out, "\"drained\""); /* false: omitted */
    assert_has(out, "\"nodeId\":\"cli-n2\"");

    char gen[32];
    snprintf(gen, sizeof gen, "%llu", (unsigned long long)g->gen100);
    assert_int_equal(run(out, "room 100 --generation %s -o json", gen), 0);
    assert_json_doc(out);
    assert_has(out, "\"state\":\"ROOM_STATE_ACTIVE\"");
    assert_lacks(out, "\"token\"");
    assert_has(out, "\"mode\":\"LEASE_MODE_READ\"");
    assert_has(out, "\"mode\":\"LEASE_MODE_WRITE\"");
}

static void test_leases(void **state)
{
    (void)state;
    char line[512], *w[16];
    assert_int_equal(run(out, "leases"), 0);
    assert_true(find_line(out, "LEASE ", line, sizeof line));
    assert_has(line, "ROOM");
    assert_has(line, "RANGES");
    int rows = 0;
    for (const char *p = strchr(out, '\n'); p && p[1]; p = strchr(p + 1, '\n')) {
        rows++;
    }
    assert_int_equal(rows, 4);
    assert_has(out, "0+16");
    assert_has(out, "100+8");

    assert_int_equal(run(out, "leases --room 100 --node cli-n1"), 0);
    assert_true(find_line(out, "LEASE ", line, sizeof line));
    const char *row = strchr(out, '\n') + 1;
    snprintf(line, sizeof line, "%s", row);
    assert_true(split(line, w, 16) == 11);
    assert_string_equal(w[1], "100");
    assert_string_equal(w[3], "cli-n1");
    assert_string_equal(w[5], "SOURCE");
    assert_string_equal(w[7], "READ");
    assert_string_equal(w[8], "ACTIVE");
    assert_string_equal(w[9], "16");
    assert_string_equal(w[10], "0+16");

    assert_int_equal(run(out, "leases --room 100 -o json"), 0);
    assert_json_doc(out);
    assert_has(out, "{\"leases\":[{\"leaseId\":\"");
    assert_has(out, "\"room\":{\"roomId\":\"100\",");
    assert_lacks(out, "\"roomId\":\"200\",");
    assert_has(out, "\"state\":\"LEASE_STATE_ACTIVE\"");
    assert_int_equal(run(out, "leases --state released -o json"), 0);
    assert_string_equal(out, "{}\n");
}

static void test_stats(void **state)
{
    (void)state;
    char line[512], *w[4];
    assert_int_equal(run(out, "stats"), 0);
    assert_true(find_line(out, "STAT ", line, sizeof line));
    assert_has(line, "VALUE");
    static const struct {
        const char *name, *value;
    } want[] = {
        {"rooms.active ", "1"},   {"rooms.aborting ", "1"},  {"rooms.opening ", "0"},
        {"nodes.attached ", "2"}, {"leases.released ", "0"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!find_line(out, want[i].name, line, sizeof line)) {
            fail_msg("no %s in\n%s", want[i].name, out);
        }
        assert_int_equal(split(line, w, 4), 2);
        assert_string_equal(w[1], want[i].value);
    }
    assert_true(find_line(out, "uptime_ms ", line, sizeof line));

    assert_int_equal(run(out, "stats -o json"), 0);
    assert_json_doc(out);
    assert_has(out, "{\"rooms\":{\"active\":\"1\",\"aborting\":\"1\"},\"leases\":{");
    assert_has(out, "\"nodes\":{\"attached\":\"2\"},\"noticesPending\":\"");
    assert_has(out, "\"generation\":\"");
    assert_has(out, "\"uptimeMs\":\"");
}

static void test_abort_idempotent(void **state)
{
    (void)state;
    char want[128];
    /* The ABORTING room: the same token as the engine's abort, twice. */
    for (int i = 0; i < 2; i++) {
        assert_int_equal(run(out, "abort 200 -o json --reason 'ops \"test\"'"), 0);
        assert_json_doc(out);
        snprintf(want, sizeof want, "\"token\":{\"hi\":\"%llu\",\"lo\":\"%llu\"}",
                 (unsigned long long)g->token200_hi, (unsigned long long)g->token200_lo);
        assert_has(out, want);
        assert_has(out, "\"state\":\"ROOM_STATE_ABORTING\",\"alreadyAborting\":true,"
                        "\"reason\":\"ABORT_REASON_ENGINE\"");
    }
    char line[512], *w[8];
    assert_int_equal(run(out, "abort 200"), 0);
    assert_true(find_line(out, "ROOM ", line, sizeof line));
    assert_has(line, "TOKEN");
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_int_equal(split(line, w, 8), 6);
    assert_string_equal(w[2], "ABORTING");
    assert_string_equal(w[4], "yes");
    assert_string_equal(w[5], g->token200);
}

static void test_not_found(void **state)
{
    (void)state;
    assert_int_equal(run2(out, "room 999"), 4);
    assert_has(out, "kvfence: NOT_FOUND: ");
    assert_int_equal(run2(out, "room 999 -o json"), 4);
    assert_int_equal(run2(out, "room 100 --generation 999999"), 4);
    assert_int_equal(run2(out, "abort 999"), 4);
    assert_has(out, "kvfence: NOT_FOUND: ");
    assert_int_equal(run2(out, "fence no-such-node"), 4);
    assert_has(out, "kvfence: NOT_FOUND: ");
    /* stdout stays empty on errors */
    assert_int_equal(run(out, "room 999 -o json 2>/dev/null"), 4);
    assert_string_equal(out, "");
}

static void test_fence(void **state)
{
    (void)state;
    char line[256], *w[4];
    assert_int_equal(run(out, "fence cli-n1"), 0);
    assert_true(find_line(out, "NODE ", line, sizeof line));
    assert_has(line, "FENCERS");
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_int_equal(split(line, w, 4), 3);
    assert_string_equal(w[1], "1");
    assert_string_equal(w[2], "1"); /* cli-n2 shares its rooms */
    assert_int_equal(run(out, "fence cli-n2 -o json"), 0);
    assert_json_doc(out);
    assert_string_equal(out, "{\"incarnation\":\"1\",\"fencers\":1}\n");
}

/* Reads one line from a watch; fails at EOF. */
static void watch_line(FILE *p, char *line, size_t cap)
{
    if (!fgets(line, (int)cap, p)) {
        fail_msg("the watch ended early");
    }
}

/* The token of an AbortRoomResponse in proto3 JSON: {"hi":"N","lo":"N"}. */
static void parse_token_json(const char *json, Kvfence__V1__AbortToken *t)
{
    const char *hi = strstr(json, "\"token\":{\"hi\":\"");
    const char *lo = strstr(json, "\"lo\":\"");
    if (!hi || !lo) {
        fail_msg("no token in %s", json);
    }
    t->hi = strtoull(hi + strlen("\"token\":{\"hi\":\""), NULL, 10);
    t->lo = strtoull(lo + strlen("\"lo\":\""), NULL, 10);
}

static void test_watch(void **state)
{
    (void)state;
    uint64_t gen = make_room(300, 200, 4);
    char cmd[512], line[1024];
    snprintf(cmd, sizeof cmd, "%s --server %s watch --room-states --count 2", KVF_CLI_BIN,
             g->proc.target);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    watch_line(p, line, sizeof line);
    assert_has(line, " synced replayed=");

    assert_int_equal(run(out, "-o json abort 300 --reason watch-test"), 0);
    Kvfence__V1__AbortToken token = KVFENCE__V1__ABORT_TOKEN__INIT;
    parse_token_json(out, &token);

    watch_line(p, line, sizeof line);
    char want[128];
    snprintf(want, sizeof want, "room_state room=300 generation=%llu ACTIVE -> ABORTING",
             (unsigned long long)gen);
    assert_has(line, want);
    assert_has(line, "reason=ADMIN");
    assert_has(line, " token=");

    /* Both nodes drain: the leases are released and the room ABORTED. */
    assert_int_equal(fake_node_send_drained(g->n1, 300, gen, &token), 0);
    assert_int_equal(fake_node_send_drained(g->n2, 300, gen, &token), 0);
    watch_line(p, line, sizeof line);
    if (!strstr(line, "released lease=") && !strstr(line, "ABORTING -> ABORTED")) {
        fail_msg("unexpected second event: %s", line);
    }
    assert_has(line, "room=300");
    assert_null(fgets(line, sizeof line, p)); /* --count 2: done */
    int status = pclose(p);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);

    /* JSON lines; the replay now holds room 300's releases. */
    snprintf(cmd, sizeof cmd, "%s --server %s -o json watch --node cli-n1 --count 1", KVF_CLI_BIN,
             g->proc.target);
    p = popen(cmd, "r");
    assert_non_null(p);
    watch_line(p, line, sizeof line);
    assert_json_doc(line);
    assert_has(line, "{\"receivedUnixMs\":\"");
    assert_has(line, "\"released\":{\"leaseId\":\"");
    assert_has(line, "\"room\":{\"roomId\":\"300\",");
    assert_has(line, "\"nodeId\":\"cli-n1\"");
    assert_has(line, "\"state\":\"LEASE_STATE_RELEASED\"");
    assert_null(fgets(line, sizeof line, p));
    status = pclose(p);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);

    assert_int_equal(run(out, "room 300 -o json"), 0);
    assert_has(out, "\"state\":\"ROOM_STATE_ABORTED\"");
    assert_has(out, "\"drained\":true");
}

static void test_env_and_unreachable(void **state)
{
    (void)state;
    char target[96];
    snprintf(target, sizeof target, "%s", g->proc.target);
    assert_int_equal(run_raw(out, "--server 127.0.0.1:1 nodes"), 3);
    assert_has(out, "kvfence: UNAVAILABLE: ");
    assert_int_equal(run_raw(out, "--server 127.0.0.1:1 -o json room 1"), 3);
    assert_int_equal(run_raw(out, "--server 127.0.0.1:1 watch --count 1"), 3);
    /* A listener that never speaks HTTP/2: the call runs into its deadline. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(fd, 8), 0);
    socklen_t sl = sizeof sa;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    int rc = run_raw(out, "--timeout 300 --server 127.0.0.1:%u stats", ntohs(sa.sin_port));
    close(fd);
    if (rc != 3) {
        fail_msg("silent server: exit %d:\n%s", rc, out);
    }
    assert_has(out, "kvfence: DEADLINE_EXCEEDED: ");
    /* KVFENCE_SERVER picks the server; --server wins over it. */
    char cmd[512];
    snprintf(cmd, sizeof cmd, "KVFENCE_SERVER=%s %s stats -o json", target, KVF_CLI_BIN);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, OUT_MAX - 1, p);
    out[n] = '\0';
    assert_int_equal(WEXITSTATUS(pclose(p)), 0);
    assert_json_doc(out);
    snprintf(cmd, sizeof cmd, "KVFENCE_SERVER=%s %s --server 127.0.0.1:1 stats 2>/dev/null", target,
             KVF_CLI_BIN);
    p = popen(cmd, "r");
    assert_non_null(p);
    while (fread(out, 1, OUT_MAX - 1, p) > 0) {
    }
    assert_int_equal(WEXITSTATUS(pclose(p)), 3);
}

/* ---- TLS ------------------------------------------------------------------- */

static void test_tls(void **state)
{
    (void)state;
    char dir[64] = "/tmp/kvf-cli-tls-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "(set -e; cd %s; "
             "K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'; "
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=kvf-test-ca; "
             "openssl req $K -keyout server.key -out server.csr -subj /CN=kvf-control; "
             "printf 'subjectAltName=DNS:kvf-control,IP:127.0.0.1\\n' > server.ext; "
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out server.pem -days 2 -extfile server.ext; "
             "openssl req $K -keyout client.key -out client.csr -subj /CN=kvf-admin; "
             "printf 'subjectAltName=URI:spiffe://kvfence/admin\\n' > client.ext; "
             "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "  -out client.pem -days 2 -extfile client.ext) >/dev/null 2>&1",
             dir);
    if (system(cmd) != 0) { /* openssl is required at configure time */
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        (void)system(cmd);
        fail_msg("openssl could not make the test certificates");
    }
    char cert[128], key[128], ca[128];
    snprintf(cert, sizeof cert, "%s/server.pem", dir);
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    const char *args[] = {"--threads",       "2", "--tls-cert", cert, "--tls-key", key,
                          "--tls-client-ca", ca,  NULL};
    struct kvf_proc tp;
    memset(&tp, 0, sizeof tp);
    assert_int_equal(kvf_proc_start(&tp, KVF_CONTROL_BIN, args), 0);

    int rc_mtls = run_raw(out,
                          "--server %s --tls-ca %s/ca.pem --tls-cert %s/client.pem "
                          "--tls-key %s/client.key --tls-server-name kvf-control -o json stats",
                          tp.target, dir, dir, dir);
    static char saved[OUT_MAX];
    memcpy(saved, out, sizeof saved);
    int rc_ip = run_raw(out,
                        "--server %s --tls-ca %s/ca.pem --tls-cert %s/client.pem "
                        "--tls-key %s/client.key nodes",
                        tp.target, dir, dir, dir);
    int rc_nocert = run_raw(out, "--server %s --tls-ca %s/ca.pem stats", tp.target, dir);
    /* The server's certificate names no admin: refused (PERMISSION_DENIED). */
    int rc_notadmin = run_raw(out,
                              "--server %s --tls-ca %s/ca.pem --tls-cert %s/server.pem "
                              "--tls-key %s/server.key stats",
                              tp.target, dir, dir, dir);
    int rc_plain = run_raw(out, "--server %s stats", tp.target);
    /* KVFENCE_CACERT / KVFENCE_CERT / KVFENCE_KEY beside KVFENCE_SERVER, as
     * etcdctl's ETCDCTL_*; flags win over them. */
    static char env_out[OUT_MAX];
    int rc_env = run_sh(env_out, sizeof env_out, true,
                        "KVFENCE_SERVER=%s KVFENCE_CACERT=%s/ca.pem KVFENCE_CERT=%s/client.pem "
                        "KVFENCE_KEY=%s/client.key %s -o json stats",
                        tp.target, dir, dir, dir, KVF_CLI_BIN);
    int rc_env_flags = run_sh(out, OUT_MAX, true,
                              "KVFENCE_SERVER=%s KVFENCE_CACERT=/nonexistent/ca.pem "
                              "KVFENCE_CERT=%s/server.pem KVFENCE_KEY=%s/server.key "
                              "%s --tls-ca %s/ca.pem --tls-cert %s/client.pem "
                              "--tls-key %s/client.key stats",
                              tp.target, dir, dir, KVF_CLI_BIN, dir, dir, dir);
    int rc_env_bad =
        run_sh(out, OUT_MAX, true, "KVFENCE_SERVER=%s KVFENCE_CACERT=/nonexistent/ca.pem %s stats",
               tp.target, KVF_CLI_BIN);

    kvf_proc_stop(&tp, 10000);
    kvf_proc_kill(&tp);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    (void)system(cmd);

    if (rc_mtls != 0) {
        fail_msg("mutual TLS stats: exit %d:\n%s", rc_mtls, saved);
    }
    assert_has(saved, "{\"rooms\":{");
    assert_int_equal(rc_ip, 0);     /* the certificate names 127.0.0.1 too */
    assert_int_equal(rc_nocert, 3); /* the server wants a client certificate */
    assert_int_not_equal(rc_notadmin, 0);
    assert_int_equal(rc_plain, 3); /* plaintext to a TLS server */
    if (rc_env != 0) {
        fail_msg("TLS files from the environment: exit %d:\n%s", rc_env, env_out);
    }
    assert_has(env_out, "{\"rooms\":");
    assert_int_equal(rc_env_flags, 0); /* the flags' files, not the environment's */
    assert_int_equal(rc_env_bad, 2);   /* an unreadable KVFENCE_CACERT */
}

/* Counts the lines of `s` that hold `needle`. */
static int count_lines_with(const char *s, const char *needle)
{
    int n = 0;
    for (const char *line = s; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        const char *hit = strstr(line, needle);
        if (hit && (size_t)(hit - line) < len) {
            n++;
        }
        line = end ? end + 1 : NULL;
    }
    return n;
}

/* Counts the occurrences of `needle` in `s`. */
static int count_hits(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) {
        n++;
    }
    return n;
}

/* More rooms and leases than one Admin page holds (100, the server's default):
 * the CLI must follow next_page_token to the end and list each one once. Two
 * nodes of their own, so the earlier tests' state does not matter. */
static void test_paging(void **state)
{
    (void)state;
    enum { ROOMS = 130, BASE = 5000 };
    struct fake_node *p1 = fake_node_attach(g->ch, "cli-p1", 1);
    struct fake_node *p2 = fake_node_attach(g->ch, "cli-p2", 1);
    assert_non_null(p1);
    assert_non_null(p2);
    for (unsigned i = 0; i < ROOMS; i++) {
        uint64_t gen = join(BASE + i, "cli-p1", KVFENCE__V1__ROLE__ROLE_SOURCE, 2 * i, 2);
        assert_int_equal(join(BASE + i, "cli-p2", KVFENCE__V1__ROLE__ROLE_SINK, 2 * i, 2), gen);
    }

    static char big[OUT_MAX * 4];
    assert_int_equal(run_cap(big, sizeof big, "rooms --node cli-p1"), 0);
    assert_int_equal(count_lines_with(big, " ACTIVE "), ROOMS);
    char want[64];
    for (unsigned i = 0; i < ROOMS; i++) {
        snprintf(want, sizeof want, "\n%u ", BASE + i);
        assert_int_equal(count_hits(big, want), 1);
    }
    assert_int_equal(run_cap(big, sizeof big, "-o json rooms --node cli-p2"), 0);
    assert_json_doc(big);
    assert_int_equal(count_hits(big, "\"roomId\":\"5"), ROOMS);

    /* Two leases per room: 260 rows over three pages. */
    assert_int_equal(run_cap(big, sizeof big, "leases --node cli-p1"), 0);
    assert_int_equal(count_lines_with(big, " cli-p1 "), ROOMS);
    assert_int_equal(run_cap(big, sizeof big, "-o json leases"), 0);
    assert_json_doc(big);
    assert_int_equal(count_hits(big, "\"nodeId\":\"cli-p1\""), ROOMS);
    assert_int_equal(count_hits(big, "\"nodeId\":\"cli-p2\""), ROOMS);

    fake_node_vanish(p1);
    fake_node_vanish(p2);
}

/* ---- the proto3 JSON dialect, node views, output forms ---------------------- */

/* Parses the CLI's JSON with a real parser: python3's json module prints each
 * room id of `-o json rooms` (as the JSON holds it: a string) on its own line. */
#define PY_ROOM_IDS                                                                     \
    "/usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); "                    \
    "[print(type(r[\"room\"][\"roomId\"]).__name__, r[\"room\"][\"roomId\"]) for r in " \
    "d[\"rooms\"]]'"

/* Room ids above 2^53 lose digits as JSON numbers (jq, JavaScript, any
 * double-based parser): the CLI writes 64-bit integers as strings, as proto3's
 * JSON mapping does, and the id read back from the JSON finds the room. */
static void test_json_big_ids(void **state)
{
    (void)state;
    static const char *const ids[] = {"9223372036854775806", "9007199254740993"};
    uint64_t gen0 = make_room(9223372036854775806ull, 300, 4);
    uint64_t gen1 = make_room(9007199254740993ull, 310, 4);
    assert_true(gen1 > gen0);

    assert_int_equal(run(out, "-o json rooms --state active"), 0);
    assert_json_doc(out);
    assert_has(out, "\"roomId\":\"9223372036854775806\"");
    assert_has(out, "\"roomId\":\"9007199254740993\"");
    assert_has(out, "\"state\":\"ROOM_STATE_ACTIVE\"");

    static char parsed[OUT_MAX];
    int rc = run_sh(parsed, sizeof parsed, true, "%s --server %s -o json rooms --state active | %s",
                    KVF_CLI_BIN, g->proc.target, PY_ROOM_IDS);
    if (rc != 0) {
        fail_msg("python3 could not read the rooms JSON (exit %d):\n%s", rc, parsed);
    }
    for (size_t i = 0; i < 2; i++) {
        char want[64];
        snprintf(want, sizeof want, "str %s\n", ids[i]);
        assert_has(parsed, want);
        /* The id as read from the JSON names the room. */
        assert_int_equal(run(out, "-o json room %s", ids[i]), 0);
        assert_json_doc(out);
        snprintf(want, sizeof want, "{\"room\":{\"roomId\":\"%s\",\"generation\":\"%llu\"}", ids[i],
                 (unsigned long long)(i == 0 ? gen0 : gen1));
        assert_has(out, want);
    }
    /* The same document through python3: every room id round-trips. */
    rc = run_sh(parsed, sizeof parsed, true,
                "for id in $(%s --server %s -o json rooms --state active | /usr/bin/python3 -c "
                "'import json,sys; [print(r[\"room\"][\"roomId\"]) for r in "
                "json.load(sys.stdin)[\"rooms\"]]'); do %s --server %s room $id >/dev/null || "
                "echo \"room $id: exit $?\"; done",
                KVF_CLI_BIN, g->proc.target, KVF_CLI_BIN, g->proc.target);
    assert_int_equal(rc, 0);
    assert_string_equal(parsed, "");

    /* Enums by their proto names, bytes-free messages, defaults omitted. */
    assert_int_equal(run(out, "-o json room %s", ids[0]), 0);
    assert_has(out, "\"role\":\"ROLE_SOURCE\"");
    assert_has(out, "\"mode\":\"LEASE_MODE_READ\"");
    assert_has(out, "\"ranges\":[{\"first\":300,\"count\":4}]");
    assert_lacks(out, "\"token\"");       /* absent: the room is not aborting */
    assert_lacks(out, "\"abortReason\""); /* UNSPECIFIED: the default */
    assert_lacks(out, "\"completed\":false");
    assert_lacks(out, "room_id");
}

/* -o json is protobuf's own JSON: each reply, printed by the CLI, equals the
 * same reply printed by google.protobuf.json_format (cli_json_ref.py), both
 * parsed by python3's json module. */
static void test_json_matches_protobuf(void **state)
{
    (void)state;
    static const char *const calls[] = {
        "room 200", "room 9223372036854775806", "rooms", "node cli-n1", "nodes", "leases", "stats"};
    static char cmp[OUT_MAX];
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        int rc = run_sh(cmp, sizeof cmp, true,
                        "%s --server %s -o json %s | PYTHONPATH=%s /usr/bin/python3 %s %s %s",
                        KVF_CLI_BIN, g->proc.target, calls[i], KVF_PY_STUBS, KVF_CLI_JSON_REF,
                        g->proc.target, calls[i]);
        if (rc != 0) {
            fail_msg("kvfence -o json %s differs from protobuf's JSON (exit %d):\n%s", calls[i], rc,
                     cmp);
        }
    }
}

/* `kvfence node ID` and `kvfence nodes` show what the control plane knows of
 * a node: its pools, its capabilities, its sessions' last message. */
static void test_node_view(void **state)
{
    (void)state;
    char line[512], *w[16];
    assert_int_equal(run(out, "nodes"), 0);
    assert_true(find_line(out, "cli-n2 ", line, sizeof line));
    assert_true(split(line, w, 16) >= 9);
    assert_string_equal(w[5], "1"); /* POOLS: the fake node's one pool */
    assert_string_not_equal(w[8], "0ms");

    assert_int_equal(run(out, "-o json nodes"), 0);
    assert_json_doc(out);
    assert_has(out, "\"pools\":[{\"poolId\":1,\"pageSize\":4096,\"pageCount\":1024}]");
    assert_has(out, "\"features\":[\"QUIESCE_V1\"");

    assert_int_equal(run(out, "node cli-n2"), 0);
    assert_true(find_line(out, "node:", line, sizeof line));
    assert_has(line, "cli-n2");
    assert_true(find_line(out, "state:", line, sizeof line));
    assert_has(line, "ATTACHED");
    assert_true(find_line(out, "features:", line, sizeof line));
    assert_has(line, "QUIESCE_V1");
    assert_true(find_line(out, "POOL ", line, sizeof line));
    assert_has(line, "PAGE_SIZE");
    assert_true(find_line(out, "1 ", line, sizeof line));
    assert_true(split(line, w, 16) >= 3);
    assert_string_equal(w[1], "4096");
    assert_string_equal(w[2], "1024");
    assert_int_equal(run(out, "-o json node cli-n2"), 0);
    assert_json_doc(out);
    assert_has(out,
               "{\"nodeId\":\"cli-n2\",\"incarnation\":\"1\",\"state\":\"NODE_STATE_ATTACHED\"");
    assert_has(out, "\"poolId\":1");
    assert_int_equal(run2(out, "node no-such-node"), 4);
    assert_has(out, "kvfence: NOT_FOUND: ");
}

/* A room whose node nobody fenced does not say FENCED yes: here a single-node
 * room, still OPENING (one of its two participants joined). */
static void test_fenced_only_after_a_fence(void **state)
{
    (void)state;
    char line[512], *w[16];
    join(7001, "cli-n1", KVFENCE__V1__ROLE__ROLE_SOURCE, 400, 4);
    assert_int_equal(run(out, "room 7001"), 0);
    assert_true(find_line(out, "state:", line, sizeof line));
    assert_has(line, "OPENING");
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_int_equal(split(line, w, 16), 12);
    if (strcmp(w[10], "no") != 0) {
        fail_msg("FENCED for a room nobody fenced:\n%s", out);
    }
    assert_int_equal(run(out, "-o json room 7001"), 0);
    assert_lacks(out, "\"fenced\"");

    /* Where a fence happened it shows: cli-n2 carries out the fence of cli-n1
     * that test_fence asked for; room 200 (cli-n1 and cli-n2) says so, the
     * single-node room still does not. */
    assert_int_equal(fake_node_send_peer_fenced(g->n2, "cli-n1", 1), 0);
    bool fenced = false;
    for (int i = 0; i < 100 && !fenced; i++) {
        assert_int_equal(run(out, "room 200"), 0);
        assert_true(find_line(out, "cli-n1 ", line, sizeof line));
        assert_int_equal(split(line, w, 16), 12);
        fenced = strcmp(w[10], "yes") == 0;
        if (!fenced) {
            usleep(20000);
        }
    }
    if (!fenced) {
        fail_msg("cli-n1 fenced by cli-n2, but room 200 says:\n%s", out);
    }
    assert_int_equal(run(out, "-o json room 200"), 0);
    assert_has(out, "\"fenced\":true");
    assert_int_equal(run(out, "room 7001"), 0);
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_int_equal(split(line, w, 16), 12);
    assert_string_equal(w[10], "no");
    assert_int_equal(run(out, "-o wide node cli-n1"), 0);
    assert_true(find_line(out, "fenced by:", line, sizeof line));
    assert_has(line, "1 peers");
}

/* -o yaml (the JSON document as YAML), -o wide (more columns), --no-headers. */
static void test_output_forms(void **state)
{
    (void)state;
    char line[512], *w[32];
    assert_int_equal(run(out, "-o yaml room 200"), 0);
    assert_has(out, "room:\n  roomId: \"200\"\n  generation: \"");
    assert_has(out, "\nstate: ROOM_STATE_ABORTING\n");
    assert_has(out, "\nparticipants:\n- participant:\n    nodeId: cli-n1\n");
    assert_has(out, "    ranges:\n    - first: 100\n      count: 8\n");
    /* The same data as the JSON document: python3 reads the YAML back, if it
     * has a YAML module (python3-yaml); the string checks above hold anyway. */
    static char cmp[OUT_MAX];
    static const char *const docs[] = {"stats", "room 200", "nodes", "leases --room 200"};
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        int rc = run_sh(
            cmp, sizeof cmp, true,
            "/usr/bin/python3 -c 'import yaml' 2>/dev/null || exit 0; "
            "%s --server %s -o yaml %s > /tmp/kvf-cli-yaml.$$ && "
            "%s --server %s -o json %s | /usr/bin/python3 -c 'import json,sys,yaml; "
            "t=lambda d: {k: t(v) for k, v in d.items() if not k.endswith(\"Ms\") and "
            "not k.startswith(\"notice\")} if isinstance(d, dict) else [t(v) for v in d] if "
            "isinstance(d, list) else d; "
            "j=t(json.load(sys.stdin)); y=t(yaml.safe_load(open(\"/tmp/kvf-cli-yaml.'$$'\"))); "
            "sys.exit(0 if j==y else \"differ: %%r %%r\" %% (j, y))'; rc=$?; "
            "rm -f /tmp/kvf-cli-yaml.$$; exit $rc",
            KVF_CLI_BIN, g->proc.target, docs[i], KVF_CLI_BIN, g->proc.target, docs[i]);
        if (rc != 0) {
            fail_msg("YAML and JSON of %s differ:\n%s", docs[i], cmp);
        }
    }

    assert_int_equal(run(out, "rooms --no-headers --state aborting"), 0);
    assert_lacks(out, "GENERATION");
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_int_equal(run(out, "-o wide rooms --state aborting"), 0);
    assert_true(find_line(out, "ROOM ", line, sizeof line));
    assert_has(line, "SOURCES");
    assert_has(line, "SINKS");
    assert_has(line, "PROTO");
    assert_true(find_line(out, "200 ", line, sizeof line));
    assert_int_equal(split(line, w, 32), 12);
    assert_int_equal(run(out, "-o wide nodes --no-headers"), 0);
    assert_lacks(out, "INCARNATION");
    assert_true(find_line(out, "cli-n1 ", line, sizeof line));
    assert_has(line, "QUIESCE_V1");
    assert_int_equal(run(out, "-o wide leases --room 200"), 0);
    assert_true(find_line(out, "LEASE ", line, sizeof line));
    assert_has(line, "HOST_PROOF");
    assert_int_equal(run2(out, "-o xml nodes"), 2);
    assert_has(out, "table, wide, json or yaml");
}

/* kvfence health: the gRPC health service; exit 0 when SERVING. */
static void test_health(void **state)
{
    (void)state;
    assert_int_equal(run(out, "health"), 0);
    assert_string_equal(out, "SERVING\n");
    assert_int_equal(run(out, "health --service kvfence.v1.Admin -o json"), 0);
    assert_string_equal(out, "{\"status\":\"SERVING\"}\n");
    assert_int_equal(run2(out, "health --service no.such.Service"), 4);
    assert_int_equal(run_raw(out, "--server 127.0.0.1:1 health"), 3);
}

/* kvfence help [COMMAND], a command's help on a usage error, completion. */
static void test_help_and_completion(void **state)
{
    (void)state;
    assert_int_equal(run_raw(out, "help"), 0);
    assert_has(out, "Usage: kvfence");
    assert_has(out, "completion");
    assert_int_equal(run_raw(out, "help rooms"), 0);
    assert_has(out, "Usage: kvfence rooms");
    assert_int_equal(run_raw(out, "help bogus"), 2);
    /* A usage error prints the command's own help on stderr, nothing on stdout. */
    assert_int_equal(run_sh(out, OUT_MAX, false, "%s rooms --bogus 2>/dev/null", KVF_CLI_BIN), 2);
    assert_string_equal(out, "");
    assert_int_equal(run_raw(out, "rooms --bogus"), 2);
    assert_has(out, "unknown flag '--bogus'");
    assert_has(out, "Usage: kvfence rooms");
    assert_int_equal(run_raw(out, "room"), 2);
    assert_has(out, "Usage: kvfence room ID");

    static char script[OUT_MAX];
    assert_int_equal(run_raw(script, "completion bash"), 0);
    assert_has(script, "complete -F");
    assert_has(script, "rooms");
    assert_has(script, "--no-headers");
    int rc = run_sh(out, OUT_MAX, true, "%s completion bash | bash -n", KVF_CLI_BIN);
    if (rc != 0) {
        fail_msg("bash -n refuses the completion script:\n%s", out);
    }
    /* The script completes: COMP_WORDS "kvfence ro" offers room and rooms. */
    rc = run_sh(out, OUT_MAX, true,
                "bash -c 'source <(%s completion bash); COMP_WORDS=(kvfence ro); COMP_CWORD=1; "
                "_kvfence; echo \"${COMPREPLY[@]}\"'",
                KVF_CLI_BIN);
    assert_int_equal(rc, 0);
    assert_string_equal(out, "room rooms\n");
    assert_int_equal(run_raw(out, "completion zsh"), 0);
    assert_has(out, "#compdef kvfence");
    assert_int_equal(run_raw(out, "completion fish"), 2);
}

/* kvfence node lists the leases that wait for a proof from the node's own
 * host: cli-h1 restarts (incarnation 2) while its incarnation 1 holds a lease
 * in room 7100; cli-n2 fences it and drains, the room ends ABORTED, and
 * cli-h1@1's own lease stays RELEASING until its host proves it stopped. */
static void test_node_waiting_leases(void **state)
{
    (void)state;
    char line[512];
    struct fake_node *h1 = fake_node_attach(g->ch, "cli-h1", 1);
    assert_non_null(h1);
    uint64_t gen = join(7100, "cli-h1", KVFENCE__V1__ROLE__ROLE_SOURCE, 0, 4);
    assert_int_equal(join(7100, "cli-n2", KVFENCE__V1__ROLE__ROLE_SINK, 500, 4), gen);
    struct fake_node *h2 = fake_node_attach(g->ch, "cli-h1", 2); /* incarnation 1 is LOST */
    assert_non_null(h2);
    assert_int_equal(run(out, "-o json room 7100"), 0);
    assert_has(out, "\"state\":\"ROOM_STATE_ABORTING\"");
    Kvfence__V1__AbortToken token = KVFENCE__V1__ABORT_TOKEN__INIT;
    parse_token_json(out, &token);
    assert_int_equal(fake_node_send_peer_fenced(g->n2, "cli-h1", 1), 0);
    assert_int_equal(fake_node_send_drained(g->n2, 7100, gen, &token), 0);
    bool waiting = false;
    for (int i = 0; i < 100 && !waiting; i++) {
        assert_int_equal(run(out, "node cli-h1"), 0);
        waiting = find_line(out, "leases waiting for a proof from its host: 1", line, sizeof line);
        if (!waiting) {
            usleep(20000);
        }
    }
    if (!waiting) {
        fail_msg("no lease of cli-h1 waits for its host:\n%s", out);
    }
    assert_true(find_line(out, "incarnation:", line, sizeof line));
    assert_has(line, "2");
    assert_true(find_line(out, "LEASE ", line, sizeof line));
    assert_has(line, "GENERATION");
    char want[64];
    snprintf(want, sizeof want, "7100  %llu", (unsigned long long)gen);
    assert_has(out, want);
    assert_int_equal(run(out, "-o wide leases --room 7100 --node cli-h1"), 0);
    assert_true(find_line(out, "LEASE ", line, sizeof line));
    assert_has(out, " RELEASING ");
    assert_has(out, " waiting\n");
    fake_node_vanish(h1);
    fake_node_vanish(h2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_and_version),
        cmocka_unit_test(test_usage_errors),
        cmocka_unit_test(test_nodes),
        cmocka_unit_test(test_rooms),
        cmocka_unit_test(test_room),
        cmocka_unit_test(test_leases),
        cmocka_unit_test(test_stats),
        cmocka_unit_test(test_abort_idempotent),
        cmocka_unit_test(test_not_found),
        cmocka_unit_test(test_fence),
        cmocka_unit_test(test_watch),
        cmocka_unit_test(test_env_and_unreachable),
        cmocka_unit_test(test_tls),
        cmocka_unit_test(test_json_big_ids),
        cmocka_unit_test(test_json_matches_protobuf),
        cmocka_unit_test(test_node_view),
        cmocka_unit_test(test_fenced_only_after_a_fence),
        cmocka_unit_test(test_output_forms),
        cmocka_unit_test(test_health),
        cmocka_unit_test(test_help_and_completion),
        cmocka_unit_test(test_node_waiting_leases),
        cmocka_unit_test(test_paging), /* last: its nodes vanish, 130 rooms abort */
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
