"""Model store with the real SmolLM2: import, manifest, list/verify and bad weights
(issue 2 item 2)."""

from __future__ import annotations

import json
import os

import pytest

from hearthnet.errors import BadRequest, ModelNotFound, WeightsMismatch
from hearthnet.models import ModelStore, importer
from hearthnet.models.hashing import weights_sha256
from tests.helpers.tiny_models import make_tiny_model
from tests.unit.test_models import _cli


def test_smollm2_manifest_and_plain_transformers_load(smollm2):
    from transformers import AutoModelForCausalLM

    assert smollm2.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert smollm2.alias == "smollm2" and smollm2.num_layers == 30 and smollm2.hidden_size == 576
    assert len(smollm2.weights_sha256) == 64
    # imported at bf16 (issue 12 §1; data dirs imported before that hold float32): the
    # manifest names the stored dtype
    from safetensors import safe_open

    with safe_open(str(smollm2.path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.norm.weight").dtype
    assert smollm2.dtype == str(stored).removeprefix("torch.")
    assert smollm2.dtype in ("bfloat16", "float32")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "manifest.json"):
        assert (smollm2.path / f).is_file(), f
    assert "quantization_config" not in json.loads((smollm2.path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(smollm2.path))
    assert model.config.num_hidden_layers == 30


def test_import_is_idempotent_without_converting_again(model_store, smollm2, monkeypatch):
    def no_conversion(*_a: object, **_k: object) -> None:
        raise AssertionError("the second import converted the GGUF again")

    weights = smollm2.path / "model.safetensors"
    before = weights.stat()
    monkeypatch.setattr(importer, "import_gguf", no_conversion)
    again = importer.import_smollm2(model_store)
    assert again == smollm2
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_list_json_and_verify_via_cli(smollm2):
    r = _cli("models", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    row = next(x for x in rows if x["alias"] == "smollm2")
    for k in ("model_id", "alias", "weights_sha256", "path", "num_layers"):
        assert k in row
    assert row["weights_sha256"] == smollm2.weights_sha256
    r = _cli("models", "verify", "smollm2")
    assert r.returncode == 0 and "ok" in r.stdout


def test_unknown_model_lists_what_is_there(model_store):
    with pytest.raises(ModelNotFound) as ei:
        model_store.get("no-such-model")
    assert "smollm2" in ei.value.message
    r = _cli("models", "verify", "no-such-model")
    assert r.returncode == 1 and "smollm2" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture()
def tiny_store(tmp_path, smollm2):
    src = make_tiny_model("llama", tmp_path / "src", smollm2.path, layers=4)
    store = ModelStore(tmp_path / "store")
    entry = importer.import_folder(store, src, alias="tiny")
    return store, entry


def test_import_folder_registers_and_hash_is_layout_independent(tiny_store, tmp_path):
    store, entry = tiny_store
    assert entry.num_layers == 4 and entry.alias == "tiny"
    assert store.get("tiny").weights_sha256 == weights_sha256(entry.path)
    # the same tensors re-serialised (another header order) keep the same hash
    from safetensors.torch import load_file, save_file

    f = entry.path / "model.safetensors"
    tensors = load_file(str(f))
    other = tmp_path / "other"
    other.mkdir()
    save_file(dict(reversed(list(tensors.items()))), str(other / "model.safetensors"))
    assert weights_sha256(other) == entry.weights_sha256


def test_verify_names_corrupted_file(tiny_store, tmp_path):
    store, entry = tiny_store
    f = entry.path / "model.safetensors"
    with f.open("r+b") as fh:
        fh.seek(f.stat().st_size - 10)
        fh.write(b"\x01\x02\x03")
    with pytest.raises(WeightsMismatch) as ei:
        store.verify("tiny")
    assert "model.safetensors" in ei.value.message
    r = _cli("models", "--models-dir", str(store.root), "verify", "tiny")
    assert r.returncode == 1 and "model.safetensors" in r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_file_is_weights_mismatch_on_load(tiny_store):
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    store, entry = tiny_store
    f = entry.path / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    with pytest.raises(WeightsMismatch) as ei:
        LayeredStack(store.get("tiny"), 0, 1)
    assert str(f) in ei.value.message


def test_layer_range_outside_model_is_bad_request(tiny_store):
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    _, entry = tiny_store
    with pytest.raises(BadRequest) as ei:
        LayeredStack(entry, 2, 9)
    assert "[0, 3]" in ei.value.message
