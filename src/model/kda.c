/* kda.c: the Kimi Delta Attention block of the layer graph (spec section 8),
 * the one forward of KDA: `k3 run` calls it on one sequence with its carried
 * state, `k3 train` on B sequences from zero states with a record for its
 * backward (src/train/tkda.c) and the training GEMM as its products.
 *
 *   q,k,v = SiLU(ShortConv(W x))      carried history: last K-1 pre-conv inputs
 *   q,k   = L2-normalised per head    (q's 1/sqrt(D) is applied in the kernel)
 *   beta  = sigmoid(b_proj x)         one scalar per head
 *   g     = g_min * sigmoid(exp(A_log[h]) * (f_b(f_a x) + dt_bias))
 *   o     = the delta rule with per-channel decay exp(g), recurrent or chunkwise
 *   y     = o_proj(RMSNorm_head(o; o_norm) * sigmoid(g_proj x))
 *
 * The arithmetic lives in the kernels (kernels.h: ShortConv, gate, both
 * forms of the recurrence, the head norm); what differs between the callers
 * is named by k3_fwd_ops (model/source.h). */
#include "model/model_impl.h"

#include <assert.h>
#include <math.h>


/* SiLU of n values from x into y (y may be x). */
K3_HOT static void silu_into(const k3_fwd_ops *fo, float *y, const float *x, size_t n) {
    if (fo->train_rounding) {
#pragma omp parallel for schedule(static) if (n > 131072)
        for (size_t i = 0; i < n; i++) y[i] = x[i] * km_sigmoid(x[i]);
        return;
    }
    if (y != x) memcpy(y, x, n * sizeof *y);
    k_silu(y, (int)n);
}

/* One head's q or k to unit length; rinv (may be NULL) gets 1/norm. */
static void l2_head(const k3_fwd_ops *fo, float *x, int D, float *rinv) {
    if (fo->train_rounding) {
        float r = 1.0f / sqrtf(k_sumsq(x, D) + 1e-6f);
        for (int d = 0; d < D; d++) x[d] *= r;
        if (rinv) *rinv = r;
        return;
    }
    if (rinv) *rinv = 1.0f / sqrtf(k_dot(x, x, D) + 1e-6f);
    k_l2norm(x, D, 1e-6f);
}

/* Sequence s's first row: s T, or with lengths the rows of those before it. */
static size_t first_row(const int *len, int s, int T) {
    if (!len) return (size_t)s * (size_t)T;
    size_t r = 0;
    for (int i = 0; i < s; i++) r += (size_t)len[i];
    return r;
}

/* The recurrence on every sequence in one kernel call, the threads splitting
 * (sequence, head) pairs: whether the states lie one after another
 * (training's zero states) or apart (a batch of decode states), a pair's work
 * is the same, so are the bits. With lengths (len) each sequence runs the
 * form it runs alone: chunkwise only for several positions outside a recorded
 * pass (model.c's forward_chunk makes the same choice). */
static void kda_recur(const k3_kda_state *st, float *o, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, int nseq, int T, const int *len, int H, int D, int chunk,
                      float lower, float *Ssave, k3_ws *ws) {
    const size_t HDD = (size_t)H * D * D;
    bool packed = !len;
    for (int s = 1; s < nseq && packed; s++) packed = st[s].S == st[0].S + (size_t)s * HDD;
    if (packed) { /* a record's zero states (saving states, without a workspace) always are */
        k_kda_forward(o, st[0].S, q, k, v, g, beta, nseq, T, H, D, chunk, lower, Ssave);
        return;
    }
    assert(ws && !Ssave);
    /* each sequence's state apart (a batch of decode states): all in one team */
    k_kda_seq *seq = ws_get(ws, (size_t)nseq * sizeof *seq);
    for (int s = 0; s < nseq; s++) {
        int Ts = len ? len[s] : T;
        seq[s] = (k_kda_seq){.S = st[s].S, .row = first_row(len, s, T), .T = Ts,
                             .C = len && (Ts <= 1 || st[s].trace) ? 0 : chunk};
    }
    k_kda_forward_seqs(o, q, k, v, g, beta, seq, nseq, H, D, lower);
}

