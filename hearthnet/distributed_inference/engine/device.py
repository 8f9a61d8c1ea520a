"""Where tensors live: device selection, device facts, the memory budget, pinned staging.

This module owns everything about *which* device a shard or a head computes on (M26 §5.7,
DESIGN.md decision 11) and how many bytes it may hold there (M26 §5.6):

- `resolve_device("auto" | "cpu" | "cuda" | "cuda:N" | "mps")`: `auto` picks CUDA, then
  MPS, then the CPU; a device that is asked for but absent is a `ConfigError` at start-up.
- `device_info(device)`: kind, name and memory, for the advertisement and `hearthnet status`.
- `MemoryBudget`: the bytes a shard holds on its device (weights + the preallocated KV
  caches of its sessions), checked against `shard_max_vram_mb` before an open is admitted.
- `Staging`: reused page-locked host buffers for hidden states crossing device ↔ host
  (DESIGN.md hot path rules): one copy each way, no allocation per step.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import torch

from hearthnet.config import DEVICE_PATTERN
from hearthnet.errors import ConfigError, ShardUnavailable

_DEVICE_RE = re.compile(DEVICE_PATTERN)


def valid_device_spec(spec: str) -> bool:
    """Whether `spec` is one of auto, cpu, cuda, cuda:N, mps (not whether it is present)."""
    return isinstance(spec, str) and bool(_DEVICE_RE.match(spec))


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """The torch device for a config value; `ConfigError` if absent or malformed."""
    if isinstance(spec, torch.device):
        return spec
    if not valid_device_spec(spec):
        raise ConfigError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N, mps",
                          key="device")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not _mps_available():
            raise ConfigError("device 'mps' was asked for but this machine has no usable "
                              "Apple MPS device; use device = \"auto\" or \"cpu\"", key="device")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {spec!r} was asked for but torch sees no CUDA GPU "
                          f"(torch {torch.__version__}); use device = \"auto\" or \"cpu\"",
                          key="device")
    dev = torch.device(spec)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {spec!r} was asked for but there are only "
                          f"{torch.cuda.device_count()} CUDA device(s)", key="device")
    return torch.device("cuda", index)


def rows_independent(kind: str) -> bool:
    """Whether a row's output on a device of `kind` (cpu | cuda | mps) is the same whatever
    rows share its product, so a prompt may be cut into pieces by the load (prefix sharing,
    a shard's prefill pieces beside decode rows) without changing an answer: a CPU's
    kernels; a GPU's half-precision products of other row counts round differently (an
    H100 changed every answer at 2 and 4 chats, docs/benchmarks.md)."""
    return kind == "cpu"


def device_info(device: torch.device) -> dict[str, Any]:
    """Kind, name and total/free memory in MiB of `device` (advertised; `hearthnet status`)."""
    info: dict[str, Any] = {"kind": device.type, "name": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(name=props.name, total_mb=total // 2**20, free_mb=free // 2**20)
    elif device.type == "mps":
        info.update(name="Apple MPS",
                    total_mb=int(torch.mps.recommended_max_memory()) // 2**20)
    else:
        import os

        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        # the vector ISA torch dispatches to (AVX2, AVX512 …): int8 speed depends on it
        info.update(name=f"cpu ({torch.backends.cpu.get_cpu_capability()})",
                    total_mb=pages * size // 2**20)
    return info


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device as the driver reports it; None where unknown."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings; no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is a device out-of-memory error (CUDA or MPS)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "out of memory" in str(e).lower())


class MemoryBudget:
    """Bytes a shard holds on its device against `shard_max_vram_mb` (M26 §5.6).

    `reserve` admits a new allocation or raises `ShardUnavailable` (the router then picks
    another shard); `release` gives it back. Weights are reserved once at load time.
    """

    def __init__(self, limit_mb: int | None, device: torch.device) -> None:
        self.limit_bytes = None if limit_mb is None else int(limit_mb) * 2**20
        self.device = device
        self.used_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, what: str) -> None:
        """Count `nbytes` more, or raise `ShardUnavailable` naming the budget."""
        with self._lock:
            if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
                raise ShardUnavailable(
                    f"{what} needs {nbytes / 2**20:.1f} MiB on {self.device} but the shard "
                    f"holds {self.used_bytes / 2**20:.1f} of its "
                    f"{self.limit_bytes / 2**20:.0f} MiB (shard_max_vram_mb); pick another",
                    reason="memory_budget")
            free = free_device_bytes(self.device)
            if free is not None and nbytes > free:
                raise ShardUnavailable(
                    f"{what} needs {nbytes / 2**20:.1f} MiB but {self.device} has only "
                    f"{free / 2**20:.1f} MiB free; pick another", reason="device_memory")
            self.used_bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes = max(0, self.used_bytes - nbytes)


class Staging:
    """Reused host buffers for one sequential user (a session or a call): no allocation per step.

    On a CUDA device the buffers are page-locked, so copies run by DMA and the host→device
    copy does not block; on the CPU both directions are plain casts. A buffer returned by
    `to_host` is overwritten by the next `to_host`: the caller encodes it first.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def _buffer(self, role: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._bufs.get((role, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1 << 12), dtype=dtype, pin_memory=self._pinned)
            self._bufs[(role, dtype)] = buf
        return buf[:numel]

    def to_device(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` (host) on the device in `dtype`: one pinned copy, then an async upload."""
        if self.device.type == "cpu":
            return x.to(dtype)
        if not self._pinned:
            return x.to(self.device, dtype)
        buf = self._buffer("in", x.dtype, x.numel()).view(x.shape)
        buf.copy_(x)
        return buf.to(self.device, non_blocking=True).to(dtype)

    def to_host(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`y` (device) in `dtype` on the host, cast on the device before the copy."""
        y = y.to(dtype)
        if y.device.type == "cpu":
            return y
        if not self._pinned:
            return y.cpu()
        buf = self._buffer("out", dtype, y.numel()).view(y.shape)
        buf.copy_(y, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return buf
