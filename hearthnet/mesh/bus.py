"""CapabilityBus: named capabilities, callable in-process and over the node's `/bus` feed.

A capability is an async-iterator function `handler(args: dict) -> AsyncIterator[dict]`.
Over WebSocket the caller sends one msgpack map ``{"capability": name, "args": {...}}``
and receives one msgpack map per frame, then ``{"type": "end"}``. A `HearthNetError` becomes
an ``{"type": "error", "code", "message"}`` frame; any other exception becomes an
``internal`` error frame (its traceback goes to this node's log, never to the caller), so
every call ends with an error or its last frame, then ``end``. A caller that disconnects
cancels the call (the handler's `finally` blocks run, so shard sessions are closed). At the
caller, `bus_call` raises `ConnectionLost` for a call that ends without its ``end`` frame:
a truncated answer never looks like a complete one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from hearthnet import safe_msgpack
from hearthnet.errors import (
    AuthError,
    BadRequest,
    ConnectionLost,
    HearthNetError,
    InternalError,
    ProtocolError,
)
from hearthnet.frames import ErrorFrame, from_wire
from hearthnet.observability import get_logger
from hearthnet.security.tls import tls_refusals

log = get_logger("bus")

Handler = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]
MAX_REQUEST_BYTES = 1 << 20
BUS_PATH = "/bus"  # the node's capability feed (main and admin listeners)
# (capability, caller or None) -> None; raises AuthError to refuse a call before any work
Authorizer = Callable[[str, "str | None"], None]


class CapabilityBus:
    """The capabilities one node offers."""

    def __init__(self, metrics: Any = None) -> None:
        self._handlers: dict[str, Handler] = {}
        self.metrics = metrics  # `Metrics`: calls by capability, caller and result

    def register(self, name: str, handler: Handler) -> None:
        self._handlers[name] = handler

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def call(self, name: str, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Call a capability in-process."""
        h = self._handlers.get(name)
        if h is None:
            raise BadRequest(f"unknown capability {name!r}; this node offers {self.names()}")
        return h(args)

    async def serve_connection(self, ws: Any, *, caller: str | None = None,
                               authorize: Authorizer | None = None) -> None:
        """Serve one `/bus` WebSocket connection (one call); never raises.

        `caller` is the authenticated member at the other end (None: the local CLI or a
        plaintext mesh); `authorize(capability, caller)` raises `AuthError` to refuse the
        call before any work, so a guest cannot chat under this node's identity.
        """
        capability = None
        label, result = "malformed", "error"
        try:
            req = _request(await ws.recv())
            capability = req["capability"]
            label = capability if capability in self._handlers else "unknown"
            if authorize is not None:
                try:
                    authorize(capability, caller)
                except AuthError:
                    result = "refused"
                    raise
            it = self.call(capability, req.get("args", {}))
            try:
                async for frame in it:
                    await ws.send(safe_msgpack.packb(frame))
            finally:
                with contextlib.suppress(Exception):
                    await it.aclose()  # type: ignore[attr-defined]
            await ws.send(safe_msgpack.packb({"type": "end"}))
            result = "ok"
        except HearthNetError as e:
            await _send_error(ws, e)
        except ConnectionClosed:
            log.info("bus_caller_gone")
        except Exception:  # a bug: the caller gets a typed ending, the log the traceback
            log.exception("bus_call_failed", capability=capability)
            await _send_error(ws, InternalError(
                f"internal error in {capability!r} on this node; see its log"))
        finally:
            if self.metrics is not None:  # the caller's identity is a metric label (§4)
                self.metrics.bus_calls_total.labels(label, caller or "local", result).inc()
            with contextlib.suppress(Exception):
                await ws.close()


def _request(raw: bytes | str) -> dict[str, Any]:
    """A bus call's request map; `BadRequest` for anything else (before any work)."""
    try:
        req = safe_msgpack.unpackb(raw) if isinstance(raw, bytes) else None
    except ValueError as e:
        raise BadRequest(f"malformed bus call: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("capability"), str) \
            or not isinstance(req.get("args", {}), dict):
        raise BadRequest("a bus call is a msgpack map {capability, args}")
    return req


async def bus_call(uri: str, capability: str, args: dict[str, Any], *,
                   open_timeout: float = 10.0, ssl: Any = None
                   ) -> AsyncGenerator[dict[str, Any], None]:
    """Call `capability` on the node at base URI `uri`; yields its frames.

    An `error` frame is yielded as is (callers decide); a lost connection raises
    `ConnectionLost`, a failed TLS handshake an `AuthError` (reason ``tls_handshake``).
    """
    try:
        # a node busy loading a model may answer pings late: only a dead one is lost
        with tls_refusals(uri):  # ssl.SSLError: an AuthError ``tls_handshake``
            ws = await connect(uri.rstrip("/") + BUS_PATH, open_timeout=open_timeout, ssl=ssl,
                               max_size=MAX_REQUEST_BYTES, compression=None, ping_timeout=60)
        async with ws:
            await ws.send(safe_msgpack.packb({"capability": capability, "args": args}))
            async for raw in ws:
                frame = _frame(raw)
                if frame.get("type") == "end":
                    return
                yield frame
        raise ConnectionLost(f"the node at {uri} ended the call without its end frame")
    except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as e:
        raise ConnectionLost(f"cannot reach the node at {uri}: {e}") from e
    except ConnectionClosed as e:
        raise ConnectionLost(f"the node at {uri} closed the call: {e}") from e


def _frame(raw: bytes | str) -> dict[str, Any]:
    """One frame of a bus reply; `ProtocolError` unless it is a msgpack map."""
    try:
        frame = safe_msgpack.unpackb(raw) if isinstance(raw, bytes) else None
    except ValueError as e:
        raise ProtocolError(f"malformed bus frame: {e}") from None
    if not isinstance(frame, dict):
        raise ProtocolError("a bus frame is a msgpack map")
    return frame


async def _send_error(ws: Any, err: HearthNetError) -> None:
    """The call's last frames: the typed error, then ``end``."""
    with contextlib.suppress(ConnectionClosed):
        await ws.send(safe_msgpack.packb(ErrorFrame.of(err).to_wire()))
        await ws.send(safe_msgpack.packb({"type": "end"}))


def raise_for_error(frame: dict[str, Any]) -> None:
    """Raise the HearthNet error an `error` frame carries (`PeerDataError` for a malformed
    one)."""
    error = from_wire(frame) if frame.get("type") == "error" else None
    if isinstance(error, ErrorFrame):
        raise error.exception()
