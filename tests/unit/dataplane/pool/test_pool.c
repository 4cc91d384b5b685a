/*
 * test_pool.c: host shared-memory pools against real POSIX shm objects that
 * the test creates (shm_open O_CREAT with a name unique to the process),
 * fills with a pattern and unlinks at the end; and the CUDA IPC pool: opened
 * from an allocation exported by a child process when a device is present,
 * skipped (said in the output) when none is, -ENOTSUP in a build without CUDA;
 * the fake device pool of the tests and the pools' copy functions.
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#ifdef KVF_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "pool.h"

#define PAGE_SIZE  4096u
#define PAGE_COUNT 16u
#define OBJ_BYTES  ((size_t)PAGE_SIZE * PAGE_COUNT + 8192u)

static char g_name[64];

static uint8_t pattern(size_t i)
{
    return (uint8_t)(i * 31u + 7u);
}

static int setup_shm(void **state)
{
    (void)state;
    snprintf(g_name, sizeof(g_name), "/kvf-test-pool-%d", (int)getpid());
    shm_unlink(g_name);
    int fd = shm_open(g_name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)OBJ_BYTES) != 0) {
        close(fd);
        return -1;
    }
    uint8_t *p = mmap(NULL, OBJ_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        return -1;
    for (size_t i = 0; i < OBJ_BYTES; i++)
        p[i] = pattern(i);
    munmap(p, OBJ_BYTES);
    return 0;
}

static int teardown_shm(void **state)
{
    (void)state;
    return shm_unlink(g_name) == 0 ? 0 : -1;
}

static void test_open_read_pages(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    assert_int_equal(kvf_pool_open_shm(g_name, 0, (uint64_t)PAGE_SIZE * PAGE_COUNT, PAGE_SIZE,
                                       PAGE_COUNT, &pool, &err),
                     0);
    assert_non_null(pool);
    assert_int_equal(kvf_pool_kind(pool), KVF_POOL_HOST_SHM);
    assert_int_equal(kvf_pool_page_size(pool), PAGE_SIZE);
    assert_int_equal(kvf_pool_page_count(pool), PAGE_COUNT);
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
        uint8_t *p = kvf_pool_page(pool, pg);
        assert_non_null(p);
        for (size_t i = 0; i < PAGE_SIZE; i++)
            assert_int_equal(p[i], pattern((size_t)pg * PAGE_SIZE + i));
    }
    /* Writes go to the shared object. */
    uint8_t *p3 = kvf_pool_page(pool, 3);
    p3[5] = 0xA5;
    int fd = shm_open(g_name, O_RDONLY, 0);
    assert_true(fd >= 0);
    uint8_t b = 0;
    assert_int_equal(pread(fd, &b, 1, (off_t)(3 * PAGE_SIZE + 5)), 1);
    assert_int_equal(b, 0xA5);
    p3[5] = pattern(3 * PAGE_SIZE + 5);
    close(fd);
    assert_int_equal(kvf_pool_close(pool), 0);
}

static void test_offset_not_page_aligned(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    const uint64_t off = 1000; /* not a multiple of the system page */
    assert_int_equal(
        kvf_pool_open_shm(g_name, off, (uint64_t)PAGE_SIZE * 4, PAGE_SIZE, 4, &pool, NULL), 0);
    for (uint32_t pg = 0; pg < 4; pg++) {
        uint8_t *p = kvf_pool_page(pool, pg);
        assert_int_equal(p[0], pattern(off + (size_t)pg * PAGE_SIZE));
        assert_int_equal(p[PAGE_SIZE - 1], pattern(off + (size_t)pg * PAGE_SIZE + PAGE_SIZE - 1));
    }
    assert_int_equal(kvf_pool_close(pool), 0);
}

