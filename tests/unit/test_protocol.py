"""The pure stream protocol (hearthnet/transport/protocol.py): bytes in, events and bytes out.

Mirrors python-websockets' tests/test_protocol.py: no sockets, no clock. docs/protocol.md
sections are cited where a test pins a rule down.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearthnet.constants import CloseCode
from hearthnet.errors import (
    BadRequest,
    FrameTooLarge,
    ProtocolError,
    ShardUnavailable,
    StreamStalled,
    WeightsMismatch,
)
from hearthnet.transport.codec import HEADER, encode_tensor
from hearthnet.transport.protocol import (
    PROTOCOL_VERSION,
    Accepted,
    CloseReceived,
    CreditReceived,
    ErrorReceived,
    Opcode,
    OpenRequested,
    PingReceived,
    PongReceived,
    ProtocolFailed,
    Role,
    State,
    StepReceived,
    StreamProtocol,
)

torch.set_num_threads(1)

STREAM = 42


def pump(src: StreamProtocol, dst: StreamProtocol) -> list[bytes]:
    """Deliver everything ``src`` has to send to ``dst``; return the frames."""
    frames = [bytes(f) for f in src.data_to_send()]
    for f in frames:
        dst.receive_data(f)
    return frames


def opened(window: int = 4, chunk_bytes: int = 64, max_tensor_bytes: int = 1 << 20,
           params: dict[str, Any] | None = None) -> tuple[StreamProtocol, StreamProtocol]:
    c = StreamProtocol(Role.CLIENT, window=window, chunk_bytes=chunk_bytes,
                       max_tensor_bytes=max_tensor_bytes)
    s = StreamProtocol(Role.SERVER, window=window, chunk_bytes=chunk_bytes,
                       max_tensor_bytes=max_tensor_bytes)
    c.send_open(params or {"wire_dtype": "fp16"}, stream_id=STREAM)
    pump(c, s)
    assert [type(e) for e in s.events_received()] == [OpenRequested]
    s.send_accept({})
    pump(s, c)
    assert [type(e) for e in c.events_received()] == [Accepted]
    return c, s


def failure(p: StreamProtocol) -> ProtocolFailed:
    events = p.events_received()
    assert len(events) == 1 and isinstance(events[0], ProtocolFailed), events
    assert p.state is State.FAILED
    return events[0]


def steps(p: StreamProtocol) -> list[StepReceived]:
    return [e for e in p.events_received() if isinstance(e, StepReceived)]


def fatal_error_frame(frames: list[bytes]) -> dict[str, Any]:
    (f,) = frames
    assert f[0] == Opcode.ERROR and f[1] == 1
    body: dict[str, Any] = msgpack.unpackb(f[4:])
    return body


def open_frame(version: int = PROTOCOL_VERSION, window: int = 4, chunk: int = 64,
               max_bytes: int = 1 << 20, flags: int = 0, body: bytes | None = None) -> bytes:
    packed = msgpack.packb({"wire_dtype": "fp16"}) if body is None else body
    return struct.pack("<BBHIIIQ", 1, flags, version, STREAM, window, chunk, max_bytes) + packed


def x(n: int = 32, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(1, 1, n).to(dtype)


# -- handshake (docs/protocol.md §3.1, §3.2) ---------------------------------------------------


def test_open_accept_negotiates_the_smaller_limits_and_carries_params() -> None:
    c = StreamProtocol(Role.CLIENT, window=16, chunk_bytes=4096, max_tensor_bytes=1000)
    s = StreamProtocol(Role.SERVER, window=8, chunk_bytes=8192, max_tensor_bytes=5000)
    c.send_open({"model": "smollm2", "layers": [0, 14], "wire_dtype": "bf16"}, stream_id=9)
    assert c.state is State.OPEN_SENT
    pump(c, s)
    (ev,) = s.events_received()
    assert ev == OpenRequested(9, PROTOCOL_VERSION, 8, 4096, 1000,
                               {"model": "smollm2", "layers": [0, 14], "wire_dtype": "bf16"})
    assert s.state is State.OPEN_RECEIVED
    s.send_accept({"shard_id": "m:0-14"})
    pump(s, c)
    assert c.events_received() == [Accepted(9, 8, 4096, 1000, {"shard_id": "m:0-14"})]
    assert c.state is s.state is State.OPEN
    assert c.window == s.window == 8 and c.credit == s.credit == 8
    assert c.wire_dtype is s.wire_dtype and c.wire_dtype.wire_name == "bf16"


def test_open_frame_layout() -> None:
    c = StreamProtocol(Role.CLIENT, window=16, chunk_bytes=1 << 20, max_tensor_bytes=1 << 28)
    c.send_open({"a": 1}, stream_id=0xAABBCCDD)
    (f,) = c.data_to_send()
    assert f[0] == 0x01 and f[1] == 0 and f[2:4] == b"\x01\x00"
    assert struct.unpack_from("<IIIQ", f, 4) == (0xAABBCCDD, 16, 1 << 20, 1 << 28)
    assert msgpack.unpackb(bytes(f[24:])) == {"a": 1}


def test_version_mismatch_is_a_clear_fatal_error_both_ways() -> None:
    s = StreamProtocol(Role.SERVER)
    s.receive_data(open_frame(version=2))
    ev = failure(s)
    assert isinstance(ev.error, ProtocolError) and ev.close_code == CloseCode.PROTOCOL_ERROR
    assert "version 2" in ev.error.message and "version 1" in ev.error.message
    out = [bytes(f) for f in s.data_to_send()]
    body = fatal_error_frame(out)
    assert body["code"] == "protocol_error" and body["details"]["peer_version"] == 2
    # the client on the other end gets the same error, rebuilt by its code
    c = StreamProtocol(Role.CLIENT)
    c.send_open({})
    c.data_to_send()
    c.receive_data(out[0])
    (got,) = c.events_received()
    assert isinstance(got, ErrorReceived) and got.fatal
    assert isinstance(got.error, ProtocolError) and "version 2" in got.error.message
    assert c.state is State.CLOSED


def test_version_is_checked_before_anything_else() -> None:
    s = StreamProtocol(Role.SERVER)
    s.receive_data(b"\x01\x00\x07\x00")  # too short for OPEN, but the version speaks first
    assert "version 7" in failure(s).error.message


@pytest.mark.parametrize(("data", "match"), [
    (open_frame(body=b"\xc1"), "not valid msgpack"),
    (open_frame(body=msgpack.packb([1, 2])), "not a map"),
    (open_frame(body=msgpack.packb({"wire_dtype": "int8"})), "int8"),
    (open_frame(window=0), "window 0"),
    (open_frame(chunk=10), "chunk size 10"),
    (open_frame(max_bytes=0), "tensor limit 0"),
    (open_frame(flags=2), "reserved"),
    (open_frame()[:20], "OPEN frame of 20 bytes"),
])
def test_malformed_open_fails_the_stream(data: bytes, match: str) -> None:
    s = StreamProtocol(Role.SERVER)
    s.receive_data(data)
    assert match in failure(s).error.message
    assert fatal_error_frame([bytes(f) for f in s.data_to_send()])["code"] == "protocol_error"


def test_accept_must_not_raise_limits_or_change_stream() -> None:
    for window, stream in ((8, STREAM), (4, STREAM + 1)):
        c = StreamProtocol(Role.CLIENT, window=4, chunk_bytes=64)
        c.send_open({}, stream_id=STREAM)
        c.data_to_send()
        f = bytearray(open_frame(window=window))
        f[0] = Opcode.ACCEPT
        struct.pack_into("<I", f, 4, stream)
        c.receive_data(bytes(f))
        assert failure(c).error.message.startswith("ACCEPT")


def test_refusal_is_a_fatal_error_with_the_callers_error_class() -> None:
    c = StreamProtocol(Role.CLIENT)
    s = StreamProtocol(Role.SERVER)
    c.send_open({})
    pump(c, s)
    s.events_received()
    s.send_error(WeightsMismatch("weights hash differs", expected="ab", got="cd"), fatal=True)
    assert s.state is State.CLOSED
    pump(s, c)
    (ev,) = c.events_received()
    assert isinstance(ev, ErrorReceived) and ev.fatal and ev.step is None
    assert isinstance(ev.error, WeightsMismatch) and ev.error.code == "weights_mismatch"
    assert ev.error.details == {"expected": "ab", "got": "cd"}
    assert c.state is State.CLOSED


# -- steps (docs/protocol.md §4) ---------------------------------------------------------------


@pytest.mark.parametrize("wire", ["fp16", "bf16", "fp32"])
def test_steps_cross_both_ways_with_their_header_fields(wire: str) -> None:
    c, s = opened(params={"wire_dtype": wire}, chunk_bytes=128, window=16)
    a = torch.randn(1, 7, 40)  # fp32 in: converted to the wire dtype on send
    assert c.send_step(3, 11, a) == 1
    pump(c, s)
    (inp,) = steps(s)
    assert (inp.opcode, inp.step, inp.start_pos, inp.compute_us) == (Opcode.INPUT, 3, 11, 0)
    assert torch.equal(inp.tensor, a.to(c.wire_dtype.torch_dtype))
    assert inp.chunks == -(-7 * 40 * inp.tensor.element_size() // 128)
    s.consumed()
    s.send_step(3, 11, inp.tensor, compute_us=777)
    pump(s, c)
    (out,) = steps(c)
    assert (out.opcode, out.step, out.compute_us) == (Opcode.OUTPUT, 3, 777)
    assert torch.equal(out.tensor, inp.tensor)
    assert c.tensors_sent == s.tensors_received == 1 and s.tensors_sent == 1


def test_tensor_over_the_agreed_limit_cannot_be_sent() -> None:
    c, _ = opened(max_tensor_bytes=100)
    with pytest.raises(BadRequest, match="exceeds"):
        c.send_step(0, 0, x(51))
    assert c.state is State.OPEN and not c.has_data_to_send


def test_oversized_tensor_header_fails_with_frame_too_large() -> None:
    _, s = opened(max_tensor_bytes=1000)
    s.receive_data(HEADER.pack(3, 1, 3, 0, STREAM, 0, 0, 0, 1, 1, 1, 501, 0, 0, 1002)
                   + bytes(1002))
    ev = failure(s)
    assert isinstance(ev.error, FrameTooLarge) and ev.close_code == CloseCode.MESSAGE_TOO_BIG


@pytest.mark.parametrize(("tensor", "stream", "match"), [
    (torch.ones(4, dtype=torch.float32), STREAM, "wire dtype is fp16"),
    (torch.ones(4, dtype=torch.float16), STREAM + 1, "stream 43"),
])
def test_data_frame_for_another_dtype_or_stream_fails(tensor: torch.Tensor, stream: int,
                                                     match: str) -> None:
    _, s = opened()
    s.receive_data(bytes(encode_tensor(tensor, stream_id=stream, chunk_bytes=64)[0]))
    assert match in failure(s).error.message


# -- flow control (docs/protocol.md §6) --------------------------------------------------------


def test_lockstep_decode_never_blocks_and_credit_is_batched() -> None:
    c, s = opened(window=16)
    credits: list[bytes] = []
    for i in range(100):
        c.send_step(i, i, x())
        assert not c.blocked
        pump(c, s)
        (inp,) = steps(s)
        s.consumed()
        s.send_step(i, i, inp.tensor)
        credits += [f for f in pump(s, c) if f[0] == Opcode.CREDIT]
        steps(c)
        c.consumed()
        pump(c, s)
    assert len(credits) == 100 // 8
    assert all(f == b"\x05\x00\x00\x00\x08\x00\x00\x00" for f in credits)


def test_a_paused_receiver_stops_the_sender_at_the_window() -> None:
    c, s = opened(window=4)
    for i in range(20):
        c.send_step(i, 0, x())
    sent = pump(c, s)
    assert len(sent) == 4 and c.blocked and c.in_flight == 4 and c.credit == 0
    assert pump(c, s) == [] and not c.has_data_to_send
    assert s.held_tensors == 4 and s.buffered_bytes == 4 * 64
    s.consumed()  # one consumed: below the batch threshold (window // 2), nothing yet
    assert pump(s, c) == []
    s.consumed()
    assert pump(s, c) == [b"\x05\x00\x00\x00\x02\x00\x00\x00"]
    assert [type(e) for e in c.events_received()] == [CreditReceived]
    assert len(pump(c, s)) == 2 and c.blocked and c.in_flight == 4


def test_a_tensor_larger_than_the_window_crosses() -> None:
    c, s = opened(window=2, chunk_bytes=64)
    big = torch.randn(10, 32).half()  # 640 bytes = 10 chunks
    c.send_step(0, 0, big)
    for _ in range(20):
        pump(c, s)
        pump(s, c)
    (ev,) = steps(s)
    assert torch.equal(ev.tensor, big) and ev.chunks == 10
    assert c.in_flight <= 2


def test_while_a_tensor_waits_unconsumed_the_next_one_stops_at_the_window() -> None:
    c, s = opened(window=2, chunk_bytes=64)
    first, second = torch.randn(10, 32).half(), torch.randn(10, 32).half()
    c.send_step(0, 0, first)
    c.send_step(1, 0, second)
    for _ in range(20):
        pump(c, s)
        pump(s, c)
    assert s.held_tensors == 1 and c.blocked and c.in_flight == 2
    # one complete tensor + only the chunks received of the next (issue 14 §2: the buffer
    # grows with the data, it is not allocated at the declared size)
    assert 640 < s.buffered_bytes <= 640 + 2 * 64
    got = steps(s)
    s.consumed()
    for _ in range(20):
        pump(s, c)
        pump(c, s)
    got += steps(s)
    assert [torch.equal(e.tensor, t) for e, t in zip(got, (first, second), strict=True)]
    assert not c.blocked


def test_chunk_without_credit_is_a_flow_control_violation() -> None:
    _, s = opened(window=2, chunk_bytes=64)
    one_chunk = bytes(encode_tensor(x(), stream_id=STREAM, chunk_bytes=64)[0])
    s.receive_data(one_chunk)
    s.receive_data(one_chunk)  # two tensors held, unconsumed: no credit returned
    assert len(steps(s)) == 2 and s.data_to_send() == []
    s.receive_data(one_chunk)
    assert "flow control violation" in failure(s).error.message


@pytest.mark.parametrize(("frame", "match"), [
    (b"\x05\x00\x00\x00\x01\x00\x00\x00", "outside 1..4"),  # credit already full
    (b"\x05\x00\x00\x00\x00\x00\x00\x00", "CREDIT of 0"),
    (b"\x05\x00\x00\x00\x01", "CREDIT frame of 5 bytes"),
])
def test_bad_credit_fails_the_stream(frame: bytes, match: str) -> None:
    c, _ = opened(window=4)
    c.receive_data(frame)
    assert match in failure(c).error.message


class _Wire:
    """A one-way network between a client and a server, delivering frame by frame."""

    def __init__(self, window: int) -> None:
        self.c, self.s = opened(window=window, chunk_bytes=64)
        self.to_server: list[bytes] = []
        self.sent: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []

    def check(self) -> None:
        assert 0 <= self.c.in_flight <= self.c.window
        assert self.c.in_flight >= len(self.to_server)
        for p in (self.c, self.s):
            assert p.state is State.OPEN

    def run(self, action: str, size: int) -> None:
        if action == "send":
            t = torch.full((size,), float(len(self.sent)), dtype=torch.float16)
            self.sent.append(t)
            self.c.send_step(len(self.sent), 0, t)
            self.to_server += [bytes(f) for f in self.c.data_to_send()]
        elif action == "deliver" and self.to_server:
            self.s.receive_data(self.to_server.pop(0))
            self.received += [e.tensor for e in steps(self.s)]
        elif action == "consume" and self.s.held_tensors:
            self.s.consumed()
        # credit flows back at once; the client releases what it now may
        pump(self.s, self.c)
        self.c.events_received()
        self.to_server += [bytes(f) for f in self.c.data_to_send()]
        self.check()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 6),
       actions=st.lists(st.tuples(st.sampled_from(["send", "deliver", "consume"]),
                                  st.integers(1, 200)), max_size=60))
def test_window_is_never_exceeded_and_everything_arrives_in_order(
        window: int, actions: list[tuple[str, int]]) -> None:
    w = _Wire(window)
    for action, size in actions:
        w.run(action, size)
    for _ in range(10_000):  # then the application drains everything
        if not (w.to_server or w.s.held_tensors or w.c.has_data_to_send or w.c.blocked):
            break
        w.run("deliver", 0)
        w.run("consume", 0)
    assert len(w.received) == len(w.sent)
    assert all(torch.equal(a, b) for a, b in zip(w.sent, w.received, strict=True))


def test_consumed_without_a_received_tensor_is_a_caller_error() -> None:
    _, s = opened()
    with pytest.raises(BadRequest):
        s.consumed()


# -- errors, close, ping (docs/protocol.md §3.4–§3.6, §7) --------------------------------------


def test_non_fatal_error_keeps_the_session_open_and_carries_step_and_details() -> None:
    c, s = opened()
    s.send_error(ShardUnavailable("shard is busy", queue_depth=5), step=3)
    pump(s, c)
    (ev,) = c.events_received()
    assert isinstance(ev, ErrorReceived) and not ev.fatal and ev.step == 3
    assert isinstance(ev.error, ShardUnavailable) and ev.error.details == {"queue_depth": 5}
    assert c.state is s.state is State.OPEN


def test_non_fatal_error_is_ordered_after_queued_data() -> None:
    _, s = opened(window=2, chunk_bytes=64)
    s.send_step(0, 0, x(128))  # 4 chunks, credit for 2
    s.send_error(BadRequest("later"))
    assert [f[0] for f in s.data_to_send()] == [Opcode.OUTPUT, Opcode.OUTPUT]
    s.receive_data(b"\x05\x00\x00\x00\x02\x00\x00\x00")
    assert [f[0] for f in s.data_to_send()] == [Opcode.OUTPUT, Opcode.OUTPUT, Opcode.ERROR]


def test_non_fatal_error_inside_a_tensor_fails_the_stream() -> None:
    c, s = opened(chunk_bytes=64)
    c.receive_data(bytes(encode_tensor(x(64), opcode=Opcode.OUTPUT, stream_id=STREAM,
                                       chunk_bytes=64)[0]))
    s.send_error(BadRequest("oops"))
    pump(s, c)
    assert "middle of a tensor" in failure(c).error.message


def test_error_detail_keys_that_clash_with_code_or_message_are_dropped() -> None:
    c, _ = opened()
    body = msgpack.packb({"code": "bad_request", "message": "m",
                          "details": {"code": "x", "message": "y", "ok": 1}})
    c.receive_data(b"\x06\x00\x00\x00" + body)
    (ev,) = c.events_received()
    assert isinstance(ev, ErrorReceived) and ev.error.details == {"ok": 1}


@pytest.mark.parametrize("body", [
    msgpack.packb({"code": 1, "message": "m"}),
    msgpack.packb({"code": "c"}),
    msgpack.packb({"code": "c", "message": "m", "step": -1}),
    msgpack.packb({"code": "c", "message": "m", "details": [1]}),
    b"\xc1",
])
def test_malformed_error_frame_fails_the_stream(body: bytes) -> None:
    c, _ = opened()
    c.receive_data(b"\x06\x00\x00\x00" + body)
    assert "ERROR frame" in failure(c).error.message


def test_close_ends_the_session_and_later_frames_are_ignored() -> None:
    c, s = opened()
    c.send_step(0, 0, x())
    c.send_close("chat finished")
    c.send_close("again")  # idempotent
    frames = pump(c, s)
    assert frames == [b"\x07\x00\x00\x00chat finished"]  # unsent data was dropped
    assert s.events_received() == [CloseReceived("chat finished")]
    assert c.state is s.state is State.CLOSED
    s.receive_data(bytes(encode_tensor(x(), stream_id=STREAM, chunk_bytes=64)[0]))
    s.receive_data(b"garbage")
    assert s.events_received() == [] and s.data_to_send() == []


def test_ping_is_answered_with_the_same_nonce() -> None:
    c, s = opened()
    c.send_ping(2**64 - 1)
    (ping,) = pump(c, s)
    assert ping == b"\x08" + bytes(7) + b"\xff" * 8
    assert s.events_received() == [PingReceived(2**64 - 1)]
    (pong,) = pump(s, c)
    assert pong[0] == Opcode.PONG
    assert c.events_received() == [PongReceived(2**64 - 1)]


def test_local_fail_sends_a_fatal_error_and_ignores_the_rest() -> None:
    c, s = opened()
    c.send_step(0, 0, x())
    c.fail(StreamStalled("no output within 30 s"), CloseCode.POLICY_VIOLATION)
    assert c.state is State.FAILED and c.close_code == CloseCode.POLICY_VIOLATION
    frames = pump(c, s)
    assert [f[0] for f in frames] == [Opcode.ERROR]  # the queued step was dropped
    (ev,) = s.events_received()
    assert isinstance(ev, ErrorReceived) and ev.fatal
    # the transport's own stall keeps its own class and code across the wire
    assert type(ev.error) is StreamStalled and ev.error.code == "stream_stalled"


# -- the state table (docs/protocol.md §5) ----------------------------------------------------


def _in_state(role: Role, state: State) -> StreamProtocol:
    if state is State.OPEN:
        c, s = opened()
        return c if role is Role.CLIENT else s
    p = StreamProtocol(role, window=4, chunk_bytes=64)
    if role is Role.CLIENT and state is State.OPEN_SENT:
        p.send_open({}, stream_id=STREAM)
        p.data_to_send()
    if role is Role.SERVER and state is State.OPEN_RECEIVED:
        p.receive_data(open_frame())
        p.events_received()
    assert p.state is state
    return p


_INPUT = bytes(encode_tensor(torch.ones(4).half(), stream_id=STREAM, chunk_bytes=64)[0])
_OUTPUT = bytes(encode_tensor(torch.ones(4).half(), opcode=Opcode.OUTPUT, stream_id=STREAM,
                              chunk_bytes=64)[0])
_CREDIT = b"\x05\x00\x00\x00\x01\x00\x00\x00"


@pytest.mark.parametrize(("role", "state", "frame", "match"), [
    (Role.SERVER, State.IDLE, _INPUT, "unexpected INPUT"),
    (Role.SERVER, State.IDLE, _CREDIT, "unexpected CREDIT"),
    (Role.SERVER, State.OPEN_RECEIVED, _INPUT, "unexpected INPUT"),
    (Role.SERVER, State.OPEN, open_frame(), "unexpected OPEN"),
    (Role.SERVER, State.OPEN, _OUTPUT, "unexpected OUTPUT"),
    (Role.CLIENT, State.OPEN_SENT, _OUTPUT, "unexpected OUTPUT"),
    (Role.CLIENT, State.OPEN_SENT, b"\x06\x00\x00\x00" + msgpack.packb(
        {"code": "bad_request", "message": "m"}), "unexpected ERROR"),
    (Role.CLIENT, State.OPEN, _INPUT, "unexpected INPUT"),
    (Role.CLIENT, State.OPEN, b"\x02" + open_frame()[1:], "unexpected ACCEPT"),
    (Role.CLIENT, State.OPEN, b"\x0a\x00", "unknown opcode 0x0a"),
    (Role.CLIENT, State.OPEN, b"\x00", "unknown opcode 0x00"),
    (Role.CLIENT, State.OPEN, b"", "empty frame"),
])
def test_frames_the_table_does_not_allow_fail_the_stream(role: Role, state: State,
                                                         frame: bytes, match: str) -> None:
    p = _in_state(role, state)
    p.receive_data(frame)
    ev = failure(p)
    assert match in ev.error.message and ev.close_code == CloseCode.PROTOCOL_ERROR


@pytest.mark.parametrize(("role", "state", "call"), [
    (Role.CLIENT, State.IDLE, lambda p: p.send_step(0, 0, x())),
    (Role.CLIENT, State.OPEN_SENT, lambda p: p.send_step(0, 0, x())),
    (Role.CLIENT, State.OPEN, lambda p: p.send_accept({})),
    (Role.CLIENT, State.OPEN, lambda p: p.send_open({})),
    (Role.CLIENT, State.IDLE, lambda p: p.send_ping(1)),
    (Role.SERVER, State.IDLE, lambda p: p.send_open({})),
    (Role.SERVER, State.OPEN_RECEIVED, lambda p: p.send_step(0, 0, x())),
    (Role.SERVER, State.OPEN_RECEIVED, lambda p: p.send_error(BadRequest("x"))),
    (Role.SERVER, State.OPEN, lambda p: p.send_accept({})),
])
def test_illegal_sends_raise_and_leave_the_state_unchanged(role: Role, state: State,
                                                           call: Any) -> None:
    p = _in_state(role, state)
    with pytest.raises(BadRequest, match="cannot send"):
        call(p)
    assert p.state is state and p.data_to_send() == []


@pytest.mark.parametrize(("params", "match"), [
    ({1: "a"}, "str keys"),
    ({"a": object()}, "cannot be encoded"),
    ({"wire_dtype": "fp8"}, "fp8"),
    ({"blob": "x" * 70_000}, "limit"),
])
def test_bad_open_params_are_refused_before_sending(params: dict[Any, Any], match: str) -> None:
    c = StreamProtocol(Role.CLIENT)
    with pytest.raises(BadRequest, match=match):
        c.send_open(params)
    assert c.state is State.IDLE and c.data_to_send() == []


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(window=1025), dict(chunk_bytes=8),
                                    dict(max_tensor_bytes=0)])
def test_bad_local_limits_raise(kwargs: dict[str, int]) -> None:
    with pytest.raises(BadRequest):
        StreamProtocol(Role.CLIENT, **kwargs)


# -- the receive path never raises (docs/protocol.md §7) ---------------------------------------

_STATES = [(Role.SERVER, State.IDLE), (Role.SERVER, State.OPEN_RECEIVED),
           (Role.SERVER, State.OPEN), (Role.CLIENT, State.OPEN_SENT), (Role.CLIENT, State.OPEN)]


def _assert_survives(p: StreamProtocol, frames: list[bytes]) -> None:
    for f in frames:
        p.receive_data(f)  # must not raise
        for ev in p.events_received():
            if isinstance(ev, ProtocolFailed):
                assert isinstance(ev.error, ProtocolError) and ev.close_code in (1002, 1009)
                assert p.state is State.FAILED
                out = p.data_to_send()
                assert len(out) == 1 and out[0][0] == Opcode.ERROR
        p.data_to_send()


@settings(max_examples=300, deadline=None)
@given(where=st.sampled_from(_STATES), frames=st.lists(st.binary(max_size=120), max_size=6))
def test_random_bytes_never_raise(where: tuple[Role, State], frames: list[bytes]) -> None:
    _assert_survives(_in_state(*where), frames)


def _valid_frames() -> list[bytes]:
    tensor_frames = [bytes(f) for f in encode_tensor(torch.randn(3, 40).half(),
                                                     stream_id=STREAM, chunk_bytes=64)]
    out_frames = [bytes(f) for f in encode_tensor(torch.randn(3, 40).half(),
                                                  opcode=Opcode.OUTPUT, stream_id=STREAM,
                                                  chunk_bytes=64)]
    error = b"\x06\x00\x00\x00" + msgpack.packb({"code": "bad_request", "message": "m",
                                                 "details": {"k": [1, 2]}, "step": 4})
    return [open_frame(), b"\x02" + open_frame()[1:], *tensor_frames, *out_frames, _CREDIT,
            error, b"\x06\x01" + error[2:], b"\x07\x00\x00\x00bye", b"\x08" + bytes(15),
            b"\x09" + bytes(15)]


_VALID = _valid_frames()


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    f = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "extend", "set"]))
        if kind == "flip" and f:
            i = draw(st.integers(0, len(f) - 1))
            f[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del f[draw(st.integers(0, len(f))):]
        elif kind == "extend":
            f += draw(st.binary(min_size=1, max_size=16))
        elif f:
            f[draw(st.integers(0, min(len(f) - 1, 47)))] = draw(st.integers(0, 255))
    return bytes(f)


@settings(max_examples=400, deadline=None)
@given(where=st.sampled_from(_STATES),
       frames=st.lists(st.one_of(_mutated(), st.sampled_from(_VALID)), max_size=8))
def test_mutated_frames_never_raise(where: tuple[Role, State], frames: list[bytes]) -> None:
    _assert_survives(_in_state(*where), frames)


def test_valid_frames_in_order_are_accepted() -> None:
    # the corpus the mutations start from is itself valid in sequence
    s = StreamProtocol(Role.SERVER, window=4, chunk_bytes=64)
    s.receive_data(_VALID[0])
    s.send_accept({})
    s.data_to_send()
    for f in _VALID[2:6]:
        s.receive_data(f)
    assert s.state is State.OPEN and len(steps(s)) == 1
