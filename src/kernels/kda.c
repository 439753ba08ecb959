/* kda.c: the Kimi Delta Attention kernels (spec section 8): depthwise causal
 * ShortConv with SiLU, the decay gate, the recurrent delta rule, its chunkwise
 * UT/WY form for prefill, and the head-wise output norm + gate.
 *
 * Each kernel is written once over the primitive table (internal.h), so the
 * scalar and AVX-512 paths give the same bits. Heads are independent; threads
 * split heads, never a head's arithmetic. */
#include "kernels/internal.h"
#include "kernels/kmath.h"
#include "util/common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- ShortConv ----------------------------------------------------------- */

void k_shortconv_silu(float *y, const float *x, int T, int C, const float *w, int K, float *state) {
    const k_vops *ops = k_ops();
    if (T <= 0 || C <= 0) return;
    int P = K - 1;
    /* win[(P + t)][c]: the P carried inputs then the T new ones, so tap j of
     * output t reads row t + j, and the new state is the last P rows. */
    float *win = xmalloc_array((size_t)(P + T) * (size_t)C, sizeof *win);
    float *wt = xmalloc_array((size_t)K * (size_t)C, sizeof *wt); /* taps transposed: [K][C] */
    for (int c = 0; c < C; c++) {
        for (int j = 0; j < P; j++) win[(size_t)j * C + c] = state[(size_t)c * P + j];
        for (int j = 0; j < K; j++) wt[(size_t)j * C + c] = w[(size_t)c * K + j];
    }
    memcpy(win + (size_t)P * C, x, (size_t)T * (size_t)C * sizeof *win);
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * C;
        memset(yt, 0, (size_t)C * sizeof *yt);
        /* per channel: acc = fma(w[c][j], in_j, acc) for j = 0 (oldest) .. K-1 */
        for (int j = 0; j < K; j++)
            ops->vfma(yt, wt + (size_t)j * C, win + (size_t)(t + j) * C, C);
    }
    ops->silu(y, T * C);
    for (int c = 0; c < C; c++)
        for (int j = 0; j < P; j++) state[(size_t)c * P + j] = win[(size_t)(T + j) * C + c];
    free(win);
    free(wt);
}

/* ---- decay gate ---------------------------------------------------------------- */

K3_HOT void k_kda_gate(float *g, const float *z, const float *A_log, const float *dt_bias, int H, int D,
                float lower) {
    const k_vops *ops = k_ops();
    for (int h = 0; h < H; h++) {
        float a = km_exp(A_log[h]);
        float *gh = g + (size_t)h * D;
        ops->vadd(gh, z + (size_t)h * D, dt_bias + (size_t)h * D, D);
        ops->scale(gh, gh, a, D);
        /* lower * sigmoid(t): sigmoid_mul of a vector of `lower` values */
        for (int d = 0; d < D; d++) gh[d] = lower * km_sigmoid(gh[d]);
    }
}

/* ---- recurrent form --------------------------------------------------------------- */

/* One head over T positions. S is [D][D] (row i = key channel). Per step:
 *   S = diag(a) S; u = S^T k (sequential over i);  d = beta (v - u);
 *   S += k d^T; o = S^T qs.
 * Where the primitive table has it, the write sweep of step t and the decay
 * sweep of step t+1 run as one pass over S (the same operations per element
 * in the same order, so the same bits; S is read once per step, not twice). */
static void recur_head(const k_vops *ops, float *o, float *S, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, int T, int H, int D, float qscale, float *tmp) {
    float *a = tmp, *u = tmp + D, *d = tmp + 2 * D, *qs = tmp + 3 * D, *u2 = tmp + 4 * D;
    size_t P = (size_t)H * (size_t)D;
    if (T < 1) return;
    ops->vexp(a, g, D);
    memset(u, 0, (size_t)D * sizeof *u);
    ops->kda_rows_decay(S, D, a, k, u);
    for (int t = 0; t < T; t++) {
        size_t off = (size_t)t * P;
        ops->subscale(d, v + off, u, beta[(size_t)t * H], D);
        ops->scale(qs, q + off, qscale, D);
        float *ot = o + off;
        memset(ot, 0, (size_t)D * sizeof *ot);
        if (t + 1 < T && ops->kda_rows_write_decay) {
            ops->vexp(a, g + off + P, D);
            memset(u2, 0, (size_t)D * sizeof *u2);
            ops->kda_rows_write_decay(S, D, k + off, d, qs, ot, a, k + off + P, u2);
            float *sw = u;
            u = u2;
            u2 = sw;
        } else {
            ops->kda_rows_write(S, D, k + off, d, qs, ot);
            if (t + 1 < T) {
                ops->vexp(a, g + off + P, D);
                memset(u, 0, (size_t)D * sizeof *u);
                ops->kda_rows_decay(S, D, a, k + off + P, u);
            }
        }
    }
}

