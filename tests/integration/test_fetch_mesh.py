"""Weights from the mesh with real node processes on 127.0.0.1 (DESIGN.md decision 17).

node-a holds SmolLM2 and hosts layers 0-9 and 13-29; node-b holds nothing and is
configured to host layers 10-12: it fetches exactly those layers' tensors over the
members' mutual-TLS links, checks them, keeps them as a partial model and hosts them, and
a chat through node-a and node-b answers the local engine's tokens. node-t holds a copy
whose layer bytes were altered but whose manifest still claims the true hashes: its
bytes are caught before use, it is reported and not asked again. A non-member gets
nothing. The `kill -9` of a holder mid-fetch (`make bench`) ends with the same bytes
fetched from the other holder.

Run as ``python -m tests.integration.test_fetch_mesh --config F [--delay S]`` this module
is a test node: the production daemon whose weight reads take `S` seconds each, so a kill
lands mid-fetch without a race (a fault from the outside: nothing in hearthnet/ knows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hearthnet.distributed_inference.engine.sampling import SamplingParams
from hearthnet.errors import AuthError, ConnectionLost
from hearthnet.mesh.bus import bus_call
from hearthnet.mesh.launcher import NodeProc, NodeSpec
from hearthnet.models import ModelStore
from hearthnet.models.hashing import file_sha256
from hearthnet.models.store import MANIFEST, select_tensors
from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args
from hearthnet.node.fetch import READ_CAPABILITY
from hearthnet.security import NodeKey, client_context
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.mesh import TestMesh
from tests.helpers.waiting import wait_for

LAYERS = (10, 12)  # node-b's range: 3 layers, 21 MB in bf16
KILL_LAYERS = (10, 19)  # 71 MB: long enough to kill a holder mid-fetch
PROMPT = "What is the capital of France?"
N = 12


class FetchMesh(TestMesh):
    """A `TestMesh` whose nodes are this module's test node, each with its own store."""

    def __init__(self, specs: list[NodeSpec], *, stores: dict[str, Path],
                 delays: dict[str, float] | None = None, **kw: Any) -> None:
        super().__init__(specs, **kw)
        self.delays = delays or {}
        for nid, store in stores.items():  # every node its own store (default: the suite's)
            cfg = self.nodes[nid].config
            line = f"models_dir = {json.dumps(str(store))}"
            cfg.write_text(re.sub(r"(?m)^models_dir = .*$", lambda _, x=line: x,
                                  cfg.read_text()))

    def node_argv(self, n: NodeProc) -> list[str]:
        return [sys.executable, "-m", "tests.integration.test_fetch_mesh", "--config",
                str(n.config), "--delay", str(self.delays.get(n.spec.node_id, 0.0))]


def _chat_tokens(uri: str) -> list[int]:
    async def run() -> list[dict[str, Any]]:
        args = chat_args(PROMPT, "smollm2", SamplingParams(max_tokens=N), wire_dtype="fp32")
        return [f async for f in bus_call(uri, CHAT_CAPABILITY, args)]

    frames = asyncio.run(run())
    assert frames[-1]["type"] == "done", frames[-1]
    return [f["token_id"] for f in frames if f["type"] == "token_delta"]


