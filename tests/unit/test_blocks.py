"""GGUF blocks held as int4 exactly (engine/blocks.py, quant.Int4Linear.from_blocks): for
Q4_0, Q4_1 and Q4_K the held weights are gguf-py's de-quantised fp32 weights bit for bit;
in the exact kernel a product equals the fp32 product to fp32 rounding, in the fast one
to bf16 rounding of the scales, zeros, activations and outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

from hearthnet.distributed_inference.engine import q4vnni, quant
from hearthnet.distributed_inference.engine.blocks import (
    GgmlBlocks,
    inexact_zeros,
    int4_groups,
)
from hearthnet.distributed_inference.engine.quant import Int4Linear, held_nbytes
from hearthnet.errors import ConfigError
from hearthnet.models.hashing import hash_dtype
from tests.helpers.kernels import use_int4_kernel

N, K = 48, 512  # Q4_K needs inputs in super-blocks of 256; outputs a multiple of 16


def _q4k_blocks(rng: np.random.Generator) -> np.ndarray:
    """Q4_K blocks gguf-py cannot write: random nibbles and 6-bit scales and mins, with
    real-sized fp16 d and dmin (random bytes there would be inf or NaN)."""
    raw = rng.integers(0, 256, (N, K // 256, 144), dtype=np.uint8)
    for lo in (0, 2):  # d, dmin
        half = rng.uniform(2e-4, 2e-3, (N, K // 256)).astype(np.float16)
        raw[..., lo:lo + 2] = half.view(np.uint8).reshape(N, K // 256, 2)
    return raw.reshape(N, -1)


def _blocks(kind: str) -> GgmlBlocks:
    rng = np.random.default_rng(7)
    if kind == "Q4_K":
        raw = _q4k_blocks(rng)
    else:
        raw = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05,
                       GGMLQuantizationType[kind])
    return GgmlBlocks(torch.from_numpy(raw), kind, (N, K))


def _reference(b: GgmlBlocks) -> torch.Tensor:
    values = dequantize(b.raw.numpy(), GGMLQuantizationType[b.ggml_type])
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(b.shape)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_blocks_map_onto_int4_groups_exactly(kind):
    b = _blocks(kind)
    q, scale, zero = int4_groups(b.raw, kind, b.shape)
    held = ((q.float() - 8).reshape(N, -1, 32) * scale[..., None] + zero[..., None])
    assert torch.equal(held.reshape(N, K), _reference(b))  # bit for bit
    assert torch.equal(b.dequantise(), _reference(b))
    assert inexact_zeros(b.raw, kind, b.shape) == 0


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_linear_held_from_blocks_in_the_exact_kernel_computes_the_fp32_product(
        kind, monkeypatch):
    use_int4_kernel(monkeypatch, "int4pack-fp32")  # int4pack-fp32
    b = _blocks(kind)
    bias = torch.randn(N)
    lin = Int4Linear.from_blocks(b, bias)
    assert lin.scales_and_zeros.dtype == torch.float32
    x = torch.randn(5, K)
    ref = x.double() @ _reference(b).double().t() + bias.double()
    got = lin(x)
    assert got.dtype == torch.float32
    # fp32 rounding of a 512-term sum: |Σ x·w| error ≤ ~K·eps·Σ|x·w|
    bound = 1e-6 * (x.abs().double() @ _reference(b).abs().double().t()).max()
    assert (got.double() - ref).abs().max() < bound
    fp32 = torch.nn.functional.linear(x, _reference(b), bias)  # what fp32 weights give
    assert (got - fp32).abs().max() < bound
    held = sum(t.numel() * t.element_size() for t in lin.buffers())
    assert held == held_nbytes((N, K), "int4", True, kind)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_the_fast_bf16_kernel_rounds_scales_zeros_activations_and_outputs_only(
        kind, monkeypatch):
    """`int4pack-bf16`: the 4-bit values stay exact, and each of scale, zero, activation
    and output rounds to bf16 (relative 2^-9): the product is within that of the fp32
    de-quantised one, element by element and (~3 significant digits) over the whole —
    a wrong scale or zero mapping (zero off by 8·scale, a 1 % scale) is far outside."""
    use_int4_kernel(monkeypatch, "int4pack-bf16")
    b = _blocks(kind)
    lin = Int4Linear.from_blocks(b, None)
    assert lin.scales_and_zeros.dtype == torch.bfloat16
    held = sum(t.numel() * t.element_size() for t in lin.buffers())
    assert held == held_nbytes((N, K), "int4", True, kind)  # bf16 scales and zeros
    torch.manual_seed(0)
    x = torch.randn(5, K)
    got = lin(x)
    assert got.dtype == torch.float32
    exact = x.double() @ _reference(b).double().t()
    q, scale, zero = int4_groups(b.raw, kind, b.shape)
    terms = ((q.float() - 8).abs().reshape(N, -1, 32) * scale.abs()[..., None]
             + zero.abs()[..., None]).reshape(N, K).double()  # |(q−8)·scale| + |zero|
    # x, scale and zero each rounded (2^-9), then the output (2^-9 of |y|): ≤ 2^-8 of these
    bound = 2.0 ** -8 * (x.abs().double() @ terms.t() + exact.abs())
    assert bool(((got.double() - exact).abs() <= bound).all())
    rel = float((got.double() - exact).norm() / exact.norm())
    assert 1e-4 < rel < 2.0 ** -7  # rounded (the bf16 path), but only that


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_the_vnni_kernel_keeps_the_blocks_own_scales_and_is_faithful(kind, monkeypatch):
    """`int4-vnni`: the blocks' nibbles and their own scales (fp16 d, m for Q4_0/Q4_1 —
    the file's bytes; fp32 d·sc, −dmin·m for Q4_K), activations as two int8 digits: a
    product within ~1e-4 of the fp32 de-quantised one (the bf16 path: ~3e-3), every row's
    result the same whatever the rows beside it, and the bias added."""
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    b = _blocks(kind)
    bias = torch.randn(N)
    lin = Int4Linear.from_blocks(b, bias)
    assert lin.vnni and lin.weight_int4.shape == (N // 16, K // 32, 256)
    if kind != "Q4_K":
        blocks = b.raw.reshape(N, K // 32, -1)
        d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
        assert torch.equal(lin.scales_and_zeros, d.reshape(N // 16, 16, -1).transpose(1, 2))
        assert (lin.offsets is None) == (kind == "Q4_0")
        # as many bytes as the file's blocks: 18 (Q4_0) or 20 (Q4_1) per 32 weights
        assert sum(t.numel() * t.element_size() for t in lin.buffers()) == b.raw.numel()
    held = sum(t.numel() * t.element_size() for t in lin.buffers())
    assert held == held_nbytes((N, K), "int4", True, kind)
    torch.manual_seed(0)
    x = torch.randn(46, K) * torch.logspace(-2, 1, K)  # groups of very different sizes
    got = lin(x)
    exact = x.double() @ _reference(b).double().t() + bias.double()
    rel = float((got.double() - exact).norm() / exact.norm())
    assert rel < 1e-4
    bound = 2e-4 * (x.abs().double() @ _reference(b).abs().double().t()) + 1e-5
    assert bool(((got.double() - exact).abs() <= bound).all())
    for m in range(1, 18):  # alone, and every count of rows one pass of a tile takes
        assert torch.equal(lin(x[3:3 + m]), got[3:3 + m]), m
    assert lin(x[:0]).shape == (0, N)


def test_vnni_siblings_join_into_one_matrix_with_the_same_outputs(monkeypatch):
    """Q4_0 and Q4_1 matrices (scales of one dtype, offsets or none) join only with their
    own kind; the joined product is each member's, bit for bit."""
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    parts = [Int4Linear.from_blocks(_blocks(k), None) for k in ("Q4_1", "Q4_1")]
    assert Int4Linear.joinable(parts)
    assert not Int4Linear.joinable([parts[0], Int4Linear.from_blocks(_blocks("Q4_0"), None)])
    assert not Int4Linear.joinable([parts[0], Int4Linear.from_blocks(_blocks("Q4_K"), None)])
    x = torch.randn(3, K)
    alone = [p(x) for p in parts]
    joined = Int4Linear.joined(parts, None)
    assert joined.out_features == 2 * N
    assert torch.equal(joined(x), torch.cat(alone, dim=-1))


