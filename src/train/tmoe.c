/* tmoe.c: the MLP sublayers for training: dense SiTU-GLU MLP and Stable
 * LatentMoE (k3-checkpoint-format.md sections 10-11; report eq. 11-14).
 *
 * Router: s = sigmoid(W_r x); experts chosen by top-k of s + bias (ties to the
 * lower index, as the inference kernel), weights from the UNBIASED s,
 * renormalised; the gradient flows through the selected s only and the bias
 * gets none. The (k+1)-th selection score is each token's Quantile Balancing
 * cutoff. Routed experts run batched: the tokens of one expert are gathered
 * and go through one matrix product per weight. */
#include "train/tinternal.h"

#include <math.h>
#include <string.h>

#include "kernels/kernels.h"

/* ---- dense SiTU-GLU MLP (also the fused shared experts) ----------------------- */

/* The forward is the kernels' SiTU-GLU (the model's), row by row. */
static void situ_rows(float *h, const float *gu, int N, int W, float b1, float b2) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float *a = gu + (size_t)n * 2 * W, *u = a + W;
        k_situ_glu(h + (size_t)n * W, a, u, W, b1, b2);
    }
}

static void situ_rows_bwd(float *dgu, const float *dh, const float *gu, int N, int W, float b1, float b2) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        t_situ_bwd(dgu + (size_t)n * 2 * W, dgu + (size_t)n * 2 * W + W, dh + (size_t)n * W,
                   gu + (size_t)n * 2 * W, gu + (size_t)n * 2 * W + W, (size_t)W, b1, b2);
}

/* The same on [N][W] planes: dg, du from dh and the gate and up planes. */
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

/* The model graph's weight view: the fused gate|up rows as two matrices. */
static k3_mlp_w mlp_view(const tmodel *m, const mlp_w *w, int width) {
    const int E = m->cfg.hidden_size;
    const float *p = m->w;
    return (k3_mlp_w){
        .gate = {.type = KW_F32, .rows = width, .cols = E, .data = p + w->gate_up},
        .up = {.type = KW_F32, .rows = width, .cols = E, .data = p + w->gate_up + (size_t)width * E},
        .down = {.type = KW_F32, .rows = E, .cols = width, .data = p + w->down},
    };
}

void mlp_forward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, float *out, int N) {
    k3_mlp_w v = mlp_view(m, w, width);
    k3_mlp_rec_forward(&m->cfg, &v, &t_fwd_ops, x, N, out, a);
}

void mlp_backward(tmodel *m, const mlp_w *w, mlp_acts *a, int width, const float *x, const float *dout,
                  float *dx, int N, float *scratch, bool accumulate) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size;
    float *dh = scratch, *dg = scratch + (size_t)N * width, *du = dg + (size_t)N * width;
    const size_t up = (size_t)width * E; /* the up rows of the fused gate|up */
    t_linear_dw(m->g + w->down, dout, a->h, N, width, E);
    t_linear_dx(dh, dout, m->w + w->down, N, width, E, false);
    situ_planes_bwd(dg, du, dh, a->g, a->u, N, width, c->situ_beta, c->situ_linear_beta);
    t_linear_dw(m->g + w->gate_up, dg, x, N, E, width);
    t_linear_dw(m->g + w->gate_up + up, du, x, N, E, width);
    /* dx: one chain over the gate rows then the up rows, as over the fused 2W */
    t_linear_dx(dx, dg, m->w + w->gate_up, N, E, width, accumulate);
    t_linear_dx(dx, du, m->w + w->gate_up + up, N, E, width, true);
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
    a->idx = xmalloc_array(N * k, sizeof(int));
    a->p = xmalloc_array(N * k, sizeof(float));
    a->z = xmalloc_array(N * lat, sizeof(float));
    a->au = xmalloc_array(N * k * 2 * I, sizeof(float));
    a->h = xmalloc_array(N * k * I, sizeof(float));
    a->e = xmalloc_array(N * k * lat, sizeof(float));
    a->u = xmalloc_array(N * lat, sizeof(float));
    a->ru = xmalloc_array(N, sizeof(float));
    a->un = xmalloc_array(N * lat, sizeof(float));
    a->tmp = xmalloc_array(N * (size_t)c->hidden_size, sizeof(float));
    mlp_alloc(&a->sh, cap, c->num_shared_experts * c->moe_inter);
}

