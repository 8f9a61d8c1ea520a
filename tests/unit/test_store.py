"""ShardStore: the advertisement read model — folding, index, expiry, hop weight, rebuild."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    WITHDRAWN,
    ShardDescriptor,
    ShardHealth,
    advertisement_payload,
    withdrawal_payload,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.observability import Metrics

SHA = "ab" * 32
SHA2 = "cd" * 32
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def desc(lo: int, hi: int, host: str = "node-b", *, sha: str = SHA, model: str = "m",
         endpoint: str = "ws://127.0.0.1:7702") -> ShardDescriptor:
    return ShardDescriptor.create(model_id=model, weights_sha256=sha, layer_range=(lo, hi),
                                  host=host, endpoint=endpoint, max_concurrent_streams=4,
                                  advertised_at=datetime.fromtimestamp(T0, UTC))


class Host:
    """A hosting node's event log with its own clock (the events are real, signed ids)."""

    def __init__(self, tmp: Path, node: str, clock: Clock) -> None:
        self.log = EventLog(tmp / f"{node}.db", node, clock=clock)

    def advertise(self, d: ShardDescriptor, health: ShardHealth | None = None) -> Event:
        return self.log.append(ADVERTISED, advertisement_payload(d, health))

    def withdraw(self, d: ShardDescriptor) -> Event:
        return self.log.append(WITHDRAWN, withdrawal_payload(d.shard_id))


def test_advertisements_are_indexed_and_queried(tmp_path: Path) -> None:
    clock = Clock()
    b, c = Host(tmp_path, "node-b", clock), Host(tmp_path, "node-c", clock)
    store = ShardStore(120, clock=clock)
    d1, d2, d3 = desc(0, 14), desc(15, 29, "node-c"), desc(0, 29, "node-c", sha=SHA2)
    for ev in (b.advertise(d1), c.advertise(d2), c.advertise(d3)):
        assert store.apply(ev)
    assert [a.shard_id for a in store.live()] == sorted([d1.shard_id, d2.shard_id,
                                                         d3.shard_id])
    assert {a.shard_id for a in store.candidates("m", SHA)} == {d1.shard_id, d2.shard_id}
    assert len(store.candidates("m")) == 3
    assert store.candidates("other") == []
    assert [a.shard_id for a in store.by_key("m", SHA, (0, 14))] == [d1.shard_id]
    assert store.by_key("m", SHA, (0, 13)) == []
    assert store.models() == {"m"}
    assert store.hashes("m") == {SHA, SHA2}
    assert ("m", SHA, (0, 14)) in store.index_keys()
    ad = store.get(d1.shard_id)
    assert ad is not None and ad.descriptor == d1 and ad.origin == "node-b" and ad.seq == 1
    assert len(store) == 3


def test_covers_needs_every_layer_of_one_hash_live(tmp_path: Path) -> None:
    clock = Clock()
    b, c = Host(tmp_path, "node-b", clock), Host(tmp_path, "node-c", clock)
    store = ShardStore(120, clock=clock)
    assert not store.covers("m", SHA, 30)  # nothing advertised
    store.apply(b.advertise(desc(0, 14)))
    store.apply(c.advertise(desc(15, 29, "node-c", sha=SHA2)))  # the other half, another hash
    assert not store.covers("m", SHA, 30) and not store.covers("m", SHA2, 30)
    store.apply(c.advertise(desc(10, 29, "node-c")))  # overlapping ranges cover too
    assert store.covers("m", SHA, 30) and not store.covers("other", SHA, 30)
    assert not store.covers("m", SHA, 31)  # a layer no one holds
    clock.t += 10_000  # every advertisement expired: nothing is live
    assert not store.covers("m", SHA, 30)


def test_same_range_on_two_hosts_are_two_shards(tmp_path: Path) -> None:
    clock = Clock()
    store = ShardStore(120, clock=clock)
    store.apply(Host(tmp_path, "node-c", clock).advertise(desc(15, 29, "node-c")))
    store.apply(Host(tmp_path, "node-d", clock).advertise(desc(15, 29, "node-d")))
    assert len(store.by_key("m", SHA, (15, 29))) == 2


