"""`PipelineOrchestrator`: a distributed chat, end to end (M26 §4.3, §5.3–5.5, §5.10).

Per call: pick a pipeline (timed as construction), open one session per stage concurrently,
run the prefill through the chain, then the decode loop — embed → relay the hidden state
through each stage → norm and lm_head → sample (DESIGN.md "Hot path rules").

The orchestrator relays between stages (DESIGN.md decision 1), so it holds the input of
every stage for every position so far (`_Stage.history`). When a stage fails — its stream
errors, closes, stalls past the deadline, or returns activations that fail the sanity
check — it is excluded, `router.repick` finds a replacement covering the same sub-range,
the recorded inputs are replayed into the replacement to rebuild its KV cache, and the
in-flight step is redone (M26 §5.4; issue 6). Nothing already streamed is lost or repeated.
After `fallback_after_failures` failures in one call, or when no replacement exists, the
*same* `Generation` continues on the local engine when `fallback_to_local` is set.

Frames (plain dicts, JSON-safe): `token_delta`, `shard_status`, `shard_failover`,
`pipeline_aborted`, `done`, `error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from hearthnet.distributed_inference.backends.small_model_layered import LayeredHead
from hearthnet.distributed_inference.descriptors import Pipeline, PipelineStage
from hearthnet.distributed_inference.generation import Generation, SamplingParams
from hearthnet.distributed_inference.health import ShardHealthTracker
from hearthnet.distributed_inference.routing import ShardRouter
from hearthnet.distributed_inference.sanity import SanityChecker, calibrate
from hearthnet.distributed_inference.shard import WIRE_DTYPES
from hearthnet.errors import (
    BadRequest,
    ExperimentalDisabled,
    HearthNetError,
    ShardCorrupted,
    ShardUnavailable,
    WeightsMismatch,
)
from hearthnet.models.store import ModelEntry, ModelStore
from hearthnet.observability import Metrics, get_logger

log = get_logger("pipeline")

Frame = dict[str, Any]
_OPEN_ATTEMPTS = 3
# (uri, open_params, deadline_s) -> channel with .step(step, start_pos, tensor, deadline_s)
# returning an object with .tensor and .compute_us, and .close(). The transport seam.
Connector = Callable[[str, dict[str, Any], float], Awaitable[Any]]
# Adds caller authentication to open params (issue 7); identity when security is off.
OpenSigner = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class ChatRequest:
    """An `experimental.distributed_llm.chat` request."""

    model: str
    messages: list[dict[str, str]]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ChatRequest:
        if not isinstance(d, dict) or not isinstance(d.get("model", "smollm2"), str):
            raise BadRequest("request must be a map with a model name")
        msgs = d.get("messages")
        if not isinstance(msgs, list) or not msgs or len(msgs) > 256:
            raise BadRequest("messages must be a non-empty list of {role, content}")
        return cls(model=d.get("model", "smollm2"), messages=msgs)


@dataclass(frozen=True)
class DistributedChatParams:
    """The spec's parameters (M26 §4.3) plus sampling."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    fallback_to_local: bool = True
    wire_dtype: str = "fp16"
    max_shards: int = 16
    timeout_s: float = 30.0
    fallback_after_failures: int = 2

    @classmethod
    def from_dict(cls, d: dict[str, Any], defaults: DistributedChatParams) -> DistributedChatParams:
        """Build from a request map; unknown keys or wrong types are `bad_request`."""
        if not isinstance(d, dict):
            raise BadRequest("params must be a map")
        s = d.get("sampling", {})
        if not isinstance(s, dict):
            raise BadRequest("params.sampling must be a map")
        known = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop"}
        if set(s) - known:
            raise BadRequest(f"unknown sampling keys {sorted(set(s) - known)}")
        try:
            sampling = SamplingParams(**{**s, "stop": tuple(s.get("stop", ()))})
            out = cls(sampling=sampling,
                      fallback_to_local=bool(d.get("fallback_to_local",
                                                   defaults.fallback_to_local)),
                      wire_dtype=str(d.get("wire_dtype", defaults.wire_dtype)),
                      max_shards=int(d.get("max_shards", defaults.max_shards)),
                      timeout_s=float(d.get("timeout_s", defaults.timeout_s)),
                      fallback_after_failures=int(d.get("fallback_after_failures",
                                                        defaults.fallback_after_failures)))
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad params: {e}") from e
        if out.wire_dtype not in WIRE_DTYPES:
            raise BadRequest("wire_dtype must be fp16, bf16 or fp32")
        if not 0.1 <= out.timeout_s <= 600:
            raise BadRequest("timeout_s must be in 0.1..600")
        return out


