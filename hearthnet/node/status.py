"""The mesh as one node sees it (`hearthnet status`, ``/api/status``, the status page).

Nodes: every member of the community, every host of a live advertisement and every gossip
peer, each with its state (online / suspect / offline / unknown) and why. Shards: the live
advertisements, with live session counts for this node's own. Models: per-layer coverage.
Running chats: this orchestrator's calls in progress (counts and shard ids only, M26 §5.8).
Placement: automatic hosting, with ``in_use`` so that a page shows it only where it applies.
"""

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
    links = getattr(node, "peer_links", {})
    entries = {(e.model_id, e.weights_sha256): e for e in node.models.entries()}
    own = _own_sessions(node)
    for ad in node.store.live():
        d = ad.descriptor
        h = ad.health
        served = getattr(node, "shards", {}).get(d.shard_id) if d.host == node.node_id \
            else None
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
            # this node's own shard: its open sessions now, not at its last heartbeat;
            # another's: at least the sessions this node's calls hold on it now
            "active_sessions": served.active if served is not None
            else _at_least(h.active_sessions if h else None, own.get(d.shard_id, 0)),
            "sessions_live": served is not None,
            "sessions_from_here": own.get(d.shard_id, 0),  # this node's calls open on it
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
    models = []
    speculation = getattr(getattr(node, "orchestrator", None), "speculation", {})
    head_steps = getattr(getattr(node, "orchestrator", None), "head_steps", None)
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
                       "holds_head": e.holds_head,  # this node's store has the head's files
                       "coverage": _coverage_rows(covered),
                       # this orchestrator's speculative passes of the model's calls so far
                       # (DESIGN.md decision 16): {mode: {passes, proposed, accepted}}
                       "speculative": speculation.get(e.alias, {}),
                       # M26 §5.7: this orchestrator's head steps ({kind: compiled or eager
                       # and why}); None before a call here loaded the model's head
                       "head_step": head_steps(e.alias) if head_steps else None})
    api = getattr(node, "api", None)
    from hearthnet.distributed_inference.engine.memory import process_memory

    return {"node_id": node.node_id, "endpoint": node.endpoint, "time": now,
            # this process: its shards' weights, KV caches (peak) and RSS (M26 §5.6)
            "memory": process_memory(getattr(node, "shards", {}).values()),
            "api": api.url if api is not None else None,
            "peers": _peers(node, links, now),
            "recent_events": list(getattr(node, "recent_events", [])),
            "nodes": mesh_nodes(node, shards, links, now),
            "running_calls": running_calls(node),
            "shards": sorted(shards, key=lambda s: (s["model_id"], s["layers"], s["host"])),
            "models": models, "placement": placement_status(node),
            # weights fetched from members (DESIGN.md decision 17; node/fetch.py)
            "fetches": fetcher.status() if (fetcher := getattr(node, "fetcher", None)) else [],
            # what each member holds of each model (its held events), to fetch from
            "held": [{"model": h.alias, "weights_sha256": h.weights_sha256, "node": h.node_id,
                      "layers": [list(r) for r in h.layers], "head": h.head}
                     for h in _held(node)]}


def _held(node: Any) -> list[Any]:
    """The members' holdings of models (`node.fetch.HeldModels`), if the node keeps them."""
    held = getattr(node, "held", None)
    return held.all() if held is not None else []


def placement_status(node: Any) -> dict[str, Any]:
    """Automatic hosting (DESIGN.md decision 14): served list, this node's choices, mesh news.

    ``in_use`` is false on a hand-written mesh — no served-model list, no automatic host
    here or in the advertisements, no claim ever made — and the page shows no card then.
    """
    view = node.placement
    last = {k: (c.to_dict() if (c := view.last(k)) is not None else None)
            for k in ("rehost", "rebalance")}
    served = [m.to_dict() for m in view.served()]
    claims = [c.to_dict() for c in list(view.history)[-8:]]
    auto_shards = any(view.auto_shard(ad.descriptor.shard_id) for ad in node.store.live())
    in_use = bool(served or claims or auto_shards or node.auto is not None
                  or last["rehost"] or last["rebalance"])
    return {"in_use": in_use, "served_models": served, **view.served_meta(),
            "this_node": node.auto.status() if node.auto is not None else None,
            "last_rehost": last["rehost"], "last_rebalance": last["rebalance"],
            "recent_claims": claims}


