"""Issue 14, the pure tier: defects of the attack run that need no process to reproduce."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine.generation import PromptLimits
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import DistributedChatParams
from hearthnet.distributed_inference.orchestrator.sanity import SanityChecker
from hearthnet.errors import BadRequest, ShardCorrupted, ShardUnavailable, error_from_code
from hearthnet.transport.codec import OP_INPUT, EncodedTensor, TensorAssembler


@pytest.mark.parametrize("details", [{"self": 1}, {"message": "x", "code": "y"},
                                     {"shard_id": "s", "reason": "r", "cls": 3}])
def test_peer_error_details_are_data_never_keyword_arguments(details):
    err = error_from_code("shard_unavailable", "busy", details)
    assert isinstance(err, ShardUnavailable) and err.message == "busy"
    assert err.details == details and err.code == "shard_unavailable"
    assert error_from_code("bad_config", "x", {"file": 1, "self": 2}).code == "bad_config"


@pytest.mark.parametrize("sampling", [{"top_k": 1.5}, {"seed": "abc"}, {"max_tokens": "9"},
                                      {"temperature": "hot"}, {"top_p": [1]},
                                      {"max_tokens": True}, {"stop": "abc"}, {"seed": 2**64}])
def test_sampling_parameters_are_type_checked_at_the_door(sampling):
    with pytest.raises(BadRequest):
        DistributedChatParams.from_dict({"sampling": sampling}, DistributedChatParams())


def test_sampling_parameters_of_the_right_types_pass():
    p = DistributedChatParams.from_dict({"sampling": {"top_k": 5, "seed": 3, "top_p": 1,
                                                      "temperature": 0.7, "stop": ["x"]}},
                                        DistributedChatParams())
    assert p.sampling.top_k == 5 and p.sampling.stop == ("x",)


def test_prompt_limits_name_the_limit():
    lim = PromptLimits(max_prompt_bytes=10, max_prompt_tokens=3, max_completion_tokens=4)
    msgs = [{"role": "user", "content": "é" * 6}]  # 12 bytes
    with pytest.raises(BadRequest, match="max_prompt_bytes = 10") as e:
        lim.check_request(msgs, SamplingParams(max_tokens=1))
    assert e.value.details["limit"] == "max_prompt_bytes"
    with pytest.raises(BadRequest, match="max_completion_tokens = 4"):
        lim.check_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5))
    with pytest.raises(BadRequest, match="max_prompt_tokens = 3"):
        lim.check_prompt_ids([1, 2, 3, 4])
    lim.check_request([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    lim.check_prompt_ids([1, 2, 3])


def test_receive_buffer_grows_with_the_data_not_the_declared_size():
    big = torch.zeros(1, 4096, 64)  # 1 MiB declared
    enc = EncodedTensor(big, opcode=OP_INPUT, stream_id=1, step=0, start_pos=0,
                        chunk_bytes=4096)
    asm = TensorAssembler(chunk_bytes=4096)
    _, t = asm.feed(enc.frame(0))
    assert t is None and asm.buffered_bytes == 4096  # one chunk, not 1 MiB
    for i in range(1, len(enc.frames()) - 1):
        asm.feed(enc.frame(i))
    _, t = asm.feed(enc.frame(len(enc.frames()) - 1))
    assert t is not None and torch.equal(t, big)


def test_sanity_check_refuses_a_wrong_shape_or_dtype():
    c = SanityChecker(None)
    good = torch.zeros(1, 3, 8, dtype=torch.float16)
    c.check("s", 0, good, shape=(1, 3, 8), dtype=torch.float16)
    with pytest.raises(ShardCorrupted, match="shape") as e:
        c.check("s", 0, torch.zeros(1, 3, 7, dtype=torch.float16), shape=(1, 3, 8))
    assert e.value.details["check"] == "shape"
    with pytest.raises(ShardCorrupted, match=r"expected torch\.float16"):
        c.check("s", 0, good.float(), shape=(1, 3, 8), dtype=torch.float16)


# ---- §6 gossip backoff survives a hello followed by an immediate failure ----

async def test_gossip_backoff_survives_hello_then_failure(tmp_path):
    import asyncio
    import time

    from websockets.asyncio.server import serve

    from hearthnet.mesh.eventlog import EventLog
    from hearthnet.mesh.gossip import GossipPeerLink, encode_hello

    dials: list[float] = []

    async def hello_then_close(ws):  # answers the hello, then fails at once
        dials.append(time.monotonic())
        await ws.send(encode_hello("node-z", {}))
        await ws.recv()
        await ws.close(1011, "boom")

    log = EventLog(tmp_path / "a.sqlite3", "node-y")
    async with serve(hello_then_close, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        link = GossipPeerLink(log, f"ws://127.0.0.1:{port}", min_backoff=0.05,
                              max_backoff=0.8, stable_after_s=5.0)
        link.start()
        while len(dials) < 6:
            await asyncio.sleep(0.01)
        await link.stop()
    log.close()
    # backoff 0.05, 0.1, 0.2, 0.4, 0.8 (±20 %) between the six dials; before the fix the
    # hello reset it every time: six dials in ~0.3 s
    assert dials[5] - dials[0] >= 0.8 * (0.05 + 0.1 + 0.2 + 0.4 + 0.8)


# ---- §5 retention and per-origin quotas for every registered type ----

def test_every_event_type_has_retention_and_a_per_origin_bound(tmp_path):
    from hearthnet.mesh.eventlog import EventLog, EventType, EventTypes

    types = EventTypes()
    types.register(EventType("t.note", max_per_origin=3))
    types.register(EventType("t.temp", retain_s=10.0))
    now = [1000.0]
    log = EventLog(tmp_path / "e.sqlite3", "node-a", types=types, clock=lambda: now[0])
    for i in range(5):
        log.append("t.note", {"i": i})
    log.append("t.temp", {"x": 1})
    now[0] += 11
    assert log.compact(3600) == 2 + 1  # two notes over the quota, the expired temp
    held = [(e.type, e.payload.get("i")) for e in log.all_events()]
    assert held == [("t.note", 2), ("t.note", 3), ("t.note", 4)]
    pages = list(log.since_pages({}, log.vector(), page=2))
    assert [len(p) for p in pages] == [2, 1]  # catch-up is paged
    log.close()


def test_deep_msgpack_is_refused_at_the_door():
    import msgpack

    from hearthnet import safe_msgpack

    nested: object = 1
    for _ in range(600):
        nested = [nested]
    with pytest.raises(ValueError, match="nesting deeper"):
        safe_msgpack.unpackb(msgpack.packb(nested))
    assert safe_msgpack.unpackb(msgpack.packb({"a": [[1]]})) == {"a": [[1]]}


def test_a_per_origin_quota_holds_inside_one_ingested_batch(tmp_path):
    """The admission policy sees `count_of` including the events the same batch admitted
    before: a batch of 5 against a quota of 3 stores 3 (a flood in one gossip message)."""
    from hearthnet.mesh.eventlog import EventLog

    src = EventLog(tmp_path / "src.sqlite3", "node-b")
    events = [src.append("t.note", {"i": i}) for i in range(5)]
    src.close()
    holder: list[EventLog] = []

    def admit(ev):
        return "quota" if holder[0].count_of(ev.origin, ev.type) >= 3 else None

    log = EventLog(tmp_path / "dst.sqlite3", "node-a", admit=admit)
    holder.append(log)
    assert log.ingest_many(events) == [True] * 3 + [False] * 2
    assert log.count_of("node-b", "t.note") == 3 and log.count() == 3
    log.close()
