#!/usr/bin/python3
"""kernels_ref.py: our own PyTorch reference for the k3 kernels.

Writes small JSON fixtures under tests/fixtures/kernels/ for cases the peer
fixtures do not cover (other head counts and head dims, conv kernels != 4,
other SiTU betas and decay bounds, MXFP4 and BF16 products). Inputs are
float32 values; expected outputs are computed in float64 with formulations
that differ from the C code (matrix forms, torch conv1d, torch.topk), so the
tests compare two independent routes to the same function.

Usage (from the repository root):  /usr/bin/python3 tools/kernels_ref.py
The output is deterministic for the fixed seeds below; the fixtures are
committed so `make test` needs no Python.
"""
import json
import math
import os
import sys

import torch

OUT = os.path.join("tests", "fixtures", "kernels")
torch.set_default_dtype(torch.float64)


def t32(shape, lo, hi, gen):
    """float32 uniform values, returned as float64 tensors holding them exactly."""
    x = torch.rand(shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo
    return x.double()


def arr(x, digits=9):
    x = x.detach()
    flat = x.reshape(-1).tolist()
    if digits:
        flat = [float("%.*g" % (digits, v)) for v in flat]
    return {"shape": list(x.shape), "data": flat}


def save(name, obj):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
    print("wrote %s (%d bytes)" % (path, os.path.getsize(path)), file=sys.stderr)


# ---- KDA ------------------------------------------------------------------------


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_reference(q, k, v, g, beta, S0):
    """Matrix form of the delta rule: S_t = (I - b k k^T) Diag(a) S + b k v^T,
    o_t = S_t^T q_t / sqrt(D). Shapes: q,k,v,g [T,H,D], beta [T,H], S0 [H,D,D]."""
    T, H, D = q.shape
    S = S0.clone()
    o = torch.zeros(T, H, D)
    eye = torch.eye(D)
    for t in range(T):
        for h in range(H):
            kk = k[t, h].unsqueeze(1)
            b = beta[t, h]
            A = torch.diag(torch.exp(g[t, h]))
            S[h] = (eye - b * kk @ kk.T) @ A @ S[h] + b * kk @ v[t, h].unsqueeze(0)
            o[t, h] = S[h].T @ q[t, h] / math.sqrt(D)
    return o, S


def kda_case(name, T, H, D, lower, seed, zero_state):
    gen = torch.Generator().manual_seed(seed)
    q = l2n(t32((T, H, D), -1, 1, gen).float()).double()
    k = l2n(t32((T, H, D), -1, 1, gen).float()).double()
    v = t32((T, H, D), -2, 2, gen)
    g = t32((T, H, D), lower, 0, gen)
    beta = t32((T, H), 0.01, 0.99, gen)
    S0 = torch.zeros(H, D, D) if zero_state else t32((H, D, D), -0.5, 0.5, gen)
    o, S = kda_reference(q, k, v, g, beta, S0)
    save(name, {
        "T": T, "H": H, "D": D, "lower": lower,
        "note": "q,k already L2-normalised per head (kernel input); q NOT scaled; g = log decay",
        "q": arr(q), "k": arr(k), "v": arr(v), "g": arr(g), "beta": arr(beta), "S0": arr(S0),
        "out": arr(o, 9), "state_out": arr(S, 9),
    })


def gate_case(name, T, H, D, lower, seed):
    gen = torch.Generator().manual_seed(seed)
    z = t32((T, H, D), -4, 4, gen)
    A_log = t32((H,), -1, 1.5, gen)
    dt_bias = t32((H, D), -1, 1, gen)
    g = lower * torch.sigmoid(torch.exp(A_log).view(1, H, 1) * (z + dt_bias.unsqueeze(0)))
    save(name, {"T": T, "H": H, "D": D, "lower": lower, "z": arr(z), "A_log": arr(A_log),
                "dt_bias": arr(dt_bias), "g": arr(g, 9)})


# ---- ShortConv -------------------------------------------------------------------


def conv_case(name, T, C, K, seed):
    gen = torch.Generator().manual_seed(seed)
    x = t32((T, C), -2, 2, gen)
    w = t32((C, K), -0.6, 0.6, gen)
    state = t32((C, K - 1), -1, 1, gen)  # carried inputs, oldest first
    x2 = t32((2, C), -2, 2, gen)  # a second call continues from the new state
    full = torch.cat([state.T, x, x2], 0)  # [K-1 + T + 2, C]
    y = torch.nn.functional.conv1d(full.T.unsqueeze(0), w.unsqueeze(1), groups=C)[0].T
    y = torch.nn.functional.silu(y)
    state_after = full[T: T + K - 1].T  # the K-1 inputs before x2
    save(name, {"T": T, "C": C, "K": K, "x": arr(x), "w": arr(w), "state": arr(state),
                "x2": arr(x2), "out": arr(y[:T], 9), "state_after": arr(state_after),
                "out2": arr(y[T:], 9)})


# ---- SiTU, norms, router --------------------------------------------------------------


def situ_case(name, seed, betas):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for b1, b2 in betas:
        a = torch.cat([t32((24,), -3, 3, gen), t32((8,), -300, 300, gen)])
        u = torch.cat([t32((24,), -3, 3, gen), t32((8,), -3000, 3000, gen)])
        out = (b1 * torch.tanh(a / b1) * torch.sigmoid(a)) * (b2 * torch.tanh(u / b2))
        cases.append({"b1": b1, "b2": b2, "gate": arr(a), "up": arr(u), "out": arr(out, 9)})
    save(name, {"cases": cases})


def router_case(name, seed):
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for n, k, renorm, scale in [(16, 4, False, 2.5), (24, 6, True, 1.0), (12, 1, True, 0.75)]:
        rows = []
        for _ in range(4):
            logits = t32((n,), -3, 3, gen)
            bias = t32((n,), -0.3, 0.3, gen)
            s = torch.sigmoid(logits)
            _, idx = torch.topk(s + bias, k)  # sorted, descending
            w = s[idx]
            if renorm and k > 1:
                w = w / (w.sum() + 1e-20)
            w = w * scale
            rows.append({"logits": arr(logits), "bias": arr(bias), "idx": idx.tolist(), "w": arr(w, 9)})
        cases.append({"n": n, "k": k, "renorm": renorm, "scale": scale, "rows": rows})
    save(name, {"cases": cases})


def norm_case(name, seed):
    gen = torch.Generator().manual_seed(seed)
    x = t32((3, 40), -3, 3, gen)
    gain = t32((40,), 0.5, 1.5, gen)
    eps = 1e-6
    rms = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    l2 = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    sm = torch.softmax(x * 4, -1)
    save(name, {"eps": eps, "x": arr(x), "gain": arr(gain), "rms_gain": arr(rms * gain, 9),
                "rms_nogain": arr(rms, 9), "l2": arr(l2, 9), "softmax_of_4x": arr(sm, 9)})


# ---- products --------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def mxfp4_case(name, rows, cols, group, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=gen)
    scales = torch.randint(118, 126, (rows, cols // group), generator=gen)
    scales[1, 0] = 255  # zeroes that group
    lut = torch.tensor(E2M1)
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(rows, cols)  # low nibble = even
    sc = torch.where(scales == 255, torch.zeros(()), torch.pow(2.0, (scales - 127).double()))
    W = lut[codes] * sc.repeat_interleave(group, 1)
    x = t32((3, cols), -1, 1, gen)
    y = x @ W.T
    save(name, {"rows": rows, "cols": cols, "group": group, "packed": arr(packed), "scales": arr(scales),
                "x": arr(x), "y": arr(y, 9)})


def bf16_case(name, rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((rows, cols), generator=gen, dtype=torch.float32).to(torch.bfloat16)
    bits = w.view(torch.int16).to(torch.int32) & 0xFFFF
    x = t32((2, cols), -1, 1, gen)
    y = x @ w.double().T
    save(name, {"rows": rows, "cols": cols, "bits": arr(bits), "x": arr(x), "y": arr(y, 9)})


def main():
    kda_case("kda_h3_d32.json", T=20, H=3, D=32, lower=-5.0, seed=1, zero_state=False)
    kda_case("kda_h2_d8.json", T=9, H=2, D=8, lower=-2.0, seed=2, zero_state=True)
    kda_case("kda_h1_d64.json", T=40, H=1, D=64, lower=-5.0, seed=3, zero_state=False)
    gate_case("gate_h3_d12.json", T=2, H=3, D=12, lower=-3.0, seed=4)
    conv_case("conv_k3.json", T=5, C=24, K=3, seed=5)
    conv_case("conv_k5.json", T=3, C=20, K=5, seed=6)
    conv_case("conv_k2.json", T=4, C=17, K=2, seed=7)
    situ_case("situ_betas.json", seed=8, betas=[(2.0, 10.0), (8.0, 50.0), (4.0, 25.0)])
    router_case("router_cases.json", seed=9)
    norm_case("norms.json", seed=10)
    mxfp4_case("mxfp4_matvec.json", rows=24, cols=96, group=32, seed=11)
    mxfp4_case("mxfp4_group16.json", rows=8, cols=48, group=16, seed=12)
    bf16_case("bf16_matvec.json", rows=20, cols=70, seed=13)


if __name__ == "__main__":
    main()
