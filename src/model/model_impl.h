/* model_impl.h: what the model's files share (not a public header: use
 * model.h, model/source.h or model/records.h): the model struct (weights.c binds it, model.c runs it), the
 * workspace of one forward chunk, and the blocks that live in their own
 * files (kda.c, mla.c, moe.c). */
#ifndef K3_MODEL_IMPL_H
#define K3_MODEL_IMPL_H

#include "model/records.h"
#include "formats/safetensors.h"
#include "util/common.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

struct k3_model {
    k3_config cfg;            /* num_layers cut to opts.layers */
    float mla_eps;            /* MLA latent-norm epsilon in use */
    int kda_chunk;            /* > 0: chunkwise KDA for multi-token calls */
    int chunk;                /* positions per forward pass (opts.prefill_chunk, default K3_PREFILL_CHUNK) */
    k3_mat embed;             /* [V][E] */
    k3_mat lm_head;           /* [V][E] */
    float *norm;              /* final RMSNorm gain [E] */
    float *out_res_q;         /* final AttnRes folded query [E] */
    k3_layer_w *layers;       /* [cfg.num_layers] */
    k3_owned owned;           /* every allocation made while binding */
    uint64_t mapped_bytes;    /* tensor bytes used in place (mmap / blob) */
    st_index *ix;             /* safetensors shards, NULL for a blob */
    float *blob;              /* the peer blob, NULL for safetensors */
    k3_weight_source src;     /* where layers and experts come from now */
    const k3_fwd_ops *ops;    /* the trunk's and the head's products (k3_model_set_ops; NULL: k3_infer_ops) */
};

/* ---- workspace ------------------------------------------------------------
 * A bump allocator for the temporaries of one forward chunk. The state sizes
 * it from ws_need() so a forward never allocates; should the estimate ever
 * fall short, the overflow is served by the heap (and kept until the next
 * reset), never by a crash. */
typedef struct {
    char *base;
    size_t cap, used, high;
    void **extra;
    size_t nextra, cextra;
    uint64_t overflow;   /* bytes ever served by the heap fallback */
} k3_ws;

#define WS_ALIGN 64

