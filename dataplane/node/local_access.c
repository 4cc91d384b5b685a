/*
 * local_access.c: the NodeLocal socket's placement, the fd gate and the
 * old-style shm check (local_access.h; docs/security.md, "NodeLocal").
 *
 * The gate issues a handle per descriptor: 16 bytes from getrandom, kept in
 * a table of GATE_MAX entries with the descriptor and the sender's
 * SO_PEERCRED. A handle is taken once by RegisterPool (node_gate_take) or
 * expires after GATE_TTL_MS; expired entries are closed when the gate next
 * issues one, and all at stop. The gate refuses a descriptor that is not a
 * regular file (a shm object or memfd) or not open read-write, because the
 * node maps it PROT_READ|PROT_WRITE: a caller who can only read its memory
 * must not gain a writable mapping through the node.
 *
 * DESIGN: see local_access.h. The gate thread accepts one connection at a
 * time; each exchange is bounded by KVF_FDPASS_TIMEOUT_MS (kvf_fdpass.c).
 */
#include "local_access.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include "kvf_error.h"
#include "kvf_fdpass.h"
#include "node_log.h"
#include "node_types.h"

#define GATE_MAX    64
#define GATE_TTL_MS 30000

/* ---- the socket's audience and placement -------------------------------------------- */

void node_access_init(struct node_access *a, uint32_t mode, int64_t gid)
{
    a->mode = mode ? (mode_t)(mode & 0777) : 0660;
    a->gid = gid >= 0 ? (gid_t)gid : getegid();
}

int node_access_private_dir(const char *final_path, char *dir, size_t cap)
{
    char copy[256];
    snprintf(copy, sizeof copy, "%s", final_path);
    int n = snprintf(dir, cap, "%s/.kvf-sock-XXXXXX", dirname(copy));
    if (n < 0 || (size_t)n >= cap)
        return -ENAMETOOLONG;
    if (!mkdtemp(dir)) { /* 0700 */
        int e = errno;
        node_log("error", NULL, "NodeLocal: cannot make a private directory beside %s: %s",
                 final_path, strerror(e));
        return -e;
    }
    return 0;
}

int node_access_place(const struct node_access *a, const char *tmp_path, const char *final_path)
{
    const char *step = "chown";
    if (chown(tmp_path, (uid_t)-1, a->gid) == 0) {
        step = "chmod";
        if (chmod(tmp_path, a->mode) == 0) {
            step = "rename";
            if (rename(tmp_path, final_path) == 0)
                return 0;
        }
    }
    int e = errno;
    node_log("error", NULL, "NodeLocal: %s of %s (mode %04o group %u): %s", step, final_path,
             (unsigned)a->mode, (unsigned)a->gid, strerror(e));
    return -e;
}

/* ---- the old-style check --------------------------------------------------------------- */

int node_access_check_shm(const struct node_access *a, int fd, const char *name, char *why,
                          size_t cap)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(why, cap, "host_shm: fstat(\"%s\"): %s", name, strerror(errno));
        return KVF_GRPC_INTERNAL;
    }
    mode_t om = st.st_mode & 0777;
    /* connect(2) needs write permission on the socket: who besides the
     * node's own user (and root) may call. */
    bool group_calls = (a->mode & 0020) != 0, others_call = (a->mode & 0002) != 0;
    bool world_rw = (om & 0006) == 0006;
    bool group_rw = world_rw || (st.st_gid == a->gid && (om & 0060) == 0060);
    /* With a POSIX ACL the group bits are only a mask: do not guess. */
    bool has_acl =
        (group_calls || others_call) && fgetxattr(fd, "system.posix_acl_access", NULL, 0) >= 0;
    bool ok = !has_acl && (!others_call || world_rw) && (!group_calls || group_rw);
    if (ok)
        return 0;
    snprintf(why, cap,
             "host_shm.shm_name: \"%s\" (uid %u gid %u mode %04o%s) is not read-write for every "
             "user the NodeLocal socket admits (mode %04o group %u); hand the memory over as a "
             "descriptor (host_fd, docs/node.md)",
             name, (unsigned)st.st_uid, (unsigned)st.st_gid, (unsigned)om,
             has_acl ? " with an ACL" : "", (unsigned)a->mode, (unsigned)a->gid);
    return KVF_GRPC_PERMISSION_DENIED;
}

