"""Weights hashes.

`weights_sha256` identifies a model's weights independently of how they are laid out in
files (one file or many, any header order). It is the SHA-256 of, for every tensor in all
`*.safetensors` files of the model folder, in ascending order of tensor name:

    name (UTF-8) | 0x00 | dtype (safetensors name, e.g. "F32") | 0x00 |
    shape as decimal comma-separated ASCII (e.g. "49152,576") | 0x00 |
    the tensor's raw little-endian bytes, row-major

A tensor of GGUF quantised blocks (an import with kept blocks, `--dtype gguf`) is hashed
as it is stored: its safetensors dtype is U8 and its shape (rows, bytes per row), and its
dtype field names the GGML type too, `U8:` + the type (e.g. "U8:Q4_1"), because two types
can share a row's byte length (Q4_0 and Q4_K both take 18 bytes per 32 values). The type
comes from the file's `__metadata__` (`GGML_METADATA`).

Two folders with the same tensor names, dtypes, shapes and values have the same hash;
changing any value, name, dtype or shape changes it. Shards of a pipeline must report the
same hash (M26 §2, §6 `weights_mismatch`).

A tensor's own hash (`tensor_sha256`, the manifest's `tensors` table) is the SHA-256 of
that same record for that one tensor: ``name | 0x00 | dtype | 0x00 | shape | 0x00 |
bytes``. A node holding a part of a model (the layers it fetched, DESIGN.md decision 17)
checks each tensor it receives against it before the tensor is kept; `weights_sha256`
itself can be checked only by a holder of every tensor.

`file_sha256` is the plain SHA-256 of a file's bytes; the manifest records it per file so
`verify` can name the file that changed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hearthnet.errors import WeightsMismatch

_CHUNK = 8 << 20
GGML_METADATA = "hearthnet.ggml"
"""The safetensors `__metadata__` key of a file holding GGUF blocks: JSON {tensor name:
{"type": GGML type name, "shape": logical shape}}, for each tensor stored as U8 blocks."""


Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
"""The GGML block types held exactly as int4 groups of 32 (engine/blocks.py): torch-free
here, for the store's `ModelEntry.q4_blocks`."""


def ggml_tensors(metadata: dict[str, str] | None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (GGML type, logical shape)} from a safetensors file's `__metadata__`."""
    raw = (metadata or {}).get(GGML_METADATA)
    if not raw:
        return {}
    return {k: (str(v["type"]), tuple(int(d) for d in v["shape"]))
            for k, v in json.loads(raw).items()}


def hash_dtype(dtype: str, ggml_type: str | None) -> str:
    """The dtype field a tensor's bytes are hashed under (the module docstring)."""
    return f"{dtype}:{ggml_type}" if ggml_type else dtype


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_safetensors_header(path: Path) -> tuple[dict[str, dict[str, object]], int]:
    """Parse a safetensors header without reading tensor data.

    Returns:
        (tensor name → {dtype, shape, data_offsets}, byte offset where the data starts).

    Raises:
        WeightsMismatch: the file is truncated or its header is malformed.
    """
    header, start, _ = read_safetensors_header_and_metadata(path)
    return header, start


def read_safetensors_header_and_metadata(path: Path) -> tuple[
        dict[str, dict[str, object]], int, dict[str, str]]:
    """`read_safetensors_header` and the file's `__metadata__` (empty when it has none)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise WeightsMismatch(f"{path}: truncated safetensors file (no header)", file=str(path))
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise WeightsMismatch(f"{path}: corrupted safetensors header length", file=str(path))
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsMismatch(f"{path}: corrupted safetensors header: {e}",
                                  file=str(path)) from e
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        if data_start + hi > size or lo > hi:
            raise WeightsMismatch(
                f"{path}: truncated safetensors file (tensor {name!r} extends past the end)",
                file=str(path))
    return header, data_start, metadata


def tensor_prefix(name: str, dtype: str, shape: Sequence[int]) -> bytes:
    """What a tensor's record hashes before its bytes (the module docstring); `dtype` is
    the hash dtype (`hash_dtype`)."""
    return f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\0".encode()


def tensor_table(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `tensors` table of the safetensors files in `folder`:
    {name: {sha256, bytes, dtype, shape, file}} (+ `logical_shape` of a GGUF block
    tensor), `sha256` as `tensor_sha256` in the module docstring, `dtype` the hash dtype."""
    return hash_folder(folder)[1]


def tensor_record(sha256: str, nbytes: int, dtype: str, shape: Sequence[int], file: str,
                  logical_shape: Sequence[int] | None = None) -> dict[str, Any]:
    """One row of the manifest's `tensors` table."""
    rec: dict[str, Any] = {"sha256": sha256, "bytes": int(nbytes), "dtype": dtype,
                           "shape": [int(d) for d in shape], "file": file}
    if logical_shape is not None:
        rec["logical_shape"] = [int(d) for d in logical_shape]
    return rec


def weights_sha256(folder: Path) -> str:
    """The model's `weights_sha256` as defined in this module's docstring."""
    return hash_folder(folder)[0]


def hash_folder(folder: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """`weights_sha256` and the `tensors` table of `folder`, reading every byte once."""
    entries: list[tuple[str, Path, dict[str, object], int]] = []
    ggml: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        header, start, metadata = read_safetensors_header_and_metadata(f)
        ggml.update(ggml_tensors(metadata))
        entries.extend((name, f, info, start) for name, info in header.items())
    entries.sort(key=lambda e: e[0])
    h = hashlib.sha256()
    table: dict[str, dict[str, Any]] = {}
    handles: dict[Path, object] = {}
    try:
        for name, f, info, start in entries:
            fh = handles.get(f)
            if fh is None:
                fh = handles[f] = f.open("rb")
            shape = [int(d) for d in info["shape"]]  # type: ignore[attr-defined]
            dtype = hash_dtype(str(info["dtype"]), ggml[name][0] if name in ggml else None)
            prefix = tensor_prefix(name, dtype, shape)
            h.update(prefix)
            t = hashlib.sha256(prefix)
            lo, hi = (int(x) for x in info["data_offsets"])  # type: ignore[attr-defined]
            fh.seek(start + lo)  # type: ignore[attr-defined]
            remaining = hi - lo
            while remaining > 0:
                chunk = fh.read(min(_CHUNK, remaining))  # type: ignore[attr-defined]
                if not chunk:
                    raise WeightsMismatch(f"{f}: truncated safetensors file", file=str(f))
                h.update(chunk)
                t.update(chunk)
                remaining -= len(chunk)
            table[name] = tensor_record(t.hexdigest(), hi - lo, dtype, shape, f.name,
                                        ggml[name][1] if name in ggml else None)
    finally:
        for fh in handles.values():
            fh.close()  # type: ignore[attr-defined]
    return h.hexdigest(), table
