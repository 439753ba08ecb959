// chat.js: the chat page of `k3 serve`. Talks to the same server's
// /v1/chat/completions with stream: true and renders the server-sent events
// as they arrive: reasoning_content into a <details>, content below it. The
// whole conversation is resent each turn (as every OpenAI client does); the
// server's state cache makes that cost only the new tokens. Models without a
// chat template get /v1/completions (text continuation) and no thinking box.
// The conversation lives in `turns`, the one source the log is drawn from,
// and is kept in localStorage (per model id) so a reload shows it again;
// "new chat" forgets it. Replies are Markdown (marked), sanitised (DOMPurify)
// when the build embedded those libraries, else plain text.
"use strict";

const $ = (id) => document.getElementById(id);
// One exchange each: {user, thinking, reasoning, label, content, calls, meta,
// state: "running" | "ok" | "stopped" | "error", error}
let turns = [];
let views = []; // the DOM of each turn, as render() drew it
let chat = true, model = null, busy = null;

function setStatus(text, bad) {
  $("status").textContent = text;
  $("status").classList.toggle("bad", !!bad);
}

const storeKey = () => "k3-chat:" + model;

function save() {
  // storage full or disabled: the page works on, only a reload forgets
  try { localStorage.setItem(storeKey(), JSON.stringify(turns)); } catch (e) { /* see above */ }
}

function load() {
  let t = [];
  try { t = JSON.parse(localStorage.getItem(storeKey()) || "[]"); } catch (e) { t = []; }
  turns = Array.isArray(t) ? t.filter((x) => x && typeof x.user === "string") : [];
  // a reply that was streaming when the page went away never finished
  for (const x of turns) if (x.state === "running") { x.state = "stopped"; x.meta = "stopped"; }
}

function bubble(role) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  $("log").appendChild(el);
  return el;
}

function button(cls, label, title, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = cls;
  b.textContent = label;
  b.title = title;
  b.addEventListener("click", onClick);
  return b;
}

// The placeholders a build without the libraries serves define neither.
const markdown = typeof marked !== "undefined" && typeof DOMPurify !== "undefined";
// Nothing that loads from elsewhere (the page loads nothing from other
// origins) or takes input; DOMPurify drops scripts and event handlers itself.
const PURIFY = { FORBID_TAGS: ["img", "picture", "source", "video", "audio", "style", "form", "input", "button",
  "textarea", "select"] };

// A reply's text into el: Markdown rendered and sanitised, or plain text.
function setReply(el, text) {
  if (!markdown) { el.textContent = text; return; }
  el.classList.add("md");
  el.innerHTML = DOMPurify.sanitize(marked.parse(text, { headerIds: false, mangle: false }), PURIFY);
}

function scrollDown() { window.scrollTo(0, document.body.scrollHeight); }

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
  const fold = (label) => {
    details.open = false;
    summary.textContent = label;
    details.classList.toggle("cut", label !== "reasoning");
  };
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
      fold(label);
    },
    show(reasoning, label) { // a finished reply's, folded
      details.hidden = false;
      text.textContent = reasoning;
      fold(label || "reasoning");
    },
  };
}

async function copy(text, b) {
  try {
    await navigator.clipboard.writeText(text);
    b.textContent = "copied";
    setTimeout(() => { b.textContent = "copy"; }, 1500);
  } catch (e) {
    setStatus("copy failed: " + e.message, true);
  }
}

function callsText(calls) {
  return calls.map((tc) => "→ " + tc.function.name + "(" + tc.function.arguments + ")").join("\n");
}

// Draws the whole log from `turns`; each message gets its buttons: copy on
// all, edit on a user message, regenerate on the last reply.
function render() {
  $("log").textContent = "";
  views = turns.map((t, i) => {
    const u = bubble("user");
    const utext = document.createElement("div");
    utext.className = "text";
    utext.textContent = t.user;
    const uact = document.createElement("div");
    uact.className = "actions";
    uact.append(button("edit", "edit", "edit this message and resend the conversation from here", () => edit(i, u)),
      button("copy", "copy", "copy this message", (ev) => copy(t.user, ev.target)));
    u.append(utext, uact);

    const el = bubble("assistant");
    const box = chat ? thinkingBox() : null;
    const content = document.createElement("div");
    content.className = "content";
    const calls = document.createElement("div");
    calls.className = "calls";
    const meta = document.createElement("div");
    meta.className = "meta";
    const act = document.createElement("div");
    act.className = "actions";
    act.append(button("copy", "copy", "copy this reply", (ev) => copy(t.content || "", ev.target)));
    if (i === turns.length - 1)
      act.append(button("regenerate", "regenerate", "replace this reply with a new one", regenerate));
    if (box) el.append(box.details);
    el.append(content, calls, meta, act);
    if (t.state !== "running") {
      if (box && t.reasoning) box.show(t.reasoning, t.label);
      if (t.state === "error") content.textContent = (t.content ? t.content + "\n" : "") + "error: " + t.error;
      else setReply(content, t.content || "");
      calls.textContent = callsText(t.calls || []);
      meta.textContent = t.meta || "";
      el.classList.toggle("error", t.state === "error");
    }
    calls.hidden = !calls.textContent;
    return { box, content, calls, meta };
  });
  scrollDown();
}

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
    load();
    render();
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

