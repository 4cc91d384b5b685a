/*
 * test_node_pools.c: the memory engines hand over, registered through the C
 * client library (libkvfence) and moved end to end between real
 * kvfence-node processes (one kvfence-control, two nodes on 127.0.0.1; the
 * rooms and chunks go through node_harness.c).
 *
 * This machine has no GPU: "device memory" is the library's fake device
 * memory (kvf_fake_device_alloc), which exports a fake CUDA IPC handle that
 * the library sends in RegisterPool's cuda_ipc field like a real one; the
 * nodes run with --test-fake-device-pools and copy such a pool only as they
 * copy CUDA memory (kvf_pool_read/kvf_pool_write, counted and logged when the
 * pool is unregistered).
 *
 *   - a CUDA pool registered from C by device pointer (source, staged) and
 *     by exported handle at an offset (sink): byte-exact over TCP, every
 *     frame a device read at the source and a device write at the sink;
 *   - a fake handle sent to a node without --test-fake-device-pools is what
 *     it claims to be, a CUDA handle: refused, nothing registered;
 *   - multi-buffer pools (8 layers x K/V of 2 KiB slots + one 64-byte aux
 *     buffer, fake device and host buffers mixed): over TCP (the source
 *     staged) and on one node (local transport), every slot of every buffer
 *     checked, every buffer's copy count checked; an abort while a frame is
 *     held: ABORTED, every lease RELEASED, not one byte of any buffer
 *     written; bad buffer lists refused naming the field, nothing registered
 *     and nothing left mapped;
 *   - the engines' own terms: a source registered from SGLang-style
 *     ptrs/lens/item_lens, a sink from vLLM-style per-layer [2, blocks, ...]
 *     tensors (K and V halves), one page = one block across every layer;
 *     lists that do not divide into pages refused naming the entry.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "node_harness.h"
#include "pools_lib.h"

#define WAIT_MS     10000
#define PAGE_COUNT  64u
#define LEASE_PAGES 32u
#define MAX_BUFS    20u

/* One buffer of a test pool: host shm or fake device memory, mapped here. */
struct tbuf {
    char name[64];
    uint8_t *mem;  /* page 0 of the buffer (after `skip` bytes of the object) */
    uint8_t *base; /* the mapping */
    uint64_t map_len;
    uint64_t skip;
    uint32_t page_size;
    bool device;
};

struct tpool {
    struct tbuf b[MAX_BUFS];
    uint32_t nbufs;
    uint32_t pool_id;
};

struct fx {
    struct kvf_proc cp;
    struct kvf_rpc_channel *ch;
    char dir[64];
    char prefix[48]; /* --test-fake-device-pools */
    struct nh_node n1, n2;
    pl_client *c1, *c2;
    struct tpool src, sink;
};

/* Byte `i` of page `page` of buffer `b` under `seed`: differs between
 * buffers, pages and seeds, so a slot landed in the wrong buffer or page
 * shows. */
static uint8_t pat(uint32_t seed, uint32_t b, uint32_t page, uint32_t i)
{
    return (uint8_t)(seed * 29u + b * 97u + page * 157u + i * 3u + (i >> 8));
}

static int setup(void **state)
{
    return nh_fx_alloc(state, sizeof(struct fx));
}

static void tpool_free(struct tpool *p)
{
    for (uint32_t i = 0; i < p->nbufs; i++) {
        struct tbuf *b = &p->b[i];
        if (!b->base) /* none, or a view into another buffer's mapping */
            continue;
        if (b->device) {
            pl_fake_free(b->base);
        } else {
            munmap(b->base, b->map_len);
            shm_unlink(b->name);
        }
        b->base = NULL;
    }
}

static int teardown(void **state)
{
    struct fx *f = *state;
    pl_disconnect(f->c1);
    pl_disconnect(f->c2);
    struct nh_node *nodes[] = {&f->n1, &f->n2};
    int rc = nh_teardown(&f->cp, f->ch, nodes, 2, 8000, NULL, 0, f->dir);
    tpool_free(&f->src);
    tpool_free(&f->sink);
    free(f);
    return rc;
}

static void cp_start(struct fx *f)
{
    const char *args[] = {"--threads", "2", "--node-ttl-ms", "1500", "--resend-ms", "50", NULL};
    nh_control_start(&f->cp, &f->ch, args);
    nh_tmpdir(f->dir, sizeof f->dir, "pools");
    snprintf(f->prefix, sizeof f->prefix, "/kvf-fdev-%d-", (int)getpid());
}

static void node_start(struct fx *f, struct nh_node *np, pl_client **c, const char *tag,
                       const char *const *extra, unsigned flags)
{
    assert_int_equal(nh_node_start(np, f->dir, tag, tag, f->cp.target, extra, NH_LOG_FILE | flags),
                     0);
    char msg[PL_MSG];
    if (pl_connect(np->sock, c, msg) != 0)
        fail_msg("kvf_node_client_create: %s", msg);
}

/* Adds a buffer of `page_size` bytes per page to `p`, `skip` bytes into its
 * object, filled with `seed`'s pattern as buffer `p->nbufs`: fake device
 * memory (named under the fixture's prefix) or host shm. */
static struct tbuf *buf_add(struct fx *f, struct tpool *p, const char *tag, uint32_t page_size,
                            bool device, uint64_t skip, uint32_t seed)
{
    assert_true(p->nbufs < MAX_BUFS);
    uint32_t idx = p->nbufs++;
    struct tbuf *b = &p->b[idx];
    memset(b, 0, sizeof *b);
    b->page_size = page_size;
    b->device = device;
    b->skip = skip;
    b->map_len = skip + (uint64_t)page_size * PAGE_COUNT;
    if (device) {
        snprintf(b->name, sizeof b->name, "%s%s%u", f->prefix, tag, idx);
        void *m = NULL;
        char msg[PL_MSG];
        if (pl_fake_alloc(b->name, b->map_len, &m, msg) != 0)
            fail_msg("kvf_fake_device_alloc: %s", msg);
        b->base = m;
    } else {
        snprintf(b->name, sizeof b->name, "/kvf-hbuf-%d-%s%u", (int)getpid(), tag, idx);
        int fd = shm_open(b->name, O_RDWR | O_CREAT | O_EXCL, 0600);
        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, (off_t)b->map_len), 0);
        void *m = mmap(NULL, b->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        assert_true(m != MAP_FAILED);
        b->base = m;
    }
    b->mem = b->base + skip;
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
        for (uint32_t i = 0; i < page_size; i++)
            b->mem[(size_t)pg * page_size + i] = pat(seed, idx, pg, i);
    return b;
}

