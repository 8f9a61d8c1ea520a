"""The chat frames (`hearthnet.frames`): one definition, read back exactly, malformed is typed.

A frame's wire map is what the bus carries, what ``hearthnet chat --json`` prints and what
the status page and the tests read: its keys must not drift. A map from a peer is checked
before it is used, so a broken or other-version node gives the caller a `PeerDataError`,
never a `KeyError`. The last tests send what the orchestrator builds through a real bus to
`HearthNetClient`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.server import serve

from hearthnet import safe_msgpack
from hearthnet.client import HearthNetClient, parse_frame
from hearthnet.distributed_inference.engine.generation import Generation
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.frames import done_frame, token_frame
from hearthnet.errors import HearthNetError, PeerDataError, ShardUnavailable
from hearthnet.frames import (
    FRAME_TYPES,
    Done,
    ErrorFrame,
    OtherFrame,
    PipelineAborted,
    ShardFailover,
    ShardStatus,
    StreamFrame,
    TokenDelta,
    WireWidened,
    from_wire,
    is_incident,
    read_frame,
)
from hearthnet.mesh.bus import CapabilityBus
from hearthnet.node.capabilities import CHAT_CAPABILITY

A, B = "m:0-14@node-b", "m:15-29@node-c"

# one of each frame type, with and without its optional fields
FRAMES: list[StreamFrame] = [
    TokenDelta("Hel", 9906, 0),
    TokenDelta("", 2, 1),  # a token that ends mid-character releases no text
    ShardStatus.ok(A, (0, 14), "fp16"),
    ShardStatus.degraded(B, ShardUnavailable("node-c went away")),
    ShardFailover(B, ("m:15-29@node-d",), (A, "m:15-29@node-d"), 7, 12.5),
    WireWidened(A, (0, 14), 3, "fp16", "fp32"),
    PipelineAborted("no cover for layers 15-29", None, 0),
    PipelineAborted("2 shard failures", "local", 4),
    Done("length", {"prompt_tokens": 5, "completion_tokens": 2},
         {"first_token_ms": 3.0, "tokens_per_second": 20.5, "total_ms": 99.0,
          "per_shard": {A: {"layers": [0, 14], "p50_ms": 1.5}}},
         (A, B), formats={"head": "fp32", "stages": ["int8", "int8"]}, failovers=1),
    Done("eos", {"prompt_tokens": 5, "completion_tokens": 1}, {"first_token_ms": 1.0},
         ("local",), fallback=True),
    ErrorFrame("shard_unavailable", "no shard covers layers 15-29"),
    ErrorFrame("connection_lost", "the node went away", details={"uri": "ws://x"},
               tokens_so_far=3),
    # a call that asked for log-probabilities: 2 alternatives, then none (logprobs = 0)
    TokenDelta(" Paris", 12, 2, logprob=-0.25, token_bytes=b" Paris",
               top_logprobs=((12, -0.25, b" Paris"), (13, -2.0, b"\xc3"))),
    TokenDelta("", 14, 3, logprob=-7.5, token_bytes=b"\xa9", top_logprobs=()),
]


def test_every_frame_type_is_covered() -> None:
    assert {f.TYPE for f in FRAMES} == FRAME_TYPES


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: f.TYPE)
def test_round_trip_through_the_wire(frame: StreamFrame) -> None:
    wire = frame.to_wire()
    assert from_wire(wire) == frame
    assert from_wire(safe_msgpack.unpackb(safe_msgpack.packb(wire))) == frame  # the bus
    assert from_wire(json.loads(json.dumps(wire))) == frame  # `hearthnet chat --json`


def test_the_wire_keys_are_the_spec_s() -> None:
    """The maps the bus carried before the frames were types (tests and the page read them)."""
    assert TokenDelta("a", 1, 0).to_wire() == {"type": "token_delta", "text": "a",
                                               "token_id": 1, "index": 0}
    assert ShardStatus.ok(A, (0, 14), "fp16").to_wire() == {
        "type": "shard_status", "shard_id": A, "status": "ok", "layers": [0, 14],
        "wire_dtype": "fp16"}
    # the stage's held format and kernel, when the orchestrator knows them
    assert ShardStatus.ok(A, (0, 14), "fp32", "int8", "onednn").to_wire() == {
        "type": "shard_status", "shard_id": A, "status": "ok", "layers": [0, 14],
        "wire_dtype": "fp32", "weights_format": "int8", "kernel": "onednn"}
    assert ShardStatus.degraded(B, ShardUnavailable("gone")).to_wire() == {
        "type": "shard_status", "shard_id": B, "status": "degraded",
        "code": "shard_unavailable", "message": "gone"}
    assert WireWidened(A, (0, 14), 3, "fp16", "fp32").to_wire() == {
        "type": "wire_widened", "shard_id": A, "layers": [0, 14], "step": 3,
        "from": "fp16", "to": "fp32"}
    # `continuing` is always there, null when the call ends with an error
    assert PipelineAborted("why", None, 0).to_wire() == {
        "type": "pipeline_aborted", "reason": "why", "continuing": None, "tokens_so_far": 0}
    # the pipeline's done counts failovers; only a fallback's says `fallback`
    done = FRAMES[8].to_wire()
    assert list(done) == ["type", "finish_reason", "usage", "timings", "pipeline", "formats",
                          "failovers"]
    assert done["pipeline"] == [A, B] and "fallback" not in done
    assert FRAMES[9].to_wire()["fallback"] is True and "failovers" not in FRAMES[9].to_wire()
    assert ErrorFrame.of(ShardUnavailable("x", shard_id=A)).to_wire() == {
        "type": "error", "code": "shard_unavailable", "message": "x"}
    # log-probabilities only when asked; a token's bytes as byte values (JSON has no bytes)
    assert FRAMES[-2].to_wire() == {
        "type": "token_delta", "text": " Paris", "token_id": 12, "index": 2,
        "logprob": -0.25, "bytes": list(b" Paris"),
        "top_logprobs": [[12, -0.25, list(b" Paris")], [13, -2.0, [0xC3]]]}


def _token() -> dict[str, Any]:
    return {"type": "token_delta", "text": "a", "token_id": 1, "index": 0}


@pytest.mark.parametrize(("raw", "says"), [
    ({"text": "a", "token_id": 1, "index": 0}, "unknown type None"),
    ({**_token(), "type": "token_deltas"}, "unknown type 'token_deltas'"),
    ({**_token(), "type": 7}, "unknown type 7"),
    ({"type": "token_delta", "text": "a", "index": 0}, "without its 'token_id'"),
    ({**_token(), "text": 5}, "'text' is not a string"),
    ({**_token(), "token_id": True}, "'token_id' is not an integer"),
    ({**_token(), "index": "0"}, "'index' is not an integer"),
    ({**_token(), "logprob": 0.5}, "'logprob' is not a log-probability"),
    ({**_token(), "logprob": "-1"}, "'logprob' is not a number"),
    ({**_token(), "logprob": float("-inf")}, "'logprob' is not a log-probability"),
    ({**_token(), "bytes": [256]}, "'bytes' is not a list of at most 256 byte values"),
    ({**_token(), "bytes": "a"}, "'bytes' is not a list"),
    ({**_token(), "top_logprobs": [[1, -0.1]]}, "'top_logprobs' is not a list of at most 20"),
    ({**_token(), "top_logprobs": [[1, -0.1, [97]]] * 21}, "'top_logprobs' is not a list"),
    ({**_token(), "top_logprobs": [[1, 0.1, [97]]]}, "'top_logprobs' is not a log-prob"),
    ({**_token(), "top_logprobs": [["1", -0.1, [97]]]}, "'top_logprobs' is not an integer"),
    ({"type": "shard_status", "shard_id": A, "status": "ok", "layers": [0]},
     "'layers' is not a [start, end] pair"),
    ({"type": "pipeline_aborted", "reason": "r", "tokens_so_far": 0},
     "without its 'continuing'"),
    ({"type": "pipeline_aborted", "reason": "r", "continuing": 1, "tokens_so_far": 0},
     "'continuing' is not a string"),
    ({"type": "shard_failover", "failed": B, "replacement": [1], "pipeline": [A],
      "replayed_positions": 1, "ms": 1.0}, "'replacement' is not a list of strings"),
    ({"type": "done", "finish_reason": "eos", "usage": {"completion_tokens": "2"},
      "timings": {}, "pipeline": []}, "'usage' is not a map of integers"),
    ({"type": "done", "finish_reason": "eos", "usage": {}, "timings": [], "pipeline": []},
     "'timings' is not a map"),
    ({"type": "done", "finish_reason": "eos", "usage": {}, "timings": {}, "pipeline": [],
      "fallback": "yes"}, "'fallback' is not true or false"),
    ({"type": "error", "message": "m"}, "without its 'code'"),
    (["token_delta"], "a chat frame is a map"),
    (None, "a chat frame is a map"),
])
def test_a_malformed_frame_is_a_typed_error(raw: Any, says: str) -> None:
    with pytest.raises(PeerDataError) as e:
        from_wire(raw)
    assert says in e.value.message
    assert e.value.code == "bad_peer_data"


def test_keys_a_newer_node_adds_are_ignored() -> None:
    assert from_wire({**_token(), "entropy": 0.1}) == TokenDelta("a", 1, 0)


def test_read_frame_keeps_a_newer_node_s_frame_type() -> None:
    raw = {"type": "speculation_accepted", "n": 3}
    frame = read_frame(raw)
    assert frame == OtherFrame("speculation_accepted", raw)
    assert frame.to_wire() == raw
    with pytest.raises(PeerDataError):  # a known type is still checked
        read_frame({"type": "done"})


def test_incidents_are_what_the_status_page_lists() -> None:
    assert [f.TYPE for f in FRAMES if is_incident(f)] == [
        "shard_status", "shard_failover", "pipeline_aborted", "pipeline_aborted"]
    assert not is_incident(ShardStatus.ok(A, (0, 14), "fp16"))


def test_an_error_frame_rebuilds_its_error_class() -> None:
    err = ErrorFrame("shard_unavailable", "no cover", details={"busy": True}).exception()
    assert isinstance(err, ShardUnavailable) and err.message == "no cover"
    assert err.details == {"busy": True}
    assert type(ErrorFrame("from_the_future", "?").exception()) is HearthNetError


# ---- the client reads what the orchestrator builds ----

class _Letters:
    """A tokenizer for `Generation`: token i is one letter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _built() -> list[StreamFrame]:
    """A call's frames as the orchestrator builds them (pipeline.py, failover.py)."""
    gen = Generation(_Letters(), [1, 2, 3], SamplingParams(max_tokens=3), {0})
    out: list[StreamFrame] = [ShardStatus.ok(A, (0, 14), "fp16"),
                              ShardStatus.ok(B, (15, 29), "fp16")]
    out.append(token_frame(gen.accept(7)))
    out.append(ShardStatus.degraded(B, ShardUnavailable("node-c went away")))
    out.append(ShardFailover(B, ("m:15-29@node-d",), (A, "m:15-29@node-d"), 4, 10.0))
    out.append(WireWidened(A, (0, 14), 2, "fp16", "fp32"))
    out += [token_frame(gen.accept(8)), token_frame(gen.accept(9))]
    out.append(done_frame(gen, t0=0.0, first_ms=1.0, tokens_per_s=2.0,
                          pipeline=[A, "m:15-29@node-d"], failovers=1,
                          formats={"head": "fp32", "stages": ["fp32", "fp32"]}))
    return out


def test_the_orchestrator_s_frames_parse_as_the_client_reads_them() -> None:
    built = _built()
    done = built[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.usage == {"prompt_tokens": 3, "completion_tokens": 3} and done.text_tokens == 3
    assert [f.text for f in built if isinstance(f, TokenDelta)] == ["h", "i", "j"]
    for f in built:
        assert parse_frame(safe_msgpack.unpackb(safe_msgpack.packb(f.to_wire()))) == f
    with pytest.raises(ShardUnavailable, match="no cover"):
        parse_frame(ErrorFrame.of(ShardUnavailable("no cover")).to_wire())


async def test_a_chat_over_a_real_bus_reaches_the_client_typed() -> None:
    """The node's path: orchestrator frames → `to_wire` → `/bus` (msgpack) → the client."""
    built = _built()

    async def chat(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for f in built:
            yield f.to_wire()

    bus = CapabilityBus()
    bus.register(CHAT_CAPABILITY, chat)
    async with serve(bus.serve_connection, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with HearthNetClient(f"ws://127.0.0.1:{port}") as hn:
            got = [f async for f in hn.chat("hi", max_tokens=3)]
            text, done = await hn.answer("hi", max_tokens=3)
    assert got == built
    assert text == "hij" and done == built[-1]
