"""Speculative passes through real node processes (DESIGN.md decision 16), on SmolLM2.

One mesh: `node-a` orchestrates with SmolLM2 as its own draft model (the same tokenizer, so
the draft path runs end to end), `node-b` hosts layers 0-14 and `node-c` 15-29. Greedy over
the default (fp32) wire: a speculative answer must be the plain answer, token for token,
where prompt lookup hits (an edit of a given paragraph) and where it finds nothing to
propose; the shards roll their caches back past rejected proposals, also while another
chat's steps are batched with them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hearthnet.bench.speculative import EDIT_PROMPT
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from tests.helpers.mesh import TestMesh

pytestmark = pytest.mark.slow

PLAIN = "Write a short poem about a lighthouse keeper."
N = 24


@pytest.fixture(scope="module")
def mesh(smollm2):
    m = TestMesh([NodeSpec("node-a", extra_di={"draft_models": {"smollm2": "smollm2"},
                                                "speculate_max_tokens": 6}),
                  NodeSpec("node-b", [(0, 14)]), NodeSpec("node-c", [(15, 29)])])
    with m:
        m.wait_covered("node-a", shards=2)
        yield m


async def _chat(m: TestMesh, prompt: str, node: str = "node-a", n: int = N,
                sampling: SamplingParams | None = None, **params: Any) -> list[dict[str, Any]]:
    args = chat_args(prompt, "smollm2", sampling or SamplingParams(max_tokens=n), **params)
    return [f async for f in bus_call(m.nodes[node].uri, CHAT_CAPABILITY, args)]


def _tokens(frames: list[dict[str, Any]]) -> list[int]:
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


def _metric(m: TestMesh, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(m.metrics("node-a")):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def test_lookup_hits_on_an_edit_and_answers_as_plain_passes(mesh, local_answer):
    want = local_answer(EDIT_PROMPT, N)
    accepted0 = _metric(mesh, "hearthnet_speculative_accepted_total", model="smollm2",
                        mode="lookup")
    off = await _chat(mesh, EDIT_PROMPT, n=4, speculate="off")
    assert off[-1]["type"] == "done" and off[-1].get("speculative") is None
    assert _tokens(off) == want[:4]
    frames = await _chat(mesh, EDIT_PROMPT)  # lookup: the node's default
    done = frames[-1]
    assert done["type"] == "done", done
    assert _tokens(frames) == want
    spec = done["speculative"]
    assert spec["mode"] == "lookup" and spec["accepted"] >= N // 3, spec
    assert spec["tokens_per_pass"] >= 2.0 and spec["passes"] < N // 2, spec
    # every step of the answer is one pass through both shards: fewer steps than tokens
    assert all(s["steps"] == spec["passes"] + 1 for s in done["timings"]["per_shard"].values())
    assert _metric(mesh, "hearthnet_speculative_accepted_total", model="smollm2",
                   mode="lookup") == accepted0 + spec["accepted"]
    assert _metric(mesh, "hearthnet_speculative_proposed_total", model="smollm2",
                   mode="lookup") >= spec["proposed"]


async def test_where_lookup_finds_nothing_the_answer_is_the_same(mesh, local_answer):
    frames = await _chat(mesh, PLAIN, speculate="lookup")
    assert frames[-1]["type"] == "done", frames[-1]
    assert _tokens(frames) == local_answer(PLAIN, N)
    spec = frames[-1]["speculative"]
    assert spec["mode"] == "lookup" and spec["tokens_per_pass"] < 1.5, spec


async def test_a_draft_model_proposes_and_the_answer_is_the_same(mesh, local_answer):
    frames = await _chat(mesh, PLAIN, speculate="draft")
    done = frames[-1]
    assert done["type"] == "done", done
    assert _tokens(frames) == local_answer(PLAIN, N)
    spec = done["speculative"]
    # the model as its own draft: it proposes what the target takes, up to 6 a pass
    assert spec["mode"] == "draft" and spec["tokens_per_pass"] >= 3.0, spec


async def test_concurrent_speculating_chats_roll_back_alone(mesh, local_answer):
    """Two chats at once: their steps share the shards' rounds (batched), each rolls its own
    cache back; both answers are their solo answers."""
    a, b = await asyncio.gather(_chat(mesh, EDIT_PROMPT), _chat(mesh, PLAIN))
    assert a[-1]["type"] == b[-1]["type"] == "done"
    assert _tokens(a) == local_answer(EDIT_PROMPT, N)
    assert _tokens(b) == local_answer(PLAIN, N)


async def test_sampled_speculation_finishes_with_the_asked_length(mesh):
    s = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=7)
    frames = await _chat(mesh, EDIT_PROMPT, sampling=s)
    done = frames[-1]
    assert done["type"] == "done", done
    assert len(_tokens(frames)) == done["usage"]["completion_tokens"]
    assert done["finish_reason"] in ("length", "eos")
    assert done["speculative"]["passes"] > 0
    again = await _chat(mesh, EDIT_PROMPT, sampling=s)  # seeded: reproducible
    assert _tokens(again) == _tokens(frames)


async def test_bad_speculate_values_are_refused_before_work(mesh):
    frames = await _chat(mesh, PLAIN, speculate="always")
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_request"
    assert "speculate must be one of lookup, draft, off" in frames[-1]["message"]
    assert not [f for f in frames if f["type"] == "token_delta"]
    # node-b has no draft model configured: a typed refusal naming the setting
    frames = await _chat(mesh, PLAIN, node="node-b", speculate="draft")
    assert frames[-1]["type"] == "error" and frames[-1]["code"] == "bad_request"
    assert "no draft model is configured for smollm2" in frames[-1]["message"]
