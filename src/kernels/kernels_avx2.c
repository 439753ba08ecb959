/* kernels_avx2.c: the AVX2 + FMA primitive table, for x86-64 CPUs without
 * AVX-512 (Haswell to Alder Lake, Zen 1-3). Every function repeats the
 * scalar reference of kernels.c / kernels.h (km_*) operation for operation, so the
 * bits are identical:
 *  - a canonical 16-lane dot accumulator is two ymm registers, lo = lanes
 *    0-7 and hi = lanes 8-15; a 16-element block j..j+15 feeds j..j+7 to lo
 *    and j+8..j+15 to hi, and the tree's first level (l += l+8) is lo + hi;
 *  - tails keep the canonical lane of every element: dots finish in scalar
 *    fmaf on the spilled lanes (a masked fma(0,0,acc) would turn a -0 lane
 *    into +0), elementwise loops use masked loads and stores;
 *  - exp / tanh / sigmoid are the km_* algorithms of kernels.h lane by lane.
 * A slot left NULL here runs the scalar primitive (kernels.c merges the
 * tables), so a primitive added later stays correct on this path.
 *
 * The functions carry target attributes and are reached only through
 * k_ops() after a CPUID check, so the binary still runs without AVX2. */
#if defined(__x86_64__)

#include "kernels/internal.h"

#include "util/common.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#define TGT __attribute__((target("avx2,fma")))
#define INL static inline __attribute__((always_inline)) TGT

#define UNROLL _Pragma("GCC unroll 16")

/* integer mask vector: lanes < r on (r may be <= 0 or >= 8) */
INL __m256i lanes_below(int r) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The canonical tree of a 16-lane accumulator held as (lo, hi). */
INL float tree2(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);                                              /* l += l+8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l += l+4 */
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                                 /* l += l+2 */
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));                                  /* l += l+1 */
    return _mm_cvtss_f32(d);
}

/* Spills (lo, hi) to the 16 canonical lanes. */
INL void spill(float *acc, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
}

/* ---- math, lane by lane as km_* --------------------------------------------------- */

INL __m256 v_exp(__m256 x) {
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(KM_EXP_LO));
    xc = _mm256_min_ps(xc, _mm256_set1_ps(KM_EXP_HI));
    __m256 kf = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(KM_LOG2E)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(KM_LN2_HI), xc);
    r = _mm256_fnmadd_ps(kf, _mm256_set1_ps(KM_LN2_LO), r);
    __m256 p = _mm256_set1_ps(KM_E7);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KM_E6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KM_E5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KM_E4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KM_E3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KM_E2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i k = _mm256_cvtps_epi32(kf);
    __m256i k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    __m256i b127 = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, b127), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, b127), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(y, _mm256_add_ps(x, x), nan);
}

INL __m256 v_neg(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

INL __m256 v_sigmoid(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, v_exp(v_neg(x))));
}

INL __m256 v_tanh(__m256 x) {
    __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_andnot_ps(sign, x);
    __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(KM_TANH_SMALL), _CMP_LT_OQ);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(KM_T5);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KM_T4));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KM_T3));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KM_T2));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KM_T1));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KM_T0));
    __m256 ys = _mm256_fmadd_ps(_mm256_mul_ps(x, z), p, x);
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = v_exp(_mm256_add_ps(a, a));
    __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    __m256 yl = _mm256_or_ps(_mm256_andnot_ps(sign, t), _mm256_and_ps(sign, x)); /* copysign */
    return _mm256_blendv_ps(yl, ys, small);
}

/* ---- reductions ---------------------------------------------------------------------- */

TGT static float v_dot(const float *a, const float *b, int n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), hi);
    }
    if (j == n) return tree2(lo, hi);
    float acc[16];
    spill(acc, lo, hi);
    for (; j < n; j++) acc[j & 15] = fmaf(a[j], b[j], acc[j & 15]);
    return k_tree16(acc);
}

TGT static float v_sum(const float *x, int n) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(x + j));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(x + j + 8));
    }
    if (j == n) return tree2(lo, hi);
    float acc[16];
    spill(acc, lo, hi);
    for (; j < n; j++) acc[j & 15] += x[j];
    return k_tree16(acc);
}

/* ---- elementwise ----------------------------------------------------------------------
 * Full vectors, then one masked vector: lanes beyond n load zeros, are
 * computed and never stored. (Masked moves only for the tail: a masked
 * store is slow on some CPUs.) */
