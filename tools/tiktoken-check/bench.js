// bench.js: npm tiktoken encode throughput on the texts bench/tokenizer.c uses
// (run from the repository root: node tools/tiktoken-check/bench.js).
"use strict";
const fs = require("fs");
const { kimiEncoder } = require("./kimi.js");

const enc = kimiEncoder();
function bench(name, text) {
  const len = Buffer.byteLength(text, "utf8");
  let best = Infinity, total = 0, iters = 0, n = 0;
  while (total < 2.0 || iters < 3) {
    // CPU time (user + system), as bench/tokenizer.c: the machine is shared
    const t0 = process.cpuUsage();
    n = enc.encode_ordinary(text).length;
    const u = process.cpuUsage(t0);
    const dt = (u.user + u.system) / 1e6;
    best = Math.min(best, dt);
    total += dt;
    iters++;
  }
  console.log(`${name.padEnd(14)} ${String(len).padStart(9)} bytes ${String(n).padStart(8)} ids  ` +
              `encode ${(len / best / 1e6).toFixed(2).padStart(7)} MB/s (CPU time, best of ${iters})`);
}
bench("tinystories", fs.readFileSync("../shared/data/tinystories/train.txt", "utf8"));
const corpus = JSON.parse(fs.readFileSync("tests/fixtures/tokenizer/corpus.json", "utf8"))
  .filter((c) => !c.allow_special && !c.name.startsWith("long_")).map((c) => c.text).join("");
const one = Buffer.byteLength(corpus, "utf8");
bench("multilingual", corpus.repeat(Math.floor((1 << 20) / one) + 1));
enc.free();
