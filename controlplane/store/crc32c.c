/*
 * crc32c.c: software CRC-32C, slicing-by-8 (see crc32c.h).
 *
 * table[0] is the classic byte-at-a-time table; table[k][b] is the CRC of byte
 * b followed by k zero bytes, which lets the loop fold 8 input bytes per step
 * with 8 independent lookups.
 *
 * DESIGN: the tables are built once under pthread_once by whichever thread
 * calls first, and are read-only afterwards; any thread may call.
 */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#define CRC32C_POLY 0x82F63B78u

static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_tables_build(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = crc_table[0][b];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[t][b] = c;
        }
    }
}

uint32_t kvf_crc32c(uint32_t crc, const void *bytes, size_t len)
{
    const unsigned char *p = bytes;
    pthread_once(&crc_once, crc_tables_build);
    crc = ~crc;
    while (len > 0 && ((uintptr_t)p & 7) != 0) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint32_t lo;
        uint32_t hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        lo = __builtin_bswap32(lo);
        hi = __builtin_bswap32(hi);
#endif
        lo ^= crc;
        crc = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
              crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^
              crc_table[2][(hi >> 8) & 0xff] ^ crc_table[1][(hi >> 16) & 0xff] ^
              crc_table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len > 0) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    return ~crc;
}
