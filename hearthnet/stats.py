"""Percentiles: one implementation, one convention, for every figure HearthNet reports.

The convention is the *nearest rank* (the smallest sample with at least `q` % of the
samples at or below it), `q` in 0..100: the value returned is always one that was
measured. The shard's advertised p95, the orchestrator's view of a shard, the `done`
frame's per-shard figures and every benchmark use `percentile`; the median is its 50th.

`LatencyWindow` keeps the last `size` samples of a stream that can be arbitrarily long
(every decode step of a long chat), so per-call and per-shard latency figures take bounded
memory (DESIGN.md hot path rules).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (`q` in 0..100) of `values`; 0.0 when empty."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def median(values: Iterable[float]) -> float:
    """The nearest-rank median (`percentile(values, 50)`); 0.0 when empty."""
    return percentile(values, 50.0)


class LatencyWindow:
    """The last `size` samples of a latency stream, and how many were ever added."""

    __slots__ = ("_samples", "count")

    def __init__(self, size: int = 1024) -> None:
        self._samples: deque[float] = deque(maxlen=max(1, size))
        self.count = 0

    def add(self, value: float) -> None:
        self._samples.append(value)
        self.count += 1

    def percentile(self, q: float) -> float:
        """The nearest-rank `q`-th percentile of the kept samples; 0.0 when none."""
        return percentile(self._samples, q)

    @property
    def last(self) -> float:
        """The newest sample (`IndexError` when there is none)."""
        return self._samples[-1]

    def __len__(self) -> int:
        return len(self._samples)
