"""Head + [0,14] + [15,29] + head reproduces the whole transformers model (issue 2 §6)."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack

PROMPTS = [  # two prompts × 64 tokens (a third added a minute to the suite, nothing new)
    "What is the capital of France?",
    "Write a short poem about a lighthouse keeper.",
]


@pytest.fixture(scope="module")
def parts(smollm2):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    return (LayeredHead(smollm2), LayeredStack(smollm2, 0, 14), LayeredStack(smollm2, 15, 29),
            ref)


def _split_greedy(head, a, b, ids, n, wire=None):
    """Greedy decode through two ranges; `wire` rounds the boundary hidden state.

    (The wire dtypes' effect on SmolLM2 and every family is measured and printed by
    tests/integration/test_wire_report.py.)
    """
    sa, sb = a.open_session(0, 14, len(ids) + n + 1), b.open_session(15, 29, len(ids) + n + 1)

    def through(x, pos):
        h = sa.forward(x, pos)
        if wire is not None:
            h = h.to(wire)
        return sb.forward(h, pos)

    logits = [head.logits(through(head.embed(ids), 0))]
    toks = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits.append(head.logits(through(head.embed([toks[-1]]), len(ids) + i)))
        toks.append(int(logits[-1].argmax()))
    return toks, logits


def test_logits_match_on_prefill_and_32_decode_steps(parts):
    head, a, b, ref = parts
    ids = head.chat_prompt_ids([{"role": "user", "content": PROMPTS[0]}])
    toks, logits = _split_greedy(head, a, b, ids, 33)
    full = ids + toks[:-1]
    with torch.no_grad():
        ref_logits = ref(torch.tensor([full])).logits[0, len(ids) - 1:]
    diff = (torch.stack(logits) - ref_logits).abs().max().item()
    assert diff < 1e-4, f"max logit difference {diff}"


@pytest.mark.parametrize("prompt", PROMPTS[1:])  # the other prompt is the logits test's
def test_greedy_tokens_are_transformers_greedy_choices(parts, prompt):
    """64 greedy tokens through the two ranges are transformers' greedy choice at every
    position: its argmax after the prompt and each token before (what its `generate`
    picks step by step), from one forward over the whole sequence — the suite runs this
    beside other tests on two cores, where `generate`'s 64 steps took up to 118 s."""
    head, a, b, ref = parts
    ids = head.chat_prompt_ids([{"role": "user", "content": prompt}])
    toks, _ = _split_greedy(head, a, b, ids, 64)
    with torch.no_grad():
        logits = ref(torch.tensor([ids + toks[:-1]])).logits[0, len(ids) - 1:]
    expected = logits.argmax(-1).tolist()
    # generation stops at EOS: up to there (EOS included) the tokens must be identical
    stop = next((i + 1 for i, t in enumerate(expected) if t in head.eos_token_ids), 64)
    assert toks[:stop] == expected[:stop]
