"""Speculative passes (DESIGN.md decision 16): proposers, acceptance, the rejection rule, and
the local engine's speculative answer on the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine.generation import Generation, Sampler
from hearthnet.distributed_inference.engine.sampling import SamplingParams, check_speculate
from hearthnet.distributed_inference.engine.speculation import (
    RETRY_AFTER_TOKENS,
    LookupProposer,
    SpecLength,
    Speculator,
    check_draft_tokenizer,
)
from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams
from hearthnet.errors import BadRequest

VOCAB = 32


class Tok:
    """A tokenizer whose token i reads ``<i>``."""

    def __init__(self, vocab: dict[str, int] | None = None) -> None:
        self.vocab = vocab or {f"<{i}>": i for i in range(VOCAB)}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)

    def get_vocab(self):
        return dict(self.vocab)


def _gen(prompt, max_tokens=16, eos=(31,), **kw) -> Generation:
    return Generation(Tok(), list(prompt), SamplingParams(max_tokens=max_tokens, **kw),
                      set(eos))


def _rows(*tokens: int) -> torch.Tensor:
    """Logits whose row i puts its argmax on tokens[i]."""
    rows = torch.zeros(len(tokens), VOCAB)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


# ---- prompt lookup ----

def test_lookup_proposes_the_continuation_of_the_latest_earlier_match():
    g = _gen([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8])
    g.tokens = [1, 2]  # ... 7 8 1 2: "1 2" last seen before "3 7 8"
    assert LookupProposer(min_ngram=2).propose(g, 3) == [3, 7, 8]
    g.tokens = [1, 2, 3]  # the trigram "1 2 3" wins over the bigram "2 3"
    assert LookupProposer(min_ngram=2).propose(g, 2) == [7, 8]
    g.tokens = [30, 29]  # nothing like it before: no proposal
    assert LookupProposer(min_ngram=2).propose(g, 4) == []
    assert LookupProposer(min_ngram=2).propose(g, 0) == []


def test_lookup_indexes_incrementally_and_never_matches_itself():
    p = LookupProposer(min_ngram=2)
    g = _gen([5, 6, 7])
    g.tokens = [5, 6]
    assert p.propose(g, 4) == [7, 5, 6]  # the earlier "5 6", not the suffix itself
    g.tokens += [7, 5, 6]
    assert p.propose(g, 2) == [7, 5]  # the latest earlier "5 6" (position 3)


# ---- acceptance ----

def test_greedy_acceptance_takes_the_agreeing_prefix_and_one_more():
    s = Speculator("lookup", LookupProposer())
    g = _gen([1, 2, 3])
    g.tokens = [4]
    # rows after the input token and each proposal: agrees on 5 and 6, then says 9
    events = s.accept(g, _rows(5, 6, 9, 0), [5, 6, 7])
    assert [e.token_id for e in events] == [5, 6, 9] and g.tokens == [4, 5, 6, 9]
    assert (s.stats.proposed, s.stats.accepted, s.stats.passes) == (3, 2, 1)
    events = s.accept(g, _rows(10, 11, 12), [10, 11])  # all taken: plus the bonus row
    assert [e.token_id for e in events] == [10, 11, 12]
    assert s.stats.as_dict()["tokens_per_pass"] == 3.0
    with pytest.raises(ValueError):
        s.accept(g, _rows(1, 2), [1, 2])


def test_a_pass_the_head_picked_is_taken_as_its_logits_would_be():
    """Where the head picked each row's argmax itself (`Generation.argmax_only`: greedy, no
    grammar, no log-probabilities), a pass of token ids is taken as the pass of logits."""
    for rows in (_rows(5, 6, 9, 0), _rows(5, 6, 9, 0).argmax(dim=-1)):
        g = _gen([1, 2, 3])
        g.tokens = [4]
        events = Speculator("lookup", LookupProposer()).accept(g, rows, [5, 6, 7])
        assert [e.token_id for e in events] == [5, 6, 9] and g.tokens == [4, 5, 6, 9]
        assert g.step(rows[-1]).token_id == 0
    assert _gen([1]).argmax_only
    assert not _gen([1], temperature=0.7).argmax_only  # the sampler draws from the row
    assert not _gen([1], logprobs=2).argmax_only  # the row's log-probabilities are reported


def test_acceptance_stops_at_eos_and_at_max_tokens():
    s = Speculator("lookup", LookupProposer())
    g = _gen([1, 2], eos=(31,))
    g.tokens = [3]
    events = s.accept(g, _rows(31, 5, 6), [31, 5])
    assert [e.token_id for e in events] == [31] and g.finish_reason == "eos"
    g = _gen([1, 2], max_tokens=3)
    g.tokens = [3]
    events = s.accept(g, _rows(4, 5, 6), [4, 5])
    assert [e.token_id for e in events] == [4, 5] and g.finish_reason == "length"
    assert s.propose(g) == []  # a done answer proposes nothing


def test_proposals_never_outrun_the_answer():
    s = Speculator("lookup", LookupProposer(), max_k=8)
    g = _gen([1, 2, 3, 4, 5, 6, 7, 8, 1, 2], max_tokens=4)  # "1 2 3" seen before
    g.tokens = [3]
    assert s.propose(g) == [4, 5]  # 3 left: 2 proposals and the pass's own token


def test_spec_length_grows_on_success_and_pauses_after_waste():
    k = SpecLength(max_k=8)
    assert k.next() == 4
    k.update(4, 4)
    assert k.next() == 6
    k.update(6, 2)
    assert k.next() == 2
    k.update(2, 0)  # a wasted pass: proposals pause
    assert [k.next() for _ in range(RETRY_AFTER_TOKENS - 1)] == [0] * (RETRY_AFTER_TOKENS - 1)
    assert k.next() == 1
    k.update(1, 0)  # wasted again: a pause twice as long
    assert [k.next() for _ in range(2 * RETRY_AFTER_TOKENS - 1)].count(0) == \
        2 * RETRY_AFTER_TOKENS - 1
    assert k.next() == 1
    k.update(1, 1)
    assert k.next() == 3


def test_the_rejection_rule_keeps_the_sampling_distribution():
    """Sampling: a proposal is kept with probability p(proposal), else the token is drawn from
    p without it — so every token is distributed as plain sampling draws it."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0] + [-9.0] * (VOCAB - 5))
    params = SamplingParams(temperature=0.8, top_k=4, seed=3)
    sampler = Sampler(params)
    p = sampler.probs(logits)
    n = 20000
    for proposed in (0, 3, 20):  # likely, unlikely, and outside top-k (p = 0)
        counts = torch.zeros(VOCAB)
        for _ in range(n):
            counts[sampler.verify(logits, proposed)] += 1
        assert torch.allclose(counts / n, p, atol=0.015), (proposed, counts[:6] / n, p[:6])
    assert Sampler(SamplingParams()).verify(logits, 3) == 0  # greedy: the argmax


