/*
 * test_wal.c: the embedded write-ahead log store (controlplane/store) on real
 * files, each test in its own mkdtemp directory under /tmp that it removes.
 *
 * Covered: CRC-32C vectors; appends from several threads replayed in seq order;
 * group commit (fewer syncs than records); snapshots and log truncation; torn
 * tails at many cut points and corrupt tails (cut and reported, later appends
 * continue the seq); corruption in a middle segment, a missing segment and a
 * corrupt snapshot (refused with a message naming the file); new-cluster
 * detection; the data dir lock; API misuse. The crash test (a child process
 * killed with SIGKILL while appending) is in test_wal_crash.c.
 *
 * The store has a real committer thread; these tests use real threads on
 * purpose (its job is to batch concurrent appenders), and check only outcomes
 * that hold under any interleaving.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "crc32c.h"
#include "store.h"
#include "wal.h"
#include "wal_test_util.h"

/* ---- a replay collector -------------------------------------------------- */

struct rec {
    uint64_t seq;
    size_t len;
    unsigned char *bytes;
};

struct collect {
    struct rec *recs;
    size_t n;
    size_t cap;
    unsigned char *snap;
    size_t snap_len;
    uint64_t snap_seq;
    int snap_calls;
};

static int collect_snapshot(void *ctx, const void *bytes, size_t len, uint64_t seq)
{
    struct collect *c = ctx;
    c->snap = malloc(len ? len : 1);
    assert_non_null(c->snap);
    memcpy(c->snap, bytes, len);
    c->snap_len = len;
    c->snap_seq = seq;
    c->snap_calls++;
    return 0;
}

static int collect_record(void *ctx, uint64_t seq, const void *bytes, size_t len)
{
    struct collect *c = ctx;
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 256;
        c->recs = realloc(c->recs, c->cap * sizeof(*c->recs));
        assert_non_null(c->recs);
    }
    struct rec *r = &c->recs[c->n++];
    r->seq = seq;
    r->len = len;
    r->bytes = malloc(len ? len : 1);
    assert_non_null(r->bytes);
    memcpy(r->bytes, bytes, len);
    return 0;
}

static void collect_free(struct collect *c)
{
    for (size_t i = 0; i < c->n; i++)
        free(c->recs[i].bytes);
    free(c->recs);
    free(c->snap);
    memset(c, 0, sizeof(*c));
}

/* ---- opening ------------------------------------------------------------- */

struct logcap {
    int warnings;
    char last[512];
};

static void capture_log(void *ctx, enum kvf_store_log_level level, const char *msg)
{
    struct logcap *l = ctx;
    if (level != KVF_STORE_LOG_INFO)
        l->warnings++;
    snprintf(l->last, sizeof(l->last), "%s", msg);
}

static struct logcap g_quiet; /* sink for messages the tests do not read */

static struct kvf_store *create_store(const char *dir, uint64_t segment_bytes, struct logcap *log)
{
    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    if (segment_bytes != 0)
        o.segment_bytes = segment_bytes;
    o.log_fn = capture_log;
    o.log_ctx = log != NULL ? log : &g_quiet;
    struct kvf_store *s = kvf_store_wal_create(&o);
    assert_non_null(s);
    return s;
}

/* Creates and recovers; asserts success. */
static struct kvf_store *open_store(const char *dir, uint64_t segment_bytes, struct collect *c,
                                    struct kvf_store_recovery *info)
{
    struct kvf_store *s = create_store(dir, segment_bytes, NULL);
    struct kvf_error err = {0};
    int rc = kvf_store_recover(s, collect_snapshot, collect_record, c, info, &err);
    if (rc != 0)
        fail_msg("recover of %s failed: %d %s", dir, rc, err.msg);
    return s;
}

/* ---- appends ------------------------------------------------------------- */

/* Waits for one append's callback. */
struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t done;
    int status;
    uint64_t last_seq;
};

static void waiter_init(struct waiter *w)
{
    memset(w, 0, sizeof(*w));
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
}

static void waiter_destroy(struct waiter *w)
{
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
}

