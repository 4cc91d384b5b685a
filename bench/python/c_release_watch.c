/*
 * c_release_watch.c: the C client's view of lease releases, for
 * bench_release.py. It opens one kvf_watch_leases() stream on the control
 * plane at argv[1] (node filter argv[2], "" for every lease) and writes one
 * line per event to stdout:
 *
 *     synced <replayed>
 *     released <lease_id> <CLOCK_MONOTONIC ns at receipt>
 *
 * (stdout is a file the benchmark reads afterwards, so a line costs a
 * write(2), no pipe back-pressure). It runs until stdin reaches EOF, then
 * stops the watch and exits 0.
 *
 * DESIGN: the library's watch thread runs the callback; the main thread only
 * blocks on stdin. The callback is the only writer of stdout.
 */
#include <inttypes.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "kvfence/kvfence.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void on_event(const struct kvf_lease_event *ev, void *ctx)
{
    (void)ctx;
    if (ev->kind == KVF_LEASE_EVENT_RELEASED)
        printf("released %" PRIu64 " %" PRIu64 "\n", ev->lease_id, now_ns());
    else if (ev->kind == KVF_LEASE_EVENT_SYNCED)
        printf("synced %" PRIu64 "\n", ev->replayed);
    else if (ev->kind == KVF_LEASE_EVENT_DISCONNECTED)
        fprintf(stderr, "c_release_watch: disconnected: %s\n", ev->status.message);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: c_release_watch HOST:PORT NODE_ID|\"\"\n");
        return 2;
    }
    struct kvf_status st;
    kvf_client *c;
    if (kvf_client_create(argv[1], NULL, &c, &st)) {
        fprintf(stderr, "c_release_watch: %s\n", st.message);
        return 1;
    }
    struct kvf_watch_filter f = {.node_id = argv[2][0] ? argv[2] : NULL};
    kvf_watch *w;
    if (kvf_watch_leases(c, &f, on_event, NULL, &w, &st)) {
        fprintf(stderr, "c_release_watch: %s\n", st.message);
        kvf_client_destroy(c);
        return 1;
    }
    char buf[64];
    while (read(0, buf, sizeof buf) > 0)
        ;
    kvf_watch_stop(w);
    kvf_client_destroy(c);
    return 0;
}
