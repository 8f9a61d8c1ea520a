"""int4 products of many rows (a prefill) in fp32 GEMMs of de-quantised tiles: the same
weights as torch's int4 kernel, exact to fp32 rounding, used from a probed row count on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from hearthnet.distributed_inference.engine import quant
from hearthnet.distributed_inference.engine.blocks import GgmlBlocks
from hearthnet.distributed_inference.engine.quant import Int4Linear
from hearthnet.errors import ConfigError
from tests.helpers.kernels import use_int4_kernel

needs_layout = pytest.mark.skipif(not quant.dense_layout_ok(),
                                  reason="torch packs int4 in another layout on this CPU")


@pytest.fixture(autouse=True)
def torch_int4(monkeypatch):
    """The dense path reads torch's int4 layout: int4 quantised at load in torch's kernel
    (where int4-vnni is this process's choice, it would be held for that instead)."""
    use_int4_kernel(monkeypatch, "int4pack-bf16")


def _q4_linear(kind: str, n: int = 128, k: int = 96) -> tuple[Int4Linear, torch.Tensor]:
    """An int4 linear held from GGUF `kind` blocks of a random (n, k) matrix, and the
    blocks' exact fp32 weights (the reference)."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    t = GGMLQuantizationType[kind]
    blocks = GgmlBlocks(torch.from_numpy(quants.quantize(w, t)), kind, (n, k))
    return Int4Linear.from_blocks(blocks, None, torch.bfloat16), blocks.dequantise()


def _exact_weights(m: Int4Linear) -> torch.Tensor:
    """(n, k) fp32 weights (q − 8)·scale + zero of `m` as held (its bf16 scales), from
    the kernel itself: identity rows in the exact fp32 path."""
    sz = m.scales_and_zeros.float()
    w: torch.Tensor = torch._weight_int4pack_mm_for_cpu(
        torch.eye(m.in_features), m.weight_int4, m.group, sz).t()
    return w


@needs_layout
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_dense_product_is_the_held_weights_product_to_fp32_rounding(kind):
    m, ref_w = _q4_linear(kind)
    w = _exact_weights(m)
    # the held weights are the blocks' up to the bf16 rounding of their scales
    assert float((w - ref_w).abs().max()) <= 2 ** -8 * float(ref_w.abs().max())
    x = torch.randn(40, m.in_features, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ w.double().t())
    dense = quant.dense_product(x, m.weight_int4, m.scales_and_zeros, m.group)
    kernel = torch._weight_int4pack_mm_for_cpu(x.bfloat16(), m.weight_int4, m.group,
                                               m.scales_and_zeros).double()
    scale = float(ref.abs().max())
    assert dense.dtype == torch.float32 and dense.shape == (40, m.out_features)
    assert float((dense.double() - ref).abs().max()) <= 1e-5 * scale  # fp32 rounding
    assert float((kernel - ref).abs().max()) > 1e-4 * scale  # bf16 activations: not so
    # groups of 64 (int4 quantised at load) and several tiles of row blocks
    big = Int4Linear(torch.randn(192, 256), None)
    assert big.group == 64
    x = torch.randn(3, 256)
    w = _exact_weights(big)
    for tile_bytes in (1, quant._TILE_BYTES):  # one block per tile, all in one
        quant_tile = quant._TILE_BYTES
        quant._TILE_BYTES = tile_bytes
        try:
            got = quant.dense_product(x, big.weight_int4, big.scales_and_zeros, 64)
        finally:
            quant._TILE_BYTES = quant_tile
        assert float((got - x @ w.t()).abs().max()) <= 1e-5 * float((x @ w.t()).abs().max())


@needs_layout
def test_int4_linear_runs_many_rows_dense_and_few_in_the_kernel(monkeypatch):
    m, _ = _q4_linear("Q4_0")
    w = _exact_weights(m)
    calls: list[int] = []
    kernel = torch._weight_int4pack_mm_for_cpu

    def counted(x: torch.Tensor, *a: object) -> torch.Tensor:
        calls.append(len(x))
        return kernel(x, *a)

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", counted)
    monkeypatch.setattr(quant, "INT4_DENSE_ROWS", 64.0, raising=False)
    monkeypatch.setattr(quant, "_DEQUANTISE", quant._dequantised_tile)
    for rows, dense in ((1, False), (33, False), (63, False), (64, True), (100, True)):
        calls.clear()
        x = torch.randn(1, rows, m.in_features)
        y = m(x)
        assert y.shape == (1, rows, m.out_features) and y.dtype == x.dtype
        assert calls == ([] if dense else [rows])
        err = float((y[0].double() - x[0].double() @ w.double().t()).abs().max())
        assert (err <= 1e-5 * float(y.abs().max())) == dense  # the kernel rounds to bf16
    # a threshold under the floor still leaves a speculative pass (≤ 33 rows) in the kernel
    monkeypatch.setattr(quant, "INT4_DENSE_ROWS", 1.0)
    calls.clear()
    m(torch.randn(33, m.in_features))
    assert calls == [33]
    # rows that are not whole blocks of 64 always run in the kernel
    odd, _ = _q4_linear("Q4_0", n=80)
    calls.clear()
    odd(torch.randn(100, 96))
    assert calls == [100]


def test_the_probe_chooses_the_fewest_rows_from_which_dense_stays_clearly_faster():
    # measured on the 2-core AVX-512 VM (8960 × 1536, one thread): kernel against dense
    assert quant.dense_rows_from({64: (22.0, 24.0), 128: (52.0, 35.5),
                                  256: (101.0, 66.0)}) == 128
    assert quant.dense_rows_from({64: (10.0, 8.0), 128: (20.0, 12.0), 256: (40.0, 20.0)}) \
        == 64
    # faster at 64 but not at 128: a probe that flips is noise, not a threshold
    assert quant.dense_rows_from({64: (10.0, 8.0), 128: (20.0, 19.0),
                                  256: (40.0, 20.0)}) == 256
    assert quant.dense_rows_from({64: (10.0, 12.0), 128: (20.0, 19.0),
                                  256: (40.0, 35.0)}) == math.inf
    assert quant.dense_rows_from({16: (1.0, 0.1)}) == quant.DENSE_FLOOR


def test_the_row_threshold_can_be_set_by_environment_and_a_bad_value_is_refused(monkeypatch):
    assert quant.dense_setting(" Auto ") is None  # a probe chooses
    assert quant.dense_setting(" OFF ") == quant.dense_setting("") == math.inf  # default
    assert quant.dense_setting("128") == 128.0
    for bad in ("33", "-1", "1e3", "fast"):
        with pytest.raises(ConfigError, match=r"HEARTHNET_INT4_DENSE_ROWS=.* is not a row "
                                              r"count; use auto, off or a whole number of "
                                              r"at least 34"):
            quant.dense_setting(bad)
    monkeypatch.setenv(quant.INT4_DENSE_ENV, "several")
    with pytest.raises(ConfigError, match="'several'"):  # at load, before any product
        Int4Linear(torch.randn(64, 64), None)


BAD_SETTINGS = {
    "HEARTHNET_INT4_DENSE_ROWS": ("5", "HEARTHNET_INT4_DENSE_ROWS='5' is not a row count; use "
                                       "auto, off or a whole number of at least 34"),
    "HEARTHNET_INT8_KERNEL": ("avx9", "HEARTHNET_INT8_KERNEL='avx9' is not an int8 kernel; "
                                      "use one of auto, onednn, fbgemm, int8pack, int8-vnni"),
}


@pytest.mark.parametrize("setting", list(BAD_SETTINGS))
@pytest.mark.parametrize("argv", [["bench", "local", "--weights", "int4"],
                                  ["node", "--config", "config/auto3/node-a.toml"]])
def test_a_bad_kernel_setting_is_one_line_before_any_work(argv, setting, smollm2):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    value, message = BAD_SETTINGS[setting]
    env = dict(os.environ, **{setting: value})
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", *argv], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"hearthnet: config error: {message}"]