def test_expiry_after_four_health_timeouts_and_heartbeat_refresh(tmp_path: Path) -> None:
    clock = Clock()
    metrics = Metrics()
    b = Host(tmp_path, "node-b", clock)
    store = ShardStore(4 * 30, clock=clock, metrics=metrics)
    d = desc(0, 14)
    store.apply(b.advertise(d))
    assert metrics.registry.get_sample_value("hearthnet_advertisements_live") == 1
    clock.t += 119.9
    assert store.get(d.shard_id) is not None
    store.apply(b.advertise(d, ShardHealth(d.shard_id, True, datetime.now(UTC), 3.0, 2, 1)))
    clock.t += 119.9
    ad = store.get(d.shard_id)
    assert ad is not None and ad.health is not None and ad.health.queue_depth == 2
    assert store.health(d.shard_id) == ad.health
    clock.t += 0.1
    assert store.live() == []
    assert store.get(d.shard_id) is None
    assert metrics.registry.get_sample_value("hearthnet_advertisements_live") == 0


def test_catch_up_of_old_advertisements_does_not_revive_them(tmp_path: Path) -> None:
    host_clock = Clock()
    b = Host(tmp_path, "node-b", host_clock)
    old = b.advertise(desc(0, 14))
    store = ShardStore(120, clock=Clock(T0 + 500))  # this node hears of it 500 s later
    assert store.apply(old)
    assert store.live() == []


def test_future_timestamps_are_clamped(tmp_path: Path) -> None:
    b = Host(tmp_path, "node-b", Clock(T0 + 3600))  # host clock an hour ahead
    clock = Clock()
    store = ShardStore(120, clock=clock)
    d = desc(0, 14)
    store.apply(b.advertise(d))
    ad = store.get(d.shard_id)
    assert ad is not None and ad.seen_at == T0
    clock.t += 121
    assert store.get(d.shard_id) is None


def test_withdrawal_removes_and_late_old_advertisement_does_not_resurrect(
        tmp_path: Path) -> None:
    clock = Clock()
    b = Host(tmp_path, "node-b", clock)
    d = desc(0, 14)
    first = b.advertise(d)
    gone = b.withdraw(d)
    store = ShardStore(120, clock=clock)
    store.apply(first)
    assert store.apply(gone)
    assert store.get(d.shard_id) is None
    assert not store.apply(first)  # replayed late (another peer): ignored
    assert store.get(d.shard_id) is None
    assert store.apply(b.advertise(d))  # a newer advertisement brings it back
    assert store.get(d.shard_id) is not None


def test_only_the_host_may_advertise_or_withdraw_its_shard(tmp_path: Path) -> None:
    clock = Clock()
    store = ShardStore(120, clock=clock)
    d = desc(0, 14, "node-b")
    mallory = Host(tmp_path, "node-m", clock)
    assert not store.apply(mallory.advertise(d))
    assert store.live() == []
    store.apply(Host(tmp_path, "node-b", clock).advertise(d))
    assert not store.apply(mallory.withdraw(d))
    assert store.get(d.shard_id) is not None


def test_malformed_payloads_and_other_types_are_ignored(tmp_path: Path) -> None:
    clock = Clock()
    log = EventLog(tmp_path / "b.db", "node-b", clock=clock)
    store = ShardStore(120, clock=clock)
    assert not store.apply(log.append(ADVERTISED, {"shard_id": "x", "descriptor": {}}))
    assert not store.apply(log.append(ADVERTISED, {"nothing": True}))
    assert not store.apply(log.append(WITHDRAWN, {"shard_id": 5}))
    assert not store.apply(log.append("something.else", {"shard_id": "x"}))
    assert store.live() == []


