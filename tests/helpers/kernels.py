"""Choosing the int4 path a test runs in (`quant.INT4_KERNEL`, normally probed once)."""

from __future__ import annotations

import pytest

from hearthnet.distributed_inference.engine import q4vnni, quant


def use_int4_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Run int4 from Q4 blocks in `name` (a key of `quant.INT4_KERNELS`) for this test;
    skips with the reason where `int4-vnni` is asked for and this machine lacks it."""
    if name == q4vnni.KERNEL and not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    # both chosen first: monkeypatch reads the old values through the module's lazy
    # `__getattr__`, which would otherwise choose the dtype from the patched kernel and
    # have it "restored" for every later test
    quant.int4_kernel_name(), quant.int4_blocks_dtype()
    monkeypatch.setattr(quant, "INT4_KERNEL", name, raising=False)
    monkeypatch.setattr(quant, "INT4_BLOCKS_DTYPE", quant.INT4_KERNELS[name], raising=False)
