"""How `hearthnet status` and the page name a shard's state and say why (issue 15 §6),
and what the page shows of the mesh: every node, running chats, live sessions (issue 36 §7)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from hearthnet.commands.status import render
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.liveness import HostLiveness
from hearthnet.distributed_inference.orchestrator.calls import RunningCalls
from hearthnet.frames import PipelineAborted, ShardFailover, ShardStatus, TokenDelta
from hearthnet.mesh.launcher import free_port
from hearthnet.node.status import _peers, _state, mesh_status

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


# ---- what the status page answers: every node, running chats, live sessions ----

def _member(node_id: str, trust: str = "trusted") -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, trust=SimpleNamespace(label=trust))


def _descriptor(shard_id: str, host: str, layers: tuple[int, int]) -> SimpleNamespace:
    return SimpleNamespace(
        shard_id=shard_id, model_id="m", weights_sha256="w", layer_range=layers, host=host,
        endpoint=f"wss://{host}:1", max_concurrent_streams=8, weights_format="fp32",
        kernel="", vram_required_mb=100, device="cpu", device_name="cpu",
        device_memory_mb=0)


def _mesh_node(*, members: list[str], ads: list[SimpleNamespace], heard: list[str],
               peer_links: dict[str, tuple[bool, float]], auto_shards: tuple[str, ...] = (),
               served: list[Any] | None = None) -> SimpleNamespace:
    """A node as `mesh_status` reads it: members, advertisements, links, no placement."""
    node = _node([time.time()])
    for ad in ads:
        node.health.heartbeat(ad.descriptor.shard_id, at=time.time())
    node.endpoint = "wss://node-a:1"
    node.peer_links = peer_links
    node.guard = SimpleNamespace(directory=SimpleNamespace(
        members=lambda: [_member(m) for m in members]))
    node.log = SimpleNamespace(vector=lambda: {h: 1 for h in heard})
    node.store = SimpleNamespace(live=lambda: ads)
    node.models = SimpleNamespace(entries=lambda: [])
    node.router = SimpleNamespace(why_unusable=lambda ad, formats: None,
                                  held_format=lambda d: d.weights_format)
    node.placement = SimpleNamespace(
        auto_shard=lambda sid: {"reason": "weakest"} if sid in auto_shards else None,
        last=lambda kind: None, served=lambda: served or [], served_meta=lambda: {},
        history=[])
    node.auto = None
    node.shards = {}
    node.orchestrator = SimpleNamespace(running=RunningCalls(), speculation={})
    return node


async def test_every_member_node_is_listed_with_its_state_and_why():
    """Not only the direct gossip links: a member heard of through a relay, a member never
    seen, a host known by its advertisement, a peer whose link dropped."""
    now = time.time()
    ads = [SimpleNamespace(descriptor=_descriptor("m:0-14@node-b", "node-b", (0, 14)),
                           health=None, seen_at=now),
           SimpleNamespace(descriptor=_descriptor("m:15-29@node-c", "node-c", (15, 29)),
                           health=None, seen_at=now)]
    node = _mesh_node(members=["node-a", "node-b", "node-c", "node-d", "node-e", "node-f"],
                      ads=ads, heard=["node-b", "node-c", "node-d"],
                      peer_links={"node-b": (True, now - 5), "node-f": (False, now - 7)})
    st = await mesh_status(node)
    by = {n["node_id"]: n for n in st["nodes"]}
    assert list(by) == ["node-a", "node-b", "node-c", "node-d", "node-e", "node-f"]
    assert by["node-a"]["self"] and by["node-a"]["state"] == "online"
    assert by["node-b"]["state"] == "online" and by["node-b"]["link"] == {
        "connected": True, "direction": "in"}
    assert [h["layers"] for h in by["node-b"]["hosts"]] == [[0, 14]]
    # no link of its own to node-c (a chain A-B-C): known by its advertisement
    assert by["node-c"]["state"] == "online" and by["node-c"]["link"] is None
    assert by["node-c"]["hosts"][0]["shard_id"] == "m:15-29@node-c"
    assert by["node-d"]["state"] == "unknown" and "through other members" in \
        by["node-d"]["reason"]
    assert by["node-e"]["state"] == "offline" and by["node-e"]["reason"].startswith(
        "never seen")
    assert by["node-f"]["state"] == "offline" and not by["node-f"]["online"]
    assert by["node-f"]["reason"] == "gossip link to node-f lost 7 s ago"
    assert all(n["member"] and n["trust"] == "trusted" for n in st["nodes"])
    assert [p["node_id"] for p in st["peers"]] == ["node-b", "node-f"]  # the old key stays
    # a host whose every shard is suspect is suspect, with its shard's reason
    text = render(st)  # `hearthnet status` lists them too, each with its state and why
    assert "  node-a (this node): online" in text
    assert "  node-b: online, trusted; hosts layers 0-14" in text
    assert "  node-e: offline (never seen" in text
    assert "  node-f: offline (gossip link to node-f lost 7 s ago), trusted; hosts no layers" \
        in text
    node.health.mark_suspect("m:15-29@node-c", "connection_lost")
    c = next(n for n in (await mesh_status(node))["nodes"] if n["node_id"] == "node-c")
    assert c["state"] == "suspect" and c["reason"].startswith("connection_lost")


async def test_own_shards_count_sessions_live_and_remote_ones_add_this_node_s_calls():
    now = time.time()
    heartbeat = SimpleNamespace(queue_depth=0, active_sessions=0, p95_latency_ms=None)
    ads = [SimpleNamespace(descriptor=_descriptor("m:0-14@node-a", "node-a", (0, 14)),
                           health=heartbeat, seen_at=now),
           SimpleNamespace(descriptor=_descriptor("m:15-29@node-c", "node-c", (15, 29)),
                           health=heartbeat, seen_at=now)]
    node = _mesh_node(members=["node-a", "node-c"], ads=ads, heard=[], peer_links={})
    node.shards = {"m:0-14@node-a": SimpleNamespace(active=2, decode_state=lambda: None)}
    with node.orchestrator.running.track("smollm2") as call:
        call.see(ShardStatus.ok("m:0-14@node-a", (0, 14), "fp32"))
        call.see(ShardStatus.ok("m:15-29@node-c", (15, 29), "fp32"))
        st = await mesh_status(node)
    by = {s["shard_id"]: s for s in st["shards"]}
    assert by["m:0-14@node-a"]["active_sessions"] == 2  # the heartbeat said 0
    assert by["m:0-14@node-a"]["sessions_live"] is True
    # another's: its heartbeat's count (0), but at least this node's call on it
    assert by["m:15-29@node-c"]["active_sessions"] == 1
    assert by["m:15-29@node-c"]["sessions_live"] is False
    assert by["m:15-29@node-c"]["sessions_from_here"] == 1
    assert [c["path"] for c in st["running_calls"]] == [["m:0-14@node-a", "m:15-29@node-c"]]
    assert (await mesh_status(node))["running_calls"] == []  # ended: gone


async def test_automatic_hosting_is_in_use_only_where_it_applies():
    now = time.time()
    ad = SimpleNamespace(descriptor=_descriptor("m:0-29@node-b", "node-b", (0, 29)),
                         health=None, seen_at=now)
    hand_written = _mesh_node(members=["node-a", "node-b"], ads=[ad], heard=[], peer_links={})
    assert (await mesh_status(hand_written))["placement"]["in_use"] is False
    auto = _mesh_node(members=["node-a", "node-b"], ads=[ad], heard=[], peer_links={},
                      auto_shards=("m:0-29@node-b",))
    assert (await mesh_status(auto))["placement"]["in_use"] is True
    served = _mesh_node(members=["node-a"], ads=[], heard=[], peer_links={},
                        served=[SimpleNamespace(to_dict=lambda: {"alias": "smollm2"})])
    assert (await mesh_status(served))["placement"]["in_use"] is True


def test_a_running_call_follows_its_frames():
    """Tokens, tok/s, path, failovers and the local fallback, from the frames the caller
    gets; the registry forgets a call however it ends."""
    calls = RunningCalls()
    with calls.track("smollm2") as call:
        assert call.state == "starting" and len(calls) == 1
        call.see(ShardStatus.ok("m:0-14@node-b", (0, 14), "fp32"))
        call.see(ShardStatus.ok("m:15-29@node-c", (15, 29), "fp32"))
        assert call.state == "prefill"
        for i in range(5):
            call.see(TokenDelta("x", 1, i))
        assert call.first_at is not None
        assert call.tokens_per_s(call.first_at + 2.0) == 2.0  # 4 tokens after the first
        call.see(ShardFailover("m:15-29@node-c", ("m:15-29@node-d",),
                               ("m:0-14@node-b", "m:15-29@node-d"), 40, 12.0))
        view = calls.snapshot()[0]
        assert view["state"] == "decoding" and view["tokens"] == 5 and view["failovers"] == 1
        assert view["path"] == ["m:0-14@node-b", "m:15-29@node-d"]
        assert view["tokens_per_s"] > 0 and view["first_token_ms"] is not None
        text = render({"node_id": "node-a", "endpoint": "wss://x:1", "shards": [],
                       "models": [], "running_calls": [view]})
        assert "running chats:\n  smollm2: decoding, 5 tokens, " in text
        assert "tok/s, via 0-14@node-b -> 15-29@node-d\n" in text
        call.see(PipelineAborted("no replacement for layers 15-29", "local", 5))
        assert call.tokens_per_s(time.perf_counter() + 1) == 0.0  # no local token yet
        for i in range(3):
            call.see(TokenDelta("y", 2, 5 + i))
        view = calls.snapshot()[0]
        assert view["state"] == "local fallback" and view["fallback"] is True
        assert view["path"] == ["local"] and view["tokens"] == 8
        assert "via local fallback" in render({"node_id": "node-a", "endpoint": "wss://x:1",
                                               "shards": [], "models": [],
                                               "running_calls": [view]})
        assert view["fallback_reason"] == "no replacement for layers 15-29"
        assert set(view) >= {"model", "started_at", "elapsed_s", "pipeline"}
        assert "text" not in view  # counts and ids only (M26 §5.8)
    assert calls.snapshot() == []
    try:
        with calls.track("smollm2"):
            raise RuntimeError("the caller went away")
    except RuntimeError:
        pass
    assert len(calls) == 0