static void waiter_done(void *ctx, uint64_t seq, int status)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->done++;
    if (status != 0)
        w->status = status;
    w->last_seq = seq;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void waiter_wait(struct waiter *w, uint64_t n)
{
    pthread_mutex_lock(&w->mu);
    while (w->done < n)
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

/* Appends the test payload of `seq` and waits until durable. */
static void append_sync(struct kvf_store *s, uint64_t want_seq)
{
    unsigned char buf[WAL_TEST_PAYLOAD_MAX];
    size_t len = wal_test_payload(want_seq, buf);
    struct waiter w;
    waiter_init(&w);
    uint64_t seq = 0;
    assert_int_equal(kvf_store_append(s, buf, len, waiter_done, &w, &seq), 0);
    assert_int_equal(seq, want_seq);
    waiter_wait(&w, 1);
    assert_int_equal(w.status, 0);
    waiter_destroy(&w);
}

/* Appends payloads for seqs first..last (async) and waits for them. */
static void append_range(struct kvf_store *s, uint64_t first, uint64_t last)
{
    struct waiter w;
    waiter_init(&w);
    unsigned char buf[WAL_TEST_PAYLOAD_MAX];
    for (uint64_t q = first; q <= last; q++) {
        size_t len = wal_test_payload(q, buf);
        uint64_t seq = 0;
        assert_int_equal(kvf_store_append(s, buf, len, waiter_done, &w, &seq), 0);
        assert_int_equal(seq, q);
    }
    waiter_wait(&w, last - first + 1);
    assert_int_equal(w.status, 0);
    waiter_destroy(&w);
}

/* Checks that `c` holds exactly seqs first..last with their test payloads. */
static void check_range(const struct collect *c, uint64_t first, uint64_t last)
{
    assert_int_equal(c->n, last >= first ? last - first + 1 : 0);
    for (size_t i = 0; i < c->n; i++) {
        assert_int_equal(c->recs[i].seq, first + i);
        assert_true(wal_test_payload_ok(c->recs[i].seq, c->recs[i].bytes, c->recs[i].len));
    }
}

/* ---- CRC ----------------------------------------------------------------- */

static void test_crc32c_vectors(void **state)
{
    (void)state;
    assert_int_equal(kvf_crc32c(0, "123456789", 9), 0xE3069283u);
    assert_int_equal(kvf_crc32c(0, "", 0), 0);
    unsigned char zeros[32] = {0};
    assert_int_equal(kvf_crc32c(0, zeros, 32), 0x8A9136AAu); /* RFC 3720 B.4 */
    unsigned char ones[32];
    memset(ones, 0xff, sizeof(ones));
    assert_int_equal(kvf_crc32c(0, ones, 32), 0x62A8AB43u);
    /* Split anywhere: same result (the unaligned head and tail paths). */
    unsigned char buf[1000];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (unsigned char)(i * 131 + 7);
    uint32_t whole = kvf_crc32c(0, buf, sizeof(buf));
    for (size_t cut = 0; cut < 40; cut++)
        assert_int_equal(kvf_crc32c(kvf_crc32c(0, buf, cut), buf + cut, sizeof(buf) - cut), whole);
    assert_int_equal(kvf_crc32c(0, buf + 3, 997),
                     kvf_crc32c(kvf_crc32c(0, buf + 3, 500), buf + 503, 497));
}

/* ---- threads ------------------------------------------------------------- */

#define T4_THREADS 4
#define T4_PER     500

struct t4_arg {
    struct kvf_store *s;
    uint32_t id;
    struct waiter w;
    uint64_t seqs[T4_PER];
};

/* Payload of thread `id`'s record `i`: identifies itself and checks itself. */
static size_t t4_payload(uint32_t id, uint32_t i, unsigned char *buf)
{
    size_t len = 8 + (id * 37 + i * 11) % 200;
    memcpy(buf, &id, 4);
    memcpy(buf + 4, &i, 4);
    for (size_t k = 8; k < len; k++)
        buf[k] = (unsigned char)(id * 7 + i * 3 + k);
    return len;
}

static void *t4_run(void *arg)
{
    struct t4_arg *a = arg;
    unsigned char buf[256];
    for (uint32_t i = 0; i < T4_PER; i++) {
        size_t len = t4_payload(a->id, i, buf);
        assert_int_equal(kvf_store_append(a->s, buf, len, waiter_done, &a->w, &a->seqs[i]), 0);
    }
    return NULL;
}

static void test_append_threads_recover(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct kvf_store *s = open_store(dir, 0, &c, &info);
    assert_true(info.new_cluster);
    assert_int_equal(info.next_seq, 1);

    struct t4_arg args[T4_THREADS];
    pthread_t th[T4_THREADS];
    for (uint32_t t = 0; t < T4_THREADS; t++) {
        args[t].s = s;
        args[t].id = t;
        waiter_init(&args[t].w);
        assert_int_equal(pthread_create(&th[t], NULL, t4_run, &args[t]), 0);
    }
    for (int t = 0; t < T4_THREADS; t++)
        pthread_join(th[t], NULL);
    kvf_store_destroy(s); /* flushes: every callback has fired when it returns */
    for (int t = 0; t < T4_THREADS; t++) {
        assert_int_equal(args[t].w.done, T4_PER);
        assert_int_equal(args[t].w.status, 0);
        for (int i = 1; i < T4_PER; i++)
            assert_true(args[t].seqs[i] > args[t].seqs[i - 1]);
    }

    s = open_store(dir, 0, &c, &info);
    assert_false(info.new_cluster);
    assert_false(info.tail_cut);
    assert_int_equal(c.n, T4_THREADS * T4_PER);
    assert_int_equal(info.records, T4_THREADS * T4_PER);
    assert_int_equal(info.next_seq, T4_THREADS * T4_PER + 1);
    uint32_t next_i[T4_THREADS] = {0};
    for (size_t k = 0; k < c.n; k++) {
        assert_int_equal(c.recs[k].seq, k + 1);
        uint32_t id;
        uint32_t i;
        assert_true(c.recs[k].len >= 8);
        memcpy(&id, c.recs[k].bytes, 4);
        memcpy(&i, c.recs[k].bytes + 4, 4);
        assert_true(id < T4_THREADS);
        assert_int_equal(i, next_i[id]); /* each thread's records in its order */
        assert_int_equal(c.recs[k].seq, args[id].seqs[i]);
        next_i[id]++;
        unsigned char want[256];
        size_t len = t4_payload(id, i, want);
        assert_int_equal(c.recs[k].len, len);
        assert_memory_equal(c.recs[k].bytes, want, len);
    }
    uint64_t seq = 0;
    assert_int_equal(kvf_store_append(s, "x", 1, NULL, NULL, &seq), 0);
    assert_int_equal(seq, T4_THREADS * T4_PER + 1);
    kvf_store_destroy(s);
    for (int t = 0; t < T4_THREADS; t++)
        waiter_destroy(&args[t].w);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* ---- group commit ---------------------------------------------------------- */

#define GC_THREADS 8
#define GC_PER     150

struct gc_arg {
    struct kvf_store *s;
};

static void *gc_run(void *arg)
{
    struct gc_arg *a = arg;
    unsigned char buf[200];
    memset(buf, 0xab, sizeof(buf));
    for (int i = 0; i < GC_PER; i++) {
        /* Like an RPC handler: append, then wait until it is durable. */
        struct waiter w;
        waiter_init(&w);
        assert_int_equal(kvf_store_append(a->s, buf, sizeof(buf), waiter_done, &w, NULL), 0);
        waiter_wait(&w, 1);
        assert_int_equal(w.status, 0);
        waiter_destroy(&w);
    }
    return NULL;
}

static void test_group_commit(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store *s = open_store(dir, 0, &c, NULL);
    struct gc_arg a = {.s = s};
    pthread_t th[GC_THREADS];
    for (int t = 0; t < GC_THREADS; t++)
        assert_int_equal(pthread_create(&th[t], NULL, gc_run, &a), 0);
    for (int t = 0; t < GC_THREADS; t++)
        pthread_join(th[t], NULL);
    struct kvf_store_stats st;
    kvf_store_stats(s, &st);
    print_message("group commit: %" PRIu64 " records, %" PRIu64 " fsyncs, max batch %" PRIu64
                  ", last fsync %" PRIu64 " us\n",
                  st.records, st.fsyncs, st.max_batch, st.last_fsync_ns / 1000);
    assert_int_equal(st.records, GC_THREADS * GC_PER);
    assert_int_equal(st.bytes, GC_THREADS * GC_PER * (16 + 200));
    assert_true(st.fsyncs < st.records);
    assert_true(st.max_batch > 1);
    assert_int_equal(st.fsyncs, st.commits);
    uint64_t hist = 0;
    for (int i = 0; i < KVF_STORE_LAT_BUCKETS; i++)
        hist += st.fsync_lat_us[i];
    assert_int_equal(hist, st.commits);
    assert_int_equal(st.queued, 0);
    assert_int_equal(st.durable_seq, GC_THREADS * GC_PER);
    assert_int_equal(st.next_seq, GC_THREADS * GC_PER + 1);
    assert_int_equal(st.failed, 0);
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* ---- snapshots and truncation -------------------------------------------- */

static int produce_test_snapshot(void *ctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)ctx;
    unsigned char buf[WAL_TEST_SNAP_MAX];
    size_t len = wal_test_snapshot(seq, buf);
    /* In pieces, to exercise the sink's buffering. */
    size_t half = len / 3;
    assert_int_equal(kvf_store_sink_write(sink, buf, half), 0);
    assert_int_equal(kvf_store_sink_write(sink, buf + half, 0), 0);
    return kvf_store_sink_write(sink, buf + half, len - half);
}

static int produce_fail(void *ctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)ctx;
    (void)seq;
    assert_int_equal(kvf_store_sink_write(sink, "partial", 7), 0);
    return -ECANCELED;
}

static void test_snapshot_truncation(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct kvf_store *s = open_store(dir, 4096, &c, &info);
    append_range(s, 1, 300);
    assert_true(wal_test_count_files(dir, "wal-") > 5);

    struct kvf_error err = {0};
    uint64_t snap_seq = 0;
    /* Out of range, failing producer: nothing changes. */
    assert_int_equal(kvf_store_write_snapshot(s, 301, produce_test_snapshot, NULL, NULL, &err),
                     -EINVAL);
    assert_int_equal(kvf_store_write_snapshot(s, 0, produce_test_snapshot, NULL, NULL, &err),
                     -EINVAL);
    assert_int_equal(
        kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, produce_fail, NULL, NULL, &err),
        -ECANCELED);
    assert_int_equal(wal_test_count_files(dir, "snapshot-"), 0);

    int segs_before = wal_test_count_files(dir, "wal-");
    assert_int_equal(kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, produce_test_snapshot, NULL,
                                              &snap_seq, &err),
                     0);
    assert_int_equal(snap_seq, 300);
    assert_int_equal(wal_test_count_files(dir, "snapshot-"), 1);
    assert_true(wal_test_file_exists(dir, "snapshot-000000000000012c.snap"));
    /* Every segment before is covered: only the new one is left. */
    assert_int_equal(wal_test_count_files(dir, "wal-"), 1);
    assert_true(wal_test_file_exists(dir, "wal-000000000000012d.log"));
    struct kvf_store_stats st;
    kvf_store_stats(s, &st);
    assert_int_equal(st.snapshot_seq, 300);
    assert_int_equal(st.snapshots, 1);
    assert_int_equal(st.segments, 1);
    assert_int_equal(st.segments_removed, (uint64_t)segs_before);
    /* Older than the newest snapshot: refused. */
    append_range(s, 301, 350);
    assert_int_equal(kvf_store_write_snapshot(s, 299, produce_test_snapshot, NULL, NULL, &err),
                     -EINVAL);
    kvf_store_destroy(s);

    s = open_store(dir, 4096, &c, &info);
    assert_false(info.new_cluster);
    assert_int_equal(c.snap_calls, 1);
    assert_int_equal(c.snap_seq, 300);
    assert_int_equal(info.snapshot_seq, 300);
    assert_true(wal_test_snapshot_ok(300, c.snap, c.snap_len));
    check_range(&c, 301, 350);
    assert_int_equal(info.next_seq, 351);
    collect_free(&c);

    /* A snapshot in the middle of the log (explicit seq) keeps the records after it. */
    append_range(s, 351, 500);
    assert_int_equal(kvf_store_write_snapshot(s, 420, produce_test_snapshot, NULL, &snap_seq, &err),
                     0);
    assert_int_equal(snap_seq, 420);
    assert_int_equal(wal_test_count_files(dir, "snapshot-"), 1); /* the older one is gone */
    append_range(s, 501, 510);
    kvf_store_destroy(s);
    s = open_store(dir, 4096, &c, &info);
    assert_int_equal(c.snap_seq, 420);
    assert_true(wal_test_snapshot_ok(420, c.snap, c.snap_len));
    check_range(&c, 421, 510);
    kvf_store_destroy(s);
    collect_free(&c);

    /* A leftover temp snapshot is ignored and removed. */
    wal_test_write_file(dir, "snapshot-0000000000000fff.snap.tmp", "junk", 4);
    s = open_store(dir, 4096, &c, &info);
    assert_int_equal(c.snap_seq, 420);
    assert_true(info.stale_removed >= 1);
    assert_false(wal_test_file_exists(dir, "snapshot-0000000000000fff.snap.tmp"));
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* ---- torn and corrupt tails ---------------------------------------------- */

