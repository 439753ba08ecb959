#!/usr/bin/env bash
# asan
# k3 serve reuses a shared prefix across conversations at message boundaries:
# two new conversations with the same long system prompt (~400 tokens, far
# from the state cache's 1024-token grid), different user messages. The second
# resumes at the end of the system message: it reports cached_tokens equal to
# the system message's token count (`k3 tokenize --chat` of the system message
# alone), and its reply equals a cold server's for the same request (bit-
# identical logits, greedy). /v1/completions has no message boundaries: a
# prompt sharing only part of an earlier one reuses grid and prompt-end
# snapshots only (docs/serve.md). Every wait bounded.
set -u
source tests/cli/lib.sh
PY=/usr/bin/python3
if ! $PY -c 'import numpy' 2>/dev/null; then
  skip serve-prefix "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
  finish; exit $?
fi
M=tests/out/chat-model-a   # test_chat.sh's
chat_model $M 3 || { finish; exit 1; }
kill_pids_at_exit

$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
system = " ".join("Rule %d: answer in plain words, keep it short and kind." % i for i in range(1, 41))
sysmsg = {"role": "system", "content": system}
json.dump({"messages": [sysmsg], "add_generation_prompt": False}, open(out + "/sys.json", "w"))
for name, q in (("a", "What is a cat?"), ("b", "Tell me about rivers in the north.")):
    json.dump({"messages": [sysmsg, {"role": "user", "content": q}], "max_tokens": 12, "temperature": 0},
              open("%s/%s.json" % (out, name), "w"))
PY
NSYS=$("$K3" tokenize "$M" --chat "$OUT/sys.json" | tr ',' '\n' | grep -c .)

post() { # URL FILE OUT
  curl -s --max-time 120 -H 'Content-Type: application/json' -o "$3" -w '%{http_code}' --data-binary "@$2" "$1v1/chat/completions"
}
field() { $PY -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>&1; }

start_server "$OUT/warm.log" "$K3" serve "$M" --port 0 || { fail start "$(head -c 300 "$OUT/warm.log.err")"; finish; exit 1; }
WARM=$SERVER_URL
start_server "$OUT/cold.log" "$K3" serve "$M" --port 0 || { fail start-cold "$(head -c 300 "$OUT/cold.log.err")"; finish; exit 1; }
COLD=$SERVER_URL
pass "servers (system message $NSYS tokens)"

check first "$(post "$WARM" "$OUT/a.json" "$OUT/a.out") $(field "$OUT/a.out" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')" "200 0"
check second-cached "$(post "$WARM" "$OUT/b.json" "$OUT/b.out") $(field "$OUT/b.out" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')" "200 $NSYS"
check cold-cached "$(post "$COLD" "$OUT/b.json" "$OUT/bc.out") $(field "$OUT/bc.out" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')" "200 0"
want=$(field "$OUT/bc.out" 'repr(j["choices"][0]["message"])')
check second-equals-cold "$(field "$OUT/b.out" 'repr(j["choices"][0]["message"])')" "$want"
[ -n "$want" ] && pass "reply ($(printf %s "$want" | head -c 60))" || fail reply "empty"

# completions: no boundaries; a prompt that shares only the start of an
# earlier one (shorter than the grid) starts cold
body() { $PY -c 'import json,sys; print(json.dumps({"prompt": sys.argv[1], "max_tokens": 2, "temperature": 0}))' "$1"; }
LONG=$($PY -c 'print(" ".join("word%d" % i for i in range(60)))')
body "$LONG first" >"$OUT/c1.json"; body "$LONG second" >"$OUT/c2.json"
curl -s --max-time 60 -H 'Content-Type: application/json' -o "$OUT/c1.out" --data-binary "@$OUT/c1.json" "${WARM}v1/completions"
curl -s --max-time 60 -H 'Content-Type: application/json' -o "$OUT/c2.out" --data-binary "@$OUT/c2.json" "${WARM}v1/completions"
check completions-no-boundary "$(field "$OUT/c2.out" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')" 0
finish
