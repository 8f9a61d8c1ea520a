"""The M26 §4.1 dataclasses: what a shard is, how healthy it is, and a pipeline of shards.

Also the payload helpers of the two shard events (DESIGN.md decision 7):

- `experimental.shard.advertised` carries ``{"shard_id", "descriptor", "health"}``. A
  hosting node emits one when a shard is ready and *re-advertises on every heartbeat*
  (every health timeout / 2) with its current `ShardHealth`: a heartbeat **is** a
  re-advertisement, so the store has one fold rule (the latest advertisement of a shard
  wins and refreshes its expiry) and the event log can compact superseded ones.
- `experimental.shard.withdrawn` carries ``{"shard_id", "reason"}`` and is emitted on clean
  shutdown.

Shard ids. The spec's ``"<model_id>:<lo>-<hi>"`` collides when two nodes host the same
range (a spare), so a HearthNet shard id is ``"<model_id>:<lo>-<hi>@<host>"`` (M26 §4.1,
refined). `ShardDescriptor.from_dict` refuses a descriptor whose id does not match its own
fields, so one node cannot claim another node's shard id.

Times on the wire are float Unix seconds; in the dataclasses they are timezone-aware UTC
`datetime`s. `hop_weight` is not the advertiser's to set: the receiving `ShardStore`
assigns it from its LAN networks (M26 §5.2), so `to_dict` includes it for diagnostics but
`ShardStore` overrides whatever arrives.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from hearthnet.distributed_inference.directory.formats import HELD_FORMATS, KERNELS
from hearthnet.errors import BadRequest, PeerDataError
from hearthnet.ids import NODE_ID_RE
from hearthnet.mesh.eventlog import EVENT_TYPES, EventType

ShardID = str
NodeID = str
Endpoint = str

DEVICE_KINDS = ("cpu", "cuda", "mps")
"""Device kinds a shard advertises (DESIGN.md decision 11)."""
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_KERNEL_RE = re.compile(r"^[a-z0-9_.-]{0,32}$")  # a name, not only `formats.KERNELS`: a
# newer release's kernel must not make older peers drop its shard
_INCARNATION_RE = re.compile(r"^[a-z0-9]{0,32}$")


def _shard_subject(payload: Mapping[str, Any]) -> str | None:
    """Both shard events are about their ``shard_id``: the latest one supersedes the rest."""
    sid = payload.get("shard_id")
    return sid if isinstance(sid, str) else None


ADVERTISED = EVENT_TYPES.register(EventType("experimental.shard.advertised", _shard_subject))
"""A shard is ready (and, repeated on every heartbeat, still ready with this health)."""
WITHDRAWN = EVENT_TYPES.register(EventType("experimental.shard.withdrawn", _shard_subject))
"""A shard was stopped cleanly."""


def make_shard_id(model_id: str, lo: int, hi: int, host: NodeID) -> ShardID:
    """The shard id ``"<model_id>:<lo>-<hi>@<host>"`` (M26 §4.1, made unique per host)."""
    return f"{model_id}:{lo}-{hi}@{host}"


def to_datetime(ts: float) -> datetime:
    """Unix seconds → aware UTC datetime."""
    return datetime.fromtimestamp(ts, UTC)


def to_timestamp(dt: datetime) -> float:
    """Aware (or naive, taken as UTC) datetime → Unix seconds."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


