/*
 * host_lock.h: the node's exclusive lock on its host, the witness of its
 * predecessors' death (docs/design.md §4, "Lost node"; docs/node.md, "Host lock").
 *
 * kvfence-node holds an exclusive flock(2) on one file of its run directory
 * for its whole life; the file says which incarnation holds it. The kernel
 * drops the lock only when the holder's last descriptor of it closes, which
 * is when the process has died (all its threads have left their memory
 * mappings by then); a paused process keeps it. So a new process that takes
 * the lock knows that every incarnation recorded there before, and every
 * earlier one of this node id on this host, can touch nothing any more, and
 * says so in its Hello (witnessed_gone). No timer is involved.
 *
 * DESIGN: called by kvf_node_start (before any thread) and by the owner
 * thread (node_self_fence); the descriptor is O_CLOEXEC so that no child
 * inherits the lock.
 */
#ifndef KVF_NODE_HOST_LOCK_H
#define KVF_NODE_HOST_LOCK_H

#include <stdint.h>

/*
 * Opens (creating it, mode 0600) and locks `path` without waiting. On success
 * *fd_p is the descriptor to keep open for the node's life and *prev_p the
 * incarnation the file recorded (0: none). Errors: -EWOULDBLOCK (a live
 * process holds it: another kvfence-node of this host with the same run
 * directory), or the errno of open/flock/read.
 */
int node_host_lock_take(const char *path, int *fd_p, uint64_t *prev_p);

/* Records `incarnation` as the holder's. 0 or a negative errno. */
int node_host_lock_record(int fd, uint64_t incarnation);

#endif /* KVF_NODE_HOST_LOCK_H */
