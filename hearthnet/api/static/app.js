// HearthNet status page: polls /api/status, draws the chats running now, every node of the
// community, coverage and shard health, and streams a chat through /v1/chat/completions.
// Plain JS, no build step, no network beyond this node. A card for a feature not in use
// (automatic hosting on a hand-written mesh) stays hidden.
"use strict";
const POLL_MS = 2000;
const POLL_RUNNING_MS = 1000;  // while a chat runs: its tokens and tok/s move every second
let running = false;
let apiKey = localStorage.getItem("hearthnet-api-key") || "";
const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k);
  return e;
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

function shortShard(id) { return String(id).split(":").pop(); }  // "0-14@node-b"
function pct(n, total) { return (100 * n / total).toFixed(3) + "%"; }
function fmt(v, digits) { return v === null || v === undefined ? "–" :
  (typeof v === "number" ? v.toFixed(digits) : String(v)); }

function coverageBar(m) {
  const bar = el("div", {class: "bar coverage"});
  for (const row of m.coverage) {
    const [lo, hi] = row.layers;
    const kind = row.hosts.length === 0 ? "gap" : row.hosts.length > 1 ? "spare" : "one";
    const label = `${lo}–${hi} ` + (row.hosts.length ? row.hosts.join(" + ") : "no host");
    bar.append(el("div", {class: "seg " + kind, "data-kind": kind, title: label,
      style: `left:${pct(lo, m.num_layers)};width:${pct(hi - lo + 1, m.num_layers)}`}, label));
  }
  return bar;
}

function lanes(m, shards) {
  const box = el("div", {class: "lanes"});
  for (const s of shards.filter((s) => s.model_id === m.model_id)) {
    const [lo, hi] = s.layers;
    const state = s.state || (s.suspect ? "suspect" : "online");
    const lane = el("div", {class: "lane", "data-shard": s.shard_id, "data-host": s.host,
      "data-state": state});
    lane.append(el("div", {class: "lane-fill " + state, title: s.reason || state,
      style: `left:${pct(lo, m.num_layers)};width:${pct(hi - lo + 1, m.num_layers)}`},
      `${s.host} ${lo}–${hi} ${state}`));
    box.append(lane);
  }
  return box;
}

function renderModels(st) {
  const box = $("models");
  box.replaceChildren();
  if (!st.models.length) box.append(el("p", {class: "muted"}, "no stored models"));
  for (const m of st.models) {
    const badge = m.fully_covered ? el("span", {class: "badge"}, "fully covered")
      : el("span", {class: "badge bad"}, "gaps: layers " +
        m.uncovered.map(([a, b]) => `${a}–${b}`).join(", "));
    box.append(el("div", {class: "model", "data-model": m.alias,
        "data-covered": String(m.fully_covered)},
      el("div", {class: "model-title"}, `${m.alias} `,
        el("span", {class: "muted"}, `${m.num_layers} layers`), badge,
        el("span", {class: "muted spec"}, speculationNote(m.speculative)),
        el("span", {class: "muted head-step", title: headTitle(m.head_step)},
          headNote(m.head_step))),
      coverageBar(m), lanes(m, st.shards),
      el("div", {class: "axis"}, el("span", {}, "layer 0"),
        el("span", {}, `layer ${m.num_layers - 1}`))));
  }
  const sel = $("chat-model");
  const want = st.models.map((m) => m.alias).join(",");
  if (sel.dataset.models !== want) {
    sel.replaceChildren(...st.models.map((m) => el("option", {value: m.alias}, m.alias)));
    sel.dataset.models = want;
  }
}

function renderShards(st) {
  const body = $("shards").querySelector("tbody");
  body.replaceChildren();
  for (const s of st.shards) {
    const state = s.state || (s.suspect ? "suspect" : "online");
    const td = (label, cls, ...kids) => el("td", {"data-label": label, class: cls || ""},
      ...kids);
    body.append(el("tr", {class: "shard-row", "data-shard": s.shard_id, "data-state": state},
      td("Shard", "name", el("span", {title: s.shard_id}, shortShard(s.shard_id))),
      td("Host", "", s.host),
      td("Layers", "", `${s.layers[0]}–${s.layers[1]}`),
      td("State", "state-" + state, state,
        s.reason ? el("span", {class: "reason"}, s.reason) : null,
        s.unusable_reason ? el("span", {class: "reason"}, "not used by calls: " +
          s.unusable_reason) : null),
      td("p95 ms", "", fmt(s.p95_latency_ms, 1)), td("Queue", "", fmt(s.queue_depth, 0)),
      td("Sessions", "", sessions(s)), td("Format", "",
        s.advertised_format && s.advertised_format !== s.format
          ? `${s.format} (advertised ${s.advertised_format})`
          : fmt(s.kernel ? `${s.format} (${s.kernel})` : s.format)),
      td("Memory MB", "", fmt(s.memory_mb, 0)), td("Device", "", fmt(s.device))));
  }
  if (!st.shards.length) body.append(el("tr", {}, el("td", {colspan: "10", class: "muted"},
    "no live shard advertisements")));
}

