/* tkda.c: Kimi Delta Attention for training: the record, the call of the
 * model graph's forward (src/model/kda.c, which runs the kernels' recurrent
 * or chunkwise form) and the backward (k3-checkpoint-format.md section 8;
 * report eq. 1-6).
 *
 * Two forms of the recurrence, chosen by tmodel.kda_chunk:
 *  - 0: the exact recurrent form, backward by backpropagation through time
 *    (the reference). The forward keeps the state every K_KDA_RECUR_BLOCK
 *    positions; the backward recomputes the states inside one block from that
 *    checkpoint (the kernel's step, same bits) and walks it in reverse.
 *  - C > 0: the chunkwise (UT / WY) form of kernels/kda.c, chunks of C
 *    positions clamped so |gate_lower_bound| C <= 80 (C = 16 for the K3
 *    bound -5); the backward (k_kda_chunk_bwd, in the kernels beside the
 *    forward it inverts) recomputes a chunk's products from its saved
 *    entering state (k_kda_chunk_prep) and walks them in reverse. The two
 *    forms agree to f32 rounding (test train_kda_chunked_matches_recurrent).
 * Memory for the saved states: B*H*(T/C)*D*D floats per layer. */
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

/* The chunk the kernels are asked for: 0 (recurrent) or the flag's,
 * at most TM_MAX_KDA_CHUNK; k_kda_block_len clamps it to the decay bound. */
int tm_kda_chunk(const tmodel *m) {
    if (m->kda_chunk <= 0) return 0;
    return m->kda_chunk < TM_MAX_KDA_CHUNK ? m->kda_chunk : TM_MAX_KDA_CHUNK;
}
/* Positions per saved state. */
static int ck_len(const tmodel *m) { return k_kda_block_len(tm_kda_chunk(m), m->cfg.gate_lower_bound); }
static int nck_of(int T, int C) { return (T + C - 1) / C; }

size_t kda_ssave_floats(const tmodel *m, int B, int T) {
    const k3_config *c = &m->cfg;
    return (size_t)B * c->kda_heads * (size_t)nck_of(T, ck_len(m)) * c->kda_head_dim * c->kda_head_dim;
}

size_t kda_scratch(const tmodel *m, int N) {
    const k3_config *c = &m->cfg;
    size_t P = (size_t)c->kda_heads * c->kda_head_dim;
    return (size_t)N * (16 * P + 4 * (size_t)c->kda_heads + (size_t)c->kda_head_dim);
}

void kda_alloc(const tmodel *m, kda_acts *a, int cap) {
    const k3_config *c = &m->cfg;
    const size_t N = (size_t)cap, H = c->kda_heads, D = c->kda_head_dim, P = H * D;
    a->pre = xmalloc_array(N * 3 * P, sizeof(float));
    a->cv = xmalloc_array(N * 3 * P, sizeof(float));
    a->q = xmalloc_array(N * P, sizeof(float));
    a->k = xmalloc_array(N * P, sizeof(float));
    a->rq = xmalloc_array(N * H, sizeof(float));
    a->rk = xmalloc_array(N * H, sizeof(float));
    a->v = xmalloc_array(N * P, sizeof(float));
    a->beta = xmalloc_array(N * H, sizeof(float));
    a->fa = xmalloc_array(N * D, sizeof(float));
    a->zb = xmalloc_array(N * P, sizeof(float));
    a->gl = xmalloc_array(N * P, sizeof(float));
    a->o = xmalloc_array(N * P, sizeof(float));
    a->ro = xmalloc_array(N * H, sizeof(float));
    a->gate = xmalloc_array(N * P, sizeof(float));
    a->y = xmalloc_array(N * P, sizeof(float));
    a->Ssave = NULL; /* sized before each forward (depends on the mode) */
}

void kda_free(kda_acts *a) {
    free(a->Ssave);
    float *b[] = {a->pre, a->cv, a->q, a->k, a->rq, a->rk, a->v, a->beta, a->fa, a->zb, a->gl, a->o,
                  a->ro, a->gate, a->y};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
    memset(a, 0, sizeof *a);
}

/* ShortConv taps [ch][K] -> [K][ch], so a tap runs over a contiguous row. */
static float *conv_taps_t(const float *cw, int nch, int K) {
    float *t = xmalloc_array((size_t)nch * K, sizeof(float));
    for (int ch = 0; ch < nch; ch++)
        for (int j = 0; j < K; j++) t[(size_t)j * nch + ch] = cw[(size_t)ch * K + j];
    return t;
}

/* Backward of one chunk [t0, t0+len) of one head, walking positions in
 * reverse. dS: gradient w.r.t. the state after the chunk (in), replaced by the
 * gradient w.r.t. the state before it. Sprev: [len][D][D] states before each
 * step (recomputed by the caller). Outputs dq, dk, dv, dgl (rows of stride st)
 * and dbeta (stride sb) are overwritten. */
