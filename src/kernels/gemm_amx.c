/* gemm_amx.c: the BF16-mode training product on AMX tiles (Intel AMX-BF16:
 * Sapphire Rapids and later); see kernels.h ("the training GEMM") for when it
 * runs and its numerics.
 *
 * One TDPBF16PS multiplies a 16x32 BF16 tile of A by a 32x16 tile of B (in
 * pairs of k: row q holds B(2q, n), B(2q+1, n) side by side) into a 16x16
 * F32 tile of C: 16K flops per instruction, about 6x the F32 FMA rate of a
 * core. Both operands are converted to BF16 once per call into tile order:
 *   A: [M/16][K/32][16 rows][32 k]      (one tile = 1 KB, contiguous)
 *   B: [N/16][K/32][16 pairs][16 n][2]  (likewise)
 * padded with zeros to multiples of 32 rows/columns and 32 k. A job is a 32x32
 * block of C (2x2 C tiles, 2 A and 2 B tiles per k step) over ALL of K, the
 * k steps always starting at k = 0 in steps of 32, so an element's sequence
 * of instructions does not depend on the thread count or the job split.
 *
 * Tile state: Linux hands out AMX tile data only to a process that asks
 * (arch_prctl ARCH_REQ_XCOMP_PERM, once per process: k_cpu_amx in
 * kernels.c); the tile configuration is per thread, so every thread loads it at the start of its share of a call
 * and releases the tiles at the end (a released tile state is cheap to save
 * on a context switch). */
#include "kernels/internal.h"

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "util/common.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#define TGA __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg;

