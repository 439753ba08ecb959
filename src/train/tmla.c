/* tmla.c: Gated MLA with NoPE for training: the record, the call of the
 * model graph's forward (src/model/mla.c, expanded core) and the backward
 * (k3-checkpoint-format.md section 9; report eq. 7). The rope slot
 * (qk_rope_head_dim) is projected and scored but never rotated; the single
 * shared k_rope receives the sum of every head's gradient. Latent norms use
 * cfg.mla_latent_eps (1e-6). */
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

size_t mla_scratch(const tmodel *m, int N) {
    const k3_config *c = &m->cfg;
    size_t H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim;
    size_t per = 3 * H * dv + H * (dn + dr) + H * (dn + dv) + H * dr + 3 * (size_t)c->kv_lora_rank + dr +
                 2 * (size_t)c->q_lora_rank;
    return (size_t)N * per;
}

void mla_alloc(const tmodel *m, mla_acts *a, int cap, int B, int T) {
    const k3_config *c = &m->cfg;
    const size_t N = (size_t)cap, H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim,
                 dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    a->cq_pre = xmalloc_array(N * rq, sizeof(float));
    a->rcq = xmalloc_array(N, sizeof(float));
    a->cq = xmalloc_array(N * rq, sizeof(float));
    a->q = xmalloc_array(N * H * (dn + dr), sizeof(float));
    a->ckv = xmalloc_array(N * (rkv + dr), sizeof(float));
    a->clat = xmalloc_array(N * rkv, sizeof(float));
    a->rkv = xmalloc_array(N, sizeof(float));
    a->ckvn = xmalloc_array(N * rkv, sizeof(float));
    a->kv = xmalloc_array(N * H * (dn + dv), sizeof(float));
    a->pr = xmalloc_array((size_t)B * H * (size_t)T * T, sizeof(float));
    a->o = xmalloc_array(N * H * dv, sizeof(float));
    a->gate = xmalloc_array(N * H * dv, sizeof(float));
    a->y = xmalloc_array(N * H * dv, sizeof(float));
}

void mla_free(mla_acts *a) {
    float *b[] = {a->cq_pre, a->rcq, a->cq, a->q, a->ckv, a->clat, a->rkv, a->ckvn, a->kv, a->pr, a->o,
                  a->gate, a->y};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
    memset(a, 0, sizeof *a);
}

/* ---- BF16 mode: the attention's backward as matrix products -------------------
 * (the forward: k3_mla_attend_expanded's BF16 form) per (sequence, head):
 * dP = dO V^T, dS = P (dP - rowsum(P dP)) scale, dQ = dS K, dK = dS^T Q,
 * dV = P^T dO. Each product is one training GEMM in the BF16 mode (AMX where
 * present), the full T x T square (the masked half multiplies zeros of P);
 * the heads run side by side, each product on one thread, so the bits do not
 * depend on the thread count. */
