"""The community member list: who may connect, sign events and see activations.

`MemberDirectory` is built from the config's ``[[community.members]]`` tables (node id,
base64 public key, trust level) and answers the membership questions: is this node a
member, is this its signature, is it trusted enough (M26 §5.8, §5.9). It is shared by the
transport, the event log and the router, and `replace` swaps the whole list atomically
when the config is reloaded, so a removed member is refused from the next
check on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from hearthnet.errors import AuthError, ConfigError
from hearthnet.observability import get_logger
from hearthnet.security.keys import (
    check_node_id,
    decode_public_key,
    encode_public_key,
    fingerprint,
    public_key_bytes,
    verify_signature,
)

_log = get_logger("security.members")

EventVerifier = Callable[[str, bytes, bytes], bool]


class Trust(IntEnum):
    """Trust levels of M01, ordered: ``guest < member < trusted < steward``."""

    GUEST = 0
    MEMBER = 1
    TRUSTED = 2
    STEWARD = 3

    @classmethod
    def parse(cls, value: object) -> Trust:
        """A `Trust` from its name (``"trusted"``) or itself.

        Raises:
            ConfigError: not one of guest, member, trusted, steward.
        """
        if isinstance(value, Trust):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        raise ConfigError(f"unknown trust level {value!r}: use one of "
                          + ", ".join(t.label for t in cls), key="trust",
                          reason="unknown trust level")

    @property
    def label(self) -> str:
        """The lowercase name used in configs, logs and metric labels."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Member:
    """One entry of the member list."""

    node_id: str
    public_key_raw: bytes
    trust: Trust
    public_key: Ed25519PublicKey = field(compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        """From a ``{"node_id", "public_key", "trust"}`` mapping (trust defaults to member).

        Raises:
            ConfigError: a field is missing or invalid.
        """
        if not isinstance(d, Mapping):
            raise ConfigError("a community member must be a table with node_id, public_key "
                              "and trust", key="community.members", reason="not a table")
        node_id = check_node_id(d.get("node_id"))
        pk_text = d.get("public_key")
        if not isinstance(pk_text, str) or not pk_text.strip():
            raise ConfigError(
                f"member {node_id} has no public_key: run `hearthnet keys provision "
                "<config folder>` (or scripts/gen_mesh_keys.py), or paste `hearthnet keys "
                "show` from that node",
                key="community.members.public_key", reason="missing")
        public_key = decode_public_key(pk_text)
        trust = Trust.parse(d.get("trust", "member"))
        return cls(node_id, public_key_bytes(public_key), trust, public_key)

    @property
    def public_key_b64(self) -> str:
        return encode_public_key(self.public_key_raw)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key_raw)

    def to_dict(self) -> dict[str, str]:
        """The member as a config table."""
        return {"node_id": self.node_id, "public_key": self.public_key_b64,
                "trust": self.trust.label}


@dataclass(frozen=True)
class _Snapshot:
    by_id: Mapping[str, Member]
    by_key: Mapping[bytes, Member]
    version: int


def _index(members: Iterable[Member], version: int) -> _Snapshot:
    by_id: dict[str, Member] = {}
    by_key: dict[bytes, Member] = {}
    for m in members:
        if m.node_id in by_id:
            raise ConfigError(f"member {m.node_id} is listed twice",
                              key="community.members", reason="duplicate node id")
        if m.public_key_raw in by_key:
            raise ConfigError(f"members {by_key[m.public_key_raw].node_id} and {m.node_id} "
                              "have the same public key", key="community.members",
                              reason="duplicate public key")
        by_id[m.node_id] = m
        by_key[m.public_key_raw] = m
    return _Snapshot(by_id, by_key, version)


