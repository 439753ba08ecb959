#!/usr/bin/python3
"""bench/report.py: issue 7's summary table, measured in one run.

    bench/report.sh [--quick] [--only decode,prefill,stream,train,index,ttft]
                    [--cache DIR] [--json F] [--svg F] [--md F] [...]
    bench/report.py --render REPORT.json [--svg F] [--md F]

Runs the benchmarks (bin/bench_decode, bin/bench_stream, bin/bench_train +
tools/bench_torch.py, bin/bench_index, `k3 run` for the time to first token)
with a short configuration, reads their machine-readable output (--json of
each bench), and prints ONE table: target | measured | roofline or reference
measured in the same run | share | issue goal | met?, with the machine's
conditions. Writes everything as JSON (the benches' raw figures, the
conditions and the rows) and a bar chart (SVG) of each target's share of its
roofline with the goal marked.

The checkpoints it needs are built once under the cache directory (--cache,
$K3_BENCH_CACHE, default bench/.cache) and reused while their stamp (the
command that built them) matches and they open: the 627 MB mid
checkpoint (gen_checkpoint.py --preset mid), the 2.1 GB streaming checkpoint with its packed trunk, the sparse
replica of the release (497,220 tensors). --render recomputes the table and
the chart from a report JSON without running anything (tests use it).

Standard library only; bench/report.sh builds the binaries first. Not a test:
the figures depend on the machine and its load (see the conditions block).
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

PY = "/usr/bin/python3"
SECTIONS = ["decode", "prefill", "stream", "train", "index", "ttft"]

# The goals (issue 7, "Targets").
GOAL_DECODE_SHARE = 0.70      # of the memory-bandwidth roofline, at 1 and 2 threads
GOAL_PREFILL_TOKS = 400.0     # tokens/s on a 256-token prompt
GOAL_STREAM_SHARE = 0.80      # of the disk roofline
GOAL_TRAIN_TOKS = 2829.0      # tokens/s, smol-50m, two cores
GOAL_TRAIN_VS_TORCH = 3.0     # the floor: 3x PyTorch measured in the same run
GOAL_INDEX_S = 0.1            # index the 497,220-tensor replica
GOAL_TTFT_S = 1.0             # first token, 601 MB checkpoint, warm

FULL = dict(decode_prompt=256, decode_gen=32, decode_probe_mb=1024, decode_threads="1,2",
            stream_prompt=16, stream_gen=8, stream_repeat=3, stream_probe=1.0, stream_rungs="",
            train_config="configs/smol-50m.json", train_batch=4, train_seq=256, train_steps=1,
            train_threads="2", train_modes="f32,bf16", train_optimizer="adamw",
            index_repeats=5, ttft_runs=5)
QUICK = dict(decode_prompt=32, decode_gen=4, decode_probe_mb=64, decode_threads="1,2",
             stream_prompt=4, stream_gen=2, stream_repeat=1, stream_probe=0.2, stream_rungs="5,8",
             train_config="configs/smol-5m.json", train_batch=1, train_seq=32, train_steps=1,
             train_threads="2", train_modes="f32", train_optimizer="adamw",
             index_repeats=2, ttft_runs=2)

# How each cached input is built (argv after the interpreter; OUT is replaced).
GEN_MID = ["tools/gen_checkpoint.py", "OUT", "--preset", "mid", "--force"]
GEN_STREAM = ["tools/gen_checkpoint.py", "OUT", "--preset", "mid", "--target-bytes", "2.1e9",
              "--seed", "4", "--force"]
# --quick: one small checkpoint of the mid layout (155 MB) for decode,
# streaming, the index and the first token.
GEN_QUICK = ["tools/gen_checkpoint.py", "OUT", "--preset", "mid", "--set", "hidden_size=512",
             "--set", "num_experts=16", "--set", "vocab_size=8000", "--set", "intermediate_size=1024",
             "--force"]
GEN_REPLICA = ["tools/make_sparse_replica.py", "OUT"]


def log(msg):
    print("[report] " + msg, file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------------
# inputs: build once, reuse while the stamp matches

def cached_input(cache, name, gen, check):
    """CACHE/name built by `gen` unless CACHE/name.stamp holds the same command
    and check(path) says it opens. Returns the path."""
    path = os.path.join(cache, name)
    cmd = [PY] + [path if a == "OUT" else a for a in gen]
    stamp = path + ".stamp"
    want = " ".join(shlex.quote(a) for a in [PY] + gen)  # OUT kept: the cache may move
    try:
        with open(stamp) as f:
            have = f.read().strip()
    except OSError:
        have = None
    if have == want and check(path):
        return path
    log("building %s (once; cached): %s" % (path, want))
    if os.path.exists(stamp):
        os.unlink(stamp)
    t0 = time.time()
    run_logged(cmd, os.path.join(cache, "logs", name + ".gen.log"))
    if not check(path):
        raise BenchError("%s: built but does not open" % path)
    with open(stamp + ".tmp", "w") as f:
        f.write(want + "\n")
    os.replace(stamp + ".tmp", stamp)
    log("built %s in %.0f s" % (path, time.time() - t0))
    return path


def opens(path):
    """The directory is a checkpoint the engine can index."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    r = subprocess.run(["bin/bench_index", path, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return r.returncode == 0


