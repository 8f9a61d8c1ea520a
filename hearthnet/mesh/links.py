"""Which gossip links a node keeps beyond its configured peers (M26 §5.1, §5.8).

A node dials its configured peers (``[node] peers``) for as long as it runs. Those alone
let one failure cut a node off: in the chain A–B–C–D, D's heartbeats reach A only through
C, and with C dead D's advertisements expire at A while D is up. `LinkKeeper` keeps more
links, from what the node knows of the community's members:

- **discovered**: every member that mDNS discovery (`mesh.discovery`) holds an address of
  now is dialled there, as before (one address per member; gone when discovery drops it).
- **fill**: while fewer than `target` distinct members are linked (incoming links count),
  other known members are dialled: at the endpoint they signed into their shard
  advertisements (a member's gossip endpoint is its shard endpoint, path ``/gossip``) or a
  discovered address. Two is the smallest count that no single link or node failure
  takes to zero, and the spare link is up *before* the failure, so heartbeats never
  stop; each link more carries every event once more.
- **repair**: a member whose advertisements are still held but whose heartbeats stopped
  arriving (``stale``: it may be up, with our gossip path to it broken) is dialled
  directly, whatever the count.

Every dial is pinned to the one member it means to reach (the daemon's `make_link`: TLS to
that member's key, and the hello must name it); a non-member is never dialled and a link
to a member removed from the list is stopped. A managed link makes one connection: when
it ends the keeper decides again, with exponential backoff per member (`min_backoff_s`
doubling to `max_backoff_s`, ±20 % jitter; a link that held restarts from the minimum).
A link refused authentication, or answered by another node, is dropped: its address is
set aside for `quarantine_s` (``on_refused`` lets discovery forget it) and the member
backs off to the maximum, so a spoofed address is dialled once, not every few seconds.
A member linked another way (its own incoming link, a configured peer) is not dialled.

The keeper holds no socket: `tick` decides from what the callbacks report (tested with fake
links and an injected clock); `run` calls it every `tick_s` and on `wake`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hearthnet.background import detach
from hearthnet.observability import get_logger

DEFAULT_TARGET = 2  # distinct members linked: the least that survives any one failure
MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
QUARANTINE_S = 600.0  # a refused (member, address) is not dialled again for this long
MAX_QUARANTINED = 256  # refused addresses remembered at most (the oldest go first)
TICK_S = 1.0

VIA_AD, VIA_MDNS = "advertised", "discovered"

_log = get_logger("mesh.links")


@dataclass(frozen=True, slots=True)
class Known:
    """An address of a member, as this node knows it.

    Attributes:
        node_id: the member.
        uri: its base URI (``wss://host:port``); gossip is at ``<uri>/gossip``.
        source: `VIA_AD` (its signed shard advertisement) or `VIA_MDNS` (mDNS discovery).
        stale: its advertisements are held but its heartbeats stopped arriving.
    """

    node_id: str
    uri: str
    source: str
    stale: bool = False


class Link(Protocol):
    """What the keeper needs of a gossip link (`mesh.gossip.GossipPeerLink`)."""

    uri: str
    peer_id: str | None

    @property
    def connected(self) -> bool: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


L = TypeVar("L", bound=Link)
OnEnd = Callable[[str, bool], None]  # (how: refused | unreachable | closed, held)


@dataclass(slots=True)
class _Backoff:
    failures: int = 0
    next_at: float = 0.0  # monotonic: not dialled before


class LinkKeeper(Generic[L]):
    """Keeps the node's managed gossip links; see the module docstring.

    Args:
        node_id: this node (never dialled).
        links: the node's list of outgoing links (configured ones included, which the
            keeper reads and never touches); managed links are added and removed here.
        make_link: ``(member id, uri, on_end)`` -> a managed link to that member, not
            started, that never redials and calls ``on_end(how, held)`` when it ends.
        known: the member addresses known now.
        live: the members linked now (any connection past the hello, in or out).
        is_member: whether a node id is in the member list now.
        on_refused: ``(node_id, uri)`` of a refused dial (discovery forgets it).
        target: fill up to this many distinct linked members (0: no fill).
    """

    def __init__(self, node_id: str, links: list[L], *,
                 make_link: Callable[[str, str, OnEnd], L],
                 known: Callable[[], Iterable[Known]], live: Callable[[], set[str]],
                 is_member: Callable[[str], bool],
                 on_refused: Callable[[str, str], None] | None = None,
                 target: int = DEFAULT_TARGET, min_backoff_s: float = MIN_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, quarantine_s: float = QUARANTINE_S,
                 tick_s: float = TICK_S, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.node_id, self.links = node_id, links
        self.make_link, self.known, self.live = make_link, known, live
        self.is_member, self.on_refused = is_member, on_refused
        self.target = target
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max(min_backoff_s,
                                                                     max_backoff_s)
        self.quarantine_s, self.tick_s, self.clock = quarantine_s, tick_s, clock
        self.rng = rng or random.Random()
        self.managed: dict[str, L] = {}  # member id -> its managed link
        self._backoff: dict[str, _Backoff] = {}
        self._quarantined: dict[tuple[str, str], float] = {}  # (id, uri) -> until
        self._wake = asyncio.Event()

    # ---- queries ----

    def linked(self, node_id: str, uri: str) -> bool:
        """A managed link to `node_id` at `uri` is connected now."""
        link = self.managed.get(node_id)
        return link is not None and link.uri == uri.rstrip("/") and link.connected

    def backoff_of(self, node_id: str) -> tuple[int, float]:
        """``(failures in a row, not dialled before)`` of a member (monotonic time)."""
        b = self._backoff.get(node_id, _Backoff())
        return b.failures, b.next_at

    # ---- the loop ----

    def wake(self) -> None:
        """Decide again now (a link came up or went down, an address was found or lost)."""
        self._wake.set()

    async def run(self) -> None:
        """Call `tick` every `tick_s` seconds and on `wake`, until cancelled."""
        while True:
            self._wake.clear()
            self.tick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.tick_s):
                    await self._wake.wait()

    def tick(self) -> None:
        """Stop the managed links no longer wanted and dial the members wanted now."""
        now = self.clock()
        self._quarantined = {k: t for k, t in self._quarantined.items() if t > now}
        known = self._usable(self.known())
        live = self.live()
        self._prune(known, live, now)
        for node_id, uri in self._wanted(known, live, now):
            self._dial(node_id, uri)

    # ---- deciding ----

    def _usable(self, rows: Iterable[Known]) -> dict[str, list[Known]]:
        """Members' addresses that may be dialled, by member: advertised ones first (a
        member signed them), no non-member, not this node, nothing refused lately."""
        out: dict[str, list[Known]] = {}
        for k in rows:
            uri = k.uri.rstrip("/")
            if k.node_id == self.node_id or not self.is_member(k.node_id) \
                    or (k.node_id, uri) in self._quarantined:
                continue
            row = Known(k.node_id, uri, k.source, k.stale)
            if all(r.uri != uri for r in out.get(k.node_id, ())):
                out.setdefault(k.node_id, []).append(row)
        for rows_ in out.values():
            rows_.sort(key=lambda r: r.source != VIA_AD)
        return out

    def _prune(self, known: dict[str, list[Known]], live: set[str], now: float) -> None:
        """Stop a managed link to a non-member; and one not connected whose address is
        no longer known (discovery dropped or replaced it, the advertisement expired) or
        whose member is linked another way. A connected link to a member stays: it is
        authenticated. A dial cut off by a new address counts as a failed one, so a flood
        of announcements is dialled at the backoff's pace, not at the flood's."""
        for node_id, link in list(self.managed.items()):
            if not self.is_member(node_id):
                self._stop(node_id, "not a member")
            elif link.connected:
                continue
            elif all(k.uri != link.uri for k in known.get(node_id, ())):
                self._stop(node_id, "address no longer known")
                self._back_off(node_id, now, held=False)
            elif node_id in live:
                self._stop(node_id, "linked another way")

    def _wanted(self, known: dict[str, list[Known]], live: set[str], now: float
                ) -> list[tuple[str, str]]:
        """``(member, uri)`` to dial now: every discovered or stale member, then others
        until `target` members are linked or being dialled."""
        configured = [link for link in self.links if link not in self.managed.values()]
        covered = live | set(self.managed) | {
            link.peer_id for link in configured if link.peer_id is not None}
        taken = {link.uri for link in configured}
        free = []
        for node_id, rows in known.items():
            b = self._backoff.get(node_id, _Backoff())
            if node_id in covered or b.next_at > now:
                continue
            rows = [r for r in rows if r.uri not in taken]
            if rows:  # alternate between a member's addresses as dials there fail
                free.append((node_id, rows, rows[b.failures % len(rows)].uri, b.failures))
        must = [(n, uri) for n, rows, uri, _ in free
                if any(r.source == VIA_MDNS or r.stale for r in rows)]
        need = self.target - len(live | set(self.managed)) - len(must)
        chosen = {n for n, _ in must}
        rest = [f for f in free if f[0] not in chosen]
        self.rng.shuffle(rest)
        rest.sort(key=lambda f: f[3])  # members that failed least first, else at random
        return must + [(n, uri) for n, _, uri, _ in rest[:max(0, need)]]

    # ---- acting ----

    def _dial(self, node_id: str, uri: str) -> None:
        link = self.make_link(node_id, uri, lambda how, held: self._ended(
            node_id, uri, link, how, held))
        self.managed[node_id] = link
        self.links.append(link)
        _log.info("gossip_link_dialling", node=self.node_id, peer=node_id, uri=uri)
        link.start()

    def _stop(self, node_id: str, why: str) -> None:
        link = self.managed.pop(node_id)
        with contextlib.suppress(ValueError):
            self.links.remove(link)
        _log.info("gossip_link_dropped", node=self.node_id, peer=node_id, uri=link.uri,
                  reason=why)
        detach(link.stop())

    def _ended(self, node_id: str, uri: str, link: L, how: str, held: bool) -> None:
        """A managed link ended by itself: forget it and back its member off."""
        if self.managed.get(node_id) is link:
            del self.managed[node_id]
        with contextlib.suppress(ValueError):
            self.links.remove(link)
        now = self.clock()
        refused = how == "refused"
        if refused:  # not that member there (a spoofed or stale address)
            self._quarantine(node_id, uri, now)
            if self.on_refused is not None:
                self.on_refused(node_id, uri)
        next_at = self._back_off(node_id, now, held=held, refused=refused)
        _log.info("gossip_link_ended", node=self.node_id, peer=node_id, uri=uri, how=how,
                  retry_in_s=round(next_at - now, 1))
        self.wake()

    def _back_off(self, node_id: str, now: float, *, held: bool,
                  refused: bool = False) -> float:
        """Set when `node_id` may be dialled again; returns that time."""
        b = self._backoff.setdefault(node_id, _Backoff())
        if held:  # it worked: dial again soon (the peer restarted, a network blip)
            b.failures, delay = 0, self.min_backoff_s
        else:
            b.failures += 1  # the exponent is capped: a member dead for days stays a float
            delay = min(self.max_backoff_s, self.min_backoff_s * 2 ** min(b.failures - 1, 32))
        if refused:
            delay = self.max_backoff_s
        b.next_at = now + delay * self.rng.uniform(0.8, 1.2)
        return b.next_at

    def _quarantine(self, node_id: str, uri: str, now: float) -> None:
        if len(self._quarantined) >= MAX_QUARANTINED:
            del self._quarantined[min(self._quarantined, key=self._quarantined.__getitem__)]
        self._quarantined[(node_id, uri)] = now + self.quarantine_s
