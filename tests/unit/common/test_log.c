/*
 * test_log.c: kvf_log's lines parsed back as JSON (a small strict parser of
 * flat objects below), the schema and field order, escaping, level filtering,
 * the stderr path, and lines from many threads at once.
 */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvf_log.h"

/* ---- a strict parser of one flat JSON object ------------------------------ */

#define JMAX_FIELDS 16

struct jfield {
    char key[32];
    bool is_str;
    char val[8192]; /* a string decoded, or a number's text */
};

struct jobj {
    struct jfield f[JMAX_FIELDS];
    int n;
};

static bool jstring(const char **pp, char *out, size_t cap)
{
    const char *p = *pp;
    size_t o = 0;
    if (*p++ != '"')
        return false;
    for (;;) {
        unsigned char c = (unsigned char)*p++;
        if (c == '"')
            break;
        if (c < 0x20 || o + 2 >= cap)
            return false; /* raw control characters are not JSON */
        if (c != '\\') {
            out[o++] = (char)c;
            continue;
        }
        c = (unsigned char)*p++;
        switch (c) {
        case '"':
        case '\\':
        case '/':
            out[o++] = (char)c;
            break;
        case 'n':
            out[o++] = '\n';
            break;
        case 'r':
            out[o++] = '\r';
            break;
        case 't':
            out[o++] = '\t';
            break;
        case 'b':
            out[o++] = '\b';
            break;
        case 'f':
            out[o++] = '\f';
            break;
        case 'u': {
            unsigned v = 0;
            for (int i = 0; i < 4; i++) {
                char h = *p++;
                v <<= 4;
                if (h >= '0' && h <= '9')
                    v |= (unsigned)(h - '0');
                else if (h >= 'a' && h <= 'f')
                    v |= (unsigned)(h - 'a' + 10);
                else if (h >= 'A' && h <= 'F')
                    v |= (unsigned)(h - 'A' + 10);
                else
                    return false;
            }
            if (v > 0x7f)
                return false; /* the logger escapes control characters only */
            out[o++] = (char)v;
            break;
        }
        default:
            return false;
        }
    }
    out[o] = '\0';
    *pp = p;
    return true;
}

/* Parses `line` (one object, then '\n', then the end) into *o. */
static bool jparse(const char *line, struct jobj *o)
{
    const char *p = line;
    o->n = 0;
    if (*p++ != '{')
        return false;
    if (*p == '}')
        return p[1] == '\n' && p[2] == '\0';
    for (;;) {
        if (o->n == JMAX_FIELDS)
            return false;
        struct jfield *f = &o->f[o->n++];
        if (!jstring(&p, f->key, sizeof f->key) || *p++ != ':')
            return false;
        if (*p == '"') {
            f->is_str = true;
            if (!jstring(&p, f->val, sizeof f->val))
                return false;
        } else {
            size_t k = 0;
            if (*p == '-')
                f->val[k++] = *p++;
            if (*p < '0' || *p > '9')
                return false;
            while ((*p >= '0' && *p <= '9') || *p == '.')
                f->val[k++] = *p++;
            f->val[k] = '\0';
            f->is_str = false;
        }
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p++ != '}')
            return false;
        break;
    }
    return p[0] == '\n' && p[1] == '\0';
}

static const struct jfield *jget(const struct jobj *o, const char *key)
{
    for (int i = 0; i < o->n; i++)
        if (strcmp(o->f[i].key, key) == 0)
            return &o->f[i];
    return NULL;
}

/* ---- capture -------------------------------------------------------------- */

struct capture {
    char lines[64][16384];
    int n;
    int overflow;
};

static void capture_fn(void *arg, const char *line, size_t len)
{
    struct capture *c = arg;
    assert_int_equal(strlen(line), len);
    if (c->n == 64 || len >= sizeof c->lines[0]) {
        c->overflow++;
        return;
    }
    memcpy(c->lines[c->n++], line, len + 1);
}

static struct capture cap;
static struct jobj obj;

static int setup(void **state)
{
    (void)state;
    memset(&cap, 0, sizeof cap);
    kvf_log_set_level(KVF_LOG_INFO);
    kvf_log_set_proc(NULL);
    kvf_log_set_sink(capture_fn, &cap);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvf_log_set_sink(NULL, NULL);
    kvf_log_set_proc(NULL);
    kvf_log_set_level(KVF_LOG_INFO);
    return 0;
}

static const struct jobj *parse_line(int i)
{
    assert_true(i < cap.n);
    if (!jparse(cap.lines[i], &obj))
        fail_msg("not one JSON object on one line: %s", cap.lines[i]);
    return &obj;
}

