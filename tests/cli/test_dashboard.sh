#!/usr/bin/env bash
# asan
# k3 dashboard against synthetic run directories (tests/dashboard/fake-trainer.sh
# writes one while we read): endpoints, since= filtering, partial last lines,
# replaced and corrupt files, path traversal and symlinks, malformed requests,
# slow clients (a deadline, a per-client connection limit), a 10,000-request
# load loop (server RSS must not grow), clean stop on signals.
set -u
source tests/cli/lib.sh
CC=${CC:-cc}
ASAN=0
case "$K3" in *asan*) ASAN=1 ;; esac

rm -rf "$OUT/runs" "$OUT/outside" "$OUT/solo"
mkdir -p "$OUT/runs" "$OUT/outside"
CLIENT=$OUT/http_client
if ! $CC -O2 -Wall -Wextra -Werror -o "$CLIENT" tests/dashboard/http_client.c 2>"$OUT/client-build.log"; then
  fail "build-client" "$(head -c 300 "$OUT/client-build.log")"; finish; exit 1
fi
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; }
# stop_wait PID SIGNAL: sends SIGNAL, waits up to 20 s, sets RC to the exit
# status (or 124 after a SIGKILL). A server that ignores the signal fails its
# check instead of hanging the suite.
stop_wait() {
  kill "-$2" "$1" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null; RC=124; return; fi
  wait "$1"; RC=$?
}
trap cleanup EXIT


# ---- usage errors ----
expect_exit dash-no-run-dir 2 "$K3" dashboard
expect_exit dash-bad-port 2 "$K3" dashboard --run-dir "$OUT/runs" --port 70000
expect_exit dash-bad-flag 2 "$K3" dashboard --run-dir "$OUT/runs" --frobnicate
expect_exit dash-missing-dir 2 "$K3" dashboard --run-dir "$OUT/does-not-exist"
expect_err_contains dash-missing-dir "does-not-exist"
: >"$OUT/plain-file"
expect_exit dash-not-dir 2 "$K3" dashboard --run-dir "$OUT/plain-file"
expect_exit dash-bad-stale 2 "$K3" dashboard --run-dir "$OUT/runs" --stale-after -3
expect_exit dash-help 0 "$K3" dashboard --help
expect_out_contains dash-help "--run-dir"

# ---- run directories ----
# beta: a finished run; alpha: a run being written during the tests;
# gamma: hand-made files (partial line, bad line, symlinks, odd entries)
bash tests/dashboard/fake-trainer.sh "$OUT/runs/beta" 6 0 5 2 8 || fail "fake-trainer" "beta"
bash tests/dashboard/fake-trainer.sh "$OUT/runs/alpha" 60 0.15 5 3 8 &
PIDS+=($!); WRITER=$!
G=$OUT/runs/gamma
mkdir -p "$G"
printf '{"format":"k3-run","version":1,"status":"running","step":2,"total_steps":10,"started_at":1,"updated_at":1,"latest":null,"latest_eval":null}\n' >"$G/state.json"
printf '{"kind":"train","step":1,"time":1.5,"train_loss":5.0,"lr":0.001}\nthis is not json\n{"kind":"train","step":2,"time":2.5,"train_lo' >"$G/metrics.jsonl"
echo TOPSECRET >"$OUT/outside/secret.txt"
ln -s ../../outside/secret.txt "$G/secret.txt"
ln -s /etc/hostname "$G/hostname.txt"
mkdir "$G/sub.json"
echo hidden >"$G/.hidden.txt"
echo weights >"$G/latest.safetensors"
echo notes >"$G/notes.txt"
D=$OUT/runs/delta # state.json is a symlink to a file outside the run
mkdir -p "$D"
printf '{"status":"finished","step":99,"secret":"TOPSECRET"}\n' >"$OUT/outside/state.json"
ln -s ../../outside/state.json "$D/state.json"
: >"$D/metrics.jsonl"
mkdir -p "$OUT/outside/linked"
printf '{"status":"finished","step":1}\n' >"$OUT/outside/linked/state.json"
ln -s ../outside/linked "$OUT/runs/linked" # a symlinked run directory: not listed
E=$OUT/runs/epsilon # a trainer that rounds its times to 10 s: timing from step_time_s
mkdir -p "$E"
now=$(date +%s)
printf '{"status":"running","step":5,"total_steps":105,"started_at":%d0,"updated_at":%d0}\n' "$((now / 10))" "$((now / 10))" >"$E/state.json"
for s in 1 2 3 4 5; do
  printf '{"kind":"train","step":%d,"time":%d0,"train_loss":3,"step_time_s":0.%d}\n' "$s" "$((now / 10))" "$((s == 3 ? 9 : 5))"