static void attn_bwd_bf16(const tmodel *m, const mla_acts *a, const float *dO, float *dQ, float *dKV,
                          float *dkrh, int B, int T) {
    const k3_config *c = &m->cfg;
    const int H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim,
              rkv = c->kv_lora_rank;
    const int dq = dn + dr, dkv = dn + dv, HV = H * dv;
    const float scale = 1.0f / sqrtf((float)dq);
#pragma omp parallel
    {
        float *dS = xmalloc_array((size_t)T * T, sizeof(float));
#pragma omp for schedule(dynamic)
        for (int bh = 0; bh < B * H; bh++) {
            int b = bh / H, h = bh % H;
            const float *P = a->pr + (size_t)bh * T * T;
            const float *q0 = a->q + (size_t)b * T * H * dq + (size_t)h * dq;
            const float *kv0 = a->kv + (size_t)b * T * H * dkv + (size_t)h * dkv;
            const float *kr0 = a->ckv + (size_t)b * T * (rkv + dr) + rkv;
            const float *do0 = dO + (size_t)b * T * HV + (size_t)h * dv;
            float *dkv0 = dKV + (size_t)b * T * H * dkv + (size_t)h * dkv;
            float *dq0 = dQ + (size_t)b * T * H * dq + (size_t)h * dq;
            /* dP = dO V^T, then dS in place */
            k_gemm(dS, T, T, T, dv, (k_view){do0, HV, 1}, (k_view){kv0 + dn, 1, H * dkv}, false, K_GEMM_BF16);
            for (int t = 0; t < T; t++) {
                const float *pr = P + (size_t)t * T;
                float *ds = dS + (size_t)t * T, mix = 0.0f;
                for (int s = 0; s <= t; s++) mix += pr[s] * ds[s];
                for (int s = 0; s <= t; s++) ds[s] = pr[s] * (ds[s] - mix) * scale;
                for (int s = t + 1; s < T; s++) ds[s] = 0.0f;
            }
            k_gemm(dq0, H * dq, T, dn, T, (k_view){dS, T, 1}, (k_view){kv0, H * dkv, 1}, false, K_GEMM_BF16);
            k_gemm(dkv0, H * dkv, T, dn, T, (k_view){dS, 1, T}, (k_view){q0, H * dq, 1}, false, K_GEMM_BF16);
            k_gemm(dkv0 + dn, H * dkv, T, dv, T, (k_view){P, 1, T}, (k_view){do0, HV, 1}, false, K_GEMM_BF16);
            if (dr) {
                k_gemm(dq0 + dn, H * dq, T, dr, T, (k_view){dS, T, 1}, (k_view){kr0, rkv + dr, 1}, false,
                        K_GEMM_BF16);
                k_gemm(dkrh + (size_t)b * T * H * dr + (size_t)h * dr, H * dr, T, dr, T, (k_view){dS, 1, T},
                        (k_view){q0 + dn, H * dq, 1}, false, K_GEMM_BF16);
            }
        }
        free(dS);
    }
}

