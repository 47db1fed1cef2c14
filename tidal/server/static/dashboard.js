// tidal's dashboard: renders frames (one engine core's stats and scheduler view each), live
// from /dashboard/stream or replayed from window.TIDAL_FRAMES. Charts are uPlot.
"use strict";

const QUEUES = ["waiting", "prefill", "decode", "preempted", "transferring"];
const BLOCKS = {".": ["free", "#e4e7ec"], "c": ["cached", "#9fd4a8"],
                "u": ["used", "#2f8fdc"], "s": ["shared", "#1a4f8a"]};
const WINDOW = 300;  // seconds of history the charts keep
const cores = {};
const latency = {ttft: [], tpot: [], slo: {}};
let origin = null;  // time of the first frame: charts count seconds from it

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

// A legend's value: the point under the cursor, else the latest (uPlot shows "--").
function latest(u, value, series, index) {
  const data = u.data[series];
  const v = index == null ? data[data.length - 1] : value;
  if (v == null) return "-";
  return Math.abs(v) >= 100 ? v.toFixed(0) : Number(v.toPrecision(3)).toString();
}

// series: [label, colour, bars?]; the x axis is seconds since the first frame.
function chart(parent, title, yLabel, series) {
  const opts = {
    title, width: 380, height: 190, legend: {show: true},
    scales: {x: {time: false}},
    axes: [{label: "seconds"}, {label: yLabel, size: 60}],
    series: [{label: "s", value: latest}, ...series.map(([label, color, bars]) => ({
      label, stroke: color, fill: bars ? color : undefined, width: 1.5, points: {show: false},
      value: latest, paths: bars ? uPlot.paths.bars({size: [0.9, 8]}) : undefined}))],
  };
  return new uPlot(opts, [[], ...series.map(() => [])], parent);
}

// New data, and the legend's latest values unless the cursor is on the chart.
function draw(u, data) {
  u.setData(data);
  if (u.cursor.idx == null) u.setLegend({idx: null});
}

function corePanel(index, label) {
  const panel = el("div", {class: "core", id: `core-${index}`});
  panel.append(el("h2", {}, label ?? `engine core ${index}`));
  const counts = el("div", {class: "counts"});
  for (const q of QUEUES) {
    counts.append(el("span", {}, el("i", {class: `chip ${q}`}), `${q} `,
                     el("b", {class: `queue-${q}`}, "0")));
  }
  // LoRA adapter slots: the adapters of running requests (in slots) and of waiting ones
  counts.append(el("span", {class: "lora", hidden: ""}, "LoRA slots ", el("b", {class: "lora-running"}),
                   " waiting ", el("b", {class: "lora-waiting"})));
  panel.append(counts);
  const blockRow = el("div", {class: "row"});
  const canvas = el("canvas", {class: "blocks", width: 512, height: 128});
  const legend = el("div", {class: "counts"});
  for (const [name, color] of Object.values(BLOCKS)) {
    legend.append(el("span", {}, el("i", {class: `chip b-${name}`}), `${name} blocks `,
                     el("b", {class: `blocks-${name}`}, "0")));
  }
  legend.append(el("div", {class: "cell-note"}));
  blockRow.append(el("div", {}, el("h2", {}, "KV pool, block by block"), canvas, legend));
  const table = el("table", {}, el("thead", {}, el("tr", {},
    ...["request", "state", "age (s)", "prompt", "output", "computed"].map(h => el("th", {}, h)))),
    el("tbody"));
  blockRow.append(el("div", {}, el("h2", {}, "Requests (oldest of each queue)"),
                     el("div", {class: "requests"}, table)));
  panel.append(blockRow);
  const charts = el("div", {class: "row"});
  panel.append(charts);
  const later = [...document.querySelectorAll(".core")].find(p => Number(p.dataset.index) > index);
  panel.dataset.index = index;
  document.getElementById("cores").insertBefore(panel, later ?? null);  // in core order
  const slot = () => { const d = el("div"); charts.append(d); return d; };
  return {
    panel, canvas, tbody: table.querySelector("tbody"), last: null,
    rate: {x: [], prompt: [], gen: []}, steps: {x: [], prefill: [], decode: [], accepted: [], ms: [], predicted: []},
    state: {x: [], ratio: [], usage: []}, tier: {x: [], held: [], loaded: [], stored: [], ms: []},
    slot,
    charts: {
      rate: chart(slot(), "Throughput", "tokens/s", [["prompt", "#f0a030"], ["generated", "#2f8fdc"]]),
      steps: chart(slot(), "Step composition", "tokens/step", [["prefill", "#f0a030", true], ["decode", "#2f8fdc"], ["accepted guesses", "#30a050"]]),
      ms: chart(slot(), "Step time", "ms", [["step", "#555"], ["predicted", "#f0a030"]]),
      state: chart(slot(), "Decode reservation and KV use", "share (0-1)", [["new_token_ratio", "#8a5cd0"], ["kv usage", "#2f8fdc"]]),
    },
  };
}

