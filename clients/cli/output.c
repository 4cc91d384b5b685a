/*
 * output.c: tables and JSON for the kvfence CLI (output.h).
 */
#include "output.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

void cli_table_init(struct cli_table *t, size_t ncols, const char *const *headers)
{
    memset(t, 0, sizeof *t);
    t->ncols = ncols < CLI_TABLE_MAX_COLS ? ncols : CLI_TABLE_MAX_COLS;
    for (size_t i = 0; headers && i < t->ncols; i++) {
        t->headers[i] = headers[i];
    }
}

void cli_table_cell(struct cli_table *t, const char *fmt, ...)
{
    if (t->ncells == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        char **cells = realloc(t->cells, cap * sizeof *cells);
        if (!cells) {
            t->oom = true;
            return;
        }
        t->cells = cells;
        t->cap = cap;
    }
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    if (n < 0) {
        s = NULL;
        t->oom = true;
    }
    t->cells[t->ncells++] = s;
}

static void print_row(FILE *f, const char *const *row, const size_t *width, size_t ncols)
{
    for (size_t c = 0; c < ncols; c++) {
        const char *s = row[c] ? row[c] : "";
        if (c + 1 < ncols) {
            fprintf(f, "%-*s  ", (int)width[c], s);
        } else {
            fprintf(f, "%s\n", s);
        }
    }
}

int cli_table_print(const struct cli_table *t, FILE *f)
{
    size_t width[CLI_TABLE_MAX_COLS] = {0};
    size_t nrows = t->ncols ? t->ncells / t->ncols : 0;
    bool header = t->headers[0] != NULL;
    for (size_t c = 0; c < t->ncols; c++) {
        if (header) {
            width[c] = strlen(t->headers[c]);
        }
        for (size_t r = 0; r < nrows; r++) {
            const char *s = t->cells[r * t->ncols + c];
            size_t w = s ? strlen(s) : 0;
            if (w > width[c]) {
                width[c] = w;
            }
        }
    }
    if (header) {
        print_row(f, t->headers, width, t->ncols);
    }
    for (size_t r = 0; r < nrows; r++) {
        print_row(f, (const char *const *)&t->cells[r * t->ncols], width, t->ncols);
    }
    return t->oom ? -1 : 0;
}

void cli_table_free(struct cli_table *t)
{
    for (size_t i = 0; i < t->ncells; i++) {
        free(t->cells[i]);
    }
    free(t->cells);
    memset(t, 0, sizeof *t);
}

/* ---- JSON ---------------------------------------------------------------- */

void cli_json_init(struct cli_json *j, FILE *f)
{
    memset(j, 0, sizeof *j);
    j->f = f;
    j->first[0] = true;
}

static void put_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"':
            fputs("\\\"", f);
            break;
        case '\\':
            fputs("\\\\", f);
            break;
        case '\n':
            fputs("\\n", f);
            break;
        case '\r':
            fputs("\\r", f);
            break;
        case '\t':
            fputs("\\t", f);
            break;
        default:
            if (*p < 0x20 || *p == 0x7f) {
                fprintf(f, "\\u%04x", *p);
            } else {
                fputc(*p, f);
            }
        }
    }
    fputc('"', f);
}

/* The comma and the key before a value. */
static void member(struct cli_json *j, const char *key)
{
    if (!j->first[j->depth]) {
        fputc(',', j->f);
    }
    j->first[j->depth] = false;
    if (key) {
        put_string(j->f, key);
        fputc(':', j->f);
    }
}

static void json_open(struct cli_json *j, const char *key, char c)
{
    member(j, key);
    fputc(c, j->f);
    if (j->depth + 1 < CLI_JSON_MAX_DEPTH) {
        j->depth++;
    }
    j->first[j->depth] = true;
}

static void json_close(struct cli_json *j, char c)
{
    fputc(c, j->f);
    if (j->depth > 0) {
        j->depth--;
    }
}

void cli_json_obj_begin(struct cli_json *j, const char *key)
{
    json_open(j, key, '{');
}

void cli_json_obj_end(struct cli_json *j)
{
    json_close(j, '}');
}

void cli_json_arr_begin(struct cli_json *j, const char *key)
{
    json_open(j, key, '[');
}

void cli_json_arr_end(struct cli_json *j)
{
    json_close(j, ']');
}

void cli_json_str(struct cli_json *j, const char *key, const char *val)
{
    member(j, key);
    if (val) {
        put_string(j->f, val);
    } else {
        fputs("null", j->f);
    }
}

void cli_json_u64(struct cli_json *j, const char *key, uint64_t val)
{
    member(j, key);
    fprintf(j->f, "%" PRIu64, val);
}

void cli_json_bool(struct cli_json *j, const char *key, bool val)
{
    member(j, key);
    fputs(val ? "true" : "false", j->f);
}

void cli_json_null(struct cli_json *j, const char *key)
{
    member(j, key);
    fputs("null", j->f);
}

void cli_json_end(struct cli_json *j)
{
    fputc('\n', j->f);
    j->depth = 0;
    j->first[0] = true;
}

const char *cli_fmt_duration(uint64_t ms, char *buf, size_t len)
{
    uint64_t s = ms / 1000;
    if (ms < 1000) {
        snprintf(buf, len, "%" PRIu64 "ms", ms);
    } else if (s < 60) {
        snprintf(buf, len, "%" PRIu64 ".%" PRIu64 "s", s, (ms % 1000) / 100);
    } else if (s < 3600) {
        snprintf(buf, len, "%" PRIu64 "m%02" PRIu64 "s", s / 60, s % 60);
    } else if (s < 86400) {
        snprintf(buf, len, "%" PRIu64 "h%02" PRIu64 "m", s / 3600, (s % 3600) / 60);
    } else {
        snprintf(buf, len, "%" PRIu64 "d%02" PRIu64 "h", s / 86400, (s % 86400) / 3600);
    }
    return buf;
}
