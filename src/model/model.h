/* model.h: the K3 forward pass, its decode state and token sampling.
 *
 * Typical use (error handling elided):
 *
 *     k3_model *m;  k3_model_open("MODEL_DIR", NULL, &m, &err);
 *     k3_state *s;  k3_state_new(m, max_positions, &s, &err);
 *     float *logits = xmalloc_array(k3_model_config(m)->vocab_size, sizeof(float));
 *     k3_forward(m, s, prompt, n_prompt, logits, false, &err);   // prefill
 *     for (...) { int id = k3_argmax(logits, V); k3_forward(m, s, &id, 1, logits, false, &err); }
 *     k3_state_free(s); k3_model_free(m);
 *
 * Arithmetic contract. Every token is computed with the same per-token
 * arithmetic whether it arrives in a prefill batch or alone: batch products
 * use k_matmul (same bits as k_matvec per row), KDA uses the recurrent kernel,
 * MLA attends position by position. So feeding a sequence in any split (one
 * prefill, token by token, or a full recompute) gives the same logits bits,
 * and so does any thread count (kernels split rows, never a reduction).
 *
 * Layer graph: k3-checkpoint-format.md section 6 (AttnRes section 7, KDA 8,
 * MLA 9, LatentMoE 10, dense MLP 11, head 12); the equations are in model.c.
 * Everything is computed in f32; BF16 weights stay BF16 in memory. */
#ifndef K3_MODEL_H
#define K3_MODEL_H

#include "formats/config.h"
#include "kernels/kernels.h"
#include "util/common.h"

typedef struct k3_model k3_model;
typedef struct k3_state k3_state;

/* ---- opening a model -------------------------------------------------- */
typedef struct {
    int layers;            /* run only the first N layers (0: all); --layers */
    bool peer_mla_eps;     /* MLA latent norms use rms_norm_eps (the peer's 1e-5)
                              instead of the released fixed 1e-6 (spec section 9) */
    bool top_only;         /* bind only the model-level tensors (embeddings, head,
                              final norms); the layers must then come from a weight
                              source set with k3_model_set_source (streaming under a budget) */
    int kda_chunk;         /* > 0: multi-token calls (prefill) use the chunkwise
                              KDA form with this chunk length. Faster for long
                              prompts, equal to fp32 rounding but NOT bitwise to
                              the recurrent form, so prefill and token-by-token
                              logits then differ in the last bits. 0: recurrent. */
    int prefill_chunk;     /* positions one forward pass carries at once (0:
                              K3_PREFILL_CHUNK).
                              Larger chunks read every weight (and a layer's
                              experts) once for more positions: faster prefill,
                              more scratch and, for a streaming source, more
                              experts fetched per layer. Never changes the bits. */
} k3_model_opts;

/* The default prefill chunk: every weight (and each selected expert) is read
 * and decoded once per this many positions; 256 keeps the products of a chunk
 * matrix-matrix (about 21 rows per routed expert at top-8 of 96) for a few
 * MB of scratch at the decode benchmark's hidden size 1280 (k3_state_size
 * says how much). */
#define K3_PREFILL_CHUNK 256

/* Opens a model directory (config.json + *.safetensors in the released layout,
 * spec section 3). opts may be NULL. Errors: K3_EXIT_USAGE for a missing
 * directory or an invalid config, K3_EXIT_DATA for a missing tensor or a wrong
 * shape/dtype (one line naming the tensor), K3_EXIT_RUNTIME for I/O. */
int k3_model_open(const char *dir, const k3_model_opts *opts, k3_model **out, k3_err *err);
/* The same from what was already read of dir: cfg as k3_config_load gave it
 * (before --layers; opts->layers applies here) and ix as st_open gave it (the
 * model takes its own reference, st_retain; the caller keeps and closes
 * its). The engine opens both once for the plan and the model. */
int k3_model_open_index(const char *dir, const k3_config *cfg, st_index *ix, const k3_model_opts *opts,
                        k3_model **out, k3_err *err);
/* Opens the peer oracle's flat f32 blob (tiny_k3.json + tiny_k3.bin: tensor
 * name -> element offset and shape, names with '.' -> '_'); for tests. */
