// serve_page.test.mjs: the chat page of `k3 serve` in headless Chromium
// (Debian's /usr/bin/chromium through playwright-core). Started by
// tests/cli/test_serve_e2e.sh, which sets SERVE_URL (a k3 serve on a model
// with the Kimi vocabulary), E2E_OUT (screenshots) and CHROMIUM.
// Type a message, send it, watch the reply stream in with its reasoning
// readable in an open <details> before the reply ends, folded once it ends
// (labelled "reasoning cut" when the token limit closed it); turn thinking
// off and see no reasoning. The conversation survives a reload; regenerate
// resends the same messages and replaces the last reply; editing the first
// message resends from there; copy fills the clipboard; "new chat" forgets
// the conversation, also after a reload. A stored reply renders as Markdown
// (MARKDOWN=1) with injected HTML sanitised. With COMPLETION_URL (a k3 serve on a model with no
// chat template) also: its page shows no thinking box at all.
// Prints PASS/FAIL lines and "N passed, N failed".
import { check, out, runPage } from './page.mjs';
import path from 'node:path';

const url = process.env.SERVE_URL;

await runPage({ viewport: { width: 1100, height: 900 } }, async (page, problems) => {
  const streams = [];
  const sent = []; // the chat requests' bodies, in order
  page.on('request', (r) => { if (r.url().endsWith('/v1/chat/completions')) sent.push(r.postDataJSON()); });
  page.on('response', (r) => { if (r.url().endsWith('/v1/chat/completions')) streams.push(r.headers()['content-type'] || ''); });

  const resp = await page.goto(url, { waitUntil: 'load' });
  check('page loads', resp && resp.status() === 200, resp ? `HTTP ${resp.status()}` : 'no response');
  await page.waitForFunction(() => document.querySelector('#model').textContent.length > 0, null, { timeout: 30000 });
  check('model name shown', (await page.textContent('#model')).length > 0);
  check('thinking toggle on by default', await page.isChecked('#thinking'));

  // count every change of the reasoning and content text while it streams,
  // and note whether the reasoning was readable (shown, open, not empty)
  // while the reply was still running (its meta line not yet written)
  await page.evaluate(() => {
    window.__updates = 0;
    window.__live = false;
    new MutationObserver(() => {
      window.__updates++;
      const m = document.querySelector('.msg.assistant');
      const d = m && m.querySelector('details.reasoning');
      if (d && !d.hidden && d.open && d.querySelector('.text').textContent.length > 0 &&
          m.querySelector('.meta').textContent === '') window.__live = true;
    }).observe(document.querySelector('#log'), { subtree: true, characterData: true, childList: true });
  });
  await page.fill('#max_tokens', '120');
  await page.fill('#input', 'Hello! Who are you?');
  await page.click('#send');
  await page.waitForFunction(() => {
    const m = document.querySelectorAll('.msg.assistant');
    return m.length === 1 && m[0].querySelector('.meta').textContent.length > 0;
  }, null, { timeout: 120000 });
  const first = await page.evaluate(() => {
    const m = document.querySelector('.msg.assistant');
    const d = m.querySelector('details.reasoning');
    return { hidden: d.hidden, open: d.open, reasoning: d.querySelector('.text').textContent,
      summary: d.querySelector('summary').textContent, meta: m.querySelector('.meta').textContent,
      error: m.classList.contains('error'), user: document.querySelector('.msg.user .text').textContent,
      updates: window.__updates, live: window.__live, content: m.querySelector('.content').textContent };
  });
  check('user message shown', first.user === 'Hello! Who are you?', first.user);
  check('reply without error', !first.error, first.meta);
  check('reasoning visible while it streams, before the reply ends', first.live);
  check('reasoning shown apart, in a <details>', !first.hidden && first.reasoning.length > 0, JSON.stringify(first).slice(0, 300));
  // the label follows from what the server sent: no answer and finish_reason
  // "length" (shown in the meta line) means the limit cut the think channel
  const cut = first.content === '' && first.meta.endsWith('(length)');
  check(`reasoning labelled "${cut ? 'reasoning cut' : 'reasoning'}"`, first.summary === (cut ? 'reasoning cut' : 'reasoning'),
    first.summary);
  check('reasoning folded once the reply ends', !first.open);
  check('reply streamed (many updates)', first.updates > 10, `${first.updates} updates`);
  check('served as server-sent events', streams.length === 1 && streams[0].startsWith('text/event-stream'), streams.join());
  check('tokens reported', /\d+ tokens in/.test(first.meta), first.meta);
  await page.click('.msg.assistant details.reasoning summary');
  check('reasoning unfolds on click', await page.evaluate(() => document.querySelector('.msg.assistant details').open));
  await page.screenshot({ path: path.join(out, 'chat.png'), fullPage: true });

  // second turn: the page resends the history, the server reuses it
  const turn = async (n, text) => {
    await page.fill('#input', text);
    await page.click('#send');
    await page.waitForFunction((k) => {
      const m = document.querySelectorAll('.msg.assistant');
      return m.length === k && m[k - 1].querySelector('.meta').textContent.length > 0;
    }, n, { timeout: 120000 });
    return page.evaluate((k) => {
      const m = document.querySelectorAll('.msg.assistant')[k - 1];
      return { hidden: m.querySelector('details.reasoning').hidden, meta: m.querySelector('.meta').textContent,
        error: m.classList.contains('error'), content: m.querySelector('.content').textContent };
    }, n);
  };
  await page.fill('#max_tokens', '24');
  const second = await turn(2, 'Tell me more.');
  const reused = /(\d+) of (\d+) prompt tokens reused/.exec(second.meta);
  check('turn 2 reuses the first turn', !second.error && reused && Number(reused[1]) > 0, second.meta);
  // third turn, thinking off: no reasoning
  await page.uncheck('#thinking');
  const third = await turn(3, 'Say it again, shorter.');
  check('thinking off: no reasoning block', third.hidden && !third.error, JSON.stringify(third).slice(0, 300));
  await page.screenshot({ path: path.join(out, 'chat-3.png'), fullPage: true });

  // a cut for sure: 3 tokens cannot close the think channel and answer
  await page.fill('#max_tokens', '3');
  await page.check('#thinking');
  const fourth = await turn(4, 'Think about it.');
  const label4 = await page.evaluate(() => [...document.querySelectorAll('.msg.assistant summary')].pop().textContent);
  check('3-token limit: "reasoning cut"', !fourth.error && fourth.content === '' && fourth.meta.endsWith('(length)') &&
    label4 === 'reasoning cut', `${label4} / ${fourth.meta}`);

  // ---- the conversation survives a reload ----
  const snapshot = () => page.evaluate(() => [...document.querySelectorAll('#log .msg')].map((m) =>
    m.classList.contains('user') ? 'U:' + m.querySelector('.text').textContent
      : 'A:' + (m.querySelector('details .text')?.textContent ?? '') + '|' + (m.querySelector('summary')?.textContent ?? '') +
        '|' + m.querySelector('.content').textContent + '|' + m.querySelector('.meta').textContent));
  const ready = () => page.waitForFunction(() => document.querySelector('#status').textContent === 'ready', null,
    { timeout: 30000 });
  const before = await snapshot();
  await page.reload({ waitUntil: 'load' });
  await ready();
  const after = await snapshot();
  check('reload keeps the conversation', before.length === 8 && JSON.stringify(after) === JSON.stringify(before),
    `${before.length} messages before, ${after.length} after`);

  // ---- regenerate: the same messages again, the last reply replaced ----
  const lastReply = () => page.evaluate(() => {
    const m = [...document.querySelectorAll('.msg.assistant')].pop();
    return (m.querySelector('details .text')?.textContent ?? '') + '|' + m.querySelector('.content').textContent;
  });
  const old = await lastReply();
  const nSent = sent.length;
  await page.fill('#max_tokens', '24');
  check('regenerate only on the last reply', await page.locator('.msg.assistant .regenerate').count() === 1);
  await page.click('.msg.assistant .regenerate');
  await page.waitForFunction(() => {
    const m = document.querySelectorAll('.msg.assistant');
    return m.length === 4 && m[3].querySelector('.meta').textContent.length > 0;
  }, null, { timeout: 120000 });
  const regen = await lastReply();
  check('regenerate resends the same messages', sent.length === nSent + 1 &&
    JSON.stringify(sent[nSent].messages) === JSON.stringify(sent[nSent - 1].messages), `${sent.length - nSent} requests`);
  check('regenerate replaces the last reply', await page.locator('.msg').count() === 8 && regen !== old &&
    !regen.startsWith(old), `${old} -> ${regen}`);

  // ---- edit the first message: the conversation restarts from it ----
  await page.locator('.msg.user .edit').first().click();
  await page.fill('.msg.user textarea.edit', 'Edited question');
  await page.click('.msg.user .edit-send');
  await page.waitForFunction(() => {
    const m = document.querySelectorAll('.msg.assistant');
    return m.length === 1 && m[0].querySelector('.meta').textContent.length > 0;
  }, null, { timeout: 120000 });
  const edited = await snapshot();
  const last = sent[sent.length - 1].messages;
  check('edit resends from the edited message', edited.length === 2 && edited[0] === 'U:Edited question' &&
    JSON.stringify(last) === JSON.stringify([{ role: 'user', content: 'Edited question' }]), JSON.stringify(last));

  // ---- copy ----
  await page.context().grantPermissions(['clipboard-read', 'clipboard-write'], { origin: new URL(url).origin });
  await page.click('.msg.user .copy');
  check('copy puts the message on the clipboard',
    await page.evaluate(() => navigator.clipboard.readText()) === 'Edited question');
  await page.click('.msg.assistant .copy');
  const clip = await page.evaluate(() => navigator.clipboard.readText());
  check('copy puts the reply on the clipboard', clip === await page.textContent('.msg.assistant .content'), clip);

  // ---- new chat forgets, also across a reload ----
  await page.click('#reset');
  const cleared = await page.evaluate(() => document.querySelectorAll('#log .msg').length);
  await page.reload({ waitUntil: 'load' });
  await ready();
  check('new chat clears it, also after a reload', cleared === 0 &&
    await page.evaluate(() => document.querySelectorAll('#log .msg').length) === 0);

  // ---- replies as Markdown, sanitised (MARKDOWN=1: the build embedded
  // marked and DOMPurify; else the page must show the text as it is) ----
  const md = process.env.MARKDOWN === '1';
  const model = await page.textContent('#model');
  const reply = 'a **b** c\n\n<img src="x" onerror="window.__pwned = 1"><script>window.__pwned = 2</script>' +
    '<a href="#" onclick="window.__pwned = 3">link</a>';
  const mdStart = problems.length;
  await page.evaluate(([k, r]) => localStorage.setItem(k, JSON.stringify([{ user: 'md', thinking: false, reasoning: '',
    label: '', content: r, calls: [], meta: 'stored', state: 'ok' }])), ['k3-chat:' + model, reply]);
  await page.reload({ waitUntil: 'load' });
  await ready();
  if (md) await page.click('.msg.assistant .content a', { timeout: 5000 });
  await page.waitForTimeout(300); // an image's onerror would have run by now
  const r = await page.evaluate(() => {
    const c = document.querySelector('.msg.assistant .content');
    return { libs: typeof marked !== 'undefined' && typeof DOMPurify !== 'undefined',
      strong: c.querySelector('strong')?.textContent ?? null, text: c.textContent,
      imgs: document.querySelectorAll('#log img').length, scripts: c.querySelectorAll('script').length,
      handlers: [...c.querySelectorAll('*')].filter((e) => [...e.attributes].some((a) => a.name.startsWith('on'))).length,
      pwned: window.__pwned ?? null };
  });
  check(md ? 'markdown: libraries loaded' : 'plain text: no Markdown libraries in this build', r.libs === md);
  if (md) check('markdown: **b** renders as <strong>', r.strong === 'b', JSON.stringify(r));
  else check('plain text: **b** shown as typed', r.strong === null && r.text.includes('**b**'), JSON.stringify(r));
  check('injected <img onerror>, <script>, onclick: removed, never run',
    r.imgs === 0 && r.scripts === 0 && r.handlers === 0 && r.pwned === null, JSON.stringify(r));
  // Chromium reports the page's CSP (script-src 'self') refusing the injected
  // handlers as soon as they are parsed, even in the sanitiser's inert
  // document: expected here, and not the page's fault
  const csp = problems.splice(mdStart).filter((m) => !/inline event handler violates .*Content Security Policy/.test(m));
  problems.push(...csp);
  await page.click('#reset');

  const curl = process.env.COMPLETION_URL;
  if (curl) {
    await page.goto(curl, { waitUntil: 'load' });
    await page.waitForFunction(() => document.querySelector('#status').textContent === 'ready', null, { timeout: 30000 });
    check('completion model: thinking toggle disabled', await page.isDisabled('#thinking'));
    await page.fill('#max_tokens', '8');
    await page.fill('#input', 'Once upon a time');
    await page.click('#send');
    await page.waitForFunction(() => {
      const m = document.querySelector('.msg.assistant');
      return m && m.querySelector('.meta').textContent.length > 0;
    }, null, { timeout: 120000 });
    const c = await page.evaluate(() => {
      const m = document.querySelector('.msg.assistant');
      return { boxes: m.querySelectorAll('details').length, content: m.querySelector('.content').textContent,
        error: m.classList.contains('error') };
    });
    check('completion model: reply, no thinking box at all', !c.error && c.content.length > 0 && c.boxes === 0,
      JSON.stringify(c));
  }
  check('no console errors', problems.length === 0, problems.join(' | '));
});
