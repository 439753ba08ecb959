#!/usr/bin/python3
"""release_projection.py: projected decode seconds per token of the full Kimi
K3 release at k3's memory presets, from the bytes a token touches (measured
on the sparse replica), per-core matrix-vector rates (bench/kernels.c) and
stated machine figures (memory bandwidth, cores, disk bandwidth).

  bench/release_projection.py [--validate | --speculation] [--layers FILE [--context N] [--cpu-time]]

--speculation: only the table of s/token by generated ids per forward pass
(speculation; the model is in speculation()'s comment).

Per decoded token (docs/release-scale.md measured these on the replica):
  trunk  108.5 GB of BF16 layer weights (93 layers), head 2.35 GB BF16,
  experts 92 MoE layers x 16 experts x 17.55 MB MXFP4 = 25.5 GB.

The model, per preset (trunk GB, cache GB) on a machine:
  resident trunk R = min(trunk_gb - head - ring, 108.5) in whole layers
      (1.17 GB on average), ring = 0 when all
      layers fit, else 2 slots of 2.34 GB (one slot when only one fits);
  hit rate h      = the expert cache's resident LFU hit rate at cache_gb on
      the real 93-layer trace (k3 cache-sim, table below), interpolated;
  t_compute = bf16 bytes / min(cores * bf16_core, mem_bw * eff)
            + expert bytes / min(cores * mxfp4_core, mem_bw * eff);
  t_io      = ((108.5 - R) + 25.5 * (1 - h)) / disk_bw;
  t = max(t_compute, t_io) where reads overlap compute (two ring slots or
      no ring: k3 reads the next layer and the experts while computing),
      and between that and t_compute + t_io with one ring slot (the laptop
      preset for the release): the two bounds are printed.

--layers FILE: bin/bench_layers' JSON (one decode token through each block
kind at the release's dimensions, timed on this machine). Prints the
per-token compute those figures add up to (each block's best seconds x its
layer count, at each measured MLA context, plus the head), and uses it as
this machine's t_compute in place of bytes / rates (at --context, default
the shortest measured; --cpu-time: the blocks' CPU seconds / threads instead
of their best wall seconds, the figure to use when other jobs shared the
cores during the run): what the per-layer rates say beside what the
whole-token byte model says. The other machines keep the byte model.
Plain python3, no numpy.
"""
import argparse

TRUNK, HEAD, EXPERTS, SLOT = 108.5, 2.35, 25.5, 2.34
# k3 cache-sim ../shared/fixtures/peer/expert_trace.bin --capacity-gb ...:
# resident LFU hit rate (%) by cache GB
HITS = [(0.0, 0.0), (1.49, 0.7), (5.98, 3.4), (19.99, 12.2), (99.98, 66.5), (1440.0, 100.0)]
# bench/kernels.c --quick on this machine's CPU (AMD EPYC, AVX-512, 1 thread,
# the machine quiet: load 2): GB of weights per second per core at width 7168
# (with other jobs on the cores the same run gave 4.8 and 2.6)
BF16_CORE, MXFP4_CORE = 20.5, 14.6
# the same run's read bandwidth at 2 threads, and the rate k3 itself read the
# replica's holes at through io_uring + O_DIRECT in the run validated against
# (4.55 GB/s while reading; dd iflag=direct bs=64M read them at 16.2 GB/s
# beside that run): the holes have no disk, so this is k3's own read path
HERE_MEM_BW, HERE_HOLE_BW = 41.8, 4.55

MEASURED = "25.0 and 27.9 s/token, 134.0 GB read (machine quiet, load 2)"
PRESETS = {"laptop": (5, 1.5), "desktop": (22, 6), "workstation": (100, 20), "server": (115, 100)}


def hit_rate(gb):
    for (a, ha), (b, hb) in zip(HITS, HITS[1:]):
        if gb <= b:
            return (ha + (hb - ha) * (gb - a) / (b - a)) / 100.0
    return 1.0


def auto(mem_gb):
    use = 0.85 * mem_gb
    return max(1, int(use * 0.75)), max(1, int(use * 0.25))


