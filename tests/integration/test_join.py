"""Join without pasting keys, with real node processes on 127.0.0.1: node A (the steward)
runs from a config that hosts SmolLM2, node C is a member A knows from its config, node B
is fresh from ``hearthnet init``. ``hearthnet invite`` on A and ``hearthnet join CODE`` on
B make B a member (a wrong code first is refused on both sides, the used code afterwards
is refused); A's live member list shows B at once and C's once A's signed member event
reaches it; then B starts, links to A over mutual TLS pinned to the exchanged keys, and a
chat through B answers from A's shard.

Below it, the short code's search in process (no mDNS: the announcers are given): a
spoofed announcement of the invite costs the joiner one dial and the spoofer one failed
guess, a flood gets three dials, and finding nobody says what was searched. The real mDNS
path, across two network namespaces, is tests/netns/test_join_netns.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hearthnet.errors import AuthError
from hearthnet.security.joining import (
    CODE_CHARS,
    ID_CHARS,
    Card,
    Invite,
    InviteBook,
    WrongCode,
    parse_code,
    serve_join,
    welcome_map,
)
from hearthnet.security.keys import NodeKey, encode_public_key
from tests.helpers.waiting import wait_for

CLI = [sys.executable, "-m", "hearthnet.cli"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=os.environ.copy())


class Proc:
    """A node process with its output in files (no pipe can fill up and stall it)."""

    def __init__(self, config: Path, data: Path, logs: Path) -> None:
        self.data = data
        self.out, self.err = logs.with_suffix(".out"), logs.with_suffix(".err")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.p = subprocess.Popen([*CLI, "node", "--config", str(config)], stdout=out,
                                      stderr=err, text=True)

    def ready(self) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            assert self.p.poll() is None, self.err.read_text()[-3000:]
            for line in self.out.read_text().splitlines():
                if '"node_ready"' in line:
                    got: dict[str, Any] = json.loads(line)
                    return got
            return None
        return wait_for(probe, "node_ready", timeout=180)

    def status(self) -> dict[str, Any]:
        admin = json.loads((self.data / "node.json").read_text())["admin"]
        with urllib.request.urlopen(admin.replace("ws://", "http://") + "/status",
                                    timeout=10) as r:
            got: dict[str, Any] = json.loads(r.read())
            return got

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


@pytest.fixture
def nodes(smollm2: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from hearthnet.security.keys import NodeKey

    a_data, c_data = tmp_path / "a-data", tmp_path / "c-data"
    a_key, c_key = NodeKey.load_or_create(a_data), NodeKey.load_or_create(c_data)
    a_cfg = tmp_path / "a.toml"
    a_cfg.write_text(f"""\
[[community.members]]
node_id = "node-c"
public_key = "{c_key.public_key_b64}"
trust = "trusted"

[node]
id = "node-a"
listen_host = "127.0.0.1"
listen_port = 0
data_dir = "{a_data}"

[research]
enable = true

[research.distributed_inference]
enabled = true

[research.distributed_inference.host]
serve_shards = true

[[shards]]
model = "smollm2"
layers = [0, {smollm2.num_layers - 1}]

[api]
enabled = false
""")
    procs: list[Proc] = []
    try:
        yield {"a_cfg": a_cfg, "a_data": a_data, "a_key": a_key.public_key_b64,
               "c_data": c_data, "tmp": tmp_path, "procs": procs}
    finally:
        for p in procs:
            p.stop()


def test_invite_join_then_b_is_a_member_and_chats_through_a(nodes: dict[str, Any]) -> None:
    tmp: Path = nodes["tmp"]
    a = Proc(nodes["a_cfg"], nodes["a_data"], tmp / "a")
    nodes["procs"].append(a)
    endpoint = a.ready()["endpoint"]
    c_cfg = tmp / "c.toml"  # a member without a model: it lists A as the steward
    c_cfg.write_text(f"""\
[[community.members]]
node_id = "node-a"
public_key = "{nodes["a_key"]}"
trust = "steward"