/* Every buffer of `p`: pages [dfirst, +count) hold `src_seed`'s pattern of
 * pages [sfirst, +count) (a copy landed), every other page `seed`'s. */
static void tpool_check(const struct tpool *p, uint32_t seed, uint32_t dfirst, uint32_t count,
                        uint32_t src_seed, uint32_t sfirst, const char *label)
{
    for (uint32_t b = 0; b < p->nbufs; b++) {
        const struct tbuf *tb = &p->b[b];
        for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
            bool copied = pg >= dfirst && pg < dfirst + count;
            for (uint32_t i = 0; i < tb->page_size; i++) {
                uint8_t want =
                    copied ? pat(src_seed, b, pg - dfirst + sfirst, i) : pat(seed, b, pg, i);
                uint8_t got = tb->mem[(size_t)pg * tb->page_size + i];
                if (got != want)
                    fail_msg("%s: buffer %u page %u byte %u: %u, want %u (%s)", label, b, pg, i,
                             got, want, copied ? "copied" : "canary");
            }
        }
    }
}

/* The node logged the line `want` exactly once. */
static void expect_log_once(struct nh_node *np, const char *want)
{
    if (nh_log_count(np, want, NULL) != 1) {
        nh_node_dump_log(np);
        fail_msg("node %s: want the log line '%s' once", np->id, want);
    }
}

/* Unregisters device pool `pool_id` of `np`; the node logs its copy counts. */
static void expect_device_io(struct nh_node *np, uint32_t pool_id, uint64_t writes,
                             uint64_t write_bytes, uint64_t reads, uint64_t read_bytes)
{
    nh_unregister_pool(np, pool_id, WAIT_MS);
    char any[64], want[200];
    snprintf(any, sizeof any, "device pool %u (", pool_id);
    nh_wait_log(np, any, NULL, 1, WAIT_MS);
    snprintf(want, sizeof want,
             "device pool %u (fake device (test)): writes=%llu write_bytes=%llu reads=%llu "
             "read_bytes=%llu",
             pool_id, (unsigned long long)writes, (unsigned long long)write_bytes,
             (unsigned long long)reads, (unsigned long long)read_bytes);
    expect_log_once(np, want);
}

/* A room: n1's `src` pages [0, 32) -> n2's `sink` pages [32, 64), both
 * nodes knowing it. */
static kvf_room_key room(struct fx *f, uint64_t id, uint32_t src_pool, uint32_t sink_pool)
{
    kvf_room_key k = nh_join_pair(f->ch, id, "n1", src_pool, 0, "n2", sink_pool, LEASE_PAGES,
                                  LEASE_PAGES, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, src_pool, "n2", sink_pool, LEASE_PAGES, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, src_pool, "n2", sink_pool, LEASE_PAGES, WAIT_MS);
    return k;
}

/* The same room with both sides on n1 (local transport). */
static kvf_room_key room_on_n1(struct fx *f, uint64_t id, uint32_t src_pool, uint32_t sink_pool)
{
    kvf_room_key k = nh_join_pair(f->ch, id, "n1", src_pool, 0, "n1", sink_pool, LEASE_PAGES,
                                  LEASE_PAGES, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, src_pool, "n1", sink_pool, LEASE_PAGES, WAIT_MS);
    return k;
}

/* Room `k`, aborting while a frame is held: no lease released yet and not
 * one byte of the sink written. */
static void expect_held(struct fx *f, kvf_room_key k)
{
    unsigned released = 9;
    (void)nh_room_state(f->ch, k, &released, NULL);
    assert_int_equal(released, 0); /* a frame is admitted: nothing may be released */
    tpool_check(&f->sink, 2, 0, 0, 1, 0, "sink while held");
}

/* Room `k` ends ABORTED with both of its leases RELEASED. */
static void expect_aborted_released(struct fx *f, kvf_room_key k)
{
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    unsigned released = 9, leases = 0;
    assert_int_equal(nh_room_state(f->ch, k, &released, &leases),
                     KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED);
    assert_int_equal(released, 2);
    assert_int_equal(leases, 2);
}

/* A chunk of one range: `count` pages from page `s` of `source_pool` on n1
 * to page `d` of `sink_pool` on `sink_node`. */
static struct nh_chunk chunk1(uint64_t seq, uint32_t source_pool, const char *sink_node,
                              uint32_t sink_pool, uint32_t s, uint32_t d, uint32_t count, bool last)
{
    struct nh_chunk ch = {.seq = seq,
                          .source_pool = source_pool,
                          .sink_node = sink_node,
                          .sink_pool = sink_pool,
                          .n = 1,
                          .sfirst = {s},
                          .dfirst = {d},
                          .count = {count},
                          .last = last};
    return ch;
}

/* SubmitChunk of `ch` on n1; fails the test unless OK. */
static void submit_ok(struct fx *f, kvf_room_key k, const struct nh_chunk *ch)
{
    struct kvf_rpc_status st;
    int code = nh_submit(f->n1.local, k, ch, &st);
    if (code != KVF_GRPC_OK)
        fail_msg("SubmitChunk %llu: %d %s", (unsigned long long)ch->seq, code, st.message);
}

/* SubmitChunk of `ch` on n1, refused at submit: FAILED_PRECONDITION with a
 * message holding `why`. */
static void submit_refused(struct fx *f, kvf_room_key k, const struct nh_chunk *ch, const char *why)
{
    struct kvf_rpc_status st;
    assert_int_equal(nh_submit(f->n1.local, k, ch, &st), KVF_GRPC_FAILED_PRECONDITION);
    printf("  refused: %s\n", st.message);
    assert_non_null(strstr(st.message, why));
}

