"""The decode loop of a distributed chat (M26 §4.3 step 3; DESIGN.md "Hot path rules").

Per step: embed → relay the hidden state through each stage → norm and lm_head → sample.
The norm + lm_head of concurrent chats on one orchestrator run as one batched product per
round and micro-batch lane (`RoundBatcher`, `Lanes`, DESIGN.md decision 12): each call submits
its last hidden state and gets its own logits back.
The orchestrator relays between stages (DESIGN.md decision 1) and records every stage's
input (`StageSession.history`) so that `Failover` can replay it into a replacement; a stage
failure inside a step is handed to `Failover.replace` and the step is redone from the
replaced stage.

Per-token path (DESIGN.md hot path rules): a step's input is converted to the first stage's
wire dtype once (`embed_for_wire`; the prompt's on the executor), so the transport sends it as is;
each stage's histograms are bound once per session (`StageSession`), and a stage's step
runs under one deadline (`Channel.step`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor

import torch

from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.engine.base import ClientHead
from hearthnet.distributed_inference.engine.batcher import RoundBatcher
from hearthnet.distributed_inference.orchestrator.calls import CallState, StageFailed
from hearthnet.distributed_inference.orchestrator.failover import Failover
from hearthnet.distributed_inference.orchestrator.frames import token_frame
from hearthnet.distributed_inference.orchestrator.sanity import SanityChecker
from hearthnet.errors import HearthNetError, PipelineStalled, StreamStalled, WireOverflow
from hearthnet.frames import StreamFrame
from hearthnet.observability import Metrics
from hearthnet.transport.codec import cast_to_wire


class DecodeLoop:
    """Drives one call's `Generation` through its stages, token by token."""

    def __init__(self, *, metrics: Metrics, health: ShardHealthTracker, failover: Failover,
                 executor: Executor, prefill_chunk_tokens: int = 256,
                 batch_window_ms: float = 2.0) -> None:
        self.metrics, self.health, self.failover = metrics, health, failover
        self.executor = executor
        self.prefill_chunk_tokens = max(1, prefill_chunk_tokens)
        self.batch_window_s = max(0.0, batch_window_ms) / 1000
        # calls in their decode loop, per micro-batch lane: the head rows a lane's round expects
        self.running: Counter[int] = Counter()
        self._heads: weakref.WeakKeyDictionary[
            ClientHead, dict[int, RoundBatcher[tuple[torch.Tensor, bool], torch.Tensor]]] = \
            weakref.WeakKeyDictionary()

    def head_batcher(self, head: ClientHead, lane: int = 0
                     ) -> RoundBatcher[tuple[torch.Tensor, bool], torch.Tensor]:
        """The batcher of `head`'s norm + lm_head for one lane (one per loaded head and
        lane, as the stages keep theirs): each call submits the rows it needs logits of,
        (1, T, H), and whether their argmax alone will do (`Generation.argmax_only`), and
        gets (T, vocab) logits back, or (T,) token ids."""
        lanes = self._heads.setdefault(head, {})
        batcher = lanes.get(lane)
        if batcher is None:
            def run(jobs: Sequence[tuple[torch.Tensor, bool]]) -> list[torch.Tensor]:
                return head.logits_rows([h for h, _ in jobs], [p for _, p in jobs])

            batcher = RoundBatcher(run, self.executor, window_s=self.batch_window_s,
                                   expected=lambda: self.running[lane], on_batch=self._observe,
                                   pace_holds=False)
            lanes[lane] = batcher
        return batcher

    def _observe(self, size: int, waits_ms: list[float]) -> None:
        self.metrics.head_batch_size.observe(size)
        for w in waits_ms:
            self.metrics.head_batch_wait_ms.observe(w)

    async def run(self, call: CallState, head: ClientHead, checker: SanityChecker,
                  t0: float) -> AsyncIterator[StreamFrame]:
        """Stream the call's token frames (and diagnostics) until the generation ends.

        Sets `call.first_ms` and `call.decode_t0`. Raises `FellBack` when the pipeline
        cannot go on; frames raised before that stay in `call.frames`.
        """
        self.running[call.lane] += 1
        try:
            async for f in self._run(call, head, checker, t0):
                yield f
        finally:
            self.running[call.lane] -= 1
            for lanes in self._heads.values():  # a round waiting for this call goes on
                if (batcher := lanes.get(call.lane)) is not None:
                    batcher.expected_changed(id(call))

    async def _run(self, call: CallState, head: ClientHead, checker: SanityChecker,
                   t0: float) -> AsyncIterator[StreamFrame]:
        gen = call.gen
        heads = self.head_batcher(head, call.lane)
        loop = asyncio.get_running_loop()
        # the prompt's embeddings and their one cast to the first stage's wire dtype run off
        # the loop: a long prompt is thousands of rows. The stages hold the first
        # `call.prefix` positions already (copied from another call's sessions)
        pos, proposed = call.prefix, list[int]()
        x = await loop.run_in_executor(self.executor, embed_for_wire, head,
                                       gen.prompt_ids[pos:], call.stages[0].channel.wire_dtype)
        # others wait to copy the prompt's first `share_at` positions: they go as a chunk of
        # their own, held for copying once every stage has passed them, and the rest flows
        # right behind (a stage does not idle while the next computes the shared part)
        cut = call.share_at if pos < call.share_at < len(gen.prompt_ids) else 0
        spec = call.speculator
        prompt = True
        while not gen.done:
            h = await self.relay_chunked(call, x, pos, checker, cut)
            cut = 0
            if prompt:  # every stage holds the prompt: others may copy it
                call.hold(len(gen.prompt_ids))
            for f in call.take_frames():
                yield f
            # norm + lm_head (~7 ms for SmolLM2) run off the loop, batched with the other
            # calls' heads of this round (DESIGN.md decision 12): the last row, or every row
            # of a speculative pass (DESIGN.md decision 16)
            rows = await heads.submit((h[:, -(len(proposed) + 1):], gen.argmax_only),
                                      key=id(call))
            events = spec.accept(gen, rows, proposed) if spec is not None and not prompt \
                else [gen.step(rows[-1])]
            prompt = False
            if call.first_ms is None:
                call.first_ms = (time.perf_counter() - t0) * 1000
                self.metrics.first_token_ms.observe(call.first_ms)
                call.decode_t0 = time.perf_counter()
            self.metrics.tokens_generated_total.inc(len(events))
            for ev in events:
                yield token_frame(ev)
            # the next pass starts after the tokens taken; the stages cut their caches back
            # there (rejected proposals), and a replay never sees a rejected proposal
            pos = len(gen.all_ids) - 1
            if proposed:
                for st in call.stages:
                    st.truncate(pos)
            if spec is None or gen.done:
                proposed = []
            elif spec.heavy:  # a draft model's steps: off the loop
                proposed = await loop.run_in_executor(self.executor, spec.propose, gen)
            else:
                proposed = spec.propose(gen)
            # a few rows, looked up and cast once here: cheaper than an executor hop
            x = embed_for_wire(head, [gen.tokens[-1], *proposed],
                               call.stages[0].channel.wire_dtype)

    async def relay_chunked(self, call: CallState, x: torch.Tensor, pos: int,
                            checker: SanityChecker, cut: int = 0) -> torch.Tensor:
        """`relay` a long prefill in chunks of `prefill_chunk_tokens` positions: each chunk
        is its own step, so other calls' steps interleave. Through several stages the
        chunks flow (M26 §5.3): stage 0 starts on chunk i+1 as soon as it has passed chunk i
        on, so the stages compute at once (`_flow`). With `cut` (a position inside the
        prefill) a chunk ends there, and `call.hold(cut)` as soon as every stage has
        passed it. When a stage fails meanwhile, the prefill goes on one chunk at a time
        from the last position every stage holds, where failover works as for any step."""
        n = self.prefill_chunk_tokens
        t = int(x.shape[1])
        first = cut - pos if pos < cut < pos + t else 0
        sizes = [min(n, end - at) for lo, end in ((0, first), (first, t))
                 for at in range(lo, end, n)]
        if len(sizes) > 1 and len(call.stages) > 1:
            done = await self._flow(call, x, pos, checker, sizes,
                                    (-(-first // n) - 1, lambda: call.hold(cut)) if first
                                    else None)
            if isinstance(done, torch.Tensor):
                return done
            for st in call.stages:  # rejoin at a position every stage holds
                st.truncate(done)
            x, t, pos = x[:, done - pos:], t - (done - pos), done
        elif first:  # one stage: the shared positions, then the rest
            await self.relay_chunked(call, x[:, :first], pos, checker)
            call.hold(cut)
            x, t, pos = x[:, first:], t - first, cut
        for at in range(0, t - n, n):  # every chunk but the last
            await self.relay(call, x[:, at:at + n], pos + at, checker)
        last = ((t - 1) // n) * n
        return await self.relay(call, x[:, last:], pos + last, checker)

    async def _flow(self, call: CallState, x: torch.Tensor, pos: int,
                    checker: SanityChecker, sizes: list[int],
                    passed: tuple[int, Callable[[], None]] | None = None
                    ) -> torch.Tensor | int:
        """The chunks of `x` (of `sizes` positions) through every stage, each stage a task
        taking its chunks in order from the one before; with `passed` (i, f), f() once the
        last stage has passed chunk i. The last stage's output of the last chunk, or — when
        a stage failed — the position up to which every stage has taken every chunk."""
        starts = [0, *itertools.accumulate(sizes[:-1])]
        chunks = [(pos + at, x[:, at:at + size]) for at, size in zip(starts, sizes, strict=True)]
        step0 = call.step
        call.step += len(chunks)
        stages = list(call.stages)
        queues: list[asyncio.Queue[torch.Tensor | None]] = [asyncio.Queue() for _ in stages]
        for _, c in chunks:
            queues[0].put_nowait(c)
        taken = [0] * len(stages)
        out: list[torch.Tensor] = []
        failed = False

        async def run(k: int) -> None:
            nonlocal failed
            for i, (at, _) in enumerate(chunks):
                inp = await queues[k].get()
                if inp is None or failed:
                    return
                try:
                    h = await self.one(call, k, inp, at, checker, step0 + i + 1)
                except StageFailed:
                    # the others finish the step they are in (a step abandoned mid-flight
                    # would leave its answer in the stream) and take no more
                    failed = True
                    for q in queues:
                        q.put_nowait(None)
                    raise
                taken[k] += 1
                if k + 1 < len(stages):
                    queues[k + 1].put_nowait(h)
                    continue
                out.append(h)
                if passed is not None and i == passed[0]:
                    passed[1]()

        results = await asyncio.gather(*(run(k) for k in range(len(stages))),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, StageFailed):
                raise r
        if failed:
            return min(pos + sum(int(c.shape[1]) for _, c in chunks[:k]) for k in taken)
        return out[-1]

    async def relay(self, call: CallState, x: torch.Tensor, pos: int,
                    checker: SanityChecker) -> torch.Tensor:
        """One step through every stage, failing over as needed; returns the last output."""
        k = 0
        call.step += 1
        while True:
            try:
                return await self.through(call, x, pos, k, checker)
            except StageFailed as f:
                if isinstance(f.cause, WireOverflow):  # the wire, not the shard: widen it
                    k, x = await self.failover.widen(call, f, pos)
                else:
                    k, x = await self.failover.replace(call, f, pos)

    async def through(self, call: CallState, x: torch.Tensor, pos: int, k0: int,
                      checker: SanityChecker) -> torch.Tensor:
        """Stages `k0..` in order; raises `StageFailed` for the first that fails."""
        for k in range(k0, len(call.stages)):
            x = await self.one(call, k, x, pos, checker, call.step)
        return x

    async def one(self, call: CallState, k: int, x: torch.Tensor, pos: int,
                  checker: SanityChecker, step: int) -> torch.Tensor:
        """Stage `k`'s step on `x` at `pos`: checked, recorded for replay and measured;
        raises `StageFailed`."""
        st = call.stages[k]
        t = time.perf_counter()
        try:
            res = await st.channel.step(step, pos, x, call.params.timeout_s)
            # a wrong shape or dtype is corruption too (M26 §5.8): failover
            checker.check(st.shard_id, st.stage.end, res.tensor, shape=x.shape,
                          dtype=st.channel.wire_dtype)
        except StreamStalled as e:  # the transport's stall is the pipeline's (M26 §6)
            raise StageFailed(k, PipelineStalled(f"{st.shard_id}: {e.message}"), x) from e
        except HearthNetError as e:
            raise StageFailed(k, e, x) from e
        rtt = (time.perf_counter() - t) * 1000
        st.history.append(x)
        overhead = rtt - res.compute_us / 1000
        st.rtt_ms.add(rtt)
        st.overhead_ms.add(overhead)
        st.latency.observe(rtt)
        st.overhead.observe(overhead)
        self.health.observe_latency(st.shard_id, rtt)
        return res.tensor


def embed_for_wire(head: ClientHead, token_ids: list[int], wire: torch.dtype) -> torch.Tensor:
    """The embeddings of `token_ids` on the host, converted once to the first stage's wire
    dtype (run on the executor). Left unconverted when the cast overflows: sending it then
    reports the `WireOverflow` for that stage, which widens it."""
    x = head.embed_host(token_ids)
    try:
        return cast_to_wire(x, wire)
    except WireOverflow:
        return x

