"""Tensor streams over WebSocket: the asyncio adapter around `protocol` (docs/protocol.md §1, §8).

This module only moves bytes between a `websockets` connection and a `StreamProtocol`,
and owns the clock: every wait has a deadline, and a step that does not complete within
its deadline raises `StreamStalled` (the hook failover uses, M26 §5.4). Everything else —
frames, states, credit — is decided by the pure protocol.

Per session there is one reader task: it feeds each received message to the protocol and
never waits on a write, so CREDIT frames keep flowing however full the send buffers are.
Writes go through one lock, in the protocol's order. A sender whose credit is exhausted
waits for CREDIT (at most ``window`` chunks are ever in flight, so a slow receiver never
makes the sender buffer without bound); ``websockets`` refuses a message larger than one
chunk plus header before buffering it (``max_size``); compression is off; asyncio and
uvloop both set TCP_NODELAY on their TCP sockets.

Client side: `TensorChannel.connect`. Server side: `ServerStream.accept_open` on a
connection the node's own websockets server accepted (routing by path is the node's),
or `serve` for a stand-alone server (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl as _ssl
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from websockets.asyncio.client import connect as _ws_connect
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as _ws_serve
from websockets.exceptions import (
    ConnectionClosed,
    ConnectionClosedOK,
    InvalidURI,
    WebSocketException,
)
from websockets.http11 import Request, Response

from hearthnet.constants import (
    DEFAULT_TIMEOUT_S,
    MAX_TENSOR_BYTES,
    TENSOR_CHUNK_BYTES,
    TENSOR_FLOW_CONTROL_WINDOW,
    CloseCode,
)
from hearthnet.errors import (
    BadRequest,
    ConnectionLost,
    HearthNetError,
    InternalError,
    StreamStalled,
)
from hearthnet.observability import Metrics, get_logger
from hearthnet.security.tls import tls_refusals
from hearthnet.transport.codec import max_frame_bytes
from hearthnet.transport.protocol import (
    Accepted,
    CloseReceived,
    CreditReceived,
    ErrorReceived,
    Event,
    OpenRequested,
    PingReceived,
    PongReceived,
    ProtocolFailed,
    Role,
    StepReceived,
    StreamProtocol,
)

__all__ = ["ServerStream", "StepInput", "StepResult", "TensorChannel", "handle_stream",
           "serve"]

DEFAULT_DEADLINE_S = DEFAULT_TIMEOUT_S
"""Default per-step deadline: `DISTRIBUTED_SHARD_HEALTH_TIMEOUT_S` (M26 §5.4)."""

SHARD_PATH = "/shard"
"""Request path of tensor sessions on a node's WebSocket server (docs/protocol.md §1)."""

BUSY_STEP_FACTOR = 20.0
"""A client step re-armed by its shard's progress PINGs (docs/protocol.md §3.6a) ends at
the latest this many deadlines after it began (10 minutes at the default 30 s: eight
1,000-token prompts queued on a busy 2-core shard took over 4), so a shard that only ever
PINGs is stalled all the same."""

PROGRESS_EVERY_S = 1.0
"""A shard PINGs a session whose step waits behind progressing work at most this often,
and only once the step has waited this long: a prompt step costs no extra frame."""

_NOT_SENT = "step {step} could not be sent before the deadline: the peer returned no credit"
_NOT_RECEIVED = "no complete step arrived before the deadline"
_CLOSE_GRACE_S = 2.0  # how long a closing or failing session waits for the peer
_log = get_logger("transport")


@dataclass(frozen=True, slots=True)
class StepResult:
    """A shard's output for one step, as the client receives it.

    ``compute_us`` is the shard's own compute time from the OUTPUT header, so the caller
    can tell network overhead from compute (M26 §8.4).
    """

    step: int
    start_pos: int
    tensor: torch.Tensor = field(repr=False)  # (batch, tokens, hidden), wire dtype
    compute_us: int


@dataclass(frozen=True, slots=True)
class StepInput:
    """A step's input, as the shard receives it."""

    step: int
    start_pos: int
    tensor: torch.Tensor = field(repr=False)  # (batch, tokens, hidden), wire dtype


