/* gemm.c: the training matrix product; see kernels.h ("the training GEMM")
 * for the numerics.
 *
 * Blocking (GotoBLAS style): B is packed once per call into panels of NR
 * columns ([K][NR], zero-padded); each job (a block of MC rows x a range of
 * panels) packs its rows of A per KC slice into micro-panels of MR rows
 * ([KC][MR]) and runs an MR x NR register tile (24 zmm accumulators) over
 * them. A KC slice continues the chain from the stored C, so the blocking
 * never changes a result. In BF16 mode the packed operands are BF16 pairs
 * (k, k+1) and the tile uses vdpbf16ps. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernels/internal.h"
#include "util/common.h"

enum { MR = 12, NR = 32, KC = 256, MC = 96 };

static bool g_scalar = false;
void k_gemm_set_scalar(bool on) { g_scalar = on; }

bool k_gemm_bf16_available(void) { return k_cpu_bf16(); }

static bool g_amx_allowed = true;
void k_gemm_set_amx(bool on) { g_amx_allowed = on; }
bool k_gemm_amx_available(void) { return g_amx_allowed && k_cpu_amx(); }

/* Which tiles run (K3_ISA decides the path in force): AVX-512 tiles for both
 * modes (BF16 needs AVX512_BF16), AVX2+FMA tiles for F32; everything else is
 * the scalar reference. Every path gives the scalar reference's bits in F32. */
static k_isa tile_isa(k_gemm_mode mode) {
    if (g_scalar) return K_ISA_SCALAR;
    k_isa a = k_isa_active();
    if (a == K_ISA_AVX512 && (mode == K_GEMM_F32 || k_gemm_bf16_available())) return K_ISA_AVX512;
    if (a == K_ISA_AVX2 && mode == K_GEMM_F32) return K_ISA_AVX2;
    return K_ISA_SCALAR;
}

/* Not tile_isa: a test that forces the scalar reference does not change
 * what the CPU and the path in force can run. */
bool k_gemm_bf16_fast(void) { return k_isa_active() == K_ISA_AVX512 && k_gemm_bf16_available(); }

void k3_train_gemm_describe(char *buf, size_t n) {
    static const char *const f32[] = {"the scalar reference", "AVX2+FMA tiles (the scalar reference's bits)",
                                      "AVX-512 tiles (the scalar reference's bits)"};
    k_isa a = tile_isa(K_GEMM_F32);
    const char *bf = k_gemm_amx_available() ? "AMX-BF16 tiles" : "AVX512_BF16 (vdpbf16ps) tiles";
    if (!k_gemm_bf16_fast()) /* only the scalar emulation could run it: k3 train refuses */
        snprintf(buf, n, "F32 on %s; --bf16 refused (no AVX512_BF16 on this path)", f32[a < 3 ? a : 0]);
    else snprintf(buf, n, "F32 on %s, --bf16 on %s", f32[a < 3 ? a : 0], bf);
}

static inline float at(k_view v, ptrdiff_t i, ptrdiff_t j) { return v.p[i * v.rs + j * v.cs]; }

/* ---- BF16 helpers (shared by both paths, so the rounding is one function) ---- */

/* As VCVTNEPS2BF16: denormal inputs become a signed zero, NaN stays a
 * (quiet) NaN, everything else rounds to nearest even. */
static inline uint16_t to_bf16(float f) {
    if (fpclassify(f) == FP_SUBNORMAL) return signbit(f) ? 0x8000 : 0;
    return k3_f32_to_bf16(f);
}
static inline float ftz(float x) { return fpclassify(x) == FP_SUBNORMAL ? copysignf(0.0f, x) : x; }
static inline float bf(uint16_t h) { return k3_bf16_to_f32(h); }

/* ---- scalar reference ------------------------------------------------------------ */

