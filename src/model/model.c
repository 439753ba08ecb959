/* model.c: the K3 layer graph (k3-checkpoint-format.md sections 6-12).
 *
 * Read top to bottom: one function per equation block of the spec (AttnRes,
 * dense MLP; KDA, MLA and LatentMoE are kda.c's, mla.c's and moe.c's, the
 * workspace model_impl.h's, what every block shares common.c's), then the
 * decoder layer and the model forward, then the decode state and the sampler.
 * Nothing here is called by the blocks: the graph sits on top of them.
 *
 * Activations are [T][width] row-major f32 for a chunk of T consecutive
 * positions. Every per-position quantity is computed with arithmetic that does
 * not depend on T or on the thread count (see model.h), which is what makes
 * prefill, token-by-token decoding and full recomputation agree bit for bit. */
#include "model/model_impl.h"

#include <assert.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* ---- AttnRes (section 7) -------------------------------------------------------
 * Keys are the RMSNormed sources (gain folded into q at load time), values the
 * RAW sources; one softmax over sources per position. */
K3_HOT static void attnres_rows(const float *q, const float *const *src, int nsrc, int T, int E, float eps,
                                 float *out, float *alpha, float *rinv, float *logits) {
    int nthr = omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nthr) if (PAR_ROWS(T, (double)E * nsrc))
    for (int t = 0; t < T; t++) {
        float *logit = alpha ? alpha + (size_t)t * nsrc : logits + (size_t)omp_get_thread_num() * nsrc;
        for (int i = 0; i < nsrc; i++) {
            const float *v = src[i] + (size_t)t * E;
            float inv = 1.0f / sqrtf(k_sumsq(v, E) / (float)E + eps);
            if (rinv) rinv[(size_t)t * nsrc + i] = inv;
            logit[i] = k_dot(v, q, E) * inv;
        }
        k_softmax(logit, nsrc);
        float *o = out + (size_t)t * E;
        memset(o, 0, (size_t)E * sizeof *o);
        for (int i = 0; i < nsrc; i++) {
            const float *v = src[i] + (size_t)t * E;
            for (int j = 0; j < E; j++) o[j] = fmaf(logit[i], v[j], o[j]);
        }
    }
}

/* alpha, rinv (both NULL or both set): the record training's backward reads.
 * Its workspace: the per-thread logits below. */
static size_t attnres_ws_need(int nsrc) { return wsz((size_t)omp_get_max_threads() * (size_t)nsrc); }
static void attnres(const k3_config *c, const float *q, const float *const *src, int nsrc, int T, float *out,
                    float *alpha, float *rinv, k3_ws *ws) {
    float *logits = alpha ? NULL : ws_f(ws, (size_t)omp_get_max_threads() * nsrc);
    attnres_rows(q, src, nsrc, T, c->hidden_size, c->rms_eps, out, alpha, rinv, logits);
}

void k3_attnres_rows(const float *q, const float *const *src, int nsrc, int T, int E, float eps, float *out,
                     float *alpha, float *rinv) {
    float *logits = alpha ? NULL : xmalloc_array((size_t)omp_get_max_threads() * nsrc, sizeof(float));
    attnres_rows(q, src, nsrc, T, E, eps, out, alpha, rinv, logits);
    free(logits);
}

void k3_attnres(const k3_config *c, const float *q, const float *const *src, int nsrc, int T, float *out) {
    k3_ws ws;
    ws_init(&ws, 0);
    attnres(c, q, src, nsrc, T, out, NULL, NULL, &ws);
    ws_free(&ws);
}

/* ---- SiTU-GLU MLP (sections 5, 11; also the shared experts) ------------------ */
/* rec (may be NULL): the gate and up projections and the SiTU-GLU output,
 * what training's backward reads; without it g holds the output. */
static size_t mlp_ws_need(const k3_config *c, size_t T) { return 2 * wsz(T * (size_t)c->dense_inter); } /* g, u */
static void mlp_block(const k3_config *c, const k3_mlp_w *w, const k3_fwd_ops *fo, const float *x, int T, float *y,
                      k3_mlp_rec *rec, k3_ws *ws) {
    int I = w->gate.rows;
    float *g = rec ? rec->g : ws_f(ws, (size_t)T * I), *u = rec ? rec->u : ws_f(ws, (size_t)T * I);
    float *h = rec ? rec->h : g;
    k_prod jobs[2] = {{&w->gate, x, T, g}, {&w->up, x, T, u}}; /* one pass over x, one thread team */
    fo->products(jobs, 2);
    situ_par(c, h, g, u, (size_t)T * I);
    k_prod down = {&w->down, h, T, y};
    fo->products(&down, 1);
}
static void mlp(const k3_config *c, const k3_mlp_w *w, const float *x, int T, float *y, k3_ws *ws) {
    mlp_block(c, w, &k3_infer_ops, x, T, y, NULL, ws);
}

void k3_mlp_rec_forward(const k3_config *c, const k3_mlp_w *w, const k3_fwd_ops *fo, const float *x, int N, float *y,
                        k3_mlp_rec *rec) {
    mlp_block(c, w, fo, x, N, y, rec, NULL);
}

void k3_mlp(const k3_config *c, const k3_mlp_w *w, const float *x, int T, float *y) {
    k3_ws ws;
    ws_init(&ws, 0);
    mlp(c, w, x, T, y, &ws);
    ws_free(&ws);
}

/* ---- the decode state ------------------------------------------------------------------ */

struct k3_state {
    const k3_model *m;
    int pos, max_pos, chunk;
    int nbuf;                 /* block vectors + partial held at once */
    k3_kda_state *kda;        /* [num_layers], S == NULL for MLA layers */
    k3_mla_cache *mla;        /* [num_layers], latent == NULL for KDA layers */
    float *kda_mem, *mla_mem;
    size_t kda_floats, mla_floats;
    float *blk;               /* [nbuf][chunk][E] */
    k3_ws ws;
    struct {                  /* a pass that can be cut back (k3_state_pass_*) */
        int max_T;            /* reserved length (0: none) */
        bool open;
        int pos0;             /* position at pass_begin */
        float *kda0;          /* [kda_floats] the KDA part at pass_begin */
        float *mem;           /* every trace's buffers, then the replay output */
        k3_kda_trace *tr;     /* [num_layers], used for KDA layers */
    } pass;
};


static int n_boundaries(const k3_config *c) {
    int S = c->attn_res_block_size > 0 ? c->attn_res_block_size : 1;
    return (c->num_layers + S - 1) / S;
}
/* The workspace a chunk of N rows takes (defined beside graph_forward, from
 * each block's own *_ws_need). */
static size_t ws_need(const k3_config *c, int N, int64_t max_pos);

