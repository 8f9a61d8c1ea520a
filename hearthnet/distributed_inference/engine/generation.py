"""Token sampling and streaming text: shared by the local engine and the orchestrator.

`Generation` is the state of one answer: the tokens so far, the sampler with its seeded
generator, incremental detokenisation and stop handling. The local engine and the
distributed orchestrator both drive one, so a call that falls back to local inference
continues the *same* `Generation` (M26 §5.4).

Log-probabilities (``SamplingParams.logprobs``) are the model's own: `torch.log_softmax` of
the raw logits a token was sampled (or verified) from, before temperature, top-k and top-p
— what OpenAI reports. They are computed only for a call that asks (the default path does
no extra work), for every token taken, a speculative pass's included: each accepted token
from the row that verified it, so they are exact whatever the proposer.

A call with a ``grammar`` (`SamplingParams.grammar`: OpenAI ``response_format`` or a forced
tool call, M26 §5.4) has its sampler mask every row it picks from — one step's, or each row
of a speculative pass — to the tokens the grammar allows after the tokens taken so far: a
disallowed token's logit is -inf before temperature, top-k, top-p and the argmax, so the
mask only removes (where the unconstrained pick is allowed, the constrained one is the
same). The grammar's matcher advances only when `Generation.accept` takes a token, so a
rejected speculative proposal never touches it and verification stays exact with no
rollback: each proposal is verified against the mask of the tokens accepted before it. The
answer ends (``stop``) when the grammar is complete; log-probabilities stay the raw ones.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from hearthnet.distributed_inference.engine.grammar import GrammarState, matcher
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import BadRequest


class Sampler:
    """Picks the next token from logits; seeded, so a call is reproducible.

    With ``params.logprobs`` set it keeps the row it last picked from (`__call__` or
    `verify`) for `Generation.accept` to take: every path that takes a token — one step, or
    a speculative pass verifying proposals row by row — picks it through here first.
    """

    def __init__(self, params: SamplingParams, grammar: GrammarState | None = None) -> None:
        """`grammar`: the answer's place in its grammar (None: no constraint), advanced by
        `Generation.accept`."""
        self.params = params
        self.grammar = grammar
        self._bits = torch.arange(32, dtype=torch.int32)
        self._mask_words: torch.Tensor | None = None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.keep_rows = params.logprobs is not None
        self.row: torch.Tensor | None = None  # (vocab,) the logits last picked from

    def __call__(self, logits: torch.Tensor) -> int:
        """`logits`: (vocab,) fp32; or a 0-d int64 tensor, the token the head already
        picked where the logits are (`Generation.argmax_only`)."""
        if logits.dim() == 0:
            return int(logits)
        if self.keep_rows:
            self.row = logits  # raw: log-probabilities are the model's own
        if self.grammar is not None:
            logits = self.masked(logits)
        if self.params.greedy:
            return int(torch.argmax(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (vocab,) with every token the grammar does not allow next at -inf.

        The row may be longer than the tokenizer (a model's padded vocabulary): those ids
        are no token at all and are masked too. The bits are unpacked here in eager torch
        rather than by `llguidance.torch.apply_token_bitmask_inplace`, whose kernel is a
        `torch.compile(dynamic=True)` function: a node would compile it (seconds of
        inductor on a CPU) in the middle of the first constrained answer.
        """
        g = self.grammar
        if g is None:
            return logits
        vocab = int(logits.shape[-1])
        if self._mask_words is None:
            self._mask_words = torch.zeros(g.words, dtype=torch.int32)
        words = self._mask_words
        g.fill(words.data_ptr(), words.numel() * 4)
        allowed = ((words.unsqueeze(-1) >> self._bits) & 1).flatten().bool()  # (32·words,)
        keep = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, g.vocab_size)
        keep[:n] = allowed[:n]
        if not bool(keep.any()):  # the grammar failed: nothing it allows is a token
            raise RuntimeError(f"the grammar allows no token: {g.error or 'stopped'}")
        return logits.masked_fill(~keep, float("-inf"))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution this sampler draws from: `logits` (vocab,) after temperature,
        top-k and top-p."""
        p = self.params
        x = logits / p.temperature
        if p.top_k > 0 and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the first over p
            x = x.clone()
            x[order[drop]] = float("-inf")
        return torch.softmax(x, dim=-1)

    def verify(self, logits: torch.Tensor, proposed: int) -> int:
        """The token to take at a position where `proposed` was proposed (DESIGN.md decision
        16): greedy takes the argmax (the proposal when they agree); sampling keeps the
        proposal with probability p(proposed) and otherwise draws from p without it — the
        rejection rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for
        a proposer that names one token, so every token is distributed exactly as `__call__`
        would draw it."""
        if logits.dim() == 0:  # picked by the head (`Generation.argmax_only`): the argmax
            return int(logits)
        if self.keep_rows:
            self.row = logits
        if self.grammar is not None:  # the mask of the tokens taken before this position
            logits = self.masked(logits)
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.probs(logits)
        u = float(torch.rand((), generator=self.generator))
        if u < float(probs[proposed]):
            return proposed
        rest = probs.clone()
        rest[proposed] = 0.0
        if float(rest.sum()) <= 0.0:  # p(proposed) rounds to 1: nothing else can be drawn
            return proposed
        return int(torch.multinomial(rest, 1, generator=self.generator))


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; multi-byte characters come out whole.

    Decodes a small window of recent tokens and emits only text that no longer ends in an
    incomplete UTF-8 sequence (U+FFFD), as text-generation-inference does.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=False)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return str(now[len(before):])
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character stays as U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=False)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=False)
        self.prefix = self.read = len(self.ids)
        return str(now[len(before):])


# OpenAI's floor for a log-probability too small to show (and JSON has no -Infinity)
MIN_LOGPROB = -9999.0
_SPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, reversed (transformers' own
    GPT-2 table, which every byte-level tokenizer shares)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    return {c: b for b, c in table.items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for: exact even for a token that is part of a character
    (OpenAI's ``bytes``; decoding one such token alone gives U+FFFD)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return bytes(str(tokenizer.decode([token_id])), "utf-8")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kind = type(getattr(backend, "decoder", None)).__name__
    if kind == "ByteLevel":
        table = _byte_level_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode("utf-8")  # an added token, kept as written
    m = _SPIECE_BYTE.fullmatch(piece)
    if m is not None:
        return bytes([int(m[1], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word boundary


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A taken token's log-probability and its `k` likeliest alternatives, likeliest first:
    ``(token_id, logprob, bytes)`` each (`SamplingParams.logprobs`)."""

    logprob: float
    token_bytes: bytes
    top: tuple[tuple[int, float, bytes], ...]


