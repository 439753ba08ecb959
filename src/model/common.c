/* common.c: what every block of the model graph shares (model_impl.h):
 * RMSNorm over rows (with the record training's backward reads) and
 * inference's products. The blocks (kda.c, mla.c, moe.c) and the graph
 * (model.c) call these; nothing here calls back into them. */
#include "model/model_impl.h"

#include <math.h>

static void rmsnorm_rows(float *y, const float *x, const float *g, int T, int n, float eps) {
#pragma omp parallel for schedule(static) if (PAR_ROWS(T, n))
    for (int t = 0; t < T; t++) k_rmsnorm(y + (size_t)t * n, x + (size_t)t * n, g, n, eps);
}

void k3_rmsnorm_rows(float *y, float *rinv, const float *x, const float *g, int T, int n, float eps) {
    if (!rinv) {
        rmsnorm_rows(y, x, g, T, n, eps);
        return;
    }
#pragma omp parallel for schedule(static) if (PAR_ROWS(T, n))
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        rinv[t] = 1.0f / sqrtf(k_sumsq(xr, n) / (float)n + eps); /* before y: y may alias x */
        k_rmsnorm(y + (size_t)t * n, xr, g, n, eps);
    }
}

/* Inference's products: one matrix on its own runs k_matmul, several share
 * one thread team (k_products: the same bits). */
static void products_canonical(const k_prod *jobs, int njobs) {
    if (njobs == 1) k_matmul(jobs[0].W, jobs[0].X, jobs[0].n, jobs[0].Y);
    else k_products(jobs, njobs);
}
const k3_fwd_ops k3_infer_ops = {.products = products_canonical, .train_rounding = false};
