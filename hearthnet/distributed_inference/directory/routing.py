"""The ShardRouter: pick shards covering layers 0..N-1 (M26 §4.4, §5.2, §5.6).

`pick` filters the live advertisements to the requested model and weights hash, then
covers the layers greedily from layer 0 (M26 §5.2). At each cursor, among the eligible
shards that contain the cursor, it takes the best by, in order:

1. healthy before unhealthy — suspect or offline shards (`ShardHealthTracker`) are used
   only when nothing else contains the cursor;
2. not this node (a soft "avoid self as shard", M26 §4.4; the hard rule is below);
3. lower hop weight — prefer the LAN (M26 §5.2);
4. lower queue depth: the host's advertised queue depth plus the sessions this router has
   reserved on the shard;
5. further reach — the shard that covers more layers from the cursor, so fewer hops;
6. lower p95 latency, then shard id (deterministic).

It then runs the chosen shard over the sub-range ``cursor..min(hi, N-1)`` and moves the
cursor past it, so overlapping shards chain at any boundary (DESIGN.md decision 2):
shards 0-7, 4-11, 8-15 of a 16-layer model give {0-7, 8-15} (M26 §8.1).

Eligible means: same model and hash, hosted range inside the model (``hi < N``), not in
`exclude`, its host not probed down (`host_down`, the node's `HostLiveness`: a ``kill -9``ed
host refuses connections long before its heartbeats are missed), and below its
`max_concurrent_streams` (M26 §5.6): a shard's load is
``max(advertised active_sessions - our sessions there ended since, sessions reserved
here)`` — the advertisement already counts our open sessions when it was made, so the two
are not added, and one made while our previous calls ran (re-advertised only every
heartbeat) does not keep the shard "full" once they have ended (M26 §5.6). Unless
`allow_self_as_shard`, a shard of this node is never the **first** stage (embedding and
sampling stay on the orchestrator, M26 §5.2).

`max_shards_per_request`: if the greedy cover needs more stages, the router falls back to
the minimum-stage cover (furthest reach first); if even that is too long it fails.

Failure: `WeightsMismatch` when every uncovered layer is covered only by shards with
another weights hash; otherwise `ShardUnavailable` naming the uncovered layers and why the
shards there were not usable. Both carry ``uncovered=[[lo, hi], ...]`` in `details`;
``busy=True`` when every uncovered layer has a shard that is only at its
`max_concurrent_streams` (busy, not gone: the orchestrator waits for a slot).
`wait_for_release` returns when one of this node's pipelines is released; `busy_wait` gives
the wait for a slot that opening a call and replacing a failed stage share (`BusyWait`).

Reservations: `pick` and `repick` reserve one session on each chosen shard (unless
``reserve=False``) so that concurrent pipelines from this node respect
`max_concurrent_streams`; the caller must `release(pipeline)` when the call ends.

`repick(pipeline, exclude)` keeps every stage whose shard is not excluded (their sessions
and KV caches stay useful) and replaces each run of excluded stages by a cover of exactly
the same layers, using shards not already in the pipeline. If that is impossible or too
long it picks a whole new pipeline avoiding `exclude`. The new pipeline keeps the
`pipeline_id`; the reservations move with it (released for dropped stages, taken for new
ones); if repick fails, the old reservations are left as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from hearthnet.constants import DEFAULT_TIMEOUT_S
from hearthnet.distributed_inference.directory.descriptors import (
    Pipeline,
    PipelineStage,
    ShardDescriptor,
    ShardID,
    to_datetime,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.distributed_inference.directory.store import Advertisement, ShardStore
from hearthnet.errors import BadRequest, ShardUnavailable, WeightsMismatch
from hearthnet.observability import get_logger

if TYPE_CHECKING:
    from hearthnet.config import DistributedInferenceSection

_log = get_logger("distributed_inference.routing")


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    """The routing part of ``[research.distributed_inference]`` (M26 §7)."""

    max_shards_per_request: int = 16
    allow_self_as_shard: bool = False
    shard_health_timeout_seconds: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_config(cls, section: DistributedInferenceSection) -> RoutingSettings:
        """From the node config's ``[research.distributed_inference]`` section."""
        return cls(max_shards_per_request=int(section.max_shards_per_request),
                   allow_self_as_shard=bool(section.allow_self_as_shard),
                   shard_health_timeout_seconds=float(section.shard_health_timeout_seconds))


