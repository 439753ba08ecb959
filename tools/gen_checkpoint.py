#!/usr/bin/python3
"""gen_checkpoint.py: write a random Kimi K3-architecture checkpoint in the released layout.

For any config: nested config.json (text_config, linear_attn_config and, for
MXFP4 experts, quantization_config) or the flat fixture shape; one safetensors
shard per layer (or --layers-per-shard) plus a last shard with the embedding,
lm_head, final norm and output AttnRes, named like the release
(`model-00001-of-000012.safetensors`, six-digit total); model.safetensors.index.json;
routed experts as MXFP4 (weight_packed + weight_scale, U8; low nibble = even
element; E8M0 scale per group of 32) or unquantised; BF16 trunk with the small
tensors the release keeps in F32 (ShortConv weights, A_log, dt_bias, o_norm,
router bias) stored F32; A_log stored with head_dim entries and a zero tail.

Deterministic: every tensor is drawn from its own generator seeded by
(--seed, tensor name), so a tensor's values do not depend on the others or on
the order of writing. Weight scales keep activations well-conditioned (see
init_std below). Generation is numpy-vectorised: about 10-20 s per GB.

  gen_checkpoint.py OUT --preset tiny
  gen_checkpoint.py OUT --preset mid                          (~0.6 GB, hidden 1280, 11 layers,
                                                               96 MXFP4 experts, top-8)
  gen_checkpoint.py OUT --preset mid --target-bytes 2e9       (grows num_experts to ~2 GB)
  gen_checkpoint.py OUT --preset tiny --set num_experts=16 --set attn_res_block_size=2
  gen_checkpoint.py OUT --config-json spec.json               (a flat dict of the keys below)
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import tempfile

import numpy as np

# Keys of a model spec use the released text_config spelling, plus `layer_map`
# ("KKKM...", zero-based, K = KDA, M = MLA) and the KDA keys num_heads / head_dim /
# short_conv_kernel_size / gate_lower_bound that go to linear_attn_config.
PRESETS = {
    # the peer's tiny architecture (shared/fixtures/peer/tiny-checkpoint)
    "tiny": dict(
        hidden_size=128, num_hidden_layers=13, vocab_size=256, rms_norm_eps=1e-5,
        num_heads=4, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        layer_map="KKKMKKKMKKKMM",
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=16, mla_use_output_gate=True,
        num_experts=8, num_experts_per_token=2, num_shared_experts=2,
        routed_expert_hidden_size=64, moe_intermediate_size=64, intermediate_size=96,
        routed_scaling_factor=1.0, moe_renormalize=True, latent_moe_use_norm=True,
        first_k_dense_replace=1, moe_layer_freq=1, attn_res_block_size=3,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ"),
    # a mid-sized K3, the shape the decode, prefill and streaming benchmarks run:
    # hidden 1280, 11 layers, 96 MXFP4 experts, top-8 (627 MB)
    "mid": dict(
        hidden_size=1280, num_hidden_layers=11, vocab_size=32000, rms_norm_eps=1e-5,
        num_heads=10, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        layer_map="KKKMKKKMKKM",
        num_attention_heads=10, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
        num_experts=96, num_experts_per_token=8, num_shared_experts=2,
        routed_expert_hidden_size=512, moe_intermediate_size=256, intermediate_size=3072,
        routed_scaling_factor=1.0, moe_renormalize=True, latent_moe_use_norm=True,
        first_k_dense_replace=1, moe_layer_freq=1, attn_res_block_size=4,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ"),
    # the released Kimi K3's exact dimensions (../shared/fixtures/k3-release/config.json,
    # checked against it by --preset release-dims when that file is present); use with
    # --layers N (the release's first N layers, the last one MLA) and fewer routed experts
    "release-dims": dict(
        hidden_size=7168, num_hidden_layers=93, vocab_size=163840, rms_norm_eps=1e-5,
        num_heads=96, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
        layer_map=None,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_output_gate=True,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        routed_expert_hidden_size=3584, moe_intermediate_size=3072, intermediate_size=33792,
        routed_scaling_factor=1.0, moe_renormalize=True, latent_moe_use_norm=True,
        first_k_dense_replace=1, moe_layer_freq=1, attn_res_block_size=12,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ"),
}
# the released layer pattern: MLA at 1-based layers 4, 8, ..., 92 and 93 (the last)
PRESETS["release-dims"]["layer_map"] = "".join(
    "M" if (l + 1) % 4 == 0 or l == 92 else "K" for l in range(93))
RELEASE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                              "fixtures", "k3-release", "config.json")


def check_release_dims(spec, path=RELEASE_CONFIG):
    """Compare the embedded release-dims numbers with the released config when it is
    present; returns the number of keys compared (0 without the file)."""
    if not os.path.exists(path):
        return 0
    root = json.load(open(path))
    tc = root.get("text_config", root)
    lac = tc.get("linear_attn_config", {})
    n = 0
    for k, v in spec.items():
        if k == "layer_map":
            full = set(lac["full_attn_layers"])
            want = "".join("M" if l + 1 in full else "K" for l in range(tc["num_hidden_layers"]))
        elif k in lac and k not in tc:
            want = lac[k]
        elif k in tc:
            want = tc[k]
        else:
            raise GenError(f"release-dims: {k} not in {path}")
        if want != v:
            raise GenError(f"release-dims: {k} is {v!r} here, {want!r} in {path}")
        n += 1
    return n


KIMI_VOCAB = 163840          # the Kimi tokenizer's ids fit only a vocabulary this large
PREFIX = "language_model.model."


class GenError(Exception):
    pass


# ---------------------------------------------------------------------------
# config

def layer_kinds(spec):
    lm = spec.get("layer_map")
    L = spec["num_hidden_layers"]
    if lm is None:
        full = spec.get("full_attn_layers")
        if full is None:
            raise GenError("spec needs layer_map or full_attn_layers")
        lm = "".join("M" if l + 1 in full else "K" for l in range(L))
    if len(lm) != L or set(lm) - {"K", "M"}:
        raise GenError(f"layer_map {lm!r} must be {L} letters K/M")
    return lm


def is_dense(spec, l):
    return l < spec.get("first_k_dense_replace", 0) or l % spec.get("moe_layer_freq", 1) != 0


def has_moe_layer(spec):
    return any(not is_dense(spec, l) for l in range(spec["num_hidden_layers"]))


def config_json(spec, opts):
    """The config.json dict: released nested shape, or the flat fixture shape."""
    lm = layer_kinds(spec)
    full = [l + 1 for l, k in enumerate(lm) if k == "M"]
    kda = [l + 1 for l, k in enumerate(lm) if k == "K"]
    text_keys = ["hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps",
                 "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "mla_use_output_gate", "num_experts",
                 "num_experts_per_token", "num_shared_experts", "routed_expert_hidden_size",
                 "moe_intermediate_size", "intermediate_size", "routed_scaling_factor",
                 "moe_renormalize", "latent_moe_use_norm", "first_k_dense_replace",
                 "moe_layer_freq", "attn_res_block_size", "activation_situ_beta",
                 "activation_situ_linear_beta", "hidden_act"]
    tc = {k: spec[k] for k in text_keys if k in spec}
    tc.update(num_key_value_heads=spec["num_attention_heads"], mla_use_nope=True,
              moe_router_activation_func="sigmoid", num_expert_group=1, topk_group=1,
              use_grouped_topk=True, topk_method="noaux_tc", num_nextn_predict_layers=0,
              tie_word_embeddings=False, model_type="kimi_linear",
              architectures=["KimiLinearForCausalLM"], dtype="bfloat16")
    ids = {}
    if opts.tokenizer:
        ids = dict(bos_token_id=163584, eos_token_id=163586, pad_token_id=spec["vocab_size"] - 1)
    tc.update(ids)
    lac = dict(full_attn_layers=full, kda_layers=kda, gate_lower_bound=spec["gate_lower_bound"],
               head_dim=spec["head_dim"], num_heads=spec["num_heads"],
               short_conv_kernel_size=spec["short_conv_kernel_size"], use_full_rank_gate=True)
    if opts.flat_config:
        flat = {k: v for k, v in tc.items() if k in text_keys or k in ids}
        flat.pop("activation_situ_beta", None)
        flat.pop("activation_situ_linear_beta", None)
        flat.update(kda_num_heads=spec["num_heads"], kda_head_dim=spec["head_dim"],
                    short_conv_kernel_size=spec["short_conv_kernel_size"],
                    gate_lower_bound=spec["gate_lower_bound"], full_attn_layers=full,
                    kda_layers=kda, situ_beta=spec["activation_situ_beta"],
                    situ_linear_beta=spec["activation_situ_linear_beta"],
                    tie_word_embeddings=False)
        return flat
    tc["linear_attn_config"] = lac
    if opts.experts == "mxfp4" and has_moe_layer(spec):
        tc["quantization_config"] = {
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "input_activations": None,
                "output_activations": None, "targets": ["Linear"],
                "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                            "group_size": 32, "num_bits": 4, "observer": "minmax",
                            "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                            "strategy": "group", "symmetric": True, "type": "float",
                            "zp_dtype": None}}},
            "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}
    root = dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
                dtype="bfloat16", tie_word_embeddings=False, text_config=tc)
    root.update(ids)
    return root


def check_spec(spec):
    need = list(PRESETS["tiny"].keys())
    miss = [k for k in need if k not in spec]
    if miss:
        raise GenError("spec lacks " + ", ".join(miss))
    if spec["num_experts_per_token"] > spec["num_experts"]:
        raise GenError("num_experts_per_token > num_experts")
    lat, I = spec["routed_expert_hidden_size"], spec["moe_intermediate_size"]
    if lat % 32 or I % 32:
        raise GenError("MXFP4 needs routed_expert_hidden_size and moe_intermediate_size "
                       "to be multiples of 32")
    layer_kinds(spec)


# ---------------------------------------------------------------------------
# tensor plan: (name, dtype, shape, init) per shard, in file order

QK_CORR = 0.8


def init_std(kind, fan_in):
    """Per-kind scale. Inputs of every projection are RMSNormed (rms ~1), so
    std = gain/sqrt(fan_in) keeps each output at rms ~gain. Gains > 1 on gates and
    the router spread sigmoid/SiTU inputs over their non-linear range; the lm_head
    gain gives logits of std ~2 so greedy margins are rarely tiny."""
    gains = {"lin": 1.0, "gate": 1.5, "router": 2.0, "head": 2.0, "expert_in": 1.5,
             "out": 1.0, "conv": 1.0}
    return gains[kind] / math.sqrt(fan_in)


def plan(spec, opts):
    E, V, L = spec["hidden_size"], spec["vocab_size"], spec["num_hidden_layers"]
    H, D, K = spec["num_heads"], spec["head_dim"], spec["short_conv_kernel_size"]
    P = H * D
    Hm, rq, rkv = spec["num_attention_heads"], spec["q_lora_rank"], spec["kv_lora_rank"]
    dn, dr, dv = spec["qk_nope_head_dim"], spec["qk_rope_head_dim"], spec["v_head_dim"]
    Ne, Ns = spec["num_experts"], spec["num_shared_experts"]
    lat, I, Id = spec["routed_expert_hidden_size"], spec["moe_intermediate_size"], spec["intermediate_size"]
    kinds = layer_kinds(spec)
    fdt = {"bf16": "BF16", "f16": "F16", "f32": "F32"}[opts.trunk_dtype]
    # The release stores these small tensors F32 (spec section 3); with --trunk-dtype
    # f16/f32 everything non-expert takes that dtype.
    small = "F32" if fdt == "BF16" else fdt

    gains = getattr(opts, "gains", None) or {}

    def lin(name, o, i, kind="lin"):
        g = next((v for k, v in gains.items() if name.endswith(k)), 1.0)
        return (name, fdt, [o, i], ("normal", g * init_std(kind, i)))

    def gain(name, n, dt=None):
        return (name, dt or fdt, [n], ("gain",))

    layers = []
    for l in range(L):
        p = f"{PREFIX}layers.{l}."
        t = [gain(p + "input_layernorm.weight", E), gain(p + "post_attention_layernorm.weight", E),
             gain(p + "self_attention_res_norm.weight", E),
             (p + "self_attention_res_proj.weight", fdt, [1, E], ("normal", 1.5 / math.sqrt(E))),
             gain(p + "mlp_res_norm.weight", E),
             (p + "mlp_res_proj.weight", fdt, [1, E], ("normal", 1.5 / math.sqrt(E)))]
        a = p + "self_attn."
        if kinds[l] == "K":
            # k is drawn correlated with q (projection and conv taps; correlation
            # QK_CORR) so q_t.k_s is not a sum of random signs: with independent q and k
            # the read-out o = S^T q is a heavy cancellation and amplifies fp32 rounding
            # ~30x per KDA layer, which makes fp32-vs-fp64 fixtures fragile.
            t += [lin(a + "q_proj.weight", P, E), lin(a + "v_proj.weight", P, E),
                  (a + "k_proj.weight", fdt, [P, E],
                   ("corr", a + "q_proj.weight", init_std("lin", E), QK_CORR))]
            t += [(a + f"{c}_conv1d.weight", small, [P, 1, K], ("normal", init_std("conv", K)))
                  for c in "qv"]
            t += [(a + "k_conv1d.weight", small, [P, 1, K],
                   ("corr", a + "q_conv1d.weight", init_std("conv", K), QK_CORR))]
            t += [lin(a + "f_a_proj.weight", D, E), lin(a + "f_b_proj.weight", P, D),
                  (a + "A_log", small, [D], ("alog", H)),
                  (a + "dt_bias", small, [P], ("normal", 0.5)),
                  lin(a + "b_proj.weight", H, E, "gate"), lin(a + "g_proj.weight", P, E, "gate"),
                  gain(a + "o_norm.weight", D, small), lin(a + "o_proj.weight", E, P, "out")]
        else:
            t += [lin(a + "q_a_proj.weight", rq, E), gain(a + "q_a_layernorm.weight", rq),
                  lin(a + "q_b_proj.weight", Hm * (dn + dr), rq),
                  lin(a + "kv_a_proj_with_mqa.weight", rkv + dr, E),
                  gain(a + "kv_a_layernorm.weight", rkv),
                  lin(a + "kv_b_proj.weight", Hm * (dn + dv), rkv),
                  lin(a + "o_proj.weight", E, Hm * dv, "out")]
            if spec["mla_use_output_gate"]:
                t.append(lin(a + "g_proj.weight", Hm * dv, E, "gate"))
        ex = []
        if is_dense(spec, l):
            m = p + "mlp."
            t += [lin(m + "gate_proj.weight", Id, E, "expert_in"),
                  lin(m + "up_proj.weight", Id, E, "expert_in"),
                  lin(m + "down_proj.weight", E, Id, "out")]
        else:
            m = p + "block_sparse_moe."
            t += [lin(m + "gate.weight", Ne, E, "router"),
                  (m + "gate.e_score_correction_bias", small, [Ne], ("normal", 0.1)),
                  lin(m + "routed_expert_down_proj.weight", lat, E),
                  lin(m + "routed_expert_up_proj.weight", E, lat, "out")]
            if spec["latent_moe_use_norm"]:
                t.append(gain(m + "routed_expert_norm.weight", lat))
            if Ns > 0:
                s = m + "shared_experts."
                t += [lin(s + "gate_proj.weight", Ns * I, E, "expert_in"),
                      lin(s + "up_proj.weight", Ns * I, E, "expert_in"),
                      lin(s + "down_proj.weight", E, Ns * I, "out")]
            for e in range(Ne):
                for w, (r, c, kind) in (("w1", (I, lat, "expert_in")), ("w2", (lat, I, "out")),
                                        ("w3", (I, lat, "expert_in"))):
                    b = f"{m}experts.{e}.{w}"
                    std = init_std(kind, c)
                    if opts.experts == "mxfp4":
                        ex.append((b + ".weight_packed", "U8", [r, c // 2], ("mx_packed", b, std)))
                        ex.append((b + ".weight_scale", "U8", [r, c // 32], ("mx_scale", b, std)))
                    else:
                        ex.append((b + ".weight", fdt, [r, c], ("normal", std)))
        # one contiguous trunk run per layer, widest dtype first (keeps F32 aligned),
        # then each expert's six tensors as one run, like the release
        width = {"F32": 0, "BF16": 1, "F16": 1}
        t.sort(key=lambda x: (width[x[1]], x[0]))
        layers.append(t + ex)
    shards = [sum(layers[i:i + opts.layers_per_shard], [])
              for i in range(0, L, opts.layers_per_shard)]
    last = [gain(PREFIX + "norm.weight", E), gain(PREFIX + "output_attn_res_norm.weight", E),
            (PREFIX + "output_attn_res_proj.weight", fdt, [1, E], ("normal", 1.5 / math.sqrt(E))),
            (PREFIX + "embed_tokens.weight", fdt, [V, E], ("normal", 1.0)),
            ("language_model.lm_head.weight", fdt, [V, E], ("normal", init_std("head", E)))]
    shards.append(last)
    return shards


NBYTES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}


def tensor_bytes(t):
    return NBYTES[t[1]] * int(np.prod(t[2]))


def total_bytes(shards):
    return sum(tensor_bytes(t) for s in shards for t in s)


def touched_bytes(shards, spec):
    """Weight bytes one decoded token reads: every non-expert tensor except the
    embedding, one embedding row, and k of N_e routed experts per MoE layer."""
    tot = 0
    k, ne = spec["num_experts_per_token"], spec["num_experts"]
    for s in shards:
        for t in s:
            n = tensor_bytes(t)
            if t[0].endswith("embed_tokens.weight"):
                tot += n // spec["vocab_size"]
            elif ".experts." in t[0]:
                tot += n * k / ne
            else:
                tot += n
    return int(tot)


# ---------------------------------------------------------------------------
# values

def rng_for(seed, name):
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, h])


def to_bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")


def encode(a, dt):
    if dt == "BF16":
        return to_bf16(a).tobytes()
    if dt == "F16":
        return a.astype("<f2").tobytes()
    return a.astype("<f4").tobytes()


MX_THRESH = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)


def mx_quantize(w):
    """float32 [rows, cols] -> (packed [rows, cols/2] U8, scale [rows, cols/32] U8).
    Scale: the smallest power of two with max|group| / scale <= 6 (E2M1's largest
    magnitude), as E8M0 (bias 127); codes: nearest E2M1 magnitude (ties go to the
    smaller), sign in bit 3; element 2c in the low nibble of byte c."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 32, 32)
    amax = np.abs(g).max(2)
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int64)
    e = np.where(amax == 0, 0, np.clip(e, -127, 127))
    v = g * np.ldexp(np.float32(1), -e)[:, :, None].astype(np.float32)
    a = np.abs(v)
    code = np.zeros(v.shape, dtype=np.uint8)
    for th in MX_THRESH:
        code += a > th
    code |= (v < 0).astype(np.uint8) << 3
    code = code.reshape(rows, cols)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.astype(np.uint8), (e + 127).astype(np.uint8)


