#!/usr/bin/env bash
# bench/ab.sh: old engine vs new engine in the same run, through `k3 run`.
#
#   bench/ab.sh OLD_K3 NEW_K3 MODEL_DIR [ROUNDS] [PROMPT] [GEN]
#
# Alternates the two binaries ROUNDS times (default 3) at 1 and 2 threads on
# the same prompt (PROMPT pseudo-random ids, default 256; GEN greedy tokens,
# default 32). Per run it prints the wall-clock prefill and decode tokens/s
# that `k3 run --out` reports, and the CPU seconds (user + sys, all threads)
# of a prefill-only run and of the full run: CPU per decoded token =
# (full - prefill-only) / GEN. CPU time is what a machine shared with other
# jobs inflates least; alternating makes the load disturb both sides alike.
# Build the old binary from the commit to compare, e.g.
#   git worktree add /tmp/k3-old main && make -C /tmp/k3-old bin/k3
set -u
[ $# -ge 3 ] || { echo "usage: bench/ab.sh OLD_K3 NEW_K3 MODEL_DIR [ROUNDS] [PROMPT] [GEN]" >&2; exit 2; }
OLD=$1 NEW=$2 DIR=$3 ROUNDS=${4:-3} NP=${5:-256} NG=${6:-32}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# Prompt ids below the model's vocabulary (the first vocab_size in its config).
V=$(grep -o '"vocab_size": *[0-9]*' "$DIR/config.json" 2>/dev/null | head -n 1 | grep -o '[0-9]*$')
[ -n "$V" ] || { echo "bench/ab.sh: no vocab_size in $DIR/config.json" >&2; exit 2; }
IDS=$(awk -v n="$NP" -v v="$V" 'BEGIN { x = 12345; for (i = 0; i < n; i++) { x = (x * 1103515245 + 12345) % 2147483648;
      printf "%s%d", (i ? "," : ""), x % v } }')
OUT=$(mktemp) TIM=$(mktemp)
trap 'rm -f "$OUT" "$TIM"' EXIT
field() { sed -n "s/^ *\"$1\": *\([0-9.eE+-]*\).*/\1/p" "$OUT" | head -n 1; }
cpu_of() { # BIN THREADS GEN -> CPU seconds of one run
  /usr/bin/time -f "%U %S" -o "$TIM" "$1" run "$DIR" --ids "$IDS" --gen "$3" --threads "$2" --quiet --out "$OUT" || return 1
  awk '{ print $1 + $2 }' "$TIM"
}
printf "%-5s %-7s %-4s | %13s %13s | %13s %15s\n" round threads bin "prefill tok/s" "decode tok/s" \
  "prefill CPU s" "decode CPU ms/t"
for r in $(seq 1 "$ROUNDS"); do
  for th in 1 2; do
    for which in old new; do
      bin=$OLD; [ "$which" = new ] && bin=$NEW
      c1=$(cpu_of "$bin" "$th" 1) || { echo "bench/ab.sh: $bin failed" >&2; exit 1; }
      c2=$(cpu_of "$bin" "$th" $((NG + 1))) || { echo "bench/ab.sh: $bin failed" >&2; exit 1; }
      printf "%-5s %-7s %-4s | %13.1f %13.2f | %13.3f %15.1f\n" "$r" "$th" "$which" "$(field prefill_tokens_per_s)" \
        "$(field tokens_per_s)" "$c1" "$(awk -v a="$c1" -v b="$c2" -v n="$NG" 'BEGIN { print 1000 * (b - a) / n }')"
    done
  done
done
