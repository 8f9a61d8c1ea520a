"""Weight formats (issue 12 §2): int8/int4 modules, per-tensor loading, heads, routing policy."""

from __future__ import annotations

import os

import pytest
import torch

from hearthnet.distributed_inference.directory import formats
from hearthnet.distributed_inference.engine import q4vnni, quant
from hearthnet.distributed_inference.engine.quant import (
    Int4Linear,
    Int8Linear,
    held_bytes,
    held_nbytes,
)
from hearthnet.errors import BadRequest, ConfigError
from tests.helpers.kernels import use_int4_kernel


@pytest.mark.parametrize("int4", ["int4pack-bf16", q4vnni.KERNEL])
def test_int8_and_int4_linear_match_the_float_product(int4, monkeypatch):
    use_int4_kernel(monkeypatch, int4)
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 256) * 0.05, torch.randn(96), torch.randn(3, 5, 256)
    ref = torch.nn.functional.linear(x, w, b)
    q8, q4 = Int8Linear(w, b), Int4Linear(w, b)
    plain = Int8Linear(w, b, keep_rows=True).weight_int8
    assert plain.dtype == torch.int8 and plain.shape == (96, 256)
    # per-output-channel symmetric: each row's largest |w| maps to ±127
    assert bool((plain.abs().amax(1) == 127).all())
    assert (q8.dequantised() - w).abs().max() <= w.abs().amax(1).max() / 127
    for m, tol in ((q8, 0.02), (q4, 0.12)):
        y = m(x)
        assert y.shape == ref.shape and y.dtype == x.dtype
        assert float((y - ref).norm() / ref.norm()) < tol
    assert Int4Linear(torch.randn(16, 96), None).group == 32  # 64 does not divide 96
    # torch's kernel: groups of 64 where they divide; int4-vnni: 32, as llama.cpp's Q4_1
    assert Int4Linear(torch.randn(16, 256), None).group == (64 if int4 != q4vnni.KERNEL else 32)
    assert q4.vnni == (int4 == q4vnni.KERNEL)
    assert held_bytes(q4) - 4 * 96 == held_nbytes((96, 256), "int4", True)  # less the bias
    with pytest.raises(BadRequest, match="int4 needs"):
        Int4Linear(torch.randn(16, 100), None)


def test_int4_quantised_at_load_for_the_vnni_kernel_is_q4_1_with_fp16_numbers(monkeypatch):
    """Quantised at load for `int4-vnni`: groups of 32 with an fp16 scale and minimum each,
    every weight within half a step of its group's grid (steps of the fp16 scale), the
    product that of those weights to ~1e-4."""
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    torch.manual_seed(1)
    w = torch.randn(48, 320) * torch.logspace(-3, 0, 320)  # groups of very different sizes
    q4 = Int4Linear(w, None)
    assert q4.vnni and q4.group == 32
    assert q4.scales_and_zeros.dtype == q4.offsets.dtype == torch.float16
    step = q4.scales_and_zeros.float().permute(0, 2, 1).reshape(48, 10)  # (rows, groups)
    low = q4.offsets.float().permute(0, 2, 1).reshape(48, 10)
    held = q4(torch.eye(320)).t()  # the held weights, row by row
    err = (held - w).reshape(48, 10, 32).abs()
    assert bool((err <= step[..., None] * 0.5 + 1e-3 * step[..., None] + 1e-6).all())
    grid = ((held.reshape(48, 10, 32) - low[..., None]) / step[..., None])
    assert float((grid - grid.round()).abs().max()) < 1e-3  # values on the fp16 grid
    x = torch.randn(7, 320)
    ref = x.double() @ held.double().t()
    assert float((q4(x).double() - ref).norm() / ref.norm()) < 1e-4


