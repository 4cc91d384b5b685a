/*
 * kvfence.c: the kvfence admin CLI (docs/cli.md). One subcommand per run; it
 * calls kvfence-control's Admin service (and Control/WatchLeases for watch)
 * over gRPC, plaintext or TLS, and prints a table or one JSON document.
 *
 * Exit codes: 0 ok, 1 the server answered with an error, 2 usage error (also
 * unreadable TLS files), 3 the server cannot be reached (UNAVAILABLE,
 * DEADLINE_EXCEEDED), 4 not found (NOT_FOUND).
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "kvf_error.h"
#include "kvf_version.h"
#include "kvfence/v1/control.pb-c.h"
#include "output.h"
#include "rpc_client.h"

enum {
    EXIT_OK = 0,
    EXIT_SERVER = 1,
    EXIT_USAGE = 2,
    EXIT_UNREACHABLE = 3,
    EXIT_NOT_FOUND = 4,
};

#define DEFAULT_SERVER     "127.0.0.1:7070"
#define DEFAULT_TIMEOUT_MS 5000
#define MAX_STATES         8

/* ---- options ------------------------------------------------------------- */

enum opt_id {
    O_SERVER = 1,
    O_TLS_CA,
    O_TLS_CERT,
    O_TLS_KEY,
    O_TLS_NAME,
    O_TIMEOUT,
    O_OUTPUT,
    O_HELP,
    O_VERSION,
    O_STATE,
    O_NODE,
    O_MIN_AGE,
    O_GENERATION,
    O_ROOM,
    O_REASON,
    O_ROOM_STATES,
    O_COUNT,
};

struct opt {
    const char *name; /* long name without "--" */
    char shortc;      /* 0: none */
    bool has_arg;
    enum opt_id id;
};

static const struct opt global_opts[] = {
    {"server", 0, true, O_SERVER},
    {"tls-ca", 0, true, O_TLS_CA},
    {"tls-cert", 0, true, O_TLS_CERT},
    {"tls-key", 0, true, O_TLS_KEY},
    {"tls-server-name", 0, true, O_TLS_NAME},
    {"timeout", 0, true, O_TIMEOUT},
    {"output", 'o', true, O_OUTPUT},
    {"help", 'h', false, O_HELP},
    {"version", 0, false, O_VERSION},
    {NULL, 0, false, 0},
};

struct command;

struct cli {
    const char *server;
    const char *tls_ca;
    const char *tls_cert;
    const char *tls_key;
    const char *tls_name;
    int64_t timeout_ms;
    bool json;
    const struct command *cmd;
    const char *args[4]; /* positional arguments after the command */
    size_t nargs;
    /* command options */
    int states[MAX_STATES];
    size_t nstates;
    const char *node;
    uint64_t min_age_ms;
    uint64_t generation;
    uint64_t room_id;
    const char *reason;
    bool room_states;
    uint64_t count; /* 0: unlimited */
    struct kvf_rpc_channel *ch;
};

struct command {
    const char *name;
    size_t min_args, max_args;
    const struct opt *opts;
    const char *help;
    int (*run)(struct cli *c);
};

static const char *progname = "kvfence";

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", progname);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '%s --help'.\n", progname);
    return EXIT_USAGE;
}

static bool parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+') {
        return false;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max) {
        return false;
    }
    *out = v;
    return true;
}

/* ---- enums --------------------------------------------------------------- */

/* The enum value's proto name without `prefix` ("ACTIVE" for
 * ROOM_STATE_ACTIVE), or its number when unknown. */
static const char *enum_name(const ProtobufCEnumDescriptor *d, const char *prefix, int v, char *buf,
                             size_t len)
{
    const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(d, v);
    if (!ev) {
        snprintf(buf, len, "%d", v);
        return buf;
    }
    size_t pl = strlen(prefix);
    const char *n = ev->name;
    if (strncmp(n, prefix, pl) == 0) {
        n += pl;
    }
    snprintf(buf, len, "%s", n);
    return buf;
}

/* Parses a state name, short ("aborting") or full ("ROOM_STATE_ABORTING"),
 * any case; UNSPECIFIED is refused. Returns the value or -1. */
static int enum_parse(const ProtobufCEnumDescriptor *d, const char *prefix, const char *s)
{
    size_t pl = strlen(prefix);
    for (unsigned i = 0; i < d->n_values; i++) {
        const char *n = d->values[i].name;
        const char *shortn = strncmp(n, prefix, pl) == 0 ? n + pl : n;
        if (strcmp(shortn, "UNSPECIFIED") == 0) {
            continue;
        }
        if (strcasecmp(s, n) == 0 || strcasecmp(s, shortn) == 0) {
            return d->values[i].value;
        }
    }
    return -1;
}

#define ROOM_STATE_NAME(v, b) \
    enum_name(&kvfence__v1__room_state__descriptor, "ROOM_STATE_", (v), (b), sizeof(b))
#define NODE_STATE_NAME(v, b) \
    enum_name(&kvfence__v1__node_state__descriptor, "NODE_STATE_", (v), (b), sizeof(b))
#define LEASE_STATE_NAME(v, b) \
    enum_name(&kvfence__v1__lease_state__descriptor, "LEASE_STATE_", (v), (b), sizeof(b))
#define LEASE_MODE_NAME(v, b) \
    enum_name(&kvfence__v1__lease_mode__descriptor, "LEASE_MODE_", (v), (b), sizeof(b))
#define ROLE_NAME(v, b) enum_name(&kvfence__v1__role__descriptor, "ROLE_", (v), (b), sizeof(b))
#define REASON_NAME(v, b) \
    enum_name(&kvfence__v1__abort_reason__descriptor, "ABORT_REASON_", (v), (b), sizeof(b))
#define ENDPOINT_KIND_NAME(v, b) \
    enum_name(&kvfence__v1__endpoint_kind__descriptor, "ENDPOINT_KIND_", (v), (b), sizeof(b))
#define POOL_KIND_NAME(v, b) \
    enum_name(&kvfence__v1__pool_kind__descriptor, "POOL_KIND_", (v), (b), sizeof(b))

/* ---- RPC ----------------------------------------------------------------- */

static int exit_for_code(int code)
{
    switch (code) {
    case KVF_GRPC_OK:
        return EXIT_OK;
    case KVF_GRPC_NOT_FOUND:
        return EXIT_NOT_FOUND;
    case KVF_GRPC_UNAVAILABLE:
    case KVF_GRPC_DEADLINE_EXCEEDED:
        return EXIT_UNREACHABLE;
    default:
        return EXIT_SERVER;
    }
}

static int report_status(const struct kvf_rpc_status *st)
{
    fprintf(stderr, "%s: %s: %s\n", progname, kvf_grpc_code_name(st->code),
            st->message[0] ? st->message : "(no message)");
    return exit_for_code(st->code);
}

static int connect_server(struct cli *c)
{
    struct kvf_rpc_channel_opts o;
    kvf_rpc_channel_opts_init(&o);
    o.tls_root_ca_path = c->tls_ca;
    o.tls_cert_path = c->tls_cert;
    o.tls_key_path = c->tls_key;
    o.tls_target_name = c->tls_name;
    c->ch = kvf_rpc_channel_create(c->server, &o);
    if (!c->ch) {
        fprintf(stderr, "%s: cannot set up a channel to %s (see the message above)\n", progname,
                c->server);
        return EXIT_USAGE;
    }
    return EXIT_OK;
}