K3_HOT static void chunk_bwd(float *dS, const float *Sprev, const float *q, const float *k, const float *v,
                      const float *gl, const float *beta, const float *dout, float *dq, float *dk,
                      float *dv, float *dgl, float *dbeta, int len, int D, size_t st, size_t sb,
                      float *wk) {
    float *Sp = wk, *St = wk + (size_t)D * D;           /* S' and S_t */
    float *u = St + (size_t)D * D, *dl = u + D, *du = dl + D, *al = du + D, *dlt = al + D;
    const float qs = 1.0f / sqrtf((float)D);
    for (int t = len - 1; t >= 0; t--) {
        const float *S0 = Sprev + (size_t)t * D * D;
        const float *qt = q + t * st, *kt = k + t * st, *vt = v + t * st, *gt = gl + t * st;
        const float *dot = dout + t * st;
        float bt = beta[t * sb];
        /* recompute S' = diag(a) S0, u = S'^T k, delta, S_t */
        for (int i = 0; i < D; i++) {
            al[i] = t_exp(gt[i]);
            for (int j = 0; j < D; j++) Sp[(size_t)i * D + j] = S0[(size_t)i * D + j] * al[i];
        }
        for (int j = 0; j < D; j++) u[j] = 0.0f;
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) u[j] = fmaf(Sp[(size_t)i * D + j], kt[i], u[j]);
        for (int j = 0; j < D; j++) dlt[j] = bt * (vt[j] - u[j]);
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) St[(size_t)i * D + j] = fmaf(kt[i], dlt[j], Sp[(size_t)i * D + j]);
        /* o = S_t^T (q qs): dq = qs S_t do; dS += (q qs) do^T */
        float *dqt = dq + t * st, *dkt = dk + t * st, *dvt = dv + t * st, *dgt = dgl + t * st;
        for (int i = 0; i < D; i++) {
            float s = 0.0f;
            for (int j = 0; j < D; j++) s = fmaf(St[(size_t)i * D + j], dot[j], s);
            dqt[i] = s * qs;
            float qi = qt[i] * qs;
            for (int j = 0; j < D; j++) dS[(size_t)i * D + j] = fmaf(qi, dot[j], dS[(size_t)i * D + j]);
        }
        /* S_t = S' + k delta^T */
        for (int j = 0; j < D; j++) dl[j] = 0.0f;
        for (int i = 0; i < D; i++) {
            float s = 0.0f;
            for (int j = 0; j < D; j++) {
                dl[j] = fmaf(dS[(size_t)i * D + j], kt[i], dl[j]);
                s = fmaf(dS[(size_t)i * D + j], dlt[j], s);
            }
            dkt[i] = s;
        }
        /* delta = beta (v - u) */
        float db = 0.0f;
        for (int j = 0; j < D; j++) {
            db = fmaf(dl[j], vt[j] - u[j], db);
            dvt[j] = bt * dl[j];
            du[j] = -bt * dl[j];
        }
        dbeta[t * sb] = db;
        /* u = S'^T k: dS' = dS + k du^T; dk += S' du */
        for (int i = 0; i < D; i++) {
            float s = 0.0f;
            for (int j = 0; j < D; j++) {
                s = fmaf(Sp[(size_t)i * D + j], du[j], s);
                dS[(size_t)i * D + j] = fmaf(kt[i], du[j], dS[(size_t)i * D + j]);
            }
            dkt[i] += s;
        }
        /* S' = diag(a) S0: da_i = <S0[i], dS'[i]>; dS0 = diag(a) dS' */
        for (int i = 0; i < D; i++) {
            float s = 0.0f;
            for (int j = 0; j < D; j++) {
                s = fmaf(S0[(size_t)i * D + j], dS[(size_t)i * D + j], s);
                dS[(size_t)i * D + j] *= al[i];
            }
            dgt[i] = s * al[i];
        }
    }
}

