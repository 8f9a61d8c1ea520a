"""`hearthnet models synth SHAPE`: real-shape models with random weights (M26 §5.7's models).

A synthetic model is a normal store folder: the real `config.json` of a published model
(M26 §5.7's Qwen2.5-{1.5B,3B,7B}, Llama-3.2-{1B,3B}), bf16 weights drawn from a seeded
normal distribution (std = the config's `initializer_range`; RMSNorm weights are ones), a
working tokenizer, and a manifest with `synthetic: true`. Everything else (shards, chat,
bench) treats it as any model; its output is meaningless text, its cost is real.

Weights are generated and written tensor by tensor, in row chunks (`SafetensorsWriter`), so
a 15 GB model never sits in memory. Each tensor's generator is seeded from the seed and the
tensor's name, so the same SHAPE and seed always give the same `weights_sha256`.

The tokenizer is SmolLM2's (shipped with the bundled model, so it works offline): its ids
(< 49,152) all fall inside every shape's embedding; the config's special-token ids are set
to the tokenizer's, and `vocab_size` stays the real one. Embedding / lm_head rows above the
tokenizer's ids are zero — padding rows, as in the real models' padded vocabularies — so
they are never looked up and never win the arg-max (random logits of real rows do).
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hearthnet.errors import BadRequest
from hearthnet.models.shapes import SHAPES
from hearthnet.models.store import ModelEntry, ModelStore
from hearthnet.models.writer import DEFAULT_MAX_FILE_BYTES, SafetensorsWriter, TensorPlan

_ROWS_PER_CHUNK_ELEMS = 16 << 20  # ~64 MB of fp32 randoms at a time
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")
Progress = Callable[[int], None]


def shape_config(shape: str) -> tuple[str, dict[str, Any]]:
    """(model id, config.json dict) of SHAPE; `BadRequest` naming the known shapes."""
    try:
        model_id, cfg = SHAPES[shape]
    except KeyError:
        raise BadRequest(f"unknown synthetic shape {shape!r}; known shapes: "
                         f"{', '.join(SHAPES)}") from None
    return model_id, {**cfg, "torch_dtype": "bfloat16"}


def tensor_plan(config: dict[str, Any]) -> list[TensorPlan]:
    """Every stored tensor of a model with this config (names and shapes from transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    sd = model.state_dict()
    if config.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    return [TensorPlan(k, torch.bfloat16, tuple(sd[k].shape)) for k in sorted(sd)]


def _generate(writer: SafetensorsWriter, t: TensorPlan, seed: int, std: float,
              vocab_used: int, vocab_size: int) -> None:
    """Write tensor `t` in row chunks; rows of a vocab-sized matrix past the tokenizer's ids
    are zero (padding rows, never looked up and never the arg-max)."""
    if len(t.shape) == 1 and t.name.endswith("norm.weight"):
        writer.write(t.name, torch.ones(t.shape, dtype=t.dtype))
        return
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(t.name.encode()))
    rows = t.shape[0]
    cols = math.prod(t.shape[1:])
    pad = len(t.shape) == 2 and rows == vocab_size
    step = max(1, _ROWS_PER_CHUNK_ELEMS // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        part = torch.randn((n, *t.shape[1:]), generator=g).mul_(std)
        if pad and r + n > vocab_used:
            part[max(0, vocab_used - r):] = 0
        writer.write(t.name, part.to(t.dtype))


def _tokenizer_source(store: ModelStore) -> Path:
    from hearthnet.models.importer import SMOLLM2_ALIAS, import_smollm2

    e = store.find(SMOLLM2_ALIAS) or import_smollm2(store)
    return e.path


def _write_tokenizer(src: Path, out: Path, config: dict[str, Any]) -> int:
    """Copy the tokenizer files; set the config's special ids; returns the tokenizer's size."""
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    if len(tok) > int(config["vocab_size"]):
        raise BadRequest(f"tokenizer has {len(tok)} ids, more than the shape's vocab_size")
    gen_file = out / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    config.update({k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if k in gen})
    return len(tok)


def synth_model(store: ModelStore, shape: str, *, alias: str | None = None, seed: int = 0,
                progress: Progress | None = None) -> ModelEntry:
    """Write a synthetic model of SHAPE into the store (idempotent: an existing alias is
    returned as is)."""
    _, config = shape_config(shape)
    alias = alias or shape
    existing = store.find(alias)
    if existing is not None:
        return existing
    return write_synthetic(store, alias, config, model_id=f"hearthnet-synthetic/{shape}",
                           seed=seed, tokenizer_from=None,
                           source=f"synth:{shape}:seed={seed}", progress=progress)


def write_synthetic(store: ModelStore, alias: str, config: dict[str, Any], *, model_id: str,
                    seed: int,
                    tokenizer_from: Path | None, source: str,
                    progress: Progress | None = None,
                    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> ModelEntry:
    """Write a random-weight model with `config` as `alias` (see the module docstring).

    Nothing is visible to `models list` until it is complete: the folder is written as
    `<alias>.importing` and renamed at the end; an interrupted run resumes.
    """
    from hearthnet.models.importer import publish_folder, stage_folder

    config = dict(config)
    src = tokenizer_from or _tokenizer_source(store)
    tmp = stage_folder(store, alias, f"{source}:{json.dumps(config, sort_keys=True)}")
    vocab_used = _write_tokenizer(src, tmp, config)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    plan = tensor_plan(config)
    writer = SafetensorsWriter(tmp, plan, max_file_bytes)
    done = writer.resume()  # an interrupted run's complete files are kept
    std = float(config.get("initializer_range", 0.02))
    for t in plan:
        if t.name not in done:
            _generate(writer, t, seed, std, vocab_used, int(config["vocab_size"]))
        if progress:
            progress(t.nbytes)
    return publish_folder(store, tmp, alias, model_id=model_id, written=writer.close(),
                          source=source, synthetic=True)
