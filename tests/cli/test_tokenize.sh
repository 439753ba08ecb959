#!/usr/bin/env bash
# asan
# k3 tokenize / k3 detokenize: ids as npm tiktoken gives them, byte-exact
# roundtrips, and one-line errors with exit code 2 for bad input.
cd "$(dirname "$0")/../.." || exit 1
. tests/cli/lib.sh
TOK=$(fixture tokenizer/kimi)

# ids below come from npm tiktoken (tools/tiktoken-check/kimi.js encoder)
expect_exit hello 0 "$K3" tokenize "$TOK" --text "Hello, world!"
[ "$(cat "$OUT/hello.out")" = "19180,11,2695,0" ] && pass hello:ids || fail hello:ids "$(cat "$OUT/hello.out")"

expect_exit multilingual 0 "$K3" tokenize "$TOK" --text "你好世界 naïve café 🚀"
[ "$(cat "$OUT/multilingual.out")" = "33845,2243,7915,44187,367,70591,17137,40101" ] && pass multilingual:ids \
  || fail multilingual:ids "$(cat "$OUT/multilingual.out")"

expect_exit special_plain 0 "$K3" tokenize "$TOK" --text "<|im_end|>"
[ "$(cat "$OUT/special_plain.out")" = "27,91,348,11129,91,29" ] && pass special_plain:ids || fail special_plain:ids
expect_exit special_allowed 0 "$K3" tokenize "$TOK" --text "<|im_end|>" --allow-special
[ "$(cat "$OUT/special_allowed.out")" = "163586" ] && pass special_allowed:ids || fail special_allowed:ids

expect_exit json 0 "$K3" tokenize "$TOK" --text "Hello, world!" --json
[ "$(cat "$OUT/json.out")" = '{"ids": [19180, 11, 2695, 0], "count": 4}' ] && pass json:format \
  || fail json:format "$(cat "$OUT/json.out")"
expect_exit empty 0 "$K3" tokenize "$TOK" --text "" --json
expect_out_contains empty '"count": 0'

# whole files: tokenize then detokenize gives the same bytes
for f in "$TOK/SOURCE.md" "$(fixture docs/k3-checkpoint-format.md)" src/tokenizer/tokenizer.c; do
  n=rt_$(basename "$f" | tr . _)
  if expect_exit "$n" 0 "$K3" tokenize "$TOK" --file "$f"; then
    expect_exit "$n.de" 0 "$K3" detokenize "$TOK" --ids "$(cat "$OUT/$n.out")"
    cmp -s "$OUT/$n.de.out" "$f" && pass "$n:bytes" || fail "$n:bytes" "roundtrip differs"
  fi
done
printf 'from stdin\r\n\ttabs  ' > "$OUT/stdin.txt"
expect_exit stdin 0 "$K3" tokenize "$TOK" --file - < "$OUT/stdin.txt"
expect_exit stdin.de 0 "$K3" detokenize "$TOK" --ids "$(cat "$OUT/stdin.out")"
cmp -s "$OUT/stdin.de.out" "$OUT/stdin.txt" && pass stdin:bytes || fail stdin:bytes

expect_exit detok_special 0 "$K3" detokenize "$TOK" --ids 163586,163589
[ "$(cat "$OUT/detok_special.out")" = "<|im_end|><|reserved_token_163589|>" ] && pass detok_special:bytes \
  || fail detok_special:bytes

# usage and input errors: exit 2, one line
expect_exit no_dir 2 "$K3" tokenize
expect_exit no_text 2 "$K3" tokenize "$TOK"
expect_exit both 2 "$K3" tokenize "$TOK" --text a --file b
expect_exit unknown_opt 2 "$K3" tokenize "$TOK" --text a --bogus
expect_exit missing_file 2 "$K3" tokenize "$TOK" --file "$OUT/does-not-exist.txt"
expect_err_contains missing_file "does-not-exist.txt"
printf 'ok \xc3\x28 bad' > "$OUT/bad_utf8.txt"
expect_exit bad_utf8 2 "$K3" tokenize "$TOK" --file "$OUT/bad_utf8.txt"
expect_err_contains bad_utf8 "bad_utf8.txt: invalid UTF-8 at byte 3"
expect_exit id_range 2 "$K3" detokenize "$TOK" --ids 1,163840
expect_err_contains id_range "out of range"
expect_exit id_junk 2 "$K3" detokenize "$TOK" --ids 1,x
expect_exit no_ids 2 "$K3" detokenize "$TOK"
expect_exit no_tok_dir 2 "$K3" tokenize "$OUT/no-such-dir" --text a
expect_err_contains no_tok_dir "no-such-dir/tiktoken.model"

# corrupt tokenizer directories: the error names the file and line
mkdir -p "$OUT/bad64" "$OUT/order"
head -n 300 "$TOK/tiktoken.model" > "$OUT/bad64/tiktoken.model"
printf 'Zm9v!!== 300\n' >> "$OUT/bad64/tiktoken.model"
expect_exit bad_base64 2 "$K3" tokenize "$OUT/bad64" --text a
expect_err_contains bad_base64 "bad64/tiktoken.model:301: bad base64"
{ head -n 299 "$TOK/tiktoken.model"; sed -n 301p "$TOK/tiktoken.model"; sed -n 300p "$TOK/tiktoken.model"; } \
  > "$OUT/order/tiktoken.model"
expect_exit rank_order 2 "$K3" detokenize "$OUT/order" --ids 1
expect_err_contains rank_order "order/tiktoken.model:300: rank 300 out of order (expected 299)"

expect_exit help 0 "$K3" help tokenize
expect_out_contains help "--allow-special"
expect_exit help_de 0 "$K3" detokenize --help
# endless inputs are refused at once (bounded in time and memory), and a
# request with a key twice is refused as serve refuses it
for f in file chat; do
  expect_exit "dev_zero_$f" 2 bash -c "$MEM_CAP timeout 20 '$K3' tokenize '$TOK' --$f /dev/zero"
  expect_err_contains "dev_zero_$f" "not a regular file"
done
# a run of millions of letters is one pre-tokenizer piece: it outgrows the
# regex JIT's stack, which must grow (or give way to the interpreter) rather
# than fail after a partial '{"ids": ['; the ids decode back to the text
# (decoded here from tiktoken.model itself, not by k3)
for run in x:4000000 ACGT:1000000; do
  python3 -c 'import sys; sys.stdout.write(sys.argv[1] * int(sys.argv[2]))' "${run%%:*}" "${run##*:}" >"$OUT/run.txt"
  name=long_run_${run%%:*}
  expect_exit "$name" 0 "$K3" tokenize "$TOK" --file "$OUT/run.txt" --json
  python3 - "$TOK/tiktoken.model" "$OUT/$name.out" "$OUT/run.txt" <<'EOF2' && pass "$name:decodes" || fail "$name:decodes"
import base64, json, sys
vocab = {}
for line in open(sys.argv[1], "rb"):
    if line.strip():
        tok, rank = line.split()
        vocab[int(rank)] = base64.b64decode(tok)
j = json.load(open(sys.argv[2]))
text = open(sys.argv[3], "rb").read()
sys.exit(not (j["count"] == len(j["ids"]) and b"".join(vocab[i] for i in j["ids"]) == text))
EOF2
done
printf '{"messages":[{"role":"user","content":"a","content":"b"}]}' >"$OUT/dupkey.json"
expect_exit chat_duplicate_key 2 "$K3" tokenize "$TOK" --chat "$OUT/dupkey.json"
finish