int k3_model_open_blob(const char *json_path, const char *bin_path, const k3_model_opts *opts,
                       k3_model **out, k3_err *err);
void k3_model_free(k3_model *m);

/* The effective config (num_layers already cut to opts.layers). */
const k3_config *k3_model_config(const k3_model *m);
/* Bytes of weights held in memory (mapped or allocated) by this model. */
uint64_t k3_model_weight_bytes(const k3_model *m);
/* Weight bytes one decoded token reads: every trunk matrix, k routed experts
 * per MoE layer, the lm_head and one embedding row (norm vectors included;
 * model-level tensors only for a model opened top_only). */
uint64_t k3_model_bytes_per_token(const k3_model *m);

/* ---- decode state ----------------------------------------------------- */
/* Per-layer state: KDA recurrent S [H][D][D] and the ShortConv history (last
 * K-1 pre-conv inputs of q, k, v); MLA latent cache (r_kv + d_rope floats per
 * position: the normalised c_kv and the raw shared rope key); plus scratch for
 * a prefill chunk. Sized for max_pos positions at creation. */
typedef struct {
    uint64_t kda_bytes;      /* KDA S + conv history, all KDA layers */
    uint64_t mla_bytes;      /* latent cache at max_pos, all MLA layers */
    uint64_t scratch_bytes;  /* activations of one prefill chunk */
    uint64_t total;          /* sum of the three */
} k3_state_plan;
k3_state_plan k3_state_size(const k3_model *m, int64_t max_pos);
/* The same from a config alone (num_layers already cut to --layers, with
 * n_kda_layers / n_mla_layers recounted), so a memory plan can be checked
 * before any weight is read. */
k3_state_plan k3_state_size_cfg(const k3_config *c, int64_t max_pos);
/* The same for a model that will be opened with prefill_chunk = chunk (0: the
 * default), so a plan can try smaller chunks before refusing. */
k3_state_plan k3_state_size_chunk(const k3_config *c, int chunk, int64_t max_pos);
int k3_state_new(const k3_model *m, int max_pos, k3_state **out, k3_err *err);
void k3_state_reset(k3_state *s);  /* back to position 0, state zeroed */
void k3_state_free(k3_state *s);
int k3_state_pos(const k3_state *s);
/* Scratch bytes that had to come from the heap because the plan was short
 * (0 when k3_state_size is right; the tests check it). */
uint64_t k3_state_scratch_overflow(const k3_state *s);

/* ---- decode-state snapshots ------------------------------------------- */
/* A state at position p is exactly: the KDA part (S and the ShortConv history
 * of every KDA layer, a fixed size) plus the MLA latent rows of positions
 * [0, p) of every MLA layer; scratch holds nothing between calls. Copying
 * those out and back in reproduces the state bit for bit, so a forward pass
 * after a restore gives the logits the original state would have given. The
 * KDA part is recurrent: it cannot be rewound, only replaced by a copy taken
 * at the position wanted. Row buffers are layer-major: [n_mla][n][W] with
 * W = kv_lora_rank + qk_rope_head_dim. */
uint64_t k3_state_kda_floats(const k3_config *c);   /* floats of the KDA part */
uint64_t k3_state_row_floats(const k3_config *c);   /* MLA floats per position, all MLA layers */
/* Bytes of a whole snapshot at position pos: the KDA part plus pos rows. */
uint64_t k3_state_snapshot_bytes(const k3_config *c, int64_t pos);
void k3_state_kda_get(const k3_state *s, float *out);
void k3_state_kda_set(k3_state *s, const float *in);
/* MLA rows [p0, p0 + n) out of / into the cache. get needs p0 + n <= pos;
 * set needs p0 + n <= max_pos and leaves pos alone. K3_EXIT_USAGE otherwise. */
int k3_state_rows_get(const k3_state *s, int p0, int n, float *out, k3_err *err);
int k3_state_rows_set(k3_state *s, int p0, int n, const float *in, k3_err *err);
/* Declares the state to be at pos (0 <= pos <= max_pos): the caller vouches
 * that the KDA part and rows [0, pos) belong to the same pos tokens (e.g. it
 * has just set them from a snapshot). Lowering pos truncates the MLA cache
 * (rows from pos on are zeroed); it does not rewind the KDA part. */
