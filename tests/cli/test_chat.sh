#!/usr/bin/env bash
# asan
# `k3 chat`: a piped three-turn conversation on a small random model with the
# full Kimi vocabulary (163,840 ids; generated at test time by
# tools/gen_checkpoint.py with the Kimi tokenizer, cached under tests/out).
# The reference for every reply is `k3 run --ids` on that turn's whole prompt
# (a cold prefill of the conversation, another code path), same sampling seed.
#  - turn 2 and 3 report reused tokens and give the cold run's ids;
#  - after /reset a conversation with the same system prompt resumes at the
#    system message's end (a message-boundary snapshot) and equals a cold run;
#  - 1 vs 2 threads, --cold and a streamed budget (--trunk, tiny --cache-gb)
#    give the same ids;
#  - /save then --load (or /load) in a new process continues bit-identically,
#    feeding only the new message; a session saved with thinking off loads
#    with it off, and the loaded line and the banner say so;
#  - a corrupt or truncated session file and another model's session: exit 4,
#    one line; a /save, /load or --out that fails (full device, missing
#    folder, a directory): one line, the chat goes on, the exit status says so; a model whose tokenizer has no XTML ids: exit 2, one line.
. "$(dirname "$0")/lib.sh"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
need_chat_python
M=tests/out/chat-model-a
M2=tests/out/chat-model-b
chat_model $M 3 && chat_model $M2 4 || { finish; exit 1; }

SAMPLE="--temperature 0.9 --top-k 50 --seed 7"
CHAT="$K3 chat $M --gen 10 $SAMPLE --system You_are_a_test."
printf 'Hello there\nWhat is 2+2?\nAnd once more.\n' >"$OUT/three.txt"

# ids of a field in the transcript, one line per turn
turns() { $PY -c '
import json, sys
d = json.load(open(sys.argv[1]))
for t in d["turns"]: print(",".join(map(str, t[sys.argv[2]])) if isinstance(t[sys.argv[2]], list) else t[sys.argv[2]])
' "$1" "$2"; }

expect_exit three 0 $CHAT --threads 1 --out "$OUT/t1.json" <"$OUT/three.txt"
[ "$(grep -c '^\[turn ' "$OUT/three.err")" -eq 3 ] && pass three:stats || fail three:stats "$(head -c 300 "$OUT/three.err")"
grep -q 'first token .* tok/s' "$OUT/three.err" && pass three:ttft || fail three:ttft
mapfile -t reused < <(turns "$OUT/t1.json" reused)
mapfile -t plen < <($PY -c '
import json, sys
for t in json.load(open(sys.argv[1]))["turns"]: print(len(t["prompt_ids"]))' "$OUT/t1.json")
[ "${reused[0]}" = 0 ] && pass turn1:cold || fail turn1:cold "reused ${reused[0]}"
# turn 2 resumes at least from turn 1's prompt end (its prompt is a prefix)
[ "${reused[1]}" -ge "${plen[0]}" ] && grep -q "^\[turn 2: prompt ${plen[1]} tokens, reused ${reused[1]} " "$OUT/three.err" \
  && pass turn2:reused || fail turn2:reused "reused ${reused[1]}, turn 1 prompt ${plen[0]}"
[ "${reused[2]}" -ge "${plen[1]}" ] && pass turn3:reused || fail turn3:reused "reused ${reused[2]}"

# every turn against a cold `k3 run` of its whole prompt, seed + turn index
mapfile -t prompts < <(turns "$OUT/t1.json" prompt_ids)
mapfile -t gens < <(turns "$OUT/t1.json" generated_ids)
for t in 0 1 2; do
  expect_exit "cold$t" 0 $K3 run $M --ids "${prompts[$t]}" --gen 10 --temperature 0.9 --top-k 50 \
    --seed $((7 + t)) --threads 1 --quiet --out "$OUT/cold$t.json"
  want=$(tr -d '[:space:]' <"$OUT/cold$t.json" | grep -o '"generated_ids":\[[0-9,]*\]' | grep -o '[0-9,]*\]' | tr -d ']')
  # k3 run stops only at eos_token_id; chat also at [EOS]: compare chat's reply as a prefix
  case ",$want," in ",${gens[$t]},"*) pass "turn$((t + 1)):ids_equal_cold" ;;
    *) fail "turn$((t + 1)):ids_equal_cold" "chat ${gens[$t]} vs run $want" ;; esac
