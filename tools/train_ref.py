#!/usr/bin/env python3
"""PyTorch reference of one smol-K3 training step (the llm.c method).

Our own code, written from ../shared/docs/k3-checkpoint-format.md sections 5-10
and the K3 technical report section 2. It runs in float64 so that it is the
exact function the C trainer (float32) approximates. Debian python3-torch 1.13.

  /usr/bin/python3 tools/train_ref.py inventory configs/smol-50m.json
      prints the parameter inventory (must agree with `k3 train --inventory`)
  /usr/bin/python3 tools/train_ref.py fixture tests/fixtures/train/grad-config.json OUTDIR
      writes OUTDIR/grad.bin + grad.json: parameters, router biases, inputs,
      logits, loss, every parameter gradient, the Quantile Balancing update of
      that batch, and the first 10 optimiser steps' losses with AdamW and with
      Muon (+ Per-Head Muon), with QB bias updates between steps.

Tensor names are the released ones (language_model.model.layers.L....). The
router's e_score_correction_bias is a buffer, not a parameter: it gets no
gradient and is set by Quantile Balancing."""
import json, math, struct, sys

import torch

torch.set_default_dtype(torch.float64)
DT = torch.float64


# ---------------------------------------------------------------- config
class Cfg:
    def __init__(self, path):
        with open(path) as f:
            root = json.load(f)
        tc = root.get("text_config", root)
        la = tc.get("linear_attn_config", {})
        self.E = tc["hidden_size"]
        self.L = tc["num_hidden_layers"]
        self.V = tc["vocab_size"]
        self.eps = tc["rms_norm_eps"]
        self.Hk = la["num_heads"]
        self.Dk = la["head_dim"]
        self.K = la["short_conv_kernel_size"]
        self.gmin = la["gate_lower_bound"]
        self.full = la["full_attn_layers"]
        self.Hm = tc["num_attention_heads"]
        self.rq = tc["q_lora_rank"]
        self.rkv = tc["kv_lora_rank"]
        self.dn = tc["qk_nope_head_dim"]
        self.dr = tc["qk_rope_head_dim"]
        self.dv = tc["v_head_dim"]
        self.Ne = tc["num_experts"]
        self.k = tc["num_experts_per_token"]
        self.Ns = tc["num_shared_experts"]
        self.lat = tc["routed_expert_hidden_size"]
        self.I = tc["moe_intermediate_size"]
        self.Id = tc.get("intermediate_size", 0)
        self.scale = tc.get("routed_scaling_factor", 1.0)
        self.dense_k = tc.get("first_k_dense_replace", 0)
        self.freq = tc.get("moe_layer_freq", 1)
        self.S = tc["attn_res_block_size"]
        self.b1 = tc["activation_situ_beta"]
        self.b2 = tc["activation_situ_linear_beta"]
        self.kind = ["M" if (l + 1) in self.full else "K" for l in range(self.L)]
        self.dense = [l < self.dense_k or l % self.freq != 0 for l in range(self.L)]


P_MODEL = "language_model.model."
P_LAYER = "language_model.model.layers.%d."


