/*
 * rpc_internal.h: helpers shared by rpc_server.c and rpc_client.c (private to
 * common/rpc/). Small enough to live as static inline functions, so both files
 * stay self-contained and nothing here is exported from kvf_rpc.
 */
#ifndef KVF_RPC_INTERNAL_H
#define KVF_RPC_INTERNAL_H

#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "kvf_clock.h"
#include "kvf_log.h"

#define container_of_rpc(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* Logs one error line (kvf_log), its message prefixed with "kvf_rpc: ". */
static inline void rpc_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline void rpc_log(const char *fmt, ...)
{
    char msg[KVF_LOG_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kvf_log("error", "kvf_rpc: %s", msg);
}

/* A gRPC deadline `timeout_ms` from now; negative means none. */
static inline gpr_timespec rpc_deadline_ms(int64_t timeout_ms)
{
    if (timeout_ms < 0)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

/* Reads a whole (PEM) file into a NUL-terminated malloc'd string. */
static inline int rpc_read_file(const char *path, char **text_p)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -errno;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t n = fread(buf + len, 1, cap - len - 1, f);
        len += n;
        if (len + 1 < cap)
            break;
        char *bigger = realloc(buf, cap * 2);
        if (!bigger) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = bigger;
        cap *= 2;
    }
    int failed = ferror(f);
    fclose(f);
    if (!buf)
        return -ENOMEM;
    if (failed) {
        free(buf);
        return -EIO;
    }
    buf[len] = '\0';
    *text_p = buf;
    return 0;
}

/* A byte buffer holding a copy of `bytes` (NULL on allocation failure, which
 * gRPC turns into an abort, so in practice never). */
static inline grpc_byte_buffer *rpc_bb_from_bytes(const uint8_t *bytes, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)bytes, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Copies every slice of `bb` (large messages arrive in several) into one
 * malloc'd buffer; the caller frees it. An empty message gives a non-NULL
 * buffer of length 0. */
static inline int rpc_bb_copy_out(grpc_byte_buffer *bb, uint8_t **buf_p, size_t *len_p)
{
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return -EIO;
    size_t cap = grpc_byte_buffer_length(bb), len = 0;
    uint8_t *buf = malloc(cap ? cap : 1);
    grpc_slice s;
    while (buf && grpc_byte_buffer_reader_next(&rd, &s)) {
        size_t n = GRPC_SLICE_LENGTH(s);
        if (len + n > cap) {
            size_t want = (len + n) * 2;
            uint8_t *bigger = realloc(buf, want);
            if (!bigger) {
                free(buf);
                buf = NULL;
                grpc_slice_unref(s);
                break;
            }
            buf = bigger;
            cap = want;
        }
        memcpy(buf + len, GRPC_SLICE_START_PTR(s), n);
        len += n;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&rd);
    if (!buf)
        return -ENOMEM;
    *buf_p = buf;
    *len_p = len;
    return 0;
}

#endif /* KVF_RPC_INTERNAL_H */
