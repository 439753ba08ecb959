// chat.js: the chat page of `k3 serve`. Talks to the same server's
// /v1/chat/completions with stream: true and renders the server-sent events
// as they arrive: reasoning_content into a folded <details>, content below
// it. The whole conversation is resent each turn (as every OpenAI client
// does); the server's state cache makes that cost only the new tokens.
// Models without a chat template get /v1/completions (text continuation).
"use strict";

const $ = (id) => document.getElementById(id);
const history = []; // OpenAI messages of this conversation
let chat = true, model = null, busy = null;

function setStatus(text, bad) {
  $("status").textContent = text;
  $("status").classList.toggle("bad", !!bad);
}

function bubble(role) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  $("log").appendChild(el);
  return el;
}

// The folded think channel of one reply. While reasoning streams in, the box
// is open under a "thinking…" summary so it can be read live; when the answer
// starts (or the reply ends) it folds, its summary saying how it ended.
function thinkingBox() {
  const details = document.createElement("details");
  details.className = "reasoning";
  details.hidden = true;
  const summary = document.createElement("summary");
  const text = document.createElement("div");
  text.className = "text";
  details.append(summary, text);
  let live = false;
  return {
    details,
    stream(reasoning) {
      if (!live && details.hidden) {
        live = true;
        details.hidden = false;
        details.open = true;
        summary.textContent = "thinking…";
      }
      text.textContent = reasoning;
    },
    end(label) {
      if (!live) return;
      live = false;
      details.open = false;
      summary.textContent = label;
      details.classList.toggle("cut", label !== "reasoning");
    },
  };
}

function scrollDown() { window.scrollTo(0, document.body.scrollHeight); }

async function init() {
  try {
    const h = await (await fetch("/health")).json();
    const m = await (await fetch("/v1/models")).json();
    chat = !!h.chat;
    model = m.data[0].id;
    $("model").textContent = model;
    if (!chat) {
      $("mode-note").hidden = false;
      $("mode-note").textContent = "This model has no chat template (its tokenizer lacks the XTML ids): " +
        "the page continues your text with /v1/completions.";
      $("thinking").disabled = true;
      $("system-box").hidden = true;
    }
    setStatus("ready");
  } catch (e) {
    setStatus("server unreachable", true);
  }
}

// Reads an SSE body: calls onEvent(obj) for every "data: {...}" line.
async function readEvents(resp, onEvent) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of ev.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const userEl = bubble("user");
  userEl.textContent = text;
  const el = bubble("assistant");
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  // A completion model has no think channel: no box at all.
  const box = chat ? thinkingBox() : null;
  if (box) el.append(box.details);
  el.append(content, meta);
  scrollDown();

  const thinking = $("thinking").checked;
  const body = { model, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value) };
  let url;
  if (chat) {
    const msgs = [];
    const sys = $("system").value.trim();
    if (sys) msgs.push({ role: "system", content: sys });
    msgs.push(...history, { role: "user", content: text });
    body.messages = msgs;
    body.chat_template_kwargs = { thinking };
    url = "/v1/chat/completions";
  } else {
    body.prompt = text;
    url = "/v1/completions";
  }
  const ctl = new AbortController();
  busy = ctl;
  $("send").disabled = true;
  $("stop").hidden = false;
  setStatus("generating…");
  const t0 = performance.now();
  let tFirst = 0, reasoning = "", answer = "", usage = null, finish = null;
  const calls = [];
  try {
    const resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: ctl.signal });
    if (!resp.ok) {
      const j = await resp.json().catch(() => ({}));
      throw new Error((j.error && j.error.message) || ("HTTP " + resp.status));
    }
    await readEvents(resp, (ev) => {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      const c = ev.choices && ev.choices[0];
      if (!c) return;
      if (c.finish_reason) finish = c.finish_reason;
      const piece = chat ? c.delta || {} : { content: c.text };
      if (piece.reasoning_content && box) {
        if (!tFirst) tFirst = performance.now();
        reasoning += piece.reasoning_content;
        box.stream(reasoning);
      }
      if (piece.content) {
        if (!tFirst) tFirst = performance.now();
        if (box && !answer) box.end("reasoning");
        answer += piece.content;
        content.textContent = answer;
      }
      if (piece.tool_calls) {
        for (const tc of piece.tool_calls) calls.push(tc);
        const pre = document.createElement("div");
        pre.className = "calls";
        pre.textContent = calls.map((tc) => "→ " + tc.function.name + "(" + tc.function.arguments + ")").join("\n");
        el.querySelector(".calls")?.remove();
        el.insertBefore(pre, meta);
      }
      scrollDown();
    });
    const secs = (performance.now() - t0) / 1000;
    const ttft = tFirst ? ((tFirst - t0) / 1000).toFixed(2) + " s to first token, " : "";
    const n = usage ? usage.completion_tokens : 0;
    meta.textContent = ttft + n + " tokens in " + secs.toFixed(2) + " s" +
      (usage ? ", " + usage.prompt_tokens_details.cached_tokens + " of " + usage.prompt_tokens +
        " prompt tokens reused" : "") + (finish ? " (" + finish + ")" : "");
    // the token limit ended the think channel before it closed: no answer came
    if (box && reasoning && !answer) box.end(finish === "length" ? "reasoning cut" : "reasoning");
    if (chat) {
      history.push({ role: "user", content: text });
      const m = { role: "assistant", content: answer };
      if (reasoning && thinking) m.reasoning_content = reasoning;
      history.push(m);
    }
    setStatus("ready");
  } catch (e) {
    if (box && reasoning && !answer) box.end(e.name === "AbortError" ? "reasoning stopped" : "reasoning");
    if (e.name === "AbortError") {
      meta.textContent = "stopped";
      setStatus("stopped");
    } else {
      el.classList.add("error");
      content.textContent = (answer ? answer + "\n" : "") + "error: " + e.message;
      setStatus("error", true);
    }
  } finally {
    busy = null;
    $("send").disabled = false;
    $("stop").hidden = true;
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim() || busy) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => busy && busy.abort());
$("reset").addEventListener("click", () => {
  if (busy) busy.abort();
  history.length = 0;
  $("log").textContent = "";
  setStatus("ready");
});
init();
