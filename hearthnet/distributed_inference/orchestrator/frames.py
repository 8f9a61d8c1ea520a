"""The frames a chat streams (M26 §4.3): built here, in one place, for every path.

Frames are plain JSON-safe dicts: `token_delta`, `shard_status`, `shard_failover`,
`pipeline_aborted`, `done`, `error`. The `done` frame of the pipeline and of the local
fallback share one builder (`done_frame`), so their common keys cannot drift apart.
"""

from __future__ import annotations

import time
from typing import Any

from hearthnet.distributed_inference.engine.generation import Generation, TokenEvent

Frame = dict[str, Any]


def token_frame(ev: TokenEvent) -> Frame:
    """One streamed token."""
    return {"type": "token_delta", "text": ev.text, "token_id": ev.token_id,
            "index": ev.index}


def done_frame(gen: Generation, *, t0: float, first_ms: float, tokens_per_s: float,
               pipeline: list[str], timings: dict[str, Any] | None = None,
               **extra: Any) -> Frame:
    """The final frame of a successful call.

    Args:
        gen: the finished generation (finish reason, usage).
        t0: `time.perf_counter()` at the call's start (for ``total_ms``).
        first_ms: time to the first token; tokens_per_s: decode speed.
        pipeline: the shard ids that served the end of the call (``["local"]`` after a
            fallback).
        timings: more entries of ``timings`` (construction, failover, per shard).
        extra: more top-level keys (``failovers``, ``fallback``).
    """
    return {"type": "done", "finish_reason": gen.finish_reason,
            "usage": {"prompt_tokens": len(gen.prompt_ids),
                      "completion_tokens": len(gen.tokens)},
            "timings": {"first_token_ms": round(first_ms, 1),
                        "tokens_per_second": round(tokens_per_s, 2),
                        "total_ms": round((time.perf_counter() - t0) * 1000, 1),
                        **(timings or {})},
            "pipeline": pipeline, **extra}


def error_frame(code: str, message: str) -> Frame:
    """The final frame of a failed call."""
    return {"type": "error", "code": code, "message": message}