/* Fresh dir with records 1..n in one segment; returns the dir. */
static char *make_log(uint64_t n, uint64_t segment_bytes)
{
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store *s = open_store(dir, segment_bytes, &c, NULL);
    append_range(s, 1, n);
    kvf_store_destroy(s);
    collect_free(&c);
    return dir;
}

/* Recovers a damaged log that must be cut after `good` records; checks the
 * report, appends the next seq and checks that a later recovery is clean. */
static void recover_cut(const char *dir, uint64_t good, uint64_t cut_bytes, const char *reason)
{
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct logcap log = {0};
    struct kvf_store *s = create_store(dir, 0, &log);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, collect_snapshot, collect_record, &c, &info, &err), 0);
    assert_true(info.tail_cut);
    assert_int_equal(info.tail_good_seq, good);
    if (cut_bytes != UINT64_MAX)
        assert_int_equal(info.tail_cut_bytes, cut_bytes);
    assert_string_equal(info.tail_file, "wal-0000000000000001.log");
    if (reason != NULL && strstr(info.tail_reason, reason) == NULL)
        fail_msg("reason \"%s\" lacks \"%s\"", info.tail_reason, reason);
    assert_true(log.warnings >= 1); /* said so in the log */
    check_range(&c, 1, good);
    assert_int_equal(info.next_seq, good + 1);
    collect_free(&c);
    append_sync(s, good + 1);
    kvf_store_destroy(s);

    s = open_store(dir, 0, &c, &info);
    assert_false(info.tail_cut);
    check_range(&c, 1, good + 1);
    kvf_store_destroy(s);
    collect_free(&c);
}

