"""Weight formats: how a shard or a head holds its weights (DESIGN.md decision 10).

A format is chosen per shard (`[[shards]] weights`, or the host's default) and per head:

- `fp32`, `bf16`, `fp16`: every tensor held in that dtype, and the layers compute in it.
- `native`: the stored dtype of the model (a bf16 import is held in bf16); resolved to
  one of the three above when the weights are loaded, so advertisements name a real one.
- `int8`: int8 weights. Every `nn.Linear` weight is quantised at load time from the
  stored weights, symmetric per output channel (scale = max |w| / 127, bf16); everything
  else (norms, attention, residuals) stays fp32. The product runs in an integer GEMM with
  int32 accumulation: each activation row is written as two integer digits against its
  own largest value, `x ≈ s·(hi + lo/(2·top))` (`split_rows`), both digits go through
  the GEMM as one batch (the weights are read once) and are recombined in fp32. Integer
  accumulation is exact, so a row's result does not depend on the batch it runs in.
  `INT8_KERNEL`, chosen on first use, is the first of these that torch has
  here, computes a full-range product exactly and is not pathologically slow (a probe):
  - `onednn`: `torch.ops.onednn.qlinear_pointwise` (VNNI/AMX), 8-bit digits (~15 bits);
  - `fbgemm`: `quantized.linear_with_input_q_dq_qweight_dq_output_fp32` (AVX2, where
    oneDNN's int8 path is wrong and ~10× slower), 7-bit digits (~13 bits): its kernel
    sums pairs of products in 16 bits, which 8-bit digits would overflow;
  - else `int8pack`: torch's `_weight_int8pack_mm` with bf16 activations (ARM builds).
  Where HearthNet's own VNNI kernel (`int4-vnni`, below) runs, its 8-bit path is probed
  beside that choice and taken if it is faster (`int8-vnni`): the same int8 values and
  scales (one per row for every group of 32), against two int8 digits of each group of 32
  activations (~2e-5 of a product, against ~1e-4 for fbgemm's 7-bit digits of a whole row),
  the digits made inside the kernel. On a 2-core Zen 4 (one thread, the 1.5B's fused
  gate/up): one row 0.90 ms against fbgemm's 1.04, eight rows 2.76 against 3.85.
  `HEARTHNET_INT8_KERNEL` overrides the choice: `auto` (the default) or a kernel's name.
- `int4`: weight-only int4. Where int4 runs in HearthNet's own `int4-vnni` kernel (below),
  quantised at load as llama.cpp's Q4_1: asymmetric in groups of 32 along the input
  dimension, each with an fp16 scale and minimum. Elsewhere asymmetric in groups of 64 (32
  where 64 does not divide; gpt-fast's layout) with bf16 scales and zeros, in torch's
  `_weight_int4pack_mm_for_cpu` with bf16 activations (`int4pack-bf16`). Not in a call's
  default accepted set (docs/operations.md "Weight formats").
  From a store that kept a GGUF's blocks (DESIGN.md decision 15) the Q4_0/Q4_1/Q4_K
  blocks are held as they are — int4 groups of 32 with the blocks' own scales and zeros,
  no second quantisation (`blocks.int4_groups`) — and their products run in one of the
  kernel's two paths or in HearthNet's own, `INT4_KERNEL`, chosen on first use:
  - `int4pack-fp32`: fp32 scales, zeros, activations and outputs; exact — a product
    equals the fp32 de-quantised weights' to fp32 rounding — but torch's non-vectorised
    path (a 8960 × 1536 matrix and one row on an AVX-512 CPU: 13.7 ms, against 0.97 ms
    for the dense fp32 matmul);
  - `int4pack-bf16`: the blocks' 4-bit values still exact, but the group scales and
    zeros, the activations and the outputs rounded to bf16 (8 bits of mantissa, ~3
    significant digits); vectorised (the same matrix: 0.41 ms). Held from the bundled
    SmolLM2 GGUF's blocks, with an fp32 head, it agrees with the fp32 de-quantised model
    on 99.69 % of teacher-forced next tokens (measured by `hearthnet bench quality
    --gguf`).
  - `int4-vnni` (`q4vnni`, AVX-512 VNNI CPUs where a C++ compiler builds it): the blocks'
    nibbles with their own fp16 (Q4_0, Q4_1) or fp32 (Q4_K) scales, in integer dot
    products against two int8 digits of each activation; a product is within ~2e-5 of
    the fp32 one, and it is the fastest of the three on a 2-core Zen 4 (one row of a
    1024 × 1024 matrix, one thread: 0.020 ms, against 0.057 bf16 and 1.76 fp32; ~2× bf16's
    speed on 46 rows). Held in the file's own bytes for Q4_0 and Q4_1.
  A probe times them on one (1024 × 1024) matrix and one activation row
  (`_int4_probe_ms`); the faster of the faithful paths (exact fp32, `int4-vnni`) is kept
  unless the bf16 one is at least `INT4_MIN_SPEEDUP` times faster — where torch's build
  has no vectorised bf16 path for this CPU it is not — so noise never flips the choice.
  `HEARTHNET_INT4_KERNEL` overrides it: `auto` (the default), `exact` or `int4pack-fp32`,
  `int4pack-bf16`, `int4-vnni`. `INT4_BLOCKS_DTYPE` is the chosen path's dtype.
  Products of many rows (a prefill) can run instead in torch's fp32 GEMM on the weights
  de-quantised a tile at a time (`dense_product`: the kernel works through its rows four
  at a time, so its cost grows with every row, while a GEMM reuses each de-quantised
  tile for all of them; exact but for fp32 rounding), from `INT4_DENSE_ROWS` rows on.
  Off unless `HEARTHNET_INT4_DENSE_ROWS` asks for it (`off`, the default; `auto`; or a
  row count): on one thread it took 0.63-0.83× the kernel's time at 128-256 rows on the
  2-core AVX-512 VM, but on two threads beside other work its many parallel regions
  (two per tile) made a 4-layer 1.5B prefill 2-5× slower. `auto`: a probe in a
  background thread, started by the first such product, chooses the row count
  (`dense_rows_from`; never fewer than `DENSE_FLOOR`, so decode steps and speculative
  passes stay in the kernel the compiled steps use) where the de-quantisation compiles
  and torch packs int4 in the layout it reads; else, and until then, the kernel runs
  every product.
  A linear of Q8_0 blocks is held as they are (`Q8Linear`) where `int4-vnni` runs: the
  same kernel with 8-bit values. Other blocks (Q5_K, Q6_K …, and Q8_0 elsewhere) are
  de-quantised exactly to fp32 and held as int8 per output channel (no torch CPU kernel
  takes int8 with per-group scales); the quality benchmark reports that loss.

Loading is per tensor: a tensor is read from safetensors, converted to the held format and
assigned, then the next one is read, so the stored model never sits in memory whole (a
device move goes between the conversion and the assignment: `_place`).

Format names and the routing policy live in `distributed_inference/directory/formats.py`.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from typing import Any, TypeGuard

import torch
from torch import nn

from hearthnet.distributed_inference.directory.formats import STORED
from hearthnet.distributed_inference.engine import q4vnni
from hearthnet.distributed_inference.engine.blocks import (
    GROUP,
    GgmlBlocks,
    int4_affine,
    int4_groups,
    q8_groups,
)
from hearthnet.dtypes import FLOAT_DTYPES
from hearthnet.errors import BadRequest, ConfigError, WeightsMismatch
from hearthnet.models.hashing import Q4_TYPES  # held exactly as int4 groups of 32
from hearthnet.observability import get_logger

log = get_logger("quant")

INT4_GROUPS = (64, 32)  # the largest that divides a matrix's input size: finer groups
# than gpt-fast's default 128 round less (llama.cpp's Q4 blocks are 32) for ~6 % more bytes
BLOCK_FORMATS = ("int4",)  # formats that take GGUF blocks as they are (`load_module`)
_FLOAT = FLOAT_DTYPES  # the float formats are named as the wire dtypes
_CHUNK_ELEMENTS = 1 << 22  # quantise ≤ 4 Mi elements at a time: the fp32 temporaries of
# one chunk stay ~16 MB each, whatever the tensor's shape (a 7B down_proj, 3584 × 18944,
# in one chunk took 770 MB of transient memory — more than a shard's whole headroom)


def format_name(name: str | torch.dtype) -> str:
    """A format name from a format, a dtype name ("float32") or a torch dtype."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    return STORED.get(name, name)


