"""`PipelineOrchestrator`: a distributed chat, end to end (M26 §4.3, §5.3–5.5, §5.10).

Per call: pick a pipeline (timed as construction), open one session per stage concurrently,
then run the decode loop (`decode.py`), which fails stages over by replay (`failover.py`).
After `fallback_after_failures` failures in one call, or when no replacement exists, the
*same* `Generation` continues on the local engine when `fallback_to_local` is set. A shard at
its `max_concurrent_streams` is busy, not gone: construction waits for a slot (up to the call's
`timeout_s`) rather than falling back: a household's orchestrator often cannot hold the whole
model, and then falling back ends the answer.

The parts: request parsing (`request.py`), per-call state (`calls.py`), the decode loop
(`decode.py`), failover replay (`failover.py`), the frames (`frames.py`). This module
composes them: construction, the local fallback and the call's ending.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from hearthnet.distributed_inference.directory.descriptors import PipelineStage
from hearthnet.distributed_inference.directory.formats import (
    call_formats,
    formats_for,
    lossless_of,
    resolve_format,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.routing import ShardRouter
from hearthnet.distributed_inference.engine.base import ClientHead
from hearthnet.distributed_inference.engine.compiled import compile_dir_of
from hearthnet.distributed_inference.engine.generation import Generation, PromptLimits, TokenEvent
from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.local import LocalEngine, LocalTimings
from hearthnet.distributed_inference.engine.memory import layer_weight_bytes
from hearthnet.distributed_inference.engine.speculation import (
    DEFAULT_MAX_PROPOSED,
    DraftProposer,
    LookupProposer,
    Speculator,
    check_draft_tokenizer,
)
from hearthnet.distributed_inference.orchestrator.calls import (
    PREFIX_MIN_TOKENS,
    CallState,
    Connector,
    FellBack,
    Lanes,
    RunningCalls,
    StageSession,
    copies_exactly,
    inputs_before,
    prefix_source,
    shared_prefix,
    worth_waiting_for,
)
from hearthnet.distributed_inference.orchestrator.decode import DecodeLoop
from hearthnet.distributed_inference.orchestrator.failover import Failover
from hearthnet.distributed_inference.orchestrator.frames import done_frame, token_frame
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.distributed_inference.orchestrator.sanity import (
    Calibration,
    SanityChecker,
    calibrate,
)
from hearthnet.distributed_inference.orchestrator.wire import WirePlan
from hearthnet.errors import (
    BadRequest,
    ExperimentalDisabled,
    HearthNetError,
    InternalError,
    ModelUnusable,
    ShardUnavailable,
    WeightsMismatch,
)
from hearthnet.frames import Done, ErrorFrame, PipelineAborted, ShardStatus, StreamFrame
from hearthnet.models.store import HeadKey, ModelEntry, ModelStore
from hearthnet.observability import Metrics, get_logger
from hearthnet.transport.websocket import SHARD_PATH

log = get_logger("pipeline")

_OPEN_ATTEMPTS = 3

# Adds caller authentication to open params (M26 §5.8); identity when security is off.
OpenSigner = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class _Opening:
    """A call choosing and opening its stages: its prompt, an event set when that is done,
    and the shared lengths of the calls waiting to copy its prompt's first positions."""

    weights: str  # the model's weights_sha256: only the same model's prompts are shared
    ids: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    shares: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Prepared:
    """What the orchestrator keeps per model: built whole or not at all: failures stay loud."""

    head: ClientHead
    checker: SanityChecker
    calibration: Calibration


