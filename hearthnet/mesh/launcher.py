"""Start a local mesh of `hearthnet node` processes on 127.0.0.1 (demo, benchmarks, tests).

`LocalMesh` writes one TOML per node into a fresh folder (free ports, its own data
directory per node, the shared model store), starts each node as a separate process,
waits for its `node_ready` line and for the model to be covered, and stops every process
it started — on exit, on error and on Ctrl-C.

Secure by default (M26 §5.8, §5.9): `LocalMesh` gives every node a key and every config the
full member list (`security.provision`), so the nodes talk ``wss://`` with mutual TLS and
sign their events and session opens. Clients in this process reach a node through its
loopback admin listener (`NodeProc.uri`). Pass ``insecure_plaintext=True`` for plain
``ws://`` links.

On Linux every node process gets SIGTERM when the launching thread dies
(``PR_SET_PDEATHSIG``): a demo killed with SIGKILL leaves no orphan nodes behind.
Subclasses choose how a node process starts (`node_argv`, `node_env`); the test suite's
`tests.helpers.mesh.TestMesh` starts its own entry point with injected faults that way.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hearthnet.errors import HearthNetError
from hearthnet.paths import models_dir
from hearthnet.security.provision import provision

_PORTS = range(20000, 32768)  # below Linux's ephemeral range (32768-60999): a port the
# kernel hands out (bind to 0) can be taken by any outgoing connection before the node
# binds it, and with many WebSocket clients on one machine that happened
_HANDED_OUT: set[int] = set()


def log_tail(path: Path, lines: int = 12, width: int = 400) -> str:
    """The last `lines` lines of a node's log, each cut at `width` characters: a node that
    exits while a mesh starts says why in the error itself (the mesh's folder, and its
    logs, are removed when the mesh stops)."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"(unreadable: {e})"
    return "\n".join(line[:width] for line in text) or "(empty)"


def log_tails(root: Path) -> str:
    """`log_tail` of every node log under `root`, each under its name (a benchmark's mesh
    that failed to start; no tensor contents are ever logged)."""
    return "\n".join(f"--- {f.name}\n{log_tail(f)}" for f in sorted(root.glob("*.log")))


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not handed out before
    by this process (chosen at random: processes started together do not collide)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_PORTS)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range is crowded: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class NodeSpec:
    """One node of a local mesh: its id and the layer ranges it hosts."""

    node_id: str
    shards: list[tuple[int, int]] = field(default_factory=list)
    extra_di: dict[str, Any] = field(default_factory=dict)
    trust: str = "trusted"  # this node's trust in every member list
    extra_host: dict[str, Any] = field(default_factory=dict)  # [...distributed_inference.host]
    auto: dict[str, Any] | None = None  # shards = "auto" with this [...auto] table
    threads: int | None = None  # torch_threads of this node (default: the mesh's)
    api: dict[str, Any] = field(default_factory=dict)  # [api] (e.g. listen_port)
    model_shards: list[tuple[str, int, int]] = field(default_factory=list)  # other models
    max_streams: int = 8  # every [[shards]] entry's max_concurrent_streams
    extra_node: dict[str, Any] = field(default_factory=dict)  # [node] (drain_timeout_seconds)


@dataclass
class NodeProc:
    spec: NodeSpec
    port: int
    config: Path
    proc: subprocess.Popen[str] | None = None
    endpoint: str = ""
    admin: str = ""  # the loopback admin listener, known once the node is ready
    api: str = ""  # the HTTP API / status page (http://127.0.0.1:PORT), once ready
    tls: bool = True

    @property
    def uri(self) -> str:
        """Where a local client calls the node: its admin listener (``/bus``, HTTP)."""
        return self.admin or self.listen_uri

    @property
    def listen_uri(self) -> str:
        """The node's main listener (``/shard``, ``/gossip``; TLS unless plaintext)."""
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}"


# resolved here, in the parent: the child between fork and exec only calls it
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launching thread dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}"
                               for k, x in v.items()) + "}"
    return str(v)


