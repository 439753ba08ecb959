/* tmoe.c: the MLP sublayers for training: dense SiTU-GLU MLP and Stable
 * LatentMoE (k3-checkpoint-format.md sections 10-11; report eq. 11-14). The
 * forwards are the model graph's (model.c mlp_block, moe.c moe_block) on a
 * weight view of the arena, with a record; here are the backward and
 * training's bookkeeping (expert loads, Quantile Balancing margins).
 *
 * Router (kernels k_router_select): s = sigmoid(W_r x); experts chosen by
 * top-k of s + bias (ties to the lower index), weights from the UNBIASED s,
 * renormalised; the gradient flows through the selected s only and the bias
 * gets none. The (k+1)-th selection score is each token's Quantile Balancing
 * cutoff. Routed experts run batched: the tokens of one expert are grouped
 * and go through one matrix product per weight. */
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

/* ---- dense SiTU-GLU MLP (also the fused shared experts) ----------------------- */

/* SiTU-GLU backward on [N][W] planes: dg, du from dh and the gate and up
 * planes (the forward is the model graph's). */
static void situ_planes_bwd(float *dg, float *du, const float *dh, const float *g, const float *u, int N, int W,
                            float b1, float b2) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        size_t r = (size_t)n * W;
        t_situ_bwd(dg + r, du + r, dh + r, g + r, u + r, (size_t)W, b1, b2);
    }
}

size_t mlp_scratch(const tmodel *m, int N, int width) {
    (void)m;
    return (size_t)N * 3 * (size_t)width;
}

void mlp_alloc(mlp_acts *a, int cap, int width) {
    a->g = xmalloc_array((size_t)cap * width, sizeof(float));
    a->u = xmalloc_array((size_t)cap * width, sizeof(float));
    a->h = xmalloc_array((size_t)cap * width, sizeof(float));
}

void mlp_free(mlp_acts *a) {
    free(a->g);
    free(a->u);
    free(a->h);
    memset(a, 0, sizeof *a);
}

void mlp_backward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, const float *dout,
                  float *dx, int N, float *scratch, bool accumulate) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size;
    float *dh = scratch, *dg = scratch + (size_t)N * width, *du = dg + (size_t)N * width;
    const size_t up = (size_t)width * E; /* the up rows of the fused gate|up */
    t_linear_dw(m->g + w->down, dout, a->h, N, width, E, tm_gemm_mode(m));
    t_linear_dx(dh, dout, m->w + w->down, N, width, E, false, tm_gemm_mode(m));
    situ_planes_bwd(dg, du, dh, a->g, a->u, N, width, c->situ_beta, c->situ_linear_beta);
    t_linear_dw(m->g + w->gate_up, dg, x, N, E, width, tm_gemm_mode(m));
    t_linear_dw(m->g + w->gate_up + up, du, x, N, E, width, tm_gemm_mode(m));
    /* dx: one chain over the gate rows then the up rows, as over the fused 2W */
    t_linear_dx(dx, dg, m->w + w->gate_up, N, E, width, accumulate, tm_gemm_mode(m));
    t_linear_dx(dx, du, m->w + w->gate_up + up, N, E, width, true, tm_gemm_mode(m));
}

/* ---- LatentMoE ------------------------------------------------------------------- */

size_t moe_scratch(const tmodel *m, int N) {
    const k3_config *c = &m->cfg;
    size_t lat = c->latent_dim, I = c->moe_inter, k = c->experts_per_token, Ne = c->num_experts;
    size_t W = (size_t)c->num_shared_experts * I;
    size_t Nk = (size_t)N * k;
    size_t routed = (size_t)N * (3 * lat + Ne) + Nk * (1 + 3 * lat + 6 * I);
    size_t shared = mlp_scratch(m, N, (int)W);
    return routed + shared;
}

