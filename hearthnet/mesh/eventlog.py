"""The node's append-only event log in SQLite (DESIGN.md decision 7, M26 §5.1).

Every event has an id, an origin node, a per-origin sequence number, a type, a payload and
a timestamp, optionally a signature. The log is the source of truth of the mesh: read
models (the `ShardStore`) are folds over `all_events()` and rebuild after a restart.
`hearthnet.mesh.gossip` replicates it between nodes.

Invariants the gossip relies on:

- A node stores the events of one origin in increasing `seq` order: `ingest` drops any
  event whose `seq` is not above the origin's highest stored `seq` (a duplicate, or an
  event this node compacted or rejected). Gossip streams each origin in order, so no
  needed event is ever dropped; `vector()` is therefore a complete summary of what the
  node holds and `since(vector)` is a complete catch-up.
- `event_id` is content-addressed (sha256 of the canonical encoding of origin, seq, type,
  payload and ts, first 32 hex digits); `ingest` recomputes and checks it. Signatures sign
  `Event.signing_bytes()` = msgpack of (event_id, origin, seq, type, payload, ts) with
  dict keys sorted.
- A node must keep its data directory: a node that loses its log and keeps its id starts
  again at seq 1, and peers drop those events as duplicates until its seq passes what they
  hold (it recovers its own history from peers' catch-up, which moves its counter on).

Event types. The log knows no event semantics of its own: the module that owns a type
registers an `EventType` in `EVENT_TYPES` (the registry other checks — allow-lists, size
limits, trust — hang off too). A type's optional ``subject(payload)`` names what the event
is about; an event is *superseded* by a later event of the same origin with the same
subject (the shard events of `hearthnet.distributed_inference.directory.descriptors` use the shard
id, so a re-advertisement supersedes the previous one). Types that share a subject
namespace supersede each other.

Growth is bounded by compaction (`compact`): a superseded event older than
`compact_retain_s` is deleted. Heartbeats are re-advertisements, so a host heartbeating
every 15 s keeps at most ``retain / 15 + 1`` events per shard. Events without a subject are
never compacted. The per-origin high-water marks live in their own table, so compaction
never moves them back.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from hearthnet import safe_msgpack
from hearthnet.errors import BadRequest, PeerDataError, StorageError
from hearthnet.ids import valid_node_id
from hearthnet.observability import Metrics, get_logger

MAX_PAYLOAD_BYTES = 64 * 1024
MAX_TYPE_LEN = 128
DEFAULT_COMPACT_EVERY = 256
CATCH_UP_PAGE = 256  # events read per page of a catch-up


Signer = Callable[[bytes], bytes]
Verifier = Callable[[str, bytes, bytes], bool]
# Membership policy for ingested events: the reason to reject one, or None to accept.
Admission = Callable[["Event"], "str | None"]
Subscriber = Callable[["Event"], object]

_log = get_logger("mesh.eventlog")

Subject = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True, slots=True)
class EventType:
    """What the log knows of one event type; registered by the module that owns the type.

    Attributes:
        name: the wire type string (1..`MAX_TYPE_LEN` characters).
        subject: ``subject(payload) -> str | None``, what an event is about; a later event
            of the same origin with the same subject supersedes it (compaction). None:
            events of this type are never superseded.
        max_payload_bytes: the largest canonical payload of this type (no member fills logs).
        min_trust: the lowest trust of a member that may originate it (guest, member,
            trusted, steward); the daemon's admission policy enforces it.
        max_per_origin: how many events of this type one origin may have stored at once.
        retain_s: events older than this are deleted by compaction (None: kept while
            not superseded; every type is bounded by `max_per_origin` either way).
    """

    name: str
    subject: Subject | None = None
    max_payload_bytes: int = 16 * 1024
    min_trust: str = "member"
    max_per_origin: int = 1024
    retain_s: float | None = None


class EventTypes:
    """A registry of `EventType`s; `EVENT_TYPES` is the process-wide one."""

    def __init__(self) -> None:
        self._types: dict[str, EventType] = {}

    def register(self, event_type: EventType) -> str:
        """Add `event_type`; returns its name. Registering the same definition twice is a
        no-op; a different definition under a taken name raises `ValueError`."""
        _check_type(event_type.name)
        known = self._types.setdefault(event_type.name, event_type)
        if known != event_type:
            raise ValueError(f"event type {event_type.name!r} is already registered")
        return event_type.name

    def names(self) -> list[str]:
        """Every registered type (the gossip allow-list)."""
        return sorted(self._types)

    def get(self, name: str) -> EventType | None:
        """The registered type `name`, or None."""
        return self._types.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._types

    def subject(self, event: Event) -> str | None:
        """What `event` is about (its compaction key), or None."""
        known = self._types.get(event.type)
        if known is None or known.subject is None:
            return None
        try:
            return known.subject(event.payload)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            # a payload of an unexpected shape has no subject: never compacted, still stored
            _log.warning("event_subject_failed", type=event.type, origin=event.origin,
                         seq=event.seq, error=type(e).__name__)
            return None


EVENT_TYPES = EventTypes()


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the log. Treat `payload` as read-only."""

    event_id: str
    origin: str
    seq: int
    type: str
    payload: dict[str, Any]
    ts: float
    signature: bytes | None = None

    def signing_bytes(self) -> bytes:
        """The canonical bytes a signer signs and a verifier checks."""
        return safe_msgpack.packb([self.event_id, self.origin, self.seq, self.type,
                      canonical(self.payload), self.ts])

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-safe map (gossip message element)."""
        return {"id": self.event_id, "o": self.origin, "s": self.seq, "t": self.type,
                "p": self.payload, "ts": self.ts, "sig": self.signature}

    @classmethod
    def from_wire(cls, d: object) -> Event:
        """Parse a peer's wire map; raises `PeerDataError` when malformed (never anything
        else)."""
        if not isinstance(d, Mapping):
            raise PeerDataError("event is not a map")
        try:
            eid, origin, seq, typ = d["id"], d["o"], d["s"], d["t"]
            payload, ts, sig = d["p"], d["ts"], d.get("sig")
        except KeyError as e:
            raise PeerDataError(f"event lacks field {e.args[0]!r}") from None
        ev = cls(event_id=eid, origin=origin, seq=seq, type=typ, payload=payload,
                 ts=float(ts) if _is_number(ts) else ts, signature=sig)
        ev.check()
        return ev

    def check(self) -> None:
        """Raise `PeerDataError` unless every field is well-formed and the id matches."""
        try:
            self._validate()
        except BadRequest as e:  # the shared field checks speak of a caller's data
            raise PeerDataError(e.message) from None

    def _validate(self) -> None:
        if not valid_node_id(self.origin):
            raise BadRequest("event origin is not a node id")
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or self.seq < 1 \
                or self.seq >= 2**63:
            raise BadRequest("event seq is not a positive integer")
        _check_type(self.type)
        if not isinstance(self.ts, float) or not math.isfinite(self.ts):
            raise BadRequest("event ts is not a finite number")
        if self.signature is not None and not isinstance(self.signature, bytes):
            raise BadRequest("event signature is not bytes")
        packed = _check_payload(self.payload)
        if self.event_id != _event_id(self.origin, self.seq, self.type, packed, self.ts):
            raise BadRequest("event id does not match its content")


def canonical(obj: Any) -> Any:
    """`safe_msgpack.canonical` of an event payload.

    Raises:
        BadRequest: a value msgpack cannot carry portably (only None, bool, int, finite
            float, str, bytes, lists and str-keyed maps are allowed).
    """
    try:
        return safe_msgpack.canonical(obj)
    except ValueError as e:
        raise BadRequest(f"event payload: {e}") from None


class EventLog:
    """Append-only SQLite (WAL) event log of one node.

    Thread-safe (one connection behind a lock); meant to be driven from the node's event
    loop — every call is a short local transaction.

    Args:
        path: the SQLite file (its folder is created).
        node_id: this node (the origin of `append`ed events).
        metrics: counts appended / received / rejected events.
        signer: signs `Event.signing_bytes()` of appended events.
        verifier: ``verifier(origin, data, signature) -> bool`` for ingested events; when
            set, unsigned events are rejected too.
        admit: ``admit(event) -> reason | None`` for ingested events that passed the
            other checks (the daemon's membership policy: signed by a member): a reason
            rejects the event, counted in ``events_rejected_total{reason}``.
        clock: wall clock for event timestamps (Unix seconds).
        compact_retain_s: when set, `compact(compact_retain_s)` runs every
            `compact_every` stored events (the daemon passes 4 × the health timeout).
        types: the event-type registry (subjects for compaction); `EVENT_TYPES` by default.
        set_aside_corrupt: a file SQLite finds corrupt (not a database, malformed pages)
            is renamed ``<name>.corrupt-<UTC time>`` (with its ``-wal``/``-shm``), kept for
            inspection, logged ``event_log_set_aside``, and a fresh log is created (the
            daemon: its peers hold copies and gossip catch-up refills it). Off: a
            `StorageError`, as for every other failure. Permissions, a full disk or a
            locked file are never set aside: those stay a `StorageError`.
    """

    def __init__(self, path: str | Path, node_id: str, *, metrics: Metrics | None = None,
                 signer: Signer | None = None, verifier: Verifier | None = None,
                 admit: Admission | None = None,
                 clock: Callable[[], float] = time.time,
                 compact_retain_s: float | None = None,
                 compact_every: int = DEFAULT_COMPACT_EVERY,
                 types: EventTypes = EVENT_TYPES, set_aside_corrupt: bool = False) -> None:
        if not valid_node_id(node_id):
            raise BadRequest(f"node id {node_id!r} is not [a-z0-9-]+")
        self.path = Path(path)
        self.node_id = node_id
        self.metrics = metrics
        self._signer = signer
        self._verifier = verifier
        self._admit_policy = admit
        self._clock = clock
        self._compact_retain_s = compact_retain_s
        self._compact_every = max(1, compact_every)
        self._types = types
        self._since_compact = 0
        # (origin, type) -> events admitted by the batch being ingested, not yet written:
        # `count_of` includes them, so a per-origin quota holds inside one batch (§5)
        self._batch: dict[tuple[str, str], int] = {}
        self._subscribers: list[Subscriber] = []
        # which origins' events catch-up serves (the daemon: current members only)
        self.serve_filter: Callable[[str], bool] | None = None
        self._lock = threading.RLock()
        self._vector: dict[str, int] = {}
        with self._sql("open"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = self._connect()
            try:
                self._prepare()
            except sqlite3.DatabaseError as e:
                if not (set_aside_corrupt and _is_corrupt(e)):
                    self._db.close()
                    raise
                self._set_aside(e)  # still open: closing first would delete the -wal
                self._db.close()
                self._db = self._connect()
                self._prepare()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)

    def _prepare(self) -> None:
        """Check the file is a sound database, create the tables, read the high-water
        marks."""
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        # a file whose header reads but whose pages do not would fail later, mid-gossip;
        # the log is bounded by compaction, so the check is cheap at start
        problems = [r[0] for r in self._db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise _Corrupt("integrity check failed: " + "; ".join(map(str, problems)))
        self._db.executescript(_SCHEMA)
        self._vector = dict(self._db.execute("SELECT origin, max_seq FROM origins").fetchall())

    def _set_aside(self, cause: sqlite3.Error) -> None:
        """Rename the corrupt file (and its ``-wal``/``-shm``) out of the way, never delete
        it: someone may want to look at it, or recover what it held."""
        if str(self.path) == ":memory:":
            raise cause
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():  # two corrupt files within a second: keep both
            n += 1
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        for suffix in ("", "-wal", "-shm", "-journal"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                side.rename(aside.with_name(aside.name + suffix))
        _log.warning("event_log_set_aside", node=self.node_id, path=str(self.path),
                     moved_to=str(aside), error=f"{type(cause).__name__}: {cause}",
                     action="started a fresh event log; this node's peers refill it "
                            "(gossip catch-up), as after an emptied log")

    @contextlib.contextmanager
    def _sql(self, action: str) -> Iterator[None]:
        """Every SQLite (or file system) failure leaves the log as a `StorageError` naming
        the file, logged here where the foreign error is translated (DESIGN.md Errors)."""
        try:
            yield
        except (sqlite3.Error, OSError) as e:
            _log.error("event_log_failed", node=self.node_id, path=str(self.path),
                       action=action, error=f"{type(e).__name__}: {e}")
            raise StorageError(f"cannot {action} the event log {self.path}: {e}; check the "
                               "data directory (disk space, permissions)") from e

    # ---- writing ----

    def append(self, type: str, payload: Mapping[str, Any]) -> Event:
        """Append an event of this node and notify subscribers.

        Raises:
            BadRequest: bad type, or a payload that is not canonical-encodable or is larger
                than `MAX_PAYLOAD_BYTES`.
        """
        _check_type(type)
        canon = canonical(dict(payload))
        packed = _check_payload(canon)
        with self._lock:
            seq = self._vector.get(self.node_id, 0) + 1
            ts = float(self._clock())
            ev = Event(_event_id(self.node_id, seq, type, packed, ts), self.node_id, seq, type,
                       canon, ts)
            if self._signer is not None:
                ev = Event(ev.event_id, ev.origin, ev.seq, ev.type, ev.payload, ev.ts,
                           self._signer(ev.signing_bytes()))
            # our own events must survive a power cut: a lost seq would be reused
            with self._sql("write to"):
                self._db.execute("PRAGMA synchronous=FULL")
                try:
                    self._write([ev])
                finally:
                    self._db.execute("PRAGMA synchronous=NORMAL")
        if self.metrics is not None:
            self.metrics.events_appended_total.labels(type=type).inc()
        self._after_store([ev])
        return ev

    def ingest(self, event: Event) -> bool:
        """Store an event received from a peer. False when duplicate or rejected."""
        return self.ingest_many([event]) == [True]

    def ingest_many(self, events: Iterable[Event]) -> list[bool]:
        """Store a batch of peer events in one transaction; one bool per event.

        An event is dropped (False) when its seq is not above what this node holds of its
        origin (duplicate), and rejected (False, counted in
        ``events_rejected_total{reason}``) when malformed, unsigned or badly signed while
        a verifier is set. Rejected events are never stored, so never gossiped.
        """
        results: list[bool] = []
        stored: list[Event] = []
        with self._lock:
            pending = dict(self._vector)
            try:
                for ev in events:
                    ok = self._admit(ev, pending)
                    results.append(ok)
                    if ok:
                        pending[ev.origin] = ev.seq
                        stored.append(ev)
                        key = (ev.origin, ev.type)
                        self._batch[key] = self._batch.get(key, 0) + 1
                if stored:
                    self._write(stored)
            finally:
                self._batch.clear()
        if self.metrics is not None:
            for ev in stored:
                self.metrics.events_received_total.labels(type=ev.type).inc()
        self._after_store(stored)
        return results

    def _admit(self, ev: Event, vector: Mapping[str, int]) -> bool:
        if not isinstance(ev, Event):
            self._reject("malformed", None)
            return False
        try:
            ev.check()
        except PeerDataError as e:
            self._reject("malformed", ev, str(e))
            return False
        if ev.seq <= vector.get(ev.origin, 0):
            return False  # duplicate (or compacted / superseded)
        if self._verifier is not None:
            if ev.signature is None:
                self._reject("unsigned", ev)
                return False
            try:
                good = bool(self._verifier(ev.origin, ev.signing_bytes(), ev.signature))
            except Exception as e:  # a verifier bug must not break ingestion
                self._reject("verifier_error", ev, repr(e))
                return False
            if not good:
                self._reject("bad_signature", ev)
                return False
        if self._admit_policy is not None:
            try:
                reason = self._admit_policy(ev)
            except Exception as e:  # a policy bug must not break ingestion: a rejection
                reason = "policy_error"
                _log.warning("event_policy_failed", node=self.node_id, error=repr(e),
                             exc_info=True)
            if reason is not None:
                self._reject(reason, ev)
                return False
        return True

    def _reject(self, reason: str, ev: Event | None, detail: str = "") -> None:
        if self.metrics is not None:
            self.metrics.events_rejected_total.labels(reason=reason).inc()
        _log.warning("event_rejected", node=self.node_id, reason=reason, detail=detail,
                     origin=getattr(ev, "origin", None), seq=getattr(ev, "seq", None))

    def _write(self, events: list[Event]) -> None:
        now = float(self._clock())
        rows = [(e.event_id, e.origin, e.seq, e.type, safe_msgpack.packb(canonical(e.payload)),
                 e.ts, e.signature, self._types.subject(e), now) for e in events]
        highs: dict[str, int] = {}
        for e in events:
            highs[e.origin] = max(highs.get(e.origin, 0), e.seq)
        with self._sql("write to"):
            try:
                self._transaction(rows, highs)
            except sqlite3.Error:
                self._rollback()
                raise
        for origin, seq in highs.items():
            self._vector[origin] = max(self._vector.get(origin, 0), seq)
        self._since_compact += len(events)
        if self._compact_retain_s is not None and self._since_compact >= self._compact_every:
            self.compact(self._compact_retain_s)

    def _transaction(self, rows: list[tuple[Any, ...]], highs: dict[str, int]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany(
            "INSERT INTO events (event_id, origin, seq, type, payload, ts, signature,"
            " subject, received_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        self._db.executemany(
            "INSERT INTO origins (origin, max_seq) VALUES (?, ?) ON CONFLICT(origin)"
            " DO UPDATE SET max_seq = max(max_seq, excluded.max_seq)",
            list(highs.items()))
        self._db.execute("COMMIT")

    def _rollback(self) -> None:
        """Undo a failed write's open transaction; the write's own error is what the caller
        gets, so a failing ROLLBACK (no transaction began, or the disk is gone) is logged."""
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error as e:
            _log.warning("event_log_rollback_failed", node=self.node_id, path=str(self.path),
                         error=f"{type(e).__name__}: {e}")

    def _after_store(self, events: list[Event]) -> None:
        for ev in events:
            for cb in list(self._subscribers):
                try:
                    cb(ev)
                except Exception:  # a subscriber bug must not break the log
                    _log.exception("event_subscriber_failed", node=self.node_id,
                                   type=ev.type)

    # ---- reading ----

    def vector(self) -> dict[str, int]:
        """Per origin, the highest seq this node holds (or held before compaction)."""
        with self._lock:
            return dict(self._vector)

    def since_pages(self, vector: Mapping[str, int], upto: Mapping[str, int], *,
                    page: int = CATCH_UP_PAGE) -> Iterator[list[Event]]:
        """Events a peer with `vector` lacks up to `upto` (a `vector()` snapshot), each
        origin in increasing seq order, read `page` rows at a time: a catch-up holds one
        page in memory, not the log. Origins `serve_filter` refuses (members
        removed by a reload) are skipped."""
        for origin, high in upto.items():
            have = vector.get(origin, 0)
            while have < high and self._serves(origin):
                with self._lock, self._sql("read"):
                    rows = self._db.execute(
                        _SELECT + " WHERE origin = ? AND seq > ? AND seq <= ? ORDER BY seq"
                        " LIMIT ?", (origin, have, high, page)).fetchall()
                if not rows:
                    break
                have = int(rows[-1][2])
                events = self._events(rows)
                if events:
                    yield events

    def _serves(self, origin: str) -> bool:
        return self.serve_filter is None or bool(self.serve_filter(origin))

    def since(self, vector: Mapping[str, int], *, limit: int | None = None) -> list[Event]:
        """Events a peer with `vector` lacks, each origin in increasing seq order."""
        out: list[Event] = []
        with self._lock, self._sql("read"):
            for origin, high in self._vector.items():
                have = vector.get(origin, 0)
                if have >= high or not self._serves(origin):
                    continue
                rows = self._db.execute(_SELECT + " WHERE origin = ? AND seq > ? ORDER BY seq",
                                        (origin, have)).fetchall()
                out.extend(self._events(rows))
                if limit is not None and len(out) >= limit:
                    return out[:limit]
        return out

    def all_events(self) -> list[Event]:
        """Every stored event in the order this node stored them (to rebuild read models)."""
        with self._lock, self._sql("read"):
            rows = self._db.execute(_SELECT + " ORDER BY rowid").fetchall()
        return self._events(rows)

    def _events(self, rows: list[tuple[Any, ...]]) -> list[Event]:
        """The events of `rows`; a row that no longer decodes (a damaged file, an edit by
        hand) is logged and skipped, so one bad row cannot stop a node from rebuilding its
        read models or serving a catch-up."""
        out: list[Event] = []
        for r in rows:
            try:
                out.append(_row_event(r))
            except (ValueError, TypeError, msgpack.UnpackException) as e:
                _log.warning("event_row_unreadable", node=self.node_id, path=str(self.path),
                             origin=r[1], seq=r[2], error=f"{type(e).__name__}: {e}")
        return out

    def count_of(self, origin: str, type: str) -> int:
        """How many events of `type` from `origin` this node holds (per-origin quotas),
        counting those the batch being ingested has admitted so far."""
        with self._lock, self._sql("read"):
            return int(self._db.execute("SELECT count(*) FROM events WHERE origin = ? AND "
                                        "type = ?", (origin, type)).fetchone()[0]) \
                + self._batch.get((origin, type), 0)

    def count(self) -> int:
        with self._lock, self._sql("read"):
            return int(self._db.execute("SELECT count(*) FROM events").fetchone()[0])

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(event)` after each newly stored event; returns an unsubscribe.

        Callbacks run synchronously in the storing thread; they must be quick (queue the
        work) and their exceptions are logged, never propagated.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)
        return unsubscribe

    # ---- maintenance ----

    def compact(self, retain_s: float) -> int:
        """Delete superseded events older than `retain_s` seconds; returns how many.

        Superseded: a later event of the same origin with the same subject (see
        `EventType.subject`). The latest event of every subject is always kept.
        """
        cutoff = float(self._clock()) - retain_s
        with self._lock, self._sql("compact"):
            self._since_compact = 0
            cur = self._db.execute(
                "DELETE FROM events WHERE subject IS NOT NULL AND ts < ? AND EXISTS ("
                " SELECT 1 FROM events AS later WHERE later.origin = events.origin"
                " AND later.subject = events.subject AND later.seq > events.seq)",
                (cutoff,))
            n = cur.rowcount
            n += self._expire_by_type()
        if n:
            _log.debug("event_log_compacted", node=self.node_id, deleted=n)
        return int(n)

    def _expire_by_type(self) -> int:
        """Retention per type, so no type grows without bound: delete events older than their type's
        `retain_s`, and a type's oldest events of one origin over its `max_per_origin`."""
        now = float(self._clock())
        n = 0
        for name in self._types.names():
            t = self._types.get(name)
            if t is None:
                continue
            if t.retain_s is not None:
                n += self._db.execute("DELETE FROM events WHERE type = ? AND ts < ?",
                                      (name, now - t.retain_s)).rowcount
            n += self._db.execute(
                "DELETE FROM events WHERE type = ? AND rowid IN (SELECT rowid FROM ("
                " SELECT rowid, row_number() OVER (PARTITION BY origin ORDER BY seq DESC)"
                " AS k FROM events WHERE type = ?) WHERE k > ?)",
                (name, name, t.max_per_origin)).rowcount
        return int(n)

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            self._subscribers.clear()
            try:
                self._db.close()
            except sqlite3.Error as e:  # closing is the last thing: report, do not raise
                _log.warning("event_log_close_failed", node=self.node_id,
                             path=str(self.path), error=f"{type(e).__name__}: {e}")


class _Corrupt(sqlite3.DatabaseError):
    """The file opened, but SQLite's integrity check found it damaged."""


# SQLite primary result codes of a damaged file (https://sqlite.org/rescode.html); every
# other failure (CANTOPEN, READONLY, PERM, FULL, IOERR, BUSY) is the disk or the
# permissions, which setting the file aside would not mend
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


def _is_corrupt(e: sqlite3.Error) -> bool:
    """True when `e` says the file is not a sound SQLite database."""
    code = getattr(e, "sqlite_errorcode", None)
    return isinstance(e, _Corrupt) or (isinstance(code, int) and
                                       code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    rowid INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    origin TEXT NOT NULL,
    seq INTEGER NOT NULL,
    type TEXT NOT NULL,
    payload BLOB NOT NULL,
    ts REAL NOT NULL,
    signature BLOB,
    subject TEXT,
    received_at REAL NOT NULL,
    UNIQUE (origin, seq)
);
CREATE INDEX IF NOT EXISTS events_subject ON events (origin, subject, seq)
    WHERE subject IS NOT NULL;
CREATE TABLE IF NOT EXISTS origins (
    origin TEXT PRIMARY KEY,
    max_seq INTEGER NOT NULL
);
"""

_SELECT = "SELECT event_id, origin, seq, type, payload, ts, signature FROM events"


def _row_event(r: tuple[Any, ...]) -> Event:
    """The event of one stored row; `ValueError` (or `TypeError`) when it does not decode."""
    payload = msgpack.unpackb(r[4], raw=False)
    if not isinstance(payload, dict):
        raise ValueError(f"the payload is a {type(payload).__name__}, not a map")
    return Event(r[0], r[1], int(r[2]), r[3], payload, float(r[5]),
                 bytes(r[6]) if r[6] is not None else None)


def _event_id(origin: str, seq: int, type: str, packed_payload: bytes, ts: float) -> str:
    head = safe_msgpack.packb([origin, seq, type, ts])
    return hashlib.sha256(head + packed_payload).hexdigest()[:32]


def _check_type(type: object) -> None:
    if not isinstance(type, str) or not 0 < len(type) <= MAX_TYPE_LEN:
        raise BadRequest(f"event type must be a string of 1..{MAX_TYPE_LEN} characters")


def canonical_bytes(payload: Mapping[str, Any]) -> bytes:
    """The canonical msgpack encoding of a payload (what size limits measure)."""
    return safe_msgpack.packb(canonical(payload))


def _check_payload(payload: object) -> bytes:
    """Canonical bytes of a payload map; raises `BadRequest` when unfit."""
    if not isinstance(payload, Mapping):
        raise BadRequest("event payload must be a map")
    try:
        packed = safe_msgpack.packb(canonical(payload))
    except (ValueError, OverflowError, TypeError) as e:
        raise BadRequest(f"event payload cannot be encoded: {e}") from None
    if len(packed) > MAX_PAYLOAD_BYTES:
        raise BadRequest(f"event payload is {len(packed)} bytes, more than "
                         f"{MAX_PAYLOAD_BYTES}")
    return packed


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
