/*
 * wal_test_util.h: helpers shared by the store tests: temp directories, the
 * deterministic payloads and snapshots (derived from the seq, so that a reader
 * can check any record without knowing who wrote it), and file surgery
 * (truncate, flip a byte) to fake torn writes and corruption.
 *
 * Every helper fails the current cmocka test on an unexpected error.
 */
#ifndef KVF_WAL_TEST_UTIL_H
#define KVF_WAL_TEST_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define WAL_TEST_PAYLOAD_MAX 400
#define WAL_TEST_SNAP_MAX    8192

/* A new directory /tmp/kvf_wal_XXXXXX (malloc'd path). */
char *wal_test_mkdtemp(void);
/* Removes the tree and frees the path. */
void wal_test_rmtree(char *dir);

/* The payload of record `seq` (16..315 bytes); returns its length. */
size_t wal_test_payload(uint64_t seq, unsigned char *buf);
bool wal_test_payload_ok(uint64_t seq, const unsigned char *bytes, size_t len);
/* The snapshot body that stands for seqs 1..seq. */
size_t wal_test_snapshot(uint64_t seq, unsigned char *buf);
bool wal_test_snapshot_ok(uint64_t seq, const unsigned char *bytes, size_t len);

int wal_test_count_files(const char *dir, const char *prefix);
/* Names starting with `prefix`, sorted; returns how many (at most max). */
int wal_test_list_files(const char *dir, const char *prefix, char names[][64], int max);
bool wal_test_file_exists(const char *dir, const char *name);
off_t wal_test_file_size(const char *dir, const char *name);
/* Offsets of the records of a segment (walking the length fields). */
/* Offsets of the data records of a segment (a seal ends the list). */
size_t wal_test_record_offsets(const char *dir, const char *name, off_t *offs, size_t max);
void wal_test_truncate(const char *dir, const char *name, off_t size);
void wal_test_flip_byte(const char *dir, const char *name, off_t off);
void wal_test_append_zeros(const char *dir, const char *name, size_t n);
void wal_test_write_file(const char *dir, const char *name, const void *bytes, size_t len);
void wal_test_copy_file(const char *dir, const char *from, const char *to);
void wal_test_unlink(const char *dir, const char *name);

/* test_wal_crash.c */
void test_wal_crash_kill9(void **state);

#endif /* KVF_WAL_TEST_UTIL_H */