void moe_alloc(const tmodel *m, moe_acts *a, int cap) {
    const k3_config *c = &m->cfg;
    const size_t N = (size_t)cap, lat = c->latent_dim, I = c->moe_inter, k = c->experts_per_token,
                 Ne = c->num_experts;
    a->s = xmalloc_array(N * Ne, sizeof(float));
    a->cut = xmalloc_array(N, sizeof(float));
    a->idx = xmalloc_array(N * k, sizeof(int));
    a->p = xmalloc_array(N * k, sizeof(float));
    a->z = xmalloc_array(N * lat, sizeof(float));
    a->g1 = xmalloc_array(N * k * I, sizeof(float));
    a->g3 = xmalloc_array(N * k * I, sizeof(float));
    a->h = xmalloc_array(N * k * I, sizeof(float));
    a->e = xmalloc_array(N * k * lat, sizeof(float));
    a->row = xmalloc_array(N * k, sizeof(int));
    a->u = xmalloc_array(N * lat, sizeof(float));
    a->ru = xmalloc_array(N, sizeof(float));
    a->un = xmalloc_array(N * lat, sizeof(float));
    mlp_alloc(&a->sh, cap, c->num_shared_experts * c->moe_inter);
}

void moe_free(moe_acts *a) {
    void *b[] = {a->s, a->cut, a->idx, a->p, a->z, a->g1, a->g3, a->h, a->e, a->row, a->u, a->ru, a->un};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) free(b[i]);
    mlp_free(&a->sh);
    memset(a, 0, sizeof *a);
}

/* Slots (n*k + j) of each expert in increasing n: off[Ne+1], list[N*k]. The
 * model graph's grouped rows are in this order: slot list[i] is row i. */
static void dispatch(const int *idx, int N, int k, int Ne, int *off, int *list) {
    memset(off, 0, sizeof(int) * (size_t)(Ne + 1));
    for (int i = 0; i < N * k; i++) off[idx[i] + 1]++;
    for (int e = 0; e < Ne; e++) off[e + 1] += off[e];
    int *fill = xmalloc_array((size_t)Ne, sizeof(int));
    memcpy(fill, off, sizeof(int) * (size_t)Ne);
    for (int i = 0; i < N * k; i++) list[fill[idx[i]]++] = i;
    free(fill);
}

void moe_account(tmodel *m, const tm_layer *ly, const moe_acts *a, int N) {
    const int Ne = m->cfg.num_experts, k = m->cfg.experts_per_token;
    /* training's bookkeeping: expert loads and Quantile Balancing's margins
     * s - cut against each token's threshold */
    int64_t *load = m->load + (size_t)ly->moe * Ne;
    for (int i = 0; i < N * k; i++) load[a->idx[i]]++;
    if (m->qb_record && k < Ne) {
        const size_t qrow = (size_t)m->n_moe * Ne;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *s = a->s + (size_t)n * Ne;
            float *mg = m->qb_marg + (size_t)(m->qb_n + n) * qrow + (size_t)ly->moe * Ne;
            for (int e = 0; e < Ne; e++) mg[e] = s[e] - a->cut[n];
        }
    }
}

void moe_backward(tmodel *m, const tm_layer *ly, moe_acts *a, const float *x, const float *dout,
                  float *dx, int N, float *scratch) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, Ne = c->num_experts, k = c->experts_per_token, lat = c->latent_dim,
              I = c->moe_inter;
    const int W = c->num_shared_experts * I;
    const size_t Nk = (size_t)N * k;
    const moe_w *q = &ly->moe_w;
    const float *w = m->w;
    float *g = m->g;
    float *dun = scratch, *du = dun + (size_t)N * lat, *dz = du + (size_t)N * lat;
    float *dlog = dz + (size_t)N * lat, *dp = dlog + (size_t)N * Ne;
    float *de = dp + Nk, *dzs = de + Nk * lat, *gbase = dzs + Nk * lat, *hbase = gbase + Nk * lat;
    float *dhbase = hbase + Nk * I, *daubase = dhbase + Nk * I;
    float *shs = daubase + Nk * 4 * I; /* dau [Nk][2I] (per expert two [ne][I] planes), then spare */
    /* shared experts (writes dx) */
    mlp_backward(m, &q->shared, &a->sh, W, x, dout, dx, N, shs, false);
    /* r = W_up rmsnorm(u) */
    t_linear_dw(g + q->lat_up, dout, a->un, N, lat, E, tm_gemm_mode(m));
    t_linear_dx(dun, dout, w + q->lat_up, N, lat, E, false, tm_gemm_mode(m));
    t_rmsnorm_bwd(du, g + q->lat_norm, dun, a->u, a->ru, w + q->lat_norm, N, lat, false);
    /* u = sum_j p_j e_j */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            size_t sl = (size_t)n * k + j;
            const float *dur = du + (size_t)n * lat;
            dp[sl] = k_dot(dur, a->e + (size_t)a->row[sl] * lat, lat);
            float pj = a->p[sl];
            for (int i = 0; i < lat; i++) de[sl * lat + i] = pj * dur[i];
        }
    /* experts, batched per expert */
    int *off = xmalloc_array((size_t)Ne + 1, sizeof(int));
    int *list = xmalloc_array(Nk, sizeof(int));
    dispatch(a->idx, N, k, Ne, off, list);
    /* experts side by side as in the forward, each in its own rows off[e].. */
