/*
 * reflection.c: gRPC server reflection over an embedded FileDescriptorSet.
 *
 * kvf_reflection_create() copies the set once and walks its top-level entries
 * (field 1, length-delimited: one FileDescriptorProto each) by hand, so that
 * every file keeps the exact bytes protoc wrote; those bytes are what clients
 * get. Each entry is also unpacked with the protobuf-c code generated from
 * descriptor.proto to learn its name, its imports and the symbols it defines.
 * The symbols go into one array sorted by name (binary search at request
 * time); imports are resolved to file indexes once, so a request only walks
 * integers to collect a file's transitive imports.
 *
 * kvf_reflection_handle() decodes one ServerReflectionRequest, builds the
 * response on the stack and in a few short-lived arrays that point into the
 * index and into the decoded request (nothing is copied), packs it into one
 * malloc'd buffer and frees the scaffolding. The v1alpha generated messages
 * serve v1 too: the two protos differ only in their package name, which never
 * reaches the wire.
 *
 * DESIGN: the index is written only inside create and read-only afterwards,
 * so handle() takes no lock and may run on any number of RPC threads at once.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/reflection/v1alpha/reflection.pb-c.h"
#include "health.h"
#include "kvf_error.h"
#include "reflection.h"
#include "kvf_log.h"

typedef Grpc__Reflection__V1alpha__ServerReflectionRequest refl_request;
typedef Grpc__Reflection__V1alpha__ServerReflectionResponse refl_response;
typedef Google__Protobuf__FileDescriptorProto file_proto;
typedef Google__Protobuf__DescriptorProto message_proto;
typedef Google__Protobuf__EnumDescriptorProto enum_proto;
typedef Google__Protobuf__FieldDescriptorProto field_proto;

#define REQ_CASE(x)  GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_##x
#define RESP_CASE(x) GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_##x

/* Deepest message nesting indexed; deeper is a hostile set, not a real one. */
#define REFL_MAX_DEPTH 64

enum refl_kind {
    REFL_MESSAGE,
    REFL_ENUM,
    REFL_OTHER, /* fields, enum values, services, methods, extensions */
};

struct refl_file {
    const uint8_t *bytes; /* into kvf_reflection.set */
    size_t len;
    file_proto *proto;
    size_t *deps; /* indexes of the imports that are in the set */
    size_t n_deps;
};

struct refl_symbol {
    char *name; /* fully qualified, no leading '.' */
    size_t file;
    enum refl_kind kind;
};

struct refl_extension {
    const char *extendee; /* into the parsed proto, leading '.' skipped */
    int32_t number;
    size_t file;
};

struct kvf_reflection {
    uint8_t *set;
    struct refl_file *files;
    size_t n_files;
    struct refl_symbol *syms;
    size_t n_syms, cap_syms;
    struct refl_extension *exts;
    size_t n_exts, cap_exts;
    char **services;
    size_t n_services;
};

static void refl_log(const char *what)
{
    kvf_log("error", "kvfence introspect: reflection: %s", what);
}

/* ---- the descriptor set ---------------------------------------------- */

static int read_varint(const uint8_t *p, size_t len, size_t *pos, uint64_t *v_p)
{
    uint64_t v = 0;
    for (unsigned shift = 0; shift < 64; shift += 7) {
        if (*pos >= len)
            return -EINVAL;
        uint8_t b = p[(*pos)++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v_p = v;
            return 0;
        }
    }
    return -EINVAL;
}

static int skip_field(const uint8_t *p, size_t len, size_t *pos, unsigned wire_type)
{
    uint64_t v;
    switch (wire_type) {
    case 0:
        return read_varint(p, len, pos, &v);
    case 1:
        v = 8;
        break;
    case 2:
        if (read_varint(p, len, pos, &v) != 0)
            return -EINVAL;
        break;
    case 5:
        v = 4;
        break;
    default:
        return -EINVAL;
    }
    if (v > len - *pos)
        return -EINVAL;
    *pos += v;
    return 0;
}

