/*
 * test_file.c: kvf_file_write / kvf_file_printf: a new file, replacing an
 * existing one, and errors that leave neither a .tmp nor a changed target.
 */
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_file.h"

struct fx {
    char dir[64];
    char path[128]; /* dir/f */
    char tmp[160];  /* dir/f.tmp */
};

static int setup(void **state)
{
    struct fx *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->dir, sizeof f->dir, "/tmp/kvf-file-XXXXXX");
    if (!mkdtemp(f->dir)) {
        free(f);
        return -1;
    }
    snprintf(f->path, sizeof f->path, "%s/f", f->dir);
    snprintf(f->tmp, sizeof f->tmp, "%s.tmp", f->path);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fx *f = *state;
    unlink(f->tmp);
    rmdir(f->path); /* a test may have made it a directory */
    unlink(f->path);
    int rc = rmdir(f->dir); /* fails if a test left anything else behind */
    free(f);
    return rc;
}

/* The whole contents of `path` into buf (NUL terminated); its length or -1. */
static long slurp(const char *path, char *buf, size_t size)
{
    FILE *fp = fopen(path, "r");
    if (!fp)
        return -1;
    size_t n = fread(buf, 1, size - 1, fp);
    fclose(fp);
    buf[n] = '\0';
    return (long)n;
}

static void test_write_new(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_file_write(f->path, "7070\n", 5, 0), 0);
    char buf[64];
    assert_int_equal(slurp(f->path, buf, sizeof buf), 5);
    assert_string_equal(buf, "7070\n");
    assert_int_equal(access(f->tmp, F_OK), -1);
}

static void test_replace_existing(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_file_printf(f->path, 0, "%u\n%s\n", 40001u, "/run/a-long-socket-path"), 0);
    struct stat before;
    assert_int_equal(stat(f->path, &before), 0);
    /* Shorter contents: the old bytes must not survive past the new end. */
    assert_int_equal(kvf_file_printf(f->path, KVF_FILE_SYNC, "%u\n", 9u), 0);
    char buf[64];
    assert_int_equal(slurp(f->path, buf, sizeof buf), 2);
    assert_string_equal(buf, "9\n");
    /* A new inode renamed over the old one, not the old file rewritten in
     * place (a reader holding the old one still sees it whole). */
    struct stat after;
    assert_int_equal(stat(f->path, &after), 0);
    assert_true(before.st_ino != after.st_ino);
    assert_int_equal(access(f->tmp, F_OK), -1);
}

static void test_empty(void **state)
{
    struct fx *f = *state;
    assert_int_equal(kvf_file_write(f->path, "", 0, KVF_FILE_SYNC), 0);
    struct stat st;
    assert_int_equal(stat(f->path, &st), 0);
    assert_int_equal(st.st_size, 0);
}

static void test_missing_directory(void **state)
{
    struct fx *f = *state;
    char path[160], tmp[170];
    snprintf(path, sizeof path, "%s/no-such-dir/f", f->dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    assert_int_equal(kvf_file_write(path, "x\n", 2, 0), -ENOENT);
    assert_int_equal(kvf_file_printf(path, KVF_FILE_SYNC, "%d\n", 1), -ENOENT);
    assert_int_equal(access(tmp, F_OK), -1);
    assert_int_equal(access(path, F_OK), -1);
}

/* The rename fails after the .tmp was written: the .tmp is removed and the
 * target is unchanged. */
static void test_rename_fails_cleans_tmp(void **state)
{
    struct fx *f = *state;
    assert_int_equal(mkdir(f->path, 0700), 0);
    assert_int_equal(kvf_file_write(f->path, "x\n", 2, 0), -EISDIR);
    assert_int_equal(access(f->tmp, F_OK), -1);
    struct stat st;
    assert_int_equal(stat(f->path, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
}

static void test_name_too_long(void **state)
{
    (void)state;
    char *path = malloc(PATH_MAX + 1);
    assert_non_null(path);
    memset(path, 'a', PATH_MAX - 2);
    path[PATH_MAX - 2] = '\0'; /* fits, but "<path>.tmp" does not */
    assert_int_equal(kvf_file_write(path, "x", 1, 0), -ENAMETOOLONG);
    free(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_write_new, setup, teardown),
        cmocka_unit_test_setup_teardown(test_replace_existing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_empty, setup, teardown),
        cmocka_unit_test_setup_teardown(test_missing_directory, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rename_fails_cleans_tmp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_name_too_long, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
