"""Tensor ⇄ frames: the data-frame header, chunking and reassembly (docs/protocol.md §4).

This module owns the bytes of INPUT and OUTPUT frames and nothing else: no sockets, no
asyncio, no protocol state. A tensor of dtype fp16, bf16 or fp32 and rank 1–4 travels as
its raw little-endian bytes, cut into chunks of at most ``chunk_bytes`` (1 MiB by
default, ``TENSOR_CHUNK_BYTES``, M26 §5.5); every chunk is one frame with a fixed 48-byte
header. The receiver validates a header *before* it allocates anything (known dtype,
rank, dims > 0, shape × item size within the negotiated limit, chunk count and this
chunk's length consistent with the negotiated chunk size, indices in order) and builds
the tensor over the received buffer: a one-chunk tensor is a view of the received
message itself, a multi-chunk tensor is a view of one buffer the chunks are copied into.

Received tensors of one chunk are backed by the immutable ``bytes`` of the message: treat
them as read-only (``clone()`` before an in-place operation).
"""

from __future__ import annotations

import enum
import struct
import sys
import warnings
from collections.abc import Sequence
from math import prod
from typing import Any, NamedTuple

import numpy as np
import torch

from hearthnet.constants import MAX_TENSOR_BYTES, TENSOR_CHUNK_BYTES, WIRE_DTYPES
from hearthnet.dtypes import FLOAT_DTYPES
from hearthnet.errors import BadRequest, FrameTooLarge, ProtocolError, WireOverflow

MAX_RANK = 4
"""Largest number of dimensions of a tensor on the wire (docs/protocol.md §4)."""

OP_INPUT = 0x03
OP_OUTPUT = 0x04
"""Opcodes of the two data frames; the full list is `protocol.Opcode` (docs/protocol.md §2)."""

# docs/protocol.md §4: opcode, dtype, ndim, flags, stream_id, step, start_pos, chunk_index,
# chunk_count, dim0..dim3, compute_us, payload_bytes — 48 bytes, little-endian.
HEADER = struct.Struct("<4B11I")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 48

_U32_MAX = 0xFFFF_FFFF
_LITTLE = sys.byteorder == "little"

# Received one-chunk tensors are deliberately built over the read-only message bytes (no
# copy). torch warns about that once per process (for each of the two ways it is done
# here); have those warnings here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


class WireDtype(enum.IntEnum):
    """Element types a tensor may have on the wire (docs/protocol.md §4, `dtype` byte)."""

    FP16 = 1
    BF16 = 2
    FP32 = 3

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH[self]

    @property
    def itemsize(self) -> int:
        return 4 if self is WireDtype.FP32 else 2

    @property
    def wire_name(self) -> str:
        """The name used in OPEN params (``"fp16"``, ``"bf16"``, ``"fp32"``)."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: object) -> WireDtype:
        """The dtype called ``name`` in OPEN params.

        Raises:
            BadRequest: ``name`` is not one of ``fp16``, ``bf16``, ``fp32``.
        """
        for member in cls:
            if member.wire_name == name:
                return member
        raise BadRequest(f"unsupported wire dtype {name!r}: use one of {list(WIRE_DTYPES)}",
                         wire_dtype=str(name))

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> WireDtype:
        """The wire dtype carrying torch ``dtype`` unchanged.

        Raises:
            BadRequest: ``dtype`` has no wire representation.
        """
        for member, td in _TORCH.items():
            if td == dtype:
                return member
        raise BadRequest(f"tensors of dtype {dtype} cannot be sent: use float16, bfloat16 "
                         "or float32", dtype=str(dtype))


_TORCH = {d: FLOAT_DTYPES[d.wire_name] for d in WireDtype}
_BY_CODE = {int(d): d for d in WireDtype}
_BY_TORCH = {td: d for d, td in _TORCH.items()}
_ITEMSIZE = {d: d.itemsize for d in WireDtype}  # a dict lookup: Enum properties are slow
# The dtypes numpy holds natively: a received tensor is wrapped as a numpy array over the
# message, a few µs cheaper than torch's own frombuffer + view on a decode step (measured:
# `hearthnet bench transport`'s codec figures). bf16 has no numpy dtype: torch does it.
_NUMPY: dict[WireDtype, np.dtype[Any]] = {WireDtype.FP16: np.dtype("<f2"),
                                          WireDtype.FP32: np.dtype("<f4")}


class ChunkHeader(NamedTuple):
    """The decoded 48-byte header of one data frame (docs/protocol.md §4).

    A named tuple, not a dataclass: one is built per received frame, on the decode path.
    """

    opcode: int
    dtype: WireDtype
    shape: tuple[int, ...]
    stream_id: int
    step: int
    start_pos: int
    chunk_index: int
    chunk_count: int
    compute_us: int
    payload_bytes: int
    total_bytes: int
    """Size of the whole tensor in bytes (shape × item size)."""


def chunk_count_for(total_bytes: int, chunk_bytes: int) -> int:
    """Number of chunks a tensor of ``total_bytes`` needs (at least one)."""
    return max(1, -(-total_bytes // chunk_bytes))


def max_frame_bytes(chunk_bytes: int = TENSOR_CHUNK_BYTES) -> int:
    """The largest WebSocket message a stream with this chunk size may receive.

    This is what the WebSocket layer's ``max_size`` must be set to, so an oversized
    frame is refused before it is buffered (docs/protocol.md §1). Control frames carrying
    msgpack (OPEN, ACCEPT, ERROR) are at most 64 KiB.
    """
    return max(HEADER_SIZE + chunk_bytes, 64 * 1024 + 64)


# ---------------------------------------------------------------------------------------
# Sending


def cast_to_wire(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in the wire ``dtype``; `WireOverflow` when finite values become Inf.

    A narrowing cast (fp32 → fp16) of values beyond the dtype's range gives Inf: that is a
    transport limit, not corrupt activations, and the sender says so. Only
    a narrowing cast is checked; values that were already non-finite stay the receiver's
    sanity check's business.
    """
    if tensor.dtype == dtype:
        return tensor
    out = tensor.to(dtype)
    if torch.finfo(dtype).max < torch.finfo(tensor.dtype).max and \
            bool((torch.isinf(out) & torch.isfinite(tensor)).any()):
        name = WireDtype.from_torch(dtype).wire_name
        raise WireOverflow(f"activations exceed the range of the wire dtype {name}; a wider "
                           f"wire dtype (bf16 or fp32) is needed", wire_dtype=name)
    return out


