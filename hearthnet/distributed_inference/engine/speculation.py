"""Speculative steps (DESIGN.md decision 16): propose tokens, verify them in one pass.

One answer pays, per token, one trip through every shard (or one pass over the local
layers). A step that carries the last token plus k proposed ones costs about what one token
costs (the weights are read once), and returns k + 1 rows of hidden states: row i is the
model's prediction after proposal i. `Speculator.accept` takes the longest prefix of the
proposals that the model agrees with and one token more (the model's own at the first
disagreement, or after the last proposal), so a pass yields 1..k+1 tokens and the answer is
the model's: greedy keeps the argmax at every position; sampling uses the rejection rule
(`Sampler.verify`), so tokens are distributed exactly as without speculation.

Whoever runs the pass cuts its KV cache back past the first rejected proposal: the next step
starts at ``len(gen.all_ids) - 1``, and a layer session given a step below its length drops
the positions from there (`LayerSession.forward`; the shard's rollback, docs/protocol.md).

Proposers:

- `LookupProposer` — prompt lookup (Saxena 2023; transformers' ``prompt_lookup_num_tokens``,
  vLLM's n-gram proposer): the continuation of the latest earlier occurrence of the answer's
  last 3 tokens in the prompt and the answer so far. No model; strong on summaries, edits,
  code and chat history, silent where nothing repeats.
- `DraftProposer` — a small model of the same tokenizer, held by the orchestrator, run greedily
  k steps ahead on its own KV cache.

`SpecLength` adapts k to the recent acceptance (as transformers' assisted generation does,
+2 after a pass that took every proposal); after a pass that took none, proposals pause for
a few tokens, longer each time in a row — a failed pass costs more than a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hearthnet.distributed_inference.engine.generation import Generation, TokenEvent
from hearthnet.errors import BadRequest

DEFAULT_MAX_PROPOSED = 8  # [research.distributed_inference] speculate_max_tokens
RETRY_AFTER_TOKENS = 8  # tokens without proposals after k fell to 0, then one more try


class Proposer(Protocol):
    """Proposes the tokens that may follow a generation's tokens."""

    def propose(self, gen: Generation, k: int) -> list[int]:
        """Up to `k` tokens that may follow `gen.all_ids` (fewer, or none, when unsure)."""
        ...

    def close(self) -> None:
        """Free what the proposer holds (a draft's KV cache)."""
        ...


class LookupProposer:
    """Prompt lookup over `gen.all_ids`, indexed incrementally: an n-gram → the position
    after its latest occurrence, for n in `min_ngram..max_ngram` (longest match first).

    Three tokens must match by default: bigrams ("of the") recur in any answer, and each
    failed pass costs more than a plain step (SmolLM2, int4, 64 tokens of four story
    prompts: 27 bigram-or-longer proposals, 8 taken; trigrams: 13, 5 taken; an edit prompt
    keeps 3.9 of its 4.5 tokens per pass)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 3) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[tuple[int, ...], int] = {}
        self._seen = 0  # positions of all_ids whose n-grams ending before them are indexed

    def _catch_up(self, ids: list[int]) -> None:
        # index every n-gram that ends before the last position: the suffix being looked
        # up must find an *earlier* occurrence, never itself
        for end in range(max(self._seen, 1), len(ids)):
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._index[tuple(ids[end - n:end])] = end
        self._seen = max(self._seen, len(ids))

    def propose(self, gen: Generation, k: int) -> list[int]:
        ids = gen.all_ids
        if k <= 0 or len(ids) < self.min_ngram + 1:
            return []
        self._catch_up(ids)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            at = self._index.get(tuple(ids[-n:]))
            if at is not None:
                return ids[at:at + k]
        return []

    def close(self) -> None:
        self._index.clear()


class DraftProposer:
    """A draft model's greedy continuation. `engine` is a `LocalEngine` of the draft (its
    head and full layer stack); the proposer holds one session on it for the call and keeps
    its cache in step with the answer (cut back past rejected proposals)."""

    def __init__(self, engine: Any, max_length: int) -> None:
        self.engine = engine
        stack = engine.stack
        self.session = stack.open_session(0, engine.entry.num_layers - 1, max_length)
        self._ids: list[int] = []  # the tokens in the draft's cache, in order

    def propose(self, gen: Generation, k: int) -> list[int]:
        ids = gen.all_ids
        room = self.session.max_length - len(ids)
        k = min(k, room)
        if k <= 0:
            return []
        same = 0
        for a, b in zip(self._ids, ids, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(ids) - 1)  # at least the last token runs: its row is needed
        head = self.engine.head
        h = self.session.forward(head.embed(ids[same:]), same)
        self._ids = list(ids)
        out: list[int] = []
        for _ in range(k):
            tok = int(torch.argmax(head.logits(h)))
            out.append(tok)
            if len(out) == k:
                break
            h = self.session.forward(head.embed([tok]), len(self._ids))
            self._ids.append(tok)
        return out

    def close(self) -> None:
        self.session.close()


class SpecLength:
    """How many tokens to propose next: adapted to the last pass's acceptance."""

    def __init__(self, max_k: int = DEFAULT_MAX_PROPOSED) -> None:
        self.max_k = max(1, max_k)
        self.k = min(4, self.max_k)
        self._idle = 0  # passes since proposals paused
        self._wasted = 0  # wasted passes in a row

    def next(self) -> int:
        if self.k == 0:
            self._idle += 1
            pause = RETRY_AFTER_TOKENS << min(3, self._wasted - 1)
            if self._idle >= pause:
                self.k, self._idle = 1, 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == 0:  # a wasted pass: pause, longer each time in a row
            self.k, self._idle = 0, 0
            self._wasted += 1
            return
        self._wasted = 0
        self.k = min(self.max_k, self.k + 2) if accepted == proposed else max(1, accepted)


