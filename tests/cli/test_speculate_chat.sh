#!/usr/bin/env bash
# k3 chat --speculate K [--draft DIR]: a conversation's replies are exactly
# those of the same chat without speculation (the reference: a plain chat,
# never a value the speculative path computed itself), turn by turn, while
# turns 2 and 3 resume from the state the earlier turns left (reuse):
#  - greedy and sampled with a seed; n-gram drafts over the whole rendered
#    conversation and a draft model (here the model itself, which drafts
#    what the target decodes greedily, so every draft is accepted);
#  - with grid snapshots of the state cache falling inside verifying passes
#    (--state-grid 5), without a state cache, and under mpirun with 2 ranks
#    (n-gram and draft model);
#  - --draft with another tokenizer: exit 2.
. "$(dirname "$0")/lib.sh"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
need_chat_python
M=tests/out/chat-model-a
chat_model $M 3 || { finish; exit 1; }
# the user repeats a phrase, so the n-gram lookup over the conversation has drafts to offer
printf 'Say one two three four five\nSay one two three four five again\nAnd once more: one two three four five\n' \
  >"$OUT/three.txt"

# same NAME PLAIN_ARGS -- SPEC_ARGS: the two chats' turns have equal generated ids and
# messages, reuse where the plain chat does, and turn 2 resumed from turn 1's state
same() {
  local name=$1; shift
  local plain=() spec=()
  while [ "$1" != "--" ]; do plain+=("$1"); shift; done
  shift; spec=("$@")
  expect_exit "$name:plain" 0 $K3 chat $M --gen 24 --out "$OUT/$name.plain.json" "${plain[@]}" <"$OUT/three.txt" || return
  expect_exit "$name:spec" 0 $K3 chat $M --gen 24 --out "$OUT/$name.spec.json" "${plain[@]}" "${spec[@]}" \
    <"$OUT/three.txt" || return
  $PY - "$OUT/$name.plain.json" "$OUT/$name.spec.json" <<'PY' && pass "$name:same" || fail "$name:same" "$(cat "$OUT/why")"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ids = lambda d: [t["generated_ids"] for t in d["turns"]]
why = []
if len(a["turns"]) != 3: why.append("%d turns" % len(a["turns"]))
if ids(a) != ids(b): why.append("generated ids differ: %s vs %s" % (ids(a), ids(b)))
if a["messages"] != b["messages"]: why.append("messages differ")
reused = lambda d: [t["reused"] for t in d["turns"]]
# a grid snapshot falling inside a verifying pass is taken at the pass's end
# (session.h), so with --state-grid a turn may resume a few positions apart
near = lambda x, y: abs(x - y) <= 17 and (x == 0) == (y == 0)
if not all(map(near, reused(a), reused(b))): why.append("reused %s, plain %s" % (reused(b), reused(a)))
if reused(b)[1] == 0: why.append("turn 2 reused nothing")
open(sys.argv[2].rsplit("/", 1)[0] + "/why", "w").write("; ".join(why))
sys.exit(1 if why else 0)
PY
}
# drafts NAME: the speculative chat proposed drafts and had some accepted
drafts() {
  $PY - "$OUT/$1.spec.json" <<'PY' && pass "$1:drafts" || fail "$1:drafts" "$(head -c 400 "$OUT/$1.spec.json")"
import json, sys
t = json.load(open(sys.argv[1]))["turns"]
p, a = sum(x["drafts_proposed"] for x in t), sum(x["drafts_accepted"] for x in t)
sys.exit(0 if p > 0 and 0 < a <= p else 1)
PY
}

same ngram-greedy -- --speculate 4
drafts ngram-greedy
same ngram-sampled --temperature 0.9 --top-k 50 --seed 7 -- --speculate 4
same draft-greedy -- --draft $M
drafts draft-greedy
same draft-sampled --temperature 0.9 --seed 11 -- --draft $M --speculate 3
# grid snapshots every 5 positions: some fall inside a verifying pass
same grid --state-grid 5 -- --speculate 4
same no-cache --state-cache-gb 0 -- --speculate 4
same grid-draft --state-grid 5 --threads 2 -- --draft $M

# ---- refusals ------------------------------------------------------------------------------
rm -rf "$OUT/other" && mkdir -p "$OUT/other"
for f in config.json model.safetensors tokenizer_config.json; do ln -s "$PWD/$M/$f" "$OUT/other/$f"; done
head -n -1 "$M/tiktoken.model" >"$OUT/other/tiktoken.model"
expect_exit other-tokenizer 2 $K3 chat $M --draft "$OUT/other" </dev/null
expect_err_contains other-tokenizer "tokenizer"
expect_exit too-many 2 $K3 chat $M --speculate 17 </dev/null

# ---- under mpirun: every rank drafts the same ids from the same conversation ---------------
[ "${K3#*asan}" != "$K3" ] && { finish; exit; } # the MPI runs: test_mpi*.sh
mpi_setup
expect_exit mpi-plain 0 $K3 chat $M --gen 24 --temperature 0.9 --seed 5 --state-grid 5 --out "$OUT/mpi.plain.json" \
  <"$OUT/three.txt"
expect_exit mpi-spec 0 $MPI -np 2 $K3 chat $M --gen 24 --temperature 0.9 --seed 5 --state-grid 5 --speculate 4 \
  --out "$OUT/mpi.spec.json" <"$OUT/three.txt"
# same_turns NAME FILE: FILE's three turns generated plain's ids
same_turns() {
  $PY -c '
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ids = lambda d: [t["generated_ids"] for t in d["turns"]]
sys.exit(0 if ids(a) == ids(b) and len(ids(a)) == 3 else 1)' "$OUT/mpi.plain.json" "$2" \
    && pass "$1:same" || fail "$1:same" "the 2-rank speculative chat differs from one plain process"
}
same_turns mpi "$OUT/mpi.spec.json"
# a draft model: each rank drafts with its own copy
expect_exit mpi-draft 0 $MPI -np 2 $K3 chat $M --gen 24 --temperature 0.9 --seed 5 --state-grid 5 --draft $M \
  --out "$OUT/mpi.draft.json" <"$OUT/three.txt"
same_turns mpi-draft "$OUT/mpi.draft.json"
finish
