/*
 * test_wal_crash.c: kill -9 while appending, then recover (part of test_wal).
 *
 * A child process opens the store, appends records as fast as it can (the
 * payload of each is derived from its seq, wal_test_payload) and takes a
 * snapshot every SNAP_EVERY records. Each durable callback writes the record's
 * seq into a pipe: that is the acknowledgement an RPC would have answered.
 * The parent reads the pipe, kills the child with SIGKILL after a random short
 * delay, and recovers the directory: every acknowledged seq must be there
 * (in the snapshot or as a record with the right payload), the records must
 * be contiguous after the snapshot, and none may be half present. The same
 * directory goes through every round, so each round also recovers after the
 * previous round's cut tail.
 *
 * SIGKILL does not lose the page cache, so this proves the ordering of
 * acknowledgements and the handling of torn tails within the process's
 * writes, not the disk's own sync guarantees.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "store.h"
#include "wal.h"
#include "wal_test_util.h"

#define ROUNDS       20
#define SNAP_EVERY   3000
#define MAX_INFLIGHT 4096

struct child {
    int pipe_fd;
    uint64_t acked; /* atomically updated by the committer thread */
};

static void child_done(void *ctx, uint64_t seq, int status)
{
    struct child *c = ctx;
    if (status != 0)
        _exit(4);
    ssize_t n;
    do {
        n = write(c->pipe_fd, &seq, sizeof(seq));
    } while (n < 0 && errno == EINTR);
    __atomic_add_fetch(&c->acked, 1, __ATOMIC_RELEASE);
}

static int child_produce(void *ctx, uint64_t seq, struct kvf_store_sink *sink)
{
    (void)ctx;
    unsigned char buf[WAL_TEST_SNAP_MAX];
    size_t len = wal_test_snapshot(seq, buf);
    return kvf_store_sink_write(sink, buf, len);
}

static void quiet_log(void *ctx, enum kvf_store_log_level level, const char *msg)
{
    (void)ctx;
    (void)level;
    (void)msg;
}

static struct kvf_store *crash_store(const char *dir)
{
    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    o.segment_bytes = 256 * 1024; /* several segments between snapshots */
    o.log_fn = quiet_log;
    return kvf_store_wal_create(&o);
}

static void __attribute__((noreturn)) child_main(const char *dir, int pipe_fd)
{
    struct child c = {.pipe_fd = pipe_fd};
    struct kvf_store *s = crash_store(dir);
    struct kvf_store_recovery info;
    struct kvf_error err = {0};
    if (s == NULL || kvf_store_recover(s, NULL, NULL, NULL, &info, &err) != 0)
        _exit(2);
    unsigned char buf[WAL_TEST_PAYLOAD_MAX];
    uint64_t sent = 0;
    for (uint64_t seq = info.next_seq;; seq++) {
        while (sent - __atomic_load_n(&c.acked, __ATOMIC_ACQUIRE) > MAX_INFLIGHT)
            sched_yield();
        size_t len = wal_test_payload(seq, buf);
        uint64_t got = 0;
        if (kvf_store_append(s, buf, len, child_done, &c, &got) != 0 || got != seq)
            _exit(3);
        sent++;
        if (seq % SNAP_EVERY == 0 &&
            kvf_store_write_snapshot(s, KVF_STORE_SEQ_LAST, child_produce, NULL, NULL, &err) != 0)
            _exit(5);
    }
}

/* What the parent's recovery saw. */
struct check {
    uint64_t snap_seq;
    uint64_t first;
    uint64_t last;
    uint64_t n;
    int bad;
    char why[128];
};

static int check_snapshot(void *ctx, const void *bytes, size_t len, uint64_t seq)
{
    struct check *k = ctx;
    k->snap_seq = seq;
    if (!wal_test_snapshot_ok(seq, bytes, len)) {
        k->bad++;
        snprintf(k->why, sizeof(k->why), "snapshot %" PRIu64 " has the wrong bytes", seq);
    }
    return 0;
}