def running_calls(node: Any) -> list[dict[str, Any]]:
    """The chats this node orchestrates now (`RunningCalls.snapshot`), oldest first."""
    running = getattr(getattr(node, "orchestrator", None), "running", None)
    return running.snapshot() if running is not None else []


def _at_least(heartbeat: int | None, own: int) -> int | None:
    if heartbeat is None:
        return own or None
    return max(heartbeat, own)


def _own_sessions(node: Any) -> dict[str, int]:
    """Per shard id, the sessions this node's calls in progress hold on it: live, where a
    remote shard's own count is only as fresh as its last heartbeat."""
    running = getattr(getattr(node, "orchestrator", None), "running", None)
    out: dict[str, int] = {}
    for call in running or ():
        if not call.fallback:
            for sid in call.path:
                out[sid] = out.get(sid, 0) + 1
    return out


def mesh_nodes(node: Any, shards: list[dict[str, Any]], links: dict[str, tuple[bool, float]],
               now: float) -> list[dict[str, Any]]:
    """Every node this node knows of — the community's members (the guard's live list),
    the hosts of live advertisements and the gossip peers, direct or not — with its state
    and why, what it hosts and its gossip link to this node (None: known through others)."""
    rows: dict[str, dict[str, Any]] = {}

    def row(nid: str) -> dict[str, Any]:
        return rows.setdefault(nid, {
            "node_id": nid, "self": nid == node.node_id, "member": False, "trust": None,
            "endpoint": None, "link": None, "hosts": []})

    row(node.node_id)["endpoint"] = node.endpoint
    guard = getattr(node, "guard", None)
    for m in guard.directory.members() if guard is not None else ():
        r = row(m.node_id)
        r["member"], r["trust"] = True, m.trust.label
    for p in _peers(node, links, now):
        if p["node_id"] is None:  # a configured address not (yet) answered: no node id
            continue
        r = row(p["node_id"])
        r["link"] = {"connected": p["connected"], "direction": p["direction"]}
        r["endpoint"] = r["endpoint"] or p["uri"]
    for s in shards:
        r = row(s["host"])
        r["endpoint"] = s["endpoint"] if not r["self"] else r["endpoint"]
        r["hosts"].append({"shard_id": s["shard_id"], "model_id": s["model_id"],
                           "layers": s["layers"], "state": s["state"],
                           "reason": s["reason"], "auto": bool(s.get("auto"))})
    heard = _origins(node)
    for r in rows.values():
        r["state"], r["reason"] = _node_state(node, r, links, heard, now)
        r["online"] = r["state"] in ("online", "suspect")
    return sorted(rows.values(), key=lambda r: (not r["self"], r["node_id"]))


def _origins(node: Any) -> set[str]:
    """The nodes whose events this node holds (heard of through gossip, even via others)."""
    log = getattr(node, "log", None)
    return set(log.vector()) if log is not None else set()


def _node_state(node: Any, r: dict[str, Any], links: dict[str, tuple[bool, float]],
                heard: set[str], now: float) -> tuple[str, str | None]:
    """("online" | "suspect" | "offline" | "unknown", why) of one node, as this node sees
    it: the same evidence as a shard's state (`_state`) in the same order — its gossip link,
    the liveness probe — then its shards', then a live link alone."""
    nid = r["node_id"]
    if r["self"]:
        return "online", None
    link = links.get(nid)
    if link is not None and not link[0]:
        return "offline", f"gossip link to {nid} lost {now - link[1]:.0f} s ago"
    liveness = getattr(node, "liveness", None)  # probes every advertising host
    down = liveness.reason(nid, now) if liveness is not None else None
    if down is not None:
        return "offline", down
    if r["hosts"]:
        states = [h["state"] for h in r["hosts"]]
        if "online" in states:
            return "online", None
        worst = "suspect" if "suspect" in states else "offline"
        return worst, next(h["reason"] for h in r["hosts"] if h["state"] == worst)
    if link is not None:
        return "online", None  # a live gossip link of its own, nothing hosted
    if nid in heard:
        return "unknown", ("no gossip link to this node and nothing hosted: its events "
                           "reach this node through other members")
    return "offline", "never seen: no gossip link, no advertisement, no event from it"


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