class _Session:
    """The I/O of one `StreamProtocol` over one websockets connection."""

    def __init__(self, ws: Connection, proto: StreamProtocol, deadline_s: float,
                 metrics: Metrics | None) -> None:
        self._ws = ws
        self._proto = proto
        self.deadline_s = deadline_s
        # the byte counters, looked up once (DESIGN.md hot path rules: every frame counts)
        self._bytes_in = metrics.transport_bytes_in_total if metrics is not None else None
        self._bytes_out = metrics.transport_bytes_out_total if metrics is not None else None
        self._loop = asyncio.get_running_loop()
        self._ready: deque[StepReceived | HearthNetError] = deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._credit = asyncio.Event()
        self._handshake: asyncio.Future[Event] = self._loop.create_future()
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._ping_nonce = 0
        self._step_timer: asyncio.Timeout | None = None  # a client step re-armed by PINGs
        self._step_window = 0.0
        self._step_limit_at = 0.0
        self.progress_pings = 0  # PINGs received while a step waited (client side)
        self._last_progress = 0.0  # when this server last PINGed progress
        self._failure: HearthNetError | None = None  # why the session can no longer be used
        self._peer_closed = False
        self._write_lock = asyncio.Lock()
        self._flusher: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._reader = self._loop.create_task(self._read_loop())

    # -- public to both ends -------------------------------------------------------------

    @property
    def window(self) -> int:
        """The agreed credit window in chunks."""
        return self._proto.window

    @property
    def chunk_bytes(self) -> int:
        """The agreed chunk size."""
        return self._proto.chunk_bytes

    @property
    def max_tensor_bytes(self) -> int:
        """The agreed largest tensor."""
        return self._proto.max_tensor_bytes

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype every tensor has on this stream."""
        return self._proto.wire_dtype.torch_dtype

    @property
    def stream_id(self) -> int:
        return self._proto.stream_id

    @property
    def connection(self) -> Connection:
        """The underlying websockets connection (addresses, close code, headers)."""
        return self._ws

    @property
    def protocol(self) -> StreamProtocol:
        """The pure protocol state (counters, credit, state) — read only."""
        return self._proto

    @property
    def closed(self) -> bool:
        """Whether the session has ended (closed by either side or failed)."""
        return self._failure is not None or self._peer_closed

    async def ping(self, deadline_s: float | None = None) -> float:
        """Round-trip a PING through the peer's protocol layer; return the seconds taken.

        Raises:
            StreamStalled: no PONG within the deadline. ConnectionLost: the session ended.
        """
        self._check_usable()
        self._ping_nonce += 1
        nonce = self._ping_nonce
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pings[nonce] = fut
        start = self._loop.time()
        timeout = self.deadline_s if deadline_s is None else deadline_s
        try:
            async with asyncio.timeout(timeout):
                self._proto.send_ping(nonce)
                await self._flush()
                await fut
        except TimeoutError:
            raise self._stalled(f"no PONG within {timeout:g} s") from None
        finally:
            self._pings.pop(nonce, None)
        return self._loop.time() - start

    async def close(self, reason: str = "") -> None:
        """Send CLOSE (if the session is still open) and close the connection. Idempotent."""
        if self._failure is None:
            self._proto.send_close(reason)
            self._terminate(ConnectionLost("the tensor stream was closed by this side"),
                            CloseCode.NORMAL, reason or "closed")
        elif self._shutdown_task is None:
            self._start_shutdown(CloseCode.NORMAL, reason or "closed")
        await self._finish()

    # -- reading -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        ws, proto = self._ws, self._proto
        try:
            while True:
                data = await ws.recv(decode=False)
                self.bytes_received += len(data)
                if self._bytes_in is not None:
                    self._bytes_in.inc(len(data))
                proto.receive_data(data)
                for event in proto.events_received():
                    self._on_event(event)
                if proto.has_data_to_send:
                    self._schedule_flush()
        except ConnectionClosed as exc:
            self._on_disconnect(exc)
        except Exception as exc:  # safety net: translate, never leak from the task
            err = ConnectionLost(f"tensor stream reader failed: {exc!r}")
            err.__cause__ = exc
            self._terminate(err, CloseCode.INTERNAL_ERROR, "internal error")

    def _on_event(self, event: Event) -> None:
        if type(event) is StepReceived:
            self._ready.append(event)
            self._wake()
        elif type(event) is CreditReceived:
            self._credit.set()
        elif type(event) is ErrorReceived:
            if event.fatal:
                self._terminate(event.error, CloseCode.NORMAL, event.error.code)
            else:
                self._ready.append(event.error)
                self._wake()
        elif type(event) is CloseReceived:
            self._on_peer_close(event.reason)
        elif type(event) is PingReceived:
            self._on_progress()
        elif type(event) is PongReceived:
            fut = self._pings.get(event.nonce)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif type(event) is ProtocolFailed:
            if isinstance(event.error, InternalError):  # our bug: its traceback in our log
                _log.error("tensor stream parser failed", stream_id=self._proto.stream_id,
                           exc_info=event.error.__cause__)
            else:
                _log.warning("tensor stream protocol failure", stream_id=self._proto.stream_id,
                             code=event.error.code, reason=event.error.message)
            self._terminate(event.error, event.close_code, event.error.code)
        elif not self._handshake.done():  # OpenRequested or Accepted
            self._handshake.set_result(event)

    def _on_progress(self) -> None:
        """The peer PINGed: a client step waiting for its output gets its deadline again
        from now (the shard is busy, not stalled: docs/protocol.md §3.6a), within
        `BUSY_STEP_FACTOR` deadlines of the step's start."""
        timer = self._step_timer
        if timer is None or timer.expired():
            return
        self.progress_pings += 1
        timer.reschedule(min(self._loop.time() + self._step_window, self._step_limit_at))

    def _step_deadline(self, deadline_s: float | None) -> asyncio.Timeout:
        """One client step's deadline (raises TimeoutError), re-armed by progress PINGs;
        the caller clears `_step_timer` when the step ends. asyncio's own `Timeout`, not a
        generator context manager around it: this is paid on every step of every hop."""
        window = self.deadline_s if deadline_s is None else deadline_s
        start = self._loop.time()
        timer = asyncio.timeout_at(start + window)
        self._step_timer, self._step_window = timer, window
        self._step_limit_at = start + BUSY_STEP_FACTOR * window
        return timer

    def _on_peer_close(self, reason: str) -> None:
        """The peer sent CLOSE: see `ServerStream` and `TensorChannel` for what it means."""
        err = ConnectionLost(f"the peer closed the tensor stream: {reason or 'no reason'}")
        self._terminate(err, CloseCode.NORMAL, "closed")

    def _on_disconnect(self, exc: ConnectionClosed) -> None:
        if isinstance(exc, ConnectionClosedOK):
            msg = "the peer closed the connection"
        else:
            msg = f"the connection to the peer was lost ({exc})"
        err = ConnectionLost(msg)
        err.__cause__ = exc
        self._terminate(err, None, "")

    def _wake(self) -> None:
        w = self._wakeup
        if w is not None and not w.done():
            w.set_result(None)

    def _terminate(self, error: HearthNetError, close_code: int | None, reason: str) -> None:
        """End the session on ``error`` (first cause wins) and wake every waiter."""
        if self._failure is None:
            self._failure = error
        self._proto.drop_partial()  # a half-received tensor is freed now, not at the next GC
        self._wake()
        self._credit.set()
        if not self._handshake.done():
            self._handshake.set_exception(self._failure)
            self._handshake.exception()  # retrieved: no "never retrieved" warning
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(self._failure)
                fut.exception()
        if close_code is not None:
            self._start_shutdown(close_code, reason)

    # -- writing -------------------------------------------------------------------------

    async def _flush(self) -> None:
        """Write everything the protocol has to send now, in order."""
        async with self._write_lock:
            proto, ws, counter = self._proto, self._ws, self._bytes_out
            while True:
                frames = proto.data_to_send()
                if not frames:
                    return
                for frame in frames:
                    try:
                        await ws.send(frame)
                    except ConnectionClosed as exc:
                        self._on_disconnect(exc)
                        raise (self._failure
                               or ConnectionLost("the peer closed the tensor stream")) from None
                    self.bytes_sent += len(frame)
                    if counter is not None:
                        counter.inc(len(frame))

    def _schedule_flush(self) -> None:
        # The reader never waits on a write: a busy writer picks the new frames up itself.
        if self._write_lock.locked() or (self._flusher is not None and not self._flusher.done()):
            return
        self._flusher = self._loop.create_task(self._flush_quietly())

    async def _flush_quietly(self) -> None:
        with contextlib.suppress(HearthNetError):
            await self._flush()

    def _start_shutdown(self, code: int, reason: str) -> None:
        if self._shutdown_task is None:
            self._shutdown_task = self._loop.create_task(self._shutdown(code, reason))

    async def _shutdown(self, code: int, reason: str) -> None:
        """Send what is queued (CLOSE or a fatal ERROR), then close the WebSocket.

        A peer that does not complete the close within the grace period is cut off.
        """
        try:
            async with asyncio.timeout(_CLOSE_GRACE_S):
                with contextlib.suppress(HearthNetError):
                    await self._flush()
                await self._ws.close(code, reason[:120])
        except Exception:  # a stalled or broken peer: drop the TCP connection
            self._ws.transport.abort()

    async def _finish(self) -> None:
        """Wait until the shutdown and the reader are over."""
        if self._shutdown_task is not None:
            await asyncio.shield(self._shutdown_task)
        try:
            async with asyncio.timeout(_CLOSE_GRACE_S):
                await asyncio.shield(self._reader)
        except TimeoutError:
            self._ws.transport.abort()
            self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        if self._flusher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher

    # -- steps ---------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._peer_closed:
            raise ConnectionLost("the peer closed the tensor stream")

    def _stalled(self, message: str) -> StreamStalled:
        """A deadline passed: fail the session (docs/protocol.md §8) and return the error."""
        err = StreamStalled(message)
        if self._failure is None:
            _log.info("tensor stream stalled", stream_id=self._proto.stream_id,
                      reason=message)
            self._proto.fail(err, CloseCode.POLICY_VIOLATION)
            self._terminate(err, CloseCode.POLICY_VIOLATION, "deadline exceeded")
        return err

    def _deadline_at(self, deadline_s: float | None) -> float:
        return self._loop.time() + (self.deadline_s if deadline_s is None else deadline_s)

    async def _send_tensor(self, step: int, start_pos: int, tensor: torch.Tensor,
                           compute_us: int, deadline_at: float) -> None:
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._send_untimed(step, start_pos, tensor, compute_us)
        except TimeoutError:
            raise self._stalled(_NOT_SENT.format(step=step)) from None

    async def _send_untimed(self, step: int, start_pos: int, tensor: torch.Tensor,
                            compute_us: int) -> None:
        """Queue one step and flush it, waiting for credit when the window is full; the
        caller bounds it with its deadline."""
        self._check_usable()
        proto = self._proto
        seq = proto.send_step(step, start_pos, tensor, compute_us)
        while True:
            self._credit.clear()
            await self._flush()
            if proto.tensors_sent >= seq:
                return
            self._check_usable()
            await self._credit.wait()  # window exhausted: wait for CREDIT

    async def _recv_tensor(self, deadline_at: float) -> StepReceived | None:
        try:
            async with asyncio.timeout_at(deadline_at):
                return await self._recv_untimed()
        except TimeoutError:
            raise self._stalled(_NOT_RECEIVED) from None

    async def _recv_untimed(self) -> StepReceived | None:
        """The next received step (None once the peer closed cleanly), giving credit back;
        the caller bounds it with its deadline."""
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            if self._peer_closed:
                return None
            self._wakeup = self._loop.create_future()
            await self._wakeup
        item = self._ready.popleft()
        if isinstance(item, HearthNetError):
            raise item
        self._proto.consumed()  # docs/protocol.md §6: credit flows back as we consume
        if self._proto.has_data_to_send:
            self._schedule_flush()
        return item

    async def _await_handshake(self, deadline_at: float, what: str) -> Event:
        try:
            async with asyncio.timeout_at(deadline_at):
                return await asyncio.shield(self._handshake)
        except TimeoutError:
            raise self._stalled(f"no {what} before the deadline") from None