function trim(series, now) {
  while (series.x.length && series.x[0] < now - WINDOW) {
    for (const k of Object.keys(series)) series[k].shift();
  }
}

function drawBlocks(c, view) {
  const ctx = c.canvas.getContext("2d");
  const n = view.blocks.length, cols = Math.ceil(Math.sqrt(n * 4)), rows = Math.ceil(n / cols);
  const size = Math.max(1, Math.floor(Math.min(512 / cols, 128 / rows)));
  c.canvas.width = cols * size; c.canvas.height = rows * size;
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = BLOCKS[view.blocks[i]][1];
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size, size);
  }
  for (const [code, [name]] of Object.entries(BLOCKS)) {
    c.panel.querySelector(`.blocks-${name}`).textContent = view.block_counts[code] ?? 0;
  }
  c.panel.querySelector(".cell-note").textContent =
    view.blocks_per_cell > 1 ? `one cell: ${view.blocks_per_cell} blocks (the busiest shown)` : "";
}

function drawRequests(c, view) {
  const rows = view.requests.map(r => el("tr", {class: "req", "data-state": r.state},
    el("td", {}, r.id), el("td", {}, el("i", {class: `chip ${r.state}`}), r.state),
    el("td", {}, r.age.toFixed(1)), el("td", {}, r.prompt_tokens),
    el("td", {}, r.output_tokens), el("td", {}, r.computed_tokens)));
  c.tbody.replaceChildren(...rows);
}

function render(frame) {
  const view = frame.view;
  if (!view) return;
  if (origin === null) origin = view.steps.length ? view.steps[0].time : view.time;
  const c = cores[frame.core] ??= corePanel(frame.core, frame.label);
  (window.tidalLast ??= {})[frame.core] = frame;  // what each panel shows, for tests
  const t = view.time - origin, s = frame.stats;
  for (const q of QUEUES) c.panel.querySelector(`.queue-${q}`).textContent = view.queues[q] ?? 0;
  const lora = c.panel.querySelector(".lora"), running = s.running_loras ?? [];
  lora.hidden = !running.length && !(s.waiting_loras ?? []).length;
  lora.querySelector(".lora-running").textContent =
    `${running.join(", ") || "none"} (${running.length} of ${s.max_loras})`;
  lora.querySelector(".lora-waiting").textContent = (s.waiting_loras ?? []).join(", ") || "none";
  drawBlocks(c, view);
  drawRequests(c, view);
  if (c.last && t > c.last.t) {
    const dt = t - c.last.t;
    c.rate.x.push(t);
    c.rate.prompt.push((s.prompt_tokens - c.last.prompt) / dt);
    c.rate.gen.push((s.generation_tokens - c.last.gen) / dt);
  }
  c.last = {t, prompt: s.prompt_tokens, gen: s.generation_tokens};
  for (const step of view.steps) {
    c.steps.x.push(step.time - origin);
    c.steps.prefill.push(step.prefill_tokens);
    c.steps.decode.push(step.decode_tokens);
    c.steps.accepted.push(step.accepted_tokens || 0);
    c.steps.ms.push(step.seconds * 1000);
    c.steps.predicted.push(step.predicted ? step.predicted * 1000 : null);  // none: no model
  }
  c.state.x.push(t); c.state.ratio.push(s.new_token_ratio); c.state.usage.push(s.kv_usage);
  if (s.tier_capacity > 0) {  // the tiers below the pool (--kv-cache-dir, --kv-host-memory)
    c.charts.tier ??= chart(c.slot(), "KV tier", "blocks, blocks/s, ms",
      [["held", "#555"], ["loaded/s", "#30a050"], ["stored/s", "#f0a030"],
       ["load ms a block", "#8a5cd0"]]);
    const dt = c.lastTier && t > c.lastTier.t ? t - c.lastTier.t : null;
    c.tier.x.push(t); c.tier.held.push(s.tier_blocks);
    c.tier.loaded.push(dt ? (s.tier_hit_blocks - c.lastTier.loaded) / dt : 0);
    c.tier.stored.push(dt ? (s.tier_stored_blocks - c.lastTier.stored) / dt : 0);
    c.tier.ms.push(s.tier_load_ms);
    c.lastTier = {t, loaded: s.tier_hit_blocks, stored: s.tier_stored_blocks};
  }
  for (const series of [c.rate, c.steps, c.state, c.tier]) trim(series, t);
  draw(c.charts.rate, [c.rate.x, c.rate.prompt, c.rate.gen]);
  draw(c.charts.steps, [c.steps.x, c.steps.prefill, c.steps.decode, c.steps.accepted]);
  draw(c.charts.ms, [c.steps.x, c.steps.ms, c.steps.predicted]);
  draw(c.charts.state, [c.state.x, c.state.ratio, c.state.usage]);
  if (c.charts.tier) {
    draw(c.charts.tier, [c.tier.x, c.tier.held, c.tier.loaded, c.tier.stored, c.tier.ms]);
  }
  c.panel.dataset.steps = s.num_steps;
  addLatency(frame);
}

