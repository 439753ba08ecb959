/* model/records.h: the model's blocks one at a time and the records training
 * keeps of its forward. For training (src/train: the forward with records,
 * then its backward, which reuses the AttnRes and RMSNorm rows and the MLA
 * core), the unit tests that check each block against the peer's module
 * fixtures or feed one from the streaming source, and bench/layers.c, which
 * times each block alone; users of a model need only model/model.h.
 *
 * Invariants:
 * - Each block's forward is written once, in src/model; training runs the
 *   same functions with its k3_fwd_ops (model/source.h) and a record, and the
 *   inference path runs them without one.
 * - A record holds exactly what the block's backward reads, computed in the
 *   forward that produced the output (never recomputed differently).
 * - k3_forward_rec runs the same layer loop and stitching as k3_forward. */
#ifndef K3_MODEL_RECORDS_H
#define K3_MODEL_RECORDS_H

#include "kernels/kernels.h"
#include "model/model.h"
#include "model/source.h"

/* ---- the blocks one at a time -------------------------------------------- */
/* Module functions on T positions (rows of [T][E] activations), exactly as
 * the model uses them. pos0 is the absolute position of row 0 (MLA). */
typedef struct k3_kda_trace k3_kda_trace;
typedef struct {
    float *S;                    /* [H][D][D] */
    float *conv;                 /* [3][P][K-1]: q, k, v histories, oldest first */
    k3_kda_trace *trace;         /* NULL; set by the state during a recorded pass
                                    (k3_state_pass_begin): where the block writes
                                    the recurrence's inputs */
} k3_kda_state;
typedef struct {
    float *latent;               /* [max_pos][r_kv + d_r] */
    int max_pos;
} k3_mla_cache;

/* AttnRes: out[t] = sum_i softmax_i(<v_i[t], q> / rms(v_i[t])) v_i[t] over
 * sources src[0..nsrc) each [T][E]. */
void k3_attnres(const k3_config *c, const float *q, const float *const *src, int nsrc, int T,
                float *out);
/* The same block with the record training's backward needs (src/train):
 * sources of width E, rms epsilon eps; alpha[T][nsrc] gets the softmax
 * weights and rinv[T][nsrc] each source's inverse rms (either may be NULL).
 * k3_attnres is this call with the config's E and rms_eps. */
void k3_attnres_rows(const float *q, const float *const *src, int nsrc, int T, int E, float eps, float *out,
                     float *alpha, float *rinv);
/* RMSNorm of T rows of n: y = x / rms(x) * g (g NULL: no gain), rms(x) =
 * sqrt(mean(x^2) + eps), the layers' and heads' norm; rinv[T] (may be NULL)
 * records 1 / rms(x) for training's backward. y may alias x. */
void k3_rmsnorm_rows(float *y, float *rinv, const float *x, const float *g, int T, int n, float eps);
void k3_kda(const k3_config *c, const k3_kda_w *w, k3_kda_state *st, const float *x, int T, float *y);
void k3_mla(const k3_config *c, float latent_eps, const k3_mla_w *w, k3_mla_cache *cache, int pos0,
            const float *x, int T, float *y);
/* experts: [N_e] bound experts (any selection may be used). */
void k3_moe(const k3_config *c, const k3_moe_w *w, const k3_expert_w *experts, const float *x, int T,
            float *y);
/* The same block with its routed experts served by src as in a run (layer L's
 * experts_start/next at one position, else experts_get): the reads a streamed
 * run makes, overlapped with compute the same way. Fails with the source's
 * error. */
int k3_moe_source(const k3_config *c, const k3_moe_w *w, const k3_weight_source *src, int L, const float *x, int T,
                  float *y, k3_err *err);
void k3_mlp(const k3_config *c, const k3_mlp_w *w, const float *x, int T, float *y);
/* One decoder layer (section 6) on T positions. buf[0..*nb) hold the completed
 * block vectors and buf[*nb] the running partial sum, each [T][E]; at a block
 * boundary (L % attn_res_block_size == 0) the partial becomes block *nb, *nb
 * grows by one and the new partial is written to buf[*nb] (so buf needs one
 * spare entry). ks / mc: the layer's KDA state or MLA cache (the other unused). */
int k3_layer(const k3_config *c, float mla_eps, const k3_layer_w *w, int L, k3_kda_state *ks, k3_mla_cache *mc,
             int pos0, float **buf, int *nb, int T, k3_err *err);

/* ---- training's records ------------------------------------------------ */
/* What the KDA block's backward reads, for N = nseq*T rows (H heads of D, P =
 * H*D). The q, k, v projections and their conv outputs are three planes of
 * [N][P] (q, then k, then v). */
typedef struct {
    float *pre;    /* [3][N][P] projections before the ShortConv */
    float *cv;     /* [3][N][P] ShortConv outputs before SiLU */
    float *q, *k;  /* [N][P] after SiLU and the per-head L2 norm (q not yet scaled) */
    float *rq, *rk;/* [N][H] the L2 norms' inverses */
    float *v;      /* [N][P] after SiLU */
    float *beta;   /* [N][H] */
    float *fa;     /* [N][D] f_a x */
    float *zb;     /* [N][P] f_b(f_a x) + dt_bias */
    float *gl;     /* [N][P] log-decay */
    float *o;      /* [N][P] the recurrence's output */
    float *ro;     /* [N*H] the head norm's inverse rms */
    float *gate;   /* [N][P] sigmoid(g_proj x) */
    float *y;      /* [N][P] o_proj's input */
    float *Ssave;  /* [nseq][H][nblk][D][D]: the state entering every block of
                      k_kda_block_len(chunk, gate_lower_bound) positions */
} k3_kda_rec;
/* What a SiTU-GLU MLP's backward reads (dense layers, the shared experts):
 * N rows of I = gate.rows. */
