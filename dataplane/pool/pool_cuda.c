/*
 * pool_cuda.c: CUDA IPC pools (built only with KVF_HAVE_CUDA). An engine
 * exports its KV allocation with cudaIpcGetMemHandle and sends the 64-byte
 * handle in RegisterPool; the node opens it with cudaIpcOpenMemHandle on the
 * engine's device and closes it with cudaIpcCloseMemHandle. Page addresses
 * are device pointers: only CUDA copies and GPUDirect RDMA may use them.
 *
 * Plain C against the CUDA runtime API (no .cu file, no nvcc).
 *
 * DESIGN: open and close run on the node's control thread; each call sets the
 * calling thread's current device first (the runtime keeps it per thread).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "pool_internal.h"
#include "kvf_log.h"

int kvf_pool_open_cuda_ipc(const void *handle, size_t handle_len, uint32_t device, uint64_t offset,
                           uint64_t size, uint32_t page_size, uint32_t page_count,
                           struct kvf_pool **pool_p, struct kvf_error *err)
{
    if (handle == NULL || handle_len != sizeof(cudaIpcMemHandle_t))
        return kvf_error_set(err, -EINVAL, "cuda_ipc.ipc_handle: %zu bytes, expected %zu",
                             handle == NULL ? (size_t)0 : handle_len, sizeof(cudaIpcMemHandle_t));
    int rc = pool_check_geometry("cuda_ipc", offset, size, page_size, page_count, UINT64_MAX, err);
    if (rc != 0)
        return rc;

    int ndev = 0;
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess)
        return kvf_error_set(err, -ENODEV, "cuda_ipc.device: no CUDA device on this node: %s",
                             cudaGetErrorString(ce));
    if (device >= (uint32_t)ndev)
        return kvf_error_set(err, -ENODEV, "cuda_ipc.device: %u, this node has %d CUDA devices",
                             device, ndev);
    ce = cudaSetDevice((int)device);
    if (ce != cudaSuccess)
        return kvf_error_set(err, -ENODEV, "cuda_ipc.device: cudaSetDevice(%u): %s", device,
                             cudaGetErrorString(ce));

    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    void *dev_ptr = NULL;
    ce = cudaIpcOpenMemHandle(&dev_ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (ce != cudaSuccess)
        return kvf_error_set(err, -EIO,
                             "cuda_ipc.ipc_handle: cudaIpcOpenMemHandle on device %u: %s", device,
                             cudaGetErrorString(ce));
    /* The runtime does not say how large the allocation is (cuMemGetAddressRange
     * would, through the driver API); the engine's size is trusted here and the
     * copies that run out of range fail with an error completion. */
    struct kvf_pool *pool = pool_alloc(KVF_POOL_CUDA_IPC, size, page_size, page_count);
    if (pool == NULL) {
        rc = kvf_error_set(err, -ENOMEM, "cuda_ipc: out of memory");
        goto err_close_handle;
    }
    pool->map_base = dev_ptr;
    pool->base = (uint8_t *)dev_ptr + offset;
    pool->device = device;
    *pool_p = pool;
    return 0;

err_close_handle:
    cudaIpcCloseMemHandle(dev_ptr);
    return rc;
}

void pool_cuda_unmap(struct kvf_pool *pool)
{
    cudaError_t ce = cudaSetDevice((int)pool->device);
    if (ce == cudaSuccess)
        ce = cudaIpcCloseMemHandle(pool->map_base);
    if (ce != cudaSuccess)
        kvf_log("error", "kvf_pool_close: cudaIpcCloseMemHandle on device %u: %s", pool->device,
                cudaGetErrorString(ce));
}

int pool_cuda_copy(struct kvf_pool *pool, void *dst, const void *src, size_t len, bool to_device)
{
    /* The runtime's current device is per thread: set it on every call, the
     * receiver and staging threads never set one themselves. */
    cudaError_t ce = cudaSetDevice((int)pool->device);
    if (ce == cudaSuccess)
        ce = cudaMemcpy(dst, src, len, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess) {
        kvf_log("error", "kvf_pool: cudaMemcpy %s device %u, %zu bytes: %s",
                to_device ? "to" : "from", pool->device, len, cudaGetErrorString(ce));
        return -EIO;
    }
    return 0;
}

int pool_cuda_copy_2d(struct kvf_pool *pool, void *dst, size_t dpitch, const void *src,
                      size_t spitch, size_t width, size_t rows, bool to_device)
{
    cudaError_t ce = cudaSetDevice((int)pool->device);
    if (ce == cudaSuccess)
        ce = cudaMemcpy2D(dst, dpitch, src, spitch, width, rows,
                          to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
    if (ce != cudaSuccess) {
        kvf_log("error", "kvf_pool: cudaMemcpy2D %s device %u, %zu x %zu bytes: %s",
                to_device ? "to" : "from", pool->device, rows, width, cudaGetErrorString(ce));
        return -EIO;
    }
    return 0;
}