// The OpenAI messages of the turns before `upto` that completed.
function messages(upto) {
  const msgs = [];
  const sys = $("system").value.trim();
  if (sys) msgs.push({ role: "system", content: sys });
  for (const t of turns.slice(0, upto)) {
    if (t.state !== "ok") continue;
    msgs.push({ role: "user", content: t.user });
    const m = { role: "assistant", content: t.content };
    if (t.reasoning && t.thinking) m.reasoning_content = t.reasoning;
    msgs.push(m);
  }
  return msgs;
}

// Starts the reply of the last turn (just added or reset), streams it into
// its view and records it in the turn.
async function run() {
  const i = turns.length - 1, t = turns[i], v = views[i];
  Object.assign(t, { thinking: chat && $("thinking").checked, reasoning: "", label: "", content: "", calls: [],
    meta: "", state: "running", error: "" });
  save();
  const body = { model, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value) };
  let url;
  if (chat) {
    body.messages = [...messages(i), { role: "user", content: t.user }];
    body.chat_template_kwargs = { thinking: t.thinking };
    url = "/v1/chat/completions";
  } else {
    body.prompt = t.user;
    url = "/v1/completions";
  }
  const ctl = new AbortController();
  busy = ctl;
  document.body.classList.add("busy");
  $("send").disabled = true;
  $("stop").hidden = false;
  setStatus("generating…");
  const t0 = performance.now();
  let tFirst = 0, usage = null, finish = null;
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
      if (piece.reasoning_content && v.box) {
        if (!tFirst) tFirst = performance.now();
        t.reasoning += piece.reasoning_content;
        v.box.stream(t.reasoning);
      }
      if (piece.content) {
        if (!tFirst) tFirst = performance.now();
        if (t.reasoning && !t.content) { t.label = "reasoning"; v.box.end(t.label); }
        t.content += piece.content;
        setReply(v.content, t.content);
      }
      if (piece.tool_calls) {
        for (const tc of piece.tool_calls) t.calls.push(tc);
        v.calls.textContent = callsText(t.calls);
        v.calls.hidden = false;
      }
      scrollDown();
    });
    const secs = (performance.now() - t0) / 1000;
    const ttft = tFirst ? ((tFirst - t0) / 1000).toFixed(2) + " s to first token, " : "";
    const n = usage ? usage.completion_tokens : 0;
    t.meta = ttft + n + " tokens in " + secs.toFixed(2) + " s" +
      (usage ? ", " + usage.prompt_tokens_details.cached_tokens + " of " + usage.prompt_tokens +
        " prompt tokens reused" : "") + (finish ? " (" + finish + ")" : "");
    // the token limit ended the think channel before it closed: no answer came
    if (t.reasoning && !t.content) t.label = finish === "length" ? "reasoning cut" : "reasoning";
    t.state = "ok";
    setStatus("ready");
  } catch (e) {
    if (t.reasoning && !t.content) t.label = e.name === "AbortError" ? "reasoning stopped" : "reasoning";
    if (e.name === "AbortError") {
      t.state = "stopped";
      t.meta = "stopped";
      setStatus("stopped");
    } else {
      t.state = "error";
      t.error = e.message;
      setStatus("error", true);
    }
  } finally {
    busy = null;
    document.body.classList.remove("busy");
    $("send").disabled = false;
    $("stop").hidden = true;
  }
  if (turns[i] !== t) return; // "new chat" dropped this turn meanwhile
  save();
  render();
}

function send(text) {
  turns.push({ user: text, state: "running" });
  render();
  run();
}

function regenerate() {
  if (busy || !turns.length) return;
  turns[turns.length - 1].state = "running";
  render();
  run();
}

// Turns user message i into a text box; sending it drops turn i and all
// after it and sends the edited text in its place.
function edit(i, el) {
  if (busy) return;
  const box = document.createElement("textarea");
  box.className = "edit";
  box.rows = 3;
  box.value = turns[i].user;
  const act = document.createElement("div");
  act.className = "actions";
  act.append(button("edit-send", "send", "resend the conversation from this message", () => {
    if (busy || !box.value.trim()) return;
    turns.length = i;
    send(box.value);
  }), button("edit-cancel", "cancel", "keep the message as it was", render));
  el.textContent = "";
  el.append(box, act);
  box.focus();
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
  turns = [];
  try { localStorage.removeItem(storeKey()); } catch (e) { /* storage disabled */ }
  render();
  setStatus("ready");
});
init();