static int add_file(struct kvf_reflection *refl, size_t *cap, const uint8_t *bytes, size_t len)
{
    if (refl->n_files == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        struct refl_file *nf = realloc(refl->files, ncap * sizeof(*nf));
        if (!nf)
            return -ENOMEM;
        refl->files = nf;
        *cap = ncap;
    }
    file_proto *fp = google__protobuf__file_descriptor_proto__unpack(NULL, len, bytes);
    if (!fp) {
        refl_log("a FileDescriptorProto in the set does not decode");
        return -EINVAL;
    }
    if (!fp->name || !fp->name[0]) {
        refl_log("a FileDescriptorProto in the set has no name");
        google__protobuf__file_descriptor_proto__free_unpacked(fp, NULL);
        return -EINVAL;
    }
    refl->files[refl->n_files++] = (struct refl_file){.bytes = bytes, .len = len, .proto = fp};
    return 0;
}

static int parse_set(struct kvf_reflection *refl, size_t len)
{
    const uint8_t *p = refl->set;
    size_t pos = 0, cap = 0;
    while (pos < len) {
        uint64_t key, flen;
        if (read_varint(p, len, &pos, &key) != 0)
            goto err_malformed;
        if (key >> 3 != 1 || (key & 7) != 2) {
            if (skip_field(p, len, &pos, key & 7) != 0)
                goto err_malformed;
            continue;
        }
        if (read_varint(p, len, &pos, &flen) != 0 || flen > len - pos)
            goto err_malformed;
        int rc = add_file(refl, &cap, p + pos, flen);
        if (rc != 0)
            return rc;
        pos += flen;
    }
    return 0;

err_malformed:
    refl_log("the descriptor set is not a valid FileDescriptorSet");
    return -EINVAL;
}

static long find_file(const struct kvf_reflection *refl, const char *name)
{
    for (size_t i = 0; i < refl->n_files; i++)
        if (strcmp(refl->files[i].proto->name, name) == 0)
            return (long)i;
    return -1;
}

static int resolve_deps(struct kvf_reflection *refl)
{
    for (size_t i = 0; i < refl->n_files; i++) {
        struct refl_file *f = &refl->files[i];
        for (size_t j = 0; j < i; j++) {
            if (strcmp(refl->files[j].proto->name, f->proto->name) == 0) {
                kvf_log("error", "kvfence introspect: reflection: %s is twice in the set",
                        f->proto->name);
                return -EINVAL;
            }
        }
        if (f->proto->n_dependency == 0)
            continue;
        f->deps = malloc(f->proto->n_dependency * sizeof(*f->deps));
        if (!f->deps)
            return -ENOMEM;
        for (size_t d = 0; d < f->proto->n_dependency; d++) {
            long idx = find_file(refl, f->proto->dependency[d]);
            if (idx < 0) {
                /* Served without it; a client asking for it gets NOT_FOUND. */
                kvf_log("error",
                        "kvfence introspect: reflection: %s imports %s, which is not in the "
                        "set (build it with --include_imports)",
                        f->proto->name, f->proto->dependency[d]);
                continue;
            }
            f->deps[f->n_deps++] = (size_t)idx;
        }
    }
    return 0;
}

/* ---- the symbol index ------------------------------------------------- */

/* Adds "scope<sep>name" (or just "name" when scope is empty). */
static int add_symbol(struct kvf_reflection *refl, const char *scope, char sep, const char *name,
                      size_t file, enum refl_kind kind)
{
    if (!name || !name[0])
        return 0;
    if (refl->n_syms == refl->cap_syms) {
        size_t ncap = refl->cap_syms ? refl->cap_syms * 2 : 64;
        struct refl_symbol *ns = realloc(refl->syms, ncap * sizeof(*ns));
        if (!ns)
            return -ENOMEM;
        refl->syms = ns;
        refl->cap_syms = ncap;
    }
    size_t slen = scope ? strlen(scope) : 0, nlen = strlen(name);
    char *full = malloc(slen + 1 + nlen + 1);
    if (!full)
        return -ENOMEM;
    if (slen) {
        memcpy(full, scope, slen);
        full[slen++] = sep;
    }
    memcpy(full + slen, name, nlen + 1);
    refl->syms[refl->n_syms++] = (struct refl_symbol){.name = full, .file = file, .kind = kind};
    return 0;
}

