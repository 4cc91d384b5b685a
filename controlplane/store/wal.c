/*
 * wal.c: the embedded store: an append-only, checksummed write-ahead log with
 * group commit, snapshots and truncation, in one data directory (wal.h).
 *
 * Formats (all integers little-endian):
 *   segment  wal-<first seq>.log: a 24-byte header, then records back to back,
 *            then (once the next segment exists) a seal.
 *            header  = "KVFW", u32 version (2; 1 is read too, it has no
 *                      seals), u64 first seq, u32 0, u32 CRC-32C of the 20
 *                      bytes before it.
 *            record  = u32 payload length, u32 CRC-32C over (u64 seq, payload),
 *                      u64 seq, payload. Seqs go up by exactly 1, also from
 *                      one segment to the next.
 *            seal    = a record header with length 0x80000000, no payload,
 *                      and the next segment's first seq: "the log goes on in
 *                      wal-<seq>.log". Written (and synced) only after that
 *                      segment is durable, so a last segment that ends in a
 *                      seal has lost its successor.
 *   snapshot snapshot-<seq>.snap: a 32-byte header, then the body.
 *            header  = "KVFS", u32 version (1), u64 seq covered, u64 body
 *                      length, u32 CRC-32C of the body, u32 CRC-32C of the 28
 *                      bytes before it.
 * A snapshot is written to snapshot-<seq>.snap.tmp, synced, renamed and the
 * directory synced; a file with the final name is therefore always complete,
 * and a corrupt one is reported, never skipped for an older one. After a
 * snapshot at S the log rolls to a new segment and segments that hold only
 * seqs <= S are deleted, as are older snapshots.
 *
 * Recovery trusts nothing it cannot verify: the newest snapshot must verify,
 * every segment but the last must verify completely and chain to the next one,
 * the log must reach back to the snapshot, and only the last segment may end
 * in a torn tail, which is cut at the last good record (ftruncate + fsync) and
 * reported. A torn tail holds only records whose append was never
 * acknowledged: an acknowledgement follows the sync that made the record and
 * everything before it durable. Damage is a torn tail only if no record that
 * verifies follows it (wal_check.c); a bad record followed by good ones, a
 * record with the wrong seq, a gap between segments, a sealed last segment or
 * a snapshot with no segment after it is corruption or a lost file: recovery
 * fails with -EIO naming the file, offset and seq, and nothing is changed.
 * Which damage can be torn is a property of its kind (enum wal_damage,
 * wal_damage_can_be_torn), never of a message's words. One exception keeps an
 * intact log startable: a seal whose write failed (the store stops at once
 * then) leaves at most a seal's bytes after the last record of a segment
 * that is not the last; recovery accepts it if those bytes are the seal's own
 * (or zeros) and the next segment chains on, and logs it.
 * With opts.repair (kvfence-control --repair-wal) it instead copies the files
 * it would change to repair-<UTC time>/ in the data dir, cuts the log at the
 * damage (later segments deleted), reports how many records that dropped,
 * and goes on.
 *
 * DESIGN: one committer thread per store owns the open segment (its fd, size
 * and rolling). Appenders, from any thread, copy their record into an entry,
 * take the next seq and link the entry at the tail of one queue under `mu`, so
 * queue order is seq order. The committer takes the whole queue at once,
 * writes it with writev (one call per WAL_IOV_BATCH records), syncs once
 * (group commit; a batch that fills a segment syncs it, rolls and goes on),
 * publishes durable_seq, and then, with no lock held, fires the callbacks in
 * seq order. The queue is not bounded: appenders that must not outrun the
 * disk wait for their callbacks (as RPC handlers do). write_snapshot() runs on its
 * caller's thread: it waits on `durable_cv` for its records to be durable,
 * writes the snapshot file, then asks the committer (roll_req_gen) to start a
 * new segment, waits for that, and deletes the covered segments itself. The
 * segment list and every counter are under `mu`. A failed write or sync makes
 * the store fail for good (failed != 0): queued and later appends are refused,
 * because what reached the disk is no longer known. recover() runs before the
 * committer exists, on its caller's thread, and owns everything then.
 */
#include "wal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "wal_internal.h"
#include "kvf_log.h"

#define WAL_SEG_MAGIC     "KVFW"
#define WAL_SNAP_MAGIC    "KVFS"
#define WAL_VERSION       2u /* segments with seals; 1 is still read */
#define WAL_SNAP_VERSION  1u
#define WAL_SNAP_HDR      32u
#define WAL_SEG_NAME_LEN  24u /* "wal-" + 16 hex + ".log" */
#define WAL_SNAP_NAME_LEN 30u /* "snapshot-" + 16 hex + ".snap" */
#define WAL_SNAP_BUF      (256u * 1024u)
#define WAL_IOV_BATCH     512

struct wal_entry {
    struct wal_entry *next;
    uint64_t seq;
    kvf_store_done_fn done;
    void *done_ctx;
    uint32_t len;        /* payload length */
    unsigned char rec[]; /* WAL_REC_HDR header + payload */
};

struct wal {
    struct kvf_store base; /* first: container_of */
    struct kvf_store_wal_opts opts;
    char *dir;
    int dir_fd;
    int lock_fd;

    pthread_mutex_t mu;
    pthread_cond_t work_cv;    /* committer: queue, roll request or stop */
    pthread_cond_t durable_cv; /* snapshot writers: durable_seq, roll_done_gen */
    pthread_mutex_t snap_mu;   /* one snapshot at a time */

    /* under mu */
    struct wal_entry *head;
    struct wal_entry *tail;
    bool recovered; /* recover() was called (successfully or not) */
    bool open;      /* recovered and the committer runs */
    bool stopping;
    int failed;
    uint64_t next_seq;
    uint64_t durable_seq;
    uint64_t snapshot_seq;
    uint64_t roll_below; /* roll if the open segment holds a seq <= this */
    uint64_t roll_req_gen;
    uint64_t roll_done_gen;
    uint64_t *seg_first; /* first seqs of the live segments, ascending */
    size_t seg_n;
    size_t seg_cap;
    struct kvf_store_stats st; /* counters only; the rest is filled on read */

    /* committer only (recover() before it starts) */
    int seg_fd;
    uint64_t seg_start; /* first seq of the open segment */
    uint64_t seg_size;
    uint64_t written_seq; /* last seq written to the log */
    bool thread_started;
    pthread_t committer;
};

/* ---- small helpers ----------------------------------------------------- */

static struct wal *wal_of(struct kvf_store *s)
{
    return (struct wal *)((char *)s - offsetof(struct wal, base));
}

static void put_u32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

#define get_u32 wal_get_u32
#define get_u64 wal_get_u64

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define record_crc wal_record_crc

static void seg_name(char *buf, size_t size, uint64_t first)
{
    snprintf(buf, size, "wal-%016" PRIx64 ".log", first);
}

static void snap_name(char *buf, size_t size, uint64_t seq)
{
    snprintf(buf, size, "snapshot-%016" PRIx64 ".snap", seq);
}

/* Parses 16 lowercase hex digits. */
static bool parse_hex16(const char *s, uint64_t *v_p)
{
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        if (c >= '0' && c <= '9')
            v = (v << 4) | (uint64_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v = (v << 4) | (uint64_t)(c - 'a' + 10);
        else
            return false;
    }
    *v_p = v;
    return true;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s);
    size_t m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static void wal_log(struct wal *w, enum kvf_store_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void wal_log(struct wal *w, enum kvf_store_log_level level, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (w->opts.log_fn != NULL) {
        w->opts.log_fn(w->opts.log_ctx, level, msg);
        return;
    }
    static const char *const names[] = {"info", "warn", "error"};
    kvf_log(names[level], "kvfence store: %s", msg);
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int pwrite_all(int fd, const void *buf, size_t len, off_t off)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t n = pwrite(fd, p, len, off);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += n;
        off += n;
        len -= (size_t)n;
    }
    return 0;
}

