#!/usr/bin/env bash
# k3 serve against a hostile client, on the small fixture model: cross-origin
# pages and bodies a browser sends without asking (403, 415), --queue 0 (one
# computes, none waits), HTTP the library itself would refuse with its own
# HTML pages (OpenAI error objects instead), slow clients that trickle their
# headers or body (a deadline, a per-client connection limit, others answered
# meanwhile), and a stop while requests are in flight (each gets a
# well-formed end). Loopback only, a few connections, every wait bounded.
set -u
source tests/cli/lib.sh
MODEL=tests/fixtures/trained-5m
kill_pids_at_exit
JSON='Content-Type: application/json'

# error_is NAME STATUS CODE: the last response is an OpenAI error object
error_is() { check "$1" "$CODE|$(jget 'j["error"]["code"], j["error"]["type"] is not None, bool(j["error"]["message"])')" "$2|('$3', True, True)"; }
stop_wait() { # PID: SIGTERM, up to 20 s; RC
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null; RC=124; return; fi
  wait "$1"; RC=$?
}

# ---- --queue 0: an idle server takes a request, a busy one answers 429 ----
# (one slot: one long request makes it busy; test_serve_batch.sh has several)
start_server "$OUT/q0.log" "$K3" serve "$MODEL" --port 0 --queue 0 --parallel 1 || { fail start-q0 "$(head -c 300 "$OUT/q0.log.err")"; finish; exit 1; }
URL=${SERVER_URL%/}; SPID=$SERVER_PID
req POST "$URL/v1/completions" -H "$JSON" --data-binary '{"prompt":"Once upon a time","max_tokens":4,"temperature":0}'
check queue0-idle-serves "$CODE" 200
curl -s -o /dev/null --max-time 60 -H "$JSON" --data-binary '{"prompt":"Once upon a time","max_tokens":400,"temperature":1.5,"seed":1}' "$URL/v1/completions" &
BUSY=$!
for _ in $(seq 200); do serve_state "$URL" | grep -q ' True ' && break; sleep 0.05; done
req POST "$URL/v1/completions" -H "$JSON" --data-binary '{"prompt":"Hi","max_tokens":2}'
error_is queue0-busy-429 429 queue_full
kill -9 "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null
stop_wait "$SPID"; check queue0-stop "$RC" 0

# ---- origins and body types ----
start_server "$OUT/s.log" "$K3" serve "$MODEL" --port 0 --cors-origin http://app.example:3000 || { fail start "$(head -c 300 "$OUT/s.log.err")"; finish; exit 1; }
URL=${SERVER_URL%/}; SPID=$SERVER_PID; PORT=$SERVER_PORT
BODY='{"prompt":"Hi","max_tokens":2}'
# a page elsewhere posts text/plain (no preflight in a browser): refused before it runs
req POST "$URL/v1/completions" -H 'Origin: http://evil.example' -H 'Content-Type: text/plain' --data-binary "$BODY"
error_is origin-refused 403 forbidden_origin
req POST "$URL/v1/completions" -H 'Origin: http://evil.example' -H "$JSON" --data-binary "$BODY"
error_is origin-refused-json 403 forbidden_origin
req GET "$URL/v1/models" -H 'Origin: null'
error_is origin-null 403 forbidden_origin
# a form's body type, even from no browser: 415
req POST "$URL/v1/completions" -H 'Content-Type: application/x-www-form-urlencoded' --data-binary "$BODY"
error_is form-body-415 415 unsupported_media_type
req POST "$URL/v1/completions" -H 'Content-Type: text/plain' --data-binary "$BODY"
error_is text-body-415 415 unsupported_media_type
# the server's own page (Origin = http://Host), JSON with a charset, no type at all: served
req POST "$URL/v1/completions" -H "Origin: http://127.0.0.1:$PORT" -H 'Content-Type: application/json; charset=utf-8' --data-binary "$BODY"
check own-origin "$CODE" 200
req POST "$URL/v1/completions" -H 'Content-Type:' --data-binary "$BODY"
check no-content-type "$CODE" 200
# an allowed origin: the response says so; a preflight gets the CORS headers
req POST "$URL/v1/completions" -H 'Origin: http://app.example:3000' -H "$JSON" --data-binary "$BODY"
check cors-allowed "$CODE|$(grep -i '^Access-Control-Allow-Origin:' "$OUT/head" | tr -d '\r')" "200|Access-Control-Allow-Origin: http://app.example:3000"
req OPTIONS "$URL/v1/chat/completions" -H 'Origin: http://app.example:3000' -H 'Access-Control-Request-Method: POST' \
  -H 'Access-Control-Request-Headers: authorization, content-type, x-stainless-os'
