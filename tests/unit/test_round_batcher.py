"""`RoundBatcher` (issue 16 §1-2): rounds, fairness, prefill interleaving, per-row results.

A fake `run_batch` records each executor job. Time is a `FakeClock` the tests move (a
waiting round re-reads it when woken by `expected_changed`); no test sleeps, and the real
waits a round may make are bounded by windows far beyond any test's run time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.batcher import LIVE_ROUNDS, RoundBatcher
from tests.helpers.waiting import wait_until


class Recorder:
    """run_batch: answers job * 10; a job named in `fail` gets its own exception."""

    def __init__(self, fail: set[Any] | None = None) -> None:
        self.rounds: list[list[Any]] = []
        self.fail = fail or set()

    def __call__(self, jobs: Sequence[Any]) -> list[Any]:
        self.rounds.append(list(jobs))
        return [ValueError(f"row {j}") if j in self.fail else j * 10 for j in jobs]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1) as p:
        yield p


class FakeClock:
    """The batcher's clock, in seconds; only the test moves it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def settle() -> None:
    """Let the rounds task run up to its next wait."""
    for _ in range(10):
        await asyncio.sleep(0)


async def tick(b: RoundBatcher[Any, Any], clock: FakeClock, to: float) -> None:
    """Move the clock to `to` and wake a waiting round so that it re-reads it."""
    clock.t = to
    b.expected_changed()
    await settle()


async def _three_in_step(b: RoundBatcher[int, int], clock: FakeClock) -> None:
    """Sessions a, b and c step together at 1000 and 1100: a pace of 100 s each."""
    for t in (0.0, 100.0):
        clock.t = 1000.0 + t
        await asyncio.wait_for(asyncio.gather(*(b.submit(1, key=k) for k in "abc")), 20)


async def test_concurrent_steps_form_one_batch_and_each_gets_its_row(pool):
    rec = Recorder()
    sizes: list[int] = []
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 4,
                                             on_batch=lambda n, waits: sizes.append(n))
    # the round starts when the 4 expected steps are in, not when the window ends
    got = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), 20)
    assert got == [0, 10, 20, 30]
    assert rec.rounds == [[0, 1, 2, 3]] and sizes == [4]


async def test_a_lone_session_never_waits_for_the_window(pool):
    rec = Recorder()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=60.0, expected=lambda: 1)
    assert await asyncio.wait_for(b.submit(7), 20) == 70


async def test_a_stalled_session_does_not_hold_the_round_beyond_the_window(pool):
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    # three sessions step together (no wait: all are in), then c goes silent
    assert await asyncio.wait_for(asyncio.gather(
        *(b.submit(i, key=k) for i, k in ((1, "a"), (2, "b"), (3, "c")))), 20) == [10, 20, 30]
    both = asyncio.gather(b.submit(4, key="a"), b.submit(5, key="b"))
    await settle()
    assert b.queued == 2  # the round waits for c ...
    await tick(b, clock, 1029.9)
    assert b.queued == 2 and b.waited_out == 0  # ... the whole window ...
    await tick(b, clock, 1030.1)
    assert await asyncio.wait_for(both, 20) == [40, 50]  # ... and not a moment longer
    assert rec.rounds == [[1, 2, 3], [4, 5]] and b.waited_out == 1


async def test_a_session_due_by_its_pace_is_waited_for_beyond_the_window(pool):
    """Three chats stepping every 100 s; b arrives 50 s early (drifted) while a and c are
    not back: the round (one row, two missing) waits for them until their due time plus a
    tenth of a cycle (230), past the 30 s window (180), so the three merge again."""
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    await _three_in_step(b, clock)  # one job each every 100 s, the last at 1100
    clock.t = 1150.0
    early = asyncio.ensure_future(b.submit(3, key="b"))
    await settle()
    await tick(b, clock, 1185.0)  # past the window: a and c are due at 1200, still waiting
    assert b.queued == 1 and b.waited_out == 0
    clock.t = 1199.0
    got = await asyncio.wait_for(asyncio.gather(early, b.submit(4, key="a"),
                                                b.submit(5, key="c")), 20)
    assert got == [30, 40, 50] and rec.rounds[-1] == [3, 4, 5] and b.waited_out == 0

