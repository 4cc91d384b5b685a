/*
 * metrics.c: the Prometheus metrics registry of kvfence.
 *
 * It owns the families (struct kvf_metric_vec: name, help, type, label names,
 * histogram bounds), their children (struct kvf_metric: label values and the
 * atomic values the hot path updates), the collectors, and the rendering of
 * all of them in the text exposition format 0.0.4.
 *
 * Values. A counter is a uint64_t count. A gauge is a double kept as its bit
 * pattern in an _Atomic uint64_t: set is a store, add a compare-and-swap loop.
 * A histogram keeps one non-cumulative uint64_t count per bucket (the last one
 * is +Inf) and its sum as double bits updated by compare-and-swap, so the sum
 * keeps full double precision at any scale (integer micro-units would overflow
 * or lose small values). Render makes the buckets cumulative and prints the
 * +Inf total as _count, so _count always equals the +Inf bucket.
 *
 * DESIGN (threads). Updates through a child handle are lock-free: relaxed
 * atomics on the child, which never moves or goes away before the registry
 * does. Everything else is behind two mutexes. `mu` guards the family list,
 * each family's child list and hash table: registration, child lookup and the
 * first half of render take it, so render sees every child whole. `collect_mu`
 * guards the collector list and is held while render runs the collectors, so
 * renders are serialised and kvf_metrics_remove_collector() returning means
 * the callback is not running. Collectors run without `mu` and may look up
 * children, which takes `mu`: the lock order is collect_mu, then mu.
 */
#include "metrics.h"
#include "kvf_log.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum metric_type {
    TYPE_COUNTER,
    TYPE_GAUGE,
    TYPE_HISTOGRAM,
};

static const char *const type_names[] = {
    [TYPE_COUNTER] = "counter",
    [TYPE_GAUGE] = "gauge",
    [TYPE_HISTOGRAM] = "histogram",
};

struct kvf_metric {
    enum metric_type type;        /* copied from the family for the hot path */
    struct kvf_metric_vec *vec;   /* the family */
    struct kvf_metric *next;      /* the family's children, creation order */
    struct kvf_metric *hash_next; /* the family's hash chain */
    uint64_t hash;
    char **values;              /* vec->n_labels strings, NULL when none */
    _Atomic uint64_t value;     /* counter: the count; gauge: double bits */
    _Atomic uint64_t sum_bits;  /* histogram: the sum, double bits */
    _Atomic uint64_t buckets[]; /* histogram: n_bounds + 1 counts, last +Inf */
};

struct kvf_metric_vec {
    struct kvf_metrics *reg;
    struct kvf_metric_vec *next; /* registration order */
    enum metric_type type;
    char *name;
    char *help;
    size_t n_labels;
    char **label_names;
    size_t n_bounds;
    double *bounds;
    /* Under reg->mu once the family is registered. */
    struct kvf_metric *first, *last;
    size_t n_children;
    struct kvf_metric **table; /* hash chains, table_size a power of two */
    size_t table_size;
};

struct collector {
    kvf_metrics_collect_fn fn;
    void *ctx;
    struct collector *next;
};

struct kvf_metrics {
    pthread_mutex_t mu;         /* families, children, hash tables */
    pthread_mutex_t collect_mu; /* collectors; held while they run */
    size_t max_children;
    struct kvf_metric_vec *first, *last;
    struct collector *collectors; /* added order */
};

/* A growing text buffer, always NUL-terminated once allocated. */
struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

struct kvf_metrics_writer {
    struct kvf_metrics *reg;
    struct sbuf *sb;
    char **names; /* families written by collectors in this render */
    size_t n_names, cap_names;
    const char *cur; /* the family of the last sample, one of names[] */
    enum metric_type cur_type;
};

static void metrics_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void metrics_log(const char *fmt, ...)
{
    char msg[KVF_LOG_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvf_log("error", "kvf_metrics: %s", msg);
}

static char *str_dup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static uint64_t dbl_bits(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof(u));
    return u;
}

static double bits_dbl(uint64_t u)
{
    double v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

/* Adds `delta` to the double kept as bits in `a`. */
static void atomic_add_double(_Atomic uint64_t *a, double delta)
{
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(a, &old, dbl_bits(bits_dbl(old) + delta),
                                                  memory_order_relaxed, memory_order_relaxed))
        ;
}