class EncodedTensor:
    """A tensor prepared for sending: wire dtype, contiguous, its raw little-endian bytes.

    Frames are built on demand with `frame`, so a sender that is waiting for credit holds
    the tensor once, not a second copy of it cut into frames. A tensor already on the
    CPU, contiguous and in the wire dtype (every decode step) is not copied here: its
    bytes are read through a memoryview, and the one copy is the frame itself.
    """

    __slots__ = ("_fields", "_payload", "_tensor", "chunk_bytes", "chunk_count",
                 "total_bytes")

    def __init__(self, tensor: torch.Tensor, *, opcode: int, stream_id: int, step: int,
                 start_pos: int, compute_us: int = 0, wire_dtype: WireDtype | None = None,
                 chunk_bytes: int = TENSOR_CHUNK_BYTES,
                 max_tensor_bytes: int = MAX_TENSOR_BYTES) -> None:
        """Check and convert ``tensor``; no frame is built yet.

        Args:
            tensor: a floating tensor of rank 1–4 with every dimension > 0, on any device.
                It is converted to ``wire_dtype`` (default: its own dtype) and copied to
                the CPU if needed; otherwise its memory is used as is, so the caller must
                not modify it until the frames are sent.
            opcode: `OP_INPUT` or `OP_OUTPUT`.
            compute_us: the sender's compute time, reported in OUTPUT headers.
            chunk_bytes: the negotiated chunk size (> 0).
            max_tensor_bytes: the negotiated largest tensor.

        Raises:
            BadRequest: unsupported dtype or rank, empty dimension, a field out of range,
                or a tensor larger than ``max_tensor_bytes``.
        """
        if chunk_bytes <= 0:
            raise BadRequest(f"chunk_bytes must be > 0, not {chunk_bytes}")
        if opcode != OP_INPUT and opcode != OP_OUTPUT:
            raise BadRequest(f"opcode {opcode} is not a data frame")
        if wire_dtype is None:
            wire_dtype = _BY_TORCH.get(tensor.dtype) or WireDtype.from_torch(tensor.dtype)
        elif not tensor.dtype.is_floating_point:
            raise BadRequest(f"tensors of dtype {tensor.dtype} cannot be sent: hidden states "
                             "are floating point", dtype=str(tensor.dtype))
        shape = tuple(tensor.shape)
        rank = len(shape)
        if not 1 <= rank <= MAX_RANK:
            raise BadRequest(f"tensor rank {rank} is not 1..{MAX_RANK}", shape=shape)
        for d in shape:
            if not 0 < d <= _U32_MAX:
                raise BadRequest(f"tensor shape {shape} has an empty or oversized dimension",
                                 shape=shape)
        if not (0 <= stream_id <= _U32_MAX and 0 <= step <= _U32_MAX
                and 0 <= start_pos <= _U32_MAX and 0 <= compute_us <= _U32_MAX):
            for name, value in (("stream_id", stream_id), ("step", step),
                                ("start_pos", start_pos), ("compute_us", compute_us)):
                if not 0 <= value <= _U32_MAX:
                    raise BadRequest(f"{name} {value} does not fit in an unsigned 32-bit "
                                     "field")
        total = prod(shape) * _ITEMSIZE[wire_dtype]
        if total > max_tensor_bytes:
            raise BadRequest(f"tensor of {total} bytes exceeds the stream's limit of "
                             f"{max_tensor_bytes} bytes: send fewer tokens per step",
                             total_bytes=total, max_tensor_bytes=max_tensor_bytes)
        count = chunk_count_for(total, chunk_bytes)
        if count > _U32_MAX:
            raise BadRequest(f"tensor needs {count} chunks: use a larger chunk size")
        # Each step below is skipped when it has nothing to do: a torch call costs µs
        # even when it returns its input, and a decode step's whole frame is 2-6 KB.
        t = tensor.detach() if tensor.requires_grad else tensor
        wire = _TORCH[wire_dtype]
        if t.dtype != wire:
            t = cast_to_wire(t, wire)
        if not t.is_cpu:
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if not _LITTLE:  # pragma: no cover - big-endian hosts only
            t = _byteswapped(t.reshape(-1), _ITEMSIZE[wire_dtype])
        # numpy has no bf16: its bits travel as int16 (a view, no copy)
        arr = (t if wire_dtype is not WireDtype.BF16 else t.view(torch.int16)).numpy()
        self._tensor = t  # the memory the payload views stays alive with it
        self._payload = memoryview(arr.data).cast("B")
        self._fields = (opcode, int(wire_dtype), rank, 0, stream_id, step, start_pos,
                        *shape, *((0,) * (MAX_RANK - rank)), compute_us)
        self.chunk_bytes = chunk_bytes
        self.chunk_count = count
        self.total_bytes = total

    def frame(self, index: int) -> bytes:
        """Frame number ``index`` (0-based): header followed by that chunk's bytes."""
        cb = self.chunk_bytes
        piece = self._payload if self.chunk_count == 1 else \
            self._payload[index * cb:(index + 1) * cb]
        f = self._fields
        return HEADER.pack(f[0], f[1], f[2], f[3], f[4], f[5], f[6], index, self.chunk_count,
                           f[7], f[8], f[9], f[10], f[11], len(piece)) + piece

    def frames(self) -> list[bytes]:
        """Every frame of the tensor, in order."""
        return [self.frame(i) for i in range(self.chunk_count)]


