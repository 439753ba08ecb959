#!/usr/bin/env bash
# What is written once stays written once: a grep over src/ that fails when a
# second copy of a loop appears. Each check is one line of the table below:
#   NAME | PATTERN (grep -E) | FILES ALLOWED TO HOLD IT (space-separated)
# Looked for:
#   generation-sample:  calls of k3_sample( (the sampler), allowed only in the
#                       generation loop (src/generate/generate.c) and the
#                       sampler's own file (src/model/model.c);
#   generation-check:   calls of k3_logits_check( , the same two files.
# Tests (tests/) are not searched: they call these functions directly.
. "$(dirname "$0")/lib.sh"

CHECKS='
generation-sample|k3_sample\(|src/generate/generate.c src/model/model.c
generation-check|k3_logits_check\(|src/generate/generate.c src/model/model.c
'

while IFS='|' read -r name pat allowed; do
  [ -n "$name" ] || continue
  bad=""
  for f in $(grep -rlE "$pat" src --include='*.c'); do
    case " $allowed " in *" $f "*) ;; *) bad="$bad $f" ;; esac
  done
  if [ -z "$bad" ]; then pass "$name"; else fail "$name" "also in:$bad"; fi
done <<<"$CHECKS"
finish
