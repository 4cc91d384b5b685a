/*
 * kvf_log.c: JSON-lines logging to stderr (schema in kvf_log.h).
 *
 * A line is built in a stack buffer (message, escaping, fields) and handed to
 * the sink in one piece: write(2) of the whole line to stderr, or the test's
 * capture function. The wall clock is read here, once per line, for "ts"; no
 * other module of kvfence needs a wall-clock timestamp for its logs.
 *
 * DESIGN: the threshold is an atomic read on every call, so a dropped event
 * costs one load and no formatting. The sink and its argument change only in
 * tests; they sit under one mutex, held while a line is delivered, so a sink
 * that is being removed never runs afterwards.
 */
#include "kvf_log.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Atomic int g_level = KVF_LOG_INFO;

static pthread_mutex_t g_sink_mu = PTHREAD_MUTEX_INITIALIZER;
static kvf_log_sink_fn g_sink;      /* under g_sink_mu; NULL: stderr */
static void *g_sink_arg;            /* under g_sink_mu */
static char g_proc_esc[64 * 6 + 1]; /* under g_sink_mu: the escaped "proc" value */

static const char *const level_names[] = {"debug", "info", "warn", "error"};

int kvf_log_level_parse(const char *name, enum kvf_log_level *level_p)
{
    if (name == NULL)
        return -EINVAL;
    for (int i = KVF_LOG_DEBUG; i <= KVF_LOG_ERROR; i++) {
        if (strcmp(name, level_names[i]) == 0) {
            *level_p = (enum kvf_log_level)i;
            return 0;
        }
    }
    return -EINVAL;
}

const char *kvf_log_level_name(enum kvf_log_level level)
{
    if ((int)level < KVF_LOG_DEBUG || (int)level > KVF_LOG_ERROR)
        return "error";
    return level_names[level];
}

void kvf_log_set_level(enum kvf_log_level level)
{
    if ((int)level < KVF_LOG_DEBUG)
        level = KVF_LOG_DEBUG;
    if ((int)level > KVF_LOG_ERROR)
        level = KVF_LOG_ERROR;
    atomic_store_explicit(&g_level, (int)level, memory_order_relaxed);
}

enum kvf_log_level kvf_log_get_level(void)
{
    return (enum kvf_log_level)atomic_load_explicit(&g_level, memory_order_relaxed);
}

bool kvf_log_enabled(enum kvf_log_level level)
{
    return (int)level >= atomic_load_explicit(&g_level, memory_order_relaxed);
}

/* Escapes `in` for a JSON string into out[cap]. Stops before an escape that
 * would not fit, so the result is always whole. Returns its length. */
static size_t json_escape(char *out, size_t cap, const char *in)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p != '\0'; p++) {
        unsigned char c = *p;
        char two = 0;
        if (c == '"' || c == '\\')
            two = (char)c;
        else if (c == '\n')
            two = 'n';
        else if (c == '\r')
            two = 'r';
        else if (c == '\t')
            two = 't';
        if (two != 0) {
            if (o + 2 >= cap)
                break;
            out[o++] = '\\';
            out[o++] = two;
        } else if (c < 0x20 || c == 0x7f) {
            if (o + 6 >= cap)
                break;
            memcpy(out + o, "\\u00", 4);
            out[o + 4] = hex[c >> 4];
            out[o + 5] = hex[c & 15];
            o += 6;
        } else {
            if (o + 1 >= cap)
                break;
            out[o++] = (char)c;
        }
    }
    out[o] = '\0';
    return o;
}

void kvf_log_set_proc(const char *name)
{
    char cut[64] = "";
    if (name != NULL)
        snprintf(cut, sizeof cut, "%s", name);
    pthread_mutex_lock(&g_sink_mu);
    json_escape(g_proc_esc, sizeof g_proc_esc, cut);
    pthread_mutex_unlock(&g_sink_mu);
}

void kvf_log_set_sink(kvf_log_sink_fn fn, void *arg)
{
    pthread_mutex_lock(&g_sink_mu);
    g_sink = fn;
    g_sink_arg = arg;
    pthread_mutex_unlock(&g_sink_mu);
}