static void test_bounds(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    assert_int_equal(kvf_pool_open_shm(g_name, 0, (uint64_t)PAGE_SIZE * PAGE_COUNT, PAGE_SIZE,
                                       PAGE_COUNT, &pool, NULL),
                     0);
    assert_non_null(kvf_pool_page(pool, PAGE_COUNT - 1));
    assert_null(kvf_pool_page(pool, PAGE_COUNT));
    assert_null(kvf_pool_page(pool, UINT32_MAX));
    assert_int_equal(kvf_pool_check_range(pool, 0, 0, (uint64_t)PAGE_SIZE * PAGE_COUNT), 0);
    assert_int_equal(kvf_pool_check_range(pool, PAGE_COUNT - 1, 10, PAGE_SIZE - 10), 0);
    assert_int_equal(kvf_pool_check_range(pool, PAGE_COUNT - 1, 10, PAGE_SIZE - 9), -ERANGE);
    assert_int_equal(kvf_pool_check_range(pool, PAGE_COUNT, 0, 0), -ERANGE);
    assert_int_equal(kvf_pool_check_range(pool, 0, UINT64_MAX, 1), -ERANGE);
    assert_int_equal(kvf_pool_check_range(pool, 1, 0, UINT64_MAX), -ERANGE);
    assert_int_equal(kvf_pool_close(pool), 0);
}

static void test_unknown_name(void **state)
{
    (void)state;
    struct kvf_pool *pool = (struct kvf_pool *)(uintptr_t)0x1;
    struct kvf_error err = {0};
    assert_int_equal(
        kvf_pool_open_shm("/kvf-test-pool-does-not-exist", 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err),
        -ENOENT);
    assert_int_equal(err.code, -ENOENT);
    assert_non_null(strstr(err.msg, "kvf-test-pool-does-not-exist"));
    assert_ptr_equal(pool, (struct kvf_pool *)(uintptr_t)0x1); /* untouched on failure */
    printf("  unknown name: %s\n", err.msg);
}

static void test_invalid(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    /* The object is shorter than asked for. */
    assert_int_equal(kvf_pool_open_shm(g_name, 0, OBJ_BYTES + PAGE_SIZE, PAGE_SIZE,
                                       (uint32_t)(OBJ_BYTES / PAGE_SIZE) + 1, &pool, &err),
                     -EINVAL);
    printf("  too small: %s\n", err.msg);
    assert_int_equal(kvf_pool_open_shm(g_name, 8192, OBJ_BYTES, PAGE_SIZE, 1, &pool, &err),
                     -EINVAL);
    /* size < page_size x page_count. */
    assert_int_equal(kvf_pool_open_shm(g_name, 0, PAGE_SIZE * 2 - 1, PAGE_SIZE, 2, &pool, &err),
                     -EINVAL);
    assert_non_null(strstr(err.msg, "page_size"));
    assert_int_equal(kvf_pool_open_shm(g_name, 0, PAGE_SIZE, 0, 1, &pool, &err), -EINVAL);
    assert_int_equal(kvf_pool_open_shm(g_name, 0, PAGE_SIZE, PAGE_SIZE, 0, &pool, &err), -EINVAL);
    assert_int_equal(kvf_pool_open_shm("no-slash", 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err),
                     -EINVAL);
    assert_int_equal(kvf_pool_open_shm("/a/b", 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err), -EINVAL);
    assert_int_equal(kvf_pool_open_shm(NULL, 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err), -EINVAL);
    assert_null(pool);
}

/* An object the node may not open read-write: -EACCES. Root opens anything,
 * so as root the open runs in a child that dropped to "nobody". */
