/*
 * kvf_log.h: the one logger of kvfence, shared by both daemons and every
 * library under them.
 *
 * Each event is one JSON object on one line of stderr, written with a single
 * write(2) so that lines from different threads never interleave:
 *
 *   {"ts":"2026-12-02T01:02:03.456Z","level":"info","proc":"kvfence-node",
 *    "msg":"...","room":"7:3","node":"n1","incarnation":5}
 *
 *   ts           UTC wall-clock time, ISO-8601 with milliseconds (always)
 *   level        "debug", "info", "warn" or "error" (always)
 *   proc         the process name set with kvf_log_set_proc() (when set)
 *   msg          the message, JSON-escaped (always)
 *   room         "room_id:generation" (events about one room-generation)
 *   node         a node id (events about one node)
 *   incarnation  that node's incarnation (only with node, only when not 0)
 *
 * Fields appear in this order; the optional ones are left out rather than
 * written empty. A message longer than KVF_LOG_MSG_MAX bytes is cut (the line
 * stays valid JSON). docs/logging.md is the operator's copy of this schema.
 *
 * Levels: a process-wide threshold (kvf_log_set_level, "info" by default)
 * drops events below it before they are formatted. Levels are named by string
 * at call sites ("warn"), so a line in the code reads like the line it prints;
 * a name this module does not know is logged as "error", never dropped.
 *
 * Threads: every function may be called from any thread. The level is an
 * atomic; the sink (stderr, or a test's capture function) is read under a
 * mutex that is held while one line is delivered.
 */
#ifndef KVF_LOG_H
#define KVF_LOG_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvf_types.h"

enum kvf_log_level {
    KVF_LOG_DEBUG = 0,
    KVF_LOG_INFO = 1,
    KVF_LOG_WARN = 2,
    KVF_LOG_ERROR = 3,
};

/* Longest message kept (bytes, before escaping); longer ones are cut. */
#define KVF_LOG_MSG_MAX 1024

/* The optional fields of one event. All may be NULL/0. */
struct kvf_log_fields {
    const kvf_room_key *room; /* "room":"id:generation" */
    const char *node;         /* "node":"<id>" */
    uint64_t incarnation;     /* "incarnation":N, only with node and when not 0 */
};

/* Parses "debug", "info", "warn" or "error" (exact, lower case) into
 * *level_p. Returns 0, or -EINVAL (and leaves *level_p alone). */
int kvf_log_level_parse(const char *name, enum kvf_log_level *level_p);

/* The name of a level ("info"); "error" for a value out of range. */
const char *kvf_log_level_name(enum kvf_log_level level);

/* The process-wide threshold: events below it are dropped. Default info. */
void kvf_log_set_level(enum kvf_log_level level);
enum kvf_log_level kvf_log_get_level(void);

/* Whether an event at `level` would be written (to skip costly arguments). */
bool kvf_log_enabled(enum kvf_log_level level);

/* Sets the "proc" field of every later line ("kvfence-control"). The string
 * is copied (at most 63 bytes); NULL or "" removes the field. */
void kvf_log_set_proc(const char *name);

/* The primitive: one event at `level` with optional `fields` (may be NULL). */
void kvf_log_emitv(enum kvf_log_level level, const struct kvf_log_fields *fields, const char *fmt,
                   va_list ap);
void kvf_log_emit(enum kvf_log_level level, const struct kvf_log_fields *fields, const char *fmt,
                  ...) __attribute__((format(printf, 3, 4)));

/* The everyday forms, the level by name ("debug", "info", "warn", "error"). */
void kvf_log(const char *level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvf_logv(const char *level, const char *fmt, va_list ap);
/* With a "room" field and, when `node` is not NULL, a "node" field. */
void kvf_log_room(const char *level, kvf_room_key room, const char *node, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* With a "node" field and, when `incarnation` is not 0, an "incarnation". */
void kvf_log_node(const char *level, const char *node, uint64_t incarnation, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Test hook: every later line (with its '\n', NUL-terminated, `len` bytes
 * without the NUL) goes to `fn` instead of stderr; NULL restores stderr. `fn`
 * runs under the logger's mutex: it must not log. */
typedef void (*kvf_log_sink_fn)(void *arg, const char *line, size_t len);
void kvf_log_set_sink(kvf_log_sink_fn fn, void *arg);

#endif /* KVF_LOG_H */