/* Positions a forward pass processes at once (the model's chunk, K3_PREFILL_CHUNK unless
 * opened otherwise): bounds the activations while letting every weight be
 * read once per chunk. */
static int chunk_for(int chunk, int64_t max_pos) {
    int ch = chunk > 0 ? chunk : K3_PREFILL_CHUNK;
    return max_pos < ch ? (int)(max_pos > 0 ? max_pos : 1) : ch;
}
static int state_chunk(const k3_model *m, int64_t max_pos) { return chunk_for(m->chunk, max_pos); }

static k3_state_plan state_size(const k3_config *c, int chunk, int64_t max_pos) {
    k3_state_plan p = {0};
    uint64_t P = (uint64_t)c->kda_heads * c->kda_head_dim;
    uint64_t kda_f = (uint64_t)c->kda_heads * c->kda_head_dim * c->kda_head_dim + 3 * P * (uint64_t)(c->conv_kernel - 1);
    uint64_t W = (uint64_t)c->kv_lora_rank + c->qk_rope_dim;
    int nk = c->n_kda_layers, nm = c->n_mla_layers; /* counted by the config reader (and --layers) */
    p.kda_bytes = (uint64_t)nk * kda_f * 4;
    uint64_t mla = 0;
    if (max_pos < 0 || !k3_mul_ok(W * 4 * (uint64_t)nm, (uint64_t)max_pos, &mla)) mla = UINT64_MAX / 4;
    p.mla_bytes = mla;
    int64_t mp = max_pos > (int64_t)1 << 40 ? (int64_t)1 << 40 : max_pos; /* ws_need only sizes scores */
    p.scratch_bytes = (uint64_t)(n_boundaries(c) + 1) * chunk * c->hidden_size * 4 + ws_need(c, chunk, mp);
    p.total = p.kda_bytes + p.mla_bytes + p.scratch_bytes;
    if (p.total < p.mla_bytes) p.total = UINT64_MAX;
    return p;
}

k3_state_plan k3_state_size(const k3_model *m, int64_t max_pos) {
    return state_size(&m->cfg, state_chunk(m, max_pos), max_pos);
}

/* For a plan made before the model is open: the default chunk. */
k3_state_plan k3_state_size_cfg(const k3_config *c, int64_t max_pos) {
    return state_size(c, chunk_for(0, max_pos), max_pos);
}

k3_state_plan k3_state_size_chunk(const k3_config *c, int chunk, int64_t max_pos) {
    return state_size(c, chunk_for(chunk, max_pos), max_pos);
}

int k3_state_new(const k3_model *m, int max_pos, k3_state **out, k3_err *err) {
    const k3_config *c = &m->cfg;
    if (max_pos < 1) return k3_fail(err, K3_EXIT_USAGE, "state length %d must be at least 1", max_pos);
    k3_state *s = xcalloc(1, sizeof *s);
    s->m = m;
    s->max_pos = max_pos;
    s->chunk = state_chunk(m, max_pos);
    s->nbuf = n_boundaries(c) + 1;
    int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    size_t kda_f = (size_t)H * D * D + 3 * (size_t)P * (K - 1), W = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    int nk = c->n_kda_layers, nm = c->n_mla_layers; /* counted by the config reader (and --layers) */
    s->kda_floats = (size_t)nk * kda_f;
    s->mla_floats = (size_t)nm * W * (size_t)max_pos;
    s->kda_mem = xcalloc(s->kda_floats ? s->kda_floats : 1, sizeof(float));
    s->mla_mem = xcalloc(s->mla_floats ? s->mla_floats : 1, sizeof(float));
    s->kda = xcalloc((size_t)c->num_layers, sizeof *s->kda);
    s->mla = xcalloc((size_t)c->num_layers, sizeof *s->mla);
    size_t ok = 0, om = 0;
    for (int L = 0; L < c->num_layers; L++) {
        if (c->layer_kind[L] == 'K') {
            s->kda[L].S = s->kda_mem + ok;
            s->kda[L].conv = s->kda_mem + ok + (size_t)H * D * D;
            ok += kda_f;
        } else {
            s->mla[L].latent = s->mla_mem + om;
            s->mla[L].max_pos = max_pos;
            om += W * (size_t)max_pos;
        }
    }
    s->blk = xmalloc_aligned((size_t)s->nbuf * s->chunk * c->hidden_size * sizeof(float));
    ws_init(&s->ws, ws_need(c, s->chunk, max_pos));
    *out = s;
    return K3_OK;
}

void k3_state_reset(k3_state *s) {
    s->pass.open = false;
    for (int L = 0; L < s->m->cfg.num_layers; L++) s->kda[L].trace = NULL;
    memset(s->kda_mem, 0, s->kda_floats * sizeof(float));
    memset(s->mla_mem, 0, s->mla_floats * sizeof(float));
    s->pos = 0;
}

static void pass_free(k3_state *s) {
    free(s->pass.kda0);
    free(s->pass.mem);
    free(s->pass.tr);
    for (int L = 0; s->kda && L < s->m->cfg.num_layers; L++) s->kda[L].trace = NULL;
    memset(&s->pass, 0, sizeof s->pass);
}

void k3_state_free(k3_state *s) {
    if (!s) return;
    pass_free(s);
    free(s->kda_mem);
    free(s->mla_mem);
    free(s->kda);
    free(s->mla);
    free(s->blk);
    ws_free(&s->ws);
    free(s);
}

int k3_state_pos(const k3_state *s) { return s->pos; }

uint64_t k3_state_scratch_overflow(const k3_state *s) { return s->ws.overflow; }

/* Snapshots: kda_mem is one block (every KDA layer's S then its conv history),
 * mla_mem is [n_mla][max_pos][W], so both copy as a few memcpy. */
static size_t row_width(const k3_config *c) { return (size_t)c->kv_lora_rank + c->qk_rope_dim; }
static int n_mla_layers(const k3_config *c) { return c->n_mla_layers; }

uint64_t k3_state_kda_floats(const k3_config *c) {
    uint64_t P = (uint64_t)c->kda_heads * c->kda_head_dim;
    uint64_t per = P * (uint64_t)c->kda_head_dim + 3 * P * (uint64_t)(c->conv_kernel - 1);
    return (uint64_t)(c->num_layers - n_mla_layers(c)) * per;
}

uint64_t k3_state_row_floats(const k3_config *c) { return (uint64_t)n_mla_layers(c) * row_width(c); }

uint64_t k3_state_snapshot_bytes(const k3_config *c, int64_t pos) {
    return 4 * (k3_state_kda_floats(c) + k3_state_row_floats(c) * (uint64_t)(pos > 0 ? pos : 0));
}