[node]
id = "node-c"
listen_host = "127.0.0.1"
listen_port = 0
data_dir = "{nodes["c_data"]}"
peers = ["{endpoint}"]

[api]
enabled = false
""")
    c = Proc(c_cfg, nodes["c_data"], tmp / "c")
    nodes["procs"].append(c)
    c.ready()

    # B: fresh from `hearthnet init` (test ports: two nodes on one machine)
    b_data = tmp / "b-data"
    r = _cli("init", "--dir", str(tmp / "b"), "--name", "node-b", "--listen-host",
             "127.0.0.1", "--port", "0", "--api-port", "0", "--data-dir", str(b_data))
    assert r.returncode == 0, r.stderr
    b_cfg = tmp / "b" / "node.toml"
    assert "next steps" in r.stdout and (b_data / "node.key").exists()

    r = _cli("invite", "--config", str(nodes["a_cfg"]), "--ttl", "5m")
    assert r.returncode == 0, r.stderr
    code = next(w for w in r.stdout.split() if "@127.0.0.1:" in w)

    # a wrong code: refused here and in A's log, nobody admitted, the invite survives
    flip = "0" if code[3] != "0" else "1"
    wrong = code[:3] + flip + code[4:]
    r = _cli("join", wrong, "--config", str(b_cfg))
    assert r.returncode == 1 and "wrong invite code" in r.stderr, r.stderr
    wait_for(lambda: '"wrong_code"' in a.err.read_text(), "A logs the wrong code", 30)
    assert not (b_data / "members.toml").exists()

    r = _cli("join", code, "--config", str(b_cfg))
    assert r.returncode == 0, r.stderr
    assert "joined node-a's community as node-b" in r.stdout
    assert "node-b" in {n["node_id"] for n in a.status()["nodes"] if n["member"]}
    assert code.split("-")[0] not in a.err.read_text()  # the code is never logged

    wait_for(lambda: "node-b" in {n["node_id"] for n in c.status()["nodes"] if n["member"]},
             "A's signed member event reaches C", timeout=60)
    assert "node-c" in r.stdout  # B got C's key from A: the whole member list

    r = _cli("join", code, "--config", str(b_cfg))  # reused: refused
    assert r.returncode == 1 and "used already" in r.stderr, r.stderr

    b = Proc(b_cfg, b_data, tmp / "b")
    nodes["procs"].append(b)
    b.ready()

    def linked() -> bool:
        rows = {n["node_id"]: n for n in a.status()["nodes"]}
        link = rows.get("node-b", {}).get("link")
        return bool(link and link["connected"])
    wait_for(linked, "B's gossip link to A over mutual TLS", timeout=60)
    b_view = {n["node_id"]: n for n in b.status()["nodes"]}
    assert b_view["node-a"]["member"] and b_view["node-a"]["trust"] == "steward"

    wait_for(lambda: any(m["fully_covered"] for m in b.status()["models"]),
             "B sees A's shard cover SmolLM2", timeout=60)
    r = _cli("chat", "--config", str(b_cfg), "--max-tokens", "4", "--json", "Hi",
             timeout=300)
    assert r.returncode == 0, r.stderr
    frames = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert frames[-1]["type"] == "done", frames[-3:]
    assert sum(f["type"] == "token_delta" for f in frames) >= 1


# ---- the short code: the inviter found by mDNS (hearthnet/mesh/join_announce.py) ----

class _Inviters:
    """`join_announce.InviterSearch` stand-in: these announcers, in this order (what mDNS
    would resolve), and nothing after them."""

    def __init__(self, found: list[Any]) -> None:
        self.found, self.asked = list(found), 0

    def __call__(self, invite_id: str) -> _Inviters:
        self.invite_id = invite_id
        return self

    async def __aenter__(self) -> _Inviters:
        self.seen = len(self.found)
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def next(self, timeout_s: float) -> Any:
        self.asked += 1
        return self.found.pop(0) if self.found else None


async def _door(secret: str, admitted: list[Card]) -> tuple[Any, InviteBook, int]:
    """A join listener on 127.0.0.1 holding one invite of `secret` (the node's, or a
    spoofer's: it knows the id, announced in clear, and guesses the rest)."""
    import time

    from websockets.asyncio.server import serve

    book = InviteBook()
    book._by_id[secret[:ID_CHARS]] = Invite(secret, time.monotonic() + 60)

    async def admit(card: Card) -> dict[str, Any]:
        admitted.append(card)
        return welcome_map("node-a", [{"node_id": card.node_id, "trust": "trusted",
                                       "public_key": encode_public_key(card.public_key)}],
                           7700, False)

    async def handler(ws: Any) -> None:
        await serve_join(ws, book, admit, time.monotonic)

    server = await serve(handler, "127.0.0.1", 0)
    return server, book, server.sockets[0].getsockname()[1]


async def test_a_spoofed_announcement_of_the_invite_gets_one_failed_guess_and_the_join_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone can announce a code's invite id (it is public): the joiner dials the
    spoofer, whose guess fails without seeing the joiner's card, then the real inviter."""
    from hearthnet.commands import join as join_cmd
    from hearthnet.mesh import join_announce
    from hearthnet.mesh.join_announce import Inviter

    code = parse_code("7KQ2M-XD4RA")
    spoofed: list[Card] = []
    admitted: list[Card] = []
    spoof, spoof_book, spoof_port = await _door("7K" + "0" * (CODE_CHARS - 2), spoofed)
    real, real_book, real_port = await _door(code.secret, admitted)
    found = _Inviters([Inviter("node-a", "127.0.0.1", spoof_port),
                       Inviter("node-a", "127.0.0.1", real_port)])
    monkeypatch.setattr(join_announce, "InviterSearch", found)
    card = Card("node-b", NodeKey.generate().public_key_raw)
    try:
        located, welcome = await join_cmd._find_and_exchange(code, card, 5.0)
    finally:
        spoof.close()
        real.close()
    assert found.invite_id == "7K" and (located.host, located.port) == ("127.0.0.1", real_port)
    assert welcome["node_id"] == "node-a" and admitted == [card] and spoofed == []
    assert spoof_book._by_id["7K"].tries == 1  # the spoofer's one guess, spent and failed
    assert len(real_book) == 0  # the real invite is used


async def test_a_join_dials_at_most_three_announcers_then_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each dial lets the announcer test one guess: a flood of spoofed announcements gets
    three, and the joiner says what it tried (the long form still works)."""
    from hearthnet.commands import join as join_cmd
    from hearthnet.mesh import join_announce
    from hearthnet.mesh.join_announce import MAX_CANDIDATES, Inviter

    code = parse_code("7KQ2M-XD4RA")
    doors = [await _door("7K" + c * (CODE_CHARS - 2), []) for c in "0123"]
    found = _Inviters([Inviter(f"spoof-{i}", "127.0.0.1", port)
                       for i, (_, _, port) in enumerate(doors)])
    monkeypatch.setattr(join_announce, "InviterSearch", found)
    try:
        with pytest.raises(WrongCode) as e:
            await join_cmd._find_and_exchange(code, Card("node-b", bytes(32)), 5.0)
    finally:
        for server, _, _ in doors:
            server.close()
    assert MAX_CANDIDATES == 3 and len(found.found) == 1  # the fourth was never dialled
    assert "wrong invite code" in e.value.message
    assert "tried 3 announcers: spoof-0 at 127.0.0.1:" in e.value.message


async def test_no_announcement_of_the_invite_says_what_was_searched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from hearthnet.commands import join as join_cmd
    from hearthnet.mesh import join_announce

    monkeypatch.setattr(join_announce, "InviterSearch", _Inviters([]))
    with pytest.raises(AuthError) as e:
        await join_cmd._find_and_exchange(parse_code("7KQ2M-XD4RA"), Card("node-b", bytes(32)),
                                          2.0)
    assert e.value.details["reason"] == "invite_not_found"
    msg = e.value.message
    assert "invite 7K" in msg and "within 2 s" in msg and "_hearthnet-join._tcp.local." in msg
    assert "XD4RA" not in msg  # the secret part is not echoed
    assert "CODE@HOST:PORT" in msg
