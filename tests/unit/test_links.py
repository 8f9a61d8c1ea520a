"""`LinkKeeper`: which gossip links a node keeps beyond its configured peers.

Fake links and an injected clock decide the cases (no sleeps); one test runs real gossip
links over 127.0.0.1 to show that a node whose only link drops dials another member it
knows and its events (heartbeats) get through again.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from websockets.asyncio.server import Server, ServerConnection, serve

from hearthnet.mesh import gossip
from hearthnet.mesh.discovery import DiscoveredPeers, LanDiscovery
from hearthnet.mesh.eventlog import EventLog
from hearthnet.mesh.gossip import GossipPeerLink, handle_gossip_connection
from hearthnet.mesh.links import (
    MAX_BACKOFF_S,
    QUARANTINE_S,
    VIA_AD,
    VIA_MDNS,
    Known,
    LinkKeeper,
    OnEnd,
)
from tests.helpers.waiting import wait_until

ME = "node-d"


class FakeLink:
    """A gossip link the test drives: `up()`, `end(how)`."""

    def __init__(self, world: World, node_id: str, uri: str, on_end: OnEnd | None) -> None:
        self.world, self.node_id, self.uri, self.on_end = world, node_id, uri, on_end
        self.peer_id: str | None = None
        self.connected = self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        self.down()

    def up(self) -> None:
        self.connected, self.peer_id = True, self.node_id
        self.world.live.add(self.node_id)

    def down(self) -> None:
        if self.connected:
            self.connected = False
            self.world.live.discard(self.node_id)

    def end(self, how: str, held: bool = False) -> None:
        self.down()
        assert self.on_end is not None
        self.on_end(how, held)


class World:
    """What the keeper of node-d sees: members, known addresses, live peers, a clock."""

    def __init__(self, *, target: int = 2,
                 members: tuple[str, ...] = ("node-a", "node-b", "node-c", ME)) -> None:
        self.now = 1000.0
        self.members = set(members)
        self.known: list[Known] = []
        self.live: set[str] = set()
        self.links: list[FakeLink] = []
        self.dialled: list[FakeLink] = []
        self.refused: list[tuple[str, str]] = []
        self.keeper = LinkKeeper(
            ME, self.links, make_link=self.make, known=lambda: list(self.known),
            live=lambda: set(self.live), is_member=self.members.__contains__,
            on_refused=lambda n, u: self.refused.append((n, u)), target=target,
            clock=lambda: self.now, rng=random.Random(7))

    def make(self, node_id: str, uri: str, on_end: OnEnd) -> FakeLink:
        link = FakeLink(self, node_id, uri, on_end)
        self.dialled.append(link)
        return link

    def configured(self, node_id: str, uri: str, *, up: bool = True) -> FakeLink:
        """A configured peer's link (the keeper reads it, never manages it)."""
        link = FakeLink(self, node_id, uri, None)
        self.links.append(link)
        if up:
            link.up()
        return link

    def ad(self, node_id: str, port: int, *, stale: bool = False) -> None:
        self.known.append(Known(node_id, f"wss://127.0.0.1:{port}", VIA_AD, stale))

    def tick(self) -> list[tuple[str, str]]:
        """Tick; the (member, uri) dialled by this tick."""
        before = len(self.dialled)
        self.keeper.tick()
        return [(lk.node_id, lk.uri) for lk in self.dialled[before:]]


# ---- filling up to the target ----


async def test_one_live_link_gets_a_spare_before_anything_fails() -> None:
    """mesh4's node-d: configured to node-c only. With a target of 2 it also links to
    another member it knows (node-b's advertised endpoint) while node-c is still up."""
    w = World()
    w.configured("node-c", "wss://127.0.0.1:7703")
    w.ad("node-b", 7702)
    w.ad("node-c", 7703)
    assert w.tick() == [("node-b", "wss://127.0.0.1:7702")]
    w.dialled[-1].up()
    assert w.tick() == []  # two members linked: nothing more


