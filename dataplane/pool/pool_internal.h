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

/* One buffer of a MULTI pool: the buffer, and where its slot lies in a page. */
struct pool_buf {
    struct kvf_pool *pool;
    uint32_t at;        /* bytes of the slots before it in a page */
    uint32_t page_size; /* its slot: bytes of it per page */
};

struct kvf_pool {
    enum kvf_pool_kind kind;
    uint32_t page_size;
    uint32_t page_count;
    uint64_t size;   /* bytes of the pool */
    uint8_t *base;   /* first byte of page 0 (host or device pointer) */
    void *map_base;  /* what was mapped/opened: munmap / cudaIpcCloseMemHandle it */
    size_t map_len;  /* HOST_SHM: bytes mapped at map_base */
    uint32_t device; /* CUDA_IPC: the device ordinal */
    uint32_t nbufs;  /* MULTI: its buffers (bufs[]); map_base/map_len reserve its addresses */
    struct pool_buf *bufs;
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

/* A strided CUDA_IPC copy (cudaMemcpy2D): `rows` rows of `width` bytes,
 * `dpitch` / `spitch` bytes apart at the destination / source. 0 or -EIO. */
int pool_cuda_copy_2d(struct kvf_pool *pool, void *dst, size_t dpitch, const void *src,
                      size_t spitch, size_t width, size_t rows, bool to_device);

/* Copies `rows` rows of `width` bytes between the pool at `offset` (rows
 * back to back: a buffer's slots of consecutive pages) and host memory
 * (rows `host_pitch` apart: the same slots in a page-major frame). Counts
 * one copy. 0, -ERANGE, -EIO. */
int pool_io_2d(struct kvf_pool *pool, uint64_t offset, uint8_t *host, size_t host_pitch,
               size_t width, size_t rows, bool to_pool);

/* A MULTI pool's copies (pool_multi.c): the arguments of pool_io. */
int pool_multi_io(struct kvf_pool *pool, uint64_t offset, uint8_t *host, size_t len, bool to_pool);

/* Closes a MULTI pool's buffers and its address reservation (pool_multi.c). */
void pool_multi_unmap(struct kvf_pool *pool);

#endif /* KVF_POOL_INTERNAL_H */
