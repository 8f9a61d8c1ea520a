"""Weight formats (issue 12 §2): int8/int4 modules, per-tensor loading, heads, routing policy."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference import formats
from hearthnet.distributed_inference.backends import quant
from hearthnet.distributed_inference.backends.quant import Int4Linear, Int8Linear
from hearthnet.errors import BadRequest


def test_int8_and_int4_linear_match_the_float_product():
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 256) * 0.05, torch.randn(96), torch.randn(3, 5, 256)
    ref = torch.nn.functional.linear(x, w, b)
    q8, q4 = Int8Linear(w, b), Int4Linear(w, b)
    assert q8.weight_int8.dtype == torch.int8 and q8.weight_int8.shape == (96, 256)
    # per-output-channel symmetric: each row's largest |w| maps to ±127
    assert bool((q8.weight_int8.abs().amax(1) == 127).all())
    assert (q8.dequantised() - w).abs().max() <= w.abs().amax(1).max() / 127
    for m, tol in ((q8, 0.02), (q4, 0.12)):
        y = m(x)
        assert y.shape == ref.shape and y.dtype == x.dtype
        assert float((y - ref).norm() / ref.norm()) < tol
    assert Int4Linear(torch.randn(16, 96), None).group == 32  # 128 and 64 do not divide 96
    with pytest.raises(BadRequest, match="int4 needs"):
        Int4Linear(torch.randn(16, 100), None)


def test_formats_and_routing_policy():
    assert formats.resolve_format("native", "bfloat16") == "bf16"
    assert formats.resolve_format("native", "float32") == "fp32"
    assert formats.resolve_format("int8", "bfloat16") == "int8"
    assert quant.format_name(torch.bfloat16) == "bf16" and quant.format_name("float32") == "fp32"
    with pytest.raises(BadRequest, match="unknown weight format 'int3'"):
        formats.resolve_format("int3", "float32")
    assert formats.check_policy(None) == "int8"
    for bad in ("fp8", 3, "EXACT"):
        with pytest.raises(BadRequest, match="weights must be"):
            formats.check_policy(bad)
    # default: at least as precise as int8 — int4 is left out
    assert formats.accepted_formats("int8", "fp32") == ["fp32", "bf16", "fp16", "int8"]
    assert formats.accepted_formats("bf16", "fp32") == ["fp32", "bf16", "fp16"]
    assert formats.accepted_formats("int4", "fp32") == list(formats.HELD_FORMATS)
    assert formats.accepted_formats("exact", "bf16") == ["bf16"]


def test_quantisation_works_in_bounded_chunks_with_the_same_result(monkeypatch):
    """A wide weight (a 7B down_proj is 3584 × 18944) is quantised a few Mi elements at a
    time, so a shard's load transient stays small; the result does not depend on it."""
    torch.manual_seed(0)
    w = torch.randn(96, 640).bfloat16()
    whole = Int8Linear(w, None)
    seen: list[int] = []
    rows = quant._rows

    def spy(t):
        for r, chunk in rows(t):
            seen.append(chunk.numel())
            yield r, chunk

    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 4 * 640)
    monkeypatch.setattr(quant, "_rows", spy)
    chunked = Int8Linear(w, None)
    assert max(seen) <= 4 * 640 and len(seen) == 96 // 4
    assert torch.equal(chunked.weight_int8, whole.weight_int8)
    assert torch.equal(chunked.scales, whole.scales)
