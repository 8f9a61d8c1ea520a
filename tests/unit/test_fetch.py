"""Weights from the mesh, in one process: planning, the serving limits, a fetch from several
holders with verification, a tampered holder, a dead holder and a resumed fetch
(node/fetch.py; DESIGN.md decision 17). The calls go straight to each holder's
`WeightsService` (the bus and its TLS are tested with real nodes in
tests/integration/test_fetch_mesh.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from hearthnet.errors import BadRequest, ConnectionLost, HearthNetError, ShardUnavailable
from hearthnet.frames import ErrorFrame
from hearthnet.mesh.eventlog import EventLog
from hearthnet.models import ModelStore
from hearthnet.models.hashing import read_safetensors_header
from hearthnet.models.importer import import_folder
from hearthnet.models.store import ModelEntry, select_tensors
from hearthnet.node.fetch import (
    DATA,
    HELD,
    MANIFEST_CAPABILITY,
    MAX_READ_BYTES,
    STALE_STAGING_S,
    STATE,
    FetchPlan,
    HeldModels,
    WeightsFetcher,
    WeightsService,
    held_payload,
    remove_stale_staging,
)
from tests.helpers.tiny_models import make_tiny_model


def test_plan_splits_among_holders_by_what_each_holds() -> None:
    names = [f"t{i}" for i in range(6)]
    plan = FetchPlan(names, {"a": lambda n: True, "b": lambda n: n in ("t3", "t4", "t5")})
    assert plan.take("b") == ["t3"]
    assert plan.take("a") == ["t0"]
    assert plan.take("b") == ["t4"]  # never one a holder lacks, never one in hand elsewhere
    sizes = dict.fromkeys(names, 1 << 20)
    assert plan.take("a", sizes, budget=2 << 20) == ["t1", "t2"]  # small ones share a call
    plan.finish("t0")
    assert plan.drop("b", "connection_lost") == ["t3", "t4"]  # back in the queue
    assert plan.take("b") == []  # never asked again
    assert plan.take("a", sizes, budget=3 << 20) == ["t3", "t4", "t5"]
    assert plan.orphans() == []
    plan.drop("a", "bad bytes")
    assert plan.orphans() == ["t1", "t2", "t3", "t4", "t5"]


class Holder(WeightsService):
    """A member's service with faults: `tamper` flips the first byte of every range it
    serves, `die_after` reads make it unreachable (as after kill -9)."""

    def __init__(self, store: ModelStore, tamper: bool = False, die_after: int | None = None):
        super().__init__(store)
        self.tamper, self.die_after, self.reads, self.bytes = tamper, die_after, 0, 0

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        data = super().read_range(path, offset, length)
        self.bytes += len(data)
        if self.tamper:
            data = bytes([data[0] ^ 1]) + data[1:]
        return data


class Mesh:
    """Holders by node id and the held events of a shared event log."""

    def __init__(self, tmp: Path, holders: dict[str, Holder]) -> None:
        self.holders = holders
        self.held = HeldModels()
        for nid, h in holders.items():
            log = EventLog(tmp / f"{nid}.db", nid)
            e = h.store.entries()[0]
            self.held.apply(log.append(HELD, held_payload(e, f"wss://{nid}:1")))

    async def call(self, node: str, capability: str, args: dict[str, Any]
                   ) -> AsyncIterator[dict[str, Any]]:
        h = self.holders[node]
        if h.die_after is not None and h.reads >= h.die_after:
            raise ConnectionLost(f"cannot reach {node}")
        if capability != MANIFEST_CAPABILITY:
            h.reads += 1
        handler = h.manifest if capability == MANIFEST_CAPABILITY else h.read
        try:
            async for f in handler(args):
                yield f
        except HearthNetError as e:
            yield ErrorFrame.of(e).to_wire()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2) -> Path:
    src = make_tiny_model("llama", tmp_path_factory.mktemp("src") / "m", smollm2.path,
                          layers=6)
    return src


def _holder_store(tmp: Path, name: str, src: Path) -> ModelStore:
    store = ModelStore(tmp / name)
    import_folder(store, src, alias="tiny")
    return store


def _fetcher(tmp: Path, mesh: Mesh) -> tuple[WeightsFetcher, ModelStore, CollectorRegistry]:
    store, reg = ModelStore(tmp / "me"), CollectorRegistry()
    # small read calls: the tiny model's layers would all fit in one
    return WeightsFetcher(store, mesh.held, mesh.call, node_id="me", registry=reg,
                          batch_bytes=64 << 10, settle_s=0.0), store, reg


def _layer_bytes(e: ModelEntry, lo: int, hi: int, head: bool = False) -> int:
    return sum(int(e.tensors[n]["bytes"]) for n in select_tensors(e.tensors, [(lo, hi)], head))


def test_fetch_takes_exactly_the_layers_from_both_holders(tmp_path: Path, tiny: Path) -> None:
    a, b = (Holder(_holder_store(tmp_path, n, tiny)) for n in ("a", "b"))
    mesh = Mesh(tmp_path, {"a": a, "b": b})
    fetcher, store, reg = _fetcher(tmp_path, mesh)
    entry = asyncio.run(fetcher.fetch("tiny", [(2, 4)], head=False))
    full = a.store.get("tiny")
    want = _layer_bytes(full, 2, 4)
    assert entry.partial and entry.held_layers == [(2, 4)] and not entry.holds_head
    assert set(entry.tensor_locations()) == set(select_tensors(full.tensors, [(2, 4)], False))
    assert a.bytes + b.bytes <= 1.1 * want  # only those layers crossed the wire
    assert a.bytes and b.bytes  # both holders served a share
    store.verify("tiny")  # every held tensor matches the table
    st = fetcher.status()[0]
    assert st["state"] == "done" and st["bytes_done"] == st["bytes_total"] == want
    assert sorted(st["sources"]) == ["a", "b"] and st["layers"] == [2, 4]
    assert reg.get_sample_value("hearthnet_weights_fetched_bytes_total",
                                {"peer": "a"}) == a.bytes
    # a second fetch adds the head and layer 5 into the same folder
    entry = asyncio.run(fetcher.fetch("tiny", [(5, 5)], head=True))
    assert entry.held_layers == [(2, 5)] and entry.holds_head
    assert (entry.path / "tokenizer.json").is_file() and (entry.path / "config.json").is_file()
    store.verify("tiny")


def test_a_tampered_holder_is_reported_and_not_asked_again(tmp_path: Path, tiny: Path) -> None:
    good = Holder(_holder_store(tmp_path, "good", tiny))
    bad_store = _holder_store(tmp_path, "bad", tiny)
    bad = Holder(bad_store, tamper=True)
    mesh = Mesh(tmp_path, {"bad": bad, "good": good})
    fetcher, store, reg = _fetcher(tmp_path, mesh)
    entry = asyncio.run(fetcher.fetch("tiny", [(0, 2)], head=False))
    store.verify("tiny")  # the tampered byte never reached the store
    assert reg.get_sample_value("hearthnet_weights_fetch_mismatches_total",
                                {"peer": "bad"}) >= 1
    assert bad.reads >= 1  # it was asked, and caught
    assert fetcher.bad[entry.weights_sha256] == {"bad"}
    served = bad.reads
    asyncio.run(fetcher.fetch("tiny", [(3, 3)], head=False))
    assert bad.reads == served  # not asked again for this model


def test_a_dead_holder_share_goes_to_the_other(tmp_path: Path, tiny: Path) -> None:
    a = Holder(_holder_store(tmp_path, "a", tiny), die_after=2)
    b = Holder(_holder_store(tmp_path, "b", tiny))
    fetcher, store, _ = _fetcher(tmp_path, Mesh(tmp_path, {"a": a, "b": b}))
    entry = asyncio.run(fetcher.fetch("tiny", [(0, 5)], head=True))
    assert entry.held_layers == [(0, 5)] and entry.holds_head
    assert not entry.partial  # the whole model: checked against weights_sha256 as well
    store.verify("tiny")
    assert fetcher.status()[0]["state"] == "done"


def test_an_interrupted_fetch_resumes_with_only_the_missing_tensors(tmp_path: Path,
                                                                    tiny: Path) -> None:
    only = Holder(_holder_store(tmp_path, "a", tiny), die_after=3)
    mesh = Mesh(tmp_path, {"a": only})
    fetcher, store, _ = _fetcher(tmp_path, mesh)
    with pytest.raises(ShardUnavailable, match="run again to resume"):
        asyncio.run(fetcher.fetch("tiny", [(0, 5)], head=False))
    assert fetcher.status()[0]["state"] == "failed"
    stage = next(store.root.glob("tiny.fetch-*"))
    done = json.loads((stage / STATE).read_text())["done"]
    assert done  # some tensors were checked and kept
    # a write lost on the disk (a power cut): that tensor is checked again and re-fetched
    lost = sorted(done)[0]
    header, start = read_safetensors_header(stage / DATA)
    with (stage / DATA).open("r+b") as f:
        f.seek(start + header[lost]["data_offsets"][0])
        f.write(b"\xff\xff")
    first = only.bytes
    only.die_after = None  # the holder is back (or another took its place)
    entry = asyncio.run(fetcher.fetch("tiny", [(0, 5)], head=False))
    full = only.store.get("tiny")
    done_bytes = sum(int(full.tensors[n]["bytes"]) for n in done if n != lost)
    config = (full.path / "config.json").stat().st_size  # fetched once the weights are
    assert only.bytes - first == _layer_bytes(full, 0, 5) - done_bytes + config  # the rest
    assert not stage.exists()
    store.verify(entry.alias)


def test_reads_are_refused_before_any_work(tmp_path: Path, tiny: Path) -> None:
    svc = Holder(_holder_store(tmp_path, "a", tiny))
    sha = svc.store.get("tiny").weights_sha256

    async def read(args: dict[str, Any]) -> list[dict[str, Any]]:
        return [f async for f in svc.read(args)]

    name = "model.layers.0.mlp.up_proj.weight"
    bad = [{"model": "x" * 64, "ranges": [{"tensor": name, "offset": 0, "length": 1}]},
           {"model": sha, "ranges": [{"tensor": name, "offset": 0,
                                      "length": MAX_READ_BYTES + 1}]},
           {"model": sha, "ranges": [{"tensor": name, "offset": -1, "length": 1}]},
           {"model": sha, "ranges": [{"file": "../../etc/passwd", "offset": 0, "length": 1}]},
           {"model": sha, "ranges": [{"tensor": name, "offset": 1 << 30, "length": 1}]},
           {"model": sha, "ranges": []}]
    for args in bad:
        with pytest.raises(BadRequest):
            asyncio.run(read(args))
    assert svc.bytes == 0
    ok = asyncio.run(read({"model": sha, "ranges": [{"tensor": name, "offset": 0,
                                                     "length": 16}]}))
    assert [len(f["data"]) for f in ok] == [16]


def test_a_skeleton_of_a_members_model_costs_what_the_model_costs(tmp_path: Path,
                                                                  tiny: Path) -> None:
    """Automatic hosting places a model a member holds from its manifest alone (module
    autohost: "a member has it like I have it"), with the fetch time in its plan."""
    from hearthnet.distributed_inference.placement.autohost import (
        layer_bytes,
        layer_params,
        missing_bytes,
    )
    from hearthnet.distributed_inference.placement.planner import (
        DEFAULT_FETCH_BYTES_PER_S,
        fetch_seconds,
    )

    a = Holder(_holder_store(tmp_path, "a", tiny))
    fetcher, _, _ = _fetcher(tmp_path, Mesh(tmp_path, {"a": a}))
    skeleton = asyncio.run(fetcher.fetch("tiny", [], head=False))
    full = a.store.get("tiny")
    assert skeleton.partial and skeleton.held_layers == [] and not skeleton.tensor_locations()
    assert layer_params(skeleton) == layer_params(full)
    assert layer_bytes(skeleton, "fp32") == layer_bytes(full, "fp32")
    assert missing_bytes(skeleton, 1, 2) == _layer_bytes(full, 1, 2)
    assert missing_bytes(full, 1, 2) == 0
    assert fetch_seconds(int(DEFAULT_FETCH_BYTES_PER_S) * 2) == 2.0
    assert fetch_seconds(10_000_000, 5e6) == 2.0


def test_model_bytes_go_to_authenticated_members_only() -> None:
    from types import SimpleNamespace

    from hearthnet.errors import AuthError
    from hearthnet.node.daemon import Node
    from hearthnet.node.fetch import READ_CAPABILITY

    asked: list[tuple[str, str | None]] = []
    node = SimpleNamespace(metrics=None, guard=SimpleNamespace(
        authorize_bus=lambda cap, caller: asked.append((cap, caller))))
    with pytest.raises(AuthError, match="mutual TLS"):  # a plaintext listener's caller
        Node._authorize_bus(node, READ_CAPABILITY, None)  # type: ignore[arg-type]
    assert asked == []  # refused before anything else
    Node._authorize_bus(node, READ_CAPABILITY, "node-b")  # type: ignore[arg-type]
    assert asked == [(READ_CAPABILITY, "node-b")]  # a member: the guard's trust rules


def test_status_prints_each_fetch() -> None:
    from hearthnet.commands.status import render_fetches

    st = {"fetches": [
        {"model": "smollm2", "layers": [10, 19], "head": False, "bytes_done": 35_400_960,
         "bytes_total": 70_801_920, "sources": ["node-a", "node-c"], "state": "fetching",
         "detail": ""},
        {"model": "qwen", "layers": None, "head": True, "bytes_done": 0, "bytes_total": 9,
         "sources": [], "state": "failed", "detail": "no member holds model 'qwen'"}]}
    assert render_fetches(st) == [
        "",
        "fetch smollm2 layers 10-19: fetching 50 % (35.4 of 70.8 MB) from node-a, node-c",
        "fetch qwen head: failed 0 % (0.0 of 0.0 MB) from -  no member holds model 'qwen'"]
    assert render_fetches({}) == []


def test_holders_that_disagree_on_the_table_stop_the_fetch(tmp_path: Path, tiny: Path) -> None:
    from hearthnet.errors import PeerDataError

    class Liar(Holder):
        async def manifest(self, args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
            async for f in super().manifest(args):
                name = next(iter(f["manifest"]["tensors"]))
                f["manifest"]["tensors"][name]["sha256"] = "0" * 64  # its own bytes' hash
                yield f

    a = Holder(_holder_store(tmp_path, "a", tiny))
    liar = Liar(_holder_store(tmp_path, "liar", tiny))
    fetcher, store, _ = _fetcher(tmp_path, Mesh(tmp_path, {"a": a, "liar": liar}))
    with pytest.raises(PeerDataError, match="a and liar give different tensors tables"):
        asyncio.run(fetcher.fetch("tiny", [(0, 1)], head=False))
    assert a.bytes == liar.bytes == 0  # before any byte
    assert store.find("tiny") is None


def test_a_node_says_what_it_holds_as_its_store_changes(tmp_path: Path, tiny: Path) -> None:
    from types import SimpleNamespace

    from hearthnet.node.daemon import Node

    store = _holder_store(tmp_path, "mine", tiny)
    log = EventLog(tmp_path / "me.db", "me")
    node: Any = SimpleNamespace(cfg=SimpleNamespace(research=SimpleNamespace(enable=True)),
                                models=store, log=log, endpoint="wss://127.0.0.1:1",
                                _held_said={})
    node._announce_held = lambda e=None: Node._announce_held(node, e)

    def holders() -> list[str]:
        held = HeldModels()
        held.rebuild(log.all_events())
        return [h.node_id for h in held.holders("tiny")]

    Node._announce_held_changes(node)
    assert holders() == ["me"]
    n = len(log.all_events())
    Node._announce_held_changes(node)
    assert len(log.all_events()) == n  # nothing changed: nothing said
    store.remove("tiny")
    Node._announce_held_changes(node)
    assert holders() == []  # gone: members stop asking


def test_an_abandoned_fetch_is_removed_after_a_week_and_a_recent_one_kept(
        tmp_path: Path, tiny: Path) -> None:
    only = Holder(_holder_store(tmp_path, "a", tiny), die_after=3)
    fetcher, store, _ = _fetcher(tmp_path, Mesh(tmp_path, {"a": only}))
    with pytest.raises(ShardUnavailable):
        asyncio.run(fetcher.fetch("tiny", [(0, 5)], head=False))
    stage = next(store.root.glob("tiny.fetch-*"))
    touched = max(f.stat().st_mtime for f in [stage, *stage.iterdir()])
    other = store.root / "tiny.importing"  # an import under way is not a fetch's
    other.mkdir()
    assert remove_stale_staging(store.root, touched + STALE_STAGING_S - 1) == []
    assert stage.exists()
    assert remove_stale_staging(store.root, touched + STALE_STAGING_S + 1) == [stage.name]
    assert not stage.exists() and other.exists()
