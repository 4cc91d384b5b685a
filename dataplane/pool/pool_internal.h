/*
 * pool_internal.h: what pool.c and the CUDA IPC opener (pool_cuda.c, or
 * pool_nocuda.c in a build without CUDA) share. Private to dataplane/pool/.
 */
#ifndef KVF_POOL_INTERNAL_H
#define KVF_POOL_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "pool.h"

/* busy word: bit 63 says close has begun, the low bits count busy references. */
#define POOL_CLOSING (UINT64_C(1) << 63)

struct kvf_pool {
    enum kvf_pool_kind kind;
    uint32_t page_size;
    uint32_t page_count;
    uint64_t size;   /* bytes of the pool */
    uint8_t *base;   /* first byte of page 0 (host or device pointer) */
    void *map_base;  /* what was mapped/opened: munmap / cudaIpcCloseMemHandle it */
    size_t map_len;  /* HOST_SHM: bytes mapped at map_base */
    uint32_t device; /* CUDA_IPC: the device ordinal */
    _Atomic uint64_t busy;
    _Atomic uint64_t io_writes, io_write_bytes, io_reads, io_read_bytes;
};

/* Checks page_size, page_count, size and that offset + size does not exceed
 * `avail` bytes (UINT64_MAX when unknown). 0 or -EINVAL with a message. */
int pool_check_geometry(const char *what, uint64_t offset, uint64_t size, uint32_t page_size,
                        uint32_t page_count, uint64_t avail, struct kvf_error *err);

/* Allocates a pool struct with the geometry filled in, busy 0. NULL on ENOMEM. */
struct kvf_pool *pool_alloc(enum kvf_pool_kind kind, uint64_t size, uint32_t page_size,
                            uint32_t page_count);

/* Closes the CUDA IPC mapping of `pool` (pool_cuda.c); logs failures. */
void pool_cuda_unmap(struct kvf_pool *pool);

/* CUDA_IPC copies (pool_cuda.c; -ENOTSUP in pool_nocuda.c, never reached):
 * synchronous cudaMemcpy between host memory and `dev` on the pool's device.
 * 0 or -EIO. */
int pool_cuda_copy(struct kvf_pool *pool, void *dst, const void *src, size_t len, bool to_device);

#endif /* KVF_POOL_INTERNAL_H */