/* ---- the fd gate ------------------------------------------------------------------------- */

struct gate_entry {
    bool used;
    uint8_t handle[KVF_FDPASS_HANDLE_SIZE];
    int fd;
    int64_t expires_ms;
    struct node_gate_peer peer;
};

struct node_gate {
    char path[256];
    int lsock;
    int stop_fd; /* eventfd */
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t lock; /* guards entries */
    struct gate_entry entries[GATE_MAX];
};

static int64_t gate_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Files `fd` under a new handle: 0, or -ENOSPC / -EIO (getrandom). */
static int gate_issue(struct node_gate *g, int fd, const struct node_gate_peer *peer,
                      uint8_t *handle)
{
    if (getrandom(handle, KVF_FDPASS_HANDLE_SIZE, 0) != (ssize_t)KVF_FDPASS_HANDLE_SIZE)
        return -EIO;
    int64_t now = gate_now_ms();
    int expired[GATE_MAX], nexpired = 0, rc = -ENOSPC;
    pthread_mutex_lock(&g->lock);
    struct gate_entry *free_e = NULL;
    for (size_t i = 0; i < GATE_MAX; i++) {
        struct gate_entry *e = &g->entries[i];
        if (e->used && e->expires_ms <= now) {
            expired[nexpired++] = e->fd;
            e->used = false;
        }
        if (!e->used && !free_e)
            free_e = e;
    }
    if (free_e) {
        free_e->used = true;
        memcpy(free_e->handle, handle, KVF_FDPASS_HANDLE_SIZE);
        free_e->fd = fd;
        free_e->expires_ms = now + GATE_TTL_MS;
        free_e->peer = *peer;
        rc = 0;
    }
    pthread_mutex_unlock(&g->lock);
    for (int i = 0; i < nexpired; i++)
        close(expired[i]);
    return rc;
}

int node_gate_take(struct node_gate *g, const uint8_t *handle, size_t len, int *fd_p,
                   struct node_gate_peer *peer_p)
{
    if (!g || len != KVF_FDPASS_HANDLE_SIZE)
        return -ENOENT;
    int64_t now = gate_now_ms();
    int rc = -ENOENT, stale = -1;
    pthread_mutex_lock(&g->lock);
    for (size_t i = 0; i < GATE_MAX; i++) {
        struct gate_entry *e = &g->entries[i];
        if (!e->used || memcmp(e->handle, handle, KVF_FDPASS_HANDLE_SIZE) != 0)
            continue;
        e->used = false;
        if (e->expires_ms <= now) {
            stale = e->fd;
        } else {
            *fd_p = e->fd;
            *peer_p = e->peer;
            rc = 0;
        }
        break;
    }
    pthread_mutex_unlock(&g->lock);
    if (stale >= 0)
        close(stale);
    return rc;
}

/* Checks the descriptor an engine handed over: 0 or a positive errno. */
static int gate_check_fd(int fd)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return EBADF;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) != O_RDWR)
        return EACCES;
    return 0;
}

/* One connection: its credentials, its descriptor, the answer. */
static void gate_serve(struct node_gate *g, int conn)
{
    struct ucred uc;
    socklen_t uclen = sizeof uc;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &uc, &uclen) != 0) {
        node_log("warn", NULL, "fd socket: SO_PEERCRED: %s", strerror(errno));
        return;
    }
    struct node_gate_peer peer = {uc.pid, uc.uid, uc.gid};
    int fd = -1;
    int rc = kvf_fdpass_recv(conn, &fd);
    int error = rc == 0 ? gate_check_fd(fd) : (rc == -EINVAL ? EINVAL : -rc);
    uint8_t handle[KVF_FDPASS_HANDLE_SIZE];
    if (error == 0) {
        rc = gate_issue(g, fd, &peer, handle);
        error = -rc;
    }
    if (error != 0) {
        if (fd >= 0)
            close(fd);
        fd = -1;
        node_log("warn", NULL, "fd socket: refused a descriptor from pid %d uid %u gid %u: %s",
                 (int)peer.pid, (unsigned)peer.uid, (unsigned)peer.gid, strerror(error));
    }
    if (kvf_fdpass_reply(conn, error, error == 0 ? handle : NULL) != 0 && fd >= 0) {
        /* The engine never learns the handle: take it back at once. */
        int back;
        struct node_gate_peer p;
        if (node_gate_take(g, handle, sizeof handle, &back, &p) == 0)
            close(back);
    }
}

