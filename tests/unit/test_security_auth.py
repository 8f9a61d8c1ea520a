"""Signed session opens and limits (hearthnet/security/auth.py, issue 7 items 3, 6, 7)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hearthnet.errors import AuthError, LimitExceeded
from hearthnet.observability import Metrics
from hearthnet.safe_msgpack import MAX_DEPTH, canonical_packb
from hearthnet.security.auth import (
    AuthReason,
    ConnectionLimiter,
    NonceCache,
    OpenAuthVerifier,
    RateLimiter,
    make_open_auth,
    note_refusal,
    reason_of,
    sign_open,
)
from hearthnet.security.keys import NodeKey
from hearthnet.security.members import MemberDirectory, Trust

A, B, G, X = (NodeKey.generate() for _ in range(4))
T0 = 1_700_000_000.0
PARAMS: dict[str, Any] = {"model": "smollm2", "weights_sha256": "ab" * 32, "start": 0,
                          "end": 14, "max_len": 512, "dtype": "fp16"}


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def members() -> list[dict[str, str]]:
    return [{"node_id": "node-a", "public_key": A.public_key_b64, "trust": "trusted"},
            {"node_id": "node-b", "public_key": B.public_key_b64, "trust": "steward"},
            {"node_id": "guest-g", "public_key": G.public_key_b64, "trust": "member"}]


def verifier(**kw: Any) -> tuple[OpenAuthVerifier, Clock]:
    clock = Clock()
    return OpenAuthVerifier(MemberDirectory.from_dicts(members()), clock=clock, **kw), clock


def refusal(v: OpenAuthVerifier, auth: Any, params: Any = PARAMS, **kw: Any) -> str:
    with pytest.raises(AuthError) as e:
        v.verify(auth, params, **kw)
    assert e.value.code == "auth_failed"
    return reason_of(e.value)


def test_a_trusted_member_open_is_accepted() -> None:
    v, _ = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0)
    assert set(auth) == {"caller", "ts", "nonce", "sig"}
    assert len(auth["nonce"]) == 16 and auth["ts"] == int(T0 * 1000)
    assert v.verify(auth, PARAMS) == "node-a"
    assert v.verify(make_open_auth(B, "node-b", PARAMS, now=T0), PARAMS) == "node-b"


def test_open_survives_a_msgpack_round_trip() -> None:
    v, _ = verifier()
    fields = sign_open(A, "node-a", {**PARAMS, "range": (0, 14)}, now=T0)
    wire = msgpack.unpackb(msgpack.packb(fields, use_bin_type=True), raw=False)
    assert isinstance(wire["range"], list)  # tuple came back as a list
    assert v.verify_open(wire, peer="node-a") == "node-a"


def test_unknown_member() -> None:
    v, _ = verifier()
    assert refusal(v, make_open_auth(X, "node-x", PARAMS, now=T0)) == "unknown_member"


def test_bad_signature_wrong_key_and_tampered_params() -> None:
    v, _ = verifier()
    assert refusal(v, make_open_auth(X, "node-a", PARAMS, now=T0)) == "bad_signature"
    auth = make_open_auth(A, "node-a", PARAMS, now=T0)
    assert refusal(v, auth, {**PARAMS, "end": 29}) == "bad_signature"
    assert refusal(v, {**auth, "nonce": bytes(16)}) == "bad_signature"
    assert refusal(v, {**auth, "caller": "node-b"}) == "bad_signature"
    assert refusal(v, {**auth, "ts": auth["ts"] + 1}) == "bad_signature"


def test_insufficient_trust_default_is_trusted_and_configurable() -> None:
    v, _ = verifier()
    assert refusal(v, make_open_auth(G, "guest-g", PARAMS, now=T0)) == "insufficient_trust"
    low, _ = verifier(min_trust=Trust.MEMBER)
    assert low.verify(make_open_auth(G, "guest-g", PARAMS, now=T0), PARAMS) == "guest-g"
    high, _ = verifier(min_trust=Trust.STEWARD)
    assert refusal(high, make_open_auth(A, "node-a", PARAMS, now=T0)) == "insufficient_trust"


@pytest.mark.parametrize("offset,ok", [(-60.0, True), (60.0, True), (-60.01, False),
                                       (60.01, False), (-3600.0, False), (3600.0, False)])
def test_timestamp_skew_in_both_directions(offset: float, ok: bool) -> None:
    v, _ = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0 + offset)
    if ok:
        assert v.verify(auth, PARAMS) == "node-a"
    else:
        assert refusal(v, auth) == "stale_timestamp"


def test_replayed_open_is_refused_and_fresh_opens_still_work() -> None:
    v, clock = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0)
    assert v.verify(auth, PARAMS) == "node-a"
    assert refusal(v, auth) == "replayed_nonce"
    clock.t += 30
    assert refusal(v, auth) == "replayed_nonce"
    assert v.verify(make_open_auth(A, "node-a", PARAMS, now=clock.t), PARAMS) == "node-a"


def test_a_forgotten_nonce_is_still_refused_as_stale() -> None:
    v, clock = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0 + 60)  # as far in the future as allowed
    v.verify(auth, PARAMS)
    clock.t = T0 + 120  # its last accepted moment: still remembered
    assert refusal(v, auth) == "replayed_nonce"
    clock.t = T0 + 120.01
    assert refusal(v, auth) == "stale_timestamp"
    v.verify(make_open_auth(A, "node-a", PARAMS, now=clock.t), PARAMS)  # triggers purge
    assert len(v.nonces) == 1  # the expired entry is gone, the cache stays small


def test_nonce_cache_full_refuses_rather_than_forgets() -> None:
    v, clock = verifier(nonce_cache=NonceCache(max_entries=3, max_per_caller=2))
    kept = [make_open_auth(A, "node-a", PARAMS, now=T0) for _ in range(2)]
    for auth in kept:
        v.verify(auth, PARAMS)
    assert refusal(v, make_open_auth(A, "node-a", PARAMS, now=T0)) == "nonce_cache_full"
    v.verify(make_open_auth(B, "node-b", PARAMS, now=T0), PARAMS)  # others keep their share
    assert refusal(v, make_open_auth(B, "node-b", PARAMS, now=T0)) == "nonce_cache_full"
    assert len(v.nonces) == 3
    for auth in kept:
        assert refusal(v, auth) == "replayed_nonce"  # nothing fresh was forgotten
    clock.t = T0 + 61  # the stored nonces' opens are stale now; their room is reusable
    assert v.verify(make_open_auth(A, "node-a", PARAMS, now=clock.t), PARAMS) == "node-a"
    assert len(v.nonces) == 1


def test_refused_opens_never_take_nonce_cache_room() -> None:
    v, _ = verifier()
    for auth in (make_open_auth(X, "node-x", PARAMS, now=T0),
                 make_open_auth(X, "node-a", PARAMS, now=T0),
                 make_open_auth(G, "guest-g", PARAMS, now=T0),
                 make_open_auth(A, "node-a", PARAMS, now=T0 - 600)):
        refusal(v, auth)
    assert len(v.nonces) == 0


def test_open_on_another_members_connection_is_refused() -> None:
    v, _ = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0)
    assert refusal(v, auth, peer="node-b") == "peer_mismatch"
    assert v.verify(auth, PARAMS, peer="node-a") == "node-a"  # not consumed by the refusal


def test_reload_removing_a_member_refuses_its_new_opens() -> None:
    v, _ = verifier()
    assert v.verify(make_open_auth(A, "node-a", PARAMS, now=T0), PARAMS) == "node-a"
    v.directory.replace([m for m in members() if m["node_id"] != "node-a"])
    assert refusal(v, make_open_auth(A, "node-a", PARAMS, now=T0)) == "unknown_member"
    v.directory.replace([*members()[1:], {**members()[0], "trust": "member"}])
    assert refusal(v, make_open_auth(A, "node-a", PARAMS, now=T0)) == "insufficient_trust"


@pytest.mark.parametrize("mutate", [
    lambda a: None, lambda a: "auth", lambda a: [a], lambda a: {},
    lambda a: {**a, "extra": 1}, lambda a: {k: v for k, v in a.items() if k != "sig"},
    lambda a: {**a, "caller": "bad id"}, lambda a: {**a, "caller": 5},
    lambda a: {**a, "ts": str(a["ts"])}, lambda a: {**a, "ts": True},
    lambda a: {**a, "ts": -1}, lambda a: {**a, "ts": float(a["ts"])},
    lambda a: {**a, "nonce": a["nonce"][:15]}, lambda a: {**a, "nonce": "x" * 16},
    lambda a: {**a, "sig": a["sig"] + b"x"},
])
def test_malformed_auth(mutate: Any) -> None:
    v, _ = verifier()
    assert refusal(v, mutate(make_open_auth(A, "node-a", PARAMS, now=T0))) == "malformed"


def _deep(n: int) -> Any:
    return [1] if n == 0 else [_deep(n - 1)]


@pytest.mark.parametrize("params", [None, [1], {1: "int key"}, {"x": object()},
                                    {"x": 2**70}, {"x": _deep(MAX_DEPTH)}, {"x": float("nan")}])
def test_malformed_params(params: Any) -> None:
    v, _ = verifier()
    assert refusal(v, make_open_auth(A, "node-a", PARAMS, now=T0), params) == "malformed"


def test_open_fields_must_be_a_map_with_auth() -> None:
    v, _ = verifier()
    for fields in ("not a map", PARAMS):
        with pytest.raises(AuthError) as e:
            v.verify_open(fields)
        assert reason_of(e.value) == "malformed"


def test_canonical_ignores_key_order_and_tuple_vs_list() -> None:
    assert canonical_packb({"b": 1, "a": (1, 2)}) == canonical_packb({"a": [1, 2], "b": 1})
    assert canonical_packb({"a": 1}) != canonical_packb({"a": 1.0})
    for unfit in ({"a": {1, 2}}, {"a": float("nan")}, {1: "a"}):
        with pytest.raises(ValueError):
            canonical_packb(unfit)


_wire = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=70),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                              max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(auth=_wire, params=_wire, peer=st.none() | st.text(max_size=8))
def test_fuzz_verify_raises_only_auth_errors(auth: Any, params: Any, peer: Any) -> None:
    v, _ = verifier()
    with pytest.raises(AuthError):
        v.verify(auth, params, peer=peer)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_fuzz_mutated_valid_opens_are_refused(data: st.DataObject) -> None:
    v, _ = verifier()
    auth = make_open_auth(A, "node-a", PARAMS, now=T0)
    field = data.draw(st.sampled_from(["caller", "ts", "nonce", "sig"]))
    value = data.draw(_wire)
    if value == auth[field] and type(value) is type(auth[field]):
        return
    with pytest.raises(AuthError):
        v.verify({**auth, field: value}, PARAMS)
    assert len(v.nonces) == 0


def test_note_refusal_counts_by_reason_and_logs_who() -> None:
    m = Metrics()
    v, _ = verifier()
    with pytest.raises(AuthError) as e:
        v.verify(make_open_auth(G, "guest-g", PARAMS, now=T0), PARAMS)
    with capture_logs() as logs:
        note_refusal(m, e.value, caller="guest-g", shard_id="smollm2:0-14")
    assert m.registry.get_sample_value("hearthnet_auth_failures_total",
                                       {"reason": "insufficient_trust"}) == 1
    assert logs == [{"event": "auth_refused", "reason": "insufficient_trust",
                     "caller": "guest-g", "shard_id": "smollm2:0-14",
                     "component": "security.auth", "log_level": "warning"}]


# --- limits ------------------------------------------------------------------------

def test_rate_limiter_token_bucket() -> None:
    clock = Clock(0.0)
    rl = RateLimiter(rate=2, burst=3, clock=clock)
    assert [rl.allow("p") for _ in range(4)] == [True, True, True, False]
    assert rl.allow("q")  # keys are independent
    clock.t = 0.5
    assert rl.allow("p") and not rl.allow("p")
    clock.t = 100
    assert [rl.allow("p") for _ in range(4)] == [True, True, True, False]  # capped at burst
    with pytest.raises(LimitExceeded) as e:
        rl.check("p")
    assert reason_of(e.value) == AuthReason.RATE_LIMITED
    assert e.value.code == "rate_limit_exceeded" and not isinstance(e.value, AuthError)


def test_rate_limiter_memory_is_bounded() -> None:
    clock = Clock(0.0)
    rl = RateLimiter(rate=1, burst=1, clock=clock, max_keys=2)
    assert rl.allow("a") and rl.allow("b")
    assert not rl.allow("c")  # both buckets in use: a new key is refused, not stored
    assert len(rl) == 2
    clock.t = 5  # a and b have refilled: equivalent to fresh, so they can be dropped
    assert rl.allow("c") and len(rl) == 1


def test_connection_limiter_counts_per_peer_and_caller() -> None:
    cl = ConnectionLimiter(max_connections_per_peer=2, max_sessions_per_caller=1,
                           max_connections_total=3)
    assert cl.acquire_connection("10.0.0.1") and cl.acquire_connection("10.0.0.1")
    assert not cl.acquire_connection("10.0.0.1")
    assert cl.acquire_connection("10.0.0.2")
    assert not cl.acquire_connection("10.0.0.3")  # total cap
    cl.release_connection("10.0.0.1")
    cl.release_connection("10.0.0.9")  # double/unknown release does not free room
    assert cl.connections("10.0.0.1") == 1
    assert cl.acquire_connection("10.0.0.3") and not cl.acquire_connection("10.0.0.4")
    with cl.session("node-a"):
        assert cl.sessions("node-a") == 1
        with pytest.raises(LimitExceeded) as e, cl.session("node-a"):
            pass
        assert reason_of(e.value) == "too_many_sessions"
        with cl.session("node-b"):
            pass
    assert cl.sessions("node-a") == 0 and cl.acquire_session("node-a")


def test_connection_context_manager_releases_on_error() -> None:
    cl = ConnectionLimiter(max_connections_per_peer=1)
    with pytest.raises(RuntimeError), cl.connection("p"):
        raise RuntimeError("handler failed")
    assert cl.connections("p") == 0
    with cl.connection("p"), pytest.raises(LimitExceeded) as e, cl.connection("p"):
        pass
    assert reason_of(e.value) == "too_many_connections"
