"""Sampling, incremental detokenisation and stop strings (issue 2 §5)."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine.generation import Sampler
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import BadRequest


def test_seeded_sampling_is_reproducible_and_filters_apply():
    logits = torch.randn(1000)
    p = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=7)
    a = [Sampler(p)(logits) for _ in range(1)]
    s1, s2 = Sampler(p), Sampler(p)
    xs = [s1(logits) for _ in range(50)]
    assert xs == [s2(logits) for _ in range(50)] and a[0] == xs[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert set(xs) <= top5
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())  # temperature 0 = greedy


@pytest.mark.parametrize("kw", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0},
                                {"top_k": -2}, {"stop": ("",)}])
def test_bad_sampling_params(kw):
    with pytest.raises(BadRequest):
        SamplingParams(**kw)
