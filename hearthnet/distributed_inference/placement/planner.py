"""Automatic placement: which layer range an automatic host loads (DESIGN.md decision 14; M26 §10).

Pure functions, no I/O: the daemon (`hearthnet.distributed_inference.placement.autohost`) feeds them
what the event log says and acts on the answer.

The rule is Petals' block selection, restated for HearthNet's inclusive layer ranges:

- **speed** of a host: decoder-layer steps per second it measured for one token
  (`measure_speed`, a matrix-vector probe every host can run before it holds a layer;
  `measure_layer_speed` times real layers, for predictions), or the number its config
  pins. A host serving ``k`` layers passes ``speed / k`` tokens per second through its
  range: that is its **throughput**, and
  every layer of its range gets it added to its **coverage**.
- A host **places** a window of ``length`` layers where the sorted coverage of the window
  is lexicographically smallest (`best_start`): it raises the weakest layers first, and an
  uncovered layer (coverage 0) is always filled before a covered one.
- Window **length** (`split_lengths`): the model's layers are shared among the automatic
  hosts in proportion to their speed, each capped by the layers its memory budget holds
  (`budget_layers`), the overflow going to the hosts with room (water-filling). Alone, a
  host takes everything its budget holds; next to a host twice as fast it takes a third.
- **Rebalance** (`plan_move`): a host moves only when moving raises the minimum coverage so
  much that ``min_before / min_after < balance_quality`` (Petals' ``balance_quality``,
  default 0.75), and never to a place where a layer would be left uncovered (its old range
  must stay covered by others or by the new window).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

EPS = 1e-9
# DESIGN.md decision 17: a range a member holds is fetched before it is hosted; until this
# node has measured a fetch, a plan assumes a wired household LAN's practical rate
DEFAULT_FETCH_BYTES_PER_S = 30e6


def fetch_seconds(nbytes: int, bytes_per_s: float | None = None) -> float:
    """Estimated seconds to fetch `nbytes` of weights from members at `bytes_per_s` (the
    last measured rate, or `DEFAULT_FETCH_BYTES_PER_S`)."""
    rate = bytes_per_s if bytes_per_s and bytes_per_s > 0 else DEFAULT_FETCH_BYTES_PER_S
    return max(0, nbytes) / rate


@dataclass(frozen=True, slots=True)
class Span:
    """One host's range of one model: layers ``lo..hi`` (inclusive) at ``speed``."""

    host: str
    lo: int
    hi: int
    speed: float  # layer steps per second

    @property
    def length(self) -> int:
        return self.hi - self.lo + 1

    @property
    def throughput(self) -> float:
        """Tokens per second this host passes through its whole range."""
        return self.speed / self.length


@dataclass(frozen=True, slots=True)
class HostCapacity:
    """An automatic host as the split sees it: its speed and the layers its budget holds."""

    host: str
    speed: float
    max_layers: int


def coverage(num_layers: int, spans: Iterable[Span]) -> list[float]:
    """Per layer, the summed throughput of the hosts serving it (0 = uncovered)."""
    cov = [0.0] * num_layers
    for s in sorted(spans, key=lambda s: (s.host, s.lo, s.hi)):  # same sums everywhere
        for i in range(max(0, s.lo), min(num_layers - 1, s.hi) + 1):
            cov[i] += s.throughput
    return cov


def best_start(cov: Sequence[float], length: int) -> int:
    """The start of the ``length``-layer window whose sorted coverage is smallest.

    Ties go to the lowest start, so every node computes the same answer.
    """
    if not 1 <= length <= len(cov):
        raise ValueError(f"window of {length} layers does not fit {len(cov)} layers")
    return min(range(len(cov) - length + 1),
               key=lambda i: (sorted(cov[i:i + length]), i))


