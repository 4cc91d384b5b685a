/*
 * fuzz_util.c: the helpers of fuzz_util.h.
 */
#include "fuzz_util.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char *fz_scratch_dir(void)
{
    static char dir[256];
    if (dir[0])
        return dir;
    const char *tmp = getenv("TMPDIR");
    snprintf(dir, sizeof dir, "%s/kvf-fuzz-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        abort();
    }
    return dir;
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