def test_formats_and_routing_policy():
    assert formats.resolve_format("native", "bfloat16") == "bf16"
    assert formats.resolve_format("native", "float32") == "fp32"
    assert formats.resolve_format("int8", "bfloat16") == "int8"
    assert quant.format_name(torch.bfloat16) == "bf16" and quant.format_name("float32") == "fp32"
    with pytest.raises(BadRequest, match="unknown weight format 'int3'"):
        formats.resolve_format("int3", "float32")
    assert formats.check_policy(None) == "lossless"
    for bad in ("fp8", 3, "EXACT", "Lossless"):
        with pytest.raises(BadRequest, match="weights must be"):
            formats.check_policy(bad)
    # the default: only formats that keep the stored weights
    assert formats.lossless_formats("float32") == {"fp32"}
    assert formats.lossless_formats("bfloat16") == {"fp32", "bf16"}
    assert formats.lossless_formats("float16") == {"fp32", "fp16"}
    assert formats.lossless_formats("float32", q4_blocks=True) == {"fp32", "int4"}
    keep = formats.lossless_formats("bfloat16")
    assert formats.accepted_formats("lossless", "fp32", keep) == ["fp32", "bf16"]
    assert formats.accepted_formats("lossless", "fp32") == ["fp32"]
    # a minimum format: at least as precise as int8 — int4 is left out
    assert formats.accepted_formats("int8", "fp32") == ["fp32", "bf16", "fp16", "int8"]
    assert formats.accepted_formats("bf16", "fp32") == ["fp32", "bf16", "fp16"]
    assert formats.accepted_formats("int4", "fp32") == list(formats.HELD_FORMATS)
    assert formats.accepted_formats("exact", "bf16") == ["bf16"]


def test_quantisation_works_in_bounded_chunks_with_the_same_result(monkeypatch):
    """A wide weight (a 7B down_proj is 3584 × 18944) is quantised a few Mi elements at a
    time, so a shard's load transient stays small; the result does not depend on it."""
    torch.manual_seed(0)
    w = torch.randn(96, 640).bfloat16()
    whole = Int8Linear(w, None, keep_rows=True)
    seen: list[int] = []
    rows = quant._rows

    def spy(t):
        for r, chunk in rows(t):
            seen.append(chunk.numel())
            yield r, chunk

    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 4 * 640)
    monkeypatch.setattr(quant, "_rows", spy)
    chunked = Int8Linear(w, None, keep_rows=True)
    assert max(seen) <= 4 * 640 and len(seen) == 96 // 4
    assert torch.equal(chunked.weight_int8, whole.weight_int8)
    assert torch.equal(chunked.scales, whole.scales)


@pytest.mark.parametrize(("top", "bits"), [(127, 15), (63, 13)])
def test_activation_digits_keep_thirteen_to_fifteen_bits_of_each_row(top, bits):
    """`split_rows` writes each row as two integer digits against its own largest value:
    8-bit digits for oneDNN (~15 bits), 7-bit ones for fbgemm (~13 bits)."""
    torch.manual_seed(0)
    x = torch.randn(4, 300) * torch.tensor([[1.0], [1e-3], [50.0], [0.0]])
    x[2, 7] = 4000.0  # an outlier channel costs only its own row's resolution
    d, s = quant.split_rows(x, top)
    assert d.shape == (8, 300) and s.shape == (4, 1)
    assert torch.equal(d, d.round()) and int(d.abs().max()) == top
    back = s * (d[:4] + d[4:] / (2 * top))
    assert torch.equal(back[3], torch.zeros(300))  # an all-zero row stays zero
    # error ≤ half a lo digit: s / (4·top) = max |x| / (4·top²) per row, ≈ 2^-bits
    assert bool(((back - x).abs() <= s / (4 * top) * 1.001 + 1e-30).all())
    assert 4 * top * top > 2 ** bits


def test_int8_kernel_is_an_exact_integer_gemm_only_where_it_is_fast():
    """On CPUs without VNNI/AMX torch's oneDNN int8 GEMM is wrong and ~10-100× slower than
    `_weight_int8pack_mm`: at import each kernel is checked for exact products and timed."""
    assert quant.INT8_KERNEL in quant.INT8_KERNELS
    # every process on one machine must choose alike (their answers must agree): again
    assert quant._int8_kernel() == quant.INT8_KERNEL
    assert quant._integer_gemm() in ("onednn", "fbgemm", "int8pack")
    if quant._integer_gemm() != "int8pack":
        assert quant._exact(quant._integer_gemm())
    assert quant.fast_enough(0.5, 1.0)  # oneDNN with VNNI/AMX: two rows in half a row's time
    assert not quant.fast_enough(9.0, 1.0)  # its AVX2 fallback (measured: 9× on one thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        ms = quant._probe_ms(["int8pack"])
        assert torch.get_num_threads() == 3  # the probe leaves the process's count alone
    finally:
        torch.set_num_threads(threads)
    assert set(ms) == {"int8pack"} and ms["int8pack"] > 0


