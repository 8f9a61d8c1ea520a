"""GGUF quantised blocks as a store keeps them, and what a shard makes of them (DESIGN.md
decisions 10 and 15).

A store imported with kept blocks (`hearthnet models import … --dtype gguf`) holds each
quantised GGUF tensor as the file's own GGML block bytes: a uint8 tensor of shape
(rows, bytes per row), its GGML type and logical shape recorded beside it
(`hearthnet.models.gguf.GGML_METADATA`). `GgmlBlocks` is one such tensor read back.

Three ways out of the blocks:

- `dequantise`: the exact fp32 weights, as gguf-py's `gguf.quants.dequantize` (the
  reference every held format is compared with) computes them; every float format and the
  int8 format start from these.
- `int4_groups`: Q4_0, Q4_1 and Q4_K blocks as torch's group-wise int4 layout
  (`_weight_int4pack_mm_for_cpu`: ``w = (q - 8) · scale + zero`` per group of 32 inputs),
  exactly — no value is rounded on the way:

  ========  ===========================  ==========================================
  type      GGML value (q = 0..15)       scale, zero (the kernel's, per 32-group)
  ========  ===========================  ==========================================
  Q4_0      d · (q − 8)                  d, 0
  Q4_1      d · q + m                    d, m + 8·d
  Q4_K      d·sc · q − dmin·m            d·sc, 8·d·sc − dmin·m (sc, m: the group's
                                         6-bit scale and min of its 256-super-block)
  ========  ===========================  ==========================================

  d, m, dmin are fp16 and sc, m 6-bit integers, so every scale is exact in fp32 and every
  zero is too unless its two terms lie more than 2^13 apart (never in a real model:
  `inexact_zeros` counts them). In fp32 the kernel's ``(q − 8)·scale + zero`` then rounds
  once, as the reference's ``d·q + m`` does: the held weight is the reference's, bit for
  bit. The kernel's fast path takes bf16 activations, scales and zeros and writes bf16
  outputs; there the scales and zeros round to 8 bits of mantissa.
- `int4_affine` (and `q8_groups` for Q8_0): the values and scales exactly as the file has
  them — fp16 d (and m) for Q4_0/Q4_1/Q8_0, fp32 d·sc and −dmin·m for Q4_K — for
  HearthNet's own `int4-vnni` kernel (`q4vnni`), ``w = q·scale + offset``.

Which path a process uses is chosen on first use (`quant.INT4_KERNEL`).

Block layouts as llama.cpp's `ggml-quants.c` (`dequantize_row_q4_0/q4_1/q4_K`) defines
them: a Q4_0 block is d (fp16) then 16 bytes whose low nibbles are elements 0..15 and
high nibbles 16..31; Q4_1 has d and m (fp16) before the same 16 bytes; a Q4_K
super-block of 256 is d, dmin (fp16), 12 bytes of packed 6-bit scales and mins, then 4
chunks of 32 bytes, chunk c holding group 2c in its low nibbles and 2c+1 in its high.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # inputs per int4 group: a Q4_0/Q4_1 block, a Q4_K sub-block


@dataclass
class GgmlBlocks:
    """One stored tensor of GGML blocks: raw bytes (rows, bytes per row), type, shape."""

    raw: torch.Tensor  # uint8 (rows, bytes per row)
    ggml_type: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]  # logical (rows, columns): an nn.Linear weight's (out, in)

    def dequantise(self) -> torch.Tensor:
        """The exact fp32 weights (gguf-py's de-quantisation, the reference)."""
        return dequantise(self.raw, self.ggml_type, self.shape)


def dequantise(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values of GGML blocks `raw` (rows, bytes per row) of `ggml_type`, as `shape`."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    values = dequantize(raw.cpu().numpy(), GGMLQuantizationType[ggml_type])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """fp32 values of little-endian fp16 numbers stored as byte pairs (..., 2)."""
    return _half(b).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes → (..., 32) values: the low nibbles, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def int4_groups(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4 blocks as (q, scales, zeros): q uint8 (n, k) in 0..15, fp32 scales and zeros
    (n, k / 32), with weight ``(q − 8) · scale + zero`` per group — the table above."""
    n, k = shape
    if ggml_type == "Q4_0":
        b = raw.reshape(n, k // 32, 18)
        d = _fp16(b[..., 0:2])
        return _nibbles(b[..., 2:]).reshape(n, k), d, torch.zeros_like(d)
    if ggml_type == "Q4_1":
        b = raw.reshape(n, k // 32, 20)
        d, m = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        return _nibbles(b[..., 4:]).reshape(n, k), d, m + 8 * d
    if ggml_type == "Q4_K":
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # (n, supers)
        sc, mins = _q4k_scales(b[..., 4:16])  # (n, supers, 8)
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=3).reshape(n, k)  # chunk c: 2c, 2c+1
        scale = d[..., None] * sc.float()  # 11 × 6 bits: exact in fp32
        zero = 8 * scale - dmin[..., None] * mins.float()
        return q, scale.reshape(n, -1), zero.reshape(n, -1)
    raise ValueError(f"{ggml_type} blocks have no exact int4 form")


def int4_affine(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q4 blocks as (q, scale, offset) for the `int4-vnni` kernel (`q4vnni`), each value
    as the file has it: q uint8 (n, k) in 0..15; per group of 32, weight ``q·scale +
    offset`` — Q4_0: d and no offset (``(q − 8)·d``), both fp16; Q4_1: d and m, fp16;
    Q4_K: d·sc and −dmin·m in fp32 (11 × 6 bits: exact)."""
    n, k = shape
    if ggml_type == "Q4_0":
        b = raw.reshape(n, k // 32, 18)
        return _nibbles(b[..., 2:]).reshape(n, k), _half(b[..., 0:2]), None
    if ggml_type == "Q4_1":
        b = raw.reshape(n, k // 32, 20)
        return _nibbles(b[..., 4:]).reshape(n, k), _half(b[..., 0:2]), _half(b[..., 2:4])
    if ggml_type == "Q4_K":
        q, scale, _ = int4_groups(raw, ggml_type, shape)
        b = raw.reshape(n, k // 256, 144)
        _, mins = _q4k_scales(b[..., 4:16])
        offset = -(_fp16(b[..., 2:4])[..., None] * mins.float()).reshape(n, -1)
        return q, scale, offset
    raise ValueError(f"{ggml_type} blocks have no exact int4 form")


def q8_groups(raw: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks as the file has them: int8 values q (n, k) and each group of 32's fp16
    scale d (n, k / 32); weight ``q·d``. A block is d (fp16) then 32 int8 values."""
    n, k = shape
    b = raw.reshape(n, k // 32, 34)
    return b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _half(b[..., 0:2])


def _half(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 numbers stored as byte pairs (..., 2), as fp16."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in a Q4_K super-block's 12 bytes: groups 0..3
    in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); groups 4..7 in the nibbles
    of bytes 8..11 (scale low, min high) with their top 2 bits in bytes 0..7's top bits."""
    lo, mid, hi = s[..., 0:4].int(), s[..., 4:8].int(), s[..., 8:12].int()
    sc = torch.cat((lo & 63, (hi & 15) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=-1)
    return sc, mins


def inexact_zeros(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> int:
    """Groups whose zero (`int4_groups`) is not exact in fp32 (0 in every model seen)."""
    n, k = shape
    if ggml_type == "Q4_0":
        return 0
    if ggml_type == "Q4_1":
        b = raw.reshape(n, k // 32, 20)
        d, m = _fp16(b[..., 0:2]).double(), _fp16(b[..., 2:4]).double()
        exact = m + 8 * d
    else:
        b = raw.reshape(n, k // 256, 144)
        sc, mins = _q4k_scales(b[..., 4:16])
        exact = 8 * _fp16(b[..., 0:2]).double()[..., None] * sc.double() \
            - _fp16(b[..., 2:4]).double()[..., None] * mins.double()
    return int((exact.float().double() != exact).sum())
