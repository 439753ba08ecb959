#!/usr/bin/env bash
# k3 serve --speculate K [--draft DIR] and the request field "speculate": the
# response bytes are exactly those of a plain server (the reference: a server
# started without speculation, never a value the speculative path computed
# itself), every byte but the response id and the creation time:
#  - chat, three turns of one conversation each re-sending the earlier replies
#    (the later turns reuse the state the earlier ones left; a reply quoting
#    an earlier one is drafted from the rendered conversation), with and
#    without reasoning, greedy and sampled with a seed, with logprobs;
#  - completions greedy (a second prompt extending the first), sampled with
#    n = 2 choices, streamed chat and completions with usage;
#  - n-gram drafts at the server's K and at a request's smaller K, a draft
#    model (here the model itself: greedy drafts the target mostly accepts),
#    and 2 ranks under mpirun (n-gram and the draft model);
#  - four requests sent at once to a --parallel 4 server that speculates
#    (n-gram, and the draft model: one per slot), their verifying passes
#    batched in one pass over the weights (/metrics: more sequences than
#    decode passes) and the slots' drafters sharing the draft model's passes
#    (more drafters fed than passes): each response is the one that request
#    gets alone from a plain --parallel 1 server;
#  - /metrics counts the drafts (some proposed and accepted, none without
#    speculation); bad "speculate" values get 400 naming the field; bad flags
#    exit 2 (--speculate 17, --draft with another tokenizer).
# Servers listen on loopback; every wait is bounded.
# asan
set -u
. "$(dirname "$0")/lib.sh"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
need_chat_python
kill_pids_at_exit
rm -rf "${OUT:?}"/*
M=tests/out/specserve-chat-model
chat_model $M 3 || { finish; exit 1; }
END_ID=$($PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["eos_token_id"])' $M/config.json) # <|im_end|>

# The request set: every response body (streams as their raw events), the
# response id and creation time replaced, one after another in $2.
cat >"$OUT/client.py" <<'PY'
import json, re, sys, urllib.request
url, out, extra, end = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
log = open(out, "wb")

def post(path, body):
    body = dict(body, **extra)
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    raw = urllib.request.urlopen(req, timeout=120).read()
    # an SSE comment comes after 5 s without an event (a slow run): clients skip it
    norm = re.sub(rb'(?m)^: keep-alive\n\n', b'', raw)
    norm = re.sub(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', b'"id":"ID"', norm)
    norm = re.sub(rb'"created":[0-9]+', b'"created":0', norm)
    log.write(norm + b"\n")
    return raw

def conversation(turns, **kw):
    msgs = []
    for q in turns:
        msgs.append({"role": "user", "content": q})
        body = dict({"messages": msgs, "max_tokens": 24}, **kw)
        raw = post("v1/chat/completions", body)
        if kw.get("stream"):
            return
        m = json.loads(raw)["choices"][0]["message"]
        a = {"role": "assistant", "content": m.get("content") or ""}
        if m.get("reasoning_content"): a["reasoning_content"] = m["reasoning_content"]
        msgs.append(a)

say = ["Say one two three four five", "Say one two three four five again", "And once more: one two three four five"]
conversation(say, temperature=0)
conversation(say, temperature=0, reasoning_effort="none")
conversation(say[:2], temperature=0.9, top_k=50, seed=7, reasoning_effort="none")
conversation(say[:2], temperature=0, reasoning_effort="none", logprobs=True, top_logprobs=2)
# replies that end at the end-of-message id (a bias makes it come after a few
# ids), which the state keeps for the next turn: fed after a verifying pass
conversation(say, temperature=0, reasoning_effort="none", logit_bias={end: 6})
conversation(say, temperature=0.8, seed=9, reasoning_effort="none", logit_bias={end: 5})
p = "one two three four five one two three four five one two"
a = json.loads(post("v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0}))["choices"][0]["text"]
post("v1/completions", {"prompt": p + a + " " + p, "max_tokens": 24, "temperature": 0})
post("v1/completions", {"prompt": p, "max_tokens": 20, "temperature": 0.8, "seed": 3, "n": 2})
conversation(say[:1], temperature=0.7, seed=5, stream=True, stream_options={"include_usage": True})
post("v1/completions", {"prompt": p, "max_tokens": 20, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}})
PY

# metric URL NAME: a counter of /metrics
metric() { curl -s --max-time 10 "$1metrics" | sed -nE "s/^$2 ([0-9.e+]+)$/\1/p"; }
post() { req POST "$1$2" -H 'Content-Type: application/json' --data-binary "$3"; }

# run_set TAG EXTRA_JSON CMD...: starts the server CMD, runs the request set
# (EXTRA_JSON merged into every body) into $OUT/TAG.txt, keeps its drafts
# counters in DRAFTS ("PROPOSED ACCEPTED"), and stops it with $STOP_SIG
# (SIGTERM; under mpirun SIGUSR1, which mpirun hands on to rank 0)
STOP_SIG=TERM
run_set() {
  local tag=$1 extra=$2; shift 2
  if ! start_server "$OUT/$tag.log" "$@"; then fail "$tag:start" "$(head -c 300 "$OUT/$tag.log.err")"; return 1; fi
  timeout 300 $PY "$OUT/client.py" "$SERVER_URL" "$OUT/$tag.txt" "$extra" "$END_ID" 2>"$OUT/$tag.client.err" \
    && pass "$tag:requests" || fail "$tag:requests" "$(tail -n 3 "$OUT/$tag.client.err")"
  DRAFTS="$(metric "$SERVER_URL" k3_drafts_proposed_total) $(metric "$SERVER_URL" k3_drafts_accepted_total)"
  kill -$STOP_SIG "$SERVER_PID"
  local i; for i in $(seq 300); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
  wait "$SERVER_PID" && pass "$tag:stop" || fail "$tag:stop" "$(tail -n 3 "$OUT/$tag.log.err")"
}
# same TAG: TAG's responses are the plain server's, byte for byte
same() {
  cmp -s "$OUT/plain.txt" "$OUT/$1.txt" && pass "$1:same" \
    || fail "$1:same" "$(diff <(tr ',' '\n' <"$OUT/plain.txt") <(tr ',' '\n' <"$OUT/$1.txt") | head -c 400)"
}
# drafted TAG: some drafts proposed, some accepted, no more accepted than proposed
drafted() {
  local p a; read -r p a <<<"$DRAFTS"
  [ -n "$p" ] && [ -n "$a" ] && [ "$p" -gt 0 ] && [ "$a" -gt 0 ] && [ "$a" -le "$p" ] && pass "$1:drafted" \
    || fail "$1:drafted" "proposed '$p', accepted '$a'"
}

run_set plain '{}' "$K3" serve $M --port 0
# the reference says something and the later turns reuse state, or the comparisons prove little
[ "$(grep -c '"cached_tokens":[1-9]' "$OUT/plain.txt")" -ge 5 ] && pass plain:reuse \
  || fail plain:reuse "$(head -c 300 "$OUT/plain.txt")"
[ "$(grep -c '"finish_reason":"stop"' "$OUT/plain.txt")" -ge 3 ] && pass plain:stops \
  || fail plain:stops "$(grep -c '"finish_reason":"stop"' "$OUT/plain.txt") replies end at the end-of-message id"
check plain:no-drafts "$DRAFTS" "0 0"
run_set plain-field '{"speculate": 0}' "$K3" serve $M --port 0
same plain-field

run_set ngram '{}' "$K3" serve $M --port 0 --speculate 4
same ngram
drafted ngram
run_set ngram-k2 '{"speculate": 2}' "$K3" serve $M --port 0 --speculate 4 --threads 2
same ngram-k2
drafted ngram-k2
run_set ngram-off '{"speculate": 0}' "$K3" serve $M --port 0 --speculate 4
same ngram-off
check ngram-off:no-drafts "$DRAFTS" "0 0"
run_set draft '{}' "$K3" serve $M --port 0 --draft $M
same draft
drafted draft

# ---- several slots: the verifying passes of concurrent requests in one pass -------------------
# together.py URL OUT MODE: a chat reply and a completion (one after the
# other), then four requests that quote them, so that n-gram drafts find
# their continuations (chat greedy and seeded-sampled, completions greedy, a
# streamed chat), one after another (MODE alone) or all at once (together);
# the normalised bodies (the four's cached_tokens too) in a fixed order in OUT
cat >"$OUT/together.py" <<'PY'
import json, re, sys, threading, urllib.request
url, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def call(path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    raw = urllib.request.urlopen(req, timeout=120).read()
    raw = re.sub(rb'(?m)^: keep-alive\n\n', b'', raw)  # an SSE comment after 5 s without an event
    raw = re.sub(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]+"', b'"id":"ID"', raw)
    return re.sub(rb'"created":[0-9]+', b'"created":0', raw)
say, p = "Say one two three four five", "one two three four five one two three four five one two"
first = [call("v1/chat/completions", {"messages": [{"role": "user", "content": say}], "max_tokens": 24,
                                      "temperature": 0, "reasoning_effort": "none"}),
         call("v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0})]
A = json.loads(first[0])["choices"][0]["message"]["content"]
a = json.loads(first[1])["choices"][0]["text"]
def chat(q, **kw):
    msgs = [{"role": "user", "content": say}, {"role": "assistant", "content": A}, {"role": "user", "content": q}]
    return ("v1/chat/completions", dict({"messages": msgs, "max_tokens": 32, "reasoning_effort": "none"}, **kw))
reqs = [chat(say + " again", temperature=0),
        chat("again please", temperature=0.9, top_k=50, seed=11),
        ("v1/completions", {"prompt": p + a + " " + p, "max_tokens": 32, "temperature": 0}),
        chat("once more", temperature=0, stream=True),
        # a prompt longer than a prefill chunk (384 ids, the chunk 256): with several slots a
        # draft model catches up with it a chunk a step
        ("v1/completions", {"prompt": " ".join([p] * 32), "max_tokens": 24, "temperature": 0})]
got = [None] * len(reqs)
# how much of a prompt another request's state held depends on which of the
# concurrent ones got there first, not on speculation
def one(i): got[i] = re.sub(rb'"cached_tokens":[0-9]+', b'"cached_tokens":N', call(*reqs[i]))
if mode == "alone":
    for i in range(len(reqs)): one(i)
else:
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in ts: t.start()
    for t in ts: t.join()
open(out, "wb").write(b"\n".join(first + [g or b"MISSING" for g in got]) + b"\n")
PY
# together TAG MODE CMD...: starts CMD, runs together.py into $OUT/TAG.txt, stops it
together() {
  local tag=$1 mode=$2; shift 2
  if ! start_server "$OUT/$tag.log" "$@"; then fail "$tag:start" "$(head -c 300 "$OUT/$tag.log.err")"; return 1; fi
  timeout 300 $PY "$OUT/together.py" "$SERVER_URL" "$OUT/$tag.txt" "$mode" 2>"$OUT/$tag.client.err" \
    && pass "$tag:requests" || fail "$tag:requests" "$(tail -n 3 "$OUT/$tag.client.err")"
  DRAFTS="$(metric "$SERVER_URL" k3_drafts_proposed_total) $(metric "$SERVER_URL" k3_drafts_accepted_total)"
  SHARED="$(metric "$SERVER_URL" k3_batch_passes_total) $(metric "$SERVER_URL" k3_batch_sequences_total)"
  SHARED="$SHARED $(metric "$SERVER_URL" k3_draft_passes_total) $(metric "$SERVER_URL" k3_draft_sequences_total)"
  kill -TERM "$SERVER_PID"; wait "$SERVER_PID" && pass "$tag:stop" || fail "$tag:stop" "$(tail -n 3 "$OUT/$tag.log.err")"
}
# shared TAG [draft]: the decode passes fed more sequences than there were
# passes (the slots' verifying passes went together); with draft, the draft
# model's passes fed more drafters than there were passes too
shared() {
  local p s dp ds; read -r p s dp ds <<<"$SHARED"
  [ -n "$p" ] && [ "$p" -gt 0 ] && [ "$s" -gt "$p" ] && pass "$1:shared-passes ($s sequences in $p passes)" \
    || fail "$1:shared-passes" "passes '$p', sequences '$s'"
  [ -z "${2:-}" ] && return
  [ -n "$dp" ] && [ "$dp" -gt 0 ] && [ "$ds" -gt "$dp" ] && pass "$1:shared-draft-passes ($ds drafters in $dp passes)" \
    || fail "$1:shared-draft-passes" "draft passes '$dp', drafters '$ds'"
}
together alone alone "$K3" serve $M --port 0 --parallel 1
together par-ngram together "$K3" serve $M --port 0 --parallel 4 --speculate 4
cmp -s "$OUT/alone.txt" "$OUT/par-ngram.txt" && pass par-ngram:same \
  || fail par-ngram:same "$(diff <(tr ',' '\n' <"$OUT/alone.txt") <(tr ',' '\n' <"$OUT/par-ngram.txt") | head -c 400)"
drafted par-ngram
shared par-ngram
grep -q '4 slots' "$OUT/par-ngram.log" && pass par-ngram:slots \
  || fail par-ngram:slots "$(head -c 300 "$OUT/par-ngram.log")"
together par-draft together "$K3" serve $M --port 0 --parallel 4 --draft $M
cmp -s "$OUT/alone.txt" "$OUT/par-draft.txt" && pass par-draft:same \
  || fail par-draft:same "$(diff <(tr ',' '\n' <"$OUT/alone.txt") <(tr ',' '\n' <"$OUT/par-draft.txt") | head -c 400)"
drafted par-draft
shared par-draft draft

# ---- refusals ------------------------------------------------------------------------------
start_server "$OUT/refusals.log" "$K3" serve $M --port 0 --speculate 3 || fail refusals:start
U=$SERVER_URL
for bad in '5:invalid_value' '17:invalid_value' '-1:invalid_value' '"2":invalid_type' '1.5:invalid_type'; do
  v=${bad%:*}; code=${bad##*:}
  post "$U" v1/completions "{\"prompt\":\"hi\",\"max_tokens\":2,\"speculate\":$v}"
  check "refuse-$v:status" "$CODE" 400
  check "refuse-$v:error" "$(jget '(j["error"]["param"], j["error"]["code"])')" "('speculate', '$code')"
done
post "$U" v1/chat/completions '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"speculate":3}'
check field-at-bound "$CODE" 200
kill -TERM "$SERVER_PID"; wait "$SERVER_PID"
start_server "$OUT/plain2.log" "$K3" serve $M --port 0 || fail plain2:start
post "$SERVER_URL" v1/completions '{"prompt":"hi","max_tokens":2,"speculate":1}'
check plain-refuses:status "$CODE" 400
case "$(jget 'j["error"]["message"]')" in *"--speculate"*) pass plain-refuses:says-how ;;
  *) fail plain-refuses:says-how "$(head -c 300 "$OUT/body")" ;; esac
kill -TERM "$SERVER_PID"; wait "$SERVER_PID"
expect_exit too-many 2 $K3 serve $M --port 0 --speculate 17
rm -rf "$OUT/other" && mkdir -p "$OUT/other"
for f in "$M"/*; do ln -s "$PWD/$f" "$OUT/other/$(basename "$f")"; done
rm "$OUT/other/tiktoken.model" && head -n -1 "$M/tiktoken.model" >"$OUT/other/tiktoken.model"
expect_exit other-tokenizer 2 timeout 60 $K3 serve $M --port 0 --draft "$OUT/other"
expect_err_contains other-tokenizer "tokenizer"

# ---- under mpirun: every rank follows the verifying passes -----------------------------
[ "${K3#*asan}" != "$K3" ] && { finish; exit; } # the MPI runs: test_mpi*.sh
mpi_setup
MPIRUN="mpirun -q --oversubscribe --mca btl self,vader"
STOP_SIG=USR1
run_set mpi '{}' $MPIRUN -np 2 "$K3" serve $M --port 0 --speculate 4
grep -q 'expert parallel over 2 ranks' "$OUT/mpi.log" && pass mpi:ranks || fail mpi:ranks "$(head -c 300 "$OUT/mpi.log")"
same mpi
drafted mpi
# a draft model: each rank opens its own copy and drafts the same ids from the same session
run_set mpi-draft '{}' $MPIRUN -np 2 "$K3" serve $M --port 0 --draft $M
same mpi-draft
drafted mpi-draft
finish
