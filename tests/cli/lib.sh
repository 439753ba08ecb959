# lib.sh: helpers for command-line tests. Source it from tests/cli/*.sh, with
# the repository root as the working directory.
# $K3 is the binary under test (bin/k3 or bin/k3-asan). Inputs come from
# tests/fixtures (`fixture REL`); $SHARED (../shared, or $K3_SHARED) is only for
# a check whose input may not be committed, which must `skip` without it.
# Each script ends by calling `finish`, which prints "N passed, N failed, N skipped".
K3=${K3:-bin/k3}
SHARED=${K3_SHARED:-../shared}
OUT=tests/out/cli-$(basename "$0" .sh)
mkdir -p "$OUT"
_pass=0; _fail=0; _skip=0

# MEM_CAP: a shell prefix capping a command's address space at 2 GB, so that a
# read of an endless input fails at once instead of exhausting the machine.
# Empty for the sanitizer build, whose shadow memory reserves terabytes of
# address space (the command's own timeout still bounds it there).
MEM_CAP="ulimit -v 2000000;"
[ "${K3#*asan}" != "$K3" ] && MEM_CAP=""

pass() { echo "PASS $1"; _pass=$((_pass + 1)); }
fail() { echo "FAIL $1${2:+: $2}"; _fail=$((_fail + 1)); }
# skip NAME REASON: a check that could not run here; counted apart, never as a pass
skip() { echo "SKIP $1: $2"; _skip=$((_skip + 1)); }

# fixture REL: the path of tests/fixtures/REL. A fixture committed compressed
# (REL.gz) is unpacked once into tests/out/fixtures/REL (through a temp file,
# so an interrupted run leaves no partial copy) and that path is printed.
fixture() {
  local p=tests/fixtures/$1 o=tests/out/fixtures/$1
  if [ -e "$p" ] || [ ! -e "$p.gz" ]; then echo "$p"; return; fi
  if [ ! -e "$o" ] || [ "$p.gz" -nt "$o" ]; then
    mkdir -p "$(dirname "$o")"
    if ! gzip -dc "$p.gz" >"$o.tmp.$$" || ! mv -f "$o.tmp.$$" "$o"; then
      rm -f "$o.tmp.$$"; echo "lib.sh: cannot unpack $p.gz" >&2; echo "$p"; return
    fi
  fi
  echo "$o"
}

# expect_exit NAME CODE CMD...: runs CMD, checks its exit code; for nonzero codes
# also checks stderr is exactly one line starting "k3: " (the error contract).
expect_exit() {
  local name=$1 code=$2; shift 2
  "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  if [ "$rc" -ne "$code" ]; then
    fail "$name" "exit $rc, wanted $code; stderr: $(head -c 300 "$OUT/$name.err")"; return 1
  fi
  if [ "$code" -ne 0 ]; then
    local lines; lines=$(grep -c '' "$OUT/$name.err")
    if [ "$lines" -ne 1 ] || ! grep -q '^k3: ' "$OUT/$name.err"; then
      fail "$name" "error is not one 'k3: ' line: $(head -c 300 "$OUT/$name.err")"; return 1
    fi
  fi
  pass "$name"
}

# expect_err_contains NAME TEXT: the last expect_exit's stderr contains TEXT.
expect_err_contains() {
  if grep -qF -- "$2" "$OUT/$1.err"; then pass "$1:msg"; else fail "$1:msg" "stderr lacks '$2': $(head -c 300 "$OUT/$1.err")"; fi
}
# expect_out_contains NAME TEXT: the last expect_exit's stdout contains TEXT.
expect_out_contains() {
  if grep -qF -- "$2" "$OUT/$1.out"; then pass "$1:out"; else fail "$1:out" "stdout lacks '$2'"; fi
}

# The common start of the MPI tests: one OpenMP thread a rank (ranks share
# the cores), a FAIL and exit when Open MPI is missing, root allowed, MPI set to
# a bounded mpirun on shared memory (-q: no banners of mpirun's own), ASAN=1
# for the sanitizer build with the options Open MPI needs there: its own
# start-up allocations are suppressed by library name (tests/lsan.supp),
# which needs full stacks, and no table of the suppressions used on stderr.
mpi_setup() {
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
  export OMP_NUM_THREADS=1
  if ! command -v mpirun >/dev/null; then
    fail mpi:installed "no mpirun: install Open MPI (scripts/setup.sh)"; finish; exit
  fi
  if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
  MPI="timeout 120 mpirun -q --oversubscribe --mca btl self,vader"
  ASAN=0; [ "${K3#*asan}" != "$K3" ] && ASAN=1
  if [ $ASAN = 1 ]; then
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}:fast_unwind_on_malloc=0"
    export LSAN_OPTIONS="${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp}:print_suppressions=0"
  fi
}