TRUNK_VERSION = 2  # the packed trunk's format version this k3 reads (K3_TRUNK_VERSION, src/memory/trunk.h)


def trunk_version(index):
    try:
        with open(index) as f:
            return json.load(f).get("version")
    except (OSError, ValueError):
        return None


def packed_trunk(cache, name, model):
    """CACHE/name: `k3 pack-trunk model`, redone when the model's stamp changes."""
    path = os.path.join(cache, name)
    stamp = path + ".stamp"
    with open(model + ".stamp") as f:
        want = f.read().strip()
    try:
        with open(stamp) as f:
            have = f.read().strip()
    except OSError:
        have = None
    index = os.path.join(path, "trunk.json")
    if have == want and os.path.isfile(index) and trunk_version(index) == TRUNK_VERSION:
        return path
    log("packing the trunk of %s into %s (once; cached)" % (model, path))
    if os.path.exists(stamp):
        os.unlink(stamp)
    run_logged(["bin/k3", "pack-trunk", model, path], os.path.join(cache, "logs", name + ".pack.log"))
    with open(stamp + ".tmp", "w") as f:
        f.write(want + "\n")
    os.replace(stamp + ".tmp", stamp)
    return path


def run_logged(cmd, logpath, env=None):
    """Runs cmd with stdout+stderr into logpath; returns stdout text. Raises
    BenchError with the log's tail on a nonzero exit."""
    os.makedirs(os.path.dirname(logpath), exist_ok=True)
    with open(logpath, "w") as f:
        f.write("$ " + " ".join(shlex.quote(a) for a in cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        out = r.stdout.decode("utf-8", "replace")
        f.write(out)
    if r.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-3:])
        raise BenchError("%s exited %d: %s (log: %s)" % (cmd[0], r.returncode, tail, logpath))
    return out