# Direct code sampler for large expert sets (quantising floats costs ~45 ns per
# element; this ~3): each nibble is drawn from the code distribution of a
# quantised N(0, 1.8^2) clipped to +-6, via a 16-bit lookup (one random byte per
# nibble); the per-group exponent is the one giving the target std, jittered by
# -1/0/+1 so groups differ as in real data.
_LUT16 = None
SAMPLE_SIGMA = 1.8


def _lut16():
    global _LUT16
    if _LUT16 is None:
        from math import erf, sqrt
        mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
        edges = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, float("inf")]
        cdf = lambda x: 0.5 * (1 + erf(x / (SAMPLE_SIGMA * sqrt(2))))
        probs, lo = [], 0.0
        for hi in edges:
            probs.append(2 * (cdf(hi) - cdf(lo)) if lo > 0 else 2 * (cdf(hi) - 0.5))
            lo = hi
        # 128 slots per sign, proportional to probability (at least one each)
        counts = np.maximum(1, np.round(np.array(probs) / sum(probs) * 128)).astype(int)
        counts[np.argmax(counts)] += 128 - counts.sum()
        q = np.repeat(np.arange(8, dtype=np.uint8), counts)
        q = np.concatenate([q, q | 8]).astype(np.uint16)             # 256 entries
        u = np.arange(65536, dtype=np.uint32)
        _LUT16 = (q[u & 255] | (q[u >> 8] << 4)).astype(np.uint8)
        rms = math.sqrt(sum(p * m * m for p, m in zip(np.array(probs) / sum(probs), mags)))
        _lut16.rms = rms
    return _LUT16


