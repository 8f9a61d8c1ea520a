"""ShardRouter: greedy cover (M26 §5.2, §8.1), preferences, limits, failures, repick."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

import pytest

from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    ShardDescriptor,
    ShardHealth,
    advertisement_payload,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.routing import RoutingSettings, ShardRouter
from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.errors import BadRequest, ShardUnavailable, WeightsMismatch
from hearthnet.mesh.eventlog import Event

SHA = "ab" * 32
SHA2 = "cd" * 32
T0 = 1_700_000_000.0
_seq = itertools.count(1)


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Mesh:
    """A store fed with advertisements, and a router over it."""

    def __init__(self, *, self_node: str = "node-a", tracker: bool = False,
                 **settings: object) -> None:
        self.clock = Clock()
        self.tracker = ShardHealthTracker(clock=self.clock) if tracker else None
        self.store = ShardStore(120, clock=self.clock, tracker=self.tracker)
        self.router = ShardRouter(self.store, RoutingSettings(**settings),  # type: ignore[arg-type]
                                  self.tracker, self_node_id=self_node)

    def add(self, lo: int, hi: int, host: str = "node-b", *, sha: str = SHA,
            model: str = "m", queue: int = 0, active: int = 0, streams: int = 4,
            ip: str = "127.0.0.1", online: bool = True, ts: float | None = None,
            fmt: str = "fp32") -> str:
        d = ShardDescriptor.create(model_id=model, weights_sha256=sha, layer_range=(lo, hi),
                                   host=host, endpoint=f"ws://{ip}:7700",
                                   max_concurrent_streams=streams,
                                   advertised_at=datetime.fromtimestamp(T0, UTC),
                                   weights_format=fmt)
        h = ShardHealth(d.shard_id, online, datetime.fromtimestamp(T0, UTC), 5.0, queue,
                        active)
        ev = Event(f"id{next(_seq)}", host, next(_seq), ADVERTISED,
                   advertisement_payload(d, h), self.clock.t if ts is None else ts)
        assert self.store.apply(ev)
        return d.shard_id

    async def pick(self, total: int = 16, *, sha: str = SHA, **kw: object) -> list[str]:
        p = await self.router.pick("m", sha, total, **kw)  # type: ignore[arg-type]
        return [f"{s.shard.host}:{s.start}-{s.end}" for s in p.stages]


async def test_spec_8_1_overlap_shard_is_ignored() -> None:
    m = Mesh()
    m.add(0, 7, "node-b")
    m.add(4, 11, "node-c")
    m.add(8, 15, "node-d")
    assert await m.pick() == ["node-b:0-7", "node-d:8-15"]


async def test_pipeline_fields() -> None:
    m = Mesh()
    a = m.add(0, 7, "node-b")
    b = m.add(8, 15, "node-c")
    p = await m.router.pick("m", SHA, 16)
    assert p.model_id == "m" and p.weights_sha256 == SHA and p.total_layers == 16
    assert p.shard_ids == [a, b]
    assert [d.shard_id for d in p.ordered_shards] == [a, b]
    assert p.established_at == datetime.fromtimestamp(T0, UTC)
    p2 = await m.router.pick("m", SHA, 16)
    assert p2.pipeline_id != p.pipeline_id


async def test_sub_ranges_chain_overlapping_shards_at_any_boundary() -> None:
    m = Mesh()
    m.add(0, 9, "node-b")
    m.add(5, 15, "node-c")
    assert await m.pick() == ["node-b:0-9", "node-c:10-15"]


async def test_lower_queue_depth_wins_over_reach() -> None:
    m = Mesh()
    m.add(0, 3, "node-b")
    m.add(4, 15, "node-c", queue=5)
    m.add(4, 9, "node-d", queue=1)
    m.add(10, 15, "node-e", queue=0)
    assert await m.pick() == ["node-b:0-3", "node-d:4-9", "node-e:10-15"]


async def test_tie_on_queue_depth_reaches_further() -> None:
    m = Mesh()
    m.add(0, 5, "node-b", queue=2)
    m.add(0, 11, "node-c", queue=2)
    m.add(6, 15, "node-d")
    m.add(12, 15, "node-e")
    assert await m.pick() == ["node-c:0-11", "node-e:12-15"]


async def test_lan_shards_are_preferred() -> None:
    m = Mesh()
    m.add(0, 15, "node-w", ip="8.8.8.8")
    m.add(0, 7, "node-b", ip="192.168.1.2", queue=3)
    m.add(8, 15, "node-c", ip="192.168.1.3", queue=3)
    assert await m.pick() == ["node-b:0-7", "node-c:8-15"]


async def test_deterministic_when_everything_ties() -> None:
    m = Mesh()
    m.add(0, 15, "node-c")
    m.add(0, 15, "node-b")
    assert await m.pick(reserve=False) == ["node-b:0-15"]
    assert await m.pick(reserve=False) == ["node-b:0-15"]


async def test_gap_names_the_uncovered_layers() -> None:
    m = Mesh()
    m.add(0, 5, "node-b")
    m.add(9, 12, "node-c")
    with pytest.raises(ShardUnavailable) as ei:
        await m.pick()
    assert ei.value.code == "shard_unavailable"
    assert ei.value.details["uncovered"] == [[6, 8], [13, 15]]
    assert "6-8, 13-15" in ei.value.message


async def test_unknown_model_is_shard_unavailable() -> None:
    m = Mesh()
    m.add(0, 15, "node-b", model="other")
    with pytest.raises(ShardUnavailable, match="no live shard advertises m"):
        await m.pick()


async def test_weights_mismatch_when_only_other_hashes_cover() -> None:
    m = Mesh()
    m.add(0, 7, "node-b")
    m.add(8, 15, "node-c", sha=SHA2)
    with pytest.raises(WeightsMismatch) as ei:
        await m.pick()
    assert ei.value.code == "weights_mismatch"
    assert ei.value.details["uncovered"] == [[8, 15]]
    with pytest.raises(WeightsMismatch):
        await m.pick(sha="ef" * 32)  # nothing with the requested hash at all


async def test_gap_not_covered_by_other_hash_is_shard_unavailable() -> None:
    m = Mesh()
    m.add(0, 7, "node-b")
    m.add(8, 11, "node-c", sha=SHA2)
    with pytest.raises(ShardUnavailable):
        await m.pick()  # 12-15 has no shard at all


async def test_expired_advertisements_are_not_used() -> None:
    m = Mesh()
    m.add(0, 15, "node-b")
    m.clock.t += 119
    assert await m.pick(reserve=False) == ["node-b:0-15"]
    m.clock.t += 1
    with pytest.raises(ShardUnavailable):
        await m.pick()


async def test_self_is_never_the_first_shard_unless_allowed() -> None:
    m = Mesh(self_node="node-a")
    m.add(0, 15, "node-a")
    m.add(0, 7, "node-b")
    m.add(8, 15, "node-c")
    assert await m.pick(reserve=False) == ["node-b:0-7", "node-c:8-15"]
    only_self = Mesh(self_node="node-a")
    only_self.add(0, 15, "node-a")
    with pytest.raises(ShardUnavailable, match="allow_self_as_shard"):
        await only_self.pick()
    allowed = Mesh(self_node="node-a", allow_self_as_shard=True)
    allowed.add(0, 15, "node-a")
    assert await allowed.pick() == ["node-a:0-15"]


async def test_self_may_serve_later_layers_when_nothing_else_does() -> None:
    m = Mesh(self_node="node-a")
    m.add(0, 7, "node-b")
    m.add(8, 15, "node-a")
    assert await m.pick() == ["node-b:0-7", "node-a:8-15"]


async def test_max_shards_per_request_falls_back_to_fewest_stages() -> None:
    m = Mesh(max_shards_per_request=2)
    m.add(0, 3, "node-b")  # the greedy choice (queue 0) at every step...
    m.add(4, 7, "node-c")
    m.add(8, 15, "node-d")
    m.add(0, 11, "node-e", queue=3)  # ...needs 3 stages; the furthest reach needs 2
    m.add(12, 15, "node-f", queue=3)
    assert await m.pick() == ["node-e:0-11", "node-d:12-15"]
    tight = Mesh(max_shards_per_request=1)
    tight.add(0, 7, "node-b")
    tight.add(8, 15, "node-c")
    with pytest.raises(ShardUnavailable, match="needs 2 shards but max_shards_per_request"):
        await tight.pick()


async def test_shards_at_max_concurrent_streams_are_skipped() -> None:
    m = Mesh()
    m.add(0, 15, "node-b", active=4, streams=4)
    m.add(0, 15, "node-c", queue=9, active=1, streams=4)
    assert await m.pick(reserve=False) == ["node-c:0-15"]
    full = Mesh()
    full.add(0, 15, "node-b", active=2, streams=2)
    with pytest.raises(ShardUnavailable, match="max_concurrent_streams"):
        await full.pick()


async def test_a_full_cover_is_busy_and_a_missing_one_is_not() -> None:
    """Issue 16 §2: `busy` tells the orchestrator to wait for a slot, not to fall back."""
    full = Mesh()
    full.add(0, 15, "node-b", active=2, streams=2)
    with pytest.raises(ShardUnavailable) as ei:
        await full.pick()
    assert ei.value.details["busy"] is True
    gap = Mesh()
    gap.add(0, 7, "node-b", active=2, streams=2)  # 8-15: nobody, busy or not
    with pytest.raises(ShardUnavailable) as ei:
        await gap.pick()
    assert ei.value.details["busy"] is False


async def test_an_advertisement_made_during_our_calls_does_not_keep_the_shard_full() -> None:
    """Issue 16 §2: the shard re-advertises every heartbeat; one made while our pipeline
    was open counts it, and must not make the shard look full once we released it."""
    m = Mesh()
    m.add(0, 15, "node-b", streams=1)
    p = await m.router.pick("m", SHA, 16)
    m.clock.t += 1
    m.add(0, 15, "node-b", streams=1, active=1)  # advertised while our session was open
    with pytest.raises(ShardUnavailable):  # still ours: full
        await m.router.pick("m", SHA, 16)
    m.clock.t += 1
    m.router.release(p)
    assert await m.pick() == ["node-b:0-15"]  # the advertisement counted our ended session
    m.clock.t += 1
    m.add(0, 15, "node-b", streams=1, active=1)  # a newer one: someone else's session
    with pytest.raises(ShardUnavailable):
        await m.pick()


async def test_ended_sessions_are_counted_without_growing_across_advertisements() -> None:
    """A long-lived orchestrator releases sessions on a shard for days: the record of when
    they ended keeps only what the shard's current advertisement has not counted yet, and
    the load it gives is the same as before (a query changes nothing)."""
    m = Mesh()
    sid = m.add(0, 15, "node-b", streams=2)
    for _ in range(50):
        m.clock.t += 1
        m.add(0, 15, "node-b", streams=2, active=1)  # made while our one session was open
        p = await m.router.pick("m", SHA, 16)
        m.router.release(p)
    ad = m.store.get(sid)
    assert ad is not None and m.router._ended_since(ad) == 1  # this advertisement's session
    assert m.router._ended_since(ad) == 1  # asking twice: the same answer
    assert len(m.router._ended[sid]) == 1  # not 50
    assert await m.pick() == ["node-b:0-15"]  # counted out: not full


async def test_wait_for_release_returns_on_a_release_or_at_its_timeout() -> None:
    m = Mesh()
    m.add(0, 15, "node-b", streams=1)
    p = await m.router.pick("m", SHA, 16)
    since = m.router.releases
    m.router.release(p)
    await asyncio.wait_for(m.router.wait_for_release(since, 60), 5)  # already released
    await m.router.wait_for_release(m.router.releases, 0.01)  # none: the timeout


async def test_reservations_spread_pipelines_and_respect_capacity() -> None:
    m = Mesh()
    b = m.add(0, 15, "node-b", streams=2)
    c = m.add(0, 15, "node-c", streams=1)
    p1 = await m.router.pick("m", SHA, 16)
    assert p1.shard_ids == [b]
    p2 = await m.router.pick("m", SHA, 16)  # b has 1 in use now: c's queue is lower
    assert p2.shard_ids == [c]
    p3 = await m.router.pick("m", SHA, 16)
    assert p3.shard_ids == [b]
    assert m.router.in_use(b) == 2
    with pytest.raises(ShardUnavailable):  # every shard is at its limit
        await m.router.pick("m", SHA, 16)
    m.router.release(p2)
    assert m.router.in_use(c) == 0
    p4 = await m.router.pick("m", SHA, 16)
    assert p4.shard_ids == [c]


async def test_suspect_shards_are_avoided_and_used_only_as_last_resort() -> None:
    m = Mesh(tracker=True)
    b = m.add(0, 15, "node-b")
    m.add(0, 15, "node-c", queue=5)
    assert m.tracker is not None
    m.tracker.mark_suspect(b, "stalled")
    assert await m.pick(reserve=False) == ["node-c:0-15"]
    lonely = Mesh(tracker=True)
    only = lonely.add(0, 15, "node-b")
    assert lonely.tracker is not None
    lonely.tracker.mark_suspect(only, "stalled")
    assert await lonely.pick(reserve=False) == ["node-b:0-15"]


async def test_offline_shards_are_avoided() -> None:
    m = Mesh(tracker=True)
    m.add(0, 15, "node-b", ts=T0 - 60)  # no heartbeat for 60 s > health timeout
    m.add(0, 15, "node-c", queue=5)
    assert await m.pick(reserve=False) == ["node-c:0-15"]
    no_tracker = Mesh()
    no_tracker.add(0, 15, "node-b", online=False)
    no_tracker.add(0, 15, "node-c", queue=5)
    assert await no_tracker.pick(reserve=False) == ["node-c:0-15"]


async def test_shards_of_a_probed_down_host_are_never_picked() -> None:
    """Issue 15 §6: a host whose listener refuses the liveness probe is skipped at once (not
    only ranked last like a suspect), and the error names why."""
    down = {"node-b"}
    m = Mesh()
    m.router.host_down = down.__contains__
    m.add(0, 15, "node-b")
    m.add(0, 15, "node-c", queue=5)
    assert await m.pick(reserve=False) == ["node-c:0-15"]
    lonely = Mesh()
    lonely.router.host_down = down.__contains__
    lonely.add(0, 7, "node-c")
    lonely.add(8, 15, "node-b")
    with pytest.raises(ShardUnavailable) as e:
        await lonely.pick(reserve=False)
    assert e.value.details["uncovered"] == [[8, 15]]
    assert "host node-b refuses connections (probed down)" in e.value.message
    down.clear()  # reachable again: used again
    assert await lonely.pick(reserve=False) == ["node-c:0-7", "node-b:8-15"]


async def test_shard_claiming_layers_beyond_the_model_is_ignored() -> None:
    m = Mesh()
    m.add(0, 40, "node-b")
    with pytest.raises(ShardUnavailable, match="beyond the model"):
        await m.pick()


async def test_bad_total_layers() -> None:
    with pytest.raises(BadRequest):
        await Mesh().pick(total=0)


async def test_repick_replaces_only_the_failed_stage_with_a_sub_range() -> None:
    m = Mesh()
    b = m.add(0, 7, "node-b")
    c = m.add(8, 11, "node-c")
    e = m.add(12, 15, "node-e")
    d = m.add(4, 13, "node-d", queue=2)  # overlapping spare
    p = await m.router.pick("m", SHA, 16)
    assert p.shard_ids == [b, c, e]
    q = await m.router.repick(p, {c})
    assert q.pipeline_id == p.pipeline_id
    assert [(s.shard.shard_id, s.start, s.end) for s in q.stages] == \
        [(b, 0, 7), (d, 8, 11), (e, 12, 15)]
    assert q.stages[0] is p.stages[0] and q.stages[2] is p.stages[2]
    assert (m.router.in_use(c), m.router.in_use(d), m.router.in_use(b)) == (0, 1, 1)


async def test_repick_uses_a_sub_range_of_a_bigger_shard() -> None:
    m = Mesh()
    b = m.add(0, 7, "node-b")
    c = m.add(8, 15, "node-c")
    big = m.add(0, 15, "node-d", queue=3)
    p = await m.router.pick("m", SHA, 16)
    assert p.shard_ids == [b, c]
    q = await m.router.repick(p, {c})
    assert [(s.shard.shard_id, s.start, s.end) for s in q.stages] == [(b, 0, 7),
                                                                      (big, 8, 15)]
    with pytest.raises(ShardUnavailable, match="0-7"):
        await m.router.repick(q, {b, big, c})  # nothing left for 0-7


async def test_repick_failure_keeps_reservations_and_raises() -> None:
    m = Mesh()
    b = m.add(0, 7, "node-b")
    c = m.add(8, 15, "node-c")
    p = await m.router.pick("m", SHA, 16)
    with pytest.raises(ShardUnavailable) as ei:
        await m.router.repick(p, {c})
    assert ei.value.details["uncovered"] == [[8, 15]]
    assert (m.router.in_use(b), m.router.in_use(c)) == (1, 1)
    m.router.release(p)
    assert (m.router.in_use(b), m.router.in_use(c)) == (0, 0)


async def test_repick_with_whole_cover_when_patching_needs_a_used_shard() -> None:
    m = Mesh()
    x = m.add(0, 15, "node-x", queue=4)
    b = m.add(8, 15, "node-b")
    a = m.add(0, 7, "node-c")
    p = await m.router.pick("m", SHA, 16)
    assert p.shard_ids == [a, b]
    q = await m.router.repick(p, {a, b})
    assert q.shard_ids == [x]
    assert [(s.start, s.end) for s in q.stages] == [(0, 15)]


async def test_repick_without_excluded_stages_returns_the_pipeline() -> None:
    m = Mesh()
    m.add(0, 15, "node-b")
    p = await m.router.pick("m", SHA, 16)
    assert await m.router.repick(p, {"nope"}) is p


async def test_repick_respects_capacity_freed_by_its_own_reservation() -> None:
    m = Mesh()
    only = m.add(0, 15, "node-b", streams=1)
    p = await m.router.pick("m", SHA, 16)
    m.router.release(p)
    p = await m.router.pick("m", SHA, 16)
    # excluding a shard not in the pipeline changes nothing; excluding the one shard fails
    with pytest.raises(ShardUnavailable):
        await m.router.repick(p, {only})
    assert m.router.in_use(only) == 1


def test_routing_settings_from_config_section() -> None:
    from hearthnet.config import DistributedInferenceSection

    s = RoutingSettings.from_config(DistributedInferenceSection(
        max_shards_per_request=3, allow_self_as_shard=True, shard_health_timeout_seconds=10))
    assert s == RoutingSettings(3, True, 10.0)


async def test_router_only_chains_shards_of_accepted_formats():
    """Issue 12 §2: the call's `weights` decides which held formats a pipeline may use."""
    from hearthnet.distributed_inference.directory.formats import accepted_formats

    m = Mesh()
    a = m.add(0, 9, "node-b", fmt="int4")
    b = m.add(0, 9, "node-c", fmt="int8")
    c = m.add(10, 19, "node-d", fmt="bf16")
    m.add(10, 19, "node-e", fmt="fp32", queue=9)  # busier: picked only when bf16 is refused
    default = frozenset(accepted_formats("int8", "fp32"))  # int4 is not in the default
    p = await m.router.pick("m", SHA, 20, formats=default, reserve=False)
    assert p.shard_ids == [b, c]
    anyfmt = frozenset(accepted_formats("int4", "fp32"))
    assert (await m.router.pick("m", SHA, 20, formats=anyfmt, reserve=False)).shard_ids[0] \
        in (a, b)
    with pytest.raises(ShardUnavailable) as ei:  # exact fp32: no fp32 shard for 0-9
        await m.router.pick("m", SHA, 20, formats=frozenset({"fp32"}), reserve=False)
    assert "holds int8 weights; the call accepts fp32" in ei.value.message
    # a replacement keeps the call's formats: losing the int8 shard falls to nothing
    p = await m.router.pick("m", SHA, 20, formats=default)
    with pytest.raises(ShardUnavailable, match="holds int4"):
        await m.router.repick(p, exclude={b}, formats=default)


