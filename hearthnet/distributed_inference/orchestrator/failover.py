"""Failover by replay (M26 §5.4): replace a failed stage and rebuild its cache.

When a stage fails — its stream errors, closes, stalls past the deadline, or returns
activations that fail the sanity check — it is excluded, `router.repick` finds a
replacement covering the same sub-range, the recorded inputs are replayed into the
replacement to rebuild its KV cache, and the in-flight step is redone. Nothing already
streamed is lost or repeated. After `fallback_after_failures` failures in one call, or when
no replacement exists, `FellBack` tells the orchestrator to continue locally or abort.

A `wire_overflow` is not a stage failure (a transport limit, not a fault): `widen` reopens the
same stage with a wider wire dtype, replays it and redoes the step — nobody is blamed. Nor is a
replacement that refuses the open because it is at its `max_concurrent_streams` (busy, M26
§5.6): it is neither suspected nor counted. Another replacement is tried first; when only busy
shards could replace the failed stage, the call waits for a slot as opening one does (up to its
`timeout_s`, `BusyWait`) before it falls back — a household's orchestrator often cannot hold the
whole model, and then falling back means ending the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import torch

from hearthnet.distributed_inference.directory.descriptors import Pipeline, PipelineStage
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.routing import ShardRouter
from hearthnet.distributed_inference.orchestrator.calls import (
    CallState,
    ClosedChannel,
    FellBack,
    StageFailed,
    StageSession,
)
from hearthnet.distributed_inference.orchestrator.request import DistributedChatParams
from hearthnet.distributed_inference.orchestrator.wire import WirePlan
from hearthnet.errors import (
    HearthNetError,
    ShardCorrupted,
    ShardUnavailable,
    WeightsMismatch,
    WireOverflow,
)
from hearthnet.frames import ShardFailover, ShardStatus, WireWidened
from hearthnet.models.store import ModelEntry, ModelStore
from hearthnet.observability import Metrics, get_logger

log = get_logger("pipeline")

# (stage, model, params, max_len, wire plan) -> an open session on that stage's shard
StageOpener = Callable[[PipelineStage, ModelEntry, DistributedChatParams, int, WirePlan, int],
                       Awaitable[StageSession]]
"""(stage, model, call params, max_length, wire plan, micro-batch lane) -> its session."""


class Failover:
    """Replaces failed stages of a call (M26 §5.4)."""

    def __init__(self, *, models: ModelStore, router: ShardRouter,
                 health: ShardHealthTracker, metrics: Metrics, open_stage: StageOpener) -> None:
        self.models, self.router, self.health, self.metrics = models, router, health, metrics
        self.open_stage = open_stage

    def note_failure(self, call: CallState, sid: str, cause: HearthNetError) -> None:
        """Count a stage failure; raises `FellBack` past `fallback_after_failures`."""
        call.failures += 1
        if isinstance(cause, ShardCorrupted):
            self.metrics.shard_corruption_detected_total.labels(sid).inc()
        self.health.mark_suspect(sid, cause.code)
        log.warning("shard_failed", shard_id=sid, code=cause.code, step=call.step,
                    failures=call.failures)
        call.frames.append(ShardStatus.degraded(sid, cause))
        if call.failures >= call.params.fallback_after_failures:
            raise FellBack(f"{call.failures} shard failures in one call (fallback after "
                           f"{call.params.fallback_after_failures}); last: {sid}: "
                           f"{cause.message}")

    async def widen(self, call: CallState, f: StageFailed, pos: int
                    ) -> tuple[int, torch.Tensor]:
        """Reopen the overflowing stage with a wider wire dtype, replay it, redo the step.

        No suspicion, no corruption metric, no failure count. Under a forced wire dtype
        the overflow ends the call (`WirePlan.widen` raises it as `wire_overflow`).
        """
        old = call.stages[f.index]
        assert isinstance(f.cause, WireOverflow)
        call.wire.widen(old.stage.start, old.stage.end, f.cause)
        with contextlib.suppress(Exception):
            await old.channel.close()
        entry = self.models.get(call.pipeline.model_id)
        try:
            new = await self.open_stage(old.stage, entry, call.params, call.max_len, call.wire,
                                        call.lane)
            if old.history:  # rebuild the KV cache of the positions before this step
                await new.channel.step(0, 0, torch.cat(old.history, dim=1),
                                       call.params.timeout_s)
        except HearthNetError as e:  # the shard itself failed now: an ordinary failover
            closed = ClosedChannel(old.channel.wire_dtype)
            call.stages[f.index] = StageSession(old.stage, closed, old.wire, old.latency,
                                                old.overhead, old.history)
            return await self.replace(call, StageFailed(f.index, e, f.x_in), pos)
        new.history, new.rtt_ms, new.overhead_ms = old.history, old.rtt_ms, old.overhead_ms
        call.stages[f.index] = new
        log.info("wire_widened", shard_id=old.shard_id, step=call.step, old=old.wire,
                 new=new.wire)
        call.frames.append(WireWidened(old.shard_id, (old.stage.start, old.stage.end),
                                       call.step, old.wire, new.wire))
        return f.index, f.x_in

    async def replace(self, call: CallState, f: StageFailed, pos: int
                      ) -> tuple[int, torch.Tensor]:
        """Replace the failed stage; returns (stage index to resume from, its input)."""
        failed = call.stages[f.index]
        with contextlib.suppress(Exception):
            await failed.channel.close()
        exclude, busy = {failed.shard_id}, set[str]()
        self.note_failure(call, failed.shard_id, f.cause)
        t0 = time.perf_counter()
        slot = self.router.busy_wait(call.params.timeout_s)
        while True:
            try:
                new = await self.router.repick(call.pipeline, exclude=exclude | busy,
                                               formats=call.formats)
            except (ShardUnavailable, WeightsMismatch) as e:
                waiting = bool(busy or e.details.get("busy"))
                # repick's own release and re-reservation counted: what ends a wait is later
                if waiting and await slot.wait(self.router.releases):
                    busy.clear()  # busy a moment ago: worth another try
                    continue
                why = f" (no busy replacement freed a slot within {call.params.timeout_s:g} s)"
                raise FellBack(f"no replacement for {failed.shard_id}: {e.message}"
                               + (why if waiting else "")) from e
            try:
                resume, x, fresh = await self.rebuild(call, new, pos, f)
                break
            except StageFailed as g:  # a replacement failed while being rebuilt
                bad = new.stages[g.index].shard.shard_id
                call.pipeline = new
                if g.cause.details.get("busy"):  # at its stream limit: busy, not broken
                    busy.add(bad)
                else:
                    exclude.add(bad)
                    self.note_failure(call, bad, g.cause)
        ms = (time.perf_counter() - t0) * 1000
        call.failover_ms.append(ms)
        self.metrics.failovers_total.inc()
        call.frames.append(ShardFailover(failed.shard_id, tuple(fresh),
                                         tuple(s.shard_id for s in call.stages), pos,
                                         round(ms, 1)))
        return resume, x

    async def rebuild(self, call: CallState, new: Pipeline, pos: int, f: StageFailed
                      ) -> tuple[int, torch.Tensor, list[str]]:
        """Swap in `new`'s stages and replay recorded inputs into the fresh ones.

        Stages before the first changed one are untouched. From the first changed stage `i`
        to the last fresh one, every stage is fed the recorded inputs of positions < `pos`
        (a kept stage recomputes: its session cuts its cache back); stages after that keep
        their caches. Returns `i`, the in-flight input at `i`'s boundary and the shard ids
        of the fresh stages.
        """
        old = call.stages
        keys = [(s.shard.shard_id, s.start, s.end) for s in new.stages]
        i = next((j for j, key in enumerate(keys) if j >= len(old) or old[j].key != key),
                 len(keys))
        by_key = {s.key: s for s in old if s.shard_id != old[f.index].shard_id}
        entry = self.models.get(new.model_id)
        fresh_idx = [j for j, key in enumerate(keys) if key not in by_key]
        opened = await asyncio.gather(
            *(self.open_stage(new.stages[j], entry, call.params, call.max_len, call.wire,
                              call.lane) for j in fresh_idx),
            return_exceptions=True)
        stages: list[StageSession] = [by_key.get(key) for key in keys]  # type: ignore[misc]
        for j, st in zip(fresh_idx, opened, strict=True):
            if isinstance(st, BaseException):
                for o in opened:
                    if isinstance(o, StageSession):
                        with contextlib.suppress(Exception):
                            await o.channel.close()
                cause = st if isinstance(st, HearthNetError) else ShardUnavailable(str(st))
                raise StageFailed(j, cause, f.x_in)
            stages[j] = st
        # the boundary input at stage i: positions < pos are replayed, the rest is in flight
        src = old[i].history if i < len(old) else []
        recorded = torch.cat(src, dim=1) if src else None
        x_now = f.x_in if i == f.index or recorded is None or recorded.shape[1] <= pos \
            else recorded[:, pos:]
        replay = recorded[:, :pos] if recorded is not None and pos > 0 else None
        last = max(fresh_idx) if fresh_idx else i - 1
        for j in range(i, len(stages)):
            st = stages[j]
            if j > last:
                st.truncate(pos)
                continue
            st.history = []
            if replay is None:
                continue
            try:
                res = await st.channel.step(0, 0, replay, call.params.timeout_s)
            except HearthNetError as e:
                raise StageFailed(j, e, f.x_in) from e
            st.history = [replay]
            replay = res.tensor
        call.stages, call.pipeline = stages, new
        return i, x_now, [stages[j].shard_id for j in fresh_idx]