h=$(tr -d '\r' <"$OUT/head")
if [ "$CODE" = 204 ] && echo "$h" | grep -qi '^Access-Control-Allow-Origin: http://app.example:3000$' &&
   echo "$h" | grep -qi '^Access-Control-Allow-Methods: .*POST' && echo "$h" | grep -qi '^Access-Control-Allow-Headers: .*content-type'; then
  pass preflight
else fail preflight "HTTP $CODE: $h"; fi
req OPTIONS "$URL/v1/chat/completions" -H 'Origin: http://evil.example' -H 'Access-Control-Request-Method: POST'
error_is preflight-refused 403 forbidden_origin
if grep -qi '^Access-Control-Allow-Origin' "$OUT/head"; then fail preflight-refused-no-cors "$(cat "$OUT/head")"; else pass preflight-refused-no-cors; fi
stop_wait "$SPID"; check stop "$RC" 0

# ---- slow clients: a request's headers or body that trickle past --request-timeout
# are cut off while other clients are answered; one address holds at most
# --client-connections connections ----
start_server "$OUT/slow.log" "$K3" serve "$MODEL" --port 0 --request-timeout 2 --client-connections 4 \
  || { fail start-slow "$(head -c 300 "$OUT/slow.log.err")"; finish; exit 1; }
URL=${SERVER_URL%/}; SPID=$SERVER_PID; PORT=$SERVER_PORT
for what in headers body; do
  python3 tests/cli/raw_http.py "$PORT" trickle $what >"$OUT/trickle-$what.out" 2>&1 &
  TP=$!
  sleep 0.5
  # meanwhile another client is answered
  req POST "$URL/v1/completions" -H "$JSON" --data-binary '{"prompt":"Hi","max_tokens":2}'
  check "slow-$what-others-served" "$CODE" 200
  wait "$TP"
  t=$(sed -nE 's/^closed ([0-9.]+)$/\1/p' "$OUT/trickle-$what.out")
  if [ -n "$t" ] && python3 -c "import sys; sys.exit(not (1.5 <= float('$t') <= 6))"; then pass "slow-$what-dropped"
  else fail "slow-$what-dropped" "$(cat "$OUT/trickle-$what.out")"; fi
done
# five idle connections from one address: the fifth is closed at once, the
# first four until their deadline; afterwards a request is served again
python3 tests/cli/raw_http.py "$PORT" perip 4 >"$OUT/perip.out" 2>&1
check per-client-limit "$(cat "$OUT/perip.out")" "last-closed True first-open True"
req POST "$URL/v1/completions" -H "$JSON" --data-binary '{"prompt":"Hi","max_tokens":2}'
check per-client-after "$CODE" 200
# a body framed twice (two Content-Length headers, or one beside chunking): 400 with an error object
cat >"$OUT/framing.py" <<'EOF2'
import json, socket, sys
port, which = int(sys.argv[1]), sys.argv[2]
b = b'{"prompt":"Hi","max_tokens":2}'
h = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n"
h += b"Content-Length: %d\r\n" % len(b)
h += b"Content-Length: %d\r\n" % len(b) if which == "two" else b"Transfer-Encoding: chunked\r\n"
s = socket.create_connection(("127.0.0.1", port)); s.settimeout(10)
s.sendall(h + b"\r\n" + b)
out = b""
try:
    while True:
        d = s.recv(65536)
        if not d: break
        out += d
