/*
 * kvf_config.h: the settings of a kvfence daemon, from one table.
 *
 * A daemon describes each setting once (name, kind, default, help); this
 * module fills them from four places, each overriding the one before:
 *
 *   1. the default in the table;
 *   2. the config file (--config PATH, or the environment variable
 *      <PREFIX>CONFIG): lines "name = value", '#' starts a comment;
 *   3. the environment: <PREFIX><NAME>, upper case, '-' as '_'
 *      (KVF_CONTROL_DATA_DIR for data-dir);
 *   4. the command line: --name value or --name=value.
 *
 * --help prints the table (with the environment names); --version is left to
 * the caller. Errors name the source and the setting ("--node-ttl-ms: 'x' is
 * not a number", "/etc/kvf.conf:3: unknown setting 'lisen'").
 *
 * Not thread-safe: a daemon parses once, in main, before it starts threads.
 */
#ifndef KVF_CONFIG_H
#define KVF_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvf_error.h"

enum kvf_config_kind {
    KVF_CONFIG_STRING = 1, /* const char **; NULL or empty means unset */
    KVF_CONFIG_UINT = 2,   /* uint64_t *, decimal */
    KVF_CONFIG_BOOL = 3,   /* bool *: true/false/1/0/yes/no; a bare --flag means true */
};

struct kvf_config_item {
    const char *name; /* "data-dir": the flag is --data-dir */
    enum kvf_config_kind kind;
    void *value;  /* where the parsed value goes; holds the default on entry */
    uint64_t max; /* KVF_CONFIG_UINT: largest value accepted (0: no limit) */
    const char *help;
};

/*
 * Fills the items from the config file, the environment and argv, in that
 * order of precedence (argv wins). `env_prefix` is like "KVF_CONTROL_". String
 * values point into argv, the environment or storage owned by the module
 * (freed by kvf_config_free). Returns 0, 1 when --help was printed to `out`,
 * or -EINVAL with a message in `err`.
 */
int kvf_config_parse(const struct kvf_config_item *items, size_t n, const char *env_prefix,
                     int argc, char **argv, FILE *out, struct kvf_error *err);

/* Prints the settings table (flag, environment name, default, help). */
void kvf_config_usage(const struct kvf_config_item *items, size_t n, const char *env_prefix,
                      FILE *out);

/* Frees the strings kept from the config file. */
void kvf_config_free(void);

#endif /* KVF_CONFIG_H */