/* Calls `method` of the Admin service; returns an exit code, *resp_p on 0. */
static int call(struct cli *c, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        fprintf(stderr, "%s: out of memory\n", progname);
        return EXIT_SERVER;
    }
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st = {0};
    char full[128];
    snprintf(full, sizeof full, "/kvfence.v1.Admin/%s", method);
    int rc = kvf_rpc_unary(c->ch, full, buf, len, c->timeout_ms, &resp, &resp_len, &st);
    free(buf);
    if (rc != 0) {
        free(resp);
        if (st.code == KVF_GRPC_OK) {
            st.code = KVF_GRPC_INTERNAL;
            snprintf(st.message, sizeof st.message, "call failed (%s)", strerror(-rc));
        }
        return report_status(&st);
    }
    *resp_p = protobuf_c_message_unpack(rd, NULL, resp_len, resp);
    free(resp);
    if (!*resp_p) {
        fprintf(stderr, "%s: %s: undecodable reply\n", progname, method);
        return EXIT_SERVER;
    }
    return EXIT_OK;
}

/* Appends a reply page; frees it and returns -1 when out of memory. */
static int push_page(ProtobufCMessage ***pages, size_t *n, ProtobufCMessage *m)
{
    ProtobufCMessage **p = realloc(*pages, (*n + 1) * sizeof *p);
    if (!p) {
        protobuf_c_message_free_unpacked(m, NULL);
        fprintf(stderr, "%s: out of memory\n", progname);
        return -1;
    }
    p[(*n)++] = m;
    *pages = p;
    return 0;
}

/* The reply pages of a paged List* call, in order. */
struct pages {
    ProtobufCMessage **v;
    size_t n;
};

static void pages_free(struct pages *pg)
{
    for (size_t i = 0; i < pg->n; i++) {
        protobuf_c_message_free_unpacked(pg->v[i], NULL);
    }
    free(pg->v);
}

/*
 * Calls a paged Admin method until the reply's next_page_token is empty.
 * page_token is the request's page_token field; next_off is the offset of the
 * reply's next_page_token. The caller frees *pg, also on error.
 */
static int call_paged(struct cli *c, const char *method, const ProtobufCMessage *req,
                      char **page_token, const ProtobufCMessageDescriptor *rd, size_t next_off,
                      struct pages *pg)
{
    *page_token = "";
    for (;;) {
        ProtobufCMessage *m = NULL;
        int rc = call(c, method, req, rd, &m);
        if (rc != EXIT_OK) {
            return rc;
        }
        if (push_page(&pg->v, &pg->n, m) != 0) {
            return EXIT_SERVER;
        }
        /* Points into the page just kept, which lives until pages_free. */
        char *next = *(char **)((char *)m + next_off);
        if (!next || !*next) {
            return EXIT_OK;
        }
        *page_token = next;
    }
}

/* ---- shared printing ----------------------------------------------------- */

static const char *fmt_token(const Kvfence__V1__AbortToken *t, char *buf, size_t len)
{
    if (!t) {
        return NULL;
    }
    snprintf(buf, len, "%016" PRIx64 "%016" PRIx64, t->hi, t->lo);
    return buf;
}

static uint64_t lease_pages(const Kvfence__V1__Lease *l)
{
    uint64_t n = 0;
    for (size_t i = 0; l && i < l->n_ranges; i++) {
        n += l->ranges[i]->count;
    }
    return n;
}

static void json_room_key(struct cli_json *j, const char *key, const Kvfence__V1__RoomKey *k)
{
    if (!k) {
        cli_json_null(j, key);
        return;
    }
    cli_json_obj_begin(j, key);
    cli_json_u64(j, "room_id", k->room_id);
    cli_json_u64(j, "generation", k->generation);
    cli_json_obj_end(j);
}

static void json_participant(struct cli_json *j, const char *key, const Kvfence__V1__Participant *p)
{
    char b[64];
    if (!p) {
        cli_json_null(j, key);
        return;
    }
    cli_json_obj_begin(j, key);
    cli_json_str(j, "node_id", p->node_id);
    cli_json_u64(j, "rank", p->rank);
    cli_json_str(j, "role", ROLE_NAME(p->role, b));
    cli_json_obj_end(j);
}

static void json_lease(struct cli_json *j, const char *key, const Kvfence__V1__Lease *l)
{
    char b[64];
    if (!l) {
        cli_json_null(j, key);
        return;
    }
    cli_json_obj_begin(j, key);
    cli_json_u64(j, "lease_id", l->lease_id);
    json_room_key(j, "room", l->room);
    json_participant(j, "participant", l->participant);
    cli_json_u64(j, "pool_id", l->pool_id);
    cli_json_arr_begin(j, "ranges");
    for (size_t i = 0; i < l->n_ranges; i++) {
        cli_json_obj_begin(j, NULL);
        cli_json_u64(j, "first", l->ranges[i]->first);
        cli_json_u64(j, "count", l->ranges[i]->count);
        cli_json_obj_end(j);
    }
    cli_json_arr_end(j);
    cli_json_str(j, "mode", LEASE_MODE_NAME(l->mode, b));
    cli_json_str(j, "state", LEASE_STATE_NAME(l->state, b));
    if (l->awaiting_host_proof) /* only then: its node was lost, no timer ends the wait */
        cli_json_bool(j, "awaiting_host_proof", true);
    cli_json_obj_end(j);
}

/* A lease's state for a table: a RELEASING lease that waits for a proof from its
 * lost node's host says so (deploy/README.md, runbook 4). */
static const char *lease_state_cell(const Kvfence__V1__Lease *l, char *b, size_t size)
{
    char nb[64];
    const char *name = LEASE_STATE_NAME(l ? l->state : 0, nb);
    snprintf(b, size, "%s%s", name, l && l->awaiting_host_proof ? " (waits for host proof)" : "");
    return b;
}

/* "0+16,64+8": the ranges as first+count. */
static void fmt_ranges(const Kvfence__V1__Lease *l, char *buf, size_t len)
{
    size_t off = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < l->n_ranges && off < len; i++) {
        int n = snprintf(buf + off, len - off, "%s%u+%u", i ? "," : "", l->ranges[i]->first,
                         l->ranges[i]->count);
        if (n < 0 || (size_t)n >= len - off) {
            if (len > 4) {
                strcpy(buf + len - 4, "...");
            }
            return;
        }
        off += (size_t)n;
    }
    if (l->n_ranges == 0) {
        snprintf(buf, len, "-");
    }
}

static int finish_table(struct cli_table *t)
{
    int rc = cli_table_print(t, stdout);
    cli_table_free(t);
    if (rc != 0) {
        fprintf(stderr, "%s: out of memory\n", progname);
        return EXIT_SERVER;
    }
    return EXIT_OK;
}

/* ---- nodes --------------------------------------------------------------- */

