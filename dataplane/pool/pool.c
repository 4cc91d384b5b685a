/*
 * pool.c: host shared-memory pools and what every pool kind shares (geometry
 * checks, page addresses, the busy count, close).
 *
 * A HOST_SHM pool maps an existing POSIX shm object created by an engine with
 * shm_open(O_RDWR) + mmap(MAP_SHARED). The pool may start at any byte offset of
 * the object; mmap needs a page-aligned file offset, so the mapping starts at
 * the system page below `offset` and `base` points `offset` bytes in. The file
 * descriptor is closed right after mmap (the mapping keeps the object alive).
 * kvf_pool_open_fd maps a descriptor the caller already holds (one an engine
 * handed to the node, or one the node opened and checked): kvf_pool_open_shm
 * is shm_open + kvf_pool_open_fd.
 *
 * A FAKE_DEVICE pool (tests) is a HOST_SHM mapping with another kind: the
 * node reaches its bytes only through kvf_pool_read/kvf_pool_write, as it
 * must for CUDA memory; those count every copy so tests can see the path.
 *
 * Multi-buffer pools (KVF_POOL_MULTI) are pool_multi.c's; their copies come
 * through pool_io here, which hands them over after the range check.
 *
 * DESIGN: see pool.h. The only mutable field after open is `busy`, an atomic
 * word whose bit 63 (POOL_CLOSING) is set by close with one CAS from exactly 0,
 * so close and busy_get never both succeed on one pool.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pool_internal.h"
#include "kvf_log.h"

int pool_check_geometry(const char *what, uint64_t offset, uint64_t size, uint32_t page_size,
                        uint32_t page_count, uint64_t avail, struct kvf_error *err)
{
    if (page_size == 0)
        return kvf_error_set(err, -EINVAL, "%s: page_size must be >= 1", what);
    if (page_count == 0)
        return kvf_error_set(err, -EINVAL, "%s: page_count must be >= 1", what);
    uint64_t need = (uint64_t)page_size * page_count; /* < 2^64: both are 32-bit */
    if (size < need)
        return kvf_error_set(
            err, -EINVAL, "%s: size %llu is smaller than page_size %u x page_count %u = %llu", what,
            (unsigned long long)size, page_size, page_count, (unsigned long long)need);
    if (offset > avail || size > avail - offset)
        return kvf_error_set(
            err, -EINVAL, "%s: offset %llu + size %llu exceeds the object's %llu bytes", what,
            (unsigned long long)offset, (unsigned long long)size, (unsigned long long)avail);
    return 0;
}

struct kvf_pool *pool_alloc(enum kvf_pool_kind kind, uint64_t size, uint32_t page_size,
                            uint32_t page_count)
{
    struct kvf_pool *pool = calloc(1, sizeof(*pool));
    if (pool == NULL)
        return NULL;
    pool->kind = kind;
    pool->size = size;
    pool->page_size = page_size;
    pool->page_count = page_count;
    atomic_init(&pool->busy, 0);
    atomic_init(&pool->io_writes, 0);
    atomic_init(&pool->io_write_bytes, 0);
    atomic_init(&pool->io_reads, 0);
    atomic_init(&pool->io_read_bytes, 0);
    return pool;
}

/* A POSIX shm name: "/name", 2..NAME_MAX bytes, no other '/'. */
static int pool_check_shm_name(const char *name, struct kvf_error *err)
{
    if (name == NULL || name[0] != '/' || name[1] == '\0')
        return kvf_error_set(err, -EINVAL, "host_shm.shm_name: \"%s\" must start with '/'",
                             name != NULL ? name : "(null)");
    size_t len = strnlen(name, 256);
    if (len > 255)
        return kvf_error_set(err, -EINVAL, "host_shm.shm_name: longer than 255 bytes");
    if (strchr(name + 1, '/') != NULL)
        return kvf_error_set(err, -EINVAL, "host_shm.shm_name: \"%s\" contains a second '/'", name);
    return 0;
}

int kvf_pool_open_fake_device(const char *name, uint64_t offset, uint64_t size, uint32_t page_size,
                              uint32_t page_count, struct kvf_pool **pool_p, struct kvf_error *err)
{
    int rc = kvf_pool_open_shm(name, offset, size, page_size, page_count, pool_p, err);
    if (rc == 0)
        (*pool_p)->kind = KVF_POOL_FAKE_DEVICE; /* still unmapped as shm at close */
    return rc;
}

int kvf_pool_shm_open(const char *name, int *fd_p, struct kvf_error *err)
{
    int rc = pool_check_shm_name(name, err);
    if (rc != 0)
        return rc;
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT)
            return kvf_error_set(err, -ENOENT, "host_shm: no shared memory object \"%s\"", name);
        if (e == EACCES)
            return kvf_error_set(err, -EACCES, "host_shm: no permission to open \"%s\" read-write",
                                 name);
        return kvf_error_set(err, -e, "host_shm: shm_open(\"%s\"): %s", name, strerror(e));
    }
    *fd_p = fd;
    return 0;
}

