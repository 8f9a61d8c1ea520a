"""LAN discovery by mDNS/DNS-SD (DESIGN.md decision 14), with python-zeroconf.

With ``[node] discovery = "mdns"`` a node announces itself as a ``_hearthnet._tcp.local.``
service (TXT: its node id and URI scheme) on the interface of its advertised address, and
browses for the others. A found peer is only an *address*: the node passes it to
``on_found(node_id, uri)`` when the node id is in its member list (`allowed`), and the
daemon then opens an ordinary gossip link, which is mutual TLS pinned to that member's key.
Discovery never admits anyone; a stranger announcing a member's node id gets no further
than the TLS handshake.

Announcements are not trusted to be few or honest (M26 §5.8): anyone on the LAN can
announce a member's id at any address. `DiscoveredPeers` holds what was found, bounded:
one address per member id (the latest announced), at most `MAX_DISCOVERED` in all, each
dropped when its service is removed (mDNS ``Removed``: a goodbye, or its records expired)
or when it was neither announced again nor linked for `DISCOVERY_TTL_S`. The daemon's
`mesh.links.LinkKeeper` dials only the addresses held now, so a spoofer that leaves
leaves nothing that is redialled, and an address refused by TLS is `forget`-ed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from hearthnet.ids import NODE_ID_RE
from hearthnet.observability import get_logger

SERVICE_TYPE = "_hearthnet._tcp.local."
RESOLVE_TIMEOUT_MS = 3000
# python-zeroconf reports no refresh of an unchanged service, so "seen" is an announcement
# or a link that authenticated at the address; a member's live node is linked long before
# this runs out, and a spoofer's address that nobody could link to is gone after it
DISCOVERY_TTL_S = 300.0
MAX_DISCOVERED = 256  # addresses held at most (one per member id; members only)
MAX_RESOLVING = 16  # services resolved at once; more wait their turn (a flood)
MAX_WAITING = 256  # services waiting to be resolved; past that, announcements are dropped

log = get_logger("mesh.discovery")

Found = Callable[[str, str], None]


def peer_from_service(properties: Mapping[bytes, bytes | None], addresses: list[str],
                      port: int | None) -> tuple[str, str] | None:
    """``(node_id, base URI)`` of a resolved service, or None when it is not a HearthNet
    node's (no or malformed id, no address, bad scheme)."""
    raw_id, raw_scheme = properties.get(b"id"), properties.get(b"scheme")
    if not raw_id or not port or not addresses:
        return None
    node_id = raw_id.decode("utf-8", "replace")
    scheme = (raw_scheme or b"wss").decode("ascii", "replace")
    if not NODE_ID_RE.match(node_id) or scheme not in ("ws", "wss"):
        return None
    host = addresses[0]
    if ":" in host:
        host = f"[{host}]"
    return node_id, f"{scheme}://{host}:{port}"


async def stop_browsing(tasks: Iterable[asyncio.Task[Any]],
                        browser: AsyncServiceBrowser | None) -> None:
    """Cancel the lookups under way and stop the browser (whatever zeroconf raises while
    it shuts down: the node is stopping either way)."""
    for t in list(tasks):
        t.cancel()
    if browser is not None:
        with contextlib.suppress(Exception):
            await browser.async_cancel()


@dataclass(slots=True)
class Sighting:
    """The current discovered address of one member."""

    node_id: str
    uri: str
    name: str  # the mDNS service instance that announced it
    seen_at: float  # monotonic: last announced, or last linked


class DiscoveredPeers:
    """The discovered addresses, bounded and expiring; see the module docstring.

    Args:
        ttl_s: an address neither announced again nor linked for this long is dropped.
        cap: addresses held at most; a new member's address evicts the least recently
            seen one.
        clock: monotonic seconds.
        linked: whether the node holds an authenticated gossip link to ``(node_id, uri)``
            now; such an address counts as seen (it is still good).
    """

    def __init__(self, *, ttl_s: float = DISCOVERY_TTL_S, cap: int = MAX_DISCOVERED,
                 clock: Callable[[], float] = time.monotonic,
                 linked: Callable[[str, str], bool] | None = None) -> None:
        self.ttl_s, self.cap, self.clock = ttl_s, cap, clock
        self.linked = linked
        self._by_id: dict[str, Sighting] = {}

    def announced(self, name: str, node_id: str, uri: str) -> bool:
        """Record that service `name` announced member `node_id` at `uri`; True when that
        is a new address for it (the latest announcement replaces the one held)."""
        now = self.clock()
        held = self._by_id.get(node_id)
        if held is not None and held.uri == uri:
            held.seen_at, held.name = now, name
            return False
        if held is None and len(self._by_id) >= self.cap:
            oldest = min(self._by_id.values(), key=lambda s: s.seen_at)
            del self._by_id[oldest.node_id]
            log.info("discovery_evicted", node=oldest.node_id, uri=oldest.uri)
        self._by_id[node_id] = Sighting(node_id, uri, name, now)
        return True

    def removed(self, name: str) -> Sighting | None:
        """Service `name` went away: drop the address it announced, if still held."""
        gone = next((s for s in self._by_id.values() if s.name == name), None)
        if gone is not None:
            del self._by_id[gone.node_id]
        return gone

    def forget(self, node_id: str, uri: str) -> bool:
        """Drop `uri` as `node_id`'s address (a dial there was refused); True if held."""
        held = self._by_id.get(node_id)
        if held is None or held.uri != uri:
            return False
        del self._by_id[node_id]
        return True

    def expire(self) -> list[Sighting]:
        """Drop the addresses not seen for `ttl_s`; returns them."""
        now = self.clock()
        for s in self._by_id.values():
            if self.linked is not None and self.linked(s.node_id, s.uri):
                s.seen_at = now
        gone = [s for s in self._by_id.values() if now - s.seen_at >= self.ttl_s]
        for s in gone:
            del self._by_id[s.node_id]
        return gone

    def current(self) -> dict[str, str]:
        """``{node_id: uri}`` of the addresses held now (expired ones dropped first)."""
        for s in self.expire():
            log.info("discovery_expired", node=s.node_id, uri=s.uri)
        return {s.node_id: s.uri for s in self._by_id.values()}

    def __len__(self) -> int:
        return len(self._by_id)


