"""Tensor streams over real sockets on 127.0.0.1 (hearthnet/transport/websocket.py).

The second tier of the transport tests: a real `websockets` server and client, real TCP.
Deadlines are short so the suite stays fast; nothing here asserts on speed (that is
`hearthnet bench transport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgpack
import pytest
import torch
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed

from hearthnet.errors import (
    BadRequest,
    ConnectionLost,
    HearthNetError,
    StreamStalled,
    WeightsMismatch,
)
from hearthnet.loop import run
from hearthnet.transport import websocket
from hearthnet.transport.bench import EchoPeer
from hearthnet.transport.codec import max_frame_bytes
from hearthnet.transport.protocol import Role, StreamProtocol
from hearthnet.transport.websocket import (
    SHARD_PATH,
    ServerStream,
    StepInput,
    TensorChannel,
    serve,
)
from tests.helpers.waiting import wait_until

torch.set_num_threads(1)

Handler = Callable[[ServerStream], Awaitable[None]]


@contextlib.asynccontextmanager
async def shard_server(handler: Handler, **kw: Any) -> AsyncIterator[str]:
    server = await serve(handler, "127.0.0.1", 0, **kw)
    try:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}{SHARD_PATH}"
    finally:
        server.close()
        await server.wait_closed()


async def echo(stream: ServerStream) -> None:
    await stream.accept({"shard_id": "echo"})
    while (inp := await stream.recv_step()) is not None:
        await stream.send_step(inp.step, inp.start_pos, inp.tensor, compute_us=123)


def hidden(tokens: int, size: int) -> torch.Tensor:
    return torch.randn(1, tokens, size).to(torch.float16)  # (B, T, hidden)


def ws_frame(payload: bytes, *, mask: bool) -> bytes:
    """One unfragmented binary WebSocket frame (RFC 6455 §5.2), for raw peers."""
    n = len(payload)
    head = bytes([0x82])
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 65536:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if not mask:
        return head + payload
    key = b"\x01\x02\x03\x04"
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


# -- the happy path ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [576, 3072])
async def test_decode_steps_round_trip_with_the_shards_compute_time(size: int) -> None:
    async with shard_server(echo) as uri:
        ch = await TensorChannel.connect(uri, {"wire_dtype": "fp16", "model": "m"})
        assert ch.accepted == {"shard_id": "echo"} and ch.window == 16
        for i in range(50):
            x = hidden(1, size)
            r = await ch.step(i, 100 + i, x)
            assert (r.step, r.start_pos, r.compute_us) == (i, 100 + i, 123)
            assert torch.equal(r.tensor, x)
        assert ch.bytes_sent >= 50 * (48 + 2 * size)
        assert ch.bytes_received >= 50 * (48 + 2 * size)
        await ch.close()
        await ch.close()  # idempotent


async def test_prefill_of_8_mib_crosses_in_at_least_8_chunks_and_arrives_intact() -> None:
    seen: list[int] = []

    async def counting_echo(stream: ServerStream) -> None:
        await stream.accept()
        while (inp := await stream.recv_step()) is not None:
            seen.append(stream.protocol.chunks_received)
            await stream.send_step(inp.step, inp.start_pos, inp.tensor)

    async with shard_server(counting_echo) as uri:
        ch = await TensorChannel.connect(uri, {"wire_dtype": "fp16"})
        x = hidden(2048, 2048)
        assert x.numel() * x.element_size() == 8 << 20
        r = await ch.step(0, 0, x)
        assert torch.equal(r.tensor, x)
        assert seen == [8] and ch.protocol.chunks_sent == 8
        assert ch.protocol.chunks_received == 8
        await ch.close()


@pytest.mark.parametrize("wire", ["bf16", "fp32"])
async def test_wire_dtype_from_open_params_is_what_both_sides_get(wire: str) -> None:
    async with shard_server(echo) as uri:
        ch = await TensorChannel.connect(uri, {"wire_dtype": wire})
        x = torch.randn(1, 3, 64)  # fp32; converted to the wire dtype on send
        r = await ch.step(0, 0, x)
        assert r.tensor.dtype == ch.wire_dtype and torch.equal(r.tensor, x.to(ch.wire_dtype))
        await ch.close()


async def test_socket_has_nodelay_and_no_compression() -> None:
    async with shard_server(echo) as uri:
        ch = await TensorChannel.connect(uri, {})
        sock = ch.connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert ch.connection.response is not None
        assert "Sec-WebSocket-Extensions" not in ch.connection.response.headers
        assert await ch.ping() > 0
        await ch.close()


async def test_client_close_ends_the_server_session() -> None:
    ended: list[StepInput | None] = []

    async def recorder(stream: ServerStream) -> None:
        await stream.accept()
        ended.append(await stream.recv_step())

    async with shard_server(recorder) as uri:
        ch = await TensorChannel.connect(uri, {})
        await ch.close("chat finished")
        await wait_until(lambda: bool(ended), "server saw the close")
        assert ended == [None]
        with pytest.raises(ConnectionLost):
            await ch.step(0, 0, hidden(1, 8))


def test_runs_on_uvloop() -> None:
    async def main() -> tuple[str, bool]:
        async with shard_server(echo) as uri:
            ch = await TensorChannel.connect(uri, {})
            x = hidden(1, 576)
            ok = torch.equal((await ch.step(0, 0, x)).tensor, x)
            await ch.close()
            return type(asyncio.get_running_loop()).__module__, ok

    module, ok = run(main())
    assert module.startswith("uvloop") and ok


# -- backpressure (docs/protocol.md §6) --------------------------------------------------------


async def test_paused_receiver_stops_the_sender_at_the_window_with_bounded_memory() -> None:
    window, chunk = 4, 1024
    release = asyncio.Event()
    streams: list[ServerStream] = []
    got: list[torch.Tensor] = []

    async def paused(stream: ServerStream) -> None:
        streams.append(stream)
        await stream.accept()
        await release.wait()  # the application does not consume...
        while (inp := await stream.recv_step()) is not None:  # ...until released
            got.append(inp.tensor)

    async with shard_server(paused, window=window, chunk_bytes=chunk) as uri:
        ch = await TensorChannel.connect(uri, {}, window=window, chunk_bytes=chunk)
        tensors = [torch.full((4, 256), float(i), dtype=torch.float16) for i in range(32)]
        tensor_bytes = 4 * 256 * 2  # 2 KiB = 2 chunks each

        async def sender() -> None:
            for i, t in enumerate(tensors):
                await ch.send_step(i, 0, t)

        task = asyncio.create_task(sender())
        await wait_until(lambda: ch.protocol.blocked, "sender blocked on credit")
        sent = ch.protocol.chunks_sent
        assert ch.protocol.in_flight == window
        await asyncio.sleep(0.3)  # nothing more moves while the receiver is paused
        assert ch.protocol.chunks_sent == sent and not task.done()
        server = streams[0].protocol
        assert server.chunks_received == sent
        assert server.buffered_bytes <= 2 * tensor_bytes  # one held + one in progress
        assert ch.connection.transport.get_write_buffer_size() == 0
        assert sent < 32 * 2
        release.set()
        await asyncio.wait_for(task, 10)
        await wait_until(lambda: len(got) == 32, "all tensors consumed")
        assert all(torch.equal(a, b) for a, b in zip(got, tensors, strict=True))
        assert ch.protocol.in_flight <= window
        await ch.close()


# -- failures -----------------------------------------------------------------------------


async def test_peer_that_disappears_gives_connection_lost_before_the_deadline() -> None:
    async def crashes(stream: ServerStream) -> None:
        await stream.accept()
        await stream.recv_step()
        stream.connection.transport.abort()  # as a crashed host: RST, no close frame

    async with shard_server(crashes) as uri:
        ch = await TensorChannel.connect(uri, {}, deadline_s=20)
        with pytest.raises(ConnectionLost):  # not StreamStalled: long before 20 s
            await ch.step(0, 0, hidden(1, 576))
        await ch.close()


async def test_killed_peer_process_gives_connection_lost() -> None:
    with EchoPeer() as peer:
        ch = await TensorChannel.connect(peer.uri, {"wire_dtype": "fp16"}, deadline_s=20)
        x = hidden(1, 576)
        assert torch.equal((await ch.step(0, 0, x)).tensor, x)
        peer.kill()
        with pytest.raises(ConnectionLost):
            await ch.step(1, 1, x)
        await ch.close()


async def test_silent_peer_raises_stream_stalled_at_the_deadline() -> None:
    server_saw: list[BaseException] = []

    async def silent(stream: ServerStream) -> None:
        await stream.accept()
        await stream.recv_step(deadline_s=30)
        try:
            await stream.recv_step(deadline_s=30)
        except HearthNetError as exc:
            server_saw.append(exc)

    async with shard_server(silent) as uri:
        ch = await TensorChannel.connect(uri, {})
        with pytest.raises(StreamStalled) as info:
            await ch.step(0, 0, hidden(1, 576), deadline_s=0.5)
        assert info.value.code == "stream_stalled"
        with pytest.raises(StreamStalled):  # the session is failed for good
            await ch.step(1, 1, hidden(1, 576))
        await ch.close()
        await wait_until(lambda: bool(server_saw), "server told of the stall")
        assert type(server_saw[0]) is StreamStalled


async def test_progress_pings_keep_a_step_open_only_up_to_the_busy_bound(monkeypatch) -> None:
    """docs/protocol.md §3.6a: a shard's PINGs re-arm the client's step deadline, but a
    shard that only ever PINGs is stalled after `BUSY_STEP_FACTOR` deadlines."""
    monkeypatch.setattr(websocket, "BUSY_STEP_FACTOR", 3.0)
    monkeypatch.setattr(websocket, "PROGRESS_EVERY_S", 0.0)
    stop = asyncio.Event()

    async def busy_forever(stream: ServerStream) -> None:
        await stream.accept()
        await stream.recv_step()
        since = asyncio.get_running_loop().time()
        while not stop.is_set() and not stream.closed:
            stream.progress(since)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)

    async with shard_server(busy_forever) as uri:
        ch = await TensorChannel.connect(uri, {})
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StreamStalled):
            await ch.step(0, 0, hidden(1, 576), deadline_s=0.3)
        took = loop.time() - t0
        stop.set()
        await ch.close()
    assert ch.progress_pings >= 3  # the deadline was re-armed, again and again ...
    assert 0.85 <= took < 2.0, took  # ... and still ended at 3 deadlines


async def test_slowloris_shard_is_cut_off_at_the_deadline() -> None:
    cut = asyncio.Event()
    written: list[int] = []

    async def slow_shard(ws: ServerConnection) -> None:
        proto = StreamProtocol(Role.SERVER)
        proto.receive_data(await ws.recv(decode=False))
        proto.events_received()
        proto.send_accept({})
        for f in proto.data_to_send():
            await ws.send(f)
        proto.receive_data(await ws.recv(decode=False))
        (step,) = proto.events_received()
        proto.send_step(0, 0, step.tensor)  # type: ignore[union-attr]
        (out,) = proto.data_to_send()
        raw = ws_frame(bytes(out), mask=False)
        try:
            for b in raw:  # one byte at a time
                if ws.transport.is_closing():
                    break
                ws.transport.write(bytes([b]))
                written.append(b)
                await asyncio.sleep(0.5)
        except RuntimeError:  # the client's close reached websockets first: it half-closed
            pass              # the transport (write_eof), so the next write is refused
        finally:
            cut.set()

    async with ws_serve(slow_shard, "127.0.0.1", 0, compression=None) as server:
        uri = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/shard"
        ch = await TensorChannel.connect(uri, {})
        with pytest.raises(StreamStalled):
            await ch.step(0, 0, hidden(1, 576), deadline_s=1.5)
        await ch.close()
        await asyncio.wait_for(cut.wait(), 10)
        assert 0 < len(written) < 48 + 2 * 576  # cut off long before the frame was out


async def test_slowloris_client_is_cut_off_by_the_servers_deadline() -> None:
    server_saw: list[BaseException] = []

    async def shard(stream: ServerStream) -> None:
        await stream.accept()
        try:
            await stream.recv_step()  # default deadline of the stream: 1.5 s
        except HearthNetError as exc:
            server_saw.append(exc)
            raise

    async with shard_server(shard, deadline_s=1.5) as uri:
        async with ws_connect(uri, compression=None) as ws:
            proto = StreamProtocol(Role.CLIENT)
            proto.send_open({})
            for f in proto.data_to_send():
                await ws.send(f)
            proto.receive_data(await ws.recv(decode=False))
            proto.send_step(0, 0, hidden(1, 576))
            (inp,) = proto.data_to_send()
            for b in ws_frame(bytes(inp), mask=True):
                if ws.transport.is_closing():
                    break
                ws.transport.write(bytes([b]))
                await asyncio.sleep(0.5)
            await asyncio.wait_for(ws.wait_closed(), 10)
        assert len(server_saw) == 1 and isinstance(server_saw[0], StreamStalled)


async def test_oversized_message_is_refused_by_websockets_with_1009() -> None:
    async with shard_server(echo, chunk_bytes=1024) as uri:
        async with ws_connect(uri, compression=None) as ws:
            await ws.send(bytes(max_frame_bytes(1024) + 1))
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1009
        ch = await TensorChannel.connect(uri, {}, chunk_bytes=1024)  # server still serves
        await ch.close()


async def test_oversized_message_from_a_shard_is_connection_lost_for_the_client() -> None:
    async def rogue(ws: ServerConnection) -> None:
        proto = StreamProtocol(Role.SERVER)
        proto.receive_data(await ws.recv(decode=False))
        proto.send_accept({})
        for f in proto.data_to_send():
            await ws.send(f)
        await ws.recv()
        with contextlib.suppress(ConnectionClosed):
            await ws.send(bytes(200_000))
            await ws.wait_closed()

    async with ws_serve(rogue, "127.0.0.1", 0, compression=None, max_size=None) as server:
        uri = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/shard"
        ch = await TensorChannel.connect(uri, {}, chunk_bytes=1024)
        with pytest.raises(ConnectionLost, match="1009"):  # websockets refused it by size
            await ch.step(0, 0, hidden(1, 64))
        await ch.close()


async def test_version_mismatch_is_refused_with_a_clear_error_and_1002() -> None:
    async with shard_server(echo) as uri, ws_connect(uri, compression=None) as ws:
        await ws.send(struct.pack("<BBHIIIQ", 1, 0, 2, 1, 16, 1 << 20, 1 << 28)
                      + msgpack.packb({}))
        reply = await ws.recv(decode=False)
        assert reply[:2] == b"\x06\x01"  # fatal ERROR
        body = msgpack.unpackb(reply[4:])
        assert body["code"] == "protocol_error" and "version 2" in body["message"]
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1002


async def test_garbage_is_answered_and_the_server_keeps_serving() -> None:
    async with shard_server(echo) as uri:
        async with ws_connect(uri, compression=None) as ws:
            await ws.send(b"GET / HTTP/1.1")
            reply = await ws.recv(decode=False)
            assert msgpack.unpackb(reply[4:])["code"] == "protocol_error"
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 1002
        ch = await TensorChannel.connect(uri, {})
        x = hidden(1, 576)
        assert torch.equal((await ch.step(0, 0, x)).tensor, x)
        await ch.close()


async def test_refused_open_raises_the_servers_error_class() -> None:
    async def refuses(stream: ServerStream) -> None:
        await stream.refuse(WeightsMismatch("this shard serves other weights",
                                            expected=stream.open_params.get("sha")))

    async with shard_server(refuses) as uri:
        with pytest.raises(WeightsMismatch) as info:
            await TensorChannel.connect(uri, {"sha": "abc"})
        assert info.value.details == {"expected": "abc"}


async def test_step_error_keeps_the_session_open() -> None:
    async def picky(stream: ServerStream) -> None:
        await stream.accept()
        while (inp := await stream.recv_step()) is not None:
            if inp.step == 1:
                await stream.send_error(BadRequest("start_pos beyond max length"), step=1)
            else:
                await stream.send_step(inp.step, inp.start_pos, inp.tensor)

    async with shard_server(picky) as uri:
        ch = await TensorChannel.connect(uri, {})
        x = hidden(1, 64)
        await ch.step(0, 0, x)
        with pytest.raises(BadRequest, match="max length"):
            await ch.step(1, 1, x)
        assert torch.equal((await ch.step(2, 2, x)).tensor, x)
        await ch.close()


async def test_handler_crash_is_reported_and_the_server_keeps_serving() -> None:
    calls = []

    async def flaky(stream: ServerStream) -> None:
        calls.append(1)
        await stream.accept()
        if len(calls) == 1:
            await stream.recv_step()
            raise RuntimeError("bug in the shard")
        await echo_loop(stream)

    async def echo_loop(stream: ServerStream) -> None:
        while (inp := await stream.recv_step()) is not None:
            await stream.send_step(inp.step, inp.start_pos, inp.tensor)

    async with shard_server(flaky) as uri:
        ch = await TensorChannel.connect(uri, {})
        with pytest.raises(HearthNetError) as info:
            await ch.step(0, 0, hidden(1, 8))
        assert info.value.code == "internal"
        await ch.close()
        ch = await TensorChannel.connect(uri, {})
        await ch.step(0, 0, hidden(1, 8))
        await ch.close()


async def test_connect_failures_are_typed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(ConnectionLost):
        await TensorChannel.connect(f"ws://127.0.0.1:{port}/shard", {}, deadline_s=5)
    with pytest.raises(BadRequest):
        await TensorChannel.connect("http://127.0.0.1/shard", {})
    with pytest.raises(BadRequest):
        await TensorChannel.connect("ws://127.0.0.1:1/shard", {"wire_dtype": "int4"})

    async def never_answers(stream: ServerStream) -> None:
        with contextlib.suppress(HearthNetError):  # ends when the client gives up
            await stream.recv_step(deadline_s=30)

    async with shard_server(never_answers) as uri:
        with pytest.raises(ConnectionLost, match="404"):
            await TensorChannel.connect(uri.replace("/shard", "/gossip"), {})
        with pytest.raises(StreamStalled):
            await TensorChannel.connect(uri, {}, deadline_s=0.5)
