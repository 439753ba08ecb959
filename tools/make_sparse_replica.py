#!/usr/bin/python3
"""Build a shape-faithful sparse replica of the released Kimi K3 checkpoint.

    /usr/bin/python3 tools/make_sparse_replica.py OUT_DIR [--release DIR]

Reads the released config.json and model.safetensors.index.json.gz (default
tests/fixtures/k3-release of this repository) and writes OUT_DIR with the 96 shards
model-000NN-of-000096.safetensors, each a real safetensors header followed by
a hole where the tensor data would be (the file is extended with truncate, so
the data takes no disk space), plus config.json and the uncompressed
model.safetensors.index.json. Plain python3 standard library, no torch.

Where the shapes and dtypes come from (k3-checkpoint-format.md section 3):
every language-model tensor's shape is a formula of config values (3.1-3.6)
and its dtype is the spec's assignment (BF16 matrices and norm gains; F32
ShortConv weights, A_log, dt_bias, o_norm and the router bias; U8 MXFP4
experts). A_log is stored at length head_dim (spec 3.3). The layer kind comes
from linear_attn_config.kda_layers. The index's weight map decides which
names exist and which shard holds each; a name the spec does not describe is
an error.

Vision tower and projector (3.7): the spec pins only their totals (401,214,464
and 46,144,512 BF16 parameters); the shapes below, derived from vision_config
(27 blocks of wqkv/wo/fc0/fc1/norm0/norm1, a patch conv, a 64x64 position
table, a final norm; a 2x2-merge MLP into the text width), reproduce both
totals exactly, but single shapes there are our reading, not observed.

Tensor order inside a shard follows the safetensors writer: by dtype (F32,
then BF16, then U8), then by name, packed from offset 0 with no gaps. The
header is compact JSON without __metadata__, padded with spaces to a multiple
of 8 bytes. With this layout the 96 headers add up to exactly the published
75,766,584 bytes (file total minus the index's total_size), and the tensor
data to exactly the index's total_size; the script checks both.
"""
import gzip
import json
import os
import re
import sys

DTYPE_SIZE = {"F32": 4, "BF16": 2, "U8": 1}
DTYPE_RANK = {"F32": 0, "BF16": 1, "U8": 2}  # writer order: wider dtypes first