async def test_a_node_whose_only_link_drops_dials_another_known_member() -> None:
    w = World(target=1)
    c = w.configured("node-c", "wss://127.0.0.1:7703")
    w.ad("node-b", 7702)
    w.ad("node-c", 7703)
    assert w.tick() == []  # one link is the target here
    c.down()  # node-c died: the configured link redials node-c by itself
    assert w.tick() == [("node-b", "wss://127.0.0.1:7702")]  # not node-c again
    assert w.keeper.managed["node-b"].started


async def test_incoming_links_count_and_a_linked_member_is_not_dialled() -> None:
    w = World()
    w.live |= {"node-a", "node-b"}  # they dialled us
    w.ad("node-b", 7702)
    w.ad("node-c", 7703)
    assert w.tick() == []
    w.live.discard("node-a")
    assert w.tick() == [("node-c", "wss://127.0.0.1:7703")]  # node-b is linked already


async def test_a_configured_address_is_not_dialled_twice() -> None:
    w = World()
    w.configured("node-c", "wss://127.0.0.1:7703", up=False)  # never connected yet
    w.configured("node-x", "wss://127.0.0.1:7704", up=False)
    w.links[-1].peer_id = None
    w.ad("node-b", 7704)  # the configured, not yet connected address
    w.ad("node-c", 7703)
    assert w.tick() == []


async def test_never_dials_a_non_member_or_itself() -> None:
    w = World()
    w.ad("node-z", 7709)  # not in the member list
    w.ad(ME, 7704)
    assert w.tick() == []
    w.members.add("node-z")
    assert w.tick() == [("node-z", "wss://127.0.0.1:7709")]


async def test_a_member_removed_from_the_list_loses_its_link() -> None:
    w = World()
    w.ad("node-b", 7702)
    w.tick()
    link = w.keeper.managed["node-b"]
    link.up()
    w.members.discard("node-b")  # a reload removed it
    w.tick()
    await wait_until(lambda: link.stopped, "the link stopped")
    assert "node-b" not in w.keeper.managed and link not in w.links


# ---- backoff ----


async def test_failed_dials_back_off_exponentially_with_jitter() -> None:
    w = World()
    w.ad("node-b", 7702)
    waits = []
    for _ in range(9):
        assert w.tick() == [("node-b", "wss://127.0.0.1:7702")]
        t0 = w.now
        w.dialled[-1].end("unreachable")
        assert "node-b" not in w.keeper.managed and not w.links
        next_at = w.keeper.backoff_of("node-b")[1]
        w.now = next_at - 0.001
        assert w.tick() == []  # not before its time
        w.now = next_at
        waits.append(next_at - t0)
    for n, wait in enumerate(waits):  # 1, 2, 4, ... s, ±20 %, capped
        base = min(MAX_BACKOFF_S, 2.0 ** n)
        assert 0.8 * base <= wait <= 1.2 * base, (n, wait)
    assert len({round(wait / min(MAX_BACKOFF_S, 2.0 ** n), 6)
                for n, wait in enumerate(waits)}) > 1  # jittered
    for _ in range(2000):  # dead for days: still the capped wait
        w.tick()
        w.dialled[-1].end("unreachable")
        w.now = w.keeper.backoff_of("node-b")[1]
    assert w.keeper.backoff_of("node-b")[0] == 2009


async def test_a_link_that_held_is_redialled_soon() -> None:
    w = World()
    w.ad("node-b", 7702)
    for _ in range(4):  # a bad patch: backoff grows
        w.tick()
        w.dialled[-1].end("unreachable")
        w.now = w.keeper.backoff_of("node-b")[1]
    w.tick()
    w.dialled[-1].up()
    w.dialled[-1].end("closed", held=True)  # it held, then the peer restarted
    failures, next_at = w.keeper.backoff_of("node-b")
    assert failures == 0 and next_at - w.now <= 1.2


