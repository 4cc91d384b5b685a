/*
 * output.h: the kvfence CLI's tables. A table collects its cells and prints
 * them in aligned columns (two spaces apart, no trailing blanks). JSON and
 * YAML documents come from pbjson.h.
 */
#ifndef KVF_CLI_OUTPUT_H
#define KVF_CLI_OUTPUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CLI_TABLE_MAX_COLS 16

struct cli_table {
    size_t ncols;
    const char *headers[CLI_TABLE_MAX_COLS]; /* NULL headers: no header line */
    char **cells;                            /* row-major, malloc'd strings */
    size_t ncells;
    size_t cap;
    bool oom;
};

/* Starts a table of `ncols` columns with the given headers (copied pointers:
 * string literals); `headers` NULL prints no header line. */
void cli_table_init(struct cli_table *t, size_t ncols, const char *const *headers);
/* Appends the next cell (rows fill left to right). */
void cli_table_cell(struct cli_table *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Prints the header and the complete rows; returns -1 if a cell was lost to
 * memory, else 0. */
int cli_table_print(const struct cli_table *t, FILE *f);
void cli_table_free(struct cli_table *t);

/* Formats a duration in ms for humans: "850ms", "12.3s", "4m05s", "2h07m",
 * "3d04h". Returns buf. */
const char *cli_fmt_duration(uint64_t ms, char *buf, size_t len);

#endif /* KVF_CLI_OUTPUT_H */
