#!/usr/bin/env bash
# asan
# k3 run --speculate K [--draft DIR]: drafted ids verified in one forward pass
# give exactly plain decoding's output: the same text and the same
# --dump-logits bytes (every row the loop sampled from), greedy and sampled,
# n-gram and draft-model drafts, 1 and 2 threads, resident and with the
# routed experts streamed, drafts capped by the context, under mpirun (n-gram
# and draft model); the
# counters in --out say drafts were proposed and accepted; bad combinations
# are one error line, exit 2; bytes_read_per_token drops with perfect drafts.
# The plain run is the reference: the claim is
# equality with it, never a value the speculative path computed itself.
. "$(dirname "$0")/lib.sh"
M=models/default
# a story that repeats itself, so the n-gram lookup finds drafts the model accepts
P="Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a"

# same NAME PLAIN_ARGS -- SPEC_ARGS: the two runs' stdout and logits rows are equal
same() {
  local name=$1; shift
  local plain=() spec=()
  while [ "$1" != "--" ]; do plain+=("$1"); shift; done
  shift; spec=("$@")
  expect_exit "$name:plain" 0 $K3 run "$M" --prompt "$P" --quiet --dump-logits "$OUT/$name.plain.bin" \
    --out "$OUT/$name.plain.json" "${plain[@]}" || return
  cp "$OUT/$name:plain.out" "$OUT/$name.plain.txt"
  expect_exit "$name:spec" 0 $K3 run "$M" --prompt "$P" --quiet --dump-logits "$OUT/$name.spec.bin" \
    --out "$OUT/$name.spec.json" "${plain[@]}" "${spec[@]}" || return
  cmp -s "$OUT/$name.plain.bin" "$OUT/$name.spec.bin" && pass "$name:logits" \
    || fail "$name:logits" "the logits rows differ from plain decoding's"
  python3 - "$OUT/$name.plain.json" "$OUT/$name.spec.json" <<'PY' && pass "$name:ids" || fail "$name:ids" "generated ids differ"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
sys.exit(0 if a["generated_ids"] == b["generated_ids"] and a["text"] == b["text"] else 1)
PY
}
# counters NAME: the speculative run proposed drafts, accepted some, fed > 1 id a pass
counters() {
  python3 - "$OUT/$1.spec.json" <<'PY' && pass "$1:counters" || fail "$1:counters" "$(head -c 300 "$OUT/$1.spec.json")"
import json, sys
j = json.load(open(sys.argv[1]))
ok = j["drafts_proposed"] > 0 and 0 < j["drafts_accepted"] <= j["drafts_proposed"] and j["tokens_per_pass"] > 1
sys.exit(0 if ok else 1)
PY
}

same ngram-greedy --gen 48 --threads 1 -- --speculate 4
counters ngram-greedy
same ngram-greedy-2t --gen 48 --threads 2 -- --speculate 6
same ngram-sampled --gen 48 --temperature 0.8 --seed 3 --top-k 40 -- --speculate 4
# n-gram drafts without their gate: only the acceptance shortens them
same ngram-ungated --gen 48 -- --speculate 4 --draft-p-min 0
same draft-greedy --gen 40 -- --draft "$M"
counters draft-greedy
same draft-sampled --gen 40 --temperature 0.8 --seed 9 -- --speculate 3 --draft "$M"
# the routed experts read from disk through a cache far smaller than the model
same ngram-streamed --gen 32 --cache-gb 0.001 -- --speculate 4
# bytes_read_per_token: the weights a generated token cost. Perfect drafts (the model
# drafting for itself: every draft accepted) read the weights once a pass of several
# ids, so far fewer bytes a token than plain decoding; the disk part is the stream's
# counters of the decode calls (memory.steps), per generated token
same draft-streamed --gen 32 --cache-gb 0.001 -- --draft "$M"
python3 - "$OUT/draft-streamed.plain.json" "$OUT/draft-streamed.spec.json" <<'PY' && pass bytes-per-token \
  || fail bytes-per-token "$(cat "$OUT/bytes.why")"
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
why = []
for name, j in (("plain", a), ("speculative", b)):
    n = len(j["generated_ids"])
    disk = sum(s["trunk_bytes"] + s["expert_bytes"] for s in j["memory"]["steps"] if s["kind"] == "token")
    if not j["bytes_read_per_token"] > 0: why.append("%s: bytes_read_per_token %r" % (name, j["bytes_read_per_token"]))
    if abs(j["disk_bytes_read_per_token"] * n - disk) > 1e-6 * disk + 1:
        why.append("%s: disk_bytes_read_per_token %r x %d ids != the decode steps' %d bytes" % (name, j["disk_bytes_read_per_token"], n, disk))
if b["drafts_accepted"] != b["drafts_proposed"] or b["decode_passes"] * 2 > a["decode_passes"]:
    why.append("the drafts were not perfect: %d of %d, %d passes" % (b["drafts_accepted"], b["drafts_proposed"], b["decode_passes"]))
