"""Streaming safetensors writing: a model folder written tensor by tensor: memory near one tensor.

`SafetensorsWriter` is given the plan first (every tensor's name, dtype and shape), so the
headers are known before any data exists; tensors are then written in ascending name order,
each in one piece or in consecutive parts (row chunks), and never held together in memory.
Files are split at `max_file_bytes` (an `model.safetensors.index.json` names where each
tensor lives when there is more than one file), each written as `<name>.partial` and renamed
when complete, so a complete file on disk is always a whole one — and an interrupted
import resumes after the last complete file (`resume`).

While writing, the writer hashes each file's bytes (`file_sha256`) and — because tensors go
out in ascending name order — the model's `weights_sha256` as `hearthnet.models.hashing`
defines it, and each tensor's own hash (`hashing.tensor_record`: the manifest's `tensors`
table), so a multi-GB model is not read back to be hashed.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from hearthnet.errors import ModelStoreError
from hearthnet.models.hashing import GGML_METADATA, hash_dtype, tensor_record

# torch dtype → safetensors dtype name (the ones a model store holds).
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
}
DEFAULT_MAX_FILE_BYTES = 4 << 30
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to be written: name, dtype and shape; for GGUF blocks (uint8 rows of
    blocks) also their GGML type and logical shape (`hashing.GGML_METADATA`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    ggml_type: str = ""
    logical_shape: tuple[int, ...] = ()

    @property
    def hash_prefix(self) -> bytes:
        """What `weights_sha256` hashes before the tensor's bytes (`hashing`)."""
        shape = ",".join(str(d) for d in self.shape)
        dtype = hash_dtype(ST_DTYPES[self.dtype], self.ggml_type or None)
        return f"{self.name}\0{dtype}\0{shape}\0".encode()

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class WrittenModel:
    """What the writer produced: file name → sha256, the model's weights_sha256 and its
    `tensors` table (name → `hashing.tensor_record`)."""

    file_sha256: dict[str, str] = field(default_factory=dict)
    weights_sha256: str = ""
    total_bytes: int = 0
    tensors: dict[str, dict[str, object]] = field(default_factory=dict)


def _split(plan: Sequence[TensorPlan], max_file_bytes: int) -> list[list[TensorPlan]]:
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in plan:
        if groups[-1] and size + t.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    return groups


