#!/usr/bin/env bash
# k3 serve under mpirun on localhost (expert parallel, 2 ranks, Open MPI
# --oversubscribe): rank 0 answers the same requests with the same bytes as one
# `k3 serve` process (greedy completions, a streamed one, a prompt that extends
# the previous one, which reuses the session's state on every rank; chat turns
# on the same conversation when the chat model can be generated); SIGTERM to
# rank 0 and SIGUSR1 to mpirun stop every rank with exit 0 and leave no
# process (SIGTERM to mpirun: the job ends, bounded, exit Open MPI's); a client
# that goes away during a prefill stops it on every rank at the same chunk; a port rank 0 cannot bind ends the job with one line naming rank 0;
# a follower killed with SIGKILL ends the job (non-zero, mpirun names the rank)
# and one that stops answering is named by rank 0 within K3_DIST_TIMEOUT.
# Every wait is bounded (curl --max-time, counted polling loops).
set -u
. "$(dirname "$0")/lib.sh"
mpi_setup
MODEL=tests/fixtures/trained-5m
PY=/usr/bin/python3
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT
rm -rf "${OUT:?}"/*
MPIRUN="mpirun --oversubscribe --mca btl self,vader"

# rank_pid MPIRUN_PID R: the pid of rank R (the descendant of mpirun with that
# rank: its child in Open MPI 4, a grandchild under a launcher daemon)
rank_pid() {
  local p kids=$1 all=
  for _ in 1 2 3; do kids=$(for p in $kids; do pgrep -P "$p"; done); all="$all $kids"; done
  for p in $all; do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo "$p"; return; }
  done
}
# wait_exit PID SECONDS: sets RC (124: still running after SECONDS, then killed)
wait_exit() {
  local i
  for i in $(seq $(($2 * 10))); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$1" 2>/dev/null; then kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null; RC=124; return; fi
  wait "$1"; RC=$?
}
# no process of the job is left (the rank pids noted at the start) within 5 s:
# the ranks that mpirun ends may outlive it by a moment
none_left() {
  local p i left
  for i in $(seq 50); do
    left=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && left=1; done
    [ $left = 0 ] && return 0; sleep 0.1
  done
  return 1
}
health_ok() { curl -s --max-time 5 "$1health" | grep -q '"status": *"ok"'; }

# post URL PATH BODY OUTFILE: the response body into OUTFILE
post() { curl -s --max-time 60 -H 'Content-Type: application/json' --data-binary "$3" "$1${2#/}" >"$4"; }
jf() { $PY -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>&1; }

# completions TAG URL: the requests, and what they answer (text, usage) in $OUT/TAG.txt
completions() {
  local t=$1 u=$2 a
  post "$u" v1/completions '{"prompt":"Once upon a time","max_tokens":24,"temperature":0}' "$OUT/$t.a.json"
  a=$(jf "$OUT/$t.a.json" 'j["choices"][0]["text"]')
  post "$u" v1/completions "$($PY -c 'import json,sys; print(json.dumps({"prompt": "Once upon a time" + sys.argv[1] + " Then",
    "max_tokens": 16, "temperature": 0}))' "$a")" "$OUT/$t.b.json"
  curl -H 'Content-Type: application/json' -s -N --max-time 60 --data-binary '{"prompt":"The little dog","max_tokens":12,"temperature":0,"stream":true}' \
    "${u}v1/completions" >"$OUT/$t.s.sse"
  {
    echo "a: $a"
    jf "$OUT/$t.a.json" '"a usage:", j["usage"]'
    jf "$OUT/$t.b.json" '"b:", j["choices"][0]["text"], j["usage"]'
    $PY -c 'import json,sys
out = []
for l in open(sys.argv[1]):
    if l.startswith("data: {"):
        out += [c.get("text", "") for c in json.loads(l[6:])["choices"]]
print("stream:", "".join(out))' "$OUT/$t.s.sse"
  } >"$OUT/$t.txt"
}

# chat TAG URL: two turns of one conversation, the second re-sending the first reply
chat() {
  local t=$1 u=$2
  post "$u" v1/chat/completions '{"messages":[{"role":"user","content":"Hello there"}],"max_tokens":10,"temperature":0}' \
    "$OUT/$t.c1.json"
  local body; body=$($PY -c 'import json,sys
r = json.load(open(sys.argv[1]))["choices"][0]["message"]
m = {"role": "assistant", "content": r.get("content") or ""}
if r.get("reasoning_content"): m["reasoning_content"] = r["reasoning_content"]
print(json.dumps({"messages": [{"role": "user", "content": "Hello there"}, m, {"role": "user", "content": "And again?"}],
                  "max_tokens": 10, "temperature": 0}))' "$OUT/$t.c1.json" 2>&1)
  post "$u" v1/chat/completions "$body" "$OUT/$t.c2.json"
  { jf "$OUT/$t.c1.json" '"c1:", j["choices"][0]["message"], j["usage"]'
    jf "$OUT/$t.c2.json" '"c2:", j["choices"][0]["message"], j["usage"]'; } >"$OUT/$t.chat.txt"
}

# ---- one process: the reference ---------------------------------------------------
if ! start_server "$OUT/one.log" "$K3" serve "$MODEL" --port 0; then
  fail one:start "$(head -c 300 "$OUT/one.log.err")"; finish; exit
fi
completions one "$SERVER_URL"
kill -TERM "$SERVER_PID"; wait_exit "$SERVER_PID" 20
[ "$RC" = 0 ] && pass one:stop || fail one:stop "exit $RC"
# the reference must say something, or the comparison below proves nothing
grep -q '^a: ..' "$OUT/one.txt" && grep -q "'cached_tokens': [1-9]" "$OUT/one.txt" \
  && pass one:answers || fail one:answers "$(head -c 300 "$OUT/one.txt")"

# ---- 2 ranks: the same answers; SIGTERM to rank 0 ends every rank with 0 -----------
if ! start_server "$OUT/np2.log" $MPIRUN -q -np 2 "$K3" serve "$MODEL" --port 0; then
  fail np2:start "$(head -c 300 "$OUT/np2.log.err")"; finish; exit
fi
MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
grep -q 'expert parallel over 2 ranks' "$OUT/np2.log" && pass np2:start || fail np2:start "$(head -c 300 "$OUT/np2.log")"
health_ok "$SERVER_URL" && pass np2:health || fail np2:health
completions np2 "$SERVER_URL"
cmp -s "$OUT/one.txt" "$OUT/np2.txt" && pass np2:same-answers \
  || fail np2:same-answers "$(diff "$OUT/one.txt" "$OUT/np2.txt" | head -c 400)"
[ -n "$R0" ] && [ -n "$R1" ] && kill -TERM "$R0"
wait_exit "$MP" 30
[ "$RC" = 0 ] && pass np2:sigterm-rank0-exit-0 || fail np2:sigterm-rank0-exit-0 "mpirun exit $RC: $(head -c 300 "$OUT/np2.log.err")"
none_left "$R0" "$R1" && pass np2:no-process-left || fail np2:no-process-left
grep -q '^k3 serve: stopped' "$OUT/np2.log" && pass np2:stopped-line || fail np2:stopped-line

# SIGTERM to mpirun: Open MPI forwards it and ends the job a second later (exit 1,
# its own), so the job ends, bounded, and leaves no process
if start_server "$OUT/term.log" $MPIRUN -q -np 2 "$K3" serve "$MODEL" --port 0; then
  MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
  kill -TERM "$MP"
  wait_exit "$MP" 20
  [ "$RC" != 124 ] && pass sigterm-mpirun:ends || fail sigterm-mpirun:ends "still running after 20 s"
  none_left "$R0" "$R1" && pass sigterm-mpirun:no-process-left || fail sigterm-mpirun:no-process-left
else
  fail sigterm-mpirun:start "$(head -c 300 "$OUT/term.log.err")"
fi

# ---- chat turns (a generated chat model), stopped with SIGUSR1 to mpirun ------------
if $PY -c 'import numpy' 2>/dev/null; then
  CM=tests/out/mpi-chat-model   # test_mpi.sh's: the full Kimi vocabulary, 8 experts top-2
  chat_model $CM 3
  if start_server "$OUT/chat1.log" "$K3" serve "$CM" --port 0; then
    chat one "$SERVER_URL"
    kill -TERM "$SERVER_PID"; wait_exit "$SERVER_PID" 20
  fi
  grep -q "^('c2:'.*'cached_tokens': [1-9]" "$OUT/one.chat.txt" 2>/dev/null && pass chat-one:answers \
    || fail chat-one:answers "$(head -c 300 "$OUT/one.chat.txt" "$OUT/chat1.log.err" 2>&1)"
  if start_server "$OUT/chat2.log" $MPIRUN -q -np 2 "$K3" serve "$CM" --port 0; then
    MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
    chat np2 "$SERVER_URL"
    cmp -s "$OUT/one.chat.txt" "$OUT/np2.chat.txt" && pass chat-np2:same-turns \
      || fail chat-np2:same-turns "$(diff "$OUT/one.chat.txt" "$OUT/np2.chat.txt" | head -c 400)"
    kill -USR1 "$MP"
    wait_exit "$MP" 30
    [ "$RC" = 0 ] && pass chat-np2:sigusr1-mpirun-exit-0 || fail chat-np2:sigusr1-mpirun-exit-0 "mpirun exit $RC"
    none_left "$R0" "$R1" && pass chat-np2:no-process-left || fail chat-np2:no-process-left
  else
    fail chat-np2:start "$(head -c 300 "$OUT/chat2.log.err")"
  fi
else
  skip chat "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
fi

# ---- batched serving (--parallel 4): every rank follows each batched pass ----------------
# Four mixed requests sent at once (chat greedy with logprobs, one id favoured
# by logit_bias so that its reply repeats and n-gram drafts are accepted, a long completion
# sampled with a seed whose prefill goes chunk by chunk between the others'
# steps, a streamed sampled chat with usage, two seeded completion choices)
# each get the bytes they get alone from one --parallel 1 process; at 2 ranks
# plain and speculating (n-gram), at 3 ranks plain and with split experts; then a follower killed
# while a batch computes ends the job, mpirun naming it.
if $PY -c 'import numpy' 2>/dev/null; then
  CM=tests/out/mpi-chat-model
  chat_model $CM 3
  $PY - "$OUT/breqs.json" <<'PY'
import json, sys
long = " ".join("The %d little foxes ran over the hill to find berries." % i for i in range(30))
reqs = [
  dict(name="chat-greedy", kind="chat", body=dict(messages=[{"role": "user", "content": "Hello, who are you?"}],
       max_tokens=16, temperature=0, logprobs=True, top_logprobs=2, logit_bias={"2000": 10})),
  dict(name="compl-long-seeded", kind="completions", body=dict(prompt=long, max_tokens=16, temperature=0.9, seed=11,
       top_k=40)),
  dict(name="chat-stream", kind="chat", body=dict(messages=[{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "Tell me a story about a cat."}], max_tokens=16, temperature=0.8, seed=5,
       stream=True, stream_options={"include_usage": True})),
  dict(name="compl-n2", kind="completions", body=dict(prompt="Once upon a time", max_tokens=12, temperature=0.7,
       seed=3, n=2)),
]
json.dump(reqs, open(sys.argv[1], "w"))
# the kill round: long replies, so the batch still computes when a rank dies
json.dump([dict(r, body=dict(r["body"], max_tokens=400)) for r in reqs], open(sys.argv[1].replace(".json", "-kill.json"), "w"))
PY
  BNAMES="chat-greedy compl-long-seeded chat-stream compl-n2"
  BCOMMON="--port 0 --chunk 8 --threads 1 --ctx 1024"
  DRIVE="timeout 300 $PY tests/cli/serve_batch_drive.py"
  metric() { curl -s --max-time 10 "$1metrics" | sed -nE "s/^$2 ([0-9.e+]+)$/\1/p"; }
  # batch TAG MODE CMD...: starts CMD, sends the requests (MODE alone or together)
  # into $OUT/TAG/, keeps the drafts proposed in DRAFTS, stops it (SIGTERM to rank 0)
  batch() {
    local tag=$1 mode=$2; shift 2
    mkdir -p "$OUT/$tag"
    if ! start_server "$OUT/$tag.log" "$@"; then fail "$tag:start" "$(head -c 300 "$OUT/$tag.log.err")"; return 1; fi
    local mp=$SERVER_PID r0; r0=$(rank_pid "$mp" 0); [ -n "$r0" ] || r0=$mp
    $DRIVE "${SERVER_URL%/}" "$mode" "$OUT/$tag" "$OUT/breqs.json" || fail "$tag:drive"
    DRAFTS=$(metric "$SERVER_URL" k3_drafts_proposed_total)
    kill -TERM "$r0"; wait_exit "$mp" 30
    [ "$RC" = 0 ] && pass "$tag:stop-exit-0" || fail "$tag:stop-exit-0" "exit $RC: $(tail -c 300 "$OUT/$tag.log.err")"
  }
  # same TAG: every response of TAG is the one-process reference's
  same() {
    local bad= n
    for n in $BNAMES; do cmp -s "$OUT/balone/$n.txt" "$OUT/$1/$n.txt" || bad="$bad $n"; done
    if [ -z "$bad" ]; then pass "$1:same-bytes-as-alone"; else
      n=${bad# }; n=${n%% *}
      fail "$1:same-bytes-as-alone" "differs:$bad; $n: $(diff "$OUT/balone/$n.txt" "$OUT/$1/$n.txt" 2>&1 | head -c 400)"
    fi
    grep -q '4 slots' "$OUT/$1.log" && pass "$1:4-slots" || fail "$1:4-slots" "$(head -c 300 "$OUT/$1.log")"
  }
  batch balone alone "$K3" serve $CM $BCOMMON --parallel 1
  grep -q '^status 200' "$OUT/balone/compl-n2.txt" && grep -q '"finish_reason"' "$OUT/balone/chat-stream.txt" \
    && pass balone:answers || fail balone:answers "$(head -c 300 "$OUT/balone/compl-n2.txt")"
  batch bnp2 together $MPIRUN -q -np 2 "$K3" serve $CM $BCOMMON --parallel 4
  same bnp2
  grep -q 'over 2 ranks' "$OUT/bnp2.log" && pass bnp2:ranks || fail bnp2:ranks "$(head -c 300 "$OUT/bnp2.log")"
  batch bnp2-spec together $MPIRUN -q -np 2 "$K3" serve $CM $BCOMMON --parallel 4 --speculate 4
  same bnp2-spec
  [ -n "$DRAFTS" ] && [ "${DRAFTS%%.*}" -gt 0 ] && pass "bnp2-spec:drafted ($DRAFTS)" || fail bnp2-spec:drafted "proposed '$DRAFTS'"
  batch bnp3 together $MPIRUN -q -np 3 "$K3" serve $CM $BCOMMON --parallel 4
  same bnp3
  # split experts (--parallel-layout tp): every rank computes its rows of every expert
  batch bnp3-split together $MPIRUN -q -np 3 "$K3" serve $CM $BCOMMON --parallel 4 --parallel-layout tp
  same bnp3-split
  grep -q 'trunk and experts split over 3 ranks' "$OUT/bnp3-split.log" && pass bnp3-split:layout \
    || fail bnp3-split:layout "$(head -c 300 "$OUT/bnp3-split.log")"

  # a follower killed (SIGKILL) while four requests compute in one batch
  if start_server "$OUT/bkill.log" $MPIRUN -np 2 "$K3" serve $CM $BCOMMON --parallel 4; then
    MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
    mkdir -p "$OUT/bkill"
    timeout 60 $PY tests/cli/serve_batch_drive.py "${SERVER_URL%/}" together "$OUT/bkill" "$OUT/breqs-kill.json" \
      >/dev/null 2>&1 &
    DR=$!
    busy=0
    for _ in $(seq 300); do
      busy=$(curl -s --max-time 5 "${SERVER_URL}health" | sed -nE 's/.*"busy": *([0-9]+).*/\1/p')
      [ -n "$busy" ] && [ "$busy" -ge 3 ] && break; sleep 0.05
    done
    [ -n "$busy" ] && [ "$busy" -ge 3 ] && pass "bkill:batch-running ($busy slots busy)" || fail bkill:batch-running "busy '$busy'"
    kill -9 "$R1"
    wait_exit "$MP" 20
    [ "$RC" != 0 ] && [ "$RC" != 124 ] && pass bkill:exit || fail bkill:exit "exit $RC"
    grep -q 'process rank 1 .* exited on signal 9' "$OUT/bkill.log.err" && pass bkill:named \
      || fail bkill:named "$(head -c 300 "$OUT/bkill.log.err")"
    none_left "$R0" "$R1" && pass bkill:no-process-left || fail bkill:no-process-left
    wait "$DR" 2>/dev/null
  else
    fail bkill:start "$(head -c 300 "$OUT/bkill.log.err")"
  fi
