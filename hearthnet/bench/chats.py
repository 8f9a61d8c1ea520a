"""One greedy chat through a node of a benchmark's mesh, and its token ids (shared by the
benchmarks that measure meshes: pipeline, speculative, anchor, reach)."""

from __future__ import annotations

import time
from typing import Any

from hearthnet.errors import HearthNetError


async def chat_frames(uri: str, prompt: str, model: str, tokens: int,
                      **params: Any) -> tuple[list[dict[str, Any]], float]:
    """One greedy chat through the node at `uri`: (its frames, wall seconds)."""
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    args = chat_args(prompt, model, SamplingParams(max_tokens=tokens), **params)
    t0 = time.perf_counter()
    frames = [f async for f in bus_call(uri, CHAT_CAPABILITY, args)]
    wall = time.perf_counter() - t0
    if not frames or frames[-1].get("type") != "done":
        raise HearthNetError(f"the chat did not finish: {frames[-1:]}")
    if frames[-1].get("fallback"):  # the local engine's figure is not the pipeline's
        why = next((f.get("reason") for f in frames if f.get("type") == "pipeline_aborted"),
                   "?")
        raise HearthNetError(f"the chat fell back to the orchestrator's local engine "
                             f"({why}): no distributed figure to report")
    return frames, wall


def token_ids(frames: list[dict[str, Any]]) -> list[int]:
    return [int(f["token_id"]) for f in frames if f.get("type") == "token_delta"]