static void assert_str_field(const struct jobj *o, const char *key, const char *want)
{
    const struct jfield *f = jget(o, key);
    if (f == NULL)
        fail_msg("no field '%s'", key);
    assert_true(f->is_str);
    assert_string_equal(f->val, want);
}

/* ---- tests ---------------------------------------------------------------- */

static void level_names_parse_both_ways(void **state)
{
    (void)state;
    const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++) {
        enum kvf_log_level l = KVF_LOG_ERROR;
        assert_int_equal(kvf_log_level_parse(names[i], &l), 0);
        assert_int_equal(l, i);
        assert_string_equal(kvf_log_level_name(l), names[i]);
    }
    enum kvf_log_level l = KVF_LOG_DEBUG;
    assert_int_equal(kvf_log_level_parse("warning", &l), -EINVAL);
    assert_int_equal(kvf_log_level_parse("INFO", &l), -EINVAL);
    assert_int_equal(kvf_log_level_parse("", &l), -EINVAL);
    assert_int_equal(kvf_log_level_parse(NULL, &l), -EINVAL);
    assert_int_equal(l, KVF_LOG_DEBUG); /* untouched on error */
}

static void a_line_has_the_schema_in_order(void **state)
{
    (void)state;
    kvf_log_set_proc("kvfence-node");
    kvf_log_room("warn", (kvf_room_key){42, 7}, "n1", "room %d: %s", 42, "drained");
    assert_int_equal(cap.n, 1);
    const struct jobj *o = parse_line(0);
    assert_int_equal(o->n, 6);
    const char *order[] = {"ts", "level", "proc", "msg", "room", "node"};
    for (int i = 0; i < 6; i++)
        assert_string_equal(o->f[i].key, order[i]);
    assert_str_field(o, "level", "warn");
    assert_str_field(o, "proc", "kvfence-node");
    assert_str_field(o, "msg", "room 42: drained");
    assert_str_field(o, "room", "42:7");
    assert_str_field(o, "node", "n1");
    /* ts: 2026-12-02T01:02:03.456Z */
    const struct jfield *tsf = jget(o, "ts");
    assert_non_null(tsf);
    const char *ts = tsf->val;
    assert_int_equal(strnlen(ts, sizeof tsf->val), 24);
    assert_true(ts[4] == '-' && ts[7] == '-' && ts[10] == 'T' && ts[13] == ':' && ts[16] == ':' &&
                ts[19] == '.' && ts[23] == 'Z');
}

static void optional_fields_are_left_out(void **state)
{
    (void)state;
    kvf_log("info", "plain");
    kvf_log_node("error", "n2", 5, "lost");
    kvf_log_node("info", "n3", 0, "joined");
    kvf_log_emit(KVF_LOG_INFO, NULL, "emitted");
    assert_int_equal(cap.n, 4);

    const struct jobj *o = parse_line(0);
    assert_int_equal(o->n, 3); /* ts, level, msg: no proc set, no room, no node */
    assert_str_field(o, "msg", "plain");
    assert_null(jget(o, "proc"));

    o = parse_line(1);
    assert_int_equal(o->n, 5);
    assert_str_field(o, "level", "error");
    assert_str_field(o, "node", "n2");
    const struct jfield *inc = jget(o, "incarnation");
    assert_non_null(inc);
    assert_false(inc->is_str);
    assert_string_equal(inc->val, "5");

    o = parse_line(2);
    assert_int_equal(o->n, 4);
    assert_null(jget(o, "incarnation"));
    assert_str_field(parse_line(3), "msg", "emitted");
}

static void messages_are_escaped_and_round_trip(void **state)
{
    (void)state;
    const char *nasty = "say \"hi\"\\ to\nthe\tlog\r\x01\x1f\x7f end";
    kvf_log("info", "%s", nasty);
    kvf_log_node("info", "n\"1\n", 0, "x");
    assert_int_equal(cap.n, 2);
    assert_null(strchr(cap.lines[0], '\r'));
    assert_str_field(parse_line(0), "msg", nasty);
    assert_str_field(parse_line(1), "node", "n\"1\n");
}

static void a_long_message_is_cut_and_stays_json(void **state)
{
    (void)state;
    static char big[4 * KVF_LOG_MSG_MAX];
    /* Quotes everywhere, so that the cut can fall inside an escape. */
    for (size_t i = 0; i + 1 < sizeof big; i++)
        big[i] = (i % 3 == 0) ? '"' : (i % 3 == 1) ? '\x02' : 'a';
    big[sizeof big - 1] = '\0';
    kvf_log("info", "%s", big);
    assert_int_equal(cap.n, 1);
    const struct jfield *msg = jget(parse_line(0), "msg");
    assert_non_null(msg);
    const char *text = msg->val;
    assert_int_equal(strnlen(text, sizeof msg->val), KVF_LOG_MSG_MAX);
    assert_memory_equal(text, big, KVF_LOG_MSG_MAX);
}

