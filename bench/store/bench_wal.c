/*
 * bench_wal.c: the embedded WAL store (controlplane/store) on this machine's
 * disk: group commit and recovery (docs/design.md §8: WAL recovery of 100,000 rooms
 * in under 2 s).
 *
 * Runs, each in a fresh directory:
 *   1. durable appends with 1, 8 and 64 writer threads, each writer appending
 *      200-byte records and waiting for each one to be durable, like an RPC
 *      handler: appends/s, fsyncs per append, mean batch, fsync latency;
 *   2. the same with one writer that does not wait (pipelined), to show the
 *      write path's ceiling;
 *   3. recovery of a log holding 100,000 rooms' worth of records (3 records
 *      of 200 bytes per room: 300,000 records, ~65 MB);
 *   4. writing a snapshot of 100,000 x 300 bytes (30 MB) and recovering it.
 * Recovery is timed with the files in the page cache and again after
 * posix_fadvise(DONTNEED) asked the kernel to drop them (cold, best effort).
 *
 * Usage: bench_wal [seconds per append run, default 2] [parent dir, default /tmp]
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "store.h"
#include "wal.h"
#include "kvf_clock.h"

#define ROOMS           100000
#define RECS_PER_ROOM   3
#define REC_BYTES       200
#define SNAP_ROOM_BYTES 300

static uint64_t now_ns(void)
{
    return (uint64_t)kvf_clock_mono_ns();
}

static void quiet_log(void *ctx, enum kvf_store_log_level level, const char *msg)
{
    (void)ctx;
    if (level != KVF_STORE_LOG_INFO)
        fprintf(stderr, "bench_wal: store: %s\n", msg);
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static char *make_dir(const char *parent)
{
    char *dir = malloc(strlen(parent) + 32);
    if (dir == NULL)
        return NULL;
    sprintf(dir, "%s/kvf_bench_wal_XXXXXX", parent);
    if (mkdtemp(dir) == NULL) {
        fprintf(stderr, "bench_wal: mkdtemp in %s: %s\n", parent, strerror(errno));
        free(dir);
        return NULL;
    }
    return dir;
}

static void remove_dir(char *dir)
{
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

static struct kvf_store *open_store(const char *dir, enum kvf_store_wal_sync sync,
                                    kvf_store_snapshot_fn on_snap, kvf_store_record_fn on_rec,
                                    void *ctx, struct kvf_store_recovery *info)
{
    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    o.sync = sync;
    o.log_fn = quiet_log;
    struct kvf_store *s = kvf_store_wal_create(&o);
    if (s == NULL)
        return NULL;
    struct kvf_error err = {0};
    if (kvf_store_recover(s, on_snap, on_rec, ctx, info, &err) != 0) {
        fprintf(stderr, "bench_wal: recover %s: %s\n", dir, err.msg);
        kvf_store_destroy(s);
        return NULL;
    }
    return s;
}

/* ---- durable appends -------------------------------------------------------- */

struct sync_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t done;
    int status;
};

