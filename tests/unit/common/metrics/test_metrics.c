/*
 * test_metrics.c: the metrics registry and its HTTP endpoint (common/metrics/).
 *
 * Rendering is checked against the exact text of the exposition format 0.0.4.
 * Real threads are used here on purpose: the registry is a shared object whose
 * hot path is atomics, not a state core, and the concurrency test checks that
 * no update is lost. The HTTP tests run a real server on 127.0.0.1 port 0 and
 * a plain socket client, and check that stop leaves no thread behind.
 *
 * malloc, calloc and realloc are wrapped at link time (CMakeLists.txt) in this
 * executable only, for the allocation failure sweep; the wrappers do nothing
 * unless a sweep arms them.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "http.h"
#include "metrics.h"
#include "process.h"

/* ---- allocation failure injection ---- */

void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t size);
void *__wrap_malloc(size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t size);

static long fail_at = -1; /* index of the allocation to fail, -1: none */
static long alloc_index;
static int failures;

static bool should_fail(void)
{
    if (fail_at < 0)
        return false;
    if (alloc_index++ == fail_at) {
        failures++;
        return true;
    }
    return false;
}

void *__wrap_malloc(size_t size)
{
    return should_fail() ? NULL : __real_malloc(size);
}

void *__wrap_calloc(size_t n, size_t size)
{
    return should_fail() ? NULL : __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t size)
{
    return should_fail() ? NULL : __real_realloc(p, size);
}

/* ---- helpers ---- */

/* Not inlined: gcc 12 at -O2 takes the address passed to kvf_metrics_render
 * for one the result may point into, and warns (-Wdangling-pointer) wherever
 * the result is read after this returns. */
__attribute__((noinline)) static char *render(struct kvf_metrics *reg)
{
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(kvf_metrics_render(reg, &text, &len), 0);
    assert_non_null(text);
    assert_int_equal(strlen(text), len);
    return text;
}

static void assert_render(struct kvf_metrics *reg, const char *expected)
{
    char *text = render(reg);
    if (strcmp(text, expected) != 0)
        fprintf(stderr, "rendered:\n%s\nexpected:\n%s\n", text, expected);
    assert_string_equal(text, expected);
    free(text);
}

static int count_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

/* ---- rendering ---- */

static void empty_registry_renders_nothing(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    assert_non_null(reg);
    assert_render(reg, "");
    struct kvf_metric_vec *vec;
    const char *labels[] = {"method", NULL};
    assert_int_equal(kvf_metrics_counter_vec(reg, "no_children_total", "h", labels, &vec), 0);
    assert_render(reg, ""); /* a family without children is left out */
    assert_int_equal(kvf_metrics_render(NULL, &(char *){NULL}, NULL), -EINVAL);
    assert_int_equal(kvf_metrics_render(reg, NULL, NULL), -EINVAL);
    kvf_metrics_destroy(reg);
    kvf_metrics_destroy(NULL);
}

static void counter_exact_text(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric *c;
    assert_int_equal(kvf_metrics_counter(reg, "kvfence_wal_bytes_total", "Bytes appended.", &c), 0);
    kvf_counter_add(c, 41);
    kvf_counter_inc(c);
    assert_int_equal(kvf_counter_value(c), 42);
    assert_render(reg, "# HELP kvfence_wal_bytes_total Bytes appended.\n"
                       "# TYPE kvfence_wal_bytes_total counter\n"
                       "kvfence_wal_bytes_total 42\n");
    kvf_metrics_destroy(reg);
}

static void labelled_counter_escapes(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric_vec *vec;
    const char *names[] = {"method", "code", NULL};
    assert_int_equal(kvf_metrics_counter_vec(reg, "kvfence_rpc_requests_total",
                                             "Requests \"by\" method.\nline \\ two", names, &vec),
                     0);
    struct kvf_metric *ok, *ok2, *odd;
    assert_int_equal(
        kvf_metric_child(vec, (const char *[]){"/kvfence.v1.Control/JoinRoom", "OK"}, &ok), 0);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"a\"b\\c\nd", ""}, &odd), 0);
    assert_int_equal(
        kvf_metric_child(vec, (const char *[]){"/kvfence.v1.Control/JoinRoom", "OK"}, &ok2), 0);
    assert_ptr_equal(ok, ok2); /* same values, same handle */
    assert_ptr_not_equal(ok, odd);
    kvf_counter_add(ok, 3);
    kvf_counter_inc(odd);
    assert_render(reg, "# HELP kvfence_rpc_requests_total Requests \"by\" method.\\nline \\\\ two\n"
                       "# TYPE kvfence_rpc_requests_total counter\n"
                       "kvfence_rpc_requests_total{method=\"/kvfence.v1.Control/JoinRoom\","
                       "code=\"OK\"} 3\n"
                       "kvfence_rpc_requests_total{method=\"a\\\"b\\\\c\\nd\",code=\"\"} 1\n");
    kvf_metrics_destroy(reg);
}

