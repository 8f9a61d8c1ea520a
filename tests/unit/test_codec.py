"""Tensor ⇄ frames (hearthnet/transport/codec.py, docs/protocol.md §4): pure, bytes in and out."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hearthnet.constants import TENSOR_CHUNK_BYTES
from hearthnet.errors import BadRequest, FrameTooLarge, ProtocolError
from hearthnet.transport.codec import (
    HEADER,
    HEADER_SIZE,
    OP_INPUT,
    OP_OUTPUT,
    EncodedTensor,
    TensorAssembler,
    WireDtype,
    chunk_count_for,
    decode_tensor,
    encode_tensor,
    max_frame_bytes,
    parse_header,
)

torch.set_num_threads(1)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
_INT_VIEW = {2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so NaNs compare equal and -0.0 differs from 0.0."""
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def header(**over: int) -> bytearray:
    """A valid one-chunk header for a (2, 3) fp16 tensor, fields overridable."""
    f = dict(op=OP_INPUT, dtype=1, ndim=2, flags=0, stream=7, step=1, pos=0, index=0,
             count=1, d0=2, d1=3, d2=0, d3=0, compute=0, payload=12)
    f.update(over)
    return bytearray(HEADER.pack(*f.values()))


def frame(payload: int = 12, **over: int) -> bytes:
    return bytes(header(payload=payload, **over) + bytes(payload))


# -- wire layout -------------------------------------------------------------------------


def test_header_is_48_bytes_little_endian_at_documented_offsets() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(1, 2, 3)
    (f,) = encode_tensor(t, opcode=OP_OUTPUT, stream_id=0x01020304, step=5, start_pos=9,
                         compute_us=1234)
    assert HEADER_SIZE == 48 and len(f) == 48 + 24
    assert f[0] == OP_OUTPUT and f[1] == WireDtype.FP32 and f[2] == 3 and f[3] == 0
    u32 = lambda off: struct.unpack_from("<I", f, off)[0]  # noqa: E731
    assert f[4:8] == b"\x04\x03\x02\x01"  # little-endian stream id
    assert (u32(8), u32(12), u32(16), u32(20)) == (5, 9, 0, 1)
    assert (u32(24), u32(28), u32(32), u32(36)) == (1, 2, 3, 0)
    assert (u32(40), u32(44)) == (1234, 24)
    assert bytes(f[48:]) == np.arange(6, dtype="<f4").tobytes()


def test_wire_dtype_names_and_mapping() -> None:
    for name, td in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                     ("fp32", torch.float32)):
        w = WireDtype.from_name(name)
        assert w.torch_dtype == td and WireDtype.from_torch(td) is w and w.wire_name == name
    with pytest.raises(BadRequest, match="int8"):
        WireDtype.from_name("int8")
    with pytest.raises(BadRequest):
        WireDtype.from_torch(torch.int64)


def test_max_frame_bytes_covers_a_full_chunk_and_control_frames() -> None:
    assert max_frame_bytes(TENSOR_CHUNK_BYTES) == TENSOR_CHUNK_BYTES + HEADER_SIZE
    assert max_frame_bytes(64) >= 64 * 1024


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_step_round_trip_is_exact(dtype: torch.dtype) -> None:
    x = torch.randn(1, 1, 576).to(dtype)
    frames = encode_tensor(x, step=3, start_pos=17)
    assert len(frames) == 1
    h, y = decode_tensor(frames)
    assert same(x, y) and (h.step, h.start_pos, h.shape) == (3, 17, (1, 1, 576))


def test_special_values_pass_through_unchanged() -> None:
    # M26 §5.8: NaN/Inf detection is the orchestrator's job; transport keeps every bit.
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 65504.0],
                     dtype=torch.float16)
    _, y = decode_tensor(encode_tensor(x, chunk_bytes=4), chunk_bytes=4)
    assert same(x, y)


def test_one_chunk_tensor_is_a_view_of_the_received_message() -> None:
    x = torch.randn(1, 1, 64).half()
    msg = bytes(encode_tensor(x)[0])
    _, y = TensorAssembler().feed(msg)
    assert y is not None
    assert y.data_ptr() == np.frombuffer(msg, dtype=np.uint8).ctypes.data + HEADER_SIZE


