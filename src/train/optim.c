/* optim.c: AdamW, Muon and Per-Head Muon, the learning-rate schedule and
 * gradient clipping (report section 2.5).
 *
 * Muon (Moonlight form): momentum buffer m = mu m + g, Nesterov update
 * g + mu m, orthogonalised by 5 Newton-Schulz quintic iterations with
 * coefficients (3.4445, -4.7750, 2.0315) on X = G / (||G||_F + 1e-7) (taken
 * wide: transposed when it has more rows than columns), then scaled by
 * 0.2 sqrt(max(rows, cols)) so its RMS matches AdamW's and one learning rate
 * serves both. Per-Head Muon does the same for each row block of the Q, K, V
 * projections (one block per head; kv_b_proj: the head's key and value blocks
 * separately). Weight decay is decoupled: w *= 1 - lr wd before the update.
 *
 * Every parameter (and every Muon block) is updated by one thread in a fixed
 * order, so the result does not depend on the thread count. */
#include <math.h>
#include <string.h>

#include "train/tinternal.h"
#include "kernels/kernels.h" /* k_gemm, K3_HOT */

void topt_defaults(topt_cfg *c) {
    memset(c, 0, sizeof *c);
    c->lr = 3e-3;
    c->min_lr_ratio = 0.1;
    c->warmup_frac = 0.01;
    c->weight_decay = 0.1;
    c->clip = 1.0;
    c->beta1 = 0.9;
    c->beta2 = 0.95;
    c->eps = 1e-8;
    c->momentum = 0.95;
    c->muon = true;
    c->total_steps = 1;
}

void topt_init(topt *o, const tmodel *m, const topt_cfg *c) {
    memset(o, 0, sizeof *o);
    o->c = *c;
    o->m1 = xcalloc(m->nw, sizeof(float));
    o->m2 = xcalloc(m->nw, sizeof(float));
}

void topt_free(topt *o) {
    free(o->m1);
    free(o->m2);
    memset(o, 0, sizeof *o);
}

/* Warmup: ceil(warmup_frac * total) steps (at least 1) rising linearly to lr;
 * then cosine from lr down to min_lr_ratio * lr at the last step. step is the
 * zero-based index of the optimiser step about to be taken. */
double topt_lr(const topt_cfg *c, int64_t step) {
    int64_t warm = (int64_t)ceil(c->warmup_frac * (double)c->total_steps);
    if (warm < 1) warm = 1;
    if (step < warm) return c->lr * (double)(step + 1) / (double)warm;
    int64_t span = c->total_steps - warm;
    if (span < 1) span = 1;
    double prog = (double)(step - warm) / (double)span;
    if (prog > 1.0) prog = 1.0;
    double lo = c->lr * c->min_lr_ratio;
    return lo + 0.5 * (c->lr - lo) * (1.0 + cos(M_PI * prog));
}

/* C[r][c] = A[r][k] B[k][c] and C = A A^T (A [r][c], C [r][r]) with the
 * training GEMM (one fma chain per element; X X^T and A A are exactly
 * symmetric since fma(a, b, c) == fma(b, a, c), so k_gemm_sym computes
 * half of each). Called inside the parallel loop over Muon blocks, so each
 * runs on one thread. In the BF16 training mode (--bf16) the
 * Newton-Schulz products take BF16 operands too, as Muon's reference
 * implementation does (its iteration is made to tolerate that precision):
 * on AMX this is most of the optimiser's time saved. */
static void mm(float *C, const float *A, const float *B, int r, int k, int c, k_gemm_mode mode) {
    k_gemm(C, c, r, c, k, (k_view){A, k, 1}, (k_view){B, c, 1}, false, mode);
}

static void aat(float *C, const float *A, int r, int c, k_gemm_mode mode) {
    k_gemm_sym(C, r, r, c, (k_view){A, c, 1}, (k_view){A, 1, c}, mode);
}

/* C = S S for a symmetric S [r][r] (A = X X^T above): symmetric as well. */
static void sq(float *C, const float *S, int r, k_gemm_mode mode) {
    k_gemm_sym(C, r, r, r, (k_view){S, r, 1}, (k_view){S, r, 1}, mode);
}

/* In place: G [rows][cols] -> its Newton-Schulz orthogonalisation. */
static void newton_schulz(float *G, int rows, int cols, k_gemm_mode mode) {
    const float a = 3.4445f, b = -4.7750f, c = 2.0315f;
    bool tr = rows > cols;
    int r = tr ? cols : rows, n = tr ? rows : cols; /* X is [r][n], r <= n */
    float *X = xmalloc_array((size_t)r * n, sizeof(float));
    double ss = 0.0;
    for (size_t i = 0; i < (size_t)rows * cols; i++) ss += (double)G[i] * G[i];
    float inv = (float)(1.0 / (sqrt(ss) + 1e-7));
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float v = G[(size_t)i * cols + j] * inv;
            if (tr) X[(size_t)j * n + i] = v; else X[(size_t)i * n + j] = v;
        }
    float *A = xmalloc_array((size_t)r * r, sizeof(float));
    float *A2 = xmalloc_array((size_t)r * r, sizeof(float));
    float *BX = xmalloc_array((size_t)r * n, sizeof(float));
    for (int it = 0; it < 5; it++) {
        aat(A, X, r, n, mode);
        sq(A2, A, r, mode);
        for (size_t i = 0; i < (size_t)r * r; i++) A2[i] = b * A[i] + c * A2[i]; /* B = bA + cA^2 */
        mm(BX, A2, X, r, r, n, mode);
        for (size_t i = 0; i < (size_t)r * n; i++) X[i] = a * X[i] + BX[i];
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) G[(size_t)i * cols + j] = tr ? X[(size_t)j * n + i] : X[(size_t)i * n + j];
    free(X);
    free(A);
    free(A2);
    free(BX);
}

