"""Automatic placement rules (issue 17): coverage, window choice, sizing, rebalance."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.placement.planner import (
    HostCapacity,
    Span,
    best_start,
    budget_layers,
    coverage,
    gap_lengths,
    measure_speed,
    plan_move,
    split_lengths,
)


def test_coverage_weights_each_host_by_its_throughput() -> None:
    cov = coverage(6, [Span("a", 0, 2, 3.0), Span("b", 2, 5, 8.0)])
    assert cov == [1.0, 1.0, 3.0, 2.0, 2.0, 2.0]


def test_best_start_fills_the_uncovered_layers_first() -> None:
    cov = coverage(30, [Span("a", 0, 14, 15.0)])
    assert best_start(cov, 8) == 15
    assert best_start(cov, 20) == 10  # covers all 15 uncovered layers
    assert best_start([0.0] * 10, 4) == 0  # ties: lowest start, the same on every node


def test_best_start_raises_the_weakest_layers() -> None:
    cov = [3.0, 3.0, 1.0, 2.0, 1.0, 5.0]
    assert best_start(cov, 3) == 2  # window [1, 2, 1] beats [3, 1, 2] and [2, 1, 5]
    with pytest.raises(ValueError):
        best_start(cov, 7)


def test_budget_layers() -> None:
    assert budget_layers(100, 30, 30) == 3
    assert budget_layers(10_000, 30, 30) == 30
    assert budget_layers(10, 30, 30) == 0


def test_split_is_proportional_to_speed() -> None:
    hosts = [HostCapacity("a", 2.0, 30), HostCapacity("b", 1.0, 30), HostCapacity("c", 1.0, 30)]
    assert split_lengths(30, hosts) == {"a": 15, "b": 8, "c": 7}
    assert split_lengths(30, [HostCapacity("a", 5.0, 30)]) == {"a": 30}


def test_split_caps_by_budget_and_gives_the_rest_to_hosts_with_room() -> None:
    hosts = [HostCapacity("fast", 10.0, 6), HostCapacity("b", 1.0, 30),
             HostCapacity("c", 1.0, 30)]
    lengths = split_lengths(30, hosts)
    assert lengths == {"fast": 6, "b": 12, "c": 12}
    assert sum(lengths.values()) == 30
    short = split_lengths(30, [HostCapacity("a", 1.0, 5), HostCapacity("b", 1.0, 5)])
    assert short == {"a": 5, "b": 5}  # the budgets cannot hold the model: all at cap


def test_greedy_placement_of_the_split_tiles_the_model() -> None:
    hosts = [HostCapacity("a", 2.0, 30), HostCapacity("b", 1.0, 30), HostCapacity("c", 1.0, 30)]
    lengths = split_lengths(30, hosts)
    spans: list[Span] = []
    for h in ("c", "a", "b"):  # any arrival order
        lo = best_start(coverage(30, spans), lengths[h])
        spans.append(Span(h, lo, lo + lengths[h] - 1, 1.0))
    assert gap_lengths(coverage(30, spans)) == []


def test_gap_lengths() -> None:
    assert gap_lengths([1.0, 0.0, 0.0, 2.0, 0.0]) == [(1, 2), (4, 4)]


def test_plan_move_raises_the_weakest_coverage() -> None:
    a, b, c = Span("a", 0, 14, 1.0), Span("b", 15, 29, 1.0), Span("c", 0, 14, 3.0)
    move = plan_move(30, [a, b, c], a, 0.75)  # a moving to 15-29 doubles the minimum
    assert move is not None and (move.new_lo, move.new_hi) == (15, 29)
    assert move.quality == pytest.approx(0.5)
    assert plan_move(30, [a, b, c], c, 0.75) is None  # c moving leaves 0-14 weaker
    assert plan_move(30, [a, b, c], b, 0.75) is None  # b is the only host of 15-29


def test_plan_move_respects_the_margin() -> None:
    a, b, c = Span("a", 0, 14, 1.0), Span("b", 15, 29, 1.0), Span("c", 0, 14, 1.4)
    # a moving: min goes from 1/15 to 1.4/15 -> quality 0.71
    move = plan_move(30, [a, b, c], a, 0.75)
    assert move is not None and (move.new_lo, move.new_hi) == (15, 29)  # beside b
    assert move.min_after == pytest.approx(1.4 / 15)
    assert plan_move(30, [a, b, c], a, 0.6) is None


def test_plan_move_never_opens_a_gap() -> None:
    a, b = Span("a", 0, 14, 1.0), Span("b", 10, 29, 1.0)
    assert plan_move(30, [a, b], a, 0.99) is None  # its layers 0-9 have no other host


def test_plan_move_fills_an_uncovered_range_when_its_old_one_stays_covered() -> None:
    a, c = Span("a", 0, 14, 1.0), Span("c", 0, 14, 1.0)  # 15-29 lost its host
    move = plan_move(30, [a, c], c, 0.75)
    assert move is not None and (move.new_lo, move.new_hi) == (15, 29)
    assert move.min_before == 0.0


def test_measure_speed_is_positive_and_finite() -> None:
    s = measure_speed(4096 * 12, 64, dtype=torch.float32, repeats=2)
    assert 0 < s < float("inf")
