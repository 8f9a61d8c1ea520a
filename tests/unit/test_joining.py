"""Joining with a one-time code (hearthnet/security/joining.py): the code's format, the
invite book's expiry, single use and burning, and the SPAKE2 exchange in process — the
right code pins both keys, a wrong code or a man in the middle without it learns nothing."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from hearthnet.errors import AuthError, BadRequest, PeerDataError
from hearthnet.safe_msgpack import unpackb
from hearthnet.security.joining import (
    ALPHABET,
    CODE_CHARS,
    MAX_TRIES,
    Card,
    InviteBook,
    InviterExchange,
    JoinCode,
    JoinerExchange,
    WrongCode,
    dial_join,
    parse_code,
    parse_welcome,
    serve_join,
    welcome_map,
)
from hearthnet.security.keys import NodeKey, encode_public_key
from hearthnet.security.members import Trust


class Pipe:
    """One end of an in-memory message pipe (what a WebSocket gives the exchange)."""

    def __init__(self, inbox: asyncio.Queue[bytes], outbox: asyncio.Queue[bytes]) -> None:
        self.inbox, self.outbox = inbox, outbox
        self.sent: list[bytes] = []

    async def send(self, message: bytes) -> None:
        self.sent.append(message)
        await self.outbox.put(message)

    async def recv(self) -> bytes:
        return await self.inbox.get()


def pipes() -> tuple[Pipe, Pipe]:
    a: asyncio.Queue[bytes] = asyncio.Queue()
    b: asyncio.Queue[bytes] = asyncio.Queue()
    return Pipe(a, b), Pipe(b, a)


def card() -> Card:
    return Card("node-new", NodeKey.generate().public_key_raw)


INVITER = NodeKey.generate()


class Community:
    """The inviter's side effect: the member list it would extend."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = [{"node_id": "node-a",
                                            "public_key": INVITER.public_key_b64,
                                            "trust": "steward"}]

    async def admit(self, c: Card) -> dict[str, Any]:
        if any(r["node_id"] == c.node_id for r in self.rows):
            raise AuthError(f"{c.node_id} is a member already", reason="node_id_taken")
        self.rows.append({"node_id": c.node_id, "public_key": encode_public_key(c.public_key),
                          "trust": Trust.TRUSTED.label})
        return welcome_map("node-a", self.rows, 7700, True)


# ---- the code ----

def test_code_is_short_base32_with_where_to_reach_the_inviter() -> None:
    book = InviteBook()
    secret = book.issue(600, now=0.0)
    assert len(secret) == CODE_CHARS and set(secret) <= set(ALPHABET)
    text = JoinCode(secret, "192.168.1.20", 41234).text()
    assert re.fullmatch(r"[0-9A-Z]{5}-[0-9A-Z]{5}@192\.168\.1\.20:41234", text)
    assert parse_code(text) == JoinCode(secret, "192.168.1.20", 41234)


def test_typed_codes_are_forgiving_about_case_dashes_and_lookalikes() -> None:
    assert parse_code(" 7kq2m-xd4ra@host:1 ").secret == "7KQ2MXD4RA"
    assert parse_code("1KQ2M XD0RA@host:1").secret == parse_code("lkq2m-xdora@host:1").secret
    assert parse_code("7KQ2MXD4RA@[fe80::1]:9").host == "fe80::1"
    short = parse_code(" 7kq2m-xd4ra ")  # no address: the joiner looks for it by mDNS
    assert (short.secret, short.located, short.text()) == ("7KQ2MXD4RA", False, "7KQ2M-XD4RA")


@pytest.mark.parametrize("bad", ["7KQ2M-XD4R", "7KQ2M@host:1", "7KQ2M-XD4RA@host",
                                 "7KQ2M-XD4RA@host:0", "7KQ2M-XD4R!@host:1", "@host:1"])
def test_malformed_codes_are_refused_saying_what_a_code_looks_like(bad: str) -> None:
    with pytest.raises(BadRequest, match="invite code"):
        parse_code(bad)


def test_codes_are_random() -> None:
    book = InviteBook()
    assert len({book.issue(60, 0.0) for _ in range(16)}) == 16


