"""The member list (hearthnet/security/members.py): trust, signatures, events, reload."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hearthnet.errors import AuthError, ConfigError
from hearthnet.observability import Metrics
from hearthnet.security.keys import NodeKey
from hearthnet.security.members import Member, MemberDirectory, Trust

A, B, C = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()


def row(node_id: str, key: NodeKey, trust: str = "trusted") -> dict[str, Any]:
    return {"node_id": node_id, "public_key": key.public_key_b64, "trust": trust}


def directory() -> MemberDirectory:
    return MemberDirectory.from_dicts([row("node-a", A, "steward"), row("node-b", B, "member")])


def rejected(metrics: Metrics, reason: str) -> float:
    v = metrics.registry.get_sample_value("hearthnet_events_rejected_total",
                                          {"reason": reason})
    return v or 0.0


def test_trust_levels_are_ordered_and_parsed() -> None:
    assert Trust.GUEST < Trust.MEMBER < Trust.TRUSTED < Trust.STEWARD
    assert Trust.parse("Trusted") is Trust.TRUSTED and Trust.parse(Trust.GUEST) is Trust.GUEST
    assert Trust.STEWARD.label == "steward"
    with pytest.raises(ConfigError, match="guest, member, trusted, steward"):
        Trust.parse("admin")


def test_lookup_by_id_and_key_and_trust() -> None:
    d = directory()
    assert len(d) == 2 and "node-a" in d and "node-c" not in d
    assert d.trust_of("node-a") is Trust.STEWARD and d.trust_of("node-c") is None
    assert d.by_public_key(B.public_key_raw) == d.get("node-b")
    assert d.by_public_key(C.public_key_raw) is None
    assert d.meets("node-a", Trust.TRUSTED) and not d.meets("node-b", Trust.TRUSTED)
    assert not d.meets("node-c", Trust.GUEST)
    assert [m.node_id for m in d] == ["node-a", "node-b"]
    assert d.get("node-b") is not None and d.get("node-b").to_dict() == row(  # type: ignore[union-attr]
        "node-b", B, "member")


@pytest.mark.parametrize("rows,match", [
    ([row("node-a", A), row("node-a", B)], "listed twice"),
    ([row("node-a", A), row("node-b", A)], "same public key"),
    ([{"node_id": "node-a", "trust": "trusted"}], "has no public_key"),
    ([{"node_id": "node-a", "public_key": "", "trust": "trusted"}], "gen_mesh_keys"),
    ([{"node_id": "bad id", "public_key": A.public_key_b64}], "invalid node id"),
    ([row("node-a", A, "root")], "unknown trust level"),
    (["node-a"], "must be a table"),
])
def test_invalid_member_lists_are_refused(rows: list[Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MemberDirectory.from_dicts(rows)


def test_verify_checks_the_members_own_key() -> None:
    d = directory()
    sig = A.sign(b"event")
    assert d.verify("node-a", b"event", sig)
    assert not d.verify("node-b", b"event", sig)  # someone else's signature
    assert not d.verify("node-c", b"event", C.sign(b"event"))  # non-member
    assert not d.verify("node-a", b"event!", sig)


def test_event_verifier_drops_counts_and_never_logs_payload() -> None:
    d, m = directory(), Metrics()
    verify = d.event_verifier(metrics=m)
    secret = b"payload-SECRET-activation"
    with capture_logs() as logs:
        assert verify("node-b", secret, B.sign(secret))
        assert not verify("node-c", secret, C.sign(secret))
        assert not verify("node-a", secret, B.sign(secret))
        assert not verify("node-a", secret + b"x", A.sign(secret))  # tampered
    assert rejected(m, "unknown_origin") == 1 and rejected(m, "bad_signature") == 2
    assert [(e["reason"], e["origin"]) for e in logs] == [
        ("unknown_origin", "node-c"), ("bad_signature", "node-a"), ("bad_signature", "node-a")]
    assert "SECRET" not in repr(logs)


def test_event_verifier_min_trust() -> None:
    d, m = directory(), Metrics()
    verify = d.event_verifier(metrics=m, min_trust=Trust.TRUSTED)
    assert not verify("node-b", b"e", B.sign(b"e"))
    assert verify("node-a", b"e", A.sign(b"e"))
    assert rejected(m, "insufficient_trust") == 1


@given(origin=st.one_of(st.text(max_size=80), st.integers(), st.none(), st.binary()),
       data=st.one_of(st.binary(max_size=200), st.text(max_size=20), st.none()),
       sig=st.one_of(st.binary(max_size=80), st.text(max_size=80), st.none()))
def test_event_verifier_never_raises_on_garbage(origin: Any, data: Any, sig: Any) -> None:
    assert directory().event_verifier()(origin, data, sig) is False


def test_advertisement_host_must_be_its_signer() -> None:
    d = directory()
    d.check_advertisement("node-a", "node-a")
    with pytest.raises(AuthError) as e:
        d.check_advertisement("node-a", "node-b")
    assert e.value.details["reason"] == "host_not_signer"
    with pytest.raises(AuthError) as e:
        d.check_advertisement("node-c", "node-c")
    assert e.value.details["reason"] == "unknown_member"


def test_replace_applies_at_once_and_bad_lists_keep_the_old_one() -> None:
    d = directory()
    verify = d.event_verifier()
    v0 = d.version
    d.replace([row("node-a", A, "steward"), row("node-c", C, "trusted")])
    assert d.version == v0 + 1
    assert not verify("node-b", b"e", B.sign(b"e"))  # removed member refused
    assert verify("node-c", b"e", C.sign(b"e"))  # added member accepted
    with pytest.raises(ConfigError):
        d.replace([row("node-x", A), row("node-y", A)])
    assert d.version == v0 + 1 and "node-c" in d
    d.replace([Member.from_dict(row("node-b", B))])
    assert [m.node_id for m in d] == ["node-b"]


def test_concurrent_reads_during_replace_see_whole_lists() -> None:
    d = MemberDirectory.from_dicts([row("node-a", A), row("node-b", B)])
    lists = ([row("node-a", A), row("node-b", B)], [row("node-c", C)])
    stop = threading.Event()
    seen_bad: list[set[str]] = []

    def writer() -> None:
        for i in range(300):
            d.replace(lists[i % 2])
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    while not stop.is_set():
        ids = {m.node_id for m in d.members()}
        if ids not in ({"node-a", "node-b"}, {"node-c"}):
            seen_bad.append(ids)
    t.join()
    assert not seen_bad