/* ---- names and values ---- */

static bool is_alpha_(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

bool kvf_metrics_name_valid(const char *name)
{
    if (!name || !(is_alpha_(name[0]) || name[0] == ':'))
        return false;
    for (const char *c = name + 1; *c; c++)
        if (!(is_alpha_(*c) || is_digit(*c) || *c == ':'))
            return false;
    return true;
}

bool kvf_metrics_label_name_valid(const char *name)
{
    if (!name || !is_alpha_(name[0]) || (name[0] == '_' && name[1] == '_'))
        return false;
    for (const char *c = name + 1; *c; c++)
        if (!(is_alpha_(*c) || is_digit(*c)))
            return false;
    return true;
}

/* Well-formed UTF-8: no overlong forms, surrogates or code points past
 * U+10FFFF. */
static bool utf8_valid(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        unsigned c = *p;
        size_t n;
        uint32_t cp, min;
        if (c < 0x80) {
            p++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 1, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            n = 2, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            n = 3, cp = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        for (size_t i = 1; i <= n; i++) {
            if ((p[i] & 0xc0) != 0x80)
                return false; /* also stops at the NUL */
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        p += n + 1;
    }
    return true;
}

/* Checks a NULL-terminated list of label names; writes its length. */
static int label_names_check(const char *const *names, enum metric_type type, size_t *n_p)
{
    size_t n = 0;
    for (; names && names[n]; n++) {
        if (n == KVF_METRICS_MAX_LABELS || !kvf_metrics_label_name_valid(names[n]))
            return -EINVAL;
        if (type == TYPE_HISTOGRAM && strcmp(names[n], "le") == 0)
            return -EINVAL;
        for (size_t j = 0; j < n; j++)
            if (strcmp(names[j], names[n]) == 0)
                return -EINVAL;
    }
    *n_p = n;
    return 0;
}

/* ---- text buffer ---- */

static bool sb_reserve(struct sbuf *sb, size_t more)
{
    if (sb->oom)
        return false;
    if (sb->len + more + 1 <= sb->cap)
        return true;
    size_t cap = sb->cap ? sb->cap : 4096;
    while (cap < sb->len + more + 1)
        cap *= 2;
    char *p = realloc(sb->p, cap);
    if (!p) {
        sb->oom = true;
        return false;
    }
    sb->p = p;
    sb->cap = cap;
    sb->p[sb->len] = '\0';
    return true;
}

static void sb_put(struct sbuf *sb, const char *s, size_t n)
{
    if (!sb_reserve(sb, n))
        return;
    memcpy(sb->p + sb->len, s, n);
    sb->len += n;
    sb->p[sb->len] = '\0';
}

static void sb_puts(struct sbuf *sb, const char *s)
{
    sb_put(sb, s, strlen(s));
}

/* Writes `s` escaped: backslash and newline always, the double quote too for
 * label values (HELP text keeps its quotes). */
static void sb_escaped(struct sbuf *sb, const char *s, bool quote)
{
    for (const char *c = s; *c; c++) {
        if (*c == '\\')
            sb_put(sb, "\\\\", 2);
        else if (*c == '\n')
            sb_put(sb, "\\n", 2);
        else if (*c == '"' && quote)
            sb_put(sb, "\\\"", 2);
        else
            sb_put(sb, c, 1);
    }
}

/* Formats `v` as Prometheus reads it: NaN, +Inf, -Inf, else the shortest %g
 * that reads back as the same double ("0.1", "2.5", "1e+21"). The process
 * keeps the "C" locale, so the decimal point is '.'. Integers below 2^53 are
 * written out ("10", "22835200", not "1e+01"). */
static void fmt_double(char *buf, size_t size, double v)
{
    if (isnan(v)) {
        snprintf(buf, size, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, size, "%s", v > 0 ? "+Inf" : "-Inf");
        return;
    }
    /* An integer below 2^53 in magnitude: exact as an integer. */
    if (v > -9007199254740992.0 && v < 9007199254740992.0 && v == (double)(int64_t)v) {
        snprintf(buf, size, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, size, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

static void sb_double(struct sbuf *sb, double v)
{
    char buf[64];
    fmt_double(buf, sizeof(buf), v);
    sb_puts(sb, buf);
}

static void sb_u64(struct sbuf *sb, uint64_t v)
{
    char buf[32];
    snprintf(buf, sizeof(buf), "%" PRIu64, v);
    sb_puts(sb, buf);
}

/* Writes # HELP (left out when `help` is empty) and # TYPE. */
static void sb_header(struct sbuf *sb, const char *name, const char *help, enum metric_type type)
{
    if (help[0]) {
        sb_puts(sb, "# HELP ");
        sb_puts(sb, name);
        sb_puts(sb, " ");
        sb_escaped(sb, help, false);
        sb_puts(sb, "\n");
    }
    sb_puts(sb, "# TYPE ");
    sb_puts(sb, name);
    sb_puts(sb, " ");
    sb_puts(sb, type_names[type]);
    sb_puts(sb, "\n");
}

/* Writes `name{n1="v1",...,extra="extra_value"} ` (no braces without labels);
 * names[i] and values[i] for i < n, then the extra pair when extra is set. */
static void sb_labels(struct sbuf *sb, const char *name, const char *suffix, char *const *names,
                      char *const *values, size_t n, const char *extra, const char *extra_value)
{
    sb_puts(sb, name);
    sb_puts(sb, suffix);
    if (n == 0 && !extra) {
        sb_puts(sb, " ");
        return;
    }
    sb_puts(sb, "{");
    for (size_t i = 0; i < n; i++) {
        if (i)
            sb_puts(sb, ",");
        sb_puts(sb, names[i]);
        sb_puts(sb, "=\"");
        sb_escaped(sb, values[i], true);
        sb_puts(sb, "\"");
    }
    if (extra) {
        if (n)
            sb_puts(sb, ",");
        sb_puts(sb, extra);
        sb_puts(sb, "=\"");
        sb_puts(sb, extra_value);
        sb_puts(sb, "\"");
    }
    sb_puts(sb, "} ");
}

/* ---- registry ---- */

void kvf_metrics_opts_init(struct kvf_metrics_opts *opts)
{
    if (!opts)
        return;
    memset(opts, 0, sizeof(*opts));
    opts->max_children = KVF_METRICS_DEFAULT_MAX_CHILDREN;
}

struct kvf_metrics *kvf_metrics_create(const struct kvf_metrics_opts *opts)
{
    struct kvf_metrics *reg = calloc(1, sizeof(*reg));
    if (!reg) {
        metrics_log("create: out of memory");
        return NULL;
    }
    reg->max_children =
        opts && opts->max_children ? opts->max_children : KVF_METRICS_DEFAULT_MAX_CHILDREN;
    pthread_mutex_init(&reg->mu, NULL);
    pthread_mutex_init(&reg->collect_mu, NULL);
    return reg;
}

static void child_free(struct kvf_metric *m, size_t n_labels)
{
    if (!m)
        return;
    for (size_t i = 0; m->values && i < n_labels; i++)
        free(m->values[i]);
    free(m->values);
    free(m);
}

static void vec_free(struct kvf_metric_vec *vec)
{
    if (!vec)
        return;
    struct kvf_metric *m = vec->first;
    while (m) {
        struct kvf_metric *next = m->next;
        child_free(m, vec->n_labels);
        m = next;
    }
    for (size_t i = 0; vec->label_names && i < vec->n_labels; i++)
        free(vec->label_names[i]);
    free(vec->label_names);
    free(vec->bounds);
    free(vec->table);
    free(vec->name);
    free(vec->help);
    free(vec);
}

void kvf_metrics_destroy(struct kvf_metrics *reg)
{
    if (!reg)
        return;
    struct kvf_metric_vec *vec = reg->first;
    while (vec) {
        struct kvf_metric_vec *next = vec->next;
        vec_free(vec);
        vec = next;
    }
    struct collector *c = reg->collectors;
    while (c) {
        struct collector *next = c->next;
        free(c);
        c = next;
    }
    pthread_mutex_destroy(&reg->mu);
    pthread_mutex_destroy(&reg->collect_mu);
    free(reg);
}

/* FNV-1a over the values, each followed by 0xff (a byte UTF-8 never has, so
 * ("a","bc") and ("ab","c") differ). */
static uint64_t values_hash(const char *const *values, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        for (const unsigned char *c = (const unsigned char *)values[i]; *c; c++)
            h = (h ^ *c) * 0x100000001b3ull;
        h = (h ^ 0xff) * 0x100000001b3ull;
    }
    return h;
}

static struct kvf_metric *vec_find(struct kvf_metric_vec *vec, const char *const *values,
                                   uint64_t h)
{
    if (!vec->table)
        return NULL;
    for (struct kvf_metric *m = vec->table[h & (vec->table_size - 1)]; m; m = m->hash_next) {
        if (m->hash != h)
            continue;
        size_t i = 0;
        while (i < vec->n_labels && strcmp(m->values[i], values[i]) == 0)
            i++;
        if (i == vec->n_labels)
            return m;
    }
    return NULL;
}

/* Makes room in the hash table for one more child. */
static int vec_table_grow(struct kvf_metric_vec *vec)
{
    if (vec->table && vec->n_children < vec->table_size)
        return 0;
    size_t size = vec->table_size ? vec->table_size * 2 : 8;
    struct kvf_metric **table = calloc(size, sizeof(*table));
    if (!table)
        return -ENOMEM;
    for (struct kvf_metric *m = vec->first; m; m = m->next) {
        struct kvf_metric **slot = &table[m->hash & (size - 1)];
        m->hash_next = *slot;
        *slot = m;
    }
    free(vec->table);
    vec->table = table;
    vec->table_size = size;
    return 0;
}

/* Creates the child of `vec` for `values` (checked by the caller) and links it.
 * The caller holds reg->mu, or owns `vec` before it is registered. */
static int vec_add_child(struct kvf_metric_vec *vec, const char *const *values, uint64_t h,
                         struct kvf_metric **metric_p)
{
    size_t n_buckets = vec->type == TYPE_HISTOGRAM ? vec->n_bounds + 1 : 0;
    int rc = vec_table_grow(vec);
    if (rc < 0)
        return rc;
    struct kvf_metric *m = calloc(1, sizeof(*m) + n_buckets * sizeof(m->buckets[0]));
    if (!m)
        return -ENOMEM;
    m->type = vec->type;
    m->vec = vec;
    m->hash = h;
    if (vec->n_labels) {
        m->values = calloc(vec->n_labels, sizeof(*m->values));
        if (!m->values)
            goto err_free_child;
        for (size_t i = 0; i < vec->n_labels; i++)
            if (!(m->values[i] = str_dup(values[i])))
                goto err_free_child;
    }
    atomic_init(&m->value, vec->type == TYPE_GAUGE ? dbl_bits(0.0) : 0);
    atomic_init(&m->sum_bits, dbl_bits(0.0));
    for (size_t i = 0; i < n_buckets; i++)
        atomic_init(&m->buckets[i], 0);

    struct kvf_metric **slot = &vec->table[h & (vec->table_size - 1)];
    m->hash_next = *slot;
    *slot = m;
    if (vec->last)
        vec->last->next = m;
    else
        vec->first = m;
    vec->last = m;
    vec->n_children++;
    *metric_p = m;
    return 0;

err_free_child:
    child_free(m, vec->n_labels);
    return -ENOMEM;
}

static bool values_check(const struct kvf_metric_vec *vec, const char *const *values)
{
    if (vec->n_labels && !values)
        return false;
    for (size_t i = 0; i < vec->n_labels; i++)
        if (!values[i] || !utf8_valid(values[i]))
            return false;
    return true;
}

int kvf_metric_child(struct kvf_metric_vec *vec, const char *const *label_values,
                     struct kvf_metric **metric_p)
{
    if (!vec || !metric_p || !values_check(vec, label_values))
        return -EINVAL;
    struct kvf_metrics *reg = vec->reg;
    uint64_t h = values_hash(label_values, vec->n_labels);
    int rc = 0;
    pthread_mutex_lock(&reg->mu);
    struct kvf_metric *m = vec_find(vec, label_values, h);
    if (m)
        *metric_p = m;
    else if (vec->n_children >= reg->max_children)
        rc = -E2BIG;
    else
        rc = vec_add_child(vec, label_values, h, metric_p);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

static struct kvf_metric_vec *family_find(struct kvf_metrics *reg, const char *name)
{
    for (struct kvf_metric_vec *v = reg->first; v; v = v->next)
        if (strcmp(v->name, name) == 0)
            return v;
    return NULL;
}

/* Builds a family (with its only child when metric_p is set) and registers
 * it; nothing is linked on error. */
static int family_register(struct kvf_metrics *reg, enum metric_type type, const char *name,
                           const char *help, const char *const *label_names, const double *bounds,
                           size_t n_bounds, struct kvf_metric_vec **vec_p,
                           struct kvf_metric **metric_p)
{
    size_t n_labels;
    if (!reg || !kvf_metrics_name_valid(name) || (!vec_p && !metric_p))
        return -EINVAL;
    int rc = label_names_check(label_names, type, &n_labels);
    if (rc < 0)
        return rc;
    if (type == TYPE_HISTOGRAM) {
        if (n_bounds > KVF_METRICS_MAX_BUCKETS || (n_bounds && !bounds))
            return -EINVAL;
        for (size_t i = 0; i < n_bounds; i++)
            if (!isfinite(bounds[i]) || (i && !(bounds[i] > bounds[i - 1])))
                return -EINVAL;
    }

    struct kvf_metric_vec *vec = calloc(1, sizeof(*vec));
    if (!vec)
        return -ENOMEM;
    vec->reg = reg;
    vec->type = type;
    vec->name = str_dup(name);
    vec->help = str_dup(help ? help : "");
    if (!vec->name || !vec->help)
        goto err_free_vec;
    if (n_labels) {
        vec->label_names = calloc(n_labels, sizeof(*vec->label_names));
        if (!vec->label_names)
            goto err_free_vec;
        vec->n_labels = n_labels;
        for (size_t i = 0; i < n_labels; i++)
            if (!(vec->label_names[i] = str_dup(label_names[i])))
                goto err_free_vec;
    }
    if (type == TYPE_HISTOGRAM && n_bounds) {
        vec->bounds = malloc(n_bounds * sizeof(*vec->bounds));
        if (!vec->bounds)
            goto err_free_vec;
        memcpy(vec->bounds, bounds, n_bounds * sizeof(*bounds));
    }
    vec->n_bounds = type == TYPE_HISTOGRAM ? n_bounds : 0;
    struct kvf_metric *child = NULL;
    if (metric_p && vec_add_child(vec, NULL, values_hash(NULL, 0), &child) < 0)
        goto err_free_vec;

    pthread_mutex_lock(&reg->mu);
    if (family_find(reg, name)) {
        pthread_mutex_unlock(&reg->mu);
        vec_free(vec);
        return -EEXIST;
    }
    if (reg->last)
        reg->last->next = vec;
    else
        reg->first = vec;
    reg->last = vec;
    pthread_mutex_unlock(&reg->mu);
    if (vec_p)
        *vec_p = vec;
    if (metric_p)
        *metric_p = child;
    return 0;

err_free_vec:
    vec_free(vec);
    return -ENOMEM;
}

int kvf_metrics_counter_vec(struct kvf_metrics *reg, const char *name, const char *help,
                            const char *const *label_names, struct kvf_metric_vec **vec_p)
{
    if (!vec_p)
        return -EINVAL;
    return family_register(reg, TYPE_COUNTER, name, help, label_names, NULL, 0, vec_p, NULL);
}

int kvf_metrics_gauge_vec(struct kvf_metrics *reg, const char *name, const char *help,
                          const char *const *label_names, struct kvf_metric_vec **vec_p)
{
    if (!vec_p)
        return -EINVAL;
    return family_register(reg, TYPE_GAUGE, name, help, label_names, NULL, 0, vec_p, NULL);
}

int kvf_metrics_histogram_vec(struct kvf_metrics *reg, const char *name, const char *help,
                              const char *const *label_names, const double *bounds, size_t n_bounds,
                              struct kvf_metric_vec **vec_p)
{
    if (!vec_p)
        return -EINVAL;
    return family_register(reg, TYPE_HISTOGRAM, name, help, label_names, bounds, n_bounds, vec_p,
                           NULL);
}

int kvf_metrics_counter(struct kvf_metrics *reg, const char *name, const char *help,
                        struct kvf_metric **metric_p)
{
    if (!metric_p)
        return -EINVAL;
    return family_register(reg, TYPE_COUNTER, name, help, NULL, NULL, 0, NULL, metric_p);
}

int kvf_metrics_gauge(struct kvf_metrics *reg, const char *name, const char *help,
                      struct kvf_metric **metric_p)
{
    if (!metric_p)
        return -EINVAL;
    return family_register(reg, TYPE_GAUGE, name, help, NULL, NULL, 0, NULL, metric_p);
}

int kvf_metrics_histogram(struct kvf_metrics *reg, const char *name, const char *help,
                          const double *bounds, size_t n_bounds, struct kvf_metric **metric_p)
{
    if (!metric_p)
        return -EINVAL;
    return family_register(reg, TYPE_HISTOGRAM, name, help, NULL, bounds, n_bounds, NULL, metric_p);
}

/* ---- hot path ---- */

void kvf_counter_add(struct kvf_metric *m, uint64_t n)
{
    if (m && m->type == TYPE_COUNTER)
        atomic_fetch_add_explicit(&m->value, n, memory_order_relaxed);
}

void kvf_counter_inc(struct kvf_metric *m)
{
    kvf_counter_add(m, 1);
}

void kvf_gauge_set(struct kvf_metric *m, double v)
{
    if (m && m->type == TYPE_GAUGE)
        atomic_store_explicit(&m->value, dbl_bits(v), memory_order_relaxed);
}

void kvf_gauge_add(struct kvf_metric *m, double delta)
{
    if (m && m->type == TYPE_GAUGE)
        atomic_add_double(&m->value, delta);
}

void kvf_histogram_observe(struct kvf_metric *m, double v)
{
    if (!m || m->type != TYPE_HISTOGRAM || isnan(v))
        return;
    const double *bounds = m->vec->bounds;
    size_t lo = 0, hi = m->vec->n_bounds; /* first bound >= v, n_bounds for +Inf */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (bounds[mid] >= v)
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&m->buckets[lo], 1, memory_order_relaxed);
    atomic_add_double(&m->sum_bits, v);
}

uint64_t kvf_counter_value(const struct kvf_metric *m)
{
    if (!m || m->type != TYPE_COUNTER)
        return 0;
    return atomic_load_explicit(&((struct kvf_metric *)m)->value, memory_order_relaxed);
}

double kvf_gauge_value(const struct kvf_metric *m)
{
    if (!m || m->type != TYPE_GAUGE)
        return 0;
    return bits_dbl(atomic_load_explicit(&((struct kvf_metric *)m)->value, memory_order_relaxed));
}

/* ---- collectors ---- */

int kvf_metrics_add_collector(struct kvf_metrics *reg, kvf_metrics_collect_fn fn, void *ctx)
{
    if (!reg || !fn)
        return -EINVAL;
    struct collector *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->fn = fn;
    c->ctx = ctx;
    pthread_mutex_lock(&reg->collect_mu);
    struct collector **tail = &reg->collectors;
    while (*tail)
        tail = &(*tail)->next;
    *tail = c;
    pthread_mutex_unlock(&reg->collect_mu);
    return 0;
}

int kvf_metrics_remove_collector(struct kvf_metrics *reg, kvf_metrics_collect_fn fn, void *ctx)
{
    if (!reg)
        return -ENOENT;
    pthread_mutex_lock(&reg->collect_mu);
    for (struct collector **c = &reg->collectors; *c; c = &(*c)->next) {
        if ((*c)->fn == fn && (*c)->ctx == ctx) {
            struct collector *gone = *c;
            *c = gone->next;
            pthread_mutex_unlock(&reg->collect_mu);
            free(gone);
            return 0;
        }
    }
    pthread_mutex_unlock(&reg->collect_mu);
    return -ENOENT;
}

/* Checks a NULL-terminated name, value pair list; writes the pair count. */
static int label_pairs_check(const char *const *labels, size_t *n_p)
{
    size_t n = 0;
    for (; labels && labels[2 * n]; n++) {
        const char *name = labels[2 * n], *value = labels[2 * n + 1];
        if (n == KVF_METRICS_MAX_LABELS || !kvf_metrics_label_name_valid(name) || !value ||
            !utf8_valid(value))
            return -EINVAL;
        for (size_t j = 0; j < n; j++)
            if (strcmp(labels[2 * j], name) == 0)
                return -EINVAL;
    }
    *n_p = n;
    return 0;
}

static bool writer_seen(const struct kvf_metrics_writer *w, const char *name)
{
    for (size_t i = 0; i < w->n_names; i++)
        if (strcmp(w->names[i], name) == 0)
            return true;
    return false;
}

/* Starts (or continues) family `name` of `type` in a collector's output:
 * checks the name, and writes # HELP / # TYPE before its first sample. */
static int writer_family(struct kvf_metrics_writer *w, enum metric_type type, const char *name,
                         const char *help)
{
    if (!w || !kvf_metrics_name_valid(name))
        return -EINVAL;
    bool same = w->cur && strcmp(w->cur, name) == 0;
    if (same && w->cur_type != type)
        return -EEXIST;
    if (same)
        return 0;
    if (writer_seen(w, name))
        return -EEXIST;
    pthread_mutex_lock(&w->reg->mu);
    bool registered = family_find(w->reg, name) != NULL;
    pthread_mutex_unlock(&w->reg->mu);
    if (registered)
        return -EEXIST;
    if (w->n_names == w->cap_names) {
        size_t cap = w->cap_names ? 2 * w->cap_names : 8;
        char **names = realloc(w->names, cap * sizeof(*names));
        if (!names)
            return -ENOMEM;
        w->names = names;
        w->cap_names = cap;
    }
    char *copy = str_dup(name);
    if (!copy)
        return -ENOMEM;
    w->names[w->n_names++] = copy;
    w->cur = copy;
    w->cur_type = type;
    sb_header(w->sb, name, help ? help : "", type);
    return 0;
}

/* One sample line: name+suffix, the `n_pairs` label pairs of `labels` and,
 * when `le` is set, le="<le>"; then the value. */
static void writer_line(struct kvf_metrics_writer *w, const char *name, const char *suffix,
                        const char *const *labels, size_t n_pairs, const char *le, double value)
{
    struct sbuf *sb = w->sb;
    sb_puts(sb, name);
    sb_puts(sb, suffix);
    if (n_pairs || le) {
        sb_puts(sb, "{");
        for (size_t i = 0; i < n_pairs; i++) {
            if (i)
                sb_puts(sb, ",");
            sb_puts(sb, labels[2 * i]);
            sb_puts(sb, "=\"");
            sb_escaped(sb, labels[2 * i + 1], true);
            sb_puts(sb, "\"");
        }
        if (le) {
            if (n_pairs)
                sb_puts(sb, ",");
            sb_puts(sb, "le=\"");
            sb_puts(sb, le);
            sb_puts(sb, "\"");
        }
        sb_puts(sb, "}");
    }
    sb_puts(sb, " ");
    sb_double(sb, value);
    sb_puts(sb, "\n");
}

static int writer_sample(struct kvf_metrics_writer *w, enum metric_type type, const char *name,
                         const char *help, const char *const *labels, double value)
{
    size_t n_pairs;
    if (!w || !kvf_metrics_name_valid(name) || label_pairs_check(labels, &n_pairs) < 0)
        return -EINVAL;
    int rc = writer_family(w, type, name, help);
    if (rc < 0)
        return rc;
    writer_line(w, name, "", labels, n_pairs, NULL, value);
    return w->sb->oom ? -ENOMEM : 0;
}

int kvf_metrics_write_gauge(struct kvf_metrics_writer *w, const char *name, const char *help,
                            const char *const *labels, double value)
{
    return writer_sample(w, TYPE_GAUGE, name, help, labels, value);
}

int kvf_metrics_write_counter(struct kvf_metrics_writer *w, const char *name, const char *help,
                              const char *const *labels, double value)
{
    return writer_sample(w, TYPE_COUNTER, name, help, labels, value);
}

int kvf_metrics_write_histogram(struct kvf_metrics_writer *w, const char *name, const char *help,
                                const char *const *labels, const double *bounds,
                                const uint64_t *cum_counts, size_t n_bounds, uint64_t count,
                                double sum)
{
    size_t n_pairs;
    if (!w || !kvf_metrics_name_valid(name) || label_pairs_check(labels, &n_pairs) < 0 ||
        n_bounds > KVF_METRICS_MAX_BUCKETS || (n_bounds && (!bounds || !cum_counts)))
        return -EINVAL;
    for (size_t i = 0; i < n_pairs; i++)
        if (strcmp(labels[2 * i], "le") == 0)
            return -EINVAL;
    for (size_t i = 0; i < n_bounds; i++)
        if (!isfinite(bounds[i]) || (i && bounds[i] <= bounds[i - 1]) ||
            (i && cum_counts[i] < cum_counts[i - 1]) || cum_counts[i] > count)
            return -EINVAL;
    int rc = writer_family(w, TYPE_HISTOGRAM, name, help);
    if (rc < 0)
        return rc;
    char le[64];
    for (size_t i = 0; i < n_bounds; i++) {
        fmt_double(le, sizeof(le), bounds[i]);
        writer_line(w, name, "_bucket", labels, n_pairs, le, (double)cum_counts[i]);
    }
    writer_line(w, name, "_bucket", labels, n_pairs, "+Inf", (double)count);
    if (!isnan(sum))
        writer_line(w, name, "_sum", labels, n_pairs, NULL, sum);
    writer_line(w, name, "_count", labels, n_pairs, NULL, (double)count);
    return w->sb->oom ? -ENOMEM : 0;
}

/* ---- render ---- */

static void render_family(struct sbuf *sb, const struct kvf_metric_vec *vec)
{
    if (!vec->first)
        return;
    sb_header(sb, vec->name, vec->help, vec->type);
    for (struct kvf_metric *m = vec->first; m; m = m->next) {
        if (vec->type == TYPE_COUNTER) {
            sb_labels(sb, vec->name, "", vec->label_names, m->values, vec->n_labels, NULL, NULL);
            sb_u64(sb, atomic_load_explicit(&m->value, memory_order_relaxed));
            sb_puts(sb, "\n");
            continue;
        }
        if (vec->type == TYPE_GAUGE) {
            sb_labels(sb, vec->name, "", vec->label_names, m->values, vec->n_labels, NULL, NULL);
            sb_double(sb, bits_dbl(atomic_load_explicit(&m->value, memory_order_relaxed)));
            sb_puts(sb, "\n");
            continue;
        }
        uint64_t total = 0;
        char le[64];
        for (size_t i = 0; i <= vec->n_bounds; i++) {
            total += atomic_load_explicit(&m->buckets[i], memory_order_relaxed);
            fmt_double(le, sizeof(le), i < vec->n_bounds ? vec->bounds[i] : INFINITY);
            sb_labels(sb, vec->name, "_bucket", vec->label_names, m->values, vec->n_labels, "le",
                      le);
            sb_u64(sb, total);
            sb_puts(sb, "\n");
        }
        sb_labels(sb, vec->name, "_sum", vec->label_names, m->values, vec->n_labels, NULL, NULL);
        sb_double(sb, bits_dbl(atomic_load_explicit(&m->sum_bits, memory_order_relaxed)));
        sb_puts(sb, "\n");
        sb_labels(sb, vec->name, "_count", vec->label_names, m->values, vec->n_labels, NULL, NULL);
        sb_u64(sb, total);
        sb_puts(sb, "\n");
    }
}

int kvf_metrics_render(struct kvf_metrics *reg, char **text_p, size_t *len_p)
{
    if (!reg || !text_p)
        return -EINVAL;
    struct sbuf sb = {0};
    sb_reserve(&sb, 0); /* an empty registry renders "" */

    pthread_mutex_lock(&reg->mu);
    for (struct kvf_metric_vec *vec = reg->first; vec; vec = vec->next)
        render_family(&sb, vec);
    pthread_mutex_unlock(&reg->mu);

    struct kvf_metrics_writer w = {.reg = reg, .sb = &sb};
    pthread_mutex_lock(&reg->collect_mu);
    for (struct collector *c = reg->collectors; c && !sb.oom; c = c->next)
        c->fn(c->ctx, &w);
    pthread_mutex_unlock(&reg->collect_mu);
    for (size_t i = 0; i < w.n_names; i++)
        free(w.names[i]);
    free(w.names);

    if (sb.oom) {
        free(sb.p);
        return -ENOMEM;
    }
    *text_p = sb.p;
    if (len_p)
        *len_p = sb.len;
    return 0;
}
