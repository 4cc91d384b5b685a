/*
 * pools.c: registering device memory with the node (kvfence.h, "CUDA
 * device memory"): the export of a device pointer (the fake's first, then
 * CUDA's) and RegisterPool with cuda_ipc. Host memory by name or descriptor
 * is kvfence.c's.
 *
 * Calls block the calling thread until the node answers; any thread.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

/* ---- pools of several buffers ---------------------------------------------------- */

/* Every buffer's memory in wire form, and what must be undone after. */
struct wire_buffers {
    size_t n;
    Kvfence__V1__PoolBuffer *pb;
    Kvfence__V1__PoolBuffer **pp;
    Kvfence__V1__HostShmMemory *shm;
    Kvfence__V1__HostFdMemory *hfd;
    Kvfence__V1__CudaIpcMemory *cm;
    struct kvf_cuda_ipc *ipc;
    uint8_t (*handle)[16];
};

static void wire_buffers_free(struct wire_buffers *w)
{
    free(w->pb);
    free(w->pp);
    free(w->shm);
    free(w->hfd);
    free(w->cm);
    free(w->ipc);
    free(w->handle);
}

/* Hands `fd` over as buffer i's memory; 1 when the node has no fd socket. */
static int buffer_fd(kvf_node_client *n, struct wire_buffers *w, size_t i, int fd,
                     const struct kvf_pool_buffer *b, struct kvf_status *st)
{
    int rc = client_hand_over(n, fd, w->handle[i], st);
    if (rc == -ENOENT || rc == -ECONNREFUSED)
        return 1;
    if (rc != 0)
        return rc;
    kvfence__v1__host_fd_memory__init(&w->hfd[i]);
    w->hfd[i].handle.data = w->handle[i];
    w->hfd[i].handle.len = sizeof w->handle[i];
    w->hfd[i].offset = b->offset;
    w->hfd[i].size = b->size;
    w->pb[i].memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_FD;
    w->pb[i].host_fd = &w->hfd[i];
    return 0;
}

/* Buffer i in wire form: 0, or -code with `st` naming it. */
static int buffer_wire(kvf_node_client *n, struct wire_buffers *w, size_t i,
                       const struct kvf_pool_buffer *b, struct kvf_status *st)
{
    Kvfence__V1__PoolBuffer *pb = &w->pb[i];
    kvfence__v1__pool_buffer__init(pb);
    pb->page_size = b->page_size;
    w->pp[i] = pb;
    int rc;
    switch (b->memory) {
    case KVF_BUFFER_SHM: {
        if (!b->shm_name || !b->shm_name[0])
            return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                                 "kvf_register_pool_buffers: buffers[%zu].shm_name is required", i);
        /* As kvf_register_pool_shm: the descriptor, else by name. */
        int fd = shm_open(b->shm_name, O_RDWR | O_CLOEXEC, 0);
        rc = 1;
        if (fd >= 0) {
            rc = buffer_fd(n, w, i, fd, b, st);
            close(fd);
        }
        if (rc <= 0)
            return rc;
        kvfence__v1__host_shm_memory__init(&w->shm[i]);
        w->shm[i].shm_name = (char *)b->shm_name;
        w->shm[i].offset = b->offset;
        w->shm[i].size = b->size;
        pb->memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_SHM;
        pb->host_shm = &w->shm[i];
        return 0;
    }
    case KVF_BUFFER_FD:
        rc = b->fd >= 0 ? buffer_fd(n, w, i, b->fd, b, st) : -1;
        if (rc == 1 || rc == -1)
            return client_status(st, rc == 1 ? KVF_STATUS_UNAVAILABLE : KVF_STATUS_INVALID_ARGUMENT,
                                 "kvf_register_pool_buffers: buffers[%zu].fd: %s", i,
                                 rc == 1 ? "the node has no fd socket" : "not a descriptor");
        return rc;
    case KVF_BUFFER_CUDA: {
        if (!b->dev_ptr)
            return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                                 "kvf_register_pool_buffers: buffers[%zu].dev_ptr is required", i);
        struct kvf_status est;
        rc = kvf_cuda_ipc_export(b->dev_ptr, &w->ipc[i], &est);
        if (rc != 0)
            return client_status(st, est.code, "buffers[%zu]: %s", i, est.message);
        break;
    }
    case KVF_BUFFER_CUDA_IPC:
        w->ipc[i] = b->ipc;
        break;
    default:
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_buffers: buffers[%zu].memory: unknown kind %d", i,
                             (int)b->memory);
    }
    cuda_memory(&w->cm[i], &w->ipc[i], b->size);
    pb->memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_CUDA_IPC;
    pb->cuda_ipc = &w->cm[i];
    return 0;
}