class PipelineOrchestrator:
    """Chooses shards, opens streams, pumps activations through them; handles failover."""

    def __init__(self, *, models: ModelStore, router: ShardRouter, health: ShardHealthTracker,
                 metrics: Metrics, connect: Connector, executor: Executor,
                 defaults: DistributedChatParams | None = None, enabled: bool = True,
                 sign_open: OpenSigner | None = None, max_concurrent_pipelines: int = 4,
                 local_weights: str = "fp32", limits: PromptLimits | None = None,
                 prefill_chunk_tokens: int = 256, head_device: str = "cpu",
                 batch_window_ms: float = 2.0, draft_models: dict[str, str] | None = None,
                 speculate_max_tokens: int = DEFAULT_MAX_PROPOSED,
                 local_budget_mb: int = 0, lanes: int | None = None,
                 prefix_sharing: bool = True, compile_head: bool = False) -> None:
        self.models, self.router, self.health, self.metrics = models, router, health, metrics
        self.connect, self.executor = connect, executor
        self.defaults = defaults or DistributedChatParams()
        self.enabled = enabled
        self.sign_open = sign_open or (lambda p: p)
        # by `ModelEntry.head_key` (alias, weights, tokenizer and template files), not by
        # weights alone: a model re-imported with a fixed template under another alias
        # must not get the head (the prompt) of whichever alias loaded first
        self._prepared: dict[HeadKey, _Prepared] = {}
        self._unusable: dict[HeadKey, HearthNetError] = {}
        self._locals: dict[HeadKey, LocalEngine] = {}
        self._local_locks: dict[HeadKey, asyncio.Lock] = {}
        self._head_lock = asyncio.Lock()
        # DESIGN.md decision 16: a model's draft model (by alias), loaded on first use
        self.draft_models = dict(draft_models or {})
        self.speculate_max_tokens = max(1, speculate_max_tokens)
        self._drafts: dict[HeadKey, LocalEngine] = {}
        self._draft_lock = asyncio.Lock()
        # per model alias and mode: passes, proposed and accepted so far (the status page)
        self.speculation: dict[str, dict[str, dict[str, int]]] = {}
        self.running = RunningCalls()  # calls in progress (the status page), counts only
        self._slots = asyncio.Semaphore(max_concurrent_pipelines)
        self.local_weights = local_weights  # the head's and local engine's format
        self.local_budget_mb = local_budget_mb  # the local engine's layers; 0: unbounded
        self.head_device = head_device  # where the head (and fallback) run (DESIGN.md decision 11)
        # M26 §5.7: on the CPU the head's embedding and norm + lm_head run compiled once built
        # (in the background, saved beside the layers' steps in the model store)
        self.compile_head = compile_head
        self.limits = limits or PromptLimits()
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        self.lanes = Lanes(lanes)
        # DESIGN.md decision 12: calls whose sessions a new call's may copy a shared prompt
        # prefix from (constructed, not yet closed), by id
        self.prefix_sharing = prefix_sharing
        self._live: dict[int, CallState] = {}
        # calls choosing and opening their stages, by id
        self._constructing: dict[int, _Opening] = {}
        self.failover = Failover(models=models, router=router, health=health,
                                 metrics=metrics, open_stage=self._open)
        self.decoder = DecodeLoop(metrics=metrics, health=health, failover=self.failover,
                                  executor=executor, prefill_chunk_tokens=prefill_chunk_tokens,
                                  batch_window_ms=batch_window_ms)

    # ---- public API ----

    async def chat(self, request: ChatRequest, params: DistributedChatParams
                   ) -> AsyncGenerator[StreamFrame, None]:
        """Stream the frames of one distributed chat (M26 §4.3)."""
        if not self.enabled:
            raise ExperimentalDisabled(
                "distributed inference is disabled on this node "
                "(policy.research.enable / research.distributed_inference.enabled)")
        entry = self.models.get(request.model)  # ModelNotFound is a bad_request
        # before any work: a raw prompt (a text completion) under the messages' byte limit
        self.limits.check_request(request.prompt if request.prompt is not None
                                  else request.messages, params.sampling)
        async with self._slots, contextlib.aclosing(self._chat(entry, request, params)) as it:
            with self.running.track(entry.alias) as live:  # the status page's running chats
                async for frame in it:  # aclosing: an abandoned call still closes its sessions
                    live.see(frame)
                    yield frame

    def has_free_slot(self) -> bool:
        """False while `max_concurrent_pipelines` calls run (the API answers 429 then)."""
        return not self._slots.locked()

    async def prepare(self, model: str) -> None:
        """Load the head and the sanity bounds of `model` ahead of the first call."""
        await self._head(self.models.get(model))

    def head_steps(self, alias: str) -> dict[str, str] | None:
        """What this orchestrator's head of `alias` runs its embedding and logits as
        (compiled, or eager and why; M26 §5.7; plain ``eager`` where the node compiles
        nothing, ``compile_decode = false``); None before the head is loaded."""
        for key, prep in self._prepared.items():
            if key[0] == alias:
                compiled = getattr(prep.head, "compiled", None)
                return compiled.state() if compiled is not None \
                    else {"logits": "eager", "embed": "eager"}
        return None

    # ---- the call ----

    async def _chat(self, entry: ModelEntry, request: ChatRequest,
                    params: DistributedChatParams) -> AsyncGenerator[StreamFrame, None]:
        t0 = time.perf_counter()
        prep = await self._head(entry)
        head, checker = prep.head, prep.checker
        wire = WirePlan(params.wire_dtype, params.wire_wide_dtype, prep.calibration)
        wire.check_forced(entry.alias)  # a forced fp16 that cannot fit: refused before work
        call: CallState | None = None
        # None until the prompt is tokenised: the handlers below also end a call that fails
        # before that (a chat template refusing the messages)
        gen: Generation | None = None
        spec: Speculator | None = None
        outcome = "error"
        try:
            # a text completion's raw prompt is continued as it is, without the template
            ids = head.text_prompt_ids(request.prompt) if request.prompt is not None \
                else head.chat_prompt_ids(request.messages)
            self.limits.check_prompt_ids(ids)  # the same limit as the local path
            if params.sampling.grammar is None:
                gen = Generation(head.tokenizer, ids, params.sampling, head.eos_token_ids)
            else:  # a grammar's first use builds its view of the vocabulary (~0.5 s for
                # 49k tokens): off the loop, which serves every other call meanwhile
                gen = await asyncio.to_thread(Generation, head.tokenizer, ids,
                                              params.sampling, head.eos_token_ids)
            spec = await self._speculator(entry, head, gen, params)
            try:
                call = await self._construct(entry, gen, params, wire)
            except (ShardUnavailable, WeightsMismatch) as e:
                async for f in self._give_up(entry, gen, params, e.message, t0, None,
                                             code=e.code, spec=spec):
                    yield f
                outcome = "fallback" if params.fallback_to_local else "aborted"
                return
            call.speculator = spec
            if call.prefix:
                self.metrics.prefix_reused_tokens_total.inc(call.prefix)
            construct_ms = (time.perf_counter() - t0) * 1000
            self.metrics.pipeline_construct_ms.observe(construct_ms)
            for st in call.stages:
                self.metrics.stage_formats_total.labels(
                    st.weights_format, str(st.weights_format in call.lossless).lower()).inc()
                yield ShardStatus.ok(st.shard_id, (st.stage.start, st.stage.end), st.wire,
                                     st.weights_format, st.kernel)
            try:
                async for f in self.decoder.run(call, head, checker, t0):
                    yield f
            except FellBack as fb:
                for f in call.take_frames():
                    yield f
                # the surviving stages' sessions end now, not after the local continuation:
                # idle, they would hold their shards' stream slots (M26 §5.6) meanwhile
                ended, call = call, None
                await self._close(ended)
                async for f in self._give_up(entry, gen, params, fb.reason, t0,
                                             ended.first_ms, spec=spec):
                    yield f
                outcome = "fallback" if params.fallback_to_local else "aborted"
                return
            tps = call.tokens_per_s(time.perf_counter())
            self.metrics.tokens_per_second.observe(tps)
            outcome = "ok"
            yield self._done(call, t0, construct_ms, tps)
        except HearthNetError as e:
            yield ErrorFrame.of(e)
        except Exception:  # a bug: a typed ending for the caller, the traceback in our log
            log.exception("chat_failed", model=entry.model_id,
                          tokens=len(gen.tokens) if gen is not None else 0)
            err = InternalError("internal error in the distributed chat on this node; "
                                "see its log")
            yield ErrorFrame.of(err)
        finally:
            self.metrics.chats_total.labels(outcome).inc()
            if call is not None:
                await self._close(call)
            if spec is not None:
                self._count(entry, spec)
                spec.close()

    async def _head(self, entry: ModelEntry) -> _Prepared:
        """The model's head, sanity checker and calibration — all three, or a typed error.

        Nothing half-built is kept: a head or calibration that fails is remembered as the
        error (logged once, here) and every call of that model gets it, typed.
        """
        key = entry.head_key()
        async with self._head_lock:
            if key in self._unusable:
                raise self._unusable[key]
            if key not in self._prepared:
                self._forget_replaced(key)
                try:
                    self._prepared[key] = await self._prepare(entry)
                except HearthNetError as e:
                    self._unusable[key] = e
                    log.error("model_unusable", model=entry.alias, code=e.code,
                              message=e.message)
                    raise
        return self._prepared[key]

    def _forget_replaced(self, key: HeadKey) -> None:
        """Drop what was kept for an earlier version of `key`'s alias (re-imported, or its
        template fixed in place): no call asks for it again, and a 7B head is GBs. Calls
        under way keep their own reference."""
        for kept in (self._prepared, self._unusable, self._locals, self._local_locks,
                     self._drafts):
            for k in [k for k in kept if k[0] == key[0] and k != key]:
                del kept[k]

    async def _prepare(self, entry: ModelEntry) -> _Prepared:
        loop = asyncio.get_running_loop()
        what = "head"
        try:
            compile_dir = compile_dir_of(entry) if self.compile_head else None
            head = await loop.run_in_executor(
                self.executor, lambda: LayeredHead(entry, self.local_weights, self.head_device,
                                                   compile_dir=compile_dir))
            what = "calibration"
            cal = await loop.run_in_executor(self.executor, calibrate, entry.path,
                                             self.head_device)
        except HearthNetError:
            raise
        except Exception as e:  # a foreign failure of transformers/torch, named
            raise ModelUnusable(f"model {entry.alias} ({entry.model_type}) cannot be used: "
                                f"its {what} failed: {type(e).__name__}: {e}",
                                model=entry.alias, stage=what) from e
        return _Prepared(head, SanityChecker(cal.bounds), cal)

    async def _speculator(self, entry: ModelEntry, head: ClientHead, gen: Generation,
                          params: DistributedChatParams) -> Speculator | None:
        """The call's proposer (DESIGN.md decision 16), or None for ``speculate = "off"``.

        Raises:
            BadRequest: ``draft`` for a model with no draft model configured, or whose draft's
                tokenizer differs — before any work.
        """
        max_k = self.speculate_max_tokens
        if params.speculate == "off":
            return None
        if params.speculate == "lookup":
            return Speculator("lookup", LookupProposer(), max_k)
        draft = await self._draft(entry, head)
        max_len = len(gen.prompt_ids) + params.sampling.max_tokens + 1
        loop = asyncio.get_running_loop()
        proposer = await loop.run_in_executor(self.executor, DraftProposer, draft, max_len)
        return Speculator("draft", proposer, max_k, heavy=True)

    def _count(self, entry: ModelEntry, spec: Speculator) -> None:
        st = spec.stats
        per = self.speculation.setdefault(entry.alias, {}).setdefault(
            st.mode, {"passes": 0, "proposed": 0, "accepted": 0})
        per["passes"] += st.passes
        per["proposed"] += st.proposed
        per["accepted"] += st.accepted
        m = self.metrics
        m.speculative_proposed_total.labels(entry.alias, st.mode).inc(st.proposed)
        m.speculative_accepted_total.labels(entry.alias, st.mode).inc(st.accepted)
        m.speculative_passes_total.labels(entry.alias, st.mode).inc(st.passes)

    async def _draft(self, entry: ModelEntry, head: ClientHead) -> LocalEngine:
        """The draft model's engine of `entry` (its `draft_models` alias), loaded once."""
        name = self.draft_models.get(entry.alias) or self.draft_models.get(entry.model_id)
        if name is None:
            raise BadRequest(f"speculate = draft: no draft model is configured for "
                             f"{entry.alias} on this node ([research.distributed_inference."
                             f"draft_models]); use lookup or off", model=entry.alias,
                             param="speculate")
        draft_entry = self.models.get(name)  # ModelNotFound names it
        key = draft_entry.head_key()
        async with self._draft_lock:
            if key not in self._drafts:
                loop = asyncio.get_running_loop()
                self._drafts[key] = await loop.run_in_executor(
                    self.executor, lambda: LocalEngine(
                        draft_entry, self.local_weights, head_weights=self.local_weights,
                        device=self.head_device, limits=self.limits))
        engine = self._drafts[key]
        check_draft_tokenizer(head.tokenizer, engine.head.tokenizer, entry.alias,
                              draft_entry.alias)
        return engine

    async def _construct(self, entry: ModelEntry, gen: Generation,
                         params: DistributedChatParams, wire: WirePlan) -> CallState:
        """`_construct_now`, after the call being constructed (or waiting to be) whose
        prompt this one's shares the most first tokens with, where that is worth it
        (`worth_waiting_for`): chats that start together with one system prompt or
        document open after the first, and copy its positions once it has computed them
        (`_prefix_source`) instead of all computing them; a chat that repeats another's
        prompt copies all of it from that one. The first sends those positions as a chunk
        of their own (`CallState.share_at`, the shortest shared length of the calls
        waiting for it) and the rest of its prompt right behind; each of the others sends
        its own positions as soon as its stages hold the copy, so the stages compute the
        prompts' own positions while the later stages still compute earlier ones
        (`DecodeLoop.relay_chunked`)."""
        if not self.prefix_sharing:
            return await self._construct_now(entry, gen, params, wire)
        ids, weights = gen.prompt_ids, entry.weights_sha256

        def share(other: list[int]) -> int:  # the last of `ids` is always computed
            return min(shared_prefix(other, ids), len(ids) - 1)

        # the call to wait for: of those being constructed or waiting to be, the one whose
        # prompt shares the most first tokens with this one's, where it is worth it — not
        # where a running call shares as many (`_prefix_source` finds that one). Calls
        # that wait are listed too, so of eight chats that start together with four
        # prompts (or one document and its questions) each copies from the one that
        # shares most with it, not all from the first; a call waits only for one listed
        # before it, so no two wait for each other
        live = max((share(c.gen.prompt_ids) for c in self._live.values()
                    if c.pipeline.weights_sha256 == weights
                    and worth_waiting_for(c.gen.prompt_ids, ids)), default=0)
        source = max((o for o in self._constructing.values()
                      if o.weights == weights and worth_waiting_for(o.ids, ids)
                      and share(o.ids) > live), key=lambda o: share(o.ids), default=None)
        mine = _Opening(weights, ids)
        self._constructing[id(mine)] = mine
        try:
            if source is not None:
                source.shares.append(share(source.ids))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(source.done.wait(), params.timeout_s)
            call = await self._construct_now(entry, gen, params, wire)
            if copies_exactly(call.pipeline.stages):
                call.share_at = min(mine.shares, default=0)
            return call
        finally:
            del self._constructing[id(mine)]
            mine.done.set()

    async def _construct_now(self, entry: ModelEntry, gen: Generation,
                             params: DistributedChatParams, wire: WirePlan) -> CallState:
        """Pick a pipeline and open every stage concurrently (M26 §4.3 steps 1-2).

        A shard that cannot be reached or refuses the open is excluded and the router picks
        again, up to `_OPEN_ATTEMPTS` failures. A shard at its `max_concurrent_streams`
        (M26 §5.6) is busy, not gone: another cover is tried first, and when
        only busy shards cover a layer the call waits for a slot — until one of this node's
        pipelines is released, or a short back-off for other callers' sessions — up to its
        `timeout_s`, instead of continuing on the local engine.
        """
        max_len = len(gen.prompt_ids) + params.sampling.max_tokens + 1
        exclude: set[str] = set()
        busy: set[str] = set()
        reasons: list[str] = []
        formats = self._formats(entry, params)
        slot = self.router.busy_wait(params.timeout_s)
        failures = 0
        while failures < _OPEN_ATTEMPTS:
            releases = self.router.releases
            try:
                pipeline = await self.router.pick(entry.model_id, entry.weights_sha256,
                                                  entry.num_layers, exclude=exclude | busy,
                                                  formats=formats)
            except ShardUnavailable as e:
                if not (busy or e.details.get("busy")) or not await slot.wait(releases):
                    if reasons:  # why the shards it excluded were refused, not only "excluded"
                        raise ShardUnavailable(f"{e.message}; refused on open: "
                                               + "; ".join(reasons[-3:]), **e.details) from e
                    raise
                busy.clear()  # busy a moment ago: worth another try
                continue
            if len(pipeline.stages) > params.max_shards:
                self.router.release(pipeline)
                raise ShardUnavailable(f"the cover needs {len(pipeline.stages)} shards; "
                                       f"max_shards is {params.max_shards}")
            lane = self.lanes.take(len(pipeline.stages))
            try:
                source = await self._prefix_source(pipeline.stages, gen, params, wire)
                opened = await asyncio.gather(
                    *(self._open(s, entry, params, max_len, wire, lane,
                                 fork=(source[0].stages[k].ref, source[1]) if source else None)
                      for k, s in enumerate(pipeline.stages)), return_exceptions=True)
            except BaseException:  # cancelled while opening: the lane was never used
                self.lanes.drop(lane)
                raise
            stages = [o for o in opened if isinstance(o, StageSession)]
            if len(stages) == len(opened):
                call = CallState(pipeline, stages, gen, params, max_len, wire, formats,
                                 lossless=lossless_of(entry), lane=lane)
                call.prefix = call.held = self._take_prefix(call, source)
                self._live[id(call)] = call
                return call
            self.lanes.drop(lane)
            for st in stages:
                with contextlib.suppress(Exception):
                    await st.channel.close()
            self.router.release(pipeline)
            failed = False
            for stage, o in zip(pipeline.stages, opened, strict=True):
                if isinstance(o, BaseException) and not isinstance(o, HearthNetError):
                    raise o
                if isinstance(o, HearthNetError):
                    reasons.append(o.message)
                    refused = busy if o.details.get("busy") else exclude
                    refused.add(stage.shard.shard_id)
                    failed = failed or refused is exclude
            failures += failed
        raise ShardUnavailable(f"could not open sessions in {_OPEN_ATTEMPTS} attempts: "
                               + "; ".join(reasons[-3:]))

    async def _prefix_source(self, stages: list[PipelineStage], gen: Generation,
                             params: DistributedChatParams, plan: WirePlan
                             ) -> tuple[CallState, int] | None:
        """The running call a new call through `stages` takes its prompt's first positions
        from, and how many (`prefix_source`): one still sending its prompt is waited for
        while its prompt moves (`CallState.prefix_wait`: until the call's `timeout_s` passes
        with no step of it). None where prefix sharing is off or no call fits."""
        if not self.prefix_sharing or not self._live or not copies_exactly(stages):
            return None
        route = [(s.shard.shard_id, s.start, s.end, plan.for_stage(s.start, s.end))
                 for s in stages]
        found = prefix_source(self._live.values(), route, gen.prompt_ids)
        if found is None or found[0].held >= found[1]:
            return found
        src = found[0]
        await src.prefix_wait(found[1], params.timeout_s)  # as long as its prompt moves
        # it may have ended, failed over, or hold fewer positions (its shared part)
        n = min(found[1], src.held)
        if id(src) not in self._live or src.route != route or n < PREFIX_MIN_TOKENS:
            return None
        return src, n

    def _take_prefix(self, call: CallState, source: tuple[CallState, int] | None) -> int:
        """How many first prompt positions every stage of `call` copied from `source` (the
        fewest any stage's ACCEPT states; 0 without a source). Each stage's record of
        inputs starts with the source's for those positions, so a failover replays them
        into a replacement as if this call had sent them."""
        if source is None:
            return 0
        src, _ = source
        n = min(int(st.channel.accepted.get("forked") or 0) for st in call.stages)
        if n <= 0 or id(src) not in self._live or src.route != call.route:
            return 0
        taken = [inputs_before(s.history, n) for s in src.stages]
        if any(sum(int(h.shape[1]) for h in hs) < n for hs in taken):
            return 0  # the source's record is shorter: send every position (a redo)
        for st, hs in zip(call.stages, taken, strict=True):
            st.history = hs
        return n

    async def _open(self, stage: PipelineStage, entry: ModelEntry,
                    params: DistributedChatParams, max_len: int, plan: WirePlan, lane: int = 0,
                    fork: tuple[str, int] | None = None) -> StageSession:
        wire = plan.for_stage(stage.start, stage.end)
        ref = secrets.token_hex(8)
        open_params: dict[str, Any] = {
            "shard_id": stage.shard.shard_id, "model_id": entry.model_id,
            "weights_sha256": entry.weights_sha256, "start": stage.start, "end": stage.end,
            "max_length": max_len, "wire_dtype": wire, "lane": lane, "ref": ref}
        if fork is not None:
            open_params["fork"] = {"ref": fork[0], "positions": fork[1]}
        p = self.sign_open(open_params)
        uri = stage.shard.endpoint.rstrip("/") + SHARD_PATH
        try:
            ch = await self.connect(uri, p, params.timeout_s)
        except HearthNetError as e:
            if not isinstance(e, ShardUnavailable):  # busy is healthy; unreachable is not
                self.health.mark_suspect(stage.shard.shard_id, e.code)
            raise ShardUnavailable(f"could not open a session on {stage.shard.shard_id}: "
                                   f"{e.message}", shard_id=stage.shard.shard_id,
                                   busy=bool(e.details.get("busy"))) from e
        sid = stage.shard.shard_id
        try:
            fmt, kernel = self._check_accept(stage, entry, params, ch.accepted)
        except HearthNetError:
            with contextlib.suppress(Exception):
                await ch.close()
            raise
        return StageSession(stage, ch, wire, self.metrics.shard_latency_ms.labels(sid),
                            self.metrics.hop_overhead_ms.labels(sid), weights_format=fmt,
                            kernel=kernel, ref=ref)

    def _check_accept(self, stage: PipelineStage, entry: ModelEntry,
                      params: DistributedChatParams, accepted: dict[str, Any]
                      ) -> tuple[str, str]:
        """The shard's ACCEPT against the call: (its held format, kernel), or a typed error.

        The router picked the shard by its advertisement, which may be stale (a host
        restarted with another format while its gossip link was down); the ACCEPT is what
        the shard holds now, so a call is never served by a format it does not accept and
        never reports the advertised one. A format the call refuses is `shard_unavailable`
        (the router remembers it and picks another); other weights or another range than
        asked for is `weights_mismatch`.
        """
        sid = stage.shard.shard_id
        fmt = accepted.get("weights_format")
        if not isinstance(fmt, str):
            raise ShardUnavailable(f"{sid} did not state its weight format on accept",
                                   shard_id=sid)
        self.router.note_accept(stage.shard, fmt)
        sha = accepted.get("weights_sha256", entry.weights_sha256)
        rng = accepted.get("layers", [stage.start, stage.end])
        if sha != entry.weights_sha256 or list(rng) != [stage.start, stage.end]:
            raise WeightsMismatch(f"{sid} accepted a session of weights {str(sha)[:16]}… "
                                  f"layers {rng}; the call asked for "
                                  f"{entry.weights_sha256[:16]}… layers "
                                  f"[{stage.start}, {stage.end}]", shard_id=sid)
        allowed = self._formats(entry, params)
        if fmt not in allowed:
            raise ShardUnavailable(
                f"{sid} holds {fmt} weights now (advertised {stage.shard.weights_format}); "
                f"the call accepts {', '.join(sorted(allowed))} (params.weights)",
                shard_id=sid)
        return fmt, str(accepted.get("kernel") or "")

    def _formats(self, entry: ModelEntry, params: DistributedChatParams) -> frozenset[str]:
        """The held formats a call of `entry` with `params` accepts."""
        return formats_for(params.weights, self.local_weights, entry)

    # ---- giving up (M26 §5.4) ----

    async def _give_up(self, entry: ModelEntry, gen: Generation, params: DistributedChatParams,
                       reason: str, t0: float, first_ms: float | None,
                       code: str = "shard_unavailable", spec: Speculator | None = None
                       ) -> AsyncIterator[StreamFrame]:
        """The pipeline cannot go on: continue locally, or abort (M26 §5.4)."""
        if params.fallback_to_local and code != "weights_mismatch":
            why_not = self._why_not_local(entry)
            if why_not is None:
                async for f in self._continue_locally(entry, gen, reason, t0, first_ms, spec):
                    yield f
                return
            reason = f"{reason}; {why_not}"
        yield PipelineAborted(reason, None, len(gen.tokens))
        yield ErrorFrame(code, reason)

    def _why_not_local(self, entry: ModelEntry) -> str | None:
        """Why this node cannot continue an answer on its own engine, or None (M26 §5.4's
        fallback needs the whole model: a household's model is one no machine holds)."""
        if entry.head_key() in self._locals:
            return None
        if entry.partial:
            return (f"this node holds only layers {entry.held_layers} of {entry.alias}, so "
                    f"it cannot continue the answer alone")
        if self.local_budget_mb:
            need = layer_weight_bytes(entry, 0, entry.num_layers - 1,
                                      resolve_format(self.local_weights, entry.dtype))
            if need > self.local_budget_mb * 2**20:
                return (f"continuing alone needs all of {entry.alias}'s layers, "
                        f"{need / 2**20:.0f} MiB as {self.local_weights}, over this node's "
                        f"budget of {self.local_budget_mb} MiB")
        return None

    async def _continue_locally(self, entry: ModelEntry, gen: Generation, reason: str,
                                t0: float, first_ms: float | None,
                                spec: Speculator | None = None) -> AsyncIterator[StreamFrame]:
        """Continue `gen` on the local engine (M26 §5.4 fallback), not restarted."""
        yield PipelineAborted(reason, "local", len(gen.tokens))
        self.metrics.fallback_to_local_total.inc()
        engine = await self._local(entry)
        loop = asyncio.get_running_loop()
        timings = LocalTimings()  # this call's own: concurrent fallbacks share the engine
        it = engine.steps(gen, timings, spec)
        end = object()
        try:
            while True:  # one executor job per prefill chunk or token: others interleave
                ev = await loop.run_in_executor(self.executor, next, it, end)
                if ev is end:
                    break
                if not isinstance(ev, TokenEvent):  # None: a prefill chunk, no token yet
                    continue
                if first_ms is None:
                    first_ms = (time.perf_counter() - t0) * 1000
                    self.metrics.first_token_ms.observe(first_ms)
                self.metrics.tokens_generated_total.inc()
                yield token_frame(ev)
        finally:
            await loop.run_in_executor(self.executor, it.close)  # frees the local KV cache
        self.metrics.tokens_per_second.observe(timings.decode_tokens_per_s)
        yield done_frame(gen, t0=t0, first_ms=first_ms or 0.0,
                         tokens_per_s=timings.decode_tokens_per_s, pipeline=["local"],
                         formats=call_formats(engine.head.format, [engine.stack.format], [],
                                              None, lossless_of(entry)),
                         fallback=True, speculative=spec.stats if spec else None)

    async def _local(self, entry: ModelEntry) -> LocalEngine:
        """The one local engine of `entry`, built by the first caller: calls falling back
        at once wait for it (each building its own held the whole model once per call —
        eight chats falling back together OOM-killed a 1.5B orchestrator)."""
        key = entry.head_key()
        async with self._local_locks.setdefault(key, asyncio.Lock()):
            if key not in self._locals:
                head = (await self._head(entry)).head
                loop = asyncio.get_running_loop()
                self._locals[key] = await loop.run_in_executor(
                    self.executor, lambda: LocalEngine(
                        entry, self.local_weights, head=head, limits=self.limits,
                        prefill_chunk_tokens=self.prefill_chunk_tokens))
        return self._locals[key]

    # ---- endings ----

    def _done(self, call: CallState, t0: float, construct_ms: float, tps: float) -> Done:
        per_shard = {}
        for st in call.stages:
            xs, ov = st.rtt_ms, st.overhead_ms
            if xs.count:
                per_shard[st.shard_id] = {
                    "layers": [st.stage.start, st.stage.end], "steps": xs.count,
                    "weights_format": st.weights_format, "kernel": st.kernel,
                    "p50_ms": round(xs.percentile(50), 3),
                    "p95_ms": round(xs.percentile(95), 3),
                    "overhead_p50_ms": round(ov.percentile(50), 3),
                    "overhead_p95_ms": round(ov.percentile(95), 3),
                    "wire_dtype": st.wire}
        return done_frame(call.gen, t0=t0, first_ms=call.first_ms or 0.0, tokens_per_s=tps,
                          pipeline=[s.shard_id for s in call.stages],
                          formats=call_formats(
                              self._own_format(call),
                              [s.weights_format for s in call.stages],
                              [s.wire for s in call.stages], call.params.weights,
                              call.lossless),
                          timings={"construction_ms": round(construct_ms, 1),
                                   "failover_ms": [round(x, 1) for x in call.failover_ms],
                                   "per_shard": per_shard},
                          failovers=len(call.failover_ms),
                          speculative=call.speculator.stats if call.speculator else None,
                          cached_prompt_tokens=call.prefix)

    def _own_format(self, call: CallState) -> str:
        # a head's format follows from its weights' dtype alone: any head of them says it
        w = call.pipeline.weights_sha256
        return next((p.head.format for k, p in self._prepared.items() if k[1] == w),
                    self.local_weights)

    async def _close(self, call: CallState) -> None:
        self._live.pop(id(call), None)
        call.end_prefix()  # a call waiting to copy its prompt goes on without it
        self.router.release(call.pipeline)
        self.lanes.give(call)
        for st in call.stages:
            with contextlib.suppress(Exception):
                await st.channel.close()


