"""Basic sanity checks on shard outputs (M26 §5.8, issue 6 §3).

Every hidden state a shard returns is checked for NaN/Inf and against a norm bound for that
layer boundary. The bounds are calibrated once per model (`calibrate`): the whole model runs
a few fixed prompts locally, and for each boundary (the output of layer i) we record the
largest per-position L2 norm seen; the bound is that maximum × `MARGIN`. Real activations
of other prompts stay well inside (the test suite checks this on prompts not used for
calibration); a shard that returns scaled garbage crosses it.

A malicious shard that returns *plausible* garbage — values of a normal norm — passes these
checks. That limit is documented and shown by a test; detecting it would need shadow
inference (M26 §10).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from hearthnet.errors import ShardCorrupted

MARGIN = 4.0
CALIBRATION_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about autumn rain.",
    "List three prime numbers and explain why they are prime.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish, German and Japanese.",
)
BOUNDS_FILE = "activation_bounds.json"


class SanityChecker:
    """Checks a (1, T, H) hidden state leaving layer `end` (inclusive)."""

    def __init__(self, bounds: Sequence[float] | None) -> None:
        self.bounds = list(bounds) if bounds else None

    def check(self, shard_id: str, end: int, hidden: torch.Tensor) -> None:
        """Raise `ShardCorrupted` when `hidden` has NaN/Inf or exceeds the boundary's bound."""
        h = hidden.float()
        if not bool(torch.isfinite(h).all()):
            raise ShardCorrupted(f"shard {shard_id} returned NaN or Inf activations",
                                 shard_id=shard_id, check="finite")
        if self.bounds is not None and 0 <= end < len(self.bounds):
            norm = float(h.norm(dim=-1).max())
            if norm > self.bounds[end]:
                raise ShardCorrupted(
                    f"shard {shard_id} returned activations of norm {norm:.1f} after layer "
                    f"{end}; the calibrated bound is {self.bounds[end]:.1f}",
                    shard_id=shard_id, check="norm")


@torch.inference_mode()
def calibrate(model_dir: Path, prompts: Sequence[str] = CALIBRATION_PROMPTS) -> list[float]:
    """Per-boundary norm bounds of a stored model; cached in `activation_bounds.json`."""
    cached = model_dir / BOUNDS_FILE
    if cached.is_file():
        return [float(x) for x in json.loads(cached.read_text())["bounds"]]
    from hearthnet.distributed_inference.backends.small_model_layered import (
        LayeredHead,
        LayeredStack,
    )
    from hearthnet.models.store import ModelEntry

    entry = ModelEntry.load(model_dir)
    head = LayeredHead(entry)
    stack = LayeredStack(entry, 0, entry.num_layers - 1)
    peaks = [0.0] * entry.num_layers
    for p in prompts:
        ids = head.chat_prompt_ids([{"role": "user", "content": p}])
        h = head.embed(ids)
        for i in range(entry.num_layers):
            s = stack.open_session(i, i, len(ids))
            h = s.forward(h, 0)
            peaks[i] = max(peaks[i], float(h.norm(dim=-1).max()))
            s.close()
    bounds = [x * MARGIN for x in peaks]
    tmp = cached.with_suffix(".tmp")
    tmp.write_text(json.dumps({"margin": MARGIN, "prompts": list(prompts), "bounds": bounds}))
    tmp.replace(cached)
    return bounds
