"""LAN discovery by mDNS/DNS-SD (DESIGN.md decision 14), with python-zeroconf.

With ``[node] discovery = "mdns"`` a node announces itself as a ``_hearthnet._tcp.local.``
service (TXT: its node id and URI scheme) on the interface of its advertised address, and
browses for the others. A found peer is only an *address*: the node passes it to
``on_found(node_id, uri)`` when the node id is in its member list (`allowed`), and the
daemon then opens an ordinary gossip link, which is mutual TLS pinned to that member's key.
Discovery never admits anyone; a stranger announcing a member's node id gets no further
than the TLS handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable, Mapping
from typing import Any

from zeroconf import ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from hearthnet.ids import NODE_ID_RE
from hearthnet.observability import get_logger

SERVICE_TYPE = "_hearthnet._tcp.local."
RESOLVE_TIMEOUT_MS = 3000

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


class LanDiscovery:
    """Announce this node and find the others; see the module docstring.

    Args:
        node_id: this node.
        host: the address others dial (the node's advertised host; a name is resolved).
        port: the bound listener port.
        scheme: ``wss`` (mutual TLS) or ``ws`` (plaintext mode).
        allowed: whether a node id is a member (others are ignored).
        on_found: called once per member found at a new address.
    """

    def __init__(self, node_id: str, host: str, port: int, scheme: str, *,
                 allowed: Callable[[str], bool], on_found: Found) -> None:
        self.node_id, self.port, self.scheme = node_id, port, scheme
        self.ip = _ip_of(host)
        self.allowed, self.on_found = allowed, on_found
        self.found: dict[str, str] = {}
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._tasks: set[asyncio.Task[None]] = set()

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
        for t in list(self._tasks):
            t.cancel()
        if self._browser is not None:
            with contextlib.suppress(Exception):
                await self._browser.async_cancel()
        if self._zc is not None:
            with contextlib.suppress(Exception):
                await self._zc.async_unregister_all_services()
            await self._zc.async_close()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange, **_: Any) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zeroconf, RESOLVE_TIMEOUT_MS):
            return
        peer = peer_from_service(info.properties, info.parsed_addresses(), info.port)
        if peer is None:
            log.info("discovery_ignored", name=name, reason="not a hearthnet node")
            return
        node_id, uri = peer
        if node_id == self.node_id or self.found.get(node_id) == uri:
            return
        if not self.allowed(node_id):  # discovery never admits anyone
            log.info("discovery_ignored", name=name, node=node_id, reason="not a member")
            return
        self.found[node_id] = uri
        log.info("discovery_found", node=node_id, uri=uri)
        self.on_found(node_id, uri)


def _ip_of(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)
