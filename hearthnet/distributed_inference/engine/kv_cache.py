"""The preallocated KV cache of a session and its masks (DESIGN.md decision 11, gpt-fast style).

A `KVSlot` holds, for each layer of a sub-range `[start, end]`, key and value buffers of
shape ``(1, kv_heads, capacity, head_dim)`` allocated once, and is updated by index at the
step's positions (`index_copy_`): no concatenation, no growth, no per-step allocation.
Sliding-window layers get the same full-length buffers (the window is applied in the
mask), so a redo at an earlier position — failover replay, M26 §5.4 — is just a shorter
length: later entries are overwritten before they are read, and the causal mask keeps a
query from ever seeing an entry beyond its own position.

Why not transformers' `StaticCache`: its sliding-window layers are rolling buffers that
cannot be rewound to an earlier position, and its buffers always span the full capacity,
while the eager (CPU, prefill) path here attends only over the positions written so far.

The slot is the cache object (`cache`, formerly `past_key_values`) the family's own
decoder layers receive: they call ``update(key, value, layer_idx, ...)`` and get the
keys/values to attend over. Masks are computed from a positions tensor with two tensor ops
(no Python structures per step), so the same step function can be captured in a CUDA
graph.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

CAPACITY_QUANTUM = 256
"""Capacities are rounded up to a multiple of this, so slots (and their captured CUDA
graphs) are reused across sessions of similar lengths."""


def capacity_for(max_length: int) -> int:
    """The slot capacity that holds `max_length` positions."""
    return -(-max_length // CAPACITY_QUANTUM) * CAPACITY_QUANTUM


def kv_shape(config: Any) -> tuple[int, int]:
    """(kv_heads, head_dim) of a transformers decoder config."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv_heads, head_dim