/* writev of every iovec, resuming after short writes. Modifies `iov`. */
static int writev_all(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        size_t left = (size_t)n;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* Syncs `fd` as the options say. Returns 0 or -errno. */
static int wal_sync_fd(const struct wal *w, int fd)
{
    int rc = 0;
    switch (w->opts.sync) {
    case KVF_STORE_WAL_FDATASYNC:
        rc = fdatasync(fd);
        break;
    case KVF_STORE_WAL_FSYNC:
        rc = fsync(fd);
        break;
    case KVF_STORE_WAL_UNSAFE_NO_SYNC:
        return 0;
    }
    return rc < 0 ? -errno : 0;
}

static int wal_sync_dir(const struct wal *w)
{
    if (w->opts.sync == KVF_STORE_WAL_UNSAFE_NO_SYNC)
        return 0;
    return fsync(w->dir_fd) < 0 ? -errno : 0;
}

/* Under mu. */
static int seg_list_push(struct wal *w, uint64_t first)
{
    if (w->seg_n == w->seg_cap) {
        size_t cap = w->seg_cap ? w->seg_cap * 2 : 16;
        uint64_t *a = realloc(w->seg_first, cap * sizeof(*a));
        if (a == NULL)
            return -ENOMEM;
        w->seg_first = a;
        w->seg_cap = cap;
    }
    w->seg_first[w->seg_n++] = first;
    return 0;
}

static unsigned lat_bucket(uint64_t ns)
{
    uint64_t us = ns / 1000;
    if (us < 16)
        return 0;
    unsigned b = (unsigned)(63 - __builtin_clzll(us)) - 3;
    return b < KVF_STORE_LAT_BUCKETS ? b : KVF_STORE_LAT_BUCKETS - 1;
}

/* ---- options, create --------------------------------------------------- */

void kvf_store_wal_opts_init(struct kvf_store_wal_opts *opts)
{
    memset(opts, 0, sizeof(*opts));
    opts->segment_bytes = 64ull << 20;
    opts->max_record_bytes = 16u << 20;
    opts->sync = KVF_STORE_WAL_FDATASYNC;
}

static const struct kvf_store_ops wal_ops;

struct kvf_store *kvf_store_wal_create(const struct kvf_store_wal_opts *opts)
{
    if (opts == NULL || opts->data_dir == NULL || opts->data_dir[0] == '\0' ||
        opts->segment_bytes < 4096 || opts->max_record_bytes == 0 ||
        opts->max_record_bytes > WAL_RECORD_HARD_MAX || (unsigned)opts->sync > 2) {
        kvf_log("error", "kvfence store: wal: invalid options (data_dir required, "
                         "segment_bytes >= 4096, 0 < max_record_bytes <= 1 GiB)");
        return NULL;
    }
    struct wal *w = calloc(1, sizeof(*w));
    if (w == NULL)
        goto err_log;
    w->dir = strdup(opts->data_dir);
    if (w->dir == NULL)
        goto err_free_wal;
    if (pthread_mutex_init(&w->mu, NULL) != 0)
        goto err_free_dir;
    if (pthread_cond_init(&w->work_cv, NULL) != 0)
        goto err_destroy_mu;
    if (pthread_cond_init(&w->durable_cv, NULL) != 0)
        goto err_destroy_work_cv;
    if (pthread_mutex_init(&w->snap_mu, NULL) != 0)
        goto err_destroy_durable_cv;
    w->base.ops = &wal_ops;
    w->opts = *opts;
    w->opts.data_dir = w->dir;
    w->dir_fd = -1;
    w->lock_fd = -1;
    w->seg_fd = -1;
    w->next_seq = 1;
    return &w->base;

err_destroy_durable_cv:
    pthread_cond_destroy(&w->durable_cv);
err_destroy_work_cv:
    pthread_cond_destroy(&w->work_cv);
err_destroy_mu:
    pthread_mutex_destroy(&w->mu);
err_free_dir:
    free(w->dir);
err_free_wal:
    free(w);
err_log:
    kvf_log("error", "kvfence store: wal: out of memory creating the store");
    return NULL;
}

/* ---- segments (committer, or recover() before the committer starts) ---- */

/* Creates wal-<first>.log with its header, syncs it and the directory, and
 * makes it the open segment (closing the previous one). */
static int wal_segment_create(struct wal *w, uint64_t first)
{
    char name[WAL_SEG_NAME_LEN + 1];
    unsigned char hdr[WAL_SEG_HDR];
    seg_name(name, sizeof(name), first);
    memcpy(hdr, WAL_SEG_MAGIC, 4);
    put_u32(hdr + 4, WAL_VERSION);
    put_u64(hdr + 8, first);
    put_u32(hdr + 16, 0);
    put_u32(hdr + 20, kvf_crc32c(0, hdr, 20));

    int fd = openat(w->dir_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) {
        int rc = -errno;
        wal_log(w, KVF_STORE_LOG_ERROR, "%s/%s: cannot create segment: %s", w->dir, name,
                strerror(-rc));
        return rc;
    }
    int rc = write_all(fd, hdr, sizeof(hdr));
    if (rc == 0)
        rc = wal_sync_fd(w, fd);
    if (rc == 0)
        rc = wal_sync_dir(w);
    if (rc != 0) {
        wal_log(w, KVF_STORE_LOG_ERROR, "%s/%s: cannot write segment header: %s", w->dir, name,
                strerror(-rc));
        goto err_unlink;
    }
    if (w->seg_fd >= 0) {
        /* The successor is durable: seal the segment it follows. */
        unsigned char seal[WAL_REC_HDR];
        put_u32(seal, WAL_SEAL_LEN);
        put_u32(seal + 4, record_crc(first, NULL, 0));
        put_u64(seal + 8, first);
        rc = write_all(w->seg_fd, seal, sizeof(seal));
        if (rc == 0)
            rc = wal_sync_fd(w, w->seg_fd);
        if (rc != 0) {
            /* Keep the new (empty, durable) segment: a seal that did reach
             * the disk must not point at a file that is gone. */
            wal_log(w, KVF_STORE_LOG_ERROR, "%s: cannot seal the segment before %s: %s", w->dir,
                    name, strerror(-rc));
            close(fd);
            return rc;
        }
    }
    pthread_mutex_lock(&w->mu);
    rc = seg_list_push(w, first);
    pthread_mutex_unlock(&w->mu);
    if (rc != 0)
        goto err_unlink;
    if (w->seg_fd >= 0)
        close(w->seg_fd);
    w->seg_fd = fd;
    w->seg_start = first;
    w->seg_size = WAL_SEG_HDR;
    return 0;

err_unlink:
    unlinkat(w->dir_fd, name, 0);
    close(fd);
    return rc;
}

/* Syncs the open segment, timing it into `*sync_ns_p`; counts the call. */
static int wal_sync_segment(struct wal *w, uint64_t *syncs_p, uint64_t *sync_ns_p)
{
    uint64_t t0 = now_ns();
    int rc = wal_sync_fd(w, w->seg_fd);
    *sync_ns_p = now_ns() - t0;
    if (w->opts.sync != KVF_STORE_WAL_UNSAFE_NO_SYNC)
        (*syncs_p)++;
    return rc;
}

/*
 * Writes one batch (linked entries, seq order) and syncs once: one writev per
 * WAL_IOV_BATCH records, one sync at the end. A batch that crosses the segment
 * limit syncs the full segment, rolls, and goes on in the new one (so a batch
 * touches one sync per segment it writes to). Committer only.
 */
static int wal_commit(struct wal *w, struct wal_entry *batch, uint64_t *syncs_p,
                      uint64_t *sync_ns_p)
{
    uint64_t size_before = w->seg_size;
    struct iovec iov[WAL_IOV_BATCH];
    int cnt = 0;
    int rc = 0;
    uint64_t last = 0;
    for (struct wal_entry *e = batch; e != NULL; e = e->next) {
        uint64_t rec_len = WAL_REC_HDR + (uint64_t)e->len;
        if (w->seg_size > WAL_SEG_HDR && w->seg_size + rec_len > w->opts.segment_bytes) {
            /* Full: make what it holds durable, then roll. */
            if (cnt > 0) {
                rc = writev_all(w->seg_fd, iov, cnt);
                cnt = 0;
                if (rc != 0)
                    goto err_cut;
            }
            rc = wal_sync_segment(w, syncs_p, sync_ns_p);
            if (rc != 0)
                goto err_cut;
            w->written_seq = last != 0 ? last : w->written_seq;
            rc = wal_segment_create(w, e->seq);
            if (rc != 0)
                return rc;
            size_before = w->seg_size;
        }
        put_u32(e->rec, e->len);
        put_u32(e->rec + 4, record_crc(e->seq, e->rec + WAL_REC_HDR, e->len));
        put_u64(e->rec + 8, e->seq);
        iov[cnt].iov_base = e->rec;
        iov[cnt].iov_len = (size_t)rec_len;
        w->seg_size += rec_len;
        last = e->seq;
        if (++cnt == WAL_IOV_BATCH) {
            rc = writev_all(w->seg_fd, iov, cnt);
            cnt = 0;
            if (rc != 0)
                goto err_cut;
        }
    }
    if (cnt > 0) {
        rc = writev_all(w->seg_fd, iov, cnt);
        if (rc != 0)
            goto err_cut;
    }
    rc = wal_sync_segment(w, syncs_p, sync_ns_p);
    if (rc != 0)
        return rc;
    w->written_seq = last;
    return 0;

err_cut:
    /* Best effort: leave no half record behind for the next start. */
    (void)!ftruncate(w->seg_fd, (off_t)size_before);
    w->seg_size = size_before;
    return rc;
}

/* Fires the callbacks of a batch in order and frees it. No lock held. */
static void wal_batch_finish(struct wal_entry *batch, int status)
{
    while (batch != NULL) {
        struct wal_entry *next = batch->next;
        if (batch->done != NULL)
            batch->done(batch->done_ctx, batch->seq, status);
        free(batch);
        batch = next;
    }
}

static void *wal_committer(void *arg)
{
    struct wal *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->head == NULL && !w->stopping && w->roll_req_gen == w->roll_done_gen)
            pthread_cond_wait(&w->work_cv, &w->mu);

        if (w->roll_req_gen != w->roll_done_gen) {
            uint64_t gen = w->roll_req_gen;
            uint64_t below = w->roll_below;
            int failed = w->failed;
            pthread_mutex_unlock(&w->mu);
            /* A segment holding a seq <= below is never empty (below <= written_seq). */
            int rc = 0;
            if (failed == 0 && w->seg_start <= below)
                rc = wal_segment_create(w, w->written_seq + 1);
            pthread_mutex_lock(&w->mu);
            if (rc != 0 && w->failed == 0)
                w->failed = rc;
            w->roll_done_gen = gen;
            pthread_cond_broadcast(&w->durable_cv);
            continue;
        }
        if (w->head == NULL)
            break; /* stopping, nothing left */

        struct wal_entry *batch = w->head;
        w->head = w->tail = NULL;
        int failed = w->failed;
        pthread_mutex_unlock(&w->mu);

        uint64_t n = 0;
        uint64_t bytes = 0;
        uint64_t last = 0;
        for (struct wal_entry *e = batch; e != NULL; e = e->next) {
            n++;
            bytes += WAL_REC_HDR + (uint64_t)e->len;
            last = e->seq;
        }
        uint64_t sync_ns = 0;
        uint64_t syncs = 0;
        int rc = failed != 0 ? failed : wal_commit(w, batch, &syncs, &sync_ns);
        if (rc != 0 && failed == 0)
            wal_log(w, KVF_STORE_LOG_ERROR,
                    "%s: writing records %" PRIu64 "..%" PRIu64 " failed: %s; the store "
                    "refuses further appends, restart to recover",
                    w->dir, batch->seq, last, strerror(-rc));

        pthread_mutex_lock(&w->mu);
        w->st.queued -= n;
        if (rc == 0) {
            w->durable_seq = last;
            w->st.records += n;
            w->st.bytes += bytes;
            w->st.commits++;
            if (n > w->st.max_batch)
                w->st.max_batch = n;
            if (syncs > 0) {
                w->st.fsyncs += syncs;
                w->st.last_fsync_ns = sync_ns;
                w->st.fsync_lat_us[lat_bucket(sync_ns)]++;
            }
        } else if (w->failed == 0) {
            w->failed = rc < 0 ? rc : -EIO; /* keep the cause (-ENOSPC, -EIO, ...) */
        }
        pthread_cond_broadcast(&w->durable_cv);
        pthread_mutex_unlock(&w->mu);

        wal_batch_finish(batch, rc == 0 ? 0 : rc < 0 ? rc : -EIO);
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* ---- append ------------------------------------------------------------ */

static int wal_append(struct kvf_store *s, const void *bytes, size_t len, kvf_store_done_fn done,
                      void *done_ctx, uint64_t *seq_p)
{
    struct wal *w = wal_of(s);
    if (len > w->opts.max_record_bytes)
        return -E2BIG;
    struct wal_entry *e = malloc(sizeof(*e) + WAL_REC_HDR + len);
    if (e == NULL)
        return -ENOMEM;
    if (len > 0)
        memcpy(e->rec + WAL_REC_HDR, bytes, len);
    e->len = (uint32_t)len;
    e->done = done;
    e->done_ctx = done_ctx;
    e->next = NULL;

    pthread_mutex_lock(&w->mu);
    int rc = 0;
    if (!w->open || w->stopping)
        rc = -EAGAIN;
    else if (w->failed != 0)
        rc = w->failed;
    if (rc != 0) {
        pthread_mutex_unlock(&w->mu);
        free(e);
        return rc;
    }
    e->seq = w->next_seq++;
    if (w->tail == NULL) {
        w->head = e;
        pthread_cond_signal(&w->work_cv);
    } else {
        w->tail->next = e;
    }
    w->tail = e;
    w->st.queued++;
    uint64_t seq = e->seq;
    pthread_mutex_unlock(&w->mu);
    if (seq_p != NULL)
        *seq_p = seq;
    return 0;
}

/* ---- snapshot ---------------------------------------------------------- */

struct wal_snap_sink {
    struct kvf_store_sink base; /* first */
    int fd;
    int error;
    uint32_t crc;
    uint64_t length;
    size_t used;
    unsigned char *buf;
};

static int snap_sink_flush(struct wal_snap_sink *k)
{
    if (k->used == 0 || k->error != 0)
        return k->error;
    k->error = write_all(k->fd, k->buf, k->used);
    k->used = 0;
    return k->error;
}

static int snap_sink_write(struct kvf_store_sink *sink, const void *bytes, size_t len)
{
    struct wal_snap_sink *k = (struct wal_snap_sink *)sink;
    if (k->error != 0)
        return k->error;
    k->crc = kvf_crc32c(k->crc, bytes, len);
    k->length += len;
    if (len >= WAL_SNAP_BUF) {
        if (snap_sink_flush(k) != 0)
            return k->error;
        k->error = write_all(k->fd, bytes, len);
        return k->error;
    }
    if (k->used + len > WAL_SNAP_BUF && snap_sink_flush(k) != 0)
        return k->error;
    memcpy(k->buf + k->used, bytes, len);
    k->used += len;
    return 0;
}

/* Writes snapshot-<seq>.snap via a temp file. Caller thread; no lock held. */
static int wal_snapshot_file(struct wal *w, uint64_t seq, kvf_store_produce_fn produce, void *ctx,
                             struct kvf_error *err)
{
    char name[WAL_SNAP_NAME_LEN + 1];
    char tmp[WAL_SNAP_NAME_LEN + 5];
    snap_name(name, sizeof(name), seq);
    snprintf(tmp, sizeof(tmp), "%s.tmp", name);

    struct wal_snap_sink k = {.base = {.write = snap_sink_write}};
    k.buf = malloc(WAL_SNAP_BUF);
    if (k.buf == NULL)
        return kvf_error_set(err, -ENOMEM, "%s: out of memory", name);
    int rc;
    k.fd = openat(w->dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (k.fd < 0) {
        rc = kvf_error_set(err, -errno, "%s/%s: cannot create: %s", w->dir, tmp, strerror(errno));
        goto err_free_buf;
    }
    unsigned char hdr[WAL_SNAP_HDR] = {0};
    rc = write_all(k.fd, hdr, sizeof(hdr)); /* placeholder, rewritten below */
    if (rc != 0) {
        kvf_error_set(err, rc, "%s/%s: write: %s", w->dir, tmp, strerror(-rc));
        goto err_unlink_tmp;
    }
    rc = produce(ctx, seq, &k.base);
    if (rc != 0) {
        kvf_error_set(err, rc, "%s: the snapshot producer failed (%s)", name, strerror(-rc));
        goto err_unlink_tmp;
    }
    rc = snap_sink_flush(&k);
    if (rc == 0) {
        memcpy(hdr, WAL_SNAP_MAGIC, 4);
        put_u32(hdr + 4, WAL_SNAP_VERSION);
        put_u64(hdr + 8, seq);
        put_u64(hdr + 16, k.length);
        put_u32(hdr + 24, k.crc);
        put_u32(hdr + 28, kvf_crc32c(0, hdr, 28));
        rc = pwrite_all(k.fd, hdr, sizeof(hdr), 0);
    }
    if (rc == 0)
        rc = wal_sync_fd(w, k.fd);
    if (rc != 0) {
        kvf_error_set(err, rc, "%s/%s: write: %s", w->dir, tmp, strerror(-rc));
        goto err_unlink_tmp;
    }
    if (renameat(w->dir_fd, tmp, w->dir_fd, name) != 0) {
        rc = kvf_error_set(err, -errno, "%s/%s: rename: %s", w->dir, name, strerror(errno));
        goto err_unlink_tmp;
    }
    rc = wal_sync_dir(w);
    if (rc != 0) {
        /* The rename may or may not be durable; the file is complete either way. */
        kvf_error_set(err, rc, "%s: fsync of the directory: %s", w->dir, strerror(-rc));
        goto err_close;
    }
    close(k.fd);
    free(k.buf);
    return 0;

err_unlink_tmp:
    unlinkat(w->dir_fd, tmp, 0);
err_close:
    close(k.fd);
err_free_buf:
    free(k.buf);
    return rc;
}

/* Deletes snapshots older than `seq`. Caller thread. Returns how many. */
static unsigned wal_remove_old_snapshots(struct wal *w, uint64_t seq)
{
    int fd = dup(w->dir_fd);
    if (fd < 0)
        return 0;
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        close(fd);
        return 0;
    }
    rewinddir(d);
    unsigned removed = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        uint64_t v;
        if (strlen(de->d_name) == WAL_SNAP_NAME_LEN && strncmp(de->d_name, "snapshot-", 9) == 0 &&
            ends_with(de->d_name, ".snap") && parse_hex16(de->d_name + 9, &v) && v < seq) {
            if (unlinkat(w->dir_fd, de->d_name, 0) == 0)
                removed++;
            else
                wal_log(w, KVF_STORE_LOG_WARN, "%s/%s: cannot remove old snapshot: %s", w->dir,
                        de->d_name, strerror(errno));
        }
    }
    closedir(d);
    return removed;
}

