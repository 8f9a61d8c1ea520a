"""The KV cache, the memory budget and shard sessions on the CPU with the real SmolLM2
(issue 13 §1-§5); the pure device checks are in tests/unit/test_device.py."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from hearthnet.distributed_inference.engine.kv_cache import capacity_for, slot_bytes
from hearthnet.distributed_inference.engine.layers import LayeredSession, LayeredStack
from hearthnet.distributed_inference.shard.server import OpenRequest, ShardServer, ShardSettings
from hearthnet.errors import ConfigError, ShardUnavailable
from tests.helpers.scripted_stream import ScriptedStream, Step

H = 576  # SmolLM2's hidden size


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_shard_asked_for_an_absent_gpu_does_not_start(smollm2):
    with ThreadPoolExecutor(1) as ex, pytest.raises(ConfigError, match="no CUDA GPU"):
        ShardServer(smollm2, 0, 3, node_id="n1", endpoint="ws://127.0.0.1:1",
                    settings=ShardSettings(device="cuda"), executor=ex)


def test_cache_is_preallocated_and_updated_in_place(smollm2):
    stack = LayeredStack(smollm2, 0, 3)
    s = stack.open_session(0, 3, 40)
    slot = s.slot
    assert slot.capacity == capacity_for(40) == 256
    assert slot.nbytes == slot_bytes(stack.config, 4, 256, torch.float32)
    ptrs = [k.data_ptr() for k in slot.keys]
    torch.manual_seed(0)
    xs = torch.randn(1, 12, H)
    outs = [s.forward(xs[:, :8], 0)] + [s.forward(xs[:, i:i + 1], i) for i in range(8, 12)]
    assert [k.data_ptr() for k in slot.keys] == ptrs  # written by index, never regrown
    whole = stack.open_session(0, 3, 40).forward(xs, 0)  # the same positions in one pass
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-4, atol=1e-4)


def test_redo_after_decoding_rewinds_the_cache(smollm2):
    """A redo (failover replay, M26 §5.4) at an earlier position sees none of the entries
    written after it: the result equals a fresh session fed the final sequence."""
    stack = LayeredStack(smollm2, 0, 3)
    torch.manual_seed(1)
    xs, alt = torch.randn(1, 10, H), torch.randn(1, 3, H)
    s = stack.open_session(0, 3, 32)
    s.forward(xs[:, :6], 0)
    for i in range(6, 10):
        s.forward(xs[:, i:i + 1], i)
    redo = s.forward(alt, 5)  # positions 5..7 again, different values
    assert s.length == 8
    step = s.forward(xs[:, 9:10], 8)
    fresh = stack.open_session(0, 3, 32).forward(
        torch.cat([xs[:, :5], alt, xs[:, 9:10]], dim=1), 0)
    torch.testing.assert_close(torch.cat([redo, step], dim=1), fresh[:, 5:], rtol=1e-4,
                               atol=1e-4)


def test_closed_sessions_leave_their_slot_for_the_next(smollm2):
    stack = LayeredStack(smollm2, 0, 3)
    a = stack.open_session(0, 3, 20)
    slot = a.slot
    a.close()
    b = stack.open_session(0, 3, 100)  # same capacity (256): the same buffers
    assert b.slot is slot and b.length == 0
    c = stack.open_session(0, 3, 100)  # b holds it: a new one
    assert c.slot is not slot


def _tight_stack(entry: Any, slots: float) -> LayeredStack:
    """Layers 0-3 under a budget of their weights plus about `slots` caches of 256."""
    probe = LayeredStack(entry, 0, 3)
    weights, one = probe.held_bytes(), slot_bytes(probe.config, 4, 256, torch.float32)
    return LayeredStack(entry, 0, 3, budget_mb=math.ceil((weights + slots * one) / 2**20))


def test_weights_over_the_budget_are_refused_at_load(smollm2):
    with pytest.raises(ShardUnavailable, match="shard_max_vram_mb"):
        LayeredStack(smollm2, 0, 3, budget_mb=1)


def test_open_over_the_budget_is_refused_and_idle_caches_make_room(smollm2):
    stack = _tight_stack(smollm2, 2.0)  # the weights and two caches of 256 positions
    a, b = stack.open_session(0, 3, 50), stack.open_session(0, 3, 50)
    with pytest.raises(ShardUnavailable, match="shard_max_vram_mb") as e:
        stack.open_session(0, 3, 50)
    assert e.value.details["reason"] == "memory_budget"
    slot = a.slot
    a.close()
    c = stack.open_session(0, 3, 50)  # the closed session's cache is reused
    assert c.slot is slot
    used = stack.held_bytes()
    b.close()
    c.close()
    assert stack.held_bytes() == used  # idle caches are kept for reuse, still counted
    longer = stack.open_session(0, 3, 300)  # 512 positions: the idle ones are freed first
    assert longer.slot.capacity == 512 and not stack._idle


def _server(entry: Any, ex: ThreadPoolExecutor, **kw: Any) -> ShardServer:
    return ShardServer(entry, 0, 3, node_id="n1", endpoint="ws://127.0.0.1:1",
                       settings=ShardSettings(device="cpu", **kw), executor=ex)


def _req(server: ShardServer, max_length: int = 16) -> OpenRequest:
    return OpenRequest(server.shard_id, 0, 3, max_length, "fp32", "test")


async def test_shard_refuses_an_open_over_budget_as_shard_unavailable(smollm2):
    """The budget is the start check's plan for one session of 16 tokens (a 256-position
    cache); an open whose real cache would not fit beside the weights (here one longer
    than planned, as `validate_open` would also refuse) is refused before it is accepted."""
    from hearthnet.distributed_inference.engine.memory import plan_shard

    limit = plan_shard(smollm2, 0, 3, "fp32", 1, 16).total_mb
    with ThreadPoolExecutor(1) as ex:
        server = _server(smollm2, ex, max_vram_mb=limit, max_concurrent_streams=1,
                         max_session_tokens=16)
        await server.start()
        assert server.descriptor.device == "cpu" and server.descriptor.device_memory_mb > 0
        stream = ScriptedStream([])
        with pytest.raises(ShardUnavailable, match="shard_max_vram_mb"):
            await server.serve_session(stream, _req(server, max_length=300))
        assert stream.accepted is None and server.active == 0  # refused before accept
        ok = ScriptedStream([Step(0, 0, torch.randn(1, 4, H))])
        await server.serve_session(ok, _req(server, max_length=16))  # the planned one fits
        assert ok.accepted is not None and len(ok.sent) == 1


async def test_out_of_memory_in_a_step_ends_that_session_only(smollm2, monkeypatch):
    x = torch.randn(1, 4, H)
    real = LayeredSession.forward
    boom = {"on": True}

    def forward(self: LayeredSession, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        if boom["on"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, hidden, start_pos)

    monkeypatch.setattr(LayeredSession, "forward", forward)
    with ThreadPoolExecutor(1) as ex:
        server = _server(smollm2, ex)
        await server.start()
        hit = ScriptedStream([Step(0, 0, x), Step(1, 4, x[:, :1])])
        await server.serve_session(hit, _req(server))
        assert len(hit.errors) == 1 and isinstance(hit.errors[0], ShardUnavailable)
        assert hit.errors[0].details["reason"] == "device_out_of_memory"
        assert hit.steps and not hit.sent  # the session ended at the failed step
        boom["on"] = False
        ok = ScriptedStream([Step(0, 0, x), Step(1, 4, x[:, :1])])
        await asyncio.wait_for(server.serve_session(ok, _req(server)), 60)
        assert [s for s, _ in ok.sent] == [0, 1] and not ok.errors and server.active == 0
