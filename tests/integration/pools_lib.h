/*
 * pools_lib.h: test_node_pools' side of libkvfence. The public header
 * (kvfence/kvfence.h) and the node harness's common/kvf_types.h both define
 * struct kvf_room_key, so the library's calls live in pools_lib.c, which
 * includes only the public header, behind these plain-typed wrappers. Each
 * returns what the library call returned (0, or minus a status code: the
 * gRPC code) and copies the status message into `msg` (PL_MSG bytes).
 */
#ifndef KVF_TEST_POOLS_LIB_H
#define KVF_TEST_POOLS_LIB_H

#include <stddef.h>
#include <stdint.h>

#define PL_MSG 256

typedef struct pl_client pl_client;

int pl_connect(const char *sock, pl_client **c, char *msg);
void pl_disconnect(pl_client *c);

int pl_fake_alloc(const char *name, uint64_t size, void **p, char *msg);
void pl_fake_free(void *p);

/* kvf_cuda_ipc_export: the offset and device it exported. */
int pl_export(const void *ptr, uint64_t *offset, uint32_t *device, char *msg);

/* kvf_register_pool_cuda (by pointer). */
int pl_register_cuda(pl_client *c, const void *ptr, uint64_t size, uint32_t page_size,
                     uint32_t page_count, uint32_t *id, char *msg);

/* kvf_cuda_ipc_export of `ptr`, then kvf_register_pool_cuda_ipc. */
int pl_register_cuda_exported(pl_client *c, const void *ptr, uint64_t size, uint32_t page_size,
                              uint32_t page_count, uint32_t *id, char *msg);

/* kvf_register_pool_shm. */
int pl_register_shm(pl_client *c, const char *name, uint64_t size, uint32_t page_size,
                    uint32_t page_count, uint32_t *id, char *msg);

/* One buffer for pl_register_buffers: host shm by name, or a device pointer. */
struct pl_buf {
    const char *shm_name; /* host shm; NULL: dev_ptr */
    const void *dev_ptr;
    uint64_t size;
    uint32_t page_size;
};

/* kvf_register_pool_buffers of `n` buffers of `page_count` pages. */
int pl_register_buffers(pl_client *c, const struct pl_buf *b, size_t n, uint32_t page_count,
                        uint32_t *id, char *msg);

/* kvf_register_pool_sglang. */
int pl_register_sglang(pl_client *c, const uint64_t *ptrs, const uint64_t *lens,
                       const uint64_t *item_lens, size_t n, uint32_t page_count, uint32_t *id,
                       char *msg);

/* kvf_register_pool_vllm of `n` layers: ptrs[i], sizes[i], split[i]. */
int pl_register_vllm(pl_client *c, void *const *ptrs, const uint64_t *sizes, const int *split,
                     size_t n, uint32_t num_blocks, uint32_t *id, char *msg);

#endif /* KVF_TEST_POOLS_LIB_H */
