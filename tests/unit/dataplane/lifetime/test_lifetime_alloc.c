/*
 * test_lifetime_alloc.c: allocation failure sweep of the lifetime core.
 *
 * calloc, aligned_alloc and realloc are wrapped at link time (CMakeLists.txt)
 * in this executable only. The sweep fails the Nth allocation for N = 0, 1, ...
 * until a run needs no failure, and checks that every constructor reports it
 * (NULL, -ENOMEM, or a dropped message) and leaves the table usable. Under the
 * sanitizer build LeakSanitizer checks that nothing leaked.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "lifetime.h"

void *__real_calloc(size_t n, size_t size);
void *__real_aligned_alloc(size_t align, size_t size);
void *__real_realloc(void *p, size_t size);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_aligned_alloc(size_t align, size_t size);
void *__wrap_realloc(void *p, size_t size);

static long fail_at = -1; /* index of the allocation to fail, -1: none */
static long alloc_index;
static int failures;

static bool should_fail(void)
{
    if (alloc_index++ == fail_at) {
        failures++;
        return true;
    }
    return false;
}

void *__wrap_calloc(size_t n, size_t size)
{
    return should_fail() ? NULL : __real_calloc(n, size);
}

void *__wrap_aligned_alloc(size_t align, size_t size)
{
    return should_fail() ? NULL : __real_aligned_alloc(align, size);
}

void *__wrap_realloc(void *p, size_t size)
{
    return should_fail() ? NULL : __real_realloc(p, size);
}

static kvf_room_key key(uint64_t room_id, uint64_t generation)
{
    kvf_room_key k = {.room_id = room_id, .generation = generation};
    return k;
}

/* Builds a table and opens rooms (enough to grow the maps); every step must
 * either work or say it ran out of memory. */
static void run_once(void)
{
    struct kvf_lt_table *t = kvf_lt_table_create();
    if (t == NULL)
        return;
    for (uint64_t i = 1; i <= 80; i++) {
        struct kvf_lt *lt = NULL;
        int rc = kvf_lt_table_open(t, key(i, i), &lt);
        if (rc != 0) {
            assert_int_equal(rc, -ENOMEM);
            assert_null(lt);
            assert_null(kvf_lt_table_find(t, key(i, i)));
            continue;
        }
        if (i % 2 == 0) {
            assert_true(kvf_lt_close(lt));
            assert_int_equal(kvf_lt_table_forget(t, key(i, i)), 0);
        }
    }
    assert_true(kvf_lt_table_count(t) <= 40);
    kvf_lt_table_destroy(t);
}

static void every_allocation_failure_is_reported_and_leaks_nothing(void **state)
{
    (void)state;
    for (fail_at = 0;; fail_at++) {
        alloc_index = 0;
        failures = 0;
        run_once();
        if (failures == 0)
            break; /* this run needed fewer allocations than fail_at: all covered */
    }
    fail_at = -1;
    assert_true(alloc_index > 80); /* the sweep reached the lifetimes and the map growth */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(every_allocation_failure_is_reported_and_leaks_nothing),
    };
    return cmocka_run_group_tests_name("lifetime_alloc", tests, NULL, NULL);
}
