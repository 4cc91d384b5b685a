/*
 * test_config.c: settings from defaults, a config file, the environment and
 * the command line, in that order of precedence, and the errors that name
 * where a bad value came from.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_config.h"

struct cfg {
    const char *listen;
    uint64_t ttl;
    bool verbose;
};

#define ITEMS(c)                                                        \
    {                                                                   \
        {"listen", KVF_CONFIG_STRING, &(c).listen, 0, "address"},       \
            {"node-ttl-ms", KVF_CONFIG_UINT, &(c).ttl, 100000, "ttl"},  \
            {"verbose", KVF_CONFIG_BOOL, &(c).verbose, 0, "more logs"}, \
    }

static char path[64];

static int setup(void **state)
{
    (void)state;
    snprintf(path, sizeof(path), "/tmp/kvf-config-XXXXXX");
    int fd = mkstemp(path);
    if (fd < 0)
        return -1;
    const char text[] = "# a comment\nlisten = 127.0.0.1:9 \nnode-ttl-ms=500 # trailing\n\n";
    if (write(fd, text, sizeof(text) - 1) != (ssize_t)(sizeof(text) - 1))
        return -1;
    close(fd);
    unsetenv("KVT_LISTEN");
    unsetenv("KVT_NODE_TTL_MS");
    unsetenv("KVT_CONFIG");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    unlink(path);
    kvf_config_free();
    return 0;
}

static int parse(struct cfg *c, int argc, char **argv, struct kvf_error *err)
{
    const struct kvf_config_item items[] = ITEMS(*c);
    kvf_error_clear(err);
    return kvf_config_parse(items, 3, "KVT_", argc, argv, stdout, err);
}

static void defaults_stand_when_nothing_is_given(void **state)
{
    (void)state;
    struct cfg c = {"127.0.0.1:7070", 10000, false};
    struct kvf_error err;
    char *argv[] = {"prog", NULL};
    assert_int_equal(parse(&c, 1, argv, &err), 0);
    assert_string_equal(c.listen, "127.0.0.1:7070");
    assert_int_equal(c.ttl, 10000);
    assert_false(c.verbose);
}

static void command_line_beats_environment_beats_file_beats_default(void **state)
{
    (void)state;
    struct cfg c = {"default", 1, false};
    struct kvf_error err;
    setenv("KVT_CONFIG", path, 1);
    char *argv1[] = {"prog", NULL};
    assert_int_equal(parse(&c, 1, argv1, &err), 0);
    assert_string_equal(c.listen, "127.0.0.1:9"); /* the file */
    assert_int_equal(c.ttl, 500);
    setenv("KVT_NODE_TTL_MS", "700", 1);
    assert_int_equal(parse(&c, 1, argv1, &err), 0);
    assert_int_equal(c.ttl, 700); /* the environment over the file */
    char *argv2[] = {"prog", "--node-ttl-ms", "900", "--listen=unix:/x", "--verbose", NULL};
    assert_int_equal(parse(&c, 5, argv2, &err), 0);
    assert_int_equal(c.ttl, 900); /* the command line over both */
    assert_string_equal(c.listen, "unix:/x");
    assert_true(c.verbose);
    unsetenv("KVT_NODE_TTL_MS");
    unsetenv("KVT_CONFIG");
}

static void bad_values_name_their_source(void **state)
{
    (void)state;
    struct cfg c = {"d", 1, false};
    struct kvf_error err;
    char *argv1[] = {"prog", "--node-ttl-ms", "ten", NULL};
    assert_int_equal(parse(&c, 3, argv1, &err), -EINVAL);
    assert_non_null(strstr(err.msg, "--node-ttl-ms"));
    assert_non_null(strstr(err.msg, "'ten'"));
    char *argv2[] = {"prog", "--node-ttl-ms", "100001", NULL};
    assert_int_equal(parse(&c, 3, argv2, &err), -EINVAL); /* over the maximum */
    char *argv3[] = {"prog", "--lisen", "x", NULL};
    assert_int_equal(parse(&c, 3, argv3, &err), -EINVAL);
    assert_non_null(strstr(err.msg, "--lisen"));
    char *argv4[] = {"prog", "--listen", NULL};
    assert_int_equal(parse(&c, 2, argv4, &err), -EINVAL);
    assert_non_null(strstr(err.msg, "needs a value"));
    setenv("KVT_NODE_TTL_MS", "-1", 1);
    char *argv5[] = {"prog", NULL};
    assert_int_equal(parse(&c, 1, argv5, &err), -EINVAL);
    assert_non_null(strstr(err.msg, "KVT_NODE_TTL_MS"));
    unsetenv("KVT_NODE_TTL_MS");
    FILE *f = fopen(path, "a");
    fputs("bogus = 1\n", f);
    fclose(f);
    char *argv6[] = {"prog", "--config", path, NULL};
    assert_int_equal(parse(&c, 3, argv6, &err), -EINVAL);
    assert_non_null(strstr(err.msg, ":5: unknown setting 'bogus'"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(defaults_stand_when_nothing_is_given, setup, teardown),
        cmocka_unit_test_setup_teardown(command_line_beats_environment_beats_file_beats_default,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(bad_values_name_their_source, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
