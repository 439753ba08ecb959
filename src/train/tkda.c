/* tkda.c: Kimi Delta Attention, forward and backward for training
 * (k3-checkpoint-format.md section 8; report eq. 1-6).
 *
 * The recurrence runs in its exact sequential form; the backward is
 * backpropagation through time. The forward keeps the state only at every
 * KCK-th position; the backward recomputes the states inside one chunk from
 * that checkpoint (with the same code, so the same bits) and walks it in
 * reverse. Memory: B*H*(T/KCK)*D*D floats per layer instead of B*H*T*D*D. */
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

enum { KCK = 16 };

static int nck(int T) { return (T + KCK - 1) / KCK; }

size_t kda_scratch(const tmodel *m, int N) {
    const k3_config *c = &m->cfg;
    size_t P = (size_t)c->kda_heads * c->kda_head_dim;
    return (size_t)N * (16 * P + 4 * (size_t)c->kda_heads + (size_t)c->kda_head_dim);
}

void kda_alloc(const tmodel *m, kda_acts *a, int cap, int B, int T) {
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
    a->Sck = xmalloc_array((size_t)B * H * (size_t)nck(T) * D * D, sizeof(float));
}

void kda_free(kda_acts *a) {
    float *b[] = {a->pre, a->cv, a->q, a->k, a->rq, a->rk, a->v, a->beta, a->fa, a->zb, a->gl, a->o,
                  a->ro, a->gate, a->y, a->Sck};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
    memset(a, 0, sizeof *a);
}

/* One recurrence step for one head: S <- diag(exp g) S; u = S^T k;
 * S += k (beta (v - u))^T; o = S^T q / sqrt(D). u, d are D-float scratch. */
static void step_fwd(float *o, float *S, const float *q, const float *k, const float *v,
                     const float *gl, float beta, int D, float qscale, float *u) {
    for (int i = 0; i < D; i++) {
        float a = expf(gl[i]);
        float *s = S + (size_t)i * D;
        for (int j = 0; j < D; j++) s[j] *= a;
    }
    for (int j = 0; j < D; j++) u[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        const float *s = S + (size_t)i * D;
        for (int j = 0; j < D; j++) u[j] = fmaf(s[j], k[i], u[j]);
    }
    for (int j = 0; j < D; j++) u[j] = beta * (v[j] - u[j]); /* u becomes delta */
    for (int i = 0; i < D; i++) {
        float *s = S + (size_t)i * D;
        for (int j = 0; j < D; j++) s[j] = fmaf(k[i], u[j], s[j]);
    }
    if (o) {
        for (int j = 0; j < D; j++) o[j] = 0.0f;
        for (int i = 0; i < D; i++) {
            const float *s = S + (size_t)i * D;
            float qi = q[i] * qscale;
            for (int j = 0; j < D; j++) o[j] = fmaf(s[j], qi, o[j]);
        }
    }
}

void kda_recur_fwd(float *o, float *S, const float *q, const float *k, const float *v,
                   const float *gl, const float *beta, int T, int D, size_t st, size_t sb) {
    float *u = xmalloc_array((size_t)D, sizeof(float));
    float qs = 1.0f / sqrtf((float)D);
    for (int t = 0; t < T; t++)
        step_fwd(o + t * st, S, q + t * st, k + t * st, v + t * st, gl + t * st, beta[t * sb], D, qs, u);
    free(u);
}

