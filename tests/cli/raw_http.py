"""raw_http.py: hostile HTTP over a raw loopback socket, for the serve and
dashboard tests (requests curl will not send). Every wait is bounded.

  raw_http.py PORT ask CASE     sends one request (CASES below) with
                                Connection: close (cut-*: then ends its
                                sending half), reads the answer until the
                                server closes (10 s at most) and prints
                                "STATUS_LINES STATUS TYPE ERROR": how many
                                status lines came back (a page sent twice
                                shows 2), the first status, the media type, and
                                the error's code (an OpenAI error object), "msg"
                                (the dashboard's {"error": message}) or "-"
  raw_http.py PORT trickle WHAT [PATH]
                                sends a request's headers (WHAT=headers) or a
                                body (WHAT=body) one byte every 0.3 s for up to
                                12 s; prints "closed SECONDS" when the server
                                hangs up, else "open 12"; a POST to
                                /v1/completions, or a GET of PATH
  raw_http.py PORT perip N      opens N+1 idle connections; prints whether the
                                last was closed at once and the first stays open
"""
import json
import re
import socket
import sys
import time

HOST = b"Host: 127.0.0.1\r\nConnection: close\r\n"
JSON_POST = b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"

CASES = {
    # a version libmicrohttpd takes for HTTP/1.1
    "version-1.7": b"GET /health HTTP/1.7\r\n" + HOST + b"\r\n",
    # request targets and heads past the limits (and far past them, within
    # the connection's memory), and just within them
    "uri-20k": b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "uri-100k": b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "query-9k": b"GET /health?q=" + b"a" * 9000 + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "query-7k": b"GET /health?q=" + b"a" * 7000 + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "header-100k": b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 100000 + b"\r\n\r\n",
    "headers-40k": b"GET /health HTTP/1.1\r\n" + HOST + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 90) for i in range(400)) + b"\r\n",
    "header-30k": b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 30000 + b"\r\n\r\n",
    # a body framing libmicrohttpd cannot end: it would wait for the close
    "te-gzip": JSON_POST + b"Transfer-Encoding: gzip\r\n\r\n" + b"x" * 10,
    # what libmicrohttpd would answer with its own HTML page: a head beyond
    # its connection memory, versions it refuses, malformed lines and
    # lengths (a negative one also sent its status line twice), bad chunks
    "header-300k": b"GET /health HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 300000 + b"\r\n\r\n",
    "version-2.0": b"GET /health HTTP/2.0\r\n" + HOST + b"\r\n",
    "version-0.9": b"GET /health\r\n\r\n",
    "bad-version": b"GET /health HTTP/1.1x\r\n" + HOST + b"\r\n",
    "bad-line": b"GET  /health HTTP/1.1\r\n" + HOST + b"\r\n",
    "bad-header": b"GET /health HTTP/1.1\r\n" + HOST + b"No colon here\r\n\r\n",
    "folded-header": b"GET /health HTTP/1.1\r\n" + HOST + b"X-A: 1\r\n  continued\r\n\r\n",
    "length-negative": JSON_POST + b"Content-Length: -1\r\n\r\n",
    "length-junk": JSON_POST + b"Content-Length: 12abc\r\n\r\n{}",
    "length-2e64": JSON_POST + b"Content-Length: 36893488147419103232\r\n\r\n{}",
    "chunk-bad-size": JSON_POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "chunk-too-long": JSON_POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}xx\r\n0\r\n\r\n",
    "chunk-no-lf": JSON_POST + b"Transfer-Encoding: chunked\r\n\r\n2\r{}\r\n0\r\n\r\n",
    "length-trailing-tab": JSON_POST + b"Content-Length: 2\t\r\n\r\n{}",
    # heads within the size limits whose many small parts would fill the
    # library's connection memory (it answered with its page, or not at all)
    "params-4000": b"GET /health?" + b"&".join([b"a"] * 4000) + b" HTTP/1.1\r\n" + HOST + b"\r\n",
    "headers-8000": b"GET /health HTTP/1.1\r\n" + HOST + b"a:\r\n" * 7000 + b"\r\n",
    "cookies-6000": b"GET /health HTTP/1.1\r\n" + HOST + b"Cookie: " + b"; ".join([b"a=1"] * 6000) + b"\r\n\r\n",
    # the client stops sending (half-closes) inside the head or a chunked body
    "cut-head": b"GET /health HTTP/1.1\r\nHost: 127.0",
    "cut-chunk": JSON_POST + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro",
    # a good chunked body, in pieces, with an extension and a trailer: served
    "chunk-ok": JSON_POST + b"Transfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x;x=1\r\n%s\r\n" % (len(p), p) for p in (b'{"prompt": "Once', b' upon", "max_tok', b'ens": 2}'))
    + b"0\r\nX-Trailer: 1\r\n\r\n",
}
# the dashboard's routes
CASES["dash-version-1.7"] = CASES["version-1.7"].replace(b"/health", b"/api/runs")
CASES["dash-header-100k"] = CASES["header-100k"].replace(b"/health", b"/api/runs")
CASES["dash-uri-20k"] = CASES["uri-20k"]
CASES["dash-header-300k"] = CASES["header-300k"].replace(b"/health", b"/api/runs")
CASES["dash-version-2.0"] = CASES["version-2.0"].replace(b"/health", b"/api/runs")
CASES["dash-chunk-bad"] = CASES["chunk-bad-size"].replace(b"POST /v1/completions", b"GET /api/runs")


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def ask(port, case):
    s = connect(port)
    try:
        s.sendall(CASES[case])
        if case.startswith("cut-"):
            s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    out = b""
    end = time.time() + 10
    try:
        while time.time() < end:
            d = s.recv(65536)
            if not d:
                break
            out += d
    except OSError:
        pass
    if not out:
        print("0 - - -")
        return
    lines = len(re.findall(rb"(?m)^HTTP/1\.[01] [0-9]{3} ", out))
    head, _, body = out.partition(b"\r\n\r\n")
    status = head.split(b" ")[1].decode(errors="replace") if b" " in head else "-"
    ctype = "-"
    for h in head.split(b"\r\n")[1:]:
        k, _, v = h.partition(b":")
        if k.strip().lower() == b"content-type":
            ctype = v.strip().split(b";")[0].decode(errors="replace")
    try:
        e = json.loads(body)["error"]
        err = "msg" if isinstance(e, str) and e else e["code"]
    except Exception:
        err = "-"
    print(lines, status, ctype, err)


