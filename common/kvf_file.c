/*
 * kvf_file.c: atomic small-file writes (tmp in the same directory, rename).
 */
#include "kvf_file.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* fsync of the directory holding `path`, so that the rename is durable. */
static int sync_dir(const char *path)
{
    char dir[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

int kvf_file_write(const char *path, const void *data, size_t len, unsigned flags)
{
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return -ENAMETOOLONG;
    FILE *fp = fopen(tmp, "we");
    if (!fp)
        return -errno;
    int rc = 0;
    errno = 0; /* fwrite need not set it */
    if (fwrite(data, 1, len, fp) != len || fflush(fp) != 0)
        rc = errno ? -errno : -EIO;
    if (rc == 0 && (flags & KVF_FILE_SYNC) && fsync(fileno(fp)) != 0)
        rc = -errno;
    if (fclose(fp) != 0 && rc == 0)
        rc = -errno;
    if (rc == 0 && rename(tmp, path) != 0)
        rc = -errno;
    if (rc != 0) {
        unlink(tmp);
        return rc;
    }
    return (flags & KVF_FILE_SYNC) ? sync_dir(path) : 0;
}

int kvf_file_printf(const char *path, unsigned flags, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -EINVAL;
    char *buf = malloc((size_t)n + 1);
    if (!buf)
        return -ENOMEM;
    va_start(ap, fmt);
    vsnprintf(buf, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = kvf_file_write(path, buf, (size_t)n, flags);
    free(buf);
    return rc;
}
