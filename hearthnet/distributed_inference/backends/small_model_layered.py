"""`small_model_layered`: per-layer forward for decoder-only text models (M26 §5.7).

A shard is `layers[lo:hi+1]` of the same model (gpt-fast's way: features applied from
outside, not a fork of the model code). The layers are the model family's own
`transformers` decoder-layer modules: we build the family's base model on the `meta`
device (no memory), keep the layers we host, and fill them with exactly their tensors read
from the safetensors file(s) — nothing else is read. Everything else a family needs also
comes from transformers' own modules and config, called the way the family's full model
calls them:

- the attention implementation the family's model class picks by itself (sdpa, or eager
  where the family needs it, e.g. Gemma-2's attention soft-capping);
- rotary embeddings from the base model's rotary module, one set per layer type when the
  module takes a `layer_type` (Gemma-3: different `rope_theta` for sliding and full
  layers), with any `rope_scaling` (Llama-3.x `llama3`, Phi-3 `longrope`) it implements;
- masks per layer type (`full_attention` / `sliding_attention`, from `layer_types` or
  the config's sliding-window settings) from `transformers.masking_utils`;
- the embedding module itself (Gemma's scaled embedding), whose non-persistent buffers
  (`embed_scale`) are re-created the way transformers' own loading does — a CPU
  placeholder filled by the model class's `_init_weights`;
- final-logit soft-capping from the config in the head (Gemma-2).

Covered and tested against the full transformers model (logits within 1e-4 in fp32, greedy
tokens identical, prompts longer than the sliding window): Llama (incl. Llama-3.x
`rope_scaling`), Qwen2/2.5, Qwen3, Mistral, Gemma-2, Gemma-3 (text) and Phi-3 — see
tests/helpers/tiny_models.py and tests/unit/test_families.py. Other families load when
their decoder layers take the same call (hidden state, masks, position embeddings, cache);
any tensor left unloaded is a `bad_request` naming the family and the tensor.

Layers, rotary tables and the head live on the configured device (`device.py`, issue 13):
weights go from the safetensors file straight to that device, one tensor at a time, in
their held format (float formats; the int8/int4 kernels are CPU-only and refused on a GPU).
KV caches are preallocated per session (`kv_cache.KVSlot`, sized by `max_length`) and
updated by index; a step is one small function (`LayeredSession.step`), replayed as a
captured CUDA graph for decode steps on a CUDA device, eager elsewhere.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hearthnet.distributed_inference.backends.device import (
    MemoryBudget,
    resolve_device,
)
from hearthnet.distributed_inference.backends.kv_cache import (
    BatchKV,
    KVSlot,
    PackedKV,
    attention_mask,
    batch_attention_mask,
    capacity_for,
    slot_bytes,
)
from hearthnet.distributed_inference.backends.memory import release_free_heap
from hearthnet.distributed_inference.backends.quant import (
    Int8Linear,
    compute_dtype_of,
    format_name,
    held_bytes,
    load_module,
)
from hearthnet.distributed_inference.formats import HEAD_FORMATS, QUANTISED, resolve_format
from hearthnet.errors import BadRequest, ShardUnavailable, WeightsMismatch
from hearthnet.models.store import ModelEntry

_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<rest>.+)$")


def load_config(entry: ModelEntry) -> Any:
    """The decoder's transformers config of a stored model.

    The attention implementation is left to the family's model class (it picks sdpa where
    the family supports it, eager where it does not — Gemma-2's soft-capped attention).
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(entry.path))
    return cfg.get_text_config(decoder=True)


def family(config: Any) -> str:
    """The config's `model_type` (for messages)."""
    return str(getattr(config, "model_type", "unknown"))