def test_descriptor_carries_its_format():
    d = ShardDescriptor.create(model_id="m", weights_sha256=SHA, layer_range=(0, 3),
                               host="node-b", endpoint="ws://127.0.0.1:1",
                               max_concurrent_streams=2, weights_format="int8")
    back = ShardDescriptor.from_dict(d.to_dict())
    assert back.weights_format == "int8"
    old = {k: v for k, v in d.to_dict().items() if k != "weights_format"}
    assert ShardDescriptor.from_dict(old).weights_format == "fp32"  # older advertisers
    with pytest.raises(BadRequest, match="weights_format"):
        ShardDescriptor.from_dict({**d.to_dict(), "weights_format": "native"})


def test_one_definition_of_a_usable_host_for_routing_coverage_and_hosting() -> None:
    """A host below the routing trust, or one holding a format calls refuse, covers
    nothing: `usable_host` is what the router picks by, and what automatic hosting, head
    preparation and `status` count as coverage (`ShardStore.covers(usable=…)`)."""
    m = Mesh()
    m.router.host_allowed = lambda host: host != "node-m"  # node-m: a mere member
    member = m.add(0, 15, "node-m")
    m.add(0, 7, "node-b", fmt="int8")
    ads = {a.descriptor.shard_id: a for a in m.store.candidates("m", SHA)}
    lossless = frozenset({"fp32", "bf16"})
    assert not m.router.usable_host(ads[member])
    assert m.router.why_unusable(ads[member]) == "host node-m is below the routing minimum trust"
    int8 = next(a for a in ads.values() if a.descriptor.host == "node-b")
    assert m.router.usable_host(int8) and not m.router.usable_host(int8, lossless)
    assert m.router.why_unusable(int8, lossless) == \
        "holds int8 weights; calls here accept bf16, fp32"
    # every layer is advertised, none by a host a default call may use
    assert m.store.covers("m", SHA, 16)
    assert not m.store.covers("m", SHA, 16, lambda ad: m.router.usable_host(ad, lossless))
    m.add(0, 15, "node-c")
    assert m.store.covers("m", SHA, 16, lambda ad: m.router.usable_host(ad, lossless))


async def test_the_format_a_shard_accepted_with_outlives_its_stale_advertisement() -> None:
    """A host restarted with int8 while its fp32 advertisement lives on: once its ACCEPT
    said int8, the router routes by that until the host advertises anew."""
    m = Mesh()
    sid = m.add(0, 15, "node-b")
    ad = next(iter(m.store.candidates("m", SHA)))
    m.router.note_accept(ad.descriptor, "int8")
    assert m.router.held_format(ad.descriptor) == "int8"
    with pytest.raises(ShardUnavailable, match="holds int8 weights; the call accepts fp32"):
        await m.pick(formats=frozenset({"fp32"}))
    m.add(0, 15, "node-b", fmt="int8", ts=T0 + 1)  # its new advertisement: the news now
    ad = next(iter(m.store.candidates("m", SHA)))
    assert ad.descriptor.shard_id == sid and m.router.held_format(ad.descriptor) == "int8"
    m.add(0, 15, "node-b", ts=T0 + 2)  # and back to fp32, advertised
    ad = next(iter(m.store.candidates("m", SHA)))
    assert m.router.held_format(ad.descriptor) == "fp32"
    assert await m.pick(formats=frozenset({"fp32"})) == ["node-b:0-15"]
