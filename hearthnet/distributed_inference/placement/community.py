"""The community's placement facts in the event log, and their read model (DESIGN.md decision 14).

Three event types, each signed by its origin and replicated by gossip like every event:

- ``experimental.community.models_served`` ``{"models": [{model_id, weights_sha256,
  alias}]}``: the whole list of models the community serves. Only a member at trust
  ``steward`` may originate it (the guard rejects others' on ingest, and the fold ignores
  them too); the newest event by ``(ts, origin, seq)`` wins.
- ``experimental.placement.capacity`` ``{"models": {model_id: {speed, max_layers}}}``: an
  automatic host announces, before it places anything, how fast it is and how many layers
  of each model its budget holds, so hosts that start together share the model by speed.
- ``experimental.placement.claim`` ``{model_id, weights_sha256, layer_range, speed,
  max_layers, reason, state, detail}``: an automatic host is loading ``layer_range``
  (``state = "pending"``) or gave that up (``"cancelled"``). A pending claim counts as
  coverage until its host advertises the range or it is ``claim_ttl_s`` old, so two hosts
  do not load the same range at once. ``reason`` is ``initial``, ``rehost`` or
  ``rebalance``; ``detail`` says why in words (`hearthnet status` shows it).

`PlacementView` folds these (and the ``placement`` field that automatic hosts add to their
advertisements) into what `hearthnet.distributed_inference.placement.autohost` and the status page
need. Malformed payloads are logged and ignored, never raised.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hearthnet.distributed_inference.directory.descriptors import ADVERTISED
from hearthnet.errors import BadRequest
from hearthnet.mesh.eventlog import EVENT_TYPES, Event, EventType
from hearthnet.observability import get_logger


def _claim_subject(payload: Mapping[str, Any]) -> str | None:
    mid = payload.get("model_id")
    return f"placement.claim:{mid}" if isinstance(mid, str) else None


# a newer event of the same origin (and, for claims, model) supersedes the older ones
SERVED_MODELS = EVENT_TYPES.register(EventType("experimental.community.models_served",
                                               lambda _: "community.models_served"))
CAPACITY = EVENT_TYPES.register(EventType("experimental.placement.capacity",
                                          lambda _: "placement.capacity"))
CLAIM = EVENT_TYPES.register(EventType("experimental.placement.claim", _claim_subject))
PLACEMENT_TYPES = (SERVED_MODELS, CAPACITY, CLAIM)

REASONS = ("initial", "rehost", "rebalance")
MAX_SERVED = 64
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")

_log = get_logger("distributed_inference.community")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One entry of the served-model list."""

    model_id: str
    weights_sha256: str
    alias: str

    def to_dict(self) -> dict[str, str]:
        return {"model_id": self.model_id, "weights_sha256": self.weights_sha256,
                "alias": self.alias}


@dataclass(frozen=True, slots=True)
class Claim:
    """A host's latest claim on one model."""

    origin: str
    model_id: str
    weights_sha256: str
    lo: int
    hi: int
    speed: float
    max_layers: int
    reason: str
    state: str
    detail: str
    ts: float
    seq: int

    @property
    def order(self) -> tuple[float, str]:
        """Earlier claims win a conflict: by time, then by node id."""
        return (self.ts, self.origin)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.origin, "model_id": self.model_id, "layers": [self.lo, self.hi],
                "reason": self.reason, "state": self.state, "detail": self.detail,
                "at": self.ts, "speed": round(self.speed, 3)}


@dataclass(frozen=True, slots=True)
class Capacity:
    """An automatic host's speed and layer budget for one model."""

    host: str
    speed: float
    max_layers: int
    ts: float


# ---- payloads ----

def served_payload(models: Iterable[ServedModel]) -> dict[str, Any]:
    return {"models": [m.to_dict() for m in models]}