int kvf_pool_open_shm(const char *name, uint64_t offset, uint64_t size, uint32_t page_size,
                      uint32_t page_count, struct kvf_pool **pool_p, struct kvf_error *err)
{
    int rc = pool_check_shm_name(name, err);
    if (rc != 0)
        return rc;
    rc = pool_check_geometry("host_shm", offset, size, page_size, page_count, UINT64_MAX, err);
    if (rc != 0)
        return rc;
    int fd;
    rc = kvf_pool_shm_open(name, &fd, err);
    if (rc != 0)
        return rc;
    rc = kvf_pool_open_fd(fd, KVF_POOL_HOST_SHM, "host_shm", offset, size, page_size, page_count,
                          pool_p, err);
    close(fd);
    return rc;
}

int kvf_pool_open_fd(int fd, enum kvf_pool_kind kind, const char *what, uint64_t offset,
                     uint64_t size, uint32_t page_size, uint32_t page_count,
                     struct kvf_pool **pool_p, struct kvf_error *err)
{
    if (kind != KVF_POOL_HOST_SHM && kind != KVF_POOL_FAKE_DEVICE)
        return kvf_error_set(err, -EINVAL, "%s: only host memory maps from a descriptor", what);
    int rc = pool_check_geometry(what, offset, size, page_size, page_count, UINT64_MAX, err);
    if (rc != 0)
        return rc;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        return kvf_error_set(err, -e, "%s: fstat: %s", what, strerror(e));
    }
    if (!S_ISREG(st.st_mode))
        return kvf_error_set(err, -EBADF, "%s: not a shared memory object or memfd", what);
    rc = pool_check_geometry(what, offset, size, page_size, page_count, (uint64_t)st.st_size, err);
    if (rc != 0)
        return rc;

    long sys_page = sysconf(_SC_PAGESIZE);
    uint64_t map_off = offset / (uint64_t)sys_page * (uint64_t)sys_page;
    uint64_t map_len = offset - map_off + size;
    if (map_len > SIZE_MAX)
        return kvf_error_set(err, -EINVAL, "%s: %llu bytes do not fit the address space", what,
                             (unsigned long long)map_len);
    void *map = mmap(NULL, (size_t)map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)map_off);
    if (map == MAP_FAILED) {
        int e = errno;
        return kvf_error_set(err, -e, "%s: mmap(%llu bytes): %s", what, (unsigned long long)map_len,
                             strerror(e));
    }
    struct kvf_pool *pool = pool_alloc(kind, size, page_size, page_count);
    if (pool == NULL) {
        rc = kvf_error_set(err, -ENOMEM, "%s: out of memory", what);
        goto err_unmap;
    }
    pool->map_base = map;
    pool->map_len = (size_t)map_len;
    pool->base = (uint8_t *)map + (offset - map_off);
    *pool_p = pool;
    return 0;

err_unmap:
    munmap(map, (size_t)map_len);
    return rc;
}

int kvf_pool_close(struct kvf_pool *pool)
{
    if (pool == NULL)
        return 0;
    uint64_t expect = 0;
    if (!atomic_compare_exchange_strong_explicit(&pool->busy, &expect, POOL_CLOSING,
                                                 memory_order_acq_rel, memory_order_acquire))
        return -EBUSY;
    switch (pool->kind) {
    case KVF_POOL_HOST_SHM:
    case KVF_POOL_FAKE_DEVICE:
        if (munmap(pool->map_base, pool->map_len) != 0)
            kvf_log("error", "kvf_pool_close: munmap: %s", strerror(errno));
        break;
    case KVF_POOL_CUDA_IPC:
        pool_cuda_unmap(pool);
        break;
    case KVF_POOL_MULTI:
        pool_multi_unmap(pool);
        break;
    }
    free(pool);
    return 0;
}

void *kvf_pool_page(const struct kvf_pool *pool, uint32_t page)
{
    if (page >= pool->page_count)
        return NULL;
    return pool->base + (uint64_t)page * pool->page_size;
}

int kvf_pool_check_range(const struct kvf_pool *pool, uint32_t first, uint64_t offset, uint64_t len)
{
    uint64_t total = (uint64_t)pool->page_size * pool->page_count;
    uint64_t start = (uint64_t)first * pool->page_size;
    if (first >= pool->page_count || offset > total - start || len > total - start - offset)
        return -ERANGE;
    return 0;
}

/* [offset, offset + len) inside the pool's pages. */
static bool io_in_range(const struct kvf_pool *pool, uint64_t offset, size_t len)
{
    uint64_t total = (uint64_t)pool->page_size * pool->page_count;
    return offset <= total && (uint64_t)len <= total - offset;
}

/* Counts one copy of `len` bytes into (to_pool) or out of `pool`: the
 * figures logged when it is unregistered. */
