"""Two machines from nothing: ``hearthnet init`` in two network namespaces, ``invite`` on
the first, ``join SHORTCODE`` on the second (no address: the inviter is found by mDNS),
then a chat through both (M26 §5.8; docs/security.md: Joining with a code).

Each namespace has its own address on one bridge and a default route out of ``eth0``, as a
machine on a home LAN has; every step is the real CLI run with ``ip netns exec``, with the
defaults `init` writes (ports 7700 and 11435 in each namespace, mDNS discovery) except
what a user edits by hand: the node names (the two namespaces share one host name), the
folders (the test's own), and one layer range each instead of ``shards = "auto"``
(node-a 0–14, node-b 15–29), so that the chat's pipeline runs through both. The time from
the first ``init`` to the first answered token is logged, not asserted.

Then the refusals a user meets: the used code again (short and long form), and a wrong
code (right invite id, wrong secret) — each exit code 1 with a message saying why — and
an invite's announcement withdrawn when it is used and when it expires. The
tests share one LAN and run in file order. Skipped with the reason where namespaces
cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hearthnet.mesh.join_announce import JOIN_SERVICE_TYPE
from hearthnet.mesh.launcher import NodeSpec
from tests.helpers.waiting import wait_for
from tests.netns.conftest import NetnsLan

pytestmark = pytest.mark.netns

RANGES = {"node-a": (0, 14), "node-b": (15, 29)}
LISTEN_PORT = 7700  # `hearthnet init`'s default, in each namespace


@pytest.fixture(scope="module")
def lan(netns_ok: None, smollm2: Any) -> Any:
    net = NetnsLan([NodeSpec("node-a"), NodeSpec("node-b")], name="j")
    net.state = {}  # type: ignore[attr-defined]  # what the tests hand on, in file order
    try:
        net.up()
        net.add_default_routes()
        yield net
    finally:
        net.down()
        assert not net.root.exists()


def _cli(lan: NetnsLan, node_id: str, *args: str, timeout: float = 60
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(lan.exec_args(node_id, sys.executable, "-m", "hearthnet.cli", *args),
                          capture_output=True, text=True, timeout=timeout)


def _init(lan: NetnsLan, node_id: str) -> Path:
    """`hearthnet init` in the node's namespace, then the user's one edit: a layer range."""
    folder = lan.root / f"{node_id}-init"
    r = _cli(lan, node_id, "init", "--dir", str(folder), "--name", node_id,
             "--data-dir", str(lan.root / f"{node_id}-data"))
    assert r.returncode == 0, r.stderr
    cfg = folder / "node.toml"
    text = cfg.read_text()
    assert f'advertise_host = "{lan.nodes[node_id].addr}"' in text  # its LAN address
    assert 'discovery = "mdns"' in text
    first, last = RANGES[node_id]
    cfg.write_text(re.sub(r'^shards = "auto".*$', "", text, flags=re.M)
                   + f'\n[[shards]]\nmodel = "smollm2"\nlayers = [{first}, {last}]\n')
    lan.nodes[node_id].config = cfg  # `start` and the bus client use this config now
    return cfg


def _log(lan: NetnsLan, node_id: str, event: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (lan.root / f"{node_id}.log").read_text().splitlines()
            if f'"{event}"' in line]


def _invite(lan: NetnsLan, *ttl: str) -> tuple[str, str]:
    """`hearthnet invite` on node-a: (short code, long code) as printed."""
    r = _cli(lan, "node-a", "invite", "--config", str(lan.nodes["node-a"].config), *ttl)
    assert r.returncode == 0, r.stderr
    short = re.search(r"hearthnet join (\S+) --config", r.stdout)
    long = re.search(r"hearthnet join (\S+@\S+) --config", r.stdout)
    assert short and long and "@" not in short.group(1), r.stdout
    assert r.stdout.split("\n\n")[1].strip() == short.group(1)  # the code shown is short
    return short.group(1), long.group(1)


def test_init_invite_join_by_mdns_then_a_chat_runs_through_both(lan: NetnsLan) -> None:
    t0 = time.monotonic()
    steps: dict[str, float] = {}
    a_cfg, b_cfg = _init(lan, "node-a"), _init(lan, "node-b")
    steps["init x2"] = time.monotonic() - t0
    lan.start(["node-a"])
    steps["node-a ready"] = time.monotonic() - t0
    short, long = _invite(lan)
    steps["invite"] = time.monotonic() - t0
    assert _log(lan, "node-a", "invite_announced")  # on the LAN while the code is open

    r = _cli(lan, "node-b", "join", short, "--config", str(b_cfg))
    assert r.returncode == 0, r.stderr
    steps["join (mDNS)"] = time.monotonic() - t0
    a = lan.nodes["node-a"]
    assert "joined node-a's community as node-b" in r.stdout, r.stdout
    assert f"peer wss://{a.addr}:{LISTEN_PORT} added to" in r.stdout, r.stdout
    lan.state["codes"] = (short, long)  # type: ignore[attr-defined]

    lan.start(["node-b"])
    steps["node-b ready"] = time.monotonic() - t0
    lan.wait_seen("node-b", "node-a", timeout=60)  # linked, both ranges advertised
    steps["covered"] = time.monotonic() - t0
    p = subprocess.Popen(lan.exec_args("node-b", sys.executable, "-m", "hearthnet.cli", "chat",
                                       "--config", str(b_cfg), "--max-tokens", "4", "--json",
                                       "Name three colours."),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frames: list[dict[str, Any]] = []
    first_token_s = None
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("{"):
            frames.append(json.loads(line))
            if first_token_s is None and frames[-1]["type"] == "token_delta":
                first_token_s = time.monotonic() - t0
    err = p.stderr.read() if p.stderr else ""
    assert p.wait(timeout=120) == 0, err[-2000:]
    done = frames[-1]
    assert done["type"] == "done" and not done.get("fallback"), frames[-3:]
    hosts = {s["host"] for s in lan.wait_seen("node-b", "node-a", timeout=10)}
    assert len(done["pipeline"]) == 2 and hosts == {"node-a", "node-b"}, done
    assert first_token_s is not None
    steps["first token"] = first_token_s
    print(f"\ninit -> first answered token: {first_token_s:.1f} s in two namespaces (at: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in steps.items()) + ")")
    assert a_cfg.exists()


def test_the_used_code_is_refused_in_both_forms(lan: NetnsLan) -> None:
    short, long = lan.state["codes"]  # type: ignore[attr-defined]
    b_cfg = str(lan.nodes["node-b"].config)
    wait_for(lambda: _log(lan, "node-a", "invite_unannounced"), "the announcement withdrawn",
             timeout=30)
    r = _cli(lan, "node-b", "join", short, "--config", b_cfg, "--find-timeout", "2s")
    assert r.returncode == 1, r.stdout
    assert f"no node announced invite {short[:2]}" in r.stderr, r.stderr
    assert JOIN_SERVICE_TYPE in r.stderr and "used already" in r.stderr, r.stderr
    assert "CODE@HOST:PORT" in r.stderr, r.stderr
    r = _cli(lan, "node-b", "join", long, "--config", b_cfg)
    assert r.returncode == 1 and "used already" in r.stderr, r.stderr


def test_a_wrong_code_is_refused_and_admits_nobody_and_the_invite_expires(
        lan: NetnsLan) -> None:
    short, _ = _invite(lan, "--ttl", "8s")
    withdrawn = len(_log(lan, "node-a", "invite_unannounced"))
    wrong = short[:-1] + ("0" if short[-1] != "0" else "1")  # same invite id: found, tested
    b_cfg = str(lan.nodes["node-b"].config)
    members = (lan.root / "node-b-data" / "members.toml").read_text()
    r = _cli(lan, "node-b", "join", wrong, "--config", b_cfg)
    assert r.returncode == 1, r.stdout
    assert "wrong invite code" in r.stderr, r.stderr
    wait_for(lambda: any(e.get("reason") == "wrong_code"
                         for e in _log(lan, "node-a", "auth_refused")),
             "node-a logs the wrong code", timeout=30)
    assert (lan.root / "node-b-data" / "members.toml").read_text() == members
    # the wrong try did not burn it (3 do); its expiry withdraws its announcement
    wait_for(lambda: [e["invite"] for e in _log(lan, "node-a", "invite_unannounced")
                      ][withdrawn:] == [short[:2]],
             "the expired invite's announcement withdrawn", timeout=30)
