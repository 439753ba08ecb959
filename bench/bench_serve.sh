#!/usr/bin/env bash
# bench/bench_serve.sh: decode speed through k3 serve's HTTP API against
# `k3 run` on the same model, prompt and sampling, measured in one run.
#
#   bench/bench_serve.sh [MODEL_DIR] [--gen N] [--reps R] [--threads T] [--tok DIR] [--temp T] [--seed S]
#
# Defaults: models/default, N 300, R 5, 1 thread (CPU time then means work,
# not OpenMP threads spinning at barriers), temperature 1.5, seed 7 (a
# sample that runs the whole N on models/default). --tok gives a tokenizer to
# a model without one (e.g. tools/gen_checkpoint.py --preset mid with
# --tok models/default, whose 2,048 ids fit its vocabulary).
#
# Each repetition runs `k3 run` and one streamed /v1/completions request to a
# k3 serve started once, with the same prompt and sampling, so both compute
# the same tokens (the texts are compared). Two measures:
#  - decode tokens/s by the wall clock: k3 run's tokens_per_s against the
#    client's, from the first to the last text event (one event per token,
#    checked), so HTTP, JSON and the server-sent events are inside it; best of R;
#  - decode tokens per CPU-second, which a busy shared machine distorts far
#    less: the CPU time of a k3 run process (wait4) with --gen N minus one with
#    --gen 1, against the server process's CPU time (/proc/PID/stat) over a
#    request of N tokens minus one of 1 token: N-1 decoded tokens each, with
#    everything the server does per token; median of R.
# The server runs with --state-cache-gb 0, so it prefills every request cold
# as k3 run does. Goal: serve >= 95% of run. A benchmark, never a test: it
# times things; run it on a quiet machine (the load average is printed).
set -eu
cd "$(dirname "$0")/.."
MODEL=models/default GEN=300 REPS=5 THREADS=1 TOK= TEMP=1.5 SEED=7
while [ $# -gt 0 ]; do
  case "$1" in
    --gen) GEN=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --tok) TOK=$2; shift 2 ;;
    --temp) TEMP=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --help|-h) sed -n '2,26p' "$0"; exit 0 ;;
    -*) echo "bench_serve: unknown option $1" >&2; exit 2 ;;
    *) MODEL=$1; shift ;;
  esac
done
make -s bin/k3 >&2
K3=bin/k3
TFLAG=(--threads "$THREADS")
[ -n "$TOK" ] && TFLAG+=(--tok "$TOK")
PROMPT="Once upon a time"
OUT=$(mktemp -d)
SPID=
trap '[ -n "$SPID" ] && kill $SPID 2>/dev/null; rm -rf "$OUT"' EXIT
"$K3" serve "$MODEL" --port 0 --state-cache-gb 0 "${TFLAG[@]}" >"$OUT/serve.log" 2>"$OUT/serve.err" &
SPID=$!
URL=
for _ in $(seq 600); do
  URL=$(grep -o 'http://[^ ]*/' "$OUT/serve.log" | head -n 1) && [ -n "$URL" ] && break
  kill -0 "$SPID" 2>/dev/null || { cat "$OUT/serve.err" >&2; exit 1; }
  sleep 0.1
done
[ -n "$URL" ] || { echo "bench_serve: the server did not start" >&2; exit 1; }

/usr/bin/python3 - "$K3" "$MODEL" "$URL" "$PROMPT" "$GEN" "$REPS" "$OUT" "$SPID" "$TEMP" "$SEED" "${TFLAG[@]}" <<'EOF'
import http.client, json, os, statistics, subprocess, sys, time, urllib.parse
k3, model, url, prompt, gen, reps, out, spid, temp, seed = sys.argv[1:11]
tflag = sys.argv[11:]
gen, reps = int(gen), int(reps)
u = urllib.parse.urlparse(url)
tick = os.sysconf("SC_CLK_TCK")

def run_once(n):
    """k3 run: (decode tok/s, CPU seconds of the process, tokens, text)."""
    cmd = [k3, "run", model, "--prompt", prompt, "--gen", str(n), "--temperature", temp, "--seed", seed,
           "--quiet", "--out", out + "/run.json"] + tflag
    p = subprocess.Popen(cmd)
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        sys.exit("bench_serve: k3 run failed")
    j = json.load(open(out + "/run.json"))
    return j["tokens_per_s"], ru.ru_utime + ru.ru_stime, len(j["generated_ids"]), j["text"]

def server_cpu():
    f = open(f"/proc/{spid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick

def serve_once(n):
    """k3 serve: (decode tok/s by the client, CPU seconds of the server, tokens, text, events)."""
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": float(temp), "seed": int(seed),
                       "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    c.connect()
    c0 = server_cpu()
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
    time.sleep(0.05)  # the worker's end of the job counts too
    cpu = server_cpu() - c0
    k = usage["completion_tokens"]
    dec = (len(times) - 1) / (times[-1] - times[0]) if len(times) == k and k > 1 else float("nan")
    return dec, cpu, k, "".join(text), len(times)

wall = {"run": [], "serve": []}
cpu = {"run": [], "serve": []}
for i in range(reps):
    dr, cr, nr, textr = run_once(gen)
    _, cr1, _, _ = run_once(1)
    ds, cs, ns, texts, nev = serve_once(gen)
    _, cs1, _, _, _ = serve_once(1)
    if textr != texts or nr != ns:
        sys.exit(f"bench_serve: k3 run and k3 serve differ ({nr} / {ns} tokens)")
    steps = nr - 1
    rr, rs = steps / max(cr - cr1, 1e-9), steps / max(cs - cs1, 1e-9)
    wall["run"].append(dr); wall["serve"].append(ds)
    cpu["run"].append(rr); cpu["serve"].append(rs)
    print(f"rep {i + 1}: {nr} tokens, {nev} events, same text; wall decode k3 run {dr:.1f} / k3 serve {ds:.1f} tok/s; "
          f"per CPU-second {rr:.1f} / {rs:.1f} tok/s", flush=True)
best = {k: max(x for x in v if x == x) for k, v in wall.items()}
med = {k: statistics.median(v) for k, v in cpu.items()}
with open("/proc/loadavg") as f:
    load = f.read().split()[0]
sw = 100.0 * best["serve"] / best["run"]
sc = 100.0 * med["serve"] / med["run"]
print(f"k3 serve through HTTP (streamed /v1/completions) vs k3 run on {model}, {gen} tokens, {reps} reps: "
      f"decode {best['serve']:.1f} vs {best['run']:.1f} tok/s by the wall clock (best, {sw:.1f}%), "
      f"{med['serve']:.1f} vs {med['run']:.1f} tok/s per CPU-second (median, {sc:.1f}%); goal >= 95%: "
      f"{'met' if min(sw, sc) >= 95 else 'met per CPU-second' if sc >= 95 else 'not met'}; load average {load}")
EOF