else
  skip batch "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
fi

# ---- a client gone during a long prefill: every rank stops at the same chunk ----------
# (one token a forward call, so the prefill lasts seconds); the same request again
# continues from exactly the tokens the cut consumed and gives a cold `k3 run`'s text
$PY -c 'print("Once upon a time there was a little dog. " * 120, end="")' >"$OUT/long.txt"
$PY -c 'import json, sys
p = open(sys.argv[1] + "/long.txt").read()
for name, extra in (("long-stream", {"stream": True}), ("long-plain", {})):
    json.dump(dict(prompt=p, max_tokens=8, temperature=0, **extra), open(f"{sys.argv[1]}/{name}.json", "w"))' "$OUT"
"$K3" run "$MODEL" --prompt-file "$OUT/long.txt" --gen 8 --quiet --out "$OUT/long-cold.json" 2>"$OUT/long-cold.err"
want=$(jf "$OUT/long-cold.json" 'j["text"]')
if start_server "$OUT/cut.log" $MPIRUN -q -np 2 "$K3" serve "$MODEL" --port 0 --ctx 4096 --chunk 1 --max-body 1M; then
  MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
  curl -H 'Content-Type: application/json' -s -N --max-time 60 --data-binary "@$OUT/long-stream.json" "${SERVER_URL}v1/completions" >"$OUT/cut.sse" &
  CURL=$!
  for _ in $(seq 500); do [ "$(serve_state "${SERVER_URL%/}" | cut -d' ' -f1,2)" = "0 True" ] && break; sleep 0.02; done
  sleep 0.3
  kill -9 "$CURL" 2>/dev/null; wait "$CURL" 2>/dev/null
  for _ in $(seq 200); do [ "$(serve_state "${SERVER_URL%/}" | cut -d' ' -f1,2)" = "1 False" ] && break; sleep 0.05; done
  K=$(sed -nE 's/.*cancelled after ([0-9]+) of ([0-9]+) prompt tokens.*/\1/p' "$OUT/cut.log.err" | tail -n 1)
  [ -n "$K" ] && pass "cut:during-prefill ($K tokens)" || fail cut:during-prefill "$(tail -c 300 "$OUT/cut.log.err")"
  # the whole prompt again, one token a call: generous on a loaded 2-core machine
  curl -s --max-time 300 -H 'Content-Type: application/json' --data-binary "@$OUT/long-plain.json" \
    "${SERVER_URL}v1/completions" >"$OUT/again.json"
  got=$(jf "$OUT/again.json" 'j["choices"][0]["text"]')
  cached=$(jf "$OUT/again.json" 'j["usage"]["prompt_tokens_details"]["cached_tokens"]')
  [ -n "$want" ] && [ "$got" = "$want" ] && pass cut:again-equals-cold || fail cut:again-equals-cold "got '$got', wanted '$want'"
  [ -n "$K" ] && [ "$cached" = "$K" ] && pass cut:continues-from-the-cut || fail cut:continues-from-the-cut "cached $cached, cut at $K"
  kill -TERM "$R0"; wait_exit "$MP" 30
  [ "$RC" = 0 ] && pass cut:stop-exit-0 || fail cut:stop-exit-0 "exit $RC"
