#!/usr/bin/env bash
# bench/layers.c at tiny dimensions (tests/fixtures/gen/k3_like, every block
# kind), so the per-layer benchmark keeps building and running: exit codes, the
# JSON's blocks, the weight bytes each block reads (worked out by hand from the
# config below, not by the bench), and bench/release_projection.py --layers
# reading that JSON. The timings themselves are not checked (machine and load).
. "$(dirname "$0")/lib.sh"
B=bin/bench_layers
PY=/usr/bin/python3
CFG=tests/fixtures/gen/k3_like/config.json
if ! [ -x "$B" ]; then
  fail built "$B missing (make $B; the test target builds it)"
  finish; exit $?
fi

expect_exit run 0 $B $CFG --contexts 1,16 --reps 2 --probe-mb 16 --json "$OUT/l.json"
expect_out_contains run "hidden 48, 9 layers (6 KDA, 3 MLA), vocab 128, 8 experts top-2 (MXFP4)"
expect_exit usage 2 $B $CFG --reps 0
expect_exit noconfig 2 $B "$OUT/absent.json"
expect_exit badctx 2 $B $CFG --contexts 1,,2

if ! [ -x "$PY" ]; then
  skip json "$PY missing: the JSON is not checked"
  finish; exit $?
fi
# k3_like: E 48, KDA H 3 x D 16 (P 48), MLA 3 heads (d_n 24, d_r 8, d_v 16,
# r_q 32, r_kv 16, gated), dense I 96, MoE 8 experts top-2 (latent 64, I 32,
# 2 shared: width 64), vocab 128; BF16 = 2 bytes, an MXFP4 [r][c] matrix is
# r*c/2 + r*c/32 bytes.
#   kda: q,k,v,g 4*48*48*2 + f_a 16*48*2 + f_b 48*16*2 + b 3*48*2 + o 48*48*2 = 26400
#   mla: q_a 32*48*2 + q_b 96*32*2 + kv_a 24*48*2 + kv_b 120*16*2 + o 48*48*2 + g 48*48*2 = 24576;
#        state at context 16: 16 rows of 24 floats = 1536
#   dense_mlp: 3*96*48*2 = 27648
#   moe: router 8*48*2 + down 64*48*2 + up 48*64*2 + shared 3*64*48*2 + 2 experts x 3 x (1024 + 64) = 38016
#   head: 128*48*2 = 12288
got=$($PY - "$OUT/l.json" <<'PYEOF'
import json, math, sys
j = json.load(open(sys.argv[1]))
b = {x["block"]: x for x in j["blocks"]}
ok = all(x["best_s"] > 0 and x["median_s"] >= x["best_s"] and math.isfinite(x["gbs"]) for x in j["blocks"])
print(" ".join("%s:%d" % (n, b[n]["weight_bytes"]) for n in ("kda", "mla@1", "mla@16", "dense_mlp", "moe", "head")),
      b["mla@16"]["state_bytes"], b["mla@16"]["context"], j["layers"]["dense"], j["layers"]["moe"], ok)
PYEOF
)
check bytes "$got" "kda:26400 mla@1:24576 mla@16:24576 dense_mlp:27648 moe:38016 head:12288 1536 16 1 8 True"

expect_exit projection 0 $PY bench/release_projection.py --layers "$OUT/l.json" --context 16 --validate
expect_out_contains projection "| mla@16 |"
expect_out_contains projection "the per-layer figures at context 16 (best wall)"
expect_exit projcpu 0 $PY bench/release_projection.py --layers "$OUT/l.json" --cpu-time --validate
expect_out_contains projcpu "the per-layer figures at context 1 (CPU time / threads)"
"$PY" bench/release_projection.py --cpu-time >"$OUT/nolayers.out" 2>&1
rc=$?
check nolayers "$rc" 2
"$PY" bench/release_projection.py --layers "$OUT/l.json" --context 5 >"$OUT/ctx.out" 2>&1
rc=$?
check badcontext "$rc" 2
echo '{"blocks": []}' >"$OUT/bad.json"
"$PY" bench/release_projection.py --layers "$OUT/bad.json" >"$OUT/bad.out" 2>&1
rc=$?
check notreport "$rc:$(grep -c 'not a bench_layers report' "$OUT/bad.out")" "1:1"
finish