void k3_state_kda_get(const k3_state *s, float *out) { memcpy(out, s->kda_mem, s->kda_floats * sizeof(float)); }
void k3_state_kda_set(k3_state *s, const float *in) { memcpy(s->kda_mem, in, s->kda_floats * sizeof(float)); }
int k3_state_max_pos(const k3_state *s) { return s->max_pos; }

static void rows_copy(const k3_state *s, int p0, int n, float *rows, bool get) {
    const k3_config *c = &s->m->cfg;
    size_t W = row_width(c), nm = (size_t)n_mla_layers(c);
    for (size_t l = 0; l < nm; l++) {
        float *st = s->mla_mem + (l * (size_t)s->max_pos + (size_t)p0) * W, *b = rows + l * (size_t)n * W;
        if (get) memcpy(b, st, (size_t)n * W * sizeof(float));
        else memcpy(st, b, (size_t)n * W * sizeof(float));
    }
}

int k3_state_rows_get(const k3_state *s, int p0, int n, float *out, k3_err *err) {
    if (p0 < 0 || n < 0 || n > s->pos - p0)
        return k3_fail(err, K3_EXIT_USAGE, "state rows [%d, +%d) are not all filled (%d positions)", p0, n, s->pos);
    rows_copy(s, p0, n, out, true);
    return K3_OK;
}

int k3_state_rows_set(k3_state *s, int p0, int n, const float *in, k3_err *err) {
    if (p0 < 0 || n < 0 || n > s->max_pos - p0)
        return k3_fail(err, K3_EXIT_USAGE, "state rows [%d, +%d) do not fit %d positions", p0, n, s->max_pos);
    rows_copy(s, p0, n, (float *)in, false);
    return K3_OK;
}

int k3_state_set_pos(k3_state *s, int pos, k3_err *err) {
    if (pos < 0 || pos > s->max_pos)
        return k3_fail(err, K3_EXIT_USAGE, "state position %d is outside [0, %d]", pos, s->max_pos);
    if (pos < s->pos) {
        const k3_config *c = &s->m->cfg;
        size_t W = row_width(c), nm = (size_t)n_mla_layers(c);
        for (size_t l = 0; l < nm; l++)
            memset(s->mla_mem + (l * (size_t)s->max_pos + (size_t)pos) * W, 0,
                   (size_t)(s->pos - pos) * W * sizeof(float));
    }
    s->pos = pos;
    return K3_OK;
}

void k3_state_save(const k3_state *s, void *buf) {
    float *f = buf;
    k3_state_kda_get(s, f);
    rows_copy(s, 0, s->pos, f + s->kda_floats, true);
}

int k3_state_load(k3_state *s, const void *buf, int pos, k3_err *err) {
    if (pos < 0 || pos > s->max_pos)
        return k3_fail(err, K3_EXIT_USAGE, "snapshot of %d positions does not fit a state of %d", pos, s->max_pos);
    const float *f = buf;
    s->pass.open = false; /* a loaded state ends any pass */
    for (int L = 0; L < s->m->cfg.num_layers; L++) s->kda[L].trace = NULL;
    int rc = k3_state_set_pos(s, 0, err);
    if (rc) return rc;
    k3_state_kda_set(s, f);
    rows_copy(s, 0, pos, (float *)(f + s->kda_floats), false);
    s->pos = pos;
    return K3_OK;
}

/* ---- passes that can be cut back --------------------------------------------------------
 * A trace holds, per token, 7P + H floats (q, k, v, g; beta; three pre-conv
 * planes); the replay's output is one [max_T][P] buffer for all layers. */
static uint64_t trace_floats(const k3_config *c) {
    uint64_t P = (uint64_t)c->kda_heads * c->kda_head_dim;
    return 7 * P + (uint64_t)c->kda_heads;
}

uint64_t k3_state_pass_bytes(const k3_config *c, int max_T) {
    if (max_T < 1) return 0;
    uint64_t nk = (uint64_t)(c->num_layers - n_mla_layers(c)), T = (uint64_t)max_T;
    if (!nk) return 0;
    uint64_t P = (uint64_t)c->kda_heads * c->kda_head_dim;
    return 4 * (k3_state_kda_floats(c) + nk * T * trace_floats(c) + T * P);
}

int k3_state_pass_reserve(k3_state *s, int max_T, k3_err *err) {
    const k3_config *c = &s->m->cfg;
    if (max_T < 1) return k3_fail(err, K3_EXIT_USAGE, "a pass must allow at least 1 token, not %d", max_T);
    if (s->pass.open) return k3_fail(err, K3_EXIT_USAGE, "cannot reserve a pass record inside a pass");
    if (max_T <= s->pass.max_T) return K3_OK;
    pass_free(s);
    int nk = c->num_layers - n_mla_layers(c);
    s->pass.max_T = max_T;
    if (!nk) return K3_OK; /* MLA only: the cache is cut back by position */
    size_t H = (size_t)c->kda_heads, P = H * (size_t)c->kda_head_dim, T = (size_t)max_T;
    size_t per = T * (size_t)trace_floats(c);
    s->pass.kda0 = xmalloc_array(s->kda_floats, sizeof(float));
    s->pass.mem = xmalloc_array((size_t)nk * per + T * P, sizeof(float));
    s->pass.tr = xcalloc((size_t)c->num_layers, sizeof *s->pass.tr);
    float *p = s->pass.mem;
    for (int L = 0; L < c->num_layers; L++) {
        if (c->layer_kind[L] != 'K') continue;
        k3_kda_trace *t = &s->pass.tr[L];
        t->max_T = max_T;
        t->q = p;
        t->k = p + T * P;
        t->v = p + 2 * T * P;
        t->g = p + 3 * T * P;
        t->pre = p + 4 * T * P;
        t->beta = p + 7 * T * P;
        p += per;
    }
    return K3_OK;
}

int k3_state_pass_begin(k3_state *s, k3_err *err) {
    if (!s->pass.max_T) return k3_fail(err, K3_EXIT_USAGE, "no pass record reserved (k3_state_pass_reserve)");
    if (s->pass.open) return k3_fail(err, K3_EXIT_USAGE, "a pass is already open");
    if (s->pass.kda0) memcpy(s->pass.kda0, s->kda_mem, s->kda_floats * sizeof(float));
    s->pass.pos0 = s->pos;
    s->pass.open = true;
    for (int L = 0; s->pass.tr && L < s->m->cfg.num_layers; L++)
        if (s->m->cfg.layer_kind[L] == 'K') s->kda[L].trace = &s->pass.tr[L];
    return K3_OK;
}

int k3_state_pass_len(const k3_state *s) { return s->pass.open ? s->pos - s->pass.pos0 : 0; }

/* The conv history after the first keep tokens of the pass: the last K-1 of
 * (history at begin, pre[0..keep)), per plane and channel, oldest first.
 * Ascending i reads index keep + i >= i of the old history, never one
 * already overwritten. */
