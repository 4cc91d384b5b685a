/*
 * pbjson.c: proto3 canonical JSON and YAML for any protobuf-c message
 * (pbjson.h). One walk over the descriptors decides which fields are present
 * and how each value reads (field_present, scalar_text); two small writers
 * lay the values out as JSON (json_message) or block YAML (yaml_message).
 */
#include "pbjson.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>

/* ---- the walk -------------------------------------------------------------- */

/* Whether `fd` of `m` is printed; for a repeated field its length in *n_p. */
static bool field_present(const ProtobufCMessage *m, const ProtobufCFieldDescriptor *fd,
                          size_t *n_p)
{
    const char *base = (const char *)m;
    const void *p = base + fd->offset;
    *n_p = 1;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
        *n_p = *(const size_t *)(base + fd->quantifier_offset);
        return *n_p > 0;
    }
    if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
        /* The member of a oneof that is set is printed, default value or not. */
        return *(const uint32_t *)(base + fd->quantifier_offset) == fd->id;
    }
    if (fd->label == PROTOBUF_C_LABEL_OPTIONAL && fd->quantifier_offset != 0 &&
        fd->type != PROTOBUF_C_TYPE_MESSAGE && fd->type != PROTOBUF_C_TYPE_STRING) {
        return *(const protobuf_c_boolean *)(base + fd->quantifier_offset); /* proto2 has_ */
    }
    if (fd->label == PROTOBUF_C_LABEL_REQUIRED) {
        return true;
    }
    switch (fd->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_ENUM:
        return *(const uint32_t *)p != 0;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return *(const uint64_t *)p != 0;
    case PROTOBUF_C_TYPE_FLOAT:
        return *(const float *)p != 0.0f || signbit(*(const float *)p);
    case PROTOBUF_C_TYPE_DOUBLE:
        return *(const double *)p != 0.0 || signbit(*(const double *)p);
    case PROTOBUF_C_TYPE_BOOL:
        return *(const protobuf_c_boolean *)p != 0;
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        return s != NULL && s[0] != '\0';
    }
    case PROTOBUF_C_TYPE_BYTES:
        return ((const ProtobufCBinaryData *)p)->len > 0;
    case PROTOBUF_C_TYPE_MESSAGE:
        return *(ProtobufCMessage *const *)p != NULL;
    }
    return false;
}

/* The size of one element of a repeated field of `type`. */
static size_t elem_size(ProtobufCType type)
{
    switch (type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return sizeof(uint64_t);
    case PROTOBUF_C_TYPE_DOUBLE:
        return sizeof(double);
    case PROTOBUF_C_TYPE_FLOAT:
        return sizeof(float);
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
        return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(ProtobufCMessage *);
    default:
        return sizeof(uint32_t);
    }
}

/* Element `i` of `fd` (0 for a singular field). */
static const void *field_elem(const ProtobufCMessage *m, const ProtobufCFieldDescriptor *fd,
                              size_t i)
{
    const char *p = (const char *)m + fd->offset;
    if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
        return *(const char *const *)p + i * elem_size(fd->type);
    }
    return p;
}

static bool message_empty(const ProtobufCMessage *m)
{
    for (unsigned i = 0; i < m->descriptor->n_fields; i++) {
        size_t n;
        if (field_present(m, &m->descriptor->fields[i], &n)) {
            return false;
        }
    }
    return true;
}

/* protobuf's ToJsonName: each '_' dropped and the letter after it upper-cased. */
static void json_name(const char *name, char *buf, size_t len)
{
    size_t o = 0;
    bool up = false;
    for (const char *c = name; *c && o + 1 < len; c++) {
        if (*c == '_') {
            up = true;
            continue;
        }
        buf[o++] = up ? (char)toupper((unsigned char)*c) : *c;
        up = false;
    }
    buf[o] = '\0';
}

/* Kinds of scalar text: a JSON number or literal, or a string to quote. */
enum text_kind {
    TEXT_BARE,   /* 42, true, 1.5 */
    TEXT_STRING, /* printed quoted in JSON (and in YAML unless plain-safe) */
    TEXT_QUOTED, /* a string YAML must quote too: 64-bit integers, base64 */
};

/* An integer's decimal text into buf; `kind` says whether it is quoted (the
 * 64-bit ones are, in protobuf's JSON mapping). */
static enum text_kind int_text(int64_t v, enum text_kind kind, char *buf, size_t len)
{
    snprintf(buf, len, "%" PRId64, v);
    return kind;
}

static enum text_kind uint_text(uint64_t v, enum text_kind kind, char *buf, size_t len)
{
    snprintf(buf, len, "%" PRIu64, v);
    return kind;
}

