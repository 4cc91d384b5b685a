/*
 * metrics.h: kvfence's Prometheus metrics registry (kvf_metrics_*).
 *
 * A registry holds metric families -- counters, gauges and histograms -- each
 * with a fixed list of label names given at registration. A family hands out
 * one child per distinct list of label values (kvf_metric_child); the child is
 * the handle the hot path updates with kvf_counter_add(), kvf_gauge_set() or
 * kvf_histogram_observe(). Those updates are lock-free (C11 atomics) and may
 * come from any thread; looking up or creating a child takes the registry's
 * mutex, so callers look children up once and keep the handle.
 *
 * Collectors are callbacks run at scrape time that write samples computed from
 * their owner's state (rooms by state, leases outstanding) through a writer.
 *
 * kvf_metrics_render() produces the Prometheus text exposition format 0.0.4;
 * http.h serves it.
 *
 * Lifetimes: families and children live as long as the registry; every handle
 * becomes invalid at kvf_metrics_destroy(). Strings passed in (names, help,
 * label names and values) are copied.
 */
#ifndef KVF_METRICS_H
#define KVF_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_error.h"

/* Default cap on the children of one family (label cardinality). */
#define KVF_METRICS_DEFAULT_MAX_CHILDREN 1024u
/* Most label names one family may have. */
#define KVF_METRICS_MAX_LABELS 16u
/* Most bucket bounds one histogram may have (+Inf is added to them). */
#define KVF_METRICS_MAX_BUCKETS 64u

struct kvf_metrics;        /* a registry */
struct kvf_metric_vec;     /* a family: name, help, type, label names */
struct kvf_metric;         /* a child: one list of label values, the hot-path handle */
struct kvf_metrics_writer; /* what a collector writes through */

struct kvf_metrics_opts {
    /* Children one family may have; kvf_metric_child() answers -E2BIG past it.
     * 0 = KVF_METRICS_DEFAULT_MAX_CHILDREN. */
    size_t max_children;
};

/* Fills `opts` with defaults. */
void kvf_metrics_opts_init(struct kvf_metrics_opts *opts);

/* Creates an empty registry; `opts` may be NULL for defaults. Returns NULL and
 * logs why on out of memory. Any thread; the caller destroys it. */
struct kvf_metrics *kvf_metrics_create(const struct kvf_metrics_opts *opts);

/* Frees the registry, its families, children and collectors. Accepts NULL.
 * No other thread may be using it (stop the HTTP server first). */
void kvf_metrics_destroy(struct kvf_metrics *reg);

/*
 * Registration. `name` must match [a-zA-Z_:][a-zA-Z0-9_:]*; `help` is any
 * text (NULL or "" = no # HELP line). `label_names` is a NULL-terminated
 * array, or NULL for none; each must match [a-zA-Z_][a-zA-Z0-9_]*, must not
 * begin with "__", must not repeat, and a histogram may not use "le". At most
 * KVF_METRICS_MAX_LABELS.
 *
 * Each returns 0 and writes `*vec_p`, or -EINVAL (bad name, label name or
 * bounds), -EEXIST (a family of that name is registered) or -ENOMEM; `*vec_p`
 * is written only on success. Any thread.
 */
int kvf_metrics_counter_vec(struct kvf_metrics *reg, const char *name, const char *help,
                            const char *const *label_names, struct kvf_metric_vec **vec_p);
int kvf_metrics_gauge_vec(struct kvf_metrics *reg, const char *name, const char *help,
                          const char *const *label_names, struct kvf_metric_vec **vec_p);
/* `bounds` are the upper bounds of the buckets (inclusive, "le"), finite and
 * strictly increasing, at most KVF_METRICS_MAX_BUCKETS of them; a +Inf bucket
 * is always added. `n_bounds` may be 0 (only +Inf). */
int kvf_metrics_histogram_vec(struct kvf_metrics *reg, const char *name, const char *help,
                              const char *const *label_names, const double *bounds, size_t n_bounds,
                              struct kvf_metric_vec **vec_p);

/* Shorthands for a family without labels: register it and return its only
 * child. Same errors as the _vec forms. */
int kvf_metrics_counter(struct kvf_metrics *reg, const char *name, const char *help,
                        struct kvf_metric **metric_p);
int kvf_metrics_gauge(struct kvf_metrics *reg, const char *name, const char *help,
                      struct kvf_metric **metric_p);
int kvf_metrics_histogram(struct kvf_metrics *reg, const char *name, const char *help,
                          const double *bounds, size_t n_bounds, struct kvf_metric **metric_p);

/* Finds or creates the child of `vec` for `label_values`: one value per label
 * name, in the same order (the array's length is the family's label count; for
 * a family without labels pass NULL). Values may be any UTF-8 text, "" too.
 * The same values always give the same handle. Returns 0 and writes
 * `*metric_p`, or -EINVAL (NULL vec, a NULL value, invalid UTF-8), -E2BIG (the
 * family has opts.max_children children) or -ENOMEM. Takes the registry mutex:
 * look children up once, off the hot path. Any thread. */
