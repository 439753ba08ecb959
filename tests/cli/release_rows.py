#!/usr/bin/python3
"""release_rows.py: real rows in the sparse replica of the release, and the
logits they must give (float64, plain python), for tests/cli/test_release_head.sh.

  release_rows.py write REPLICA IDS ROWS     fill rows into the shard's holes
  release_rows.py check REPLICA IDS ROWS LOGITS.bin

Everything else stays a hole (zero), so every layer adds nothing to the
residual stream and the final hidden state is c * embed[last id] with c > 0
(how Block AttnRes weighs the stream's zero sources sets c); the final RMSNorm
removes c (the rows are large enough that eps is below fp32 rounding), so
logits[v] = head[v] . (embed[id] / rms(embed[id]) * gain) for the rows
written, and exactly 0 for every other row. The rows chosen sit past 2^31
bytes of both the 163,840 x 7,168 BF16 embedding and head (row 149,797 on).
"""
import json
import math
import os
import struct
import sys

P = "language_model."


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    return h, 8 + n


def locate(rep, name):
    wm = json.load(open(os.path.join(rep, "model.safetensors.index.json")))["weight_map"]
    path = os.path.join(rep, wm[name])
    h, base = header(path)
    t = h[name]
    assert t["dtype"] == "BF16", name
    return path, base + t["data_offsets"][0], t["shape"]


def bf16(x):
    """x must be exactly representable (small integers times powers of two)."""
    b = struct.pack("<f", x)
    assert b[:2] == b"\0\0", x
    return b[2:]


def emb_val(i, j):
    return float(((j * 7 + i) % 13) - 6) * 8.0


def head_val(v, j):
    return float(((j * 3 + v * 5) % 11) - 5) / 4.0


def gain_val(j):
    return 1.0 + (j % 4) / 4.0


def write(rep, ids, rows):
    E = 7168
    for name, idxs, f in ((P + "model.embed_tokens.weight", ids, emb_val), (P + "lm_head.weight", rows, head_val)):
        path, off, shape = locate(rep, name)
        assert shape[1] == E
        with open(path, "r+b") as fh:
            for i in idxs:
                fh.seek(off + i * E * 2)
                fh.write(b"".join(bf16(f(i, j)) for j in range(E)))
    for name in (P + "model.norm.weight",):
        path, off, shape = locate(rep, name)
        with open(path, "r+b") as fh:
            fh.seek(off)
            fh.write(b"".join(bf16(gain_val(j)) for j in range(E)))


def check(rep, ids, rows, logits_path):
    E, V = 7168, 163840
    data = open(logits_path, "rb").read()
    nrow = len(data) // (4 * V)
    last = data[(nrow - 1) * 4 * V:]
    lg = struct.unpack("<%df" % V, last)
    e = [emb_val(ids[-1], j) for j in range(E)]
    rms = math.sqrt(sum(x * x for x in e) / E + 1e-5)
    h = [e[j] / rms * gain_val(j) for j in range(E)]
    bad = 0
    worst = 0.0
    for v in rows:
        want = sum(head_val(v, j) * h[j] for j in range(E))
        scale = sum(abs(head_val(v, j) * h[j]) for j in range(E))
        err = abs(lg[v] - want) / scale
        worst = max(worst, err)
        if err > 2e-6:
            bad += 1
            print("row %d: k3 %.9g reference %.9g (error %.3g of the sum of |terms|)" % (v, lg[v], want, err))
    others = sum(1 for v in range(V) if v not in set(rows) and lg[v] != 0.0)
    if others:
        print("%d rows that are holes have nonzero logits" % others)
    print("%d rows checked, worst error %.3g of the sum of |terms|; %d hole rows exactly 0"
          % (len(rows), worst, V - len(rows) - others))
    return 1 if bad or others else 0


def main():
    cmd, rep = sys.argv[1], sys.argv[2]
    ids = [int(x) for x in sys.argv[3].split(",")]
    rows = [int(x) for x in sys.argv[4].split(",")]
    if cmd == "write":
        write(rep, ids, rows)
        return 0
    return check(rep, ids, rows, sys.argv[5])


if __name__ == "__main__":
    sys.exit(main())