static void test_torn_tail_cut_points(void **state)
{
    (void)state;
    const uint64_t n = 10;
    char *ref = make_log(n, 0);
    off_t offs[12];
    size_t nrec = wal_test_record_offsets(ref, "wal-0000000000000001.log", offs, 12);
    assert_int_equal(nrec, n);
    off_t end = wal_test_file_size(ref, "wal-0000000000000001.log");
    wal_test_rmtree(ref);

    off_t last = offs[n - 1];
    /* Inside the last record's header (several points), and inside its payload. */
    off_t cuts[] = {last + 1, last + 4, last + 8, last + 15, last + 16, last + 17, end - 1};
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
        char *dir = make_log(n, 0);
        wal_test_truncate(dir, "wal-0000000000000001.log", cuts[i]);
        recover_cut(dir, n - 1, (uint64_t)(cuts[i] - last),
                    cuts[i] - last < 16 ? "short record header" : "short payload");
        wal_test_rmtree(dir);
    }
    /* Torn in the middle: everything after the cut is lost (it was never acked). */
    {
        char *dir = make_log(n, 0);
        wal_test_truncate(dir, "wal-0000000000000001.log", offs[4] + 20);
        recover_cut(dir, 4, 20, "short payload");
        wal_test_rmtree(dir);
    }
    /* Zeros after the last record (size grew, data did not reach the disk). */
    {
        char *dir = make_log(n, 0);
        wal_test_append_zeros(dir, "wal-0000000000000001.log", 100);
        recover_cut(dir, n, 100, "CRC mismatch");
        wal_test_rmtree(dir);
    }
    /* A cut exactly at a record boundary is not damage at all. */
    {
        char *dir = make_log(n, 0);
        wal_test_truncate(dir, "wal-0000000000000001.log", last);
        struct collect c = {0};
        struct kvf_store_recovery info;
        struct kvf_store *s = open_store(dir, 0, &c, &info);
        assert_false(info.tail_cut);
        check_range(&c, 1, n - 1);
        append_sync(s, n);
        kvf_store_destroy(s);
        collect_free(&c);
        wal_test_rmtree(dir);
    }
}

