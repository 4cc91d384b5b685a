/*
 * devpool.c: device memory pools in kvfence-node (devpool.h).
 *
 * CUDA IPC pools are opened with kvf_pool_open_cuda_ipc: in a build without
 * CUDA the pool layer answers -ENOTSUP, which becomes FAILED_PRECONDITION
 * "this kvfence-node was built without CUDA"; with CUDA but no device (or an
 * ordinal beyond them) FAILED_PRECONDITION naming cuda_ipc.device, and a
 * handle the runtime refuses INVALID_ARGUMENT naming cuda_ipc.ipc_handle.
 * The fake device pool (--test-fake-device-pools PREFIX) exists so that the
 * same data path runs on a machine without a GPU: the node treats it exactly
 * as a CUDA pool except that its copies are memcpy. It comes two ways: a
 * host_shm pool whose name starts with PREFIX, or a cuda_ipc pool whose
 * handle is the clients' fake handle (kvf_fake_ipc.h) naming an object under
 * PREFIX, which is how the clients register "device memory" on a machine
 * without a GPU, through the same calls and fields as real CUDA memory.
 */
#include "devpool.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvf_fake_ipc.h"
#include "kvf_fdpass.h"
#include "local.h"
#include "tcp.h"
#include "local_access.h"
#include "node_log.h"

const char *node_devpool_check_cuda_request(const Kvfence__V1__RegisterPoolRequest *r)
{
    const Kvfence__V1__CudaIpcMemory *c = r->cuda_ipc;
    if (r->page_size == 0 || r->page_count == 0)
        return "page_size and page_count must be >= 1";
    if (c->ipc_handle.len != KVF_POOL_CUDA_IPC_HANDLE_SIZE)
        return "cuda_ipc.ipc_handle: must be the 64 bytes of a cudaIpcMemHandle_t";
    if (c->size < (uint64_t)r->page_size * r->page_count)
        return "cuda_ipc.size: smaller than page_size x page_count";
    return NULL;
}

static bool fake_device_name(const struct kvf_node *n, const char *name)
{
    const char *pre = n->opts.test_fake_device_pools;
    return pre && pre[0] && name && strncmp(name, pre, strlen(pre)) == 0;
}

/* The memory behind `fd` at `offset`, `size`, as the kernel names it. */
static void memory_key(int fd, uint64_t offset, uint64_t size, char *key, size_t key_len)
{
    struct stat st;
    if (fstat(fd, &st) != 0) {
        key[0] = '\0';
        return;
    }
    snprintf(key, key_len, "inode:%" PRIu64 ":%" PRIu64 ":%" PRIu64 ":%" PRIu64,
             (uint64_t)st.st_dev, (uint64_t)st.st_ino, offset, size);
}

/* One memory to open: a single-buffer pool's, or one buffer's. `what`
 * prefixes every message ("" or "buffers[3]."). */
struct memory {
    const Kvfence__V1__HostShmMemory *shm;
    const Kvfence__V1__CudaIpcMemory *cuda;
    const Kvfence__V1__HostFdMemory *fd;
    uint32_t page_size, page_count;
    const char *what;
};

/* `msg` = what + text. */
static void say(char *msg, size_t msg_len, const char *what, const char *text)
{
    snprintf(msg, msg_len, "%s%s", what, text);
}

/* Host shared memory by name, as `kind`: the node opens it, so it must be no
 * more than every caller of the socket could open itself (local_access.h). */
static int open_by_name(struct kvf_node *n, const struct memory *m, const char *name,
                        uint64_t offset, uint64_t size, const char *field, enum kvf_pool_kind kind,
                        struct kvf_pool **pool_p, char *key, size_t key_len, char *msg,
                        size_t msg_len)
{
    struct kvf_error err;
    kvf_error_clear(&err);
    int fd;
    int rc = kvf_pool_shm_open(name, &fd, &err);
    if (rc != 0) {
        say(msg, msg_len, m->what, err.msg);
        return (int)kvf_errno_to_grpc_code(rc);
    }
    char why[256];
    int code = node_access_check_shm(&n->access, fd, name, why, sizeof why);
    if (code != 0) {
        close(fd);
        say(msg, msg_len, m->what, why);
        return code;
    }
    rc = kvf_pool_open_fd(fd, kind, field, offset, size, m->page_size, m->page_count, pool_p, &err);
    if (rc == 0)
        memory_key(fd, offset, size, key, key_len);
    close(fd);
    if (rc == 0)
        return 0;
    say(msg, msg_len, m->what, err.msg);
    return (int)kvf_errno_to_grpc_code(rc);
}

