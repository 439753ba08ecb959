#!/usr/bin/env bash
# bench/mpi.sh: decode under mpirun on this host (localhost, shared memory) at 1
# to 4 ranks, in the default layout (tp+ep: the trunk split by output rows, the
# routed experts by expert), with split experts (tp: the experts by rows too) and
# in the experts-only layout (ep), and the figures the projection needs.
#
#   bench/mpi.sh [--model DIR] [--gen N] [--max-ranks R] [--threads T] [--out FILE]
#
# Per rank count, `mpirun -np R k3 run MODEL --ids ... --gen N --out` reports
# (rank 0's "expert_parallel" block, every rank's own figures) per decoded
# token: exchanges (of which the split trunk's gathers), bytes each rank
# sent, the share of the decode time each rank spent inside them (posting,
# transfer and waiting for slower ranks), the trunk's weight bytes each rank's
# products read against one process's, with the tokens/s and a check that the
# ids equal the single process's; then the same with the trunk packed and streamed
# (--trunk): each rank's streamed bytes read from disk per token against one
# process's. Then bin/bench_exchange times one exchange alone (the release's
# decode block at each rank count, and fixed sizes), and k3 cache-sim spreads
# the peer's expert trace of the real release over 2..32 ranks. Everything
# goes to one JSON file (default bench/.cache/mpi.json) for
# bench/mpi_projection.py. The model defaults to the mid checkpoint
# (tools/gen_checkpoint.py --preset mid, 627 MB, built once under
# bench/.cache). A benchmark, never a test: on a shared or small machine the
# ranks share cores (--oversubscribe beyond the core count) and the shares
# say so.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=bench/.cache/mid
GEN=33
MAXR=4
THREADS=1
OUTJ=bench/.cache/mpi.json
while [ $# -gt 0 ]; do
  case $1 in
    --model) MODEL=$2; shift 2 ;;
    --gen) GEN=$2; shift 2 ;;
    --max-ranks) MAXR=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --out) OUTJ=$2; shift 2 ;;
    *) echo "bench/mpi.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=/usr/bin/python3; [ -x $PY ] || PY=python3
RELEASE=tests/fixtures/k3-release            # the released config.json
TRACE=bench/.cache/expert_trace.bin          # the peer's trace of a real run of the release
mkdir -p bench/.cache
[ -s "$TRACE" ] || gunzip -c tests/fixtures/peer/expert_trace.bin.gz >"$TRACE"
make -s -j2 bin/k3 bin/bench_exchange >/dev/null
mkdir -p bench/.cache
if [ ! -e "$MODEL/config.json" ]; then
  echo "bench/mpi.sh: building $MODEL (tools/gen_checkpoint.py --preset mid)" >&2
  $PY tools/gen_checkpoint.py "$MODEL" --preset mid >/dev/null
fi
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
MPI="timeout 600 mpirun -q --oversubscribe --mca btl self,vader"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
IDS=$(seq 11 10 330 | paste -sd, -)   # a 32-token prompt
# warm the page cache: every rank maps the same shards
bin/k3 run "$MODEL" --ids "$IDS" --gen 2 --quiet --threads "$THREADS" >/dev/null
for R in $(seq 1 "$MAXR"); do
  if [ "$R" = 1 ]; then
    bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/run1.json"
  else
    $MPI -np "$R" bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/run$R.json"
    $MPI -np "$R" bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/ep$R.json" \
      --parallel-layout ep
    $MPI -np "$R" bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/split$R.json" \
      --parallel-layout tp
  fi
  $MPI -np "$R" bin/bench_exchange --config "$RELEASE/config.json" --iters 400 >"$W/exch$R.jsonl"
