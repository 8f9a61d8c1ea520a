"""Per-call state of one distributed chat: its stage sessions, its step counter, failures.

Every `PipelineOrchestrator` call owns one `CallState`; nothing here is shared between
calls (concurrent chats and concurrent fallbacks each hold their own). `StageFailed` and
`FellBack` are the two internal signals between the decode loop (`decode.py`) and the
failover replay (`failover.py`); neither ever reaches a caller.

`RunningCalls` is the one shared thing: the orchestrator's calls in progress as the status
page shows them (model, tokens so far, tok/s, path or local fallback, failovers). Each
`RunningCall` follows its call's frames — the same facts the caller is told — and holds
counts and shard ids only: no prompt, no token text, no tensor (M26 §5.8).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import Histogram

from hearthnet.distributed_inference.directory.descriptors import Pipeline, PipelineStage
from hearthnet.distributed_inference.engine.batcher import MAX_LANES
from hearthnet.distributed_inference.engine.device import rows_independent
from hearthnet.distributed_inference.engine.generation import Generation
from hearthnet.distributed_inference.engine.speculation import Speculator
from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams
from hearthnet.distributed_inference.orchestrator.wire import WirePlan
from hearthnet.distributed_inference.seams import Channel, Connector, StepOutput
from hearthnet.errors import ConnectionLost, HearthNetError
from hearthnet.frames import (
    PipelineAborted,
    ShardFailover,
    ShardStatus,
    StreamFrame,
    TokenDelta,
)
from hearthnet.stats import LatencyWindow

__all__ = ["CallState", "ClosedChannel", "Connector", "FellBack", "RunningCall",
           "RunningCalls", "StageFailed", "StageSession", "decode_rate", "inputs_before",
           "prefix_source", "shared_prefix", "worth_waiting_for"]


def decode_rate(tokens: int, decode_t0: float, now: float) -> float:
    """Decode speed: the tokens after the first over the time since the first
    (`perf_counter` seconds); 0.0 before a second token."""
    decode_s = now - decode_t0
    return (tokens - 1) / decode_s if decode_s > 0 and tokens > 1 else 0.0


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
    ref: str = ""  # this node's name for the session on its shard (another call's `fork`)

    @property
    def shard_id(self) -> str:
        return self.stage.shard.shard_id

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.stage.shard.shard_id, self.stage.start, self.stage.end)

    @property
    def route(self) -> tuple[str, int, int, str]:
        """Shard, sub-range and wire dtype: sessions that agree on them compute the same
        keys and values from the same inputs."""
        return (self.stage.shard.shard_id, self.stage.start, self.stage.end, self.wire)

    def truncate(self, pos: int) -> None:
        """Drop recorded inputs at positions ≥ `pos` (a step about to be redone)."""
        self.history = inputs_before(self.history, pos)


def inputs_before(history: list[torch.Tensor], pos: int) -> list[torch.Tensor]:
    """The recorded inputs of positions < `pos` (views, no copy)."""
    kept: list[torch.Tensor] = []
    n = 0
    for h in history:
        if n + h.shape[1] > pos:
            if pos > n:
                kept.append(h[:, :pos - n])
            break
        kept.append(h)
        n += h.shape[1]
    return kept


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
    lane: int = 0  # its micro-batch lane on every stage and the head (`Lanes`)
    lane_held: bool = True  # counted in `Lanes` until the call is closed
    # shared prompt prefixes (DESIGN.md decision 12): positions its stages copied from
    # another call (`prefix_source`), and how many of its prompt's every stage holds
    prefix: int = 0
    held: int = 0
    # the prompt's first `share_at` positions go through as a chunk of their own, for calls
    # that wait to copy them (0: the prompt in one go); `prefix_ready` is set once every
    # stage holds the whole prompt, or the call ended: it will hold no more
    share_at: int = 0
    prefix_ready: asyncio.Event = field(default_factory=asyncio.Event)
    _held_moved: asyncio.Event = field(default_factory=asyncio.Event)  # pulsed by `hold`

    def hold(self, positions: int) -> None:
        """Every stage holds the prompt's first `positions`: other calls may copy them."""
        self.held = positions
        if positions >= len(self.gen.prompt_ids):
            self.prefix_ready.set()
        self._pulse()

    def end_prefix(self) -> None:
        """The call ended (or failed): it holds no more of its prompt for others."""
        self.prefix_ready.set()
        self._pulse()

    def _pulse(self) -> None:
        moved, self._held_moved = self._held_moved, asyncio.Event()
        moved.set()

    def progress_mark(self) -> tuple[tuple[int, int], ...]:
        """What changes while this call's steps go on: each stage's recorded inputs (one
        more per step it took) and the progress PINGs its shard sent while a step waited
        (docs/protocol.md §3.6a)."""
        return tuple((len(st.history), int(getattr(st.channel, "progress_pings", 0)))
                     for st in self.stages)

    async def prefix_wait(self, positions: int, idle_s: float) -> None:
        """Wait until every stage holds the prompt's first `positions` (or the call will
        hold no more: `prefix_ready`) while this call's prompt moves: give up once `idle_s`
        passes with no stage taking a step or PINGing progress. A call copying this one's
        prompt start waits so: a long shared document on a slow machine is many steps,
        each within its own deadline, and may take longer than one of them in all — a
        single `idle_s` for the whole of it gave up on such a source and then computed the
        whole prompt itself, beside it (M26 §5.3)."""
        mark = self.progress_mark()
        while self.held < positions and not self.prefix_ready.is_set():
            moved = self._held_moved
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved.wait(), idle_s)
            now = self.progress_mark()
            if now == mark and not moved.is_set():
                return
            mark = now

    @property
    def route(self) -> list[tuple[str, int, int, str]]:
        """Each stage's shard, sub-range and wire dtype, in order."""
        return [st.route for st in self.stages]

    def tokens_per_s(self, now: float) -> float:
        """Decode speed: tokens after the first over the time since it."""
        return decode_rate(len(self.gen.tokens), self.decode_t0, now)

    def take_frames(self) -> list[StreamFrame]:
        out, self.frames = self.frames, []
        return out


