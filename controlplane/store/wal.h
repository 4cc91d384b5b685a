/*
 * wal.h: the embedded store: an append-only write-ahead log with snapshots in
 * one data directory (the default store of kvfence-control; store.h has the
 * interface and its threading rules, wal.c the file formats).
 *
 * The directory holds
 *   wal-<first seq, 16 hex>.log        log segments, rolled at segment_bytes
 *   snapshot-<seq, 16 hex>.snap        the newest snapshot (older ones deleted)
 *   LOCK                               flock()ed while a process has it open
 * and nothing else of ours (temp files *.tmp are removed on recovery).
 */
#ifndef KVF_STORE_WAL_H
#define KVF_STORE_WAL_H

#include <stdint.h>

#include "store.h"

enum kvf_store_wal_sync {
    KVF_STORE_WAL_FDATASYNC = 0, /* default: fdatasync() after each group commit */
    KVF_STORE_WAL_FSYNC = 1,     /* fsync(): also flushes metadata that reads do not need */
    /* No sync at all: a crash of the machine loses acknowledged records.
     * For benchmarks that isolate the write path only; never in production. */
    KVF_STORE_WAL_UNSAFE_NO_SYNC = 2,
};

/* Severity of a message of the store. */
enum kvf_store_log_level {
    KVF_STORE_LOG_INFO = 0,
    KVF_STORE_LOG_WARN = 1,
    KVF_STORE_LOG_ERROR = 2,
};

typedef void (*kvf_store_log_fn)(void *ctx, enum kvf_store_log_level level, const char *msg);

struct kvf_store_wal_opts {
    const char *data_dir;         /* required; created (mode 0700, parents too) if absent */
    uint64_t segment_bytes;       /* roll to a new segment past this size (64 MiB) */
    uint32_t max_record_bytes;    /* largest record accepted (16 MiB) */
    enum kvf_store_wal_sync sync; /* KVF_STORE_WAL_FDATASYNC */
    /* Where the store says what it did ("new cluster", "cut torn tail").
     * NULL: kvf_log lines prefixed "kvfence store: ". Called on the thread
     * that caused the message (recover()'s caller or the committer). */
    kvf_store_log_fn log_fn;
    void *log_ctx;
    /* Operator repair (kvfence-control --repair-wal): where recovery would
     * refuse to start (damage that valid records follow, a seq gap, a missing
     * segment), copy the files it changes to repair-<UTC time>/ in data_dir,
     * cut the log at the damage, delete later segments, and report it in
     * struct kvf_store_recovery (repaired, repair_dropped, ...). */
    bool repair;
};

/* Fills `opts` with the defaults above (data_dir NULL). */
void kvf_store_wal_opts_init(struct kvf_store_wal_opts *opts);

/*
 * Creates a WAL store for opts->data_dir (copied). Touches no file yet:
 * kvf_store_recover() opens, locks and replays the directory and starts the
 * committer thread. Returns NULL (and logs why) on bad options or out of
 * memory. Free with kvf_store_destroy().
 */
struct kvf_store *kvf_store_wal_create(const struct kvf_store_wal_opts *opts);

#endif /* KVF_STORE_WAL_H */