def mx_sample(rng, rows, cols, std):
    lut = _lut16()
    packed = lut[rng.integers(0, 65536, size=(rows, cols // 2), dtype=np.uint16)]
    base = int(round(math.log2(std / _lut16.rms)))
    jitter = rng.integers(-1, 2, size=(rows, cols // 32), dtype=np.int64)
    scale = np.clip(127 + base + jitter, 1, 254).astype(np.uint8)
    return packed, scale


BIG = 64 << 20          # elements; larger normal/corr tensors are drawn in chunks
CHUNK = 16 << 20


def value_chunks(t, seed, opts, mx_cache):
    """The tensor's bytes in pieces: tensors over BIG elements are drawn CHUNK elements
    at a time from the same generator(s), so no whole float32 copy of a 1.2 G-element
    head is ever held (smaller tensors, every existing preset's, are drawn as before)."""
    name, dt, shape, init = t
    n = int(np.prod(shape))
    if n <= BIG or init[0] not in ("normal", "corr"):
        yield values(t, seed, opts, mx_cache)
        return
    rng = rng_for(seed, name)
    other = rng_for(seed, init[1]) if init[0] == "corr" else None
    for lo in range(0, n, CHUNK):
        m = min(CHUNK, n - lo)
        if other is None:
            a = rng.standard_normal(m, dtype=np.float32) * np.float32(init[1])
        else:
            c = init[3]
            a = (np.float32(c) * other.standard_normal(m, dtype=np.float32) +
                 np.float32(math.sqrt(1 - c * c)) * rng.standard_normal(m, dtype=np.float32)) \
                * np.float32(init[2])
        yield encode(a, dt)


def values(t, seed, opts, mx_cache):
    name, dt, shape, init = t
    kind = init[0]
    if kind in ("mx_packed", "mx_scale"):
        base, std = init[1], init[2]
        if base not in mx_cache:
            mx_cache.clear()
            rng = rng_for(seed, base)
            rows = shape[0]
            cols = shape[1] * (2 if kind == "mx_packed" else 32)
            if opts.mx_method == "quantize":
                w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
                mx_cache[base] = mx_quantize(w)
            else:
                mx_cache[base] = mx_sample(rng, rows, cols, std)
        return mx_cache[base][0 if kind == "mx_packed" else 1].tobytes()
    rng = rng_for(seed, name)
    n = int(np.prod(shape))
    if kind == "normal":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(init[1])
    elif kind == "corr":                      # c * (the other tensor) + sqrt(1-c^2) * own
        other = rng_for(seed, init[1]).standard_normal(n, dtype=np.float32)
        c = init[3]
        a = (np.float32(c) * other + np.float32(math.sqrt(1 - c * c)) *
             rng.standard_normal(n, dtype=np.float32)) * np.float32(init[2])
    elif kind == "gain":
        a = rng.uniform(0.8, 1.2, n).astype(np.float32)
    elif kind == "alog":                      # per head; zero tail up to head_dim
        a = np.zeros(n, dtype=np.float32)
        a[:init[1]] = rng.uniform(-1.0, 1.0, init[1])
    else:
        raise GenError(f"unknown init {kind}")
    return encode(a, dt)


# ---------------------------------------------------------------------------
# writing

def write_shard(path, tensors, seed, opts, progress):
    hdr, off = {}, 0
    for t in tensors:
        n = tensor_bytes(t)
        hdr[t[0]] = {"dtype": t[1], "shape": t[2], "data_offsets": [off, off + n]}
        off += n
    hdr["__metadata__"] = {"format": "pt"}
    hj = json.dumps(hdr, separators=(",", ":")).encode()
    hj += b" " * ((8 - (8 + len(hj)) % 8) % 8)       # data section 8-byte aligned
    mx_cache = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for t in tensors:
            got = 0
            for b in value_chunks(t, seed, opts, mx_cache):
                f.write(b)
                got += len(b)
                progress(len(b))
            if got != tensor_bytes(t):
                raise GenError(f"internal: {t[0]} produced {got} bytes")
        f.flush()
        os.fsync(f.fileno())


def shard_name(i, n):
    return f"model-{i + 1:05d}-of-{n:06d}.safetensors"


def generate(out, spec, opts, quiet=False):
    check_spec(spec)
    shards = plan(spec, opts)
    total = total_bytes(shards)
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=parent)
    done = [0]

    def progress(n):
        done[0] += n
        if not quiet and sys.stderr.isatty():
            sys.stderr.write(f"\r{done[0] / 1e6:9.1f} / {total / 1e6:.1f} MB")
    try:
        wmap = {}
        for i, s in enumerate(shards):
            fn = shard_name(i, len(shards))
            write_shard(os.path.join(tmp, fn), s, opts.seed, opts, progress)
            for t in s:
                wmap[t[0]] = fn
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=0)
            f.write("\n")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_json(spec, opts), f, indent=1)
            f.write("\n")
        if opts.tokenizer:
            for fn in ("tiktoken.model", "tokenizer_config.json"):
                shutil.copyfile(os.path.join(opts.tokenizer, fn), os.path.join(tmp, fn))
        if os.path.exists(out):
            if not opts.force:
                raise GenError(f"{out}: exists (use --force to replace)")
            shutil.rmtree(out)
        os.chmod(tmp, 0o755)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not quiet:
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        print(f"{out}: {len(shards)} shards, {total} tensor bytes "
              f"({total / 1e6:.1f} MB), layer map {layer_kinds(spec)}, "
              f"{spec['num_experts']} experts top-{spec['num_experts_per_token']} "
              f"({opts.experts}, {opts.mx_method if opts.experts == 'mxfp4' else '-'}), "
              f"{touched_bytes(shards, spec) / 1e6:.1f} MB of weights read per decoded token",
              file=sys.stderr)
    return total


def fit_target(spec, opts, target, dim):
    """Choose spec[dim] (num_experts, or moe_intermediate_size in steps of 32) so the
    tensor bytes come closest to target; bytes are affine in num_experts."""
    def size(v):
        s = dict(spec)
        s[dim] = v
        return total_bytes(plan(s, opts))
    if dim == "num_experts":
        lo = spec["num_experts_per_token"]
        per = size(lo + 1) - size(lo)
        v = max(lo, int(round((target - size(lo)) / per)) + lo)
    elif dim == "moe_intermediate_size":
        best = None
        for v in range(32, 1 << 16, 32):
            d = abs(size(v) - target)
            if best is None or d < best[0]:
                best = (d, v)
            elif size(v) > target:
                break
        v = best[1]
    else:
        raise GenError(f"--target-dim {dim} not supported")
    spec[dim] = v
    return spec


def generate_with_reference(a, spec):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import k3_ref as R
    ids = R.parse_ids(a.ref_ids)
    first = a.seed
    for a.seed in range(first, first + max(1, a.tries)):
        generate(a.out, spec, a)
        cfg, W = R.open_model(a.out)
        res = R.reference(cfg, W, ids, a.ref_gen)
        t2, rt = res["min_top2_margin"], res["min_router_margin"]
        print(f"seed {a.seed}: greedy {res['generated_ids']}, min top-2 gap {t2:.3g}, "
              f"min router gap {rt:.3g}", file=sys.stderr)
        if t2 >= a.min_top2 and rt >= a.min_router:
            lg = res["logits"]
            out = {"note": "tools/k3_ref.py float64 reference on this checkpoint; tf_pred[i] is "
                           "the argmax of the row for fed_ids[i]",
                   "seed": a.seed, "mla_latent_eps": R.RELEASE_MLA_LATENT_EPS,
                   "prompt_ids": ids, "generated_ids": res["generated_ids"],
                   "fed_ids": res["fed_ids"], "tf_pred": res["tf_pred"],
                   "min_top2_margin": t2,
                   "min_router_margin": rt if math.isfinite(rt) else None,
                   "logits_head": [[float("%.9g" % v) for v in r] for r in lg[:, :16].tolist()]}
            with open(os.path.join(a.out, "reference.json"), "w") as f:
                json.dump(out, f)
                f.write("\n")
            return 0
    print(f"gen_checkpoint: no seed in {first}..{a.seed} meets the margins", file=sys.stderr)
    return 1


def parse_set(spec, items):
    for it in items or []:
        if "=" not in it:
            raise GenError(f"--set {it}: want key=value")
        k, v = it.split("=", 1)
        try:
            spec[k] = json.loads(v)
        except json.JSONDecodeError:
            spec[k] = v
    return spec


def make_opts(**kw):
    """Options with their defaults (used by gen_fixtures.py)."""
    d = dict(seed=0, experts="mxfp4", trunk_dtype="bf16", flat_config=False,
             layers_per_shard=1, tokenizer=None, force=False, mx_method="quantize",
             gains=None)
    d.update(kw)
    return argparse.Namespace(**d)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write a random K3-architecture checkpoint.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("out", help="output model directory (created atomically)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--config-json", help="JSON file with a spec dict (overrides the preset)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override one spec key (JSON value), e.g. --set num_experts=16")
    ap.add_argument("--layers", type=int, metavar="N",
                    help="keep the preset's first N layers (its layer map cut to N, the last "
                         "layer MLA as in the release, whose last layer is MLA)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", choices=["mxfp4", "dense"], default="mxfp4",
                    help="routed experts MXFP4 (default) or unquantised in the trunk dtype")
    ap.add_argument("--mxfp4-init", dest="mx_method", choices=["auto", "quantize", "sample"],
                    default="auto", help="quantize Gaussian weights (slow, exact scale rule) or "
                    "sample codes directly (fast); auto: quantize below 64M expert elements")
    ap.add_argument("--trunk-dtype", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--flat-config", action="store_true", help="flat fixture-shape config.json")
    ap.add_argument("--layers-per-shard", type=int, default=1)
    ap.add_argument("--target-bytes", type=float, help="grow/shrink --target-dim to reach this size")
    ap.add_argument("--target-dim", default="num_experts",
                    choices=["num_experts", "moe_intermediate_size"])
    ap.add_argument("--tokenizer", default="auto",
                    help="directory with tiktoken.model + tokenizer_config.json to copy, 'none', "
                    "or 'auto' (tests/fixtures/tokenizer/kimi when vocab_size >= 163840)")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--dry-run", action="store_true", help="print the size and config only")
    ap.add_argument("--ref-ids", metavar="IDS",
                    help="after writing, run tools/k3_ref.py (float64) on these prompt ids and "
                    "store OUT/reference.json: greedy ids, teacher-forced argmax, margins")
    ap.add_argument("--ref-gen", type=int, default=16, help="greedy steps for --ref-ids")
    ap.add_argument("--min-top2", type=float, default=0.0,
                    help="with --ref-ids: re-seed (seed+1, ...) until every top-2 logit gap "
                    "is at least this")
    ap.add_argument("--min-router", type=float, default=0.0,
                    help="with --ref-ids: ... and every router k-th/(k+1)-th gap at least this")
    ap.add_argument("--tries", type=int, default=10, help="seeds to try with --min-*")
    a = ap.parse_args(argv)
    try:
        spec = dict(PRESETS[a.preset])
        if a.config_json:
            spec.update(json.load(open(a.config_json)))
        if a.preset == "release-dims":
            n = check_release_dims(spec)
            print(f"gen_checkpoint: release-dims: {n} keys checked against the released config"
                  if n else "gen_checkpoint: release-dims: released config not found, "
                  "using the embedded numbers", file=sys.stderr)
        if a.layers is not None:
            if not 1 <= a.layers <= spec["num_hidden_layers"]:
                raise GenError(f"--layers must be 1..{spec['num_hidden_layers']}")
            lm = spec["layer_map"][:a.layers]
            if a.layers > 1:
                lm = lm[:-1] + "M"
            spec["num_hidden_layers"], spec["layer_map"] = a.layers, lm
        parse_set(spec, a.set)
        if "layer_map" in spec and len(spec["layer_map"]) != spec["num_hidden_layers"] \
                and a.set and any(s.startswith("num_hidden_layers=") for s in a.set):
            # layer count changed without a map: extend K3's pattern (every 4th MLA, last MLA)
            L = spec["num_hidden_layers"]
            spec["layer_map"] = "".join("M" if (l + 1) % 4 == 0 or l == L - 1 else "K"
                                        for l in range(L))
        if a.layers_per_shard < 1:
            raise GenError("--layers-per-shard must be >= 1")
        if a.tokenizer == "auto":
            here = os.path.dirname(os.path.abspath(__file__))
            kimi = os.path.join(here, "..", "tests", "fixtures", "tokenizer", "kimi")
            a.tokenizer = kimi if spec["vocab_size"] >= KIMI_VOCAB and os.path.isdir(kimi) else None
        elif a.tokenizer == "none":
            a.tokenizer = None
        if a.tokenizer and spec["vocab_size"] < KIMI_VOCAB:
            raise GenError(f"the Kimi tokenizer needs vocab_size >= {KIMI_VOCAB}")
        if a.mx_method == "auto":
            a.mx_method = "quantize"       # decided below once the size is known
            auto_mx = True
        else:
            auto_mx = False
        check_spec(spec)
        if a.target_bytes:
            fit_target(spec, a, a.target_bytes, a.target_dim)
        if auto_mx:
            nel = sum(int(np.prod(t[2])) * 2 for s in plan(spec, a) for t in s
                      if t[3][0] == "mx_packed")
            a.mx_method = "quantize" if nel <= 64 << 20 else "sample"
        if a.dry_run:
            print(json.dumps(config_json(spec, a), indent=1))
            sh = plan(spec, a)
            print(f"tensor bytes {total_bytes(sh)}, weight bytes read per decoded token "
                  f"{touched_bytes(sh, spec)}", file=sys.stderr)
            return 0
        if not a.ref_ids:
            generate(a.out, spec, a)
            return 0
        return generate_with_reference(a, spec)
    except GenError as e:
        print(f"gen_checkpoint: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
