"""Shard health: heartbeats, last seen, online/offline, p95 latency, suspicion (M26 §4.1, §5.4).

Two sources feed a shard's health:

- its host's heartbeats (re-advertisements carrying `ShardHealth`, M26 §5.1), passed in by
  the `ShardStore` (``heartbeat(shard_id, health, at=event ts)``);
- what callers on this node observe (`observe_latency` per step, `mark_suspect` when a
  stream errors or stalls, M26 §5.4).

Rules (all times on the injected wall clock, Unix seconds):

- **online** ⇔ heard of (heartbeat or observed answer) within `offline_after_s` (the
  health timeout: two heartbeats are sent per timeout) and the last heartbeat did not say
  ``online = false``.
- **p95** = the larger of the advertised p95 (the host's compute) and the p95 of the last
  `window` observed round trips (needs `min_samples`): the caller's view includes the
  network, the host's view includes load the caller has not seen yet; the router wants the
  pessimistic one.
- **suspect**: `mark_suspect` makes a shard suspect for `suspect_base_s` × 2^(strikes-1)
  seconds, capped at `suspect_max_s`. Suspicion *decays*: it simply ends when that time
  has passed, and the strike count resets once a shard has gone `suspect_max_s` without a
  new mark. Heartbeats do not clear suspicion (a host can be up while its forwards fail);
  `clear_suspect` does (e.g. after a good session). The router avoids suspect shards.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hearthnet.constants import DEFAULT_TIMEOUT_S
from hearthnet.distributed_inference.directory.descriptors import ShardHealth, ShardID, to_datetime
from hearthnet.stats import percentile


@dataclass(frozen=True, slots=True)
class HealthView:
    """Everything the tracker knows about one shard, at one instant."""

    shard_id: ShardID
    online: bool
    last_seen: float | None  # Unix seconds
    p95_latency_ms: float | None
    advertised_p95_ms: float | None
    observed_p95_ms: float | None
    observed_samples: int
    queue_depth: int
    active_sessions: int
    suspect: bool
    suspect_reason: str | None
    suspect_until: float | None
    strikes: int

    def to_shard_health(self) -> ShardHealth:
        """The spec's `ShardHealth` (M26 §4.1) for this view."""
        return ShardHealth(shard_id=self.shard_id, online=self.online,
                           last_seen=to_datetime(self.last_seen or 0.0),
                           p95_latency_ms=self.p95_latency_ms or 0.0,
                           queue_depth=self.queue_depth, active_sessions=self.active_sessions)


@dataclass(slots=True)
class _State:
    last_heartbeat: float | None = None
    last_seen: float | None = None
    advertised: ShardHealth | None = None
    observed: deque[float] = field(default_factory=deque)
    suspect_until: float | None = None
    suspect_reason: str | None = None
    last_mark: float | None = None
    strikes: int = 0