void k_kda_recurrent(float *o, float *S, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, int T, int H, int D) {
    const k_vops *ops = k_ops();
    float qscale = 1.0f / sqrtf((float)D);
#pragma omp parallel for schedule(static) if ((double)T * H * D * D > 32768.0)
    for (int h = 0; h < H; h++) {
        float *tmp = xmalloc_array(5 * (size_t)D, sizeof *tmp);
        size_t hd = (size_t)h * D;
        recur_head(ops, o + hd, S + hd * D, q + hd, k + hd, v + hd, g + hd, beta + h, T, H, D, qscale, tmp);
        free(tmp);
    }
}

/* ---- chunkwise (UT / WY) form ------------------------------------------------------
 * For a chunk of L positions starting from state S0, with in-chunk partial
 * log-decay sums, the delta rule unrolls to
 *   S_t = Diag(e^{G_t}) S0 + sum_{s<=t} (e^{G_t - G_s} o k_s) w_s^T,
 * where the written values w_t solve the unit lower-triangular system
 *   w_t + beta_t sum_{s<t} A[t][s] w_s = beta_t (v_t - S0^T (e^{G_t} o k_t)),
 *   A[t][s] = sum_i k_t[i] k_s[i] e^{G_t[i] - G_s[i]}          (s < t)
 * (the UT transform: W = (I + Diag(beta) A)^{-1} Diag(beta) (V - Kd S0)),
 * and the outputs are
 *   o_t = S0^T (e^{G_t} o qs_t) + sum_{s<=t} B[t][s] w_s,
 *   B[t][s] = sum_i qs_t[i] k_s[i] e^{G_t[i] - G_s[i]}          (s <= t).
 * G_t - G_s is formed as the running sum g_{s+1} + ... + g_t, never as a
 * difference of two long cumulative sums (which would lose digits when the
 * decays are strong) and never as e^{G_t} * e^{-G_s} (which overflows): every
 * exponent is <= 0. */

typedef struct {
    float *Q, *A, *B, *W, *KS, *EG, *KD, *QD, *dsum, *e, *ke;
} chunk_buf;