static void gemm_scalar(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc,
                        k_gemm_mode mode, bool upper) {
#pragma omp parallel for schedule(static) if ((double)M * N * K > 1e5)
    for (int m = 0; m < M; m++)
        for (int n = upper ? m : 0; n < N; n++) {
            float c = acc ? C[m * ldc + n] : 0.0f;
            if (mode == K_GEMM_F32) {
                for (int k = 0; k < K; k++) c = fmaf(at(A, m, k), at(B, k, n), c);
            } else {
                c = ftz(c);
                for (int k = 0; k < K; k += 2) {
                    float a0 = bf(to_bf16(at(A, m, k))), b0 = bf(to_bf16(at(B, k, n)));
                    float a1 = k + 1 < K ? bf(to_bf16(at(A, m, k + 1))) : 0.0f;
                    float b1 = k + 1 < K ? bf(to_bf16(at(B, k + 1, n))) : 0.0f;
                    c = ftz(fmaf(a1, b1, c));
                    c = ftz(fmaf(a0, b0, c));
                }
            }
            C[m * ldc + n] = c;
        }
}

/* ---- packing (for the SIMD tiles: x86-64 only) ------------------------------------------ */

#if defined(__x86_64__)

#include <immintrin.h>

/* d[k * ldd + i] = s[i * lds + k] for rows i < width (zero past nrows) and
 * k < kc: the transposing copy both packers need when the operand's rows run
 * along k (X of X W^T as A, W of X W^T as B). In 8 x 8 register transposes;
 * pure data movement, so the product's bits are unchanged. Every x86 SIMD
 * tile runs on a CPU with AVX2. */
__attribute__((target("avx2"))) static void transpose_rows(float *d, int ldd, const float *s, ptrdiff_t lds,
                                                          int nrows, int width, int kc) {
    int k8 = kc & ~7;
    for (int g0 = 0; g0 < width; g0 += 8) {
        int gw = width - g0 < 8 ? width - g0 : 8;
        for (int k = 0; k < k8; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i < gw && g0 + i < nrows ? _mm256_loadu_ps(s + (g0 + i) * lds + k) : _mm256_setzero_ps();
            __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
            __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
            __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
            __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
            __m256 c[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                           _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                           _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                           _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
            for (int j = 0; j < 8; j++) {
                float *o = d + (size_t)(k + j) * ldd + g0;
                if (gw == 8) _mm256_storeu_ps(o, c[j]);
                else if (gw == 4) _mm_storeu_ps(o, _mm256_castps256_ps128(c[j]));
                else {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, c[j]);
                    memcpy(o, tmp, sizeof(float) * (size_t)gw);
                }
            }
        }
        for (int k = k8; k < kc; k++)
            for (int i = 0; i < gw; i++) d[(size_t)k * ldd + g0 + i] = g0 + i < nrows ? s[(g0 + i) * lds + k] : 0.0f;
    }
}

/* F32: panel p holds B(k, p*NR + j) at [k][j]; pairs: [k/2][j][2] as BF16. */
static void pack_b_f32(float *Bp, k_view B, int K, int N, int p) {
    float *d = Bp + (size_t)p * K * NR;
    int n0 = p * NR, w = N - n0 < NR ? N - n0 : NR;
    if (B.rs == 1 && B.cs != 1) { /* W^T viewed: row j of W is column j of B, along k */
        transpose_rows(d, NR, B.p + n0 * B.cs, B.cs, w, NR, K);
        return;
    }
    if (B.cs == 1) {
        for (int k = 0; k < K; k++) {
            const float *s = B.p + k * B.rs + n0;
            memcpy(d + (size_t)k * NR, s, sizeof(float) * (size_t)w);
            for (int j = w; j < NR; j++) d[(size_t)k * NR + j] = 0.0f;
        }
    } else {
        for (int j = 0; j < NR; j++)
            for (int k = 0; k < K; k++) d[(size_t)k * NR + j] = j < w ? at(B, k, n0 + j) : 0.0f;
    }
}