except OSError: pass
head, _, body = out.partition(b"\r\n\r\n")
try: code = json.loads(body)["error"]["code"]
except Exception: code = body[:80]
print(head.split(b"\r\n")[0].decode(errors="replace"), code)
EOF2
check two-content-length "$(python3 "$OUT/framing.py" "$PORT" two 2>&1)" "HTTP/1.1 400 Bad Request invalid_framing"
check length-and-chunked "$(python3 "$OUT/framing.py" "$PORT" te 2>&1)" "HTTP/1.1 400 Bad Request invalid_framing"
# HTTP that libmicrohttpd lets through or would answer with its own HTML
# page: one OpenAI error object, once
for c in version-1.7:505:http_version_not_supported uri-20k:414:uri_too_long uri-100k:414:uri_too_long \
         query-9k:414:uri_too_long header-100k:431:request_header_fields_too_large \
         headers-40k:431:request_header_fields_too_large te-gzip:501:unsupported_transfer_encoding \
         header-300k:431:request_header_fields_too_large version-2.0:505:http_version_not_supported \
         version-0.9:505:http_version_not_supported bad-version:400:invalid_request_line \
         bad-line:400:invalid_request_line bad-header:400:invalid_header folded-header:400:invalid_header \
         length-negative:400:invalid_content_length length-junk:400:invalid_content_length \
         length-2e64:413:request_too_large chunk-bad-size:400:invalid_chunked_body \
         chunk-too-long:400:invalid_chunked_body chunk-no-lf:400:invalid_chunked_body \
         length-trailing-tab:400:invalid_content_length cut-head:400:incomplete_request \
         cut-chunk:400:incomplete_request params-4000:414:uri_too_long \
         headers-8000:431:request_header_fields_too_large cookies-6000:431:request_header_fields_too_large; do
  IFS=: read -r name st code <<<"$c"
  check "http-$name" "$(python3 tests/cli/raw_http.py "$PORT" ask "$name" 2>&1)" "1 $st application/json $code"
done
# just within the limits: served
check http-query-7k "$(python3 tests/cli/raw_http.py "$PORT" ask query-7k 2>&1)" "1 200 application/json -"
check http-header-30k "$(python3 tests/cli/raw_http.py "$PORT" ask header-30k 2>&1)" "1 200 application/json -"
# a chunked body, decoded by k3 and handed on: served like a Content-Length one
check http-chunk-ok "$(python3 tests/cli/raw_http.py "$PORT" ask chunk-ok 2>&1)" "1 200 application/json -"
# curl's chunked upload that waits for 100 Continue (20 s at most) before its body
printf '{"prompt": "Once upon a time", "max_tokens": 2}' >"$OUT/chunk.json"
r=$(curl -s -o /dev/null -w '%{http_code} %{time_total}' --max-time 30 --expect100-timeout 20 -H "$JSON" \
  -H 'Transfer-Encoding: chunked' -H 'Expect: 100-continue' --data-binary @"$OUT/chunk.json" "$URL/v1/completions")
check http-chunk-expect "$(python3 -c 'import sys; c, t = sys.argv[1].split(); print(c, float(t) < 10)' "$r" 2>&1)" "200 True"
stop_wait "$SPID"; check slow-stop "$RC" 0

