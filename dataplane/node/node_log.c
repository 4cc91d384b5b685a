/*
 * node_log.c: the node's log lines and clock (node_log.h), kept out of the
 * owner (node.c) so that every module can log without calling up into it.
 */
#include "node_log.h"

#include <stdarg.h>

#include "kvf_clock.h"
#include "kvf_log.h"

void node_log(const char *level, const kvf_room_key *room, const char *fmt, ...)
{
    enum kvf_log_level lvl = KVF_LOG_ERROR; /* an unknown level is never dropped */
    (void)kvf_log_level_parse(level, &lvl);
    struct kvf_log_fields fields = {.room = room};
    va_list ap;
    va_start(ap, fmt);
    kvf_log_emitv(lvl, &fields, fmt, ap);
    va_end(ap);
}

int64_t node_now_ms(void)
{
    return kvf_clock_mono_ms();
}
