"""Gossip of the event log between nodes over a WebSocket feed (M26 §5.1).

Wire (one msgpack map per binary WebSocket message)::

    {"k": "hello", "v": 1, "node": <node id>, "vector": {origin: max_seq}}
    {"k": "events", "events": [<Event.to_wire()>, ...]}

Both ends of a connection behave the same way, whoever dialled:

1. Send ``hello`` with our vector; the first message received must be the peer's
   ``hello`` (within `HELLO_TIMEOUT_S`).
2. Catch-up: send every event the peer's vector lacks (`EventLog.since`), in batches of
   at most `MAX_BATCH_BYTES`, each origin in seq order.
3. Live: push every event this node newly stores (appended here *or ingested from any
   other peer*), which relays events through intermediate nodes (A–B–C: A's events reach
   C through B). Events the peer is known to hold (it sent them, or we did) are skipped.
4. Ingest what the peer sends; duplicates are dropped by the log.

Subscribing to the log and computing the catch-up happen in one synchronous step, so no
event falls between them. A connection whose live queue overflows (a peer that cannot
keep up) is closed; the reconnect's catch-up fills the gap. Malformed messages and events
are dropped and counted (``events_rejected_total{reason}``); a peer sending too many is
disconnected. Nothing here raises into the server: `handle_gossip_connection` returns
when the connection ends, whatever happened.

The message codec (`encode_hello`, `encode_events`, `decode_message`) is pure; the
asyncio session and `GossipPeerLink` (the dialling side, with bounded exponential
backoff) sit on top of `websockets`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from hearthnet import safe_msgpack
from hearthnet.background import detach
from hearthnet.constants import CloseCode
from hearthnet.errors import AuthError, HearthNetError, PeerDataError, ProtocolError, Refused
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.observability import get_logger
from hearthnet.security.tls import tls_refusals

GOSSIP_PATH = "/gossip"
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1024 * 1024  # websockets max_size for gossip connections
MAX_BATCH_BYTES = 256 * 1024
MAX_BATCH_EVENTS = 512
HELLO_TIMEOUT_S = 10.0
# A close (a policy close above all) is sent at once; a peer that has not completed the
# close handshake within this is cut off. websockets' default, 10 s, is what a flooding
# peer waited for its 1008 before: its close reply sits unread behind the
# flood, so the handshake never completes. Servers of `/gossip` pass it as `close_timeout`.
CLOSE_TIMEOUT_S = 2.0
LIVE_QUEUE_MAX = 10_000
MAX_MALFORMED = 32  # malformed messages tolerated per connection before closing it


_log = get_logger("mesh.gossip")


# ---- codec (pure) ----

@dataclass(frozen=True, slots=True)
class Hello:
    """First message of each side: who we are and what we hold."""

    node: str
    vector: dict[str, int]


@dataclass(frozen=True, slots=True)
class Events:
    """A batch of events; `malformed` counts the elements that did not parse."""

    events: list[Event]
    malformed: int = 0


GossipMessage = Hello | Events


def encode_hello(node: str, vector: Mapping[str, int]) -> bytes:
    return safe_msgpack.packb({"k": "hello", "v": PROTOCOL_VERSION, "node": node,
                               "vector": dict(vector)})


def encode_events(events: Iterable[Event]) -> bytes:
    return safe_msgpack.packb({"k": "events", "events": [e.to_wire() for e in events]})


def batch_events(events: Iterable[Event], *, max_bytes: int = MAX_BATCH_BYTES,
                 max_events: int = MAX_BATCH_EVENTS) -> Iterator[bytes]:
    """Encode `events` as ``events`` messages of at most `max_bytes` (order kept).

    One event is never split; an event alone larger than `max_bytes` (impossible for
    events within `MAX_PAYLOAD_BYTES`) gets a message of its own.
    """
    batch: list[Event] = []
    size = 0
    for ev in events:
        n = len(safe_msgpack.packb(ev.to_wire()))
        if batch and (size + n > max_bytes or len(batch) >= max_events):
            yield encode_events(batch)
            batch, size = [], 0
        batch.append(ev)
        size += n
    if batch:
        yield encode_events(batch)


def decode_message(data: bytes | str) -> GossipMessage:
    """Parse one gossip message.

    Raises:
        ProtocolError: not msgpack, not a known message, wrong version or bad fields.
            Malformed *events* inside a valid batch do not raise: they are counted in
            `Events.malformed`.
    """
    if not isinstance(data, bytes):
        raise ProtocolError("gossip messages are binary")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"gossip message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = safe_msgpack.unpackb(data)
    except ValueError as e:  # all that safe_msgpack raises for malformed input
        raise ProtocolError(f"gossip message is not msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("gossip message is not a map")
    kind = msg.get("k")
    if kind == "hello":
        return _decode_hello(msg)
    if kind == "events":
        raw = msg.get("events")
        if not isinstance(raw, list):
            raise ProtocolError("events message without an events list")
        events: list[Event] = []
        bad = 0
        for item in raw:
            try:
                events.append(Event.from_wire(item))
            except PeerDataError:
                bad += 1
        return Events(events, bad)
    raise ProtocolError(f"unknown gossip message kind {kind!r}")


def _decode_hello(msg: dict[str, Any]) -> Hello:
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"gossip version {msg.get('v')!r} is not {PROTOCOL_VERSION}")
    node, vector = msg.get("node"), msg.get("vector")
    if not isinstance(node, str) or not node:
        raise ProtocolError("hello without a node id")
    if not isinstance(vector, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in vector.items()):
        raise ProtocolError("hello vector must map origins to seqs >= 0")
    return Hello(node, vector)


# ---- asyncio session ----

class GossipConnection(Protocol):
    """What a gossip session needs of a connection (websockets' Server/ClientConnection)."""

    async def send(self, message: bytes) -> None: ...

    async def recv(self) -> str | bytes: ...

    async def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None: ...


PeerCallback = Callable[[str, bool], None]


class _Closing(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class _WrongPeer(_Closing):
    """The hello names another node than the one we meant to reach (or ourselves)."""

    def __init__(self, reason: str) -> None:
        super().__init__(CloseCode.POLICY_VIOLATION, reason)


# how a link that does not redial (`GossipPeerLink(redial=False)`) ended: refused
# authentication or answered by another node / unreachable / connected, then closed
LinkEnd = Literal["refused", "unreachable", "closed"]
EndCallback = Callable[[LinkEnd, bool], None]  # (how, held stable_after_s or longer)


async def run_gossip_session(log: EventLog, ws: GossipConnection, *,
                             on_hello: Callable[[str], None] | None = None,
                             expect_peer: str | None = None) -> str:
    """Run one gossip connection until it ends; returns the peer's node id.

    Raises whatever ends the connection (`ConnectionClosed`, `OSError`,
    `ProtocolError` for a bad hello, ...); `handle_gossip_connection` and
    `GossipPeerLink` turn those into a logged, closed connection.
    """
    await ws.send(encode_hello(log.node_id, log.vector()))
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
        # arrives as the awaited call completes, and a link told to stop then never stops
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            first = await ws.recv()
    except TimeoutError:
        raise _Closing(CloseCode.POLICY_VIOLATION, "no hello") from None
    try:
        hello = decode_message(first)
    except ProtocolError as e:
        _count(log, "malformed_message")
        raise _Closing(CloseCode.PROTOCOL_ERROR, e.message) from None
    if not isinstance(hello, Hello):
        raise _Closing(CloseCode.PROTOCOL_ERROR, "first message must be hello")
    if hello.node == log.node_id:
        raise _WrongPeer("connected to self")
    if expect_peer is not None and hello.node != expect_peer:  # no member may pose as another
        _count(log, "hello_not_peer")
        raise _WrongPeer("hello node id is not the TLS peer")
    if on_hello is not None:
        on_hello(hello.node)

    peer_known = dict(hello.vector)
    queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=LIVE_QUEUE_MAX)
    overflow = asyncio.Event()

    def on_event(ev: Event) -> None:
        try:
            queue.put_nowait(ev)
        except asyncio.QueueFull:
            overflow.set()

    unsubscribe = log.subscribe(on_event)
    # same synchronous step as subscribe: no gap. Paged: one page in memory, not the log
    backlog = log.since_pages(dict(peer_known), log.vector())
    sender = asyncio.create_task(_send_loop(ws, backlog, queue, peer_known))
    overflowed = asyncio.create_task(overflow.wait())
    receiver = asyncio.create_task(_recv_loop(log, ws, peer_known))
    try:
        done, _ = await asyncio.wait({sender, receiver, overflowed},
                                     return_when=asyncio.FIRST_COMPLETED)
        if overflowed in done:
            raise _Closing(CloseCode.TRY_AGAIN_LATER, "live queue overflow; reconnect to catch up")
        for t in done:
            t.result()  # re-raise the reason the connection ended
    finally:
        unsubscribe()
        for t in (sender, receiver, overflowed):
            t.cancel()
        await asyncio.gather(sender, receiver, overflowed, return_exceptions=True)
    return hello.node


async def _send_loop(ws: GossipConnection, backlog: Iterable[list[Event]],
                     queue: asyncio.Queue[Event], peer_known: dict[str, int]) -> None:
    for page in backlog:
        await _send_events(ws, page, peer_known)
    while True:
        batch = [await queue.get()]
        while not queue.empty() and len(batch) < MAX_BATCH_EVENTS:
            batch.append(queue.get_nowait())
        await _send_events(ws, batch, peer_known)


async def _send_events(ws: GossipConnection, events: list[Event],
                       peer_known: dict[str, int]) -> None:
    fresh = [e for e in events if e.seq > peer_known.get(e.origin, 0)]
    for e in fresh:
        peer_known[e.origin] = max(peer_known.get(e.origin, 0), e.seq)
    for message in batch_events(fresh):
        await ws.send(message)


async def _recv_loop(log: EventLog, ws: GossipConnection, peer_known: dict[str, int]) -> None:
    malformed = 0
    while True:
        data = await ws.recv()
        msg: GossipMessage | None
        try:
            msg = decode_message(data)
        except ProtocolError as err:
            msg = None
            _count(log, "malformed_message")
            _log.warning("gossip_malformed_message", node=log.node_id, error=err.message)
        if isinstance(msg, Hello):
            _count(log, "malformed_message")
            msg = None
        if msg is None:
            malformed += 1
            if malformed > MAX_MALFORMED:
                raise _Closing(CloseCode.POLICY_VIOLATION, "too many malformed messages")
            continue
        for _ in range(msg.malformed):
            _count(log, "malformed")
        for e in msg.events:
            peer_known[e.origin] = max(peer_known.get(e.origin, 0), e.seq)
        log.ingest_many(msg.events)


def _count(log: EventLog, reason: str) -> None:
    if log.metrics is not None:
        log.metrics.events_rejected_total.labels(reason=reason).inc()


async def handle_gossip_connection(log: EventLog, ws: GossipConnection, *,
                                   on_peer: PeerCallback | None = None,
                                   expect_peer: str | None = None) -> None:
    """Serve one incoming `/gossip` WebSocket connection until it ends (never raises).

    Args:
        log: this node's event log.
        ws: the accepted connection (the node daemon routes request path ``/gossip``
            here; its server should use ``max_size=MAX_MESSAGE_BYTES``).
        on_peer: called ``(peer_node_id, True)`` after the hello and
            ``(peer_node_id, False)`` when the connection ends.
    """
    peer: list[str] = []

    def hello(node: str) -> None:
        peer.append(node)
        _log.info("gossip_peer_connected", node=log.node_id, peer=node, side="server")
        if on_peer is not None:
            on_peer(node, True)

    try:
        await run_gossip_session(log, ws, on_hello=hello, expect_peer=expect_peer)
    except Exception as e:  # a server handler must never raise
        await _close_for(ws, e, log, peer[0] if peer else None)
    finally:
        if peer:
            _log.info("gossip_peer_disconnected", node=log.node_id, peer=peer[0])
            if on_peer is not None:
                on_peer(peer[0], False)


async def _close_for(ws: GossipConnection, e: BaseException, log: EventLog,
                     peer: str | None) -> None:
    if isinstance(e, _Closing):
        _log.warning("gossip_closing", node=log.node_id, peer=peer, reason=e.reason)
        with contextlib.suppress(Exception):
            await ws.close(e.code, e.reason)
        return
    if not isinstance(e, (ConnectionClosed, OSError)):
        if isinstance(e, HearthNetError):  # e.g. a peer over its message rate
            _log.warning("gossip_error", node=log.node_id, peer=peer, error=e.message)
            with contextlib.suppress(Exception):
                await ws.close(CloseCode.POLICY_VIOLATION, e.code)
            return
        _log.exception("gossip_failed", node=log.node_id, peer=peer)
        with contextlib.suppress(Exception):
            await ws.close(CloseCode.INTERNAL_ERROR, "internal error")


class GossipPeerLink:
    """Keeps one outgoing gossip connection to `<uri>/gossip` alive.

    Dials, runs the session (catch-up both ways, then live push), and on any failure
    waits and dials again with exponential backoff from `min_backoff` to `max_backoff`
    seconds (±20 % jitter), reset only after a connection that got past the hello and
    then held for `stable_after_s` seconds: a peer that answers the hello and fails at once
    cannot make the link redial in a tight loop.

    Args:
        log: this node's event log.
        uri: the peer's base URI (``ws://host:port``), as in the config's ``peers``.
        connect_kwargs: extra arguments for `websockets.asyncio.client.connect`
            (``ssl=``, ``additional_headers=`` ... for the security work).
        on_peer: called ``(peer_node_id, True/False)`` on connect / disconnect.
        ssl_factory: builds the ``ssl=`` context for each dial, so a dial reflects the
            current member list (mutual TLS pinned to member keys).
        check_peer: called with the open connection before the session; raising (e.g.
            `AuthError` from `tls.peer_node_id`) drops it and retries with backoff.
        expect_peer: the member this link must reach: a hello naming another node is
            refused (in plaintext mode the only check; with TLS `check_peer` pins it too).
        redial: False for a link that a `mesh.links.LinkKeeper` manages: it makes one
            connection, never dials again, and reports how it ended to `on_end`; the keeper
            decides whether and when to dial again (its backoff is per member).
        on_end: with ``redial=False``, called once with ``(how, held)`` when the link ends
            by itself (not by `stop`): ``how`` is ``"refused"`` (authentication failed, or
            the peer is another node than `expect_peer`), ``"unreachable"`` or ``"closed"``
            (it connected, then the connection ended); ``held``: it stayed up at least
            `stable_after_s`.
    """

    def __init__(self, log: EventLog, uri: str, *, min_backoff: float = 0.2,
                 max_backoff: float = 10.0, open_timeout: float = 5.0,
                 stable_after_s: float = 5.0,
                 connect_kwargs: Mapping[str, Any] | None = None,
                 on_peer: PeerCallback | None = None,
                 ssl_factory: Callable[[], Any] | None = None,
                 check_peer: Callable[[Any], object] | None = None,
                 expect_peer: str | None = None, redial: bool = True,
                 on_end: EndCallback | None = None) -> None:
        self.log = log
        self.uri = uri.rstrip("/")
        self.expect_peer, self.redial, self._on_end = expect_peer, redial, on_end
        self.min_backoff, self.max_backoff = min_backoff, max(min_backoff, max_backoff)
        self.stable_after_s = stable_after_s
        self.open_timeout = open_timeout
        self._connect_kwargs = dict(connect_kwargs or {})
        self._on_peer = on_peer
        self._ssl_factory = ssl_factory
        self._check_peer = check_peer
        self._task: asyncio.Task[None] | None = None
        self._ws: Any = None  # the open connection, if any
        self._connected = asyncio.Event()
        self.peer_id: str | None = None
        self.failures = 0

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        """Start dialling (needs a running event loop; idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"gossip-link:{self.uri}")

    async def stop(self) -> None:
        """Close the connection and stop reconnecting."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._connected.clear()

    def drop_connection(self) -> None:
        """Close the current connection (its member was removed); the link redials with
        backoff and the member check refuses it while it is not a member."""
        if self._ws is not None:
            detach(self._ws.close(CloseCode.POLICY_VIOLATION, "member removed"))

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until the hello exchange succeeded; False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self._connected.wait()
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        delay = self.min_backoff
        kwargs: dict[str, Any] = {"open_timeout": self.open_timeout,
                                  "max_size": MAX_MESSAGE_BYTES, "compression": None,
                                  "proxy": None, "close_timeout": CLOSE_TIMEOUT_S}
        kwargs.update(self._connect_kwargs)
        while True:
            reached_hello = refused = False
            lasted = 0.0
            hello_at = time.monotonic()
            try:
                if self._ssl_factory is not None:
                    kwargs["ssl"] = self._ssl_factory()
                with tls_refusals(self.uri):  # ssl.SSLError: an AuthError (a Refused)
                    ws = await connect(self.uri + GOSSIP_PATH, **kwargs)
                async with ws:
                    expect = self.expect_peer
                    if self._check_peer is not None:
                        who = self._check_peer(ws)
                        if isinstance(who, str) and expect is not None and who != expect:
                            raise AuthError(f"{self.uri} is {who}, not {expect}",
                                            reason="unexpected_peer", peer=who)
                        expect = who if isinstance(who, str) else expect
                    self._ws = ws
                    def hello(node: str) -> None:
                        nonlocal reached_hello
                        reached_hello = True
                        self.peer_id = node
                        self._connected.set()
                        _log.info("gossip_peer_connected", node=self.log.node_id, peer=node,
                                  uri=self.uri, side="client")
                        if self._on_peer is not None:
                            self._on_peer(node, True)
                    try:
                        hello_at = time.monotonic()
                        await run_gossip_session(self.log, ws, on_hello=hello,
                                                 expect_peer=expect)
                    except Exception as e:
                        refused = isinstance(e, _WrongPeer)  # another node answered
                        await _close_for(ws, e, self.log, self.peer_id)
                    finally:
                        self._ws = None
                        lasted = time.monotonic() - hello_at
            except asyncio.CancelledError:
                self._disconnected(reached_hello)
                raise
            except Refused as e:
                refused = isinstance(e, AuthError)
                self.failures += 1
                _log.warning("gossip_peer_refused", node=self.log.node_id, uri=self.uri,
                             error=e.message)
            except (OSError, WebSocketException, TimeoutError, HearthNetError) as e:
                self.failures += 1
                _log.debug("gossip_dial_failed", node=self.log.node_id, uri=self.uri,
                           error=f"{type(e).__name__}: {e}")
            except Exception:  # never let the link die: log and retry
                self.failures += 1
                _log.exception("gossip_link_failed", node=self.log.node_id, uri=self.uri)
            self._disconnected(reached_hello)
            held = reached_hello and lasted >= self.stable_after_s
            if not self.redial:  # the keeper decides about the next dial
                how: LinkEnd = "refused" if refused else \
                    "closed" if reached_hello else "unreachable"
                if self._on_end is not None:
                    self._on_end(how, held)
                return
            if held:
                delay = self.min_backoff  # only a link that held resets the backoff (§6)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(self.max_backoff, delay * 2)

    def _disconnected(self, reached_hello: bool) -> None:
        if not self._connected.is_set():
            return
        self._connected.clear()
        if reached_hello:
            _log.info("gossip_peer_disconnected", node=self.log.node_id, peer=self.peer_id,
                      uri=self.uri)
            if self._on_peer is not None and self.peer_id is not None:
                self._on_peer(self.peer_id, False)
