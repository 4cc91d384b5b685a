/*
 * client_internal.h: what the files of libkvfence share (kvfence.c, the pool
 * registration of pools.c, the device memory export of cuda_export*.c and
 * fake_device.c). Private to clients/c; nothing here is exported.
 */
#ifndef KVF_CLIENT_INTERNAL_H
#define KVF_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvfence/kvfence.h"
#include "kvfence/v1/node.pb-c.h"

/* Records `code` (positive) and a message in `st` (may be NULL); returns
 * -code. */
int client_status(struct kvf_status *st, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* NodeLocal.RegisterPool of `req` (its memory set by the caller): 0 and
 * *pool_id_out (may be NULL), or -code with `st` set. kvfence.c. */
int client_register_pool(kvf_node_client *n, Kvfence__V1__RegisterPoolRequest *req,
                         uint32_t *pool_id_out, struct kvf_status *st);

/* Hands `fd` over on the node's fd socket: 0 and the one-time handle
 * (KVF_FDPASS_HANDLE_SIZE bytes) in `handle`; -ENOENT / -ECONNREFUSED (no
 * status set) when the node has no fd socket; else -code with `st` set.
 * kvfence.c. */
int client_hand_over(kvf_node_client *n, int fd, uint8_t *handle, struct kvf_status *st);

/* The real export (cuda_export.c with CUDA, cuda_export_none.c without):
 * 0, or -code with `st` set. */
int client_cuda_export(const void *dev_ptr, struct kvf_cuda_ipc *out, struct kvf_status *st);

/* The fake export (fake_device.c): 1 and *out when `dev_ptr` lies in memory
 * of kvf_fake_device_alloc, else 0. */
int client_fake_export(const void *dev_ptr, struct kvf_cuda_ipc *out);

#endif /* KVF_CLIENT_INTERNAL_H */