static void pack_b_bf16(uint16_t *Bp, k_view B, int K, int N, int p) {
    int K2 = (K + 1) / 2;
    uint16_t *d = Bp + (size_t)p * K2 * NR * 2;
    int n0 = p * NR, w = N - n0 < NR ? N - n0 : NR;
    for (int k = 0; k < 2 * K2; k++)
        for (int j = 0; j < NR; j++)
            d[((size_t)(k / 2) * NR + j) * 2 + (k & 1)] = (j < w && k < K) ? to_bf16(at(B, k, n0 + j)) : 0;
}

/* A rows m0..m0+rows, k0..k0+kc into micro-panels [rows/MR][kc][MR]. */
static void pack_a_f32(float *Ap, k_view A, int m0, int rows, int k0, int kc) {
    for (int t = 0; t < rows; t += MR) {
        float *d = Ap + (size_t)t * kc;
        int h = rows - t < MR ? rows - t : MR;
        if (A.rs == 1) { /* A^T stored: MR consecutive floats per k */
            for (int k = 0; k < kc; k++) {
                const float *s = A.p + (m0 + t) + (k0 + k) * A.cs;
                for (int r = 0; r < MR; r++) d[(size_t)k * MR + r] = r < h ? s[r] : 0.0f;
            }
            continue;
        }
        if (A.cs == 1) { /* rows along k */
            transpose_rows(d, MR, A.p + (m0 + t) * A.rs + k0, A.rs, h, MR, kc);
            continue;
        }
        for (int r = 0; r < MR; r++) {
            if (r >= h) {
                for (int k = 0; k < kc; k++) d[(size_t)k * MR + r] = 0.0f;
                continue;
            }
            const float *s = A.p + (m0 + t + r) * A.rs + k0 * A.cs; /* any other strides */
            for (int k = 0; k < kc; k++) d[(size_t)k * MR + r] = s[k * A.cs];
        }
    }
}

/* kc even except possibly at the end of K (then padded with a zero). */
static void pack_a_bf16(uint32_t *Ap, k_view A, int m0, int rows, int k0, int kc, int K) {
    int kc2 = (kc + 1) / 2;
    for (int t = 0; t < rows; t += MR) {
        uint32_t *d = Ap + (size_t)t * kc2;
        int h = rows - t < MR ? rows - t : MR;
        for (int r = 0; r < MR; r++)
            for (int q = 0; q < kc2; q++) {
                uint32_t v = 0;
                if (r < h) {
                    int k = k0 + 2 * q;
                    uint16_t lo = to_bf16(at(A, m0 + t + r, k));
                    uint16_t hi = k + 1 < K ? to_bf16(at(A, m0 + t + r, k + 1)) : 0;
                    v = (uint32_t)lo | ((uint32_t)hi << 16);
                }
                d[(size_t)q * MR + r] = v;
            }
    }
}

/* ---- AVX-512 tiles ------------------------------------------------------------------- */

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TGTBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")))
#define UNROLL _Pragma("GCC unroll 16")

