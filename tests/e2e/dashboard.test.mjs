// dashboard.test.mjs: drives the k3 dashboard page in headless Chromium
// (Debian's /usr/bin/chromium through playwright-core) while a trainer writes
// the run directory. Started by tests/cli/test_dashboard_e2e.sh, which sets:
//   DASH_URL     the page, e.g. http://127.0.0.1:PORT/
//   E2E_OUT      where screenshots go
//   E2E_SAMPLE   text the latest sample must contain ("" = any non-empty text)
// Prints PASS/FAIL lines and "N passed, N failed".
import { check, out, runPage } from './page.mjs';
import fs from 'node:fs';
import path from 'node:path';

const url = process.env.DASH_URL;
const wantSample = process.env.E2E_SAMPLE || '';

await runPage({ viewport: { width: 1280, height: 900 } }, async (page, problems) => {
  page.on('requestfailed', (r) => problems.push(`request failed: ${r.url()} ${r.failure()?.errorText}`));
  const foreign = [];
  page.on('request', (r) => { if (!r.url().startsWith(new URL(url).origin)) foreign.push(r.url()); });

  const resp = await page.goto(url, { waitUntil: 'load' });
  check('page loads', resp && resp.status() === 200, resp ? `HTTP ${resp.status()}` : 'no response');

  const read = () => page.evaluate(() => ({
    step: Number(document.querySelector('#step').dataset.step || -1),
    points: Number(document.querySelector('#loss-chart').dataset.trainPoints || 0),
    pathPoints: (document.querySelector('#loss-chart path.train')?.getAttribute('d') || '').split(/[ML]/).length - 1,
    status: document.querySelector('#status').textContent,
  }));
  await page.waitForFunction(() => Number(document.querySelector('#loss-chart').dataset.trainPoints) > 0 &&
    document.querySelector('#step').dataset.step !== '', null, { timeout: 60000 });
  const a = await read();
  console.log(`first poll: step ${a.step}, ${a.points} train points, status ${a.status}`);
  check('status shows running', a.status === 'running', a.status);
  // the page polls every 2 s; wait for a later poll that brought new steps
  await page.waitForFunction(([s, p]) => Number(document.querySelector('#step').dataset.step) > s &&
    Number(document.querySelector('#loss-chart').dataset.trainPoints) > p, [a.step, a.points], { timeout: 60000 })
    .catch(() => {});
  const b = await read();
  console.log(`later poll: step ${b.step}, ${b.points} train points`);
  check('step number increases between polls', b.step > a.step, `${a.step} -> ${b.step}`);
  check('loss curve point count increases between polls', b.points > a.points, `${a.points} -> ${b.points}`);
  check('loss curve is drawn', b.pathPoints >= 2, `${b.pathPoints} path points`);

  await page.waitForFunction(() => {
    const t = document.querySelector('#sample').textContent || '';
    return t.length > 0 && !t.includes('no sample yet');
  }, null, { timeout: 90000 }).catch(() => {});
  const sample = await page.evaluate(() => ({
    text: document.querySelector('#sample').textContent, step: document.querySelector('#sample-step').textContent,
  }));
  check('sample text appears', sample.text.length > 0 && !sample.text.includes('no sample yet') &&
    sample.text.includes(wantSample), JSON.stringify(sample.text.slice(0, 120)));
  check('sample shows its step', /^step \d+/.test(sample.step), sample.step);

  // stats, mini charts and the expert heat map are filled in
  const filled = await page.evaluate(() => ({
    train: document.querySelector('#s-train').textContent,
    tps: document.querySelector('#s-tps').textContent,
    rss: document.querySelector('#s-rss').textContent,
    minis: [...document.querySelectorAll('.mini svg path.mini')].length,
    heat: document.querySelectorAll('#heat svg rect').length,
    eta: document.querySelector('#eta').textContent,
  }));
  check('stat cards filled', filled.train !== '–' && filled.tps !== '–' && filled.rss !== '–', JSON.stringify(filled));
  check('lr / tokens/s / grad norm / RSS charts drawn', filled.minis === 4, `${filled.minis} of 4`);
  if (process.env.E2E_EXPECT_HEAT !== '0') check('expert-load heat map drawn', filled.heat > 0, `${filled.heat} cells`);
  check('ETA shown while running', filled.eta !== '–', filled.eta);

  // log scale and smoothing controls redraw without errors
  await page.check('#logscale');
  await page.fill('#smooth', '0.9').catch(() => {});
  await page.evaluate(() => document.querySelector('#smooth').dispatchEvent(new Event('input')));
  const logOk = await page.evaluate(() => (document.querySelector('#loss-chart path.train')?.getAttribute('d') || '').length > 0);
  check('log scale redraws the curve', logOk);
  await page.uncheck('#logscale');

  await page.waitForTimeout(2500); // one more poll, so the shot shows the latest state
  const shot = path.join(out, 'dashboard.png');
  await page.screenshot({ path: shot, fullPage: true });
  check('screenshot saved', fs.existsSync(shot) && fs.statSync(shot).size > 10000, shot);

  // phone width: no horizontal scrolling of the page
  await page.setViewportSize({ width: 390, height: 844 });
  await page.waitForTimeout(2500);
  const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  check('fits a phone width (390 px)', overflow <= 1, `${overflow} px too wide`);
  await page.screenshot({ path: path.join(out, 'dashboard-phone.png'), fullPage: true });

  check('no console errors, CSP violations or failed requests', problems.length === 0, problems.slice(0, 5).join(' | '));
  check('no request leaves the dashboard server', foreign.length === 0, foreign.slice(0, 3).join(' '));
});
