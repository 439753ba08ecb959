/* kernels_avx512.c: the AVX-512 primitive table. Every function repeats the
 * scalar reference of kernels.c / kernels.h (km_*) operation for operation, so the
 * bits are identical: 16-lane dots use one zmm accumulator (lane l holds
 * elements l, l+16, ...), tails use masked FMAs that leave unused lanes
 * untouched, and the same 8-4-2-1 tree closes every dot. exp/tanh/sigmoid
 * are the km_* algorithms of kernels.h lane by lane.
 *
 * The functions carry target attributes and are reached only through
 * k_ops() after a CPUID check, so the binary still runs without AVX-512. */
#if defined(__x86_64__)

#include "kernels/internal.h"

#include "util/common.h"

#include <immintrin.h>
#include <string.h>

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define INL static inline __attribute__((always_inline)) TGT

#define UNROLL _Pragma("GCC unroll 16")

INL __mmask16 tailmask(int r) { return (__mmask16)((1u << r) - 1u); }

INL float tree(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); /* l += l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));      /* l += l+4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                       /* l += l+2 */
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));                                        /* l += l+1 */
    return _mm_cvtss_f32(d);
}

/* ---- math, lane by lane as km_* --------------------------------------------------- */

INL __m512 v_exp(__m512 x) {
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(KM_EXP_LO));
    xc = _mm512_min_ps(xc, _mm512_set1_ps(KM_EXP_HI));
    __m512 kf = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(KM_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(KM_LN2_HI), xc);
    r = _mm512_fnmadd_ps(kf, _mm512_set1_ps(KM_LN2_LO), r);
    __m512 p = _mm512_set1_ps(KM_E7);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_E6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_E5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_E4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_E3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KM_E2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512i k = _mm512_cvtps_epi32(kf);
    __m512i k1 = _mm512_srai_epi32(k, 1), k2 = _mm512_sub_epi32(k, k1);
    __m512i b127 = _mm512_set1_epi32(127);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k1, b127), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(k2, b127), 23));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    return _mm512_mask_blend_ps(nan, y, _mm512_add_ps(x, x));
}

INL __m512 v_neg(__m512 x) { return _mm512_xor_ps(x, _mm512_set1_ps(-0.0f)); }

INL __m512 v_sigmoid(__m512 x) {
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, v_exp(v_neg(x))));
}

INL __m512 v_tanh(__m512 x) {
    __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 a = _mm512_andnot_ps(sign, x);
    __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(KM_TANH_SMALL), _CMP_LT_OQ);
    __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(KM_T5);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KM_T4));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KM_T3));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KM_T2));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KM_T1));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KM_T0));
    __m512 ys = _mm512_fmadd_ps(_mm512_mul_ps(x, z), p, x);
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = v_exp(_mm512_add_ps(a, a));
    __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    __m512 yl = _mm512_or_ps(_mm512_andnot_ps(sign, t), _mm512_and_ps(sign, x)); /* copysign */
    return _mm512_mask_blend_ps(small, yl, ys);
}

/* ---- primitives ---------------------------------------------------------------------- */

TGT static float v_dot(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
    if (j < n) {
        __mmask16 m = tailmask(n - j);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, a + j), _mm512_maskz_loadu_ps(m, b + j), acc, m);
    }
    return tree(acc);
}

TGT static float v_sum(const float *x, int n) {
    __m512 acc = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
    if (j < n) {
        __mmask16 m = tailmask(n - j);
        acc = _mm512_mask_add_ps(acc, m, acc, _mm512_maskz_loadu_ps(m, x + j));
    }
    return tree(acc);
}

/* Elementwise loops: full vectors, then one masked vector; lanes beyond n
 * are computed on zeros and never stored. */
#define ELEMWISE(n, BODY)                                                  \
    do {                                                                   \
        int j_ = 0;                                                        \
        for (; j_ + 16 <= (n); j_ += 16) {                                 \
            __mmask16 m = 0xffff;                                          \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
        if (j_ < (n)) {                                                    \
            __mmask16 m = tailmask((n) - j_);                              \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
    } while (0)
#define LD(p) _mm512_maskz_loadu_ps(m, (p) + j)
#define ST(p, v) _mm512_mask_storeu_ps((p) + j, m, (v))

TGT static void v_axpy(float *y, float a, const float *x, int n) {
    __m512 va = _mm512_set1_ps(a);
    ELEMWISE(n, ST(y, _mm512_fmadd_ps(va, LD(x), LD(y))));
}
TGT static void v_vfma(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm512_fmadd_ps(LD(a), LD(b), LD(y))));
}
TGT static void v_scale(float *y, const float *x, float s, int n) {
    __m512 vs = _mm512_set1_ps(s);
    ELEMWISE(n, ST(y, _mm512_mul_ps(LD(x), vs)));
}
TGT static void v_vmul(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm512_mul_ps(LD(a), LD(b))));
}
TGT static void v_vadd(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm512_add_ps(LD(a), LD(b))));
}
TGT static void v_vexp(float *y, const float *x, int n) { ELEMWISE(n, ST(y, v_exp(LD(x)))); }
TGT static void v_subscale(float *y, const float *a, const float *b, float s, int n) {
    __m512 vs = _mm512_set1_ps(s);
    ELEMWISE(n, ST(y, _mm512_mul_ps(_mm512_sub_ps(LD(a), LD(b)), vs)));
}
TGT static void v_divs(float *y, const float *x, float d, int n) {
    __m512 vd = _mm512_set1_ps(d);
    ELEMWISE(n, ST(y, _mm512_div_ps(LD(x), vd)));
}
TGT static void v_silu(float *x, int n) {
    __m512 one = _mm512_set1_ps(1.0f);
    ELEMWISE(n, {
        __m512 v = LD(x);
        ST(x, _mm512_div_ps(v, _mm512_add_ps(one, v_exp(v_neg(v)))));
    });
}
TGT static void v_situ(float *out, const float *gate, const float *up, int n, float b1, float b2) {
    __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2);
    ELEMWISE(n, {
        __m512 a = LD(gate);
        __m512 g = _mm512_mul_ps(_mm512_mul_ps(vb1, v_tanh(_mm512_div_ps(a, vb1))), v_sigmoid(a));
        __m512 u = _mm512_mul_ps(vb2, v_tanh(_mm512_div_ps(LD(up), vb2)));
        ST(out, _mm512_mul_ps(g, u));
    });
}
TGT static void v_sigmoid_mul(float *y, const float *gate, int n) {
    ELEMWISE(n, ST(y, _mm512_mul_ps(LD(y), v_sigmoid(LD(gate)))));
}

