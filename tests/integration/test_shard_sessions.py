"""Shard-side session isolation with real node processes on 127.0.0.1 (issue 6 §4).

- A broken open or step on a shard — garbage bytes on ``/shard``, a wrong weights hash, a
  bad layer range, an unsigned open, a step with a gap or the wrong shape — is refused on
  its own connection and never disturbs a chat running through the same shard at the
  same time (the chat's answer is exact, with no failover).
- A caller that vanishes mid-session (its connection dropped, or its whole process
  killed) frees its session: the shard node's
  ``hearthnet_distributed_inference_shard_active_sessions`` gauge drops back to 0.

The test process acts as member ``node-a`` (its key and TLS certificate from
`LocalMesh`) when it talks to ``node-b``'s shard directly.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect as ws_connect

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import HearthNetError
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from hearthnet.transport.websocket import TensorChannel
from tests.helpers.mesh import TestMesh

pytestmark = pytest.mark.slow

PROMPT = "Explain in three sentences why the sky is blue."
N = 32
GAUGE = "hearthnet_distributed_inference_shard_active_sessions"


@pytest.fixture(scope="module")
def reference(local_answer) -> list[int]:
    return local_answer(PROMPT, N)


@pytest.fixture(scope="module")
def mesh(smollm2):
    # node-b is a shard-only host: it loads no head at start (`bench reach`); node-c keeps
    # the daemon's default, which a local mesh turns off for its layer hosts
    with TestMesh([NodeSpec("node-a"),
                   NodeSpec("node-b", [(0, 14)], extra_di={"prepare_heads_at_start": False}),
                   NodeSpec("node-c", [(15, 29)], extra_di={"prepare_heads_at_start": True})
                   ]) as m:
        yield m


# ---- helpers ----

def _gauge(m: TestMesh, node_id: str) -> float:
    """Open sessions over every shard the node hosts, from its /metrics."""
    total = 0.0
    for fam in text_string_to_metric_families(m.metrics(node_id)):
        total += sum(s.value for s in fam.samples if s.name == GAUGE)
    return total


async def _wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `cond` without blocking the event loop (our own sockets must close meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _open_params(m: TestMesh, entry: Any, **over: Any) -> dict[str, Any]:
    p = {"shard_id": f"{entry.model_id}:0-14@node-b", "model_id": entry.model_id,
         "weights_sha256": entry.weights_sha256, "start": 0, "end": 14, "max_length": 64,
         "wire_dtype": "fp32", **over}
    return m.sign_open("node-a", p)


async def _session(m: TestMesh, entry: Any, *, signed: bool = True,
                   **over: Any) -> TensorChannel:
    params = _open_params(m, entry, **over) if signed else \
        {k: v for k, v in _open_params(m, entry, **over).items() if k != "auth"}
    return await TensorChannel.connect(m.nodes["node-b"].listen_uri + "/shard", params,
                                       ssl=m.client_ssl("node-a", expect="node-b"),
                                       deadline_s=10.0)


async def _chat(m: TestMesh, started: asyncio.Event | None = None) -> list[dict[str, Any]]:
    args = chat_args(PROMPT, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32",
                     timeout_s=10.0)
    frames = []
    async for f in bus_call(m.nodes["node-a"].uri, CHAT_CAPABILITY, args):
        frames.append(f)
        if started is not None and f["type"] == "token_delta":
            started.set()
    return frames


# ---- the attacks: each must be refused on its own connection ----

async def _garbage_tcp(m: TestMesh) -> None:
    """Random bytes where a TLS handshake should be."""
    _, w = await asyncio.open_connection("127.0.0.1", m.nodes["node-b"].port)
    w.write(os.urandom(4096))
    await w.drain()
    w.close()


async def _garbage_http(m: TestMesh, ctx: ssl.SSLContext) -> None:
    """A member's TLS connection, then nonsense instead of an HTTP upgrade."""
    r, w = await asyncio.open_connection("127.0.0.1", m.nodes["node-b"].port, ssl=ctx,
                                         server_hostname="node-b")
    w.write(b"GET /shard HTTP/1.1\r\n\x00\xff" + os.urandom(512) + b"\r\n\r\n")
    await w.drain()
    await asyncio.wait_for(r.read(), 10)  # the node answers or closes; never hangs
    w.close()


async def _garbage_frames(m: TestMesh, ctx: ssl.SSLContext) -> None:
    """A WebSocket on /shard whose first message is random bytes, not an OPEN."""
    async with ws_connect(m.nodes["node-b"].listen_uri + "/shard", ssl=ctx,
                          server_hostname="node-b", open_timeout=10) as ws:
        await ws.send(os.urandom(300))
        with pytest.raises(Exception):  # noqa: B017 - closed or an error frame, either way
            for _ in range(4):
                await asyncio.wait_for(ws.recv(), 10)


async def _refused_open(m: TestMesh, entry: Any, code: str, **kw: Any) -> None:
    with pytest.raises(HearthNetError) as ei:
        ch = await _session(m, entry, **kw)
        await ch.close()
    assert ei.value.code == code, ei.value


