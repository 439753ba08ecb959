#!/usr/bin/env bash
# asan
# k3 prepare: a small tokenizer on the TinyStories validation stories, the
# files and statistics it writes, determinism across thread counts, reuse of a
# tokenizer, the three input formats, and the one-line errors.
. "$(dirname "$0")/lib.sh"
VALID=$(fixture tinystories/valid.txt)

# json_num FILE SPLIT KEY: a number from stats.json ("train"/"validation" block
# or "" for the top level), found by its key (keys are unique per block).
json_num() {
  if [ -z "$2" ]; then grep -m1 "\"$3\":" "$1" | sed -E 's/.*: *([0-9.eE+-]+).*/\1/'
  else sed -n "/\"$2\": {/,/}/p" "$1" | grep -m1 "\"$3\":" | sed -E 's/.*: *([0-9.eE+-]+).*/\1/'; fi
}

D=$OUT/ts
rm -rf "$D" "$OUT/ts1" "$OUT/reuse"
expect_exit prepare_valid 0 $K3 prepare --input "$VALID" --output-dir "$D" --vocab-size 1024 \
  --validation-stories 100 --tokenizer-stories 600
for f in tiktoken.model tokenizer_config.json train.bin val.bin stats.json; do
  if [ -s "$D/$f" ]; then pass "wrote_$f"; else fail "wrote_$f"; fi
done
expect_out_contains prepare_valid "bytes/token"
# 1,000 stories in valid.txt (its SOURCE.md): 900 train + 100 validation
[ "$(json_num "$D/stats.json" train stories)" = 900 ] && pass stats_train_stories || fail stats_train_stories
[ "$(json_num "$D/stats.json" validation stories)" = 100 ] && pass stats_val_stories || fail stats_val_stories
[ "$(json_num "$D/stats.json" "" vocab_size)" = 1024 ] && pass stats_vocab || fail stats_vocab
[ "$(json_num "$D/stats.json" "" tokenizer_stories)" = 600 ] && pass stats_tok_stories || fail stats_tok_stories
# 1023 BPE ranks (1024 - 1 special id), <|endoftext|> right after them
[ "$(wc -l <"$D/tiktoken.model")" = 1023 ] && pass ranks_1023 || fail ranks_1023
grep -q '"1023"' "$D/tokenizer_config.json" && pass eot_id_1023 || fail eot_id_1023
grep -q '"num_reserved_special_tokens": 1' "$D/tokenizer_config.json" && pass reserved_1 || fail reserved_1
# the story bytes add up: 803,233 file bytes minus, per story, the newline
# ending its last line and the 14-byte line "<|endoftext|>\n"
tb=$(json_num "$D/stats.json" train bytes); vb=$(json_num "$D/stats.json" validation bytes)
[ $((tb + vb)) = $((803233 - 15000)) ] && pass stats_bytes || fail stats_bytes "$tb + $vb"
# a 1k vocabulary compresses TinyStories to roughly 2.5-3.5 bytes per token
bpt=$(json_num "$D/stats.json" train bytes_per_token)
awk -v b="$bpt" 'BEGIN { exit !(b > 2.5 && b < 3.5) }' && pass bytes_per_token || fail bytes_per_token "$bpt"
# shard sizes: 64-byte header + 2 bytes per token
tt=$(json_num "$D/stats.json" train tokens)
[ "$(stat -c %s "$D/train.bin")" = $((64 + 2 * tt)) ] && pass train_shard_size || fail train_shard_size
head -c 8 "$D/train.bin" | grep -q K3TOKENS && pass shard_magic || fail shard_magic

# same bytes with one thread
expect_exit prepare_1thread 0 $K3 prepare --input "$VALID" --output-dir "$OUT/ts1" --vocab-size 1024 \
  --validation-stories 100 --tokenizer-stories 600 --threads 1
for f in tiktoken.model tokenizer_config.json train.bin val.bin; do
  cmp -s "$D/$f" "$OUT/ts1/$f" && pass "threads_same_$f" || fail "threads_same_$f"
done
# reusing the tokenizer gives the same shards
expect_exit prepare_reuse 0 $K3 prepare --input "$VALID" --output-dir "$OUT/reuse" --tokenizer "$D" \
  --validation-stories 100
