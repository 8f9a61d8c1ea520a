"""A shard at capacity is busy, not gone (issue 16 §2), through real node processes.

Node A orchestrates; nodes B and C host layers 0-14 and 15-29 of SmolLM2 with
`max_concurrent_streams = 1`. Two chats start at once: the second finds both shards busy
and waits for the first call's slot instead of continuing on node A's local engine — both
answers end `done` through the shards, token-identical to the local engine's (fp32), the
second streaming only after the first has finished. The shards re-advertise every second
here, so an advertisement made while the first chat ran (active_sessions = 1) is usually
what the router sees when the second one picks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

PROMPTS = ["Hi!", "Write a short poem about a lighthouse keeper."]
N = 24


@pytest.fixture
def mesh(smollm2: Any, tmp_path: Path) -> Any:
    with LocalMesh([NodeSpec("node-a"),
                    NodeSpec("node-b", [(0, 14)], max_streams=1),
                    NodeSpec("node-c", [(15, 29)], max_streams=1)],
                   root=tmp_path, timeout_s=2.0) as m:
        yield m


async def _chat(uri: str, prompt: str, log: list[str]) -> tuple[list[int], list[dict[str, Any]]]:
    # the second chat waits for the first's whole answer, and the call waits at most its
    # `timeout_s` — by default the mesh's 2 s health timeout, which 24 tokens exceed on a
    # slow 2-core VM (AMD EPYC Zen 1: it then fell back to node A's engine)
    args = chat_args(prompt, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32",
                     timeout_s=60.0)
    ids: list[int] = []
    frames: list[dict[str, Any]] = []
    async for f in bus_call(uri, CHAT_CAPABILITY, args):
        frames.append(f)
        if f["type"] == "token_delta":
            if not ids:
                log.append(f"{prompt}:first")
            ids.append(f["token_id"])
        elif f["type"] in ("done", "error"):
            log.append(f"{prompt}:{f['type']}")
    return ids, frames


async def test_two_chats_on_one_stream_shards_both_finish_through_the_shards(mesh, local_answer):
    uri = mesh.nodes["node-a"].uri
    log: list[str] = []
    results = await asyncio.gather(*(_chat(uri, p, log) for p in PROMPTS))
    for p, (ids, frames) in zip(PROMPTS, results, strict=True):
        kinds = [f["type"] for f in frames]
        assert "pipeline_aborted" not in kinds and kinds[-1] == "done", (p, kinds)
        done = frames[-1]
        assert not done.get("fallback") and len(done["pipeline"]) == 2, done
        assert ids == local_answer(p, N), p
    # one after the other: the second chat's first token comes after the first's done
    first = log[0].rsplit(":", 1)[0]
    assert log[:2] == [f"{first}:first", f"{first}:done"], log