static int wal_write_snapshot(struct kvf_store *s, uint64_t seq, kvf_store_produce_fn produce,
                              void *ctx, uint64_t *seq_p, struct kvf_error *err)
{
    struct wal *w = wal_of(s);
    int rc = 0;
    pthread_mutex_lock(&w->snap_mu);
    pthread_mutex_lock(&w->mu);
    if (!w->open || w->stopping) {
        rc = kvf_error_set(err, -EAGAIN, "%s: store not open", w->dir);
        goto out_unlock;
    }
    uint64_t last = w->next_seq - 1;
    if (seq == KVF_STORE_SEQ_LAST)
        seq = last;
    if (seq == 0 || seq > last || seq < w->snapshot_seq) {
        rc = kvf_error_set(err, -EINVAL,
                           "%s: snapshot seq %" PRIu64 " out of range (snapshot %" PRIu64
                           ", last appended %" PRIu64 ")",
                           w->dir, seq, w->snapshot_seq, last);
        goto out_unlock;
    }
    while (w->durable_seq < seq && w->failed == 0)
        pthread_cond_wait(&w->durable_cv, &w->mu);
    if (w->failed != 0) {
        rc = kvf_error_set(err, w->failed, "%s: store failed: %s", w->dir, strerror(-w->failed));
        goto out_unlock;
    }
    pthread_mutex_unlock(&w->mu);

    rc = wal_snapshot_file(w, seq, produce, ctx, err);
    if (rc != 0) {
        pthread_mutex_unlock(&w->snap_mu);
        return rc;
    }

    /* Truncation: the committer starts a new segment past the snapshot, then
     * every segment whose successor starts at or below seq + 1 is covered. */
    pthread_mutex_lock(&w->mu);
    w->snapshot_seq = seq;
    w->st.snapshots++;
    w->roll_below = seq;
    uint64_t gen = ++w->roll_req_gen;
    pthread_cond_signal(&w->work_cv);
    while (w->roll_done_gen < gen)
        pthread_cond_wait(&w->durable_cv, &w->mu);
    size_t drop = 0;
    while (drop + 1 < w->seg_n && w->seg_first[drop + 1] <= seq + 1)
        drop++;
    uint64_t *gone = NULL;
    if (drop > 0) {
        gone = malloc(drop * sizeof(*gone));
        if (gone != NULL) {
            memcpy(gone, w->seg_first, drop * sizeof(*gone));
            memmove(w->seg_first, w->seg_first + drop, (w->seg_n - drop) * sizeof(*gone));
            w->seg_n -= drop;
            w->st.segments_removed += drop;
        } else {
            drop = 0; /* keep them: the next snapshot retries */
        }
    }
    pthread_mutex_unlock(&w->mu);

    for (size_t i = 0; i < drop; i++) {
        char name[WAL_SEG_NAME_LEN + 1];
        seg_name(name, sizeof(name), gone[i]);
        if (unlinkat(w->dir_fd, name, 0) != 0)
            wal_log(w, KVF_STORE_LOG_WARN, "%s/%s: cannot remove covered segment: %s", w->dir, name,
                    strerror(errno));
    }
    free(gone);
    unsigned old = wal_remove_old_snapshots(w, seq);
    if (drop > 0 || old > 0)
        (void)wal_sync_dir(w); /* a lost unlink only leaves a covered file behind */
    if (seq_p != NULL)
        *seq_p = seq;
    pthread_mutex_unlock(&w->snap_mu);
    return 0;

out_unlock:
    pthread_mutex_unlock(&w->mu);
    pthread_mutex_unlock(&w->snap_mu);
    return rc;
}

