"""Real hosts for tests: HearthNet nodes in separate network namespaces on one bridge.

`NetnsLan` makes one Linux bridge and, per node, a network namespace joined to the bridge
by a veth pair, with its own address in ``10.231.0.0/24``. Each node runs
``ip netns exec <ns> python -m hearthnet.cli node`` with a TOML from
`hearthnet.mesh.launcher.node_toml` listening on its namespace address (mutual TLS with
keys from `provision`, like `LocalMesh`). The bus client runs inside the orchestrator's
namespace (`CLIENT`, a subprocess) and talks to that node's loopback admin listener.

A host can be killed whole (every process in its namespace, SIGKILL) or cut off (its veth
set down on the bridge side: TCP connections go silent). Everything — processes,
namespaces, veths, the bridge — is removed at the end, also on failure. Names carry this
process's pid (``hnl<pid>...``), so parallel runs do not collide and
``scripts/lan_test.sh --cleanup`` can find leftovers.

Tests here are marked ``netns`` and skipped with the reason when namespaces cannot be made
(not root, no ``ip``, no permission).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hearthnet.mesh.launcher import NodeSpec, log_tail, node_toml, wait_node_ready
from hearthnet.paths import models_dir
from hearthnet.security.provision import provision

SUBNET = "10.231.0"
PORT = 7710  # every node listens on its own address; the same port everywhere is fine

# The bus client, run inside the orchestrator's namespace. Modes:
#   wait <host> <since> <timeout>   until the node sees <host>'s shard advertised after <since>
#   chat <prompt> <max_tokens> <timeout_s>   one JSON frame per line, then {"type": "exit"}
CLIENT = r"""
import asyncio, json, sys, time, urllib.request
from hearthnet.node.admin import node_uri
from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.mesh.bus import bus_call
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

cfg, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]

def status():
    uri = node_uri(cfg).replace("ws://", "http://")
    with urllib.request.urlopen(uri + "/status", timeout=5) as r:
        return json.loads(r.read())

if mode == "wait":
    host, since, deadline = args[0], float(args[1]), time.monotonic() + float(args[2])
    while time.monotonic() < deadline:
        try:
            st = status()
            if any(s["host"] == host and st["time"] - s["age_s"] >= since - 0.5
                   for s in st["shards"]) and all(m["fully_covered"] for m in st["models"]):
                print(json.dumps({"type": "seen", "shards": st["shards"]}), flush=True)
                sys.exit(0)
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit(3)

async def chat(prompt, n, timeout_s):
    a = chat_args(prompt, "smollm2", SamplingParams(max_tokens=n), wire_dtype="fp32",
                  timeout_s=timeout_s)
    async for f in bus_call(node_uri(cfg), CHAT_CAPABILITY, a):
        print(json.dumps(f), flush=True)
    print(json.dumps({"type": "exit"}), flush=True)

asyncio.run(chat(args[0], int(args[1]), float(args[2])))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run scripts/lan_test.sh as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"hnl{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class LanNode:
    spec: NodeSpec
    ns: str
    veth: str  # the bridge-side end, in the root namespace
    addr: str
    config: Path
    proc: subprocess.Popen[str] | None = None


