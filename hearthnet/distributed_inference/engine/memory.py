"""Memory truth (M26 §4.1 `vram_required_mb`, §5.6): what a shard needs, known before loading it.

A shard's resident need is its layers' weights in their held format plus the KV cache of
its session limit (`max_concurrent_streams` sessions of `max_session_tokens` positions,
each the preallocated cache slot a session really gets, `kv_cache.KVSlot`). Both
come from the safetensors headers and the config alone (no tensor is read), so a host can
refuse a shard over `shard_max_vram_mb` before loading it. The weights figure equals the
loaded `LayeredStack.param_bytes()` (tests/unit/test_memory.py).

And what a host really holds, beside its resident memory (`process_memory`, in a node's
status): its shards' weights, the KV-cache slots alive in the process and their peak
(`kv_cache.LEDGER`), its peak RSS, and the runtime's own share — the RSS when the first
shard was planned, before any weight was read (`plan_shard`).

And what the C allocator keeps of the memory a host frees: `release_free_heap` hands its
free pages back (after loading, and worth it after a round of prefill chunks);
`HEARTHNET_LARGE_BLOCKS_MIB` (`apply_large_blocks`, applied by a node at start) maps
large blocks on their own, so that freed activations leave at once, at a price in page
faults.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.distributed_inference.engine.families import load_config
from hearthnet.distributed_inference.engine.kv_cache import (
    CAPACITY_QUANTUM,
    LEDGER,
    capacity_for,
    slot_bytes,
)
from hearthnet.distributed_inference.engine.quant import compute_dtype_of, held_nbytes
from hearthnet.errors import BadRequest, ConfigError
from hearthnet.models.hashing import ggml_tensors, read_safetensors_header_and_metadata
from hearthnet.models.store import ModelEntry

_LAYER = re.compile(r"layers\.(\d+)\.")
MIB = 2**20


@functools.cache
def _libc() -> Any:
    """glibc's allocator entry points (`malloc_trim`, `mallopt`), or None elsewhere
    (macOS, musl: their allocators keep no such state to tune)."""
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim, lib.mallopt  # noqa: B018 - both exist, or this is not glibc
    except (OSError, AttributeError):
        return None
    return lib


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`).

    Loading converts tensors through temporaries below glibc's mmap threshold; freed, they
    stay in the process's heap, so a 7B shard kept ~500 MB it no longer used. Called after
    each loaded layer, so a host's resident memory is its weights, not their history; and
    worth calling after a shard's round of prefill chunks, whose activations (tens of MiB
    per layer, from the arenas once glibc has raised its mmap threshold) stay resident
    otherwise: 8 × 2,000-token prefills through 14 1.5B-shape int8 layers left RSS 394 MiB
    above the caches' allocation, 64 MiB with a trim after each round (14 ms a trim,
    against ~3 s a round)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's <malloc.h> parameter number
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
LARGE_BLOCKS_ENV = "HEARTHNET_LARGE_BLOCKS_MIB"


def return_large_blocks(threshold: int) -> bool:
    """From now on, a block of at least `threshold` bytes is mapped on its own and goes
    back to the OS the moment it is freed (glibc `mallopt(M_MMAP_THRESHOLD)`); whether
    that is so (False where the allocator is not glibc's).

    Why (M26 §5.6: a host holds weights + caches): glibc raises its mmap threshold to the
    size of every mapped block freed, up to 32 MiB, so after the first large free a
    prefill chunk's activations (1.5 MiB per 256 positions of a 1.5B's hidden state, up
    to 35 MiB in its MLP) and a long step's input and output come from the arenas — the
    event loop's and the compute thread's — between tensors that outlive them; freed,
    they stay resident. 8 × 2,000-token prefills through 14 1.5B-shape int8 layers: RSS
    peaked 470 MiB above the caches' allocation and kept 394 after; with 1 MiB blocks
    mapped, 243 (the steps' inputs and outputs and one layer's chunk) and 14. The price is
    page faults: a freed block's pages come back zeroed on its next use, so those
    prefills took 44 % more CPU time (sys time ×4) on a 2-core VM — hence opt-in
    (`large_blocks_setting`), where `release_free_heap` after each round of prefill chunks
    costs ~0.5 %."""
    if not 0 < threshold <= _MMAP_THRESHOLD_MAX:
        raise BadRequest(f"a block threshold of {threshold} bytes is outside glibc's "
                         f"range (1 to {_MMAP_THRESHOLD_MAX})")
    lib = _libc()
    return lib is not None and bool(lib.mallopt(M_MMAP_THRESHOLD, threshold))


def large_blocks_setting(value: str | None = None) -> int | None:
    """`HEARTHNET_LARGE_BLOCKS_MIB` (or `value`), in bytes: unset or ``off`` (the
    default) keeps glibc's own policy (None); a whole number of MiB from 1 to 32 is the
    size from which freed blocks go back to the OS at once (`return_large_blocks`).
    `ConfigError` for anything else."""
    raw = os.environ.get(LARGE_BLOCKS_ENV, "") if value is None else value
    v = raw.strip().lower() or "off"
    if v == "off":
        return None
    if v.isdigit() and 1 <= int(v) <= _MMAP_THRESHOLD_MAX >> 20:
        return int(v) << 20
    raise ConfigError(f"{LARGE_BLOCKS_ENV}={raw!r} is not a block size; use off or a whole "
                      f"number of MiB from 1 to {_MMAP_THRESHOLD_MAX >> 20}",
                      key=LARGE_BLOCKS_ENV, reason="bad large block size")


def apply_large_blocks() -> bool:
    """Apply `HEARTHNET_LARGE_BLOCKS_MIB` to this process (a node, before any shard
    loads); whether freed large blocks now go back to the OS at once."""
    threshold = large_blocks_setting()
    return threshold is not None and return_large_blocks(threshold)


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
    note_runtime_baseline()  # a shard is planned before any of its weights is read
    config = load_config(entry)
    per_session = kv_session_bytes(config, lo, hi, fmt, tokens)
    return MemoryPlan(weights_bytes=layer_weight_bytes(entry, lo, hi, fmt),
                      kv_bytes=per_session * sessions,
                      kv_bytes_per_token=per_session // max(tokens, 1))


_baseline: list[int] = []  # the RSS at the first `note_runtime_baseline`, once


def rss_bytes() -> dict[str, int]:
    """This process's resident memory now (``rss``) and at its peak (``peak_rss``, the
    kernel's high-water mark), in bytes; empty where /proc is missing (not Linux)."""
    out: dict[str, int] = {}
    keys = {"VmRSS": "rss", "VmHWM": "peak_rss"}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[keys[k]] = int(v.split()[0]) * 1024  # kB
    except OSError:
        return {}
    return out


