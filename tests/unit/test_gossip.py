"""Gossip: the pure message codec, and sessions between in-process logs over 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from hearthnet.constants import CloseCode
from hearthnet.errors import ProtocolError
from hearthnet.mesh import gossip
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.mesh.gossip import (
    Events,
    GossipPeerLink,
    Hello,
    batch_events,
    decode_message,
    encode_events,
    encode_hello,
    handle_gossip_connection,
    run_gossip_session,
)
from hearthnet.observability import Metrics
from tests.helpers.waiting import wait_until

# ---- codec ----


def test_hello_round_trip() -> None:
    assert decode_message(encode_hello("node-a", {"node-b": 3})) == \
        Hello("node-a", {"node-b": 3})


def test_events_round_trip_and_malformed_elements_are_counted(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a")
    evs = [log.append("t", {"i": i}) for i in range(3)]
    assert decode_message(encode_events(evs)) == Events(evs, 0)
    raw = msgpack.packb({"k": "events", "events": [evs[0].to_wire(), {"id": 1}, "x"]})
    assert decode_message(raw) == Events([evs[0]], 2)


@pytest.mark.parametrize("data", [
    "text frame",
    b"\xc1\xc1\xc1",
    msgpack.packb([1, 2]),
    msgpack.packb({"k": "gimme"}),
    msgpack.packb({"k": "hello", "v": 99, "node": "a", "vector": {}}),
    msgpack.packb({"k": "hello", "v": 1, "node": "", "vector": {}}),
    msgpack.packb({"k": "hello", "v": 1, "node": "a", "vector": {"b": -1}}),
    msgpack.packb({"k": "hello", "v": 1, "node": "a", "vector": [1]}),
    msgpack.packb({"k": "events", "events": 5}),
])
def test_malformed_messages_raise_protocol_error(data: bytes | str) -> None:
    with pytest.raises(ProtocolError):
        decode_message(data)


def test_batches_respect_size_and_count(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a")
    evs = [log.append("t", {"blob": b"x" * 1000}) for _ in range(50)]
    batches = list(batch_events(evs, max_bytes=10_000))
    assert all(len(b) <= 10_000 + 100 for b in batches)
    got = [e for b in batches for e in decode_message(b).events]  # type: ignore[union-attr]
    assert got == evs
    assert len(list(batch_events(evs, max_events=7))) == 8
    assert list(batch_events([])) == []


# ---- sessions over real sockets ----


@asynccontextmanager
async def node_server(log: EventLog, port: int = 0) -> AsyncIterator[int]:
    async def handler(ws: ServerConnection) -> None:
        assert ws.request is not None and ws.request.path == "/gossip"
        await handle_gossip_connection(log, ws)

    async with serve(handler, "127.0.0.1", port, max_size=gossip.MAX_MESSAGE_BYTES,
                     compression=None) as server:
        yield next(iter(server.sockets)).getsockname()[1]


def link(log: EventLog, port: int) -> GossipPeerLink:
    lk = GossipPeerLink(log, f"ws://127.0.0.1:{port}", min_backoff=0.02, max_backoff=0.2)
    lk.start()
    return lk


async def test_catch_up_both_ways_then_live(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    old_a = [a.append("t", {"i": i}) for i in range(3)]
    old_b = [b.append("t", {"i": i}) for i in range(2)]
    async with node_server(a) as port:
        lk = link(b, port)
        try:
            assert await lk.wait_connected(10)
            assert lk.peer_id == "node-a"
            await wait_until(lambda: a.vector() == b.vector() == {"node-a": 3, "node-b": 2},
                             "both logs in sync")
            assert b.since({"node-b": 2}) == old_a
            assert a.since({"node-a": 3}) == old_b
            new = a.append("t", {"live": True})
            await wait_until(lambda: b.vector().get("node-a") == 4, "gossip state")
            assert b.all_events()[-1] == new
            mine = b.append("t", {"live": "back"})
            await wait_until(lambda: a.vector().get("node-b") == 3, "gossip state")
            assert a.all_events()[-1] == mine
        finally:
            await lk.stop()


async def test_events_are_relayed_through_an_intermediate_node(tmp_path: Path) -> None:
    a, b, c = (EventLog(tmp_path / f"{n}.db", f"node-{n}") for n in "abc")
    async with node_server(b) as port_b:
        links = [link(a, port_b), link(c, port_b)]
        try:
            ev = a.append("t", {"hello": "c"})
            await wait_until(lambda: c.vector().get("node-a") == 1, "gossip state")
            assert c.all_events() == [ev]
            back = c.append("t", {"hello": "a"})
            await wait_until(lambda: a.vector().get("node-c") == 1, "gossip state")
            assert back in a.all_events()
        finally:
            for lk in links:
                await lk.stop()


async def test_link_reconnects_and_catches_up_after_peer_restart(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    async with node_server(a) as port:
        lk = link(b, port)
        assert await lk.wait_connected(10)
    # server gone: the link keeps retrying; events made meanwhile are caught up later
    await wait_until(lambda: not lk.connected, "gossip state")
    a.append("t", {"while": "down"})
    b.append("t", {"while": "down"})
    await wait_until(lambda: lk.failures >= 1, "a failed dial while the peer is down")
    try:
        async with node_server(a, port):
            await wait_until(lambda: a.vector() == b.vector() == {"node-a": 1, "node-b": 1},
                             "caught up after the restart")
    finally:
        await lk.stop()


async def test_malformed_messages_are_counted_and_do_not_crash(tmp_path: Path) -> None:
    metrics = Metrics()
    a = EventLog(tmp_path / "a.db", "node-a", metrics=metrics)
    other = EventLog(tmp_path / "x.db", "node-x")
    good = other.append("t", {"ok": 1})
    async with node_server(a) as port:
        async with connect(f"ws://127.0.0.1:{port}/gossip") as ws:
            hello = decode_message(await ws.recv())
            assert hello == Hello("node-a", {})
            await ws.send(encode_hello("node-x", {}))
            await ws.send(b"\x00garbage")
            await ws.send("text")
            await ws.send(msgpack.packb({"k": "events", "events": [{"bad": 1}]}))
            await ws.send(encode_events([good]))
            await wait_until(lambda: a.vector() == {"node-x": 1}, "gossip state")
        rejected = metrics.registry.get_sample_value
        assert rejected("hearthnet_events_rejected_total", {"reason": "malformed_message"}) == 2
        assert rejected("hearthnet_events_rejected_total", {"reason": "malformed"}) == 1
        # the server still serves others
        b = EventLog(tmp_path / "b.db", "node-b")
        lk = link(b, port)
        try:
            await wait_until(lambda: b.vector() == {"node-x": 1}, "gossip state")
        finally:
            await lk.stop()


async def test_flood_of_garbage_gets_the_peer_disconnected(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    async with node_server(a) as port, connect(f"ws://127.0.0.1:{port}/gossip") as ws:
        await ws.recv()
        await ws.send(encode_hello("node-x", {}))
        with pytest.raises(ConnectionClosed) as ei:
            for _ in range(gossip.MAX_MALFORMED + 5):
                await ws.send(b"\xc1")
            await ws.recv()
        assert ei.value.rcvd is not None and ei.value.rcvd.code == CloseCode.POLICY_VIOLATION


@pytest.mark.parametrize("first", [
    b"\xc1",
    encode_events([]),
    encode_hello("node-a", {}),  # claims to be the server itself
])
async def test_bad_first_message_closes_the_connection(tmp_path: Path, first: bytes) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    async with node_server(a) as port, connect(f"ws://127.0.0.1:{port}/gossip") as ws:
        await ws.recv()
        await ws.send(first)
        with pytest.raises(ConnectionClosed) as ei:
            await ws.recv()
        assert ei.value.rcvd is not None
        assert ei.value.rcvd.code in (CloseCode.PROTOCOL_ERROR, CloseCode.POLICY_VIOLATION)


async def test_live_queue_overflow_reconnects_and_catches_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gossip, "LIVE_QUEUE_MAX", 3)
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    ups: list[bool] = []
    async with node_server(a) as port:
        lk = GossipPeerLink(b, f"ws://127.0.0.1:{port}", min_backoff=0.02,
                            on_peer=lambda peer, up: ups.append(up))
        lk.start()
        try:
            assert await lk.wait_connected(10)
            # one event through the live feed first: a's side of the session has subscribed
            # (b's hello callback runs before a has read b's hello, and 50 events appended
            # before a subscribes would all arrive by catch-up, with no overflow to test)
            a.append("t", {"i": 0})
            await wait_until(lambda: b.vector().get("node-a") == 1, "the live feed")
            for i in range(1, 51):  # synchronously: far more than the live queue holds
                a.append("t", {"i": i})
            await wait_until(lambda: b.vector().get("node-a") == 51, "gossip state")
            assert [e.payload["i"] for e in b.all_events()] == list(range(51))
            assert ups[:3] == [True, False, True]  # dropped, then caught up on reconnect
        finally:
            await lk.stop()


async def test_rejected_events_are_not_relayed(tmp_path: Path) -> None:
    def verifier(origin: str, data: bytes, sig: bytes) -> bool:
        return sig == b"ok"

    a = EventLog(tmp_path / "a.db", "node-a", signer=lambda d: b"ok")
    mallory = EventLog(tmp_path / "m.db", "node-m", signer=lambda d: b"forged")
    b = EventLog(tmp_path / "b.db", "node-b", verifier=verifier)
    c = EventLog(tmp_path / "c.db", "node-c", verifier=verifier)
    bad = mallory.append("t", {"evil": True})
    good = a.append("t", {"fine": True})
    assert not b.ingest(bad) and b.ingest(good)
    async with node_server(b) as port:
        lk = link(c, port)
        try:
            # c caught up with all b holds; b never took mallory's event, so c cannot have it
            await wait_until(lambda: c.vector() == b.vector() == {"node-a": 1}, "c caught up")
            assert [e.origin for e in c.all_events()] == ["node-a"]
        finally:
            await lk.stop()


def test_event_wire_form_is_what_gossip_sends(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "a.db", "node-a", signer=lambda d: b"sig")
    ev = log.append("t", {"x": [1, 2]})
    back = Event.from_wire(msgpack.unpackb(msgpack.packb(ev.to_wire(), use_bin_type=True),
                                           raw=False))
    assert back == ev


async def test_a_stop_that_meets_the_peers_hello_still_stops_the_session(tmp_path: Path) -> None:
    """A link told to stop just as the peer's hello arrives must stop: Python 3.11's
    `asyncio.wait_for` returned the hello and dropped the cancellation, so the link dialled
    on forever and a node's shutdown hung (seen under load in the backoff test)."""
    import asyncio

    hello = asyncio.get_running_loop().create_future()

    class Peer:
        async def send(self, data: bytes) -> None:
            pass

        async def recv(self) -> bytes:
            return await hello

    log = EventLog(tmp_path / "a.sqlite3", "node-y")
    session = asyncio.create_task(run_gossip_session(log, Peer()))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # the session now waits for the peer's hello
    await asyncio.sleep(0)
    hello.set_result(encode_hello("node-z", {}))
    session.cancel()  # in the same step as the hello's arrival
    with pytest.raises(asyncio.CancelledError):
        await session
    log.close()


