#!/usr/bin/env bash
# Training speed of `k3 train` beside the PyTorch reference, measured in one
# run (docs/training-speed.md).
#
#   scripts/bench_train.sh [--batch 16] [--seq 256] [--accum 1] [--steps 1]
#                          [--configs "configs/smol-5m.json configs/smol-50m.json"]
#                          [--threads 1,2] [--no-torch] [--no-bf16]
#
# For each config and thread count: bin/bench_train (C, chunkwise KDA, Muon
# and AdamW in F32, and Muon in the --bf16 mode: AMX where the CPU has it,
# else vdpbf16ps) and tools/bench_torch.py (float32 eager PyTorch, chunkwise KDA,
# AdamW), same batch shape, random tokens. Prints tokens/s by wall clock and by
# CPU time (on a shared machine the wall clock counts time other jobs held the
# cores), seconds per optimiser step, model GFLOP/s and the share of the
# measured FMA peak (bin/bench_train --peak, one core, times the threads).
# Set K3_TORCH_BLAS_DIR to a directory holding libblas.so.3 (e.g. OpenBLAS
# unpacked from libopenblas0-pthread) to run PyTorch on it instead of the
# system BLAS; the table says which one ran.
set -euo pipefail
B=16; T=256; A=1; STEPS=1; THREADS=1,2; TORCH=1; BF16=1
CONFIGS="configs/smol-5m.json configs/smol-50m.json"
while [ $# -gt 0 ]; do
  case "$1" in
    --batch) B=$2; shift 2;;
    --seq) T=$2; shift 2;;
    --accum) A=$2; shift 2;;
    --steps) STEPS=$2; shift 2;;
    --threads) THREADS=$2; shift 2;;
    --configs) CONFIGS=$2; shift 2;;
    --no-torch) TORCH=0; shift;;
    --no-bf16) BF16=0; shift;;
    *) echo "k3: bench_train.sh: unknown flag $1" >&2; exit 2;;
  esac
done
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
make -s bin/bench_train >&2
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
bin/bench_train --json --peak >>"$OUT"
for c in $CONFIGS; do
  for opt in muon adamw; do
    bin/bench_train --json --config "$c" --batch "$B" --seq "$T" --accum "$A" --steps "$STEPS" \
      --threads "$THREADS" --optimizer "$opt" >>"$OUT"
  done
  if [ "$BF16" = 1 ]; then
    bin/bench_train --json --config "$c" --batch "$B" --seq "$T" --accum "$A" --steps "$STEPS" \
      --threads "$THREADS" --optimizer muon --bf16 >>"$OUT"
  fi
  if [ "$TORCH" = 1 ]; then
    if [ -n "${K3_TORCH_BLAS_DIR:-}" ]; then
      LD_LIBRARY_PATH="$K3_TORCH_BLAS_DIR" OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tools/bench_torch.py "$c" \
        --batch "$B" --seq "$T" --accum "$A" --steps "$STEPS" --threads "$THREADS" >>"$OUT"
    else
      /usr/bin/python3 tools/bench_torch.py "$c" --batch "$B" --seq "$T" --accum "$A" --steps "$STEPS" \
        --threads "$THREADS" >>"$OUT"
    fi
  fi
done
/usr/bin/python3 - "$OUT" "${K3_TORCH_BLAS_DIR:-system}" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peak = rows[0]["fma_peak_gflops_per_core"]
amx = rows[0].get("amx_peak_gflops_per_core", 0)
bfp = rows[0].get("bf16_peak_gflops_per_core", 0)
print("Peaks (measured, one core): F32 FMA %.1f, vdpbf16ps %.1f, AMX-BF16 %.1f GFLOP/s; PyTorch BLAS: %s"
      % (peak, bfp, amx, sys.argv[2]))
print("% peak: of the F32 FMA peak (F32 rows) or of the BF16 unit that ran (bf16 rows), per busy core")
print("%-22s %-16s %3s %10s %12s %10s %9s %8s" % ("config", "impl", "thr", "tok/s", "tok/CPU-s", "s/step",
                                                    "GFLOP/s", "% peak"))
ref = {}
for r in rows[1:]:
    if r.get("impl") == "pytorch":
        ref[(r["config"], r["threads"])] = r
for r in rows[1:]:
    impl = r.get("impl") or ("k3 " + r["optimizer"] + ((" bf16-amx" if r.get("amx") else " bf16") if r.get("bf16") else ""))
    if "gflops" in r:
        gf = r["flops_per_token"] * r["tokens_per_step"] / r["s_per_step"] / 1e9
        gfc = r["flops_per_token"] * r["tokens_per_cpu_s"] / 1e9   # per busy core-second
        pk = (amx if r.get("amx") else bfp) if r.get("bf16") else peak
        pct = "%.1f" % (100 * gfc / pk) if pk else "-"
        gfs = "%.1f" % gf
    else:
        gfs = pct = "-"
    line = "%-22s %-16s %3d %10.1f %12.1f %10.2f %9s %8s" % (r["config"].split("/")[-1], impl, r["threads"],
                                                             r["tokens_per_s"], r["tokens_per_cpu_s"],
                                                             r["s_per_step"], gfs, pct)
    t = ref.get((r["config"], r["threads"]))
    if t and r.get("impl") != "pytorch":
        line += "   x%.1f PyTorch (CPU time)" % (r["tokens_per_cpu_s"] / t["tokens_per_cpu_s"])
    print(line)
EOF