def text_shapes(tc):
    """Returns f(name) -> (dtype, shape) for language-model tensors."""
    E, V = tc["hidden_size"], tc["vocab_size"]
    lac = tc["linear_attn_config"]
    Hk, Dk, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = Hk * Dk
    Hm = tc["num_attention_heads"]
    rq, rkv = tc["q_lora_rank"], tc["kv_lora_rank"]
    dn, dr, dv = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    Ne, Ns, I = tc["num_experts"], tc["num_shared_experts"], tc["moe_intermediate_size"]
    lat, Id = tc["routed_expert_hidden_size"], tc["intermediate_size"]
    kda = set(l - 1 for l in lac["kda_layers"])

    model = {
        "embed_tokens.weight": ("BF16", [V, E]),
        "norm.weight": ("BF16", [E]),
        "output_attn_res_norm.weight": ("BF16", [E]),
        "output_attn_res_proj.weight": ("BF16", [1, E]),
    }
    every = {
        "input_layernorm.weight": ("BF16", [E]),
        "post_attention_layernorm.weight": ("BF16", [E]),
        "self_attention_res_norm.weight": ("BF16", [E]),
        "self_attention_res_proj.weight": ("BF16", [1, E]),
        "mlp_res_norm.weight": ("BF16", [E]),
        "mlp_res_proj.weight": ("BF16", [1, E]),
    }
    kda_attn = {
        "q_proj.weight": ("BF16", [P, E]), "k_proj.weight": ("BF16", [P, E]),
        "v_proj.weight": ("BF16", [P, E]),
        "q_conv1d.weight": ("F32", [P, 1, K]), "k_conv1d.weight": ("F32", [P, 1, K]),
        "v_conv1d.weight": ("F32", [P, 1, K]),
        "f_a_proj.weight": ("BF16", [Dk, E]), "f_b_proj.weight": ("BF16", [P, Dk]),
        "A_log": ("F32", [Dk]), "dt_bias": ("F32", [P]),
        "b_proj.weight": ("BF16", [Hk, E]), "g_proj.weight": ("BF16", [P, E]),
        "o_norm.weight": ("F32", [Dk]), "o_proj.weight": ("BF16", [E, P]),
    }
    mla_attn = {
        "q_a_proj.weight": ("BF16", [rq, E]), "q_a_layernorm.weight": ("BF16", [rq]),
        "q_b_proj.weight": ("BF16", [Hm * (dn + dr), rq]),
        "kv_a_proj_with_mqa.weight": ("BF16", [rkv + dr, E]),
        "kv_a_layernorm.weight": ("BF16", [rkv]),
        "kv_b_proj.weight": ("BF16", [Hm * (dn + dv), rkv]),
        "o_proj.weight": ("BF16", [E, Hm * dv]), "g_proj.weight": ("BF16", [Hm * dv, E]),
    }
    dense = {
        "gate_proj.weight": ("BF16", [Id, E]), "up_proj.weight": ("BF16", [Id, E]),
        "down_proj.weight": ("BF16", [E, Id]),
    }
    moe = {
        "gate.weight": ("BF16", [Ne, E]), "gate.e_score_correction_bias": ("F32", [Ne]),
        "routed_expert_down_proj.weight": ("BF16", [lat, E]),
        "routed_expert_norm.weight": ("BF16", [lat]),
        "routed_expert_up_proj.weight": ("BF16", [E, lat]),
        "shared_experts.gate_proj.weight": ("BF16", [Ns * I, E]),
        "shared_experts.up_proj.weight": ("BF16", [Ns * I, E]),
        "shared_experts.down_proj.weight": ("BF16", [E, Ns * I]),
    }
    expert = {
        "w1.weight_packed": ("U8", [I, lat // 2]), "w1.weight_scale": ("U8", [I, lat // 32]),
        "w3.weight_packed": ("U8", [I, lat // 2]), "w3.weight_scale": ("U8", [I, lat // 32]),
        "w2.weight_packed": ("U8", [lat, I // 2]), "w2.weight_scale": ("U8", [lat, I // 32]),
    }
    layer_re = re.compile(r"^language_model\.model\.layers\.(\d+)\.(.*)$")
    expert_re = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(.*)$")

    def shape(name):
        if name == "language_model.lm_head.weight":
            return ("BF16", [V, E])
        if name.startswith("language_model.model.") and name[21:] in model:
            return model[name[21:]]
        m = layer_re.match(name)
        if not m:
            return None
        L, rest = int(m.group(1)), m.group(2)
        if rest in every:
            return every[rest]
        if rest.startswith("self_attn."):
            return (kda_attn if L in kda else mla_attn).get(rest[10:])
        if rest.startswith("mlp."):
            return dense.get(rest[4:])
        m2 = expert_re.match(rest)
        if m2:
            return expert.get(m2.group(2)) if int(m2.group(1)) < Ne else None
        if rest.startswith("block_sparse_moe."):
            return moe.get(rest[17:])
        return None
    return shape


def vision_shapes(vc):
    """Returns f(name) -> (dtype, shape) for vision_tower.* and mm_projector.*."""
    d, di, qkv = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["qkv_hidden_size"]
    p, nl = vc["patch_size"], vc["vt_num_hidden_layers"]
    ph, pw = vc["init_pos_emb_height"], vc["init_pos_emb_width"]
    mk = vc["merge_kernel_size"]
    merged = d * mk[0] * mk[1]
    text = vc["text_hidden_size"]
    block = {
        "wqkv.weight": [3 * qkv, d], "wo.weight": [d, qkv],
        "mlp.fc0.weight": [di, d], "mlp.fc1.weight": [d, di],
        "norm0.weight": [d], "norm1.weight": [d],
    }
    fixed = {
        "vision_tower.patch_embed.proj.weight": [d, 3, p, p],
        "vision_tower.patch_embed.pos_emb.weight": [ph, pw, d],
        "vision_tower.encoder.final_layernorm.weight": [d],
        "mm_projector.proj.0.weight": [merged, merged],
        "mm_projector.proj.2.weight": [text, merged],
        "mm_projector.post_norm.weight": [text],
    }
    block_re = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.(.*)$")

    def shape(name):
        if name in fixed:
            return ("BF16", fixed[name])
        m = block_re.match(name)
        if m and int(m.group(1)) < nl and m.group(2) in block:
            return ("BF16", block[m.group(2)])
        return None
    return shape


def header_bytes(tensors):
    """tensors: list of (name, dtype, shape). Returns (header, data_len)."""
    tensors = sorted(tensors, key=lambda t: (DTYPE_RANK[t[1]], t[0].encode()))
    parts = []
    off = 0
    for name, dt, shp in tensors:
        n = DTYPE_SIZE[dt]
        for s in shp:
            n *= s
        parts.append("%s:{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%d,%d]}" % (
            json.dumps(name), dt, ",".join(str(s) for s in shp), off, off + n))
        off += n
    h = ("{" + ",".join(parts) + "}").encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return h, off


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    out = argv[1]
    rel = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "k3-release")
    if len(argv) == 4 and argv[2] == "--release":
        rel = argv[3]
    elif len(argv) != 2:
        print("usage: make_sparse_replica.py OUT_DIR [--release DIR]", file=sys.stderr)
        return 2
    cfg_text = open(os.path.join(rel, "config.json"), "rb").read()
    cfg = json.loads(cfg_text)
    index_text = gzip.open(os.path.join(rel, "model.safetensors.index.json.gz"), "rb").read()
    index = json.loads(index_text)
    tshape = text_shapes(cfg["text_config"])
    vshape = vision_shapes(cfg["vision_config"])
    shards = {}
    for name, shard in index["weight_map"].items():
        s = tshape(name) or vshape(name)
        if s is None:
            print("make_sparse_replica: no shape rule for tensor %s" % name, file=sys.stderr)
            return 1
        shards.setdefault(shard, []).append((name, s[0], s[1]))
    os.makedirs(out, exist_ok=True)
    total_file = total_data = 0
    for shard in sorted(shards):
        hdr, dlen = header_bytes(shards[shard])
        path = os.path.join(out, shard)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(len(hdr).to_bytes(8, "little"))
            f.write(hdr)
            f.truncate(8 + len(hdr) + dlen)  # the data is a hole
        os.replace(tmp, path)
        total_file += 8 + len(hdr) + dlen
        total_data += dlen
    with open(os.path.join(out, "config.json"), "wb") as f:
        f.write(cfg_text)
    with open(os.path.join(out, "model.safetensors.index.json"), "wb") as f:
        f.write(index_text)
    # published: 1,560,936,091,448 bytes in 96 files (k3-checkpoint-format.md 1)
    want = index.get("metadata", {}).get("total_size")
    print("%d tensors in %d shards: %d bytes (%d of tensor data; index total_size %s)" % (
        len(index["weight_map"]), len(shards), total_file, total_data, want))
    if want is not None and want != total_data:
        print("make_sparse_replica: tensor bytes %d differ from the index total_size %d" % (
            total_data, want), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
