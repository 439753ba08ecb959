/* model/source.h: what plugs into the model from outside: where its weights
 * come from and how its products are computed. For the memory module's
 * streaming source, the expert and tensor parallelism of src/dist, the
 * trainer's parameters bound in place, and the engine that sets them on a
 * model; users of a model need only model/model.h.
 *
 * Invariants:
 * - The bound weight views (k3_layer_w and below) are made only by the binder
 *   (k3_bind_layer*, k3_model_open_lookup, k3_model_bind_top), from a tensor
 *   lookup checked against the config exactly as at a directory open.
 * - A weight source changes where bytes come from, never the bits: the model
 *   calls it in forward order and sums experts in the router's order whatever
 *   order they arrive in or whichever rank computed them.
 * - A k3_fwd_ops's products give k_products' bits (model.h's arithmetic
 *   contract); only training's ops (train_rounding, its own products) differ,
 *   and only for training's forward.
 * - Tensor data handed to the binder outlives the model. */
#ifndef K3_MODEL_SOURCE_H
#define K3_MODEL_SOURCE_H

#include "kernels/kernels.h"
#include "model/model.h"
#include "util/common.h"

/* ---- bound weights ------------------------------------------------------- */

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
struct k3_weight_source {
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
};
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

typedef struct k3_mla_rec k3_mla_rec; /* model/records.h */

/* ---- the products a forward runs on --------------------------------------
 * A block's forward math is written once, in the model graph (the blocks and
 * their records: model/records.h); `k3 train`
 * runs it on B sequences at once with a weight view onto its parameter arena
 * (k3_mat KW_F32 views) and a record of what its backward reads. What the two
 * callers fix differently is only how some steps are rounded, named here: */
typedef struct {
    /* Y = X W^T for each job (independent jobs): the canonical dots of
     * k_products (inference) or the training GEMM's one fma chain per element
     * (src/train/tops.c t_fwd_ops) */
    void (*products)(const k_prod *jobs, int njobs);
    /* training's rounding of two elementwise steps: SiLU as x * sigmoid(x)
     * (inference: x / (1 + e^-x)) and the KDA q/k L2 norm as a times-1/norm
     * on a plain sum of squares (inference: a division by the norm of a
     * dot). The same functions; the bits each side's contract fixed. */
    bool train_rounding;
    /* MLA's expanded attention core runs its two products as BF16 GEMMs
     * (training's BF16 mode; k3_mla_attend_expanded) */
    bool mla_bf16;
    /* LatentMoE's routed-expert products (many similar jobs): NULL runs them
     * with products; training's run side by side, one thread each */
    void (*expert_products)(const k_prod *jobs, int njobs);
    /* products is a collective of every rank of a job (the trunk split over
     * the ranks, dist/tensor_par.h): each call costs a round of messages, so
     * the blocks batch the jobs they can into one call */
    bool collective;
    /* the routed experts' products are that collective too (each rank holds
     * and computes only its rows of every expert's matrices): the decode
     * path that computes each expert as it arrives is not taken */
    bool experts_split;
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

#endif
