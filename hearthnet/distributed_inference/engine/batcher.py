"""`RoundBatcher`: steps of concurrent sessions run as one executor job per round (M26 §5.3).

Decode is bound by reading the weights, so B one-position steps cost about one when they run
as one forward (M26 §5.3's pipelining, measured in `hearthnet bench pipeline`). A shard
(`ShardServer`) and an orchestrator's head (`DecodeLoop.head_batcher`) each own one
`RoundBatcher`:

- every caller `submit`s one job and awaits its own result; a session has at most one job
  queued (it waits for its step before sending the next), so each round holds at most one
  step per session and the queue is served first in, first out — nobody starves;
- a round takes every queued batchable job (a decode step) as one batch; jobs arriving
  while a round runs make the next round. With ``window_s`` > 0 a round first waits for
  the steps of the other sessions expected — the open ones (`expected()`) that stepped in
  the last `LIVE_ROUNDS` rounds — and starts at once when every one of them has a job
  queued (a lone session never waits). Otherwise it waits ``window_s``, or, when fewer
  rows are queued than are missing, longer where a missing session's pace says its next
  job is due: until then (plus a tenth of its cycle), at most one of its cycles and at
  most 1.5 cycles of the queued sessions (their median). Concurrent chats that drifted
  apart in a pipeline (one group at this shard while another is at the next stage or the
  head) so merge into one batch — the wait costs the waiting group the offset once, the
  merge saves a forward per round for good; a fixed short window leaves them in 2-4
  groups that each re-read the weights (measured, docs/operations.md). A session that is
  late against its pace is not waited for beyond ``window_s``, and one that stops
  stepping (stalled caller) is not expected after `LIVE_ROUNDS` rounds. Measured on the
  1.5B shape at 8 chats (docs/benchmarks.md), each limit for a reason:
  - a pace is the time between a session's consecutive *decode* steps: a prefill chunk
    starts it afresh — from a prompt's chunk to its first decode step other prompts'
    prefills run, and rounds held that long for a session not yet back stalled every
    chat at once (1.8-2.0 s);
  - 1.5 of the queued sessions' cycles: decode steps taken while other prompts prefill
    are seconds apart too, and a smoothed pace remembers them for a few steps (a 5.6 s
    hold at the head with 2,000-token prompts);
  - only the smaller group waits: seven chats held once for one that drifted cost seven
    gaps of a round — more than the 5 % of gaps that an inter-token p95 at 8 chats with
    16-token answers lets pass — where the one waiting for the seven costs one; and two
    groups of one size go on apart (they held each other at different stages until
    their due times passed, 0.3-0.8 s a round; apart, one computes at shard 0 while the
    other is at shard 1, as lanes do);
  - only where the owner merges groups (`pace_holds`, a shard's batcher): an
    orchestrator's head waits the window alone. Its rows come from the last stage in
    the groups the shards formed, so a hold there added a second wait to each merge the
    shards make — with 110-token prompts seven of eight chats shared one gap of ~0.4 s
    that way (inter-token p95 1.7-2.4x a lone chat's, against 1.3-1.8x without;
    docs/benchmarks.md);
- non-batchable jobs (prefill chunks, each ``tokens`` positions) join the round (mixed
  rounds, as vLLM's and Sarathi's chunked prefill): oldest first, as many as fit in
  ``mixed_budget`` positions beside decode rows, ``prefill_budget`` in a round without
  any (at least one chunk per round), in the same ``run_batch`` call as the decode rows,
  so the owner can run them as one forward (the shard packs them,
  `LayeredStack.forward_packed`): while other chats prefill, a decoding chat's round costs
  about one forward, not two, and a long prefill (already chunked) never
  stalls decode rows for more than one chunk;
- ``on_progress`` is called after every round that ran, and every `HOLD_BEAT_S` while a
  round is held for the expected sessions' steps: the owner tells the callers still
  waiting that their steps are queued behind work that goes on (a shard's progress PINGs,
  docs/protocol.md §3.6a) — a round held for a slow session's pace can outlast a step's
  deadline on a busy machine — which a stuck forward never does (no round runs, and none
  is being collected);
- the owner's ``run_batch(jobs)`` returns one result or exception per job, so a bad row
  fails only its own caller (shard/server.py and head batching decide how rows fail);
- a session that stalls, errs or disconnects simply has no job in the next round; a caller
  cancelled while its job is running waits for the job to end first (its cache is still
  being written) and is then cancelled.

The batcher's task runs only while jobs are queued, so an idle shard holds no task.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from hearthnet.observability import get_logger

log = get_logger("batcher")

J = TypeVar("J")
R = TypeVar("R")

LIVE_ROUNDS = 4
"""A session that queued a job during the last this many batch rounds is waited for."""

PACE_SLACK = 0.1
"""A session due by its pace is waited for this fraction of its cycle beyond its due time:
one that misses its round waits a whole round more (a doubled gap between its tokens)."""

MAX_LANES = 8
"""Micro-batch lanes a session may name: an orchestrator uses one per stage of its
pipeline, and each lane's steps make their own rounds (`ShardServer.lane_batcher`)."""