PREFIX_MIN_TOKENS = 16  # fewer shared first tokens are not worth a session's fork


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def worth_waiting_for(source: Sequence[int], ids: Sequence[int]) -> bool:
    """Whether a call with prompt `ids` should wait for another call's prompt `source` to
    be computed and copy its first positions (`prefix_source`): where they share at
    least `PREFIX_MIN_TOKENS` first tokens and at least half of `ids` (the last of `ids`
    not counted: it is always computed), and `source` is at most twice as long (a long
    prompt's prefill is no time to wait for a short shared preamble)."""
    n = min(shared_prefix(source, ids), len(ids) - 1)
    return n >= PREFIX_MIN_TOKENS and 2 * n >= len(ids) and len(source) <= 2 * len(ids)


def copies_exactly(stages: Iterable[PipelineStage]) -> bool:
    """Whether positions copied from another call's sessions leave a call's answer as
    computing them would (DESIGN.md decision 12): the copier computes the rest of its
    prompt as a smaller product than its own prefill, and its source sends its prompt in
    two pieces; so only where every stage's products are `rows_independent`."""
    return all(rows_independent(s.shard.device) for s in stages)


def prefix_source(calls: Iterable[CallState], route: list[tuple[str, int, int, str]],
                  ids: Sequence[int]) -> tuple[CallState, int] | None:
    """The running call a new call with prompt `ids` through `route` copies its first
    positions from, and how many (DESIGN.md decision 12): the one through the same
    shards, sub-ranges and wire dtypes whose prompt shares the most first tokens — at
    least `PREFIX_MIN_TOKENS`, and the last of `ids` always left to compute (its output
    is the first token's). A call still sending those positions is chosen only where it
    is `worth_waiting_for`; else the call that holds the most of them already
    (`CallState.held`), if any."""
    top = len(ids) - 1
    held: tuple[CallState, int] | None = None
    waiting: tuple[CallState, int] | None = None
    for c in calls:
        if c.route != route:
            continue
        n = min(shared_prefix(c.gen.prompt_ids, ids), top)
        have = min(n, c.held)
        if have >= PREFIX_MIN_TOKENS and (held is None or have > held[1]):
            held = (c, have)
        if n >= PREFIX_MIN_TOKENS and have < n and not c.prefix_ready.is_set() \
                and worth_waiting_for(c.gen.prompt_ids, ids) \
                and (waiting is None or n > waiting[1]):
            waiting = (c, n)
    if waiting is not None and (held is None or waiting[1] > held[1]):
        return waiting
    return held


class Lanes:
    """An orchestrator's micro-batch lanes (M26 §5.3, DESIGN.md decision 12).

    Concurrent chats through a pipeline of S stages go into S lanes, the emptiest first,
    and every stage and the head batch each lane's rows as rounds of their own. One batch
    of every chat keeps all stages but one idle while that one computes; with a lane per
    stage, stage 0 computes one lane while stage 1 computes another, and a round of half
    the rows costs well over half a round of all of them on a CPU (1.5B shape, int8, one
    thread: 4 rows 0.8 × the time of 8). `fixed` (the config's ``pipeline_lanes``) sets the
    count instead; 1, a node's default, is one batch of every chat (lanes are opt-in: on one
    2-core machine they did not raise the aggregate, docs/benchmarks.md).
    """

    def __init__(self, fixed: int | None = None) -> None:
        self.fixed = fixed
        self.calls: Counter[int] = Counter()  # lane -> calls in it now

    def take(self, stages: int) -> int:
        """A lane for a new call through `stages` stages, the one with fewest calls,
        counted at once: chats that start together are opening their stages at the same
        time and must not all see the same emptiest lane."""
        n = max(1, min(self.fixed or stages, MAX_LANES))
        lane = min(range(n), key=lambda lane: (self.calls[lane], lane))
        self.calls[lane] += 1
        return lane

    def drop(self, lane: int) -> None:
        """A taken lane whose call did not come about (its stages could not be opened)."""
        self.calls[lane] -= 1

    def give(self, call: CallState) -> None:
        """`call` ended: its lane has one call fewer (once, however often it is closed)."""
        if call.lane_held:
            call.lane_held = False
            self.drop(call.lane)


