#!/usr/bin/env bash
# asan
# k3 eval: a model trained by k3 train scores the validation tokens exactly as
# the trainer's own evaluation does (same windows: --ctx = --seq-len, stride =
# ctx, the same number of tokens), --json, --compare, sliding windows, and the
# refusals.
. "$(dirname "$0")/lib.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
D=$OUT/data; R=$OUT/run; rm -rf "$D" "$R" "$OUT/model" "$OUT/model2"
head -c 300000 "$(fixture tinystories/train.txt)" >"$OUT/train.txt"
# 40 whole validation stories, each ending in its separator line
awk 'BEGIN { n = 0 } { print } /^<\|endoftext\|>$/ { if (++n == 41) exit }' "$(fixture tinystories/valid.txt)" | sed '1,/^<|endoftext|>$/d' >"$OUT/val.txt"
expect_exit prepare 0 $K3 prepare --input "$OUT/train.txt" --validation-input "$OUT/val.txt" --output-dir "$D" \
  --vocab-size 1024
T=32
expect_exit train 0 $K3 train --data-dir "$D" --config configs/tiny-train.json --output-dir "$R" --steps 30 \
  --batch-size 4 --seq-len $T --gradient-accumulation 1 --eval-interval 30 --eval-tokens 100000000 \
  --sample-interval 1000 --quiet
# the same stories joined by the special with no newlines: read raw, they are
# the ids k3 prepare writes (specials split the text before pre-tokenization)
perl -0pe 's/\n<\|endoftext\|>\n/<|endoftext|>/g' "$OUT/val.txt" >"$OUT/val-joined.txt"
rec=$(grep '"kind":"eval"' "$R/metrics.jsonl" | grep '"step":30,')
field() { echo "$rec" | sed -E "s/.*\"$1\":([0-9.eE+-]+).*/\1/"; }
vl=$(field val_loss); vb=$(field val_bpb); vt=$(field val_tokens)
echo "trainer: val_loss $vl, val_bpb $vb, $vt tokens"
expect_exit export 0 $K3 export "$R/latest.safetensors" "$OUT/model" --dtype f32 --experts f32
# the validation file itself: read as k3 prepare reads it
expect_exit eval-matches 0 $K3 eval "$OUT/model" --text "$OUT/val.txt" --ctx $T --max-tokens $((vt + 1)) --json --quiet
ev() { sed -nE "s/.*\"$1\": ([0-9.eE+-]+).*/\1/p" "$OUT/eval-matches.out"; }
en=$(ev nats_per_token); eb=$(ev bits_per_byte); et=$(ev tokens)
echo "k3 eval: nats_per_token $en, bits_per_byte $eb, $et tokens"
[ "$et" = "$vt" ] && pass eval:same-tokens || fail eval:same-tokens "eval $et, trainer $vt"
# the trainer's forward (training kernels) and the engine's (f32 export) round
# differently; measured |difference| 3e-10 nats, asserted at 1e-6
awk -v a="$en" -v b="$vl" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-6) }' && pass eval:equals-val-loss \
  || fail eval:equals-val-loss "eval $en vs trainer $vl"
awk -v a="$eb" -v b="$vb" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-6) }' && pass eval:equals-val-bpb \
  || fail eval:equals-val-bpb "eval $eb vs trainer $vb"
# the text's bytes: every scored story byte once (the specials cover none)
for k in nats_per_token bits_per_byte tokens bytes; do grep -q "\"$k\"" "$OUT/eval-matches.out" && pass "json:$k" || fail "json:$k"; done
grep -q '"format": "stories"' "$OUT/eval-matches.out" && grep -qE '"documents": 40(,|$)' "$OUT/eval-matches.out" \
  && pass json:format-stories || fail json:format-stories "$(grep -E 'format|documents' "$OUT/eval-matches.out")"

# one stream, three spellings: the file read as stories, the joined text read
# raw, and the stories as JSONL (each with its separator id) are the same ids,
# so the same total to the bit
total() { grep total_nats "$OUT/$1.out"; }
expect_exit eval-joined 0 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --json --quiet
expect_exit eval-stories 0 $K3 eval "$OUT/model" --text "$OUT/val.txt" --ctx $T --json --quiet
grep -q '"format": "raw"' "$OUT/eval-joined.out" && pass auto:raw || fail auto:raw
[ -n "$(total eval-stories)" ] && [ "$(total eval-joined)" = "$(total eval-stories)" ] && pass formats:raw-joined-equals-stories \
  || fail formats:raw-joined-equals-stories "$(total eval-joined) vs $(total eval-stories)"
perl -MJSON::PP -0ne 'my $j = JSON::PP->new->canonical; for my $s (split /\n<\|endoftext\|>\n?/) { print $j->encode({text => $s}), "\n" if $s =~ /\S/ }' \
  "$OUT/val.txt" >"$OUT/val.jsonl"
