"""A model's sizes per layer, from its headers alone (`hearthnet plan`, M26 §10).

Every tensor's logical shape, stored dtype (and GGML block type) and stored bytes, each
assigned to its decoder layer or to the **head** (embedding, final norm, lm_head: what an
orchestrator holds). Read from a safetensors file or folder (its JSON header: 8 bytes of
length, then the header; no tensor byte is read), a store entry (its folder), or a GGUF
file (gguf-py's `GGUFReader` memory-maps the file and parses the key-values and tensor
infos at its start; tensor data pages are never touched). What each held format would make
of these bytes is `distributed_inference.placement.predict`'s (it needs the engine's
quantisation rules); this module stays torch-free.

Knows nothing of the network (STYLE.md): a remote file's header is fetched elsewhere
(`hearthnet.commands.plan`) and handed in as bytes (`safetensors_sizes_from_bytes`) or as a
file whose unread part is a hole (`gguf_sizes`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.errors import BadRequest
from hearthnet.models.hashing import ggml_tensors, read_safetensors_header_and_metadata

# decoder layer of a tensor: transformers' names (…layers.N.…) and llama.cpp's (blk.N.…)
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk|h)\.(\d+)\.")
# bytes per element of safetensors' dtypes (the ones a model store can hold)
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_ST_FORMAT = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
MAX_HEADER = 100 << 20  # as `hashing`: a bigger safetensors header is a corrupt file


@dataclass(frozen=True, slots=True)
class TensorSize:
    """One stored tensor: name, logical shape, stored dtype (GGML type where blocks), bytes."""

    name: str
    layer: int | None  # None: a head tensor
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype ("F32", "U8" for blocks) or GGML type name ("Q4_K")
    ggml_type: str  # GGML block type of kept blocks, "" for plain floats
    stored_bytes: int

    @property
    def params(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSizes:
    """Per-tensor sizes of one model, and the facts a plan needs of its shape.

    `stored_format`: the held format `native` means (fp32/bf16/fp16), from the layers' dtype.
    """

    source: str  # what was read: a path, a URL, a store alias
    container: str  # "safetensors" | "gguf"
    num_layers: int
    hidden_size: int
    tensors: tuple[TensorSize, ...]
    stored_format: str
    tied_embeddings: bool

    def layer_tensors(self, i: int) -> list[TensorSize]:
        return [t for t in self.tensors if t.layer == i]

    def head_tensors(self) -> list[TensorSize]:
        return [t for t in self.tensors if t.layer is None]

    def layer_stored_bytes(self) -> list[int]:
        """Stored bytes of each decoder layer, layer 0 first."""
        out = [0] * self.num_layers
        for t in self.tensors:
            if t.layer is not None and t.layer < self.num_layers:
                out[t.layer] += t.stored_bytes
        return out

    def head_stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.head_tensors())

    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (mean over layers), as `autohost.layer_params`."""
        total = sum(t.params for t in self.tensors if t.layer is not None)
        return total // max(1, self.num_layers)

    def head_matmul_params(self) -> int:
        """Parameters the head multiplies per decoded token: the lm_head (the embedding
        matrix when tied); the embedding itself is a row lookup, the norm negligible."""
        heads = [t for t in self.head_tensors() if len(t.shape) == 2]
        lm = [t for t in heads if "lm_head" in t.name or t.name.startswith("output.")]
        if lm:
            return lm[0].params
        return max((t.params for t in heads), default=0)  # tied: the embedding

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "container": self.container,
                "num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "stored_format": self.stored_format, "tensors": len(self.tensors),
                "layer_stored_bytes": self.layer_stored_bytes(),
                "head_stored_bytes": self.head_stored_bytes(),
                "params_per_layer": self.params_per_layer()}


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _st_tensor(name: str, info: Mapping[str, Any],
               ggml: Mapping[str, tuple[str, tuple[int, ...]]]) -> TensorSize:
    try:
        lo, hi = (int(x) for x in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        dtype = str(info["dtype"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"tensor {name!r}: malformed safetensors header entry") from e
    kind, logical = ggml.get(name, ("", shape))
    return TensorSize(name, layer_of(name), logical, dtype, kind, hi - lo)


def _from_tensors(source: str, container: str, tensors: list[TensorSize],
                  config: Mapping[str, Any] | None) -> ModelSizes:
    if not tensors:
        raise BadRequest(f"{source}: no tensors in the header; is it a model?")
    layers = [t.layer for t in tensors if t.layer is not None]
    if not layers:
        raise BadRequest(f"{source}: no decoder-layer tensors (…layers.N… or blk.N…); "
                         "is it a language model?")
    cfg = config or {}
    num_layers = int(cfg.get("num_hidden_layers") or max(layers) + 1)
    heads = [t for t in tensors if t.layer is None and len(t.shape) == 2]
    hidden = int(cfg.get("hidden_size") or (min(heads, key=lambda t: t.shape[1]).shape[1]
                                            if heads else 0))
    dtypes = [t.dtype for t in tensors if t.layer is not None and not t.ggml_type]
    stored = _ST_FORMAT.get(max(set(dtypes), key=dtypes.count) if dtypes else "", "fp32")
    names = {t.name for t in tensors}
    tied = bool(cfg.get("tie_word_embeddings", not any(
        "lm_head" in n or n.startswith("output.") for n in names)))
    return ModelSizes(source, container, num_layers, hidden, tuple(tensors), stored, tied)


def safetensors_sizes(path: Path, source: str | None = None) -> ModelSizes:
    """Sizes of a safetensors file, or of every ``*.safetensors`` of a folder (its
    ``config.json``, when present, names the layer count and hidden size)."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise BadRequest(f"{path}: no *.safetensors file in this folder")
    tensors: list[TensorSize] = []
    for f in files:
        header, _, metadata = read_safetensors_header_and_metadata(f)
        ggml = ggml_tensors(metadata)
        tensors += [_st_tensor(n, info, ggml) for n, info in header.items()]
    cfg_file = (path if path.is_dir() else path.parent) / "config.json"
    config = _read_config(cfg_file)
    return _from_tensors(source or str(path), "safetensors", tensors, config)


def _read_config(f: Path) -> dict[str, Any] | None:
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    cfg = data.get("text_config", data) if isinstance(data, dict) else None
    return cfg if isinstance(cfg, dict) else None


def safetensors_header_length(prefix: bytes) -> int:
    """Total bytes of a safetensors header (8 + its JSON), from the file's first 8 bytes."""
    if len(prefix) < 8:
        raise BadRequest("not a safetensors file: shorter than its 8-byte header length")
    n = int(struct.unpack("<Q", prefix[:8])[0])
    if n < 2 or n > MAX_HEADER:
        raise BadRequest(f"not a safetensors file: header length {n} is implausible")
    return 8 + n


def safetensors_sizes_from_bytes(prefix: bytes, source: str,
                                 config: Mapping[str, Any] | None = None) -> ModelSizes:
    """Sizes from the first bytes of a safetensors file (at least its whole header)."""
    end = safetensors_header_length(prefix)
    if len(prefix) < end:
        raise BadRequest(f"{source}: the header is {end} bytes, only {len(prefix)} given")
    try:
        header = json.loads(prefix[8:end])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"{source}: not a safetensors file (header is not JSON: {e})") from e
    if not isinstance(header, dict):
        raise BadRequest(f"{source}: not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    ggml = ggml_tensors(metadata if isinstance(metadata, dict) else {})
    tensors = [_st_tensor(n, info, ggml) for n, info in header.items()
               if isinstance(info, Mapping)]
    return _from_tensors(source, "safetensors", tensors, config)


GGUF_MAGIC = b"GGUF"


def gguf_sizes(path: Path, source: str | None = None) -> ModelSizes:
    """Sizes of a GGUF file from its key-values and tensor infos (no tensor data is read).

    Raises:
        BadRequest: not a GGUF file gguf-py can read.
    """
    reader = gguf_reader(path)
    return gguf_sizes_of(reader, source or str(path))


def gguf_reader(path: Path) -> Any:
    """gguf-py's reader of `path` (a memory map: only the pages parsed are read)."""
    from gguf import GGUFReader

    reader: Any
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise BadRequest(f"{path.name}: not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf-py raises whatever numpy does on a malformed file
        raise BadRequest(f"{path.name}: not a readable GGUF file "
                         f"({type(e).__name__}: {e})"[:300]) from e
    return reader


def gguf_header_end(reader: Any) -> int:
    """Where the reader's parse ended: the start of the tensor data (its header's length)."""
    return int(reader.data_offset)


def gguf_sizes_of(reader: Any, source: str) -> ModelSizes:
    """`ModelSizes` of an open `GGUFReader`."""
    fields = reader.fields

    def field(key: str) -> Any:
        f = fields.get(key)
        return f.contents() if f is not None else None

    arch = str(field("general.architecture") or "")
    tensors = []
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))  # ne → rows first
        kind = t.tensor_type.name
        plain = kind in ("F32", "F16", "BF16")
        tensors.append(TensorSize(t.name, layer_of(t.name), shape, kind,
                                  "" if plain else kind, int(t.n_bytes)))
    config = {"num_hidden_layers": field(f"{arch}.block_count"),
              "hidden_size": field(f"{arch}.embedding_length")}
    sizes = _from_tensors(source, "gguf", tensors, {k: v for k, v in config.items() if v})
    floats = [t.dtype for t in tensors if t.layer is not None and not t.ggml_type]
    if not floats:  # all blocks: an import keeping them holds fp32 natively (gguf.py)
        return ModelSizes(sizes.source, "gguf", sizes.num_layers, sizes.hidden_size,
                          sizes.tensors, "fp32", sizes.tied_embeddings)
    return sizes


def local_sizes(path: Path) -> ModelSizes:
    """Sizes of a local GGUF file, safetensors file or folder of them.

    Raises:
        BadRequest: the path is missing, unreadable or not a model file.
    """
    if not path.exists():
        raise BadRequest(f"{path}: no such file or folder")
    try:
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs and not any(path.glob("*.safetensors")):
                return gguf_sizes(ggufs[0])
            return safetensors_sizes(path)
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == GGUF_MAGIC:
            return gguf_sizes(path)
        return safetensors_sizes(path)
    except OSError as e:
        raise BadRequest(f"{path}: cannot read it ({e.strerror or e})") from e
