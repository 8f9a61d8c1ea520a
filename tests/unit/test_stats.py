"""One percentile convention (nearest rank, q in 0..100) and bounded latency windows
(issue 10 §5, §8)."""

from __future__ import annotations

from hearthnet.stats import LatencyWindow, median, percentile


def test_percentile_is_the_nearest_rank_and_always_a_measured_value() -> None:
    assert percentile([5.0], 95) == 5.0
    assert percentile([float(x) for x in range(1, 21)], 95) == 19.0
    assert percentile([float(x) for x in range(100)], 95) == 94.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 100) == 2.0 and percentile([1.0, 2.0], 0) == 1.0
    assert percentile([], 95) == 0.0


def test_median_is_the_50th_percentile() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.0  # a measured value, not 2.5
    assert median([]) == 0.0


def test_a_latency_window_keeps_the_last_samples_and_counts_all() -> None:
    w = LatencyWindow(4)
    for x in range(10):
        w.add(float(x))
    assert len(w) == 4 and w.count == 10 and w.last == 9.0
    assert w.percentile(50) == 7.0 and w.percentile(100) == 9.0  # of 6, 7, 8, 9 only
    assert LatencyWindow().percentile(95) == 0.0
