#!/usr/bin/python3
"""k3_ref.py: an independent, plain-PyTorch reference of the Kimi K3 forward pass.

Written from ../shared/docs/k3-checkpoint-format.md (sections 2-12) and the K3
technical report (section 2, eq. 1-12); no engine code was consulted. All math
runs in float64 on the weights exactly as stored (BF16/F16/F32 widened, MXFP4
experts dequantised exactly), so it is an exact-function reference: an fp32
engine should agree with it to fp32 rounding noise.

Model sources:
  * a model directory in the released layout (nested config.json with
    text_config / linear_attn_config / quantization_config) or the flat fixture
    shape; every *.safetensors file in it is indexed (the index file is not
    needed), names prefixed `language_model.model.` / `language_model.lm_head.`
    (unprefixed names are accepted too);
  * the peer's flat f32 blob (tiny_k3.json + tiny_k3.bin): reference-module
    names with '.' -> '_'.

Usage:
  k3_ref.py run MODEL_DIR --ids 3,7,11 --gen 16 [--out F.json] [--dump-logits F]
  k3_ref.py run --blob tiny_k3.json --ids ...
  k3_ref.py peer-check [--shared ../shared]      validate against the peer fixtures

The MLA latent norms (q_a_layernorm, kv_a_layernorm) use a fixed epsilon of
1e-6 in the release (spec section 9); the peer's fixtures were built with 1e-5.
--mla-latent-eps selects it (default 1e-6).
"""
import argparse
import glob
import json
import math
import os
import struct
import sys

import numpy as np
import torch

F64 = torch.float64
RELEASE_MLA_LATENT_EPS = 1e-6
L2_EPS = 1e-6            # fixed inside the KDA kernels (spec section 5)

# E2M1 magnitudes by code (bit 3 is the sign), spec section 4.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                dtype=np.float64)


class RefError(Exception):
    pass


# ---------------------------------------------------------------------------
# safetensors

ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
}


