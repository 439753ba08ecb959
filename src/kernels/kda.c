/* kda.c: the Kimi Delta Attention kernels (spec section 8): depthwise causal
 * ShortConv with SiLU, the decay gate, the recurrent delta rule, its chunkwise
 * UT/WY form (prefill and training) with training's backward of a chunk,
 * and the head-wise output norm + gate.
 *
 * Each kernel is written once over the primitive table (internal.h), so the
 * scalar and AVX-512 paths give the same bits. Heads are independent; threads
 * split heads, never a head's arithmetic. */
#include "kernels/internal.h"
#include "util/common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- ShortConv ----------------------------------------------------------- */

/* One position (decoding): each channel's taps straight from its carried
 * inputs, the same fmas in the same order as the windowed form below,
 * without its buffers (a decoded token makes one call per plane and KDA
 * layer, a batch one per sequence too: the windows' allocation and
 * transposes cost more than the arithmetic). */
K3_HOT static void shortconv_one(float *y, const float *x, int C, const float *w, int K, float *state) {
    const int P = K - 1;
    for (int c = 0; c < C; c++) {
        float *s = state + (size_t)c * P, xc = x[c], acc = 0.0f;
        const float *wc = w + (size_t)c * K;
        for (int j = 0; j < P; j++) acc = fmaf(wc[j], s[j], acc);
        for (int j = 0; j + 1 < P; j++) s[j] = s[j + 1];
        if (P > 0) s[P - 1] = xc;
        y[c] = fmaf(wc[P], xc, acc);
    }
}

void k_shortconv(float *y, const float *x, int T, int C, const float *w, int K, float *state) {
    const k_vops *ops = k_ops();
    if (T <= 0 || C <= 0) return;
    if (T == 1) {
        shortconv_one(y, x, C, w, K, state);
        return;
    }
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
    for (int c = 0; c < C; c++)
        for (int j = 0; j < P; j++) state[(size_t)c * P + j] = win[(size_t)(T + j) * C + c];
    free(win);
    free(wt);
}

void k_shortconv_silu(float *y, const float *x, int T, int C, const float *w, int K, float *state) {
    k_shortconv(y, x, T, C, w, K, state);
    if (T > 0 && C > 0) k_ops()->silu(y, T * C);
}

/* ---- decay gate ---------------------------------------------------------------- */

K3_HOT void k_kda_gate(float *g, float *zb, const float *z, const float *A_log, const float *dt_bias, int H,
                       int D, float lower) {
    const k_vops *ops = k_ops();
    for (int h = 0; h < H; h++) {
        float a = km_exp(A_log[h]);
        float *gh = g + (size_t)h * D;
        ops->vadd(gh, z + (size_t)h * D, dt_bias + (size_t)h * D, D);
        if (zb) memcpy(zb + (size_t)h * D, gh, (size_t)D * sizeof *gh);
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
    k_kda_forward(o, S, q, k, v, g, beta, 1, T, H, D, 0, 0.0f, NULL);
}

/* ---- chunkwise (UT / WY) form ------------------------------------------------------
 * Within a chunk of L positions, with G_t = g_1 + ... + g_t (per key channel)
 * and the state S0 entering it:
 *     KG = K e^G, KN = K e^-G, QG = (Q/sqrt(D)) e^G          (row-wise)
 *     A = strict_tril(KG KN^T), Bm = tril(QG KN^T)  (A[t][s] = sum_i k_t k_s e^(G_t-G_s))
 *     W = diag(beta) (V - KG S0 - A W)               (forward substitution: the UT transform)
 *     O = QG S0 + Bm W
 *     S = diag(e^G_L) S0 + (K e^(G_L - G))^T W
 * Factoring e^(G_t - G_s) = e^G_t e^-G_s makes every step a matrix product
 * (O(L D) exponentials per chunk, not O(L^2 D)), and training's backward is
 * the reverse of these same products. It is safe because the decay is bounded
 * below (g >= lower), so |G| <= |lower| L: k_kda_block_len clamps the chunk to
 * |lower| L <= 80, and e^80 is far from the f32 limit. */

int k_kda_block_len(int C, float lower) {
    if (C <= 0) return K_KDA_RECUR_BLOCK;
    float lb = fabsf(lower);
    if (lb > 0.0f && (float)C * lb > 80.0f) C = (int)(80.0f / lb);
    return C < 1 ? 1 : C;
}

void k_kda_cws_init(k_kda_cws *w, int C, int D) {
    size_t cd = (size_t)C * D, cc = (size_t)C * C, dd = (size_t)D * D;
    w->C = C;
    w->D = D;
    w->buf = xmalloc_aligned(sizeof(float) * (20 * cd + 4 * cc + 3 * dd + (size_t)C));
    float *p = w->buf;
    float **cdv[] = {&w->G, &w->eG, &w->eN, &w->KG, &w->KN, &w->QG, &w->KC, &w->Z, &w->W, &w->O,
                     &w->dQG, &w->dKG, &w->dKN, &w->dKC, &w->dW, &w->E, &w->nZ, &w->dG, &w->KNT, &w->WT};
    for (size_t i = 0; i < sizeof cdv / sizeof cdv[0]; i++) { *cdv[i] = p; p += cd; }
    float **ccv[] = {&w->Am, &w->Bm, &w->dA, &w->dBm};
    for (size_t i = 0; i < 4; i++) { *ccv[i] = p; p += cc; }
    w->S0T = p; p += dd;
    w->dST = p; p += dd;
    w->dS0 = p; p += dd;
    w->bd = p;
}

void k_kda_cws_free(k_kda_cws *w) { free(w->buf); }

/* The chunk form's two helpers: dst[c][r] = src[r][c] (src row stride lds),
 * and C[M][N] (ldc) = 0 then += A B through ops->gemm_acc (one fma chain per
 * element over k in order). */
static void k_kda_transpose(float *dst, const float *src, int rows, int cols, size_t lds) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) dst[(size_t)c * rows + r] = src[(size_t)r * lds + c];
}

