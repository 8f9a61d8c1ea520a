"""`HearthNetClient`: call `experimental.distributed_llm.chat` from a host app (issue 15 §3).

    async with HearthNetClient.from_config("config/mesh3/node-a.toml") as hn:
        async for frame in hn.chat([{"role": "user", "content": "Hi"}], max_tokens=32):
            if isinstance(frame, TokenDelta):
                print(frame.text, end="", flush=True)

The client speaks the node's capability bus (``/bus``, msgpack frames) and turns each frame
into a typed dataclass (`TokenDelta`, `ShardStatus`, `ShardFailover`, `PipelineAborted`,
`Done`). An ``error`` frame raises the matching `hearthnet.errors` class (the spec's codes:
`BadRequest`, `ShardUnavailable`, `PipelineStalled` …); a call that ends without ``done``
or ``error`` raises `ConnectionLost`. Every frame keeps its wire map in ``raw``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hearthnet.errors import BadRequest, ConnectionLost, error_from_code
from hearthnet.mesh.bus import bus_call
from hearthnet.node.capabilities import CHAT_CAPABILITY


@dataclass(frozen=True)
class TokenDelta:
    """One more piece of the answer."""

    text: str
    token_id: int
    index: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class ShardStatus:
    """A shard of the pipeline is ``ok`` (at construction) or ``degraded`` (failed)."""

    shard_id: str
    status: str
    code: str | None = None
    message: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class ShardFailover:
    """A failed stage was replaced and its state replayed (M26 §5.4)."""

    failed: str
    replacement: list[str]
    pipeline: list[str]
    ms: float
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class PipelineAborted:
    """The pipeline gave up; ``continuing == "local"`` when the answer goes on locally."""

    reason: str
    continuing: str | None
    tokens_so_far: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Done:
    """The answer is complete."""

    finish_reason: str | None
    usage: dict[str, int]
    timings: dict[str, Any]
    pipeline: list[str]
    failovers: int
    fallback: bool
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def text_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))


@dataclass(frozen=True)
class OtherFrame:
    """A frame type this client version does not know (newer node); kept, not dropped."""

    type: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


ChatFrame = TokenDelta | ShardStatus | ShardFailover | PipelineAborted | Done | OtherFrame


def parse_frame(f: dict[str, Any]) -> ChatFrame:
    """The typed frame of one wire map.

    Raises:
        HearthNetError: the matching class of an ``error`` frame's code.
    """
    kind = str(f.get("type"))
    if kind == "token_delta":
        return TokenDelta(str(f.get("text", "")), int(f.get("token_id", -1)),
                          int(f.get("index", -1)), f)
    if kind == "shard_status":
        return ShardStatus(str(f.get("shard_id")), str(f.get("status")), f.get("code"),
                           f.get("message"), f)
    if kind == "shard_failover":
        return ShardFailover(str(f.get("failed")), list(f.get("replacement", [])),
                             list(f.get("pipeline", [])), float(f.get("ms", 0.0)), f)
    if kind == "pipeline_aborted":
        return PipelineAborted(str(f.get("reason", "")), f.get("continuing"),
                               int(f.get("tokens_so_far", 0)), f)
    if kind == "done":
        return Done(f.get("finish_reason"), dict(f.get("usage", {})),
                    dict(f.get("timings", {})), list(f.get("pipeline", [])),
                    int(f.get("failovers", 0)), bool(f.get("fallback", False)), f)
    if kind == "error":
        details = f.get("details") if isinstance(f.get("details"), dict) else {}
        raise error_from_code(str(f.get("code")), str(f.get("message")), details)
    return OtherFrame(kind, f)


class HearthNetClient:
    """A host app's handle on one node's capabilities.

    Args:
        uri: the node's bus base URI — its loopback admin listener (``ws://127.0.0.1:P``,
            in the ``node_ready`` line and ``<data_dir>/node.json``) or a plaintext node.
        model: the default model of `chat`.
        open_timeout: seconds to reach the node.
    """

    def __init__(self, uri: str, *, model: str = "smollm2", open_timeout: float = 10.0
                 ) -> None:
        self.uri = uri.rstrip("/")
        self.model = model
        self.open_timeout = open_timeout
        self._calls: weakref.WeakSet[AsyncGenerator[ChatFrame, None]] = weakref.WeakSet()

    @classmethod
    def from_config(cls, config: str | Path, **kwargs: Any) -> HearthNetClient:
        """The client of the running node of a config file (reads its ``node.json``)."""
        from hearthnet.commands.remote import node_uri

        return cls(node_uri(str(config)), **kwargs)

    async def __aenter__(self) -> HearthNetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Abandon every call still running (their shard sessions are closed)."""
        for call in list(self._calls):
            with contextlib.suppress(Exception):
                await call.aclose()

    def chat(self, messages: list[dict[str, str]] | str, *, model: str | None = None,
             max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, stop: list[str] | None = None,
             **params: Any) -> AsyncGenerator[ChatFrame, None]:
        """Stream one distributed chat (M26 §4.3) as typed frames.

        `messages` is a list of ``{"role", "content"}`` or one user prompt. `params` are
        the spec's call parameters (``fallback_to_local``, ``wire_dtype``, ``timeout_s``,
        ``max_shards``, ``weights``: which shard formats the call accepts, issue 12).
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a prompt or a non-empty list of "
                             "{role, content}")
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "top_k": top_k, "seed": seed, "stop": list(stop or [])}
        args = {"request": {"model": model or self.model, "messages": messages},
                "params": {"sampling": sampling, **params}}
        call = self._run(args)
        self._calls.add(call)
        return call

    async def _run(self, args: dict[str, Any]) -> AsyncGenerator[ChatFrame, None]:
        ended = False
        async with contextlib.aclosing(bus_call(self.uri, CHAT_CAPABILITY, args,
                                                open_timeout=self.open_timeout)) as it:
            async for raw in it:
                frame = parse_frame(raw)  # an error frame raises here
                ended = isinstance(frame, Done)
                yield frame
        if not ended:
            raise ConnectionLost(f"the call to {self.uri} ended without its done frame")

    async def answer(self, messages: list[dict[str, str]] | str, **kwargs: Any
                     ) -> tuple[str, Done]:
        """The whole answer text and its `Done` frame (a convenience over `chat`)."""
        parts: list[str] = []
        done: Done | None = None
        async with contextlib.aclosing(self.chat(messages, **kwargs)) as frames:
            async for f in frames:
                if isinstance(f, TokenDelta):
                    parts.append(f.text)
                elif isinstance(f, Done):
                    done = f
        assert done is not None  # _run raises ConnectionLost otherwise
        return "".join(parts), done
