/* kernels_neon.c: the NEON primitive table for ARM64 (AArch64: Apple
 * silicon, Graviton, Ampere, Raspberry Pi 4/5). Every function repeats the
 * scalar reference of kernels.c / kernels.h (km_*) operation for operation, so the
 * bits are identical to the scalar path and to the x86 paths:
 *  - a canonical 16-lane dot accumulator is four q registers, a[0] = lanes
 *    0-3, a[1] = 4-7, a[2] = 8-11, a[3] = 12-15; the tree's levels are
 *    a[0] + a[2] and a[1] + a[3] (l += l+8), then their sum (l += l+4), then
 *    the two halves (l += l+2), then the two lanes (l += l+1);
 *  - vfmaq_f32 is one fused multiply-add, as fmaf is; tails keep the
 *    canonical lane of every element (dots finish in scalar fmaf on the
 *    spilled lanes; elementwise loops run the last partial vector on a
 *    zero-padded copy and store only the live lanes);
 *  - exp / tanh / sigmoid are the km_* algorithms of kernels.h lane by lane
 *    (vrndnq_f32 is nearbyintf in the default rounding mode).
 * A slot left NULL here runs the scalar primitive (kernels.c merges the
 * tables). NEON is part of the AArch64 base architecture, so this file needs
 * no target attributes; kernels.c still checks HWCAP_ASIMD. */
#if defined(__aarch64__)

#include "kernels/internal.h"

#include "util/common.h"

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#define INL static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

typedef float32x4_t v4;

/* The canonical tree of a 16-lane accumulator held as a[4]. */
INL float tree4(const v4 *a) {
    v4 b0 = vaddq_f32(a[0], a[2]), b1 = vaddq_f32(a[1], a[3]); /* l += l+8 */
    v4 c = vaddq_f32(b0, b1);                                   /* l += l+4 */
    float32x2_t d = vadd_f32(vget_low_f32(c), vget_high_f32(c)); /* l += l+2 */
    return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);           /* l += l+1 */
}

INL void spill4(float *acc, const v4 *a) {
    UNROLL for (int q = 0; q < 4; q++) vst1q_f32(acc + 4 * q, a[q]);
}

INL v4 vset(float x) { return vdupq_n_f32(x); }

/* ---- math, lane by lane as km_* --------------------------------------------------- */

INL v4 v_exp(v4 x) {
    uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x));
    v4 xc = vmaxq_f32(x, vset(KM_EXP_LO));
    xc = vminq_f32(xc, vset(KM_EXP_HI));
    v4 kf = vrndnq_f32(vmulq_f32(xc, vset(KM_LOG2E)));
    v4 r = vfmsq_f32(xc, kf, vset(KM_LN2_HI)); /* fma(-kf, hi, xc) */
    r = vfmsq_f32(r, kf, vset(KM_LN2_LO));
    v4 p = vset(KM_E7);
    p = vfmaq_f32(vset(KM_E6), p, r);
    p = vfmaq_f32(vset(KM_E5), p, r);
    p = vfmaq_f32(vset(KM_E4), p, r);
    p = vfmaq_f32(vset(KM_E3), p, r);
    p = vfmaq_f32(vset(KM_E2), p, r);
    p = vfmaq_f32(vset(1.0f), p, r);
    p = vfmaq_f32(vset(1.0f), p, r);
    int32x4_t k = vcvtq_s32_f32(kf); /* kf is an integer: exact */
    int32x4_t k1 = vshrq_n_s32(k, 1), k2 = vsubq_s32(k, k1);
    int32x4_t b127 = vdupq_n_s32(127);
    v4 s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, b127), 23));
    v4 s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, b127), 23));
    v4 y = vmulq_f32(vmulq_f32(p, s1), s2);
    return vbslq_f32(nan, vaddq_f32(x, x), y);
}

INL v4 v_sigmoid(v4 x) {
    v4 one = vset(1.0f);
    return vdivq_f32(one, vaddq_f32(one, v_exp(vnegq_f32(x))));
}