static void test_torn_new_segment_header(void **state)
{
    (void)state;
    char *dir = make_log(10, 0);
    /* A crash while the next segment was being created: a partial header. */
    wal_test_write_file(dir, "wal-000000000000000b.log", "KVFW\1\0", 6);
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct kvf_store *s = open_store(dir, 0, &c, &info);
    assert_true(info.tail_cut);
    assert_int_equal(info.tail_good_seq, 10);
    assert_int_equal(info.tail_cut_bytes, 6);
    assert_string_equal(info.tail_file, "wal-000000000000000b.log");
    check_range(&c, 1, 10);
    append_sync(s, 11);
    kvf_store_destroy(s);
    collect_free(&c);
    s = open_store(dir, 0, &c, &info);
    assert_false(info.tail_cut);
    check_range(&c, 1, 11);
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

static void test_corrupt_tail_crc(void **state)
{
    (void)state;
    const uint64_t n = 10;
    char *dir = make_log(n, 0);
    off_t offs[12];
    assert_int_equal(wal_test_record_offsets(dir, "wal-0000000000000001.log", offs, 12), n);
    off_t end = wal_test_file_size(dir, "wal-0000000000000001.log");
    /* A flipped payload byte of the last record. */
    wal_test_flip_byte(dir, "wal-0000000000000001.log", end - 3);
    recover_cut(dir, n - 1, (uint64_t)(end - offs[n - 1]), "CRC mismatch");
    wal_test_rmtree(dir);

    /* A flipped seq byte of the last record: also caught by the CRC. */
    dir = make_log(n, 0);
    wal_test_flip_byte(dir, "wal-0000000000000001.log", offs[n - 1] + 9);
    recover_cut(dir, n - 1, (uint64_t)(end - offs[n - 1]), "CRC mismatch");
    wal_test_rmtree(dir);
}

static void test_corrupt_middle_segment(void **state)
{
    (void)state;
    char *dir = make_log(200, 4096);
    int nseg = wal_test_count_files(dir, "wal-");
    assert_true(nseg >= 3);
    off_t offs[64];
    size_t nrec = wal_test_record_offsets(dir, "wal-0000000000000001.log", offs, 64);
    assert_true(nrec > 5);
    wal_test_flip_byte(dir, "wal-0000000000000001.log", offs[3] + 20);
    off_t size = wal_test_file_size(dir, "wal-0000000000000001.log");

    struct collect c = {0};
    struct kvf_store_recovery info;
    memset(&info, 0x5a, sizeof(info));
    struct kvf_store *s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    int rc = kvf_store_recover(s, collect_snapshot, collect_record, &c, &info, &err);
    assert_int_equal(rc, -EIO);
    assert_int_equal(err.code, -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "wal-0000000000000001.log"));
    assert_non_null(strstr(err.msg, "corrupt at offset"));
    assert_int_equal(info.next_seq, 0x5a5a5a5a5a5a5a5aull); /* info untouched on failure */
    assert_int_equal(kvf_store_append(s, "x", 1, NULL, NULL, NULL), -EAGAIN);
    kvf_store_destroy(s);
    /* Nothing was cut or deleted. */
    assert_int_equal(wal_test_file_size(dir, "wal-0000000000000001.log"), size);
    assert_int_equal(wal_test_count_files(dir, "wal-"), nseg);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* Recovers `dir` with the repair option; asserts success and returns the report. */
static struct kvf_store_recovery recover_repair(const char *dir, struct collect *c)
{
    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    o.segment_bytes = 4096;
    o.log_fn = capture_log;
    o.log_ctx = &g_quiet;
    o.repair = true;
    struct kvf_store *s = kvf_store_wal_create(&o);
    assert_non_null(s);
    struct kvf_store_recovery info;
    struct kvf_error err = {0};
    int rc = kvf_store_recover(s, collect_snapshot, collect_record, c, &info, &err);
    if (rc != 0)
        fail_msg("repair of %s failed: %d %s", dir, rc, err.msg);
    kvf_store_destroy(s);
    return info;
}

/* Issue 14: a flipped byte in a record of the LAST segment that good records
 * follow is corruption, not a torn tail: refused, nothing cut; the repair
 * backs the segment up, cuts there and counts what it dropped. */
static void test_corrupt_mid_last_segment(void **state)
{
    (void)state;
    const uint64_t n = 40;
    char *dir = make_log(n, 0);
    const char *seg = "wal-0000000000000001.log";
    off_t offs[48];
    assert_int_equal(wal_test_record_offsets(dir, seg, offs, 48), n);
    wal_test_flip_byte(dir, seg, offs[20] + 20); /* payload of seq 21 */
    off_t size = wal_test_file_size(dir, seg);

    struct collect c = {0};
    struct kvf_store *s = create_store(dir, 0, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    char want[96];
    snprintf(want, sizeof(want), "%s: corrupt at offset %lld (seq 21)", seg, (long long)offs[20]);
    assert_non_null(strstr(err.msg, want));
    kvf_store_destroy(s);
    collect_free(&c);
    assert_int_equal(wal_test_file_size(dir, seg), size); /* nothing cut */

    struct kvf_store_recovery info = recover_repair(dir, &c);
    assert_true(info.repaired);
    assert_int_equal(info.repair_dropped, n - 20);
    assert_int_equal(info.next_seq, 21);
    assert_int_equal(c.n, 20);
    char backup[160];
    snprintf(backup, sizeof(backup), "%s/%s", info.repair_backup, seg);
    assert_true(wal_test_file_exists(dir, backup));
    assert_int_equal(wal_test_file_size(dir, backup), size);
    assert_int_equal(wal_test_file_size(dir, seg), offs[20]);
    collect_free(&c);

    /* Clean afterwards, and appends go on at 21. */
    s = open_store(dir, 0, &c, &info);
    assert_false(info.tail_cut);
    assert_int_equal(info.next_seq, 21);
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* A tail of zeros (a file extended but never written) is still a torn tail. */
static void test_zero_tail_is_torn(void **state)
{
    (void)state;
    char *dir = make_log(10, 0);
    wal_test_append_zeros(dir, "wal-0000000000000001.log", 300);
    recover_cut(dir, 10, 300, "CRC mismatch");
    wal_test_rmtree(dir);
}

/* Issue 14: the last segment deleted: its predecessor ends in a seal that
 * names it, so recovery refuses; the repair removes the seal and goes on. */
static void test_missing_last_segment(void **state)
{
    (void)state;
    char *dir = make_log(200, 4096);
    char names[16][64];
    int nseg = wal_test_list_files(dir, "wal-", names, 16);
    assert_true(nseg >= 3);
    wal_test_unlink(dir, names[nseg - 1]);
    struct collect c = {0};
    struct kvf_store *s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, names[nseg - 2]));
    kvf_store_destroy(s);
    collect_free(&c);

    struct kvf_store_recovery info = recover_repair(dir, &c);
    assert_true(info.repaired);
    assert_int_equal(info.repair_dropped, 0); /* none seen: the file is gone */
    assert_true(info.repair_dropped_unknown); /* so the count says "at least" */
    assert_true(info.repair_lost_from > 0);
    uint64_t next = info.next_seq;
    collect_free(&c);
    s = open_store(dir, 4096, &c, &info);
    assert_int_equal(info.next_seq, next);
    append_range(s, next, next + 5);
    kvf_store_destroy(s);
    collect_free(&c);
    s = open_store(dir, 4096, &c, &info);
    assert_int_equal(info.next_seq, next + 6);
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* Issue 14: a seal whose write failed leaves part of it (or nothing) after the
 * last record of a segment that has a successor; the store stopped there, so
 * every record is intact and the log must start, with every record. Bytes
 * that are not the seal's own stay corruption. */
static void test_torn_seal_is_not_corruption(void **state)
{
    (void)state;
    for (off_t cut = 1; cut < 16; cut += 7) {
        char *dir = make_log(200, 4096);
        char names[16][64];
        int nseg = wal_test_list_files(dir, "wal-", names, 16);
        assert_true(nseg >= 3);
        off_t size = wal_test_file_size(dir, names[0]);
        wal_test_truncate(dir, names[0], size - cut); /* 16 - cut bytes of the seal left */
        struct collect c = {0};
        struct kvf_store_recovery info;
        struct kvf_store *s = open_store(dir, 4096, &c, &info);
        check_range(&c, 1, 200);
        assert_false(info.tail_cut);
        append_sync(s, 201);
        kvf_store_destroy(s);
        collect_free(&c);
        s = open_store(dir, 4096, &c, &info);
        check_range(&c, 1, 201);
        kvf_store_destroy(s);
        collect_free(&c);
        wal_test_rmtree(dir);
    }
    /* The same cut seal with a flipped byte in its length: refused. */
    char *dir = make_log(200, 4096);
    char names[16][64];
    assert_true(wal_test_list_files(dir, "wal-", names, 16) >= 3);
    off_t size = wal_test_file_size(dir, names[0]);
    wal_test_truncate(dir, names[0], size - 8);
    wal_test_flip_byte(dir, names[0], size - 16 + 1);
    struct collect c = {0};
    struct kvf_store *s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, names[0]));
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* Issue 14: a sealed last segment with bytes after its seal is no torn tail
 * (nothing is written after a seal): refused, the seal is not cut away. */
static void test_bytes_after_seal_of_last_segment(void **state)
{
    (void)state;
    char *dir = make_log(200, 4096);
    char names[16][64];
    int nseg = wal_test_list_files(dir, "wal-", names, 16);
    assert_true(nseg >= 3);
    wal_test_unlink(dir, names[nseg - 1]);
    off_t size = wal_test_file_size(dir, names[nseg - 2]);
    wal_test_append_zeros(dir, names[nseg - 2], 5);
    struct collect c = {0};
    struct kvf_store *s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, names[nseg - 2]));
    assert_int_equal(wal_test_file_size(dir, names[nseg - 2]), size + 5); /* nothing cut */
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* Issue 14: a snapshot with every segment after it deleted is refused. */
static void test_snapshot_without_segment(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store *s = open_store(dir, 4096, &c, NULL);
    append_range(s, 1, 30);
    struct kvf_error serr = {0};
    assert_int_equal(
        kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, produce_test_snapshot, NULL, NULL, &serr),
        0);
    append_range(s, 31, 40);
    kvf_store_destroy(s);
    collect_free(&c);
    char names[16][64];
    int nseg = wal_test_list_files(dir, "wal-", names, 16);
    for (int i = 0; i < nseg; i++)
        wal_test_unlink(dir, names[i]);
    s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "missing (seq 31 on)"));
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