static void levels_below_the_threshold_are_dropped(void **state)
{
    (void)state;
    assert_int_equal(kvf_log_get_level(), KVF_LOG_INFO);
    assert_false(kvf_log_enabled(KVF_LOG_DEBUG));
    assert_true(kvf_log_enabled(KVF_LOG_INFO));
    kvf_log("debug", "hidden");
    kvf_log("info", "shown");
    assert_int_equal(cap.n, 1);

    kvf_log_set_level(KVF_LOG_WARN);
    kvf_log("info", "hidden");
    kvf_log("warn", "w");
    kvf_log("error", "e");
    kvf_log("bogus-level", "an unknown level is an error, never dropped");
    kvf_log_set_level(KVF_LOG_DEBUG);
    kvf_log("debug", "d");
    assert_int_equal(cap.n, 5);
    assert_str_field(parse_line(1), "level", "warn");
    assert_str_field(parse_line(2), "level", "error");
    assert_str_field(parse_line(3), "level", "error");
    assert_str_field(parse_line(4), "level", "debug");
    assert_str_field(parse_line(4), "msg", "d");
}

static void errno_survives_a_log_call(void **state)
{
    (void)state;
    errno = EPIPE;
    kvf_log("error", "write failed");
    assert_int_equal(errno, EPIPE);
}

/* Without a sink the line goes to fd 2, whole, with one write. */
static void lines_go_to_stderr_without_a_sink(void **state)
{
    (void)state;
    kvf_log_set_sink(NULL, NULL);
    char path[] = "/tmp/kvf_test_log_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    unlink(path);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fd, STDERR_FILENO) >= 0);
    kvf_log_set_proc("kvfence-control");
    kvf_log_room("info", (kvf_room_key){1, 2}, NULL, "to stderr");
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);

    char buf[1024] = "";
    ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
    close(fd);
    assert_true(n > 0);
    buf[n] = '\0';
    if (!jparse(buf, &obj))
        fail_msg("stderr line is not one JSON object: %s", buf);
    assert_str_field(&obj, "proc", "kvfence-control");
    assert_str_field(&obj, "msg", "to stderr");
    assert_str_field(&obj, "room", "1:2");
    assert_null(jget(&obj, "node"));
}

/* ---- threads -------------------------------------------------------------- */

#define T_THREADS 8
#define T_LINES   500

struct tcount {
    pthread_mutex_t mu;
    int bad;
    int per_thread[T_THREADS];
};

static void count_fn(void *arg, const char *line, size_t len)
{
    struct tcount *tc = arg;
    static struct jobj o; /* the sink runs under the logger's mutex */
    (void)len;
    int t = -1, i = -1;
    if (!jparse(line, &o) || jget(&o, "msg") == NULL ||
        sscanf(jget(&o, "msg")->val, "thread %d line %d", &t, &i) != 2 || t < 0 || t >= T_THREADS) {
        tc->bad++;
        return;
    }
    tc->per_thread[t]++;
}

static void *log_thread(void *arg)
{
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < T_LINES; i++)
        kvf_log_node("info", "n1", (uint64_t)t + 1, "thread %d line %d", t, i);
    return NULL;
}

static void many_threads_give_whole_lines(void **state)
{
    (void)state;
    struct tcount tc = {.mu = PTHREAD_MUTEX_INITIALIZER};
    kvf_log_set_sink(count_fn, &tc);
    pthread_t th[T_THREADS];
    for (int t = 0; t < T_THREADS; t++)
        assert_int_equal(pthread_create(&th[t], NULL, log_thread, (void *)(intptr_t)t), 0);
    for (int t = 0; t < T_THREADS; t++)
        pthread_join(th[t], NULL);
    kvf_log_set_sink(NULL, NULL);
    assert_int_equal(tc.bad, 0);
    for (int t = 0; t < T_THREADS; t++)
        assert_int_equal(tc.per_thread[t], T_LINES);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(level_names_parse_both_ways, setup, teardown),
        cmocka_unit_test_setup_teardown(a_line_has_the_schema_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(optional_fields_are_left_out, setup, teardown),
        cmocka_unit_test_setup_teardown(messages_are_escaped_and_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(a_long_message_is_cut_and_stays_json, setup, teardown),
        cmocka_unit_test_setup_teardown(levels_below_the_threshold_are_dropped, setup, teardown),
        cmocka_unit_test_setup_teardown(errno_survives_a_log_call, setup, teardown),
        cmocka_unit_test_setup_teardown(lines_go_to_stderr_without_a_sink, setup, teardown),
        cmocka_unit_test_setup_teardown(many_threads_give_whole_lines, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