# ---- links a keeper manages: one connection, then report how it ended ----


async def _ended(lk: GossipPeerLink, ends: list[tuple[str, bool]]) -> tuple[str, bool]:
    lk.start()
    await wait_until(lambda: ends, "the link ended")
    await lk.stop()
    assert len(ends) == 1
    return ends[0]


async def test_a_link_answered_by_another_node_ends_refused(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    ends: list[tuple[str, bool]] = []
    async with node_server(a) as port:  # node-a answers where node-c was expected
        lk = GossipPeerLink(b, f"ws://127.0.0.1:{port}", expect_peer="node-c", redial=False,
                            on_end=lambda how, held: ends.append((how, held)))
        assert await _ended(lk, ends) == ("refused", False)
        assert lk.peer_id is None and not lk.connected


async def test_a_link_to_a_closed_port_ends_unreachable(tmp_path: Path) -> None:
    b = EventLog(tmp_path / "b.db", "node-b")
    async with node_server(EventLog(tmp_path / "a.db", "node-a")) as port:
        pass  # closed again: nothing listens there now
    ends: list[tuple[str, bool]] = []
    lk = GossipPeerLink(b, f"ws://127.0.0.1:{port}", redial=False, open_timeout=2,
                        on_end=lambda how, held: ends.append((how, held)))
    assert await _ended(lk, ends) == ("unreachable", False)


async def test_a_link_that_connected_ends_closed_and_never_redials(tmp_path: Path) -> None:
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")
    ends: list[tuple[str, bool]] = []
    ups: list[bool] = []
    async with node_server(a) as port:
        lk = GossipPeerLink(b, f"ws://127.0.0.1:{port}", expect_peer="node-a", redial=False,
                            on_peer=lambda peer, up: ups.append(up),
                            on_end=lambda how, held: ends.append((how, held)))
        lk.start()
        assert await lk.wait_connected(10)
    # the server closed its connections on leaving
    await wait_until(lambda: ends, "the link ended")
    assert ends == [("closed", False)] and ups == [True, False]
    await lk.stop()


async def test_a_tls_link_pinned_to_one_member_refuses_another(tmp_path: Path) -> None:
    """The keeper's links pin the one member they mean to reach: node-b dialling node-c at
    an address where node-a (also a member) answers ends refused, as a stranger would."""
    from hearthnet.security.keys import NodeKey
    from hearthnet.security.members import MemberDirectory
    from hearthnet.security.tls import client_context, server_context

    keys = {n: NodeKey.generate() for n in ("node-a", "node-b", "node-c")}
    members = MemberDirectory.from_dicts([
        {"node_id": n, "public_key": k.public_key_b64, "trust": "trusted"}
        for n, k in keys.items()])
    a = EventLog(tmp_path / "a.db", "node-a")
    b = EventLog(tmp_path / "b.db", "node-b")

    async def handler(ws: ServerConnection) -> None:
        await handle_gossip_connection(a, ws)

    ends: list[tuple[str, bool]] = []
    async with serve(handler, "127.0.0.1", 0, compression=None,
                     ssl=server_context(keys["node-a"], "node-a", members)) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        for expect, want in (("node-c", ("refused", False)), ("node-a", ("closed", False))):
            ends.clear()
            lk = GossipPeerLink(
                b, f"wss://127.0.0.1:{port}", expect_peer=expect, redial=False,
                on_end=lambda how, held: ends.append((how, held)),
                ssl_factory=lambda e=expect: client_context(  # type: ignore[misc]
                    keys["node-b"], "node-b", members, expect=e))
            lk.start()
            if expect == "node-a":  # the right member: linked, until we close it
                assert await lk.wait_connected(10) and lk.peer_id == "node-a"
                lk.drop_connection()
            await wait_until(lambda: ends, "the link ended")
            assert ends == [want]
            await lk.stop()