/* Writes all of buf[len] to stderr; a short write continues, an error ends. */
static void write_stderr(const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, buf, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return;
        buf += w;
        len -= (size_t)w;
    }
}

void kvf_log_emitv(enum kvf_log_level level, const struct kvf_log_fields *fields, const char *fmt,
                   va_list ap)
{
    if (!kvf_log_enabled(level))
        return;
    int saved_errno = errno; /* callers log and then read errno */

    char msg[KVF_LOG_MSG_MAX + 1];
    char esc[KVF_LOG_MSG_MAX * 6 + 1];
    char node_esc[128 * 6 + 1];
    char opt[1024];
    char line[sizeof esc + sizeof opt + 512];

    vsnprintf(msg, sizeof msg, fmt, ap);
    json_escape(esc, sizeof esc, msg);

    /* The optional fields, in schema order. */
    size_t f = 0;
    opt[0] = '\0';
    if (fields != NULL && fields->room != NULL) {
        f += (size_t)snprintf(opt + f, sizeof opt - f, ",\"room\":\"%" PRIu64 ":%" PRIu64 "\"",
                              fields->room->room_id, fields->room->generation);
    }
    if (fields != NULL && fields->node != NULL) {
        char node[129];
        snprintf(node, sizeof node, "%s", fields->node);
        json_escape(node_esc, sizeof node_esc, node);
        f += (size_t)snprintf(opt + f, sizeof opt - f, ",\"node\":\"%s\"", node_esc);
        if (fields->incarnation != 0)
            snprintf(opt + f, sizeof opt - f, ",\"incarnation\":%" PRIu64, fields->incarnation);
    }

    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);

    pthread_mutex_lock(&g_sink_mu);
    char proc[sizeof g_proc_esc + 16] = "";
    if (g_proc_esc[0] != '\0')
        snprintf(proc, sizeof proc, ",\"proc\":\"%s\"", g_proc_esc);
    int n = snprintf(line, sizeof line,
                     "{\"ts\":\"%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ\",\"level\":\"%s\"%s,"
                     "\"msg\":\"%s\"%s}\n",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     ts.tv_nsec / 1000000L, kvf_log_level_name(level), proc, esc, opt);
    if (n > 0 && (size_t)n < sizeof line) {
        if (g_sink != NULL)
            g_sink(g_sink_arg, line, (size_t)n);
        else
            write_stderr(line, (size_t)n);
    }
    pthread_mutex_unlock(&g_sink_mu);
    errno = saved_errno;
}

void kvf_log_emit(enum kvf_log_level level, const struct kvf_log_fields *fields, const char *fmt,
                  ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvf_log_emitv(level, fields, fmt, ap);
    va_end(ap);
}

/* A level by name; an unknown name is an error, so it is never dropped. */
static enum kvf_log_level level_of(const char *name)
{
    enum kvf_log_level level = KVF_LOG_ERROR;
    (void)kvf_log_level_parse(name, &level);
    return level;
}

void kvf_logv(const char *level, const char *fmt, va_list ap)
{
    kvf_log_emitv(level_of(level), NULL, fmt, ap);
}

void kvf_log(const char *level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvf_log_emitv(level_of(level), NULL, fmt, ap);
    va_end(ap);
}

void kvf_log_room(const char *level, kvf_room_key room, const char *node, const char *fmt, ...)
{
    struct kvf_log_fields fields = {.room = &room, .node = node};
    va_list ap;
    va_start(ap, fmt);
    kvf_log_emitv(level_of(level), &fields, fmt, ap);
    va_end(ap);
}

void kvf_log_node(const char *level, const char *node, uint64_t incarnation, const char *fmt, ...)
{
    struct kvf_log_fields fields = {.node = node, .incarnation = incarnation};
    va_list ap;
    va_start(ap, fmt);
    kvf_log_emitv(level_of(level), &fields, fmt, ap);
    va_end(ap);
}
