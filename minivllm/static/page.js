"use strict";
// mini-vLLM's page: a chat on /v1/chat/completions, and the engine live from the snapshots of /live/events.
// A user's text is only ever set as textContent. The model's answer is Markdown, rendered as it streams by marked
// (shipped beside this file): any HTML in it stays text, DOMPurify keeps only safe elements and attributes of what
// marked made, and the result goes in as DOM nodes, never as a string of HTML.
const $ = (id) => document.getElementById(id);
const page = { messages: [], controller: null, events: 0, last: null };
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

// Server-sent events read from a fetch response (EventSource cannot send a key): onData gets each `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const lines = buf.slice(0, end).split("\n").filter((l) => l.startsWith("data:"));
      buf = buf.slice(end + 2);
      const data = lines.map((l) => l.slice(l.startsWith("data: ") ? 6 : 5)).join("\n");
      if (lines.length) onData(data);
    }
  }
}

async function errorText(r) {
  const text = await r.text();
  try { return JSON.parse(text).error.message; } catch (e) { return `${r.status} ${text.slice(0, 200)}`; }
}

// ---- the chat pane ------------------------------------------------------------------------------------------
const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);
marked.use({ gfm: true, renderer: { html: (token) => escapeHtml(token.text) } });  // HTML in Markdown: as text

// The answer so far as Markdown: code blocks with their language, lists, inline code, tables.
function renderMarkdown(el, text) {
  const nodes = DOMPurify.sanitize(marked.parse(text), { RETURN_DOM_FRAGMENT: true });
  for (const code of nodes.querySelectorAll("pre > code[class^='language-']")) {
    code.parentElement.dataset.lang = code.className.slice("language-".length);
  }
  el.replaceChildren(nodes);
}

function addMessage(role, text) {
  const box = document.createElement("div");
  const who = document.createElement("div");
  const body = document.createElement("div");
  box.className = `msg ${role}`;
  who.className = "who";
  who.textContent = role;
  body.className = "text";
  body.textContent = text;
  box.append(who, body);
  $("messages").append(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return body;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function number(id) {
  const x = parseFloat($(id).value);
  return Number.isFinite(x) ? x : undefined;
}

// Send `text` as the next user message and stream the answer in; `extra` joins the request's body.
async function send(text, extra = {}) {
  if (page.controller || !text) return;
  page.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.parentElement.classList.add("streaming");
  const body = { model: $("model").value || undefined, messages: page.messages, stream: true,
                 temperature: number("temperature"), max_tokens: number("max-tokens"), ...extra };
  page.controller = new AbortController();
  setBusy(true);
  $("chat-status").textContent = "generating…";
  let reply = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: page.controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = (chunk.choices || [])[0] || {};
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        renderMarkdown(out, reply);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
      if (choice.finish_reason) $("chat-status").textContent = `finished (${choice.finish_reason})`;
    });
  } catch (e) {
    const stopped = e.name === "AbortError";
    $("chat-status").textContent = stopped ? "stopped" : `error: ${e.message}`;
    if (!stopped) out.parentElement.classList.add("error");
  } finally {
    page.messages.push({ role: "assistant", content: reply });
    out.parentElement.classList.remove("streaming");
    page.controller = null;
    setBusy(false);
  }
}

async function loadModels() {
  const r = await fetch("/v1/models");
  if (!r.ok) return;
  for (const m of (await r.json()).data) {
    const option = document.createElement("option");
    option.value = option.textContent = m.id;
    $("model").append(option);
  }
}

// ---- the engine pane ----------------------------------------------------------------------------------------
const FREE = -1, CACHED = -2, HELD = -3;
const colour = (id) => `hsl(${(id * 137.508) % 360}, 62%, 52%)`;
const fill = (v) => v === FREE ? "#e6e6ea" : v === CACHED ? "#b9dcc0" : v === HELD ? "#8a8a90" : colour(v);

// What a cell of several blocks shows: the sequence holding most of them, else held, else kept, else free.
function cellMark(marks) {
  const count = new Map();
  for (const m of marks) count.set(m, (count.get(m) || 0) + 1);
  const seqs = [...count].filter(([m]) => m >= 0).sort((a, b) => b[1] - a[1]);
  if (seqs.length) return seqs[0][0];
  return count.has(HELD) ? HELD : count.has(CACHED) ? CACHED : FREE;
}

