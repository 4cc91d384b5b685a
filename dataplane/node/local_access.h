/*
 * local_access.h: who may make kvfence-node map memory (docs/security.md,
 * "NodeLocal"). The node runs with more privilege than its engines (root,
 * CAP_IPC_LOCK, the RDMA devices), so it must never open memory for a caller
 * who could not open it itself. Three pieces:
 *
 *  - socket placement: the NodeLocal socket and the fd socket are bound in a
 *    private 0700 directory beside their path, given their mode and group
 *    there, and renamed into place, so no one ever sees them more open than
 *    configured, whatever the umask;
 *  - the fd gate: the fd socket ("<NodeLocal socket>.fds", kvf_fdpass.h),
 *    where an engine hands over an open read-write descriptor and gets a
 *    one-time handle for RegisterPool's host_fd. gRPC core does not tell a
 *    handler who called over a unix socket; here the node reads SO_PEERCRED
 *    itself, and the descriptor is the proof that the caller may use the
 *    memory;
 *  - the old-style check: a RegisterPool naming a shm object (host_shm) is
 *    served only when every user the NodeLocal socket admits could open that
 *    object read-write itself (node_access_check_shm).
 *
 * DESIGN: the gate has its own thread (poll on the listening socket and an
 * eventfd that stops it); its handle table is the one object shared with the
 * owner thread, which takes handles (node_gate_take) while it registers a
 * pool: the table has its own mutex, held only for table operations, never
 * across a system call that may block.
 */
#ifndef KVF_NODE_LOCAL_ACCESS_H
#define KVF_NODE_LOCAL_ACCESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* The audience of the NodeLocal socket: its mode and group (the owner is the
 * node's effective uid). */
struct node_access {
    mode_t mode; /* permission bits, e.g. 0660 */
    gid_t gid;   /* the socket's group */
};

/* Fills `a` from the options: mode 0 means 0660, gid -1 the node's egid. */
void node_access_init(struct node_access *a, uint32_t mode, int64_t gid);

/* Makes a private directory (0700) beside `final_path` for binding it:
 * "<dir of final_path>/.kvf-sock-XXXXXX" into `dir` (`cap` bytes). 0 or
 * -errno (logged). */
int node_access_private_dir(const char *final_path, char *dir, size_t cap);

/* Gives the socket file `tmp_path` (bound inside a private directory) the
 * mode and group of `a`, then renames it to `final_path` (replacing a stale
 * socket left there). 0 or -errno (logged). */
int node_access_place(const struct node_access *a, const char *tmp_path, const char *final_path);

/* Checks the open shm object `fd` (named `name`, for the message): 0 when
 * every user the socket admits could open it read-write, else a gRPC status
 * code (PERMISSION_DENIED naming host_shm.shm_name, or the fstat error) and
 * the reason in `why`. Any thread. */
int node_access_check_shm(const struct node_access *a, int fd, const char *name, char *why,
                          size_t cap);

/* ---- the fd gate -------------------------------------------------------------------- */

struct node_gate;

/* Binds the fd socket at `path` (placed as above with `a`) and starts its
 * thread. NULL (logged) when it cannot. */
struct node_gate *node_gate_start(const char *path, const struct node_access *a);

/* Stops the thread, closes every descriptor not taken, removes the socket
 * file. Accepts NULL. */
void node_gate_stop(struct node_gate *g);

/* The credentials of the process that handed a descriptor over. */
struct node_gate_peer {
    pid_t pid;
    uid_t uid;
    gid_t gid;
};

/* Takes the descriptor named by `handle` (`len` bytes): 0 and *fd_p (the
 * caller closes it) and *peer_p, or -ENOENT when no descriptor waits under
 * that handle (never issued, taken already, or expired). Owner thread. */
int node_gate_take(struct node_gate *g, const uint8_t *handle, size_t len, int *fd_p,
                   struct node_gate_peer *peer_p);

#endif /* KVF_NODE_LOCAL_ACCESS_H */
