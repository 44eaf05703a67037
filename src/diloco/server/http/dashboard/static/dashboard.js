// The diloco dashboard: polls GET /v1/dashboard, draws tables and uPlot charts, and sends the
// admin actions. Same-origin requests with the session cookie; writes carry the protocol
// header (which the server requires, and which no other site's form can send).
"use strict";

const PROTOCOL = { "X-Diloco-Protocol": "1" };
const POLL_MS = 2000;
const HISTORY_PAGE = 1000; // rounds per answer of /v1/dashboard
const COLORS = ["#2f6fdb", "#d9480f", "#2b8a3e", "#ae3ec9", "#e67700", "#0c8599", "#c2255c", "#5f3dc4"];
const run = { rounds: [], workers: [], last: -1, charts: {}, lossWorkers: "" };

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = text;
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  return node;
}

function fixed(value, digits) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function say(text) {
  document.getElementById("message").textContent = text;
}

async function call(method, path, body) {
  const options = { method, credentials: "same-origin", headers: { ...PROTOCOL } };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body);
  }
  const response = await fetch(path, options);
  if (response.status === 401) {
    window.location.href = "/"; // the session expired: the login page
    throw new Error("signed out");
  }
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.error || `${method} ${path}: ${response.status}`);
  return answer;
}

function renderSummary(status) {
  const live = status.workers.filter((w) => w.live).length;
  const items = [
    ["round", status.round],
    ["mode", status.mode],
    ["live workers", live],
    ["waiting for", status.waiting_for.join(", ") || "-"],
    ["state", status.broken ? "broken: " + status.broken : status.paused ? "paused" : "running"],
    ["outer lr", status.outer_lr],
    ["rounds/hour", fixed(status.rounds_per_hour, 1)],
    ["MB in", fixed(status.bytes_in / 1e6, 1)],
    ["MB out", fixed(status.bytes_out / 1e6, 1)],
    ["uptime s", fixed(status.uptime_seconds, 0)],
  ];
  const summary = document.getElementById("summary");
  summary.replaceChildren(
    ...items.map(([name, value]) => {
      const item = el("div", null, { "data-name": name });
      item.append(el("dt", name), el("dd", String(value)));
      return item;
    })
  );
  const lr = document.getElementById("lr");
  if (document.activeElement !== lr) lr.value = status.outer_lr;
}

function renderWorkers(status) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(
    ...status.workers.map((w) => {
      const row = el("tr", null, { "data-worker": w.worker_id, class: w.live ? "" : "gone" });
      row.append(
        el("td", w.worker_id),
        el("td", w.live ? "live" : "gone"),
        el("td", w.step),
        el("td", fixed(w.steps_per_second, 2)),
        el("td", w.recommended_sync_every ?? "-"),
        el("td", fixed(w.loss, 4)),
        el("td", w.tokens),
        el("td", w.rounds_contributed),
        el("td", fixed(w.last_seen_seconds_ago, 1))
      );
      const cell = el("td");
      if (w.live) {
        const evict = el("button", "Evict", { type: "button", class: "evict" });
        evict.addEventListener("click", () => act(`evict ${w.worker_id}`, () =>
          call("POST", `/v1/admin/workers/${encodeURIComponent(w.worker_id)}/evict`, {
            ban: false,
            reason: "evicted from the dashboard",
          }), `evict worker ${w.worker_id}? (it may register again)`));
        cell.append(evict);
      }
      row.append(cell);
      return row;
    })
  );
}

function roundSeconds(i) {
  return i > 0 ? run.rounds[i].at - run.rounds[i - 1].at : null;
}

function renderRounds() {
  const body = document.querySelector("#rounds tbody");
  const first = Math.max(0, run.rounds.length - 20);
  const rows = [];
  for (let i = run.rounds.length - 1; i >= first; i--) {
    const r = run.rounds[i];
    const previous = i > 0 ? run.rounds[i - 1] : { bytes_in: 0, bytes_out: 0 };
    const row = el("tr", null, { "data-round": r.round });
    row.append(
      el("td", r.round),
      el("td", new Date(r.at * 1000).toLocaleTimeString()),
      el("td", r.contributions),
      el("td", r.live_workers),
      el("td", fixed(roundSeconds(i), 2)),
      el("td", fixed(r.seconds, 3)),
      el("td", fixed((r.bytes_in - previous.bytes_in) / 1e6, 2)),
      el("td", fixed((r.bytes_out - previous.bytes_out) / 1e6, 2))
    );
    rows.push(row);
  }
  body.replaceChildren(...rows);
}

function chart(id, names, data) {
  const key = id + ":" + names.join(",");
  const target = document.getElementById(id);
  if (run.charts[id] && run.charts[id].key === key) {
    run.charts[id].plot.setData(data);
    return;
  }
  if (run.charts[id]) run.charts[id].plot.destroy();
  const width = Math.max(320, target.clientWidth || 420);
  const series = [{ label: "round" }].concat(
    names.map((name, i) => ({ label: name, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))
  );
  const plot = new uPlot({ width, height: 220, series, scales: { x: { time: false } } }, data, target);
  run.charts[id] = { key, plot };
}

function renderCharts() {
  const x = run.rounds.map((r) => r.round);
  const workerIds = [...new Set(run.workers.map((w) => w.worker_id))].sort();
  const lossAt = new Map(run.workers.map((w) => [w.round + ":" + w.worker_id, w.loss]));
  chart("chart-loss", workerIds, [x, ...workerIds.map((id) => x.map((r) => lossAt.get(r + ":" + id) ?? null))]);
  const delta = (field) => run.rounds.map((r, i) => (r[field] - (i > 0 ? run.rounds[i - 1][field] : 0)) / 1e6);
  chart("chart-bytes", ["MB in", "MB out"], [x, delta("bytes_in"), delta("bytes_out")]);
  chart("chart-time", ["round s", "outer step s"], [x, run.rounds.map((_, i) => roundSeconds(i)), run.rounds.map((r) => r.seconds)]);
  chart("chart-workers", ["contributions", "live workers"], [x, run.rounds.map((r) => r.contributions), run.rounds.map((r) => r.live_workers)]);
}

async function poll() {
  let more = false; // a full page of history: fetch the next one at once
  try {
    const data = await call("GET", `/v1/dashboard?after=${run.last}`);
    more = data.history.rounds.length >= HISTORY_PAGE;
    run.rounds.push(...data.history.rounds);
    run.workers.push(...data.history.workers);
    if (run.rounds.length) run.last = run.rounds[run.rounds.length - 1].round;
    renderSummary(data.status);
    renderWorkers(data.status);
    renderRounds();
    renderCharts();
    document.body.dataset.round = String(data.status.round);
  } catch (error) {
    say(error.message);
  } finally {
    setTimeout(poll, more ? 0 : POLL_MS);
  }
}

async function act(what, action, question) {
  if (question && !window.confirm(question)) return;
  try {
    await action();
    say(`${what}: done`);
  } catch (error) {
    say(`${what}: ${error.message}`);
  }
}

document.getElementById("pause").addEventListener("click", () => act("pause", () => call("POST", "/v1/admin/pause")));
document.getElementById("resume").addEventListener("click", () => act("resume", () => call("POST", "/v1/admin/resume")));
document.getElementById("set-lr").addEventListener("click", () => {
  const lr = Number(document.getElementById("lr").value);
  act(`outer lr ${lr}`, () => call("PUT", "/v1/admin/outer-lr", { outer_lr: lr }));
});
if (document.body.dataset.openServer) document.getElementById("logout").hidden = true;
poll();