INL v4 v_tanh(v4 x) {
    v4 a = vabsq_f32(x);
    uint32x4_t small = vcltq_f32(a, vset(KM_TANH_SMALL));
    v4 z = vmulq_f32(x, x);
    v4 p = vset(KM_T5);
    p = vfmaq_f32(vset(KM_T4), p, z);
    p = vfmaq_f32(vset(KM_T3), p, z);
    p = vfmaq_f32(vset(KM_T2), p, z);
    p = vfmaq_f32(vset(KM_T1), p, z);
    p = vfmaq_f32(vset(KM_T0), p, z);
    v4 ys = vfmaq_f32(x, vmulq_f32(x, z), p);
    v4 one = vset(1.0f);
    v4 e = v_exp(vaddq_f32(a, a));
    v4 t = vsubq_f32(one, vdivq_f32(vset(2.0f), vaddq_f32(e, one)));
    uint32x4_t sign = vdupq_n_u32(0x80000000u);
    v4 yl = vbslq_f32(sign, x, t); /* copysign(t, x) */
    return vbslq_f32(small, ys, yl);
}

/* ---- reductions ---------------------------------------------------------------------- */

static float v_dot(const float *a, const float *b, int n) {
    v4 acc[4];
    UNROLL for (int q = 0; q < 4; q++) acc[q] = vset(0.0f);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        UNROLL for (int q = 0; q < 4; q++) acc[q] = vfmaq_f32(acc[q], vld1q_f32(a + j + 4 * q), vld1q_f32(b + j + 4 * q));
    if (j == n) return tree4(acc);
    float s[16];
    spill4(s, acc);
    for (; j < n; j++) s[j & 15] = fmaf(a[j], b[j], s[j & 15]);
    return k_tree16(s);
}

static float v_sum(const float *x, int n) {
    v4 acc[4];
    UNROLL for (int q = 0; q < 4; q++) acc[q] = vset(0.0f);
    int j = 0;
    for (; j + 16 <= n; j += 16)
        UNROLL for (int q = 0; q < 4; q++) acc[q] = vaddq_f32(acc[q], vld1q_f32(x + j + 4 * q));
    if (j == n) return tree4(acc);
    float s[16];
    spill4(s, acc);
    for (; j < n; j++) s[j & 15] += x[j];
    return k_tree16(s);
}

/* ---- elementwise ----------------------------------------------------------------------
 * Full vectors, then the last partial one on zero-padded copies of the
 * inputs (computed, only its live lanes stored). */
#define ELEMWISE(n, BODY)                                                  \
    do {                                                                   \
        int j_ = 0;                                                        \
        for (; j_ + 4 <= (n); j_ += 4) {                                   \
            const int live = 4;                                            \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
        if (j_ < (n)) {                                                    \
            const int live = (n) - j_;                                     \
            int j = j_;                                                    \
            BODY;                                                          \
        }                                                                  \
    } while (0)
INL v4 ld_part(const float *p, int live) {
    if (live == 4) return vld1q_f32(p);
    float t[4] = {0, 0, 0, 0};
    memcpy(t, p, (size_t)live * sizeof(float));
    return vld1q_f32(t);
}
INL void st_part(float *p, v4 v, int live) {
    if (live == 4) {
        vst1q_f32(p, v);
        return;
    }
    float t[4];
    vst1q_f32(t, v);
    memcpy(p, t, (size_t)live * sizeof(float));
}
#define LD(p) ld_part((p) + j, live)
#define ST(p, v) st_part((p) + j, (v), live)

static void v_axpy(float *y, float a, const float *x, int n) {
    v4 va = vset(a);
    ELEMWISE(n, ST(y, vfmaq_f32(LD(y), va, LD(x))));
}
static void v_vfma(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, vfmaq_f32(LD(y), LD(a), LD(b))));
}
static void v_scale(float *y, const float *x, float s, int n) {
    v4 vs = vset(s);
    ELEMWISE(n, ST(y, vmulq_f32(LD(x), vs)));
}
static void v_vmul(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, vmulq_f32(LD(a), LD(b))));
}
static void v_vadd(float *y, const float *a, const float *b, int n) {
    ELEMWISE(n, ST(y, vaddq_f32(LD(a), LD(b))));
}
static void v_vexp(float *y, const float *x, int n) { ELEMWISE(n, ST(y, v_exp(LD(x)))); }
static void v_subscale(float *y, const float *a, const float *b, float s, int n) {
    v4 vs = vset(s);
    ELEMWISE(n, ST(y, vmulq_f32(vsubq_f32(LD(a), LD(b)), vs)));
}
static void v_divs(float *y, const float *x, float d, int n) {
    v4 vd = vset(d);
    ELEMWISE(n, ST(y, vdivq_f32(LD(x), vd)));
}
static void v_silu(float *x, int n) {
    v4 one = vset(1.0f);
    ELEMWISE(n, {
        v4 v = LD(x);
        ST(x, vdivq_f32(v, vaddq_f32(one, v_exp(vnegq_f32(v)))));
    });
}
static void v_situ(float *out, const float *gate, const float *up, int n, float b1, float b2) {
    v4 vb1 = vset(b1), vb2 = vset(b2);
    ELEMWISE(n, {
        v4 a = LD(gate);
        v4 g = vmulq_f32(vmulq_f32(vb1, v_tanh(vdivq_f32(a, vb1))), v_sigmoid(a));
        v4 u = vmulq_f32(vb2, v_tanh(vdivq_f32(LD(up), vb2)));
        ST(out, vmulq_f32(g, u));
    });
}
static void v_sigmoid_mul(float *y, const float *gate, int n) {
    ELEMWISE(n, ST(y, vmulq_f32(LD(y), v_sigmoid(LD(gate)))));
}

