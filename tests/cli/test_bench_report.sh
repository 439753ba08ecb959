#!/usr/bin/env bash
# bench/report.sh without the heavy benchmarks: the table, the JSON and the SVG
# rendered from a canned report (tests/fixtures/bench/report.json, figures
# chosen so every share and verdict below is worked out by hand), its errors,
# and, when bin/bench_index is built (`make bench`), one real run of the cheap
# sections on the tiny peer checkpoint.
. "$(dirname "$0")/lib.sh"
PY=/usr/bin/python3
if ! [ -x "$PY" ]; then
  skip report "$PY missing: bench/report.py is not tested"
  finish; exit $?
fi
R=bench/report.py
FIX=tests/fixtures/bench/report.json

expect_exit render 0 $PY $R --render $FIX --svg "$OUT/r.svg" --md "$OUT/r.md"
# row NAME TARGET-PREFIX TEXT...: the table row starting with TARGET-PREFIX holds every TEXT
row() {
  local name=$1 target=$2; shift 2
  local line; line=$(grep -F "| $target" "$OUT/render.out" | head -n 1)
  [ -n "$line" ] || { fail "$name" "no row '$target'"; return; }
  for t in "$@"; do
    case "$line" in *"$t"*) ;; *) fail "$name" "row '$target' lacks '$t': $line"; return;; esac
  done
  pass "$name"
}
# decode: 9.0 of 12.0 GB/s = 75% (met), CPU 6.0 of 12.0 = 50% (not), 2 threads 50/25 = x2.00
row decode1 "decode, 1 thread (wall" "25.0 tok/s" "33.3 tok/s = 360.0 MB/token / 12.0 GB/s" "| 75%" "| yes"
row decode1cpu "decode, 1 thread (CPU" "| 50%" "**no**"
row decode2 "decode, 2 threads (wall" "| 90%" "| yes"
row decode21 "decode, 2 threads vs 1" "x2.00" "| yes"
# prefill: 62.5 / 160 = 39%, 200 < 400 tok/s; 131.25 / 320 = 41%, 420 >= 400
row prefill1 "prefill 256-token prompt, 1 thread" "200.0 tok/s" "| 39%" "**no**"
row prefill2 "prefill 256-token prompt, 2 threads" "420.0 tok/s" "FMA peak 320.0" "| 41%" "| yes"
# streaming: the old-I/O rerun is not a row; rungs without ring slots have no goal
row stream_res "streaming: resident" "| 8%" "compute-bound" "| -"
row stream_ok "streaming: trunk 0.25 GB" "0.150 s/token" "0.142 s/token" "| 94%" "| yes"
row stream_no "streaming: trunk 0.125 GB" "| 65%" "**no**"
if grep -q SHOULD-NOT-APPEAR "$OUT/render.out"; then fail stream_before "old-I/O row shown"; else pass stream_before; fi
# training: 700 x 0.1166 GFLOP = 81.6 GFLOP/s of 320 = 26%; ratios 7.00 wall, 2.50 CPU (< 3: not met)
row train_f32 "training smol-50m, k3 f32" "700.0 tok/s" "81.6 GFLOP/s" "PyTorch 100.0 tok/s" "| 26%" "**no**"
row train_ratio "  k3 f32 / PyTorch" "x7.00 wall, x2.50 CPU time" "**no**"
row train_bf16 "training smol-50m, k3 bf16" "3000.0 tok/s" "| 109%" "| yes"
row train_torch "training smol-50m, PyTorch" "BLAS: canned BLAS" "| 4%"
row index "index 497,220 tensors" "0.310 s" "< 0.1 s" "**no**"
row ttft "time to first token" "0.085 s" "| yes"
expect_out_contains render "before 0.10/0.20/0.30, after 1.50/0.60/0.40"
expect_out_contains render "CPU: Canned CPU <test> & co, 2 cores"
n=$(grep -c '^| ' "$OUT/render.out")
[ "$n" -eq 18 ] && pass rows:count || fail rows:count "$n table lines, wanted 18 (header + 17 rows)"
cmp -s <(grep '^|' "$OUT/render.out") <(grep '^|' "$OUT/r.md") && pass md:same_table || fail md:same_table
# SVG: well-formed, text escaped, one bar per row with a share (12), one goal
# tick per bar with a goal (10), targets without a roofline listed (5)
if $PY -c 'import sys, xml.dom.minidom as m; m.parse(sys.argv[1])' "$OUT/r.svg" 2>"$OUT/svg.err"; then
  pass svg:xml