done

# threads, --cold, a streamed budget: the same replies
expect_exit threads2 0 $CHAT --threads 2 --out "$OUT/t2.json" <"$OUT/three.txt"
[ "$(turns "$OUT/t2.json" generated_ids)" = "$(turns "$OUT/t1.json" generated_ids)" ] && pass threads:1_eq_2 \
  || fail threads:1_eq_2
expect_exit cold 0 $CHAT --cold --out "$OUT/tc.json" <"$OUT/three.txt"
[ "$(turns "$OUT/tc.json" generated_ids)" = "$(turns "$OUT/t1.json" generated_ids)" ] && pass cold:same_ids \
  || fail cold:same_ids
[ "$(turns "$OUT/tc.json" reused | tr '\n' ' ')" = "0 0 0 " ] && pass cold:reuses_nothing || fail cold:reuses_nothing
expect_exit pack 0 $K3 pack-trunk $M "$OUT/trunk"
expect_exit streamed 0 $CHAT --trunk "$OUT/trunk" --trunk-gb 0.06 --cache-gb 0.0002 --chunk 3 --state-cache-gb 0.01 \
  --out "$OUT/ts.json" <"$OUT/three.txt"
[ "$(turns "$OUT/ts.json" generated_ids)" = "$(turns "$OUT/t1.json" generated_ids)" ] && pass streamed:same_ids \
  || fail streamed:same_ids

# /think off re-renders turn 1's reply without its think channel, so the
# history diverges inside turn 1's generation prefix: the session and the
# prompt-end snapshot do not match, the deepest grid snapshot (grid 8) before
# the divergence does; the reply equals a cold run
printf 'Hello there\n/think off\nWhat is 2+2?\n' >"$OUT/think.txt"
expect_exit think 0 $CHAT --state-grid 8 --out "$OUT/tt.json" <"$OUT/think.txt"
mapfile -t tre < <(turns "$OUT/tt.json" reused)
mapfile -t tpr < <(turns "$OUT/tt.json" prompt_ids)
mapfile -t tge < <(turns "$OUT/tt.json" generated_ids)
div=$($PY -c 'import sys; a, b = (s.split(",") for s in sys.argv[1:3]); print(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))' \
  "${tpr[0]}" "${tpr[1]}")
[ "${tre[1]}" -gt 0 ] && [ "${tre[1]}" -le "$div" ] && [ $((tre[1] % 8)) -eq 0 ] && [ "${tre[1]}" -gt $((div - 8)) ] \
  && pass "think_off:grid_snapshot(reused=${tre[1]},diverged=$div)" \
  || fail think_off:grid_snapshot "reused ${tre[1]}, prompts diverge at $div"
expect_exit think_cold 0 $K3 run $M --ids "${tpr[1]}" --gen 10 --temperature 0.9 --top-k 50 --seed 8 --quiet \
  --out "$OUT/think_cold.json"
want=$(tr -d '[:space:]' <"$OUT/think_cold.json" | grep -o '"generated_ids":\[[0-9,]*\]' | grep -o '[0-9,]*\]' | tr -d ']')
case ",$want," in ",${tge[1]},"*) pass think_off:ids_equal_cold ;; *) fail think_off:ids_equal_cold "${tge[1]} vs $want" ;; esac

# /reset then a new conversation with the same system prompt: turn 1 left a
# snapshot at the system message's end (a message boundary), so the new
# conversation resumes there (reused = the system message's token count, far
# below the 1024 grid) and its greedy reply equals a cold run's
SYSP=$($PY -c 'print(" ".join("Be kind and brief, rule %d." % i for i in range(30)))')
$PY -c 'import json,sys; json.dump({"messages":[{"role":"system","content":sys.argv[1]}],"add_generation_prompt":False},open(sys.argv[2],"w"))' \
  "$SYSP" "$OUT/sysp.json"