if not b["bytes_read_per_token"] * 2 < a["bytes_read_per_token"]:
    why.append("speculative %r bytes a token, plain %r" % (b["bytes_read_per_token"], a["bytes_read_per_token"]))
open(sys.argv[1].rsplit("/", 1)[0] + "/bytes.why", "w").write("; ".join(why))
sys.exit(1 if why else 0)
PY
# a smaller model drafting (the 5M fixture: some drafts rejected), its drafts stopped
# where they are likely rejected (--draft-p-min) or only by the acceptance (0)
D=tests/fixtures/trained-5m
same small-draft --gen 40 --cache-gb 0.001 -- --draft "$D"
counters small-draft
same small-draft-sampled --gen 40 --temperature 0.8 --seed 4 -- --draft "$D" --draft-p-min 0.5
same small-draft-ungated --gen 40 -- --draft "$D" --draft-p-min 0
# more drafts than the context has room for: capped, same output
same beyond-context --gen 3 -- --speculate 16

# ---- refusals --------------------------------------------------------------------------
expect_exit too-many 2 $K3 run "$M" --prompt "$P" --gen 4 --speculate 17
expect_exit with-full 2 $K3 run "$M" --prompt "$P" --gen 4 --full --speculate 2
expect_exit p-min-range 2 $K3 run "$M" --prompt "$P" --gen 4 --draft "$M" --draft-p-min 1.5
expect_err_contains p-min-range "--draft-p-min"
expect_exit p-min-nan 2 $K3 run "$M" --prompt "$P" --gen 4 --draft "$M" --draft-p-min nan
expect_exit p-min-no-draft 2 $K3 run "$M" --prompt "$P" --gen 4 --draft-p-min 0.5
expect_err_contains p-min-no-draft "--speculate K or --draft DIR"
expect_exit p-min-chat 2 $K3 chat "$M" --draft-p-min 0.5 </dev/null
expect_exit p-min-serve 2 $K3 serve "$M" --draft "$M" --draft-p-min -0.1
expect_err_contains with-full "--speculate"
# a draft model whose tokenizer differs by one merge: its ids would mean other text
rm -rf "$OUT/other" && mkdir -p "$OUT/other"
for f in config.json model.safetensors tokenizer_config.json; do ln -s "$PWD/$M/$f" "$OUT/other/$f"; done
head -n -1 "$M/tiktoken.model" >"$OUT/other/tiktoken.model"
expect_exit other-tokenizer 2 $K3 run "$M" --prompt "$P" --gen 4 --draft "$OUT/other"
expect_err_contains other-tokenizer "tokenizer"

# ---- under mpirun: n-gram and draft-model drafts, same bits as one process ----------------
[ "${K3#*asan}" != "$K3" ] && { finish; exit; } # the MPI runs: test_mpi*.sh
mpi_setup
export OMP_NUM_THREADS=1
$K3 run "$M" --prompt "$P" --gen 24 --quiet --dump-logits "$OUT/mpi.plain.bin" >"$OUT/mpi.plain.txt" 2>&1
expect_exit mpi-ngram 0 $MPI -np 2 $K3 run "$M" --prompt "$P" --gen 24 --quiet --speculate 4 \
  --dump-logits "$OUT/mpi.spec.bin"
cmp -s "$OUT/mpi.plain.bin" "$OUT/mpi.spec.bin" && pass mpi-ngram:logits || fail mpi-ngram:logits "differ from one plain process"
# a draft model: every rank runs its own copy, so every rank drafts the same ids
$K3 run "$M" --prompt "$P" --gen 24 --quiet --temperature 0.8 --seed 3 --dump-logits "$OUT/mpi.plain-s.bin" \
  >"$OUT/mpi.plain-s.txt" 2>&1
expect_exit mpi-draft 0 $MPI -np 2 $K3 run "$M" --prompt "$P" --gen 24 --quiet --draft "$D" \
  --dump-logits "$OUT/mpi.draft.bin" --out "$OUT/mpi-draft.spec.json"
cmp -s "$OUT/mpi.plain.bin" "$OUT/mpi.draft.bin" && pass mpi-draft:logits || fail mpi-draft:logits "differ from one plain process"
counters mpi-draft
expect_exit mpi-draft-sampled 0 $MPI -np 2 $K3 run "$M" --prompt "$P" --gen 24 --quiet --draft "$D" \
  --temperature 0.8 --seed 3 --parallel-layout ep --dump-logits "$OUT/mpi.draft-s.bin"
cmp -s "$OUT/mpi.plain-s.bin" "$OUT/mpi.draft-s.bin" && pass mpi-draft-sampled:logits \
  || fail mpi-draft-sampled:logits "differ from one plain process"
finish