else
  fail svg:xml "$(head -c 300 "$OUT/svg.err")"
fi
grep -qF 'Canned CPU &lt;test&gt; &amp; co' "$OUT/r.svg" && pass svg:escaped || fail svg:escaped
bars=$(grep -c 'height="16" fill="#' "$OUT/r.svg")
[ "$bars" -eq 12 ] && pass svg:bars || fail svg:bars "$bars bars, wanted 12"
ticks=$(grep -c 'stroke="#c0392b" stroke-width="3"/>$' "$OUT/r.svg")
[ "$ticks" -eq 10 ] && pass svg:goal_ticks || fail svg:goal_ticks "$ticks ticks, wanted 10"
dots=$(grep -c '<circle' "$OUT/r.svg")
[ "$dots" -eq 5 ] && pass svg:others || fail svg:others "$dots, wanted 5"
# bar length is proportional to the share: 75% and 90% bars, same scale
w75=$(grep -F '>decode, 1 thread (wall, best token)<' -A1 "$OUT/r.svg" | sed -n 's/.*width="\([0-9.]*\)".*/\1/p')
w90=$(grep -F '>decode, 2 threads (wall, best token)<' -A1 "$OUT/r.svg" | sed -n 's/.*width="\([0-9.]*\)".*/\1/p')
$PY -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(abs(a / b - 0.75 / 0.90) > 0.01)" \
  "$w75" "$w90" && pass svg:proportional || fail svg:proportional "widths $w75 $w90"

# a section that failed is a row saying so, not a crash
$PY - "$FIX" "$OUT/failed.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
del r["raw"]["stream"]
r["errors"]["stream"] = "bin/bench_stream exited 1: disk gone"
r["settings"]["quick"] = True
json.dump(r, open(sys.argv[2], "w"))
EOF
expect_exit failed 0 $PY $R --render "$OUT/failed.json" --svg "$OUT/f.svg" --md "$OUT/f.md"
expect_out_contains failed "| streaming decode"
expect_out_contains failed "not measured: bin/bench_stream exited 1: disk gone"
expect_out_contains failed "QUICK RUN"
grep -q 'QUICK RUN' "$OUT/f.svg" && pass failed:svg_quick || fail failed:svg_quick

# bad inputs: one k3: line, exit 2
echo '{"raw": {"decode": {"decode": []}}}' >"$OUT/notreport.json"
expect_exit notreport 2 $PY $R --render "$OUT/notreport.json" --svg "$OUT/x.svg" --md "$OUT/x.md"
expect_err_contains notreport "not a bench report"
echo '{ nope' >"$OUT/badjson.json"
expect_exit badjson 2 $PY $R --render "$OUT/badjson.json"
expect_exit missing 2 $PY $R --render "$OUT/does-not-exist.json"
expect_exit only_bad 2 $PY $R --only decode,warp --cache "$OUT/cache"
expect_err_contains only_bad "unknown section 'warp'"

# the cheap sections for real, on the tiny peer checkpoint (needs `make bench`)
TINY=$(fixture peer/tiny-checkpoint)
if [ -x bin/bench_index ] && [ -d "$TINY" ]; then
  expect_exit live 0 $PY $R --only index,ttft --mid-dir "$TINY" --replica-dir "$TINY" --index-repeats 1 \
    --ttft-runs 1 --cache "$OUT/cache"
  expect_out_contains live "| index "
  expect_out_contains live "| time to first token"
  $PY -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(not (r["raw"]["index"]["tensors"] > 0
and r["raw"]["ttft"]["best_s"] > 0 and r["conditions"]["load_after"] is not None and len(r["rows"]) == 2))' \
    "$OUT/cache/report.json" && pass live:json || fail live:json
  [ -f "$OUT/cache/report.svg" ] && [ -f "$OUT/cache/report.md" ] && pass live:outputs || fail live:outputs
else
  skip live "bin/bench_index not built (make bench): the live run of the index and ttft sections"
fi
finish