def budget_layers(budget_bytes: int, bytes_per_layer: int, num_layers: int) -> int:
    """How many decoder layers fit the memory budget (0..num_layers)."""
    if bytes_per_layer <= 0:
        return num_layers
    return max(0, min(num_layers, budget_bytes // bytes_per_layer))


def split_lengths(num_layers: int, hosts: Sequence[HostCapacity]) -> dict[str, int]:
    """Layers per host: proportional to speed, capped by budget, overflow redistributed.

    The lengths sum to ``num_layers`` when the budgets together hold the model (else every
    host is at its cap). Deterministic: ties are broken by host id.
    """
    out = {h.host: 0 for h in hosts}
    left = num_layers
    open_hosts = sorted((h for h in hosts if h.max_layers > 0 and h.speed > 0),
                        key=lambda h: h.host)
    while left > 0 and open_hosts:
        total = sum(h.speed for h in open_hosts)
        want = {h.host: left * h.speed / total for h in open_hosts}
        capped = [h for h in open_hosts if want[h.host] >= h.max_layers - out[h.host]]
        if capped:  # give the capped hosts their cap, share the rest among the others
            for h in capped:
                left -= h.max_layers - out[h.host]
                out[h.host] = h.max_layers
            open_hosts = [h for h in open_hosts if h not in capped]
            continue
        given = _round_shares(want, left)
        for host, n in given.items():
            out[host] += n
        left = 0
    return out


def _round_shares(want: Mapping[str, float], total: int) -> dict[str, int]:
    """Integer shares summing to ``total``: floors, then the largest remainders."""
    floors = {h: math.floor(w) for h, w in want.items()}
    rest = total - sum(floors.values())
    order = sorted(want, key=lambda h: (-(want[h] - floors[h]), h))
    for h in order[:rest]:
        floors[h] += 1
    return floors


def gap_lengths(cov: Sequence[float]) -> list[tuple[int, int]]:
    """The uncovered runs ``(lo, hi)`` of a coverage vector."""
    runs: list[tuple[int, int]] = []
    for i, c in enumerate(cov):
        if c > EPS:
            continue
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


@dataclass(frozen=True, slots=True)
class Move:
    """A rebalance decision: move ``old`` to start at ``new_lo`` (same length)."""

    old: Span
    new_lo: int
    min_before: float
    min_after: float

    @property
    def new_hi(self) -> int:
        return self.new_lo + self.old.length - 1

    @property
    def quality(self) -> float:
        """Petals' balance quality: ``min_before / min_after`` (lower = more to gain)."""
        return self.min_before / self.min_after if self.min_after > EPS else 1.0


def plan_move(num_layers: int, spans: Sequence[Span], mine: Span, balance_quality: float
              ) -> Move | None:
    """Whether moving `mine` raises the weakest coverage enough (see the module docstring).

    Returns the move, or None when `mine` is best where it is, when moving would leave a
    layer uncovered, or when the gain is below the margin.
    """
    cov = coverage(num_layers, spans)
    before = min(cov)
    without = coverage(num_layers, [s for s in spans if s != mine])
    new_lo = best_start(without, mine.length)
    if new_lo == mine.lo:
        return None
    moved = Span(mine.host, new_lo, new_lo + mine.length - 1, mine.speed)
    after_cov = coverage(num_layers, [*[s for s in spans if s != mine], moved])
    after = min(after_cov)
    if after <= EPS or after <= before + EPS:
        return None  # would open a gap, or gains nothing
    move = Move(mine, new_lo, before, after)
    return move if move.quality < balance_quality else None


def measure_layer_speed(entry: Any, weights: str, *, layers: int = 2, steps: int = 48,
                        threads: int | None = None) -> float:
    """Decoder-layer steps per second of a real one-token decode step over `entry`'s first
    held `layers` layers, held as `weights`, in the engine, eager, on `threads` torch
    threads (default: as set): the median step of `steps` after a 16-token prefill — the
    median, not the best, so a machine other processes share is timed as loaded as the
    chats it predicts will be.

    What `measure_speed` (a matrix-vector product over a layer's weights) leaves out —
    attention over the cache, norms, rotary, per-layer Python — is in this figure: on
    SmolLM2 the probe said 1,820 layer steps/s where real layers ran 748, so a plan from
    the probe predicted 2.2x the measured tok/s and one from this figure 0.99x
    (docs/benchmarks.md). Reads those layers' weights: `entry` must hold them.
    """
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        lo = entry.held_layers[0][0]
        hi = min(entry.held_layers[0][1], lo + layers - 1)
        stack = LayeredStack(entry, lo, hi, weights)
        session = stack.open_session(lo, hi, 16 + steps + 1)
        times = []
        try:
            with torch.inference_mode():
                session.forward(torch.randn(1, 16, stack.hidden_size), 0)
                for i in range(steps):
                    x = torch.randn(1, 1, stack.hidden_size)
                    t0 = time.perf_counter()
                    session.forward(x, 16 + i)
                    times.append(time.perf_counter() - t0)
        finally:
            session.close()
        return float((hi - lo + 1) / statistics.median(times))
    finally:
        torch.set_num_threads(before)


MEASURE_MAX_PARAMS = 16 * 2**20
"""The probe matrix holds at most this many weights; a bigger layer's time is scaled."""


def measure_speed(params_per_layer: int, hidden_size: int, *, dtype: torch.dtype,
                  repeats: int = 20) -> float:
    """Decoder-layer steps per second of this host for one token (best of `repeats`).

    A one-token decode step is bound by streaming the layer's weights once: this times a
    matrix-vector product over a random matrix of the layer's parameter count (at most
    `MEASURE_MAX_PARAMS`, the time scaled linearly beyond), in the held dtype, on the torch
    threads the process has set.
    """
    hidden = max(1, hidden_size)
    rows = max(1, min(params_per_layer, MEASURE_MAX_PARAMS) // hidden)
    weight = torch.randn(rows, hidden, dtype=torch.float32).to(dtype)
    x = torch.randn(1, hidden, dtype=torch.float32).to(dtype)
    best = math.inf
    with torch.inference_mode():
        torch.nn.functional.linear(x, weight)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - t0)
    scale = max(1.0, params_per_layer / (rows * hidden))
    return 1.0 / max(best * scale, 1e-6)
