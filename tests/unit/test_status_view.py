"""How `hearthnet status` and the page name a shard's state and say why (issue 15 §6)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from hearthnet.commands.status import render
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.liveness import HostLiveness
from hearthnet.mesh.launcher import free_port
from hearthnet.node.status import _peers, _state

SID = "m:15-29@node-c"


def _node(clock: list[float]) -> SimpleNamespace:
    health = ShardHealthTracker(clock=lambda: clock[0], offline_after_s=30)
    return SimpleNamespace(node_id="node-a", health=health, links=[])


def test_online_suspect_offline_each_with_a_reason():
    clock = [1000.0]
    node = _node(clock)
    node.health.heartbeat(SID, at=1000.0)
    assert _state(node, SID, "node-c", {}, clock[0]) == ("online", None)
    node.health.mark_suspect(SID, "connection_lost")  # e.g. a restarted host's old session
    state, why = _state(node, SID, "node-c", {}, clock[0])
    assert state == "suspect" and why.startswith("connection_lost (routing avoids it for")
    clock[0] += 10_000  # suspicion over, no heartbeat for long
    state, why = _state(node, SID, "node-c", {}, clock[0])
    assert state == "offline" and why == "no heartbeat since 10000 s ago"
    links = {"node-c": (False, clock[0] - 3)}  # its gossip link dropped: a killed host
    assert _state(node, SID, "node-c", links, clock[0]) == \
        ("offline", "gossip link to node-c lost 3 s ago")


async def test_a_host_refusing_the_liveness_probe_is_offline_at_once():
    """Issue 15 §6: no gossip link of our own to the host (a chain A-B-C) and its heartbeat
    still fresh, but its listener refuses connections: offline, with the probe as reason."""
    clock = [time.time()]
    node = _node(clock)
    node.health.heartbeat(SID, at=clock[0])
    ads = [_ad("node-c", free_port(), seen_at=clock[0] - 1)]
    node.liveness = HostLiveness(SimpleNamespace(live=lambda: ads), "node-a", interval_s=2.0,
                                 failures=2)
    assert _state(node, SID, "node-c", {}, clock[0]) == ("online", None)
    seen: list[bool] = []
    node.liveness.on_change(lambda: seen.append(True))
    assert not await node.liveness.probe_once()  # one refusal is not enough
    assert await node.liveness.probe_once() and seen == [True]
    state, why = _state(node, SID, "node-c", {}, clock[0] + 3)
    assert state == "offline" and why == \
        "host node-c refuses connections (TCP probe failed 2x in a row, 3 s ago)"
    assert node.liveness.down_hosts() == ["node-c"]
    # restarted: it re-advertises at once, before the next probe — online again
    ads.append(_ad("node-c", free_port(), seen_at=time.time() + 1))
    assert _state(node, SID, "node-c", {}, clock[0] + 3) == ("online", None)
    assert node.liveness.down_hosts() == []


def _ad(host: str, port: int, seen_at: float) -> SimpleNamespace:
    return SimpleNamespace(seen_at=seen_at, descriptor=SimpleNamespace(
        host=host, endpoint=f"wss://127.0.0.1:{port}"))


def test_a_relay_lists_its_incoming_peers():
    node = _node([0.0])
    node.links = [SimpleNamespace(uri="wss://127.0.0.1:7702", peer_id="node-b", connected=True)]
    peers = _peers(node, {"node-b": (True, 0.0), "node-c": (True, 0.0)}, 5.0)
    assert [(p["node_id"], p["direction"], p["connected"]) for p in peers] == [
        ("node-b", "out", True), ("node-c", "in", True)]
    text = render({"node_id": "node-a", "endpoint": "wss://x:1", "peers": peers,
                   "api": "http://127.0.0.1:8080", "shards": [], "models": []})
    assert "peers: node-b (up), node-c (up, incoming)" in text
    assert "api: http://127.0.0.1:8080/v1" in text
