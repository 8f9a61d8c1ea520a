"""The node's security wiring: identity, members, TLS, signed opens, limits (M26 §5.8, §5.9).

`NodeGuard` is built from a `NodeConfig` and holds everything the daemon consults before
doing work for a peer (M26 §5.8, §5.9):

- the node key (``<data_dir>/node.key``, created on first start) and the live
  `MemberDirectory` — the configured members plus this node itself (``steward``; its own
  CLI and its own shards act as it);
- the TLS contexts: a listener context pinned to the members, and per-dial client
  contexts pinned to the node being dialled (cached per member-list version);
- `admit_event`, the event log's membership policy: events of non-members and events
  with a bad or missing signature are refused, and an advertisement's or withdrawal's
  host must be the event's signer;
- `sign_open` / `verify_open` for shard session opens;
- connection, session and rate limits;
- `reload`: re-read the config file and apply member and trust changes (SIGHUP).

Nothing here logs payloads or tensors: refusals carry node ids and reasons only.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hearthnet.config import NodeConfig, load_config
from hearthnet.constants import CloseCode
from hearthnet.distributed_inference.directory.descriptors import (
    ADVERTISED,
    WITHDRAWN,
    parse_advertisement,
    parse_withdrawal,
)
from hearthnet.distributed_inference.placement.community import SERVED_MODELS
from hearthnet.errors import AuthError, ConfigError, PeerDataError, Refused
from hearthnet.mesh.eventlog import EVENT_TYPES, Event, canonical_bytes
from hearthnet.observability import Metrics, get_logger
from hearthnet.security import (
    ConnectionLimiter,
    MemberDirectory,
    NodeKey,
    OpenAuthVerifier,
    RateLimiter,
    Trust,
    client_context,
    member_gate,
    note_refusal,
    peer_node_id,
    server_context,
    sign_open,
    warn_insecure_plaintext,
)
from hearthnet.security.tls import ProcessRequest

log = get_logger("mesh.guard")

STATE_FILE = "node.json"


def member_rows(cfg: NodeConfig, key: NodeKey) -> list[dict[str, Any]]:
    """The member list the node enforces: the config's members plus the node itself.

    Raises:
        ConfigError: a member has no public key (run ``hearthnet keys provision``), or
            the config lists this node with a key that is not its own.
    """
    rows: list[dict[str, Any]] = []
    for m in cfg.community.members:
        if not m.public_key.strip():
            raise ConfigError(
                f"community member {m.node_id} has no public_key; generate keys and member "
                f"lists with `hearthnet keys provision <config folder>` (same machine) or "
                f"paste `hearthnet keys show` from {m.node_id}",
                file=str(cfg.source) if cfg.source else None,
                key="community.members.public_key", reason="missing")
        rows.append(m.model_dump())
    own = next((r for r in rows if r["node_id"] == cfg.node.id), None)
    if own is None:
        rows.append({"node_id": cfg.node.id, "public_key": key.public_key_b64,
                     "trust": Trust.STEWARD.label})
    elif own["public_key"].strip() != key.public_key_b64:
        raise ConfigError(
            f"the member list gives {cfg.node.id} a public key that is not this node's key "
            f"({key.path}); run `hearthnet keys show --config ...` and fix the list",
            file=str(cfg.source) if cfg.source else None, key="community.members",
            reason="own key mismatch")
    return rows


class NodeGuard:
    """Security state of one node; see the module docstring.

    Raises (constructor):
        ConfigError: unusable key file or member list.
    """

    def __init__(self, cfg: NodeConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.node_id = cfg.node.id
        self.metrics = metrics
        self.key = NodeKey.load_or_create(cfg.effective_data_dir())
        self.directory = MemberDirectory.from_dicts(member_rows(cfg, self.key))
        self.tls = not cfg.security.insecure_plaintext
        self.route_min_trust = Trust.parse(cfg.community.route_min_trust)
        self.bus_min_trust = {k: Trust.parse(v) for k, v in cfg.community.bus_min_trust.items()}
        self.on_reload: list[Callable[[], object]] = []  # live effects of a member change
        # (origin, type) -> events held: the event log's count, for per-origin quotas
        self.stored_count: Callable[[str, str], int] | None = None
        self.opens = OpenAuthVerifier(self.directory, Trust.parse(cfg.community.min_trust))
        sec = cfg.security
        self.limiter = ConnectionLimiter(max_connections_per_peer=sec.max_connections_per_peer,
                                         max_sessions_per_caller=sec.max_sessions_per_caller,
                                         max_connections_total=sec.max_connections_total)
        self.rate = RateLimiter(sec.connection_rate, sec.connection_burst)
        self.message_rate = RateLimiter(sec.message_rate, sec.message_burst)
        self._server_ssl: ssl.SSLContext | None = None
        self._client_ssl: dict[tuple[str | None, int], ssl.SSLContext] = {}
        if not self.tls:
            warn_insecure_plaintext(log)

    # ---- TLS: links carry activations, so encrypted (M26 §5.8) ----

    def server_ssl(self) -> ssl.SSLContext | None:
        """The listener's context (None in plaintext mode); follows reloads."""
        if self.tls and self._server_ssl is None:
            self._server_ssl = server_context(self.key, self.node_id, self.directory)
        return self._server_ssl

    def client_ssl(self, expect: str | None) -> ssl.SSLContext | None:
        """A context for dialling member `expect` (None: any member); None if plaintext.

        Raises:
            AuthError: ``unknown_member`` — `expect` is not a member.
        """
        if not self.tls:
            return None
        k = (expect, self.directory.version)
        ctx = self._client_ssl.get(k)
        if ctx is None:
            ctx = client_context(self.key, self.node_id, self.directory, expect=expect)
            self._client_ssl = {kk: v for kk, v in self._client_ssl.items()
                                if kk[1] == k[1]}
            self._client_ssl[k] = ctx
        return ctx

    def gate(self) -> ProcessRequest | None:
        """``process_request`` answering 403 to non-members (None if plaintext)."""
        return member_gate(self.directory, metrics=self.metrics) if self.tls else None

    def peer_of(self, conn: Any, expect: str | None = None) -> str | None:
        """The member at the other end of a TLS connection; None in plaintext mode.

        Raises:
            AuthError: not a member (or not `expect`).
        """
        return peer_node_id(conn, self.directory, expect=expect) if self.tls else None

    # ---- events: signed by a member, ads by their host ----

    def admit_event(self, ev: Event) -> str | None:
        """Why an ingested event must be dropped, or None (the event log's policy)."""
        if ev.signature is None:
            return "unsigned"
        reason = self.directory.check_event(ev.origin, ev.signing_bytes(), ev.signature)
        if reason is not None:
            return reason
        try:
            host = _event_host(ev)
        except PeerDataError:
            return "malformed"
        if host is not None:
            try:
                self.directory.check_advertisement(ev.origin, host)
            except AuthError as e:
                return str(e.details.get("reason", "host_not_signer"))
        if ev.type == SERVED_MODELS and not self.is_steward(ev.origin):
            return "not_steward"  # only a steward edits the served-model list
        return self._admit_by_type(ev)

    def _admit_by_type(self, ev: Event) -> str | None:
        """The event-type registry's limits, so no member can fill every log: allow-list,
        size, trust to originate, per-origin quota."""
        known = EVENT_TYPES.get(ev.type)
        if known is None:
            return "unknown_type"
        if len(canonical_bytes(ev.payload)) > known.max_payload_bytes:
            return "too_large"
        if not self.directory.meets(ev.origin, Trust.parse(known.min_trust)):
            return "insufficient_trust"
        if self.stored_count is not None and \
                self.stored_count(ev.origin, ev.type) >= known.max_per_origin:
            return "quota"
        return None

    def is_steward(self, node_id: str) -> bool:
        """Whether `node_id` is a member at trust ``steward`` (the top)."""
        return self.directory.trust_of(node_id) == Trust.STEWARD

    # ---- session opens: per-call signed authentication (M26 §5.8) ----

    def sign_open(self, params: dict[str, Any]) -> dict[str, Any]:
        """`params` plus this node's signed ``auth`` field."""
        return sign_open(self.key, self.node_id, params)

    def verify_open(self, fields: Any, peer: str | None) -> str:
        """The authenticated caller of an OPEN; raises `AuthError` (already counted)."""
        try:
            return self.opens.verify_open(fields, peer=peer)
        except Refused as e:
            sid = fields.get("shard_id") if isinstance(fields, Mapping) else None
            note_refusal(self.metrics, e, caller=e.details.get("caller"), peer=peer,
                         shard_id=str(sid)[:128] if sid is not None else None)
            raise

    def authorize_bus(self, capability: str, caller: str | None) -> None:
        """Refuse a `/bus` call of `caller` under the capability's minimum trust (default
        `community.min_trust`, per capability `community.bus_min_trust`), before any work,
        so a guest cannot chat under this node's identity; counted in ``auth_failures_total``.
        `caller` None is the local CLI (admin listener) or a plaintext mesh without
        identities."""
        if caller is None:
            return
        need = self.bus_min_trust.get(capability, self.opens.min_trust)
        if not self.directory.meets(caller, need):
            err = AuthError(f"{caller} may not call {capability[:128]!r} on {self.node_id}: "
                            f"it needs trust {need.label} or above",
                            reason="insufficient_trust", caller=caller)
            note_refusal(self.metrics, err, caller=caller, capability=capability[:128])
            raise err

    def host_allowed(self, host: str) -> bool:
        """Routing filter: may activations go to a shard on `host` (M26 §5.9)?"""
        return self.directory.meets(host, self.route_min_trust)

    # ---- limits on hostile traffic ----

    @contextlib.contextmanager
    def connection(self, peer: str) -> Iterator[None]:
        """Hold a connection slot for `peer` after its rate check; raises `AuthError`."""
        self.rate.check(peer)
        with self.limiter.connection(peer):
            yield

    def rate_limited(self, ws: Any, peer: str) -> RateLimitedConnection:
        """`ws` whose every received message counts against `peer`'s message rate."""
        return RateLimitedConnection(ws, lambda: self.message_rate.check(peer))

    # ---- reload: member changes apply without a restart ----

    def reload(self, path: str | Path | None = None) -> bool:
        """Re-read the config and apply members and trust minimums; False if refused.

        A bad file leaves everything as it was (logged). Other settings need a restart.
        """
        source = path or self.cfg.source
        if source is None:
            log.warning("reload_skipped", reason="config was not loaded from a file")
            return False
        try:
            cfg = load_config(source)
            if cfg.node.id != self.node_id:
                raise ConfigError(f"{source} is the config of {cfg.node.id}, not "
                                  f"{self.node_id}", key="node.id", reason="other node")
            rows = member_rows(cfg, self.key)
            min_trust = Trust.parse(cfg.community.min_trust)
            route_min = Trust.parse(cfg.community.route_min_trust)
            bus_min = {k: Trust.parse(v) for k, v in cfg.community.bus_min_trust.items()}
            self.directory.replace(rows)
        except ConfigError as e:
            log.error("reload_refused", error=e.message)
            return False
        self.opens.min_trust = min_trust
        self.route_min_trust = route_min
        self.bus_min_trust = bus_min
        log.info("reloaded", members=len(self.directory), min_trust=min_trust.label,
                 route_min_trust=route_min.label)
        for effect in self.on_reload:  # close what removed members hold open
            try:
                effect()
            except Exception:
                log.exception("reload_effect_failed")
        return True