def test_the_vnni_kernel_refuses_malformed_operands_with_a_clear_error(monkeypatch):
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    lin = Int4Linear.from_blocks(_blocks("Q4_0"), None)
    w, s = lin.weight_int4, lin.scales_and_zeros
    bad = [((torch.randn(2, K).half(), w, s, None), "x must be contiguous fp32"),
           ((torch.randn(2, K + 32), w, s, None), f"x has {K + 32} inputs"),
           ((torch.randn(2, K), w.float(), s, None), "w must be contiguous uint8"),
           ((torch.randn(2, K), w, s.float().double(), None), "s must be"),
           ((torch.randn(2, K), w, s, s.float()), "o must be as s")]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            q4vnni.mm(*args)


def test_q8_0_blocks_held_as_they_are_compute_within_the_digits_rounding(monkeypatch):
    """`Q8Linear`: the file's int8 values and fp16 scales (its bytes, no more), rows for
    embeddings exactly the de-quantised ones, products ~2e-5 of fp32 and each row's the
    same beside any others; blocks it cannot hold are refused before any work."""
    use_int4_kernel(monkeypatch, q4vnni.KERNEL)
    rng = np.random.default_rng(3)
    raw = quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05,
                   GGMLQuantizationType.Q8_0)
    b = GgmlBlocks(torch.from_numpy(raw), "Q8_0", (N, K))
    assert quant.Q8Linear.takes(b)
    lin = quant.Q8Linear(b, bias=torch.ones(N))
    assert sum(t.numel() * t.element_size() for t in lin.buffers()) == raw.size
    assert held_nbytes((N, K), "int4", True, "Q8_0") == raw.size
    ref = _reference(b)
    assert torch.equal(lin.dequantised(), ref)
    ids = torch.tensor([[5, 0], [N - 1, 17]])
    assert torch.equal(lin.rows(ids), ref[ids])
    x = torch.randn(9, K)
    got = lin(x)
    exact = x.double() @ ref.double().t() + 1
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-4
    assert torch.equal(lin(x[4:5]), got[4:5])
    with pytest.raises(ValueError, match="not Q8_0"):
        quant.Q8Linear(_blocks("Q4_0"))
    # rows that are not whole tiles of 16 (a vocabulary of 49,155): padded, never returned
    odd = GgmlBlocks(torch.from_numpy(raw[:N - 8]), "Q8_0", (N - 8, K))
    assert quant.Q8Linear.takes(odd)
    short = quant.Q8Linear(odd)
    assert torch.equal(short(x), quant.Q8Linear(b)(x)[:, :N - 8])
    assert torch.equal(short.rows(torch.tensor([N - 9])), ref[N - 9:N - 8])
    assert sum(t.numel() * t.element_size() for t in short.buffers()) == raw.size \
        == held_nbytes((N - 8, K), "int4", True, "Q8_0")
    use_int4_kernel(monkeypatch, "int4pack-bf16")  # not this process's kernel: int8 rows
    assert not quant.Q8Linear.takes(b)
    as_int8 = quant.Int8Linear(b.dequantise(), None)  # what the store's loader makes of them
    assert held_nbytes((N, K), "int4", True, "Q8_0") == quant.held_bytes(as_int8) \
        == held_nbytes((N, K), "int8", True)


