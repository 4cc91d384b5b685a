/*
 * pool.h: the memory pools an engine registers with its node (docs/design.md §1,
 * "pool"): `page_size` bytes x `page_count` pages of host shared memory (a
 * POSIX shm object the engine created) or of CUDA device memory (an allocation
 * the engine exported with cudaIpcGetMemHandle). The node maps the memory once
 * at RegisterPool and hands transports and staging engines page addresses.
 *
 * Lifetime of a pool: the node's control thread opens it, publishes it in its
 * pool registry, and closes it only after it took it out of the registry and
 * no room's lifetime can still touch its pages (the lifetime table says so:
 * kvf_lt_table_can_teardown(), or every lease on the pool is released). As a
 * second line of defence each pool carries a `busy` count: a transport or a
 * staging engine takes it (kvf_pool_busy_get) for as long as one of its ops
 * reads or writes the pool, and kvf_pool_close refuses with -EBUSY while it is
 * above zero. Once close has begun, busy_get refuses (-ENOENT), so no op can
 * slip in between the check and the unmap.
 *
 * DESIGN: open and close run on the node's control thread. kvf_pool_page and
 * the accessors read fields that never change after open and may run on any
 * thread; busy_get/busy_put are atomic and may run on any thread, but only on
 * a pool that is still open (the caller reached it through the registry).
 *
 * Errors: 0 or a negative errno (common/kvf_error.h); a struct kvf_error, when
 * given, says what was wrong.
 */
#ifndef KVF_POOL_H
#define KVF_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

struct kvf_pool;

enum kvf_pool_kind {
    KVF_POOL_HOST_SHM = 1, /* host shared memory: page addresses are host pointers */
    KVF_POOL_CUDA_IPC = 2, /* CUDA device memory: page addresses are device pointers */
    /* Tests only: a host shm object the node treats as device memory. Its
     * page addresses are host pointers, but nothing outside kvf_pool_read and
     * kvf_pool_write may dereference them, so the device data path runs (and
     * is counted) on a machine without a GPU. */
    KVF_POOL_FAKE_DEVICE = 3,
    /* Several buffers (each a pool of one of the kinds above) with one page
     * geometry: page i is slot i of every buffer (kvf_pool_open_buffers). Its
     * page addresses name a reserved, inaccessible range: unique, but never
     * to dereference; its bytes move only through kvf_pool_read/write. */
    KVF_POOL_MULTI = 4,
};

/* Buffers of one multi-buffer pool, at most. */
#define KVF_POOL_MAX_BUFFERS 1024u

/* Size of a cudaIpcMemHandle_t (node.proto CudaIpcMemory.ipc_handle). */
#define KVF_POOL_CUDA_IPC_HANDLE_SIZE 64u

/*
 * Maps the existing POSIX shared-memory object `name` ("/sglang-kv-0"; it must
 * start with '/' and contain no other '/') read-write and shared, and makes the
 * `size` bytes from byte `offset` of it a pool of `page_count` pages of
 * `page_size` bytes. Returns 0 and writes `*pool_p`, or:
 *   -EINVAL  a bad name, page_size or page_count of 0, size < page_size x
 *            page_count, or the object is shorter than offset + size;
 *   -ENOENT  no such object;
 *   -EACCES  the node may not open it read-write;
 *   -ENOMEM, or another -errno of shm_open/fstat/mmap.
 * The object stays owned by the engine: the node never unlinks it.
 * Control thread.
 */
int kvf_pool_open_shm(const char *name, uint64_t offset, uint64_t size, uint32_t page_size,
                      uint32_t page_count, struct kvf_pool **pool_p, struct kvf_error *err);

/* Validates `name` as kvf_pool_open_shm does and opens the object read-write
 * (close-on-exec, no symlink followed): 0 and *fd_p, or the errors of
 * kvf_pool_open_shm. The node checks the descriptor (fstat) before it maps
 * it with kvf_pool_open_fd. Any thread. */
int kvf_pool_shm_open(const char *name, int *fd_p, struct kvf_error *err);

/*
 * Maps `size` bytes from byte `offset` of the open descriptor `fd` (a POSIX
 * shm object or a memfd, opened read-write) read-write and shared, as a pool
 * of `kind` KVF_POOL_HOST_SHM or KVF_POOL_FAKE_DEVICE; `what` ("host_fd")
 * prefixes the messages. The caller keeps `fd` (the mapping does not need
 * it). Errors as kvf_pool_open_shm, and -EBADF when `fd` is not a regular
 * file, -EACCES when it was not opened read-write. Control thread.
 */
int kvf_pool_open_fd(int fd, enum kvf_pool_kind kind, const char *what, uint64_t offset,
                     uint64_t size, uint32_t page_size, uint32_t page_count,
                     struct kvf_pool **pool_p, struct kvf_error *err);

/*
 * Opens the CUDA allocation exported by an engine (`handle`, `handle_len`
 * bytes, a cudaIpcMemHandle_t) on device `device` with cudaIpcOpenMemHandle,
 * and makes the `size` bytes from `offset` of it a pool. Same errors as
 * kvf_pool_open_shm for the geometry, -ENODEV for a bad device, -EIO when the
 * CUDA runtime refuses the handle, and -ENOTSUP when this node was built
 * without CUDA. Control thread.
 */
int kvf_pool_open_cuda_ipc(const void *handle, size_t handle_len, uint32_t device, uint64_t offset,
                           uint64_t size, uint32_t page_size, uint32_t page_count,
                           struct kvf_pool **pool_p, struct kvf_error *err);

/*
 * Tests only: kvf_pool_open_shm, but the pool is KVF_POOL_FAKE_DEVICE (above).
 * Same errors. Control thread.
 */
