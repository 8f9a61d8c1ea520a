"""A benchmark's models folder: only the benchmarked model, and, where asked, the store's
own compiled steps, so a mesh that waits for warm steps loads them instead of compiling
every step again in a folder deleted with the run."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hearthnet.bench import single_model_dir
from hearthnet.distributed_inference.engine.compiled import compile_dir_of


def _entry(store: Path, alias: str = "m") -> SimpleNamespace:
    path = store / alias
    path.mkdir(parents=True)
    return SimpleNamespace(alias=alias, path=path)


def test_the_store_compiled_steps_are_shared_when_asked(tmp_path: Path):
    store = tmp_path / "store" / "models"
    e = _entry(store)
    d = single_model_dir(e, tmp_path / "run", share_compiled=True)
    assert sorted(p.name for p in d.iterdir()) == [".compiled", "m"]
    assert (d / "m").resolve() == e.path.resolve()
    # a node of the run finds its steps where a node of the store does, and what it
    # saves there outlives the run's folder
    seen_by_node = compile_dir_of(SimpleNamespace(path=d / "m"))
    (seen_by_node / "decode-k.bin").write_bytes(b"step")
    assert (store / ".compiled" / "decode-k.bin").read_bytes() == b"step"
    assert single_model_dir(e, tmp_path / "run", share_compiled=True) == d  # again: no error


def test_without_sharing_the_run_compiles_into_its_own_folder(tmp_path: Path):
    e = _entry(tmp_path / "store" / "models")
    d = single_model_dir([e], tmp_path / "run")
    assert [p.name for p in d.iterdir()] == ["m"]
    assert not (tmp_path / "store" / "models" / ".compiled").exists()


def test_a_store_whose_folder_cannot_be_made_leaves_the_run_its_own(tmp_path: Path):
    store = tmp_path / "store" / "models"
    e = _entry(store)
    (store / ".compiled").write_text("not a folder")  # as a read-only store would refuse
    d = single_model_dir(e, tmp_path / "run", share_compiled=True)
    assert [p.name for p in d.iterdir()] == ["m"]
