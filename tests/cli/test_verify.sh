#!/usr/bin/env bash
# asan
# k3 verify: shard digests against a sha256sum manifest (written without one),
# byte ranges and dtypes, and every refusal as one line with its exit code.
# References: coreutils sha256sum on the same files, and the FIPS 180-2
# example digests for "abc", the empty message and the 448-bit message.
. "$(dirname "$0")/lib.sh"
M=$OUT/model; rm -rf "$M"; mkdir -p "$M"; cp tests/fixtures/gen/k3_like/* "$M/"
rm -f "$M/expected.json"

expect_exit write 0 $K3 verify "$M"
[ -s "$M/SHA256SUMS" ] && pass write:file || fail write:file
# the manifest is what sha256sum computes, in its format
(cd "$M" && sha256sum model-*.safetensors) >"$OUT/coreutils.sums"
diff <(sort -k2 "$M/SHA256SUMS") <(sort -k2 "$OUT/coreutils.sums") >/dev/null && pass write:equals-sha256sum \
  || fail write:equals-sha256sum "$(diff <(sort -k2 "$M/SHA256SUMS") <(sort -k2 "$OUT/coreutils.sums") | head -3)"
(cd "$M" && sha256sum -c --quiet SHA256SUMS) >/dev/null 2>&1 && pass write:sha256sum-c || fail write:sha256sum-c
expect_exit check 0 $K3 verify "$M" --sha256 "$M/SHA256SUMS"
expect_out_contains check "matches"
expect_exit check-coreutils 0 $K3 verify "$M" --sha256 "$OUT/coreutils.sums"
# binary-mode lines ("hex *name") and upper-case hex are the same manifest
awk '{ print toupper($1) " *" $2 }' "$OUT/coreutils.sums" >"$OUT/binary.sums"
expect_exit check-binary-upper 0 $K3 verify "$M" --sha256 "$OUT/binary.sums"

# FIPS 180-2 example digests, through files the manifest lists
printf 'abc' >"$M/abc.txt"; : >"$M/empty.txt"
printf 'abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq' >"$M/448.txt"
{ cat "$OUT/coreutils.sums"
  echo "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  abc.txt"
  echo "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  empty.txt"
  echo "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1  448.txt"; } >"$OUT/fips.sums"
expect_exit fips-vectors 0 $K3 verify "$M" --sha256 "$OUT/fips.sums"
sed 's/^ba7816bf/ba7816be/' "$OUT/fips.sums" >"$OUT/fips-bad.sums"
expect_exit fips-wrong 4 $K3 verify "$M" --sha256 "$OUT/fips-bad.sums"
expect_err_contains fips-wrong "abc.txt"

# a changed byte in a shard's data
cp "$M/model-00003-of-000010.safetensors" "$OUT/shard3.good"
size=$(stat -c %s "$M/model-00003-of-000010.safetensors")
printf '\x5a' | dd of="$M/model-00003-of-000010.safetensors" bs=1 seek=$((size - 10)) conv=notrunc status=none
expect_exit flipped 4 $K3 verify "$M" --sha256 "$M/SHA256SUMS"
expect_err_contains flipped "model-00003-of-000010.safetensors: sha256"
cp "$OUT/shard3.good" "$M/model-00003-of-000010.safetensors"
# a shard the manifest does not list; a listed file that is missing
grep -v 00005 "$M/SHA256SUMS" >"$OUT/short.sums"
expect_exit unlisted 4 $K3 verify "$M" --sha256 "$OUT/short.sums"
expect_err_contains unlisted "not in the manifest"
{ cat "$M/SHA256SUMS"; echo "0000000000000000000000000000000000000000000000000000000000000000  gone.bin"; } >"$OUT/gone.sums"
expect_exit listed-missing 4 $K3 verify "$M" --sha256 "$OUT/gone.sums"
# a truncated shard: its byte ranges no longer fit
head -c 20000 "$OUT/shard3.good" >"$M/model-00003-of-000010.safetensors"
expect_exit truncated 4 $K3 verify "$M"
cp "$OUT/shard3.good" "$M/model-00003-of-000010.safetensors"
# config against the index
sed 's/"vocab_size": 128/"vocab_size": 100/' tests/fixtures/gen/k3_like/config.json >"$M/config.json"
expect_exit config-mismatch 4 $K3 verify "$M" --sha256 "$M/SHA256SUMS"
cp tests/fixtures/gen/k3_like/config.json "$M/"

# usage
printf 'not a manifest\n' >"$OUT/bad.sums"
expect_exit bad-manifest 2 $K3 verify "$M" --sha256 "$OUT/bad.sums"
expect_exit no-manifest-file 2 $K3 verify "$M" --sha256 "$OUT/none.sums"
expect_exit write-nodir 2 $K3 verify "$M" --write "$OUT/no/dir/SUMS"
expect_exit no-dir 2 $K3 verify "$OUT/nothing"
expect_exit both 2 $K3 verify "$M" --sha256 "$M/SHA256SUMS" --write "$OUT/x"
expect_exit bad-flag 2 $K3 verify "$M" --bogus
# one file, two digests: sha256sum -c fails one of the lines, so must verify;
# the same line twice is still a manifest that checks
{ cat "$OUT/coreutils.sums"; head -n 1 "$OUT/coreutils.sums" | awk '{ printf "%064d  %s\n", 0, $2 }'; } >"$OUT/conflict.sums"
expect_exit conflicting-digests 2 $K3 verify "$M" --sha256 "$OUT/conflict.sums"
expect_err_contains conflicting-digests "another digest"
{ cat "$OUT/coreutils.sums"; head -n 1 "$OUT/coreutils.sums"; } >"$OUT/repeat.sums"
expect_exit repeated-line 0 $K3 verify "$M" --sha256 "$OUT/repeat.sums"
# an endless manifest is refused at once, not read until memory runs out
expect_exit manifest-dev-zero 2 bash -c "$MEM_CAP timeout 20 $K3 verify '$M' --sha256 /dev/zero"
expect_err_contains manifest-dev-zero "not a regular file"
expect_exit help 0 $K3 verify --help
expect_out_contains help "sha256sum"
finish
