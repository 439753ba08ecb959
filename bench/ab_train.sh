#!/usr/bin/env bash
# bench/ab_train.sh: old vs new training step in the same run, through bin/bench_train.
#
#   bench/ab_train.sh OLD_BENCH_TRAIN NEW_BENCH_TRAIN [ROUNDS] [BENCH_TRAIN FLAGS...]
#
# Alternates the two binaries ROUNDS times (default 3) with the same flags
# (default: --config configs/smol-5m.json --batch 8 --seq 256 --steps 2
# --threads 1,2) and prints, per run and thread count, tokens per CPU-second
# (what a shared machine inflates least), tokens/s by wall clock, and the hash
# of the weights after the last step: the two builds take bit-identical F32
# steps iff the hashes match. Build the old binary from the commit to compare:
#   git worktree add /tmp/k3-old COMMIT && make -C /tmp/k3-old bin/bench_train
set -u
[ $# -ge 2 ] || { echo "usage: bench/ab_train.sh OLD NEW [ROUNDS] [FLAGS...]" >&2; exit 2; }
OLD=$1 NEW=$2 ROUNDS=${3:-3}
shift 2; [ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- --config configs/smol-5m.json --batch 8 --seq 256 --steps 2 --threads 1,2
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
printf "%-5s %-4s %-7s | %14s %12s | %s\n" round bin threads "tokens/CPU-s" "tokens/s" weights
for r in $(seq 1 "$ROUNDS"); do
  for which in old new; do
    bin=$OLD; [ "$which" = new ] && bin=$NEW
    out=$("$bin" "$@" 2>&1) || { echo "bench/ab_train.sh: $bin failed: $out" >&2; exit 1; }
    echo "$out" | sed -n 's/^threads \([0-9]*\): .*(\([0-9.]*\) tokens\/s.*(\([0-9.]*\) tokens per CPU-s).* weights \([0-9a-f]*\).*/\1 \2 \3 \4/p' |
      while read -r th wall cpu hash; do
        printf "%-5s %-4s %-7s | %14s %12s | %s\n" "$r" "$which" "$th" "$cpu" "$wall" "$hash"
      done
  done
done
