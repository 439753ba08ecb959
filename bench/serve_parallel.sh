#!/usr/bin/env bash
# bench/serve_parallel.sh: k3 serve with several requests at once, --parallel
# P (their decode steps in one forward pass) against --parallel 1 (one after
# another), with and without --speculate K, measured in one run.
#
#   bench/serve_parallel.sh [MODEL_DIR] [--clients "1 4 8"] [--parallel "1 8"] [--speculate "0"]
#                           [--draft DIR] [--reqs R] [--gen G] [--temperature T] [--threads T]
#
# Defaults: models/default, clients 1, 4 and 8, --parallel 1 and 8, no
# speculation (a list of K: each server with --speculate K, 0 none; --draft
# DIR: the servers that speculate draft with that model), R 3
# requests per client one after another, G 100 tokens each (temperature 0.8,
# a seed per request), 2 threads. For each server and client count, C clients
# (the npm openai client, tests/e2e/node_modules: `npm ci` there, as the e2e
# tests do) stream their requests to a fresh server (--state-cache-gb 0: every
# prompt prefilled cold); the line gives the aggregate completion tokens per
# second over the wall clock and the p50/p95 time to first token. A
# benchmark, never a test: it times things; run it on a quiet machine (the
# load average and the CPU are printed). K3=BINARY benchmarks that build of
# k3 instead of making bin/k3 (one build against another: run it per build).
set -eu
cd "$(dirname "$0")/.."
MODEL=models/default CLIENTS="1 4 8" PARS="1 8" SPECS=0 REQS=3 GEN=100 TEMP=0.8 THREADS=2 DRAFT=
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) CLIENTS=$2; shift 2 ;;
    --parallel) PARS=$2; shift 2 ;;
    --speculate) SPECS=$2; shift 2 ;;
    --draft) DRAFT=$2; shift 2 ;;
    --temperature) TEMP=$2; shift 2 ;;
    --reqs) REQS=$2; shift 2 ;;
    --gen) GEN=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --help|-h) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "serve_parallel: unknown option $1" >&2; exit 2 ;;
    *) MODEL=$1; shift ;;
  esac
done
command -v node >/dev/null || { echo "serve_parallel: needs node" >&2; exit 1; }
[ -d tests/e2e/node_modules/openai ] || (cd tests/e2e && npm ci --no-audit --no-fund >&2) \
  || { echo "serve_parallel: no npm openai client (npm ci in tests/e2e failed)" >&2; exit 1; }
if [ -z "${K3:-}" ]; then make -s bin/k3 >&2; K3=bin/k3; fi
OUT=$(mktemp -d)
SPID=
trap '[ -n "$SPID" ] && kill $SPID 2>/dev/null; rm -rf "$OUT"' EXIT
echo "# $(lscpu | sed -nE 's/^Model name: *//p'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $MODEL, --threads $THREADS, $REQS requests of $GEN tokens per client, temperature $TEMP${DRAFT:+, --draft $DRAFT}, $K3"
for K in $SPECS; do
for P in $PARS; do
  for C in $CLIENTS; do
    spec=(); [ "$K" != 0 ] && spec=(--speculate "$K" ${DRAFT:+--draft "$DRAFT"})
    "$K3" serve "$MODEL" --port 0 --parallel "$P" "${spec[@]}" --threads "$THREADS" --state-cache-gb 0 --queue 64 \
      >"$OUT/serve.log" 2>"$OUT/serve.err" &
    SPID=$!
    URL=
    for _ in $(seq 600); do
      URL=$(grep -o 'http://[^ ]*/' "$OUT/serve.log" | head -n 1) && [ -n "$URL" ] && break
      kill -0 "$SPID" 2>/dev/null || { cat "$OUT/serve.err" >&2; exit 1; }
      sleep 0.1
    done
    [ -n "$URL" ] || { echo "serve_parallel: the server did not start" >&2; exit 1; }
    line=$(timeout 900 node bench/serve_parallel.mjs "$URL" "$C" "$REQS" "$GEN" "$TEMP" "$(basename "$MODEL")")
    metrics=$(curl -s --max-time 10 "${URL}metrics")
    m() { sed -nE "s/^$1 ([0-9]+)$/\1/p" <<<"$metrics"; }
    drafts=", sequences/passes $(m k3_batch_sequences_total)/$(m k3_batch_passes_total)"
    [ "$K" != 0 ] && drafts="$drafts, drafts proposed/accepted $(m k3_drafts_proposed_total)/$(m k3_drafts_accepted_total)"
    [ "$K" != 0 ] && [ -n "$DRAFT" ] && drafts="$drafts, draft model drafters/passes $(m k3_draft_sequences_total)/$(m k3_draft_passes_total)"
    echo "parallel $P speculate $K: $line$drafts"
    kill "$SPID"; wait "$SPID" 2>/dev/null || true; SPID=
  done
done
done
