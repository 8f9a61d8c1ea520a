"""Model families (M26 §5.7): a stored model's transformers config, its base model built
on the `meta` device, the attention kind of every layer, and which formats a device takes.

The layers are the family's own `transformers` decoder-layer modules, not a copy of their
code; everything a family needs beside them comes from transformers' own modules and
config, called the way the family's full model calls them:

- the attention implementation the family's model class picks by itself (sdpa, or eager
  where the family needs it, e.g. Gemma-2's attention soft-capping);
- rotary embeddings from the base model's rotary module, one set per layer type when the
  module takes a `layer_type` (Gemma-3: different `rope_theta` for sliding and full
  layers), with any `rope_scaling` (Llama-3.x `llama3`, Phi-3 `longrope`) it implements;
- masks per layer type (`full_attention` / `sliding_attention`, from `layer_types` or
  the config's sliding-window settings) from `transformers.masking_utils`;
- the embedding module itself (Gemma's scaled embedding), whose non-persistent buffers
  (`embed_scale`) are re-created the way transformers' own loading does;
- final-logit soft-capping from the config in the head (Gemma-2).

Covered and tested against the full transformers model (logits within 1e-4 in fp32, greedy
tokens identical, prompts longer than the sliding window): Llama (incl. Llama-3.x
`rope_scaling`), Qwen2/2.5, Qwen3, Mistral, Gemma-2, Gemma-3 (text) and Phi-3 — see
tests/helpers/tiny_models.py and tests/integration/test_families.py. Other families load
when their decoder layers take the same call (hidden state, masks, position embeddings,
cache); any tensor left unloaded is a `bad_request` naming the family and the tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hearthnet.distributed_inference.directory.formats import (
    QUANTISED,
)
from hearthnet.errors import BadRequest
from hearthnet.models.store import ModelEntry


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


def meta_base_model(config: Any) -> Any:
    """The family's base model (e.g. LlamaModel) on the meta device: structure, no memory."""
    from transformers import AutoModel

    from_config: Callable[..., Any] = AutoModel.from_config  # untyped in transformers
    with torch.device("meta"):
        model = from_config(config)
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def layer_types(config: Any) -> list[str]:
    """Attention kind of every layer, inferred as transformers' own caches do."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    unsupported = set(types) - {"full_attention", "sliding_attention"}
    if unsupported:
        raise BadRequest(f"layer types {sorted(unsupported)} are not supported by "
                         f"small_model_layered")
    return list(types)


def check_device_format(fmt: str, device: torch.device) -> None:
    """`BadRequest` for a held format with no kernel on `device` (int8/int4: CPU only)."""
    if fmt in QUANTISED and device.type != "cpu":
        raise BadRequest(f"weights held as {fmt} run on CPU kernels only (oneDNN, fbgemm, "
                         f"_weight_int8pack_mm, _weight_int4pack_mm_for_cpu, HearthNet's "
                         f"int4-vnni/int8-vnni); on {device} use bf16 or fp16", format=fmt,
                         device=str(device))