static void gauge_exact_text(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric *g;
    assert_int_equal(kvf_metrics_gauge(reg, "kvfence_pages_free", "Free pages.", &g), 0);
    kvf_gauge_set(g, 2.5);
    kvf_gauge_add(g, -1.0);
    assert_true(kvf_gauge_value(g) == 1.5);
    struct kvf_metric_vec *vec;
    assert_int_equal(
        kvf_metrics_gauge_vec(reg, "kvfence_pool_x", NULL, (const char *[]){"pool", NULL}, &vec),
        0);
    const char *pools[] = {"a", "b", "c", "d", "e", "f"};
    const double values[] = {0.1, -3, 1e21, NAN, INFINITY, -INFINITY};
    for (size_t i = 0; i < 6; i++) {
        struct kvf_metric *m;
        assert_int_equal(kvf_metric_child(vec, (const char *[]){pools[i]}, &m), 0);
        kvf_gauge_set(m, values[i]);
    }
    assert_render(reg, "# HELP kvfence_pages_free Free pages.\n"
                       "# TYPE kvfence_pages_free gauge\n"
                       "kvfence_pages_free 1.5\n"
                       "# TYPE kvfence_pool_x gauge\n"
                       "kvfence_pool_x{pool=\"a\"} 0.1\n"
                       "kvfence_pool_x{pool=\"b\"} -3\n"
                       "kvfence_pool_x{pool=\"c\"} 1e+21\n"
                       "kvfence_pool_x{pool=\"d\"} NaN\n"
                       "kvfence_pool_x{pool=\"e\"} +Inf\n"
                       "kvfence_pool_x{pool=\"f\"} -Inf\n");
    kvf_metrics_destroy(reg);
}

static void histogram_exact_text(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric_vec *vec;
    const double bounds[] = {0.5, 1, 2.5};
    assert_int_equal(kvf_metrics_histogram_vec(reg, "kvfence_lease_seconds", "Lease hold time.",
                                               (const char *[]){"op", NULL}, bounds, 3, &vec),
                     0);
    struct kvf_metric *h;
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"read"}, &h), 0);
    kvf_histogram_observe(h, 0.25);
    kvf_histogram_observe(h, 0.5); /* le is inclusive */
    kvf_histogram_observe(h, 0.75);
    kvf_histogram_observe(h, 3);
    kvf_histogram_observe(h, NAN); /* ignored */
    struct kvf_metric *small;
    const double small_bounds[] = {0.005, 0.01};
    assert_int_equal(kvf_metrics_histogram(reg, "kvfence_small", "s", small_bounds, 2, &small), 0);
    kvf_histogram_observe(small, 0.007);
    struct kvf_metric *inf_only;
    assert_int_equal(kvf_metrics_histogram(reg, "kvfence_inf_only", "i", NULL, 0, &inf_only), 0);
    kvf_histogram_observe(inf_only, -2);
    assert_render(reg, "# HELP kvfence_lease_seconds Lease hold time.\n"
                       "# TYPE kvfence_lease_seconds histogram\n"
                       "kvfence_lease_seconds_bucket{op=\"read\",le=\"0.5\"} 2\n"
                       "kvfence_lease_seconds_bucket{op=\"read\",le=\"1\"} 3\n"
                       "kvfence_lease_seconds_bucket{op=\"read\",le=\"2.5\"} 3\n"
                       "kvfence_lease_seconds_bucket{op=\"read\",le=\"+Inf\"} 4\n"
                       "kvfence_lease_seconds_sum{op=\"read\"} 4.5\n"
                       "kvfence_lease_seconds_count{op=\"read\"} 4\n"
                       "# HELP kvfence_small s\n"
                       "# TYPE kvfence_small histogram\n"
                       "kvfence_small_bucket{le=\"0.005\"} 0\n"
                       "kvfence_small_bucket{le=\"0.01\"} 1\n"
                       "kvfence_small_bucket{le=\"+Inf\"} 1\n"
                       "kvfence_small_sum 0.007\n"
                       "kvfence_small_count 1\n"
                       "# HELP kvfence_inf_only i\n"
                       "# TYPE kvfence_inf_only histogram\n"
                       "kvfence_inf_only_bucket{le=\"+Inf\"} 1\n"
                       "kvfence_inf_only_sum -2\n"
                       "kvfence_inf_only_count 1\n");
    kvf_metrics_destroy(reg);
}

static void wrong_type_and_null_are_noops(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric *c, *g;
    assert_int_equal(kvf_metrics_counter(reg, "c_total", "", &c), 0);
    assert_int_equal(kvf_metrics_gauge(reg, "g", "", &g), 0);
    kvf_gauge_set(c, 7);
    kvf_histogram_observe(c, 7);
    kvf_counter_add(g, 7);
    kvf_counter_add(NULL, 1);
    kvf_gauge_set(NULL, 1);
    kvf_gauge_add(NULL, 1);
    kvf_histogram_observe(NULL, 1);
    assert_int_equal(kvf_counter_value(c), 0);
    assert_true(kvf_gauge_value(g) == 0);
    assert_int_equal(kvf_counter_value(NULL), 0);
    assert_true(kvf_gauge_value(c) == 0);
    kvf_metrics_destroy(reg);
}

/* ---- validation ---- */

