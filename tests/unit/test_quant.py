"""Weight formats (issue 12 §2): int8/int4 modules, per-tensor loading, heads, routing policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearthnet.distributed_inference import formats
from hearthnet.distributed_inference.backends import quant
from hearthnet.distributed_inference.backends import small_model_layered as sml
from hearthnet.distributed_inference.backends.quant import Int4Linear, Int8Linear
from hearthnet.distributed_inference.backends.small_model_layered import (
    LayeredHead,
    LayeredStack,
)
from hearthnet.errors import BadRequest
from hearthnet.models import ModelStore
from hearthnet.models.importer import import_folder
from tests.helpers.tiny_models import make_tiny_model

FAMS = ("llama", "qwen2", "mistral", "gemma2")  # tied, qkv bias, untied, scaled embeddings


@pytest.fixture(scope="module")
def fam_store(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("quant")
    store = ModelStore(root / "store")
    return {f: import_folder(store, make_tiny_model(f, root / "src" / f, smollm2.path,
                                                    layers=4, seed=2), alias=f)
            for f in FAMS}


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


def _logits(entry, weights, ids):
    head = LayeredHead(entry, "int8" if weights == "int4" else weights)
    stack = LayeredStack(entry, 0, entry.num_layers - 1, weights)
    s = stack.open_session(0, entry.num_layers - 1, 32)
    out = [head.logits(s.forward(head.embed(ids), 0))]
    out.append(head.logits(s.forward(head.embed([int(out[-1].argmax())]), len(ids))))
    return torch.stack(out), stack, head


@pytest.fixture(scope="module")
def fp32_ref(fam_store):
    cache: dict[str, tuple[torch.Tensor, int, int]] = {}

    def get(family: str) -> tuple[torch.Tensor, int, int]:
        if family not in cache:
            ref, stack, head = _logits(fam_store[family], "fp32", IDS)
            cache[family] = (ref, stack.param_bytes(), head.param_bytes())
        return cache[family]

    return get


IDS = list(range(300, 310))
# relative logit error vs fp32 (random tiny models amplify errors more than real ones; a
# wrong layout or scale gives ≥ 1). int4 is checked loosely here, exactly in the unit test.
CASES = [("llama", "bf16", 0.03), ("llama", "int8", 0.05), ("llama", "int4", 0.8),
         ("qwen2", "int8", 0.05), ("gemma2", "int8", 0.05), ("mistral", "int8", 0.05)]


@pytest.mark.parametrize(("family", "fmt", "tol"), CASES)
def test_formats_load_and_stay_close_to_fp32(fam_store, fp32_ref, family, fmt, tol):
    ref, ref_stack_bytes, ref_head_bytes = fp32_ref(family)
    got, stack, head = _logits(fam_store[family], fmt, IDS)
    assert stack.format == fmt and got.dtype == torch.float32
    rel = float((got - ref).norm() / ref.norm())
    assert rel < tol, (family, fmt, rel)
    if fmt in formats.QUANTISED:  # every Linear was replaced by its quantised module
        assert not [m for m in stack.layers.modules() if isinstance(m, nn.Linear)]
    if fmt == "int8":  # held bytes ≈ a quarter of fp32 (plus scales and fp32 norms)
        assert 0.25 < stack.param_bytes() / ref_stack_bytes < 0.32
        assert head.param_bytes() < ref_head_bytes / 3


def test_loading_reads_one_tensor_at_a_time(fam_store, monkeypatch):
    sizes: list[int] = []
    orig = sml._WeightsReader.read

    def spy(self, keys, device=None):
        keys = list(keys)
        sizes.append(len(keys))
        return orig(self, keys, device)

    monkeypatch.setattr(sml._WeightsReader, "read", spy)
    LayeredStack(fam_store["qwen2"], 0, 3, "int8")
    assert sizes and set(sizes) == {1}


def test_head_refuses_int4_and_unknown_format(fam_store):
    with pytest.raises(BadRequest, match="a head holds"):
        LayeredHead(fam_store["llama"], "int4")
    with pytest.raises(BadRequest, match="unknown weight format"):
        LayeredStack(fam_store["llama"], 0, 1, "q4_k")