K3_HOT void kda_backward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    const int N = B * T, P3 = 3 * P;
    const size_t NP = (size_t)N * P;
    const float *w = m->w;
    float *g = m->g;
    const kda_w *kw = &ly->kda;
    float *dy = scratch, *dgp = dy + NP, *don = dgp + NP, *dof = don + NP;
    float *dq = dof + NP, *dk = dq + NP, *dv = dk + NP, *dgl = dv + NP;
    float *dbeta = dgl + NP, *dfa = dbeta + (size_t)N * H;
    float *dcv = dfa + (size_t)N * D, *dpre = dcv + 3 * NP;
    /* out = o_proj y, y = rmsnorm_h(o) * gate */
    t_linear_dw(g + kw->o_proj, dout, a->y, N, P, E, tm_gemm_mode(m));
    t_linear_dx(dy, dout, w + kw->o_proj, N, P, E, false, tm_gemm_mode(m));
    const float *gain = w + kw->o_norm;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < P; i++) {
            size_t ix = (size_t)n * P + i;
            float on = gain[i % D] * (a->o[ix] * a->ro[(size_t)n * H + i / D]);
            float s = a->gate[ix];
            dgp[ix] = dy[ix] * on * s * (1.0f - s);
            don[ix] = dy[ix] * s;
        }
    t_rmsnorm_bwd(dof, g + kw->o_norm, don, a->o, a->ro, gain, N * H, D, false);
    t_linear_dw(g + kw->g_proj, dgp, x, N, E, P, tm_gemm_mode(m));
    t_linear_dx(dx, dgp, w + kw->g_proj, N, E, P, false, tm_gemm_mode(m));
    /* the recurrence, chunk by chunk from the end: BPTT (recurrent) or the
     * chunkwise backward */
    const int CK = ck_len(m), nc = nck_of(T, CK);
    const bool chunked = m->kda_chunk > 0;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        float *dS = xcalloc((size_t)D * D, sizeof(float));
        float *Sprev = NULL, *S = NULL, *wk = NULL;
        k_kda_cws ws;
        if (chunked) {
            k_kda_cws_init(&ws, CK, D);
        } else {
            Sprev = xmalloc_array((size_t)CK * D * D, sizeof(float));
            S = xmalloc_array((size_t)D * D, sizeof(float));
            wk = xmalloc_array(2 * (size_t)D * D + 5 * (size_t)D, sizeof(float));
        }
        for (int ck = nc - 1; ck >= 0; ck--) {
            int t0 = ck * CK, len = T - t0 < CK ? T - t0 : CK;
            size_t r0 = ((size_t)b * T + t0) * P + (size_t)h * D;
            size_t b0 = ((size_t)b * T + t0) * H + h;
            const float *S0 = a->Ssave + (((size_t)b * H + h) * nc + ck) * D * D;
            if (chunked) {
                k_kda_chunk_bwd(&ws, dS, S0, a->q + r0, a->k + r0, a->v + r0, a->gl + r0, a->beta + b0,
                                dof + r0, dq + r0, dk + r0, dv + r0, dgl + r0, dbeta + b0, len, (size_t)P,
                                (size_t)H);
                continue;
            }
            memcpy(S, S0, sizeof(float) * (size_t)D * D);
            for (int t = 0; t < len; t++) {
                memcpy(Sprev + (size_t)t * D * D, S, sizeof(float) * (size_t)D * D);
                size_t rt = r0 + (size_t)t * P;
                /* the forward's step (one head: H = 1, row stride unused) */
                k_kda_recurrent(wk, S, a->q + rt, a->k + rt, a->v + rt, a->gl + rt, a->beta + b0 + (size_t)t * H, 1,
                                1, D);
            }
            chunk_bwd(dS, Sprev, a->q + r0, a->k + r0, a->v + r0, a->gl + r0, a->beta + b0, dof + r0, dq + r0,
                      dk + r0, dv + r0, dgl + r0, dbeta + b0, len, D, (size_t)P, (size_t)H, wk);
        }
        if (chunked) k_kda_cws_free(&ws);
        free(dS);
        free(Sprev);
        free(S);
        free(wk);
    }
    /* decay: gl = gmin sigmoid(exp(A_h) zb); dzb overwrites dgl */
    const float gmin = c->gate_lower_bound;
    const float *Al = w + kw->A_log;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < P; i++) {
            size_t ix = (size_t)n * P + i;
            float eA = t_exp(Al[i / D]);
            float s = t_sigmoid(eA * a->zb[ix]);
            dgl[ix] = dgl[ix] * gmin * s * (1.0f - s); /* d/d(eA zb) */
        }
    float *gA = g + kw->A_log, *gdt = g + kw->dt_bias;
    for (int h = 0; h < H; h++) {
        float eA = t_exp(Al[h]), s = 0.0f;
        for (int n = 0; n < N; n++)
            for (int d = 0; d < D; d++) {
                size_t ix = (size_t)n * P + (size_t)h * D + d;
                s = fmaf(dgl[ix], eA * a->zb[ix], s); /* d(eA zb)/dA_log = eA zb */
            }
        gA[h] += s;
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < P; i++) dgl[(size_t)n * P + i] *= t_exp(Al[i / D]); /* now dzb */
    {
        /* column sums over n in increasing order, rows read contiguously */
        float *acc = xcalloc((size_t)P, sizeof(float));
        for (int n = 0; n < N; n++) {
            const float *r = dgl + (size_t)n * P;
            for (int i = 0; i < P; i++) acc[i] += r[i];
        }
        for (int i = 0; i < P; i++) gdt[i] += acc[i];
        free(acc);
    }
    t_linear_dw(g + kw->f_b, dgl, a->fa, N, D, P, tm_gemm_mode(m));
    t_linear_dx(dfa, dgl, w + kw->f_b, N, D, P, false, tm_gemm_mode(m));
    t_linear_dw(g + kw->f_a, dfa, x, N, E, D, tm_gemm_mode(m));
    t_linear_dx(dx, dfa, w + kw->f_a, N, E, D, true, tm_gemm_mode(m));
    /* beta = sigmoid(b_proj x) */
    for (size_t i = 0; i < (size_t)N * H; i++) dbeta[i] *= a->beta[i] * (1.0f - a->beta[i]);
    t_linear_dw(g + kw->b_proj, dbeta, x, N, E, H, tm_gemm_mode(m));
    t_linear_dx(dx, dbeta, w + kw->b_proj, N, E, H, true, tm_gemm_mode(m));
    /* L2 norms of q, k, then SiLU: into dcv [N][3P] (the record's cv and pre
     * are three [N][P] planes, q, k, v) */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *dc = dcv + (size_t)n * P3;
        for (int h = 0; h < H; h++) {
            size_t o0 = (size_t)n * P + (size_t)h * D;
            float sq = 0.0f, sk = 0.0f;
            for (int d = 0; d < D; d++) {
                sq = fmaf(a->q[o0 + d], dq[o0 + d], sq);
                sk = fmaf(a->k[o0 + d], dk[o0 + d], sk);
            }
            float rq = a->rq[(size_t)n * H + h], rk = a->rk[(size_t)n * H + h];
            for (int d = 0; d < D; d++) {
                dc[h * D + d] = rq * (dq[o0 + d] - a->q[o0 + d] * sq);
                dc[P + h * D + d] = rk * (dk[o0 + d] - a->k[o0 + d] * sk);
                dc[2 * P + h * D + d] = dv[o0 + d];
            }
        }
        for (int pl = 0; pl < 3; pl++) {
            const float *cvr = a->cv + (size_t)pl * NP + (size_t)n * P;
            float *dcp = dc + (size_t)pl * P;
            for (int i = 0; i < P; i++) {
                float s = t_sigmoid(cvr[i]);
                dcp[i] *= s * (1.0f + cvr[i] * (1.0f - s));
            }
        }
    }
    /* ShortConv: dpre[n] = sum_j w[j] dcv[n + K-1-j] within the sequence */
    float *cwT = conv_taps_t(w + kw->conv, P3, K); /* as in the forward: same chains, rows at a time */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        int t = n % T;
        float *dp = dpre + (size_t)n * P3;
        for (int ch = 0; ch < P3; ch++) dp[ch] = 0.0f;
        for (int j = 0; j < K; j++) {
            if (t + (K - 1 - j) >= T) continue;
            const float *wj = cwT + (size_t)j * P3, *dr = dcv + (size_t)(n + K - 1 - j) * P3;
            for (int ch = 0; ch < P3; ch++) dp[ch] = fmaf(wj[ch], dr[ch], dp[ch]);
        }
    }
    free(cwT);
    /* taps: gcw[ch][j] += sum_n dcv[n][ch] pre[n-(K-1)+j][ch], n in increasing
     * order; blocks of channels so the rows are read contiguously */
    float *gcw = g + kw->conv;
    enum { CB = 64 };
    const int ncbp = (P + CB - 1) / CB, ncb = 3 * ncbp; /* blocks within each plane */