#define ELEMWISE(n, BODY)                                                  \
    do {                                                                   \
        int j_ = 0;                                                        \
        for (; j_ + 8 <= (n); j_ += 8) {                                   \
            const bool full = true;                                        \
            const __m256i m = _mm256_setzero_si256();                      \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
        if (j_ < (n)) {                                                    \
            const bool full = false;                                       \
            const __m256i m = lanes_below((n) - j_);                       \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
    } while (0)
#define LD(p) (full ? _mm256_loadu_ps((p) + j) : _mm256_maskload_ps((p) + j, m))
#define ST(p, v)                                                           \
    do {                                                                   \
        __m256 v_ = (v);                                                   \
        if (full) _mm256_storeu_ps((p) + j, v_);                           \
        else _mm256_maskstore_ps((p) + j, m, v_);                          \
    } while (0)

TGT static void v_axpy(float *y, float a, const float *x, int n) {
    __m256 va = _mm256_set1_ps(a);
    ELEMWISE(n, ST(y, _mm256_fmadd_ps(va, LD(x), LD(y))));
}
TGT static void v_vfma(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm256_fmadd_ps(LD(a), LD(b), LD(y))));
}
TGT static void v_scale(float *y, const float *x, float s, int n) {
    __m256 vs = _mm256_set1_ps(s);
    ELEMWISE(n, ST(y, _mm256_mul_ps(LD(x), vs)));
}
TGT static void v_vmul(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm256_mul_ps(LD(a), LD(b))));
}
TGT static void v_vadd(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, _mm256_add_ps(LD(a), LD(b))));
}
TGT static void v_vexp(float *y, const float *x, int n) { ELEMWISE(n, ST(y, v_exp(LD(x)))); }
TGT static void v_subscale(float *y, const float *a, const float *b, float s, int n) {
    __m256 vs = _mm256_set1_ps(s);
    ELEMWISE(n, ST(y, _mm256_mul_ps(_mm256_sub_ps(LD(a), LD(b)), vs)));
}
TGT static void v_divs(float *y, const float *x, float d, int n) {
    __m256 vd = _mm256_set1_ps(d);
    ELEMWISE(n, ST(y, _mm256_div_ps(LD(x), vd)));
}
TGT static void v_silu(float *x, int n) {
    __m256 one = _mm256_set1_ps(1.0f);
    ELEMWISE(n, {
        __m256 v = LD(x);
        ST(x, _mm256_div_ps(v, _mm256_add_ps(one, v_exp(v_neg(v)))));
    });
}
TGT static void v_situ(float *out, const float *gate, const float *up, int n, float b1, float b2) {
    __m256 vb1 = _mm256_set1_ps(b1), vb2 = _mm256_set1_ps(b2);
    ELEMWISE(n, {
        __m256 a = LD(gate);
        __m256 g = _mm256_mul_ps(_mm256_mul_ps(vb1, v_tanh(_mm256_div_ps(a, vb1))), v_sigmoid(a));
        __m256 u = _mm256_mul_ps(vb2, v_tanh(_mm256_div_ps(LD(up), vb2)));
        ST(out, _mm256_mul_ps(g, u));
    });
}
TGT static void v_sigmoid_mul(float *y, const float *gate, int n) {
    ELEMWISE(n, ST(y, _mm256_mul_ps(LD(y), v_sigmoid(LD(gate)))));
}

/* ---- panels ---------------------------------------------------------------------------- */

/* C += A B: 4 rows x 16 columns of C stay in registers while k runs, so each
 * element still sees its FMAs in k order. Masked columns load zeros and are
 * never stored. */
TGT static void v_gemm_acc(float *C, int ldc, int M, int N, const float *A, int sam, int sak, int K,
                           const float *B, int ldb) {
    for (int j = 0; j < N; j += 16) {
        const __m256i m0 = lanes_below(N - j), m1 = lanes_below(N - j - 8);
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            __m256 c[4][2];
            UNROLL for (int r = 0; r < 4; r++) {
                c[r][0] = _mm256_maskload_ps(C + (size_t)(m + r) * ldc + j, m0);
                c[r][1] = _mm256_maskload_ps(C + (size_t)(m + r) * ldc + j + 8, m1);
            }
            for (int k = 0; k < K; k++) {
                __m256 b0 = _mm256_maskload_ps(B + (size_t)k * ldb + j, m0);
                __m256 b1 = _mm256_maskload_ps(B + (size_t)k * ldb + j + 8, m1);
                UNROLL for (int r = 0; r < 4; r++) {
                    __m256 a = _mm256_set1_ps(A[(size_t)(m + r) * sam + (size_t)k * sak]);
                    c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
                    c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
                }
            }
            UNROLL for (int r = 0; r < 4; r++) {
                _mm256_maskstore_ps(C + (size_t)(m + r) * ldc + j, m0, c[r][0]);
                _mm256_maskstore_ps(C + (size_t)(m + r) * ldc + j + 8, m1, c[r][1]);
            }
        }
        for (; m < M; m++) {
            __m256 c0 = _mm256_maskload_ps(C + (size_t)m * ldc + j, m0);
            __m256 c1 = _mm256_maskload_ps(C + (size_t)m * ldc + j + 8, m1);
            for (int k = 0; k < K; k++) {
                __m256 a = _mm256_set1_ps(A[(size_t)m * sam + (size_t)k * sak]);
                c0 = _mm256_fmadd_ps(a, _mm256_maskload_ps(B + (size_t)k * ldb + j, m0), c0);
                c1 = _mm256_fmadd_ps(a, _mm256_maskload_ps(B + (size_t)k * ldb + j + 8, m1), c1);
            }
            _mm256_maskstore_ps(C + (size_t)m * ldc + j, m0, c0);
            _mm256_maskstore_ps(C + (size_t)m * ldc + j + 8, m1, c1);
        }
    }
}

