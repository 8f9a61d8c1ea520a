"""Weight formats: how a shard or a head holds its weights (issue 12 §2).

A format is chosen per shard (`[[shards]] weights`, or the host's default) and per head:

- `fp32`, `bf16`, `fp16`: every tensor held in that dtype, and the layers compute in it.
- `native`: the stored dtype of the model (a bf16 import is held in bf16); resolved to
  one of the three above when the weights are loaded, so advertisements name a real one.
- `int8`: weight-only int8. Every `nn.Linear` weight is quantised at load time from the
  stored weights, symmetric per output channel (scale = max |w| / 127, bf16); the matrix
  product runs in torch's fused CPU kernel `torch._weight_int8pack_mm` with bf16
  activations; everything else (norms, attention, residuals) stays fp32.
- `int4`: weight-only int4, asymmetric in groups of 128 (64, 32 where 128 does not divide)
  along the input dimension (gpt-fast's layout), torch's `_weight_int4pack_mm_for_cpu`;
  compute as for int8. Not in a call's default accepted set (README "Weight formats").

Loading is per tensor: a tensor is read from safetensors, converted to the held format and
assigned, then the next one is read, so the stored model never sits in memory whole (a
device move goes between the conversion and the assignment: `_place`).

Format names and the routing policy live in `distributed_inference/formats.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hearthnet.distributed_inference.formats import STORED
from hearthnet.errors import BadRequest, WeightsMismatch
from hearthnet.transport.codec import FLOAT_DTYPES

INT4_GROUPS = (128, 64, 32)  # the largest that divides a matrix's input size
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


class Int8Linear(nn.Module):
    """`nn.Linear` with int8 weights and per-output-channel bf16 scales."""

    weight_int8: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        n, k = weight.shape
        q = torch.empty((n, k), dtype=torch.int8)
        scales = torch.empty(n, dtype=torch.float32)
        for r, w in _rows(weight):
            # the kernel multiplies by bf16 scales: quantise with exactly those
            s = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).bfloat16().float()
            q[r:r + len(w)] = torch.round(w / s[:, None]).clamp_(-127, 127).to(torch.int8)
            scales[r:r + len(w)] = s
        self.in_features, self.out_features = k, n
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None \
            else None

    def dequantised(self) -> torch.Tensor:
        """The fp32 weight this module computes with (tests, quality checks)."""
        w: torch.Tensor = self.weight_int8.float() * self.scales.float()[:, None]
        return w

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of the weight (an int8 embedding lookup)."""
        out: torch.Tensor = self.weight_int8[ids].float() * self.scales[ids].float()[..., None]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.weight_int8, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """`nn.Linear` with int4 weights, asymmetric per group of inputs (`INT4_GROUPS`)."""

    weight_int4: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        n, k = weight.shape
        gs = next((g for g in INT4_GROUPS if k % g == 0), 0)
        if not gs or n % 16:
            raise BadRequest(f"int4 needs input sizes divisible by {INT4_GROUPS[-1]} and "
                             f"output sizes by 16; this model has a {n}x{k} matrix — use int8")
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
        self.in_features, self.out_features, self.group = k, n, gs
        self.register_buffer("weight_int4", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16))
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(x2, self.weight_int4, self.group,
                                              self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


_QUANT_LINEAR: dict[str, type[Int8Linear] | type[Int4Linear]] = {
    "int8": Int8Linear, "int4": Int4Linear}


def _place(t: torch.Tensor) -> torch.Tensor:
    """Where a converted tensor goes (CPU here; the GPU issue moves it to its device)."""
    return t


def load_module(module: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], fmt: str,
                where: str) -> None:
    """Fill meta `module` from (relative name, stored tensor) pairs, one tensor at a time.

    Float formats convert each tensor to the format's dtype; quantised formats replace
    each `nn.Linear` with its quantised module when its weight arrives (its bias, before or
    after, goes with it) and hold the other tensors in fp32. Strict: a name that is not a
    parameter or buffer of `module` is a `WeightsMismatch`; what stays on meta is the
    caller's to check (non-persistent buffers are re-created afterwards).
    """
    dtype = compute_dtype_of(fmt)
    quant = _QUANT_LINEAR.get(fmt)
    for name, t in tensors:
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:
            raise WeightsMismatch(f"{where}: weights do not match the model structure "
                                  f"(unexpected {name!r})") from None
        if quant is not None and isinstance(owner, nn.Linear) and attr == "weight":
            bias = owner.bias if owner.bias is not None and not owner.bias.is_meta else None
            module.set_submodule(owner_name, quant(t, bias))
            if owner.bias is not None and bias is None:
                _meta_bias(module.get_submodule(owner_name), owner.bias)
            continue
        _assign(owner, attr, _place(t.to(dtype)), name, where)


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
    """Bytes of every parameter and buffer of `module` as held (quantised or not)."""
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def held_nbytes(shape: tuple[int, ...], fmt: str, linear: bool) -> int:
    """Bytes one stored tensor takes once held as `fmt` (what `load_module` makes of it).

    `linear`: the tensor is an `nn.Linear` weight (quantised formats quantise only those;
    their other tensors are held in fp32).
    """
    n = math.prod(shape)
    if fmt == "int8" and linear:
        return n + shape[0] * 2  # int8 values + one bf16 scale per output channel
    if fmt == "int4" and linear:
        k = shape[1]
        gs = next((g for g in INT4_GROUPS if k % g == 0), INT4_GROUPS[-1])
        return n // 2 + (k // gs) * shape[0] * 2 * 2  # packed nibbles + bf16 (scale, zero)
    if fmt in _FLOAT:
        return n * torch.empty((), dtype=_FLOAT[fmt]).element_size()
    return n * 4  # the other tensors of a quantised format: fp32
