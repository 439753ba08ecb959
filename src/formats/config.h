/* config.h: the strict K3 config reader.
 *
 * Reads both the released nested shape (text_config, text_config.linear_attn_config,
 * text_config.quantization_config) and the flat fixture shape, with both
 * spellings of every key (k3-checkpoint-format.md section 2.2). KDA keys are
 * looked up in linear_attn_config first, then text_config, then the root
 * (flat spellings kda_num_heads / kda_head_dim). A missing or wrongly-typed
 * required key is an error listing EVERY such key at once. Optional keys and
 * the defaults they take are listed in config.c and reported by k3 inspect. */
#ifndef K3_FORMATS_CONFIG_H
#define K3_FORMATS_CONFIG_H

#include "util/common.h"

#define K3_MAX_LAYERS 4096
/* Bounds on config integers (the released K3's largest is 163,840) and on
 * what they derive: one projection's row count at most K3_MAX_DIM, one
 * matrix at most K3_MAX_MATRIX elements (the release's largest, the
 * embedding, has 1.17e9), so that no size computed from them wraps. Larger
 * values are refused (exit 2) with "too large". */
#define K3_MAX_DIM 16777216
#define K3_MAX_MATRIX 2147483647LL

typedef struct {
    /* trunk */
    int hidden_size;          /* E */
    int num_layers;           /* L */
    int vocab_size;           /* V */
    float rms_eps;            /* every RMSNorm except MLA latent norms */
    float mla_latent_eps;     /* q_a/kv_a_layernorm: fixed 1e-6 (spec section 9) */
    /* KDA */
    int kda_heads, kda_head_dim, conv_kernel;
    float gate_lower_bound;
    /* MLA */
    int mla_heads, q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    bool mla_output_gate;
    /* MoE */
    int num_experts, experts_per_token, num_shared_experts;
    int latent_dim;           /* routed_expert_hidden_size */
    int moe_inter;            /* moe_intermediate_size */
    int dense_inter;          /* intermediate_size (dense layers); 0 if no dense layer */
    float routed_scaling_factor;
    bool moe_renormalize, latent_moe_use_norm;
    int first_k_dense_replace, moe_layer_freq;
    /* AttnRes, SiTU */
    int attn_res_block_size;
    float situ_beta, situ_linear_beta;
    /* quantisation of routed experts (from quantization_config when present) */
    bool experts_mxfp4_declared;
    int mxfp4_group;          /* 32 */
    /* token ids (-1 when absent) */
    int bos_token_id, eos_token_id, pad_token_id;
    /* derived layer map, zero-based */
    char layer_kind[K3_MAX_LAYERS];   /* 'K' (KDA) or 'M' (MLA) */
    bool layer_dense[K3_MAX_LAYERS];  /* dense MLP instead of LatentMoE */
    int n_kda_layers, n_mla_layers;
    /* which optional keys took their default (comma-separated, for reports) */
    char defaults_used[512];
} k3_config;

/* Parse path (a config.json, or a model directory holding one). */
int k3_config_load(const char *path, k3_config *cfg, k3_err *err);
/* Parse from a JSON text (name is used in messages). */
int k3_config_parse(const char *json_text, const char *name, k3_config *cfg, k3_err *err);
/* cfg as a run of its first `layers` layers sees it (--layers; 0 or the
 * whole count: unchanged): num_layers and the KDA/MLA counts cut down, the
 * layer maps kept. More layers than the model has is K3_EXIT_USAGE naming
 * dir. */
int k3_config_first_layers(k3_config *cfg, int layers, const char *dir, k3_err *err);
/* "KKKMKKKM..." into buf (L+1 bytes). */
void k3_config_layer_map(const k3_config *cfg, char *buf, size_t n);

/* Added by the formats work (additive): where config meets checkpoint. Checks
 * that the embedding and lm_head are [vocab_size, hidden_size] (released names
 * language_model.model.embed_tokens.weight / language_model.lm_head.weight, or
 * the same without the language_model. prefix) and, when the checkpoint holds
 * packed MXFP4 experts (U8 *.experts.*.weight_packed), that both expert dims
 * divide by the MXFP4 group. K3_EXIT_DATA on mismatch. */
typedef struct st_index st_index;
int k3_config_check_index(const k3_config *cfg, const st_index *ix, k3_err *err);
/* The prefix a checkpoint's model tensors live under (formats/names.h):
 * K3N_PREFIX, or K3N_PREFIX_PLAIN when only the plain spelling of the
 * embedding is there. The one probe: the binder and streaming both use it. */
const char *k3_names_prefix(const st_index *ix);
/* The head's full name under that prefix: K3N_HEAD_FULL beside the released
 * model, K3N_HEAD beside the plain one. */
const char *k3_names_head(const char *prefix);

#endif