# ---- checks at the door ----

def test_speculate_is_checked_at_the_door():
    assert check_speculate("lookup") == "lookup"
    with pytest.raises(BadRequest, match="speculate must be one of lookup, draft, off"):
        check_speculate("fast")
    d = DistributedChatParams.from_dict({"speculate": "off"}, DistributedChatParams())
    assert d.speculate == "off" and DistributedChatParams().speculate == "lookup"
    for bad in ("maybe", 1, True):
        with pytest.raises(BadRequest):
            DistributedChatParams.from_dict({"speculate": bad}, DistributedChatParams())


def test_a_draft_of_another_vocabulary_is_refused():
    check_draft_tokenizer(Tok(), Tok(), "big", "small")
    other = Tok({"<0>": 0, "<1>": 2})
    with pytest.raises(BadRequest, match="draft model small cannot propose for big"):
        check_draft_tokenizer(Tok(), other, "big", "small")


# ---- the local engine on the real model ----

@pytest.fixture(scope="module")
def engine(smollm2):
    from hearthnet.distributed_inference.engine.local import LocalEngine

    return LocalEngine(smollm2)


@pytest.mark.parametrize("prompt", [
    "Repeat this sentence exactly: the cat sat on the mat and the dog lay by the door.",
    "Write a short poem about a lighthouse keeper."])
def test_local_speculative_answer_is_the_plain_answer(engine, local_answer, prompt):
    from hearthnet.distributed_inference.engine.speculation import DraftProposer

    msgs = [{"role": "user", "content": prompt}]
    want = local_answer(prompt, 40)
    params = SamplingParams(max_tokens=40)
    spec = Speculator("lookup", LookupProposer())
    got = [e.token_id for e in engine.run(engine.new_generation(msgs, params), speculator=spec)]
    assert got == want
    if prompt.startswith("Repeat"):
        assert spec.stats.accepted > 5, spec.stats
    draft = Speculator("draft", DraftProposer(engine, 200))
    try:
        gen = engine.new_generation(msgs, params)
        assert [e.token_id for e in engine.run(gen, speculator=draft)] == want
    finally:
        draft.close()
    # the model as its own draft: every proposal is taken, up to the answer's end
    assert draft.stats.as_dict()["tokens_per_pass"] >= 3.0, draft.stats


def test_the_head_picks_the_argmax_where_the_logits_are(engine):
    """`logits_rows(..., picks)`: a picked entry's rows come back as their argmax token
    ids, beside the others' logits from the same product."""
    head = engine.head
    g = torch.Generator().manual_seed(0)
    hidden = [torch.randn(1, 3, head.hidden_size, generator=g),
              torch.randn(1, 1, head.hidden_size, generator=g)]
    logits = head.logits_rows(hidden)
    ids, rest = head.logits_rows(hidden, [True, False])
    assert ids.dtype == torch.int64 and ids.shape == (3,)
    assert torch.equal(ids, logits[0].argmax(dim=-1)) and torch.equal(rest, logits[1])
    assert all(torch.equal(a, b) for a, b in zip(head.logits_rows(hidden, [False, False]),
                                                 logits, strict=True))