/* C += A B panels for the chunked KDA: 4 rows x 32 columns of C stay in
 * registers while k runs, so each element still sees its FMAs in k order. */
TGT static void v_gemm_acc(float *C, int ldc, int M, int N, const float *A, int sam, int sak, int K,
                           const float *B, int ldb) {
    for (int j = 0; j < N; j += 32) {
        __mmask16 m0 = N - j >= 16 ? 0xffff : tailmask(N - j);
        __mmask16 m1 = N - j >= 32 ? 0xffff : (N - j > 16 ? tailmask(N - j - 16) : 0);
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            __m512 c[4][2];
            UNROLL for (int r = 0; r < 4; r++) {
                c[r][0] = _mm512_maskz_loadu_ps(m0, C + (size_t)(m + r) * ldc + j);
                c[r][1] = _mm512_maskz_loadu_ps(m1, C + (size_t)(m + r) * ldc + j + 16);
            }
            for (int k = 0; k < K; k++) {
                __m512 b0 = _mm512_maskz_loadu_ps(m0, B + (size_t)k * ldb + j);
                __m512 b1 = _mm512_maskz_loadu_ps(m1, B + (size_t)k * ldb + j + 16);
                UNROLL for (int r = 0; r < 4; r++) {
                    __m512 a = _mm512_set1_ps(A[(size_t)(m + r) * sam + (size_t)k * sak]);
                    c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
                    c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
                }
            }
            UNROLL for (int r = 0; r < 4; r++) {
                _mm512_mask_storeu_ps(C + (size_t)(m + r) * ldc + j, m0, c[r][0]);
                _mm512_mask_storeu_ps(C + (size_t)(m + r) * ldc + j + 16, m1, c[r][1]);
            }
        }
        for (; m < M; m++) {
            __m512 c0 = _mm512_maskz_loadu_ps(m0, C + (size_t)m * ldc + j);
            __m512 c1 = _mm512_maskz_loadu_ps(m1, C + (size_t)m * ldc + j + 16);
            for (int k = 0; k < K; k++) {
                __m512 a = _mm512_set1_ps(A[(size_t)m * sam + (size_t)k * sak]);
                c0 = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m0, B + (size_t)k * ldb + j), c0);
                c1 = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(m1, B + (size_t)k * ldb + j + 16), c1);
            }
            _mm512_mask_storeu_ps(C + (size_t)m * ldc + j, m0, c0);
            _mm512_mask_storeu_ps(C + (size_t)m * ldc + j + 16, m1, c1);
        }
    }
}

/* Recurrent KDA row sweeps with u / o (and d) held in registers for the
 * common head dims (D = 16 ND, ND <= 8); the same elementwise operations in
 * the same order as the scalar sweeps, so the same bits. */
#define KDA_ROWS(ND)                                                                              \
    TGT static void kda_decay_##ND(float *S, const float *a, const float *k, float *u) {         \
        __m512 acc[ND];                                                                           \
        UNROLL for (int v = 0; v < ND; v++) acc[v] = _mm512_loadu_ps(u + 16 * v);                 \
        for (int i = 0; i < 16 * ND; i++) {                                                       \
            float *Si = S + (size_t)i * 16 * ND;                                                  \
            __m512 ai = _mm512_set1_ps(a[i]), ki = _mm512_set1_ps(k[i]);                          \
            UNROLL for (int v = 0; v < ND; v++) {                                                 \
                __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(Si + 16 * v), ai);                      \
                _mm512_storeu_ps(Si + 16 * v, sv);                                                \
                acc[v] = _mm512_fmadd_ps(ki, sv, acc[v]);                                         \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int v = 0; v < ND; v++) _mm512_storeu_ps(u + 16 * v, acc[v]);                 \
    }                                                                                             \
    TGT static void kda_write_##ND(float *S, const float *k, const float *d, const float *qs, float *o) { \
        __m512 acc[ND], dv[ND];                                                                   \
        UNROLL for (int v = 0; v < ND; v++) {                                                     \
            acc[v] = _mm512_loadu_ps(o + 16 * v);                                                 \
            dv[v] = _mm512_loadu_ps(d + 16 * v);                                                  \
        }                                                                                         \
        for (int i = 0; i < 16 * ND; i++) {                                                       \
            float *Si = S + (size_t)i * 16 * ND;                                                  \
            __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(qs[i]);                         \
            UNROLL for (int v = 0; v < ND; v++) {                                                 \
                __m512 sv = _mm512_fmadd_ps(ki, dv[v], _mm512_loadu_ps(Si + 16 * v));             \
                _mm512_storeu_ps(Si + 16 * v, sv);                                                \
                acc[v] = _mm512_fmadd_ps(qi, sv, acc[v]);                                         \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int v = 0; v < ND; v++) _mm512_storeu_ps(o + 16 * v, acc[v]);                 \
    }