done
# the packed streamed trunk (k3 pack-trunk, --trunk): every layer streamed through two
# ring slots of the rank's largest share and nothing pinned (--trunk-gb: the plan's
# model-level tensors, as one process's plan gives them, plus 2.3 times the largest
# layer's run over R), so a rank's reads per token are its share of the whole stack
TRUNK=$MODEL-trunk
# (packed again unless of the format version this k3 reads: K3_TRUNK_VERSION, src/memory/trunk.h)
grep -q '"version": 2,' "$TRUNK/trunk.json" 2>/dev/null || bin/k3 pack-trunk "$MODEL" "$TRUNK" >/dev/null
bin/k3 run "$MODEL" --ids "$IDS" --gen 2 --quiet --threads "$THREADS" --trunk "$TRUNK" --out "$W/plan.json"
tgb() {
  $PY - "$W/plan.json" "$TRUNK/trunk.json" "$1" <<'PY'
import json, sys
head = json.load(open(sys.argv[1]))["memory"]["plan"]["head_bytes"]
big = max(r["bytes"] for r in json.load(open(sys.argv[2]))["runs"] if r["layer"] >= 0)
print((head + 2.3 * big / int(sys.argv[3]) + 4e6) / 1e9)
PY
}
for R in $(seq 1 "$MAXR"); do
  if [ "$R" = 1 ]; then
    bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/st1.json" \
      --trunk "$TRUNK" --trunk-gb "$(tgb 1)" --cache-gb 2
  else
    $MPI -np "$R" bin/k3 run "$MODEL" --ids "$IDS" --gen "$GEN" --quiet --threads "$THREADS" --out "$W/st$R.json" \
      --trunk "$TRUNK" --trunk-gb "$(tgb "$R")" --cache-gb 2
  fi
done
for R in 2 4 8 16 32; do
  bin/k3 cache-sim "$TRACE" --placement $R --model "$RELEASE" --placement-out "$W/place$R.json" \
    >"$W/place$R.txt"
done
$PY - "$W" "$MAXR" "$OUTJ" "$MODEL" "$(nproc)" "$(cut -d' ' -f1 /proc/loadavg)" <<'PY'
import json, os, re, sys
w, maxr, out, model, ncpu, load = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
res = {"model": model, "cpus": ncpu, "load_before": float(load), "runs": [], "exchange": [], "placement": []}
ids1 = None
print(f"decode of {model} under mpirun on this host ({ncpu} CPUs, load {load}); per decoded token:")
print(f"{'ranks':>5} {'layout':>6} {'tok/s':>8} {'exch/tok':>8} {'gathers':>7} {'kB sent/rank':>13} "
      f"{'exch share min..max':>20} {'split MB/rank':>13} {'of one':>6} {'ids':>4}")
for r in range(1, maxr + 1):
    for lay in ("tp+ep", "tp", "ep") if r > 1 else ("one",):
        j = json.load(open(f"{w}/{dict(ep='ep', tp='split').get(lay, 'run')}{r}.json"))
        ids = j["generated_ids"]
        if ids1 is None: ids1 = ids
        d = j.get("expert_parallel", {}).get("decode")
        row = {"ranks": r, "layout": lay, "tokens_per_s": j["tokens_per_s"], "same_ids": ids == ids1,
               "exchanges_per_token": d["exchanges_per_token"] if d else 0,
               "split_gathers_per_token": d.get("split_gathers_per_token", 0) if d else 0,
               "bytes_sent_per_token": d["bytes_sent_per_token"] if d else [0],
               "exchange_share": d["exchange_share"] if d else [0], "split_share": d.get("split_share") if d else None,
               "trunk_bytes_read_per_token": d.get("trunk_bytes_read_per_token") if d else None,
               "trunk_bytes_one_process_per_token": d.get("trunk_bytes_one_process_per_token") if d else None,
               "experts_held": d["experts_held"] if d else None, "oversubscribed": r * int(j["threads"]) > ncpu}
        res["runs"].append(row)
        sh = row["exchange_share"]
        tr = row["trunk_bytes_read_per_token"]
        trs = f"{max(tr)/1e6:>13.2f} {max(tr)/row['trunk_bytes_one_process_per_token']:>6.3f}" if tr else f"{'all':>13} {'1':>6}"
        print(f"{r:>5} {lay:>6} {row['tokens_per_s']:>8.2f} {row['exchanges_per_token']:>8.1f} "
              f"{row['split_gathers_per_token']:>7.1f} {max(row['bytes_sent_per_token'])/1e3:>13.1f} "
              f"{100*min(sh):>9.1f}..{100*max(sh):>5.1f}% {trs} "
              f"{'same' if row['same_ids'] else 'DIFF':>4}{'  (oversubscribed)' if row['oversubscribed'] else ''}")
    for line in open(f"{w}/exch{r}.jsonl"):
        res["exchange"].append(json.loads(line))