/* Recurrent KDA row sweeps with u / o (and d) in registers for D = 8 NV
 * (NV = 2, 4, 8: head dims 16, 32, 64); the same elementwise operations in
 * the same order as the scalar sweeps. */
#define KDA_ROWS(NV)                                                                              \
    TGT static void kda_decay_##NV(float *S, const float *a, const float *k, float *u) {         \
        __m256 acc[NV];                                                                           \
        UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm256_loadu_ps(u + 8 * v);                  \
        for (int i = 0; i < 8 * NV; i++) {                                                        \
            float *Si = S + (size_t)i * 8 * NV;                                                   \
            __m256 ai = _mm256_set1_ps(a[i]), ki = _mm256_set1_ps(k[i]);                          \
            UNROLL for (int v = 0; v < NV; v++) {                                                 \
                __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(Si + 8 * v), ai);                       \
                _mm256_storeu_ps(Si + 8 * v, sv);                                                 \
                acc[v] = _mm256_fmadd_ps(ki, sv, acc[v]);                                         \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int v = 0; v < NV; v++) _mm256_storeu_ps(u + 8 * v, acc[v]);                  \
    }                                                                                             \
    TGT static void kda_write_##NV(float *S, const float *k, const float *d, const float *qs, float *o) { \
        __m256 acc[NV], dv[NV];                                                                   \
        UNROLL for (int v = 0; v < NV; v++) {                                                     \
            acc[v] = _mm256_loadu_ps(o + 8 * v);                                                  \
            dv[v] = _mm256_loadu_ps(d + 8 * v);                                                   \
        }                                                                                         \
        for (int i = 0; i < 8 * NV; i++) {                                                        \
            float *Si = S + (size_t)i * 8 * NV;                                                   \
            __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(qs[i]);                         \
            UNROLL for (int v = 0; v < NV; v++) {                                                 \
                __m256 sv = _mm256_fmadd_ps(ki, dv[v], _mm256_loadu_ps(Si + 8 * v));              \
                _mm256_storeu_ps(Si + 8 * v, sv);                                                 \
                acc[v] = _mm256_fmadd_ps(qi, sv, acc[v]);                                         \
            }                                                                                     \
        }                                                                                         \
        UNROLL for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + 8 * v, acc[v]);                  \
    }
KDA_ROWS(2)
KDA_ROWS(4)
KDA_ROWS(8)

TGT static void v_kda_rows_decay(float *S, int D, const float *a, const float *k, float *u) {
    switch (D) {
    case 16: kda_decay_2(S, a, k, u); return;
    case 32: kda_decay_4(S, a, k, u); return;
    case 64: kda_decay_8(S, a, k, u); return;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_scale(Si, Si, a[i], D);
        v_axpy(u, k[i], Si, D);
    }
}
TGT static void v_kda_rows_write(float *S, int D, const float *k, const float *d, const float *qs, float *o) {
    switch (D) {
    case 16: kda_write_2(S, k, d, qs, o); return;
    case 32: kda_write_4(S, k, d, qs, o); return;
    case 64: kda_write_8(S, k, d, qs, o); return;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_axpy(Si, k[i], d, D);
        v_axpy(o, qs[i], Si, D);
    }
}

/* rows_write of one step fused with rows_decay of the next (prefill): one
 * pass over S. Columns are independent, so they go in blocks of 16 with the
 * block's o, u2 and d in registers while the rows pass; each element sees the
 * scalar sweeps' operations in their order. */
TGT static void v_kda_rows_write_decay(float *S, int D, const float *k, const float *d, const float *qs, float *o,
                                       const float *a2, const float *k2, float *u2) {
    if (D % 16 != 0) {
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D;
            v_axpy(Si, k[i], d, D);
            v_axpy(o, qs[i], Si, D);
            v_scale(Si, Si, a2[i], D);
            v_axpy(u2, k2[i], Si, D);
        }
        return;
    }
    for (int c = 0; c < D; c += 16) {
        __m256 o0 = _mm256_loadu_ps(o + c), o1 = _mm256_loadu_ps(o + c + 8);
        __m256 u0 = _mm256_loadu_ps(u2 + c), u1 = _mm256_loadu_ps(u2 + c + 8);
        __m256 d0 = _mm256_loadu_ps(d + c), d1 = _mm256_loadu_ps(d + c + 8);
        for (int i = 0; i < D; i++) {
            float *Si = S + (size_t)i * D + c;
            __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(qs[i]);
            __m256 ai = _mm256_set1_ps(a2[i]), k2i = _mm256_set1_ps(k2[i]);
            __m256 s0 = _mm256_fmadd_ps(ki, d0, _mm256_loadu_ps(Si));
            __m256 s1 = _mm256_fmadd_ps(ki, d1, _mm256_loadu_ps(Si + 8));
            o0 = _mm256_fmadd_ps(qi, s0, o0);
            o1 = _mm256_fmadd_ps(qi, s1, o1);
            s0 = _mm256_mul_ps(s0, ai);
            s1 = _mm256_mul_ps(s1, ai);
            _mm256_storeu_ps(Si, s0);
            _mm256_storeu_ps(Si + 8, s1);
            u0 = _mm256_fmadd_ps(k2i, s0, u0);
            u1 = _mm256_fmadd_ps(k2i, s1, u1);
        }
        _mm256_storeu_ps(o + c, o0);
        _mm256_storeu_ps(o + c + 8, o1);
        _mm256_storeu_ps(u2 + c, u0);
        _mm256_storeu_ps(u2 + c + 8, u1);
    }
}