def test_multi_chunk_tensor_is_one_buffer_of_exactly_its_size() -> None:
    x = torch.randn(4, 100).float()
    frames = encode_tensor(x, chunk_bytes=256)
    assert len(frames) == chunk_count_for(1600, 256) == 7
    assert all(len(f) == HEADER_SIZE + 256 for f in frames[:-1])
    assert len(frames[-1]) == HEADER_SIZE + 1600 - 6 * 256
    _, y = decode_tensor(frames, chunk_bytes=256)
    assert same(x, y) and y.untyped_storage().nbytes() == 1600


def test_sender_converts_to_the_wire_dtype_and_handles_views() -> None:
    x = torch.randn(3, 5).t()  # non-contiguous fp32
    _, y = decode_tensor(encode_tensor(x, wire_dtype=WireDtype.BF16, chunk_bytes=8),
                         chunk_bytes=8)
    assert same(y, x.to(torch.bfloat16).contiguous())


def test_frames_are_built_lazily_and_repeatably() -> None:
    x = torch.randn(2, 300).half()
    enc = EncodedTensor(x, opcode=OP_INPUT, stream_id=1, step=0, start_pos=0,
                        chunk_bytes=500)
    assert enc.chunk_count == 3 and enc.total_bytes == 1200
    assert enc.frame(1) == enc.frames()[1]


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       dtype=st.sampled_from(DTYPES), chunk_bytes=st.integers(1, 300),
       step=st.integers(0, 2**32 - 1), seed=st.integers(0, 2**31))
def test_random_shapes_dtypes_and_chunk_sizes_round_trip_exactly(
        shape: list[int], dtype: torch.dtype, chunk_bytes: int, step: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 100).to(dtype)
    frames = encode_tensor(x, step=step, chunk_bytes=chunk_bytes)
    assert len(frames) == chunk_count_for(x.numel() * x.element_size(), chunk_bytes)
    h, y = decode_tensor([bytes(f) for f in frames], chunk_bytes=chunk_bytes)
    assert same(x, y) and h.step == step and h.chunk_count == len(frames)


# -- receive-side validation, before allocation ------------------------------------------


@pytest.mark.parametrize(("data", "match"), [
    (b"\x03" * 10, "shorter than its 48-byte header"),
    (frame(op=5), "not a data frame"),
    (frame(flags=1), "reserved"),
    (frame(dtype=9), "unknown dtype"),
    (frame(ndim=0), "rank 0"),
    (frame(ndim=5), "rank 5"),
    (frame(d1=0), "bad tensor dims"),
    (frame(d2=4), "bad tensor dims"),
    (frame(count=2), "chunk count 2"),
    (frame(index=1, count=1), "not below"),
    (frame(payload=10), "carries 10 bytes"),
    (bytes(header()) + bytes(13), "carries 13 bytes"),
])
def test_malformed_headers_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_header(data, chunk_bytes=1024, max_tensor_bytes=1 << 20)


def test_oversized_tensor_is_refused_from_its_header_alone() -> None:
    # 65535^4 fp32 elements would be 73 EB: refused before any allocation.
    huge = bytes(header(ndim=4, dtype=3, d0=65535, d1=65535, d2=65535, d3=65535,
                        payload=0))
    with pytest.raises(FrameTooLarge) as info:
        TensorAssembler(max_tensor_bytes=1 << 30).feed(huge)
    assert info.value.code == "frame_too_large"


def test_tensor_at_the_limit_is_accepted() -> None:
    x = torch.ones(2, 3).half()
    _, y = decode_tensor(encode_tensor(x), max_tensor_bytes=12)
    assert same(x, y)
    with pytest.raises(FrameTooLarge):
        decode_tensor(encode_tensor(x), max_tensor_bytes=11)


def chunks(n: int = 4) -> list[bytes]:
    x = torch.arange(n * 8, dtype=torch.float16)
    return [bytes(f) for f in encode_tensor(x, step=2, chunk_bytes=16)]


def test_chunk_before_chunk_zero_is_refused() -> None:
    with pytest.raises(ProtocolError, match="before chunk 0"):
        TensorAssembler(chunk_bytes=16).feed(chunks()[1])