else
  fail cut:start "$(head -c 300 "$OUT/cut.log.err")"
fi

# ---- faults ----------------------------------------------------------------------------
# rank 0 cannot listen (the port is taken): one line naming rank 0, every rank ends
$PY -c 'import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1); print(s.getsockname()[1], flush=True); time.sleep(60)' \
  >"$OUT/port" &
PIDS+=($!)
for _ in $(seq 50); do [ -s "$OUT/port" ] && break; sleep 0.1; done
expect_exit port-taken 1 timeout 60 $MPIRUN -q -np 2 "$K3" serve "$MODEL" --port "$(cat "$OUT/port")"
expect_err_contains port-taken "rank 0 of 2"

# a follower killed (SIGKILL) while the server idles: the job ends at once, non-zero,
# mpirun's report names the rank
if start_server "$OUT/kill.log" $MPIRUN -np 2 "$K3" serve "$MODEL" --port 0; then
  MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
  kill -9 "$R1"
  wait_exit "$MP" 20
  [ "$RC" != 0 ] && [ "$RC" != 124 ] && pass follower-killed:exit || fail follower-killed:exit "exit $RC"
  grep -q 'process rank 1 .* exited on signal 9' "$OUT/kill.log.err" && pass follower-killed:named \
    || fail follower-killed:named "$(head -c 300 "$OUT/kill.log.err")"
  none_left "$R0" "$R1" && pass follower-killed:no-process-left || fail follower-killed:no-process-left
