"""The mesh as one node sees it: nodes, shards, per-model layer coverage (`hearthnet status`)."""

from __future__ import annotations

import time
from typing import Any


def _ranges(layers: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


async def mesh_status(node: Any) -> dict[str, Any]:
    """A JSON-safe snapshot of what `node` knows."""
    now = time.time()
    shards = []
    nodes: dict[str, dict[str, Any]] = {node.node_id: {"node_id": node.node_id, "self": True,
                                                      "endpoint": node.endpoint}}
    for ad in node.store.live():
        d = ad.descriptor
        h = ad.health
        suspect = node.health.is_suspect(d.shard_id)
        shards.append({
            "shard_id": d.shard_id, "model_id": d.model_id, "weights_sha256": d.weights_sha256,
            "layers": list(d.layer_range), "host": d.host, "endpoint": d.endpoint,
            "online": True, "suspect": suspect,
            "age_s": round(now - ad.seen_at, 1),
            "queue_depth": h.queue_depth if h else None,
            "active_sessions": h.active_sessions if h else None,
            "p95_latency_ms": h.p95_latency_ms if h else None,
            "max_concurrent_streams": d.max_concurrent_streams})
        nodes.setdefault(d.host, {"node_id": d.host, "self": False, "endpoint": d.endpoint})
    models = []
    for e in node.models.entries():
        covered: dict[int, list[str]] = {i: [] for i in range(e.num_layers)}
        for s in shards:
            if s["model_id"] == e.model_id and s["weights_sha256"] == e.weights_sha256:
                for i in range(s["layers"][0], min(s["layers"][1], e.num_layers - 1) + 1):
                    covered[i].append(s["host"])
        missing = [i for i, hosts in covered.items() if not hosts]
        models.append({"model_id": e.model_id, "alias": e.alias,
                       "weights_sha256": e.weights_sha256, "num_layers": e.num_layers,
                       "fully_covered": not missing, "uncovered": _ranges(missing),
                       "coverage": _coverage_rows(covered)})
    return {"node_id": node.node_id, "endpoint": node.endpoint, "time": now,
            "peers": [{"uri": link.uri, "connected": link.connected} for link in node.links],
            "nodes": sorted(nodes.values(), key=lambda n: n["node_id"]),
            "shards": sorted(shards, key=lambda s: (s["model_id"], s["layers"], s["host"])),
            "models": models}


def _coverage_rows(covered: dict[int, list[str]]) -> list[dict[str, Any]]:
    """Collapse per-layer host lists into runs: [{layers: [lo, hi], hosts: [...]}]."""
    rows: list[dict[str, Any]] = []
    for i in sorted(covered):
        hosts = sorted(set(covered[i]))
        if rows and rows[-1]["hosts"] == hosts and rows[-1]["layers"][1] == i - 1:
            rows[-1]["layers"][1] = i
        else:
            rows.append({"layers": [i, i], "hosts": hosts})
    return rows
