// serve_page.test.mjs: the chat page of `k3 serve` in headless Chromium
// (Debian's /usr/bin/chromium through playwright-core). Started by
// tests/cli/test_serve_e2e.sh, which sets SERVE_URL (a k3 serve on a model
// with the Kimi vocabulary), E2E_OUT (screenshots) and CHROMIUM.
// Type a message, send it, watch the reply stream in with its reasoning
// folded apart in a <details>; turn thinking off and see no reasoning.
// Prints PASS/FAIL lines and "N passed, N failed".
import { check, out, runPage } from './page.mjs';
import path from 'node:path';

const url = process.env.SERVE_URL;

await runPage({ viewport: { width: 1100, height: 900 } }, async (page, problems) => {
  const streams = [];
  page.on('response', (r) => { if (r.url().endsWith('/v1/chat/completions')) streams.push(r.headers()['content-type'] || ''); });

  const resp = await page.goto(url, { waitUntil: 'load' });
  check('page loads', resp && resp.status() === 200, resp ? `HTTP ${resp.status()}` : 'no response');
  await page.waitForFunction(() => document.querySelector('#model').textContent.length > 0, null, { timeout: 30000 });
  check('model name shown', (await page.textContent('#model')).length > 0);
  check('thinking toggle on by default', await page.isChecked('#thinking'));

  // count every change of the reasoning and content text while it streams
  await page.evaluate(() => {
    window.__updates = 0;
    new MutationObserver(() => { window.__updates++; })
      .observe(document.querySelector('#log'), { subtree: true, characterData: true, childList: true });
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
      error: m.classList.contains('error'), user: document.querySelector('.msg.user').textContent,
      updates: window.__updates };
  });
  check('user message shown', first.user === 'Hello! Who are you?', first.user);
  check('reply without error', !first.error, first.meta);
  check('reasoning shown apart, in a <details>', !first.hidden && first.reasoning.length > 0 && first.summary === 'reasoning',
    JSON.stringify(first).slice(0, 300));
  check('reasoning folded', !first.open);
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
  check('no console errors', problems.length === 0, problems.join(' | '));
});
