#!/usr/bin/env bash
# The trunk split over the ranks (tensor parallelism, --parallel-layout tp+ep,
# the default under mpirun) on localhost (Open MPI, --oversubscribe): the
# logits bytes of 1, 2, 3 and 4 ranks equal one process's, resident and with a
# streamed trunk, with the experts-only layout (ep) and with split experts
# (tp: the routed experts' matrices split by rows too); the run report's
# per-rank trunk bytes are the rank's share (together exactly one process's,
# each about 1/R); with a packed streamed trunk each rank reads from disk only its
# rows' share (together about one process's reads, each about 1/R) and checks
# their 16-row checksums; the memory plan counts a rank's share (a --trunk-gb one
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
tptrunk 1,2,3,4 --trunk TRUNK --trunk-gb 0.00012 --cache-gb 0.00002
tpchunk 3       --cache-gb 0.00012 --chunk 3
ep      4       --parallel-layout ep
split   2,3,4   --parallel-layout tp
splittrunk 2,3  --parallel-layout tp --trunk TRUNK --trunk-gb 0.00012 --cache-gb 0.00006
splitchunk 3    --parallel-layout tp --cache-gb 0.00018 --chunk 3
LIST
# (a rank's rows of an expert are read as one aligned span per tensor: on these
# tiny experts the spans' page rounding makes a share's buffer larger than a
# whole expert's, hence the larger --cache-gb of the split runs)

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
# ---- split experts (--parallel-layout tp): each rank computes and reads its rows of
# every selected expert, so the split matrices' bytes (trunk and experts) add up to one
# process's and each rank's are about 1/R; no expert exchange is left (every exchange is
# a gather of split products), and every rank holds (its rows of) every expert.
for R in 2 3 4; do
  $PY - "$OUT/split-np$R.json" "$OUT/tp-np$R.json" $R <<'PY' && pass "split-share-np$R" || fail "split-share-np$R" "$(cat "$OUT/split-np$R.json.txt")"
import json, sys
d = json.load(open(sys.argv[1]))["expert_parallel"]["decode"]
t = json.load(open(sys.argv[2]))["expert_parallel"]["decode"]
R = int(sys.argv[3])
read, whole = d["trunk_bytes_read_per_token"], d["trunk_bytes_one_process_per_token"]
# (1.5: the experts' matrices here are 32-64 rows, two to four 16-row runs, so
# their shares are uneven at 3 and 4 ranks)
ok = (d["layout"] == "tp" and len(read) == R and abs(sum(read) - whole) < 1e-6 * whole
      and max(read) <= 1.5 * whole / R
      # the experts' rows are in the split bytes now: more than the trunk's alone
      and whole > t["trunk_bytes_one_process_per_token"]
      and d["exchanges_per_token"] == d["split_gathers_per_token"]
      and len(set(d["experts_held"])) == 1 and d["experts_held"][0] > max(t["experts_held"]))
open(sys.argv[1] + ".txt", "w").write(f"read {read} whole {whole} exchanges {d['exchanges_per_token']} "
                                      f"gathers {d['split_gathers_per_token']} held {d['experts_held']}")
sys.exit(0 if ok else 1)
PY
done
expect_exit split-talk 0 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 6 --parallel-layout tp </dev/null
expect_err_contains split-talk "k3: split experts, decode: every rank holds its rows of"
expect_exit talk 0 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 6
expect_err_contains talk "k3: tensor parallel, decode: the trunk's matrices read"
expect_err_contains talk "this rank's rows of the split matrices"

