/*
 * fake_device.c: fake device memory for tests and machines without a GPU
 * (kvf_fake_device_alloc in kvfence.h). Each allocation is a POSIX shm
 * object mapped into this process; kvf_cuda_ipc_export of a pointer inside
 * one gives the fake handle naming the object (common/kvf_fake_ipc.h), which
 * a node started with --test-fake-device-pools opens as a fake device pool.
 * The same client calls and RegisterPool fields as real CUDA memory carry
 * it; only the handle's bytes differ.
 *
 * DESIGN: the allocations are a list under one mutex; any thread may
 * allocate, free and export.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "kvf_fake_ipc.h"

struct fake_alloc {
    struct fake_alloc *next;
    uint8_t *addr;
    uint64_t size;
    char name[KVF_FAKE_IPC_NAME_MAX + 1];
};

static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_alloc *fake_list;

int kvf_fake_device_alloc(const char *shm_name, uint64_t size, void **dev_ptr_out,
                          struct kvf_status *st)
{
    if (!shm_name || shm_name[0] != '/' || !dev_ptr_out || size == 0)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_fake_device_alloc: a '/name', a size and dev_ptr_out are "
                             "required");
    if (strlen(shm_name) > KVF_FAKE_IPC_NAME_MAX)
        return client_status(st, KVF_STATUS_INVALID_ARGUMENT,
                             "kvf_fake_device_alloc: shm_name longer than %u bytes",
                             KVF_FAKE_IPC_NAME_MAX);
    struct fake_alloc *a = calloc(1, sizeof *a);
    if (!a)
        return client_status(st, KVF_STATUS_RESOURCE_EXHAUSTED,
                             "kvf_fake_device_alloc: out of memory");
    snprintf(a->name, sizeof a->name, "%s", shm_name);
    int fd = shm_open(shm_name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0660);
    if (fd < 0) {
        int e = errno;
        free(a);
        return client_status(st, e == EEXIST ? KVF_STATUS_ALREADY_EXISTS : KVF_STATUS_INTERNAL,
                             "kvf_fake_device_alloc: shm_open(%s): %s", shm_name, strerror(e));
    }
    /* 0660 whatever the umask: the node opens it by name, and only an object
     * every caller of its socket could open (docs/security.md). */
    void *m = MAP_FAILED;
    if (fchmod(fd, 0660) == 0 && ftruncate(fd, (off_t)size) == 0)
        m = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        shm_unlink(shm_name);
        free(a);
        return client_status(st, KVF_STATUS_INTERNAL, "kvf_fake_device_alloc: %s: %s", shm_name,
                             strerror(e));
    }
    a->addr = m;
    a->size = size;
    pthread_mutex_lock(&fake_lock);
    a->next = fake_list;
    fake_list = a;
    pthread_mutex_unlock(&fake_lock);
    *dev_ptr_out = m;
    if (st) {
        st->code = KVF_STATUS_OK;
        st->message[0] = '\0';
    }
    return 0;
}

void kvf_fake_device_free(void *dev_ptr)
{
    if (!dev_ptr)
        return;
    pthread_mutex_lock(&fake_lock);
    struct fake_alloc **pp = &fake_list;
    while (*pp && (*pp)->addr != dev_ptr)
        pp = &(*pp)->next;
    struct fake_alloc *a = *pp;
    if (a)
        *pp = a->next;
    pthread_mutex_unlock(&fake_lock);
    if (!a)
        return;
    munmap(a->addr, (size_t)a->size);
    shm_unlink(a->name);
    free(a);
}

int client_fake_export(const void *dev_ptr, struct kvf_cuda_ipc *out)
{
    const uint8_t *p = dev_ptr;
    int found = 0;
    pthread_mutex_lock(&fake_lock);
    for (struct fake_alloc *a = fake_list; a; a = a->next) {
        if (p >= a->addr && p < a->addr + a->size) {
            memset(out, 0, sizeof *out);
            (void)kvf_fake_ipc_encode(a->name, out->handle); /* the length was checked */
            out->device = 0;
            out->offset = (uint64_t)(p - a->addr);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&fake_lock);
    return found;
}
