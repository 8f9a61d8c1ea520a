"""`hearthnet models synth` (issue 12 §3) building on SmolLM2's tokenizer and config."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from hearthnet.models.hashing import file_sha256, weights_sha256
from hearthnet.models.store import ModelStore
from hearthnet.models.synth import write_synthetic
from tests.helpers.tiny_models import TINY_QWEN2

TINY = TINY_QWEN2


def _tiny(store: ModelStore, smollm2, alias: str = "tiny", seed: int = 0, **kw):
    return write_synthetic(store, alias, TINY, model_id="hearthnet-synthetic/tiny",
                           seed=seed, tokenizer_from=smollm2.path, source="test", **kw)


def test_synthetic_model_is_a_normal_bf16_store_model(tmp_path, smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = ModelStore(tmp_path)
    # a tiny file limit forces several files and an index, as for a 7B model
    e = _tiny(store, smollm2, max_file_bytes=2 << 20)
    assert e.synthetic and e.dtype == "bfloat16" and e.num_layers == 3
    assert len(e.files) > 1 and (e.path / "model.safetensors.index.json").is_file()
    assert [x.alias for x in store.entries()] == ["tiny"]
    # hashes computed while streaming equal the definitions computed from disk
    assert weights_sha256(e.path) == e.weights_sha256
    for name, rec in e.files.items():
        assert file_sha256(e.path / name) == rec["sha256"]
    model = AutoModelForCausalLM.from_pretrained(str(e.path))
    assert model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(str(e.path))
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    assert int(ids.max()) < TINY["vocab_size"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert int(out.max()) < len(tok)  # padding rows never win: every token decodes
    cfg = json.loads((e.path / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id


def test_same_seed_same_hash_other_seed_other_hash(tmp_path, smollm2):
    a = _tiny(ModelStore(tmp_path / "a"), smollm2)
    b = _tiny(ModelStore(tmp_path / "b"), smollm2)
    c = _tiny(ModelStore(tmp_path / "c"), smollm2, seed=1)
    assert a.weights_sha256 == b.weights_sha256 != c.weights_sha256
    with safe_open(str(next(iter(a.path.glob("*.safetensors")))), "pt") as f:
        norm = [k for k in f.keys() if k.endswith("norm.weight")]  # noqa: SIM118
        assert norm and all(bool((f.get_tensor(k) == 1).all()) for k in norm)


def test_models_remove_deletes_one_model_and_says_so(tmp_path, smollm2, capsys):
    """`hearthnet models remove` (issue 15 §6): the store forgets exactly that model."""
    from hearthnet.cli import main

    store = ModelStore(tmp_path / "models")
    _tiny(store, smollm2, alias="keep")
    gone = _tiny(store, smollm2, alias="gone", seed=1)
    argv = ["models", "--models-dir", str(store.root), "remove", "gone"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("removed gone (hearthnet-synthetic/tiny")
    assert [e.alias for e in store.entries()] == ["keep"] and not gone.path.exists()
    assert not list(store.root.glob("*.removing"))
    assert main(argv) == 1  # gone already: the one-line error, no traceback
    assert capsys.readouterr().err.strip().startswith("hearthnet: bad_request: unknown")
