#!/usr/bin/env bash
# asan
# k3 run: the tiny released-layout checkpoint reproduces the peer's torch greedy
# decode, --full and --threads give the same logits bytes, and every bad input
# is one error line with its exit code.
. "$(dirname "$0")/lib.sh"
TINY=$(fixture peer/tiny-checkpoint)
KIMI=$(fixture tokenizer/kimi)

# the "generated_ids" array of a JSON file, whitespace removed
gen_ids() { tr -d '[:space:]' <"$1" | grep -o '"generated_ids":\[[0-9,]*\]'; }

# ---- the peer's greedy decode, 64/64 ----------------------------------------
expect_exit greedy64 0 $K3 run "$TINY" --ids 3,7,11,5,9 --gen 64 --out "$OUT/g.json" --quiet \
  --dump-logits "$OUT/inc.bin" --threads 2
want=$(gen_ids "$(fixture peer/tiny-checkpoint.greedy.json)")
got=$(gen_ids "$OUT/g.json")
if [ -n "$want" ] && [ "$want" = "$got" ]; then pass greedy64:ids; else fail greedy64:ids "got $got"; fi
for k in prompt_ids prefill_s decode_s tokens_per_s peak_rss_bytes threads; do
  grep -q "\"$k\"" "$OUT/g.json" && pass "out-json:$k" || fail "out-json:$k" "missing key"
done
# one row of 256 logits per token fed: 5 prompt + 63 generated
size=$(stat -c %s "$OUT/inc.bin")
[ "$size" -eq $(( (5 + 63) * 256 * 4 )) ] && pass dump:size || fail dump:size "$size bytes"

# ---- --full and --threads 1 give the same logits bytes ----------------------
expect_exit full 0 $K3 run "$TINY" --ids 3,7,11,5,9 --gen 64 --full --quiet --dump-logits "$OUT/full.bin" --threads 2
cmp -s "$OUT/inc.bin" "$OUT/full.bin" && pass full:bitwise || fail full:bitwise "logits differ"
expect_exit threads1 0 $K3 run "$TINY" --ids 3,7,11,5,9 --gen 64 --quiet --dump-logits "$OUT/t1.bin" --threads 1
cmp -s "$OUT/inc.bin" "$OUT/t1.bin" && pass threads:bitwise || fail threads:bitwise "logits differ"

# the released engine's form: k3 MODEL_DIR; ids stream to stdout without a tokenizer
expect_exit alias 0 $K3 "$TINY" --ids 3,7,11,5,9 --gen 3 --incremental
expect_out_contains alias "92 168 13"
expect_exit help 0 $K3 "$TINY" --help
expect_out_contains help "--dump-logits"
expect_exit layers 0 $K3 run "$TINY" --ids 3,7 --gen 2 --layers 2 --quiet

# sampling: the same seed gives the same tokens
expect_exit sample1 0 $K3 run "$TINY" --ids 3,7,11 --gen 16 --temperature 0.9 --top-k 40 --top-p 0.95 --seed 5 --out "$OUT/s1.json" --quiet
expect_exit sample2 0 $K3 run "$TINY" --ids 3,7,11 --gen 16 --temperature 0.9 --top-k 40 --top-p 0.95 --seed 5 --out "$OUT/s2.json" --quiet
[ "$(gen_ids "$OUT/s1.json")" = "$(gen_ids "$OUT/s2.json")" ] && pass sample:reproducible || fail sample:reproducible
[ "$(gen_ids "$OUT/s1.json")" != "$got" ] && pass sample:not-greedy || fail sample:not-greedy

# with a tokenizer: text streams to stdout and lands in --out (single-byte ids fit the tiny vocab)
expect_exit text 0 $K3 run "$TINY" --tok "$KIMI" --prompt "Q" --gen 4 --out "$OUT/t.json"
grep -q '"text"' "$OUT/t.json" && pass text:key || fail text:key
# ... and that text is the generated ids detokenized (k3 detokenize, whose
# bytes tests/cli/test_tokenize.sh holds to tiktoken's); JSON needs valid
# UTF-8, so where the bytes are not, each byte >= 0x80 is written as '?'
ids=$(gen_ids "$OUT/t.json" | grep -o '[0-9,]*\]' | tr -d ']')
if expect_exit text_detok 0 $K3 detokenize "$KIMI" --ids "$ids"; then
  if ! command -v python3 >/dev/null; then skip text:detokenized "python3 missing (to read the JSON string)"
  elif python3 - "$OUT/t.json" "$OUT/text_detok.out" <<'PY'
import json, sys
text = json.load(open(sys.argv[1]))["text"]
raw = open(sys.argv[2], "rb").read()
try: want = raw.decode("utf-8")
except UnicodeDecodeError: want = "".join(chr(b) if b < 0x80 else "?" for b in raw)
sys.exit(0 if raw and text == want else 1)
PY
  then pass text:detokenized; else fail text:detokenized "text $(grep '"text"' "$OUT/t.json") vs ids $ids"; fi