/* out[p] = dot(x, B + p ldb): 4 rows side by side (independent chains hide
 * the FMA latency), each in the canonical order. */
TGT static void v_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len) {
    int p = 0;
    for (; p + 4 <= rows; p += 4) {
        __m256 lo[4], hi[4];
        UNROLL for (int i = 0; i < 4; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        int j = 0;
        for (; j + 16 <= len; j += 16) {
            __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
            UNROLL for (int i = 0; i < 4; i++) {
                const float *b = B + (size_t)(p + i) * ldb + j;
                lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(b), x0, lo[i]);
                hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(b + 8), x1, hi[i]);
            }
        }
        UNROLL for (int i = 0; i < 4; i++) {
            if (j == len) {
                out[p + i] = tree2(lo[i], hi[i]);
                continue;
            }
            float acc[16];
            spill(acc, lo[i], hi[i]);
            const float *b = B + (size_t)(p + i) * ldb;
            for (int jj = j; jj < len; jj++) acc[jj & 15] = fmaf(x[jj], b[jj], acc[jj & 15]);
            out[p + i] = k_tree16(acc);
        }
    }
    for (; p < rows; p++) out[p] = v_dot(x, B + (size_t)p * ldb, len);
}

/* ---- products ---------------------------------------------------------------------------
 * A tile is RB weight rows x TB inputs with one (lo, hi) accumulator pair per
 * (row, input), sweeping the columns in 16-wide blocks; a column tail (F32
 * and BF16 only) finishes in scalar fmaf on the spilled canonical lanes.
 * With 16 ymm registers: 4 rows x 1 input for a matrix-vector product
 * (8 accumulators), 2 rows x 3 inputs for several (12; each weight vector is
 * decoded once for 3 FMAs). */

typedef struct {
    const k3_mat *W;
    const float *X;
    const float *Xp; /* BF16: X with every whole 16-block in the even/odd order (bf16_prepare) */
    float *Y;
    int cols, rows;
} prod;

/* weight block: 16 columns starting at j of a row, as (lo, hi) */
INL void ld_f32(const void *row, int j, __m256 *lo, __m256 *hi) {
    *lo = _mm256_loadu_ps((const float *)row + j);
    *hi = _mm256_loadu_ps((const float *)row + j + 8);
}
/* BF16 -> f32: the 16 bits placed high in a zeroed dword (exact). */
INL __m256 bf8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* BF16 in the even/odd order: one 256-bit load of elements j..j+15, whose
 * dword i holds element 2i low and 2i+1 high. Shifting left by 16 widens the
 * even elements, masking the low half the odd ones (both exact), so lo holds
 * canonical lanes 0, 2, .., 14 and hi lanes 1, 3, .., 15. Each lane still
 * sees the elements of one residue class mod 16 in increasing j; the inputs
 * are permuted the same way once per product (bf16_prepare), and eo_canon
 * restores the canonical lanes before the tree: the scalar bits, with one
 * load and one integer op per 8 weights instead of a load, a widening
 * shuffle and a shift. */
INL void ld_bf16(const void *row, int j, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
/* (even lanes, odd lanes) -> canonical (lanes 0-7, lanes 8-15) */
INL void eo_canon(__m256 *lo, __m256 *hi) {
    __m256 u = _mm256_unpacklo_ps(*lo, *hi), v = _mm256_unpackhi_ps(*lo, *hi);
    *lo = _mm256_permute2f128_ps(u, v, 0x20);
    *hi = _mm256_permute2f128_ps(u, v, 0x31);
}

/* scalar weight element for the tails (the scalar path's widening) */
static inline float w_elem(const k3_mat *W, const void *row, int j) {
    return W->type == KW_F32 ? ((const float *)row)[j] : k3_bf16_to_f32(((const uint16_t *)row)[j]);
}

/* MXFP4: 8 codes from 4 packed bytes. The dword is broadcast and lane i
 * shifted right by 4i, leaving element i's code in its low nibble (low
 * nibble = even element). vpermps reads the low 3 bits to look up the E2M1
 * magnitude already multiplied by the group scale (exact: a power of two);
 * bit 3 is the sign, moved to bit 31 and xored in (E2M1[8+c] = -E2M1[c],
 * -0.0 included). */
INL __m256i mx_shifts(void) { return _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28); }
INL __m256 mx8(const uint8_t *p, __m256 lut, __m256i sh) {
    int32_t q;
    memcpy(&q, p, 4);
    __m256i c = _mm256_srlv_epi32(_mm256_set1_epi32(q), sh);
    __m256 mag = _mm256_permutevar8x32_ps(lut, c);
    __m256i sgn = _mm256_and_si256(_mm256_slli_epi32(c, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sgn));
}