static void k_kda_mm0(const k_vops *ops, float *Cm, int ldc, int M, int N, const float *A, int sam, int sak,
                      int K, const float *Bm, int ldb) {
    for (int m = 0; m < M; m++) memset(Cm + (size_t)m * ldc, 0, sizeof(float) * (size_t)N);
    if (K > 0) ops->gemm_acc(Cm, ldc, M, N, A, sam, sak, K, Bm, ldb);
}

void k_kda_chunk_prep(k_kda_cws *w, const float *q, const float *k, const float *v, const float *gl,
                      const float *beta, int L, size_t st, size_t sb, const float *S0) {
    const k_vops *ops = k_ops();
    const int D = w->D, C = w->C;
    const float qs = 1.0f / sqrtf((float)D);
    for (int t = 0; t < L; t++) {
        float *G = w->G + (size_t)t * D;
        const float *g = gl + t * st;
        if (t == 0) memcpy(G, g, sizeof(float) * (size_t)D);
        else ops->vadd(G, G - D, g, D);
    }
    ops->vexp(w->eG, w->G, L * D);
    for (int i = 0; i < L * D; i++) w->eN[i] = -w->G[i];
    ops->vexp(w->eN, w->eN, L * D);
    for (int t = 0; t < L; t++) {
        size_t r = (size_t)t * D;
        ops->vmul(w->KG + r, k + t * st, w->eG + r, D);
        ops->vmul(w->KN + r, k + t * st, w->eN + r, D);
        ops->scale(w->QG + r, q + t * st, qs, D);
        ops->vmul(w->QG + r, w->QG + r, w->eG + r, D);
    }
    k_kda_transpose(w->KNT, w->KN, L, D, (size_t)D); /* [D][L] */
    k_kda_mm0(ops, w->Am, C, L, L, w->KG, D, 1, D, w->KNT, L);
    k_kda_mm0(ops, w->Bm, C, L, L, w->QG, D, 1, D, w->KNT, L);
    /* Both strictly lower; the diagonal of Bm (e^0 = 1) is the plain dot
     * q_t.k_t / sqrt(D): kept out of the e^G factors, its G-gradient would be
     * two large terms cancelling (bad when the decay is strong). */
    for (int t = 0; t < L; t++) {
        for (int u = t; u < L; u++) w->Am[(size_t)t * C + u] = w->Bm[(size_t)t * C + u] = 0.0f;
        w->bd[t] = ops->dot(q + t * st, k + t * st, D) * qs;
    }
    /* Z = V - KG S0 - A W, W = beta Z, row by row */
    k_kda_mm0(ops, w->Z, D, L, D, w->KG, D, 1, D, S0, D);
    for (int t = 0; t < L; t++) {
        float *z = w->Z + (size_t)t * D;
        ops->subscale(z, v + t * st, z, 1.0f, D);
        for (int u = 0; u < t; u++) ops->axpy(z, -w->Am[(size_t)t * C + u], w->W + (size_t)u * D, D);
        ops->scale(w->W + (size_t)t * D, z, beta[t * sb], D);
    }
    /* KC = K e^(G_L - G) */
    const float *eGl = w->eG + (size_t)(L - 1) * D;
    for (int t = 0; t < L; t++) ops->vmul(w->KC + (size_t)t * D, w->KN + (size_t)t * D, eGl, D);
}

