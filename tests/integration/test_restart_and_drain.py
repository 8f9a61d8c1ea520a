"""A node's start and stop under trouble, with real node processes on 127.0.0.1.

- A corrupt event log ("file is not a database") no longer keeps the node down: the file is
  set aside (kept, never deleted), a warning says where it went, and the fresh log is
  refilled from the peer, as an emptied log is.
- SIGTERM drains: a shard session open at SIGTERM finishes its answer (``done``, the very
  tokens of the local engine), new sessions are refused ``shard_unavailable`` meanwhile,
  and the node exits within ``[node] drain_timeout_seconds``.

One mesh serves the module: ``node-b`` hosts every layer and is the star's centre,
``node-a`` orchestrates. node-b's replies wait while its gate file is missing, so a test
holds an answer open for as long as it needs (`tests.helpers.faults`, mode ``gate``).
The order of the tests matters (node-b is stopped by the last); pytest keeps file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import HearthNetError
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from hearthnet.transport.websocket import TensorChannel
from tests.helpers.mesh import TestMesh
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT = "Name three colours."
N = 12  # tokens of the answer held open across SIGTERM
HELD_AFTER = 3  # the gate closes once this many tokens of the answer have arrived
DRAIN_S = 10.0  # the default `[node] drain_timeout_seconds`


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    gate = tmp_path_factory.mktemp("gate") / "open"
    gate.touch()  # open: node-b answers at once until a test removes it
    return gate


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory, gate):
    specs = [NodeSpec("node-b", [(0, 29)]), NodeSpec("node-a")]  # node-a dials node-b
    m = TestMesh(specs, root=tmp_path_factory.mktemp("drain"),
                 faults={"node-b": {"mode": "gate", "gate_file": str(gate)}})
    try:
        m.start()
        yield m
    finally:
        gate.touch()  # nothing waits on it at the teardown
        m.stop()


def _log_events(m: TestMesh, node_id: str) -> list[dict[str, Any]]:
    out = []
    for line in m.log_text(node_id).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_a_corrupt_event_log_is_set_aside_and_refilled_from_the_peer(mesh):
    mesh.kill("node-a", signal.SIGTERM)
    folder = mesh.root / "node-a"
    garbage = b"\x00this is not an SQLite database\xff" * 4096
    (folder / "events.sqlite3").write_bytes(garbage)
    mesh.start_node("node-a")  # its node_ready line: the start went past the log
    (aside,) = [p for p in folder.glob("events.sqlite3.corrupt-*")
                if not p.name.endswith(("-wal", "-shm", "-journal"))]
    assert aside.read_bytes() == garbage  # kept as it was, for inspection
    (warned,) = [e for e in _log_events(mesh, "node-a") if e["event"] == "event_log_set_aside"]
    assert warned["level"] == "warning" and warned["moved_to"] == str(aside)
    assert "file is not a database" in warned["error"]
    # the fresh log holds node-b's advertisement again: gossip catch-up from the peer
    st = mesh.wait_covered("node-a", timeout=60)
    assert [s["host"] for s in st["shards"]] == ["node-b"]


async def test_a_session_open_at_sigterm_finishes_its_answer(mesh, smollm2, gate):
    mesh.wait_covered("node-a", timeout=60)
    args = chat_args(PROMPT, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32",
                     fallback_to_local=False)
    reference = [f async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args)]
    assert reference[-1]["type"] == "done", reference[-1]
    frames: list[dict[str, Any]] = []

    async def chat() -> None:
        async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args):
            frames.append(f)
            if _count(frames, "token_delta") == HELD_AFTER and f["type"] == "token_delta":
                gate.unlink()  # a later reply of node-b waits: the answer cannot end

    call = asyncio.create_task(chat())
    await wait_until(lambda: not gate.exists() or call.done(), "the answer under way")
    proc = mesh.nodes["node-b"].proc
    assert proc is not None and not call.done(), frames
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    await wait_until(lambda: '"node_draining"' in mesh.log_text("node-b"), "node-b draining")
    assert proc.poll() is None  # still serving the open session
    with pytest.raises(HearthNetError) as refused:  # a new session: fail over elsewhere
        await TensorChannel.connect(
            mesh.nodes["node-b"].listen_uri + "/shard", mesh.sign_open("node-a", {
                "shard_id": f"{smollm2.model_id}:0-29@node-b", "model_id": smollm2.model_id,
                "weights_sha256": smollm2.weights_sha256, "start": 0, "end": 29,
                "max_length": 16, "wire_dtype": "fp32"}),
            ssl=mesh.client_ssl("node-a", "node-b"), deadline_s=10)
    assert refused.value.code == "shard_unavailable", refused.value.to_dict()
    assert "shutting down" in refused.value.message
    assert not refused.value.details.get("busy")  # not worth waiting for
    gate.touch()
    async with asyncio.timeout(60):
        await call
    done = frames[-1]
    assert done["type"] == "done", done
    assert _tokens(frames) == _tokens(reference) and len(_tokens(frames)) == N
    assert "".join(f["text"] for f in frames if f["type"] == "token_delta") == \
        "".join(f["text"] for f in reference if f["type"] == "token_delta")
    assert done["failovers"] == 0 and not _count(frames, "shard_failover")
    await asyncio.to_thread(proc.wait, DRAIN_S + 5)
    took = time.monotonic() - t0
    assert took < DRAIN_S + 5, took
    events = [e["event"] for e in _log_events(mesh, "node-b")]
    assert events.index("node_draining") < events.index("node_drained") \
        < events.index("node_stopped")
    assert "drain_timed_out" not in events


def _count(frames: list[dict[str, Any]], kind: str) -> int:
    return sum(f["type"] == kind for f in frames)


def _tokens(frames: list[dict[str, Any]]) -> list[int]:
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]