// The pool on a canvas of at most GRID_AREA pixels: a cell per block while cells stay MIN_CELL pixels or more,
// else several blocks a cell (the legend says how many), so that the bundled model's 10,922 blocks stay readable.
const GRID_AREA = 560 * 300, MIN_CELL = 8;
function drawGrid(pool) {
  const canvas = $("grid"), ctx = canvas.getContext("2d");
  const per = Math.max(1, Math.ceil((pool.n * MIN_CELL * MIN_CELL) / GRID_AREA));  // blocks a cell
  const cells = Math.ceil(pool.n / per);
  const cell = Math.max(MIN_CELL, Math.min(18, Math.floor(Math.sqrt(GRID_AREA / cells))));
  const cols = Math.floor(canvas.width / cell), gap = 1;
  canvas.height = Math.ceil(cells / cols) * cell;
  const marks = new Array(pool.n);
  for (let i = 0, b = 0; i < pool.grid.length; i += 2) marks.fill(pool.grid[i], b, (b += pool.grid[i + 1]));
  const at = (c) => [(c % cols) * cell, Math.floor(c / cols) * cell];
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  for (let c = 0; c < cells; c++) {
    ctx.fillStyle = fill(per === 1 ? marks[c] : cellMark(marks.slice(c * per, (c + 1) * per)));
    ctx.fillRect(...at(c), cell - gap, cell - gap);
  }
  ctx.strokeStyle = "#111";
  for (const c of new Set(pool.shared.map((b) => Math.floor(b / per)))) {
    ctx.strokeRect(at(c)[0] + 0.5, at(c)[1] + 0.5, cell - gap - 1, cell - gap - 1);
  }
  Object.assign(canvas.dataset, { held: pool.n - pool.free, per, cell });
  $("grid-scale").textContent = per === 1 ? "a cell per block" : `${per} blocks a cell`;
}

function chip(cls, id, text) {
  const el = document.createElement("span"), sw = document.createElement("i");
  el.className = cls;
  sw.style.background = colour(id);
  el.append(sw, text);
  return el;
}

function drawQueue(el, seqs) {
  const text = (s) => `#${s.id}: ${s.len} / ${s.prompt}, ${s.computed}, ${s.blocks} blk`
    + (s.preempted ? `, preempted ${s.preempted}` : "");
  const none = Object.assign(document.createElement("span"), { className: "empty", textContent: "none" });
  el.replaceChildren(...(seqs.length ? seqs.map((s) => chip("seq", s.id, text(s))) : [none]));
}

function drawSteps(steps) {
  $("steps").replaceChildren(...steps.slice().reverse().map((s) => {
    const line = document.createElement("div"), label = document.createElement("span");
    const rows = document.createElement("span");
    line.className = "step";
    label.className = "label";
    label.textContent = `step ${s.step} · ${s.ms.toFixed(1)} ms`;
    rows.className = "rows";
    const row = ([id, n, prefill]) => chip(prefill ? "row prefill" : "row", id, prefill ? `#${id} ×${n}` : `#${id}`);
    rows.append(...s.rows.map(row));
    line.append(label, rows);
    return line;
  }));
}

function draw(snap) {
  const t = snap.totals, pool = snap.blocks;
  page.events += 1;
  page.last = snap;
  document.body.dataset.events = page.events;
  $("s-tps").textContent = snap.tokens_per_s.toFixed(1);
  $("s-step").textContent = t.steps;
  $("s-running").textContent = snap.running.length;
  $("s-waiting").textContent = snap.waiting.length;
  $("s-used").textContent = pool.n - pool.free;
  $("s-preempt").textContent = t.preemptions;
  const rate = t.prefix_queries ? Math.round((100 * t.prefix_hits) / t.prefix_queries) : 0;
  $("s-prefix").textContent = `${t.prefix_hits} (${rate}%)`;
  $("pool").textContent = `(${pool.n} blocks of ${pool.size} tokens, ${pool.free} free)`;
  drawGrid(pool);
  drawQueue($("running"), snap.running);
  drawQueue($("waiting"), snap.waiting);
  drawSteps(snap.steps);
}

function connection(text, cls) {
  $("conn").textContent = text;
  $("conn").className = `conn ${cls}`;
}

// Watch the engine for as long as the page is open; on any break, wait a second and connect again.
async function watch() {
  for (;;) {
    try {
      const r = await fetch("/live/events", { cache: "no-store" });
      if (!r.ok) throw new Error(await errorText(r));
      connection("engine: live", "ok");
      await readEvents(r, (data) => draw(JSON.parse(data)));
      connection("engine: stream ended, reconnecting", "warn");
    } catch (e) {
      connection(`engine: ${e.message}; reconnecting`, "bad");
    }
    await sleep(1000);
  }
}

function start() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => page.controller && page.controller.abort());
  $("clear").addEventListener("click", () => { page.messages = []; $("messages").replaceChildren(); });
  loadModels();
  watch();
}

window.minivllm = { send, page };
start();
