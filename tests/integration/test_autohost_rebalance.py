"""Rebalancing with real node processes (issue 17 §3): no gap, the open chat finishes.

``node-a`` (the steward) starts alone and takes 0-14 (budgets of 15 SmolLM2 layers, pinned
speed 1), then ``node-b`` fills 15-29 — one at a time, so who holds which half is known
(started together, either may win the claim on 0-14). A chat through ``node-b`` runs on
both ranges and is then *held open*: node-b's shard 15-29 answers its first steps and then
waits for a gate file (a test-only fault, `tests.helpers.faults`), so nothing here races
the chat's length against the machine's load. ``node-c``, three times as fast, joins and
takes one half (both are equally weak: the lower one, 0-14, on a view that already holds
both advertisements). The host it joined (the
*mover*) now doubles the weakest coverage by moving to the other half (quality 0.5 <
0.75), so its next rebalance check (every ~1 s) loads the new range, advertises it and
withdraws the old one — but does not free it while the held chat has a session on it.
Coverage is watched all along: it never has a gap. Then the gate opens, the chat finishes
on its old pipeline, and the mover frees its old range.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from tests.helpers.mesh import TestMesh
from tests.helpers.waiting import wait_for, wait_until
from tests.integration.test_autohost import _cli, _covered_by, _ranges

pytestmark = pytest.mark.slow

BUDGET = {"memory_mb": 215, "rebalance_interval_s": 1.0}  # 15 layers of SmolLM2 fp32
PROMPT = "Write a long, detailed essay about the history of bread, with many sections."
CHAT_TOKENS = 40
HELD_AFTER_STEPS = 3  # node-b's 15-29 answers the prefill and two decode steps, then waits
STATE_TIMEOUT_S = 120.0  # bounds a broken run only: every wait below is on state


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory, gate):
    di = {"allow_self_as_shard": True}
    # a held session is idle on the stages before the gate: not "stalled" while held
    host = {"session_idle_timeout_seconds": STATE_TIMEOUT_S * 5}
    specs = [NodeSpec(n, trust="steward" if n == "node-a" else "trusted", extra_di=di,
                      auto={**BUDGET, "speed": speed}, extra_host=host)
             for n, speed in (("node-a", 1.0), ("node-b", 1.0), ("node-c", 3.0))]
    faults = {"node-b": {"mode": "gate", "shard": "15-29", "after_steps": HELD_AFTER_STEPS,
                         "gate_file": str(gate)}}
    m = TestMesh(specs, faults=faults, root=tmp_path_factory.mktemp("rebalance"))
    try:
        m.start_node("node-a")
        r = _cli(m, "models", "serve", "smollm2", "--config", str(m.nodes["node-a"].config))
        assert r.returncode == 0, r.stderr
        wait_for(lambda: _ranges(m.status("node-a")).get("node-a") == [[0, 14]],
                 "node-a alone to take 0-14", STATE_TIMEOUT_S)
        m.start_node("node-b")
        yield m
    finally:
        m.stop()


class CoverageWatch:
    """Polls node-b's status in the background and notes every moment with a gap."""

    def __init__(self, mesh: TestMesh) -> None:
        self.mesh = mesh
        self.gaps: list[float] = []
        self.last: dict[str, Any] = mesh.status("node-b")
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            s = await asyncio.to_thread(self.mesh.status, "node-b")
            if not _covered_by(s, {"node-a", "node-b", "node-c"}):
                self.gaps.append(time.time())
            self.last = s
            await asyncio.sleep(0.2)

    async def until(self, cond: Callable[[dict[str, Any]], bool], what: str
                    ) -> dict[str, Any]:
        """Wait (bounded) until `cond` holds on the latest status; returns that status."""
        await wait_until(lambda: cond(self.last), what, STATE_TIMEOUT_S)
        return self.last

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def test_rebalance_without_gap_and_without_failing_the_open_chat(mesh, gate):
    st = wait_for(lambda: (s := mesh.status("node-b")) and
                  _ranges(s) == {"node-a": [[0, 14]], "node-b": [[15, 29]]} and s,
                  "node-b to fill 15-29 next to node-a's 0-14", STATE_TIMEOUT_S)
    shard_of = {s["host"]: s["shard_id"] for s in st["shards"]}
    frames: list[dict[str, Any]] = []
    args = chat_args(PROMPT, "smollm2", SamplingParams(max_tokens=CHAT_TOKENS),
                     fallback_to_local=False, timeout_s=600)  # a held step is no stall

    async def chat() -> None:
        async for f in bus_call(mesh.nodes["node-b"].uri, CHAT_CAPABILITY, args):
            frames.append(f)

    watch = CoverageWatch(mesh)
    task = asyncio.create_task(chat())
    try:
        await wait_until(lambda: any(f["type"] == "token_delta" for f in frames),
                         "the chat's first token", STATE_TIMEOUT_S)
        mesh.start_node("node-c", wait=False)
        st = await watch.until(lambda s: "node-c" in _ranges(s), "node-c to place")
        joined = _ranges(st)["node-c"]  # 0-14 (a tie); 15-29 if node-c saw only node-a yet
        mover = next(h for h, rs in _ranges(st).items() if h != "node-c" and rs == joined)
        other = [[15, 29]] if joined == [[0, 14]] else [[0, 14]]
        # the mover loads the other half, advertises it, withdraws its old range ...
        await watch.until(lambda s: _ranges(s, {mover}).get(mover) == other,
                          f"{mover} to move to {other}")
        assert not task.done(), frames[-1]  # ... while the chat is held open on it
        this = mesh.status(mover)["placement"]["this_node"]
        assert this["decisions"][-1]["kind"] == "rebalance", this["decisions"]
        assert "quality 0.50" in this["decisions"][-1]["detail"]
        gate.touch()  # let the chat finish
        await task
    finally:
        gate.touch()
        await watch.stop()
        task.cancel()
    done = frames[-1]
    assert done["type"] == "done" and not done.get("fallback"), done
    assert done["failovers"] == 0 and shard_of[mover] in done["pipeline"], done
    assert sum(f["type"] == "token_delta" for f in frames) > HELD_AFTER_STEPS
    assert not watch.gaps, f"coverage had a gap at {watch.gaps}"
    a = wait_for(lambda: (x := mesh.status(mover)["placement"]["this_node"])
                 and x["decisions"][-1]["kind"] == "dropped" and x,
                 f"{mover} to free its old range once the chat's session ended",
                 STATE_TIMEOUT_S)
    assert [d["kind"] for d in a["decisions"]][-2:] == ["rebalance", "dropped"]