static int open_cuda(struct kvf_node *n, const struct memory *m, struct kvf_pool **pool_p,
                     char *key, size_t key_len, char *msg, size_t msg_len)
{
    const Kvfence__V1__CudaIpcMemory *c = m->cuda;
    /* A fake handle (kvf_fake_ipc.h) on a node with --test-fake-device-pools:
     * the shm object it names, as a fake device pool, by name and so under
     * the same access rule as host_shm. */
    char fake[KVF_FAKE_IPC_NAME_MAX + 1];
    if (n->opts.test_fake_device_pools && n->opts.test_fake_device_pools[0] &&
        kvf_fake_ipc_decode(c->ipc_handle.data, c->ipc_handle.len, fake)) {
        if (!fake_device_name(n, fake)) {
            snprintf(msg, msg_len,
                     "%scuda_ipc.ipc_handle: a fake handle of \"%s\", outside "
                     "--test-fake-device-pools",
                     m->what, fake);
            return KVF_GRPC_INVALID_ARGUMENT;
        }
        return open_by_name(n, m, fake, c->offset, c->size, "cuda_ipc", KVF_POOL_FAKE_DEVICE,
                            pool_p, key, key_len, msg, msg_len);
    }
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_pool_open_cuda_ipc(c->ipc_handle.data, c->ipc_handle.len, c->device, c->offset,
                                    c->size, m->page_size, m->page_count, pool_p, &err);
    if (rc == 0)
        return 0;
    if (rc == -ENOTSUP) {
        say(msg, msg_len, m->what, "cuda_ipc: this kvfence-node was built without CUDA");
        return KVF_GRPC_FAILED_PRECONDITION;
    }
    say(msg, msg_len, m->what, err.msg);
    if (rc == -ENODEV)
        return KVF_GRPC_FAILED_PRECONDITION;
    if (rc == -ENOMEM)
        return KVF_GRPC_RESOURCE_EXHAUSTED;
    return KVF_GRPC_INVALID_ARGUMENT; /* -EINVAL geometry, -EIO a refused handle */
}

static int open_fd(struct kvf_node *n, const struct memory *m, struct kvf_pool **pool_p, char *key,
                   size_t key_len, char *msg, size_t msg_len)
{
    const Kvfence__V1__HostFdMemory *hf = m->fd;
    int fd;
    struct node_gate_peer peer;
    if (node_gate_take(n->gate, hf->handle.data, hf->handle.len, &fd, &peer) != 0) {
        say(msg, msg_len, m->what,
            "host_fd.handle: no descriptor waits under it (never issued, used, or expired)");
        return KVF_GRPC_NOT_FOUND;
    }
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_pool_open_fd(fd, KVF_POOL_HOST_SHM, "host_fd", hf->offset, hf->size, m->page_size,
                              m->page_count, pool_p, &err);
    if (rc == 0)
        memory_key(fd, hf->offset, hf->size, key, key_len);
    close(fd);
    if (rc == 0) {
        node_log("info", NULL, "host_fd %spool: the descriptor came from pid %d uid %u gid %u",
                 m->what[0] ? "buffer of a " : "", (int)peer.pid, (unsigned)peer.uid,
                 (unsigned)peer.gid);
        return 0;
    }
    say(msg, msg_len, m->what, err.msg);
    return (int)kvf_errno_to_grpc_code(rc);
}