_SWAP_VIEW = {2: torch.int16, 4: torch.int32}


def _byteswapped(t: torch.Tensor, itemsize: int) -> torch.Tensor:  # pragma: no cover
    """A copy of the 1-D tensor ``t`` with every element's bytes reversed (docs/protocol.md §1).

    Only big-endian hosts need it: the wire is little-endian.
    """
    arr = t.view(_SWAP_VIEW[itemsize]).numpy().byteswap()
    return torch.from_numpy(arr).view(t.dtype)


def encode_tensor(tensor: torch.Tensor, *, opcode: int = OP_INPUT, stream_id: int = 0,
                  step: int = 0, start_pos: int = 0, compute_us: int = 0,
                  wire_dtype: WireDtype | None = None, chunk_bytes: int = TENSOR_CHUNK_BYTES,
                  max_tensor_bytes: int = MAX_TENSOR_BYTES) -> list[bytes]:
    """All frames of ``tensor`` (see `EncodedTensor` for the arguments and errors)."""
    return EncodedTensor(tensor, opcode=opcode, stream_id=stream_id, step=step,
                         start_pos=start_pos, compute_us=compute_us, wire_dtype=wire_dtype,
                         chunk_bytes=chunk_bytes, max_tensor_bytes=max_tensor_bytes).frames()


# ---------------------------------------------------------------------------------------
# Receiving


