"""The model store's per-tensor hashes (every import path) and partial models.

A tensor's hash is its record under `weights_sha256`'s definition (models/hashing.py), so
the table written at import must equal the one read back from the files; a store written
before the table existed gets it computed once; a partial folder loads the layers it holds
and refuses, typed, the ones it lacks (DESIGN.md decision 17).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from hearthnet.errors import ModelNotFound
from hearthnet.models import ModelStore
from hearthnet.models.hashing import tensor_prefix, tensor_table, weights_sha256
from hearthnet.models.importer import import_folder, import_gguf
from hearthnet.models.store import MANIFEST, ModelEntry, select_tensors
from hearthnet.models.synth import write_synthetic
from hearthnet.node.fetch import safetensors_header
from tests.helpers.tiny_gguf import GGUF_VOCAB, write_tiny_gguf
from tests.helpers.tiny_models import TINY_QWEN2, make_tiny_model


def _check_table(entry: ModelEntry) -> None:
    """The manifest's table is the files' own, every record hashes as documented."""
    table = tensor_table(entry.path)
    assert entry.tensors == table
    assert entry.weights_sha256 == weights_sha256(entry.path)  # unchanged definition
    name, rec = next(iter(table.items()))
    fname, at, n = entry.tensor_locations()[name]
    raw = (entry.path / fname).read_bytes()[at:at + n]
    assert rec["sha256"] == hashlib.sha256(
        tensor_prefix(name, rec["dtype"], rec["shape"]) + raw).hexdigest()
    assert rec["bytes"] == n


def test_synth_import_writes_per_tensor_hashes_across_files(tmp_path: Path, smollm2) -> None:
    store = ModelStore(tmp_path / "store")
    e = write_synthetic(store, "tq", TINY_QWEN2, model_id="t/q", seed=1,
                        tokenizer_from=smollm2.path, source="test", max_file_bytes=2 << 20)
    assert len(e.files) > 1 and {r["file"] for r in e.tensors.values()} == set(e.files)
    _check_table(e)
    assert json.loads((e.path / MANIFEST).read_text())["tensors"] == e.tensors


def test_folder_import_writes_per_tensor_hashes(tmp_path: Path, smollm2) -> None:
    src = make_tiny_model("llama", tmp_path / "src", smollm2.path, layers=3)
    e = import_folder(ModelStore(tmp_path / "store"), src, alias="tl")
    assert len(e.tensors) == len(tensor_table(src))
    _check_table(e)


def test_gguf_import_keeping_blocks_hashes_them_with_their_type(tmp_path: Path, smollm2) -> None:
    src = make_tiny_model("llama", tmp_path / "src", smollm2.path, layers=2,
                          vocab_size=GGUF_VOCAB)
    gguf = write_tiny_gguf("llama", src, tmp_path / "t.gguf", quant="Q4_0")
    store = ModelStore(tmp_path / "store")
    e = import_gguf(store, gguf, alias="tg", dtype="gguf")
    blocks = {n: r for n, r in e.tensors.items() if r["dtype"].startswith("U8:")}
    assert blocks and all(r["dtype"] == "U8:Q4_0" and r["logical_shape"]
                          for r in blocks.values())
    _check_table(e)
    # a partial copy of its layer 1 still holds them as int4 blocks (lossless)
    assert e.q4_blocks and _partial(store, e, [(1, 1)], head=False).q4_blocks


def test_an_old_store_gets_its_table_once_written_back(tmp_path: Path, smollm2) -> None:
    src = make_tiny_model("llama", tmp_path / "src", smollm2.path, layers=2)
    store = ModelStore(tmp_path / "store")
    e = import_folder(store, src, alias="old")
    data = json.loads((e.path / MANIFEST).read_text())
    want = data.pop("tensors")
    (e.path / MANIFEST).write_text(json.dumps(data))  # as written before the table
    old = store.get("old")
    assert old.tensors == {}
    new = store.ensure_tensors(old)
    assert new.tensors == want
    assert store.get("old").tensors == want  # persisted: computed once


def _partial(store: ModelStore, full: ModelEntry, layers: list[tuple[int, int]],
             head: bool) -> ModelEntry:
    """A partial folder of `full` holding `layers` (and the head), as a fetch writes it."""
    names = select_tensors(full.tensors, layers, head)
    folder = store.root / "part"
    folder.mkdir()
    header, _ = safetensors_header(full.tensors, names)
    with (folder / "fetched.safetensors").open("wb") as out:
        out.write(header)
        for n in names:
            fname, at, size = full.tensor_locations()[n]
            with (full.path / fname).open("rb") as f:
                f.seek(at)
                out.write(f.read(size))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (full.path / f).is_file():
            shutil.copy(full.path / f, folder / f)
    manifest = json.loads((full.path / MANIFEST).read_text())
    manifest["alias"] = "part"
    return store.write_partial(folder, manifest, {"layers": layers, "head": head})


def test_a_partial_model_loads_its_layers_and_refuses_others(tmp_path: Path, smollm2,
                                                             capsys) -> None:
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    src = make_tiny_model("llama", tmp_path / "src", smollm2.path, layers=4)
    store = ModelStore(tmp_path / "store")
    full = import_folder(store, src, alias="full")
    part = _partial(store, full, [(1, 2)], head=False)
    assert part.partial and part.held_layers == [(1, 2)] and not part.holds_head
    assert part.weights_sha256 == full.weights_sha256 and part.tensors == full.tensors
    assert set(part.tensor_locations()) == set(select_tensors(full.tensors, [(1, 2)], False))
    store.verify("part")  # its tensors match the whole model's table
    with pytest.raises(ModelNotFound, match=r"lacks layers 0\.\.0"):
        part.require_layers(0, 2)
    with pytest.raises(ModelNotFound, match="without the head"):
        part.require_head()
    with pytest.raises(ModelNotFound, match=r"layers 3\.\.3"):
        LayeredStack(part, 2, 3)  # the engine refuses it too, before reading weights
    from hearthnet.cli import main

    assert main(["models", "--models-dir", str(store.root), "list"]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("part ")]
    assert line.endswith(f"partial: layers 1-2  {part.path}")  # no "+ head"
    x = torch.randn(1, 5, 64)
    a = LayeredStack(part, 1, 2).open_session(1, 2, 8).forward(x, 0)
    b = LayeredStack(full, 0, 3).open_session(1, 2, 8).forward(x, 0)
    assert torch.equal(a, b)  # the same layers, the same bytes


def test_selection_takes_exactly_a_range_and_the_head() -> None:
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
             *(f"model.layers.{i}.{t}" for i in range(12) for t in ("a.weight", "b.weight"))]
    got = select_tensors(names, [(2, 3), (10, 10)], head=False)
    assert got == sorted(f"model.layers.{i}.{t}" for i in (2, 3, 10)
                         for t in ("a.weight", "b.weight"))
    head = select_tensors(names, [], head=True)
    assert head == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
