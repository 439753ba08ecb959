#!/usr/bin/env bash
# End-to-end: a trainer writes a run directory, `k3 dashboard` serves it, and
# headless Chromium (Debian's /usr/bin/chromium, driven by npm playwright-core
# from tests/e2e/) checks that the page follows the run: the step number and
# the loss curve's point count grow between polls, the sample text appears.
# Screenshots: tests/out/cli-test_dashboard_e2e/dashboard{,-phone}.png.
#
# The trainer is `k3 train` on the tiny config when this build has the train
# and prepare commands and a configs/tiny*.json, else the synthetic writer
# tests/dashboard/fake-trainer.sh. K3_E2E_TRAINER=train|fake forces one.
set -u
source tests/cli/lib.sh
source tests/e2e/lib.sh
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

e2e_prerequisites || { finish; exit 1; }

RUN=$OUT/run
rm -rf "$RUN" "$OUT/data" "$OUT"/*.png
mkdir -p "$RUN"
trainer=${K3_E2E_TRAINER:-auto}
config=$(ls configs/tiny*.json 2>/dev/null | head -n 1)
if [ "$trainer" = auto ]; then
  trainer=fake
  if "$K3" help train >/dev/null 2>&1 && "$K3" help prepare >/dev/null 2>&1 && [ -n "$config" ]; then trainer=train; fi
fi
echo "trainer: $trainer"
if [ "$trainer" = train ]; then
  # the shards' vocabulary must be the config's
  vocab=$(grep -o '"vocab_size": *[0-9]*' "$config" | head -n 1 | grep -o '[0-9]*$')
  if ! "$K3" prepare --input "$(fixture tinystories/valid.txt)" --output-dir "$OUT/data" --vocab-size "$vocab" \
       --tokenizer-stories 400 --validation-stories 40 >"$OUT/prepare.log" 2>&1; then
    fail "e2e-prepare" "$(tail -n 3 "$OUT/prepare.log")"; finish; exit 1
  fi
  # a long schedule so the run is still going when the browser looks; frequent
  # small evaluations and samples so the page has something to show at once
  "$K3" train --config "$config" --data-dir "$OUT/data" --output-dir "$RUN" --steps 100000 --batch-size 2 \
    --gradient-accumulation 1 --seq-len 64 --eval-interval 4 --eval-tokens 1024 --sample-interval 4 \
    --sample-tokens 24 --checkpoint-interval 1000 >"$OUT/train.log" 2>&1 &
  PIDS+=($!); TPID=$!
  SAMPLE=""
else
  bash tests/dashboard/fake-trainer.sh "$RUN" 600 0.25 8 4 16 &
  PIDS+=($!); TPID=$!
  SAMPLE="Once upon a time"
fi

start_server "$OUT/server.log" "$K3" dashboard --run-dir "$RUN" --port 0 ||
  { fail "e2e-server" "$(cat "$OUT/server.log.err")"; finish; exit 1; }
URL=$SERVER_URL; DPID=$SERVER_PID
echo "dashboard at $URL (trainer pid $TPID)"

DASH_URL=$URL E2E_OUT=$OUT E2E_SAMPLE=$SAMPLE CHROMIUM=$CHROMIUM e2e_node "e2e[$trainer]" "$OUT/e2e.log" "$E2E/dashboard.test.mjs"
if kill -0 "$TPID" 2>/dev/null; then pass "trainer still running at the end"; else fail "trainer" "exited early: $(tail -n 3 "$OUT/train.log" 2>/dev/null)"; fi

kill -TERM "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null
kill -INT "$DPID"; wait "$DPID"; rc=$?
if [ "$rc" -eq 0 ]; then pass "dashboard stops on SIGINT"; else fail "dashboard stops on SIGINT" "exit $rc"; fi
finish
