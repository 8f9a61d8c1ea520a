"""Layer building from the model store (M26 §5.7): read exactly the tensors a module
needs from the safetensors file(s), straight to the target device, one tensor at a time,
in their held format, and re-create the buffers a checkpoint does not carry.

A shard is `layers[lo:hi+1]` of the same model (gpt-fast's way: features applied from
outside, not a fork of the model code): nothing but its own tensors is read.

A store that kept a GGUF's blocks (`hashing.GGML_METADATA`) is read the same way: `read`
gives every tensor as values (blocks de-quantised exactly to fp32, `blocks.GgmlBlocks`),
`tensors(…, blocks=True)` gives the blocks themselves, for a format that holds them
(`int4`, DESIGN.md decision 15).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hearthnet.distributed_inference.engine.blocks import GgmlBlocks
from hearthnet.distributed_inference.engine.families import family
from hearthnet.distributed_inference.engine.quant import (
    BLOCK_FORMATS,
    load_module,
)
from hearthnet.errors import BadRequest, ModelNotFound, WeightsMismatch
from hearthnet.models.hashing import ggml_tensors

_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<rest>.+)$")


class WeightsReader:
    """Reads named tensors from a model folder's safetensors files, and nothing else."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.index: dict[str, Path] = {}
        self.ggml: dict[str, tuple[str, tuple[int, ...]]] = {}  # name → (type, shape)
        for f in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as st:
                    self.ggml.update(ggml_tensors(st.metadata()))
                    for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                        self.index[k] = f
            except (SafetensorError, OSError, ValueError) as e:
                raise WeightsMismatch(f"{f}: unreadable safetensors file ({e}); re-import the "
                                      f"model", file=str(f)) from e
        self.layer_prefix = self._find_layer_prefix()

    def _find_layer_prefix(self) -> str:
        for k in self.index:  # the decoder's prefix is its embedding's (not a vision tower's)
            if k.endswith("embed_tokens.weight") and \
                    any(x.startswith(k[:-len("embed_tokens.weight")] + "layers.")
                        for x in self.index):
                return k[:-len("embed_tokens.weight")]
        for k in self.index:
            m = _LAYER_KEY.match(k)
            if m:
                return m.group("prefix")
        for k in self.index:  # a partial model holding the head only (models/store.py)
            if k.endswith("embed_tokens.weight"):
                return k[:-len("embed_tokens.weight")]
        raise WeightsMismatch(f"{self.folder}: no decoder-layer tensors found")

    def keys_for_layer(self, idx: int) -> list[str]:
        p = f"{self.layer_prefix}layers.{idx}."
        return [k for k in self.index if k.startswith(p)]

    def tensors(self, keys: Iterable[str], prefix: str, device: torch.device | None = None,
                blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GgmlBlocks]]:
        """(name relative to `prefix`, tensor) for `keys`, read one at a time
        straight onto `device`, never the whole model in host memory (DESIGN.md decision 11).
        `blocks`: a tensor of GGUF blocks comes as its `GgmlBlocks` (on the host)."""
        for k in keys:
            if blocks and k in self.ggml:
                raw = self._read([k], None)[k]
                yield k[len(prefix):], GgmlBlocks(raw, *self.ggml[k])
            else:
                yield k[len(prefix):], self.read([k], device)[k]

    def shape(self, key: str, st: Any) -> tuple[int, ...]:
        """Logical shape of tensor `key` (a block tensor's values, not its bytes)."""
        if key in self.ggml:
            return self.ggml[key][1]
        return tuple(int(d) for d in st.get_slice(key).get_shape())

    def nbytes(self, keys: Iterable[str], dtype: torch.dtype) -> int:
        """Bytes `keys` take once held in `dtype` (from the headers; nothing is read)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = 0
        for f, ks in self._by_file(keys).items():
            with safe_open(str(f), framework="pt") as st:
                for k in ks:
                    n = 1
                    for d in self.shape(k, st):
                        n *= d
                    total += n * itemsize
        return total

    def _by_file(self, keys: Iterable[str]) -> dict[Path, list[str]]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.index[k], []).append(k)
        return by_file

    def read(self, keys: Iterable[str],
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Tensors `keys`, each read from its file straight onto `device` (default CPU);
        GGUF blocks de-quantised exactly to fp32 (on the host, then moved)."""
        out = self._read(keys, device)
        for k in out:
            if k in self.ggml:
                out[k] = GgmlBlocks(out[k], *self.ggml[k]).dequantise().to(out[k].device)
        return out

    def _read(self, keys: Iterable[str],
              device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Tensors `keys` as stored (GGUF blocks as their bytes)."""
        out: dict[str, torch.Tensor] = {}
        where = str(device or "cpu")
        for f, ks in self._by_file(keys).items():
            try:
                with safe_open(str(f), framework="pt", device=where) as st:
                    for k in ks:
                        out[k] = _owned(st.get_tensor(k))
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise WeightsMismatch(f"{f}: cannot read tensors ({e}); the file is corrupted "
                                      f"or truncated — re-import the model", file=str(f)) from e
        return out


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` in memory of its own: safetensors' CPU tensors alias the file's mmap, so a weights
    file truncated under a running shard would kill the process with SIGBUS on the next
    forward, with no log. Device tensors are copies already."""
    return t.clone() if t.device.type == "cpu" else t


def fill_module(module: nn.Module, reader: WeightsReader, keys: Iterable[str], prefix: str,
                fmt: str, where: str, base: Any, device: torch.device | None = None) -> None:
    """Materialise a meta module from the tensors `keys` (under `prefix`), strictly, one
    tensor at a time converted to the held format `fmt` (`quant.load_module`).

    Non-persistent buffers (not in any weights file) are then re-created as transformers'
    own loading does; anything still on meta is a `bad_request` naming family and tensor.
    """
    expected = {n for n, _ in module.state_dict().items()}
    keys = [k for k in keys if k.startswith(prefix)]
    missing = sorted(expected - {k[len(prefix):] for k in keys}
                     - _non_persistent(module))
    if missing:
        raise WeightsMismatch(f"{where}: weights do not match the model structure "
                              f"(missing {missing[:4]})")
    load_module(module, reader.tensors(keys, prefix, device, blocks=fmt in BLOCK_FORMATS),
                fmt,
                where)
    materialise_buffers(module, base, where, device or torch.device("cpu"))


def _non_persistent(module: nn.Module) -> set[str]:
    out: set[str] = set()
    for name, sub in module.named_modules():
        out.update(f"{name}.{b}" if name else b for b in sub._non_persistent_buffers_set)
    return out


def materialise_buffers(module: nn.Module, base: Any, where: str,
                         device: torch.device) -> None:
    """Re-create `module`'s meta buffers on `device` with the model class's own initialiser.

    transformers' `from_pretrained` does the same: a CPU placeholder per non-persistent
    buffer, then `_init_weights`, which skips every tensor flagged `_is_hf_initialized`
    (all the loaded weights) and fills the buffers (e.g. Gemma's `embed_scale`).
    """
    owners: list[nn.Module] = []
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                persistent = name not in sub._non_persistent_buffers_set
                sub.register_buffer(name, torch.empty_like(buf, device=device),
                                    persistent=persistent)
                owners.append(sub)
        for p in sub.parameters(recurse=False):
            p._is_hf_initialized = True  # type: ignore[attr-defined]
    init = getattr(base, "_init_weights", None)
    with torch.no_grad():
        for sub in owners:
            if init is not None:
                init(sub)
    refuse_meta(module, base.config, where)


def refuse_meta(module: nn.Module, config: Any, where: str) -> None:
    """`BadRequest` naming the family and the first tensor still on the meta device."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise BadRequest(f"{where}: family {family(config)!r}: tensor {name!r} has no "
                             f"value after loading (not in the weights and not re-creatable)"
                             f"; this family is not supported by small_model_layered",
                             family=family(config), tensor=name)


def layer_keys(reader: WeightsReader, lo: int, hi: int) -> list[str]:
    """The tensors of layers `lo..hi`; `ModelNotFound` naming the layers the folder lacks
    (a partial model's, models/store.py) before any is read."""
    keys = {i: reader.keys_for_layer(i) for i in range(lo, hi + 1)}
    missing = [i for i, ks in keys.items() if not ks]
    if missing:
        raise ModelNotFound(f"{reader.folder} holds no tensors of layers {missing[0]}.."
                            f"{missing[-1]} of [{lo}, {hi}] (a partial model holds only the "
                            f"layers it fetched); host a range it holds",
                            layers=[lo, hi], missing=[missing[0], missing[-1]])
    return [k for ks in keys.values() for k in ks]