/* ---- recovery ---------------------------------------------------------- */

/* A read-only mapping of one file of the data directory. */
struct wal_map {
    const unsigned char *p;
    size_t size;
};

static int wal_map_file(struct wal *w, const char *name, int flags, int *fd_p, struct wal_map *m,
                        struct kvf_error *err)
{
    int fd = openat(w->dir_fd, name, flags | O_CLOEXEC);
    if (fd < 0)
        return kvf_error_set(err, -errno, "%s/%s: open: %s", w->dir, name, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int rc = kvf_error_set(err, -errno, "%s/%s: stat: %s", w->dir, name, strerror(errno));
        close(fd);
        return rc;
    }
    m->size = (size_t)sb.st_size;
    m->p = NULL;
    if (m->size > 0) {
        void *p = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            int rc = kvf_error_set(err, -errno, "%s/%s: mmap: %s", w->dir, name, strerror(errno));
            close(fd);
            return rc;
        }
        madvise(p, m->size, MADV_SEQUENTIAL);
        m->p = p;
    }
    *fd_p = fd;
    return 0;
}

static void wal_unmap(struct wal_map *m)
{
    if (m->p != NULL)
        munmap((void *)m->p, m->size);
    m->p = NULL;
}

/* Loads and verifies the snapshot, then hands it to on_snapshot. */
static int wal_load_snapshot(struct wal *w, uint64_t seq, kvf_store_snapshot_fn on_snapshot,
                             void *ctx, struct kvf_store_recovery *info, struct kvf_error *err)
{
    char name[WAL_SNAP_NAME_LEN + 1];
    snap_name(name, sizeof(name), seq);
    struct wal_map m;
    int fd;
    int rc = wal_map_file(w, name, O_RDONLY, &fd, &m, err);
    if (rc != 0)
        return rc;
    const char *what = NULL;
    char detail[96] = "";
    if (m.size < WAL_SNAP_HDR) {
        what = "shorter than its header";
        snprintf(detail, sizeof(detail), " (%zu bytes)", m.size);
    } else if (memcmp(m.p, WAL_SNAP_MAGIC, 4) != 0) {
        what = "bad magic";
    } else if (get_u32(m.p + 28) != kvf_crc32c(0, m.p, 28)) {
        what = "header CRC mismatch";
    } else if (get_u32(m.p + 4) != WAL_SNAP_VERSION) {
        what = "unsupported version";
        snprintf(detail, sizeof(detail), " %u", get_u32(m.p + 4));
    } else if (get_u64(m.p + 8) != seq) {
        what = "seq in header differs from its name";
    } else if (get_u64(m.p + 16) != m.size - WAL_SNAP_HDR) {
        what = "length mismatch";
        snprintf(detail, sizeof(detail), " (header says %" PRIu64 " bytes, file has %zu)",
                 get_u64(m.p + 16), m.size - WAL_SNAP_HDR);
    } else {
        uint32_t want = get_u32(m.p + 24);
        uint32_t got = kvf_crc32c(0, m.p + WAL_SNAP_HDR, m.size - WAL_SNAP_HDR);
        if (want != got) {
            what = "body CRC mismatch";
            snprintf(detail, sizeof(detail), " (stored %08x, computed %08x)", want, got);
        }
    }
    if (what != NULL) {
        rc = kvf_error_set(err, -EBADMSG,
                           "%s is corrupt: %s%s; refusing to start rather than lose the state "
                           "it holds (data dir %s)",
                           name, what, detail, w->dir);
        wal_log(w, KVF_STORE_LOG_ERROR, "%s", err != NULL ? err->msg : name);
        goto out;
    }
    info->snapshot_seq = seq;
    info->snapshot_bytes = m.size - WAL_SNAP_HDR;
    if (on_snapshot != NULL) {
        rc = on_snapshot(ctx, m.p + WAL_SNAP_HDR, m.size - WAL_SNAP_HDR, seq);
        if (rc != 0)
            kvf_error_set(err, rc, "%s: the snapshot consumer refused it (%s)", name,
                          strerror(-rc));
    }
out:
    wal_unmap(&m);
    close(fd);
    return rc;
}

