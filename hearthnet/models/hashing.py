"""Weights hashes.

`weights_sha256` identifies a model's weights independently of how they are laid out in
files (one file or many, any header order). It is the SHA-256 of, for every tensor in all
`*.safetensors` files of the model folder, in ascending order of tensor name:

    name (UTF-8) | 0x00 | dtype (safetensors name, e.g. "F32") | 0x00 |
    shape as decimal comma-separated ASCII (e.g. "49152,576") | 0x00 |
    the tensor's raw little-endian bytes, row-major

Two folders with the same tensor names, dtypes, shapes and values have the same hash;
changing any value, name, dtype or shape changes it. Shards of a pipeline must report the
same hash (M26 §2, §6 `weights_mismatch`).

`file_sha256` is the plain SHA-256 of a file's bytes; the manifest records it per file so
`verify` can name the file that changed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from hearthnet.errors import WeightsMismatch

_CHUNK = 8 << 20


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
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        lo, hi = info["data_offsets"]
        if data_start + hi > size or lo > hi:
            raise WeightsMismatch(
                f"{path}: truncated safetensors file (tensor {name!r} extends past the end)",
                file=str(path))
    return header, data_start


def weights_sha256(folder: Path) -> str:
    """The model's `weights_sha256` as defined in this module's docstring."""
    entries: list[tuple[str, Path, dict[str, object], int]] = []
    for f in sorted(folder.glob("*.safetensors")):
        header, start = read_safetensors_header(f)
        entries.extend((name, f, info, start) for name, info in header.items())
    entries.sort(key=lambda e: e[0])
    h = hashlib.sha256()
    handles: dict[Path, object] = {}
    try:
        for name, f, info, start in entries:
            fh = handles.get(f)
            if fh is None:
                fh = handles[f] = f.open("rb")
            shape = ",".join(str(d) for d in info["shape"])  # type: ignore[attr-defined]
            h.update(f"{name}\0{info['dtype']}\0{shape}\0".encode())
            lo, hi = (int(x) for x in info["data_offsets"])  # type: ignore[attr-defined]
            fh.seek(start + lo)  # type: ignore[attr-defined]
            remaining = hi - lo
            while remaining > 0:
                chunk = fh.read(min(_CHUNK, remaining))  # type: ignore[attr-defined]
                if not chunk:
                    raise WeightsMismatch(f"{f}: truncated safetensors file", file=str(f))
                h.update(chunk)
                remaining -= len(chunk)
    finally:
        for fh in handles.values():
            fh.close()  # type: ignore[attr-defined]
    return h.hexdigest()
