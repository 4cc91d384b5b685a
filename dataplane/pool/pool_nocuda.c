/*
 * pool_nocuda.c: the CUDA IPC opener of a node built without CUDA
 * (KVF_HAVE_CUDA off): every CUDA pool is refused with -ENOTSUP, so the node
 * does not advertise CUDA pools and an engine that tries gets a clear answer.
 */
#include <errno.h>

#include "pool_internal.h"

int kvf_pool_open_cuda_ipc(const void *handle, size_t handle_len, uint32_t device, uint64_t offset,
                           uint64_t size, uint32_t page_size, uint32_t page_count,
                           struct kvf_pool **pool_p, struct kvf_error *err)
{
    (void)handle;
    (void)handle_len;
    (void)device;
    (void)offset;
    (void)size;
    (void)page_size;
    (void)page_count;
    (void)pool_p;
    return kvf_error_set(err, -ENOTSUP, "cuda_ipc: this node was built without CUDA");
}

void pool_cuda_unmap(struct kvf_pool *pool)
{
    (void)pool; /* never reached: no CUDA pool can be opened */
}

int pool_cuda_copy(struct kvf_pool *pool, void *dst, const void *src, size_t len, bool to_device)
{
    (void)pool; /* never reached: no CUDA pool can be opened */
    (void)dst;
    (void)src;
    (void)len;
    (void)to_device;
    return -ENOTSUP;
}

int pool_cuda_copy_2d(struct kvf_pool *pool, void *dst, size_t dpitch, const void *src,
                      size_t spitch, size_t width, size_t rows, bool to_device)
{
    (void)pool; /* never reached: no CUDA pool can be opened */
    (void)dst;
    (void)dpitch;
    (void)src;
    (void)spitch;
    (void)width;
    (void)rows;
    (void)to_device;
    return -ENOTSUP;
}
