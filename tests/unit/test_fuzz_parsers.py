"""Hostile input to the parsers ends in the exact typed failure, and only in it (issue 7
item 6, issue 10 §7).

Hypothesis drives the tensor frame parser (`StreamProtocol.receive_data`, both roles,
after and before the handshake) and the gossip decoders (`decode_message`,
`Event.from_wire`) with random bytes, random msgpack values and valid messages with
bytes flipped, cut or spliced. The contract, asserted on every example:

- the frame parser never raises; input it cannot take fails the stream with exactly one
  `ProtocolFailed` whose error is a `ProtocolError` (``protocol_error``) or a
  `FrameTooLarge` (``frame_too_large``) — never an `InternalError`, which is what the
  parser's safety net makes of an unexpected exception (a bug) — queues one fatal ERROR
  frame with the same code for the peer, and ignores everything after;
- the gossip decoder returns a `Hello` or an `Events` batch of checked events, or raises
  exactly `ProtocolError`; the event parser returns an event that round-trips, or raises
  exactly `PeerDataError`.

Any other exception is not swallowed: it fails the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearthnet import safe_msgpack
from hearthnet.errors import FrameTooLarge, InternalError, PeerDataError, ProtocolError
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.mesh.gossip import Events, Hello, decode_message, encode_events, encode_hello
from hearthnet.transport.protocol import (
    Opcode,
    OpenRequested,
    ProtocolFailed,
    Role,
    State,
    StepReceived,
    StreamProtocol,
)

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
_PEER_FAULTS = {ProtocolError: ("protocol_error", 1002), FrameTooLarge: ("frame_too_large", 1009)}


def _client_frames() -> list[bytes]:
    """A real OPEN and two INPUT steps, as a client sends them."""
    c = StreamProtocol(Role.CLIENT, chunk_bytes=1024)
    c.send_open({"shard_id": "m:0-3@node-b", "wire_dtype": "fp16", "max_length": 8})
    frames = [bytes(f) for f in c.data_to_send()]
    s = StreamProtocol(Role.SERVER, chunk_bytes=1024)
    for f in frames:
        s.receive_data(f)
    s.send_accept({})
    for f in s.data_to_send():
        c.receive_data(f)
    c.events_received()
    c.send_step(1, 0, torch.ones(1, 3, 8))
    c.send_step(2, 3, torch.ones(1, 1, 8))
    return frames + [bytes(f) for f in c.data_to_send()]


VALID = _client_frames()


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "cut", "splice", "extend"]))
    if not frame or kind == "extend":
        return frame + data.draw(st.binary(max_size=64))
    i = data.draw(st.integers(0, len(frame) - 1))
    if kind == "flip":
        return frame[:i] + bytes([frame[i] ^ data.draw(st.integers(1, 255))]) + frame[i + 1:]
    if kind == "cut":
        return frame[:i]
    return frame[:i] + data.draw(st.binary(max_size=32)) + frame[i:]


def _feed(proto: StreamProtocol, frames: list[bytes],
          got: list[Any] | None = None) -> ProtocolFailed | None:
    """Feed `frames` (a server accepts an OPEN it takes), collecting events into `got`;
    assert the failure contract; the failure, if the stream failed."""
    failed: ProtocolFailed | None = None
    for f in frames:
        proto.receive_data(f)  # never raises: an exception here fails the test
        events = proto.events_received()
        if any(isinstance(e, OpenRequested) for e in events):
            proto.send_accept({})
        out = proto.data_to_send()
        if got is not None:
            got += events
        if failed is not None:  # FAILED ignores further input
            assert events == [] and out == [] and proto.state is State.FAILED
            continue
        failures = [e for e in events if isinstance(e, ProtocolFailed)]
        if not failures:
            continue
        assert len(failures) == 1 and events[-1] is failures[0]
        failed = failures[0]
        assert type(failed.error) in _PEER_FAULTS, f"not a peer fault: {failed.error!r}"
        code, close = _PEER_FAULTS[type(failed.error)]
        assert failed.error.code == code and failed.close_code == close
        assert proto.state is State.FAILED
        assert len(out) >= 1 and out[-1][0] == Opcode.ERROR  # the fatal ERROR for the peer
        assert code.encode() in bytes(out[-1])
    return failed


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=8))
def test_frame_parser_fails_random_bytes_as_a_protocol_error(frames: list[bytes]) -> None:
    for role in (Role.SERVER, Role.CLIENT):
        proto = StreamProtocol(role)
        failed = _feed(proto, frames)
        assert (failed is None) == (proto.state is not State.FAILED)
        if frames and not frames[0]:
            assert failed is not None and "empty frame" in failed.error.message


@FUZZ
@given(st.data())
def test_frame_parser_takes_valid_frames_and_fails_mutated_ones_typed(
        data: st.DataObject) -> None:
    frames = list(VALID)
    j = data.draw(st.integers(0, len(frames) - 1))
    frames[j] = _mutate(frames[j], data)
    proto = StreamProtocol(Role.SERVER, chunk_bytes=1024)
    got: list[Any] = []
    failed = _feed(proto, frames, got)
    if failed is None:  # the mutation left every frame acceptable: the session is open,
        # or the flip made a frame a valid CLOSE, and the peer closed it cleanly
        assert isinstance(got[0], OpenRequested)
        assert proto.state is State.OPEN or (proto.state is State.CLOSED
                                             and frames[j][0] == Opcode.CLOSE)


def test_unmutated_frames_open_a_session_and_deliver_both_steps() -> None:
    proto = StreamProtocol(Role.SERVER, chunk_bytes=1024)
    got: list[Any] = []
    assert _feed(proto, VALID, got) is None and proto.state is State.OPEN
    steps = [e for e in got if isinstance(e, StepReceived)]
    assert [(s.step, s.start_pos, tuple(s.tensor.shape)) for s in steps] == \
        [(1, 0, (1, 3, 8)), (2, 3, (1, 1, 8))]


def test_a_bug_in_the_parser_is_an_internal_error_not_the_peers_protocol_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The safety net keeps `receive_data` from raising, but reports an unexpected
    exception as ``internal`` (close 1011) with the exception as its cause."""
    def broken(self: StreamProtocol, data: Any) -> None:
        raise TypeError("a bug")

    monkeypatch.setattr(StreamProtocol, "_receive_open", broken)
    proto = StreamProtocol(Role.SERVER, chunk_bytes=1024)
    proto.receive_data(VALID[0])
    (failed,) = proto.events_received()
    assert isinstance(failed, ProtocolFailed) and isinstance(failed.error, InternalError)
    assert not isinstance(failed.error, ProtocolError)
    assert failed.error.code == "internal" and failed.close_code == 1011
    assert isinstance(failed.error.__cause__, TypeError)
    assert proto.state is State.FAILED


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**64 + 1, 2**64 - 1),
                     st.floats(), st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), _scalars),
                                                 inner, max_size=4)), max_leaves=20)