static void sync_done(void *ctx, uint64_t seq, int status)
{
    (void)seq;
    struct sync_wait *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done++;
    if (status != 0)
        w->status = status;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

struct writer {
    struct kvf_store *s;
    uint64_t deadline;
    uint64_t appends;
    uint64_t lat_sum_ns;
    int status;
};

static void *writer_run(void *arg)
{
    struct writer *wr = arg;
    unsigned char rec[REC_BYTES];
    memset(rec, 0x5a, sizeof(rec));
    struct sync_wait w;
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    w.done = 0;
    w.status = 0;
    while (now_ns() < wr->deadline) {
        uint64_t t0 = now_ns();
        memcpy(rec, &wr->appends, sizeof(wr->appends));
        int rc = kvf_store_append(wr->s, rec, sizeof(rec), sync_done, &w, NULL);
        if (rc != 0) {
            wr->status = rc;
            break;
        }
        pthread_mutex_lock(&w.mu);
        while (w.done <= wr->appends)
            pthread_cond_wait(&w.cv, &w.mu);
        pthread_mutex_unlock(&w.mu);
        wr->appends++;
        wr->lat_sum_ns += now_ns() - t0;
    }
    if (w.status != 0)
        wr->status = w.status;
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    return NULL;
}

static uint64_t hist_pct(const struct kvf_store_stats *st, double pct)
{
    uint64_t total = 0;
    for (int i = 0; i < KVF_STORE_LAT_BUCKETS; i++)
        total += st->fsync_lat_us[i];
    uint64_t want = (uint64_t)(pct * (double)total);
    uint64_t acc = 0;
    for (int i = 0; i < KVF_STORE_LAT_BUCKETS; i++) {
        acc += st->fsync_lat_us[i];
        if (acc > want)
            return 16ull << i; /* upper edge of the bucket */
    }
    return 16ull << (KVF_STORE_LAT_BUCKETS - 1);
}

static int run_writers(const char *parent, int nthreads, double seconds)
{
    char *dir = make_dir(parent);
    if (dir == NULL)
        return -1;
    struct kvf_store *s = open_store(dir, KVF_STORE_WAL_FDATASYNC, NULL, NULL, NULL, NULL);
    if (s == NULL) {
        remove_dir(dir);
        return -1;
    }
    struct writer *w = calloc((size_t)nthreads, sizeof(*w));
    pthread_t *th = calloc((size_t)nthreads, sizeof(*th));
    if (w == NULL || th == NULL) {
        free(w);
        free(th);
        kvf_store_destroy(s);
        remove_dir(dir);
        return -1;
    }
    uint64_t t0 = now_ns();
    uint64_t deadline = t0 + (uint64_t)(seconds * 1e9);
    int started = 0;
    for (int i = 0; i < nthreads; i++) {
        w[i].s = s;
        w[i].deadline = deadline;
        if (pthread_create(&th[i], NULL, writer_run, &w[i]) != 0)
            break;
        started++;
    }
    uint64_t appends = 0;
    uint64_t lat = 0;
    int status = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        appends += w[i].appends;
        lat += w[i].lat_sum_ns;
        if (w[i].status != 0)
            status = w[i].status;
    }
    double el = (double)(now_ns() - t0) / 1e9;
    struct kvf_store_stats st;
    kvf_store_stats(s, &st);
    printf("%8d %12.0f %10.3f %9.1f %10.1f %9" PRIu64 " %9" PRIu64 "%s\n", started,
           (double)appends / el, (double)st.fsyncs / (double)(appends ? appends : 1),
           (double)st.records / (double)(st.commits ? st.commits : 1),
           (double)lat / 1e3 / (double)(appends ? appends : 1), hist_pct(&st, 0.5),
           hist_pct(&st, 0.99), status != 0 || started != nthreads ? "  (errors)" : "");
    free(w);
    free(th);
    kvf_store_destroy(s);
    remove_dir(dir);
    return status;
}

/* ---- pipelined appends ------------------------------------------------------ */

struct counter {
    uint64_t done;
};

static void count_done(void *ctx, uint64_t seq, int status)
{
    (void)seq;
    (void)status;
    struct counter *c = ctx;
    __atomic_add_fetch(&c->done, 1, __ATOMIC_RELEASE);
}

/* Appends `n` records of `len` bytes with at most `window` in flight. */
static int append_pipelined(struct kvf_store *s, uint64_t n, size_t len, uint64_t window)
{
    unsigned char rec[1024];
    memset(rec, 0xa5, sizeof(rec));
    struct counter c = {0};
    for (uint64_t i = 0; i < n; i++) {
        while (i - __atomic_load_n(&c.done, __ATOMIC_ACQUIRE) >= window)
            sched_yield();
        memcpy(rec, &i, sizeof(i));
        int rc = kvf_store_append(s, rec, len, count_done, &c, NULL);
        if (rc != 0)
            return rc;
    }
    while (__atomic_load_n(&c.done, __ATOMIC_ACQUIRE) < n)
        sched_yield();
    return 0;
}

static int run_pipelined(const char *parent)
{
    char *dir = make_dir(parent);
    if (dir == NULL)
        return -1;
    struct kvf_store *s = open_store(dir, KVF_STORE_WAL_FDATASYNC, NULL, NULL, NULL, NULL);
    if (s == NULL) {
        remove_dir(dir);
        return -1;
    }
    const uint64_t n = 300000;
    uint64_t t0 = now_ns();
    int rc = append_pipelined(s, n, REC_BYTES, 8192);
    double el = (double)(now_ns() - t0) / 1e9;
    struct kvf_store_stats st;
    kvf_store_stats(s, &st);
    printf("pipelined, 1 writer, <= 8192 in flight: %.0f appends/s, %.4f fsyncs/append, "
           "mean batch %.0f%s\n",
           (double)n / el, (double)st.fsyncs / (double)n,
           (double)st.records / (double)(st.commits ? st.commits : 1), rc ? " (errors)" : "");
    kvf_store_destroy(s);
    remove_dir(dir);
    return rc;
}

/* ---- recovery ---------------------------------------------------------------- */

struct replay {
    uint64_t records;
    uint64_t bytes;
    uint64_t sum;
    uint64_t snap_bytes;
};

static int on_record(void *ctx, uint64_t seq, const void *bytes, size_t len)
{
    (void)seq;
    struct replay *r = ctx;
    const unsigned char *p = bytes;
    r->records++;
    r->bytes += len;
    r->sum += len ? p[0] + p[len - 1] : 0; /* touch the payload */
    return 0;
}

