#!/usr/bin/env bash
# Memory sizing under a memory cgroup limit smaller than the machine's free
# memory: the test makes a cgroup (v1 memory controller or v2 memory.max) with
# a 3 GB limit below its own, runs k3 inside it, and checks that `doctor`,
# `--preset auto` and the plan's refusal (with and without a larger
# --max-memory) all go by the limit's headroom, not by MemAvailable. Skipped
# with the reason where no such cgroup can be made (not root, no memory
# cgroup filesystem, a v2 parent that cannot delegate the controller).
. "$(dirname "$0")/lib.sh"
LIMIT=3000000000
kb=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo 2>/dev/null); avail=$(( ${kb:-0} * 1024 ))

# the memory hierarchy's directory of this shell's own cgroup: v1 first
# ("N:...memory...:/path"), else v2 ("0::/path"), on its mount from mountinfo
cg_dir() {
  local kind=$1 path root mnt
  if [ "$kind" = v1 ]; then
    path=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3; exit}' /proc/self/cgroup)
    read -r root mnt < <(awk '{for (i = 7; i <= NF; i++) if ($i == "-") break;
      if ($(i+1) == "cgroup" && $(i+3) ~ /(^|,)memory(,|$)/) {print $4, $5; exit}}' /proc/self/mountinfo)
  else
    path=$(awk -F: '$1 == "0" && $2 == "" {print $3; exit}' /proc/self/cgroup)
    read -r root mnt < <(awk '{for (i = 7; i <= NF; i++) if ($i == "-") break;
      if ($(i+1) == "cgroup2") {print $4, $5; exit}}' /proc/self/mountinfo)
  fi
  [ -n "$path" ] && [ -n "$mnt" ] || return 1
  [ "$root" != / ] && path=${path#"$root"}
  echo "$mnt${path%/}"
}

CG=""; KIND=""; why="no memory cgroup in /proc/self/cgroup and /proc/self/mountinfo"
if [ "$(id -u)" != 0 ]; then
  why="not root: cannot create a cgroup"
elif [ -z "$avail" ] || [ "$avail" -le $((2 * LIMIT)) ]; then
  why="MemAvailable ($avail bytes) is not well above the test's limit ($LIMIT)"
else
  for kind in v1 v2; do
    d=$(cg_dir $kind) || continue
    limfile=memory.limit_in_bytes; [ $kind = v2 ] && limfile=memory.max
    [ $kind = v2 ] && [ ! -e "$d/memory.max" ] && ! grep -qw memory "$d/cgroup.subtree_control" 2>/dev/null &&
      ! echo +memory >"$d/cgroup.subtree_control" 2>/dev/null && { why="v2: cannot enable the memory controller below $d"; continue; }
    c=$d/k3-test-memlimit-$$
    if ! mkdir "$c" 2>/dev/null; then why="cannot create a cgroup in $d"; continue; fi
    if ! echo $LIMIT >"$c/$limfile" 2>/dev/null; then rmdir "$c"; why="cannot set $limfile in $c"; continue; fi
    CG=$c; KIND=$kind; break
  done
fi
if [ -z "$CG" ]; then skip memlimit "$why"; finish; exit $?; fi
trap 'rmdir "$CG" 2>/dev/null' EXIT
# run a command as a member of the cgroup
incg() { bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CG" "$@"; }
echo "cgroup $KIND: $CG (limit $LIMIT bytes; MemAvailable $avail)"

expect_exit doctor 0 incg $K3 doctor
got=$(grep '^memory' "$OUT/doctor.out" | awk '{print $2}')
if grep -q "memory cgroup's headroom" "$OUT/doctor.out" && awk -v g="$got" -v l=$LIMIT 'BEGIN {exit !(g * 1e9 <= l)}'; then
  pass "doctor:available=$got GB"
else
  fail doctor:available "$(head -n 20 "$OUT/doctor.out" | grep -E '^(memory|cgroup)')"
fi
grep -q '^cgroup .*memory limit 3.00 GB' "$OUT/doctor.out" && pass doctor:limit || fail doctor:limit "$(grep '^cgroup' "$OUT/doctor.out")"

# auto inside the limit: trunk + cache within it (outside: sized from MemAvailable)
expect_exit auto 0 incg $K3 run models/default --ids 1,2,3 --gen 2 --preset auto --quiet --out "$OUT/auto.json"
jnum() { tr -d '[:space:]' <"$1" | grep -o "\"$2\":[0-9.e+-]*" | head -n 1 | cut -d: -f2; }
t=$(jnum "$OUT/auto.json" trunk_gb); x=$(jnum "$OUT/auto.json" cache_gb)
awk -v t="$t" -v x="$x" -v l=$LIMIT 'BEGIN {exit !((t + x) * 1e9 <= l)}' && pass "auto:plan=$t+$x GB" || fail auto:plan "trunk $t cache $x GB"

# a plan past the limit but inside MemAvailable is refused up front, even
# with a --max-memory that would allow it (5M positions of MLA cache: ~4 GB)
for mm in "" "--max-memory 100G"; do
  name=refuse${mm:+-maxmem}
  expect_exit "$name" 3 incg $K3 run models/default --ids 1,2,3 --gen 5000000 --quiet --out "$OUT/$name.json" $mm
  expect_err_contains "$name" "the memory cgroup's headroom is"
done
finish
