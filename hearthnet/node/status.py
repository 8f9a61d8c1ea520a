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


def _decode_state(node: Any, shard_id: str) -> str | None:
    """How this node's own shard runs its decode steps (M26 §5.7: compiled, or eager and
    why); None for another node's shard or one not loaded."""
    shard = getattr(node, "shards", {}).get(shard_id)
    return shard.decode_state() if shard is not None else None


async def mesh_status(node: Any) -> dict[str, Any]:
    """A JSON-safe snapshot of what `node` knows."""
    now = time.time()
    shards = []
    nodes: dict[str, dict[str, Any]] = {node.node_id: {
        "node_id": node.node_id, "self": True, "endpoint": node.endpoint, "online": True,
        "reason": None}}
    links = getattr(node, "peer_links", {})
    entries = {(e.model_id, e.weights_sha256): e for e in node.models.entries()}
    for ad in node.store.live():
        d = ad.descriptor
        h = ad.health
        suspect = node.health.is_suspect(d.shard_id)
        state, reason = _state(node, d.shard_id, d.host, links, now)
        # the router's one definition of a shard a call may use (with this node's default
        # weights policy where it holds the model): only those count as coverage
        entry = entries.get((d.model_id, d.weights_sha256))
        unusable = node.router.why_unusable(
            ad, node.default_formats(entry) if entry is not None else None)
        shards.append({
            "shard_id": d.shard_id, "model_id": d.model_id, "weights_sha256": d.weights_sha256,
            "layers": list(d.layer_range), "host": d.host, "endpoint": d.endpoint,
            "online": state != "offline", "suspect": suspect, "state": state,
            "reason": reason, "age_s": round(now - ad.seen_at, 1),
            "queue_depth": h.queue_depth if h else None,
            "active_sessions": h.active_sessions if h else None,
            "p95_latency_ms": node.health.p95(d.shard_id) or (h.p95_latency_ms if h else None),
            "max_concurrent_streams": d.max_concurrent_streams,
            # weight format (DESIGN.md decision 10) and device (DESIGN.md decision 11), when the
            # advertisement has them
            # what the shard's last ACCEPT stated when it differs from the advertisement
            "format": node.router.held_format(d), "advertised_format": d.weights_format,
            "kernel": d.kernel, "memory_mb": d.vram_required_mb,
            "device": d.device, "device_name": d.device_name,
            "device_memory_mb": d.device_memory_mb, "vram_required_mb": d.vram_required_mb,
            "usable": unusable is None, "unusable_reason": unusable,
            "auto": node.placement.auto_shard(d.shard_id),  # automatic placement
            "decode_step": _decode_state(node, d.shard_id)})
        nodes.setdefault(d.host, {"node_id": d.host, "self": False, "endpoint": d.endpoint,
                                  "online": True, "reason": None})
        if d.host != node.node_id and state == "offline":  # its listener or link is gone
            nodes[d.host].update(online=False, reason=reason)
    models = []
    speculation = getattr(getattr(node, "orchestrator", None), "speculation", {})
    for e in entries.values():
        covered: dict[int, list[str]] = {i: [] for i in range(e.num_layers)}
        for s in shards:  # an offline or unusable shard covers nothing: no call can use it
            if s["model_id"] == e.model_id and s["weights_sha256"] == e.weights_sha256 \
                    and s["state"] != "offline" and s["usable"]:
                for i in range(s["layers"][0], min(s["layers"][1], e.num_layers - 1) + 1):
                    covered[i].append(s["host"])
        missing = [i for i, hosts in covered.items() if not hosts]
        models.append({"model_id": e.model_id, "alias": e.alias,
                       "weights_sha256": e.weights_sha256, "num_layers": e.num_layers,
                       "fully_covered": not missing, "uncovered": _ranges(missing),
                       "coverage": _coverage_rows(covered),
                       # this orchestrator's speculative passes of the model's calls so far
                       # (DESIGN.md decision 16): {mode: {passes, proposed, accepted}}
                       "speculative": speculation.get(e.alias, {})})
    api = getattr(node, "api", None)
    return {"node_id": node.node_id, "endpoint": node.endpoint, "time": now,
            "api": api.url if api is not None else None,
            "peers": _peers(node, links, now),
            "recent_events": list(getattr(node, "recent_events", [])),
            "nodes": sorted(nodes.values(), key=lambda n: n["node_id"]),
            "shards": sorted(shards, key=lambda s: (s["model_id"], s["layers"], s["host"])),
            "models": models, "placement": placement_status(node)}


def placement_status(node: Any) -> dict[str, Any]:
    """Automatic hosting (DESIGN.md decision 14): served list, this node's choices, mesh news."""
    view = node.placement
    last = {k: (c.to_dict() if (c := view.last(k)) is not None else None)
            for k in ("rehost", "rebalance")}
    return {"served_models": [m.to_dict() for m in view.served()], **view.served_meta(),
            "this_node": node.auto.status() if node.auto is not None else None,
            "last_rehost": last["rehost"], "last_rebalance": last["rebalance"],
            "recent_claims": [c.to_dict() for c in list(view.history)[-8:]]}


def _state(node: Any, shard_id: str, host: str, links: dict[str, tuple[bool, float]],
           now: float) -> tuple[str, str | None]:
    """("online" | "suspect" | "offline", why) of one shard, as this node sees it."""
    link = links.get(host)
    if link is not None and not link[0] and host != node.node_id:
        return "offline", f"gossip link to {host} lost {now - link[1]:.0f} s ago"
    liveness = getattr(node, "liveness", None)  # every node probes hosts: offline in seconds
    down = liveness.reason(host, now) if liveness is not None else None
    if down is not None:
        return "offline", down
    view = node.health.view(shard_id)
    if view is not None and view.suspect:
        return "suspect", f"{view.suspect_reason} (routing avoids it for " \
            f"{(view.suspect_until or now) - now:.0f} s more)"
    if view is not None and not view.online:
        seen = f"{now - view.last_seen:.0f} s ago" if view.last_seen else "never"
        return "offline", f"no heartbeat since {seen}"
    return "online", None


def _peers(node: Any, links: dict[str, tuple[bool, float]], now: float
           ) -> list[dict[str, Any]]:
    """Configured peer URIs and every gossip peer seen (incoming links too: a relay)."""
    out = [{"uri": link.uri, "node_id": link.peer_id, "connected": link.connected,
            "direction": "out"} for link in node.links]
    dialled = {p["node_id"] for p in out}
    for peer, (up, since) in sorted(links.items()):
        if peer not in dialled:
            out.append({"uri": None, "node_id": peer, "connected": up, "direction": "in",
                        "since_s": round(now - since, 1)})
    return out


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
