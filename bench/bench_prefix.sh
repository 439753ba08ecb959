#!/usr/bin/env bash
# bench/bench_prefix.sh: time to first token of new conversations that share a
# long system prompt, on a k3 serve that reuses it (message-boundary
# snapshots, the default state cache) against one that prefills every request
# cold (--state-cache-gb 0), measured in one run.
#
#   bench/bench_prefix.sh [MODEL_DIR] [--convs N] [--sentences S] [--threads T]
#
# Defaults: tests/out/bench-prefix-chat, a random chat model with the Kimi
# tokenizer (models/default has no chat template), made by
#   tools/gen_checkpoint.py tests/out/bench-prefix-chat --preset tiny
#     --set vocab_size=163840 --set hidden_size=256 --set num_hidden_layers=9
#     --tokenizer tests/fixtures/tokenizer/kimi --seed 5
# 10 conversations, a system prompt of 44 sentences (about 760 tokens), 1
# thread. Each conversation is the same system message plus its own short
# user message, sent once to each server as
# a non-streamed request for 1 token at temperature 0, so the request's wall
# time is its time to first token (prefill, one sample, HTTP). Printed: the
# system prompt's tokens, the median TTFT of conversations 2..N on each server
# (the first one on the reusing server is cold too), their cached_tokens, and
# whether the replies are the same. A benchmark, never a test: run it on a
# quiet machine (the load average is printed).
set -eu
cd "$(dirname "$0")/.."
MODEL=tests/out/bench-prefix-chat CONVS=10 SENT=44 THREADS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --convs) CONVS=$2; shift 2 ;;
    --sentences) SENT=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --help|-h) sed -n '2,22p' "$0"; exit 0 ;;
    -*) echo "bench_prefix: unknown option $1" >&2; exit 2 ;;
    *) MODEL=$1; shift ;;
  esac
done
K3=${K3:-bin/k3}
TMP=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; rm -rf "$TMP"' EXIT
start() { # NAME ARGS...: a server on a free port; its URL in $TMP/NAME.url
  local name=$1; shift
  "$K3" serve "$MODEL" --port 0 --threads "$THREADS" "$@" >"$TMP/$name.log" 2>"$TMP/$name.err" &
  PIDS+=($!)
  for _ in $(seq 600); do
    grep -o 'http://[^ ]*/' "$TMP/$name.log" 2>/dev/null | head -n 1 >"$TMP/$name.url"
    [ -s "$TMP/$name.url" ] && return 0
    sleep 0.1
  done
  echo "bench_prefix: $name server did not start: $(head -c 300 "$TMP/$name.err")" >&2; exit 1
}
python3 - "$TMP" "$CONVS" "$SENT" <<'PY'
import json, sys
tmp, convs, sent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
system = " ".join("Guideline %d: answer carefully, cite the source, stay kind and brief." % i for i in range(sent))
json.dump({"messages": [{"role": "system", "content": system}], "add_generation_prompt": False}, open(tmp + "/sys.json", "w"))
for i in range(convs):
    json.dump({"messages": [{"role": "system", "content": system},
                            {"role": "user", "content": "Question %d: what is %d times %d?" % (i, i + 3, i + 7)}],
               "max_tokens": 1, "temperature": 0}, open("%s/c%d.json" % (tmp, i), "w"))
PY
NSYS=$("$K3" tokenize "$MODEL" --chat "$TMP/sys.json" | tr ',' '\n' | grep -c .)
start reuse
start cold --state-cache-gb 0
for name in reuse cold; do
  url=$(cat "$TMP/$name.url")
  for i in $(seq 0 $((CONVS - 1))); do
    t=$(curl -s --max-time 600 -H 'Content-Type: application/json' -o "$TMP/$name.$i.out" -w '%{time_total}' \
      --data-binary "@$TMP/c$i.json" "${url}v1/chat/completions")
    echo "$t" >"$TMP/$name.$i.t"
  done
done
python3 - "$TMP" "$CONVS" "$NSYS" <<'PY'
import json, os, statistics, sys
tmp, convs, nsys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def get(name, i):
    j = json.load(open("%s/%s.%d.out" % (tmp, name, i)))
    return (float(open("%s/%s.%d.t" % (tmp, name, i)).read()), j["usage"]["prompt_tokens"],
            j["usage"]["prompt_tokens_details"]["cached_tokens"], j["choices"][0]["message"])
r = [get("reuse", i) for i in range(convs)]
c = [get("cold", i) for i in range(convs)]
print("load average %s; system prompt %d tokens; prompts %d..%d tokens; %d conversations"
      % (os.getloadavg()[0], nsys, min(x[1] for x in r), max(x[1] for x in r), convs))
print("cold   : TTFT median %.3f s (conversations 2..%d), cached_tokens %s"
      % (statistics.median(x[0] for x in c[1:]), convs, sorted(set(x[2] for x in c[1:]))))
print("reused : TTFT median %.3f s (conversations 2..%d), cached_tokens %s; first (cold) %.3f s"
      % (statistics.median(x[0] for x in r[1:]), convs, sorted(set(x[2] for x in r[1:])), r[0][0]))
print("replies identical: %s" % all(a[3] == b[3] for a, b in zip(r, c)))
PY