class TensorChannel(_Session):
    """Client side of one shard session: sends INPUT steps, receives OUTPUT steps.

    Attributes:
        accepted: params of the server's ACCEPT frame.
        bytes_sent, bytes_received: frame bytes written and read.
    """

    accepted: dict[str, Any]

    @classmethod
    async def connect(cls, uri: str, open_params: dict[str, Any], *,
                      window: int = TENSOR_FLOW_CONTROL_WINDOW,
                      chunk_bytes: int = TENSOR_CHUNK_BYTES,
                      max_tensor_bytes: int = MAX_TENSOR_BYTES,
                      deadline_s: float = DEFAULT_DEADLINE_S,
                      ssl: _ssl.SSLContext | None = None, stream_id: int | None = None,
                      metrics: Metrics | None = None) -> TensorChannel:
        """Connect to ``uri`` and open a session with ``open_params`` (docs/protocol.md §3.1).

        ``open_params["wire_dtype"]`` (``"fp16"``, ``"bf16"`` or ``"fp32"``; default
        fp16) is the dtype of every tensor on the stream; tensors are converted to it on
        send. The whole handshake must finish within ``deadline_s``; ``deadline_s`` is
        also the default deadline of every later step.

        Raises:
            BadRequest: bad limits, params or URI.
            AuthError: the TLS handshake failed (reason ``tls_handshake``: the server's
                key is not pinned by ``ssl``, or it refused our certificate).
            ConnectionLost: connection refused, WebSocket handshake failed, or the server
                closed before accepting.
            StreamStalled: no ACCEPT within the deadline.
            HearthNetError: the server refused the session; the class matches the code
                of its ERROR frame (e.g. `WeightsMismatch`, `ShardUnavailable`).
        """
        loop = asyncio.get_running_loop()
        deadline_at = loop.time() + deadline_s
        proto = StreamProtocol(Role.CLIENT, window=window, chunk_bytes=chunk_bytes,
                               max_tensor_bytes=max_tensor_bytes)
        proto.send_open(open_params,
                        stream_id=secrets.randbits(32) if stream_id is None else stream_id)
        try:
            with tls_refusals(uri):  # ssl.SSLError: an AuthError ``tls_handshake``
                ws = await _ws_connect(uri, ssl=ssl, compression=None,
                                       max_size=max_frame_bytes(chunk_bytes),
                                       write_limit=max_frame_bytes(chunk_bytes),
                                       open_timeout=deadline_s, close_timeout=_CLOSE_GRACE_S)
        except InvalidURI as exc:
            raise BadRequest(f"not a WebSocket URI: {uri!r}") from exc
        except TimeoutError as exc:
            raise StreamStalled(f"no WebSocket handshake with {uri} within {deadline_s:g} s"
                                ) from exc
        except (OSError, WebSocketException) as exc:
            raise ConnectionLost(f"could not connect to {uri}: {exc}") from exc
        self = cls(ws, proto, deadline_s, metrics)
        try:
            await self._flush()
            event = await self._await_handshake(deadline_at, "ACCEPT")
        except HearthNetError:
            await self.close("open failed")
            raise
        assert isinstance(event, Accepted)
        self.accepted = event.params
        _log.debug("tensor stream open", uri=uri, stream_id=proto.stream_id,
                   window=proto.window, chunk_bytes=proto.chunk_bytes)
        return self

    async def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                        deadline_s: float | None = None) -> None:
        """Send one step's input; returns once every chunk is handed to the socket.

        Waits for credit when the window is full. The caller must not modify ``tensor``
        in place until this returns.

        Raises:
            BadRequest: a tensor the codec refuses (see `codec.EncodedTensor`).
            StreamStalled: not sent within the deadline (the session is then failed).
            ConnectionLost / the peer's error: the session ended.
        """
        await self._send_tensor(step, start_pos, tensor, 0, self._deadline_at(deadline_s))

    async def recv_step(self, deadline_s: float | None = None) -> StepResult:
        """Receive the next step's output.

        The deadline covers the whole step, not each byte, so a peer that trickles data
        is cut off (M26 §8.3); a shard busy with other sessions' work re-arms it with
        progress PINGs (docs/protocol.md §3.6a), up to `BUSY_STEP_FACTOR` deadlines.

        Raises:
            StreamStalled: no complete output within the deadline (the session is then
                failed: open a new one).
            HearthNetError: the shard's ERROR frame, rebuilt by its code.
            ConnectionLost: the shard closed the session or the connection broke.
        """
        try:
            async with self._step_deadline(deadline_s):
                ev = await self._recv_untimed()
        except TimeoutError:
            raise self._stalled(_NOT_RECEIVED) from None
        finally:
            self._step_timer = None
        if ev is None:  # pragma: no cover - a client session never ends that way
            raise ConnectionLost("the shard closed the tensor stream")
        return StepResult(ev.step, ev.start_pos, ev.tensor, ev.compute_us)

    async def step(self, step: int, start_pos: int, tensor: torch.Tensor,
                   deadline_s: float | None = None) -> StepResult:
        """`send_step` then `recv_step` under one deadline — one timer — for both (the
        decode loop's per-token path)."""
        sent = False
        try:
            async with self._step_deadline(deadline_s):
                await self._send_untimed(step, start_pos, tensor, 0)
                sent = True
                ev = await self._recv_untimed()
        except TimeoutError:
            raise self._stalled(_NOT_RECEIVED if sent else _NOT_SENT.format(step=step)
                                ) from None
        finally:
            self._step_timer = None
        if ev is None:  # pragma: no cover
            raise ConnectionLost("the shard closed the tensor stream")
        return StepResult(ev.step, ev.start_pos, ev.tensor, ev.compute_us)


