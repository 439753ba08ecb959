// page.mjs: what the browser tests share (dashboard.test.mjs, serve_page.test.mjs):
// headless Chromium (Debian's /usr/bin/chromium, or $CHROMIUM, through
// playwright-core) on a fresh throw-away profile, with a page that records
// console errors and warnings and uncaught exceptions in `problems`.
import { chromium } from 'playwright-core';
import { check, finish } from './check.mjs';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

export { check };
export const out = process.env.E2E_OUT || 'tests/out';

// Runs body(page, problems) in the browser; an exception is a failed check.
// Then closes the browser, removes the profile and finishes (check.mjs).
export async function runPage({ viewport }, body) {
  fs.mkdirSync(out, { recursive: true });
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'k3-e2e-chromium-'));
  let ctx;
  try {
    // A persistent context on a fresh profile: the equivalent of
    // --user-data-dir, which playwright manages itself.
    ctx = await chromium.launchPersistentContext(profile, {
      executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
      headless: true,
      viewport,
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
        '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    });
    const page = ctx.pages()[0] || await ctx.newPage();
    const problems = [];
    page.on('console', (m) => { if (m.type() === 'error' || m.type() === 'warning') problems.push(`${m.type()}: ${m.text()}`); });
    page.on('pageerror', (e) => problems.push(`pageerror: ${e.message}`));
    await body(page, problems);
  } catch (e) {
    check('e2e run', false, e && e.stack ? e.stack.split('\n').slice(0, 3).join(' ') : String(e));
  } finally {
    if (ctx) await ctx.close().catch(() => {});
    fs.rmSync(profile, { recursive: true, force: true });
  }
  finish();
}