async def test_a_dead_member_does_not_hold_up_a_live_one() -> None:
    """node-c died (its ads are still held): node-d keeps linking node-b while it backs
    off node-c."""
    w = World()
    w.ad("node-b", 7702)
    w.ad("node-c", 7703)
    assert sorted(w.tick()) == [("node-b", "wss://127.0.0.1:7702"),
                                ("node-c", "wss://127.0.0.1:7703")]
    b, c = sorted(w.dialled[-2:], key=lambda lk: lk.node_id)
    b.up()
    c.end("unreachable")
    assert w.tick() == []  # node-c backs off; node-b is linked
    w.now = w.keeper.backoff_of("node-c")[1]
    assert w.tick() == [("node-c", "wss://127.0.0.1:7703")]


# ---- refusals and addresses that go away ----


async def test_a_refused_address_is_dropped_and_not_redialled() -> None:
    w = World()
    spoofed = Known("node-b", "wss://10.0.0.66:4000", VIA_MDNS)
    w.known.append(spoofed)
    assert w.tick() == [("node-b", spoofed.uri)]
    w.dialled[-1].end("refused")  # TLS: not node-b's key
    assert w.refused == [("node-b", spoofed.uri)]
    assert w.keeper.backoff_of("node-b")[1] - w.now >= 0.8 * MAX_BACKOFF_S
    for _ in range(20):  # still announced: never dialled again while set aside
        w.now += MAX_BACKOFF_S
        if w.now - 1000.0 >= 0.9 * QUARANTINE_S:
            break
        assert w.tick() == []
    w.known.append(Known("node-b", "wss://127.0.0.1:7702", VIA_MDNS))  # its real address
    w.now += MAX_BACKOFF_S
    assert w.tick() == [("node-b", "wss://127.0.0.1:7702")]


async def test_an_address_that_goes_away_stops_its_dialling_not_a_working_link() -> None:
    w = World()
    w.known.append(Known("node-b", "wss://127.0.0.1:7702", VIA_MDNS))
    w.known.append(Known("node-c", "wss://127.0.0.1:7703", VIA_MDNS))
    w.tick()
    b, c = (w.keeper.managed[n] for n in ("node-b", "node-c"))
    b.up()  # linked; node-c's dial is still under way
    w.known.clear()  # both services removed
    w.tick()
    await wait_until(lambda: c.stopped, "node-c's dial stopped")
    assert list(w.keeper.managed) == ["node-b"] and not b.stopped  # authenticated: kept
    b.end("closed", held=True)
    w.now += MAX_BACKOFF_S
    assert w.tick() == []  # gone from discovery: not redialled


async def test_discovered_and_stale_members_are_dialled_whatever_the_count() -> None:
    w = World(target=0)
    w.ad("node-b", 7702)
    w.ad("node-c", 7703, stale=True)  # its heartbeats stopped arriving
    w.known.append(Known("node-a", "wss://127.0.0.1:7701", VIA_MDNS))
    assert sorted(w.tick()) == [("node-a", "wss://127.0.0.1:7701"),
                                ("node-c", "wss://127.0.0.1:7703")]


async def test_a_member_s_addresses_alternate_as_dials_fail() -> None:
    w = World(target=1)
    w.ad("node-b", 7702)
    w.known.append(Known("node-b", "wss://192.168.1.2:7702", VIA_MDNS))
    uris = []
    for _ in range(3):
        uris += [u for _, u in w.tick()]
        w.dialled[-1].end("unreachable")
        w.now = w.keeper.backoff_of("node-b")[1]
    assert uris == ["wss://127.0.0.1:7702", "wss://192.168.1.2:7702", "wss://127.0.0.1:7702"]


async def test_spoofed_announcements_make_one_link_and_none_after_removal() -> None:
    """100 announcements of node-b at new ports: discovery holds one address, the keeper
    one link at a time; once the spoofer's service is removed nothing is redialled."""
    w = World()
    disc = LanDiscovery(ME, "127.0.0.1", 7704, "wss", allowed=w.members.__contains__,
                        on_found=lambda n, u: None,
                        peers=DiscoveredPeers(clock=lambda: w.now))
    w.keeper.known = lambda: [Known(n, u, VIA_MDNS) for n, u in disc.current().items()]
    for port in range(5000, 5100):
        disc.announced(f"spoof-{port}._hearthnet._tcp.local.",
                       ("node-b", f"wss://10.0.0.66:{port}"))
        w.tick()
        assert len(disc.current()) == 1 and len(w.links) <= 1
        w.now += 0.01
    # a dial cut off by the next announcement counts as failed: backoff, not a dial each
    assert len(w.dialled) <= 3
    w.now = w.keeper.backoff_of("node-b")[1]
    w.tick()
    link = w.keeper.managed["node-b"]
    assert link.uri == "wss://10.0.0.66:5099"  # the latest
    disc.removed("spoof-5099._hearthnet._tcp.local.")  # the spoofer left
    w.tick()
    await wait_until(lambda: link.stopped, "its dial stopped")
    assert not w.keeper.managed and not w.links and not disc.current()
    w.now += 3600
    assert w.tick() == []