/* A recorded pass's rows of one sequence (n rows from row a0 of the block's
 * buffers): the pre-conv inputs (three planes NP floats apart), then what the
 * recurrence consumes; what a replay of a prefix needs. */
static void trace_pre(k3_kda_trace *tr, const float *pre, size_t NP, size_t a0, size_t n, size_t P) {
    for (size_t j = 0; j < 3; j++)
        memcpy(tr->pre + (j * (size_t)tr->max_T + (size_t)tr->row) * P, pre + j * NP + a0 * P, n * P * sizeof(float));
}

static void trace_rows(k3_kda_trace *tr, const float *q, const float *k, const float *v, const float *g,
                       const float *beta, size_t a0, size_t n, size_t P, size_t H) {
    size_t r = (size_t)tr->row * P;
    memcpy(tr->q + r, q + a0 * P, n * P * sizeof(float));
    memcpy(tr->k + r, k + a0 * P, n * P * sizeof(float));
    memcpy(tr->v + r, v + a0 * P, n * P * sizeof(float));
    memcpy(tr->g + r, g + a0 * P, n * P * sizeof(float));
    memcpy(tr->beta + (size_t)tr->row * H, beta + a0 * H, n * H * sizeof(float));
}

/* One term per ws_get in kda_block below (pre, cv, gate, beta, fa) and
 * kda_recur (a sequence per row at most). */
size_t kda_ws_need(const k3_config *c, size_t N) {
    size_t H = (size_t)c->kda_heads, D = (size_t)c->kda_head_dim, NP = N * H * D;
    return 2 * wsz(3 * NP) + wsz(NP) + wsz(N * H) + wsz(N * D) + wsb(N * sizeof(k_kda_seq));
}