class ServerStream(_Session):
    """Server (shard) side of one session on an accepted WebSocket connection.

    Attributes:
        open_params: params of the client's OPEN frame.
    """

    open_params: dict[str, Any]

    @classmethod
    async def accept_open(cls, ws: ServerConnection, *,
                          window: int = TENSOR_FLOW_CONTROL_WINDOW,
                          chunk_bytes: int = TENSOR_CHUNK_BYTES,
                          max_tensor_bytes: int = MAX_TENSOR_BYTES,
                          deadline_s: float = DEFAULT_DEADLINE_S,
                          metrics: Metrics | None = None) -> ServerStream:
        """Read the client's OPEN frame; answer with `accept` or `refuse` next.

        ``window``, ``chunk_bytes`` and ``max_tensor_bytes`` are this server's limits;
        the session uses the smaller of these and the client's. The connection's
        ``max_size`` must be at least ``codec.max_frame_bytes(chunk_bytes)``.

        Raises:
            ProtocolError: the first frame is not a valid OPEN (e.g. a version mismatch);
                an ERROR frame was sent and the connection closed before this raises.
            StreamStalled: no OPEN within ``deadline_s``.
            ConnectionLost: the client went away first.
        """
        proto = StreamProtocol(Role.SERVER, window=window, chunk_bytes=chunk_bytes,
                               max_tensor_bytes=max_tensor_bytes)
        self = cls(ws, proto, deadline_s, metrics)
        try:
            event = await self._await_handshake(self._deadline_at(None), "OPEN")
        except HearthNetError:
            await self._finish()
            raise
        assert isinstance(event, OpenRequested)
        self.open_params = event.params
        return self

    async def accept(self, params: dict[str, Any] | None = None) -> None:
        """Accept the session; ``params`` go back to the client in ACCEPT.

        Raises:
            BadRequest: already answered, or params not msgpack-able.
            ConnectionLost: the client went away.
        """
        self._check_usable()
        self._proto.send_accept(params or {})
        await self._flush()

    def limit_tensor_bytes(self, limit: int) -> None:
        """Lower this session's largest accepted tensor before `accept`: no over-allocation."""
        self._proto.limit_tensor_bytes(limit)

    async def refuse(self, err: HearthNetError, *, step: int | None = None) -> None:
        """Send ``err`` as a fatal ERROR and close: refuses an OPEN or ends a session
        (naming the failed ``step`` when there is one)."""
        if self._failure is None and not self._peer_closed:
            self._proto.send_error(err, fatal=True, step=step)
            self._terminate(err, CloseCode.NORMAL, err.code)
        else:
            self._start_shutdown(CloseCode.NORMAL, err.code)
        await self._finish()

    async def recv_step(self, deadline_s: float | None = None) -> StepInput | None:
        """The next step's input, or None once the client closed the session cleanly.

        The deadline covers the whole wait (idle time included); default: the
        ``deadline_s`` given to `accept_open`.

        Raises:
            StreamStalled: nothing complete within the deadline (the session is failed).
            HearthNetError: a non-fatal ERROR from the client, or the error that ended
                the session (`ProtocolError`, `ConnectionLost`...).
        """
        ev = await self._recv_tensor(self._deadline_at(deadline_s))
        if ev is None:
            return None
        return StepInput(ev.step, ev.start_pos, ev.tensor)

    async def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                        compute_us: int = 0, deadline_s: float | None = None) -> None:
        """Send one step's output with the shard's compute time in microseconds.

        Raises: as `TensorChannel.send_step`.
        """
        await self._send_tensor(step, start_pos, tensor, compute_us,
                                self._deadline_at(deadline_s))

    def progress(self, waiting_since: float) -> None:
        """Tell the client that its step, queued since `waiting_since` (the event loop's
        `time()`), waits behind work that is making progress: a PING
        (docs/protocol.md §3.6a), at most every `PROGRESS_EVERY_S` and only once the step
        has waited that long."""
        now = self._loop.time()
        if (self._failure is not None or self._peer_closed
                or now - max(waiting_since, self._last_progress) < PROGRESS_EVERY_S):
            return
        self._last_progress = now
        self._ping_nonce += 1
        self._proto.send_ping(self._ping_nonce)
        self._schedule_flush()

    async def send_error(self, err: HearthNetError, *, step: int | None = None) -> None:
        """Send ``err`` as a non-fatal ERROR: the client's next `recv_step` raises it and
        the session stays open."""
        self._check_usable()
        self._proto.send_error(err, step=step)
        await self._flush()

    def _on_peer_close(self, reason: str) -> None:
        # A client's CLOSE is the normal end of a session: recv_step returns None.
        self._peer_closed = True
        self._wake()
        self._credit.set()
        self._start_shutdown(CloseCode.NORMAL, "closed")

    def _on_disconnect(self, exc: ConnectionClosed) -> None:
        if isinstance(exc, ConnectionClosedOK) and self._failure is None:
            self._on_peer_close("")  # a clean close without CLOSE frame ends it too
            return
        super()._on_disconnect(exc)