static void test_missing_segment(void **state)
{
    (void)state;
    char *dir = make_log(200, 4096);
    char names[16][64];
    int nseg = wal_test_list_files(dir, "wal-", names, 16);
    assert_true(nseg >= 3);
    wal_test_unlink(dir, names[1]);
    struct collect c = {0};
    struct kvf_store *s = create_store(dir, 4096, NULL);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, names[2]));
    assert_non_null(strstr(err.msg, "missing"));
    kvf_store_destroy(s);
    collect_free(&c);

    /* The first segment missing (no snapshot to cover it) is refused too. */
    wal_test_unlink(dir, names[0]);
    s = create_store(dir, 4096, NULL);
    assert_int_equal(kvf_store_recover(s, NULL, collect_record, &c, NULL, &err), -EIO);
    assert_non_null(strstr(err.msg, "missing"));
    kvf_store_destroy(s);
    collect_free(&c);
    wal_test_rmtree(dir);
}

/* ---- corrupt snapshot ----------------------------------------------------- */

static char *make_snapshotted(uint64_t *snap_seq_p)
{
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store *s = open_store(dir, 0, &c, NULL);
    append_range(s, 1, 40);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, produce_test_snapshot, NULL,
                                              snap_seq_p, &err),
                     0);
    append_range(s, 41, 45);
    kvf_store_destroy(s);
    collect_free(&c);
    return dir;
}

