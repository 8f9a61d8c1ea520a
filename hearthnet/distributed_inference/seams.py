"""The transport seams of distributed inference, as Protocols, so no room imports the transport.

The orchestrator and the shard server never name the WebSocket transport's classes: the
orchestrator dials through a `Connector` and steps a `Channel`; the shard server serves a
`ShardStream`. `hearthnet.transport.websocket`'s `TensorChannel` and `ServerStream`
implement them (checked by `mypy --strict` where the node daemon hands them over); tests
inject in-process or fault-injecting implementations of the same Protocols.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch

from hearthnet.errors import HearthNetError


class StepOutput(Protocol):
    """A shard's answer to one step, as the orchestrator receives it (M26 §8.4)."""

    @property
    def tensor(self) -> torch.Tensor:
        """`(1, T, H)` hidden states in the stream's wire dtype."""
        ...

    @property
    def compute_us(self) -> int:
        """The shard's own compute time: the rest of the round trip is overhead."""
        ...


class Channel(Protocol):
    """The orchestrator's end of one stage session (docs/protocol.md §3)."""

    accepted: dict[str, Any]
    """The shard's ACCEPT params: what it really holds (format, weights, layers)."""

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of every tensor on this stream."""
        ...

    async def step(self, step: int, start_pos: int, tensor: torch.Tensor,
                   deadline_s: float | None = None) -> StepOutput:
        """Send one step's input and receive its output, under one deadline for both."""
        ...

    async def close(self, reason: str = "") -> None:
        """End the session (idempotent)."""
        ...


Connector = Callable[[str, dict[str, Any], float], Awaitable[Channel]]
"""(uri, open params, deadline in s) -> an accepted `Channel` (or a typed error)."""


class StepIn(Protocol):
    """One step's input, as a shard receives it."""

    @property
    def step(self) -> int: ...

    @property
    def start_pos(self) -> int: ...

    @property
    def tensor(self) -> torch.Tensor: ...


class ShardStream(Protocol):
    """The shard server's end of one session (docs/protocol.md §3)."""

    def limit_tensor_bytes(self, limit: int) -> None:
        """Lower the largest tensor this session accepts (before `accept`)."""
        ...

    async def accept(self, params: dict[str, Any] | None = None) -> None:
        """Accept the session; `params` go back to the caller."""
        ...

    async def refuse(self, err: HearthNetError, *, step: int | None = None) -> None:
        """Send `err` as a fatal error and close."""
        ...

    async def recv_step(self, deadline_s: float | None = None) -> StepIn | None:
        """The next step's input; None once the caller closed the session cleanly."""
        ...

    async def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                        compute_us: int = 0, deadline_s: float | None = None) -> None:
        """Send one step's output with the shard's compute time."""
        ...

    def progress(self, waiting_since: float) -> None:
        """The session's step, queued since `waiting_since` (the event loop's `time()`),
        waits behind work that is making progress: tell the caller it is not stalled."""
        ...

    async def send_error(self, err: HearthNetError, *, step: int | None = None) -> None:
        """Send `err` as a non-fatal error: the session stays open."""
        ...

    async def close(self, reason: str = "") -> None:
        """End the session (idempotent)."""
        ...
