/*
 * host_lock.c: the node's exclusive host lock (see host_lock.h). The file
 * holds one line, the holder's incarnation in decimal; it is rewritten in
 * place (the lock is on the inode, so it is never replaced by a rename).
 */
#include "host_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

int node_host_lock_take(const char *path, int *fd_p, uint64_t *prev_p)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return -errno;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int rc = errno == EWOULDBLOCK ? -EWOULDBLOCK : -errno;
        close(fd);
        return rc;
    }
    char buf[32];
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    if (n < 0) {
        int rc = -errno;
        close(fd);
        return rc;
    }
    buf[n] = '\0';
    uint64_t prev = strtoull(buf, NULL, 10); /* garbage or empty: 0, nothing witnessed */
    *fd_p = fd;
    *prev_p = prev;
    return 0;
}

int node_host_lock_record(int fd, uint64_t incarnation)
{
    char buf[32];
    int len = snprintf(buf, sizeof buf, "%" PRIu64 "\n", incarnation);
    if (ftruncate(fd, 0) != 0)
        return -errno;
    if (pwrite(fd, buf, (size_t)len, 0) != len)
        return errno ? -errno : -EIO;
    return 0;
}
