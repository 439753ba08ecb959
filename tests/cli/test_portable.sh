#!/usr/bin/env bash
# asan
# One binary for any x86-64: the build uses instructions beyond baseline
# x86-64 only in dispatched (target-attributed) files, and the checker that
# says so catches a file built with -mavx2; K3_ISA selects a kernel path or
# is refused with one line; `k3 run` writes the same logits bytes on every
# path this CPU has (scalar, avx2, avx512), at 1 and 2 threads, on the peer's
# tiny checkpoint and on a generated one (MXFP4 experts, BF16 trunk), and
# under valgrind, whose CPU has no AVX-512 (the binary must fall back alone);
# the model tests against our PyTorch fixtures pass on every path.
. "$(dirname "$0")/lib.sh"
TINY=$(fixture peer/tiny-checkpoint)
GEN=tests/fixtures/gen/k3_like

# ---- the machine code (release build only: the objects are build/rel) ------
if [ "$K3" = bin/k3 ] && [ -d build/rel ]; then
  expect_exit objdump-release 0 bash scripts/check_portable.sh bin/k3 build/rel
  expect_out_contains objdump-release "only in the"
  # the checker must fail on a file that is not dispatched but built wide
  mkdir -p "$OUT/wide/$OUT"
  cat >"$OUT/wide.c" <<'EOF'
void scale(float *y, const float *x, float s, int n) { for (int i = 0; i < n; i++) y[i] = x[i] * s; }
EOF
  if cc -O3 -mavx2 -c -o "$OUT/wide/$OUT/wide.o" "$OUT/wide.c" 2>/dev/null; then
    bash scripts/check_portable.sh bin/k3 "$OUT/wide" >"$OUT/wide.log" 2>&1
    rc=$?
    if [ $rc -eq 1 ] && grep -q "wide.c: scale" "$OUT/wide.log"; then pass objdump-flags-wide-file
    else fail objdump-flags-wide-file "rc $rc: $(head -c 300 "$OUT/wide.log")"; fi
  fi
fi

# ---- K3_ISA ---------------------------------------------------------------------
expect_exit isa-unknown 2 env K3_ISA=sse9 "$K3" doctor
expect_err_contains isa-unknown "K3_ISA=sse9: unknown instruction set"
expect_exit isa-scalar 0 env K3_ISA=scalar "$K3" doctor
expect_out_contains isa-scalar "kernels    scalar (set by K3_ISA"
expect_exit isa-default 0 env -u K3_ISA "$K3" doctor
avail=$(sed -n 's/^kernels .*available: \([a-z0-9 ]*\);.*/\1/p' "$OUT/isa-default.out")
best=${avail##* }
expect_out_contains isa-default "kernels    $best (the best available"
for isa in avx2 avx512 neon; do
  case " $avail " in
    *" $isa "*) expect_exit "isa-$isa" 0 env K3_ISA=$isa "$K3" doctor
                expect_out_contains "isa-$isa" "kernels    $isa (set by K3_ISA" ;;
    *) expect_exit "isa-$isa-refused" 2 env K3_ISA=$isa "$K3" doctor
       expect_err_contains "isa-$isa-refused" "this CPU lacks the $isa instructions" ;;
  esac
done

# ---- the same logits bytes on every path -------------------------------------------
for model in "$TINY" "$GEN"; do
  m=$(basename "$model")
  ref=""
  for isa in $avail; do
    for th in 1 2; do
      expect_exit "run-$m-$isa-t$th" 0 env K3_ISA=$isa "$K3" run "$model" --ids 3,7,11,5,9,2,8,1,4 --gen 12 \
        --quiet --threads $th --dump-logits "$OUT/$m-$isa-$th.bin"
      if [ -z "$ref" ]; then ref="$OUT/$m-$isa-$th.bin"; continue; fi
      if cmp -s "$ref" "$OUT/$m-$isa-$th.bin"; then pass "logits-$m-$isa-t$th"
      else fail "logits-$m-$isa-t$th" "differs from $(basename "$ref")"; fi
    done
  done
  [ "$(stat -c %s "$ref")" -gt 0 ] && pass "logits-$m-nonempty" || fail "logits-$m-nonempty"
  # a CPU without AVX-512, for real: valgrind's CPU model hides AVX-512, so
  # the binary must pick another path by itself and still give the same bytes
  # (a -march=native build dies here with SIGILL)
  if [ "$K3" = bin/k3 ] && command -v valgrind >/dev/null; then
    expect_exit "valgrind-run-$m" 0 valgrind --tool=none -q --error-exitcode=9 "$K3" run "$model" \
      --ids 3,7,11,5,9,2,8,1,4 --gen 12 --quiet --threads 2 --dump-logits "$OUT/$m-valgrind.bin"
    if cmp -s "$ref" "$OUT/$m-valgrind.bin"; then pass "logits-$m-valgrind"
    else fail "logits-$m-valgrind" "differs from $(basename "$ref")"; fi
  fi
done
# the whole model against our PyTorch fixtures (tests/fixtures/gen, the peer's
# tiny checkpoint) on each path, not only the default one
if [ "$K3" = bin/k3 ] && [ -x bin/k3-test ]; then
  for isa in $avail; do
    [ "$isa" = "$best" ] && continue
    for t in genfix model_; do
      if K3_ISA=$isa bin/k3-test "$t" >"$OUT/unit-$isa-$t.log" 2>&1 &&
         grep -qE '^[1-9][0-9]* passed, 0 failed, 0 skipped' "$OUT/unit-$isa-$t.log"; then
        pass "unit-$t-$isa"
      else
        fail "unit-$t-$isa" "$(grep -E 'FAIL|passed' "$OUT/unit-$isa-$t.log" | head -3)"
      fi
    done
  done
fi
if [ "$K3" = bin/k3 ] && command -v valgrind >/dev/null; then
  expect_exit valgrind-doctor 0 valgrind --tool=none -q "$K3" doctor
  expect_out_contains valgrind-doctor "kernels    "
  grep '^kernels' "$OUT/valgrind-doctor.out"
fi
finish
