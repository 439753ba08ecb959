// serve.test.mjs: the official `openai` npm client against `k3 serve`.
// Started by tests/cli/test_serve_e2e.sh, which sets:
//   SERVE_URL    a k3 serve on a random-weight model with the Kimi vocabulary
//   COLD_URL     a second, fresh k3 serve on the same model (nothing cached)
//   SCRIPT_URL   tests/serve/scripted_server: the same HTTP server whose model
//                replies with the chat template's rendering of a tool call
//   MODEL        the model id of SERVE_URL / COLD_URL
// Prints PASS/FAIL lines and "N passed, N failed".
import OpenAI from 'openai';
import { check, finish } from './check.mjs';

const model = process.env.MODEL;
const client = (url) => new OpenAI({ baseURL: url + 'v1', apiKey: 'none', timeout: 120000, maxRetries: 0 });
const warm = client(process.env.SERVE_URL);
const cold = client(process.env.COLD_URL);
const scripted = client(process.env.SCRIPT_URL);
const same = (name, got, want) => check(name, JSON.stringify(got) === JSON.stringify(want),
  `got ${JSON.stringify(got).slice(0, 300)}, wanted ${JSON.stringify(want).slice(0, 300)}`);

// Collects a stream into {reasoning, content, tool_calls, finish, usage, chunks}.
async function collect(stream) {
  const r = { reasoning: '', content: '', tool_calls: [], finish: null, usage: null, chunks: 0, objects: new Set() };
  for await (const ch of stream) {
    r.chunks++;
    r.objects.add(ch.object);
    if (ch.usage) r.usage = ch.usage;
    for (const c of ch.choices) {
      if (c.delta.reasoning_content) r.reasoning += c.delta.reasoning_content;
      if (c.delta.content) r.content += c.delta.content;
      for (const tc of c.delta.tool_calls || []) {
        const t = (r.tool_calls[tc.index] ||= { id: '', type: 'function', function: { name: '', arguments: '' } });
        if (tc.id) t.id = tc.id;
        if (tc.function?.name) t.function.name += tc.function.name;
        if (tc.function?.arguments) t.function.arguments += tc.function.arguments;
      }
      if (c.finish_reason) r.finish = c.finish_reason;
    }
  }
  return r;
}