/* ---- panels ---------------------------------------------------------------------------- */

/* C += A B: 4 rows x 16 columns of C stay in registers while k runs, so each
 * element still sees its FMAs in k order; the columns past the last full
 * 16 run the same chains in scalar fmaf. */
static void v_gemm_acc(float *C, int ldc, int M, int N, const float *A, int sam, int sak, int K, const float *B,
                       int ldb) {
    int j = 0;
    for (; j + 16 <= N; j += 16) {
        int m = 0;
        for (; m + 4 <= M; m += 4) {
            v4 c[4][4];
            UNROLL for (int r = 0; r < 4; r++) UNROLL for (int q = 0; q < 4; q++) c[r][q] =
                vld1q_f32(C + (size_t)(m + r) * ldc + j + 4 * q);
            for (int k = 0; k < K; k++) {
                const float *b = B + (size_t)k * ldb + j;
                v4 bq[4];
                UNROLL for (int q = 0; q < 4; q++) bq[q] = vld1q_f32(b + 4 * q);
                UNROLL for (int r = 0; r < 4; r++) {
                    v4 a = vset(A[(size_t)(m + r) * sam + (size_t)k * sak]);
                    UNROLL for (int q = 0; q < 4; q++) c[r][q] = vfmaq_f32(c[r][q], a, bq[q]);
                }
            }
            UNROLL for (int r = 0; r < 4; r++) UNROLL for (int q = 0; q < 4; q++)
                vst1q_f32(C + (size_t)(m + r) * ldc + j + 4 * q, c[r][q]);
        }
        for (; m < M; m++) {
            v4 c[4];
            UNROLL for (int q = 0; q < 4; q++) c[q] = vld1q_f32(C + (size_t)m * ldc + j + 4 * q);
            for (int k = 0; k < K; k++) {
                v4 a = vset(A[(size_t)m * sam + (size_t)k * sak]);
                UNROLL for (int q = 0; q < 4; q++) c[q] = vfmaq_f32(c[q], a, vld1q_f32(B + (size_t)k * ldb + j + 4 * q));
            }
            UNROLL for (int q = 0; q < 4; q++) vst1q_f32(C + (size_t)m * ldc + j + 4 * q, c[q]);
        }
    }
    if (j < N)
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                float a = A[(size_t)m * sam + (size_t)k * sak];
                float *c = C + (size_t)m * ldc;
                const float *b = B + (size_t)k * ldb;
                for (int jj = j; jj < N; jj++) c[jj] = fmaf(a, b[jj], c[jj]);
            }
}