static inline void *ws_get(k3_ws *w, size_t bytes) {
    size_t n = (bytes + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN;
    if (w->used + n <= w->cap) {
        void *p = w->base + w->used;
        w->used += n;
        if (w->used > w->high) w->high = w->used;
        return p;
    }
#ifdef K3_CHECKED
    /* a sized workspace that overflows means a block's *_ws_need missed a ws_get */
    assert(!w->cap && "workspace plan short");
#endif
    if (w->nextra == w->cextra) {
        w->cextra = w->cextra ? 2 * w->cextra : 8;
        w->extra = xrealloc_array(w->extra, w->cextra, sizeof *w->extra);
    }
    void *p = xmalloc_aligned(n);
    w->extra[w->nextra++] = p;
    w->overflow += n;
    w->high += n;
    return p;
}
static inline float *ws_f(k3_ws *w, size_t n) { return ws_get(w, n * sizeof(float)); }
static inline int *ws_i(k3_ws *w, size_t n) { return ws_get(w, n * sizeof(int)); }

static inline void ws_reset(k3_ws *w) {
    for (size_t i = 0; i < w->nextra; i++) free(w->extra[i]);
    w->nextra = 0;
    w->used = 0;
}
static inline void ws_init(k3_ws *w, size_t cap) {
    memset(w, 0, sizeof *w);
    w->cap = cap;
    w->base = cap ? xmalloc_aligned(cap) : NULL;
}
static inline void ws_free(k3_ws *w) {
    ws_reset(w);
    free(w->extra);
    free(w->base);
    memset(w, 0, sizeof *w);
}

/* Bytes ws_get rounds n bytes / n floats (or ints) to: each block's *_ws_need
 * adds one of these per ws_get it makes. */
static inline size_t wsb(size_t bytes) { return (bytes + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN; }
static inline size_t wsz(size_t nfloats) { return wsb(nfloats * 4); }

/* Per-position work of a prefill chunk is split over threads only when the
 * chunk is long enough to pay for a thread team (rows are independent, so
 * the bits do not change). */
#define PAR_ROWS(T, n) ((double)(T) * (double)(n) > 131072.0)

/* SiTU-GLU over n elements (elementwise), in blocks over threads when long. */
static inline void situ_par(const k3_config *c, float *out, const float *gate, const float *up, size_t n) {
    const size_t B = 16384;
    long nb = (long)((n + B - 1) / B);
#pragma omp parallel for schedule(static) if (n > 4 * B)
    for (long b = 0; b < nb; b++) {
        size_t o = (size_t)b * B, len = n - o < B ? n - o : B;
        k_situ_glu(out + o, gate + o, up + o, (int)len, c->situ_beta, c->situ_linear_beta);
    }
}

static inline void add_rows(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

/* Where a recorded pass (k3_state_pass_begin) keeps one KDA layer's
 * per-token recurrence inputs; row r is the pass's r-th token. */
struct k3_kda_trace {
    float *q, *k, *v, *g;     /* [max_T][P] */
    float *beta;              /* [max_T][H] */
    float *pre;               /* [3][max_T][P] ShortConv inputs (q, k, v planes) */
    int max_T;
    int row;                  /* row of the call's first token (set by the state) */
};

/* The KDA block (kda.c) on nseq sequences of T positions (rows s*T + t of x
 * and y, each [.][E]), or, with len (no rec), of len[s] positions each, one
 * after another: st[s] is sequence s's state (S [H][D][D], conv [3][P][K-1]),
 * updated; chunk > 0 runs the chunkwise form (with len: for a sequence of
 * several positions outside a recorded pass, as it would alone). rec (may be
 * NULL) gets what training's backward reads; without it the temporaries come
 * from ws. A sequence whose st[s].trace is set (no rec: a recorded pass)
 * gets the recurrence's inputs at rows trace->row.. */
void kda_block(const k3_config *c, const k3_kda_w *w, const k3_fwd_ops *fo, const k3_kda_state *st, const float *x,
               int nseq, int T, const int *len, float *y, int chunk, k3_kda_rec *rec, k3_ws *ws);
/* Workspace one call of kda_block without a record takes for N rows in all. */
size_t kda_ws_need(const k3_config *c, size_t N);

/* The MLA block (mla.c) on nseq sequences of T positions (or, with len and no
 * record, of len[s] positions each): without a record, sequence s's latents
 * go to cache[s] rows pos0[s].. and the absorbed core attends over them; with
 * one, the expanded core over each sequence and no cache (cache, pos0 NULL). */
void mla_block(const k3_config *c, float eps_lat, const k3_mla_w *w, const k3_fwd_ops *fo, const k3_mla_cache *cache,
               const int *pos0, const float *x, int nseq, int T, const int *len, float *y, k3_mla_rec *rec,
               k3_ws *ws);
/* Workspace one call of mla_block without a record takes for N rows in all,
 * no sequence reaching past position max_pos. */
size_t mla_ws_need(const k3_config *c, size_t N, int64_t max_pos);

/* The LatentMoE block (moe.c) on T rows: experts from xa (resident, or a
 * weight source); rec (may be NULL) gets what training's backward reads. */
typedef struct {
    const k3_weight_source *src;   /* NULL: experts[] holds every expert */
    const k3_expert_w *experts;
    int layer;
} expert_access;
int moe_block(const k3_config *c, const k3_moe_w *w, const k3_fwd_ops *fo, const expert_access *xa, const float *x,
              int T, float *y, k3_moe_rec *rec, k3_ws *ws, k3_err *err);
/* Workspace one call of moe_block without a record takes for T rows. */
size_t moe_ws_need(const k3_config *c, size_t T);

#endif
