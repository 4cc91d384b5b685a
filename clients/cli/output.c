/*
 * output.c: tables and durations for the kvfence CLI (output.h).
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
