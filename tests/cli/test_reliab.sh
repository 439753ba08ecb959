#!/usr/bin/env bash
# asan
# Hostile-user cases: output paths that are not regular files, full devices,
# corrupted indexes and checkpoints, out-of-range config integers, stale temp
# files. Each must end in one error line and its exit code, never wrong output.
. "$(dirname "$0")/lib.sh"
M=tests/fixtures/gen/k3_like
type skip >/dev/null 2>&1 || skip() { echo "SKIP $1: $2"; }

# ---- output paths ---------------------------------------------------------------
expect_exit out-empty 2 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out ''
expect_exit dump-empty 2 $K3 run $M --ids 1,2,3 --gen 2 --quiet --dump-logits ''
expect_exit out-nodir 2 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/no/such/dir/x.json"
expect_exit out-isdir 2 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT"
expect_err_contains out-isdir "--out"
# a FIFO stays a FIFO and the reader gets the report
rm -f "$OUT/fifo" "$OUT/fifo.got"; mkfifo "$OUT/fifo"
timeout 60 cat "$OUT/fifo" >"$OUT/fifo.got" & reader=$!
expect_exit out-fifo 0 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/fifo"
[ -p "$OUT/fifo" ] && pass out-fifo:still-fifo || { fail out-fifo:still-fifo "replaced by a regular file"; kill $reader 2>/dev/null; }
wait $reader
grep -q '"generated_ids"' "$OUT/fifo.got" && pass out-fifo:content || fail out-fifo:content "reader got $(head -c 100 "$OUT/fifo.got")"
# a symlink to a regular file: the target is replaced, the link stays
echo old >"$OUT/target.json"; ln -sf target.json "$OUT/link.json"
expect_exit out-symlink 0 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/link.json"
[ -L "$OUT/link.json" ] && grep -q generated_ids "$OUT/target.json" && pass out-symlink:kept || fail out-symlink:kept
# a device is written in place; a full one is an error. The devices are our
# own nodes in $OUT: a build without the fix would replace /dev/null itself.
rm -f "$OUT/null" "$OUT/full"
if mknod -m 666 "$OUT/null" c 1 3 2>/dev/null && mknod -m 666 "$OUT/full" c 1 7 2>/dev/null &&
   echo x >"$OUT/null" 2>/dev/null; then
  expect_exit out-devnull 0 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/null" --dump-logits "$OUT/null"
  [ -c "$OUT/null" ] && pass out-devnull:still-device || fail out-devnull:still-device
  expect_exit out-devfull 1 $K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/full"
  expect_exit dump-devfull 1 $K3 run $M --ids 1,2,3 --gen 2 --quiet --dump-logits "$OUT/full"
  [ -c "$OUT/full" ] && pass out-devfull:still-device || fail out-devfull:still-device
else
  skip out-devices "cannot make device nodes here (not root, or a nodev mount)"
fi
# a link to the standard output (as /dev/stdout is) writes into the pipe
ln -sfn /proc/self/fd/1 "$OUT/stdout-link"
$K3 run $M --ids 1,2,3 --gen 2 --quiet --out "$OUT/stdout-link" | cat >"$OUT/piped.json"
[ -L "$OUT/stdout-link" ] && grep -q generated_ids "$OUT/piped.json" && pass out-stdout-link || fail out-stdout-link

# ---- packed trunk index ---------------------------------------------------------------
T=$OUT/trunk; rm -rf "$T"
expect_exit trunk-pack 0 $K3 pack-trunk $M "$T"
expect_exit trunk-run 0 $K3 run $M --ids 1,2,3 --gen 4 --quiet --trunk "$T" --out "$OUT/trunk-good.json"
cp "$T/trunk.json" "$OUT/trunk.json.good"
# trunk_edit NAME PERL-EXPR: the run refuses an index edited by PERL-EXPR (exit 4)
trunk_edit() {
  perl -0pe "$2" "$OUT/trunk.json.good" >"$T/trunk.json"
  if cmp -s "$T/trunk.json" "$OUT/trunk.json.good"; then fail "$1" "the edit changed nothing"; return; fi
  expect_exit "$1" 4 $K3 run $M --ids 1,2,3 --gen 4 --quiet --trunk "$T"
}
# the first two model-level tensors have the same dtype and size: swap their offsets
trunk_edit trunk-swap-offsets 's/("offset": )0(,\s*"bytes": 96\s*\},\s*\{[^}]*?"offset": )128/${1}128${2}0/'
trunk_edit trunk-dtype 's/"dtype": "BF16"/"dtype": "F16"/'
trunk_edit trunk-name 's/model\.norm\.weight/model.nxrm.weight/'
trunk_edit trunk-no-checksum 's/,\s*"table_crc32c": "[0-9a-f]+"//'
cp "$OUT/trunk.json.good" "$T/trunk.json"

