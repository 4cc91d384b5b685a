/*
 * crc32c.h: CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), computed
 * in software with slicing-by-8 tables. It checksums the records and snapshots
 * of the store (wal.c). No SSE 4.2 instruction is used, so the result is the
 * same on every machine; about 1-2 GB/s on one core, enough to replay a 64 MiB
 * segment well inside the recovery budget (docs/design.md §8).
 *
 * DESIGN: pure functions over the caller's bytes; the tables are built once
 * (pthread_once) and then only read, so any thread may call.
 */
#ifndef KVF_STORE_CRC32C_H
#define KVF_STORE_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/*
 * Continues a CRC-32C: pass 0 to start, and the previous result to go on
 * over more bytes. kvf_crc32c(0, "123456789", 9) == 0xE3069283.
 */
uint32_t kvf_crc32c(uint32_t crc, const void *bytes, size_t len);

#endif /* KVF_STORE_CRC32C_H */
