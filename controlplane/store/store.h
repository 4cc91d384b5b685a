/*
 * store.h: the durable store of the control plane (docs/design.md §2.9 "Nothing lost
 * on restart").
 *
 * The service turns every state change into one record (protobuf-c bytes; the
 * store never looks inside) and appends it. A record gets a sequence number
 * (seq) at append time; seqs start at 1 and strictly increase in append order.
 * The append's completion callback fires once the record is durable, and only
 * then does the RPC that made the change answer. From time to time the service
 * writes a snapshot: opaque bytes that stand for every record with seq <= S.
 * On start, recover() hands back the newest snapshot and then every later
 * record in seq order, and the service rebuilds rooms, leases, tokens and
 * pending notices from them.
 *
 * Implementations sit behind struct kvf_store_ops (STYLE.md rule 8); every slot
 * is set. The embedded one is the write-ahead log in a data directory
 * (wal.h, kvf_store_wal_create). An etcd implementation for HA is planned and
 * the interface is shaped for it:
 *   - append    = a put of key <prefix>/log/<seq, 16 hex> inside a txn guarded
 *                 by the leader's election key (If mod_revision(<prefix>/leader)
 *                 == our revision), so a deposed leader cannot write. Appends
 *                 queued while one txn is in flight go into the next txn: group
 *                 commit is one Raft round for many changes. The txn response
 *                 fires the callbacks in seq order. seq stays the store's own
 *                 counter (continuing from recovery); the txn's etcd revision
 *                 is kept only for fencing and compaction.
 *   - snapshot  = puts of <prefix>/snap/<S>/<chunk> (etcd caps a request at
 *                 1.5 MiB) and a pointer key <prefix>/snap, then a delete-range
 *                 of the log keys <= S and an etcd compaction at that revision.
 *                 That is this interface's "truncation".
 *   - recover   = range get of <prefix>/snap then of <prefix>/log/ from S + 1;
 *                 a missing prefix means a new cluster.
 * Nothing in the interface talks about files, fsync or segments; those are in
 * the WAL's options and stats.
 *
 * DESIGN (for every implementation): recover() is called once, before any
 * append, from the thread that owns the service state; its callbacks run on
 * that thread. After it returns 0, append() may be called from any thread;
 * records are ordered by the moment append() takes them (the seq it writes to
 * *seq_p). Completion callbacks run on the store's own thread (the WAL's
 * committer), one at a time, in seq order; a callback may call append() but
 * must not call write_snapshot() or close(), and should be short (it delays
 * every later acknowledgement). write_snapshot() blocks its caller; it may
 * run concurrently with appends. close() (kvf_store_destroy) must not race
 * with other calls on the handle; it first makes every accepted record durable
 * and fires its callback, then frees.
 *
 * Errors: 0 or a negative errno (common/kvf_error.h). -EIO: the medium failed
 * or data on it is corrupt (the message says which file and where); -EBADMSG:
 * a snapshot or log header that does not verify; -EAGAIN: not recovered yet or
 * closing; -E2BIG: a record over the size limit.
 */
#ifndef KVF_STORE_H
#define KVF_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

struct kvf_store;
struct kvf_store_sink;

/* Pass as the seq of kvf_store_write_snapshot(): "every record appended so far". */
#define KVF_STORE_SEQ_LAST UINT64_MAX

/* Buckets of the fsync (commit) latency histogram: bucket i counts commits that
 * took < 2^(i+4) µs (i.e. < 16 µs, < 32 µs, ... ), the last bucket the rest. */
#define KVF_STORE_LAT_BUCKETS 18

/* Longest file name reported in struct kvf_store_recovery. */
#define KVF_STORE_NAME_MAX 64

/*
 * Called by recover() once with the newest snapshot (if there is one) before
 * any record. `bytes` is valid during the call only. Return 0, or a negative
 * errno to stop recovery (recover() then returns it).
 */
typedef int (*kvf_store_snapshot_fn)(void *ctx, const void *bytes, size_t len, uint64_t seq);

/* Called by recover() for every record after the snapshot, in seq order. Same
 * rules as kvf_store_snapshot_fn. */