/* The text of a non-message, non-string, non-bytes value into buf. */
static enum text_kind scalar_text(const ProtobufCFieldDescriptor *fd, const void *p, char *buf,
                                  size_t len)
{
    switch (fd->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        return int_text(*(const int32_t *)p, TEXT_BARE, buf, len);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        return uint_text(*(const uint32_t *)p, TEXT_BARE, buf, len);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        return int_text(*(const int64_t *)p, TEXT_QUOTED, buf, len);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return uint_text(*(const uint64_t *)p, TEXT_QUOTED, buf, len);
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_DOUBLE: {
        double d =
            fd->type == PROTOBUF_C_TYPE_FLOAT ? (double)*(const float *)p : *(const double *)p;
        if (isnan(d)) {
            snprintf(buf, len, "NaN");
            return TEXT_QUOTED;
        }
        if (isinf(d)) {
            snprintf(buf, len, "%sInfinity", d < 0 ? "-" : "");
            return TEXT_QUOTED;
        }
        snprintf(buf, len, "%.*g", fd->type == PROTOBUF_C_TYPE_FLOAT ? 9 : 17, d);
        return TEXT_BARE;
    }
    case PROTOBUF_C_TYPE_BOOL:
        snprintf(buf, len, "%s", *(const protobuf_c_boolean *)p ? "true" : "false");
        return TEXT_BARE;
    case PROTOBUF_C_TYPE_ENUM: {
        int v = *(const int *)p;
        const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(
            (const ProtobufCEnumDescriptor *)fd->descriptor, v);
        if (ev == NULL) {
            snprintf(buf, len, "%d", v);
            return TEXT_BARE;
        }
        snprintf(buf, len, "%s", ev->name);
        return TEXT_STRING;
    }
    default:
        buf[0] = '\0';
        return TEXT_STRING;
    }
}

/* The two-character JSON escape of `c`, or NULL for a character that has
 * none (printed as itself, or as \u00XX when it is a control character). */
static const char *json_escape(unsigned char c)
{
    switch (c) {
    case '"':
        return "\\\"";
    case '\\':
        return "\\\\";
    case '\n':
        return "\\n";
    case '\r':
        return "\\r";
    case '\t':
        return "\\t";
    default:
        return NULL;
    }
}

static void put_json_string(FILE *f, const char *s, size_t len)
{
    fputc('"', f);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = json_escape(c);
        if (esc) {
            fputs(esc, f);
        } else if (c < 0x20 || c == 0x7f) {
            fprintf(f, "\\u%04x", c);
        } else {
            fputc(c, f);
        }
    }
    fputc('"', f);
}

static void put_json_cstr(FILE *f, const char *s)
{
    put_json_string(f, s, strlen(s));
}

static void put_base64(FILE *f, const uint8_t *d, size_t len)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    fputc('"', f);
    for (size_t i = 0; i < len; i += 3) {
        uint32_t v = (uint32_t)d[i] << 16;
        if (i + 1 < len) {
            v |= (uint32_t)d[i + 1] << 8;
        }
        if (i + 2 < len) {
            v |= d[i + 2];
        }
        fputc(tab[(v >> 18) & 63], f);
        fputc(tab[(v >> 12) & 63], f);
        fputc(i + 1 < len ? tab[(v >> 6) & 63] : '=', f);
        fputc(i + 2 < len ? tab[v & 63] : '=', f);
    }
    fputc('"', f);
}

/* ---- JSON ------------------------------------------------------------------ */

static void json_message(FILE *f, const ProtobufCMessage *m, const struct cli_pb_extra *extra);

static void json_value(FILE *f, const ProtobufCFieldDescriptor *fd, const void *p)
{
    char buf[64];
    switch (fd->type) {
    case PROTOBUF_C_TYPE_MESSAGE:
        json_message(f, *(ProtobufCMessage *const *)p, NULL);
        return;
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        s = s ? s : "";
        put_json_cstr(f, s);
        return;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *b = p;
        put_base64(f, b->data, b->len);
        return;
    }
    default:
        if (scalar_text(fd, p, buf, sizeof buf) == TEXT_BARE) {
            fputs(buf, f);
        } else {
            put_json_cstr(f, buf);
        }
    }
}

static void json_message(FILE *f, const ProtobufCMessage *m, const struct cli_pb_extra *extra)
{
    bool first = true;
    fputc('{', f);
    if (extra != NULL) {
        put_json_cstr(f, extra->key);
        fputc(':', f);
        put_json_cstr(f, extra->value);
        first = false;
    }
    for (unsigned i = 0; m != NULL && i < m->descriptor->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &m->descriptor->fields[i];
        size_t n;
        if (!field_present(m, fd, &n)) {
            continue;
        }
        char name[128];
        json_name(fd->name, name, sizeof name);
        if (!first) {
            fputc(',', f);
        }
        first = false;
        put_json_cstr(f, name);
        fputc(':', f);
        if (fd->label != PROTOBUF_C_LABEL_REPEATED) {
            json_value(f, fd, field_elem(m, fd, 0));
            continue;
        }
        fputc('[', f);
        for (size_t k = 0; k < n; k++) {
            if (k) {
                fputc(',', f);
            }
            json_value(f, fd, field_elem(m, fd, k));
        }
        fputc(']', f);
    }
    fputc('}', f);
}