class NetnsLan:
    """Nodes on separate network namespaces joined by a bridge; see the module docstring."""

    def __init__(self, specs: list[NodeSpec], *, timeout_s: float = 10.0,
                 name: str = "") -> None:
        tag = f"hnl{os.getpid()}"  # `name` (a letter or two) keeps modules' LANs apart
        self.bridge = f"{tag}{name}br"
        self.root = Path(tempfile.mkdtemp(prefix="hearthnet-lan-"))
        self.client_py = self.root / "client.py"
        self.client_py.write_text(CLIENT)
        self.nodes: dict[str, LanNode] = {}
        for i, spec in enumerate(specs):
            addr = f"{SUBNET}.{11 + i}"
            self.nodes[spec.node_id] = LanNode(spec, f"{tag}-{name}{spec.node_id}",
                                               f"{tag}{name}v{i}",
                                               addr, self.root / f"{spec.node_id}.toml")
        first = next(iter(self.nodes.values()))
        for n in self.nodes.values():
            peers = [] if n is first else [f"wss://{first.addr}:{PORT}"]
            text = node_toml(n.spec, PORT, peers, self.root / n.spec.node_id, models_dir(),
                             timeout_s=timeout_s, members=specs)
            n.config.write_text(text.replace('listen_host = "127.0.0.1"',
                                              f'listen_host = "{n.addr}"'))
        provision(self.root)

    # ---- network ----

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for n in self.nodes.values():
            _ip("netns", "add", n.ns)
            _ip("-n", n.ns, "link", "set", "lo", "up")
            _ip("link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.ns)
            _ip("link", "set", n.veth, "master", self.bridge, "up")
            _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", "eth0")
            _ip("-n", n.ns, "link", "set", "eth0", "up")
            # multicast (mDNS discovery, issue 17) leaves by the bridge
            _ip("-n", n.ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def add_default_routes(self) -> None:
        """A default route out of each namespace's ``eth0``, as a home LAN's router gives:
        what `hearthnet init` reads the machine's LAN address from (no gateway answers;
        the nodes only talk on the bridge)."""
        for n in self.nodes.values():
            _ip("-n", n.ns, "route", "add", "default", "dev", "eth0")

    def down(self) -> None:
        """Kill every process in the namespaces, delete them and the bridge, and remove the
        LAN's folder (configs, keys, node data and logs) (idempotent)."""
        for n in self.nodes.values():
            self.kill_host(n.spec.node_id)
            _ip("netns", "del", n.ns, check=False)  # takes the veth pair with it
            _ip("link", "del", n.veth, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    def cut(self, node_id: str) -> None:
        """Pull the host's cable: its veth goes down on the bridge side."""
        _ip("link", "set", self.nodes[node_id].veth, "down")

    def mend(self, node_id: str) -> None:
        _ip("link", "set", self.nodes[node_id].veth, "up")

    # ---- processes ----

    def exec_args(self, node_id: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node_id].ns, *cmd]

    def start(self, ids: list[str] | None = None, timeout: float = 180.0) -> None:
        ids = ids or list(self.nodes)
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        for i in ids:
            n = self.nodes[i]
            with (self.root / f"{i}.log").open("a") as log:  # the child keeps its own copy
                n.proc = subprocess.Popen(
                    self.exec_args(i, sys.executable, "-m", "hearthnet.cli", "node",
                                   "--config", str(n.config)),
                    stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                    start_new_session=True)
        for i in ids:
            self._wait_ready(self.nodes[i], timeout)

    def _wait_ready(self, n: LanNode, timeout: float) -> None:
        assert n.proc is not None
        wait_node_ready(n.proc, timeout, n.spec.node_id, lambda: self.log_tail(n))

    def log_tail(self, n: LanNode) -> str:
        return log_tail(self.root / f"{n.spec.node_id}.log")

    def kill_host(self, node_id: str) -> None:
        """SIGKILL every process in the host's namespace (the machine dies)."""
        n = self.nodes[node_id]
        r = _ip("netns", "pids", n.ns, check=False)
        for pid in r.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if n.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                n.proc.wait(timeout=30)
            if n.proc.stdout is not None:
                n.proc.stdout.close()

    def client(self, node_id: str, *args: str) -> subprocess.Popen[str]:
        """The bus client (`CLIENT`) inside `node_id`'s namespace."""
        return subprocess.Popen(
            self.exec_args(node_id, sys.executable, str(self.client_py),
                           str(self.nodes[node_id].config), *args),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_seen(self, node_id: str, host: str, since: float = 0.0,
                  timeout: float = 90.0) -> list[dict[str, Any]]:
        """Wait until `node_id` sees the model covered and `host`'s shard advertised."""
        p = self.client(node_id, "wait", host, str(since), str(timeout))
        out, err = p.communicate(timeout=timeout + 30)
        assert p.returncode == 0, f"{node_id} never saw {host}: {err[-2000:]}"
        return list(json.loads(out.splitlines()[-1])["shards"])


@pytest.fixture(scope="module")
def netns_ok() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