static int check_record(void *ctx, uint64_t seq, const void *bytes, size_t len)
{
    struct check *k = ctx;
    uint64_t want = k->n == 0 ? k->snap_seq + 1 : k->last + 1;
    if (seq != want || !wal_test_payload_ok(seq, bytes, len)) {
        if (k->bad++ == 0)
            snprintf(k->why, sizeof(k->why),
                     "record seq %" PRIu64 " (expected %" PRIu64 "), len %zu: wrong", seq, want,
                     len);
    }
    if (k->n == 0)
        k->first = seq;
    k->last = seq;
    k->n++;
    return 0;
}

static uint64_t rng_next(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

void test_wal_crash_kill9(void **state)
{
    (void)state;
    char *dir = wal_test_mkdtemp();
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 16);
    print_message("crash test: seed %" PRIu64 ", dir %s\n", seed, dir);
    uint64_t rng = seed;
    uint64_t max_acked_ever = 0;
    int cuts = 0;
    for (int round = 0; round < ROUNDS; round++) {
        int fds[2];
        assert_int_equal(pipe(fds), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(fds[0]);
            child_main(dir, fds[1]);
        }
        close(fds[1]);

        /* Read acknowledgements until the kill time, then kill, then drain. */
        unsigned delay_ms = 5 + (unsigned)(rng_next(&rng) % 120);
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        uint64_t max_acked = 0;
        uint64_t acks = 0;
        bool killed = false;
        for (;;) {
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            long elapsed = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
            if (!killed && elapsed >= (long)delay_ms) {
                kill(pid, SIGKILL);
                killed = true;
            }
            struct pollfd p = {.fd = fds[0], .events = POLLIN};
            int wait_ms = killed ? 1000 : (int)((long)delay_ms - elapsed);
            int pr = poll(&p, 1, wait_ms < 0 ? 0 : wait_ms);
            if (pr < 0 && errno == EINTR)
                continue;
            assert_true(pr >= 0);
            if (pr == 0)
                continue;
            uint64_t seqs[512];
            ssize_t n = read(fds[0], seqs, sizeof(seqs));
            if (n == 0)
                break; /* child gone: EOF */
            if (n < 0 && errno == EINTR)
                continue;
            assert_true(n > 0);
            for (size_t i = 0; i < (size_t)n / 8; i++) {
                if (seqs[i] > max_acked)
                    max_acked = seqs[i];
                acks++;
            }
            /* A seq is 8 bytes written at once to a pipe: never split. */
            assert_int_equal(n % 8, 0);
        }
        close(fds[0]);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGKILL)
            fail_msg("round %d: child ended on its own (status 0x%x)", round, status);

        struct kvf_store *s = crash_store(dir);
        assert_non_null(s);
        struct check k = {0};
        struct kvf_store_recovery info;
        struct kvf_error err = {0};
        int rc = kvf_store_recover(s, check_snapshot, check_record, &k, &info, &err);
        if (rc != 0)
            fail_msg("round %d: recover failed: %d %s", round, rc, err.msg);
        if (k.bad != 0)
            fail_msg("round %d: %d bad records: %s", round, k.bad, k.why);
        uint64_t have = k.n > 0 ? k.last : k.snap_seq;
        if (max_acked > have)
            fail_msg("round %d: seq %" PRIu64 " was acknowledged but recovery ends at %" PRIu64,
                     round, max_acked, have);
        if (max_acked_ever > have)
            fail_msg("round %d: an earlier round acknowledged %" PRIu64 ", now %" PRIu64, round,
                     max_acked_ever, have);
        if (k.n > 0 && k.first != k.snap_seq + 1)
            fail_msg("round %d: records start at %" PRIu64 " after snapshot %" PRIu64, round,
                     k.first, k.snap_seq);
        assert_int_equal(info.next_seq, have + 1);
        if (max_acked > max_acked_ever)
            max_acked_ever = max_acked;
        cuts += info.tail_cut;
        print_message("round %2d: kill after %3u ms, %6" PRIu64 " acks, recovered snapshot %" PRIu64
                      " + %" PRIu64 " records up to %" PRIu64 "%s\n",
                      round, delay_ms, acks, k.snap_seq, k.n, have,
                      info.tail_cut ? " (torn tail cut)" : "");
        kvf_store_destroy(s); /* joins the committer before the next fork */
    }
    print_message("crash test: %d of %d rounds cut a torn tail; %" PRIu64 " records acked\n", cuts,
                  ROUNDS, max_acked_ever);
    assert_true(max_acked_ever > 0);
    wal_test_rmtree(dir);
}