async def _bad_steps(m: TestMesh, entry: Any) -> None:
    """A session whose bad steps are refused, and which still works afterwards."""
    ch = await _session(m, entry)
    try:
        h = int(ch.accepted["hidden_size"])
        with pytest.raises(HearthNetError) as ei:  # a gap: nothing at positions 0..4
            await ch.step(1, 5, torch.zeros(1, 2, h), 10.0)
        assert ei.value.code == "bad_request"
        with pytest.raises(HearthNetError) as ei:  # the wrong hidden size
            await ch.step(2, 0, torch.zeros(1, 2, h + 1), 10.0)
        assert ei.value.code == "bad_request"
        res = await ch.step(3, 0, torch.randn(1, 3, h) * 0.05, 10.0)
        assert tuple(res.tensor.shape) == (1, 3, h)
        assert bool(torch.isfinite(res.tensor).all())
    finally:
        await ch.close()


async def _attack_round(m: TestMesh, entry: Any) -> None:
    ctx = m.client_ssl("node-a", expect="node-b")
    await _garbage_tcp(m)
    await _garbage_http(m, ctx)
    await _garbage_frames(m, ctx)
    await _refused_open(m, entry, "weights_mismatch", weights_sha256="0" * 64)
    await _refused_open(m, entry, "bad_request", start=10, end=20)
    await _refused_open(m, entry, "bad_request", start=0, end=14, max_length=0)
    await _refused_open(m, entry, "bad_request", start=0, end=14, lane=9)
    await _refused_open(m, entry, "bad_request", start=0, end=14, ref="x" * 65)
    await _refused_open(m, entry, "bad_request", start=0, end=14,
                        fork={"ref": "a", "positions": 10 ** 9})
    await _refused_open(m, entry, "shard_unavailable",
                        shard_id=f"{entry.model_id}:15-29@node-b")
    await _refused_open(m, entry, "auth_failed", signed=False)
    await _bad_steps(m, entry)


# ---- tests (in this order: the last one kills the orchestrator) ----

async def test_broken_opens_and_steps_do_not_disturb_a_running_session(
        mesh, smollm2, reference):
    started = asyncio.Event()
    chat = asyncio.create_task(_chat(mesh, started))
    await asyncio.wait_for(started.wait(), 60)
    rounds = 0
    while not chat.done() or rounds == 0:  # attack node-b for as long as the chat runs
        await _attack_round(mesh, smollm2)
        rounds += 1
    frames = await chat
    assert frames[-1]["type"] == "done", frames[-1]
    assert [f["token_id"] for f in frames if f["type"] == "token_delta"] == reference
    assert all(f["status"] == "ok" for f in frames if f["type"] == "shard_status")
    assert frames[-1]["failovers"] == 0
    assert any(s.startswith(f"{smollm2.model_id}:0-14@node-b") for s in frames[-1]["pipeline"])
    await _wait_for(lambda: _gauge(mesh, "node-b") == 0, "node-b's sessions to close")


async def test_dropped_connection_frees_the_session(mesh, smollm2):
    ch = await _session(mesh, smollm2)
    h = int(ch.accepted["hidden_size"])
    await ch.step(1, 0, torch.randn(1, 4, h) * 0.05, 10.0)  # a KV cache now exists
    assert _gauge(mesh, "node-b") == 1
    ch.connection.transport.abort()  # the caller vanishes: no CLOSE, no goodbye
    await _wait_for(lambda: _gauge(mesh, "node-b") == 0, "node-b to free the dropped session")
    await ch.close()


async def test_killed_caller_process_frees_every_session(mesh):
    args = chat_args(PROMPT, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32",
                     timeout_s=10.0)
    seen: list[float] = []
    with pytest.raises(HearthNetError):  # the node we were talking to dies under us
        async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args):
            if f["type"] == "token_delta" and f["index"] == 3:
                seen = [_gauge(mesh, "node-b"), _gauge(mesh, "node-c")]
                mesh.kill("node-a")  # SIGKILL: the orchestrator never closes its sessions
    assert seen == [1, 1]  # each shard held the call's session when the caller died
    await _wait_for(lambda: _gauge(mesh, "node-b") == 0 and _gauge(mesh, "node-c") == 0,
              "the shards to free the dead caller's sessions")


def test_a_shard_only_host_loads_no_head_at_start(mesh):
    """`prepare_heads_at_start = false` keeps a shard host's memory for its layers (a 7B
    head in fp32 is 4.4 GB); the orchestrating node still prepares the head ahead of
    calls, once it sees the model covered."""
    deadline = time.monotonic() + 60
    while "head_load_started" not in mesh.log_text("node-a"):
        assert time.monotonic() < deadline, "node A never prepared the covered model's head"
        time.sleep(0.2)
    assert "head_load_started" not in mesh.log_text("node-b")
    assert "head_load_started" in mesh.log_text("node-c")