def slot_bytes(config: Any, layers: int, capacity: int, dtype: torch.dtype) -> int:
    """Bytes of the key and value buffers of `layers` layers at `capacity` positions."""
    kv_heads, head_dim = kv_shape(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * kv_heads * capacity * head_dim * itemsize


@dataclass(frozen=True)
class CacheBytes:
    """The KV-cache slots this process holds, and the most it held at once."""

    bytes: int
    slots: int
    peak_bytes: int
    peak_slots: int
    largest_slot_bytes: int  # one session's slot: its capacity, not the positions written


class CacheLedger:
    """Bytes of every `KVSlot` alive in the process (busy or kept idle for the next
    session) and their peak — what a host's resident memory is held against (M26 §5.6:
    weights + caches). A slot is counted from its allocation (its buffers are zero-filled,
    so resident at once) until `KVSlot.release` or its collection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # slots come and go on compute threads
        self._bytes = self._slots = self._peak = self._peak_slots = self._largest = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
            self._slots += 1
            self._largest = max(self._largest, nbytes)
            if self._bytes > self._peak:
                self._peak, self._peak_slots = self._bytes, self._slots

    def remove(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes
            self._slots -= 1

    def snapshot(self) -> CacheBytes:
        with self._lock:
            return CacheBytes(self._bytes, self._slots, self._peak, self._peak_slots,
                              self._largest)


LEDGER = CacheLedger()
"""This process's slots (`engine.memory.process_memory` reports them beside its RSS)."""


class KVSlot:
    """Preallocated keys/values of layers `[start, end]` (absolute layer indices)."""

    def __init__(self, config: Any, start: int, end: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        kv_heads, head_dim = kv_shape(config)
        self.start, self.end, self.capacity = start, end, capacity
        self.keys = [torch.zeros(1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
                     for _ in range(start, end + 1)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.keys + self.values)
        LEDGER.add(self.nbytes)  # uncounted once released, or once collected unreleased
        self._uncount = weakref.finalize(self, LEDGER.remove, self.nbytes)
        # what the next `update` writes: positions (T,) and how many positions to return
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.kv_len: int | None = None  # None: the whole capacity (graph-captured steps)
        # the captured step (CUDA; layers._DecodeGraph), kept with the slot
        self.graph: Any = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values at `positions`; the keys/values to attend over."""
        i = layer_idx - self.start
        k, v = self.keys[i], self.values[i]
        k.index_copy_(2, self.positions, key_states)
        v.index_copy_(2, self.positions, value_states)
        if self.kv_len is None:
            return k, v
        return k[:, :, :self.kv_len], v[:, :, :self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity if self.kv_len is None else self.kv_len

    def release(self) -> None:
        self.keys, self.values = [], []
        self._uncount()  # runs once: a second release, or the collection, counts nothing


def attention_mask(positions: torch.Tensor, kv_idx: torch.Tensor, window: int | None,
                   additive_dtype: torch.dtype | None) -> torch.Tensor:
    """(1, 1, T, K) mask of queries at `positions` over keys `kv_idx` (causal, windowed).

    Boolean (True = attend) for sdpa; additive (0 / dtype min) for eager attention.
    """
    return _as_mask(_allowed(positions, kv_idx, window), additive_dtype)


def _allowed(positions: torch.Tensor, kv_idx: torch.Tensor, window: int | None) -> torch.Tensor:
    """(T, K) boolean: a query at `positions` may see the key at `kv_idx` (causal, windowed)."""
    q = positions.unsqueeze(1)  # (T, 1)
    allowed = kv_idx.unsqueeze(0) <= q  # (T, K)
    if window is not None:
        allowed = allowed & (kv_idx.unsqueeze(0) > q - window)  # transformers' overlay
    return allowed


def _as_mask(allowed: torch.Tensor, additive_dtype: torch.dtype | None) -> torch.Tensor:
    """(1, 1, T, K): boolean for sdpa, additive (0 / dtype min) for eager attention."""
    allowed = allowed[None, None]
    if additive_dtype is None:
        return allowed
    zero = torch.zeros((), dtype=additive_dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(additive_dtype).min)


class SegmentsKV:
    """The cache of one forward over several sessions (DESIGN.md decision 12): decode rows
    and prefill chunks alike, packed along the sequence dimension, ``(1, N, H)``.

    Segment ``r`` is ``counts[r]`` positions of session ``r`` from ``starts[r]`` on (a
    decode row is one, a prefill chunk many). `update` writes each segment's keys/values
    into its own session's `KVSlot` at its positions and nothing else: no history is
    gathered, padded or concatenated. The attention (`attention.segments_attention`) then
    runs each segment's queries over its own slot where it lies — a view of the positions
    it may see (``lo..length``: the whole history, or the sliding window's part of it) —
    so a step costs the new positions and the cached length read, never a copy of the
    caches, and rows never share an attention computation (one session's non-finite
    history cannot spoil another's row). `histories` gives the attention those views.
    """

    def __init__(self, slots: list[KVSlot], starts: list[int], counts: list[int],
                 kinds: list[str], window: int | None, additive_dtype: torch.dtype | None,
                 device: torch.device) -> None:
        self.slots, self.counts, self.kinds = slots, counts, kinds
        self.start = slots[0].start
        self.lengths = [p + t for p, t in zip(starts, counts, strict=True)]
        self.at = [torch.arange(p, p + t, device=device)
                   for p, t in zip(starts, counts, strict=True)]
        self.kv_len = max(self.lengths)
        # per layer kind, per segment: (first key position it may see, its mask or None)
        self.plans = {kind: [_segment_plan(at, p, n, window if kind == "sliding_attention"
                                           else None, additive_dtype)
                             for at, p, n in zip(self.at, starts, self.lengths, strict=True)]
                      for kind in set(kinds)}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each segment into its slot; the new keys/values themselves (the attention
        reads the slots, `attend`)."""
        i = layer_idx - self.start
        off = 0
        for slot, at, t in zip(self.slots, self.at, self.counts, strict=True):
            slot.keys[i].index_copy_(2, at, key_states[:, :, off:off + t])
            slot.values[i].index_copy_(2, at, value_states[:, :, off:off + t])
            off += t
        return key_states, value_states

    def histories(self, layer_idx: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per segment, the keys and values its queries may see — views of its own slot
        (``lo..length``) — and its mask (None where none is needed)."""
        i = layer_idx - self.start
        return [(slot.keys[i][:, :, lo:n], slot.values[i][:, :, lo:n], mask)
                for slot, n, (lo, mask) in zip(self.slots, self.lengths,
                                               self.plans[self.kinds[i]], strict=True)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


def _segment_plan(at: torch.Tensor, first: int, length: int, window: int | None,
                  additive_dtype: torch.dtype | None) -> tuple[int, torch.Tensor | None]:
    """(first key position, mask) of queries at `at` (`first`..`length` − 1) over a history
    of `length` positions: the keys before the window's reach are not read at all, and no
    mask is needed where every query sees every key read (one query) or sdpa's own causal
    flag does it (a prefill from position 0 within the window)."""
    t = length - first
    lo = max(0, first - window + 1) if window is not None else 0
    if t == 1 or (first == 0 and additive_dtype is None and lo == 0
                  and (window is None or length <= window)):
        return lo, None
    kv_idx = torch.arange(lo, length, device=at.device)
    return lo, _as_mask(_allowed(at, kv_idx, window), additive_dtype)
