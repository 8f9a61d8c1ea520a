"""PipelineOrchestrator over an in-process transport: exactness, failover, fallback."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.distributed_inference.orchestrator.pipeline import PipelineOrchestrator
from hearthnet.distributed_inference.orchestrator.request import ChatRequest, DistributedChatParams
from hearthnet.observability import Metrics
from tests.helpers.inprocess import InProcessMesh

PROMPT = [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def local_tokens(local_answer):
    return local_answer(PROMPT[0]["content"], 24)


async def _chosen(mesh: InProcessMesh, smollm2, layer: int):
    """The host the router would use for `layer` (routing is deterministic)."""
    r = mesh.router()
    p = await r.pick(smollm2.model_id, smollm2.weights_sha256, 30, reserve=False)
    sid = next(s.shard.shard_id for s in p.stages if s.start <= layer <= s.end)
    return next(h for h in mesh.hosts.values() if h.descriptor.shard_id == sid)


def _orch(mesh: InProcessMesh, model_store, **kw) -> tuple[PipelineOrchestrator, Metrics]:
    m = Metrics()
    return PipelineOrchestrator(models=model_store, router=mesh.router(), health=mesh.health,
                                metrics=m, connect=mesh.connect,
                                executor=ThreadPoolExecutor(1), **kw), m


async def _run(orch, prompt=PROMPT, **kw) -> list[dict]:
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=24), wire_dtype="fp32",
                                   **kw)
    return [f.to_wire() async for f in orch.chat(ChatRequest("smollm2", prompt), params)]


def _tokens(frames):
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


async def test_two_shards_identical_to_local(smollm2, model_store, local_tokens):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    orch, _ = _orch(mesh, model_store)
    frames = await _run(orch)
    assert _tokens(frames) == local_tokens
    done = frames[-1]
    assert done["type"] == "done" and len(done["pipeline"]) == 2


async def test_failover_to_spare_keeps_every_token(smollm2, model_store, local_tokens):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 10, 29)  # spare overlapping C
    c = await _chosen(mesh, smollm2, 29)
    c.fail_after_steps = 8
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch)
    kinds = [f["type"] for f in frames]
    assert "shard_failover" in kinds and "pipeline_aborted" not in kinds
    assert _tokens(frames) == local_tokens
    assert m.failovers_total._value.get() == 1
    degraded = next(f for f in frames if f["type"] == "shard_status" and
                    f["status"] == "degraded")
    assert degraded["shard_id"] == c.descriptor.shard_id


async def test_fallback_to_local_continues_the_same_answer(smollm2, model_store, local_tokens):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    c = mesh.add("node-c", 15, 29)
    c.fail_after_steps = 6
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch)
    ab = next(f for f in frames if f["type"] == "pipeline_aborted")
    assert ab["continuing"] == "local" and ab["tokens_so_far"] > 0
    assert _tokens(frames) == local_tokens
    assert m.fallback_to_local_total._value.get() == 1


async def test_no_fallback_past_the_budget_ends_with_why(smollm2, model_store, local_tokens):
    """A node whose budget cannot hold the whole model does not load it to continue (the
    household's model is one no machine holds): the answer ends with an error that says
    why, after every token it gave."""
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    c = mesh.add("node-c", 15, 29)
    c.fail_after_steps = 6
    orch, m = _orch(mesh, model_store, local_budget_mb=100)  # SmolLM2's layers: 405 MB fp32
    frames = await _run(orch)
    ab, err = frames[-2], frames[-1]
    assert ab["type"] == "pipeline_aborted" and ab["continuing"] is None
    assert err["type"] == "error" and err["code"] == "shard_unavailable"
    assert "over this node's budget of 100 MiB" in err["message"]
    got = _tokens(frames)
    assert 0 < len(got) < len(local_tokens) and got == local_tokens[:len(got)]
    assert m.fallback_to_local_total._value.get() == 0 and not orch._locals


def test_a_partial_model_never_continues_alone(smollm2, model_store):
    import dataclasses

    orch, _ = _orch(InProcessMesh(smollm2), model_store)
    part = dataclasses.replace(smollm2, holds={"layers": [[0, 14]], "head": True})
    assert "holds only layers [(0, 14)]" in orch._why_not_local(part)
    assert orch._why_not_local(smollm2) is None  # no budget given: the whole model loads


async def test_no_spare_no_fallback_aborts(smollm2, model_store):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    c = mesh.add("node-c", 15, 29)
    c.fail_after_steps = 4
    orch, _ = _orch(mesh, model_store)
    frames = await _run(orch, fallback_to_local=False)
    assert frames[-2]["type"] == "pipeline_aborted"
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "shard_unavailable"


async def _with_spare(smollm2):
    """B holds 0-14; C and D both hold 15-29: returns the mesh, whichever of C and D the
    router chose, and the other (its spare)."""
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 15, 29)
    chosen = await _chosen(mesh, smollm2, 29)
    spare = next(h for h in mesh.hosts.values()
                 if h.node_id in ("node-c", "node-d") and h is not chosen)
    return mesh, chosen, spare


async def test_nan_output_is_corruption_and_fails_over(smollm2, model_store, local_tokens):
    mesh, c, _ = await _with_spare(smollm2)
    calls = {"n": 0}

    def poison(t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return t * float("nan") if calls["n"] > 3 else t

    c.transform = poison
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch)
    deg = [f for f in frames if f["type"] == "shard_status" and f["status"] == "degraded"]
    assert deg and deg[0]["code"] == "shard_corrupted"
    assert _tokens(frames) == local_tokens
    assert m.shard_corruption_detected_total.labels(c.descriptor.shard_id)._value.get() == 1


async def test_two_failures_fall_back(smollm2, model_store, local_tokens):
    mesh, c, d = await _with_spare(smollm2)
    c.fail_after_steps = 5
    d.fail_after_steps = 3
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch)
    assert _tokens(frames) == local_tokens
    assert [f["type"] for f in frames].count("shard_failover") == 1
    assert m.fallback_to_local_total._value.get() == 1


async def test_abandoned_call_closes_every_session(smollm2, model_store):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    orch, _ = _orch(mesh, model_store)
    params = DistributedChatParams(sampling=SamplingParams(max_tokens=24))
    agen = orch.chat(ChatRequest("smollm2", PROMPT), params)
    n = 0
    async for f in agen:
        n += f.to_wire()["type"] == "token_delta"
        if n == 3:
            break
    await agen.aclose()  # the caller walks away mid-answer
    assert len(mesh.channels) == 2 and all(c.closed for c in mesh.channels)
    assert all(orch.router.in_use(h.descriptor.shard_id) == 0 for h in mesh.hosts.values())


async def test_disabled_and_unknown_model(smollm2, model_store):
    from hearthnet.errors import ExperimentalDisabled, ModelNotFound

    orch, _ = _orch(InProcessMesh(smollm2), model_store)
    with pytest.raises(ModelNotFound) as ei:
        [f async for f in orch.chat(ChatRequest("nope", PROMPT), DistributedChatParams())]
    assert ei.value.code == "bad_request"
    orch.enabled = False
    with pytest.raises(ExperimentalDisabled):
        [f async for f in orch.chat(ChatRequest("smollm2", PROMPT), DistributedChatParams())]


async def test_refused_open_repicks_instead_of_queuing(smollm2, model_store, local_answer):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 15, 29)
    busy = await _chosen(mesh, smollm2, 29)
    busy.refuse_opens = True  # at max_concurrent_streams: refuses at once (M26 §5.6)
    orch, _ = _orch(mesh, model_store)
    frames = await _run(orch)
    assert _tokens(frames) == local_answer(PROMPT[0]["content"], 24)
    assert busy.descriptor.shard_id not in frames[-1]["pipeline"]
    assert not mesh.health.is_suspect(busy.descriptor.shard_id)  # busy, not broken
    assert sum(1 for c in mesh.channels if not c.closed) == 0


async def test_a_busy_replacement_is_waited_for_then_passed_over(smollm2, model_store,
                                                                  local_tokens):
    """C fails mid-answer; its only spare D stays at max_concurrent_streams. D is busy, not
    broken: it is not suspected and not counted as the call's second failure; the call
    waits for a slot up to its timeout_s, then goes on on the local engine (no other
    replacement) without a lost token, and says why."""
    mesh, c, d = await _with_spare(smollm2)
    c.fail_after_steps = 6
    d.refuse_opens = True
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch, fallback_after_failures=3, timeout_s=0.5)
    assert _tokens(frames) == local_tokens and frames[-1]["type"] == "done"
    aborted = next(f for f in frames if f["type"] == "pipeline_aborted")
    assert "no busy replacement freed a slot within 0.5 s" in aborted["reason"]
    assert d.opened == 0  # asked again after each wait, refused every time
    degraded = [f["shard_id"] for f in frames if f["type"] == "shard_status"
                and f["status"] == "degraded"]
    assert degraded == [c.descriptor.shard_id]  # C alone failed
    assert mesh.health.is_suspect(c.descriptor.shard_id)
    assert not mesh.health.is_suspect(d.descriptor.shard_id)  # busy, not broken
    assert m.fallback_to_local_total._value.get() == 1


async def test_a_spare_refusing_as_busy_is_waited_for_and_takes_over(smollm2, model_store,
                                                                     local_tokens):
    """C fails mid-answer; its only spare D refuses the first two opens as busy, then a
    slot frees up: the call waits for it and finishes through D — no fallback, every
    token kept, D never suspected."""
    mesh, c, d = await _with_spare(smollm2)
    c.fail_after_steps = 6
    d.busy_opens = 2
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch)
    assert _tokens(frames) == local_tokens and frames[-1]["type"] == "done"
    assert "pipeline_aborted" not in [f["type"] for f in frames]
    assert d.descriptor.shard_id in frames[-1]["pipeline"] and d.opened == 1
    assert d.busy_opens == 0  # both busy refusals were met before it opened
    assert not mesh.health.is_suspect(d.descriptor.shard_id)
    assert m.failovers_total._value.get() == 1 and m.fallback_to_local_total._value.get() == 0


async def test_a_replacement_full_of_our_own_calls_is_waited_for(smollm2, model_store,
                                                                 local_tokens):
    """The only spare D (one stream) is taken by another call of this node when C fails:
    the router sees D full; the failing call waits, and takes D as soon as the other call
    releases it (not after a back-off, not on the local engine)."""
    import asyncio

    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    c = mesh.add("node-c", 15, 29)
    d = mesh.add("node-d", 15, 29, max_streams=1)
    orch, m = _orch(mesh, model_store)
    other = await orch.router.pick(smollm2.model_id, smollm2.weights_sha256, 30,
                                   exclude={c.descriptor.shard_id})
    assert d.descriptor.shard_id in other.shard_ids  # the other call holds D's one slot
    c.fail_after_steps = 6

    async def other_call_ends() -> None:
        while not c.dead:  # until C has failed and the call is waiting for D
            await asyncio.sleep(0.01)
        orch.router.release(other)

    ender = asyncio.create_task(other_call_ends())
    frames = await _run(orch, timeout_s=60)
    await ender
    assert _tokens(frames) == local_tokens and frames[-1]["type"] == "done"
    assert d.descriptor.shard_id in frames[-1]["pipeline"]
    failover = next(f for f in frames if f["type"] == "shard_failover")
    assert failover["ms"] < 30_000  # woken by the release, far inside timeout_s
    assert m.fallback_to_local_total._value.get() == 0


# ---- a long prompt flows through the stages (M26 §5.3) ----

LONG = ("The keeper climbed the stairs at dusk, trimmed the wick and wrote the weather in "
        "the log, as every keeper had for a hundred years. " * 12) + "What happened next?"


async def test_a_long_prompt_flows_through_the_stages(smollm2, model_store, local_answer):
    """Chunk i+1 enters stage 0 before stage 1 is done with chunk i: both stages work at
    once on one prompt, and the answer is the local engine's."""
    mesh = InProcessMesh(smollm2)
    trace: list[tuple[str, int]] = []
    for node, lo, hi in (("node-b", 0, 14), ("node-c", 15, 29)):
        mesh.add(node, lo, hi).trace = trace
    orch, _ = _orch(mesh, model_store, prefill_chunk_tokens=32)
    frames = await _run(orch, [{"role": "user", "content": LONG}], speculate="off")
    assert _tokens(frames) == local_answer(LONG, 24)
    n_prompt = frames[-1]["usage"]["prompt_tokens"]
    prefill = [(n, p) for n, p in trace if p < n_prompt]  # decode steps start at n_prompt
    last_b = max(i for i, (n, _) in enumerate(prefill) if n == "node-b")
    assert sum(n == "node-b" for n, _ in prefill) > 6
    assert prefill.index(("node-c", 0)) < last_b


async def test_a_stage_failing_mid_prefill_fails_over(smollm2, model_store, local_answer):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 10, 29)
    c = await _chosen(mesh, smollm2, 29)
    c.fail_after_steps = 3  # three chunks of the prompt, then gone
    orch, m = _orch(mesh, model_store, prefill_chunk_tokens=32)
    frames = await _run(orch, [{"role": "user", "content": LONG}])
    assert [f["type"] for f in frames].count("shard_failover") == 1
    assert _tokens(frames) == local_answer(LONG, 24)
    assert m.failovers_total._value.get() == 1


