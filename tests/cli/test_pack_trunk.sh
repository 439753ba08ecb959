#!/usr/bin/env bash
# asan
# k3 pack-trunk: pack, --verify, and the faults: a flipped byte in the trunk,
# a shard truncated after packing, a trunk from a different checkpoint.
. "$(dirname "$0")/lib.sh"
SRC=tests/fixtures/gen/k3_like
M=$OUT/model
rm -rf "$M" "$OUT/trunk"; mkdir -p "$M"
cp "$SRC"/* "$M"/

expect_exit pack 0 $K3 pack-trunk "$M" "$OUT/trunk"
[ -f "$OUT/trunk/trunk.bin" ] && [ -f "$OUT/trunk/trunk.json" ] && pass pack:files || fail pack:files
ls "$OUT/trunk" | grep -qv '^trunk\.\(bin\|json\)$' && fail pack:no-temp "$(ls "$OUT/trunk")" || pass pack:no-temp
expect_exit verify 0 $K3 pack-trunk "$M" "$OUT/trunk" --verify
# a trunk folder under folders that do not exist yet is made with them
rm -rf "$OUT/nest"
expect_exit pack_nested 0 $K3 pack-trunk "$M" "$OUT/nest/a/trunk"
cmp -s "$OUT/trunk/trunk.bin" "$OUT/nest/a/trunk/trunk.bin" && pass pack_nested:same || fail pack_nested:same

# a flipped byte inside a layer run
cp "$OUT/trunk/trunk.bin" "$OUT/trunk.bin.good"
printf '\x5a' | dd of="$OUT/trunk/trunk.bin" bs=1 seek=$((4096 * 3 + 17)) conv=notrunc status=none
expect_exit flipped 4 $K3 pack-trunk "$M" "$OUT/trunk" --verify
cp "$OUT/trunk.bin.good" "$OUT/trunk/trunk.bin"

# a trunk packed from another checkpoint
expect_exit other 4 $K3 pack-trunk tests/fixtures/gen/s2_two_dense "$OUT/trunk" --verify
expect_err_contains other "different checkpoint"

# a shard truncated after packing
last=$(ls "$M"/model-*.safetensors | sort | sed -n 3p)
truncate -s -1000 "$last"
expect_exit truncated 4 $K3 pack-trunk "$M" "$OUT/trunk" --verify

# usage
expect_exit noargs 2 $K3 pack-trunk "$M"
expect_exit badflag 2 $K3 pack-trunk "$M" "$OUT/trunk" --bogus
expect_exit nomodel 2 $K3 pack-trunk "$OUT/none" "$OUT/t2"
expect_exit notrunk 2 $K3 pack-trunk "$SRC" "$OUT/none" --verify
finish