def node_toml(spec: NodeSpec, port: int, peers: list[str], data_dir: Path, models: Path,
              *, model: str = "smollm2", timeout_s: float = 30.0, threads: int = 1,
              members: list[NodeSpec] | None = None, insecure_plaintext: bool = False
              ) -> str:
    """One node's TOML. `members` are listed without keys (`provision` fills them in)."""
    serves = bool(spec.shards or spec.model_shards) or spec.auto is not None
    di = {"enabled": True, "shard_health_timeout_seconds": timeout_s,
          "activation_dtype": "auto",
          # one machine: a node that holds layers leaves the head to the node that answers
          # (it loads one when asked to) rather than building its own while the mesh
          # starts, on the cores every node shares (M26 §5.6)
          **({"prepare_heads_at_start": False} if spec.shards or spec.model_shards else {}),
          **spec.extra_di}
    lines = ['shards = "auto"', ""] if spec.auto is not None else []
    lines += ["[node]", f'id = "{spec.node_id}"', 'listen_host = "127.0.0.1"',
              f"listen_port = {port}", f"data_dir = {_toml_value(str(data_dir))}",
              f"models_dir = {_toml_value(str(models))}",
              f"torch_threads = {spec.threads or threads}",
              f"peers = {_toml_value(peers)}", 'log_level = "info"']
    lines += [f"{k} = {_toml_value(v)}" for k, v in spec.extra_node.items()]
    lines += ["",
              "[research]", "enable = true", "", "[research.distributed_inference]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in di.items()]
    lines += ["", "[research.distributed_inference.host]",
              f"serve_shards = {_toml_value(serves)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in spec.extra_host.items()] + [""]
    if spec.auto is not None:
        lines += ["[research.distributed_inference.auto]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in spec.auto.items()] + [""]
    for m, lo, hi in [(model, lo, hi) for lo, hi in spec.shards] + spec.model_shards:
        lines += ["[[shards]]", f'model = "{m}"', f"layers = [{lo}, {hi}]",
                  f"max_concurrent_streams = {spec.max_streams}", ""]
    lines += ["[security]", f"insecure_plaintext = {_toml_value(insecure_plaintext)}", ""]
    if spec.api:
        lines += ["[api]"] + [f"{k} = {_toml_value(v)}" for k, v in spec.api.items()] + [""]
    for member in members or []:
        lines += ["[[community.members]]", f'node_id = "{member.node_id}"',
                  'public_key = ""', f'trust = "{member.trust}"', ""]
    return "\n".join(lines)


def wait_node_ready(proc: subprocess.Popen[str], timeout: float, node_id: str,
                    on_exit: Callable[[], str]) -> dict[str, Any]:
    """Read a node process's stdout until its `node_ready` line; returns that line's map.

    Raises:
        HearthNetError: the process exited first (with `on_exit()`'s text), or timeout.
    """
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise HearthNetError(f"node {node_id} exited with {proc.returncode}; "
                                     f"{on_exit()}")
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict) and msg.get("event") == "node_ready":
            return msg
    raise HearthNetError(f"node {node_id} not ready within {timeout:.0f} s")


class LocalMesh:
    """A mesh of node processes on this machine; use as a context manager."""

    def __init__(self, specs: list[NodeSpec], *, root: Path | None = None,
                 model: str = "smollm2", timeout_s: float = 30.0, threads: int = 1,
                 quiet: bool = True, insecure_plaintext: bool = False,
                 models: Path | None = None) -> None:
        self._own_root = root is None  # a folder we made is removed again by `stop`
        self.root = Path(root or tempfile.mkdtemp(prefix="hearthnet-mesh-"))
        self.tls = not insecure_plaintext
        self.model, self.timeout_s, self.threads, self.quiet = model, timeout_s, threads, quiet
        self.models = models or models_dir()
        self.nodes: dict[str, NodeProc] = {}
        ports = [free_port() for _ in specs]
        first = f"{'wss' if self.tls else 'ws'}://127.0.0.1:{ports[0]}"
        for i, (spec, port) in enumerate(zip(specs, ports, strict=True)):
            # a star around the first node: gossip from anyone reaches everyone through it
            peers = [] if i == 0 else [first]
            cfg = self.root / f"{spec.node_id}.toml"
            cfg.write_text(node_toml(spec, port, peers, self.root / spec.node_id, self.models,
                                     model=model, timeout_s=timeout_s, threads=threads,
                                     members=specs, insecure_plaintext=insecure_plaintext))
            self.nodes[spec.node_id] = NodeProc(spec, port, cfg, tls=self.tls)
        provision(self.root)  # a key per node, every key in every member list, never by hand

    def __enter__(self) -> LocalMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, wait_cover: bool = True, timeout: float = 120.0) -> None:
        for n in self.nodes.values():
            self.start_node(n.spec.node_id, wait=False)
        for n in self.nodes.values():
            self._wait_ready(n, timeout)
        if wait_cover:
            self.wait_covered(next(iter(self.nodes)), timeout=timeout)

    def node_argv(self, n: NodeProc) -> list[str]:
        """The command line that runs node `n`."""
        return [sys.executable, "-m", "hearthnet.cli", "node", "--config", str(n.config)]

    def node_env(self, n: NodeProc) -> dict[str, str]:
        """The environment of node `n`'s process."""
        return dict(os.environ, OMP_NUM_THREADS=str(n.spec.threads or self.threads),
                    TOKENIZERS_PARALLELISM="false")

    def start_node(self, node_id: str, wait: bool = True, timeout: float = 120.0) -> NodeProc:
        n = self.nodes[node_id]
        with (self.root / f"{node_id}.log").open("a") as log:
            n.proc = subprocess.Popen(
                self.node_argv(n), stdout=subprocess.PIPE, stderr=log, text=True,
                env=self.node_env(n), start_new_session=True, preexec_fn=_die_with_parent)
        if wait:
            self._wait_ready(n, timeout)
        return n

    def _wait_ready(self, n: NodeProc, timeout: float) -> None:
        assert n.proc is not None
        log = self.root / f"{n.spec.node_id}.log"
        msg = wait_node_ready(n.proc, timeout, n.spec.node_id,
                              lambda: f"see {log}; its last lines:\n{log_tail(log)}")
        n.endpoint = msg["endpoint"]
        n.admin = msg.get("admin") or ""
        n.api = msg.get("api") or ""

    def status(self, node_id: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.nodes[node_id].uri.replace("ws://", "http://")
                                    + "/status", timeout=5) as r:
            return dict(json.loads(r.read()))

    def metrics(self, node_id: str) -> str:
        with urllib.request.urlopen(self.nodes[node_id].uri.replace("ws://", "http://")
                                    + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    def wait_covered(self, node_id: str, timeout: float = 60.0, shards: int | None = None
                     ) -> dict[str, Any]:
        """Wait until `node_id` sees the model fully covered (and `shards` live ones)."""
        want = shards if shards is not None else sum(
            len(n.spec.shards) + len(n.spec.model_shards) for n in self.nodes.values())
        deadline = time.monotonic() + timeout
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                st = self.status(node_id)
                m = next((m for m in st["models"] if m["alias"] == self.model), None)
                if m and m["fully_covered"] and len(st["shards"]) >= want:
                    return st
            except OSError:
                pass
            time.sleep(0.2)
        raise HearthNetError(f"model {self.model} not covered as seen from {node_id} "
                             f"within {timeout:.0f} s: {st.get('models')}")

    def decode_steps(self) -> dict[str, str]:
        """{shard id: what its decode steps run as}, from each shard's own node (M26 §5.7)."""
        states: dict[str, str] = {}
        for node_id in self.nodes:
            try:
                shards = self.status(node_id)["shards"]
            except OSError:
                shards = []
            states.update({s["shard_id"]: s["decode_step"] for s in shards
                           if s.get("decode_step")})
        return states

    def head_steps(self) -> dict[str, dict[str, str] | None]:
        """{"alias@node": what that node's head of the model runs its steps as (M26 §5.7),
        None until the node loaded it} for every node that sees the model covered and
        holds its head."""
        heads: dict[str, dict[str, str] | None] = {}
        for node_id in self.nodes:
            try:
                models = self.status(node_id)["models"]
            except OSError:
                models = []
            heads.update({f"{m['alias']}@{node_id}": m.get("head_step") for m in models
                          if m["alias"] == self.model and m["fully_covered"]
                          and m.get("holds_head", True)})
        return heads

    def wait_decode_steps(self, timeout: float = 600.0, head_load_s: float = 30.0
                          ) -> dict[str, str]:
        """Wait until no node's shard is still compiling its decode step and no node's head
        its steps (a benchmark measures what a warm node runs; a node loads the head of a
        model it sees covered and holds, within `head_load_s` of the wait's start or not
        at all, as one whose head failed to load); `decode_steps`."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            states = self.decode_steps()
            heads = self.head_steps()
            compiling = [v for v in [*states.values(), *(s for h in heads.values() if h
                                                         for s in h.values())]
                         if v == "compiling" or ": compiling" in v]
            loading = None in heads.values() and time.monotonic() < start + head_load_s
            if not compiling and not loading:
                return states
            if time.monotonic() > deadline:
                raise HearthNetError(f"decode steps still compiling after {timeout:.0f} s: "
                                     f"{states}; heads: {heads}")
            time.sleep(0.5)

    def kill(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        """Kill a node's whole process group (a host dying)."""
        p = self.nodes[node_id].proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, sig)
            p.wait(timeout=30)

    def stop(self) -> None:
        for n in self.nodes.values():
            if n.proc is not None and n.proc.poll() is None:
                os.killpg(n.proc.pid, signal.SIGTERM)
        for n in self.nodes.values():
            if n.proc is not None:
                try:
                    n.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(n.proc.pid, signal.SIGKILL)
                    n.proc.wait()
                if n.proc.stdout:
                    n.proc.stdout.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_text(self, node_id: str) -> str:
        return (self.root / f"{node_id}.log").read_text()
