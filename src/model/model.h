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
 * Everything is computed in f32; BF16 weights stay BF16 in memory.
 *
 * This header is for users of a model (open, state, forward, sampling). What
 * plugs into the model from outside (weight sources, the tensor lookup and
 * binder, the products a forward runs on) is model/source.h; the blocks one at
 * a time and training's forward with records are model/records.h. */
#ifndef K3_MODEL_H
#define K3_MODEL_H

#include "formats/config.h"
#include "util/common.h"

typedef struct k3_model k3_model;
typedef struct k3_state k3_state;
/* Where a model's weights come from (a streaming source, expert parallelism):
 * model/source.h; only a pointer here. */
typedef struct k3_weight_source k3_weight_source;

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
 * (opts->layers, if any, applies here; the engine passes a cfg already cut
 * and no opts->layers) and ix as st_open gave it (the
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

#endif
