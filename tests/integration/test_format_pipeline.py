"""Weight formats through the orchestrator: the real SmolLM2.

Distributed output is token-identical to a local engine holding the same formats; the
`done` frame and the stages' `shard_status` name every stage's format and the head's and
say whether all were lossless; a call's `weights` decides which shards it may use, and by
default only formats that keep the stored weights serve it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.quant import INT8_KERNEL
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.errors import BadRequest
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh

PROMPT = [{"role": "user", "content": "Name three colours."}]
N = 8


def _orch(mesh: InProcessMesh, model_store, own: str) -> PipelineOrchestrator:
    return PipelineOrchestrator(models=model_store, router=mesh.router(), health=mesh.health,
                                metrics=Metrics(), connect=mesh.connect,
                                executor=ThreadPoolExecutor(1), local_weights=own)


async def _run(orch, **kw) -> list[dict]:
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=N), wire_dtype="fp32",
                                   **kw)
    return [f.to_wire() async for f in orch.chat(ChatRequest("smollm2", PROMPT), params)]


def _tokens(frames):
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
async def test_distributed_equals_local_with_the_same_formats(smollm2, model_store, fmt):
    local = LocalEngine(smollm2, fmt)
    want = [e.token_id for e in local.generate(PROMPT, SamplingParams(max_tokens=N))]
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14, fmt)
    mesh.add("node-c", 15, 29, fmt)
    frames = await _run(_orch(mesh, model_store, fmt), weights=fmt)
    assert _tokens(frames) == want
    done = frames[-1]
    # the bundled store is bf16: bf16 keeps its weights, int8 does not
    assert done["type"] == "done" and done["formats"] == {
        "head": fmt, "stages": [fmt, fmt], "wire": ["fp32", "fp32"], "policy": fmt,
        "lossless": fmt == "bf16"}
    assert [(f["weights_format"], f.get("kernel")) for f in frames
            if f["type"] == "shard_status"] == [(fmt, INT8_KERNEL if fmt == "int8" else None)] * 2
    assert {v["weights_format"] for v in done["timings"]["per_shard"].values()} == {fmt}
    assert {v["kernel"] for v in done["timings"]["per_shard"].values()} == {
        INT8_KERNEL if fmt == "int8" else ""}  # what int8 runs in here; bf16 names none


async def test_call_weights_param_filters_shards(smollm2, model_store):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 29, "int8")
    orch = _orch(mesh, model_store, "fp32")
    # the default (lossless) never uses the int8 shard: int8 rounds every stored weight
    frames = await _run(orch, fallback_to_local=False)
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "shard_unavailable"
    assert "holds int8 weights; the call accepts bf16, fp32" in frames[-1]["message"]
    # asked for (at least int8): it serves, and the answer says it was lossy
    frames = await _run(orch, fallback_to_local=False, weights="int8")
    assert frames[-1]["type"] == "done"
    assert frames[-1]["formats"] == {"head": "fp32", "stages": ["int8"], "wire": ["fp32"],
                                     "policy": "int8", "lossless": False}
    # exact: only the orchestrator's own format (fp32) — none is there
    frames = await _run(orch, fallback_to_local=False, weights="exact")
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "shard_unavailable"
    assert "holds int8 weights; the call accepts fp32" in frames[-1]["message"]
    # with fallback the local engine answers, in the orchestrator's own format
    frames = await _run(orch, weights="bf16")
    assert frames[-1]["fallback"] and frames[-1]["formats"] == {
        "head": "fp32", "stages": ["fp32"], "wire": [], "lossless": True}
    with pytest.raises(BadRequest, match="weights must be"):
        DistributedChatParams.from_dict({"weights": "q4"}, DistributedChatParams())


async def test_the_accept_not_the_advertisement_decides_and_is_reported(smollm2, model_store):
    """A host restarted with int8 while its fp32 advertisement lived on (its gossip link
    was down): its ACCEPT says int8, so an exact call never runs on it — another shard
    serves, or the call fails over — and a call that takes int8 reports int8."""
    mesh = InProcessMesh(smollm2)
    stale = mesh.add("node-b", 0, 29, "fp32")
    stale.held_format = "int8"
    orch = _orch(mesh, model_store, "fp32")
    frames = await _run(orch, fallback_to_local=False, weights="exact")
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "shard_unavailable"
    assert "holds int8 weights now (advertised fp32)" in frames[-1]["message"]
    assert not _tokens(frames)
    # the router remembers what the shard said until it advertises anew: no second open
    opened = stale.opened
    frames = await _run(orch, fallback_to_local=False, weights="exact")
    assert "holds int8 weights; the call accepts fp32" in frames[-1]["message"]
    assert stale.opened == opened
    # an honest fp32 host is picked instead, and named
    mesh.add("node-c", 0, 29, "fp32")
    frames = await _run(orch, fallback_to_local=False, weights="exact")
    assert frames[-1]["type"] == "done"
    assert [p.rsplit("@")[-1] for p in frames[-1]["pipeline"]] == ["node-c"]
    # a call that accepts int8 may use the restarted host, and says int8, not fp32
    frames = await _run(orch, fallback_to_local=False, weights="int8")
    stages = [f for f in frames if f["type"] == "shard_status"]
    done = frames[-1]
    for st, fmt in zip(stages, done["formats"]["stages"], strict=True):
        want = "int8" if st["shard_id"].endswith("node-b") else "fp32"
        assert st["weights_format"] == fmt == want
        assert done["timings"]["per_shard"][st["shard_id"]]["weights_format"] == want
    # and the metrics count what served the stages, not what was advertised
    counted = orch.metrics.stage_formats_total
    assert counted.labels("int8", "false")._value.get() == \
        sum(st["weights_format"] == "int8" for st in stages)
    assert counted.labels("fp32", "true")._value.get() >= 1  # node-c's, in the exact call
