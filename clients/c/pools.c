/*
 * pools.c: registering device memory with the node (kvfence.h, "CUDA
 * device memory"): the export of a device pointer (the fake's first, then
 * CUDA's) and RegisterPool with cuda_ipc. Host memory by name or descriptor
 * is kvfence.c's.
 *
 * Calls block the calling thread until the node answers; any thread.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

int kvf_cuda_ipc_export(const void *dev_ptr, struct kvf_cuda_ipc *out, struct kvf_status *st)
{
    if (!dev_ptr || !out)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_cuda_ipc_export: dev_ptr and out are required");
    struct kvf_cuda_ipc ipc;
    if (!client_fake_export(dev_ptr, &ipc)) {
        int rc = client_cuda_export(dev_ptr, &ipc, st);
        if (rc != 0)
            return rc;
    }
    *out = ipc;
    return client_status(st, KVF_STATUS_OK, "%s", "");
}

/* The cuda_ipc memory of `ipc` + `pool` in `cm` (which points into ipc). */
static void cuda_memory(Kvfence__V1__CudaIpcMemory *cm, const struct kvf_cuda_ipc *ipc,
                        uint64_t size)
{
    kvfence__v1__cuda_ipc_memory__init(cm);
    cm->ipc_handle.data = (uint8_t *)ipc->handle;
    cm->ipc_handle.len = sizeof ipc->handle;
    cm->offset = ipc->offset;
    cm->size = size;
    cm->device = ipc->device;
}

int kvf_register_pool_cuda_ipc(kvf_node_client *n, const struct kvf_cuda_ipc *ipc,
                               const struct kvf_cuda_pool *pool, uint32_t *pool_id_out,
                               struct kvf_status *st)
{
    if (!n || !ipc || !pool)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_cuda_ipc: node client, ipc and pool are required");
    Kvfence__V1__CudaIpcMemory cm;
    cuda_memory(&cm, ipc, pool->size);
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC;
    req.cuda_ipc = &cm;
    req.page_size = pool->page_size;
    req.page_count = pool->page_count;
    req.rank = pool->rank;
    req.pool_key = (char *)(pool->pool_key ? pool->pool_key : "");
    return client_register_pool(n, &req, pool_id_out, st);
}

int kvf_register_pool_cuda(kvf_node_client *n, const struct kvf_cuda_pool *pool,
                           uint32_t *pool_id_out, struct kvf_status *st)
{
    if (!n || !pool || !pool->dev_ptr)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_cuda: node client and pool.dev_ptr are required");
    struct kvf_cuda_ipc ipc;
    int rc = kvf_cuda_ipc_export(pool->dev_ptr, &ipc, st);
    if (rc != 0)
        return rc;
    return kvf_register_pool_cuda_ipc(n, &ipc, pool, pool_id_out, st);
}
