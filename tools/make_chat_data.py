#!/usr/bin/env python3
"""Chat conversations made from TinyStories text, for training a small chat
model (`k3 prepare --format chat`, docs/chat-model.md).

Each story becomes one conversation in the OpenAI message shape that
`k3 tokenize --chat` and k3 serve take: a user asks for a story about the
story's main character, or for a story that uses some of its words; the
assistant answers with the story. Some conversations go on: the user asks
for it shorter (the first sentences), for a title, or, when the first answer
was the story's first half, for what happens next (the second half). About
two thirds think first (a short reasoning_content saying what the user asked
for), the rest have thinking off. The requests are filled from the story
itself, so an answer always fits its request: the words asked for occur in
the story, the character is the story's.

  make_chat_data.py STORIES.txt... --out FILE.jsonl [--seed N]
  make_chat_data.py STORIES.txt --requests FILE.jsonl   held-out requests:
      {"request": {messages, thinking}, "words": [...]} per line, or for a
      story about a character {"request": ..., "name": NAME}

Stories are separated by lines <|endoftext|> (TinyStories' layout). The
output is a function of the input and the seed."""
import argparse
import json
import random
import re
import sys

STOP = set("""a about above after again against all am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just let me more most
my myself no nor not now of off on once only or other our ours out over own same she should so some
such than that the their them then there these they this those through to too under until up very was
we were what when where which while who whom why will with would you your yours one day time said says
saw went got get very upon little big also back away around again came come go going were don didn
can't couldn't wasn't didn't it's that's mom dad named every two three knew heard asked looked
wanted felt made many much like liked things thing something anything even ever still yes okay let
""".split())

# a whole lower-case word (not the tail of "Will", not "couldn" of "couldn't")
WORD = re.compile(r"(?<![\w'’])[a-z]+(?![\w'’])")


def read_stories(paths):
    out = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            cur = []
            for line in f:
                if line.rstrip("\n") == "<|endoftext|>":
                    s = "".join(cur).strip()
                    if s:
                        out.append(s)
                    cur = []
                else:
                    cur.append(line)
            s = "".join(cur).strip()
            if s:
                out.append(s)
    return out


def sentences(story):
    """The story cut after each . ! or ? (closing quotes kept with it)."""
    parts = re.findall(r'.+?[.!?]+["”’]?(?:\s+|$)|.+$', story, flags=re.S)
    return [p.strip() for p in parts if p.strip()]


def character(story):
    m = re.search(r"\b(?:a|an) ((?:[a-z]+ ){0,2}[a-z]+) named ([A-Z][a-z]+)", story)
    if m:
        return "a %s named %s" % (m.group(1), m.group(2)), m.group(2)
    m = re.search(r"\bnamed ([A-Z][a-z]+)", story)
    if m:
        return m.group(1), m.group(1)
    return None, None


def content_words(story, name):
    seen, out = set(), []
    for w in WORD.findall(story):
        if len(w) < 3 or w in STOP or w in seen or (name and w == name.lower()):
            continue
        seen.add(w)
        out.append(w)
    return out


def title(story, name):
    counts = {}
    for m in re.finditer(r"\bthe ([a-z]+)\b", story):
        w = m.group(1)
        if w not in STOP:
            counts[w] = counts.get(w, 0) + 1
    thing = max(sorted(counts), key=lambda w: counts[w]) if counts else None
    if name and thing:
        return "%s and the %s" % (name, thing.capitalize())
    if thing:
        return "The %s" % thing.capitalize()
    return name or "A Little Story"


def join_words(ws):
    return ws[0] if len(ws) == 1 else ", ".join(ws[:-1]) + " and " + ws[-1]


ASK_ABOUT = ["Tell me a story about {s}.", "Can you write a story about {s}?", "Write a short story about {s}.",
             "I want a story about {s}.", "Please tell me a story about {s}."]
ASK_WORDS = ["Write a story that uses the words {w}.", "Tell me a story with the words {w}.",
             "Can you make up a story using {w}?", "Please write a story with these words: {w}."]
SYSTEMS = ["You are a friendly storyteller for young children.", "You write short, simple stories.",
           "You are a helpful assistant."]


def first_request(story, rng):
    """The user's first message, the reasoning for it, and the requested words."""
    subj, name = character(story)
    words = content_words(story, name)
    if subj and (len(words) < 3 or rng.random() < 0.5):
        s = subj if rng.random() < 0.7 or subj == name else name
        return rng.choice(ASK_ABOUT).format(s=s), "The user wants a story about %s." % s, [], name
    if len(words) < 3:
        return None
    ws = rng.sample(words, 3)
    return (rng.choice(ASK_WORDS).format(w=join_words(ws)),
            "The user wants a story that uses the words %s. I will use each of them." % join_words(ws), ws, name)


def conversation(story, rng):
    req = first_request(story, rng)
    if req is None:
        return None
    ask, why, words, name = req
    about = name if not words else None
    thinking = rng.random() < 0.67
    msgs = []
    if rng.random() < 0.25:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    sents = sentences(story)
    follow = rng.random()
    first = story
    if follow < 0.15 and len(sents) >= 6:  # told in two halves
        h = len(sents) // 2
        first, second = " ".join(sents[:h]), " ".join(sents[h:])
    msgs.append({"role": "user", "content": ask})
    msgs.append(assistant(first, why + " I will tell it in two parts." if first != story else why + " I will tell a simple story.", thinking))
    if first != story:
        msgs.append({"role": "user", "content": rng.choice(["What happens next?", "And then what happened?", "Go on, please."])})
        msgs.append(assistant(second, "The user wants the rest of the story.", thinking))
    elif follow < 0.30 and len(sents) >= 5:
        msgs.append({"role": "user", "content": rng.choice(["Make it shorter.", "Can you make it shorter?", "That is too long. Shorter, please."])})
        k = rng.choice([2, 3])
        msgs.append(assistant(" ".join(sents[:k]), "The user wants a shorter story. I will keep it to %d sentences." % k, thinking))
    elif follow < 0.45:
        msgs.append({"role": "user", "content": rng.choice(["Give it a title.", "What would be a good title for it?", "Can you give the story a title?"])})
        t = title(story, name)
        msgs.append(assistant(t, "A good title names the story's main character or thing.", thinking))
    return {"messages": msgs, "thinking": thinking}, ask, words, about


def assistant(text, why, thinking):
    m = {"role": "assistant", "content": text}
    if thinking:
        m["reasoning_content"] = why
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stories", nargs="+")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="conversations, one JSON object per line")
    g.add_argument("--requests", help="held-out first requests with their words, one JSON object per line")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    stories = read_stories(a.stories)
    if not stories:
        sys.exit("make_chat_data.py: no stories in " + " ".join(a.stories))
    n = 0
    with open(a.out or a.requests, "w", encoding="utf-8") as f:
        for s in stories:
            c = conversation(s, rng)
            if c is None:
                continue
            conv, ask, words, about = c
            if a.out:
                f.write(json.dumps(conv, ensure_ascii=False) + "\n")
            else:
                req = {"messages": [{"role": "user", "content": ask}], "thinking": conv["thinking"]}
                row = {"request": req, "words": words} if words else {"request": req, "name": about}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    print("%s: %d conversations from %d stories" % (a.out or a.requests, n, len(stories)), file=sys.stderr)


if __name__ == "__main__":
    main()