static void invalid_names_refused(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric_vec *vec = (struct kvf_metric_vec *)0x1; /* must stay untouched */
    struct kvf_metric *m = (struct kvf_metric *)0x1;
    const char *bad_names[] = {"", "1abc", "a-b", "a b", "a.b", "é"};
    for (size_t i = 0; i < sizeof(bad_names) / sizeof(bad_names[0]); i++) {
        assert_false(kvf_metrics_name_valid(bad_names[i]));
        assert_int_equal(kvf_metrics_counter_vec(reg, bad_names[i], "", NULL, &vec), -EINVAL);
        assert_int_equal(kvf_metrics_gauge(reg, bad_names[i], "", &m), -EINVAL);
    }
    assert_int_equal(kvf_metrics_counter(reg, NULL, "", &m), -EINVAL);
    assert_true(kvf_metrics_name_valid("a:b_c9"));
    assert_true(kvf_metrics_name_valid(":x"));
    assert_true(kvf_metrics_name_valid("_"));

    const char *bad_labels[][3] = {{"__reserved", NULL}, {"1a", NULL},  {"a:b", NULL},
                                   {"", NULL},           {"x-y", NULL}, {"dup", "dup", NULL}};
    for (size_t i = 0; i < sizeof(bad_labels) / sizeof(bad_labels[0]); i++)
        assert_int_equal(kvf_metrics_counter_vec(reg, "ok_total", "", bad_labels[i], &vec),
                         -EINVAL);
    assert_true(kvf_metrics_label_name_valid("_a"));
    assert_false(kvf_metrics_label_name_valid("__a"));

    const double bounds[] = {1, 2};
    assert_int_equal(
        kvf_metrics_histogram_vec(reg, "h", "", (const char *[]){"le", NULL}, bounds, 2, &vec),
        -EINVAL);
    const double unsorted[] = {2, 1}, equal[] = {1, 1}, nan_b[] = {NAN}, inf_b[] = {1, INFINITY};
    assert_int_equal(kvf_metrics_histogram(reg, "h", "", unsorted, 2, &m), -EINVAL);
    assert_int_equal(kvf_metrics_histogram(reg, "h", "", equal, 2, &m), -EINVAL);
    assert_int_equal(kvf_metrics_histogram(reg, "h", "", nan_b, 1, &m), -EINVAL);
    assert_int_equal(kvf_metrics_histogram(reg, "h", "", inf_b, 2, &m), -EINVAL);
    assert_int_equal(kvf_metrics_histogram(reg, "h", "", NULL, 1, &m), -EINVAL);
    assert_int_equal(kvf_metrics_counter(NULL, "x", "", &m), -EINVAL);
    assert_int_equal(kvf_metrics_counter(reg, "x", "", NULL), -EINVAL);
    assert_ptr_equal(vec, (struct kvf_metric_vec *)0x1);
    assert_ptr_equal(m, (struct kvf_metric *)0x1);

    /* A second family of the same name, whatever its type. */
    struct kvf_metric *ok;
    assert_int_equal(kvf_metrics_counter(reg, "twice", "", &ok), 0);
    assert_int_equal(kvf_metrics_gauge(reg, "twice", "", &m), -EEXIST);
    assert_int_equal(kvf_metrics_counter_vec(reg, "twice", "", NULL, &vec), -EEXIST);

    /* Label values: NULL, a NULL array, invalid UTF-8. */
    assert_int_equal(
        kvf_metrics_counter_vec(reg, "v_total", "", (const char *[]){"a", "b", NULL}, &vec), 0);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"x", NULL}, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(vec, NULL, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"x", "\xff"}, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"x", "\xc0\xaf"}, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"x", "\xed\xa0\x80"}, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"x", "\xe2\x82"}, &m), -EINVAL);
    assert_int_equal(kvf_metric_child(NULL, (const char *[]){"x", "y"}, &m), -EINVAL);
    assert_ptr_equal(m, (struct kvf_metric *)0x1);
    assert_int_equal(
        kvf_metric_child(vec, (const char *[]){"\xc3\xa9t\xc3\xa9", "\xf0\x9f\x98\x80"}, &m), 0);
    kvf_counter_inc(m);
    char *text = render(reg);
    assert_non_null(strstr(text, "v_total{a=\"\xc3\xa9t\xc3\xa9\",b=\"\xf0\x9f\x98\x80\"} 1\n"));
    free(text);
    kvf_metrics_destroy(reg);
}

static void child_cap_is_e2big(void **state)
{
    (void)state;
    struct kvf_metrics_opts opts;
    kvf_metrics_opts_init(&opts);
    assert_int_equal(opts.max_children, KVF_METRICS_DEFAULT_MAX_CHILDREN);
    opts.max_children = 2;
    struct kvf_metrics *reg = kvf_metrics_create(&opts);
    struct kvf_metric_vec *vec;
    assert_int_equal(kvf_metrics_counter_vec(reg, "c_total", "", (const char *[]){"k", NULL}, &vec),
                     0);
    struct kvf_metric *a, *b, *c, *a2;
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"a"}, &a), 0);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"b"}, &b), 0);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"c"}, &c), -E2BIG);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"a"}, &a2), 0);
    assert_ptr_equal(a, a2);
    kvf_metrics_destroy(reg);
}

static void many_children_keep_identity(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric_vec *vec;
    assert_int_equal(
        kvf_metrics_counter_vec(reg, "c_total", "", (const char *[]){"a", "b", NULL}, &vec), 0);
    struct kvf_metric *kids[300];
    char x[16], y[16];
    for (int i = 0; i < 300; i++) {
        snprintf(x, sizeof(x), "%d", i / 10);
        snprintf(y, sizeof(y), "%d", i % 10);
        assert_int_equal(kvf_metric_child(vec, (const char *[]){x, y}, &kids[i]), 0);
        kvf_counter_add(kids[i], (uint64_t)i);
    }
    /* ("1","23") and ("12","3") are different children. */
    struct kvf_metric *p, *q;
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"1", "23"}, &p), 0);
    assert_int_equal(kvf_metric_child(vec, (const char *[]){"12", "3"}, &q), 0);
    assert_ptr_not_equal(p, q);
    for (int i = 0; i < 300; i++) {
        struct kvf_metric *m;
        snprintf(x, sizeof(x), "%d", i / 10);
        snprintf(y, sizeof(y), "%d", i % 10);
        assert_int_equal(kvf_metric_child(vec, (const char *[]){x, y}, &m), 0);
        assert_ptr_equal(m, kids[i]);
        assert_int_equal(kvf_counter_value(m), (uint64_t)i);
    }
    kvf_metrics_destroy(reg);
}

