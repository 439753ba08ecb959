#!/usr/bin/env bash
# Runs the whole suite: unit tests (release and ASan+UBSan builds) and the
# command-line scripts (release binary; scripts marked "# asan" also under the
# sanitizer build). Prints every result and a final "N passed, N failed".
#
# Two lanes run side by side (K3_TEST_JOBS=1 runs them one after the other):
# the release lane (unit tests, then every script with bin/k3) and the
# sanitizer lane (unit tests, then the "# asan" scripts with bin/k3-asan).
# Most scripts spend their time waiting on processes, servers and the disk, so
# the second lane uses what the first leaves idle. A script's sanitizer run
# starts only after its release run has ended: the two share the script's
# output folder and the models it builds once under tests/out, so they never
# run at the same time. Each test's log is printed whole when it ends.
set -u
cd "$(dirname "$0")/.."
mkdir -p tests/out
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=0:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# Tests share 2 cores with each other: spinning OpenMP barriers stall badly
# when a thread is descheduled, so waiting threads sleep instead.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
JOBS=${K3_TEST_JOBS:-2}
case "$JOBS" in 1|2) ;; *) echo "tests/run.sh: K3_TEST_JOBS must be 1 or 2, not '$JOBS'" >&2; exit 2;; esac
D=tests/out/.run   # per test: its exit status, and a mark that it ended
rm -rf "$D"; mkdir -p "$D"

SCRIPTS=(); for s in tests/cli/test_*.sh; do [ -e "$s" ] && SCRIPTS+=("$s"); done
REL=(unit); ASAN=(unit-asan)
for s in "${SCRIPTS[@]}"; do
  n=$(basename "$s" .sh); REL+=("cli-$n")
  grep -q '^# asan' "$s" && ASAN+=("cli-$n-asan")
done

run() { # NAME CMD...: runs one test into its log, then prints the log whole
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"tests/out/$name.log" 2>&1
  echo $? >"$D/$name.rc"
  echo "== $name took $((SECONDS - t0)) s" >>"tests/out/$name.log" # where the suite's time goes
  { flock 9; echo "== $name"; cat "tests/out/$name.log"; } 9>"$D/print.lock"
  touch "$D/$name.done"
}

release_lane() {
  run unit bin/k3-test
  local s
  for s in "${SCRIPTS[@]}"; do K3=bin/k3 run "cli-$(basename "$s" .sh)" bash "$s"; done
}
asan_lane() {
  run unit-asan bin/k3-test-asan
  local s n
  for s in "${SCRIPTS[@]}"; do
    grep -q '^# asan' "$s" || continue
    n=$(basename "$s" .sh)
    while [ ! -e "$D/cli-$n.done" ]; do sleep 1; done
    K3=bin/k3-asan run "cli-$n-asan" bash "$s"
  done
}

if [ "$JOBS" = 1 ]; then
  release_lane; asan_lane
else
  trap 'kill $(jobs -p) 2>/dev/null' EXIT
  release_lane & asan_lane & wait
  trap - EXIT
fi

P=0; F=0; S=0
for name in "${REL[@]}" "${ASAN[@]}"; do
  log=tests/out/$name.log
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$log" 2>/dev/null | tail -n 1)
  if [ -z "$line" ]; then echo "FAIL $name: produced no summary line"; F=$((F + 1)); continue; fi
  p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
  s=$(echo "$line" | sed -nE 's/.* ([0-9]+) skipped.*/\1/p')
  P=$((P + p)); F=$((F + f)); S=$((S + ${s:-0}))
  rc=$(cat "$D/$name.rc" 2>/dev/null || echo 1)
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then echo "FAIL $name: exited $rc"; F=$((F + 1)); fi
done
echo
echo "suite: $SECONDS s ($JOBS lanes)"
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ]
