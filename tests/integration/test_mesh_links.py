"""The mesh keeps its gossip links from the member list: no single node failure cuts a
node off (`hearthnet.mesh.links`).

`LocalMesh` links every node to the first one, so node-b first gives the chain A–B–C:
node-b a relay hosting nothing, node-a orchestrating, node-c hosting every layer. Before,
node-c's heartbeats reached node-a only through node-b: with node-b dead, node-c's
advertisements expired at node-a (4 × the health timeout) while node-c was up. Now each
node with fewer than two members linked dials another member it knows: node-a dials
node-c at the endpoint node-c signed into its advertisement. After a ``kill -9`` of
node-b, node-c's heartbeats still reach node-a, whose status shows the model covered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

HEALTH_TIMEOUT_S = 4.0  # heartbeats every 2 s, advertisements expire after 16 s


@pytest.fixture(scope="module")
def chain(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    with LocalMesh([NodeSpec("node-b"), NodeSpec("node-a"), NodeSpec("node-c", [(0, 29)])],
                   timeout_s=HEALTH_TIMEOUT_S, root=tmp_path_factory.mktemp("links")) as m:
        yield m


def _linked(st: dict[str, Any], peer: str) -> bool:
    return any(p["node_id"] == peer and p["connected"] for p in st["peers"])


def _heard_since(st: dict[str, Any], host: str, t: float) -> bool:
    """`host`'s shard is covered and advertised (a heartbeat) after `t` (Unix time)."""
    shard = next((s for s in st["shards"] if s["host"] == host), None)
    return shard is not None and st["time"] - shard["age_s"] > t \
        and st["models"][0]["fully_covered"]


def test_the_ends_of_a_chain_stay_linked_when_the_middle_dies(chain: LocalMesh) -> None:
    def status_when(cond: Any) -> Any:
        st = chain.status("node-a")
        return st if cond(st) else None

    st = wait_for(lambda: status_when(lambda s: _linked(s, "node-c")),
                  "node-a linked to node-c besides node-b", timeout=30)
    assert _linked(st, "node-b")  # its configured peer, still there
    killed_at = time.time()
    chain.kill("node-b")
    st = wait_for(lambda: status_when(lambda s: _heard_since(s, "node-c", killed_at + 0.5)),
                  "a heartbeat of node-c made after node-b died, at node-a", timeout=30)
    assert _linked(st, "node-c") and not _linked(st, "node-b")
    shard = next(s for s in st["shards"] if s["host"] == "node-c")
    assert shard["state"] == "online", shard
    print(f"\nnode-c heard at node-a {st['time'] - killed_at:.1f} s after node-b died")