static int cmd_nodes(struct cli *c)
{
    Kvfence__V1__ListNodesRequest rq = KVFENCE__V1__LIST_NODES_REQUEST__INIT;
    struct pages pg = {0};
    int rc = call_paged(c, "ListNodes", &rq.base, &rq.page_token,
                        &kvfence__v1__list_nodes_response__descriptor,
                        offsetof(Kvfence__V1__ListNodesResponse, next_page_token), &pg);
    if (rc != EXIT_OK) {
        goto out;
    }
    char b[64], b2[64];
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        cli_json_arr_begin(&j, "nodes");
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListNodesResponse *r = (Kvfence__V1__ListNodesResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_nodes; i++) {
                Kvfence__V1__NodeInfo *n = r->nodes[i];
                cli_json_obj_begin(&j, NULL);
                cli_json_str(&j, "node_id", n->node_id);
                cli_json_u64(&j, "incarnation", n->incarnation);
                cli_json_str(&j, "state", NODE_STATE_NAME(n->state, b));
                cli_json_u64(&j, "protocol_version", n->protocol_version);
                if (n->capabilities) {
                    cli_json_obj_begin(&j, "capabilities");
                    cli_json_u64(&j, "protocol_min", n->capabilities->protocol_min);
                    cli_json_u64(&j, "protocol_max", n->capabilities->protocol_max);
                    cli_json_arr_begin(&j, "features");
                    for (size_t k = 0; k < n->capabilities->n_features; k++) {
                        cli_json_str(&j, NULL, n->capabilities->features[k]);
                    }
                    cli_json_arr_end(&j);
                    cli_json_obj_end(&j);
                } else {
                    cli_json_null(&j, "capabilities");
                }
                cli_json_arr_begin(&j, "endpoints");
                for (size_t k = 0; k < n->n_endpoints; k++) {
                    cli_json_obj_begin(&j, NULL);
                    cli_json_str(&j, "kind", ENDPOINT_KIND_NAME(n->endpoints[k]->kind, b));
                    cli_json_str(&j, "address", n->endpoints[k]->address);
                    cli_json_obj_end(&j);
                }
                cli_json_arr_end(&j);
                cli_json_arr_begin(&j, "pools");
                for (size_t k = 0; k < n->n_pools; k++) {
                    const Kvfence__V1__Pool *pl = n->pools[k];
                    cli_json_obj_begin(&j, NULL);
                    cli_json_u64(&j, "pool_id", pl->pool_id);
                    cli_json_str(&j, "kind", POOL_KIND_NAME(pl->kind, b));
                    cli_json_u64(&j, "page_size", pl->page_size);
                    cli_json_u64(&j, "page_count", pl->page_count);
                    cli_json_u64(&j, "owner_rank", pl->owner_rank);
                    cli_json_u64(&j, "base_addr", pl->base_addr);
                    cli_json_u64(&j, "rkey", pl->rkey);
                    cli_json_u64(&j, "cuda_device", pl->cuda_device);
                    cli_json_obj_end(&j);
                }
                cli_json_arr_end(&j);
                cli_json_u64(&j, "room_count", n->room_count);
                cli_json_u64(&j, "state_age_ms", n->state_age_ms);
                cli_json_u64(&j, "last_seen_ms", n->last_seen_ms);
                cli_json_u64(&j, "notices_pending", n->notices_pending);
                cli_json_obj_end(&j);
            }
        }
        cli_json_arr_end(&j);
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"NODE",  "INCARNATION", "STATE",     "PROTO",    "ROOMS",
                                        "POOLS", "NOTICES",     "STATE_AGE", "LAST_SEEN"};
        struct cli_table t;
        cli_table_init(&t, 9, h);
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListNodesResponse *r = (Kvfence__V1__ListNodesResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_nodes; i++) {
                Kvfence__V1__NodeInfo *n = r->nodes[i];
                cli_table_cell(&t, "%s", n->node_id);
                cli_table_cell(&t, "%" PRIu64, n->incarnation);
                cli_table_cell(&t, "%s", NODE_STATE_NAME(n->state, b));
                cli_table_cell(&t, "%u", n->protocol_version);
                cli_table_cell(&t, "%u", n->room_count);
                cli_table_cell(&t, "%zu", n->n_pools);
                cli_table_cell(&t, "%u", n->notices_pending);
                cli_table_cell(&t, "%s", cli_fmt_duration(n->state_age_ms, b, sizeof b));
                cli_table_cell(&t, "%s", cli_fmt_duration(n->last_seen_ms, b2, sizeof b2));
            }
        }
        rc = finish_table(&t);
    }
out:
    pages_free(&pg);
    return rc;
}

/* ---- rooms --------------------------------------------------------------- */

/* The members of a RoomInfo except the participants. */
static void json_room_fields(struct cli_json *j, const Kvfence__V1__RoomInfo *r)
{
    char b[64];
    json_room_key(j, "room", r->room);
    cli_json_str(j, "state", ROOM_STATE_NAME(r->state, b));
    cli_json_str(j, "abort_reason", REASON_NAME(r->abort_reason, b));
    cli_json_str(j, "token", fmt_token(r->token, b, sizeof b));
    cli_json_u64(j, "expected_sources", r->expected_sources);
    cli_json_u64(j, "expected_sinks", r->expected_sinks);
    cli_json_u64(j, "protocol_version", r->protocol_version);
    cli_json_u64(j, "age_ms", r->age_ms);
    cli_json_u64(j, "state_age_ms", r->state_age_ms);
    cli_json_bool(j, "past_drain_deadline", r->past_drain_deadline);
    cli_json_u64(j, "participant_count", r->participant_count);
}

static int cmd_rooms(struct cli *c)
{
    Kvfence__V1__ListRoomsRequest rq = KVFENCE__V1__LIST_ROOMS_REQUEST__INIT;
    rq.n_states = c->nstates;
    rq.states = (Kvfence__V1__RoomState *)c->states;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.min_age_ms = c->min_age_ms;
    struct pages pg = {0};
    int rc = call_paged(c, "ListRooms", &rq.base, &rq.page_token,
                        &kvfence__v1__list_rooms_response__descriptor,
                        offsetof(Kvfence__V1__ListRoomsResponse, next_page_token), &pg);
    if (rc != EXIT_OK) {
        goto out;
    }
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        cli_json_arr_begin(&j, "rooms");
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListRoomsResponse *r = (Kvfence__V1__ListRoomsResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_rooms; i++) {
                cli_json_obj_begin(&j, NULL);
                json_room_fields(&j, r->rooms[i]);
                cli_json_obj_end(&j);
            }
        }
        cli_json_arr_end(&j);
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"ROOM",         "GENERATION",    "STATE",
                                        "PARTICIPANTS", "AGE",           "STATE_AGE",
                                        "REASON",       "PAST_DEADLINE", "TOKEN"};
        struct cli_table t;
        cli_table_init(&t, 9, h);
        char b[64];
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListRoomsResponse *r = (Kvfence__V1__ListRoomsResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_rooms; i++) {
                const Kvfence__V1__RoomInfo *ri = r->rooms[i];
                cli_table_cell(&t, "%" PRIu64, ri->room ? ri->room->room_id : 0);
                cli_table_cell(&t, "%" PRIu64, ri->room ? ri->room->generation : 0);
                cli_table_cell(&t, "%s", ROOM_STATE_NAME(ri->state, b));
                cli_table_cell(&t, "%u/%u", ri->participant_count,
                               ri->expected_sources + ri->expected_sinks);
                cli_table_cell(&t, "%s", cli_fmt_duration(ri->age_ms, b, sizeof b));
                cli_table_cell(&t, "%s", cli_fmt_duration(ri->state_age_ms, b, sizeof b));
                cli_table_cell(&t, "%s", ri->abort_reason ? REASON_NAME(ri->abort_reason, b) : "-");
                cli_table_cell(&t, "%s", ri->past_drain_deadline ? "yes" : "no");
                cli_table_cell(&t, "%s", ri->token ? fmt_token(ri->token, b, sizeof b) : "-");
            }
        }
        rc = finish_table(&t);
    }