int k3_state_set_pos(k3_state *s, int pos, k3_err *err);
int k3_state_max_pos(const k3_state *s);
/* A whole snapshot in one buffer (k3_state_snapshot_bytes(cfg, pos) bytes):
 * the KDA part, then rows [0, pos). load sets pos. */
void k3_state_save(const k3_state *s, void *buf);
int k3_state_load(k3_state *s, const void *buf, int pos, k3_err *err);

/* ---- passes that can be cut back (speculative decoding) ---------------- *
 * A pass feeds T tokens of which only the first `keep` may turn out to be
 * wanted (drafts verified in one forward). The MLA cache is cut back by
 * position; the KDA part is recurrent, so the pass records what the
 * recurrence consumed and the state is rebuilt without another pass over the
 * weights:
 *
 *     k3_state_pass_reserve(s, T_max, &err);     // once: the record's memory
 *     k3_state_pass_begin(s, &err);              // copies the KDA part
 *     k3_forward(m, s, ids, T, logits, true, &err);  // [T][V], recorded
 *     k3_state_pass_end(s, keep, &err);          // state = first keep tokens fed
 *
 * During the pass every KDA layer records, per token, the recurrence's inputs
 * (q, k after SiLU and the head L2 norm, v after SiLU, the log-decay g, beta)
 * and the ShortConv's pre-conv inputs. pass_end with keep < T puts the KDA
 * part copied at begin back, replays the recurrence (k_kda_forward, recurrent
 * form) over the first keep recorded tokens and rebuilds the conv histories
 * from the recorded inputs; then it cuts the MLA cache to pos0 + keep. The
 * result is the state plain decoding of those keep tokens gives, bit for bit
 * (the recurrent step does not depend on how positions are grouped), and the
 * next logits are identical. A recorded pass always uses the recurrent KDA
 * form (--kda-chunk does not apply to it). Several forward calls may share
 * one pass (their tokens count together against T_max).
 *
 * Memory (k3_state_pass_bytes): one copy of the KDA part plus, per KDA layer
 * and token of T_max, 7 P + H floats (q, k, v, g, the three pre-conv inputs;
 * beta), and P floats per token for the replay's output (one buffer). For the release (69 KDA layers, H 96,
 * D 128, P 12,288) that is 464.6 MB + 23.8 MB per token: 655 MB at T_max 8. */
uint64_t k3_state_pass_bytes(const k3_config *c, int max_T);
/* Allocates the record for passes of up to max_T >= 1 tokens (again with a
 * larger max_T: reallocates; not during a pass). */
int k3_state_pass_reserve(k3_state *s, int max_T, k3_err *err);
/* Starts a recorded pass at the current position. K3_EXIT_USAGE without a
 * reserve or inside a pass. A forward that would take the pass past max_T
 * tokens is refused (K3_EXIT_USAGE, state unchanged). */
int k3_state_pass_begin(k3_state *s, k3_err *err);
/* Ends the pass keeping its first keep tokens (0 <= keep <= tokens fed in
 * the pass; all of them: nothing to rebuild). K3_EXIT_USAGE outside a pass or
 * for keep out of range (the pass stays open then). */
int k3_state_pass_end(k3_state *s, int keep, k3_err *err);
/* Tokens fed since pass_begin (0 outside a pass). */
int k3_state_pass_len(const k3_state *s);

/* ---- forward ----------------------------------------------------------- */
/* Feeds n >= 1 tokens at the state's position and advances it by n.
 * logits: NULL (none computed), [n][V] when all_logits, else [V] for the last
 * token. Errors: an id outside [0, V) or a full state -> K3_EXIT_USAGE (the
 * state is left unchanged); a weight-source failure passes its code through. */
int k3_forward(k3_model *m, k3_state *s, const int32_t *ids, int n, float *logits, bool all_logits,
               k3_err *err);