# ---------------------------------------------------------------------------------------
# Stand-alone server and event loop


async def handle_stream(ws: ServerConnection,
                        handler: Callable[[ServerStream], Awaitable[None]], *,
                        window: int = TENSOR_FLOW_CONTROL_WINDOW,
                        chunk_bytes: int = TENSOR_CHUNK_BYTES,
                        max_tensor_bytes: int = MAX_TENSOR_BYTES,
                        deadline_s: float = DEFAULT_DEADLINE_S,
                        metrics: Metrics | None = None) -> None:
    """Run one session on an accepted connection: `accept_open`, then ``handler``.

    ``handler`` must `accept` or `refuse` the stream. Errors never escape: a bad OPEN was
    already answered; a `HearthNetError` from the handler is sent as a fatal ERROR; any
    other exception is logged and sent as an internal error. The stream is closed after.
    """
    try:
        stream = await ServerStream.accept_open(ws, window=window, chunk_bytes=chunk_bytes,
                                                max_tensor_bytes=max_tensor_bytes,
                                                deadline_s=deadline_s, metrics=metrics)
    except HearthNetError as exc:
        _log.info("tensor stream not opened", code=exc.code, reason=exc.message)
        return
    try:
        await handler(stream)
    except HearthNetError as exc:
        if not stream.closed:
            await stream.refuse(exc)
    except Exception:
        _log.exception("tensor stream handler failed", stream_id=stream.stream_id)
        if not stream.closed:
            await stream.refuse(InternalError("internal error on the shard host; see its log"))
    finally:
        await stream.close()


