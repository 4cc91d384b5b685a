/*
 * kvfence.c: the kvfence admin CLI's entry (docs/cli.md): the command table,
 * the command line (global flags anywhere, --flag value and --flag=value),
 * the environment (KVFENCE_SERVER, KVFENCE_CACERT, KVFENCE_CERT, KVFENCE_KEY;
 * flags win), help, and the dispatch to one command per run. The commands
 * themselves are in cmd_views.c and cmd_actions.c, the shared helpers in
 * cli.c.
 *
 * Exit codes: 0 ok, 1 the server answered with an error, 2 usage error (also
 * unreadable TLS files), 3 the server cannot be reached (UNAVAILABLE,
 * DEADLINE_EXCEEDED; health: not SERVING), 4 not found (NOT_FOUND).
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "kvf_version.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"

#define DEFAULT_SERVER     "127.0.0.1:7070"
#define DEFAULT_TIMEOUT_MS 5000

/* ---- the command table ---------------------------------------------------- */

const struct cli_opt cli_global_opts[] = {
    {"server", 0, true, O_SERVER},
    {"tls-ca", 0, true, O_TLS_CA},
    {"tls-cert", 0, true, O_TLS_CERT},
    {"tls-key", 0, true, O_TLS_KEY},
    {"tls-server-name", 0, true, O_TLS_NAME},
    {"timeout", 0, true, O_TIMEOUT},
    {"output", 'o', true, O_OUTPUT},
    {"no-headers", 0, false, O_NO_HEADERS},
    {"help", 'h', false, O_HELP},
    {"version", 0, false, O_VERSION},
    {NULL, 0, false, 0},
};

static const struct cli_opt rooms_opts[] = {
    {"state", 0, true, O_STATE},
    {"node", 0, true, O_NODE},
    {"min-age-ms", 0, true, O_MIN_AGE},
    {NULL, 0, false, 0},
};
static const struct cli_opt room_opts[] = {
    {"generation", 0, true, O_GENERATION},
    {NULL, 0, false, 0},
};
static const struct cli_opt leases_opts[] = {
    {"node", 0, true, O_NODE},
    {"state", 0, true, O_STATE},
    {"room", 0, true, O_ROOM},
    {NULL, 0, false, 0},
};
static const struct cli_opt abort_opts[] = {
    {"generation", 0, true, O_GENERATION},
    {"reason", 0, true, O_REASON},
    {NULL, 0, false, 0},
};
static const struct cli_opt watch_opts[] = {
    {"node", 0, true, O_NODE},
    {"room-states", 0, false, O_ROOM_STATES},
    {"count", 0, true, O_COUNT},
    {NULL, 0, false, 0},
};
static const struct cli_opt health_opts[] = {
    {"service", 0, true, O_SERVICE},
    {NULL, 0, false, 0},
};
static const struct cli_opt no_opts[] = {{NULL, 0, false, 0}};

#define OUT_FORMS "[-o table|wide|json|yaml]"

