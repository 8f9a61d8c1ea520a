"""Products in AMX tiles (`q4vnni`'s AMX path): the VNNI path's results bit for bit, for
every row count, 8-bit values with both scale layouts and 4-bit values with and without
offsets, and the setting that turns it on or off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hearthnet.distributed_inference.engine import q4vnni, quant
from hearthnet.errors import ConfigError


def _amx_here() -> str:
    """Why the AMX path cannot run in this process ("" when it can)."""
    if not q4vnni.available():
        return q4vnni.unavailable_reason()
    was = bool(torch.ops.hearthnet.use_amx(True))
    if not was:
        return "no AMX-INT8 on this CPU (or Linux does not allow its tiles)"
    return ""


@pytest.fixture
def amx_toggle() -> Iterator[None]:
    """Run a test that switches the process's AMX path; put back what was chosen."""
    why = _amx_here()
    if why:
        pytest.skip(why)
    state = q4vnni._amx.get("state", "")
    yield
    torch.ops.hearthnet.use_amx(state.startswith("on"))


def _both(product: Any, *args: Any) -> tuple[torch.Tensor, ...]:
    torch.ops.hearthnet.use_amx(False)
    vnni = product(*args)
    assert torch.ops.hearthnet.use_amx(True)
    return vnni, product(*args)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 40])
def test_the_amx_path_gives_the_vnni_products_bit_for_bit(rows, amx_toggle):
    g = torch.Generator().manual_seed(rows)
    n, k = 48, 32 * 7  # three tiles; an odd number of groups (the pipeline's last one)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.01, 30, k)  # spread groups
    # int8 per output channel (one fp32 scale per row) and Q8_0 blocks (fp16 per group)
    per_row = q4vnni.pack8_rows(q, torch.rand(n, generator=g) * 1e-2 + 1e-3)
    per_group = q4vnni.pack8(q, (torch.rand(n, k // 32, generator=g) * 1e-2).half())
    for w, s in (per_row, per_group):
        vnni, amx = _both(q4vnni.mm8, x, w, s)
        assert torch.equal(vnni, amx)
        ref = x @ (q.float() * _scales(s, n, k)).T
        assert float((amx - ref).abs().max() / ref.abs().max()) < 1e-4


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 20])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q4_k"])
def test_4bit_products_in_tiles_are_the_vnni_products(rows, kind, amx_toggle):
    """Q4_0 ((q − 8)·d), Q4_1 (q·d + m, fp16) and Q4_K (fp32 d·sc and offsets) blocks."""
    g = torch.Generator().manual_seed(rows)
    n, k = 32, 32 * 5
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    dtype = torch.float32 if kind == "q4_k" else torch.float16
    scale = (torch.rand(n, k // 32, generator=g) * 1e-2).to(dtype)
    offset = None if kind == "q4_0" else (torch.randn(n, k // 32, generator=g) * 1e-2).to(dtype)
    w, s, o = q4vnni.pack(q, scale, offset)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.01, 30, k)
    vnni, amx = _both(q4vnni.mm, x, w, s, o)
    assert torch.equal(vnni, amx)


def _scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """`pack8`/`pack8_rows` scales (tiles, groups or 1, 16) as (n, k) per weight."""
    per = s.float().permute(0, 2, 1).reshape(n, -1)
    return per.repeat_interleave(k // per.shape[1], dim=1)


def test_a_round_of_rows_is_each_row_alone(amx_toggle):
    """A row's result does not depend on the rows beside it (the batch-invariance rounds
    and speculative passes rely on), with AMX on."""
    g = torch.Generator().manual_seed(5)
    w, s = q4vnni.pack8_rows(torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g),
                             torch.rand(32, generator=g) * 1e-2)
    x = torch.randn(11, 256, generator=g)
    assert torch.ops.hearthnet.use_amx(True)
    together = q4vnni.mm8(x, w, s)
    for i in range(11):
        assert torch.equal(q4vnni.mm8(x[i:i + 1].contiguous(), w, s), together[i:i + 1])


def test_the_amx_setting_is_checked_and_chosen_once(monkeypatch, amx_toggle):
    with pytest.raises(ConfigError, match="HEARTHNET_AMX='sometimes': use one of"):
        q4vnni.amx_setting("sometimes")
    monkeypatch.setenv(q4vnni.AMX_ENV, " OFF ")
    assert q4vnni.amx_setting() == "off"
    with pytest.raises(ConfigError, match="HEARTHNET_AMX"):
        monkeypatch.setenv(q4vnni.AMX_ENV, "yes")
        quant.kernel_settings()  # a node's start refuses it in one line
    q4vnni._choose_amx("off")
    assert q4vnni.amx_state() == "off: HEARTHNET_AMX=off"
    assert not torch.ops.hearthnet.use_amx(False)
    q4vnni._choose_amx("on")
    assert q4vnni.amx_state() == "on: HEARTHNET_AMX=on"
    # auto: a probe of 8 rows with the path off and on, alternated; kept unless clearly slower
    monkeypatch.setattr(q4vnni, "_amx_probe_ms", lambda: {"vnni": 1.0, "amx": 1.5})
    q4vnni._choose_amx("auto")
    assert q4vnni.amx_state().startswith("off: 8 rows × 1024 × 1024 in 1.500 ms against 1.000")
    monkeypatch.setattr(q4vnni, "_amx_probe_ms", lambda: {"vnni": 1.0, "amx": 1.05})
    q4vnni._choose_amx("auto")
    assert q4vnni.amx_state().startswith("on: ")


def test_without_amx_the_setting_leaves_the_vnni_path(monkeypatch):
    """Where the CPU, Linux or the compiler has no AMX, every setting runs VNNI and says why."""
    if not q4vnni.available():
        pytest.skip(q4vnni.unavailable_reason())
    if not _amx_here():
        pytest.skip("this CPU has AMX-INT8: the path is shown by the tests above")
    for setting in ("auto", "on"):
        q4vnni._choose_amx(setting)
        assert q4vnni.amx_state().startswith("off: the CPU or the kernel has no AMX-INT8")