async def test_a_pace_counts_decode_steps_only(pool):
    """The time from a session's prefill chunk to its next step is no decode cycle (other
    prompts' prefills ran between): after a's and c's chunks long ago and one decode step,
    their pace is unknown, so b's round waits the window for them, not the chunk-to-step
    time."""
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    chunks = (b.submit(100, batchable=False, tokens=4, key="a"),
              b.submit(200, batchable=False, tokens=4, key="c"))
    assert await asyncio.wait_for(asyncio.gather(*chunks), 20) == [1000, 2000]
    clock.t = 1900.0  # a's and c's first decode steps, 900 s after their chunks (beside b's)
    await asyncio.wait_for(asyncio.gather(*(b.submit(1, key=k) for k in "abc")), 20)
    clock.t = 1950.0
    early = asyncio.ensure_future(b.submit(3, key="b"))
    await settle()
    await tick(b, clock, 1981.0)  # past the window: a's and c's pace unknown, b goes alone
    assert await asyncio.wait_for(early, 20) == 30
    assert rec.rounds[-1] == [3] and b.waited_out == 1

async def test_a_session_out_of_step_is_waited_for_about_a_cycle_of_the_others(pool):
    """c's and d's pace says one step every 600 s (their steps were slow while other
    prompts prefilled); a steps every 100 s. A round of a, early at 1850 (cycle now 75 s),
    waits for them at most 1.5 of a's cycles (until 1962.5), not until their due time
    (2200)."""
    rec, clock = Recorder(), FakeClock()
    n = {"expected": 2}
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, clock=clock,
                                             expected=lambda: n["expected"])
    await asyncio.wait_for(asyncio.gather(b.submit(1, key="c"), b.submit(1, key="d")), 20)
    n["expected"] = 3
    clock.t = 1600.0
    await asyncio.wait_for(asyncio.gather(*(b.submit(1, key=k) for k in "acd")), 20)
    n["expected"] = 1  # c and d are away for a while: a steps on
    for t in (1700.0, 1800.0):
        clock.t = t
        await asyncio.wait_for(b.submit(1, key="a"), 20)
    n["expected"] = 3
    clock.t = 1850.0
    early = asyncio.ensure_future(b.submit(2, key="a"))
    await settle()
    await tick(b, clock, 1960.0)  # within 1.5 of a's cycles: still waiting for c and d
    assert b.queued == 1 and b.waited_out == 0
    await tick(b, clock, 1963.0)
    assert await asyncio.wait_for(early, 20) == 20
    assert rec.rounds[-1] == [2] and b.waited_out == 1

async def test_two_groups_of_one_size_go_on_apart(pool):
    """a and b step every 100 s; b arrives 50 s early: one row queued, one missing — they
    go on apart (each would wait for the other at a different stage of a pipeline)."""
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 2,
                                             clock=clock)
    for t in (0.0, 100.0):
        clock.t = 1000.0 + t
        await asyncio.wait_for(asyncio.gather(b.submit(1, key="a"), b.submit(2, key="b")), 20)
    clock.t = 1150.0
    early = asyncio.ensure_future(b.submit(3, key="b"))
    await settle()
    await tick(b, clock, 1181.0)  # the window only, though a is due at 1200
    assert await asyncio.wait_for(early, 20) == 30 and rec.rounds[-1] == [3]


async def test_of_two_groups_the_smaller_waits_for_the_larger(pool):
    """a, b and c step every 100 s. b and c arrive 50 s early (drifted): the two of them go
    at once rather than wait for a (the smaller group waits, not the larger); a, arriving
    alone at its due time, waits for them (they are due) and the three merge again."""
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    await _three_in_step(b, clock)
    clock.t = 1150.0
    pair = asyncio.ensure_future(asyncio.gather(b.submit(2, key="b"), b.submit(3, key="c")))
    await settle()
    await tick(b, clock, 1181.0)  # the window: a is due at 1200, but two wait for no one
    assert await asyncio.wait_for(pair, 20) == [20, 30] and rec.rounds[-1] == [2, 3]
    clock.t = 1200.0
    alone = asyncio.ensure_future(b.submit(4, key="a"))
    await settle()
    await tick(b, clock, 1240.0)  # past the window: b and c are due at 1225 (+ slack)
    assert b.queued == 1
    clock.t = 1241.0
    got = await asyncio.wait_for(asyncio.gather(alone, b.submit(5, key="b"),
                                                b.submit(6, key="c")), 20)
    assert got == [40, 50, 60] and rec.rounds[-1] == [4, 5, 6]


async def test_a_session_late_against_its_pace_is_not_waited_for_longer(pool):
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    await _three_in_step(b, clock)
    clock.t = 1150.0
    early = asyncio.ensure_future(b.submit(3, key="b"))
    await settle()
    await tick(b, clock, 1229.0)
    assert b.queued == 1
    await tick(b, clock, 1231.0)  # a and c are a tenth of their cycle overdue: b goes alone
    assert await asyncio.wait_for(early, 20) == 30
    assert rec.rounds[-1] == [3] and b.waited_out == 1