def inventory(c):
    """[(name, shape, group, component)] in the trainer's canonical order.
    group: 'adamw' (decayed), 'adamw_nd' (no weight decay), 'muon', or
    ('muon_heads', [block rows...]) for Per-Head Muon."""
    out = []
    E = c.E
    out.append((P_MODEL + "embed_tokens.weight", [c.V, E], "adamw", "embedding"))
    for l in range(c.L):
        p = P_LAYER % l
        for n in ["input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                  "mlp_res_norm"]:
            out.append((p + n + ".weight", [E], "adamw_nd", "norms+attnres"))
        for n in ["self_attention_res_proj", "mlp_res_proj"]:
            out.append((p + n + ".weight", [1, E], "adamw", "norms+attnres"))
        a = p + "self_attn."
        if c.kind[l] == "K":
            P, D, H = c.Hk * c.Dk, c.Dk, c.Hk
            for n in ["q_proj", "k_proj", "v_proj"]:
                out.append((a + n + ".weight", [P, E], ("muon_heads", [D] * H), "kda"))
            for n in ["q_conv1d", "k_conv1d", "v_conv1d"]:
                out.append((a + n + ".weight", [P, 1, c.K], "adamw", "kda"))
            out.append((a + "f_a_proj.weight", [D, E], "muon", "kda"))
            out.append((a + "f_b_proj.weight", [P, D], "muon", "kda"))
            out.append((a + "A_log", [H], "adamw_nd", "kda"))
            out.append((a + "dt_bias", [P], "adamw_nd", "kda"))
            out.append((a + "b_proj.weight", [H, E], "muon", "kda"))
            out.append((a + "g_proj.weight", [P, E], "muon", "kda"))
            out.append((a + "o_norm.weight", [D], "adamw_nd", "kda"))
            out.append((a + "o_proj.weight", [E, P], "muon", "kda"))
        else:
            H = c.Hm
            out.append((a + "q_a_proj.weight", [c.rq, E], "muon", "mla"))
            out.append((a + "q_a_layernorm.weight", [c.rq], "adamw_nd", "mla"))
            out.append((a + "q_b_proj.weight", [H * (c.dn + c.dr), c.rq],
                        ("muon_heads", [c.dn + c.dr] * H), "mla"))
            out.append((a + "kv_a_proj_with_mqa.weight", [c.rkv + c.dr, E], "muon", "mla"))
            out.append((a + "kv_a_layernorm.weight", [c.rkv], "adamw_nd", "mla"))
            out.append((a + "kv_b_proj.weight", [H * (c.dn + c.dv), c.rkv],
                        ("muon_heads", [c.dn, c.dv] * H), "mla"))
            out.append((a + "o_proj.weight", [E, H * c.dv], "muon", "mla"))
            out.append((a + "g_proj.weight", [H * c.dv, E], "muon", "mla"))
        if c.dense[l]:
            m = p + "mlp."
            out.append((m + "gate_proj.weight", [c.Id, E], "muon", "dense mlp"))
            out.append((m + "up_proj.weight", [c.Id, E], "muon", "dense mlp"))
            out.append((m + "down_proj.weight", [E, c.Id], "muon", "dense mlp"))
        else:
            m = p + "block_sparse_moe."
            W = c.Ns * c.I
            out.append((m + "gate.weight", [c.Ne, E], "muon", "router"))
            out.append((m + "routed_expert_down_proj.weight", [c.lat, E], "muon", "latent proj"))
            out.append((m + "routed_expert_norm.weight", [c.lat], "adamw_nd", "latent proj"))
            out.append((m + "routed_expert_up_proj.weight", [E, c.lat], "muon", "latent proj"))
            out.append((m + "shared_experts.gate_proj.weight", [W, E], "muon", "shared experts"))
            out.append((m + "shared_experts.up_proj.weight", [W, E], "muon", "shared experts"))
            out.append((m + "shared_experts.down_proj.weight", [E, W], "muon", "shared experts"))
            for e in range(c.Ne):
                x = m + "experts.%d." % e
                out.append((x + "w1.weight", [c.I, c.lat], "muon", "routed experts"))
                out.append((x + "w3.weight", [c.I, c.lat], "muon", "routed experts"))
                out.append((x + "w2.weight", [c.lat, c.I], "muon", "routed experts"))
    out.append((P_MODEL + "norm.weight", [E], "adamw_nd", "final norm+attnres"))
    out.append((P_MODEL + "output_attn_res_norm.weight", [E], "adamw_nd", "final norm+attnres"))
    out.append((P_MODEL + "output_attn_res_proj.weight", [1, E], "adamw", "final norm+attnres"))
    out.append(("language_model.lm_head.weight", [c.V, E], "adamw", "lm_head"))
    return out


def moe_layers(c):
    return [l for l in range(c.L) if not c.dense[l]]


def bias_name(l):
    return (P_LAYER % l) + "block_sparse_moe.gate.e_score_correction_bias"


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def print_inventory(c):
    inv = inventory(c)
    comp = {}
    for name, shape, group, cname in inv:
        comp[cname] = comp.get(cname, 0) + numel(shape)
    total = sum(comp.values())
    for k in ["embedding", "kda", "mla", "dense mlp", "router", "latent proj",
              "shared experts", "routed experts", "norms+attnres", "final norm+attnres",
              "lm_head"]:
        if k in comp:
            print("%-20s %12d" % (k, comp[k]))
    print("%-20s %12d" % ("total", total))
    print("%-20s %12d" % ("router biases (buf)", c.Ne * len(moe_layers(c))))
    return total


# ---------------------------------------------------------------- model
def rmsnorm(x, g, eps):
    return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def situ(a, u, b1, b2):
    return (b1 * torch.tanh(a / b1) * torch.sigmoid(a)) * (b2 * torch.tanh(u / b2))


def attnres(sources, gnorm, w, eps):
    V = torch.stack(sources, 0)                       # [m, B, T, E]
    K = rmsnorm(V, gnorm, eps)
    s = (K * w.reshape(-1)).sum(-1)                   # [m, B, T]
    a = torch.softmax(s, 0)
    return (a.unsqueeze(-1) * V).sum(0)


def lin(x, W):
    return x @ W.t()


def kda(c, P, a, x):
    B, T, E = x.shape
    H, D, K = c.Hk, c.Dk, c.K
    Pd = H * D
    outs = []
    for n in ["q", "k", "v"]:
        y = lin(x, P[a + n + "_proj.weight"]).transpose(1, 2)          # [B, P, T]
        y = torch.nn.functional.conv1d(y, P[a + n + "_conv1d.weight"], padding=K - 1,
                                       groups=Pd)[..., :T]
        y = torch.nn.functional.silu(y).transpose(1, 2).reshape(B, T, H, D)
        outs.append(y)
    q, k, v = outs
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(lin(x, P[a + "b_proj.weight"]))               # [B, T, H]
    z = lin(lin(x, P[a + "f_a_proj.weight"]), P[a + "f_b_proj.weight"])
    z = (z + P[a + "dt_bias"]).reshape(B, T, H, D)
    A = torch.exp(P[a + "A_log"][:H]).reshape(1, 1, H, 1)
    g = c.gmin * torch.sigmoid(A * z)
    alpha = torch.exp(g)
    S = torch.zeros(B, H, D, D)
    o = []
    qs = q / math.sqrt(D)
    for t in range(T):
        S = S * alpha[:, t].unsqueeze(-1)
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + k[:, t].unsqueeze(-1) * (beta[:, t].unsqueeze(-1) * (v[:, t] - u)).unsqueeze(-2)
        o.append(torch.einsum("bhkv,bhk->bhv", S, qs[:, t]))
    o = torch.stack(o, 1)                                               # [B, T, H, D]
    o = rmsnorm(o, P[a + "o_norm.weight"], c.eps)
    gate = torch.sigmoid(lin(x, P[a + "g_proj.weight"])).reshape(B, T, H, D)
    return lin((o * gate).reshape(B, T, Pd), P[a + "o_proj.weight"])


def mla(c, P, a, x):
    B, T, E = x.shape
    H, dn, dr, dv = c.Hm, c.dn, c.dr, c.dv
    cq = rmsnorm(lin(x, P[a + "q_a_proj.weight"]), P[a + "q_a_layernorm.weight"], 1e-6)
    q = lin(cq, P[a + "q_b_proj.weight"]).reshape(B, T, H, dn + dr)
    ckv = lin(x, P[a + "kv_a_proj_with_mqa.weight"])
    kr = ckv[..., c.rkv:]                                               # [B, T, dr]
    ckv = rmsnorm(ckv[..., :c.rkv], P[a + "kv_a_layernorm.weight"], 1e-6)
    kv = lin(ckv, P[a + "kv_b_proj.weight"]).reshape(B, T, H, dn + dv)
    kn, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([kn, kr.unsqueeze(2).expand(B, T, H, dr)], -1)
    sc = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dn + dr)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    sc = sc.masked_fill(~mask, float("-inf"))
    pr = torch.softmax(sc, -1)
    o = torch.einsum("bhts,bshd->bthd", pr, v).reshape(B, T, H * dv)
    gate = torch.sigmoid(lin(x, P[a + "g_proj.weight"]))
    return lin(gate * o, P[a + "o_proj.weight"])