def test_int4_from_blocks_runs_in_the_kernel_path_a_probe_chose_and_names_it(monkeypatch):
    """int4 held from a GGUF's Q4 blocks runs in `_weight_int4pack_mm_for_cpu`'s exact fp32
    path or its bf16 one (~30× faster where vectorised): the probe keeps the exact one
    unless the bf16 one is clearly faster, and `kernel_of` names what runs."""
    probed = os.environ.get(quant.INT4_KERNEL_ENV, "auto") in ("auto", "")  # at import
    monkeypatch.delenv(quant.INT4_KERNEL_ENV, raising=False)
    assert quant.INT4_KERNEL in quant.INT4_KERNELS
    assert quant.INT4_KERNELS[quant.INT4_KERNEL] == quant.INT4_BLOCKS_DTYPE
    assert quant.kernel_of("int4", blocks=True) == quant.INT4_KERNEL
    # int4 quantised at load: in int4-vnni where that is the kernel, else bf16
    assert quant.kernel_of("int4") == (q4vnni.KERNEL if quant.INT4_KERNEL == q4vnni.KERNEL
                                       else "int4pack-bf16")
    assert set(quant.INT4_KERNELS) <= set(formats.KERNELS)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        ms = quant._int4_probe_ms()
        assert torch.get_num_threads() == 3  # the probe leaves the process's count alone
    finally:
        torch.set_num_threads(threads)
    vnni = {q4vnni.KERNEL} if q4vnni.available() else set()
    assert set(ms) == {"int4pack-fp32", "int4pack-bf16"} | vnni and min(ms.values()) > 0
    assert quant.int4_kernel(probe=lambda: ms) == quant.faster_int4(ms)
    if probed:  # every process on one machine must choose alike (answers must agree)
        assert quant.faster_int4(ms) == quant.INT4_KERNEL
    # measured with AVX-512 (8960 × 1536, one row): fp32 13.7 ms, bf16 0.41 ms
    assert quant.faster_int4({"int4pack-fp32": 13.7, "int4pack-bf16": 0.41}) == "int4pack-bf16"
    # a bf16 path that is a reference path too, or only a little faster: exact
    for bf16 in (20.8, 13.7, 8.0):
        assert quant.faster_int4({"int4pack-fp32": 13.7, "int4pack-bf16": bf16}) == \
            "int4pack-fp32"
    # the faster faithful path, unless bf16 is twice as fast as it (Zen 4, 1024 × 1024)
    probed_zen4 = {"int4pack-fp32": 1.76, "int4pack-bf16": 0.057, q4vnni.KERNEL: 0.020}
    assert quant.faster_int4(probed_zen4) == q4vnni.KERNEL
    assert quant.faster_int4({**probed_zen4, q4vnni.KERNEL: 0.2}) == "int4pack-bf16"
    assert quant.faster_int4({**probed_zen4, q4vnni.KERNEL: 2.0}) == "int4pack-bf16"
    assert quant.faster_int4({**probed_zen4, "int4pack-bf16": 1.0}) == q4vnni.KERNEL

    def broken() -> dict[str, float]:
        raise RuntimeError("no bf16 int4pack kernel in this build")

    assert quant.int4_kernel("auto", probe=broken) == "int4pack-fp32"
    # kernel_of names the path chosen
    for name in quant.INT4_KERNELS:
        monkeypatch.setattr(quant, "INT4_KERNEL", name)
        assert quant.kernel_of("int4", blocks=True) == name