class LanDiscovery:
    """Announce this node and find the others; see the module docstring.

    Args:
        node_id: this node.
        host: the address others dial (the node's advertised host; a name is resolved).
        port: the bound listener port.
        scheme: ``wss`` (mutual TLS) or ``ws`` (plaintext mode).
        allowed: whether a node id is a member (others are ignored).
        on_found: called once per member found at a new address.
        on_lost: called when a member's address is dropped (service removed).
        peers: the address book (default: a `DiscoveredPeers` with default bounds).
    """

    def __init__(self, node_id: str, host: str, port: int, scheme: str, *,
                 allowed: Callable[[str], bool], on_found: Found,
                 on_lost: Found | None = None, peers: DiscoveredPeers | None = None) -> None:
        self.node_id, self.port, self.scheme = node_id, port, scheme
        self.ip = _ip_of(host)
        self.allowed, self.on_found, self.on_lost = allowed, on_found, on_lost
        self.peers = peers if peers is not None else DiscoveredPeers()
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._resolving: set[str] = set()  # service names being resolved now
        self._waiting: dict[str, Zeroconf] = {}  # names to resolve next, oldest first

    async def start(self) -> None:
        self._zc = AsyncZeroconf(interfaces=[self.ip])
        info = AsyncServiceInfo(
            SERVICE_TYPE, f"{self.node_id}.{SERVICE_TYPE}",
            addresses=[ipaddress.ip_address(self.ip).packed], port=self.port,
            properties={"id": self.node_id, "scheme": self.scheme},
            server=f"{self.node_id}.local.")
        await self._zc.async_register_service(info)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE],
                                            handlers=[self._on_change])
        log.info("discovery_started", ip=self.ip, port=self.port)

    async def stop(self) -> None:
        self._waiting.clear()
        await stop_browsing(self._tasks, self._browser)
        if self._zc is not None:
            with contextlib.suppress(Exception):
                await self._zc.async_unregister_all_services()
            await self._zc.async_close()

    @property
    def zeroconf(self) -> AsyncZeroconf | None:
        """The running mDNS responder (None before `start`): this node's other
        announcements (`join_announce.JoinAnnouncer`) share it, and `stop` withdraws
        them with the node's own."""
        return self._zc

    def current(self) -> dict[str, str]:
        """``{member id: uri}`` of the addresses discovered and held now."""
        return self.peers.current()

    def forget(self, node_id: str, uri: str) -> None:
        """A dial of `node_id` at `uri` was refused (not that member): drop the address."""
        if self.peers.forget(node_id, uri):
            log.info("discovery_forgotten", node=node_id, uri=uri, reason="refused")

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange, **_: Any) -> None:
        if state_change is ServiceStateChange.Removed:
            self._waiting.pop(name, None)
            self.removed(name)
        elif state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            # bounded work under a flood of announcements, and a member's own announcement
            # drowned in one is still resolved in its turn (M26 §5.8)
            if name in self._resolving or name in self._waiting:
                return
            if len(self._resolving) < MAX_RESOLVING:
                self._start_resolving(zeroconf, name)
            elif len(self._waiting) < MAX_WAITING:
                self._waiting[name] = zeroconf
            else:
                log.info("discovery_ignored", name=name, reason="too many announcements")

    def _start_resolving(self, zeroconf: Zeroconf, name: str) -> None:
        self._resolving.add(name)
        task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._resolved(t, name))

    def _resolved(self, task: asyncio.Task[None], name: str) -> None:
        """One resolution ended (whatever its outcome): start the next waiting one."""
        self._tasks.discard(task)
        self._resolving.discard(name)
        if self._waiting and not task.cancelled():
            nxt = next(iter(self._waiting))
            self._start_resolving(self._waiting.pop(nxt), nxt)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zeroconf, RESOLVE_TIMEOUT_MS):
            return
        self.announced(name, peer_from_service(info.properties, info.parsed_addresses(),
                                               info.port))

    def announced(self, name: str, peer: tuple[str, str] | None) -> None:
        """Service `name` resolved to `peer` (``(node_id, uri)``; None: not a node's)."""
        if peer is None:
            log.info("discovery_ignored", name=name, reason="not a hearthnet node")
            return
        node_id, uri = peer
        if node_id == self.node_id:
            return
        if not self.allowed(node_id):  # discovery never admits anyone
            log.info("discovery_ignored", name=name, node=node_id, reason="not a member")
            return
        if self.peers.announced(name, node_id, uri):
            log.info("discovery_found", node=node_id, uri=uri)
            self.on_found(node_id, uri)

    def removed(self, name: str) -> None:
        """Service `name` went away (mDNS ``Removed``): its address is dialled no more."""
        gone = self.peers.removed(name)
        if gone is not None:
            log.info("discovery_removed", node=gone.node_id, uri=gone.uri)
            if self.on_lost is not None:
                self.on_lost(gone.node_id, gone.uri)


def _ip_of(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)
