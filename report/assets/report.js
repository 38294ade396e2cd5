// troupe report: draws the runs described by the JSON in #troupe-data (written by report/page.cpp)
// as SVG. No network, no libraries. Layout of the data: see report/page.hpp.
//
// Every plotted series is one <path class="series" data-points="N"> whose d attribute holds N
// points, so a test can count what was drawn from the DOM alone. #app gets data-state="ready"
// once everything is drawn.
'use strict';
(function () {
  const DATA = JSON.parse(document.getElementById('troupe-data').textContent);
  const RUNS = DATA.runs;
  const COLORS = ['#1f6feb', '#d1242f', '#1a7f37', '#8250df', '#bf8700', '#0a7ea4', '#e16f24',
                  '#57606a'];
  // The same colours as the schedule SVGs of `troupe schedule show --svg`.
  const KIND_COLORS = { F: '#4c78a8', B: '#54a24b', I: '#f58518', W: '#b279a2',
                        REDUCE_GRAD: '#e45756', STEP: '#333333', comm: '#9ecae9',
                        wait: '#e4e7ec', other: '#bab0ac' };
  const SVGNS = 'http://www.w3.org/2000/svg';
  const W = 600, H = 250, M = { l: 64, r: 14, t: 10, b: 34 };
  // The x axis to start with: #x=step|tokens|time in the page's address, else step.
  const state = { x: (/[#&]x=(step|tokens|time)/.exec(location.hash) || [])[1] || 'step' };
  const timeCharts = [];  // redrawn when the x axis changes
  const app = document.getElementById('app');
  const tip = el('div', { class: 'tip' }, document.body);

  RUNS.forEach((run, k) => { run.color = COLORS[k % COLORS.length]; });

  // ---- small helpers --------------------------------------------------------------------------
  function el(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function sv(tag, attrs, parent, text) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function title(node, text) { sv('title', {}, node, text); }

  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return '–';
    const a = Math.abs(v);
    if (a === 0) return '0';
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
    if (Number.isInteger(v)) return String(v);
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(2);
    return v.toPrecision(4);
  }
  function fmtSI(v) {
    const a = Math.abs(v);
    if (a >= 1e12) return (v / 1e12).toPrecision(3) + 'T';
    if (a >= 1e9) return (v / 1e9).toPrecision(3) + 'G';
    if (a >= 1e6) return (v / 1e6).toPrecision(3) + 'M';
    if (a >= 1e3) return (v / 1e3).toPrecision(3) + 'k';
    return fmt(v);
  }
  function fmtTime(s) {
    if (!isFinite(s)) return '–';
    if (s === 0) return '0';
    if (s < 60) return s.toFixed(s < 10 ? 2 : 1) + ' s';
    const t = Math.round(s), h = Math.floor(t / 3600), m = Math.floor(t / 60) % 60, r = t % 60;
    const pad = (n) => String(n).padStart(2, '0');
    return h > 0 ? h + ':' + pad(m) + ':' + pad(r) : m + ':' + pad(r);
  }
  function fmtBytes(b) {
    const n = (x) => String(parseFloat(x.toFixed(2)));
    if (b >= 1024 ** 3) return n(b / 1024 ** 3) + ' GiB';
    if (b >= 1024 ** 2) return n(b / 1024 ** 2) + ' MiB';
    if (b >= 1024) return n(b / 1024) + ' KiB';
    return b + ' B';
  }
  function fmtPct(f) { return isFinite(f) ? (100 * f).toFixed(1) + '%' : '–'; }

  function niceStep(span, n) {
    const raw = span / Math.max(1, n), p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * p;
  }
  function ticks(lo, hi, n, minStep) {
    if (!(hi > lo)) return [lo];
    const step = Math.max(niceStep(hi - lo, n), minStep || 0), out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
      out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function timeTicks(lo, hi, n) {
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600,
                   43200, 86400];
    const want = (hi - lo) / Math.max(1, n);
    const step = steps.find((s) => s >= want);
    if (!step || hi - lo < 5) return ticks(lo, hi, n);
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) out.push(v);
    return out;
  }
  // Labels for evenly spaced ticks: as many decimals as the spacing needs.
  function tickLabel(v, all) {
    if (v === 0) return '0';
    const big = Math.max(...all.map(Math.abs));
    if (big >= 1e5 || big < 1e-3) return v.toExponential(1).replace('.0e', 'e');
    const step = all.length > 1 ? Math.abs(all[1] - all[0]) : Math.abs(v);
    return v.toFixed(Math.min(6, Math.max(0, -Math.floor(Math.log10(step) + 1e-9))));
  }
  // Index of the element of the sorted array `xs` nearest to `x`.
  function nearest(xs, x) {
    let lo = 0, hi = xs.length - 1;
    while (hi - lo > 1) {
      const mid = (lo + hi) >> 1;
      if (xs[mid] < x) lo = mid; else hi = mid;
    }
    return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
  }

  // ---- x axis ---------------------------------------------------------------------------------
  const X_MODES = {
    step: { label: 'step', format: (v) => 'step ' + Math.round(v), tick: fmtSI,
            ticks: (lo, hi, n) => ticks(lo, hi, n, 1) },
    tokens: { label: 'tokens', format: (v) => fmtSI(v) + ' tokens', tick: fmtSI, ticks: ticks },
    time: { label: 'wall time (training time, restarts joined)', format: fmtTime, tick: fmtTime,
            ticks: timeTicks },
  };
  // x of row r of `run` (rows are metrics.jsonl lines); steps count from 1 (steps done).
  function xOfRow(run, r) {
    if (state.x === 'time') return run.x.time[r];
    if (state.x === 'tokens') return run.x.step[r] * run.tokens_per_step;
    return run.x.step[r];
  }
  // x of "after `step` steps", for marks; null when the run never logged that step.
  function xOfStep(run, step) {
    if (state.x === 'step') return step;
    if (state.x === 'tokens') return run.tokens_per_step ? step * run.tokens_per_step : null;
    const steps = run.x.step;
    if (!steps.length) return null;
    const r = nearest(steps, step);
    return steps[r] === step ? run.x.time[r] : null;
  }
  function modeAvailable(mode) {
    return mode !== 'tokens' || RUNS.every((r) => r.tokens_per_step > 0);
  }

  // ---- time-series charts ---------------------------------------------------------------------
  // spec: {key, title, y, logY, series(run) -> [{label, data: {i, v}, dash, dots}], caption,
  //        references(run) -> [{label, value}] drawn as dashed horizontal lines, skipped: bool}
  function timeChart(parent, spec) {
    const card = el('div', { class: 'card', 'data-chart': spec.key }, parent);
    el('h2', {}, card, spec.title);
    const holder = el('div', {}, card);
    const legend = el('div', { class: 'legend' }, card);
    const caption = spec.caption ? el('div', { class: 'caption' }, card, spec.caption) : null;
    const chart = { spec, holder, legend, card, caption };
    timeCharts.push(chart);
    drawTimeChart(chart);
    return chart;
  }

  function drawTimeChart(chart) {
    const spec = chart.spec;
    chart.holder.textContent = '';
    chart.legend.textContent = '';
    const lines = [];
    RUNS.forEach((run, k) => {
      for (const s of spec.series(run)) {
        if (!s.data || !s.data.i.length) continue;
        if (state.x === 'tokens' && !run.tokens_per_step) continue;
        const xs = s.data.i.map((r) => xOfRow(run, r));
        const ys = s.data.v;
        lines.push({ run, k, label: s.label, xs, ys, dash: s.dash, dots: s.dots });
      }
    });
    const refs = [];
    RUNS.forEach((run, k) => {
      for (const r of spec.references ? spec.references(run) : [])
        if (isFinite(r.value)) refs.push({ run, k, label: r.label, value: r.value });
    });
    if (chart.caption) chart.caption.hidden = !lines.length;
    if (!lines.length) {
      el('div', { class: 'empty' }, chart.holder, spec.empty || 'nothing recorded');
      return;
    }
    const ty = spec.logY ? (v) => Math.log2(v) : (v) => v;
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const l of lines) {
      x0 = Math.min(x0, l.xs[0]); x1 = Math.max(x1, l.xs[l.xs.length - 1]);
      for (const v of l.ys) if (isFinite(v) && (!spec.logY || v > 0)) {
        y0 = Math.min(y0, ty(v)); y1 = Math.max(y1, ty(v));
      }
    }
    for (const r of refs) { y0 = Math.min(y0, ty(r.value)); y1 = Math.max(y1, ty(r.value)); }
    if (spec.zeroBased) y0 = Math.min(0, y0);
    if (x1 <= x0) { x0 -= 0.5; x1 += 0.5; }
    if (y1 <= y0) { const d = Math.abs(y0) * 0.1 || 0.5; y0 -= d; y1 += d; }
    const pad = (y1 - y0) * 0.05;
    if (!(spec.zeroBased && y0 === 0)) y0 -= pad;
    y1 += pad;
    const px = (x) => M.l + (x - x0) / (x1 - x0) * (W - M.l - M.r);
    const py = (v) => H - M.b - (ty(v) - y0) / (y1 - y0) * (H - M.t - M.b);

    const svg = sv('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'data-x': state.x },
                   chart.holder);
    const grid = sv('g', { class: 'axis' }, svg);
    const mode = X_MODES[state.x];
    for (const t of mode.ticks(x0, x1, 6)) {
      const x = px(t);
      sv('line', { class: 'gridline', x1: x, x2: x, y1: M.t, y2: H - M.b }, grid);
      sv('text', { x, y: H - M.b + 14, 'text-anchor': 'middle' }, grid, mode.tick(t));
    }
    const yt = spec.logY ? ticks(Math.ceil(y0), Math.floor(y1), 5, 1).filter(Number.isInteger)
                         : ticks(y0, y1, 5);
    for (const t of yt) {
      const v = spec.logY ? Math.pow(2, t) : t, y = py(v);
      sv('line', { class: 'gridline', x1: M.l, x2: W - M.r, y1: y, y2: y }, grid);
      sv('text', { x: M.l - 6, y: y + 4, 'text-anchor': 'end' }, grid,
         spec.logY ? '2^' + t : spec.yTick ? spec.yTick(v) : tickLabel(v, yt));
    }
    sv('line', { x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b }, grid);
    sv('line', { x1: M.l, x2: M.l, y1: M.t, y2: H - M.b }, grid);
    sv('text', { x: (M.l + W - M.r) / 2, y: H - 4, 'text-anchor': 'middle' }, grid, mode.label);
    sv('text', { x: 12, y: (M.t + H - M.b) / 2, 'text-anchor': 'middle',
                 transform: `rotate(-90 12 ${(M.t + H - M.b) / 2})` }, grid, spec.y);

    // Marks: checkpoints, restarts, faults (and skipped steps where the chart asks for them).
    const marks = sv('g', { class: 'marks' }, svg);
    RUNS.forEach((run, k) => {
      for (const m of run.marks) {
        if (m.kind === 'skipped' && !spec.skipped) continue;
        const xv = xOfStep(run, m.step);
        if (xv === null || xv < x0 || xv > x1) continue;
        const x = px(xv);
        const y1m = m.kind === 'skipped' ? H - M.b - 8 : M.t;
        const line = sv('line', { class: 'mark mark-' + m.kind, 'data-kind': m.kind, 'data-run': k,
                                  'data-chart': spec.key, x1: x, x2: x, y1: y1m, y2: H - M.b },
                        marks);
        title(line, run.name + ': ' + m.label);
      }
    });
    for (const r of refs) {
      const y = py(r.value);
      const line = sv('line', { class: 'prediction', x1: M.l, x2: W - M.r, y1: y, y2: y,
                                stroke: r.run.color, 'stroke-dasharray': '6 4',
                                'stroke-width': 1.2, opacity: 0.8 }, svg);
      title(line, r.run.name + ': ' + r.label + ' ' + (spec.yFormat || fmt)(r.value));
    }
    for (const l of lines) {
      let d = '', n = 0;
      for (let j = 0; j < l.xs.length; ++j) {
        const v = l.ys[j];
        if (!isFinite(v) || (spec.logY && v <= 0)) continue;
        d += (n ? 'L' : 'M') + px(l.xs[j]).toFixed(1) + ' ' + py(v).toFixed(1);
        ++n;
      }
      const path = sv('path', { class: 'series', d, fill: 'none', stroke: l.run.color,
                                'stroke-width': 1.4, 'data-chart': spec.key, 'data-run': l.k,
                                'data-series': l.label, 'data-points': n }, svg);
      if (l.dash) path.setAttribute('stroke-dasharray', l.dash);
      if (l.dots && l.xs.length <= 400)
        for (let j = 0; j < l.xs.length; ++j)
          if (isFinite(l.ys[j]))
            sv('circle', { cx: px(l.xs[j]), cy: py(l.ys[j]), r: 2.4, fill: l.run.color }, svg);
    }
    const shown = new Set();
    for (const l of lines) {
      const key = (RUNS.length > 1 ? l.run.name + ' · ' : '') + l.label;
      if (shown.has(key)) continue;
      shown.add(key);
      const item = el('span', { class: 'run-key' }, chart.legend);
      const sw = el('span', { class: 'swatch' }, item);
      sw.style.background = l.dash ? `repeating-linear-gradient(90deg, ${l.run.color} 0 5px, transparent 5px 8px)` : l.run.color;
      item.appendChild(document.createTextNode(key));
    }
    for (const r of refs) {
      const item = el('span', { class: 'run-key' }, chart.legend);
      el('span', { class: 'swatch' }, item).style.background =
        `repeating-linear-gradient(90deg, ${r.run.color} 0 6px, transparent 6px 10px)`;
      item.appendChild(document.createTextNode(
        (RUNS.length > 1 ? r.run.name + ' · ' : '') + r.label + ' ' + (spec.yFormat || fmt)(r.value)));
    }

    // Hover: the nearest point of every series to the pointer's x.
    const hover = sv('g', { class: 'hover', visibility: 'hidden' }, svg);
    const vline = sv('line', { class: 'hover-line', y1: M.t, y2: H - M.b }, hover);
    const dots = lines.map((l) => sv('circle', { r: 3.2, fill: 'white', stroke: l.run.color,
                                                   'stroke-width': 1.6 }, hover));
    const catcher = sv('rect', { x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b,
                                 fill: 'transparent' }, svg);
    catcher.addEventListener('mousemove', (ev) => {
      const pt = svg.createSVGPoint();
      pt.x = ev.clientX; pt.y = ev.clientY;
      const p = pt.matrixTransform(svg.getScreenCTM().inverse());
      const xv = x0 + (p.x - M.l) / (W - M.l - M.r) * (x1 - x0);
      hover.setAttribute('visibility', 'visible');
      vline.setAttribute('x1', p.x); vline.setAttribute('x2', p.x);
      const rows = [mode.format(xv)];
      lines.forEach((l, j) => {
        const i = nearest(l.xs, xv);
        const v = l.ys[i];
        dots[j].setAttribute('cx', px(l.xs[i]));
        dots[j].setAttribute('cy', isFinite(v) ? py(v) : -100);
        rows.push((RUNS.length > 1 ? l.run.name + ' · ' : '') + l.label + ': ' +
                  (spec.yFormat || fmt)(v) + '   (' + mode.format(l.xs[i]) + ')');
      });
      showTip(ev, rows.join('\n'));
    });
    catcher.addEventListener('mouseleave', () => {
      hover.setAttribute('visibility', 'hidden');
      hideTip();
    });
  }

  function showTip(ev, text) {
    tip.textContent = text;
    tip.style.display = 'block';
    const w = tip.offsetWidth;
    tip.style.left = (ev.clientX + 14 + w > window.innerWidth ? ev.clientX - 14 - w : ev.clientX + 14) + 'px';
    tip.style.top = (ev.clientY + 12) + 'px';
  }
  function hideTip() { tip.style.display = 'none'; }
  function hoverText(node, text) {
    node.addEventListener('mousemove', (ev) => showTip(ev, text));
    node.addEventListener('mouseleave', hideTip);
  }

  // ---- horizontal stacked bars (per stage) ----------------------------------------------------
  // rows: [{label, kind, run, parts: [{name, value, color}], note}]
  function barChart(parent, key, heading, rows, unit, caption, wide) {
    const card = el('div', { class: 'card' + (wide ? ' wide' : ''), 'data-chart': key }, parent);
    el('h2', {}, card, heading);
    if (!rows.length) {
      el('div', { class: 'empty' }, card, caption || 'nothing recorded');
      return;
    }
    const rowH = 20, top = 6, left = 150, right = 150;
    const h = top + rows.length * rowH + 26;
    const svg = sv('svg', { class: 'chart', viewBox: `0 0 ${W} ${h}` }, card);
    const max = Math.max(...rows.map((r) => r.parts.reduce((a, p) => a + p.value, 0))) || 1;
    const px = (v) => left + v / max * (W - left - right);
    for (const t of ticks(0, max / unit.scale(max), 4).map((v) => v * unit.scale(max))) {
      sv('line', { class: 'gridline', x1: px(t), x2: px(t), y1: top, y2: h - 22 }, svg);
      sv('text', { x: px(t), y: h - 8, 'text-anchor': 'middle' }, svg, unit.tick(t));
    }
    rows.forEach((r, j) => {
      const y = top + j * rowH;
      const g = sv('g', { class: 'bar-row', 'data-chart': key, 'data-kind': r.kind, 'data-run': r.run },
                   svg);
      sv('text', { x: left - 6, y: y + 13, 'text-anchor': 'end' }, g, r.label);
      let acc = 0;
      for (const p of r.parts) {
        if (!(p.value > 0)) continue;
        const rect = sv('rect', { x: px(acc), y: y + 2, width: Math.max(0.5, px(acc + p.value) - px(acc)),
                                  height: rowH - 5, fill: p.color }, g);
        hoverText(rect, r.label + '\n' + p.name + ': ' + unit.format(p.value));
        title(rect, p.name + ' ' + unit.format(p.value));
        acc += p.value;
      }
      sv('text', { x: px(acc) + 6, y: y + 13 }, g, r.note || unit.format(acc));
    });
    const legend = el('div', { class: 'legend' }, card);
    const seen = new Set();
    for (const r of rows) for (const p of r.parts) {
      if (seen.has(p.name)) continue;
      seen.add(p.name);
      const item = el('span', { class: 'run-key' }, legend);
      el('span', { class: 'swatch' }, item).style.background = p.color;
      item.appendChild(document.createTextNode(p.name));
    }
    if (caption) el('div', { class: 'caption' }, card, caption);
  }

  // ---- one step's timeline per rank -----------------------------------------------------------
  function kindOf(name, cat) {
    if (cat === 'wait') return 'wait';
    if (cat === 'comm') return 'comm';
    if (/REDUCE/.test(name)) return 'REDUCE_GRAD';
    if (/STEP/.test(name)) return 'STEP';
    const m = /^\d+([FBIW])\d+/.exec(name);
    return m ? m[1] : 'other';
  }
  function timelineCard(parent, run, k) {
    const card = el('div', { class: 'card wide', 'data-chart': 'timeline', 'data-run': k }, parent);
    el('h2', {}, card, 'One step per rank' + (RUNS.length > 1 ? ': ' + run.name : ''));
    const tl = run.timeline, pred = run.prediction;
    if (!tl) {
      el('div', { class: 'empty' }, card, run.timeline_note || 'no trace.json');
      return;
    }
    const rows = [];
    for (const r of tl.rows) rows.push({ label: `measured dp${r.dp} pp${r.pp}`, events: r.events, sim: false });
    if (pred) pred.timeline.forEach((evs, rank) =>
      rows.push({ label: `simulated pp${rank}`, events: evs.map((e) => [e[0], e[1], e[2], e[3] - e[2]]), sim: true }));
    let end = 0;
    for (const r of rows) for (const e of r.events) end = Math.max(end, e[2] + e[3]);
    end = end || 1;
    const rowH = 20, left = 130, right = 16, top = 4, Wt = 1200;
    const h = top + rows.length * rowH + 30;
    const svg = sv('svg', { class: 'chart', viewBox: `0 0 ${Wt} ${h}` }, card);
    const px = (t) => left + t / end * (Wt - left - right);
    const unit = end >= 2 ? 1 : 1e-3, unitName = end >= 2 ? ' s' : ' ms';
    for (const t of ticks(0, end / unit, 8)) {
      const x = px(t * unit);
      sv('line', { class: 'gridline', x1: x, x2: x, y1: top, y2: h - 26 }, svg);
      sv('text', { x, y: h - 12, 'text-anchor': 'middle' }, svg, fmt(t) + unitName);
    }
    rows.forEach((r, j) => {
      const y = top + j * rowH;
      const g = sv('g', { class: r.sim ? 'sim-row' : 'trace-row' }, svg);
      sv('text', { x: left - 6, y: y + 13, 'text-anchor': 'end' }, g, r.label);
      for (const e of r.events) {
        const kind = r.sim ? e[1] : kindOf(e[0], e[1]);
        const rect = sv('rect', { class: r.sim ? 'sim-event' : 'event', 'data-run': k, x: px(e[2]), y: y + 2,
                                  width: Math.max(0.6, px(e[2] + e[3]) - px(e[2])), height: rowH - 5,
                                  fill: KIND_COLORS[kind] || KIND_COLORS.other }, g);
        const text = r.label + '\n' + e[0] + ': ' + (e[3] * 1e3).toFixed(3) + ' ms at ' +
                     (e[2] * 1e3).toFixed(3) + ' ms';
        hoverText(rect, text);
        title(rect, text);
      }
    });
    const legend = el('div', { class: 'legend' }, card);
    for (const [name, color] of [['F forward', 'F'], ['B backward', 'B'], ['I input grad', 'I'],
                                 ['W weight grad', 'W'], ['reduce / step', 'REDUCE_GRAD'],
                                 ['communication', 'comm'], ['waiting', 'wait']]) {
      const item = el('span', { class: 'run-key' }, legend);
      el('span', { class: 'swatch' }, item).style.background = KIND_COLORS[color];
      item.appendChild(document.createTextNode(name));
    }
    el('div', { class: 'caption' }, card,
       `step ${tl.step + 1} from trace.json (${tl.events} events)` +
       (pred ? '; simulated: ' + costsText(pred.costs)
             : (run.prediction_note ? '; ' + run.prediction_note : '')));
  }

  // What the simulator was given: each chunk's GPU time (metrics.jsonl's device_costs), or the
  // traced step's mean duration per instruction kind.
  function costsText(costs) {
    if (costs.chunks) {
      const kinds = ['F', 'B', 'I', 'W'].filter((k) => costs.chunks.some((c) => c[k] > 0));
      return 'the schedule run by schedules/simulate with each chunk\u2019s GPU time per ' +
             'instruction (metrics.jsonl device_costs, median over steps; ms by chunk: ' +
             kinds.map((k) => k + ' ' + costs.chunks.map((c) => fmt(c[k] * 1e3)).join('/'))
               .join(', ') + ')';
    }
    return 'the schedule run by schedules/simulate with this step\u2019s mean durations per ' +
           'kind (' + Object.entries(costs).map(([k, v]) => k + ' ' + fmt(v * 1e3) + ' ms')
             .join(', ') + ')';
  }

  // ---- page -----------------------------------------------------------------------------------
  function header() {
    el('h1', {}, app, 'troupe report');
    el('div', { class: 'sub' }, app,
       RUNS.map((r) => r.dir).join(' · ') + ' — written ' + DATA.generated);
    const bar = el('div', { class: 'bar' }, app);
    const runs = el('div', { class: 'runs' }, bar);
    for (const r of RUNS) {
      const item = el('span', { class: 'run-key' }, runs);
      el('span', { class: 'swatch' }, item).style.background = r.color;
      el('b', {}, item, r.name);
    }
    const sw = el('div', { class: 'switch', id: 'x-switch' }, bar);
    el('span', {}, sw, 'x axis: ');
    for (const mode of ['step', 'tokens', 'time']) {
      const b = el('button', { 'data-x': mode }, sw, mode === 'time' ? 'wall time' : mode);
      if (!modeAvailable(mode)) b.disabled = true;
      if (mode === state.x) b.classList.add('on');
      b.addEventListener('click', () => {
        state.x = mode;
        for (const o of sw.querySelectorAll('button')) o.classList.toggle('on', o === b);
        timeCharts.forEach(drawTimeChart);
      });
    }
  }

  function notes() {
    const items = [];
    for (const r of RUNS) for (const n of r.notes) items.push((RUNS.length > 1 ? r.name + ': ' : '') + n);
    if (!items.length) return;
    const box = el('div', { class: 'notes', id: 'notes' }, app);
    el('b', {}, box, 'Input notes (what was skipped, and why)');
    const ul = el('ul', {}, box);
    for (const t of items) el('li', {}, ul, t);
  }

  function summaryTable() {
    const s = el('div', { class: 'section scroll' }, app);
    const t = el('table', { id: 'summary' }, s);
    const cols = [['run', (r) => r.name], ['layout', (r) => r.summary.layout || '–'],
                  ['schedule', (r) => r.summary.schedule || '–'],
                  ['steps', (r) => r.summary.steps_done + (r.summary.train_steps ? ' / ' + r.summary.train_steps : '')],
                  ['tokens', (r) => r.summary.tokens ? fmtSI(r.summary.tokens) : '–'],
                  ['time', (r) => fmtTime(r.summary.time_s)],
                  ['last loss', (r) => fmt(r.summary.last_loss)],
                  ['last val loss', (r) => fmt(r.summary.last_val_loss)],
                  ['tokens/s (median)', (r) => fmtSI(r.summary.median_tokens_per_s)],
                  ['model TFLOP/s (median)', (r) => fmt(r.summary.median_tflops)],
                  ['bubble measured / simulated', (r) => fmtPct(r.summary.median_bubble) + ' / ' +
                     (r.prediction ? fmtPct(r.prediction.bubble) : '–')],
                  ['checkpoints', (r) => r.marks.filter((m) => m.kind === 'checkpoint').length],
                  ['restarts', (r) => r.marks.filter((m) => m.kind === 'restart').length],
                  ['faults', (r) => r.marks.filter((m) => m.kind === 'fault').length]];
    const head = el('tr', {}, t);
    for (const [name] of cols) el('th', {}, head, name);
    for (const r of RUNS) {
      const tr = el('tr', {}, t);
      cols.forEach(([, f], j) => {
        const td = el('td', { class: j > 2 ? 'num' : '' }, tr, String(f(r)));
        if (j === 0) td.style.borderLeft = '4px solid ' + r.color;
      });
    }
  }

  function configDiff() {
    if (RUNS.length < 2) return;
    const s = el('div', { class: 'section scroll', id: 'config-diff' }, app);
    el('h2', {}, s, 'Config differences');
    if (!DATA.config_diff.length) {
      el('div', { class: 'sub' }, s, 'the runs have the same config');
      return;
    }
    const t = el('table', {}, s);
    const head = el('tr', {}, t);
    el('th', {}, head, 'key');
    for (const r of RUNS) el('th', {}, head, r.name);
    for (const d of DATA.config_diff) {
      const tr = el('tr', {}, t);
      el('td', {}, tr, d.key);
      for (const v of d.values) el('td', {}, tr, v === null ? '(no config)' : v);
    }
  }

  function eventsTable() {
    const rows = [];
    for (const r of RUNS) for (const m of r.marks)
      if (m.kind === 'restart' || m.kind === 'fault') rows.push([r, m]);
    if (!rows.length) return;
    const s = el('div', { class: 'section scroll' }, app);
    el('h2', {}, s, 'Restarts and faults');
    const t = el('table', { id: 'events' }, s);
    const head = el('tr', {}, t);
    for (const c of ['run', 'after step', 'what']) el('th', {}, head, c);
    for (const [r, m] of rows) {
      const tr = el('tr', {}, t);
      el('td', {}, tr, r.name);
      el('td', { class: 'num' }, tr, String(m.step));
      el('td', {}, tr, m.label);
    }
  }

  function series(run, key) { return run.series[key]; }

  function charts() {
    const grid = el('div', { class: 'grid section' }, app);
    const anyDown = RUNS.filter((r) => r.downsampled);
    if (anyDown.length)
      el('div', { class: 'caption card wide', id: 'downsampled' }, grid,
         anyDown.map((r) => `${r.name}: ${r.rows} steps drawn as ${r.downsampled} buckets ` +
                             '(the minimum and maximum of each bucket kept)').join('; '));
    timeChart(grid, { key: 'loss', title: 'Loss', y: 'mean token loss',
      series: (r) => [{ label: 'train', data: series(r, 'loss') },
                      { label: 'validation', data: r.val, dash: '5 3', dots: true }] });
    timeChart(grid, { key: 'lr', title: 'Learning rate', y: 'lr', zeroBased: true,
      series: (r) => [{ label: 'lr', data: series(r, 'lr') }] });
    timeChart(grid, { key: 'grad_norm', title: 'Gradient norm (before clipping)', y: 'global L2 norm',
      series: (r) => [{ label: 'grad norm', data: series(r, 'grad_norm') }] });
    timeChart(grid, { key: 'loss_scale', title: 'Loss scale and skipped steps', y: 'loss scale',
      logY: true, skipped: true,
      empty: 'no dynamic loss scaling in ' + (RUNS.length > 1 ? 'these runs' : 'this run') +
             ' (precision.dynamic_loss_scale)',
      series: (r) => [{ label: 'loss scale', data: series(r, 'loss_scale') }],
      caption: 'red ticks: steps skipped for non-finite gradients' });
    timeChart(grid, { key: 'tokens_per_s', title: 'Throughput', y: 'tokens/s', zeroBased: true,
      yFormat: fmtSI, yTick: fmtSI,
      series: (r) => [{ label: 'tokens/s', data: series(r, 'tokens_per_s') }] });
    timeChart(grid, { key: 'tflops', title: 'Model TFLOP/s', y: 'TFLOP/s', zeroBased: true,
      series: (r) => [{ label: 'model TFLOP/s', data: series(r, 'tflops') }],
      caption: 'tokens/s × (6·N + 12·L·d·T) per token (N parameters, L layers, d hidden, T ' +
               'sequence length); recomputation not counted' });
    timeChart(grid, { key: 'bubble', title: 'Pipeline bubble per step', y: 'idle share',
      zeroBased: true, yFormat: fmtPct, yTick: (v) => (100 * v).toFixed(0) + '%',
      empty: 'no per-stage times (single-rank runs record none)',
      series: (r) => [{ label: r.summary.bubble_source === 'device' ? 'measured (GPU time)'
                                                                     : 'measured',
                        data: series(r, 'bubble') }],
      references: (r) => r.prediction ? [{ label: 'simulated', value: r.prediction.bubble }] : [],
      caption: 'measured: mean idle share of the stages within each step’s span (on a GPU, of ' +
               'each stage’s stream, timed by CUDA events); simulated: the schedule simulator ' +
               'with the measured costs (on a GPU, each chunk’s device time)' });

    // Per-stage time, measured beside the simulator.
    const stageRows = [];
    RUNS.forEach((r, k) => {
      const pp = [...new Set(r.stages.map((s) => s.pp))].sort((a, b) => a - b);
      for (const p of pp) {
        for (const s of r.stages.filter((x) => x.pp === p))
          stageRows.push({ run: k, kind: 'measured',
            label: (RUNS.length > 1 ? r.name + ' ' : '') + `dp${s.dp} pp${s.pp}`,
            parts: s.device_busy_s !== undefined
              ? [{ name: 'busy on the GPU (compute)', value: s.device_busy_s, color: '#4c78a8' },
                 { name: 'idle on the GPU', value: s.device_idle_s, color: '#d0d5dd' }]
              : [{ name: 'busy (compute)', value: s.busy_s, color: '#4c78a8' },
                 { name: 'communicating', value: s.comm_s, color: '#9ecae9' },
                 { name: 'waiting', value: s.wait_s, color: '#d0d5dd' }],
            note: 'bubble ' + fmtPct(s.device_busy_s !== undefined ? s.device_bubble : s.bubble) });
        if (r.prediction && r.prediction.ranks[p]) {
          const q = r.prediction.ranks[p];
          stageRows.push({ run: k, kind: 'simulated',
            label: (RUNS.length > 1 ? r.name + ' ' : '') + `simulated pp${p}`,
            parts: [{ name: 'simulated compute', value: q.compute_s, color: '#2f5d8a' },
                    { name: 'simulated transfer / reduce / step', value: q.transfer_s + q.other_s, color: '#6baed6' },
                    { name: 'simulated idle', value: q.idle_s, color: '#eaecf0' }],
            note: 'bubble ' + fmtPct(q.bubble) });
        }
      }
    });
    barChart(grid, 'stages', 'Per-stage time per step (median) beside the simulator', stageRows,
             { scale: (max) => (max >= 1 ? 1 : 1e-3),
               tick: (v) => (v >= 1 || v === 0 ? fmt(v) + ' s' : fmt(v * 1e3) + ' ms'),
               format: (v) => (v * 1e3).toFixed(3) + ' ms' },
             stageRows.length ? 'measured from metrics.jsonl’s stages (on a GPU, each stage’s stream ' +
             'within the step’s device span); simulated rows: the schedule run by the simulator ' +
             'with the measured costs (on a GPU each chunk’s, else the mean per instruction kind)'
                              : 'no per-stage times (single-rank runs record none)');

    const memRows = [];
    RUNS.forEach((r, k) => {
      for (const s of r.stages) {
        const parts = [{ name: 'peak saved activations', value: s.peak_activation_bytes, color: '#54a24b' }];
        if (s.peak_device_bytes) {
          parts[0] = { name: 'peak device memory (stage)', value: s.peak_device_bytes, color: '#54a24b' };
          parts.push({ name: 'peak device memory (optimizer shard)', value: s.optimizer_peak_device_bytes || 0, color: '#b279a2' });
        }
        memRows.push({ run: k, kind: 'memory', label: (RUNS.length > 1 ? r.name + ' ' : '') + `dp${s.dp} pp${s.pp}`, parts });
      }
    });
    barChart(grid, 'memory', 'Peak memory per stage', memRows,
             { scale: (max) => (max >= 1024 ** 3 ? 1024 ** 3 : max >= 1024 ** 2 ? 1024 ** 2 : 1024),
               tick: fmtBytes, format: fmtBytes },
             memRows.length ? 'the largest value any step reported (CPU runs: saved activations only)'
                            : 'no per-stage memory (single-rank runs record none)');
    RUNS.forEach((r, k) => timelineCard(grid, r, k));
  }

  header();
  notes();
  summaryTable();
  configDiff();
  eventsTable();
  charts();
  app.setAttribute('data-state', 'ready');
})();