class _WeightsReader:
    """Reads named tensors from a model folder's safetensors files, and nothing else."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.index: dict[str, Path] = {}
        for f in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as st:
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
        raise WeightsMismatch(f"{self.folder}: no decoder-layer tensors found")

    def keys_for_layer(self, idx: int) -> list[str]:
        p = f"{self.layer_prefix}layers.{idx}."
        return [k for k in self.index if k.startswith(p)]

    def tensors(self, keys: Iterable[str], prefix: str, device: torch.device | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name relative to `prefix`, tensor) for `keys`, read one at a time (issue 12 §2)
        straight onto `device` (issue 13 §1)."""
        for k in keys:
            yield k[len(prefix):], self.read([k], device)[k]

    def nbytes(self, keys: Iterable[str], dtype: torch.dtype) -> int:
        """Bytes `keys` take once held in `dtype` (from the headers; nothing is read)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        total = 0
        for f, ks in self._by_file(keys).items():
            with safe_open(str(f), framework="pt") as st:
                for k in ks:
                    n = 1
                    for d in st.get_slice(k).get_shape():
                        n *= int(d)
                    total += n * itemsize
        return total

    def _by_file(self, keys: Iterable[str]) -> dict[Path, list[str]]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.index[k], []).append(k)
        return by_file

    def read(self, keys: Iterable[str],
             device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Tensors `keys`, each read from its file straight onto `device` (default CPU)."""
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
    forward (issue 14 §8). Device tensors are copies already."""
    return t.clone() if t.device.type == "cpu" else t


def _meta_base_model(config: Any) -> Any:
    """The family's base model (e.g. LlamaModel) on the meta device: structure, no memory."""
    from transformers import AutoModel

    from_config: Callable[..., Any] = AutoModel.from_config  # untyped in transformers
    with torch.device("meta"):
        model = from_config(config)
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def _fill(module: nn.Module, reader: _WeightsReader, keys: Iterable[str], prefix: str,
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
    load_module(module, reader.tensors(keys, prefix, device), fmt, where)
    _materialise_buffers(module, base, where, device or torch.device("cpu"))


def _non_persistent(module: nn.Module) -> set[str]:
    out: set[str] = set()
    for name, sub in module.named_modules():
        out.update(f"{name}.{b}" if name else b for b in sub._non_persistent_buffers_set)
    return out


def _materialise_buffers(module: nn.Module, base: Any, where: str,
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
    _refuse_meta(module, base.config, where)


def _refuse_meta(module: nn.Module, config: Any, where: str) -> None:
    """`BadRequest` naming the family and the first tensor still on the meta device."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:
            raise BadRequest(f"{where}: family {family(config)!r}: tensor {name!r} has no "
                             f"value after loading (not in the weights and not re-creatable)"
                             f"; this family is not supported by small_model_layered",
                             family=family(config), tensor=name)


def _layer_types(config: Any) -> list[str]:
    """Attention kind of every layer, inferred as transformers' own caches do."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unsupported = set(types) - {"full_attention", "sliding_attention"}
    if unsupported:
        raise BadRequest(f"layer types {sorted(unsupported)} are not supported by "
                         f"small_model_layered")
    return list(types)


class _Rotary:
    """The base model's rotary embedding module (a copy on the device), called as the model
    does.

    Families with one rotary per layer type (Gemma-3: `rope_theta` differs between
    sliding and full layers) take a `layer_type`; the others give one pair for all.
    """

    def __init__(self, config: Any, base: Any, where: str,
                 device: torch.device | None = None) -> None:
        with torch.device(device or "cpu"):
            self.module: nn.Module = type(base.rotary_emb)(config=config)
        _refuse_meta(self.module, config, where + " rotary embedding")
        self.per_type = "layer_type" in inspect.signature(self.module.forward).parameters
        # rope types whose frequencies depend on the step's longest position (`dynamic`
        # NTK, Phi-3's `longrope`): computed per step, as the model does, never tabled
        kinds = getattr(self.module, "rope_type", "default")
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        self.dynamic = any("dynamic" in str(k) or k == "longrope" for k in kinds)

    def __call__(self, h: torch.Tensor, pos: torch.Tensor, types: Iterable[str]
                 ) -> dict[str, Any]:
        """Position embeddings for every layer type in `types`."""
        kinds = sorted(set(types))
        if not self.per_type:
            pe = self.module(h, position_ids=pos)
            return dict.fromkeys(kinds, pe)
        return {k: self.module(h, position_ids=pos, layer_type=k) for k in kinds}


class _DecodeGraph:
    """One captured decode step (T = 1) of a slot: static input, position and output.

    Captured once per slot at position ``capacity - 1`` (a harmless write: any session
    writes a position before a query can see it), then replayed by every session that
    takes the slot — no capture on the hot path after the first (issue 13 item 3).
    """

    def __init__(self, session: LayeredSession) -> None:
        stack, slot = session.stack, session.slot
        self.x = torch.zeros(1, 1, stack.hidden_size, dtype=stack.dtype, device=stack.device)
        self.pos = torch.full((1,), slot.capacity - 1, dtype=torch.long, device=stack.device)
        before = torch.cuda.memory_allocated(stack.device)
        new_stream: Callable[..., Any] = torch.cuda.Stream  # untyped in torch
        side = new_stream(stack.device)
        side.wait_stream(torch.cuda.current_stream(stack.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: kernels chosen, workspaces allocated
                session.step(self.x, self.pos, None)
        torch.cuda.current_stream(stack.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = session.step(self.x, self.pos, None)
        self.nbytes = max(0, torch.cuda.memory_allocated(stack.device) - before)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        self.x.copy_(x)
        self.pos.fill_(pos)
        self.graph.replay()
        return self.out.clone()


class LayeredSession:
    """A sub-range `[start, end]` of a `LayeredStack` with its preallocated KV cache."""

    def __init__(self, stack: LayeredStack, start: int, end: int, max_length: int) -> None:
        self.stack, self.start, self.end, self.max_length = stack, start, end, max_length
        self.layers = stack.layers[start - stack.lo:end - stack.lo + 1]
        self._types = stack.layer_types[start:end + 1]
        self.slot = stack.take_slot(start, end, capacity_for(max_length))
        self._pe, self._kv_idx = stack.tables(self.slot.capacity)
        self._len = 0

    @property
    def length(self) -> int:
        return self._len

    @property
    def cache_bytes(self) -> int:
        return self.slot.nbytes

    def _masks(self, positions: torch.Tensor, kv_len: int | None,
               eager_plain: bool) -> dict[str, Any]:
        """One mask per layer kind; None where sdpa needs none (a plain causal step)."""
        kv_idx = self._kv_idx if kv_len is None else self._kv_idx[:kv_len]
        masks: dict[str, Any] = {}
        for kind in set(self._types):
            window = self.stack.sliding_window if kind == "sliding_attention" else None
            if eager_plain and self.stack.additive_mask is None \
                    and (window is None or int(kv_idx.shape[0]) <= window):
                masks[kind] = None
            else:
                masks[kind] = attention_mask(positions, kv_idx, window, self.stack.additive_mask)
        return masks

    def step(self, h: torch.Tensor, positions: torch.Tensor, kv_len: int | None,
             plain: bool = False) -> torch.Tensor:
        """The per-token work (gpt-fast's `decode_one_token`): `h` (1, T, H) at `positions`.

        `kv_len` None attends over the whole slot (graph-captured decode); an int attends
        over the first `kv_len` positions only (eager prefill, CPU). `plain`: a step sdpa
        can run with no mask (one query, or a prefill from position 0).
        """
        self.slot.positions, self.slot.kv_len = positions, kv_len
        masks = self._masks(positions, kv_len, plain)
        if self.stack.rotary.dynamic:
            pe = self.stack.rotary(h, positions.unsqueeze(0), self._types)
        else:
            pe = {kind: (cos[:, positions], sin[:, positions])
                  for kind, (cos, sin) in self._pe.items()}
        pos_ids = positions.unsqueeze(0)
        for layer, kind in zip(self.layers, self._types, strict=True):
            h = layer(h, attention_mask=masks[kind], position_ids=pos_ids,
                      past_key_values=self.slot, use_cache=True, position_embeddings=pe[kind])
        return h

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run positions `start_pos..` through the sub-range; see `LayerSession.forward`.

        Returns the output on the stack's device.
        """
        t = self.check(hidden, start_pos)
        self._len = min(self._len, start_pos)  # redo: the cache is cut back (rewound)
        h = hidden.to(self.stack.device, self.stack.dtype)  # (1, T, H)
        if t == 1 and self.stack.graphs:
            out = self._graph()(h, start_pos)
        else:
            positions = torch.arange(start_pos, start_pos + t, device=self.stack.device)
            out = self.step(h, positions, start_pos + t, plain=t == 1 or start_pos == 0)
        self._len = start_pos + t
        return out

    def rewind(self, start_pos: int) -> None:
        """Cut the cache back to `start_pos` before a step there (a redo, M26 §5.4)."""
        self._len = min(self._len, start_pos)

    def advance(self, length: int) -> None:
        """The cache holds `length` positions after a step."""
        self._len = length

    def _graph(self) -> _DecodeGraph:
        graph: _DecodeGraph | None = getattr(self.slot, "graph", None)
        if graph is None:
            graph = _DecodeGraph(self)
            self.slot.graph = graph  # type: ignore[attr-defined]
            self.stack.budget.reserve(graph.nbytes, "a CUDA graph's workspace")
            self.slot.nbytes += graph.nbytes
        return graph

    def check(self, hidden: torch.Tensor, start_pos: int) -> int:
        """`BadRequest` for a step this session cannot take; its number of positions."""
        if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] != self.stack.hidden_size:
            raise BadRequest(f"hidden state has shape {tuple(hidden.shape)}; expected "
                             f"(1, tokens, {self.stack.hidden_size})")
        t = int(hidden.shape[1])
        if t < 1:
            raise BadRequest("a step needs at least one position")
        if start_pos < 0 or start_pos > self._len:
            raise BadRequest(f"step starts at position {start_pos} but the session holds "
                             f"{self._len} positions (a gap; steps must be contiguous)")
        if start_pos + t > self.max_length:
            raise BadRequest(f"step would reach {start_pos + t} positions; the session's "
                             f"max_length is {self.max_length}")
        return t

    def close(self) -> None:
        """Give the cache slot back to the stack (kept for reuse while the budget allows)."""
        if self.layers is not None:
            self.stack.give_back(self.slot)
        self.layers = None  # type: ignore[assignment]


class LayeredStack:
    """Decoder layers `[lo, hi]` of one stored model, and nothing else (DESIGN.md 4).

    The layers live on `device` (issue 13 item 1); KV cache slots are preallocated there,
    counted against `budget_mb` (`shard_max_vram_mb`, M26 §5.6) together with the weights,
    and kept for reuse after a session closes (with their captured CUDA graph) until the
    budget needs the room.
    """

    def __init__(self, entry: ModelEntry, lo: int, hi: int, weights: str = "fp32", *,
                 device: str | torch.device = "cpu", budget_mb: int | None = None,
                 cuda_graphs: bool = True) -> None:
        if not (0 <= lo <= hi < entry.num_layers):
            raise BadRequest(f"layer range [{lo}, {hi}] is outside {entry.alias}'s layers; "
                             f"valid range is [0, {entry.num_layers - 1}]")
        self.format = resolve_format(format_name(weights), entry.dtype)
        self.device = resolve_device(device)
        check_device_format(self.format, self.device)
        entry.check_files()
        self.entry, self.lo, self.hi = entry, lo, hi
        self.dtype = compute_dtype_of(self.format)
        self.graphs = cuda_graphs and self.device.type == "cuda"
        self.budget = MemoryBudget(budget_mb, self.device)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)
        reader = _WeightsReader(entry.path)
        what = f"layers [{lo}, {hi}] of {entry.alias} as {self.format}"
        estimate = reader.nbytes(_layer_keys(reader, lo, hi), self.dtype)
        self.budget.reserve(estimate, what)  # before any weight is read (M26 §5.6)
        base = _meta_base_model(self.config)
        # sdpa takes boolean masks (None for a plain causal step); eager attention (the
        # family's choice, e.g. Gemma-2's soft-capping) adds a float mask
        self.additive_mask = None if base.config._attn_implementation == "sdpa" else self.dtype
        self.layers = nn.ModuleList()
        for i in range(lo, hi + 1):
            layer = base.layers[i]
            keys = reader.keys_for_layer(i)
            prefix = f"{reader.layer_prefix}layers.{i}."
            _fill(layer, reader, keys, prefix, self.format, f"{entry.path} layer {i}", base,
                  self.device)
            layer.eval()
            self.layers.append(layer)
            release_free_heap()  # the layer's conversion temporaries, not kept resident
        self.rotary = _Rotary(self.config, base, str(entry.path), self.device)
        self.graphs = self.graphs and not self.rotary.dynamic  # data-dependent rope: eager
        del base
        self.layer_types = _layer_types(self.config)
        self._tables: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
        self._idle: dict[tuple[int, int, int], list[KVSlot]] = {}
        self.budget.release(estimate)  # the held bytes, once known (quantised: fewer)
        self.budget.reserve(self.param_bytes(), what)

    def layer_indices(self) -> list[int]:
        return list(range(self.lo, self.hi + 1))

    def param_bytes(self) -> int:
        """Bytes of the hosted layers' weights in their held format."""
        return held_bytes(self.layers)

    def held_bytes(self) -> int:
        """Bytes held on the device: weights, cache slots (busy and idle), graph workspaces."""
        return self.budget.used_bytes

    def tables(self, capacity: int) -> tuple[dict[str, Any], torch.Tensor]:
        """({layer type: (cos, sin)}, kv positions) for `capacity` positions, computed once
        per capacity: a step only indexes them."""
        if capacity not in self._tables:
            pos = torch.arange(capacity, device=self.device)
            probe = torch.zeros(1, 1, self.hidden_size, dtype=self.dtype, device=self.device)
            with torch.inference_mode():
                pe = self.rotary(probe, pos.unsqueeze(0), self.layer_types)
            self._tables[capacity] = (pe, pos)
        return self._tables[capacity]

    def take_slot(self, start: int, end: int, capacity: int) -> KVSlot:
        """An idle slot of that shape, or a new one within the budget (else refused)."""
        idle = self._idle.get((start, end, capacity))
        if idle:
            return idle.pop()
        need = slot_bytes(self.config, end - start + 1, capacity, self.dtype)
        what = f"a KV cache of {capacity} positions × layers [{start}, {end}]"
        try:
            self.budget.reserve(need, what)
        except ShardUnavailable:
            if not self.drop_idle():
                raise
            self.budget.reserve(need, what)
        return KVSlot(self.config, start, end, capacity, self.dtype, self.device)

    def give_back(self, slot: KVSlot) -> None:
        """Keep a closed session's slot (and its graph) for the next session."""
        self._idle.setdefault((slot.start, slot.end, slot.capacity), []).append(slot)

    def drop_idle(self) -> bool:
        """Free every idle slot; whether anything was freed."""
        slots = [s for ss in self._idle.values() for s in ss]
        self._idle.clear()
        for s in slots:
            self.budget.release(s.nbytes)
            s.release()
        if slots and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return bool(slots)

    @torch.inference_mode()
    def decode_batch(self, sessions: list[LayeredSession], hidden: list[torch.Tensor],
                     starts: list[int]) -> torch.Tensor:
        """One decode position of each of several sessions over the same sub-range, run as
        one forward (issue 16 §1): (B, 1, H) on the device, row ``b`` for ``sessions[b]``.

        Weight reads dominate a decode step, so B rows cost about one. Each row keeps its
        own cache (`BatchKV` writes into the session's slot), rotary position and length
        (`batch_attention_mask`); rows never see each other. Eager on every device (a batch
        of one takes the session's own, possibly graph-captured, `forward`).
        """
        first = sessions[0]
        if self._check_rows(sessions, hidden, starts) != [1] * len(sessions):
            raise BadRequest("a decode batch takes one position per session")
        h = torch.cat([x.to(self.device, self.dtype) for x in hidden])  # (B, 1, H)
        positions = torch.tensor(starts, dtype=torch.long, device=self.device)
        capacity = max(s.slot.capacity for s in sessions)
        _, kv_idx = self.tables(capacity)
        kv_idx = kv_idx[:max(starts) + 1]
        cache = BatchKV([s.slot for s in sessions], positions, [p + 1 for p in starts])
        masks = {kind: batch_attention_mask(
            positions, kv_idx, self.sliding_window if kind == "sliding_attention" else None,
            self.additive_mask) for kind in set(first._types)}
        pe = {kind: (cos.transpose(0, 1), sin.transpose(0, 1)) for kind, (cos, sin) in
              self._rotary_at(h.transpose(0, 1), positions, [1] * len(sessions),
                              first._types, capacity).items()}  # (B, 1, D)
        pos_ids = positions.unsqueeze(1)
        for layer, kind in zip(first.layers, first._types, strict=True):
            h = layer(h, attention_mask=masks[kind], position_ids=pos_ids,
                      past_key_values=cache, use_cache=True, position_embeddings=pe[kind])
        for s, p in zip(sessions, starts, strict=True):
            s.advance(p + 1)
        return h

    def _check_rows(self, sessions: list[LayeredSession], hidden: list[torch.Tensor],
                    starts: list[int]) -> list[int]:
        """`BadRequest` unless every row is a valid step of a distinct session of this
        stack over one sub-range; each row's number of positions. Rewinds a redo's cache."""
        first = sessions[0]
        if len({id(s) for s in sessions}) != len(sessions):
            raise BadRequest("a batch holds at most one step per session")
        counts = []
        for s, h, p in zip(sessions, hidden, starts, strict=True):
            if s.stack is not self or (s.start, s.end) != (first.start, first.end):
                raise BadRequest("a batch holds sessions of one stack and sub-range")
            counts.append(s.check(h, p))
        for s, p in zip(sessions, starts, strict=True):
            s.rewind(p)
        return counts

    @torch.inference_mode()
    def forward_packed(self, sessions: list[LayeredSession], hidden: list[torch.Tensor],
                       starts: list[int]) -> list[torch.Tensor]:
        """Steps of several sessions over one sub-range — decode rows and prefill chunks
        alike — as one forward (issue 16 §1, mixed rounds): their positions are packed
        along the sequence dimension, ``(1, N, H)``, each with its own rotary position; a
        `PackedKV` writes each session's keys/values into its own slot and a block-diagonal
        mask keeps every token inside its own session's history. The layers' weights are
        read once for all rows. Returns each session's output, ``(1, T_r, H)`` on the
        device. Eager on every device."""
        first = sessions[0]
        counts = self._check_rows(sessions, hidden, starts)
        h = torch.cat([x.to(self.device, self.dtype) for x in hidden], dim=1)  # (1, N, H)
        cache = PackedKV([s.slot for s in sessions], starts, counts, self.device)
        positions = torch.cat(cache.at)
        masks = {kind: cache.mask(self.sliding_window if kind == "sliding_attention" else None,
                                  self.additive_mask) for kind in set(first._types)}
        pe = self._rotary_at(h, positions, counts, first._types,
                             max(s.slot.capacity for s in sessions))
        pos_ids = positions.unsqueeze(0)
        for layer, kind in zip(first.layers, first._types, strict=True):
            h = layer(h, attention_mask=masks[kind], position_ids=pos_ids,
                      past_key_values=cache, use_cache=True, position_embeddings=pe[kind])
        for s, n in zip(sessions, cache.lengths, strict=True):
            s.advance(n)
        return list(torch.split(h, counts, dim=1))

    def _rotary_at(self, h: torch.Tensor, positions: torch.Tensor, counts: list[int],
                   types: list[str], capacity: int) -> dict[str, Any]:
        """(cos, sin) of shape (1, N, D) per layer type for the N positions of `h`
        (1, N, H), each at its own ``positions[i]``; `counts` splits them by session. Rope
        whose frequencies depend on the step's longest position (dynamic, longrope) is
        computed session by session, as each session's solo step would."""
        if not self.rotary.dynamic:
            table, _ = self.tables(capacity)
            return {kind: (cos[:, positions], sin[:, positions])
                    for kind, (cos, sin) in table.items()}
        parts = [self.rotary(hs, ps.unsqueeze(0), types) for hs, ps in
                 zip(torch.split(h, counts, dim=1), torch.split(positions, counts), strict=True)]
        return {kind: (torch.cat([p[kind][0] for p in parts], dim=1),
                       torch.cat([p[kind][1] for p in parts], dim=1)) for kind in parts[0]}

    def open_session(self, start: int, end: int, max_length: int) -> LayeredSession:
        """A new session over `[start, end]` ⊆ `[lo, hi]`; `BadRequest` outside it,
        `ShardUnavailable` when its cache would exceed the memory budget."""
        if not (self.lo <= start <= end <= self.hi):
            raise BadRequest(f"sub-range [{start}, {end}] is outside the hosted layers "
                             f"[{self.lo}, {self.hi}]")
        if max_length < 1:
            raise BadRequest("max_length must be at least 1")
        return LayeredSession(self, start, end, max_length)


def check_device_format(fmt: str, device: torch.device) -> None:
    """`BadRequest` for a held format with no kernel on `device` (int8/int4: CPU only)."""
    if fmt in QUANTISED and device.type != "cpu":
        raise BadRequest(f"weights held as {fmt} run on torch's CPU kernels only (oneDNN, fbgemm, "
                         f"_weight_int8pack_mm, _weight_int4pack_mm_for_cpu); on {device} "
                         f"use bf16 or fp16", format=fmt, device=str(device))


def _layer_keys(reader: _WeightsReader, lo: int, hi: int) -> list[str]:
    return [k for i in range(lo, hi + 1) for k in reader.keys_for_layer(i)]


class LayeredHead:
    """The orchestrator's part of a model: tokenizer, embeddings, final norm, lm_head."""

    def __init__(self, entry: ModelEntry, weights: str | torch.dtype = "fp32",
                 device: str | torch.device = "cpu", *, lm_head: bool = True) -> None:
        """`lm_head=False`: tokenizer, embeddings and norm only (calibration embeds prompts
        and never needs logits; an untied 7B lm_head is 2.2 GB in fp32)."""
        from transformers import AutoTokenizer

        self.format = resolve_format(format_name(weights), entry.dtype)
        if self.format not in HEAD_FORMATS:
            raise BadRequest(f"a head holds its weights as {', '.join(HEAD_FORMATS)} (or "
                             f"native); not {self.format}")
        self.device = resolve_device(device)
        check_device_format(self.format, self.device)
        entry.check_files()
        self.entry = entry
        self.dtype = compute_dtype_of(self.format)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.tokenizer = AutoTokenizer.from_pretrained(str(entry.path))
        reader = _WeightsReader(entry.path)
        base = _meta_base_model(self.config)
        p = reader.layer_prefix
        self.embed_tokens: nn.Module = base.embed_tokens
        self.norm: nn.Module = base.norm
        self._load_embeddings(reader, p + "embed_tokens.", base)
        norm_keys = [k for k in reader.index if k.startswith(p + "norm.")]
        _fill(self.norm, reader, norm_keys, p + "norm.", self.format, f"{entry.path} norm", base,
              self.device)
        self.embed_tokens.eval()
        self.norm.eval()
        # Gemma-2's final-logit soft-capping, applied as its CausalLM head does
        cap = getattr(self.config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None
        self.lm_head_q: Int8Linear | None = None
        self.lm_head_weight: torch.Tensor = torch.empty(0)
        if lm_head:
            self._load_lm_head(reader)
        self.eos_token_ids = self._eos_ids()
        del base

    def _load_embeddings(self, reader: _WeightsReader, prefix: str, base: Any) -> None:
        """Embeddings as held: a float matrix, or (int8) an `Int8Linear` whose rows are
        looked up — the family's embedding module keeps its scale buffers (Gemma)."""
        where = f"{self.entry.path} embeddings"
        self.embed_q: Int8Linear | None = None
        if self.format != "int8":
            _fill(self.embed_tokens, reader, [prefix + "weight"], prefix, self.format, where,
                  base, self.device)
            return
        self.embed_q = Int8Linear(reader.read([prefix + "weight"])[prefix + "weight"], None,
                                  keep_rows=True)
        self.embed_tokens.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        _materialise_buffers(self.embed_tokens, base, where, self.device)

    def _load_lm_head(self, reader: _WeightsReader) -> None:
        tied = "lm_head.weight" not in reader.index or bool(
            getattr(self.config, "tie_word_embeddings", False))  # M26: lm_head tied or not
        if self.format == "int8":
            if tied and self.embed_q is not None:
                self.embed_q.pack()  # rows for embeddings, packed for the product
            self.lm_head_q = self.embed_q if tied else Int8Linear(
                reader.read(["lm_head.weight"])["lm_head.weight"], None)
        elif tied:
            self.lm_head_weight = self.embed_tokens.weight  # type: ignore[assignment]
        else:
            self.lm_head_weight = reader.read(["lm_head.weight"], self.device)[
                "lm_head.weight"].to(self.dtype)

    def param_bytes(self) -> int:
        """Bytes of the head's weights in their held format (a tied matrix counted once)."""
        mods = [self.embed_tokens, self.norm, *(m for m in (self.embed_q, self.lm_head_q) if m)]
        total = held_bytes(nn.ModuleList(mods))
        emb: torch.Tensor = self.embed_tokens.weight  # type: ignore[assignment]
        if self.lm_head_weight.numel() and self.lm_head_weight.data_ptr() != emb.data_ptr():
            total += self.lm_head_weight.numel() * self.lm_head_weight.element_size()
        return total

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = self.entry.path / "generation_config.json"
        if gen.is_file():
            e: Any = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` with the model's chat template and a generation prompt."""
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) \
                    or m.get("role") not in ("system", "user", "assistant"):
                raise BadRequest("each message needs a role (system|user|assistant) and "
                                 "string content")
        if not self.tokenizer.chat_template:
            text = "".join(m["content"] + "\n" for m in messages)
            return list(self.tokenizer(text)["input_ids"])
        out: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)
        ids: Any = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """(1, T, H) input hidden state for `token_ids`, on the head's device."""
        ids = torch.tensor([token_ids], dtype=torch.long).to(self.device, non_blocking=True)
        if self.embed_q is None:
            out: torch.Tensor = self.embed_tokens(ids)
            return out
        rows = self.embed_q.rows(ids)
        scale = getattr(self.embed_tokens, "embed_scale", None)  # Gemma's scaled embedding
        return rows * scale.float() if scale is not None else rows

    def embed_host(self, token_ids: list[int]) -> torch.Tensor:
        """`embed` as a host tensor the caller owns (sent to a shard, kept for replay)."""
        return self.embed(token_ids).cpu()

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(vocab,) fp32 host logits of the last position of a (1, T, H) final hidden state
        (from any device): the sampler and its seeded generator stay on the host."""
        return self.logits_batch([hidden_last])[0]

    @torch.inference_mode()
    def logits_batch(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`logits` of several chats' final hidden states as one norm + lm_head product
        (issue 16 §3): the lm_head's weights are read once for all rows."""
        h = torch.cat([x[:, -1:, :].to(self.device, self.dtype) for x in hidden])  # (B, 1, H)
        h = self.norm(h)
        if self.lm_head_q is not None:
            logits = self.lm_head_q(h)[:, -1]
        else:
            logits = torch.nn.functional.linear(h, self.lm_head_weight)[:, -1]
        assert isinstance(logits, torch.Tensor)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return list(logits.float().cpu().unbind(0))