def mlp(c, P, m, x):
    h = situ(lin(x, P[m + "gate_proj.weight"]), lin(x, P[m + "up_proj.weight"]), c.b1, c.b2)
    return lin(h, P[m + "down_proj.weight"])


def moe(c, P, bias, m, x, qb):
    B, T, E = x.shape
    xs = x.reshape(B * T, E)
    s = torch.sigmoid(lin(xs, P[m + "gate.weight"]))                    # [N, Ne]
    sel = s.detach() + bias
    kk = min(c.k + 1, c.Ne)
    top = torch.topk(sel, kk, dim=-1)
    idx = top.indices[:, :c.k]
    if kk > c.k:
        qb.append((s.detach(), top.values[:, c.k]))
    w = torch.gather(s, 1, idx)
    if c.k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * c.scale
    z = lin(xs, P[m + "routed_expert_down_proj.weight"])                # [N, lat]
    u = torch.zeros(B * T, c.lat)
    for e in range(c.Ne):
        hit = (idx == e)
        rows = hit.any(-1).nonzero().reshape(-1)
        if rows.numel() == 0:
            continue
        pe = (w * hit).sum(-1)[rows]
        x_ = "experts.%d." % e
        h = situ(lin(z[rows], P[m + x_ + "w1.weight"]), lin(z[rows], P[m + x_ + "w3.weight"]),
                 c.b1, c.b2)
        ye = lin(h, P[m + x_ + "w2.weight"])
        u = u.index_add(0, rows, pe.unsqueeze(-1) * ye)
    r = lin(rmsnorm(u, P[m + "routed_expert_norm.weight"], c.eps),
            P[m + "routed_expert_up_proj.weight"])
    sh = mlp(c, P, m + "shared_experts.", xs)
    return (r + sh).reshape(B, T, E)