/* Two chunks of 16 pages n1 -> `sink_node`; the room completes. */
static void transfer_to(struct fx *f, kvf_room_key k, uint32_t src_pool, const char *sink_node,
                        uint32_t sink_pool)
{
    for (uint32_t c = 0; c < 2; c++) {
        uint32_t s = c * (LEASE_PAGES / 2);
        struct nh_chunk ch = chunk1(c + 1, src_pool, sink_node, sink_pool, s, LEASE_PAGES + s,
                                    LEASE_PAGES / 2, c == 1);
        submit_ok(f, k, &ch);
    }
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
}

static void transfer(struct fx *f, kvf_room_key k, uint32_t src_pool, uint32_t sink_pool)
{
    transfer_to(f, k, src_pool, "n2", sink_pool);
}

/* kvfence-control and two nodes that take fake device pools, n1 staging
 * through host buffers (a device source over TCP needs it). */
static void device_pair(struct fx *f)
{
    cp_start(f);
    const char *a1[] = {"--staging", "host", "--test-fake-device-pools", f->prefix, NULL};
    const char *a2[] = {"--test-fake-device-pools", f->prefix, NULL};
    node_start(f, &f->n1, &f->c1, "n1", a1, 0);
    node_start(f, &f->n2, &f->c2, "n2", a2, 0);
}

/* ---- CUDA pools from C ------------------------------------------------------------ */

#define CUDA_PAGE 16384u /* 16 pages per 256 KiB frame: one frame per 16-page chunk */

static void test_cuda_pool_registered_from_c(void **state)
{
    struct fx *f = *state;
    device_pair(f);
    struct tbuf *s = buf_add(f, &f->src, "src", CUDA_PAGE, true, 0, 1);
    /* The sink's pool starts 8 KiB into its allocation: the exported offset
     * must come along. */
    struct tbuf *d = buf_add(f, &f->sink, "sink", CUDA_PAGE, true, 8192, 2);

    char msg[PL_MSG];
    uint64_t bytes = (uint64_t)CUDA_PAGE * PAGE_COUNT;
    if (pl_register_cuda(f->c1, s->mem, bytes, CUDA_PAGE, PAGE_COUNT, &f->src.pool_id, msg) != 0)
        fail_msg("kvf_register_pool_cuda: %s", msg);
    uint64_t off = 0;
    uint32_t dev = 9;
    if (pl_export(d->mem, &off, &dev, msg) != 0)
        fail_msg("kvf_cuda_ipc_export: %s", msg);
    assert_int_equal(off, 8192);
    assert_int_equal(dev, 0);
    if (pl_register_cuda_exported(f->c2, d->mem, bytes, CUDA_PAGE, PAGE_COUNT, &f->sink.pool_id,
                                  msg) != 0)
        fail_msg("kvf_register_pool_cuda_ipc: %s", msg);
    nh_wait_log(&f->n1, "fake device (test)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "fake device (test)", NULL, 1, WAIT_MS);

    kvf_room_key k = room(f, 801, f->src.pool_id, f->sink.pool_id);
    transfer(f, k, f->src.pool_id, f->sink.pool_id);
    tpool_check(&f->sink, 2, LEASE_PAGES, LEASE_PAGES, 1, 0, "sink");
    tpool_check(&f->src, 1, 0, 0, 1, 0, "source");
    /* Device path on both sides: one staged read per frame at the source,
     * one write per frame at the sink. */
    uint64_t moved = (uint64_t)LEASE_PAGES * CUDA_PAGE;
    expect_device_io(&f->n1, f->src.pool_id, 0, 0, 2, moved);
    expect_device_io(&f->n2, f->sink.pool_id, 2, moved, 0, 0);
    /* The sink's bytes before its offset were never touched. */
    for (uint32_t i = 0; i < 8192; i++)
        assert_int_equal(d->base[i], 0);
}

static void test_fake_handle_needs_the_flag(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    node_start(f, &f->n1, &f->c1, "n1", NULL, 0);
    struct tbuf *s = buf_add(f, &f->src, "src", CUDA_PAGE, true, 0, 1);
    char msg[PL_MSG];
    uint32_t id = 0;
    int rc = pl_register_cuda(f->c1, s->mem, (uint64_t)CUDA_PAGE * PAGE_COUNT, CUDA_PAGE,
                              PAGE_COUNT, &id, msg);
    printf("  fake handle, node without the flag: %d %s\n", rc, msg);
#ifdef KVF_TEST_HAVE_CUDA
    assert_true(rc == -KVF_GRPC_FAILED_PRECONDITION || rc == -KVF_GRPC_INVALID_ARGUMENT);
#else
    assert_int_equal(rc, -KVF_GRPC_FAILED_PRECONDITION);
    assert_string_equal(msg, "cuda_ipc: this kvfence-node was built without CUDA");
#endif
    /* Host memory that is no fake is not exported: no CUDA runtime here
     * (UNIMPLEMENTED), or the runtime says it is not device memory. */
    uint64_t off = 0;
    uint32_t dev = 0;
    static uint8_t plain[64];
    rc = pl_export(plain, &off, &dev, msg);
    printf("  export of host memory: %d %s\n", rc, msg);
    assert_true(rc == -KVF_GRPC_UNIMPLEMENTED || rc == -KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "kvf_cuda_ipc_export"));
    /* Nothing registered: the next pool is pool 1. */
    struct tbuf *h = buf_add(f, &f->sink, "h", CUDA_PAGE, false, 0, 2);
    assert_int_equal(pl_register_shm(f->c1, h->name, h->map_len, CUDA_PAGE, PAGE_COUNT, &id, msg),
                     0);
    assert_int_equal(id, 1);
}

/* ---- multi-buffer pools ------------------------------------------------------------ */

#define LAYERS   8u
#define KV_SLOT  2048u
#define AUX_SLOT 64u
#define MB_PAGE  (2u * LAYERS * KV_SLOT + AUX_SLOT) /* 32832: 7 pages per 256 KiB frame */
#define MB_BUFS  (2u * LAYERS + 1u)
/* Frames of a 16-page chunk: 7 + 7 + 2. */
#define MB_FRAMES 6u

/* 8 layers x (K, V), then aux: K (V) buffers fake device memory when
 * `dev_k` (`dev_v`), aux host shm. */
static void layout(struct fx *f, struct tpool *p, const char *tag, bool dev_k, bool dev_v,
                   uint32_t seed)
{
    for (uint32_t l = 0; l < LAYERS; l++) {
        buf_add(f, p, tag, KV_SLOT, dev_k, 0, seed);
        buf_add(f, p, tag, KV_SLOT, dev_v, 0, seed);
    }
    buf_add(f, p, tag, AUX_SLOT, false, 0, seed);
}

