#!/usr/bin/env python3
"""How often a chat model does what held-out requests ask, over a running
`k3 serve`: the share of replies that use the words a request names, and of
stories about a named character that name it.

  chat_eval.py URL REQUESTS.jsonl [--n N] [--temperature T] [--seed S]
               [--max-tokens M] [--show K]

REQUESTS.jsonl is `tools/make_chat_data.py STORIES --requests FILE`'s output
(one {"request": {messages, thinking}, "words": [...]} or {"request": ...,
"name": NAME} a line, from stories the model was not trained on). Each of the first N requests is sent to
URL/v1/chat/completions with its thinking setting and seed S + its index;
a reply uses a word when the word occurs in its content as a whole word
(case-insensitive), and names a character when the name occurs in it as a
word. Prints, for the word requests, the share of requested words used, the share of
replies using all of them, the share using at least one, the share ending
with a stop (not cut by --max-tokens), and the first K exchanges. The
control, from the same replies: the share of the NEXT request's words found
in each reply (what a model that ignores the request would score, since
common story words occur anyway); for the character requests, the share of
replies naming the character, and the control: naming the next such
request's character. Exit 0
after printing; 1 when the server cannot be reached."""
import argparse
import json
import re
import sys
import urllib.request


def ask(url, req, temperature, seed, max_tokens):
    body = {"messages": req["messages"], "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "chat_template_kwargs": {"thinking": bool(req.get("thinking", True))}}
    r = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=600) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("requests")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--show", type=int, default=2)
    a = ap.parse_args()
    every = [json.loads(line) for line in open(a.requests, encoding="utf-8") if line.strip()][: a.n]
    rows = [r for r in every if r.get("words")]
    named = [r for r in every if r.get("name")]
    used = asked = all_used = any_used = stopped = 0
    shown, texts, ntexts = [], [], []
    for i, row in enumerate(every):
        try:
            out = ask(a.url, row["request"], a.temperature, a.seed + i, a.max_tokens)
        except OSError as e:
            sys.exit("chat_eval.py: %s: %s" % (a.url, e))
        ch = out["choices"][0]
        text = ch["message"].get("content") or ""
        stopped += ch.get("finish_reason") == "stop"
        if len(shown) < a.show:
            shown.append((row["request"]["messages"][-1]["content"], ch["message"].get("reasoning_content"), text))
        if row.get("name"):
            ntexts.append(text)
            continue
        if not row.get("words"):
            continue
        texts.append(text)
        hit = [w for w in row["words"] if re.search(r"\b%s\b" % re.escape(w), text, flags=re.I)]
        used += len(hit)
        asked += len(row["words"])
        all_used += len(hit) == len(row["words"])
        any_used += bool(hit)
    n = len(rows)
    ctl = sum(1 for i in range(n) for w in rows[(i + 1) % n]["words"]
              if re.search(r"\b%s\b" % re.escape(w), texts[i], flags=re.I))
    ctl_asked = sum(len(rows[(i + 1) % n]["words"]) for i in range(n))
    print("requests %d (%d with words, %d about a character), temperature %g, seeds %d..%d, max_tokens %d" %
          (len(every), n, len(named), a.temperature, a.seed, a.seed + len(every) - 1, a.max_tokens))
    print("requested words used: %d of %d (%.1f%%)" % (used, asked, 100.0 * used / max(asked, 1)))
    print("control, the next request's words in each reply: %d of %d (%.1f%%)" %
          (ctl, ctl_asked, 100.0 * ctl / max(ctl_asked, 1)))
    print("replies using all of them: %.1f%%; at least one: %.1f%%" %
          (100.0 * all_used / max(n, 1), 100.0 * any_used / max(n, 1)))
    m = len(named)
    has = lambda name, t: re.search(r"\b%s\b" % re.escape(name), t) is not None
    hit = sum(has(named[i]["name"], ntexts[i]) for i in range(m))
    ctl = sum(has(named[(i + 1) % m]["name"], ntexts[i]) for i in range(m))
    print("stories naming the character asked for: %d of %d (%.1f%%); control, the next request's: %d (%.1f%%)" %
          (hit, m, 100.0 * hit / max(m, 1), ctl, 100.0 * ctl / max(m, 1)))
    print("replies ended by the model (not cut by max_tokens): %.1f%%" % (100.0 * stopped / max(len(every), 1)))
    for q, think, text in shown:
        print("\nuser: %s" % q)
        if think:
            print("reasoning: %s" % think)
        print("assistant: %s" % text)


if __name__ == "__main__":
    main()
