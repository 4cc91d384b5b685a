/*
 * fuzz_config.c: the settings parser (common/kvf_config.c) on hostile
 * input. The input is "FILE\xff ARGV": the bytes before the first 0xff are
 * the config file (passed with --config), the rest is the command line, one
 * argument per NUL-separated piece. The table has one setting of each kind.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "kvf_config.h"

#define MAX_ARGS 32

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static FILE *devnull;
    static char path[300];
    if (!devnull) {
        devnull = fopen("/dev/null", "w");
        snprintf(path, sizeof path, "%s/fuzz.conf", fz_scratch_dir());
    }
    const uint8_t *sep = memchr(data, 0xff, size);
    size_t file_len = sep ? (size_t)(sep - data) : size;
    fz_write_file(path, data, file_len);

    /* argv: "prog --config PATH" then the pieces; a copy, NUL-terminated. */
    size_t rest = sep ? size - file_len - 1 : 0;
    char *args = malloc(rest + 1);
    if (!args)
        return 0;
    if (rest)
        memcpy(args, sep + 1, rest);
    args[rest] = '\0';
    char *argv[MAX_ARGS + 4] = {"fuzz", "--config", path};
    int argc = 3;
    for (size_t i = 0; i <= rest && argc < MAX_ARGS + 3;) {
        argv[argc++] = args + i;
        i += strlen(args + i) + 1;
    }
    argv[argc] = NULL;

    const char *str = "default";
    uint64_t num = 7;
    bool flag = false;
    const char *other = NULL;
    const struct kvf_config_item items[] = {
        {"listen", KVF_CONFIG_STRING, &str, 0, "a string"},
        {"node-ttl-ms", KVF_CONFIG_UINT, &num, 86400000, "a bounded number"},
        {"count", KVF_CONFIG_UINT, &num, 0, "an unbounded number"},
        {"verbose", KVF_CONFIG_BOOL, &flag, 0, "a flag"},
        {"data-dir", KVF_CONFIG_STRING, &other, 0, "another string"},
    };
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_config_parse(items, sizeof items / sizeof items[0], "KVF_FUZZ_", argc, argv,
                              devnull, &err);
    if (rc == 0 && str)
        (void)strlen(str); /* what the parser kept must be a string */
    if (rc == 0 && other)
        (void)strlen(other);
    kvf_config_free();
    free(args);
    return 0;
}
