"""M26 §4.1 dataclasses and the shard event payloads."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from hearthnet.distributed_inference.directory.descriptors import (
    Pipeline,
    PipelineStage,
    ShardDescriptor,
    ShardHealth,
    advertisement_payload,
    make_shard_id,
    parse_advertisement,
    parse_withdrawal,
    withdrawal_payload,
)
from hearthnet.errors import BadRequest, PeerDataError

SHA = "ab" * 32
AT = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def desc(lo: int, hi: int, host: str = "node-b", model: str = "org/model") -> ShardDescriptor:
    return ShardDescriptor.create(model_id=model, weights_sha256=SHA, layer_range=(lo, hi),
                                  host=host, endpoint="ws://127.0.0.1:7702",
                                  max_concurrent_streams=8, vram_required_mb=300,
                                  advertised_at=AT)


def test_shard_id_names_model_range_and_host() -> None:
    d = desc(0, 14)
    assert d.shard_id == "org/model:0-14@node-b" == make_shard_id("org/model", 0, 14, "node-b")
    assert desc(0, 14, host="node-d").shard_id != d.shard_id  # two hosts, same range
    assert d.contains(0) and d.contains(14) and not d.contains(15)
    assert d.num_layers == 15


def test_descriptor_round_trips_through_dict() -> None:
    d = desc(3, 9)
    back = ShardDescriptor.from_dict(d.to_dict())
    assert back == d
    assert back.advertised_at == AT


@pytest.mark.parametrize(("field", "value"), [
    ("shard_id", "org/model:0-14"),            # id without host (spec form) is refused
    ("layer_range", [5, 2]),
    ("layer_range", [-1, 2]),
    ("layer_range", [0]),
    ("weights_sha256", "xyz"),
    ("host", "Node B"),
    ("endpoint", "http://x:1"),
    ("max_concurrent_streams", 0),
    ("max_concurrent_streams", True),
    ("advertised_at", "yesterday"),
    ("hop_weight", -1.0),
])
def test_descriptor_from_dict_refuses_bad_fields(field: str, value: object) -> None:
    d = desc(0, 14).to_dict()
    d[field] = value
    with pytest.raises(BadRequest):
        ShardDescriptor.from_dict(d)


def test_descriptor_from_dict_missing_field_is_bad_request() -> None:
    d = desc(0, 14).to_dict()
    del d["endpoint"]
    with pytest.raises(BadRequest, match="endpoint"):
        ShardDescriptor.from_dict(d)


def test_health_round_trip_and_validation() -> None:
    h = ShardHealth("s", True, AT, 12.5, 3, 2)
    assert ShardHealth.from_dict(h.to_dict()) == h
    bad = h.to_dict() | {"queue_depth": -1}
    with pytest.raises(BadRequest):
        ShardHealth.from_dict(bad)
    with pytest.raises(BadRequest):
        ShardHealth.from_dict(h.to_dict() | {"online": "yes"})


def test_advertisement_and_withdrawal_payloads() -> None:
    d = desc(0, 14)
    h = ShardHealth(d.shard_id, True, AT, 5.0, 0, 1)
    assert parse_advertisement(advertisement_payload(d, h)) == (d, h)
    assert parse_advertisement(advertisement_payload(d)) == (d, None)
    other = ShardHealth("other", True, AT, 5.0, 0, 1)
    # a peer's malformed event is the peer's fault, not a caller's bad request
    with pytest.raises(PeerDataError, match=r"health\.shard_id") as info:
        parse_advertisement(advertisement_payload(d, other))
    assert info.value.code == "bad_peer_data" and not isinstance(info.value, BadRequest)
    p = advertisement_payload(d) | {"shard_id": "x"}
    with pytest.raises(PeerDataError, match="shard_id"):
        parse_advertisement(p)
    assert parse_withdrawal(withdrawal_payload(d.shard_id)) == (d.shard_id, "shutdown")
    with pytest.raises(PeerDataError, match="shard_id is missing"):
        parse_withdrawal({"reason": "x"})


def test_stage_must_lie_inside_its_shard() -> None:
    d = desc(4, 11)
    assert PipelineStage(d, 8, 11).num_layers == 4
    with pytest.raises(BadRequest):
        PipelineStage(d, 2, 8)
    with pytest.raises(BadRequest):
        PipelineStage(d, 9, 8)


def test_pipeline_validates_exact_cover_and_round_trips() -> None:
    a, b = desc(0, 7), desc(4, 15, host="node-c")
    p = Pipeline.from_stages("p1", "org/model", SHA, 16,
                             [PipelineStage(a, 0, 7), PipelineStage(b, 8, 15)], AT)
    assert p.ordered_shards == [a, b]
    assert p.shard_ids == [a.shard_id, b.shard_id]
    assert Pipeline.from_dict(p.to_dict()) == p
    with pytest.raises(BadRequest, match="starts at layer 4"):
        Pipeline.from_stages("p2", "org/model", SHA, 16,
                             [PipelineStage(a, 0, 7), PipelineStage(b, 4, 15)])
    with pytest.raises(BadRequest, match="covers layers 0-7 of 16"):
        Pipeline.from_stages("p3", "org/model", SHA, 16, [PipelineStage(a, 0, 7)])
    with pytest.raises(BadRequest, match="another model"):
        Pipeline.from_stages("p4", "org/other", SHA, 8, [PipelineStage(a, 0, 7)])


def test_a_quantised_shard_names_its_kernel_and_status_shows_it() -> None:
    """Which kernel an int8/int4 shard's products run in (fbgemm on AVX2, oneDNN on
    VNNI/AMX …) is advertised with its format: int8 numerics differ slightly between
    kernels, so a mixed mesh shows it. An advertisement from an older release (no
    `kernel`) parses as none; one from a newer release naming a kernel this one does not
    know still parses (its shard is not dropped); only a malformed name is refused."""
    from hearthnet.commands.status import render

    kw = dict(model_id="org/model", weights_sha256=SHA, layer_range=(0, 3), host="n1",
              endpoint="ws://h:1", max_concurrent_streams=2)
    d = ShardDescriptor.create(**kw, weights_format="int8", kernel="fbgemm")
    assert ShardDescriptor.from_dict(d.to_dict()).kernel == "fbgemm"
    old = d.to_dict()
    del old["kernel"]
    assert ShardDescriptor.from_dict(old).kernel == ""
    newer = {**d.to_dict(), "kernel": "kleidiai-i8mm"}
    assert ShardDescriptor.from_dict(newer).kernel == "kleidiai-i8mm"
    for bad in ("x" * 33, "Fbgemm <b>", 8):
        with pytest.raises(BadRequest, match="kernel"):
            ShardDescriptor.from_dict({**d.to_dict(), "kernel": bad})
    row = {"shard_id": d.shard_id, "layers": [0, 3], "host": "n1", "suspect": False,
           "active_sessions": 0, "queue_depth": 0, "p95_latency_ms": 0.0, "age_s": 1.0,
           "format": "int8", "kernel": "fbgemm", "memory_mb": 40}
    fp32 = {**row, "host": "n2", "format": "fp32", "kernel": ""}
    text = render({"node_id": "n1", "endpoint": "ws://h:1", "shards": [row, fp32],
                   "models": []})
    assert "int8 (fbgemm)" in text and "fp32 " in text and "fp32 (" not in text
    # a shard whose ACCEPT said int8 though it advertised fp32: the truth, marked
    moved = {**row, "host": "n3", "format": "int8", "advertised_format": "fp32"}
    text = render({"node_id": "n1", "endpoint": "ws://h:1", "shards": [moved], "models": []})
    assert "int8!" in text


def test_a_shard_advertises_the_kernel_this_process_chose() -> None:
    from hearthnet.distributed_inference.directory.formats import KERNELS
    from hearthnet.distributed_inference.engine.q4vnni import KERNEL as VNNI
    from hearthnet.distributed_inference.engine.quant import INT4_KERNEL, INT8_KERNEL, kernel_of

    assert kernel_of("int8") == INT8_KERNEL  # int4 quantised at load: vnni, else bf16
    assert kernel_of("int4") == (VNNI if INT4_KERNEL == VNNI else "int4pack-bf16")
    assert kernel_of("int4", blocks=True) == INT4_KERNEL  # a GGUF's Q4 blocks held as int4
    assert kernel_of("fp32") == kernel_of("bf16") == ""
    for kernel in (INT8_KERNEL, "int4pack-bf16", "int4pack-fp32"):  # advertised as they are
        assert kernel in KERNELS
        d = ShardDescriptor.create(model_id="org/model", weights_sha256=SHA, layer_range=(0, 3),
                                   host="n1", endpoint="ws://h:1", max_concurrent_streams=2,
                                   weights_format="int4", kernel=kernel)
        assert ShardDescriptor.from_dict(d.to_dict()).kernel == kernel
