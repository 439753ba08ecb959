// bench/serve_parallel.mjs: C concurrent clients of a k3 serve at URL, each
// with the npm openai client (tests/e2e/node_modules), each sending R
// streamed /v1/completions requests one after another (max_tokens G,
// temperature T (default 0.8), a seed per request). Prints one JSON line: clients,
// requests, completion tokens, wall seconds, aggregate tokens/s, and the
// p50/p95 time to first token (from the request to its first text event).
// Usage: node bench/serve_parallel.mjs URL C R G [T [MODEL]]  (MODEL: the name the
// server serves, its directory's name; default 'default')
import { createRequire } from 'module';
const require = createRequire(new URL('../tests/e2e/package.json', import.meta.url));
const OpenAI = require('openai').default ?? require('openai');

const [url, C, R, G] = [process.argv[2], +process.argv[3], +process.argv[4], +process.argv[5]];
const T = process.argv[6] === undefined ? 0.8 : +process.argv[6];
const MODEL = process.argv[7] ?? 'default';
const client = new OpenAI({ baseURL: url + 'v1', apiKey: 'none', timeout: 600000, maxRetries: 0 });
const prompts = ['Once upon a time', 'The little dog', 'One day a girl named Lily', 'Tom and his friend',
                 'There was a big tree', 'The sun was shining', 'A cat sat on', 'Mom said'];
const ttft = [];
let tokens = 0;

async function one(c, r) {
  const t0 = performance.now();
  let first = 0;
  const stream = await client.completions.create({
    model: MODEL, prompt: prompts[(c + r) % prompts.length], max_tokens: G, temperature: T,
    seed: 100 * c + r, stream: true, stream_options: { include_usage: true } });
  for await (const ev of stream) {
    if (!first && ev.choices?.length && ev.choices[0].text) first = performance.now();
    if (ev.usage) tokens += ev.usage.completion_tokens;
  }
  ttft.push((first || performance.now()) - t0);
}

async function clientLoop(c) { for (let r = 0; r < R; r++) await one(c, r); }

const t0 = performance.now();
await Promise.all(Array.from({ length: C }, (_, c) => clientLoop(c)));
const wall = (performance.now() - t0) / 1000;
ttft.sort((a, b) => a - b);
const pct = (p) => ttft[Math.min(ttft.length - 1, Math.ceil(p * ttft.length) - 1)] / 1000;
console.log(JSON.stringify({ clients: C, requests: ttft.length, tokens, wall_s: +wall.toFixed(3),
  tokens_per_s: +(tokens / wall).toFixed(1), ttft_p50_s: +pct(0.5).toFixed(3), ttft_p95_s: +pct(0.95).toFixed(3) }));