const struct cli_command cli_commands[] = {
    {"nodes", 0, 0, "", no_opts, "list nodes",
     "Usage: kvfence nodes " OUT_FORMS " [--no-headers]\n"
     "\n"
     "Lists the nodes (current incarnations) by node id: state, negotiated\n"
     "protocol, non-terminal rooms, pools, pending notices, time in state and\n"
     "since its session's last message ('-': not tracked, or no session).\n"
     "-o wide adds the peers that fenced it, features, endpoints and version.\n"
     "JSON / YAML: the ListNodesResponse, every page in one.\n",
     cli_cmd_nodes},
    {"node", 1, 1, "NODE", no_opts, "one node: pools, capabilities, session, fences",
     "Usage: kvfence node ID " OUT_FORMS "\n"
     "\n"
     "Shows one node's current incarnation: state, session (last message),\n"
     "protocol and features, endpoints, rooms, pending notices, fences, its\n"
     "pools, and its leases that wait for a proof from its host.\n"
     "JSON / YAML: the NodeInfo (GetNode).\n"
     "\n"
     "Exit 4 when the node is unknown.\n",
     cli_cmd_node},
    {"rooms", 0, 0, "", rooms_opts, "list rooms (--state, --node, --min-age-ms)",
     "Usage: kvfence rooms [--state S]... [--node N] [--min-age-ms MS] " OUT_FORMS "\n"
     "\n"
     "Lists rooms (tombstones included), oldest first, following every page.\n"
     "\n"
     "  --state S        only rooms in state S: opening, active, aborting,\n"
     "                   completed, aborted (repeat, or S1,S2 for several)\n"
     "  --node N         only rooms with a participant on node N\n"
     "  --min-age-ms MS  only rooms created at least MS ms ago\n"
     "\n"
     "-o wide adds expected sources and sinks and the protocol version.\n"
     "JSON / YAML: the ListRoomsResponse (RoomInfo without participants).\n",
     cli_cmd_rooms},
    {"room", 1, 1, "ID", room_opts, "one room with its participants",
     "Usage: kvfence room ID [--generation G] " OUT_FORMS "\n"
     "\n"
     "Shows one room-generation: state, abort reason, token (32 hex digits),\n"
     "age, and per participant its node, rank, role, lease, pages, and its\n"
     "node's completed, drained and fenced state (fenced: only where a fence\n"
     "happened) and abort notices sent. -o wide adds lease mode and ranges.\n"
     "\n"
     "  --generation G   that generation (default: the current one)\n"
     "\n"
     "Exit 4 when the room is unknown.\n",
     cli_cmd_room},
    {"leases", 0, 0, "", leases_opts, "list leases (--node, --state, --room)",
     "Usage: kvfence leases [--node N] [--state S]... [--room ID] " OUT_FORMS "\n"
     "\n"
     "Lists leases by lease id, following every page.\n"
     "\n"
     "  --node N    only leases of participants on node N\n"
     "  --state S   only leases in state S: active, releasing, released\n"
     "              (repeat, or S1,S2)\n"
     "  --room ID   only leases of room ID (any generation)\n"
     "\n"
     "-o wide puts the wait for a host proof in a column of its own.\n"
     "JSON / YAML: the ListLeasesResponse.\n",
     cli_cmd_leases},
    {"stats", 0, 0, "", no_opts, "control plane counters and gauges",
     "Usage: kvfence stats " OUT_FORMS "\n"
     "\n"
     "Counters and gauges of the control plane: rooms, leases and nodes per\n"
     "state, notices, stale reports, fences, last generation, uptime.\n",
     cli_cmd_stats},
    {"abort", 1, 1, "ID", abort_opts, "abort a room; prints its token (idempotent)",
     "Usage: kvfence abort ID [--generation G] [--reason TEXT] " OUT_FORMS "\n"
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
     cli_cmd_abort},
    {"fence", 1, 1, "NODE", no_opts, "have NODE fenced by its peers",
     "Usage: kvfence fence NODE " OUT_FORMS "\n"
     "\n"
     "Asks every node sharing a non-terminal room with NODE to fence NODE's\n"
     "current incarnation. Prints the incarnation and the number of fencers.\n"
     "Exit 4 when the node is unknown.\n",
     cli_cmd_fence},
    {"watch", 0, 0, "", watch_opts, "stream lease releases and room transitions",
     "Usage: kvfence watch [--node N] [--room-states] [--count N] " OUT_FORMS "\n"
     "\n"
     "Streams lease releases (and, with --room-states, room state changes)\n"
     "one line per event until Ctrl-C (exit 0) or --count events. The server\n"
     "first replays the releases it still remembers, then sends a 'synced'\n"
     "marker (printed, not counted). -o json prints one LeaseEvent per line\n"
     "with \"receivedUnixMs\" first; -o yaml one document per event.\n"
     "--timeout does not apply to the stream.\n"
     "\n"
     "  --node N        only leases (and their rooms) on node N\n"
     "  --room-states   also room state changes (ACTIVE -> ABORTING ...)\n"
     "  --count N       exit 0 after N events\n"
     "\n"
     "Exit 3 when the server is unreachable or ends the stream.\n",
     cli_cmd_watch},
    {"health", 0, 0, "", health_opts, "the server's gRPC health (exit 0: SERVING)",
     "Usage: kvfence health [--service NAME] " OUT_FORMS "\n"
     "\n"
     "Asks the gRPC health service (grpc.health.v1.Health/Check). SERVING:\n"
     "prints it, exit 0. NOT_SERVING (recovering, shutting down): stderr,\n"
     "exit 3, as for a server that cannot be reached.\n"
     "\n"
     "  --service NAME  one service, e.g. kvfence.v1.Admin (default: the\n"
     "                  server as a whole)\n"
     "\n"
     "Exit 4 when the server does not know the service.\n",
     cli_cmd_health},
    {"help", 0, 1, "[COMMAND]", no_opts, "this help, or one command's",
     "Usage: kvfence help [COMMAND]\n"
     "\n"
     "Prints the global help, or COMMAND's own help.\n",
     NULL},
    {"completion", 1, 1, "SHELL", no_opts, "print a shell completion script (bash, zsh)",
     "Usage: kvfence completion bash|zsh\n"
     "\n"
     "Prints a completion script for the shell:\n"
     "  source <(kvfence completion bash)      # in ~/.bashrc\n"
     "  kvfence completion zsh > \"${fpath[1]}/_kvfence\"\n",
     NULL},
};