static int on_snapshot(void *ctx, const void *bytes, size_t len, uint64_t seq)
{
    (void)seq;
    struct replay *r = ctx;
    const unsigned char *p = bytes;
    r->snap_bytes = len;
    for (size_t i = 0; i < len; i += 4096)
        r->sum += p[i];
    return 0;
}

/* Asks the kernel to drop the directory's files from the page cache. */
static void drop_cache(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char p[1024];
        snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
        int fd = open(p, O_RDONLY);
        if (fd >= 0) {
            fdatasync(fd);
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
    }
    closedir(d);
}

static int time_recovery(const char *dir, const char *what, bool cold)
{
    if (cold)
        drop_cache(dir);
    struct replay r = {0};
    struct kvf_store_recovery info;
    uint64_t t0 = now_ns();
    struct kvf_store *s =
        open_store(dir, KVF_STORE_WAL_FDATASYNC, on_snapshot, on_record, &r, &info);
    double ms = (double)(now_ns() - t0) / 1e6;
    if (s == NULL)
        return -1;
    printf("recover %-34s %s: %8.1f ms (%" PRIu64 " records, %.1f MB; snapshot %.1f MB)\n", what,
           cold ? "cold" : "warm", ms, r.records, (double)r.bytes / 1e6,
           (double)r.snap_bytes / 1e6);
    kvf_store_destroy(s);
    return 0;
}

static int produce_rooms(void *ctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)ctx;
    (void)seq;
    unsigned char room[SNAP_ROOM_BYTES];
    for (uint32_t i = 0; i < ROOMS; i++) {
        memset(room, (int)(i & 0xff), sizeof(room));
        memcpy(room, &i, sizeof(i));
        int rc = kvf_store_sink_write(sink, room, sizeof(room));
        if (rc != 0)
            return rc;
    }
    return 0;
}

static int run_recovery(const char *parent)
{
    char *dir = make_dir(parent);
    if (dir == NULL)
        return -1;
    struct kvf_store *s = open_store(dir, KVF_STORE_WAL_FDATASYNC, NULL, NULL, NULL, NULL);
    if (s == NULL) {
        remove_dir(dir);
        return -1;
    }
    const uint64_t n = (uint64_t)ROOMS * RECS_PER_ROOM;
    uint64_t t0 = now_ns();
    int rc = append_pipelined(s, n, REC_BYTES, 16384);
    printf("wrote %" PRIu64 " records of %d bytes in %.2f s\n", n, REC_BYTES,
           (double)(now_ns() - t0) / 1e9);
    kvf_store_destroy(s);
    if (rc == 0)
        rc = time_recovery(dir, "log of 100k rooms (300k records)", false);
    if (rc == 0)
        rc = time_recovery(dir, "log of 100k rooms (300k records)", true);

    /* Snapshot of 100k rooms, then recovery of the snapshot alone. */
    if (rc == 0) {
        s = open_store(dir, KVF_STORE_WAL_FDATASYNC, NULL, NULL, NULL, NULL);
        if (s == NULL)
            rc = -1;
    }
    if (rc == 0) {
        struct kvf_error err = {0};
        t0 = now_ns();
        rc = kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, produce_rooms, NULL, NULL, &err);
        if (rc != 0)
            fprintf(stderr, "bench_wal: snapshot: %s\n", err.msg);
        else
            printf("snapshot of 100k rooms x %d bytes written (and log truncated) in %.1f ms\n",
                   SNAP_ROOM_BYTES, (double)(now_ns() - t0) / 1e6);
        kvf_store_destroy(s);
    }
    if (rc == 0)
        rc = time_recovery(dir, "snapshot of 100k rooms (30 MB)", false);
    if (rc == 0)
        rc = time_recovery(dir, "snapshot of 100k rooms (30 MB)", true);
    remove_dir(dir);
    return rc;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 2.0;
    const char *parent = argc > 2 ? argv[2] : "/tmp";
    if (seconds <= 0)
        seconds = 2.0;
    printf("bench_wal: durable appends of %d-byte records, fdatasync, %.1f s per run, in %s\n",
           REC_BYTES, seconds, parent);
    printf("%8s %12s %10s %9s %10s %9s %9s\n", "writers", "appends/s", "fsync/app", "batch",
           "lat_us", "fs_p50us", "fs_p99us");
    int rc = 0;
    const int threads[] = {1, 8, 64};
    for (size_t i = 0; i < sizeof(threads) / sizeof(threads[0]) && rc == 0; i++)
        rc = run_writers(parent, threads[i], seconds);
    if (rc == 0)
        rc = run_pipelined(parent);
    if (rc == 0)
        rc = run_recovery(parent);
    return rc == 0 ? 0 : 1;
}
