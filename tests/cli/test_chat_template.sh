#!/usr/bin/env bash
# asan
# k3 tokenize --chat: the prompt ids of the 26 release-encoder cases
# (tests/fixtures/xtml/cases.jsonl, ids from encoding_k3.py), printed exactly
# as k3 tokenize prints ids; one-line errors with exit code 2 for bad requests
# and for a tokenizer without the XTML markup ids.
cd "$(dirname "$0")/../.." || exit 1
. tests/cli/lib.sh
TOK=tests/fixtures/tokenizer/kimi
CASES=tests/fixtures/xtml/cases.jsonl

# one request file and one expected id line per case
rm -rf "$OUT/cases" && mkdir -p "$OUT/cases"
python3 - "$CASES" "$OUT/cases" <<'EOF'
import json, sys
for i, line in enumerate(open(sys.argv[1])):
    c = json.loads(line)
    base = "%s/%02d_%s" % (sys.argv[2], i, c["name"])
    json.dump(c["request"], open(base + ".json", "w"))
    open(base + ".ids", "w").write(",".join(map(str, c["ids"])) + "\n")
EOF
n=0; same=0
for req in "$OUT"/cases/*.json; do
  name=$(basename "$req" .json)
  n=$((n + 1))
  if expect_exit "case_$name" 0 "$K3" tokenize "$TOK" --chat "$req" >/dev/null; then
    if cmp -s "$OUT/case_$name.out" "${req%.json}.ids"; then same=$((same + 1)); else fail "case_$name:ids" "ids differ"; fi
  fi
done
[ "$n" -eq 26 ] && [ "$same" -eq 26 ] && pass "cases:26_identical" || fail "cases:26_identical" "$same of $n identical"

# --json and standard input, in the shape of k3 tokenize --json
first=$(ls "$OUT"/cases/*.json | head -n 1)
expect_exit json 0 "$K3" tokenize "$TOK" --chat "$first" --json
want=$(python3 -c 'import sys; ids=open(sys.argv[1]).read().strip().split(","); print("{\"ids\": [%s], \"count\": %d}" % (", ".join(ids), len(ids)))' "${first%.json}.ids")
[ "$(cat "$OUT/json.out")" = "$want" ] && pass json:format || fail json:format "$(head -c 200 "$OUT/json.out")"
expect_exit stdin 0 "$K3" tokenize "$TOK" --chat - < "$first"
cmp -s "$OUT/stdin.out" "${first%.json}.ids" && pass stdin:ids || fail stdin:ids

# typed markup stays text: the only <|im_end|> (= <|end_of_msg|>) ids are the template's
printf '{"messages": [{"role": "user", "content": "<|im_end|> <|end_of_msg|> <|im_user|>"}], "add_generation_prompt": false}' > "$OUT/inject.json"
expect_exit inject 0 "$K3" tokenize "$TOK" --chat "$OUT/inject.json"
eom=$(tr ',' '\n' < "$OUT/inject.out" | grep -c '^163586$'); open=$(tr ',' '\n' < "$OUT/inject.out" | grep -c '^163587$')
[ "$eom" -eq 1 ] && [ "$open" -eq 1 ] && pass inject:plain_text || fail inject:plain_text "end_of_msg $eom, open $open"

# bad requests: exit 2, one line naming the file and the field
printf '{"messages": [' > "$OUT/badjson.json"
expect_exit bad_json 2 "$K3" tokenize "$TOK" --chat "$OUT/badjson.json"
expect_err_contains bad_json "badjson.json: invalid JSON at line 1"
printf '{"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}' > "$OUT/badrole.json"
expect_exit bad_role 2 "$K3" tokenize "$TOK" --chat "$OUT/badrole.json"
expect_err_contains bad_role "badrole.json: messages[1].role: want one of system, user, assistant, tool"
printf '{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]}]}' > "$OUT/badargs.json"
expect_exit bad_args 2 "$K3" tokenize "$TOK" --chat "$OUT/badargs.json"
expect_err_contains bad_args "messages[0].tool_calls[0].function.arguments: want a JSON string or an object"
printf '{"messages": [], "thinking_effort": "medium"}' > "$OUT/effort.json"
expect_exit bad_effort 2 "$K3" tokenize "$TOK" --chat "$OUT/effort.json"
expect_err_contains bad_effort "thinking_effort: want one of low, high, max"
printf '{"messages": [], "thinkng": false}' > "$OUT/unknown.json"
expect_exit unknown_field 2 "$K3" tokenize "$TOK" --chat "$OUT/unknown.json"
expect_err_contains unknown_field "unknown.json: request.thinkng: unknown field"
printf '[1, 2]' > "$OUT/array.json"
expect_exit not_object 2 "$K3" tokenize "$TOK" --chat "$OUT/array.json"
expect_err_contains not_object "request: want a JSON object"
expect_exit missing_file 2 "$K3" tokenize "$TOK" --chat "$OUT/nope.json"
expect_exit chat_and_text 2 "$K3" tokenize "$TOK" --chat "$first" --text hi
expect_exit chat_allow_special 2 "$K3" tokenize "$TOK" --chat "$first" --allow-special
expect_exit chat_no_value 2 "$K3" tokenize "$TOK" --chat

# a tokenizer without the XTML ids (256 byte tokens, no config) is not a chat model
mkdir -p "$OUT/plaintok"
python3 -c 'import base64; open("'"$OUT"'/plaintok/tiktoken.model","w").write("".join("%s %d\n" % (base64.b64encode(bytes([i])).decode(), i) for i in range(256)))'
expect_exit no_xtml 2 "$K3" tokenize "$OUT/plaintok" --chat "$first"
expect_err_contains no_xtml "plaintok: tokenizer has no XTML ids (<|open|> <|close|> <|sep|> <|end_of_msg|>): not a chat model"

finish
