/*
 * fuzz_wal.c: the write-ahead log's recovery (controlplane/store/wal.c),
 * through its public API only (kvf_store_wal_create, kvf_store_recover): the
 * input becomes the files of a data directory, recovery replays them, and a
 * store that recovered must take one more record.
 *
 * Input: byte 0 picks the layout, the rest are file bytes.
 *   0: one segment (the last one: a torn or corrupt tail is cut);
 *   1: two segments, split at a u16 offset (the first must verify whole and
 *      chain to the second);
 *   2: a snapshot file (a u16-prefixed chunk), then one segment after it.
 * File names take their seq from the header bytes where the header has one,
 * so that well-formed inputs are named as the store names them.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_util.h"
#include "wal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void quiet(void *ctx, enum kvf_store_log_level level, const char *msg)
{
    (void)ctx;
    (void)level;
    (void)msg;
}

static int on_snapshot(void *ctx, const void *bytes, size_t len, uint64_t seq)
{
    (void)bytes;
    (void)seq;
    *(size_t *)ctx += len;
    return 0;
}

static int on_record(void *ctx, uint64_t seq, const void *bytes, size_t len)
{
    (void)seq;
    (void)bytes;
    *(size_t *)ctx += len;
    return 0;
}

static uint64_t seq_at(const uint8_t *p, size_t len, size_t off, uint64_t dflt)
{
    if (len < off + 8)
        return dflt;
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[off + (size_t)i];
    return v;
}

static void put(const char *dir, const char *kind, uint64_t seq, const char *ext, const uint8_t *p,
                size_t len)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s%016llx.%s", dir, kind, (unsigned long long)seq, ext);
    fz_write_file(path, p, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char dir[300];
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "%s/wal", fz_scratch_dir());
        (void)mkdir(dir, 0700);
    }
    fz_clear_dir(dir);
    struct fz_in in = {data, size};
    uint8_t mode = fz_u8(&in) % 3;
    if (mode == 0) {
        put(dir, "wal-", seq_at(in.p, in.left, 8, 1), "log", in.p, in.left);
    } else if (mode == 1) {
        size_t cut = fz_u16(&in);
        if (cut > in.left)
            cut = in.left;
        uint64_t s1 = seq_at(in.p, cut, 8, 1);
        uint64_t s2 = seq_at(in.p + cut, in.left - cut, 8, s1 + 1);
        put(dir, "wal-", s1, "log", in.p, cut);
        if (s2 != s1)
            put(dir, "wal-", s2, "log", in.p + cut, in.left - cut);
    } else {
        size_t snap_len = 0;
        const uint8_t *snap = fz_chunk(&in, &snap_len);
        uint64_t s = seq_at(snap, snap_len, 8, 1);
        put(dir, "snapshot-", s, "snap", snap, snap_len);
        put(dir, "wal-", seq_at(in.p, in.left, 8, s + 1), "log", in.p, in.left);
    }

    struct kvf_store_wal_opts o;
    kvf_store_wal_opts_init(&o);
    o.data_dir = dir;
    o.sync = KVF_STORE_WAL_UNSAFE_NO_SYNC;
    o.max_record_bytes = 1u << 20;
    o.log_fn = quiet;
    struct kvf_store *st = kvf_store_wal_create(&o);
    if (!st)
        abort();
    size_t seen = 0;
    struct kvf_error err;
    kvf_error_clear(&err);
    int rc = kvf_store_recover(st, on_snapshot, on_record, &seen, NULL, &err);
    if (rc == 0) {
        static const uint8_t rec[] = "after recovery";
        uint64_t seq = 0;
        if (kvf_store_append(st, rec, sizeof rec, NULL, NULL, &seq) != 0)
            abort(); /* a recovered store takes records */
    }
    kvf_store_destroy(st);
    return 0;
}
