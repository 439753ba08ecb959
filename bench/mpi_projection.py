#!/usr/bin/python3
"""mpi_projection.py: projected decode tokens/s of the full Kimi K3 release on R
ranks (one rank per socket), from the release's config, figures measured by
bench/mpi.sh, and stated host and network figures. The defaults are the
anchor's class of machine: Xeon 8592+ sockets (8 x DDR5-5600: 358 GB/s peak),
two a node with 1 TB (512 GB a rank), 400 Gb/s a node (25 GB/s a rank).

  bench/mpi_projection.py [--measured bench/.cache/mpi.json] [--mem-bw 358] [--ram 512]
                          [--disk 6] [--net-bw 25] [--net-lat 5] [--msg-us 0.5] [--eff 0.8]
                          [--bf16-core 14.6] [--mxfp4-core 9.5] [--layers BENCH_LAYERS_JSON...]
                          [--ranks 1,2,...,32] [--json]

The model (docs/mpi.md explains each term), for the layout k3 runs by default
(tp+ep: the trunk's matrices split by output rows over the ranks, the routed
experts by expert):

  t(R) = split(R) / bw                                    the busiest rank's rows of every split
                                                          matrix (whole 16-row runs) and the head
       + whole / bw                                       what every rank reads whole: MLA's kv_b,
                                                          KDA's f_b, one embedding row, KDA state
       + n_moe * busiest(R) * expert_bytes / read_bw      the slowest rank's experts per layer
       + n_moe * (net_lat + (R-1) msg + recv(R) / net_bw) one expert exchange per MoE layer
       + sum over gathers (net_lat + ceil(log2 R) msg + (R-1)/R out_bytes / net_bw)
                                                          the split products' gathers: 2 a KDA layer,
                                                          3 an MLA layer, 2 a MoE or dense layer, 1 the head

  bw = min(mem_bw * eff, cores * bf16_core)              a byte costs the slower of its read and its
                                                          compute: a core's rate in a decode step at
                                                          the release's dimensions, bin/bench_layers'
                                                          weight bytes per CPU-second (--layers takes
                                                          them from its reports); the experts the
                                                          same with mxfp4_core

as a second figure (split_tokens_per_s) the split-experts layout (tp), where
every rank computes its rows of each of a token's k experts, with two more
gathers a MoE layer and no exchange:

  t_tp(R) = split(R) / bw + whole / bw + n_moe * k * expert_share(R) / read_bw + gathers

and, as a third (replicated_tokens_per_s), the experts-only layout (ep),
where every rank reads the whole trunk and makes only the exchanges:

  t_ep(R) = trunk_read / (mem_bw * eff) + experts + exchanges

  busiest(R): the most of a token's k experts that one rank holds, averaged
              over tokens and layers: drawn from the peer's real release trace
              (per-layer expert popularity) under the traced placement that
              bench/mpi.sh computed (contiguous where none), else uniform;
  read_bw:    min(mem_bw * eff, cores * mxfp4_core) when the rank's share of the experts fits its RAM
              beside the trunk, else a mix with the disk (the resident
              fraction hits, the rest is read at --disk GB/s);
  recv(R):    bytes a rank receives per exchange, (k - k / R) * latent * 4.

The anchor is the published 21 tokens/s on 32 sockets of 16 hosts (one rank
per socket, ~5 ms a token of communication in 581 small collectives). The
compute is taken as bandwidth-bound (decode at batch 1 reads every weight
once): eff is what k3's decode reached of a read probe on the development
host (81-88%), an assumption on a full socket of cores.
"""
import argparse
import gzip
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def text_config(path):
    c = json.load(open(path))
    t = c.get("text_config", c)
    la = t.get("linear_attn_config", {})
    return t, la


def release_bytes(t, la):
    """Bytes one decoded token reads, from the config's shapes (BF16 trunk, MXFP4 experts)."""
    E, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    N, k, l, I = t["num_experts"], t["num_experts_per_token"], t["routed_expert_hidden_size"], t["moe_intermediate_size"]
    S = t.get("num_shared_experts", 0) * I
    H, D, K = la["num_heads"], la["head_dim"], la.get("short_conv_kernel_size", 4)
    P = H * D
    mla_layers = set(x - 1 for x in la.get("full_attn_layers", []))  # 1-based in the config
    Hm, rq, rkv = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
    dn, dr, dv = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    first_dense = t.get("first_k_dense_replace", 0)
    Id = t.get("intermediate_size", 0)
    kda = 2 * (3 * P * E + D * E + P * D + H * E + P * E + E * P) + 4 * 3 * P * K
    mla = 2 * (rq * E + Hm * (dn + dr) * rq + (rkv + dr) * E + Hm * (dn + dv) * rkv + E * Hm * dv
               + (Hm * dv * E if t.get("mla_use_output_gate") else 0))
    moe_trunk = 2 * (N * E + l * E + E * l + 3 * S * E)
    dense = 2 * 3 * Id * E
    expert = 3 * I * l // 2 + 3 * I * l // 32  # MXFP4 nibbles + one E8M0 scale per 32
    trunk, n_moe = 2 * V * E + 2 * E, 0           # lm_head + one embedding row
    for L_ in range(L):
        trunk += mla if L_ in mla_layers else kda
        if L_ < first_dense:
            trunk += dense
        else:
            trunk += moe_trunk
            n_moe += 1
    return dict(trunk=trunk, expert=expert, n_moe=n_moe, k=k, N=N, latent=l, layers=L, E=E,
                experts_total=expert * N * n_moe)