def st_header(path):
    """Returns (header dict without __metadata__, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise RefError(f"{path}: truncated safetensors header")
        n = struct.unpack("<Q", raw)[0]
        if n > 100 << 20:
            raise RefError(f"{path}: header length {n} is implausible")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


class SafetensorsDir:
    """Every *.safetensors in a directory, indexed by tensor name."""

    def __init__(self, d):
        self.d = d
        self.where = {}
        self.maps = {}
        files = sorted(glob.glob(os.path.join(d, "*.safetensors")))
        if not files:
            raise RefError(f"{d}: no *.safetensors files")
        for p in files:
            hdr, base = st_header(p)
            size = os.path.getsize(p)
            for name, ent in hdr.items():
                b, e = ent["data_offsets"]
                if base + e > size:
                    raise RefError(f"{p}: tensor {name} runs past the end of the file")
                if name in self.where:
                    raise RefError(f"{p}: tensor {name} also in {self.where[name][0]}")
                self.where[name] = (p, ent["dtype"], list(ent["shape"]), base + b, base + e)

    def has(self, name):
        return name in self.where

    def info(self, name):
        _, dt, shape, _, _ = self.where[name]
        return dt, shape

    def raw(self, name):
        p, dt, shape, b, e = self.where[name]
        if dt not in ST_DTYPES:
            raise RefError(f"{p}: tensor {name}: unsupported dtype {dt}")
        if p not in self.maps:
            self.maps[p] = np.memmap(p, dtype=np.uint8, mode="r")
        buf = self.maps[p][b:e]
        n = int(np.prod(shape)) if shape else 1
        if e - b != n * ST_DTYPES[dt].itemsize:
            raise RefError(f"{p}: tensor {name}: {e - b} bytes for shape {shape} {dt}")
        return np.frombuffer(buf, dtype=ST_DTYPES[dt]).reshape(shape), dt

    def f64(self, name):
        a, dt = self.raw(name)
        if dt == "BF16":
            a = bf16_to_f32(a)
        elif dt == "U8":
            raise RefError(f"{name}: U8 tensor used as a float tensor")
        return torch.from_numpy(np.array(a, dtype=np.float64))


def mxfp4_dequant(packed, scale, group=32):
    """packed [rows, cols/2] U8, scale [rows, cols/group] U8 -> float64 [rows, cols].
    Low nibble = even element. Scale byte 255 (NaN in the MX spec) zeroes its group,
    as the peer does (spec section 15.8; never produced by gen_checkpoint)."""
    rows, half = packed.shape
    cols = half * 2
    if scale.shape[0] != rows or scale.shape[1] * group != cols:
        raise RefError(f"MXFP4 shapes disagree: packed {packed.shape}, scale {scale.shape}")
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    vals = E2M1[codes]
    s = scale.astype(np.int64)
    mult = np.where(s == 255, 0.0, np.ldexp(1.0, (s - 127)))
    vals = vals.reshape(rows, cols // group, group) * mult[:, :, None]
    return torch.from_numpy(vals.reshape(rows, cols))


class FlatBlob:
    """The peer's tiny_k3.json + tiny_k3.bin (flat little-endian f32)."""

    def __init__(self, json_path, bin_path=None):
        meta = json.load(open(json_path))
        self.meta = meta
        self.tensors = meta["tensors"]
        bin_path = bin_path or os.path.splitext(json_path)[0] + ".bin"
        self.data = np.fromfile(bin_path, dtype="<f4")
        if self.data.size < meta["total_floats"]:
            raise RefError(f"{bin_path}: {self.data.size} floats, want {meta['total_floats']}")

    @staticmethod
    def translate(name):
        """Released tensor name -> the blob's reference-module name."""
        n = name
        for p in ("language_model.model.", "language_model."):
            if n.startswith(p):
                n = n[len(p):]
                break
        moe_map = [
            ("block_sparse_moe.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
            ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
            ("block_sparse_moe.routed_expert_down_proj.weight", "mlp.down.weight"),
            ("block_sparse_moe.routed_expert_up_proj.weight", "mlp.up.weight"),
            ("block_sparse_moe.routed_expert_norm.weight", "mlp.norm.weight"),
            ("block_sparse_moe.shared_experts.gate_proj.weight", "mlp.shared.w1.weight"),
            ("block_sparse_moe.shared_experts.up_proj.weight", "mlp.shared.w3.weight"),
            ("block_sparse_moe.shared_experts.down_proj.weight", "mlp.shared.w2.weight"),
            ("block_sparse_moe.experts.", "mlp.experts."),
        ]
        for a, b in moe_map:
            n = n.replace(a, b)
        return n.replace(".", "_")

    def has(self, name):
        return self.translate(name) in self.tensors

    def info(self, name):
        t = self.tensors[self.translate(name)]
        return "F32", t["shape"]

    def f64(self, name):
        t = self.tensors[self.translate(name)]
        a = self.data[t["offset"]:t["offset"] + t["numel"]].reshape(t["shape"])
        return torch.from_numpy(a.astype(np.float64))


# ---------------------------------------------------------------------------
# config

_MISSING = object()


class Config:
    """Every constant of the forward pass, read from a nested or flat config."""

    def __init__(self, root, name="config.json"):
        if "config" in root and "hidden_size" not in root and "text_config" not in root:
            root = root["config"]      # ref_k3.json / tiny_k3.json / MANIFEST wrapper
        tc = root.get("text_config", root)
        lac = tc.get("linear_attn_config", {}) or {}
        self.name = name

        def get(keys, default=_MISSING, where=(tc, root)):
            for d in where:
                for k in keys:
                    if k in d and d[k] is not None:
                        return d[k]
            if default is _MISSING:
                raise RefError(f"{name}: missing key {keys[0]}")
            return default

        self.E = int(get(["hidden_size"]))
        self.L = int(get(["num_hidden_layers"]))
        self.V = int(get(["vocab_size"]))
        self.eps = float(get(["rms_norm_eps"]))
        # KDA dims: linear_attn_config only (or the flat aliases), never text_config's
        # synthesised head_dim (spec section 2.1, the 74 trap).
        self.Hk = int(get(["num_heads"], None, (lac,)) or get(["kda_num_heads"]))
        self.Dk = int(get(["head_dim"], None, (lac,)) or get(["kda_head_dim"]))
        self.K = int(get(["short_conv_kernel_size"], None, (lac,))
                     or get(["short_conv_kernel_size"]))
        gmin = get(["gate_lower_bound"], None, (lac, tc, root))
        self.gmin = None if gmin is None else float(gmin)
        self.full_rank_gate = bool(get(["use_full_rank_gate"], True, (lac, tc, root)))
        full = get(["full_attn_layers"], None, (lac, tc, root))
        kda = get(["kda_layers"], None, (lac, tc, root))
        if kda is not None:
            kinds = ["K" if (l + 1) in kda else "M" for l in range(self.L)]
            if full is not None and sorted(full) != [l + 1 for l in range(self.L) if kinds[l] == "M"]:
                raise RefError(f"{name}: kda_layers and full_attn_layers are not complements")
        elif full is not None:
            for x in full:
                if not 1 <= x <= self.L:
                    raise RefError(f"{name}: full_attn_layers entry {x} out of range")
            kinds = ["M" if (l + 1) in full else "K" for l in range(self.L)]
        else:
            raise RefError(f"{name}: no layer map (kda_layers / full_attn_layers)")
        self.kinds = kinds
        # MLA
        self.Hm = int(get(["num_attention_heads"]))
        qr = get(["q_lora_rank"], None)
        self.q_lora = None if qr is None else int(qr)
        self.kv_lora = int(get(["kv_lora_rank"]))
        self.dn = int(get(["qk_nope_head_dim"]))
        self.dr = int(get(["qk_rope_head_dim"]))
        self.dv = int(get(["v_head_dim"]))
        self.mla_gate = bool(get(["mla_use_output_gate"], True))
        # MoE
        self.Ne = int(get(["num_experts", "n_routed_experts"]))
        self.topk = int(get(["num_experts_per_token", "num_experts_per_tok"]))
        self.Ns = int(get(["num_shared_experts", "n_shared_experts"]))
        lat = get(["routed_expert_hidden_size"], None)
        self.latent = None if lat is None else int(lat)
        self.I = int(get(["moe_intermediate_size"]))
        self.Id = int(get(["intermediate_size"], 0))
        self.rsf = float(get(["routed_scaling_factor"]))
        self.renorm = bool(get(["moe_renormalize"], True))
        self.latent_norm = bool(get(["latent_moe_use_norm"], True))
        self.first_dense = int(get(["first_k_dense_replace"], 0))
        self.moe_freq = int(get(["moe_layer_freq"], 1))
        self.n_group = int(get(["num_expert_group"], 1))
        self.topk_group = int(get(["topk_group"], 1))
        if self.n_group > 1 and self.n_group > self.topk_group:
            raise RefError(f"{name}: group-limited routing is not implemented")
        act = get(["moe_router_activation_func"], "sigmoid")
        if act != "sigmoid":
            raise RefError(f"{name}: router activation {act} not implemented")
        s = get(["attn_res_block_size"], None)
        self.S = None if s is None else int(s)
        self.act = get(["hidden_act"], "situ")
        b1 = get(["activation_situ_beta", "situ_beta"], None)
        self.b1 = 1.0 if not b1 else float(b1)
        b2 = get(["activation_situ_linear_beta", "situ_linear_beta"], None)
        self.b2 = None if b2 is None else float(b2)
        qc = tc.get("quantization_config") or root.get("quantization_config")
        self.group = 32
        if qc:
            try:
                self.group = int(qc["config_groups"]["group_0"]["weights"]["group_size"])
            except (KeyError, TypeError):
                pass
        eos = get(["eos_token_id"], None)
        self.eos = eos if isinstance(eos, int) else None
        # checks the peer applies
        if self.topk > self.Ne or self.topk < 1:
            raise RefError(f"{name}: num_experts_per_token {self.topk} not in 1..{self.Ne}")
        if self.S is not None and self.S <= 0:
            raise RefError(f"{name}: attn_res_block_size must be > 0")
        if self.K < 1:
            raise RefError(f"{name}: short_conv_kernel_size must be >= 1")

    def dense(self, l):
        return l < self.first_dense or (l % self.moe_freq) != 0

    def layer_map(self):
        return "".join(self.kinds)


def load_config(path):
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return Config(json.load(open(p)), p)


# ---------------------------------------------------------------------------
# weights

LAZY_MIN = 16 << 20      # elements: with --lazy, tensors this large are never widened whole
LAZY_ROWS_BYTES = 256 << 20


class LazyMatrix:
    """A large 2-D tensor left in the (memory-mapped) file: products widen a block of
    rows to float64 at a time and free it, and row lookups (the embedding) widen only
    those rows. Each output element is still one float64 dot product, so the results
    are those of the whole widened matrix."""

    def __init__(self, src, name, dtype):
        self.src, self.name, self.dtype = src, name, dtype
        self.shape = torch.Size(src.info(name)[1])

    def dim(self):
        return len(self.shape)

    def _rows(self, lo, hi):
        a, dt = self.src.raw(self.name)
        a = a[lo:hi]
        if dt == "BF16":
            a = bf16_to_f32(np.asarray(a))
        return torch.from_numpy(np.array(a, dtype=np.float64)).to(self.dtype)

    def __getitem__(self, idx):
        idx = torch.as_tensor(idx).tolist()
        return torch.stack([self._rows(i, i + 1)[0] for i in idx], 0)

    def rmul(self, x):
        """x @ self.T, a block of rows at a time."""
        rows, cols = self.shape
        step = max(1, LAZY_ROWS_BYTES // (8 * cols))
        out = torch.empty(x.shape[:-1] + (rows,), dtype=x.dtype)
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            out[..., lo:hi] = x @ self._rows(lo, hi).T
        return out


class Weights:
    """Name resolution (released prefix or bare), float64 conversion, MXFP4 experts."""

    def __init__(self, src, cfg, cache_experts=True, dtype=F64, lazy=False):
        self.src, self.cfg = src, cfg
        # lazy: keep nothing widened between uses (a release-size model is 40+ GB in
        # float64); matrices of LAZY_MIN elements or more become LazyMatrix
        self.lazy = lazy
        # float64 is the reference; float32 exists only to estimate how far an fp32
        # engine can drift on a given model (the fixture conditioning check)
        self.dtype = dtype
        self.cache = {}
        self.cache_experts = cache_experts

    def _resolve(self, name):
        for n in (name, name.replace("language_model.model.", "model.", 1),
                  name.replace("language_model.model.", "", 1),
                  name.replace("language_model.", "", 1)):
            if self.src.has(n):
                return n
        return None

    def has(self, name):
        return self._resolve(name) is not None

    def get(self, name, shape=None):
        if name in self.cache:
            return self.cache[name]
        n = self._resolve(name)
        if n is None:
            raise RefError(f"missing tensor {name}")
        big = False
        if self.lazy and isinstance(self.src, SafetensorsDir):
            shp = self.src.info(n)[1]
            big = len(shp) == 2 and int(np.prod(shp)) >= LAZY_MIN
        t = LazyMatrix(self.src, n, self.dtype) if big else self.src.f64(n).to(self.dtype)
        if shape is not None and list(t.shape) != list(shape):
            raise RefError(f"tensor {name}: shape {list(t.shape)}, want {list(shape)}")
        if not self.lazy:
            self.cache[name] = t
        return t

    def layer(self, l, rest, shape=None):
        return self.get(f"language_model.model.layers.{l}.{rest}", shape)

    def expert(self, l, e, w, rows, cols):
        """Routed expert matrix w in {w1,w2,w3} as float64 [rows, cols]."""
        key = (l, e, w)
        if key in self.cache:
            return self.cache[key]
        base = f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}"
        pk = self._resolve(base + ".weight_packed")
        if pk is not None:
            sc = self._resolve(base + ".weight_scale")
            if sc is None:
                raise RefError(f"missing tensor {base}.weight_scale")
            p, pdt = self.src.raw(pk)
            s, sdt = self.src.raw(sc)
            if pdt != "U8" or sdt != "U8":
                raise RefError(f"{base}: MXFP4 tensors must be U8 (got {pdt}, {sdt})")
            t = mxfp4_dequant(np.asarray(p), np.asarray(s), self.cfg.group)
        else:
            t = self.get(base + ".weight")
        t = t.to(self.dtype)
        if list(t.shape) != [rows, cols]:
            raise RefError(f"{base}: shape {list(t.shape)}, want {[rows, cols]}")
        if self.cache_experts:
            self.cache[key] = t
        return t


def open_model(path=None, blob=None, cache_experts=True, dtype=F64, lazy=False):
    if blob:
        fb = FlatBlob(blob)
        cfg = Config(fb.meta, blob)
        return cfg, Weights(fb, cfg, cache_experts, dtype)
    cfg = load_config(path)
    return cfg, Weights(SafetensorsDir(path), cfg, cache_experts and not lazy, dtype, lazy)


# ---------------------------------------------------------------------------
# primitives (spec section 5)

def rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def silu(x):
    return x * torch.sigmoid(x)


def glu_act(cfg, a, u):
    """SiTU-GLU (hidden_act situ): [b1 tanh(a/b1) sigmoid(a)] * [b2 tanh(u/b2)].
    The sigmoid takes the uncapped gate; a missing linear beta leaves u uncapped."""
    if cfg.act == "situ":
        g = cfg.b1 * torch.tanh(a / cfg.b1) * torch.sigmoid(a)
        up = u if cfg.b2 is None else cfg.b2 * torch.tanh(u / cfg.b2)
        return g * up
    if cfg.act in ("silu", "swish"):
        return silu(a) * u
    raise RefError(f"hidden_act {cfg.act} not implemented")


def linear(x, w):
    if isinstance(w, LazyMatrix):
        return w.rmul(x)
    return x @ w.T


# ---------------------------------------------------------------------------
# KDA (spec section 8; report eq. 1, 2, 5, 6)

def short_conv(x, w):
    """Depthwise causal conv, w [C,1,K]: w[c,0,K-1] multiplies the current input."""
    T, C = x.shape
    K = w.shape[2]
    xp = torch.cat([torch.zeros(K - 1, C, dtype=x.dtype), x], 0)
    y = torch.zeros_like(x)
    for j in range(K):
        y = y + w[:, 0, j] * xp[j:j + T]
    return silu(y)


def kda_attention(cfg, W, l, x, want_state=False):
    T = x.shape[0]
    H, D, E, K = cfg.Hk, cfg.Dk, cfg.E, cfg.K
    P = H * D
    at = lambda r, s=None: W.layer(l, "self_attn." + r, s)
    q = short_conv(linear(x, at("q_proj.weight", [P, E])), at("q_conv1d.weight", [P, 1, K]))
    k = short_conv(linear(x, at("k_proj.weight", [P, E])), at("k_conv1d.weight", [P, 1, K]))
    v = short_conv(linear(x, at("v_proj.weight", [P, E])), at("v_conv1d.weight", [P, 1, K]))
    q = l2norm(q.view(T, H, D)) * (D ** -0.5)
    k = l2norm(k.view(T, H, D))
    v = v.view(T, H, D)
    beta = torch.sigmoid(linear(x, at("b_proj.weight", [H, E])))            # [T,H]
    z = linear(linear(x, at("f_a_proj.weight", [D, E])), at("f_b_proj.weight", [P, D]))
    a_log = W.layer(l, "self_attn.A_log")
    if a_log.dim() != 1 or a_log.numel() < H:
        raise RefError(f"layer {l}: A_log has {a_log.numel()} values, need >= {H}")
    A = torch.exp(a_log[:H]).view(1, H, 1)
    zb = z.view(T, H, D) + at("dt_bias", [P]).view(1, H, D)
    if cfg.gmin is not None:
        g = cfg.gmin * torch.sigmoid(A * zb)
    else:
        g = -A * torch.nn.functional.softplus(zb)
    alpha = torch.exp(g)                                                    # [T,H,D]
    S = torch.zeros(H, D, D, dtype=x.dtype)
    o = torch.zeros(T, H, D, dtype=x.dtype)
    for t in range(T):
        S = alpha[t].unsqueeze(2) * S
        u = torch.einsum("hij,hi->hj", S, k[t])
        S = S + k[t].unsqueeze(2) * (beta[t].view(H, 1) * (v[t] - u)).unsqueeze(1)
        o[t] = torch.einsum("hij,hi->hj", S, q[t])
    o = rmsnorm(o, at("o_norm.weight", [D]), cfg.eps).reshape(T, P)
    if W.has(f"language_model.model.layers.{l}.self_attn.g_proj.weight"):
        gate = linear(x, at("g_proj.weight", [P, E]))
    else:  # use_full_rank_gate false: a low-rank pair
        gate = linear(linear(x, at("g_a_proj.weight", [D, E])), at("g_b_proj.weight", [P, D]))
    y = linear(torch.sigmoid(gate) * o, at("o_proj.weight", [E, P]))
    return (y, S) if want_state else y


# ---------------------------------------------------------------------------
# Gated MLA with NoPE (spec section 9; report eq. 7)

def mla_attention(cfg, W, l, x, latent_eps):
    T = x.shape[0]
    H, dn, dr, dv, E, r = cfg.Hm, cfg.dn, cfg.dr, cfg.dv, cfg.E, cfg.kv_lora
    at = lambda n, s=None: W.layer(l, "self_attn." + n, s)
    if cfg.q_lora is not None:
        cq = rmsnorm(linear(x, at("q_a_proj.weight", [cfg.q_lora, E])),
                     at("q_a_layernorm.weight", [cfg.q_lora]), latent_eps)
        q = linear(cq, at("q_b_proj.weight", [H * (dn + dr), cfg.q_lora]))
    else:
        q = linear(x, at("q_proj.weight", [H * (dn + dr), E]))
    q = q.view(T, H, dn + dr)
    c = linear(x, at("kv_a_proj_with_mqa.weight", [r + dr, E]))
    ckv = rmsnorm(c[:, :r], at("kv_a_layernorm.weight", [r]), latent_eps)
    krope = c[:, r:]                                                        # [T,dr]
    kv = linear(ckv, at("kv_b_proj.weight", [H * (dn + dv), r])).view(T, H, dn + dv)
    knope, v = kv[..., :dn], kv[..., dn:]
    sc = torch.einsum("thd,shd->hts", q[..., :dn], knope)
    if dr > 0:
        sc = sc + torch.einsum("thd,sd->hts", q[..., dn:], krope)
    sc = sc / math.sqrt(dn + dr)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    sc = sc.masked_fill(mask, float("-inf"))
    a = torch.einsum("hts,shd->thd", torch.softmax(sc, -1), v).reshape(T, H * dv)
    if cfg.mla_gate:
        a = torch.sigmoid(linear(x, at("g_proj.weight", [H * dv, E]))) * a
    return linear(a, at("o_proj.weight", [E, H * dv]))


# ---------------------------------------------------------------------------
# MLPs (spec sections 10, 11; report eq. 11, 12)

def dense_mlp(cfg, W, l, x):
    E, I = cfg.E, cfg.Id
    g = linear(x, W.layer(l, "mlp.gate_proj.weight", [I, E]))
    u = linear(x, W.layer(l, "mlp.up_proj.weight", [I, E]))
    return linear(glu_act(cfg, g, u), W.layer(l, "mlp.down_proj.weight", [E, I]))


def route(cfg, W, l, x):
    """Returns (idx [T,k] long, weights [T,k], margin [T]) where margin is the gap
    between the k-th and (k+1)-th biased selection score (inf when k == N_e)."""
    m = "block_sparse_moe."
    s = torch.sigmoid(linear(x, W.layer(l, m + "gate.weight", [cfg.Ne, cfg.E])))
    sel = s + W.layer(l, m + "gate.e_score_correction_bias", [cfg.Ne])
    # Ties: lowest expert index first (stable sort). Fixtures are built with a
    # margin check so that no tie rule matters.
    order = torch.from_numpy(np.argsort(-sel.numpy(), axis=1, kind="stable"))
    idx = order[:, :cfg.topk]
    if cfg.topk < cfg.Ne:
        ss = torch.gather(sel, 1, order)
        margin = ss[:, cfg.topk - 1] - ss[:, cfg.topk]
    else:
        margin = torch.full((x.shape[0],), float("inf"), dtype=x.dtype)
    p = torch.gather(s, 1, idx)
    if cfg.renorm and cfg.topk > 1:
        p = p / (p.sum(1, keepdim=True) + 1e-20)
    p = p * cfg.rsf
    return idx, p, margin


def moe(cfg, W, l, x, stats=None):
    T, E = x.shape
    m = "block_sparse_moe."
    idx, p, margin = route(cfg, W, l, x)
    if stats is not None:
        stats.setdefault("router_margin", []).append(float(margin.min()))
    lat = cfg.latent
    if lat is not None:
        z = linear(x, W.layer(l, m + "routed_expert_down_proj.weight", [lat, E]))
    else:
        lat, z = E, x
    u = torch.zeros(T, lat, dtype=x.dtype)
    I = cfg.I
    for e in torch.unique(idx).tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        zr = z[rows]
        w1 = W.expert(l, e, "w1", I, lat)
        w3 = W.expert(l, e, "w3", I, lat)
        w2 = W.expert(l, e, "w2", lat, I)
        out = linear(glu_act(cfg, linear(zr, w1), linear(zr, w3)), w2)
        u.index_add_(0, rows, p[rows, slot].unsqueeze(1) * out)
    if cfg.latent is not None:
        if cfg.latent_norm:
            u = rmsnorm(u, W.layer(l, m + "routed_expert_norm.weight", [lat]), cfg.eps)
        r = linear(u, W.layer(l, m + "routed_expert_up_proj.weight", [E, lat]))
    else:
        r = u
    if cfg.Ns > 0:
        n = cfg.Ns * I
        sh = m + "shared_experts."
        g = linear(x, W.layer(l, sh + "gate_proj.weight", [n, E]))
        up = linear(x, W.layer(l, sh + "up_proj.weight", [n, E]))
        r = r + linear(glu_act(cfg, g, up), W.layer(l, sh + "down_proj.weight", [E, n]))
    return r


# ---------------------------------------------------------------------------
# AttnRes (spec section 7; report eq. 8-10) and the model (spec sections 6, 12)

def attn_res(cfg, sources, norm_w, proj_w):
    V = torch.stack(sources, 0)                                   # [m,T,E]
    keys = rmsnorm(V, norm_w, cfg.eps)
    s = torch.einsum("mte,e->mt", keys, proj_w.reshape(-1))
    a = torch.softmax(s, 0)
    return torch.einsum("mt,mte->te", a, V)


def forward(cfg, W, ids, latent_eps=RELEASE_MLA_LATENT_EPS, n_layers=None, stats=None):
    """Teacher-forced logits [T, V] (float64) for the token ids."""
    E = cfg.E
    ids = list(ids)
    for t in ids:
        if not 0 <= t < cfg.V:
            raise RefError(f"token id {t} outside the vocabulary (0..{cfg.V - 1})")
    emb = W.get("language_model.model.embed_tokens.weight", [cfg.V, E])
    h = emb[torch.tensor(ids, dtype=torch.long)]
    nl = cfg.L if n_layers is None else n_layers
    P = "language_model.model."
    blocks, partial = [], h
    for l in range(nl):
        lw = lambda r, s=None: W.layer(l, r, s)
        attn = (lambda x: kda_attention(cfg, W, l, x)) if cfg.kinds[l] == "K" else \
               (lambda x: mla_attention(cfg, W, l, x, latent_eps))
        mlp = (lambda x: dense_mlp(cfg, W, l, x)) if cfg.dense(l) else \
              (lambda x: moe(cfg, W, l, x, stats))
        if cfg.S is None:          # plain pre-norm residual (not K3)
            partial = partial + attn(rmsnorm(partial, lw("input_layernorm.weight", [E]), cfg.eps))
            partial = partial + mlp(rmsnorm(partial, lw("post_attention_layernorm.weight", [E]), cfg.eps))
            continue
        if blocks:
            a = attn_res(cfg, blocks + [partial], lw("self_attention_res_norm.weight", [E]),
                         lw("self_attention_res_proj.weight", [1, E]))
        else:
            a = partial
        if l % cfg.S == 0:
            blocks.append(partial)
            partial = None
        t = attn(rmsnorm(a, lw("input_layernorm.weight", [E]), cfg.eps))
        partial = t if partial is None else partial + t
        m = attn_res(cfg, blocks + [partial], lw("mlp_res_norm.weight", [E]),
                     lw("mlp_res_proj.weight", [1, E]))
        partial = partial + mlp(rmsnorm(m, lw("post_attention_layernorm.weight", [E]), cfg.eps))
        if stats is not None:
            stats.setdefault("max_abs_partial", []).append(float(partial.abs().max()))
            if "capture" in stats:
                stats["capture"].append(partial.clone())
    if cfg.S is None:
        x = partial
    else:
        x = attn_res(cfg, blocks + [partial], W.get(P + "output_attn_res_norm.weight", [E]),
                     W.get(P + "output_attn_res_proj.weight", [1, E]))
    x = rmsnorm(x, W.get(P + "norm.weight", [E]), cfg.eps)
    return linear(x, W.get("language_model.lm_head.weight", [cfg.V, E]))


def top2_margin(logits):
    t = torch.topk(logits, 2, dim=-1).values
    return t[..., 0] - t[..., 1]


def greedy(cfg, W, prompt, n_gen, latent_eps=RELEASE_MLA_LATENT_EPS, stop_at_eos=True,
           n_layers=None):
    """Greedy decode by recomputing the whole prefix each step (exact function).
    Returns (generated ids, min top-2 margin over the decoded steps)."""
    seq, out, marg = list(prompt), [], float("inf")
    for _ in range(n_gen):
        lg = forward(cfg, W, seq, latent_eps, n_layers)[-1]
        nxt = int(torch.argmax(lg))
        marg = min(marg, float(top2_margin(lg)))
        out.append(nxt)
        seq.append(nxt)
        if stop_at_eos and cfg.eos is not None and nxt == cfg.eos:
            break
    return out, marg


def reference(cfg, W, prompt, n_gen, latent_eps=RELEASE_MLA_LATENT_EPS, n_layers=None):
    """Greedy ids plus the teacher-forced pass over prompt + generated[:-1] (the rows
    `k3 run --dump-logits` writes). The last teacher-forced row equals the last greedy
    step's logits, so greedy is read off the full pass once it is known."""
    gen, gmarg = greedy(cfg, W, prompt, n_gen, latent_eps, n_layers=n_layers)
    fed = list(prompt) + gen[:-1]
    stats = {}
    lg = forward(cfg, W, fed, latent_eps, n_layers, stats)
    tf = torch.argmax(lg, -1).tolist()
    if tf[len(prompt) - 1:] != gen:
        raise RefError("teacher-forced argmax disagrees with greedy decode")
    return {
        "prompt_ids": list(prompt), "generated_ids": gen, "fed_ids": fed,
        "logits": lg, "tf_pred": tf,
        "min_top2_margin": float(top2_margin(lg).min()),
        "min_router_margin": min(stats.get("router_margin", [float("inf")])),
        "max_abs_partial": max(stats.get("max_abs_partial", [0.0])),
    }


# ---------------------------------------------------------------------------
# validation against the peer's fixtures

def _ok(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    return bool(cond)


def normwise_worst(got, want, atol=1e-5, rtol=1e-4):
    """max over elements of |d| / (atol + rtol * max(|want|, rms(row of want)))."""
    got = np.asarray(got, dtype=np.float64).reshape(-1, np.shape(want)[-1])
    want = np.asarray(want, dtype=np.float64).reshape(got.shape)
    rms = np.sqrt((want * want).mean(1, keepdims=True))
    bound = atol + rtol * np.maximum(np.abs(want), rms)
    return float((np.abs(got - want) / bound).max())


def peer_check(shared, latent_eps):
    peer = os.path.join(shared, "fixtures", "peer")
    ok = True
    # 1. tiny-checkpoint: released naming, MXFP4 experts, 64-token greedy
    cfg, W = open_model(os.path.join(peer, "tiny-checkpoint"))
    g = json.load(open(os.path.join(peer, "tiny-checkpoint.greedy.json")))
    prompt, full = g["prompt_ids"], g["full_ids"]
    lg = forward(cfg, W, full, latent_eps)
    tf = torch.argmax(lg, -1).tolist()
    ok &= _ok(tf == g["tf_pred"][:len(tf)] and len(g["tf_pred"]) >= len(tf) - 1,
              f"tiny-checkpoint teacher-forced argmax {sum(a == b for a, b in zip(tf, g['tf_pred']))}/{len(tf)}")
    gen = tf[len(prompt) - 1:-1]
    ok &= _ok(gen == g["generated_ids"],
              f"tiny-checkpoint greedy {sum(a == b for a, b in zip(gen, g['generated_ids']))}/{len(g['generated_ids'])}"
              f" (min top-2 margin {float(top2_margin(lg[len(prompt) - 1:-1]).min()):.3g})")
    if "logits_head" in g:
        want = np.array(g["logits_head"], dtype=np.float64)
        got = lg[:want.shape[0], :want.shape[1]].numpy()
        ok &= _ok(normwise_worst(got, want) <= 1.0,
                  f"tiny-checkpoint logits_head max|d| {np.abs(got - want).max():.3g}")
    rl = json.load(open(os.path.join(peer, "tiny-checkpoint", "ref_logits.json")))
    want = np.array(rl["logits_bits"], dtype=np.uint32).view(np.float32).astype(np.float64)
    got = forward(cfg, W, rl["prompt_ids"], latent_eps)[-1].numpy()
    w = normwise_worst(got, want)
    ok &= _ok(w <= 1.0 and int(np.argmax(got)) == rl["argmax"],
              f"tiny-checkpoint ref_logits: argmax {int(np.argmax(got))} (want {rl['argmax']}), "
              f"max|d| {np.abs(got - want).max():.3g}, normwise worst {w:.3g}")
    # 2. the 13-layer oracle from the flat f32 blob
    cfg, W = open_model(blob=os.path.join(peer, "tiny_k3.json"))
    ref = json.load(open(os.path.join(peer, "ref_k3.json")))
    full, prompt = ref["full_ids"], ref["prompt_ids"]
    lg = forward(cfg, W, full, latent_eps)
    tf = torch.argmax(lg, -1).tolist()
    ok &= _ok(tf == ref["tf_pred"], f"ref_k3 teacher-forced {sum(a == b for a, b in zip(tf, ref['tf_pred']))}/{len(tf)}")
    gen, _ = greedy(cfg, W, prompt, len(full) - len(prompt), latent_eps)
    ok &= _ok(prompt + gen == full, f"ref_k3 greedy {sum(a == b for a, b in zip(gen, full[len(prompt):]))}/{len(gen)}")
    want = np.array(ref["logits_head"], dtype=np.float64)
    got = lg[:, :want.shape[1]].numpy()
    ok &= _ok(np.abs(got - want).max() <= 2e-5,
              f"ref_k3 logits_head max|d| {np.abs(got - want).max():.3g} (fixture printed to 6 decimals)")
    # 3. MXFP4 decoding on real released bytes, and our quantiser round trip
    d = json.load(open(os.path.join(peer, "mxfp4.json")))
    pk = np.array(d["packed"]["data"], dtype=np.uint8).reshape(d["packed"]["shape"])
    sc = np.array(d["scales"]["data"], dtype=np.uint8).reshape(d["scales"]["shape"])
    got = mxfp4_dequant(pk, sc, d["group_size"]).numpy()
    want = np.array(d["expected"]["data"], dtype=np.float64).reshape(d["expected"]["shape"])
    ok &= _ok(np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want)),
              "mxfp4.json: real released bytes decode bit-exactly (incl. -0)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gen_checkpoint
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-6, 2, (64, 1)))).astype(np.float32)
    qp, qs = gen_checkpoint.mx_quantize(w)
    back = mxfp4_dequant(qp, qs).numpy()
    g = np.abs(w.reshape(64, 8, 32)).max(2)
    step = np.ldexp(1.0, qs.astype(np.int64) - 127)          # E2M1 unit of each group
    covers = bool((g <= 6 * step).all() and (g > 3 * step).all())
    half = np.repeat(step, 32, axis=1)                           # worst gap between codes is 2 units
    ok &= _ok(covers and bool((np.abs(back - w) <= half + 1e-30).all()),
              "gen_checkpoint MXFP4 quantiser: scale covers each group max, error <= half a step")
    # 4. module fixtures (ops/) through the same functions
    ok &= ops_check(os.path.join(peer, "ops"), latent_eps)
    return ok


