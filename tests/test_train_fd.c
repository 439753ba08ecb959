/* test_train_fd.c: every backward of the trainer against central finite
 * differences (independent of the PyTorch reference), and the determinism of
 * the gradients across thread counts. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "harness.h"
#include "model/records.h"
#include "train/tinternal.h"

static uint64_t rs = 88172645463325252ull;
static float frand(void) { /* uniform in [-1, 1) */
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (float)((double)(rs >> 11) / 4503599627370496.0 - 1.0);
}
static void fill(float *x, size_t n, float scale, float offset) {
    for (size_t i = 0; i < n; i++) x[i] = offset + scale * frand();
}
static double dotd(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* ---- primitives: L = <r, f(x)>; compare dL/dx . d with the central difference */

TEST(train_fd_rmsnorm) {
    enum { N = 3, D = 24 };
    float x[N * D], g[D], r[N * D], y[N * D], inv[N], dx[N * D], dg[D] = {0}, d[N * D], xp[N * D];
    fill(x, N * D, 1.0f, 0.1f);
    fill(g, D, 0.3f, 1.0f);
    fill(r, N * D, 1.0f, 0.0f);
    fill(d, N * D, 1.0f, 0.0f);
    k3_rmsnorm_rows(y, inv, x, g, N, D, 1e-5f);
    t_rmsnorm_bwd(dx, dg, r, x, inv, g, N, D, false);
    const float eps = 1e-2f;
    for (int i = 0; i < N * D; i++) xp[i] = x[i] + eps * d[i];
    k3_rmsnorm_rows(y, inv, xp, g, N, D, 1e-5f);
    double lp = dotd(r, y, N * D);
    for (int i = 0; i < N * D; i++) xp[i] = x[i] - eps * d[i];
    k3_rmsnorm_rows(y, inv, xp, g, N, D, 1e-5f);
    double lm = dotd(r, y, N * D);
    double fd = (lp - lm) / (2 * eps), an = dotd(dx, d, N * D);
    CHECKF(fabs(fd - an) < 2e-3 * fabs(an) + 1e-4, "dx: fd %g analytic %g", fd, an);
    /* gain */
    float gp[D];
    for (int i = 0; i < D; i++) gp[i] = g[i] + eps * d[i];
    k3_rmsnorm_rows(y, inv, x, gp, N, D, 1e-5f);
    lp = dotd(r, y, N * D);
    for (int i = 0; i < D; i++) gp[i] = g[i] - eps * d[i];
    k3_rmsnorm_rows(y, inv, x, gp, N, D, 1e-5f);
    lm = dotd(r, y, N * D);
    fd = (lp - lm) / (2 * eps);
    an = dotd(dg, d, D);
    CHECKF(fabs(fd - an) < 2e-3 * fabs(an) + 1e-4, "dg: fd %g analytic %g", fd, an);
}

TEST(train_fd_situ) {
    enum { M = 64 };
    float a[M], u[M], h[M], r[M], da[M], du[M], ap[M];
    for (int i = 0; i < M; i++) { a[i] = 12.0f * frand(); u[i] = 40.0f * frand(); }
    fill(r, M, 1.0f, 0.0f);
    t_situ_bwd(da, du, r, a, u, M, 4.0f, 25.0f);
    const float eps = 1e-2f;
    for (int i = 0; i < M; i++) {
        float hp, hm;
        ap[0] = a[i] + eps;
        t_situ(&hp, ap, &u[i], 1, 4.0f, 25.0f);
        ap[0] = a[i] - eps;
        t_situ(&hm, ap, &u[i], 1, 4.0f, 25.0f);
        double fd = r[i] * ((double)hp - hm) / (2 * eps);
        CHECKF(fabs(fd - da[i]) < 5e-3 * fabs(da[i]) + 2e-3, "da[%d]: fd %g analytic %g", i, fd, da[i]);
        ap[0] = u[i] + eps;
        t_situ(&hp, &a[i], ap, 1, 4.0f, 25.0f);
        ap[0] = u[i] - eps;
        t_situ(&hm, &a[i], ap, 1, 4.0f, 25.0f);
        fd = r[i] * ((double)hp - hm) / (2 * eps);
        CHECKF(fabs(fd - du[i]) < 5e-3 * fabs(du[i]) + 2e-3, "du[%d]: fd %g analytic %g", i, fd, du[i]);
    }
    (void)h;
}

/* The model graph's AttnRes with the key-norm gain folded into the query as
 * the binder folds it (w * gn), recording what the backward reads. */
static void attnres_fwd(float *out, float *al, float *rr, const float *const *src, int m, const float *gn,
                        const float *w, int n, int dim, float eps) {
    float gw[64];
    for (int d = 0; d < dim; d++) gw[d] = w[d] * gn[d];
    k3_attnres_rows(gw, src, m, n, dim, eps, out, al, rr);
}

TEST(train_fd_attnres) {
    enum { N = 2, D = 16, M = 3 };
    float v[M][N * D], gn[D], w[D], r[N * D], out[N * D], al[N * M], rr[N * M];
    float dv[M][N * D], dgn[D] = {0}, dw[D] = {0};
    for (int i = 0; i < M; i++) fill(v[i], N * D, 1.0f + i, 0.0f);
    fill(gn, D, 0.3f, 1.0f);
    fill(w, D, 1.0f, 0.0f);
    fill(r, N * D, 1.0f, 0.0f);
    memset(dv, 0, sizeof dv);
    const float *src[M] = {v[0], v[1], v[2]};
    float *dsrc[M] = {dv[0], dv[1], dv[2]};
    attnres_fwd(out, al, rr, src, M, gn, w, N, D, 1e-5f);
    t_attnres_bwd(dsrc, dgn, dw, r, al, rr, src, M, gn, w, N, D, 1e-5f);
    const float eps = 1e-2f;
    /* every source, then gn and w, along random directions */
    for (int which = 0; which < M + 2; which++) {
        float *p = which < M ? v[which] : which == M ? gn : w;
        size_t n = which < M ? (size_t)N * D : D;
        const float *an_g = which < M ? dv[which] : which == M ? dgn : dw;
        float d[N * D], save[N * D];
        fill(d, n, 1.0f, 0.0f);
        memcpy(save, p, n * sizeof(float));
        for (size_t i = 0; i < n; i++) p[i] = save[i] + eps * d[i];
        attnres_fwd(out, al, rr, src, M, gn, w, N, D, 1e-5f);
        double lp = dotd(r, out, N * D);
        for (size_t i = 0; i < n; i++) p[i] = save[i] - eps * d[i];
        attnres_fwd(out, al, rr, src, M, gn, w, N, D, 1e-5f);
        double lm = dotd(r, out, N * D);
        memcpy(p, save, n * sizeof(float));
        double fd = (lp - lm) / (2 * eps), an = dotd(an_g, d, n);
        CHECKF(fabs(fd - an) < 5e-3 * fabs(an) + 2e-4, "input %d: fd %g analytic %g", which, fd, an);
    }
}

/* ---- the whole model: each parameter tensor along a random direction -------------- */

static bool tiny_model(tmodel *m) {
    k3_config c;
    k3_err err = {0};
    if (k3_config_load(t_repo("tests/fixtures/train/grad-config.json"), &c, &err)) return false;
    if (tm_build(m, &c, &err)) return false;
    tm_init(m, 7);
    /* move every parameter off its symmetric start (zero pseudo-queries and
     * unit gains would hide gradient paths) */
    for (int i = 0; i < m->np; i++) {
        tparam *p = &m->params[i];
        float *w = m->w + p->off;
        if (strstr(p->name, "norm.weight") || strstr(p->name, "layernorm"))
            fill(w, p->numel, 0.2f, 1.0f);
        else if (strstr(p->name, "res_proj") || strstr(p->name, "A_log"))
            fill(w, p->numel, 0.5f, 0.0f);
        else if (!strstr(p->name, "dt_bias") && !strstr(p->name, "conv1d"))
            for (size_t j = 0; j < p->numel; j++) w[j] *= 3.0f; /* std 0.06 */
    }
    for (int q = 0; q < m->n_moe; q++) fill(tm_bias(m, m->moe_layer[q]), (size_t)c.num_experts, 0.05f, 0.0f);
    return true;
}

TEST(train_fd_every_parameter) {
    tmodel m;
    CHECK(tiny_model(&m));
    enum { B = 2, T = 20 };
    int32_t tok[B * (T + 1)];
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)((i * 7 + 3) % m.cfg.vocab_size);
    tm_forward(&m, tok, B, T);
    tm_backward(&m, 1.0f / (B * T));
    int checked = 0;
    for (int i = 0; i < m.np; i++) {
        tparam *p = &m.params[i];
        const float *g = m.g + p->off;
        double gn = sqrt(dotd(g, g, p->numel));
        if (gn == 0.0) continue; /* unused (layer 0 pre-attention AttnRes, unchosen experts) */
        /* routed experts share one code path: two per layer are enough */
        const char *ex = strstr(p->name, "experts.");
        if (ex && !strstr(p->name, "shared") && atoi(ex + 8) >= 2) continue;
        float *d = xmalloc_array(p->numel, sizeof(float));
        float *save = xmalloc_array(p->numel, sizeof(float));
        /* direction: the gradient's own direction plus noise, so the
         * derivative is well above the float32 noise of the loss */
        for (size_t j = 0; j < p->numel; j++) d[j] = (float)(g[j] / gn) + 0.3f * frand() / sqrtf((float)p->numel);
        float *w = m.w + p->off;
        memcpy(save, w, p->numel * sizeof(float));
        /* steps that move the loss by about 2e-4 and 5e-5: far above its
         * float32 noise, small against the curvature. The router's top-k is
         * piecewise constant, so a step may straddle a selection flip; a flip
         * cannot hit both step sizes the same way, so one of the two must
         * agree. */
        double an = dotd(g, d, p->numel), fd[2];
        fd[1] = NAN;
        for (int k = 0; k < 2; k++) {
            if (k == 1 && fabs(fd[0] - an) < 1e-2 * fabs(an) + 1e-4) break; /* the first step agreed */
            const float eps = (float)fmin((k ? 5e-5 : 2e-4) / gn, k ? 1e-3 : 4e-3);
            for (size_t j = 0; j < p->numel; j++) w[j] = save[j] + eps * d[j];
            double lp = tm_forward(&m, tok, B, T) / (B * T);
            for (size_t j = 0; j < p->numel; j++) w[j] = save[j] - eps * d[j];
            double lm = tm_forward(&m, tok, B, T) / (B * T);
            memcpy(w, save, p->numel * sizeof(float));
            fd[k] = (lp - lm) / (2 * eps);
        }
        bool ok = fabs(fd[0] - an) < 1e-2 * fabs(an) + 1e-4 || fabs(fd[1] - an) < 3e-2 * fabs(an) + 4e-4;
        CHECKF(ok, "%s: fd %.6g / %.6g analytic %.6g", p->name, fd[0], fd[1], an);
        checked++;
        free(d);
        free(save);
    }
    CHECKF(checked > 80, "only %d tensors checked", checked);
    tm_free(&m);
}

/* Gradients have the same bits at 1 and 2 threads. */
TEST(train_grads_thread_invariant) {
    tmodel m;
    CHECK(tiny_model(&m));
    enum { B = 2, T = 20 };
    int32_t tok[B * (T + 1)];
    for (int i = 0; i < B * (T + 1); i++) tok[i] = (int32_t)((i * 5 + 1) % m.cfg.vocab_size);
    float *g1 = xmalloc_array(m.nw, sizeof(float));
    int save = omp_get_max_threads();
    omp_set_num_threads(1);
    double l1 = tm_forward(&m, tok, B, T);
    tm_backward(&m, 1.0f / (B * T));
    memcpy(g1, m.g, m.nw * sizeof(float));
    memset(m.g, 0, m.nw * sizeof(float));
    omp_set_num_threads(2);
    double l2 = tm_forward(&m, tok, B, T);
    tm_backward(&m, 1.0f / (B * T));
    omp_set_num_threads(save);
    CHECK(l1 == l2);
    CHECK(memcmp(g1, m.g, m.nw * sizeof(float)) == 0);
    free(g1);
    tm_free(&m);
}
