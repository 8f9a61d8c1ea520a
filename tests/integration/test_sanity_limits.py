"""The limit of the sanity checks, documented by test (M26 §5.8, issue 6).

`SanityChecker` catches NaN/Inf and activations far outside the calibrated norms. It cannot
catch a shard that returns a *different but plausible* hidden state: here a shard permutes
the hidden dimensions of its real output, which keeps every per-position norm exactly, so
every check passes — and the answer silently changes. Catching that would need shadow
inference (M26 §10); these tests pin down that the orchestrator does not claim to.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.distributed_inference.engine.local import LocalEngine
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.distributed_inference.orchestrator.sanity import SanityChecker, calibrate
from hearthnet.errors import ShardCorrupted
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh
from tests.helpers.marks import IN_MAKE_BENCH

PROMPT = [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}]
N = 24


@pytest.fixture(scope="module")
def local_tokens(smollm2) -> list[int]:
    eng = LocalEngine(smollm2)
    return [ev.token_id for ev in eng.generate(PROMPT, SamplingParams(max_tokens=N))]


def _permute(hidden_size: int):
    perm = torch.randperm(hidden_size, generator=torch.Generator().manual_seed(6))

    def f(t: torch.Tensor) -> torch.Tensor:  # (1, T, H): same per-position norms
        return t[..., perm].contiguous()

    return f


@torch.inference_mode()
def test_permuted_hidden_state_passes_every_check(smollm2):
    checker = SanityChecker(calibrate(smollm2.path).bounds)
    head = LayeredHead(smollm2)
    stack = LayeredStack(smollm2, 0, smollm2.num_layers - 1)
    ids = head.chat_prompt_ids([{"role": "user", "content": "Name three rivers in Europe."}])
    s = stack.open_session(0, smollm2.num_layers - 1, len(ids))
    h = s.forward(head.embed(ids), 0)  # (1, T, H) after the last layer
    s.close()
    end = smollm2.num_layers - 1
    forged = _permute(h.shape[-1])(h)
    assert not torch.equal(forged, h)
    assert torch.allclose(forged.norm(dim=-1), h.norm(dim=-1))
    checker.check("liar", end, forged)  # passes: the limit
    with pytest.raises(ShardCorrupted) as ei:  # what the checks do catch
        checker.check("loud", end, h * 1000.0)
    assert ei.value.code == "shard_corrupted"
    with pytest.raises(ShardCorrupted):
        checker.check("nan", end, h * float("nan"))


@IN_MAKE_BENCH  # a limit shown, not a behaviour kept: a minute of `make test` on 2 cores
async def test_plausible_garbage_is_not_detected_and_changes_the_answer(
        smollm2, model_store, local_tokens):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    liar = mesh.add("node-c", 15, 29)
    liar.transform = _permute(liar.stack.hidden_size)
    metrics = Metrics()
    orch = PipelineOrchestrator(models=model_store, router=mesh.router(), health=mesh.health,
                                metrics=metrics, connect=mesh.connect,
                                executor=ThreadPoolExecutor(1))
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=N), wire_dtype="fp32")
    frames = [f.to_wire() async for f in orch.chat(ChatRequest("smollm2", PROMPT), params)]
    # the orchestrator saw nothing wrong ...
    assert frames[-1]["type"] == "done" and frames[-1]["failovers"] == 0
    assert not [f for f in frames if f["type"] == "shard_status" and f["status"] != "ok"]
    assert not [f for f in frames if f["type"] in ("shard_failover", "pipeline_aborted")]
    sid = liar.descriptor.shard_id
    assert metrics.shard_corruption_detected_total.labels(sid)._value.get() == 0
    assert liar.steps > 0
    # ... yet the answer is not the model's answer
    tokens = [f["token_id"] for f in frames if f["type"] == "token_delta"]
    assert tokens and tokens != local_tokens