typedef int (*kvf_store_record_fn)(void *ctx, uint64_t seq, const void *bytes, size_t len);

/*
 * Completion of one append: `status` is 0 once the record is durable, or a
 * negative errno (-ENOSPC, -EIO, ...: why the store failed) if the store
 * failed before it was; then it is not
 * known whether the record survives a restart, and the store refuses every
 * later append (the service should stop and restart to recover). Runs on the
 * store's thread (see DESIGN above).
 */
typedef void (*kvf_store_done_fn)(void *ctx, uint64_t seq, int status);

/*
 * Produces the snapshot covering every record with seq <= `seq`, by calling
 * kvf_store_sink_write() as often as it likes. Runs on the caller of
 * kvf_store_write_snapshot(). Return 0, or a negative errno to abandon the
 * snapshot (nothing is changed on disk).
 */
typedef int (*kvf_store_produce_fn)(void *ctx, uint64_t seq, struct kvf_store_sink *sink);

/* A place to write snapshot bytes; implementations embed it. */
struct kvf_store_sink {
    int (*write)(struct kvf_store_sink *sink, const void *bytes, size_t len);
};

/* What recover() found. Written only when recover() returns 0. */
struct kvf_store_recovery {
    bool new_cluster;         /* nothing was stored: a new cluster */
    bool dir_created;         /* the data directory did not exist and was created */
    uint64_t snapshot_seq;    /* seq covered by the loaded snapshot, 0 if none */
    uint64_t snapshot_bytes;  /* its body length */
    uint64_t records;         /* records handed to on_record */
    uint64_t first_seq;       /* seq of the first of them (0 if none) */
    uint64_t last_seq;        /* seq of the last of them (0 if none) */
    uint64_t next_seq;        /* the seq the next append gets */
    uint32_t segments;        /* log segments read */
    uint32_t stale_removed;   /* temp files, and segments wholly covered by the snapshot, removed */
    bool tail_cut;            /* a torn or corrupt tail was cut off the last segment */
    uint64_t tail_cut_bytes;  /* how many bytes were cut */
    uint64_t tail_good_seq;   /* seq of the last good record before the cut (0 if none) */
    uint64_t tail_cut_offset; /* file offset where the cut was made */
    char tail_file[KVF_STORE_NAME_MAX]; /* file name of that segment */
    char tail_reason[96];               /* what was wrong there ("CRC mismatch", ...) */
    uint64_t elapsed_ns;                /* time recover() took */
    /* Only with the WAL's repair option (wal.h): */
    bool repaired;           /* damage was found and the log cut there */
    uint64_t repair_dropped; /* records in what was cut or deleted */
    /* A file that held records was already gone (a deleted last segment):
     * repair_dropped counts what was seen, and more were lost (from seq
     * repair_lost_from on; how many, nothing on disk says). */
    bool repair_dropped_unknown;
    uint64_t repair_lost_from;
    char repair_backup[KVF_STORE_NAME_MAX]; /* sub-directory of the data dir with the copies */
    char repair_what[320];                  /* what was wrong and what was done */
};

/* Counters, readable at any time from any thread. */
struct kvf_store_stats {
    uint64_t records;       /* records made durable */
    uint64_t bytes;         /* bytes written to the log (headers included) */
    uint64_t commits;       /* group commits (write + sync of one batch) */
    uint64_t fsyncs;        /* syncs that made records durable (a commit that fills a segment
                               takes two); 0 in an unsafe no-sync mode */
    uint64_t max_batch;     /* most records in one group commit */
    uint64_t last_fsync_ns; /* latency of the last commit's final sync */
    uint64_t fsync_lat_us[KVF_STORE_LAT_BUCKETS]; /* that latency, one count per commit */
    uint64_t queued;                              /* records appended but not yet durable */
    uint64_t next_seq;                            /* seq the next append gets */
    uint64_t durable_seq;                         /* every seq <= this is durable */
    uint64_t snapshot_seq;                        /* seq of the newest snapshot, 0 if none */
    uint64_t snapshots;                           /* snapshots written since open */
    uint64_t segments;                            /* live log segments */
    uint64_t segments_removed;                    /* segments deleted by truncation since open */
    int failed; /* 0, or the sticky negative errno that stopped appends */
};

