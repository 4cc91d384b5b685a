/*
 * bench_pool.c: what a multi-buffer pool's page costs to land and to send.
 * A frame of whole pages is written into a pool (kvf_pool_write: what the
 * TCP receiver and the local transport do per frame) and read back out
 * (kvf_pool_read: what a staged source does), for one host buffer of the
 * page size and for the same page split into an engine's buffers (layers x
 * K/V slots plus one aux slot, each buffer its own shm object). Prints GB/s
 * per case. Host memory only (a CUDA buffer's copy is cudaMemcpy2D).
 *
 *   bench_pool [--mib 256] [--rounds 20]
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pool.h"

#define FRAME_MAX (256u * 1024u)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A shm object of `size` bytes opened as a host pool of `count` pages of `ps`. */
static struct kvf_pool *host_pool(const char *tag, unsigned i, uint32_t ps, uint32_t count)
{
    char name[64];
    snprintf(name, sizeof name, "/kvf-bench-pool-%d-%s%u", (int)getpid(), tag, i);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    uint64_t size = (uint64_t)ps * count;
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        perror("shm");
        exit(1);
    }
    close(fd);
    struct kvf_pool *p = NULL;
    struct kvf_error err = {0};
    if (kvf_pool_open_shm(name, 0, size, ps, count, &p, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    shm_unlink(name); /* the mapping keeps it */
    return p;
}

/* One case: `layers` x (K, V) slots of `slot` bytes and an aux slot of
 * `aux` bytes; layers 0: one buffer of the whole page. */
static void run(const char *label, unsigned layers, uint32_t slot, uint32_t aux, uint64_t mib,
                unsigned rounds)
{
    uint32_t ps = layers ? 2 * layers * slot + aux : slot;
    uint32_t count = (uint32_t)((mib << 20) / ps);
    struct kvf_pool *pool;
    if (layers == 0) {
        pool = host_pool("one", 0, ps, count);
    } else {
        unsigned nb = 2 * layers + 1;
        struct kvf_pool **b = calloc(nb, sizeof *b);
        for (unsigned i = 0; i < nb; i++)
            b[i] = host_pool("buf", i, i + 1 == nb ? aux : slot, count);
        struct kvf_error err = {0};
        if (kvf_pool_open_buffers(b, nb, &pool, &err) != 0) {
            fprintf(stderr, "%s\n", err.msg);
            exit(1);
        }
        free(b);
    }
    uint32_t per = FRAME_MAX / ps ? FRAME_MAX / ps : 1;
    size_t flen = (size_t)per * ps;
    uint8_t *frame = malloc(flen);
    memset(frame, 0x5a, flen);
    /* Touch every page once so the first round does not pay the faults. */
    for (uint32_t pg = 0; pg + per <= count; pg += per)
        kvf_pool_write(pool, (uint64_t)pg * ps, frame, flen);
    uint64_t bytes = 0;
    double t0 = now_s();
    for (unsigned r = 0; r < rounds; r++)
        for (uint32_t pg = 0; pg + per <= count; pg += per) {
            kvf_pool_write(pool, (uint64_t)pg * ps, frame, flen);
            bytes += flen;
        }
    double tw = now_s() - t0;
    t0 = now_s();
    for (unsigned r = 0; r < rounds; r++)
        for (uint32_t pg = 0; pg + per <= count; pg += per)
            kvf_pool_read(pool, (uint64_t)pg * ps, frame, flen);
    double tr = now_s() - t0;
    printf("| %s | %u | %u | %u | %.2f | %.2f |\n", label, layers ? 2 * layers + 1 : 1, ps, per,
           (double)bytes / tw / 1e9, (double)bytes / tr / 1e9);
    free(frame);
    kvf_pool_close(pool);
}

int main(int argc, char **argv)
{
    uint64_t mib = 256;
    unsigned rounds = 20;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--mib") == 0)
            mib = strtoull(argv[i + 1], NULL, 10);
        else if (strcmp(argv[i], "--rounds") == 0)
            rounds = (unsigned)strtoul(argv[i + 1], NULL, 10);
    }
    printf("| layout | buffers | page bytes | pages a frame | write (scatter) GB/s | read (gather) "
           "GB/s |\n|---|---|---|---|---|---|\n");
    run("one buffer, 32832-byte pages", 0, 32832, 0, mib, rounds);
    run("8 layers x K/V x 2 KiB + 64 B aux", 8, 2048, 64, mib, rounds);
    run("one buffer, 131136-byte pages", 0, 131136, 0, mib, rounds);
    run("32 layers x K/V x 2 KiB + 64 B aux", 32, 2048, 64, mib, rounds);
    run("32 layers x K/V x 256 B + 64 B aux", 32, 256, 64, mib, rounds);
    return 0;
}
