#!/usr/bin/env bash
# fake-trainer.sh: writes a run directory the way `k3 train` does
# (docs/run-dir.md), with made-up numbers, so the dashboard can be tested
# without a trainer. Each step appends a train record to metrics.jsonl (every
# third one in two writes with a pause between, so readers meet partial last
# lines), then replaces state.json atomically; every EVAL steps it appends an
# eval record and a sample and rewrites loss.svg.
#
#   fake-trainer.sh DIR STEPS [SECONDS_PER_STEP] [EVAL_EVERY] [LAYERS] [EXPERTS]
#
# SIGTERM/SIGINT end the run with status "stopped", like the trainer.
set -euo pipefail
dir=$1 steps=$2 dt=${3:-0.2} every=${4:-5} layers=${5:-4} experts=${6:-16}
mkdir -p "$dir"
started=$(date +%s.%N)
stop=0
trap 'stop=1' TERM INT

now() { date +%s.%N | cut -c1-14; }

# state.json through a temp file and rename: readers never see half a file
write_state() { # STATUS STEP PHASE LATEST LATEST_EVAL BEST BEST_STEP
  local tmp="$dir/state.json.tmp.$$"
  printf '{"format":"k3-run","version":1,"status":"%s","step":%d,"total_steps":%d,"stop_at":null,"started_at":%s,"updated_at":%s,"resumed_from":null,"phase":"%s","pid":%d,"hostname":"%s","params":5123456,"config":{"hidden_size":128,"num_hidden_layers":%d,"n_routed_experts":%d},"train":{"batch_size":4,"seq_len":64,"grad_accum":1,"tokens_per_step":256,"optimizer":"muon"},"latest":%s,"latest_eval":%s,"best_val_loss":%s,"best_step":%s}\n' \
    "$1" "$2" "$steps" "$started" "$(now)" "$3" "$$" "$(hostname)" "$layers" "$experts" "$4" "$5" "$6" "$7" >"$tmp"
  mv -f "$tmp" "$dir/state.json"
}

# one train record (with per-layer expert loads) for step $1, on stdout
train_record() {
  awk -v s="$1" -v t="$(now)" -v L="$layers" -v E="$experts" -v N="$steps" -v rss="$((300 + $1))" 'BEGIN {
    srand(s * 7919 + 17);
    loss = 2.0 + 6.0 * exp(-s / (N / 4.0)) + 0.15 * (rand() - 0.5);
    warm = N / 20.0 + 1; lr = (s < warm) ? 0.001 * s / warm : 0.0001 + 0.0009 * 0.5 * (1 + cos(3.14159265 * (s - warm) / (N - warm + 1)));
    printf "{\"kind\":\"train\",\"step\":%d,\"time\":%s,\"train_loss\":%.6f,\"lr\":%.6g,\"grad_norm\":%.4f,\"tokens\":%d,\"tokens_per_s\":%.1f,\"step_time_s\":%.3f,\"peak_rss_bytes\":%d,\"expert_load\":[", s, t, loss, lr, 0.5 + rand(), s * 256, 1800 + 200 * rand(), 0.14, rss * 1048576;
    for (l = 0; l < L; l++) {
      tot = 0; dead = 0; mx = 0;
      for (e = 0; e < E; e++) { w[e] = (rand() < 0.06) ? 0 : exp(1.2 * (rand() - 0.5) + ((e == l) ? 1.0 : 0)); tot += w[e] }
      printf "%s{\"layer\":%d,\"loads\":[", (l ? "," : ""), l;
      for (e = 0; e < E; e++) { v = w[e] / tot; if (v == 0) dead++; if (v > mx) mx = v; printf "%s%.5f", (e ? "," : ""), v }
      printf "],\"dead_frac\":%.5f,\"max_over_mean\":%.4f}", dead / E, mx * E;
    }
    printf "]}\n";
  }'
}

svg() { # a small loss.svg, as the trainer redraws it at each eval
  local tmp="$dir/loss.svg.tmp.$$"
  printf '<svg xmlns="http://www.w3.org/2000/svg" width="320" height="120"><text x="10" y="20">loss at step %d</text><polyline fill="none" stroke="blue" points="10,100 100,60 200,40 310,35"/></svg>\n' "$1" >"$tmp"
  mv -f "$tmp" "$dir/loss.svg"
}

eval_record() { awk -v s="$1" -v t="$(now)" -v N="$steps" 'BEGIN { v = 2.1 + 6.0 * exp(-s / (N / 4.0)); printf "{\"kind\":\"eval\",\"step\":%d,\"time\":%s,\"val_loss\":%.6f,\"val_bpb\":%.6f,\"val_tokens\":4096}\n", s, t, v, v / 2.2 }'; }

sample_record() {
  printf '{"step":%d,"time":%s,"prompt":"Once upon a time","text":"Once upon a time (step %d) there was a little fox named Pip. Pip liked to \\"count\\" the stars: 1, 2, 3.\\nOne night a star fell into the pond, and Pip said: <hello> & goodbye."}\n' "$1" "$(now)" "$1"
}

latest=null last_eval=null best=null best_step=null
write_state running 0 init null null null null
ev=$(eval_record 0); echo "$ev" >>"$dir/metrics.jsonl"; last_eval=$ev
sample_record 0 >>"$dir/samples.jsonl"; svg 0
best=$(echo "$ev" | sed -E 's/.*"val_loss":([0-9.]+).*/\1/'); best_step=0
for ((s = 1; s <= steps; s++)); do
  sleep "$dt"
  rec=$(train_record "$s")
  if ((s % 3 == 0)); then # a partial last line for a moment, as a slow write would leave
    half=$((${#rec} / 2))
    printf '%s' "${rec:0:half}" >>"$dir/metrics.jsonl"
    sleep "$(awk -v d="$dt" 'BEGIN { print d / 2 }')"
    printf '%s\n' "${rec:half}" >>"$dir/metrics.jsonl"
  else
    printf '%s\n' "$rec" >>"$dir/metrics.jsonl"
  fi
  latest=$rec
  if ((s % every == 0 || s == steps)); then
    ev=$(eval_record "$s"); echo "$ev" >>"$dir/metrics.jsonl"; last_eval=$ev
    v=$(echo "$ev" | sed -E 's/.*"val_loss":([0-9.]+).*/\1/')
    if awk -v a="$v" -v b="$best" 'BEGIN { exit !(a < b) }'; then best=$v; best_step=$s; fi
    sample_record "$s" >>"$dir/samples.jsonl"; svg "$s"
  fi
  if ((stop)); then write_state stopped "$s" done "$latest" "$last_eval" "$best" "$best_step"; exit 0; fi
  write_state running "$s" train "$latest" "$last_eval" "$best" "$best_step"
done
write_state finished "$steps" done "$latest" "$last_eval" "$best" "$best_step"
