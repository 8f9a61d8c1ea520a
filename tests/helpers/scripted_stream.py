"""A scripted `ShardStream` (hearthnet.distributed_inference.seams) for shard-server tests.

`ScriptedStream` feeds a shard server the `StepIn`s it was given, then a clean close, and
records what the server answered: the ACCEPT params, each output, each error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hearthnet.errors import HearthNetError


@dataclass(frozen=True)
class Step:
    """One step's input (a `StepIn`)."""

    step: int
    start_pos: int
    tensor: torch.Tensor = field(repr=False)


class ScriptedStream:
    """The shard side of one session: scripted inputs, recorded replies."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = list(steps)
        self.accepted: dict[str, Any] | None = None
        self.limit: int | None = None
        self.sent: list[tuple[int, torch.Tensor]] = []  # (step, output)
        self.errors: list[HearthNetError] = []  # non-fatal and fatal, in order
        self.closed = False
        self.progressed: list[float] = []  # `progress` calls: when each waiting step began

    def limit_tensor_bytes(self, limit: int) -> None:
        self.limit = limit

    async def accept(self, params: dict[str, Any] | None = None) -> None:
        self.accepted = params or {}

    async def refuse(self, err: HearthNetError, *, step: int | None = None) -> None:
        self.errors.append(err)
        self.closed = True

    async def recv_step(self, deadline_s: float | None = None) -> Step | None:
        return self.steps.pop(0) if self.steps else None

    async def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                        compute_us: int = 0, deadline_s: float | None = None) -> None:
        self.sent.append((step, tensor.clone()))

    def progress(self, waiting_since: float) -> None:
        self.progressed.append(waiting_since)

    async def send_error(self, err: HearthNetError, *, step: int | None = None) -> None:
        self.errors.append(err)

    async def close(self, reason: str = "") -> None:
        self.closed = True
