"""An in-process transport seam for orchestrator tests (httpx's MockTransport idea).

`InProcessMesh` hosts `LayeredStack`s under fake endpoints and hands the orchestrator
channels that call the sessions directly. A host can be made to fail on cue.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    ShardDescriptor,
    advertisement_payload,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.routing import RoutingSettings, ShardRouter
from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.quant import kernel_of
from hearthnet.dtypes import FLOAT_DTYPES
from hearthnet.errors import ConnectionLost, ShardUnavailable
from hearthnet.mesh.eventlog import EventLog
from hearthnet.models.store import ModelEntry

_WIRE = FLOAT_DTYPES


@dataclass
class Result:
    tensor: torch.Tensor
    compute_us: int


@dataclass
class Host:
    node_id: str
    stack: LayeredStack
    descriptor: ShardDescriptor
    dead: bool = False
    fail_after_steps: int | None = None  # die after this many steps (across sessions)
    transform: Any = None  # corrupt outputs: f(tensor) -> tensor
    steps: int = 0
    opened: int = 0
    refuse_opens: bool = False  # answer every open with shard_unavailable (a busy shard)
    busy_opens: int = 0  # refuse this many opens as busy, then accept (a slot freed up)
    # the format its ACCEPT states when it differs from the advertisement (a host that
    # restarted with another format while its advertisement lived on); "": the stack's
    held_format: str = ""
    trace: list[tuple[str, int]] | None = None  # (node id, start_pos) of every step, in order
    by_ref: dict[str, Any] = field(default_factory=dict)  # open sessions by their ref


@dataclass
class Channel:
    host: Host
    session: Any
    wire: torch.dtype
    closed: bool = False
    accepted: dict[str, Any] = field(default_factory=dict)  # as a shard's ACCEPT states
    ref: str | None = None  # the caller's name for the session (another open's fork)

    async def step(self, step: int, start_pos: int, x: torch.Tensor,
                   deadline_s: float | None = None) -> Result:
        h = self.host
        if h.fail_after_steps is not None and h.steps >= h.fail_after_steps:
            h.dead = True
        if h.dead or self.closed:
            raise ConnectionLost(f"{h.node_id} went away")
        h.steps += 1
        if h.trace is not None:
            h.trace.append((h.node_id, start_pos))
        await asyncio.sleep(0)  # a real channel yields while the shard computes
        t = time.perf_counter()
        out = self.session.forward(x.to(self.wire), start_pos)
        if h.transform is not None:
            out = h.transform(out)
        return Result(out.to(self.wire), int((time.perf_counter() - t) * 1e6))

    @property
    def wire_dtype(self) -> torch.dtype:
        return self.wire

    async def close(self, reason: str = "") -> None:
        self.closed = True
        if self.ref is not None and self.host.by_ref.get(self.ref) is self.session:
            del self.host.by_ref[self.ref]


@dataclass
class InProcessMesh:
    entry: ModelEntry
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.health = ShardHealthTracker()
        self.store = ShardStore(120.0, tracker=self.health)
        self.channels: list[Channel] = []

    def add(self, node_id: str, lo: int, hi: int, weights: str = "fp32", *,
            max_streams: int = 8, device: str = "cpu") -> Host:
        """A shard host of layers lo..hi; `device` is what its advertisement says it
        computes on (its layers run on this machine's CPU whatever it says)."""
        stack = LayeredStack(self.entry, lo, hi, weights)
        d = ShardDescriptor.create(model_id=self.entry.model_id,
                                   weights_sha256=self.entry.weights_sha256,
                                   layer_range=(lo, hi), host=node_id,
                                   endpoint=f"ws://{node_id}.inproc:1",
                                   max_concurrent_streams=max_streams,
                                   weights_format=stack.format, device=device,
                                   kernel=kernel_of(stack.format,
                                                    bool(self.entry.ggml_types)))
        with tempfile.TemporaryDirectory(prefix="hn-inproc-") as folder:  # nothing left
            log = EventLog(Path(folder) / f"{node_id}.sqlite", node_id)
            self.store.apply(log.append(ADVERTISED, advertisement_payload(d)))
            log.close()
        host = Host(node_id, stack, d)
        self.hosts[d.endpoint + "/shard"] = host
        return host

    def router(self) -> ShardRouter:
        return ShardRouter(self.store, RoutingSettings(), self.health, self_node_id="orch")

    async def connect(self, uri: str, params: dict[str, Any], deadline_s: float) -> Channel:
        host = self.hosts[uri]
        if host.dead:
            raise ConnectionLost(f"cannot reach {host.node_id}")
        if host.refuse_opens or host.busy_opens > 0:
            host.busy_opens = max(0, host.busy_opens - 1)
            raise ShardUnavailable(f"{host.node_id} is at max_concurrent_streams",
                                   busy=True)  # as a shard's refusal says (issue 16 §2)
        host.opened += 1
        s = host.stack.open_session(params["start"], params["end"], params["max_length"])
        fork = params.get("fork")  # as a shard takes it: an open session of the same caller
        source = host.by_ref.get(fork["ref"]) if fork is not None else None
        forked = s.copy_prefix(source, fork["positions"]) if source is not None else 0
        ref = params.get("ref")
        if ref is not None:
            host.by_ref[ref] = s
        ch = Channel(host, s, _WIRE[params["wire_dtype"]], accepted={
            "shard_id": host.descriptor.shard_id, "weights_sha256": self.entry.weights_sha256,
            "layers": [params["start"], params["end"]],
            "weights_format": host.held_format or host.stack.format,
            "kernel": host.descriptor.kernel, "forked": forked}, ref=ref)
        self.channels.append(ch)
        return ch