/* kvf_register_pool_buffers of every buffer of `p`. */
static uint32_t register_tpool(pl_client *c, struct tpool *p)
{
    struct pl_buf v[MAX_BUFS];
    for (uint32_t i = 0; i < p->nbufs; i++)
        v[i] = (struct pl_buf){.shm_name = p->b[i].device ? NULL : p->b[i].name,
                               .dev_ptr = p->b[i].device ? p->b[i].mem : NULL,
                               .size = (uint64_t)p->b[i].page_size * PAGE_COUNT,
                               .page_size = p->b[i].page_size};
    char msg[PL_MSG];
    uint32_t id = 0;
    if (pl_register_buffers(c, v, p->nbufs, PAGE_COUNT, &id, msg) != 0)
        fail_msg("kvf_register_pool_buffers: %s", msg);
    return id;
}

/* Registers f->src through `csrc` and f->sink through `csink`. */
static void register_tpools(struct fx *f, pl_client *csrc, pl_client *csink)
{
    f->src.pool_id = register_tpool(csrc, &f->src);
    f->sink.pool_id = register_tpool(csink, &f->sink);
}

/* The source as one host buffer of the multi-buffer page size (a
 * single-buffer pool sends the same bytes as a multi-buffer one of that page
 * size), registered on n1. */
static void one_buffer_source(struct fx *f)
{
    struct tbuf *s = buf_add(f, &f->src, "src", MB_PAGE, false, 0, 1);
    char msg[PL_MSG];
    if (pl_register_shm(f->c1, s->name, s->map_len, MB_PAGE, PAGE_COUNT, &f->src.pool_id, msg))
        fail_msg("kvf_register_pool_shm: %s", msg);
}

/* Unregisters multi-buffer pool `p` (`pool_id` on `np`) and checks the copy
 * counts logged for it and for each of its buffers: `writes` (`reads`)
 * copies of every buffer's slots of `pages` pages. */
static void expect_buffers_io(struct nh_node *np, const struct tpool *p, uint64_t writes,
                              uint64_t reads, uint64_t pages)
{
    nh_unregister_pool(np, p->pool_id, WAIT_MS);
    char any[64], want[220];
    snprintf(any, sizeof any, "pool %u buffer %u (", p->pool_id, p->nbufs - 1);
    nh_wait_log(np, any, NULL, 1, WAIT_MS);
    snprintf(want, sizeof want,
             "device pool %u (multi-buffer): writes=%llu write_bytes=%llu reads=%llu "
             "read_bytes=%llu",
             p->pool_id, (unsigned long long)writes,
             (unsigned long long)(writes ? pages * MB_PAGE : 0), (unsigned long long)reads,
             (unsigned long long)(reads ? pages * MB_PAGE : 0));
    expect_log_once(np, want);
    for (uint32_t b = 0; b < p->nbufs; b++) {
        uint64_t bytes = pages * p->b[b].page_size;
        snprintf(want, sizeof want,
                 "pool %u buffer %u (%s): writes=%llu write_bytes=%llu reads=%llu "
                 "read_bytes=%llu",
                 p->pool_id, b, p->b[b].device ? "fake device (test)" : "host_shm",
                 (unsigned long long)writes, (unsigned long long)(writes ? bytes : 0),
                 (unsigned long long)reads, (unsigned long long)(reads ? bytes : 0));
        expect_log_once(np, want);
    }
}

static void test_multi_buffer_pool_over_tcp(void **state)
{
    struct fx *f = *state;
    device_pair(f);
    layout(f, &f->src, "src", true, false, 1);
    layout(f, &f->sink, "sink", false, true, 2);
    register_tpools(f, f->c1, f->c2);
    char want[96];
    snprintf(want, sizeof want, "multi-buffer (%u buffers), %u pages of %u bytes", MB_BUFS,
             PAGE_COUNT, MB_PAGE);
    nh_wait_log(&f->n2, want, NULL, 1, WAIT_MS);

    /* One lease per side covers every buffer. */
    kvf_room_key k = room(f, 811, f->src.pool_id, f->sink.pool_id);
    transfer(f, k, f->src.pool_id, f->sink.pool_id);
    tpool_check(&f->sink, 2, LEASE_PAGES, LEASE_PAGES, 1, 0, "sink");
    tpool_check(&f->src, 1, 0, 0, 1, 0, "source");
    /* Every frame: one staged gather of every buffer at the source, one
     * scatter into every buffer at the sink. */
    expect_buffers_io(&f->n1, &f->src, 0, MB_FRAMES, LEASE_PAGES);
    expect_buffers_io(&f->n2, &f->sink, MB_FRAMES, 0, LEASE_PAGES);
}

static void test_multi_buffer_pool_same_node(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *a1[] = {"--test-fake-device-pools", f->prefix, NULL};
    node_start(f, &f->n1, &f->c1, "n1", a1, 0);
    layout(f, &f->src, "src", false, true, 1);
    layout(f, &f->sink, "sink", true, false, 2);
    register_tpools(f, f->c1, f->c1);
    kvf_room_key k = room_on_n1(f, 812, f->src.pool_id, f->sink.pool_id);
    transfer_to(f, k, f->src.pool_id, "n1", f->sink.pool_id);
    tpool_check(&f->sink, 2, LEASE_PAGES, LEASE_PAGES, 1, 0, "sink");
    tpool_check(&f->src, 1, 0, 0, 1, 0, "source");
    /* Local transport: each frame read from every source buffer and written
     * into every sink buffer through its host buffer. */
    expect_buffers_io(&f->n1, &f->src, 0, MB_FRAMES, LEASE_PAGES);
    expect_buffers_io(&f->n1, &f->sink, MB_FRAMES, 0, LEASE_PAGES);
}