/* ---- collectors ---- */

struct rooms_ctx {
    int calls;
    int rc_bad_name, rc_bad_label, rc_odd, rc_registered, rc_came_back, rc_other_type;
};

static void rooms_collector(void *ctx, struct kvf_metrics_writer *w)
{
    struct rooms_ctx *rc = ctx;
    rc->calls++;
    assert_int_equal(kvf_metrics_write_gauge(w, "kvfence_rooms", "Rooms by state.",
                                             (const char *[]){"state", "ACTIVE", NULL}, 3),
                     0);
    assert_int_equal(kvf_metrics_write_gauge(w, "kvfence_rooms", "ignored",
                                             (const char *[]){"state", "JOIN\"ING", NULL}, 1),
                     0);
    rc->rc_other_type = kvf_metrics_write_counter(w, "kvfence_rooms", "", NULL, 1);
    rc->rc_bad_name = kvf_metrics_write_gauge(w, "bad-name", "", NULL, 1);
    rc->rc_bad_label = kvf_metrics_write_gauge(w, "x", "", (const char *[]){"__x", "v", NULL}, 1);
    rc->rc_odd = kvf_metrics_write_gauge(w, "x", "", (const char *[]){"k", NULL}, 1);
    rc->rc_registered = kvf_metrics_write_gauge(w, "kvfence_registered", "", NULL, 1);
    assert_int_equal(kvf_metrics_write_counter(w, "kvfence_collects_total", "Collections.", NULL,
                                               (double)rc->calls),
                     0);
    rc->rc_came_back = kvf_metrics_write_gauge(w, "kvfence_rooms", "", NULL, 1);
}

static void other_collector(void *ctx, struct kvf_metrics_writer *w)
{
    struct kvf_metrics *reg = ctx;
    /* A collector may look up children and update them. */
    struct kvf_metric_vec *vec;
    int rc = kvf_metrics_gauge_vec(reg, "kvfence_from_collector", "", NULL, &vec);
    assert_true(rc == 0 || rc == -EEXIST);
    assert_int_equal(kvf_metrics_write_gauge(w, "kvfence_other", "", NULL, 0.25), 0);
}

static void collector_output_included(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric *g;
    assert_int_equal(kvf_metrics_gauge(reg, "kvfence_registered", "r", &g), 0);
    struct rooms_ctx rooms = {0};
    assert_int_equal(kvf_metrics_add_collector(reg, rooms_collector, &rooms), 0);
    assert_int_equal(kvf_metrics_add_collector(reg, other_collector, reg), 0);
    assert_int_equal(kvf_metrics_add_collector(reg, NULL, reg), -EINVAL);
    assert_render(reg, "# HELP kvfence_registered r\n"
                       "# TYPE kvfence_registered gauge\n"
                       "kvfence_registered 0\n"
                       "# HELP kvfence_rooms Rooms by state.\n"
                       "# TYPE kvfence_rooms gauge\n"
                       "kvfence_rooms{state=\"ACTIVE\"} 3\n"
                       "kvfence_rooms{state=\"JOIN\\\"ING\"} 1\n"
                       "# HELP kvfence_collects_total Collections.\n"
                       "# TYPE kvfence_collects_total counter\n"
                       "kvfence_collects_total 1\n"
                       "# TYPE kvfence_other gauge\n"
                       "kvfence_other 0.25\n");
    assert_int_equal(rooms.calls, 1);
    assert_int_equal(rooms.rc_other_type, -EEXIST);
    assert_int_equal(rooms.rc_bad_name, -EINVAL);
    assert_int_equal(rooms.rc_bad_label, -EINVAL);
    assert_int_equal(rooms.rc_odd, -EINVAL);
    assert_int_equal(rooms.rc_registered, -EEXIST);
    assert_int_equal(rooms.rc_came_back, -EEXIST);

    /* Each render starts afresh; a removed collector is not called again. */
    assert_int_equal(kvf_metrics_remove_collector(reg, rooms_collector, &rooms), 0);
    assert_int_equal(kvf_metrics_remove_collector(reg, rooms_collector, &rooms), -ENOENT);
    assert_render(reg, "# HELP kvfence_registered r\n"
                       "# TYPE kvfence_registered gauge\n"
                       "kvfence_registered 0\n"
                       "# TYPE kvfence_other gauge\n"
                       "kvfence_other 0.25\n");
    assert_int_equal(rooms.calls, 1);
    kvf_metrics_destroy(reg); /* frees the collector still added */
}

/* A histogram whose buckets its source keeps (the WAL's fsync latency):
 * written by a collector with the histogram type, le last, _sum optional. */
struct hist_ctx {
    int rc_le_label, rc_decreasing, rc_bounds, rc_over, rc_other_type;
};

