"""`hearthnet status --config FILE [--json]`: the mesh as the configured node sees it."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="nodes, shards and layer coverage")
    p.add_argument("--config", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hearthnet.commands.remote import http_get_json
    from hearthnet.node.admin import node_uri

    st = http_get_json(node_uri(args.config), "/status")
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(render(st))
    return 0


def _device(s: dict[str, Any]) -> str:
    """e.g. `cuda NVIDIA H100 80GB HBM3 (81559 MiB; shard 3120 MiB)` (DESIGN.md decision 11)."""
    name = s.get("device_name") or ""
    mem = f"{s.get('device_memory_mb', 0)} MiB; shard {s.get('vram_required_mb', 0)} MiB"
    return f"{s.get('device', 'cpu')} {name} ({mem})".replace("cpu cpu", "cpu")


def _format(s: dict[str, Any]) -> str:
    """e.g. `int8 (fbgemm)`: the held format and, quantised, the kernel it runs in."""
    fmt = s.get("format") or "-"
    if s.get("advertised_format") not in (None, fmt):  # its ACCEPT said otherwise: "int8!"
        return fmt + "!"
    return f"{fmt} ({s['kernel']})" if s.get("kernel") else fmt


def render(st: dict[str, Any]) -> str:
    """A table a person can read at a glance."""
    lines = [f"node {st['node_id']} at {st['endpoint']}"]
    peers = ", ".join(f"{p.get('node_id') or p['uri']} ({'up' if p['connected'] else 'down'}"
                      f"{', incoming' if p.get('direction') == 'in' else ''})"
                      for p in st.get("peers", [])) or "none"
    lines.append(f"peers: {peers}")
    if st.get("api"):
        lines.append(f"api: {st['api']}/v1   status page: {st['api']}/")
    lines += render_nodes(st) + render_chats(st)
    lines.append("")
    names = [s["shard_id"].split("/")[-1] for s in st["shards"]]
    wide = max([34, *map(len, names)])  # whole shard ids: they end in the host's id
    host_w = max([10, *(len(s["host"]) for s in st["shards"])])
    lines.append(f"{'SHARD':<{wide}} {'LAYERS':<8} {'HOST':<{host_w}} {'STATE':<8} "
                 f"{'FORMAT':<13} {'MEM MB':>7} {'SESS':>4} {'QUEUE':>5} {'P95 ms':>7} "
                 f"{'AGE s':>6}  DEVICE")
    for s, name in zip(st["shards"], names, strict=True):
        state = s.get("state") or ("suspect" if s["suspect"] else "online")
        lo, hi = s["layers"]
        lines.append(f"{name:<{wide}} {lo:>2}-{hi:<5} {s['host']:<{host_w}} {state:<8} "
                     f"{_format(s):<13} {s.get('memory_mb') or 0:>7} "
                     f"{s['active_sessions'] or 0:>4} {s['queue_depth'] or 0:>5} "
                     f"{(s['p95_latency_ms'] or 0):>7.1f} {s['age_s']:>6.1f}  {_device(s)}")
        if s.get("reason"):
            lines.append(f"    {state}: {s['reason']}")
        if s.get("unusable_reason"):  # live, but no call from here may use it
            lines.append(f"    not used by calls: {s['unusable_reason']}")
        if s.get("decode_step"):
            lines.append(f"    decode step: {s['decode_step']}")
    if not st["shards"]:
        lines.append("(no live shard advertisements)")
    lines.append("")
    for m in st["models"]:
        state = "FULLY COVERED" if m["fully_covered"] else \
            "NOT COVERED: layers " + ", ".join(f"{a}-{b}" for a, b in m["uncovered"])
        lines.append(f"model {m['alias']} ({m['model_id']}, {m['num_layers']} layers): {state}")
        if m.get("head_step"):
            lines.append("  head steps: " + "; ".join(f"{k} {v}" for k, v in
                                                       m["head_step"].items()))
        for row in m["coverage"]:
            a, b = row["layers"]
            lines.append(f"  layers {a:>2}-{b:<2}  {', '.join(row['hosts']) or '-'}")
    if st.get("placement") and st["placement"].get("in_use", True):
        lines += render_placement(st)
    lines += render_fetches(st)
    return "\n".join(lines)


def render_fetches(st: dict[str, Any]) -> list[str]:
    """Weights this node fetches (or fetched) from members (DESIGN.md decision 17)."""
    out = []
    for f in st.get("fetches") or []:
        what = []
        if f.get("layers"):
            what.append(f"layers {f['layers'][0]}-{f['layers'][1]}")
        if f.get("head"):
            what.append("head")
        total = int(f.get("bytes_total") or 0)
        done = int(f.get("bytes_done") or 0)
        pct = f"{100 * done / total:.0f} %" if total else "-"
        line = (f"fetch {f['model']} {' + '.join(what) or '-'}: {f['state']} {pct} "
                f"({done / 1e6:.1f} of {total / 1e6:.1f} MB) from "
                f"{', '.join(f.get('sources') or []) or '-'}")
        out.append(line + (f"  {f['detail']}" if f.get("detail") else ""))
    return ["", *out] if out else []


def render_nodes(st: dict[str, Any]) -> list[str]:
    """Every member node this one knows of, with its state and what it hosts."""
    nodes = st.get("nodes") or []
    if not nodes:
        return []
    lines = ["", "nodes:"]
    for n in nodes:
        hosts = ", ".join(f"{h['layers'][0]}-{h['layers'][1]}" for h in n.get("hosts", []))
        what = f"hosts layers {hosts}" if hosts else "hosts no layers"
        why = f" ({n['reason']})" if n.get("reason") else ""
        me = " (this node)" if n.get("self") else ""
        trust = f", {n['trust']}" if n.get("trust") else ""
        lines.append(f"  {n['node_id']}{me}: {n.get('state', '?')}{why}{trust}; {what}")
    return lines


def render_chats(st: dict[str, Any]) -> list[str]:
    """The chats this node is running now: tokens, speed and the path (or local)."""
    calls = st.get("running_calls") or []
    if not calls:
        return []
    lines = ["", "running chats:"]
    for c in calls:
        path = "local fallback" if c.get("fallback") else \
            " -> ".join(str(p).rsplit(":", 1)[-1] for p in c.get("path", [])) or "-"
        lines.append(f"  {c['model']}: {c.get('state', '?')}, {c.get('tokens', 0)} tokens, "
                     f"{c.get('tokens_per_s', 0):.1f} tok/s, via {path}")
    return lines


def render_placement(st: dict[str, Any]) -> list[str]:
    """Automatic hosting (DESIGN.md decision 14): who chose what and why, last moves."""
    p = st["placement"]
    served = ", ".join(m["alias"] or m["model_id"] for m in p["served_models"]) or "none"
    lines = ["", f"served models: {served}" + (f" (set by {p['set_by']})" if p.get("set_by")
                                                else "")]
    auto = [s for s in st["shards"] if s.get("auto")]
    if auto:
        lines.append("automatic hosts:")
        lines += [f"  {s['host']:<10} layers {s['layers'][0]}-{s['layers'][1]}: "
                  f"{s['auto'].get('detail', '')}" for s in auto]
    for kind in ("rehost", "rebalance"):
        c = p.get(f"last_{kind}")
        lines.append(f"last {kind}: " + (
            f"{c['host']} took layers {c['layers'][0]}-{c['layers'][1]} at "
            f"{_clock(c['at'])} ({_ago(c['at'], st['time'])}): {c['detail']}" if c else "never"))
    me = p.get("this_node")
    if me:
        down = ", ".join(me["down_hosts"]) or "none"
        lines.append(f"this node: automatic, budget {me['budget_mb']} MB ({me['format']}), "
                     f"unreachable hosts: {down}")
    return lines


def _clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _ago(ts: float, now: float) -> str:
    return f"{max(0.0, now - ts):.0f} s ago"
