/*
 * kvf_fdpass.c: both ends of the fd socket's one exchange (kvf_fdpass.h):
 * a fixed 8-byte request carrying one descriptor in SCM_RIGHTS, a fixed
 * 24-byte answer. Timeouts are SO_RCVTIMEO/SO_SNDTIMEO on the socket, so a
 * peer that stalls costs the other side at most KVF_FDPASS_TIMEOUT_MS.
 */
#include "kvf_fdpass.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

static const char MAGIC[4] = {'K', 'V', 'F', 'D'};

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void set_timeouts(int s)
{
    struct timeval tv = {KVF_FDPASS_TIMEOUT_MS / 1000, (KVF_FDPASS_TIMEOUT_MS % 1000) * 1000};
    (void)setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    (void)setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

int kvf_fdpass_path(const char *local_socket, char *buf, size_t cap)
{
    struct sockaddr_un sa;
    int n = snprintf(buf, cap, "%s%s", local_socket, KVF_FDPASS_SUFFIX);
    if (n < 0 || (size_t)n >= cap || (size_t)n >= sizeof sa.sun_path)
        return -ENAMETOOLONG;
    return 0;
}

/* Reads exactly `len` bytes: 0, -EPROTO at an early end, or -errno. */
static int read_full(int s, uint8_t *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(s, buf + got, len - got, 0);
        if (r == 0)
            return -EPROTO;
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        got += (size_t)r;
    }
    return 0;
}

int kvf_fdpass_send(const char *path, int fd, uint8_t *handle, struct kvf_error *err)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path)
        return kvf_error_set(err, -ENAMETOOLONG, "fd socket %s: path too long", path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return kvf_error_set(err, -errno, "fd socket: socket: %s", strerror(errno));
    set_timeouts(s);
    int rc;
    if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        rc = kvf_error_set(err, -e, "fd socket %s: connect: %s", path, strerror(e));
        goto err_close;
    }
    uint8_t req[KVF_FDPASS_REQ_SIZE];
    memcpy(req, MAGIC, 4);
    put_le32(req + 4, KVF_FDPASS_VERSION);
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {.iov_base = req, .iov_len = sizeof req};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    ssize_t w;
    do {
        w = sendmsg(s, &msg, MSG_NOSIGNAL);
    } while (w < 0 && errno == EINTR);
    if (w != (ssize_t)sizeof req) {
        int e = w < 0 ? errno : EPROTO;
        rc = kvf_error_set(err, -e, "fd socket %s: sendmsg: %s", path, strerror(e));
        goto err_close;
    }
    uint8_t rep[KVF_FDPASS_REPLY_SIZE];
    rc = read_full(s, rep, sizeof rep);
    if (rc != 0) {
        rc = kvf_error_set(err, rc, "fd socket %s: no answer: %s", path, strerror(-rc));
        goto err_close;
    }
    if (memcmp(rep, MAGIC, 4) != 0) {
        rc = kvf_error_set(err, -EPROTO, "fd socket %s: not a kvfence fd socket", path);
        goto err_close;
    }
    uint32_t e = get_le32(rep + 4);
    if (e != 0) {
        rc = kvf_error_set(err, -(int)e, "fd socket %s: the node refused the descriptor: %s", path,
                           strerror((int)e));
        goto err_close;
    }
    memcpy(handle, rep + 8, KVF_FDPASS_HANDLE_SIZE);
    close(s);
    return 0;

err_close:
    close(s);
    return rc;
}

int kvf_fdpass_recv(int conn, int *fd_p)
{
    set_timeouts(conn);
    uint8_t req[KVF_FDPASS_REQ_SIZE];
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = req, .iov_len = sizeof req};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t r;
    do {
        r = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return -errno;
    /* Every descriptor that came is ours to close unless it is the one. */
    int fds[4], nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < n && nfds < 4; i++)
            memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
    }
    int ok = r == (ssize_t)sizeof req && !(msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) &&
             memcmp(req, MAGIC, 4) == 0 && get_le32(req + 4) == KVF_FDPASS_VERSION && nfds == 1;
    if (!ok) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        return -EINVAL;
    }
    *fd_p = fds[0];
    return 0;
}

int kvf_fdpass_reply(int conn, int error, const uint8_t *handle)
{
    uint8_t rep[KVF_FDPASS_REPLY_SIZE] = {0};
    memcpy(rep, MAGIC, 4);
    put_le32(rep + 4, (uint32_t)error);
    if (handle)
        memcpy(rep + 8, handle, KVF_FDPASS_HANDLE_SIZE);
    ssize_t w;
    do {
        w = send(conn, rep, sizeof rep, MSG_NOSIGNAL);
    } while (w < 0 && errno == EINTR);
    if (w < 0)
        return -errno;
    return w == (ssize_t)sizeof rep ? 0 : -EIO;
}
