// expected.js: reference ids from npm tiktoken (the Rust core of OpenAI's
// tiktoken compiled to WASM) for the k3 tokenizer tests. Independent of k3's
// own code: it builds the Kimi encoder from tests/fixtures/tokenizer/kimi exactly
// as the Kimi tokenizer class does (pattern from SOURCE.md, 256 reserved
// specials after the base ranks) and writes
//   tests/fixtures/tokenizer/expected.json
// Run from the repository root:
//   (cd tools/tiktoken-check && npm ci) && node tools/tiktoken-check/expected.js
"use strict";
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");
const { kimiEncoder, probeBlock, BLOCK, hashIds } = require("./kimi.js");

const enc = kimiEncoder();
const corpus = JSON.parse(fs.readFileSync("tests/fixtures/tokenizer/corpus.json", "utf8"));
const cases = corpus.map((c) => {
  const ids = c.allow_special ? enc.encode(c.text, "all") : enc.encode_ordinary(c.text);
  return { name: c.name, ids: Array.from(ids) };
});

// Whole files: ids are too many to store, so a 64-bit hash of them and the count.
// The committed fixtures (FILE, or FILE.gz when it is stored compressed), and
// the tech report, which is not committed (its licence is not ours to grant):
// the test of that one runs only where ../shared is beside the repository.
const read = (p) => fs.existsSync(p) ? fs.readFileSync(p) : zlib.gunzipSync(fs.readFileSync(p + ".gz"));
const files = [
  "tests/fixtures/docs/k3-checkpoint-format.md",
  "../shared/docs/kimi-k3-tech-report.txt",
  "tests/fixtures/tinystories/valid.txt",
  "tests/fixtures/tinystories/train.txt", // over 1 MiB: k3 encodes it in parallel chunks
  "tests/fixtures/tokenizer/kimi/SOURCE.md",
].map((p) => {
  const text = new TextDecoder("utf-8", { fatal: true }).decode(read(p));
  const ids = enc.encode_ordinary(text), sids = enc.encode(text, "all");
  return { path: p, count: ids.length, hash: hashIds(ids),
           count_special: sids.length, hash_special: hashIds(sids) };
});

// Every Unicode scalar value, in blocks of BLOCK code points, through probe contexts.
const blocks = [];
for (let b = 0; b < 0x110000; b += BLOCK) {
  const ids = enc.encode_ordinary(probeBlock(b));
  blocks.push({ start: b, count: ids.length, hash: hashIds(ids) });
}
enc.free();

const out = {
  generator: "tools/tiktoken-check/expected.js with npm tiktoken " +
    require("./node_modules/tiktoken/package.json").version,
  cases, files, block: BLOCK, blocks,
};
fs.writeFileSync("tests/fixtures/tokenizer/expected.json", JSON.stringify(out) + "\n");
console.log(`${cases.length} cases, ${files.length} files, ${blocks.length} blocks`);
