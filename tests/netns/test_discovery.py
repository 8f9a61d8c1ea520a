"""LAN discovery by mDNS/DNS-SD in network namespaces (issue 17 §5).

Two nodes in two namespaces on one bridge (multicast routed out of each namespace's
``eth0``), both configs with ``discovery = "mdns"`` and **no peers**: ``node-a``
orchestrates, ``node-b`` hosts every layer. They must find each other's addresses, link up
(mutual TLS pinned to the member list) and cover the model; a chat then runs through the
mesh. Skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from hearthnet.mesh.launcher import NodeSpec
from tests.netns.conftest import NetnsLan

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def lan(netns_ok, smollm2):
    net = NetnsLan([NodeSpec("node-a"), NodeSpec("node-b", [(0, 29)])], name="d")
    for n in net.nodes.values():  # no peers written: discovery must find them
        text = re.sub(r"^peers = .*$", 'peers = []\ndiscovery = "mdns"',
                      n.config.read_text(), flags=re.M)
        n.config.write_text(text)
    try:
        net.up()
        net.start()
        yield net
    finally:
        net.down()
        assert not net.root.exists()  # nothing of the LAN is left in the temp folder


def test_nodes_find_each_other_without_peers(lan):
    shards = lan.wait_seen("node-a", "node-b", timeout=60)
    assert [s["host"] for s in shards] == ["node-b"]
    log = (lan.root / "node-a.log").read_text()
    found = {json.loads(line)["node"] for line in log.splitlines()
             if '"discovery_found"' in line}
    assert found == {"node-b"}, found


def test_a_chat_runs_through_the_discovered_mesh(lan):
    p = lan.client("node-a", "chat", "Name three colours.", "8", "10")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    frames = [json.loads(line) for line in out.splitlines()]
    done = next(f for f in frames if f["type"] == "done")
    assert not done.get("fallback") and done["pipeline"] == [shards_of_b(lan)], done


def shards_of_b(lan: NetnsLan) -> str:
    return str(lan.wait_seen("node-a", "node-b", timeout=30)[0]["shard_id"])


# An attacker on the LAN: announces member node-b at `n` ports of its own address, then
# leaves (unregisters: mDNS goodbyes) when a line arrives on stdin.
SPOOFER = r"""
import asyncio, socket, sys
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

async def main(ip, n):
    zc = AsyncZeroconf(interfaces=[ip])
    infos = [AsyncServiceInfo("_hearthnet._tcp.local.", f"spoof-{i}._hearthnet._tcp.local.",
                              addresses=[socket.inet_aton(ip)], port=5000 + i,
                              properties={"id": "node-b", "scheme": "wss"},
                              server=f"spoof-{i}.local.") for i in range(n)]
    await asyncio.gather(*await asyncio.gather(*(zc.async_register_service(i) for i in infos)))
    print("announced", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await zc.async_unregister_all_services()
    await zc.async_close()
    print("left", flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _log_lines(lan: NetnsLan, node_id: str, event: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (lan.root / f"{node_id}.log").read_text().splitlines()
            if f'"{event}"' in line]


def _until(cond: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.2)


def test_spoofed_announcements_make_no_links_and_their_removal_is_followed(lan):
    """100 announcements of node-b at new ports (each added a gossip link that was
    redialled every 10 s for ever): node-a holds one address per member, dials only
    the real node-b, and drops the spoofed address when the spoofer's services go."""
    b = lan.nodes["node-b"]
    script = lan.root / "spoof.py"
    script.write_text(SPOOFER)
    spoofer = subprocess.Popen(lan.exec_args("node-b", sys.executable, str(script), b.addr,
                                             "100"),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert spoofer.stdout is not None and spoofer.stdin is not None
        assert spoofer.stdout.readline().strip() == "announced"
        spoofed = f"wss://{b.addr}:50"
        _until(lambda: sum(str(f["uri"]).startswith(spoofed)
                           for f in _log_lines(lan, "node-a", "discovery_found")) >= 50,
               "node-a sees the spoofed announcements")
        spoofer.stdin.write("\n")
        spoofer.stdin.flush()
        assert spoofer.stdout.readline().strip() == "left"
        _until(lambda: any(str(r["uri"]).startswith(spoofed)
                           for r in _log_lines(lan, "node-a", "discovery_removed")),
               "node-a drops the spoofed address")
    finally:
        spoofer.kill()
        spoofer.wait()
    dialled = {str(d["uri"]) for d in _log_lines(lan, "node-a", "gossip_link_dialling")}
    assert dialled <= {f"wss://{b.addr}:7710"}, dialled  # node-b itself, or nothing
