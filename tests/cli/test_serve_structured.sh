#!/usr/bin/env bash
# asan
# k3 serve's structured output on the random full-vocabulary chat model
# (lib.sh's chat_model, 163,840 ids) sampled at temperature 2: every reply
# asked for with response_format json_object or json_schema that ends on its
# own (finish "stop") parses (python3's json, the reference) and matches its
# schema (a validator written out below from JSON Schema's rules, not the
# server's); with thinking on the answer after the reasoning does; a reply cut
# by max_tokens says "length"; a streamed reply concatenates to the same
# content; response_format "text" leaves the reply as without it; a schema
# keyword the server cannot enforce is a 400 naming it. tool_choice
# "required" or a named function: every reply that ends on its own is calls
# (finish "tool_calls") of declared tools (the named one when named) whose
# arguments parse and match the tool's parameters (python's jsonschema when
# this python has it, else the validator below): one or more under
# "required" (some replies several, each with its own id), exactly one when
# named or with parallel_tool_calls false; streamed, the call deltas give
# the same calls at their indexes; "auto" replies as with tool_choice absent;
# under "auto" with strict tools (the ids that spell a call's opening raised
# so that the random model opens calls) every call a reply makes is valid,
# at most one with parallel_tool_calls false; an unenforceable parameters
# keyword is a 400 naming its path. Loopback, every wait bounded.
. "$(dirname "$0")/lib.sh"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
need_chat_python structured
M=tests/out/chat-model-a
chat_model $M 3 || { finish; exit 1; }
kill_pids_at_exit
if ! start_server "$OUT/server.log" "$K3" serve $M --port 0 --ctx 2048 --max-tokens 400; then
  fail start "$(head -c 600 "$OUT/server.log.err")"; finish; exit 1
fi
pass "start ($SERVER_URL)"
URL=${SERVER_URL%/}
ASAN=0
case "$K3" in *asan*) ASAN=1 ;; esac

# The generations: one Python process sends them all (bounded by its timeouts)
# and prints one PASS/FAIL line per check.
$PY - "$URL" "$ASAN" >"$OUT/checks.txt" 2>"$OUT/checks.err" <<'PY'
import json, sys, urllib.request, urllib.error
url, asan = sys.argv[1], sys.argv[2] == "1"
CLOSE = 163588  # <|close|> (<|im_assistant|> in the Kimi tokenizer)

def post(body, timeout=300):
    r = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=timeout) as f:
            return f.status, f.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def valid(s, v):
    """JSON Schema's rules for the keywords the server enforces."""
    if s is True or s == {}: return True
    if "enum" in s and not any(json_eq(v, e) for e in s["enum"]): return False
    if "const" in s and not json_eq(v, s["const"]): return False
    t = s.get("type")
    if t is not None:
        ts = t if isinstance(t, list) else [t]
        ok = False
        for x in ts:
            ok |= {"object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
                   "number": isinstance(v, (int, float)) and not isinstance(v, bool),
                   "integer": isinstance(v, int) and not isinstance(v, bool),
                   "boolean": isinstance(v, bool), "null": v is None}[x]
        if not ok: return False
    if isinstance(v, dict):
        props = s.get("properties", {})
        for r in s.get("required", []):
            if r not in v: return False
        ap = s.get("additionalProperties", True)
        for k, x in v.items():
            if k in props:
                if not valid(props[k], x): return False
            elif ap is False or (isinstance(ap, dict) and not valid(ap, x)):
                return False
    if isinstance(v, list) and "items" in s:
        if not all(valid(s["items"], x) for x in v): return False
    return True

def json_eq(a, b):
    if isinstance(a, bool) or isinstance(b, bool): return a is b
    return a == b

def out(ok, name, why=""):
    print(("PASS " if ok else "FAIL ") + name + ("" if ok else ": " + why[:600]))

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", 3, None]}},
        "required": ["age", "ok", "kind"], "additionalProperties": False},
    "list": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "number"},
             "tag": {"const": "x"}}, "required": ["n", "tag"], "additionalProperties": False}},
    "mixed": {"type": "object", "properties": {"v": {"type": ["integer", "null"]},
              "sub": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"],
                      "additionalProperties": {"type": "null"}},
              "arr": {"type": "array", "items": {"enum": [1, 2]}}},
              "required": ["v", "sub"], "additionalProperties": {"type": "integer"}},
    "scalar": {"type": "integer"},
}
msgs = [{"role": "user", "content": "Reply with JSON."}]
n_req = 2 if asan else 4
stats = {"stop": 0, "length": 0}
cases = []
for name, schema in SCHEMAS.items():
    for think in (False, True):
        for seed in range(n_req):
            cases.append((name, schema, think, seed))