/* The operations of one implementation. No slot is NULL. */
struct kvf_store_ops {
    const char *name; /* "wal", "etcd" */
    int (*recover)(struct kvf_store *store, kvf_store_snapshot_fn on_snapshot,
                   kvf_store_record_fn on_record, void *ctx, struct kvf_store_recovery *info_p,
                   struct kvf_error *err);
    int (*append)(struct kvf_store *store, const void *bytes, size_t len, kvf_store_done_fn done,
                  void *done_ctx, uint64_t *seq_p);
    int (*write_snapshot)(struct kvf_store *store, uint64_t seq, kvf_store_produce_fn produce,
                          void *ctx, uint64_t *seq_p, struct kvf_error *err);
    void (*stats)(struct kvf_store *store, struct kvf_store_stats *stats);
    void (*close)(struct kvf_store *store);
};

/* The base of every implementation's handle (embedded first; recovered with
 * container_of). Callers treat it as opaque and use the functions below. */
struct kvf_store {
    const struct kvf_store_ops *ops;
};

/*
 * Opens the store and replays it: `on_snapshot` with the newest snapshot, then
 * `on_record` for each later record, in order (either callback may be NULL to
 * skip). An empty or missing store is a new cluster (info says so and the
 * store is created). A torn tail of the log (damage at the end of the last
 * segment that no valid record follows) is cut at the last good record and
 * reported in `info_p` (and in the store's log). A corrupt snapshot, damage
 * that valid records follow, a seq gap or a missing segment fails with
 * -EBADMSG or -EIO and a message naming the file, offset and seq: state is
 * never dropped silently. -EBUSY if another
 * process holds the store, -EALREADY if called twice. Once only, before any
 * append; on failure the handle can only be destroyed. `info_p` may be NULL.
 */
int kvf_store_recover(struct kvf_store *store, kvf_store_snapshot_fn on_snapshot,
                      kvf_store_record_fn on_record, void *ctx, struct kvf_store_recovery *info_p,
                      struct kvf_error *err);

/*
 * Appends one record (copied; `bytes` may be reused at once). On 0, `*seq_p`
 * (may be NULL) holds its seq and `done` (may be NULL) will be called exactly
 * once, on the store's thread, when the record is durable or the store has
 * failed. On error `done` is never called: -EAGAIN before recover() or while
 * closing, -E2BIG over the record limit, -ENOMEM, or the sticky error of a
 * failed store. Any thread.
 */
int kvf_store_append(struct kvf_store *store, const void *bytes, size_t len, kvf_store_done_fn done,
                     void *done_ctx, uint64_t *seq_p);

/*
 * Writes a snapshot covering every record with seq <= `seq` (KVF_STORE_SEQ_LAST:
 * every record appended so far), produced by `produce`, then truncates the log
 * up to it. The caller vouches that what `produce` writes is the state after
 * exactly those records, typically by calling from the one thread that changes
 * the state and appends. Waits until those records are durable first, so a
 * snapshot never runs ahead of the log. `*seq_p` (may be NULL) gets the seq
 * covered. -EINVAL if `seq` was never appended or is older than the newest
 * snapshot. Blocks; not from a completion callback.
 */
int kvf_store_write_snapshot(struct kvf_store *store, uint64_t seq, kvf_store_produce_fn produce,
                             void *ctx, uint64_t *seq_p, struct kvf_error *err);

/* Writes bytes of a snapshot; only from inside a kvf_store_produce_fn. */
int kvf_store_sink_write(struct kvf_store_sink *sink, const void *bytes, size_t len);

/* Copies the counters. Any thread. */
void kvf_store_stats(struct kvf_store *store, struct kvf_store_stats *stats);

/* Implementation name ("wal"). */
const char *kvf_store_name(const struct kvf_store *store);

/* Makes every accepted append durable and fires its callback, stops the
 * store's thread and frees the handle. Accepts NULL. Not from a callback. */
void kvf_store_destroy(struct kvf_store *store);

#endif /* KVF_STORE_H */