def project(trunk_gb, cache_gb, mem_bw, cores, disk, eff=0.8, tpp=1.0, tc=None):
    avail = trunk_gb - HEAD
    if avail >= TRUNK:
        resident, slots = TRUNK, 0
    else:
        slots = 2 if avail >= 2 * SLOT else 1
        layer = TRUNK / 93  # whole layers are pinned
        resident = max(0.0, avail - slots * SLOT) // layer * layer
    h = hit_rate(cache_gb)
    bw = mem_bw * eff
    if tc is None:
        tc = (TRUNK + HEAD) / min(cores * BF16_CORE, bw) + EXPERTS / min(cores * MXFP4_CORE, bw)
    # a pass of tpp generated ids reads the streamed trunk once; each id's
    # experts are its own (16 of 896 a layer: ids of one pass share few)
    tio = ((TRUNK - resident) / tpp + EXPERTS * (1 - h)) / disk
    lo = max(tc, tio)
    hi = tc + tio if slots == 1 else lo
    return dict(resident=resident, slots=slots, hit=h, tc=tc, tio=tio, lo=lo, hi=hi,
                read=(TRUNK - resident) / tpp + EXPERTS * (1 - h))


MACHINES = [
    # name, RAM GB, memory GB/s, cores, disk GB/s (low, high)
    ("this machine (2-core EPYC, 24 GB)", 24, HERE_MEM_BW, 2, (HERE_HOLE_BW, HERE_HOLE_BW)),
    ("seed: 2x EPYC 7763, 228 GB, NVMe", 228, 300.0, 128, (3.2, 6.0)),
    ("desktop: 64 GB, 8 cores, one NVMe", 64, 60.0, 8, (5.0, 5.0)),
    ("laptop: 16 GB, 8 cores, NVMe", 16, 50.0, 8, (3.0, 3.0)),
]


def fmt(p):
    s = "%.1f" % p["lo"] if abs(p["hi"] - p["lo"]) < 0.05 else "%.1f-%.1f" % (p["lo"], p["hi"])
    return s


def load_layers(path):
    """bench_layers' JSON -> (figures, {context: (wall s/token, CPU s/token)}).
    CPU s/token counts each block's CPU seconds / threads: the time its
    threads ran, which other jobs on a shared machine inflate least."""
    import json
    with open(path) as f:
        j = json.load(f)
    try:
        n = j["layers"]
        thr = j["threads"]
        blocks = {b["block"]: b for b in j["blocks"]}
        fixed = [("kda", n["kda"]), ("dense_mlp", n["dense"]), ("moe", n["moe"]), ("head", 1)]
        mla = sorted((b["context"], b) for b in j["blocks"] if b["block"].startswith("mla@"))
        for name, _ in fixed:
            blocks[name]
    except (KeyError, TypeError) as e:
        raise SystemExit("release_projection.py: %s: not a bench_layers report (missing %s)" % (path, e))
    if not mla:
        raise SystemExit("release_projection.py: %s: no MLA block measured" % path)
    # dense layers run an attention block too (layer 0 is KDA in the release):
    # the KDA and MLA counts already hold every layer's attention
    wall0 = sum(blocks[b]["best_s"] * k for b, k in fixed)
    cpu0 = sum(blocks[b]["cpu_s"] / thr * k for b, k in fixed)
    per_ctx = {}
    for ctx, b in mla:
        per_ctx[ctx] = (wall0 + b["best_s"] * n["mla"], cpu0 + b["cpu_s"] / thr * n["mla"])
    return j, blocks, mla, per_ctx