def closed(s, wait):
    s.settimeout(wait)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def trickle(port, what, path=None):
    s = connect(port)
    head = JSON_POST.replace(b"Connection: close\r\n", b"")
    if path:
        head = head.replace(b"POST /v1/completions", b"GET " + path.encode())
    head += b"Content-Length: 1000\r\n\r\n" if what == "body" else b"X-Slow: "
    t0 = time.time()
    s.sendall(head)
    s.settimeout(0.3)
    while time.time() - t0 < 12:
        try:
            if s.recv(4096) == b"":
                break
        except socket.timeout:
            pass
        except OSError:
            break
        try:
            s.sendall(b"a")
        except OSError:
            break
    else:
        print("open 12")
        return
    print("closed %.1f" % (time.time() - t0))


def perip(port, n):
    conns = [connect(port) for _ in range(n + 1)]
    time.sleep(0.3)
    print("last-closed", closed(conns[n], 1.0), "first-open", not closed(conns[0], 0.2))


if __name__ == "__main__":
    port, what = int(sys.argv[1]), sys.argv[2]
    if what == "ask":
        ask(port, sys.argv[3])
    elif what == "trickle":
        trickle(port, sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
    elif what == "perip":
        perip(port, int(sys.argv[3]))
    else:
        sys.exit("raw_http.py: unknown command " + what)