/* n floats -> n BF16 (n <= 16 per call), the instruction's rounding. */
TGTBF static inline __m256i cvt16(const float *src, int n) {
    __mmask16 m = n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u);
    return (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src));
}
/* lo | hi << 16 for 16 BF16 pairs */
TGTBF static inline __m512i pair16(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

/* Vector packers for the layouts the training products use; other strides
 * take the scalar packers (same conversion, same bits). */
TGTBF static bool pack_b_bf16_v(uint16_t *Bp, k_view B, int K, int N, int p) {
    int K2 = (K + 1) / 2;
    uint32_t *d = (uint32_t *)(Bp + (size_t)p * K2 * NR * 2);
    int n0 = p * NR, w = N - n0 < NR ? N - n0 : NR;
    if (B.cs == 1) {
        for (int q = 0; q < K2; q++) {
            const float *r0 = B.p + (2 * q) * B.rs + n0, *r1 = r0 + B.rs;
            bool two = 2 * q + 1 < K;
            for (int h = 0; h < 2; h++) {
                int c = w - 16 * h;
                c = c < 0 ? 0 : c > 16 ? 16 : c;
                __m256i lo = cvt16(r0 + 16 * h, c), hi = two ? cvt16(r1 + 16 * h, c) : _mm256_setzero_si256();
                _mm512_storeu_si512(d + (size_t)q * NR + 16 * h, pair16(lo, hi));
            }
        }
        return true;
    }
    if (B.rs == 1) {
        for (int j = 0; j < NR; j++) {
            const float *row = B.p + (n0 + j) * B.cs;
            for (int q0 = 0; q0 < K2; q0 += 16) {
                uint32_t t[16];
                int c = 2 * (K2 - q0) < 32 ? 2 * (K2 - q0) : 32; /* floats of this block incl. padding */
                int valid = K - 2 * q0 < c ? K - 2 * q0 : c;
                if (j >= w) valid = 0;
                __m256i a = cvt16(row + 2 * q0, valid < 16 ? valid : 16);
                __m256i b = cvt16(row + 2 * q0 + 16, valid > 16 ? valid - 16 : 0);
                _mm256_storeu_si256((__m256i *)t, a);
                _mm256_storeu_si256((__m256i *)t + 1, b);
                for (int q = 0; q < c / 2; q++) d[(size_t)(q0 + q) * NR + j] = t[q];
            }
        }
        return true;
    }
    return false;
}

TGTBF static bool pack_a_bf16_v(uint32_t *Ap, k_view A, int m0, int rows, int k0, int kc, int K) {
    int kc2 = (kc + 1) / 2;
    if (A.cs == 1) {
        for (int t = 0; t < rows; t += MR) {
            uint32_t *d = Ap + (size_t)t * kc2;
            int h = rows - t < MR ? rows - t : MR;
            for (int r = 0; r < MR; r++) {
                const float *row = A.p + (m0 + t + r) * A.rs + k0;
                for (int q0 = 0; q0 < kc2; q0 += 16) {
                    uint32_t tt[16];
                    int c = 2 * (kc2 - q0) < 32 ? 2 * (kc2 - q0) : 32;
                    int valid = K - (k0 + 2 * q0) < c ? K - (k0 + 2 * q0) : c;
                    if (r >= h) valid = 0;
                    __m256i a = cvt16(row + 2 * q0, valid < 16 ? valid : 16);
                    __m256i b = cvt16(row + 2 * q0 + 16, valid > 16 ? valid - 16 : 0);
                    _mm256_storeu_si256((__m256i *)tt, a);
                    _mm256_storeu_si256((__m256i *)tt + 1, b);
                    for (int q = 0; q < c / 2; q++) d[(size_t)(q0 + q) * MR + r] = tt[q];
                }
            }
        }
        return true;
    }
    if (A.rs == 1) {
        for (int t = 0; t < rows; t += MR) {
            uint32_t *d = Ap + (size_t)t * kc2;
            int h = rows - t < MR ? rows - t : MR;
            for (int q = 0; q < kc2; q++) {
                int k = k0 + 2 * q;
                const float *r0 = A.p + (m0 + t) + k * A.cs;
                __m256i lo = cvt16(r0, h), hi = k + 1 < K ? cvt16(r0 + A.cs, h) : _mm256_setzero_si256();
                _mm512_mask_storeu_epi32(d + (size_t)q * MR, (__mmask16)((1u << MR) - 1u), pair16(lo, hi));
            }
        }
        return true;
    }
    return false;
}

/* The MR x NR block of C a tile accumulates in registers: columns past w
 * masked off, rows past h (and a first pass) start from zero and are never
 * stored. Shared by the F32 and BF16 tiles; always inlined so c stays in
 * registers. */
#define TINL static inline __attribute__((always_inline)) TGT
TINL void tile_begin(__m512 c[MR][2], __mmask16 *m0, __mmask16 *m1, const float *C, ptrdiff_t ldc, int h, int w,
                     bool first) {
    *m0 = w >= 16 ? 0xffff : (__mmask16)((1u << w) - 1u);
    *m1 = w >= 32 ? 0xffff : (w > 16 ? (__mmask16)((1u << (w - 16)) - 1u) : 0);
    UNROLL for (int r = 0; r < MR; r++) {
        if (first || r >= h) {
            c[r][0] = _mm512_setzero_ps();
            c[r][1] = _mm512_setzero_ps();
        } else {
            c[r][0] = _mm512_maskz_loadu_ps(*m0, C + r * ldc);
            c[r][1] = _mm512_maskz_loadu_ps(*m1, C + r * ldc + 16);
        }
    }
}
TINL void tile_end(float *C, ptrdiff_t ldc, int h, __mmask16 m0, __mmask16 m1, __m512 c[MR][2]) {
    UNROLL for (int r = 0; r < MR; r++) {
        if (r >= h) break;
        _mm512_mask_storeu_ps(C + r * ldc, m0, c[r][0]);
        _mm512_mask_storeu_ps(C + r * ldc + 16, m1, c[r][1]);
    }
}

/* C tile (h rows, w cols) at C; first: start from zero instead of C. */
TGT static void tile_f32(float *C, ptrdiff_t ldc, int h, int w, const float *Ap, const float *Bp, int kc,
                         bool first) {
    __m512 c[MR][2];
    __mmask16 m0, m1;
    tile_begin(c, &m0, &m1, C, ldc, h, w, first);
    for (int k = 0; k < kc; k++) {
        __m512 b0 = _mm512_loadu_ps(Bp + (size_t)k * NR), b1 = _mm512_loadu_ps(Bp + (size_t)k * NR + 16);
        const float *a = Ap + (size_t)k * MR;
        UNROLL for (int r = 0; r < MR; r++) {
            __m512 av = _mm512_set1_ps(a[r]);
            c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);
        }
    }
    tile_end(C, ldc, h, m0, m1, c);
}