function histogram(values, bins) {
  if (!values.length) return [[], []];
  const top = Math.max(...values) * 1.001 || 1, width = top / bins;
  const counts = new Array(bins).fill(0);
  for (const v of values) counts[Math.min(bins - 1, Math.floor(v / width))]++;
  return [counts.map((_, i) => (i + 0.5) * width), counts];
}

// A red line at the SLO target (seconds) when one is set.
function sloLine(key) {
  return (u) => {
    const ms = latency.slo[`${key}_ms`];
    if (!ms) return;
    const x = u.valToPos(ms / 1000, "x", true), ctx = u.ctx;
    ctx.save(); ctx.strokeStyle = "#d9453d"; ctx.lineWidth = 2; ctx.beginPath();
    ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
    ctx.restore();
  };
}

function latencyChart(id, title) {
  // from 0 to past the last bin and the SLO target, so both show
  const range = (u, min, max) => [0, Math.max(max * 1.05, (latency.slo[`${id}_ms`] || 0) / 900)];
  return new uPlot({title, width: 420, height: 190, scales: {x: {time: false, range}},
    hooks: {draw: [sloLine(id)]},
    legend: {show: false}, axes: [{label: "seconds"}, {label: "requests"}],
    series: [{label: "s"}, {label: "requests", stroke: "#2f8fdc", fill: "#2f8fdc88",
                             points: {show: false},
                             paths: uPlot.paths.bars({size: [0.95, 40]})}]},
    [[], []], document.getElementById(id));
}
const latencyCharts = {ttft: latencyChart("ttft", "Time to first token"),
                       tpot: latencyChart("tpot", "Time per output token")};

function addLatency(frame) {
  latency.slo = frame.slo || {};
  for (const [, ttft, tpot] of frame.latency || []) {
    latency.ttft.push(ttft);
    if (tpot !== null) latency.tpot.push(tpot);
  }
  for (const key of ["ttft", "tpot"]) {
    if (latency[key].length > 1000) latency[key].splice(0, latency[key].length - 1000);
    const values = latency[key];
    const slo = latency.slo[`${key}_ms`];
    const within = slo ? values.filter(v => v * 1000 <= slo).length : null;
    latencyCharts[key].setData(histogram(values, 30));
    const name = key === "ttft" ? "Time to first token" : "Time per output token";
    const note = slo ? `, SLO ${slo} ms: ${(100 * within / (values.length || 1)).toFixed(0)}% within`
                     : "";
    latencyCharts[key].root.querySelector(".u-title").textContent =
      `${name} (${values.length} requests${note})`;
  }
  const slo = latency.slo;
  document.getElementById("slo").textContent = slo.ttft_ms || slo.tpot_ms
    ? `SLO: TTFT ${slo.ttft_ms ?? "-"} ms, TPOT ${slo.tpot_ms ?? "-"} ms` : "";
}

function reset() {
  for (const k of Object.keys(cores)) { cores[k].panel.remove(); delete cores[k]; }
  latency.ttft = []; latency.tpot = []; origin = null;
}

function replay(frames) {
  const status = document.getElementById("status");
  const scrub = document.getElementById("scrub"), play = document.getElementById("play");
  document.getElementById("replay").hidden = false;
  status.textContent = `replay: ${frames.length} frames`;
  scrub.max = frames.length - 1;
  let shown = -1, timer = null;
  const show = (index) => {
    if (index < shown) { reset(); shown = -1; }
    for (let i = shown + 1; i <= index; i++) render(frames[i]);
    shown = index; scrub.value = index;
    const t = frames[index].view ? frames[index].view.time - frames[0].view.time : 0;
    document.getElementById("replay-time").textContent = `${t.toFixed(1)} s`;
  };
  const step = () => { if (shown < frames.length - 1) show(shown + 1); else toggle(); };
  const toggle = () => {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "play"; }
    else { timer = setInterval(step, 100); play.textContent = "pause"; }
  };
  play.onclick = toggle;
  scrub.oninput = () => show(Number(scrub.value));
  show(0);
  toggle();
}

function live() {
  const status = document.getElementById("status");
  const source = new EventSource("dashboard/stream" + location.search);
  source.onopen = () => { status.textContent = "live"; status.className = "live"; };
  source.onerror = () => { status.textContent = "disconnected: retrying"; status.className = "down"; };
  source.onmessage = (e) => render(JSON.parse(e.data));
}

if (window.TIDAL_FRAMES) replay(window.TIDAL_FRAMES); else live();
