"""Per-call state of one distributed chat: its stage sessions, its step counter, failures.

Every `PipelineOrchestrator` call owns one `CallState`; nothing here is shared between
calls (concurrent chats and concurrent fallbacks each hold their own). `StageFailed` and
`FellBack` are the two internal signals between the decode loop (`decode.py`) and the
failover replay (`failover.py`); neither ever reaches a caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import Histogram

from hearthnet.distributed_inference.directory.descriptors import Pipeline, PipelineStage
from hearthnet.distributed_inference.engine.generation import Generation
from hearthnet.distributed_inference.engine.speculation import Speculator
from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams
from hearthnet.distributed_inference.orchestrator.wire import WirePlan
from hearthnet.distributed_inference.seams import Channel, Connector, StepOutput
from hearthnet.errors import ConnectionLost, HearthNetError
from hearthnet.frames import StreamFrame
from hearthnet.stats import LatencyWindow

__all__ = ["CallState", "ClosedChannel", "Connector", "FellBack", "StageFailed",
           "StageSession"]


class StageFailed(Exception):
    """Internal: stage `index` failed with `cause` while given `x_in` at this step."""

    def __init__(self, index: int, cause: HearthNetError, x_in: torch.Tensor) -> None:
        super().__init__(str(cause))
        self.index, self.cause, self.x_in = index, cause, x_in


class ClosedChannel:
    """Stands for the channel of a stage that is already closed (a `Channel`)."""

    def __init__(self, wire_dtype: torch.dtype) -> None:
        self._wire_dtype = wire_dtype
        self.accepted: dict[str, Any] = {}

    @property
    def wire_dtype(self) -> torch.dtype:
        return self._wire_dtype

    async def step(self, step: int, start_pos: int, tensor: torch.Tensor,
                   deadline_s: float | None = None) -> StepOutput:
        raise ConnectionLost("this stage's session is already closed")

    async def close(self, reason: str = "") -> None:
        return None


class FellBack(Exception):
    """Internal: give up on the pipeline; continue locally or abort."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class StageSession:
    """One open stage of a call: its channel and the inputs it was given so far."""

    stage: PipelineStage
    channel: Channel
    wire: str  # the wire dtype of this stage's stream (M26 §5.3)
    # this shard's latency and hop-overhead histograms, bound once (DESIGN.md hot path rules)
    latency: Histogram
    overhead: Histogram
    history: list[torch.Tensor] = field(default_factory=list)  # inputs, (1, T_i, H) each
    # the last steps' round trips and overheads (bounded: a long chat is many steps)
    rtt_ms: LatencyWindow = field(default_factory=LatencyWindow)
    overhead_ms: LatencyWindow = field(default_factory=LatencyWindow)
    # what the shard's ACCEPT stated it holds (not the advertisement: what served the call)
    weights_format: str = ""
    kernel: str = ""

    @property
    def shard_id(self) -> str:
        return self.stage.shard.shard_id

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.stage.shard.shard_id, self.stage.start, self.stage.end)

    def truncate(self, pos: int) -> None:
        """Drop recorded inputs at positions ≥ `pos` (a step about to be redone)."""
        kept: list[torch.Tensor] = []
        n = 0
        for h in self.history:
            if n + h.shape[1] > pos:
                if pos > n:
                    kept.append(h[:, :pos - n])
                break
            kept.append(h)
            n += h.shape[1]
        self.history = kept


@dataclass
class CallState:
    """Per-call bookkeeping."""

    pipeline: Pipeline
    stages: list[StageSession]
    gen: Generation
    params: DistributedChatParams
    max_len: int
    wire: WirePlan
    formats: frozenset[str] | None = None  # weight formats the call accepts (DESIGN.md decision 10)
    # the model's formats that keep its stored weights (what `done` reports against)
    lossless: frozenset[str] = frozenset({"fp32"})
    failures: int = 0
    step: int = 0
    failover_ms: list[float] = field(default_factory=list)
    frames: list[StreamFrame] = field(default_factory=list)  # diagnostics raised mid-step
    first_ms: float | None = None  # time to the first token, once there is one
    # the call's proposer and its statistics (DESIGN.md decision 16); None: one token a pass
    speculator: Speculator | None = None
    decode_t0: float = 0.0  # perf_counter() at the first token

    def tokens_per_s(self, now: float) -> float:
        """Decode speed: tokens after the first over the time since it."""
        decode_s = now - self.decode_t0
        n = len(self.gen.tokens)
        return (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0

    def take_frames(self) -> list[StreamFrame]:
        out, self.frames = self.frames, []
        return out