static int index_extension(struct kvf_reflection *refl, const char *scope, const field_proto *fd,
                           size_t file)
{
    int rc = add_symbol(refl, scope, '.', fd->name, file, REFL_OTHER);
    if (rc != 0 || !fd->extendee || !fd->has_number)
        return rc;
    if (refl->n_exts == refl->cap_exts) {
        size_t ncap = refl->cap_exts ? refl->cap_exts * 2 : 16;
        struct refl_extension *ne = realloc(refl->exts, ncap * sizeof(*ne));
        if (!ne)
            return -ENOMEM;
        refl->exts = ne;
        refl->cap_exts = ncap;
    }
    const char *extendee = fd->extendee[0] == '.' ? fd->extendee + 1 : fd->extendee;
    refl->exts[refl->n_exts++] =
        (struct refl_extension){.extendee = extendee, .number = fd->number, .file = file};
    return 0;
}

static int index_enum(struct kvf_reflection *refl, const char *scope, const enum_proto *ed,
                      size_t file)
{
    if (!ed->name || !ed->name[0])
        return -EINVAL;
    int rc = add_symbol(refl, scope, '.', ed->name, file, REFL_ENUM);
    if (rc != 0)
        return rc;
    const char *full = refl->syms[refl->n_syms - 1].name;
    for (size_t i = 0; i < ed->n_value && rc == 0; i++) {
        /* protobuf puts enum values next to their enum ("pkg.VALUE"); some
         * clients ask for "pkg.Enum.VALUE": answer both. */
        rc = add_symbol(refl, scope, '.', ed->value[i]->name, file, REFL_OTHER);
        if (rc == 0)
            rc = add_symbol(refl, full, '.', ed->value[i]->name, file, REFL_OTHER);
    }
    return rc;
}

static int index_message(struct kvf_reflection *refl, const char *scope, const message_proto *md,
                         size_t file, unsigned depth)
{
    if (depth > REFL_MAX_DEPTH || !md->name || !md->name[0])
        return -EINVAL;
    int rc = add_symbol(refl, scope, '.', md->name, file, REFL_MESSAGE);
    if (rc != 0)
        return rc;
    /* refl->syms may move while we add, the string it points to does not. */
    const char *full = refl->syms[refl->n_syms - 1].name;
    for (size_t i = 0; i < md->n_field && rc == 0; i++)
        rc = add_symbol(refl, full, '.', md->field[i]->name, file, REFL_OTHER);
    for (size_t i = 0; i < md->n_oneof_decl && rc == 0; i++)
        rc = add_symbol(refl, full, '.', md->oneof_decl[i]->name, file, REFL_OTHER);
    for (size_t i = 0; i < md->n_enum_type && rc == 0; i++)
        rc = index_enum(refl, full, md->enum_type[i], file);
    for (size_t i = 0; i < md->n_extension && rc == 0; i++)
        rc = index_extension(refl, full, md->extension[i], file);
    for (size_t i = 0; i < md->n_nested_type && rc == 0; i++)
        rc = index_message(refl, full, md->nested_type[i], file, depth + 1);
    return rc;
}

static int index_file(struct kvf_reflection *refl, size_t file)
{
    const file_proto *fp = refl->files[file].proto;
    const char *pkg = fp->package ? fp->package : "";
    int rc = 0;
    for (size_t i = 0; i < fp->n_message_type && rc == 0; i++)
        rc = index_message(refl, pkg, fp->message_type[i], file, 0);
    for (size_t i = 0; i < fp->n_enum_type && rc == 0; i++)
        rc = index_enum(refl, pkg, fp->enum_type[i], file);
    for (size_t i = 0; i < fp->n_extension && rc == 0; i++)
        rc = index_extension(refl, pkg, fp->extension[i], file);
    for (size_t i = 0; i < fp->n_service && rc == 0; i++) {
        const Google__Protobuf__ServiceDescriptorProto *sd = fp->service[i];
        if (!sd->name || !sd->name[0])
            return -EINVAL;
        rc = add_symbol(refl, pkg, '.', sd->name, file, REFL_OTHER);
        if (rc != 0)
            break;
        const char *svc = refl->syms[refl->n_syms - 1].name;
        for (size_t m = 0; m < sd->n_method && rc == 0; m++) {
            /* add_symbol may move syms, but not the strings they point to. */
            rc = add_symbol(refl, svc, '.', sd->method[m]->name, file, REFL_OTHER);
            if (rc == 0)
                rc = add_symbol(refl, svc, '/', sd->method[m]->name, file, REFL_OTHER);
        }
    }
    return rc;
}