static void conv_rebuild(float *conv, const k3_kda_trace *t, int keep, size_t P, int K) {
    for (size_t j = 0; j < 3; j++)
        for (size_t ch = 0; ch < P; ch++) {
            float *h = conv + (j * P + ch) * (size_t)(K - 1);
            for (int i = 0; i < K - 1; i++) {
                int idx = keep + i - (K - 1); /* position in the pass; < 0: the old history */
                h[i] = idx >= 0 ? t->pre[(j * (size_t)t->max_T + (size_t)idx) * P + ch] : h[K - 1 + idx];
            }
        }
}

int k3_state_pass_end(k3_state *s, int keep, k3_err *err) {
    if (!s->pass.open) return k3_fail(err, K3_EXIT_USAGE, "no pass is open");
    int fed = s->pos - s->pass.pos0;
    if (keep < 0 || keep > fed)
        return k3_fail(err, K3_EXIT_USAGE, "cannot keep %d tokens of a pass of %d", keep, fed);
    const k3_config *c = &s->m->cfg;
    if (keep < fed && s->pass.kda0) {
        memcpy(s->kda_mem, s->pass.kda0, s->kda_floats * sizeof(float));
        const int H = c->kda_heads, D = c->kda_head_dim;
        const size_t P = (size_t)H * D;
        float *o = s->pass.mem + (size_t)(c->num_layers - n_mla_layers(c)) * (size_t)s->pass.max_T *
                                     (size_t)trace_floats(c);
        for (int L = 0; keep > 0 && L < c->num_layers; L++) {
            if (c->layer_kind[L] != 'K') continue;
            const k3_kda_trace *t = &s->pass.tr[L];
            k_kda_forward(o, s->kda[L].S, t->q, t->k, t->v, t->g, t->beta, 1, keep, H, D, 0, c->gate_lower_bound,
                          NULL);
            conv_rebuild(s->kda[L].conv, t, keep, P, c->conv_kernel);
        }
    }
    for (int L = 0; L < c->num_layers; L++) s->kda[L].trace = NULL;
    s->pass.open = false;
    return k3_state_set_pos(s, s->pass.pos0 + keep, err);
}

/* ---- weight sources ------------------------------------------------------------------ */

static int resident_layer_get(void *ctx, int layer, const k3_layer_w **w, k3_err *err) {
    k3_model *m = ctx;
    if (!m->layers) return k3_fail(err, K3_EXIT_RUNTIME, "model opened without layers and no weight source set");
    *w = &m->layers[layer];
    return K3_OK;
}

const k3_layer_w *k3_model_layer(const k3_model *m, int layer) { return m->layers ? &m->layers[layer] : NULL; }

void k3_model_set_ops(k3_model *m, const k3_fwd_ops *ops) { m->ops = ops; }

void k3_model_set_source(k3_model *m, const k3_weight_source *src) {
    if (src) m->src = *src;
    else m->src = (k3_weight_source){.ctx = m, .layer_get = resident_layer_get};
}

/* ---- decoder layer (section 6) ----------------------------------------------------------
 * One pass runs nseq sequences of T positions at once: activations are rows
 * s*T + t of [nseq*T][E]. Rows are independent everywhere except inside a
 * sequence (KDA's recurrence and ShortConv, MLA's attention), and every
 * row's arithmetic is the same whatever else shares the pass (batch products
 * use the canonical dots per row), so a sequence gives the same bits alone
 * or in a batch. What the caller fixes: */
typedef struct {
    const k3_config *c;
    float mla_eps;                /* MLA latent-norm epsilon */
    int kda_chunk;                /* KDA form for this pass: 0 recurrent, > 0 chunkwise */
    const k3_fwd_ops *fo;         /* products and roundings (k3_infer_ops, or training's) */
    const k3_weight_source *src;  /* routed experts from here when it serves them; else resident */
    int nseq, T;
    const int *len;               /* NULL: T positions per sequence; else len[s] each, T their sum (no record) */
    k3_ws *ws;
} fwd_pass;

/* Rows of a pass: its sequences' positions, one sequence after another. */
static int pass_rows(const fwd_pass *p) { return p->len ? p->T : p->nseq * p->T; }

/* Layer L of the graph:
 * buf[0..nb) are the completed block vectors, buf[nb] the running partial sum;
 * at a boundary layer the partial becomes block nb and buf[nb+1] the new one.
 *   1. a = AttnRes(attn_res, blocks + [p])        (layer 0: a = p, the embedding)
 *   2. if L % S == 0: blocks.append(p); p = empty
 *   3. p += Attn(RMSNorm(a; input_layernorm))    (p = that, when empty)
 *   4. m = AttnRes(mlp_res, blocks + [p])
 *   5. p += MLP(RMSNorm(m; post_attention_layernorm))
 * ks / mc / pos0 ([nseq] each): the sequences' KDA states or MLA caches and
 * positions for this layer. Without a record the partial is updated in
 * place in buf's own buffers. With one (training: every sequence from
 * position 0 and a zero state, ks, mc, pos0 NULL) every intermediate goes to
 * rec, the partial after each block is rec->p_mid / p_out, and buf[nb] is
 * left pointing at rec->p_out. */
/* Workspace of layer_forward without a record on N rows: a, xn and sub, then
 * one step at a time (each releases its temporaries before the next). */
