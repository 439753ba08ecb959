#!/usr/bin/env bash
# k3 serve --parallel: requests decoding together get exactly what each gets
# alone. A random chat model (full Kimi vocabulary) is served with four slots
# and a small prefill chunk (a long prompt's prefill interleaves with the
# others' decode steps), and with one slot; four mixed requests (chat and
# completions, greedy and seeded sampling with filters and penalties, n=2,
# logprobs, one streamed with usage, one long prompt) sent at once to the
# first must return the bodies and events (ids and timestamps aside) each
# returns sent alone to the second, twice (the second time every prompt is
# cached: cached_tokens per request equal too). Also with the weights streamed
# (--trunk, a tiny --cache-gb), and with one request's client gone after its
# first event (the others unchanged, the cancel counted). /health reports the
# slots, /metrics that the requests shared decode passes (sequences per pass
# above 1 with four slots, exactly 1 with one) (--parallel with --speculate:
# test_speculate_serve.sh; under mpirun: test_mpi_serve.sh).
# Loopback, every wait bounded. About 13 s under the sanitizer on a quiet
# 2-core machine (a stream is read up to its [DONE], not until the server
# closes the kept-alive connection).
# asan
set -u
source tests/cli/lib.sh
kill_pids_at_exit
need_chat_python batch
M=tests/out/chat-model-batch
chat_model $M 9 || { finish; exit 1; }
stop_wait() { # PID: SIGTERM, up to 20 s, then RC (124 after a SIGKILL)
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 200); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null; RC=124; return; fi
  wait "$1"; RC=$?
}
DRIVE="timeout 600 $PY tests/cli/serve_batch_drive.py"
# batch_counts URL: "PASSES SEQUENCES ROWS" of the decode passes (/metrics)
batch_counts() {
  curl -s --max-time 10 "$1/metrics" | awk '$1 == "k3_batch_passes_total" { p = $2 }
    $1 == "k3_batch_sequences_total" { s = $2 } $1 == "k3_batch_rows_total" { r = $2 } END { print p, s, r }'
}

expect_exit help 0 "$K3" serve --help
expect_out_contains help "--parallel N"
expect_exit parallel-zero 2 "$K3" serve $M --parallel 0
expect_exit parallel-word 2 "$K3" serve $M --parallel many