/* By name; among equal names the earlier file first, so that it wins. */
static int symbol_cmp(const void *a, const void *b)
{
    const struct refl_symbol *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c != 0)
        return c;
    return (x->file > y->file) - (x->file < y->file);
}

static void sort_symbols(struct kvf_reflection *refl)
{
    if (refl->n_syms == 0)
        return;
    qsort(refl->syms, refl->n_syms, sizeof(*refl->syms), symbol_cmp);
    size_t out = 1;
    for (size_t i = 1; i < refl->n_syms; i++) {
        if (strcmp(refl->syms[i].name, refl->syms[out - 1].name) == 0) {
            free(refl->syms[i].name);
            continue;
        }
        refl->syms[out++] = refl->syms[i];
    }
    refl->n_syms = out;
}

static const struct refl_symbol *find_symbol(const struct kvf_reflection *refl, const char *name)
{
    if (name[0] == '.')
        name++;
    size_t lo = 0, hi = refl->n_syms;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, refl->syms[mid].name);
        if (c == 0)
            return &refl->syms[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* ---- services ---------------------------------------------------------- */

static int add_service(struct kvf_reflection *refl, const char *name)
{
    for (size_t i = 0; i < refl->n_services; i++)
        if (strcmp(refl->services[i], name) == 0)
            return 0;
    char *copy = strdup(name);
    if (!copy)
        return -ENOMEM;
    refl->services[refl->n_services++] = copy;
    return 0;
}

static int set_services(struct kvf_reflection *refl, const char *const *names, size_t n)
{
    static const char *const builtin[] = {KVF_REFLECTION_SERVICE_V1ALPHA, KVF_REFLECTION_SERVICE_V1,
                                          KVF_HEALTH_SERVICE};
    size_t n_builtin = sizeof(builtin) / sizeof(builtin[0]);
    refl->services = calloc(n + n_builtin, sizeof(*refl->services));
    if (!refl->services)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        if (!names[i] || !names[i][0]) {
            refl_log("a service name is NULL or empty");
            return -EINVAL;
        }
        int rc = add_service(refl, names[i]);
        if (rc != 0)
            return rc;
    }
    for (size_t i = 0; i < n_builtin; i++) {
        int rc = add_service(refl, builtin[i]);
        if (rc != 0)
            return rc;
    }
    return 0;
}

/* ---- create and destroy ------------------------------------------------ */

struct kvf_reflection *kvf_reflection_create(const uint8_t *descriptor_set, size_t len,
                                             const char *const *service_names, size_t n)
{
    if ((!descriptor_set && len) || (!service_names && n)) {
        refl_log("invalid arguments");
        return NULL;
    }
    struct kvf_reflection *refl = calloc(1, sizeof(*refl));
    if (!refl)
        goto err_nomem;
    refl->set = malloc(len ? len : 1);
    if (!refl->set)
        goto err_nomem;
    if (len)
        memcpy(refl->set, descriptor_set, len);

    int rc = parse_set(refl, len);
    if (rc == 0)
        rc = resolve_deps(refl);
    for (size_t i = 0; i < refl->n_files && rc == 0; i++) {
        rc = index_file(refl, i);
        if (rc == -EINVAL)
            kvf_log("error",
                    "kvfence introspect: reflection: %s has a nameless or too deeply "
                    "nested definition",
                    refl->files[i].proto->name);
    }
    if (rc == 0)
        rc = set_services(refl, service_names, n);
    if (rc == -ENOMEM)
        goto err_nomem;
    if (rc != 0)
        goto err_destroy;
    sort_symbols(refl);
    return refl;

err_nomem:
    refl_log("out of memory building the index");
err_destroy:
    kvf_reflection_destroy(refl);
    return NULL;
}

void kvf_reflection_destroy(struct kvf_reflection *refl)
{
    if (!refl)
        return;
    for (size_t i = 0; i < refl->n_files; i++) {
        google__protobuf__file_descriptor_proto__free_unpacked(refl->files[i].proto, NULL);
        free(refl->files[i].deps);
    }
    free(refl->files);
    for (size_t i = 0; i < refl->n_syms; i++)
        free(refl->syms[i].name);
    free(refl->syms);
    free(refl->exts);
    for (size_t i = 0; i < refl->n_services; i++)
        free(refl->services[i]);
    free(refl->services);
    free(refl->set);
    free(refl);
}