def print_layers(path, j, blocks, mla, per_ctx):
    n = j["layers"]
    print("per-layer figures from %s (%s, %d threads; read probe %.1f GB/s):"
          % (path, j.get("kernels", "?"), j["threads"], j["probe_gbs"]))
    print("| block | per call, best (s) | of the probe | layers | s/token (best) |")
    print("|---|---|---|---|---|")
    rows = [("kda", n["kda"]), ("dense_mlp", n["dense"]), ("moe", n["moe"]), ("head", 1)]
    rows += [(b["block"], n["mla"]) for _, b in mla]
    for name, k in rows:
        b = blocks[name]
        print("| %s | %.4f | %.0f%% | %d | %.2f |" % (name, b["best_s"], 100 * b["probe_ratio"], k, b["best_s"] * k))
    print()
    for ctx, (w, c) in sorted(per_ctx.items()):
        print("compute per token at context %d: %.1f s (best wall), %.1f s (CPU time / threads)" % (ctx, w, c))
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate", action="store_true", help="only the check against the replica run")
    ap.add_argument("--speculation", action="store_true", help="only the table of s/token by tokens per pass")
    ap.add_argument("--layers", metavar="FILE", help="bin/bench_layers --json output: this machine's compute")
    ap.add_argument("--context", type=int, help="with --layers: the MLA context whose figures set t_compute")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --layers: CPU seconds / threads instead of best wall seconds (a loaded machine)")
    a = ap.parse_args()
    here_tc = None
    if (a.context is not None or a.cpu_time) and not a.layers:
        ap.error("--context and --cpu-time need --layers")
    if a.layers:
        j, blocks, mla, per_ctx = load_layers(a.layers)
        ctx = a.context if a.context is not None else min(per_ctx)
        if ctx not in per_ctx:
            ap.error("--context %d was not measured (measured: %s)" % (ctx, ", ".join(map(str, sorted(per_ctx)))))
        print_layers(a.layers, j, blocks, mla, per_ctx)
        here_tc = per_ctx[ctx][1 if a.cpu_time else 0]
        print("this machine's t_compute below: the per-layer figures at context %d (%s), %.1f s "
              "(the byte model gives %.1f s)" % (ctx, "CPU time / threads" if a.cpu_time else "best wall", here_tc, project(*PRESETS["laptop"], mem_bw=HERE_MEM_BW,
                                                                     cores=2, disk=HERE_HOLE_BW)["tc"]))
        print()
    p = project(*PRESETS["laptop"], mem_bw=HERE_MEM_BW, cores=2, disk=HERE_HOLE_BW, tc=here_tc)
    print("validation, laptop preset on the sparse replica here: projected %.1f-%.1f s/token "
          "(compute %.1f, reads %.1f GB at %.1f s); measured: %s"
          % (p["lo"], p["hi"], p["tc"], p["read"], p["tio"], MEASURED))
    if a.validate:
        return
    if a.speculation:
        speculation()
        return
    print()
    print("| machine | preset (trunk+cache GB) | trunk resident GB | expert hit | GB read/token | s/token |")
    print("|---|---|---|---|---|---|")
    for name, ram, bw, cores, (d0, d1) in MACHINES:
        rows = [("laptop", PRESETS["laptop"])]
        if ram >= 224:
            rows.append(("server", PRESETS["server"]))
        elif ram > 10:
            rows.append(("auto", auto(ram)))
        for pname, (t, c) in rows:
            tc = here_tc if bw == HERE_MEM_BW and cores == 2 else None
            p0 = project(t, c, bw, cores, d0, tc=tc)
            p1 = project(t, c, bw, cores, d1, tc=tc)
            s = fmt(p0) if d0 == d1 else "%s (%.1f GB/s) / %s (%.1f GB/s)" % (fmt(p0), d0, fmt(p1), d1)
            print("| %s | %s (%g+%g) | %.1f | %.1f%% | %.1f | %s |"
                  % (name, pname, t, c, p0["resident"], 100 * p0["hit"], p0["read"], s))

    print()
    speculation()


TPP = (1, 1.5, 2, 3, 4)


def speculation():
    """s/token against generated ids per forward pass (speculation), the seed's
    machine at the laptop, workstation and server presets: the streamed trunk
    is read once a pass (bench/speculate.sh measured it: an oracle-shaped
    checkpoint streamed read 0.20x the trunk bytes a token at 4.97 generated ids a pass),
    the experts each id selects are read as before (the release's 16 of 896 a
    layer overlap little between ids; on the 8-expert oracle shape they did,
    0.57x), and the compute a token is unchanged (no credit for batched
    products). Rejected drafts' expert reads are not counted: the ceiling."""
    print("| preset (trunk+cache GB), seed machine | GB read / token at 1 and 4 ids/pass | "
          + " | ".join("s/token at %g ids/pass" % t for t in TPP) + " |")
    print("|---|---|" + "---|" * len(TPP))
    for pname in ("laptop", "workstation", "server"):
        t, c = PRESETS[pname]
        for disk in (3.2, 6.0):
            cells = [fmt(project(t, c, 300.0, 128, disk, tpp=x)) for x in TPP]
            p1, p4 = project(t, c, 300.0, 128, disk), project(t, c, 300.0, 128, disk, tpp=4)
            print("| %s (%g+%g), NVMe %.1f GB/s | %.1f, %.1f | %s |"
                  % (pname, t, c, disk, p1["read"], p4["read"], " | ".join(cells)))


if __name__ == "__main__":
    main()