print("\nstreamed (--trunk, every layer through the ring): streamed trunk bytes read from disk per decoded token")
print(f"{'ranks':>5} {'tok/s':>8} {'pinned':>6} {'MB per rank min..max':>21} {'of one':>13} {'all ranks':>9} {'ids':>4}")
res["streamed"] = []
one = None
for r in range(1, maxr + 1):
    j = json.load(open(f"{w}/st{r}.json"))
    toks = [s["trunk_bytes"] for s in j["memory"]["steps"] if s["kind"] == "token"]
    disk = [sum(toks) / len(toks)] if r == 1 else j["expert_parallel"]["decode"]["trunk_disk_bytes_per_token"]
    if one is None: one = disk[0]
    row = {"ranks": r, "tokens_per_s": j["tokens_per_s"], "pinned_layers": j["memory"]["plan"]["pinned_layers"],
           "ring_slots": j["memory"]["plan"]["ring_slots"], "trunk_disk_bytes_per_token": disk,
           "one_process_bytes_per_token": one, "same_ids": j["generated_ids"] == ids1,
           "oversubscribed": r * int(j["threads"]) > ncpu}
    res["streamed"].append(row)
    print(f"{r:>5} {row['tokens_per_s']:>8.2f} {row['pinned_layers']:>6} {min(disk)/1e6:>10.2f}..{max(disk)/1e6:>9.2f} "
          f"{min(disk)/one:>6.3f}..{max(disk)/one:>5.3f} {sum(disk)/one:>9.3f} {'same' if row['same_ids'] else 'DIFF':>4}"
          f"{'  (oversubscribed)' if row['oversubscribed'] else ''}")
print("\none exchange alone (bench_exchange; the release's decode block: ceil(16/R) x 3584 f32 per rank):")
for e in res["exchange"]:
    if e["ranks"] > 1 and e["model_block"]:
        print(f"  {e['ranks']} ranks: {e['block_bytes']} B a rank: median {e['median_us']:.1f} us, best {e['best_us']:.1f} us")
for r in (2, 4, 8, 16, 32):
    t = open(f"{w}/place{r}.txt").read()
    m = re.search(r"serves ([0-9.]+)x .*contiguous: ([0-9.]+)x\); per step and layer the busiest rank computes "
                  r"([0-9.]+) experts on average \(contiguous: ([0-9.]+)\)", t)
    p = {"ranks": r, "imbalance_traced": float(m.group(1)), "imbalance_contiguous": float(m.group(2)),
         "step_max_traced": float(m.group(3)), "step_max_contiguous": float(m.group(4)),
         "owner": json.load(open(f"{w}/place{r}.json"))["owner"]}
    res["placement"].append(p)
print("\nthe peer's release trace over R ranks: busiest rank's share of requests over the mean "
      "(traced placement / contiguous):")
print("  " + ", ".join(f"{p['ranks']}: {p['imbalance_traced']:.3f} / {p['imbalance_contiguous']:.3f}"
                       for p in res["placement"]))
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
json.dump(res, open(out, "w"))
print(f"\nwritten {out}")
PY
