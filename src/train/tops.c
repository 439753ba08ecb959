/* tops.c: training-side operations; see tops.h. */
#include "train/tops.h"

#include <stdio.h>
#include <string.h>

#include "kernels/kernels.h"
#include "model/records.h" /* the blocks' forward */
#include "train/train.h" /* TM_MAX_ATTNRES_SOURCES */
#include "util/common.h"

/* The three products of a linear layer are one strided GEMM each
 * (kernels.h, "the training GEMM"): one fma chain per output element over the contraction index in increasing
 * order, whatever the tiling or thread count. */
void t_linear(float *Y, const float *X, const float *W, int n, int in, int out, k_gemm_mode mode) {
    k_view x = {X, in, 1}, wt = {W, 1, in}; /* B(k, o) = W[o][k] */
    k_gemm(Y, out, n, out, in, x, wt, false, mode);
}

static void products(const k_prod *jobs, int njobs, k_gemm_mode mode) {
    for (int i = 0; i < njobs; i++) {
        const k3_mat *W = jobs[i].W;
        if (W->type != KW_F32) { /* a view onto the f32 arena, always: a bug otherwise */
            fprintf(stderr, "k3: internal error: a training product given a weight of type %d, not F32\n", (int)W->type);
            abort();
        }
        t_linear(jobs[i].Y, jobs[i].X, W->data, jobs[i].n, W->cols, W->rows, mode);
    }
}
static void products_f32(const k_prod *jobs, int njobs) { products(jobs, njobs, K_GEMM_F32); }
static void products_bf16(const k_prod *jobs, int njobs) { products(jobs, njobs, K_GEMM_BF16); }

/* Many similar products (the experts): one thread each, dynamic (each
 * product's GEMM then runs on its thread; its bits do not depend on that). */
static void products_each_f32(const k_prod *jobs, int njobs) {
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < njobs; i++) products(jobs + i, 1, K_GEMM_F32);
}
static void products_each_bf16(const k_prod *jobs, int njobs) {
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < njobs; i++) products(jobs + i, 1, K_GEMM_BF16);
}

static const k3_fwd_ops fwd_f32 = {.products = products_f32, .train_rounding = true,
                                   .expert_products = products_each_f32};
static const k3_fwd_ops fwd_bf16 = {.products = products_bf16, .train_rounding = true,
                                    .mla_bf16 = true, .expert_products = products_each_bf16};
const k3_fwd_ops *t_fwd_ops(k_gemm_mode mode) { return mode == K_GEMM_BF16 ? &fwd_bf16 : &fwd_f32; }

void t_linear_dx(float *dX, const float *dY, const float *W, int n, int in, int out, bool accumulate,
                 k_gemm_mode mode) {
    k_view dy = {dY, out, 1}, w = {W, in, 1};
    k_gemm(dX, in, n, in, out, dy, w, accumulate, mode);
}

void t_linear_dw(float *dW, const float *dY, const float *X, int n, int in, int out, k_gemm_mode mode) {
    k_view dyt = {dY, 1, out}, x = {X, in, 1}; /* A(o, t) = dY[t][o] */
    k_gemm(dW, in, out, in, n, dyt, x, true, mode);
}

K3_HOT void t_rmsnorm_bwd(float *dx, float *dg, const float *dy, const float *x, const float *r,
                   const float *g, int n, int dim, bool accumulate) {
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * dim, *dyr = dy + (size_t)t * dim;
        float *dxr = dx + (size_t)t * dim;
        float inv = r[t];
        /* y = g * xhat, xhat = x r: dx = r (dxhat - xhat mean(dxhat xhat)) */
        double c = 0.0;
        for (int d = 0; d < dim; d++) {
            float dxh = g ? dyr[d] * g[d] : dyr[d];
            c += (double)dxh * (double)(xr[d] * inv);
        }
        float cm = (float)(c / dim);
        for (int d = 0; d < dim; d++) {
            float dxh = g ? dyr[d] * g[d] : dyr[d];
            float v = inv * (dxh - (xr[d] * inv) * cm);
            dxr[d] = accumulate ? dxr[d] + v : v;
        }
    }
    if (dg) {
        /* per d one fma chain over t in order, DB chains side by side (rows
         * walked contiguously, the same bits as one column at a time) */
        enum { DB = 32 };
#pragma omp parallel for schedule(static)
        for (int d0 = 0; d0 < dim; d0 += DB) {
            const int dn = dim - d0 < DB ? dim - d0 : DB;
            float s[DB] = {0};
            for (int t = 0; t < n; t++) {
                const float *dyr = dy + (size_t)t * dim + d0, *xr = x + (size_t)t * dim + d0;
                const float rt = r[t];
                for (int j = 0; j < dn; j++) s[j] = fmaf(dyr[j], xr[j] * rt, s[j]);
            }
            for (int j = 0; j < dn; j++) dg[d0 + j] += s[j];
        }
    }
}