else
  fail follower-killed:start "$(head -c 300 "$OUT/kill.log.err")"
fi

# a follower that stops answering mid-request: rank 0 names it within K3_DIST_TIMEOUT
if K3_DIST_TIMEOUT=3 K3_DIST_FAULT=hang:1:20 start_server "$OUT/hang.log" $MPIRUN -q -np 2 "$K3" serve "$MODEL" --port 0
then
  MP=$SERVER_PID; R0=$(rank_pid "$MP" 0); R1=$(rank_pid "$MP" 1); PIDS+=($R0 $R1)
  post "$SERVER_URL" v1/completions '{"prompt":"Once upon a time","max_tokens":24,"temperature":0}' "$OUT/hang.json"
  wait_exit "$MP" 30
  [ "$RC" = 1 ] && pass follower-hangs:exit || fail follower-hangs:exit "exit $RC"
  [ "$(grep -c '' "$OUT/hang.log.err")" = 1 ] && grep -q '^k3: rank 0 of 2 .*no answer from rank 1 ' "$OUT/hang.log.err" \
    && pass follower-hangs:one-line || fail follower-hangs:one-line "$(head -c 300 "$OUT/hang.log.err")"
  none_left "$R0" "$R1" && pass follower-hangs:no-process-left || fail follower-hangs:no-process-left
else
  fail follower-hangs:start "$(head -c 300 "$OUT/hang.log.err")"
fi
finish