/* Batched decoding: one position of each of nseq sequences in one pass
 * (ids[s] is fed to states[s], at that state's own position; each advances
 * by one). The layers read every weight once for the whole batch; each
 * sequence's logits (logits[s][V], or NULL) have exactly the bits
 * k3_forward(m, states[s], &ids[s], 1, ...) gives. The states must be
 * distinct and of this model; one inside a recorded pass records its
 * position as k3_forward does. Errors as k3_forward's (no state changes). */
int k3_forward_batch(k3_model *m, k3_state *const *states, int nseq, const int32_t *ids, float *logits,
                     k3_err *err);
/* The same with n[s] >= 1 positions of sequence s (a verifying pass of a
 * sampled id and its drafts, a prefill chunk): ids holds the sequences' ids
 * one after another (sum of n), and logits (NULL: none) gets every row,
 * [sum n][V] in the same order. Sequence s's rows, state and pass record are
 * exactly those of k3_forward(m, states[s], its ids, n[s], rows, true, ...)
 * alone, whatever the other sequences are (the KDA form included: chunkwise
 * with --kda-chunk only for several positions outside a recorded pass, as
 * k3_forward chooses). */
int k3_forward_batch_rows(k3_model *m, k3_state *const *states, int nseq, const int *n, const int32_t *ids,
                          float *logits, k3_err *err);

/* ---- sampling ------------------------------------------------------------ */
/* Greedy: the largest logit, lowest index among equals. */
int k3_argmax(const float *logits, int n);

typedef struct {
    float temperature;  /* <= 0: greedy (the other fields are ignored) */
    int top_k;          /* 0: off */
    float top_p;        /* 1 (or >= 1): off */
    float min_p;        /* 0: off; keep tokens with p >= min_p * p_max */
    uint64_t seed;
    uint64_t rng;       /* PRNG state, set by k3_sampler_init */
    float *probs;       /* scratch, [V] */
    int *order;         /* scratch, [V] */
    int *tmp;           /* scratch, [V] */
    int n;
} k3_sampler;
void k3_sampler_init(k3_sampler *sp, int vocab, float temperature, int top_k, float top_p,
                     float min_p, uint64_t seed);
/* The one range check of top_p (`k3 run --top-p`, serve's top_p): (0, 1], on
 * the float the sampler holds, since a tiny positive number that rounds to
 * 0.0f would turn the filter off instead of keeping one token. True and *out
 * set when v is valid. */
bool k3_sample_top_p_ok(double v, float *out);
void k3_sampler_free(k3_sampler *sp);
/* Draws the next id. Reproducible for a seed: the same logits sequence gives the
 * same ids on every machine (own PRNG, f64 cumulative sums in a fixed order). */
int k3_sample(k3_sampler *sp, const float *logits);
/* ln sum_i exp(logits[i]), in double, one fixed order (max first): a row's
 * log-probabilities are logits[i] minus it (eval's loss, serve's logprobs). */
double k3_log_sum_exp(const float *logits, int vocab);
/* What every generator checks before it samples: a non-finite logit (NaN or
 * Inf weights) would make greedy decoding pick token 0 forever and sampling
 * pick garbage. K3_EXIT_DATA naming what (the model), the first such logit
 * and how many tokens were fed. */
int k3_logits_check(const float *logits, int vocab, const char *what, size_t fed, k3_err *err);

/* =============================================================== * Lower level: bound weights and per-module functions. Used by model.c, the
 * unit tests (peer module fixtures) and weight sources that stream layers or
 * experts from disk instead of holding them (a model larger than memory).
 * ====================================================================== */

typedef struct { k3_mat gate, up, down; } k3_mlp_w;            /* SiTU-GLU MLP */
typedef struct { k3_mat w1, w3, w2; } k3_expert_w;            /* gate, up, down (latent) */

typedef struct {
    k3_mat q, k, v;              /* [P][E] */
    float *conv[3];              /* q, k, v depthwise taps [P][K] */
    k3_mat f_a, f_b;             /* [D][E], [P][D] */
    float *A_log;                /* [H] (first H stored values) */
    float *dt_bias;              /* [P] */
    k3_mat b;                    /* [H][E] */
    k3_mat g;                    /* [P][E] full-rank output gate */
    float *o_norm;               /* [D] shared by all heads */
    k3_mat o;                    /* [E][P] */
} k3_kda_w;