def json_lines(text):
    """The JSON objects among a program's output lines (others are skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


# ---------------------------------------------------------------------------
# the benchmarks

def bench_decode(a, s, model, logs):
    out = os.path.join(logs, "decode.json")
    cmd = ["bin/bench_decode", model, "--prompt", str(s["decode_prompt"]), "--gen", str(s["decode_gen"]),
           "--threads", s["decode_threads"], "--probe-mb", str(s["decode_probe_mb"]), "--json", out]
    if a.chunk:
        cmd += ["--chunk", str(a.chunk)]
    run_logged(cmd, os.path.join(logs, "decode.log"))
    with open(out) as f:
        return json.load(f)


def bench_stream(a, s, model, trunk, logs):
    out = os.path.join(logs, "stream.json")
    cmd = ["bin/bench_stream", model, trunk, "--prompt", str(s["stream_prompt"]), "--gen", str(s["stream_gen"]),
           "--repeat", str(s["stream_repeat"]), "--probe", str(s["stream_probe"]), "--json", out]
    if s["stream_rungs"]:
        cmd += ["--rungs", s["stream_rungs"]]
    run_logged(cmd, os.path.join(logs, "stream.log"))
    with open(out) as f:
        return json.load(f)


def bench_train(a, s, logs):
    res = {"k3": [], "torch": [], "errors": []}
    peak = json_lines(run_logged(["bin/bench_train", "--json", "--peak"], os.path.join(logs, "train-peak.log")))
    res["peak"] = peak[0] if peak else {}
    for mode in [m for m in s["train_modes"].split(",") if m]:
        # f32: the default step; any other mode M is bench_train's flag --M
        # (bf16 today; a new fast path adds its flag there, not here)
        flags = [] if mode == "f32" else ["--" + mode]
        cmd = ["bin/bench_train", "--json", "--config", s["train_config"], "--batch", str(s["train_batch"]),
               "--seq", str(s["train_seq"]), "--steps", str(s["train_steps"]), "--threads", s["train_threads"],
               "--optimizer", s["train_optimizer"]] + flags
        try:
            for r in json_lines(run_logged(cmd, os.path.join(logs, "train-k3-%s.log" % mode))):
                r["mode"] = mode
                res["k3"].append(r)
        except BenchError as e:
            res["errors"].append("k3 %s: %s" % (mode, e))
    env = dict(os.environ)
    blas = os.environ.get("K3_TORCH_BLAS_DIR")
    if blas:
        env["LD_LIBRARY_PATH"] = blas
        env["OPENBLAS_NUM_THREADS"] = "1"
    cmd = [PY, "tools/bench_torch.py", s["train_config"], "--batch", str(s["train_batch"]), "--seq",
           str(s["train_seq"]), "--accum", "1", "--steps", str(s["train_steps"]), "--threads", s["train_threads"]]
    try:
        res["torch"] = json_lines(run_logged(cmd, os.path.join(logs, "train-torch.log"), env=env))
    except BenchError as e:
        res["errors"].append("pytorch: %s" % e)
    res["torch_blas"] = blas_name(blas)
    if not blas and "/blas/" in system_blas():
        log("note: PyTorch ran on the reference (netlib) BLAS, 10x slower than OpenBLAS here; "
            "K3_TORCH_BLAS_DIR=DIR (a libblas.so.3 from libopenblas0-pthread) gives the fairer reference")
    if not res["k3"] and not res["torch"]:
        raise BenchError("; ".join(res["errors"]))
    return res


def bench_index(a, s, replica, logs):
    out = os.path.join(logs, "index.json")
    run_logged(["bin/bench_index", replica, str(s["index_repeats"]), "--json", out], os.path.join(logs, "index.log"))
    with open(out) as f:
        return json.load(f)


def bench_ttft(a, s, model, logs):
    """Wall time of a whole `k3 run MODEL --ids 5 --gen 1` process (open, index,
    bind, one forward pass, exit) with the page cache warm: one unmeasured run
    first, then the best and median of the timed ones."""
    cmd = ["bin/k3", "run", model, "--ids", "5", "--gen", "1", "--quiet"]
    times = []
    for i in range(s["ttft_runs"] + 1):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        dt = time.perf_counter() - t0
        if r.returncode != 0:
            raise BenchError("k3 run exited %d: %s" % (r.returncode, r.stderr.decode("utf-8", "replace").strip()))
        if i:
            times.append(dt)
    times.sort()
    return {"model": model, "command": " ".join(cmd), "runs": len(times), "best_s": times[0],
            "median_s": times[len(times) // 2], "times_s": times}


def blas_name(d):
    """Which BLAS PyTorch ran on, in words (no machine paths in the report)."""
    if d:
        libs = sorted(f for f in os.listdir(d) if f.startswith("libopenblas")) if os.path.isdir(d) else []
        ver = [f[len("libopenblasp-r"):-3] for f in libs if f.startswith("libopenblasp-r") and f.endswith(".so")]
        if libs:
            return "OpenBLAS%s via K3_TORCH_BLAS_DIR" % (" " + ver[0] if ver else "")
        return "libblas.so.3 of K3_TORCH_BLAS_DIR"
    real = system_blas()
    if "/blas/" in real:
        return "netlib reference BLAS (system libblas.so.3)"
    if "openblas" in real:
        return "OpenBLAS (system libblas.so.3)"
    return "system libblas.so.3 (%s)" % os.path.basename(real)


def system_blas():
    try:
        return os.path.realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3")
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------
# conditions

def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def cpu_info():
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and model in ("unknown", "x86_64", ""):
                    model = v.strip()
                elif k == "flags" and not flags:
                    flags = set(v.split())
    except OSError:
        pass
    isa = [x for x in ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"] if x in flags]
    return model, isa


def kernels_path():
    """The kernel path in force (K3_ISA or the best the CPU has), as k3 doctor names it."""
    try:
        out = subprocess.run(["bin/k3", "doctor"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    for line in out.splitlines():
        if line.startswith("kernels "):
            return line.split()[1]
    return "?"


def git_commit():
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL).stdout.decode().strip()
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL).stdout.decode().strip()
        return h + ("+dirty" if d else "") if h else "unknown"
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------
# rows: every figure of the table, derived from the raw figures

def row(target, measured, reference, share, goal, met, goal_share=None, kind="target", section=""):
    return {"section": section, "target": target, "measured": measured, "reference": reference, "share": share,
            "goal": goal, "goal_share": goal_share, "met": met, "kind": kind}


def by_threads(rows, t):
    for r in rows:
        if r.get("threads") == t:
            return r
    return None


def derive(rep):
    """The table's rows from a report's raw figures (pure: --render and the
    tests go through here too)."""
    raw, errors, rows = rep.get("raw", {}), rep.get("errors", {}), []
    want = rep.get("settings", {}).get("sections", SECTIONS)

    def failed(section, what):
        if section in errors:
            rows.append(row(what, "not measured: " + errors[section], "-", None, "-", None, section=section,
                            kind="error"))
            return True
        return section not in raw

    d = raw.get("decode")
    if "decode" in want and not failed("decode", "decode"):
        bpt = d["bytes_per_token"]
        for r in d["decode"]:
            t = r["threads"]
            roof = r["probe_gbs"] * 1e9 / bpt
            share = r["best_gbs"] / r["probe_gbs"]
            rows.append(row("decode, %d thread%s (wall, best token)" % (t, "s" if t > 1 else ""),
                            "%.1f tok/s (median %.1f)" % (r["best_tokens_per_s"], r["median_tokens_per_s"]),
                            "%.1f tok/s = %.1f MB/token / %.1f GB/s read probe" % (roof, bpt / 1e6, r["probe_gbs"]),
                            share, ">= 70% of bandwidth roofline", share >= GOAL_DECODE_SHARE, GOAL_DECODE_SHARE,
                            section="decode"))
            cshare = r["cpu_gbs"] / r["probe_cpu_gbs"]
            rows.append(row("decode, %d thread%s (CPU time)" % (t, "s" if t > 1 else ""),
                            "%.1f GB per CPU-s (%.1f CPU ms/token)" % (r["cpu_gbs"], r["cpu_ms_per_token"]),
                            "%.1f GB/s probe per CPU-s" % r["probe_cpu_gbs"], cshare,
                            ">= 70% of bandwidth roofline", cshare >= GOAL_DECODE_SHARE, GOAL_DECODE_SHARE,
                            section="decode"))
        one, two = by_threads(d["decode"], 1), by_threads(d["decode"], 2)
        if one and two:
            ratio = two["best_tokens_per_s"] / one["best_tokens_per_s"]
            rows.append(row("decode, 2 threads vs 1", "x%.2f (best token; median x%.2f)" % (
                ratio, two["median_tokens_per_s"] / one["median_tokens_per_s"]),
                "1 thread: %.1f tok/s" % one["best_tokens_per_s"], None, "2 threads faster", ratio > 1.0,
                section="decode"))
    if "prefill" in want and not failed("decode", "prefill"):
        peak = d["fma_peak_gflops_per_core"]
        gpt = d["prefill_gflop"] / d["prompt"]
        for r in d["prefill"]:
            t = r["threads"]
            share = r["gflops"] / (peak * t) if peak > 0 else None
            gshare = GOAL_PREFILL_TOKS * gpt / (peak * t) if peak > 0 else None
            rows.append(row("prefill %d-token prompt, %d thread%s" % (d["prompt"], t, "s" if t > 1 else ""),
                            "%.1f tok/s, %.1f GFLOP/s (%.1f per CPU-s)" % (r["tokens_per_s"], r["gflops"],
                                                                           r["gflops_per_cpu_s"]),
                            "FMA peak %.1f GFLOP/s (%d x %.1f)" % (peak * t, t, peak), share,
                            ">= 400 tok/s (256-token prompt)", r["tokens_per_s"] >= GOAL_PREFILL_TOKS, gshare,
                            section="prefill"))
    s = raw.get("stream")
    if "stream" in want and not failed("stream", "streaming decode"):
        ladder = [r for r in s["ladder"] if r.get("io") != "before"]  # "before": --compare's old I/O
        if not ladder:
            rows.append(row("streaming decode", "not measured: the ladder has no rungs", "-", None, "-", None,
                            section="stream", kind="error"))
        for r in ladder:
            streamed = r.get("ring_slots", 0) > 0
            goal = ">= 80% of disk roofline" if streamed else "- (compute-bound: %.0f%% of max(disk, compute))" % (
                100 * r["roofline_ratio"])
            rows.append(row("streaming: " + r["budget"],
                            "%.3f s/token (%.1f MB/token)" % (r["s_per_token"], r["mb_per_token"]),
                            "%.3f s/token = MB / %.0f MB/s disk" % (r["floor_s"], r["disk_mbs"]),
                            r["disk_roofline_ratio"], goal,
                            r["disk_roofline_ratio"] >= GOAL_STREAM_SHARE if streamed else None,
                            GOAL_STREAM_SHARE if streamed else None, section="stream",
                            kind="target" if streamed else "info"))
    tr = raw.get("train")
    if "train" in want and not failed("train", "training"):
        peak = tr.get("peak", {}).get("fma_peak_gflops_per_core", 0)
        cfgname = os.path.basename(rep.get("settings", {}).get("train_config", "?")).replace(".json", "")
        torch = {r["threads"]: r for r in tr.get("torch", [])}
        for e in tr.get("errors", []):
            rows.append(row("training", "not measured: " + e, "-", None, "-", None, section="train", kind="error"))
        for r in tr.get("k3", []):
            t, fpt = r["threads"], r["flops_per_token"]
            gf = fpt * r["tokens_per_s"] / 1e9
            share = gf / (peak * t) if peak > 0 else None
            gshare = GOAL_TRAIN_TOKS * fpt / 1e9 / (peak * t) if peak > 0 else None
            p = torch.get(t)
            ref = ("PyTorch %.1f tok/s, %.1f tok/CPU-s" % (p["tokens_per_s"], p["tokens_per_cpu_s"]) if p
                   else "PyTorch not measured")
            rows.append(row("training %s, k3 %s %s, %d thread%s" % (cfgname, r.get("mode", "f32"),
                                                                   r.get("optimizer", "?"), t, "s" if t > 1 else ""),
                            "%.1f tok/s, %.1f tok/CPU-s, %.1f GFLOP/s" % (r["tokens_per_s"], r["tokens_per_cpu_s"],
                                                                          gf),
                            ref + "; FMA peak %.1f GFLOP/s" % (peak * t), share, ">= 2,829 tok/s",
                            r["tokens_per_s"] >= GOAL_TRAIN_TOKS, gshare, section="train"))
            if p:
                rw, rc = r["tokens_per_s"] / p["tokens_per_s"], r["tokens_per_cpu_s"] / p["tokens_per_cpu_s"]
                rows.append(row("  k3 %s / PyTorch, %d thread%s" % (r.get("mode", "f32"), t, "s" if t > 1 else ""),
                                "x%.2f wall, x%.2f CPU time" % (rw, rc),
                                "PyTorch %.1f tok/s (same run)" % p["tokens_per_s"], None, ">= 3x PyTorch (floor)",
                                min(rw, rc) >= GOAL_TRAIN_VS_TORCH, section="train"))
        for t, p in sorted(torch.items()):
            fpt = next((r["flops_per_token"] for r in tr.get("k3", []) if r["threads"] == t), None)
            share = fpt * p["tokens_per_s"] / 1e9 / (peak * t) if fpt and peak > 0 else None
            rows.append(row("training %s, PyTorch reference, %d thread%s" % (cfgname, t, "s" if t > 1 else ""),
                            "%.1f tok/s, %.1f tok/CPU-s" % (p["tokens_per_s"], p["tokens_per_cpu_s"]),
                            "BLAS: %s" % tr.get("torch_blas", "?"), share, "- (reference)", None,
                            section="train", kind="reference"))
    ix = raw.get("index")
    if "index" in want and not failed("index", "index"):
        rows.append(row("index %s tensors (%d shards)" % (format(ix["tensors"], ","), ix["shards"]),
                        "%.3f s best wall (median %.3f; %.3f CPU-s per open)" % (ix["best_s"], ix["median_s"],
                                                                                  ix["cpu_s_per_open"]),
                        "-", None, "< 0.1 s", ix["best_s"] < GOAL_INDEX_S, section="index"))
    tt = raw.get("ttft")
    if "ttft" in want and not failed("ttft", "time to first token"):
        rows.append(row("time to first token (whole `k3 run`, warm)",
                        "%.3f s best (median %.3f, %d runs)" % (tt["best_s"], tt["median_s"], tt["runs"]),
                        "-", None, "< 1 s", tt["best_s"] < GOAL_TTFT_S, section="ttft"))
    return rows


# ---------------------------------------------------------------------------
# rendering

def fmt_share(x):
    return "-" if x is None else "%.0f%%" % (100 * x)


def fmt_met(m):
    return "-" if m is None else ("yes" if m else "**no**")


def conditions_lines(rep):
    c, st = rep.get("conditions", {}), rep.get("settings", {})
    la = lambda v: "/".join("%.2f" % x for x in v) if v else "?"
    lines = [
        "date: %s; commit %s" % (c.get("date", "?"), c.get("commit", "?")),
        "CPU: %s, %s cores; ISA: %s; kernels path: %s" % (
            c.get("cpu", "?"), c.get("cores", "?"), " ".join(c.get("isa", [])) or "?",
            c.get("kernels", "?")),
        "load average (1/5/15 min): before %s, after %s; OMP_WAIT_POLICY=%s" % (
            la(c.get("load_before")), la(c.get("load_after")), c.get("omp_wait_policy") or "(unset)"),
    ]
    secs = st.get("sections", SECTIONS)
    parts = []
    if "decode" in secs or "prefill" in secs:
        parts.append("decode/prefill prompt %s + %s tokens, threads %s" % (
            st.get("decode_prompt"), st.get("decode_gen"), st.get("decode_threads")))
    if "stream" in secs:
        parts.append("streaming %s tokens x %s repeats" % (st.get("stream_gen"), st.get("stream_repeat")))
    if "train" in secs:
        parts.append("training %s batch %sx%s, %s, threads %s" % (
            os.path.basename(str(st.get("train_config"))), st.get("train_batch"), st.get("train_seq"),
            st.get("train_optimizer"), st.get("train_threads")))
    if st and parts:
        lines.append("settings: " + "; ".join(parts))
    if st.get("quick"):
        lines.append("QUICK RUN: small sizes to test the report itself; these figures are not the issue's targets")
    return lines


def table_md(rows):
    head = ["target", "measured", "roofline / reference (same run)", "share", "issue goal", "met?"]
    body = [[r["target"], r["measured"], r["reference"], fmt_share(r["share"]), r["goal"], fmt_met(r["met"])]
            for r in rows]
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(cells)) + " |"
    out = [line(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"]
    out += [line(b) for b in body]
    return "\n".join(out)


def xml(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def svg_chart(rep, rows):
    """Horizontal bars: each target's share of its roofline (decode: read
    bandwidth; prefill and training: FMA peak; streaming: disk), a red tick at
    the share the issue's goal needs, green when met, orange when not, grey for
    references and rungs without a goal."""
    bars = [r for r in rows if r["share"] is not None]
    others = [r for r in rows if r["share"] is None and r["kind"] != "error"]
    W, LW, RW, TOP, RH = 900, 330, 60, 74, 22
    H = TOP + RH * max(1, len(bars)) + 78 + (18 * len(others) + 24 if others else 0)
    xmax = max([1.2] + [r["share"] * 1.08 for r in bars] + [(r["goal_share"] or 0) * 1.08 for r in bars])
    xmax = min(xmax, 3.0)
    X = lambda v: LW + min(v, xmax) / xmax * (W - LW - RW)
    c = rep.get("conditions", {})
    o = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" '
         'font-size="12">' % (W, H), '<rect width="100%" height="100%" fill="white"/>',
         '<text x="%d" y="22" text-anchor="middle" font-size="15">k3 against the machine\'s limits '
         '(issue 7): share of each roofline, measured in one run</text>' % (W / 2),
         '<text x="%d" y="40" text-anchor="middle" font-size="11" fill="#444">%s</text>' % (
             W / 2, xml("%s, %s cores, %s; load %s -> %s; %s%s" % (
                 c.get("cpu", "?"), c.get("cores", "?"), c.get("kernels", "?"),
                 "/".join("%.1f" % x for x in c.get("load_before") or []) or "?",
                 "/".join("%.1f" % x for x in c.get("load_after") or []) or "?", c.get("date", "?"),
                 "; QUICK RUN (not the issue's sizes)" if rep.get("settings", {}).get("quick") else "")))]
    step = 0.2 if xmax <= 1.6 else 0.5
    k = 0
    while k * step <= xmax + 1e-9:
        v = k * step
        o.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="%s"%s/>' % (
            X(v), TOP - 6, X(v), TOP + RH * len(bars), "#888" if abs(v - 1) < 1e-9 else "#e4e4e4",
            ' stroke-dasharray="4,3"' if abs(v - 1) < 1e-9 else ""))
        o.append('<text x="%.1f" y="%d" text-anchor="middle" font-size="10">%.0f%%</text>' % (X(v), TOP - 10,
                                                                                            100 * v))
        k += 1
    for i, r in enumerate(bars):
        y = TOP + i * RH
        colour = "#9a9a9a" if r["met"] is None else ("#2e8b57" if r["met"] else "#d9822b")
        label = r["target"].strip()
        if len(label) > 52:
            label = label[:51] + "\u2026"
        o.append('<text x="%d" y="%.1f" text-anchor="end">%s</text>' % (LW - 8, y + RH / 2 + 4, xml(label)))
        o.append('<rect x="%d" y="%.1f" width="%.1f" height="%d" fill="%s"/>' % (
            LW, y + 3, max(0.0, X(r["share"]) - LW), RH - 6, colour))
        o.append('<text x="%.1f" y="%.1f" font-size="11">%s%s</text>' % (
            X(r["share"]) + 4, y + RH / 2 + 4, fmt_share(r["share"]), "+" if r["share"] > xmax else ""))
        if r["goal_share"] is not None:
            o.append('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#c0392b" stroke-width="3"/>' % (
                X(r["goal_share"]), y + 1, X(r["goal_share"]), y + RH - 1))
    ly = TOP + RH * len(bars) + 22
    legend = [("#2e8b57", "goal met"), ("#d9822b", "goal not met"), ("#9a9a9a", "reference / no goal")]
    x = LW - 200
    for col, txt in legend:
        o.append('<rect x="%d" y="%d" width="14" height="12" fill="%s"/><text x="%d" y="%d">%s</text>' % (
            x, ly - 10, col, x + 18, ly, txt))
        x += 150
    o.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#c0392b" stroke-width="3"/><text x="%d" y="%d">'
             'share the goal needs</text>' % (x + 6, ly - 12, x + 6, ly + 2, x + 16, ly))
    o.append('<text x="%d" y="%d" font-size="10" fill="#444">roofline: decode = weight bytes per token / the '
             'read-bandwidth probe; prefill, training = the FMA peak x threads;</text>' % (LW - 200, ly + 20))
    o.append('<text x="%d" y="%d" font-size="10" fill="#444">streaming = MB read per token / the disk\'s MB/s '
             '(all measured in the same run)</text>' % (LW - 200, ly + 34))
    if others:
        y = ly + 62
        o.append('<text x="%d" y="%d" font-size="13">Targets without a roofline</text>' % (LW - 200, y - 4))
        for r in others:
            y += 18
            colour = "#9a9a9a" if r["met"] is None else ("#2e8b57" if r["met"] else "#d9822b")
            o.append('<circle cx="%d" cy="%d" r="5" fill="%s"/><text x="%d" y="%d">%s</text>' % (
                LW - 194, y - 4, colour, LW - 182, y, xml("%s: %s (goal: %s)" % (
                    r["target"].strip(), r["measured"], r["goal"]))))
    o.append("</svg>")
    return "\n".join(o) + "\n"


def write_atomic(path, text):
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def render(rep, a):
    rows = derive(rep)
    rep["rows"] = rows
    text = "\n".join(conditions_lines(rep)) + "\n\n" + table_md(rows) + "\n"
    print(text, end="")
    if a.md:
        write_atomic(a.md, "<!-- written by bench/report.sh; do not edit by hand -->\n" +
                     "\n".join("* " + x for x in conditions_lines(rep)) + "\n\n" + table_md(rows) + "\n")
    if a.svg:
        write_atomic(a.svg, svg_chart(rep, rows))
    return rows


# ---------------------------------------------------------------------------

def main(argv):
    ap = argparse.ArgumentParser(prog="bench/report.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, to test the report itself")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma list of: " + ",".join(SECTIONS))
    ap.add_argument("--cache", default=os.environ.get("K3_BENCH_CACHE", "bench/.cache"),
                    help="where inputs and logs are kept (default $K3_BENCH_CACHE or bench/.cache)")
    ap.add_argument("--json", help="report JSON (default CACHE/report.json)")
    ap.add_argument("--svg", help="bar chart (default docs/bench-report.svg for a full run of every section, "
                                  "else CACHE/report.svg)")
    ap.add_argument("--md", help="the table as Markdown (default docs/bench-report.md for a full run of every "
                                 "section, else CACHE/report.md)")
    ap.add_argument("--render", metavar="REPORT_JSON", help="only recompute the table and chart from a report JSON")
    ap.add_argument("--mid-dir", help="use this 627 MB mid checkpoint instead of building one")
    ap.add_argument("--stream-dir", help="use this streaming checkpoint instead of building one")
    ap.add_argument("--trunk-dir", help="its packed trunk (k3 pack-trunk), with --stream-dir")
    ap.add_argument("--replica-dir", help="use this sparse replica instead of building one")
    ap.add_argument("--chunk", type=int, default=0, help="bench_decode --chunk (default: the engine's)")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None,
                        help="default %s (--quick: %s)" % (v, QUICK[k]))
    a = ap.parse_args(argv)

    if a.render:
        try:
            with open(a.render) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            print("k3: %s: %s" % (a.render, e), file=sys.stderr)
            return 2
        try:
            render(rep, a)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            print("k3: %s: not a bench report (%s: %s)" % (a.render, type(e).__name__, e), file=sys.stderr)
            return 2
        return 0

    only = [x for x in a.only.split(",") if x]
    bad = [x for x in only if x not in SECTIONS]
    if bad or not only:
        print("k3: --only: unknown section '%s' (%s)" % (",".join(bad), ",".join(SECTIONS)), file=sys.stderr)
        return 2
    s = dict(QUICK if a.quick else FULL)
    for k in s:
        v = getattr(a, k)
        if v is not None:
            s[k] = v
    s["quick"] = a.quick
    s["sections"] = only
    full_run = not a.quick and set(only) == set(SECTIONS)
    cache = a.cache
    logs = os.path.join(cache, "logs")
    os.makedirs(logs, exist_ok=True)
    a.json = a.json or os.path.join(cache, "report.json")
    a.svg = a.svg or ("docs/bench-report.svg" if full_run else os.path.join(cache, "report.svg"))
    a.md = a.md or ("docs/bench-report.md" if full_run else os.path.join(cache, "report.md"))

    # as bench_train.sh and ab.sh: on a shared machine, OpenMP threads spinning
    # at barriers wait for descheduled peers (a 0.07 s `k3 run` took 1.6 s at
    # load 6); on an idle machine set OMP_WAIT_POLICY=active to compare
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    model, isa = cpu_info()
    rep = {"schema": 1, "settings": s, "raw": {}, "errors": {},
           "conditions": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                          "commit": git_commit(), "cpu": model, "cores": os.cpu_count(), "isa": isa,
                          "kernels": kernels_path(),
                          "load_before": loadavg(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                          "command": "bench/report.sh " + " ".join(shlex.quote(x) for x in argv)}}
    raw, errors = rep["raw"], rep["errors"]

    def attempt(section, fn):
        log("%s ..." % section)
        t0 = time.time()
        try:
            raw[section] = fn()
            log("%s done in %.0f s" % (section, time.time() - t0))
        except (BenchError, OSError, ValueError, KeyError) as e:
            errors[section] = str(e)
            log("%s FAILED: %s" % (section, e))

    inputs = {}

    def need(name):
        if name in inputs:
            if isinstance(inputs[name], Exception):
                raise inputs[name]
            return inputs[name]
        try:
            if name == "mid":
                if a.mid_dir or a.quick:
                    p = a.mid_dir or cached_input(cache, "quick-model", GEN_QUICK, opens)
                else:
                    p = cached_input(cache, "mid", GEN_MID, opens)
                if not opens(p):
                    raise BenchError("%s: not a checkpoint that opens" % p)
                inputs[name] = p
            elif name == "stream":
                if a.stream_dir:
                    if not a.trunk_dir:
                        raise BenchError("--stream-dir needs --trunk-dir (k3 pack-trunk)")
                    inputs[name] = (a.stream_dir, a.trunk_dir)
                else:
                    m = cached_input(cache, "quick-model" if a.quick else "stream",
                                     GEN_QUICK if a.quick else GEN_STREAM, opens)
                    inputs[name] = (m, packed_trunk(cache, "quick-trunk" if a.quick else "stream-trunk", m))
            elif name == "replica":
                if a.replica_dir:
                    inputs[name] = a.replica_dir
                elif a.quick:  # the replica takes a while to write; the quick run indexes its own model
                    inputs[name] = need("mid")
                else:
                    if not os.path.isdir("tests/fixtures/k3-release"):
                        raise BenchError("tests/fixtures/k3-release missing: cannot build the sparse replica "
                                         "(give --replica-dir)")
                    inputs[name] = cached_input(cache, "replica", GEN_REPLICA, opens)
        except BenchError as e:
            inputs[name] = e
            raise
        return inputs[name]

    if "decode" in only or "prefill" in only:
        attempt("decode", lambda: bench_decode(a, s, need("mid"), logs))
    if "stream" in only:
        attempt("stream", lambda: bench_stream(a, s, *need("stream"), logs))
    if "train" in only:
        attempt("train", lambda: bench_train(a, s, logs))
    if "index" in only:
        attempt("index", lambda: bench_index(a, s, need("replica"), logs))
    if "ttft" in only:
        attempt("ttft", lambda: bench_ttft(a, s, need("mid"), logs))

    c = rep["conditions"]
    c["load_after"] = loadavg()
    c["kernels"] = raw.get("decode", {}).get("kernels") or c.get("kernels", "?")
    log("logs of every bench: %s" % logs)
    print()
    render(rep, a)
    write_atomic(a.json, json.dumps(rep, indent=1) + "\n")
    print("\nwrote %s, %s, %s" % (a.json, a.md, a.svg))
    return 1 if errors or raw.get("train", {}).get("errors") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
