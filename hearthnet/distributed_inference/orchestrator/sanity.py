"""Basic sanity checks on shard outputs (M26 §5.8, §8.3).

Every hidden state a shard returns is checked for NaN/Inf and against a norm bound for that
layer boundary. The bounds are calibrated once per model (`calibrate`): the whole model runs
a few fixed prompts locally, and for each boundary (the output of layer i) we record the
largest per-position L2 norm seen; the bound is that maximum × `MARGIN`. Real activations
of other prompts stay well inside (the test suite checks this on prompts not used for
calibration); a shard that returns scaled garbage crosses it.

A malicious shard that returns *plausible* garbage — values of a normal norm — passes these
checks. That limit is documented and shown by a test; detecting it would need shadow
inference (M26 §10).

The same calibration run records each boundary's largest |value| (`Calibration.absmax`):
the wire dtype `auto` uses it to choose fp16 where max × `WIRE_MARGIN` fits fp16's range
and a wider dtype where it does not. Some models carry huge, nearly
prompt-independent activations at a few positions (SmolLM2: ~24,900 from layer 11 on;
Gemma-3: > 100,000), so the margin is smaller than the norm bound's: it separates
"always far below 65,504" from "near or over it", and a value that overflows anyway is
caught by the sender (`wire_overflow`) and the step redone wider.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hearthnet.errors import ShardCorrupted

MARGIN = 4.0
WIRE_MARGIN = 2.0
FP16_MAX = 65504.0
_VERSION = 2  # 2: with absmax per boundary
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

    def check(self, shard_id: str, end: int, hidden: torch.Tensor, *,
              shape: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> None:
        """Raise `ShardCorrupted` when `hidden` is not of `shape`/`dtype` (when given; the
        stage's input shape and the wire dtype: a wrong width is corruption too), has NaN/Inf
        or exceeds the boundary's bound."""
        if shape is not None and tuple(hidden.shape) != tuple(shape):
            raise ShardCorrupted(f"shard {shard_id} returned a hidden state of shape "
                                 f"{tuple(hidden.shape)}; expected {tuple(shape)}",
                                 shard_id=shard_id, check="shape")
        if dtype is not None and hidden.dtype != dtype:
            raise ShardCorrupted(f"shard {shard_id} returned {hidden.dtype} activations; "
                                 f"expected {dtype}", shard_id=shard_id, check="dtype")
        # one reduction answers both checks (DESIGN.md hot path rules): a NaN or Inf makes the
        # largest per-position norm non-finite; accumulated in fp32 without a copy
        norm = float(torch.linalg.vector_norm(hidden, dim=-1, dtype=torch.float32).amax())
        if not math.isfinite(norm):
            raise ShardCorrupted(f"shard {shard_id} returned NaN or Inf activations (or a "
                                 f"position whose norm overflows fp32)",
                                 shard_id=shard_id, check="finite")
        if self.bounds is not None and 0 <= end < len(self.bounds) \
                and norm > self.bounds[end]:
            raise ShardCorrupted(
                f"shard {shard_id} returned activations of norm {norm:.1f} after layer "
                f"{end}; the calibrated bound is {self.bounds[end]:.1f}",
                shard_id=shard_id, check="norm")


@dataclass(frozen=True)
class Calibration:
    """What one calibration run measured about a model's layer boundaries.

    `bounds[i]`: the norm bound of layer i's output; `absmax[i]`: its largest |value|;
    `embed_absmax`: the largest |value| of the embeddings (the first stage's input).
    """

    bounds: list[float]
    absmax: list[float]
    embed_absmax: float

    def absmax_at(self, boundary: int) -> float:
        """Largest |value| crossing `boundary` (-1: the embeddings, i: layer i's output)."""
        return self.embed_absmax if boundary < 0 else self.absmax[boundary]

    def fp16_fits(self, boundary: int) -> bool:
        """True when `boundary`'s calibrated max × `WIRE_MARGIN` fits fp16's range."""
        return self.absmax_at(boundary) * WIRE_MARGIN <= FP16_MAX


@torch.inference_mode()
def calibrate(model_dir: Path, device: str | torch.device = "cpu",
              prompts: Sequence[str] = CALIBRATION_PROMPTS) -> Calibration:
    """Per-boundary norm bounds and magnitudes; cached in `activation_bounds.json`.

    Computed in fp32 on `device` (the orchestrator's head device: a GPU makes a 3B model's
    calibration take a second, not minutes), one decoder layer in memory at a time: its
    peak is the embeddings plus one fp32 layer, not the whole model (nor its lm_head)."""
    cached = model_dir / BOUNDS_FILE
    if cached.is_file():
        data = json.loads(cached.read_text())
        if data.get("version") == _VERSION:
            return Calibration([float(x) for x in data["bounds"]],
                               [float(x) for x in data["absmax"]], float(data["embed_absmax"]))
    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.distributed_inference.engine.layers import LayeredStack
    from hearthnet.models.store import ModelEntry

    entry = ModelEntry.load(model_dir)
    head = LayeredHead(entry, device=device, lm_head=False)
    hidden = [head.embed(head.chat_prompt_ids([{"role": "user", "content": p}]))
              for p in prompts]
    del head
    embed_absmax = max(float(h.abs().max()) for h in hidden)
    peaks, absmax = [0.0] * entry.num_layers, [0.0] * entry.num_layers
    # One layer in memory at a time (DESIGN.md decision 10): the orchestrator of a 7B model must not
    # need the whole model in fp32 (30 GB) to calibrate; all prompts pass layer i together.
    for i in range(entry.num_layers):
        layer = LayeredStack(entry, i, i, device=device)
        for j, h in enumerate(hidden):
            s = layer.open_session(i, i, h.shape[1])
            hidden[j] = h = s.forward(h, 0)
            s.close()
            peaks[i] = max(peaks[i], float(h.float().norm(dim=-1).max()))
            absmax[i] = max(absmax[i], float(h.abs().max()))
        del layer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hand the model's memory back for the shards on this GPU
    cal = Calibration([x * MARGIN for x in peaks], absmax, embed_absmax)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # nodes sharing a store may race here
    tmp.write_text(json.dumps({"version": _VERSION, "margin": MARGIN, "prompts": list(prompts),
                               "bounds": cal.bounds, "absmax": cal.absmax,
                               "embed_absmax": cal.embed_absmax}))
    tmp.replace(cached)
    return cal