/* The same over kc2 pairs; C is flushed to zero when denormal on entry, as
 * the instruction reads it. */
TGTBF static void tile_bf16(float *C, ptrdiff_t ldc, int h, int w, const uint32_t *Ap, const uint16_t *Bp,
                            int kc2, bool first) {
    __m512 c[MR][2];
    __mmask16 m0, m1;
    tile_begin(c, &m0, &m1, C, ldc, h, w, first);
    for (int q = 0; q < kc2; q++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(Bp + (size_t)q * NR * 2);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(Bp + (size_t)q * NR * 2 + 32);
        const uint32_t *a = Ap + (size_t)q * MR;
        UNROLL for (int r = 0; r < MR; r++) {
            __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r]);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], av, b0);
            c[r][1] = _mm512_dpbf16_ps(c[r][1], av, b1);
        }
    }
    tile_end(C, ldc, h, m0, m1, c);
}

/* ---- AVX2 + FMA tile (F32) -------------------------------------------------------------
 * The same MR x NR tile over the same packed panels, in blocks of 6 rows x
 * 16 columns: 12 ymm accumulators, two B vectors and one broadcast fit the 16
 * registers, and each k costs 8 loads for 12 FMAs (a 12 x 8 block needs 13),
 * reading each B row's 64 bytes at once. Each C element still sees its FMAs
 * in k order from C (or zero). */

#define TGT2 __attribute__((target("avx2,fma")))

