"""Per-call signed authentication of session opens, and limits on hostile traffic.

Per-call signed authentication (M26 §5.8): a shard session OPEN carries the caller's node id, a
timestamp, a fresh nonce and a signature over those and the session parameters. The
shard accepts it only from a member at or above its minimum trust, within ±`max_skew_s`
of its own clock, with a nonce it has not seen. Every refusal is an `AuthError` whose
``details["reason"]`` is one of `AuthReason`.

Why the nonce cache can be bounded: an open is accepted only while
``|now - ts| <= skew``, so its nonce need only be remembered until ``ts + skew``; after
that a replay is refused as ``stale_timestamp`` without the cache. Entries therefore
expire at ``ts + skew`` (at most ``2 × skew`` after they were stored) and are dropped
then. If a flood of *valid, signed, fresh* opens fills the cache anyway, new opens are
refused (``nonce_cache_full``) rather than forgetting a fresh nonce, which would let its
open be replayed. A per-caller share stops one member from starving the others. Only
opens that passed every other check are stored, so unauthenticated traffic cannot fill
the cache.

Item 6's limits live here too: `RateLimiter` (token bucket per key) and
`ConnectionLimiter` (connections per peer, sessions per caller). They are plain counters
with an injectable clock for the daemon to consult before doing work; call them from the
event loop thread.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum
from typing import Any

from hearthnet.errors import AuthError, LimitExceeded, Refused
from hearthnet.ids import valid_node_id
from hearthnet.observability import get_logger
from hearthnet.safe_msgpack import canonical_packb
from hearthnet.security.keys import SIGNATURE_BYTES, NodeKey, verify_signature
from hearthnet.security.members import MemberDirectory, Trust

_log = get_logger("security.auth")

Clock = Callable[[], float]

NONCE_BYTES = 16
AUTH_FIELD = "auth"
# Domain separation: an open signs a 5-element array starting with this tag, so its
# signature can never be valid for other signed bytes (an event signs a 6-element array).
_OPEN_DOMAIN = "hearthnet/open/v1"
_AUTH_KEYS = frozenset({"caller", "ts", "nonce", "sig"})


class AuthReason(StrEnum):
    """Every reason an authentication or limit check refuses (metric label values)."""

    MALFORMED = "malformed"
    UNKNOWN_MEMBER = "unknown_member"
    BAD_SIGNATURE = "bad_signature"
    INSUFFICIENT_TRUST = "insufficient_trust"
    STALE_TIMESTAMP = "stale_timestamp"
    REPLAYED_NONCE = "replayed_nonce"
    NONCE_CACHE_FULL = "nonce_cache_full"
    PEER_MISMATCH = "peer_mismatch"
    RATE_LIMITED = "rate_limited"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TOO_MANY_SESSIONS = "too_many_sessions"
    CERT_MISMATCH = "cert_mismatch"
    UNEXPECTED_PEER = "unexpected_peer"
    NO_PEER_CERT = "no_peer_cert"
    TLS_HANDSHAKE = "tls_handshake"


_LIMITS = frozenset({AuthReason.RATE_LIMITED, AuthReason.TOO_MANY_CONNECTIONS,
                     AuthReason.TOO_MANY_SESSIONS})


def refuse(reason: AuthReason, message: str, **details: Any) -> Refused:
    """The refusal carrying `reason` in its details (raise it): a `LimitExceeded` for the
    rate, connection and session limits, an `AuthError` for everything else."""
    cls = LimitExceeded if reason in _LIMITS else AuthError
    return cls(message, reason=reason.value, **details)


def reason_of(err: Refused) -> str:
    """The refusal reason of an `AuthError` (``"unknown"`` if it carries none)."""
    return str(err.details.get("reason", "unknown"))


def note_refusal(metrics: Any, err: Refused, **context: Any) -> None:
    """Count `err` in ``auth_failures_total{reason}`` and log it with `context`.

    `context` names who was refused (``caller=``, ``peer=``, ``shard_id=``) — never
    tensor contents or message payloads (M26 §5.8).
    """
    reason = reason_of(err)
    if metrics is not None:
        metrics.auth_failures_total.labels(reason=reason).inc()
    _log.warning("auth_refused", reason=reason, **context)


def _open_message(caller: str, ts: int, nonce: bytes, params: Mapping[str, Any]) -> bytes:
    """The signed bytes of an OPEN: its canonical msgpack (`safe_msgpack.canonical_packb`);
    `ValueError` / `OverflowError` when `params` have no canonical form."""
    return canonical_packb([_OPEN_DOMAIN, caller, ts, nonce, params])


# --- the caller side ---------------------------------------------------------------

def make_open_auth(key: NodeKey, node_id: str, params: Mapping[str, Any],
                   now: float | None = None) -> dict[str, Any]:
    """The ``auth`` field of a session OPEN (M26 §5.8).

    Args:
        key: the caller's node key.
        node_id: the caller's node id, as listed in the members.
        params: the OPEN's session parameters, exactly as the shard will see them
            (without the ``auth`` field itself).
        now: Unix time in seconds (default: the wall clock).

    Returns:
        ``{"caller": str, "ts": int (Unix ms), "nonce": 16 bytes, "sig": 64 bytes}``.
    """
    ts = int((time.time() if now is None else now) * 1000)
    nonce = os.urandom(NONCE_BYTES)
    sig = key.sign(_open_message(node_id, ts, nonce, params))
    return {"caller": node_id, "ts": ts, "nonce": nonce, "sig": sig}


def sign_open(key: NodeKey, node_id: str, params: Mapping[str, Any],
              now: float | None = None) -> dict[str, Any]:
    """`params` plus its ``auth`` field: the full OPEN fields a caller sends."""
    return {**params, AUTH_FIELD: make_open_auth(key, node_id, params, now)}


def split_open(fields: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Split received OPEN fields into (session params, auth) — the inverse of `sign_open`."""
    params = {k: v for k, v in fields.items() if k != AUTH_FIELD}
    return params, fields.get(AUTH_FIELD)


