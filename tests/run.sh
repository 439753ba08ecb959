#!/usr/bin/env bash
# Runs the whole suite: unit tests (release and ASan+UBSan builds) and the
# command-line scripts (release binary; scripts marked "# asan" also under the
# sanitizer build). Prints every result and a final "N passed, N failed".
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
P=0; F=0; S=0

tally() { # reads a log, adds its closing counts
  local line; line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$1" | tail -n 1)
  if [ -z "$line" ]; then echo "FAIL $2: produced no summary line"; F=$((F + 1)); return; fi
  local p f s
  p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
  s=$(echo "$line" | sed -nE 's/.* ([0-9]+) skipped.*/\1/p')
  P=$((P + p)); F=$((F + f)); S=$((S + ${s:-0}))
}

run() { # NAME CMD...
  local name=$1; shift
  echo "== $name"
  local t0=$SECONDS
  "$@" 2>&1 | tee "tests/out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name took $((SECONDS - t0)) s" # where the suite's time goes
  tally "tests/out/$name.log" "$name"
  if [ "$rc" -ne 0 ] && ! grep -qE '^[0-9]+ passed, [1-9][0-9]* failed' "tests/out/$name.log"; then
    echo "FAIL $name: exited $rc"; F=$((F + 1))
  fi
}

run unit bin/k3-test
run unit-asan bin/k3-test-asan
for s in tests/cli/test_*.sh; do
  [ -e "$s" ] || continue
  n=$(basename "$s" .sh)
  K3=bin/k3 run "cli-$n" bash "$s"
  if grep -q '^# asan' "$s"; then K3=bin/k3-asan run "cli-$n-asan" bash "$s"; fi
done
echo
echo "suite: $SECONDS s"
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ]
