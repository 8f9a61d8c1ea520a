"""The tensor stream protocol as a pure state machine (docs/protocol.md; DESIGN.md decision 5).

No sockets, no asyncio, no clock — the shape of python-websockets' sans-I/O core: the I/O
layer hands every WebSocket message it receives to `StreamProtocol.receive_data`, reads
the resulting events with `events_received`, and writes what `data_to_send` returns, one
WebSocket binary message per item. The application calls the ``send_*`` methods.

What it owns:

* the byte layout of every frame except the tensor header (that is `codec`), docs/protocol.md
  §2–§3;
* the session states and the one table of legal transitions, docs/protocol.md §5;
* the credit window, docs/protocol.md §6: a sender never has more than ``window`` unacknowledged
  data chunks in flight — further chunks wait inside the protocol and `blocked` is true —
  and a receiver returns credit as the application consumes what it received
  (`consumed`), batched so that a lockstep decode loop never waits on a CREDIT frame;
* failure, docs/protocol.md §7: `receive_data` never raises. Malformed input becomes a
  `ProtocolFailed` event carrying a typed error and a WebSocket close code, plus a fatal
  ERROR frame for the peer; the stream is then FAILED and ignores further input.

Misuse by the local caller (sending in the wrong state, an unsendable tensor) raises
`BadRequest` and leaves the state unchanged, as h11 does with ``LocalProtocolError``.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from hearthnet import safe_msgpack
from hearthnet.constants import (
    MAX_TENSOR_BYTES,
    TENSOR_CHUNK_BYTES,
    TENSOR_FLOW_CONTROL_WINDOW,
    CloseCode,
)
from hearthnet.errors import (
    BadRequest,
    FrameTooLarge,
    HearthNetError,
    InternalError,
    ProtocolError,
    error_from_code,
)
from hearthnet.transport.codec import (
    OP_INPUT,
    OP_OUTPUT,
    EncodedTensor,
    TensorAssembler,
    WireDtype,
)

PROTOCOL_VERSION = 1
"""The version this module speaks (docs/protocol.md §9)."""

MAX_WINDOW = 1024
MIN_CHUNK_BYTES = 64
MAX_CHUNK_BYTES = 16 << 20
MAX_PARAMS_BYTES = 64 * 1024
"""Largest msgpack body of OPEN, ACCEPT and ERROR frames (docs/protocol.md §3)."""
MAX_REASON_BYTES = 1024
"""Largest CLOSE reason (docs/protocol.md §3.5)."""

_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


class Opcode(enum.IntEnum):
    """First byte of every frame (docs/protocol.md §2)."""

    OPEN = 0x01
    ACCEPT = 0x02
    INPUT = OP_INPUT
    OUTPUT = OP_OUTPUT
    CREDIT = 0x05
    ERROR = 0x06
    CLOSE = 0x07
    PING = 0x08
    PONG = 0x09


class Role(enum.Enum):
    """Which end of the stream this is: the client opens it and sends INPUT."""

    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    """Session states (docs/protocol.md §5)."""

    IDLE = "idle"
    OPEN_SENT = "open_sent"
    OPEN_RECEIVED = "open_received"
    OPEN = "open"
    CLOSED = "closed"
    FAILED = "failed"


# ---------------------------------------------------------------------------------------
# The state table (docs/protocol.md §5). ``_FATAL`` stands for an ERROR frame with the fatal
# flag. Keys are (role, state); values map a frame kind to the state it leads to. A frame
# kind missing from the entry is illegal in that state: received, it fails the stream;
# sent, it raises BadRequest. CREDIT and PONG are sent automatically.

_FATAL = 0x100 | Opcode.ERROR

_C, _S = Role.CLIENT, Role.SERVER
_I, _OS, _OR, _O, _CL = State.IDLE, State.OPEN_SENT, State.OPEN_RECEIVED, State.OPEN, State.CLOSED
_OP = Opcode

_RECEIVE: dict[tuple[Role, State], dict[int, State]] = {
    (_C, _OS): {_OP.ACCEPT: _O, _FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _OS, _OP.PONG: _OS},
    (_C, _O): {_OP.OUTPUT: _O, _OP.CREDIT: _O, _OP.ERROR: _O, _FATAL: _CL, _OP.CLOSE: _CL,
               _OP.PING: _O, _OP.PONG: _O},
    (_S, _I): {_OP.OPEN: _OR},
    (_S, _OR): {_FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _OR, _OP.PONG: _OR},
    (_S, _O): {_OP.INPUT: _O, _OP.CREDIT: _O, _OP.ERROR: _O, _FATAL: _CL, _OP.CLOSE: _CL,
               _OP.PING: _O, _OP.PONG: _O},
}

_SEND: dict[tuple[Role, State], dict[int, State]] = {
    (_C, _I): {_OP.OPEN: _OS},
    (_C, _OS): {_FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _OS},
    (_C, _O): {_OP.INPUT: _O, _OP.ERROR: _O, _FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _O},
    (_S, _OR): {_OP.ACCEPT: _O, _FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _OR},
    (_S, _O): {_OP.OUTPUT: _O, _OP.ERROR: _O, _FATAL: _CL, _OP.CLOSE: _CL, _OP.PING: _O},
}

# ---------------------------------------------------------------------------------------
# Frame layouts (docs/protocol.md §3), little-endian.

_HANDSHAKE = struct.Struct("<BBHIIIQ")  # op, flags, version, stream, window, chunk, max
_CREDIT = struct.Struct("<B3xI")  # op, pad, chunks
_ERROR_HEAD = struct.Struct("<BB2x")  # op, flags (bit 0: fatal), pad; then msgpack map
_CLOSE_HEAD = struct.Struct("<B3x")  # op, pad; then UTF-8 reason
_PING = struct.Struct("<B7xQ")  # op, pad, nonce (also PONG)
_FLAG_FATAL = 0x01


# ---------------------------------------------------------------------------------------
# Events (frozen, slotted: h11/_events.py)


@dataclass(frozen=True, slots=True)
class OpenRequested:
    """Server side: the client asked to open the stream (docs/protocol.md §3.1).

    The window, chunk size and tensor limit are the *agreed* ones (the smaller of both
    sides' values); ACCEPT will carry them back.
    """

    stream_id: int
    version: int
    window: int
    chunk_bytes: int
    max_tensor_bytes: int
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Accepted:
    """Client side: the server accepted the stream with these agreed values (§3.2)."""

    stream_id: int
    window: int
    chunk_bytes: int
    max_tensor_bytes: int
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StepReceived:
    """A complete tensor of one step arrived (INPUT on the server, OUTPUT on the client).

    The tensor is in the stream's wire dtype; for a one-chunk tensor it is a read-only
    view of the received message. Call `StreamProtocol.consumed` when the application has
    taken it, so credit flows back (docs/protocol.md §6).
    """

    opcode: Opcode
    step: int
    start_pos: int
    tensor: torch.Tensor = field(repr=False)
    compute_us: int
    chunks: int


@dataclass(frozen=True, slots=True)
class CreditReceived:
    """The peer returned ``chunks`` credits; ``available`` is the credit now held."""

    chunks: int
    available: int


@dataclass(frozen=True, slots=True)
class ErrorReceived:
    """The peer sent an ERROR frame (§3.4); ``fatal`` ones end the session."""

    error: HearthNetError
    fatal: bool
    step: int | None


@dataclass(frozen=True, slots=True)
class CloseReceived:
    """The peer ended the session (§3.5)."""

    reason: str


@dataclass(frozen=True, slots=True)
class PingReceived:
    """The peer sent a PING (§3.6; its PONG is already queued). A shard PINGs a client whose
    step waits behind other work that is making progress (§3.6a)."""

    nonce: int


@dataclass(frozen=True, slots=True)
class PongReceived:
    """Answer to a PING of ours (§3.6)."""

    nonce: int


@dataclass(frozen=True, slots=True)
class ProtocolFailed:
    """The stream failed on received data; a fatal ERROR frame is queued for the peer (§7).

    ``error`` is a `ProtocolError` (or `FrameTooLarge`) when the peer broke the protocol,
    and an `InternalError` (close code 1011, the unexpected exception as its
    ``__cause__``) when this parser itself failed: a bug is never passed off as the
    peer's fault. The I/O layer should send `StreamProtocol.data_to_send` and close the
    WebSocket with ``close_code``.
    """

    error: ProtocolError | InternalError
    close_code: int


Event: TypeAlias = (OpenRequested | Accepted | StepReceived | CreditReceived | ErrorReceived
         | CloseReceived | PingReceived | PongReceived | ProtocolFailed)


class _Outgoing:
    """A tensor whose chunks are released as credit allows."""

    __slots__ = ("encoded", "next")

    def __init__(self, encoded: EncodedTensor) -> None:
        self.encoded = encoded
        self.next = 0


# ---------------------------------------------------------------------------------------


class StreamProtocol:
    """One tensor stream (one shard session) seen from one end. Not thread-safe.

    Attributes:
        role, state: see `Role` and `State`.
        window, chunk_bytes, max_tensor_bytes: this side's limits until the stream opens,
            then the agreed ones (docs/protocol.md §3.1).
        stream_id: chosen by the client in OPEN.
        wire_dtype: the dtype of every tensor on the stream (OPEN param ``wire_dtype``).
        open_params: params of the OPEN frame; accept_params: params of ACCEPT.
        credit: chunks this side may still send before it must wait for CREDIT.
        failure: the error that failed the stream, if any; close_code: its close code.
        chunks_sent, chunks_received, tensors_sent, tensors_received: counters.
    """

    def __init__(self, role: Role, *, window: int = TENSOR_FLOW_CONTROL_WINDOW,
                 chunk_bytes: int = TENSOR_CHUNK_BYTES,
                 max_tensor_bytes: int = MAX_TENSOR_BYTES) -> None:
        """Args:
            role: CLIENT (opens, sends INPUT) or SERVER (accepts, sends OUTPUT).
            window: credit window in chunks, 1..`MAX_WINDOW`.
            chunk_bytes: largest chunk payload, `MIN_CHUNK_BYTES`..`MAX_CHUNK_BYTES`.
            max_tensor_bytes: largest tensor this side accepts (> 0).

        Raises:
            BadRequest: a value out of range.
        """
        _check_limits(window, chunk_bytes, max_tensor_bytes, BadRequest)
        self.role = role
        self._state = State.IDLE
        self._rx: dict[int, State] = {}  # the state table's rows for this role and state
        self._tx: dict[int, State] = {}
        self.state = State.IDLE
        self.window = window
        self.chunk_bytes = chunk_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.stream_id = 0
        self.wire_dtype = WireDtype.FP16
        self.open_params: dict[str, Any] = {}
        self.accept_params: dict[str, Any] = {}
        self.credit = 0
        self.failure: HearthNetError | None = None
        self.close_code: int | None = None
        self.chunks_sent = self.chunks_received = 0
        self.tensors_sent = self.tensors_received = 0
        self._tensors_queued = 0
        self._events: list[Event] = []
        self._control: list[bytes | bytearray] = []  # CREDIT, PING, PONG: never wait
        self._ordered: deque[bytes | bytearray | _Outgoing] = deque()  # in order
        self._peer_credit = 0  # chunks the peer may still send us
        self._pending_credit = 0  # consumed chunks not yet returned to the peer
        self._held: deque[tuple[int, int]] = deque()  # (uncredited chunks, bytes) per tensor
        self._deferred = 0  # uncredited chunks of the tensor in progress
        self._assembler = TensorAssembler(chunk_bytes=chunk_bytes,
                                          max_tensor_bytes=max_tensor_bytes)
        self._incoming = Opcode.OUTPUT if role is Role.CLIENT else Opcode.INPUT
        self._outgoing = Opcode.INPUT if role is Role.CLIENT else Opcode.OUTPUT

    @property
    def state(self) -> State:
        """The session state (docs/protocol.md §5)."""
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        # The legal frames of the new state are looked up once here, not per frame: a
        # (role, state) key hashes two Enums in Python, twice per frame on the step path.
        self._state = state
        self._rx = _RECEIVE.get((self.role, state), {})
        self._tx = _SEND.get((self.role, state), {})

    # -- what the I/O layer reads ------------------------------------------------------

    def events_received(self) -> list[Event]:
        """Events produced since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def data_to_send(self) -> list[bytes | bytearray]:
        """Frames to write now, each one WebSocket binary message, in order.

        Data chunks are released only while credit lasts (docs/protocol.md §6); the rest stay
        queued and `blocked` is true until CREDIT arrives.
        """
        out = self._control
        self._control = []
        queue = self._ordered
        while queue:
            item = queue[0]
            if isinstance(item, _Outgoing):
                enc = item.encoded
                while item.next < enc.chunk_count and self.credit > 0:
                    out.append(enc.frame(item.next))
                    item.next += 1
                    self.credit -= 1
                    self.chunks_sent += 1
                if item.next < enc.chunk_count:
                    break
                self.tensors_sent += 1
            else:
                out.append(item)
            queue.popleft()
        return out

    @property
    def blocked(self) -> bool:
        """Whether a tensor is waiting for credit (the window is exhausted)."""
        queue = self._ordered
        return bool(queue) and type(queue[0]) is _Outgoing and self.credit == 0

    @property
    def has_data_to_send(self) -> bool:
        """Whether `data_to_send` would return something now."""
        return bool(self._control) or (bool(self._ordered) and not self.blocked)

    @property
    def in_flight(self) -> int:
        """Chunks sent and not yet acknowledged by the peer (never above `window`)."""
        return self.window - self.credit if self.state is State.OPEN else 0

    @property
    def held_tensors(self) -> int:
        """Tensors received and not yet `consumed` by the application."""
        return len(self._held)

    @property
    def buffered_bytes(self) -> int:
        """Bytes of received tensors not yet consumed, plus the tensor in progress."""
        return sum(n for _, n in self._held) + self._assembler.buffered_bytes

    # -- sending -------------------------------------------------------------------------

    def send_open(self, params: dict[str, Any], *, stream_id: int = 1) -> None:
        """Queue OPEN with this side's limits and ``params`` (client; docs/protocol.md §3.1).

        ``params["wire_dtype"]`` (``"fp16"`` by default) fixes the dtype of every tensor
        on the stream.

        Raises:
            BadRequest: wrong state, params not a msgpack-able map with str keys or over
                `MAX_PARAMS_BYTES`, unknown wire dtype, stream id out of range.
        """
        nxt = self._check_send(Opcode.OPEN)
        if not 0 <= stream_id <= _U32_MAX:
            raise BadRequest(f"stream id {stream_id} does not fit in 32 bits")
        wire = WireDtype.from_name(params.get("wire_dtype", "fp16"))
        body = _pack_params(params)
        self._ordered.append(_HANDSHAKE.pack(Opcode.OPEN, 0, PROTOCOL_VERSION, stream_id,
                                             self.window, self.chunk_bytes,
                                             self.max_tensor_bytes) + body)
        self.stream_id, self.wire_dtype, self.open_params = stream_id, wire, dict(params)
        self.state = nxt

    def send_accept(self, params: dict[str, Any] | None = None) -> None:
        """Queue ACCEPT with the agreed limits (server, after `OpenRequested`; §3.2).

        Raises:
            BadRequest: wrong state, or params not a msgpack-able map.
        """
        nxt = self._check_send(Opcode.ACCEPT)
        body = _pack_params(params or {})
        self._ordered.append(_HANDSHAKE.pack(Opcode.ACCEPT, 0, PROTOCOL_VERSION,
                                             self.stream_id, self.window, self.chunk_bytes,
                                             self.max_tensor_bytes) + body)
        self.accept_params = dict(params or {})
        self._open_flow()
        self.state = nxt

    def send_step(self, step: int, start_pos: int, tensor: torch.Tensor,
                  compute_us: int = 0) -> int:
        """Queue a step's tensor: INPUT from the client, OUTPUT from the server (§4).

        The tensor is converted to the wire dtype now; its chunks leave through
        `data_to_send` as credit allows. The caller must not modify ``tensor`` in place
        until `tensors_sent` reaches the returned number.

        Returns:
            The sequence number of this tensor on this stream (1, 2, ...).

        Raises:
            BadRequest: wrong state, or a tensor the codec refuses (dtype, rank, empty
                dimension, over the agreed ``max_tensor_bytes``).
        """
        nxt = self._check_send(self._outgoing)
        enc = EncodedTensor(tensor, opcode=self._outgoing, stream_id=self.stream_id,
                            step=step, start_pos=start_pos, compute_us=compute_us,
                            wire_dtype=self.wire_dtype, chunk_bytes=self.chunk_bytes,
                            max_tensor_bytes=self.max_tensor_bytes)
        self._ordered.append(_Outgoing(enc))
        self._tensors_queued += 1
        if nxt is not self._state:
            self.state = nxt
        return self._tensors_queued

    def send_error(self, error: HearthNetError, *, fatal: bool = False,
                   step: int | None = None) -> None:
        """Queue an ERROR frame carrying ``error.to_dict()`` (§3.4).

        A non-fatal ERROR follows the data already queued and leaves the session open
        (the peer's next receive raises it). A fatal one drops unsent data, goes out
        first and closes the session; it is how a server refuses an OPEN.

        Raises:
            BadRequest: wrong state (e.g. a non-fatal ERROR before ACCEPT).
        """
        nxt = self._check_send(_FATAL if fatal else Opcode.ERROR)
        frame = _error_frame(error, fatal=fatal, step=step)
        if fatal:
            self._drop_unsent()
            self._control.append(frame)
        else:
            self._ordered.append(frame)
        self.state = nxt

    def send_close(self, reason: str = "") -> None:
        """Queue CLOSE (§3.5): the session ends and unsent data is dropped.

        Idempotent: does nothing once the stream is CLOSED or FAILED. Before ACCEPT on
        the server it is a plain close without an answer.
        """
        if self.state in (State.CLOSED, State.FAILED):
            return
        nxt = self._tx.get(Opcode.CLOSE, State.CLOSED)
        self._drop_unsent()
        raw = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
        self._control.append(_CLOSE_HEAD.pack(Opcode.CLOSE) + raw)
        self.state = nxt

    def send_ping(self, nonce: int = 0) -> None:
        """Queue PING; the peer answers PONG with the same 64-bit ``nonce`` (§3.6).

        Raises:
            BadRequest: wrong state or nonce out of range.
        """
        self._check_send(Opcode.PING)
        if not 0 <= nonce <= _U64_MAX:
            raise BadRequest(f"ping nonce {nonce} does not fit in 64 bits")
        self._control.append(_PING.pack(Opcode.PING, nonce))

    def consumed(self) -> None:
        """The application took the oldest `StepReceived` tensor: return its credit.

        Credit goes back in batches of at least half the window (docs/protocol.md §6).

        Raises:
            BadRequest: no received tensor is waiting to be consumed.
        """
        if not self._held:
            raise BadRequest("consumed() called with no received tensor outstanding")
        self._pending_credit += self._held.popleft()[0]
        if not self._held and self._deferred:
            # Nothing is waiting for the application any more: the tensor in progress
            # is assembling into its own buffer, so its chunks count as consumed.
            self._pending_credit += self._deferred
            self._deferred = 0
        self._grant_credit()

    def fail(self, error: HearthNetError, close_code: int = CloseCode.INTERNAL_ERROR) -> None:
        """End the stream locally on ``error``: drop unsent data, queue a fatal ERROR.

        For failures the I/O layer detects (a deadline passed, a broken socket).
        Does nothing if the stream already ended.
        """
        if self.state in (State.CLOSED, State.FAILED):
            return
        frame = _error_frame(error, fatal=True, step=None)
        self._drop_unsent()
        self.drop_partial()
        self._control = [frame]
        self.state = State.FAILED
        self.failure = error
        self.close_code = close_code

    def drop_partial(self) -> None:
        """Free the tensor being received, if any (a failed stream holds no buffer)."""
        self._assembler.reset()

    def limit_tensor_bytes(self, limit: int) -> None:
        """Lower the largest tensor this side accepts (server, before `send_accept`):
        a shard derives it from what the session can legitimately send (no over-allocation)."""
        if self.state is not State.OPEN_RECEIVED:
            raise BadRequest("the tensor limit can only be lowered before ACCEPT")
        self.max_tensor_bytes = max(1, min(self.max_tensor_bytes, limit))

    # -- receiving -----------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Take one WebSocket message from the peer. Never raises.

        After CLOSED or FAILED input is ignored (the peer may still have frames in
        flight). Malformed input fails the stream: see `ProtocolFailed`.
        """
        if self._state is State.CLOSED or self._state is State.FAILED:
            return
        try:
            if not data:
                raise ProtocolError("empty frame")
            op = data[0]
            kind = op
            if op == Opcode.ERROR and len(data) > 1 and data[1] & _FLAG_FATAL:
                kind = _FATAL
            nxt = self._rx.get(kind)
            if nxt is None:
                raise ProtocolError(self._unexpected(op, kind))
            if op == self._incoming:
                self._receive_chunk(data)
            elif op == Opcode.CREDIT:
                self._receive_credit(data)
            elif op == Opcode.PING or op == Opcode.PONG:
                self._receive_ping(op, data)
            elif op == Opcode.ERROR:
                self._receive_error(data)
            elif op == Opcode.CLOSE:
                self._receive_close(data)
            elif op == Opcode.OPEN:
                self._receive_open(data)
            else:
                self._receive_accept(data)
            if nxt is not self._state:  # handlers raise on failure: only on success
                self.state = nxt
        except ProtocolError as exc:
            self._fail_received(exc)
        except Exception as exc:  # safety net: the receive path never raises (§7) ...
            # ... but a bug is not the peer's protocol error: it fails the stream as
            # `internal` (close 1011), its cause attached for the I/O layer's log
            err = InternalError(f"this node could not process a frame: {type(exc).__name__}")
            err.__cause__ = exc
            self.fail(err, CloseCode.INTERNAL_ERROR)
            self._events.append(ProtocolFailed(err, CloseCode.INTERNAL_ERROR))

    def _receive_chunk(self, data: bytes | bytearray | memoryview) -> None:
        # docs/protocol.md §6: the peer may only send while it holds credit.
        if self._peer_credit <= 0:
            raise ProtocolError(f"flow control violation: more than {self.window} "
                                "unacknowledged chunks in flight")
        self._peer_credit -= 1
        self.chunks_received += 1
        h, tensor = self._assembler.feed(data)
        if tensor is None:
            if self._held:
                self._deferred += 1
            else:
                self._pending_credit += 1
                self._grant_credit()
            return
        self._held.append((self._deferred + 1, h.total_bytes))
        self._deferred = 0
        self.tensors_received += 1
        self._events.append(StepReceived(self._incoming, h.step, h.start_pos, tensor,
                                         h.compute_us, h.chunk_count))

    def _receive_credit(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) != _CREDIT.size:
            raise ProtocolError(f"CREDIT frame of {len(data)} bytes; expected {_CREDIT.size}")
        _, n = _CREDIT.unpack(data)
        if n == 0 or self.credit + n > self.window:
            raise ProtocolError(f"CREDIT of {n} chunks would take the credit to "
                                f"{self.credit + n}, outside 1..{self.window}")
        self.credit += n
        self._events.append(CreditReceived(n, self.credit))

    def _receive_ping(self, op: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != _PING.size:
            raise ProtocolError(f"PING/PONG frame of {len(data)} bytes; expected {_PING.size}")
        _, nonce = _PING.unpack(data)
        if op == Opcode.PING:
            self._control.append(_PING.pack(Opcode.PONG, nonce))
            self._events.append(PingReceived(nonce))
        else:
            self._events.append(PongReceived(nonce))

    def _receive_error(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) < _ERROR_HEAD.size or len(data) > _ERROR_HEAD.size + MAX_PARAMS_BYTES:
            raise ProtocolError(f"ERROR frame of {len(data)} bytes")
        _, flags = _ERROR_HEAD.unpack_from(data, 0)
        if flags & ~_FLAG_FATAL:
            raise ProtocolError(f"ERROR flags {flags:#x} use reserved bits")
        body = _unpack_map(data, _ERROR_HEAD.size, "ERROR")
        code, message = body.get("code"), body.get("message")
        step, details = body.get("step"), body.get("details", {})
        if (not isinstance(code, str) or not isinstance(message, str)
                or not isinstance(details, dict)
                or not (step is None or (isinstance(step, int) and step >= 0))):
            raise ProtocolError("ERROR frame needs str code and message, a map of details "
                                "and an optional step number")
        fatal = bool(flags & _FLAG_FATAL)
        if not fatal and self._assembler.in_progress:
            raise ProtocolError("non-fatal ERROR in the middle of a tensor")
        extra = {k: v for k, v in details.items() if k not in ("code", "message")}
        error = error_from_code(code, message, extra)
        if fatal:
            self._drop_unsent()
            self._assembler.reset()
        self._events.append(ErrorReceived(error, fatal, step))

    def _receive_close(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) > _CLOSE_HEAD.size + MAX_REASON_BYTES:
            raise ProtocolError(f"CLOSE frame of {len(data)} bytes")
        reason = bytes(data[_CLOSE_HEAD.size:]).decode("utf-8", "replace")
        self._drop_unsent()
        self._assembler.reset()
        self._events.append(CloseReceived(reason))

    def _receive_open(self, data: bytes | bytearray | memoryview) -> None:
        stream_id, window, chunk_bytes, max_tensor_bytes, params = _parse_handshake(data, "OPEN")
        try:
            wire = WireDtype.from_name(params.get("wire_dtype", "fp16"))
        except BadRequest as exc:
            raise ProtocolError(exc.message) from exc
        # docs/protocol.md §3.1: each limit is the smaller of both sides' values.
        self.window = min(self.window, window)
        self.chunk_bytes = min(self.chunk_bytes, chunk_bytes)
        self.max_tensor_bytes = min(self.max_tensor_bytes, max_tensor_bytes)
        self.stream_id, self.wire_dtype, self.open_params = stream_id, wire, params
        self._events.append(OpenRequested(stream_id, PROTOCOL_VERSION, self.window,
                                          self.chunk_bytes, self.max_tensor_bytes, params))

    def _receive_accept(self, data: bytes | bytearray | memoryview) -> None:
        stream_id, window, chunk_bytes, max_tensor_bytes, params = _parse_handshake(
            data, "ACCEPT")
        if stream_id != self.stream_id:
            raise ProtocolError(f"ACCEPT for stream {stream_id}; this is stream "
                                f"{self.stream_id}")
        if (window > self.window or chunk_bytes > self.chunk_bytes
                or max_tensor_bytes > self.max_tensor_bytes):
            raise ProtocolError("ACCEPT raised a limit above what OPEN proposed")
        self.window, self.chunk_bytes, self.max_tensor_bytes = (window, chunk_bytes,
                                                                max_tensor_bytes)
        self.accept_params = params
        self._open_flow()
        self._events.append(Accepted(stream_id, window, chunk_bytes, max_tensor_bytes,
                                     params))

    # -- internals -----------------------------------------------------------------------

    def _open_flow(self) -> None:
        """Start the credit window with the agreed limits (docs/protocol.md §6)."""
        self.credit = self._peer_credit = self.window
        self._assembler = TensorAssembler(
            chunk_bytes=self.chunk_bytes, max_tensor_bytes=self.max_tensor_bytes,
            expect_opcode=self._incoming, expect_dtype=self.wire_dtype,
            expect_stream_id=self.stream_id)

    def _grant_credit(self) -> None:
        # docs/protocol.md §6: return credit once half the window is owed, never per chunk.
        if self._pending_credit >= max(1, self.window // 2) and self._state is State.OPEN:
            n, self._pending_credit = self._pending_credit, 0
            self._peer_credit += n
            self._control.append(_CREDIT.pack(Opcode.CREDIT, n))

    def _check_send(self, kind: int) -> State:
        nxt = self._tx.get(kind)
        if nxt is None:
            name = "fatal ERROR" if kind == _FATAL else Opcode(kind).name
            raise BadRequest(f"a {self.role.value} cannot send {name} in state "
                             f"{self.state.value}")
        return nxt

    def _drop_unsent(self) -> None:
        self._ordered.clear()
        self._control = [f for f in self._control if f[0] != Opcode.CREDIT]

    def _unexpected(self, op: int, kind: int) -> str:
        try:
            name = "fatal ERROR" if kind == _FATAL else Opcode(op).name
        except ValueError:
            return f"unknown opcode {op:#04x}"
        return f"unexpected {name} frame for a {self.role.value} in state {self.state.value}"

    def _fail_received(self, error: ProtocolError) -> None:
        code = (CloseCode.MESSAGE_TOO_BIG if isinstance(error, FrameTooLarge)
                else CloseCode.PROTOCOL_ERROR)
        self.fail(error, code)
        self._events.append(ProtocolFailed(error, code))


def _check_limits(window: int, chunk_bytes: int, max_tensor_bytes: int,
                  exc: type[HearthNetError]) -> None:
    if not 1 <= window <= MAX_WINDOW:
        raise exc(f"window {window} is not 1..{MAX_WINDOW} chunks")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise exc(f"chunk size {chunk_bytes} is not {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} "
                  "bytes")
    if not 1 <= max_tensor_bytes <= _U64_MAX:
        raise exc(f"tensor limit {max_tensor_bytes} is not 1..2**64-1 bytes")


def _pack_params(params: dict[str, Any]) -> bytes:
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise BadRequest("stream params must be a map with str keys")
    try:
        body = safe_msgpack.packb(params)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRequest(f"stream params cannot be encoded: {exc}") from exc
    if len(body) > MAX_PARAMS_BYTES:
        raise BadRequest(f"stream params take {len(body)} bytes; the limit is "
                         f"{MAX_PARAMS_BYTES}")
    return bytes(body)


def _unpack_map(data: bytes | bytearray | memoryview, offset: int, what: str) -> dict[str, Any]:
    try:
        # msgpack caps every declared length at the input size: no allocation bombs.
        obj = safe_msgpack.unpackb(bytes(data[offset:]))
    except ValueError as exc:  # all that safe_msgpack raises for malformed input
        raise ProtocolError(f"{what} frame body is not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ProtocolError(f"{what} frame body is not a map with str keys")
    return obj


def _parse_handshake(data: bytes | bytearray | memoryview, what: str
                     ) -> tuple[int, int, int, int, dict[str, Any]]:
    # docs/protocol.md §9: the version sits at bytes 2..3 in every version; check it first.
    if len(data) < 4:
        raise ProtocolError(f"{what} frame of {len(data)} bytes")
    version = int.from_bytes(data[2:4], "little")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks tensor protocol version {version}; this node "
                            f"speaks version {PROTOCOL_VERSION}: run the same HearthNet "
                            "release on both nodes", peer_version=version,
                            supported=[PROTOCOL_VERSION])
    if len(data) < _HANDSHAKE.size or len(data) > _HANDSHAKE.size + MAX_PARAMS_BYTES:
        raise ProtocolError(f"{what} frame of {len(data)} bytes")
    _, flags, _, stream_id, window, chunk_bytes, max_tensor_bytes = _HANDSHAKE.unpack_from(
        data, 0)
    if flags:
        raise ProtocolError(f"{what} flags {flags:#x} are reserved and must be 0")
    _check_limits(window, chunk_bytes, max_tensor_bytes, ProtocolError)
    params = _unpack_map(data, _HANDSHAKE.size, what)
    return stream_id, window, chunk_bytes, max_tensor_bytes, params


def _error_frame(error: HearthNetError, *, fatal: bool, step: int | None) -> bytes:
    body: dict[str, Any] = error.to_dict()
    if step is not None:
        body["step"] = step
    try:
        packed = safe_msgpack.packb(body)
    except (TypeError, ValueError, OverflowError):
        packed = safe_msgpack.packb({"code": error.code, "message": error.message})
    if len(packed) > MAX_PARAMS_BYTES:
        packed = safe_msgpack.packb({"code": error.code, "message": error.message[:1000]})
    return _ERROR_HEAD.pack(Opcode.ERROR, _FLAG_FATAL if fatal else 0) + bytes(packed)
