#!/usr/bin/env bash
# The release's full-width head and embedding (163,840 x 7,168 BF16, 2.35 GB
# each) read past 2^31 bytes: the sparse replica of the release (built here by
# tools/make_sparse_replica.py, holes for data) gets real embedding rows for
# the prompt, a final-norm gain and real head rows on both sides of byte 2^31
# (tests/cli/release_rows.py, plain python3); every other weight stays zero.
# `k3 run --layers 1` must give, for the last prompt token, each written row's
# logit within fp32 rounding of the float64 value computed by release_rows.py
# and exactly 0 for the 163,835 hole rows: resident at 2 threads (rows mapped
# from the shard) and from a packed trunk at 1 thread (the 4.7 GB run 0 read
# through io_uring), the same logits bits both ways. Release build only: ~2-3
# minutes, mostly page faults on the holes.
. "$(dirname "$0")/lib.sh"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
PY=/usr/bin/python3
R=$OUT/replica
IDS=5,163839,150000
ROWS=0,7,149796,149797,150000,163839
rm -rf "$R" "$OUT/trunk"
if ! $PY tools/make_sparse_replica.py "$R" >"$OUT/replica.log" 2>&1; then
  fail replica "$(tail -n 3 "$OUT/replica.log")"; finish; exit $?
fi
$PY tests/cli/release_rows.py write "$R" $IDS $ROWS && pass rows:written || fail rows:written
expect_exit resident 0 $K3 run "$R" --layers 1 --threads 2 --ids $IDS --gen 1 --quiet --out "$OUT/resident.json" --dump-logits "$OUT/resident.bin"
$PY tests/cli/release_rows.py check "$R" $IDS $ROWS "$OUT/resident.bin" >"$OUT/resident.check" 2>&1 &&
  pass "resident:reference $(tail -n 1 "$OUT/resident.check")" || fail resident:reference "$(cat "$OUT/resident.check")"
expect_exit pack 0 $K3 pack-trunk "$R" "$OUT/trunk"
alloc=$(du -k "$OUT/trunk/trunk.bin" | cut -f1)
[ "$alloc" -lt 65536 ] && pass "pack:sparse=${alloc}kB" || fail pack:sparse "trunk.bin holds $alloc kB on disk"
expect_exit trunk 0 $K3 run "$R" --trunk "$OUT/trunk" --preset laptop --layers 1 --threads 1 --ids $IDS --gen 1 --quiet --out "$OUT/trunk.json" --dump-logits "$OUT/trunk.bin"
$PY tests/cli/release_rows.py check "$R" $IDS $ROWS "$OUT/trunk.bin" >"$OUT/trunk.check" 2>&1 &&
  pass "trunk:reference" || fail trunk:reference "$(cat "$OUT/trunk.check")"
cmp -s "$OUT/resident.bin" "$OUT/trunk.bin" && pass same-bits || fail same-bits "resident and trunk logits differ"
rm -rf "$R" "$OUT/trunk" "$OUT"/*.bin
finish