# ---- config integers ------------------------------------------------------------------
# cfg_set SRC KEY VALUE DEST: SRC with KEY's integer replaced
cfg_set() { sed -E "s/\"$2\": [0-9]+/\"$2\": $3/" "$1" >"$4"; cmp -s "$1" "$4" && echo "cfg_set: $2 not in $1" >&2; }
C=$OUT/cfg; rm -rf "$C"; mkdir -p "$C/m"
for f in $M/*.safetensors $M/model.safetensors.index.json; do ln -sf "$PWD/$f" "$C/m/"; done
for kv in attn_res_block_size:2147483647 vocab_size:2147483648 hidden_size:4294967297 num_shared_experts:1073741824 \
          v_head_dim:2147483647 qk_nope_head_dim:2147483647; do
  k=${kv%%:*}; v=${kv#*:}
  cfg_set $M/config.json "$k" "$v" "$C/m/config.json"
  expect_exit "cfg-run-$k" 2 $K3 run "$C/m" --ids 1,2 --gen 2 --quiet
  expect_err_contains "cfg-run-$k" "too large"
  cfg_set configs/tiny-train.json "$k" "$v" "$C/t.json"
  expect_exit "cfg-inventory-$k" 2 $K3 train --config "$C/t.json" --inventory
  expect_err_contains "cfg-inventory-$k" "too large"
done
# within the per-key bound, but a derived size is not
cfg_set configs/tiny-train.json num_shared_experts 16777215 "$C/t.json"
expect_exit cfg-derived-shared 2 $K3 train --config "$C/t.json" --inventory
expect_err_contains cfg-derived-shared "num_shared_experts x moe_intermediate_size"
cfg_set configs/tiny-train.json v_head_dim 16000000 "$C/t.json"
expect_exit cfg-derived-v 2 $K3 train --config "$C/t.json" --inventory

# ---- tokenizer_config.json that is not an object ----------------------------------
TK=$OUT/tok; rm -rf "$TK"; mkdir -p "$TK"
ln -sf "$(cd "$(fixture tokenizer/kimi)" && pwd)/tiktoken.model" "$TK/tiktoken.model"
for j in '[1,2,3]' '[]' '[{"added_tokens_decoder":{}}]'; do
  printf '%s' "$j" >"$TK/tokenizer_config.json"
  expect_exit "tokcfg-$j" 2 $K3 tokenize "$TK" --text "hello"
  expect_err_contains "tokcfg-$j" "not a JSON object"
done
printf '42' >"$TK/tokenizer_config.json"
expect_exit tokcfg-scalar 2 $K3 tokenize "$TK" --text "hello"
printf '{}' >"$TK/tokenizer_config.json"
expect_exit tokcfg-empty-object 0 $K3 tokenize "$TK" --text "hello"

# ---- a shard truncated while mapped --------------------------------------------------
# The prompt comes from a FIFO, read after the shards are mapped: opening the
# FIFO for writing returns once k3 is there, the shards are truncated, and the
# prompt then lets the forward pass touch the vanished pages.
B=$OUT/bus; rm -rf "$B"; mkdir -p "$B"; cp $M/* "$B/"; mkfifo "$B/prompt"
$K3 run "$B" --tok "$TK" --prompt-file "$B/prompt" --gen 3 --quiet >"$OUT/bus.out" 2>"$OUT/bus.err" &
bus_pid=$!
exec 3>"$B/prompt"
for f in "$B"/model-*.safetensors; do truncate -s 8192 "$f"; done
printf 'Q' >&3
exec 3>&-
wait $bus_pid; bus_rc=$?
if [ "$bus_rc" -eq 4 ] && [ "$(grep -c '' "$OUT/bus.err")" -eq 1 ] && grep -q '^k3: .*model-0000.*safetensors: .*shrank' "$OUT/bus.err"; then
  pass shard-truncated-while-mapped
else
  fail shard-truncated-while-mapped "exit $bus_rc: $(head -c 300 "$OUT/bus.err")"
fi

# ---- --layers, memory refusal units, k3 doctor ------------------------------------------
expect_exit layers-too-many 2 $K3 run $M --ids 1,2 --gen 2 --quiet --layers 10
expect_err_contains layers-too-many "has only 9 layers"
expect_exit layers-all 0 $K3 run $M --ids 1,2 --gen 2 --quiet --layers 9
expect_exit budget-tiny 3 $K3 run $M --ids 1,2 --gen 2 --quiet --max-memory 1K
if grep -q '0\.000' "$OUT/budget-tiny.err"; then fail budget-tiny:units "$(cat "$OUT/budget-tiny.err")"; else pass budget-tiny:units; fi
expect_err_contains budget-tiny "kB"
if $K3 doctor >/dev/null 2>&1 && K3_ISA=avx2 $K3 doctor >/dev/null 2>&1; then
  K3_ISA=avx2 expect_exit doctor-avx2 0 $K3 doctor
  expect_out_contains doctor-avx2 "F32 on AVX2+FMA tiles"
  grep -q "scalar path" "$OUT/doctor-avx2.out" && fail doctor-avx2:no-scalar-claim || pass doctor-avx2:no-scalar-claim
else
  skip doctor-avx2 "this CPU has no AVX2"
fi
K3_ISA=scalar expect_exit doctor-scalar 0 $K3 doctor
expect_out_contains doctor-scalar "F32 on the scalar reference"

# ---- standard output full -----------------------------------------------------------
# full_exit NAME CODE CMD...: like expect_exit, with stdout on /dev/full
full_exit() {
  local name=$1 code=$2; shift 2
  "$@" >/dev/full 2>"$OUT/$name.err"
  local rc=$?
  if [ "$rc" -ne "$code" ]; then fail "$name" "exit $rc, wanted $code: $(head -c 200 "$OUT/$name.err")"; return; fi
  # k3 run's report precedes the error on stderr: the error is the last line
  if { [ -z "$REPORT_OK" ] && [ "$(grep -c '' "$OUT/$name.err")" -ne 1 ]; } || ! tail -n 1 "$OUT/$name.err" | grep -q '^k3: standard output'; then
    fail "$name" "not one error line: $(head -c 300 "$OUT/$name.err")"; return
  fi
  pass "$name"
}
REPORT_OK=1 full_exit stdout-run 1 $K3 run $M --ids 1,2,3 --gen 4
full_exit stdout-inspect 1 $K3 inspect $M
full_exit stdout-inspect-json 1 $K3 inspect $M --json
full_exit stdout-help 1 $K3 --help
full_exit stdout-run-help 1 $K3 run --help
full_exit stdout-version 1 $K3 --version
full_exit stdout-cache-sim 1 $K3 cache-sim --help
finish