static void *gate_main(void *arg)
{
    struct node_gate *g = arg;
    for (;;) {
        struct pollfd pf[2] = {{g->lsock, POLLIN, 0}, {g->stop_fd, POLLIN, 0}};
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            node_log("error", NULL, "fd socket: poll: %s", strerror(errno));
            break;
        }
        if (pf[1].revents)
            break;
        if (!(pf[0].revents & POLLIN))
            continue;
        int conn = accept4(g->lsock, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0)
            continue;
        gate_serve(g, conn);
        close(conn);
    }
    return NULL;
}

/* Binds the listening socket in a private directory and places it. */
static int gate_bind(struct node_gate *g, const struct node_access *a)
{
    char dir[300], tmp[320];
    int rc = node_access_private_dir(g->path, dir, sizeof dir);
    if (rc != 0)
        return rc;
    snprintf(tmp, sizeof tmp, "%s/s", dir);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(tmp) >= sizeof sa.sun_path) {
        rc = -ENAMETOOLONG;
        node_log("error", NULL, "fd socket %s: path too long", tmp);
        goto err_rmdir;
    }
    memcpy(sa.sun_path, tmp, strlen(tmp) + 1);
    g->lsock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (g->lsock < 0 || bind(g->lsock, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        listen(g->lsock, 16) != 0) {
        rc = -errno;
        node_log("error", NULL, "fd socket %s: %s", g->path, strerror(errno));
        goto err_unlink;
    }
    rc = node_access_place(a, tmp, g->path);
    if (rc != 0)
        goto err_unlink;
    (void)rmdir(dir);
    return 0;

err_unlink:
    if (g->lsock >= 0)
        close(g->lsock);
    g->lsock = -1; /* nothing of ours at g->path: stop must not remove it */
    (void)unlink(tmp);
err_rmdir:
    (void)rmdir(dir);
    return rc;
}

struct node_gate *node_gate_start(const char *path, const struct node_access *a)
{
    struct node_gate *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    snprintf(g->path, sizeof g->path, "%s", path);
    g->lsock = -1;
    pthread_mutex_init(&g->lock, NULL);
    g->stop_fd = eventfd(0, EFD_CLOEXEC);
    if (g->stop_fd < 0 || gate_bind(g, a) != 0)
        goto err_stop;
    if (pthread_create(&g->thread, NULL, gate_main, g) != 0) {
        node_log("error", NULL, "fd socket %s: its thread did not start", path);
        goto err_stop;
    }
    g->thread_started = true;
    return g;

err_stop:
    node_gate_stop(g);
    return NULL;
}

void node_gate_stop(struct node_gate *g)
{
    if (!g)
        return;
    if (g->thread_started) {
        uint64_t one = 1;
        if (write(g->stop_fd, &one, sizeof one) != (ssize_t)sizeof one)
            node_log("warn", NULL, "fd socket: cannot wake its thread: %s", strerror(errno));
        pthread_join(g->thread, NULL);
    }
    if (g->lsock >= 0) {
        close(g->lsock);
        (void)unlink(g->path);
    }
    if (g->stop_fd >= 0)
        close(g->stop_fd);
    for (size_t i = 0; i < GATE_MAX; i++)
        if (g->entries[i].used)
            close(g->entries[i].fd);
    pthread_mutex_destroy(&g->lock);
    free(g);
}
