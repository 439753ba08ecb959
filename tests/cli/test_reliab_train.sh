#!/usr/bin/env bash
# asan
# Training-side hostile cases: a flipped bit in a checkpoint, non-finite
# weights, stale temp files and sample folders left by kill -9, disk full
# while writing. Each ends in one error line and its exit code.
. "$(dirname "$0")/lib.sh"
type skip >/dev/null 2>&1 || skip() { echo "SKIP $1: $2"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
D=$OUT/data
rm -rf "$D" "$OUT/tmp"; mkdir -p "$OUT/tmp"
head -c 300000 "$(fixture tinystories/train.txt)" >"$OUT/train.txt"
expect_exit prepare 0 $K3 prepare --input "$OUT/train.txt" --validation-input "$(fixture tinystories/valid.txt)" \
  --output-dir "$D" --vocab-size 1024
CFG=configs/tiny-train.json
COMMON="--data-dir $D --config $CFG --batch-size 2 --seq-len 32 --gradient-accumulation 1 --quiet"
COMMON="$COMMON --eval-interval 2 --eval-tokens 512 --sample-interval 2 --sample-tokens 4"

# leftovers of a killed run (dead PIDs) are removed by the next run
R=$OUT/run; rm -rf "$R"; mkdir -p "$R"
DEAD=2147483646
for f in latest.safetensors state.json best.safetensors; do echo junk >"$R/$f.tmp.$DEAD"; done
echo mine >"$R/state.json.tmp.$$"   # a live process's temp file stays
mkdir -p "$OUT/tmp/k3-sample-$DEAD-abcdef" "$OUT/tmp/k3-sample-$$-ghijkl"
echo x >"$OUT/tmp/k3-sample-$DEAD-abcdef/config.json"
TMPDIR=$OUT/tmp expect_exit train 0 $K3 train $COMMON --output-dir "$R" --steps 4
left=$(ls "$R" | grep "\.tmp\.$DEAD" | tr '\n' ' ')
[ -z "$left" ] && pass stale-temps-removed || fail stale-temps-removed "left: $left"
[ -e "$R/state.json.tmp.$$" ] && pass live-temp-kept || fail live-temp-kept
[ ! -e "$OUT/tmp/k3-sample-$DEAD-abcdef" ] && pass stale-sample-removed || fail stale-sample-removed
[ -d "$OUT/tmp/k3-sample-$$-ghijkl" ] && pass live-sample-kept || fail live-sample-kept
rm -f "$R/state.json.tmp.$$"
cp "$R/latest.safetensors" "$OUT/ck4.safetensors"; CK=$OUT/ck4.safetensors
grep -aq '"payload_crc32c"' "$CK" && pass ckpt-has-checksum || fail ckpt-has-checksum

# the data section starts after the 8-byte length and the header
hlen=$(od -An -tu8 -N8 "$CK" | tr -d ' ')
# put4 FILE BYTE_OFFSET: overwrite 4 bytes with 0x01020304 (a change of a weight or moment)
put4() { printf '\001\002\003\004' | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }
cp "$CK" "$OUT/flip-w.safetensors"; put4 "$OUT/flip-w.safetensors" $((8 + hlen + 400))
expect_exit flip-weight-resume 4 $K3 train --data-dir "$D" --output-dir "$OUT/r2" --steps 6 --resume "$OUT/flip-w.safetensors" --quiet
expect_err_contains flip-weight-resume "checksum"
expect_exit flip-weight-export 4 $K3 export "$OUT/flip-w.safetensors" "$OUT/e1" --no-tokenizer
size=$(stat -c %s "$CK")
cp "$CK" "$OUT/flip-m.safetensors"; put4 "$OUT/flip-m.safetensors" $((size - 64))   # the last moment tensor
expect_exit flip-moment-resume 4 $K3 train --data-dir "$D" --output-dir "$OUT/r3" --steps 6 --resume "$OUT/flip-m.safetensors" --quiet
expect_err_contains flip-moment-resume "checksum"
expect_exit good-resume 0 $K3 train --data-dir "$D" --output-dir "$R" --steps 6 --resume "$R/latest.safetensors" --quiet

# a version 1 checkpoint (no checksum): read, with a note; a NaN weight in it
# is refused by export exactly as by resume
LC_ALL=C sed 's/"version":"2"/"version":"1"/; s/"payload_crc32c"/"payload_crc32_"/' "$CK" >"$OUT/v1.safetensors"
expect_exit v1-export 0 $K3 export "$OUT/v1.safetensors" "$OUT/e2" --no-tokenizer
expect_err_contains v1-export "not verified"
cp "$OUT/v1.safetensors" "$OUT/v1nan.safetensors"
printf '\000\000\300\177' | dd of="$OUT/v1nan.safetensors" bs=1 seek=$((8 + hlen + 8)) conv=notrunc status=none
expect_exit nan-resume 4 $K3 train --data-dir "$D" --output-dir "$OUT/r4" --steps 6 --resume "$OUT/v1nan.safetensors" --quiet
expect_err_contains nan-resume "not finite"
expect_exit nan-export 4 $K3 export "$OUT/v1nan.safetensors" "$OUT/e3" --no-tokenizer
expect_err_contains nan-export "not finite"

# a model whose weights are all NaN: k3 run stops with one line, never token 0
N=$OUT/nanmodel; rm -rf "$N"; mkdir -p "$N"
expect_exit export-f32 0 $K3 export "$CK" "$OUT/e4" --no-tokenizer --dtype f32 --experts f32
cp "$OUT/e4/config.json" "$N/"
mh=$(od -An -tu8 -N8 "$OUT/e4/model.safetensors" | tr -d ' ')
msize=$(stat -c %s "$OUT/e4/model.safetensors")
{ head -c $((8 + mh)) "$OUT/e4/model.safetensors"; head -c $((msize - 8 - mh)) /dev/zero | tr '\0' '\377'; } >"$N/model.safetensors"
expect_exit nan-run 4 $K3 run "$N" --ids 1,2,3 --gen 4 --quiet
expect_err_contains nan-run "not finite"

# ---- disk full while writing: the previous file stays, one error line --------
# RLIMIT_FSIZE with SIGXFSZ ignored makes every write past the limit fail with
# EFBIG, as a full disk fails with ENOSPC: no root, tmpfs or loop device needed.
# full_run NAME LIMIT_KB CMD...: runs CMD under the limit; exit 1, one line
full_run() {
  local name=$1 kb=$2; shift 2
  ( trap '' XFSZ; ulimit -f "$kb"; exec "$@" ) >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  if [ "$rc" -ne 1 ]; then fail "$name" "exit $rc, wanted 1: $(head -c 300 "$OUT/$name.err")"; return 1; fi
  if [ "$(grep -c '' "$OUT/$name.err")" -ne 1 ] || ! grep -q '^k3: ' "$OUT/$name.err"; then
    fail "$name" "not one error line: $(head -c 300 "$OUT/$name.err")"; return 1
  fi
  pass "$name"
}
# a checkpoint
F=$OUT/full; rm -rf "$F"; mkdir -p "$F"
cp -r "$R" "$F/run"; cp "$F/run/latest.safetensors" "$F/latest.before"
full_run full-checkpoint 64 $K3 train --data-dir "$D" --output-dir "$F/run" --steps 8 --resume "$F/run/latest.safetensors" --quiet
cmp -s "$F/run/latest.safetensors" "$F/latest.before" && pass full-checkpoint:previous-intact || fail full-checkpoint:previous-intact
ls "$F/run" | grep -q '\.tmp\.' && fail full-checkpoint:no-temp "$(ls "$F/run")" || pass full-checkpoint:no-temp
# an export
expect_exit full-export-first 0 $K3 export "$CK" "$F/exp" --no-tokenizer
cp "$F/exp/model.safetensors" "$F/exp.before"
full_run full-export 16 $K3 export "$CK" "$F/exp" --no-tokenizer --dtype f32 --experts f32
cmp -s "$F/exp/model.safetensors" "$F/exp.before" && pass full-export:previous-intact || fail full-export:previous-intact
# a packed trunk
expect_exit full-trunk-first 0 $K3 pack-trunk "$F/exp" "$F/trunk"
cp "$F/trunk/trunk.bin" "$F/trunk.bin.before"; cp "$F/trunk/trunk.json" "$F/trunk.json.before"
full_run full-trunk 16 $K3 pack-trunk "$OUT/e4" "$F/trunk"
cmp -s "$F/trunk/trunk.bin" "$F/trunk.bin.before" && cmp -s "$F/trunk/trunk.json" "$F/trunk.json.before" \
  && pass full-trunk:previous-intact || fail full-trunk:previous-intact
# a prepared shard
cp -r "$D" "$F/data"; ls -l "$F/data" >"$F/data.before"; md5sum "$F/data"/* >"$F/data.sums" 2>/dev/null
full_run full-prepare 64 $K3 prepare --input "$(fixture tinystories/train.txt)" --validation-input "$(fixture tinystories/valid.txt)" \
  --output-dir "$F/data" --vocab-size 1024
md5sum -c --quiet "$F/data.sums" >/dev/null 2>&1 && pass full-prepare:previous-intact || fail full-prepare:previous-intact
ls "$F/data" | grep -q '\.tmp\.' && fail full-prepare:no-temp "$(ls "$F/data")" || pass full-prepare:no-temp

finish
