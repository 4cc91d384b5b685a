/*
 * wal_test_util.c: helpers of the store tests (see wal_test_util.h).
 */
#include "wal_test_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

char *wal_test_mkdtemp(void)
{
    char *dir = strdup("/tmp/kvf_wal_XXXXXX");
    assert_non_null(dir);
    assert_non_null(mkdtemp(dir));
    return dir;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

void wal_test_rmtree(char *dir)
{
    assert_int_equal(nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS), 0);
    free(dir);
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

size_t wal_test_payload(uint64_t seq, unsigned char *buf)
{
    size_t len = 16 + (size_t)(mix(seq) % 300);
    memcpy(buf, &seq, 8);
    uint64_t h = mix(seq ^ 0x9e3779b97f4a7c15ull);
    for (size_t i = 8; i < len; i++) {
        buf[i] = (unsigned char)h;
        h = h * 6364136223846793005ull + 1442695040888963407ull;
        h ^= h >> 29;
    }
    return len;
}

bool wal_test_payload_ok(uint64_t seq, const unsigned char *bytes, size_t len)
{
    unsigned char want[WAL_TEST_PAYLOAD_MAX];
    size_t n = wal_test_payload(seq, want);
    return n == len && memcmp(want, bytes, n) == 0;
}

size_t wal_test_snapshot(uint64_t seq, unsigned char *buf)
{
    size_t len = 1000 + (size_t)(mix(seq + 1) % 6000);
    memcpy(buf, "SNAP", 4);
    memcpy(buf + 4, &seq, 8);
    for (size_t i = 12; i < len; i++)
        buf[i] = (unsigned char)(seq * 131 + i * 7);
    return len;
}

bool wal_test_snapshot_ok(uint64_t seq, const unsigned char *bytes, size_t len)
{
    unsigned char want[WAL_TEST_SNAP_MAX];
    size_t n = wal_test_snapshot(seq, want);
    return n == len && memcmp(want, bytes, n) == 0;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(a, b);
}

int wal_test_list_files(const char *dir, const char *prefix, char names[][64], int max)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, prefix, strlen(prefix)) != 0)
            continue;
        if (n < max && names != NULL) {
            size_t len = strnlen(de->d_name, 63);
            memcpy(names[n], de->d_name, len);
            names[n][len] = '\0';
        }
        n++;
    }
    closedir(d);
    if (names != NULL)
        qsort(names, (size_t)(n < max ? n : max), 64, cmp_name);
    return n;
}

int wal_test_count_files(const char *dir, const char *prefix)
{
    return wal_test_list_files(dir, prefix, NULL, 0);
}

static void path_of(char *buf, size_t size, const char *dir, const char *name)
{
    snprintf(buf, size, "%s/%s", dir, name);
}

bool wal_test_file_exists(const char *dir, const char *name)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    return access(p, F_OK) == 0;
}

off_t wal_test_file_size(const char *dir, const char *name)
{
    char p[512];
    struct stat sb;
    path_of(p, sizeof(p), dir, name);
    assert_int_equal(stat(p, &sb), 0);
    return sb.st_size;
}

size_t wal_test_record_offsets(const char *dir, const char *name, off_t *offs, size_t max)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    int fd = open(p, O_RDONLY);
    assert_true(fd >= 0);
    off_t size = lseek(fd, 0, SEEK_END);
    off_t off = 24; /* segment header */
    size_t n = 0;
    while (off + 16 <= size && n < max) {
        unsigned char h[4];
        assert_int_equal(pread(fd, h, 4, off), 4);
        uint32_t len =
            (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 24;
        if (len == 0x80000000u)
            break; /* the seal: the segment ends here */
        offs[n++] = off;
        off += 16 + (off_t)len;
    }
    close(fd);
    return n;
}

void wal_test_truncate(const char *dir, const char *name, off_t size)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    assert_int_equal(truncate(p, size), 0);
}

void wal_test_flip_byte(const char *dir, const char *name, off_t off)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    int fd = open(p, O_RDWR);
    assert_true(fd >= 0);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

void wal_test_append_zeros(const char *dir, const char *name, size_t n)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    off_t size = wal_test_file_size(dir, name);
    assert_int_equal(truncate(p, size + (off_t)n), 0);
}

void wal_test_write_file(const char *dir, const char *name, const void *bytes, size_t len)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, bytes, len), (ssize_t)len);
    close(fd);
}

void wal_test_copy_file(const char *dir, const char *from, const char *to)
{
    char p[512];
    path_of(p, sizeof(p), dir, from);
    off_t size = wal_test_file_size(dir, from);
    char *buf = malloc((size_t)size + 1);
    assert_non_null(buf);
    int fd = open(p, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(read(fd, buf, (size_t)size), size);
    close(fd);
    wal_test_write_file(dir, to, buf, (size_t)size);
    free(buf);
}

void wal_test_unlink(const char *dir, const char *name)
{
    char p[512];
    path_of(p, sizeof(p), dir, name);
    assert_int_equal(unlink(p), 0);
}
