"""mDNS discovery's address book: bounded, expiring, following removals (no network).

`LanDiscovery` is built but never started: the tests feed it resolved announcements and
zeroconf's state changes directly, with an injected clock.
"""

from __future__ import annotations

import asyncio

import pytest
from zeroconf import ServiceStateChange

from hearthnet.mesh import discovery
from hearthnet.mesh.discovery import (
    DISCOVERY_TTL_S,
    SERVICE_TYPE,
    DiscoveredPeers,
    LanDiscovery,
    peer_from_service,
)
from tests.helpers.waiting import wait_until

MEMBERS = {"node-a", "node-b", "node-c"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lan(clock: Clock, **kw: object) -> tuple[LanDiscovery, list[tuple[str, str, str]]]:
    """node-a's discovery (not started) and the found/lost calls it makes."""
    calls: list[tuple[str, str, str]] = []
    disc = LanDiscovery("node-a", "127.0.0.1", 7701, "wss", allowed=MEMBERS.__contains__,
                        on_found=lambda n, u: calls.append(("found", n, u)),
                        on_lost=lambda n, u: calls.append(("lost", n, u)),
                        peers=DiscoveredPeers(clock=clock, **kw))  # type: ignore[arg-type]
    return disc, calls


def name(i: int | str) -> str:
    return f"spoof-{i}.{SERVICE_TYPE}"


def test_a_service_resolves_to_a_node_s_base_uri() -> None:
    assert peer_from_service({b"id": b"node-b", b"scheme": b"wss"}, ["10.0.0.2"], 7702) == \
        ("node-b", "wss://10.0.0.2:7702")
    assert peer_from_service({b"id": b"node-b"}, ["fe80::1"], 7702) == \
        ("node-b", "wss://[fe80::1]:7702")
    assert peer_from_service({b"id": b"Node B!"}, ["10.0.0.2"], 7702) is None
    assert peer_from_service({b"id": b"node-b", b"scheme": b"http"}, ["10.0.0.2"], 7702) is None


def test_100_spoofed_announcements_of_one_member_leave_one_address() -> None:
    clock = Clock()
    disc, calls = lan(clock)
    for port in range(6000, 6100):
        disc.announced(name(port), ("node-b", f"wss://10.0.0.66:{port}"))
        clock.now += 0.01
    assert disc.current() == {"node-b": "wss://10.0.0.66:6099"}  # the latest only
    assert len(disc.peers) == 1
    assert len([c for c in calls if c[0] == "found"]) == 100  # each one news, none kept


def test_the_same_announcement_again_is_no_news() -> None:
    disc, calls = lan(Clock())
    for _ in range(3):
        disc.announced(name("b"), ("node-b", "wss://10.0.0.2:7702"))
    assert calls == [("found", "node-b", "wss://10.0.0.2:7702")]


def test_non_members_and_this_node_are_not_held() -> None:
    disc, calls = lan(Clock())
    disc.announced(name("x"), ("node-x", "wss://10.0.0.9:7709"))
    disc.announced(name("a"), ("node-a", "wss://10.0.0.66:7701"))
    disc.announced(name("n"), None)  # not a hearthnet node's service
    assert disc.current() == {} and calls == []


def test_removed_service_drops_its_address_and_an_older_one_s_removal_does_not() -> None:
    disc, calls = lan(Clock())
    disc.announced(name(1), ("node-b", "wss://10.0.0.66:1"))
    disc.announced(name(2), ("node-b", "wss://10.0.0.66:2"))
    disc._on_change(None, SERVICE_TYPE, name(1), ServiceStateChange.Removed)  # type: ignore[arg-type]
    assert disc.current() == {"node-b": "wss://10.0.0.66:2"}  # replaced already
    disc._on_change(None, SERVICE_TYPE, name(2), ServiceStateChange.Removed)  # type: ignore[arg-type]
    assert disc.current() == {}
    assert calls[-1] == ("lost", "node-b", "wss://10.0.0.66:2")


def test_an_address_not_seen_for_the_ttl_expires() -> None:
    clock = Clock()
    disc, _ = lan(clock)
    disc.announced(name("b"), ("node-b", "wss://10.0.0.2:7702"))
    disc.announced(name("c"), ("node-c", "wss://10.0.0.3:7703"))
    clock.now += DISCOVERY_TTL_S / 2
    disc.announced(name("c"), ("node-c", "wss://10.0.0.3:7703"))  # announced again: seen
    clock.now += DISCOVERY_TTL_S / 2
    assert disc.current() == {"node-c": "wss://10.0.0.3:7703"}
    clock.now += DISCOVERY_TTL_S
    assert disc.current() == {}


def test_an_address_linked_now_does_not_expire() -> None:
    """zeroconf reports no refresh of an unchanged service: a member linked at its
    discovered address keeps it however long the link holds."""
    clock = Clock()
    up = {("node-b", "wss://10.0.0.2:7702")}
    disc, _ = lan(clock, linked=lambda n, u: (n, u) in up)
    disc.announced(name("b"), ("node-b", "wss://10.0.0.2:7702"))
    clock.now += 10 * DISCOVERY_TTL_S
    assert disc.current() == {"node-b": "wss://10.0.0.2:7702"}
    up.clear()  # the link went down: the TTL runs from its last sighting
    clock.now += DISCOVERY_TTL_S
    assert disc.current() == {}


def test_a_refused_address_is_forgotten() -> None:
    disc, _ = lan(Clock())
    disc.announced(name("b"), ("node-b", "wss://10.0.0.66:1"))
    disc.forget("node-b", "wss://10.0.0.2:7702")  # another address: kept
    assert disc.current() == {"node-b": "wss://10.0.0.66:1"}
    disc.forget("node-b", "wss://10.0.0.66:1")
    assert disc.current() == {}


def test_the_book_holds_at_most_cap_addresses() -> None:
    clock = Clock()
    book = DiscoveredPeers(cap=3, clock=clock)
    for i in range(10):
        book.announced(name(i), f"node-{i}", f"wss://10.0.0.{i}:7700")
        clock.now += 1
    assert len(book) == 3
    assert sorted(book.current()) == ["node-7", "node-8", "node-9"]  # the oldest went


async def test_a_flood_of_announcements_is_resolved_a_few_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At most `MAX_RESOLVING` resolutions at once, at most `MAX_WAITING` waiting; the
    member announced amid the flood is still resolved in its turn."""
    disc, calls = lan(Clock())
    release = asyncio.Event()
    resolving = 0
    most = 0

    async def resolve(zeroconf: object, name_: str) -> None:
        nonlocal resolving, most
        resolving += 1
        most = max(most, resolving)
        await release.wait()
        resolving -= 1
        if name_ == name("real"):
            disc.announced(name_, ("node-c", "wss://10.0.0.3:7703"))

    monkeypatch.setattr(disc, "_resolve", resolve)
    flood = [name(i) for i in range(discovery.MAX_RESOLVING + discovery.MAX_WAITING + 50)]
    for n in [*flood[:100], name("real"), *flood[100:], *flood]:  # repeats: no news
        disc._on_change(None, SERVICE_TYPE, n, ServiceStateChange.Added)  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert len(disc._tasks) == discovery.MAX_RESOLVING
    assert len(disc._waiting) == discovery.MAX_WAITING
    release.set()
    await wait_until(lambda: not disc._tasks, "every admitted resolution done")
    assert most == discovery.MAX_RESOLVING
    assert ("found", "node-c", "wss://10.0.0.3:7703") in calls
    await disc.stop()