done >"$E/metrics.jsonl"
Z=$OUT/runs/zeta # "running", fresh, but its trainer process (on this machine) is gone
mkdir -p "$Z"
for ph in eval train; do # 100 s without a write: fine in an evaluation, stale in training
  mkdir -p "$OUT/runs/quiet-$ph"
  printf '{"status":"running","step":3,"total_steps":9,"updated_at":%d,"phase":"%s"}\n' "$((now - 100))" "$ph" >"$OUT/runs/quiet-$ph/state.json"
done
true & gone=$!; wait "$gone"
printf '{"status":"running","step":1,"total_steps":9,"updated_at":%s,"pid":%d,"hostname":"%s"}\n' "$(date +%s.%N)" "$gone" "$(hostname)" >"$Z/state.json"
sleep 0.5

start_dash() { # LOG ARGS...: starts k3 dashboard on a free port; sets DPID and PORT
  local log=$1; shift
  start_server "$log" "$K3" dashboard --port 0 "$@"; local rc=$?
  DPID=$SERVER_PID; PORT=$SERVER_PORT
  return $rc
}
if ! start_dash "$OUT/server.log" --run-dir "$OUT/runs" --stale-after 30; then
  fail "start" "$(cat "$OUT/server.log" "$OUT/server.log.err")"; finish; exit 1
fi
pass "start (port $PORT)"