int kvf_register_pool_buffers(kvf_node_client *n, const struct kvf_buffer_pool *pool,
                              uint32_t *pool_id_out, struct kvf_status *st)
{
    if (!n || !pool || !pool->buffers || pool->n_buffers == 0)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_buffers: node client and buffers are required");
    size_t nb = pool->n_buffers;
    struct wire_buffers w = {.n = nb,
                             .pb = calloc(nb, sizeof *w.pb),
                             .pp = calloc(nb, sizeof *w.pp),
                             .shm = calloc(nb, sizeof *w.shm),
                             .hfd = calloc(nb, sizeof *w.hfd),
                             .cm = calloc(nb, sizeof *w.cm),
                             .ipc = calloc(nb, sizeof *w.ipc),
                             .handle = calloc(nb, sizeof *w.handle)};
    int rc = 0;
    if (!w.pb || !w.pp || !w.shm || !w.hfd || !w.cm || !w.ipc || !w.handle)
        rc = client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                           "kvf_register_pool_buffers: out of memory");
    for (size_t i = 0; rc == 0 && i < nb; i++)
        rc = buffer_wire(n, &w, i, &pool->buffers[i], st);
    if (rc == 0) {
        Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
        req.n_buffers = nb;
        req.buffers = w.pp;
        req.page_count = pool->page_count;
        req.rank = pool->rank;
        req.pool_key = (char *)(pool->pool_key ? pool->pool_key : "");
        rc = client_register_pool(n, &req, pool_id_out, st);
    }
    wire_buffers_free(&w);
    return rc;
}

/* ---- the engines' own terms ----------------------------------------------------------- */

/* The end of an engine's registration: when `rc` is 0 (the buffers laid out
 * without error), registers the `nb` buffers `b` as one pool; frees `b`
 * either way. Returns rc, or kvf_register_pool_buffers()'s result. */
static int register_buffers_free(kvf_node_client *n, int rc, struct kvf_pool_buffer *b, size_t nb,
                                 uint32_t page_count, uint32_t rank, const char *pool_key,
                                 uint32_t *pool_id_out, struct kvf_status *st)
{
    if (rc == 0) {
        struct kvf_buffer_pool p = {.buffers = b,
                                    .n_buffers = nb,
                                    .page_count = page_count,
                                    .rank = rank,
                                    .pool_key = pool_key};
        rc = kvf_register_pool_buffers(n, &p, pool_id_out, st);
    }
    free(b);
    return rc;
}

int kvf_register_pool_sglang(kvf_node_client *n, const uint64_t *ptrs, const uint64_t *lens,
                             const uint64_t *item_lens, size_t count, uint32_t page_count,
                             uint32_t rank, const char *pool_key, uint32_t *pool_id_out,
                             struct kvf_status *st)
{
    if (!n || !ptrs || !lens || !item_lens || count == 0)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_sglang: node client and the three lists are "
                             "required");
    struct kvf_pool_buffer *b = calloc(count, sizeof *b);
    if (!b)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_register_pool_sglang: out of memory");
    int rc = 0;
    bool exact = false;
    for (size_t i = 0; i < count && rc == 0; i++) {
        if (item_lens[i] == 0 || item_lens[i] > UINT32_MAX) {
            rc = client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                               "kvf_register_pool_sglang: kv_item_lens[%zu]: %llu bytes a page", i,
                               (unsigned long long)item_lens[i]);
            break;
        }
        uint64_t pages = lens[i] / item_lens[i];
        if (i == 0 && page_count == 0) {
            exact = true; /* every buffer must hold as many pages as the first */
            page_count = pages > UINT32_MAX ? 0 : (uint32_t)pages;
        }
        if (page_count == 0 || pages < page_count || (exact && pages != page_count)) {
            rc = client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                               "kvf_register_pool_sglang: kv_data_lens[%zu]: %llu bytes hold %llu "
                               "pages of %llu bytes, not %u",
                               i, (unsigned long long)lens[i], (unsigned long long)pages,
                               (unsigned long long)item_lens[i], page_count);
            break;
        }
        b[i] = (struct kvf_pool_buffer){.memory = KVF_BUFFER_CUDA,
                                        .dev_ptr = (const void *)(uintptr_t)ptrs[i],
                                        .size = lens[i],
                                        .page_size = (uint32_t)item_lens[i]};
    }
    return register_buffers_free(n, rc, b, count, page_count, rank, pool_key, pool_id_out, st);
}

int kvf_register_pool_vllm(kvf_node_client *n, const struct kvf_vllm_layer *layers, size_t n_layers,
                           uint32_t num_blocks, uint32_t rank, const char *pool_key,
                           uint32_t *pool_id_out, struct kvf_status *st)
{
    if (!n || !layers || n_layers == 0 || num_blocks == 0)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_register_pool_vllm: node client, layers and num_blocks are "
                             "required");
    struct kvf_pool_buffer *b = calloc(2 * n_layers, sizeof *b);
    if (!b)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_register_pool_vllm: out of memory");
    size_t nb = 0;
    int rc = 0;
    for (size_t i = 0; i < n_layers && rc == 0; i++) {
        const struct kvf_vllm_layer *l = &layers[i];
        uint64_t parts = l->kv_split ? 2 : 1;
        uint64_t per = (uint64_t)num_blocks * parts;
        if (!l->dev_ptr || l->size == 0 || l->size % per != 0 || l->size / per > UINT32_MAX) {
            rc = client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                               "kvf_register_pool_vllm: layers[%zu].size: %llu bytes are not %llu "
                               "x %u blocks",
                               i, (unsigned long long)l->size, (unsigned long long)parts,
                               num_blocks);
            break;
        }
        uint64_t half = l->size / parts;
        for (uint64_t k = 0; k < parts; k++)
            b[nb++] = (struct kvf_pool_buffer){.memory = KVF_BUFFER_CUDA,
                                               .dev_ptr = (const uint8_t *)l->dev_ptr + k * half,
                                               .size = half,
                                               .page_size = (uint32_t)(half / num_blocks)};
    }
    return register_buffers_free(n, rc, b, nb, num_blocks, rank, pool_key, pool_id_out, st);
}
