#!/usr/bin/env bash
# asan
# A checkpoint with a non-finite weight: one element of lm_head row 5 set to
# NaN in a copy of the model, so the logit of token 5 is NaN at every position.
# Every generator refuses to sample from such logits (model.h,
# k3_logits_check): `k3 run` and `k3 chat` stop with exit 4 and one line naming
# the logit; `k3 serve` answers the request with HTTP 500 and an OpenAI error
# object (code non_finite_logits; a stream gets it as its last event) and
# keeps serving.
set -u
source tests/cli/lib.sh
PY=/usr/bin/python3
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT

# poison DIR: lm_head.weight[5][0] = NaN, in whichever shard of DIR holds it
poison() {
  $PY - "$1" <<'PY'
import glob, json, struct, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        names = [k for k in h if k.endswith("lm_head.weight")]
        if not names:
            continue
        t = h[names[0]]
        size, nan = {"BF16": (2, b"\xc0\x7f"), "F32": (4, b"\x00\x00\xc0\x7f")}[t["dtype"]]
        f.seek(8 + n + t["data_offsets"][0] + 5 * t["shape"][1] * size)
        f.write(nan)
        sys.exit(0)
sys.exit("no lm_head.weight in " + sys.argv[1])
PY
}

# ---- k3 run ----
NAN=$OUT/nan-smol
rm -rf "$NAN"; cp -r models/default "$NAN"; poison "$NAN" || fail poison-smol
expect_exit run-nan 4 "$K3" run "$NAN" --prompt "Once upon a time" --gen 8 --quiet
# the first logits checked are the prompt's last: after its n tokens
n=$("$K3" tokenize models/default --text "Once upon a time" | tr ',' '\n' | grep -c .)
expect_err_contains run-nan "logit 5 is not finite (nan) after $n tokens: the checkpoint holds non-finite weights"
expect_exit run-clean 0 "$K3" run models/default --prompt "Once upon a time" --gen 8 --quiet

# ---- k3 chat (a small random chat model with the Kimi vocabulary) ----
if $PY -c 'import numpy' 2>/dev/null; then
  CM=tests/out/nonfinite-chat-model
  chat_model $CM 3
  NANCHAT=$OUT/nan-chat
  rm -rf "$NANCHAT"; cp -r "$CM" "$NANCHAT"; poison "$NANCHAT" || fail poison-chat
  printf 'Hello there\n' >"$OUT/one.txt"
  expect_exit chat-nan 4 "$K3" chat "$NANCHAT" --gen 4 --no-think <"$OUT/one.txt"
  expect_err_contains chat-nan "logit 5 is not finite (nan)"
  expect_exit chat-clean 0 "$K3" chat "$CM" --gen 4 --no-think <"$OUT/one.txt"
else
  skip chat-nan "python3 with numpy missing: the chat model cannot be generated (scripts/setup.sh --test)"
fi

# ---- k3 serve ----
start_server "$OUT/server.log" "$K3" serve "$NAN" --port 0
SPID=$SERVER_PID; PORT=$SERVER_PORT
if [ -z "$PORT" ]; then fail serve-start "$(head -c 600 "$OUT/server.log.err")"; finish; exit 1; fi
URL=http://127.0.0.1:$PORT
code=$(curl -H 'Content-Type: application/json' -s --max-time 60 -o "$OUT/body.json" -w '%{http_code}' --data-binary '{"prompt":"Once upon a time","max_tokens":8}' "$URL/v1/completions")
got=$($PY -c 'import json,sys; e=json.load(open(sys.argv[1]))["error"]; print(e["type"], e["code"], "logit 5 is not finite" in e["message"])' "$OUT/body.json" 2>&1)
if [ "$code|$got" = "500|server_error non_finite_logits True" ]; then pass serve-nan; else fail serve-nan "HTTP $code: $(head -c 300 "$OUT/body.json")"; fi
curl -H 'Content-Type: application/json' -s -N --max-time 60 --data-binary '{"prompt":"Once upon a time","max_tokens":8,"stream":true}' "$URL/v1/completions" >"$OUT/nan.sse"
last=$(grep '^data: ' "$OUT/nan.sse" | tail -n 2 | head -n 1)
if printf %s "$last" | grep -q '"code":"non_finite_logits"' && tail -n 2 "$OUT/nan.sse" | grep -q '^data: \[DONE\]'; then pass serve-nan-stream
else fail serve-nan-stream "$(head -c 300 "$OUT/nan.sse")"; fi
code=$(curl -s --max-time 10 -o "$OUT/health.json" -w '%{http_code}' "$URL/health")
failed=$($PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["requests"]["failed"])' "$OUT/health.json" 2>&1)
if [ "$code|$failed" = "200|2" ]; then pass serve-alive; else fail serve-alive "HTTP $code, failed $failed"; fi
if grep -q 'failed: .*logit 5 is not finite' "$OUT/server.log.err"; then pass serve-logged; else fail serve-logged "$(tail -c 300 "$OUT/server.log.err")"; fi
kill -TERM "$SPID"
for _ in $(seq 200); do kill -0 "$SPID" 2>/dev/null || break; sleep 0.1; done
wait "$SPID" 2>/dev/null; rc=$?
if [ "$rc" = 0 ]; then pass serve-stop; else fail serve-stop "exit $rc"; fi
finish