# --- the shard side ----------------------------------------------------------------

class NonceCache:
    """Nonces of accepted opens, each kept until its open would be stale anyway.

    Bounded by `max_entries` overall and `max_per_caller` per caller; see the module
    docstring for why that is safe.
    """

    def __init__(self, max_entries: int = 65536, max_per_caller: int = 8192) -> None:
        self.max_entries = max_entries
        self.max_per_caller = max_per_caller
        self._expiry: dict[tuple[str, bytes], float] = {}
        self._heap: list[tuple[float, str, bytes]] = []
        self._per_caller: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, caller: str, nonce: bytes, expires_at: float, now: float) -> None:
        """Remember `nonce` until `expires_at` (Unix seconds).

        Raises:
            AuthError: ``replayed_nonce`` if it is already remembered,
                ``nonce_cache_full`` if the cache (or the caller's share) is full.
        """
        with self._lock:
            self._purge(now)
            key = (caller, nonce)
            if key in self._expiry:
                raise refuse(AuthReason.REPLAYED_NONCE, "this session open was already used",
                             caller=caller)
            if (len(self._expiry) >= self.max_entries
                    or self._per_caller.get(caller, 0) >= self.max_per_caller):
                raise refuse(AuthReason.NONCE_CACHE_FULL,
                             "too many session opens in the replay window; retry shortly",
                             caller=caller)
            self._expiry[key] = expires_at
            heapq.heappush(self._heap, (expires_at, caller, nonce))
            self._per_caller[caller] = self._per_caller.get(caller, 0) + 1

    def _purge(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            _, caller, nonce = heapq.heappop(self._heap)
            del self._expiry[(caller, nonce)]
            left = self._per_caller[caller] - 1
            if left:
                self._per_caller[caller] = left
            else:
                del self._per_caller[caller]


class OpenAuthVerifier:
    """Checks the ``auth`` of session opens for one shard host (M26 §5.8).

    Args:
        directory: the live member list (follows config reloads).
        min_trust: the lowest trust allowed to open sessions (default trusted, M26 §5.9).
        max_skew_s: accepted clock difference in either direction.
        clock: Unix time in seconds; injectable for tests.
        nonce_cache: replay memory (default: a `NonceCache` with default bounds).
    """

    def __init__(self, directory: MemberDirectory, min_trust: Trust = Trust.TRUSTED,
                 max_skew_s: float = 60.0, clock: Clock = time.time,
                 nonce_cache: NonceCache | None = None) -> None:
        self.directory = directory
        self.min_trust = min_trust
        self.max_skew_s = max_skew_s
        self.clock = clock
        self.nonces = nonce_cache if nonce_cache is not None else NonceCache()

    def verify(self, auth: Any, params: Any, *, peer: str | None = None) -> str:
        """Check one open's `auth` against its `params`; return the caller's node id.

        Args:
            auth: the received ``auth`` field (untrusted; any shape).
            params: the received session parameters without ``auth`` (untrusted).
            peer: the node id the connection itself was authenticated as (mutual TLS,
                `tls.peer_node_id`); when given, the open must come from that node, so an
                open captured by one member cannot be replayed by it to another shard.

        Raises:
            AuthError: with ``details["reason"]`` one of malformed, unknown_member,
                stale_timestamp, bad_signature, insufficient_trust, peer_mismatch,
                replayed_nonce, nonce_cache_full. Nothing else escapes.
        """
        caller, ts, nonce, sig = _parse_auth(auth)
        member = self.directory.get(caller)
        if member is None:
            raise refuse(AuthReason.UNKNOWN_MEMBER, f"{caller} is not a community member",
                         caller=caller)
        now = self.clock()
        if abs(now - ts / 1000) > self.max_skew_s:
            raise refuse(AuthReason.STALE_TIMESTAMP,
                         f"open timestamp is more than {self.max_skew_s:g} s from this "
                         "node's clock; check both clocks (NTP)", caller=caller)
        if not isinstance(params, Mapping):
            raise refuse(AuthReason.MALFORMED, "session parameters must be a map",
                         caller=caller)
        try:
            message = _open_message(caller, ts, nonce, params)
        except (ValueError, OverflowError) as e:
            raise refuse(AuthReason.MALFORMED, f"session parameters cannot be signed: {e}",
                         caller=caller) from None
        if not verify_signature(member.public_key, message, sig):
            raise refuse(AuthReason.BAD_SIGNATURE, f"bad signature on open from {caller}",
                         caller=caller)
        if member.trust < self.min_trust:
            raise refuse(AuthReason.INSUFFICIENT_TRUST,
                         f"{caller} is {member.trust.label}; this shard requires "
                         f"{self.min_trust.label} or higher", caller=caller)
        if peer is not None and peer != caller:
            raise refuse(AuthReason.PEER_MISMATCH,
                         f"open signed by {caller} arrived on {peer}'s connection",
                         caller=caller, peer=peer)
        self.nonces.add(caller, nonce, ts / 1000 + self.max_skew_s, now)
        return caller

    def verify_open(self, fields: Any, *, peer: str | None = None) -> str:
        """`verify` on the full received OPEN fields (params plus ``auth``)."""
        if not isinstance(fields, Mapping):
            raise refuse(AuthReason.MALFORMED, "session open fields must be a map")
        params, auth = split_open(fields)
        return self.verify(auth, params, peer=peer)


def _parse_auth(auth: Any) -> tuple[str, int, bytes, bytes]:
    if not isinstance(auth, Mapping) or set(auth) != _AUTH_KEYS:
        raise refuse(AuthReason.MALFORMED, "session open lacks a valid auth field "
                     "{caller, ts, nonce, sig}")
    caller, ts, nonce, sig = auth["caller"], auth["ts"], auth["nonce"], auth["sig"]
    if not valid_node_id(caller):
        raise refuse(AuthReason.MALFORMED, "auth.caller is not a node id")
    if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts < 2**53:
        raise refuse(AuthReason.MALFORMED, "auth.ts must be Unix milliseconds")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise refuse(AuthReason.MALFORMED, f"auth.nonce must be {NONCE_BYTES} bytes")
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
        raise refuse(AuthReason.MALFORMED, f"auth.sig must be {SIGNATURE_BYTES} bytes")
    return caller, ts, nonce, sig


# --- limits on hostile traffic ------------------------------------------------------

class RateLimiter:
    """A token bucket per key: `rate` tokens per second, holding at most `burst`.

    Memory is bounded by `max_keys`: when full, buckets that have refilled completely
    (equivalent to new ones) are dropped; if none has, new keys are refused.
    """

    def __init__(self, rate: float, burst: float, *, clock: Clock = time.monotonic,
                 max_keys: int = 10000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst, self.clock, self.max_keys = rate, burst, clock, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def allow(self, key: str, cost: float = 1.0) -> bool:
        """Take `cost` tokens from `key`'s bucket if it has them."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys and not self._sweep(now):
                return False
            tokens = self.burst
        else:
            tokens = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
        if tokens < cost:
            self._buckets[key] = (tokens, now)
            return False
        self._buckets[key] = (tokens - cost, now)
        return True

    def check(self, key: str, cost: float = 1.0) -> None:
        """`allow`, raising `LimitExceeded` (``rate_limited``) when refused."""
        if not self.allow(key, cost):
            raise refuse(AuthReason.RATE_LIMITED, f"too many messages from {key}; slow down",
                         peer=key)

    def _sweep(self, now: float) -> bool:
        full = [k for k, (t, at) in self._buckets.items()
                if t + (now - at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]
        return len(self._buckets) < self.max_keys

    def __len__(self) -> int:
        return len(self._buckets)


class ConnectionLimiter:
    """Counts open connections per peer and open sessions per caller.

    Args:
        max_connections_per_peer: concurrent connections from one peer (address or id).
        max_sessions_per_caller: concurrent sessions of one authenticated caller.
        max_connections_total: concurrent connections overall.
    """

    def __init__(self, max_connections_per_peer: int = 8, max_sessions_per_caller: int = 64,
                 max_connections_total: int = 256) -> None:
        self.max_connections_per_peer = max_connections_per_peer
        self.max_sessions_per_caller = max_sessions_per_caller
        self.max_connections_total = max_connections_total
        self._connections: dict[str, int] = {}
        self._sessions: dict[str, int] = {}
        self._total = 0

    def acquire_connection(self, peer: str) -> bool:
        """Count a new connection from `peer`, or return False if over a limit."""
        if (self._connections.get(peer, 0) >= self.max_connections_per_peer
                or self._total >= self.max_connections_total):
            return False
        self._connections[peer] = self._connections.get(peer, 0) + 1
        self._total += 1
        return True

    def release_connection(self, peer: str) -> None:
        if _decrement(self._connections, peer):
            self._total -= 1

    def acquire_session(self, caller: str) -> bool:
        """Count a new session of `caller`, or return False if over its limit."""
        if self._sessions.get(caller, 0) >= self.max_sessions_per_caller:
            return False
        self._sessions[caller] = self._sessions.get(caller, 0) + 1
        return True

    def release_session(self, caller: str) -> None:
        _decrement(self._sessions, caller)

    @contextlib.contextmanager
    def connection(self, peer: str) -> Iterator[None]:
        """Hold a connection slot for `peer`; raises `LimitExceeded` (too_many_connections)."""
        if not self.acquire_connection(peer):
            raise refuse(AuthReason.TOO_MANY_CONNECTIONS,
                         f"too many connections from {peer}", peer=peer)
        try:
            yield
        finally:
            self.release_connection(peer)

    @contextlib.contextmanager
    def session(self, caller: str) -> Iterator[None]:
        """Hold a session slot for `caller`; raises `LimitExceeded` (too_many_sessions)."""
        if not self.acquire_session(caller):
            raise refuse(AuthReason.TOO_MANY_SESSIONS,
                         f"{caller} has too many open sessions", caller=caller)
        try:
            yield
        finally:
            self.release_session(caller)

    def connections(self, peer: str) -> int:
        return self._connections.get(peer, 0)

    def sessions(self, caller: str) -> int:
        return self._sessions.get(caller, 0)


def _decrement(counts: dict[str, int], key: str) -> bool:
    """Decrement `key`'s count; False if it was not counted (a double release)."""
    n = counts.get(key, 0)
    if n <= 0:
        return False
    if n > 1:
        counts[key] = n - 1
    else:
        del counts[key]
    return True
