/*
 * kvf_file.h: writing a small file atomically.
 *
 * A reader (a test, a script, an engine) polls such files and must never see
 * half of one: the bytes go to "<path>.tmp" in the same directory (so the
 * rename stays on one file system), then rename() replaces <path> in one
 * step. On any error the .tmp is removed and <path> is left as it was.
 * Used by the port files of kvfence-control and kvfence-node and the node's
 * test hold counter. Not for the state cores (they do no I/O).
 */
#ifndef KVF_FILE_H
#define KVF_FILE_H

#include <stddef.h>

enum {
    /* fsync the file before the rename and its directory after: the new
     * contents survive a crash (port files do not need it). */
    KVF_FILE_SYNC = 1u,
};

/* Replaces `path` with the `len` bytes at `data`. 0 or -errno
 * (-ENAMETOOLONG when "<path>.tmp" is longer than PATH_MAX). */
int kvf_file_write(const char *path, const void *data, size_t len, unsigned flags);

/* The same with printf-formatted contents. */
int kvf_file_printf(const char *path, unsigned flags, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif /* KVF_FILE_H */