# ---- a packed trunk: each rank reads only its rows' share of every streamed layer ----------
# A model whose matrices span many 16-row runs (hidden 512; k3_like's are 48-64 rows, so
# a rank's share of one is a page or two), made by tools/gen_checkpoint.py; four layers
# of about 3.4 MB. Each run streams every layer through one ring slot (--trunk-gb: the
# head, about 0.53 MB, plus 1.3 slots of a rank's largest share: nothing pinned), so a
# rank's reads per token are its share of the whole stack: with the rows split, about
# 1/R of one process's plus what every rank reads whole (MLA's kv_b, norms, conv taps)
# and the page rounding of each share.
PY=/usr/bin/python3
if $PY -c 'import numpy' 2>/dev/null; then
  BM=$OUT/mid; BT=$OUT/midt
  $PY tools/gen_checkpoint.py "$BM" --preset tiny --set hidden_size=512 --set num_heads=8 --set head_dim=64 \
    --set num_hidden_layers=4 --set layer_map=KKKM --set first_k_dense_replace=0 --set num_attention_heads=8 \
    --set q_lora_rank=512 --set kv_lora_rank=256 --set qk_nope_head_dim=64 --set v_head_dim=64 --seed 3 --force \
    >"$OUT/gen.log" 2>&1 || fail gen-mid "$(tail -n 3 "$OUT/gen.log")"
  expect_exit pack-mid 0 $K3 pack-trunk "$BM" "$BT"
  gb() { $PY -c "print((0.6 + 1.3 * (3.5 / $1 + 0.6)) / 1000)"; }   # GB for R ranks
  expect_exit mid-one 0 $K3 run "$BM" --ids $IDS --gen 6 --quiet --out "$OUT/mid-one.json" --dump-logits "$OUT/mid-one.bin"
  for R in 1 2 3 4; do
    n=midtrunk-np$R
    expect_exit "$n" 0 $MPI -np $R $K3 run "$BM" --ids $IDS --gen 6 --quiet --out "$OUT/$n.json" \
      --dump-logits "$OUT/$n.bin" --trunk "$BT" --trunk-gb "$(gb $R)" --cache-gb 0.0001 </dev/null
    cmp -s "$OUT/mid-one.bin" "$OUT/$n.bin" && pass "$n:logits" || fail "$n:logits" "differ from one process's"
  done
  # the plan counts a rank's share of the streamed layers: the ring slot 2 ranks fit
  # is too small for one process's largest layer
  expect_exit mid-plan-one 3 $K3 run "$BM" --ids $IDS --gen 2 --quiet --trunk "$BT" --trunk-gb "$(gb 2)" --cache-gb 0.0001
  expect_err_contains mid-plan-one "one ring slot"
  # one process's streamed reads per decoded token against each rank's
  for R in 2 3 4; do
    $PY - "$OUT/midtrunk-np1.json" "$OUT/midtrunk-np$R.json" $R "$OUT/disk$R.txt" <<'PY' && pass "disk-share-np$R" || fail "disk-share-np$R" "$(cat "$OUT/disk$R.txt")"
import json, sys
one = json.load(open(sys.argv[1]))
toks = [s["trunk_bytes"] for s in one["memory"]["steps"] if s["kind"] == "token"]
whole = sum(toks) / len(toks)
j = json.load(open(sys.argv[2]))
R = int(sys.argv[3])
d = j["expert_parallel"]["decode"]
disk = d["trunk_disk_bytes_per_token"]
rows, rows_one = d["trunk_bytes_read_per_token"], d["trunk_bytes_one_process_per_token"]
ok = (one["memory"]["plan"]["pinned_layers"] == 0 and j["memory"]["plan"]["pinned_layers"] == 0 and len(disk) == R
      and whole > 3e6
      # every byte is read by some rank, and little twice (what stays whole, page rounding)
      and 0.99 * whole <= sum(disk) <= 1.35 * whole
      # each rank about 1/R (no rank reads the whole stack, none skips its share; the
      # margin: what stays whole, uneven shares, and parts of a layer the one-slot
      # ring reads again when the next layer needs its room first)
      and max(disk) <= 1.5 * whole / R and min(disk) >= 0.8 * whole / R
      # the split products' own count: the rows' shares add up exactly
      and abs(sum(rows) - rows_one) < 1e-6 * rows_one and max(rows) <= 1.35 * rows_one / R)
open(sys.argv[4], "w").write(
    f"one process {whole:.0f} B a token; ranks {disk}; rows {rows} of {rows_one}")