NSYS=$($K3 tokenize $M --chat "$OUT/sysp.json" | tr ',' '\n' | grep -c .)
printf 'Hello there\n/reset\nWhat is 2+2?\n' >"$OUT/reset.txt"
expect_exit reset 0 $K3 chat $M --gen 10 --temperature 0 --system "$SYSP" --out "$OUT/tr.json" <"$OUT/reset.txt"
mapfile -t rre < <(turns "$OUT/tr.json" reused)
mapfile -t rpr < <(turns "$OUT/tr.json" prompt_ids)
mapfile -t rge < <(turns "$OUT/tr.json" generated_ids)
[ "${rre[1]}" = "$NSYS" ] && pass "reset:resumes_system_prompt($NSYS)" || fail reset:resumes_system_prompt "reused ${rre[1]}, system message $NSYS tokens"
expect_exit reset_cold 0 $K3 run $M --ids "${rpr[1]}" --gen 10 --temperature 0 --quiet --out "$OUT/reset_cold.json"
want=$(tr -d '[:space:]' <"$OUT/reset_cold.json" | grep -o '"generated_ids":\[[0-9,]*\]' | grep -o '[0-9,]*\]' | tr -d ']')
case ",$want," in ",${rge[1]},"*) pass reset:ids_equal_cold ;; *) fail reset:ids_equal_cold "${rge[1]} vs $want" ;; esac

# save after two turns, continue in a new process
S=$OUT/conv.k3session
rm -f "$S"
printf 'Hello there\nWhat is 2+2?\n/save %s\nAnd once more.\n' "$S" >"$OUT/save.txt"
expect_exit save 0 $CHAT --out "$OUT/tsave.json" <"$OUT/save.txt"
[ -s "$S" ] && pass save:file || fail save:file
[ "$(turns "$OUT/tsave.json" generated_ids)" = "$(turns "$OUT/t1.json" generated_ids)" ] && pass save:same_ids \
  || fail save:same_ids
g3=$(turns "$OUT/t1.json" generated_ids | sed -n 3p)
echo 'And once more.' >"$OUT/third.txt"
expect_exit load 0 $CHAT --load "$S" --out "$OUT/tload.json" <"$OUT/third.txt"
[ "$(turns "$OUT/tload.json" generated_ids)" = "$g3" ] && pass load:continues_bit_identically \
  || fail load:continues_bit_identically "$(turns "$OUT/tload.json" generated_ids) vs $g3"
[ "$(turns "$OUT/tload.json" prompt_ids)" = "$(turns "$OUT/t1.json" prompt_ids | sed -n 3p)" ] && pass load:same_prompt \
  || fail load:same_prompt
lr=$(turns "$OUT/tload.json" reused)
[ "$lr" -ge "${plen[1]}" ] && pass "load:reused=$lr" || fail load:reused "$lr"
printf '/load %s\nAnd once more.\n' "$S" >"$OUT/load2.txt"
expect_exit load_cmd 0 $CHAT --out "$OUT/tload2.json" <"$OUT/load2.txt"
[ "$(turns "$OUT/tload2.json" generated_ids)" = "$g3" ] && pass load_cmd:same_ids || fail load_cmd:same_ids
# a conversation saved with /think off loads with thinking off, and says so:
# on the loaded line and, in a terminal (script(1) gives chat a pty), in the
# banner, which must not state --think's default
ST=$OUT/think-off.k3session
rm -f "$ST"
printf 'Hello there\n/think off\n/save %s\n' "$ST" >"$OUT/saveoff.txt"
expect_exit save_think_off 0 $CHAT <"$OUT/saveoff.txt"
expect_exit load_think_off 0 $CHAT --load "$ST" </dev/null
expect_err_contains load_think_off "3 messages, 1 turn from $ST; thinking off]"
if command -v script >/dev/null; then
  printf '/quit\n' | script -qec "$CHAT --load '$ST'" /dev/null >"$OUT/load_banner.out" 2>&1
  grep -q '^k3 chat: .*; thinking off' "$OUT/load_banner.out" && pass load:banner_thinking_off \
    || fail load:banner_thinking_off "$(grep '^k3 chat: ' "$OUT/load_banner.out")"
else
  skip load:banner_thinking_off "no script(1) to give k3 chat a terminal"
fi

