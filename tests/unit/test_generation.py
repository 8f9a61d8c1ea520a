"""Sampling, incremental detokenisation, stop strings and log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from hearthnet.distributed_inference.engine.generation import (
    Generation,
    PromptLimits,
    Sampler,
    token_bytes,
)
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.engine.speculation import LookupProposer, Speculator
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
                                {"top_k": -2}, {"stop": ("",)}, {"logprobs": 21},
                                {"logprobs": -1}, {"logprobs": True}, {"logprobs": 1.0}])
def test_bad_sampling_params(kw):
    with pytest.raises(BadRequest):
        SamplingParams(**kw)


class _Pieces:
    """A byte-level tokenizer for `Generation`: token i is the letter ``chr(97 + i % 26)``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, i: int) -> str:
        return chr(97 + i % 26)


def _gen(**kw) -> Generation:
    return Generation(_Pieces(), [1, 2], SamplingParams(max_tokens=8, **kw), eos_ids=set())


def test_logprobs_are_the_model_s_log_softmax_before_sampling_transforms():
    """OpenAI reports the model's log-probabilities: of the raw logits, not of the
    distribution after temperature, top-k and top-p the token was drawn from."""
    torch.manual_seed(0)
    logits = torch.randn(50) * 3
    gen = _gen(temperature=0.7, top_k=5, top_p=0.9, seed=3, logprobs=4)
    ev = gen.step(logits)
    want = torch.log_softmax(logits, dim=-1)
    assert ev.logprobs is not None
    assert ev.logprobs.logprob == pytest.approx(float(want[ev.token_id]), abs=1e-6)
    top = ev.logprobs.top
    assert [i for i, _, _ in top] == torch.topk(want, 4).indices.tolist()
    assert [lp for _, lp, _ in top] == pytest.approx(torch.topk(want, 4).values.tolist())
    assert [lp for _, lp, _ in top] == sorted((lp for _, lp, _ in top), reverse=True)
    assert all(b == chr(97 + i % 26).encode() for i, _, b in top)
    assert ev.logprobs.token_bytes == chr(97 + ev.token_id % 26).encode()
    # a distribution: every logprob ≤ 0, the whole vocabulary's sum to 1
    assert float(torch.exp(want).sum()) == pytest.approx(1.0, abs=1e-5)
    assert sum(math.exp(lp) for _, lp, _ in top) <= 1.0 + 1e-6
    assert ev.logprobs.logprob <= 0.0
    # temperature 0.7 would give another number: the tempered one is not reported
    tempered = torch.log_softmax(logits / 0.7, dim=-1)[ev.token_id]
    assert abs(float(tempered) - ev.logprobs.logprob) > 1e-3


def test_the_default_path_keeps_no_logits_and_samples_the_same_tokens():
    torch.manual_seed(1)
    rows = [torch.randn(40) for _ in range(6)]
    plain, asked = _gen(temperature=1.0, seed=11), _gen(temperature=1.0, seed=11, logprobs=0)
    got_plain = [plain.step(r) for r in rows]
    got_asked = [asked.step(r) for r in rows]
    assert [e.token_id for e in got_plain] == [e.token_id for e in got_asked]
    assert all(e.logprobs is None for e in got_plain)
    assert plain.sampler.row is None  # nothing kept, nothing computed
    assert all(e.logprobs is not None and e.logprobs.top == () for e in got_asked)


def test_a_speculative_pass_reports_each_token_from_the_row_that_verified_it():
    torch.manual_seed(2)
    rows = torch.randn(3, 30)  # after the pass's input token and after each proposal
    gen = _gen(logprobs=2)
    gen.step(torch.randn(30))  # the prefill's token
    proposed = [int(rows[0].argmax()), int(rows[1].argmax())]  # greedy: both accepted
    events = Speculator("lookup", LookupProposer(), 4).accept(gen, rows, proposed)
    assert [e.token_id for e in events] == [*proposed, int(rows[2].argmax())]
    for e, row in zip(events, rows, strict=True):
        lp = torch.log_softmax(row, dim=-1)
        assert e.logprobs is not None
        assert e.logprobs.logprob == pytest.approx(float(lp[e.token_id]), abs=1e-6)
        assert e.logprobs.top[0][0] == e.token_id  # greedy: the sampled one is the likeliest
    assert len({id(e.logprobs) for e in events}) == 3  # one per token


def test_token_bytes_are_exact_for_a_token_that_is_part_of_a_character(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2.path))
    text = "héllo ☃ <|im_end|>"
    ids = tok(text)["input_ids"]
    parts = [token_bytes(tok, i) for i in ids]
    assert b"".join(parts) == text.encode()
    assert any(p and not _utf8(p) for p in parts)  # the snowman is split across tokens


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_raw_prompt_is_held_to_the_messages_byte_limit():
    limits = PromptLimits(max_prompt_bytes=8)
    limits.check_request("12345678", SamplingParams())
    with pytest.raises(BadRequest, match="max_prompt_bytes") as e:
        limits.check_request("é" * 5, SamplingParams())  # 10 bytes
    assert e.value.details["value"] == 10