static void io_count(struct kvf_pool *pool, uint64_t len, bool to_pool)
{
    atomic_fetch_add_explicit(to_pool ? &pool->io_writes : &pool->io_reads, 1,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(to_pool ? &pool->io_write_bytes : &pool->io_read_bytes, len,
                              memory_order_relaxed);
}

/* Copies `len` bytes between the pool at `offset` and host memory: into the
 * pool from `host_src` (to_pool), else out of it into `host_dst`; through the
 * CUDA runtime for a CUDA pool. Counts the copy. */
static int pool_io(struct kvf_pool *pool, uint64_t offset, void *host_dst, const void *host_src,
                   size_t len, bool to_pool)
{
    if (!io_in_range(pool, offset, len))
        return -ERANGE;
    if (len == 0)
        return 0;
    uint8_t *at = pool->base + offset;
    void *dst = to_pool ? at : host_dst;
    const void *src = to_pool ? host_src : at;
    int rc = 0;
    if (pool->kind == KVF_POOL_MULTI) /* never written from when to_pool */
        rc = pool_multi_io(pool, offset, to_pool ? (uint8_t *)(uintptr_t)host_src : host_dst, len,
                           to_pool);
    else if (pool->kind == KVF_POOL_CUDA_IPC)
        rc = pool_cuda_copy(pool, dst, src, len, to_pool);
    else
        memcpy(dst, src, len);
    if (rc == 0)
        io_count(pool, len, to_pool);
    return rc;
}

int pool_io_2d(struct kvf_pool *pool, uint64_t offset, uint8_t *host, size_t host_pitch,
               size_t width, size_t rows, bool to_pool)
{
    uint64_t len = (uint64_t)width * rows;
    if (pool->kind == KVF_POOL_MULTI || !io_in_range(pool, offset, (size_t)len))
        return -ERANGE;
    if (len == 0)
        return 0;
    uint8_t *at = pool->base + offset;
    int rc = 0;
    if (pool->kind == KVF_POOL_CUDA_IPC) {
        rc = to_pool ? pool_cuda_copy_2d(pool, at, width, host, host_pitch, width, rows, true)
                     : pool_cuda_copy_2d(pool, host, host_pitch, at, width, width, rows, false);
    } else {
        for (size_t r = 0; r < rows; r++) {
            if (to_pool)
                memcpy(at + r * width, host + r * host_pitch, width);
            else
                memcpy(host + r * host_pitch, at + r * width, width);
        }
    }
    if (rc == 0)
        io_count(pool, len, to_pool);
    return rc;
}

int kvf_pool_write(struct kvf_pool *pool, uint64_t offset, const void *src, size_t len)
{
    return pool_io(pool, offset, NULL, src, len, true);
}

int kvf_pool_read(struct kvf_pool *pool, uint64_t offset, void *dst, size_t len)
{
    return pool_io(pool, offset, dst, NULL, len, false);
}

bool kvf_pool_is_device(const struct kvf_pool *pool)
{
    return pool->kind == KVF_POOL_CUDA_IPC || pool->kind == KVF_POOL_FAKE_DEVICE ||
           pool->kind == KVF_POOL_MULTI;
}

void kvf_pool_io_stats(const struct kvf_pool *pool, struct kvf_pool_io_stats *out)
{
    out->writes = atomic_load_explicit(&pool->io_writes, memory_order_relaxed);
    out->write_bytes = atomic_load_explicit(&pool->io_write_bytes, memory_order_relaxed);
    out->reads = atomic_load_explicit(&pool->io_reads, memory_order_relaxed);
    out->read_bytes = atomic_load_explicit(&pool->io_read_bytes, memory_order_relaxed);
}

int kvf_pool_busy_get(struct kvf_pool *pool)
{
    uint64_t w = atomic_load_explicit(&pool->busy, memory_order_relaxed);
    do {
        if (w & POOL_CLOSING)
            return -ENOENT;
    } while (!atomic_compare_exchange_weak_explicit(&pool->busy, &w, w + 1, memory_order_acquire,
                                                    memory_order_relaxed));
    return 0;
}

void kvf_pool_busy_put(struct kvf_pool *pool)
{
    atomic_fetch_sub_explicit(&pool->busy, 1, memory_order_release);
}

uint64_t kvf_pool_busy(const struct kvf_pool *pool)
{
    return atomic_load_explicit(&pool->busy, memory_order_relaxed) & ~POOL_CLOSING;
}

enum kvf_pool_kind kvf_pool_kind(const struct kvf_pool *pool)
{
    return pool->kind;
}

uint32_t kvf_pool_page_size(const struct kvf_pool *pool)
{
    return pool->page_size;
}

uint32_t kvf_pool_page_count(const struct kvf_pool *pool)
{
    return pool->page_count;
}

uint64_t kvf_pool_size(const struct kvf_pool *pool)
{
    return pool->size;
}

uint32_t kvf_pool_device(const struct kvf_pool *pool)
{
    return pool->device;
}
