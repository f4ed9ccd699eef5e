// The live page: polls /ui/state every 0.5 s and draws the relay tree (inline SVG, one band per region)
// and a table of nodes. Everything comes from this origin; the state's layout (x, y in [0, 1]) is
// computed on the node (p2psync/ui/state.py), so this script only draws.
"use strict";

const POLL_MS = 500;
const SVG = "http://www.w3.org/2000/svg";
const BOX_W = 118, BOX_H = 50, ROW_H = 110, TOP = 34, WIDTH = 1100;

function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (parent) parent.appendChild(e);
  return e;
}

function text(parent, x, y, cls, s) {
  const t = el("text", { x, y, class: cls }, parent);
  t.textContent = s;
  return t;
}

function bytes(n) {
  if (n === null || n === undefined) return "";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + u[i];
}

function version(v) { return v === null || v === undefined ? "\u2013" : "v" + v; }

function transferText(n) {
  if (!n.transfers || !n.transfers.length) return "";
  return n.transfers.map((t) => `${t.chunks_held}/${t.chunks} chunks (${Math.round(100 * t.fraction)} %)`).join(", ");
}

function drawTree(svg, state) {
  const nodes = state.nodes;
  const levels = Math.max(1, state.rows || 1);
  const height = TOP + levels * ROW_H;
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${height}`);
  svg.replaceChildren();
  const bands = el("g", { class: "bands" }, svg);
  state.regions.forEach((b, i) => {
    el("rect", { class: "band" + (i % 2 ? " odd" : ""), x: b.x0 * WIDTH, y: 0, width: (b.x1 - b.x0) * WIDTH, height }, bands);
    const label = text(bands, (b.x0 + b.x1) / 2 * WIDTH, 20, "band-label", `${b.name} (${b.nodes})`);
    label.setAttribute("data-region", b.name);
  });
  const pos = {};
  for (const n of nodes) pos[n.id] = [n.x * WIDTH, TOP + n.y * (height - TOP)];
  const region = Object.fromEntries(nodes.map((n) => [n.id, n.region]));
  const edges = el("g", { class: "edges" }, svg);
  for (const n of nodes) {
    if (!n.parent || !pos[n.parent]) continue;
    const [x1, y1] = pos[n.parent], [x2, y2] = pos[n.id];
    const my = (y1 + y2) / 2;
    el("path", {
      class: "edge" + (region[n.parent] !== n.region ? " cross" : ""),
      d: `M ${x1} ${y1 + BOX_H / 2} C ${x1} ${my}, ${x2} ${my}, ${x2} ${y2 - BOX_H / 2}`,
      "data-edge": `${n.parent}->${n.id}`,
    }, edges);
  }
  const perRow = {};
  for (const n of nodes) { const k = n.region + "|" + n.y; perRow[k] = (perRow[k] || 0) + 1; }
  const group = el("g", { class: "nodes" }, svg);
  for (const n of nodes) {
    const band = state.regions.find((b) => b.name === n.region);
    const room = band ? (band.x1 - band.x0) * WIDTH / perRow[n.region + "|" + n.y] : BOX_W;
    const w = Math.max(60, Math.min(BOX_W, room - 8));
    const [x, y] = pos[n.id];
    const behind = state.head !== null && n.version !== state.head;
    const role = ["trainer", "relay", "rollout"].includes(n.role) ? n.role : "unknown";
    const g = el("g", {
      class: `node ${role} ${n.status}` + (behind ? " behind" : ""),
      "data-node": n.id, "data-version": n.version === null || n.version === undefined ? "" : n.version,
      "data-region": n.region, "data-role": n.role, "data-status": n.status,
      transform: `translate(${x - w / 2} ${y - BOX_H / 2})`,
    }, group);
    el("title", {}, g).textContent =
      `${n.id} (${n.role}, ${n.region})\n${n.address || "address unknown"}\nstatus: ${n.status}` +
      (n.error ? `\n${n.error}` : "") + (n.transfers.length ? `\n${transferText(n)}` : "");
    el("rect", { class: "box", width: w, height: BOX_H, rx: 6 }, g);
    text(g, w / 2, 17, "id", n.id.length > 16 ? n.id.slice(0, 15) + "\u2026" : n.id);
    text(g, w / 2, 33, "version", version(n.version) + (n.status === "alive" || n.status === "seen" ? "" : " \u00b7 " + n.status));
    if (n.progress !== null && n.progress !== undefined) {
      el("rect", { class: "bar-bg", x: 6, y: 40, width: w - 12, height: 5 }, g);
      el("rect", { class: "bar", x: 6, y: 40, width: (w - 12) * n.progress, height: 5, "data-progress": n.progress.toFixed(3) }, g);
    }
  }
}

function drawTable(tbody, state) {
  const band = Object.fromEntries(state.regions.map((b, i) => [b.name, i]));
  const rows = state.nodes.slice().sort((a, b) => band[a.region] - band[b.region] || a.y - b.y || a.x - b.x);
  tbody.replaceChildren(...rows.map((n) => {
    const tr = document.createElement("tr");
    tr.dataset.row = n.id;
    const behind = state.head !== null && n.version !== state.head;
    const cells = [n.id, n.region, n.role, version(n.version), transferText(n), n.parent || "",
      bytes(n.bytes_in), bytes(n.bytes_out), n.status + (n.error ? ` (${n.error})` : "")];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = c;
      if (i === 3 && behind) td.className = "behind";
      if (i === 8) td.className = "status-" + n.status;
      tr.appendChild(td);
    });
    return tr;
  }));
}

function render(state) {
  drawTree(document.getElementById("tree"), state);
  drawTable(document.querySelector("#nodes tbody"), state);
  const me = state.nodes.find((n) => n.id === state.self);
  document.getElementById("summary").textContent =
    `${state.self} (trainer) at ${version(state.head)} \u00b7 ${state.in_sync}/${state.nodes.length} nodes at that version` +
    (state.oldest !== null && state.oldest !== state.head ? ` \u00b7 oldest ${version(state.oldest)}` : "") +
    (state.source === "cluster" ? "" : " \u00b7 (no membership service: children seen by the trainer)") +
    (me && me.transfers.length ? ` \u00b7 ${transferText(me)}` : "");
  document.getElementById("updated").textContent = "updated " + new Date(state.now * 1000).toLocaleTimeString();
  document.body.dataset.head = state.head === null ? "" : state.head;
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

function showError(message) {
  const box = document.getElementById("error");
  box.textContent = message;
  box.hidden = !message;
}

async function poll() {
  try {
    const resp = await fetch("/ui/state", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) {
      showError("Not signed in (or the cluster token changed): open /ui?token=<cluster token> once.");
    } else if (!resp.ok) {
      showError(`The trainer answered HTTP ${resp.status}.`);
    } else {
      render(await resp.json());
      showError("");
    }
  } catch (err) {
    showError(`Cannot reach the trainer node: ${err}`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
