/*
 * cli.h: what the kvfence CLI's files share (docs/cli.md): the parsed command
 * line (struct cli), the command table's row (struct cli_command), the exit
 * codes, and the helpers every command uses to call the control plane and
 * print. kvfence.c parses the line and dispatches; cmd_views.c holds the
 * read-only commands (nodes, node, rooms, room, leases, stats), cmd_actions.c
 * the others (abort, fence, watch, health); completion.c writes the shell
 * completion scripts from the command table. Single-threaded.
 */
#ifndef KVF_CLI_CLI_H
#define KVF_CLI_CLI_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "output.h"
#include "pbjson.h"

enum {
    EXIT_OK = 0,
    EXIT_SERVER = 1,
    EXIT_USAGE = 2,
    EXIT_UNREACHABLE = 3,
    EXIT_NOT_FOUND = 4,
};

#define CLI_MAX_STATES 8

enum cli_form {
    CLI_FORM_TABLE,
    CLI_FORM_WIDE, /* tables with more columns */
    CLI_FORM_JSON,
    CLI_FORM_YAML,
};

enum cli_opt_id {
    O_SERVER = 1,
    O_TLS_CA,
    O_TLS_CERT,
    O_TLS_KEY,
    O_TLS_NAME,
    O_TIMEOUT,
    O_OUTPUT,
    O_NO_HEADERS,
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
    O_SERVICE,
};

struct cli_opt {
    const char *name; /* long name without "--" */
    char shortc;      /* 0: none */
    bool has_arg;
    enum cli_opt_id id;
};

struct cli;

struct cli_command {
    const char *name;
    size_t min_args, max_args;
    const char *arg_names;      /* for the global help: "ID", "NODE", "" */
    const struct cli_opt *opts; /* ends with a NULL name */
    const char *summary;        /* one line for the global help */
    const char *help;           /* the command's own help */
    int (*run)(struct cli *c);  /* NULL: runs without a server (help, completion) */
};

struct kvf_rpc_channel;

struct cli {
    const char *server;
    const char *tls_ca;
    const char *tls_cert;
    const char *tls_key;
    const char *tls_name;
    int64_t timeout_ms;
    enum cli_form form;
    bool no_headers;
    const struct cli_command *cmd;
    const char *args[4]; /* positional arguments after the command */
    size_t nargs;
    /* command options */
    int states[CLI_MAX_STATES];
    size_t nstates;
    const char *node;
    uint64_t min_age_ms;
    uint64_t generation;
    uint64_t room_id;
    const char *reason;
    const char *service; /* health --service */
    bool room_states;
    uint64_t count; /* 0: unlimited */
    struct kvf_rpc_channel *ch;
};

extern const char *const cli_progname;

/* The command table (kvfence.c) and its length. */
extern const struct cli_command cli_commands[];
extern const size_t cli_command_count;
extern const struct cli_opt cli_global_opts[];

/* Whether the output is a document (JSON or YAML), not a table. */
static inline bool cli_doc(const struct cli *c)
{
    return c->form == CLI_FORM_JSON || c->form == CLI_FORM_YAML;
}

/* Prints "kvfence: <message>" and the command's help (or a pointer to the
 * global help) on stderr; returns EXIT_USAGE. */