/* State of the replay across segments. */
struct wal_replay {
    kvf_store_record_fn on_record;
    void *ctx;
    uint64_t snap_seq;
    uint64_t expect;      /* seq the next record must carry; 0 = take the first one */
    uint64_t last;        /* last record seq read from the log (delivered or not) */
    const uint64_t *segs; /* every segment (first seqs, ascending) and this one's index */
    size_t nsegs;
    size_t idx;
    bool stop; /* repaired: this segment is the last one now */
};

/* --repair-wal: backs up the segments from index `from` on (all of them
 * when `cut` is false, plus the one being cut), so that the cut below can
 * be undone by hand. Sets info's backup name. */
static int wal_repair_backup(struct wal *w, const struct wal_replay *r, size_t from,
                             struct kvf_store_recovery *info, struct kvf_error *err)
{
    char backup[KVF_STORE_NAME_MAX];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(backup, sizeof(backup), "repair-%Y%m%dT%H%M%SZ", &tm);
    size_t n = r->nsegs - from;
    char(*names)[WAL_SEG_NAME_LEN + 1] = calloc(n ? n : 1, sizeof(*names));
    const char **list = calloc(n ? n : 1, sizeof(*list));
    int rc = -ENOMEM;
    if (names != NULL && list != NULL) {
        for (size_t i = 0; i < n; i++) {
            seg_name(names[i], sizeof(names[i]), r->segs[from + i]);
            list[i] = names[i];
        }
        rc = wal_backup_files(w->dir_fd, backup, list, n);
    }
    free(list);
    free(names);
    if (rc != 0)
        return kvf_error_set(err, rc, "%s/%s: cannot write the backup: %s; nothing repaired",
                             w->dir, backup, strerror(-rc));
    snprintf(info->repair_backup, sizeof(info->repair_backup), "%s", backup);
    return 0;
}

/* --repair-wal: deletes the segments after index `idx` and counts their
 * records into info->repair_dropped. */
static int wal_repair_drop_after(struct wal *w, const struct wal_replay *r, size_t idx,
                                 struct kvf_store_recovery *info, struct kvf_error *err)
{
    for (size_t i = idx + 1; i < r->nsegs; i++) {
        char name[WAL_SEG_NAME_LEN + 1];
        seg_name(name, sizeof(name), r->segs[i]);
        info->repair_dropped += wal_file_records(w->dir_fd, name);
        if (unlinkat(w->dir_fd, name, 0) != 0)
            return kvf_error_set(err, -errno, "%s/%s: unlink: %s", w->dir, name, strerror(errno));
    }
    int rc = wal_sync_dir(w);
    if (rc != 0)
        return kvf_error_set(err, rc, "%s: fsync: %s", w->dir, strerror(-rc));
    return 0;
}

/*
 * Reads one segment. For the last segment, a bad tail is cut and reported;
 * for any other, -EIO. `*keep_p` is set false when the last segment had no
 * valid header and was removed.
 */
static int wal_replay_segment(struct wal *w, uint64_t first, bool is_last, struct wal_replay *r,
                              struct kvf_store_recovery *info, bool *keep_p, uint64_t *size_p,
                              struct kvf_error *err)
{
    char name[WAL_SEG_NAME_LEN + 1];
    seg_name(name, sizeof(name), first);
    struct wal_map m;
    int fd;
    int rc = wal_map_file(w, name, is_last ? O_RDWR : O_RDONLY, &fd, &m, err);
    if (rc != 0)
        return rc;
    *keep_p = true;