PRESENT_CYCLES = 1.5
"""A round waits for a missing session at most this many cycles of the queued sessions."""

HOLD_BEAT_S = 0.5
"""While a round is held for expected sessions' steps, `on_progress` is called this often."""

HOLD_LOG_S = 0.25
"""A round held this long or longer for expected sessions' steps is logged (``round_held``:
how long, how many rows were queued and expected) — a gap in every batched chat's tokens."""

RunBatch = Callable[[Sequence[Any]], list[Any]]
"""(jobs) -> one result or exception per job, in order; runs on the executor."""


@dataclass
class _Queued(Generic[J]):
    job: J
    future: asyncio.Future[Any]
    key: Hashable
    tokens: int = 1
    queued_at: float = 0.0  # on the batcher's clock
    running: bool = False


class RoundBatcher(Generic[J, R]):
    """Runs submitted jobs in rounds on `executor`; see the module docstring.

    `clock` (seconds, monotonic) times every decision — sessions' pace, a round's deadline,
    the waits reported to `on_batch` — so tests move time instead of sleeping; the wait
    itself is woken by arrivals and `expected_changed`, which re-read it.
    """

    def __init__(self, run_batch: RunBatch, executor: Executor, *, window_s: float = 0.0,
                 expected: Callable[[], int] = lambda: 1, prefill_budget: int = 0,
                 mixed_budget: int | None = None,
                 on_batch: Callable[[int, list[float]], None] | None = None,
                 on_progress: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 pace_holds: bool = True) -> None:
        self.run_batch, self.executor, self.clock = run_batch, executor, clock
        self.window_s = max(0.0, window_s)
        self.pace_holds = pace_holds  # wait beyond the window for sessions due by their pace
        # positions of prefill chunks per round: without / beside decode rows
        self.prefill_budget = prefill_budget
        self.mixed_budget = prefill_budget if mixed_budget is None else mixed_budget
        self.expected = expected
        self.on_batch = on_batch  # (batch size, each job's wait in ms) for the metrics
        self.on_progress = on_progress  # the work goes on (module docstring)
        self._batch: deque[_Queued[J]] = deque()
        self._solo: deque[_Queued[J]] = deque()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._round = 0
        self._seen: dict[Hashable, int] = {}  # session -> the last round it queued a job in
        self._pace: dict[Hashable, tuple[float, float | None]] = {}  # (last job at, cycle)
        self.waited_out = 0  # rounds that started at the window's end, someone missing

    @property
    def queued(self) -> int:
        return len(self._batch) + len(self._solo)

    def decoding_besides(self, key: Hashable, *, counted: bool = True) -> bool:
        """Whether sessions other than `key` step decode rows here: open ones (`expected`,
        which counts `key` where `counted`) that queued a decode step lately (a pace) — a
        prefill of `key` then shares the compute with their rounds."""
        others = sum(1 for k in self._pace if k != key)
        return min(others, self.expected() - counted) > 0

    def expected_changed(self, ended: Hashable = None) -> None:
        """A session ended (or began): a round waiting for its step re-checks `expected`;
        the session `ended`, if named, is no longer waited for nor counted as decoding."""
        if ended is not None:
            self._seen.pop(ended, None)
            self._pace.pop(ended, None)
        self._arrived.set()

    async def submit(self, job: J, *, batchable: bool = True, key: Hashable = None,
                     tokens: int = 1) -> R:
        """Queue `job` of session `key` (a prefill chunk of `tokens` positions when not
        `batchable`) for the next round and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        item: _Queued[J] = _Queued(job, loop.create_future(), key, tokens, self.clock())
        if key is None:
            item.key = key = id(item)
        self._seen[key] = self._round
        if batchable:
            self._keep_pace(key, item.queued_at)
        else:  # a prefill chunk: the time since its last job was not a decode step's cycle
            self._pace.pop(key, None)
        (self._batch if batchable else self._solo).append(item)
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._rounds())
        try:
            result: R = await asyncio.shield(item.future)
            return result
        except asyncio.CancelledError:
            self._seen.pop(key, None)  # its caller is gone: not waited for any more
            self._pace.pop(key, None)
            self._arrived.set()
            if item.running:  # its rows are being computed: let the round finish first
                await asyncio.wait([item.future])
            if item.future.done() and not item.future.cancelled():
                item.future.exception()  # retrieved: nobody else will
            item.future.cancel()
            raise

    async def _rounds(self) -> None:
        while self._batch or self._solo:
            await self._collect()
            batch = self._take(self._batch, len(self._batch))
            budget = self.mixed_budget if batch else self.prefill_budget
            await self._run(batch, self._take(self._solo, budget, by_tokens=True))
            if batch:
                self._round += 1  # decode rounds only: prefill chunks make no one stale
                self._seen = {k: r for k, r in self._seen.items()
                              if self._round - r <= LIVE_ROUNDS}
                self._pace = {k: v for k, v in self._pace.items() if k in self._seen}

    def _keep_pace(self, key: Hashable, now: float) -> None:
        """Track the time between a session's jobs (smoothed)."""
        last = self._pace.get(key)
        cycle = None if last is None else now - last[0]
        if last is not None and last[1] is not None and cycle is not None:
            cycle = 0.5 * last[1] + 0.5 * cycle
        self._pace[key] = (now, cycle)

    def _deadline(self, start: float) -> float:
        """When to stop waiting: `window_s` after `start`, or when the last missing
        session is due by its pace (plus `PACE_SLACK` of its cycle, at least `window_s`),
        at most one of its cycles — and at most `PRESENT_CYCLES` cycles of the queued
        sessions (their median), where known: a session in step with them is due within
        one of their cycles; one whose own cycle is longer is not in step (its last cycles
        spanned other prompts' prefills, which a smoothed pace remembers for a few
        steps). Without `pace_holds` (a head), the window alone."""
        deadline = start + self.window_s
        if not self.pace_holds:
            return deadline
        queued = {i.key for i in self._batch} | {i.key for i in self._solo}
        due = [(last + cycle, cycle) for k in self._seen if k not in queued
               for last, cycle in [self._pace.get(k, (0.0, None))] if cycle is not None]
        missing = self._expecting() - len(queued)
        if due and len(queued) < missing:  # the smaller group waits for the larger one
            # (a tenth of a cycle of slack: a step due "now" may be a little late)
            latest = max(d + max(self.window_s, PACE_SLACK * c) for d, c in due)
            longest = max(c for _, c in due)
            present = sorted(c for k in queued
                             for _, c in [self._pace.get(k, (0.0, None))] if c is not None)
            if present:  # half a cycle more: a queued session's last cycle was its early one
                longest = min(longest, max(self.window_s,
                                           PRESENT_CYCLES * present[len(present) // 2]))
            deadline = max(deadline, min(latest, start + longest))
        return deadline

    async def _collect(self) -> None:
        """Wait for the expected sessions' steps (see the module docstring); not at all once
        every one has a job queued (a session in prefill has its next chunk queued)."""
        if not self._batch or self.window_s <= 0:
            return
        start = self.clock()
        while self.queued < self._expecting():
            left = self._deadline(start) - self.clock()
            if left <= 0:
                self.waited_out += 1
                self._log_hold(start, "the expected steps' due time passed")
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(min(left, HOLD_BEAT_S)):
                    await self._arrived.wait()
            except TimeoutError:  # the round is still held: its callers are not stalled
                if self.on_progress is not None:
                    self.on_progress()
        self._log_hold(start, "every expected step arrived")

    def _expecting(self) -> int:
        """How many sessions' jobs a round waits for: the open ones that stepped lately."""
        return min(self.expected(), len(self._seen))

    def _log_hold(self, start: float, end: str) -> None:
        held = self.clock() - start
        if held >= HOLD_LOG_S:
            log.info("round_held", held_ms=round(held * 1000, 1), queued=self.queued,
                     expected=self._expecting(), ended=end)

    @staticmethod
    def _take(queue: deque[_Queued[J]], limit: int, *, by_tokens: bool = False
              ) -> list[_Queued[J]]:
        """Live jobs, oldest first, up to `limit` jobs (or `limit` positions, `by_tokens`;
        at least one job); a cancelled caller's job is dropped."""
        out: list[_Queued[J]] = []
        used = 0
        while queue:
            item = queue[0]
            cost = item.tokens if by_tokens else 1
            if out and used + cost > limit and not item.future.done():
                break
            queue.popleft()
            if not item.future.done():
                item.running = True
                out.append(item)
                used += cost
        return out

    async def _run(self, batch: list[_Queued[J]], chunks: list[_Queued[J]]) -> None:
        """One round: the decode rows `batch` and prefill `chunks` in one executor job."""
        items = batch + chunks
        if not items:
            return
        now = self.clock()
        if batch and self.on_batch is not None:  # decode rows, not prefill chunks
            self.on_batch(len(batch), [(now - i.queued_at) * 1000 for i in batch])
        jobs = [i.job for i in items]
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.run_batch, jobs)
        except asyncio.CancelledError:  # the loop is shutting down: release every waiter,
            for item in items:  # which would otherwise wait for a round that never reports
                item.future.cancel()
            raise
        except Exception as e:  # run_batch reports rows itself; this is a last resort
            results = [e] * len(items)
        for item, res in zip(items, results, strict=True):
            if item.future.done():
                continue
            if isinstance(res, BaseException):
                item.future.set_exception(res)
            else:
                item.future.set_result(res)
        if self.on_progress is not None:
            self.on_progress()
