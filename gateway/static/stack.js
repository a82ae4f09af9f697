// The live view: frames from GET /v1/stack/events (gateway/live_view.py), drawn as they come.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";
const RETRY_MS = 2000;
let known = null; // worker ids of the last frame: who joined and who left
let controller = null;

function showError(err) {
  $("error").textContent = err ? err.message : "";
  $("error").hidden = !err;
  $("error").dataset.kind = err && err.kind ? err.kind : "";
  if (err && err.kind === "auth") $("settings").open = true;
}

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const pct = (a, b) => (b ? `${Math.round((100 * a) / b)}%` : "–");
const ms = (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + " ms";

function renderTotals(frame) {
  const l = frame.latency || {};
  const rows = [
    ["Tokens/s", l.tokens_per_s === null || l.tokens_per_s === undefined ? "–" : l.tokens_per_s.toFixed(1)],
    ["TTFT p50 / p99", `${fmtSeconds(l.ttft_p50_s)} / ${fmtSeconds(l.ttft_p99_s)}`],
    ["ITL p50 / p99", `${fmtSeconds(l.itl_p50_s)} / ${fmtSeconds(l.itl_p99_s)}`],
    ["Requests started", String(l.requests || 0)],
    ["Waiting for prefill", String(frame.num_waiting || 0)],
    ["ITL target", frame.itl_target || "–"],
  ];
  $("totals").replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
}

// Stacked bars of the last steps (decode below, prompt chunks above) and, under them, each step's time
// against the ITL target's bound (a tick; the bar turns red above it).
function stepCharts(w, budget) {
  const steps = w.steps || [];
  const width = 240, h = 60, bw = width / 24; // room for the 24 steps a view carries
  const maxTokens = Math.max(budget || 1, ...steps.map((s) => s.decode_tokens + s.prefill_tokens));
  const maxMs = Math.max(1e-3, ...steps.map((s) => Math.max(s.step_ms, s.target_ms)));
  const first = 24 - steps.length; // the newest step on the right
  const tokens = el("svg:svg", { viewBox: `0 0 ${width} ${h}`, preserveAspectRatio: "none", class: "chart", role: "img",
    "aria-label": `Tokens of the last ${steps.length} steps` });
  const times = el("svg:svg", { viewBox: `0 0 ${width} ${h}`, preserveAspectRatio: "none", class: "chart", role: "img",
    "aria-label": `Time of the last ${steps.length} steps against the ITL target` });
  steps.forEach((s, i) => {
    const x = (first + i) * bw + 1, dh = (h * s.decode_tokens) / maxTokens, ph = (h * s.prefill_tokens) / maxTokens;
    const g = el("svg:g", { class: "step", "data-decode": s.decode_tokens, "data-prefill": s.prefill_tokens },
      el("svg:title", {}, `${s.decode_tokens} decode + ${s.prefill_tokens} prompt-chunk tokens ` +
        `(${s.prefill_chunks} chunks)`),
      el("svg:rect", { x, y: h - dh, width: bw - 2, height: dh, class: "decode" }),
      el("svg:rect", { x, y: h - dh - ph, width: bw - 2, height: ph, class: "prefill" }));
    tokens.append(g);
    const th = (h * s.step_ms) / maxMs, over = s.target_ms > 0 && s.step_ms > s.target_ms;
    const t = el("svg:g", { class: "time" + (over ? " over" : "") },
      el("svg:title", {}, `${ms(s.step_ms)}` + (s.target_ms > 0 ? ` (target ${ms(s.target_ms)})` : "")),
      el("svg:rect", { x, y: h - th, width: bw - 2, height: th }));
    if (s.target_ms > 0) {
      const ty = h - (h * s.target_ms) / maxMs;
      t.append(el("svg:line", { x1: x - 1, x2: x + bw - 1, y1: ty, y2: ty, class: "target" }));
    }
    times.append(t);
  });
  return [tokens, times];
}

function lastStepText(w) {
  const s = (w.steps || [])[w.steps.length - 1];
  if (!s) return "No step yet.";
  const age = w.last_step_age_s >= 1 ? ` (${w.last_step_age_s.toFixed(0)} s ago)` : "";
  return `Last step${age}: ${s.decode_tokens} decode + ${s.prefill_tokens} prompt-chunk tokens ` +
    `(${s.prefill_chunks} chunk${s.prefill_chunks === 1 ? "" : "s"}) in ${ms(s.step_ms)}` +
    (s.target_ms > 0 ? `, target ${ms(s.target_ms)}` : "");
}

function workerCard(w, budget) {
  const card = el("article", { class: "worker", "data-worker-id": w.worker_id, "aria-label": `Worker ${w.worker_id}` },
    el("h3", {}, w.worker_id, " ", el("span", { class: "role " + w.role }, w.role),
      w.draining ? el("span", { class: "role draining" }, "draining") : null));
  const facts = [["Threads", w.threads || "–"], ["Host", w.host || "–"]];
  if (!w.adopted) {
    card.append(el("dl", { class: "facts" }, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
      el("p", { class: "hint" }, "Joining: the scheduler has not planned on it yet."));
    return card;
  }
  const kv = w.kv, p = w.prefix_cache, sp = w.speculation;
  facts.push(["Running", w.num_running], ["Waiting", w.num_waiting], ["Handoffs in flight", w.handoffs_in_flight],
    ["Prefix cache hits", `${pct(p.hits, p.queries)} of ${p.queries} tokens`],
    ["Speculation accepted", sp.drafted ? `${pct(sp.accepted, sp.drafted)} of ${sp.drafted}` : "–"]);
  const [tokens, times] = stepCharts(w, budget);
  const used = kv.total ? (100 * kv.used) / kv.total : 0, cached = kv.total ? (100 * kv.cached) / kv.total : 0;
  card.append(
    el("dl", { class: "facts" }, ...facts.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, String(v))])),
    el("p", { class: "kv-text" }, `KV blocks: ${kv.used} used · ${kv.cached} cached · ${kv.free} free of ${kv.total}`),
    el("div", { class: "kv", role: "img", "aria-label": `KV blocks ${pct(kv.used, kv.total)} used` },
      el("span", { class: "used", style: `width:${used}%` }),
      el("span", { class: "cached", style: `width:${cached}%` })),
    el("p", { class: "chart-label" }, "Tokens per step"), tokens,
    el("p", { class: "chart-label" }, "Step time against the ITL target"), times,
    el("p", { class: "last-step" }, lastStepText(w)));
  return card;
}

