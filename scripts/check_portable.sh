#!/usr/bin/env bash
# check_portable.sh: is this k3 build safe on any x86-64 CPU?
#
#   scripts/check_portable.sh [BINARY [OBJDIR]]     (default bin/k3 build/rel)
#
# The build targets baseline x86-64 (SSE2); wider instructions may appear only
# in code reached after a CPUID check. This disassembles every object under
# OBJDIR and the linked BINARY and finds each function that uses an
# instruction beyond baseline x86-64: a ymm/zmm or mask register, a VEX/EVEX
# encoded instruction, or an SSE3..SSE4.2, BMI, LZCNT, POPCNT, MOVBE, AES or
# CLMUL instruction. Such a function is allowed
#  - in an object whose source (or a header beside it that it includes)
#    uses __attribute__((target(...))) (the SIMD
#    kernel files: found by grep, so the list maintains itself), or
#  - anywhere, when it is an x86-64-v3/v4 clone of a K3_HOT (target_clones)
#    function (name suffix .arch_x86_64_v3/v4; GCC's ifunc picks it by CPUID);
# anything else is reported and the exit status is 1. In the binary every such
# function must come from an allowed object or be such a clone (so nothing
# else, e.g. a static library routine, brought wide code in). -march=native,
# -mavx2 or a stray intrinsic outside a dispatched file fails this check.
set -euo pipefail
BIN=${1:-bin/k3}
OBJ=${2:-build/rel}
command -v objdump >/dev/null || { echo "k3: check_portable.sh: objdump not found (binutils)" >&2; exit 2; }
[ -f "$BIN" ] || { echo "k3: $BIN: no such binary" >&2; exit 2; }
[ -d "$OBJ" ] || { echo "k3: $OBJ: no such object directory" >&2; exit 2; }

# objdump -d FILE | wide_funcs: the names of functions using non-baseline code.
wide_funcs() {
  awk '
    BEGIN {
      n = split("addsubps addsubpd haddps haddpd hsubps hsubpd lddqu movddup movshdup movsldup fisttp " \
                "pabsb pabsw pabsd palignr phaddw phaddd phaddsw phsubw phsubd phsubsw pmaddubsw pmulhrsw " \
                "pshufb psignb psignw psignd " \
                "blendps blendpd blendvps blendvpd dpps dppd extractps insertps movntdqa mpsadbw packusdw " \
                "pblendvb pblendw pcmpeqq pextrb pextrd pextrq phminposuw pinsrb pinsrd pinsrq pmaxsb pmaxsd " \
                "pmaxuw pmaxud pminsb pminsd pminuw pminud pmovsxbw pmovsxbd pmovsxbq pmovsxwd pmovsxwq " \
                "pmovsxdq pmovzxbw pmovzxbd pmovzxbq pmovzxwd pmovzxwq pmovzxdq pmuldq pmulld ptest roundps " \
                "roundpd roundss roundsd crc32 crc32b crc32w crc32l crc32q pcmpestri pcmpestrm pcmpistri " \
                "pcmpistrm pcmpgtq popcnt lzcnt andn bextr blsi blsmsk blsr bzhi mulx pdep pext rorx sarx " \
                "shlx shrx movbe aesenc aesenclast aesdec aesdeclast aesimc aeskeygenassist pclmulqdq " \
                "adcx adox", m, " ")
      for (i = 1; i <= n; i++) late[m[i]] = 1
      # tzcnt is left out on purpose: GCC emits "rep bsf" for ctz at baseline,
      # which objdump shows as tzcnt and which runs as bsf on older CPUs.
    }
    /^[0-9a-f]+ <.*>:$/ { f = $2; sub(/^</, "", f); sub(/>:$/, "", f); next }
    /^ +[0-9a-f]+:\t/ {
      t = $0; sub(/^ +[0-9a-f]+:\t/, "", t)
      w = split(t, ws, /[ \t]+/); k = 1
      while (k < w && ws[k] ~ /^(rep|repz|repe|repnz|repne|lock|notrack|bnd|data16|cs|ds|ss|es|fs|gs|addr32)$/) k++
      op = ws[k]
      wide = (t ~ /%[yz]mm[0-9]/ || t ~ /%k[0-7]([^0-9]|$)/ || op ~ /^v/ || (op in late))
      if (wide && f != "" && !(f in seen)) { seen[f] = 1; print f }
    }'
}

# strip the compiler's clone suffixes: foo.part.0, foo.constprop.1, foo.isra.0, foo.cold
base() { sed -E 's/\.(part|constprop|isra|cold|lto_priv|localalias)(\.[0-9]+)?//g; s/\.(arch_x86_64_v[0-9]|default|resolver)//g'; }

# uses_target SRC: SRC, or a header it includes from its own folder (such as
# bench/bench.h), defines functions with __attribute__((target(...))).
uses_target() {
  local h
  grep -q '__attribute__((target(' "$1" && return 0
  for h in $(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$1"); do
    [ -f "$(dirname "$1")/$h" ] && grep -q '__attribute__((target(' "$(dirname "$1")/$h" && return 0
  done
  return 1
}

status=0
cloned=0
allowed_objs=()
allowed_names=$(mktemp)
trap 'rm -f "$allowed_names"' EXIT
while IFS= read -r o; do
  rel=${o#"$OBJ"/}
  src=${rel%.o}.c
  # an object left in OBJDIR by a source since moved or deleted is not in the
  # binary (the Makefile links the sources that exist): skip it
  [ -f "$src" ] || continue
  funcs=$(objdump -d --no-show-raw-insn "$o" | wide_funcs)
  if [ -f "$src" ] && uses_target "$src"; then
    allowed_objs+=("$o")
    nm "$o" | awk '$2 ~ /^[tTwW]$/ {print $3}' | base >>"$allowed_names"
    continue
  fi
  # elsewhere only the AVX2 / AVX-512 clones of target_clones (K3_HOT) functions
  for f in $funcs; do
    case "$f" in
      *.arch_x86_64_v[34]*) cloned=$((cloned + 1)) ;;
      *) status=1; echo "wide code outside a dispatched function: $src: $f" ;;
    esac
  done
done < <(find "$OBJ" -name '*.o' | sort)

# the linked binary: every wide function must come from an allowed object
for f in $(objdump -d --no-show-raw-insn "$BIN" | wide_funcs); do
  case "$f" in *.arch_x86_64_v[34]*) continue ;; esac
  b=$(echo "$f" | sed 's/@.*//' | base)
  if ! grep -qxF -- "$b" "$allowed_names"; then
    status=1
    echo "wide code in $BIN not from a dispatched file: $f"
  fi
done
if [ "$status" -eq 0 ]; then
  echo "portable: $BIN and $OBJ use instructions beyond baseline x86-64 only in" \
       "the ${#allowed_objs[@]} dispatched objects ($(printf '%s ' "${allowed_objs[@]##*/}" | sed 's/ $//'))" \
       "and in $cloned AVX2/AVX-512 clones of K3_HOT functions"
fi
exit $status