static void test_multi_buffer_abort_with_frame_held(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *a2[] = {"--test-fake-device-pools", f->prefix, NULL};
    node_start(f, &f->n1, &f->c1, "n1", NULL, NH_FAULT_FILE);
    node_start(f, &f->n2, &f->c2, "n2", a2, 0);
    one_buffer_source(f);
    layout(f, &f->sink, "sink", true, false, 2);
    f->sink.pool_id = register_tpool(f->c2, &f->sink);
    kvf_room_key k = room(f, 813, f->src.pool_id, f->sink.pool_id);

    nh_set_faults(&f->n1, "hold=1\n", WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->src.pool_id, "n2", f->sink.pool_id, 0, LEASE_PAGES, 4);
    nh_wait_log(&f->n1, "fault: hold frame", NULL, 1, WAIT_MS);
    nh_abort_room(f->ch, k, "test abort");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, WAIT_MS);
    expect_held(f, k);

    nh_set_faults(&f->n1, "hold=0\n", WAIT_MS);
    nh_wait_log(&f->n1, "fault: release frame", NULL, 1, WAIT_MS);
    expect_aborted_released(f, k);
    /* After RELEASED: not one page of any buffer touched. */
    tpool_check(&f->sink, 2, 0, 0, 1, 0, "sink after release");
    expect_buffers_io(&f->n2, &f->sink, 0, 0, 0);
    tpool_check(&f->sink, 2, 0, 0, 1, 0, "sink after unregister");
}

/* RegisterPool of a raw request: the status code and message. */
static int register_raw(struct nh_node *np, Kvfence__V1__RegisterPoolRequest *req,
                        struct kvf_rpc_status *st)
{
    uint8_t *resp = NULL;
    size_t len = 0;
    int code =
        nh_call(np->local, "/kvfence.v1.NodeLocal/RegisterPool", &req->base, &resp, &len, st);
    free(resp);
    return code;
}

/* Whether the node process maps an object named `name`. */
static bool node_maps(const struct nh_node *np, const char *name)
{
    char path[64], line[512];
    snprintf(path, sizeof path, "/proc/%d/maps", (int)np->pid);
    FILE *fp = fopen(path, "r");
    assert_non_null(fp);
    bool found = false;
    while (!found && fgets(line, sizeof line, fp))
        found = strstr(line, name) != NULL;
    fclose(fp);
    return found;
}

static void expect_refused(struct nh_node *np, Kvfence__V1__RegisterPoolRequest *req, int want,
                           const char *field)
{
    struct kvf_rpc_status st;
    int code = register_raw(np, req, &st);
    printf("  refused: %d %s\n", code, st.message);
    if (code != want || strncmp(st.message, field, strlen(field)) != 0)
        fail_msg("RegisterPool: %d '%s', want %d starting '%s'", code, st.message, want, field);
}

static void test_bad_buffer_lists_refused(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *a1[] = {"--test-fake-device-pools", f->prefix, NULL};
    node_start(f, &f->n1, &f->c1, "n1", a1, 0);
    /* Five buffers the node may open by name (0660 objects). */
    enum { NB = 5 };
    Kvfence__V1__HostShmMemory shm[NB];
    Kvfence__V1__PoolBuffer pb[NB];
    Kvfence__V1__PoolBuffer *pp[NB];
    for (uint32_t i = 0; i < NB; i++) {
        struct tbuf *b = buf_add(f, &f->src, "bad", KV_SLOT, true, 0, 3);
        kvfence__v1__host_shm_memory__init(&shm[i]);
        shm[i].shm_name = b->name;
        shm[i].size = (uint64_t)KV_SLOT * PAGE_COUNT;
        kvfence__v1__pool_buffer__init(&pb[i]);
        pb[i].memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_SHM;
        pb[i].host_shm = &shm[i];
        pb[i].page_size = KV_SLOT;
        pp[i] = &pb[i];
    }
    Kvfence__V1__RegisterPoolRequest req = KVFENCE__V1__REGISTER_POOL_REQUEST__INIT;
    req.n_buffers = NB;
    req.buffers = pp;
    req.page_count = PAGE_COUNT;

    pb[3].page_size = 0;
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "buffers[3].page_size");
    pb[3].page_size = KV_SLOT;
    shm[2].size = (uint64_t)KV_SLOT * PAGE_COUNT - 1;
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "buffers[2].host_shm.size");
    shm[2].size = (uint64_t)KV_SLOT * PAGE_COUNT;
    pb[1].memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY__NOT_SET;
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "buffers[1]: no memory");
    uint8_t short_handle[10] = {0};
    Kvfence__V1__CudaIpcMemory cm = KVFENCE__V1__CUDA_IPC_MEMORY__INIT;
    cm.ipc_handle.data = short_handle;
    cm.ipc_handle.len = sizeof short_handle;
    cm.size = (uint64_t)KV_SLOT * PAGE_COUNT;
    pb[1].memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_CUDA_IPC;
    pb[1].cuda_ipc = &cm;
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "buffers[1].cuda_ipc.ipc_handle");
    pb[1].memory_case = KVFENCE__V1__POOL_BUFFER__MEMORY_HOST_SHM;
    pb[1].host_shm = &shm[1]; /* the oneof's pointers share one place */
    req.page_size = 4096;
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "page_size: 4096");
    req.page_size = 0;
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY_HOST_SHM;
    req.host_shm = &shm[0];
    expect_refused(&f->n1, &req, KVF_GRPC_INVALID_ARGUMENT, "buffers: given with memory");
    req.memory_case = KVFENCE__V1__REGISTER_POOL_REQUEST__MEMORY__NOT_SET;
    req.host_shm = NULL;

    /* The last buffer's object does not exist: buffers 0..3 were opened
     * (mapped) on the owner thread, and must be closed again. */
    char missing[64];
    snprintf(missing, sizeof missing, "%smissing", f->prefix);
    shm[4].shm_name = missing;
    expect_refused(&f->n1, &req, KVF_GRPC_NOT_FOUND, "buffers[4].");
    for (uint32_t i = 0; i < NB - 1; i++)
        if (node_maps(&f->n1, f->src.b[i].name))
            fail_msg("buffer %u (%s) is still mapped by the node", i, f->src.b[i].name);

    /* Nothing registered: no pool 1, and the next pool gets id 1 with the
     * page size of its buffers together. */
    Kvfence__V1__UnregisterPoolRequest ur = KVFENCE__V1__UNREGISTER_POOL_REQUEST__INIT;
    ur.pool_id = 1;
    uint8_t *resp = NULL;
    size_t len = 0;
    struct kvf_rpc_status st;
    assert_int_equal(
        nh_call(f->n1.local, "/kvfence.v1.NodeLocal/UnregisterPool", &ur.base, &resp, &len, &st),
        KVF_GRPC_NOT_FOUND);
    free(resp);
    shm[4].shm_name = f->src.b[4].name;
    resp = NULL;
    assert_int_equal(
        nh_call(f->n1.local, "/kvfence.v1.NodeLocal/RegisterPool", &req.base, &resp, &len, &st),
        KVF_GRPC_OK);
    Kvfence__V1__RegisterPoolResponse *r =
        kvfence__v1__register_pool_response__unpack(NULL, len, resp);
    free(resp);
    assert_non_null(r);
    assert_int_equal(r->pool->pool_id, 1);
    assert_int_equal(r->pool->page_size, NB * KV_SLOT);
    assert_int_equal(r->pool->page_count, PAGE_COUNT);
    kvfence__v1__register_pool_response__free_unpacked(r, NULL);
    for (uint32_t i = 0; i < NB; i++)
        assert_true(node_maps(&f->n1, f->src.b[i].name));
}

