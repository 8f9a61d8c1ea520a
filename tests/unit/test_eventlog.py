"""EventLog: append-only SQLite log, ingest rules, signatures, persistence, compaction."""

from __future__ import annotations

import hashlib
import hmac
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hearthnet.distributed_inference.directory.descriptors import ADVERTISED, WITHDRAWN
from hearthnet.errors import BadRequest, PeerDataError, StorageError
from hearthnet.mesh.eventlog import (
    EVENT_TYPES,
    MAX_PAYLOAD_BYTES,
    Event,
    EventLog,
    EventType,
    EventTypes,
    canonical,
)
from hearthnet.observability import Metrics


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return v or 0.0


def test_append_assigns_per_origin_sequence(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a", clock=Clock())
    e1 = log.append("t.one", {"x": 1})
    e2 = log.append("t.two", {"y": [1, 2]})
    assert (e1.origin, e1.seq, e2.seq) == ("node-a", 1, 2)
    assert e1.event_id != e2.event_id and len(e1.event_id) == 32
    assert e1.ts == 1_700_000_000.0
    assert log.vector() == {"node-a": 2}
    assert log.since({}) == [e1, e2]
    assert log.since({"node-a": 1}) == [e2]
    assert log.since({"node-a": 2}) == []
    assert log.all_events() == [e1, e2]
    assert log.count() == 2


def test_database_is_sqlite_wal(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a")
    log.append("t", {})
    log.close()
    db = sqlite3.connect(tmp_path / "a.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_log_survives_restart_and_continues_numbering(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    log = EventLog(path, "node-a")
    first = [log.append("t", {"i": i}) for i in range(3)]
    peer = EventLog(tmp_path / "b.db", "node-b")
    theirs = peer.append("t", {"from": "b"})
    assert log.ingest(theirs)
    log.close()
    again = EventLog(path, "node-a")
    assert again.vector() == {"node-a": 3, "node-b": 1}
    assert again.all_events() == [*first, theirs]
    assert again.append("t", {}).seq == 4


def test_ingest_drops_duplicates_and_old_seqs(tmp_path: Path) -> None:
    metrics = Metrics()
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b", metrics=metrics)
    evs = [a.append("t", {"i": i}) for i in range(3)]
    assert b.ingest_many(evs) == [True, True, True]
    assert b.ingest(evs[1]) is False
    assert b.ingest_many([evs[2], evs[0]]) == [False, False]
    assert b.since({}) == evs
    assert sample(metrics, "hearthnet_events_received_total", type="t") == 3
    # out of order inside one batch: the older one is dropped
    more = [a.append("t", {"i": i}) for i in range(3, 5)]
    assert b.ingest_many([more[1], more[0]]) == [True, False]


def test_ingest_rejects_tampered_and_malformed_events(tmp_path: Path) -> None:
    metrics = Metrics()
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b", metrics=metrics)
    ev = a.append("t", {"amount": 1})
    forged = Event(ev.event_id, ev.origin, ev.seq, ev.type, {"amount": 1000}, ev.ts)
    assert b.ingest(forged) is False
    bad_origin = Event(ev.event_id, "Not A Node", ev.seq, ev.type, ev.payload, ev.ts)
    assert b.ingest(bad_origin) is False
    assert b.ingest("not an event") is False  # type: ignore[arg-type]
    assert sample(metrics, "hearthnet_events_rejected_total", reason="malformed") == 3
    assert b.vector() == {}
    assert b.ingest(ev) is True  # the genuine one still gets in


def test_signer_and_verifier(tmp_path: Path) -> None:
    keys = {"node-a": b"ka", "node-b": b"kb"}

    def signer_for(node: str) -> Callable[[bytes], bytes]:
        return lambda data: hmac.new(keys[node], data, hashlib.sha256).digest()

    def verifier(origin: str, data: bytes, sig: bytes) -> bool:
        k = keys.get(origin)
        return k is not None and hmac.compare_digest(
            hmac.new(k, data, hashlib.sha256).digest(), sig)

    metrics = Metrics()
    a = EventLog(tmp_path / "a.db", "node-a", signer=signer_for("node-a"))
    b = EventLog(tmp_path / "b.db", "node-b", verifier=verifier, metrics=metrics)
    good = a.append("t", {"v": 1})
    assert good.signature is not None
    assert b.ingest(good)
    forged_sig = a.append("t", {"v": 2})
    forged = Event(forged_sig.event_id, forged_sig.origin, forged_sig.seq, forged_sig.type,
                   forged_sig.payload, forged_sig.ts, b"\x00" * 32)
    assert not b.ingest(forged)
    unsigned = Event(forged.event_id, forged.origin, forged.seq, forged.type, forged.payload,
                     forged.ts, None)
    assert not b.ingest(unsigned)
    assert sample(metrics, "hearthnet_events_rejected_total", reason="bad_signature") == 1
    assert sample(metrics, "hearthnet_events_rejected_total", reason="unsigned") == 1
    assert b.vector() == {"node-a": 1}  # rejected events are not stored (so never gossiped)
    assert b.ingest(forged_sig)  # the genuinely signed one is accepted afterwards

    def broken(origin: str, data: bytes, sig: bytes) -> bool:
        raise RuntimeError("verifier bug")

    c = EventLog(tmp_path / "c.db", "node-c", verifier=broken, metrics=metrics)
    assert not c.ingest(good)
    assert sample(metrics, "hearthnet_events_rejected_total", reason="verifier_error") == 1


def test_signing_bytes_are_canonical(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    ev = a.append("t", {"b": 1, "a": (1, 2)})
    assert ev.payload == {"a": [1, 2], "b": 1}
    reordered = Event(ev.event_id, ev.origin, ev.seq, ev.type, {"b": 1, "a": [1, 2]}, ev.ts)
    assert reordered.signing_bytes() == ev.signing_bytes()
    reordered.check()  # same id: the id is computed over the canonical form


def test_append_refuses_bad_payloads(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a")
    with pytest.raises(BadRequest):
        log.append("t", {1: "x"})  # type: ignore[dict-item]
    with pytest.raises(BadRequest):
        log.append("t", {"x": float("nan")})
    with pytest.raises(BadRequest):
        log.append("t", {"x": object()})
    with pytest.raises(BadRequest):
        log.append("t", {"x": b"\x00" * (MAX_PAYLOAD_BYTES + 1)})
    with pytest.raises(BadRequest):
        log.append("", {})
    assert log.vector() == {}
    assert canonical({"z": {"b": (1,), "a": None}}) == {"z": {"a": None, "b": [1]}}


def test_subscribers_see_appended_and_ingested_events(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    seen: list[tuple[str, int]] = []

    def boom(ev: Event) -> None:
        raise RuntimeError("subscriber bug")

    b.subscribe(boom)  # must not break the log
    unsubscribe = b.subscribe(lambda ev: seen.append((ev.origin, ev.seq)))
    b.append("t", {})
    ea = a.append("t", {})
    b.ingest(ea)
    b.ingest(ea)  # duplicate: not announced
    assert seen == [("node-b", 1), ("node-a", 1)]
    unsubscribe()
    b.append("t", {})
    assert len(seen) == 2


def test_metrics_count_appended_events(tmp_path: Path) -> None:
    metrics = Metrics()
    log = EventLog(tmp_path / "a.db", "node-a", metrics=metrics)
    log.append(ADVERTISED, {"shard_id": "s"})
    log.append(ADVERTISED, {"shard_id": "s"})
    assert sample(metrics, "hearthnet_events_appended_total", type=ADVERTISED) == 2


def test_wire_form_round_trips_and_rejects_garbage() -> None:
    ev = Event("x", "node-a", 1, "t", {}, 1.0)
    with pytest.raises(PeerDataError, match="id does not match"):
        Event.from_wire(ev.to_wire())  # wrong id
    with pytest.raises(PeerDataError, match="lacks field"):
        Event.from_wire({"id": "x"})
    with pytest.raises(PeerDataError, match="not a map"):
        Event.from_wire([1, 2, 3])
    bad = {**ev.to_wire(), "p": {"x": float("nan")}}
    with pytest.raises(PeerDataError, match="non-finite"):  # shared payload checks too
        Event.from_wire(bad)


def test_compaction_keeps_latest_advertisement_per_shard(tmp_path: Path) -> None:
    clock = Clock()
    log = EventLog(tmp_path / "a.db", "node-a", clock=clock)
    other = log.append("note", {"text": "never compacted"})
    for i in range(10):  # heartbeats every 15 s for two shards
        log.append(ADVERTISED, {"shard_id": "s1", "n": i})
        log.append(ADVERTISED, {"shard_id": "s2", "n": i})
        clock.t += 15
    log.append(WITHDRAWN, {"shard_id": "s2", "reason": "shutdown"})
    before = log.vector()
    deleted = log.compact(retain_s=60)
    # retained: events younger than 60 s (the last 4 rounds), plus the latest of each shard
    remaining = log.all_events()
    assert deleted == 12  # the 6 rounds older than 60 s
    assert other in remaining
    assert [e.payload["n"] for e in remaining if e.payload.get("shard_id") == "s1"] == \
        [6, 7, 8, 9]
    assert remaining[-1].type == WITHDRAWN
    assert log.vector() == before  # compaction never moves the high-water marks back
    assert log.compact(retain_s=0) == 3 + 4  # every superseded one goes when retain is 0
    kinds = [(e.type, e.payload.get("shard_id")) for e in log.all_events()]
    assert kinds == [("note", None), (ADVERTISED, "s1"), (WITHDRAWN, "s2")]


def test_since_after_compaction_serves_a_fresh_peer(tmp_path: Path) -> None:
    clock = Clock()
    a = EventLog(tmp_path / "a.db", "node-a", clock=clock)
    for i in range(5):
        a.append(ADVERTISED, {"shard_id": "s", "n": i})
    clock.t += 1000
    a.compact(retain_s=10)
    b = EventLog(tmp_path / "b.db", "node-b")
    assert b.ingest_many(a.since(b.vector())) == [True]
    assert b.vector() == {"node-a": 5}
    assert b.all_events()[0].payload["n"] == 4


def test_automatic_compaction_bounds_growth(tmp_path: Path) -> None:
    clock = Clock()
    log = EventLog(tmp_path / "a.db", "node-a", clock=clock, compact_retain_s=120,
                   compact_every=16)
    for _ in range(200):  # 50 minutes of heartbeats at 15 s
        log.append(ADVERTISED, {"shard_id": "s"})
        clock.t += 15
    assert log.count() <= 120 // 15 + 16 + 1
    assert log.vector() == {"node-a": 200}


def test_registry_gives_the_log_its_subjects(tmp_path: Path) -> None:
    """The log knows no event semantics: compaction follows the registered subjects only."""
    types = EventTypes()
    up = types.register(EventType("test.lamp.on", lambda p: p.get("lamp")))
    clock = Clock()
    log = EventLog(tmp_path / "a.db", "node-a", clock=clock, types=types)
    for i in range(3):
        log.append(up, {"lamp": "l1", "n": i})
        log.append(ADVERTISED, {"shard_id": "s", "n": i})  # not registered in `types`
        clock.t += 100
    assert log.compact(retain_s=0) == 2
    assert [(e.type, e.payload["n"]) for e in log.all_events()] == \
        [(ADVERTISED, 0), (ADVERTISED, 1), (up, 2), (ADVERTISED, 2)]


def test_registry_refuses_a_conflicting_definition() -> None:
    types = EventTypes()
    first = EventType("test.x")
    assert types.register(first) == "test.x"
    assert types.register(EventType("test.x")) == "test.x"  # the same definition again
    assert "test.x" in types and types.get("test.x") == first and types.get("nope") is None
    with pytest.raises(ValueError):
        types.register(EventType("test.x", lambda p: "other"))
    with pytest.raises(BadRequest):
        types.register(EventType(""))


def test_shard_events_register_themselves() -> None:
    for name in (ADVERTISED, WITHDRAWN):
        known = EVENT_TYPES.get(name)
        assert known is not None and known.subject is not None
        assert known.subject({"shard_id": "m:0-3@a"}) == "m:0-3@a"
        assert known.subject({"shard_id": 5}) is None


def test_every_sqlite_failure_is_a_storage_error(tmp_path: Path) -> None:
    """A broken database surfaces as `StorageError` from every method, never sqlite3.Error."""
    log = EventLog(tmp_path / "a.db", "node-a")
    log.append("t", {})
    log._db.close()  # what a vanished or corrupted file looks like to the log
    calls: list[Callable[[], object]] = [
        lambda: log.append("t", {}), lambda: log.since({}),
        lambda: log.all_events(), lambda: log.count(), lambda: log.compact(0)]
    other = EventLog(tmp_path / "b.db", "node-b")
    ev = other.append("t", {})
    calls.append(lambda: log.ingest(ev))
    for call in calls:
        with pytest.raises(StorageError) as info:
            call()
        assert info.value.code == "event_log" and str(tmp_path / "a.db") in info.value.message
    log.close()  # still idempotent
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StorageError, match="cannot open"):
        EventLog(tmp_path / "dir.db", "node-a")


# ---- error paths: translated at the boundary and logged (DESIGN.md Errors) ----


def _logged(logs: list[dict[str, object]], event: str) -> list[dict[str, object]]:
    return [e for e in logs if e["event"] == event]


def test_a_corrupt_database_file_is_a_logged_storage_error(tmp_path: Path) -> None:
    (tmp_path / "a.db").write_bytes(b"this is not an SQLite database" * 100)
    with capture_logs() as logs, pytest.raises(StorageError, match="cannot open") as info:
        EventLog(tmp_path / "a.db", "node-a")
    assert info.value.code == "event_log" and "a.db" in info.value.message
    (failed,) = _logged(logs, "event_log_failed")
    assert failed["action"] == "open" and "DatabaseError" in str(failed["error"])


def _damaged_pages(path: Path) -> None:
    """A log whose header reads and whose pages do not (a torn write, a bad sector)."""
    log = EventLog(path, "node-a")
    for i in range(200):
        log.append("t", {"i": i, "pad": "x" * 400})
    log.close()
    data = bytearray(path.read_bytes())
    for off in range(3 * 4096, len(data) - 64, 4096):
        data[off:off + 48] = b"\xff" * 48
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["garbage", "pages"])
def test_a_corrupt_file_is_set_aside_and_a_fresh_log_starts(tmp_path: Path, damage: str) -> None:
    """The daemon's setting: the corrupt file (and its -wal) is renamed, never deleted, a
    warning says where it went, and the fresh log works (peers refill it by gossip)."""
    path = tmp_path / "events.sqlite3"
    if damage == "garbage":
        path.write_bytes(b"this is not an SQLite database" * 100)
        (tmp_path / "events.sqlite3-wal").write_bytes(b"half a journal")
    else:
        _damaged_pages(path)
    before = path.read_bytes()
    with capture_logs() as logs:
        log = EventLog(path, "node-a", clock=Clock(), set_aside_corrupt=True)
    (aside,) = tmp_path.glob("events.sqlite3.corrupt-20231114T221320Z")
    assert aside.read_bytes() == before
    (warned,) = _logged(logs, "event_log_set_aside")
    assert warned["log_level"] == "warning" and warned["moved_to"] == str(aside)
    assert warned["path"] == str(path) and "peers refill it" in str(warned["action"])
    if damage == "garbage":
        assert "file is not a database" in str(warned["error"])
        assert (tmp_path / f"{aside.name}-wal").read_bytes() == b"half a journal"
    else:
        assert "integrity check failed" in str(warned["error"])
    assert log.count() == 0 and log.append("t", {}).seq == 1
    log.close()
    with pytest.raises(StorageError, match="cannot open"):  # off (the default): an error
        path.write_bytes(before)
        EventLog(path, "node-a")


def test_what_setting_aside_cannot_mend_stays_a_storage_error(tmp_path: Path) -> None:
    """A path that cannot be opened (permissions, a folder in its place) is not corrupt:
    a `StorageError` naming the file, and nothing is moved."""
    (tmp_path / "events.sqlite3").mkdir()
    with capture_logs() as logs, pytest.raises(StorageError, match="cannot open"):
        EventLog(tmp_path / "events.sqlite3", "node-a", set_aside_corrupt=True)
    assert not _logged(logs, "event_log_set_aside")
    assert [p.name for p in tmp_path.iterdir()] == ["events.sqlite3"]


def test_an_unusable_data_folder_is_a_storage_error_not_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where the data folder should be")
    with capture_logs() as logs, pytest.raises(StorageError, match="cannot open"):
        EventLog(tmp_path / "file" / "a.db", "node-a")
    assert _logged(logs, "event_log_failed")


def test_a_locked_database_fails_the_write_without_using_up_a_seq(tmp_path: Path) -> None:
    """Another process holding the write lock: the append is a `StorageError`, logged; the
    failed transaction is rolled back and the next append takes the seq it would have."""
    log = EventLog(tmp_path / "a.db", "node-a", clock=Clock())
    log.append("t", {"n": 1})
    log._db.execute("PRAGMA busy_timeout = 0")  # fail at once instead of after 5 s
    other = sqlite3.connect(tmp_path / "a.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    with capture_logs() as logs, pytest.raises(StorageError, match="locked"):
        log.append("t", {"n": 2})
    (failed,) = _logged(logs, "event_log_failed")
    assert failed["action"] == "write to"
    assert log.vector() == {"node-a": 1}
    other.execute("ROLLBACK")
    other.close()
    assert log.append("t", {"n": 2}).seq == 2
    assert [e.payload["n"] for e in log.all_events()] == [1, 2]
    log.close()


def test_an_unreadable_row_is_logged_and_skipped_by_every_read(tmp_path: Path) -> None:
    """A row whose payload no longer decodes (or decodes to no map) is skipped with a
    warning naming it — without its contents — and the other events are still served."""
    log = EventLog(tmp_path / "a.db", "node-a", clock=Clock())
    good = [log.append("t", {"n": n}) for n in range(4)]
    log._db.execute("UPDATE events SET payload = ? WHERE seq = 2", (b"\xc1",))
    log._db.execute("UPDATE events SET payload = ? WHERE seq = 3", (b"\x05",))
    want = [good[0], good[3]]
    with capture_logs() as logs:
        assert log.all_events() == want
        assert log.since({}) == want
        assert [e for page in log.since_pages({}, log.vector(), page=1) for e in page] == want
    bad = _logged(logs, "event_row_unreadable")
    assert sorted({(e["origin"], e["seq"]) for e in bad}) == [("node-a", 2), ("node-a", 3)]
    assert len(bad) == 6 and all("payload" not in e for e in bad)
    log.close()


def test_a_subject_failing_on_a_payload_is_logged_and_the_event_kept(tmp_path: Path) -> None:
    types = EventTypes()
    types.register(EventType("t.keyed", lambda p: p["key"]))
    log = EventLog(tmp_path / "a.db", "node-a", types=types)
    with capture_logs() as logs:
        ev = log.append("t.keyed", {"other": 1})
    assert log.all_events() == [ev]
    (failed,) = _logged(logs, "event_subject_failed")
    assert (failed["type"], failed["seq"], failed["error"]) == ("t.keyed", 1, "KeyError")
    log.close()
