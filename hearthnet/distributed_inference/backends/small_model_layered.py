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

KV caches are transformers `DynamicCache`s, one per session; a session over `[start, end]`
only fills the cache layers of that sub-range.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hearthnet.distributed_inference.backends.quant import (
    Int8Linear,
    compute_dtype_of,
    format_name,
    held_bytes,
    load_module,
)
from hearthnet.distributed_inference.formats import HEAD_FORMATS, resolve_format
from hearthnet.errors import BadRequest, WeightsMismatch
from hearthnet.models.store import ModelEntry

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_LAYER_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<idx>\d+)\.(?P<rest>.+)$")


def compute_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map "fp32"/"bf16"/... to a torch dtype; `BadRequest` for anything else."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise BadRequest(f"unknown dtype {name!r}; use fp32 or bf16") from None


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

    def tensors(self, keys: Iterable[str], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name relative to `prefix`, tensor) for `keys`, read one at a time (issue 12 §2)."""
        for k in keys:
            yield k[len(prefix):], self.read([k])[k]

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.index[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for f, ks in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as st:
                    for k in ks:
                        out[k] = st.get_tensor(k)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise WeightsMismatch(f"{f}: cannot read tensors ({e}); the file is corrupted "
                                      f"or truncated — re-import the model", file=str(f)) from e
        return out


def _meta_base_model(config: Any) -> Any:
    """The family's base model (e.g. LlamaModel) on the meta device: structure, no memory."""
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def _fill(module: nn.Module, reader: _WeightsReader, keys: Iterable[str], prefix: str,
          fmt: str, where: str, base: Any) -> None:
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
    load_module(module, reader.tensors(keys, prefix), fmt, where)
    _materialise_buffers(module, base, where)


def _non_persistent(module: nn.Module) -> set[str]:
    out: set[str] = set()
    for name, sub in module.named_modules():
        out.update(f"{name}.{b}" if name else b for b in sub._non_persistent_buffers_set)
    return out


