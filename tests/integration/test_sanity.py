"""Sanity bounds: calibrated per boundary, real activations pass, garbage does not (issue 6 §3)."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.orchestrator.sanity import (
    CALIBRATION_PROMPTS,
    SanityChecker,
    calibrate,
)
from hearthnet.errors import ShardCorrupted

OTHER_PROMPTS = ["Write a short poem about a lighthouse keeper.",
                 "Explain in three sentences why the sky is blue.",
                 "¿Cuál es la capital de Francia? Responde en español.",
                 "Summarise the plot of Hamlet in one paragraph."]


@pytest.fixture(scope="module")
def checker(smollm2):
    return SanityChecker(calibrate(smollm2.path).bounds)


def test_bounds_are_cached_per_boundary(smollm2, checker):
    assert checker.bounds is not None and len(checker.bounds) == smollm2.num_layers
    assert all(b > 0 for b in checker.bounds)
    assert calibrate(smollm2.path).bounds == checker.bounds  # second call reads the cache
    assert not set(OTHER_PROMPTS) & set(CALIBRATION_PROMPTS)


def test_real_activations_of_other_prompts_pass(smollm2, checker):
    head = LayeredHead(smollm2)
    stack = LayeredStack(smollm2, 0, 29)
    for p in OTHER_PROMPTS:
        ids = head.chat_prompt_ids([{"role": "user", "content": p}])
        h = head.embed(ids)
        for i in range(30):
            h = stack.open_session(i, i, len(ids)).forward(h, 0)
            checker.check("s", i, h)  # raises if a real activation crossed its bound


def test_nan_inf_and_scaled_garbage_are_caught(checker):
    h = torch.randn(1, 3, 576)
    for bad in (h * float("nan"), h.masked_fill(h > 1, float("inf"))):
        with pytest.raises(ShardCorrupted, match="NaN or Inf"):
            checker.check("s", 14, bad)
    with pytest.raises(ShardCorrupted, match="norm"):
        checker.check("s", 14, torch.full((1, 1, 576), 1e4))
