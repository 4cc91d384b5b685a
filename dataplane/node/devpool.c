/*
 * devpool.c: device memory pools in kvfence-node (devpool.h).
 *
 * CUDA IPC pools are opened with kvf_pool_open_cuda_ipc: in a build without
 * CUDA the pool layer answers -ENOTSUP, which becomes FAILED_PRECONDITION
 * "this kvfence-node was built without CUDA"; with CUDA but no device (or an
 * ordinal beyond them) FAILED_PRECONDITION naming cuda_ipc.device, and a
 * handle the runtime refuses INVALID_ARGUMENT naming cuda_ipc.ipc_handle.
 * The fake device pool (--test-fake-device-pools PREFIX) exists so that the
 * same data path runs on a machine without a GPU: the node treats it exactly
 * as a CUDA pool except that its copies are memcpy. It comes two ways: a
 * host_shm pool whose name starts with PREFIX, or a cuda_ipc pool whose
 * handle is the clients' fake handle (kvf_fake_ipc.h) naming an object under
 * PREFIX, which is how the clients register "device memory" on a machine
 * without a GPU, through the same calls and fields as real CUDA memory.
 */
#include "devpool.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvf_fake_ipc.h"
#include "local.h"
#include "tcp.h"
#include "local_access.h"
#include "node_log.h"

const char *node_devpool_check_cuda_request(const Kvfence__V1__RegisterPoolRequest *r)
{
    const Kvfence__V1__CudaIpcMemory *c = r->cuda_ipc;
    if (r->page_size == 0 || r->page_count == 0)
        return "page_size and page_count must be >= 1";
    if (c->ipc_handle.len != KVF_POOL_CUDA_IPC_HANDLE_SIZE)
        return "cuda_ipc.ipc_handle: must be the 64 bytes of a cudaIpcMemHandle_t";
    if (c->size < (uint64_t)r->page_size * r->page_count)
        return "cuda_ipc.size: smaller than page_size x page_count";
    return NULL;
}

static bool fake_device_name(const struct kvf_node *n, const char *name)
{
    const char *pre = n->opts.test_fake_device_pools;
    return pre && pre[0] && name && strncmp(name, pre, strlen(pre)) == 0;
}

/* The memory behind `fd` at `offset`, `size`, as the kernel names it. */
static void memory_key(int fd, uint64_t offset, uint64_t size, char *key, size_t key_len)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        key[0] = '\0';
        return;
    }
    snprintf(key, key_len, "inode:%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64,
             (uint64_t)st.st_dev, (uint64_t)st.st_ino, offset, size);
}

/* A fake CUDA handle (kvf_fake_ipc.h) on a node with --test-fake-device-pools:
 * the shm object it names, opened as a fake device pool, by name and so
 * under the same access rule as host_shm. */
static int open_fake_cuda(struct kvf_node *n, const Kvfence__V1__CudaIpcMemory *c, const char *name,
                          uint32_t page_size, uint32_t page_count, struct kvf_pool **pool_p,
                          char *key, size_t key_len, char *msg, size_t msg_len)
{
    if (!fake_device_name(n, name)) {
        snprintf(msg, msg_len,
                 "cuda_ipc.ipc_handle: a fake handle of \"%s\", outside --test-fake-device-pools",
                 name);
        return KVF_GRPC_INVALID_ARGUMENT;
    }
    struct kvf_error err;
    kvf_error_clear(&err);
    int fd;
    int rc = kvf_pool_shm_open(name, &fd, &err);
    if (rc != 0) {
        snprintf(msg, msg_len, "cuda_ipc.ipc_handle (fake): %s", err.msg);
        return (int)kvf_errno_to_grpc_code(rc);
    }
    int code = node_access_check_shm(&n->access, fd, name, msg, msg_len);
    if (code != 0) {
        close(fd);
        return code;
    }
    rc = kvf_pool_open_fd(fd, KVF_POOL_FAKE_DEVICE, "cuda_ipc", c->offset, c->size, page_size,
                          page_count, pool_p, &err);
    if (rc == 0)
        memory_key(fd, c->offset, c->size, key, key_len);
    close(fd);
    if (rc == 0)
        return 0;
    snprintf(msg, msg_len, "%s", err.msg);
    return (int)kvf_errno_to_grpc_code(rc);
}