def parse_served(payload: Mapping[str, Any]) -> list[ServedModel]:
    """The list of a ``models_served`` payload; raises `BadRequest` when malformed."""
    rows = payload.get("models")
    if not isinstance(rows, list) or len(rows) > MAX_SERVED:
        raise BadRequest(f"models must be a list of at most {MAX_SERVED} models")
    out = []
    for r in rows:
        if not isinstance(r, Mapping):
            raise BadRequest("a served model must be a map")
        mid, sha, alias = r.get("model_id"), r.get("weights_sha256"), r.get("alias", "")
        if not (isinstance(mid, str) and 0 < len(mid) <= 256):
            raise BadRequest("served model_id must be a string of 1..256 characters")
        if not (isinstance(sha, str) and _SHA_RE.match(sha)):
            raise BadRequest("served weights_sha256 must be 64 hex digits")
        if not (isinstance(alias, str) and len(alias) <= 64):
            raise BadRequest("served alias must be a string of at most 64 characters")
        out.append(ServedModel(mid, sha, alias))
    return out


def claim_payload(*, model_id: str, weights_sha256: str, lo: int, hi: int, speed: float,
                  max_layers: int, reason: str, state: str = "pending", detail: str = ""
                  ) -> dict[str, Any]:
    return {"model_id": model_id, "weights_sha256": weights_sha256, "layer_range": [lo, hi],
            "speed": float(speed), "max_layers": int(max_layers), "reason": reason,
            "state": state, "detail": detail[:300]}


def parse_claim(ev: Event) -> Claim:
    """The claim of a ``placement.claim`` event; raises `BadRequest` when malformed."""
    p = ev.payload
    lr = p.get("layer_range")
    if not (isinstance(lr, list) and len(lr) == 2 and all(_is_int(x) for x in lr)
            and 0 <= lr[0] <= lr[1]):
        raise BadRequest("claim layer_range must be [lo, hi] with 0 <= lo <= hi")
    speed: Any = p.get("speed")
    max_layers: Any = p.get("max_layers")
    if not (_is_num(speed) and speed > 0) or not (_is_int(max_layers) and max_layers >= 0):
        raise BadRequest("claim speed must be > 0 and max_layers an integer >= 0")
    reason, state, detail = p.get("reason"), p.get("state"), p.get("detail", "")
    if reason not in REASONS or state not in ("pending", "cancelled") \
            or not isinstance(detail, str):
        raise BadRequest("claim reason/state/detail are malformed")
    mid, sha = p.get("model_id"), p.get("weights_sha256")
    if not (isinstance(mid, str) and isinstance(sha, str)):
        raise BadRequest("claim model_id and weights_sha256 must be strings")
    return Claim(ev.origin, mid, sha, lr[0], lr[1], float(speed), int(max_layers), reason,
                 state, detail[:300], ev.ts, ev.seq)


def capacity_payload(models: Mapping[str, tuple[float, int]]) -> dict[str, Any]:
    return {"models": {m: {"speed": float(s), "max_layers": int(n)}
                       for m, (s, n) in models.items()}}


def parse_capacity(ev: Event) -> dict[str, Capacity]:
    """Per model id, the capacity in a ``placement.capacity`` or advertisement event."""
    rows = ev.payload.get("models")
    if not isinstance(rows, Mapping):
        raise BadRequest("capacity models must be a map")
    out = {}
    for mid, r in rows.items():
        if not isinstance(r, Mapping) or not (_is_num(r.get("speed")) and r["speed"] > 0) \
                or not (_is_int(r.get("max_layers")) and r["max_layers"] >= 0):
            raise BadRequest("capacity entries must be {speed > 0, max_layers >= 0}")
        out[str(mid)] = Capacity(ev.origin, float(r["speed"]), int(r["max_layers"]), ev.ts)
    return out


def placement_info(*, model_id: str, speed: float, max_layers: int, reason: str,
                   detail: str) -> dict[str, Any]:
    """The ``placement`` field an automatic host adds to its advertisements."""
    return {"auto": True, "reason": reason, "detail": detail[:300],
            "models": {model_id: {"speed": float(speed), "max_layers": int(max_layers)}}}


# ---- the read model ----

