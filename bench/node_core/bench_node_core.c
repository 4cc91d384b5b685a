/*
 * bench_node_core.c: memory of the node's rules core over a long uptime
 * (issue 15: rooms and lifetimes were never freed, peer slots never reused).
 *
 * Drives the core as the daemon does, one room after another: open, one
 * local source and one local sink, a TCP op admitted and retired, both
 * participants complete (every other room instead: an abort notice with a
 * token while the op is in flight, then the op retires), effects drained
 * after every call, kvf_ncore_collect at the end of each room (the daemon's
 * end of a job), and the caller's room freed on ROOM_FREE. Every 1,000 rooms
 * the peer comes back as a new incarnation and the old one is fenced, so the
 * run also goes through 1,000 peer incarnations on 64 slots.
 *
 * Prints, every 100,000 rooms: the core's counters (rooms retained,
 * lifetimes in the table, peer slots used and recycled, effect queue
 * capacity) and the process's resident set (/proc/self/statm). Flat figures
 * from 100k on mean bounded memory.
 * Usage: bench_node_core [rooms, default 1000000] [retain, default 1024]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "node_core.h"

struct room {
    struct kvf_ncore_room core;
    uint32_t peer; /* the peer slot it names */
};

static long rss_kib(void)
{
    FILE *fp = fopen("/proc/self/statm", "r");
    long size = 0, res = 0;
    if (!fp)
        return -1;
    if (fscanf(fp, "%ld %ld", &size, &res) != 2)
        res = -1;
    fclose(fp);
    return res < 0 ? -1 : res * (sysconf(_SC_PAGESIZE) / 1024);
}

/* Room ids are random at the control plane and generations come from one
 * counter (lifetime_table.c): the same here. */
static kvf_room_key key_of(uint64_t i)
{
    return (kvf_room_key){(i * 0x9e3779b97f4a7c15ull) & KVF_ROOM_ID_MAX, i};
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Applies the effects as the daemon would; counts what matters here. */
static void drain(struct kvf_ncore *c, uint64_t *freed, uint64_t *drained_sent)
{
    struct kvf_ncore_fx fx;
    while (kvf_ncore_fx_take(c, &fx)) {
        struct room *r = fx.user;
        switch (fx.kind) {
        case KVF_NCORE_FX_ROOM_DRAINED:
            kvf_ncore_peer_unref(c, r->peer); /* sends to no peer again */
            break;
        case KVF_NCORE_FX_SEND_DRAINED:
            (*drained_sent)++;
            break;
        case KVF_NCORE_FX_ROOM_FREE:
            free(r);
            (*freed)++;
            break;
        default:
            break;
        }
    }
}

static void report(struct kvf_ncore *c, uint64_t rooms, double t0)
{
    struct kvf_ncore_stats s;
    kvf_ncore_stats(c, &s);
    printf("%9llu rooms  %5zu retained  %5zu lifetimes  %2u peer slots  %6llu recycled  "
           "fx cap %zu  rss %ld KiB  %.1f s\n",
           (unsigned long long)rooms, s.retained, s.lifetimes, s.peers_used,
           (unsigned long long)s.peers_recycled, s.fx_cap, rss_kib(), now_s() - t0);
}

int main(int argc, char **argv)
{
    uint64_t rooms = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000ull;
    size_t retain = argc > 2 ? strtoull(argv[2], NULL, 10) : 1024;
    struct kvf_ncore_opts o;
    kvf_ncore_opts_init(&o);
    o.retain_max = retain;
    struct kvf_ncore *c = kvf_ncore_create(&o);
    if (!c) {
        fprintf(stderr, "bench_node_core: out of memory\n");
        return 1;
    }
    uint64_t freed = 0, drained_sent = 0, failures = 0;
    uint32_t peer = 0;
    uint64_t inc = 1;
    if (kvf_ncore_peer_get(c, "n2", inc, &peer, NULL) != 0)
        return 1;
    double t0 = now_s();
    report(c, 0, t0);
    for (uint64_t i = 1; i <= rooms; i++) {
        if (i % 1000 == 0) { /* the peer restarts: the old incarnation is fenced */
            kvf_ncore_peer_fenced(c, peer);
            if (kvf_ncore_peer_get(c, "n2", ++inc, &peer, NULL) != 0) {
                fprintf(stderr, "bench_node_core: %s\n", kvf_ncore_reason(c));
                return 1;
            }
        }
        struct room *r = calloc(1, sizeof *r);
        if (!r || kvf_ncore_room_open(c, &r->core, key_of(i), r) != 0) {
            fprintf(stderr, "bench_node_core: room %llu not opened\n", (unsigned long long)i);
            return 1;
        }
        r->peer = peer;
        kvf_ncore_peer_ref(c, peer);
        kvf_ncore_room_members(c, &r->core, 2, 0);
        struct kvf_lt_op op;
        if (kvf_lt_admit(r->core.lt, &op, KVF_LT_OP_TCP_FRAME, peer) != 0)
            failures++;
        if (i % 2) {
            (void)kvf_lt_op_retire(&op, KVF_LT_DONE_OK);
            failures += kvf_ncore_part_completed(c, &r->core, 0, false) != 0;
            failures += kvf_ncore_part_completed(c, &r->core, 0, true) != 0;
        } else {
            kvf_ncore_room_abort(c, &r->core, (kvf_token){i, ~i}, i);
            drain(c, &freed, &drained_sent);
            (void)kvf_lt_op_retire(&op, KVF_LT_DONE_FLUSHED);
            kvf_ncore_room_check(c, &r->core);
        }
        drain(c, &freed, &drained_sent);
        failures += !kvf_ncore_room_terminal(&r->core);
        kvf_ncore_collect(c);
        drain(c, &freed, &drained_sent);
        if (i % 100000 == 0)
            report(c, i, t0);
    }
    printf("rooms freed %llu, Drained reports %llu, failures %llu\n", (unsigned long long)freed,
           (unsigned long long)drained_sent, (unsigned long long)failures);
    kvf_ncore_destroy(c); /* the retained rooms stay the caller's: not freed here (they would
                             be freed by the daemon's own teardown) */
    return failures ? 1 : 0;
}
