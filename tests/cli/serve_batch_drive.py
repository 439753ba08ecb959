#!/usr/bin/env python3
"""serve_batch_drive.py URL MODE OUTDIR REQS.json: sends the requests of
REQS.json to a k3 serve at URL (loopback) and writes each response,
normalised, to OUTDIR/NAME.txt: the JSON body, or a streamed response's
events one a line, each without the fields that name the response ("id",
"created", and the response's serial inside tool call ids), keys sorted.
MODE: "alone" (one after another), "together" (all at once, released by a
barrier) or "cancel:NAME" (together; NAME is streamed and its connection is
closed after its first event). Every request has a 300 s timeout. Exit 1 if
a request fails to connect."""
import http.client, json, re, socket, sys, threading, urllib.parse

url, mode, out, reqs_path = sys.argv[1:5]
reqs = json.load(open(reqs_path))
u = urllib.parse.urlparse(url)
cancel = mode.split(":", 1)[1] if mode.startswith("cancel:") else None

def norm(o):
    if isinstance(o, dict):
        return {k: norm(v) for k, v in o.items() if k not in ("id", "created")}
    if isinstance(o, list):
        return [norm(v) for v in o]
    return o

def dump(o):
    return json.dumps(norm(o), sort_keys=True, ensure_ascii=False)

def run(r, barrier):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps(r["body"])
    path = "/v1/chat/completions" if r["kind"] == "chat" else "/v1/completions"
    if barrier:
        barrier.wait()
    c.request("POST", path, body, {"Content-Type": "application/json"})
    sock = c.sock  # the response keeps it; the connection lets go of it (Connection: close)
    resp = c.getresponse()
    lines = ["status %d" % resp.status]
    if r["body"].get("stream"):
        while True:
            line = resp.fp.readline()
            if not line:
                break
            line = line.decode("utf-8").rstrip("\n")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            lines.append(data if data == "[DONE]" else dump(json.loads(data)))
            if data == "[DONE]":
                # the stream's end
                break
            if r["name"] == cancel:
                sock.shutdown(socket.SHUT_RDWR)
                c.close()
                lines.append("closed")
                break
    else:
        lines.append(dump(json.loads(resp.read())))
    open("%s/%s.txt" % (out, r["name"]), "w").write("\n".join(lines) + "\n")

if mode == "alone":
    for r in reqs:
        run(r, None)
else:
    b = threading.Barrier(len(reqs))
    ts = [threading.Thread(target=run, args=(r, b)) for r in reqs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
