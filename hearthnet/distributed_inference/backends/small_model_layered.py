"""`small_model_layered`: per-layer forward for small decoder-only models (M26 §5.7).

A shard is `layers[lo:hi+1]` of the same model (gpt-fast's way: features applied from
outside, not a fork of the model code). The layers are the model family's own
`transformers` decoder-layer modules: we build the family's base model on the `meta`
device (no memory), keep the layers we host, and fill them with exactly their tensors read
from the safetensors file(s) — nothing else is read. Rotary embeddings and attention masks
come from the same transformers modules, so Llama, Qwen2, Qwen3, Mistral (and other
families with the same decoder-layer calling convention) need no per-family code.

KV caches are transformers `DynamicCache`s, one per session; a session over `[start, end]`
only fills the cache layers of that sub-range.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

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
    """The transformers config of a stored model, set up for CPU inference."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(entry.path))
    cfg._attn_implementation = "sdpa"
    return cfg


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
        for k in self.index:
            m = _LAYER_KEY.match(k)
            if m:
                return m.group("prefix")
        raise WeightsMismatch(f"{self.folder}: no decoder-layer tensors found")

    def keys_for_layer(self, idx: int) -> list[str]:
        p = f"{self.layer_prefix}layers.{idx}."
        return [k for k in self.index if k.startswith(p)]

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


def _fill(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str,
          dtype: torch.dtype, where: str) -> None:
    """Materialise a meta module from `tensors` (keys under `prefix`), strictly."""
    sd = {k[len(prefix):]: v.to(dtype) for k, v in tensors.items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise WeightsMismatch(
            f"{where}: weights do not match the model structure "
            f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")


def _layer_types(config: Any) -> list[str]:
    """Attention kind of every layer, inferred as transformers' own caches do."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unsupported = set(types) - {"full_attention", "sliding_attention"}
    if unsupported:
        raise BadRequest(f"layer types {sorted(unsupported)} are not supported by "
                         f"small_model_layered")
    return list(types)


def _rotary(config: Any, base: Any) -> nn.Module:
    """A real (CPU) copy of the base model's rotary embedding module."""
    with torch.device("cpu"):
        rotary: nn.Module = type(base.rotary_emb)(config=config)
    return rotary


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
        pe = self.stack.rotary(h, position_ids=pos)
        for layer, kind in zip(self.layers, self._types, strict=True):
            h = layer(h, attention_mask=masks[kind], position_ids=pos,
                      past_key_values=self.cache, use_cache=True, position_embeddings=pe)
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

    def __init__(self, entry: ModelEntry, lo: int, hi: int, dtype: str | torch.dtype = "fp32"):
        if not (0 <= lo <= hi < entry.num_layers):
            raise BadRequest(f"layer range [{lo}, {hi}] is outside {entry.alias}'s layers; "
                             f"valid range is [0, {entry.num_layers - 1}]")
        entry.check_files()
        self.entry, self.lo, self.hi = entry, lo, hi
        self.dtype = compute_dtype(dtype)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        reader = _WeightsReader(entry.path)
        base = _meta_base_model(self.config)
        self.layers = nn.ModuleList()
        for i in range(lo, hi + 1):
            layer = base.layers[i]
            keys = reader.keys_for_layer(i)
            prefix = f"{reader.layer_prefix}layers.{i}."
            _fill(layer, reader.read(keys), prefix, self.dtype, f"{entry.path} layer {i}")
            layer.eval()
            self.layers.append(layer)
        self.rotary = _rotary(self.config, base)
        del base
        self.layer_types = _layer_types(self.config)

    def layer_indices(self) -> list[int]:
        return list(range(self.lo, self.hi + 1))

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.layers.parameters())

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

    def __init__(self, entry: ModelEntry, dtype: str | torch.dtype = "fp32") -> None:
        from transformers import AutoTokenizer

        entry.check_files()
        self.entry = entry
        self.dtype = compute_dtype(dtype)
        self.config = load_config(entry)
        self.hidden_size = int(self.config.hidden_size)
        self.num_layers = int(self.config.num_hidden_layers)
        self.tokenizer = AutoTokenizer.from_pretrained(str(entry.path))
        reader = _WeightsReader(entry.path)
        base = _meta_base_model(self.config)
        p = reader.layer_prefix
        self.embed_tokens: nn.Module = base.embed_tokens
        self.norm: nn.Module = base.norm
        _fill(self.embed_tokens, reader.read([p + "embed_tokens.weight"]), p + "embed_tokens.",
              self.dtype, f"{entry.path} embeddings")
        norm_keys = [k for k in reader.index if k.startswith(p + "norm.")]
        _fill(self.norm, reader.read(norm_keys), p + "norm.", self.dtype, f"{entry.path} norm")
        if "lm_head.weight" in reader.index and not getattr(self.config, "tie_word_embeddings",
                                                             False):
            w = reader.read(["lm_head.weight"])["lm_head.weight"].to(self.dtype)
        else:
            w = self.embed_tokens.weight  # tied (M26: lm_head tied or not)
        self.lm_head_weight: torch.Tensor = w
        self.eos_token_ids = self._eos_ids()
        del base

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
        return self.embed_tokens(ids)

    @torch.inference_mode()
    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """(vocab,) fp32 logits of the last position of a (1, T, H) final hidden state."""
        h = self.norm(hidden_last[:, -1:, :].to(self.dtype))
        return torch.nn.functional.linear(h, self.lm_head_weight)[0, -1].float()