static void test_access_denied(void **state)
{
    (void)state;
    char name[64];
    snprintf(name, sizeof(name), "/kvf-test-pool-ro-%d", (int)getpid());
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0400);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, PAGE_SIZE), 0);
    close(fd);
    int rc;
    if (geteuid() != 0) {
        struct kvf_pool *pool = NULL;
        struct kvf_error err = {0};
        rc = kvf_pool_open_shm(name, 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err);
        printf("  read-only object: %s\n", err.msg);
    } else {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            if (setgid(65534) != 0 || setuid(65534) != 0)
                _exit(100);
            struct kvf_pool *pool = NULL;
            struct kvf_error err = {0};
            int r = kvf_pool_open_shm(name, 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err);
            printf("  read-only object (as nobody): %s\n", err.msg);
            fflush(stdout);
            _exit(-r);
        }
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFEXITED(status));
        assert_int_not_equal(WEXITSTATUS(status), 100);
        rc = -WEXITSTATUS(status);
    }
    shm_unlink(name);
    assert_int_equal(rc, -EACCES);
}

static void test_close_busy(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    assert_int_equal(kvf_pool_open_shm(g_name, 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, NULL), 0);
    assert_int_equal(kvf_pool_busy_get(pool), 0);
    assert_int_equal(kvf_pool_busy_get(pool), 0);
    assert_int_equal(kvf_pool_busy(pool), 2);
    assert_int_equal(kvf_pool_close(pool), -EBUSY);
    kvf_pool_busy_put(pool);
    assert_int_equal(kvf_pool_close(pool), -EBUSY);
    /* Still mapped and readable after refused closes. */
    assert_int_equal(((uint8_t *)kvf_pool_page(pool, 0))[1], pattern(1));
    kvf_pool_busy_put(pool);
    assert_int_equal(kvf_pool_busy(pool), 0);
    assert_int_equal(kvf_pool_close(pool), 0);
    assert_int_equal(kvf_pool_close(NULL), 0);
}

/* ---- device-pool copies -------------------------------------------------- */

/* The fake device pool: the same mapping as host_shm, another kind, and its
 * bytes reached through kvf_pool_write/kvf_pool_read, which count. */
static void test_fake_device_io(void **state)
{
    (void)state;
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    assert_int_equal(
        kvf_pool_open_fake_device(g_name, 4096, (uint64_t)PAGE_SIZE * 4, PAGE_SIZE, 4, &pool, &err),
        0);
    assert_int_equal(kvf_pool_kind(pool), KVF_POOL_FAKE_DEVICE);
    assert_true(kvf_pool_is_device(pool));
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(pool, &st);
    assert_int_equal(st.writes + st.reads + st.write_bytes + st.read_bytes, 0);

    uint8_t buf[PAGE_SIZE + 100];
    assert_int_equal(kvf_pool_read(pool, PAGE_SIZE - 50, buf, sizeof buf), 0);
    for (size_t i = 0; i < sizeof buf; i++)
        assert_int_equal(buf[i], pattern(4096 + PAGE_SIZE - 50 + i));
    uint8_t w[300];
    for (size_t i = 0; i < sizeof w; i++)
        w[i] = (uint8_t)(0xC0 ^ i);
    assert_int_equal(kvf_pool_write(pool, (uint64_t)PAGE_SIZE * 2 + 10, w, sizeof w), 0);
    uint8_t back[sizeof w + 2];
    assert_int_equal(kvf_pool_read(pool, (uint64_t)PAGE_SIZE * 2 + 9, back, sizeof back), 0);
    assert_int_equal(back[0], pattern(4096 + PAGE_SIZE * 2 + 9)); /* neighbours untouched */
    assert_memory_equal(back + 1, w, sizeof w);
    assert_int_equal(back[sizeof w + 1], pattern(4096 + PAGE_SIZE * 2 + 10 + sizeof w));

    /* Outside the pages: refused, nothing copied, not counted. */
    assert_int_equal(kvf_pool_write(pool, (uint64_t)PAGE_SIZE * 4 - 1, w, 2), -ERANGE);
    assert_int_equal(kvf_pool_read(pool, (uint64_t)PAGE_SIZE * 4 + 1, buf, 0), -ERANGE);
    assert_int_equal(kvf_pool_read(pool, UINT64_MAX, buf, 1), -ERANGE);
    assert_int_equal(kvf_pool_write(pool, (uint64_t)PAGE_SIZE * 4, w, 0),
                     0); /* empty, at the end */

    kvf_pool_io_stats(pool, &st);
    assert_int_equal(st.writes, 1);
    assert_int_equal(st.write_bytes, sizeof w);
    assert_int_equal(st.reads, 2);
    assert_int_equal(st.read_bytes, sizeof buf + sizeof back);
    assert_int_equal(kvf_pool_close(pool), 0);

    /* The write reached the shm object itself (another mapping sees it). */
    struct kvf_pool *host = NULL;
    assert_int_equal(
        kvf_pool_open_shm(g_name, 4096, (uint64_t)PAGE_SIZE * 4, PAGE_SIZE, 4, &host, NULL), 0);
    assert_false(kvf_pool_is_device(host));
    assert_memory_equal((uint8_t *)kvf_pool_page(host, 2) + 10, w, sizeof w);
    /* Host pools copy through the same functions (memcpy), counted alike. */
    uint8_t one = 0x11;
    assert_int_equal(kvf_pool_write(host, 0, &one, 1), 0);
    assert_int_equal(((uint8_t *)kvf_pool_page(host, 0))[0], 0x11);
    kvf_pool_io_stats(host, &st);
    assert_int_equal(st.writes, 1);
    /* restore the pattern for the other tests */
    one = pattern(4096);
    assert_int_equal(kvf_pool_write(host, 0, &one, 1), 0);
    for (size_t i = 0; i < sizeof w; i++)
        ((uint8_t *)kvf_pool_page(host, 2))[10 + i] = pattern(4096 + PAGE_SIZE * 2 + 10 + i);
    assert_int_equal(kvf_pool_close(host), 0);
}