cmp -s "$D/train.bin" "$OUT/reuse/train.bin" && pass reuse_same_shard || fail reuse_same_shard
cmp -s "$D/tiktoken.model" "$OUT/reuse/tiktoken.model" && pass reuse_copies_tokenizer || fail reuse_copies_tokenizer
# a staging folder of a killed prepare (dead PID) is removed by the next
# prepare into the same directory; a live process's stays
DEAD=2147483646
mkdir -p "$OUT/reuse/.k3-prepare.tmp.$DEAD" "$OUT/reuse/.k3-prepare.tmp.$$"
echo junk >"$OUT/reuse/.k3-prepare.tmp.$DEAD/train.bin"
expect_exit prepare_again 0 $K3 prepare --input "$VALID" --output-dir "$OUT/reuse" --tokenizer "$D" \
  --validation-stories 100
[ ! -e "$OUT/reuse/.k3-prepare.tmp.$DEAD" ] && pass stale_stage_removed || fail stale_stage_removed
[ -d "$OUT/reuse/.k3-prepare.tmp.$$" ] && pass live_stage_kept || fail live_stage_kept
rm -rf "$OUT/reuse/.k3-prepare.tmp.$$"

# other formats: JSONL and plain text (documents split at blank lines)
printf '{"text": "Once upon a time, there was a cat."}\n\n{"text": "The cat sat.\\nThe end.", "id": 2}\n{"text":"Tom ran."}\n' >"$OUT/c.jsonl"
expect_exit prepare_jsonl 0 $K3 prepare --input "$OUT/c.jsonl" --output-dir "$OUT/j" --tokenizer "$D" --validation-stories 1
[ "$(json_num "$OUT/j/stats.json" train stories)" = 2 ] && pass jsonl_stories || fail jsonl_stories
[ "$(json_num "$OUT/j/stats.json" train bytes)" = 55 ] && pass jsonl_bytes || fail jsonl_bytes
printf 'First paragraph,\nstill first.\n\n\nSecond one.\n  \nThird.\n' >"$OUT/c.txt"
expect_exit prepare_text 0 $K3 prepare --input "$OUT/c.txt" --output-dir "$OUT/t" --tokenizer "$D" --validation-fraction 0
[ "$(json_num "$OUT/t/stats.json" train stories)" = 3 ] && pass text_paragraphs || fail text_paragraphs
[ "$(json_num "$OUT/t/stats.json" train bytes)" = 46 ] && pass text_bytes || fail text_bytes
[ ! -e "$OUT/t/val.bin" ] && pass no_val_shard_when_empty || fail no_val_shard_when_empty

# errors: one line, exit 2
expect_exit err_missing 2 $K3 prepare --input "$OUT/nope.txt" --output-dir "$OUT/e"
expect_err_contains err_missing "nope.txt"
: >"$OUT/empty.txt"
expect_exit err_empty 2 $K3 prepare --input "$OUT/empty.txt" --output-dir "$OUT/e"
expect_err_contains err_empty "empty corpus"
expect_exit err_vocab 2 $K3 prepare --input "$VALID" --output-dir "$OUT/e" --vocab-size 256
expect_err_contains err_vocab "too small"
expect_exit err_no_input 2 $K3 prepare --output-dir "$OUT/e"
expect_exit err_no_output 2 $K3 prepare --input "$VALID"
expect_exit err_flag 2 $K3 prepare --input "$VALID" --output-dir "$OUT/e" --bogus
expect_exit err_pattern 2 $K3 prepare --input "$VALID" --output-dir "$OUT/e" --pattern gpt4
expect_exit err_all_val 2 $K3 prepare --input "$VALID" --output-dir "$OUT/e" --validation-stories 1000
expect_err_contains err_all_val "leaves none"
printf 'good text\n\nbad \xff text\n' >"$OUT/bad.txt"
expect_exit err_utf8 2 $K3 prepare --input "$OUT/bad.txt" --output-dir "$OUT/e"
expect_err_contains err_utf8 "bad.txt:3: invalid UTF-8"
printf '{"text": "ok"}\n{"txt": "no"}\n' >"$OUT/bad.jsonl"
expect_exit err_jsonl 2 $K3 prepare --input "$OUT/bad.jsonl" --output-dir "$OUT/e"
expect_err_contains err_jsonl "bad.jsonl:2"
expect_exit err_tokdir 2 $K3 prepare --input "$VALID" --output-dir "$OUT/e" --tokenizer "$OUT/nodir"
expect_exit help 0 $K3 prepare --help
expect_out_contains help "--vocab-size"
finish
