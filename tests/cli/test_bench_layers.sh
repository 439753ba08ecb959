#!/usr/bin/env bash
# bench/layers.c at tiny dimensions (tests/fixtures/gen/k3_like, every block
# kind), so the per-layer benchmark keeps building and running: exit codes, the
# JSON's blocks, the weight bytes each block reads (worked out by hand from the
# config below, not by the bench), the MoE block with its experts read from a
# file under --tmp by the streaming source (the bench itself exits 1 unless
# its output has the resident block's bits; here: the experts and bytes read,
# O_DIRECT and buffered, MXFP4 and BF16 experts, the file cleaned up), and
# bench/release_projection.py --layers reading that JSON. The timings
# themselves are not checked (machine and load).
. "$(dirname "$0")/lib.sh"
B=bin/bench_layers
PY=/usr/bin/python3
CFG=tests/fixtures/gen/k3_like/config.json
if ! [ -x "$B" ]; then
  fail built "$B missing (make $B; the test target builds it)"
  finish; exit $?
fi

rm -rf "$OUT/tmp" && mkdir -p "$OUT/tmp"
expect_exit run 0 $B $CFG --contexts 1,16 --reps 2 --probe-mb 16 --tmp "$OUT/tmp" --json "$OUT/l.json"
expect_out_contains run "hidden 48, 9 layers (6 KDA, 3 MLA), vocab 128, 8 experts top-2 (MXFP4)"
expect_out_contains run "2 experts of 3264 B read a call"
check cleanup "$(ls -A "$OUT/tmp")" ""
# O_DIRECT off: buffered reads, the file's pages dropped before each call
K3_DIRECT_IO=0 expect_exit buffered 0 $B $CFG --contexts 1 --reps 2 --probe-mb 16 --tmp "$OUT/tmp" --json "$OUT/b.json"
expect_out_contains buffered "(buffered) from $OUT/tmp"
expect_out_contains buffered "(2 MiB pieces, 4 in flight, buffered)"
# unquantised (BF16) experts: w1, w3, w2 of [32][32] = 6144 bytes each
expect_exit bf16 0 $B tests/fixtures/gen/dense_experts/config.json --contexts 1 --reps 2 --probe-mb 16 --tmp "$OUT/tmp"
expect_out_contains bf16 "3 experts of 6144 B read a call"
expect_exit nodisk 0 $B $CFG --contexts 1 --reps 1 --probe-mb 16 --no-disk
if grep -q '^moe_disk' "$OUT/nodisk.out"; then fail nodisk:row "a moe_disk row with --no-disk"; else pass nodisk:row; fi
expect_exit badtmp 2 $B $CFG --contexts 1 --reps 1 --probe-mb 16 --tmp "$OUT/absent-dir"
expect_err_contains badtmp "--tmp $OUT/absent-dir"
check cleanup2 "$(ls -A "$OUT/tmp")" ""
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
#   moe_disk: the moe block's bytes; its 2 experts of w1, w3 [32][64] and w2
#        [64][32]: 3 x (1024 + 64) = 3264 bytes each, read a call: 6528 bytes
#        and at most a 4 KiB block more at each end of each (O_DIRECT)
got=$($PY - "$OUT/l.json" <<'PYEOF'
import json, math, sys
j = json.load(open(sys.argv[1]))
b = {x["block"]: x for x in j["blocks"]}
ok = all(x["best_s"] > 0 and x["median_s"] >= x["best_s"] and math.isfinite(x["gbs"]) for x in j["blocks"])
d = b["moe_disk"]
print(" ".join("%s:%d" % (n, b[n]["weight_bytes"]) for n in ("kda", "mla@1", "mla@16", "dense_mlp", "moe", "moe_disk", "head")),
      b["mla@16"]["state_bytes"], b["mla@16"]["context"], j["layers"]["dense"], j["layers"]["moe"], ok,
      d["experts_read"], d["expert_bytes"], 6528 <= d["read_bytes"] <= 6528 + 2 * 2 * 4096,
      d["backend"] in ("io_uring", "pread"), d["read_mbs"] > 0, d["disk_probe_gbs"] > 0)
PYEOF
)
check bytes "$got" "kda:26400 mla@1:24576 mla@16:24576 dense_mlp:27648 moe:38016 moe_disk:38016 head:12288 1536 16 1 8 True 2 3264 True True True True"
got=$($PY -c 'import json, sys; d = [b for b in json.load(open(sys.argv[1]))["blocks"] if b["block"] == "moe_disk"][0]; print(d["direct"], 6528 <= d["read_bytes"] <= 6528 + 4 * 4096)' "$OUT/b.json")
check buffered:json "$got" "False True"

expect_exit projection 0 $PY bench/release_projection.py --layers "$OUT/l.json" --context 16 --validate
expect_out_contains projection "| mla@16 |"
expect_out_contains projection "the per-layer figures at context 16 (best wall)"
expect_exit projfull 0 $PY bench/release_projection.py --layers "$OUT/l.json" --context 16
expect_out_contains projfull "| moe_disk | "
expect_out_contains projfull "| this machine, its disk (trunk at "
expect_out_contains projfull "| s/token / tau 1.07 (speculation) |"
"$PY" bench/release_projection.py --layers "$OUT/l.json" --tau 0.5 >"$OUT/tau.out" 2>&1
rc=$?
check badtau "$rc" 2
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

# bench/mpi_projection.py --layers: the per-core rates from bench_layers reports,
# worked by hand on two made-up reports: per block the smaller CPU time; BF16 =
# 4 GB of kda, mla@1, dense_mlp and head over 0.4 s = 10 GB/s; the MoE block's
# 2 GB in 0.3 s hold 16 x 62.5 MB = 1 GB of experts, its other 1 GB costs 0.1 s
# at 10 GB/s, so MXFP4 = 1 GB / 0.2 s = 5 GB/s.
if "$PY" -c 'import numpy' 2>/dev/null; then
  "$PY" - "$OUT" <<'PY'
import json, sys
def rep(slow):
    b = [dict(block=n, weight_bytes=int(1e9), cpu_s=0.1 * slow) for n in ("kda", "mla@1", "dense_mlp", "head")]
    b.append(dict(block="moe", weight_bytes=int(2e9), cpu_s=0.3 * slow))
    b.append(dict(block="moe_disk", weight_bytes=int(2e9), cpu_s=1.0, experts_read=16, expert_bytes=62500000))
    return {"blocks": b}
json.dump(rep(1.0), open(sys.argv[1] + "/m1.json", "w"))
json.dump(rep(1.5), open(sys.argv[1] + "/m2.json", "w"))
PY
  got=$("$PY" bench/mpi_projection.py --layers "$OUT/m2.json" "$OUT/m1.json" --ranks 32 --json 2>&1 |
        "$PY" -c 'import json, sys; d = json.load(sys.stdin); a = d["args"]; r = d["rows"][0]
print(round(a["bf16_core"], 6), round(a["mxfp4_core"], 6), r["ranks"], r["split_tokens_per_s"] > 0)')
  check mpi-rates "$got" "10.0 5.0 32 True"
  "$PY" bench/mpi_projection.py --layers "$OUT/bad.json" >"$OUT/mbad.out" 2>&1
  rc=$?
  check mpi-notreport "$rc:$(grep -c 'lack one of' "$OUT/mbad.out")" "1:1"
else
  skip mpi-rates "python3 with numpy missing (scripts/setup.sh --test)"
fi
finish