def test_the_int4_kernel_can_be_chosen_by_environment_and_a_bad_name_is_refused(monkeypatch):
    def never() -> dict[str, float]:
        raise AssertionError("an explicit choice needs no probe")

    for value, kernel in (("exact", "int4pack-fp32"), ("int4pack-fp32", "int4pack-fp32"),
                          ("int4pack-bf16", "int4pack-bf16"),
                          (" Int4pack-BF16 ", "int4pack-bf16")):
        monkeypatch.setenv(quant.INT4_KERNEL_ENV, value)
        assert quant.int4_kernel(probe=never) == kernel
        assert quant.int4_kernel(value, probe=never) == kernel
    fast = {"int4pack-fp32": 10.0, "int4pack-bf16": 1.0}
    for auto in ("auto", ""):
        monkeypatch.setenv(quant.INT4_KERNEL_ENV, auto)
        assert quant.int4_kernel(probe=lambda: fast) == "int4pack-bf16"
    monkeypatch.setenv(quant.INT4_KERNEL_ENV, "fast")
    with pytest.raises(ConfigError, match="HEARTHNET_INT4_KERNEL='fast' is not an int4 "
                                          "kernel; use one of auto, exact, int4pack-fp32"):
        quant.int4_kernel(probe=never)
    with pytest.raises(ConfigError, match="'int4pack'"):
        quant.int4_kernel("int4pack", probe=never)


def test_an_integer_gemm_that_saturates_is_not_used(monkeypatch):
    """torch's oneDNN int8 GEMM on an AVX2-only CPU (AMD EPYC, Zen 1) computed 64 · 127²
    as 8,160, and fbgemm's AVX2 kernel sums pairs in 16 bits: a GEMM that loses
    full-range products is refused, not used."""
    for name, kernel in (("_qlinear", "onednn"), ("_fbgemm", "fbgemm")):
        exact = getattr(quant, name)

        def saturating(*a, exact=exact):  # int16 sums, as vpmaddubsw would
            return exact(*a).clamp(-32768, 32767)

        monkeypatch.setattr(quant, name, saturating)
        assert not quant._exact(kernel)
        monkeypatch.setattr(quant, name, exact)


VNNI8 = q4vnni.INT8_KERNEL


@pytest.fixture(params=["onednn", "fbgemm", VNNI8])
def kernel(request, monkeypatch):
    """Each integer GEMM in use, where torch has it here exactly (even if too slow to be
    chosen on this CPU), and HearthNet's VNNI kernel where it runs."""
    if request.param == VNNI8 and not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    if request.param != VNNI8 and not quant._exact(request.param):
        pytest.skip(f"no exact {request.param} int8 GEMM here (torch build or CPU)")
    monkeypatch.setattr(quant, "INT8_KERNEL", request.param)
    return request.param


def _scale_bytes(kernel: str, rows: int) -> int:
    """Bytes of an int8 linear's scales: bf16 per row, and `int8-vnni`'s fp32 copy."""
    return rows * 2 + (rows * 4 if kernel == VNNI8 else 0)


def test_integer_gemm_int8_is_held_once_exact_per_row_and_close_to_the_float_product(kernel):
    torch.manual_seed(0)
    w, b = torch.randn(160, 384) * 0.05, torch.randn(160)
    q8 = Int8Linear(w, b)
    plain = Int8Linear(w, b, keep_rows=True)
    assert q8.packed and q8.kernel == kernel and not plain.packed
    assert "weight_int8" not in q8._buffers
    # the weights are held once: int8 values + scales + the fp32 bias
    assert quant.held_bytes(q8) == 160 * 384 + _scale_bytes(kernel, 160) + 160 * 4
    assert torch.equal(q8.dequantised(), plain.dequantised())
    x = torch.randn(5, 384)
    y = q8(x)
    ref = torch.nn.functional.linear(x, q8.dequantised(), b)
    bits = {"onednn": 15, "fbgemm": 13, VNNI8: 15}[kernel]  # VNNI8: digits per group of 32
    assert float((y - ref).abs().max() / ref.abs().max()) < 2.0 ** (4 - bits)
    # int32 accumulation: a row's result does not depend on the batch it runs in
    for i in range(5):
        assert torch.equal(q8(x[i:i + 1]), y[i:i + 1])
    # a tied head: rows for the embedding lookup, then packed for the lm_head product
    plain.pack()
    assert plain.packed and torch.equal(plain(x), y)
    assert torch.equal(plain.rows(torch.tensor([3])), plain.dequantised()[3:4])


