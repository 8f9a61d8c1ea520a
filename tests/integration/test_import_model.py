"""Compact store (issue 12 §1) with the real SmolLM2: its GGUF converted to bf16 tensor by
tensor, folders at their own precision, resumable imports."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from hearthnet.models import ModelStore, importer, writer
from hearthnet.models.importer import import_folder, import_gguf, smollm2_gguf_path
from hearthnet.models.synth import write_synthetic
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.tiny_models import TINY_QWEN2 as TINY


def _reuse_gguf_parsing(monkeypatch) -> None:
    """transformers' GGUF loader parses the file twice (config, then weights: 49k tokenizer
    strings each time) and rebuilds gguf's tensor-name map for each of its 272 tensors —
    over half of its 30 s here. Each result is reused; the conversion itself is untouched."""
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


# 40 s of transformers' own conversion of the real SmolLM2 GGUF: in `make bench`. `make test`
# checks the same import against transformers' load of a GGUF for every family on tiny
# models (test_gguf_import.py) and the kept Q4 blocks on SmolLM2 (test_gguf_blocks.py)
@IN_MAKE_BENCH
def test_gguf_imports_to_bf16_tensor_by_tensor_as_transformers_converts(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hearthnet.models import gguf as gguf_mod

    gguf = smollm2_gguf_path()
    store = ModelStore(tmp_path)
    seen: list[int] = []
    builds: list[Path] = []
    real_init = gguf_mod.GgufPlan.__init__

    def counted(self, path, *a, **kw):
        builds.append(path)
        real_init(self, path, *a, **kw)

    monkeypatch.setattr(gguf_mod.GgufPlan, "__init__", counted)
    importer._gguf_plan.cache_clear()
    # what `models import --dtype bf16` shows as the bar's total (the default keeps blocks)
    total = importer.gguf_plan_bytes(gguf, "bf16")
    e = import_gguf(store, gguf, alias="s", dtype="bf16", progress=seen.append)
    assert builds == [gguf]  # the GGUF's metadata was read and mapped once, not per step
    assert e.dtype == "bfloat16" and e.num_layers == 30 and not e.synthetic
    f = e.path / "model.safetensors"
    header = int.from_bytes(f.read_bytes()[:8], "little")
    assert sum(seen) == f.stat().st_size - 8 - header == total  # every tensor byte, once
    ours = load_file(str(e.path / "model.safetensors"))
    assert {v.dtype for v in ours.values()} == {torch.bfloat16}
    _reuse_gguf_parsing(monkeypatch)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32).state_dict()
    for k, v in ours.items():  # the same values transformers' whole-model conversion gives
        assert torch.equal(v, ref[k].to(torch.bfloat16)), k
    # the folder loads with plain transformers, at its stored precision
    assert AutoModelForCausalLM.from_pretrained(str(e.path)).dtype == torch.bfloat16


def test_folder_keeps_its_precision_and_an_interrupted_import_resumes(tmp_path, smollm2,
                                                                      monkeypatch):
    calls = {"n": 0}
    real = writer.SafetensorsWriter.write

    def count(self, name, part):
        calls["n"] += 1
        return real(self, name, part)

    monkeypatch.setattr(writer.SafetensorsWriter, "write", count)
    src = write_synthetic(ModelStore(tmp_path / "src"), "tiny", TINY, model_id="t", seed=3,
                          tokenizer_from=smollm2.path, source="test", max_file_bytes=2 << 20)
    store = ModelStore(tmp_path / "dst")
    copied: list[int] = []
    e = import_folder(store, src.path, alias="t", progress=copied.append)
    assert e.dtype == "bfloat16" and e.weights_sha256 == src.weights_sha256  # no up-cast
    assert sum(copied) == sum(int(f["size"]) for f in src.files.values())

    # an interrupted synth leaves only a hidden staging folder, then resumes from it
    full, calls["n"] = calls["n"], 0

    def dying(self, name, part):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return real(self, name, part)

    store2 = ModelStore(tmp_path / "again")
    monkeypatch.setattr(writer.SafetensorsWriter, "write", dying)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic(store2, "tiny", TINY, model_id="t", seed=3,
                        tokenizer_from=smollm2.path, source="test", max_file_bytes=2 << 20)
    assert store2.entries() == [] and (store2.root / "tiny.importing").is_dir()
    kept = sorted(p.name for p in (store2.root / "tiny.importing").glob("*.safetensors"))
    assert kept  # complete files survived the interruption
    monkeypatch.setattr(writer.SafetensorsWriter, "write", count)
    calls["n"] = 0
    again = write_synthetic(store2, "tiny", TINY, model_id="t", seed=3,
                            tokenizer_from=smollm2.path, source="test", max_file_bytes=2 << 20)
    assert again.weights_sha256 == src.weights_sha256  # same model as uninterrupted
    assert calls["n"] < full  # the kept files were not generated again
    assert not (store2.root / "tiny.importing").exists()