static void chunk_head(const k_vops *ops, chunk_buf *bf, float *o, float *S, const float *q,
                       const float *k, const float *v, const float *g, const float *beta, int L,
                       int H, int D, float qscale) {
    size_t P = (size_t)H * (size_t)D;
#define ROW(p, t) ((p) + (size_t)(t) * P)
    float *Q = bf->Q, *A = bf->A, *B = bf->B, *W = bf->W, *KS = bf->KS, *EG = bf->EG;
    for (int t = 0; t < L; t++) {
        ops->scale(Q + (size_t)t * D, ROW(q, t), qscale, D);
        if (t == 0) memcpy(EG, ROW(g, 0), (size_t)D * sizeof *EG);
        else ops->vadd(EG + (size_t)t * D, EG + (size_t)(t - 1) * D, ROW(g, t), D);
    }
    ops->vexp(EG, EG, L * D); /* EG[t] = e^{G_t}, G_t = g_0 + ... + g_t */
    for (int s = 0; s < L; s++) {
        const float *ks = ROW(k, s);
        B[(size_t)s * L + s] = ops->dot(Q + (size_t)s * D, ks, D);
        memset(bf->dsum, 0, (size_t)D * sizeof *bf->dsum);
        for (int t = s + 1; t < L; t++) {
            ops->vadd(bf->dsum, bf->dsum, ROW(g, t), D);
            ops->vexp(bf->e, bf->dsum, D);
            ops->vmul(bf->ke, ks, bf->e, D);
            A[(size_t)t * L + s] = ops->dot(ROW(k, t), bf->ke, D);
            B[(size_t)t * L + s] = ops->dot(Q + (size_t)t * D, bf->ke, D);
        }
        /* key decayed to the chunk end, for the state update */
        ops->vexp(bf->e, bf->dsum, D);
        ops->vmul(KS + (size_t)s * D, ks, bf->e, D);
    }
    /* The three products with S0 run as C += A S0 panels (gemm_acc keeps
     * each element's FMA sequence: increasing i, exactly as a per-row loop). */
    float *KD = bf->KD, *QD = bf->QD;
    for (int t = 0; t < L; t++) {
        ops->vmul(KD + (size_t)t * D, ROW(k, t), EG + (size_t)t * D, D);
        ops->scale(KD + (size_t)t * D, KD + (size_t)t * D, -1.0f, D); /* exact negation */
        ops->vmul(QD + (size_t)t * D, Q + (size_t)t * D, EG + (size_t)t * D, D);
        memcpy(W + (size_t)t * D, ROW(v, t), (size_t)D * sizeof *W);
        memset(ROW(o, t), 0, (size_t)D * sizeof *o);
    }
    ops->gemm_acc(W, D, L, D, KD, D, 1, D, S, D);      /* W_t = v_t - S0^T kd_t */
    ops->gemm_acc(o, (int)P, L, D, QD, D, 1, D, S, D); /* o_t = S0^T qd_t */
    for (int t = 0; t < L; t++) { /* forward substitution: the UT transform */
        float *c = W + (size_t)t * D;
        for (int s = 0; s < t; s++) ops->axpy(c, -A[(size_t)t * L + s], W + (size_t)s * D, D);
        ops->scale(c, c, beta[(size_t)t * H], D);
    }
    for (int t = 0; t < L; t++)
        for (int s = 0; s <= t; s++) ops->axpy(ROW(o, t), B[(size_t)t * L + s], W + (size_t)s * D, D);
    const float *EL = EG + (size_t)(L - 1) * D; /* state to the chunk end */
    for (int i = 0; i < D; i++) ops->scale(S + (size_t)i * D, S + (size_t)i * D, EL[i], D);
    ops->gemm_acc(S, D, D, D, KS, 1, D, L, W, D); /* S += KS^T W */
#undef ROW
}

void k_kda_chunked(float *o, float *S, const float *q, const float *k, const float *v,
                   const float *g, const float *beta, int T, int H, int D, int C) {
    const k_vops *ops = k_ops();
    if (C < 1) C = 1;
    float qscale = 1.0f / sqrtf((float)D);
    size_t P = (size_t)H * (size_t)D;
    size_t Cs = (size_t)C, Ds = (size_t)D;
#pragma omp parallel for schedule(static) if ((double)T * H * D * D > 32768.0)
    for (int h = 0; h < H; h++) {
        chunk_buf bf;
        size_t tot = 6 * Cs * Ds + 2 * Cs * Cs + 3 * Ds;
        float *mem = xmalloc_array(tot, sizeof *mem);
        float *p = mem;
        bf.Q = p; p += Cs * Ds;
        bf.W = p; p += Cs * Ds;
        bf.KS = p; p += Cs * Ds;
        bf.A = p; p += Cs * Cs;
        bf.B = p; p += Cs * Cs;
        bf.EG = p; p += Cs * Ds;
        bf.dsum = p; p += Ds;
        bf.e = p; p += Ds;
        bf.ke = p; p += Ds;
        bf.KD = p; p += Cs * Ds;
        bf.QD = p;
        float *Sh = S + (size_t)h * Ds * Ds;
        for (int t0 = 0; t0 < T; t0 += C) {
            int L = T - t0 < C ? T - t0 : C;
            size_t off = (size_t)t0 * P + (size_t)h * Ds;
            chunk_head(ops, &bf, o + off, Sh, q + off, k + off, v + off, g + off,
                       beta + (size_t)t0 * H + h, L, H, D, qscale);
        }
        free(mem);
    }
}

/* ---- output norm and gate ------------------------------------------------------------ */

void k_kda_out_norm_gate(float *out, const float *o, const float *gain, const float *gate, int H, int D,
                         float eps) {
    const k_vops *ops = k_ops();
    for (int h = 0; h < H; h++) {
        size_t off = (size_t)h * D;
        k_rmsnorm(out + off, o + off, gain, D, eps);
        ops->sigmoid_mul(out + off, gate + off, D);
    }
}
