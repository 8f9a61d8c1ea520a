"""`Lanes`: an orchestrator's concurrent chats spread over one micro-batch lane per stage."""

from __future__ import annotations

from typing import Any

from hearthnet.distributed_inference.engine.batcher import MAX_LANES
from hearthnet.distributed_inference.orchestrator.calls import Lanes


class _Call:
    """The two fields `Lanes.give` reads and writes of a `CallState`."""

    def __init__(self, lane: int) -> None:
        self.lane, self.lane_held = lane, True


def _start(lanes: Lanes, stages: int) -> Any:
    return _Call(lanes.take(stages))


def test_chats_fill_the_emptiest_lane_of_as_many_as_the_pipeline_has_stages():
    lanes = Lanes()
    calls = [_start(lanes, 2) for _ in range(5)]
    assert [c.lane for c in calls] == [0, 1, 0, 1, 0]
    lanes.give(calls[1])  # lane 1 now holds one chat, lane 0 three: the next goes to 1
    assert lanes.take(2) == 1
    assert lanes.take(1) == 0  # one stage: one lane, every chat batched together


def test_chats_starting_together_get_different_lanes_before_any_opens():
    """Lanes are counted when taken, not when the stages have opened: eight chats that
    start at once would otherwise all see lane 0 empty."""
    lanes = Lanes()
    taken = [lanes.take(2) for _ in range(8)]
    assert sorted(taken) == [0, 0, 0, 0, 1, 1, 1, 1]
    lanes.drop(taken[0])  # a call whose stages could not be opened gives its lane back
    assert lanes.calls[0] == 3


def test_a_call_closed_twice_frees_its_lane_once():
    lanes = Lanes()
    a, b = _start(lanes, 2), _start(lanes, 2)
    lanes.give(a)
    lanes.give(a)
    assert lanes.calls[a.lane] == 0 and lanes.calls[b.lane] == 1


def test_the_configured_count_overrides_the_stages_and_the_cap_holds():
    one = Lanes(fixed=1)
    assert {one.take(3) for _ in range(3)} == {0}
    many = Lanes()
    picked = [_start(many, 20).lane for _ in range(2 * MAX_LANES)]
    assert set(picked) == set(range(MAX_LANES))
