"""Fault injection for shards, by wrapping (issue 6 §5; issue 10 §3: not in production).

`install_faults(shard, spec)` wraps a running `ShardServer` from the outside: its weight
stack's sessions (the forward misbehaves) and, for ``close_mid_frame``, the session's
stream (half a WebSocket frame, then the socket drops). The shard's own step loop has no
branch for any of it. `tests.helpers.testnode` installs it in a node process.

    {"mode": "nan", "after_steps": 5, "shard": "0-14", "delay_s": 1.0}

- mode: exit | nan | garbage | wrong_shape | slow | hang | close_mid_frame | gate
- after_steps: misbehave from the shard's (after_steps+1)-th step on (default 0)
- shard: only the hosted shard with these layers (default: every shard)
- delay_s: for "slow", seconds per step
- gate_file: for "gate", each due reply waits until this file exists — the test holds a call
  open for as long as it needs and then lets it finish (the wait is asynchronous: the node's
  event loop and compute thread keep working, e.g. loading another shard)
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hearthnet.distributed_inference.shard.server import OpenRequest, ShardServer

MODES = ("exit", "nan", "garbage", "wrong_shape", "slow", "hang", "close_mid_frame")
"""The misbehaviours a caller must fail over from (`tests/integration/test_failover.py`)."""
HOLD = "gate"  # not a failure: holds replies until the test opens the gate
STREAM_MODES = ("close_mid_frame", HOLD)  # faults of the session's stream, not the forward
GATE_POLL_S = 0.05


class Fault:
    """One configured fault; counts the shard's steps across its sessions."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.mode = spec.get("mode")
        if self.mode not in (*MODES, HOLD):
            raise ValueError(f"fault mode must be one of {(*MODES, HOLD)}, not {self.mode!r}")
        self.after = int(spec.get("after_steps", 0))
        self.delay = float(spec.get("delay_s", 1.0))
        self.gate = Path(spec["gate_file"]) if self.mode == HOLD else None
        self._n = 0
        self._lock = threading.Lock()

    def tick(self) -> bool:
        """Count one step; True once the fault is due."""
        with self._lock:
            self._n += 1
            return self._n > self.after

    def corrupt(self, out: torch.Tensor) -> torch.Tensor:
        """The forward-level faults (run in the shard's compute thread)."""
        if self.mode == "exit":
            os._exit(17)  # a crash: no goodbye, no withdrawal
        if self.mode == "nan":
            return out * float("nan")
        if self.mode == "garbage":
            return out * 1000.0
        if self.mode == "wrong_shape":  # plausible values, one hidden unit short (issue 14 §3)
            return out[..., :-1].contiguous()
        if self.mode == "slow":
            time.sleep(self.delay)
        elif self.mode == "hang":
            threading.Event().wait()  # never answers
        return out


OutputHook = Callable[[torch.Tensor], torch.Tensor]


class FaultySession:
    """A KV-cache session whose every forward output goes through `hook`."""

    def __init__(self, inner: Any, hook: OutputHook) -> None:
        self.inner, self.hook = inner, hook

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        return self.hook(self.inner.forward(x, start_pos))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyStack:
    """A shard's weight stack handing out `FaultySession`s: ``shard.stack =
    FaultyStack(shard.stack, hook)`` (put the inner one back to undo)."""

    def __init__(self, inner: Any, hook: OutputHook) -> None:
        self.inner, self.hook = inner, hook

    def open_session(self, start: int, end: int, max_length: int) -> FaultySession:
        return FaultySession(self.inner.open_session(start, end, max_length), self.hook)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FaultyStream:
    """A session stream whose replies, once due, misbehave: ``close_mid_frame`` sends half a
    frame and drops the socket; ``gate`` waits for the gate file, then replies."""

    def __init__(self, inner: Any, fault: Fault) -> None:
        self.inner, self.fault = inner, fault

    async def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                        **kw: Any) -> None:
        if self.fault.tick():
            if self.fault.gate is None:
                transport = self.inner.connection.transport
                transport.write(b"\x82\x7e\x10\x00" + bytes(100))  # announces 4096 bytes
                transport.abort()
                return
            while not self.fault.gate.exists():
                await asyncio.sleep(GATE_POLL_S)
        await self.inner.send_step(step, start_pos, tensor, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def install_faults(shard: ShardServer, spec: dict[str, Any]) -> None:
    """Wrap `shard` (started: its stack loaded) with the fault `spec`, if it matches."""
    if not spec:
        return
    fault = Fault(spec)
    only = spec.get("shard")
    if only and only != f"{shard.lo}-{shard.hi}":
        return
    if fault.mode in STREAM_MODES:
        serve = shard.serve_session

        async def serve_session(stream: Any, req: OpenRequest) -> None:
            await serve(FaultyStream(stream, fault), req)

        shard.serve_session = serve_session  # type: ignore[method-assign]
    else:
        assert shard.stack is not None, "install faults on a started shard"
        shard.stack = FaultyStack(  # type: ignore[assignment]
            shard.stack, lambda out: fault.corrupt(out) if fault.tick() else out)