void kda_forward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, float *out, int B, int T) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    const int N = B * T, P3 = 3 * P;
    const float *w = m->w;
    const kda_w *kw = &ly->kda;
    t_linear(a->pre, x, w + kw->qkv, N, E, P3);
    /* ShortConv (depthwise causal, w[c][K-1] on the current input) + SiLU */
    const float *cw = w + kw->conv;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        int t = n % T;
        float *cv = a->cv + (size_t)n * P3;
        for (int ch = 0; ch < P3; ch++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int tt = t - (K - 1) + j;
                if (tt < 0) continue;
                acc = fmaf(cw[(size_t)ch * K + j], a->pre[(size_t)(n - (K - 1) + j) * P3 + ch], acc);
            }
            cv[ch] = acc;
        }
        float *qr = a->q + (size_t)n * P, *kr = a->k + (size_t)n * P, *vr = a->v + (size_t)n * P;
        for (int i = 0; i < P; i++) {
            qr[i] = cv[i] * t_sigmoid(cv[i]);
            kr[i] = cv[P + i] * t_sigmoid(cv[P + i]);
            vr[i] = cv[2 * P + i] * t_sigmoid(cv[2 * P + i]);
        }
        for (int h = 0; h < H; h++) {
            float rq = 1.0f / sqrtf(k_sumsq(qr + h * D, D) + 1e-6f);
            float rk = 1.0f / sqrtf(k_sumsq(kr + h * D, D) + 1e-6f);
            a->rq[(size_t)n * H + h] = rq;
            a->rk[(size_t)n * H + h] = rk;
            for (int d = 0; d < D; d++) { qr[h * D + d] *= rq; kr[h * D + d] *= rk; }
        }
    }
    /* beta, decay */
    t_linear(a->beta, x, w + kw->b_proj, N, E, H);
    for (size_t i = 0; i < (size_t)N * H; i++) a->beta[i] = t_sigmoid(a->beta[i]);
    t_linear(a->fa, x, w + kw->f_a, N, E, D);
    t_linear(a->zb, a->fa, w + kw->f_b, N, D, P);
    const float *dtb = w + kw->dt_bias, *Al = w + kw->A_log;
    const float gmin = c->gate_lower_bound;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < P; i++) {
            size_t ix = (size_t)n * P + i;
            a->zb[ix] += dtb[i];
            a->gl[ix] = gmin * t_sigmoid(expf(Al[i / D]) * a->zb[ix]);
        }
    /* recurrence, one (sequence, head) per task; checkpoint every KCK steps */
    const int nc = nck(T);
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        float *S = xcalloc((size_t)D * D, sizeof(float));
        for (int ck = 0; ck < nc; ck++) {
            int t0 = ck * KCK, len = T - t0 < KCK ? T - t0 : KCK;
            memcpy(a->Sck + (((size_t)b * H + h) * nc + ck) * D * D, S, sizeof(float) * (size_t)D * D);
            size_t r0 = ((size_t)b * T + t0) * P + (size_t)h * D;
            kda_recur_fwd(a->o + r0, S, a->q + r0, a->k + r0, a->v + r0, a->gl + r0,
                          a->beta + ((size_t)b * T + t0) * H + h, len, D, (size_t)P, (size_t)H);
        }
        free(S);
    }
    /* head-wise RMSNorm (shared gain), sigmoid gate, o_proj */
    t_linear(a->gate, x, w + kw->g_proj, N, E, P);
    for (size_t i = 0; i < (size_t)N * P; i++) a->gate[i] = t_sigmoid(a->gate[i]);
    t_rmsnorm(a->y, a->ro, a->o, w + kw->o_norm, N * H, D, c->rms_eps);
    for (size_t i = 0; i < (size_t)N * P; i++) a->y[i] *= a->gate[i];
    t_linear(out, a->y, w + kw->o_proj, N, P, E);
}

/* Backward of one chunk [t0, t0+len) of one head, walking positions in
 * reverse. dS: gradient w.r.t. the state after the chunk (in), replaced by the
 * gradient w.r.t. the state before it. Sprev: [len][D][D] states before each
 * step (recomputed by the caller). Outputs dq, dk, dv, dgl (rows of stride st)
 * and dbeta (stride sb) are overwritten. */
