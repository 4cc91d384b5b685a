/*
 * kvf_clock.h: the clocks kvfence reads, in the units it uses.
 *
 * Monotonic time (CLOCK_MONOTONIC) measures intervals, deadlines and timers:
 * it never jumps when the wall clock is set. Wall-clock time (CLOCK_REALTIME)
 * is only for what people read (log timestamps, times shown to operators), and
 * never for deciding anything.
 *
 * The state cores must not include this header: they are handed the time
 * (kvf_time_ns, kvf_types.h) by the thread that steps them.
 */
#ifndef KVF_CLOCK_H
#define KVF_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Monotonic time in nanoseconds (since an arbitrary start, e.g. boot). */
static inline int64_t kvf_clock_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Monotonic time in milliseconds. */
static inline int64_t kvf_clock_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000L;
}

/* Wall-clock time in milliseconds since the Unix epoch. */
static inline int64_t kvf_clock_real_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000L;
}

/* The CLOCK_MONOTONIC instant `ms` milliseconds from now, as a timespec, for
 * pthread_cond_timedwait on a condvar set to CLOCK_MONOTONIC. A negative
 * `ms` counts as 0. */
static inline struct timespec kvf_clock_mono_after_ms(int64_t ms)
{
    struct timespec ts;
    if (ms < 0)
        ms = 0;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = (int64_t)ts.tv_nsec + (ms % 1000) * 1000000LL;
    ts.tv_sec += (time_t)(ms / 1000 + ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

#endif /* KVF_CLOCK_H */
