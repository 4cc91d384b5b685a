/*
 * test_common.c: the error convention and the feature names of common/.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "kvf_error.h"
#include "kvf_types.h"

static void errno_maps_to_the_documented_grpc_codes(void **state)
{
    (void)state;
    assert_int_equal(kvf_errno_to_grpc_code(0), KVF_GRPC_OK);
    assert_int_equal(kvf_errno_to_grpc_code(-EINVAL), KVF_GRPC_INVALID_ARGUMENT);
    assert_int_equal(kvf_errno_to_grpc_code(-ENOENT), KVF_GRPC_NOT_FOUND);
    assert_int_equal(kvf_errno_to_grpc_code(-E2BIG), KVF_GRPC_RESOURCE_EXHAUSTED);
    assert_int_equal(kvf_errno_to_grpc_code(-EBUSY), KVF_GRPC_FAILED_PRECONDITION);
    assert_int_equal(kvf_errno_to_grpc_code(-ESTALE), KVF_GRPC_FAILED_PRECONDITION);
    assert_int_equal(kvf_errno_to_grpc_code(-ENOTSUP), KVF_GRPC_FAILED_PRECONDITION);
    assert_int_equal(kvf_errno_to_grpc_code(-ECANCELED), KVF_GRPC_ABORTED);
    assert_int_equal(kvf_errno_to_grpc_code(-EBADMSG), KVF_GRPC_DATA_LOSS);
    assert_int_equal(kvf_errno_to_grpc_code(-EXDEV), KVF_GRPC_INTERNAL);
    assert_string_equal(kvf_grpc_code_name(KVF_GRPC_FAILED_PRECONDITION), "FAILED_PRECONDITION");
    assert_string_equal(kvf_grpc_code_name((enum kvf_grpc_code)99), "UNKNOWN");
}

static void error_set_records_code_and_message(void **state)
{
    (void)state;
    struct kvf_error err;
    kvf_error_clear(&err);
    assert_int_equal(kvf_error_set(&err, -E2BIG, "lease.ranges: %d ranges, limit %d", 9, 8),
                     -E2BIG);
    assert_int_equal(err.code, -E2BIG);
    assert_string_equal(err.msg, "lease.ranges: 9 ranges, limit 8");
    assert_int_equal(kvf_error_set(NULL, -EINVAL, "ignored"), -EINVAL);
}

static void feature_names_round_trip(void **state)
{
    (void)state;
    for (unsigned i = 0; i < KVF_FEATURE_COUNT; i++) {
        const char *name = kvf_feature_name(1u << i);
        assert_non_null(name);
        assert_int_equal(kvf_feature_from_name(name), 1u << i);
    }
    assert_null(kvf_feature_name(3));
    assert_int_equal(kvf_feature_from_name("WARP_DRIVE"), 0);
    assert_int_equal(kvf_features_first_missing(KVF_FEATURE_TCP, KVF_FEATURES_REQUIRED),
                     KVF_FEATURE_QUIESCE_V1);
    assert_int_equal(kvf_features_first_missing(KVF_FEATURE_QUIESCE_V1, KVF_FEATURES_REQUIRED), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(errno_maps_to_the_documented_grpc_codes),
        cmocka_unit_test(error_set_records_code_and_message),
        cmocka_unit_test(feature_names_round_trip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