try {
  // ---- models ----
  const models = await warm.models.list();
  same('models.list', models.data.map((m) => m.id), [model]);

  // ---- chat, not streamed: thinking on by default ----
  const hello = [{ role: 'user', content: 'Hello! What is 2 + 2?' }];
  const a = await warm.chat.completions.create({ model, messages: hello, max_tokens: 24, temperature: 0 });
  const m = a.choices[0].message;
  check('chat: object and role', a.object === 'chat.completion' && m.role === 'assistant', JSON.stringify(a).slice(0, 200));
  check('chat: reasoning_content (thinking on by default)', typeof m.reasoning_content === 'string' && m.reasoning_content.length > 0,
    JSON.stringify(m).slice(0, 300));
  check('chat: finish_reason', ['length', 'stop'].includes(a.choices[0].finish_reason), a.choices[0].finish_reason);
  check('chat: usage', a.usage.prompt_tokens > 0 && a.usage.completion_tokens > 0 &&
    a.usage.total_tokens === a.usage.prompt_tokens + a.usage.completion_tokens &&
    Number.isInteger(a.usage.prompt_tokens_details.cached_tokens), JSON.stringify(a.usage));

  // ---- the same streamed: the same text, chunk objects, usage, [DONE] ----
  const s = await collect(await warm.chat.completions.create({ model, messages: hello, max_tokens: 24, temperature: 0,
    stream: true, stream_options: { include_usage: true } }));
  same('stream: same reasoning as not streamed', s.reasoning, m.reasoning_content || '');
  same('stream: same content as not streamed', s.content, m.content || '');
  same('stream: same finish_reason', s.finish, a.choices[0].finish_reason);
  check('stream: chat.completion.chunk objects', s.objects.size === 1 && s.objects.has('chat.completion.chunk'), [...s.objects].join());
  check('stream: usage chunk', s.usage && s.usage.completion_tokens === a.usage.completion_tokens, JSON.stringify(s.usage));

  // ---- thinking off: no reasoning channel ----
  const off = await warm.chat.completions.create({ model, messages: hello, max_tokens: 12, temperature: 0,
    chat_template_kwargs: { thinking: false } });
  check('thinking off: no reasoning_content, content', !off.choices[0].message.reasoning_content &&
    typeof off.choices[0].message.content === 'string', JSON.stringify(off.choices[0].message).slice(0, 300));
  same('thinking off: the same reply twice', (await warm.chat.completions.create({ model, messages: hello, max_tokens: 12,
    temperature: 0, chat_template_kwargs: { thinking: false } })).choices[0].message, off.choices[0].message);

  // ---- a multi-turn conversation: turn 2 reuses turn 1 and equals a cold server ----
  const t1 = await warm.chat.completions.create({ model, messages: [{ role: 'user', content: 'Tell me a story.' }],
    max_tokens: 16, temperature: 0.8, seed: 11 });
  const turn2 = [{ role: 'user', content: 'Tell me a story.' },
    { role: 'assistant', content: t1.choices[0].message.content, reasoning_content: t1.choices[0].message.reasoning_content },
    { role: 'user', content: 'And then what happened?' }];
  const req2 = { model, messages: turn2, max_tokens: 16, temperature: 0.8, seed: 12 };
  const w2 = await warm.chat.completions.create(req2);
  const c2 = await cold.chat.completions.create(req2);
  const cached = w2.usage.prompt_tokens_details.cached_tokens;
  check('turn 2: cached tokens reported', cached >= t1.usage.prompt_tokens,
    `cached ${cached}, turn 1 prompt ${t1.usage.prompt_tokens}, turn 2 prompt ${w2.usage.prompt_tokens}`);
  check('turn 2: cold server reuses nothing', c2.usage.prompt_tokens_details.cached_tokens === 0,
    JSON.stringify(c2.usage));
  same('turn 2: same prompt tokens as a cold server', w2.usage.prompt_tokens, c2.usage.prompt_tokens);
  same('turn 2: same reply as a cold server', [w2.choices[0].message, w2.choices[0].finish_reason, w2.usage.completion_tokens],
    [c2.choices[0].message, c2.choices[0].finish_reason, c2.usage.completion_tokens]);
  console.log(`turn 2: ${cached} of ${w2.usage.prompt_tokens} prompt tokens reused`);

  // ---- a tool-call round trip through the template: declared tools, the
  // assistant's call and the tool's result in the history ----
  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const call = { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris"}' } };
  const round = [...ask, { role: 'assistant', content: null, tool_calls: [call] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temperature_c": 21, "sky": "clear"}' }];
  const r1 = await warm.chat.completions.create({ model, messages: ask, tools, max_tokens: 8, temperature: 0 });
  const r2 = await warm.chat.completions.create({ model, messages: round, tools, max_tokens: 8, temperature: 0 });
  check('tools: request with tools answered', r1.choices.length === 1 && r2.choices.length === 1);
  check('tools: the call and its result are in the prompt', r2.usage.prompt_tokens > r1.usage.prompt_tokens + 20,
    `${r2.usage.prompt_tokens} vs ${r1.usage.prompt_tokens}`);
  const r2c = await cold.chat.completions.create({ model, messages: round, tools, max_tokens: 8, temperature: 0 });
  same('tools: the result turn equals a cold server', r2.choices[0].message, r2c.choices[0].message);

  // the model side of the round trip: a model whose ids are the template's own
  // rendering of that call (scripted_server) gives it back as tool_calls
  const sc = await scripted.chat.completions.create({ model: 'scripted', messages: ask, tools, max_tokens: 200,
    chat_template_kwargs: { thinking: false } });
  const scm = sc.choices[0].message;
  same('tool call: finish_reason', sc.choices[0].finish_reason, 'tool_calls');
  same('tool call: name and arguments', (scm.tool_calls || []).map((t) => [t.type, t.function.name, JSON.parse(t.function.arguments)]),
    [['function', 'get_weather', { city: 'Paris' }]]);
  check('tool call: an id', typeof scm.tool_calls?.[0]?.id === 'string' && scm.tool_calls[0].id.length > 0);
  const again = await scripted.chat.completions.create({ model: 'scripted', messages: ask, tools, max_tokens: 200,
    chat_template_kwargs: { thinking: false } });
  check('tool call: ids unique across responses', again.choices[0].message.tool_calls[0].id !== scm.tool_calls[0].id,
    `${again.choices[0].message.tool_calls[0].id} twice`);
  check('tool call: no content', scm.content === null || scm.content === '', JSON.stringify(scm.content));
  const scs = await collect(await scripted.chat.completions.create({ model: 'scripted', messages: ask, tools,
    max_tokens: 200, stream: true, chat_template_kwargs: { thinking: false } }));
  same('tool call streamed: delta.tool_calls', scs.tool_calls.map((t) => [t.function.name, JSON.parse(t.function.arguments)]),
    [['get_weather', { city: 'Paris' }]]);
  same('tool call streamed: finish_reason', scs.finish, 'tool_calls');
  // the client's own stream helper accumulates the same message
  const helper = await scripted.chat.completions.stream({ model: 'scripted', messages: ask, tools, max_tokens: 200,
    chat_template_kwargs: { thinking: false } }).finalChatCompletion();
  same('tool call: the client stream helper', helper.choices[0].message.tool_calls.map((t) => [t.function.name, t.function.arguments]),
    scm.tool_calls.map((t) => [t.function.name, t.function.arguments]));
  // and the call goes back as history, with its result: the round trip
  const back = await warm.chat.completions.create({ model, tools, max_tokens: 8, temperature: 0,
    messages: [...ask, scm, { role: 'tool', tool_call_id: scm.tool_calls[0].id, content: '{"temperature_c": 21}' }] });
  check('tool call: sent back as history with its result', back.choices.length === 1 && back.usage.prompt_tokens > r1.usage.prompt_tokens);

  // ---- the fields clients send ----
  // developer is the system role: the same prompt and reply as system
  const asSystem = await warm.chat.completions.create({ model, max_tokens: 6, temperature: 0,
    messages: [{ role: 'system', content: 'Be brief.' }, ...hello] });
  const asDev = await warm.chat.completions.create({ model, max_tokens: 6, temperature: 0,
    messages: [{ role: 'developer', content: 'Be brief.' }, ...hello] });
  same('developer = system', [asDev.usage.prompt_tokens, asDev.choices[0].message],
    [asSystem.usage.prompt_tokens, asSystem.choices[0].message]);
  // every documented reasoning_effort: none turns thinking off; medium (the
  // default) renders no effort message; the others the template's effort
  const eff = {};
  for (const e of ['none', 'minimal', 'low', 'medium', 'high', 'xhigh']) {
    eff[e] = await warm.chat.completions.create({ model, messages: hello, max_tokens: 4, temperature: 0, reasoning_effort: e });
  }
  const plain = await warm.chat.completions.create({ model, messages: hello, max_tokens: 4, temperature: 0 });
  same('reasoning_effort none = thinking off', [eff.none.usage.prompt_tokens, eff.none.choices[0].message],
    [off.usage.prompt_tokens, (await warm.chat.completions.create({ model, messages: hello, max_tokens: 4, temperature: 0,
      chat_template_kwargs: { thinking: false } })).choices[0].message]);
  same('reasoning_effort medium = no effort given', eff.medium.usage.prompt_tokens, plain.usage.prompt_tokens);
  same('reasoning_effort minimal = low', eff.minimal.usage.prompt_tokens, eff.low.usage.prompt_tokens);
  check('reasoning_effort low/high/xhigh render an effort message', eff.low.usage.prompt_tokens > plain.usage.prompt_tokens &&
    eff.high.usage.prompt_tokens > plain.usage.prompt_tokens && eff.xhigh.usage.prompt_tokens > plain.usage.prompt_tokens,
    JSON.stringify(Object.fromEntries(Object.entries(eff).map(([k, v]) => [k, v.usage.prompt_tokens]))));
  same('modalities [text]', (await warm.chat.completions.create({ model, messages: hello, max_tokens: 4, temperature: 0,
    modalities: ['text'] })).choices[0].message, plain.choices[0].message);
  // logprobs: one entry per generated token (the stop id excepted), OpenAI's shape
  const lp = await warm.chat.completions.create({ model, messages: hello, max_tokens: 10, temperature: 0, logprobs: true,
    top_logprobs: 3, chat_template_kwargs: { thinking: false } });
  const lc = lp.choices[0].logprobs?.content || [];
  check('logprobs: entries', lc.length >= 1 && lc.length <= 10 && lc.every((e) => typeof e.token === 'string' &&
    e.logprob <= 0 && Array.isArray(e.bytes) && e.top_logprobs.length === 3 && e.top_logprobs[0].logprob === e.logprob),
    JSON.stringify(lp.choices[0].logprobs).slice(0, 400));
  same('logprobs: the reply unchanged', lp.choices[0].message, (await warm.chat.completions.create({ model, messages: hello,
    max_tokens: 10, temperature: 0, chat_template_kwargs: { thinking: false } })).choices[0].message);
  const lps = await warm.chat.completions.create({ model, messages: hello, max_tokens: 10, temperature: 0, logprobs: true,
    top_logprobs: 3, chat_template_kwargs: { thinking: false }, stream: true });
  const streamed = [];
  for await (const ch of lps) for (const c of ch.choices) streamed.push(...(c.logprobs?.content || []));
  same('logprobs: streamed the same', streamed, lc);
  // n: choices computed one after another; choice 0 is the n = 1 reply
  const n1 = await warm.chat.completions.create({ model, messages: hello, max_tokens: 6, temperature: 1, seed: 4 });
  const n3 = await warm.chat.completions.create({ model, messages: hello, max_tokens: 6, temperature: 1, seed: 4, n: 3 });
  same('n = 3: indexes', n3.choices.map((c) => c.index), [0, 1, 2]);
  same('n = 3: choice 0 is the n = 1 reply', n3.choices[0].message, n1.choices[0].message);
  check('n = 3: completion tokens summed', n3.usage.completion_tokens > n1.usage.completion_tokens, JSON.stringify(n3.usage));
  // penalties and logit_bias: neutral values change nothing; a +100 bias on
  // the end of the message ends the reply at once
  same('neutral penalties and bias: the reply unchanged', (await warm.chat.completions.create({ model, messages: hello,
    max_tokens: 4, temperature: 0, presence_penalty: 0, frequency_penalty: 0, logit_bias: {} })).choices[0].message,
    plain.choices[0].message);
  const ended = await warm.chat.completions.create({ model, messages: hello, max_tokens: 8, temperature: 0,
    logit_bias: { [process.env.END_OF_MSG]: 100 }, chat_template_kwargs: { thinking: false } });
  same('logit_bias: end of message forced', [ended.choices[0].finish_reason, ended.usage.completion_tokens, ended.choices[0].message.content],
    ['stop', 1, '']);
  const pen = { model, messages: hello, max_tokens: 12, temperature: 0, presence_penalty: 1.5, frequency_penalty: 1,
    repetition_penalty: 1.3 };
  same('penalties: deterministic', (await warm.chat.completions.create(pen)).choices[0].message,
    (await warm.chat.completions.create(pen)).choices[0].message);

  // ---- errors as the client sees them ----
  const status = async (p) => { try { await p; return 200; } catch (e) { return [e.status, e.error?.code ?? e.code]; } };
  same('error: n over the bound', await status(warm.chat.completions.create({ model, messages: hello, n: 9 })), [400, 'invalid_value']);
  same('error: an image part', await status(warm.chat.completions.create({ model, messages: [{ role: 'user', content: [
    { type: 'text', text: 'What is this?' }, { type: 'image_url', image_url: { url: 'data:image/png;base64,AAAA' } }] }] })),
    [400, 'unsupported_value']);
  same('error: audio modality', await status(warm.chat.completions.create({ model, messages: hello, modalities: ['text', 'audio'] })),
    [400, 'unsupported_value']);
  same('error: unknown reasoning_effort', await status(warm.chat.completions.create({ model, messages: hello,
    reasoning_effort: 'turbo' })), [400, 'invalid_value']);
  same('error: unknown model', await status(warm.chat.completions.create({ model: 'nope', messages: hello })), [404, 'model_not_found']);
  same('error: bad role', await status(warm.chat.completions.create({ model, messages: [{ role: 'wizard', content: 'x' }] })),
    [400, 'invalid_value']);
} catch (e) {
  check('exception', false, String(e.stack || e));
}
finish();