@dataclass
class TokenEvent:
    """One generated token and the text it released (possibly empty); its log-probabilities
    when the call asked for them."""

    token_id: int
    text: str
    index: int
    logprobs: TokenLogprobs | None = None


@dataclass
class Generation:
    """The state of one answer; see the module docstring."""

    tokenizer: Any
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: set[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        grammar = None if self.params.grammar is None else \
            matcher(self.tokenizer, self.eos_ids, self.params.grammar)
        self.sampler = Sampler(self.params, grammar)
        self.detok = IncrementalDetokenizer(self.tokenizer, self.prompt_ids)
        self._held = ""  # text held back because it may be the start of a stop string
        self._bytes: dict[int, bytes] = {}

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def argmax_only(self) -> bool:
        """Whether picking a token needs nothing but its logits' argmax (greedy, no grammar,
        no log-probabilities): the head can pick it where the logits are
        (`LayeredHead.logits_rows`'s `picks`) and hand over the token id alone."""
        return self.params.greedy and self.sampler.grammar is None \
            and not self.sampler.keep_rows

    @property
    def all_ids(self) -> list[int]:
        """Prompt and generated tokens: the positions a replacement must rebuild."""
        return self.prompt_ids + self.tokens

    def step(self, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token from `logits` and account for it."""
        tid = self.sampler(logits)
        return self.accept(tid)

    def accept(self, tid: int) -> TokenEvent:
        """Take `tid`, picked by `self.sampler` (`step`, or a speculative pass's `verify`)."""
        lp = self._logprobs(tid) if self.sampler.keep_rows else None
        self.tokens.append(tid)
        grammar = self.sampler.grammar
        if grammar is not None and tid not in self.eos_ids:
            grammar.consume(tid)
        if tid in self.eos_ids:
            self.finish_reason = "eos"
            return TokenEvent(tid, self._release(final=True), len(self.tokens) - 1, lp)
        delta = self._held + self.detok.push(tid)
        self._held = ""
        out = self._apply_stop(delta)
        if not self.done and grammar is not None and grammar.stopped:
            self.finish_reason = "stop"  # the grammar is complete: nothing may follow
            out += self._release(final=True)
        if not self.done and len(self.tokens) >= self.params.max_tokens:
            self.finish_reason = "length"
            out += self._release(final=True)
        return TokenEvent(tid, out, len(self.tokens) - 1, lp)

    def _logprobs(self, tid: int) -> TokenLogprobs:
        """`tid`'s log-probability and the top alternatives, from the raw logits it was
        picked from (the module docstring says why raw)."""
        row, self.sampler.row = self.sampler.row, None
        if row is None:  # a token taken without a pick: its row is unknown
            raise RuntimeError("a token was accepted without the logits it was picked from")
        lp = torch.log_softmax(row.float(), dim=-1)  # (vocab,)
        k = self.params.logprobs or 0
        top = torch.topk(lp, k) if k else None
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True) if top is not None \
            else ()
        out = TokenLogprobs(max(float(lp[tid]), MIN_LOGPROB), self._token_bytes(tid),
                            tuple((i, max(v, MIN_LOGPROB), self._token_bytes(i))
                                  for i, v in pairs))
        return out

    def _token_bytes(self, tid: int) -> bytes:
        if tid not in self._bytes:
            self._bytes[tid] = token_bytes(self.tokenizer, tid)
        return self._bytes[tid]

    def _apply_stop(self, delta: str) -> str:
        if not self.params.stop:
            self.text += delta
            return delta
        window = self.text + delta
        for s in self.params.stop:
            i = window.find(s, max(0, len(self.text) - len(s)))
            if i >= 0:
                self.finish_reason = "stop"
                out = window[len(self.text):i]
                self.text = window[:i]
                return out
        hold = max((k for s in self.params.stop for k in range(1, len(s))
                    if window.endswith(s[:k])), default=0)
        out = delta[:len(delta) - hold] if hold else delta
        self._held = delta[len(delta) - hold:] if hold else ""
        self.text += out
        return out

    def _release(self, final: bool) -> str:
        rest = self._held + (self.detok.flush() if final else "")
        self._held = ""
        self.text += rest
        return rest


@dataclass(frozen=True)
class PromptLimits:
    """How much one call may ask for, so one huge prompt cannot wedge a node: checked before any
    work, the same for the mesh and the local path (config `[research.distributed_inference]`
    ``max_prompt_bytes``, ``max_prompt_tokens``, ``max_completion_tokens``)."""

    max_prompt_bytes: int = 32 * 1024
    max_prompt_tokens: int = 4096
    max_completion_tokens: int = 2048

    def check_request(self, messages: list[Any] | str, params: SamplingParams) -> None:
        """Bytes and `max_tokens`, before tokenising anything; raises `BadRequest`.

        `messages`: a chat's messages, or a text completion's raw prompt (one limit for
        both: the bytes a caller makes the node tokenise)."""
        if isinstance(messages, str):
            size = len(messages.encode("utf-8", "replace"))
        else:
            size = sum(len(m["content"].encode("utf-8", "replace")) for m in messages
                       if isinstance(m, dict) and isinstance(m.get("content"), str))
            # the tools and earlier calls the template renders count as prompt too
            extra = [getattr(messages, "tools", None) or [],
                     [m.get("tool_calls") for m in messages if isinstance(m, dict)]]
            size += len(json.dumps(extra, default=str).encode()) if any(extra[1]) \
                or extra[0] else 0
        if size > self.max_prompt_bytes:
            raise BadRequest(f"the prompt is {size} bytes; this node's limit is "
                             f"max_prompt_bytes = {self.max_prompt_bytes}",
                             limit="max_prompt_bytes", value=size)
        if params.max_tokens > self.max_completion_tokens:
            raise BadRequest(f"max_tokens {params.max_tokens} is over this node's limit "
                             f"max_completion_tokens = {self.max_completion_tokens}",
                             limit="max_completion_tokens", value=params.max_tokens)

    def check_prompt_ids(self, ids: list[int]) -> None:
        """The tokenised prompt's length; raises `BadRequest`."""
        if len(ids) > self.max_prompt_tokens:
            raise BadRequest(f"the prompt is {len(ids)} tokens; this node's limit is "
                             f"max_prompt_tokens = {self.max_prompt_tokens}",
                             limit="max_prompt_tokens", value=len(ids))