get() { # PATH [CURL ARGS...]: sets CODE and CTYPE, body in $OUT/body, headers in $OUT/headers
  local p=$1; shift
  local res
  res=$(curl -s --max-time 60 --path-as-is -o "$OUT/body" -D "$OUT/headers" -w '%{http_code}|%{content_type}' "$@" "http://127.0.0.1:$PORT$p")
  CODE=${res%%|*}; CTYPE=${res#*|}
}
ok() { # NAME TEST...: pass if TEST succeeds, else fail with the last response
  local n=$1; shift
  if "$@"; then pass "$n"; else fail "$n" "code=$CODE type=$CTYPE body=$(head -c 240 "$OUT/body" | tr '\n' ' ')"; fi
}
body_has() { grep -qF -- "$1" "$OUT/body"; }
body_lacks() { ! grep -qF -- "$1" "$OUT/body"; }
nrec() { grep -o '"step":[0-9]*' "$OUT/body" | wc -l; }
steps() { grep -o '"step":[0-9]*' "$OUT/body" | cut -d: -f2 | tr '\n' ' '; }
is() { [ "$1" = "$2" ]; }

# ---- the page and its assets ----
get /;            ok page         is "$CODE $CTYPE" "200 text/html; charset=utf-8"
ok page-content   body_has '<svg id="loss-chart"'
ok page-csp       grep -qi '^Content-Security-Policy: default-src' "$OUT/headers"
ok page-nosniff   grep -qi '^X-Content-Type-Options: nosniff' "$OUT/headers"
get /app.js;      ok app-js       is "$CODE $CTYPE" "200 text/javascript; charset=utf-8"
# the page embedded at build time is byte for byte the one in src/web/assets/
cmp -s "$OUT/body" src/web/assets/app.js && pass app-js-is-source || fail app-js-is-source "differs from src/web/assets/app.js"
get /style.css;   ok style-css    is "$CODE $CTYPE" "200 text/css; charset=utf-8"
cmp -s "$OUT/body" src/web/assets/style.css && pass style-css-is-source || fail style-css-is-source "differs from src/web/assets/style.css"
get /favicon.svg; ok favicon      is "$CODE $CTYPE" "200 image/svg+xml"
get / -I;         ok head         is "$CODE" 200
get /nothing;     ok unknown-404  is "$CODE" 404
get /index.html;  ok no-aliases   is "$CODE" 404

# ---- runs ----
get /api/runs
ok runs           is "$CODE $CTYPE" "200 application/json; charset=utf-8"
ok runs-list      body_has '"name":"alpha"'
ok runs-list2     body_has '"name":"beta"'
ok runs-gamma     body_has '"name":"gamma"'
ok runs-no-link   body_lacks '"name":"linked"'
get "/api/state?run=nope";   ok unknown-run  is "$CODE" 404
get "/api/state?run=../runs/beta"; ok run-no-path is "$CODE" 404
get "/api/state?run=%2e%2e"; ok run-dotdot   is "$CODE" 404
get "/api/state";            ok default-run  body_has '"run":"alpha"'

# ---- state ----
get "/api/state?run=beta"
ok state-beta     is "$CODE" 200
ok state-finished body_has '"status":"finished"'
ok state-step     body_has '"step":6,"total_steps":6'
ok state-derived  body_has '"dashboard":{"run":"beta"'
ok state-loads    body_has '"expert_load":[{"layer":0'
get "/api/state?run=alpha"
ok state-running  body_has '"status":"running"'
ok state-eta      grep -qE '"eta_s":[0-9]' "$OUT/body"
get "/api/state?run=gamma"
ok state-stale    body_has '"status":"stale"'
ok state-badline  body_has '"metrics_bad_lines":1'
get "/api/state?run=epsilon"
ok timing-median  grep -qE '"sec_per_step":0.5(0*)?,' "$OUT/body"
ok timing-eta     grep -qE '"eta_s":58(\.0*)?,' "$OUT/body"  # 100 steps x mean 0.58 s (times span < 60 s)
get "/api/state?run=quiet-eval";  ok quiet-eval-running body_has '"status":"running","stale":false'
get "/api/state?run=quiet-train"; ok quiet-train-stale  body_has '"status":"stale","stale":true'
get "/api/state?run=zeta"
ok stale-pid-gone body_has "\"stale_reason\":\"trainer process $gone is gone\""
get "/api/state?run=delta"
ok symlink-state  body_lacks TOPSECRET
ok symlink-state-reported body_has 'symbolic link'

# ---- metrics and since= ----
get "/api/metrics?run=beta"
ok metrics-all    is "$(nrec) $CODE" "9 200"  # steps 1-6 + evals at 0, 5, 6
ok metrics-no-loads body_lacks expert_load
get "/api/metrics?run=beta&since=4"
ok since-4        is "$(steps)" "5 5 6 6 "
get "/api/metrics?run=beta&since=6"
ok since-end      is "$(tr -d '\n' <"$OUT/body")" "[]"
get "/api/metrics?run=beta&since=4&limit=1"
ok limit-keeps-step is "$(steps)" "5 5 "     # never splits a step's train and eval records
for bad in abc -2 1e3 "" 99999999999999999999999; do
  get "/api/metrics?run=beta&since=$bad"; ok "since-invalid[$bad]" is "$CODE" 400
done
get "/api/metrics?run=beta&limit=0"; ok limit-invalid is "$CODE" 400

# partial last line: only the complete records; the rest once it is written
get "/api/metrics?run=gamma"
ok partial-line   is "$(steps)" "1 "
printf 'ss":4.0}\n' >>"$G/metrics.jsonl"
get "/api/metrics?run=gamma"
ok partial-completed is "$(steps)" "1 2 "
get "/api/metrics?run=gamma&since=1"
ok partial-since  is "$(steps)" "2 "
# replaced (a resumed run rewrites it) and truncated in place
printf '{"kind":"train","step":1,"time":9,"train_loss":7.0}\n' >"$G/m.tmp" && mv "$G/m.tmp" "$G/metrics.jsonl"
get "/api/metrics?run=gamma"
ok replaced       body_has '"train_loss":7.0'
ok replaced-count is "$(steps)" "1 "
: >"$G/metrics.jsonl"; printf '{"kind":"eval","step":3,"val_loss":2.5}\n' >>"$G/metrics.jsonl"
get "/api/metrics?run=gamma"
ok truncated      is "$(steps)" "3 "
# corrupt state.json: the last good one is kept and the problem reported
printf '{"status": "runn' >"$G/state.json"
get "/api/state?run=gamma"
ok corrupt-state  body_has 'state.json:'
ok corrupt-kept   body_has '"total_steps":10'

# ---- samples ----
get "/api/samples?run=beta"
ok samples        is "$(steps)" "0 5 6 "
ok samples-text   body_has 'Once upon a time (step 6)'
get "/api/samples?run=beta&limit=1"
ok samples-newest is "$(steps)" "6 "

# ---- files inside the run directory only ----
get "/files/loss.svg?run=beta"
ok file-svg       is "$CODE $CTYPE" "200 image/svg+xml"
ok file-sandbox   grep -qi '^Content-Security-Policy:.*sandbox' "$OUT/headers"
get "/files/notes.txt?run=gamma";          ok file-txt is "$CODE $CTYPE" "200 text/plain; charset=utf-8"
for p in "/files/../../../../etc/passwd" "/files/%2e%2e/%2e%2e/%2e%2e/etc/passwd" "/files/..%2f..%2f..%2fetc%2fpasswd" \
         "/files/%2e%2e%2fstate.json" "/files//etc/passwd" "/files/%2fetc%2fpasswd" "/files/%252e%252e%252fetc%252fpasswd" \
         "/api/../files/state.json" "/files/./state.json" "/files/" "/files" "/etc/passwd" "//etc/passwd" \
         "/files/secret.txt" "/files/hostname.txt" "/files/sub.json" "/files/.hidden.txt" \
         "/files/latest.safetensors" "/files/..%5c..%5cetc%5cpasswd" "/files/%00" ; do
  get "$p?run=gamma"
  ok "refused[$p]" is "$CODE" 404
  if grep -q 'root:' "$OUT/body" || grep -q TOPSECRET "$OUT/body"; then fail "leak[$p]" "$(head -c 100 "$OUT/body")"; fi
done

# ---- malformed and hostile requests ----
raw() { printf "$1" | timeout 10 "$CLIENT" "$PORT" raw >"$OUT/raw" 2>&1; head -n 1 "$OUT/raw" | tr -d '\r'; }
rawok() { # NAME REQUEST EXPECTED-STATUS-REGEX
  local line; line=$(raw "$2")
  if [[ "$line" =~ $3 ]]; then pass "$1"; else fail "$1" "got '$line'"; fi
}
rawok raw-garbage   'GARBAGE\r\n\r\n'                                         '^(HTTP/1.1 4[0-9][0-9] .*|)$'
rawok raw-bad-host  'GET /api/runs HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n'    '^HTTP/1.1 403'
rawok raw-host-ok   'GET /api/runs HTTP/1.1\r\nHost: localhost:1\r\nConnection: close\r\n\r\n'     '^HTTP/1.1 200'
rawok raw-http10    'GET /api/runs HTTP/1.0\r\n\r\n'                          '^HTTP/1.[01] 200'
rawok raw-post      'POST /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello' '^HTTP/1.1 405'
rawok raw-put       'PUT /files/x.txt HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc' '^HTTP/1.1 405'
rawok raw-version   'GET / HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n'               '^(HTTP/1.1 (400|505) .*|)$'
rawok raw-get-body  'GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 4\r\n\r\nabcd' '^HTTP/1.1 200'
# the declared 99,999,999,999,999-byte body never comes: the server discards
# what arrives and waits for the rest (up to its 15 s connection timeout), so
# nothing comes back within the client's 2 s of silence. Refusing the length
# at once (413) would be right too; any other status means it answered a
# request whose body it had not read.
rawok raw-huge-clen 'GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999999999\r\n\r\nabc' '^(HTTP/1.1 413 .*|)$'
rawok raw-truncated 'GET /api/st'                                             '^$'
rawok raw-bad-escape 'GET /files/%%zz%%00%%ff?run=gamma HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' '^HTTP/1.1 4[0-9][0-9]'
long=$(head -c 20000 /dev/zero | tr '\0' 'a')
rawok raw-long-url  "GET /$long HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"         '^HTTP/1.1 414'
# a head within 32 KiB is served; one over it is refused (431)
rawok raw-long-hdr-ok "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: $long\r\n\r\n" '^HTTP/1.1 200'
rawok raw-long-hdr  "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: $long$long\r\n\r\n" '^HTTP/1.1 431'
many=$(for i in $(seq 3000); do printf 'X-H%d: v\\r\\n' "$i"; done)
rawok raw-many-hdrs "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n$many\r\n"         '^HTTP/1.1 431'
head -c 8192 /dev/urandom >"$OUT/junk"
timeout 10 "$CLIENT" "$PORT" raw <"$OUT/junk" >/dev/null 2>&1
get /api/runs
ok alive-after-malformed is "$CODE" 200
kill -0 "$DPID" 2>/dev/null && pass "still-running" || fail "still-running" "server died"

# ---- reading while the trainer writes: state.json replaced, partial lines ----
okc=0
for i in $(seq 30); do
  get "/api/state?run=alpha"
  if [ "$CODE" = 200 ] && grep -q '"status":"running"\|"status":"finished"' "$OUT/body"; then okc=$((okc + 1)); fi
  get "/api/metrics?run=alpha&since=$((i / 2))"
  if [ "$CODE" = 200 ] && [ "$(head -c 1 "$OUT/body")" = "[" ]; then okc=$((okc + 1)); fi
  sleep 0.05
done
ok concurrent-reads is "$okc" 60
get "/api/metrics?run=alpha"
last=$(steps | tr ' ' '\n' | sed '/^$/d' | sort -n | tail -n 1)
ok metrics-grow    test "${last:-0}" -gt 3

# ---- load: 10,000 requests; the server's memory must not grow ----
N=10000; WARM=1000
[ "$ASAN" = 1 ] && WARM=300
paths=("/api/state?run=beta" "/api/metrics?run=beta&since=-1" "/api/samples?run=beta" "/" "/app.js"
       "/api/runs" "/files/loss.svg?run=beta" "/api/metrics?run=beta&since=3")
rss() { awk '/^VmRSS/ {print $2}' "/proc/$DPID/status"; }
"$CLIENT" "$PORT" load "$WARM" "${paths[@]}" >/dev/null
r0=$(rss); t0=$(date +%s.%N)
if "$CLIENT" "$PORT" load "$N" "${paths[@]}" >"$OUT/load.txt" 2>&1; then pass "load-$N ($(cat "$OUT/load.txt"))"; else fail "load-$N" "$(head -c 300 "$OUT/load.txt")"; fi
r1=$(rss); t1=$(date +%s.%N)
echo "load: $N requests in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') s; VmRSS $r0 kB -> $r1 kB"
if [ "$ASAN" = 1 ]; then
  echo "(RSS not checked under ASan: its allocator quarantines freed memory)"
elif [ "$((r1 - r0))" -le 1024 ]; then pass "load-rss-flat (+$((r1 - r0)) kB)"
else fail "load-rss-flat" "VmRSS grew from $r0 kB to $r1 kB"; fi

# ---- several explicit run directories, same base name ----
mkdir -p "$OUT/solo/a/run" "$OUT/solo/b/run"
cp "$OUT/runs/beta/state.json" "$OUT/solo/a/run/"; cp "$OUT/runs/beta/state.json" "$OUT/solo/b/run/"
MAIN_PORT=$PORT MAIN_PID=$DPID
if start_dash "$OUT/server2.log" --run-dir "$OUT/solo/a/run" --run-dir "$OUT/solo/b/run/"; then
  get /api/runs
  ok two-runs body_has '"name":"run~2"'
  kill -0 "$DPID" 2>/dev/null || fail "two-runs-alive" "server exited: $(cat "$OUT/server2.log" "$OUT/server2.log.err" | head -c 400)"
  # the port is taken: a clear one-line error
  expect_exit port-in-use 1 timeout 30 "$K3" dashboard --run-dir "$OUT/runs" --port "$PORT"
  expect_err_contains port-in-use "cannot listen"
  stop_wait "$DPID" TERM
  ok sigterm-exit0 is "$RC" 0
else
  fail "start-two" "$(cat "$OUT/server2.log.err")"
fi

# ---- an empty directory (the trainer has not written yet): shown as a run ----
mkdir -p "$OUT/empty/new-run"
if start_dash "$OUT/server3.log" --run-dir "$OUT/empty/new-run"; then
  get /api/runs
  ok empty-run-listed body_has '"name":"new-run"'
  stop_wait "$DPID" TERM
  ok empty-run-exit0 is "$RC" 0
else
  fail "empty-run-start" "$(cat "$OUT/server3.log.err")"
fi

# ---- slow clients: a request's headers (or a GET's body) that trickle past
# --request-timeout are cut off while others are answered; one address holds
# at most --client-connections connections. HTTP libmicrohttpd would take (or
# answer with its own HTML page): the dashboard's own error object ----
expect_exit dash-bad-timeout 2 "$K3" dashboard --run-dir "$OUT/runs" --request-timeout 0
expect_exit dash-bad-conns 2 "$K3" dashboard --run-dir "$OUT/runs" --client-connections 0
if start_dash "$OUT/server4.log" --run-dir "$OUT/runs" --request-timeout 2 --client-connections 4; then
  for what in headers body; do
    python3 tests/cli/raw_http.py "$PORT" trickle $what /api/runs >"$OUT/trickle-$what.out" 2>&1 &
    TP=$!
    sleep 0.5
    get /api/runs
    ok "slow-$what-others-served" is "$CODE" 200
    wait "$TP"
    t=$(sed -nE 's/^closed ([0-9.]+)$/\1/p' "$OUT/trickle-$what.out")
    if [ -n "$t" ] && python3 -c "import sys; sys.exit(not (1.5 <= float('$t') <= 6))"; then pass "slow-$what-dropped"
    else fail "slow-$what-dropped" "$(cat "$OUT/trickle-$what.out")"; fi
  done
  check per-client-limit "$(python3 tests/cli/raw_http.py "$PORT" perip 4 2>&1)" "last-closed True first-open True"
  get /api/runs
  ok per-client-after is "$CODE" 200
  for c in dash-version-1.7:505 dash-uri-20k:414 dash-header-100k:431 dash-header-300k:431 dash-version-2.0:505 \
           dash-chunk-bad:400; do
    check "http-${c%%:*}" "$(python3 tests/cli/raw_http.py "$PORT" ask "${c%%:*}" 2>&1)" "1 ${c##*:} application/json msg"
  done
  stop_wait "$DPID" TERM
  ok slow-exit0 is "$RC" 0
else
  fail "slow-start" "$(cat "$OUT/server4.log.err")"
fi
PORT=$MAIN_PORT DPID=$MAIN_PID

# ---- a non-loopback address warns ----
"$K3" dashboard --run-dir "$OUT/runs" --host 0.0.0.0 --port 0 >"$OUT/any.out" 2>"$OUT/any.err" &
APID=$!; PIDS+=($APID)
for _ in $(seq 100); do grep -q http "$OUT/any.out" && break; sleep 0.1; done
stop_wait "$APID" INT
ok nonloopback-warning grep -q 'warning: listening on 0.0.0.0' "$OUT/any.err"

# ---- Ctrl-C stops cleanly ----
kill "$WRITER" 2>/dev/null; wait "$WRITER" 2>/dev/null
kill -INT "$DPID"
for _ in $(seq 100); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$DPID" 2>/dev/null; then fail "sigint-stops" "still running after 10 s"; else
  wait "$DPID"; rc=$?
  ok sigint-exit0 is "$rc" 0
  ok sigint-message grep -q 'stopped' "$OUT/server.log"
  ok stderr-clean   is "$(cat "$OUT/server.log.err")" ""
fi
finish
