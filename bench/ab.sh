#!/usr/bin/env bash
# bench/ab.sh: old engine vs new engine in the same run, through `k3 run`.
#
#   bench/ab.sh OLD_K3 NEW_K3 MODEL_DIR [ROUNDS] [PROMPT] [GEN]
#
# Alternates the two binaries ROUNDS times (default 3) at 1 and 2 threads on
# the same prompt (PROMPT pseudo-random ids, default 256; GEN greedy tokens,
# default 32) and prints, per run, prefill and decode tokens/s as `k3 run
# --out` reports them (decode: steps / decode time). Alternating makes a
# busy machine disturb both sides alike; compare the best of each column.
# Build the old binary from the commit to compare, e.g.
#   git worktree add /tmp/k3-old main && make -C /tmp/k3-old bin/k3
set -u
[ $# -ge 3 ] || { echo "usage: bench/ab.sh OLD_K3 NEW_K3 MODEL_DIR [ROUNDS] [PROMPT] [GEN]" >&2; exit 2; }
OLD=$1 NEW=$2 DIR=$3 ROUNDS=${4:-3} NP=${5:-256} NG=${6:-32}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
IDS=$(awk -v n="$NP" 'BEGIN { x = 12345; for (i = 0; i < n; i++) { x = (x * 1103515245 + 12345) % 2147483648;
      printf "%s%d", (i ? "," : ""), x % 30000 } }')
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
field() { sed -n "s/^ *\"$1\": *\([0-9.eE+-]*\).*/\1/p" "$OUT" | head -n 1; }
printf "%-5s %-7s %-4s %14s %14s\n" round threads bin "prefill tok/s" "decode tok/s"
for r in $(seq 1 "$ROUNDS"); do
  for th in 1 2; do
    for which in old new; do
      bin=$OLD; [ "$which" = new ] && bin=$NEW
      "$bin" run "$DIR" --ids "$IDS" --gen "$NG" --threads "$th" --quiet --out "$OUT" || exit 1
      printf "%-5s %-7s %-4s %14.1f %14.2f\n" "$r" "$th" "$which" "$(field prefill_tokens_per_s)" "$(field tokens_per_s)"
    done
  done
done