TGT2 static inline __m256i avx2_mask(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* rows [r0, r0 + 6) x columns [c0, c0 + 8 * nv) of the tile, nv = 1 or 2 */
TGT2 static inline void block_f32_avx2(float *C, ptrdiff_t ldc, int hr, int w, const float *Ap, const float *Bp,
                                       int kc, bool first, int r0, int c0, const int nv) {
    __m256i m0 = avx2_mask(w - c0), m1 = avx2_mask(w - c0 - 8);
    __m256 x[6], y[6];
    UNROLL for (int r = 0; r < 6; r++) {
        bool z = first || r >= hr;
        x[r] = z ? _mm256_setzero_ps() : _mm256_maskload_ps(C + (r0 + r) * ldc + c0, m0);
        y[r] = (z || nv < 2) ? _mm256_setzero_ps() : _mm256_maskload_ps(C + (r0 + r) * ldc + c0 + 8, m1);
    }
    if (nv == 2) {
        for (int k = 0; k < kc; k++) {
            __m256 b0 = _mm256_loadu_ps(Bp + (size_t)k * NR + c0), b1 = _mm256_loadu_ps(Bp + (size_t)k * NR + c0 + 8);
            const float *a = Ap + (size_t)k * MR + r0;
            UNROLL for (int r = 0; r < 6; r++) {
                __m256 av = _mm256_broadcast_ss(a + r);
                x[r] = _mm256_fmadd_ps(av, b0, x[r]);
                y[r] = _mm256_fmadd_ps(av, b1, y[r]);
            }
        }
    } else {
        for (int k = 0; k < kc; k++) {
            __m256 b0 = _mm256_loadu_ps(Bp + (size_t)k * NR + c0);
            const float *a = Ap + (size_t)k * MR + r0;
            UNROLL for (int r = 0; r < 6; r++) x[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + r), b0, x[r]);
        }
    }
    UNROLL for (int r = 0; r < 6; r++) {
        if (r >= hr) break;
        _mm256_maskstore_ps(C + (r0 + r) * ldc + c0, m0, x[r]);
        if (nv == 2) _mm256_maskstore_ps(C + (r0 + r) * ldc + c0 + 8, m1, y[r]);
    }
}

TGT2 static void tile_f32_avx2(float *C, ptrdiff_t ldc, int h, int w, const float *Ap, const float *Bp, int kc,
                               bool first) {
    for (int r0 = 0; r0 < h; r0 += 6)
        for (int c0 = 0; c0 < w; c0 += 16) {
            if (w - c0 > 8) block_f32_avx2(C, ldc, h - r0, w, Ap, Bp, kc, first, r0, c0, 2);
            else block_f32_avx2(C, ldc, h - r0, w, Ap, Bp, kc, first, r0, c0, 1);
        }
}
#endif

/* ---- driver --------------------------------------------------------------------------- */

/* upper: only the elements on or above the diagonal are needed (tiles wholly
 * below it are skipped; the elements computed are computed as always). */
static void gemm(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc, k_gemm_mode mode,
                 bool upper) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!acc)
            for (int m = 0; m < M; m++) memset(C + m * ldc, 0, sizeof(float) * (size_t)N);
        return;
    }
#if defined(__x86_64__)
    const k_isa isa = tile_isa(mode);
    bool simd = isa != K_ISA_SCALAR;
#else
    bool simd = false;
#endif
    if (simd && mode == K_GEMM_BF16 && k_gemm_amx_available()) {
        k_gemm_amx(C, ldc, M, N, K, A, B, acc);
        return;
    }
    if (!simd) {
        gemm_scalar(C, ldc, M, N, K, A, B, acc, mode, upper);
        return;
    }
#if defined(__x86_64__)
    const int np = (N + NR - 1) / NR, K2 = (K + 1) / 2;
    const bool bfm = mode == K_GEMM_BF16;
    const size_t bsz = bfm ? (size_t)np * K2 * NR * 2 * sizeof(uint16_t) : (size_t)np * K * NR * sizeof(float);
    void *Bp = xmalloc_aligned(bsz);
    const double work = (double)M * N * K;
    const bool par = work > 2e5 && omp_get_max_threads() > 1 && !omp_in_parallel();