def _arr(node):
    return torch.tensor(node["data"], dtype=F64).reshape(node["shape"])


class DictWeights:
    """Weights for one layer from an ops fixture (flat reference-module names)."""

    def __init__(self, d, layer, prefix=""):
        self.d, self.l, self.prefix = d, layer, prefix
        self.cache_experts = True

    def _key(self, name):
        rest = name.split(f"layers.{self.l}.", 1)[1]
        return self.prefix + FlatBlob.translate("language_model.model." + rest)

    def has(self, name):
        return self._key(name) in self.d

    def layer(self, l, rest, shape=None):
        k = self._key(f"language_model.model.layers.{l}.{rest}")
        if k not in self.d:
            raise RefError(f"ops fixture lacks {k}")
        t = _arr(self.d[k])
        return t.reshape(shape) if shape is not None else t

    def expert(self, l, e, w, rows, cols):
        return self.layer(l, f"block_sparse_moe.experts.{e}.{w}.weight", [rows, cols])


def ops_check(ops, latent_eps):
    ok = True
    man = json.load(open(os.path.join(ops, "MANIFEST.json")))
    cfg = Config(man, "MANIFEST.json")
    rd = lambda n: json.load(open(os.path.join(ops, n)))
    for name in ("kda_layer1.json", "kda_layer8.json"):
        d = rd(name)
        alias = {"q_proj": "self_attn_q_proj_weight", "k_proj": "self_attn_k_proj_weight",
                 "v_proj": "self_attn_v_proj_weight", "g_proj": "self_attn_g_proj_weight",
                 "o_proj": "self_attn_o_proj_weight", "f_a": "self_attn_f_a_proj_weight",
                 "f_b": "self_attn_f_b_proj_weight", "b_proj": "self_attn_b_proj_weight",
                 "q_conv": "self_attn_q_conv1d_weight", "k_conv": "self_attn_k_conv1d_weight",
                 "v_conv": "self_attn_v_conv1d_weight", "A_log": "self_attn_A_log",
                 "dt_bias": "self_attn_dt_bias", "o_norm": "self_attn_o_norm_weight"}
        dd = {alias[k]: v for k, v in d.items() if k in alias}
        x = _arr(d["in"])
        outs = []
        for b in range(x.shape[0]):
            y, S = kda_attention(cfg, DictWeights(dd, 0), 0, x[b], want_state=True)
            outs.append(y)
        got = torch.stack(outs).numpy()
        ok &= _ok(normwise_worst(got, _arr(d["out"]).numpy()) <= 1, f"ops/{name}")
    d = rd("mla.json")
    dd = {"self_attn_" + k: v for k, v in d.items() if k.endswith("_weight")}
    x = _arr(d["in"])
    got = torch.stack([mla_attention(cfg, DictWeights(dd, 0), 0, x[b], latent_eps)
                       for b in range(x.shape[0])]).numpy()
    ok &= _ok(normwise_worst(got, _arr(d["out"]).numpy()) <= 1, "ops/mla.json")
    d = rd("moe.json")
    dd = {"mlp_" + k: v for k, v in d.items() if isinstance(v, dict) and "data" in v}
    x = _arr(d["in"])
    got = moe(cfg, DictWeights(dd, 0), 0, x.reshape(-1, x.shape[-1])).numpy()
    ok &= _ok(normwise_worst(got, _arr(d["out"]).numpy().reshape(got.shape)) <= 1, "ops/moe.json")
    d = rd("attnres.json")
    src = list(_arr(d["block_residual"]).transpose(0, 1)) + [_arr(d["prefix_sum"])]  # [T,n,E]
    got = attn_res(cfg, src, _arr(d["norm_weight"]), _arr(d["proj_weight"])).numpy()
    ok &= _ok(normwise_worst(got, _arr(d["out"]).numpy()) <= 1, "ops/attnres.json")
    return ok