@pytest.mark.parametrize(("endpoint", "weight"), [
    ("ws://127.0.0.1:7702", 1.0),
    ("ws://192.168.1.20:7702", 1.0),
    ("wss://10.1.2.3:7702", 1.0),
    ("ws://[::1]:7702", 1.0),
    ("ws://8.8.8.8:7702", 2.0),
    ("ws://[2001:db8::1]:7702", 2.0),
    ("ws://localhost:7702", 1.0),
    ("ws://kitchen-pc:7702", 1.0),
    ("ws://kitchen-pc.local:7702", 1.0),
    ("ws://shard.example.org:7702", 2.0),
])
def test_hop_weight_prefers_the_lan(tmp_path: Path, endpoint: str, weight: float) -> None:
    clock = Clock()
    store = ShardStore(120, clock=clock)
    d = desc(0, 14, endpoint=endpoint)
    store.apply(Host(tmp_path, "node-b", clock).advertise(d))
    ad = store.get(d.shard_id)
    assert ad is not None and ad.descriptor.hop_weight == weight


def test_custom_lan_networks(tmp_path: Path) -> None:
    store = ShardStore(120, lan_networks=["100.64.0.0/10"])
    assert store.hop_weight("ws://100.64.1.1:1") == 1.0
    assert store.hop_weight("ws://192.168.1.1:1") == 2.0


def test_rebuild_from_the_log_after_restart(tmp_path: Path) -> None:
    clock = Clock()
    b, c = Host(tmp_path, "node-b", clock), Host(tmp_path, "node-c", clock)
    mine = EventLog(tmp_path / "a.db", "node-a", clock=clock)
    store = ShardStore(120, clock=clock)
    mine.subscribe(store.apply)
    d1, d2, d3 = desc(0, 14), desc(15, 29, "node-c"), desc(10, 29, "node-c")
    mine.ingest_many([b.advertise(d1), c.advertise(d2), c.advertise(d3), c.withdraw(d3)])
    before = [(a.shard_id, a.seq, a.seen_at) for a in store.live()]
    assert [s for s, _, _ in before] == sorted([d1.shard_id, d2.shard_id])
    mine.close()
    reopened = EventLog(tmp_path / "a.db", "node-a", clock=clock)
    fresh = ShardStore(120, clock=clock)
    assert fresh.rebuild(reopened.all_events()) == 2
    assert [(a.shard_id, a.seq, a.seen_at) for a in fresh.live()] == before


def test_tracker_is_fed_with_heartbeats_and_forgets_withdrawn(tmp_path: Path) -> None:
    clock = Clock()
    tracker = ShardHealthTracker(clock=clock)
    store = ShardStore(120, clock=clock, tracker=tracker)
    b = Host(tmp_path, "node-b", clock)
    d = desc(0, 14)
    store.apply(b.advertise(d, ShardHealth(d.shard_id, True, datetime.now(UTC), 7.0, 1, 1)))
    assert tracker.online(d.shard_id)
    assert tracker.p95(d.shard_id) == 7.0
    store.apply(b.withdraw(d))
    assert tracker.view(d.shard_id) is None


def test_a_new_incarnation_supersedes_the_hosts_old_advertisements_at_once(tmp_path):
    """A restarted node (same id, same address) advertises with a new boot id: every
    advertisement of its old process goes at once, not after the expiry; one of the old
    process's arriving late is ignored; peers of an older release (no boot id) and other
    hosts are untouched."""
    import dataclasses

    clock = Clock()
    store = ShardStore(120, clock=clock)
    b, c = Host(tmp_path, "node-b", clock), Host(tmp_path, "node-c", clock)
    old = [dataclasses.replace(desc(lo, hi), incarnation="aaaa") for lo, hi in ((0, 9), (10, 19))]
    late = b.advertise(dataclasses.replace(desc(20, 29), incarnation="aaaa"))
    for d in old:
        assert store.apply(b.advertise(d))
    assert store.apply(c.advertise(desc(0, 29, "node-c")))  # no boot id: an older release
    new = dataclasses.replace(desc(5, 14), incarnation="bbbb")
    assert store.apply(b.advertise(new))
    assert sorted(a.descriptor.shard_id for a in store.live()) == sorted(
        [new.shard_id, desc(0, 29, "node-c").shard_id])
    assert not store.apply(late)  # the old process's, gossiped late: ignored
    assert {a.descriptor.incarnation for a in store.live()} == {"bbbb", ""}
    # a rebuild from the log folds to the same directory
    assert store.rebuild(b.log.all_events() + c.log.all_events()) == 2