@dataclass
class RunningCall:
    """One call in progress, as the status page shows it; fed its frames by `see`."""

    call_id: int
    model: str
    started_at: float  # wall clock (time.time())
    t0: float  # perf_counter() at the start
    path: list[str] = field(default_factory=list)  # stage shard ids, in order
    fallback: bool = False  # continued (or ran wholly) on the local engine (M26 §5.4)
    fallback_reason: str | None = None
    failovers: int = 0
    tokens: int = 0
    first_at: float | None = None  # perf_counter() at the first token
    last_at: float | None = None  # perf_counter() at the latest token
    # tokens taken before the local engine took over: its tok/s counts its own only
    local_from: int = 0
    local_t0: float | None = None

    def see(self, frame: StreamFrame) -> None:
        """Note what `frame` says of the call: one isinstance chain and a counter on the
        per-token path (DESIGN.md hot path rules)."""
        if isinstance(frame, TokenDelta):
            self.tokens += 1
            self.last_at = time.perf_counter()
            if self.first_at is None:
                self.first_at = self.last_at
            if self.fallback and self.local_t0 is None:
                self.local_t0 = self.last_at
        elif isinstance(frame, ShardStatus):
            if frame.status == "ok":  # one per stage, at construction
                self.path.append(frame.shard_id)
        elif isinstance(frame, ShardFailover):
            self.failovers += 1
            self.path = list(frame.pipeline)
        elif isinstance(frame, PipelineAborted) and frame.continuing == "local":
            self.fallback, self.fallback_reason = True, frame.reason
            self.local_from = self.tokens

    @property
    def state(self) -> str:
        """"starting" (choosing and opening shards), "prefill" (the prompt, no token yet),
        "decoding", or "local fallback" once the local engine carries it."""
        if self.fallback:
            return "local fallback"
        if self.tokens:
            return "decoding"
        return "prefill" if self.path else "starting"

    def tokens_per_s(self, now: float) -> float:
        """Decode speed so far: of the local engine's tokens alone after a fallback (the
        pipeline's speed says nothing of the local engine's)."""
        if self.fallback:
            if self.local_t0 is None:
                return 0.0
            return decode_rate(self.tokens - self.local_from, self.local_t0, now)
        return decode_rate(self.tokens, self.first_at or now, now)

    def to_dict(self, now: float, wall: float) -> dict[str, Any]:
        """A JSON-safe view: counts, ids and times only (M26 §5.8)."""
        # the rate up to the latest token: a stalled stream shows its last speed, not a
        # rate that decays while nothing moves
        tps = self.tokens_per_s(self.last_at if self.last_at is not None else now)
        return {"call_id": self.call_id, "model": self.model, "state": self.state,
                "tokens": self.tokens, "tokens_per_s": round(tps, 2),
                "path": ["local"] if self.fallback else list(self.path),
                "pipeline": list(self.path), "fallback": self.fallback,
                "fallback_reason": self.fallback_reason, "failovers": self.failovers,
                "started_at": self.started_at, "elapsed_s": round(wall - self.started_at, 1),
                "first_token_ms": round((self.first_at - self.t0) * 1000, 1)
                if self.first_at is not None else None}


class RunningCalls:
    """The orchestrator's calls in progress (the status page's "running chats").

    `track` registers a call for the time of a ``with`` block and removes it when the
    block ends however it ends (finished, failed, or abandoned by its caller).
    """

    def __init__(self) -> None:
        self._calls: dict[int, RunningCall] = {}
        self._ids = itertools.count(1)

    @contextmanager
    def track(self, model: str) -> Iterator[RunningCall]:
        call = RunningCall(next(self._ids), model, time.time(), time.perf_counter())
        self._calls[call.call_id] = call
        try:
            yield call
        finally:
            self._calls.pop(call.call_id, None)

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[RunningCall]:
        return iter(list(self._calls.values()))

    def snapshot(self) -> list[dict[str, Any]]:
        """Every call in progress, oldest first, as `RunningCall.to_dict`."""
        now, wall = time.perf_counter(), time.time()
        return [c.to_dict(now, wall) for c in sorted(self._calls.values(),
                                                     key=lambda c: c.call_id)]