async def test_a_failing_row_fails_only_its_caller(pool):
    rec = Recorder(fail={2})
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, expected=lambda: 3)
    got = await asyncio.gather(*(b.submit(i) for i in (1, 2, 3)), return_exceptions=True)
    assert rec.rounds == [[1, 2, 3]]  # one batch, not three solo rounds
    assert got[0] == 10 and got[2] == 30
    assert isinstance(got[1], ValueError) and str(got[1]) == "row 2"


async def test_prefill_chunks_join_the_decode_rows_round(pool):
    """Mixed rounds: a prefill chunk runs in the same `run_batch` call as the round's
    decode rows (the owner packs them into one forward), one chunk per round when the
    budget holds one."""
    rec = Recorder()
    sizes: list[int] = []
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, expected=lambda: 2,
                                             on_batch=lambda n, waits: sizes.append(n))

    async def prefill() -> list[int]:  # a 3-chunk prefill: one chunk at a time
        return [await b.submit(100 + c, batchable=False, tokens=4) for c in range(3)]

    async def decode(first: int) -> list[int]:
        return [await b.submit(first + 2 * t) for t in range(3)]

    out = await asyncio.gather(prefill(), decode(0), decode(1))
    assert out == [[1000, 1010, 1020], [0, 20, 40], [10, 30, 50]]
    chunks = [i for i, r in enumerate(rec.rounds) if any(j >= 100 for j in r)]
    assert len(chunks) == 3 and all(sum(j >= 100 for j in rec.rounds[i]) == 1 for i in chunks)
    # the chunks ride with decode rows: the first round holds both decode rows and a chunk
    assert sorted(rec.rounds[0]) == [0, 1, 100]
    assert max(sizes) == 2 and len(rec.rounds) == 3  # decode rows only in the metric


@pytest.mark.parametrize(("budget", "rounds"), [(8, [[100, 200]]), (5, [[100], [200]]),
                                                (2, [[100], [200]])])
async def test_prefill_chunks_fill_the_budget_oldest_first(pool, budget, rounds):
    """Two 4-position chunks queued at once share a round when the budget holds both; a
    chunk larger than the budget still runs, alone."""
    rec = Recorder()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, prefill_budget=budget)
    got = await asyncio.gather(b.submit(100, batchable=False, tokens=4),
                               b.submit(200, batchable=False, tokens=4))
    assert got == [1000, 2000] and rec.rounds == rounds


async def test_beside_decode_rows_the_smaller_mixed_budget_holds(pool):
    """`mixed_budget` bounds the prefill positions of a round that has decode rows (their
    gap), `prefill_budget` one without: two queued 4-position chunks and one decode row
    make a round of the row and one chunk, then a round of the other chunk."""
    rec = Recorder()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, prefill_budget=8, mixed_budget=4)
    got = await asyncio.gather(b.submit(100, batchable=False, tokens=4),
                               b.submit(200, batchable=False, tokens=4), b.submit(1))
    assert got == [1000, 2000, 10] and rec.rounds == [[1, 100], [200]]


async def test_a_cancelled_caller_is_dropped_and_not_waited_for(pool):
    rec = Recorder()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3)
    # three sessions step together once, so each is expected in the next rounds
    assert await asyncio.wait_for(asyncio.gather(
        *(b.submit(i, key=k) for i, k in ((1, "a"), (2, "b"), (3, "c")))), 20) == [10, 20, 30]
    gone = asyncio.ensure_future(b.submit(5, key="c"))
    await asyncio.sleep(0)  # queued, the round waiting for a and b
    gone.cancel()
    # a and b go on at once: c's caller left, so the round does not wait for it
    got = await asyncio.wait_for(asyncio.gather(b.submit(6, key="a"), b.submit(7, key="b")), 20)
    assert got == [60, 70] and all(5 not in r for r in rec.rounds)
    with pytest.raises(asyncio.CancelledError):
        await gone


async def test_a_session_that_stops_stepping_is_not_waited_for_after_a_few_rounds(pool):
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock)
    await asyncio.wait_for(asyncio.gather(
        *(b.submit(i, key=k) for i, k in ((1, "a"), (2, "b"), (3, "c")))), 20)
    for t in range(3 * LIVE_ROUNDS):  # c stalls; a and b step on
        pair = asyncio.gather(b.submit(t, key="a"), b.submit(t, key="b"))
        await settle()
        if t < LIVE_ROUNDS:  # c stepped recently: the round waits the window out for it
            assert b.queued == 2, t
            await tick(b, clock, clock.t + 31.0)
        assert await asyncio.wait_for(pair, 20) == [10 * t, 10 * t]  # then at once
    assert b.waited_out == LIVE_ROUNDS


