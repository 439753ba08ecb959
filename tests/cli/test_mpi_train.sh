#!/usr/bin/env bash
# asan
# Data-parallel k3 train under mpirun on localhost (Open MPI, --oversubscribe):
# 10 steps of the tiny config on tiny data (k3 prepare at test time) give the
# same checkpoint bytes and the same metrics (losses, learning rates, gradient
# norms, expert loads, validation losses) and samples in one process, at
# mpirun -np 1, at 2 ranks (also exchanging in small pieces) and with 4
# micro-batches at 2 and 4 ranks; a run stopped at step 5 and resumed at
# another rank count (1 -> 2, 2 -> 1) equals the uninterrupted one; SIGUSR1
# to mpirun ends every rank after the same step with the checkpoint
# of a run stopped there on purpose; only rank 0 writes (its ranks run in
# separate directories); and the one-line errors:
# a rank count that does not divide the micro-batches, ranks whose config or
# data differ, a run directory only rank 0 refuses, a rank that hangs.
# Every run is bounded by `timeout` and takes about a second. Under the
# sanitizer build a subset runs (MPI start-up with full leak stacks takes
# seconds a rank): 4 steps of 4 micro-batches in one process and at 2 ranks,
# exchanging in small pieces.
. "$(dirname "$0")/lib.sh"
mpi_setup
# MPI start-up with full leak stacks is slow: longer bound under the sanitizer
[ $ASAN = 1 ] && MPI="timeout 300 mpirun -q --oversubscribe --mca btl self,vader"
K3ABS=$(realpath "$K3")
rm -rf "${OUT:?}"/*
D=$OUT/data
# ~110k training tokens: the first 300 kB of the validation stories
head -c 300000 "$(fixture tinystories/valid.txt)" >"$OUT/text.txt"
expect_exit prepare 0 $K3 prepare --input "$OUT/text.txt" --output-dir "$D" --vocab-size 1024 \
  --validation-fraction 0.1 --threads 1
# 8 routed experts top-2 in every layer: Quantile Balancing runs every step
CFG=configs/tiny-train.json
RUN="--data-dir $D --batch-size 2 --seq-len 32 --steps 10 --eval-interval 5 --eval-tokens 256 \
  --sample-interval 5 --sample-tokens 8 --quiet"

# the records without what the clock gives (times, speeds, memory)
records() { sed -E 's/"(time|tokens_per_s|step_time_s|updated_at)":[^,]*,//g; s/,"peak_rss_bytes":[0-9]+//' "$1"; }
# same NAME REF DIR: DIR's checkpoints, metrics and samples equal REF's
same() {
  local f ok=1
  for f in latest.safetensors best.safetensors; do
    cmp -s "$2/$f" "$3/$f" || { fail "$1:$f" "differs from $(basename "$2")'s"; ok=0; }
  done
  [ $ok = 1 ] && pass "$1:checkpoints"
  diff <(records "$2/metrics.jsonl") <(records "$3/metrics.jsonl") >/dev/null && pass "$1:metrics" \
    || fail "$1:metrics" "$(diff <(records "$2/metrics.jsonl") <(records "$3/metrics.jsonl") | head -c 300)"
  diff <(records "$2/samples.jsonl") <(records "$3/samples.jsonl") >/dev/null && pass "$1:samples" \
    || fail "$1:samples"
}

if [ $ASAN = 1 ]; then
  ARUN="$RUN --config $CFG --gradient-accumulation 4 --stop-at 4"
  expect_exit asan-single 0 $K3 train $ARUN --output-dir "$OUT/asan1"
  expect_exit asan-np2 0 env K3_DIST_PIECE=100003,3001 $MPI -np 2 $K3 train $ARUN --output-dir "$OUT/asan2"
  same asan-np2 "$OUT/asan1" "$OUT/asan2"
  finish; exit
fi

# ---- the same bits at every rank count ------------------------------------------------------
expect_exit single 0 $K3 train $RUN --config $CFG --gradient-accumulation 2 --output-dir "$OUT/single"
[ "$(grep -c '"kind":"train"' "$OUT/single/metrics.jsonl")" = 10 ] && pass single:records || fail single:records
grep -q '"expert_load"' "$OUT/single/metrics.jsonl" && pass single:moe || fail single:moe "no expert loads: QB untested"
for R in 1 2; do
  expect_exit np$R 0 $MPI -np $R $K3 train $RUN --config $CFG --gradient-accumulation 2 --output-dir "$OUT/np$R"
  same np$R "$OUT/single" "$OUT/np$R"
done
grep -q '"ranks": 2' "$OUT/np2/state.json" && pass np2:state-ranks || fail np2:state-ranks
# pieces of 100003 floats (the fold: 5 pieces) and 3001 bytes (the gathers: the
# margins in 4): both cross piece boundaries
expect_exit pieces 0 env K3_DIST_PIECE=100003,3001 $MPI -np 2 $K3 train $RUN --config $CFG --gradient-accumulation 2 \
  --output-dir "$OUT/pieces"
same pieces "$OUT/single" "$OUT/pieces"
# 4 micro-batches: 2 a rank (rank 0 folds its own as it goes, rank 1 keeps them apart), 1 a rank
expect_exit single4 0 $K3 train $RUN --config $CFG --gradient-accumulation 4 --output-dir "$OUT/single4"
for R in 2 4; do
  expect_exit acc4-np$R 0 $MPI -np $R $K3 train $RUN --config $CFG --gradient-accumulation 4 --output-dir "$OUT/acc4-np$R"
  same acc4-np$R "$OUT/single4" "$OUT/acc4-np$R"
done
# the order of the fold shows: 4 micro-batches of 2 are not 2 of 4 (nor 1 of 8)
cmp -s "$OUT/single/latest.safetensors" "$OUT/single4/latest.safetensors" && fail acc:differs || pass acc:differs

# ---- resume at another rank count ---------------------------------------------------------------
expect_exit stop1 0 $K3 train $RUN --config $CFG --gradient-accumulation 2 --output-dir "$OUT/r12" --stop-at 5
expect_exit resume2 0 $MPI -np 2 $K3 train $RUN --output-dir "$OUT/r12" --resume "$OUT/r12/latest.safetensors"
same resume-1to2 "$OUT/single" "$OUT/r12"
expect_exit stop2 0 $MPI -np 2 $K3 train $RUN --config $CFG --gradient-accumulation 2 --output-dir "$OUT/r21" --stop-at 5
grep -q '"status": "stopped"' "$OUT/r21/state.json" && pass stop2:stopped || fail stop2:stopped
expect_exit resume1 0 $K3 train $RUN --output-dir "$OUT/r21" --resume "$OUT/r21/latest.safetensors"
same resume-2to1 "$OUT/single" "$OUT/r21"

# ---- a stop request: every rank ends after the same step, rank 0 checkpoints it ------------------------
LONG="--data-dir $D --batch-size 2 --seq-len 32 --steps 100000 --eval-interval 100000 --eval-tokens 256 --skip-samples \
  --quiet --config $CFG --gradient-accumulation 2"
$MPI -np 2 $K3 train $LONG --output-dir "$OUT/int" >"$OUT/int.out" 2>"$OUT/int.err" &
job=$!
for _ in $(seq 600); do # until 3 steps are done (at most 60 s)
  [ "$(grep -c '"kind":"train"' "$OUT/int/metrics.jsonl" 2>/dev/null)" -ge 3 ] 2>/dev/null && break
  sleep 0.1
done
# to mpirun itself (the child of `timeout`, which would die of SIGUSR1), which
# forwards it to the ranks
mpirun_pid=$(pgrep -P $job mpirun)
[ -n "$mpirun_pid" ] && kill -USR1 "$mpirun_pid"
wait $job; rc=$?
S=$(sed -nE 's/^ "step": ([0-9]+),$/\1/p' "$OUT/int/state.json")
if [ $rc = 0 ] && grep -q '"status": "stopped"' "$OUT/int/state.json" && grep -q "\"checkpoint_step\": $S\$" "$OUT/int/state.json"; then
  pass sigusr1:stopped
  # the checkpoint is the one of a run stopped at that step on purpose, in one process
  expect_exit sigusr1-ref 0 $K3 train $LONG --output-dir "$OUT/int-ref" --stop-at "$S"
  cmp -s "$OUT/int/latest.safetensors" "$OUT/int-ref/latest.safetensors" && pass sigusr1:same-checkpoint \
    || fail sigusr1:same-checkpoint "step $S"
else
  fail sigusr1:stopped "exit $rc, step ${S:-?}: $(head -c 300 "$OUT/int.err")"
fi

# ---- only rank 0 writes and prints --------------------------------------------------------------
# each rank in a directory of its own, the same relative paths (the same command line)
for w in a b; do mkdir -p "$OUT/$w"; ln -s ../data "$OUT/$w/data"; cp $CFG "$OUT/$w/cfg.json"; done
WRUN="--data-dir data --batch-size 2 --seq-len 32 --steps 4 --eval-interval 2 --eval-tokens 256 --sample-interval 2 \
  --sample-tokens 8 --config cfg.json --output-dir out"
expect_exit rank0-writes 0 $MPI -np 1 -wdir "$OUT/a" $K3ABS train $WRUN : -np 1 -wdir "$OUT/b" $K3ABS train $WRUN
[ -s "$OUT/a/out/latest.safetensors" ] && [ -s "$OUT/a/out/state.json" ] && pass rank0-writes:rank0 \
  || fail rank0-writes:rank0 "rank 0 wrote no run directory"
[ ! -e "$OUT/b/out" ] && pass rank0-writes:others-nothing || fail rank0-writes:others-nothing "$(ls "$OUT/b/out")"
[ "$(grep -c '^step ' "$OUT/rank0-writes.out")" = 4 ] && pass rank0-writes:one-stdout \
  || fail rank0-writes:one-stdout "$(grep -c '^step ' "$OUT/rank0-writes.out") step lines"
# a run directory that only rank 0 has refuses the job, naming rank 0
expect_exit rank0-refuses 2 $MPI -np 1 -wdir "$OUT/a" $K3ABS train $WRUN : -np 1 -wdir "$OUT/b" $K3ABS train $WRUN
expect_err_contains rank0-refuses "rank 0 of 2"
expect_err_contains rank0-refuses "already holds a run"
rm -rf "$OUT/a/out"

# ---- refused ------------------------------------------------------------------------------------
expect_exit bad-ranks 2 $MPI -np 3 $K3 train $RUN --config $CFG --gradient-accumulation 2 --output-dir "$OUT/bad"
expect_err_contains bad-ranks "3 ranks cannot share 2 micro-batches a step (--gradient-accumulation 2)"
expect_err_contains bad-ranks "(-np 1, 2)"
[ ! -e "$OUT/bad" ] && pass bad-ranks:nothing-written || fail bad-ranks:nothing-written
# rank 1's config has another layer layout
sed 's/"hidden_size": 64/"hidden_size": 32/' $CFG >"$OUT/b/cfg.json"
cmp -s $CFG "$OUT/b/cfg.json" && fail other-config:setup "sed changed nothing"
expect_exit other-config 2 $MPI -np 1 -wdir "$OUT/a" $K3ABS train $WRUN : -np 1 -wdir "$OUT/b" $K3ABS train $WRUN
expect_err_contains other-config "rank 1 of 2"
expect_err_contains other-config "model config or training settings"
cp $CFG "$OUT/b/cfg.json"
# rank 1's training shard differs in one token (still a valid shard)
rm "$OUT/b/data"; cp -r "$D" "$OUT/b/data"
printf '\001\000' | dd of="$OUT/b/data/train.bin" bs=1 seek=100064 conv=notrunc status=none
cmp -s "$D/train.bin" "$OUT/b/data/train.bin" && fail other-data:setup "the token was already 1"
expect_exit other-data 2 $MPI -np 1 -wdir "$OUT/a" $K3ABS train $WRUN : -np 1 -wdir "$OUT/b" $K3ABS train $WRUN
expect_err_contains other-data "rank 1 of 2"
expect_err_contains other-data "token shards"
# refused before rank 0 touched its run directory
[ ! -e "$OUT/a/out" ] && pass other-data:nothing-written || fail other-data:nothing-written "$(ls "$OUT/a/out")"
# a rank that stops answering at its 3rd exchange: bounded, named, exit 1
expect_exit hang 1 env K3_DIST_TIMEOUT=3 K3_DIST_FAULT=hang:1:3 $MPI -np 2 $K3 train $RUN --config $CFG \
  --gradient-accumulation 2 --output-dir "$OUT/hang"
expect_err_contains hang "no answer from rank 1"
finish
