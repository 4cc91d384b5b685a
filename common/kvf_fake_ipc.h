/*
 * kvf_fake_ipc.h: the test-only fake CUDA IPC handle. Machines without a GPU
 * (and the tests) stand in host shared memory for device memory: the
 * clients' fake device allocator (kvf_fake_device_alloc in libkvfence,
 * kvfence.fake_device in Python) exports such memory as a 64-byte handle in
 * the place of a cudaIpcMemHandle_t, sent in the same RegisterPool field
 * (cuda_ipc.ipc_handle), and a node started with --test-fake-device-pools
 * PREFIX opens it as a fake device pool (dataplane/pool, KVF_POOL_FAKE_DEVICE)
 * when the object's name starts with PREFIX. Any other node treats it as
 * what it claims to be, a CUDA handle, which the CUDA runtime refuses.
 *
 * Layout (64 bytes): "KVFFAKE1", then the POSIX shm object's name
 * ("/kvf-...", at most KVF_FAKE_IPC_NAME_MAX bytes), NUL-padded.
 * Header only; no I/O.
 */
#ifndef KVF_FAKE_IPC_H
#define KVF_FAKE_IPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVF_FAKE_IPC_SIZE     64u
#define KVF_FAKE_IPC_MAGIC    "KVFFAKE1"
#define KVF_FAKE_IPC_NAME_MAX 55u /* 64 - 8 magic bytes - 1 NUL */

/* Writes the fake handle of `name` into `h` (KVF_FAKE_IPC_SIZE bytes).
 * -1 when the name is too long (nothing written), else 0. */
static inline int kvf_fake_ipc_encode(const char *name, uint8_t *h)
{
    size_t len = strlen(name);
    if (len == 0 || len > KVF_FAKE_IPC_NAME_MAX)
        return -1;
    memset(h, 0, KVF_FAKE_IPC_SIZE);
    memcpy(h, KVF_FAKE_IPC_MAGIC, 8);
    memcpy(h + 8, name, len);
    return 0;
}

/* True when `h` (`len` bytes) is a fake handle; then `name` (at least
 * KVF_FAKE_IPC_NAME_MAX + 1 bytes) holds the object's name. */
static inline bool kvf_fake_ipc_decode(const uint8_t *h, size_t len, char *name)
{
    if (len != KVF_FAKE_IPC_SIZE || memcmp(h, KVF_FAKE_IPC_MAGIC, 8) != 0)
        return false;
    const uint8_t *nm = h + 8;
    size_t n = 0;
    while (n < KVF_FAKE_IPC_NAME_MAX && nm[n] != 0)
        n++;
    if (n == 0 || nm[n] != 0)
        return false;
    memcpy(name, nm, n);
    name[n] = '\0';
    return true;
}

#endif /* KVF_FAKE_IPC_H */
