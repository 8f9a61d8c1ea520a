"""Hostile input to the parsers never raises out of them (issue 7 item 6).

Hypothesis drives the tensor frame parser (`StreamProtocol.receive_data`, both roles,
after and before the handshake) and the gossip decoders (`decode_message`,
`Event.from_wire`) with random bytes, random msgpack values and valid messages with
bytes flipped, cut or spliced. The contract: the frame parser never raises (a bad frame
fails the stream); the gossip decoder raises only `ProtocolError`, the event parser only
`BadRequest`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hearthnet.errors import PeerDataError, ProtocolError
from hearthnet.mesh.eventlog import EventLog
from hearthnet.mesh.gossip import decode_message, encode_events, encode_hello
from hearthnet.transport.protocol import Role, StreamProtocol

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


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


def _feed(proto: StreamProtocol, frames: list[bytes]) -> None:
    for f in frames:
        proto.receive_data(f)  # the contract: never raises
        proto.events_received()
        proto.data_to_send()


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=8))
def test_frame_parser_survives_random_bytes(frames: list[bytes]) -> None:
    _feed(StreamProtocol(Role.SERVER), frames)
    _feed(StreamProtocol(Role.CLIENT), frames)


@FUZZ
@given(st.data())
def test_frame_parser_survives_mutated_frames(data: st.DataObject) -> None:
    frames = list(VALID)
    j = data.draw(st.integers(0, len(frames) - 1))
    frames[j] = _mutate(frames[j], data)
    _feed(StreamProtocol(Role.SERVER, chunk_bytes=1024), frames)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**64 + 1, 2**64 - 1),
                     st.floats(), st.text(max_size=20), st.binary(max_size=20))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), _scalars),
                                                 inner, max_size=4)), max_leaves=20)


def _decode(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_message(data)


@FUZZ
@given(st.binary(max_size=512))
def test_gossip_decoder_survives_random_bytes(data: bytes) -> None:
    _decode(data)


@FUZZ
@given(_values)
def test_gossip_decoder_survives_random_msgpack(value: Any) -> None:
    for msg in (value, {"k": "events", "events": value}, {"k": "events", "events": [value]},
                {"k": "hello", "v": 1, "node": value, "vector": value}):
        try:
            packed = msgpack.packb(msg, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            continue
        _decode(packed)


@FUZZ
@given(_values)
def test_event_parser_raises_only_peer_data_error(value: Any) -> None:
    from hearthnet.mesh.eventlog import Event

    for wire in (value, {"id": value, "o": "node-a", "s": 1, "t": "x", "p": {}, "ts": 1.0},
                 {"id": "0" * 32, "o": value, "s": value, "t": value, "p": value,
                  "ts": value, "sig": value}):
        with contextlib.suppress(PeerDataError):
            Event.from_wire(wire)


def _valid_messages(tmp: Path) -> list[bytes]:
    log = EventLog(tmp / "fuzz.sqlite3", "node-a", signer=lambda b: b"\x01" * 64)
    try:
        log.append("experimental.test", {"n": 1, "s": "x", "l": [1, 2.5, None]})
        log.append("experimental.test", {"n": 2})
        return [encode_hello("node-a", log.vector()), encode_events(log.all_events())]
    finally:
        log.close()


@FUZZ
@given(st.data())
def test_gossip_decoder_survives_mutated_messages(tmp_path_factory: Any,
                                                  data: st.DataObject) -> None:
    msgs = _valid_messages(tmp_path_factory.mktemp("fuzz"))
    _decode(_mutate(data.draw(st.sampled_from(msgs)), data))
