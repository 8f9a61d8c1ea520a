"""Join without pasting keys, with real node processes on 127.0.0.1: node A (the steward)
runs from a config that hosts SmolLM2, node C is a member A knows from its config, node B
is fresh from ``hearthnet init``. ``hearthnet invite`` on A and ``hearthnet join CODE`` on
B make B a member (a wrong code first is refused on both sides, the used code afterwards
is refused); A's live member list shows B at once and C's once A's signed member event
reaches it; then B starts, links to A over mutual TLS pinned to the exchanged keys, and a
chat through B answers from A's shard."""

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