static int open_memory(struct kvf_node *n, const struct memory *m, struct kvf_pool **pool_p,
                       char *key, size_t key_len, char *msg, size_t msg_len)
{
    key[0] = '\0';
    if (m->cuda)
        return open_cuda(n, m, pool_p, key, key_len, msg, msg_len);
    if (m->fd)
        return open_fd(n, m, pool_p, key, key_len, msg, msg_len);
    const Kvfence__V1__HostShmMemory *shm = m->shm;
    return open_by_name(n, m, shm->shm_name, shm->offset, shm->size, "host_shm",
                        fake_device_name(n, shm->shm_name) ? KVF_POOL_FAKE_DEVICE
                                                           : KVF_POOL_HOST_SHM,
                        pool_p, key, key_len, msg, msg_len);
}

static struct memory buffer_memory(const Kvfence__V1__PoolBuffer *b, uint32_t page_count,
                                   const char *what)
{
    struct memory m = {.page_size = b->page_size, .page_count = page_count, .what = what};
    if (b->memory_case == KVFENCE__V1__POOL_BUFFER__MEMORY_CUDA_IPC)
        m.cuda = b->cuda_ipc;
    else if (b->memory_case == KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_FD)
        m.fd = b->host_fd;
    else
        m.shm = b->host_shm;
    return m;
}

/* 64-bit FNV-1a of `s` onto `h`. */
static uint64_t fnv1a(uint64_t h, const char *s)
{
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * UINT64_C(0x100000001b3);
    return (h ^ 0xff) * UINT64_C(0x100000001b3); /* a separator */
}

/* A multi-buffer pool: every buffer, then the pool over them. On a refusal
 * the buffers opened are closed, and the descriptors that later host_fd
 * buffers name are taken and closed too (a handle names its descriptor
 * once, whatever the outcome). */
static int open_buffers(struct kvf_node *n, const Kvfence__V1__RegisterPoolRequest *req,
                        struct kvf_pool **pool_p, char *key, size_t key_len, char *msg,
                        size_t msg_len)
{
    uint32_t nb = (uint32_t)req->n_buffers;
    struct kvf_pool **bufs = calloc(nb, sizeof *bufs);
    if (!bufs) {
        snprintf(msg, msg_len, "buffers: out of memory");
        return KVF_GRPC_RESOURCE_EXHAUSTED;
    }
    uint64_t h = UINT64_C(0xcbf29ce484222325);
    bool all_keyed = true;
    uint32_t opened = 0;
    int code = 0;
    for (; opened < nb; opened++) {
        char what[32], bkey[160];
        snprintf(what, sizeof what, "buffers[%u].", opened);
        struct memory m = buffer_memory(req->buffers[opened], req->page_count, what);
        code = open_memory(n, &m, &bufs[opened], bkey, sizeof bkey, msg, msg_len);
        if (code != 0)
            break;
        all_keyed = all_keyed && bkey[0];
        h = fnv1a(h, bkey);
    }
    if (code == 0) {
        struct kvf_error err;
        kvf_error_clear(&err);
        int rc = kvf_pool_open_buffers(bufs, nb, pool_p, &err);
        if (rc != 0) {
            snprintf(msg, msg_len, "%s", err.msg);
            code = rc == -ENOMEM ? KVF_GRPC_RESOURCE_EXHAUSTED : KVF_GRPC_INVALID_ARGUMENT;
        }
    }
    if (code != 0) {
        for (uint32_t i = 0; i < opened && i < nb; i++)
            kvf_pool_close(bufs[i]);
        for (uint32_t i = opened + 1; i < nb; i++) {
            const Kvfence__V1__PoolBuffer *b = req->buffers[i];
            int fd;
            struct node_gate_peer peer;
            if (b->memory_case == KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_FD &&
                node_gate_take(n->gate, b->host_fd->handle.data, b->host_fd->handle.len, &fd,
                               &peer) == 0)
                close(fd);
        }
        free(bufs);
        return code;
    }
    free(bufs); /* the pool owns the buffers now */
    /* The kernel's names of every buffer make the pool's key; device
     * buffers have none, so then the engine's key is what there is. */
    if (all_keyed)
        snprintf(key, key_len, "buffers:%u:%016" PRIx64, nb, h);
    else
        key[0] = '\0';
    return 0;
}