class ShardHealthTracker:
    """Per-shard health as seen by this node (M26 §5.4).

    Args:
        clock: wall clock (Unix seconds); the store passes event timestamps, so this must
            be the same kind of clock.
        offline_after_s: silence after which a shard counts as offline (health timeout).
        suspect_base_s, suspect_max_s: suspicion length for the first strike and the cap.
        window: observed latencies kept per shard; min_samples: needed for an observed p95.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time,
                 offline_after_s: float = DEFAULT_TIMEOUT_S,
                 suspect_base_s: float = DEFAULT_TIMEOUT_S, suspect_max_s: float = 600.0,
                 window: int = 128, min_samples: int = 5) -> None:
        self._clock = clock
        self.offline_after_s = offline_after_s
        self.suspect_base_s = suspect_base_s
        self.suspect_max_s = max(suspect_base_s, suspect_max_s)
        self.window = max(1, window)
        self.min_samples = max(1, min_samples)
        self._shards: dict[ShardID, _State] = {}

    def _state(self, shard_id: ShardID) -> _State:
        st = self._shards.get(shard_id)
        if st is None:
            st = self._shards[shard_id] = _State()
        return st

    # ---- inputs ----

    def heartbeat(self, shard_id: ShardID, health: ShardHealth | None = None, *,
                  at: float | None = None) -> None:
        """Record a heartbeat (advertisement) seen at `at` (default now); older ones are ignored."""
        at = self._clock() if at is None else at
        st = self._state(shard_id)
        if st.last_heartbeat is not None and at < st.last_heartbeat:
            return
        st.last_heartbeat = at
        st.last_seen = at if st.last_seen is None else max(st.last_seen, at)
        if health is not None:
            st.advertised = health

    def observe_latency(self, shard_id: ShardID, ms: float) -> None:
        """Record one round trip this node observed (it also proves the shard is alive)."""
        if not math.isfinite(ms) or ms < 0:
            return
        st = self._state(shard_id)
        st.observed.append(float(ms))
        while len(st.observed) > self.window:
            st.observed.popleft()
        now = self._clock()
        st.last_seen = now if st.last_seen is None else max(st.last_seen, now)

    def mark_suspect(self, shard_id: ShardID, reason: str) -> float:
        """A stream to this shard errored or stalled; returns when suspicion ends."""
        now = self._clock()
        st = self._state(shard_id)
        if st.last_mark is not None and now - st.last_mark >= self.suspect_max_s:
            st.strikes = 0
        st.strikes += 1
        st.last_mark = now
        length = min(self.suspect_max_s, self.suspect_base_s * 2 ** min(st.strikes - 1, 30))
        st.suspect_until = max(st.suspect_until or 0.0, now + length)
        st.suspect_reason = reason
        return st.suspect_until

    def clear_suspect(self, shard_id: ShardID) -> None:
        """Forget suspicion and strikes (the shard served a session well)."""
        st = self._shards.get(shard_id)
        if st is not None:
            st.suspect_until, st.suspect_reason, st.strikes, st.last_mark = None, None, 0, None

    def forget(self, shard_id: ShardID) -> None:
        """Drop everything about a shard (it was withdrawn)."""
        self._shards.pop(shard_id, None)

    # ---- queries ----

    def is_suspect(self, shard_id: ShardID) -> bool:
        st = self._shards.get(shard_id)
        return st is not None and st.suspect_until is not None and \
            self._clock() < st.suspect_until

    def online(self, shard_id: ShardID) -> bool:
        st = self._shards.get(shard_id)
        if st is None or st.last_seen is None:
            return False
        if st.advertised is not None and not st.advertised.online and \
                st.last_heartbeat is not None and st.last_heartbeat >= st.last_seen:
            return False
        return self._clock() - st.last_seen <= self.offline_after_s

    def last_seen(self, shard_id: ShardID) -> float | None:
        st = self._shards.get(shard_id)
        return None if st is None else st.last_seen

    def observed_p95(self, shard_id: ShardID) -> float | None:
        st = self._shards.get(shard_id)
        if st is None or len(st.observed) < self.min_samples:
            return None
        return percentile(st.observed, 95.0)

    def p95(self, shard_id: ShardID) -> float | None:
        """max(advertised p95, observed p95), whichever exist; None when neither does."""
        st = self._shards.get(shard_id)
        if st is None:
            return None
        values = [v for v in (st.advertised.p95_latency_ms if st.advertised else None,
                              self.observed_p95(shard_id)) if v is not None]
        return max(values) if values else None

    def view(self, shard_id: ShardID) -> HealthView | None:
        st = self._shards.get(shard_id)
        if st is None:
            return None
        adv = st.advertised
        return HealthView(
            shard_id=shard_id, online=self.online(shard_id), last_seen=st.last_seen,
            p95_latency_ms=self.p95(shard_id),
            advertised_p95_ms=adv.p95_latency_ms if adv else None,
            observed_p95_ms=self.observed_p95(shard_id), observed_samples=len(st.observed),
            queue_depth=adv.queue_depth if adv else 0,
            active_sessions=adv.active_sessions if adv else 0,
            suspect=self.is_suspect(shard_id),
            suspect_reason=st.suspect_reason if self.is_suspect(shard_id) else None,
            suspect_until=st.suspect_until if self.is_suspect(shard_id) else None,
            strikes=st.strikes)

    def snapshot(self) -> dict[ShardID, HealthView]:
        """A view of every shard the tracker knows."""
        return {sid: v for sid in sorted(self._shards) if (v := self.view(sid)) is not None}

