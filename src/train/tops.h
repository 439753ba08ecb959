/* tops.h: the training-side numeric operations (internal to src/train).
 *
 * The products of a linear layer (forward, dX, dW) are blocked GEMMs
 * (kernels.h, "the training GEMM") with one fma chain per output element;
 * the other operations are C with explicit fmaf, parallel over OUTPUT elements only (one thread owns
 * each output and sums in a fixed order), so gradients have the same bits
 * whatever the thread count.
 *
 * Shapes: activations are row-major [n][dim]; a weight W is [out][in] and the
 * forward is Y = X W^T. */
#ifndef K3_TRAIN_TOPS_H
#define K3_TRAIN_TOPS_H

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdbool.h>

#include "kernels/kernels.h"
#include "model/records.h"

/* Products of the training GEMM (kernels.h) in the caller's mode: K_GEMM_BF16
 * rounds their operands to BF16 and accumulates in F32 (the model's mode:
 * tm_gemm_mode, tinternal.h). */
/* Y[n][out] = X[n][in] W^T (W f32 [out][in]). */
void t_linear(float *Y, const float *X, const float *W, int n, int in, int out, k_gemm_mode mode);
/* The model graph's blocks run with these (model/source.h k3_fwd_ops): each job's
 * W an F32 view [out][in] of the arena, Y = X W^T by t_linear in that mode;
 * training's rounding of SiLU and the KDA q/k norm; in the BF16 mode MLA's
 * expanded core with its products as BF16 GEMMs. One table per mode, so the
 * mode travels with the table. */
const k3_fwd_ops *t_fwd_ops(k_gemm_mode mode);
/* dX[n][in] (+)= dY[n][out] W. accumulate=false overwrites dX. */
void t_linear_dx(float *dX, const float *dY, const float *W, int n, int in, int out, bool accumulate,
                 k_gemm_mode mode);
/* dW[out][in] += dY^T X (one chain per element continuing from dW, rows in
 * increasing order). */
void t_linear_dw(float *dW, const float *dY, const float *X, int n, int in, int out, k_gemm_mode mode);

/* RMSNorm rows forward: model/records.h's k3_rmsnorm_rows (y, r recorded). */
/* Backward: given x, r, g, dy -> dx (+)= ..., dg += ... (dg may be NULL). */
void t_rmsnorm_bwd(float *dx, float *dg, const float *dy, const float *x, const float *r,
                   const float *g, int n, int dim, bool accumulate);

/* SiTU-GLU h = [b1 tanh(a/b1) sig(a)] * [b2 tanh(u/b2)] over m elements (the
 * kernels' k_situ_glu, as the model runs it), and its backward (da, du
 * overwritten). */
void t_situ(float *restrict h, const float *restrict a, const float *restrict u, size_t m, float b1, float b2);
void t_situ_bwd(float *restrict da, float *restrict du, const float *restrict dh, const float *restrict a,
                const float *restrict u, size_t m, float b1, float b2);

/* exp / tanh / sigmoid from the kernels (km_*, kernels.h): built from IEEE-exact
 * operations only, so loops of them vectorise with the scalar bits and do
 * not depend on the libm version. */
static inline float t_exp(float x) { return km_exp(x); }
static inline float t_tanh(float x) { return km_tanh(x); }
static inline float t_sigmoid(float x) { return km_sigmoid(x); }

/* Backward of Block AttnRes over m sources (each [n][dim]): per row,
 * k_i = rmsnorm(v_i; gn), s_i = <k_i, w>, a = softmax(s), out = sum_i a_i v_i;
 * the forward is the model graph's (model/records.h k3_attnres_rows, the gain folded
 * into the query as w * gn), which records alpha[n][m] and the per-source
 * inverse rms r[n][m]. dsrc[i] += ..., dgn += ..., dw += ... */
void t_attnres_bwd(float *const *dsrc, float *dgn, float *dw, const float *dout,
                   const float *alpha, const float *r, const float *const *src, int m,
                   const float *gn, const float *w, int n, int dim, float eps);

/* Cross-entropy over rows of logits [n][V] with targets; writes the per-row loss
 * sum to *loss_sum (double, rows added in order) and, if dlogits != NULL, the
 * gradient (softmax - onehot) * scale into dlogits (may alias logits). */
void t_cross_entropy(const float *logits, const int *targets, int n, int V, double *loss_sum,
                     float *dlogits, float scale);

#endif
