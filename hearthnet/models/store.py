"""The model store: one folder per model under `<data dir>/models/`.

Layout of a model folder (loadable with plain
`transformers.AutoModelForCausalLM.from_pretrained(folder)`)::

    <models>/<alias>/
        config.json            the transformers config (no quantization section)
        model.safetensors      weights (one or more *.safetensors files)
        tokenizer.json, tokenizer_config.json, ...   tokenizer files
        chat_template.jinja    the chat template (when the model has one)
        manifest.json          HearthNet's manifest (below)

`manifest.json` holds: `model_id` (the Hugging Face id), `alias`, `weights_sha256` (see
`hearthnet.models.hashing`), `num_layers`, `hidden_size`, `model_type`, `dtype`, `source`,
`ggml_types` ({GGML type: tensor count} of the GGUF blocks an import kept, `--dtype gguf`;
empty otherwise), `files`: {file name: {sha256, size, mtime_ns}} for every weights
file, so `verify` can name the file that changed and a loader can notice a modified file
cheaply, and `tensors`: {tensor name: {sha256, bytes, dtype, shape, file}} of the whole
model (`hashing.tensor_record`; written at import; a store written before it gets it
computed once on first need, `ModelStore.ensure_tensors`).

**Partial models** (DESIGN.md decision 17): a node that fetched some layers of a model
from the mesh keeps them in a folder of their own whose manifest has `holds`:
``{"layers": [[lo, hi], ...], "head": bool}`` (None, absent: the whole model). Such a folder
keeps the whole model's `weights_sha256`, config, tokenizer files and `tensors` table (so
it can check and serve what it has and knows what it lacks) but only the held tensors'
files; a shard range it does not hold is refused (`ModelEntry.require_layers`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hearthnet.errors import ModelNotFound, WeightsMismatch
from hearthnet.models.hashing import (
    Q4_TYPES,
    file_sha256,
    ggml_tensors,
    hash_folder,
    read_safetensors_header,
    read_safetensors_header_and_metadata,
    tensor_table,
    weights_sha256,
)
from hearthnet.paths import models_dir

if TYPE_CHECKING:
    from hearthnet.models.writer import WrittenModel

MANIFEST = "manifest.json"
# What a head reads besides its weights (M26 §5.3: the head tokenises and templates the
# prompt): two aliases with the same weights but another of these files are other heads
HEAD_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json")
HeadKey = tuple[str, str, str]  # `ModelEntry.head_key`: alias, weights, head files
_RACY_NS = 2_000_000_000  # a folder list younger than this is listed again
IMPORTING = ".importing"  # suffix of a folder being written (renamed when complete)
_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.")
Ranges = list[tuple[int, int]]


def decoder_prefix(names: Iterable[str]) -> str | None:
    """The decoder's tensor-name prefix (``model.``): its embedding's when the embedding
    sits beside its layers (not a vision tower's), else the first layer tensor's; None
    when there is none. engine/weights.py's `WeightsReader` reads the same way."""
    names = list(names)
    for k in names:
        if k.endswith("embed_tokens.weight"):
            p = k[:-len("embed_tokens.weight")]
            if any(x.startswith(p + "layers.") for x in names):
                return p
    for k in names:
        m = _LAYER_KEY.match(k)
        if m:
            return m.group("prefix")
    return None


def layer_of(name: str, prefix: str | None) -> int | None:
    """The decoder layer tensor `name` belongs to; None for the head's (embeddings, final
    norm, lm_head and any other non-layer tensor)."""
    if prefix is None or not name.startswith(prefix + "layers."):
        return None
    idx = name[len(prefix) + len("layers."):].split(".", 1)[0]
    return int(idx) if idx.isdigit() else None


def select_tensors(names: Iterable[str], layers: Sequence[tuple[int, int]],
                   head: bool) -> list[str]:
    """The tensors of the decoder layers in `layers` (inclusive ranges) and, with `head`,
    every tensor that is not a decoder layer's: what hosting those layers (and
    orchestrating) reads, and nothing else (DESIGN.md decision 4)."""
    names = sorted(names)
    prefix = decoder_prefix(names)
    out = []
    for n in names:
        i = layer_of(n, prefix)
        if (i is None and head) or (i is not None and any(lo <= i <= hi for lo, hi in layers)):
            out.append(n)
    return out


def merge_ranges(ranges: Iterable[Sequence[int]]) -> Ranges:
    """Inclusive ranges merged where they overlap or touch, sorted."""
    out: Ranges = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@functools.cache
def _q4_layers(folder: Path, weights_sha256: str) -> bool:
    """Whether every 2-D layer tensor of the store is a GGUF Q4_0/Q4_1/Q4_K block tensor
    (headers only; once per weights hash: a store's tensors never change under it)."""
    seen = False
    for f in sorted(folder.glob("*.safetensors")):
        header, _, meta = read_safetensors_header_and_metadata(f)
        blocks = ggml_tensors(meta)
        for name, rec in header.items():
            if name == "__metadata__" or ".layers." not in name:
                continue
            if name in blocks:
                seen = True
                if blocks[name][0] not in Q4_TYPES:
                    return False
            elif len(rec.get("shape", ())) == 2:  # type: ignore[arg-type]
                return False  # a float matrix: int4 would quantise it
    return seen


@dataclass(frozen=True)
class ModelEntry:
    """One imported model, as described by its manifest."""

    model_id: str
    alias: str
    weights_sha256: str
    num_layers: int
    hidden_size: int
    model_type: str
    dtype: str
    source: str
    path: Path
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    synthetic: bool = False
    ggml_types: dict[str, int] = field(default_factory=dict)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    holds: dict[str, Any] | None = None  # a partial model's holdings (module docstring)

    @property
    def partial(self) -> bool:
        """Whether this folder holds only some of the model's tensors."""
        return self.holds is not None

    @property
    def held_layers(self) -> Ranges:
        """The decoder layers this folder holds, as merged inclusive ranges."""
        if self.holds is None:
            return [(0, self.num_layers - 1)]
        return merge_ranges(self.holds.get("layers") or [])

    @property
    def holds_head(self) -> bool:
        """Whether this folder holds the head's tensors (embeddings, final norm, lm_head)."""
        return self.holds is None or bool(self.holds.get("head"))

    def missing_layers(self, lo: int, hi: int) -> list[int]:
        """The layers of `[lo, hi]` this folder does not hold."""
        return [i for i in range(lo, hi + 1)
                if not any(a <= i <= b for a, b in self.held_layers)]

    def require_layers(self, lo: int, hi: int) -> None:
        """Raise `ModelNotFound` (a caller's error, before any weight is read) unless this
        folder holds every layer of `[lo, hi]`."""
        missing = self.missing_layers(lo, hi)
        if missing:
            raise ModelNotFound(
                f"{self.alias} in this store is a partial model holding layers "
                f"{self.held_layers}; it lacks layers {missing[0]}..{missing[-1]} of "
                f"[{lo}, {hi}]: host a held range, or fetch these layers from a member "
                f"(configure the shard and the node fetches them)",
                model=self.alias, layers=[lo, hi], missing=[missing[0], missing[-1]])

    def require_head(self) -> None:
        """Raise `ModelNotFound` unless this folder holds the head's tensors."""
        if not self.holds_head:
            raise ModelNotFound(
                f"{self.alias} in this store is a partial model without the head "
                f"(embeddings, norm, lm_head); it cannot orchestrate chats of it",
                model=self.alias)

    def holdings(self) -> dict[str, Any]:
        """What a listing and an advertisement say this folder holds."""
        return {"layers": [list(r) for r in self.held_layers], "head": self.holds_head}

    def tensor_locations(self) -> dict[str, tuple[str, int, int]]:
        """{tensor name: (file name, absolute byte offset, byte length)} of the tensors
        this folder holds, from the safetensors headers (read once per entry)."""
        cached: dict[str, tuple[str, int, int]] | None = self.__dict__.get("_locations")
        if cached is None:
            cached = {}
            for f in sorted(self.path.glob("*.safetensors")):
                header, start, _ = read_safetensors_header_and_metadata(f)
                for name, info in header.items():
                    lo, hi = (int(x) for x in info["data_offsets"])  # type: ignore[attr-defined]
                    cached[name] = (f.name, start + lo, hi - lo)
            self.__dict__["_locations"] = cached  # frozen dataclass: a cache, not a field
        return cached

    @property
    def stored_as(self) -> str:
        """What the weights are stored as, for a listing: ``gguf:`` and the GGML types of
        a store that kept a GGUF's blocks (``gguf:Q4_1``, ``gguf:Q4_K+Q6_K``; its `dtype`,
        float32, is that of its other tensors and of `native`), else `dtype`."""
        return "gguf:" + "+".join(self.ggml_types) if self.ggml_types else self.dtype

    @property
    def q4_blocks(self) -> bool:
        """Whether every layer weight is a kept GGUF Q4_0/Q4_1/Q4_K block: held as int4,
        such a store loses nothing (`formats.lossless_formats`)."""
        if not self.ggml_types:
            return False
        if self.partial:  # its files hold some layers: the whole model's table says it
            prefix = decoder_prefix(self.tensors)
            layers = [r for n, r in self.tensors.items() if layer_of(n, prefix) is not None]
            blocks = [r for r in layers if str(r["dtype"]).startswith("U8:")]
            return bool(blocks) and all(
                str(r["dtype"])[3:] in Q4_TYPES for r in blocks) and all(
                len(r["shape"]) != 2 or str(r["dtype"]).startswith("U8:") for r in layers)
        return _q4_layers(self.path, self.weights_sha256)

    def to_json(self, *, tensors: bool = True) -> dict[str, Any]:
        """The manifest's fields and the folder; `tensors=False` leaves out the (long)
        per-tensor table, for listings."""
        d = asdict(self)
        d["path"] = str(self.path)
        if not tensors:
            d.pop("tensors")
        if self.holds is None:
            d.pop("holds")
        return d

    @classmethod
    def load(cls, folder: Path) -> ModelEntry:
        data = json.loads((folder / MANIFEST).read_text())
        data["path"] = folder
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def file_stats(self) -> dict[str, tuple[int, int]] | None:
        """(size, mtime_ns) of every weights file now, None when one is missing: a few
        `stat` calls, cheap enough before every shard session."""
        try:
            return {n: ((st := (self.path / n).stat()).st_size, st.st_mtime_ns)
                    for n in self.files}
        except OSError:
            return None

    def head_sha256(self) -> str:
        """sha256 over the `HEAD_FILES` the folder holds (name, size and bytes of each, in
        that order): the tokenizer, chat template and generation config a head is made of
        besides its weights. Hashed once per entry, and again only when one of those files'
        size or mtime changed (a template fixed in place): a chat pays a few `stat` calls."""
        stats = self._head_file_stats()
        cached: tuple[dict[str, tuple[int, int]], str] | None = self.__dict__.get("_head_hash")
        if cached is None or cached[0] != stats:
            h = hashlib.sha256()
            for name, (size, _) in stats.items():
                h.update(f"{name}\0{size}\0".encode())
                with contextlib.suppress(OSError):  # removed since: a key no head matches
                    h.update((self.path / name).read_bytes())
            cached = (stats, h.hexdigest())
            self.__dict__["_head_hash"] = cached  # frozen dataclass: a cache, not a field
        return cached[1]

    def head_key(self) -> HeadKey:
        """What a loaded head is kept under: alias, `weights_sha256` and `head_sha256` —
        the same weights with another tokenizer or chat template give another prompt."""
        return (self.alias, self.weights_sha256, self.head_sha256())

    def _head_file_stats(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name in HEAD_FILES:
            try:
                st = (self.path / name).stat()
            except OSError:
                continue
            out[name] = (st.st_size, st.st_mtime_ns)
        return out

    def manifest_stats(self) -> dict[str, tuple[int, int]]:
        """(size, mtime_ns) of every weights file as the manifest recorded them."""
        return {n: (int(r["size"]), int(r["mtime_ns"])) for n, r in self.files.items()}

    def check_files(self) -> None:
        """Cheap integrity check before loading weights.

        A weights file whose size or mtime differs from the manifest is re-hashed; a
        missing, truncated or changed file raises `WeightsMismatch` naming it.
        """
        for name, rec in self.files.items():
            f = self.path / name
            if not f.exists():
                raise WeightsMismatch(f"{f}: weights file is missing; re-import the model",
                                      file=str(f))
            st = f.stat()
            if st.st_size == rec["size"] and st.st_mtime_ns == rec["mtime_ns"]:
                continue
            read_safetensors_header(f)  # names truncation precisely
            if st.st_size != rec["size"] or file_sha256(f) != rec["sha256"]:
                raise WeightsMismatch(
                    f"{f}: weights file does not match its manifest (corrupted or replaced); "
                    f"re-import the model", file=str(f))


class ModelStore:
    """The models under one folder (default `<data dir>/models`).

    Manifests are parsed once and kept (DESIGN.md hot path rules: a chat looks its model up without
    re-reading every manifest): a cached entry is reused while its manifest file has the
    same inode, size and mtime, and the folder list while the store folder's mtime is
    unchanged (an import or a removal renames a folder, which changes it).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else models_dir()
        self.root.mkdir(parents=True, exist_ok=True)
        self._folders: tuple[int, list[Path]] = (-1, [])
        self._manifests: dict[Path, tuple[tuple[int, int, int], ModelEntry]] = {}

    def entries(self) -> list[ModelEntry]:
        out = []
        for d in self._model_folders():
            try:
                st = (d / MANIFEST).stat()
            except OSError:
                continue
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            cached = self._manifests.get(d)
            if cached is None or cached[0] != key:
                try:
                    cached = (key, ModelEntry.load(d))
                except (ValueError, TypeError, KeyError, OSError):
                    continue  # a half-written or foreign folder is not a model
                self._manifests[d] = cached
            out.append(cached[1])
        return out

    def _model_folders(self) -> list[Path]:
        """The store's folders, not those of imports under way; listed again only when the
        store folder changed — or changed so recently that a second change could share its
        coarse mtime (git's "racy" rule)."""
        mtime = self.root.stat().st_mtime_ns
        if self._folders[0] != mtime or time.time_ns() - mtime < _RACY_NS:
            folders = [d for d in sorted(self.root.iterdir())
                       if not d.name.endswith(IMPORTING)]  # an import under way: no model
            self._folders = (mtime, folders)
            self._manifests = {d: v for d, v in self._manifests.items() if d in folders}
        return self._folders[1]

    def get(self, name: str) -> ModelEntry:
        """Find a model by alias, model id or weights hash.

        Raises:
            ModelNotFound: listing the models that are there.
        """
        for e in self.entries():
            if name in (e.alias, e.model_id, e.weights_sha256):
                return e
        have = ", ".join(f"{e.alias} ({e.model_id})" for e in self.entries()) or "none"
        raise ModelNotFound(
            f"unknown model {name!r}; models in {self.root}: {have}. "
            f"Import one with `hearthnet models import smollm2` or `hearthnet models import PATH`.",
            model=name)

    def remove(self, name: str) -> ModelEntry:
        """Delete a stored model (by alias, model id or weights hash); returns what it was.

        The folder is first renamed out of the store, so no reader sees half a model.

        Raises:
            ModelNotFound: listing the models that are there.
        """
        import shutil

        e = self.get(name)
        doomed = e.path.with_name(e.path.name + ".removing")
        os.replace(e.path, doomed)
        shutil.rmtree(doomed)
        return e

    def find(self, name: str) -> ModelEntry | None:
        try:
            return self.get(name)
        except ModelNotFound:
            return None

    def write_manifest(self, folder: Path, *, model_id: str, alias: str, source: str,
                       written: WrittenModel | None = None,
                       synthetic: bool = False) -> ModelEntry:
        """Hash the weights in `folder` and write its manifest (atomically).

        `written`: hashes a `SafetensorsWriter` computed while writing the folder, so the
        files are not read back. `synthetic`: the
        weights are random (`hearthnet models synth`).
        """
        cfg = json.loads((folder / "config.json").read_text())
        text_cfg = cfg.get("text_config", cfg)
        files = {}
        ggml_types: dict[str, int] = {}
        for f in sorted(folder.glob("*.safetensors")):
            for kind, _ in ggml_tensors(read_safetensors_header_and_metadata(f)[2]).values():
                ggml_types[kind] = ggml_types.get(kind, 0) + 1
            st = f.stat()
            known = written.file_sha256.get(f.name) if written else None
            files[f.name] = {"sha256": known or file_sha256(f), "size": st.st_size,
                             "mtime_ns": st.st_mtime_ns}
        if not files:
            raise ModelNotFound(f"{folder}: no *.safetensors weights in the folder")
        dtype = str(text_cfg.get("dtype") or text_cfg.get("torch_dtype") or "float32")
        if written and written.tensors:
            whash, table = written.weights_sha256, dict(sorted(written.tensors.items()))
        else:
            whash, table = hash_folder(folder)  # one read for both
        entry = ModelEntry(
            model_id=model_id, alias=alias,
            weights_sha256=whash,
            num_layers=int(text_cfg["num_hidden_layers"]),
            hidden_size=int(text_cfg["hidden_size"]), model_type=str(text_cfg["model_type"]),
            dtype=dtype, source=source, path=folder, files=files,
            synthetic=synthetic, ggml_types=dict(sorted(ggml_types.items())), tensors=table)
        _write_manifest(folder, entry)
        return entry

    def ensure_tensors(self, entry: ModelEntry) -> ModelEntry:
        """`entry` with its `tensors` table: a store written before per-tensor hashes
        existed gets them computed once (reading every weights file) and written back into
        its manifest atomically, so an old store can serve its tensors to the mesh."""
        if entry.tensors:
            return entry
        if entry.partial:  # a partial folder is only ever written with its table
            raise WeightsMismatch(f"{entry.path}: a partial model without its tensors "
                                  f"table; remove it and fetch again", file=str(entry.path))
        entry.check_files()
        # the table is what members check fetched bytes against: computed from files
        # that still hash to the model's weights_sha256, or not at all
        whash, table = hash_folder(entry.path)
        if whash != entry.weights_sha256:
            raise WeightsMismatch(f"{entry.path}: weights_sha256 differs from the manifest; "
                                  f"re-import the model", file=str(entry.path))
        data = json.loads((entry.path / MANIFEST).read_text())
        data["tensors"] = table
        tmp = entry.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(entry.path / MANIFEST)
        return ModelEntry.load(entry.path)

    def write_partial(self, folder: Path, manifest: Mapping[str, Any],
                      holds: dict[str, Any]) -> ModelEntry:
        """Write the manifest of a partial model folder (atomically): the whole model's
        `manifest` fields (weights hash, config facts, `tensors` table) with this folder's
        own `files` and `holds`.

        Raises:
            WeightsMismatch: a held tensor is not in the folder's files.
        """
        try:  # files a merge does not touch keep their recorded hash (not read again)
            before = json.loads((folder / MANIFEST).read_text()).get("files") or {}
        except (OSError, ValueError):
            before = {}
        files = {}
        for f in sorted(folder.glob("*.safetensors")):
            st = f.stat()
            rec = before.get(f.name)
            same = rec is not None and (rec.get("size"), rec.get("mtime_ns")) == (
                st.st_size, st.st_mtime_ns)
            files[f.name] = {"sha256": rec["sha256"] if same and rec else file_sha256(f),
                             "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        known = set(ModelEntry.__dataclass_fields__) - {"path", "files", "holds"}
        entry = ModelEntry(**{k: v for k, v in manifest.items() if k in known},
                           path=folder, files=files,
                           holds={"layers": [list(r) for r in merge_ranges(holds["layers"])],
                                  "head": bool(holds.get("head"))})
        want = select_tensors(entry.tensors, entry.held_layers, entry.holds_head)
        have = set(entry.tensor_locations())
        lacking = [n for n in want if n not in have]
        if lacking:
            raise WeightsMismatch(f"{folder}: held tensors missing from its files: "
                                  f"{lacking[:3]}", file=str(folder))
        _write_manifest(folder, entry)
        return ModelEntry.load(folder)

    def complete(self, entry: ModelEntry) -> ModelEntry:
        """A partial model that now holds every layer and the head becomes a whole one,
        once its files hash to the model's `weights_sha256` (the one check a partial
        holder could not make: it also proves the `tensors` table it was given).

        Raises:
            WeightsMismatch: the files do not hash to `weights_sha256`.
        """
        if not entry.partial or entry.held_layers != [(0, entry.num_layers - 1)] \
                or not entry.holds_head:
            return entry
        if weights_sha256(entry.path) != entry.weights_sha256:
            raise WeightsMismatch(f"{entry.path}: every tensor matched its table, yet the "
                                  f"whole does not hash to weights_sha256 (a wrong table); "
                                  f"remove it and fetch again", file=str(entry.path))
        whole = ModelEntry(**{**{k: getattr(entry, k) for k in entry.__dataclass_fields__},
                              "holds": None})
        _write_manifest(entry.path, whole)
        return ModelEntry.load(entry.path)

    def verify(self, name: str) -> ModelEntry:
        """Recompute every hash of a model (of a partial one: its files and the tensors
        it holds, against the whole model's `tensors` table).

        Raises:
            WeightsMismatch: naming the file whose bytes or whose tensors changed.
        """
        e = self.get(name)
        if e.partial:
            e.check_files()
            for tname, rec in tensor_table(e.path).items():
                if e.tensors.get(tname, {}).get("sha256") != rec["sha256"]:
                    raise WeightsMismatch(f"{e.path}: tensor {tname!r} differs from the "
                                          f"model's tensors table", file=str(e.path))
            return e
        for fname, rec in e.files.items():
            f = e.path / fname
            if not f.exists():
                raise WeightsMismatch(f"{f}: weights file is missing", file=str(f))
            read_safetensors_header(f)
            if file_sha256(f) != rec["sha256"]:
                raise WeightsMismatch(f"{f}: sha256 differs from the manifest", file=str(f))
        if weights_sha256(e.path) != e.weights_sha256:
            raise WeightsMismatch(f"{e.path}: weights_sha256 differs from the manifest",
                                  file=str(e.path))
        return e


def _write_manifest(folder: Path, entry: ModelEntry) -> None:
    """`entry` as `folder`'s manifest, replaced atomically (no reader sees half of it)."""
    data = entry.to_json()
    data.pop("path")
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(folder / MANIFEST)
