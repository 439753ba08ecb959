// app.js: the k3 dashboard page. Polls the server every 2 s and draws
// everything as hand-made SVG (no libraries, no network beyond this server).
'use strict';

const POLL_MS = 2000;
const SVGNS = 'http://www.w3.org/2000/svg';
const $ = (id) => document.getElementById(id);

const S = {
  runs: [], run: null,        // selected run name
  state: null,                // last /api/state
  recs: [],                   // metric records (train and eval), file order
  samples: [],                // sample records, newest last
  maxStep: -1,                // highest step among recs
  sampleIdx: -1,              // sample shown; -1 = follow the latest
  polls: 0, timer: null, lastOk: 0,
};

// ---- formatting ----

const isNum = (v) => typeof v === 'number' && isFinite(v);
function fmt(v, digits = 4) { return isNum(v) ? v.toFixed(digits) : '–'; }
function fmtSig(v, sig = 3) {
  if (!isNum(v)) return '–';
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(sig - 1);
  return String(+v.toPrecision(sig));
}
function fmtInt(v) { return isNum(v) ? Math.round(v).toLocaleString('en-US') : '–'; }
function fmtBytes(v) {
  if (!isNum(v)) return '–';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + ' ' + u[i];
}
function fmtDur(s) {
  if (!isNum(s) || s < 0) return '–';
  s = Math.round(s);
  if (s < 60) return s + ' s';
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${String(m).padStart(2, '0')}m`;
  return `${m}m ${String(s % 60).padStart(2, '0')}s`;
}
function fmtTick(v) {
  const a = Math.abs(v);
  if (v === 0) return '0';
  if (a >= 1e6) return (v / 1e6).toPrecision(3).replace(/\.?0+$/, '') + 'M';
  if (a >= 1e4) return (v / 1e3).toPrecision(3).replace(/\.?0+$/, '') + 'k';
  if (a < 1e-2) return v.toExponential(0);
  return String(+v.toPrecision(3));
}

// ---- data ----

async function getJSON(path) {
  const r = await fetch(path, { cache: 'no-store' });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}
const q = () => 'run=' + encodeURIComponent(S.run);

function resetRun(name) {
  S.run = name; S.state = null; S.recs = []; S.samples = []; S.maxStep = -1; S.sampleIdx = -1;
}

// Records come back as "every record with step > since". Asking from one step
// before the newest we hold, and replacing what we hold from there, picks up an
// eval record written after its step's train record without duplicating it.
function mergeRecords(since, got) {
  if (got.length === 0) return;
  S.recs = S.recs.filter((r) => r.step <= since).concat(got);
  for (const r of got) if (r.step > S.maxStep) S.maxStep = r.step;
}
function mergeSamples(since, got) {
  if (got.length === 0) return;
  S.samples = S.samples.filter((r) => r.step <= since).concat(got).slice(-50);
}

async function loadRuns() {
  const runs = await getJSON('/api/runs');
  S.runs = runs;
  const sel = $('run');
  const names = runs.map((r) => r.name);
  if (!S.run || !names.includes(S.run)) {
    const want = new URLSearchParams(location.search).get('run');
    resetRun(names.includes(want) ? want : (names[0] || null));
  }
  if (sel.options.length !== runs.length || [...sel.options].some((o, i) => o.value !== names[i])) {
    sel.textContent = '';
    for (const r of runs) {
      const o = document.createElement('option');
      o.value = r.name; o.textContent = r.name;
      sel.appendChild(o);
    }
  }
  for (const o of sel.options) {
    const r = runs.find((x) => x.name === o.value);
    o.textContent = r ? `${r.name} (${r.status}${isNum(r.step) ? ', step ' + r.step : ''})` : o.value;
  }
  sel.value = S.run;
  $('runpick').hidden = runs.length < 2;
}

async function poll() {
  clearTimeout(S.timer);
  try {
    if (S.polls % 5 === 0 || !S.run) await loadRuns();
    if (S.run) {
      const run = S.run;
      const st = await getJSON('/api/state?' + q());
      if (run !== S.run) return;
      // a resumed run rewrote its files and went back in steps: start over
      if (isNum(st.step) && st.step < S.maxStep) { S.recs = []; S.maxStep = -1; S.samples = []; }
      const since = Math.max(-1, S.maxStep - 1);
      let got = await getJSON(`/api/metrics?${q()}&since=${since}`);
      mergeRecords(since, got);
      const ss = S.samples.length ? Math.max(-1, S.samples[S.samples.length - 1].step - 1) : -1;
      got = await getJSON(`/api/samples?${q()}&since=${ss}&limit=20`);
      mergeSamples(ss, got);
      S.state = st;
    }
    S.lastOk = Date.now();
    S.polls++;
    render();
  } catch (e) {
    const c = $('conn');
    c.textContent = 'server unreachable: ' + (e && e.message ? e.message : e);
    c.classList.add('down');
  }
  S.timer = setTimeout(poll, POLL_MS);
}

// ---- SVG helpers ----

function el(name, attrs, parent) {
  const e = document.createElementNS(SVGNS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function text(parent, x, y, s, anchor = 'start', cls) {
  const t = el('text', { x, y, 'text-anchor': anchor }, parent);
  if (cls) t.setAttribute('class', cls);
  t.textContent = s;
  return t;
}

function niceStep(range, count) {
  const raw = range / Math.max(1, count);
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  const f = raw / p;
  return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
}
function linTicks(lo, hi, count) {
  if (!(hi > lo)) return [lo];
  const st = niceStep(hi - lo, count), out = [];
  for (let v = Math.ceil(lo / st) * st; v <= hi + st * 1e-9; v += st) out.push(+v.toPrecision(12));
  return out;
}
function logTicks(lo, hi) {
  const out = [], a = Math.floor(Math.log10(lo)), b = Math.ceil(Math.log10(hi));
  const mult = b - a <= 1 ? [1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9] : b - a <= 2 ? [1, 2, 3, 5] : [1];
  for (let e = a; e <= b; e++)
    for (const m of mult) { const v = m * Math.pow(10, e); if (v >= lo && v <= hi) out.push(+v.toPrecision(6)); }
  return out;
}

// Keeps a polyline drawable: at most ~2 points per pixel column, keeping each
// column's minimum and maximum so spikes stay visible.
function decimate(pts, columns) {
  if (pts.length <= columns * 2) return pts;
  const x0 = pts[0][0], x1 = pts[pts.length - 1][0], w = (x1 - x0) / columns || 1;
  const out = [];
  let b = -1, lo = null, hi = null;
  const flush = () => { if (lo) { if (lo[0] <= hi[0]) out.push(lo, hi); else out.push(hi, lo); } };
  for (const p of pts) {
    const k = Math.floor((p[0] - x0) / w);
    if (k !== b) { flush(); b = k; lo = hi = p; }
    else { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
  }
  flush();
  return out;
}

// A line chart. series: [{pts: [[x, y]...], cls, dots}] drawn in order.
function lineChart(svg, series, opt = {}) {
  const W = Math.max(200, svg.clientWidth || 600), H = Math.max(80, svg.clientHeight || 300);
  svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
  svg.textContent = '';
  const small = H < 200;
  const m = { l: small ? 46 : 56, r: 12, t: 10, b: small ? 20 : 26 };
  const all = series.flatMap((s) => s.pts).filter((p) => isNum(p[0]) && isNum(p[1]) && (!opt.log || p[1] > 0));
  if (all.length === 0) {
    text(svg, W / 2, H / 2, opt.empty || 'waiting for data', 'middle', 'empty');
    return;
  }
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const [x, y] of all) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  if (opt.xmax && opt.xmax > x1) x1 = opt.xmax;
  if (x1 === x0) { x1 = x0 + 1; }
  if (opt.zero && !opt.log && y0 > 0) y0 = 0;
  if (y1 === y0) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  else if (!opt.log) { const pad = (y1 - y0) * 0.05; y1 += pad; if (!(opt.zero && y0 === 0)) y0 -= pad; }
  else { y0 /= 1.05; y1 *= 1.05; }
  const pw = W - m.l - m.r, ph = H - m.t - m.b;
  const ly0 = opt.log ? Math.log10(y0) : 0, ly1 = opt.log ? Math.log10(y1) : 0;
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * pw;
  const Y = opt.log ? (y) => m.t + (1 - (Math.log10(y) - ly0) / (ly1 - ly0)) * ph
                    : (y) => m.t + (1 - (y - y0) / (y1 - y0)) * ph;
  const yt = opt.log ? logTicks(y0, y1) : linTicks(y0, y1, small ? 3 : 5);
  for (const v of yt) {
    const y = Y(v).toFixed(1);
    el('line', { x1: m.l, x2: W - m.r, y1: y, y2: y, class: 'grid' }, svg);
    text(svg, m.l - 6, +y + 4, opt.fmt ? opt.fmt(v) : fmtTick(v), 'end');
  }
  for (const v of linTicks(x0, x1, Math.max(2, Math.floor(pw / 90)))) {
    const x = X(v).toFixed(1);
    el('line', { x1: x, x2: x, y1: H - m.b, y2: H - m.b + 4, class: 'axis' }, svg);
    text(svg, x, H - m.b + (small ? 14 : 17), fmtTick(v), 'middle');
  }
  el('line', { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: 'axis' }, svg);
  el('line', { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: 'axis' }, svg);
  for (const s of series) {
    const pts = decimate(s.pts.filter((p) => isNum(p[0]) && isNum(p[1]) && (!opt.log || p[1] > 0)), pw);
    if (pts.length === 0) continue;
    const d = pts.map((p, i) => (i ? 'L' : 'M') + X(p[0]).toFixed(1) + ' ' + Y(p[1]).toFixed(1)).join('');
    el('path', { d, class: s.cls }, svg);
    if (s.dots && pts.length <= 400)
      for (const p of pts) el('circle', { cx: X(p[0]).toFixed(1), cy: Y(p[1]).toFixed(1), r: 2.5, class: s.dots }, svg);
  }
  svg._scale = { X, Y, x0, x1, m, W, H };
}

// ---- rendering ----

function ema(ys, s) {
  let last = 0, w = 0;
  return ys.map((y) => {
    if (!isNum(y)) return y;
    last = last * s + (1 - s) * y; w = w * s + (1 - s);
    return last / w;
  });
}

function trainRecs() { return S.recs.filter((r) => r.kind === 'train' || (r.kind === undefined && 'train_loss' in r)); }
function evalRecs() { return S.recs.filter((r) => r.kind === 'eval' || (r.kind === undefined && 'val_loss' in r)); }

function renderLoss() {
  const svg = $('loss-chart');
  const tr = trainRecs(), ev = evalRecs();
  const raw = tr.map((r) => [r.step, r.train_loss]);
  const smooth = +$('smooth').value;
  const sm = ema(raw.map((p) => p[1]), smooth);
  const series = [];
  if (smooth > 0) series.push({ pts: raw, cls: 'train-raw' });
  series.push({ pts: raw.map((p, i) => [p[0], sm[i]]), cls: 'train' });
  series.push({ pts: ev.map((r) => [r.step, r.val_loss]), cls: 'val', dots: 'val-dot' });
  lineChart(svg, series, { log: $('logscale').checked, empty: 'waiting for the first step' });
  svg.dataset.trainPoints = String(raw.length);
  svg.dataset.valPoints = String(ev.length);
  svg._data = { tr, ev, sm };
}

function hoverLoss(ev) {
  const svg = $('loss-chart'), sc = svg._scale, data = svg._data;
  const old = svg.querySelector('.hover');
  if (old) old.remove();
  if (!sc || !data || !ev) return;
  const r = svg.getBoundingClientRect();
  const px = ((ev.clientX - r.left) / r.width) * sc.W;
  if (px < sc.m.l || px > sc.W - sc.m.r) return;
  const step = sc.x0 + ((px - sc.m.l) / (sc.W - sc.m.l - sc.m.r)) * (sc.x1 - sc.x0);
  const near = (arr) => {
    let best = -1, bd = Infinity;
    arr.forEach((x, i) => { const d = Math.abs(x.step - step); if (d < bd) { bd = d; best = i; } });
    return best;
  };
  const i = near(data.tr), j = near(data.ev);
  if (i < 0) return;
  const t = data.tr[i];
  const lines = [`step ${t.step}`, `train ${fmt(t.train_loss)} (smoothed ${fmt(data.sm[i])})`];
  if (j >= 0 && Math.abs(data.ev[j].step - t.step) <= Math.max(1, (sc.x1 - sc.x0) / 100))
    lines.push(`val ${fmt(data.ev[j].val_loss)} @ ${data.ev[j].step}`);
  const g = el('g', { class: 'hover' }, svg);
  const x = sc.X(t.step);
  el('line', { x1: x, x2: x, y1: sc.m.t, y2: sc.H - sc.m.b }, g);
  const bw = 210, bh = 8 + 16 * lines.length;
  const bx = x + 10 + bw > sc.W ? x - 10 - bw : x + 10;
  el('rect', { x: bx, y: sc.m.t + 4, width: bw, height: bh, rx: 4 }, g);
  lines.forEach((s, k) => text(g, bx + 8, sc.m.t + 20 + 16 * k, s));
}

function renderMinis() {
  const tr = trainRecs();
  const mk = (id, pts, fmtFn) => lineChart($(id), [{ pts, cls: 'mini' }], { fmt: fmtFn, zero: true, empty: 'no data yet' });
  mk('c-lr', tr.map((r) => [r.step, r.lr]), (v) => fmtSig(v, 2));
  mk('c-tps', tr.map((r) => [r.step, r.tokens_per_s]), fmtTick);
  mk('c-gn', tr.map((r) => [r.step, r.grad_norm]), fmtTick);
  // memory in one binary unit for the whole axis, named in the title
  const maxRss = Math.max(0, ...tr.map((r) => (isNum(r.peak_rss_bytes) ? r.peak_rss_bytes : 0)));
  const [unit, div] = maxRss >= 8 * 2 ** 30 ? ['GiB', 2 ** 30] : ['MiB', 2 ** 20];
  setText('h-rss', `peak RSS (${unit})`);
  mk('c-rss', tr.map((r) => [r.step, isNum(r.peak_rss_bytes) ? r.peak_rss_bytes / div : null]), fmtTick);
}

// White at the mean, red above (x4 saturates), blue below, black when dead.
function heatColor(ratio) {
  if (!isNum(ratio)) return '#888';
  if (ratio <= 0) return '#111';
  const t = Math.max(-1, Math.min(1, Math.log2(ratio) / 2));
  const mix = (a, b, f) => Math.round(a + (b - a) * f);
  return t >= 0 ? `rgb(255,${mix(255, 40, t)},${mix(255, 30, t)})` : `rgb(${mix(255, 30, -t)},${mix(255, 100, -t)},255)`;
}

function renderHeat() {
  const box = $('heat');
  const st = S.state || {};
  const latest = st.latest || null;
  const layers = latest && Array.isArray(latest.expert_load) ? latest.expert_load : null;
  $('heat-step').textContent = layers ? `step ${latest.step}` : '';
  if (!layers || layers.length === 0) {
    box.innerHTML = '<p class="muted">no expert-load data yet</p>';
    return;
  }
  const nexp = Math.max(0, ...layers.map((l) => (Array.isArray(l.loads) ? l.loads.length : 0)));
  const avail = Math.max(220, box.clientWidth || 600);
  const labelW = 34, colW = 72, right = 2 * colW + 6;
  const cell = nexp ? Math.max(5, Math.min(22, Math.floor((avail - labelW - right) / nexp))) : 0;
  const rowH = Math.max(10, Math.min(18, cell || 16));
  const W = labelW + nexp * cell + right, H = 18 + layers.length * rowH + 4;
  const svg = el('svg', { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'expert load per layer' });
  text(svg, 0, 12, 'layer');
  if (nexp) text(svg, labelW, 12, `${nexp} experts`);
  const cx = labelW + nexp * cell + 6;
  text(svg, cx + colW - 4, 12, 'dead', 'end');
  text(svg, cx + 2 * colW - 4, 12, 'max/mean', 'end');
  layers.forEach((l, row) => {
    const y = 18 + row * rowH;
    text(svg, 0, y + rowH - 4, 'L' + l.layer);
    const loads = Array.isArray(l.loads) ? l.loads : [];
    const mean = loads.length ? loads.reduce((a, b) => a + (isNum(b) ? b : 0), 0) / loads.length : 0;
    loads.forEach((v, k) => {
      const ratio = mean > 0 && isNum(v) ? v / mean : NaN;
      const r = el('rect', { x: labelW + k * cell, y, width: Math.max(1, cell - 1), height: rowH - 1, fill: heatColor(ratio) }, svg);
      el('title', {}, r).textContent = `layer ${l.layer}, expert ${k}: ${isNum(v) ? (100 * v).toFixed(2) : '?'}% of tokens (${isNum(ratio) ? ratio.toFixed(2) : '?'}x mean)`;
    });
    const dead = isNum(l.dead_frac) ? (100 * l.dead_frac).toFixed(1) + '%' : '–';
    text(svg, cx + colW - 4, y + rowH - 4, dead, 'end', 'num' + (l.dead_frac > 0 ? ' warn' : ''));
    text(svg, cx + 2 * colW - 4, y + rowH - 4, isNum(l.max_over_mean) ? l.max_over_mean.toFixed(2) : '–', 'end',
      'num' + (l.max_over_mean > 4 ? ' warn' : ''));
  });
  box.textContent = '';
  box.appendChild(svg);
}

function renderSample() {
  const pick = $('sample-pick');
  const n = S.samples.length;
  if (n === 0) {
    $('sample').innerHTML = '<span class="muted">no sample yet</span>';
    $('sample-step').textContent = '';
    pick.hidden = true;
    return;
  }
  const idx = S.sampleIdx >= 0 && S.sampleIdx < n ? S.sampleIdx : n - 1;
  const s = S.samples[idx];
  const pre = $('sample');
  if (pre.dataset.key !== `${s.step}:${s.time}:${idx}`) {
    pre.textContent = typeof s.text === 'string' ? s.text : '';
    pre.dataset.key = `${s.step}:${s.time}:${idx}`;
    pre.dataset.step = String(s.step);
  }
  $('sample-step').textContent = `step ${s.step}` + (idx === n - 1 ? '' : ' (older)');
  if (pick.options.length !== n || pick.options[n - 1].value !== String(n - 1) || pick.dataset.last !== String(S.samples[n - 1].step)) {
    pick.textContent = '';
    S.samples.forEach((x, i) => {
      const o = document.createElement('option');
      o.value = String(i);
      o.textContent = `step ${x.step}` + (i === n - 1 ? ' (latest)' : '');
      pick.appendChild(o);
    });
    pick.dataset.last = String(S.samples[n - 1].step);
  }
  pick.value = String(idx);
  pick.hidden = n < 2;
}

function setText(id, s) { const e = $(id); if (e.textContent !== s) e.textContent = s; }

function renderHeader() {
  const st = S.state || {};
  const dash = st.dashboard || {};
  const status = dash.status || st.status || 'unknown';
  const badge = $('status');
  badge.dataset.status = status;
  setText('status', status);
  setText('runname', S.run || '');
  setText('footer-run', S.run ? `run ${S.run}` : '');
  const c = $('conn');
  c.classList.remove('down');
  c.textContent = 'live · ' + new Date(S.lastOk).toLocaleTimeString();

  const step = isNum(st.step) ? st.step : (S.maxStep >= 0 ? S.maxStep : null);
  const stepEl = $('step');
  setText('step', step === null ? '–' : fmtInt(step));
  stepEl.dataset.step = step === null ? '' : String(step);
  setText('total', isNum(st.total_steps) ? fmtInt(st.total_steps) : '–');
  const frac = isNum(step) && isNum(st.total_steps) && st.total_steps > 0 ? Math.min(1, step / st.total_steps) : 0;
  setText('pct', frac ? `(${(100 * frac).toFixed(1)}%)` : '');
  $('bar-fill').style.width = (100 * frac).toFixed(2) + '%';
  setText('eta', status === 'running' ? fmtDur(dash.eta_s) : status === 'finished' ? 'done' : '–');
  const now = isNum(dash.server_time) ? dash.server_time : Date.now() / 1000;
  setText('elapsed', isNum(st.started_at) ? fmtDur((['running', 'stale'].includes(status) ? now : (st.updated_at || now)) - st.started_at) : '–');
  // a trainer that rounds its times can look up to a few seconds ahead of us
  setText('age', isNum(dash.age_s) ? fmtDur(Math.max(0, dash.age_s)) + ' ago' : '–');
  document.title = `${step === null ? '' : step + '/' + (st.total_steps || '?') + ' · '}${S.run || ''} · k3 dashboard`;

  const notes = [];
  let bad = false;
  if (status === 'stale') notes.push(`Stale: ${dash.stale_reason || 'no recent update'}. The trainer may have been killed; resume from latest.safetensors.`);
  if (status === 'failed') { bad = true; notes.push('Failed: ' + (st.error || 'see the trainer output')); }
  if (status === 'waiting') notes.push('Waiting for the trainer to write state.json in this run directory.');
  if (dash.error) { bad = true; notes.push(dash.error); }
  if (dash.metrics_bad_lines) notes.push(`${dash.metrics_bad_lines} malformed line(s) in metrics.jsonl skipped`);
  const n = $('notice');
  n.hidden = notes.length === 0;
  n.classList.toggle('bad', bad);
  setText('notice', notes.join(' · '));
}

function renderStats() {
  const st = S.state || {};
  const tr = trainRecs(), ev = evalRecs();
  const lt = st.latest || tr[tr.length - 1] || {};
  const le = st.latest_eval || ev[ev.length - 1] || {};
  setText('s-train', fmt(lt.train_loss));
  const sm = ema(tr.map((r) => r.train_loss), +$('smooth').value);
  setText('s-train-sub', isNum(lt.step) ? `step ${lt.step}` + (tr.length > 1 && isNum(sm[sm.length - 1]) ? ` · smoothed ${fmt(sm[sm.length - 1])}` : '') : '');
  setText('s-val', fmt(le.val_loss));
  const best = isNum(st.best_val_loss) ? `best ${fmt(st.best_val_loss)}${isNum(st.best_step) ? ' @ ' + st.best_step : ''}` : '';
  setText('s-val-sub', [isNum(le.val_bpb) ? `${fmt(le.val_bpb, 3)} bpb` : '', isNum(le.step) ? `step ${le.step}` : '', best].filter(Boolean).join(' · '));
  setText('s-lr', fmtSig(lt.lr, 3));
  setText('s-lr-sub', isNum(lt.lr_muon) ? `muon ${fmtSig(lt.lr_muon, 3)}` : '');
  setText('s-tps', isNum(lt.tokens_per_s) ? fmtInt(lt.tokens_per_s) : '–');
  setText('s-tps-sub', isNum(lt.tokens) ? `${fmtInt(lt.tokens)} tokens seen` : '');
  setText('s-rss', fmtBytes(lt.peak_rss_bytes));
  setText('s-rss-sub', isNum(lt.step_time_s) ? `${lt.step_time_s.toFixed(2)} s/step` : '');
  setText('s-gn', fmtSig(lt.grad_norm, 3));
  setText('s-gn-sub', isNum(st.params) ? `${fmtInt(st.params)} params` : '');
}

function render() {
  renderHeader();
  renderStats();
  renderLoss();
  renderMinis();
  renderHeat();
  renderSample();
}

// ---- wiring ----

document.addEventListener('DOMContentLoaded', () => {
  const params = new URLSearchParams(location.search);
  if (params.get('log') === '1') $('logscale').checked = true;
  if (params.has('smooth')) $('smooth').value = params.get('smooth');
  $('smooth-val').textContent = (+$('smooth').value).toFixed(2);
  $('logscale').addEventListener('change', () => { renderLoss(); });
  $('smooth').addEventListener('input', () => {
    $('smooth-val').textContent = (+$('smooth').value).toFixed(2);
    renderLoss(); renderStats();
  });
  $('run').addEventListener('change', (e) => {
    resetRun(e.target.value);
    const u = new URL(location.href);
    u.searchParams.set('run', S.run);
    history.replaceState(null, '', u);
    poll();
  });
  $('sample-pick').addEventListener('change', (e) => {
    const i = +e.target.value;
    S.sampleIdx = i === S.samples.length - 1 ? -1 : i;
    renderSample();
  });
  const chart = $('loss-chart');
  chart.addEventListener('pointermove', hoverLoss);
  chart.addEventListener('pointerleave', () => hoverLoss(null));
  let rt = null;
  window.addEventListener('resize', () => { clearTimeout(rt); rt = setTimeout(() => { if (S.state) render(); }, 150); });
  poll();
});