int node_devpool_open(struct kvf_node *n, const Kvfence__V1__RegisterPoolRequest *req,
                      struct kvf_pool **pool_p, char *key, size_t key_len, char *msg,
                      size_t msg_len)
{
    key[0] = '\0';
    if (req->n_buffers > 0)
        return open_buffers(n, req, pool_p, key, key_len, msg, msg_len);
    struct memory m = {.page_size = req->page_size, .page_count = req->page_count, .what = ""};
    if (req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_CUDA_IPC)
        m.cuda = req->cuda_ipc;
    else if (req->memory_case == KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_FD)
        m.fd = req->host_fd;
    else
        m.shm = req->host_shm;
    return open_memory(n, &m, pool_p, key, key_len, msg, msg_len);
}

/* The shape of buffer `i` (CQ thread): NULL or the message in `msg`. */
static const char *check_buffer(const Kvfence__V1__PoolBuffer *b, size_t i, uint32_t page_count,
                                char *msg, size_t cap)
{
    uint64_t need = (uint64_t)b->page_size * page_count;
    uint64_t size = 0;
    const char *field = NULL;
    if (b->page_size == 0) {
        snprintf(msg, cap, "buffers[%zu].page_size: must be >= 1", i);
        return msg;
    }
    switch (b->memory_case) {
    case KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_SHM:
        if (!b->host_shm->shm_name || !b->host_shm->shm_name[0]) {
            snprintf(msg, cap, "buffers[%zu].host_shm.shm_name: empty", i);
            return msg;
        }
        field = "host_shm";
        size = b->host_shm->size;
        break;
    case KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_FD:
        if (b->host_fd->handle.len != KVF_FDPASS_HANDLE_SIZE) {
            snprintf(msg, cap,
                     "buffers[%zu].host_fd.handle: must be the 16 bytes the fd socket answered", i);
            return msg;
        }
        field = "host_fd";
        size = b->host_fd->size;
        break;
    case KVFENCE__V1__POOL_BUFFER__MEMORY_CUDA_IPC:
        if (b->cuda_ipc->ipc_handle.len != KVF_POOL_CUDA_IPC_HANDLE_SIZE) {
            snprintf(msg, cap,
                     "buffers[%zu].cuda_ipc.ipc_handle: must be the 64 bytes of a "
                     "cudaIpcMemHandle_t",
                     i);
            return msg;
        }
        field = "cuda_ipc";
        size = b->cuda_ipc->size;
        break;
    default:
        snprintf(msg, cap, "buffers[%zu]: no memory given (host_shm, host_fd or cuda_ipc)", i);
        return msg;
    }
    if (size < need) {
        snprintf(msg, cap,
                 "buffers[%zu].%s.size: %" PRIu64 " bytes, smaller than page_size %u x "
                 "page_count %u",
                 i, field, size, b->page_size, page_count);
        return msg;
    }
    return NULL;
}

const char *node_devpool_check_buffers(const Kvfence__V1__RegisterPoolRequest *r, char *msg,
                                       size_t cap)
{
    if (r->memory_case != KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY__NOT_SET)
        return "buffers: given with memory (host_shm, host_fd or cuda_ipc): set one or the other";
    if (r->n_buffers > KVF_POOL_MAX_BUFFERS) {
        snprintf(msg, cap, "buffers: %zu given, at most %u", r->n_buffers, KVF_POOL_MAX_BUFFERS);
        return msg;
    }
    if (r->page_count == 0)
        return "page_count: must be >= 1";
    uint64_t sum = 0;
    for (size_t i = 0; i < r->n_buffers; i++) {
        if (check_buffer(r->buffers[i], i, r->page_count, msg, cap))
            return msg;
        sum += r->buffers[i]->page_size;
    }
    if (sum > UINT32_MAX) {
        snprintf(msg, cap, "buffers: their page sizes add up to %" PRIu64 " bytes, more than %u",
                 sum, UINT32_MAX);
        return msg;
    }
    if (r->page_size != 0 && r->page_size != sum) {
        snprintf(msg, cap, "page_size: %u, but buffers[].page_size add up to %" PRIu64,
                 r->page_size, sum);
        return msg;
    }
    return NULL;
}