def _materialise_buffers(module: nn.Module, base: Any, where: str) -> None:
    """Re-create `module`'s meta buffers on CPU with the model class's own initialiser.

    transformers' `from_pretrained` does the same: a CPU placeholder per non-persistent
    buffer, then `_init_weights`, which skips every tensor flagged `_is_hf_initialized`
    (all the loaded weights) and fills the buffers (e.g. Gemma's `embed_scale`).
    """
    owners: list[nn.Module] = []
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                persistent = name not in sub._non_persistent_buffers_set
                sub.register_buffer(name, torch.empty_like(buf, device="cpu"),
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
    """The base model's rotary embedding module (a CPU copy), called as the model does.

    Families with one rotary per layer type (Gemma-3: `rope_theta` differs between
    sliding and full layers) take a `layer_type`; the others give one pair for all.
    """

    def __init__(self, config: Any, base: Any, where: str) -> None:
        with torch.device("cpu"):
            self.module: nn.Module = type(base.rotary_emb)(config=config)
        _refuse_meta(self.module, config, where + " rotary embedding")
        self.per_type = "layer_type" in inspect.signature(self.module.forward).parameters

    def __call__(self, h: torch.Tensor, pos: torch.Tensor, types: Iterable[str]
                 ) -> dict[str, Any]:
        """Position embeddings for every layer type in `types`."""
        kinds = sorted(set(types))
        if not self.per_type:
            pe = self.module(h, position_ids=pos)
            return dict.fromkeys(kinds, pe)
        return {k: self.module(h, position_ids=pos, layer_type=k) for k in kinds}


class LayeredSession:
    """A sub-range `[start, end]` of a `LayeredStack` with its own KV cache (DESIGN.md 2)."""

    def __init__(self, stack: LayeredStack, start: int, end: int, max_length: int) -> None:
        from transformers import DynamicCache

        self.stack, self.start, self.end, self.max_length = stack, start, end, max_length
        self.layers = stack.layers[start - stack.lo:end - stack.lo + 1]
        self.cache: Any = DynamicCache(config=stack.config)
        self._len = 0
        self._types = stack.layer_types[start:end + 1]

    @property
    def length(self) -> int:
        return self._len

    def _masks(self, hidden: torch.Tensor, pos: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        masks: dict[str, Any] = {}
        for kind, fn in (("full_attention", create_causal_mask),
                         ("sliding_attention", create_sliding_window_causal_mask)):
            if kind in self._types:
                idx = self.start + self._types.index(kind)
                masks[kind] = fn(config=self.stack.config, inputs_embeds=hidden,
                                 attention_mask=None, past_key_values=self.cache,
                                 position_ids=pos, layer_idx=idx)
        return masks

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run positions `start_pos..` through the sub-range; see `LayerSession.forward`."""
        t = self._check(hidden, start_pos)
        if start_pos < self._len:
            self.cache.crop(start_pos - self._len)  # redo: cut the cache back
            self._len = start_pos
        h = hidden.to(self.stack.dtype)  # (1, T, H)
        pos = torch.arange(start_pos, start_pos + t).unsqueeze(0)  # (1, T)
        masks = self._masks(h, pos)
        pe = self.stack.rotary(h, pos, self._types)
        for layer, kind in zip(self.layers, self._types, strict=True):
            h = layer(h, attention_mask=masks[kind], position_ids=pos,
                      past_key_values=self.cache, use_cache=True, position_embeddings=pe[kind])
        self._len = start_pos + t
        return h

    def _check(self, hidden: torch.Tensor, start_pos: int) -> int:
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
        self.cache = None
        self.layers = nn.ModuleList()


class LayeredStack:
    """Decoder layers `[lo, hi]` of one stored model, and nothing else (DESIGN.md 4)."""

    def __init__(self, entry: ModelEntry, lo: int, hi: int, weights: str = "fp32"):
        if not (0 <= lo <= hi < entry.num_layers):
            raise BadRequest(f"layer range [{lo}, {hi}] is outside {entry.alias}'s layers; "
                             f"valid range is [0, {entry.num_layers - 1}]")
        self.format = resolve_format(format_name(weights), entry.dtype)
        entry.check_files()
        self.entry, self.lo, self.hi = entry, lo, hi
        self.dtype = compute_dtype_of(self.format)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        reader = _WeightsReader(entry.path)
        base = _meta_base_model(self.config)
        self.layers = nn.ModuleList()
        for i in range(lo, hi + 1):
            layer = base.layers[i]
            keys = reader.keys_for_layer(i)
            prefix = f"{reader.layer_prefix}layers.{i}."
            _fill(layer, reader, keys, prefix, self.format, f"{entry.path} layer {i}", base)
            layer.eval()
            self.layers.append(layer)
        self.rotary = _Rotary(self.config, base, str(entry.path))
        del base
        self.layer_types = _layer_types(self.config)

    def layer_indices(self) -> list[int]:
        return list(range(self.lo, self.hi + 1))

    def param_bytes(self) -> int:
        """Bytes of the hosted layers' weights in their held format."""
        return held_bytes(self.layers)

    def open_session(self, start: int, end: int, max_length: int) -> LayeredSession:
        """A new session over `[start, end]` ⊆ `[lo, hi]`; `BadRequest` outside it."""
        if not (self.lo <= start <= end <= self.hi):
            raise BadRequest(f"sub-range [{start}, {end}] is outside the hosted layers "
                             f"[{self.lo}, {self.hi}]")
        if max_length < 1:
            raise BadRequest("max_length must be at least 1")
        return LayeredSession(self, start, end, max_length)


class LayeredHead:
    """The orchestrator's part of a model: tokenizer, embeddings, final norm, lm_head."""

    def __init__(self, entry: ModelEntry, weights: str | torch.dtype = "fp32") -> None:
        from transformers import AutoTokenizer

        self.format = resolve_format(format_name(weights), entry.dtype)
        if self.format not in HEAD_FORMATS:
            raise BadRequest(f"a head holds its weights as {', '.join(HEAD_FORMATS)} (or "
                             f"native); not {self.format}")
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
        _fill(self.norm, reader, norm_keys, p + "norm.", self.format, f"{entry.path} norm", base)
        self.embed_tokens.eval()
        self.norm.eval()
        # Gemma-2's final-logit soft-capping, applied as its CausalLM head does
        cap = getattr(self.config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None
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
                  base)
            return
        self.embed_q = Int8Linear(reader.read([prefix + "weight"])[prefix + "weight"], None)
        self.embed_tokens.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        _materialise_buffers(self.embed_tokens, base, where)

    def _load_lm_head(self, reader: _WeightsReader) -> None:
        tied = "lm_head.weight" not in reader.index or bool(
            getattr(self.config, "tie_word_embeddings", False))  # M26: lm_head tied or not
        self.lm_head_q: Int8Linear | None = None
        self.lm_head_weight: torch.Tensor = torch.empty(0)
        if self.format == "int8":
            self.lm_head_q = self.embed_q if tied else Int8Linear(
                reader.read(["lm_head.weight"])["lm_head.weight"], None)
        elif tied:
            self.lm_head_weight = self.embed_tokens.weight  # type: ignore[assignment]
        else:
            self.lm_head_weight = reader.read(["lm_head.weight"])["lm_head.weight"].to(
                self.dtype)

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
        """(1, T, H) input hidden state for `token_ids`."""
        ids = torch.tensor([token_ids], dtype=torch.long)
        if self.embed_q is None:
            out: torch.Tensor = self.embed_tokens(ids)
            return out
        rows = self.embed_q.rows(ids)
        scale = getattr(self.embed_tokens, "embed_scale", None)  # Gemma's scaled embedding
        return rows * scale.float() if scale is not None else rows

    @torch.inference_mode()
    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(vocab,) fp32 logits of the last position of a (1, T, H) final hidden state."""
        h = self.norm(hidden_last[:, -1:, :].to(self.dtype))
        if self.lm_head_q is not None:
            logits = self.lm_head_q(h)[0, -1]
        else:
            logits = torch.nn.functional.linear(h, self.lm_head_weight)[0, -1]
        assert isinstance(logits, torch.Tensor)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