K3_HOT void kda_block(const k3_config *c, const k3_kda_w *w, const k3_fwd_ops *fo, const k3_kda_state *st,
                      const float *x, int nseq, int T, const int *len, float *y, int chunk, k3_kda_rec *rec,
                      k3_ws *ws) {
    assert(rec || ws); /* without a record the temporaries come from ws */
    assert(!len || (!rec && ws));
    const int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    /* with lengths, sequence s has len[s] rows from first_row(len, s, T) */
    const int N = len ? (int)first_row(len, nseq, T) : nseq * T;
    bool traced = false; /* a recorded pass (k3_state_pass_begin) on some sequence */
    for (int s = 0; s < nseq && !rec; s++) traced = traced || st[s].trace;
    const size_t NP = (size_t)N * P;
    /* without a record, buffers are reused once consumed: z and g in the
     * pre-conv planes, o in the third, the normed output in k */
    float *pre = rec ? rec->pre : ws_f(ws, 3 * NP), *cv = rec ? rec->cv : ws_f(ws, 3 * NP);
    float *gate = rec ? rec->gate : ws_f(ws, NP);
    float *beta = rec ? rec->beta : ws_f(ws, (size_t)N * H), *fa = rec ? rec->fa : ws_f(ws, (size_t)N * D);
    /* every projection of x at once: one thread team, x read while hot */
    k_prod jobs[6] = {{&w->q, x, N, pre},  {&w->k, x, N, pre + NP}, {&w->v, x, N, pre + 2 * NP},
                      {&w->g, x, N, gate}, {&w->b, x, N, beta},     {&w->f_a, x, N, fa}};
    fo->products(jobs, 6);
    for (int s = 0; traced && s < nseq; s++) /* before the planes are reused below */
        if (st[s].trace) trace_pre(st[s].trace, pre, NP, first_row(len, s, T), (size_t)(len ? len[s] : T), (size_t)P);
    /* ShortConv per plane and sequence, each from its carried history; the
     * SiLU in the same task unless the pre-SiLU values are recorded */
    const bool fused = !rec && !fo->train_rounding;
#pragma omp parallel for schedule(static) if (PAR_ROWS(N, P))
    for (int js = 0; js < 3 * nseq; js++) {
        int j = js / nseq, s = js % nseq, Ts = len ? len[s] : T;
        size_t a = (size_t)j * NP + first_row(len, s, T) * P;
        float *hist = st[s].conv + (size_t)j * P * (K - 1);
        if (fused) k_shortconv_silu(cv + a, pre + a, Ts, P, w->conv[j], K, hist);
        else k_shortconv(cv + a, pre + a, Ts, P, w->conv[j], K, hist);
    }
    float *q = rec ? rec->q : cv, *k = rec ? rec->k : cv + NP, *v = rec ? rec->v : cv + 2 * NP;
    if (!fused) {
        silu_into(fo, q, cv, NP);
        silu_into(fo, k, cv + NP, NP);
        silu_into(fo, v, cv + 2 * NP, NP);
    }
#pragma omp parallel for schedule(static) if (PAR_ROWS(N, P))
    for (size_t i = 0; i < (size_t)N * H; i++) {
        l2_head(fo, q + i * D, D, rec ? rec->rq + i : NULL);
        l2_head(fo, k + i * D, D, rec ? rec->rk + i : NULL);
    }
    for (int i = 0; i < N * H; i++) beta[i] = km_sigmoid(beta[i]);
    float *z = rec ? rec->zb : pre; /* the pre-conv inputs are consumed */
    k_prod fb = {&w->f_b, fa, N, z};
    (fo->whole_products ? fo->whole_products : fo->products)(&fb, 1);
    float *g = rec ? rec->gl : pre + NP;
#pragma omp parallel for schedule(static) if (PAR_ROWS(N, P))
    for (int n = 0; n < N; n++)
        k_kda_gate(g + (size_t)n * P, rec ? z + (size_t)n * P : NULL, z + (size_t)n * P, w->A_log, w->dt_bias, H, D,
                   c->gate_lower_bound);
    for (int s = 0; traced && s < nseq; s++)
        if (st[s].trace)
            trace_rows(st[s].trace, q, k, v, g, beta, first_row(len, s, T), (size_t)(len ? len[s] : T), (size_t)P,
                       (size_t)H);
    float *o = rec ? rec->o : pre + 2 * NP;
    kda_recur(st, o, q, k, v, g, beta, nseq, T, len, H, D, chunk, c->gate_lower_bound, rec ? rec->Ssave : NULL, ws);
    float *normed = rec ? rec->y : k; /* k is consumed */
    if (rec) {
        /* the same head norm and gate, with the record: sigmoid(gate) kept */
        for (size_t i = 0; i < NP; i++) gate[i] = km_sigmoid(gate[i]);
        k3_rmsnorm_rows(normed, rec->ro, o, w->o_norm, N * H, D, c->rms_eps);
        for (size_t i = 0; i < NP; i++) normed[i] *= gate[i];
    } else {
#pragma omp parallel for schedule(static) if (PAR_ROWS(N, P))
        for (int n = 0; n < N; n++)
            k_kda_out_norm_gate(normed + (size_t)n * P, o + (size_t)n * P, w->o_norm, gate + (size_t)n * P, H, D,
                                c->rms_eps);
    }
    k_prod op = {&w->o, normed, N, y};
    fo->products(&op, 1);
}

void k3_kda(const k3_config *c, const k3_kda_w *w, k3_kda_state *st, const float *x, int T, float *y) {
    k3_ws ws;
    ws_init(&ws, 0);
    kda_block(c, w, &k3_infer_ops, st, x, 1, T, NULL, y, 0, NULL, &ws);
    ws_free(&ws);
}

void k3_kda_rec_forward(const k3_config *c, const k3_kda_w *w, const k3_fwd_ops *fo, int chunk, const float *x,
                        int nseq, int T, float *y, k3_kda_rec *rec) {
    const size_t H = (size_t)c->kda_heads, D = (size_t)c->kda_head_dim, P = H * D;
    float *S = xcalloc((size_t)nseq * H * D * D, sizeof(float));
    float *conv = xcalloc((size_t)nseq * 3 * P * (size_t)(c->conv_kernel - 1) + 1, sizeof(float));
    k3_kda_state *st = xmalloc_array((size_t)nseq, sizeof *st);
    for (int s = 0; s < nseq; s++)
        st[s] = (k3_kda_state){.S = S + (size_t)s * H * D * D, .conv = conv + (size_t)s * 3 * P * (size_t)(c->conv_kernel - 1)};
    kda_block(c, w, fo, st, x, nseq, T, NULL, y, chunk, rec, NULL);
    free(st);
    free(S);
    free(conv);
}
