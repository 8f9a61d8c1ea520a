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
    lines.append("")
    lines.append(f"{'SHARD':<34} {'LAYERS':<8} {'HOST':<10} {'STATE':<8} {'FORMAT':<13} "
                 f"{'MEM MB':>7} {'SESS':>4} {'QUEUE':>5} {'P95 ms':>7} {'AGE s':>6}  DEVICE")
    for s in st["shards"]:
        state = s.get("state") or ("suspect" if s["suspect"] else "online")
        lo, hi = s["layers"]
        name = s["shard_id"].split("/")[-1][:34]
        lines.append(f"{name:<34} {lo:>2}-{hi:<5} {s['host']:<10} {state:<8} "
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
        for row in m["coverage"]:
            a, b = row["layers"]
            lines.append(f"  layers {a:>2}-{b:<2}  {', '.join(row['hosts']) or '-'}")
    if st.get("placement"):
        lines += render_placement(st)
    return "\n".join(lines)


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