typedef struct {
    int param;
    int row0, rows;
} mblock;

K3_HOT double topt_step(topt *o, tmodel *m, double *lr_out) {
    const topt_cfg *c = &o->c;
    double lr = topt_lr(c, o->step);
    o->step++;
    if (lr_out) *lr_out = lr;
    /* global gradient norm, per parameter in parallel, summed in order */
    double *ss = xcalloc((size_t)m->np, sizeof(double));
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < m->np; i++) {
        const float *g = m->g + m->params[i].off;
        double s = 0.0;
        for (size_t j = 0; j < m->params[i].numel; j++) s += (double)g[j] * g[j];
        ss[i] = s;
    }
    double tot = 0.0;
    for (int i = 0; i < m->np; i++) tot += ss[i];
    free(ss);
    double gn = sqrt(tot);
    float cf = (c->clip > 0 && c->clip / (gn + 1e-6) < 1.0) ? (float)(c->clip / (gn + 1e-6)) : 1.0f;
    const float b1 = (float)c->beta1, b2 = (float)c->beta2, eps = (float)c->eps, mu = (float)c->momentum;
    const float bc1 = (float)(1.0 - pow(c->beta1, (double)o->step));
    const float bc2 = (float)(1.0 - pow(c->beta2, (double)o->step));
    const float flr = (float)lr, decay = (float)(1.0 - lr * c->weight_decay);
    /* AdamW parameters, and the Muon momentum update; collect Muon blocks */
    int nb = 0, cap = 0;
    mblock *bl = NULL;
    for (int i = 0; i < m->np; i++) {
        tparam *p = &m->params[i];
        bool muon = c->muon && (p->group == TG_MUON || p->group == TG_MUON_HEADS);
        if (!muon) continue;
        int nblk = p->group == TG_MUON_HEADS ? p->nblocks : 1;
        for (int k = 0, r0 = 0; k < nblk; k++) {
            if (nb == cap) {
                cap = cap ? cap * 2 : 256;
                bl = xrealloc_array(bl, (size_t)cap, sizeof(mblock));
            }
            int rows = p->group == TG_MUON_HEADS ? p->blocks[k] : p->shape[0];
            bl[nb++] = (mblock){i, r0, rows};
            r0 += rows;
        }
    }
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < m->np; i++) {
        tparam *p = &m->params[i];
        float *w = m->w + p->off, *g = m->g + p->off, *m1 = o->m1 + p->off, *m2 = o->m2 + p->off;
        bool muon = c->muon && (p->group == TG_MUON || p->group == TG_MUON_HEADS);
        bool wd = p->group != TG_ADAMW_ND;
        if (muon) {
            /* momentum; the Nesterov update goes to m2 (scratch) */
            for (size_t j = 0; j < p->numel; j++) {
                float gj = g[j] * cf;
                m1[j] = mu * m1[j] + gj;
                m2[j] = gj + mu * m1[j];
            }
            continue;
        }
        for (size_t j = 0; j < p->numel; j++) {
            float gj = g[j] * cf;
            m1[j] = b1 * m1[j] + (1.0f - b1) * gj;
            m2[j] = b2 * m2[j] + (1.0f - b2) * gj * gj;
            float mh = m1[j] / bc1, vh = m2[j] / bc2;
            if (wd) w[j] *= decay;
            w[j] -= flr * (mh / (sqrtf(vh) + eps));
        }
    }
#pragma omp parallel for schedule(dynamic)
    for (int k = 0; k < nb; k++) {
        tparam *p = &m->params[bl[k].param];
        int cols = (int)(p->numel / (size_t)p->shape[0]);
        size_t o0 = p->off + (size_t)bl[k].row0 * cols, n = (size_t)bl[k].rows * cols;
        float *u = o->m2 + o0, *w = m->w + o0;
        newton_schulz(u, bl[k].rows, cols, tm_gemm_mode(m)); /* the model's product mode */
        float sc = 0.2f * sqrtf((float)(bl[k].rows > cols ? bl[k].rows : cols));
        bool wd = p->group != TG_ADAMW_ND;
        for (size_t j = 0; j < n; j++) {
            if (wd) w[j] *= decay;
            w[j] -= flr * (u[j] * sc);
        }
    }
    free(bl);
    return gn;
}