KDA_ROWS(1)
KDA_ROWS(2)
KDA_ROWS(4)
KDA_ROWS(8)

/* The write sweep of one step and the decay sweep of the next in one pass
 * (o, u2 and d in registers): each row of S is read and written once per
 * step instead of twice, the same elementwise operations in the same order. */
#define KDA_WD(ND)                                                                                \
    TGT static void kda_wd_##ND(float *S, const float *k, const float *d, const float *qs, float *o, \
                                const float *a2, const float *k2, float *u2) {                    \
        __m512 ao[ND], au[ND], dv[ND];                                                            \
        UNROLL for (int v = 0; v < ND; v++) {                                                     \
            ao[v] = _mm512_loadu_ps(o + 16 * v);                                                  \
            au[v] = _mm512_loadu_ps(u2 + 16 * v);                                                 \
            dv[v] = _mm512_loadu_ps(d + 16 * v);                                                  \
        }                                                                                         \
        for (int i = 0; i < 16 * ND; i++) {                                                       \
            float *Si = S + (size_t)i * 16 * ND;                                                  \
            __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(qs[i]);                         \
            __m512 ai = _mm512_set1_ps(a2[i]), k2i = _mm512_set1_ps(k2[i]);                       \
            UNROLL for (int v = 0; v < ND; v++) {                                                 \
                __m512 sv = _mm512_fmadd_ps(ki, dv[v], _mm512_loadu_ps(Si + 16 * v));             \
                ao[v] = _mm512_fmadd_ps(qi, sv, ao[v]);                                           \
                sv = _mm512_mul_ps(sv, ai);                                                       \
                _mm512_storeu_ps(Si + 16 * v, sv);                                                \
                au[v] = _mm512_fmadd_ps(k2i, sv, au[v]);                                          \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int v = 0; v < ND; v++) {                                                     \
            _mm512_storeu_ps(o + 16 * v, ao[v]);                                                  \
            _mm512_storeu_ps(u2 + 16 * v, au[v]);                                                 \
        }                                                                                         \
    }
KDA_WD(1)
KDA_WD(2)
KDA_WD(4)
KDA_WD(8)

TGT static void v_kda_rows_decay(float *S, int D, const float *a, const float *k, float *u) {
    switch (D) {
    case 16: kda_decay_1(S, a, k, u); return;
    case 32: kda_decay_2(S, a, k, u); return;
    case 64: kda_decay_4(S, a, k, u); return;
    case 128: kda_decay_8(S, a, k, u); return;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_scale(Si, Si, a[i], D);
        v_axpy(u, k[i], Si, D);
    }
}
TGT static void v_kda_rows_write(float *S, int D, const float *k, const float *d, const float *qs, float *o) {
    switch (D) {
    case 16: kda_write_1(S, k, d, qs, o); return;
    case 32: kda_write_2(S, k, d, qs, o); return;
    case 64: kda_write_4(S, k, d, qs, o); return;
    case 128: kda_write_8(S, k, d, qs, o); return;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_axpy(Si, k[i], d, D);
        v_axpy(o, qs[i], Si, D);
    }
}

TGT static void v_kda_rows_write_decay(float *S, int D, const float *k, const float *d, const float *qs, float *o,
                                       const float *a2, const float *k2, float *u2) {
    switch (D) {
    case 16: kda_wd_1(S, k, d, qs, o, a2, k2, u2); return;
    case 32: kda_wd_2(S, k, d, qs, o, a2, k2, u2); return;
    case 64: kda_wd_4(S, k, d, qs, o, a2, k2, u2); return;
    case 128: kda_wd_8(S, k, d, qs, o, a2, k2, u2); return;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_axpy(Si, k[i], d, D);
        v_axpy(o, qs[i], Si, D);
        v_scale(Si, Si, a2[i], D);
        v_axpy(u2, k2[i], Si, D);
    }
}

/* out[p] = dot(x, B + p ldb): 8 rows side by side (independent chains hide
 * the FMA latency), each in the canonical order. */
TGT static void v_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len) {
    int p = 0;
    for (; p + 8 <= rows; p += 8) {
        __m512 acc[8];
        UNROLL for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
        int j = 0;
        for (; j + 16 <= len; j += 16) {
            __m512 xv = _mm512_loadu_ps(x + j);
            UNROLL for (int i = 0; i < 8; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(B + (size_t)(p + i) * ldb + j), xv, acc[i]);
        }
        if (j < len) {
            __mmask16 m = tailmask(len - j);
            __m512 xv = _mm512_maskz_loadu_ps(m, x + j);
            UNROLL for (int i = 0; i < 8; i++)
                acc[i] = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m, B + (size_t)(p + i) * ldb + j), xv, acc[i], m);
        }
        UNROLL for (int i = 0; i < 8; i++) out[p + i] = tree(acc[i]);
    }
    for (; p < rows; p++) out[p] = v_dot(x, B + (size_t)p * ldb, len);
}

/* ---- products ---------------------------------------------------------------------------
 * A tile is RB weight rows x TB inputs with one zmm accumulator per pair,
 * sweeping the columns in 16-wide steps: each accumulator sees its row's
 * elements in the canonical order, and the tile shape only changes which
 * independent dots run side by side (to hide FMA latency and to decode a
 * weight vector once for TB inputs). */

typedef struct {
    const k3_mat *W;
    const float *X;
    const float *aux; /* MXFP4: X with each 16-block in the decode's lane order */
    float *Y;
    int cols, rows;
} prod;

/* weight vector: 16 columns starting at j of a row; m masks a tail */
INL __m512 ld_f32(const void *row, int j, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)row + j);
}
/* BF16 -> f32 is the 16 bits placed high in a zeroed dword: for a full
 * vector one zero-masked word permute does it (one shuffle instead of a
 * widen and a shift, which matters where the FMAs are the bottleneck);
 * a tail uses the masked load and widens. Both are exact. */