def _fetched(mesh: TestMesh, node: str) -> dict[str, float]:
    """hearthnet_weights_fetched_bytes_total by peer, from `node`'s /metrics."""
    out = {}
    for m in re.finditer(r'^hearthnet_weights_fetched_bytes_total\{peer="([^"]+)"\} (\S+)$',
                         mesh.metrics(node), re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def _layer_bytes(table: dict[str, Any]) -> int:
    return sum(int(table[n]["bytes"]) for n in select_tensors(table, [LAYERS], False))


@pytest.fixture(scope="module")
def source(smollm2) -> Any:
    """The suite's SmolLM2 with its tensors table (computed once, as a serving node does)."""
    return ModelStore(smollm2.path.parent).ensure_tensors(smollm2)


def _tampered_store(root: Path, src: Any) -> Path:
    """A copy of `src` with one byte of every tensor of `LAYERS` flipped, whose manifest
    still claims the true per-tensor hashes (its file record matches the changed file,
    so the node serves it without noticing)."""
    store = root / "tampered"
    shutil.copytree(src.path, store / src.alias)
    folder = store / src.alias
    weights = folder / "model.safetensors"
    locs = src.tensor_locations()
    with weights.open("r+b") as f:
        for name in select_tensors(src.tensors, [LAYERS], False):
            _, at, _ = locs[name]
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x40]))
    manifest = json.loads((folder / MANIFEST).read_text())
    st = weights.stat()
    manifest["files"]["model.safetensors"] = {"sha256": file_sha256(weights),
                                              "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return store


@pytest.mark.parametrize("tampered", [False, pytest.param(True, marks=IN_MAKE_BENCH)])
def test_a_node_fetches_only_its_layers_and_serves_them(tmp_path: Path, source: Any,
                                                        local_answer, tampered: bool) -> None:
    """`tampered` (make bench: a third node): node-t serves altered bytes beside node-a."""
    stores = {"node-b": tmp_path / "b-models"}
    specs = [NodeSpec("node-a", [(0, LAYERS[0] - 1), (LAYERS[1] + 1, 29)]),
             NodeSpec("node-b", [LAYERS])]
    if tampered:
        stores["node-t"] = _tampered_store(tmp_path, source)
        specs.insert(1, NodeSpec("node-t"))
    mesh = FetchMesh(specs, stores=stores)
    try:
        _start_holders_then_b(mesh, ["node-t"] if tampered else [])
        mesh.wait_covered("node-a", timeout=180)
        a = mesh.nodes["node-a"]
        tokens = _chat_tokens(a.uri)
        assert tokens == local_answer(PROMPT, N)  # a chat through node-b's fetched layers
        st_b = mesh.status("node-b")
        assert any(s["host"] == "node-b" and s["layers"] == list(LAYERS)
                   for s in st_b["shards"])
        [fetch] = st_b["fetches"]
        want = _layer_bytes(source.tensors)
        assert fetch["state"] == "done" and fetch["layers"] == list(LAYERS)
        assert fetch["bytes_total"] == want and not fetch["head"]
        fetched = _fetched(mesh, "node-b")
        assert sum(fetched.values()) <= 1.1 * want, fetched  # only those layers
        part = ModelStore(stores["node-b"]).get("smollm2")
        assert part.partial and part.held_layers == [LAYERS] and not part.holds_head
        assert set(part.tensor_locations()) == set(select_tensors(source.tensors, [LAYERS],
                                                                  False))
        ModelStore(stores["node-b"]).verify("smollm2")  # exactly the true bytes
        assert fetch["sources"] == ["node-a"]
        if tampered:
            _tampered_holder_was_caught(mesh)
        # node-b now holds those layers and says so: another node could fetch from it
        assert any(h["node"] == "node-b" and h["layers"] == [list(LAYERS)]
                   for h in mesh.status("node-a")["held"])
        # and `hearthnet models list --config` shows what each node holds
        out = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "list",
                              "--config", str(a.config)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        lo, hi = LAYERS
        assert re.search(rf"smollm2\s+node-b\s+layers {lo}-{hi}\n", out), out
        assert re.search(r"smollm2\s+node-a\s+layers 0-29 \+ head", out), out
        _non_member_gets_nothing(mesh, a)
        assert _chat_tokens(a.uri) == tokens  # node-a still serves
    finally:
        mesh.stop()


def _start_holders_then_b(mesh: FetchMesh, others: list[str]) -> None:
    """node-a and the `others` holders, then node-b once node-a has heard what each holds
    (node-b then hears every holder in one catch-up from node-a)."""
    mesh.start_node("node-a")
    for nid in others:
        mesh.start_node(nid)
        wait_for(lambda n=nid: any(h["node"] == n for h in mesh.status("node-a")["held"]),
                 f"node-a hears what {nid} holds", timeout=60)
    mesh.start_node("node-b")


def _tampered_holder_was_caught(mesh: TestMesh) -> None:
    """node-t was asked at once (every holder is); every tensor it served failed its check
    and none was kept (node-b's store verified); it is named in the log and the metric."""
    assert re.search(r'hearthnet_weights_fetch_mismatches_total\{peer="node-t"\} [1-9]',
                     mesh.metrics("node-b"))
    assert re.search(r'"peer": "node-t"[^\n]*weights_fetch_mismatch|'
                     r'weights_fetch_mismatch[^\n]*"peer": "node-t"', mesh.log_text("node-b"))


def _non_member_gets_nothing(mesh: TestMesh, a: NodeProc) -> None:
    stranger = NodeKey.generate()
    ctx = client_context(stranger, "node-x", mesh.directory("node-a"), expect="node-a")
    args = {"model": "0" * 64, "ranges": [{"tensor": "x", "offset": 0, "length": 1}]}

    async def call() -> list[dict[str, Any]]:
        return [f async for f in bus_call(a.listen_uri, READ_CAPABILITY, args, ssl=ctx)]

    # refused in the TLS handshake, before any HTTP: no frame, no byte (an unauthenticated
    # caller of a plaintext listener gets `AuthError`: tests/unit/test_fetch.py)
    got: list[dict[str, Any]] = []
    with pytest.raises((AuthError, ConnectionLost)):
        got = asyncio.run(call())
    assert got == []


@IN_MAKE_BENCH
def test_a_holder_killed_mid_fetch_is_replaced_by_the_other(tmp_path: Path, source: Any,
                                                            local_answer) -> None:
    # node-c holds the same model (hard links: same bytes, no copy); both serve slowly
    c_store = tmp_path / "c-models"
    (c_store / source.alias).mkdir(parents=True)
    for f in source.path.iterdir():
        if f.is_file():
            os.link(f, c_store / source.alias / f.name)
    stores = {"node-b": tmp_path / "b-models", "node-c": c_store}
    specs = [NodeSpec("node-a", [(0, KILL_LAYERS[0] - 1), (KILL_LAYERS[1] + 1, 29)]),
             NodeSpec("node-c"), NodeSpec("node-b", [KILL_LAYERS])]
    mesh = FetchMesh(specs, stores=stores, delays={"node-a": 1.0, "node-c": 1.0})
    try:
        _start_holders_then_b(mesh, ["node-c"])

        def both_serving() -> bool:
            f = mesh.status("node-b")["fetches"]
            return bool(f) and sorted(f[0]["sources"]) == ["node-a", "node-c"] \
                and f[0]["bytes_done"] < f[0]["bytes_total"] // 2
        wait_for(both_serving, "node-b fetching from node-a and node-c", timeout=120)
        mesh.kill("node-c", signal.SIGKILL)
        mesh.wait_covered("node-a", timeout=180)
        [fetch] = mesh.status("node-b")["fetches"]
        assert fetch["state"] == "done"
        ModelStore(stores["node-b"]).verify("smollm2")  # the same bytes
        assert "weights_fetch_holder_lost" in mesh.log_text("node-b")
        assert _chat_tokens(mesh.nodes["node-a"].uri) == local_answer(PROMPT, N)
    finally:
        mesh.stop()


@IN_MAKE_BENCH
def test_automatic_hosting_places_a_model_only_a_member_holds(tmp_path: Path, source: Any,
                                                              local_answer) -> None:
    """`shards = "auto"` on a node whose store lacks the served model: "a member has it"
    counts like "I have it" — it places a window, fetches it (the estimate in its
    decision), hosts it, and a chat through it answers the local engine's tokens."""
    auto = {"speed": 100.0, "memory_mb": 450}
    specs = [NodeSpec(n, auto=auto, trust="steward" if n == "node-s" else "trusted",
                      extra_di={"allow_self_as_shard": True}) for n in ("node-s", "node-b")]
    mesh = FetchMesh(specs, stores={"node-b": tmp_path / "b-models"})
    try:
        mesh.start_node("node-s")
        mesh.start_node("node-b")
        r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "serve",
                            "smollm2", "--config", str(mesh.nodes["node-s"].config)],
                           text=True, capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ranges = wait_for(lambda: [s["layers"] for s in mesh.status("node-s")["shards"]
                                   if s["host"] == "node-b"] or None,
                          "node-b hosts a range",
                          timeout=240)
        lo, hi = ranges[0]
        fetches = mesh.status("node-b")["fetches"]
        assert any(f["layers"] == [lo, hi] and f["state"] == "done" for f in fetches)
        part = ModelStore(tmp_path / "b-models").get("smollm2")
        assert part.partial and part.held_layers == [(lo, hi)]
        assert re.search(r'"autohost_decision".*fetches \d+ MB from members first|'
                         r'fetches \d+ MB from members first.*"autohost_decision"',
                         mesh.log_text("node-b"))
        assert _chat_tokens(mesh.nodes["node-s"].uri) == local_answer(PROMPT, N)
    finally:
        mesh.stop()


def main(argv: list[str] | None = None) -> None:
    """The test node (module docstring)."""
    from hearthnet.commands.node import run_node
    from hearthnet.config import load_config
    from hearthnet.node.daemon import Node
    from hearthnet.observability import configure_logging

    ap = argparse.ArgumentParser(prog="python -m tests.integration.test_fetch_mesh")
    ap.add_argument("--config", required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    configure_logging(cfg.node.log_level, node=cfg.node.id)

    class SlowServing(Node):
        def _build_directory(self) -> None:
            super()._build_directory()
            read = self.weights.read_range

            def slow(path: Path, offset: int, length: int) -> bytes:
                time.sleep(args.delay)  # a worker thread: the node stays responsive
                return read(path, offset, length)

            if args.delay:
                self.weights.read_range = slow  # type: ignore[method-assign]

    run_node(SlowServing(cfg))


if __name__ == "__main__":
    main()
