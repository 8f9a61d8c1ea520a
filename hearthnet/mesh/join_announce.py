"""The open invites on the LAN: announced by the inviter, found by ``hearthnet join CODE``
(M26 §5.8; mDNS/DNS-SD as in `hearthnet.mesh.discovery`, DESIGN.md decision 14).

While a node that uses mDNS discovery holds a pending invite, it announces one
``_hearthnet-join._tcp.local.`` service per invite: the join listener's address and port,
and in TXT the invite's id (``id``), the inviter's node id (``node``) and the protocol
version (``v``). ``hearthnet join XXXXX-XXXXX`` (the short code, no ``@host:port``) browses
for that service type and dials the announcers whose ``id`` matches its code. An
announcement is withdrawn (mDNS goodbye) as soon as its invite is used, burnt or expired,
and with every other service when the node stops.

**What the announcement may carry.** The id is the code's first `ID_CHARS` characters:
exactly what message 1 of the exchange already sends in clear to name the invite, and what
an inviter's ``unknown_invite`` answer confirms to anyone who asks. Nothing is computed from
the rest of the code: a hash or MAC of the code in TXT would be a *verifier*, letting
anyone who hears it test guesses offline at the speed of their hardware (2^40 guesses is
minutes on a GPU), which is the very attack SPAKE2 exists to rule out. SPAKE2's transcript
gives a passive listener nothing to test a guess against, and an active attacker one guess
per exchange; so with only the id public, the code's remaining 40 bits are tested online
only, `joining.MAX_TRIES` times per invite, as without mDNS.

**Announcements are not trusted** (as in `discovery`): anyone on the LAN can announce any
id at any address. An announcement gives an address only; the SPAKE2 exchange is what
authenticates. A spoofer the joiner dials runs the exchange without the code and learns
nothing but a failed guess (its key matches nobody's; the joiner's card is sealed under a
key the spoofer does not have). The joiner dials at most `MAX_CANDIDATES` announcers of
its id, so spoofers get no more guesses than that per `join`, and resolves a bounded
number of services (`MAX_RESOLVES`), so a flood of announcements costs it bounded work.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroconf import InterfaceChoice, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from hearthnet.errors import ConnectionLost
from hearthnet.ids import NODE_ID_RE
from hearthnet.mesh.discovery import stop_browsing
from hearthnet.observability import get_logger
from hearthnet.security.joining import ALPHABET, ID_CHARS

JOIN_SERVICE_TYPE = "_hearthnet-join._tcp.local."
JOIN_TXT_VERSION = "1"
FIND_TIMEOUT_S = 10.0  # how long `hearthnet join` looks by default (answers take ~0.1 s)
MAX_CANDIDATES = 3  # announcers of one id a join dials at most (each: one online guess)
MAX_RESOLVES = 64  # services one search resolves at most (a flood costs bounded work)
RESOLVE_TIMEOUT_MS = 3000

log = get_logger("mesh.join_announce")


@dataclass(frozen=True, slots=True)
class Inviter:
    """An announcement of an open invite: where to dial (not who: the exchange proves it)."""

    node_id: str
    host: str
    port: int


def inviter_from_service(properties: Mapping[bytes, bytes | None], addresses: list[str],
                         port: int | None, invite_id: str) -> Inviter | None:
    """The inviter a resolved join service names, or None when it is not an announcement
    of invite `invite_id` (another id, another version, malformed, no address)."""
    raw_id, raw_node = properties.get(b"id"), properties.get(b"node")
    if properties.get(b"v") != JOIN_TXT_VERSION.encode() or not raw_id or not raw_node:
        return None
    if raw_id.decode("ascii", "replace") != invite_id or not port or not addresses:
        return None
    node_id = raw_node.decode("utf-8", "replace")
    if not NODE_ID_RE.match(node_id):
        return None
    v4 = [a for a in addresses if ":" not in a]  # the inviter announces one IPv4 address
    return Inviter(node_id, (v4 or addresses)[0], port)


def _service_name(node_id: str, invite_id: str) -> str:
    return f"{node_id} invite {invite_id}.{JOIN_SERVICE_TYPE}"


class JoinAnnouncer:
    """The inviter's side: keeps one announcement per pending invite (`sync`).

    Args:
        zc: the node's running mDNS responder (`LanDiscovery.zeroconf`); its `stop`
            withdraws these services with the node's own.
        node_id: this node.
        ip: the address the join listener is reached at (the node's advertised one).
    """

    def __init__(self, zc: AsyncZeroconf, node_id: str, ip: str) -> None:
        self.zc, self.node_id, self.ip = zc, node_id, ip
        self._held: dict[str, AsyncServiceInfo] = {}
        self._lock = asyncio.Lock()  # syncs run one at a time, in call order

    @property
    def announced(self) -> set[str]:
        """The invite ids announced now."""
        return set(self._held)

    async def sync(self, pending: set[str], port: int) -> bool:
        """Announce the ids in `pending` at `port` and withdraw the others; True when all
        of `pending` is announced (False: mDNS failed here, the long code still works)."""
        async with self._lock:
            for invite_id in set(self._held) - pending:
                info = self._held.pop(invite_id)
                try:
                    await self.zc.async_unregister_service(info)
                except Exception as e:  # a failed goodbye: its records expire on their own
                    log.warning("invite_unannounce_failed", error=type(e).__name__)
                log.info("invite_unannounced", invite=invite_id)
            ok = True
            for invite_id in pending - set(self._held):
                if len(invite_id) != ID_CHARS or any(c not in ALPHABET for c in invite_id):
                    raise ValueError("not an invite id")  # our own book's: a bug, not input
                info = AsyncServiceInfo(
                    JOIN_SERVICE_TYPE, _service_name(self.node_id, invite_id),
                    addresses=[ipaddress.ip_address(self.ip).packed], port=port,
                    properties={"id": invite_id, "node": self.node_id,
                                "v": JOIN_TXT_VERSION},
                    server=f"{self.node_id}.local.")
                try:  # answers queries once this returns; the announcements follow
                    await self.zc.async_register_service(info, allow_name_change=True)
                except Exception as e:
                    log.warning("invite_announce_failed", error=type(e).__name__)
                    ok = False
                    continue
                self._held[invite_id] = info
                log.info("invite_announced", invite=invite_id, ip=self.ip, port=port)
            return ok


class InviterSearch:
    """The joiner's side: browse for announcements of one invite id (an async context
    manager); `next` gives each matching announcer once, as it is resolved.

    Args:
        invite_id: the code's first `ID_CHARS` characters.
        interfaces: where to browse (default: every interface).
    """

    def __init__(self, invite_id: str, *,
                 interfaces: InterfaceChoice | list[str] = InterfaceChoice.All) -> None:
        self.invite_id, self.interfaces = invite_id, interfaces
        self.seen = 0  # join services seen (any id): the timeout message says so
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._found: asyncio.Queue[Inviter] = asyncio.Queue()
        self._names: set[str] = set()
        self._dialable: set[tuple[str, int]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> InviterSearch:
        """Start browsing.

        Raises:
            ConnectionLost: mDNS cannot be used here (no multicast-capable interface).
        """
        try:
            self._zc = AsyncZeroconf(interfaces=self.interfaces)
            self._browser = AsyncServiceBrowser(self._zc.zeroconf, [JOIN_SERVICE_TYPE],
                                                handlers=[self._on_change])
        except OSError as e:
            await self.__aexit__()
            raise ConnectionLost(f"cannot look for the inviter by mDNS on this machine "
                                 f"({e.strerror or e}): use the long form "
                                 "CODE@HOST:PORT that `hearthnet invite` printed") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop_browsing(self._tasks, self._browser)
        if self._zc is not None:
            with contextlib.suppress(Exception):
                await self._zc.async_close()

    async def next(self, timeout_s: float) -> Inviter | None:
        """The next announcer of the invite, or None when none more came in `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._found.get()
        except TimeoutError:
            return None

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange, **_: Any) -> None:
        if state_change is ServiceStateChange.Removed or name in self._names:
            return
        self._names.add(name)
        self.seen += 1
        if len(self._names) > MAX_RESOLVES:
            return
        task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(JOIN_SERVICE_TYPE, name)
        if not await info.async_request(zeroconf, RESOLVE_TIMEOUT_MS):
            return
        got = inviter_from_service(info.properties, info.parsed_addresses(), info.port,
                                   self.invite_id)
        if got is not None and (got.host, got.port) not in self._dialable:
            self._dialable.add((got.host, got.port))
            self._found.put_nowait(got)