INL __m512 ld_bf16(const void *row, int j, __mmask16 m) {
    if (m == 0xffff) {
        const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5,
                                             0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
        return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi256_si512(h)));
    }
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)row + j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* MXFP4 decode in a permuted lane order. The 8 bytes holding elements
 * j..j+15 are broadcast as one qword: dword lane 2i then holds bytes 0-3 and
 * lane 2i+1 bytes 4-7, so shifting both by 4i leaves in the low nibble the
 * code of element i (lane 2i) and of element 8+i (lane 2i+1). A permute
 * reads only those 4 index bits to look the value up in the E2M1 table
 * already multiplied by the group scale (exact: a power of two).
 * The canonical order only asks that each accumulator lane see the elements
 * of one residue class mod 16 in increasing order; a fixed permutation of the
 * lanes, applied to x as well (prepare) and undone before the tree, keeps
 * every lane's sequence of FMAs, hence the bits. Costs per 16 weights: one
 * broadcast load, one shift, one permute, one FMA. */
INL __m512i mx_shifts(void) {
    return _mm512_set_epi32(28, 28, 24, 24, 20, 20, 16, 16, 12, 12, 8, 8, 4, 4, 0, 0);
}
INL __m512 w_mx(const uint8_t *row, int j, __m512 lut, __m512i sh) {
    long long q;
    memcpy(&q, row + j / 2, 8);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi64(q), sh), lut);
}
/* lane l of a permuted accumulator holds canonical lane pi(l): pi(2i) = i,
 * pi(2i+1) = 8 + i; this gathers them back to canonical positions. */
INL __m512 mx_unpermute(__m512 acc) {
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0), acc);
}

static float e8m0_tab[256];
__attribute__((constructor)) static void e8m0_init(void) {
    for (int s = 0; s < 256; s++) e8m0_tab[s] = k_e8m0((uint8_t)s);
}

/* ---- many canonical trees at once ----------------------------------------
 * The tree of kernels.h (acc[l] += acc[l+s] for s = 8, 4, 2, 1) for 16 (8, 4)
 * accumulators together: each level adds the same two lanes as the scalar
 * tree (float addition is commutative, so which operand comes first does not
 * matter), two accumulators per instruction; 15 adds and 30 shuffles for 16
 * trees instead of about 9 instructions per tree. After the four levels lane
 * 4q + j holds tree(x[4j + q]); one permute puts tree(x[k]) in lane k. */