function renderQueue(frame) {
  const rows = (frame.waiting || []).map((s) => el("tr", { "data-request-id": s.request_id },
    el("td", { title: s.request_id }, s.request_id ? s.request_id.slice(0, 14) : s.tenant),
    el("td", {}, s.worker_id || "(no worker yet)"),
    el("td", {}, `${s.waiting_s.toFixed(1)} s`),
    el("td", {}, el("progress", { max: s.prompt_tokens, value: s.prefilled_tokens,
      "aria-label": `${s.prefilled_tokens} of ${s.prompt_tokens} tokens` }),
    ` ${s.prefilled_tokens} / ${s.prompt_tokens}`)));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 4, class: "hint" }, "Nothing waits.")));
  const more = (frame.num_waiting || 0) - (frame.waiting || []).length;
  if (more > 0) rows.push(el("tr", {}, el("td", { colspan: 4, class: "hint" }, `and ${more} more`)));
  $("queue").tBodies[0].replaceChildren(...rows);
  const tenants = frame.tenants || [];
  $("tenants-section").hidden = !tenants.length;
  const running = tenants.reduce((n, t) => n + t.num_running, 0);
  $("tenants").tBodies[0].replaceChildren(...tenants.map((t) => el("tr", {},
    el("td", {}, t.tenant || "(operator keys)"), el("td", {}, String(t.weight)),
    el("td", {}, `${t.num_running} (${pct(t.num_running, running)})`), el("td", {}, String(t.num_waiting)))));
}

function noteChanges(workers) {
  const ids = new Set(workers.map((w) => w.worker_id));
  if (known) {
    const left = [...known].filter((id) => !ids.has(id)), joined = [...ids].filter((id) => !known.has(id));
    const words = [...left.map((id) => `Worker ${id} left (its heartbeat stopped).`),
      ...joined.map((id) => `Worker ${id} joined.`)];
    if (words.length) $("notices").textContent = words.join(" ");
  }
  known = ids;
}

function render(frame) {
  if (frame.error) {
    showError(new ApiError("server", frame.error));
    return;
  }
  showError(null);
  const workers = frame.workers || [];
  noteChanges(workers);
  $("status").textContent = !workers.length ? "No worker is alive: start one, or wait for it to load."
    : frame.view ? `Live · ${workers.length} worker${workers.length === 1 ? "" : "s"}`
    : "Live · waiting for the scheduler's first view (it writes one once someone watches)";
  renderTotals(frame);
  $("workers").replaceChildren(...workers.map((w) => workerCard(w, frame.max_num_batched_tokens)));
  renderQueue(frame);
}

async function connect() {
  if (controller) controller.abort();
  controller = new AbortController();
  const mine = controller;
  try {
    const resp = await apiFetch("/v1/stack/events", { signal: mine.signal });
    $("status").textContent = "Connected.";
    await readEvents(resp, (data) => render(JSON.parse(data)));
    throw new ApiError("network", "The live view's stream ended (the gateway stopped?). Reconnecting…");
  } catch (err) {
    if (mine.signal.aborted) return;
    showError(err instanceof ApiError ? err : networkError(err));
    $("status").textContent = "Not connected.";
    if (err.kind !== "auth") setTimeout(() => { if (controller === mine) connect(); }, RETRY_MS);
  }
}

bindKeyForm($("api-key"), $("remember-key"), connect);
connect();