# ---- the invite book ----

def test_invite_expires() -> None:
    book = InviteBook()
    secret = book.issue(60, now=100.0)
    with pytest.raises(AuthError, match="not valid") as e:
        book.take(secret[:2], now=160.0)
    assert e.value.details["reason"] == "unknown_invite"
    assert len(book) == 0


def test_invite_is_single_use() -> None:
    book = InviteBook()
    secret = book.issue(60, now=0.0)
    inv = book.take(secret[:2], now=1.0)
    book.used(inv)
    with pytest.raises(AuthError, match="used already"):
        book.take(secret[:2], now=2.0)


def test_invite_is_burnt_after_max_tries_and_busy_while_in_use() -> None:
    book = InviteBook()
    secret = book.issue(60, now=0.0)
    for i in range(MAX_TRIES):
        inv = book.take(secret[:2], now=1.0)
        with pytest.raises(AuthError, match="right now"):
            book.take(secret[:2], now=1.0)  # one exchange at a time
        assert book.failed(inv) == (i == MAX_TRIES - 1)
    with pytest.raises(AuthError, match="not valid"):
        book.take(secret[:2], now=1.0)


def test_bad_ttl_and_too_many_pending_are_refused() -> None:
    book = InviteBook()
    with pytest.raises(BadRequest):
        book.issue(0, now=0.0)
    for _ in range(16):
        book.issue(60, now=0.0)
    with pytest.raises(BadRequest, match="pending"):
        book.issue(60, now=0.0)


# ---- the exchange, message by message ----

def test_right_code_pins_both_keys() -> None:
    secret = InviteBook().issue(60, 0.0)
    me = card()
    joiner = JoinerExchange(JoinCode(secret, "h", 1))
    inviter = InviterExchange(secret)
    msg2 = inviter.respond(unpackb(joiner.hello()))
    got = inviter.admit(joiner.answer(msg2, me))
    assert got == me  # the inviter pins the joiner's key
    rows = [{"node_id": "node-a", "public_key": INVITER.public_key_b64, "trust": "steward"},
            {"node_id": me.node_id, "public_key": encode_public_key(me.public_key),
             "trust": "trusted"}]
    w = parse_welcome(joiner.open_welcome(inviter.welcome(welcome_map("node-a", rows,
                                                                      7700, True))), me)
    assert w.inviter == "node-a" and w.port == 7700 and w.tls
    assert {r["node_id"]: r["public_key"] for r in w.members}["node-a"] == \
        INVITER.public_key_b64  # the joiner pins the inviter's key


def test_wrong_code_fails_on_both_sides_without_revealing_the_card() -> None:
    secret = InviteBook().issue(60, 0.0)
    other = InviteBook().issue(60, 0.0)
    joiner = JoinerExchange(JoinCode(other, "h", 1))
    inviter = InviterExchange(secret)
    msg2 = inviter.respond(unpackb(joiner.hello()))
    with pytest.raises(WrongCode, match="wrong invite code"):
        joiner.answer(msg2, card())  # the joiner sends nothing sealed


def test_inviter_refuses_a_joiner_whose_proof_is_for_another_key() -> None:
    """A joiner that skips its own check and sends a card anyway (or an attacker who
    guessed): the proof does not verify, and the card is never opened."""
    secret = InviteBook().issue(60, 0.0)
    guess = JoinCode(InviteBook().issue(60, 0.0), "h", 1)
    joiner = JoinerExchange(guess)
    inviter = InviterExchange(secret)
    inviter_msg2 = inviter.respond(unpackb(joiner.hello()))
    # a second inviter with the guessed code answers the joiner, so it confirms a key
    # that is not the real inviter's
    fake = InviterExchange(guess.secret)
    joiner2 = JoinerExchange(guess)
    msg3 = joiner2.answer(fake.respond(unpackb(joiner2.hello())), card())
    with pytest.raises(WrongCode):
        inviter.admit(msg3)
    assert inviter_msg2  # (the real inviter answered; its key stays unconfirmed)


