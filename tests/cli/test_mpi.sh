#!/usr/bin/env bash
# asan
# Expert-parallel k3 run under mpirun on localhost (Open MPI, --oversubscribe):
# the logits bytes of 1, 2 and 3 ranks equal the single process's (routed
# experts resident, streamed under a small --cache-gb with token-at-a-time or
# chunked prefill, trunk streamed, a placement from a cache trace), the ids
# equal the float64 PyTorch reference's; only rank 0 prints and writes; k3 chat
# gives one process's turns at 2 and 3 ranks and its session file loads; and the
# faults: more ranks than experts, a rank whose memory plan cannot fit, ranks
# whose checkpoints or command lines differ, a rank's read error mid-run, a
# rank that hangs, a rank that dies. Every run is bounded by `timeout`. Under
# the sanitizer build a subset runs (MPI start-up with full leak stacks takes
# seconds a rank): 2 ranks resident and streamed, a rank's plan refused, a
# rank's read error, a hang.
. "$(dirname "$0")/lib.sh"
mpi_setup
RANKS="1 2 3"; [ $ASAN = 1 ] && RANKS=2
K3ABS=$(realpath "$K3")
SRC=tests/fixtures/gen/k3_like   # 9 layers, 8 routed experts top-2 in 8 MoE layers
M=$OUT/model
T=$OUT/trunk
rm -rf "$OUT"/*; mkdir -p "$M"; cp "$SRC"/* "$M"/
IDS=99,46,66,78,71,82,91,43
WANT=98,87,14,17,122,55   # the float64 PyTorch reference (expected.json)
gen_ids() { tr -d '[:space:]' <"$1" | grep -o '"generated_ids":\[[0-9,]*\]' | grep -o '[0-9,]*\]' | tr -d ']'; }
expect_exit pack 0 $K3 pack-trunk "$M" "$T"

# ---- bit-identical at 1, 2 and 3 ranks -----------------------------------------------
expect_exit single 0 $K3 run "$M" --ids $IDS --gen 6 --quiet --out "$OUT/single.json" --dump-logits "$OUT/single.bin"
[ "$(gen_ids "$OUT/single.json")" = "$WANT" ] && pass single:ids || fail single:ids "$(gen_ids "$OUT/single.json")"
while read -r name flags; do
  [ -z "$name" ] && continue
  flags=${flags//TRUNK/$T}
  [ $ASAN = 1 ] && [ "$name" != resident ] && [ "$name" != streamed ] && continue
  for R in $RANKS; do
    n=$name-np$R
    expect_exit "$n" 0 $MPI -np $R $K3 run "$M" --ids $IDS --gen 6 --quiet --out "$OUT/$n.json" \
      --dump-logits "$OUT/$n.bin" $flags </dev/null   # (mpirun would read the list on its stdin)
    got=$(gen_ids "$OUT/$n.json")
    [ "$got" = "$WANT" ] && pass "$n:ids" || fail "$n:ids" "got $got want $WANT"
    cmp -s "$OUT/single.bin" "$OUT/$n.bin" && pass "$n:logits" || fail "$n:logits" "differ from one process's"
  done
done <<'LIST'
resident
streamed     --cache-gb 0.00002 --chunk 1
chunked      --cache-gb 0.00012 --chunk 3
trunk        --trunk TRUNK --trunk-gb 0.00012 --cache-gb 0.00002
full         --cache-gb 0.00002 --full
LIST

if [ $ASAN = 0 ]; then
# only rank 0 talks: one line of ids on stdout, its report names the ranks
expect_exit talk 0 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 6 --out "$OUT/talk.json"
[ "$(grep -c '' "$OUT/talk.out")" = 1 ] && [ "$(tr -d '\n' <"$OUT/talk.out")" = "${WANT//,/ }" ] \
  && pass talk:one-stdout || fail talk:one-stdout "$(head -c 200 "$OUT/talk.out")"
[ "$(grep -c '^k3: memory plan' "$OUT/talk.err")" = 1 ] && pass talk:one-report || fail talk:one-report
# per token, from the model's 9 layers (6 KDA, 3 MLA; 1 dense, 8 MoE): KDA 2 gathers a
# layer, MLA 3, dense 2, MoE 2 and its expert exchange, the head 1: 12+9+2+24+1 = 48
grep -q '^k3: expert parallel, decode: 3 ranks hold 16..24 routed experts each; per token 48.0 exchanges,' \
  "$OUT/talk.err" && pass talk:figures || fail talk:figures "$(grep 'expert parallel' "$OUT/talk.err")"
tr -d '[:space:]' <"$OUT/talk.json" | grep -q '"expert_parallel":{"prefill":{.*"decode":{"phase":"decode","ranks":3' \
  && pass talk:json || fail talk:json
# the plan is per rank: rank 0 holds 2 of each layer's 8 experts
grep -q '16 of 16 experts' "$OUT/talk.err" && pass talk:rank-plan || fail talk:rank-plan "$(grep 'expert cache' "$OUT/talk.err")"

# a placement from a cache trace: the same bits
expect_exit trace 0 $K3 run "$M" --ids $IDS,5,6,7,8,9,10,11,12 --gen 20 --quiet --dump-cache-trace "$OUT/trace"
expect_exit place 0 $K3 cache-sim "$OUT/trace/cache_trace.bin" --placement 3 --model "$M" --placement-out "$OUT/p3.json"
expect_out_contains place "placement for 3 ranks"
expect_exit placed 0 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 6 --quiet --dump-logits "$OUT/placed.bin" \
  --expert-placement "$OUT/p3.json" --cache-gb 0.00003 --chunk 1
cmp -s "$OUT/single.bin" "$OUT/placed.bin" && pass placed:logits || fail placed:logits
expect_exit placed-wrong-ranks 2 $MPI -np 2 $K3 run "$M" --ids $IDS --expert-placement "$OUT/p3.json"
expect_err_contains placed-wrong-ranks "made for 3 ranks, this job has 2"

# ---- k3 chat: rank 0 reads the input and talks, every rank computes -----------------
PY=/usr/bin/python3
if [ $ASAN = 0 ] && $PY -c 'import numpy' 2>/dev/null; then
  CM=tests/out/mpi-chat-model   # the full Kimi vocabulary, 8 experts top-2 (as test_chat.sh's)
  chat_model $CM 3
  # the turns' ids (and the transcript) of two runs, equal?
  same_chat() { $PY -c '
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ids = lambda d: [t["generated_ids"] for t in d["turns"]]
sys.exit(0 if ids(a) == ids(b) and a["messages"] == b["messages"] else 1)' "$1" "$2"; }
  printf 'Hello there\nWhat is 2+2?\n/save %s\nAnd once more.\n' "$OUT/chat.k3session" >"$OUT/chat.txt"
  CHAT="chat $CM --gen 10 --temperature 0.9 --top-k 50 --seed 7 --system You_are_a_test."
  expect_exit chat-1 0 $K3 $CHAT --out "$OUT/chat1.json" <"$OUT/chat.txt"
  for R in 2 3; do
    expect_exit chat-np$R 0 $MPI -np $R $K3 $CHAT --out "$OUT/chat$R.json" <"$OUT/chat.txt"
    same_chat "$OUT/chat1.json" "$OUT/chat$R.json" && pass chat-np$R:turns || fail chat-np$R:turns
    [ "$(grep -c '^\[turn ' "$OUT/chat-np$R.err")" = 3 ] && pass chat-np$R:one-report || fail chat-np$R:one-report
  done
  # the session rank 0 saved (3 ranks) continues in one process as one process's own
  printf 'And once more.\n' >"$OUT/chat-last.txt"
  expect_exit chat-load 0 $K3 $CHAT --load "$OUT/chat.k3session" --out "$OUT/chatl.json" <"$OUT/chat-last.txt"
  $PY -c '
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
sys.exit(0 if a["turns"][2]["generated_ids"] == b["turns"][-1]["generated_ids"] else 1)' "$OUT/chat1.json" \
    "$OUT/chatl.json" && pass chat-load:continues || fail chat-load:continues
elif [ $ASAN = 0 ]; then
  skip chat "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
fi

# ---- faults: one line, nonzero exit, never a hang ---------------------------------
expect_exit too-many-ranks 2 $MPI -np 9 $K3 run "$M" --ids $IDS --gen 2
expect_err_contains too-many-ranks "9 ranks but 8 routed experts per layer"
expect_exit not-a-job-command 2 $MPI -np 2 $K3 inspect "$M"
expect_exit no-rank-trace 2 $MPI -np 2 $K3 run "$M" --ids $IDS --dump-cache-trace "$OUT/rtrace"
fi
# a plan that fits ranks 0 and 1 (2 experts a layer) but not rank 2 (4)
row='[0,0,1,1,2,2,2,2]'
printf '{"format":"k3-expert-placement","version":1,"ranks":3,"num_layers":9,"num_experts":8,"owner":[%s]}\n' \
  "$row,$row,$row,$row,$row,$row,$row,$row,$row" >"$OUT/uneven.json"
expect_exit rank-budget 3 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 2 --expert-placement "$OUT/uneven.json" \
  --cache-gb 0.00003 --chunk 3
expect_err_contains rank-budget "rank 2 of 3"
if [ $ASAN = 0 ]; then
# the same relative MODEL_DIR naming another checkpoint on one rank
mkdir -p "$OUT/a" "$OUT/b"; cp -r "$M" "$OUT/a/model"; cp -r "$M" "$OUT/b/model"
sed -i 's/"rms_norm_eps": 1e-05/"rms_norm_eps": 2e-05/' "$OUT/b/model/config.json"
expect_exit other-model 2 $MPI -np 1 -wdir "$OUT/a" $K3ABS run model --ids $IDS --gen 2 : \
  -np 1 -wdir "$OUT/b" $K3ABS run model --ids $IDS --gen 2
expect_err_contains other-model "rank 1 of 2"
expect_err_contains other-model "not the same checkpoint"
expect_exit other-args 2 $MPI -np 1 $K3 run "$M" --ids $IDS --gen 2 : -np 1 $K3 run "$M" --ids $IDS --gen 3
expect_err_contains other-args "another k3 binary or command line"
fi
# a read error on rank 1 in the middle of the run
expect_exit rank-read-error 1 $MPI -np 1 $K3 run "$M" --ids $IDS --gen 6 --quiet --out "$OUT/re.json" \
  --cache-gb 0.00002 --chunk 1 : -np 1 -x K3_IO_FAIL_AFTER=20 $K3 run "$M" --ids $IDS --gen 6 --quiet \
  --out "$OUT/re.json" --cache-gb 0.00002 --chunk 1
expect_err_contains rank-read-error "rank 1 of 2"
expect_err_contains rank-read-error "Input/output error"
[ ! -e "$OUT/re.json" ] && pass rank-read-error:no-report || fail rank-read-error:no-report
# a rank that stops answering: the others time out and name it
K3_DIST_TIMEOUT=4 K3_DIST_FAULT=hang:1:5 expect_exit rank-hangs 1 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 6 --quiet
expect_err_contains rank-hangs "no answer from rank 1"
# a rank that dies (SIGKILL): mpirun ends the job and its report names the rank
[ $ASAN = 1 ] && { finish; exit; }
expect_rank_killed rank-dies 2 die:2:5 timeout 120 mpirun --oversubscribe --mca btl self,vader -np 3 \
  $K3 run "$M" --ids $IDS --gen 6 --quiet
finish
