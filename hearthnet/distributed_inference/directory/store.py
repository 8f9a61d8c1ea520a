"""The ShardStore: the read model of shard advertisements (M26 §5.1).

A fold over the event log: `apply(event)` for each live event, `rebuild(log.all_events())`
after a restart. It holds the current advertisement of every shard, indexed by
``(model_id, weights_sha256, layer_range)``, and answers the router's queries.

Fold rules:

- `experimental.shard.advertised` (first advertisement or heartbeat) replaces the shard's
  previous one if its ``(origin, seq)`` is newer; it must come from the shard's own host
  (``descriptor.host == event.origin``), otherwise it is ignored — a node cannot advertise
  shards on another node.
- `experimental.shard.withdrawn` from the host removes the shard.
- An advertisement **expires** `expiry_s` after its event timestamp (the spec's
  4 × `shard_health_timeout_seconds`, §5.1). Timestamps are the host's clock, so nodes'
  clocks must agree to within a few seconds (NTP); a timestamp in the future is clamped
  to this node's clock when applied. Expiry is evaluated lazily on each query against the
  injected clock, so tests move time instead of sleeping.
- **hop weight** (M26 §5.2) is assigned here, not by the advertiser: 1.0 when the
  endpoint's host is an IP inside one of `lan_networks`, ``localhost``, a single-label
  name or a ``.local``/``.lan``/``.home.arpa`` name; 2.0 otherwise (another network —
  reachable, but less preferred).

When given a `ShardHealthTracker`, every applied advertisement is also a heartbeat for it
(at the event's timestamp) and a withdrawal makes it forget the shard.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from hearthnet.constants import DEFAULT_LAN_NETWORKS
from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    WITHDRAWN,
    ShardDescriptor,
    ShardHealth,
    ShardID,
    parse_advertisement,
    parse_withdrawal,
)
from hearthnet.distributed_inference.directory.health import ShardHealthTracker
from hearthnet.errors import BadRequest, PeerDataError
from hearthnet.mesh.eventlog import Event
from hearthnet.observability import Metrics, get_logger

LAN_HOP_WEIGHT = 1.0
REMOTE_HOP_WEIGHT = 2.0
_LAN_SUFFIXES = (".local", ".lan", ".home.arpa", ".internal")

StoreKey = tuple[str, str, tuple[int, int]]

_log = get_logger("distributed_inference.store")


@dataclass(frozen=True, slots=True)
class Advertisement:
    """The current advertisement of one shard."""

    descriptor: ShardDescriptor
    health: ShardHealth | None
    seen_at: float  # event timestamp (Unix seconds), clamped to the local clock
    origin: str
    seq: int

    @property
    def shard_id(self) -> ShardID:
        return self.descriptor.shard_id

    @property
    def key(self) -> StoreKey:
        d = self.descriptor
        return (d.model_id, d.weights_sha256, d.layer_range)


class ShardStore:
    """Current shard advertisements, expiring `expiry_s` after they were made.

    Args:
        expiry_s: 4 × ``shard_health_timeout_seconds`` (M26 §5.1).
        clock: wall clock, Unix seconds.
        lan_networks: CIDRs counted as this LAN for the hop weight.
        metrics: ``advertisements_live`` is kept up to date.
        tracker: optional health tracker fed with heartbeats.
    """

    def __init__(self, expiry_s: float, *, clock: Callable[[], float] = time.time,
                 lan_networks: Sequence[str] = DEFAULT_LAN_NETWORKS,
                 metrics: Metrics | None = None,
                 tracker: ShardHealthTracker | None = None) -> None:
        if expiry_s <= 0:
            raise BadRequest("advertisement expiry must be positive")
        self.expiry_s = expiry_s
        self.clock = clock
        self.metrics = metrics
        self.tracker = tracker
        self._lan = [ipaddress.ip_network(n, strict=False) for n in lan_networks]
        self._ads: dict[ShardID, Advertisement] = {}
        self._by_key: dict[StoreKey, set[ShardID]] = {}
        # newest (origin, seq) applied per shard, kept after withdrawal so that an older
        # advertisement arriving late cannot resurrect a withdrawn shard
        self._latest: dict[ShardID, tuple[str, int]] = {}
        # each host's newest incarnation (boot id) and the seq it was first seen at: a
        # restarted host's first advertisement drops every one of its old process's at
        # once (they would otherwise mislead routing and placement until they expire)
        self._boot: dict[str, tuple[str, int]] = {}

    # ---- folding ----

    def apply(self, event: Event) -> bool:
        """Fold one event; True if the read model changed. Never raises on bad payloads."""
        if event.type == ADVERTISED:
            return self._apply_advertised(event)
        if event.type == WITHDRAWN:
            return self._apply_withdrawn(event)
        return False

    def rebuild(self, events: Iterable[Event]) -> int:
        """Clear and fold `events` (e.g. `EventLog.all_events()`); returns live shards."""
        self._ads.clear()
        self._by_key.clear()
        self._latest.clear()
        self._boot.clear()
        for ev in events:
            self.apply(ev)
        return len(self.live())

    def _newer(self, shard_id: ShardID, ev: Event) -> bool:
        prev = self._latest.get(shard_id)
        return prev is None or prev[0] != ev.origin or ev.seq > prev[1]

    def _apply_advertised(self, ev: Event) -> bool:
        try:
            desc, health = parse_advertisement(ev.payload)
        except PeerDataError as e:
            _log.warning("bad_advertisement", origin=ev.origin, seq=ev.seq, error=e.message)
            return False
        if desc.host != ev.origin:
            _log.warning("foreign_advertisement", origin=ev.origin, seq=ev.seq,
                         shard_id=desc.shard_id)
            return False
        if not self._current_incarnation(desc.host, desc.incarnation, ev.seq):
            return False
        if not self._newer(desc.shard_id, ev):
            return False
        self._latest[desc.shard_id] = (ev.origin, ev.seq)
        desc = dataclasses.replace(desc, hop_weight=self.hop_weight(desc.endpoint))
        seen = min(ev.ts, self.clock())
        ad = Advertisement(desc, health, seen, ev.origin, ev.seq)
        self._remove(desc.shard_id)
        self._ads[desc.shard_id] = ad
        self._by_key.setdefault(ad.key, set()).add(desc.shard_id)
        if self.tracker is not None:
            self.tracker.heartbeat(desc.shard_id, health, at=seen)
        self._update_gauge()
        return True

    def _current_incarnation(self, host: str, incarnation: str, seq: int) -> bool:
        """False for an advertisement of a host's superseded incarnation; an advertisement
        of a newer one removes the host's older incarnations' advertisements."""
        if not incarnation:  # a peer of an older release: no boot id, nothing to compare
            return True
        known = self._boot.get(host)
        if known is None or known[0] == incarnation:
            if known is None:
                self._boot[host] = (incarnation, seq)
            return True
        if seq < known[1]:  # the old process's, arriving late (the same origin's seq grows)
            return False
        self._boot[host] = (incarnation, seq)
        stale = [sid for sid, ad in self._ads.items() if ad.descriptor.host == host
                 and ad.descriptor.incarnation != incarnation]
        for sid in stale:
            self._remove(sid)
        if stale:
            _log.info("incarnation_superseded", host=host, dropped=len(stale))
            self._update_gauge()
        return True

    def _apply_withdrawn(self, ev: Event) -> bool:
        try:
            shard_id, _reason = parse_withdrawal(ev.payload)
        except PeerDataError as e:
            _log.warning("bad_withdrawal", origin=ev.origin, seq=ev.seq, error=e.message)
            return False
        if not shard_id.endswith("@" + ev.origin) or not self._newer(shard_id, ev):
            return False
        self._latest[shard_id] = (ev.origin, ev.seq)
        changed = self._remove(shard_id)
        if self.tracker is not None:
            self.tracker.forget(shard_id)
        self._update_gauge()
        return changed

    def _remove(self, shard_id: ShardID) -> bool:
        ad = self._ads.pop(shard_id, None)
        if ad is None:
            return False
        ids = self._by_key.get(ad.key)
        if ids is not None:
            ids.discard(shard_id)
            if not ids:
                del self._by_key[ad.key]
        return True

    # ---- expiry ----

    def expires_at(self, ad: Advertisement) -> float:
        return ad.seen_at + self.expiry_s

    def expire(self) -> int:
        """Drop expired advertisements now; returns how many were dropped."""
        now = self.clock()
        dead = [sid for sid, ad in self._ads.items() if now >= ad.seen_at + self.expiry_s]
        for sid in dead:
            self._remove(sid)
        if dead:
            _log.info("advertisements_expired", shard_ids=dead)
        self._update_gauge()
        return len(dead)

    def _update_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.advertisements_live.set(len(self._ads))

    # ---- queries (each drops expired advertisements first) ----

    def live(self) -> list[Advertisement]:
        """Every unexpired advertisement, ordered by shard id."""
        self.expire()
        return [self._ads[s] for s in sorted(self._ads)]

    def get(self, shard_id: ShardID) -> Advertisement | None:
        self.expire()
        return self._ads.get(shard_id)

    def candidates(self, model_id: str, weights_sha256: str | None = None
                   ) -> list[Advertisement]:
        """Live advertisements of `model_id` (and `weights_sha256` when given)."""
        return [a for a in self.live() if a.descriptor.model_id == model_id
                and (weights_sha256 is None or a.descriptor.weights_sha256 == weights_sha256)]

    def covers(self, model_id: str, weights_sha256: str, num_layers: int,
               usable: Callable[[Advertisement], bool] | None = None) -> bool:
        """Whether live advertisements of this model and hash hold every one of its
        `num_layers` layers: a pipeline of it can be built (M26 §4.3). `usable`: only
        those a call may use count (`ShardRouter.usable_host`)."""
        held: set[int] = set()
        for a in self.candidates(model_id, weights_sha256):
            if usable is not None and not usable(a):
                continue
            lo, hi = a.descriptor.layer_range
            held.update(range(max(lo, 0), min(hi, num_layers - 1) + 1))
        return num_layers > 0 and len(held) == num_layers

    def by_key(self, model_id: str, weights_sha256: str, layer_range: tuple[int, int]
               ) -> list[Advertisement]:
        """Live advertisements of exactly this model, hash and hosted range."""
        self.expire()
        lo, hi = layer_range
        ids = self._by_key.get((model_id, weights_sha256, (lo, hi)), set())
        return [self._ads[s] for s in sorted(ids)]

    def index_keys(self) -> list[StoreKey]:
        """Every live (model_id, weights_sha256, layer_range)."""
        self.expire()
        return sorted(self._by_key)

    def models(self) -> set[str]:
        """Model ids with at least one live shard."""
        return {a.descriptor.model_id for a in self.live()}

    def hashes(self, model_id: str) -> set[str]:
        """Weights hashes advertised for `model_id`."""
        return {a.descriptor.weights_sha256 for a in self.candidates(model_id)}

    def health(self, shard_id: ShardID) -> ShardHealth | None:
        """The health carried by the shard's latest heartbeat, if any."""
        ad = self.get(shard_id)
        return None if ad is None else ad.health

    def __len__(self) -> int:
        return len(self.live())

    # ---- hop weight ----

    def hop_weight(self, endpoint: str) -> float:
        """1.0 for an endpoint on this LAN, 2.0 otherwise (see the module docstring)."""
        try:
            host = urlsplit(endpoint).hostname or ""
        except ValueError:
            return REMOTE_HOP_WEIGHT
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            name = host.lower().rstrip(".")
            lan = name == "localhost" or ("." not in name and name != "") or \
                name.endswith(_LAN_SUFFIXES)
            return LAN_HOP_WEIGHT if lan else REMOTE_HOP_WEIGHT
        lan = any(ip.version == n.version and ip in n for n in self._lan)
        return LAN_HOP_WEIGHT if lan else REMOTE_HOP_WEIGHT