/* One chunk: o rows (stride st) and S (S0 in, the state after the chunk out). */
static void chunk_fwd(const k_vops *ops, k_kda_cws *w, float *o, float *S, const float *q, const float *k,
                      const float *v, const float *gl, const float *beta, int L, size_t st, size_t sb) {
    const int D = w->D, C = w->C;
    k_kda_chunk_prep(w, q, k, v, gl, beta, L, st, sb, S);
    k_kda_mm0(ops, w->O, D, L, D, w->QG, D, 1, D, S, D);
    ops->gemm_acc(w->O, D, L, D, w->Bm, C, 1, L, w->W, D);
    for (int t = 0; t < L; t++) ops->axpy(w->O + (size_t)t * D, w->bd[t], w->W + (size_t)t * D, D);
    for (int t = 0; t < L; t++) memcpy(o + t * st, w->O + (size_t)t * D, sizeof(float) * (size_t)D);
    const float *eGl = w->eG + (size_t)(L - 1) * D;
    for (int i = 0; i < D; i++) ops->scale(S + (size_t)i * D, S + (size_t)i * D, eGl[i], D);
    ops->gemm_acc(S, D, D, D, w->KC, 1, D, L, w->W, D);
}

/* Training's backward of one chunk (kernels.h), next to the forward it
 * inverts: it walks chunk_fwd's products in reverse. */