out:
    pages_free(&pg);
    return rc;
}

/* ---- room ---------------------------------------------------------------- */

static int cmd_room(struct cli *c)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = c->room_id;
    key.generation = c->generation;
    Kvfence__V1__GetRoomRequest rq = KVFENCE__V1__GET_ROOM_REQUEST__INIT;
    rq.room = &key;
    ProtobufCMessage *m = NULL;
    int rc = call(c, "GetRoom", &rq.base, &kvfence__v1__room_info__descriptor, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    const Kvfence__V1__RoomInfo *r = (const Kvfence__V1__RoomInfo *)m;
    char b[64];
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        json_room_fields(&j, r);
        cli_json_arr_begin(&j, "participants");
        for (size_t i = 0; i < r->n_participants; i++) {
            const Kvfence__V1__ParticipantInfo *p = r->participants[i];
            cli_json_obj_begin(&j, NULL);
            json_participant(&j, "participant", p->participant);
            cli_json_u64(&j, "node_incarnation", p->node_incarnation);
            json_lease(&j, "lease", p->lease);
            cli_json_bool(&j, "completed", p->completed);
            cli_json_bool(&j, "drained", p->drained);
            cli_json_bool(&j, "fenced", p->fenced);
            cli_json_u64(&j, "notice_attempts", p->notice_attempts);
            cli_json_obj_end(&j);
        }
        cli_json_arr_end(&j);
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        struct cli_table kv;
        cli_table_init(&kv, 2, NULL);
        cli_table_cell(&kv, "room:");
        cli_table_cell(&kv, "%" PRIu64, r->room ? r->room->room_id : 0);
        cli_table_cell(&kv, "generation:");
        cli_table_cell(&kv, "%" PRIu64, r->room ? r->room->generation : 0);
        cli_table_cell(&kv, "state:");
        cli_table_cell(&kv, "%s", ROOM_STATE_NAME(r->state, b));
        cli_table_cell(&kv, "abort reason:");
        cli_table_cell(&kv, "%s", r->abort_reason ? REASON_NAME(r->abort_reason, b) : "-");
        cli_table_cell(&kv, "token:");
        cli_table_cell(&kv, "%s", r->token ? fmt_token(r->token, b, sizeof b) : "-");
        cli_table_cell(&kv, "participants:");
        cli_table_cell(&kv, "%u of %u (%u sources, %u sinks)", r->participant_count,
                       r->expected_sources + r->expected_sinks, r->expected_sources,
                       r->expected_sinks);
        cli_table_cell(&kv, "protocol version:");
        cli_table_cell(&kv, "%u", r->protocol_version);
        cli_table_cell(&kv, "age:");
        cli_table_cell(&kv, "%s", cli_fmt_duration(r->age_ms, b, sizeof b));
        cli_table_cell(&kv, "state age:");
        cli_table_cell(&kv, "%s", cli_fmt_duration(r->state_age_ms, b, sizeof b));
        cli_table_cell(&kv, "past drain deadline:");
        cli_table_cell(&kv, "%s", r->past_drain_deadline ? "yes" : "no");
        rc = finish_table(&kv);
        if (rc == EXIT_OK) {
            static const char *const h[] = {"NODE",      "INCARNATION", "RANK",   "ROLE",
                                            "LEASE",     "LEASE_STATE", "POOL",   "PAGES",
                                            "COMPLETED", "DRAINED",     "FENCED", "NOTICES"};
            struct cli_table t;
            cli_table_init(&t, 12, h);
            for (size_t i = 0; i < r->n_participants; i++) {
                const Kvfence__V1__ParticipantInfo *p = r->participants[i];
                const Kvfence__V1__Participant *pp = p->participant;
                cli_table_cell(&t, "%s", pp ? pp->node_id : "-");
                cli_table_cell(&t, "%" PRIu64, p->node_incarnation);
                cli_table_cell(&t, "%u", pp ? pp->rank : 0);
                cli_table_cell(&t, "%s", ROLE_NAME(pp ? pp->role : 0, b));
                cli_table_cell(&t, "%" PRIu64, p->lease ? p->lease->lease_id : 0);
                char sb[96];
                cli_table_cell(&t, "%s", lease_state_cell(p->lease, sb, sizeof sb));
                cli_table_cell(&t, "%u", p->lease ? p->lease->pool_id : 0);
                cli_table_cell(&t, "%" PRIu64, lease_pages(p->lease));
                cli_table_cell(&t, "%s", p->completed ? "yes" : "no");
                cli_table_cell(&t, "%s", p->drained ? "yes" : "no");
                cli_table_cell(&t, "%s", p->fenced ? "yes" : "no");
                cli_table_cell(&t, "%u", p->notice_attempts);
            }
            printf("\n");
            rc = finish_table(&t);
        }
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- leases -------------------------------------------------------------- */

static int cmd_leases(struct cli *c)
{
    Kvfence__V1__ListLeasesRequest rq = KVFENCE__V1__LIST_LEASES_REQUEST__INIT;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.n_states = c->nstates;
    rq.states = (Kvfence__V1__LeaseState *)c->states;
    rq.room_id = c->room_id;
    struct pages pg = {0};
    int rc = call_paged(c, "ListLeases", &rq.base, &rq.page_token,
                        &kvfence__v1__list_leases_response__descriptor,
                        offsetof(Kvfence__V1__ListLeasesResponse, next_page_token), &pg);
    if (rc != EXIT_OK) {
        goto out;
    }
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        cli_json_arr_begin(&j, "leases");
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListLeasesResponse *r = (Kvfence__V1__ListLeasesResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_leases; i++) {
                json_lease(&j, NULL, r->leases[i]);
            }
        }
        cli_json_arr_end(&j);
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"LEASE", "ROOM", "GENERATION", "NODE",  "RANK",  "ROLE",
                                        "POOL",  "MODE", "STATE",      "PAGES", "RANGES"};
        struct cli_table t;
        cli_table_init(&t, 11, h);
        char b[64], rb[96];
        for (size_t p = 0; p < pg.n; p++) {
            Kvfence__V1__ListLeasesResponse *r = (Kvfence__V1__ListLeasesResponse *)pg.v[p];
            for (size_t i = 0; i < r->n_leases; i++) {
                const Kvfence__V1__Lease *l = r->leases[i];
                cli_table_cell(&t, "%" PRIu64, l->lease_id);
                cli_table_cell(&t, "%" PRIu64, l->room ? l->room->room_id : 0);
                cli_table_cell(&t, "%" PRIu64, l->room ? l->room->generation : 0);
                cli_table_cell(&t, "%s", l->participant ? l->participant->node_id : "-");
                cli_table_cell(&t, "%u", l->participant ? l->participant->rank : 0);
                cli_table_cell(&t, "%s", ROLE_NAME(l->participant ? l->participant->role : 0, b));
                cli_table_cell(&t, "%u", l->pool_id);
                cli_table_cell(&t, "%s", LEASE_MODE_NAME(l->mode, b));
                char sb[96];
                cli_table_cell(&t, "%s", lease_state_cell(l, sb, sizeof sb));
                cli_table_cell(&t, "%" PRIu64, lease_pages(l));
                fmt_ranges(l, rb, sizeof rb);
                cli_table_cell(&t, "%s", rb);
            }
        }
        rc = finish_table(&t);
    }
