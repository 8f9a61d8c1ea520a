"""Layered backend: only a range's weights, any family, sub-ranges, bad input (issue 2 §3-4)."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine import weights as sml_weights
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.errors import BadRequest


def test_range_holds_and_reads_only_its_own_layers(smollm2, monkeypatch):
    read: list[str] = []
    orig = sml_weights.WeightsReader.read

    def spy(self, keys, device=None):
        keys = list(keys)
        read.extend(keys)
        return orig(self, keys, device)

    monkeypatch.setattr(sml_weights.WeightsReader, "read", spy)
    stack = LayeredStack(smollm2, 15, 29)
    assert stack.layer_indices() == list(range(15, 30))
    assert read and all(any(f"layers.{i}." in k for i in range(15, 30)) for k in read)
    assert not any("embed_tokens" in k or k.startswith("model.norm") for k in read)
    names = [n for n, _ in stack.layers.named_parameters()]
    per_layer = len(names) // 15
    assert len(stack.layers) == 15 and per_layer == 9  # 4 attn + 3 mlp + 2 norms (Llama)
    assert all(p.device.type == "cpu" for p in stack.layers.parameters())
    whole = sum(1 for _ in read)
    assert whole == 15 * 9
    # 15 of 30 layers: about half of the non-embedding parameters, none of the embedding
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(smollm2.path))
    layer_bytes = sum(p.numel() * 4 for n, p in full.named_parameters() if ".layers." in n)
    assert stack.param_bytes() == layer_bytes // 2


def test_head_loads_only_embeddings_norm_and_head(smollm2, monkeypatch):
    read: list[str] = []
    orig = sml_weights.WeightsReader.read
    monkeypatch.setattr(sml_weights.WeightsReader, "read",
                        lambda self, keys, device=None: (read.extend(keys := list(keys)),
                                                         orig(self, keys, device))[1])
    head = LayeredHead(smollm2)
    assert sorted(read) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert head.lm_head_weight.data_ptr() == head.embed_tokens.weight.data_ptr()  # tied


def test_session_redo_and_bad_input(smollm2):
    stack = LayeredStack(smollm2, 0, 3)
    s = stack.open_session(1, 2, 16)
    x = torch.randn(1, 4, 576)
    first = s.forward(x, 0)
    again = s.forward(x, 0)  # a redone step cuts the cache back and gives the same output
    assert torch.equal(first, again) and s.length == 4
    with pytest.raises(BadRequest, match="gap"):
        s.forward(torch.randn(1, 1, 576), 6)
    with pytest.raises(BadRequest, match="shape"):
        s.forward(torch.randn(1, 1, 100), 4)
    with pytest.raises(BadRequest, match="max_length"):
        s.forward(torch.randn(1, 13, 576), 4)
    with pytest.raises(BadRequest, match="outside"):
        stack.open_session(2, 7, 16)
    assert s.length == 4  # refused steps leave the session as it was


def test_bf16_compute(smollm2):
    head = LayeredHead(smollm2, "bf16")
    stack = LayeredStack(smollm2, 0, 29, "bf16")
    ids = head.chat_prompt_ids([{"role": "user", "content": "Hi"}])
    s = stack.open_session(0, 29, 64)
    h = s.forward(head.embed(ids), 0)
    assert h.dtype == torch.bfloat16 and torch.isfinite(head.logits(h)).all()