async def serve(handler: Callable[[ServerStream], Awaitable[None]], host: str = "127.0.0.1",
                port: int = 0, *, path: str = SHARD_PATH,
                window: int = TENSOR_FLOW_CONTROL_WINDOW,
                chunk_bytes: int = TENSOR_CHUNK_BYTES,
                max_tensor_bytes: int = MAX_TENSOR_BYTES,
                deadline_s: float = DEFAULT_DEADLINE_S, ssl: _ssl.SSLContext | None = None,
                metrics: Metrics | None = None) -> Server:
    """A websockets server running ``handler`` for every session on ``path``.

    Other paths get HTTP 404. Use ``server.sockets[0].getsockname()[1]`` for the port
    when ``port`` is 0; close with ``server.close(); await server.wait_closed()`` or use
    it as an async context manager.
    """

    def only_path(conn: ServerConnection, request: Request) -> Response | None:
        if request.path.split("?", 1)[0] != path:
            return conn.respond(404, f"no tensor streams at {request.path}\n")
        return None

    async def session(ws: ServerConnection) -> None:
        await handle_stream(ws, handler, window=window, chunk_bytes=chunk_bytes,
                            max_tensor_bytes=max_tensor_bytes, deadline_s=deadline_s,
                            metrics=metrics)

    return await _ws_serve(session, host, port, ssl=ssl, compression=None,
                           max_size=max_frame_bytes(chunk_bytes),
                           write_limit=max_frame_bytes(chunk_bytes),
                           process_request=only_path, close_timeout=_CLOSE_GRACE_S)