/* ---- requests --------------------------------------------------------- */

/* What one response points at; freed by reply_release(). */
struct reply {
    Grpc__Reflection__V1alpha__FileDescriptorResponse fdr;
    Grpc__Reflection__V1alpha__ExtensionNumberResponse enr;
    Grpc__Reflection__V1alpha__ListServiceResponse lsr;
    Grpc__Reflection__V1alpha__ErrorResponse err;
    Grpc__Reflection__V1alpha__ServiceResponse *svcs;
    char msg[512];
};

static void reply_init(struct reply *r)
{
    memset(r, 0, sizeof(*r));
    grpc__reflection__v1alpha__file_descriptor_response__init(&r->fdr);
    grpc__reflection__v1alpha__extension_number_response__init(&r->enr);
    grpc__reflection__v1alpha__list_service_response__init(&r->lsr);
    grpc__reflection__v1alpha__error_response__init(&r->err);
}

static void reply_release(struct reply *r)
{
    free(r->fdr.file_descriptor_proto);
    free(r->enr.extension_number);
    free(r->lsr.service);
    free(r->svcs);
}

static void answer_error(refl_response *rs, struct reply *r, enum kvf_grpc_code code,
                         const char *fmt, const char *what)
{
    snprintf(r->msg, sizeof(r->msg), fmt, what);
    r->err.error_code = (int32_t)code;
    r->err.error_message = r->msg;
    rs->message_response_case = RESP_CASE(ERROR_RESPONSE);
    rs->error_response = &r->err;
}

/* `file`, then its transitive imports, each once, breadth first. */
static int answer_files(const struct kvf_reflection *refl, refl_response *rs, struct reply *r,
                        size_t file)
{
    size_t *order = malloc(refl->n_files * sizeof(*order));
    bool *seen = calloc(refl->n_files, sizeof(*seen));
    ProtobufCBinaryData *out = calloc(refl->n_files, sizeof(*out));
    if (!order || !seen || !out) {
        free(order);
        free(seen);
        free(out);
        return -ENOMEM;
    }
    size_t n = 0;
    order[n++] = file;
    seen[file] = true;
    for (size_t i = 0; i < n; i++) {
        const struct refl_file *f = &refl->files[order[i]];
        out[i].data = (uint8_t *)f->bytes;
        out[i].len = f->len;
        for (size_t d = 0; d < f->n_deps; d++) {
            if (!seen[f->deps[d]]) {
                seen[f->deps[d]] = true;
                order[n++] = f->deps[d];
            }
        }
    }
    free(order);
    free(seen);
    r->fdr.n_file_descriptor_proto = n;
    r->fdr.file_descriptor_proto = out;
    rs->message_response_case = RESP_CASE(FILE_DESCRIPTOR_RESPONSE);
    rs->file_descriptor_response = &r->fdr;
    return 0;
}

static int answer_list_services(const struct kvf_reflection *refl, refl_response *rs,
                                struct reply *r)
{
    r->svcs = calloc(refl->n_services, sizeof(*r->svcs));
    r->lsr.service = calloc(refl->n_services, sizeof(*r->lsr.service));
    if (!r->svcs || !r->lsr.service)
        return -ENOMEM;
    for (size_t i = 0; i < refl->n_services; i++) {
        grpc__reflection__v1alpha__service_response__init(&r->svcs[i]);
        r->svcs[i].name = refl->services[i];
        r->lsr.service[i] = &r->svcs[i];
    }
    r->lsr.n_service = refl->n_services;
    rs->message_response_case = RESP_CASE(LIST_SERVICES_RESPONSE);
    rs->list_services_response = &r->lsr;
    return 0;
}