INL __m512 lv8(__m512 a, __m512 b) { /* a[l] + a[l+8] | b[l] + b[l+8] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
INL __m512 lv4(__m512 a, __m512 b) { /* per 8-lane half: v[l] + v[l+4] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
INL __m512 lv2(__m512 a, __m512 b) { /* per 4-lane quarter of a, b: w[l] + w[l+2] */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
INL __m512 lv1(__m512 a, __m512 b) { /* per pair: x[0] + x[1] */
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
INL __m512i trees_order(void) { /* lane k <- lane 4 (k % 4) + k / 4 */
    return _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
}
/* lane k = tree(x[k]), k < 16 */
INL __m512 trees16(const __m512 *x) {
    __m512 c[8], g[4];
    UNROLL for (int i = 0; i < 8; i++) c[i] = lv8(x[2 * i], x[2 * i + 1]);
    UNROLL for (int i = 0; i < 4; i++) g[i] = lv4(c[2 * i], c[2 * i + 1]);
    return _mm512_permutexvar_ps(trees_order(), lv1(lv2(g[0], g[1]), lv2(g[2], g[3])));
}
/* lane k = tree(x[k]), k < 8 (upper lanes: copies) */
INL __m512 trees8(const __m512 *x) {
    __m512 c[4];
    UNROLL for (int i = 0; i < 4; i++) c[i] = lv8(x[2 * i], x[2 * i + 1]);
    __m512 j = lv2(lv4(c[0], c[1]), lv4(c[2], c[3]));
    return _mm512_permutexvar_ps(trees_order(), lv1(j, j));
}
/* lane k = tree(x[k]), k < 4 */
INL __m512 trees4(const __m512 *x) {
    __m512 g = lv4(lv8(x[0], x[1]), lv8(x[2], x[3]));
    __m512 j = lv2(g, g);
    return _mm512_permutexvar_ps(trees_order(), lv1(j, j));
}

/* Closes a tile: Y[t0 + t][r + i] = tree(ACC(i, t)). Tiles of 4 or 8 rows
 * reduce their accumulators 16 (8, 4) at a time in input-major order, so each
 * input's RB results are contiguous in Y; single-row tiles use the tree. */
#define Y_AT(t) (P->Y + (size_t)(t0 + (t)) * (size_t)P->rows + (size_t)r)
#define TILE_STORE(RB, TB, ACC)                                                                \
    do {                                                                                       \
        if (RB == 4 || RB == 8) {                                                              \
            __m512 x_[RB * TB];                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                                \
                UNROLL for (int i = 0; i < RB; i++) x_[RB * t + i] = ACC(i, t);                \
            int k_ = 0;                                                                        \
            UNROLL for (; k_ + 16 <= RB * TB; k_ += 16) {                                      \
                __m512 v = trees16(x_ + k_);                                                   \
                if (RB == 4) {                                                                 \
                    _mm_storeu_ps(Y_AT(k_ / 4), _mm512_castps512_ps128(v));                    \
                    _mm_storeu_ps(Y_AT(k_ / 4 + 1), _mm512_extractf32x4_ps(v, 1));             \
                    _mm_storeu_ps(Y_AT(k_ / 4 + 2), _mm512_extractf32x4_ps(v, 2));             \
                    _mm_storeu_ps(Y_AT(k_ / 4 + 3), _mm512_extractf32x4_ps(v, 3));             \
                } else {                                                                       \
                    _mm256_storeu_ps(Y_AT(k_ / 8), _mm512_castps512_ps256(v));                 \
                    _mm256_storeu_ps(Y_AT(k_ / 8 + 1), _mm512_extractf32x8_ps(v, 1));          \
                }                                                                              \
            }                                                                                  \
            if (RB * TB - k_ >= 8) {                                                           \
                __m512 v = trees8(x_ + k_);                                                    \
                if (RB == 4) {                                                                 \
                    _mm_storeu_ps(Y_AT(k_ / 4), _mm512_castps512_ps128(v));                    \
                    _mm_storeu_ps(Y_AT(k_ / 4 + 1), _mm512_extractf32x4_ps(v, 1));             \
                } else {                                                                       \
                    _mm256_storeu_ps(Y_AT(k_ / 8), _mm512_castps512_ps256(v));                 \
                }                                                                              \
                k_ += 8;                                                                       \
            }                                                                                  \
            if (RB == 4 && RB * TB - k_ >= 4)                                                  \
                _mm_storeu_ps(Y_AT(k_ / 4), _mm512_castps512_ps128(trees4(x_ + k_)));          \
        } else {                                                                               \
            UNROLL for (int i = 0; i < RB; i++)                                                \
                UNROLL for (int t = 0; t < TB; t++) Y_AT(t)[i] = tree(ACC(i, t));              \
        }                                                                                      \
    } while (0)

/* Prefetch distance of the matrix-vector tiles (k_mv_prefetch), measured on
 * a Sapphire Rapids Xeon. */
#ifndef K_PF_BYTES
#define K_PF_BYTES ((size_t)24 * 1024)
#endif

#define ACC_PLAIN(i, t) acc[i][t]
#define ACC_MX(i, t) mx_unpermute(acc[i][t])

#define TILE_BODY(RB, TB, LD, ESZ)                                                             \
    const int cols = P->cols;                                                                  \
    const char *wr[RB];                                                                        \
    const float *xr[TB];                                                                       \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        wr[i] = (const char *)P->W->data + (size_t)(r + i) * (size_t)cols * ESZ;               \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->X + (size_t)(t0 + t) * (size_t)cols;        \
    __m512 acc[RB][TB];                                                                        \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        UNROLL for (int t = 0; t < TB; t++) acc[i][t] = _mm512_setzero_ps();                   \
    /* prefetch the rows K_PF_BYTES ahead (the tile's rows are one                             \
     * contiguous run: spread its lines over the column steps) */              \
    const char *pf = k_mv_prefetch(P->W, P->rows, r, RB, (size_t)cols * ESZ, K_PF_BYTES);      \
    int j = 0;                                                                                 \
    for (; j + 16 <= cols; j += 16) {                                                          \
        if (pf)                                                                                \
            UNROLL for (int q = 0; q < (RB * ESZ + 3) / 4; q++)                                \
                _mm_prefetch(pf + (size_t)j * RB * ESZ + (size_t)q * 64, _MM_HINT_T0);         \
        __m512 w[RB];                                                                          \
        UNROLL for (int i = 0; i < RB; i++) w[i] = LD(wr[i], j, 0xffff);                       \
        UNROLL for (int t = 0; t < TB; t++) {                                                  \
            __m512 x = _mm512_loadu_ps(xr[t] + j);                                             \
            UNROLL for (int i = 0; i < RB; i++) acc[i][t] = _mm512_fmadd_ps(w[i], x, acc[i][t]); \
        }                                                                                      \
    }                                                                                          \
    if (j < cols) {                                                                            \
        const __mmask16 m = tailmask(cols - j);                                                \
        __m512 w[RB];                                                                          \
        UNROLL for (int i = 0; i < RB; i++) w[i] = LD(wr[i], j, m);                            \
        UNROLL for (int t = 0; t < TB; t++) {                                                  \
            __m512 x = _mm512_maskz_loadu_ps(m, xr[t] + j);                                    \
            UNROLL for (int i = 0; i < RB; i++) acc[i][t] = _mm512_mask3_fmadd_ps(w[i], x, acc[i][t], m); \
        }                                                                                      \
    }                                                                                          \
    TILE_STORE(RB, TB, ACC_PLAIN);


/* MXFP4 (cols and group multiples of 16, checked by the caller): the scale
 * index advances every group/16 vectors. */
#define TILE_MX_BODY(RB, TB)                                                                   \
    const int cols = P->cols;                                                                  \
    const int G = P->W->group, ng = (cols + G - 1) / G, vpg = G / 16;                          \
    const uint8_t *wr[RB], *sc[RB];                                                            \
    const float *xr[TB];                                                                       \
    UNROLL for (int i = 0; i < RB; i++) {                                                      \
        wr[i] = (const uint8_t *)P->W->data + (size_t)(r + i) * (size_t)(cols / 2);            \
        sc[i] = P->W->scales + (size_t)(r + i) * (size_t)ng;                                   \
    }                                                                                          \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->aux + (size_t)(t0 + t) * (size_t)cols;      \
    __m512 acc[RB][TB];                                                                        \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        UNROLL for (int t = 0; t < TB; t++) acc[i][t] = _mm512_setzero_ps();                   \
    const __m512 e2m1 = _mm512_loadu_ps(k_e2m1);                                               \
    const __m512i sh = mx_shifts();                                                            \
    const char *pf = k_mv_prefetch(P->W, P->rows, r, RB, (size_t)(cols / 2), K_PF_BYTES);      \
    if (pf) k_mv_prefetch_scales(P->W, r, RB, (size_t)(cols / 2), ng, K_PF_BYTES);             \
    for (int g = 0, j = 0; g < ng; g++) {                                                      \
        __m512 lut[RB];                                                                        \
        UNROLL for (int i = 0; i < RB; i++) lut[i] = _mm512_mul_ps(e2m1, _mm512_set1_ps(e8m0_tab[sc[i][g]])); \
        for (int v = 0; v < vpg; v++, j += 16) {                                               \
            if (pf && (j * RB / 2) % 64 == 0) _mm_prefetch(pf + (size_t)j * RB / 2, _MM_HINT_T0); \
            __m512 w[RB];                                                                      \
            UNROLL for (int i = 0; i < RB; i++) w[i] = w_mx(wr[i], j, lut[i], sh);             \
            UNROLL for (int t = 0; t < TB; t++) {                                              \
                __m512 x = _mm512_loadu_ps(xr[t] + j);                                         \
                UNROLL for (int i = 0; i < RB; i++) acc[i][t] = _mm512_fmadd_ps(w[i], x, acc[i][t]); \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    TILE_STORE(RB, TB, ACC_MX);

/* One specialised function per tile shape, so the accumulators are fixed
 * arrays the compiler keeps in registers. */
#define DEF_TILES(NAME, BODY, ...)                                                             \
    TGT static void NAME##_8x1(const prod *P, int r, int t0) { BODY(8, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x1(const prod *P, int r, int t0) { BODY(4, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x2(const prod *P, int r, int t0) { BODY(4, 2, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x3(const prod *P, int r, int t0) { BODY(4, 3, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x4(const prod *P, int r, int t0) { BODY(4, 4, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x5(const prod *P, int r, int t0) { BODY(4, 5, ##__VA_ARGS__) }      \
    TGT static void NAME##_4x6(const prod *P, int r, int t0) { BODY(4, 6, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x1(const prod *P, int r, int t0) { BODY(1, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x2(const prod *P, int r, int t0) { BODY(1, 2, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x3(const prod *P, int r, int t0) { BODY(1, 3, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x4(const prod *P, int r, int t0) { BODY(1, 4, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x5(const prod *P, int r, int t0) { BODY(1, 5, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x6(const prod *P, int r, int t0) { BODY(1, 6, ##__VA_ARGS__) }      \
    static void (*const NAME##_4[7])(const prod *, int, int) = {NULL,      NAME##_4x1, NAME##_4x2, \
                                                                NAME##_4x3, NAME##_4x4, NAME##_4x5, \
                                                                NAME##_4x6};                        \
    static void (*const NAME##_1[7])(const prod *, int, int) = {NULL,      NAME##_1x1, NAME##_1x2, \
                                                                NAME##_1x3, NAME##_1x4, NAME##_1x5, \
                                                                NAME##_1x6};

DEF_TILES(tile_f32, TILE_BODY, ld_f32, 4)
DEF_TILES(tile_bf16, TILE_BODY, ld_bf16, 2)
DEF_TILES(tile_mx, TILE_MX_BODY)

/* Products over several inputs: 4 weight rows x 6 inputs per tile (24 zmm
 * accumulators; each weight vector is decoded once for 6 FMAs, which keeps
 * the decode shuffles from competing much with the FMAs). Inputs are the
 * outer loop: a tile's 6 inputs stay in L1 while the item's rows (a few
 * dozen, in L2) pass under them. A lone input runs 8 rows side by side. */
#define TB_MAX 6
#define DRIVE(TILE)                                                                        \
    do {                                                                                   \
        if (n == 1) {                                                                      \
            int r = r0;                                                                    \
            for (; r + 8 <= r1; r += 8) TILE##_8x1(&P, r, 0);                              \
            for (; r < r1; r++) TILE##_1x1(&P, r, 0);                                      \
            break;                                                                         \
        }                                                                                  \
        for (int t = 0; t < n; t += TB_MAX) {                                              \
            int tb = n - t < TB_MAX ? n - t : TB_MAX;                                      \
            int r = r0;                                                                    \
            for (; r + 4 <= r1; r += 4) TILE##_4[tb](&P, r, t);                            \
            for (; r < r1; r++) TILE##_1[tb](&P, r, t);                                    \
        }                                                                                  \
    } while (0)

/* The panel path of products over many inputs (see rowdots_panel); off only
 * to measure the direct tiles beside it (bench_gemm). Same bits either way. */
static bool g_panel = true;
void k_avx512_set_panel(bool on) { g_panel = on; }
static bool panel_on(void) { return g_panel; }

static bool mx_fast(const k3_mat *W) { return W->cols % 16 == 0 && W->group > 0 && W->group % 16 == 0; }

/* Inputs from which a product takes the panel path. Below them the direct
 * tiles are faster: on a Zen 4 core (1 thread, per input, same run) BF16
 * 2048x2048 at 8-16 inputs took 78 us direct against 115-148 us panel, and
 * the direct tiles still won at 256 inputs there (bench_gemm: 105 against
 * 98 GFLOP/s); MXFP4 1024x1024 at 8 inputs 24 against 28 us, about even
 * at 16, the panel ahead from 22 inputs (bench_gemm's expert shapes at 22:
 * 93 against 85 GFLOP/s). The panel's decode
 * once per row pays for MXFP4 sooner; BF16 keeps it only for prefill-sized
 * products, where another machine measured it ahead (docs/performance.md).
 * Batched decode and verifying passes (a few to a few tens of inputs) stay
 * on the direct tiles. Same bits either way. */
static int pn_min(const k3_mat *W) { return W->type == KW_MXFP4 ? 16 : 64; }

/* For MXFP4: a copy of X with every 16-block in the decode's lane order
 * (lane 2i <- element i, lane 2i+1 <- element 8+i), made once per product. */
static size_t v_prepare(const k3_mat *W, const float *X, int n, float *Xp) {
    if (W->type != KW_MXFP4 || !mx_fast(W) || n <= 0 || (n >= pn_min(W) && panel_on())) return 0;
    size_t tot = (size_t)n * (size_t)W->cols;
    if (!Xp) return tot;
    for (size_t b = 0; b < tot; b += 16)
        for (int i = 0; i < 8; i++) {
            Xp[b + 2 * i] = X[b + i];
            Xp[b + 2 * i + 1] = X[b + 8 + i];
        }
    return tot;
}

/* ---- products over many inputs: rows decoded once into an f32 panel -------------------
 * With n >= pn_min(W) inputs, a BF16 or MXFP4 row is widened (exactly) once into
 * a per-thread f32 panel of PN_ROWS rows and then multiplied by every input
 * from there: the decode (a shuffle per 16 weights, on the FMA ports) is paid
 * once per row instead of once per 6 inputs. The tile over the panel is the
 * 4 x 6 (RB x TB) register tile of plain f32 loads and FMAs; each accumulator
 * still sees its row's elements in the canonical lane order (the panel holds
 * the same f32 values the direct tiles form), so the bits are those of the
 * scalar reference. The inputs of a tile are the outer loop: a tile's 6
 * inputs stay in L1 while the panel's rows pass under them. */
#define PN_ROWS 16
#ifndef PN_KC
#define PN_KC 1024
#endif

/* One 16-column step of MXFP4 in the natural lane order (lane l = element l):
 * each byte doubled (lanes 2i, 2i+1 get byte i), shifted by 0 / 4, and the
 * low 4 bits looked up in the scaled E2M1 table. */
INL __m512 w_mx_nat(const uint8_t *p, __m512 lut) {
    const __m512i sh = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m512i v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh), lut);
}

/* Rows [r, r + nr) of W widened into dst (row stride ld floats), exactly. */
TGT static void panel_decode(const k3_mat *W, int r, int nr, float *dst, size_t ld) {
    const int cols = W->cols;
    for (int i = 0; i < nr; i++) {
        float *d = dst + (size_t)i * ld;
        if (W->type == KW_BF16) {
            const uint16_t *s = (const uint16_t *)W->data + (size_t)(r + i) * (size_t)cols;
            int j = 0;
            for (; j + 16 <= cols; j += 16) _mm512_storeu_ps(d + j, ld_bf16(s, j, 0xffff));
            if (j < cols) _mm512_mask_storeu_ps(d + j, tailmask(cols - j), ld_bf16(s, j, tailmask(cols - j)));
        } else if (mx_fast(W)) {
            const int G = W->group, ng = cols / G;
            const uint8_t *s = (const uint8_t *)W->data + (size_t)(r + i) * (size_t)(cols / 2);
            const uint8_t *sc = W->scales + (size_t)(r + i) * (size_t)ng;
            const __m512 e2m1 = _mm512_loadu_ps(k_e2m1);
            for (int g = 0, j = 0; g < ng; g++) {
                __m512 lut = _mm512_mul_ps(e2m1, _mm512_set1_ps(e8m0_tab[sc[g]]));
                for (int v = 0; v < G; v += 16, j += 16) _mm512_storeu_ps(d + j, w_mx_nat(s + j / 2, lut));
            }
        } else {
            k_mat_row(W, r + i, d); /* odd MXFP4 layouts: the scalar decode, same values */
        }
    }
}

typedef struct {
    const float *Wp; /* panel row 0 = weight row r */
    size_t ldw;
    const float *X;
    float *Y;
    int cols, rows; /* rows: of Y */
} pan;

/* Columns [j0, j1) of a RB x TB tile over the panel. Columns go in blocks
 * (PN_KC) so that a tile's inputs stay in L1 on wide rows; between blocks the
 * 16-lane accumulators wait in part[] (stored and reloaded exactly, so each
 * lane still sees its FMAs in column order). The last block closes the trees. */
#define PANEL_BODY(RB, TB)                                                                     \
    const int cols = P->cols;                                                                  \
    const float *wr[RB], *xr[TB];                                                              \
    UNROLL for (int i = 0; i < RB; i++) wr[i] = P->Wp + (size_t)(rr + i) * P->ldw;             \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->X + (size_t)(t0 + t) * (size_t)cols;        \
    __m512 acc[RB][TB];                                                                        \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        UNROLL for (int t = 0; t < TB; t++)                                                    \
            acc[i][t] = j0 ? _mm512_load_ps(part + 16 * (i * TB + t)) : _mm512_setzero_ps();   \
    int j = j0;                                                                                \
    for (; j + 16 <= j1; j += 16) {                                                            \
        __m512 w[RB];                                                                          \
        UNROLL for (int i = 0; i < RB; i++) w[i] = _mm512_loadu_ps(wr[i] + j);                 \
        UNROLL for (int t = 0; t < TB; t++) {                                                  \
            __m512 x = _mm512_loadu_ps(xr[t] + j);                                             \
            UNROLL for (int i = 0; i < RB; i++) acc[i][t] = _mm512_fmadd_ps(w[i], x, acc[i][t]); \
        }                                                                                      \
    }                                                                                          \
    if (j < j1) {                                                                              \
        const __mmask16 m = tailmask(j1 - j);                                                  \
        __m512 w[RB];                                                                          \
        UNROLL for (int i = 0; i < RB; i++) w[i] = _mm512_maskz_loadu_ps(m, wr[i] + j);        \
        UNROLL for (int t = 0; t < TB; t++) {                                                  \
            __m512 x = _mm512_maskz_loadu_ps(m, xr[t] + j);                                    \
            UNROLL for (int i = 0; i < RB; i++) acc[i][t] = _mm512_mask3_fmadd_ps(w[i], x, acc[i][t], m); \
        }                                                                                      \
    }                                                                                          \
    if (j1 < cols) {                                                                           \
        UNROLL for (int i = 0; i < RB; i++)                                                    \
            UNROLL for (int t = 0; t < TB; t++) _mm512_store_ps(part + 16 * (i * TB + t), acc[i][t]); \
        return;                                                                                \
    }                                                                                          \
    TILE_STORE(RB, TB, ACC_PLAIN);

#define DEF_PTILE(RB, TB)                                                                      \
    TGT static void ptile_##RB##x##TB(const pan *P, int rr, int r, int t0, int j0, int j1, float *part) { \
        PANEL_BODY(RB, TB)                                                                     \
    }
DEF_PTILE(4, 1) DEF_PTILE(4, 2) DEF_PTILE(4, 3) DEF_PTILE(4, 4) DEF_PTILE(4, 5) DEF_PTILE(4, 6)
DEF_PTILE(1, 1) DEF_PTILE(1, 2) DEF_PTILE(1, 3) DEF_PTILE(1, 4) DEF_PTILE(1, 5) DEF_PTILE(1, 6)
typedef void (*ptile_fn)(const pan *, int, int, int, int, int, float *);
static const ptile_fn ptile_4[7] = {NULL, ptile_4x1, ptile_4x2, ptile_4x3, ptile_4x4, ptile_4x5, ptile_4x6};
static const ptile_fn ptile_1[7] = {NULL, ptile_1x1, ptile_1x2, ptile_1x3, ptile_1x4, ptile_1x5, ptile_1x6};

static float *panel_buf(size_t floats) { return k_scratch(K_SCRATCH_PANEL, floats * sizeof(float)); }

TGT static void rowdots_panel(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1) {
    size_t ld = ((size_t)W->cols + 15) / 16 * 16;
    pan P = {.ldw = ld, .X = X, .Y = Y, .cols = W->cols, .rows = W->rows};
    float *buf = W->type == KW_F32 ? NULL : panel_buf(PN_ROWS * ld);
    _Alignas(64) float part[PN_ROWS * TB_MAX * 16]; /* accumulators between column blocks */
    /* the stored bytes of one row, for prefetching the next row block (the
     * rows after this item's: the same thread usually takes them next) while
     * this one computes, so their first read does not stall on memory */
    size_t rbytes = W->type == KW_BF16 ? (size_t)W->cols * 2 : W->type == KW_MXFP4 ? (size_t)W->cols / 2 : 0;
    int ntile = (n + TB_MAX - 1) / TB_MAX;
    for (int rb = r0; rb < r1; rb += PN_ROWS) {
        int nr = r1 - rb < PN_ROWS ? r1 - rb : PN_ROWS;
        int nnext = W->rows - (rb + nr) < PN_ROWS ? W->rows - (rb + nr) : PN_ROWS;
        const char *pf = (const char *)W->data + (size_t)(rb + nr) * rbytes;
        size_t pflen = rbytes ? (size_t)nnext * rbytes : 0, pfstep = (pflen / (size_t)ntile + 63) / 64 * 64;
        if (buf) {
            panel_decode(W, rb, nr, buf, ld);
            P.Wp = buf;
        } else {
            P.Wp = (const float *)W->data + (size_t)rb * (size_t)W->cols;
            P.ldw = (size_t)W->cols;
        }
        for (int t = 0; t < n; t += TB_MAX) {
            int tb = n - t < TB_MAX ? n - t : TB_MAX;
            for (size_t o = (size_t)(t / TB_MAX) * pfstep, e = o + pfstep; o < e && o < pflen; o += 64)
                _mm_prefetch(pf + o, _MM_HINT_T1);
            for (int j0 = 0; j0 < W->cols; j0 += PN_KC) {
                int j1 = W->cols - j0 < PN_KC ? W->cols : j0 + PN_KC;
                int i = 0;
                for (; i + 4 <= nr; i += 4) ptile_4[tb](&P, i, rb + i, t, j0, j1, part + (size_t)i * TB_MAX * 16);
                for (; i < nr; i++) ptile_1[tb](&P, i, rb + i, t, j0, j1, part + (size_t)i * TB_MAX * 16);
            }
        }
    }
}

TGT static void v_rowdots(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1, const void *aux) {
    prod P = {.W = W, .X = X, .aux = aux, .Y = Y, .cols = W->cols, .rows = W->rows};
    if (n >= pn_min(W) && panel_on()) {
        rowdots_panel(W, X, n, Y, r0, r1);
        return;
    }
    switch (W->type) {
    case KW_F32: DRIVE(tile_f32); break;
    case KW_BF16: DRIVE(tile_bf16); break;
    case KW_MXFP4:
        if (mx_fast(W) && aux) DRIVE(tile_mx);
        else k_scalar_ops.rowdots(W, X, n, Y, r0, r1, NULL); /* odd layouts: same bits, slower */
        break;
    }
}

const k_vops k_avx512_ops = {
    .dot = v_dot, .sum = v_sum, .axpy = v_axpy, .vfma = v_vfma, .scale = v_scale, .vmul = v_vmul,
    .vadd = v_vadd, .vexp = v_vexp, .subscale = v_subscale, .divs = v_divs,
    .prepare = v_prepare, .rowdots = v_rowdots, .gemm_acc = v_gemm_acc, .dots = v_dots, .kda_rows_decay = v_kda_rows_decay,
    .kda_rows_write = v_kda_rows_write, .silu = v_silu, .situ = v_situ, .sigmoid_mul = v_sigmoid_mul,
    .kda_rows_write_decay = v_kda_rows_write_decay,
};

#endif
