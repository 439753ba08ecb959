#!/usr/bin/env bash
# k3 serve's operator surface on the small fixture model: --api-key and
# --api-key-file (a missing or wrong key: OpenAI's 401 object; the page and
# /health stay open; the npm openai client with the key works, without it gets
# 401), GET /metrics (parsed as Prometheus text: counters move with requests),
# POST /tokenize and /detokenize (the ids of `k3 tokenize`, and back), the
# warning when listening beyond loopback without a key. Every wait bounded.
set -u
source tests/cli/lib.sh
MODEL=tests/fixtures/trained-5m
kill_pids_at_exit
JSON='Content-Type: application/json'
error_is() { check "$1" "$CODE|$(jget 'j["error"]["code"], j["error"]["type"], bool(j["error"]["message"])')" "$2|('$3', 'invalid_request_error', True)"; }

expect_exit key-empty 2 "$K3" serve "$MODEL" --api-key ''
expect_exit key-file-missing 2 "$K3" serve "$MODEL" --api-key-file "$OUT/none"
: >"$OUT/empty.key"
expect_exit key-file-empty 2 "$K3" serve "$MODEL" --api-key-file "$OUT/empty.key"
expect_exit cors-bad 2 "$K3" serve "$MODEL" --cors-origin 'http://x.example/path'
expect_exit help 0 "$K3" serve --help
expect_out_contains help "--api-key"

printf 'sk-test-123\n' >"$OUT/k.key"
start_server "$OUT/s.log" "$K3" serve "$MODEL" --port 0 --api-key-file "$OUT/k.key" || { fail start "$(head -c 300 "$OUT/s.log.err")"; finish; exit 1; }
URL=${SERVER_URL%/}; SPID=$SERVER_PID
BODY='{"prompt":"Once upon a time","max_tokens":3,"temperature":0}'
req POST "$URL/v1/completions" -H "$JSON" --data-binary "$BODY"
error_is key-missing 401 invalid_api_key
grep -qi '^WWW-Authenticate: Bearer' "$OUT/head" && pass key-missing-header || fail key-missing-header "$(cat "$OUT/head")"
req POST "$URL/v1/completions" -H "$JSON" -H 'Authorization: Bearer sk-test-12' --data-binary "$BODY"
error_is key-wrong 401 invalid_api_key
req GET "$URL/v1/models" -H 'Authorization: Basic c2stdGVzdC0xMjM='
error_is key-basic 401 invalid_api_key
req GET "$URL/metrics"
error_is metrics-needs-key 401 invalid_api_key
req POST "$URL/v1/completions" -H "$JSON" -H 'Authorization: Bearer sk-test-123' --data-binary "$BODY"
check key-right "$CODE" 200
req GET "$URL/health"; check health-open "$CODE" 200
req GET "$URL/"; check page-open "$CODE" 200
# the npm openai client (tests/e2e), with and without the key
if [ -d tests/e2e/node_modules/openai ]; then
  cat >"$OUT/client.mjs" <<'JS'
import OpenAI from 'openai';
const url = process.env.URL + '/v1';
const ok = new OpenAI({ baseURL: url, apiKey: 'sk-test-123', maxRetries: 0, timeout: 60000 });
const bad = new OpenAI({ baseURL: url, apiKey: 'nope', maxRetries: 0, timeout: 60000 });
const r = await ok.completions.create({ model: 'trained-5m', prompt: 'Once upon a time', max_tokens: 3 });
console.log('with-key', r.choices.length);
try { await bad.models.list(); console.log('without-key no error'); }
catch (e) { console.log('without-key', e.status, e.code || e.error?.code); }
JS
  cp "$OUT/client.mjs" tests/e2e/.client_api_tmp.mjs
  out=$(URL=$URL timeout 120 node tests/e2e/.client_api_tmp.mjs 2>&1); rm -f tests/e2e/.client_api_tmp.mjs
  check openai-client "$out" "with-key 1
without-key 401 invalid_api_key"
else
  skip openai-client "tests/e2e/node_modules has no openai (scripts/setup.sh --test)"
fi