# ---- a stop with requests in flight: each gets a well-formed end ----
# (one slot, so that two wait behind the running one)
# (a sampled request that runs 400 tokens without meeting the end id, as test_serve.sh finds)
LONG=
for seed in 1 2 3 4 5 6 7 8; do
  "$K3" run "$MODEL" --prompt "Once upon a time" --gen 400 --temperature 1.5 --seed "$seed" --quiet --out "$OUT/long.json" 2>/dev/null
  if grep -q '"stop": "length"' "$OUT/long.json"; then LONG="\"prompt\":\"Once upon a time\",\"max_tokens\":400,\"temperature\":1.5,\"seed\":$seed"; break; fi
done
[ -n "$LONG" ] || fail long-request "no seed in 1..8 runs 400 tokens"
# the running request prefills a 15,000-token prompt in 4-token chunks: it is
# still computing when the stop comes, however fast the machine
python3 -c 'import json; print(json.dumps({"prompt": "Once upon a time there was a little dog. " * 1400, "max_tokens": 16}))' >"$OUT/longp.json"
LONGP=$(sed 's/^{//; s/}$//' "$OUT/longp.json")
for round in stream plain; do
  start_server "$OUT/st.log" "$K3" serve "$MODEL" --port 0 --threads 1 --chunk 4 --ctx 16384 --max-body 1M --parallel 1 || { fail "start-$round" "$(head -c 300 "$OUT/st.log.err")"; continue; }
  URL=${SERVER_URL%/}; SPID=$SERVER_PID
  # the running one (streamed in the first round, not in the second), then a queued stream and a queued plain one
  if [ $round = stream ]; then extra=',"stream":true'; else extra=''; fi
  curl -s -N --max-time 60 -H "$JSON" -o "$OUT/run.out" -w '%{http_code}' --data-binary "{$LONGP$extra}" "$URL/v1/completions" >"$OUT/run.code" 2>/dev/null &
  C1=$!
  for _ in $(seq 200); do serve_state "$URL" | grep -q ' True ' && break; sleep 0.05; done
  curl -s -N --max-time 60 -H "$JSON" -o "$OUT/qs.out" -w '%{http_code}' --data-binary "{$LONG,\"stream\":true}" "$URL/v1/completions" >"$OUT/qs.code" &
  C2=$!
  curl -s --max-time 60 -H "$JSON" -o "$OUT/qp.out" -w '%{http_code}' --data-binary "{$LONG}" "$URL/v1/completions" >"$OUT/qp.code" &
  C3=$!
  for _ in $(seq 200); do serve_state "$URL" | grep -q ' True 2$' && break; sleep 0.05; done
  sleep 0.3
  stop_wait "$SPID"; check "stop-$round-exit" "$RC" 0
  wait "$C1"; r1=$?; wait "$C2"; r2=$?; wait "$C3"; r3=$?
  if [ $round = stream ]; then
    # its tokens so far, then the error event and [DONE]; curl saw a complete response (exit 0)
    ok=$(python3 - "$OUT/run.out" <<'PY'
import json, sys
ev = [l[6:] for l in open(sys.argv[1]).read().split("\n") if l.startswith("data: ")]
text = [json.loads(e) for e in ev[:-2]]
err = json.loads(ev[-2])
print(all("choices" in t for t in text), err["error"]["code"], ev[-1])
PY
)
    check stop-running-stream "$r1 $(cat "$OUT/run.code") $ok" "0 200 True server_stopping [DONE]"
  else
    check stop-running-plain "$r1 $(cat "$OUT/run.code") $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["error"]["code"])' "$OUT/run.out" 2>&1)" "0 503 server_stopping"
  fi
  check "stop-queued-stream-$round" "$r2 $(cat "$OUT/qs.code") $(tr '\n' ' ' <"$OUT/qs.out" | sed -E 's/"message":"[^"]*"//')" \
    '0 200 data: {"error":{,"type":"server_error","param":null,"code":"server_stopping"}}  data: [DONE]  '
  check "stop-queued-plain-$round" "$r3 $(cat "$OUT/qp.code") $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["error"]["code"])' "$OUT/qp.out" 2>&1)" "0 503 server_stopping"
done
finish
