"""The open invites on the LAN (hearthnet/mesh/join_announce.py): what an inviter
announces (the invite's public id, never the rest of the code) and withdraws, and which
announcements a joiner takes for its invite. Over real mDNS between two network
namespaces: tests/netns/test_join_netns.py; the joiner's dialling of announcers:
tests/integration/test_join.py."""

from __future__ import annotations

from typing import Any

from hearthnet.mesh.join_announce import (
    JOIN_SERVICE_TYPE,
    Inviter,
    JoinAnnouncer,
    inviter_from_service,
)
from hearthnet.security.joining import ID_CHARS, InviteBook


def test_an_announcement_names_an_inviter_only_for_its_invite_id() -> None:
    txt = {b"id": b"7K", b"node": b"node-a", b"v": b"1"}
    assert inviter_from_service(txt, ["fe80::1", "10.0.0.5"], 41234, "7K") == \
        Inviter("node-a", "10.0.0.5", 41234)
    for props, addrs, port, want in [
        (txt, ["10.0.0.5"], 41234, "7Q"),  # another invite
        ({**txt, b"v": b"2"}, ["10.0.0.5"], 41234, "7K"),  # another protocol version
        ({**txt, b"node": b"Bad Name!"}, ["10.0.0.5"], 41234, "7K"),
        ({b"id": b"7K", b"v": b"1"}, ["10.0.0.5"], 41234, "7K"),  # no inviter named
        (txt, [], 41234, "7K"), (txt, ["10.0.0.5"], None, "7K"),  # nowhere to dial
    ]:
        assert inviter_from_service(props, addrs, port, want) is None


async def test_the_announcer_keeps_one_announcement_per_pending_invite_with_its_id_only(
        ) -> None:
    """What goes on the LAN: one service per pending invite, TXT naming its public id, the
    node and the version — nothing else of the code — and withdrawn once it is gone."""
    class Responder:  # the node's AsyncZeroconf, as far as the announcer uses it
        def __init__(self) -> None:
            self.live: dict[str, Any] = {}

        async def async_register_service(self, info: Any, **_: Any) -> None:
            self.live[info.name] = info

        async def async_unregister_service(self, info: Any) -> None:
            del self.live[info.name]

    zc = Responder()
    ads = JoinAnnouncer(zc, "node-a", "10.0.0.5")  # type: ignore[arg-type]
    book = InviteBook()
    first, second = book.issue(60, now=0.0), book.issue(30, now=0.0)
    assert await ads.sync(book.pending_ids(), 41234)
    assert ads.announced == {first[:ID_CHARS], second[:ID_CHARS]} and len(zc.live) == 2
    info = next(i for i in zc.live.values() if i.properties[b"id"] == first[:2].encode())
    assert info.type == JOIN_SERVICE_TYPE and info.port == 41234
    assert info.parsed_addresses() == ["10.0.0.5"]
    assert info.properties == {b"id": first[:2].encode(), b"node": b"node-a", b"v": b"1"}
    assert first[2:] not in repr(info.text)  # the secret part is announced nowhere
    book.expire(now=45.0)  # the second invite expired
    assert await ads.sync(book.pending_ids(), 41234)
    assert ads.announced == {first[:ID_CHARS]} and len(zc.live) == 1
    book.used(book.take(first[:ID_CHARS], now=46.0))
    assert await ads.sync(book.pending_ids(), 41234)
    assert ads.announced == set() and zc.live == {}
