"""A shard whose forward raises: a typed step error, a clean session end (issue 10 §1).

Real transport (`TensorChannel` ↔ `ServerStream` on 127.0.0.1), a `ShardServer` with a
stand-in stack whose forward fails on cue — no model weights needed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from hearthnet.distributed_inference.engine.memory import MemoryPlan
from hearthnet.distributed_inference.shard import server as shard_module
from hearthnet.distributed_inference.shard.server import ShardServer, ShardSettings
from hearthnet.errors import ConnectionLost, HearthNetError, StepFailed
from hearthnet.models.store import ModelEntry
from hearthnet.observability import configure_logging
from hearthnet.transport.websocket import ServerStream, TensorChannel, serve
from tests.helpers.waiting import wait_until

HIDDEN = 8
SECRET = 0.123456789  # a value no log line may ever contain


class Session:
    def __init__(self, stack: Stack, fail_at: int) -> None:
        self.stack, self.calls, self.fail_at, self.closed = stack, 0, fail_at, False

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            torch.ones(2, 3) @ x.float()[0].T
        return x.float() + 1

    def close(self) -> None:
        self.closed = True


class Stack:
    hidden_size = HIDDEN
    dtype = torch.float32
    device = torch.device("cpu")
    format = "fp32"

    def __init__(self, fail_at: int) -> None:
        self.sessions: list[Session] = []
        self.fail_at = fail_at

    def open_session(self, start: int, end: int, max_length: int) -> Session:
        self.sessions.append(Session(self, self.fail_at))
        return self.sessions[-1]


@pytest.fixture
async def shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                ) -> AsyncIterator[tuple[ShardServer, Stack, str]]:
    # no weights on disk: the memory plan is the stand-in's, not read from safetensors
    monkeypatch.setattr(shard_module, "plan_shard", lambda *a: MemoryPlan(0, 0, 0))
    entry = ModelEntry(model_id="org/m", alias="m", weights_sha256="ab" * 32, num_layers=4,
                       hidden_size=HIDDEN, model_type="llama", dtype="float32", source="test",
                       path=tmp_path)
    with ThreadPoolExecutor(1) as pool:
        server = ShardServer(entry, 0, 3, node_id="node-s", endpoint="ws://127.0.0.1:1",
                             settings=ShardSettings(), executor=pool)
        stack = Stack(fail_at=2)
        server.stack = stack  # type: ignore[assignment]

        async def handler(stream: ServerStream) -> None:
            req = server.validate_open(stream.open_params, caller="node-c")
            await server.serve_session(stream, req)

        async with await serve(handler, "127.0.0.1", 0) as ws:
            port = ws.sockets[0].getsockname()[1]
            yield server, stack, f"ws://127.0.0.1:{port}/shard"


def _open_params(server: ShardServer) -> dict[str, object]:
    return {"shard_id": server.shard_id, "model_id": "org/m", "weights_sha256": "ab" * 32,
            "start": 0, "end": 3, "max_length": 16, "wire_dtype": "fp32"}


async def test_forward_failure_is_a_typed_step_error_and_the_session_ends(
        shard: tuple[ShardServer, Stack, str], capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()
    server, stack, uri = shard
    ch = await TensorChannel.connect(uri, _open_params(server), deadline_s=10)
    x = torch.full((1, 1, HIDDEN), SECRET)
    out = await ch.step(0, 0, x)
    assert torch.equal(out.tensor, x + 1)
    with pytest.raises(StepFailed) as info:
        await ch.step(1, 1, x)
    err = info.value
    assert err.code == "step_failed" and err.details.get("step") == 1
    assert server.shard_id in err.message and "RuntimeError" in err.message
    with pytest.raises(HearthNetError):  # the session is over: no silent reuse
        await ch.step(2, 2, x)
    await ch.close()
    await wait_until(lambda: stack.sessions[0].closed and server.active == 0,
                     "the failed session's KV cache is freed")
    logged = capsys.readouterr().err
    line = next(json.loads(x) for x in logged.splitlines() if "shard_forward_failed" in x)
    assert line["step"] == 1 and "Traceback" in line["exception"]
    assert str(SECRET)[:8] not in logged  # shapes in the traceback, never values


async def test_the_shard_serves_new_sessions_after_a_failure(
        shard: tuple[ShardServer, Stack, str]) -> None:
    server, stack, uri = shard
    stack.fail_at = 1
    ch = await TensorChannel.connect(uri, _open_params(server), deadline_s=10)
    with pytest.raises(StepFailed):
        await ch.step(0, 0, torch.zeros(1, 1, HIDDEN))
    await ch.close()
    stack.fail_at = 0
    ch = await TensorChannel.connect(uri, _open_params(server), deadline_s=10)
    try:
        out = await ch.step(0, 0, torch.zeros(1, 2, HIDDEN))
        assert out.tensor.shape == (1, 2, HIDDEN)
    finally:
        await ch.close()
    with pytest.raises(ConnectionLost):
        await ch.step(1, 2, torch.zeros(1, 1, HIDDEN))