K3_HOT static void situ_bwd_run(float *restrict da, float *restrict du, const float *restrict dh, const float *restrict a,
                         const float *restrict u, size_t m, float b1, float b2) {
    for (size_t i = 0; i < m; i++) {
        float ta = t_tanh(a[i] / b1), sa = t_sigmoid(a[i]), tu = t_tanh(u[i] / b2);
        float A = b1 * ta * sa, U = b2 * tu;
        float dA = (1.0f - ta * ta) * sa + b1 * ta * sa * (1.0f - sa);
        float dU = 1.0f - tu * tu;
        da[i] = dh[i] * U * dA;
        du[i] = dh[i] * A * dU;
    }
}

enum { SITU_BLK = 4096 };

/* The forward is the kernels' SiTU-GLU (the one the model runs), in blocks
 * over threads. */
void t_situ(float *restrict h, const float *restrict a, const float *restrict u, size_t m, float b1, float b2) {
    size_t nb = (m + SITU_BLK - 1) / SITU_BLK;
#pragma omp parallel for schedule(static) if (nb > 1)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * SITU_BLK, n = m - i0 < SITU_BLK ? m - i0 : SITU_BLK;
        k_situ_glu(h + i0, a + i0, u + i0, (int)n, b1, b2);
    }
}

K3_HOT void t_situ_bwd(float *restrict da, float *restrict du, const float *restrict dh, const float *restrict a,
                const float *restrict u, size_t m, float b1, float b2) {
    size_t nb = (m + SITU_BLK - 1) / SITU_BLK;
#pragma omp parallel for schedule(static) if (nb > 1)
    for (size_t b = 0; b < nb; b++) {
        size_t i0 = b * SITU_BLK, n = m - i0 < SITU_BLK ? m - i0 : SITU_BLK;
        situ_bwd_run(da + i0, du + i0, dh + i0, a + i0, u + i0, n, b1, b2);
    }
}

K3_HOT void t_attnres_bwd(float *const *dsrc, float *dgn, float *dw, const float *dout,
                   const float *alpha, const float *r, const float *const *src, int m,
                   const float *gn, const float *w, int n, int dim, float eps) {
    (void)eps;
    float *gw = xmalloc_array((size_t)dim, sizeof(float));
    for (int d = 0; d < dim; d++) gw[d] = gn[d] * w[d];
    float *coef = xmalloc_array((size_t)n * m, sizeof(float)); /* ds_i * r_i per row */
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *al = alpha + (size_t)t * m, *rr = r + (size_t)t * m;
        const float *dy = dout + (size_t)t * dim;
        float dal[TM_MAX_ATTNRES_SOURCES], ds[TM_MAX_ATTNRES_SOURCES];
        float mix = 0.0f;
        for (int i = 0; i < m; i++) {
            dal[i] = k_dot(dy, src[i] + (size_t)t * dim, dim);
            mix += al[i] * dal[i];
        }
        for (int i = 0; i < m; i++) {
            ds[i] = al[i] * (dal[i] - mix);
            const float *v = src[i] + (size_t)t * dim;
            float *dv = dsrc[i] + (size_t)t * dim;
            /* s_i = r_i <gw, v_i>, r_i = (mean(v^2)+eps)^-1/2 */
            float gv = k_dot(gw, v, dim);
            float c1 = ds[i] * rr[i];
            float c2 = ds[i] * gv * rr[i] * rr[i] * rr[i] / (float)dim;
            for (int d = 0; d < dim; d++) dv[d] += al[i] * dy[d] + (c1 * gw[d] - c2 * v[d]);
            coef[(size_t)t * m + i] = c1;
        }
    }
    /* per d one fma chain over (t, i) in order; blocks of DB columns walk the
     * rows contiguously with the chains side by side (same bits) */
    enum { DB = 32 };
#pragma omp parallel for schedule(static)
    for (int d0 = 0; d0 < dim; d0 += DB) {
        const int dn = dim - d0 < DB ? dim - d0 : DB;
        float s[DB] = {0};
        for (int t = 0; t < n; t++)
            for (int i = 0; i < m; i++) {
                const float c = coef[(size_t)t * m + i], *v = src[i] + (size_t)t * dim + d0;
                for (int j = 0; j < dn; j++) s[j] = fmaf(c, v[j], s[j]);
            }
        for (int j = 0; j < dn; j++) {
            dgn[d0 + j] += s[j] * w[d0 + j];
            dw[d0 + j] += s[j] * gn[d0 + j];
        }
    }
    free(coef);
    free(gw);
}

void t_cross_entropy(const float *logits, const int *targets, int n, int V, double *loss_sum,
                     float *dlogits, float scale) {
    double *row = xmalloc_array((size_t)n, sizeof(double));
#pragma omp parallel for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *l = logits + (size_t)t * V;
        float mx = -INFINITY;
        for (int v = 0; v < V; v++) if (l[v] > mx) mx = l[v];
        double s = 0.0;
        for (int v = 0; v < V; v++) s += exp((double)(l[v] - mx));
        double lse = log(s) + mx;
        row[t] = lse - l[targets[t]];
        if (dlogits) {
            float *dl = dlogits + (size_t)t * V;
            for (int v = 0; v < V; v++) dl[v] = (float)(exp((double)l[v] - lse)) * scale;
            dl[targets[t]] -= scale;
        }
    }
    double s = 0.0;
    for (int t = 0; t < n; t++) s += row[t];
    *loss_sum = s;
    free(row);
}