def parse_header(frame: bytes | bytearray | memoryview, *, chunk_bytes: int,
                 max_tensor_bytes: int) -> ChunkHeader:
    """Decode and validate the header of one data frame; allocates nothing.

    Checks (docs/protocol.md §4.2): frame length, data opcode, flags, dtype, rank, dims,
    tensor size within ``max_tensor_bytes``, chunk count for the negotiated
    ``chunk_bytes``, index < count, and this chunk's exact payload length.

    Raises:
        ProtocolError: any inconsistency.
        FrameTooLarge: the tensor is larger than ``max_tensor_bytes``.
    """
    n = len(frame)
    if n < HEADER_SIZE:
        raise ProtocolError(f"data frame of {n} bytes is shorter than its 48-byte header")
    (op, dt, ndim, flags, stream_id, step, start_pos, index, count,
     d0, d1, d2, d3, compute_us, payload) = HEADER.unpack_from(frame, 0)
    if op != OP_INPUT and op != OP_OUTPUT:
        raise ProtocolError(f"opcode {op} is not a data frame")
    if flags:
        raise ProtocolError(f"data frame flags {flags:#x} are reserved and must be 0")
    dtype = _BY_CODE.get(dt)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {dt} in a data frame")
    if not 1 <= ndim <= MAX_RANK:
        raise ProtocolError(f"tensor rank {ndim} is not 1..{MAX_RANK}")
    dims = (d0, d1, d2, d3)
    shape = dims[:ndim]
    if 0 in shape or any(dims[ndim:]):
        raise ProtocolError(f"bad tensor dims {dims} for rank {ndim}")
    total = prod(shape) * _ITEMSIZE[dtype]
    if total > max_tensor_bytes:
        raise FrameTooLarge(f"peer sent a tensor of {total} bytes; the stream's limit is "
                            f"{max_tensor_bytes} bytes", total_bytes=total,
                            max_tensor_bytes=max_tensor_bytes)
    if total <= chunk_bytes:  # one chunk (every decode step): the general rule, cheaper
        expected_count, expected_len = 1, total
    else:
        expected_count = chunk_count_for(total, chunk_bytes)
        expected_len = min(chunk_bytes, total - index * chunk_bytes)
    if count != expected_count:
        raise ProtocolError(f"chunk count {count} does not match {expected_count} chunks of "
                            f"{chunk_bytes} bytes for a {total}-byte tensor")
    if index >= count:
        raise ProtocolError(f"chunk index {index} is not below the chunk count {count}")
    if payload != expected_len or n - HEADER_SIZE != expected_len:
        raise ProtocolError(f"chunk {index} carries {n - HEADER_SIZE} bytes (header says "
                            f"{payload}); expected {expected_len}")
    return ChunkHeader(op, dtype, shape, stream_id, step, start_pos, index, count,
                       compute_us, payload, total)