def compute_dtype_of(fmt: str) -> torch.dtype:
    """The dtype a layer computes in when its weights are held as `fmt`."""
    return _FLOAT.get(fmt, torch.float32)


def _rows(w: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, w.shape[1]))
    for r in range(0, w.shape[0], rows):
        yield r, w[r:r + rows].float()


def _exact(kernel: str) -> bool:
    """Whether torch has `kernel`'s integer GEMM here and it computes full-range products
    of the kernel's digits exactly. On CPUs without VNNI/AMX (AVX2 only: AMD Zen 1
    measured) torch's oneDNN path gets them wrong — 64 × 127 · 127 came out as 8,160 —
    besides being ~10-100× slower, and fbgemm's AVX2 kernel sums pairs of products in 16
    bits (8-bit digits saturate), so a product whose pairs overflow 16 bits is checked."""
    try:
        w, x = _check_operands(_DIGITS[kernel])
        _, product = _packed_product(kernel, w, torch.ones(len(w)))
        return bool(torch.equal(product(x), x @ w.float().t()))  # |sums| < 2^24: exact
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _check_operands(top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights (32, 256) and float digit rows (3, 256) in [-top, top], the first
    pair at full range (each pair's sum 2 · 127 · top: past int16 for 8-bit digits)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
    x = torch.randint(-top, top + 1, (3, 256), generator=g).float()
    w[0], x[0], x[1] = 127, top, -top
    return w, x


def _qlinear(xq: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor) -> torch.Tensor:
    """fp32 `xq @ w.T * scales` of int8 rows `xq` and a oneDNN-packed int8 `w`."""
    y: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, 0, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    return y


FBGEMM_TOP = 63  # fbgemm's digits: 7 bits, |d| ≤ 63, fed as u8 d + 64 (no 16-bit overflow)
_DIGITS = {"onednn": 127, "fbgemm": FBGEMM_TOP}  # each integer kernel's digit range


def _packed_product(kernel: str, w: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    """int8 `w` (n, k) with per-row `scales` packed for `kernel` (``onednn`` or
    ``fbgemm``): the packed weights (a tensor; fbgemm: a torch script object) and the
    product, fp32 `digits @ w.T * scales` of float rows of integer digits in the kernel's
    range (`_DIGITS`; exact: int32 accumulation)."""
    if kernel == "onednn":
        packed = torch.ops.onednn.qlinear_prepack(w, [1, w.shape[1]])
        s32, zeros = scales.float(), torch.zeros(len(w), dtype=torch.long)
        return packed, lambda digits: _qlinear(digits.to(torch.int8), packed, s32, zeros)
    packed = _fbgemm_prepack(w, scales.float())  # fbgemm applies the scales itself
    return packed, lambda digits: _fbgemm(digits, packed)


def _fbgemm_prepack(w: torch.Tensor, scales: torch.Tensor) -> Any:
    """int8 `w` (n, k) with per-row `scales`, packed for fbgemm (a torch script object)."""
    n = w.shape[0]
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors as deprecated
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            w, scales.double(), torch.zeros(n, dtype=torch.long), 0)
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"  # the engine of the packed object
        try:
            return torch.ops.quantized.linear_prepack(qw, None)
        finally:
            torch.backends.quantized.engine = engine


def _fbgemm(digits: torch.Tensor, packed: Any) -> torch.Tensor:
    """fp32 `digits @ w.T * scales` of float rows of integers in [-63, 63] (exact: int32
    accumulation) and an fbgemm-packed `w`."""
    y: torch.Tensor = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        digits, 1.0, FBGEMM_TOP + 1, packed)
    return y


def best_ms(f: Callable[[], object], runs: int = 20) -> float:
    f()
    best = math.inf
    for _ in range(runs):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def fast_enough(two_rows_ms: float, int8pack_ms: float) -> bool:
    """Whether an integer GEMM taking `two_rows_ms` for a two-row batch (the two digits) is
    worth using against `_weight_int8pack_mm` taking `int8pack_ms` for one row. oneDNN with
    VNNI/AMX takes about half; where torch's build falls back to a reference path (AVX2
    only, or ISA limits) it is ~10-100× slower, so a generous factor tells the two apart on
    a noisy machine."""
    return two_rows_ms <= INT8_MAX_RATIO * int8pack_ms


INT8_MAX_RATIO = 2.0
_PROBE = (1024, 1024)  # out × in of the probe matrix: ~1 MB, a few ms on a slow path


def _probe_ms(kernels: Iterable[str]) -> dict[str, float]:
    """ms of a (1024 × 1024) product in each of `kernels` (two digit rows; int8pack: one
    bf16 row), best of 20 (processes that start together — a mesh on one machine — must
    not choose differently because one was preempted), on one thread."""
    n, k = _PROBE
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scales = torch.ones(n)
    digits = torch.randint(-FBGEMM_TOP, FBGEMM_TOP + 1, (2, k)).float()
    run: dict[str, Callable[[], object]] = {}
    for kernel in kernels:
        if kernel in _DIGITS:
            run[kernel] = partial(_packed_product(kernel, w, scales)[1], digits)
        else:
            run[kernel] = partial(torch._weight_int8pack_mm, torch.randn(
                1, k, dtype=torch.bfloat16), w, scales.bfloat16())
    with _one_thread():
        return {kernel: best_ms(f) for kernel, f in run.items()}


@contextmanager
def _one_thread() -> Iterator[None]:
    """Probe on one thread: on a busy machine a parallel region waits for a time slice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _named_kernel(env: str, choice: str | None, names: tuple[str, ...], fmt: str) -> str:
    """`choice`, else the environment's `env`, normalised (empty: ``auto``); `ConfigError`
    unless it is one of `names`."""
    value = os.environ.get(env, "") if choice is None else choice
    value = value.strip().lower() or "auto"
    if value not in names:
        raise ConfigError(f"{env}={value!r} is not an {fmt} kernel; use one of "
                          f"{', '.join(names)}", key=env, reason=f"unknown {fmt} kernel")
    return value


def kernel_settings() -> None:
    """`ConfigError` for a `HEARTHNET_INT8_KERNEL` or `HEARTHNET_INT4_KERNEL` naming no
    kernel, or a `HEARTHNET_AMX` that is none of its settings: one line before a node
    starts (whether a named kernel runs here is known when the first weights of its format
    load)."""
    _named_kernel(INT8_KERNEL_ENV, None, ("auto", *INT8_KERNELS), "int8")
    _named_kernel(INT4_KERNEL_ENV, None, tuple(_INT4_CHOICES), "int4")
    q4vnni.amx_setting()


@cache
def _integer_gemm() -> str:
    """The first of ``onednn``, ``fbgemm`` that torch has here, computes exactly and runs
    fast on this CPU; else ``int8pack``."""
    exact = [k for k in _DIGITS if _exact(k)]  # in order of preference
    if not exact:
        return "int8pack"
    ms = _probe_ms([*exact, "int8pack"])
    return next((k for k in exact if fast_enough(ms[k], ms["int8pack"])), "int8pack")


INT8_KERNEL_ENV = "HEARTHNET_INT8_KERNEL"
INT8_KERNELS = ("onednn", "fbgemm", "int8pack", q4vnni.INT8_KERNEL)
INT8_PROBE_ROWS = (1, 8)  # a decode step and a batched round of 8 chats (M26 §5.3)
INT8_VNNI_MAX_RATIO = 1.25  # `int8-vnni` is kept unless the integer GEMM is clearly faster:
# its products are the more faithful (digits per group of 32), and processes of one machine
# probing a near tie must not choose differently (measured on Zen 4: 0.16 against fbgemm's 0.24)


def _vnni_probe_ms(other: str) -> dict[str, float]:
    """ms of a (1024 × 1024) int8 product of one and of eight activation rows, summed, in
    `int8-vnni` and in `other`, best of 20 each, on one thread (as `_probe_ms`)."""
    n, k = _PROBE
    g = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, generator=g) * 1e-2 + 1e-3
    vnni = Int8Linear(w, None, scales=scales, kernel=q4vnni.INT8_KERNEL)
    base = Int8Linear(w, None, scales=scales, kernel=other)
    xs = [torch.randn(m, k, generator=g) for m in INT8_PROBE_ROWS]
    with _one_thread(), torch.inference_mode():
        return {name: sum(best_ms(partial(lin, x)) for x in xs)
                for name, lin in ((q4vnni.INT8_KERNEL, vnni), (other, base))}


def _int8_kernel(choice: str | None = None,
                 probe: Callable[[str], dict[str, float]] = _vnni_probe_ms) -> str:
    """What int8 products run in (`INT8_KERNELS`): `choice` (default: the environment's
    `HEARTHNET_INT8_KERNEL`, else ``auto``) names one, or ``auto`` takes `_integer_gemm`'s
    choice unless `int8-vnni` is available and `probe` finds it about as fast or faster
    (`INT8_VNNI_MAX_RATIO`); `ConfigError` for another value or a kernel this process
    does not have."""
    value = _named_kernel(INT8_KERNEL_ENV, choice, ("auto", *INT8_KERNELS), "int8")
    if value == q4vnni.INT8_KERNEL and not q4vnni.available():
        raise ConfigError(f"{INT8_KERNEL_ENV}={value!r}: {q4vnni.unavailable_reason()}",
                          key=INT8_KERNEL_ENV, reason="int8 kernel unavailable")
    if value in _DIGITS and not _exact(value):
        raise ConfigError(f"{INT8_KERNEL_ENV}={value!r}: torch has no exact {value} "
                          "integer GEMM here", key=INT8_KERNEL_ENV,
                          reason="int8 kernel unavailable")
    if value != "auto":
        return value
    base = _integer_gemm()
    if not q4vnni.available():
        return base
    ms = probe(base)
    faster = ms[q4vnni.INT8_KERNEL] <= INT8_VNNI_MAX_RATIO * ms[base]
    return q4vnni.INT8_KERNEL if faster else base



INT4_KERNELS = {"int4pack-fp32": torch.float32, "int4pack-bf16": torch.bfloat16,
                q4vnni.KERNEL: torch.float32}
"""The paths int4 held from Q4 blocks can run in: the two of `_weight_int4pack_mm_for_cpu`
and `q4vnni`'s; the dtype of their activations and outputs (module docstring)."""
INT4_EXACT = "int4pack-fp32"
INT4_MIN_SPEEDUP = 2.0  # the bf16 path must be this much faster to be chosen: measured
# ~30-35× with AVX-512, far from 1 either way, so a noisy probe does not flip the choice
INT4_KERNEL_ENV = "HEARTHNET_INT4_KERNEL"
_INT4_CHOICES = {"auto": "", "exact": INT4_EXACT, **{k: k for k in INT4_KERNELS}}


def _int4_probe_ms() -> dict[str, float]:
    """ms of a (1024 × 1024) int4 product of one activation row in each of `INT4_KERNELS`
    this process has (`q4vnni.available`), best of 10, on one thread (as `_probe_ms`)."""
    n, k = _PROBE
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.rand(k // GROUP, n, 2, generator=g) * 1e-2
    x = torch.randn(1, k, generator=g)
    run: dict[str, Callable[[], object]] = {
        name: partial(torch._weight_int4pack_mm_for_cpu, x.to(dtype), packed, GROUP,
                      sz.to(dtype))
        for name, dtype in INT4_KERNELS.items() if name != q4vnni.KERNEL}
    if q4vnni.available():
        w, s, _ = q4vnni.pack(q, sz[..., 0].t().half(), None)
        run[q4vnni.KERNEL] = partial(q4vnni.mm, x, w, s, None)
    with _one_thread():
        return {name: best_ms(f, runs=10) for name, f in run.items()}


def faster_int4(ms: dict[str, float]) -> str:
    """The int4 path to use given probe times `ms`: the faster of the faithful ones (the
    exact fp32 path; `int4-vnni`, ~2e-5 of a product, where probed), unless the bf16 path
    is at least `INT4_MIN_SPEEDUP` times faster than that."""
    faithful = min((k for k in (q4vnni.KERNEL, INT4_EXACT) if k in ms), key=ms.__getitem__)
    fast = ms["int4pack-bf16"] * INT4_MIN_SPEEDUP <= ms[faithful]
    return "int4pack-bf16" if fast else faithful


def int4_kernel(choice: str | None = None,
                probe: Callable[[], dict[str, float]] = _int4_probe_ms) -> str:
    """The path int4 products from Q4 blocks run in (`INT4_KERNELS`): `choice` (default:
    the environment's `HEARTHNET_INT4_KERNEL`, else ``auto``) names one, or ``auto``
    chooses by `probe` (`faster_int4`); `ConfigError` for any other value."""
    value = _named_kernel(INT4_KERNEL_ENV, choice, tuple(_INT4_CHOICES), "int4")
    if value == q4vnni.KERNEL and not q4vnni.available():
        raise ConfigError(f"{INT4_KERNEL_ENV}={value!r}: {q4vnni.unavailable_reason()}",
                          key=INT4_KERNEL_ENV, reason="int4 kernel unavailable")
    if value != "auto":
        return _INT4_CHOICES[value]
    try:
        return faster_int4(probe())
    except (RuntimeError, NotImplementedError):  # a build without the bf16 path
        return INT4_EXACT


# The kernel choices are probed on first use, not at import: a probe costs about two
# seconds of CPU, which every node start, CLI call and test process would otherwise pay
# (most never hold int8 or int4). Read them as module attributes (`quant.INT8_KERNEL`,
# `INT4_KERNEL`: the path of int4 products from Q4 blocks, `INT4_BLOCKS_DTYPE`: its scales,
# zeros and activations); a value set on the module (tests) is the one used.
_CHOOSE: dict[str, Callable[[], Any]] = {
    "INT8_KERNEL": _int8_kernel,
    "INT4_KERNEL": int4_kernel,
    "INT4_BLOCKS_DTYPE": lambda: INT4_KERNELS[int4_kernel_name()],
}
_choosing = threading.RLock()  # a choice may read another (the dtype: the kernel)


def _chosen(name: str) -> Any:
    g = globals()
    if name not in g:
        with _choosing:
            if name not in g:
                g[name] = _CHOOSE[name]()
    return g[name]


def __getattr__(name: str) -> Any:
    if name in _CHOOSE:
        return _chosen(name)
    if name == "INT4_DENSE_ROWS":
        return int4_dense_rows()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def int8_kernel_name() -> str:
    """`INT8_KERNEL`: what int8 products run in, in this process."""
    return str(_chosen("INT8_KERNEL"))


def int4_kernel_name() -> str:
    """`INT4_KERNEL`: the path int4 products from Q4 blocks run in, in this process."""
    return str(_chosen("INT4_KERNEL"))


def int4_blocks_dtype() -> torch.dtype:
    """`INT4_BLOCKS_DTYPE`: the dtype of that path's scales, zeros and activations."""
    dtype: torch.dtype = _chosen("INT4_BLOCKS_DTYPE")
    return dtype


def kernel_of(fmt: str, blocks: bool = False) -> str:
    """The kernel `fmt`'s products run in, in this process (`formats.KERNELS`; "" for a
    float format). `blocks`: the weights are a GGUF's kept blocks, whose Q4 linears run
    in `INT4_KERNEL`'s path; int4 quantised at load runs in `int4-vnni` where that is
    `INT4_KERNEL`, else in bf16."""
    if fmt == "int4":
        return int4_kernel_name() if blocks or vnni_chosen() else "int4pack-bf16"
    return int8_kernel_name() if fmt == "int8" else ""


# ---------------------------------------------------------------------------------------
# int4 products of many rows (a prefill): the weights de-quantised a tile at a time into
# torch's fp32 GEMM (M26 §5.7)

DENSE_BLOCK = 64
"""Rows per block of torch's AVX-512 int4 pack (`_convert_weight_to_int4pack_for_cpu`,
aten/src/ATen/native/cpu/int4mm_kernel.cpp): (n / 64, k, 32) bytes, byte j of input k of
a block holding row j in its low nibble and row 32 + j in its high one. Other builds pack
otherwise (AVX2: blocks of 32): `dense_layout_ok` checks the layout before the path is used."""
DENSE_FLOOR = 34  # the fewest rows the dense path takes: a speculative pass (≤ 33 rows,
# `compiled.verify_step`) and every decode step run in the kernel the compiled steps use
DENSE_PROBE_ROWS = (64, 128, 256)  # 256: the orchestrator's prefill chunk
DENSE_MIN_SPEEDUP = 1.2  # the dense path must be this much faster at a row count (and at
# every larger one probed) to be used from there: on the 2-core AVX-512 VM, one thread,
# the 1.5B's products (compiled de-quantisation) measured 0.63-0.78× the kernel's time at
# 256 rows, 0.72-0.83× at 128 and 1.2-1.5× at 46, so the choice sits between them
INT4_DENSE_ENV = "HEARTHNET_INT4_DENSE_ROWS"
_DENSE_PROBE = (2048, 2048)  # out × in of the probe matrix (2 MiB of int4)
_TILE_BYTES = 3 << 19  # fp32 weights de-quantised per GEMM: 1.5 MiB stays in a core's L2
# cache while its product runs (the whole matrix — 55 MB for 8960 × 1536 — goes to memory
# and back)


def _dequantised_tile(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """W[rows].T, fp32 (k, 64 t), of t blocks of packed rows: `p` (t, k / g, g, 32) bytes,
    `s` and `z` (t, k / g, 1, 64) fp32 — each group's scale and its zero less 8 scales, so
    that a weight (q − 8)·scale + zero is q·s + z (q·s exact in fp32 for bf16 scales; one
    rounding of the sum)."""
    lo = (p & 15).float() * s[..., :32] + z[..., :32]  # rows 0..31 of each block
    hi = (p >> 4).float() * s[..., 32:] + z[..., 32:]  # rows 32..63
    t = p.shape[0]
    return torch.cat((lo, hi), dim=-1).reshape(t, -1, DENSE_BLOCK).permute(1, 0, 2) \
        .reshape(-1, DENSE_BLOCK * t)


def dense_product(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int,
                  dequantise: Callable[..., torch.Tensor] = _dequantised_tile
                  ) -> torch.Tensor:
    """fp32 ``x @ W.T`` (m, n) of fp32 rows `x` (m, k) and the int4 weights `packed`
    (n, k / 2; torch's AVX-512 layout, n a multiple of `DENSE_BLOCK`) with `sz` (k / g, n,
    2) (scale, zero): the weights are de-quantised to fp32 a tile of row blocks at a time
    (`dequantise`, `_dequantised_tile` or its compiled form) and each tile's product runs in
    torch's fp32 GEMM — exact but for fp32 rounding, where the kernel rounds activations
    and outputs to bf16."""
    n, k = packed.shape[0], packed.shape[1] * 2
    nb, kg = n // DENSE_BLOCK, k // group
    sz = sz.float()
    s = sz[..., 0].reshape(kg, nb, 1, DENSE_BLOCK).permute(1, 0, 2, 3).contiguous()
    z = (sz[..., 1] - 8 * sz[..., 0]).reshape(kg, nb, 1, DENSE_BLOCK).permute(1, 0, 2, 3) \
        .contiguous()  # (n / 64, k / g, 1, 64)
    p = packed.view(nb, kg, group, DENSE_BLOCK // 2)
    t = max(1, _TILE_BYTES // (k * DENSE_BLOCK * 4))
    return torch.cat([x @ dequantise(p[b:b + t], s[b:b + t], z[b:b + t])
                      for b in range(0, nb, t)], dim=1)


def dense_layout_ok() -> bool:
    """Whether torch packs int4 here in the layout `dense_product` reads: the identity's
    product with weights of scale 1 and zero 8 gives them back."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (2 * DENSE_BLOCK, 2 * GROUP), dtype=torch.int32, generator=g)
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, NotImplementedError):
        return False
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (len(q), q.shape[1] // 2):
        return False
    sz = torch.ones(q.shape[1] // GROUP, len(q), 2)
    sz[..., 1] = 8
    return bool(torch.equal(dense_product(torch.eye(q.shape[1]), packed, sz, GROUP),
                            q.t().float()))


def _compiles() -> bool:
    """Whether this process compiles (``HEARTHNET_COMPILE``, a C++ compiler): the dense
    path needs `_dequantised_tile` compiled (inductor's vectorised C++, ~3× the eager ops'
    speed; eagerly, de-quantising costs more than the kernel saves below ~250 rows)."""
    from hearthnet.config import compile_decode_enabled

    return compile_decode_enabled() and bool(
        shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"))


def _compiled_dequantiser() -> Callable[..., torch.Tensor]:
    fn: Callable[..., torch.Tensor] = torch.compile(_dequantised_tile, dynamic=True,
                                                    fullgraph=True)
    return fn


def _dense_probe_ms(dequantise: Callable[..., torch.Tensor]
                    ) -> dict[int, tuple[float, float]]:
    """{rows: (kernel ms, dense ms)} of one (2048 × 2048) product at each of
    `DENSE_PROBE_ROWS`, best of 3, in the int4 kernel path chosen for blocks and in
    `dense_product`."""
    n, k = _DENSE_PROBE
    g = torch.Generator().manual_seed(0)
    packed = torch._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
    sz = (torch.rand(k // GROUP, n, 2, generator=g) * 1e-2).to(int4_blocks_dtype())
    out = {}
    for rows in DENSE_PROBE_ROWS:
        x = torch.randn(rows, k, generator=g)
        kernel = best_ms(partial(torch._weight_int4pack_mm_for_cpu, x.to(sz.dtype), packed,
                                  GROUP, sz), runs=3)
        dense = best_ms(partial(dense_product, x, packed, sz, GROUP, dequantise), runs=3)
        out[rows] = (kernel, dense)
    return out


def dense_rows_from(ms: dict[int, tuple[float, float]]) -> float:
    """The fewest rows from which int4 products run in `dense_product`, given probe times
    {rows: (kernel ms, dense ms)}: the smallest probed count from which on it is at least
    `DENSE_MIN_SPEEDUP` times faster at every count probed (never under `DENSE_FLOOR`);
    ``inf``: never."""
    rows = math.inf
    for r in sorted(ms, reverse=True):
        kernel, dense = ms[r]
        if dense * DENSE_MIN_SPEEDUP > kernel:
            break
        rows = r
    return max(rows, DENSE_FLOOR)


def dense_setting(value: str | None = None) -> float | None:
    """`HEARTHNET_INT4_DENSE_ROWS` (or `value`): ``off`` (the default: see the module
    docstring) gives ``inf``; ``auto`` (a probe chooses, `dense_rows_from`) None; a whole
    number of rows at least `DENSE_FLOOR` that number. `ConfigError` for anything else."""
    raw = os.environ.get(INT4_DENSE_ENV, "") if value is None else value
    v = raw.strip().lower() or "off"
    if v == "auto":
        return None
    if v == "off":
        return math.inf
    if v.isdigit() and int(v) >= DENSE_FLOOR:
        return float(int(v))
    raise ConfigError(f"{INT4_DENSE_ENV}={raw!r} is not a row count; use auto, off or a "
                      f"whole number of at least {DENSE_FLOOR}", key=INT4_DENSE_ENV,
                      reason="bad int4 dense row threshold")


_dense_lock = threading.Lock()
_dense_done = threading.Event()
_dense_started = False
_DEQUANTISE: Callable[..., torch.Tensor] = _dequantised_tile  # what the choice stands for


def _choose_dense_rows() -> None:
    """Probe and publish `INT4_DENSE_ROWS` (and the de-quantiser it was measured with)."""
    global _DEQUANTISE
    rows, why = math.inf, ""
    try:
        if not dense_layout_ok():
            why = "torch packs int4 in another layout on this CPU"
        else:
            deq = _compiled_dequantiser()
            ms = _dense_probe_ms(deq)
            rows = dense_rows_from(ms)
            _DEQUANTISE = deq
            why = ", ".join(f"{r} rows: kernel {a:.2f} ms, dense {b:.2f} ms"
                            for r, (a, b) in ms.items())
    except Exception as e:  # a compile's or a kernel's failure, of any type: the kernel stays
        rows, why = math.inf, f"{type(e).__name__}: {e}"[:200]
    globals()["INT4_DENSE_ROWS"] = rows
    _dense_done.set()
    log.info("int4_dense_rows", rows=None if math.isinf(rows) else int(rows), why=why)


def int4_dense_rows(wait: bool = False) -> float:
    """`INT4_DENSE_ROWS`: the fewest rows of an int4 product that run in `dense_product`
    (``inf``: none). Set by `HEARTHNET_INT4_DENSE_ROWS`, else chosen by a probe in a
    background thread started on the first call — ``inf`` until it is done, or (`wait`)
    after waiting for it (benchmarks, so that every measured run uses one path)."""
    global _dense_started, _DEQUANTISE
    g = globals()
    if "INT4_DENSE_ROWS" not in g:
        with _dense_lock:
            if "INT4_DENSE_ROWS" not in g and not _dense_started:
                fixed = dense_setting()
                if fixed is None and not _compiles():
                    fixed = math.inf
                    log.info("int4_dense_rows", rows=None, why="this process does not "
                             "compile (HEARTHNET_COMPILE=0 or no C++ compiler)")
                if fixed is not None:
                    if not math.isinf(fixed) and _compiles():
                        _DEQUANTISE = _compiled_dequantiser()
                    g["INT4_DENSE_ROWS"] = fixed
                    return fixed
                _dense_started = True
                threading.Thread(target=_choose_dense_rows, name="int4-dense-probe",
                                 daemon=True).start()
        if wait:
            _dense_done.wait()
    return float(g.get("INT4_DENSE_ROWS", math.inf))


PRODUCT_BYTES = 24 << 20
"""The most fp32 bytes of transients (digits, digit products) one integer GEMM of
`Int8Linear` makes: a prefill chunk's product runs in blocks of rows
(`Int8Linear.block_rows`). Whole, the 256-row chunk of a 1.5B's fused gate/up product
(17,920 outputs) made 35 MiB of digit products and as much again inside fbgemm, so a
layer's chunk peaked 68 MiB above its inputs — twice that layer's KV cache for 8
sessions (32 MiB); in two blocks of 128 rows, 49 MiB. Smaller blocks save more (8 MiB:
39 MiB) but their GEMMs of ~100 digit rows ran ~1.6× slower on 2 threads; two of 128
measured no slower than one. Integer sums are exact and the recombination is per
element, so a row's result does not depend on its block."""
MIN_BLOCK_ROWS = 16  # a decode round's rows (≤ 8 sessions) stay one GEMM at every width;
# a speculative pass's (≤ 33, `compiled.verify_step`) too, up to a 1.5B's MLP


def split_rows(x: torch.Tensor, top: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of fp32 `x` (n, k) as integer digits (2n, k) in [-top, top], fp32 — hi rows
    then lo rows — and the per-row scale s (n, 1), with x ≈ s·(hi + lo/(2·top)): ~15 bits
    of each row's range for top = 127 (oneDNN), ~13 for 63 (fbgemm)."""
    s = x.abs().amax(1, keepdim=True).clamp_(min=1e-30).div_(top)  # (vector_norm: slower)
    u = x / s
    hi = u.round()
    lo = u.sub_(hi).mul_(2 * top).round_()
    return torch.cat((hi, lo)), s


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and per-output-channel bf16 scales.

    Where an integer GEMM is used (`INT8_KERNEL` oneDNN or fbgemm) the weights are held
    once, in that kernel's packed layout (`weight_packed`, or fbgemm's script object
    `fbgemm_packed`); in `int8-vnni` as `weight_q8` with fp32 `scales_q8` (`q4vnni.pack8_rows`;
    rows padded to whole tiles of 16), whose rows also serve lookups. `keep_rows=True`
    holds the plain matrix `weight_int8` instead, for embedding lookups; `pack()` adds the
    packed copy when the same matrix is also a product's weight (a head whose lm_head is
    tied to its embeddings holds both, but for `int8-vnni`). Unpacked, the product runs in
    `_weight_int8pack_mm` on `weight_int8`.
    """

    weight_int8: torch.Tensor
    weight_packed: torch.Tensor
    weight_q8: torch.Tensor
    scales_q8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *,
                 keep_rows: bool = False, scales: torch.Tensor | None = None,
                 kernel: str | None = None) -> None:
        """Quantise float `weight`, or take int8 `weight` quantised with `scales`; `kernel`:
        pack for that one (`INT8_KERNELS`) instead of this process's `INT8_KERNEL`."""
        super().__init__()
        n, k = weight.shape
        if scales is None:
            q = torch.empty((n, k), dtype=torch.int8)
            scales = torch.empty(n, dtype=torch.float32)
            for r, w in _rows(weight):
                # the kernel multiplies by bf16 scales: quantise with exactly those
                s = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).bfloat16().float()
                q[r:r + len(w)] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
                scales[r:r + len(w)] = s
        else:
            q = weight
        self.in_features, self.out_features = k, n
        self.kernel = "int8pack"  # until packed
        self._target = kernel
        self.fbgemm_packed: Any = None
        self.top = 0  # packed: the kernel's digit range
        self._product: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.register_buffer("scales", scales.to(torch.bfloat16))
        if keep_rows or self.target_kernel() == "int8pack":
            self.register_buffer("weight_int8", q)
        else:
            self.pack(q)
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None \
            else None

    @property
    def packed(self) -> bool:
        """Whether products run in an integer GEMM (oneDNN, fbgemm or `int8-vnni`)."""
        return self.kernel != "int8pack"

    def target_kernel(self) -> str:
        """The kernel this linear packs for: the one it was made for, else `INT8_KERNEL`;
        `int8-vnni` takes only whole groups of 32 inputs (others: `_integer_gemm`)."""
        kernel = self._target or int8_kernel_name()
        if kernel == q4vnni.INT8_KERNEL and self.in_features % GROUP:
            return _integer_gemm()
        return kernel

    def pack(self, q: torch.Tensor | None = None, *, drop_rows: bool = False) -> None:
        """Hold the weights (`q`, else `weight_int8`) packed for `INT8_KERNEL`, where it is
        an integer GEMM; `drop_rows`: then let the plain matrix go (held once)."""
        kernel = self.target_kernel()
        if kernel == "int8pack" or self.packed:
            return
        w = self.weight_int8 if q is None else q
        if kernel == q4vnni.INT8_KERNEL:
            pad = q4vnni.padded_rows(self.out_features) - self.out_features
            wq, sq = q4vnni.pack8_rows(nn.functional.pad(w, (0, 0, 0, pad)),
                                       nn.functional.pad(self.scales.float(), (0, pad)))
            self.register_buffer("weight_q8", wq)
            self.register_buffer("scales_q8", sq)
            drop_rows = True  # `rows` reads the packed matrix
        else:
            packed, self._product = _packed_product(kernel, w, self.scales.float())
            if kernel == "onednn":
                self.register_buffer("weight_packed", packed)
            else:  # a script object, not a buffer: `packed_bytes` counts it
                self.fbgemm_packed = packed
            self.top = _DIGITS[kernel]
        self.kernel = kernel
        if drop_rows:
            self._buffers.pop("weight_int8", None)

    def packed_bytes(self) -> int:
        """Bytes of fbgemm's packed copy (not a buffer): its int8 matrix."""
        return self.in_features * self.out_features if self.fbgemm_packed is not None else 0

    def _gemm(self, digits: torch.Tensor) -> torch.Tensor:
        """fp32 `digits @ w.T * scales` in the packed kernel (exact integer sums)."""
        assert self._product is not None  # packed
        return self._product(digits)

    def dequantised(self) -> torch.Tensor:
        """The fp32 weight this module computes with (tests, quality checks)."""
        if "weight_int8" in self._buffers or self.kernel == q4vnni.INT8_KERNEL:
            return self.rows(torch.arange(self.out_features))
        return self._gemm(torch.eye(self.in_features)).t()  # x = I: the product is w.T

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of the weight (an int8 embedding lookup; needs `keep_rows`, or
        the `int8-vnni` matrix)."""
        if "weight_int8" not in self._buffers and self.kernel == q4vnni.INT8_KERNEL:
            return q4vnni.unpack8_rows(self.weight_q8, self.scales_q8, ids)
        out: torch.Tensor = self.weight_int8[ids].float() * self.scales[ids].float()[..., None]
        return out

    def block_rows(self) -> int:
        """Rows per integer GEMM of a product of many rows (`forward`): as many as keep its
        fp32 transients within `PRODUCT_BYTES` — per row, the digit product (2 ×
        `out_features`) and the split (`split_rows`: 2 digit rows and 2 temporaries of
        `in_features`) —, a multiple of `MIN_BLOCK_ROWS` and never fewer."""
        rows = PRODUCT_BYTES // (4 * (2 * self.out_features + 4 * self.in_features))
        return max(MIN_BLOCK_ROWS, rows - rows % MIN_BLOCK_ROWS)

    def _digit_product(self, x2: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """fp32 `x2 @ w.T * scales` of fp32 rows `x2` as two digit rows each (`split_rows`)
        in the packed kernel, recombined in fp32 (into `out` when given)."""
        top = self.top
        digits, s = split_rows(x2, top)
        yy = self._gemm(digits)
        n = x2.shape[0]
        return torch.add(yy[:n], yy[n:], alpha=1 / (2 * top), out=out).mul_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == q4vnni.INT8_KERNEL:  # digits made in the kernel: any row count
            y = q4vnni.mm8(x.reshape(-1, self.in_features).float().contiguous(),
                           self.weight_q8, self.scales_q8)
            if y.shape[1] != self.out_features:  # rows padded to a whole tile
                y = y[:, :self.out_features]
            y = y.to(x.dtype)
        elif self.packed:
            x2 = x.reshape(-1, self.in_features).float()
            n, rows = x2.shape[0], self.block_rows()
            if torch.compiler.is_compiling() or n <= rows:  # a compiled step: one GEMM
                y = self._digit_product(x2).to(x.dtype)
            else:  # a prefill chunk: its rows' products a block at a time (M26 §5.6), in
                # blocks of even size (two GEMMs of 128 rows, not 144 and 112)
                blocks = -(-n // rows)
                rows = -(-n // (blocks * MIN_BLOCK_ROWS)) * MIN_BLOCK_ROWS
                y = torch.empty(n, self.out_features, dtype=torch.float32, device=x.device)
                for r in range(0, n, rows):
                    self._digit_product(x2[r:r + rows], out=y[r:r + rows])
                y = y.to(x.dtype)
        else:
            x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
            y = torch._weight_int8pack_mm(x2, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def _int4_shape_check(n: int, k: int, gs: int) -> None:
    if not gs or n % 16:
        raise BadRequest(f"int4 needs input sizes divisible by {INT4_GROUPS[-1]} and "
                         f"output sizes by 16; this model has a {n}x{k} matrix — use int8")


@cache
def _packs_join(rows: tuple[int, ...]) -> bool:
    """Whether torch's int4 packing of matrices of `rows` rows each, one after the
    other, equals the packing of all their rows at once (`Int4Linear.joinable`)."""
    g = torch.Generator().manual_seed(2)
    qs = [torch.randint(0, 16, (n, 2 * GROUP), dtype=torch.int32, generator=g) for n in rows]
    try:
        parts = [torch._convert_weight_to_int4pack_for_cpu(q, 1) for q in qs]
        whole = torch._convert_weight_to_int4pack_for_cpu(torch.cat(qs), 1)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(torch.cat(parts), whole))


class Int4Linear(nn.Module):
    """`nn.Linear` with int4 weights, asymmetric per group of inputs (`INT4_GROUPS`), or
    (`from_blocks`) a GGUF's Q4 blocks as they are."""

    weight_int4: torch.Tensor
    scales_and_zeros: torch.Tensor
    offsets: torch.Tensor | None
    vnni: bool
    in_features: int
    out_features: int
    group: int
    dense: bool
    bias: nn.Parameter | None

    @classmethod
    def from_blocks(cls, blocks: GgmlBlocks, bias: torch.Tensor | None,
                    dtype: torch.dtype | None = None) -> Int4Linear:
        """Q4_0/Q4_1/Q4_K `blocks` held exactly: in `int4-vnni`'s layout with the blocks'
        own scales (`blocks.int4_affine`) where that is `INT4_KERNEL`, else groups of 32
        with the blocks' scales and zeros (`blocks.int4_groups`) in `dtype` (default
        `INT4_BLOCKS_DTYPE`), which is also what activations are computed in."""
        n, k = blocks.shape
        _int4_shape_check(n, k, GROUP if k % GROUP == 0 else 0)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        if dtype is None and vnni_holds(n, k):
            w, s, o = q4vnni.pack(*int4_affine(blocks.raw.cpu(), blocks.ggml_type, blocks.shape))
            self._keep(w, s, GROUP, k, bias, offsets=o)
            return self
        q, scales, zeros = int4_groups(blocks.raw.cpu(), blocks.ggml_type, blocks.shape)
        sz = torch.stack((scales.t(), zeros.t()), dim=-1)  # (k / 32, n, 2), the kernel's
        self._hold(q.int(), sz.to(dtype or int4_blocks_dtype()), GROUP, bias)
        return self

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantise float `weight`: where int4 runs in `int4-vnni` (`vnni_holds`), as
        llama.cpp's Q4_1 — groups of 32, each with an fp16 scale and minimum, the values
        rounded against those fp16 numbers — else for torch's kernel (`INT4_GROUPS`, bf16
        scales and zeros)."""
        super().__init__()
        n, k = weight.shape
        if vnni_holds(n, k):
            q = torch.empty((n, k), dtype=torch.uint8)
            scale = torch.empty((n, k // GROUP), dtype=torch.float16)
            low = torch.empty_like(scale)
            for r, w in _rows(weight):
                wg = w.reshape(len(w), -1, GROUP)
                lo, hi = wg.amin(-1), wg.amax(-1)
                sh, lh = ((hi - lo) / 15).half(), lo.half()
                s32 = sh.float().clamp(min=1e-30)[..., None]  # a constant group: q = 0
                q[r:r + len(w)] = ((wg - lh.float()[..., None]) / s32).round_().clamp_(0, 15) \
                    .reshape(len(w), k).to(torch.uint8)
                scale[r:r + len(w)], low[r:r + len(w)] = sh, lh
            w, sp, op = q4vnni.pack(q, scale, low)
            self._keep(w, sp, GROUP, k, bias, offsets=op)
            return
        gs = next((g for g in INT4_GROUPS if k % g == 0), 0)
        _int4_shape_check(n, k, gs)
        g = k // gs
        q = torch.empty((n, k), dtype=torch.int32)
        sz = torch.empty((g, n, 2), dtype=torch.float32)
        for r, w in _rows(weight):
            wg = w.reshape(len(w), g, gs)
            lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
            s = ((hi - lo) / 15).clamp(min=1e-12)
            q[r:r + len(w)] = torch.round((wg - lo) / s).clamp_(0, 15).reshape(len(w), k).int()
            sz[:, r:r + len(w), 0] = s.squeeze(-1).t()
            sz[:, r:r + len(w), 1] = (lo + 8 * s).squeeze(-1).t()  # zero point of q=8
        self._hold(q, sz.to(torch.bfloat16), gs, bias)

    @staticmethod
    def joinable(parts: list[Int4Linear]) -> bool:
        """Whether `parts` can be held as one matrix (`joined`): the same inputs, groups
        and scale dtype, and packed rows that join — torch packs rows in blocks (64 on
        AVX-512, 32 on AVX2), so the parts' packed matrices, one after the other, must be
        the packing of their rows one after the other (`_packs_join`)."""
        first = parts[0]
        same = all(p.in_features == first.in_features and p.group == first.group
                   and p.scales_and_zeros.dtype == first.scales_and_zeros.dtype
                   and p.vnni == first.vnni and (p.offsets is None) == (first.offsets is None)
                   for p in parts)
        # int4-vnni's tiles of 16 rows always join
        return same and (first.vnni or _packs_join(tuple(p.out_features for p in parts)))

    @classmethod
    def joined(cls, parts: list[Int4Linear], bias: torch.Tensor | None) -> Int4Linear:
        """`parts` (`joinable`) as one linear: their outputs one after the other. Each
        part's buffers are let go once joined (the group held twice at most)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        vnni = parts[0].vnni  # scales (tiles, groups, 16), else (groups, rows, 2)
        packed = torch.cat([p.weight_int4 for p in parts])
        sz = torch.cat([p.scales_and_zeros for p in parts], dim=0 if vnni else 1)
        offsets = None if parts[0].offsets is None else \
            torch.cat([p.offsets for p in parts if p.offsets is not None])
        for p in parts:
            del p._buffers["weight_int4"], p._buffers["scales_and_zeros"], p._buffers["offsets"]
        self._keep(packed, sz, parts[0].group, parts[0].in_features, bias, offsets=offsets)
        return self

    def _hold(self, q: torch.Tensor, sz: torch.Tensor, gs: int,
              bias: torch.Tensor | None) -> None:
        """Pack int32 `q` (n, k) in 0..15 with `sz` (k / gs, n, 2) (scale, zero) for the
        kernel: weight ``(q − 8) · scale + zero``; activations are computed in sz's dtype."""
        self._keep(torch._convert_weight_to_int4pack_for_cpu(q, 1), sz, gs, q.shape[1], bias)

    def _keep(self, packed: torch.Tensor, sz: torch.Tensor, gs: int, k: int,
              bias: torch.Tensor | None, offsets: torch.Tensor | None = None) -> None:
        """Hold `packed` rows (torch's int4 pack of n rows of `k` inputs) with `sz`, or
        (3-d `packed`) `q4vnni`'s tiles with their scales `sz` and `offsets`."""
        self.vnni = packed.dim() == 3
        self.in_features, self.group = k, gs
        self.out_features = packed.shape[0] * (q4vnni.TILE if self.vnni else 1)
        dense_setting()  # a bad HEARTHNET_INT4_DENSE_ROWS is refused at load, not mid-call
        # whole blocks of torch's layout: `dense_product`
        self.dense = not self.vnni and packed.shape[0] % DENSE_BLOCK == 0
        self.register_buffer("weight_int4", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("offsets", offsets)
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.vnni:
            y = q4vnni.mm(x2.float().contiguous(), self.weight_int4, self.scales_and_zeros,
                          self.offsets).to(x.dtype)
        elif self._dense_rows(x2):  # a prefill: de-quantised tiles in fp32 GEMMs
            y = dense_product(x2.float(), self.weight_int4, self.scales_and_zeros, self.group,
                              _DEQUANTISE).to(x.dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(
                x2.to(self.scales_and_zeros.dtype).contiguous(), self.weight_int4,
                self.group, self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _dense_rows(self, x2: torch.Tensor) -> bool:
        """Whether rows `x2` run in `dense_product`: never while torch.compile traces (a
        compiled step keeps the kernel, whatever its rows), else from `int4_dense_rows`
        rows on, on the CPU, in torch's AVX-512 layout."""
        if len(x2) < DENSE_FLOOR or not self.dense or x2.device.type != "cpu":
            return False  # a decode step's few rows leave here first: the per-token path
        return not torch.compiler.is_compiling() and len(x2) >= int4_dense_rows()


class Q8Linear(nn.Module):
    """`nn.Linear` (or an embedding, `rows`) with a GGUF's Q8_0 blocks as they are: int8
    values with each group of 32's fp16 scale, in `q4vnni`'s 8-bit layout; products in
    the `int4-vnni` kernel (two int8 digits of each activation: ~2e-5 of the fp32
    product). Where the blocks' host runs `int4-vnni` (`vnni_chosen`), it stands for int8 per
    output channel, which would de-quantise them and round them a second time."""

    weight_q8: torch.Tensor
    scales: torch.Tensor
    bias: nn.Parameter | None

    def __init__(self, blocks: GgmlBlocks, bias: torch.Tensor | None = None) -> None:
        """Hold Q8_0 `blocks`; rows past the last whole tile of 16 (a vocabulary of 49,155)
        are padded with zero rows, whose outputs are never returned."""
        super().__init__()
        n, k = blocks.shape
        if blocks.ggml_type != "Q8_0" or k % GROUP:
            raise ValueError(f"{blocks.ggml_type} {n}x{k} blocks are not Q8_0")
        q, d = q8_groups(blocks.raw.cpu(), blocks.shape)
        pad = q4vnni.padded_rows(n) - n
        w, sc = q4vnni.pack8(nn.functional.pad(q, (0, 0, 0, pad)),
                             nn.functional.pad(d, (0, 0, 0, pad)))
        self.in_features, self.out_features = k, n
        self.register_buffer("weight_q8", w)
        self.register_buffer("scales", sc)
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None \
            else None

    @staticmethod
    def takes(blocks: object) -> TypeGuard[GgmlBlocks]:
        """Whether `blocks` are Q8_0 this process holds as they are (`vnni_chosen`)."""
        return isinstance(blocks, GgmlBlocks) and blocks.ggml_type == "Q8_0" \
            and vnni_chosen()

    def pack(self) -> None:
        """As `Int8Linear.pack`: the one layout serves lookups and products."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of the weight (an embedding lookup), exactly the file's."""
        return q4vnni.unpack8_rows(self.weight_q8, self.scales, ids)

    def dequantised(self) -> torch.Tensor:
        """The fp32 weight (tests, quality checks)."""
        return self.rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = q4vnni.mm8(x2.float().contiguous(), self.weight_q8, self.scales)
        y = y[:, :self.out_features].to(x.dtype)  # less the padding rows
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def vnni_chosen() -> bool:
    """Whether Q8_0 blocks are held as they are (`Q8Linear`): where int4 runs in
    `int4-vnni` (the same kernel), else they are de-quantised into int8 per output
    channel."""
    return int4_kernel_name() == q4vnni.KERNEL


def vnni_holds(n: int, k: int) -> bool:
    """Whether an int4 (n × k) matrix is held for `int4-vnni`: where that is this
    process's int4 kernel and the matrix is whole tiles of 16 rows and groups of 32."""
    return n % q4vnni.TILE == 0 and k % GROUP == 0 and vnni_chosen()


FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read
# the same input in every family's decoder layer (Phi-3's are fused in its checkpoint)
_FUSED_NAMES = {n for names in FUSE for n in names}


class FusedLinear(nn.Module):
    """Sibling quantised linears that read the same input (`FUSE`), held as one matrix:
    one activation split and one product for all of them. Their small members — k_proj
    and v_proj are 192 rows in SmolLM2, 256 in a 1.5B — no longer pay a call's fixed cost
    each: SmolLM2's decode step makes 4 int4 products a layer, not 7.

    The first member called with an input computes every member's output; the others
    take theirs for the same input object, and the outputs are let go once all are taken.
    A member called with another input, or twice, computes afresh. Eagerly the outputs are
    kept per thread (a shard's executor runs sessions in several). While torch.compile
    traces, they are kept on the module instead: the trace resolves the members' reads
    then (the compiled step computes the product once), and what is stored there at run
    time is never read back.
    """

    def __init__(self, parts: list[Int8Linear] | list[Int4Linear]) -> None:
        super().__init__()
        members: list[Int8Linear | Int4Linear] = list(parts)
        bias = None if all(p.bias is None for p in members) else torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in members])
        self.inner: Int8Linear | Int4Linear
        int8 = [p for p in parts if isinstance(p, Int8Linear)]
        if not int8:
            self.inner = Int4Linear.joined([p for p in parts if isinstance(p, Int4Linear)],
                                           bias)
        else:
            q = torch.cat([p.weight_int8 for p in int8])
            for p in int8:
                del p._buffers["weight_int8"]  # the load's transient: the group twice, not 3×
            self.inner = Int8Linear(q, bias,
                                    scales=torch.cat([p.scales.float() for p in int8]))
            del q
        self.splits = [p.out_features for p in parts]
        self._last = threading.local()
        self._traced: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = None

    def output(self, x: torch.Tensor, i: int) -> torch.Tensor:
        tracing = torch.compiler.is_compiling()
        last: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = \
            self._traced if tracing else getattr(self._last, "v", None)
        if last is None or last[0] is not x or i in last[2]:
            last = (x, self.inner(x).split(self.splits, dim=-1), set())
        taken = last[2] | {i}
        keep = None if len(taken) == len(self.splits) else (last[0], last[1], taken)
        if tracing:
            self._traced = keep
        else:
            self._last.v = keep
        y: torch.Tensor = last[1][i].contiguous()
        return y


class FusedMember(nn.Module):
    """One member of a `FusedLinear` group, in its linear's place."""

    def __init__(self, group: FusedLinear, index: int) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = group.inner.in_features, group.splits[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def _plain(m: object) -> TypeGuard[Int8Linear]:
    """An unpacked int8 linear whose weights and bias are all loaded."""
    return isinstance(m, Int8Linear) and not m.packed and "weight_int8" in m._buffers \
        and (m.bias is None or not m.bias.is_meta)


def _whole_int4(m: object) -> TypeGuard[Int4Linear]:
    """An int4 linear whose weights and bias are all loaded."""
    return isinstance(m, Int4Linear) and "weight_int4" in m._buffers \
        and (m.bias is None or not m.bias.is_meta)


def fuse_siblings(module: nn.Module) -> None:
    """Hold `module`'s `FUSE` siblings as one matrix each (`FusedLinear`) where they are
    all plain int8 linears (packed here for the integer GEMM, as every other int8 linear)
    or all int4 linears whose packed rows can be joined (`Int4Linear.joinable`)."""
    int8 = int8_kernel_name() != "int8pack"
    for parent in list(module.modules()):
        for names in FUSE:
            members = [getattr(parent, n, None) for n in names]
            p8 = [p for p in members if _plain(p)]
            p4 = [p for p in members if _whole_int4(p)]
            parts: list[Int8Linear] | list[Int4Linear] | None = None
            if int8 and len(p8) == len(names):
                parts = p8
            elif len(p4) == len(names) and Int4Linear.joinable(p4):
                parts = p4
            if parts is None or len({p.in_features for p in parts}) != 1:
                continue
            group = FusedLinear(parts)
            for i, n in enumerate(names):
                setattr(parent, n, FusedMember(group, i))
    if int8:
        for m in module.modules():
            if isinstance(m, Int8Linear) and not m.packed:
                m.pack(drop_rows=True)


_QUANT_LINEAR: dict[str, type[Int8Linear] | type[Int4Linear]] = {
    "int8": Int8Linear, "int4": Int4Linear}


def _place(t: torch.Tensor) -> torch.Tensor:
    """Where a converted tensor goes: where it was read (`WeightsReader` reads onto the device)."""
    return t


def load_module(module: nn.Module,
                tensors: Iterator[tuple[str, torch.Tensor | GgmlBlocks]], fmt: str,
                where: str) -> None:
    """Fill meta `module` from (relative name, stored tensor) pairs, one tensor at a time.

    Float formats convert each tensor to the format's dtype; quantised formats replace
    each `nn.Linear` with its quantised module when its weight arrives (its bias, before or
    after, goes with it) and hold the other tensors in fp32. GGUF blocks (`GgmlBlocks`)
    are held as they are where the format takes them (an int4 linear of Q4 blocks), else
    de-quantised exactly to fp32 first. Strict: a name that is not a
    parameter or buffer of `module` is a `WeightsMismatch`; what stays on meta is the
    caller's to check (non-persistent buffers are re-created afterwards).
    """
    dtype = compute_dtype_of(fmt)
    quant = _QUANT_LINEAR.get(fmt)
    for name, value in tensors:
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            raise WeightsMismatch(f"{where}: weights do not match the model structure "
                                  f"(unexpected {name!r})") from None
        lin = owner if isinstance(owner, nn.Linear) and attr == "weight" else None
        bias = lin.bias if lin is not None and lin.bias is not None \
            and not lin.bias.is_meta else None
        if isinstance(value, GgmlBlocks) and lin is not None and quant is Int4Linear:
            # DESIGN.md decision 15: a GGUF's Q4 blocks held as they are, and Q8_0 ones
            # where the kernel takes them; others as int8
            module.set_submodule(owner_name, Int4Linear.from_blocks(value, bias)
                                 if value.ggml_type in Q4_TYPES
                                 else Q8Linear(value, bias) if Q8Linear.takes(value)
                                 else Int8Linear(value.dequantise(), bias))
            if lin.bias is not None and bias is None:
                _meta_bias(module.get_submodule(owner_name), lin.bias)
            continue
        t = value.dequantise() if isinstance(value, GgmlBlocks) else value
        if quant is not None and lin is not None:
            # int8: packed at once, but `FUSE` siblings stay plain until the module is
            # whole, then are packed as one matrix (`fuse_siblings`)
            module.set_submodule(owner_name, Int8Linear(
                t, bias, keep_rows=owner_name.rpartition(".")[2] in _FUSED_NAMES)
                if quant is Int8Linear else quant(t, bias))
            if lin.bias is not None and bias is None:
                _meta_bias(module.get_submodule(owner_name), lin.bias)
            continue
        _assign(owner, attr, _place(t.to(dtype)), name, where)
    if quant is not None:
        fuse_siblings(module)


def _meta_bias(qmod: nn.Module, meta: torch.Tensor) -> None:
    """Keep a not-yet-loaded bias on meta so the strict check sees it is missing."""
    qmod.bias = nn.Parameter(meta, requires_grad=False)


def _assign(owner: nn.Module, attr: str, value: torch.Tensor, name: str, where: str) -> None:
    current: Any = owner._parameters.get(attr) if attr in owner._parameters \
        else owner._buffers.get(attr) if attr in owner._buffers else None
    if current is None and attr not in owner._parameters and attr not in owner._buffers:
        raise WeightsMismatch(f"{where}: weights do not match the model structure "
                              f"(unexpected {name!r})")
    if current is not None and tuple(current.shape) != tuple(value.shape):
        raise WeightsMismatch(f"{where}: tensor {name!r} has shape {tuple(value.shape)}; "
                              f"the model expects {tuple(current.shape)}")
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def held_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of `module` as held (quantised or not), and of
    fbgemm's packed matrices (script objects, not buffers)."""
    seen: set[int] = set()
    total = sum(m.packed_bytes() for m in module.modules() if isinstance(m, Int8Linear))
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def held_nbytes(shape: tuple[int, ...], fmt: str, linear: bool, ggml_type: str = "") -> int:
    """Bytes one stored tensor takes once held as `fmt` (what `load_module` makes of it).

    `linear`: the tensor is an `nn.Linear` weight (quantised formats quantise only those;
    their other tensors are held in fp32). `shape`: its logical shape; `ggml_type`: the
    GGML type of its blocks when the store kept a GGUF's blocks.
    """
    n = math.prod(shape)
    if fmt == "int4" and linear and ggml_type:
        if ggml_type == "Q8_0" and vnni_chosen():  # `Q8Linear`: the blocks, whole tiles
            rows = q4vnni.padded_rows(shape[0])
            return rows * (shape[1] + shape[1] // GROUP * 2)  # int8 + fp16 per 32
        if ggml_type not in Q4_TYPES:
            return held_nbytes(shape, "int8", linear)
        groups = (shape[1] // GROUP) * shape[0]
        if int4_kernel_name() == q4vnni.KERNEL:  # `blocks.int4_affine`'s scales and offsets
            return n // 2 + groups * {"Q4_0": 2, "Q4_1": 4}.get(ggml_type, 8)
        scale = torch.empty((), dtype=int4_blocks_dtype()).element_size()
        return n // 2 + groups * 2 * scale
    if fmt == "int8" and linear and shape[1] % GROUP == 0 \
            and int8_kernel_name() == q4vnni.INT8_KERNEL:  # whole tiles + fp32 scales too
        rows = q4vnni.padded_rows(shape[0])
        return rows * (shape[1] + 4) + shape[0] * 2
    if fmt == "int8" and linear:
        return n + shape[0] * 2  # int8 values + one bf16 scale per output channel
    if fmt == "int4" and linear and vnni_holds(shape[0], shape[1]):
        return n // 2 + (n // GROUP) * 4  # nibbles + fp16 (scale, minimum) per group of 32
    if fmt == "int4" and linear:
        k = shape[1]
        gs = next((g for g in INT4_GROUPS if k % g == 0), INT4_GROUPS[-1])
        return n // 2 + (k // gs) * shape[0] * 2 * 2  # packed nibbles + bf16 (scale, zero)
    if fmt in _FLOAT:
        return n * torch.empty((), dtype=_FLOAT[fmt]).element_size()
    return n * 4  # the other tensors of a quantised format: fp32