@dataclass(frozen=True, slots=True)
class ShardDescriptor:
    """One hosted shard: a contiguous, inclusive range of decoder layers (M26 §4.1).

    Sessions for it are opened at ``<endpoint>/shard``.
    """

    shard_id: ShardID
    model_id: str
    weights_sha256: str
    layer_range: tuple[int, int]  # inclusive
    vram_required_mb: int
    max_concurrent_streams: int
    host: NodeID
    endpoint: Endpoint  # base ws:// or wss:// URI of the host node
    advertised_at: datetime
    hop_weight: float = 1.0  # assigned by the receiving ShardStore (M26 §5.2)
    weights_format: str = "fp32"  # how the layers are held (DESIGN.md decision 10, formats.py)
    device: str = "cpu"  # where the layers run: cpu | cuda | mps (DESIGN.md decision 11)
    device_name: str = ""  # e.g. "NVIDIA H100 80GB HBM3"
    device_memory_mb: int = 0  # the device's total memory
    kernel: str = ""  # what a quantised format's products run in (formats.KERNELS), or ""
    # the host process's boot id: an advertisement of a new incarnation supersedes every
    # advertisement of the host's old one at once (`ShardStore`); "" from older peers
    incarnation: str = ""

    @classmethod
    def create(cls, *, model_id: str, weights_sha256: str, layer_range: tuple[int, int],
               host: NodeID, endpoint: Endpoint, max_concurrent_streams: int,
               vram_required_mb: int = 0, advertised_at: datetime | None = None,
               hop_weight: float = 1.0, weights_format: str = "fp32", device: str = "cpu",
               device_name: str = "", device_memory_mb: int = 0, kernel: str = "",
               incarnation: str = "") -> ShardDescriptor:
        """Build a descriptor with its canonical shard id; validates like `from_dict`."""
        lo, hi = layer_range
        d = cls(shard_id=make_shard_id(model_id, lo, hi, host), model_id=model_id,
                weights_sha256=weights_sha256, layer_range=(lo, hi),
                vram_required_mb=vram_required_mb,
                max_concurrent_streams=max_concurrent_streams, host=host, endpoint=endpoint,
                advertised_at=advertised_at or datetime.now(UTC), hop_weight=hop_weight,
                weights_format=weights_format, device=device, device_name=device_name,
                device_memory_mb=device_memory_mb, kernel=kernel, incarnation=incarnation)
        d.validate()
        return d

    @property
    def lo(self) -> int:
        return self.layer_range[0]

    @property
    def hi(self) -> int:
        return self.layer_range[1]

    @property
    def num_layers(self) -> int:
        return self.hi - self.lo + 1

    def contains(self, layer: int) -> bool:
        """Whether `layer` is inside the hosted range."""
        return self.lo <= layer <= self.hi

    def validate(self) -> None:
        """Raise `BadRequest` naming the first field that is wrong."""
        _check(isinstance(self.model_id, str) and 0 < len(self.model_id) <= 256, "model_id",
               "must be a non-empty string of at most 256 characters")
        _check(isinstance(self.weights_sha256, str) and bool(_SHA256_RE.match(
            self.weights_sha256)), "weights_sha256", "must be 64 lowercase hex digits")
        lo, hi = self.layer_range
        _check(_is_int(lo) and _is_int(hi) and 0 <= lo <= hi, "layer_range",
               "must be two integers 0 <= lo <= hi")
        _check(isinstance(self.host, str) and bool(NODE_ID_RE.match(self.host)), "host",
               "must be a node id ([a-z0-9-]+)")
        _check(self.shard_id == make_shard_id(self.model_id, lo, hi, self.host), "shard_id",
               f"must be {make_shard_id(self.model_id, lo, hi, self.host)!r}")
        _check(isinstance(self.endpoint, str)
               and self.endpoint.startswith(("ws://", "wss://")), "endpoint",
               "must be a ws:// or wss:// URI")
        _check(_is_int(self.max_concurrent_streams) and self.max_concurrent_streams >= 1,
               "max_concurrent_streams", "must be an integer >= 1")
        _check(_is_int(self.vram_required_mb) and self.vram_required_mb >= 0,
               "vram_required_mb", "must be an integer >= 0")
        _check(isinstance(self.hop_weight, (int, float)) and math.isfinite(self.hop_weight)
               and self.hop_weight > 0, "hop_weight", "must be a positive number")
        _check(self.weights_format in HELD_FORMATS, "weights_format",
               f"must be one of {', '.join(HELD_FORMATS)}")
        _check(self.device in DEVICE_KINDS, "device", f"must be one of {list(DEVICE_KINDS)}")
        _check(isinstance(self.device_name, str) and len(self.device_name) <= 128,
               "device_name", "must be a string of at most 128 characters")
        _check(_is_int(self.device_memory_mb) and self.device_memory_mb >= 0,
               "device_memory_mb", "must be an integer >= 0")
        _check(isinstance(self.kernel, str) and bool(_KERNEL_RE.match(self.kernel)), "kernel",
               f"must be a kernel name of at most 32 characters [a-z0-9_.-] (e.g. "
               f"{', '.join(KERNELS)}), or empty")
        _check(isinstance(self.incarnation, str) and bool(_INCARNATION_RE.match(
            self.incarnation)), "incarnation", "must be at most 32 characters [a-z0-9]")

    def to_dict(self) -> dict[str, Any]:
        """A msgpack/JSON-safe dict (the `descriptor` of an advertisement payload)."""
        return {
            "shard_id": self.shard_id,
            "model_id": self.model_id,
            "weights_sha256": self.weights_sha256,
            "layer_range": [self.lo, self.hi],
            "vram_required_mb": self.vram_required_mb,
            "max_concurrent_streams": self.max_concurrent_streams,
            "host": self.host,
            "endpoint": self.endpoint,
            "advertised_at": to_timestamp(self.advertised_at),
            "hop_weight": self.hop_weight,
            "weights_format": self.weights_format,
            "device": self.device,
            "device_name": self.device_name,
            "device_memory_mb": self.device_memory_mb,
            "kernel": self.kernel,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardDescriptor:
        """Parse and validate; raises `BadRequest` naming the bad field."""
        _check(isinstance(d, Mapping), "descriptor", "must be a map")
        lr = _field(d, "layer_range")
        _check(isinstance(lr, Sequence) and not isinstance(lr, (str, bytes)) and len(lr) == 2,
               "layer_range", "must be [lo, hi]")
        at = _field(d, "advertised_at")
        _check(_is_number(at), "advertised_at", "must be Unix seconds")
        desc = cls(shard_id=_field(d, "shard_id"), model_id=_field(d, "model_id"),
                   weights_sha256=_field(d, "weights_sha256"),
                   layer_range=(lr[0], lr[1]),
                   vram_required_mb=d.get("vram_required_mb", 0),
                   max_concurrent_streams=_field(d, "max_concurrent_streams"),
                   host=_field(d, "host"), endpoint=_field(d, "endpoint"),
                   advertised_at=to_datetime(float(at)),
                   hop_weight=d.get("hop_weight", 1.0),
                   weights_format=d.get("weights_format", "fp32"), device=d.get("device", "cpu"),
                   device_name=d.get("device_name", ""),
                   device_memory_mb=d.get("device_memory_mb", 0),
                   kernel=d.get("kernel", ""), incarnation=d.get("incarnation", ""))
        desc.validate()
        return desc


@dataclass(frozen=True, slots=True)
class ShardHealth:
    """Health of one shard as its host reports it on a heartbeat (M26 §4.1)."""

    shard_id: ShardID
    online: bool
    last_seen: datetime
    p95_latency_ms: float
    queue_depth: int
    active_sessions: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "online": self.online,
            "last_seen": to_timestamp(self.last_seen),
            "p95_latency_ms": self.p95_latency_ms,
            "queue_depth": self.queue_depth,
            "active_sessions": self.active_sessions,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardHealth:
        """Parse and validate; raises `BadRequest` naming the bad field."""
        _check(isinstance(d, Mapping), "health", "must be a map")
        sid, online = _field(d, "shard_id"), _field(d, "online")
        seen, p95 = _field(d, "last_seen"), _field(d, "p95_latency_ms")
        qd, act = _field(d, "queue_depth"), d.get("active_sessions", 0)
        _check(isinstance(sid, str) and sid != "", "health.shard_id", "must be a string")
        _check(isinstance(online, bool), "health.online", "must be a boolean")
        _check(_is_number(seen), "health.last_seen", "must be Unix seconds")
        _check(_is_number(p95) and p95 >= 0, "health.p95_latency_ms", "must be >= 0")
        _check(_is_int(qd) and qd >= 0, "health.queue_depth", "must be an integer >= 0")
        _check(_is_int(act) and act >= 0, "health.active_sessions", "must be an integer >= 0")
        return cls(shard_id=sid, online=online, last_seen=to_datetime(float(seen)),
                   p95_latency_ms=float(p95), queue_depth=qd, active_sessions=act)


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One hop of a pipeline: `shard` runs its layers `start..end` (inclusive).

    The sub-range lets overlapping shards chain at any boundary (DESIGN.md decision 2).
    """

    shard: ShardDescriptor
    start: int
    end: int

    def __post_init__(self) -> None:
        if not (self.shard.lo <= self.start <= self.end <= self.shard.hi):
            raise BadRequest(
                f"stage {self.start}-{self.end} is outside shard {self.shard.shard_id}",
                shard_id=self.shard.shard_id, start=self.start, end=self.end)

    @property
    def num_layers(self) -> int:
        return self.end - self.start + 1

    def to_dict(self) -> dict[str, Any]:
        return {"shard": self.shard.to_dict(), "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelineStage:
        _check(isinstance(d, Mapping), "stage", "must be a map")
        start, end = _field(d, "start"), _field(d, "end")
        _check(_is_int(start) and _is_int(end), "stage", "start and end must be integers")
        return cls(ShardDescriptor.from_dict(_field(d, "shard")), start, end)


@dataclass(slots=True)
class Pipeline:
    """An ordered chain of stages covering layers ``0..total_layers-1`` exactly (M26 §4.1).

    Per call, never persisted (M26 §5.2). `ordered_shards` is the spec's field; `stages`
    adds the sub-range each shard runs.
    """

    pipeline_id: str
    model_id: str
    weights_sha256: str
    total_layers: int
    ordered_shards: list[ShardDescriptor]
    stages: list[PipelineStage]
    established_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @classmethod
    def from_stages(cls, pipeline_id: str, model_id: str, weights_sha256: str,
                    total_layers: int, stages: Sequence[PipelineStage],
                    established_at: datetime | None = None) -> Pipeline:
        """Build a pipeline and check that its stages cover every layer exactly once."""
        p = cls(pipeline_id=pipeline_id, model_id=model_id, weights_sha256=weights_sha256,
                total_layers=total_layers, ordered_shards=[s.shard for s in stages],
                stages=list(stages), established_at=established_at or datetime.now(UTC))
        p.validate()
        return p

    def validate(self) -> None:
        """Raise `BadRequest` unless the stages chain 0..total_layers-1 with no gap/overlap."""
        cursor = 0
        for st in self.stages:
            if st.start != cursor:
                raise BadRequest(f"pipeline {self.pipeline_id}: stage {st.shard.shard_id} "
                                 f"starts at layer {st.start}, expected {cursor}")
            if st.shard.model_id != self.model_id or \
                    st.shard.weights_sha256 != self.weights_sha256:
                raise BadRequest(f"pipeline {self.pipeline_id}: stage {st.shard.shard_id} "
                                 "serves another model or weights hash")
            cursor = st.end + 1
        if cursor != self.total_layers:
            raise BadRequest(f"pipeline {self.pipeline_id} covers layers 0-{cursor - 1} "
                             f"of {self.total_layers}")
        if [s.shard for s in self.stages] != self.ordered_shards:
            raise BadRequest(f"pipeline {self.pipeline_id}: ordered_shards != stages")

    @property
    def shard_ids(self) -> list[ShardID]:
        return [s.shard.shard_id for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {
            "pipeline_id": self.pipeline_id,
            "model_id": self.model_id,
            "weights_sha256": self.weights_sha256,
            "total_layers": self.total_layers,
            "stages": [s.to_dict() for s in self.stages],
            "established_at": to_timestamp(self.established_at),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pipeline:
        _check(isinstance(d, Mapping), "pipeline", "must be a map")
        stages = _field(d, "stages")
        _check(isinstance(stages, Sequence) and not isinstance(stages, (str, bytes)),
               "stages", "must be a list")
        at = _field(d, "established_at")
        _check(_is_number(at), "established_at", "must be Unix seconds")
        total = _field(d, "total_layers")
        _check(_is_int(total) and total > 0, "total_layers", "must be a positive integer")
        return cls.from_stages(_field(d, "pipeline_id"), _field(d, "model_id"),
                               _field(d, "weights_sha256"), total,
                               [PipelineStage.from_dict(s) for s in stages], to_datetime(at))


# ---- shard event payloads (DESIGN.md decision 7, M26 §5.1) ----

def advertisement_payload(descriptor: ShardDescriptor,
                          health: ShardHealth | None = None) -> dict[str, Any]:
    """Payload of `experimental.shard.advertised` (first advertisement and heartbeats)."""
    return {"shard_id": descriptor.shard_id, "descriptor": descriptor.to_dict(),
            "health": health.to_dict() if health is not None else None}


def parse_advertisement(payload: Mapping[str, Any]
                        ) -> tuple[ShardDescriptor, ShardHealth | None]:
    """Inverse of `advertisement_payload`; raises `PeerDataError` when malformed."""
    try:
        return _parse_advertisement(payload)
    except BadRequest as e:  # the field checks are shared with local construction
        raise PeerDataError(e.message, **e.details) from None


def _parse_advertisement(payload: Mapping[str, Any]
                         ) -> tuple[ShardDescriptor, ShardHealth | None]:
    _check(isinstance(payload, Mapping), "payload", "must be a map")
    desc = ShardDescriptor.from_dict(_field(payload, "descriptor"))
    _check(payload.get("shard_id") == desc.shard_id, "shard_id",
           "must equal descriptor.shard_id")
    raw = payload.get("health")
    health = ShardHealth.from_dict(raw) if raw is not None else None
    if health is not None:
        _check(health.shard_id == desc.shard_id, "health.shard_id",
               "must equal descriptor.shard_id")
    return desc, health


def withdrawal_payload(shard_id: ShardID, reason: str = "shutdown") -> dict[str, Any]:
    """Payload of `experimental.shard.withdrawn`."""
    return {"shard_id": shard_id, "reason": reason}


def parse_withdrawal(payload: Mapping[str, Any]) -> tuple[ShardID, str]:
    """Inverse of `withdrawal_payload`; raises `PeerDataError` when malformed."""
    try:
        return _parse_withdrawal(payload)
    except BadRequest as e:
        raise PeerDataError(e.message, **e.details) from None


def _parse_withdrawal(payload: Mapping[str, Any]) -> tuple[ShardID, str]:
    _check(isinstance(payload, Mapping), "payload", "must be a map")
    sid, reason = _field(payload, "shard_id"), payload.get("reason", "")
    _check(isinstance(sid, str) and sid != "", "shard_id", "must be a string")
    _check(isinstance(reason, str), "reason", "must be a string")
    return sid, reason


# ---- helpers ----

def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise BadRequest(f"malformed shard data: {key} {reason}", key=key, reason=reason)


def _field(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise BadRequest(f"malformed shard data: {key} is missing", key=key, reason="missing")
    return d[key]