out:
    pages_free(&pg);
    return rc;
}

/* ---- stats --------------------------------------------------------------- */

static int cmd_stats(struct cli *c)
{
    Kvfence__V1__GetStatsRequest rq = KVFENCE__V1__GET_STATS_REQUEST__INIT;
    ProtobufCMessage *m = NULL;
    int rc = call(c, "GetStats", &rq.base, &kvfence__v1__stats__descriptor, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    const Kvfence__V1__Stats *s = (const Kvfence__V1__Stats *)m;
    static const Kvfence__V1__RoomCounts no_rooms = KVFENCE__V1__ROOM_COUNTS__INIT;
    static const Kvfence__V1__LeaseCounts no_leases = KVFENCE__V1__LEASE_COUNTS__INIT;
    static const Kvfence__V1__NodeCounts no_nodes = KVFENCE__V1__NODE_COUNTS__INIT;
    const Kvfence__V1__RoomCounts *r = s->rooms ? s->rooms : &no_rooms;
    const Kvfence__V1__LeaseCounts *l = s->leases ? s->leases : &no_leases;
    const Kvfence__V1__NodeCounts *n = s->nodes ? s->nodes : &no_nodes;
    struct {
        const char *name;
        uint64_t v;
    } rows[] = {
        {"rooms.opening", r->opening},
        {"rooms.active", r->active},
        {"rooms.aborting", r->aborting},
        {"rooms.completed", r->completed},
        {"rooms.aborted", r->aborted},
        {"leases.active", l->active},
        {"leases.releasing", l->releasing},
        {"leases.released", l->released},
        {"nodes.attached", n->attached},
        {"nodes.suspect", n->suspect},
        {"nodes.lost", n->lost},
        {"notices_pending", s->notices_pending},
        {"notices_sent", s->notices_sent},
        {"notices_resent", s->notices_resent},
        {"reports_stale", s->reports_stale},
        {"reports_tokenless", s->reports_tokenless},
        {"reports_unknown", s->reports_unknown},
        {"rooms_past_deadline", s->rooms_past_deadline},
        {"fences_requested", s->fences_requested},
        {"generation", s->generation},
        {"uptime_ms", s->uptime_ms},
    };
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        const char *group = NULL;
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
            const char *dot = strchr(rows[i].name, '.');
            if (group && (!dot || strncmp(rows[i].name, group, (size_t)(dot - rows[i].name)) ||
                          group[dot - rows[i].name] != '.')) {
                cli_json_obj_end(&j);
                group = NULL;
            }
            if (dot && !group) {
                char g[32];
                snprintf(g, sizeof g, "%.*s", (int)(dot - rows[i].name), rows[i].name);
                cli_json_obj_begin(&j, g);
                group = rows[i].name;
            }
            cli_json_u64(&j, dot ? dot + 1 : rows[i].name, rows[i].v);
        }
        if (group) {
            cli_json_obj_end(&j);
        }
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"STAT", "VALUE"};
        struct cli_table t;
        cli_table_init(&t, 2, h);
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
            cli_table_cell(&t, "%s", rows[i].name);
            cli_table_cell(&t, "%" PRIu64, rows[i].v);
        }
        rc = finish_table(&t);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- abort --------------------------------------------------------------- */