static size_t layer_ws_need(const k3_config *c, size_t N, int64_t max_pos) {
    size_t step = attnres_ws_need(n_boundaries(c) + 1), m;
    if (c->n_kda_layers && (m = kda_ws_need(c, N)) > step) step = m;
    if (c->n_mla_layers && (m = mla_ws_need(c, N, max_pos)) > step) step = m;
    if (c->dense_inter > 0 && (m = mlp_ws_need(c, N)) > step) step = m;
    if (c->num_experts > 0 && (m = moe_ws_need(c, N)) > step) step = m;
    return 3 * wsz(N * (size_t)c->hidden_size) + step;
}
static int layer_forward(const fwd_pass *p, const k3_layer_w *w, int L, const k3_kda_state *ks, const k3_mla_cache *mc,
                         const int *pos0, float **buf, int *nb, k3_layer_rec *rec, k3_err *err) {
    const k3_config *c = p->c;
    const int E = c->hidden_size, N = pass_rows(p);
    const size_t NE = (size_t)N * E;
    k3_ws *ws = p->ws;
    /* a record goes with zero states (training), carried states without one */
    assert(rec ? !ks && !mc && !pos0 : ks && mc && pos0);
    assert(*nb < n_boundaries(c) + 1 && (*nb > 0 || L == 0));
    size_t mark = ws->used;
    float *a = rec ? rec->a : ws_f(ws, NE), *xn = rec ? rec->xin : ws_f(ws, NE), *sub = rec ? rec->p_mid : ws_f(ws, NE);
    size_t inner = ws->used; /* each step below releases its temporaries back to here */
    const float *ain = buf[0];
    if (*nb > 0) {
        attnres(c, w->attn_res_q, (const float *const *)buf, *nb + 1, N, a, rec ? rec->al_a : NULL,
                rec ? rec->r_a : NULL, ws);
        ain = a;
    }
    ws->used = inner;
    const bool boundary = L % c->attn_res_block_size == 0;
    float *pin = buf[*nb]; /* the partial entering the layer; at a boundary, the block it completes */
    if (boundary) (*nb)++;
    k3_rmsnorm_rows(xn, rec ? rec->rin : NULL, ain, w->input_norm, N, E, c->rms_eps);
    if (w->kind == 'K') {
        if (ks)
            kda_block(c, &w->kda, p->fo, ks, xn, p->nseq, p->T, p->len, sub, p->kda_chunk, rec ? &rec->kda : NULL, ws);
        else k3_kda_rec_forward(c, &w->kda, p->fo, p->kda_chunk, xn, p->nseq, p->T, sub, &rec->kda); /* zero states */
    } else {
        mla_block(c, p->mla_eps, &w->mla, p->fo, mc, pos0, xn, p->nseq, p->T, p->len, sub, rec ? &rec->mla : NULL, ws);
    }
    ws->used = inner;
    float *pm; /* the partial after the attention block */
    if (rec) {
        if (!boundary) add_rows(sub, pin, NE);
        pm = buf[*nb] = sub;
    } else {
        pm = buf[*nb];
        if (boundary) memcpy(pm, sub, NE * sizeof(float));
        else add_rows(pm, sub, NE);
    }
    float *mi = rec ? rec->mm : a, *xm = rec ? rec->xm : xn, *f = rec ? rec->p_out : sub;
    attnres(c, w->mlp_res_q, (const float *const *)buf, *nb + 1, N, mi, rec ? rec->al_m : NULL, rec ? rec->r_m : NULL,
            ws);
    ws->used = inner;
    k3_rmsnorm_rows(xm, rec ? rec->rm : NULL, mi, w->post_norm, N, E, c->rms_eps);
    if (w->dense) {
        mlp_block(c, &w->mlp, p->fo, xm, N, f, rec ? &rec->mlp : NULL, ws);
    } else {
        expert_access xa = {.experts = w->moe.experts, .layer = L};
        if (p->src && p->src->experts_get) xa.src = p->src;
        else if (!w->moe.experts)
            return k3_fail(err, K3_EXIT_RUNTIME, "layer %d: the weight source serves no experts", L);
        int rc = moe_block(c, &w->moe, p->fo, &xa, xm, N, f, rec ? &rec->moe : NULL, ws, err);
        if (rc) return rc;
    }
    if (rec) {
        add_rows(f, pm, NE);
        buf[*nb] = f;
    } else {
        add_rows(pm, f, NE);
    }
    ws->used = mark;
    return K3_OK;
}

int k3_layer(const k3_config *c, float mla_eps, const k3_layer_w *w, int L, k3_kda_state *ks, k3_mla_cache *mc,
             int pos0, float **buf, int *nb, int T, k3_err *err) {
    k3_ws ws;
    ws_init(&ws, 0);
    fwd_pass p = {.c = c, .mla_eps = mla_eps, .fo = &k3_infer_ops, .nseq = 1, .T = T, .ws = &ws};
    int rc = layer_forward(&p, w, L, ks, mc, &pos0, buf, nb, NULL, err);
    ws_free(&ws);
    return rc;
}

/* ---- the model graph (sections 6 and 12) ----------------------------------------------------
 * Embedding -> the layers -> output AttnRes -> RMSNorm -> lm_head, on a pass
 * of nseq sequences of T positions (or of p->len[s] each). The one loop over
 * the layers: k3_forward (one sequence), k3_forward_batch(_rows) (positions
 * of each of nseq sequences) and training's k3_forward_rec all run it.
 *   st:     the decode states ([nseq]; NULL with a record: zero states)
 *   ids:    token of row s*T + t at ids[s*ld + t] (with len: of row r at ids[r])
 *   bufp:   [nbuf] block vector buffers of every row (unused with a record)
 *   logits: NULL; [rows][V] when all; else [nseq][V] for each sequence's
 *           last position */
/* Workspace of graph_forward without a record on N rows (at most one
 * sequence a row), positions up to max_pos: the per-sequence state arrays,
 * then a layer at a time, then the final AttnRes into x. */
static size_t ws_need(const k3_config *c, int N, int64_t max_pos) {
    size_t n = (size_t)N, E = (size_t)c->hidden_size;
    size_t states = wsb(n * sizeof(k3_kda_state)) + wsb(n * sizeof(k3_mla_cache)) + wsz(n);
    size_t layer = layer_ws_need(c, n, max_pos), head = wsz(n * E) + attnres_ws_need(n_boundaries(c) + 1);
    return states + (layer > head ? layer : head);
}
static int graph_forward(k3_model *m, const fwd_pass *p, k3_state *const *st, const int32_t *ids, size_t ld,
                         float **bufp, float *logits, bool all, k3_model_rec *rec, k3_err *err) {
    const k3_config *c = &m->cfg;
    const int E = c->hidden_size, nseq = p->nseq, T = p->T, N = pass_rows(p);
    k3_ws *ws = p->ws;
    k3_kda_state *ks = NULL;
    k3_mla_cache *mc = NULL;
    int *pos0 = NULL;
    if (st) {
        ks = ws_get(ws, (size_t)nseq * sizeof *ks);
        mc = ws_get(ws, (size_t)nseq * sizeof *mc);
        pos0 = ws_i(ws, (size_t)nseq);
        for (int q = 0; q < nseq; q++) pos0[q] = st[q]->pos;
    }
    if (rec) bufp[0] = rec->h0;
    assert(!rec != !st && (all || !rec) && nseq >= 1 && T >= 1 && (!p->len || (all && !rec)));
    int nb = 0;
    /* h0 = embed_tokens[token], no scaling */
    if (p->len)
        for (int r = 0; r < N; r++) k_mat_row(&m->embed, ids[r], bufp[0] + (size_t)r * E);
    else
        for (int q = 0; q < nseq; q++)
            for (int t = 0; t < T; t++) k_mat_row(&m->embed, ids[(size_t)q * ld + t], bufp[0] + ((size_t)q * T + t) * E);
    for (int L = 0; L < c->num_layers; L++) {
        const k3_layer_w *w;
        int rc = m->src.layer_get(m->src.ctx, L, &w, err);
        if (rc) return rc;
        for (int q = 0; st && q < nseq; q++) {
            ks[q] = st[q]->kda[L];
            mc[q] = st[q]->mla[L];
        }
        rc = layer_forward(p, w, L, ks, mc, pos0, bufp, &nb, rec ? &rec->l[L] : NULL, err);
        if (m->src.layer_put) m->src.layer_put(m->src.ctx, L);
        if (rc) return rc;
        if (rec) ws_reset(ws); /* a pool-less pass: its heap temporaries go layer by layer */
    }
    if (!logits) return K3_OK;
    /* x = AttnRes(out, blocks + [partial]); logits = lm_head RMSNorm(x) */
    float *x = rec ? rec->xf : ws_f(ws, (size_t)N * E);
    attnres(c, m->out_res_q, (const float *const *)bufp, nb + 1, N, x, rec ? rec->al_f : NULL, rec ? rec->r_f : NULL,
            ws);
    if (all || (T == 1 && nseq > 1)) { /* every row (a batch of single positions: every row is a last one) */
        float *xn = rec ? rec->xn : x;
        k3_rmsnorm_rows(xn, rec ? rec->rn : NULL, x, m->norm, N, E, c->rms_eps);
        k_prod head = {&m->lm_head, xn, N, logits};
        p->fo->products(&head, 1);
    } else {
        for (int q = 0; q < nseq; q++) {
            float *last = x + ((size_t)q * T + T - 1) * E;
            k_rmsnorm(last, last, m->norm, E, c->rms_eps);
            k_prod hp = {&m->lm_head, last, 1, logits + (size_t)q * c->vocab_size};
            p->fo->products(&hp, 1);
        }
    }
    return K3_OK;
}