static void hist_collector(void *ctx, struct kvf_metrics_writer *w)
{
    struct hist_ctx *hc = ctx;
    static const double bounds[] = {0.001, 0.5};
    static const uint64_t cum[] = {2, 5};
    assert_int_equal(kvf_metrics_write_histogram(w, "wal_fsync_seconds", "Fsyncs.",
                                                 (const char *[]){"disk", "a", NULL}, bounds, cum,
                                                 2, 7, NAN),
                     0);
    assert_int_equal(kvf_metrics_write_histogram(w, "wal_fsync_seconds", "",
                                                 (const char *[]){"disk", "b", NULL}, bounds, cum,
                                                 2, 5, 1.25),
                     0);
    hc->rc_other_type = kvf_metrics_write_gauge(w, "wal_fsync_seconds", "", NULL, 1);
    hc->rc_le_label = kvf_metrics_write_histogram(w, "h2", "", (const char *[]){"le", "1", NULL},
                                                  bounds, cum, 2, 7, NAN);
    hc->rc_decreasing =
        kvf_metrics_write_histogram(w, "h3", "", NULL, bounds, (const uint64_t[]){5, 2}, 2, 7, NAN);
    hc->rc_bounds =
        kvf_metrics_write_histogram(w, "h4", "", NULL, (const double[]){0.5, 0.5}, cum, 2, 7, NAN);
    hc->rc_over = kvf_metrics_write_histogram(w, "h5", "", NULL, bounds, cum, 2, 4, NAN);
    assert_int_equal(kvf_metrics_write_histogram(w, "h_inf_only", "", NULL, NULL, NULL, 0, 3, 0.5),
                     0);
}

static void collector_histogram_exact_text(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct hist_ctx hc = {0};
    assert_int_equal(kvf_metrics_add_collector(reg, hist_collector, &hc), 0);
    assert_render(reg, "# HELP wal_fsync_seconds Fsyncs.\n"
                       "# TYPE wal_fsync_seconds histogram\n"
                       "wal_fsync_seconds_bucket{disk=\"a\",le=\"0.001\"} 2\n"
                       "wal_fsync_seconds_bucket{disk=\"a\",le=\"0.5\"} 5\n"
                       "wal_fsync_seconds_bucket{disk=\"a\",le=\"+Inf\"} 7\n"
                       "wal_fsync_seconds_count{disk=\"a\"} 7\n"
                       "wal_fsync_seconds_bucket{disk=\"b\",le=\"0.001\"} 2\n"
                       "wal_fsync_seconds_bucket{disk=\"b\",le=\"0.5\"} 5\n"
                       "wal_fsync_seconds_bucket{disk=\"b\",le=\"+Inf\"} 5\n"
                       "wal_fsync_seconds_sum{disk=\"b\"} 1.25\n"
                       "wal_fsync_seconds_count{disk=\"b\"} 5\n"
                       "# TYPE h_inf_only histogram\n"
                       "h_inf_only_bucket{le=\"+Inf\"} 3\n"
                       "h_inf_only_sum 0.5\n"
                       "h_inf_only_count 3\n");
    assert_int_equal(hc.rc_other_type, -EEXIST);
    assert_int_equal(hc.rc_le_label, -EINVAL);
    assert_int_equal(hc.rc_decreasing, -EINVAL);
    assert_int_equal(hc.rc_bounds, -EINVAL);
    assert_int_equal(hc.rc_over, -EINVAL);
    kvf_metrics_destroy(reg);
}

/* kvfence_build_info and process_*: read from /proc, so the values are
 * checked against what this test can see of itself. */
static void process_metrics_from_proc(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    assert_int_equal(kvf_metrics_process_add(NULL, "1"), -EINVAL);
    assert_int_equal(kvf_metrics_process_add(reg, "1.2.3-test"), 0);
    assert_int_equal(kvf_metrics_process_add(reg, "again"), -EEXIST);
    /* Burn a little CPU, open descriptors: the numbers must move. */
    struct kvf_metrics_process_stats a, b;
    assert_int_equal(kvf_metrics_process_read(&a), 0);
    volatile double x = 0;
    for (long i = 0; i < 40000000; i++)
        x += (double)i * 1e-9;
    assert_true(x > 0);
    int fds[8];
    for (int i = 0; i < 8; i++)
        fds[i] = dup(2);
    assert_int_equal(kvf_metrics_process_read(&b), 0);
    assert_true(b.cpu_seconds > a.cpu_seconds);
    assert_true(b.open_fds >= a.open_fds + 8);
    struct timeval now;
    gettimeofday(&now, NULL);
    assert_true(b.start_time_seconds <= (double)now.tv_sec + 1);
    assert_true(b.start_time_seconds > (double)now.tv_sec - 3600);
    assert_true(b.resident_bytes > 1024 * 1024);
    assert_true(b.virtual_bytes >= b.resident_bytes);
    char *text = render(reg);
    assert_non_null(strstr(text, "# TYPE kvfence_build_info gauge\n"
                                 "kvfence_build_info{version=\"1.2.3-test\"} 1\n"));
    assert_non_null(strstr(text, "# TYPE process_cpu_seconds_total counter\n"));
    assert_non_null(strstr(text, "# TYPE process_resident_memory_bytes gauge\n"));
    assert_non_null(strstr(text, "# TYPE process_open_fds gauge\n"));
    assert_non_null(strstr(text, "# TYPE process_start_time_seconds gauge\n"));
    /* The rendered fd count is this process's, with the 8 dups open. */
    const char *p = strstr(text, "\nprocess_open_fds ");
    assert_non_null(p);
    double rendered = strtod(p + strlen("\nprocess_open_fds "), NULL);
    assert_true(rendered >= b.open_fds - 1 && rendered <= b.open_fds + 1);
    free(text);
    for (int i = 0; i < 8; i++)
        close(fds[i]);
    kvf_metrics_destroy(reg);
}

