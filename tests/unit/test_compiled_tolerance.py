"""How far a compiled decode step may differ from the eager layers (`compiled.tolerance`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hearthnet.distributed_inference.engine import compiled
from tests.helpers.kernels import use_int4_kernel


def _stack(fmt: str, dtype: torch.dtype, blocks: bool = False) -> SimpleNamespace:
    return SimpleNamespace(format=fmt, dtype=dtype,
                           entry=SimpleNamespace(ggml_types={"w": 2} if blocks else {}))


def test_int4_in_the_bf16_kernel_is_held_to_bf16s_rounding(monkeypatch):
    """An fp32 stack whose int4 products take and give bf16 activations differs from its
    eager layers by bf16 roundings: it is held to bf16's tolerance, not fp32's."""
    bf16, fp32 = compiled.TOLERANCE[torch.bfloat16], compiled.TOLERANCE[torch.float32]
    use_int4_kernel(monkeypatch, "int4pack-bf16")
    assert compiled.tolerance(_stack("int4", torch.float32)) == bf16  # quantised at load
    assert compiled.tolerance(_stack("int4", torch.float32, blocks=True)) == bf16
    use_int4_kernel(monkeypatch, "int4pack-fp32")
    assert compiled.tolerance(_stack("int4", torch.float32, blocks=True)) == fp32  # exact path
    assert compiled.tolerance(_stack("fp32", torch.float32)) == fp32
    assert compiled.tolerance(_stack("bf16", torch.bfloat16)) == bf16
