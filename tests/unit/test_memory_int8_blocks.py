"""An int8 product of many rows (a prefill chunk) runs in blocks of rows, so its transient
digit products stay within `quant.PRODUCT_BYTES` (M26 §5.6: a host holds its weights and
caches, not a layer's activations several times over) — and computes exactly what one
GEMM over all the rows computes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hearthnet.distributed_inference.engine import quant
from hearthnet.distributed_inference.engine.quant import Int8Linear


@pytest.fixture
def kernel() -> str:
    """The integer GEMM int8 products run in here (the other one, where torch has it, can
    be 10-100× slower on this CPU: `quant._int8_kernel`)."""
    name = quant.int8_kernel_name()
    if name == "int8pack":
        pytest.skip("no integer GEMM here: int8 products run in torch's int8pack kernel")
    return name


def _one_gemm(q8: Int8Linear, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
              ) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(quant, "PRODUCT_BYTES", 1 << 40)
        assert q8.block_rows() >= len(x)
        y: torch.Tensor = q8(x)
        return y


@pytest.mark.parametrize(("out_features", "rows", "block"),
                         [(640, 100, 16), (1024, 80, 32)])
def test_a_product_in_blocks_of_rows_is_bit_identical_to_one_gemm(
        kernel: str, monkeypatch: pytest.MonkeyPatch, out_features: int, rows: int,
        block: int) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(out_features, 512) * 0.05, torch.randn(out_features)
    q8 = Int8Linear(w, b)
    assert q8.kernel == kernel
    x = torch.randn(1, rows, 512) * 3
    # the transients of `block` rows at most (per row: 2 fp32 digit products of the outputs,
    # 4 fp32 rows of the inputs): blocks, and a short last one
    monkeypatch.setattr(quant, "PRODUCT_BYTES", 4 * (2 * out_features + 4 * 512) * block + 4)
    assert q8.block_rows() == block
    y = q8(x)
    assert y.shape == (1, rows, out_features)
    assert torch.equal(y, _one_gemm(q8, x, monkeypatch))


def test_a_decode_rounds_rows_stay_one_gemm_at_a_1_5b_mlp_width(kernel: str) -> None:
    """The widest product of a 1.5B layer (the fused gate/up, 17,920 outputs) keeps a
    decode round (≤ 8 rows) and a speculative pass (≤ 33) in one GEMM."""
    q8 = Int8Linear.__new__(Int8Linear)
    torch.nn.Module.__init__(q8)
    q8.in_features, q8.out_features = 1536, 2 * 8960
    assert q8.block_rows() >= 33