fi

# generation stops at the config's eos_token_id (here the 3rd greedy token, 13)
mkdir -p "$OUT/eos"
sed 's/"vocab_size": 256,/"vocab_size": 256, "eos_token_id": 13,/' "$TINY/config.json" >"$OUT/eos/config.json"
ln -sf "$(cd "$TINY" && pwd)/model.safetensors" "$OUT/eos/model.safetensors"
expect_exit eos 0 $K3 run "$OUT/eos" --ids 3,7,11,5,9 --gen 10 --out "$OUT/eos.json" --quiet
[ "$(gen_ids "$OUT/eos.json")" = '"generated_ids":[92,168,13]' ] && pass eos:stops || fail eos:stops "$(gen_ids "$OUT/eos.json")"
grep -q '"stop": "eos"' "$OUT/eos.json" && pass eos:reason || fail eos:reason

# ---- usage errors (exit 2) ------------------------------------------------------
expect_exit no-prompt 2 $K3 run "$TINY" --gen 2
expect_exit two-prompts 2 $K3 run "$TINY" --ids 1,2 --prompt hi
expect_exit full-and-inc 2 $K3 run "$TINY" --ids 1 --full --incremental
expect_exit bad-gen 2 $K3 run "$TINY" --ids 1 --gen -3
expect_exit topk-greedy 2 $K3 run "$TINY" --ids 1 --top-k 5
expect_exit id-range 2 $K3 run "$TINY" --ids 3,256
expect_exit empty-ids 2 $K3 run "$TINY" --ids ""
expect_exit empty-prompt 2 $K3 run "$TINY" --tok "$KIMI" --prompt ""
: >"$OUT/empty.txt"
expect_exit empty-file 2 $K3 run "$TINY" --tok "$KIMI" --prompt-file "$OUT/empty.txt"
expect_err_contains empty-file "empty prompt"
expect_exit no-tokenizer 2 $K3 run "$TINY" --prompt hello
expect_err_contains no-tokenizer "--ids"
expect_exit prompt-vocab 2 $K3 run "$TINY" --tok "$KIMI" --prompt "hello world"
expect_err_contains prompt-vocab "outside the model's vocabulary"
expect_exit no-dir 2 $K3 run "$OUT/does-not-exist" --ids 1

# ---- cannot fit (exit 3) ----------------------------------------------------------
expect_exit gen-too-big 3 $K3 run "$TINY" --ids 1,2 --gen 100000000000
expect_exit max-memory 3 $K3 run "$TINY" --ids 1,2 --gen 8 --max-memory 1M
expect_err_contains max-memory "--max-memory"

# ---- checkpoint data errors (exit 4): same-length edits of the header -------------
broken() { # NAME PERL-SUBSTITUTION
  mkdir -p "$OUT/$1"
  cp "$TINY/config.json" "$OUT/$1/"
  perl -0777 -pe "$2" "$TINY/model.safetensors" >"$OUT/$1/model.safetensors"
}
broken missing 's/layers\.2\.self_attn\.q_proj\.weight/layers.2.self_attn.q_prox.weight/'
expect_exit missing-tensor 4 $K3 run "$OUT/missing" --ids 1
expect_err_contains missing-tensor "missing tensor language_model.model.layers.2.self_attn.q_proj.weight"
broken shape 's/("language_model\.model\.layers\.1\.self_attn\.o_proj\.weight": \{"dtype": "BF16", "shape": )\[128, 64\]/$1\[64, 128\]/'
expect_exit wrong-shape 4 $K3 run "$OUT/shape" --ids 1
expect_err_contains wrong-shape "layers.1.self_attn.o_proj.weight: shape [64, 128], expected [128, 64]"
broken dtype 's/("language_model\.model\.layers\.2\.self_attn\.v_proj\.weight": \{"dtype": )"BF16"/$1"I16" /'
expect_exit wrong-dtype 4 $K3 run "$OUT/dtype" --ids 1
expect_err_contains wrong-dtype "layers.2.self_attn.v_proj.weight"
broken expert 's/(experts\.3\.w2\.weight_packed": \{"dtype": )"U8", /$1"I8", /'
expect_exit expert-dtype 4 $K3 run "$OUT/expert" --ids 1
expect_err_contains expert-dtype "experts.3.w2.weight_packed: dtype"
# --layers 1 needs only layer 0: a broken layer 2 is not read
expect_exit layers-skip 0 $K3 run "$OUT/missing" --ids 1 --gen 1 --layers 1 --quiet
# an endless prompt file is refused at once, bounded in time and memory
expect_exit prompt_file_dev_zero 2 bash -c "$MEM_CAP timeout 20 '$K3' run tests/fixtures/trained-5m --prompt-file /dev/zero"
expect_err_contains prompt_file_dev_zero "not a regular file"

finish