int kvf_pool_open_fake_device(const char *name, uint64_t offset, uint64_t size, uint32_t page_size,
                              uint32_t page_count, struct kvf_pool **pool_p, struct kvf_error *err);

/*
 * Makes the `nbufs` open pools `bufs` (1 .. KVF_POOL_MAX_BUFFERS, none of
 * them KVF_POOL_MULTI, all with the same page_count) one pool of kind
 * KVF_POOL_MULTI: its page_size is the sum of theirs, and byte `o` of its
 * page i is byte `o - at(b)` of buffer b's page i, where at(b) is the sum of
 * the page sizes of the buffers before b (a page is their slots in buffer
 * order). On success the pool owns the buffers (kvf_pool_close closes them);
 * on error the caller keeps them. -EINVAL (a message naming "buffers[i]":
 * another page_count, a nested multi-buffer pool, page sizes whose sum
 * exceeds UINT32_MAX, a count out of range), -ENOMEM. Control thread.
 */
int kvf_pool_open_buffers(struct kvf_pool *const *bufs, uint32_t nbufs, struct kvf_pool **pool_p,
                          struct kvf_error *err);

/* Buffers of a KVF_POOL_MULTI pool; 0 for any other kind. Any thread. */
uint32_t kvf_pool_buffer_count(const struct kvf_pool *pool);

/* Buffer `i` of a KVF_POOL_MULTI pool (owned by it), or NULL. Any thread. */
struct kvf_pool *kvf_pool_buffer(const struct kvf_pool *pool, uint32_t i);

/* The page layout of a KVF_POOL_MULTI pool as a 32-bit fingerprint of its
 * buffer count and slot sizes in order (FNV-1a, never 0); 0 for any other
 * pool (one span a page: any layout can land in it). Two multi-buffer pools
 * with the same page size but other slots would scramble each other's
 * pages: the node refuses such a transfer by comparing these. Any thread. */
uint32_t kvf_pool_layout(const struct kvf_pool *pool);

/*
 * Unmaps the pool (munmap, or cudaIpcCloseMemHandle) and frees it. Call only
 * when no room's lifetime can touch its pages any more (see the top of this
 * file); -EBUSY (and nothing changes) while its busy count is above zero.
 * Accepts NULL (returns 0). Control thread.
 */
int kvf_pool_close(struct kvf_pool *pool);

/* The address of page `page`, or NULL when page >= page_count. For a CUDA
 * pool it is a device pointer; for any device pool (kvf_pool_is_device) only
 * an address to hand to CUDA, never to dereference. Any thread. */
void *kvf_pool_page(const struct kvf_pool *pool, uint32_t page);

/* Checks that bytes [offset, offset + len) from the start of page `first`
 * lie inside the pool: 0 or -ERANGE. Any thread. */
int kvf_pool_check_range(const struct kvf_pool *pool, uint32_t first, uint64_t offset,
                         uint64_t len);

/*
 * Device pages are touched only through these two: they copy `len` bytes
 * between host memory and bytes [offset, offset + len) from the start of page
 * 0, synchronously (the bytes have landed, or were read, when they return).
 * HOST_SHM and FAKE_DEVICE: memcpy; CUDA_IPC: cudaMemcpy on the pool's device
 * (the calling thread's current device is set to it); MULTI: each page's
 * bytes are scattered to (gathered from) the buffers' slots, one strided
 * copy per buffer for a run of whole pages (cudaMemcpy2D for a CUDA
 * buffer), and each buffer counts its own copies too. `src`/`dst` are host
 * memory. 0, -ERANGE (outside the pool; nothing copied), or -EIO (the CUDA
 * runtime failed; the range may hold a partial copy). Any thread, on an open
 * pool that the caller holds busy (or otherwise keeps open).
 */
int kvf_pool_write(struct kvf_pool *pool, uint64_t offset, const void *src, size_t len);
int kvf_pool_read(struct kvf_pool *pool, uint64_t offset, void *dst, size_t len);

/* True for a pool whose pages the node must not dereference: CUDA_IPC,
 * FAKE_DEVICE and MULTI (a multi-buffer page is no one span of memory, even
 * when every buffer is host memory). Any thread. */
bool kvf_pool_is_device(const struct kvf_pool *pool);

/* Copies done by kvf_pool_write / kvf_pool_read since open (every kind):
 * tests prove with them that a device pool's bytes went the device path. */
struct kvf_pool_io_stats {
    uint64_t writes;
    uint64_t write_bytes;
    uint64_t reads;
    uint64_t read_bytes;
};
void kvf_pool_io_stats(const struct kvf_pool *pool, struct kvf_pool_io_stats *out);

/* Takes one busy reference for an op that touches the pool: 0, or -ENOENT once
 * close has begun. Any thread. */
int kvf_pool_busy_get(struct kvf_pool *pool);

/* Drops a reference taken by kvf_pool_busy_get. Any thread. */
void kvf_pool_busy_put(struct kvf_pool *pool);

/* Current busy count (statistics and tests). */
uint64_t kvf_pool_busy(const struct kvf_pool *pool);

enum kvf_pool_kind kvf_pool_kind(const struct kvf_pool *pool);
uint32_t kvf_pool_page_size(const struct kvf_pool *pool);
uint32_t kvf_pool_page_count(const struct kvf_pool *pool);
uint64_t kvf_pool_size(const struct kvf_pool *pool);
/* CUDA_IPC: the device ordinal; 0 for other kinds. */
uint32_t kvf_pool_device(const struct kvf_pool *pool);

#endif /* KVF_POOL_H */