typedef struct {
    k3_mat q_a;                  /* [r_q][E] (q_lora_rank > 0) */
    float *q_a_norm;             /* [r_q] */
    k3_mat q_b;                  /* [H(d_n+d_r)][r_q], or q_proj [H(d_n+d_r)][E] when r_q == 0 */
    k3_mat kv_a;                 /* [r_kv + d_r][E] */
    float *kv_a_norm;            /* [r_kv] */
    k3_mat kv_b;                 /* [H(d_n+d_v)][r_kv] */
    k3_mat o;                    /* [E][H d_v] */
    k3_mat g;                    /* [H d_v][E]; rows == 0 when the config has no output gate */
} k3_mla_w;

typedef struct {
    k3_mat router;               /* [N_e][E] */
    float *router_bias;          /* [N_e] selection-only bias */
    k3_mat down;                 /* W_down [l][E] */
    float *norm;                 /* [l] RMSNorm of the routed aggregate; NULL when off */
    k3_mat up;                   /* W_up [E][l] */
    k3_mlp_w shared;             /* fused shared experts, width N_s*I; rows == 0 if none */
    k3_expert_w *experts;        /* [N_e] when resident; NULL when a source serves them */
} k3_moe_w;

typedef struct {
    char kind;                   /* 'K' KDA or 'M' MLA */
    bool dense;                  /* dense MLP instead of LatentMoE */
    float *attn_res_q, *mlp_res_q;  /* AttnRes pseudo-query with the key-norm gain folded in: gamma*w [E] */
    float *input_norm, *post_norm;  /* [E] */
    k3_kda_w kda;
    k3_mla_w mla;
    k3_mlp_w mlp;                /* dense layers */
    k3_moe_w moe;                /* MoE layers */
} k3_layer_w;

/* Where weights come from. The default source serves everything from memory
 * (mapped shards or the blob); a streaming source (memory/stream.h) replaces it with
 * k3_model_set_source. Calls are made in forward order: layer_get(L) before
 * layer L computes and layer_put(L) after; experts_get once per layer per
 * forward call with the union of the chunk's selected experts (ascending,
 * distinct), filling ex[i] for ids[i]; experts_put when done with them. */
typedef struct {
    void *ctx;
    int (*layer_get)(void *ctx, int layer, const k3_layer_w **w, k3_err *err);
    void (*layer_put)(void *ctx, int layer);
    int (*experts_get)(void *ctx, int layer, const int *ids, int n, k3_expert_w *ex, k3_err *err);
    void (*experts_put)(void *ctx, int layer, const int *ids, int n);
    /* Optional, the asynchronous form of experts_get, used by the decode MoE
     * when set: experts_start issues the reads for ids[0..n) (same
     * arguments as experts_get; ex[i] may be filled now but its bytes are only
     * valid once experts_next has returned i) and returns at once, so the
     * model computes what does not need them while they are read;
     * experts_next waits until one more expert's bytes are in and returns its
     * index into ids in *i: every index once, in any order (completion
     * order). The model writes each expert's output into its own slot and
     * sums them in the router's order afterwards, so the order never changes
     * a bit. After the n-th experts_next the batch is complete and
     * experts_put follows as after experts_get; after an error the source has
     * released the batch itself (no experts_put). */
    int (*experts_start)(void *ctx, int layer, const int *ids, int n, k3_expert_w *ex, k3_err *err);
    int (*experts_next)(void *ctx, int layer, int *i, k3_err *err);
    /* Optional (expert parallelism, dist/expert_par.h), both or neither: the
     * routed experts are spread over the ranks of a job. expert_owned says
     * whether this process computes expert e of a layer; the model fetches
     * (experts_get/start) and computes only the selected experts it owns,
     * then experts_combine fills the other rows of the chunk's expert
     * outputs from their owners: expert ids[u]'s rows are out[rows[u] ..
     * rows[u+1]) x width floats (u < n, ids ascending, the same on every
     * rank since every rank routes the same bits). The weighted sum then
     * runs in the router's slot order on every rank, exactly as in one
     * process, so the bits do not depend on the rank count. */
    bool (*expert_owned)(void *ctx, int layer, int e);
    int (*experts_combine)(void *ctx, int layer, const int *ids, const int *rows, int n, float *out, int width,
                           k3_err *err);
} k3_weight_source;
void k3_model_set_source(k3_model *m, const k3_weight_source *src); /* NULL: back to resident */
/* Layer L as bound at open (the resident table the default source serves);
 * NULL for a model opened top_only. */
