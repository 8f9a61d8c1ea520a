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

import contextlib
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int:
    """The CPU's last-level cache in bytes (Linux sysfs), or 64 MiB when unknown."""
    best = 0
    for f in caches.glob("index*/size"):
        text = f.read_text().strip() if f.is_file() else ""
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            best = max(best, int(text.rstrip("KMG")) * unit)
    return best or 64 * 2**20


def timed_window(entry: Any, weights: str, layers: int | None) -> tuple[Any, int, int]:
    """The layers a timing runs over: `layers` of the first held range, by default as many
    as make twice the CPU's last-level cache as held (see `measure_layer_speed`); (the
    loaded stack, first layer, last layer)."""
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    lo, top = entry.held_layers[0]
    if layers is None:
        one = LayeredStack(entry, lo, lo, weights)
        per = max(1, one.param_bytes())
        del one
        layers = max(1, min(top - lo + 1, -(-2 * last_level_cache_bytes() // per)))
    hi = min(top, lo + layers - 1)
    return LayeredStack(entry, lo, hi, weights), lo, hi


def measure_layer_speed(entry: Any, weights: str, *, layers: int | None = None,
                        steps: int = 48, threads: int | None = None,
                        budget_s: float = 5.0,
                        window: tuple[Any, int, int] | None = None) -> float:
    """Decoder-layer steps per second of a real one-token decode step over `entry`'s first
    held `layers` layers, held as `weights`, in the engine, eager, on `threads` torch
    threads (default: as set): the median step of `steps` (fewer once `budget_s` is spent,
    at least 8) after a 16-token prefill — the median, not the best, so a machine other
    processes share is timed as loaded as the chats it predicts will be.

    `layers` (default: enough that their bytes as held are twice the CPU's last-level
    cache, within the held range): a host streams its layers' weights from memory every
    token, and a window that fits the cache runs faster than any real stage does — on the
    2-core VM (260 MiB L3) two SmolLM2 fp32 layers timed 1,050 steps/s, eleven 690, and a
    node's 11-layer stage ran at 700 (docs/benchmarks.md).

    What `measure_speed` (a matrix-vector product over a layer's weights) leaves out —
    attention over the cache, norms, rotary, per-layer Python — is in this figure: on
    SmolLM2 the probe said 1,820 layer steps/s where real layers ran 748, so a plan from
    the probe predicted 2.2x the measured tok/s and one from this figure 0.99x
    (docs/benchmarks.md). Reads those layers' weights: `entry` must hold them. `window`: a
    `timed_window` already loaded.
    """
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        stack, lo, hi = window or timed_window(entry, weights, layers)
        session = stack.open_session(lo, hi, 16 + steps + 1)
        times: list[float] = []
        try:
            with torch.inference_mode():
                session.forward(torch.randn(1, 16, stack.hidden_size), 0)
                t_end = time.perf_counter() + budget_s
                for i in range(steps):
                    x = torch.randn(1, 1, stack.hidden_size)
                    t0 = time.perf_counter()
                    session.forward(x, 16 + i)
                    times.append(time.perf_counter() - t0)
                    if len(times) >= 8 and t0 > t_end:
                        break
        finally:
            session.close()
        return float((hi - lo + 1) / statistics.median(times))
    finally:
        torch.set_num_threads(before)


def measure_batch_factor(entry: Any, weights: str, *, rows: int = 8,
                         layers: int | None = None, steps: int = 16,
                         threads: int | None = None, budget_s: float = 5.0,
                         window: tuple[Any, int, int] | None = None) -> float:
    """How many times one chat's rate `rows` chats reach together when each decode round
    carries one row of each (continuous batching, M26 §5.3): ``rows × t(1 row) / t(rows
    rows)`` over a real decode step of `entry`'s first held layers (as many as
    `measure_layer_speed` times), eager, single-row and batched steps alternating, medians.
    A round streams the weights once, so where a step is bound by memory the factor nears
    `rows`; where the products are bound by compute (a big model on few cores) it stays
    near 1 — a fixed cost per extra row fits neither. `window`: a `timed_window` already
    loaded (both timings over one load)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        stack, lo, hi = window or timed_window(entry, weights, layers)
        sessions = [stack.open_session(lo, hi, 16 + 2 * steps + 1) for _ in range(rows)]
        one_t: list[float] = []
        many_t: list[float] = []
        try:
            with torch.inference_mode():
                for s in sessions:
                    s.forward(torch.randn(1, 16, stack.hidden_size), 0)
                solo, pos = sessions[0], 16
                t_end = time.perf_counter() + budget_s
                for i in range(steps):
                    t0 = time.perf_counter()
                    solo.forward(torch.randn(1, 1, stack.hidden_size), pos)
                    one_t.append(time.perf_counter() - t0)
                    pos += 1
                    hidden = [torch.randn(1, 1, stack.hidden_size) for _ in sessions]
                    t0 = time.perf_counter()
                    stack.decode_batch(sessions, hidden, [pos] + [16 + i] * (rows - 1))
                    many_t.append(time.perf_counter() - t0)
                    pos += 1
                    if i >= 3 and time.perf_counter() > t_end:
                        break
        finally:
            for s in sessions:
                s.close()
        return float(rows * statistics.median(one_t) / statistics.median(many_t))
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
