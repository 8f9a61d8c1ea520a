"""The forward of a shard's layers (M26 §5.7): `LayeredStack` holds `layers[lo:hi+1]`
of a model, `LayeredSession` is one session's sub-range with its KV cache.

KV caches are preallocated per session (`kv_cache.KVSlot`, sized by `max_length`) and
updated by index; a step is one small function (`LayeredSession.step`, gpt-fast's
`decode_one_token`), replayed as a captured CUDA graph for decode steps on a CUDA device,
run as a compiled function on the CPU once it is ready (`compiled.CompiledDecode`,
built in the background and cached in the data dir) and eager elsewhere. Batched decode
steps of several sessions run as one forward (`LayeredStack.forward_packed`), each
session's queries attending over its own cache where it lies (`attention`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hearthnet.distributed_inference.directory.formats import (
    resolve_format,
)
from hearthnet.distributed_inference.engine import attention, tracegate
from hearthnet.distributed_inference.engine.compiled import CompiledDecode
from hearthnet.distributed_inference.engine.device import (
    MemoryBudget,
    resolve_device,
)
from hearthnet.distributed_inference.engine.families import (
    check_device_format,
    layer_types,
    load_config,
    meta_base_model,
)
from hearthnet.distributed_inference.engine.kv_cache import (
    KVSlot,
    SegmentsKV,
    attention_mask,
    capacity_for,
    slot_bytes,
)
from hearthnet.distributed_inference.engine.memory import release_free_heap
from hearthnet.distributed_inference.engine.quant import (
    compute_dtype_of,
    format_name,
    held_bytes,
)
from hearthnet.distributed_inference.engine.speculation import DEFAULT_MAX_PROPOSED
from hearthnet.distributed_inference.engine.weights import (
    WeightsReader,
    fill_module,
    layer_keys,
    refuse_meta,
)
from hearthnet.errors import BadRequest, ShardUnavailable
from hearthnet.models.store import ModelEntry

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.base import LayerSession

# the rows of every step replayed as a CUDA graph (`_DecodeGraph`): at least a speculative
# pass's last token and its proposals (speculation.DEFAULT_MAX_PROPOSED), rounded up to 16,
# a tile of the GPU's matrix units
GRAPH_ROWS = max(16, 1 + DEFAULT_MAX_PROPOSED)


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
        refuse_meta(self.module, config, where + " rotary embedding")
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
    """One captured step of `GRAPH_ROWS` positions of a slot (static input, positions and
    output), replayed for every step of 1..`GRAPH_ROWS` positions after the prompt's first
    chunk: a decode step (1) and a speculative pass (the last token and its proposals).

    A step of fewer positions fills the rest with copies of its last position (same input,
    same position: they compute and write exactly what it does), so every replay runs the
    same kernels on the same number of rows. A row's result then does not depend on how
    many rows came with it: a speculative pass's rows are bit for bit the plain decode
    steps' (on a GPU a product of 1 row and one of 5 round differently in bf16, enough to
    change a greedy answer: M26 §5.4, DESIGN.md decision 16), and a pass costs what a
    decode step does. The padding costs the GPU's share of a decode step about 14 % on an
    H100 against a 1-row graph (docs/benchmarks.md, "GPUs, 27 Nov 2026"). Eager, a step
    costs the GPU its kernels' launches from Python: 36.6 ms against 6.7 replayed for the
    3B shape on an H100.

    Captured once per slot at the slot's last position (a harmless write: any session writes
    a position before a query can see it) and kept with the slot for every session that
    takes it — no capture on the hot path after the first (DESIGN.md decision 11).
    """

    def __init__(self, session: LayeredSession) -> None:
        stack, slot = session.stack, session.slot
        rows = GRAPH_ROWS
        self.x = torch.zeros(1, rows, stack.hidden_size, dtype=stack.dtype, device=stack.device)
        self.pos = torch.full((rows,), slot.capacity - 1, dtype=torch.long, device=stack.device)
        # row i of a step of t positions is position min(i, t - 1) after its start
        self._offsets = {t: torch.arange(rows, device=stack.device).clamp_(max=t - 1)
                         for t in range(1, rows + 1)}
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
        t = int(x.shape[1])
        self.x[:, :t].copy_(x)
        self.x[:, t:].copy_(x[:, -1:].expand(-1, GRAPH_ROWS - t, -1))
        torch.add(self._offsets[t], pos, out=self.pos)
        self.graph.replay()
        return self.out[:, :t].clone()


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
        with tracegate.eager():  # not while a tracer has patched nn.Module (tracegate.py)
            if self.stack.rotary.dynamic:
                pe = self.stack.rotary(h, positions.unsqueeze(0), self._types)
            else:
                pe = {kind: (cos[:, positions], sin[:, positions])
                      for kind, (cos, sin) in self._pe.items()}
            pos_ids = positions.unsqueeze(0)
            beat = None if torch.compiler.is_compiling() else self.stack.on_layer
            for layer, kind in zip(self.layers, self._types, strict=True):
                h = layer(h, attention_mask=masks[kind], position_ids=pos_ids,
                          use_cache=True, position_embeddings=pe[kind],
                          **{self.stack.cache_arg: self.slot})
                if beat is not None:
                    beat()
        return h

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run positions `start_pos..` through the sub-range; see `LayerSession.forward`.

        Returns the output on the stack's device.
        """
        t = self.check(hidden, start_pos)
        self._len = min(self._len, start_pos)  # redo: the cache is cut back (rewound)
        h = hidden.to(self.stack.device, self.stack.dtype)  # (1, T, H)
        compiled = None
        if self.stack.compiled is not None and (t == 1 or start_pos > 0):
            compiled = self.stack.compiled.step_for(self, start_pos + 1) if t == 1 \
                else self.stack.compiled.rows_step_for(self, t, start_pos + t)
        if self.stack.graphs and (t == 1 or (start_pos > 0 and t <= GRAPH_ROWS)):
            out = self._graph()(h, start_pos)
        elif compiled is not None:  # a decode step, or a speculative pass's few rows
            positions = torch.arange(start_pos, start_pos + t, device=self.stack.device)
            # contiguous: the compiled step reads its inputs by the strides it was traced
            # with and does not check them (`compiled._aot_compile`)
            out = compiled(self, h.contiguous(), positions, start_pos + t)
        else:
            positions = torch.arange(start_pos, start_pos + t, device=self.stack.device)
            out = self.step(h, positions, start_pos + t, plain=t == 1 or start_pos == 0)
        self._len = start_pos + t
        return out

    @torch.inference_mode()
    def copy_prefix(self, source: LayerSession, positions: int) -> int:
        """Take the first `positions` cached positions of `source` — a session of the same
        stack and sub-range whose inputs there equal this one's (the orchestrator knows: a
        prompt that shares its first tokens with another of its calls) — instead of
        computing them: this session then holds them, and its first step starts there.
        Copies as many as `source` holds, keeping at least one position of this session's
        own to compute; returns how many (0: none; a session that holds positions already
        takes none)."""
        if not isinstance(source, LayeredSession) or source.stack is not self.stack \
                or (source.start, source.end) != (self.start, self.end) \
                or source.layers is None or self._len:
            return 0
        n = max(0, min(positions, source.length, self.max_length - 1))
        for mine, theirs in zip(self.slot.keys + self.slot.values,
                                source.slot.keys + source.slot.values, strict=True):
            mine[:, :, :n].copy_(theirs[:, :, :n])
        self._len = n
        return n

    def rewind(self, start_pos: int) -> None:
        """Cut the cache back to `start_pos` before a step there (a redo, M26 §5.4)."""
        self._len = min(self._len, start_pos)

    def advance(self, length: int) -> None:
        """The cache holds `length` positions after a step."""
        self._len = length

    def _graph(self) -> _DecodeGraph:
        graph: _DecodeGraph | None = self.slot.graph
        if graph is None:
            graph = _DecodeGraph(self)
            self.slot.graph = graph
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

    The layers live on `device` (DESIGN.md decision 11); KV cache slots are preallocated there,
    counted against `budget_mb` (`shard_max_vram_mb`, M26 §5.6) together with the weights,
    and kept for reuse after a session closes (with their captured CUDA graph) until the
    budget needs the room.
    """

    def __init__(self, entry: ModelEntry, lo: int, hi: int, weights: str = "fp32", *,
                 device: str | torch.device = "cpu", budget_mb: int | None = None,
                 cuda_graphs: bool = True, compile_decode: bool = False,
                 compile_dir: Path | None = None) -> None:
        """`compile_decode`: on the CPU, decode steps run compiled once compiled (in the
        background; saved in and loaded from `compile_dir` when given)."""
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
        reader = WeightsReader(entry.path)
        what = f"layers [{lo}, {hi}] of {entry.alias} as {self.format}"
        estimate = reader.nbytes(layer_keys(reader, lo, hi), self.dtype)
        self.budget.reserve(estimate, what)  # before any weight is read (M26 §5.6)
        base = meta_base_model(self.config)
        # sdpa takes boolean masks (None for a plain causal step); eager attention (the
        # family's choice, e.g. Gemma-2's soft-capping) adds a float mask
        self.additive_mask = None if base.config._attn_implementation == "sdpa" else self.dtype
        self.layers = nn.ModuleList()
        for i in range(lo, hi + 1):
            layer = base.layers[i]
            keys = reader.keys_for_layer(i)
            prefix = f"{reader.layer_prefix}layers.{i}."
            fill_module(layer, reader, keys, prefix, self.format, f"{entry.path} layer {i}",
                        base, self.device)
            layer.eval()
            self.layers.append(layer)
            release_free_heap()  # the layer's conversion temporaries, not kept resident
        attention.install(base.config, self.layers)  # batched rows attend in place
        # layer index -> its attention module (a compiled round's attention op finds them)
        self._attention_modules = {i: layer.self_attn
                                   for i, layer in zip(range(lo, hi + 1), self.layers,
                                                       strict=True)}
        self.rotary = _Rotary(self.config, base, str(entry.path), self.device)
        self.graphs = self.graphs and not self.rotary.dynamic  # data-dependent rope: eager
        del base
        self.layer_types = layer_types(self.config)
        # the name the installed transformers gives the cache argument of a decoder layer
        # (`cache` from 5.2x; `past_key_values`, deprecated there, before): no warning
        forward = inspect.signature(type(self.layers[0]).forward).parameters
        self.cache_arg = "cache" if "cache" in forward else "past_key_values"
        # called after each decoder layer of an eager forward (a compiled step has no
        # hook): a shard's sign of life while one long forward runs (docs/protocol.md §3.6a)
        self.on_layer: Callable[[], None] | None = None
        self._tables: dict[int, tuple[dict[str, Any], torch.Tensor]] = {}
        self._idle: dict[tuple[int, int, int], list[KVSlot]] = {}
        self.budget.release(estimate)  # the held bytes, once known (quantised: fewer)
        self.budget.reserve(self.param_bytes(), what)
        self.compiled = CompiledDecode(self, compile_dir) \
            if compile_decode and self.device.type == "cpu" else None

    def compile_state(self) -> dict[str, str]:
        """Per sub-range, what its decode steps run as (`CompiledDecode.state`; CUDA:
        captured graphs or eager)."""
        if self.compiled is not None:
            return self.compiled.state()
        return {"all": "cuda graphs" if self.graphs else "eager"}

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
            with torch.inference_mode(), tracegate.eager():  # a module call (tracegate.py)
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
        one forward (DESIGN.md decision 12): (B, 1, H) on the device, row ``b`` for
        ``sessions[b]`` (`forward_packed` with one position per session)."""
        if [int(x.shape[1]) for x in hidden] != [1] * len(hidden):
            raise BadRequest("a decode batch takes one position per session")
        return torch.cat(self.forward_packed(sessions, hidden, starts))

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
        alike — as one forward (mixed rounds, DESIGN.md decision 12): their positions are
        packed along the sequence dimension, ``(1, N, H)``, each with its own rotary
        position, so the layers' weights are read once for all rows. A `SegmentsKV`
        writes each session's keys/values into its own slot, and each session's queries
        attend over its own slot where it lies (`attention.segments_attention`): no
        history is copied, and rows never see each other. Returns each session's output,
        ``(1, T_r, H)`` on the device. A round of decode rows alone runs compiled on the
        CPU once its step is ready (`compiled.round_step`); anything else eagerly (a lone
        session takes its own, possibly compiled or graph-captured, `forward`).

        Where steps replay CUDA graphs, each session takes its own `forward` in turn: a
        replay costs a fraction of an eager forward's kernel launches (2.9 against about 18 ms
        for half the 3B shape on an H100), so up to several rows replayed one after another
        beat one eager forward of all, and each row is then exactly its solo step."""
        first = sessions[0]
        counts = self._check_rows(sessions, hidden, starts)
        if self.graphs:
            return [s.forward(x, p) for s, x, p in zip(sessions, hidden, starts, strict=True)]
        h = torch.cat([x.to(self.device, self.dtype) for x in hidden], dim=1)  # (1, N, H)
        cache = SegmentsKV([s.slot for s in sessions], starts, counts, first._types,
                           self.sliding_window, self.additive_mask, self.device)
        capacity = max(s.slot.capacity for s in sessions)
        compiled = None
        if self.compiled is not None and len(counts) > 1 and counts == [1] * len(counts):
            compiled = self.compiled.round_step_for(first, len(counts))
        if compiled is not None:  # a decode round: one position of each session
            h = self.run_round(compiled, first, h.contiguous(), cache, capacity)
        else:
            h = self.forward_rows(first, h, cache, capacity)
        for s, n in zip(sessions, cache.lengths, strict=True):
            s.advance(n)
        return list(torch.split(h, counts, dim=1))

    def forward_rows(self, first: LayeredSession, h: torch.Tensor, cache: SegmentsKV,
                     capacity: int) -> torch.Tensor:
        """`forward_packed`'s eager forward of the packed rows `h` (1, N, H)."""
        positions = torch.cat(cache.at)
        with tracegate.eager():  # not while a tracer has patched nn.Module (tracegate.py)
            pe = self._rotary_at(h, positions, cache.counts, first._types, capacity)
            pos_ids = positions.unsqueeze(0)
            beat = self.on_layer
            for layer, kind in zip(first.layers, first._types, strict=True):
                h = layer(h, attention_mask=None, position_ids=pos_ids, use_cache=True,
                          position_embeddings=pe[kind], **{self.cache_arg: cache,
                                                           attention.SEGMENTS_KWARG: cache})
                if beat is not None:
                    beat()
        return h

    def run_round(self, fn: Callable[..., torch.Tensor], first: LayeredSession,
                  h: torch.Tensor, cache: SegmentsKV, capacity: int) -> torch.Tensor:
        """A compiled decode round (`compiled.round_step`): one row per session of `cache`,
        their attention served by `attention.round_attention` on this thread."""
        table, _ = self.tables(capacity)
        with attention.decode_round(cache, self._attention_modules):
            return fn(first, h, torch.cat(cache.at), table)

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