static int cmd_abort(struct cli *c)
{
    Kvfence__V1__RoomKey key = KVFENCE__V1__ROOM_KEY__INIT;
    key.room_id = c->room_id;
    key.generation = c->generation;
    Kvfence__V1__AdminAbortRoomRequest rq = KVFENCE__V1__ADMIN_ABORT_ROOM_REQUEST__INIT;
    rq.room = &key;
    rq.detail = c->reason ? (char *)c->reason : "kvfence abort";
    ProtobufCMessage *m = NULL;
    int rc = call(c, "AdminAbortRoom", &rq.base, &kvfence__v1__abort_room_response__descriptor, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    const Kvfence__V1__AbortRoomResponse *r = (const Kvfence__V1__AbortRoomResponse *)m;
    char b[64], tb[64];
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        json_room_key(&j, "room", r->room);
        cli_json_str(&j, "token", fmt_token(r->token, tb, sizeof tb));
        cli_json_str(&j, "state", ROOM_STATE_NAME(r->state, b));
        cli_json_bool(&j, "already_aborting", r->already_aborting);
        cli_json_str(&j, "reason", REASON_NAME(r->reason, b));
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"ROOM",   "GENERATION",       "STATE",
                                        "REASON", "ALREADY_ABORTING", "TOKEN"};
        struct cli_table t;
        cli_table_init(&t, 6, h);
        cli_table_cell(&t, "%" PRIu64, r->room ? r->room->room_id : c->room_id);
        cli_table_cell(&t, "%" PRIu64, r->room ? r->room->generation : 0);
        cli_table_cell(&t, "%s", ROOM_STATE_NAME(r->state, b));
        cli_table_cell(&t, "%s", REASON_NAME(r->reason, b));
        cli_table_cell(&t, "%s", r->already_aborting ? "yes" : "no");
        cli_table_cell(&t, "%s", r->token ? fmt_token(r->token, tb, sizeof tb) : "-");
        rc = finish_table(&t);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- fence --------------------------------------------------------------- */

static int cmd_fence(struct cli *c)
{
    Kvfence__V1__FenceNodeRequest rq = KVFENCE__V1__FENCE_NODE_REQUEST__INIT;
    rq.node_id = (char *)c->args[0];
    ProtobufCMessage *m = NULL;
    int rc = call(c, "FenceNode", &rq.base, &kvfence__v1__fence_node_response__descriptor, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    const Kvfence__V1__FenceNodeResponse *r = (const Kvfence__V1__FenceNodeResponse *)m;
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        cli_json_str(&j, "node_id", c->args[0]);
        cli_json_u64(&j, "incarnation", r->incarnation);
        cli_json_u64(&j, "fencers", r->fencers);
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        static const char *const h[] = {"NODE", "INCARNATION", "FENCERS"};
        struct cli_table t;
        cli_table_init(&t, 3, h);
        cli_table_cell(&t, "%s", c->args[0]);
        cli_table_cell(&t, "%" PRIu64, r->incarnation);
        cli_table_cell(&t, "%u", r->fencers);
        rc = finish_table(&t);
    }
    protobuf_c_message_free_unpacked(m, NULL);
    return rc;
}

/* ---- watch --------------------------------------------------------------- */

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static void print_event(const struct cli *c, const Kvfence__V1__LeaseEvent *ev)
{
    char b[64], b2[64], tb[64];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t unix_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    if (c->json) {
        struct cli_json j;
        cli_json_init(&j, stdout);
        cli_json_obj_begin(&j, NULL);
        cli_json_u64(&j, "received_unix_ms", unix_ms);
        switch (ev->event_case) {
        case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED:
            json_lease(&j, "released", ev->released);
            break;
        case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE: {
            const Kvfence__V1__RoomStateChange *s = ev->room_state;
            cli_json_obj_begin(&j, "room_state");
            json_room_key(&j, "room", s->room);
            cli_json_str(&j, "old_state", ROOM_STATE_NAME(s->old_state, b));
            cli_json_str(&j, "new_state", ROOM_STATE_NAME(s->new_state, b));
            cli_json_str(&j, "reason", REASON_NAME(s->reason, b));
            cli_json_str(&j, "token", fmt_token(s->token, tb, sizeof tb));
            cli_json_obj_end(&j);
            break;
        }
        case KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED:
            cli_json_obj_begin(&j, "synced");
            cli_json_u64(&j, "replayed", ev->synced->replayed);
            cli_json_obj_end(&j);
            break;
        default:
            cli_json_null(&j, "unknown");
            break;
        }
        cli_json_obj_end(&j);
        cli_json_end(&j);
    } else {
        struct tm tm;
        localtime_r(&ts.tv_sec, &tm);
        char when[32];
        strftime(when, sizeof when, "%H:%M:%S", &tm);
        printf("%s.%03ld ", when, ts.tv_nsec / 1000000);
        switch (ev->event_case) {
        case KVFENCE__V1__LEASE_EVENT__EVENT_RELEASED: {
            const Kvfence__V1__Lease *l = ev->released;
            const Kvfence__V1__Participant *p = l->participant;
            printf("released lease=%" PRIu64 " room=%" PRIu64 " generation=%" PRIu64
                   " node=%s rank=%u role=%s pool=%u pages=%" PRIu64 "\n",
                   l->lease_id, l->room ? l->room->room_id : 0, l->room ? l->room->generation : 0,
                   p ? p->node_id : "-", p ? p->rank : 0, ROLE_NAME(p ? p->role : 0, b), l->pool_id,
                   lease_pages(l));
            break;
        }
        case KVFENCE__V1__LEASE_EVENT__EVENT_ROOM_STATE: {
            const Kvfence__V1__RoomStateChange *s = ev->room_state;
            printf("room_state room=%" PRIu64 " generation=%" PRIu64 " %s -> %s",
                   s->room ? s->room->room_id : 0, s->room ? s->room->generation : 0,
                   ROOM_STATE_NAME(s->old_state, b), ROOM_STATE_NAME(s->new_state, b2));
            if (s->reason) {
                printf(" reason=%s", REASON_NAME(s->reason, b));
            }
            if (s->token) {
                printf(" token=%s", fmt_token(s->token, tb, sizeof tb));
            }
            printf("\n");
            break;
        }
        case KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED:
            printf("synced replayed=%" PRIu64 "\n", ev->synced->replayed);
            break;
        default:
            printf("unknown event\n");
            break;
        }
    }
    fflush(stdout);
}

static int cmd_watch(struct cli *c)
{
    Kvfence__V1__WatchLeasesRequest rq = KVFENCE__V1__WATCH_LEASES_REQUEST__INIT;
    rq.node_id = c->node ? (char *)c->node : "";
    rq.include_room_states = c->room_states;
    size_t len = kvfence__v1__watch_leases_request__get_packed_size(&rq);
    uint8_t buf[1024];
    if (len > sizeof buf) {
        return usage_error("watch: filter too long");
    }
    kvfence__v1__watch_leases_request__pack(&rq, buf);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    struct kvf_rpc_client_stream *cs =
        kvf_rpc_client_stream_open(c->ch, "/kvfence.v1.Control/WatchLeases", KVF_RPC_NO_TIMEOUT);
    if (!cs) {
        fprintf(stderr, "%s: cannot open the watch stream\n", progname);
        return EXIT_SERVER;
    }
    int rc = kvf_rpc_client_stream_send(cs, buf, len);
    if (rc == 0) {
        rc = kvf_rpc_client_stream_half_close(cs);
    }
    int exit_code = EXIT_OK;
    uint64_t seen = 0;
    /* A send that failed because the stream ended: recv reports the status. */
    while (!interrupted && (c->count == 0 || seen < c->count)) {
        uint8_t *msg = NULL;
        size_t mlen = 0;
        struct kvf_rpc_status st = {0};
        rc = kvf_rpc_client_stream_recv(cs, 200, &msg, &mlen, &st);
        if (rc == -ETIMEDOUT) {
            continue;
        }
        if (rc == KVF_RPC_STREAM_END) {
            if (st.code != KVF_GRPC_OK) {
                exit_code = report_status(&st);
            } else {
                fprintf(stderr, "%s: the server ended the watch\n", progname);
                exit_code = EXIT_UNREACHABLE;
            }
            break;
        }
        if (rc != 0) {
            fprintf(stderr, "%s: watch: receive failed (%s)\n", progname, strerror(-rc));
            exit_code = EXIT_SERVER;
            break;
        }
        Kvfence__V1__LeaseEvent *ev = kvfence__v1__lease_event__unpack(NULL, mlen, msg);
        free(msg);
        if (!ev) {
            fprintf(stderr, "%s: watch: undecodable event\n", progname);
            exit_code = EXIT_SERVER;
            break;
        }
        print_event(c, ev);
        if (ev->event_case != KVFENCE__V1__LEASE_EVENT__EVENT_SYNCED) {
            seen++;
        }
        kvfence__v1__lease_event__free_unpacked(ev, NULL);
    }
    kvf_rpc_client_stream_close(cs);
    return exit_code;
}

/* ---- commands and help --------------------------------------------------- */

static const struct opt rooms_opts[] = {
    {"state", 0, true, O_STATE},
    {"node", 0, true, O_NODE},
    {"min-age-ms", 0, true, O_MIN_AGE},
    {NULL, 0, false, 0},
};
static const struct opt room_opts[] = {
    {"generation", 0, true, O_GENERATION},
    {NULL, 0, false, 0},
};
static const struct opt leases_opts[] = {
    {"node", 0, true, O_NODE},
    {"state", 0, true, O_STATE},
    {"room", 0, true, O_ROOM},
    {NULL, 0, false, 0},
};
static const struct opt abort_opts[] = {
    {"generation", 0, true, O_GENERATION},
    {"reason", 0, true, O_REASON},
    {NULL, 0, false, 0},
};
static const struct opt watch_opts[] = {
    {"node", 0, true, O_NODE},
    {"room-states", 0, false, O_ROOM_STATES},
    {"count", 0, true, O_COUNT},
    {NULL, 0, false, 0},
};
static const struct opt no_opts[] = {{NULL, 0, false, 0}};

static const struct command commands[] = {
    {"nodes", 0, 0, no_opts,
     "Usage: kvfence nodes [-o table|json]\n"
     "\n"
     "Lists the nodes (current incarnations) by node id: state, negotiated\n"
     "protocol, non-terminal rooms, pools, pending notices, time in state and\n"
     "since last seen. JSON: {\"nodes\": [NodeInfo...]} with capabilities,\n"
     "endpoints and pools.\n",
     cmd_nodes},
    {"rooms", 0, 0, rooms_opts,
     "Usage: kvfence rooms [--state S]... [--node N] [--min-age-ms MS] [-o table|json]\n"
     "\n"
     "Lists rooms (tombstones included), oldest first, following every page.\n"
     "\n"
     "  --state S        only rooms in state S: opening, active, aborting,\n"
     "                   completed, aborted (repeat, or S1,S2 for several)\n"
     "  --node N         only rooms with a participant on node N\n"
     "  --min-age-ms MS  only rooms created at least MS ms ago\n"
     "\n"
     "JSON: {\"rooms\": [RoomInfo without participants...]}.\n",
     cmd_rooms},
    {"room", 1, 1, room_opts,
     "Usage: kvfence room ID [--generation G] [-o table|json]\n"
     "\n"
     "Shows one room-generation: state, abort reason, token (32 hex digits),\n"
     "age, and per participant its node, rank, role, lease, pages, and its\n"
     "node's completed, drained and fenced state and abort notice attempts.\n"
     "\n"
     "  --generation G   that generation (default: the current one)\n"
     "\n"
     "Exit 4 when the room is unknown.\n",
     cmd_room},
    {"leases", 0, 0, leases_opts,
     "Usage: kvfence leases [--node N] [--state S]... [--room ID] [-o table|json]\n"
     "\n"
     "Lists leases by lease id, following every page.\n"
     "\n"
     "  --node N    only leases of participants on node N\n"
     "  --state S   only leases in state S: active, releasing, released\n"
     "              (repeat, or S1,S2)\n"
     "  --room ID   only leases of room ID (any generation)\n"
     "\n"
     "JSON: {\"leases\": [Lease...]}.\n",
     cmd_leases},
    {"stats", 0, 0, no_opts,
     "Usage: kvfence stats [-o table|json]\n"
     "\n"
     "Counters and gauges of the control plane: rooms, leases and nodes per\n"
     "state, notices, stale reports, fences, last generation, uptime.\n",
     cmd_stats},
    {"abort", 1, 1, abort_opts,
     "Usage: kvfence abort ID [--generation G] [--reason TEXT] [-o table|json]\n"
     "\n"
     "Aborts a room as an operator (reason ADMIN) and prints its abort token.\n"
     "Idempotent: aborting it again prints the same token (already_aborting).\n"
     "The leases are released later, when every node drained or was fenced.\n"
     "\n"
     "  --generation G   that generation (default: the current one)\n"
     "  --reason TEXT    detail for logs and the admin view (at most 256 bytes)\n"
     "\n"
     "Exit 4 when the room is unknown, 1 with FAILED_PRECONDITION when it is\n"
     "COMPLETED.\n",
     cmd_abort},
    {"fence", 1, 1, no_opts,
     "Usage: kvfence fence NODE [-o table|json]\n"
     "\n"
     "Asks every node sharing a non-terminal room with NODE to fence NODE's\n"
     "current incarnation. Prints the incarnation and the number of fencers.\n"
     "Exit 4 when the node is unknown.\n",
     cmd_fence},
    {"watch", 0, 0, watch_opts,
     "Usage: kvfence watch [--node N] [--room-states] [--count N] [-o table|json]\n"
     "\n"
     "Streams lease releases (and, with --room-states, room state changes)\n"
     "one line per event until Ctrl-C (exit 0) or --count events. The server\n"
     "first replays the releases it still remembers, then sends a 'synced'\n"
     "marker (printed, not counted). -o json prints one JSON document per\n"
     "line: {\"received_unix_ms\":..., and one of \"released\", \"room_state\",\n"
     "\"synced\"}. --timeout does not apply to the stream.\n"
     "\n"
     "  --node N        only leases (and their rooms) on node N\n"
     "  --room-states   also room state changes (ACTIVE -> ABORTING ...)\n"
     "  --count N       exit 0 after N events\n"
     "\n"
     "Exit 3 when the server is unreachable or ends the stream.\n",
     cmd_watch},
};

#define NCOMMANDS (sizeof commands / sizeof commands[0])

static void print_help(FILE *f)
{
    fprintf(f,
            "Usage: kvfence [GLOBAL FLAGS] COMMAND [ARGS] [FLAGS]\n"
            "\n"
            "The kvfence admin CLI: inspects and steers a kvfence-control.\n"
            "\n"
            "Commands:\n"
            "  nodes                 list nodes\n"
            "  rooms                 list rooms (--state, --node, --min-age-ms)\n"
            "  room ID               one room with its participants\n"
            "  leases                list leases (--node, --state, --room)\n"
            "  stats                 control plane counters and gauges\n"
            "  abort ID              abort a room; prints its token (idempotent)\n"
            "  fence NODE            have NODE fenced by its peers\n"
            "  watch                 stream lease releases and room transitions\n"
            "\n"
            "Global flags (anywhere on the line):\n"
            "  --server ADDR         control plane address (env KVFENCE_SERVER,\n"
            "                        default " DEFAULT_SERVER ")\n"
            "  --tls-ca PATH         use TLS; PEM of the CA that signed the server\n"
            "  --tls-cert PATH       client certificate for mutual TLS (with --tls-key)\n"
            "  --tls-key PATH        client key for mutual TLS\n"
            "  --tls-server-name N   name checked against the server certificate\n"
            "  --timeout MS          deadline of each call (default %d)\n"
            "  -o, --output FORMAT   table (default) or json\n"
            "  -h, --help            this help; 'kvfence COMMAND --help' for a command\n"
            "  --version             print the version\n"
            "\n"
            "Exit codes:\n"
            "  0  ok\n"
            "  1  the server answered with an error (\"kvfence: CODE: message\" on stderr)\n"
            "  2  usage error (bad command, flag or value; unreadable TLS file)\n"
            "  3  cannot reach the server (UNAVAILABLE, DEADLINE_EXCEEDED)\n"
            "  4  not found (NOT_FOUND: unknown room or node)\n",
            DEFAULT_TIMEOUT_MS);
}

static const struct command *find_command(const char *name)
{
    for (size_t i = 0; i < NCOMMANDS; i++) {
        if (strcmp(commands[i].name, name) == 0) {
            return &commands[i];
        }
    }
    return NULL;
}

static const struct opt *find_opt(const struct opt *table, const char *longname, size_t len,
                                  char shortc)
{
    for (const struct opt *o = table; o && o->name; o++) {
        if (longname && strlen(o->name) == len && strncmp(o->name, longname, len) == 0) {
            return o;
        }
        if (!longname && shortc && o->shortc == shortc) {
            return o;
        }
    }
    return NULL;
}

/* Adds a comma separated list of states. */
static int add_states(struct cli *c, const char *val)
{
    bool rooms = strcmp(c->cmd->name, "rooms") == 0;
    const ProtobufCEnumDescriptor *d =
        rooms ? &kvfence__v1__room_state__descriptor : &kvfence__v1__lease_state__descriptor;
    const char *prefix = rooms ? "ROOM_STATE_" : "LEASE_STATE_";
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s", val);
    char *save = NULL;
    for (char *s = strtok_r(tmp, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
        int v = enum_parse(d, prefix, s);
        if (v < 0) {
            return usage_error("%s: unknown state '%s'", c->cmd->name, s);
        }
        if (c->nstates == MAX_STATES) {
            return usage_error("%s: too many --state", c->cmd->name);
        }
        c->states[c->nstates++] = v;
    }
    return EXIT_OK;
}

static int apply_opt(struct cli *c, const struct opt *o, const char *val, bool *help, bool *version)
{
    uint64_t v;
    switch (o->id) {
    case O_SERVER:
        c->server = val;
        break;
    case O_TLS_CA:
        c->tls_ca = val;
        break;
    case O_TLS_CERT:
        c->tls_cert = val;
        break;
    case O_TLS_KEY:
        c->tls_key = val;
        break;
    case O_TLS_NAME:
        c->tls_name = val;
        break;
    case O_TIMEOUT:
        if (!parse_u64(val, INT64_MAX, &v) || v == 0) {
            return usage_error("--timeout: '%s' is not a positive number of ms", val);
        }
        c->timeout_ms = (int64_t)v;
        break;
    case O_OUTPUT:
        if (strcmp(val, "json") == 0) {
            c->json = true;
        } else if (strcmp(val, "table") == 0) {
            c->json = false;
        } else {
            return usage_error("-o: '%s' is neither table nor json", val);
        }
        break;
    case O_HELP:
        *help = true;
        break;
    case O_VERSION:
        *version = true;
        break;
    case O_STATE:
        return add_states(c, val);
    case O_NODE:
        if (!*val) {
            return usage_error("--node: empty node id");
        }
        c->node = val;
        break;
    case O_MIN_AGE:
        if (!parse_u64(val, UINT64_MAX, &c->min_age_ms)) {
            return usage_error("--min-age-ms: '%s' is not a number", val);
        }
        break;
    case O_GENERATION:
        if (!parse_u64(val, UINT64_MAX, &c->generation)) {
            return usage_error("--generation: '%s' is not a number", val);
        }
        break;
    case O_ROOM:
        if (!parse_u64(val, INT64_MAX, &c->room_id) || c->room_id == 0) {
            return usage_error("--room: '%s' is not a room id (1 .. 2^63-1)", val);
        }
        break;
    case O_REASON:
        if (strlen(val) > 256) {
            return usage_error("--reason: longer than 256 bytes");
        }
        c->reason = val;
        break;
    case O_ROOM_STATES:
        c->room_states = true;
        break;
    case O_COUNT:
        if (!parse_u64(val, UINT64_MAX, &c->count) || c->count == 0) {
            return usage_error("--count: '%s' is not a positive number", val);
        }
        break;
    }
    return EXIT_OK;
}

static int parse_args(struct cli *c, int argc, char **argv, bool *help, bool *version)
{
    bool only_positional = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (only_positional || a[0] != '-' || a[1] == '\0') {
            if (!c->cmd) {
                c->cmd = find_command(a);
                if (!c->cmd) {
                    return usage_error("unknown command '%s'", a);
                }
            } else if (c->nargs < sizeof c->args / sizeof c->args[0]) {
                c->args[c->nargs++] = a;
            } else {
                return usage_error("%s: too many arguments", c->cmd->name);
            }
            continue;
        }
        if (strcmp(a, "--") == 0) {
            only_positional = true;
            continue;
        }
        const struct opt *o = NULL;
        const char *val = NULL;
        if (a[1] == '-') {
            const char *name = a + 2;
            const char *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            o = find_opt(global_opts, name, len, 0);
            if (!o && c->cmd) {
                o = find_opt(c->cmd->opts, name, len, 0);
            }
            if (!o) {
                if (c->cmd) {
                    return usage_error("%s: unknown flag '--%.*s'", c->cmd->name, (int)len, name);
                }
                return usage_error("unknown flag '--%.*s'", (int)len, name);
            }
            if (eq) {
                if (!o->has_arg) {
                    return usage_error("--%s takes no value", o->name);
                }
                val = eq + 1;
            }
        } else {
            if (a[2] != '\0' && a[1] != 'o') {
                return usage_error("unknown flag '%s'", a);
            }
            o = find_opt(global_opts, NULL, 0, a[1]);
            if (!o) {
                return usage_error("unknown flag '%s'", a);
            }
            if (a[2] != '\0') {
                val = a + 2; /* -ojson */
            }
        }
        if (o->has_arg && !val) {
            if (i + 1 >= argc) {
                return usage_error("--%s needs a value", o->name);
            }
            val = argv[++i];
        }
        int rc = apply_opt(c, o, val, help, version);
        if (rc != EXIT_OK) {
            return rc;
        }
    }
    return EXIT_OK;
}

int main(int argc, char **argv)
{
    struct cli c;
    memset(&c, 0, sizeof c);
    c.server = getenv("KVFENCE_SERVER");
    if (!c.server || !*c.server) {
        c.server = DEFAULT_SERVER;
    }
    c.timeout_ms = DEFAULT_TIMEOUT_MS;
    bool help = false, version = false;
    int rc = parse_args(&c, argc, argv, &help, &version);
    if (rc != EXIT_OK) {
        return rc;
    }
    if (version) {
        printf("kvfence %s\n", KVF_VERSION_STRING);
        return EXIT_OK;
    }
    if (help) {
        if (c.cmd) {
            fputs(c.cmd->help, stdout);
            printf("\nGlobal flags and exit codes: kvfence --help\n");
        } else {
            print_help(stdout);
        }
        return EXIT_OK;
    }
    if (!c.cmd) {
        return usage_error("no command");
    }
    if (c.nargs < c.cmd->min_args) {
        return usage_error("%s: missing argument", c.cmd->name);
    }
    if (c.nargs > c.cmd->max_args) {
        return usage_error("%s: unexpected argument '%s'", c.cmd->name, c.args[c.cmd->max_args]);
    }
    if (strcmp(c.cmd->name, "room") == 0 || strcmp(c.cmd->name, "abort") == 0) {
        if (!parse_u64(c.args[0], INT64_MAX, &c.room_id) || c.room_id == 0) {
            return usage_error("%s: '%s' is not a room id (1 .. 2^63-1)", c.cmd->name, c.args[0]);
        }
    }
    if (strcmp(c.cmd->name, "fence") == 0 && !*c.args[0]) {
        return usage_error("fence: empty node id");
    }
    if (!c.tls_ca && (c.tls_cert || c.tls_key || c.tls_name)) {
        return usage_error("--tls-cert, --tls-key and --tls-server-name need --tls-ca");
    }
    if (!c.tls_cert != !c.tls_key) {
        return usage_error("--tls-cert and --tls-key go together");
    }
    rc = connect_server(&c);
    if (rc != EXIT_OK) {
        return rc;
    }
    rc = c.cmd->run(&c);
    if (fflush(stdout) != 0 && rc == EXIT_OK) {
        rc = EXIT_SERVER;
    }
    kvf_rpc_channel_destroy(c.ch);
    return rc;
}