def test_man_in_the_middle_without_the_code_gets_neither_key() -> None:
    """Mallory relays between the joiner and the inviter with her own SPAKE2 runs (she
    does not know the code): both ends refuse, nobody's card or welcome is opened."""
    secret = InviteBook().issue(60, 0.0)
    joiner = JoinerExchange(JoinCode(secret, "h", 1))
    inviter = InviterExchange(secret)
    mallory_guess = JoinCode(InviteBook().issue(60, 0.0), "h", 1)
    m_as_inviter = InviterExchange(mallory_guess.secret)
    m_as_joiner = JoinerExchange(mallory_guess)
    # joiner -> mallory (as inviter); mallory (as joiner) -> inviter
    to_joiner = m_as_inviter.respond(unpackb(joiner.hello()))
    to_mallory = inviter.respond(unpackb(m_as_joiner.hello()))
    with pytest.raises(WrongCode):
        joiner.answer(to_joiner, card())
    with pytest.raises(WrongCode):
        m_as_joiner.answer(to_mallory, card())
    # and relaying the messages unchanged just gives an honest run: keys she cannot read
    relay_j = JoinerExchange(JoinCode(secret, "h", 1))
    relay_i = InviterExchange(secret)
    msg3 = relay_j.answer(relay_i.respond(unpackb(relay_j.hello())), card())
    tampered = bytearray(msg3)
    tampered[-1] ^= 1
    with pytest.raises(WrongCode):
        relay_i.admit(bytes(tampered))  # the seal's tag no longer verifies


def test_garbage_is_a_peer_error_not_a_crash() -> None:
    inviter = InviterExchange(InviteBook().issue(60, 0.0))
    with pytest.raises(PeerDataError):
        inviter.respond({"pake": b"\x00" * 5})
    with pytest.raises(PeerDataError):
        JoinerExchange(JoinCode("0" * 10, "h", 1)).answer(b"\xc1", card())


# ---- the exchange driven over a connection, with the invite book ----

async def _run(book: InviteBook, code: JoinCode, community: Community,
               me: Card) -> tuple[Any, Any]:
    a, b = pipes()
    served = asyncio.ensure_future(serve_join(a, book, community.admit, lambda: 1.0))
    try:
        welcome: Any = await dial_join(b, code, me)
    except AuthError as e:
        welcome = e
    return welcome, await served


async def test_join_over_a_connection_admits_once_then_refuses_the_reused_code() -> None:
    book, community = InviteBook(), Community()
    code = JoinCode(book.issue(60, 0.0), "h", 1)
    me = card()
    welcome, outcome = await _run(book, code, community, me)
    assert outcome.result == "joined" and outcome.node_id == "node-new"
    assert parse_welcome(welcome, me).inviter == "node-a"
    assert [r["node_id"] for r in community.rows] == ["node-a", "node-new"]
    again, outcome2 = await _run(book, code, community, card())
    assert isinstance(again, AuthError) and "used already" in again.message
    assert outcome2.result == "refused"


async def test_wrong_codes_are_refused_on_both_sides_and_burn_the_invite() -> None:
    book, community = InviteBook(), Community()
    secret = book.issue(60, 0.0)
    wrong = JoinCode(secret[:2] + ("0" if secret[2] != "0" else "1") + secret[3:], "h", 1)
    results = []
    for _ in range(MAX_TRIES):
        err, outcome = await _run(book, wrong, community, card())
        assert isinstance(err, WrongCode) and "wrong invite code" in err.message
        results.append(outcome.result)
    assert results == ["wrong_code"] * (MAX_TRIES - 1) + ["burnt"]
    err, outcome = await _run(book, JoinCode(secret, "h", 1), community, card())
    assert isinstance(err, AuthError) and outcome.result == "refused"  # burnt: right code too
    assert len(community.rows) == 1  # nobody was admitted


async def test_a_taken_node_id_is_refused_and_keeps_the_invite() -> None:
    book, community = InviteBook(), Community()
    code = JoinCode(book.issue(60, 0.0), "h", 1)
    err, outcome = await _run(book, code, community, Card("node-a", card().public_key))
    assert isinstance(err, AuthError) and "member already" in err.message
    assert outcome.result == "refused" and len(book) == 1


