/*
 * fuzz_cp_snapshot.c: kvf_cps_restore() (controlplane/state/cp_snapshot.c)
 * on hostile images: it must refuse what it cannot verify (-EBADMSG) without
 * crashing or leaking, and whatever it accepts must be a state the core can
 * run, snapshot again and tick.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cp_state.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fixed_random(void *ctx, void *buf, size_t len)
{
    (void)ctx;
    memset(buf, 0x5a, len);
}

static int count_write(void *ctx, const void *buf, size_t len)
{
    (void)buf;
    *(size_t *)ctx += len;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvf_cps_opts opts;
    kvf_cps_opts_init(&opts);
    opts.random_fn = fixed_random;
    struct kvf_error err;
    kvf_error_clear(&err);
    const kvf_time_ns now = 1000000000;
    struct kvf_cps *st = kvf_cps_restore(&opts, data, size, now, &err);
    if (!st)
        return 0;
    size_t n = 0;
    if (kvf_cps_snapshot(st, now, count_write, &n) != 0)
        abort(); /* an accepted state must snapshot again */
    kvf_cps_tick(st, now + 3600 * (kvf_time_ns)1000000000);
    size_t count = 0;
    (void)kvf_cps_effects_take(st, &count);
    kvf_cps_destroy(st);
    return 0;
}