K3_HOT void k_kda_chunk_bwd(k_kda_cws *w, float *dS, const float *S0, const float *q, const float *k,
                            const float *v, const float *gl, const float *beta, const float *dout, float *dq,
                            float *dk, float *dv, float *dgl, float *dbeta, int L, size_t st, size_t sb) {
    const k_vops *ops = k_ops();
    const int D = w->D, C = w->C;
    const float qs = 1.0f / sqrtf((float)D);
    k_kda_chunk_prep(w, q, k, v, gl, beta, L, st, sb, S0);
    const float *eGl = w->eG + (size_t)(L - 1) * D;
    /* S = diag(e^G_L) S0 + KC^T W */
    k_kda_transpose(w->dST, dS, D, D, (size_t)D);
    k_kda_mm0(ops, w->dKC, D, L, D, w->W, D, 1, D, w->dST, D);   /* W dS^T */
    k_kda_mm0(ops, w->dW, D, L, D, w->KC, D, 1, D, dS, D);       /* KC dS */
    memset(w->dG, 0, sizeof(float) * (size_t)L * D);
    float *dGl = w->dG + (size_t)(L - 1) * D;
    for (int i = 0; i < D; i++) {
        float sdot = ops->dot(S0 + (size_t)i * D, dS + (size_t)i * D, D);
        dGl[i] = eGl[i] * sdot;
        ops->scale(w->dS0 + (size_t)i * D, dS + (size_t)i * D, eGl[i], D);
    }
    for (int t = 0; t < L - 1; t++) { /* the last row's factor is e^0 */
        const float *dkc = w->dKC + (size_t)t * D, *kc = w->KC + (size_t)t * D;
        float *dG = w->dG + (size_t)t * D;
        for (int i = 0; i < D; i++) {
            float pr = dkc[i] * kc[i];
            dG[i] -= pr;
            dGl[i] += pr;
        }
    }
    /* O = QG S0 + Bm W */
    k_kda_transpose(w->S0T, S0, D, D, (size_t)D);
    k_kda_mm0(ops, w->dQG, D, L, D, dout, (int)st, 1, D, w->S0T, D);            /* dO S0^T */
    ops->gemm_acc(w->dS0, D, D, D, w->QG, 1, D, L, dout, (int)st);        /* += QG^T dO */
    k_kda_transpose(w->WT, w->W, L, D, (size_t)D);                              /* [D][L] */
    k_kda_mm0(ops, w->dBm, C, L, L, dout, (int)st, 1, D, w->WT, L);             /* dO W^T */
    float *dbd = w->bd; /* reused: bd is read below before being overwritten */
    for (int t = 0; t < L; t++) {
        for (int u = t; u < L; u++) w->dBm[(size_t)t * C + u] = 0.0f;
        ops->axpy(w->dW + (size_t)t * D, w->bd[t], dout + t * st, D);     /* += diag(bd) dO */
        dbd[t] = ops->dot(dout + t * st, w->W + (size_t)t * D, D);
    }
    ops->gemm_acc(w->dW, D, L, D, w->Bm, 1, C, L, dout, (int)st);         /* += Bm^T dO */
    /* W = beta Z, Z = V - KG S0 - A W (reverse substitution) */
    memcpy(w->E, w->dW, sizeof(float) * (size_t)L * D);
    for (int t = L - 1; t >= 0; t--) {
        float *e = w->E + (size_t)t * D, *nz = w->nZ + (size_t)t * D;
        float bt = beta[t * sb];
        dbeta[t * sb] = ops->dot(e, w->Z + (size_t)t * D, D);
        ops->scale(nz, e, -bt, D);                                         /* -dZ_t */
        for (int u = 0; u < t; u++) ops->axpy(w->E + (size_t)u * D, w->Am[(size_t)t * C + u], nz, D);
    }
    k_kda_mm0(ops, w->dA, C, L, L, w->nZ, D, 1, D, w->WT, L);                   /* -dZ W^T */
    for (int t = 0; t < L; t++)
        for (int u = t; u < L; u++) w->dA[(size_t)t * C + u] = 0.0f;
    for (int t = 0; t < L; t++) ops->scale(dv + t * st, w->nZ + (size_t)t * D, -1.0f, D);
    k_kda_mm0(ops, w->dKG, D, L, D, w->nZ, D, 1, D, w->S0T, D);                 /* -dZ S0^T */
    ops->gemm_acc(w->dS0, D, D, D, w->KG, 1, D, L, w->nZ, D);             /* -= KG^T dZ */
    /* A = strict_tril(KG KN^T), Bm = tril(QG KN^T) */
    ops->gemm_acc(w->dKG, D, L, D, w->dA, C, 1, L, w->KN, D);             /* += dA KN */
    k_kda_mm0(ops, w->dKN, D, L, D, w->dA, 1, C, L, w->KG, D);                  /* dA^T KG */
    ops->gemm_acc(w->dQG, D, L, D, w->dBm, C, 1, L, w->KN, D);            /* += dBm KN */
    ops->gemm_acc(w->dKN, D, L, D, w->dBm, 1, C, L, w->QG, D);            /* += dBm^T QG */
    /* the e^(+-G) factors: dK, dQ and dG; then dg = reverse cumulative sum of dG */
    for (int t = 0; t < L; t++) {
        size_t r = (size_t)t * D;
        float *dG = w->dG + r, *dkt = dk + t * st, *dqt = dq + t * st;
        const float *eG = w->eG + r, *eN = w->eN + r;
        for (int i = 0; i < D; i++) {
            dkt[i] = w->dKG[r + i] * eG[i] + w->dKN[r + i] * eN[i] + w->dKC[r + i] * (eN[i] * eGl[i]) +
                     dbd[t] * (q[t * st + i] * qs);
            dqt[i] = (w->dQG[r + i] * eG[i] + dbd[t] * k[t * st + i]) * qs;
            dG[i] += w->dQG[r + i] * w->QG[r + i] + w->dKG[r + i] * w->KG[r + i] - w->dKN[r + i] * w->KN[r + i];
        }
    }
    for (int t = L - 1; t >= 0; t--) {
        float *dgt = dgl + t * st;
        const float *dG = w->dG + (size_t)t * D;
        if (t == L - 1) memcpy(dgt, dG, sizeof(float) * (size_t)D);
        else ops->vadd(dgt, dgl + (t + 1) * st, dG, D);
    }
    memcpy(dS, w->dS0, sizeof(float) * (size_t)D * D);
}

