"""Choosing the int4 path a test runs in (`quant.INT4_KERNEL`, normally probed once)."""

from __future__ import annotations

import pytest

from hearthnet.distributed_inference.engine import q4vnni, quant


def use_int4_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Run int4 from Q4 blocks in `name` (a key of `quant.INT4_KERNELS`) for this test;
    skips with the reason where `int4-vnni` is asked for and this machine lacks it."""
    if name == q4vnni.KERNEL and not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    monkeypatch.setattr(quant, "INT4_KERNEL", name, raising=False)
    monkeypatch.setattr(quant, "INT4_BLOCKS_DTYPE", quant.INT4_KERNELS[name], raising=False)