    const char *hdr_bad = NULL;
    if (m.size < WAL_SEG_HDR)
        hdr_bad = "incomplete header";
    else if (memcmp(m.p, WAL_SEG_MAGIC, 4) != 0)
        hdr_bad = "bad magic";
    else if (get_u32(m.p + 20) != kvf_crc32c(0, m.p, 20))
        hdr_bad = "header CRC mismatch";
    else if (get_u32(m.p + 4) != 1 && get_u32(m.p + 4) != WAL_VERSION)
        hdr_bad = "unsupported version";
    else if (get_u64(m.p + 8) != first)
        hdr_bad = "first seq in header differs from its name";
    if (hdr_bad != NULL) {
        if (is_last && m.size <= WAL_SEG_HDR) {
            /* Torn while being created: it never held a record. */
            info->tail_cut = true;
            info->tail_cut_bytes = m.size;
            info->tail_cut_offset = 0;
            info->tail_good_seq = r->last;
            snprintf(info->tail_file, sizeof(info->tail_file), "%s", name);
            snprintf(info->tail_reason, sizeof(info->tail_reason), "%s (segment removed)", hdr_bad);
            wal_log(w, KVF_STORE_LOG_WARN, "%s/%s: %s, no records: removed", w->dir, name, hdr_bad);
            if (unlinkat(w->dir_fd, name, 0) != 0)
                rc = kvf_error_set(err, -errno, "%s/%s: unlink: %s", w->dir, name, strerror(errno));
            *keep_p = false;
            goto out;
        }
        rc = kvf_error_set(err, -EBADMSG,
                           "%s/%s: %s; refusing to start rather than drop the records after it",
                           w->dir, name, hdr_bad);
        goto out;
    }
    if (r->expect != 0 && first != r->expect) {
        if (w->opts.repair) {
            /* The records from r->expect to first - 1 are gone: drop this
             * segment and every later one, start anew after the gap. */
            rc = wal_repair_backup(w, r, r->idx, info, err);
            if (rc == 0) {
                /* The gap's own records (a deleted segment), then this one's. */
                info->repair_dropped += first - r->expect;
                info->repair_dropped += wal_file_records(w->dir_fd, name);
                if (unlinkat(w->dir_fd, name, 0) != 0)
                    rc = kvf_error_set(err, -errno, "%s/%s: unlink: %s", w->dir, name,
                                       strerror(errno));
            }
            if (rc == 0)
                rc = wal_repair_drop_after(w, r, r->idx, info, err);
            if (rc == 0) {
                info->repaired = true;
                snprintf(info->repair_what, sizeof(info->repair_what),
                         "%s starts at seq %" PRIu64 " but seq %" PRIu64
                         " was expected: removed it and every later segment",
                         name, first, r->expect);
                *keep_p = false;
                r->stop = true;
            }
            goto out;
        }
        wal_log(w, KVF_STORE_LOG_ERROR,
                "%s/%s starts at seq %" PRIu64 " but seq %" PRIu64
                " was expected: records are missing (a segment deleted?); refusing to start "
                "(restore the file, or run kvfence-control --repair-wal to go on without them)",
                w->dir, name, first, r->expect);
        rc = kvf_error_set(err, -EIO,
                           "%s: seq %" PRIu64 " expected, the segment starts at %" PRIu64
                           ": a segment is missing; refusing to start",
                           name, r->expect, first);
        goto out;
    }
    r->expect = first;

    size_t off = WAL_SEG_HDR;
    enum wal_damage bad = WAL_DAMAGE_NONE;
    char detail[64] = "";
    bool sealed = false;
    while (off < m.size) {
        size_t left = m.size - off;
        if (left < WAL_REC_HDR) {
            bad = WAL_DAMAGE_SHORT_HEADER;
            break;
        }
        const unsigned char *h = m.p + off;
        uint32_t len = get_u32(h);
        uint64_t seq = get_u64(h + 8);
        if (len == WAL_SEAL_LEN) {
            if (get_u32(h + 4) != record_crc(seq, NULL, 0)) {
                bad = WAL_DAMAGE_CRC;
            } else if (seq != r->expect) {
                bad = WAL_DAMAGE_SEAL_GAP;
                snprintf(detail, sizeof(detail), " (expected %" PRIu64 ", found %" PRIu64 ")",
                         r->expect, seq);
            } else if (left != WAL_REC_HDR) {
                bad = WAL_DAMAGE_AFTER_SEAL;
            } else {
                sealed = true;
            }
            break;
        }
        if (len > WAL_RECORD_HARD_MAX) {
            bad = WAL_DAMAGE_BAD_LENGTH;
            break;
        }
        if ((size_t)len > left - WAL_REC_HDR) {
            bad = WAL_DAMAGE_SHORT_PAYLOAD;
            break;
        }
        if (get_u32(h + 4) != record_crc(seq, h + WAL_REC_HDR, len)) {
            bad = WAL_DAMAGE_CRC;
            break;
        }
        if (seq != r->expect) {
            bad = WAL_DAMAGE_SEQ_GAP;
            snprintf(detail, sizeof(detail), " (expected %" PRIu64 ", found %" PRIu64 ")",
                     r->expect, seq);
            break;
        }
        if (seq > r->snap_seq) {
            if (info->first_seq == 0)
                info->first_seq = seq;
            info->last_seq = seq;
            info->records++;
            if (r->on_record != NULL) {
                rc = r->on_record(r->ctx, seq, h + WAL_REC_HDR, len);
                if (rc != 0) {
                    kvf_error_set(err, rc, "%s: the record consumer refused seq %" PRIu64 " (%s)",
                                  name, seq, strerror(-rc));
                    goto out;
                }
            }
        }
        r->last = seq;
        r->expect = seq + 1;
        off += WAL_REC_HDR + len;
    }
    *size_p = off;
    if (bad != WAL_DAMAGE_NONE && !is_last &&
        wal_is_torn_seal(m.p + off, m.size - off, r->expect)) {
        /* The seal's write failed (the store stopped there): the segment is
         * whole, and the next one must start at r->expect (checked next). */
        wal_log(w, KVF_STORE_LOG_WARN,
                "%s/%s: %zu bytes of a seal cut short at offset %zu (its write failed); the "
                "records before it are intact",
                w->dir, name, m.size - off, off);
        bad = WAL_DAMAGE_NONE;
    }
    if (bad == WAL_DAMAGE_NONE && !(sealed && is_last))
        goto out;
    const char *bad_text = wal_damage_text(bad);

    /* What is wrong here: a torn tail (cut), or corruption or a lost file? */
    size_t later_off = 0;
    uint64_t later_seq = 0;
    bool later = bad != WAL_DAMAGE_NONE &&
                 wal_find_later(m.p, m.size, off, r->expect, &later_off, &later_seq);
    bool torn = is_last && !later && wal_damage_can_be_torn(bad);
    if (!torn) {
        char what[200];
        if (sealed)
            snprintf(what, sizeof(what),
                     "ends with a seal: the log goes on in wal-%016" PRIx64
                     ".log, which is missing (records from seq %" PRIu64 " on are lost)",
                     r->expect, r->expect);
        else if (later)
            snprintf(what, sizeof(what),
                     "%s%s at offset %zu (seq %" PRIu64 " expected there; last good seq %" PRIu64
                     "), yet a valid record (seq %" PRIu64 ") follows at offset %zu",
                     bad_text, detail, off, r->expect, r->last, later_seq, later_off);
        else
            snprintf(what, sizeof(what),
                     "%s%s at offset %zu (seq %" PRIu64 " expected there; last good seq %" PRIu64
                     ") in a segment that is not the last",
                     bad_text, detail, off, r->expect, r->last);
        if (!w->opts.repair) {
            /* The full story in the store's log (the error message is short). */
            wal_log(w, KVF_STORE_LOG_ERROR,
                    "%s/%s %s: corruption, not a torn tail; refusing to start. Restore the "
                    "data dir from a backup, or run kvfence-control --data-dir %s --repair-wal "
                    "to cut the log at offset %zu (it backs up the files first)",
                    w->dir, name, what, w->dir, off);
            if (sealed)
                rc = kvf_error_set(err, -EIO,
                                   "%s: sealed at offset %zu but wal-%016" PRIx64
                                   ".log is missing (seq %" PRIu64
                                   " on); refusing to start (see the log)",
                                   name, off, r->expect, r->expect);
            else
                rc = kvf_error_set(err, -EIO,
                                   "%s: corrupt at offset %zu (seq %" PRIu64
                                   "); refusing to start (see the log; --repair-wal cuts it there)",
                                   name, off, r->expect);
            goto out;
        }
        /* --repair-wal: back up, cut here, drop every later segment. */
        rc = wal_repair_backup(w, r, r->idx, info, err);
        if (rc != 0)
            goto out;
        if (!sealed) {
            info->repair_dropped += 1 + (later ? wal_chain_count(m.p, m.size, later_off) : 0);
        } else {
            info->repair_dropped_unknown = true;
            info->repair_lost_from = r->expect;
        }
        rc = wal_repair_drop_after(w, r, r->idx, info, err);
        if (rc != 0)
            goto out;
        if (ftruncate(fd, (off_t)off) != 0 || fsync(fd) != 0) {
            rc = kvf_error_set(err, -errno, "%s/%s: cannot cut the log: %s", w->dir, name,
                               strerror(errno));
            goto out;
        }
        info->repaired = true;
        snprintf(info->repair_what, sizeof(info->repair_what), "%s %s: cut at offset %zu", name,
                 what, off);
        r->stop = true;
        goto out;
    }
    /* The torn tail of the last segment: cut at the last good record. */
    info->tail_cut = true;
    info->tail_cut_bytes = m.size - off;
    info->tail_cut_offset = off;
    info->tail_good_seq = r->last;
    snprintf(info->tail_file, sizeof(info->tail_file), "%s", name);
    snprintf(info->tail_reason, sizeof(info->tail_reason), "%s%s", bad_text, detail);
    if (ftruncate(fd, (off_t)off) != 0 || fsync(fd) != 0) {
        rc = kvf_error_set(err, -errno, "%s/%s: cannot cut the torn tail: %s", w->dir, name,
                           strerror(errno));
        goto out;
    }
    wal_log(w, KVF_STORE_LOG_WARN,
            "%s/%s: %s%s at offset %zu: cut %zu bytes of torn or corrupt tail; last good "
            "record is seq %" PRIu64,
            w->dir, name, bad_text, detail, off, m.size - off, r->last);
out:
    wal_unmap(&m);
    close(fd);
    return rc;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a;
    uint64_t y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* mkdir -p with mode 0700 for what it creates. Sets *created_p if the last
 * component was created. */
static int mkdir_p(const char *path, bool *created_p)
{
    char buf[PATH_MAX];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof(buf))
        return -ENAMETOOLONG;
    memcpy(buf, path, n + 1);
    while (n > 1 && buf[n - 1] == '/')
        buf[--n] = '\0';
    *created_p = false;
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0')
            continue;
        char c = buf[i];
        buf[i] = '\0';
        if (mkdir(buf, 0700) == 0) {
            if (i == n)
                *created_p = true;
        } else if (errno != EEXIST) {
            return -errno;
        }
        buf[i] = c;
    }
    return 0;
}

