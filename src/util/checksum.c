/* checksum.c: CRC-32C for packed-trunk integrity and FNV-1a for identities.
 * The SSE4.2 crc32 instruction computes CRC-32C directly; the table path
 * gives the same values on CPUs without it. */
#include "util/common.h"

#include <string.h>

static uint32_t table[256];

static void table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
        table[i] = c;
    }
}

static uint32_t crc_sw(uint32_t crc, const uint8_t *p, size_t n) {
    if (!table[1]) table_init();
    for (size_t i = 0; i < n; i++) crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return crc;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}

uint32_t k3_crc32c(uint32_t crc, const void *data, size_t n) {
    static int hw = -1;
    if (hw < 0) {
        __builtin_cpu_init();
        hw = __builtin_cpu_supports("sse4.2");
    }
    crc = ~crc;
    crc = hw ? crc_hw(crc, data, n) : crc_sw(crc, data, n);
    return ~crc;
}

uint64_t k3_fnv1a64(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}
