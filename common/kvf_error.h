/*
 * kvf_error.h: the one error convention of kvfence (STYLE.md rule 5).
 *
 * Functions that can fail return 0 or a negative errno. When a caller wants to
 * know why, it passes a struct kvf_error and the callee writes one message into
 * it that names the field or the object at fault ("lease.pages[3]: page 4100
 * is outside pool 7 (4096 pages)"). The RPC edge maps the errno to a gRPC
 * status code, once, with kvf_errno_to_grpc_code().
 *
 * The errno values kvfence uses and what they mean:
 *   -EINVAL        INVALID_ARGUMENT     malformed input (a field out of range)
 *   -ENOENT        NOT_FOUND            unknown room, lease, node or pool
 *   -EEXIST        ALREADY_EXISTS       a second create of a unique thing
 *   -E2BIG         RESOURCE_EXHAUSTED   a list longer than the limit
 *   -ENOMEM        RESOURCE_EXHAUSTED   out of memory
 *   -EBUSY         FAILED_PRECONDITION  pages owned by another room
 *   -ESTALE        FAILED_PRECONDITION  stale generation, token or incarnation
 *   -ENOTSUP       FAILED_PRECONDITION  missing capability or protocol version
 *   -EPERM         FAILED_PRECONDITION  the object is in the wrong state
 *   -ECANCELED     ABORTED              the room is aborting or aborted
 *   -ETIMEDOUT     DEADLINE_EXCEEDED
 *   -EAGAIN        UNAVAILABLE          try again (shutting down, recovering)
 *   -EBADMSG       DATA_LOSS            stored state is corrupt (a bad snapshot)
 *   -EIO           INTERNAL
 */
#ifndef KVF_ERROR_H
#define KVF_ERROR_H

#include <stddef.h>

#define KVF_ERROR_MSG_MAX 256

struct kvf_error {
    int code; /* the negative errno that was returned, 0 if none */
    char msg[KVF_ERROR_MSG_MAX];
};

/* Records `code` and a printf-style message in `err` (which may be NULL) and
 * returns `code`, so that callers can write `return kvf_error_set(err, ...)`. */
int kvf_error_set(struct kvf_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Clears `err` (may be NULL). */
void kvf_error_clear(struct kvf_error *err);

/* gRPC status code numbers (grpc/status.h; stable on the wire). Kept here so
 * that layers without gRPC can name them. */
enum kvf_grpc_code {
    KVF_GRPC_OK = 0,
    KVF_GRPC_CANCELLED = 1,
    KVF_GRPC_UNKNOWN = 2,
    KVF_GRPC_INVALID_ARGUMENT = 3,
    KVF_GRPC_DEADLINE_EXCEEDED = 4,
    KVF_GRPC_NOT_FOUND = 5,
    KVF_GRPC_ALREADY_EXISTS = 6,
    KVF_GRPC_PERMISSION_DENIED = 7,
    KVF_GRPC_RESOURCE_EXHAUSTED = 8,
    KVF_GRPC_FAILED_PRECONDITION = 9,
    KVF_GRPC_ABORTED = 10,
    KVF_GRPC_OUT_OF_RANGE = 11,
    KVF_GRPC_UNIMPLEMENTED = 12,
    KVF_GRPC_INTERNAL = 13,
    KVF_GRPC_UNAVAILABLE = 14,
    KVF_GRPC_DATA_LOSS = 15,
    KVF_GRPC_UNAUTHENTICATED = 16,
};

/* Maps 0 or a negative errno to the gRPC status code the RPC edge answers. */
enum kvf_grpc_code kvf_errno_to_grpc_code(int neg_errno);

/* Returns the canonical name of a gRPC status code ("FAILED_PRECONDITION"). */
const char *kvf_grpc_code_name(enum kvf_grpc_code code);

#endif /* KVF_ERROR_H */
