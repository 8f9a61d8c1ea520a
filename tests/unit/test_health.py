"""ShardHealthTracker: heartbeats, online/offline, p95 from two sources, suspicion decay."""

from __future__ import annotations

from datetime import UTC, datetime

from hearthnet.distributed_inference.directory.descriptors import ShardHealth
from hearthnet.distributed_inference.directory.health import ShardHealthTracker


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def health(p95: float = 10.0, online: bool = True, queue: int = 0) -> ShardHealth:
    return ShardHealth("s", online, datetime.fromtimestamp(1000, UTC), p95, queue, 1)


def test_unknown_shard_is_offline_and_not_suspect() -> None:
    t = ShardHealthTracker(clock=Clock())
    assert not t.online("s")
    assert not t.is_suspect("s")
    assert t.p95("s") is None
    assert t.view("s") is None


def test_online_follows_heartbeats_and_timeout() -> None:
    clock = Clock()
    t = ShardHealthTracker(clock=clock, offline_after_s=30)
    t.heartbeat("s", health())
    assert t.online("s")
    clock.t += 30
    assert t.online("s")
    clock.t += 0.5
    assert not t.online("s")
    t.heartbeat("s", health())
    assert t.online("s")
    assert t.last_seen("s") == clock.t


def test_heartbeat_saying_offline_and_stale_heartbeats() -> None:
    clock = Clock()
    t = ShardHealthTracker(clock=clock)
    t.heartbeat("s", health(online=False))
    assert not t.online("s")
    t.heartbeat("s", health(p95=99.0), at=clock.t - 10)  # older: ignored
    assert not t.online("s")
    assert t.p95("s") == 10.0


def test_observed_answers_keep_a_shard_online() -> None:
    clock = Clock()
    t = ShardHealthTracker(clock=clock, offline_after_s=30)
    t.heartbeat("s", health())
    clock.t += 60
    assert not t.online("s")
    t.observe_latency("s", 5.0)
    assert t.online("s")


def test_p95_uses_the_larger_of_advertised_and_observed() -> None:
    t = ShardHealthTracker(clock=Clock(), min_samples=5, window=100)
    t.heartbeat("s", health(p95=20.0))
    for ms in range(1, 5):
        t.observe_latency("s", float(ms))
    assert t.observed_p95("s") is None  # not enough samples yet
    assert t.p95("s") == 20.0
    for ms in range(5, 101):
        t.observe_latency("s", float(ms))
    assert t.observed_p95("s") == 95.0
    assert t.p95("s") == 95.0
    t.observe_latency("s", float("nan"))  # ignored
    t.observe_latency("x", 7.0)
    assert t.p95("x") is None  # one sample, no heartbeat


def test_observed_window_is_bounded() -> None:
    t = ShardHealthTracker(clock=Clock(), window=10, min_samples=1)
    for _ in range(50):
        t.observe_latency("s", 1000.0)
    for _ in range(10):
        t.observe_latency("s", 1.0)
    assert t.observed_p95("s") == 1.0
    view = t.view("s")
    assert view is not None and view.observed_samples == 10


def test_suspicion_decays_and_grows_with_strikes() -> None:
    clock = Clock()
    t = ShardHealthTracker(clock=clock, suspect_base_s=30, suspect_max_s=100)
    until = t.mark_suspect("s", "stalled")
    assert until == clock.t + 30
    assert t.is_suspect("s")
    view = t.view("s")
    assert view is not None and view.suspect_reason == "stalled"
    clock.t += 30
    assert not t.is_suspect("s")  # decayed
    assert t.mark_suspect("s", "error") == clock.t + 60  # second strike doubles
    clock.t += 60
    assert t.mark_suspect("s", "error") == clock.t + 100  # capped
    clock.t += 100 + 100
    assert t.mark_suspect("s", "error") == clock.t + 30  # strikes reset after quiet time


def test_heartbeat_does_not_clear_suspicion_but_clear_suspect_does() -> None:
    t = ShardHealthTracker(clock=Clock())
    t.mark_suspect("s", "nan output")
    t.heartbeat("s", health())
    assert t.is_suspect("s")
    t.clear_suspect("s")
    assert not t.is_suspect("s")
    view = t.view("s")
    assert view is not None and view.strikes == 0


def test_snapshot_and_forget() -> None:
    t = ShardHealthTracker(clock=Clock())
    t.heartbeat("a", health(queue=4))
    t.mark_suspect("b", "stall")
    snap = t.snapshot()
    assert list(snap) == ["a", "b"]
    assert snap["a"].online and snap["a"].queue_depth == 4 and not snap["a"].suspect
    assert snap["b"].suspect and not snap["b"].online
    sh = snap["a"].to_shard_health()
    assert sh.shard_id == "a" and sh.queue_depth == 4 and sh.p95_latency_ms == 10.0
    t.forget("a")
    assert "a" not in t.snapshot()

