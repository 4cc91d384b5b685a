/*
 * devpool.h: device memory pools in kvfence-node (docs/node.md, "Device
 * pools"): opening a RegisterPool request's memory (host shm, CUDA IPC, or
 * the tests' fake device pool), handing device pools to the transports,
 * their copy statistics, and a pool's wire form (Pool).
 *
 * Device pages (kvf_pool_is_device) are touched only through kvf_pool_read /
 * kvf_pool_write: the TCP receiver lands a frame through a host bounce
 * buffer, the local transport copies through the pool functions, the source
 * stages the pages into a host buffer first (a remote sink without staging is
 * refused), and RDMA never registers them.
 *
 * DESIGN: everything here runs on the node's owner thread.
 */
#ifndef KVF_NODE_DEVPOOL_H
#define KVF_NODE_DEVPOOL_H

#include <stdbool.h>
#include <stddef.h>

#include "node_types.h"

/* Opens the memory of `req` into *pool_p: its `memory`, or each of its
 * `buffers` and a multi-buffer pool over them (kvf_pool_open_buffers; a
 * refusal closes the buffers opened). 0, or a gRPC code with `msg` naming
 * the field (cuda_ipc.ipc_handle, cuda_ipc.device, host_shm...,
 * buffers[3].host_fd.handle). A cuda_ipc handle that is the clients' fake
 * (kvf_fake_ipc.h) opens as a fake device pool on a node with
 * opts.test_fake_device_pools. With
 * opts.test_fake_device_pools set, a host_shm pool whose shm_name starts with
 * it is opened as a fake device pool (tests). On success `key` (key_len
 * bytes) holds the memory's identity on this host as the kernel names it:
 * the device and inode of the object or descriptor opened, with offset and
 * size, so the same memory registered again after a node restart gets the
 * same key whatever name or descriptor it comes by; "" for device memory. */
int node_devpool_open(struct kvf_node *n, const Kvfence__V1__RegisterPoolRequest *req,
                      struct kvf_pool **pool_p, char *key, size_t key_len, char *msg,
                      size_t msg_len);

/* Shape checks of a request with `buffers` on the CQ thread (no memory
 * beside them, at most KVF_POOL_MAX_BUFFERS, each with a page_size, one
 * memory and a size for page_count pages; page_size 0 or their sum): NULL,
 * or the INVALID_ARGUMENT message naming the field ("buffers[3].page_size:
 * must be >= 1"), in `msg` or a constant. */
const char *node_devpool_check_buffers(const Kvfence__V1__RegisterPoolRequest *r, char *msg,
                                       size_t cap);

/* Shape checks of a cuda_ipc request on the CQ thread: NULL or the
 * INVALID_ARGUMENT message. */
const char *node_devpool_check_cuda_request(const Kvfence__V1__RegisterPoolRequest *r);

/* Adds a pool to the TCP transport: a device pool through
 * kvf_transport_tcp_add_device_pool. 0 or -errno. */
int node_devpool_add_tcp(struct kvf_transport *tcp, const struct node_pool *p);

/* The same for the local transport. */
int node_devpool_add_local(struct kvf_transport *local, const struct node_pool *p);

/* True for a device pool. */
bool node_devpool_is(const struct node_pool *p);

/* What the pool was registered from ("host_shm", "cuda_ipc", "fake device
 * (test)", "multi-buffer"), for logs. */
const char *node_devpool_kind_name(const struct node_pool *p);
const char *node_devpool_pool_kind_name(const struct kvf_pool *pool);

/* Logs the device-pool copy counts of `p` (nothing for a host pool):
 * "device pool N (KIND): writes=W write_bytes=B reads=R read_bytes=B", and
 * for a multi-buffer pool one line per buffer, "pool N buffer I (KIND): ...". */
void node_devpool_log_stats(const struct node_pool *p);

/* Pool `p` as node.proto's Pool (pool_key points into `p`: valid while it
 * is registered). */
void node_pool_to_wire(const struct node_pool *p, Kvfence__V1__Pool *pv);
/* Every registered pool of `n`: pv[i] filled, pp[i] = &pv[i] (both of
 * NODE_MAX_POOLS entries). Owner thread. */
void node_pools_to_wire(struct kvf_node *n, Kvfence__V1__Pool *pv, Kvfence__V1__Pool **pp);

#endif /* KVF_NODE_DEVPOOL_H */