/* ---- concurrency ---- */

#define N_THREADS 4
#define N_ITERS   200000

struct hammer {
    struct kvf_metric_vec *counters;
    struct kvf_metric_vec *per_thread;
    struct kvf_metric *gauge;
    struct kvf_metric *hist;
    int id;
};

static void *hammer_thread(void *arg)
{
    struct hammer *h = arg;
    struct kvf_metric *c;
    if (kvf_metric_child(h->counters, (const char *[]){"shared"}, &c) < 0)
        return (void *)1;
    for (int i = 0; i < N_ITERS; i++) {
        kvf_counter_inc(c);
        kvf_gauge_add(h->gauge, 1.0);
        kvf_histogram_observe(h->hist, (i & 1) ? 0.5 : 2.0);
        if (i % 4000 == 0) { /* child creation races with the others */
            char v[32];
            struct kvf_metric *m;
            snprintf(v, sizeof(v), "t%d-%d", h->id, i / 4000);
            if (kvf_metric_child(h->per_thread, (const char *[]){v}, &m) < 0)
                return (void *)1;
            kvf_counter_inc(m);
        }
    }
    return NULL;
}

static uint64_t line_value(const char *text, const char *prefix)
{
    const char *p = strstr(text, prefix);
    assert_non_null(p);
    return strtoull(p + strlen(prefix), NULL, 10);
}

static void concurrent_updates_sum(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct hammer hs[N_THREADS];
    struct kvf_metric_vec *counters, *per_thread;
    struct kvf_metric *gauge, *hist;
    const double bounds[] = {1};
    assert_int_equal(
        kvf_metrics_counter_vec(reg, "ops_total", "", (const char *[]){"k", NULL}, &counters), 0);
    assert_int_equal(kvf_metrics_counter_vec(reg, "per_thread_total", "",
                                             (const char *[]){"t", NULL}, &per_thread),
                     0);
    assert_int_equal(kvf_metrics_gauge(reg, "level", "", &gauge), 0);
    assert_int_equal(kvf_metrics_histogram(reg, "lat", "", bounds, 1, &hist), 0);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        hs[i] = (struct hammer){counters, per_thread, gauge, hist, i};
        assert_int_equal(pthread_create(&th[i], NULL, hammer_thread, &hs[i]), 0);
    }
    for (int i = 0; i < 20; i++) /* renders race with the updates */
        free(render(reg));
    for (int i = 0; i < N_THREADS; i++) {
        void *ret;
        assert_int_equal(pthread_join(th[i], &ret), 0);
        assert_null(ret);
    }
    struct kvf_metric *c;
    assert_int_equal(kvf_metric_child(counters, (const char *[]){"shared"}, &c), 0);
    assert_int_equal(kvf_counter_value(c), (uint64_t)N_THREADS * N_ITERS);
    assert_true(kvf_gauge_value(gauge) == (double)N_THREADS * N_ITERS);
    char *text = render(reg);
    assert_int_equal(line_value(text, "lat_bucket{le=\"1\"} "), N_THREADS * N_ITERS / 2);
    assert_int_equal(line_value(text, "lat_bucket{le=\"+Inf\"} "), N_THREADS * N_ITERS);
    assert_int_equal(line_value(text, "lat_count "), N_THREADS * N_ITERS);
    const char *sum = strstr(text, "lat_sum ");
    assert_non_null(sum);
    assert_true(strtod(sum + 8, NULL) == N_THREADS * N_ITERS / 2 * 2.5); /* "1e+06" */
    /* Every thread made N_ITERS / 4000 children of its own. */
    size_t n = 0;
    for (const char *p = text; (p = strstr(p, "per_thread_total{")); p++)
        n++;
    assert_int_equal(n, N_THREADS * (N_ITERS / 4000));
    free(text);
    kvf_metrics_destroy(reg);
}

/* ---- allocation failure sweep ---- */

static void sweep_collector(void *ctx, struct kvf_metrics_writer *w)
{
    (void)ctx;
    for (int i = 0; i < 12; i++) {
        char v[16];
        snprintf(v, sizeof(v), "s%d", i);
        int rc =
            kvf_metrics_write_gauge(w, "sweep_rooms", "", (const char *[]){"state", v, NULL}, i);
        assert_true(rc == 0 || rc == -ENOMEM);
    }
}

/* One run of every allocating call; each either works or says -ENOMEM. */
static void sweep_once(void)
{
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    if (!reg)
        return;
    struct kvf_metric_vec *vec;
    struct kvf_metric *m;
    int rc = kvf_metrics_counter_vec(reg, "a_total", "help",
                                     (const char *[]){"method", "code", NULL}, &vec);
    assert_true(rc == 0 || rc == -ENOMEM);
    if (rc == 0) {
        for (int i = 0; i < 20; i++) { /* grows the hash table twice */
            char v[16];
            snprintf(v, sizeof(v), "m%d", i);
            rc = kvf_metric_child(vec, (const char *[]){v, "OK"}, &m);
            assert_true(rc == 0 || rc == -ENOMEM);
            kvf_counter_inc(rc == 0 ? m : NULL);
        }
    }
    const double bounds[] = {1, 2, 3};
    rc = kvf_metrics_histogram(reg, "h", "help", bounds, 3, &m);
    assert_true(rc == 0 || rc == -ENOMEM);
    rc = kvf_metrics_gauge(reg, "g", "help", &m);
    assert_true(rc == 0 || rc == -ENOMEM);
    rc = kvf_metrics_add_collector(reg, sweep_collector, NULL);
    assert_true(rc == 0 || rc == -ENOMEM);
    char *text = NULL;
    rc = kvf_metrics_render(reg, &text, NULL);
    assert_true(rc == 0 || rc == -ENOMEM);
    if (rc == 0)
        assert_non_null(text);
    else
        assert_null(text);
    free(text);
    kvf_metrics_destroy(reg);
}