int cli_usage_error(const struct cli *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prints "kvfence: CODE: message" and returns the exit code for `code`. */
struct kvf_rpc_status;
int cli_report_status(const struct kvf_rpc_status *st);

/* Calls unary `full_method` ("/pkg.Service/Method"); returns an exit code,
 * and *resp_p (free with protobuf_c_message_free_unpacked) on EXIT_OK. */
int cli_call(struct cli *c, const char *full_method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p);

/* The reply pages of a paged Admin List* call, in order. */
struct cli_pages {
    ProtobufCMessage **v;
    size_t n;
};
void cli_pages_free(struct cli_pages *pg);

/*
 * Calls Admin method `method` until the reply's next_page_token is empty.
 * `page_token` is the request's page_token field. The caller frees *pg, also
 * on error. Returns an exit code.
 */
int cli_call_paged(struct cli *c, const char *method, const ProtobufCMessage *req,
                   char **page_token, const ProtobufCMessageDescriptor *rd, struct cli_pages *pg);

/*
 * Prints the pages as one reply message holding every page's `field` (e.g.
 * "rooms"), in the document form of `c`. Returns an exit code.
 */
int cli_print_pages(const struct cli *c, const struct cli_pages *pg, const char *field);

/*
 * What a view command does first: cli_call(), and in the document forms
 * (cli_doc()) the reply printed and freed here. Returns an exit code; on
 * EXIT_OK in the table forms, *resp_p is the reply for the caller to print as
 * a table and free (in the document forms it is not written: the caller
 * returns when rc != EXIT_OK || cli_doc(c)).
 */
int cli_call_view(struct cli *c, const char *full_method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p);

/*
 * The same for a listing: cli_call_paged(), and in the document forms the
 * pages printed as one reply of `field` (cli_print_pages()). The caller frees
 * *pg, also on error, and prints the table unless rc != EXIT_OK ||
 * cli_doc(c).
 */
int cli_call_paged_view(struct cli *c, const char *method, const ProtobufCMessage *req,
                        char **page_token, const ProtobufCMessageDescriptor *rd, const char *field,
                        struct cli_pages *pg);

/* Prints `m` in the document form of `c` (JSON or YAML). */
int cli_print_doc(const struct cli *c, const ProtobufCMessage *m, const struct cli_pb_extra *extra);

/* Prints and frees a table (headers dropped with --no-headers). */
int cli_finish_table(const struct cli *c, struct cli_table *t);

/* An enum value's proto name without `prefix` ("ACTIVE" for
 * ROOM_STATE_ACTIVE), or its number when unknown. Returns buf. */
const char *cli_enum_name(const ProtobufCEnumDescriptor *d, const char *prefix, int v, char *buf,
                          size_t len);

/* Shared cells. The token as 32 lower-case hex digits (hi, lo), "-" when
 * absent; returns buf. */
struct Kvfence__V1__AbortToken;
struct Kvfence__V1__Lease;
const char *cli_fmt_token(const struct Kvfence__V1__AbortToken *t, char *buf, size_t len);
/* The pages a lease holds. */
uint64_t cli_lease_pages(const struct Kvfence__V1__Lease *l);
/* A lease's state; a RELEASING lease that waits for a proof from its lost
 * node's host says so. Returns buf. */
const char *cli_lease_state_cell(const struct Kvfence__V1__Lease *l, char *buf, size_t len);
/* "0+16,64+8": the ranges as first+count, "-" for none. */
void cli_fmt_ranges(const struct Kvfence__V1__Lease *l, char *buf, size_t len);

#define ROOM_STATE_NAME(v, b) \
    cli_enum_name(&kvfence__v1__room_state__descriptor, "ROOM_STATE_", (v), (b), sizeof(b))
#define NODE_STATE_NAME(v, b) \
    cli_enum_name(&kvfence__v1__node_state__descriptor, "NODE_STATE_", (v), (b), sizeof(b))
#define LEASE_MODE_NAME(v, b) \
    cli_enum_name(&kvfence__v1__lease_mode__descriptor, "LEASE_MODE_", (v), (b), sizeof(b))
#define ROLE_NAME(v, b) cli_enum_name(&kvfence__v1__role__descriptor, "ROLE_", (v), (b), sizeof(b))
#define REASON_NAME(v, b) \
    cli_enum_name(&kvfence__v1__abort_reason__descriptor, "ABORT_REASON_", (v), (b), sizeof(b))
#define ENDPOINT_KIND_NAME(v, b) \
    cli_enum_name(&kvfence__v1__endpoint_kind__descriptor, "ENDPOINT_KIND_", (v), (b), sizeof(b))

/* The commands. */
int cli_cmd_nodes(struct cli *c);
int cli_cmd_node(struct cli *c);
int cli_cmd_rooms(struct cli *c);
int cli_cmd_room(struct cli *c);
int cli_cmd_leases(struct cli *c);
int cli_cmd_stats(struct cli *c);
int cli_cmd_abort(struct cli *c);
int cli_cmd_fence(struct cli *c);
int cli_cmd_watch(struct cli *c);
int cli_cmd_health(struct cli *c);

/* completion.c: writes the script for `shell` ("bash" or "zsh") to stdout;
 * EXIT_USAGE for another shell. */
int cli_completion(const struct cli *c, const char *shell);

#endif /* KVF_CLI_CLI_H */