def test_int8_kernel_choice_override_and_probe(monkeypatch):
    """`HEARTHNET_INT8_KERNEL` names a kernel or `auto`; a name that is no kernel, or one this
    process lacks, is a ConfigError before any weight is packed. `auto` keeps the VNNI path
    unless the integer GEMM is clearly faster."""
    with pytest.raises(ConfigError, match="is not an int8 kernel"):
        quant._int8_kernel("avx9000")
    monkeypatch.setenv(quant.INT8_KERNEL_ENV, "int8pack")
    assert quant._int8_kernel() == "int8pack"
    monkeypatch.setenv(quant.INT8_KERNEL_ENV, " FBGEMM ")
    if quant._exact("fbgemm"):
        assert quant._int8_kernel() == "fbgemm"
    else:
        with pytest.raises(ConfigError, match="no exact fbgemm"):
            quant._int8_kernel()
    if not q4vnni.available():
        with pytest.raises(ConfigError, match="int8-vnni"):
            quant._int8_kernel(VNNI8)
        assert quant._int8_kernel("auto", probe=pytest.fail) == quant._integer_gemm()
        return
    base = quant._integer_gemm()
    assert quant._int8_kernel(VNNI8) == VNNI8
    tie = quant._int8_kernel("auto", probe=lambda b: {VNNI8: 1.2, b: 1.0})
    slower = quant._int8_kernel("auto", probe=lambda b: {VNNI8: 1.3, b: 1.0})
    assert (tie, slower) == (VNNI8, base)
    ms = quant._vnni_probe_ms(base)  # the real probe: both kernels timed
    assert set(ms) == {VNNI8, base} and all(v > 0 for v in ms.values())


def test_int8_vnni_pads_rows_reads_rows_from_its_packed_matrix_and_keeps_odd_widths(
        monkeypatch):
    """In `int8-vnni` a linear whose rows are no whole tile of 16 is padded and returns only
    its rows; its lookups (a tied head's embeddings) read the packed matrix, held once; a
    matrix whose inputs are no whole groups of 32 runs in the integer GEMM instead."""
    if not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    monkeypatch.setattr(quant, "INT8_KERNEL", VNNI8)
    torch.manual_seed(0)
    w, b = torch.randn(50, 64) * 0.05, torch.randn(50)
    tied = Int8Linear(w, b, keep_rows=True)
    ids = torch.tensor([[0, 49], [7, 7]])
    before = tied.rows(ids)
    tied.pack()
    assert tied.kernel == VNNI8 and set(tied._buffers) == {"scales", "weight_q8", "scales_q8"}
    assert tied.weight_q8.shape == (4, 2, 512)  # 64 rows: 50 and 14 of padding
    assert torch.equal(tied.rows(ids), before)
    x = torch.randn(3, 5, 64)
    y = tied(x)
    assert y.shape == (3, 5, 50)
    ref = torch.nn.functional.linear(x, tied.dequantised(), b)
    assert float((y - ref).abs().max() / ref.abs().max()) < 2.0 ** -11
    odd = Int8Linear(torch.randn(32, 48) * 0.05, None)
    assert odd.kernel == quant._integer_gemm()
    assert odd(torch.randn(2, 48)).shape == (2, 32)


def test_int8_without_an_integer_gemm_runs_torchs_int8pack_kernel(monkeypatch):
    monkeypatch.setattr(quant, "INT8_KERNEL", "int8pack")
    torch.manual_seed(0)
    w, x = torch.randn(64, 128) * 0.05, torch.randn(3, 128)
    q8 = Int8Linear(w, None)
    assert not q8.packed and q8.weight_int8.shape == (64, 128)
    q8.pack()  # nothing to pack into
    assert not q8.packed
    ref = torch.nn.functional.linear(x, q8.dequantised())
    assert float((q8(x) - ref).norm() / ref.norm()) < 0.01  # bf16 activations


class _Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 64)
        self.k_proj = torch.nn.Linear(64, 16)
        self.v_proj = torch.nn.Linear(64, 16)
        self.o_proj = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.o_proj(self.q_proj(x)) + torch.cat([self.k_proj(x), self.v_proj(x)], -1).sum()