/* ---- the engines' own terms --------------------------------------------------------- */

/* A buffer inside another's mapping (a vLLM layer's V half): filled with
 * `seed`'s pattern as buffer `p->nbufs`; freed with its owner. */
static void buf_view(struct tpool *p, uint8_t *mem, uint32_t page_size, uint32_t seed)
{
    assert_true(p->nbufs < MAX_BUFS);
    uint32_t idx = p->nbufs++;
    struct tbuf *b = &p->b[idx];
    memset(b, 0, sizeof *b);
    b->mem = mem;
    b->page_size = page_size;
    b->device = true;
    for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
        for (uint32_t i = 0; i < page_size; i++)
            b->mem[(size_t)pg * page_size + i] = pat(seed, idx, pg, i);
}

static void test_sglang_to_vllm_layout(void **state)
{
    struct fx *f = *state;
    device_pair(f);
    /* The source as SGLang's KVArgs: 2 layers x (K, V), 2 KiB then 1 KiB a
     * page, each buffer its own allocation. */
    static const uint32_t item[4] = {2048, 2048, 1024, 1024};
    uint64_t ptrs[4], lens[4], item_lens[4];
    for (uint32_t i = 0; i < 4; i++) {
        struct tbuf *b = buf_add(f, &f->src, "sg", item[i], true, 0, 1);
        ptrs[i] = (uint64_t)(uintptr_t)b->mem;
        lens[i] = (uint64_t)item[i] * PAGE_COUNT;
        item_lens[i] = item[i];
    }
    char msg[PL_MSG];
    uint32_t id = 0;
    /* A buffer holding fewer pages than the first is refused, naming it. */
    lens[2] -= 1;
    assert_int_equal(pl_register_sglang(f->c1, ptrs, lens, item_lens, 4, 0, &id, msg),
                     -KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "kv_data_lens[2]"));
    lens[2] += 1;
    if (pl_register_sglang(f->c1, ptrs, lens, item_lens, 4, 0, &f->src.pool_id, msg) != 0)
        fail_msg("kvf_register_pool_sglang: %s", msg);

    /* The sink as vLLM's per-layer tensors [2, num_blocks, ...]: K then V
     * halves of one allocation per layer. */
    void *lp[2];
    uint64_t lsz[2];
    int split[2] = {1, 1};
    for (uint32_t l = 0; l < 2; l++) {
        uint32_t slot = item[2 * l];
        struct tbuf *k = buf_add(f, &f->sink, "vl", slot, true, 0, 2);
        /* buf_add mapped one slot's worth of pages: map the layer whole. */
        pl_fake_free(k->base);
        char name[64];
        snprintf(name, sizeof name, "%svl-layer%u", f->prefix, l);
        snprintf(k->name, sizeof k->name, "%s", name);
        void *m = NULL;
        if (pl_fake_alloc(name, 2ull * slot * PAGE_COUNT, &m, msg) != 0)
            fail_msg("kvf_fake_device_alloc: %s", msg);
        k->base = k->mem = m;
        k->map_len = 2ull * slot * PAGE_COUNT;
        for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
            for (uint32_t i = 0; i < slot; i++)
                k->mem[(size_t)pg * slot + i] = pat(2, f->sink.nbufs - 1, pg, i);
        buf_view(&f->sink, k->mem + (size_t)slot * PAGE_COUNT, slot, 2);
        lp[l] = m;
        lsz[l] = k->map_len;
    }
    uint64_t odd[2] = {lsz[0] - 2, lsz[1]};
    assert_int_equal(pl_register_vllm(f->c2, lp, odd, split, 2, PAGE_COUNT, &id, msg),
                     -KVF_GRPC_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "layers[0].size"));
    if (pl_register_vllm(f->c2, lp, lsz, split, 2, PAGE_COUNT, &f->sink.pool_id, msg) != 0)
        fail_msg("kvf_register_pool_vllm: %s", msg);

    /* SGLang's page i is vLLM's block i: one lease and one chunk each. */
    kvf_room_key k = room(f, 821, f->src.pool_id, f->sink.pool_id);
    transfer(f, k, f->src.pool_id, f->sink.pool_id);
    tpool_check(&f->sink, 2, LEASE_PAGES, LEASE_PAGES, 1, 0, "vLLM sink");
    tpool_check(&f->src, 1, 0, 0, 1, 0, "SGLang source");
}

static void test_page_larger_than_a_staging_buffer_refused(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    const char *a1[] = {"--staging", "host", NULL};
    node_start(f, &f->n1, &f->c1, "n1", a1, 0);
    node_start(f, &f->n2, &f->c2, "n2", NULL, 0);
    /* 2 x 160 KiB a page: 320 KiB, more than a 256 KiB staging buffer. */
    for (uint32_t i = 0; i < 2; i++) {
        buf_add(f, &f->src, "big", 160u * 1024, false, 0, 1);
        buf_add(f, &f->sink, "bigsink", 160u * 1024, false, 0, 2);
    }
    register_tpools(f, f->c1, f->c2);
    kvf_room_key k = room(f, 831, f->src.pool_id, f->sink.pool_id);
    struct nh_chunk ch = chunk1(1, f->src.pool_id, "n2", f->sink.pool_id, 0, LEASE_PAGES, 2, true);
    submit_refused(f, k, &ch, "more than a staging buffer");
    nh_abort_room(f->ch, k, "test: refused chunk");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    tpool_check(&f->sink, 2, 0, 0, 1, 0, "sink");
}