sys.exit(0 if ok else 1)
PY
  done
  # the model-level run is read whole at open (its checksum) but of the head's matrix
  # each rank keeps only its rows: the plan's model-level bytes fall with R (the
  # embedding rows in use, the norms stay whole)
  $PY - "$OUT" <<'PY' && pass mid-head-share || fail mid-head-share "$(cat "$OUT/head.txt")"
import json, sys
h = [json.load(open(f"{sys.argv[1]}/midtrunk-np{r}.json"))["memory"]["plan"]["head_bytes"] for r in (1, 2, 3, 4)]
open(sys.argv[1] + "/head.txt", "w").write(f"head bytes at 1-4 ranks {h}")
sys.exit(0 if h[0] > h[1] > h[2] > h[3] and h[1] < 0.8 * h[0] else 1)
PY
  expect_exit mid-talk 0 $MPI -np 2 $K3 run "$BM" --ids $IDS --gen 4 --trunk "$BT" --trunk-gb "$(gb 2)" --cache-gb 0.0001 </dev/null
  expect_err_contains mid-talk "k3: packed trunk, decode: each rank read"
  # a flipped byte in rows 384.. of layer 1's q_proj (512 rows): the rank that holds
  # them reads and checks them (their 16-row checksum) and the job ends, naming it
  cp "$BT/trunk.bin" "$OUT/midt.bin.good"
  OFF=$($PY -c "
import json, sys
d = json.load(open(sys.argv[1]))
r = [r for r in d['runs'] if r['layer'] == 1][0]
t = [t for t in r['tensors'] if t['name'].endswith('layers.1.self_attn.q_proj.weight')][0]
print(r['offset'] + t['offset'] + t['bytes'] * 3 // 4)" "$BT/trunk.json")
  printf '\x5a' | dd of="$BT/trunk.bin" bs=1 seek="$OFF" conv=notrunc status=none
  expect_exit flip-np2 4 $MPI -np 2 $K3 run "$BM" --ids $IDS --gen 2 --quiet --trunk "$BT" --trunk-gb "$(gb 2)" \
    --cache-gb 0.0001 </dev/null
  expect_err_contains flip-np2 "rank 1 of 2"
  expect_err_contains flip-np2 "layers.1.self_attn.q_proj.weight fails its checksum"
  cp "$OUT/midt.bin.good" "$BT/trunk.bin"
else
  skip disk-share "python3 with numpy missing: the model cannot be generated (scripts/setup.sh --test)"
fi

# ---- the memory plan counts a rank's share ---------------------------------------------
expect_exit plan-one 3 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.0004
expect_exit plan-np2 0 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 6 --quiet --trunk-gb 0.0004 --dump-logits "$OUT/plan.bin"
cmp -s "$OUT/single.bin" "$OUT/plan.bin" && pass plan-np2:logits || fail plan-np2:logits
expect_exit plan-np2-ep 3 $MPI -np 2 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.0004 --parallel-layout ep
expect_exit plan-rank 3 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 2 --trunk-gb 0.00025
expect_err_contains plan-rank "rank 2 of 3"
expect_exit bad-layout 2 $K3 run "$M" --ids $IDS --gen 2 --parallel-layout pt
expect_err_contains bad-layout "is not tp+ep, tp or ep"

# ---- faults in the middle of a token (the prompt's forward call makes about 49 exchanges,
# each decoded token 48: the 80th is inside the first decoded token) ----------------------
K3_DIST_TIMEOUT=4 K3_DIST_FAULT=hang:1:80 expect_exit rank-hangs 1 $MPI -np 3 $K3 run "$M" --ids $IDS --gen 6 --quiet
expect_err_contains rank-hangs "no answer from rank 1"
expect_rank_killed rank-dies 2 die:2:80 timeout 120 mpirun --oversubscribe --mca btl self,vader -np 3 \
  $K3 run "$M" --ids $IDS --gen 6 --quiet
finish