/* out[p] = dot(x, B + p ldb): 2 rows side by side, each in the canonical order. */
static void v_dots(float *out, const float *x, const float *B, size_t ldb, int rows, int len) {
    int p = 0;
    for (; p + 2 <= rows; p += 2) {
        const float *b0 = B + (size_t)p * ldb, *b1 = b0 + ldb;
        v4 a0[4], a1[4];
        UNROLL for (int q = 0; q < 4; q++) a0[q] = a1[q] = vset(0.0f);
        int j = 0;
        for (; j + 16 <= len; j += 16)
            UNROLL for (int q = 0; q < 4; q++) {
                v4 xv = vld1q_f32(x + j + 4 * q);
                a0[q] = vfmaq_f32(a0[q], xv, vld1q_f32(b0 + j + 4 * q));
                a1[q] = vfmaq_f32(a1[q], xv, vld1q_f32(b1 + j + 4 * q));
            }
        if (j == len) {
            out[p] = tree4(a0);
            out[p + 1] = tree4(a1);
            continue;
        }
        float s0[16], s1[16];
        spill4(s0, a0);
        spill4(s1, a1);
        for (int jj = j; jj < len; jj++) {
            s0[jj & 15] = fmaf(x[jj], b0[jj], s0[jj & 15]);
            s1[jj & 15] = fmaf(x[jj], b1[jj], s1[jj & 15]);
        }
        out[p] = k_tree16(s0);
        out[p + 1] = k_tree16(s1);
    }
    for (; p < rows; p++) out[p] = v_dot(x, B + (size_t)p * ldb, len);
}

/* Recurrent KDA row sweeps: the scalar sweeps' operations, row by row. */
static void v_kda_rows_decay(float *S, int D, const float *a, const float *k, float *u) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_scale(Si, Si, a[i], D);
        v_axpy(u, k[i], Si, D);
    }
}
static void v_kda_rows_write(float *S, int D, const float *k, const float *d, const float *qs, float *o) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_axpy(Si, k[i], d, D);
        v_axpy(o, qs[i], Si, D);
    }
}
static void v_kda_rows_write_decay(float *S, int D, const float *k, const float *d, const float *qs, float *o,
                                   const float *a2, const float *k2, float *u2) {
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        v_axpy(Si, k[i], d, D);
        v_axpy(o, qs[i], Si, D);
        v_scale(Si, Si, a2[i], D);
        v_axpy(u2, k2[i], Si, D);
    }
}

/* ---- products ---------------------------------------------------------------------------
 * A tile is RB weight rows x TB inputs with one 4-register accumulator per
 * (row, input), sweeping the columns in 16-wide blocks; a column tail (F32
 * and BF16 only) finishes in scalar fmaf on the spilled canonical lanes.
 * With 32 q registers: 4 rows x 1 input for a matrix-vector product (16
 * accumulators), 2 rows x 3 inputs for several (24; each weight vector is
 * decoded once for 3 FMAs). */

typedef struct {
    const k3_mat *W;
    const float *X;
    float *Y;
    int cols, rows;
} prod;

/* weight block: 16 columns starting at j of a row */
INL void ld_f32(const void *row, int j, v4 *w) {
    UNROLL for (int q = 0; q < 4; q++) w[q] = vld1q_f32((const float *)row + j + 4 * q);
}
/* BF16 -> f32: the 16 bits placed high in a zeroed word (exact). */
INL void ld_bf16(const void *row, int j, v4 *w) {
    const uint16_t *p = (const uint16_t *)row + j;
    UNROLL for (int q = 0; q < 4; q++) w[q] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * q), 16));
}

static inline float w_elem(const k3_mat *W, const void *row, int j) {
    return W->type == KW_F32 ? ((const float *)row)[j] : k3_bf16_to_f32(((const uint16_t *)row)[j]);
}

/* MXFP4: 16 codes from 8 packed bytes (low nibble = even element). The
 * magnitude 2|E2M1[c & 7]| (0, 1, 2, 3, 4, 6, 8, 12) is looked up as a byte,
 * widened, converted and multiplied by half the group scale (all exact: small
 * integers times a power of two, overflowing to inf exactly as the scalar
 * product does); bit 3 is the sign, moved to bit 31 and xored in
 * (E2M1[8+c] = -E2M1[c], -0.0 included). */