bool node_devpool_is(const struct node_pool *p)
{
    return kvf_pool_is_device(p->pool);
}

int node_devpool_add_tcp(struct kvf_transport *tcp, const struct node_pool *p)
{
    if (node_devpool_is(p))
        return kvf_transport_tcp_add_device_pool(tcp, p->id, p->pool);
    return kvf_transport_tcp_add_pool(tcp, p->id, p->base, p->page_size, p->page_count);
}

int node_devpool_add_local(struct kvf_transport *local, const struct node_pool *p)
{
    if (node_devpool_is(p))
        return kvf_transport_local_add_device_pool(local, p->id, p->pool);
    return kvf_transport_local_add_pool(local, p->id, p->base, p->page_size, p->page_count);
}

const char *node_devpool_kind_name(const struct node_pool *p)
{
    return node_devpool_pool_kind_name(p->pool);
}

const char *node_devpool_pool_kind_name(const struct kvf_pool *pool)
{
    switch (kvf_pool_kind(pool)) {
    case KVF_POOL_CUDA_IPC:
        return "cuda_ipc";
    case KVF_POOL_FAKE_DEVICE:
        return "fake device (test)";
    case KVF_POOL_MULTI:
        return "multi-buffer";
    case KVF_POOL_HOST_SHM:
        break;
    }
    return "host_shm";
}

static void log_io(const char *what, uint32_t id, const struct kvf_pool *pool, const char *sub)
{
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(pool, &st);
    node_log("info", NULL,
             "%s %u%s (%s): writes=%" PRIu64 " write_bytes=%" PRIu64 " reads=%" PRIu64
             " read_bytes=%" PRIu64,
             what, id, sub, node_devpool_pool_kind_name(pool), st.writes, st.write_bytes, st.reads,
             st.read_bytes);
}

void node_devpool_log_stats(const struct node_pool *p)
{
    if (!node_devpool_is(p))
        return;
    log_io("device pool", p->id, p->pool, "");
    /* A multi-buffer pool: each buffer's own copies, so that tests see every
     * buffer took its slots. */
    for (uint32_t i = 0; i < kvf_pool_buffer_count(p->pool); i++) {
        char sub[32];
        snprintf(sub, sizeof sub, " buffer %u", i);
        log_io("pool", p->id, kvf_pool_buffer(p->pool, i), sub);
    }
}
/* ---- wire form ---------------------------------------------------------------- */

void node_pool_to_wire(const struct node_pool *p, Kvfence__V1__Pool *pv)
{
    kvfence__v1__pool__init(pv);
    pv->pool_id = p->id;
    pv->pool_key = (char *)p->key;
    /* A multi-buffer pool is CUDA_IPC when a buffer is (on its device). */
    const struct kvf_pool *cuda = NULL;
    if (p->pool && kvf_pool_kind(p->pool) == KVF_POOL_CUDA_IPC)
        cuda = p->pool;
    for (uint32_t i = 0; p->pool && !cuda && i < kvf_pool_buffer_count(p->pool); i++)
        if (kvf_pool_kind(kvf_pool_buffer(p->pool, i)) == KVF_POOL_CUDA_IPC)
            cuda = kvf_pool_buffer(p->pool, i);
    pv->kind = cuda ? KVFENCE__V1__POOL_KIND__POOL_KIND_CUDA_IPC
                    : KVFENCE__V1__POOL_KIND__POOL_KIND_HOST_SHM;
    pv->cuda_device = cuda ? kvf_pool_device(cuda) : 0;
    pv->page_size = p->page_size;
    pv->page_count = p->page_count;
    pv->owner_rank = p->rank;
    pv->base_addr = (uint64_t)(uintptr_t)p->base;
}

void node_pools_to_wire(struct kvf_node *n, Kvfence__V1__Pool *pv, Kvfence__V1__Pool **pp)
{
    for (uint32_t i = 0; i < n->npools; i++) {
        node_pool_to_wire(&n->pools[i], &pv[i]);
        pp[i] = &pv[i];
    }
}