#pragma omp parallel for schedule(dynamic)
    for (int e = 0; e < Ne; e++) {
        int ne = off[e + 1] - off[e];
        if (!ne) continue;
        const int *ls = list + off[e];
        /* the record's grouped rows off[e].. are this expert's, in slot order */
        const size_t r0 = (size_t)off[e];
        float *gbuf = gbase + r0 * lat, *dh = dhbase + r0 * I;
        float *da1 = daubase + r0 * 2 * I, *da3 = da1 + (size_t)ne * I; /* [ne][I] planes */
        for (int r = 0; r < ne; r++) memcpy(gbuf + (size_t)r * lat, de + (size_t)ls[r] * lat, sizeof(float) * lat);
        t_linear_dw(g + q->w2[e], gbuf, a->h + r0 * I, ne, I, lat, tm_gemm_mode(m));
        t_linear_dx(dh, gbuf, w + q->w2[e], ne, I, lat, false, tm_gemm_mode(m));
        situ_planes_bwd(da1, da3, dh, a->g1 + r0 * I, a->g3 + r0 * I, ne, I, c->situ_beta, c->situ_linear_beta);
        for (int r = 0; r < ne; r++)
            memcpy(gbuf + (size_t)r * lat, a->z + (size_t)(ls[r] / k) * lat, sizeof(float) * lat);
        /* the fused w1|w3 as its two row ranges; dz one chain over both */
        const size_t w3o = (size_t)I * lat;
        t_linear_dw(g + q->w13[e], da1, gbuf, ne, lat, I, tm_gemm_mode(m));
        t_linear_dw(g + q->w13[e] + w3o, da3, gbuf, ne, lat, I, tm_gemm_mode(m));
        t_linear_dx(gbuf, da1, w + q->w13[e], ne, lat, I, false, tm_gemm_mode(m));
        t_linear_dx(gbuf, da3, w + q->w13[e] + w3o, ne, lat, I, true, tm_gemm_mode(m));
        for (int r = 0; r < ne; r++)
            memcpy(dzs + (size_t)ls[r] * lat, gbuf + (size_t)r * lat, sizeof(float) * lat);
    }
    free(off);
    free(list);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *d = dz + (size_t)n * lat;
        for (int i = 0; i < lat; i++) d[i] = 0.0f;
        for (int j = 0; j < k; j++)
            for (int i = 0; i < lat; i++) d[i] += dzs[((size_t)n * k + j) * lat + i];
    }
    t_linear_dw(g + q->lat_down, dz, x, N, E, lat, tm_gemm_mode(m));
    t_linear_dx(dx, dz, w + q->lat_down, N, E, lat, true, tm_gemm_mode(m));
    /* router: p_j = scale s_j / (sum_T s + 1e-20); ds flows to the selected s only */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *dl = dlog + (size_t)n * Ne;
        const float *s = a->s + (size_t)n * Ne;
        const int *id = a->idx + (size_t)n * k;
        const float *dpn = dp + (size_t)n * k;
        for (int e = 0; e < Ne; e++) dl[e] = 0.0f;
        float sc = c->routed_scaling_factor;
        if (c->moe_renormalize && k > 1) {
            float S = 0.0f, dot = 0.0f;
            for (int j = 0; j < k; j++) S += s[id[j]];
            S += 1e-20f;
            for (int j = 0; j < k; j++) dot += dpn[j] * s[id[j]];
            for (int j = 0; j < k; j++) {
                float sj = s[id[j]];
                float ds = sc * (dpn[j] / S - dot / (S * S));
                dl[id[j]] = ds * sj * (1.0f - sj);
            }
        } else {
            for (int j = 0; j < k; j++) {
                float sj = s[id[j]];
                dl[id[j]] = sc * dpn[j] * sj * (1.0f - sj);
            }
        }
    }
    t_linear_dw(g + q->router, dlog, x, N, E, Ne, tm_gemm_mode(m));
    t_linear_dx(dx, dlog, w + q->router, N, E, Ne, true, tm_gemm_mode(m));
}
