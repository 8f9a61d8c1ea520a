"""Calibration holds one decoder layer at a time (issue 12: an orchestrator of a 7B model
must not need the whole model in fp32 to calibrate its sanity bounds and wire plan)."""

from __future__ import annotations

import torch

from hearthnet.distributed_inference.engine import head as engine_head
from hearthnet.distributed_inference.engine import layers as engine_layers
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.orchestrator.sanity import (
    CALIBRATION_PROMPTS,
    MARGIN,
    calibrate,
)
from hearthnet.models.store import ModelStore
from hearthnet.models.synth import write_synthetic
from tests.helpers.tiny_models import TINY_QWEN2

TINY = {**TINY_QWEN2, "num_hidden_layers": 4}


def _whole_model_reference(entry) -> tuple[list[float], list[float]]:
    """Bounds and absmax computed the simple way: every layer of the model in one stack."""
    head, stack = LayeredHead(entry), LayeredStack(entry, 0, entry.num_layers - 1)
    peaks, absmax = [0.0] * entry.num_layers, [0.0] * entry.num_layers
    for p in CALIBRATION_PROMPTS:
        ids = head.chat_prompt_ids([{"role": "user", "content": p}])
        h = head.embed(ids)
        for i in range(entry.num_layers):
            s = stack.open_session(i, i, len(ids))
            h = s.forward(h, 0)
            s.close()
            peaks[i] = max(peaks[i], float(h.float().norm(dim=-1).max()))
            absmax[i] = max(absmax[i], float(h.abs().max()))
    return [x * MARGIN for x in peaks], absmax


def test_calibration_loads_one_layer_at_a_time_and_matches_the_whole_model(
        tmp_path, smollm2, monkeypatch):
    torch.set_num_threads(1)
    entry = write_synthetic(ModelStore(tmp_path), "tiny", TINY, seed=3,
                            model_id="hearthnet-synthetic/tiny", tokenizer_from=smollm2.path,
                            source="test")
    ranges: list[tuple[int, int]] = []
    real = LayeredStack

    class Spy(real):  # type: ignore[misc,valid-type]
        def __init__(self, e, lo, hi, *a, **kw):
            ranges.append((lo, hi))
            super().__init__(e, lo, hi, *a, **kw)

    heads: list[int] = []
    real_head = LayeredHead

    class HeadSpy(real_head):  # type: ignore[misc,valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            heads.append(self.lm_head_weight.numel())

    monkeypatch.setattr(engine_layers, "LayeredStack", Spy)
    monkeypatch.setattr(engine_head, "LayeredHead", HeadSpy)
    cal = calibrate(entry.path)
    monkeypatch.setattr(engine_layers, "LayeredStack", real)
    monkeypatch.setattr(engine_head, "LayeredHead", real_head)
    assert ranges == [(i, i) for i in range(entry.num_layers)]  # never two layers at once
    assert heads == [0]  # embeddings only: no lm_head loaded to calibrate
    bounds, absmax = _whole_model_reference(entry)
    assert cal.bounds == bounds and cal.absmax == absmax  # the same figures as before