async def test_an_admit_failure_of_our_own_leaves_the_invite_usable() -> None:
    book = InviteBook()
    code = JoinCode(book.issue(60, 0.0), "h", 1)

    async def broken(c: Card) -> dict[str, Any]:
        raise OSError("disk full")

    a, b = pipes()
    served = asyncio.ensure_future(serve_join(a, book, broken, lambda: 1.0))
    joined = asyncio.ensure_future(dial_join(b, code, card()))
    with pytest.raises(OSError):
        await served
    joined.cancel()
    assert book.take(code.invite_id, 2.0).tries == 0  # released, not spent


# ---- the files the commands write (hearthnet/commands/init.py, join.py) ----

@pytest.mark.parametrize(("hostname", "node_id"), [
    ("Kitchen-PC.fritz.box", "kitchen-pc"), ("Anna's MacBook Pro", "anna-s-macbook-pro"),
    ("--x__y--", "x-y"), ("ÜÖ", "node"), ("a" * 80, "a" * 63), ("", "node")])
def test_node_id_from_hostname_is_always_legal(hostname: str, node_id: str) -> None:
    from hearthnet.commands.init import node_id_from_hostname
    from hearthnet.ids import valid_node_id

    assert node_id_from_hostname(hostname) == node_id and valid_node_id(node_id)


def test_init_writes_a_valid_config_and_key_and_never_overwrites(tmp_path, capsys) -> None:
    from hearthnet.cli import main
    from hearthnet.config import load_config

    argv = ["init", "--dir", str(tmp_path / "c"), "--name", "kitchen",
            "--data-dir", str(tmp_path / "d")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hearthnet join CODE --config" in out and "next steps" in out
    cfg = load_config(tmp_path / "c" / "node.toml")
    assert cfg.node.id == "kitchen" and cfg.shards == "auto" and cfg.auto_hosting
    assert cfg.api.listen_port == 11435 and cfg.api.loopback
    assert cfg.di.auto.memory_mb >= 256 and cfg.node.peers == []
    # the machine's cores compute (the config's own default, one thread, is for several
    # nodes sharing a machine)
    from hearthnet.commands.init import compute_threads

    assert cfg.node.torch_threads == compute_threads()
    assert f"{compute_threads()} compute threads" in out
    assert (tmp_path / "d" / "node.key").stat().st_mode & 0o077 == 0
    before = (tmp_path / "c" / "node.toml").read_text()
    assert main(argv) == 2  # a config error: exit 2, file untouched
    assert "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "c" / "node.toml").read_text() == before


def test_init_into_a_folder_it_cannot_make_is_one_line(tmp_path, capsys) -> None:
    from hearthnet.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["init", "--dir", str(blocker / "c"), "--name", "kitchen"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hearthnet: config error: cannot write ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_compute_threads_are_the_physical_cores_this_process_may_use(monkeypatch) -> None:
    import os

    import psutil

    from hearthnet.commands import init

    usable = len(os.sched_getaffinity(0))
    assert 1 <= init.compute_threads() <= usable
    # a machine of 8 cores with two hardware threads each, this process allowed all 16
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 16 if logical else 8)
    assert init.compute_threads() == 8
    # a container given 3 of them
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert init.compute_threads() == 3
    # where psutil cannot tell the physical cores: every usable one
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)
    assert init.compute_threads() == 3


def test_free_memory_is_read() -> None:
    from hearthnet.commands.init import budget_mb, free_memory_mb

    free = free_memory_mb()
    assert free is None or free > 0
    assert budget_mb() >= 256


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("30s", 30), ("10m", 600),
                                               ("1.5h", 5400)])
def test_ttl_durations(text: str, seconds: float) -> None:
    from hearthnet.commands.join import duration

    assert duration(text) == seconds


@pytest.mark.parametrize("bad", ["0", "-5m", "ten", "5d"])
def test_bad_ttls_are_usage_errors(bad: str) -> None:
    import argparse

    from hearthnet.commands.join import duration

    with pytest.raises(argparse.ArgumentTypeError):
        duration(bad)


