/*
 * pool_multi.c: multi-buffer pools (KVF_POOL_MULTI, pool.h). An engine keeps
 * its KV cache as one buffer per layer (and per K and V) plus aux buffers;
 * its "page 17" is slot 17 of every buffer at once. A multi-buffer pool makes
 * those buffers one pool: its page is the concatenation of the buffers'
 * slots in buffer order (page_size = the sum of their page sizes), so one
 * lease and one chunk cover all buffers, and a frame of k pages is k such
 * concatenations, page after page: that is also how a page travels on the
 * wire (docs/node.md, "Pools").
 *
 * The pool has no memory of its own. Its page addresses name a range of
 * page_size x page_count bytes reserved PROT_NONE: unique among the node's
 * pools (the local transport finds a source pool by address), never backed,
 * so a stray dereference faults instead of reading another pool. Its bytes
 * move only through kvf_pool_read/kvf_pool_write, which come here: a run of
 * whole pages is one strided copy per buffer (pool_io_2d: rows of the
 * buffer's slot, page_size apart in the frame, back to back in the buffer;
 * cudaMemcpy2D for a CUDA buffer), a partial page one copy per slot piece.
 *
 * DESIGN: as pool.h. The buffers are private to the pool once it is open:
 * nothing else holds them, so their busy counts stay 0 and only the pool's
 * own busy count guards close.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvf_log.h"
#include "pool_internal.h"

int kvf_pool_open_buffers(struct kvf_pool *const *bufs, uint32_t nbufs, struct kvf_pool **pool_p,
                          struct kvf_error *err)
{
    if (nbufs == 0 || nbufs > KVF_POOL_MAX_BUFFERS)
        return kvf_error_set(err, -EINVAL, "buffers: %u given, 1 to %u allowed", nbufs,
                             KVF_POOL_MAX_BUFFERS);
    uint32_t count = bufs[0]->page_count;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < nbufs; i++) {
        if (bufs[i]->kind == KVF_POOL_MULTI)
            return kvf_error_set(err, -EINVAL, "buffers[%u]: a multi-buffer pool cannot nest", i);
        if (bufs[i]->page_count != count)
            return kvf_error_set(err, -EINVAL, "buffers[%u]: %u pages, buffers[0] has %u", i,
                                 bufs[i]->page_count, count);
        sum += bufs[i]->page_size;
    }
    if (sum > UINT32_MAX)
        return kvf_error_set(err, -EINVAL,
                             "buffers: their page sizes add up to %llu bytes, more than %u",
                             (unsigned long long)sum, UINT32_MAX);
    uint64_t span = sum * count;
    if (span > SIZE_MAX / 2)
        return kvf_error_set(err, -EINVAL, "buffers: %llu bytes of pages do not fit",
                             (unsigned long long)span);
    struct kvf_pool *pool = pool_alloc(KVF_POOL_MULTI, span, (uint32_t)sum, count);
    struct pool_buf *pb = calloc(nbufs, sizeof *pb);
    if (!pool || !pb) {
        free(pool);
        free(pb);
        return kvf_error_set(err, -ENOMEM, "buffers: out of memory");
    }
    void *res =
        mmap(NULL, (size_t)span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED) {
        int e = errno;
        free(pool);
        free(pb);
        return kvf_error_set(err, -e, "buffers: reserving %llu bytes of addresses: %s",
                             (unsigned long long)span, strerror(e));
    }
    uint32_t at = 0;
    for (uint32_t i = 0; i < nbufs; i++) {
        pb[i] = (struct pool_buf){bufs[i], at, bufs[i]->page_size};
        at += bufs[i]->page_size;
    }
    pool->bufs = pb;
    pool->nbufs = nbufs;
    pool->map_base = res;
    pool->map_len = (size_t)span;
    pool->base = res;
    *pool_p = pool;
    return 0;
}

void pool_multi_unmap(struct kvf_pool *pool)
{
    for (uint32_t i = 0; i < pool->nbufs; i++) {
        int rc = kvf_pool_close(pool->bufs[i].pool);
        if (rc != 0)
            kvf_log("error", "kvf_pool_close: buffer %u: %s", i, strerror(-rc));
    }
    free(pool->bufs);
    pool->bufs = NULL;
    pool->nbufs = 0;
    if (munmap(pool->map_base, pool->map_len) != 0)
        kvf_log("error", "kvf_pool_close: munmap of the reservation: %s", strerror(errno));
}

uint32_t kvf_pool_buffer_count(const struct kvf_pool *pool)
{
    return pool->kind == KVF_POOL_MULTI ? pool->nbufs : 0;
}

struct kvf_pool *kvf_pool_buffer(const struct kvf_pool *pool, uint32_t i)
{
    if (pool->kind != KVF_POOL_MULTI || i >= pool->nbufs)
        return NULL;
    return pool->bufs[i].pool;
}

uint32_t kvf_pool_layout(const struct kvf_pool *pool)
{
    if (pool->kind != KVF_POOL_MULTI)
        return 0;
    uint32_t h = 2166136261u;
    uint32_t words[2] = {pool->nbufs, 0};
    for (uint32_t i = 0; i <= pool->nbufs; i++) {
        uint32_t w = i == 0 ? words[0] : pool->bufs[i - 1].page_size;
        for (int k = 0; k < 4; k++)
            h = (h ^ ((w >> (8 * k)) & 0xffu)) * 16777619u;
    }
    return h ? h : 1;
}

/* The buffer whose slot holds byte `in` of a page (binary search on `at`). */
static const struct pool_buf *buf_at(const struct kvf_pool *pool, uint32_t in)
{
    uint32_t lo = 0, hi = pool->nbufs;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (pool->bufs[mid].at <= in)
            lo = mid;
        else
            hi = mid;
    }
    return &pool->bufs[lo];
}

int pool_multi_io(struct kvf_pool *pool, uint64_t offset, uint8_t *host, size_t len, bool to_pool)
{
    uint64_t ps = pool->page_size;
    while (len > 0) {
        uint64_t page = offset / ps;
        uint32_t in = (uint32_t)(offset % ps);
        if (in == 0 && len >= ps) {
            /* Whole pages: one strided copy per buffer. */
            size_t rows = (size_t)(len / ps);
            for (uint32_t b = 0; b < pool->nbufs; b++) {
                const struct pool_buf *pb = &pool->bufs[b];
                int rc = pool_io_2d(pb->pool, page * pb->page_size, host + pb->at, (size_t)ps,
                                    pb->page_size, rows, to_pool);
                if (rc != 0)
                    return rc;
            }
            uint64_t n = (uint64_t)rows * ps;
            host += n;
            offset += n;
            len -= (size_t)n;
            continue;
        }
        /* Part of a page: the piece of the slot that holds byte `in`. */
        const struct pool_buf *pb = buf_at(pool, in);
        uint64_t n = pb->at + pb->page_size - in;
        if (n > len)
            n = len;
        uint64_t boff = page * pb->page_size + (in - pb->at);
        int rc = to_pool ? kvf_pool_write(pb->pool, boff, host, (size_t)n)
                         : kvf_pool_read(pb->pool, boff, host, (size_t)n);
        if (rc != 0)
            return rc;
        host += n;
        offset += n;
        len -= (size_t)n;
    }
    return 0;
}
