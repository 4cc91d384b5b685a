/*
 * cli.c: the helpers the kvfence CLI's commands share (cli.h): unary and
 * paged calls with their exit codes, printing a reply (or the pages of a
 * listing merged into one reply) as JSON / YAML, tables, and the cells
 * several commands print (tokens, leases).
 */
#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvf_error.h"
#include "kvfence/v1/control.pb-c.h"
#include "rpc_client.h"

const char *const cli_progname = "kvfence";

int cli_usage_error(const struct cli *c, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", cli_progname);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (c != NULL && c->cmd != NULL && c->cmd->help != NULL) {
        fprintf(stderr, "\n\n%s\nGlobal flags and exit codes: kvfence help\n", c->cmd->help);
    } else {
        fprintf(stderr, "\nTry '%s help'.\n", cli_progname);
    }
    return EXIT_USAGE;
}

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

int cli_report_status(const struct kvf_rpc_status *st)
{
    fprintf(stderr, "%s: %s: %s\n", cli_progname, kvf_grpc_code_name(st->code),
            st->message[0] ? st->message : "(no message)");
    return exit_for_code(st->code);
}

int cli_call(struct cli *c, const char *full_method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p)
{
    size_t len = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        fprintf(stderr, "%s: out of memory\n", cli_progname);
        return EXIT_SERVER;
    }
    protobuf_c_message_pack(req, buf);
    uint8_t *resp = NULL;
    size_t resp_len = 0;
    struct kvf_rpc_status st = {0};
    int rc = kvf_rpc_unary(c->ch, full_method, buf, len, c->timeout_ms, &resp, &resp_len, &st);
    free(buf);
    if (rc != 0) {
        free(resp);
        if (st.code == KVF_GRPC_OK) {
            st.code = KVF_GRPC_INTERNAL;
            snprintf(st.message, sizeof st.message, "call failed (%s)", strerror(-rc));
        }
        return cli_report_status(&st);
    }
    *resp_p = protobuf_c_message_unpack(rd, NULL, resp_len, resp);
    free(resp);
    if (!*resp_p) {
        fprintf(stderr, "%s: %s: undecodable reply\n", cli_progname, full_method);
        return EXIT_SERVER;
    }
    return EXIT_OK;
}

void cli_pages_free(struct cli_pages *pg)
{
    for (size_t i = 0; i < pg->n; i++) {
        protobuf_c_message_free_unpacked(pg->v[i], NULL);
    }
    free(pg->v);
    pg->v = NULL;
    pg->n = 0;
}

int cli_call_paged(struct cli *c, const char *method, const ProtobufCMessage *req,
                   char **page_token, const ProtobufCMessageDescriptor *rd, struct cli_pages *pg)
{
    const ProtobufCFieldDescriptor *next_fd =
        protobuf_c_message_descriptor_get_field_by_name(rd, "next_page_token");
    if (next_fd == NULL || next_fd->type != PROTOBUF_C_TYPE_STRING) {
        fprintf(stderr, "%s: %s: not a paged reply\n", cli_progname, method);
        return EXIT_SERVER;
    }
    char full[128];
    snprintf(full, sizeof full, "/kvfence.v1.Admin/%s", method);
    *page_token = "";
    for (;;) {
        ProtobufCMessage *m = NULL;
        int rc = cli_call(c, full, req, rd, &m);
        if (rc != EXIT_OK) {
            return rc;
        }
        ProtobufCMessage **v = realloc(pg->v, (pg->n + 1) * sizeof *v);
        if (!v) {
            protobuf_c_message_free_unpacked(m, NULL);
            fprintf(stderr, "%s: out of memory\n", cli_progname);
            return EXIT_SERVER;
        }
        v[pg->n++] = m;
        pg->v = v;
        /* Points into the page just kept, which lives until cli_pages_free. */
        char *next = *(char **)((char *)m + next_fd->offset);
        if (!next || !*next) {
            return EXIT_OK;
        }
        *page_token = next;
    }
}

int cli_call_view(struct cli *c, const char *full_method, const ProtobufCMessage *req,
                  const ProtobufCMessageDescriptor *rd, ProtobufCMessage **resp_p)
{
    ProtobufCMessage *m = NULL;
    int rc = cli_call(c, full_method, req, rd, &m);
    if (rc != EXIT_OK) {
        return rc;
    }
    if (cli_doc(c)) {
        rc = cli_print_doc(c, m, NULL);
        protobuf_c_message_free_unpacked(m, NULL);
        return rc;
    }
    *resp_p = m;
    return EXIT_OK;
}

