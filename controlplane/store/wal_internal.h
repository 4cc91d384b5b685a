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

/* Why the walk of a segment stopped before its end. */
enum wal_damage {
    WAL_DAMAGE_NONE = 0,
    WAL_DAMAGE_SHORT_HEADER,  /* fewer bytes left than a record header */
    WAL_DAMAGE_BAD_LENGTH,    /* a length no record can have */
    WAL_DAMAGE_SHORT_PAYLOAD, /* the payload runs past the end of the file */
    WAL_DAMAGE_CRC,           /* a record or seal whose CRC does not verify */
    WAL_DAMAGE_SEQ_GAP,       /* a record that verifies, with the wrong seq */
    WAL_DAMAGE_SEAL_GAP,      /* a seal that verifies, naming the wrong seq */
    WAL_DAMAGE_AFTER_SEAL,    /* bytes after a seal */
};

/* The words the logs and errors use for `d` ("CRC mismatch"). */
const char *wal_damage_text(enum wal_damage d);

/* Whether an append cut short by a crash can leave `d` at the end of the last
 * segment. A record that verifies with the wrong seq, and anything about a
 * seal, cannot: a seal is written only after the next segment is durable, and
 * nothing is written after it. */
bool wal_damage_can_be_torn(enum wal_damage d);

/* Whether `p[0, len)`, the bytes after the last record of a segment that is
 * not the last, is a seal naming `next_seq` whose write was cut short: at
 * most a seal's size, every byte either the seal's own or zero, and not the
 * whole seal. The log is intact then (the next segment chains on). */
bool wal_is_torn_seal(const unsigned char *p, size_t len, uint64_t next_seq);

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