const size_t cli_command_count = sizeof cli_commands / sizeof cli_commands[0];

static void print_help(FILE *f)
{
    fprintf(f, "Usage: kvfence [GLOBAL FLAGS] COMMAND [ARGS] [FLAGS]\n"
               "\n"
               "The kvfence admin CLI: inspects and steers a kvfence-control.\n"
               "\n"
               "Commands:\n");
    for (size_t i = 0; i < cli_command_count; i++) {
        const struct cli_command *k = &cli_commands[i];
        char lhs[32];
        snprintf(lhs, sizeof lhs, "%s%s%s", k->name, k->arg_names[0] ? " " : "", k->arg_names);
        fprintf(f, "  %-20s  %s\n", lhs, k->summary);
    }
    fprintf(f,
            "\n"
            "Global flags (anywhere on the line):\n"
            "  --server ADDR         control plane address (env KVFENCE_SERVER,\n"
            "                        default " DEFAULT_SERVER ")\n"
            "  --tls-ca PATH         use TLS; PEM of the CA that signed the server\n"
            "                        (env KVFENCE_CACERT)\n"
            "  --tls-cert PATH       client certificate for mutual TLS, with --tls-key\n"
            "                        (env KVFENCE_CERT)\n"
            "  --tls-key PATH        client key for mutual TLS (env KVFENCE_KEY)\n"
            "  --tls-server-name N   name checked against the server certificate\n"
            "  --timeout MS          deadline of each call (default %d)\n"
            "  -o, --output FORMAT   table (default), wide, json or yaml\n"
            "  --no-headers          tables without their header line\n"
            "  -h, --help            this help; 'kvfence help COMMAND' for a command\n"
            "  --version             print the version\n"
            "Flags win over the environment.\n"
            "\n"
            "Exit codes:\n"
            "  0  ok\n"
            "  1  the server answered with an error (\"kvfence: CODE: message\" on stderr)\n"
            "  2  usage error (bad command, flag or value; unreadable TLS file)\n"
            "  3  cannot reach the server (UNAVAILABLE, DEADLINE_EXCEEDED; health: not\n"
            "     SERVING)\n"
            "  4  not found (NOT_FOUND: unknown room, node or health service)\n",
            DEFAULT_TIMEOUT_MS);
}

static void print_command_help(const struct cli_command *k)
{
    fputs(k->help, stdout);
    printf("\nGlobal flags and exit codes: kvfence help\n");
}