/* What the directory listing found. */
struct wal_listing {
    uint64_t *segs;
    size_t nsegs;
    size_t cap;
    uint64_t snap; /* newest snapshot seq */
    bool have_snap;
    unsigned tmp_removed;
};

static int wal_list_dir(struct wal *w, struct wal_listing *l, struct kvf_error *err)
{
    int fd = dup(w->dir_fd);
    if (fd < 0)
        return kvf_error_set(err, -errno, "%s: dup: %s", w->dir, strerror(errno));
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        int rc = kvf_error_set(err, -errno, "%s: opendir: %s", w->dir, strerror(errno));
        close(fd);
        return rc;
    }
    int rc = 0;
    struct dirent *de;
    rewinddir(d);
    while ((de = readdir(d)) != NULL) {
        const char *n = de->d_name;
        size_t len = strlen(n);
        uint64_t v;
        if (len == WAL_SEG_NAME_LEN && strncmp(n, "wal-", 4) == 0 && ends_with(n, ".log") &&
            parse_hex16(n + 4, &v)) {
            if (l->nsegs == l->cap) {
                size_t cap = l->cap ? l->cap * 2 : 16;
                uint64_t *a = realloc(l->segs, cap * sizeof(*a));
                if (a == NULL) {
                    rc = kvf_error_set(err, -ENOMEM, "%s: out of memory", w->dir);
                    break;
                }
                l->segs = a;
                l->cap = cap;
            }
            l->segs[l->nsegs++] = v;
        } else if (len == WAL_SNAP_NAME_LEN && strncmp(n, "snapshot-", 9) == 0 &&
                   ends_with(n, ".snap") && parse_hex16(n + 9, &v)) {
            if (!l->have_snap || v > l->snap)
                l->snap = v;
            l->have_snap = true;
        } else if (len == WAL_SNAP_NAME_LEN + 4 && strncmp(n, "snapshot-", 9) == 0 &&
                   ends_with(n, ".snap.tmp")) {
            /* An unfinished snapshot: it never got its final name. */
            if (unlinkat(w->dir_fd, n, 0) == 0) {
                l->tmp_removed++;
                wal_log(w, KVF_STORE_LOG_INFO, "%s/%s: removed unfinished snapshot", w->dir, n);
            }
        }
    }
    closedir(d);
    if (rc == 0 && l->nsegs > 1)
        qsort(l->segs, l->nsegs, sizeof(*l->segs), cmp_u64);
    return rc;
}

