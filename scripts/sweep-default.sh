#!/usr/bin/env bash
# The sweep behind models/default (docs/default-model.md): three sizes of smol
# K3 (configs/smol-5m, -13m, -20m), each run with its own full schedule
# (warmup, cosine) for two lengths (the largest for one: its second length was
# not run, see the doc), then scored on the same 65,536 validation tokens. Lengths are given in steps
# of 8 x 256 tokens, sized so that each run takes about 2 and 5 minutes on two
# cores of the machine that chose the default (AMD EPYC, AVX2: 2,662 / 1,934 /
# 1,362 training tokens/s for the three sizes); fixed steps rather than fixed
# wall time keep the table the same on a busy or a faster machine.
# Usage: scripts/sweep-default.sh DATA_DIR OUT_DIR   (DATA_DIR from k3 prepare)
set -euo pipefail
data=${1:?usage: scripts/sweep-default.sh DATA_DIR OUT_DIR}
out=${2:?usage: scripts/sweep-default.sh DATA_DIR OUT_DIR}
k3="$(cd "$(dirname "$0")/.." && pwd)/bin/k3"
cfgs="$(cd "$(dirname "$0")/.." && pwd)/configs"
mkdir -p "$out"
printf '%-10s %6s %9s %8s %9s %8s\n' config steps tokens seconds val_loss val_bpb | tee "$out/table.txt"
while read -r name steps; do
  run="$out/$name-$steps"
  rm -rf "$run"
  t0=$(date +%s)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=passive "$k3" train --config "$cfgs/$name.json" \
    --data-dir "$data" --output-dir "$run" --steps "$steps" --batch-size 8 --seq-len 256 \
    --gradient-accumulation 1 --eval-interval "$steps" --eval-tokens 65536 --skip-samples --quiet \
    >"$run.log" 2>&1
  t1=$(date +%s)
  last=$(grep '"val_loss"' "$run/metrics.jsonl" | tail -n 1)
  vl=$(printf '%s' "$last" | sed -E 's/.*"val_loss": *([0-9.]+).*/\1/')
  vb=$(printf '%s' "$last" | sed -E 's/.*"val_bpb": *([0-9.]+).*/\1/')
  printf '%-10s %6d %9d %8d %9s %8s\n' "$name" "$steps" $((steps * 2048)) $((t1 - t0)) "$vl" "$vb" | tee -a "$out/table.txt"
done <<'RUNS'
smol-5m 156
smol-5m 390
smol-13m 113
smol-13m 283
smol-20m 80
RUNS