int kvf_metric_child(struct kvf_metric_vec *vec, const char *const *label_values,
                     struct kvf_metric **metric_p);

/*
 * Hot path: lock-free, any thread. A NULL handle is a no-op (so optional
 * metrics need no branches), and so is a handle of another type.
 */
/* Adds `n` to a counter (counters only go up). */
void kvf_counter_add(struct kvf_metric *m, uint64_t n);
/* Adds 1 to a counter. */
void kvf_counter_inc(struct kvf_metric *m);
/* Sets a gauge. */
void kvf_gauge_set(struct kvf_metric *m, double v);
/* Adds `delta` (may be negative) to a gauge. */
void kvf_gauge_add(struct kvf_metric *m, double delta);
/* Counts `v` in the first bucket whose bound is >= v (else +Inf) and adds it
 * to the sum. NaN is ignored. */
void kvf_histogram_observe(struct kvf_metric *m, double v);

/* Current values (for tests and introspection): 0 for NULL or another type. */
uint64_t kvf_counter_value(const struct kvf_metric *m);
double kvf_gauge_value(const struct kvf_metric *m);

/*
 * Collectors. A collector runs on the thread that calls kvf_metrics_render()
 * (the HTTP server's thread), after the registered families, and writes its
 * samples with kvf_metrics_write_gauge/_counter. It must read only state that
 * is safe to read from that thread (values its owner publishes with atomics,
 * or a snapshot it keeps under its own lock). It may look up children and
 * update metrics of the registry, but must not add or remove collectors or
 * render. Collectors run one at a time, in the order they were added.
 */
typedef void (*kvf_metrics_collect_fn)(void *ctx, struct kvf_metrics_writer *w);

/* Adds a collector called with `ctx` at every render. Returns 0, -EINVAL (NULL
 * fn) or -ENOMEM. Any thread. */
int kvf_metrics_add_collector(struct kvf_metrics *reg, kvf_metrics_collect_fn fn, void *ctx);

/* Removes the collector added with this `fn` and `ctx`. Waits for a render in
 * progress, so that when it returns `fn` is not running and will not run again
 * and `ctx` may be freed. Returns 0 or -ENOENT. Any thread but a collector's. */
int kvf_metrics_remove_collector(struct kvf_metrics *reg, kvf_metrics_collect_fn fn, void *ctx);

/* Writes one sample of a gauge (or counter) family. `labels` is a
 * NULL-terminated array of name, value pairs ({"state", "ACTIVE", NULL}), or
 * NULL. Write all the samples of one family one after the other: # HELP and
 * # TYPE go out before the first, and the family cannot come back after
 * another one (nor reuse a registered family's name). Returns 0, -EINVAL (bad
 * name or label, an odd label list), -EEXIST (name already used by another
 * family, or by the current one with another type) or -ENOMEM; on error
 * nothing is written. Only from inside a collector, with the writer it got. */
int kvf_metrics_write_gauge(struct kvf_metrics_writer *w, const char *name, const char *help,
                            const char *const *labels, double value);
int kvf_metrics_write_counter(struct kvf_metrics_writer *w, const char *name, const char *help,
                              const char *const *labels, double value);

/* Writes the samples of one histogram (one label set) whose buckets its
 * source keeps itself: `cum_counts[i]` observations <= bounds[i]
 * (cumulative), for `n_bounds` finite, strictly increasing bounds (at most
 * KVF_METRICS_MAX_BUCKETS), and `count` observations in all (the +Inf bucket
 * and _count). _sum is written unless `sum` is NaN (a source that keeps no
 * sum; Prometheus accepts a histogram without it, rate(_sum) is then
 * unknown). `labels` as above, without "le". Same rules and errors as
 * kvf_metrics_write_gauge, plus -EINVAL for bounds that are not increasing,
 * counts that decrease or exceed `count`. Only from inside a collector. */
int kvf_metrics_write_histogram(struct kvf_metrics_writer *w, const char *name, const char *help,
                                const char *const *labels, const double *bounds,
                                const uint64_t *cum_counts, size_t n_bounds, uint64_t count,
                                double sum);

/* Renders every family with at least one child (registration order, children
 * in creation order), then the collectors' output, in the Prometheus text
 * format 0.0.4. Writes a malloc'd NUL-terminated text to `*text_p` (the caller
 * frees it) and its length without the NUL to `*len_p` (may be NULL). Returns
 * 0 or -EINVAL / -ENOMEM. Any thread; renders are serialised.
 *
 * A render reads each counter and bucket atomically but not all of them at
 * one instant: a sample racing with it may show in a bucket and not yet in
 * _sum. _count is always the +Inf bucket. */
int kvf_metrics_render(struct kvf_metrics *reg, char **text_p, size_t *len_p);

/* Checks a metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) and a label name
 * ([a-zA-Z_][a-zA-Z0-9_]*, not beginning with "__"). */
bool kvf_metrics_name_valid(const char *name);
bool kvf_metrics_label_name_valid(const char *name);

#endif /* KVF_METRICS_H */