/* ---- YAML ------------------------------------------------------------------ */

struct yaml_w {
    FILE *f;
    bool dash; /* the next key opens a list item: "- " in place of its indent */
};

/* A string YAML reads back as that same string without quotes. */
static bool yaml_plain_ok(const char *s)
{
    static const char *const special[] = {"y",  "n",   "yes",   "no",   "true",
                                          "on", "off", "false", "null", NULL};
    if (!isalpha((unsigned char)s[0]) && s[0] != '_' && s[0] != '/') {
        return false;
    }
    for (const char *c = s; *c; c++) {
        if (!isalnum((unsigned char)*c) && !strchr("_.-/", *c)) {
            return false;
        }
    }
    for (size_t i = 0; special[i]; i++) {
        if (strcasecmp(s, special[i]) == 0) {
            return false;
        }
    }
    return true;
}

static void yaml_scalar(FILE *f, const ProtobufCFieldDescriptor *fd, const void *p)
{
    char buf[64];
    const char *s = buf;
    enum text_kind k;
    if (fd->type == PROTOBUF_C_TYPE_STRING) {
        s = *(char *const *)p ? *(char *const *)p : "";
        k = TEXT_STRING;
    } else if (fd->type == PROTOBUF_C_TYPE_BYTES) {
        const ProtobufCBinaryData *b = p;
        put_base64(f, b->data, b->len);
        return;
    } else {
        k = scalar_text(fd, p, buf, sizeof buf);
    }
    if (k == TEXT_BARE || (k == TEXT_STRING && yaml_plain_ok(s))) {
        fputs(s, f);
    } else {
        put_json_cstr(f, s); /* a JSON string is a YAML double-quoted one */
    }
}

static void yaml_indent(struct yaml_w *w, int indent)
{
    if (w->dash) {
        fprintf(w->f, "%*s- ", indent - 2, "");
        w->dash = false;
    } else {
        fprintf(w->f, "%*s", indent, "");
    }
}

static void yaml_message(struct yaml_w *w, const ProtobufCMessage *m, int indent);

/* One list item of `fd` at `indent` (the "- " sits there). */
static void yaml_item(struct yaml_w *w, const ProtobufCFieldDescriptor *fd, const void *p,
                      int indent)
{
    if (fd->type == PROTOBUF_C_TYPE_MESSAGE) {
        const ProtobufCMessage *sub = *(ProtobufCMessage *const *)p;
        if (message_empty(sub)) {
            fprintf(w->f, "%*s- {}\n", indent, "");
            return;
        }
        w->dash = true;
        yaml_message(w, sub, indent + 2);
        return;
    }
    fprintf(w->f, "%*s- ", indent, "");
    yaml_scalar(w->f, fd, p);
    fputc('\n', w->f);
}

static void yaml_message(struct yaml_w *w, const ProtobufCMessage *m, int indent)
{
    for (unsigned i = 0; i < m->descriptor->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &m->descriptor->fields[i];
        size_t n;
        if (!field_present(m, fd, &n)) {
            continue;
        }
        char name[128];
        json_name(fd->name, name, sizeof name);
        yaml_indent(w, indent);
        fprintf(w->f, "%s:", name);
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            fputc('\n', w->f);
            for (size_t k = 0; k < n; k++) {
                yaml_item(w, fd, field_elem(m, fd, k), indent);
            }
        } else if (fd->type == PROTOBUF_C_TYPE_MESSAGE) {
            const ProtobufCMessage *sub = *(ProtobufCMessage *const *)field_elem(m, fd, 0);
            if (message_empty(sub)) {
                fputs(" {}\n", w->f);
            } else {
                fputc('\n', w->f);
                yaml_message(w, sub, indent + 2);
            }
        } else {
            fputc(' ', w->f);
            yaml_scalar(w->f, fd, field_elem(m, fd, 0));
            fputc('\n', w->f);
        }
    }
}

/* ---- entry ----------------------------------------------------------------- */

int cli_pb_print(FILE *f, const ProtobufCMessage *m, enum cli_pb_form form,
                 const struct cli_pb_extra *extra)
{
    if (form == CLI_PB_JSON) {
        json_message(f, m, extra);
        fputc('\n', f);
    } else {
        struct yaml_w w = {.f = f, .dash = false};
        if (extra != NULL) {
            fprintf(f, "%s: ", extra->key);
            put_json_cstr(f, extra->value);
            fputc('\n', f);
        }
        if (extra == NULL && message_empty(m)) {
            fputs("{}\n", f);
        } else {
            yaml_message(&w, m, 0);
        }
    }
    return ferror(f) ? -EIO : 0;
}