int node_devpool_open(struct kvf_node *n, const Kvfence__V1__RegisterPoolRequest *req,
                      struct kvf_pool **pool_p, char *key, size_t key_len, char *msg,
                      size_t msg_len)
{
    key[0] = '\0';
    struct kvf_error err;
    kvf_error_clear(&err);
    if (req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC) {
        const Kvfence__V1__CudaIpcMemory *c = req->cuda_ipc;
        char fake[KVF_FAKE_IPC_NAME_MAX + 1];
        if (n->opts.test_fake_device_pools && n->opts.test_fake_device_pools[0] &&
            kvf_fake_ipc_decode(c->ipc_handle.data, c->ipc_handle.len, fake))
            return open_fake_cuda(n, c, fake, req->page_size, req->page_count, pool_p, key, key_len,
                                  msg, msg_len);
        int rc = kvf_pool_open_cuda_ipc(c->ipc_handle.data, c->ipc_handle.len, c->device, c->offset,
                                        c->size, req->page_size, req->page_count, pool_p, &err);
        if (rc == 0)
            return 0;
        if (rc == -ENOTSUP) {
            snprintf(msg, msg_len, "cuda_ipc: this kvfence-node was built without CUDA");
            return KVF_GRPC_FAILED_PRECONDITION;
        }
        snprintf(msg, msg_len, "%s", err.msg);
        if (rc == -ENODEV)
            return KVF_GRPC_FAILED_PRECONDITION;
        if (rc == -ENOMEM)
            return KVF_GRPC_RESOURCE_EXHAUSTED;
        return KVF_GRPC_INVALID_ARGUMENT; /* -EINVAL geometry, -EIO a refused handle */
    }
    if (req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD) {
        const Kvfence__V1__HostFdMemory *hf = req->host_fd;
        int fd;
        struct node_gate_peer peer;
        if (node_gate_take(n->gate, hf->handle.data, hf->handle.len, &fd, &peer) != 0) {
            snprintf(msg, msg_len,
                     "host_fd.handle: no descriptor waits under it (never issued, used, or "
                     "expired)");
            return KVF_GRPC_NOT_FOUND;
        }
        int rc = kvf_pool_open_fd(fd, KVF_POOL_HOST_SHM, "host_fd", hf->offset, hf->size,
                                  req->page_size, req->page_count, pool_p, &err);
        if (rc == 0)
            memory_key(fd, hf->offset, hf->size, key, key_len);
        close(fd);
        if (rc == 0) {
            node_log("info", NULL, "host_fd pool: the descriptor came from pid %d uid %u gid %u",
                     (int)peer.pid, (unsigned)peer.uid, (unsigned)peer.gid);
            return 0;
        }
        snprintf(msg, msg_len, "%s", err.msg);
        return (int)kvf_errno_to_grpc_code(rc);
    }
    /* By name: the node opens it, so it must be no more than every caller of
     * the socket could open itself (local_access.h). */
    const Kvfence__V1__HostShmMemory *shm = req->host_shm;
    bool fake = fake_device_name(n, shm->shm_name);
    int fd;
    int rc = kvf_pool_shm_open(shm->shm_name, &fd, &err);
    if (rc != 0) {
        snprintf(msg, msg_len, "%s", err.msg);
        return (int)kvf_errno_to_grpc_code(rc);
    }
    int code = node_access_check_shm(&n->access, fd, shm->shm_name, msg, msg_len);
    if (code != 0) {
        close(fd);
        return code;
    }
    rc = kvf_pool_open_fd(fd, fake ? KVF_POOL_FAKE_DEVICE : KVF_POOL_HOST_SHM, "host_shm",
                          shm->offset, shm->size, req->page_size, req->page_count, pool_p, &err);
    if (rc == 0)
        memory_key(fd, shm->offset, shm->size, key, key_len);
    close(fd);
    if (rc == 0)
        return 0;
    snprintf(msg, msg_len, "%s", err.msg);
    return (int)kvf_errno_to_grpc_code(rc);
}

bool node_devpool_is(const struct node_pool *p)
{
    return kvf_pool_is_device(p->pool);
}

int node_devpool_add_tcp(struct kvf_transport *tcp, const struct node_pool *p)
{
    if (node_devpool_is(p))
        return kvf_transport_tcp_add_device_pool(tcp, p->id, p->pool);
    return kvf_transport_tcp_add_pool(tcp, p->id, p->base, p->page_size, p->page_count);
}

int node_devpool_add_local(struct kvf_transport *local, const struct node_pool *p)
{
    if (node_devpool_is(p))
        return kvf_transport_local_add_device_pool(local, p->id, p->pool);
    return kvf_transport_local_add_pool(local, p->id, p->base, p->page_size, p->page_count);
}

const char *node_devpool_kind_name(const struct node_pool *p)
{
    switch (kvf_pool_kind(p->pool)) {
    case KVF_POOL_CUDA_IPC:
        return "cuda_ipc";
    case KVF_POOL_FAKE_DEVICE:
        return "fake device (test)";
    case KVF_POOL_HOST_SHM:
        break;
    }
    return "host_shm";
}

void node_devpool_log_stats(const struct node_pool *p)
{
    if (!node_devpool_is(p))
        return;
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(p->pool, &st);
    node_log("info", NULL,
             "device pool %u (%s): writes=%" PRIu64 " write_bytes=%" PRIu64 " reads=%" PRIu64
             " read_bytes=%" PRIu64,
             p->id, node_devpool_kind_name(p), st.writes, st.write_bytes, st.reads, st.read_bytes);
}
/* ---- wire form ---------------------------------------------------------------- */

void node_pool_to_wire(const struct node_pool *p, Kvfence__V1__Pool *pv)
{
    kvfence__v1__pool__init(pv);
    pv->pool_id = p->id;
    pv->pool_key = (char *)p->key;
    bool cuda = p->pool && kvf_pool_kind(p->pool) == KVF_POOL_CUDA_IPC;
    pv->kind = cuda ? KVFENCE__V1__POOL_KIND__POOL_KIND_CUDA_IPC
                    : KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
    pv->cuda_device = cuda ? kvf_pool_device(p->pool) : 0;
    pv->page_size = p->page_size;
    pv->page_count = p->page_count;
    pv->owner_rank = p->rank;
    pv->base_addr = (uint64_t)(uintptr_t)p->base;
}

void node_pools_to_wire(struct kvf_node *n, Kvfence__V1__Pool *pv, Kvfence__V1__Pool **pp)
{
    for (uint32_t i = 0; i < n->npools; i++) {
        node_pool_to_wire(&n->pools[i], &pv[i]);
        pp[i] = &pv[i];
    }
}
