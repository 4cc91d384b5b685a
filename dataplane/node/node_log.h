/*
 * node_log.h: the node's log lines and its monotonic clock, for every module
 * of dataplane/node/ (the bottom layer: it calls nothing of the node).
 *
 * node_log writes one JSON line through the common logger (kvf_log.h) with
 * the node's level names ("debug", "info", "warn", "error"; an unknown name
 * is logged as an error, never dropped) and, when `room` is not NULL, the
 * room-generation it is about. Any thread.
 */
#ifndef KVF_NODE_LOG_H
#define KVF_NODE_LOG_H

#include <stdint.h>

#include "kvf_types.h"

void node_log(const char *level, const kvf_room_key *room, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Monotonic milliseconds (kvf_clock_mono_ms): the node's deadlines. Any thread. */
int64_t node_now_ms(void);

#endif /* KVF_NODE_LOG_H */