/* C tiles 0-3 (16x16 f32), A tiles 4-5 (16 rows x 32 bf16), B tiles 6-7 (16 pairs x 16 cols x 2). */
TGA static void config_tiles(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* n floats -> n BF16 (n <= 16), VCVTNEPS2BF16 rounding (the emulation's). */
TGA static inline __m256i cvt16(const float *src, int n) {
    if (n <= 0) return _mm256_setzero_si256();
    __mmask16 m = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src));
}
TGA static inline __m256i cvt16s(const float *src, ptrdiff_t stride, int n) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = i < n ? src[i * stride] : 0.0f;
    return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(t));
}
/* 16 pairs: lo | hi << 16 */
TGA static inline __m512i pair16(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

/* r[i] (16 x 16 u32) := transpose, in registers. */
TGA static void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* now r[4b + j] holds, in each 128-bit lane L, rows 4L.. of column group: combine lanes */
    for (int i = 0; i < 8; i++) {
        int a = (i / 4) * 8 + (i % 4), b = a + 4;
        t[a] = _mm512_shuffle_i32x4(r[a], r[b], 0x88);
        t[b] = _mm512_shuffle_i32x4(r[a], r[b], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* One 16x16-pair block of an operand in "pair-row" order: out[i] (i < 16,
 * 16 u32 each) = pairs (X(i, 2q), X(i, 2q+1)) for q < 16, where X(i, k) is
 * element (r0 + i, k0 + k) of the view; rows >= h and k >= kv read as zero. */
TGA static void pairs_block(uint32_t *out, const float *p, ptrdiff_t rs, ptrdiff_t cs, int h, int kv) {
    __m512i r[16];
    if (cs == 1) { /* each row is contiguous in k */
        for (int i = 0; i < 16; i++) {
            if (i >= h) { r[i] = _mm512_setzero_si512(); continue; }
            const float *row = p + i * rs;
            __m256i a = cvt16(row, kv < 16 ? kv : 16), b = cvt16(row + 16, kv - 16);
            /* a holds k 0..15, b k 16..31 as bf16: as u32 pairs they are the row in order */
            r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        }
    } else if (rs == 1) { /* each k is contiguous in rows: build per-pair vectors, then transpose */
        for (int q = 0; q < 16; q++) {
            int k = 2 * q;
            __m256i lo = k < kv ? cvt16(p + k * cs, h) : _mm256_setzero_si256();
            __m256i hi = k + 1 < kv ? cvt16(p + (k + 1) * cs, h) : _mm256_setzero_si256();
            r[q] = pair16(lo, hi);
        }
        transpose16(r);
    } else {
        for (int q = 0; q < 16; q++) {
            int k = 2 * q;
            __m256i lo = k < kv ? cvt16s(p + k * cs, rs, h) : _mm256_setzero_si256();
            __m256i hi = k + 1 < kv ? cvt16s(p + (k + 1) * cs, rs, h) : _mm256_setzero_si256();
            r[q] = pair16(lo, hi);
        }
        transpose16(r);
    }
    for (int i = 0; i < 16; i++) _mm512_store_si512(out + 16 * i, r[i]);
}

/* Same block but with the roles of index and pair swapped, as the B tile
 * wants: out[q] (16 u32) = (X(k0 + 2q, n), X(k0 + 2q + 1, n)) for n < 16, with
 * X(k, n) = p[k*rs + n*cs]. */
TGA static void pairs_block_t(uint32_t *out, const float *p, ptrdiff_t rs, ptrdiff_t cs, int w, int kv) {
    __m512i r[16];
    if (cs == 1) {
        for (int q = 0; q < 16; q++) {
            int k = 2 * q;
            __m256i lo = k < kv ? cvt16(p + k * rs, w) : _mm256_setzero_si256();
            __m256i hi = k + 1 < kv ? cvt16(p + (k + 1) * rs, w) : _mm256_setzero_si256();
            r[q] = pair16(lo, hi);
        }
        for (int q = 0; q < 16; q++) _mm512_store_si512(out + 16 * q, r[q]);
        return;
    }
    /* k contiguous (rs == 1) or general: the transposed block of the pair-row form */
    pairs_block(out, p, cs, rs, w, kv);
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(out + 16 * i);
    transpose16(r);
    for (int i = 0; i < 16; i++) _mm512_store_si512(out + 16 * i, r[i]);
}

/* 2x2 C tiles over nk k-steps of 32. */
TGA static void block32(float *C, ptrdiff_t ldcb, const uint16_t *a0, const uint16_t *a1, const uint16_t *b0,
                        const uint16_t *b1, int nk, bool load) {
    if (load) {
        _tile_loadd(0, C, ldcb);
        _tile_loadd(1, C + 16, ldcb);
        _tile_loadd(2, (const char *)C + 16 * ldcb, ldcb);
        _tile_loadd(3, (const char *)C + 16 * ldcb + 64, ldcb);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int k = 0; k < nk; k++) {
        _tile_loadd(4, a0 + (size_t)k * 512, 64);
        _tile_loadd(6, b0 + (size_t)k * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b1 + (size_t)k * 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + (size_t)k * 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, C, ldcb);
    _tile_stored(1, C + 16, ldcb);
    _tile_stored(2, (char *)C + 16 * ldcb, ldcb);
    _tile_stored(3, (char *)C + 16 * ldcb + 64, ldcb);
}

/* The packed operands live in a per-thread scratch buffer (k_scratch):
 * products are called from the main thread and, for the experts, from inside
 * a parallel loop, and a fresh allocation per call cost page faults (about 6%
 * of a smol-50m step). */

TGA void k_gemm_amx(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc) {
    const int mb = (M + 31) / 32, nb = (N + 31) / 32, kb = (K + 31) / 32;
    const size_t asz = (size_t)mb * 2 * kb * 512, bsz = (size_t)nb * 2 * kb * 512; /* in bf16 */
    const bool nested = omp_in_parallel();
    uint16_t *buf = k_scratch(K_SCRATCH_AMX, (asz + bsz) * sizeof(uint16_t));
    uint16_t *Ap = buf, *Bp = buf + asz;
    const double work = (double)M * N * K;
    const bool par = !nested && work > 4e5 && omp_get_max_threads() > 1;
#pragma omp parallel if (par)
    {
        /* pack: A blocks (16 rows x 32 k), B blocks (32 k x 16 cols) */
#pragma omp for schedule(static) nowait
        for (int i = 0; i < mb * 2 * kb; i++) {
            int r0 = (i / kb) * 16, k0 = (i % kb) * 32;
            int h = M - r0 < 16 ? M - r0 : 16, kv = K - k0 < 32 ? K - k0 : 32;
            uint32_t *o = (uint32_t *)(Ap + (size_t)i * 512);
            if (h <= 0) memset(o, 0, 1024);
            else pairs_block(o, A.p + r0 * A.rs + k0 * A.cs, A.rs, A.cs, h, kv);
        }
#pragma omp for schedule(static)
        for (int i = 0; i < nb * 2 * kb; i++) {
            int n0 = (i / kb) * 16, k0 = (i % kb) * 32;
            int w = N - n0 < 16 ? N - n0 : 16, kv = K - k0 < 32 ? K - k0 : 32;
            uint32_t *o = (uint32_t *)(Bp + (size_t)i * 512);
            if (w <= 0) memset(o, 0, 1024);
            else pairs_block_t(o, B.p + k0 * B.rs + n0 * B.cs, B.rs, B.cs, w, kv);
        }
        config_tiles();
        float tmp[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int job = 0; job < mb * nb; job++) {
            int i = job / nb, j = job % nb;
            int m0 = 32 * i, n0 = 32 * j;
            int h = M - m0 < 32 ? M - m0 : 32, w = N - n0 < 32 ? N - n0 : 32;
            const uint16_t *a0 = Ap + (size_t)(2 * i) * kb * 512, *a1 = a0 + (size_t)kb * 512;
            const uint16_t *b0 = Bp + (size_t)(2 * j) * kb * 512, *b1 = b0 + (size_t)kb * 512;
            float *Cb = C + m0 * ldc + n0;
            if (h == 32 && w == 32) {
                block32(Cb, ldc * (ptrdiff_t)sizeof(float), a0, a1, b0, b1, kb, acc);
            } else {
                if (acc) {
                    memset(tmp, 0, sizeof tmp);
                    for (int r = 0; r < h; r++) memcpy(tmp + 32 * r, Cb + r * ldc, sizeof(float) * (size_t)w);
                }
                block32(tmp, 128, a0, a1, b0, b1, kb, acc);
                for (int r = 0; r < h; r++) memcpy(Cb + r * ldc, tmp + 32 * r, sizeof(float) * (size_t)w);
            }
        }
        _tile_release();
    }
}

#else
void k_gemm_amx(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc) {
    (void)C; (void)ldc; (void)M; (void)N; (void)K; (void)A; (void)B; (void)acc;
}
#endif
