/* names.h: the released tensor names (k3-checkpoint-format.md section 3), in
 * one table for every module that reads or writes them: the binder
 * (model/weights.c), the trainer's parameter table (train/train.c), export,
 * inspect and streaming.
 *
 * Layout: the model-level tensors and the layers live under K3N_PREFIX
 * ("language_model.model.", or the plain "model." spelling some exports
 * use), layer L's tensors under PREFIX "layers.L."; the head sits beside the
 * model, at K3N_HEAD_FULL. The names below are relative to those prefixes,
 * as model/source.h's lookup receives them. Each is a string literal, so they
 * concatenate with other literals (K3N_PREFIX K3N_EMBED). */
#ifndef K3_FORMATS_NAMES_H
#define K3_FORMATS_NAMES_H

#define K3N_PREFIX "language_model.model."
#define K3N_PREFIX_PLAIN "model."
#define K3N_HEAD_PARENT "language_model."   /* the head is K3N_HEAD_PARENT K3N_HEAD */
#define K3N_HEAD_FULL K3N_HEAD_PARENT K3N_HEAD

/* model-level */
#define K3N_EMBED "embed_tokens.weight"
#define K3N_HEAD "lm_head.weight"
#define K3N_NORM "norm.weight"
#define K3N_OUT_RES_NORM "output_attn_res_norm.weight"
#define K3N_OUT_RES_PROJ "output_attn_res_proj.weight"

/* every layer: norms and the Block AttnRes pseudo-queries (a [1][E] proj) */
#define K3N_IN_NORM "input_layernorm.weight"
#define K3N_POST_NORM "post_attention_layernorm.weight"
#define K3N_ATTN_RES_NORM "self_attention_res_norm.weight"
#define K3N_ATTN_RES_PROJ "self_attention_res_proj.weight"
#define K3N_MLP_RES_NORM "mlp_res_norm.weight"
#define K3N_MLP_RES_PROJ "mlp_res_proj.weight"

/* attention (KDA and MLA share the self_attn. prefix, q_proj, g_proj and o_proj) */
#define K3N_ATTN "self_attn."
#define K3N_Q_PROJ K3N_ATTN "q_proj.weight"      /* KDA q; MLA's query when q_lora_rank is 0 */
#define K3N_K_PROJ K3N_ATTN "k_proj.weight"
#define K3N_V_PROJ K3N_ATTN "v_proj.weight"
#define K3N_Q_CONV K3N_ATTN "q_conv1d.weight"
#define K3N_K_CONV K3N_ATTN "k_conv1d.weight"
#define K3N_V_CONV K3N_ATTN "v_conv1d.weight"
#define K3N_F_A K3N_ATTN "f_a_proj.weight"
#define K3N_F_B K3N_ATTN "f_b_proj.weight"
#define K3N_A_LOG K3N_ATTN "A_log"
#define K3N_DT_BIAS K3N_ATTN "dt_bias"
#define K3N_B_PROJ K3N_ATTN "b_proj.weight"
#define K3N_G_PROJ K3N_ATTN "g_proj.weight"      /* KDA gate; MLA output gate */
#define K3N_O_NORM K3N_ATTN "o_norm.weight"
#define K3N_O_PROJ K3N_ATTN "o_proj.weight"
#define K3N_Q_A K3N_ATTN "q_a_proj.weight"
#define K3N_Q_A_NORM K3N_ATTN "q_a_layernorm.weight"
#define K3N_Q_B K3N_ATTN "q_b_proj.weight"
#define K3N_KV_A K3N_ATTN "kv_a_proj_with_mqa.weight"
#define K3N_KV_A_NORM K3N_ATTN "kv_a_layernorm.weight"
#define K3N_KV_B K3N_ATTN "kv_b_proj.weight"

/* SiTU-GLU MLPs: PREFIX ".gate_proj.weight" etc. (dense layers and the fused
 * shared experts) */
#define K3N_MLP "mlp"
#define K3N_GATE_PROJ ".gate_proj.weight"
#define K3N_UP_PROJ ".up_proj.weight"
#define K3N_DOWN_PROJ ".down_proj.weight"

/* LatentMoE */
#define K3N_MOE "block_sparse_moe."
#define K3N_ROUTER K3N_MOE "gate.weight"
#define K3N_ROUTER_BIAS K3N_MOE "gate.e_score_correction_bias"
#define K3N_LAT_DOWN K3N_MOE "routed_expert_down_proj.weight"
#define K3N_LAT_UP K3N_MOE "routed_expert_up_proj.weight"
#define K3N_LAT_NORM K3N_MOE "routed_expert_norm.weight"
#define K3N_SHARED K3N_MOE "shared_experts"
/* routed expert e, matrix j (1 gate, 3 up, 2 down): printf format of its base
 * name, then ".weight" (float) or ".weight_packed" + ".weight_scale" (MXFP4) */
#define K3N_EXPERTS K3N_MOE "experts."
#define K3N_EXPERT_FMT K3N_EXPERTS "%d.w%d"
#define K3N_WEIGHT ".weight"
#define K3N_PACKED ".weight_packed"
#define K3N_SCALE ".weight_scale"

#endif
