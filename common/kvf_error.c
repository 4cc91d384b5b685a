/*
 * kvf_error.c: error messages and the errno -> gRPC status mapping
 * (see kvf_error.h for the table).
 */
#include "kvf_error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>

int kvf_error_set(struct kvf_error *err, int code, const char *fmt, ...)
{
    if (err != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

void kvf_error_clear(struct kvf_error *err)
{
    if (err != NULL) {
        err->code = 0;
        err->msg[0] = '\0';
    }
}

enum kvf_grpc_code kvf_errno_to_grpc_code(int neg_errno)
{
    switch (neg_errno) {
    case 0:
        return KVF_GRPC_OK;
    case -EINVAL:
        return KVF_GRPC_INVALID_ARGUMENT;
    case -ENOENT:
        return KVF_GRPC_NOT_FOUND;
    case -EEXIST:
        return KVF_GRPC_ALREADY_EXISTS;
    case -E2BIG:
    case -ENOMEM:
        return KVF_GRPC_RESOURCE_EXHAUSTED;
    case -EBUSY:
    case -ESTALE:
    case -ENOTSUP:
    case -EPERM:
        return KVF_GRPC_FAILED_PRECONDITION;
    case -ECANCELED:
        return KVF_GRPC_ABORTED;
    case -EACCES:
        return KVF_GRPC_PERMISSION_DENIED;
    case -ENOKEY:
        return KVF_GRPC_UNAUTHENTICATED;
    case -ETIMEDOUT:
        return KVF_GRPC_DEADLINE_EXCEEDED;
    case -EAGAIN:
        return KVF_GRPC_UNAVAILABLE;
    case -EBADMSG:
        return KVF_GRPC_DATA_LOSS;
    default:
        return KVF_GRPC_INTERNAL;
    }
}

const char *kvf_grpc_code_name(enum kvf_grpc_code code)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    if ((unsigned)code < sizeof(names) / sizeof(names[0]))
        return names[code];
    return "UNKNOWN";
}