function sessions(s) {
  // this node's own shard counts live; another's as of its last heartbeat, plus the
  // sessions this node's chats hold on it now
  const n = el("span", {class: "sessions", "data-live": String(!!s.sessions_live),
    title: s.sessions_live ? "open sessions now" : "as of the shard's last heartbeat"},
    fmt(s.active_sessions, 0));
  if (s.sessions_from_here) n.append(el("span", {class: "muted"},
    ` (${s.sessions_from_here} from here)`));
  return n;
}

function renderPlacement(st) {
  // automatic hosting (DESIGN.md decision 14): the served-model list, who chose which
  // layers and why, last re-host/rebalance — only where some node hosts automatically or
  // a served-model list is set
  const p = st.placement;
  $("placement-card").hidden = !(p && p.in_use);
  if (!p || !p.in_use) return;
  const when = (t) => new Date(t * 1000).toLocaleTimeString();
  const items = [el("li", {}, "served models: " + (p.served_models.map((m) => m.alias ||
    m.model_id).join(", ") || "none") + (p.set_by ? ` (set by ${p.set_by})` : ""))];
  for (const s of st.shards.filter((s) => s.auto))
    items.push(el("li", {class: "auto-host", "data-host": s.host},
      `${s.host} layers ${s.layers[0]}–${s.layers[1]}: ${s.auto.detail || s.auto.reason}`));
  for (const kind of ["rehost", "rebalance"]) {
    const c = p["last_" + kind];
    items.push(el("li", {class: "last-" + kind}, `last ${kind}: ` + (c ? `${c.host} took ` +
      `layers ${c.layers[0]}–${c.layers[1]} at ${when(c.at)} — ${c.detail}` : "never")));
  }
  $("placement").replaceChildren(...items);
}

function mib(b) { return b === null || b === undefined ? "–" : (b / 1048576).toFixed(1); }

function renderFetches(st) {
  // model fetches in progress or just ended (/api/status `fetches`): nothing when none
  const fs = st.fetches || [];
  $("fetches-card").hidden = fs.length === 0;
  $("fetches").replaceChildren(...fs.map((f) => {
    const what = f.head ? "head" + (f.layers ? ` + layers ${f.layers[0]}–${f.layers[1]}` : "")
      : `layers ${f.layers[0]}–${f.layers[1]}`;
    const share = f.bytes_total ? ` (${(100 * f.bytes_done / f.bytes_total).toFixed(0)} %)` : "";
    return el("li", {class: "fetch", "data-state": f.state}, `${f.model} ${what}: ${f.state} ` +
      `${mib(f.bytes_done)} / ${mib(f.bytes_total)} MiB${share} from ` +
      `${(f.sources || []).join(", ") || "–"}` + (f.detail ? ` — ${f.detail}` : ""));
  }));
}

function planModels(st) {
  // the served list where a steward set one, else the stored models; the choice is kept
  const p = st.placement || {}, sel = $("plan-model");
  const names = (p.served_models || []).length ? p.served_models.map((m) => m.alias ||
    m.model_id) : (st.models || []).map((m) => m.alias);
  if (sel.dataset.names === names.join("\n")) return;
  sel.dataset.names = names.join("\n");
  const keep = sel.value;
  sel.replaceChildren(...names.map((n) => el("option", {value: n}, n)));
  if (names.includes(keep)) sel.value = keep;
}