int cli_call_paged_view(struct cli *c, const char *method, const ProtobufCMessage *req,
                        char **page_token, const ProtobufCMessageDescriptor *rd, const char *field,
                        struct cli_pages *pg)
{
    int rc = cli_call_paged(c, method, req, page_token, rd, pg);
    if (rc == EXIT_OK && cli_doc(c)) {
        rc = cli_print_pages(c, pg, field);
    }
    return rc;
}

int cli_print_doc(const struct cli *c, const ProtobufCMessage *m, const struct cli_pb_extra *extra)
{
    enum cli_pb_form form = c->form == CLI_FORM_YAML ? CLI_PB_YAML : CLI_PB_JSON;
    if (cli_pb_print(stdout, m, form, extra) != 0) {
        fprintf(stderr, "%s: cannot write the output\n", cli_progname);
        return EXIT_SERVER;
    }
    return EXIT_OK;
}

/*
 * One reply of the listing's type whose repeated `field` holds every page's
 * items (pointers into the pages), printed like any reply; its
 * next_page_token stays empty.
 */
int cli_print_pages(const struct cli *c, const struct cli_pages *pg, const char *field)
{
    if (pg->n == 0) {
        return EXIT_SERVER;
    }
    const ProtobufCMessageDescriptor *d = pg->v[0]->descriptor;
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field_by_name(d, field);
    if (fd == NULL || fd->label != PROTOBUF_C_LABEL_REPEATED ||
        fd->type != PROTOBUF_C_TYPE_MESSAGE) {
        fprintf(stderr, "%s: %s has no list %s\n", cli_progname, d->name, field);
        return EXIT_SERVER;
    }
    size_t total = 0;
    for (size_t p = 0; p < pg->n; p++) {
        total += *(size_t *)((char *)pg->v[p] + fd->quantifier_offset);
    }
    ProtobufCMessage *all = calloc(1, d->sizeof_message);
    ProtobufCMessage **items = calloc(total ? total : 1, sizeof *items);
    if (!all || !items) {
        free(all);
        free(items);
        fprintf(stderr, "%s: out of memory\n", cli_progname);
        return EXIT_SERVER;
    }
    d->message_init(all);
    size_t k = 0;
    for (size_t p = 0; p < pg->n; p++) {
        size_t n = *(size_t *)((char *)pg->v[p] + fd->quantifier_offset);
        ProtobufCMessage **v = *(ProtobufCMessage ***)((char *)pg->v[p] + fd->offset);
        for (size_t i = 0; i < n; i++) {
            items[k++] = v[i];
        }
    }
    *(size_t *)((char *)all + fd->quantifier_offset) = total;
    *(ProtobufCMessage ***)((char *)all + fd->offset) = items;
    int rc = cli_print_doc(c, all, NULL);
    free(items);
    free(all); /* its strings are the descriptor's defaults, not ours */
    return rc;
}

int cli_finish_table(const struct cli *c, struct cli_table *t)
{
    if (c->no_headers) {
        t->headers[0] = NULL;
    }
    int rc = cli_table_print(t, stdout);
    cli_table_free(t);
    if (rc != 0) {
        fprintf(stderr, "%s: out of memory\n", cli_progname);
        return EXIT_SERVER;
    }
    return EXIT_OK;
}

const char *cli_enum_name(const ProtobufCEnumDescriptor *d, const char *prefix, int v, char *buf,
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

const char *cli_fmt_token(const Kvfence__V1__AbortToken *t, char *buf, size_t len)
{
    if (!t) {
        snprintf(buf, len, "-");
    } else {
        snprintf(buf, len, "%016" PRIx64 "%016" PRIx64, t->hi, t->lo);
    }
    return buf;
}

uint64_t cli_lease_pages(const Kvfence__V1__Lease *l)
{
    uint64_t n = 0;
    for (size_t i = 0; l && i < l->n_ranges; i++) {
        n += l->ranges[i]->count;
    }
    return n;
}

const char *cli_lease_state_cell(const Kvfence__V1__Lease *l, char *buf, size_t len)
{
    char nb[64];
    const char *name = cli_enum_name(&kvfence__v1__lease_state__descriptor, "LEASE_STATE_",
                                     l ? (int)l->state : 0, nb, sizeof nb);
    snprintf(buf, len, "%s%s", name, l && l->awaiting_host_proof ? " (waits for host proof)" : "");
    return buf;
}

void cli_fmt_ranges(const Kvfence__V1__Lease *l, char *buf, size_t len)
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