static void expect_snapshot_refused(const char *dir, const char *what)
{
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct logcap log = {0};
    struct kvf_store *s = create_store(dir, 0, &log);
    struct kvf_error err = {0};
    int rc = kvf_store_recover(s, collect_snapshot, collect_record, &c, &info, &err);
    assert_int_equal(rc, -EBADMSG);
    print_message("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "snapshot-0000000000000028.snap"));
    assert_non_null(strstr(err.msg, what));
    assert_non_null(strstr(err.msg, "refusing to start"));
    assert_true(log.warnings >= 1);
    assert_int_equal(c.snap_calls, 0);
    assert_int_equal(c.n, 0); /* no partial state handed out */
    kvf_store_destroy(s);
    collect_free(&c);
}

static void test_corrupt_snapshot(void **state)
{
    (void)state;
    uint64_t seq = 0;
    const char *snap = "snapshot-0000000000000028.snap";
    /* A flipped body byte. */
    char *dir = make_snapshotted(&seq);
    assert_int_equal(seq, 40);
    off_t size = wal_test_file_size(dir, snap);
    wal_test_flip_byte(dir, snap, size - 10);
    expect_snapshot_refused(dir, "body CRC mismatch");
    expect_snapshot_refused(dir, "body CRC mismatch"); /* again: nothing was dropped */
    assert_int_equal(wal_test_file_size(dir, snap), size);
    assert_true(wal_test_count_files(dir, "wal-") >= 1);
    wal_test_rmtree(dir);

    /* A flipped header byte, a truncated file, an emptied file. */
    dir = make_snapshotted(&seq);
    wal_test_flip_byte(dir, snap, 12);
    expect_snapshot_refused(dir, "header CRC mismatch");
    wal_test_rmtree(dir);
    dir = make_snapshotted(&seq);
    wal_test_truncate(dir, snap, size - 1);
    expect_snapshot_refused(dir, "length mismatch");
    wal_test_truncate(dir, snap, 0);
    expect_snapshot_refused(dir, "shorter than its header");
    wal_test_rmtree(dir);

    /* An older snapshot is not used in place of a corrupt newer one. */
    dir = make_snapshotted(&seq);
    wal_test_copy_file(dir, snap, "snapshot-0000000000000010.snap");
    wal_test_flip_byte(dir, snap, size - 10);
    expect_snapshot_refused(dir, "body CRC mismatch");
    wal_test_rmtree(dir);
}

/* ---- new cluster, lock, misuse ------------------------------------------- */

static void test_new_cluster(void **state)
{
    (void)state;
    char *base = wal_test_mkdtemp();
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/a/b/data", base);
    struct collect c = {0};
    struct kvf_store_recovery info;
    struct logcap log = {0};
    struct kvf_store *s = create_store(dir, 0, &log);
    struct kvf_error err = {0};
    assert_int_equal(kvf_store_recover(s, collect_snapshot, collect_record, &c, &info, &err), 0);
    assert_true(info.new_cluster);
    assert_true(info.dir_created);
    assert_non_null(strstr(log.last, "new cluster"));
    struct stat sb;
    assert_int_equal(stat(dir, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0700);
    kvf_store_destroy(s);

    /* Existing but empty: new cluster, not created. */
    s = open_store(dir, 0, &c, &info);
    assert_true(info.new_cluster);
    assert_false(info.dir_created);
    append_sync(s, 1);
    kvf_store_destroy(s);
    s = open_store(dir, 0, &c, &info);
    assert_false(info.new_cluster);
    check_range(&c, 1, 1);
    kvf_store_destroy(s);
    collect_free(&c);

    /* An empty directory made by someone else. */
    char empty[512];
    snprintf(empty, sizeof(empty), "%s/empty", base);
    assert_int_equal(mkdir(empty, 0755), 0);
    s = open_store(empty, 0, &c, &info);
    assert_true(info.new_cluster);
    assert_false(info.dir_created);
    kvf_store_destroy(s);
    wal_test_rmtree(base);
}

static void test_lock_and_misuse(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_error err = {0};

    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    assert_null(kvf_store_wal_create(&o)); /* no data dir */
    o.data_dir = dir;
    o.segment_bytes = 10;
    assert_null(kvf_store_wal_create(&o));
    assert_null(kvf_store_wal_create(NULL));

    struct kvf_store *s = create_store(dir, 0, NULL);
    assert_string_equal(kvf_store_name(s), "wal");
    assert_int_equal(kvf_store_append(s, "x", 1, NULL, NULL, NULL), -EAGAIN); /* not recovered */
    assert_int_equal(kvf_store_recover(s, NULL, NULL, NULL, NULL, &err), 0);
    assert_int_equal(kvf_store_recover(s, NULL, NULL, NULL, NULL, &err), -EALREADY);
    assert_int_equal(kvf_store_append(s, NULL, 1, NULL, NULL, NULL), -EINVAL);
    uint64_t seq = 0;
    assert_int_equal(kvf_store_append(s, NULL, 0, NULL, NULL, &seq), 0); /* empty record */
    assert_int_equal(seq, 1);
    void *big = calloc(1, (16u << 20) + 1);
    assert_non_null(big);
    assert_int_equal(kvf_store_append(s, big, (16u << 20) + 1, NULL, NULL, NULL), -E2BIG);
    free(big);

    /* A second process (or handle) on the same dir is refused. */
    struct kvf_store *s2 = create_store(dir, 0, NULL);
    assert_int_equal(kvf_store_recover(s2, NULL, NULL, NULL, NULL, &err), -EBUSY);
    assert_non_null(strstr(err.msg, "in use"));
    kvf_store_destroy(s2);
    kvf_store_destroy(s);

    s = open_store(dir, 0, &c, NULL);
    assert_int_equal(c.n, 1);
    assert_int_equal(c.recs[0].len, 0);
    kvf_store_destroy(s);
    collect_free(&c);
    kvf_store_destroy(NULL);
    wal_test_rmtree(dir);
}

/* Callbacks may append (they run on the committer thread, with no lock held). */
struct chain {
    struct kvf_store *s;
    struct waiter w;
    int left;
};

static void chain_done(void *ctx, uint64_t seq, int status)
{
    struct chain *ch = ctx;
    assert_int_equal(status, 0);
    if (ch->left-- > 0)
        assert_int_equal(kvf_store_append(ch->s, &seq, sizeof(seq), chain_done, ch, NULL), 0);
    waiter_done(&ch->w, seq, status);
}

static void test_append_from_callback_and_close_flushes(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    struct collect c = {0};
    struct kvf_store *s = open_store(dir, 0, &c, NULL);
    struct chain ch = {.s = s, .left = 20};
    waiter_init(&ch.w);
    uint64_t zero = 0;
    assert_int_equal(kvf_store_append(s, &zero, sizeof(zero), chain_done, &ch, NULL), 0);
    waiter_wait(&ch.w, 21);
    /* Many appends still queued at close: all made durable, all called back. */
    struct waiter w;
    waiter_init(&w);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(kvf_store_append(s, &i, sizeof(i), waiter_done, &w, NULL), 0);
    kvf_store_destroy(s);
    assert_int_equal(w.done, 1000);
    assert_int_equal(w.status, 0);
    s = open_store(dir, 0, &c, NULL);
    assert_int_equal(c.n, 1021);
    for (size_t i = 1; i < 21; i++) {
        uint64_t prev;
        memcpy(&prev, c.recs[i].bytes, sizeof(prev));
        assert_int_equal(prev, i); /* each chained record names the seq before it */
    }
    kvf_store_destroy(s);
    waiter_destroy(&w);
    waiter_destroy(&ch.w);
    collect_free(&c);
    wal_test_rmtree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c_vectors),
        cmocka_unit_test(test_append_threads_recover),
        cmocka_unit_test(test_group_commit),
        cmocka_unit_test(test_snapshot_truncation),
        cmocka_unit_test(test_torn_tail_cut_points),
        cmocka_unit_test(test_torn_new_segment_header),
        cmocka_unit_test(test_corrupt_tail_crc),
        cmocka_unit_test(test_corrupt_middle_segment),
        cmocka_unit_test(test_missing_segment),
        cmocka_unit_test(test_corrupt_mid_last_segment),
        cmocka_unit_test(test_zero_tail_is_torn),
        cmocka_unit_test(test_missing_last_segment),
        cmocka_unit_test(test_torn_seal_is_not_corruption),
        cmocka_unit_test(test_bytes_after_seal_of_last_segment),
        cmocka_unit_test(test_snapshot_without_segment),
        cmocka_unit_test(test_corrupt_snapshot),
        cmocka_unit_test(test_new_cluster),
        cmocka_unit_test(test_lock_and_misuse),
        cmocka_unit_test(test_append_from_callback_and_close_flushes),
        cmocka_unit_test(test_wal_crash_kill9),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