K3_HOT void mla_backward(tmodel *m, const tm_layer *ly, mla_acts *a, const float *x, const float *dout,
                  float *dx, int B, int T, float *scratch) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, H = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim,
              dv = c->v_head_dim, rq = c->q_lora_rank, rkv = c->kv_lora_rank;
    const int N = B * T, dq = dn + dr, dkv = dn + dv, HV = H * dv;
    const float *w = m->w;
    float *g = m->g;
    const mla_w *mw = &ly->mla;
    float *dy = scratch, *dgp = dy + (size_t)N * HV, *dO = dgp + (size_t)N * HV;
    float *dQ = dO + (size_t)N * HV, *dKV = dQ + (size_t)N * H * dq, *dkrh = dKV + (size_t)N * H * dkv;
    float *dckvn = dkrh + (size_t)N * H * dr, *dclat = dckvn + (size_t)N * rkv;
    float *dckv = dclat + (size_t)N * rkv, *dcq = dckv + (size_t)N * (rkv + dr), *dcqp = dcq + (size_t)N * rq;
    t_linear_dw(g + mw->o_proj, dout, a->y, N, HV, E, tm_gemm_mode(m));
    t_linear_dx(dy, dout, w + mw->o_proj, N, HV, E, false, tm_gemm_mode(m));
    for (size_t i = 0; i < (size_t)N * HV; i++) {
        float s = a->gate[i];
        dgp[i] = dy[i] * a->o[i] * s * (1.0f - s);
        dO[i] = dy[i] * s;
    }
    t_linear_dw(g + mw->g_proj, dgp, x, N, E, HV, tm_gemm_mode(m));
    t_linear_dx(dx, dgp, w + mw->g_proj, N, E, HV, false, tm_gemm_mode(m));
    const float scale = 1.0f / sqrtf((float)dq);
    memset(dKV, 0, sizeof(float) * (size_t)N * H * dkv);
    memset(dkrh, 0, sizeof(float) * (size_t)N * H * dr);
    if (m->bf16) attn_bwd_bf16(m, a, dO, dQ, dKV, dkrh, B, T);
    else
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        int b = bh / H, h = bh % H;
        const float *P = a->pr + (size_t)bh * T * T;
        float *ds = xmalloc_array((size_t)T, sizeof(float));
        for (int t = 0; t < T; t++) {
            size_t nt = (size_t)b * T + t;
            const float *pr = P + (size_t)t * T;
            const float *dot = dO + nt * HV + (size_t)h * dv;
            const float *qt = a->q + nt * H * dq + (size_t)h * dq;
            float mix = 0.0f;
            for (int s = 0; s <= t; s++) {
                const float *vs = a->kv + ((size_t)b * T + s) * H * dkv + (size_t)h * dkv + dn;
                ds[s] = k_dot(dot, vs, dv);
                mix += pr[s] * ds[s];
            }
            float *dqt = dQ + nt * H * dq + (size_t)h * dq;
            for (int i = 0; i < dq; i++) dqt[i] = 0.0f;
            for (int s = 0; s <= t; s++) {
                size_t ns = (size_t)b * T + s;
                float dsc = pr[s] * (ds[s] - mix) * scale;
                const float *kn = a->kv + ns * H * dkv + (size_t)h * dkv;
                const float *kr = a->ckv + ns * (rkv + dr) + rkv;
                float *dk = dKV + ns * H * dkv + (size_t)h * dkv;
                float *dkr = dkrh + (ns * H + h) * dr;
                for (int i = 0; i < dn; i++) {
                    dqt[i] = fmaf(dsc, kn[i], dqt[i]);
                    dk[i] = fmaf(dsc, qt[i], dk[i]);
                }
                for (int i = 0; i < dr; i++) {
                    dqt[dn + i] = fmaf(dsc, kr[i], dqt[dn + i]);
                    dkr[i] = fmaf(dsc, qt[dn + i], dkr[i]);
                }
                for (int j = 0; j < dv; j++) dk[dn + j] = fmaf(pr[s], dot[j], dk[dn + j]);
            }
        }
        free(ds);
    }
    /* kv path */
    t_linear_dw(g + mw->kv_b, dKV, a->ckvn, N, rkv, H * dkv, tm_gemm_mode(m));
    t_linear_dx(dckvn, dKV, w + mw->kv_b, N, rkv, H * dkv, false, tm_gemm_mode(m));
    t_rmsnorm_bwd(dclat, g + mw->kv_a_norm, dckvn, a->clat, a->rkv, w + mw->kv_a_norm, N, rkv, false);
    for (int n = 0; n < N; n++) {
        float *d = dckv + (size_t)n * (rkv + dr);
        memcpy(d, dclat + (size_t)n * rkv, sizeof(float) * rkv);
        for (int i = 0; i < dr; i++) {
            float s = 0.0f;
            for (int h = 0; h < H; h++) s += dkrh[((size_t)n * H + h) * dr + i];
            d[rkv + i] = s;
        }
    }
    t_linear_dw(g + mw->kv_a, dckv, x, N, E, rkv + dr, tm_gemm_mode(m));
    t_linear_dx(dx, dckv, w + mw->kv_a, N, E, rkv + dr, true, tm_gemm_mode(m));
    /* q path */
    t_linear_dw(g + mw->q_b, dQ, a->cq, N, rq, H * dq, tm_gemm_mode(m));
    t_linear_dx(dcq, dQ, w + mw->q_b, N, rq, H * dq, false, tm_gemm_mode(m));
    t_rmsnorm_bwd(dcqp, g + mw->q_a_norm, dcq, a->cq_pre, a->rcq, w + mw->q_a_norm, N, rq, false);
    t_linear_dw(g + mw->q_a, dcqp, x, N, E, rq, tm_gemm_mode(m));
    t_linear_dx(dx, dcqp, w + mw->q_a, N, E, rq, true, tm_gemm_mode(m));
}