def note_runtime_baseline() -> None:
    """Remember the RSS now as the runtime's own (interpreter, torch, transformers), the
    first time only: called before a shard's weights are read."""
    if not _baseline:
        _baseline.append(rss_bytes().get("rss", 0))


def process_memory(shards: Iterable[Any]) -> dict[str, Any]:
    """What this process holds, in bytes: the weights of `shards` (objects with a
    ``stack``, None until loaded: `ShardServer`), its KV-cache slots now and at their
    peak (allocated slots, busy or idle: each preallocated at its session's capacity,
    not the positions written), its RSS and peak RSS, and the runtime baseline (None
    where no shard was planned here)."""
    stacks = [getattr(s, "stack", None) for s in shards]
    weights = sum(int(st.param_bytes()) for st in stacks if st is not None)
    kv = LEDGER.snapshot()
    rss = rss_bytes()
    return {"weights_bytes": weights, "kv_bytes": kv.bytes, "kv_slots": kv.slots,
            "kv_peak_bytes": kv.peak_bytes, "kv_peak_slots": kv.peak_slots,
            "kv_largest_slot_bytes": kv.largest_slot_bytes,
            "kv_allocation": "preallocated per session at its capacity (prompt + max "
                             f"tokens + 1, rounded up to a multiple of {CAPACITY_QUANTUM})",
            "rss_bytes": rss.get("rss"), "peak_rss_bytes": rss.get("peak_rss"),
            "runtime_baseline_bytes": _baseline[0] if _baseline else None}