class PlacementView:
    """Served models, capacities and claims as the event log says (see the module docstring).

    Args:
        is_steward: whether an origin may edit the served-model list.
        clock: wall clock (Unix seconds) for freshness.
    """

    def __init__(self, is_steward: Callable[[str], bool], *,
                 clock: Callable[[], float] = time.time) -> None:
        self.is_steward = is_steward
        self.clock = clock
        self._served: tuple[tuple[float, str, int], list[ServedModel]] | None = None
        self._served_by = ""
        self._capacity: dict[tuple[str, str], Capacity] = {}  # (host, model_id)
        self._claims: dict[tuple[str, str], Claim] = {}  # (host, model_id)
        self._auto_shards: dict[str, dict[str, Any]] = {}  # shard_id -> placement field
        self.history: deque[Claim] = deque(maxlen=32)

    def apply(self, ev: Event) -> bool:
        """Fold one event; True when it was one of ours and well-formed."""
        try:
            if ev.type == SERVED_MODELS:
                return self._apply_served(ev)
            if ev.type == CLAIM:
                return self._apply_claim(parse_claim(ev))
            if ev.type == CAPACITY:
                return self._apply_capacity(parse_capacity(ev))
            if ev.type == ADVERTISED and isinstance(ev.payload.get("placement"), Mapping):
                return self._apply_auto_ad(ev)
        except BadRequest as e:
            _log.warning("bad_placement_event", type=ev.type, origin=ev.origin, seq=ev.seq,
                         error=e.message)
        return False

    def rebuild(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.apply(ev)

    def _apply_served(self, ev: Event) -> bool:
        if not self.is_steward(ev.origin):
            _log.warning("served_models_not_steward", origin=ev.origin)
            return False
        models = parse_served(ev.payload)
        key = (ev.ts, ev.origin, ev.seq)
        if self._served is None or key > self._served[0]:
            self._served = (key, models)
            self._served_by = ev.origin
        return True

    def _apply_claim(self, c: Claim) -> bool:
        prev = self._claims.get((c.origin, c.model_id))
        if prev is None or c.seq > prev.seq or c.ts > prev.ts:
            self._claims[(c.origin, c.model_id)] = c
            if c.state == "pending":
                self.history.append(c)
        return True

    def _apply_capacity(self, caps: Mapping[str, Capacity]) -> bool:
        for mid, cap in caps.items():
            prev = self._capacity.get((cap.host, mid))
            if prev is None or cap.ts >= prev.ts:
                self._capacity[(cap.host, mid)] = cap
        return True

    def _apply_auto_ad(self, ev: Event) -> bool:
        info = ev.payload["placement"]
        sid = ev.payload.get("shard_id")
        if not isinstance(sid, str):
            return False
        self._auto_shards[sid] = {k: info[k] for k in ("reason", "detail") if k in info
                                  and isinstance(info[k], str)}
        if isinstance(info.get("models"), Mapping):
            self._apply_capacity(parse_capacity(Event(ev.event_id, ev.origin, ev.seq,
                                                      CAPACITY, dict(info), ev.ts)))
        return True

    # ---- queries ----

    def served(self) -> list[ServedModel]:
        """The community's served-model list (empty until a steward sets one)."""
        return list(self._served[1]) if self._served is not None else []

    def served_meta(self) -> dict[str, Any]:
        if self._served is None:
            return {"set_by": None, "at": None}
        return {"set_by": self._served_by, "at": self._served[0][0]}

    def claims(self, model_id: str) -> list[Claim]:
        """Every host's latest claim on `model_id`, oldest first."""
        return sorted((c for (_, m), c in self._claims.items() if m == model_id),
                      key=lambda c: c.order)

    def pending(self, model_id: str, ttl_s: float) -> list[Claim]:
        """Claims on `model_id` still loading (pending and younger than `ttl_s`)."""
        now = self.clock()
        return [c for c in self.claims(model_id)
                if c.state == "pending" and now - c.ts < ttl_s]

    def capacities(self, model_id: str, fresh_s: float) -> dict[str, Capacity]:
        """Per host, its capacity for `model_id` announced within `fresh_s` seconds."""
        now = self.clock()
        return {h: c for (h, m), c in self._capacity.items()
                if m == model_id and now - c.ts < fresh_s}

    def auto_shard(self, shard_id: str) -> dict[str, Any] | None:
        """The ``placement`` facts of an automatic host's shard (None: hand-placed)."""
        return self._auto_shards.get(shard_id)

    def last(self, reason: str) -> Claim | None:
        """The newest claim made for `reason` anywhere in the mesh."""
        return next((c for c in reversed(self.history) if c.reason == reason), None)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
