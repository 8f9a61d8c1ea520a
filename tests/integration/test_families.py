"""Every supported family, split into 2 and 3 ranges, reproduces the whole transformers model.

Issue 11 §1: head + ranges vs `AutoModelForCausalLM` on the same folder — logits within
1e-4 in fp32 at prefill and 16 decode steps, greedy tokens identical — with a prompt
longer than every family's sliding window. The same family models are run through real
node processes in tests/integration/test_family_mesh.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from tests.helpers.tiny_models import FAMILIES, tiny_config

SPLITS = {"two": [(0, 2), (3, 5)], "three": [(0, 1), (2, 3), (4, 5)]}
PROMPT = list(range(300, 314))  # 14 positions: longer than every sliding window (≤ 7)
DECODE = 16


@pytest.fixture(scope="module")
def family_store(family_models):
    return family_models[1]


def _greedy_through(head, stacks, ranges, ids, n):
    sessions = [st.open_session(a, b, len(ids) + n + 1)
                for st, (a, b) in zip(stacks, ranges, strict=True)]

    def run(x, pos):
        for s in sessions:
            x = s.forward(x, pos)
        return x

    logits = [head.logits(run(head.embed(ids), 0))]
    toks = [int(logits[-1].argmax())]
    for i in range(n):
        logits.append(head.logits(run(head.embed([toks[-1]]), len(ids) + i)))
        toks.append(int(logits[-1].argmax()))
    return toks, torch.stack(logits)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_split_matches_transformers(family, split, family_store,
                                           family_reference):
    entry = family_store[family]
    ranges = SPLITS[split]
    head = LayeredHead(entry)
    stacks = [LayeredStack(entry, a, b) for a, b in ranges]
    toks, logits = _greedy_through(head, stacks, ranges, PROMPT, DECODE)
    with torch.no_grad():  # teacher-forced on our tokens: one pass gives every step's logits
        ref_logits = family_reference(entry)(torch.tensor([PROMPT + toks[:-1]])).logits[
            0, len(PROMPT) - 1:]
    diff = (logits - ref_logits).abs().max().item()
    assert diff < 1e-4, f"{family} {split}: max logit difference {diff}"
    # transformers' greedy choice at every step is ours: the same greedy continuation
    assert ref_logits.argmax(-1).tolist() == toks, f"{family} {split}: greedy tokens"


def test_gemma3_has_two_rotaries_and_scaled_embeddings(family_store):
    """What broke on a real Gemma-3: embed_scale on meta and the per-layer-type rotary."""
    entry = family_store["gemma3"]
    head = LayeredHead(entry)
    scale = head.embed_tokens.embed_scale
    assert scale.device.type == "cpu" and float(scale) == pytest.approx(64 ** 0.5)
    stack = LayeredStack(entry, 0, 2)
    pe = stack.rotary(torch.zeros(1, 3, 64), torch.arange(3)[None],
                      ["sliding_attention", "full_attention"])
    assert not torch.allclose(pe["sliding_attention"][0], pe["full_attention"][0])


def test_gemma2_head_soft_caps_logits(family_store):
    head = LayeredHead(family_store["gemma2"])
    assert head.final_logit_softcapping == 30.0
    big = torch.full((1, 1, 64), 1e4)
    assert head.logits(big).abs().max().item() <= 30.0


def test_tiny_configs_are_the_real_families():
    """The scaled-down configs keep what makes each family itself."""
    assert tiny_config("llama3").rope_parameters["rope_type"] == "llama3"
    g3 = tiny_config("gemma3")
    assert g3.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert tiny_config("gemma2").final_logit_softcapping == 30.0
    assert tiny_config("phi3").rope_parameters["rope_type"] == "longrope"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layer_calls_reach_the_user_with_no_library_warning(family, family_store, capfd):
    """The layers are called with the cache argument the installed transformers expects
    (`cache`, or `past_key_values` before it), so no deprecation warning is printed."""
    entry = family_store[family]
    head = LayeredHead(entry)
    stack = LayeredStack(entry, 0, entry.num_layers - 1)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' deprecation: an error
        _greedy_through(head, [stack], [(0, entry.num_layers - 1)], PROMPT, 2)
    assert "deprecated" not in capfd.readouterr().err
