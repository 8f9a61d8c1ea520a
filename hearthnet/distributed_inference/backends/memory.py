"""Memory truth (issue 12 §4): what a shard needs, known before loading it.

A shard's resident need is its layers' weights in their held format plus the KV cache of
its session limit (`max_concurrent_streams` sessions of `max_session_tokens` positions;
sliding-window layers capped at their window, as transformers' caches keep them). Both
come from the safetensors headers and the config alone (no tensor is read), so a host can
refuse a shard over `shard_max_vram_mb` before loading it. The weights figure equals the
loaded `LayeredStack.param_bytes()` (tests/unit/test_memory.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from hearthnet.distributed_inference.backends.quant import compute_dtype_of, held_nbytes
from hearthnet.models.hashing import read_safetensors_header
from hearthnet.models.store import ModelEntry

_LAYER = re.compile(r"layers\.(\d+)\.")
MIB = 2**20


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
    shapes = []
    for f in sorted(entry.path.glob("*.safetensors")):
        header, _ = read_safetensors_header(f)
        for name, info in header.items():
            m = _LAYER.search(name)
            if m and lo <= int(m.group(1)) <= hi:
                shapes.append(tuple(int(d) for d in info["shape"]))  # type: ignore[attr-defined]
    return shapes


def layer_weight_bytes(entry: ModelEntry, lo: int, hi: int, fmt: str) -> int:
    """Held bytes of layers `lo..hi` as `fmt` (every 2-D layer tensor is a Linear weight)."""
    return sum(held_nbytes(s, fmt, len(s) == 2) for s in _layer_tensor_shapes(entry, lo, hi))


def kv_bytes_per_token(config: Any, layer_types: list[str], lo: int, hi: int, fmt: str,
                       tokens: int) -> int:
    """KV-cache bytes of one session of `tokens` positions over layers `lo..hi`."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    item = torch.empty((), dtype=compute_dtype_of(fmt)).element_size()
    window = getattr(config, "sliding_window", None)
    total = 0
    for i in range(lo, hi + 1):
        # a sliding layer's cache keeps window - 1 positions (transformers' sliding layer)
        n = min(tokens, int(window) - 1) if layer_types[i] == "sliding_attention" and window \
            else tokens
        total += 2 * kv_heads * head_dim * item * n
    return total


def plan_shard(entry: ModelEntry, lo: int, hi: int, fmt: str, sessions: int,
               tokens: int) -> MemoryPlan:
    """The memory plan of a shard of layers `lo..hi` held as `fmt` (a resolved format)."""
    from hearthnet.distributed_inference.backends.small_model_layered import (
        _layer_types,
        load_config,
    )

    config = load_config(entry)
    per_session = kv_bytes_per_token(config, _layer_types(config), lo, hi, fmt, tokens)
    return MemoryPlan(weights_bytes=layer_weight_bytes(entry, lo, hi, fmt),
                      kv_bytes=per_session * sessions,
                      kv_bytes_per_token=per_session // max(tokens, 1))
