"""The plan's timings of real decoder layers (`placement.planner`): a window bigger than
the CPU's cache, and the batched rate of eight rows against one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hearthnet.distributed_inference.placement import planner
from hearthnet.models.importer import import_folder
from hearthnet.models.store import ModelStore
from tests.helpers.tiny_models import make_tiny_model


def test_the_last_level_cache_is_the_biggest_sysfs_says(tmp_path: Path) -> None:
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "260M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert planner.last_level_cache_bytes(tmp_path) == 260 * 2**20
    assert planner.last_level_cache_bytes(tmp_path / "absent") == 64 * 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2):
    root = tmp_path_factory.mktemp("timing")
    src = make_tiny_model("llama", root / "src", smollm2.path, layers=6)
    return import_folder(ModelStore(root / "store"), src, alias="tl")


def test_the_timed_window_outgrows_the_cache_within_the_held_layers(
        tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    stack, *_ = planner.timed_window(tiny, "fp32", 1)
    per = stack.param_bytes()
    monkeypatch.setattr(planner, "last_level_cache_bytes", lambda: per)  # 2 layers' worth
    assert planner.timed_window(tiny, "fp32", None)[1:] == (0, 1)
    monkeypatch.setattr(planner, "last_level_cache_bytes", lambda: 100 * per)
    assert planner.timed_window(tiny, "fp32", None)[1:] == (0, 5)  # all it holds


def test_speed_and_batch_factor_are_measured_on_real_steps(tiny) -> None:
    speed = planner.measure_layer_speed(tiny, "fp32", layers=2, steps=8, threads=1)
    factor = planner.measure_batch_factor(tiny, "fp32", rows=4, layers=2, steps=4, threads=1)
    # timings only (how fast is this machine's noise to judge; the benchmarks print them)
    assert math.isfinite(speed) and speed > 0 and math.isfinite(factor) and factor > 0