static int wal_lock_dir(struct wal *w, struct kvf_error *err)
{
    w->lock_fd = openat(w->dir_fd, "LOCK", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (w->lock_fd < 0)
        return kvf_error_set(err, -errno, "%s/LOCK: open: %s", w->dir, strerror(errno));
    if (flock(w->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        return kvf_error_set(err, e == EWOULDBLOCK ? -EBUSY : -e,
                             "%s: data dir is in use by another process (LOCK held): %s", w->dir,
                             strerror(e));
    }
    return 0;
}

static int wal_recover(struct kvf_store *s, kvf_store_snapshot_fn on_snapshot,
                       kvf_store_record_fn on_record, void *ctx, struct kvf_store_recovery *info_p,
                       struct kvf_error *err)
{
    struct wal *w = wal_of(s);
    uint64_t t0 = now_ns();
    struct kvf_store_recovery info;
    memset(&info, 0, sizeof(info));
    struct wal_listing l;
    memset(&l, 0, sizeof(l));
    int rc;

    pthread_mutex_lock(&w->mu);
    bool again = w->recovered;
    w->recovered = true;
    pthread_mutex_unlock(&w->mu);
    if (again)
        return kvf_error_set(err, -EALREADY, "%s: recover() called twice", w->dir);

    rc = mkdir_p(w->dir, &info.dir_created);
    if (rc != 0)
        return kvf_error_set(err, rc, "%s: cannot create the data dir: %s", w->dir, strerror(-rc));
    w->dir_fd = open(w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (w->dir_fd < 0)
        return kvf_error_set(err, -errno, "%s: open: %s", w->dir, strerror(errno));
    rc = wal_lock_dir(w, err);
    if (rc != 0)
        return rc;
    rc = wal_list_dir(w, &l, err);
    if (rc != 0)
        goto out_free_listing;
    info.stale_removed = l.tmp_removed;

    struct wal_replay r = {.on_record = on_record, .ctx = ctx};
    if (l.have_snap) {
        rc = wal_load_snapshot(w, l.snap, on_snapshot, ctx, &info, err);
        if (rc != 0)
            goto out_free_listing;
        r.snap_seq = l.snap;
        r.last = l.snap;
    }

    /* Segments wholly covered by the snapshot: their successor starts <= S + 1. */
    size_t start = 0;
    while (start + 1 < l.nsegs && l.segs[start + 1] <= r.snap_seq + 1) {
        char name[WAL_SEG_NAME_LEN + 1];
        seg_name(name, sizeof(name), l.segs[start]);
        if (unlinkat(w->dir_fd, name, 0) == 0)
            info.stale_removed++;
        start++;
    }
    /* The log must reach back to the first seq not in the snapshot; a
     * snapshot is always followed by a segment (its roll), so none at all
     * means a deleted one. */
    uint64_t want_max = r.snap_seq + 1;
    if ((start < l.nsegs && l.segs[start] > want_max) || (start == l.nsegs && l.have_snap)) {
        char what[200];
        if (start < l.nsegs)
            snprintf(what, sizeof(what),
                     "the log starts at seq %" PRIu64 " but seq %" PRIu64
                     " is the first one not in a snapshot: records are missing",
                     l.segs[start], want_max);
        else
            snprintf(what, sizeof(what),
                     "snapshot at seq %" PRIu64 " but no log segment (wal-%016" PRIx64
                     ".log) after it: a segment is missing and records from seq %" PRIu64
                     " on may be lost",
                     r.snap_seq, want_max, want_max);
        if (!w->opts.repair) {
            wal_log(w, KVF_STORE_LOG_ERROR,
                    "%s: %s; refusing to start (restore the file, or run kvfence-control "
                    "--repair-wal to go on without them)",
                    w->dir, what);
            rc = kvf_error_set(err, -EIO,
                               "a log segment is missing (seq %" PRIu64
                               " on); refusing to start (see the log; --repair-wal goes on "
                               "without it)",
                               want_max);
            goto out_free_listing;
        }
        struct wal_replay all = {.segs = l.segs, .nsegs = l.nsegs};
        if (start < l.nsegs) {
            rc = wal_repair_backup(w, &all, start, &info, err);
            if (rc == 0 && start > 0)
                rc = wal_repair_drop_after(w, &all, start - 1, &info, err);
            else if (rc == 0)
                for (size_t i = 0; i < l.nsegs && rc == 0; i++) {
                    char name[WAL_SEG_NAME_LEN + 1];
                    seg_name(name, sizeof(name), l.segs[i]);
                    info.repair_dropped += wal_file_records(w->dir_fd, name);
                    if (unlinkat(w->dir_fd, name, 0) != 0)
                        rc = kvf_error_set(err, -errno, "%s/%s: unlink: %s", w->dir, name,
                                           strerror(errno));
                }
            if (rc == 0 && start == 0) {
                /* The removals must be durable before the log starts anew. */
                rc = wal_sync_dir(w);
                if (rc != 0)
                    kvf_error_set(err, rc, "%s: fsync: %s", w->dir, strerror(-rc));
            }
            if (rc != 0)
                goto out_free_listing;
            l.nsegs = start;
        }
        info.repaired = true;
        snprintf(info.repair_what, sizeof(info.repair_what), "%s: going on without them", what);
    }

    bool last_kept = false;
    uint64_t last_size = 0;
    r.segs = l.segs;
    r.nsegs = l.nsegs;
    for (size_t i = start; i < l.nsegs; i++) {
        bool is_last = i + 1 == l.nsegs;
        bool keep = true;
        uint64_t size = 0;
        r.idx = i;
        rc = wal_replay_segment(w, l.segs[i], is_last, &r, &info, &keep, &size, err);
        if (rc != 0)
            goto out_free_listing;
        info.segments++;
        if (r.stop) { /* repaired: this one (if kept) is the last segment now */
            l.nsegs = keep ? i + 1 : i;
            is_last = true;
        }
        if (is_last) {
            last_kept = keep;
            last_size = size;
        }
        if (keep) {
            rc = seg_list_push(w, l.segs[i]);
            if (rc != 0) {
                kvf_error_set(err, rc, "%s: out of memory", w->dir);
                goto out_free_listing;
            }
        }
        if (r.stop)
            break;
    }
    if (info.repaired)
        wal_log(
            w, KVF_STORE_LOG_WARN, "%s: repaired: %s; dropped %s%" PRIu64 " records%s%s%s", w->dir,
            info.repair_what, info.repair_dropped_unknown ? "at least " : "", info.repair_dropped,
            info.repair_dropped_unknown ? " (a deleted file held more, how many is unknown)" : "",
            info.repair_backup[0] ? "; backup in " : "", info.repair_backup);
    if (info.stale_removed > 0)
        (void)wal_sync_dir(w);

    uint64_t next = (r.last > r.snap_seq ? r.last : r.snap_seq) + 1;
    /* No snapshot and no record: whatever files there were, no state. */
    info.new_cluster = !l.have_snap && next == 1;
    w->written_seq = next - 1;
    if (last_kept && r.expect == next) {
        /* Go on appending to the last segment. */
        char name[WAL_SEG_NAME_LEN + 1];
        seg_name(name, sizeof(name), l.segs[l.nsegs - 1]);
        w->seg_fd = openat(w->dir_fd, name, O_WRONLY | O_APPEND | O_CLOEXEC);
        if (w->seg_fd < 0) {
            rc = kvf_error_set(err, -errno, "%s/%s: open: %s", w->dir, name, strerror(errno));
            goto out_free_listing;
        }
        w->seg_start = l.segs[l.nsegs - 1];
        w->seg_size = last_size;
    } else {
        rc = wal_segment_create(w, next);
        if (rc != 0) {
            kvf_error_set(err, rc, "%s: cannot create a log segment: %s", w->dir, strerror(-rc));
            goto out_free_listing;
        }
    }

    pthread_mutex_lock(&w->mu);
    w->next_seq = next;
    w->durable_seq = next - 1;
    w->snapshot_seq = r.snap_seq;
    w->open = true;
    pthread_mutex_unlock(&w->mu);
    rc = pthread_create(&w->committer, NULL, wal_committer, w);
    if (rc != 0) {
        pthread_mutex_lock(&w->mu);
        w->open = false;
        pthread_mutex_unlock(&w->mu);
        rc = kvf_error_set(err, -rc, "%s: cannot start the committer thread", w->dir);
        goto out_free_listing;
    }
    w->thread_started = true;

    info.next_seq = next;
    info.elapsed_ns = now_ns() - t0;
    if (info.new_cluster)
        wal_log(w, KVF_STORE_LOG_INFO, "data dir %s %s: starting a new cluster", w->dir,
                info.dir_created ? "did not exist (created it)" : "holds no state");
    else
        wal_log(w, KVF_STORE_LOG_INFO,
                "data dir %s: recovered snapshot at seq %" PRIu64 " and %" PRIu64
                " records from %u segments in %.1f ms; next seq %" PRIu64 "%s",
                w->dir, info.snapshot_seq, info.records, info.segments,
                (double)info.elapsed_ns / 1e6, next,
                info.tail_cut ? " (a torn tail was cut, see above)" : "");
    if (info_p != NULL)
        *info_p = info;

out_free_listing:
    free(l.segs);
    return rc;
}

/* ---- stats, close ------------------------------------------------------ */

static void wal_stats(struct kvf_store *s, struct kvf_store_stats *st)
{
    struct wal *w = wal_of(s);
    pthread_mutex_lock(&w->mu);
    *st = w->st;
    st->next_seq = w->next_seq;
    st->durable_seq = w->durable_seq;
    st->snapshot_seq = w->snapshot_seq;
    st->segments = w->seg_n;
    st->failed = w->failed;
    pthread_mutex_unlock(&w->mu);
}

static void wal_close(struct kvf_store *s)
{
    struct wal *w = wal_of(s);
    if (w->thread_started) {
        pthread_mutex_lock(&w->mu);
        w->stopping = true;
        pthread_cond_signal(&w->work_cv);
        pthread_mutex_unlock(&w->mu);
        int rc = pthread_join(w->committer, NULL);
        if (rc != 0)
            wal_log(w, KVF_STORE_LOG_ERROR, "%s: joining the committer: %s", w->dir, strerror(rc));
    }
    if (w->seg_fd >= 0)
        close(w->seg_fd);
    if (w->lock_fd >= 0)
        close(w->lock_fd); /* releases the flock */
    if (w->dir_fd >= 0)
        close(w->dir_fd);
    pthread_mutex_destroy(&w->snap_mu);
    pthread_cond_destroy(&w->durable_cv);
    pthread_cond_destroy(&w->work_cv);
    pthread_mutex_destroy(&w->mu);
    free(w->seg_first);
    free(w->dir);
    free(w);
}

static const struct kvf_store_ops wal_ops = {
    .name = "wal",
    .recover = wal_recover,
    .append = wal_append,
    .write_snapshot = wal_write_snapshot,
    .stats = wal_stats,
    .close = wal_close,
};