static int answer_extension_numbers(const struct kvf_reflection *refl, refl_response *rs,
                                    struct reply *r, char *type)
{
    const struct refl_symbol *sym = find_symbol(refl, type);
    if (!sym || sym->kind != REFL_MESSAGE) {
        answer_error(rs, r, KVF_GRPC_NOT_FOUND, "message type not found: %s", type);
        return 0;
    }
    if (refl->n_exts) {
        r->enr.extension_number = calloc(refl->n_exts, sizeof(*r->enr.extension_number));
        if (!r->enr.extension_number)
            return -ENOMEM;
    }
    for (size_t i = 0; i < refl->n_exts; i++)
        if (strcmp(refl->exts[i].extendee, sym->name) == 0)
            r->enr.extension_number[r->enr.n_extension_number++] = refl->exts[i].number;
    r->enr.base_type_name = sym->name;
    rs->message_response_case = RESP_CASE(ALL_EXTENSION_NUMBERS_RESPONSE);
    rs->all_extension_numbers_response = &r->enr;
    return 0;
}

static int answer_extension(const struct kvf_reflection *refl, refl_response *rs, struct reply *r,
                            const Grpc__Reflection__V1alpha__ExtensionRequest *er)
{
    const char *type = er && er->containing_type ? er->containing_type : "";
    if (type[0] == '.')
        type++;
    for (size_t i = 0; er && i < refl->n_exts; i++)
        if (refl->exts[i].number == er->extension_number &&
            strcmp(refl->exts[i].extendee, type) == 0)
            return answer_files(refl, rs, r, refl->exts[i].file);
    char what[300];
    snprintf(what, sizeof(what), "%s (number %d)", type, er ? (int)er->extension_number : 0);
    answer_error(rs, r, KVF_GRPC_NOT_FOUND, "extension not found: %s", what);
    return 0;
}

static int answer(const struct kvf_reflection *refl, const refl_request *rq, refl_response *rs,
                  struct reply *r)
{
    switch (rq->message_request_case) {
    case REQ_CASE(LIST_SERVICES):
        return answer_list_services(refl, rs, r);
    case REQ_CASE(FILE_BY_FILENAME): {
        long idx = find_file(refl, rq->file_by_filename);
        if (idx < 0) {
            answer_error(rs, r, KVF_GRPC_NOT_FOUND, "file not found: %s", rq->file_by_filename);
            return 0;
        }
        return answer_files(refl, rs, r, (size_t)idx);
    }
    case REQ_CASE(FILE_CONTAINING_SYMBOL): {
        const struct refl_symbol *sym = find_symbol(refl, rq->file_containing_symbol);
        if (!sym) {
            answer_error(rs, r, KVF_GRPC_NOT_FOUND, "symbol not found: %s",
                         rq->file_containing_symbol);
            return 0;
        }
        return answer_files(refl, rs, r, sym->file);
    }
    case REQ_CASE(FILE_CONTAINING_EXTENSION):
        return answer_extension(refl, rs, r, rq->file_containing_extension);
    case REQ_CASE(ALL_EXTENSION_NUMBERS_OF_TYPE):
        return answer_extension_numbers(refl, rs, r, rq->all_extension_numbers_of_type);
    default:
        answer_error(rs, r, KVF_GRPC_UNIMPLEMENTED, "%s",
                     "no request set, or one this server does not know");
        return 0;
    }
}

int kvf_reflection_handle(const struct kvf_reflection *refl, const uint8_t *req, size_t len,
                          uint8_t **resp_p, size_t *resp_len_p)
{
    if (!refl || (!req && len) || !resp_p || !resp_len_p)
        return -EINVAL;
    static const uint8_t empty[1];
    refl_request *rq =
        grpc__reflection__v1alpha__server_reflection_request__unpack(NULL, len, req ? req : empty);
    if (!rq)
        return -EINVAL;

    refl_response rs = GRPC__REFLECTION__V1ALPHA__SERVER_REFLECTION_RESPONSE__INIT;
    rs.valid_host = rq->host;
    rs.original_request = rq;
    struct reply r;
    reply_init(&r);
    int rc = answer(refl, rq, &rs, &r);
    if (rc != 0)
        goto out;

    size_t size = grpc__reflection__v1alpha__server_reflection_response__get_packed_size(&rs);
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) {
        rc = -ENOMEM;
        goto out;
    }
    grpc__reflection__v1alpha__server_reflection_response__pack(&rs, buf);
    *resp_p = buf;
    *resp_len_p = size;

out:
    reply_release(&r);
    grpc__reflection__v1alpha__server_reflection_request__free_unpacked(rq, NULL);
    return rc;
}