async def test_a_round_cancelled_at_shutdown_releases_its_cancelled_callers():
    """Loop shutdown cancels the rounds task and every caller while a forward still runs
    (a node stopping with a busy compute thread, issue 14 §1): no caller may keep waiting
    for a round that will never report."""
    started, release = threading.Event(), threading.Event()

    def busy(jobs: Sequence[Any]) -> list[Any]:
        started.set()
        release.wait(30)
        return list(jobs)

    with ThreadPoolExecutor(1) as ex:
        b: RoundBatcher[int, int] = RoundBatcher(busy, ex)
        caller = asyncio.create_task(b.submit(1))
        await asyncio.to_thread(started.wait, 10)  # the round's forward is running
        assert b._task is not None
        caller.cancel()
        b._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(caller, 5)  # before the fix: waited for the forward
        release.set()


async def test_every_round_that_ran_reports_progress_to_the_owner(pool):
    """`on_progress` follows each round (a shard's progress PINGs to the sessions still
    queued, docs/protocol.md §3.6a): two prefills of one chunk per round, so one of
    them always waits while the other's chunk runs."""
    rec = Recorder()
    waiting: list[int] = []
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, prefill_budget=4,
                                             on_progress=lambda: waiting.append(b.queued))

    async def prefill(first: int, chunks: int) -> list[int]:
        return [await b.submit(first + c, batchable=False, key=first, tokens=4)
                for c in range(chunks)]

    assert await asyncio.gather(prefill(100, 3), prefill(200, 2)) == [[1000, 1010, 1020],
                                                                      [2000, 2010]]
    assert len(waiting) == len(rec.rounds) == 5
    assert waiting[0] == 1  # after the first chunk ran, the other prefill still waited


async def test_a_round_held_for_a_session_reports_progress_while_it_waits(pool, monkeypatch):
    """A round held for an expected session's step (its window, or that session's pace)
    is the shard at work, not stalled: `on_progress` is called while it waits, so a busy
    shard's callers keep their steps (docs/protocol.md §3.6a)."""
    from hearthnet.distributed_inference.engine import batcher as batcher_mod

    monkeypatch.setattr(batcher_mod, "HOLD_BEAT_S", 0.01)
    rec, clock = Recorder(), FakeClock()
    beats: list[int] = []
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 2,
                                             clock=clock,
                                             on_progress=lambda: beats.append(b.queued))
    assert await asyncio.gather(b.submit(1, key="a"), b.submit(2, key="b")) == [10, 20]
    held = asyncio.ensure_future(b.submit(3, key="a"))  # b is expected: the round waits
    await wait_until(lambda: len(beats) >= 4, "progress while the round is held")
    assert not held.done() and rec.rounds == [[1, 2]] and set(beats[1:]) == {1}
    assert await asyncio.wait_for(asyncio.gather(held, b.submit(4, key="b")), 20) == [30, 40]
    assert rec.rounds == [[1, 2], [3, 4]]  # the held round took both


async def test_who_decodes_besides_a_session(pool):
    """`decoding_besides`: open sessions other than the asking one that step decode rows.
    A prefill chunk, a closed session (no longer `expected`) and the asker itself do not
    count; for a session of another lane (`counted=False`) every open decoder does."""
    open_ = {"n": 2}
    b: RoundBatcher[int, int] = RoundBatcher(Recorder(), pool, expected=lambda: open_["n"])
    await b.submit(1, key="a")
    await b.submit(2, key="a")
    assert b.decoding_besides("p") and not b.decoding_besides("a")
    await b.submit(3, key="p", batchable=False, tokens=4)  # p prefills: not decoding
    assert b.decoding_besides("p")
    assert b.decoding_besides("q", counted=False)  # q of another lane: a decodes here
    open_["n"] = 1  # a closed: only p is open
    b.expected_changed("a")
    assert not b.decoding_besides("p") and not b.decoding_besides("q", counted=False)


async def test_without_pace_holds_a_round_waits_the_window_only(pool):
    """An orchestrator's head (`pace_holds=False`): b arrives 50 s early while a and c are
    due at 1200 — the round goes at the window's end (1180), where a shard's batcher would
    wait for them (`test_a_session_due_by_its_pace_is_waited_for_beyond_the_window`)."""
    rec, clock = Recorder(), FakeClock()
    b: RoundBatcher[int, int] = RoundBatcher(rec, pool, window_s=30.0, expected=lambda: 3,
                                             clock=clock, pace_holds=False)
    await _three_in_step(b, clock)
    clock.t = 1150.0
    early = asyncio.ensure_future(b.submit(3, key="b"))
    await settle()
    await tick(b, clock, 1179.0)  # within the window: still waiting
    assert b.queued == 1 and not early.done()
    await tick(b, clock, 1181.0)
    assert await asyncio.wait_for(early, 20) == 30
    assert rec.rounds[-1] == [3] and b.waited_out == 1