class StageFailed(Exception):
    """Internal: stage `index` failed with `cause` while given `x_in` at this step."""

    def __init__(self, index: int, cause: HearthNetError, x_in: torch.Tensor) -> None:
        super().__init__(str(cause))
        self.index, self.cause, self.x_in = index, cause, x_in


class _FellBack(Exception):
    """Internal: give up on the pipeline; continue locally or abort."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Stage:
    stage: PipelineStage
    channel: Any
    history: list[torch.Tensor] = field(default_factory=list)  # inputs, (1, T_i, H) each
    rtt_ms: list[float] = field(default_factory=list)
    overhead_ms: list[float] = field(default_factory=list)

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
class _Call:
    """Per-call bookkeeping."""

    pipeline: Pipeline
    stages: list[_Stage]
    gen: Generation
    params: DistributedChatParams
    max_len: int
    failures: int = 0
    step: int = 0
    failover_ms: list[float] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)  # diagnostics raised mid-step

    def take_frames(self) -> list[Frame]:
        out, self.frames = self.frames, []
        return out


class PipelineOrchestrator:
    """Chooses shards, opens streams, pumps activations through them; handles failover."""

    def __init__(self, *, models: ModelStore, router: ShardRouter, health: ShardHealthTracker,
                 metrics: Metrics, connect: Connector, executor: Executor,
                 defaults: DistributedChatParams | None = None, enabled: bool = True,
                 sign_open: OpenSigner | None = None, max_concurrent_pipelines: int = 4,
                 local_dtype: str = "fp32") -> None:
        self.models, self.router, self.health, self.metrics = models, router, health, metrics
        self.connect, self.executor = connect, executor
        self.defaults = defaults or DistributedChatParams()
        self.enabled = enabled
        self.sign_open = sign_open or (lambda p: p)
        self._heads: dict[str, LayeredHead] = {}
        self._checkers: dict[str, SanityChecker] = {}
        self._locals: dict[str, Any] = {}
        self._head_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_concurrent_pipelines)
        self.local_dtype = local_dtype

    # ---- public API ----

    async def chat(self, request: ChatRequest, params: DistributedChatParams
                   ) -> AsyncGenerator[Frame, None]:
        """Stream the frames of one distributed chat (M26 §4.3)."""
        if not self.enabled:
            raise ExperimentalDisabled(
                "distributed inference is disabled on this node "
                "(policy.research.enable / research.distributed_inference.enabled)")
        entry = self.models.get(request.model)  # ModelNotFound is a bad_request
        async with self._slots, contextlib.aclosing(self._chat(entry, request, params)) as it:
            async for frame in it:  # aclosing: an abandoned call still closes its sessions
                yield frame

    def has_free_slot(self) -> bool:
        """False while `max_concurrent_pipelines` calls run (the API answers 429 then)."""
        return not self._slots.locked()

    async def prepare(self, model: str) -> None:
        """Load the head and the sanity bounds of `model` ahead of the first call."""
        await self._head(self.models.get(model))

    # ---- the call ----

    async def _chat(self, entry: ModelEntry, request: ChatRequest,
                    params: DistributedChatParams) -> AsyncGenerator[Frame, None]:
        t0 = time.perf_counter()
        head, checker = await self._head(entry)
        gen = Generation(head.tokenizer, head.chat_prompt_ids(request.messages),
                         params.sampling, head.eos_token_ids)
        call: _Call | None = None
        outcome = "error"
        try:
            try:
                call = await self._construct(entry, gen, params)
            except (ShardUnavailable, WeightsMismatch) as e:
                async for f in self._give_up(entry, gen, params, e.message, t0, None,
                                             code=e.code):
                    yield f
                outcome = "fallback" if params.fallback_to_local else "aborted"
                return
            construct_ms = (time.perf_counter() - t0) * 1000
            self.metrics.pipeline_construct_ms.observe(construct_ms)
            for st in call.stages:
                yield {"type": "shard_status", "shard_id": st.shard_id, "status": "ok",
                       "layers": [st.stage.start, st.stage.end]}
            first_ms: float | None = None
            decode_t0 = 0.0
            loop = asyncio.get_running_loop()
            x = head.embed(gen.prompt_ids)
            pos = 0
            while not gen.done:
                try:
                    h = await self._relay(call, x, pos, checker)
                except _FellBack as fb:
                    for f in call.take_frames():
                        yield f
                    async for f in self._give_up(entry, gen, params, fb.reason, t0, first_ms):
                        yield f
                    outcome = "fallback" if params.fallback_to_local else "aborted"
                    return
                for f in call.take_frames():
                    yield f
                # lm_head (~7 ms for SmolLM2) runs off the loop: other calls' relays go on
                ev = gen.step(await loop.run_in_executor(self.executor, head.logits, h))
                if first_ms is None:
                    first_ms = (time.perf_counter() - t0) * 1000
                    self.metrics.first_token_ms.observe(first_ms)
                    decode_t0 = time.perf_counter()
                self.metrics.tokens_generated_total.inc()
                yield {"type": "token_delta", "text": ev.text, "token_id": ev.token_id,
                       "index": ev.index}
                pos += x.shape[1]
                x = head.embed([ev.token_id])
            decode_s = time.perf_counter() - decode_t0
            tps = (len(gen.tokens) - 1) / decode_s if decode_s > 0 and len(gen.tokens) > 1 \
                else 0.0
            self.metrics.tokens_per_second.observe(tps)
            outcome = "ok"
            yield self._done(call, gen, t0, construct_ms, first_ms or 0.0, tps)
        except HearthNetError as e:
            yield {"type": "error", "code": e.code, "message": e.message}
        finally:
            self.metrics.chats_total.labels(outcome).inc()
            if call is not None:
                await self._close(call)

    async def _head(self, entry: ModelEntry) -> tuple[LayeredHead, SanityChecker]:
        async with self._head_lock:
            if entry.weights_sha256 not in self._heads:
                loop = asyncio.get_running_loop()
                self._heads[entry.weights_sha256] = await loop.run_in_executor(
                    self.executor, LayeredHead, entry)
                bounds = await loop.run_in_executor(self.executor, calibrate, entry.path)
                self._checkers[entry.weights_sha256] = SanityChecker(bounds)
        return self._heads[entry.weights_sha256], self._checkers[entry.weights_sha256]

    async def _construct(self, entry: ModelEntry, gen: Generation,
                         params: DistributedChatParams) -> _Call:
        """Pick a pipeline and open every stage concurrently (M26 §4.3 steps 1-2).

        A shard that refuses the open (e.g. at `max_concurrent_streams`, M26 §5.6) or cannot
        be reached is excluded and the router picks again, up to `_OPEN_ATTEMPTS` times.
        """
        max_len = len(gen.prompt_ids) + params.sampling.max_tokens + 1
        exclude: set[str] = set()
        reasons: list[str] = []
        for _ in range(_OPEN_ATTEMPTS):
            pipeline = await self.router.pick(entry.model_id, entry.weights_sha256,
                                              entry.num_layers, exclude=exclude)
            if len(pipeline.stages) > params.max_shards:
                self.router.release(pipeline)
                raise ShardUnavailable(f"the cover needs {len(pipeline.stages)} shards; "
                                       f"max_shards is {params.max_shards}")
            opened = await asyncio.gather(
                *(self._open(s, entry, params, max_len) for s in pipeline.stages),
                return_exceptions=True)
            stages = [o for o in opened if isinstance(o, _Stage)]
            if len(stages) == len(opened):
                return _Call(pipeline, stages, gen, params, max_len)
            for st in stages:
                with contextlib.suppress(Exception):
                    await st.channel.close()
            self.router.release(pipeline)
            for stage, o in zip(pipeline.stages, opened, strict=True):
                if isinstance(o, BaseException) and not isinstance(o, HearthNetError):
                    raise o
                if isinstance(o, HearthNetError):
                    exclude.add(stage.shard.shard_id)
                    reasons.append(o.message)
        raise ShardUnavailable(f"could not open sessions in {_OPEN_ATTEMPTS} attempts: "
                               + "; ".join(reasons[-3:]))

    async def _open(self, stage: PipelineStage, entry: ModelEntry,
                    params: DistributedChatParams, max_len: int) -> _Stage:
        p = self.sign_open({
            "shard_id": stage.shard.shard_id, "model_id": entry.model_id,
            "weights_sha256": entry.weights_sha256, "start": stage.start, "end": stage.end,
            "max_length": max_len, "wire_dtype": params.wire_dtype})
        uri = stage.shard.endpoint.rstrip("/") + "/shard"
        try:
            ch = await self.connect(uri, p, params.timeout_s)
        except HearthNetError as e:
            if not isinstance(e, ShardUnavailable):  # busy is healthy; unreachable is not
                self.health.mark_suspect(stage.shard.shard_id, e.code)
            raise ShardUnavailable(f"could not open a session on {stage.shard.shard_id}: "
                                   f"{e.message}", shard_id=stage.shard.shard_id) from e
        return _Stage(stage, ch)

    # ---- the hot path ----

    async def _relay(self, call: _Call, x: torch.Tensor, pos: int,
                     checker: SanityChecker) -> torch.Tensor:
        """One step through every stage, failing over as needed; returns the last output."""
        k = 0
        call.step += 1
        while True:
            try:
                return await self._through(call, x, pos, k, checker)
            except StageFailed as f:
                k, x = await self._failover(call, f, pos)

    async def _through(self, call: _Call, x: torch.Tensor, pos: int, k0: int,
                       checker: SanityChecker) -> torch.Tensor:
        for k in range(k0, len(call.stages)):
            st = call.stages[k]
            t = time.perf_counter()
            try:
                res = await st.channel.step(call.step, pos, x, call.params.timeout_s)
                checker.check(st.shard_id, st.stage.end, res.tensor)
            except HearthNetError as e:
                raise StageFailed(k, e, x) from e
            rtt = (time.perf_counter() - t) * 1000
            st.history.append(x)
            st.rtt_ms.append(rtt)
            st.overhead_ms.append(rtt - res.compute_us / 1000)
            self.metrics.shard_latency_ms.labels(st.shard_id).observe(rtt)
            self.health.observe_latency(st.shard_id, rtt)
            x = res.tensor
        return x

    # ---- failure handling (M26 §5.4, issue 6) ----

    def _note_failure(self, call: _Call, sid: str, cause: HearthNetError) -> None:
        call.failures += 1
        if isinstance(cause, ShardCorrupted):
            self.metrics.shard_corruption_detected_total.labels(sid).inc()
        self.health.mark_suspect(sid, cause.code)
        log.warning("shard_failed", shard_id=sid, code=cause.code, step=call.step,
                    failures=call.failures)
        call.frames.append({"type": "shard_status", "shard_id": sid, "status": "degraded",
                            "code": cause.code, "message": cause.message})
        if call.failures >= call.params.fallback_after_failures:
            raise _FellBack(f"{call.failures} shard failures in one call (fallback after "
                            f"{call.params.fallback_after_failures}); last: {sid}: "
                            f"{cause.message}")

    async def _failover(self, call: _Call, f: StageFailed, pos: int
                        ) -> tuple[int, torch.Tensor]:
        """Replace the failed stage; returns (stage index to resume from, its input)."""
        failed = call.stages[f.index]
        with contextlib.suppress(Exception):
            await failed.channel.close()
        exclude = {failed.shard_id}
        self._note_failure(call, failed.shard_id, f.cause)
        t0 = time.perf_counter()
        while True:
            try:
                new = await self.router.repick(call.pipeline, exclude=exclude)
            except (ShardUnavailable, WeightsMismatch) as e:
                raise _FellBack(f"no replacement for {failed.shard_id}: {e.message}") from e
            try:
                resume, x, fresh = await self._rebuild(call, new, pos, f)
                break
            except StageFailed as g:  # a replacement failed while being rebuilt
                bad = new.stages[g.index].shard.shard_id
                exclude.add(bad)
                call.pipeline = new
                self._note_failure(call, bad, g.cause)
        ms = (time.perf_counter() - t0) * 1000
        call.failover_ms.append(ms)
        self.metrics.failovers_total.inc()
        call.frames.append({"type": "shard_failover", "failed": failed.shard_id,
                            "replacement": fresh,
                            "pipeline": [s.shard_id for s in call.stages],
                            "replayed_positions": pos, "ms": round(ms, 1)})
        return resume, x

    async def _rebuild(self, call: _Call, new: Pipeline, pos: int, f: StageFailed
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
            *(self._open(new.stages[j], entry, call.params, call.max_len) for j in fresh_idx),
            return_exceptions=True)
        stages: list[_Stage] = [by_key.get(key) for key in keys]  # type: ignore[misc]
        for j, st in zip(fresh_idx, opened, strict=True):
            if isinstance(st, BaseException):
                for o in opened:
                    if isinstance(o, _Stage):
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

    async def _give_up(self, entry: ModelEntry, gen: Generation, params: DistributedChatParams,
                       reason: str, t0: float, first_ms: float | None,
                       code: str = "shard_unavailable") -> AsyncIterator[Frame]:
        """The pipeline cannot go on: continue locally, or abort (M26 §5.4)."""
        if params.fallback_to_local and code != "weights_mismatch":
            async for f in self._continue_locally(entry, gen, reason, t0, first_ms):
                yield f
            return
        yield {"type": "pipeline_aborted", "reason": reason, "continuing": None,
               "tokens_so_far": len(gen.tokens)}
        yield {"type": "error", "code": code, "message": reason}

    async def _continue_locally(self, entry: ModelEntry, gen: Generation, reason: str,
                                t0: float, first_ms: float | None) -> AsyncIterator[Frame]:
        """Continue `gen` on the local engine (M26 §5.4 fallback, issue 6 §2)."""
        yield {"type": "pipeline_aborted", "reason": reason, "continuing": "local",
               "tokens_so_far": len(gen.tokens)}
        self.metrics.fallback_to_local_total.inc()
        engine = await self._local(entry)
        loop = asyncio.get_running_loop()
        it = engine.run(gen)
        try:
            while True:
                ev = await loop.run_in_executor(self.executor, next, it, None)
                if ev is None:
                    break
                if first_ms is None:
                    first_ms = (time.perf_counter() - t0) * 1000
                    self.metrics.first_token_ms.observe(first_ms)
                self.metrics.tokens_generated_total.inc()
                yield {"type": "token_delta", "text": ev.text, "token_id": ev.token_id,
                       "index": ev.index}
        finally:
            await loop.run_in_executor(self.executor, it.close)  # frees the local KV cache
        self.metrics.tokens_per_second.observe(engine.timings.decode_tokens_per_s)
        yield {"type": "done", "finish_reason": gen.finish_reason,
               "usage": {"prompt_tokens": len(gen.prompt_ids),
                         "completion_tokens": len(gen.tokens)},
               "timings": {"first_token_ms": round(first_ms or 0.0, 1),
                           "tokens_per_second": round(engine.timings.decode_tokens_per_s, 2),
                           "total_ms": round((time.perf_counter() - t0) * 1000, 1)},
               "pipeline": ["local"], "fallback": True}

    async def _local(self, entry: ModelEntry) -> Any:
        from hearthnet.distributed_inference.local import LocalEngine

        if entry.weights_sha256 not in self._locals:
            head, _ = await self._head(entry)
            loop = asyncio.get_running_loop()
            self._locals[entry.weights_sha256] = await loop.run_in_executor(
                self.executor, lambda: LocalEngine(entry, self.local_dtype, head=head))
        return self._locals[entry.weights_sha256]

    # ---- endings ----

    def _done(self, call: _Call, gen: Generation, t0: float, construct_ms: float,
              first_ms: float, tps: float) -> Frame:
        per_shard = {}
        for st in call.stages:
            xs = sorted(st.rtt_ms)
            ov = sorted(st.overhead_ms)
            if xs:
                per_shard[st.shard_id] = {
                    "layers": [st.stage.start, st.stage.end], "steps": len(xs),
                    "p50_ms": round(xs[len(xs) // 2], 3),
                    "p95_ms": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))], 3),
                    "overhead_p50_ms": round(ov[len(ov) // 2], 3),
                    "overhead_p95_ms": round(ov[min(len(ov) - 1, int(0.95 * len(ov)))], 3)}
        return {"type": "done", "finish_reason": gen.finish_reason,
                "usage": {"prompt_tokens": len(gen.prompt_ids),
                          "completion_tokens": len(gen.tokens)},
                "timings": {"construction_ms": round(construct_ms, 1),
                            "first_token_ms": round(first_ms, 1),
                            "tokens_per_second": round(tps, 2),
                            "total_ms": round((time.perf_counter() - t0) * 1000, 1),
                            "failover_ms": [round(x, 1) for x in call.failover_ms],
                            "per_shard": per_shard},
                "pipeline": [s.shard_id for s in call.stages], "failovers": len(
                    call.failover_ms)}

    async def _close(self, call: _Call) -> None:
        self.router.release(call.pipeline)
        for st in call.stages:
            with contextlib.suppress(Exception):
                await st.channel.close()