static int forward_chunk(k3_model *m, k3_state *s, const int32_t *ids, int T, float *logits, bool all,
                         k3_err *err) {
    const k3_config *c = &m->cfg;
    ws_reset(&s->ws);
    float *bufp[K3_MAX_LAYERS + 1];
    for (int i = 0; i < s->nbuf; i++) bufp[i] = s->blk + (size_t)i * s->chunk * c->hidden_size;
    if (s->pass.open) /* a recorded pass: this call's rows follow the pass's earlier ones */
        for (int L = 0; L < c->num_layers; L++)
            if (s->kda[L].trace) s->kda[L].trace->row = s->pos - s->pass.pos0;
    /* a recorded pass runs KDA recurrent: its replay must give the same bits */
    fwd_pass p = {.c = c, .mla_eps = m->mla_eps, .kda_chunk = T > 1 && !s->pass.open ? m->kda_chunk : 0,
                  .fo = m->ops ? m->ops : &k3_infer_ops, .src = &m->src, .nseq = 1, .T = T, .ws = &s->ws};
    int rc = graph_forward(m, &p, &s, ids, (size_t)T, bufp, logits, all, NULL, err);
    if (rc) return rc;
    s->pos += T;
    return K3_OK;
}

static int check_ids(const k3_config *c, const int32_t *ids, int n, k3_err *err) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return k3_fail(err, K3_EXIT_USAGE, "token id %d is outside the vocabulary [0, %d)", ids[i],
                           c->vocab_size);
    return K3_OK;
}

int k3_forward(k3_model *m, k3_state *s, const int32_t *ids, int n, float *logits, bool all_logits,
               k3_err *err) {
    const k3_config *c = &m->cfg;
    if (n < 1) return k3_fail(err, K3_EXIT_USAGE, "no tokens to feed");
    int rc = check_ids(c, ids, n, err);
    if (rc) return rc;
    if (n > s->max_pos - s->pos)
        return k3_fail(err, K3_EXIT_USAGE, "state is full: %d positions used of %d, %d more requested", s->pos,
                       s->max_pos, n);
    if (s->pass.open && n > s->pass.max_T - (s->pos - s->pass.pos0))
        return k3_fail(err, K3_EXIT_USAGE, "a pass of %d tokens would exceed its record of %d", s->pos - s->pass.pos0 + n,
                       s->pass.max_T);
    size_t V = (size_t)c->vocab_size;
    for (int c0 = 0; c0 < n; c0 += s->chunk) {
        int T = n - c0 < s->chunk ? n - c0 : s->chunk;
        float *lg = NULL;
        if (logits && all_logits) lg = logits + (size_t)c0 * V;
        else if (logits && c0 + T == n) lg = logits;
        rc = forward_chunk(m, s, ids + c0, T, lg, all_logits, err);
        if (rc) return rc;
    }
    return K3_OK;
}

/* The batched forward: n[q] positions of sequence q (n NULL: one each), ids
 * and the [rows][V] logits one sequence after another. */
static int forward_batch(k3_model *m, k3_state *const *states, int nseq, const int *n, const int32_t *ids,
                         float *logits, k3_err *err) {
    const k3_config *c = &m->cfg;
    if (nseq < 1) return k3_fail(err, K3_EXIT_USAGE, "no sequences to feed");
    int64_t max_pos = 1, rows = 0;
    for (int q = 0; q < nseq; q++) {
        const k3_state *s = states[q];
        int nq = n ? n[q] : 1;
        if (s->m != m) return k3_fail(err, K3_EXIT_USAGE, "sequence %d: its state belongs to another model", q);
        if (nq < 1) return k3_fail(err, K3_EXIT_USAGE, "sequence %d: no tokens to feed", q);
        if (nq > s->max_pos - s->pos)
            return k3_fail(err, K3_EXIT_USAGE, "sequence %d: state is full: %d positions used of %d, %d more requested",
                           q, s->pos, s->max_pos, nq);
        if (s->pass.open && nq > s->pass.max_T - (s->pos - s->pass.pos0))
            return k3_fail(err, K3_EXIT_USAGE, "sequence %d: a pass of %d tokens would exceed its record of %d", q,
                           s->pos - s->pass.pos0 + nq, s->pass.max_T);
        for (int r = 0; r < q; r++)
            if (states[r] == s) return k3_fail(err, K3_EXIT_USAGE, "sequences %d and %d share one state", r, q);
        if (s->max_pos > max_pos) max_pos = s->max_pos;
        rows += nq;
        if (rows > INT_MAX / 2) return k3_fail(err, K3_EXIT_USAGE, "a batch of more than %d tokens", INT_MAX / 2);
    }
    int rc = check_ids(c, ids, (int)rows, err);
    if (rc) return rc;
    /* the pass's own scratch: every row (the states' scratch is sized for one sequence) */
    const int nbuf = n_boundaries(c) + 1;
    k3_ws ws;
    ws_init(&ws, ws_need(c, (int)rows, max_pos));
    float *blk = xmalloc_aligned((size_t)nbuf * (size_t)rows * c->hidden_size * sizeof(float));
    float *bufp[K3_MAX_LAYERS + 1];
    for (int i = 0; i < nbuf; i++) bufp[i] = blk + (size_t)i * (size_t)rows * c->hidden_size;
    for (int q = 0; q < nseq; q++) { /* a recorded pass: this call's rows follow the pass's earlier ones */
        k3_state *s = states[q];
        for (int L = 0; s->pass.open && L < c->num_layers; L++)
            if (s->kda[L].trace) s->kda[L].trace->row = s->pos - s->pass.pos0;
    }
    fwd_pass p = {.c = c, .mla_eps = m->mla_eps, .kda_chunk = n ? m->kda_chunk : 0,
                  .fo = m->ops ? m->ops : &k3_infer_ops, .src = &m->src, .nseq = nseq, .T = n ? (int)rows : 1,
                  .len = n, .ws = &ws};
    rc = graph_forward(m, &p, states, ids, 1, bufp, logits, n != NULL, NULL, err);
    free(blk);
    ws_free(&ws);
    if (rc) return rc;
    for (int q = 0; q < nseq; q++) states[q]->pos += n ? n[q] : 1;
    return K3_OK;
}

