"""A killed host is shown offline in seconds, not after the 30 s health timeout (issue 15 §6).

The chain of ``config/mesh3``: node-a orchestrates and links only to node-b (0-14), node-c
(15-29) links only to node-b, so node-a has no gossip link of its own that could drop when
node-c dies — until now it showed node-c "online" for the whole health timeout. Every node
now probes the listeners of the hosts it sees advertised (`HostLiveness`): after a
``kill -9`` of node-c, node-a's status JSON (the web page's ``/api/status``, ``/v1/models``
and ``hearthnet status --json``) says node-c is offline and why, and node-a's router no
longer picks node-c's shard. Restarted, node-c is online again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import LocalMesh, NodeSpec
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.slow

HEALTH_TIMEOUT_S = 30.0  # the default; the probe must beat it by far


@pytest.fixture(scope="module")
def mesh(smollm2, tmp_path_factory):
    # LocalMesh links every node to the first one: node-b first gives mesh3's chain A-B-C;
    # node-a keeps one link (the default, two, would link it to node-c too: mesh.links),
    # as a node of a larger mesh has no link to most hosts
    with LocalMesh([NodeSpec("node-b", [(0, 14)]),
                    NodeSpec("node-a", extra_node={"min_gossip_links": 1}),
                    NodeSpec("node-c", [(15, 29)])], timeout_s=HEALTH_TIMEOUT_S,
                   root=tmp_path_factory.mktemp("chain")) as m:
        yield m


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def _page_status(m: LocalMesh) -> dict[str, Any]:
    """What the web status page polls on node-a."""
    return _get(m.nodes["node-a"].api + "/api/status")


def _shard_of(st: dict[str, Any], host: str) -> dict[str, Any] | None:
    return next((s for s in st["shards"] if s["host"] == host), None)


def _cli_status(m: LocalMesh) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "status", "--json", "--config",
                        str(m.nodes["node-a"].config)], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


async def test_killed_host_is_offline_well_before_the_health_timeout(mesh):
    st = wait_for(lambda: (s := _page_status(mesh)) and (c := _shard_of(s, "node-c"))
                  and c["state"] == "online" and s["models"][0]["fully_covered"] and s,
                  "node-a to see node-c online and the model covered")
    assert [p["node_id"] for p in st["peers"]] == ["node-b"]  # no link of its own to C
    t0 = time.monotonic()
    mesh.kill("node-c")
    st = wait_for(lambda: (s := _page_status(mesh)) and
                  _shard_of(s, "node-c")["state"] == "offline" and s,  # type: ignore[index]
                  "node-a's status page to show node-c offline", timeout=60)
    took = time.monotonic() - t0
    print(f"\nnode-c offline on node-a's status page {took:.1f} s after kill -9 "
          f"(health timeout {HEALTH_TIMEOUT_S:.0f} s)")
    c = _shard_of(st, "node-c")
    assert c is not None and c["reason"].startswith("host node-c refuses connections"), c
    assert c["age_s"] < HEALTH_TIMEOUT_S  # its last heartbeat is still fresh: the probe did it
    assert took < HEALTH_TIMEOUT_S / 2
    node_c = next(n for n in st["nodes"] if n["node_id"] == "node-c")
    assert not node_c["online"] and node_c["reason"] == c["reason"]
    m = st["models"][0]
    assert not m["fully_covered"] and m["uncovered"] == [[15, 29]]
    models = _get(mesh.nodes["node-a"].api + "/v1/models")["data"]
    assert models[0]["hearthnet"]["uncovered"] == [[15, 29]]
    cli = _shard_of(_cli_status(mesh), "node-c")
    assert cli is not None and cli["state"] == "offline"


async def test_router_skips_the_probed_down_host(mesh):
    """No session is opened on the dead host: the call fails at once, naming why."""
    args = chat_args("Hi.", "smollm2", SamplingParams(max_tokens=4), fallback_to_local=False)
    frames = [f async for f in bus_call(mesh.nodes["node-a"].uri, CHAT_CAPABILITY, args)]
    err = frames[-1]
    assert err["type"] == "error" and err["code"] == "shard_unavailable", err
    assert "host node-c refuses connections (probed down)" in err["message"], err


def test_restarted_host_is_online_again(mesh):
    mesh.start_node("node-c")
    wait_for(lambda: (s := _page_status(mesh)) and
             (c := _shard_of(s, "node-c")) and c["state"] == "online" and
             s["models"][0]["fully_covered"], "node-c online again on node-a's page",
             timeout=60)


def test_a_restarted_host_s_old_advertisements_go_at_once(mesh):
    """Killed, then restarted with another range (same id, same address: liveness probes
    cannot tell the processes apart): its old process's advertisement of 15-29 is gone
    from node-a as soon as the new one advertises 10-29, not after the 120 s expiry."""
    mesh.kill("node-c")
    cfg = mesh.nodes["node-c"].config
    cfg.write_text(cfg.read_text().replace("layers = [15, 29]", "layers = [10, 29]"))
    mesh.start_node("node-c")
    wait_for(lambda: [s["layers"] for s in _page_status(mesh)["shards"]
                      if s["host"] == "node-c"] == [[10, 29]],
             "only node-c's new range on node-a's page", timeout=30)
