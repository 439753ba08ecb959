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
# snapshots only (docs/serve.md). docs/serve.md's Python client example runs
# against the server (through tests/cli/fake_openai) under real pydantic and
# both majors' ways of keeping extra fields. Every wait bounded.
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

# docs/serve.md's Python client example, as written there, against this server
# through tests/cli/fake_openai (the openai package's calls, its reply objects
# built with real pydantic when installed (Debian's is v1), and shaped as
# each pydantic major keeps extra fields). Under each: it reads the first
# reply's reasoning_content (an extra field), prints it and sends it back,
# and its second turn reuses at least the whole first prompt.
$PY - docs/serve.md "$WARM" "$(basename "$M")" "$OUT/example.py" <<'PY'
import sys
doc, url, model, out = sys.argv[1:5]
lines = open(doc).read().split("and from Python with the official client", 1)[1].split("\n")[1:]
while lines and not lines[0].strip(): lines.pop(0)
code = []
for l in lines:
    if l.strip() and not l.startswith("    "): break
    code.append(l[4:])
src = "\n".join(code).replace("http://127.0.0.1:8000/v1", url + "v1").replace('"MODEL"', repr(model))
open(out, "w").write(src)
PY
for f in pydantic v1 v2; do
  if [ $f = pydantic ] && ! $PY -c 'import pydantic' 2>/dev/null; then
    skip docs-example:pydantic "no python3 pydantic (Debian's python3-pydantic: scripts/setup.sh --test)"; continue
  fi
  rm -f "$OUT/example-$f.log"
  FAKE_OPENAI_MODELS=$f FAKE_OPENAI_MAX_TOKENS=8 FAKE_OPENAI_LOG="$OUT/example-$f.log" \
    PYTHONPATH=tests/cli/fake_openai PYTHONDONTWRITEBYTECODE=1 timeout 300 $PY "$OUT/example.py" >"$OUT/example-$f.out" 2>&1
  rc=$?
  [ $rc = 0 ] && pass "docs-example:$f:runs" || { fail "docs-example:$f:runs" "exit $rc: $(tail -c 300 "$OUT/example-$f.out")"; continue; }
  got=$($PY - "$OUT/example-$f.log" "$OUT/example-$f.out" <<'PY'
import json, sys
calls = [json.loads(l) for l in open(sys.argv[1])]
out = open(sys.argv[2]).read()
first = calls[0]["response"]
reasoning = first["choices"][0]["message"].get("reasoning_content")
sent = calls[1]["request"]["messages"][1]
ok = []
ok.append("reasoning read" if reasoning and out.startswith(reasoning + "\n---\n") else "reasoning not printed")
ok.append("sent back" if reasoning and sent.get("reasoning_content") == reasoning else "not sent back: %r" % sent)
p1, c2 = first["usage"]["prompt_tokens"], calls[1]["response"]["usage"]["prompt_tokens_details"]["cached_tokens"]
ok.append("turn 2 reuses turn 1's prompt" if c2 >= p1 else "turn 2 cached %d < turn 1's prompt %d" % (c2, p1))
print("; ".join(ok))
PY
)
  check "docs-example:$f" "$got" "reasoning read; sent back; turn 2 reuses turn 1's prompt"
done
finish
