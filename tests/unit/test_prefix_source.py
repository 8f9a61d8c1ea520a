"""Which running call a new call copies its prompt's first positions from (`prefix_source`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from hearthnet.distributed_inference.orchestrator.calls import (
    PREFIX_MIN_TOKENS,
    inputs_before,
    prefix_source,
    shared_prefix,
    worth_waiting_for,
)

ROUTE = [("shard-b", 0, 14, "fp16"), ("shard-c", 15, 29, "fp16")]


def _call(ids: list[int], held: bool | int = True, route: list[Any] = ROUTE) -> Any:
    """A running call: `held` True holds its whole prompt, False none yet (still sending
    it), an int that many positions (its shared part, sent first)."""
    event = asyncio.Event()  # set once the call holds its whole prompt (or ended)
    if held is True:
        event.set()
    n = len(ids) if held is True else int(held)
    return SimpleNamespace(route=route, gen=SimpleNamespace(prompt_ids=ids), held=n,
                           prefix_ready=event)


def test_shared_prefix():
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([], [1]) == 0
    assert shared_prefix([1, 2], [1, 2]) == 2


def test_the_longest_shared_prefix_through_the_same_route_wins():
    ids = list(range(100))
    near = _call(list(range(60)) + [-1] * 40)
    nearer = _call([*range(80), -1])
    elsewhere = _call(list(range(100)), route=[("shard-d", 0, 29, "fp16")])
    other_wire = _call(list(range(100)), route=[(*ROUTE[0][:3], "fp32"), ROUTE[1]])
    assert prefix_source([near, nearer, elsewhere, other_wire], ROUTE, ids) == (nearer, 80)


def test_the_last_prompt_token_is_always_computed():
    ids = list(range(40))
    same = _call(list(ids))
    assert prefix_source([same], ROUTE, ids) == (same, 39)


def test_too_short_a_shared_prefix_is_not_copied():
    ids = list(range(50))
    assert prefix_source([_call([*range(PREFIX_MIN_TOKENS - 1), -1])], ROUTE, ids) is None
    assert prefix_source([], ROUTE, ids) is None


def test_a_call_still_sending_its_prompt_is_waited_for_only_when_worth_it():
    ids = list(range(40))
    # shares 30 of 40 and is no longer than twice: worth waiting for, beats a held shorter one
    busy = _call(list(range(30)) + [-1] * 10, held=False)
    held = _call([*range(20), -1])
    assert prefix_source([busy, held], ROUTE, ids) == (busy, 30)
    # shares 18 of 40 (under half): the held call's 20 instead
    shy = _call([*range(18), -1], held=False)
    assert prefix_source([shy, held], ROUTE, ids) == (held, 20)
    # a long prompt still computing: not worth waiting for a preamble of it
    long = _call(list(range(30)) + [-1] * 100, held=False)
    assert prefix_source([long], ROUTE, ids) is None
    assert not worth_waiting_for(long.gen.prompt_ids, ids)
    assert worth_waiting_for(busy.gen.prompt_ids, ids)


def test_a_call_still_sending_its_prompt_is_waited_for_the_rest_of_the_share():
    ids = list(range(40))
    # sent its first 24 positions as a step of their own (others wait for them) and still
    # sends the rest: worth waiting for all 35 shared positions, not only the 24 it holds
    first = _call(list(range(35)) + [-1] * 5, held=24)
    assert prefix_source([first], ROUTE, ids) == (first, 35)
    # a long prompt still computing is not worth waiting for: what it holds already
    long = _call(list(range(35)) + [-1] * 60, held=24)
    assert prefix_source([long], ROUTE, ids) == (long, 24)
    assert prefix_source([_call(list(range(35)) + [-1] * 60, held=10)], ROUTE, ids) is None


def test_inputs_before_cuts_the_record_at_a_position():
    import torch

    hist = [torch.zeros(1, 5, 2), torch.ones(1, 3, 2), torch.full((1, 4, 2), 2.0)]
    cut = inputs_before(hist, 7)
    assert [h.shape[1] for h in cut] == [5, 2]
    assert inputs_before(hist, 0) == []
    assert sum(h.shape[1] for h in inputs_before(hist, 100)) == 12



class _Moving:
    """A stage's channel whose shard PINGs progress as often as it is asked, `moves` times
    (a source whose long prompt is still going on: the waiter reads the count once per
    `idle_s`); then, with `then_hold`, the source holds its shared part."""

    def __init__(self, call: Any, moves: int, then_hold: bool) -> None:
        self.call, self.moves, self.then_hold, self.reads = call, moves, then_hold, 0

    @property
    def progress_pings(self) -> int:
        self.reads += 1
        if self.reads > self.moves and self.then_hold:
            self.call.hold(24)
        return min(self.reads, self.moves)


def _source(moves: int, then_hold: bool) -> tuple[Any, _Moving]:
    from hearthnet.distributed_inference.orchestrator.calls import CallState

    gen = SimpleNamespace(prompt_ids=list(range(40)))
    call = CallState(None, [], gen, None, 0, None)  # type: ignore[arg-type]
    channel = _Moving(call, moves, then_hold)
    call.stages = [SimpleNamespace(history=[], channel=channel)]  # type: ignore[list-item]
    return call, channel


async def test_a_copy_waits_for_a_source_whose_prompt_moves_longer_than_one_timeout():
    """A call copying another's prompt start waits for it as long as that prompt moves (a
    long document on a slow machine: many steps, each within its deadline) — not one
    timeout in all, after which it would compute the whole prompt itself beside it."""
    src, channel = _source(moves=5, then_hold=True)
    await asyncio.wait_for(src.prefix_wait(24, 0.01), 10)
    assert src.held == 24 and not src.prefix_ready.is_set()  # 24 held, the rest to come
    assert channel.reads > 5  # it waited through several idle periods, each with progress


async def test_a_copy_stops_waiting_for_a_source_that_does_not_move():
    src, channel = _source(moves=0, then_hold=False)
    await asyncio.wait_for(src.prefix_wait(24, 0.01), 10)
    assert not src.prefix_ready.is_set()  # gave up after one idle period: the call goes on
    assert channel.reads == 2  # the mark before and after that one period
    # a step any stage takes counts as a move, as a PING does
    before = src.progress_mark()
    src.stages[0].history.append(None)
    assert src.progress_mark() != before


async def test_a_copy_waits_until_its_source_holds_all_it_shares():
    """A source that holds its shared part (24) and still sends the rest of its prompt is
    waited for until it holds what the copy shares with it (39); one that ends meanwhile
    lets the copy go on at once."""
    src, _ = _source(moves=0, then_hold=False)
    waiter = asyncio.create_task(src.prefix_wait(39, 60))
    for _ in range(5):
        await asyncio.sleep(0)
    src.hold(24)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiter.done()  # 24 of its 39: it waits on
    src.hold(40)
    await asyncio.wait_for(waiter, 5)
    assert src.prefix_ready.is_set()  # the whole prompt: it will hold no more
    ended, _ = _source(moves=0, then_hold=False)
    waiter = asyncio.create_task(ended.prefix_wait(39, 60))
    for _ in range(5):
        await asyncio.sleep(0)
    ended.end_prefix()
    await asyncio.wait_for(waiter, 5)
    assert ended.held == 0
