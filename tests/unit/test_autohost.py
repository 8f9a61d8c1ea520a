"""`HostProber` (issue 15 §6, issue 17 §2): a host is down after N failed probes, up again at
once (`layer_params` from SmolLM2's header: tests/integration/test_layer_params.py).
`AutoHost`'s loop under stop: it ends promptly, even when a step swallowed its
cancellation, and hosts nothing once stopping began."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from hearthnet.config import parse_config
from hearthnet.distributed_inference.directory.liveness import HostLiveness, HostProber
from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.distributed_inference.placement.autohost import AutoHost, ModelCost
from hearthnet.distributed_inference.placement.community import PlacementView
from hearthnet.mesh.eventlog import EventLog
from hearthnet.models.store import ModelStore


async def test_prober_marks_down_after_n_failures_and_up_again():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    prober = HostProber(failures_to_down=2, timeout_s=1.0)
    hosts = {"b": f"wss://127.0.0.1:{port}"}
    assert not await prober.probe(hosts) and not prober.is_down("b")
    server.close()
    await server.wait_closed()
    assert not await prober.probe(hosts)  # one failure is not enough
    assert await prober.probe(hosts) and prober.is_down("b")
    assert not await prober.probe(hosts)  # no change: still down
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
    try:
        assert await prober.probe(hosts) and not prober.is_down("b")
    finally:
        server.close()
        await server.wait_closed()
    prober.down_since["gone"] = 0.0
    await prober.probe({})  # hosts no longer advertised are forgotten
    assert not prober.is_down("gone")



# ---- the loop under stop (SIGTERM): prompt, and nothing hosted after it ----

class _Host:
    """A `ShardHost` that records loads and hosts nothing."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, int]] = []

    def hosted(self) -> list[Any]:
        return []

    async def load_shard(self, entry: Any, lo: int, hi: int, placement: dict[str, Any]) -> Any:
        self.loads.append((lo, hi))
        return SimpleNamespace(shard_id=f"m:{lo}-{hi}@node-a", lo=lo, hi=hi, entry=entry)

    async def drop_shard(self, shard_id: str, reason: str) -> None:
        pass


def _auto(tmp_path: Path, host: _Host) -> AutoHost:
    """An automatic host with no model, no jitter and no settle time: the loop runs a
    round whenever it is woken, and the test drives its clock (no sleeps)."""
    cfg = parse_config('shards = "auto"\n[node]\nid = "node-a"\n[research]\nenable = true\n'
                       "[research.distributed_inference]\nenabled = true\n"
                       "[research.distributed_inference.host]\nserve_shards = true\n"
                       "[research.distributed_inference.auto]\nsettle_s = 0\n"
                       "start_jitter_s = 0\nspeed = 1\n")
    store = ShardStore(cfg.di.advertisement_expiry_s)
    auto = AutoHost(cfg, log_=EventLog(":memory:", "node-a"), store=store,
                    models=ModelStore(tmp_path / "models"), host=host,
                    view=PlacementView(lambda _node: False),
                    liveness=HostLiveness(store, "node-a", interval_s=1.0, failures=2))
    auto.clock = lambda: 0.0  # the next rebalance is 30-90 s away: rounds only when woken
    return auto


async def test_a_step_that_swallows_its_cancellation_ends_the_loop_and_hosts_nothing(
        tmp_path):
    """Python 3.11's ``wait_for`` drops a cancel that arrives as the awaited call
    completes; the step then goes on to re-host. Before the fix the loop carried on (a
    node that logged ``node_stopping`` loaded layers and needed SIGKILL)."""
    host = _Host()
    auto = _auto(tmp_path, host)
    rounds: list[bool] = []
    entered = asyncio.Event()
    entry = SimpleNamespace(model_id="m", alias="m", num_layers=4)

    async def step(*, rebalance: bool) -> None:
        rounds.append(rebalance)
        entered.set()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as 3.11's wait_for
            await asyncio.Event().wait()  # a probe, a load, a transfer...
        await auto._load(entry, ModelCost(1 << 20, 1000, 1.0), 0, 3, "rehost", "a gap")

    auto.step = step  # type: ignore[method-assign]
    auto.start()
    await entered.wait()
    async with asyncio.timeout(5):  # before the fix: stop() never returned
        await auto.stop()
    assert rounds == [False] and host.loads == []
    assert all(t.done() for t in auto._tasks)


async def test_the_rebalance_round_follows_the_injected_clock(tmp_path):
    auto = _auto(tmp_path, _Host())
    now = [0.0]
    auto.clock = lambda: now[0]
    rounds: list[bool] = []
    ran = asyncio.Event()

    async def step(*, rebalance: bool) -> None:
        rounds.append(rebalance)
        ran.set()

    auto.step = step  # type: ignore[method-assign]
    auto.start()
    await ran.wait()
    ran.clear()
    now[0] = 1000.0  # past any jittered interval (at most 1.5 × 60 s)
    auto._wake.set()
    await ran.wait()
    await auto.stop()
    assert rounds == [False, True]
    assert all(t.done() for t in auto._tasks)


async def test_stop_does_not_wait_for_a_task_that_ignores_its_cancellation(tmp_path):
    auto = _auto(tmp_path, _Host())
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    auto._tasks = [asyncio.create_task(stubborn(), name="stubborn")]
    await asyncio.sleep(0)  # it runs up to its first await
    with capture_logs() as logs:
        await auto.stop(grace_s=0.01)
    assert [e["tasks"] for e in logs if e["event"] == "autohost_stop_stuck"] == [["stubborn"]]
    assert auto.stopping
    release.set()
    await auto._tasks[0]
