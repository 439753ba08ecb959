#!/usr/bin/env bash
# Bounded libFuzzer runs of the safetensors header parser, the index-file
# cross-check, the config parser and the tokenizer (tiktoken.model,
# tokenizer_config.json, encode/decode round trips; fuzz/fuzz_*.c) from the
# committed seed corpora. Passes when no
# crash, sanitizer report or disagreement is found in K3_FUZZ_SECONDS
# (default 20) per harness. Reported as skipped (not passed) when clang is
# not installed.
. tests/cli/lib.sh
SECS=${K3_FUZZ_SECONDS:-20}
if ! command -v "${FUZZ_CC:-clang}" >/dev/null 2>&1; then
  skip fuzz "clang not installed (scripts/setup.sh --test installs it)"
  finish; exit $?
fi
if make -s fuzz bin/fuzz_index >"$OUT/build.log" 2>&1; then pass fuzz_build; else fail fuzz_build "$(tail -n 5 "$OUT/build.log")"; finish; exit 1; fi
for h in safetensors config index tokenizer; do
  work="$OUT/corpus-$h"; rm -rf "$work"; mkdir -p "$work" "$OUT/artifacts-$h"
  # the first corpus directory receives new inputs; the committed seeds stay as they are
  if ASAN_OPTIONS=detect_leaks=1 "bin/fuzz_$h" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 \
       -max_len=8192 -dict="fuzz/$h.dict" -print_final_stats=1 \
       -artifact_prefix="$OUT/artifacts-$h/" "$work" "fuzz/corpus/$h" >"$OUT/fuzz-$h.log" 2>&1; then
    pass "fuzz_$h ($(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$OUT/fuzz-$h.log" | grep -Eo '[0-9]+$') runs)"
  else
    fail "fuzz_$h" "$(grep -E 'ERROR|SUMMARY|deadly|Test unit written' "$OUT/fuzz-$h.log" | head -n 3 | tr '\n' ' ')"
  fi
done
finish