void moe_free(moe_acts *a) {
    free(a->s);
    free(a->idx);
    free(a->p);
    free(a->z);
    free(a->au);
    free(a->h);
    free(a->e);
    free(a->u);
    free(a->ru);
    free(a->un);
    free(a->tmp);
    mlp_free(&a->sh);
    memset(a, 0, sizeof *a);
}

/* Slots (n*k + j) of each expert in increasing n: off[Ne+1], list[N*k]. */
static void dispatch(const int *idx, int N, int k, int Ne, int *off, int *list) {
    memset(off, 0, sizeof(int) * (size_t)(Ne + 1));
    for (int i = 0; i < N * k; i++) off[idx[i] + 1]++;
    for (int e = 0; e < Ne; e++) off[e + 1] += off[e];
    int *fill = xmalloc_array((size_t)Ne, sizeof(int));
    memcpy(fill, off, sizeof(int) * (size_t)Ne);
    for (int i = 0; i < N * k; i++) list[fill[idx[i]]++] = i;
    free(fill);
}

K3_HOT void moe_forward(tmodel *m, const tm_layer *ly, moe_acts *a, const float *x, float *out, int N) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, Ne = c->num_experts, k = c->experts_per_token, lat = c->latent_dim,
              I = c->moe_inter;
    const int W = c->num_shared_experts * I;
    const moe_w *q = &ly->moe_w;
    const float *w = m->w;
    const float *bias = m->bias + (size_t)ly->moe * Ne;
    /* router */
    t_linear(a->s, x, w + q->router, N, E, Ne);
    const bool rec = m->qb_record && k < Ne;
    const size_t qrow = (size_t)m->n_moe * Ne;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *s = a->s + (size_t)n * Ne;
        for (int e = 0; e < Ne; e++) s[e] = t_sigmoid(s[e]);
        int *id = a->idx + (size_t)n * k;
        int sel[TM_MAX_TOPK + 1]; /* the k chosen and the first one left out */
        int kk = k < Ne ? k + 1 : k;
        unsigned char used[TM_MAX_EXPERTS];
        float cut = 0.0f;
        memset(used, 0, sizeof used);
        for (int j = 0; j < kk; j++) {
            int best = -1;
            float bv = 0.0f;
            for (int e = 0; e < Ne; e++) {
                if (used[e]) continue;
                float v = s[e] + bias[e];
                if (best < 0 || v > bv) { best = e; bv = v; }
            }
            used[best] = 1;
            sel[j] = best;
            if (j == k) cut = bv;
        }
        float sum = 0.0f;
        for (int j = 0; j < k; j++) { id[j] = sel[j]; sum += s[sel[j]]; }
        float *p = a->p + (size_t)n * k;
        for (int j = 0; j < k; j++) {
            float v = s[sel[j]];
            if (c->moe_renormalize && k > 1) v = v / (sum + 1e-20f);
            p[j] = v * c->routed_scaling_factor;
        }
        if (rec) {
            float *mg = m->qb_marg + (size_t)(m->qb_n + n) * qrow + (size_t)ly->moe * Ne;
            for (int e = 0; e < Ne; e++) mg[e] = s[e] - cut;
        }
    }
    int64_t *load = m->load + (size_t)ly->moe * Ne;
    for (int i = 0; i < N * k; i++) load[a->idx[i]]++;
    /* routed experts in the latent space */
    t_linear(a->z, x, w + q->lat_down, N, E, lat);
    int *off = xmalloc_array((size_t)Ne + 1, sizeof(int));
    int *list = xmalloc_array((size_t)N * k, sizeof(int));
    dispatch(a->idx, N, k, Ne, off, list);
    float *zg = xmalloc_array((size_t)N * k * lat, sizeof(float));
    float *aug = xmalloc_array((size_t)N * k * 2 * I, sizeof(float));
    float *hg = xmalloc_array((size_t)N * k * I, sizeof(float));
    float *yg = xmalloc_array((size_t)N * k * lat, sizeof(float));
    /* experts side by side, one thread each (their products then run on one
     * thread: the GEMM's bits do not depend on that), each in its own rows
     * off[e].. of the buffers; outputs go to per-slot rows, so no two experts
     * write the same memory and the result does not depend on the schedule */