int k3_forward_batch(k3_model *m, k3_state *const *states, int nseq, const int32_t *ids, float *logits,
                     k3_err *err) {
    return forward_batch(m, states, nseq, NULL, ids, logits, err);
}

int k3_forward_batch_rows(k3_model *m, k3_state *const *states, int nseq, const int *n, const int32_t *ids,
                          float *logits, k3_err *err) {
    if (!n) return k3_fail(err, K3_EXIT_USAGE, "no token counts");
    return forward_batch(m, states, nseq, n, ids, logits, err);
}

int k3_forward_rec(k3_model *m, const k3_fwd_ops *fo, int kda_chunk, const int32_t *ids, size_t ld, int nseq, int T,
                   float *logits, k3_model_rec *rec, k3_err *err) {
    const k3_config *c = &m->cfg;
    for (int q = 0; q < nseq; q++) {
        int rc = check_ids(c, ids + (size_t)q * ld, T, err);
        if (rc) return rc;
    }
    k3_ws ws; /* no pool: with a record the blocks take their buffers from it; the rest is small */
    ws_init(&ws, 0);
    float *bufp[K3_MAX_LAYERS + 1];
    fwd_pass p = {.c = c, .mla_eps = m->mla_eps, .kda_chunk = kda_chunk, .fo = fo, .src = &m->src, .nseq = nseq, .T = T,
              .ws = &ws};
    int rc = graph_forward(m, &p, NULL, ids, ld, bufp, logits, true, rec, err);
    ws_free(&ws);
    return rc;
}

/* ---- sampling ----------------------------------------------------------------------------- */

int k3_argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

bool k3_sample_top_p_ok(double v, float *out) {
    float f = (float)v;
    if (!(f > 0.0f) || !(v <= 1.0)) return false;
    *out = f;
    return true;
}

void k3_sampler_init(k3_sampler *sp, int vocab, float temperature, int top_k, float top_p, float min_p,
                     uint64_t seed) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = temperature;
    sp->top_k = top_k;
    sp->top_p = top_p;
    sp->min_p = min_p;
    sp->seed = seed;
    sp->rng = seed;
    sp->n = vocab;
    sp->probs = xmalloc_array((size_t)vocab, sizeof *sp->probs);
    sp->order = xmalloc_array((size_t)vocab, sizeof *sp->order);
    sp->tmp = xmalloc_array((size_t)vocab, sizeof *sp->tmp);
}

void k3_sampler_free(k3_sampler *sp) {
    free(sp->probs);
    free(sp->order);
    free(sp->tmp);
    sp->probs = NULL;
    sp->order = NULL;
    sp->tmp = NULL;
}

int k3_logits_check(const float *logits, int vocab, const char *what, size_t fed, k3_err *err) {
    for (int i = 0; i < vocab; i++)
        if (!isfinite(logits[i]))
            return k3_fail(err, K3_EXIT_DATA,
                           "%s: logit %d is not finite (%g) after %zu tokens: the checkpoint holds non-finite weights",
                           what, i, (double)logits[i], fed);
    return K3_OK;
}

/* ---- the draw ------------------------------------------------------------------------------
 * The sampler's order is probability descending, lower id first among equals
 * (a total order). Every sum runs in that order in double, so a draw is fixed
 * by the order of the ids that can change a sum; the code below finds those
 * without ordering the whole vocabulary:
 *  - top-k up to SAMPLE_HEAP_MAX: the k best through a heap of k ids;
 *  - otherwise the ids with p >= t, a prefix of the order, sorted by a radix
 *    sort (linear). t is the min-p floor when that is at least TAIL_P; else
 *    TAIL_P = 2^-54: a probability under it cannot move a double sum that has
 *    reached 0.5 (half its unit in the last place is >= 2^-54), and the sums
 *    reach ~1 long before such ids come, so the rest of the order can neither
 *    change a sum nor be drawn. With top-p, a higher t is tried first: the cut
 *    is usually among far fewer ids.
 * When a prefix is not enough (a cut or sum that would need ids below t) the
 * prefix grows, down to the whole vocabulary, before the generator is read:
 * the ids drawn are those of sorting everything, bit for bit. */
#define SAMPLE_HEAP_MAX 1024
#define TAIL_P 0x1p-54f

static inline bool ranks_before(const float *p, int i, int j) { return p[i] > p[j] || (p[i] == p[j] && i < j); }

/* Puts x into the heap h[0..n) at its root's place (the worst kept at the
 * root), moving it down past every child that ranks after it. */
static void sift_down(const float *p, int *h, int n, int x) {
    int c = 0;
    for (;;) {
        int l = 2 * c + 1, w = l;
        if (l >= n) break;
        if (l + 1 < n && ranks_before(p, h[l], h[l + 1])) w = l + 1;
        if (ranks_before(p, h[w], x)) break;
        h[c] = h[w];
        c = w;
    }
    h[c] = x;
}

/* The k best ids, in order, into out[0..k): a heap of the best seen with the
 * worst at its root, then heapsort. */
static void top_k_sorted(const float *p, int V, int k, int *out) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (n < k) { /* sift up */
            int c = n++;
            while (c > 0 && ranks_before(p, out[(c - 1) / 2], i)) {
                out[c] = out[(c - 1) / 2];
                c = (c - 1) / 2;
            }
            out[c] = i;
        } else if (ranks_before(p, i, out[0])) { /* better than the worst kept: it takes the root's place */
            sift_down(p, out, n, i);
        }
    }
    for (int m = n - 1; m > 0; m--) { /* the worst to the end */
        int x = out[m];
        out[m] = out[0];
        sift_down(p, out, m, x);
    }
}

/* The ids with p >= t into out, in order: a stable LSD radix sort (digits of
 * 11, 11 and 10 bits) on the complemented bits of p (bits of non-negative
 * floats order like their values), fed in ascending id so equals stay in id
 * order. tmp: scratch of the same size. Returns the count. */