void k_kda_chunked(float *o, float *S, const float *q, const float *k, const float *v,
                   const float *g, const float *beta, int T, int H, int D, int C, float lower) {
    k_kda_forward(o, S, q, k, v, g, beta, 1, T, H, D, C < 1 ? 1 : C, lower, NULL);
}

/* ---- both forms over sequences and heads ------------------------------------------- */

/* Sequence s's head h over its T rows from row r0 (a row: P floats of q, k,
 * v, g, o; H of beta), its state Sh [D][D]; Ssave: the state entering every
 * block, [nblocks][D][D] (NULL: none). */
static void kda_head(const k_vops *ops, float *o, float *Sh, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, size_t r0, int T, int h, int H, int D, int C, float lower,
                     float *Ssave) {
    const bool chunked = C > 0;
    /* the recurrent form runs a head in one sweep unless the states are saved */
    const int CK = !chunked && !Ssave ? T : k_kda_block_len(C, lower), nc = (T + CK - 1) / CK;
    const float qscale = 1.0f / sqrtf((float)D);
    const size_t P = (size_t)H * (size_t)D, DD = (size_t)D * D;
    k_kda_cws ws;
    float *tmp = NULL;
    if (chunked) k_kda_cws_init(&ws, CK, D);
    else tmp = xmalloc_array(5 * (size_t)D, sizeof *tmp);
    for (int ck = 0; ck < nc; ck++) {
        const int t0 = ck * CK, L = T - t0 < CK ? T - t0 : CK;
        if (Ssave) memcpy(Ssave + (size_t)ck * DD, Sh, sizeof(float) * DD);
        const size_t a = (r0 + (size_t)t0) * P + (size_t)h * D;
        const float *bt = beta + (r0 + (size_t)t0) * H + h;
        if (chunked)
            chunk_fwd(ops, &ws, o + a, Sh, q + a, k + a, v + a, g + a, bt, L, P, (size_t)H);
        else
            recur_head(ops, o + a, Sh, q + a, k + a, v + a, g + a, bt, L, H, D, qscale, tmp);
    }
    if (chunked) k_kda_cws_free(&ws);
    free(tmp);
}

/* A team only where the (sequence, head) pairs carry enough work */
#define KDA_PAR(rows, H, D) ((double)(rows) * (H) * (D) * (D) > 32768.0)

void k_kda_forward(float *o, float *S, const float *q, const float *k, const float *v, const float *g,
                   const float *beta, int nseq, int T, int H, int D, int C, float lower, float *Ssave) {
    const k_vops *ops = k_ops();
    if (T < 1 || nseq < 1) return;
    const int nc = C > 0 || Ssave ? (T + k_kda_block_len(C, lower) - 1) / k_kda_block_len(C, lower) : 1;
    const size_t DD = (size_t)D * D;
#pragma omp parallel for schedule(static) if (KDA_PAR((double)nseq * T, H, D))
    for (int sh = 0; sh < nseq * H; sh++)
        kda_head(ops, o, S + (size_t)sh * DD, q, k, v, g, beta, (size_t)(sh / H) * T, T, sh % H, H, D, C, lower,
                 Ssave ? Ssave + (size_t)sh * nc * DD : NULL);
}

void k_kda_forward_seqs(float *o, const float *q, const float *k, const float *v, const float *g,
                        const float *beta, const k_kda_seq *seq, int nseq, int H, int D, float lower) {
    const k_vops *ops = k_ops();
    double rows = 0;
    for (int s = 0; s < nseq; s++) rows += seq[s].T;
    const size_t DD = (size_t)D * D;
#pragma omp parallel for schedule(static) if (KDA_PAR(rows, H, D))
    for (int sh = 0; sh < nseq * H; sh++) {
        const k_kda_seq *x = &seq[sh / H];
        if (x->T > 0)
            kda_head(ops, o, x->S + (size_t)(sh % H) * DD, q, k, v, g, beta, x->row, x->T, sh % H, H, D, x->C, lower,
                     NULL);
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