class RateLimitedConnection:
    """A WebSocket connection whose `recv` first checks a message-rate limit (hostile input).

    Over the limit, `recv` raises `AuthError` (`rate_limited`); the connection's handler
    then closes it. Shard sessions need no such wrapper: their steps are bounded by the
    credit window, and a bus connection carries a single call.
    """

    def __init__(self, ws: Any, check: Callable[[], None]) -> None:
        self._ws, self._check = ws, check

    async def recv(self) -> str | bytes:
        data: str | bytes = await self._ws.recv()
        self._check()
        return data

    async def send(self, message: bytes) -> None:
        await self._ws.send(message)

    async def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        await self._ws.close(code, reason)


def _event_host(ev: Event) -> str | None:
    """The host an advertisement or withdrawal speaks for (None for other types)."""
    if ev.type == ADVERTISED:
        desc, _ = parse_advertisement(ev.payload)
        return desc.host
    if ev.type == WITHDRAWN:
        shard_id, _ = parse_withdrawal(ev.payload)
        return shard_id.rsplit("@", 1)[-1]
    return None


# ---- the running node's state file (CLI discovery, `--reload`) ----

def write_state(data_dir: Path, state: Mapping[str, Any]) -> Path:
    """Write ``<data_dir>/node.json`` (pid, admin URI, endpoint) atomically."""
    path = data_dir / STATE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(state)), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_state(data_dir: Path) -> dict[str, Any] | None:
    """The running node's state file, or None if absent/unreadable."""
    try:
        state = json.loads((data_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def remove_state(data_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (data_dir / STATE_FILE).unlink()
