/*
 * fuzz_util.c: the helpers of fuzz_util.h.
 */
#define _XOPEN_SOURCE 700 /* nftw */
#include "fuzz_util.h"

#include <dirent.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char scratch[256];

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    (void)remove(path);
    return 0;
}

/* At exit: the scratch tree goes (a tmpfs keeps it in memory otherwise). */
static void remove_scratch(void)
{
    if (scratch[0])
        (void)nftw(scratch, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

const char *fz_scratch_dir(void)
{
    if (scratch[0])
        return scratch;
    /* Targets that write files per input (fuzz_wal, fuzz_config) spend most
     * of their time in the file system: a tmpfs (/dev/shm) more than doubles
     * their rate, and the code under test runs the same. TMPDIR wins. */
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !tmp[0])
        tmp = access("/dev/shm", W_OK | X_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(scratch, sizeof scratch, "%s/kvf-fuzz-XXXXXX", tmp);
    if (!mkdtemp(scratch)) {
        perror("mkdtemp");
        abort();
    }
    atexit(remove_scratch);
    return scratch;
}

void fz_write_file(const char *path, const uint8_t *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f || (len && fwrite(data, 1, len, f) != len) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}

void fz_clear_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char path[512];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        (void)unlink(path);
    }
    closedir(d);
}

uint8_t fz_u8(struct fz_in *in)
{
    if (!in->left)
        return 0;
    in->left--;
    return *in->p++;
}

uint16_t fz_u16(struct fz_in *in)
{
    uint16_t lo = fz_u8(in);
    return (uint16_t)(lo | (fz_u8(in) << 8));
}

const uint8_t *fz_chunk(struct fz_in *in, size_t *len_p)
{
    size_t len = fz_u16(in);
    if (len > in->left)
        len = in->left;
    const uint8_t *p = in->p;
    in->p += len;
    in->left -= len;
    *len_p = len;
    return p;
}