# ---- /metrics: Prometheus text that moves with the requests ----
AUTH='Authorization: Bearer sk-test-123'
req GET "$URL/metrics" -H "$AUTH"
cp "$OUT/body" "$OUT/m0.txt"
req POST "$URL/v1/completions" -H "$JSON" -H "$AUTH" --data-binary "$BODY"
# (extends the previous prompt: a cache hit)
req POST "$URL/v1/completions" -H "$JSON" -H "$AUTH" --data-binary '{"prompt":"Once upon a time there was a dog","max_tokens":3}'
req GET "$URL/metrics" -H "$AUTH"
check metrics-type "$CODE $(grep -i '^Content-Type' "$OUT/head" | tr -d '\r' | cut -d' ' -f2-)" "200 text/plain; version=0.0.4; charset=utf-8"
SLOTS=$(curl -s --max-time 10 "$URL/health" | sed -nE 's/.*"total": *([0-9]+).*/\1/p')
python3 - "$OUT/m0.txt" "$OUT/body" "$SLOTS" >"$OUT/prom.out" 2>&1 <<'PY'
import re, sys
def parse(path):
    """Prometheus text format 0.0.4: # HELP/# TYPE lines, then name{labels} value."""
    vals, types = {}, {}
    for line in open(path):
        line = line.rstrip("\n")
        if not line: continue
        if line.startswith("# HELP "): continue
        if line.startswith("# TYPE "):
            _, _, name, t = line.split(" ", 3)
            assert t in ("counter", "gauge", "histogram"), line
            types[name] = t; continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*\})? (\S+)', line)
        assert m, "not a sample line: %r" % line
        base = re.sub(r'_(bucket|sum|count)$', '', m.group(1))
        assert m.group(1) in types or base in types, "no TYPE for " + m.group(1)
        vals[m.group(1) + (m.group(2) or "")] = float(m.group(4))
    return vals, types
a, _ = parse(sys.argv[1]); b, t = parse(sys.argv[2])
d = lambda k: b.get(k, 0) - a.get(k, 0)
for h in ("k3_time_to_first_token_seconds", "k3_time_per_output_token_seconds"):
    assert t[h] == "histogram"
    buckets = [v for k, v in b.items() if k.startswith(h + "_bucket")]
    assert buckets == sorted(buckets) and b[h + '_bucket{le="+Inf"}'] == b[h + "_count"], h
print(d('k3_http_responses_total{status="200"}') >= 2, d("k3_generation_tokens_total"), d("k3_time_to_first_token_seconds_count"),
      d("k3_time_per_output_token_seconds_count"), d("k3_prompt_tokens_total") > 0, d("k3_cache_hits_total") >= 1,
      b["k3_slots_total"] == float(sys.argv[3]), "k3_queue_waiting" in b, b['k3_http_responses_total{status="401"}'] >= 4)
PY
check metrics-parse "$(cat "$OUT/prom.out")" "True 6.0 2.0 4.0 True True True True True"

# ---- /tokenize and /detokenize ----
ids=$("$K3" tokenize "$MODEL" --text "Once upon a time" 2>/dev/null | tr -d '[:space:]')
req POST "$URL/tokenize" -H "$JSON" -H "$AUTH" --data-binary '{"prompt":"Once upon a time"}'
check tokenize "$CODE $(jget '",".join(map(str, j["tokens"])), j["count"] == len(j["tokens"]), j["max_model_len"] > 0')" "200 ('$ids', True, True)"
req POST "$URL/detokenize" -H "$JSON" -H "$AUTH" --data-binary "{\"tokens\":[$ids]}"
check detokenize "$CODE $(jget 'j["prompt"]')" "200 Once upon a time"
req POST "$URL/detokenize" -H "$JSON" -H "$AUTH" --data-binary '{"tokens":[1,99999999]}'
error_is detokenize-outside 400 invalid_value
req POST "$URL/tokenize" -H "$JSON" -H "$AUTH" --data-binary '{"prompt":"a","frob":1}'
error_is tokenize-unknown 400 unknown_parameter
req GET "$URL/tokenize" -H "$AUTH"
error_is tokenize-get 405 method_not_allowed
kill -TERM "$SPID"; for _ in $(seq 200); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done; wait "$SPID"; check stop "$?" 0

# ---- beyond loopback: a warning without a key, none with one ----
start_server "$OUT/w.log" "$K3" serve "$MODEL" --port 0 --host 0.0.0.0 || { fail start-any "$(head -c 300 "$OUT/w.log.err")"; finish; exit 1; }
grep -q 'warning: .*without --api-key' "$OUT/w.log.err" && pass warn-no-key || fail warn-no-key "$(cat "$OUT/w.log.err")"
kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null
start_server "$OUT/w2.log" "$K3" serve "$MODEL" --port 0 --host 0.0.0.0 --api-key k || { fail start-any-key "$(head -c 300 "$OUT/w2.log.err")"; finish; exit 1; }
grep -q 'warning' "$OUT/w2.log.err" && fail no-warn-with-key "$(cat "$OUT/w2.log.err")" || pass no-warn-with-key
kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null
finish