/* ---- CUDA IPC ------------------------------------------------------------ */

#ifndef KVF_HAVE_CUDA
static void test_cuda_ipc(void **state)
{
    (void)state;
    uint8_t handle[KVF_POOL_CUDA_IPC_HANDLE_SIZE] = {0};
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    assert_int_equal(
        kvf_pool_open_cuda_ipc(handle, sizeof(handle), 0, 0, PAGE_SIZE, PAGE_SIZE, 1, &pool, &err),
        -ENOTSUP);
    assert_null(pool);
    printf("  built without CUDA: %s\n", err.msg);
}
#else
/* The exporter must be another process (a handle cannot be opened by the
 * process that made it), and CUDA must not be initialised before fork: the
 * child does all its CUDA work, including asking for a device, after fork. */
struct cuda_msg {
    int ndev;
    cudaIpcMemHandle_t handle;
};

static void cuda_child(int to_parent, int from_parent)
{
    struct cuda_msg m;
    memset(&m, 0, sizeof(m));
    if (cudaGetDeviceCount(&m.ndev) != cudaSuccess)
        m.ndev = 0;
    void *d = NULL;
    if (m.ndev > 0) {
        if (cudaSetDevice(0) != cudaSuccess ||
            cudaMalloc(&d, (size_t)PAGE_SIZE * 4) != cudaSuccess ||
            cudaMemset(d, 0x5A, (size_t)PAGE_SIZE * 4) != cudaSuccess ||
            cudaDeviceSynchronize() != cudaSuccess ||
            cudaIpcGetMemHandle(&m.handle, d) != cudaSuccess)
            m.ndev = -1;
    }
    if (write(to_parent, &m, sizeof(m)) != (ssize_t)sizeof(m))
        _exit(2);
    char go;
    if (read(from_parent, &go, 1) < 0) /* the parent closed its pool */
        _exit(3);
    if (d != NULL)
        cudaFree(d);
    _exit(0);
}

