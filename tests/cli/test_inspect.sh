#!/usr/bin/env bash
# asan
# k3 inspect: the published census of the release (on a sparse replica built
# here by tools/make_sparse_replica.py), the peer fixtures, and one-line
# errors with the documented exit code for each malformed input.
. tests/cli/lib.sh
PY=${PYTHON:-python3}

# --- the sparse replica of the release (built once into tests/out) ---
R=tests/out/replica
if [ ! -e "$R/.built" ] || [ tools/make_sparse_replica.py -nt "$R/.built" ]; then
  rm -rf "$R"
  if $PY tools/make_sparse_replica.py "$R" >"$OUT/replica.log" 2>&1; then
    touch "$R/.built"; pass replica_built
  else
    fail replica_built "$(tail -n 3 "$OUT/replica.log")"
  fi
fi
expect_exit replica 0 "$K3" inspect "$R"
expect_out_contains replica "files: 1,560,936,091,448 bytes in 96 shards"
expect_out_contains replica "routed experts: 82,432 routed experts of exactly 17,547,264 bytes"
expect_out_contains replica "always-active parameters: 56,743,648,000"
expect_out_contains replica "tensors: 497,220"
expect_out_contains replica "layers: 93 (69 KDA, 24 MLA; 1 dense, 92 MoE)"
expect_out_contains replica "layer map: KKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMKKKMM"
# one state-cache snapshot, by hand: 69 KDA layers x (96 x 128 x 128 + 3 x 12,288 x 3)
# floats; 24 MLA layers x (512 + 64) floats per position
expect_out_contains replica "decode-state snapshot: 464,633,856 bytes of KDA state + 55,296 bytes per position"
expect_exit replica_json 0 "$K3" inspect "$R" --json
expect_out_contains replica_json '"file_bytes": 1560936091448'
expect_out_contains replica_json '"always_active_params": 56743648000'
expect_out_contains replica_json '"min_bytes": 17547264'
expect_out_contains replica_json '"max_bytes": 17547264'
expect_out_contains replica_json '"count": 82432'
# the fast header scanner and jansson must give the same census
case "$K3" in
  *asan*) ;;
  *) K3_ST_JANSSON=1 "$K3" inspect "$R" --json >"$OUT/replica_jansson.out" 2>&1
     if cmp -s "$OUT/replica_json.out" "$OUT/replica_jansson.out"; then pass replica_jansson_same
     else fail replica_jansson_same "census differs with K3_ST_JANSSON=1"; fi ;;
esac

# --- peer fixtures ---
expect_exit tiny 0 "$K3" inspect "$(fixture peer/tiny-checkpoint)"
expect_out_contains tiny "layer map: KKKMKKKMKKKMM"
expect_out_contains tiny "96 routed experts of exactly 6,528 bytes"
expect_exit peer_st 0 "$K3" inspect "$(fixture peer/st)"
expect_out_contains peer_st "tensors: 13"

# --- usage ---
expect_exit no_args 2 "$K3" inspect
expect_exit bad_option 2 "$K3" inspect "$R" --frobnicate
expect_exit missing_path 2 "$K3" inspect "$OUT/does-not-exist"
mkdir -p "$OUT/empty"
expect_exit empty_dir 2 "$K3" inspect "$OUT/empty"
expect_err_contains empty_dir "no *.safetensors shards"

# --- malformed checkpoints: each a directory holding one bad file ---
$PY - "$OUT/bad" <<'PYEOF'
import json, os, struct, sys
root = sys.argv[1]
def st(name, header, data=b"", hlen=None, extra=None):
    d = os.path.join(root, name); os.makedirs(d, exist_ok=True)
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h) if hlen is None else hlen) + h + data)
    for fn, text in (extra or {}).items():
        open(os.path.join(d, fn), "w").write(text)