async function plan(ev) {
  // a plan only when asked: it reads headers and may time a layer on the node
  ev.preventDefault();
  const out = $("plan"), model = $("plan-model").value;
  if (!model) return;
  out.dataset.state = "planning"; out.replaceChildren(el("p", {class: "muted"}, "planning…"));
  try {
    const r = await fetch("/api/plan?model=" + encodeURIComponent(model),
      {headers: headers(), cache: "no-store"});
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.status);
    const p = body.plan;
    const rows = p.nodes.map((n) => el("tr", {"data-node": n.node},
      el("td", {}, n.node + (n.orchestrator ? " (head)" : "")),
      el("td", {}, n.layers.map((r) => `${r[0]}–${r[1]}`).join(", ") || "–"),
      el("td", {}, mib(n.held_bytes)), el("td", {}, mib(n.budget_bytes)),
      el("td", {}, mib(n.fetch_bytes)), el("td", {title: n.speed_source}, fmt(n.speed, 0)),
      el("td", {}, n.fits ? "yes" : "no")));
    const table = el("table", {id: "plan-nodes"}, el("thead", {}, el("tr", {},
      ...["Node", "Layers", "Holds MiB", "Budget MiB", "Fetch MiB", "Layer steps/s", "Fits"]
        .map((h) => el("th", {}, h)))), el("tbody", {}, ...rows));
    const verdict = p.fits ? "fits" : "does not fit: " + p.problems.join("; ");
    const speed = p.single_chat_tokens_per_s === null ? p.chats_8_source :
      `predicted ${fmt(p.single_chat_tokens_per_s, 1)} tok/s for one chat, ` +
      `${fmt(p.chats_8_tokens_per_s, 1)} tok/s in all for 8 (${p.chats_8_source}); ` +
      `hop ${fmt(p.hop_ms, 2)} ms (${p.hop_source})`;
    out.replaceChildren(el("p", {id: "plan-verdict"}, `${model} as ${p.weights}: ${verdict}`),
      el("div", {class: "scroll"}, table), el("p", {id: "plan-speed", class: "muted"}, speed));
    out.dataset.state = "done";
  } catch (e) {
    out.dataset.state = "error";
    out.replaceChildren(el("p", {}, "plan failed: " + e.message));
  }
}

function renderNodes(st) {
  // every member node, not only this node's gossip links (a node known through a relay
  // has no link here)
  const body = $("nodes").querySelector("tbody");
  const td = (label, cls, ...kids) => el("td", {"data-label": label, class: cls || ""},
    ...kids);
  body.replaceChildren(...(st.nodes || []).map((n) => {
    const hosts = n.hosts.length ? n.hosts.map((h) => `${h.model_id.split("/").pop()} ` +
      `${h.layers[0]}–${h.layers[1]}` + (h.auto ? " (auto)" : "")).join(", ")
      : el("span", {class: "muted"}, "nothing");
    const link = n.self ? el("span", {class: "muted"}, "this node")
      : n.link ? `${n.link.connected ? "up" : "down"}` +
        (n.link.direction === "in" ? " (incoming)" : " (dialled)")
      : el("span", {class: "muted"}, n.state === "unknown" ? "none (heard through others)"
        : "none");
    return el("tr", {class: "node-row", "data-node": n.node_id, "data-state": n.state,
        "data-self": String(n.self)},
      td("Node", "name", n.node_id, n.self ? el("span", {class: "badge"}, "this node") : null,
        n.trust ? el("span", {class: "muted"}, ` ${n.trust}`) : null),
      td("State", "state-" + n.state, n.state,
        n.reason ? el("span", {class: "reason"}, n.reason) : null),
      td("Hosts", "", hosts), td("Gossip link", "", link));
  }));
}

function renderRunning(st) {
  // the chats this node orchestrates now: tokens, tok/s, path or local fallback
  const calls = st.running_calls || [];
  $("running").replaceChildren(...(calls.length ? calls.map((c) => {
    const path = c.fallback ? "local fallback" : c.path.length ?
      c.path.map(shortShard).join(" → ") : "choosing shards";
    return el("li", {class: "running-call", "data-call": String(c.call_id),
        "data-state": c.state, "data-fallback": String(c.fallback),
        "data-tokens": String(c.tokens), "data-tps": String(c.tokens_per_s)},
      el("b", {}, c.model), ` · ${c.state} · ${c.tokens} tokens · `,
      el("b", {class: "tps"}, `${fmt(c.tokens_per_s, 1)} tok/s`),
      ` · via `, el("span", {class: "path"}, path),
      ` · ${c.failovers} failover(s) · started ` +
        new Date(c.started_at * 1000).toLocaleTimeString() + ` (${fmt(c.elapsed_s, 0)} s ago)`,
      c.fallback && c.fallback_reason ? el("span", {class: "reason"},
        "fell back: " + c.fallback_reason) : null);
  }) : [el("li", {class: "muted"}, "no chat running")]));
}

function speculationNote(byMode) {
  // proposals this node's calls verified (DESIGN.md decision 16), per proposer
  const parts = Object.entries(byMode || {}).filter(([, s]) => s.proposed > 0).map(
    ([mode, s]) => `${mode}: ${s.accepted}/${s.proposed} proposals accepted, ` +
      `${fmt(1 + s.accepted / Math.max(1, s.passes), 2)} tokens/pass`);
  return parts.length ? " · " + parts.join("; ") : "";
}

