/*
 * store.c: the generic entry points of the durable store (store.h). Each one
 * checks its arguments and calls the implementation's ops table; the rules
 * that every implementation shares (argument checks, NULL handles) live here
 * once so that wal.c and a later etcd store do not repeat them.
 *
 * DESIGN: no state of its own; the calling-thread rules are those of store.h.
 */
#include "store.h"

#include <errno.h>
#include <stddef.h>

int kvf_store_recover(struct kvf_store *store, kvf_store_snapshot_fn on_snapshot,
                      kvf_store_record_fn on_record, void *ctx, struct kvf_store_recovery *info_p,
                      struct kvf_error *err)
{
    if (store == NULL)
        return kvf_error_set(err, -EINVAL, "store: recover of a NULL store");
    return store->ops->recover(store, on_snapshot, on_record, ctx, info_p, err);
}

int kvf_store_append(struct kvf_store *store, const void *bytes, size_t len, kvf_store_done_fn done,
                     void *done_ctx, uint64_t *seq_p)
{
    if (store == NULL || (bytes == NULL && len > 0))
        return -EINVAL;
    return store->ops->append(store, bytes, len, done, done_ctx, seq_p);
}

int kvf_store_write_snapshot(struct kvf_store *store, uint64_t seq, kvf_store_produce_fn produce,
                             void *ctx, uint64_t *seq_p, struct kvf_error *err)
{
    if (store == NULL || produce == NULL)
        return kvf_error_set(err, -EINVAL, "store: snapshot needs a store and a producer");
    return store->ops->write_snapshot(store, seq, produce, ctx, seq_p, err);
}

int kvf_store_sink_write(struct kvf_store_sink *sink, const void *bytes, size_t len)
{
    if (sink == NULL || (bytes == NULL && len > 0))
        return -EINVAL;
    if (len == 0)
        return 0;
    return sink->write(sink, bytes, len);
}

void kvf_store_stats(struct kvf_store *store, struct kvf_store_stats *stats)
{
    if (store == NULL || stats == NULL)
        return;
    store->ops->stats(store, stats);
}

const char *kvf_store_name(const struct kvf_store *store)
{
    return store == NULL ? "(null)" : store->ops->name;
}

void kvf_store_destroy(struct kvf_store *store)
{
    if (store != NULL)
        store->ops->close(store);
}