def forward(c, P, biases, tokens):
    """tokens [B, T+1] -> (logits [B, T, V], mean CE loss, qb list per MoE layer)."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    h = P[P_MODEL + "embed_tokens.weight"][inp]
    blocks, p, empty = [], h, False
    qbs = []
    for l in range(c.L):
        pre = P_LAYER % l
        if blocks:
            a = attnres(blocks + [p], P[pre + "self_attention_res_norm.weight"],
                        P[pre + "self_attention_res_proj.weight"], c.eps)
        else:
            a = p
        if l % c.S == 0:
            blocks = blocks + [p]
            empty = True
        xin = rmsnorm(a, P[pre + "input_layernorm.weight"], c.eps)
        at = pre + "self_attn."
        t = kda(c, P, at, xin) if c.kind[l] == "K" else mla(c, P, at, xin)
        p = t if empty else p + t
        empty = False
        mm = attnres(blocks + [p], P[pre + "mlp_res_norm.weight"],
                     P[pre + "mlp_res_proj.weight"], c.eps)
        xm = rmsnorm(mm, P[pre + "post_attention_layernorm.weight"], c.eps)
        if c.dense[l]:
            f = mlp(c, P, pre + "mlp.", xm)
        else:
            qb = []
            f = moe(c, P, biases[l], pre + "block_sparse_moe.", xm, qb)
            qbs.append(qb[0] if qb else None)
        p = p + f
    x = attnres(blocks + [p], P[P_MODEL + "output_attn_res_norm.weight"],
                P[P_MODEL + "output_attn_res_proj.weight"], c.eps)
    x = rmsnorm(x, P[P_MODEL + "norm.weight"], c.eps)
    logits = lin(x, P["language_model.lm_head.weight"])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, c.V), tgt.reshape(-1))
    return logits, loss, qbs


def qb_update(c, qb):
    """Quantile Balancing (report eq. 14): margins s_ij - alpha_i over the batch;
    bias_j = -(q+1)-th largest margin of expert j with q = floor(m k / n); then
    subtract the mean."""
    s, alpha = qb
    m = s.shape[0]
    marg = s - alpha.unsqueeze(-1)                                     # [m, Ne]
    q = (m * c.k) // c.Ne
    srt = torch.sort(marg, dim=0, descending=True).values
    bh = -srt[q]
    return bh - bh.mean()


# ---------------------------------------------------------------- optimisers
NS_COEF = (3.4445, -4.7750, 2.0315)


def newton_schulz(G, steps=5):
    a, b, cc = NS_COEF
    X = G / (torch.linalg.norm(G) + 1e-7)
    tr = X.shape[0] > X.shape[1]
    if tr:
        X = X.t()
    for _ in range(steps):
        A = X @ X.t()
        Bm = b * A + cc * (A @ A)
        X = a * X + Bm @ X
    return X.t() if tr else X


def lr_at(step, total, lr_max, warmup_frac=0.01, min_ratio=0.1):
    warm = max(1, math.ceil(warmup_frac * total))
    if step < warm:
        return lr_max * (step + 1) / warm
    prog = (step - warm) / max(1, total - warm)
    lo = lr_max * min_ratio
    return lo + 0.5 * (lr_max - lo) * (1 + math.cos(math.pi * prog))


class Optim:
    def __init__(self, c, P, use_muon, lr, total, wd=0.1, b1=0.9, b2=0.95, eps=1e-8,
                 mom=0.95, clip=1.0):
        self.inv = inventory(c)
        self.P = P
        self.use_muon, self.lr, self.total, self.wd = use_muon, lr, total, wd
        self.b1, self.b2, self.eps, self.mom, self.clip = b1, b2, eps, mom, clip
        self.state = {n: [torch.zeros_like(P[n]), torch.zeros_like(P[n])] for n, *_ in self.inv}
        self.t = 0

    def step(self):
        lr = lr_at(self.t, self.total, self.lr)
        self.t += 1
        gn = math.sqrt(sum(float((self.P[n].grad ** 2).sum()) for n, *_ in self.inv))
        cf = self.clip / (gn + 1e-6)
        with torch.no_grad():
            for name, shape, group, _ in self.inv:
                p = self.P[name]
                g = p.grad * cf if cf < 1 else p.grad
                m, v = self.state[name]
                muon = self.use_muon and group not in ("adamw", "adamw_nd")
                decay = group != "adamw_nd"
                if decay:
                    p.mul_(1 - lr * self.wd)
                if not muon:
                    m.mul_(self.b1).add_((1 - self.b1) * g)
                    v.mul_(self.b2).add_((1 - self.b2) * g * g)
                    mh = m / (1 - self.b1 ** self.t)
                    vh = v / (1 - self.b2 ** self.t)
                    p.sub_(lr * mh / (torch.sqrt(vh) + self.eps))
                else:
                    m.mul_(self.mom).add_(g)
                    upd = g + self.mom * m
                    blocks = group[1] if isinstance(group, tuple) else [shape[0]]
                    r0 = 0
                    out = torch.empty_like(upd)
                    for br in blocks:
                        blk = upd[r0:r0 + br]
                        out[r0:r0 + br] = newton_schulz(blk) * (0.2 * math.sqrt(max(blk.shape)))
                        r0 += br
                    p.sub_(lr * out)
        return lr, gn


# ---------------------------------------------------------------- fixture
def make_params(c, gen):
    """Fixture parameters: every tensor random (norm gains near 1, A_log and the
    pseudo-queries non-zero) so that no gradient path is hidden by a symmetric
    initialisation."""
    P = {}
    for name, shape, group, comp in inventory(c):
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("A_log"):
            t = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("dt_bias"):
            t = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("res_proj.weight"):
            t = 0.5 * torch.randn(shape, generator=gen)
        elif "conv1d" in name:
            t = 0.5 * torch.randn(shape, generator=gen)
        elif "embed_tokens" in name:
            t = 1.0 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        P[name] = t.to(DT).requires_grad_(True)
    return P


def init_params(c, gen):
    """The trainer's initialisation (same distributions as tm_init in
    src/train/train.c, drawn from torch's generator): norm gains 1,
    pseudo-queries 0, A_log 0, dt_bias inverse-softplus of LogUniform(1e-3,
    1e-1), conv taps U(+-1/sqrt(K)), every other matrix N(0, 0.02^2)."""
    P = {}
    for name, shape, group, comp in inventory(c):
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(shape)
        elif name.endswith("res_proj.weight") or name.endswith("A_log"):
            t = torch.zeros(shape)
        elif name.endswith("dt_bias"):
            dt = torch.exp(math.log(1e-3) + torch.rand(shape, generator=gen) *
                           (math.log(1e-1) - math.log(1e-3))).clamp(min=1e-4)
            t = dt + torch.log(-torch.expm1(-dt))
        elif "conv1d" in name:
            b = 1.0 / math.sqrt(c.K)
            t = (2 * torch.rand(shape, generator=gen) - 1) * b
        else:
            t = 0.02 * torch.randn(shape, generator=gen)
        P[name] = t.to(DT).requires_grad_(True)
    return P


class Blob:
    def __init__(self):
        self.data = bytearray()
        self.index = {}

    def add(self, key, t):
        t = torch.as_tensor(t).detach().to(torch.float32).contiguous()
        self.index[key] = [len(self.data) // 4, list(t.shape)]
        self.data += struct.pack("<%df" % t.numel(), *t.reshape(-1).tolist())


def fixture(cfg_path, outdir):
    c = Cfg(cfg_path)
    gen = torch.Generator().manual_seed(1234)
    P = make_params(c, gen)
    biases = {l: 0.05 * torch.randn(c.Ne, generator=gen) for l in moe_layers(c)}
    B, T = 2, 20
    tokens = torch.randint(0, c.V, (B, T + 1), generator=gen)
    blob = Blob()
    meta = {"config": "grad-config.json", "B": B, "T": T}
    for name, *_ in inventory(c):
        blob.add("param/" + name, P[name])
    for l in moe_layers(c):
        blob.add("bias/" + bias_name(l), biases[l])
    blob.add("tokens", tokens.to(torch.float32))
    logits, loss, qbs = forward(c, P, biases, tokens)
    loss.backward()
    blob.add("logits", logits)
    meta["loss"] = float(loss)
    for name, *_ in inventory(c):
        g = P[name].grad
        if g is None:  # an expert no token chose: its gradient is zero
            print("no gradient reaches", name, file=sys.stderr)
            g = torch.zeros_like(P[name])
        blob.add("grad/" + name, g)
    for l, qb in zip(moe_layers(c), qbs):
        blob.add("qb/" + bias_name(l), qb_update(c, qb))

    # 10 optimiser steps, AdamW only and Muon, micro-batch 2 x accumulation 2,
    # from the trainer's own initialisation (a well-conditioned start: from the
    # deliberately rough gradient-test parameters the trajectory is chaotic and
    # float32 cannot follow float64 for long).
    steps, accum = 10, 2
    P = init_params(c, gen)
    biases = {l: torch.zeros(c.Ne) for l in moe_layers(c)}
    for name, *_ in inventory(c):
        blob.add("init/" + name, P[name])
    # learnable data: each sequence follows t' = (7 t + 3) mod V from a random
    # start, with one random token in ten
    data = torch.randint(0, c.V, (steps, accum * B, T + 1), generator=gen)
    noise = torch.rand(steps, accum * B, T + 1, generator=gen) < 0.1
    for i in range(1, T + 1):
        nxt = (7 * data[:, :, i - 1] + 3) % c.V
        data[:, :, i] = torch.where(noise[:, :, i], data[:, :, i], nxt)
    blob.add("steps/tokens", data.to(torch.float32))
    meta.update({"steps": steps, "accum": accum, "lr": 0.01, "weight_decay": 0.1,
                 "adam_betas": [0.9, 0.95], "adam_eps": 1e-8, "muon_momentum": 0.95,
                 "clip": 1.0, "warmup_frac": 0.01, "min_lr_ratio": 0.1})
    for mode in ["adamw", "muon"]:
        P2 = {n: P[n].detach().clone().requires_grad_(True) for n in P}
        b2 = {l: biases[l].clone() for l in biases}
        opt = Optim(c, P2, mode == "muon", meta["lr"], steps)
        losses, lrs, gns = [], [], []
        for s in range(steps):
            for n in P2:
                P2[n].grad = torch.zeros_like(P2[n])
            _, loss, qbs = forward(c, P2, b2, data[s])
            loss.backward()
            lr, gn = opt.step()
            for l, qb in zip(moe_layers(c), qbs):
                b2[l] = qb_update(c, qb)
            losses.append(float(loss))
            lrs.append(lr)
            gns.append(gn)
        meta[mode] = {"losses": losses, "lr": lrs, "grad_norm": gns}
        for l in moe_layers(c):
            blob.add("%s/bias/%s" % (mode, bias_name(l)), b2[l])
        print(mode, " ".join("%.6f" % x for x in losses), file=sys.stderr)
    meta["tensors"] = blob.index
    with open(outdir + "/grad.bin", "wb") as f:
        f.write(blob.data)
    with open(outdir + "/grad.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("loss %.8f, %d floats" % (meta["loss"], len(blob.data) // 4), file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "inventory":
        print_inventory(Cfg(sys.argv[2]))
    elif len(sys.argv) >= 4 and sys.argv[1] == "fixture":
        fixture(sys.argv[2], sys.argv[3])
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