/* The sink of test_other_layout_refused: the same 32832-byte page as
 * layout(), but the aux slot first. */
static void layout_aux_first(struct fx *f, struct tpool *p, const char *tag, uint32_t seed)
{
    buf_add(f, p, tag, AUX_SLOT, false, 0, seed);
    for (uint32_t i = 0; i < 2 * LAYERS; i++)
        buf_add(f, p, tag, KV_SLOT, i % 2 == 0, 0, seed);
}

static void test_other_layout_refused(void **state)
{
    struct fx *f = *state;
    device_pair(f);
    layout(f, &f->src, "src", false, false, 1);
    layout_aux_first(f, &f->sink, "sink", 2);
    register_tpools(f, f->c1, f->c2);

    /* Over TCP the source cannot know: the sink refuses the frames before
     * any byte lands, and the room fails. */
    kvf_room_key k = room(f, 841, f->src.pool_id, f->sink.pool_id);
    struct nh_chunk ch =
        chunk1(1, f->src.pool_id, "n2", f->sink.pool_id, 0, LEASE_PAGES, LEASE_PAGES, true);
    submit_ok(f, k, &ch);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    nh_wait_log(&f->n2, "buffer layout differs from sink pool", NULL, 1, WAIT_MS);
    tpool_check(&f->sink, 2, 0, 0, 1, 0, "sink of another layout");
    expect_buffers_io(&f->n2, &f->sink, 0, 0, 0);

    /* On one node the check is at submit. */
    struct tpool *same = &f->sink;
    tpool_free(same);
    memset(same, 0, sizeof *same);
    layout_aux_first(f, same, "same", 2);
    same->pool_id = register_tpool(f->c1, same);
    kvf_room_key k2 = room_on_n1(f, 842, f->src.pool_id, same->pool_id);
    ch.sink_node = "n1";
    ch.sink_pool = same->pool_id;
    submit_refused(f, k2, &ch, "made of other buffers");
    nh_abort_room(f->ch, k2, "test: other layout");
    nh_wait_room_state(f->ch, k2, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTED, WAIT_MS);
    tpool_check(same, 2, 0, 0, 1, 0, "same-node sink of another layout");
}

static void test_one_region_into_buffers_goes_over_tcp(void **state)
{
    struct fx *f = *state;
    cp_start(f);
    char fabric[64];
    snprintf(fabric, sizeof fabric, "kvfp-%d", (int)getpid());
    const char *a[] = {"--rdma", "fake", "--rdma-fabric", fabric, NULL};
    node_start(f, &f->n1, &f->c1, "n1", a, 0);
    node_start(f, &f->n2, &f->c2, "n2", a, 0);
    nh_wait_log(&f->n1, "RDMA on: fake:", NULL, 1, WAIT_MS);
    /* A host source of the sink's page size (one RDMA region), a
     * multi-buffer host sink (a region per buffer). */
    one_buffer_source(f);
    layout(f, &f->sink, "sink", false, false, 2);
    f->sink.pool_id = register_tpool(f->c2, &f->sink);
    /* Its buffers are regions of their own, but a one-region source cannot
     * write its pages into them in one span: TCP. */
    nh_wait_log(&f->n2, "17 buffers registered for RDMA, one region each", NULL, 1, WAIT_MS);
    kvf_room_key k = room(f, 851, f->src.pool_id, f->sink.pool_id);
    transfer(f, k, f->src.pool_id, f->sink.pool_id);
    /* The single-buffer source sends page after page; every slot lands in
     * its buffer (the source's page b bytes [at, at + slot) are its
     * pattern for buffer 0 only: check against the source's bytes). */
    for (uint32_t b = 0; b < f->sink.nbufs; b++) {
        const struct tbuf *tb = &f->sink.b[b];
        uint32_t at = b < 2 * LAYERS ? b * KV_SLOT : 2 * LAYERS * KV_SLOT;
        for (uint32_t pg = 0; pg < PAGE_COUNT; pg++) {
            bool copied = pg >= LEASE_PAGES;
            for (uint32_t i = 0; i < tb->page_size; i++) {
                uint8_t want = copied ? pat(1, 0, pg - LEASE_PAGES, at + i) : pat(2, b, pg, i);
                if (tb->mem[(size_t)pg * tb->page_size + i] != want)
                    fail_msg("buffer %u page %u byte %u: %u, want %u", b, pg, i,
                             tb->mem[(size_t)pg * tb->page_size + i], want);
            }
        }
    }
    expect_buffers_io(&f->n2, &f->sink, MB_FRAMES, 0, LEASE_PAGES);
}

/* One 16-page chunk n1 [s, +16) -> n2 [d, +16) that completes. */
static void room16(struct fx *f, uint64_t id, uint32_t s, uint32_t d)
{
    kvf_room_key k =
        nh_join_pair(f->ch, id, "n1", f->src.pool_id, s, "n2", f->sink.pool_id, d, 16, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->src.pool_id, "n2", f->sink.pool_id, d, WAIT_MS);
    nh_wait_node_knows(&f->n2, k, f->src.pool_id, "n2", f->sink.pool_id, d, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->src.pool_id, "n2", f->sink.pool_id, s, d, 16);
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
}

/* Two nodes with --rdma fake (n1 with a fault file), 17-buffer host pools
 * registered on both (src on n1, sink on n2), each buffer its own region. */
static void rdma_pair(struct fx *f, unsigned n1_flags)
{
    cp_start(f);
    char fabric[64];
    snprintf(fabric, sizeof fabric, "kvfq-%d-%u", (int)getpid(), n1_flags);
    const char *a[] = {"--rdma", "fake", "--rdma-fabric", fabric, NULL};
    node_start(f, &f->n1, &f->c1, "n1", a, n1_flags);
    node_start(f, &f->n2, &f->c2, "n2", a, 0);
    nh_wait_log(&f->n1, "RDMA on: fake:", NULL, 1, WAIT_MS);
    layout(f, &f->src, "src", false, false, 1);
    layout(f, &f->sink, "sink", false, false, 2);
    register_tpools(f, f->c1, f->c2);
    nh_wait_log(&f->n1, "17 buffers registered for RDMA, one region each", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "17 buffers registered for RDMA, one region each", NULL, 1, WAIT_MS);
}