static const uint8_t mx_mag2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
INL void mx16(const uint8_t *p, v4 hs, uint8x16_t tab, v4 *w) {
    uint8x8_t b = vld1_u8(p);
    uint8x8x2_t z = vzip_u8(vand_u8(b, vdup_n_u8(15)), vshr_n_u8(b, 4));
    uint8x16_t c = vcombine_u8(z.val[0], z.val[1]);
    uint8x16_t m = vqtbl1q_u8(tab, c);
    uint8x16_t s = vshlq_n_u8(vshrq_n_u8(c, 3), 7); /* 0x80 where negative */
    uint16x8_t m0 = vmovl_u8(vget_low_u8(m)), m1 = vmovl_u8(vget_high_u8(m));
    uint16x8_t s0 = vmovl_u8(vget_low_u8(s)), s1 = vmovl_u8(vget_high_u8(s));
    uint32x4_t mi[4] = {vmovl_u16(vget_low_u16(m0)), vmovl_u16(vget_high_u16(m0)), vmovl_u16(vget_low_u16(m1)),
                        vmovl_u16(vget_high_u16(m1))};
    uint32x4_t si[4] = {vshll_n_u16(vget_low_u16(s0), 16), vshll_n_u16(vget_high_u16(s0), 16),
                        vshll_n_u16(vget_low_u16(s1), 16), vshll_n_u16(vget_high_u16(s1), 16)};
    UNROLL for (int q = 0; q < 4; q++) {
        v4 mag = vmulq_f32(vcvtq_f32_u32(mi[q]), hs);
        w[q] = vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(mag), vshlq_n_u32(si[q], 8)));
    }
}

static float e8m0_half[256];
__attribute__((constructor)) static void e8m0_init(void) {
    for (int s = 0; s < 256; s++) e8m0_half[s] = 0.5f * k_e8m0((uint8_t)s);
}

#define TILE_ACC_INIT(RB, TB)                                                                  \
    v4 acc[RB][TB][4];                                                                         \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++)                    \
        UNROLL for (int q = 0; q < 4; q++) acc[i][t][q] = vset(0.0f);

#define TILE_FMA(RB, TB, w, j)                                                                 \
    UNROLL for (int t = 0; t < TB; t++) UNROLL for (int q = 0; q < 4; q++) {                   \
        v4 xv = vld1q_f32(xr[t] + (j) + 4 * q);                                                \
        UNROLL for (int i = 0; i < RB; i++) acc[i][t][q] = vfmaq_f32(acc[i][t][q], w[i][q], xv); \
    }

#define TILE_BODY(RB, TB, LD, ESZ)                                                             \
    const int cols = P->cols;                                                                  \
    const char *wr[RB];                                                                        \
    const float *xr[TB];                                                                       \
    UNROLL for (int i = 0; i < RB; i++)                                                        \
        wr[i] = (const char *)P->W->data + (size_t)(r + i) * (size_t)cols * ESZ;               \
    UNROLL for (int t = 0; t < TB; t++) xr[t] = P->X + (size_t)(t0 + t) * (size_t)cols;        \
    TILE_ACC_INIT(RB, TB)                                                                      \
    int j = 0;                                                                                 \
    for (; j + 16 <= cols; j += 16) {                                                          \
        v4 w[RB][4];                                                                           \
        UNROLL for (int i = 0; i < RB; i++) LD(wr[i], j, w[i]);                                \
        TILE_FMA(RB, TB, w, j)                                                                 \
    }                                                                                          \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++) {                  \
        float *y = P->Y + (size_t)(t0 + t) * (size_t)P->rows + (size_t)(r + i);                \
        if (j == cols) {                                                                       \
            *y = tree4(acc[i][t]);                                                             \
            continue;                                                                          \
        }                                                                                      \
        float s[16];                                                                           \
        spill4(s, acc[i][t]);                                                                  \
        for (int jj = j; jj < cols; jj++) s[jj & 15] = fmaf(w_elem(P->W, wr[i], jj), xr[t][jj], s[jj & 15]); \
        *y = k_tree16(s);                                                                      \
    }

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
    TILE_ACC_INIT(RB, TB)                                                                      \
    const uint8x16_t tab = vld1q_u8(mx_mag2);                                                  \
    int j = 0;                                                                                 \
    for (int g = 0; g < ng; g++) {                                                             \
        v4 hs[RB];                                                                             \
        UNROLL for (int i = 0; i < RB; i++) hs[i] = vset(e8m0_half[sc[i][g]]);                 \
        for (int b = 0; b < bpg; b++, j += 16) {                                               \
            v4 w[RB][4];                                                                       \
            UNROLL for (int i = 0; i < RB; i++) mx16(wr[i] + j / 2, hs[i], tab, w[i]);         \
            TILE_FMA(RB, TB, w, j)                                                             \
        }                                                                                      \
    }                                                                                          \
    UNROLL for (int i = 0; i < RB; i++) UNROLL for (int t = 0; t < TB; t++)                    \
        P->Y[(size_t)(t0 + t) * (size_t)P->rows + (size_t)(r + i)] = tree4(acc[i][t]);