/* ---- the command line ----------------------------------------------------- */

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

static const struct cli_command *find_command(const char *name)
{
    for (size_t i = 0; i < cli_command_count; i++) {
        if (strcmp(cli_commands[i].name, name) == 0) {
            return &cli_commands[i];
        }
    }
    return NULL;
}

static const struct cli_opt *find_opt(const struct cli_opt *table, const char *longname, size_t len,
                                      char shortc)
{
    for (const struct cli_opt *o = table; o && o->name; o++) {
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
            return cli_usage_error(c, "%s: unknown state '%s'", c->cmd->name, s);
        }
        if (c->nstates == CLI_MAX_STATES) {
            return cli_usage_error(c, "%s: too many --state", c->cmd->name);
        }
        c->states[c->nstates++] = v;
    }
    return EXIT_OK;
}

static int apply_opt(struct cli *c, const struct cli_opt *o, const char *val, bool *help,
                     bool *version)
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
            return cli_usage_error(c, "--timeout: '%s' is not a positive number of ms", val);
        }
        c->timeout_ms = (int64_t)v;
        break;
    case O_OUTPUT:
        if (strcmp(val, "json") == 0) {
            c->form = CLI_FORM_JSON;
        } else if (strcmp(val, "yaml") == 0) {
            c->form = CLI_FORM_YAML;
        } else if (strcmp(val, "table") == 0) {
            c->form = CLI_FORM_TABLE;
        } else if (strcmp(val, "wide") == 0) {
            c->form = CLI_FORM_WIDE;
        } else {
            return cli_usage_error(c, "-o: '%s' is not table, wide, json or yaml", val);
        }
        break;
    case O_NO_HEADERS:
        c->no_headers = true;
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
            return cli_usage_error(c, "--node: empty node id");
        }
        c->node = val;
        break;
    case O_MIN_AGE:
        if (!parse_u64(val, UINT64_MAX, &c->min_age_ms)) {
            return cli_usage_error(c, "--min-age-ms: '%s' is not a number", val);
        }
        break;
    case O_GENERATION:
        if (!parse_u64(val, UINT64_MAX, &c->generation)) {
            return cli_usage_error(c, "--generation: '%s' is not a number", val);
        }
        break;
    case O_ROOM:
        if (!parse_u64(val, INT64_MAX, &c->room_id) || c->room_id == 0) {
            return cli_usage_error(c, "--room: '%s' is not a room id (1 .. 2^63-1)", val);
        }
        break;
    case O_REASON:
        if (strlen(val) > 256) {
            return cli_usage_error(c, "--reason: longer than 256 bytes");
        }
        c->reason = val;
        break;
    case O_ROOM_STATES:
        c->room_states = true;
        break;
    case O_COUNT:
        if (!parse_u64(val, UINT64_MAX, &c->count) || c->count == 0) {
            return cli_usage_error(c, "--count: '%s' is not a positive number", val);
        }
        break;
    case O_SERVICE:
        c->service = val;
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
                    return cli_usage_error(c, "unknown command '%s'", a);
                }
            } else if (c->nargs < sizeof c->args / sizeof c->args[0]) {
                c->args[c->nargs++] = a;
            } else {
                return cli_usage_error(c, "%s: too many arguments", c->cmd->name);
            }
            continue;
        }
        if (strcmp(a, "--") == 0) {
            only_positional = true;
            continue;
        }
        const struct cli_opt *o = NULL;
        const char *val = NULL;
        if (a[1] == '-') {
            const char *name = a + 2;
            const char *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            o = find_opt(cli_global_opts, name, len, 0);
            if (!o && c->cmd) {
                o = find_opt(c->cmd->opts, name, len, 0);
            }
            if (!o) {
                if (c->cmd) {
                    return cli_usage_error(c, "%s: unknown flag '--%.*s'", c->cmd->name, (int)len,
                                           name);
                }
                return cli_usage_error(c, "unknown flag '--%.*s'", (int)len, name);
            }
            if (eq) {
                if (!o->has_arg) {
                    return cli_usage_error(c, "--%s takes no value", o->name);
                }
                val = eq + 1;
            }
        } else {
            if (a[2] != '\0' && a[1] != 'o') {
                return cli_usage_error(c, "unknown flag '%s'", a);
            }
            o = find_opt(cli_global_opts, NULL, 0, a[1]);
            if (!o) {
                return cli_usage_error(c, "unknown flag '%s'", a);
            }
            if (a[2] != '\0') {
                val = a + 2; /* -ojson */
            }
        }
        if (o->has_arg && !val) {
            if (i + 1 >= argc) {
                return cli_usage_error(c, "--%s needs a value", o->name);
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

/* The environment's defaults; the flags parsed after them win. */
static void read_env(struct cli *c)
{
    static const struct {
        const char *name;
        size_t off;
    } vars[] = {
        {"KVFENCE_SERVER", offsetof(struct cli, server)},
        {"KVFENCE_CACERT", offsetof(struct cli, tls_ca)},
        {"KVFENCE_CERT", offsetof(struct cli, tls_cert)},
        {"KVFENCE_KEY", offsetof(struct cli, tls_key)},
    };
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i].name);
        if (v && *v) {
            *(const char **)((char *)c + vars[i].off) = v;
        }
    }
}