@dataclass(frozen=True, slots=True)
class _Cand:
    ad: Advertisement
    unhealthy: bool
    is_self: bool
    queue: int
    p95: float

    @property
    def d(self) -> ShardDescriptor:
        return self.ad.descriptor


class ShardRouter:
    """Chooses the shards of a pipeline (M26 §4.4).

    Args:
        store: the advertisement read model.
        settings: routing limits and preferences.
        health: when given, suspect/offline shards are avoided and p95 breaks ties.
        self_node_id: this node's id (for the "avoid self as first shard" rule).
        host_allowed: trust filter — whether activations may go to a shard on this host
            (M26 §5.9: the daemon passes "member at ``route_min_trust`` or higher");
            shards of other hosts are never picked. None allows every host.
        host_down: whether a host's listener is probed dead (`HostLiveness.is_down`): its
            shards are never picked. None: no probe.
    """

    def __init__(self, store: ShardStore, settings: RoutingSettings | None = None,
                 health: ShardHealthTracker | None = None, *,
                 self_node_id: str | None = None,
                 host_allowed: Callable[[str], bool] | None = None,
                 host_down: Callable[[str], bool] | None = None) -> None:
        self.store = store
        self.host_allowed = host_allowed
        self.host_down = host_down
        self.settings = settings or RoutingSettings()
        self.health = health
        self.self_node_id = self_node_id
        self._in_use: dict[ShardID, int] = {}
        self._ended: dict[ShardID, list[float]] = {}  # when our sessions there were released
        self._released = asyncio.Event()
        self.releases = 0  # pipelines released so far (`wait_for_release`)
        # what a shard's ACCEPT said it holds, against the advertisement it was picked by:
        # the truth until that shard advertises anew (a host restarted with another format
        # while its gossip was down still has its old advertisement here)
        self._accepted: dict[ShardID, tuple[ShardDescriptor, str]] = {}

    # ---- what a shard really holds ----

    def note_accept(self, shard: ShardDescriptor, weights_format: str) -> None:
        """Record the format `shard`'s ACCEPT stated (the orchestrator calls this for every
        session it opens); a new advertisement of that shard replaces it."""
        if weights_format == shard.weights_format:
            self._accepted.pop(shard.shard_id, None)
        else:
            self._accepted[shard.shard_id] = (shard, weights_format)

    def held_format(self, d: ShardDescriptor) -> str:
        """The format `d`'s shard holds as far as this node knows now: its last ACCEPT's
        when that came after this advertisement, else the advertised one."""
        seen = self._accepted.get(d.shard_id)
        if seen is None:
            return d.weights_format
        if seen[0] != d:  # advertised anew since: the new advertisement is the news
            del self._accepted[d.shard_id]
            return d.weights_format
        return seen[1]

    # ---- reservations (M26 §5.6) ----

    def in_use(self, shard_id: ShardID) -> int:
        """Sessions this node holds on `shard_id` through reserved pipelines."""
        return self._in_use.get(shard_id, 0)

    def reserve(self, pipeline: Pipeline) -> None:
        """Count one session on each stage's shard."""
        self._reserve_ids(pipeline.shard_ids)

    def release(self, pipeline: Pipeline) -> None:
        """Undo `reserve` (call when the pipeline's sessions are closed)."""
        self._release_ids(pipeline.shard_ids)

    def _reserve_ids(self, ids: Sequence[ShardID]) -> None:
        for sid in ids:
            self._in_use[sid] = self._in_use.get(sid, 0) + 1

    def _release_ids(self, ids: Sequence[ShardID]) -> None:
        now = self.store.clock()
        for sid in ids:
            n = self._in_use.get(sid, 0) - 1
            if n > 0:
                self._in_use[sid] = n
            else:
                self._in_use.pop(sid, None)
            # ends before the shard's current advertisement are counted in it, and in every
            # later one: dropped here, so the list stays as short as the releases since
            ad = self.store.get(sid)
            self._ended[sid] = [t for t in self._ended.get(sid, ())
                                if ad is not None and t >= ad.seen_at] + [now]
        self.releases += 1
        self._released.set()

    async def wait_for_release(self, since: int, timeout_s: float) -> None:
        """Return once a pipeline of this node has been released after `releases` was
        `since` (at once if one was already), or after `timeout_s`."""
        if self.releases > since:
            return
        self._released.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._released.wait()

    def busy_wait(self, timeout_s: float) -> BusyWait:
        """A wait for busy shards' slots that ends `timeout_s` from now (`BusyWait`)."""
        return BusyWait(self, timeout_s)

    def _ended_since(self, ad: Advertisement) -> int:
        """Our sessions on `ad`'s shard released since the advertisement arrived (it
        counted them, if they were open when it was made)."""
        return sum(t >= ad.seen_at for t in self._ended.get(ad.shard_id, ()))

    # ---- picking ----

    async def pick(self, model_id: str, weights_sha256: str, total_layers: int, *,
                   exclude: Collection[ShardID] = (), reserve: bool = True,
                   formats: Collection[str] | None = None) -> Pipeline:
        """A pipeline covering layers ``0..total_layers-1`` of the model (M26 §5.2).

        `formats`: the weight formats the call accepts (DESIGN.md decision 10; None: any).

        Raises:
            BadRequest: `total_layers` < 1.
            ShardUnavailable: a layer no usable shard covers, or too many shards needed.
            WeightsMismatch: the uncovered layers are only covered by other weights.
        """
        if total_layers < 1:
            raise BadRequest(f"total_layers must be >= 1, not {total_layers}")
        cands = self._candidates(model_id, weights_sha256, total_layers, set(exclude), formats)
        stages = self._cover(cands, 0, total_layers - 1, model_id, weights_sha256,
                             total_layers, set(exclude), formats)
        p = Pipeline.from_stages(uuid.uuid4().hex, model_id, weights_sha256, total_layers,
                                 stages, self._now())
        if reserve:
            self.reserve(p)
        _log.debug("pipeline_picked", pipeline_id=p.pipeline_id, model_id=model_id,
                   stages=[f"{s.shard.shard_id}[{s.start}-{s.end}]" for s in stages])
        return p

    async def repick(self, pipeline: Pipeline, exclude: Collection[ShardID], *,
                     reserve: bool = True, formats: Collection[str] | None = None
                     ) -> Pipeline:
        """Replace the excluded stages of `pipeline` (M26 §4.4, §5.4); see module docstring.

        Raises:
            ShardUnavailable / WeightsMismatch: as `pick`.
        """
        excl = set(exclude)
        stages = pipeline.stages
        if not any(s.shard.shard_id in excl for s in stages):
            return pipeline
        model, sha, total = pipeline.model_id, pipeline.weights_sha256, pipeline.total_layers
        kept = {s.shard.shard_id for s in stages if s.shard.shard_id not in excl}
        if reserve:  # our own reservations must not make replacements look full
            self._release_ids(pipeline.shard_ids)
        try:
            new_stages = self._patch(stages, excl, kept, model, sha, total, formats)
            if new_stages is None:
                new_stages = self._cover(self._candidates(model, sha, total, excl, formats), 0,
                                         total - 1, model, sha, total, excl, formats)
        except BaseException:
            if reserve:
                self._reserve_ids(pipeline.shard_ids)
            raise
        p = Pipeline.from_stages(pipeline.pipeline_id, model, sha, total, new_stages,
                                 self._now())
        if reserve:
            self.reserve(p)
        _log.info("pipeline_repicked", pipeline_id=p.pipeline_id, excluded=sorted(excl),
                  stages=[f"{s.shard.shard_id}[{s.start}-{s.end}]" for s in new_stages])
        return p

    def _patch(self, stages: list[PipelineStage], excl: set[ShardID], kept: set[ShardID],
               model: str, sha: str, total: int, formats: Collection[str] | None
               ) -> list[PipelineStage] | None:
        """Keep good stages, re-cover each run of excluded ones; None if that fails."""
        cands = self._candidates(model, sha, total, excl | kept, formats)
        out: list[PipelineStage] = []
        i = 0
        while i < len(stages):
            if stages[i].shard.shard_id not in excl:
                out.append(stages[i])
                i += 1
                continue
            j = i
            while j + 1 < len(stages) and stages[j + 1].shard.shard_id in excl:
                j += 1
            try:
                out.extend(self._cover(cands, stages[i].start, stages[j].end, model, sha,
                                       total, excl, formats))
            except (ShardUnavailable, WeightsMismatch):
                return None
            i = j + 1
        if len(out) > self.settings.max_shards_per_request:
            return None
        return out

    # ---- the cover ----

    def _candidates(self, model: str, sha: str, total: int, excl: set[ShardID],
                    formats: Collection[str] | None) -> list[_Cand]:
        out = []
        for ad in self.store.candidates(model, sha):
            if self._usable(ad, total, excl, formats) and not self._full(ad):
                out.append(self._cand(ad))
        return out

    def _usable(self, ad: Advertisement, total: int, excl: set[ShardID],
                formats: Collection[str] | None) -> bool:
        """Eligible but for its load (see the module docstring)."""
        d = ad.descriptor
        return d.shard_id not in excl and d.hi < total and self.usable_host(ad, formats)

    def usable_host(self, ad: Advertisement, formats: Collection[str] | None = None) -> bool:
        """The one definition of a shard a call may use, but for its load and the call's
        own exclusions (M26 §5.3, §5.9): its host is trusted at `route_min_trust`, not
        probed down, and its format as last stated is one of `formats` (when given).
        Automatic hosting and every coverage display count only these, so a layer shown
        covered is one a call can be routed to."""
        d = ad.descriptor
        return not self._down(d.host) and self._trusted(d.host) \
            and self._format_ok(d, formats)

    def why_unusable(self, ad: Advertisement, formats: Collection[str] | None = None
                     ) -> str | None:
        """Why `usable_host` is false, for a person (None when it is true)."""
        d = ad.descriptor
        if self._down(d.host):
            return f"host {d.host} refuses connections (probed down)"
        if not self._trusted(d.host):
            return f"host {d.host} is below the routing minimum trust"
        if not self._format_ok(d, formats):
            return (f"holds {self.held_format(d)} weights; calls here accept "
                    f"{', '.join(sorted(formats or ()))}")
        return None

    def _format_ok(self, d: ShardDescriptor, formats: Collection[str] | None) -> bool:
        """Whether the call accepts the shard's weight format (DESIGN.md decision 10), as
        its last ACCEPT stated it when that differs from the advertisement."""
        return formats is None or self.held_format(d) in formats

    def _trusted(self, host: str) -> bool:
        return self.host_allowed is None or self.host_allowed(host)

    def _down(self, host: str) -> bool:
        return host != self.self_node_id and self.host_down is not None and \
            self.host_down(host)

    def _full(self, ad: Advertisement) -> bool:
        active = ad.health.active_sessions if ad.health is not None else 0
        load = max(active - self._ended_since(ad), self.in_use(ad.shard_id))
        return load >= ad.descriptor.max_concurrent_streams

    def _cand(self, ad: Advertisement) -> _Cand:
        sid = ad.shard_id
        if self.health is not None:
            unhealthy = self.health.is_suspect(sid) or not self.health.online(sid)
            p95 = self.health.p95(sid)
        else:
            timeout = self.settings.shard_health_timeout_seconds
            unhealthy = self.store.clock() - ad.seen_at > timeout or \
                (ad.health is not None and not ad.health.online)
            p95 = ad.health.p95_latency_ms if ad.health is not None else None
        queue = (ad.health.queue_depth if ad.health is not None else 0) + self.in_use(sid)
        return _Cand(ad, unhealthy, ad.descriptor.host == self.self_node_id, queue,
                     math.inf if p95 is None else p95)

    def _first_ok(self, c: _Cand, cursor: int) -> bool:
        return cursor != 0 or self.settings.allow_self_as_shard or not c.is_self

    def _cover(self, cands: list[_Cand], lo: int, hi: int, model: str, sha: str,
               total: int, excl: set[ShardID], formats: Collection[str] | None = None
               ) -> list[PipelineStage]:
        """Stages covering exactly ``lo..hi``: greedy, then minimum-stage fallback."""
        stages = self._greedy(cands, lo, hi, best_reach=False)
        if stages is None:
            self._fail(cands, lo, hi, model, sha, total, excl, formats)
        assert stages is not None
        limit = self.settings.max_shards_per_request
        if len(stages) > limit:
            shortest = self._greedy(cands, lo, hi, best_reach=True)
            if shortest is None or len(shortest) > limit:
                n = len(shortest) if shortest is not None else len(stages)
                raise ShardUnavailable(
                    f"covering layers {lo}-{hi} of {model} needs {n} shards but "
                    f"max_shards_per_request is {limit}; raise it or host larger shards",
                    model_id=model, uncovered=[], needed=n, limit=limit)
            stages = shortest
        return stages

    def _greedy(self, cands: list[_Cand], lo: int, hi: int, *, best_reach: bool
                ) -> list[PipelineStage] | None:
        stages: list[PipelineStage] = []
        cursor = lo
        while cursor <= hi:
            here = [c for c in cands if c.d.contains(cursor) and self._first_ok(c, cursor)]
            if not here:
                return None
            if best_reach:
                best = min(here, key=lambda c: (-min(c.d.hi, hi), *self._rank(c, hi)))
            else:
                best = min(here, key=lambda c: self._rank(c, hi))
            end = min(best.d.hi, hi)
            stages.append(PipelineStage(best.d, cursor, end))
            cursor = end + 1
        return stages

    @staticmethod
    def _rank(c: _Cand, hi: int) -> tuple[Any, ...]:
        return (c.unhealthy, c.is_self, c.d.hop_weight, c.queue, -min(c.d.hi, hi), c.p95,
                c.d.shard_id)

    def _fail(self, cands: list[_Cand], lo: int, hi: int, model: str, sha: str,
              total: int, excl: set[ShardID], formats: Collection[str] | None = None) -> None:
        """Raise the error explaining why ``lo..hi`` cannot be covered."""
        covered = [False] * (hi - lo + 1)
        for c in cands:
            for layer in range(max(lo, c.d.lo), min(hi, c.d.hi) + 1):
                if self._first_ok(c, layer):
                    covered[layer - lo] = True
        missing = [lo + i for i, ok in enumerate(covered) if not ok]
        ranges = _ranges(missing)
        where = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)
        same_model = self.store.candidates(model)
        others = [a for a in same_model if a.descriptor.weights_sha256 != sha]
        if missing and others and all(
                any(a.descriptor.contains(x) for a in others) for x in missing):
            hashes = sorted({a.descriptor.weights_sha256[:12] for a in others})
            raise WeightsMismatch(
                f"layers {where} of {model} are only served with other weights "
                f"({', '.join(hashes)}…), not {sha[:12]}…; import the same model files on "
                "every node", model_id=model, uncovered=ranges, requested=sha,
                advertised=sorted({a.descriptor.weights_sha256 for a in others}))
        reasons = self._reasons(same_model, sha, missing, total, excl, formats)
        busy = bool(missing) and all(any(self._only_busy(a, x, sha, total, excl, formats)
                                         for a in same_model) for x in missing)
        if not same_model:
            known = ", ".join(sorted(self.store.models())) or "none"
            detail = f"no live shard advertises {model} (models advertised: {known})"
        else:
            detail = f"no usable shard of {model} (weights {sha[:12]}…) covers layers {where}"
            if reasons:
                detail += " (" + "; ".join(reasons) + ")"
        raise ShardUnavailable(detail + "; start a node hosting those layers or wait for "
                               "busy shards", model_id=model, uncovered=ranges, busy=busy)

    def _only_busy(self, ad: Advertisement, layer: int, sha: str, total: int,
                   excl: set[ShardID], formats: Collection[str] | None) -> bool:
        """`ad`'s shard would cover `layer` but is at its `max_concurrent_streams`."""
        d = ad.descriptor
        return d.weights_sha256 == sha and d.contains(layer) \
            and self._usable(ad, total, excl, formats) \
            and self._first_ok(self._cand(ad), layer) and self._full(ad)

    def _reasons(self, same_model: list[Advertisement], sha: str, missing: list[int],
                 total: int, excl: set[ShardID], formats: Collection[str] | None = None
                 ) -> list[str]:
        out = []
        for ad in same_model:
            d = ad.descriptor
            if d.weights_sha256 != sha or not any(d.contains(x) for x in missing):
                continue
            if d.shard_id in excl:
                out.append(f"{d.shard_id} excluded")
            elif self._down(d.host):
                out.append(f"{d.shard_id}: host {d.host} refuses connections (probed down)")
            elif not self._format_ok(d, formats):
                out.append(f"{d.shard_id} holds {self.held_format(d)} weights; the call accepts "
                           f"{', '.join(sorted(formats or ()))} (params.weights)")
            elif not self._trusted(d.host):
                out.append(f"{d.shard_id}: host {d.host} is below the routing minimum trust")
            elif d.hi >= total:
                out.append(f"{d.shard_id} claims layers beyond the model's {total}")
            elif self._full(ad):
                out.append(f"{d.shard_id} at max_concurrent_streams "
                           f"({d.max_concurrent_streams})")
            elif d.host == self.self_node_id and not self.settings.allow_self_as_shard:
                out.append(f"{d.shard_id} is on this node and allow_self_as_shard is false")
        return out

    def _now(self) -> datetime:
        return to_datetime(self.store.clock())


def _ranges(layers: list[int]) -> list[list[int]]:
    """[0,1,2,5,6] → [[0,2],[5,6]]."""
    out: list[list[int]] = []
    for x in layers:
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


BUSY_BACKOFF_S = 0.05
"""First wait for a busy shard's slot (doubled per try, up to `BUSY_BACKOFF_MAX_S`); one of
this node's own pipelines released ends a wait at once."""
BUSY_BACKOFF_MAX_S = 1.0


class BusyWait:
    """Waiting for a slot on shards at their `max_concurrent_streams` (M26 §5.6), up to a
    deadline: each `wait` returns when one of this node's pipelines is released (its
    sessions closed) or after a back-off doubled per wait (other callers' sessions end
    unseen until their host re-advertises)."""

    def __init__(self, router: ShardRouter, timeout_s: float) -> None:
        self.router = router
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.backoff = BUSY_BACKOFF_S

    async def wait(self, since: int) -> bool:
        """Wait once (`since`: `router.releases` when the shards were found busy); False,
        without waiting, once the deadline has passed."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        await self.router.wait_for_release(since, min(left, self.backoff))
        self.backoff = min(2 * self.backoff, BUSY_BACKOFF_MAX_S)
        return True