def _header(group: Sequence[TensorPlan]) -> bytes:
    meta = {"format": "pt"}
    ggml = {t.name: {"type": t.ggml_type, "shape": list(t.logical_shape)}
            for t in group if t.ggml_type}
    if ggml:
        meta[GGML_METADATA] = json.dumps(ggml, separators=(",", ":"))
    header: dict[str, object] = {"__metadata__": meta}
    off = 0
    for t in group:
        header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Writes the planned tensors into `folder`, streaming (see the module docstring)."""

    def __init__(self, folder: Path, plan: Sequence[TensorPlan],
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        names = [t.name for t in plan]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ModelStoreError("internal: tensors must be planned in ascending, unique "
                                  "name order")
        unknown = {t.dtype for t in plan} - set(ST_DTYPES)
        if unknown:
            raise ModelStoreError(f"cannot store tensors of dtype {sorted(map(str, unknown))}")
        self.folder = folder
        groups = _split(plan, max_file_bytes)
        n = len(groups)
        self.files = ["model.safetensors"] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._queue = [(fname, g) for fname, g in zip(self.files, groups, strict=True)]
        self._order = [t for g in groups for t in g]
        self._pos = 0          # index in _order of the tensor being written
        self._done_bytes = 0   # bytes of that tensor written so far
        self._fh: BinaryIO | None = None
        self._fhash = hashlib.sha256()
        self._whash = hashlib.sha256()
        self._thash = hashlib.sha256()  # the tensor being written (`tensor_record`)
        self._file_idx = -1
        self.result = WrittenModel(total_bytes=sum(t.nbytes for t in plan))
        if n > 1:
            index = {"metadata": {"total_size": self.result.total_bytes},
                     "weight_map": {t.name: f for f, g in self._queue for t in g}}
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def resume(self) -> set[str]:
        """Keep the complete files an interrupted run left (same plan → same header);
        returns the names of the tensors they hold, which the caller must not write again.

        Their bytes are read back once, in order, into the hashes.
        """
        done: set[str] = set()
        for i, (fname, group) in enumerate(self._queue):
            f = self.folder / fname
            if self._pos != sum(len(g) for _, g in self._queue[:i]) or not f.is_file() \
                    or f.stat().st_size != len(_header(group)) + sum(t.nbytes for t in group):
                break
            with f.open("rb") as fh:
                head = fh.read(len(_header(group)))
                if head != _header(group):
                    break
                fhash = hashlib.sha256(head)
                for t in group:
                    self._whash.update(t.hash_prefix)
                    thash = hashlib.sha256(t.hash_prefix)
                    left = t.nbytes
                    while left:
                        chunk = fh.read(min(left, 8 << 20))
                        fhash.update(chunk)
                        self._whash.update(chunk)
                        thash.update(chunk)
                        left -= len(chunk)
                    self._record(t, fname, thash.hexdigest())
            self.result.file_sha256[fname] = fhash.hexdigest()
            self._pos += len(group)
            done.update(t.name for t in group)
        return done

    @property
    def expected(self) -> TensorPlan | None:
        """The tensor the next `write` must belong to (None when all are written)."""
        return self._order[self._pos] if self._pos < len(self._order) else None

    def write(self, name: str, part: torch.Tensor) -> None:
        """Append `part` (the whole tensor, or its next rows) to tensor `name`."""
        t = self.expected
        if t is None or name != t.name:
            raise ModelStoreError(f"internal: expected tensor {t.name if t else None!r}, "
                                  f"got {name!r}")
        if part.dtype != t.dtype:
            raise ModelStoreError(f"internal: {name} is planned as {t.dtype}, got {part.dtype}")
        if self._done_bytes == 0:
            self._start_tensor(t)
        data = part.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
        if self._done_bytes + data.nbytes > t.nbytes:
            raise ModelStoreError(f"internal: too much data for tensor {name}")
        assert self._fh is not None
        self._fh.write(data)
        self._fhash.update(data)
        self._whash.update(data)
        self._thash.update(data)
        self._done_bytes += data.nbytes
        if self._done_bytes == t.nbytes:
            self._record(t, self._queue[self._file_idx][0], self._thash.hexdigest())
            self._pos += 1
            self._done_bytes = 0
            if self._pos == len(self._order) or self._file_of(self._pos) != self._file_idx:
                self._finish_file()

    def _file_of(self, pos: int) -> int:
        n = 0
        for i, (_, g) in enumerate(self._queue):
            n += len(g)
            if pos < n:
                return i
        return len(self._queue)

    def _start_tensor(self, t: TensorPlan) -> None:
        if self._fh is None:
            self._file_idx = self._file_of(self._pos)
            fname, group = self._queue[self._file_idx]
            self._fh = (self.folder / (fname + ".partial")).open("wb")
            self._fhash = hashlib.sha256()
            head = _header(group)
            self._fh.write(head)
            self._fhash.update(head)
        self._whash.update(t.hash_prefix)
        self._thash = hashlib.sha256(t.hash_prefix)

    def _record(self, t: TensorPlan, fname: str, sha256: str) -> None:
        self.result.tensors[t.name] = tensor_record(
            sha256, t.nbytes, hash_dtype(ST_DTYPES[t.dtype], t.ggml_type or None), t.shape,
            fname, t.logical_shape if t.ggml_type else None)

    def _finish_file(self) -> None:
        assert self._fh is not None
        self._fh.close()
        self._fh = None
        fname = self._queue[self._file_idx][0]
        (self.folder / (fname + ".partial")).replace(self.folder / fname)
        self.result.file_sha256[fname] = self._fhash.hexdigest()

    def close(self) -> WrittenModel:
        """Check every planned tensor was written; returns the hashes."""
        if self.expected is not None:
            if self._fh is not None:
                self._fh.close()
            raise ModelStoreError(f"internal: tensor {self.expected.name!r} was never written")
        self.result.weights_sha256 = self._whash.hexdigest()
        return self.result