const k3_layer_w *k3_model_layer(const k3_model *m, int layer);

/* Tensor lookup used by the binder: name is relative, in the released
 * spelling ("embed_tokens.weight", "lm_head.weight", "self_attn.q_proj.weight",
 * "block_sparse_moe.experts.3.w1.weight_packed", ...) with layer >= 0 for a
 * layer's tensors and -1 for model-level ones. Returns K3_OK and fills t, 1 when
 * the tensor does not exist, or an error code. data must stay valid while the
 * model lives; it need not be aligned (the binder copies when it is not). */
typedef enum { KT_F32 = 0, KT_F16, KT_BF16, KT_U8 } k3_tdtype;
typedef struct {
    k3_tdtype dtype;
    int rank;
    int64_t shape[4];
    const void *data;
    const char *where;           /* full name / file for messages */
} k3_tensor;
typedef int (*k3_lookup_fn)(void *ctx, int layer, const char *name, k3_tensor *t, k3_err *err);
/* (On "absent" the lookup still sets t->where to the full name it looked for.) */
/* Opens a model whose tensors come from fn under the config cfg, checked
 * exactly as at a directory open: e.g. the trainer's parameters in memory,
 * used in place (no export; an aligned f32 matrix is not copied). fn's data
 * must stay valid and unchanged while the model lives. */
int k3_model_open_lookup(const k3_config *cfg, k3_lookup_fn fn, void *ctx, const k3_model_opts *opts,
                         k3_model **out, k3_err *err);

/* The peer blob / peer fixture spelling of a relative released name: dots become
 * '_' and the MoE members take the reference module's names (gate -> mlp_gate,
 * routed_expert_down_proj -> mlp_down, shared_experts.gate_proj -> mlp_shared_w1,
 * experts.E.w1 -> mlp_experts_E_w1, ...). layer >= 0 prefixes "layers_L_" only
 * when with_layer_prefix. Returns false when buf is too small. */
bool k3_peer_name(int layer, bool with_layer_prefix, const char *name, char *buf, size_t n);

/* Binds layer L's tensors (checking every shape and dtype against cfg) into w;
 * allocations are recorded in *owned (free with k3_owned_free). */
typedef struct { void **ptrs; size_t n, cap; uint64_t bytes; } k3_owned;
int k3_bind_layer(const k3_config *cfg, int L, k3_lookup_fn fn, void *ctx, k3_layer_w *w,
                  k3_owned *owned, k3_err *err);
/* The same without the routed experts, for a weight source that serves them
 * (experts_get): their tensors are not looked up (N_e x 6 lookups, most of a
 * MoE layer's binding time) and moe.experts stays NULL. The source checks the
 * experts' shapes and dtypes itself. */
int k3_bind_layer_no_experts(const k3_config *cfg, int L, k3_lookup_fn fn, void *ctx, k3_layer_w *w,
                             k3_owned *owned, k3_err *err);
/* Binds the model-level tensors (embed_tokens, lm_head, norm, the output
 * AttnRes; layer -1 of the lookup) again from fn, checking them as at open,
 * e.g. from a packed trunk instead of the shards (one sequential read). fn's data must
 * outlive the model. The earlier tensors are no longer used. */
int k3_model_bind_top(k3_model *m, k3_lookup_fn fn, void *ctx, k3_err *err);
void k3_owned_free(k3_owned *o);
/* Records p (malloc'd, `bytes` long) in o and returns it. */
void *k3_own(k3_owned *o, void *p, uint64_t bytes);

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

typedef struct k3_mla_rec k3_mla_rec;

