/*
 * wal_check.c: what recovery needs to tell a torn tail from corruption, and
 * what --repair-wal needs to cut the log safely (wal_internal.h).
 *
 * A torn tail is the end of the last segment where an append was cut short
 * by a crash: nothing after it verifies. Damage followed by a record that
 * verifies (its header, CRC and a seq at or past the one expected) is
 * corruption of acknowledged records, never cut silently. The scan for such
 * a record tries every byte offset but computes a CRC only where the header
 * is plausible (length within the file, seq in range), so it stays linear in
 * practice.
 *
 * DESIGN: plain functions over bytes and file descriptors; they run on the
 * thread of recover() before the committer starts, and hold no state.
 */
#include "wal_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"

uint32_t wal_get_u32(const unsigned char *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

uint64_t wal_get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

uint32_t wal_record_crc(uint64_t seq, const void *payload, size_t len)
{
    unsigned char s[8];
    for (int i = 0; i < 8; i++)
        s[i] = (unsigned char)(seq >> (8 * i));
    uint32_t crc = kvf_crc32c(0, s, sizeof(s));
    return len > 0 ? kvf_crc32c(crc, payload, len) : crc;
}

const char *wal_damage_text(enum wal_damage d)
{
    switch (d) {
    case WAL_DAMAGE_NONE:
        return "no damage";
    case WAL_DAMAGE_SHORT_HEADER:
        return "short record header";
    case WAL_DAMAGE_BAD_LENGTH:
        return "record length out of range";
    case WAL_DAMAGE_SHORT_PAYLOAD:
        return "short payload";
    case WAL_DAMAGE_CRC:
        return "CRC mismatch";
    case WAL_DAMAGE_SEQ_GAP:
        return "seq gap";
    case WAL_DAMAGE_SEAL_GAP:
        return "seal with a seq gap";
    case WAL_DAMAGE_AFTER_SEAL:
        return "bytes after the seal";
    }
    return "unknown damage";
}

bool wal_damage_can_be_torn(enum wal_damage d)
{
    switch (d) {
    case WAL_DAMAGE_SHORT_HEADER:
    case WAL_DAMAGE_BAD_LENGTH:
    case WAL_DAMAGE_SHORT_PAYLOAD:
    case WAL_DAMAGE_CRC:
        return true;
    case WAL_DAMAGE_NONE:
    case WAL_DAMAGE_SEQ_GAP:
    case WAL_DAMAGE_SEAL_GAP:
    case WAL_DAMAGE_AFTER_SEAL:
        return false;
    }
    return false;
}

bool wal_is_torn_seal(const unsigned char *p, size_t len, uint64_t next_seq)
{
    if (len == 0 || len > WAL_REC_HDR)
        return false;
    unsigned char seal[WAL_REC_HDR];
    uint32_t crc = wal_record_crc(next_seq, NULL, 0);
    for (int i = 0; i < 4; i++) {
        seal[i] = (unsigned char)(WAL_SEAL_LEN >> (8 * i));
        seal[4 + i] = (unsigned char)(crc >> (8 * i));
    }
    for (int i = 0; i < 8; i++)
        seal[8 + i] = (unsigned char)(next_seq >> (8 * i));
    if (len == WAL_REC_HDR && memcmp(p, seal, len) == 0)
        return false; /* a whole seal is no torn one */
    for (size_t i = 0; i < len; i++)
        if (p[i] != seal[i] && p[i] != 0)
            return false;
    return true;
}

enum wal_rec_kind wal_rec_at(const unsigned char *p, size_t size, size_t off, uint64_t *seq_p,
                             size_t *next_p)
{
    if (off > size || size - off < WAL_REC_HDR)
        return WAL_REC_NONE;
    const unsigned char *h = p + off;
    uint32_t len = wal_get_u32(h);
    uint64_t seq = wal_get_u64(h + 8);
    if (len == WAL_SEAL_LEN) {
        if (wal_get_u32(h + 4) != wal_record_crc(seq, NULL, 0))
            return WAL_REC_NONE;
        *seq_p = seq;
        *next_p = off + WAL_REC_HDR;
        return WAL_REC_SEAL;
    }
    if (len > WAL_RECORD_HARD_MAX || (size_t)len > size - off - WAL_REC_HDR)
        return WAL_REC_NONE;
    if (wal_get_u32(h + 4) != wal_record_crc(seq, h + WAL_REC_HDR, len))
        return WAL_REC_NONE;
    *seq_p = seq;
    *next_p = off + WAL_REC_HDR + len;
    return WAL_REC_DATA;
}

bool wal_find_later(const unsigned char *p, size_t size, size_t from, uint64_t min_seq,
                    size_t *off_p, uint64_t *seq_p)
{
    /* A seq cannot run further ahead than one per record header's worth. */
    uint64_t max_seq = min_seq + size / WAL_REC_HDR + 1;
    for (size_t off = from + 1; off + WAL_REC_HDR <= size; off++) {
        uint64_t seq = wal_get_u64(p + off + 8);
        if (seq < min_seq || seq > max_seq)
            continue;
        size_t next;
        if (wal_rec_at(p, size, off, &seq, &next) != WAL_REC_NONE) {
            *off_p = off;
            *seq_p = seq;
            return true;
        }
    }
    return false;
}

uint64_t wal_chain_count(const unsigned char *p, size_t size, size_t off)
{
    uint64_t n = 0;
    uint64_t seq;
    size_t next;
    while (wal_rec_at(p, size, off, &seq, &next) == WAL_REC_DATA) {
        n++;
        off = next;
    }
    return n;
}

uint64_t wal_file_records(int dir_fd, const char *name)
{
    int fd = openat(dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct stat sb;
    uint64_t n = 0;
    if (fstat(fd, &sb) == 0 && sb.st_size > WAL_SEG_HDR) {
        size_t size = (size_t)sb.st_size;
        unsigned char *buf = malloc(size);
        if (buf != NULL && pread(fd, buf, size, 0) == (ssize_t)size)
            n = wal_chain_count(buf, size, WAL_SEG_HDR);
        free(buf);
    }
    close(fd);
    return n;
}

/* Copies one file of `dir_fd` into `to_fd` (a directory), synced. */
static int copy_file(int dir_fd, const char *name, int to_fd)
{
    int rc = 0;
    int in = openat(dir_fd, name, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return -errno;
    int out = openat(to_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (out < 0) {
        rc = -errno;
        goto out_close_in;
    }
    char buf[65536];
    for (;;) {
        ssize_t n = read(in, buf, sizeof(buf));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            rc = -errno;
            break;
        }
        if (n == 0)
            break;
        for (ssize_t done = 0; done < n;) {
            ssize_t w = write(out, buf + done, (size_t)(n - done));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0) {
                rc = -errno;
                goto out_close_out;
            }
            done += w;
        }
    }
    if (rc == 0 && fsync(out) != 0)
        rc = -errno;
out_close_out:
    close(out);
out_close_in:
    close(in);
    return rc;
}

int wal_backup_files(int dir_fd, const char *backup, const char *const *names, size_t n)
{
    if (mkdirat(dir_fd, backup, 0700) != 0 && errno != EEXIST)
        return -errno;
    int to_fd = openat(dir_fd, backup, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (to_fd < 0)
        return -errno;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++)
        rc = copy_file(dir_fd, names[i], to_fd);
    if (rc == 0 && fsync(to_fd) != 0)
        rc = -errno;
    close(to_fd);
    if (rc == 0 && fsync(dir_fd) != 0)
        rc = -errno;
    return rc;
}
