"""Host liveness on every node: which shard hosts refuse connections, long before ads expire.

A host's advertisements stay live for 4 × the health timeout and its shards count as online
until the health timeout (30 s by default) has passed without a heartbeat. A ``kill -9``ed
host says nothing, so without this module a node that has no gossip link of its own to the
dead host (the chain A-B-C of ``config/mesh3``: A only hears C through B) shows it online
for those 30 s and routes calls to it.

`HostLiveness` runs on every node (not only on automatic hosts): every
``host_probe_interval_seconds`` it opens a TCP connection to the listener of every other
host with a live advertisement (`HostProber`), and closes it at once — no TLS handshake, no
message. A host whose listener refuses (or does not accept within the probe timeout)
``host_probe_failures`` times in a row is **down**; one accepted connection, or an
advertisement it made after it went down (a restarted host re-advertises at once, before
the next probe), makes it up again. A down host's shards are

- **offline** in the node's status (`hearthnet status`, ``/status``, the web page,
  ``/v1/models`` coverage) with the reason (`reason`);
- **never chosen** by the router (`directory.routing`), so a new call
  does not open a session on a dead host (failover already excludes a stage that fails);
- left out of automatic placement, which re-hosts their ranges (`autohost`).

The kernel accepts TCP connections even while a busy node's event loop is occupied, so a
slow host is not mistaken for a dead one; a host behind a firewall that drops the probe's
SYN is (it does not answer its members either).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.observability import get_logger

log = get_logger("distributed_inference.liveness")


class HostProber:
    """TCP reachability of a set of hosts, with ``failures_to_down`` misses to go down."""

    def __init__(self, failures_to_down: int, timeout_s: float) -> None:
        self.failures_to_down = failures_to_down
        self.timeout_s = timeout_s
        self._fails: dict[str, int] = {}
        self.down_since: dict[str, float] = {}

    def is_down(self, host: str) -> bool:
        return host in self.down_since

    async def probe(self, hosts: dict[str, str]) -> bool:
        """Probe every ``{host: endpoint}``; True when some host changed state."""
        results = await asyncio.gather(*(self._reachable(ep) for ep in hosts.values()))
        changed = False
        for host, ok in zip(hosts, results, strict=True):
            changed |= self._note(host, ok)
        for host in [h for h in self.down_since if h not in hosts]:
            del self.down_since[host]  # its advertisements are gone anyway
            self._fails.pop(host, None)
        return changed

    def _note(self, host: str, ok: bool) -> bool:
        if ok:
            self._fails.pop(host, None)
            if self.down_since.pop(host, None) is not None:
                log.info("host_reachable_again", host=host)
                return True
            return False
        self._fails[host] = self._fails.get(host, 0) + 1
        if self._fails[host] >= self.failures_to_down and host not in self.down_since:
            self.down_since[host] = time.time()
            log.warning("host_unreachable", host=host, failures=self._fails[host])
            return True
        return False

    async def _reachable(self, endpoint: str) -> bool:
        parts = urlsplit(endpoint)
        if not parts.hostname or not parts.port:
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                _, writer = await asyncio.open_connection(parts.hostname, parts.port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True


class HostLiveness:
    """Probes the hosts of the live advertisements of `store`; see the module docstring."""

    def __init__(self, store: ShardStore, self_id: str, *, interval_s: float,
                 failures: int) -> None:
        self.store, self.self_id, self.interval_s = store, self_id, interval_s
        self.prober = HostProber(failures, timeout_s=min(2.0, interval_s))
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever some host went down or came back."""
        self._listeners.append(listener)

    def is_down(self, host: str) -> bool:
        since = self.prober.down_since.get(host)
        if since is None:
            return False
        return not any(ad.descriptor.host == host and ad.seen_at > since
                       for ad in self.store.live())

    def down_hosts(self) -> list[str]:
        return [h for h in sorted(self.prober.down_since) if self.is_down(h)]

    def reason(self, host: str, now: float | None = None) -> str | None:
        """Why `host` counts as down (None when it does not)."""
        since = self.prober.down_since.get(host)
        if since is None or not self.is_down(host):
            return None
        now = time.time() if now is None else now
        return (f"host {host} refuses connections (TCP probe failed "
                f"{self.prober.failures_to_down}x in a row, {now - since:.0f} s ago)")

    async def probe_once(self) -> bool:
        """One round over every other advertising host; True when some host changed."""
        hosts = {ad.descriptor.host: ad.descriptor.endpoint for ad in self.store.live()
                 if ad.descriptor.host != self.self_id}
        changed = await self.prober.probe(hosts)
        if changed:
            for listener in self._listeners:
                listener()
        return changed

    async def run(self) -> None:
        """Probe every ``interval_s`` until cancelled (the node supervises it)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_once()