typedef struct {
    float *g, *u;  /* [N][I] gate and up projections */
    float *h;      /* [N][I] SiTU-GLU(g, u), down's input */
} k3_mlp_rec;
void k3_mlp_rec_forward(const k3_config *c, const k3_mlp_w *w, const k3_fwd_ops *fo, const float *x, int N, float *y,
                        k3_mlp_rec *rec);

/* What the LatentMoE block's backward reads, for N tokens and k slots each
 * (slot n*k + j: token n's j-th choice). The experts' rows are grouped by
 * expert (ascending id; within an expert, in slot order): row[slot] is the
 * slot's row there. */
typedef struct {
    float *s;           /* [N][N_e] router sigmoid scores */
    float *cut;         /* [N] selection score of the best expert left out (k < N_e) */
    int *idx;           /* [N][k] chosen experts, in descending selection score */
    float *p;           /* [N][k] routing weights */
    float *z;           /* [N][l] W_down x */
    float *g1, *g3, *h; /* [N k][I] grouped: w1 z, w3 z, SiTU-GLU of the two (w2's input) */
    float *e;           /* [N k][l] grouped: the experts' outputs */
    int *row;           /* [N k] */
    float *u, *ru, *un; /* [N][l] sum_j p_j e_j, [N] 1/rms, [N][l] normed (W_up's input) */
    k3_mlp_rec sh;      /* the shared experts, width N_s I */
} k3_moe_rec;
/* The LatentMoE block on N rows with resident experts (w->experts). */
void k3_moe_rec_forward(const k3_config *c, const k3_moe_w *w, const k3_fwd_ops *fo, const float *x, int N,
                        float *y, k3_moe_rec *rec);

/* What the MLA block's backward reads (N = nseq*T rows, dq = d_n + d_r,
 * dkv = d_n + d_v). */
struct k3_mla_rec {
    float *cq_pre, *rcq, *cq;   /* [N][r_q] q_a x, [N] 1/rms, [N][r_q] normed */
    float *q;                   /* [N][H dq] */
    float *ckv;                 /* [N][r_kv + d_r] kv_a x */
    float *clat, *rkv, *ckvn;   /* [N][r_kv] its latent part, [N] 1/rms, [N][r_kv] normed */
    float *kv;                  /* [N][H dkv] expanded keys and values */
    float *pr;                  /* [nseq][H][T][T] softmax probabilities (0 above the diagonal) */
    float *o, *gate, *y;        /* [N][H d_v] attention output, sigmoid(g_proj x), o_proj's input */
};
/* The MLA block on nseq sequences of T positions with the expanded core
 * (x, y: [nseq*T][E]; latent_eps: the latent norms' epsilon). */
void k3_mla_rec_forward(const k3_config *c, float latent_eps, const k3_mla_w *w, const k3_fwd_ops *fo,
                        const float *x, int nseq, int T, float *y, k3_mla_rec *rec);
/* The expanded core on r's q, kv and ckv: r->pr and r->o (canonical dots for
 * the scores, one fma chain per output over the positions; bf16: the two
 * products as BF16 training GEMMs, training's BF16 mode). */
void k3_mla_attend_expanded(const k3_config *c, k3_mla_rec *r, int nseq, int T, bool bf16);

/* The KDA block on nseq sequences of T positions, each from a zero state
 * (x, y: [nseq*T][E]); chunk 0 the recurrent form, > 0 the chunkwise one. */
void k3_kda_rec_forward(const k3_config *c, const k3_kda_w *w, const k3_fwd_ops *fo, int chunk, const float *x,
                        int nseq, int T, float *y, k3_kda_rec *rec);
/* What one decoder layer's backward reads (training), for N = nseq*T rows
 * and m_a / m_m AttnRes sources (the completed blocks plus the partial). */
typedef struct {
    float *a, *al_a, *r_a;   /* [N][E] the attention input's AttnRes, [N][m_a] its softmax and the
                                sources' 1/rms; unused at layer 0, whose input is the embedding */
    float *xin, *rin;        /* [N][E] the attention block's normed input, [N] 1/rms */
    float *p_mid, *p_out;    /* [N][E] the partial sum after the attention block, after the MLP block */
    float *mm, *al_m, *r_m;  /* the MLP input's AttnRes, [N][m_m] */
    float *xm, *rm;          /* the MLP block's normed input, 1/rms */
    k3_kda_rec kda;          /* the attention block's record (by kind) */
    k3_mla_rec mla;
    k3_mlp_rec mlp;          /* the MLP block's record (dense or MoE) */
    k3_moe_rec moe;
} k3_layer_rec;
/* The whole graph's: the layers' and the model-level stitching's. */
typedef struct {
    float *h0;               /* [N][E] embedding rows */
    k3_layer_rec *l;         /* [num_layers] */
    float *xf, *al_f, *r_f;  /* the output AttnRes: [N][E], [N][nblocks + 1] x 2 */
    float *xn, *rn;          /* the final norm's output and 1/rms */
} k3_model_rec;
/* Training's forward: the model graph (the same layer loop and stitching as
 * k3_forward) on nseq sequences of T positions, each from position 0 and a
 * zero state, with fo's products and roundings, KDA in the form kda_chunk
 * (0 recurrent, else chunkwise) for every T, the expanded MLA core, every
 * record in rec, and the logits of every position ([nseq*T][V], by fo's
 * products). The token of row s*T + t is ids[s*ld + t]. Errors: an id
 * outside the vocabulary (K3_EXIT_USAGE). */
int k3_forward_rec(k3_model *m, const k3_fwd_ops *fo, int kda_chunk, const int32_t *ids, size_t ld, int nseq, int T,
                   float *logits, k3_model_rec *rec, k3_err *err);

#endif
