/*
 * test_clock.c: the clock helpers agree with each other and with the clocks
 * they read, and deadline timespecs are normalised.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <cmocka.h>

#include "kvf_clock.h"

static void monotonic_units_agree(void **state)
{
    (void)state;
    int64_t ms0 = kvf_clock_mono_ms();
    int64_t ns = kvf_clock_mono_ns();
    int64_t ms1 = kvf_clock_mono_ms();
    assert_true(ms0 <= ms1);
    assert_true(ns / 1000000 >= ms0);
    assert_true(ns / 1000000 <= ms1);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t raw_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    assert_true(raw_ms >= ms1);
    assert_true(raw_ms - ms1 < 1000);
}

static void monotonic_time_advances(void **state)
{
    (void)state;
    int64_t t0 = kvf_clock_mono_ns();
    struct timespec d = {0, 2 * 1000 * 1000};
    nanosleep(&d, NULL);
    int64_t t1 = kvf_clock_mono_ns();
    assert_true(t1 - t0 >= 2 * 1000 * 1000);
}

static void realtime_is_the_epoch_in_ms(void **state)
{
    (void)state;
    int64_t ms = kvf_clock_real_ms();
    time_t s = time(NULL);
    assert_true(ms / 1000 >= (int64_t)s - 1);
    assert_true(ms / 1000 <= (int64_t)s + 1);
    assert_true(ms > 1600000000000LL); /* after 2020 */
}

static void deadlines_are_normalised(void **state)
{
    (void)state;
    const int64_t cases[] = {0, 1, 999, 1000, 1001, 123456, -5};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int64_t before = kvf_clock_mono_ns();
        struct timespec at = kvf_clock_mono_after_ms(cases[i]);
        int64_t after = kvf_clock_mono_ns();
        assert_true(at.tv_nsec >= 0 && at.tv_nsec < 1000000000L);
        int64_t at_ns = (int64_t)at.tv_sec * 1000000000LL + at.tv_nsec;
        int64_t want = cases[i] < 0 ? 0 : cases[i] * 1000000LL;
        assert_true(at_ns >= before + want);
        assert_true(at_ns <= after + want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(monotonic_units_agree),
        cmocka_unit_test(monotonic_time_advances),
        cmocka_unit_test(realtime_is_the_epoch_in_ms),
        cmocka_unit_test(deadlines_are_normalised),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
