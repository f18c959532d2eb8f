// The kvharbor dashboard: polls the gateway's JSON API and redraws. No framework; uPlot for the charts.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token");
const REFRESH_MS = Number(document.body.dataset.refreshMs) || 2000;
const COLORS = ["#2f6fdf", "#d9822b", "#2a8a48", "#9b59b6", "#b3261e", "#16a2b8"];
const charts = {};

async function api(path) {
  const headers = TOKEN === null ? {} : { Authorization: "Bearer " + TOKEN };
  const response = await fetch(path, { headers, cache: "no-store" });
  if (!response.ok) throw new Error(path + ": " + response.status + " " + (await response.text()));
  return response.json();
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function percent(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %"; }

function setText(id, text) { document.getElementById(id).textContent = text; }

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

// Everything the page reads of /api/status, in one place.
function figures(status) {
  const hits = status.hit_rate;
  const cards = Object.entries(status.cards);
  return {
    gateway: `release ${status.release} · pid ${status.pid} · ${status.socket}`,
    lookups: hits.lookups, queryTokens: hits.lookup_tokens, hitTokens: hits.hit_tokens,
    clients: status.clients.length,
    tiers: status.store.tiers,
    skipped: status.store.skipped || {},
    card: cards.length ? { tier: cards[0][0], ...cards[0][1] } : null,
  };
}

function showStatus(status) {
  const f = figures(status);
  setText("gateway", f.gateway);
  setText("lookups", String(f.lookups));
  setText("query-tokens", String(f.queryTokens));
  setText("hit-rate-total", f.queryTokens ? percent(f.hitTokens / f.queryTokens) : "–");
  setText("clients", String(f.clients));
  const body = document.querySelector("#tiers tbody");
  body.replaceChildren();
  for (const tier of f.tiers) {
    const row = body.insertRow();
    const healthy = tier.health === "ok";
    cell(row, tier.name);
    cell(row, tier.device_type + (tier.fallback ? " (fallback)" : ""));
    cell(row, tier.health + (tier.health_detail ? ` (${tier.health_detail})` : ""), healthy ? "ok" : "bad");
    cell(row, tier.breaker, tier.breaker === "closed" ? "ok" : "bad");
    // What the objects take (what evictions count), and their own bytes where the device's allocation adds to them.
    const allocated = tier.allocated_bytes > tier.used_bytes ? ` (${bytes(tier.used_bytes)} in objects)` : "";
    cell(row, bytes(tier.allocated_bytes) + allocated);
    cell(row, bytes(tier.capacity_bytes));
    cell(row, String(tier.keys));
    cell(row, String((tier.counters || {}).evictions || 0));
    cell(row, String((tier.counters || {}).corrupt || 0), (tier.counters || {}).corrupt ? "bad" : "");
  }
  for (const [name, why] of Object.entries(f.skipped)) {  // Configured, but did not open at start.
    const row = body.insertRow();
    cell(row, name);
    cell(row, "–");
    cell(row, why, "bad");
    for (let i = 0; i < 6; i += 1) cell(row, "–");
  }
  const section = document.getElementById("card-section");
  section.hidden = f.card === null;
  if (f.card !== null) {
    const cardBody = document.querySelector("#card tbody");
    cardBody.replaceChildren();
    for (const [key, value] of Object.entries(f.card)) {
      const row = cardBody.insertRow();
      cell(row, key);
      cell(row, typeof value === "object" ? JSON.stringify(value) : String(value));
    }
  }
}

function draw(id, series, data, yRange) {
  const element = document.getElementById(id);
  const key = id + ":" + series.map((s) => s.label).join(",");
  if (!charts[id] || charts[id].key !== key) {
    if (charts[id]) charts[id].plot.destroy();
    const options = {
      width: element.clientWidth, height: element.clientHeight - 30,
      scales: { x: { time: true }, y: yRange ? { range: yRange } : {} },
      // spanGaps: an interval without lookups has no hit rate; the line joins its neighbours
      // (uPlot clips a point standing alone between gaps away).
      series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: COLORS[i % COLORS.length], width: 2,
                                                spanGaps: true, points: { show: true, size: 5 } }))],
    };
    charts[id] = { key, plot: new uPlot(options, data, element) };
  } else {
    charts[id].plot.setData(data);
  }
}

function showHistory(history) {
  const t = history.t;
  draw("chart-hit-rate", [{ label: "hit rate %" }],
       [t, history.hit_rate.map((x) => (x === null ? null : 100 * x))], [0, 100]);
  const names = Object.keys(history.tiers);
  draw("chart-usage", names.map((n) => ({ label: n })),
       [t, ...names.map((n) => history.tiers[n].used_bytes.map(
         (u) => (u === null ? null : 100 * u / history.tiers[n].capacity_bytes)))], [0, 100]);
  draw("chart-evictions", names.map((n) => ({ label: n })), [t, ...names.map((n) => history.tiers[n].evictions)]);
}

function showLog(document_) {
  const list = document.getElementById("log");
  list.replaceChildren();
  for (const line of document_.lines.slice().reverse()) {
    const item = document.createElement("li");
    item.className = line.level;
    item.textContent = new Date(line.time_s * 1000).toLocaleTimeString() + " " + line.level + " " + line.message;
    list.appendChild(item);
  }
}

async function refresh() {
  const state = document.getElementById("state");
  try {
    const [status, history, log] = await Promise.all([api("api/status"), api("api/history"), api("api/log")]);
    showStatus(status);
    showHistory(history);
    showLog(log);
    state.textContent = "live";
    state.className = "badge ok";
  } catch (err) {
    state.textContent = "not answering: " + err.message;
    state.className = "badge bad";
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