def split_layout(t, la, R):
    """Under tp+ep, per token: the busiest rank's bytes of the split matrices
    (each split in whole 16-row runs, as k_row_share deals them), the bytes
    every rank reads whole, and the gathers' output floats (one entry a gather)."""
    E, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    N, l, I = t["num_experts"], t["routed_expert_hidden_size"], t["moe_intermediate_size"]
    S = t.get("num_shared_experts", 0) * I
    H, D = la["num_heads"], la["head_dim"]
    P = H * D
    mla_layers = set(x - 1 for x in la.get("full_attn_layers", []))
    Hm, rq, rkv = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
    dn, dr, dv = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    first_dense = t.get("first_k_dense_replace", 0)
    Id = t.get("intermediate_size", 0)
    gate = t.get("mla_use_output_gate")

    def share(rows, cols):  # BF16 rows, the busiest part of R
        units = -(-rows // 16)
        return min(rows, -(-units // R) * 16) * cols * 2

    split, whole, gathers = 0, 2 * E, []
    split += share(V, E)
    gathers.append(V)
    for L_ in range(L):
        if L_ in mla_layers:
            split += share(rq, E) + share(rkv + dr, E) + (share(Hm * dv, E) if gate else 0)
            split += share(Hm * (dn + dr), rq) + share(E, Hm * dv)
            whole += 2 * Hm * (dn + dv) * rkv  # kv_b: read per head by the absorbed core
            gathers += [rq + rkv + dr + (Hm * dv if gate else 0), Hm * (dn + dr), E]
        else:
            split += 4 * share(P, E) + share(H, E) + share(D, E) + share(E, P)
            whole += 2 * 4 * H * D * D  # the recurrent state, read and written
            whole += 2 * P * D  # f_b: computed whole on every rank, no gather
            gathers += [4 * P + H + D, E]
        if L_ < first_dense:
            split += 2 * share(Id, E) + share(E, Id)
            gathers += [2 * Id, E]
        else:
            split += share(N, E) + share(l, E) + 2 * share(S, E) + share(E, l) + share(E, S)
            gathers += [N + l + 2 * S, 2 * E]
    return dict(split=split, whole=whole, gathers=gathers)


def split_experts(t, R):
    """Under tp (the routed experts split by output rows too), per MoE layer:
    the busiest rank's MXFP4 bytes of one selected expert (its rows of w1, w3
    and w2, whole 16-row runs) and the two more gathers' output floats (every
    selected expert's gates and ups, then their downs)."""
    l, I, k = t["routed_expert_hidden_size"], t["moe_intermediate_size"], t["num_experts_per_token"]

    def rows(n):
        units = -(-n // 16)
        return min(n, -(-units // R) * 16)

    per = 2 * rows(I) * (l // 2 + l // 32) + rows(l) * (I // 2 + I // 32)
    return dict(expert_share=per, gathers=[2 * k * I, k * l])


def busiest(R, k, N, owner_by_layer, popularity, tokens=64, seed=0):
    """Mean over tokens and layers of the most of a token's k experts one rank holds."""
    if R == 1:
        return float(k)
    rng = np.random.default_rng(seed)
    tot, n = 0.0, 0
    layers = list(popularity.keys()) if popularity else [None]
    for L in layers:
        p = popularity.get(L) if popularity else None
        own = np.array(owner_by_layer.get(L) if owner_by_layer and L in owner_by_layer else
                       [e * R // N for e in range(N)])
        for _ in range(tokens):
            sel = rng.choice(N, size=k, replace=False, p=p)
            tot += np.bincount(own[sel], minlength=R).max()
            n += 1
    return tot / n


def layer_rates(paths):
    """Per-core rates (GB/s of weights a CPU-second) from bin/bench_layers'
    reports at the release's dimensions: per block the smallest CPU time of
    the reports; BF16 from the attention, dense and head blocks (weight bytes
    over CPU seconds), MXFP4 from the MoE block with its 16 resident experts
    once its BF16 part (router, latent projections, shared experts) is
    charged at that BF16 rate."""
    best, expert = {}, None
    for path in paths:
        try:
            j = json.load(open(path))
            for blk in j["blocks"]:
                b = best.setdefault(blk["block"], [blk["weight_bytes"], blk["cpu_s"]])
                b[1] = min(b[1], blk["cpu_s"])
                if blk["block"] == "moe_disk":
                    expert = blk["experts_read"] * blk["expert_bytes"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"mpi_projection.py: {path}: not a bench_layers report ({e})")
    need = ["kda", "mla@1", "dense_mlp", "head", "moe", "moe_disk"]
    if any(n not in best for n in need) or not expert:
        raise SystemExit("mpi_projection.py: the bench_layers reports lack one of " + ", ".join(need))
    bf = sum(best[n][0] for n in need[:4]) / sum(best[n][1] for n in need[:4])
    wb, cpu = best["moe"]
    rest = cpu - (wb - expert) / bf
    if rest <= 0:
        raise SystemExit("mpi_projection.py: the MoE block's CPU time is not above its BF16 part's")
    return bf / 1e9, expert / rest / 1e9


def trace_popularity(path, N):
    """Per layer, the share of requests of each expert in the peer's trace (int32 (layer, expert) pairs)."""
    raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    a = np.frombuffer(raw, dtype=np.int32).reshape(-1, 2)
    pop = {}
    for L in np.unique(a[:, 0]):
        c = np.bincount(a[a[:, 0] == L, 1], minlength=N).astype(float) + 0.5  # (no expert impossible)
        pop[int(L)] = c / c.sum()
    return pop


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fx = os.path.join(HERE, "..", "tests", "fixtures")
    ap.add_argument("--config", default=os.path.join(fx, "k3-release/config.json"))
    ap.add_argument("--trace", default=os.path.join(fx, "peer/expert_trace.bin.gz"))
    ap.add_argument("--measured", default=os.path.join(HERE, ".cache/mpi.json"))
    ap.add_argument("--mem-bw", type=float, default=358.0,
                    help="GB/s one rank reads from its RAM (a socket; 358: Xeon 8592+, 8 x DDR5-5600)")
    ap.add_argument("--eff", type=float, default=0.80, help="share of --mem-bw k3's decode reaches (measured: 81-88%%)")
    ap.add_argument("--cores", type=int, default=64, help="cores a rank (a socket: 64 for the Xeon 8592+)")
    ap.add_argument("--bf16-core", type=float, default=14.6,
                    help="GB/s of BF16 weights one core's products consume (per CPU-second) in a decode "
                         "step at the release's dimensions: bin/bench_layers on the development EPYC, "
                         "5 runs, the smallest CPU time per block (docs/mpi.md)")
    ap.add_argument("--mxfp4-core", type=float, default=9.5,
                    help="the same for the MXFP4 routed experts (from the MoE block, its BF16 part charged "
                         "at --bf16-core)")
    ap.add_argument("--layers", nargs="+", metavar="FILE",
                    help="bin/bench_layers JSON reports at the release's dimensions: take both per-core rates "
                         "from them instead")
    ap.add_argument("--ram", type=float, default=512.0, help="GB of RAM per rank (1 TB a node of 2 sockets)")
    ap.add_argument("--disk", type=float, default=6.0, help="GB/s of expert reads per rank when they do not fit")
    ap.add_argument("--net-bw", type=float, default=25.0,
                    help="GB/s a rank receives (25: 400 Gb/s a node shared by its 2 sockets)")
    ap.add_argument("--net-lat", type=float, default=5.0, help="microseconds a collective costs beyond its bytes")
    ap.add_argument("--msg-us", type=float, default=0.5,
                    help="microseconds a message costs: an expert exchange posts one to each other rank, a "
                         "gather one a round (ceil(log2 R) rounds)")
    ap.add_argument("--ranks", default="1,2,4,8,16,32")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.layers:
        a.bf16_core, a.mxfp4_core = layer_rates(a.layers)
    t, la = text_config(a.config)
    b = release_bytes(t, la)
    G = 1e9
    meas = json.load(open(a.measured)) if os.path.exists(a.measured) else None
    owners = {}
    if meas:
        for p in meas.get("placement", []):
            owners[p["ranks"]] = {L: row for L, row in enumerate(p["owner"])}
    pop = trace_popularity(a.trace, b["N"]) if os.path.exists(a.trace) else None
    # a weight byte costs the slower of its read and its compute
    bw = min(a.mem_bw * a.eff, a.cores * a.bf16_core) * G
    xbw = min(a.mem_bw * a.eff, a.cores * a.mxfp4_core) * G
    rows = []
    for R in [int(x) for x in a.ranks.split(",")]:
        m = busiest(R, b["k"], b["N"], owners.get(R), pop)
        share = b["experts_total"] / R
        room = a.ram * G - b["trunk"] - 16 * G            # trunk, state, OS
        resident = max(0.0, min(1.0, room / share))
        # a miss costs a disk read, a hit a memory read of the same bytes
        per_expert = b["expert"] * (resident / xbw + (1 - resident) / (a.disk * G))
        t_trunk = b["trunk"] / bw
        t_exp = b["n_moe"] * m * per_expert
        recv = (b["k"] - b["k"] / R) * b["latent"] * 4
        t_net = 0 if R == 1 else b["n_moe"] * (a.net_lat * 1e-6 + recv / (a.net_bw * G))
        if R > 1:
            t_net += b["n_moe"] * (R - 1) * a.msg_us * 1e-6
        t_ep = t_trunk + t_exp + t_net
        sp = split_layout(t, la, R)
        t_split = (sp["split"] + sp["whole"]) / bw
        rounds = math.ceil(math.log2(R)) if R > 1 else 0  # Bruck's all-gather: one message a round
        t_gath = 0 if R == 1 else sum(a.net_lat * 1e-6 + rounds * a.msg_us * 1e-6 + f * 4 * (R - 1) / R / (a.net_bw * G)
                                      for f in sp["gathers"])
        t_tp = t_split + t_exp + t_net + t_gath
        # tp: every rank its rows of each of the k selected experts, no exchange
        se = split_experts(t, R)
        t_sexp = b["n_moe"] * b["k"] * se["expert_share"] * (resident / xbw + (1 - resident) / (a.disk * G))
        t_sgath = 0 if R == 1 else t_gath + b["n_moe"] * sum(
            a.net_lat * 1e-6 + rounds * a.msg_us * 1e-6 + f * 4 * (R - 1) / R / (a.net_bw * G) for f in se["gathers"])
        t_all = t_split + t_sexp + t_sgath
        if R == 1:
            t_tp = t_all = t_ep  # one process: nothing is split
        rows.append(dict(ranks=R, busiest_experts=m, resident_share=resident, trunk_s=t_split if R > 1 else t_trunk,
                         experts_s=t_exp, exchange_s=t_net, gathers=len(sp["gathers"]) if R > 1 else 0,
                         gather_s=t_gath, comm_s=t_net + t_gath, tokens_per_s=1 / t_tp,
                         replicated_trunk_s=t_trunk, replicated_tokens_per_s=1 / t_ep,
                         split_experts_s=t_sexp if R > 1 else t_exp, split_comm_s=t_sgath,
                         split_tokens_per_s=1 / t_all,
                         split_collectives=len(sp["gathers"]) + 2 * b["n_moe"] if R > 1 else 0))
    if a.json:
        json.dump(dict(bytes=b, args=vars(a), rows=rows), sys.stdout, indent=1)
        return
    print(f"release: trunk read per token {b['trunk']/G:.1f} GB (BF16), {b['n_moe']} MoE layers x k={b['k']} experts of "
          f"{b['expert']/1e6:.2f} MB ({b['n_moe']*b['k']*b['expert']/G:.1f} GB a token), all experts "
          f"{b['experts_total']/1e12:.3f} TB")
    print(f"compute: {a.cores} cores x {a.bf16_core:g} GB/s BF16, {a.mxfp4_core:g} GB/s MXFP4 a core: trunk at "
          f"{bw/G:.0f} GB/s, experts at {xbw/G:.0f} GB/s")
    print(f"host: {a.mem_bw:g} GB/s memory x {a.eff:g} reached, {a.ram:g} GB RAM a rank, disk {a.disk:g} GB/s; "
          f"network {a.net_bw:g} GB/s a rank, {a.net_lat:g} us a collective + {a.msg_us:g} us a peer")
    print(f"{'ranks':>5} {'busiest':>7} {'resident':>8} {'trunk ms':>8} {'experts ms':>10} {'collectives':>11} "
          f"{'comm ms':>7} {'tok/s':>6} | {'ep: tok/s':>9} | {'tp: experts ms':>14} {'collectives':>11} {'comm ms':>7} "
          f"{'tok/s':>6}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['busiest_experts']:>7.2f} {100*r['resident_share']:>7.0f}% {1e3*r['trunk_s']:>8.1f} "
              f"{1e3*r['experts_s']:>10.1f} {r['gathers'] + (b['n_moe'] if r['ranks'] > 1 else 0):>11} "
              f"{1e3*r['comm_s']:>7.2f} {r['tokens_per_s']:>6.1f} | {r['replicated_tokens_per_s']:>9.2f} | "
              f"{1e3*r['split_experts_s']:>14.1f} {r['split_collectives']:>11} {1e3*r['split_comm_s']:>7.2f} "
              f"{r['split_tokens_per_s']:>6.1f}")
    print("anchor: 21 tokens/s on 32 sockets of 16 hosts (~5 ms a token of communication in 581 collectives)")


if __name__ == "__main__":
    main()
