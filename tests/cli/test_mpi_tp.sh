#!/usr/bin/env bash
# The trunk split over the ranks (tensor parallelism, --parallel-layout tp+ep,
# the default under mpirun) on localhost (Open MPI, --oversubscribe): the
# logits bytes of 1, 2, 3 and 4 ranks equal one process's, resident and with a
# streamed trunk, and with the experts-only layout (ep); the run report's
# per-rank trunk bytes are the rank's share (together exactly one process's,
# each about 1/R); the memory plan counts a rank's share (a --trunk-gb one
# process cannot fit runs on 2 ranks; the rank whose share does not fit is
# named, exit 3); a rank killed or hanging in the middle of a token ends the
# job. Every run is bounded by `timeout`.
. "$(dirname "$0")/lib.sh"
mpi_setup
SRC=tests/fixtures/gen/k3_like   # 9 layers (KDA, MLA, a dense MLP, LatentMoE), 8 experts top-2
M=$OUT/model
T=$OUT/trunk
rm -rf "$OUT"/*; mkdir -p "$M"; cp "$SRC"/* "$M"/
IDS=99,46,66,78,71,82,91,43
WANT=98,87,14,17,122,55   # the float64 PyTorch reference (expected.json)
gen_ids() { tr -d '[:space:]' <"$1" | grep -o '"generated_ids":\[[0-9,]*\]' | grep -o '[0-9,]*\]' | tr -d ']'; }
PY=/usr/bin/python3; [ -x $PY ] || PY=python3
expect_exit pack 0 $K3 pack-trunk "$M" "$T"
expect_exit single 0 $K3 run "$M" --ids $IDS --gen 6 --quiet --out "$OUT/single.json" --dump-logits "$OUT/single.bin"
[ "$(gen_ids "$OUT/single.json")" = "$WANT" ] && pass single:ids || fail single:ids "$(gen_ids "$OUT/single.json")"

# ---- bit-identical at 1 to 4 ranks -------------------------------------------------
while read -r name ranks flags; do
  [ -z "$name" ] && continue
  flags=${flags//TRUNK/$T}
  for R in ${ranks//,/ }; do
    n=$name-np$R
    expect_exit "$n" 0 $MPI -np $R $K3 run "$M" --ids $IDS --gen 6 --quiet --out "$OUT/$n.json" \
      --dump-logits "$OUT/$n.bin" $flags </dev/null   # (mpirun would read the list on its stdin)
    cmp -s "$OUT/single.bin" "$OUT/$n.bin" && pass "$n:logits" || fail "$n:logits" "differ from one process's"
  done
done <<'LIST'
tp      1,2,3,4
tptrunk 4       --trunk TRUNK --trunk-gb 0.00012 --cache-gb 0.00002
tpchunk 3       --cache-gb 0.00012 --chunk 3
ep      4       --parallel-layout ep
LIST

# ---- the report: each rank reads its share of the trunk's matrices -------------------
for R in 2 3 4; do
  $PY - "$OUT/tp-np$R.json" $R <<'PY' && pass "share-np$R" || fail "share-np$R" "$(cat "$OUT/tp-np$R.json.txt")"
import json, sys
d = json.load(open(sys.argv[1]))["expert_parallel"]["decode"]
R = int(sys.argv[2])
read, whole = d["trunk_bytes_read_per_token"], d["trunk_bytes_one_process_per_token"]
ok = (d["layout"] == "tp+ep" and len(read) == R and whole > 0 and abs(sum(read) - whole) < 1e-6 * whole
      and max(read) <= 1.35 * whole / R and d["split_gathers_per_token"] >= 40
      and d["split_gathers_per_token"] < d["exchanges_per_token"])
open(sys.argv[1] + ".txt", "w").write(f"read {read} whole {whole} gathers {d['split_gathers_per_token']}")
sys.exit(0 if ok else 1)
PY
done
$PY -c '
import json, sys
d = json.load(open(sys.argv[1]))["expert_parallel"]["decode"]
sys.exit(0 if d["layout"] == "ep" and "trunk_bytes_read_per_token" not in d and d["exchanges_per_token"] == 8 else 1)' \
  "$OUT/ep-np4.json" && pass ep:no-split || fail ep:no-split
expect_exit talk 0 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 6
expect_err_contains talk "k3: tensor parallel, decode: the trunk's matrices read"
expect_err_contains talk "this rank's rows of the split matrices"

# ---- the memory plan counts a rank's share ---------------------------------------------
expect_exit plan-one 3 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.0004
expect_exit plan-np2 0 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 6 --quiet --trunk-gb 0.0004 --dump-logits "$OUT/plan.bin"
cmp -s "$OUT/single.bin" "$OUT/plan.bin" && pass plan-np2:logits || fail plan-np2:logits
expect_exit plan-np2-ep 3 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.0004 --parallel-layout ep
expect_exit plan-rank 3 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.00025
expect_err_contains plan-rank "rank 2 of 3"
expect_exit bad-layout 2 $K3 run "$M" --ids $IDS --gen 2 --parallel-layout tp
expect_err_contains bad-layout "is not tp+ep or ep"

# ---- faults in the middle of a token (the prompt's forward call makes about 55 exchanges,
# each decoded token 54: the 80th is inside the first decoded token) ----------------------
K3_DIST_TIMEOUT=4 K3_DIST_FAULT=hang:1:80 expect_exit rank-hangs 1 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 6 --quiet
expect_err_contains rank-hangs "no answer from rank 1"
expect_rank_killed rank-dies 2 die:2:80 timeout 120 mpirun --oversubscribe --mca btl self,vader -np 3 \
  $K3 run "$M" --ids $IDS --gen 6 --quiet
finish