@dataclass
class SpecStats:
    """One answer's speculation: passes run, tokens proposed and accepted."""

    mode: str = "off"
    passes: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens the passes after the prompt's yielded

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "passes": self.passes, "proposed": self.proposed,
                "accepted": self.accepted,
                "tokens_per_pass": round(self.tokens / self.passes, 3) if self.passes else 0.0}


class Speculator:
    """One answer's proposer, proposal length and statistics."""

    def __init__(self, mode: str, proposer: Proposer | None,
                 max_k: int = DEFAULT_MAX_PROPOSED, *, heavy: bool = False) -> None:
        """`heavy`: proposing runs a model (a draft): callers on an event loop run
        `propose` on their compute executor."""
        self.proposer, self.heavy = proposer, heavy
        self.length = SpecLength(max_k)
        self.stats = SpecStats(mode=mode if proposer is not None else "off")

    def propose(self, gen: Generation) -> list[int]:
        """The tokens to verify after `gen.tokens[-1]` in the next pass (maybe none): never
        more than the answer has room for after them (one more token comes with every
        pass)."""
        if self.proposer is None or gen.done:
            return []
        room = gen.params.max_tokens - len(gen.tokens) - 1
        k = min(self.length.next(), room)
        return self.proposer.propose(gen, k)[:k] if k > 0 else []

    def accept(self, gen: Generation, rows: torch.Tensor,
               proposed: list[int]) -> list[TokenEvent]:
        """Take the tokens of one pass: `rows` (len(proposed) + 1, vocab) are the logits
        after the pass's input token and after each proposal (or, where the head picked
        them, `Generation.argmax_only`, their (len(proposed) + 1,) argmax token ids).
        Returns the tokens taken, in order (one at least; fewer than all when the answer
        ends among them)."""
        if rows.shape[0] != len(proposed) + 1:
            raise ValueError(f"{rows.shape[0]} rows for {len(proposed)} proposals")
        out: list[TokenEvent] = []
        accepted = 0
        for i, d in enumerate(proposed):
            tok = gen.sampler.verify(rows[i], d)
            out.append(gen.accept(tok))
            accepted += tok == d
            if tok != d or gen.done:
                break
        else:
            out.append(gen.step(rows[len(proposed)]))
        self.length.update(len(proposed), accepted)
        self.stats.passes += 1
        self.stats.proposed += len(proposed)
        self.stats.accepted += accepted
        self.stats.tokens += len(out)
        return out

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()


def check_draft_tokenizer(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """`BadRequest` unless `draft` (a tokenizer) maps every token as `target` does: a draft's
    proposals are token ids, meaningful only in the target's vocabulary."""
    if target.get_vocab() != draft.get_vocab():
        raise BadRequest(f"draft model {draft_name} cannot propose for {target_name}: their "
                         "tokenizers differ (a draft must share the target's vocabulary)",
                         model=target_name, draft_model=draft_name)
