"""CapabilityBus over a real WebSocket on 127.0.0.1: every call ends typed (issue 10 §1)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import pytest
from websockets.asyncio.server import ServerConnection, serve

from hearthnet.errors import (
    BadRequest,
    ConnectionLost,
    ProtocolError,
    ShardUnavailable,
)
from hearthnet.mesh.bus import CapabilityBus, bus_call, raise_for_error
from hearthnet.observability import configure_logging

Frame = dict[str, Any]


async def _frames(n: int, fail: BaseException | None = None) -> AsyncIterator[Frame]:
    for i in range(n):
        yield {"type": "token_delta", "index": i}
    if fail is not None:
        raise fail


def _bus() -> CapabilityBus:
    bus = CapabilityBus()
    bus.register("ok", lambda args: _frames(int(args.get("n", 2))))
    bus.register("typed", lambda args: _frames(1, ShardUnavailable("no cover for layer 7")))
    bus.register("bug", lambda args: _frames(1, RuntimeError("secret 0.1234 activations")))
    return bus


async def _serve(handler: Callable[[ServerConnection], Awaitable[None]]) -> Any:
    return await serve(handler, "127.0.0.1", 0)


async def _call(handler: Callable[[ServerConnection], Awaitable[None]], capability: str,
                args: dict[str, Any] | None = None) -> list[Frame]:
    async with await _serve(handler) as server:
        port = server.sockets[0].getsockname()[1]
        return [f async for f in bus_call(f"ws://127.0.0.1:{port}", capability, args or {})]


async def test_a_call_streams_its_frames_then_ends() -> None:
    frames = await _call(_bus().serve_connection, "ok", {"n": 3})
    assert frames == [{"type": "token_delta", "index": i} for i in range(3)]


async def test_a_typed_failure_is_the_last_frame() -> None:
    frames = await _call(_bus().serve_connection, "typed")
    assert frames[0] == {"type": "token_delta", "index": 0}
    assert frames[1:] == [{"type": "error", "code": "shard_unavailable",
                           "message": "no cover for layer 7"}]
    with pytest.raises(ShardUnavailable):
        raise_for_error(frames[-1])


async def test_an_unexpected_exception_becomes_an_internal_error_frame(
        capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()  # the node's logging, writing to this test's stderr
    frames = await _call(_bus().serve_connection, "bug")
    assert frames[0]["type"] == "token_delta"
    (err,) = frames[1:]
    assert err["type"] == "error" and err["code"] == "internal"
    assert "see its log" in err["message"]
    assert "0.1234" not in err["message"]  # the caller never sees the exception's text
    logged = capsys.readouterr().err
    line = next(json.loads(x) for x in logged.splitlines() if "bus_call_failed" in x)
    assert line["capability"] == "bug" and line["level"] == "error"
    assert "Traceback" in line["exception"] and "RuntimeError" in line["exception"]
    assert "fail =" not in logged  # a plain traceback: no local variables


async def test_unknown_capability_and_malformed_calls_are_bad_requests() -> None:
    frames = await _call(_bus().serve_connection, "nope")
    assert [f["code"] for f in frames] == ["bad_request"]
    assert "'nope'" in frames[0]["message"] and "['bug', 'ok', 'typed']" in frames[0]["message"]
    with pytest.raises(BadRequest):
        _bus().call("nope", {})

    async with await _serve(_bus().serve_connection) as server:
        port = server.sockets[0].getsockname()[1]
        from websockets.asyncio.client import connect

        async with connect(f"ws://127.0.0.1:{port}/bus") as ws:
            await ws.send(b"\xc1")
            replies = [msgpack.unpackb(r) async for r in ws]
    assert replies[0]["code"] == "bad_request" and "malformed" in replies[0]["message"]
    assert replies[-1] == {"type": "end"}


async def test_a_stream_that_ends_without_end_raises_connection_lost() -> None:
    async def truncating(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.send(msgpack.packb({"type": "token_delta", "index": 0}))
        await ws.close()  # a clean close, but no end frame: the answer is truncated

    seen: list[Frame] = []
    with pytest.raises(ConnectionLost, match="without its end frame"):
        async with await _serve(truncating) as server:
            port = server.sockets[0].getsockname()[1]
            async for f in bus_call(f"ws://127.0.0.1:{port}", "ok", {}):
                seen.append(f)
    assert seen == [{"type": "token_delta", "index": 0}]


async def test_a_malformed_reply_frame_is_a_protocol_error() -> None:
    async def bad(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.send(msgpack.packb([1, 2]))

    with pytest.raises(ProtocolError, match="msgpack map"):
        await _call(bad, "ok")


async def test_an_unreachable_node_is_connection_lost() -> None:
    from hearthnet.mesh.launcher import free_port

    with pytest.raises(ConnectionLost, match="cannot reach"):
        [f async for f in bus_call(f"ws://127.0.0.1:{free_port()}", "ok", {},
                                   open_timeout=5)]


async def test_a_handlers_value_error_is_internal_not_the_callers_bad_request() -> None:
    """Only the request's own decoding makes a `bad_request`: a ValueError (or TypeError)
    raised by a capability is a bug on this node, reported as ``internal``."""
    bus = _bus()
    bus.register("value_bug", lambda args: _frames(1, ValueError("not the caller's fault")))
    bus.register("type_bug", lambda args: _frames(0, TypeError("unpackable")))
    for capability in ("value_bug", "type_bug"):
        frames = await _call(bus.serve_connection, capability)
        assert frames[-1]["type"] == "error" and frames[-1]["code"] == "internal", frames