class TensorAssembler:
    """Rebuilds tensors from their frames, one tensor at a time, chunks in order.

    A tensor of one chunk is a view of that frame's bytes; a tensor of several chunks is
    a view of one buffer that grows with the chunks actually received (a
    peer that declares a huge tensor and sends one chunk makes us hold one chunk, not the
    declared size). The caller must feed frames of one direction of one stream.
    """

    __slots__ = ("_buf", "_first", "_next", "chunk_bytes", "expect_dtype", "expect_opcode",
                 "expect_stream_id", "max_tensor_bytes")

    def __init__(self, *, chunk_bytes: int = TENSOR_CHUNK_BYTES,
                 max_tensor_bytes: int = MAX_TENSOR_BYTES, expect_opcode: int | None = None,
                 expect_dtype: WireDtype | None = None,
                 expect_stream_id: int | None = None) -> None:
        """Args:
            chunk_bytes: the negotiated chunk size.
            max_tensor_bytes: the negotiated largest tensor.
            expect_opcode, expect_dtype, expect_stream_id: when given, a frame with
                another value is refused before anything is allocated.
        """
        self.chunk_bytes = chunk_bytes
        self.max_tensor_bytes = max_tensor_bytes
        self.expect_opcode = expect_opcode
        self.expect_dtype = expect_dtype
        self.expect_stream_id = expect_stream_id
        self._first: ChunkHeader | None = None
        self._buf: bytearray | None = None
        self._next = 0

    @property
    def in_progress(self) -> bool:
        """Whether some chunks of a tensor have arrived but not all of them."""
        return self._first is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for the tensor in progress."""
        return len(self._buf) if self._buf is not None else 0

    def reset(self) -> None:
        """Drop the tensor in progress, if any."""
        self._first = None
        self._buf = None
        self._next = 0

    def feed(self, frame: bytes | bytearray | memoryview
             ) -> tuple[ChunkHeader, torch.Tensor | None]:
        """Take one data frame; return its header and the tensor if it is now complete.

        Raises:
            ProtocolError: a malformed header, or a chunk out of order or inconsistent
                with the first chunk of its tensor (the tensor in progress is dropped).
            FrameTooLarge: the tensor exceeds ``max_tensor_bytes``.
        """
        try:
            h = parse_header(frame, chunk_bytes=self.chunk_bytes,
                             max_tensor_bytes=self.max_tensor_bytes)
        except ProtocolError:
            self.reset()
            raise
        if ((self.expect_opcode is not None and h.opcode != self.expect_opcode)
                or (self.expect_dtype is not None and h.dtype is not self.expect_dtype)
                or (self.expect_stream_id is not None
                    and h.stream_id != self.expect_stream_id)):
            self.reset()
            raise ProtocolError(_unexpected(h, self.expect_opcode, self.expect_dtype,
                                            self.expect_stream_id))
        first = self._first
        if first is None:
            if h.chunk_index != 0:
                raise ProtocolError(f"chunk {h.chunk_index} of step {h.step} arrived before "
                                    "chunk 0")
            if h.chunk_count == 1:
                return h, _view(frame, HEADER_SIZE, h)
            self._first = h
            self._buf = bytearray(memoryview(frame)[HEADER_SIZE:])
            self._next = 1
            return h, None
        if (h.chunk_index != self._next or h.opcode != first.opcode
                or h.dtype is not first.dtype or h.shape != first.shape
                or h.step != first.step or h.start_pos != first.start_pos
                or h.stream_id != first.stream_id or h.compute_us != first.compute_us):
            self.reset()
            raise ProtocolError(f"chunk {h.chunk_index} of step {h.step} does not continue "
                                f"chunk {self._next - 1} of step {first.step}")
        buf = self._buf
        assert buf is not None
        buf += memoryview(frame)[HEADER_SIZE:]  # chunks arrive in order: appending places them
        self._next += 1
        if self._next < h.chunk_count:
            return h, None
        self.reset()
        return h, _view(buf, 0, h)


def _unexpected(h: ChunkHeader, opcode: int | None, dtype: WireDtype | None,
                stream_id: int | None) -> str:
    if opcode is not None and h.opcode != opcode:
        return f"data frame with opcode {h.opcode} where {opcode} was expected"
    if dtype is not None and h.dtype is not dtype:
        return (f"tensor of dtype {h.dtype.wire_name} on a stream whose wire dtype is "
                f"{dtype.wire_name}")
    return f"data frame for stream {h.stream_id} on stream {stream_id}"


def _view(buf: bytes | bytearray | memoryview, offset: int, h: ChunkHeader) -> torch.Tensor:
    """The tensor described by ``h`` over ``buf[offset:]`` — no copy on little-endian."""
    np_dtype = _NUMPY.get(h.dtype)
    if np_dtype is not None and _LITTLE:
        return torch.from_numpy(np.ndarray(h.shape, np_dtype, buf, offset))
    t = torch.frombuffer(buf, dtype=h.dtype.torch_dtype, count=h.total_bytes // h.dtype.itemsize,
                         offset=offset)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        t = _byteswapped(t, h.dtype.itemsize)
    return t.view(h.shape)


def decode_tensor(frames: Sequence[bytes | bytearray | memoryview], *,
                  chunk_bytes: int = TENSOR_CHUNK_BYTES,
                  max_tensor_bytes: int = MAX_TENSOR_BYTES) -> tuple[ChunkHeader, torch.Tensor]:
    """Rebuild one tensor from exactly its frames.

    Raises:
        ProtocolError: malformed, missing, extra or out-of-order frames.
        FrameTooLarge: the tensor exceeds ``max_tensor_bytes``.
    """
    asm = TensorAssembler(chunk_bytes=chunk_bytes, max_tensor_bytes=max_tensor_bytes)
    for i, frame in enumerate(frames):
        h, t = asm.feed(frame)
        if t is not None:
            if i != len(frames) - 1:
                raise ProtocolError(f"{len(frames) - 1 - i} frames follow a complete tensor")
            return h, t
    raise ProtocolError(f"tensor incomplete after {len(frames)} frames")
