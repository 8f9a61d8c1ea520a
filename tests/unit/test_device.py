"""Devices, the memory budget and the preallocated KV cache on the CPU (issue 13 §1-§5).

The same code paths run on CUDA in tests/cuda/ (skipped without a GPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hearthnet.config import HostSection, ShardSection
from hearthnet.distributed_inference.directory.descriptors import ShardDescriptor
from hearthnet.distributed_inference.engine import device as dev
from hearthnet.distributed_inference.engine.device import Staging, resolve_device
from hearthnet.errors import BadRequest, ConfigError

# ---- device selection (§1) ----


def test_auto_picks_cuda_then_mps_then_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_mps_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(dev, "_mps_available", lambda: True)
    assert resolve_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")


def test_absent_or_malformed_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dev, "_mps_available", lambda: False)
    for spec, msg in (("cuda", "no CUDA GPU"), ("cuda:1", "no CUDA GPU"),
                      ("mps", "no usable Apple MPS"), ("gpu", "not one of"),
                      ("cuda:x", "not one of")):
        with pytest.raises(ConfigError, match=msg):
            resolve_device(spec)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="only 1 CUDA"):
        resolve_device("cuda:3")


def test_config_accepts_devices_and_refuses_others():
    assert HostSection(device="cuda:1").device == "cuda:1"
    assert HostSection().device == "auto" and HostSection().cuda_graphs is True
    assert ShardSection(model="m", layers=(0, 1), device="cpu").device == "cpu"
    for bad in ("gpu", "cuda:", "CUDA", "cuda:1:2"):
        with pytest.raises(ValidationError):
            HostSection(device=bad)


def test_descriptor_carries_the_device():
    kw: dict[str, Any] = dict(model_id="m", weights_sha256="a" * 64, layer_range=(0, 3),
                              host="n1", endpoint="ws://h:1", max_concurrent_streams=2)
    d = ShardDescriptor.create(**kw, device="cuda", device_name="NVIDIA H100 80GB HBM3",
                               device_memory_mb=81559, vram_required_mb=3000)
    back = ShardDescriptor.from_dict(d.to_dict())
    assert (back.device, back.device_name, back.device_memory_mb) == \
        ("cuda", "NVIDIA H100 80GB HBM3", 81559)
    old = d.to_dict()
    for k in ("device", "device_name", "device_memory_mb"):
        old.pop(k)
    assert ShardDescriptor.from_dict(old).device == "cpu"  # peers of an older release
    with pytest.raises(BadRequest, match="device"):
        ShardDescriptor.create(**kw, device="tpu")
    from hearthnet.commands.status import render

    row = {"shard_id": d.shard_id, "layers": [0, 3], "host": "n1", "suspect": False,
           "active_sessions": 0, "queue_depth": 0, "p95_latency_ms": 0.0, "age_s": 1.0,
           **{k: getattr(d, k) for k in ("device", "device_name", "device_memory_mb",
                                          "vram_required_mb")}}
    text = render({"node_id": "n1", "endpoint": "ws://h:1", "shards": [row], "models": []})
    assert "cuda NVIDIA H100 80GB HBM3 (81559 MiB; shard 3000 MiB)" in text


def test_staging_on_the_cpu_casts_only():
    s = Staging(torch.device("cpu"))
    x = torch.randn(1, 3, 8)
    assert s.to_device(x, torch.float32) is x
    y = s.to_host(x, torch.float16)
    assert y.dtype == torch.float16 and torch.equal(y, x.half())


# ---- the preallocated cache (§3) ----


# ---- the memory budget (§2) ----