expect_exit eval-jsonl 0 $K3 eval "$OUT/model" --text "$OUT/val.jsonl" --ctx $T --json --quiet
grep -q '"format": "jsonl"' "$OUT/eval-jsonl.out" && [ "$(total eval-jsonl)" = "$(total eval-stories)" ] \
  && pass formats:jsonl-equals-stories || fail formats:jsonl-equals-stories "$(total eval-jsonl) vs $(total eval-stories)"
# read raw, the file's newlines around each separator are scored too: two per story
expect_exit eval-raw 0 $K3 eval "$OUT/model" --text "$OUT/val.txt" --format raw --ctx $T --json --quiet
tk() { sed -nE 's/.*"tokens": ([0-9]+).*/\1/p' "$OUT/$1.out"; }
rs=$(tk eval-stories); rr=$(tk eval-raw)
[ -n "$rs" ] && [ -n "$rr" ] && [ "$rr" -gt "$rs" ] && pass formats:raw-scores-separator-newlines \
  || fail formats:raw-scores-separator-newlines "raw $rr, stories $rs"
# standard input is read the same way
expect_exit eval-stdin 0 sh -c "$K3 eval '$OUT/model' --text - --ctx $T --json --quiet <'$OUT/val.txt'"
[ "$(total eval-stdin)" = "$(total eval-stories)" ] && pass formats:stdin || fail formats:stdin
expect_exit bad-format 2 $K3 eval "$OUT/model" --text "$OUT/val.txt" --format csv
printf '{"text": 1}\n' >"$OUT/bad.jsonl"
expect_exit bad-jsonl 2 $K3 eval "$OUT/model" --text "$OUT/bad.jsonl"
printf 'ok\n\377\n<|endoftext|>\n' >"$OUT/bad-utf8.txt"
expect_exit bad-utf8 2 $K3 eval "$OUT/model" --text "$OUT/bad-utf8.txt"
expect_err_contains bad-utf8 ":2: invalid UTF-8"

# sliding windows: the same tokens scored, each with more context, so no worse
expect_exit eval-stride 0 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --stride 8 --max-tokens $((vt + 1)) --json --quiet
st=$(sed -nE 's/.*"tokens": ([0-9]+).*/\1/p' "$OUT/eval-stride.out")
[ "$st" = "$vt" ] && pass stride:same-tokens || fail stride:same-tokens "$st"
# the text form and --compare (the model against itself: both columns equal)
expect_exit eval-text 0 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --quiet
expect_out_contains eval-text "bits per byte"
expect_exit compare 0 $K3 eval --compare "$OUT/model" "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --max-tokens 200 --quiet
line=$(grep '^nats per token' "$OUT/compare.out")
a=$(echo "$line" | awk '{ print $4 }'); b=$(echo "$line" | awk '{ print $5 }')
[ -n "$a" ] && [ "$a" = "$b" ] && pass compare:columns || fail compare:columns "$line"
expect_exit compare-json 0 $K3 eval --compare "$OUT/model" "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --max-tokens 200 --json --quiet
grep -q '"a"' "$OUT/compare-json.out" && grep -q '"b"' "$OUT/compare-json.out" && pass compare:json || fail compare:json
# threads do not change the figure
expect_exit threads1 0 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --max-tokens 300 --json --quiet --threads 1
expect_exit threads2 0 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx $T --max-tokens 300 --json --quiet --threads 2
[ "$(grep total_nats "$OUT/threads1.out")" = "$(grep total_nats "$OUT/threads2.out")" ] && pass threads:same-bits \
  || fail threads:same-bits

# refusals
expect_exit no-text 2 $K3 eval "$OUT/model"
expect_exit missing-text 2 $K3 eval "$OUT/model" --text "$OUT/none.txt"
# a folder opens (fopen succeeds) and only its read fails: named as what it is
expect_exit dir-text 2 $K3 eval "$OUT/model" --text "$OUT"
expect_err_contains dir-text "is a directory"
printf 'a' >"$OUT/one.txt"
expect_exit one-token 2 $K3 eval "$OUT/model" --text "$OUT/one.txt"
expect_exit stride-over-ctx 2 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx 8 --stride 16
expect_exit bad-ctx 2 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --ctx 0
expect_exit no-tokenizer 2 $K3 eval tests/fixtures/gen/k3_like --text "$OUT/val-joined.txt"
expect_exit budget 3 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --max-memory 1K
expect_exit compare-one 2 $K3 eval --compare "$OUT/model" --text "$OUT/val-joined.txt"
expect_exit bad-flag 2 $K3 eval "$OUT/model" --text "$OUT/val-joined.txt" --bogus
expect_exit help 0 $K3 eval --help
expect_out_contains help "bits per byte"
# an endless text is refused at once, bounded in time and memory
expect_exit text_dev_zero 2 bash -c "$MEM_CAP timeout 20 '$K3' eval tests/fixtures/trained-5m --text /dev/zero"
expect_err_contains text_dev_zero "not a regular file"
finish
