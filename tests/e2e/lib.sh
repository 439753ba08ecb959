# lib.sh (tests/e2e): what the scripts that drive node tests share
# (tests/cli/test_dashboard_e2e.sh, tests/cli/test_serve_e2e.sh). Source it
# after tests/cli/lib.sh (whose start_server starts the servers); it uses
# $OUT, pass and fail.
E2E=tests/e2e
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}

# e2e_prerequisites [MODULE...]: node, npm and $CHROMIUM are there, and
# $E2E/node_modules holds playwright-core and each MODULE (else npm ci from
# the lock file). A failure is counted; returns 1 then.
e2e_prerequisites() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null || [ ! -x "$CHROMIUM" ]; then
    fail "e2e-prerequisites" "needs node, npm and $CHROMIUM: run scripts/setup.sh --test"; return 1
  fi
  local m missing=0
  for m in playwright-core "$@"; do [ -d "$E2E/node_modules/$m" ] || missing=1; done
  if [ "$missing" = 1 ]; then
    echo "installing $E2E/node_modules (npm ci)"
    if ! (cd "$E2E" && npm ci --no-audit --no-fund) >"$OUT/npm.log" 2>&1; then
      fail "e2e-npm-ci" "$(tail -n 5 "$OUT/npm.log")"; return 1
    fi
  fi
}

# e2e_node LABEL LOG SCRIPT: runs a node test (at most 300 s; the caller puts
# its environment before the call), shows its output and counts each of its
# PASS/FAIL lines as "LABEL: name"; a test that printed no closing counts fails.
e2e_node() {
  local label=$1 log=$2 script=$3 line
  timeout 300 node "$script" >"$log" 2>&1
  cat "$log"
  while read -r line; do
    case "$line" in
      PASS\ *) pass "$label: ${line#PASS }" ;;
      FAIL\ *) fail "$label: ${line#FAIL }" ;;
    esac
  done <"$log"
  grep -qE '^[0-9]+ passed, [0-9]+ failed' "$log" || fail "$label-summary" "$script ended early"
}
