/* checksum.c: CRC-32C for packed-trunk integrity and FNV-1a for identities.
 * The SSE4.2 crc32 instruction computes CRC-32C directly; the table path
 * gives the same values on CPUs without it (and on other architectures). */
#include "util/common.h"

#include <pthread.h>
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

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc_hw1(uint32_t crc, const uint8_t *p, size_t n) {
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

/* The crc32 instruction has a latency of 3 cycles and a throughput of 1, so
 * one chain runs at a third of its speed (the packed trunk is checked as it
 * streams: ~300 MB per decoded token at the smallest budgets, and this was
 * the largest CPU user of a streamed decode). Three chains over three
 * adjacent blocks of XB bytes run together; the CRC is linear, so
 *   crc(c, A B C) = shift(shift(crc(c, A)) ^ crc(0, B)) ^ crc(0, C)
 * where shift(x) = crc(x, XB zero bytes), a linear map of x applied by four
 * byte tables built once from the one-chain code. Same values, by
 * construction and by test (crc32c_matches_bitwise_reference). */
#define XB 4096
static uint32_t shift_tab[4][256];
static int shift_ready;

__attribute__((target("sse4.2"))) static void shift_init(void) {
    static const uint8_t zeros[XB];
    uint32_t img[32]; /* the map is linear: the images of single bits, combined */
    for (int i = 0; i < 32; i++) img[i] = crc_hw1(1u << i, zeros, XB);
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 256; b++) {
            uint32_t r = 0;
            for (int bit = 0; bit < 8; bit++)
                if (b >> bit & 1) r ^= img[8 * k + bit];
            shift_tab[k][b] = r;
        }
    __atomic_store_n(&shift_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t shift_xb(uint32_t x) {
    return shift_tab[0][x & 0xff] ^ shift_tab[1][(x >> 8) & 0xff] ^ shift_tab[2][(x >> 16) & 0xff] ^
           shift_tab[3][x >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const uint8_t *p, size_t n) {
    if (n >= 3 * XB) {
        if (!__atomic_load_n(&shift_ready, __ATOMIC_ACQUIRE)) {
            static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
            pthread_mutex_lock(&mu);
            if (!shift_ready) shift_init();
            pthread_mutex_unlock(&mu);
        }
        while (n >= 3 * XB) {
            uint64_t a = crc, b = 0, c = 0;
            for (size_t i = 0; i < XB; i += 8) {
                uint64_t va, vb, vc;
                memcpy(&va, p + i, 8);
                memcpy(&vb, p + XB + i, 8);
                memcpy(&vc, p + 2 * XB + i, 8);
                a = __builtin_ia32_crc32di(a, va);
                b = __builtin_ia32_crc32di(b, vb);
                c = __builtin_ia32_crc32di(c, vc);
            }
            crc = shift_xb(shift_xb((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
            p += 3 * XB;
            n -= 3 * XB;
        }
    }
    return crc_hw1(crc, p, n);
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
#else
uint32_t k3_crc32c(uint32_t crc, const void *data, size_t n) { return ~crc_sw(~crc, data, n); }
#endif

/* Feeding one zero byte to the CRC register is a linear map over GF(2);
 * n bytes are its n-th power, by squaring. A map is held as the images of
 * the 32 single-bit registers. */
static uint32_t gf2_apply(const uint32_t m[32], uint32_t v) {
    uint32_t r = 0;
    for (int i = 0; v; i++, v >>= 1)
        if (v & 1) r ^= m[i];
    return r;
}

uint32_t k3_crc32c_zeros(uint32_t crc, uint64_t n) {
    uint32_t m[32], sq[32], r = ~crc;
    for (int i = 0; i < 32; i++) {
        uint32_t c = 1u << i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
        m[i] = c;
    }
    while (n) {
        if (n & 1) r = gf2_apply(m, r);
        n >>= 1;
        if (!n) break;
        for (int i = 0; i < 32; i++) sq[i] = gf2_apply(m, m[i]);
        memcpy(m, sq, sizeof m);
    }
    return ~r;
}

uint64_t k3_fnv1a64(uint64_t h, const void *data, size_t n) {
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}