def _decode(data: bytes) -> Hello | Events | None:
    """`decode_message(data)`: a checked message, or None after exactly `ProtocolError`."""
    try:
        msg = decode_message(data)
    except ProtocolError as e:
        assert type(e) is ProtocolError and e.code == "protocol_error", repr(e)
        return None
    if isinstance(msg, Hello):
        assert isinstance(msg.node, str) and all(
            isinstance(k, str) and isinstance(v, int) and v >= 0
            for k, v in msg.vector.items())
    else:
        assert isinstance(msg, Events) and msg.malformed >= 0
        for ev in msg.events:
            ev.check()  # every event handed on passed the checks
    return msg


@FUZZ
@given(st.binary(max_size=512))
def test_gossip_decoder_refuses_random_bytes_typed(data: bytes) -> None:
    _decode(data)


@FUZZ
@given(_values)
def test_gossip_decoder_refuses_random_msgpack_typed(value: Any) -> None:
    for msg in (value, {"k": "events", "events": value}, {"k": "events", "events": [value]},
                {"k": "hello", "v": 1, "node": value, "vector": value}):
        try:
            packed = safe_msgpack.packb(msg)
        except (TypeError, ValueError, OverflowError):
            continue
        out = _decode(packed)
        if msg == {"k": "events", "events": [value]} and _is_msgpack(packed):
            # a batch of one malformed element is a batch, not a protocol error
            assert isinstance(out, Events) and len(out.events) + out.malformed == 1


def _is_msgpack(packed: bytes) -> bool:
    """Whether the guarded decoder takes `packed` (e.g. no non-str map keys)."""
    try:
        safe_msgpack.unpackb(packed)
    except ValueError:
        return False
    return True


@FUZZ
@given(_values)
def test_event_parser_raises_only_peer_data_error(value: Any) -> None:
    for wire in (value, {"id": value, "o": "node-a", "s": 1, "t": "x", "p": {}, "ts": 1.0},
                 {"id": "0" * 32, "o": value, "s": value, "t": value, "p": value,
                  "ts": value, "sig": value}):
        try:
            ev = Event.from_wire(wire)
        except PeerDataError as e:
            assert type(e) is PeerDataError and e.code == "bad_peer_data", repr(e)
            continue
        assert Event.from_wire(ev.to_wire()) == ev  # what is accepted round-trips


def _valid_messages(tmp: Path) -> list[bytes]:
    log = EventLog(tmp / "fuzz.sqlite3", "node-a", signer=lambda b: b"\x01" * 64)
    try:
        log.append("experimental.test", {"n": 1, "s": "x", "l": [1, 2.5, None]})
        log.append("experimental.test", {"n": 2})
        return [encode_hello("node-a", log.vector()), encode_events(log.all_events())]
    finally:
        log.close()


@pytest.fixture(scope="module")
def valid_messages(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """A hello and a batch of two signed events, made once for every example."""
    return _valid_messages(tmp_path_factory.mktemp("fuzz"))


def test_valid_gossip_messages_decode(valid_messages: list[bytes]) -> None:
    hello, batch = (_decode(m) for m in valid_messages)
    assert isinstance(hello, Hello) and hello.node == "node-a" and hello.vector == {"node-a": 2}
    assert isinstance(batch, Events) and len(batch.events) == 2 and batch.malformed == 0


@FUZZ
@given(st.data())
def test_gossip_decoder_refuses_mutated_messages_typed(valid_messages: list[bytes],
                                                       data: st.DataObject) -> None:
    _decode(_mutate(data.draw(st.sampled_from(valid_messages)), data))
