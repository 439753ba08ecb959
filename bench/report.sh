#!/usr/bin/env bash
# bench/report.sh: the performance summary table in one run (also `make bench-report`).
#
#   bench/report.sh [--quick] [--only decode,prefill,stream,train,index,ttft] [--cache DIR]
#                   [--json F] [--svg F] [--md F] [--mid-dir D] [--stream-dir D --trunk-dir T]
#                   [--replica-dir D] [--help]
#   bench/report.sh --render REPORT.json [--svg F] [--md F]
#
# Builds the benchmark binaries, then bench/report.py builds (once, cached under
# --cache, default bench/.cache) the checkpoints it needs, runs every benchmark
# with a short configuration and prints one table: target | measured | roofline
# or reference measured in the same run | share | issue goal | met?, plus the
# machine's conditions; writes the report JSON and a bar chart (SVG). A full
# run (no --quick, no --only) writes docs/bench-report.{md,svg}. Run it on a
# quiet machine: the conditions block records the load before and after.
# See docs/performance.md, "The summary table".
set -eu
cd "$(dirname "$0")/.."
case " $* " in
  *" --render "*|*" --help "*|*" -h "*) ;;
  *) make -s bin/k3 bin/bench_decode bin/bench_stream bin/bench_train bin/bench_index >&2 ;;
esac
exec /usr/bin/python3 bench/report.py "$@"