static float e8m0_tab[256];
__attribute__((constructor)) static void e8m0_init(void) {
    for (int s = 0; s < 256; s++) e8m0_tab[s] = k_e8m0((uint8_t)s);
}

/* Prefetch distance of the matrix-vector tiles (k_mv_prefetch): measured
 * on a Zen 4 EPYC with K3_ISA=avx2, 8 KB beat 4, 16, 24, 48 and 96 KB at two
 * threads and tied the best at one (each thread's rows end where the next
 * thread's begin, so a long reach fetches the neighbour's rows). */
#ifndef K_PF_BYTES
#define K_PF_BYTES ((size_t)8 * 1024)
#endif
/* Closes a tile: Y[t0 + t][r + i] = tree of (lo, hi), finishing a column
 * tail from j in scalar. */
#define TILE_CLOSE(RB, TB)                                                                     \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++) {                  \
        float *y = P->Y + (size_t)(t0 + t) * (size_t)P->rows + (size_t)(r + i);                \
        if (j == cols) {                                                                       \
            *y = tree2(lo[i][t], hi[i][t]);                                                    \
            continue;                                                                          \
        }                                                                                      \
        float acc[16];                                                                         \
        spill(acc, lo[i][t], hi[i][t]);                                                        \
        for (int jj = j; jj < cols; jj++)                                                      \
            acc[jj & 15] = fmaf(w_elem(P->W, wr[i], jj), xr[t][jj], acc[jj & 15]);             \
        *y = k_tree16(acc);                                                                    \
    }

/* XB: the inputs the 16-blocks read (P->X, or P->Xp in the even/odd order);
 * FIX: what turns the accumulators into canonical lanes before the close. */