#pragma omp parallel for schedule(dynamic)
    for (int e = 0; e < Ne; e++) {
        int ne = off[e + 1] - off[e];
        if (!ne) continue;
        const int *ls = list + off[e];
        float *zge = zg + (size_t)off[e] * lat, *auge = aug + (size_t)off[e] * 2 * I;
        float *hge = hg + (size_t)off[e] * I, *yge = yg + (size_t)off[e] * lat;
        for (int r = 0; r < ne; r++)
            memcpy(zge + (size_t)r * lat, a->z + (size_t)(ls[r] / k) * lat, sizeof(float) * lat);
        t_linear(auge, zge, w + q->w13[e], ne, lat, 2 * I);
        situ_rows(hge, auge, ne, I, c->situ_beta, c->situ_linear_beta);
        t_linear(yge, hge, w + q->w2[e], ne, I, lat);
        for (int r = 0; r < ne; r++) {
            size_t sl = (size_t)ls[r];
            memcpy(a->au + sl * 2 * I, auge + (size_t)r * 2 * I, sizeof(float) * 2 * I);
            memcpy(a->h + sl * I, hge + (size_t)r * I, sizeof(float) * I);
            memcpy(a->e + sl * lat, yge + (size_t)r * lat, sizeof(float) * lat);
        }
    }
    free(zg);
    free(aug);
    free(hg);
    free(yg);
    free(off);
    free(list);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float *u = a->u + (size_t)n * lat;
        for (int i = 0; i < lat; i++) u[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            float pj = a->p[(size_t)n * k + j];
            const float *ev = a->e + ((size_t)n * k + j) * lat;
            for (int i = 0; i < lat; i++) u[i] = fmaf(pj, ev[i], u[i]);
        }
    }
    k3_rmsnorm_rows(a->un, a->ru, a->u, w + q->lat_norm, N, lat, c->rms_eps);
    t_linear(out, a->un, w + q->lat_up, N, lat, E);
    mlp_forward(m, &q->shared, &a->sh, W, x, a->tmp, N);
    for (size_t i = 0; i < (size_t)N * E; i++) out[i] += a->tmp[i];
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
    float *shs = daubase + Nk * 4 * I; /* dau [Nk][2I], then the gathered au [Nk][2I] */
    /* shared experts (writes dx) */
    mlp_backward(m, &q->shared, &a->sh, W, x, dout, dx, N, shs, false);
    /* r = W_up rmsnorm(u) */
    t_linear_dw(g + q->lat_up, dout, a->un, N, lat, E);
    t_linear_dx(dun, dout, w + q->lat_up, N, lat, E, false);
    t_rmsnorm_bwd(du, g + q->lat_norm, dun, a->u, a->ru, w + q->lat_norm, N, lat, false);
    /* u = sum_j p_j e_j */
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            size_t sl = (size_t)n * k + j;
            const float *dur = du + (size_t)n * lat;
            dp[sl] = k_dot(dur, a->e + sl * lat, lat);
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
        float *gbuf = gbase + (size_t)off[e] * lat, *hbuf = hbase + (size_t)off[e] * I;
        float *dh = dhbase + (size_t)off[e] * I, *dau = daubase + (size_t)off[e] * 2 * I;
        /* gbuf: de rows; hbuf: h rows */
        for (int r = 0; r < ne; r++) {
            memcpy(gbuf + (size_t)r * lat, de + (size_t)ls[r] * lat, sizeof(float) * lat);
            memcpy(hbuf + (size_t)r * I, a->h + (size_t)ls[r] * I, sizeof(float) * I);
        }
        t_linear_dw(g + q->w2[e], gbuf, hbuf, ne, I, lat);
        t_linear_dx(dh, gbuf, w + q->w2[e], ne, I, lat, false);
        /* hbuf now: gathered au rows [ne][2I] (reuse dau's room for the input) */
        float *aug = daubase + (Nk + (size_t)off[e]) * 2 * I;
        for (int r = 0; r < ne; r++)
            memcpy(aug + (size_t)r * 2 * I, a->au + (size_t)ls[r] * 2 * I, sizeof(float) * 2 * I);
        situ_rows_bwd(dau, dh, aug, ne, I, c->situ_beta, c->situ_linear_beta);
        for (int r = 0; r < ne; r++)
            memcpy(gbuf + (size_t)r * lat, a->z + (size_t)(ls[r] / k) * lat, sizeof(float) * lat);
        t_linear_dw(g + q->w13[e], dau, gbuf, ne, lat, 2 * I);
        t_linear_dx(gbuf, dau, w + q->w13[e], ne, lat, 2 * I, false);
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
    t_linear_dw(g + q->lat_down, dz, x, N, E, lat);
    t_linear_dx(dx, dz, w + q->lat_down, N, E, lat, true);
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
    t_linear_dw(g + q->router, dlog, x, N, E, Ne);
    t_linear_dx(dx, dlog, w + q->router, N, E, Ne, true);
}