static void chunk_bwd(float *dS, const float *Sprev, const float *q, const float *k, const float *v,
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
            al[i] = expf(gt[i]);
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

void kda_backward(tmodel *m, const tm_layer *ly, kda_acts *a, const float *x, const float *dout,
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
    t_linear_dw(g + kw->o_proj, dout, a->y, N, P, E);
    t_linear_dx(dy, dout, w + kw->o_proj, N, P, E, false);
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
    t_linear_dw(g + kw->g_proj, dgp, x, N, E, P);
    t_linear_dx(dx, dgp, w + kw->g_proj, N, E, P, false);
    /* recurrence (BPTT, chunk by chunk from the end) */
    const int nc = nck(T);
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        float *dS = xcalloc((size_t)D * D, sizeof(float));
        float *Sprev = xmalloc_array((size_t)KCK * D * D, sizeof(float));
        float *S = xmalloc_array((size_t)D * D, sizeof(float));
        float *wk = xmalloc_array(2 * (size_t)D * D + 5 * (size_t)D, sizeof(float));
        float qs = 1.0f / sqrtf((float)D);
        for (int ck = nc - 1; ck >= 0; ck--) {
            int t0 = ck * KCK, len = T - t0 < KCK ? T - t0 : KCK;
            size_t r0 = ((size_t)b * T + t0) * P + (size_t)h * D;
            size_t b0 = ((size_t)b * T + t0) * H + h;
            memcpy(S, a->Sck + (((size_t)b * H + h) * nc + ck) * D * D, sizeof(float) * (size_t)D * D);
            for (int t = 0; t < len; t++) {
                memcpy(Sprev + (size_t)t * D * D, S, sizeof(float) * (size_t)D * D);
                size_t rt = r0 + (size_t)t * P;
                step_fwd(NULL, S, a->q + rt, a->k + rt, a->v + rt, a->gl + rt, a->beta[b0 + (size_t)t * H], D,
                         qs, wk);
            }
            chunk_bwd(dS, Sprev, a->q + r0, a->k + r0, a->v + r0, a->gl + r0, a->beta + b0, dof + r0, dq + r0,
                      dk + r0, dv + r0, dgl + r0, dbeta + b0, len, D, (size_t)P, (size_t)H, wk);
        }
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
            float eA = expf(Al[i / D]);
            float s = t_sigmoid(eA * a->zb[ix]);
            dgl[ix] = dgl[ix] * gmin * s * (1.0f - s); /* d/d(eA zb) */
        }
    float *gA = g + kw->A_log, *gdt = g + kw->dt_bias;
    for (int h = 0; h < H; h++) {
        float eA = expf(Al[h]), s = 0.0f;
        for (int n = 0; n < N; n++)
            for (int d = 0; d < D; d++) {
                size_t ix = (size_t)n * P + (size_t)h * D + d;
                s = fmaf(dgl[ix], eA * a->zb[ix], s); /* d(eA zb)/dA_log = eA zb */
            }
        gA[h] += s;
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int i = 0; i < P; i++) dgl[(size_t)n * P + i] *= expf(Al[i / D]); /* now dzb */
#pragma omp parallel for schedule(static)
    for (int i = 0; i < P; i++) {
        float s = 0.0f;
        for (int n = 0; n < N; n++) s += dgl[(size_t)n * P + i];
        gdt[i] += s;
    }
    t_linear_dw(g + kw->f_b, dgl, a->fa, N, D, P);
    t_linear_dx(dfa, dgl, w + kw->f_b, N, D, P, false);
    t_linear_dw(g + kw->f_a, dfa, x, N, E, D);
    t_linear_dx(dx, dfa, w + kw->f_a, N, E, D, true);
    /* beta = sigmoid(b_proj x) */
    for (size_t i = 0; i < (size_t)N * H; i++) dbeta[i] *= a->beta[i] * (1.0f - a->beta[i]);
    t_linear_dw(g + kw->b_proj, dbeta, x, N, E, H);
    t_linear_dx(dx, dbeta, w + kw->b_proj, N, E, H, true);
    /* L2 norms of q, k, then SiLU: into dcv [N][3P] */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *dc = dcv + (size_t)n * P3;
        const float *cvr = a->cv + (size_t)n * P3;
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
        for (int i = 0; i < P3; i++) {
            float s = t_sigmoid(cvr[i]);
            dc[i] *= s * (1.0f + cvr[i] * (1.0f - s));
        }
    }
    /* ShortConv: dpre[n] = sum_j w[j] dcv[n + K-1-j] within the sequence */
    const float *cw = w + kw->conv;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        int t = n % T;
        for (int ch = 0; ch < P3; ch++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) {
                int tt = t + (K - 1 - j);
                if (tt >= T) continue;
                acc = fmaf(cw[(size_t)ch * K + j], dcv[(size_t)(n + K - 1 - j) * P3 + ch], acc);
            }
            dpre[(size_t)n * P3 + ch] = acc;
        }
    }
    float *gcw = g + kw->conv;
#pragma omp parallel for schedule(static)
    for (int ch = 0; ch < P3; ch++)
        for (int j = 0; j < K; j++) {
            float s = 0.0f;
            for (int n = 0; n < N; n++) {
                int t = n % T, tt = t - (K - 1) + j;
                if (tt < 0) continue;
                s = fmaf(dcv[(size_t)n * P3 + ch], a->pre[(size_t)(n - (K - 1) + j) * P3 + ch], s);
            }
            gcw[(size_t)ch * K + j] += s;
        }
    t_linear_dw(g + kw->qkv, dpre, x, N, E, P3);
    t_linear_dx(dx, dpre, w + kw->qkv, N, E, P3, true);
}
