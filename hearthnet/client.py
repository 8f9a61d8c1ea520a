"""`HearthNetClient`: call `experimental.distributed_llm.chat` from a host app (M26 §4.3).

    async with HearthNetClient.from_config("config/mesh3/node-a.toml") as hn:
        async for frame in hn.chat([{"role": "user", "content": "Hi"}], max_tokens=32):
            if isinstance(frame, TokenDelta):
                print(frame.text, end="", flush=True)

The client speaks the node's capability bus (``/bus``, msgpack frames) and turns each frame
into its type in `hearthnet.frames`, the node's own definition (`TokenDelta`, `ShardStatus`,
`ShardFailover`, `WireWidened`, `PipelineAborted`, `Done`; `to_wire()` gives the map back).
A frame of a type this version does not know (a newer node's) is an `OtherFrame`; a
malformed one raises `PeerDataError`. An ``error`` frame raises the matching
`hearthnet.errors` class (the spec's codes: `BadRequest`, `ShardUnavailable`,
`PipelineStalled` …); a call that ends without ``done`` or ``error`` raises `ConnectionLost`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from hearthnet.errors import BadRequest, ConnectionLost
from hearthnet.frames import (
    Done,
    ErrorFrame,
    OtherFrame,
    PipelineAborted,
    ShardFailover,
    ShardStatus,
    TokenDelta,
    WireWidened,
    read_frame,
)
from hearthnet.mesh.bus import bus_call
from hearthnet.node.admin import node_uri
from hearthnet.node.capabilities import CHAT_CAPABILITY

# the frame types are re-exported: a host app imports them from here (docs/api.md)
__all__ = ["ChatFrame", "Done", "HearthNetClient", "OtherFrame", "PipelineAborted",
           "ShardFailover", "ShardStatus", "TokenDelta", "WireWidened", "parse_frame"]


ChatFrame = (TokenDelta | ShardStatus | ShardFailover | WireWidened | PipelineAborted | Done
             | OtherFrame)


def parse_frame(raw: dict[str, Any]) -> ChatFrame:
    """The typed frame of one wire map (`hearthnet.frames.read_frame`).

    Raises:
        HearthNetError: the matching class of an ``error`` frame's code.
        PeerDataError: a malformed frame.
    """
    frame = read_frame(raw)
    if isinstance(frame, ErrorFrame):
        raise frame.exception()
    return frame


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
        ``max_shards``, ``weights``: which shard formats the call accepts, DESIGN.md decision 10;
        ``speculate``: ``lookup``, ``draft`` or ``off``, DESIGN.md decision 16).
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