T = lambda dt, shape, a, b: {"dtype": dt, "shape": shape, "data_offsets": [a, b]}
st("truncated_header", {"a": T("F32", [1], 0, 4)}, b"", hlen=400)
st("hlen_past_eof", b"{}", hlen=1 << 40)
st("oob", {"a": T("F32", [4], 0, 16)}, b"\0" * 8)
st("overlap", {"a": T("F32", [2], 0, 8), "b": T("F32", [2], 4, 12)}, b"\0" * 12)
st("unknown_dtype", {"a": T("F8_E4M3", [4], 0, 4)}, b"\0" * 4)
st("shape_mismatch", {"a": T("BF16", [3, 3], 0, 16)}, b"\0" * 16)
st("non_utf8_name", b'{"a\xff":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0")
st("rank9", {"a": T("U8", [1] * 9, 0, 1)}, b"\0")
st("truncated_data", {"a": T("F32", [4], 0, 16)}, b"\0" * 16)
os.truncate(os.path.join(root, "truncated_data", "model.safetensors"),
            os.path.getsize(os.path.join(root, "truncated_data", "model.safetensors")) - 3)
st("index_missing_shard", {"a": T("U8", [1], 0, 1)}, b"\0",
   extra={"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00002-of-000002.safetensors"}})})
st("index_missing_tensor", {"a": T("U8", [1], 0, 1)}, b"\0",
   extra={"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model.safetensors", "b": "model.safetensors"}})})
d = os.path.join(root, "zero_bytes"); os.makedirs(d, exist_ok=True)
open(os.path.join(d, "model.safetensors"), "wb").close()
d = os.path.join(root, "dup_across_shards"); os.makedirs(d, exist_ok=True)
for i in (1, 2):
    h = json.dumps({"x": T("U8", [1], 0, 1)}).encode()
    open(os.path.join(d, "model-%05d-of-000002.safetensors" % i), "wb").write(struct.pack("<Q", len(h)) + h + b"\0")
PYEOF
for c in truncated_header hlen_past_eof oob overlap unknown_dtype shape_mismatch non_utf8_name rank9 \
         truncated_data index_missing_shard index_missing_tensor zero_bytes dup_across_shards; do
  expect_exit "bad_$c" 4 "$K3" inspect "$OUT/bad/$c"
  expect_err_contains "bad_$c" "$OUT/bad/$c/"
done
expect_err_contains bad_unknown_dtype "unknown dtype 'F8_E4M3'"
expect_err_contains bad_overlap "overlap"
expect_err_contains bad_truncated_data "past the data section"
expect_err_contains bad_index_missing_shard "model-00002-of-000002.safetensors"
expect_err_contains bad_index_missing_tensor "names tensor 'b'"
expect_err_contains bad_zero_bytes "0 bytes"

# --- configs: each peer bad config beside the tiny checkpoint's weights ---
TINY=$(cd "$(fixture peer/tiny-checkpoint)" && pwd)
for c in bad_layer_index bad_topk no_layermap; do
  mkdir -p "$OUT/cfg_$c"
  ln -sf "$TINY/model.safetensors" "$OUT/cfg_$c/model.safetensors"
  cp "$(fixture peer/cfg/$c.json)" "$OUT/cfg_$c/config.json"
  expect_exit "cfg_$c" 2 "$K3" inspect "$OUT/cfg_$c"
  expect_err_contains "cfg_$c" "$OUT/cfg_$c/config.json"
done
expect_err_contains cfg_bad_layer_index "999"
expect_err_contains cfg_bad_topk "num_experts_per_token 128 exceeds num_experts 8"
expect_err_contains cfg_no_layermap "missing required keys: full_attn_layers"
# a config whose vocabulary does not match the embedding
mkdir -p "$OUT/cfg_vocab"
ln -sf "$TINY/model.safetensors" "$OUT/cfg_vocab/model.safetensors"
sed 's/"vocab_size": 256/"vocab_size": 300/' "$TINY/config.json" >"$OUT/cfg_vocab/config.json"
expect_exit cfg_vocab 4 "$K3" inspect "$OUT/cfg_vocab"
expect_err_contains cfg_vocab "vocab_size 300"

finish
