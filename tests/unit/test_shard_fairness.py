"""A shard's streams are shared fairly between members (M26 §5.6, §5.9).

While one member alone uses a shard it may hold every stream; once another member asks
(even if refused busy), the first may hold all but a quarter, so the other gets a slot as
soon as one of the first one's sessions ends; after a quiet window it is alone again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hearthnet.distributed_inference.engine.memory import MemoryPlan
from hearthnet.distributed_inference.shard import server as shard_module
from hearthnet.distributed_inference.shard.server import (
    FAIR_SHARE_WINDOW_S,
    ShardServer,
    ShardSettings,
)
from hearthnet.errors import ShardUnavailable
from hearthnet.models.store import ModelEntry


def _server(tmp_path: Path, clock: list[float], streams: int) -> ShardServer:
    entry = ModelEntry(model_id="org/m", alias="m", weights_sha256="ab" * 32, num_layers=4,
                       hidden_size=8, model_type="llama", dtype="float32", source="test",
                       path=tmp_path)
    return ShardServer(entry, 0, 3, node_id="node-s", endpoint="ws://127.0.0.1:1",
                       settings=ShardSettings(max_concurrent_streams=streams),
                       executor=ThreadPoolExecutor(1), clock=lambda: clock[0])


def _open(server: ShardServer, caller: str) -> None:
    """Validate an open from `caller` and count its session as serve_session does."""
    params = {"shard_id": server.shard_id, "model_id": "org/m", "weights_sha256": "ab" * 32,
              "start": 0, "end": 3, "max_length": 16, "wire_dtype": "fp32"}
    server.validate_open(params, caller=caller)
    server._streams[object()] = caller  # type: ignore[index]
    server.active += 1


def _close_one(server: ShardServer, caller: str) -> None:
    key = next(k for k, c in server._streams.items() if c == caller)
    del server._streams[key]
    server.active -= 1


def test_one_member_cannot_starve_another(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_module, "plan_shard", lambda *a: MemoryPlan(0, 0, 0))
    clock = [1000.0]
    s = _server(tmp_path, clock, streams=8)
    for _ in range(8):  # alone: every stream
        _open(s, "node-a")
    with pytest.raises(ShardUnavailable) as e:  # node-b asks: busy, but it counts
        _open(s, "node-b")
    assert e.value.details.get("busy") is True
    _close_one(s, "node-a")
    with pytest.raises(ShardUnavailable, match="holds its fair share \\(6 of 8"):
        _open(s, "node-a")  # the freed slot is not node-a's again
    _open(s, "node-b")
    assert s.caller_share("node-a") == s.caller_share("node-b") == 6
    clock[0] += FAIR_SHARE_WINDOW_S + 1  # node-b quiet since: node-a alone again
    while "node-b" in s._streams.values():
        _close_one(s, "node-b")
    assert s.caller_share("node-a") == 8
    _open(s, "node-a")


def test_a_one_stream_shard_has_no_reserve(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_module, "plan_shard", lambda *a: MemoryPlan(0, 0, 0))
    clock = [0.0]
    s = _server(tmp_path, clock, streams=1)
    _open(s, "node-a")
    with pytest.raises(ShardUnavailable, match="max_concurrent_streams"):
        _open(s, "node-b")
    assert s.caller_share("node-a") == s.caller_share("node-b") == 1
