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