def test_add_peer_edits_only_the_peers(tmp_path) -> None:
    import tomllib

    from hearthnet.commands.init import render_config
    from hearthnet.commands.join import add_peer

    path = tmp_path / "node.toml"
    path.write_text(render_config("n", listen_host="127.0.0.1", port=0, api_port=0,
                                  data_dir="", memory_mb=300, threads=2))
    before = tomllib.loads(path.read_text())
    assert add_peer(path, "wss://10.0.0.2:7700")
    assert not add_peer(path, "wss://10.0.0.2:7700")  # already there
    after = tomllib.loads(path.read_text())
    assert after["node"].pop("peers") == ["wss://10.0.0.2:7700"]
    before["node"].pop("peers")
    assert after == before


def test_add_peer_refuses_a_file_it_cannot_edit_safely(tmp_path) -> None:
    from hearthnet.commands.join import add_peer
    from hearthnet.errors import ConfigError

    path = tmp_path / "node.toml"
    path.write_text('node = { id = "n" }\n')
    with pytest.raises(ConfigError, match="by hand"):
        add_peer(path, "wss://10.0.0.2:7700")
    assert path.read_text() == 'node = { id = "n" }\n'


def test_member_file_merges_and_is_read_by_load_config(tmp_path) -> None:
    from hearthnet.config import load_config
    from hearthnet.security.joining import merge_member_file

    cfg_path = tmp_path / "node.toml"
    cfg_path.write_text(f'[node]\nid = "node-b"\ndata_dir = "{tmp_path / "d"}"\n')
    a, c = NodeKey.generate(), NodeKey.generate()
    merge_member_file(tmp_path / "d", [{"node_id": "node-a", "public_key": a.public_key_b64,
                                        "trust": "steward"}], "test")
    merge_member_file(tmp_path / "d", [{"node_id": "node-c", "public_key": c.public_key_b64,
                                        "trust": "trusted"}], "test")
    members = {m.node_id: m for m in load_config(cfg_path).community.members}
    assert members["node-a"].public_key == a.public_key_b64
    assert members["node-c"].trust == "trusted"


# ---- the steward's member event, folded by the other members (node/daemon.py) ----

def _fold(payload: dict[str, Any], origin: str = "node-a") -> list[dict[str, str]]:
    """What `Node._fold_member_event` adds on node-c, whose list has node-a as steward,
    node-x as trusted and itself."""
    from types import SimpleNamespace

    from hearthnet.mesh.eventlog import Event
    from hearthnet.node.daemon import MEMBER_ADDED, Node
    from hearthnet.security.members import MemberDirectory

    directory = MemberDirectory.from_dicts([
        {"node_id": "node-a", "public_key": INVITER.public_key_b64, "trust": "steward"},
        {"node_id": "node-x", "public_key": X.public_key_b64, "trust": "trusted"},
        {"node_id": "node-c", "public_key": NodeKey.generate().public_key_b64,
         "trust": "trusted"}])
    added: list[dict[str, str]] = []
    fake = SimpleNamespace(
        node_id="node-c", _add_member=added.append,
        guard=SimpleNamespace(directory=directory,
                              is_steward=lambda n: directory.trust_of(n) == Trust.STEWARD))
    Node._fold_member_event(fake, Event("id", origin, 1, MEMBER_ADDED, payload, 0.0))
    return added


X = NodeKey.generate()


def test_a_stewards_member_event_adds_a_new_member() -> None:
    new = NodeKey.generate().public_key_b64
    row = {"node_id": "node-b", "public_key": new, "trust": "trusted"}
    assert _fold(row) == [row]


@pytest.mark.parametrize("why", ["not_steward", "steward_trust", "key_swap", "key_reuse",
                                 "malformed"])
def test_member_events_never_change_the_list_otherwise(why: str) -> None:
    new = NodeKey.generate().public_key_b64
    row = {"node_id": "node-b", "public_key": new, "trust": "trusted"}
    origin = "node-a"
    if why == "not_steward":
        origin = "node-x"
    elif why == "steward_trust":
        row["trust"] = "steward"
    elif why == "key_swap":  # a listed member's key is never replaced through the log
        row["node_id"] = "node-x"
    elif why == "key_reuse":
        row["public_key"] = X.public_key_b64
    else:
        row["public_key"] = "not base64"
    assert _fold(row, origin) == []
