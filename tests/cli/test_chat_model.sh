#!/usr/bin/env bash
# The shipped chat model (models/chat, docs/chat-model.md) as a user meets
# it. Its tokenizer has <|endoftext|> and the XTML ids right after the BPE
# ranks, as `k3 prepare --format chat` writes them. Asked, with a fixed seed,
# for a story about a character it has not seen in that request's form (a
# name and an animal of the held-out requests' kind), `k3 chat` answers on
# topic: with thinking on, the reasoning says what was asked and the story
# names the character; with thinking off there is no reasoning and the story
# still names it; each reply ends by the model's own stop. `k3 serve` gives
# the same reply as a chat completion. How often held-out requests are
# answered on topic is measured by tools/chat_eval.py (docs/chat-model.md),
# not here: this is the transcript the docs show, kept true.
. "$(dirname "$0")/lib.sh"
M=models/chat
for t in '<|endoftext|>' '<|open|>' '<|close|>' '<|sep|>' '<|end_of_msg|>' '[EOS]'; do
  grep -qF "\"content\": \"$t\"" "$M/tokenizer_config.json" && pass "special:$t" || fail "special:$t"
done

ASK="Tell me a story about a cat named Tom."
NAME=Tom
ask() { local msg=$1; shift; printf '%s\n' "$msg" | $K3 chat "$M" --threads 1 --gen 600 "$@"; }
# reply NAME: the reply's text (the lines k3 chat does not mark as reasoning)
reply() { grep -v '^\[think\]' "$OUT/$1.out"; }

expect_exit think 0 ask "$ASK" --temperature 0.8 --seed 1
grep '^\[think\]' "$OUT/think.out" | grep -q "$NAME" && pass think:reasoning-names-it \
  || fail think:reasoning-names-it "$(head -c 300 "$OUT/think.out")"
reply think | grep -q "\b$NAME\b" && pass think:story-names-it || fail think:story-names-it "$(head -c 400 "$OUT/think.out")"
grep -q '^\[turn 1: .*; stop' "$OUT/think.err" && pass think:stopped || fail think:stopped "$(tail -n 2 "$OUT/think.err")"

expect_exit nothink 0 ask "$ASK" --temperature 0.8 --seed 1 --no-think
! grep -q '^\[think\]' "$OUT/nothink.out" && pass nothink:no-reasoning || fail nothink:no-reasoning
reply nothink | grep -q "\b$NAME\b" && pass nothink:story-names-it || fail nothink:story-names-it "$(head -c 400 "$OUT/nothink.out")"
grep -q '^\[turn 1: .*; stop' "$OUT/nothink.err" && pass nothink:stopped || fail nothink:stopped "$(tail -n 2 "$OUT/nothink.err")"

# the same request over HTTP: the same reasoning and story (k3 chat's turn 0
# samples with --seed, as a request's seed does)
$K3 serve "$M" --port 0 --threads 1 >"$OUT/serve.log" 2>"$OUT/serve.err" &
SPID=$!
PORT=
for _ in $(seq 300); do
  PORT=$(sed -nE 's#.*http://[^ ]*:([0-9]+)/.*#\1#p' "$OUT/serve.log")
  [ -n "$PORT" ] && break
  kill -0 "$SPID" 2>/dev/null || break
  sleep 0.1
done
if [ -n "$PORT" ]; then
  body=$(printf '{"messages":[{"role":"user","content":"%s"}],"temperature":0.8,"seed":1,"max_tokens":600}' "$ASK")
  curl -s --max-time 120 -H 'Content-Type: application/json' -d "$body" \
    "http://127.0.0.1:$PORT/v1/chat/completions" >"$OUT/serve.json"
  got=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["choices"][0]["message"]; print(m.get("content") or "")' "$OUT/serve.json" 2>&1)
  want=$(reply think)
  [ "$got" = "$want" ] && pass serve:same-reply || fail serve:same-reply "got '$(printf %s "$got" | head -c 200)', wanted '$(printf %s "$want" | head -c 200)'"
else
  fail serve:start "$(cat "$OUT/serve.log" "$OUT/serve.err" | head -c 300)"
fi
kill "$SPID" 2>/dev/null; wait "$SPID" 2>/dev/null
finish
