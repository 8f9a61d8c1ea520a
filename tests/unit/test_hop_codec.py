"""The small-tensor path of a hop (docs/protocol.md §4, M26 §5.5): a decode step's hidden
state is framed without copying the tensor first and received as a view of the message —
for every wire dtype — and the codec's own cost is what `hearthnet bench transport` reports."""

from __future__ import annotations

import gc

import pytest
import torch

from hearthnet.transport.bench import codec_timings
from hearthnet.transport.codec import (
    HEADER_SIZE,
    OP_OUTPUT,
    EncodedTensor,
    TensorAssembler,
    WireDtype,
    decode_tensor,
    encode_tensor,
)

torch.set_num_threads(1)

WIRES = [(WireDtype.FP16, torch.float16), (WireDtype.BF16, torch.bfloat16),
         (WireDtype.FP32, torch.float32)]


@pytest.mark.parametrize(("wire", "dtype"), WIRES)
def test_a_step_in_its_wire_dtype_is_framed_from_the_tensors_own_memory(
        wire: WireDtype, dtype: torch.dtype) -> None:
    # The documented contract: the caller must not modify the tensor until it is sent,
    # because the frame is cut from the tensor's memory, not from a copy made beforehand.
    x = torch.zeros(1, 1, 576, dtype=dtype)
    enc = EncodedTensor(x, opcode=OP_OUTPUT, stream_id=1, step=4, start_pos=9,
                        wire_dtype=wire)
    x[0, 0, 7] = 3.0
    h, y = decode_tensor([enc.frame(0)])
    assert y.dtype == dtype and y.shape == (1, 1, 576)
    assert float(y[0, 0, 7]) == 3.0 and (h.step, h.start_pos) == (4, 9)


@pytest.mark.parametrize(("wire", "dtype"), WIRES)
def test_a_received_step_is_a_view_of_the_message_for_every_wire_dtype(
        wire: WireDtype, dtype: torch.dtype) -> None:
    x = torch.randn(1, 1, 576).to(dtype)
    (msg,) = encode_tensor(x, wire_dtype=wire)
    msg = bytes(msg)
    h, y = TensorAssembler(expect_dtype=wire).feed(msg)
    assert y is not None and torch.equal(y, x) and h.total_bytes == x.numel() * x.element_size()
    base = torch.frombuffer(msg, dtype=torch.uint8).data_ptr()
    assert y.data_ptr() == base + HEADER_SIZE


def test_a_received_tensor_keeps_its_message_alive() -> None:
    # The view holds the message: dropping every other reference to the bytes must not
    # free them under the tensor.
    x = torch.randn(2, 3, 64)
    msg = bytes(encode_tensor(x)[0])
    _, y = TensorAssembler().feed(msg)
    del msg
    gc.collect()
    assert y is not None and torch.equal(y, x)


def test_a_multi_chunk_tensor_reports_its_whole_size_in_every_header() -> None:
    x = torch.randn(5, 100).half()
    asm = TensorAssembler(chunk_bytes=256)
    sizes = []
    for f in encode_tensor(x, chunk_bytes=256):
        h, y = asm.feed(f)
        sizes.append(h.total_bytes)
    assert y is not None and torch.equal(y, x) and set(sizes) == {1000}


def test_bench_transport_times_the_codec_on_a_step_frame() -> None:
    r = codec_timings(576, number=20, repeat=2)
    assert r["frame_bytes"] == HEADER_SIZE + 576 * 4 and r["n"] == 40
    assert r["encode_us"] > 0 and r["decode_us"] > 0