def test_skipped_or_repeated_chunk_is_refused_and_resets() -> None:
    fs = chunks()
    asm = TensorAssembler(chunk_bytes=16)
    asm.feed(fs[0])
    with pytest.raises(ProtocolError, match="does not continue"):
        asm.feed(fs[2])
    assert not asm.in_progress and asm.buffered_bytes == 0
    asm.feed(fs[0])
    with pytest.raises(ProtocolError, match="does not continue"):
        asm.feed(fs[0])


def test_chunks_of_another_tensor_are_refused() -> None:
    fs = chunks()
    other = [bytes(f) for f in encode_tensor(torch.zeros(32, dtype=torch.float16), step=3,
                                             chunk_bytes=16)]
    asm = TensorAssembler(chunk_bytes=16)
    asm.feed(fs[0])
    with pytest.raises(ProtocolError, match="does not continue"):
        asm.feed(other[1])


def test_missing_or_extra_frames_are_refused() -> None:
    fs = chunks()
    with pytest.raises(ProtocolError, match="incomplete"):
        decode_tensor(fs[:-1], chunk_bytes=16)
    with pytest.raises(ProtocolError, match="follow a complete tensor"):
        decode_tensor([*fs, fs[0]], chunk_bytes=16)


def test_chunk_size_must_match_the_negotiated_one() -> None:
    with pytest.raises(ProtocolError, match="chunk count"):
        decode_tensor(chunks(), chunk_bytes=32)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(expect_opcode=OP_OUTPUT), "opcode 3"),
    (dict(expect_dtype=WireDtype.FP32), "wire dtype is fp32"),
    (dict(expect_stream_id=8), "stream 0 on stream 8"),
])
def test_assembler_expectations_refuse_before_allocating(kwargs: dict[str, object],
                                                         match: str) -> None:
    asm = TensorAssembler(chunk_bytes=16, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=match):
        asm.feed(chunks()[0])
    assert asm.buffered_bytes == 0


# -- send-side validation ----------------------------------------------------------------


@pytest.mark.parametrize(("tensor", "kwargs", "match"), [
    (torch.ones(3, dtype=torch.int32), {}, "dtype torch.int32"),
    (torch.ones(3, dtype=torch.int32), dict(wire_dtype=WireDtype.FP16), "floating point"),
    (torch.ones(1, 1, 1, 1, 1), {}, "rank 5"),
    (torch.tensor(1.0), {}, "rank 0"),
    (torch.ones(2, 0, 3), {}, "empty"),
    (torch.ones(4), dict(max_tensor_bytes=15), "exceeds"),
    (torch.ones(4), dict(step=-1), "step -1"),
    (torch.ones(4), dict(start_pos=2**32), "start_pos"),
    (torch.ones(4), dict(chunk_bytes=0), "chunk_bytes"),
    (torch.ones(4), dict(opcode=5), "not a data frame"),
])
def test_unsendable_tensors_raise_bad_request(tensor: torch.Tensor, kwargs: dict[str, object],
                                              match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        encode_tensor(tensor, **kwargs)  # type: ignore[arg-type]


def test_tensor_with_grad_is_sent_detached() -> None:
    x = torch.randn(2, 2, requires_grad=True)
    _, y = decode_tensor(encode_tensor(x))
    assert same(y, x.detach()) and not y.requires_grad


def test_the_wire_dtype_names_are_one_list() -> None:
    """`constants.WIRE_DTYPES` names exactly the codec's dtypes, in order, bf16 included;
    the config's `activation_dtype` accepts those and `auto`, nothing else."""
    from typing import get_args

    from hearthnet.config import DistributedInferenceSection
    from hearthnet.constants import WIRE_DTYPES
    from hearthnet.dtypes import FLOAT_DTYPES
    from hearthnet.transport.codec import WireDtype

    assert tuple(d.wire_name for d in WireDtype) == WIRE_DTYPES == tuple(FLOAT_DTYPES)
    assert "bf16" in WIRE_DTYPES
    field = DistributedInferenceSection.model_fields["activation_dtype"]
    assert get_args(field.annotation) == ("auto", "compact", *WIRE_DTYPES)