/* help and completion: they need no server. */
static int run_local(struct cli *c)
{
    if (strcmp(c->cmd->name, "completion") == 0) {
        return cli_completion(c, c->args[0]);
    }
    if (c->nargs == 0) {
        print_help(stdout);
        return EXIT_OK;
    }
    const struct cli_command *k = find_command(c->args[0]);
    if (!k) {
        return cli_usage_error(c, "help: unknown command '%s'", c->args[0]);
    }
    print_command_help(k);
    return EXIT_OK;
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
        fprintf(stderr, "%s: cannot set up a channel to %s (see the message above)\n", cli_progname,
                c->server);
        return EXIT_USAGE;
    }
    return EXIT_OK;
}

int main(int argc, char **argv)
{
    struct cli c;
    memset(&c, 0, sizeof c);
    c.server = DEFAULT_SERVER;
    c.timeout_ms = DEFAULT_TIMEOUT_MS;
    read_env(&c);
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
            print_command_help(c.cmd);
        } else {
            print_help(stdout);
        }
        return EXIT_OK;
    }
    if (!c.cmd) {
        return cli_usage_error(&c, "no command");
    }
    if (c.nargs < c.cmd->min_args) {
        return cli_usage_error(&c, "%s: missing argument", c.cmd->name);
    }
    if (c.nargs > c.cmd->max_args) {
        return cli_usage_error(&c, "%s: unexpected argument '%s'", c.cmd->name,
                               c.args[c.cmd->max_args]);
    }
    if (!c.cmd->run) {
        return run_local(&c);
    }
    if (strcmp(c.cmd->name, "room") == 0 || strcmp(c.cmd->name, "abort") == 0) {
        if (!parse_u64(c.args[0], INT64_MAX, &c.room_id) || c.room_id == 0) {
            return cli_usage_error(&c, "%s: '%s' is not a room id (1 .. 2^63-1)", c.cmd->name,
                                   c.args[0]);
        }
    }
    if ((strcmp(c.cmd->name, "fence") == 0 || strcmp(c.cmd->name, "node") == 0) && !*c.args[0]) {
        return cli_usage_error(&c, "%s: empty node id", c.cmd->name);
    }
    if (!c.tls_ca && (c.tls_cert || c.tls_key || c.tls_name)) {
        return cli_usage_error(&c, "--tls-cert, --tls-key and --tls-server-name need --tls-ca "
                                   "(or KVFENCE_CACERT)");
    }
    if (!c.tls_cert != !c.tls_key) {
        return cli_usage_error(&c, "--tls-cert and --tls-key go together (KVFENCE_CERT, "
                                   "KVFENCE_KEY)");
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
