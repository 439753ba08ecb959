#!/usr/bin/env python3
"""PyTorch speed reference for `k3 train` (bench/train.c measures the C side).

Same model as tools/train_ref.py (its forward, imported), but float32, a
chunkwise KDA (chunk 16, the same e^G / e^-G factorisation as
src/train/tkda.c) instead of the per-position loop, and torch.optim.AdamW:
the configuration of issue 5's PyTorch anchor (eager PyTorch 1.13, Debian
python3-torch). Random tokens; one warm-up step, then timed optimiser steps.

  /usr/bin/python3 tools/bench_torch.py CONFIG --batch 16 --seq 256 --accum 2 \\
      --steps 1 --threads 1,2

Prints one JSON object per thread count: tokens_per_s, s_per_step (wall) and
cpu_s_per_step (process CPU time)."""
import argparse, json, math, os, sys, time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ref as R  # noqa: E402


def kda_chunked(c, P, a, x, C=16):
    B, T, E = x.shape
    H, D, K = c.Hk, c.Dk, c.K
    Pd = H * D
    outs = []
    for n in ["q", "k", "v"]:
        y = R.lin(x, P[a + n + "_proj.weight"]).transpose(1, 2)
        y = torch.nn.functional.conv1d(y, P[a + n + "_conv1d.weight"], padding=K - 1, groups=Pd)[..., :T]
        outs.append(torch.nn.functional.silu(y).transpose(1, 2).reshape(B, T, H, D))
    q, k, v = outs
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(R.lin(x, P[a + "b_proj.weight"]))                 # [B, T, H]
    z = R.lin(R.lin(x, P[a + "f_a_proj.weight"]), P[a + "f_b_proj.weight"])
    z = (z + P[a + "dt_bias"]).reshape(B, T, H, D)
    A = torch.exp(P[a + "A_log"][:H]).reshape(1, 1, H, 1)
    g = c.gmin * torch.sigmoid(A * z)
    # [B, H, T, D]
    q, k, v, g = (t.transpose(1, 2) for t in (q / math.sqrt(D), k, v, g))
    beta = beta.transpose(1, 2)
    S = torch.zeros(B, H, D, D)
    o = []
    for t0 in range(0, T, C):
        L = min(C, T - t0)
        qc, kc, vc, bc = q[:, :, t0:t0 + L], k[:, :, t0:t0 + L], v[:, :, t0:t0 + L], beta[:, :, t0:t0 + L]
        G = torch.cumsum(g[:, :, t0:t0 + L], 2)
        eG, eN = torch.exp(G), torch.exp(-G)
        KG, KN, QG = kc * eG, kc * eN, qc * eG
        Am = (KG @ KN.transpose(-1, -2)).tril(-1)
        Bm = (QG @ KN.transpose(-1, -2)).tril()
        rhs = bc.unsqueeze(-1) * (vc - KG @ S)
        # (I + diag(beta) A) W = rhs
        M = torch.eye(L) + bc.unsqueeze(-1) * Am
        W = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        o.append(QG @ S + Bm @ W)
        eGl = eG[:, :, -1:]
        S = eGl.transpose(-1, -2) * S + (KN * eGl).transpose(-1, -2) @ W
    o = torch.cat(o, 2).transpose(1, 2)                                    # [B, T, H, D]
    o = R.rmsnorm(o, P[a + "o_norm.weight"], c.eps)
    gate = torch.sigmoid(R.lin(x, P[a + "g_proj.weight"])).reshape(B, T, H, D)
    return R.lin((o * gate).reshape(B, T, Pd), P[a + "o_proj.weight"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    torch.set_default_dtype(torch.float32)
    R.DT = torch.float32
    R.kda = kda_chunked
    c = R.Cfg(args.config)
    gen = torch.Generator().manual_seed(1)
    P = R.init_params(c, gen)
    P = {k: v.detach().float().requires_grad_(True) for k, v in P.items()}
    biases = {l: torch.zeros(c.Ne) for l in R.moe_layers(c)}
    opt = torch.optim.AdamW(list(P.values()), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ntok = args.batch * args.seq * args.accum
    for nt in [int(s) for s in args.threads.split(",") if s]:
        torch.set_num_threads(nt)
        wall = cpu = 0.0
        for st in range(args.steps + 1):
            w0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            for _ in range(args.accum):
                tok = torch.randint(0, c.V, (args.batch, args.seq + 1), generator=gen)
                _, loss, _ = R.forward(c, P, biases, tok)
                (loss / args.accum).backward()
            torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
            opt.step()
            if st:
                wall += time.perf_counter() - w0
                cpu += time.process_time() - c0
        print(json.dumps({"impl": "pytorch", "config": args.config, "threads": nt, "tokens_per_step": ntok,
                          "s_per_step": wall / args.steps, "cpu_s_per_step": cpu / args.steps,
                          "tokens_per_s": ntok * args.steps / wall,
                          "tokens_per_cpu_s": ntok * args.steps / cpu, "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
