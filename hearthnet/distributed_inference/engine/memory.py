"""Memory truth (M26 §4.1 `vram_required_mb`, §5.6): what a shard needs, known before loading it.

A shard's resident need is its layers' weights in their held format plus the KV cache of
its session limit (`max_concurrent_streams` sessions of `max_session_tokens` positions,
each the preallocated cache slot a session really gets, `kv_cache.KVSlot`). Both
come from the safetensors headers and the config alone (no tensor is read), so a host can
refuse a shard over `shard_max_vram_mb` before loading it. The weights figure equals the
loaded `LayeredStack.param_bytes()` (tests/unit/test_memory.py).
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hearthnet.distributed_inference.engine.families import load_config
from hearthnet.distributed_inference.engine.kv_cache import capacity_for, slot_bytes
from hearthnet.distributed_inference.engine.quant import compute_dtype_of, held_nbytes
from hearthnet.models.hashing import ggml_tensors, read_safetensors_header_and_metadata
from hearthnet.models.store import ModelEntry

_LAYER = re.compile(r"layers\.(\d+)\.")
MIB = 2**20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to hand back
        return None
    return fn


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`).

    Loading converts tensors through temporaries below glibc's mmap threshold; freed, they
    stay in the process's heap, so a 7B shard kept ~500 MB it no longer used. Called after
    each loaded layer, so a host's resident memory is its weights, not their history."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a shard needs: weights as held, and the KV cache of its session limit."""

    weights_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int

    @property
    def total_mb(self) -> int:
        return -(-(self.weights_bytes + self.kv_bytes) // MIB)  # rounded up

    def describe(self, fmt: str, sessions: int, tokens: int) -> str:
        return (f"{self.total_mb} MB = weights {self.weights_bytes / MIB:.0f} MB as {fmt} + "
                f"KV cache {self.kv_bytes / MIB:.0f} MB for {sessions} sessions × "
                f"{tokens} tokens")


def _layer_tensor_shapes(entry: ModelEntry, lo: int, hi: int) -> list[tuple[int, ...]]:
    """Logical shape of every tensor of layers `lo..hi` (GGUF blocks: their values')."""
    return [s for s, _ in _layer_tensors(entry, lo, hi)]


def _layer_tensors(entry: ModelEntry, lo: int, hi: int
                   ) -> list[tuple[tuple[int, ...], str]]:
    """(logical shape, GGML type or "") of every tensor of layers `lo..hi`."""
    shapes = []
    for f in sorted(entry.path.glob("*.safetensors")):
        header, _, metadata = read_safetensors_header_and_metadata(f)
        ggml = ggml_tensors(metadata)
        for name, info in header.items():
            m = _LAYER.search(name)
            if m and lo <= int(m.group(1)) <= hi:
                kind, shape = ggml.get(name, ("", tuple(
                    int(d) for d in info["shape"])))  # type: ignore[attr-defined]
                shapes.append((shape, kind))
    return shapes


def layer_weight_bytes(entry: ModelEntry, lo: int, hi: int, fmt: str) -> int:
    """Held bytes of layers `lo..hi` as `fmt` (every 2-D layer tensor is a Linear weight)."""
    return sum(held_nbytes(s, fmt, len(s) == 2, kind)
               for s, kind in _layer_tensors(entry, lo, hi))


def kv_session_bytes(config: Any, lo: int, hi: int, fmt: str, tokens: int) -> int:
    """KV-cache bytes of one session of `tokens` positions over layers `lo..hi`: exactly
    the preallocated slot a session gets (`kv_cache.KVSlot`) — capacity
    rounded up to `CAPACITY_QUANTUM`, sliding-window layers full length (so a redo can
    rewind them)."""
    return slot_bytes(config, hi - lo + 1, capacity_for(tokens), compute_dtype_of(fmt))


def plan_shard(entry: ModelEntry, lo: int, hi: int, fmt: str, sessions: int,
               tokens: int) -> MemoryPlan:
    """The memory plan of a shard of layers `lo..hi` held as `fmt` (a resolved format)."""
    config = load_config(entry)
    per_session = kv_session_bytes(config, lo, hi, fmt, tokens)
    return MemoryPlan(weights_bytes=layer_weight_bytes(entry, lo, hi, fmt),
                      kv_bytes=per_session * sessions,
                      kv_bytes_per_token=per_session // max(tokens, 1))
