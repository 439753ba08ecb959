#!/usr/bin/env bash
# asan
# k3 export: a short tiny-config training run exported three ways; each
# exported directory loads in `k3 run` and generates; the f32 export's
# validation loss through the inference engine equals the training forward's;
# bad checkpoints, directories and flags give one-line errors.
. "$(dirname "$0")/lib.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# every build has these commands: one without them fails here, it does not pass on zero checks
for c in prepare train export; do
  if ! $K3 help $c >/dev/null 2>&1; then fail "command_$c" "this build has no 'k3 $c'"; finish; exit 1; fi
done
D=$OUT/data R=$OUT/run
rm -rf "$D" "$R" "$OUT"/ex-*
expect_exit prepare 0 $K3 prepare --input "$(fixture tinystories/train.txt)" --validation-input "$(fixture tinystories/valid.txt)" \
  --output-dir "$D" --vocab-size 1024
expect_exit train 0 $K3 train --data-dir "$D" --config configs/tiny-train.json --batch-size 2 --seq-len 32 \
  --gradient-accumulation 1 --quiet --output-dir "$R" --steps 8 --eval-interval 8 --eval-tokens 512 --skip-samples
CK=$R/latest.safetensors

# f32: the engine's validation loss equals the training forward's to rounding
expect_exit export_f32 0 $K3 export "$CK" "$OUT/ex-f32" --dtype f32 --experts f32 --eval-tokens 1024
change=$(sed -nE 's/.*; change ([-+0-9.eE]+).*/\1/p' "$OUT/export_f32.out")
awk -v c="$change" 'BEGIN { exit !(c != "" && c < 1e-4 && c > -1e-4) }' && pass f32_val_loss_unchanged \
  || fail f32_val_loss_unchanged "change '$change'"
# default: BF16 matrices, MXFP4 experts
expect_exit export_mxfp4 0 $K3 export "$CK" "$OUT/ex-mx" --eval-tokens 1024
expect_out_contains export_mxfp4 "routed experts mxfp4"
# the quantised exports' loss change, bounded at about twice what it measures
# on this 8-step checkpoint (printed to 5 decimals; deterministic): MXFP4
# experts -0.00003 (bound 7e-5), BF16 experts -0.00001 (bound 3e-5); the
# MXFP4 one must differ from the checkpoint at all (it is really quantised)
change_within() { # NAME BOUND NONZERO(0/1)
  local c; c=$(sed -nE 's/.*; change ([-+0-9.eE]+).*/\1/p' "$OUT/$1.out")
  if awk -v c="$c" -v b="$2" -v nz="$3" 'BEGIN { a = c < 0 ? -c : c; exit !(c != "" && a <= b && (!nz || a > 0)) }'; then
    pass "$1:loss_change"
  else
    fail "$1:loss_change" "change '$c', bound $2"
  fi
}
change_within export_mxfp4 7e-5 1
grep -q '"quantization_config"' "$OUT/ex-mx/config.json" && pass mxfp4_config || fail mxfp4_config
for f in config.json model.safetensors tiktoken.model tokenizer_config.json; do
  [ -s "$OUT/ex-mx/$f" ] && pass "wrote_$f" || fail "wrote_$f"
done
ls "$OUT/ex-mx" | grep -q tmp && fail no_temp_files || pass no_temp_files
expect_exit export_bf16 0 $K3 export "$CK" "$OUT/ex-bf16" --experts bf16 --eval-tokens 1024
change_within export_bf16 3e-5 0
expect_exit export_noeval 0 $K3 export "$CK" "$OUT/ex-noeval" --eval-tokens 0 --no-tokenizer
grep -q validation "$OUT/export_noeval.out" && fail noeval_no_validation || pass noeval_no_validation

# each loads in k3 run unchanged and generates (greedy; text and ids)
for e in f32 mx bf16; do
  expect_exit "run_$e" 0 $K3 run "$OUT/ex-$e" --prompt "Once upon a time" --gen 12 --quiet --out "$OUT/run_$e.json"
  tr -d ' \n' < "$OUT/run_$e.json" | grep -q '"generated_ids":\[[0-9]' && pass "generated_$e" || fail "generated_$e"
done
expect_exit run_ids 0 $K3 run "$OUT/ex-mx" --ids 5,6,7 --gen 4 --quiet

# errors
E=$OUT/err; rm -rf "$E"; mkdir -p "$E"
expect_exit missing_checkpoint 2 $K3 export "$E/nope.safetensors" "$E/o1"
printf 'garbage' > "$E/garbage.safetensors"
expect_exit garbage_checkpoint 4 $K3 export "$E/garbage.safetensors" "$E/o2"
head -c 5000 "$CK" > "$E/trunc.safetensors"
expect_exit truncated_checkpoint 4 $K3 export "$E/trunc.safetensors" "$E/o3"
expect_exit not_a_training_checkpoint 4 $K3 export "$OUT/ex-f32/model.safetensors" "$E/o4"
expect_err_contains not_a_training_checkpoint "not a k3 training checkpoint"
# the run directory instead of its checkpoint: named as such, not as a tensor found twice
expect_exit run_dir_given 2 $K3 export "$R" "$E/o6"
expect_err_contains run_dir_given "latest.safetensors"
mkdir -p "$E/nodata"
expect_exit no_tokenizer_in_data_dir 2 $K3 export "$CK" "$E/o5" --data-dir "$E/nodata"
expect_err_contains no_tokenizer_in_data_dir "tiktoken.model"
[ -e "$E/o5/config.json" ] && fail nothing_written || pass nothing_written
expect_exit no_tokenizer_flag 0 $K3 export "$CK" "$E/o6" --no-tokenizer
[ ! -e "$E/o6/tiktoken.model" ] && [ -s "$E/o6/config.json" ] && pass no_tokenizer_export || fail no_tokenizer_export
expect_exit bad_dtype 2 $K3 export "$CK" "$E/o7" --dtype fp8
expect_exit bad_experts 2 $K3 export "$CK" "$E/o7" --experts int4
expect_exit one_argument 2 $K3 export "$CK"
touch "$E/file"
mkdir -p "$E/stale" && touch "$E/stale/model-00001-of-00002.safetensors"
expect_exit stale_shard_in_out_dir 2 $K3 export "$CK" "$E/stale" --no-tokenizer
expect_err_contains stale_shard_in_out_dir "another model"
rm -rf "$E/new"
expect_exit nested_out_dir 0 $K3 export "$CK" "$E/new/a/b" --no-tokenizer --eval-tokens 0
[ -s "$E/new/a/b/model.safetensors" ] && pass nested_out_dir_written || fail nested_out_dir_written
expect_exit out_is_a_file 2 $K3 export "$CK" "$E/file" --no-tokenizer

# the shipped default model (docs/default-model.md): loads, decodes a few ids, fits the size cap
M=models/default
if [ -s "$M/config.json" ]; then
  expect_exit default_model_ids 0 $K3 run "$M" --ids 1,2,3 --gen 8 --quiet --out "$OUT/default.json"
  tr -d ' \n' < "$OUT/default.json" | grep -qE '"generated_ids":\[[0-9]+(,[0-9]+)*\]' && pass default_model_generates \
    || fail default_model_generates "$(head -c 300 "$OUT/default.json")"
  size=$(cat "$M"/* | wc -c)
  [ "$size" -le 25000000 ] && pass default_model_size || fail default_model_size "$size bytes"
else
  skip default_model "no $M"
fi
finish