# expect_rank_killed NAME RANK FAULT CMD...: CMD (an mpirun job) runs with
# K3_DIST_FAULT=FAULT, which SIGKILLs rank RANK mid-run: the job must end
# with an error (not hang into its timeout, exit 124) and mpirun's report must
# name that rank.
expect_rank_killed() {
  local name=$1 rank=$2 fault=$3; shift 3
  K3_DIST_FAULT=$fault "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && pass "$name:exit" || fail "$name:exit" "exit $rc"
  grep -q "process rank $rank .* exited on signal 9" "$OUT/$name.err" && pass "$name:named" \
    || fail "$name:named" "$(head -c 300 "$OUT/$name.err")"
}

# need_chat_python [NAME]: sets PY to the system python3 that
# tools/gen_checkpoint.py runs under; when it has no numpy (so no chat model
# can be made) the script reports one skip (NAME, default chat) and ends here.
need_chat_python() {
  PY=/usr/bin/python3
  if ! $PY -c 'import numpy' 2>/dev/null; then
    skip "${1:-chat}" "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
    finish; exit $?
  fi
}

# chat_model DIR SEED: a small random chat model with the full Kimi
# vocabulary (163,840 ids, 5 layers, the Kimi tokenizer's XTML ids), made by
# tools/gen_checkpoint.py and regenerated only when the command changes.
# Returns 1 (with a FAIL) when it cannot be made; callers check numpy first.
chat_model() {
  local gen="/usr/bin/python3 tools/gen_checkpoint.py $1 --preset tiny --set vocab_size=163840 --set hidden_size=64"
  gen="$gen --set num_hidden_layers=5 --tokenizer tests/fixtures/tokenizer/kimi --seed $2 --force"
  if [ "$(cat "$1.stamp" 2>/dev/null)" != "$gen" ] || [ ! -f "$1/config.json" ]; then
    rm -f "$1.stamp"
    $gen >"$OUT/gen.log" 2>&1 && echo "$gen" >"$1.stamp" || { fail "generate $1" "$(tail -n 3 "$OUT/gen.log")"; return 1; }
  fi
}

# k3 serve's /health at URL as "CANCELLED RUNNING WAITING" (RUNNING True or
# False). sed, not python: tests poll it to catch a request while it runs, so
# each poll must be quick also on a loaded machine.
serve_state() {
  curl -s --max-time 10 "$1/health" |
    sed -nE 's/.*"waiting": *([0-9]+).*"running": *(true|false).*"cancelled": *([0-9]+).*/\3 \2 \1/p' |
    sed 's/true/True/; s/false/False/'
}

# start_server LOG CMD...: starts a server that prints its http://HOST:PORT/
# address on stdout (stderr to LOG.err) and waits up to 60 s for it. Sets
# SERVER_URL, SERVER_PORT and SERVER_PID (also added to the caller's PIDS
# array, for its cleanup); returns 1 if the server exits or prints none.
start_server() {
  local log=$1; shift
  "$@" >"$log" 2>"$log.err" &
  SERVER_PID=$!; PIDS+=("$SERVER_PID"); SERVER_URL=; SERVER_PORT=
  for _ in $(seq 600); do
    SERVER_URL=$(grep -o 'http://[^ ]*/' "$log" | head -n 1)
    if [ -n "$SERVER_URL" ]; then SERVER_PORT=$(echo "$SERVER_URL" | sed -nE 's#.*:([0-9]+)/$#\1#p'); return 0; fi
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# Kills, on exit, every PID the script adds to PIDS (start_server adds its
# servers), so a failed or interrupted test leaves no server behind.
kill_pids_at_exit() {
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done' EXIT
}

# The HTTP tests' helpers. req METHOD URL [CURL ARGS]: sets CODE, the body in
# $OUT/body and the headers in $OUT/head. jget EXPR: a Python expression on
# the body's JSON as j. check NAME GOT WANTED: passes when they are equal.
req() { local m=$1 u=$2; shift 2; CODE=$(curl -s --max-time 60 -o "$OUT/body" -D "$OUT/head" -w '%{http_code}' -X "$m" "$@" "$u"); }
jget() { python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$OUT/body" "$1" 2>&1; }
check() { if [ "$2" = "$3" ]; then pass "$1"; else fail "$1" "got '$(printf %s "$2" | head -c 300)', wanted '$3'"; fi; }

finish() { echo "$_pass passed, $_fail failed, $_skip skipped"; [ "$_fail" -eq 0 ]; }
