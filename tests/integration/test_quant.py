"""Weight formats (issue 12 §2) on SmolLM2's weights: loading per tensor, heads, closeness
to fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hearthnet.distributed_inference.directory import formats
from hearthnet.distributed_inference.engine import weights as sml_weights
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
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
        # a head whose lm_head is tied to its embeddings holds the int8 matrix twice where
        # oneDNN runs the product: plain rows for lookups, packed for the lm_head
        twice = head.lm_head_q is head.embed_q and head.embed_q.packed
        assert head.param_bytes() < ref_head_bytes / (1.9 if twice else 3)


def test_loading_reads_one_tensor_at_a_time(fam_store, monkeypatch):
    sizes: list[int] = []
    orig = sml_weights.WeightsReader.read

    def spy(self, keys, device=None):
        keys = list(keys)
        sizes.append(len(keys))
        return orig(self, keys, device)

    monkeypatch.setattr(sml_weights.WeightsReader, "read", spy)
    LayeredStack(fam_store["qwen2"], 0, 3, "int8")
    assert sizes and set(sizes) == {1}


def test_head_refuses_int4_and_unknown_format(fam_store):
    with pytest.raises(BadRequest, match="a head holds"):
        LayeredHead(fam_store["llama"], "int4")
    with pytest.raises(BadRequest, match="unknown weight format"):
        LayeredStack(fam_store["llama"], 0, 1, "q4_k")