#define DEF_TILES(NAME, BODY, ...)                                                             \
    static void NAME##_4x1(const prod *P, int r, int t0) { BODY(4, 1, ##__VA_ARGS__) }         \
    static void NAME##_2x1(const prod *P, int r, int t0) { BODY(2, 1, ##__VA_ARGS__) }         \
    static void NAME##_2x2(const prod *P, int r, int t0) { BODY(2, 2, ##__VA_ARGS__) }         \
    static void NAME##_2x3(const prod *P, int r, int t0) { BODY(2, 3, ##__VA_ARGS__) }         \
    static void NAME##_1x1(const prod *P, int r, int t0) { BODY(1, 1, ##__VA_ARGS__) }         \
    static void NAME##_1x2(const prod *P, int r, int t0) { BODY(1, 2, ##__VA_ARGS__) }         \
    static void NAME##_1x3(const prod *P, int r, int t0) { BODY(1, 3, ##__VA_ARGS__) }         \
    static void (*const NAME##_2[4])(const prod *, int, int) = {NULL, NAME##_2x1, NAME##_2x2,   \
                                                                NAME##_2x3};                    \
    static void (*const NAME##_1[4])(const prod *, int, int) = {NULL, NAME##_1x1, NAME##_1x2,   \
                                                                NAME##_1x3};

DEF_TILES(tile_f32, TILE_BODY, ld_f32, 4)
DEF_TILES(tile_bf16, TILE_BODY, ld_bf16, 2)
DEF_TILES(tile_mx, TILE_MX_BODY)

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

static void v_rowdots(const k3_mat *W, const float *X, int n, float *Y, int r0, int r1, const void *aux) {
    prod P = {.W = W, .X = X, .Y = Y, .cols = W->cols, .rows = W->rows};
    switch (W->type) {
    case KW_F32: DRIVE(tile_f32); break;
    case KW_BF16: DRIVE(tile_bf16); break;
    case KW_MXFP4:
        if (mx_fast(W)) DRIVE(tile_mx);
        else k_scalar_ops.rowdots(W, X, n, Y, r0, r1, aux); /* odd layouts: same bits, slower */
        break;
    }
}

const k_vops k_neon_ops = {
    .dot = v_dot, .sum = v_sum, .axpy = v_axpy, .vfma = v_vfma, .scale = v_scale, .vmul = v_vmul,
    .vadd = v_vadd, .vexp = v_vexp, .subscale = v_subscale, .divs = v_divs,
    .rowdots = v_rowdots, .gemm_acc = v_gemm_acc, .dots = v_dots, .kda_rows_decay = v_kda_rows_decay,
    .kda_rows_write = v_kda_rows_write, .silu = v_silu, .situ = v_situ, .sigmoid_mul = v_sigmoid_mul,
    .kda_rows_write_decay = v_kda_rows_write_decay,
};

#endif
