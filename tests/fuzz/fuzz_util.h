/*
 * fuzz_util.h: small helpers shared by the libFuzzer targets of tests/fuzz:
 * a private scratch directory per process, whole-file writes, and a reader
 * of length-prefixed chunks for targets whose input is a script.
 */
#ifndef KVF_FUZZ_UTIL_H
#define KVF_FUZZ_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A directory of this process's own (under $TMPDIR, else /dev/shm if
 * writable, else /tmp), created on first use, reused, and removed with its
 * contents at exit; never NULL (aborts when it cannot be made). */
const char *fz_scratch_dir(void);

/* Writes `len` bytes to `path` (created or truncated); aborts on failure. */
void fz_write_file(const char *path, const uint8_t *data, size_t len);

/* Removes every file in `dir` (not recursive). */
void fz_clear_dir(const char *dir);

/* A cursor over the fuzz input. */
struct fz_in {
    const uint8_t *p;
    size_t left;
};

/* Takes one byte (0 when the input is used up). */
uint8_t fz_u8(struct fz_in *in);
/* Takes a little-endian u16 (missing bytes read as 0). */
uint16_t fz_u16(struct fz_in *in);
/* Takes a chunk of fz_u16() bytes, clipped to what is left. */
const uint8_t *fz_chunk(struct fz_in *in, size_t *len_p);

#endif /* KVF_FUZZ_UTIL_H */
