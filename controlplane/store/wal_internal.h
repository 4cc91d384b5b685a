/*
 * wal_internal.h: the log's on-disk record format (wal.c has the full
 * description) and the checks that recovery and --repair-wal share
 * (wal_check.c). Private to controlplane/store/.
 */
#ifndef KVF_STORE_WAL_INTERNAL_H
#define KVF_STORE_WAL_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define WAL_SEG_HDR         24u
#define WAL_REC_HDR         16u
#define WAL_RECORD_HARD_MAX (1u << 30)
/* A seal: a record header whose length is exactly this, with no payload and
 * the first seq of the next segment as its seq. Written at the end of a
 * segment once its successor exists on disk. */
#define WAL_SEAL_LEN 0x80000000u

enum wal_rec_kind {
    WAL_REC_NONE = 0, /* nothing that verifies starts here */
    WAL_REC_DATA = 1,
    WAL_REC_SEAL = 2,
};

uint32_t wal_get_u32(const unsigned char *p);
uint64_t wal_get_u64(const unsigned char *p);
uint32_t wal_record_crc(uint64_t seq, const void *payload, size_t len);

/* What starts at `off` of the segment bytes `p[0, size)`: a record whose
 * header and CRC verify (its seq in *seq_p and the offset after it in
 * *next_p), a seal, or nothing. */
enum wal_rec_kind wal_rec_at(const unsigned char *p, size_t size, size_t off, uint64_t *seq_p,
                             size_t *next_p);

/* The first offset in (from, size) where a data record or seal with a seq >=
 * min_seq verifies: a good record after damage, which a torn tail never has.
 * Returns false if there is none. */
bool wal_find_later(const unsigned char *p, size_t size, size_t from, uint64_t min_seq,
                    size_t *off_p, uint64_t *seq_p);

/* How many data records verify one after the other from `off` on. */
uint64_t wal_chain_count(const unsigned char *p, size_t size, size_t off);

/* Copies the files `names` (of the directory `dir_fd`) into the new
 * sub-directory `backup` of it, synced. 0 or a negative errno. */
int wal_backup_files(int dir_fd, const char *backup, const char *const *names, size_t n);

/* Data records in the segment file `name` of `dir_fd` (0 if it cannot be read). */
uint64_t wal_file_records(int dir_fd, const char *name);

#endif /* KVF_STORE_WAL_INTERNAL_H */
