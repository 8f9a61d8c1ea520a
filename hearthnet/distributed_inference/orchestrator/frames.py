"""The two frames built from a generation's state: `token_frame` and `done_frame`.

The frame types themselves are `hearthnet.frames` (torch-free, so the client and the CLI
read them without the model runtime); the others are built there by their constructors.
The `done` frame of the pipeline, of the local fallback and of ``hearthnet chat --local``
share `done_frame`, so their common keys cannot drift apart.
"""

from __future__ import annotations

import time
from typing import Any

from hearthnet.distributed_inference.engine.generation import Generation, TokenEvent
from hearthnet.distributed_inference.engine.speculation import SpecStats
from hearthnet.frames import Done, TokenDelta


def token_frame(ev: TokenEvent) -> TokenDelta:
    """One streamed token, with its log-probabilities when the call asked for them."""
    lp = ev.logprobs
    if lp is None:
        return TokenDelta(ev.text, ev.token_id, ev.index)
    return TokenDelta(ev.text, ev.token_id, ev.index, logprob=lp.logprob,
                      token_bytes=lp.token_bytes, top_logprobs=lp.top)


def done_frame(gen: Generation, *, t0: float, first_ms: float, tokens_per_s: float,
               pipeline: list[str], timings: dict[str, Any] | None = None,
               formats: dict[str, Any] | None = None, failovers: int | None = None,
               fallback: bool = False, speculative: SpecStats | None = None,
               cached_prompt_tokens: int = 0) -> Done:
    """The final frame of a successful call.

    Args:
        gen: the finished generation (finish reason, usage).
        t0: `time.perf_counter()` at the call's start (for ``total_ms``).
        first_ms: time to the first token; tokens_per_s: decode speed.
        pipeline: the shard ids that served the end of the call (``["local"]`` after a
            fallback).
        timings: more entries of ``timings`` (construction, failover, per shard).
        formats: the head's and the stages' weight formats; failovers: the pipeline's
            count; fallback: the local engine finished the answer.
        speculative: the call's speculation statistics (DESIGN.md decision 16).
        cached_prompt_tokens: prompt positions the stages copied from another call instead
            of computing them (in ``usage`` when there were any).
    """
    usage = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.tokens)}
    if cached_prompt_tokens:
        usage["cached_prompt_tokens"] = cached_prompt_tokens
    return Done(gen.finish_reason, usage,
                {"first_token_ms": round(first_ms, 1),
                 "tokens_per_second": round(tokens_per_s, 2),
                 "total_ms": round((time.perf_counter() - t0) * 1000, 1), **(timings or {})},
                tuple(pipeline), formats=formats, failovers=failovers, fallback=fallback,
                speculative=speculative.as_dict() if speculative is not None else None)