# ---------------------------------------------------------------------------
# CLI

def parse_ids(s):
    try:
        return [int(t) for t in s.split(",") if t.strip() != ""]
    except ValueError:
        raise RefError(f"--ids: not a comma-separated list of integers: {s}")


def result_json(res, cfg, latent_eps, head=None):
    lg = res["logits"]
    rows = lg if head is None else lg[:, :head]
    return {
        "note": "tools/k3_ref.py float64 reference; logits[i] is the row for fed_ids[i] "
                "(prompt + generated[:-1]) and predicts fed_ids[i+1] / the next generated id",
        "layer_map": cfg.layer_map(),
        "mla_latent_eps": latent_eps,
        "prompt_ids": res["prompt_ids"],
        "generated_ids": res["generated_ids"],
        "fed_ids": res["fed_ids"],
        "tf_pred": res["tf_pred"],
        "vocab_size": cfg.V,
        "logits_cols": rows.shape[1],
        "min_top2_margin": res["min_top2_margin"],
        # null when k == N_e (no selection to flip); JSON has no Infinity
        "min_router_margin": (res["min_router_margin"]
                              if math.isfinite(res["min_router_margin"]) else None),
        "logits": [[float("%.9g" % v) for v in r] for r in rows.tolist()],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="greedy ids and teacher-forced logits for a model")
    r.add_argument("model", nargs="?", help="model directory (released or flat layout)")
    r.add_argument("--blob", help="peer-style tiny_k3.json (+ .bin) instead of a directory")
    r.add_argument("--ids", required=True, help="prompt token ids, comma-separated")
    r.add_argument("--gen", type=int, default=16)
    r.add_argument("--layers", type=int, help="run only the first N layers")
    r.add_argument("--mla-latent-eps", type=float, default=RELEASE_MLA_LATENT_EPS,
                   help="epsilon of q_a/kv_a_layernorm (release 1e-6; peer fixtures 1e-5)")
    r.add_argument("--out", help="write a JSON result (ids, logits) here")
    r.add_argument("--logits-head", type=int, help="keep only the first N logits per row in --out")
    r.add_argument("--dump-logits", help="write the teacher-forced logits as float32 rows")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--lazy", action="store_true",
                   help="keep no widened weights: matrices are read from the mapped files and "
                        "widened a block of rows per product (release-size models)")
    p = sub.add_parser("peer-check", help="validate this reference against ../shared/fixtures/peer")
    p.add_argument("--shared", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "..", "..", "shared"))
    p.add_argument("--mla-latent-eps", type=float, default=1e-5,
                   help="the peer's fixtures were made with 1e-5 (default here)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "peer-check":
            torch.set_num_threads(1)
            ok = peer_check(a.shared, a.mla_latent_eps)
            print("peer-check:", "PASS" if ok else "FAIL")
            return 0 if ok else 1
        torch.set_num_threads(a.threads)
        if not a.model and not a.blob:
            raise RefError("run: give a model directory or --blob")
        cfg, W = open_model(a.model, a.blob, lazy=a.lazy)
        ids = parse_ids(a.ids)
        if not ids:
            raise RefError("--ids: empty prompt")
        res = reference(cfg, W, ids, a.gen, a.mla_latent_eps, a.layers)
        print("prompt   ", ",".join(map(str, ids)))
        print("generated", ",".join(map(str, res["generated_ids"])))
        print(f"min top-2 logit margin {res['min_top2_margin']:.4g}, "
              f"min router margin {res['min_router_margin']:.4g}", file=sys.stderr)
        if a.dump_logits:
            res["logits"].numpy().astype("<f4").tofile(a.dump_logits)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result_json(res, cfg, a.mla_latent_eps, a.logits_head), f)
                f.write("\n")
        return 0
    except RefError as e:
        print(f"k3_ref: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