static int prefix_sorted(const float *p, int V, float t, int *out, int *tmp) {
    int n = 0;
    for (int i = 0; i < V; i++)
        if (p[i] >= t) out[n++] = i;
    static const int shift[3] = {0, 11, 22};
    uint32_t cnt[3][2048];
    memset(cnt, 0, sizeof cnt);
    for (int j = 0; j < n; j++) {
        uint32_t key;
        memcpy(&key, &p[out[j]], 4);
        key = ~key;
        for (int d = 0; d < 3; d++) cnt[d][(key >> shift[d]) & 2047]++;
    }
    int *src = out, *dst = tmp;
    for (int d = 0; d < 3; d++) {
        uint32_t sum = 0;
        bool one = false;
        for (int b = 0; b < 2048; b++) {
            if (cnt[d][b] == (uint32_t)n) one = true;
            uint32_t c = cnt[d][b];
            cnt[d][b] = sum;
            sum += c;
        }
        if (one) continue; /* every key has this digit: the pass would not move anything */
        for (int j = 0; j < n; j++) {
            uint32_t key;
            memcpy(&key, &p[src[j]], 4);
            dst[cnt[d][((~key) >> shift[d]) & 2047]++] = src[j];
        }
        int *x = src;
        src = dst;
        dst = x;
    }
    if (src != out) memcpy(out, src, (size_t)n * sizeof *out);
    return n;
}

double k3_log_sum_exp(const float *logits, int vocab) {
    double mx = logits[0];
    for (int i = 1; i < vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double s = 0;
    for (int i = 0; i < vocab; i++) s += exp((double)logits[i] - mx);
    return mx + log(s);
}

int k3_sample(k3_sampler *sp, const float *logits) {
    int V = sp->n;
    if (sp->temperature <= 0) return k3_argmax(logits, V);
    /* softmax(logits / temperature) in double, max-subtracted */
    int best = k3_argmax(logits, V);
    double mx = logits[best], sum = 0;
    for (int i = 0; i < V; i++) {
        double e = exp(((double)logits[i] - mx) / sp->temperature);
        sp->probs[i] = (float)e;
        sum += e;
    }
    for (int i = 0; i < V; i++) sp->probs[i] = (float)(sp->probs[i] / sum);
    const float *p = sp->probs;
    int *ord = sp->order;
    int kcap = sp->top_k > 0 && sp->top_k < V ? sp->top_k : V;
    bool top_p = sp->top_p > 0 && sp->top_p < 1;
    float floor_p = sp->min_p * p[best]; /* p[best] is the largest probability */
    bool heap = kcap <= SAMPLE_HEAP_MAX && kcap < V;
    /* t0: the min-p floor when it is at least TAIL_P (the prefix is then the
     * min-p set itself, nothing past it a candidate), else TAIL_P */
    bool floor_set = sp->min_p > 0 && floor_p >= TAIL_P;
    float t0 = floor_set ? floor_p : TAIL_P, t = t0;
    if (top_p && p[best] * 0x1p-12f > t) t = p[best] * 0x1p-12f;
    for (;;) {
        int n = heap ? kcap : prefix_sorted(p, V, t, ord, sp->tmp);
        if (heap) top_k_sorted(p, V, kcap, ord);
        /* ord[0..n) is the start of the order: are ids past it still candidates? */
        int keep = kcap < n ? kcap : n;
        bool more = !heap && n < V && kcap > n && !(floor_set && t == t0);
        if (sp->min_p > 0) {
            int k = 1;
            while (k < keep && p[ord[k]] >= floor_p) k++;
            if (k < keep) more = false; /* the floor cuts inside the prefix */
            keep = k;
        }
        double cum = 0;
        if (top_p) {
            int k = 0;
            bool cut = false;
            while (k < keep) {
                cum += p[ord[k++]];
                if (cum >= sp->top_p) { cut = true; break; }
            }
            if (cut) more = false; /* the whole order cuts at the same place */
            keep = k;
        }
        double total = 0;
        for (int k = 0; k < keep; k++) total += p[ord[k]];
        /* candidates below t change nothing only when t is TAIL_P and the sum has reached 0.5 */
        if (more && (t > TAIL_P || total < 0.5)) {
            t = t > t0 ? t0 : 0; /* t = 0: the whole vocabulary */
            continue;
        }
        double r = k3_rng_unit(&sp->rng) * total, c = 0; /* common.h: the one PRNG */
        for (int k = 0; k < keep; k++) {
            c += p[ord[k]];
            if (r < c) return ord[k];
        }
        return ord[keep - 1]; /* r < total: not reached */
    }
}

/* ---- accounting ----------------------------------------------------------------------------- */

static uint64_t mat_bytes(const k3_mat *w) { return k_mat_bytes(w, w->rows); }

static uint64_t mlp_bytes(const k3_mlp_w *w) { return mat_bytes(&w->gate) + mat_bytes(&w->up) + mat_bytes(&w->down); }

uint64_t k3_model_bytes_per_token(const k3_model *m) {
    const k3_config *c = &m->cfg;
    uint64_t E = (uint64_t)c->hidden_size, b = 0;
    b += mat_bytes(&m->embed) / (uint64_t)c->vocab_size + mat_bytes(&m->lm_head) + 2 * E * 4;
    for (int L = 0; m->layers && L < c->num_layers; L++) { /* top_only: no layers bound */
        const k3_layer_w *w = &m->layers[L];
        b += 6 * E * 4;
        if (w->kind == 'K') {
            const k3_kda_w *k = &w->kda;
            b += mat_bytes(&k->q) + mat_bytes(&k->k) + mat_bytes(&k->v) + mat_bytes(&k->f_a) + mat_bytes(&k->f_b) +
                 mat_bytes(&k->b) + mat_bytes(&k->g) + mat_bytes(&k->o);
        } else {
            const k3_mla_w *a = &w->mla;
            b += mat_bytes(&a->q_a) + mat_bytes(&a->q_b) + mat_bytes(&a->kv_a) + mat_bytes(&a->kv_b) +
                 mat_bytes(&a->o) + mat_bytes(&a->g);
        }
        if (w->dense) {
            b += mlp_bytes(&w->mlp);
        } else {
            const k3_moe_w *e = &w->moe;
            b += mat_bytes(&e->router) + mat_bytes(&e->down) + mat_bytes(&e->up) + mlp_bytes(&e->shared);
            if (e->experts) /* k experts of this layer's (uniform) shape */
                b += (uint64_t)c->experts_per_token *
                     (mat_bytes(&e->experts[0].w1) + mat_bytes(&e->experts[0].w3) + mat_bytes(&e->experts[0].w2));
        }
    }
    return b;
}