#define TILE_BODY(RB, TB, LD, ESZ, XB, FIX)                                                    \
    const int cols = P->cols;                                                                  \
    const char *wr[RB];                                                                        \
    const float *xr[TB], *xb[TB];                                                              \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        wr[i] = (const char *)P->W->data + (size_t)(r + i) * (size_t)cols * ESZ;               \
    UNROLL for (int t = 0; t < TB; t++) {                                                      \
        xr[t] = P->X + (size_t)(t0 + t) * (size_t)cols;                                        \
        xb[t] = P->XB + (size_t)(t0 + t) * (size_t)cols;                                       \
    }                                                                                          \
    __m256 lo[RB][TB], hi[RB][TB];                                                             \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        UNROLL for (int t = 0; t < TB; t++) lo[i][t] = hi[i][t] = _mm256_setzero_ps();         \
    const char *pf = k_mv_prefetch(P->W, P->rows, r, RB, (size_t)cols * ESZ, K_PF_BYTES);      \
    int j = 0;                                                                                 \
    for (; j + 16 <= cols; j += 16) {                                                          \
        if (pf)                                                                                \
            UNROLL for (int q = 0; q < (RB * ESZ + 3) / 4; q++)                                \
                _mm_prefetch(pf + (size_t)j * RB * ESZ + (size_t)q * 64, _MM_HINT_T0);         \
        __m256 w0[RB], w1[RB];                                                                 \
        UNROLL for (int i = 0; i < RB; i++) LD(wr[i], j, &w0[i], &w1[i]);                      \
        UNROLL for (int t = 0; t < TB; t++) {                                                  \
            __m256 x0 = _mm256_loadu_ps(xb[t] + j), x1 = _mm256_loadu_ps(xb[t] + j + 8);       \
            UNROLL for (int i = 0; i < RB; i++) {                                              \
                lo[i][t] = _mm256_fmadd_ps(w0[i], x0, lo[i][t]);                               \
                hi[i][t] = _mm256_fmadd_ps(w1[i], x1, hi[i][t]);                               \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++) FIX(&lo[i][t], &hi[i][t]); \
    TILE_CLOSE(RB, TB)

/* MXFP4 (cols and group multiples of 16, checked by the caller): the scale
 * changes every group/16 blocks. */
#define TILE_MX_BODY(RB, TB)                                                                   \
    const int cols = P->cols;                                                                  \
    const int G = P->W->group, ng = (cols + G - 1) / G, bpg = G / 16;                          \
    const uint8_t *wr[RB], *sc[RB];                                                            \
    const float *xr[TB];                                                                       \
    UNROLL for (int i = 0; i < RB; i++) {                                                      \
        wr[i] = (const uint8_t *)P->W->data + (size_t)(r + i) * (size_t)(cols / 2);            \
        sc[i] = P->W->scales + (size_t)(r + i) * (size_t)ng;                                   \
    }                                                                                          \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->X + (size_t)(t0 + t) * (size_t)cols;        \
    __m256 lo[RB][TB], hi[RB][TB];                                                             \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        UNROLL for (int t = 0; t < TB; t++) lo[i][t] = hi[i][t] = _mm256_setzero_ps();         \
    const __m256 e2m1 = _mm256_loadu_ps(k_e2m1);                                               \
    const __m256i sh = mx_shifts();                                                            \
    const char *pf = k_mv_prefetch(P->W, P->rows, r, RB, (size_t)(cols / 2), K_PF_BYTES);      \
    if (pf) k_mv_prefetch_scales(P->W, r, RB, (size_t)(cols / 2), ng, K_PF_BYTES);             \
    int j = 0;                                                                                 \
    for (int g = 0; g < ng; g++) {                                                             \
        __m256 lut[RB];                                                                        \
        UNROLL for (int i = 0; i < RB; i++) lut[i] = _mm256_mul_ps(e2m1, _mm256_set1_ps(e8m0_tab[sc[i][g]])); \
        for (int b = 0; b < bpg; b++, j += 16) {                                               \
            if (pf && (j * RB / 2) % 64 == 0) _mm_prefetch(pf + (size_t)j * RB / 2, _MM_HINT_T0); \
            __m256 w0[RB], w1[RB];                                                             \
            UNROLL for (int i = 0; i < RB; i++) {                                              \
                w0[i] = mx8(wr[i] + j / 2, lut[i], sh);                                        \
                w1[i] = mx8(wr[i] + j / 2 + 4, lut[i], sh);                                    \
            }                                                                                  \
            UNROLL for (int t = 0; t < TB; t++) {                                              \
                __m256 x0 = _mm256_loadu_ps(xr[t] + j), x1 = _mm256_loadu_ps(xr[t] + j + 8);   \
                UNROLL for (int i = 0; i < RB; i++) {                                          \
                    lo[i][t] = _mm256_fmadd_ps(w0[i], x0, lo[i][t]);                           \
                    hi[i][t] = _mm256_fmadd_ps(w1[i], x1, hi[i][t]);                           \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    (void)wr;                                                                                  \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++)                    \
        P->Y[(size_t)(t0 + t) * (size_t)P->rows + (size_t)(r + i)] = tree2(lo[i][t], hi[i][t]);

#define DEF_TILES(NAME, BODY, ...)                                                             \
    TGT static void NAME##_4x1(const prod *P, int r, int t0) { BODY(4, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_2x1(const prod *P, int r, int t0) { BODY(2, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_2x2(const prod *P, int r, int t0) { BODY(2, 2, ##__VA_ARGS__) }      \
    TGT static void NAME##_2x3(const prod *P, int r, int t0) { BODY(2, 3, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x1(const prod *P, int r, int t0) { BODY(1, 1, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x2(const prod *P, int r, int t0) { BODY(1, 2, ##__VA_ARGS__) }      \
    TGT static void NAME##_1x3(const prod *P, int r, int t0) { BODY(1, 3, ##__VA_ARGS__) }      \
    static void (*const NAME##_2[4])(const prod *, int, int) = {NULL, NAME##_2x1, NAME##_2x2,   \
                                                                NAME##_2x3};                    \
    static void (*const NAME##_1[4])(const prod *, int, int) = {NULL, NAME##_1x1, NAME##_1x2,   \
                                                                NAME##_1x3};

INL void no_fix(__m256 *lo, __m256 *hi) { (void)lo, (void)hi; }
DEF_TILES(tile_f32, TILE_BODY, ld_f32, 4, X, no_fix)
DEF_TILES(tile_bf16, TILE_BODY, ld_bf16, 2, Xp, eo_canon)
DEF_TILES(tile_mx, TILE_MX_BODY)

/* Inputs are the outer loop: a tile's 3 inputs stay in L1 while the item's
 * rows pass under them. */
#define TB_MAX 3
#define DRIVE(TILE)                                                                        \
    do {                                                                                   \
        if (n == 1) {                                                                      \
            int r = r0;                                                                    \
            for (; r + 4 <= r1; r += 4) TILE##_4x1(&P, r, 0);                              \
            for (; r < r1; r++) TILE##_1x1(&P, r, 0);                                      \
            break;                                                                         \
        }                                                                                  \
        for (int t = 0; t < n; t += TB_MAX) {                                              \
            int tb = n - t < TB_MAX ? n - t : TB_MAX;                                      \
            int r = r0;                                                                    \
            for (; r + 2 <= r1; r += 2) TILE##_2[tb](&P, r, t);                            \
            for (; r < r1; r++) TILE##_1[tb](&P, r, t);                                    \
        }                                                                                  \
    } while (0)

static bool mx_fast(const k3_mat *W) { return W->cols % 16 == 0 && W->group > 0 && W->group % 16 == 0; }

/* ---- products over many inputs: rows decoded once into an f32 panel -------------------
 * With n >= pn_min(W) inputs (prefill) and cols a multiple of 16, a block of
 * PN_ROWS weight rows is widened (exactly) once into a per-thread f32 panel
 * and multiplied by every input from there, so the decode is paid once per
 * row instead of once per 3 inputs. The tile is 4 rows x 3 inputs with ONE
 * ymm accumulator per (row, input): lanes 0-7 and lanes 8-15 of the
 * canonical 16-lane accumulator are independent chains, so the tile runs
 * twice over a column block, first over the elements j = 16b + 0..7, then
 * over j = 16b + 8..15 (12 accumulators + 3 inputs + 1 weight = the 16
 * registers; 7 loads per 12 FMAs instead of 10). Column blocks of PN_KC keep
 * a tile's rows and inputs in L1 for its second pass; between passes and
 * blocks the accumulators wait in part[] (stored and reloaded exactly). Each
 * lane still sees its elements in increasing j, from +0: the scalar bits. */
#define PN_ROWS 16
#define PN_KC 512
#define PTB 3

typedef struct {
    const float *Wp; /* panel row 0 */
    size_t ldw;
    const float *X;
    int cols;
} pan;

/* Half h of columns [j0, j1) for panel rows rr.. and inputs t0..;
 * part: [RB][PTB][16] canonical lanes. */
#define PANEL_BODY(RB, TB)                                                                     \
    const float *wr[RB], *xr[TB];                                                              \
    UNROLL for (int i = 0; i < RB; i++) wr[i] = P->Wp + (size_t)(rr + i) * P->ldw;             \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->X + (size_t)(t0 + t) * (size_t)P->cols;     \
    __m256 acc[RB][TB];                                                                        \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++)                    \
        acc[i][t] = j0 ? _mm256_loadu_ps(part + 16 * (i * PTB + t) + 8 * h) : _mm256_setzero_ps(); \
    for (int j = j0 + 8 * h; j < j1; j += 16) {                                                \
        __m256 x[TB];                                                                          \
        UNROLL for (int t = 0; t < TB; t++) x[t] = _mm256_loadu_ps(xr[t] + j);                 \
        UNROLL for (int i = 0; i < RB; i++) {                                                  \
            __m256 w = _mm256_loadu_ps(wr[i] + j);                                             \
            UNROLL for (int t = 0; t < TB; t++) acc[i][t] = _mm256_fmadd_ps(w, x[t], acc[i][t]); \
        }                                                                                      \
    }                                                                                          \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++)                    \
        _mm256_storeu_ps(part + 16 * (i * PTB + t) + 8 * h, acc[i][t]);

#define DEF_PTILE(RB, TB)                                                                      \
    TGT static void ptile_##RB##x##TB(const pan *P, int rr, int t0, int j0, int j1, int h, float *part) { \
        PANEL_BODY(RB, TB)                                                                     \
    }
DEF_PTILE(4, 1) DEF_PTILE(4, 2) DEF_PTILE(4, 3) DEF_PTILE(1, 1) DEF_PTILE(1, 2) DEF_PTILE(1, 3)
typedef void (*ptile_fn)(const pan *, int, int, int, int, int, float *);
static const ptile_fn ptile_4[PTB + 1] = {NULL, ptile_4x1, ptile_4x2, ptile_4x3};
static const ptile_fn ptile_1[PTB + 1] = {NULL, ptile_1x1, ptile_1x2, ptile_1x3};

/* Rows [r, r + nr) of W widened into dst (row stride ld floats), exactly:
 * the values the direct tiles form. cols is a multiple of 16. */
TGT static void panel_decode(const k3_mat *W, int r, int nr, float *dst, size_t ld) {
    const int cols = W->cols;
    for (int i = 0; i < nr; i++) {
        float *d = dst + (size_t)i * ld;
        if (W->type == KW_BF16) {
            const uint16_t *s = (const uint16_t *)W->data + (size_t)(r + i) * (size_t)cols;
            for (int j = 0; j < cols; j += 8) _mm256_storeu_ps(d + j, bf8(s + j));
        } else {
            const int G = W->group, ng = cols / G;
            const uint8_t *s = (const uint8_t *)W->data + (size_t)(r + i) * (size_t)(cols / 2);
            const uint8_t *sc = W->scales + (size_t)(r + i) * (size_t)ng;
            const __m256 e2m1 = _mm256_loadu_ps(k_e2m1);
            const __m256i sh = mx_shifts();
            for (int g = 0, j = 0; g < ng; g++) {
                __m256 lut = _mm256_mul_ps(e2m1, _mm256_set1_ps(e8m0_tab[sc[g]]));
                for (int v = 0; v < G; v += 8, j += 8) _mm256_storeu_ps(d + j, mx8(s + j / 2, lut, sh));
            }
        }
    }
}

static float *panel_buf(size_t floats) { return k_scratch(K_SCRATCH_PANEL, floats * sizeof(float)); }

/* Inputs from which the panel pays on this path: MXFP4 from 8 (its direct
 * decode is dear: 1024x1024 at 8-256 inputs 59-62 us a token direct against
 * 31-42 panel), BF16 and F32 from 24 (2048x2048 at 8-16 inputs about 140 us
 * direct against 165-290 panel, the panel ahead from 24-32). Measured on a
 * Zen 4 core with K3_ISA=avx2, 1 thread. Same bits either way. */
static int pn_min(const k3_mat *W) { return W->type == KW_MXFP4 ? 8 : 24; }

static bool panel_fits(const k3_mat *W, int n) {
    return n >= pn_min(W) && W->cols % 16 == 0 && (W->type != KW_MXFP4 || mx_fast(W));
}

TGT static void rowdots_panel(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1) {
    const int cols = W->cols;
    pan P = {.X = X, .cols = cols, .ldw = (size_t)cols};
    float *buf = W->type == KW_F32 ? NULL : panel_buf((size_t)PN_ROWS * (size_t)cols);
    _Alignas(32) float part[PN_ROWS * PTB * 16];
    for (int rb = r0; rb < r1; rb += PN_ROWS) {
        int nr = r1 - rb < PN_ROWS ? r1 - rb : PN_ROWS;
        if (buf) {
            panel_decode(W, rb, nr, buf, (size_t)cols);
            P.Wp = buf;
        } else {
            P.Wp = (const float *)W->data + (size_t)rb * (size_t)cols;
        }
        for (int t = 0; t < n; t += PTB) {
            int tb = n - t < PTB ? n - t : PTB;
            for (int j0 = 0; j0 < cols; j0 += PN_KC) {
                int j1 = cols - j0 < PN_KC ? cols : j0 + PN_KC;
                int i = 0;
                for (; i + 4 <= nr; i += 4)
                    for (int h = 0; h < 2; h++) ptile_4[tb](&P, i, t, j0, j1, h, part + (size_t)i * PTB * 16);
                for (; i < nr; i++)
                    for (int h = 0; h < 2; h++) ptile_1[tb](&P, i, t, j0, j1, h, part + (size_t)i * PTB * 16);
            }
            for (int i = 0; i < nr; i++)
                for (int u = 0; u < tb; u++) {
                    const float *pa = part + 16 * ((size_t)i * PTB + (size_t)u);
                    Y[(size_t)(t + u) * (size_t)W->rows + (size_t)(rb + i)] =
                        tree2(_mm256_loadu_ps(pa), _mm256_loadu_ps(pa + 8));
                }
        }
    }
}

/* For the BF16 direct tiles: a copy of X with every whole 16-block in the
 * even/odd order of ld_bf16 (lane i <- element 2i, lane 8 + i <- 2i + 1),
 * made once per product; the column tail stays in place (read from X). */
static size_t v_prepare(const k3_mat *W, const float *X, int n, float *Xp) {
    if (W->type != KW_BF16 || W->cols < 16 || n <= 0 || panel_fits(W, n)) return 0;
    const size_t cols = (size_t)W->cols, whole = cols / 16 * 16;
    if (!Xp) return (size_t)n * cols;
    for (int t = 0; t < n; t++) {
        const float *x = X + (size_t)t * cols;
        float *d = Xp + (size_t)t * cols;
        for (size_t b = 0; b < whole; b += 16)
            for (int i = 0; i < 8; i++) {
                d[b + (size_t)i] = x[b + 2 * (size_t)i];
                d[b + 8 + (size_t)i] = x[b + 2 * (size_t)i + 1];
            }
    }
    return (size_t)n * cols;
}

TGT static void v_rowdots(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1, const void *aux) {
    if (panel_fits(W, n)) {
        rowdots_panel(W, X, n, Y, r0, r1);
        return;
    }
    prod P = {.W = W, .X = X, .Xp = aux, .Y = Y, .cols = W->cols, .rows = W->rows};
    switch (W->type) {
    case KW_F32: DRIVE(tile_f32); break;
    case KW_BF16:
        if (P.Xp) DRIVE(tile_bf16);
        else k_scalar_ops.rowdots(W, X, n, Y, r0, r1, aux); /* under 16 columns: no whole block */
        break;
    case KW_MXFP4:
        if (mx_fast(W)) DRIVE(tile_mx);
        else k_scalar_ops.rowdots(W, X, n, Y, r0, r1, aux); /* odd layouts: same bits, slower */
        break;
    }
}

const k_vops k_avx2_ops = {
    .prepare = v_prepare, .dot = v_dot, .sum = v_sum, .axpy = v_axpy, .vfma = v_vfma, .scale = v_scale, .vmul = v_vmul,
    .vadd = v_vadd, .vexp = v_vexp, .subscale = v_subscale, .divs = v_divs,
    .rowdots = v_rowdots, .gemm_acc = v_gemm_acc, .dots = v_dots, .kda_rows_decay = v_kda_rows_decay,
    .kda_rows_write = v_kda_rows_write, .silu = v_silu, .situ = v_situ, .sigmoid_mul = v_sigmoid_mul,
    .kda_rows_write_decay = v_kda_rows_write_decay,
};

#endif
