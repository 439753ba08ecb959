#!/usr/bin/python3
"""release_projection.py: projected decode seconds per token of the full Kimi
K3 release at k3's memory presets, from the bytes a token touches (measured
on the sparse replica), per-core matrix-vector rates (bench/kernels.c) and
stated machine figures (memory bandwidth, cores, disk bandwidth).

  bench/release_projection.py [--validate | --speculation] [--layers FILE... [--context N] [--cpu-time]]
                              [--tau T]

--speculation: only the table of s/token by generated ids per forward pass
(speculation; the model is in speculation()'s comment).
--tau T: the generated ids per pass of the speculation column of the main
table (default 1.07: n-gram drafts, `k3 run --speculate 4`, measured by
bench/speculate.sh, docs/speculation.md); the column is s/token / T.

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

--layers FILE...: bin/bench_layers' JSON (one decode token through each block
kind at the release's dimensions, timed on this machine); several reports of
repeated runs give per block the smallest time of all and the spread. Prints the
per-token compute those figures add up to (each block's best seconds x its
layer count, at each measured MLA context, plus the head), and uses it as
this machine's t_compute in place of bytes / rates (at --context, default
the shortest measured; --cpu-time: the blocks' CPU seconds / threads instead
of their best wall seconds, the figure to use when other jobs shared the
cores during the run): what the per-layer rates say beside what the
whole-token byte model says. The other machines keep the byte model.

The MoE layer with its experts read from disk (bench_layers' moe_disk row:
the 16 selected experts of 17.5 MB read through the engine's streaming
source, io_uring + O_DIRECT, overlapped with the block's compute as in a
streamed decode): with --layers, a row for this machine with a real disk in
place of the replica's holes, where a token's MoE layers cost
  92 x (h x moe + (1 - h) x moe_disk)
(the expert reads, what they overlap and what they cost beyond the resident
block, measured together), the trunk is read at the disk's sequential rate
through the same reader (moe_disk's disk_probe_gbs: the file read whole in
2 MiB pieces, 4 in flight, as the ring reads a layer), and the rest computes
as measured; t = that MoE time + max(the other
compute, the trunk reads) with two ring slots or none (expert batches pause
the trunk reads), up to their sum with one slot.
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
MEASURED_LO, MEASURED_HI = 25.0, 27.9
# generated ids a forward pass with n-gram drafts (k3 run --speculate 4), the
# one draft source k3 has for the release (a draft model must share its
# tokenizer): bench/speculate.sh, 20 TinyStories prompts, greedy and sampled
TAU_NGRAM = 1.07
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
    ("this machine (2-core EPYC, 24 GB), the replica's holes", 24, HERE_MEM_BW, 2, (HERE_HOLE_BW, HERE_HOLE_BW)),
    ("seed: 2x EPYC 7763, 228 GB, NVMe", 228, 300.0, 128, (3.2, 6.0)),
    ("desktop: 64 GB, 8 cores, one NVMe", 64, 60.0, 8, (5.0, 5.0)),
    ("laptop: 16 GB, 8 cores, NVMe", 16, 50.0, 8, (3.0, 3.0)),
]


def fmt(p):
    s = "%.1f" % p["lo"] if abs(p["hi"] - p["lo"]) < 0.05 else "%.1f-%.1f" % (p["lo"], p["hi"])
    return s


def merge_reports(paths):
    """Several bench_layers reports of the same config (repeated runs on a
    shared machine) as one: per block the smallest best and CPU seconds (the
    least disturbed call), the largest read rates, the median and the spread
    (largest best / smallest) kept beside them."""
    import json
    js = []
    for path in paths:
        with open(path) as f:
            js.append(json.load(f))
    if len(js) == 1:
        return js[0]
    j = dict(js[0])
    try:
        names = [b["block"] for b in js[0]["blocks"]]
        out = []
        for name in names:
            rows = [[b for b in x["blocks"] if b["block"] == name][0] for x in js]
            m = dict(min(rows, key=lambda b: b["best_s"]))
            m["cpu_s"] = min(b["cpu_s"] for b in rows)
            m["spread"] = max(b["best_s"] for b in rows) / m["best_s"]
            for k in ("read_mbs", "disk_probe_gbs"):
                if k in m:
                    m[k] = max(b[k] for b in rows)
            out.append(m)
        j["blocks"] = out
        j["probe_gbs"] = max(x["probe_gbs"] for x in js)
        j["probe_cpu_gbs"] = max(x["probe_cpu_gbs"] for x in js)
    except (KeyError, IndexError, TypeError) as e:
        raise SystemExit("release_projection.py: %s: not bench_layers reports of one config (%s)" % (", ".join(paths), e))
    j["reports"] = len(js)
    return j


def load_layers(paths):
    """bench_layers' JSON -> (figures, {context: (wall s/token, CPU s/token)}).
    CPU s/token counts each block's CPU seconds / threads: the time its
    threads ran, which other jobs on a shared machine inflate least."""
    path = ", ".join(paths)
    j = merge_reports(paths)
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
    if "moe_disk" in blocks and not all(k in blocks["moe_disk"] for k in ("read_mbs", "disk_probe_gbs")):
        raise SystemExit("release_projection.py: %s: not a bench_layers report (moe_disk without its read rates)"
                         % path)
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
    if j.get("reports", 1) > 1:
        print("(%d reports: per block the smallest best time of all; spread = largest best / smallest)" % j["reports"])
    print("| block | per call, best (s) | of the probe | layers | s/token (best) | spread |")
    print("|---|---|---|---|---|---|")
    rows = [("kda", n["kda"]), ("dense_mlp", n["dense"]), ("moe", n["moe"]), ("head", 1)]
    if "moe_disk" in blocks:
        rows.insert(3, ("moe_disk", n["moe"]))
    rows += [(b["block"], n["mla"]) for _, b in mla]
    for name, k in rows:
        b = blocks[name]
        print("| %s | %.4f | %.0f%% | %d | %.2f | %.2fx |" % (name, b["best_s"], 100 * b["probe_ratio"], k,
                                                          b["best_s"] * k, b.get("spread", 1.0)))
    print()
    for ctx, (w, c) in sorted(per_ctx.items()):
        print("compute per token at context %d: %.1f s (best wall), %.1f s (CPU time / threads)" % (ctx, w, c))
    if "moe_disk" in blocks:
        d = blocks["moe_disk"]
        print("MoE layer with its %d experts read from disk: %.1f ms (resident %.1f ms), %.0f MB/s read (%s%s); "
              "the disk's sequential rate through the same reader %.2f GB/s"
              % (d["experts_read"], 1e3 * d["best_s"], 1e3 * blocks["moe"]["best_s"], d["read_mbs"], d["backend"],
                 ", O_DIRECT" if d["direct"] else ", buffered", d["disk_probe_gbs"]))
    print()


def project_disk_here(trunk_gb, cache_gb, blocks, n, tc, trunk_bw):
    """This machine with a real disk: the MoE layers from the measured
    moe_disk row (reads and compute together), the trunk read at trunk_bw GB/s,
    the other blocks' compute as measured (tc minus the resident MoE blocks)."""
    p = project(trunk_gb, cache_gb, HERE_MEM_BW, 2, trunk_bw, tc=tc)
    h = p["hit"]
    moe_t = n["moe"] * (h * blocks["moe"]["best_s"] + (1 - h) * blocks["moe_disk"]["best_s"])
    other = tc - n["moe"] * blocks["moe"]["best_s"]
    trunk_io = (TRUNK - p["resident"]) / trunk_bw
    lo = moe_t + max(other, trunk_io)
    hi = moe_t + other + trunk_io if p["slots"] == 1 else lo
    return dict(p, lo=lo, hi=hi, tio=trunk_io, moe_t=moe_t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validate", action="store_true", help="only the check against the replica run")
    ap.add_argument("--speculation", action="store_true", help="only the table of s/token by tokens per pass")
    ap.add_argument("--layers", metavar="FILE", nargs="+",
                    help="bin/bench_layers --json output (several: repeated runs, per block the smallest time)")
    ap.add_argument("--context", type=int, help="with --layers: the MLA context whose figures set t_compute")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --layers: CPU seconds / threads instead of best wall seconds (a loaded machine)")
    ap.add_argument("--tau", type=float, default=TAU_NGRAM,
                    help="generated ids per forward pass for the speculation column (default %(default)s: n-gram)")
    a = ap.parse_args()
    if a.tau < 1:
        ap.error("--tau is generated ids a pass: at least 1")
    here_tc = None
    blocks = n = None
    if (a.context is not None or a.cpu_time) and not a.layers:
        ap.error("--context and --cpu-time need --layers")
    if a.layers:
        j, blocks, mla, per_ctx = load_layers(a.layers)
        ctx = a.context if a.context is not None else min(per_ctx)
        if ctx not in per_ctx:
            ap.error("--context %d was not measured (measured: %s)" % (ctx, ", ".join(map(str, sorted(per_ctx)))))
        print_layers(", ".join(a.layers), j, blocks, mla, per_ctx)
        n = j["layers"]
        here_tc = per_ctx[ctx][1 if a.cpu_time else 0]
        print("this machine's t_compute below: the per-layer figures at context %d (%s), %.1f s "
              "(the byte model gives %.1f s)" % (ctx, "CPU time / threads" if a.cpu_time else "best wall", here_tc, project(*PRESETS["laptop"], mem_bw=HERE_MEM_BW,
                                                                     cores=2, disk=HERE_HOLE_BW)["tc"]))
        print()
    p = project(*PRESETS["laptop"], mem_bw=HERE_MEM_BW, cores=2, disk=HERE_HOLE_BW, tc=here_tc)
    print("validation, laptop preset on the sparse replica here: projected %.1f-%.1f s/token "
          "(compute %.1f, reads %.1f GB at %.1f s); measured: %s"
          % (p["lo"], p["hi"], p["tc"], p["read"], p["tio"], MEASURED))
    mid = (MEASURED_LO + MEASURED_HI) / 2
    print("  the measured mean %.1f s is %.0f%% of the projected lower bound and %.0f%% of the upper"
          % (mid, 100 * mid / p["lo"], 100 * mid / p["hi"]))
    if a.validate:
        return
    if a.speculation:
        speculation()
        return
    print()
    tau = a.tau
    print("| machine | preset (trunk+cache GB) | trunk resident GB | expert hit | GB read/token | s/token | "
          "s/token / tau %g (speculation) |" % tau)
    print("|---|---|---|---|---|---|---|")

    def cell(ps):
        return " / ".join(fmt(p) for p in ps)

    def spec(ps):
        return " / ".join(fmt(dict(p, lo=p["lo"] / tau, hi=p["hi"] / tau)) for p in ps)

    if blocks is not None and "moe_disk" in blocks:
        rate = blocks["moe_disk"]["disk_probe_gbs"]
        for pname, (t, c) in (("laptop", PRESETS["laptop"]), ("auto", auto(24))):
            p = project_disk_here(t, c, blocks, n, here_tc, rate)
            print("| this machine, its disk (trunk at %.2f GB/s, experts as the MoE-from-disk row) | %s (%g+%g) | %.1f | "
                  "%.1f%% | %.1f | %s | %s |" % (rate, pname, t, c, p["resident"], 100 * p["hit"], p["read"],
                                                 cell([p]), spec([p])))
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
            ps = [p0] if d0 == d1 else [p0, p1]
            print("| %s | %s (%g+%g) | %.1f | %.1f%% | %.1f | %s | %s |"
                  % (name, pname, t, c, p0["resident"], 100 * p0["hit"], p0["read"], cell(ps), spec(ps)))

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