function headNote(steps) {
  // how this node's head runs (M26 §5.7): compiled, or eager (the reason in the title)
  const parts = Object.entries(steps || {}).map(([kind, st]) => `${kind} ${st.split(" ")[0]
    .replace(/:$/, "")}`);
  return parts.length ? " · head " + parts.join(", ") : "";
}

function headTitle(steps) {
  return Object.entries(steps || {}).map(([kind, st]) => `${kind}: ${st}`).join("\n");
}

function formatsNote(f) {
  // what served the answer: a compact format's answer must not read as an exact one
  if (!f || f.lossless === undefined) return "";
  const uniq = (xs) => [...new Set(xs || [])].join("/");
  return ` · layers ${uniq(f.stages)}, head ${f.head}` +
    (f.wire && f.wire.length ? `, wire ${uniq(f.wire)}` : "") +
    (f.lossless ? " · lossless" : " · LOSSY (a compact format was asked for)");
}

function describe(ev) {
  const when = new Date(ev.time * 1000).toLocaleTimeString();
  if (ev.type === "shard_failover")
    return `${when} failover: ${shortShard(ev.failed)} → ${ev.replacement.map(shortShard)
      .join(", ") || "?"} (${fmt(ev.ms, 0)} ms, replayed ${ev.replayed_positions} positions)`;
  if (ev.type === "pipeline_aborted")
    return `${when} pipeline gave up` + (ev.continuing ? `, continued ${ev.continuing}` : "") +
      `: ${ev.reason}`;
  return `${when} ${shortShard(ev.shard_id)} degraded: ${ev.code} ${ev.message || ""}`;
}

function renderEvents(st) {
  const evs = (st.recent_events || []).slice().reverse();
  $("events").replaceChildren(...(evs.length ? evs.map((e) => el("li",
    {class: "event", "data-type": e.type}, describe(e))) : [el("li", {class: "muted"}, "none")]));
}

async function refresh() {
  try {
    const r = await fetch("/api/status", {headers: headers(), cache: "no-store"});
    if (r.status === 401) { $("auth").hidden = false; $("node").textContent = "API key needed";
      return; }
    const st = await r.json();
    $("auth").hidden = true;
    $("node").textContent = `node ${st.node_id} · ${st.endpoint}` +
      (st.api ? ` · API ${st.api}/v1` : "");
    running = (st.running_calls || []).length > 0;
    renderRunning(st); renderNodes(st); renderModels(st); renderShards(st);
    renderPlacement(st); renderEvents(st); renderFetches(st); planModels(st);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.refreshed = String(Date.now());
  } catch (e) {
    $("updated").textContent = "node unreachable: " + e;
  }
}

async function chat(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  const out = $("answer"), facts = $("answer-facts"), btn = $("send");
  out.textContent = ""; facts.textContent = ""; btn.disabled = true;
  out.dataset.state = "streaming";
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST",
      headers: headers({"Content-Type": "application/json"}),
      body: JSON.stringify({model: $("chat-model").value, stream: true, temperature: 0,
        max_tokens: 128, messages: [{role: "user", content: prompt}]})});
    if (!r.ok) { const e = await r.json(); throw new Error(e.error ? e.error.message : r.status); }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.code + ": " + chunk.error.message);
        for (const c of chunk.choices || []) if (c.delta && c.delta.content)
          out.textContent += c.delta.content;
        if (chunk.hearthnet) {
          const h = chunk.hearthnet, t = h.timings || {};
          facts.textContent = `via ${h.fallback ? "local fallback" :
            h.pipeline.map(shortShard).join(" → ")} · first token ${fmt(t.first_token_ms, 0)} ms` +
            ` · ${fmt(t.tokens_per_second, 1)} tok/s · ${h.failovers} failover(s)` +
            (h.speculative && h.speculative.proposed ? ` · ${fmt(h.speculative.tokens_per_pass, 1)}` +
              ` tokens/pass (${h.speculative.mode}, ${h.speculative.accepted}/` +
              `${h.speculative.proposed} accepted)` : "") + formatsNote(h.formats);
        }
      }
    }
    out.dataset.state = "done";
  } catch (e) {
    out.dataset.state = "error";
    facts.textContent = "error: " + e.message;
  } finally {
    btn.disabled = false;
    refresh();
  }
}

$("chat-form").addEventListener("submit", chat);
$("plan-form").addEventListener("submit", plan);
$("auth-form").addEventListener("submit", (e) => {
  e.preventDefault(); apiKey = $("key").value.trim();
  localStorage.setItem("hearthnet-api-key", apiKey); refresh();
});
async function poll() {
  await refresh();
  setTimeout(poll, running ? POLL_RUNNING_MS : POLL_MS);
}
poll();