static void test_cuda_ipc(void **state)
{
    (void)state;
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        cuda_child(up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    struct cuda_msg m;
    assert_int_equal(read(up[0], &m, sizeof(m)), (ssize_t)sizeof(m));
    int status = 0;
    if (m.ndev <= 0) {
        close(down[1]);
        close(up[0]);
        waitpid(pid, &status, 0);
        assert_int_not_equal(m.ndev, -1);
        printf("  SKIPPED: CUDA IPC pool test: no CUDA device on this host\n");
        skip();
    }
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    int rc = kvf_pool_open_cuda_ipc(&m.handle, sizeof(m.handle), 0, PAGE_SIZE, PAGE_SIZE * 3,
                                    PAGE_SIZE, 3, &pool, &err);
    if (rc != 0)
        printf("  open: %s\n", err.msg);
    assert_int_equal(rc, 0);
    assert_int_equal(kvf_pool_kind(pool), KVF_POOL_CUDA_IPC);
    uint8_t host[PAGE_SIZE];
    assert_int_equal(cudaMemcpy(host, kvf_pool_page(pool, 2), PAGE_SIZE, cudaMemcpyDeviceToHost),
                     cudaSuccess);
    for (size_t i = 0; i < PAGE_SIZE; i++)
        assert_int_equal(host[i], 0x5A);
    assert_null(kvf_pool_page(pool, 3));
    /* The pool's own copies (cudaMemcpy host<->device). */
    assert_true(kvf_pool_is_device(pool));
    uint8_t w[100], r[102];
    memset(w, 0xA7, sizeof w);
    assert_int_equal(kvf_pool_write(pool, PAGE_SIZE + 7, w, sizeof w), 0);
    assert_int_equal(kvf_pool_read(pool, PAGE_SIZE + 6, r, sizeof r), 0);
    assert_int_equal(r[0], 0x5A);
    assert_memory_equal(r + 1, w, sizeof w);
    assert_int_equal(r[sizeof w + 1], 0x5A);
    assert_int_equal(kvf_pool_write(pool, (uint64_t)PAGE_SIZE * 3, w, 1), -ERANGE);
    assert_int_equal(kvf_pool_busy_get(pool), 0);
    assert_int_equal(kvf_pool_close(pool), -EBUSY);
    kvf_pool_busy_put(pool);
    assert_int_equal(kvf_pool_close(pool), 0);
    assert_int_equal(write(down[1], "g", 1), 1);
    close(down[1]);
    close(up[0]);
    waitpid(pid, &status, 0);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}
#endif

/* ---- multi-buffer pools ---------------------------------------------------------- */

/* Three buffers in the one object: 1000-byte slots at 0, 24-byte slots at
 * 20000, 3072-byte slots (a fake device buffer) at 24000: 4096 bytes a page. */
#define MB_OFF1 20000u
#define MB_OFF2 24000u

static void open_three(struct kvf_pool *b[3], uint32_t count1)
{
    struct kvf_error err = {0};
    assert_int_equal(
        kvf_pool_open_shm(g_name, 0, 1000u * PAGE_COUNT, 1000, PAGE_COUNT, &b[0], &err), 0);
    assert_int_equal(kvf_pool_open_shm(g_name, MB_OFF1, 24u * count1, 24, count1, &b[1], &err), 0);
    assert_int_equal(kvf_pool_open_fake_device(g_name, MB_OFF2, 3072u * PAGE_COUNT, 3072,
                                               PAGE_COUNT, &b[2], &err),
                     0);
}

/* Where byte `o` of page `pg` of the multi-buffer pool lies in the object. */
static size_t mb_at(uint32_t pg, uint32_t o)
{
    if (o < 1000)
        return (size_t)pg * 1000 + o;
    if (o < 1024)
        return MB_OFF1 + (size_t)pg * 24 + (o - 1000);
    return MB_OFF2 + (size_t)pg * 3072 + (o - 1024);
}

static void test_multi_buffers(void **state)
{
    (void)state;
    struct kvf_pool *b[3];
    open_three(b, PAGE_COUNT);
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    assert_int_equal(kvf_pool_open_buffers(b, 3, &pool, &err), 0);
    assert_int_equal(kvf_pool_kind(pool), KVF_POOL_MULTI);
    assert_int_equal(kvf_pool_page_size(pool), 4096);
    assert_int_equal(kvf_pool_page_count(pool), PAGE_COUNT);
    assert_true(kvf_pool_is_device(pool));
    assert_int_equal(kvf_pool_buffer_count(pool), 3);
    assert_ptr_equal(kvf_pool_buffer(pool, 2), b[2]);
    assert_null(kvf_pool_buffer(pool, 3));
    assert_int_equal(kvf_pool_buffer_count(b[0]), 0);
    assert_non_null(kvf_pool_page(pool, 0)); /* reserved addresses, distinct from the buffers' */
    assert_true((uint8_t *)kvf_pool_page(pool, 1) - (uint8_t *)kvf_pool_page(pool, 0) == 4096);

    /* Three whole pages (2, 3, 4), then a piece crossing every slot
     * boundary of page 6: each byte lands in its buffer's slot. */
    uint8_t frame[3 * 4096], piece[3100], back[3 * 4096];
    for (size_t i = 0; i < sizeof frame; i++)
        frame[i] = (uint8_t)(i * 7u + 3u);
    for (size_t i = 0; i < sizeof piece; i++)
        piece[i] = (uint8_t)(i * 5u + 1u);
    assert_int_equal(kvf_pool_write(pool, 2u * 4096, frame, sizeof frame), 0);
    assert_int_equal(kvf_pool_write(pool, 6u * 4096 + 990, piece, sizeof piece), 0);
    assert_int_equal(kvf_pool_write(pool, 15u * 4096 + 1, frame, 4096), -ERANGE);
    int fd = shm_open(g_name, O_RDONLY, 0);
    assert_true(fd >= 0);
    uint8_t *obj = mmap(NULL, OBJ_BYTES, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    assert_true(obj != MAP_FAILED);
    for (uint32_t k = 0; k < 3; k++)
        for (uint32_t o = 0; o < 4096; o++)
            assert_int_equal(obj[mb_at(2 + k, o)], frame[(size_t)k * 4096 + o]);
    for (uint32_t o = 0; o < sizeof piece; o++)
        assert_int_equal(obj[mb_at(6, 990 + o)], piece[o]);
    assert_int_equal(obj[mb_at(6, 989)], pattern(mb_at(6, 989))); /* around it: untouched */
    assert_int_equal(obj[mb_at(6, 990 + sizeof piece)], pattern(mb_at(6, 990 + sizeof piece)));
    assert_int_equal(obj[mb_at(1, 4095)], pattern(mb_at(1, 4095)));
    assert_int_equal(obj[mb_at(5, 0)], pattern(mb_at(5, 0)));
    munmap(obj, OBJ_BYTES);

    /* And back: the gather is the scatter's inverse. */
    assert_int_equal(kvf_pool_read(pool, 2u * 4096, back, sizeof back), 0);
    assert_memory_equal(back, frame, sizeof frame);
    assert_int_equal(kvf_pool_read(pool, 6u * 4096 + 990, back, sizeof piece), 0);
    assert_memory_equal(back, piece, sizeof piece);

    /* The whole pages were one strided copy per buffer each way; the piece
     * one copy per slot it touched. */
    struct kvf_pool_io_stats st;
    kvf_pool_io_stats(pool, &st);
    assert_int_equal(st.writes, 2);
    assert_int_equal(st.write_bytes, sizeof frame + sizeof piece);
    kvf_pool_io_stats(b[2], &st);
    assert_int_equal(st.writes, 2); /* the frame, and the piece's last 2066 bytes */
    assert_int_equal(st.write_bytes, 3u * 3072 + (sizeof piece - 10 - 24));
    assert_int_equal(st.reads, 2);
    kvf_pool_io_stats(b[1], &st);
    assert_int_equal(st.writes, 2);
    assert_int_equal(st.write_bytes, 3u * 24 + 24);

    /* Its layout: a fingerprint of its slots, 0 for one span a page. */
    assert_int_equal(kvf_pool_layout(b[0]), 0);
    assert_int_not_equal(kvf_pool_layout(pool), 0);

    /* Busy guards the pool, as any other; close closes the buffers. */
    assert_int_equal(kvf_pool_busy_get(pool), 0);
    assert_int_equal(kvf_pool_close(pool), -EBUSY);
    kvf_pool_busy_put(pool);
    assert_int_equal(kvf_pool_close(pool), 0);
}

static void test_multi_buffers_refused(void **state)
{
    (void)state;
    struct kvf_pool *b[3];
    open_three(b, PAGE_COUNT / 2); /* buffer 1 has 8 pages */
    struct kvf_pool *pool = NULL;
    struct kvf_error err = {0};
    assert_int_equal(kvf_pool_open_buffers(b, 3, &pool, &err), -EINVAL);
    assert_string_equal(err.msg, "buffers[1]: 8 pages, buffers[0] has 16");
    assert_int_equal(kvf_pool_open_buffers(b, 0, &pool, &err), -EINVAL);
    assert_null(pool);
    /* The caller kept them: a pool of two, then no nesting. */
    struct kvf_pool *two[2] = {b[0], b[2]};
    assert_int_equal(kvf_pool_open_buffers(two, 2, &pool, &err), 0);
    /* The same slots in the other order are another layout. */
    struct kvf_pool *c[2];
    assert_int_equal(kvf_pool_open_fake_device(g_name, MB_OFF2, 3072u * PAGE_COUNT, 3072,
                                               PAGE_COUNT, &c[0], &err),
                     0);
    assert_int_equal(
        kvf_pool_open_shm(g_name, 0, 1000u * PAGE_COUNT, 1000, PAGE_COUNT, &c[1], &err), 0);
    struct kvf_pool *rev = NULL, *again = NULL;
    assert_int_equal(kvf_pool_open_buffers(c, 2, &rev, &err), 0);
    assert_int_not_equal(kvf_pool_layout(rev), kvf_pool_layout(pool));
    assert_int_equal(kvf_pool_page_size(rev), kvf_pool_page_size(pool));
    struct kvf_pool *d[2];
    assert_int_equal(
        kvf_pool_open_shm(g_name, 0, 1000u * PAGE_COUNT, 1000, PAGE_COUNT, &d[0], &err), 0);
    assert_int_equal(kvf_pool_open_fake_device(g_name, MB_OFF2, 3072u * PAGE_COUNT, 3072,
                                               PAGE_COUNT, &d[1], &err),
                     0);
    assert_int_equal(kvf_pool_open_buffers(d, 2, &again, &err), 0);
    assert_int_equal(kvf_pool_layout(again), kvf_pool_layout(pool));
    assert_int_equal(kvf_pool_close(rev), 0);
    assert_int_equal(kvf_pool_close(again), 0);
    struct kvf_pool *nest[2] = {b[1], pool};
    assert_int_equal(kvf_pool_open_buffers(nest, 2, &pool, &err), -EINVAL);
    assert_string_equal(err.msg, "buffers[1]: a multi-buffer pool cannot nest");
    assert_int_equal(kvf_pool_close(pool), 0);
    assert_int_equal(kvf_pool_close(b[1]), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_read_pages),
        cmocka_unit_test(test_offset_not_page_aligned),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_unknown_name),
        cmocka_unit_test(test_invalid),
        cmocka_unit_test(test_access_denied),
        cmocka_unit_test(test_close_busy),
        cmocka_unit_test(test_cuda_ipc),
        cmocka_unit_test(test_fake_device_io),
        cmocka_unit_test(test_multi_buffers),
        cmocka_unit_test(test_multi_buffers_refused),
    };
    return cmocka_run_group_tests_name("pool", tests, setup_shm, teardown_shm);
}
