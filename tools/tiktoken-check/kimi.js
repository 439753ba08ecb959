// kimi.js: the Kimi encoder for npm tiktoken, and the probe text and id hash
// that tests/test_tokenizer.c rebuilds identically in C.
"use strict";
const fs = require("fs");
const { Tiktoken } = require("./node_modules/tiktoken");

const DIR = "tests/fixtures/tokenizer/kimi";
// Verbatim from SOURCE.md (checked below), in Rust regex syntax.
const PAT =
  "[\\p{Han}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

function kimiEncoder() {
  if (!fs.readFileSync(`${DIR}/SOURCE.md`, "utf8").includes("\n  " + PAT + "\n"))
    throw new Error("pattern differs from SOURCE.md");
  const model = fs.readFileSync(`${DIR}/tiktoken.model`, "utf8");
  const nBase = model.split("\n").filter((l) => l.length).length;
  const cfg = JSON.parse(fs.readFileSync(`${DIR}/tokenizer_config.json`, "utf8"));
  const named = cfg.added_tokens_decoder || {};
  const specials = {};
  for (let i = nBase; i < nBase + 256; i++)
    specials[named[i] ? named[i].content : `<|reserved_token_${i}|>`] = i;
  return new Tiktoken(model, specials, PAT);
}

const BLOCK = 4096;
// Each code point X in contexts that tell the pattern's classes apart:
// Han or not ("aX", "中X"), upper vs lower vs other letters ("XAb"),
// marks vs letters ("..X"), digits ("1X"), contractions ("a'X"), spaces.
function probe(c) {
  const x = String.fromCodePoint(c);
  return `a${x} ${x}Ab ..${x} 1${x} \u4e2d${x} a'${x}\n`;
}
function probeBlock(b) {
  let s = "";
  for (let c = b; c < b + BLOCK; c++) if (c < 0xd800 || c > 0xdfff) s += probe(c);
  return s;
}

const P = 0x100000001b3n, M = (1n << 64n) - 1n;
function hashIds(ids) {
  let h = 0xcbf29ce484222325n;
  for (const id of ids) h = ((h ^ BigInt(id)) * P) & M;
  return h.toString(16).padStart(16, "0");
}

module.exports = { kimiEncoder, probe, probeBlock, BLOCK, hashIds, PAT };