def test_siblings_reading_one_input_run_as_one_fused_gemm(kernel, monkeypatch):
    """q/k/v (and gate/up) are packed as one matrix: one GEMM per input, the same results
    as each linear on its own, each member's output taken once and then let go."""
    torch.manual_seed(0)
    ref = _Attn()
    with torch.device("meta"):
        held = _Attn()
    quant.load_module(held, iter(ref.state_dict().items()), "int8", "test")
    assert isinstance(held.q_proj, quant.FusedMember) and held.q_proj.group is held.v_proj.group
    assert isinstance(held.o_proj, Int8Linear) and held.o_proj.packed
    group = held.q_proj.group
    assert "weight_int8" not in group.inner._buffers and group.splits == [64, 16, 16]
    # held once: int8 q|k|v + scales + fp32 bias, and o_proj
    assert quant.held_bytes(held) == 96 * 64 + _scale_bytes(kernel, 96) + 96 * 4 + 64 * 64 \
        + _scale_bytes(kernel, 64)
    x = torch.randn(3, 64)
    solo = {n: Int8Linear(getattr(ref, n).weight.detach(), getattr(ref, n).bias.detach())(x)
            for n in ("q_proj", "k_proj", "v_proj")}
    calls = []
    owner, name = (q4vnni, "mm8") if kernel == VNNI8 else (Int8Linear, "_gemm")
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        outs = {n: getattr(held, n)(x) for n in ("k_proj", "q_proj", "v_proj")}
        assert len(calls) == 1 and getattr(group._last, "v", None) is None  # all taken
        for n, y in outs.items():
            assert y.is_contiguous() and torch.allclose(y, solo[n], rtol=0, atol=1e-5)
        y2 = held.k_proj(x.clone())  # another input: computed afresh
        assert len(calls) == 2 and torch.allclose(y2, outs["k_proj"], rtol=0, atol=1e-5)
        held.k_proj(x)  # and a member asked twice for one input
        held.k_proj(x)
        assert len(calls) == 4
        want = torch.nn.functional.linear(x, ref.q_proj.weight, ref.q_proj.bias)
        assert float((outs["q_proj"] - want).norm() / want.norm()) < 0.02


class _Mlp(torch.nn.Module):
    def __init__(self, rows: tuple[int, int]) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(64, rows[0])
        self.up_proj = torch.nn.Linear(64, rows[1], bias=False)


@pytest.mark.parametrize("int4", ["int4pack-bf16", q4vnni.KERNEL])
@pytest.mark.parametrize("rows", [(128, 64), (64, 16)])
def test_int4_siblings_are_held_as_one_matrix_where_their_packed_rows_join(rows, int4,
                                                                         monkeypatch):
    """gate/up in int4 are one packed matrix (one kernel call per input, each member's
    output as its own linear gives it, nothing held twice) where their packed rows join:
    torch packs rows in blocks (64 on AVX-512: 16 rows do not join), int4-vnni in tiles
    of 16 (always); else two linears."""
    use_int4_kernel(monkeypatch, int4)
    vnni = int4 == q4vnni.KERNEL
    torch.manual_seed(0)
    ref = _Mlp(rows)
    with torch.device("meta"):
        held = _Mlp(rows)
    quant.load_module(held, iter(ref.state_dict().items()), "int4", "test")
    solo = {n: Int4Linear(getattr(ref, n).weight.detach(),
                          None if getattr(ref, n).bias is None
                          else getattr(ref, n).bias.detach()) for n in ("gate_proj", "up_proj")}
    joins = vnni or quant._packs_join(rows)
    if rows == (128, 64):
        assert joins  # whole blocks in every layout torch packs (32 or 64 rows)
    assert isinstance(held.gate_proj, quant.FusedMember) == joins
    calls = []
    owner, name = (q4vnni, "mm") if vnni else (torch, "_weight_int4pack_mm_for_cpu")
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        outs = {n: getattr(held, n)(x) for n in ("up_proj", "gate_proj")}
        assert len(calls) == (1 if joins else 2)
        for n, y in outs.items():
            assert torch.equal(y, solo[n](x)), n
    if joins:
        group = held.gate_proj.group
        assert group.splits == list(rows) and getattr(group._last, "v", None) is None
        groups = 64 // group.inner.group
        # nibbles, and bf16 (scale, zero) or fp16 (scale, minimum) per group
        packed = sum(r * 64 // 2 + groups * r * 2 * 2 for r in rows)
        # and the fp32 bias of both (up's zeros: the members' biases are one vector)
        assert quant.held_bytes(held) == packed + sum(rows) * 4