# chat_exit NAME CODE CMD...: the exit status only (stderr also holds the turn lines)
chat_exit() {
  local name=$1 code=$2; shift 2
  "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  [ "$rc" -eq "$code" ] && pass "$name" || fail "$name" "exit $rc, wanted $code; stderr: $(head -c 300 "$OUT/$name.err")"
}
# refusals
$PY - "$S" "$OUT/corrupt.k3session" <<'EOF'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
b[len(b) // 2] ^= 0x40
open(sys.argv[2], "wb").write(b)
EOF
expect_exit corrupt 4 $CHAT --load "$OUT/corrupt.k3session" </dev/null
expect_err_contains corrupt "corrupt"
head -c 1000 "$S" >"$OUT/short.k3session"
expect_exit truncated 4 $CHAT --load "$OUT/short.k3session" </dev/null
expect_err_contains truncated "truncated"
printf '/load %s\nHi\n' "$OUT/corrupt.k3session" >"$OUT/loadbad.txt"
chat_exit corrupt_cmd 4 $CHAT <"$OUT/loadbad.txt"
[ "$(grep -c "^\[turn " "$OUT/corrupt_cmd.err")" = 1 ] && pass corrupt_cmd:goes_on || fail corrupt_cmd:goes_on
expect_exit other_model 4 $K3 chat $M2 --load "$S" </dev/null
expect_err_contains other_model "another model"
expect_exit no_tokenizer 2 $K3 chat tests/fixtures/gen/k3_like </dev/null
expect_exit no_xtml 2 $K3 chat models/default </dev/null
expect_err_contains no_xtml "XTML"
# ... and says what to use instead: the shipped chat model (test_chat_model.sh
# chats with it), or a random one (lib.sh's chat_model is that recipe at
# smaller dimensions)
expect_err_contains no_xtml "the shipped chat model models/chat"
expect_err_contains no_xtml "the Kimi K3 release, or a small random one from \`python3 tools/gen_checkpoint.py DIR --preset tiny --set vocab_size=163840\`"
[ "$(wc -l <"$OUT/no_xtml.err")" = 1 ] && pass no_xtml:one_line || fail no_xtml:one_line "$(cat "$OUT/no_xtml.err")"
expect_exit bad_flag 2 $K3 chat $M --state-cache-gb lots </dev/null
# --load of a link to an endless device: refused at once, bounded in time and memory
ln -sf /dev/zero "$OUT/zero.k3session"
expect_exit load_dev_zero 2 bash -c "$MEM_CAP timeout 20 '$K3' chat '$M' --load '$OUT/zero.k3session' </dev/null"
expect_err_contains load_dev_zero "not a regular file"
# invalid UTF-8 is refused with one line, as `k3 run --prompt` refuses it, never sent as an empty message
expect_exit bad_utf8_line 2 $CHAT < <(printf 'caf\xe9 au lait\n')
expect_err_contains bad_utf8_line "UTF-8"
expect_exit bad_utf8_system 2 $K3 chat $M --system "$(printf 'caf\xe9')" </dev/null
expect_err_contains bad_utf8_system "UTF-8"
expect_exit bad_cmd 2 $CHAT <<<'/frobnicate'

# the engine's flags name the command they were given to; a state cache past
# the largest budget says so
for c in chat eval serve; do
  expect_exit "chunk0_$c" 2 $K3 $c $M --chunk 0 </dev/null
  expect_err_contains "chunk0_$c" "$c: --chunk: '0' is not in 1..4096"
done
expect_exit state_cache_huge 2 $K3 chat $M --state-cache-gb 1e30 </dev/null
expect_err_contains state_cache_huge "over the largest budget"
# eval --compare --max-tokens with two tokenizers: N tokens are two spans of
# text, and the output says so (the same tokenizer twice: the same span)
printf 'Internationalization and extraordinarily unconventional photosynthesis.\n' >"$OUT/span.txt"
expect_exit compare_spans 0 $K3 eval --compare tests/fixtures/trained-5m $M --text "$OUT/span.txt" --max-tokens 8 --quiet
expect_out_contains compare_spans "different spans"
expect_exit compare_spans_json 0 $K3 eval --compare tests/fixtures/trained-5m $M --text "$OUT/span.txt" --max-tokens 8 --quiet --json
grep -q '"same_span": false' "$OUT/compare_spans_json.out" && pass compare_spans:json || fail compare_spans:json
expect_exit compare_same 0 $K3 eval --compare $M $M --text "$OUT/span.txt" --max-tokens 8 --quiet
grep -q 'different spans' "$OUT/compare_same.out" && fail compare_same:no_note || pass compare_same:no_note

# a line that fails (a /save, /load or --out that cannot be done) prints one
# error line and the chat goes on with the conversation kept; the exit status
# at the end is the first failure's code, and /quit is not a failure
nturns() { grep -c '^\[turn ' "$OUT/$1.err"; }
nerrs() { grep -c '^k3: ' "$OUT/$1.err"; }
printf 'Hello there\n/save /dev/full\nWhat is 2+2?\n' >"$OUT/savefull.txt"
chat_exit save_full 1 $CHAT --out "$OUT/tfull.json" <"$OUT/savefull.txt"
[ "$(nturns save_full)" = 2 ] && [ "$(nerrs save_full)" = 1 ] && pass save_full:goes_on \
  || fail save_full:goes_on "$(head -c 400 "$OUT/save_full.err")"
expect_err_contains save_full "/dev/full"
# the second reply is turn 2 of the uninterrupted conversation
[ "$(turns "$OUT/tfull.json" generated_ids)" = "$(turns "$OUT/t1.json" generated_ids | sed -n 1,2p)" ] \
  && pass save_full:kept || fail save_full:kept
printf 'Hello there\n/save %s\nWhat is 2+2?\n' "$OUT/no-such-folder/s.k3session" >"$OUT/savemiss.txt"
chat_exit save_missing_dir 1 $CHAT <"$OUT/savemiss.txt"
[ "$(nturns save_missing_dir)" = 2 ] && [ "$(nerrs save_missing_dir)" = 1 ] && pass save_missing_dir:goes_on \
  || fail save_missing_dir:goes_on "$(head -c 400 "$OUT/save_missing_dir.err")"
printf 'Hello there\n/save %s\nWhat is 2+2?\n' "$OUT" >"$OUT/savedir.txt"
chat_exit save_dir 2 $CHAT <"$OUT/savedir.txt"
[ "$(nturns save_dir)" = 2 ] && pass save_dir:goes_on || fail save_dir:goes_on "$(head -c 400 "$OUT/save_dir.err")"
long=$(printf 'n%.0s' $(seq 300))
printf 'Hello there\n/save %s/%s\nWhat is 2+2?\n' "$OUT" "$long" >"$OUT/savelong.txt"
chat_exit save_long_name 1 $CHAT <"$OUT/savelong.txt"
[ "$(nturns save_long_name)" = 2 ] && pass save_long_name:goes_on || fail save_long_name:goes_on
printf '/load %s\nHello there\n' "$OUT" >"$OUT/loaddir.txt"
chat_exit load_dir 2 $CHAT <"$OUT/loaddir.txt"
[ "$(nturns load_dir)" = 1 ] && [ "$(nerrs load_dir)" = 1 ] && pass load_dir:goes_on \
  || fail load_dir:goes_on "$(head -c 400 "$OUT/load_dir.err")"
# --out on a full device: every turn answered, one error line each, exit 1
chat_exit out_full 1 $CHAT --out /dev/full <"$OUT/three.txt"
[ "$(nturns out_full)" = 3 ] && [ "$(nerrs out_full)" = 3 ] && pass out_full:goes_on \
  || fail out_full:goes_on "$(head -c 400 "$OUT/out_full.err")"
# /quit: ends the chat, exit 0 (or the failure before it)
printf 'Hello there\n/quit\nWhat is 2+2?\n' >"$OUT/quit.txt"
expect_exit quit 0 $CHAT <"$OUT/quit.txt"
[ "$(nturns quit)" = 1 ] && pass quit:stops || fail quit:stops
printf 'Hello there\n/save /dev/full\n/quit\nWhat is 2+2?\n' >"$OUT/quitfail.txt"
chat_exit quit_after_failure 1 $CHAT <"$OUT/quitfail.txt"
[ "$(nturns quit_after_failure)" = 1 ] && pass quit_after_failure:stops || fail quit_after_failure:stops
finish
