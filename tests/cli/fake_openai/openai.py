"""A stand-in for the `openai` Python package, enough to run the client example
of docs/serve.md against a live `k3 serve` where the package is not installed
(Debian has none). The HTTP calls are plain urllib; the replies are turned
into objects the way the real client's are: typed fields as attributes,
fields its types do not declare (k3's reasoning_content) kept as pydantic
"extra" fields. FAKE_OPENAI_MODELS picks how:

  pydantic  real pydantic models with extra="allow" (whichever major is
            installed: Debian's python3-pydantic is v1)
  v1        objects shaped as pydantic v1 keeps extras: plain attributes and
            .dict(), no .model_extra
  v2        objects shaped as pydantic v2 keeps extras: .model_extra, and
            attribute reads that fall back to it

Test knobs: FAKE_OPENAI_MAX_TOKENS caps every request's max_tokens (a random
test model never stops on its own); FAKE_OPENAI_LOG appends one JSON line per
call, {"request": ..., "response": ...} (a stream's response: its chunks).
"""
import json
import os
import urllib.request

# the fields the real client's types declare; anything else is an extra field
KNOWN = {
    "ChatCompletion": ("id", "choices", "created", "model", "object", "usage", "system_fingerprint", "service_tier"),
    "Choice": ("index", "message", "finish_reason", "logprobs"),
    "ChatCompletionMessage": ("role", "content", "tool_calls", "refusal", "function_call", "audio", "annotations"),
    "CompletionUsage": ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                        "completion_tokens_details"),
    "PromptTokensDetails": ("cached_tokens", "audio_tokens"),
    "ChatCompletionChunk": ("id", "choices", "created", "model", "object", "usage", "system_fingerprint",
                            "service_tier"),
    "ChunkChoice": ("index", "delta", "finish_reason", "logprobs"),
    "ChoiceDelta": ("role", "content", "tool_calls", "refusal", "function_call"),
}
# which type a nested field has
NESTED = {
    ("ChatCompletion", "choices"): "Choice", ("ChatCompletion", "usage"): "CompletionUsage",
    ("Choice", "message"): "ChatCompletionMessage",
    ("CompletionUsage", "prompt_tokens_details"): "PromptTokensDetails",
    ("ChatCompletionChunk", "choices"): "ChunkChoice", ("ChatCompletionChunk", "usage"): "CompletionUsage",
    ("ChunkChoice", "delta"): "ChoiceDelta",
}
FLAVOUR = os.environ.get("FAKE_OPENAI_MODELS", "pydantic")
_classes = {}


def _pydantic_class(name):
    if name not in _classes:
        import typing
        import pydantic
        fields = {f: (typing.Any, None) for f in KNOWN[name]}
        if pydantic.VERSION.startswith("1."):
            class Config:
                extra = "allow"
            _classes[name] = pydantic.create_model(name, __config__=Config, **fields)
        else:
            _classes[name] = pydantic.create_model(name, __config__=pydantic.ConfigDict(extra="allow"), **fields)
    return _classes[name]


class _V1Like:
    """pydantic v1: an extra field is an attribute like any other"""
    def __init__(self, values):
        self.__dict__.update(values)

    def dict(self):
        return dict(self.__dict__)


class _V2Like:
    """pydantic v2: extra fields in model_extra, attribute reads fall back to it"""
    def __init__(self, known, extra):
        self.__dict__.update(known)
        self.__dict__["model_extra"] = extra

    def __getattr__(self, key):  # only for names not set above
        extra = self.__dict__.get("model_extra") or {}
        if key in extra:
            return extra[key]
        raise AttributeError(key)

    def model_dump(self):
        d = {k: v for k, v in self.__dict__.items() if k != "model_extra"}
        d.update(self.__dict__["model_extra"])
        return d


def _build(name, data):
    values = {}
    for k, v in data.items():
        sub = NESTED.get((name, k))
        if sub and isinstance(v, list):
            v = [_build(sub, x) for x in v]
        elif sub and isinstance(v, dict):
            v = _build(sub, v)
        values[k] = v
    known = {f: values.get(f) for f in KNOWN[name]}
    extra = {k: v for k, v in values.items() if k not in KNOWN[name]}
    if FLAVOUR == "v1":
        return _V1Like({**known, **extra})
    if FLAVOUR == "v2":
        return _V2Like(known, extra)
    return _pydantic_class(name)(**known, **extra)


def _log(request, response):
    path = os.environ.get("FAKE_OPENAI_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"request": request, "response": response}) + "\n")


class _Completions:
    def __init__(self, base_url):
        self.base_url = base_url

    def create(self, extra_body=None, **body):
        body.update(extra_body or {})
        cap = int(os.environ.get("FAKE_OPENAI_MAX_TOKENS", "0"))
        if cap:
            body["max_tokens"] = min(body.get("max_tokens") or cap, cap)
        req = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        resp = urllib.request.urlopen(req, timeout=300)
        if not body.get("stream"):
            data = json.load(resp)
            _log(body, data)
            return _build("ChatCompletion", data)
        chunks = []
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        _log(body, chunks)
        return iter([_build("ChatCompletionChunk", c) for c in chunks])


class _Chat:
    def __init__(self, base_url):
        self.completions = _Completions(base_url)


class OpenAI:
    def __init__(self, base_url, api_key=None):
        self.chat = _Chat(base_url.rstrip("/"))
