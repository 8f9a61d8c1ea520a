"""Sampling, incremental detokenisation and stop strings with SmolLM2's tokenizer (issue 2 §5)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from hearthnet.distributed_inference.engine.generation import (
    Generation,
    IncrementalDetokenizer,
)
from hearthnet.distributed_inference.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2):
    return AutoTokenizer.from_pretrained(str(smollm2.path))


def test_multibyte_characters_come_out_whole(tok):
    text = "Grüße 🦊 из Москвы — 東京タワー 🎉!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # byte-level BPE splits the emoji over several tokens: a naive per-token decode breaks it
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d = IncrementalDetokenizer(tok, [])
    pieces = [d.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == text


def _gen(tok, params, eos=frozenset({2})):
    return Generation(tok, tok("Hi", add_special_tokens=False)["input_ids"], params, set(eos))


def test_stop_string_ends_and_is_not_streamed(tok):
    g = _gen(tok, SamplingParams(max_tokens=50, stop=("STOP",)))
    out = "".join(g.accept(i).text for i in tok("one two STOP three",
                                                add_special_tokens=False)["input_ids"]
                  if not g.done)
    assert g.finish_reason == "stop" and out == "one two " and "STOP" not in out


def test_held_back_prefix_is_released_when_not_a_stop(tok):
    g = _gen(tok, SamplingParams(max_tokens=50, stop=("STOP",)))
    ids = tok("a ST b", add_special_tokens=False)["input_ids"]
    out = "".join(g.accept(i).text for i in ids)
    g2 = _gen(tok, SamplingParams(max_tokens=len(ids) + 1))
    assert out + g._release(final=True) == "".join(g2.accept(i).text for i in ids) + \
        g2._release(final=True)


def test_eos_and_max_tokens(tok):
    g = _gen(tok, SamplingParams(max_tokens=3))
    for i in tok("a b c d", add_special_tokens=False)["input_ids"][:3]:
        g.accept(i)
    assert g.finish_reason == "length"
    g = _gen(tok, SamplingParams(max_tokens=10))
    g.accept(tok("a", add_special_tokens=False)["input_ids"][0])
    ev = g.accept(2)
    assert g.finish_reason == "eos" and ev.text == ""
