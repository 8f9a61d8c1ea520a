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
        # what the next `update` writes: positions (T,) and how many positions to return
        self.positions = torch.zeros(1, dtype=torch.long, device=device)
        self.kv_len: int | None = None  # None: the whole capacity (graph-captured steps)

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


class BatchKV:
    """The `past_key_values` of one batched decode step of several sessions (DESIGN.md decision 12).

    Row ``b`` is one position of session ``b``: its key/value is written into that
    session's own `KVSlot` at its own position (the slots are never merged or moved), and
    the layer attends over the rows' histories gathered into one zero-padded tensor of the
    longest row's length. Padding is zeros, never a slot's stale entries (a slot reused
    after a failed session may hold non-finite values, and ``0 · inf`` would poison a
    row), and the per-row mask (`batch_attention_mask`) keeps every query inside its own
    row's length.
    """

    def __init__(self, slots: list[KVSlot], positions: torch.Tensor, lengths: list[int]) -> None:
        self.slots, self.positions, self.lengths = slots, positions, lengths
        self.start = slots[0].start
        self.kv_len = max(lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row at its position in its slot; (B, kv_heads, kv_len, head_dim)."""
        i = layer_idx - self.start
        b, heads, _, dim = key_states.shape
        keys = key_states.new_zeros(b, heads, self.kv_len, dim)
        values = value_states.new_zeros(b, heads, self.kv_len, dim)
        for r, (slot, n) in enumerate(zip(self.slots, self.lengths, strict=True)):
            k, v = slot.keys[i], slot.values[i]
            at = self.positions[r:r + 1]
            k.index_copy_(2, at, key_states[r:r + 1])
            v.index_copy_(2, at, value_states[r:r + 1])
            keys[r, :, :n] = k[0, :, :n]
            values[r, :, :n] = v[0, :, :n]
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len


def batch_attention_mask(positions: torch.Tensor, kv_idx: torch.Tensor, window: int | None,
                         additive_dtype: torch.dtype | None) -> torch.Tensor:
    """(B, 1, 1, K) mask of one query per row at `positions` (B,): row ``b`` sees keys
    ``≤ positions[b]`` (its own length; the zero padding beyond it never), windowed."""
    return attention_mask(positions, kv_idx, window, additive_dtype).transpose(0, 2)


class PackedKV:
    """The `past_key_values` of one packed forward over several sessions (DESIGN.md decision 12:
    mixed rounds, chunked prefill inside the decode forward as vLLM/Sarathi do).

    The rows' positions lie one after another along the sequence dimension, ``(1, N, H)``:
    segment ``r`` is ``counts[r]`` positions of session ``r`` from ``starts[r]`` on (a
    decode row is one, a prefill chunk many). `update` writes each segment's keys/values
    into its own session's `KVSlot` at its positions (the slots are never merged or
    moved) and returns the sessions' histories, ``starts[r] + counts[r]`` positions each,
    concatenated along the sequence dimension; `packed_attention_mask` keeps every query
    inside its own session's history (block-diagonal, causal, windowed).
    """

    def __init__(self, slots: list[KVSlot], starts: list[int], counts: list[int],
                 device: torch.device) -> None:
        self.slots, self.counts = slots, counts
        self.start = slots[0].start
        self.lengths = [p + t for p, t in zip(starts, counts, strict=True)]
        self.at = [torch.arange(p, p + t, device=device)
                   for p, t in zip(starts, counts, strict=True)]
        self.kv_len = sum(self.lengths)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each segment into its slot; (1, kv_heads, sum of histories, head_dim)."""
        i = layer_idx - self.start
        keys, values, off = [], [], 0
        for slot, at, t, n in zip(self.slots, self.at, self.counts, self.lengths, strict=True):
            k, v = slot.keys[i], slot.values[i]
            k.index_copy_(2, at, key_states[:, :, off:off + t])
            v.index_copy_(2, at, value_states[:, :, off:off + t])
            keys.append(k[:, :, :n])
            values.append(v[:, :, :n])
            off += t
        return torch.cat(keys, dim=2), torch.cat(values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def mask(self, window: int | None, additive_dtype: torch.dtype | None) -> torch.Tensor:
        """`packed_attention_mask` of this forward's segments."""
        return packed_attention_mask(self.at, self.lengths, window, additive_dtype)


def packed_attention_mask(query_positions: list[torch.Tensor], lengths: list[int],
                          window: int | None, additive_dtype: torch.dtype | None
                          ) -> torch.Tensor:
    """(1, 1, N, K) block-diagonal mask of packed segments: segment ``r``'s queries at
    ``query_positions[r]`` see only keys of segment ``r``'s history (``lengths[r]``
    positions, in `PackedKV`'s concatenated order), causally and within the window."""
    device = query_positions[0].device
    q_pos = torch.cat(query_positions)
    q_seg = torch.cat([torch.full_like(q, r) for r, q in enumerate(query_positions)])
    k_pos = torch.cat([torch.arange(n, device=device) for n in lengths])
    k_seg = torch.cat([torch.full((n,), r, dtype=torch.long, device=device)
                       for r, n in enumerate(lengths)])
    allowed = _allowed(q_pos, k_pos, window) & (k_seg.unsqueeze(0) == q_seg.unsqueeze(1))
    return _as_mask(allowed, additive_dtype)