/* ---- the blocks as training runs them -------------------------------------
 * A block's forward math is written once, here in the model graph; `k3 train`
 * runs it on B sequences at once with a weight view onto its parameter arena
 * (k3_mat KW_F32 views) and a record of what its backward reads. What the two
 * callers fix differently is only how some steps are rounded, named here: */
typedef struct {
    /* Y = X W^T for each job (independent jobs): the canonical dots of
     * k_products (inference) or the training GEMM's one fma chain per element
     * (src/train/tops.c t_products) */
    void (*products)(const k_prod *jobs, int njobs);
    /* training's rounding of two elementwise steps: SiLU as x * sigmoid(x)
     * (inference: x / (1 + e^-x)) and the KDA q/k L2 norm as a times-1/norm
     * on a plain sum of squares (inference: a division by the norm of a
     * dot). The same functions; the bits each side's contract fixed. */
    bool train_rounding;
    /* MLA's expanded attention core on a record (training's BF16 mode runs it
     * as GEMMs); NULL: k3_mla_attend_expanded */
    void (*mla_attend)(const k3_config *c, k3_mla_rec *r, int nseq, int T);
    /* LatentMoE's routed-expert products (many similar jobs): NULL runs them
     * with products; training's run side by side, one thread each */
    void (*expert_products)(const k_prod *jobs, int njobs);
    /* products is a collective of every rank of a job (the trunk split over
     * the ranks, dist/tensor_par.h): each call costs a round of messages, so
     * the blocks batch the jobs they can into one call */
    bool collective;
    /* a small product every rank of a collective computes whole instead of
     * its rows and a gather (KDA's f_b: a few MB, where a gather's round of
     * messages costs more than reading them): the canonical bits of one
     * process, locally; NULL runs it with products */
    void (*whole_products)(const k_prod *jobs, int njobs);
} k3_fwd_ops;
extern const k3_fwd_ops k3_infer_ops; /* what k3 run uses */
/* The products a model's forward takes its trunk matrices (and the head)
 * through: k3_infer_ops unless set (NULL: back to it). ops must outlive the
 * model; its products must give k_products' bits (model.h's contract). */
void k3_model_set_ops(k3_model *m, const k3_fwd_ops *ops);

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
 * the scores, one fma chain per output over the positions). */
void k3_mla_attend_expanded(const k3_config *c, k3_mla_rec *r, int nseq, int T);
/* The expanded core's causal softmax of one row of T scores (already scaled,
 * mx their maximum over 0..t): positions 0..t normalised, the rest zero. */
void k3_causal_softmax_row(float *pr, int t, int T, float mx);

/* The KDA block on nseq sequences of T positions, each from a zero state
 * (x, y: [nseq*T][E]); chunk 0 the recurrent form, > 0 the chunkwise one. */
void k3_kda_rec_forward(const k3_config *c, const k3_kda_w *w, const k3_fwd_ops *fo, int chunk, const float *x,
                        int nseq, int T, float *y, k3_kda_rec *rec);
void k3_mla(const k3_config *c, float latent_eps, const k3_mla_w *w, k3_mla_cache *cache, int pos0,
            const float *x, int T, float *y);
/* experts: [N_e] bound experts (any selection may be used). */
void k3_moe(const k3_config *c, const k3_moe_w *w, const k3_expert_w *experts, const float *x, int T,
            float *y);
void k3_mlp(const k3_config *c, const k3_mlp_w *w, const float *x, int T, float *y);
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

/* One decoder layer (section 6) on T positions. buf[0..*nb) hold the completed
 * block vectors and buf[*nb] the running partial sum, each [T][E]; at a block
 * boundary (L % attn_res_block_size == 0) the partial becomes block *nb, *nb
 * grows by one and the new partial is written to buf[*nb] (so buf needs one
 * spare entry). ks / mc: the layer's KDA state or MLA cache (the other unused). */
int k3_layer(const k3_config *c, float mla_eps, const k3_layer_w *w, int L, k3_kda_state *ks, k3_mla_cache *mc,
             int pos0, float **buf, int *nb, int T, k3_err *err);

#endif
