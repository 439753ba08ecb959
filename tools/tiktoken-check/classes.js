// classes.js: how tiktoken's Kimi pattern classifies every Unicode scalar
// value, read off tiktoken itself. For each code point X, seven probe strings
// are each either one pre-tokenizer piece or several:
//   bit 0 "中X"   X is Han (Script)
//   bit 1 "aX"    X is in [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
//   bit 2 "XA"    X is in [\p{Lu}\p{Lt}] and not Han
//   bit 3 "..X"   X is none of L, N, White_Space
//   bit 4 "1X"    X is N
//   bit 5 "  X"   X is White_Space
//   bit 6 "a'X"   X completes a contraction (?i:'s|'t|'m|'d)
//   bit 7 "XAb"   X is in [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]] or may
//                 open a word (none of L, N, \r, \n)
// The split is observed through a crafted vocabulary: the 256 bytes plus every
// probe string as one token. tiktoken emits a piece that is a whole token as
// that one id, so a probe encodes to a single id exactly when it is one piece.
// Output, run-length coded: tests/fixtures/tokenizer/classes.txt, lines
// "START MASK" (hex) giving the mask from START to the next line's START.
"use strict";
const fs = require("fs");
const { Tiktoken } = require("./node_modules/tiktoken");
const { PAT } = require("./kimi.js");

const PROBES = [(x) => "\u4e2d" + x, (x) => "a" + x, (x) => x + "A", (x) => ".." + x,
                (x) => "1" + x, (x) => "  " + x, (x) => "a'" + x, (x) => x + "Ab"];
const CHUNK = 1 << 15;
const bytes = [];
for (let b = 0; b < 256; b++) bytes.push(Buffer.from([b]).toString("base64") + " " + b);

let runs = [], last = -1;
for (let c0 = 0; c0 < 0x110000; c0 += CHUNK) {
  const lines = bytes.slice(), seen = new Set();
  let rank = 256;
  const cps = [];
  for (let c = c0; c < c0 + CHUNK; c++) {
    if (c >= 0xd800 && c <= 0xdfff) continue;
    cps.push(c);
    const x = String.fromCodePoint(c);
    for (const p of PROBES) {
      const s = p(x);
      if (seen.has(s)) continue;
      seen.add(s);
      lines.push(Buffer.from(s, "utf8").toString("base64") + " " + rank++);
    }
  }
  const enc = new Tiktoken(lines.join("\n") + "\n", {}, PAT);
  for (const c of cps) {
    const x = String.fromCodePoint(c);
    let m = 0;
    PROBES.forEach((p, i) => { if (enc.encode_ordinary(p(x)).length === 1) m |= 1 << i; });
    if (m !== last) { runs.push(c.toString(16) + " " + m.toString(16)); last = m; }
  }
  enc.free();
  process.stderr.write(".");
}
fs.writeFileSync("tests/fixtures/tokenizer/classes.txt",
  "# tools/tiktoken-check/classes.js: tiktoken's pattern classes per code point (START MASK, hex)\n" +
  runs.join("\n") + "\n");
console.log(`\n${runs.length} runs`);
