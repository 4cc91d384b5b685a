/*
 * pools_lib.c: test_node_pools' calls of libkvfence (pools_lib.h), through
 * the public header only.
 */
#include "pools_lib.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvfence/kvfence.h"

static int out(int rc, const struct kvf_status *st, char *msg)
{
    snprintf(msg, PL_MSG, "%s", rc == 0 ? "" : st->message);
    return rc;
}

int pl_connect(const char *sock, pl_client **c, char *msg)
{
    struct kvf_status st = {0};
    kvf_node_client *n = NULL;
    int rc = kvf_node_client_create(sock, NULL, &n, &st);
    if (rc == 0)
        *c = (pl_client *)n;
    return out(rc, &st, msg);
}

void pl_disconnect(pl_client *c)
{
    kvf_node_client_destroy((kvf_node_client *)c);
}

int pl_fake_alloc(const char *name, uint64_t size, void **p, char *msg)
{
    struct kvf_status st = {0};
    return out(kvf_fake_device_alloc(name, size, p, &st), &st, msg);
}

void pl_fake_free(void *p)
{
    kvf_fake_device_free(p);
}

int pl_export(const void *ptr, uint64_t *offset, uint32_t *device, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_cuda_ipc ipc;
    int rc = kvf_cuda_ipc_export(ptr, &ipc, &st);
    if (rc == 0) {
        *offset = ipc.offset;
        *device = ipc.device;
    }
    return out(rc, &st, msg);
}

int pl_register_cuda(pl_client *c, const void *ptr, uint64_t size, uint32_t page_size,
                     uint32_t page_count, uint32_t *id, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_cuda_pool p = {
        .dev_ptr = ptr, .size = size, .page_size = page_size, .page_count = page_count};
    return out(kvf_register_pool_cuda((kvf_node_client *)c, &p, id, &st), &st, msg);
}

int pl_register_cuda_exported(pl_client *c, const void *ptr, uint64_t size, uint32_t page_size,
                              uint32_t page_count, uint32_t *id, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_cuda_ipc ipc;
    int rc = kvf_cuda_ipc_export(ptr, &ipc, &st);
    if (rc != 0)
        return out(rc, &st, msg);
    struct kvf_cuda_pool p = {.size = size, .page_size = page_size, .page_count = page_count};
    return out(kvf_register_pool_cuda_ipc((kvf_node_client *)c, &ipc, &p, id, &st), &st, msg);
}

int pl_register_shm(pl_client *c, const char *name, uint64_t size, uint32_t page_size,
                    uint32_t page_count, uint32_t *id, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_shm_pool p = {
        .shm_name = name, .size = size, .page_size = page_size, .page_count = page_count};
    return out(kvf_register_pool_shm((kvf_node_client *)c, &p, id, &st), &st, msg);
}

int pl_register_buffers(pl_client *c, const struct pl_buf *b, size_t n, uint32_t page_count,
                        uint32_t *id, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_pool_buffer *v = calloc(n, sizeof *v);
    if (!v)
        return -KVF_STATUS_RESOURCE_EXHAUSTED;
    for (size_t i = 0; i < n; i++) {
        v[i].memory = b[i].shm_name ? KVF_BUFFER_SHM : KVF_BUFFER_CUDA;
        v[i].shm_name = b[i].shm_name;
        v[i].dev_ptr = b[i].dev_ptr;
        v[i].size = b[i].size;
        v[i].page_size = b[i].page_size;
    }
    struct kvf_buffer_pool p = {.buffers = v, .n_buffers = n, .page_count = page_count};
    int rc = kvf_register_pool_buffers((kvf_node_client *)c, &p, id, &st);
    free(v);
    return out(rc, &st, msg);
}

int pl_register_sglang(pl_client *c, const uint64_t *ptrs, const uint64_t *lens,
                       const uint64_t *item_lens, size_t n, uint32_t page_count, uint32_t *id,
                       char *msg)
{
    struct kvf_status st = {0};
    return out(kvf_register_pool_sglang((kvf_node_client *)c, ptrs, lens, item_lens, n, page_count,
                                        0, NULL, id, &st),
               &st, msg);
}

int pl_register_vllm(pl_client *c, void *const *ptrs, const uint64_t *sizes, const int *split,
                     size_t n, uint32_t num_blocks, uint32_t *id, char *msg)
{
    struct kvf_status st = {0};
    struct kvf_vllm_layer l[16];
    if (n > 16)
        return -KVF_STATUS_INVALID_ARGUMENT;
    for (size_t i = 0; i < n; i++)
        l[i] = (struct kvf_vllm_layer){.dev_ptr = ptrs[i], .size = sizes[i], .kv_split = split[i]};
    return out(kvf_register_pool_vllm((kvf_node_client *)c, l, n, num_blocks, 0, NULL, id, &st),
               &st, msg);
}