EDIT = ("Repeat this sentence exactly: the cat sat on the mat and the dog lay by the door, "
        "and the bird sang in the tree.")


async def test_failover_mid_speculative_answer_keeps_every_token(smollm2, model_store,
                                                                 local_answer):
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 10, 29)
    c = await _chosen(mesh, smollm2, 29)
    c.fail_after_steps = 4  # the prompt and three speculative passes
    orch, m = _orch(mesh, model_store)
    frames = await _run(orch, [{"role": "user", "content": EDIT}], speculate="lookup")
    assert [f["type"] for f in frames].count("shard_failover") == 1
    assert m.failovers_total._value.get() == 1
    done = frames[-1]
    assert done["type"] == "done" and done["speculative"]["accepted"] > 0, done
    assert _tokens(frames) == local_answer(EDIT, 24)


async def test_concurrent_chats_open_their_stages_in_one_lane_per_stage(smollm2, model_store,
                                                                        local_answer):
    """Two chats at once through two shards: each opens both its stages in its own lane
    (the stages batch each lane apart, so both compute at once); a replacement opened by
    failover keeps its call's lane; every lane is free again after the answers."""
    short = "Name three colours."
    want = {PROMPT[0]["content"]: local_answer(PROMPT[0]["content"], 24),
            short: local_answer(short, 24)}
    mesh = InProcessMesh(smollm2)
    mesh.add("node-b", 0, 14)
    mesh.add("node-c", 15, 29)
    mesh.add("node-d", 10, 29)  # spare overlapping C
    (await _chosen(mesh, smollm2, 29)).fail_after_steps = 8
    lanes_of: dict[int, set[int]] = {}  # a call's max_length (its prompt) -> lanes opened
    connect = mesh.connect

    async def recording(uri, params, deadline_s):
        lanes_of.setdefault(params["max_length"], set()).add(params["lane"])
        return await connect(uri, params, deadline_s)

    mesh.connect = recording  # type: ignore[method-assign]
    orch, m = _orch(mesh, model_store)
    prompts = list(want)
    answers = await asyncio.gather(*(_run(orch, [{"role": "user", "content": p}])
                                     for p in prompts))
    for p, frames in zip(prompts, answers, strict=True):
        assert _tokens(frames) == want[p], p
    assert m.failovers_total._value.get() >= 1
    # each call's stages, the replacement's too, in one lane; the two calls apart
    assert sorted(lanes_of.values(), key=min) == [{0}, {1}], lanes_of
    assert not +orch.lanes.calls  # a fixed count (lanes=1): tests/unit/test_lanes.py