$PY - "$OUT/reqs.json" <<'PY'
import json, sys
long = " ".join("The %d little foxes ran over the hill to find berries." % i for i in range(40))
reqs = [
  dict(name="chat-greedy", kind="chat", body=dict(messages=[{"role": "user", "content": "Hello, who are you?"}],
       max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)),
  dict(name="compl-long-seeded", kind="completions", body=dict(prompt=long, max_tokens=24, temperature=0.9, seed=11,
       top_k=40, presence_penalty=0.5)),
  dict(name="chat-stream", kind="chat", body=dict(messages=[{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Tell me a story about a cat."}], max_tokens=16, temperature=0.8, seed=5,
       top_p=0.9, stream=True, stream_options={"include_usage": True})),
  dict(name="compl-n2", kind="completions", body=dict(prompt="Once upon a time", max_tokens=12, temperature=0.7,
       seed=3, n=2, logprobs=1, frequency_penalty=0.3)),
]
json.dump(reqs, open(sys.argv[1], "w"))
# the cancel round: the streamed request runs long and its client goes away
c = [dict(r) for r in reqs]
c[2] = dict(c[2], name="chat-stream-cut", body=dict(c[2]["body"], max_tokens=400))
json.dump(c, open(sys.argv[1].replace(".json", "-cut.json"), "w"))
PY
NAMES="chat-greedy compl-long-seeded chat-stream compl-n2"
COMMON="--port 0 --chunk 8 --threads 1 --ctx 1024"

# compare_round NAME DIR_A DIR_B: every response of A equals B's
compare_round() {
  local bad=
  for n in $NAMES; do
    [ -f "$2/$n.txt" ] && [ -f "$3/$n.txt" ] && cmp -s "$2/$n.txt" "$3/$n.txt" || bad="$bad $n"
  done
  if [ -z "$bad" ]; then pass "$1"; else
    n=${bad# }; n=${n%% *}
    fail "$1" "differs:$bad; $n: $(diff "$2/$n.txt" "$3/$n.txt" 2>&1 | head -c 400)"
  fi
}

# ---- alone: one slot, each request after the other (twice) ----
start_server "$OUT/alone.log" "$K3" serve $M $COMMON --parallel 1 || { fail start-alone "$(head -c 300 "$OUT/alone.log.err")"; finish; exit 1; }
A=${SERVER_URL%/}; APID=$SERVER_PID
mkdir -p "$OUT/alone1" "$OUT/alone2"
$DRIVE "$A" alone "$OUT/alone1" "$OUT/reqs.json" && $DRIVE "$A" alone "$OUT/alone2" "$OUT/reqs.json" || fail drive-alone
check alone-slots "$(curl -s --max-time 10 "$A/health" | $PY -c 'import json,sys; j=json.load(sys.stdin); print(j["slots"])')" "{'busy': 0, 'total': 1}"
grep -q '^status 200' "$OUT/alone1/compl-n2.txt" && pass alone-answers || fail alone-answers "$(head -c 300 "$OUT/alone1/compl-n2.txt")"
cached() { grep -o '"cached_tokens": [0-9]*' "$1" | head -n 1 | grep -o '[0-9]*$'; }
check alone-first-not-cached "$(cached "$OUT/alone1/chat-greedy.txt")" 0
c=$(cached "$OUT/alone2/compl-long-seeded.txt")
[ -n "$c" ] && [ "$c" -gt 300 ] && pass "alone-second-cached ($c)" || fail alone-second-cached "cached_tokens '$c'"
# one slot: every decode pass feeds one sequence, one id
read -r p q r <<<"$(batch_counts "$A")"
[ -n "$p" ] && [ "$p" -gt 0 ] && [ "$q" = "$p" ] && [ "$r" = "$p" ] && pass "alone-one-sequence-a-pass ($p passes)" \
  || fail alone-one-sequence-a-pass "passes '$p', sequences '$q', rows '$r'"

# ---- together: four slots, all four at once (twice) ----
start_server "$OUT/batch.log" "$K3" serve $M $COMMON --parallel 4 || { fail start-batch "$(head -c 300 "$OUT/batch.log.err")"; finish; exit 1; }
B=${SERVER_URL%/}; BPID=$SERVER_PID
grep -q '4 slots' "$OUT/batch.log" && pass batch-banner || fail batch-banner "$(head -c 300 "$OUT/batch.log")"
# the most slots seen busy at once while the rounds run
( peak=0; for _ in $(seq 3000); do
    b=$(curl -s --max-time 5 "$B/health" | sed -nE 's/.*"busy": *([0-9]+).*/\1/p')
    [ -n "$b" ] && [ "$b" -gt "$peak" ] && peak=$b && echo "$peak" >"$OUT/peak"
    [ -f "$OUT/rounds.done" ] && break; sleep 0.02; done ) &
POLL=$!
rm -f "$OUT/rounds.done" "$OUT/peak"
mkdir -p "$OUT/batch1" "$OUT/batch2" "$OUT/cut"
$DRIVE "$B" together "$OUT/batch1" "$OUT/reqs.json" && $DRIVE "$B" together "$OUT/batch2" "$OUT/reqs.json" || fail drive-batch
touch "$OUT/rounds.done"; wait "$POLL" 2>/dev/null
compare_round together-equals-alone "$OUT/batch1" "$OUT/alone1"
compare_round together-again-equals-alone-again "$OUT/batch2" "$OUT/alone2"
peak=$(cat "$OUT/peak" 2>/dev/null || echo 0)
[ "$peak" -ge 2 ] && pass "requests-overlapped (up to $peak slots busy)" || fail requests-overlapped "at most $peak slot busy"
# the requests shared passes: more sequences than passes (with one pass per
# slot's step it would be 1); each sequence fed one id
read -r p q r <<<"$(batch_counts "$B")"
[ -n "$p" ] && [ "$p" -gt 0 ] && [ "$q" -gt "$p" ] && [ "$r" = "$q" ] \
  && pass "requests-shared-passes ($q sequences in $p passes)" || fail requests-shared-passes "passes '$p', sequences '$q', rows '$r'"
grep -q '^k3_batch_sequences_per_pass_bucket{le="4"} '"$p"'$' <(curl -s --max-time 10 "$B/metrics") \
  && pass per-pass-histogram || fail per-pass-histogram "$(curl -s --max-time 10 "$B/metrics" | grep sequences_per_pass | head -c 400)"
check batch-slots "$(curl -s --max-time 10 "$B/health" | $PY -c 'import json,sys; j=json.load(sys.stdin); print(j["slots"], j["running"])')" "{'busy': 0, 'total': 4} False"

# ---- one client goes away mid-batch: the others unchanged, the cancel counted ----
$DRIVE "$B" cancel:chat-stream-cut "$OUT/cut" "$OUT/reqs-cut.json" || fail drive-cut
NAMES="chat-greedy compl-long-seeded compl-n2" compare_round cut-others-unchanged "$OUT/cut" "$OUT/alone2"
grep -q '^closed' "$OUT/cut/chat-stream-cut.txt" && pass cut-client-closed || fail cut-client-closed "$(head -c 300 "$OUT/cut/chat-stream-cut.txt")"
for _ in $(seq 250); do curl -s --max-time 5 "$B/health" | grep -q '"cancelled": *1' && break; sleep 0.04; done
check cut-counted "$(curl -s --max-time 10 "$B/health" | $PY -c 'import json,sys; j=json.load(sys.stdin); print(j["requests"]["cancelled"], j["slots"]["busy"])')" "1 0"
grep -q 'cancelled: client disconnected' "$OUT/batch.log.err" && pass cut-logged || fail cut-logged "$(tail -c 300 "$OUT/batch.log.err")"
stop_wait "$BPID"; check batch-stop "$RC" 0

# ---- the weights streamed (a packed trunk, a tiny expert cache): the same bytes ----
expect_exit pack 0 "$K3" pack-trunk $M "$OUT/trunk"
start_server "$OUT/stream.log" "$K3" serve $M $COMMON --parallel 4 --trunk "$OUT/trunk" --trunk-gb 0.06 --cache-gb 0.0002 \
  || { fail start-streamed "$(head -c 300 "$OUT/stream.log.err")"; finish; exit 1; }
S=${SERVER_URL%/}; SPID=$SERVER_PID
mkdir -p "$OUT/stream1"
$DRIVE "$S" together "$OUT/stream1" "$OUT/reqs.json" || fail drive-streamed
compare_round streamed-together-equals-alone "$OUT/stream1" "$OUT/alone1"
stop_wait "$SPID"; check streamed-stop "$RC" 0
stop_wait "$APID"; check alone-stop "$RC" 0

finish
