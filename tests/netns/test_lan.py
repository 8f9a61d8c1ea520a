"""Real hosts (issue 6): four nodes in four network namespaces on one bridge.

``node-a`` (10.231.0.11) orchestrates; ``node-b`` hosts layers 0-14; ``node-c`` and
``node-d`` both host 15-29. Every node has its own address and talks to the others over
the bridge with mutual TLS. Three scenarios, answers greedy over an fp32 wire so they must
equal the local engine's exactly:

- the happy path;
- a whole host killed mid-answer (every process in its namespace, SIGKILL);
- a link cut mid-answer (the host's veth down): nothing errors, the connection just goes
  silent, and the per-step deadline (``timeout_s`` 3 s) must catch it.

Run with ``scripts/lan_test.sh`` (or as root: ``pytest -m netns tests/netns``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from hearthnet.mesh.launcher import NodeSpec
from tests.netns.conftest import NetnsLan

pytestmark = pytest.mark.netns

PROMPT = "Write a short poem about a lighthouse keeper."
N = 24
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def reference(local_answer) -> list[int]:
    return local_answer(PROMPT, N)


@pytest.fixture(scope="module")
def lan(netns_ok, smollm2):
    net = NetnsLan([NodeSpec("node-a"), NodeSpec("node-b", [(0, 14)]),
                    NodeSpec("node-c", [(15, 29)]), NodeSpec("node-d", [(15, 29)])])
    try:
        net.up()
        net.start()
        for h in ("node-b", "node-c", "node-d"):
            net.wait_seen("node-a", h)
        yield net
    finally:
        net.down()
        assert not net.root.exists()  # nothing of the LAN is left in the temp folder


def _chat(lan: NetnsLan, on_token: Callable[[int, list[dict[str, Any]]], None] | None = None
          ) -> list[dict[str, Any]]:
    """One chat from a client inside node-a's namespace; `on_token` after each token."""
    p = lan.client("node-a", "chat", PROMPT, str(N), str(TIMEOUT_S))
    assert p.stdout is not None
    frames: list[dict[str, Any]] = []
    n = 0
    try:
        for line in p.stdout:
            f = json.loads(line)
            if f["type"] == "exit":
                break
            frames.append(f)
            if f["type"] == "token_delta":
                n += 1
                if on_token is not None:
                    on_token(n, frames)
    finally:
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    return frames


def _tokens(frames: list[dict[str, Any]]) -> list[int]:
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


def _host_of_layer(frames: list[dict[str, Any]], layer: int) -> str:
    st = next(f for f in frames if f["type"] == "shard_status" and f["status"] == "ok"
              and f["layers"][0] <= layer <= f["layers"][1])
    return str(st["shard_id"]).rsplit("@", 1)[1]


def _assert_failed_over(frames: list[dict[str, Any]], host: str, reference: list[int]) -> None:
    assert frames[-1]["type"] == "done", frames[-3:]
    kinds = [f["type"] for f in frames]
    assert "pipeline_aborted" not in kinds and "error" not in kinds
    degraded = [f for f in frames if f["type"] == "shard_status" and f["status"] == "degraded"]
    assert [d["shard_id"].rsplit("@", 1)[1] for d in degraded] == [host], degraded
    assert frames[-1]["failovers"] == 1
    assert _tokens(frames) == reference


def test_happy_path_across_hosts(lan, reference):
    frames = _chat(lan)
    assert frames[-1]["type"] == "done" and frames[-1]["failovers"] == 0
    assert len(frames[-1]["pipeline"]) == 2
    assert _tokens(frames) == reference


def test_whole_host_killed_mid_answer(lan, reference, capsys):
    victim: dict[str, str] = {}

    def kill(n: int, frames: list[dict[str, Any]]) -> None:
        if n == 6:
            victim["host"] = _host_of_layer(frames, 29)
            lan.kill_host(victim["host"])

    frames = _chat(lan, kill)
    assert victim["host"] in ("node-c", "node-d")
    _assert_failed_over(frames, victim["host"], reference)
    with capsys.disabled():
        print(f"\nhost {victim['host']} killed: failover "
              f"{frames[-1]['timings']['failover_ms'][0]:.0f} ms")
    t = time.time()  # bring the host back for the next scenario
    lan.start([victim["host"]])
    lan.wait_seen("node-a", victim["host"], since=t)


def test_link_cut_mid_answer(lan, reference, capsys):
    victim: dict[str, Any] = {}

    def cut(n: int, frames: list[dict[str, Any]]) -> None:
        if n == 6:
            victim["host"] = _host_of_layer(frames, 29)
            lan.cut(victim["host"])
            victim["t"] = time.perf_counter()

    try:
        frames = _chat(lan, cut)
    finally:
        if "host" in victim:
            lan.mend(victim["host"])
    assert victim["host"] in ("node-c", "node-d")
    _assert_failed_over(frames, victim["host"], reference)
    degraded = next(f for f in frames if f["type"] == "shard_status"
                    and f["status"] == "degraded")
    assert degraded["code"] == "pipeline_stalled"  # silence, caught by the step deadline
    with capsys.disabled():
        print(f"\nlink to {victim['host']} cut: stalled step detected and failed over in "
              f"{frames[-1]['timings']['failover_ms'][0]:.0f} ms after the "
              f"{TIMEOUT_S:g} s deadline")
