"""Memory truth (issue 12 §4): the advertised need is the real one; over budget is refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.memory import plan_shard
from hearthnet.distributed_inference.shard.server import ShardServer, ShardSettings
from hearthnet.errors import ShardUnavailable
from hearthnet.models import ModelStore
from hearthnet.models.importer import import_folder
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("mem")
    store = ModelStore(root / "store")
    # qwen2: qkv biases and sliding-window layers (their cache is capped at the window)
    return {f: import_folder(store, make_tiny_model(f, root / f, smollm2.path, layers=4),
                             alias=f) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_planned_weights_equal_loaded_weights(tiny, family, fmt):
    entry = tiny[family]
    plan = plan_shard(entry, 1, 3, fmt, sessions=1, tokens=10)
    assert plan.weights_bytes == LayeredStack(entry, 1, 3, fmt).param_bytes()


def test_kv_cache_is_measured_not_guessed(tiny):
    entry = tiny["qwen2"]  # sliding window 4 on layers 2.. (max_window_layers = 2)
    stack = LayeredStack(entry, 0, 3, "fp32")
    s = stack.open_session(0, 3, 64)
    import torch

    s.forward(torch.randn(1, 12, stack.hidden_size), 0)
    real = sum(t.numel() * t.element_size() for t in s.slot.keys + s.slot.values)
    assert plan_shard(entry, 0, 3, "fp32", sessions=1, tokens=64).kv_bytes == real
    plan = plan_shard(entry, 0, 3, "fp32", sessions=8, tokens=64)
    assert plan.kv_bytes == 8 * real


def test_a_hosts_report_is_its_loaded_weights_and_allocated_slots(tiny):
    """Issue 34: what `bench pipeline` holds a shard's peak RSS against."""
    from types import SimpleNamespace

    from hearthnet.distributed_inference.engine.memory import process_memory

    stack = LayeredStack(tiny["llama"], 0, 3, "int8")
    before = process_memory([])
    s = stack.open_session(0, 3, 300)  # a slot of 512 positions: allocated, not written
    try:
        m = process_memory([SimpleNamespace(stack=stack)])
        assert m["weights_bytes"] == stack.param_bytes()
        assert m["kv_bytes"] - before["kv_bytes"] == s.cache_bytes == plan_shard(
            tiny["llama"], 0, 3, "int8", sessions=1, tokens=300).kv_bytes
        assert m["kv_peak_bytes"] >= m["kv_bytes"]
        assert 0 < m["runtime_baseline_bytes"] <= m["peak_rss_bytes"]  # planned above
    finally:
        s.close()
        stack.drop_idle()
    assert process_memory([])["kv_bytes"] == before["kv_bytes"]


def test_shard_over_budget_is_refused_at_start_naming_the_numbers(smollm2):
    kw = dict(node_id="node-b", endpoint="ws://127.0.0.1:1", executor=ThreadPoolExecutor(1))
    ok = ShardServer(smollm2, 0, 14, settings=ShardSettings(weights="int8", max_vram_mb=4000),
                     **kw)
    assert ok.stack is None  # nothing loaded yet: the plan comes from headers and config
    d = ok.descriptor
    assert d.weights_format == "int8" and d.vram_required_mb == ok.memory.total_mb
    with pytest.raises(ShardUnavailable) as ei:
        ShardServer(smollm2, 0, 14, settings=ShardSettings(weights="fp32", max_vram_mb=500),
                    **kw)
    msg = ei.value.message
    fp32 = plan_shard(smollm2, 0, 14, "fp32", 8, 8192)
    assert f"needs {fp32.total_mb} MB" in msg and "as fp32" in msg
    assert "shard_max_vram_mb is 500" in msg and 'weights = "int8"' in msg
    assert "8 sessions × 8192 tokens" in msg
