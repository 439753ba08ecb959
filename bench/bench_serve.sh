#!/usr/bin/env bash
# bench/bench_serve.sh: decode tokens/s through k3 serve's HTTP API against
# `k3 run` on the same model, prompt and sampling, measured in one run.
#
#   bench/bench_serve.sh [MODEL_DIR] [--gen N] [--reps R] [--threads T]
#
# MODEL_DIR defaults to models/default. Each repetition runs `k3 run --out`
# (its tokens_per_s: generated tokens after the first over the decode time)
# and then one streamed /v1/completions request to a k3 serve started once
# (tokens after the first over the time from the first to the last text
# event, measured by the client: the HTTP, JSON and server-sent-event work
# is inside the measurement, the prefill is not, as for k3 run). Both get the
# same greedy prompt, so they compute the same tokens. The best of R
# repetitions of each is compared (goal: serve >= 95% of run). A benchmark,
# never a test: it times things.
set -eu
cd "$(dirname "$0")/.."
MODEL=models/default GEN=160 REPS=5 THREADS=
while [ $# -gt 0 ]; do
  case "$1" in
    --gen) GEN=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --help|-h) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "bench_serve: unknown option $1" >&2; exit 2 ;;
    *) MODEL=$1; shift ;;
  esac
done
make -s bin/k3 >&2
K3=bin/k3
TFLAG=()
[ -n "$THREADS" ] && TFLAG=(--threads "$THREADS")
PROMPT="Once upon a time"
OUT=$(mktemp -d)
trap 'kill $SPID 2>/dev/null; rm -rf "$OUT"' EXIT
"$K3" serve "$MODEL" --port 0 "${TFLAG[@]}" >"$OUT/serve.log" 2>"$OUT/serve.err" &
SPID=$!
URL=
for _ in $(seq 600); do
  URL=$(grep -o 'http://[^ ]*/' "$OUT/serve.log" | head -n 1) && [ -n "$URL" ] && break
  kill -0 "$SPID" 2>/dev/null || { cat "$OUT/serve.err" >&2; exit 1; }
  sleep 0.1
done
[ -n "$URL" ] || { echo "bench_serve: the server did not start" >&2; exit 1; }

/usr/bin/python3 - "$K3" "$MODEL" "$URL" "$PROMPT" "$GEN" "$REPS" "$OUT" "${TFLAG[@]}" <<'EOF'
import http.client, json, subprocess, sys, time, urllib.parse
k3, model, url, prompt, gen, reps, out = sys.argv[1:8]
tflag = sys.argv[8:]
gen, reps = int(gen), int(reps)
u = urllib.parse.urlparse(url)

def run_once():
    subprocess.run([k3, "run", model, "--prompt", prompt, "--gen", str(gen), "--quiet", "--out", out + "/run.json"]
                   + tflag, check=True)
    j = json.load(open(out + "/run.json"))
    return j["tokens_per_s"], len(j["generated_ids"]), j["text"]

def serve_once():
    body = json.dumps({"prompt": prompt, "max_tokens": gen, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.status
    times, text, usage, buf = [], [], None, b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        now = time.perf_counter()
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            o = json.loads(ev[6:])
            if o.get("usage"):
                usage = o["usage"]
            for ch in o["choices"]:
                if ch.get("text"):
                    text.append(ch["text"])
                    times.append(now)
    c.close()
    n = usage["completion_tokens"]
    # one text event per token here (an incomplete character would merge two)
    steps = len(times) - 1
    return (steps / (times[-1] - times[0]) if steps > 0 else 0.0), n, "".join(text), len(times)

best_run = best_serve = 0.0
for i in range(reps):
    tr, nr, textr = run_once()
    ts, ns, texts, nev = serve_once()
    same = textr == texts
    print(f"rep {i + 1}: k3 run {tr:.1f} tok/s ({nr} tokens); k3 serve {ts:.1f} tok/s ({ns} tokens, {nev} events); "
          f"same text: {'yes' if same else 'NO'}", flush=True)
    if not same:
        sys.exit("bench_serve: the texts differ")
    best_run, best_serve = max(best_run, tr), max(best_serve, ts)
share = 100.0 * best_serve / best_run if best_run else 0.0
print(f"decode through HTTP (k3 serve, streamed /v1/completions): {best_serve:.1f} tok/s vs k3 run {best_run:.1f} tok/s "
      f"on {model}, best of {reps}: {share:.1f}% (goal >= 95%: {'met' if share >= 95 else 'not met'})")
EOF