#pragma omp parallel for schedule(static)
    for (int cb = 0; cb < ncb; cb++) {
        int pl = cb / ncbp, p0 = (cb % ncbp) * CB, c0 = pl * P + p0, nch = P - p0 < CB ? P - p0 : CB;
        const float *plane = a->pre + (size_t)pl * NP + p0;
        float *acc = xcalloc((size_t)CB * K, sizeof(float)); /* [j][c] */
        for (int n = 0; n < N; n++) {
            int t = n % T;
            const float *d = dcv + (size_t)n * P3 + c0;
            for (int j = 0; j < K; j++) {
                if (t - (K - 1) + j < 0) continue;
                const float *src = plane + (size_t)(n - (K - 1) + j) * P;
                float *ac = acc + (size_t)j * CB;
                for (int c = 0; c < nch; c++) ac[c] = fmaf(d[c], src[c], ac[c]);
            }
        }
        for (int c = 0; c < nch; c++)
            for (int j = 0; j < K; j++) gcw[(size_t)(c0 + c) * K + j] += acc[(size_t)j * CB + c];
        free(acc);
    }
    t_linear_dw(g + kw->qkv, dpre, x, N, E, P3, tm_gemm_mode(m));
    t_linear_dx(dx, dpre, w + kw->qkv, N, E, P3, true, tm_gemm_mode(m));
}
