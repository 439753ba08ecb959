#!/usr/bin/python3
"""Writes tests/fixtures/formats/st_expect.json: the f32 bit patterns that each
float tensor of tests/fixtures/peer/st/*.safetensors widens to, computed
with numpy (F16 -> F32) and torch (BF16 -> F32), independently of k3's reader.
Run from the repository root: /usr/bin/python3 tools/gen_st_expect.py"""
import json, struct, sys
import numpy as np
import torch

SHARDS = ["tests/fixtures/peer/st/model-00001-of-00002.safetensors",
          "tests/fixtures/peer/st/model-00002-of-00002.safetensors"]

out = {}
for path in SHARDS:
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    base = 8 + n
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        b0, b1 = t["data_offsets"]
        buf = raw[base + b0: base + b1]
        dt = t["dtype"]
        if dt == "F32":
            f = np.frombuffer(buf, dtype="<f4")
        elif dt == "F16":
            f = np.frombuffer(buf, dtype="<f2").astype(np.float32)
        elif dt == "BF16":
            f = torch.frombuffer(bytearray(buf), dtype=torch.bfloat16).float().numpy() if buf else np.zeros(0, np.float32)
        else:
            out[name] = {"dtype": dt, "shape": t["shape"], "bytes": buf.hex()}
            continue
        bits = np.asarray(f, dtype=np.float32).view(np.uint32).tolist()
        out[name] = {"dtype": dt, "shape": t["shape"], "f32_bits": bits}
json.dump(out, open("tests/fixtures/formats/st_expect.json", "w"), indent=0, sort_keys=True)
print(len(out), "tensors", file=sys.stderr)
