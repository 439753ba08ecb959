#!/usr/bin/env python3
"""Writes the training configs under configs/ in the RELEASED nested key names
(text_config, text_config.linear_attn_config; no quantization_config: training
keeps every weight in f32, export decides the stored dtypes).

Run from the repo root: /usr/bin/python3 tools/smol_configs.py
The outputs are committed; this script documents where the numbers come from."""
import json, os, sys


def config(hidden, layers, vocab, mla_layers, kda_heads, kda_dim, mla_heads, q_lora, kv_lora,
           nope, rope, v, experts, topk, shared, latent, inter, block, dense=0, dense_inter=None):
    full = sorted(mla_layers)
    kda = [i for i in range(1, layers + 1) if i not in full]
    tc = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-05,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": block,
        "linear_attn_config": {
            "full_attn_layers": full,
            "kda_layers": kda,
            "gate_lower_bound": -5.0,
            "head_dim": kda_dim,
            "num_heads": kda_heads,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_attention_heads": mla_heads,
        "num_key_value_heads": mla_heads,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "num_experts": experts,
        "num_experts_per_token": topk,
        "num_shared_experts": shared,
        "routed_expert_hidden_size": latent,
        "moe_intermediate_size": inter,
        "intermediate_size": dense_inter if dense_inter is not None else shared * inter,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "dtype": "float32",
        "tie_word_embeddings": False,
        "text_config": tc,
    }


CONFIGS = {
    # issue 5 item 2: the ~49M miniature (strict released layout: 49,018,061)
    "smol-50m": config(hidden=320, layers=13, vocab=8192, mla_layers=[4, 8, 12, 13],
                       kda_heads=5, kda_dim=64, mla_heads=5, q_lora=96, kv_lora=64,
                       nope=64, rope=0, v=64, experts=32, topk=4, shared=2,
                       latent=160, inter=160, block=4),
    "smol-5m": config(hidden=128, layers=13, vocab=2048, mla_layers=[4, 8, 12, 13],
                      kda_heads=2, kda_dim=64, mla_heads=2, q_lora=48, kv_lora=32,
                      nope=64, rope=0, v=64, experts=16, topk=4, shared=2,
                      latent=64, inter=64, block=4),
    # CI: trains 200 steps in seconds; vocab 1024 = 768 BPE ranks + the 256
    # special ids k3 prepare reserves; widths stay multiples of 32 so that the
    # routed experts export to MXFP4 (group 32 along each input dimension).
    "tiny-train": config(hidden=64, layers=5, vocab=1024, mla_layers=[4, 5],
                         kda_heads=2, kda_dim=32, mla_heads=2, q_lora=32, kv_lora=16,
                         nope=32, rope=0, v=32, experts=8, topk=2, shared=1,
                         latent=32, inter=32, block=2),
}

# The gradient fixture's config: every code path on (a dense layer 0, a rope
# slot, odd sizes), small enough for a float64 autograd reference.
GRAD = config(hidden=16, layers=5, vocab=37, mla_layers=[4, 5], kda_heads=2, kda_dim=8,
              mla_heads=2, q_lora=12, kv_lora=8, nope=8, rope=4, v=6, experts=6, topk=2,
              shared=1, latent=8, inter=10, block=2, dense=1, dense_inter=24)

if __name__ == "__main__":
    os.makedirs("configs", exist_ok=True)
    for name, c in CONFIGS.items():
        with open(f"configs/{name}.json", "w") as f:
            json.dump(c, f, indent=2)
            f.write("\n")
    os.makedirs("tests/fixtures/train", exist_ok=True)
    with open("tests/fixtures/train/grad-config.json", "w") as f:
        json.dump(GRAD, f, indent=2)
        f.write("\n")
    print("wrote", ", ".join(CONFIGS), "and tests/fixtures/train/grad-config.json", file=sys.stderr)