class MemberDirectory:
    """The current member list; safe to read from any thread while `replace` runs.

    Readers take the current immutable snapshot with one attribute read; `replace`
    validates the new list completely before swapping it in, so a bad reload leaves the
    old list in force.
    """

    def __init__(self, members: Iterable[Member] = ()) -> None:
        self._lock = threading.Lock()
        self._snap = _index(members, 0)

    @classmethod
    def from_dicts(cls, rows: Iterable[Mapping[str, Any]]) -> MemberDirectory:
        """From the config's member tables. Raises `ConfigError` on any bad entry."""
        return cls(parse_members(rows))

    def replace(self, members: Iterable[Member | Mapping[str, Any]]) -> None:
        """Swap in a new member list (config reload).

        Raises:
            ConfigError: the new list is invalid; the old list stays in force.
        """
        parsed = [m if isinstance(m, Member) else Member.from_dict(m) for m in members]
        with self._lock:
            new = _index(parsed, self._snap.version + 1)
            removed = sorted(set(self._snap.by_id) - set(new.by_id))
            self._snap = new
        _log.info("members_replaced", members=len(new.by_id), removed=removed,
                  version=new.version)

    @property
    def version(self) -> int:
        """Increments on every `replace`; lets caches (TLS contexts) notice a reload."""
        return self._snap.version

    def get(self, node_id: str) -> Member | None:
        return self._snap.by_id.get(node_id) if isinstance(node_id, str) else None

    def by_public_key(self, raw: bytes) -> Member | None:
        """The member whose raw 32-byte public key is `raw`, if any."""
        return self._snap.by_key.get(bytes(raw)) if isinstance(raw, (bytes, bytearray)) \
            else None

    def trust_of(self, node_id: str) -> Trust | None:
        """The member's trust level, or None for a non-member."""
        m = self.get(node_id)
        return m.trust if m else None

    def meets(self, node_id: str, min_trust: Trust) -> bool:
        """Whether `node_id` is a member at `min_trust` or above (routing, M26 §5.9)."""
        t = self.trust_of(node_id)
        return t is not None and t >= min_trust

    def verify(self, node_id: str, data: bytes, sig: bytes) -> bool:
        """Whether `sig` is member `node_id`'s signature of `data` (False for non-members)."""
        m = self.get(node_id)
        return m is not None and verify_signature(m.public_key, data, sig)

    def check_event(self, origin: str, data: bytes, sig: bytes,
                    min_trust: Trust = Trust.GUEST) -> str | None:
        """Why an event must be dropped, or None if it is good: only members sign events.

        Returns one of ``"unknown_origin"``, ``"insufficient_trust"``, ``"bad_signature"``
        (the labels of ``events_rejected_total``).
        """
        m = self.get(origin)
        if m is None:
            return "unknown_origin"
        if m.trust < min_trust:
            return "insufficient_trust"
        if not verify_signature(m.public_key, data, sig):
            return "bad_signature"
        return None

    def event_verifier(self, *, metrics: Any = None, min_trust: Trust = Trust.GUEST,
                       ) -> EventVerifier:
        """A ``(origin, data, sig) -> bool`` check for the event log.

        A refused event is counted in ``events_rejected_total{reason}`` (if `metrics` is
        given) and logged with its origin and the reason — never its payload. The check
        reads the live list, so it follows `replace`.
        """
        def verify_event(origin: str, data: bytes, sig: bytes) -> bool:
            reason = self.check_event(origin, data, sig, min_trust)
            if reason is None:
                return True
            if metrics is not None:
                metrics.events_rejected_total.labels(reason=reason).inc()
            _log.warning("event_rejected", reason=reason, origin=_printable(origin))
            return False
        return verify_event

    def check_advertisement(self, origin: str, host: str) -> None:
        """Refuse an advertisement whose ``host`` is not its signer: no member speaks for another.

        Call after the event's signature was verified against `origin`.

        Raises:
            AuthError: reason ``host_not_signer`` or ``unknown_member``.
        """
        if self.get(origin) is None:
            raise AuthError(f"advertisement from non-member {_printable(origin)}",
                            reason="unknown_member")
        if host != origin:
            raise AuthError(f"advertisement signed by {origin} claims host "
                            f"{_printable(host)}", reason="host_not_signer")

    def members(self) -> list[Member]:
        """The current members, sorted by node id."""
        return sorted(self._snap.by_id.values(), key=lambda m: m.node_id)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, str) and node_id in self._snap.by_id

    def __len__(self) -> int:
        return len(self._snap.by_id)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members())


def parse_members(rows: Iterable[Mapping[str, Any]]) -> list[Member]:
    """Parse and cross-check member tables. Raises `ConfigError`."""
    members = [Member.from_dict(r) for r in rows]
    _index(members, 0)
    return members


def _printable(value: object, limit: int = 64) -> str:
    """A bounded, printable rendering of an untrusted id for a log line."""
    text = value if isinstance(value, str) else repr(value)
    return text[:limit].encode("ascii", "backslashreplace").decode("ascii")
