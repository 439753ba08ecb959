#!/usr/bin/env bash
# k3 serve: a client that disconnects during a long prefill stops it. The
# small fixture model is served with a one-thread, 4-token prefill chunk, so a
# 15,000-token prompt prefills for seconds; the client streams it and is killed
# once the worker runs it. The server log says the prefill was cancelled before
# its end (K of N prompt tokens), the server still answers, and the same request
# again continues from exactly the K tokens the cut prefill consumed (no more:
# nothing stands in the state cache as if the prompt had been fed) and gives
# the text a cold `k3 run` of the whole prompt gives.
# Release build only (no "# asan" line): under the sanitizer the prefill runs
# for minutes. Every wait is bounded.
set -u
source tests/cli/lib.sh
MODEL=tests/fixtures/trained-5m
kill_pids_at_exit

PROMPT_FILE=$OUT/prompt.txt
python3 -c 'print("Once upon a time there was a little dog. " * 1400, end="")' >"$PROMPT_FILE"
N=$("$K3" tokenize "$MODEL" --text "$(cat "$PROMPT_FILE")" | tr ',' '\n' | grep -c .)
python3 - "$PROMPT_FILE" "$OUT" <<'PY'
import json, sys
p = open(sys.argv[1]).read()
for name, extra in (("stream", {"stream": True}), ("plain", {})):
    json.dump(dict(prompt=p, max_tokens=16, temperature=0, **extra), open(f"{sys.argv[2]}/{name}.json", "w"))
PY

start_server "$OUT/server.log" "$K3" serve "$MODEL" --port 0 --ctx 16384 --threads 1 --chunk 4 --max-body 1M
SPID=$SERVER_PID; PORT=$SERVER_PORT
if [ -z "$PORT" ]; then fail start "$(head -c 600 "$OUT/server.log.err")"; finish; exit 1; fi
pass "start (port $PORT, prompt $N tokens)"
URL=http://127.0.0.1:$PORT
health() { serve_state "$URL" | cut -d' ' -f1,2; }

# ---- the cut ----
curl -H 'Content-Type: application/json' -s -N --max-time 120 --data-binary "@$OUT/stream.json" "$URL/v1/completions" >"$OUT/cut.sse" &
CURL=$!
for _ in $(seq 500); do [ "$(health)" = "0 True" ] && break; sleep 0.02; done
sleep 0.3
kill -9 "$CURL" 2>/dev/null; wait "$CURL" 2>/dev/null
for _ in $(seq 200); do [ "$(health)" = "1 False" ] && break; sleep 0.05; done
state=$(health)
if [ "$state" = "1 False" ]; then pass "cut-counted"; else fail cut-counted "health: $state"; fi
if grep -q '^data: ' "$OUT/cut.sse"; then fail cut-before-first-token "the client got an event: $(head -c 200 "$OUT/cut.sse")"; else pass cut-before-first-token; fi
line=$(grep 'cancelled: client disconnected during the prefill' "$OUT/server.log.err" | tail -n 1)
K=$(echo "$line" | sed -nE 's/.*cancelled after ([0-9]+) of ([0-9]+) prompt tokens.*/\1/p')
NN=$(echo "$line" | sed -nE 's/.*cancelled after ([0-9]+) of ([0-9]+) prompt tokens.*/\2/p')
if [ -n "$K" ] && [ "$NN" = "$N" ] && [ "$K" -lt "$N" ]; then pass "cut-during-prefill ($K of $N prompt tokens)"
else fail cut-during-prefill "log: $(tail -c 300 "$OUT/server.log.err")"; fi

# ---- the server still answers, and the same request continues from the cut ----
code=$(curl -s --max-time 10 -o "$OUT/health.json" -w '%{http_code}' "$URL/health")
if [ "$code" = 200 ]; then pass alive; else fail alive "HTTP $code"; fi
"$K3" run "$MODEL" --prompt-file "$PROMPT_FILE" --gen 16 --quiet --out "$OUT/cold.json" 2>"$OUT/cold.err"
want=$(python3 -c 'import json,sys; sys.stdout.write(json.load(open(sys.argv[1]))["text"])' "$OUT/cold.json" 2>/dev/null)
[ -n "$want" ] || fail cold-run "$(head -c 300 "$OUT/cold.err")"
code=$(curl -H 'Content-Type: application/json' -s --max-time 120 -o "$OUT/again.json" -w '%{http_code}' --data-binary "@$OUT/plain.json" "$URL/v1/completions")
got=$(python3 -c 'import json,sys; sys.stdout.write(json.load(open(sys.argv[1]))["choices"][0]["text"])' "$OUT/again.json" 2>&1)
cached=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["prompt_tokens_details"]["cached_tokens"])' "$OUT/again.json" 2>&1)
if [ "$code" = 200 ] && [ "$got" = "$want" ]; then pass "again-equals-cold"; else fail again-equals-cold "HTTP $code, got '$(printf %s "$got" | head -c 200)', wanted '$(printf %s "$want" | head -c 200)'"; fi
if [ -n "$K" ] && [ "$cached" = "$K" ]; then pass "again-continues-from-the-cut (cached_tokens $cached)"; else fail again-continues-from-the-cut "cached_tokens $cached, wanted $K"; fi

kill -TERM "$SPID"
for _ in $(seq 200); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
wait "$SPID" 2>/dev/null; rc=$?
if [ "$rc" = 0 ]; then pass stop; else fail stop "exit $rc"; fi
finish