#pragma omp parallel for schedule(static) if (par)
    for (int p = 0; p < np; p++) {
        if (bfm) { if (!pack_b_bf16_v(Bp, B, K, N, p)) pack_b_bf16(Bp, B, K, N, p); }
        else pack_b_f32(Bp, B, K, N, p);
    }
    /* jobs: row blocks x panel ranges, at least 4 per thread when possible */
    const int nmb = (M + MC - 1) / MC;
    int nth = par ? omp_get_max_threads() : 1;
    int nsplit = 1;
    while (nmb * nsplit < 4 * nth && nsplit < np) nsplit++;
    const int ppj = (np + nsplit - 1) / nsplit;
    nsplit = (np + ppj - 1) / ppj;
#pragma omp parallel if (par)
    {
        void *Ap = xmalloc_aligned((size_t)MC * KC * sizeof(float));
#pragma omp for schedule(dynamic)
        for (int job = 0; job < nmb * nsplit; job++) {
            int m0 = (job / nsplit) * MC, rows = M - m0 < MC ? M - m0 : MC;
            int p0 = (job % nsplit) * ppj, p1 = p0 + ppj < np ? p0 + ppj : np;
            for (int k0 = 0; k0 < K; k0 += KC) {
                int kc = K - k0 < KC ? K - k0 : KC;
                bool first = k0 == 0 && !acc;
                if (bfm) { if (!pack_a_bf16_v(Ap, A, m0, rows, k0, kc, K)) pack_a_bf16(Ap, A, m0, rows, k0, kc, K); }
                else pack_a_f32(Ap, A, m0, rows, k0, kc);
                int kc2 = (kc + 1) / 2;
                for (int p = p0; p < p1; p++) {
                    int n0 = p * NR, w = N - n0 < NR ? N - n0 : NR;
                    for (int t = 0; t < rows; t += MR) {
                        int h = rows - t < MR ? rows - t : MR;
                        if (upper && n0 + w <= m0 + t) continue; /* wholly below the diagonal */
                        float *Ct = C + (m0 + t) * ldc + n0;
                        if (bfm)
                            tile_bf16(Ct, ldc, h, w, (const uint32_t *)Ap + (size_t)t * kc2,
                                      (const uint16_t *)Bp + ((size_t)p * K2 + k0 / 2) * NR * 2, kc2, first);
                        else if (isa == K_ISA_AVX2)
                            tile_f32_avx2(Ct, ldc, h, w, (const float *)Ap + (size_t)t * kc,
                                          (const float *)Bp + ((size_t)p * K + k0) * NR, kc, first);
                        else
                            tile_f32(Ct, ldc, h, w, (const float *)Ap + (size_t)t * kc,
                                     (const float *)Bp + ((size_t)p * K + k0) * NR, kc, first);
                    }
                }
            }
        }
        free(Ap);
    }
    free(Bp);
#endif
}

void k_gemm(float *C, ptrdiff_t ldc, int M, int N, int K, k_view A, k_view B, bool acc, k_gemm_mode mode) {
    gemm(C, ldc, M, N, K, A, B, acc, mode, false);
}

/* An F32 element is one fma chain over k, and fma(a, b, c) == fma(b, a, c),
 * so when A B is symmetric by construction (X X^T, or S S for a symmetric S)
 * element (j, i) is the same chain as (i, j): computing the upper triangle
 * and copying it down gives exactly the full product's bits. The BF16 modes
 * make no such promise (AMX accumulates in its own order), so they compute
 * every element. */
void k_gemm_sym(float *C, ptrdiff_t ldc, int M, int K, k_view A, k_view B, k_gemm_mode mode) {
    if (mode != K_GEMM_F32) {
        k_gemm(C, ldc, M, M, K, A, B, false, mode);
        return;
    }
    gemm(C, ldc, M, M, K, A, B, false, mode, true);
    for (int i = 1; i < M; i++)
        for (int j = 0; j < i; j++) C[(ptrdiff_t)i * ldc + j] = C[(ptrdiff_t)j * ldc + i];
}
