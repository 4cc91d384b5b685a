/*
 * kvf_fdpass.h: the fd socket beside a node's NodeLocal socket (docs/node.md,
 * "Handing memory to the node"; docs/security.md, "NodeLocal"). An engine
 * hands the node the memory of a pool as an open file descriptor (SCM_RIGHTS)
 * instead of a name the node would open with its own privileges; the node
 * answers with a one-time handle that RegisterPool then names (host_fd).
 *
 * The socket is SOCK_STREAM at "<NodeLocal socket path>.fds"; one exchange
 * per connection:
 *
 *   engine -> node  8 bytes "KVFD" + version (uint32 little-endian, 1), with
 *                   exactly one descriptor, opened read-write, as SCM_RIGHTS;
 *   node -> engine  24 bytes "KVFD" + error (uint32 little-endian: 0 or a
 *                   positive errno) + the 16-byte handle (zeros on error).
 *
 * Errors the node answers: EINVAL (a malformed request, or not exactly one
 * descriptor), EBADF (not a regular file or memfd), EACCES (not opened
 * read-write), ENOSPC (too many handles waiting for their RegisterPool).
 *
 * Both sides are here so the format lives in one place. Any thread; each
 * call blocks for at most its timeout.
 */
#ifndef KVF_FDPASS_H
#define KVF_FDPASS_H

#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

#define KVF_FDPASS_HANDLE_SIZE 16u
#define KVF_FDPASS_SUFFIX      ".fds"
#define KVF_FDPASS_VERSION     1u
#define KVF_FDPASS_REQ_SIZE    8u
#define KVF_FDPASS_REPLY_SIZE  24u
#define KVF_FDPASS_TIMEOUT_MS  2000

/* Writes "<local_socket>.fds" into buf: 0, or -ENAMETOOLONG when it does not
 * fit `cap` (or a sockaddr_un). */
int kvf_fdpass_path(const char *local_socket, char *buf, size_t cap);

/*
 * Engine side: connects to the fd socket `path`, sends `fd` and writes the
 * handle into `handle` (KVF_FDPASS_HANDLE_SIZE bytes). The caller keeps `fd`.
 * 0, or a negative errno: the node's answer (-EACCES, -EBADF, ...), or
 * -ENOENT / -ECONNREFUSED when no node serves `path` (an older node), -EPROTO
 * for a malformed answer, another -errno of the socket calls; `err` says
 * which.
 */
int kvf_fdpass_send(const char *path, int fd, uint8_t *handle, struct kvf_error *err);

/* Node side: reads one request from the accepted connection `conn` and
 * writes the descriptor it carried into *fd_p (close-on-exec). 0, -EINVAL
 * (malformed, or not exactly one descriptor: none is kept), or the -errno of
 * recvmsg. */
int kvf_fdpass_recv(int conn, int *fd_p);

/* Node side: answers `error` (0 or a positive errno) and `handle` (NULL:
 * zeros). 0 or -errno. */
int kvf_fdpass_reply(int conn, int error, const uint8_t *handle);

#endif /* KVF_FDPASS_H */
