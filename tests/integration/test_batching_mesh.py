"""Continuous batching through real node processes (issue 16 §1-4), SmolLM2, fp32.

Node A orchestrates, nodes B and C host layers 0-14 and 15-29. Three chats with prompts of
different lengths start at once: every answer is token-identical to the same prompt run
alone (`local_answer`: the local engine, which a solo mesh run equals in fp32 —
test_mesh_chat), while the shards' and the head's batch size histograms show that their
rows really shared forwards. A chat whose caller walks away mid-answer leaves the other
two answers intact.

The collection window is long (300 ms) so that the chats' steps meet in every round (a
round starts as soon as every open session has its step in; the window only bounds a
straggler): the test asserts batching itself, not a timing-dependent amount of it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

PROMPTS = ["Hi!",
           "Write a short poem about a lighthouse keeper.",
           "Explain in three sentences why the sky is blue, as if to a curious child who "
           "keeps asking why after every answer you give."]
N = 24
P = "hearthnet_distributed_inference_"


@pytest.fixture(scope="module")
def solo(local_answer: Any) -> dict[str, list[int]]:
    return {p: local_answer(p, N) for p in PROMPTS}


@pytest.fixture(scope="module")
def mesh(smollm2: Any) -> Any:
    di = {"batch_window_ms": 300.0}
    # one micro-batch lane (the default; lanes per stage: tests/integration/test_pipeline.py):
    # all three chats' rows meet in the same rounds
    with LocalMesh([NodeSpec("node-a", extra_di={**di, "pipeline_lanes": 1}),
                    NodeSpec("node-b", [(0, 14)], extra_di=di),
                    NodeSpec("node-c", [(15, 29)], extra_di=di)]) as m:
        yield m


async def _chat(uri: str, prompt: str, stop_after: int | None = None) -> list[int]:
    """A greedy fp32-wire chat's token ids; with `stop_after`, the caller leaves then."""
    # one decode row per token (speculative passes are several rows, never batched)
    args = chat_args(prompt, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32",
                     speculate="off")
    ids: list[int] = []
    calls = bus_call(uri, CHAT_CAPABILITY, args)
    async for f in calls:
        if f["type"] == "token_delta":
            ids.append(f["token_id"])
            if stop_after is not None and len(ids) >= stop_after:
                await calls.aclose()  # type: ignore[attr-defined]
                break
        elif f["type"] == "done":
            assert len(f["pipeline"]) == 2
    return ids


def _batches(text: str, name: str) -> tuple[float, float]:
    """(rows, batches) of histogram `name` in a node's /metrics, summed over series."""
    rows = batches = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == P + name:
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    rows += s.value
                elif s.name.endswith("_count"):
                    batches += s.value
    return rows, batches


async def test_concurrent_chats_are_batched_and_token_identical_to_solo(mesh, solo):
    uri = mesh.nodes["node-a"].uri
    answers = await asyncio.gather(*(_chat(uri, p) for p in PROMPTS))
    for p, ids in zip(PROMPTS, answers, strict=True):
        assert ids == solo[p], p
    decode_rows = sum(len(ids) - 1 for ids in answers)  # the prompts' steps are prefill
    for node in ("node-b", "node-c"):
        rows, batches = _batches(mesh.metrics(node), "shard_batch_size")
        # every decode row went through a batch, and most rows shared theirs
        assert rows >= decode_rows and batches < 0.75 * rows, (node, rows, batches)
    rows, batches = _batches(mesh.metrics("node-a"), "head_batch_size")
    assert rows >= decode_rows and batches < 0.75 * rows, (rows, batches)


async def test_a_caller_leaving_mid_answer_leaves_the_others_intact(mesh, solo):
    uri = mesh.nodes["node-a"].uri
    answers = await asyncio.gather(_chat(uri, PROMPTS[0]), _chat(uri, PROMPTS[1], stop_after=5),
                                   _chat(uri, PROMPTS[2]))
    assert answers[0] == solo[PROMPTS[0]] and answers[2] == solo[PROMPTS[2]]
    assert answers[1] == solo[PROMPTS[1]][:5]