static void allocation_failure_sweep(void **state)
{
    (void)state;
    for (fail_at = 0;; fail_at++) {
        alloc_index = 0;
        failures = 0;
        sweep_once();
        if (failures == 0)
            break; /* this run needed fewer allocations than fail_at: all covered */
    }
    assert_true(fail_at > 50);
    fail_at = -1;
}

/* ---- HTTP ---- */

/* Sends `request` to 127.0.0.1:port and reads the whole answer (the server
 * closes an HTTP/1.0 connection after it). Returns a malloc'd string. */
static char *http_exchange(uint16_t port, const char *request)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(port)};
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
    size_t len = strlen(request);
    assert_int_equal(send(fd, request, len, MSG_NOSIGNAL), (ssize_t)len);
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        assert_true(r >= 0); /* a timeout fails the test */
        if (r == 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    close(fd);
    return buf;
}

static void assert_status(const char *resp, int code)
{
    char want[16];
    snprintf(want, sizeof(want), " %d ", code);
    assert_true(strncmp(resp, "HTTP/1.", 7) == 0);
    assert_true(strncmp(resp + 8, want, strlen(want)) == 0);
}

static const char *find_header(const char *resp, const char *name)
{
    size_t n = strlen(name);
    for (const char *line = strstr(resp, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
        if (line[2] == '\r')
            return NULL; /* end of headers */
        if (strncasecmp(line + 2, name, n) == 0 && line[2 + n] == ':')
            return line + 2 + n + 1 + strspn(line + 2 + n + 1, " ");
    }
    return NULL;
}

static const char *body_of(const char *resp)
{
    const char *p = strstr(resp, "\r\n\r\n");
    assert_non_null(p);
    return p + 4;
}

static void http_collector(void *ctx, struct kvf_metrics_writer *w)
{
    (void)ctx;
    kvf_metrics_write_gauge(w, "kvfence_from_http_thread", "", NULL, 1);
}

static void http_serves_metrics(void **state)
{
    (void)state;
    int threads_before = count_threads();
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metric *c;
    assert_int_equal(kvf_metrics_counter(reg, "kvfence_test_total", "t", &c), 0);
    kvf_counter_add(c, 5);
    assert_int_equal(kvf_metrics_add_collector(reg, http_collector, NULL), 0);

    struct kvf_metrics_http_opts opts;
    kvf_metrics_http_opts_init(&opts);
    assert_string_equal(opts.listen_addr, "127.0.0.1:0");
    struct kvf_metrics_http *srv = NULL;
    uint16_t port = 0;
    assert_int_equal(kvf_metrics_http_start(reg, &opts, &srv, &port), 0);
    assert_non_null(srv);
    assert_true(port != 0);
    assert_int_equal(kvf_metrics_http_port(srv), port);

    char *resp = http_exchange(port, "GET /metrics HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    const char *ct = find_header(resp, "Content-Type");
    assert_non_null(ct);
    assert_true(strncmp(ct, "text/plain; version=0.0.4", 25) == 0);
    const char *body = body_of(resp);
    assert_non_null(strstr(body, "# TYPE kvfence_test_total counter\nkvfence_test_total 5\n"));
    assert_non_null(strstr(body, "\nkvfence_from_http_thread 1\n"));
    free(resp);

    resp = http_exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    assert_string_equal(body_of(resp), "ok");
    free(resp);

    resp = http_exchange(port, "GET /nope HTTP/1.0\r\n\r\n");
    assert_status(resp, 404);
    free(resp);

    resp = http_exchange(port, "GET /metrics/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_status(resp, 404);
    free(resp);

    resp = http_exchange(port, "POST /metrics HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc");
    assert_status(resp, 405);
    const char *allow = find_header(resp, "Allow");
    assert_non_null(allow);
    assert_true(strncmp(allow, "GET, HEAD", 9) == 0);
    free(resp);

    resp = http_exchange(port, "DELETE /healthz HTTP/1.0\r\n\r\n");
    assert_status(resp, 405);
    free(resp);

    resp = http_exchange(port, "HEAD /metrics HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    assert_string_equal(body_of(resp), "");
    free(resp);

    /* The port is taken: a second server on it fails. */
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    opts.listen_addr = addr;
    struct kvf_metrics_http *srv2 = (struct kvf_metrics_http *)0x1;
    int rc = kvf_metrics_http_start(reg, &opts, &srv2, NULL);
    assert_int_equal(rc, -EADDRINUSE);
    assert_ptr_equal(srv2, (struct kvf_metrics_http *)0x1);

    kvf_metrics_http_stop(srv);
    kvf_metrics_http_stop(NULL);
    /* Nothing listens any more, and the MHD thread is gone. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(port)};
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sin, sizeof(sin)), -1);
    assert_int_equal(errno, ECONNREFUSED);
    close(fd);
    assert_int_equal(count_threads(), threads_before);
    kvf_metrics_destroy(reg);
}

static void http_bad_addresses_refused(void **state)
{
    (void)state;
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    struct kvf_metrics_http_opts opts;
    kvf_metrics_http_opts_init(&opts);
    const char *bad[] = {"localhost:80", "1.2.3.4:99999", "::1:80",  "[::1]80",
                         "127.0.0.1:",   "127.0.0.1:x",   "[::1:80", "1.2.3.4:-1"};
    struct kvf_metrics_http *srv = (struct kvf_metrics_http *)0x1;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        opts.listen_addr = bad[i];
        assert_int_equal(kvf_metrics_http_start(reg, &opts, &srv, NULL), -EINVAL);
    }
    assert_int_equal(kvf_metrics_http_start(NULL, NULL, &srv, NULL), -EINVAL);
    assert_int_equal(kvf_metrics_http_start(reg, NULL, NULL, NULL), -EINVAL);
    assert_ptr_equal(srv, (struct kvf_metrics_http *)0x1);

    /* NULL opts and a bare port mean 127.0.0.1. */
    uint16_t port;
    assert_int_equal(kvf_metrics_http_start(reg, NULL, &srv, &port), 0);
    char *resp = http_exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    free(resp);
    kvf_metrics_http_stop(srv);
    opts.listen_addr = "0";
    assert_int_equal(kvf_metrics_http_start(reg, &opts, &srv, &port), 0);
    resp = http_exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    free(resp);
    kvf_metrics_http_stop(srv);

    /* IPv6 loopback, where the host has it. */
    opts.listen_addr = "[::1]:0";
    if (kvf_metrics_http_start(reg, &opts, &srv, &port) == 0) {
        assert_true(port != 0);
        kvf_metrics_http_stop(srv);
    }
    kvf_metrics_destroy(reg);
}

/* kvf_metrics_http_serve(): the start every daemon does. The port lands in
 * the port file; an endpoint that cannot start is no error (the daemon runs
 * on without metrics); a port file that cannot be written is one, and leaves
 * nothing listening. */
static void http_serve_writes_port_file(void **state)
{
    (void)state;
    int threads_before = count_threads();
    struct kvf_metrics *reg = kvf_metrics_create(NULL);
    char dir[] = "/tmp/kvf-metrics-serve-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char pf[64];
    snprintf(pf, sizeof(pf), "%s/metrics.port", dir);

    struct kvf_metrics_http *srv = NULL;
    assert_int_equal(kvf_metrics_http_serve(reg, "127.0.0.1:0", pf, &srv), 0);
    assert_non_null(srv);
    uint16_t port = kvf_metrics_http_port(srv);
    assert_true(port != 0);
    FILE *f = fopen(pf, "r");
    assert_non_null(f);
    char line[32] = {0};
    assert_non_null(fgets(line, sizeof(line), f));
    fclose(f);
    char want[32];
    snprintf(want, sizeof(want), "%u\n", (unsigned)port);
    assert_string_equal(line, want);
    char *resp = http_exchange(port, "GET /healthz HTTP/1.0\r\n\r\n");
    assert_status(resp, 200);
    free(resp);

    /* The port is taken: logged, no error, no server. */
    char addr[32];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", (unsigned)port);
    struct kvf_metrics_http *srv2 = (struct kvf_metrics_http *)0x1;
    assert_int_equal(kvf_metrics_http_serve(reg, addr, NULL, &srv2), 0);
    assert_null(srv2);
    kvf_metrics_http_stop(srv);
    assert_int_equal(unlink(pf), 0);

    /* No address, or no registry: nothing to serve. */
    srv2 = (struct kvf_metrics_http *)0x1;
    assert_int_equal(kvf_metrics_http_serve(reg, NULL, pf, &srv2), 0);
    assert_null(srv2);
    srv2 = (struct kvf_metrics_http *)0x1;
    assert_int_equal(kvf_metrics_http_serve(NULL, "127.0.0.1:0", pf, &srv2), 0);
    assert_null(srv2);
    assert_int_equal(access(pf, F_OK), -1);
    assert_int_equal(kvf_metrics_http_serve(reg, "127.0.0.1:0", NULL, NULL), -EINVAL);

    /* A port file that cannot be written: an error, the server stopped and
     * the output untouched. */
    char bad[80];
    snprintf(bad, sizeof(bad), "%s/no-such-dir/metrics.port", dir);
    srv2 = (struct kvf_metrics_http *)0x1;
    assert_int_equal(kvf_metrics_http_serve(reg, "127.0.0.1:0", bad, &srv2), -ENOENT);
    assert_ptr_equal(srv2, (struct kvf_metrics_http *)0x1);
    assert_int_equal(count_threads(), threads_before);
    assert_int_equal(rmdir(dir), 0);
    kvf_metrics_destroy(reg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(empty_registry_renders_nothing),
        cmocka_unit_test(counter_exact_text),
        cmocka_unit_test(labelled_counter_escapes),
        cmocka_unit_test(gauge_exact_text),
        cmocka_unit_test(histogram_exact_text),
        cmocka_unit_test(wrong_type_and_null_are_noops),
        cmocka_unit_test(invalid_names_refused),
        cmocka_unit_test(child_cap_is_e2big),
        cmocka_unit_test(many_children_keep_identity),
        cmocka_unit_test(collector_output_included),
        cmocka_unit_test(collector_histogram_exact_text),
        cmocka_unit_test(process_metrics_from_proc),
        cmocka_unit_test(concurrent_updates_sum),
        cmocka_unit_test(allocation_failure_sweep),
        cmocka_unit_test(http_serves_metrics),
        cmocka_unit_test(http_bad_addresses_refused),
        cmocka_unit_test(http_serve_writes_port_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