def test_the_vnni_kernel_needs_avx512_vnni_and_says_what_is_missing(monkeypatch):
    zen1 = "processor : 0\nflags : fpu sse avx avx2 fma f16c\n"
    assert q4vnni.missing_cpu_flags(zen1) == ["avx512f", "avx512bw", "avx512vl", "avx512dq",
                                              "avx512_vnni"]
    zen4 = "flags : avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
    assert q4vnni.missing_cpu_flags(zen4) == []
    # asked for by name where it is not available: a config error naming why
    monkeypatch.setattr(q4vnni, "_state", {"reason": "int4-vnni unavailable: the CPU lacks "
                                                     "avx512_vnni"})
    with pytest.raises(ConfigError, match="the CPU lacks avx512_vnni"):
        quant.int4_kernel(q4vnni.KERNEL)
    assert quant.faster_int4(quant._int4_probe_ms()) != q4vnni.KERNEL  # never probed


def test_gguf_block_tensors_are_hashed_with_their_type():
    """Q4_0 and Q4_K rows of the same byte length must not hash alike."""
    assert hash_dtype("U8", "Q4_0") != hash_dtype("U8", "Q4_K")
    assert hash_dtype("BF16", None) == "BF16"  # tensors of values: as before


def test_kept_blocks_split_over_files_resume_and_hash_as_stored(tmp_path):
    """Block tensors (uint8 rows + GGML type and logical shape in `__metadata__`) written
    over several files: an interrupted write resumes after its last whole file, and the
    writer's `weights_sha256` is the one `hashing` computes from the files."""
    from hearthnet.distributed_inference.engine.weights import WeightsReader
    from hearthnet.models.hashing import weights_sha256
    from hearthnet.models.writer import SafetensorsWriter, TensorPlan

    names = [f"model.layers.0.{n}.weight" for n in ("a", "b", "c")]
    tensors = dict(zip(names, (_blocks(k) for k in ("Q4_0", "Q4_1", "Q4_K")), strict=True))
    plan = [TensorPlan(k, torch.uint8, tuple(b.raw.shape), b.ggml_type, b.shape)
            for k, b in tensors.items()]
    plan.append(TensorPlan("model.norm.weight", torch.float32, (N,)))
    norm = torch.randn(N)

    def write(w: SafetensorsWriter, stop: str | None = None) -> set[str]:
        done = w.resume()
        for p in plan:
            if p.name == stop:
                break
            if p.name not in done:
                w.write(p.name, tensors[p.name].raw if p.ggml_type else norm)
        return done

    first = SafetensorsWriter(tmp_path, plan, max_file_bytes=20_000)
    assert len(first.files) == 3  # a | b | c and the norm
    write(first, stop=names[2])  # interrupted: a and b are in whole files
    again = SafetensorsWriter(tmp_path, plan, max_file_bytes=20_000)
    assert write(again) == set(names[:2])
    result = again.close()
    assert result.weights_sha256 == weights_sha256(tmp_path)
    reader = WeightsReader(tmp_path)
    assert reader.ggml[names[2]] == ("Q4_K", (N, K))
    assert torch.equal(reader.read(names[1:2])[names[1]], _reference(tensors[names[1]]))