# ---- the daemon's count of linked members ----


def test_a_member_linked_both_ways_stays_linked_when_one_link_drops() -> None:
    """Two nodes often dial each other: the status and the keeper count the member linked
    while any of its connections is up, and its "since" is when that changed."""
    from types import SimpleNamespace

    from hearthnet.node.daemon import Node

    node = SimpleNamespace(peer_links={}, _peer_conns={}, keeper=None)
    on_peer = Node._on_peer.__get__(node)
    on_peer("node-b", True)  # we dialled it
    since = node.peer_links["node-b"][1]
    on_peer("node-b", True)  # it dialled us
    on_peer("node-b", False)  # ours dropped
    assert node.peer_links["node-b"] == (True, since)
    on_peer("node-b", False)
    assert node.peer_links["node-b"][0] is False and node._peer_conns["node-b"] == 0
    on_peer("node-b", False)  # never below zero
    on_peer("node-b", True)
    assert node.peer_links["node-b"][0] is True


# ---- real links: the only link drops, another member carries the heartbeats ----


async def test_only_link_drops_then_events_reach_another_member(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    c = EventLog(tmp_path / "c.db", "node-c")
    d = EventLog(tmp_path / "d.db", ME)
    conns: dict[str, int] = {}

    def on_peer(peer: str, up: bool) -> None:
        conns[peer] = conns.get(peer, 0) + (1 if up else -1)
        keeper.wake()

    def make(node_id: str, uri: str, on_end: OnEnd) -> GossipPeerLink:
        return GossipPeerLink(d, uri, on_peer=on_peer, expect_peer=node_id, redial=False,
                              on_end=on_end)

    async with _gossip_server(a) as server_a, _gossip_server(c) as server_c:
        configured = GossipPeerLink(d, _uri(server_c), on_peer=on_peer, min_backoff=0.02,
                                    max_backoff=0.2)
        links = [configured]
        keeper = LinkKeeper(ME, links, make_link=make, target=1, tick_s=0.05,
                            known=lambda: [Known("node-a", _uri(server_a), VIA_AD)],
                            live=lambda: {p for p, n in conns.items() if n > 0},
                            is_member=lambda n: True)
        configured.start()
        assert await configured.wait_connected(10)
        task = asyncio.create_task(keeper.run())
        try:
            beat = d.append("t", {"heartbeat": 1})
            await wait_until(lambda: c.vector().get(ME) == beat.seq, "node-c has it")
            assert not keeper.managed  # one link was the target
            server_c.close()  # node-c dies
            await server_c.wait_closed()
            await wait_until(lambda: "node-a" in keeper.managed
                             and keeper.managed["node-a"].connected, "node-d links node-a")
            beat = d.append("t", {"heartbeat": 2})
            await wait_until(lambda: a.vector().get(ME) == beat.seq,
                             "node-d's heartbeat reaches node-a")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.gather(*(link.stop() for link in list(links)))


@asynccontextmanager
async def _gossip_server(log: EventLog) -> AsyncIterator[Server]:
    async def handler(ws: ServerConnection) -> None:
        await handle_gossip_connection(log, ws)

    async with serve(handler, "127.0.0.1", 0, max_size=gossip.MAX_MESSAGE_BYTES,
                     compression=None) as server:
        yield server


def _uri(server: Server) -> str:
    return f"ws://127.0.0.1:{next(iter(server.sockets)).getsockname()[1]}"
