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

# chat conversations (--format chat): the tokenizer gets the XTML ids after
# <|endoftext|>, and each conversation's ids in the shards are exactly what
# `k3 tokenize --chat` (checked against the release encoder's ids in
# test_chat_template.sh) renders for it, then <|endoftext|>
CONV=$(fixture chat/conversations.jsonl)
C=$OUT/chat
rm -rf "$C"
expect_exit chat_prepare 0 $K3 prepare --format chat --input "$CONV" --output-dir "$C" --vocab-size 512 \
  --validation-stories 4
[ "$(json_num "$C/stats.json" train stories)" = 36 ] && pass chat_train_conversations || fail chat_train_conversations
[ "$(wc -l <"$C/tiktoken.model")" = 506 ] && pass chat_ranks_506 || fail chat_ranks_506
want=$(printf '506 <|endoftext|>\n507 <|open|>\n508 <|close|>\n509 <|sep|>\n510 <|end_of_msg|>\n511 [EOS]')
got=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["added_tokens_decoder"]; print("\n".join(k+" "+v["content"] for k,v in sorted(d.items(), key=lambda kv: int(kv[0]))))' "$C/tokenizer_config.json")
[ "$got" = "$want" ] && pass chat_specials || fail chat_specials "$got"
# every conversation of both splits, in order: train (the first 36), then val
: >"$OUT/chat_want.ids"
n=0; ok=1
while IFS= read -r line; do
  n=$((n + 1))
  printf '%s' "$line" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["add_generation_prompt"]=False; print(json.dumps(d))' >"$OUT/conv.json"
  if ! $K3 tokenize "$C" --chat "$OUT/conv.json" >"$OUT/conv.ids" 2>"$OUT/conv.err"; then ok=0; break; fi
  { tr ',' '\n' <"$OUT/conv.ids"; echo 506; } >>"$OUT/chat_want.ids"
done <"$CONV"
shard_ids() { od -An -tu2 -v -j64 "$1" | tr -s ' ' '\n' | sed '/^$/d'; }
{ shard_ids "$C/train.bin"; shard_ids "$C/val.bin"; } >"$OUT/chat_got.ids"
if [ "$ok" = 1 ] && [ "$n" = 40 ] && cmp -s "$OUT/chat_want.ids" "$OUT/chat_got.ids"; then
  pass "chat_ids_as_the_template ($(wc -l <"$OUT/chat_got.ids") ids)"
else
  fail chat_ids_as_the_template "$n conversations; $(head -c 200 "$OUT/conv.err"); $(cmp "$OUT/chat_want.ids" "$OUT/chat_got.ids" 2>&1)"
fi
# the bytes are the text's: the markup ids add none
tb=$(json_num "$C/stats.json" train bytes)
wantb=$(head -n 36 "$CONV" | python3 -c '
import json, sys
n = 0
for line in sys.stdin:
    for m in json.loads(line)["messages"]:
        for k in ("content", "reasoning_content"):
            if isinstance(m.get(k), str): n += len(m[k].encode())
print(n)')
[ "$tb" -gt "$wantb" ] && [ "$tb" -lt $((wantb + 36 * 200)) ] && pass "chat_bytes ($tb, texts $wantb)" || fail chat_bytes "$tb vs texts $wantb"
# the chat model's tokenizer reused gives the same shards; a tokenizer without
# the XTML ids cannot render a conversation
expect_exit chat_reuse 0 $K3 prepare --format chat --input "$CONV" --output-dir "$OUT/chat2" --tokenizer "$C" \
  --validation-stories 4
cmp -s "$C/train.bin" "$OUT/chat2/train.bin" && pass chat_reuse_same || fail chat_reuse_same
expect_exit err_chat_tok 2 $K3 prepare --format chat --input "$CONV" --output-dir "$OUT/e" --tokenizer "$D"
expect_err_contains err_chat_tok "not a chat model"
# bad conversations: the file and line, exit 2.
# bad_chat NAME TEXT MESSAGE FLAGS...: NAME.jsonl holding TEXT is refused with
# exit 2 and a message that starts with MESSAGE (after the file's name)
bad_chat() {
  local name=$1 text=$2 msg=$3; shift 3
  printf '%s' "$text" >"$OUT/$name.jsonl"
  expect_exit "$name" 2 $K3 prepare --format chat --input "$OUT/$name.jsonl" --output-dir "$OUT/e" "$@"
  expect_err_contains "$name" "$name.jsonl:$msg"
}
A='{"role": "assistant", "content": "x"}'
bad_chat err_chat_last "$(head -n 1 "$CONV")"$'\n{"messages": [{"role": "user", "content": "hi"}]}\n' \
  "2: the last message must be the assistant's reply" --vocab-size 300
bad_chat err_chat_agp "{\"messages\": [$A], \"add_generation_prompt\": true}"$'\n' "1: add_generation_prompt" \
  --vocab-size 300
bad_chat err_chat_field $'\n'"{\"messages\": [$A], \"tempo\": 1}"$'\n' "2: request.tempo" --vocab-size 300
bad_chat err_chat_json "{\"messages\": [$A"$'\n' "1:" --vocab-size 300
bad_chat err_chat_role '{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}'$'\n''{"messages": [{"role": "assistant", "content": "z"}]}'$'\n' \
  "1: messages[0].role" --tokenizer "$C" --validation-stories 1
expect_exit err_chat_vocab 2 $K3 prepare --format chat --input "$CONV" --output-dir "$OUT/e" --vocab-size 261
expect_err_contains err_chat_vocab "6 special ids need at least 262"

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