cases.append(("json_object", None, False, 0))
cases.append(("json_object", None, True, 1))
for name, schema, think, seed in cases:
    rf = {"type": "json_object"} if schema is None else \
         {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    body = {"messages": msgs, "temperature": 2, "seed": seed, "max_tokens": 120 if asan else 300,
            "response_format": rf, "enable_thinking": think}
    # with thinking on, a bias on <|close|> ends the (random) reasoning at once;
    # while the value is incomplete the mask keeps <|close|> out anyway
    body["logit_bias"] = {str(CLOSE): 100}
    tag = "%s:think=%d:seed=%d" % (name, think, seed)
    st, text = post(body)
    if st != 200:
        out(False, tag, "status %d %s" % (st, text)); continue
    ch = json.loads(text)["choices"][0]
    content, fin = ch["message"]["content"], ch["finish_reason"]
    stats[fin] = stats.get(fin, 0) + 1
    if fin == "length":
        # cut by max_tokens: a prefix, never claimed complete
        out(True, tag + ":length"); continue
    if fin != "stop":
        out(False, tag, "finish %s" % fin); continue
    try:
        v = json.loads(content)
    except Exception as e:
        out(False, tag + ":parses", "%s: %r" % (e, content)); continue
    out(True, tag + ":parses")
    ok = isinstance(v, dict) if schema is None else valid(schema, v)
    out(ok, tag + ":valid", "%r against %s" % (content, name))
    if think:
        out(ch["message"].get("reasoning_content", "") == "", tag + ":reasoning", repr(ch["message"]))
out(stats["stop"] >= len(cases) // 3, "complete replies", "finish counts %s" % stats)

# streamed: the deltas concatenate to the non-streamed content
body = {"messages": msgs, "temperature": 2, "seed": 7, "max_tokens": 300, "logit_bias": {str(CLOSE): 100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}},
        "enable_thinking": False}
st, whole = post(body)
body["stream"] = True
st2, sse = post(body)
parts = []
for line in sse.splitlines():
    if line.startswith("data: ") and line != "data: [DONE]":
        for c in json.loads(line[6:]).get("choices", []):
            parts.append(c.get("delta", {}).get("content") or "")
out(st == 200 and st2 == 200 and "".join(parts) == json.loads(whole)["choices"][0]["message"]["content"],
    "stream equals", "%r vs %r" % ("".join(parts), whole[:300]))

# response_format text: the reply is the one without response_format
base = {"messages": msgs, "temperature": 1, "seed": 5, "max_tokens": 24, "enable_thinking": False}
st, a = post(base)
st2, b = post(dict(base, response_format={"type": "text"}))
ca = json.loads(a)["choices"][0]["message"]["content"] if st == 200 else None
cb = json.loads(b)["choices"][0]["message"]["content"] if st2 == 200 else None
out(ca is not None and ca == cb, "text format unchanged", "%r vs %r" % (ca, cb))

# refusals: 400 naming the keyword's path
REFUSED = [
    ({"type": "string", "pattern": "a+"}, "response_format.json_schema.schema.pattern"),
    ({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}},
     "response_format.json_schema.schema.properties.age.minimum"),
    ({"anyOf": [{"type": "string"}]}, "response_format.json_schema.schema.anyOf"),
    ({"$ref": "#/$defs/x", "$defs": {"x": {}}}, "response_format.json_schema.schema.$"),
    ({"type": "array", "items": [{"type": "string"}]}, "response_format.json_schema.schema.items"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "response_format.json_schema.schema.required"),
]
nest = {}
for _ in range(20): nest = {"type": "array", "items": nest}
REFUSED.append((nest, "deeper than"))
for schema, says in REFUSED:
    st, t = post({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    e = json.loads(t).get("error", {}) if t.startswith("{") else {}
    out(st == 400 and e.get("param") == "response_format" and says in e.get("message", ""),
        "refused " + says, "%d %s" % (st, t))
st, t = post({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
out(st == 400 and "json_schema.schema: required" in t, "refused no schema", "%d %s" % (st, t))

# tool_choice: required / named, enforced as the template's call form
try:
    import jsonschema
except ImportError:
    jsonschema = None
OPEN = 163587  # <|open|> (<|im_user|>)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
        "fields": {"type": "array", "items": {"enum": ["t", "wind"]}}, "opt": {"type": ["number", "null"]},
        "tag": {"type": ["string", "integer"], "enum": ["a&b", 7]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "look \"it\" up", "strict": True, "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]}}},
    {"type": "function", "function": {"name": "noargs"}},
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
          "additionalProperties": False}) for t in TOOLS}
# raised <|open|> and <|close|> end values and argument lists within the
# budget (a raw string argument ends only at <|close|>); the mask keeps both
# out wherever they would break the call
BIAS = {str(CLOSE): 20, str(OPEN): 20}

def call_valid(tag, call, want_name):
    fn = call["function"]
    name = fn["name"]
    if name not in PARAMS or (want_name and name != want_name):
        out(False, tag + ":name", repr(name)); return False
    try:
        args = json.loads(fn["arguments"])
    except Exception as e:
        out(False, tag + ":parses", "%s: %r" % (e, fn["arguments"])); return False
    ok = valid(PARAMS[name], args) and isinstance(args, dict)
    if jsonschema is not None:
        try:
            jsonschema.validate(args, PARAMS[name])
        except jsonschema.ValidationError:
            ok = False
    out(ok, tag + ":valid", "%r against %s" % (args, name))
    return ok

def check_call(tag, ch, want_name, one):
    """A reply that ended is calls only: exactly one when one, else one or more."""
    fin, msg = ch["finish_reason"], ch["message"]
    if fin == "length":
        out(True, tag + ":length"); return None
    calls = msg.get("tool_calls") or []
    if fin != "tool_calls" or not calls or (one and len(calls) != 1):
        out(False, tag, "finish %s, message %r" % (fin, msg)); return None
    for k, c in enumerate(calls):
        call_valid("%s:call%d" % (tag, k), c, want_name)
    out(len({c["id"] for c in calls}) == len(calls), tag + ":ids", repr(calls))
    out(msg.get("content") in (None, ""), tag + ":no content", repr(msg.get("content")))
    return calls

stats = {"tool_calls": 0, "length": 0}
n_req = 2 if asan else 3
several = 0
# (tool_choice, parallel_tool_calls: None absent): OpenAI's "required" is one
# or more calls, a named function exactly one, parallel_tool_calls false one
for choice, par in (("required", None), ("named", None), ("required", False)):
    for think in (False, True):
        for seed in range(n_req):
            tc = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
            body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": tc,
                    "temperature": 2, "seed": seed, "max_tokens": 300, "enable_thinking": think,
                    "logit_bias": BIAS}
            if par is not None: body["parallel_tool_calls"] = par
            tag = "tool %s:parallel=%s:think=%d:seed=%d" % (choice, par, think, seed)
            st, text = post(body)
            if st != 200:
                out(False, tag, "status %d %s" % (st, text)); continue
            ch = json.loads(text)["choices"][0]
            stats[ch["finish_reason"]] = stats.get(ch["finish_reason"], 0) + 1
            calls = check_call(tag, ch, "get_weather" if choice == "named" else None, choice == "named" or par is False)
            several += bool(calls) and len(calls) > 1
out(stats["tool_calls"] >= 6 * n_req // 2, "complete calls", "finish counts %s" % stats)

# streamed: the call deltas give the non-streamed calls at their indexes
# (several with this seed), finish tool_calls
for seed in (3, 0, 1, 2):
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "tool_choice": "required",
            "temperature": 2, "seed": seed, "max_tokens": 300, "enable_thinking": False, "logit_bias": BIAS}
    st, whole = post(body)
    w = json.loads(whole)["choices"][0] if st == 200 else {}
    if len(w.get("message", {}).get("tool_calls") or []) > 1: break
body["stream"] = True
st2, sse = post(body)
calls, fins = [], []
for line in sse.splitlines():
    if line.startswith("data: ") and line != "data: [DONE]":
        for c in json.loads(line[6:]).get("choices", []):
            calls += c.get("delta", {}).get("tool_calls") or []
            if c.get("finish_reason"): fins.append(c["finish_reason"])
wcalls = w.get("message", {}).get("tool_calls") or []
several += len(wcalls) > 1
out(several >= 1, "several calls under required", "%d replies with several calls" % several)
out(st == 200 and st2 == 200 and len(calls) == len(wcalls) > 0 and
    all(c["index"] == k and c["function"] == wc["function"] for k, (c, wc) in enumerate(zip(calls, wcalls))) and
    len({c["id"] for c in calls}) == len(calls) and fins == ["tool_calls"] and w.get("finish_reason") == "tool_calls",
    "tool stream equals (%d calls)" % len(wcalls), "%r %r vs %r" % (calls, fins, w))

# auto with strict tools: the reply is free until it opens a call, which is
# then held to the tool's schema. The ids that spell `call tool="` are
# raised so that the random model opens calls at all.
def tokens(text):
    r = urllib.request.Request(url + "/tokenize", json.dumps({"prompt": text}).encode(),
                               {"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=60) as f:
        return json.loads(f.read().decode())["tokens"]
STRICT = [dict(t, function=dict(t["function"], strict=True)) for t in TOOLS]
# They and <|open|> are raised alike, <|close|> a little less (about a
# tenth as likely at temperature 2): about one reply in two then calls.
abias = {str(OPEN): 30, str(CLOSE): 27}
for i in tokens('call tool="'): abias[str(i)] = 30
ncalls = 0
for par in (None, False):
    for seed in range(4 if asan else 6):
        body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": STRICT, "temperature": 2,
                "seed": seed, "max_tokens": 400, "enable_thinking": seed % 2 == 1, "logit_bias": abias}
        if par is not None: body["parallel_tool_calls"] = par
        tag = "tool auto strict:parallel=%s:seed=%d" % (par, seed)
        st, text = post(body)
        if st != 200:
            out(False, tag, "status %d %s" % (st, text)); continue
        ch = json.loads(text)["choices"][0]
        calls = ch["message"].get("tool_calls") or []
        for k, c in enumerate(calls):
            call_valid("%s:call%d" % (tag, k), c, None)
        if par is False: out(len(calls) <= 1, tag + ":at most one", repr(calls))
        ncalls += len(calls)
out(ncalls >= 2, "auto strict calls made (%d)" % ncalls, "%d calls in all" % ncalls)

# auto (and tools with no tool_choice), no strict tool: nothing enforced, the
# reply is the one without the field
LOOSE = [dict(t, function={k: v for k, v in t["function"].items() if k != "strict"}) for t in TOOLS]
for seed in range(2):
    base = {"messages": [{"role": "user", "content": "Weather?"}], "tools": LOOSE, "temperature": 2, "seed": seed,
            "max_tokens": 40, "enable_thinking": seed == 1, "logit_bias": BIAS, "logprobs": True}
    st, a = post(base)
    st2, b = post(dict(base, tool_choice="auto"))
    ma = json.loads(a)["choices"][0] if st == 200 else None
    mb = json.loads(b)["choices"][0] if st2 == 200 else None
    out(ma is not None and ma == mb, "tool_choice auto unchanged:seed=%d" % seed, "%r vs %r" % (ma, mb))

# refusals: 400 naming the parameters keyword's path, param "tools"
bad = [dict(TOOLS[0], function=dict(TOOLS[0]["function"], parameters={"type": "object", "properties": {
    "days": {"type": "integer", "minimum": 1}}}))]
for tc in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    st, t = post({"messages": msgs, "tools": bad, "tool_choice": tc})
    e = json.loads(t).get("error", {}) if t.startswith("{") else {}
    out(st == 400 and e.get("param") == "tools" and
        "tools[0].function.parameters.properties.days.minimum" in e.get("message", ""),
        "tool refused minimum:%s" % ("named" if isinstance(tc, dict) else tc), "%d %s" % (st, t))
st, t = post({"messages": msgs, "tools": bad, "tool_choice": "auto", "max_tokens": 2})
out(st == 200, "tool auto not compiled", "%d %s" % (st, t))
PY
rc=$?
while read -r verdict rest; do
  case "$verdict" in
    PASS) pass "$rest" ;;
    FAIL) fail "${rest%%:*}" "${rest#*: }" ;;
  esac
done <"$OUT/checks.txt"
[ "$rc" -eq 0 ] || fail "checks" "python exit $rc: $(tail -n 5 "$OUT/checks.err")"
[ -s "$OUT/checks.txt" ] || fail "checks" "no output: $(tail -n 5 "$OUT/checks.err")"
# the server is still up and answered everything it was sent
curl -s --max-time 10 "$URL/health" >/dev/null && pass "alive" || fail "alive" "$(tail -n 5 "$OUT/server.log.err")"
finish