static void rdma_warm_up(struct fx *f, struct nh_pool *h1p, struct nh_pool *h2p)
{
    /* A multi-buffer source cannot go over TCP without staging (and RDMA
     * runs without): a room of two one-region pools opens the link. */
    struct nh_pool h1, h2;
    memset(&h1, 0, sizeof h1);
    memset(&h2, 0, sizeof h2);
    assert_int_equal(nh_pool_create(&h1, "pools-warm", "n1", 4096, 8, nh_canary1), 0);
    assert_int_equal(nh_pool_create(&h2, "pools-warm", "n2", 4096, 8, nh_canary2), 0);
    h1.pool_id = nh_register_pool(&f->n1, &h1);
    h2.pool_id = nh_register_pool(&f->n2, &h2);
    kvf_room_key w = nh_join_pair(f->ch, 860, "n1", h1.pool_id, 0, "n2", h2.pool_id, 4, 4, WAIT_MS);
    nh_wait_node_knows(&f->n1, w, h1.pool_id, "n2", h2.pool_id, 4, WAIT_MS);
    nh_submit_one_ok(&f->n1, w, h1.pool_id, "n2", h2.pool_id, 0, 4, 4);
    nh_wait_room_state(f->ch, w, KVFENCE__V1__ROOM_STATE__ROOM_STATE_COMPLETED, WAIT_MS);
    nh_wait_log(&f->n1, "up (initiator)", NULL, 1, WAIT_MS);
    nh_wait_log(&f->n2, "up (acceptor)", NULL, 1, WAIT_MS);

    *h1p = h1;
    *h2p = h2;
}

static void test_multi_buffer_pools_over_rdma(void **state)
{
    struct fx *f = *state;
    rdma_pair(f, 0);
    struct nh_pool h1, h2;
    rdma_warm_up(f, &h1, &h2);

    /* With the link up, each chunk is one RDMA write per buffer into that
     * buffer's own region: the sink's node scatters nothing. */
    room16(f, 861, 0, LEASE_PAGES);
    room16(f, 862, 16, LEASE_PAGES + 16);
    tpool_check(&f->sink, 2, LEASE_PAGES, LEASE_PAGES, 1, 0, "sink");
    tpool_check(&f->src, 1, 0, 0, 1, 0, "source");
    expect_buffers_io(&f->n2, &f->sink, 0, 0, 0);
    expect_buffers_io(&f->n1, &f->src, 0, 0, 0);
    nh_pool_destroy(&h1);
    nh_pool_destroy(&h2);
}

static void test_multi_buffer_abort_over_rdma_held(void **state)
{
    struct fx *f = *state;
    rdma_pair(f, NH_FAULT_FILE);
    struct nh_pool h1, h2;
    rdma_warm_up(f, &h1, &h2);
    nh_set_faults(&f->n1, "rdma_hold=1\n", WAIT_MS);
    kvf_room_key k = nh_join_pair(f->ch, 871, "n1", f->src.pool_id, 0, "n2", f->sink.pool_id,
                                  LEASE_PAGES, 16, WAIT_MS);
    nh_wait_node_knows(&f->n1, k, f->src.pool_id, "n2", f->sink.pool_id, LEASE_PAGES, WAIT_MS);
    nh_submit_one_ok(&f->n1, k, f->src.pool_id, "n2", f->sink.pool_id, 0, LEASE_PAGES, 16);
    nh_abort_room(f->ch, k, "test abort over rdma");
    nh_wait_room_state(f->ch, k, KVFENCE__V1__ROOM_STATE__ROOM_STATE_ABORTING, WAIT_MS);
    nh_wait_log(&f->n1, "abort notice", &k, 1, WAIT_MS);
    /* 17 writes held at n1 (one per buffer): nothing may be released. */
    expect_held(f, k);

    nh_set_faults(&f->n1, "rdma_hold=0\n", WAIT_MS);
    expect_aborted_released(f, k);
    /* The held writes went into the (still held) sink lease before the
     * release; after it, not one byte of any buffer changes. */
    static uint8_t snap[MB_BUFS][KV_SLOT * PAGE_COUNT];
    for (uint32_t b = 0; b < f->sink.nbufs; b++)
        memcpy(snap[b], f->sink.b[b].mem, (size_t)f->sink.b[b].page_size * PAGE_COUNT);
    nh_sleep_ms(300);
    for (uint32_t b = 0; b < f->sink.nbufs; b++) {
        const struct tbuf *tb = &f->sink.b[b];
        if (memcmp(snap[b], tb->mem, (size_t)tb->page_size * PAGE_COUNT) != 0)
            fail_msg("buffer %u changed after the leases were RELEASED", b);
        for (uint32_t pg = 0; pg < PAGE_COUNT; pg++)
            for (uint32_t i = 0; i < tb->page_size; i++) {
                uint8_t got = tb->mem[(size_t)pg * tb->page_size + i];
                bool leased = pg >= LEASE_PAGES && pg < LEASE_PAGES + 16;
                if (got != pat(2, b, pg, i) && !(leased && got == pat(1, b, pg - LEASE_PAGES, i)))
                    fail_msg("buffer %u page %u byte %u: %u is neither canary nor copy", b, pg, i,
                             got);
            }
    }
    nh_pool_destroy(&h1);
    nh_pool_destroy(&h2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_cuda_pool_registered_from_c, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fake_handle_needs_the_flag, setup, teardown),
        cmocka_unit_test_setup_teardown(test_multi_buffer_pool_over_tcp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_multi_buffer_pool_same_node, setup, teardown),
        cmocka_unit_test_setup_teardown(test_multi_buffer_abort_with_frame_held, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_buffer_lists_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sglang_to_vllm_layout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_page_larger_than_a_staging_buffer_refused, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_other_layout_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_one_region_into_buffers_goes_over_tcp, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_multi_buffer_pools_over_rdma, setup, teardown),
        cmocka_unit_test_setup_teardown(test_multi_buffer_abort_over_rdma_held, setup, teardown),
    };
    return cmocka_run_group_tests_name("node_pools", tests, NULL, NULL);
}
