"""Small random-weight models of every supported family, saved as Hugging Face folders.

Each family is its real `config.json` (the fields that shape the computation: rope
scaling, sliding windows, layer types, soft-capping, norms, biases, tying) scaled down to a
few layers and a small hidden size. Sliding windows are shrunk so that test prompts are
longer than the window.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

# hidden 64, 4 heads of 16, 2 KV heads; the rest from each family's real config.json
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    # Llama-3.2-1B-Instruct: llama3 rope scaling, theta 500000, tied embeddings
    "llama3": dict(model_type="llama", rope_theta=500000.0, max_position_embeddings=131072,
                   rope_scaling={
                       "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen2.5-0.5B-Instruct: qkv bias, tied; the sliding window switched on (as Qwen2 allows)
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                  max_window_layers=2, rope_theta=1000000.0),
    # Qwen3-0.6B: q/k norms, tied
    "qwen3": dict(model_type="qwen3", rope_theta=1000000.0),
    # Mistral-7B-v0.1: sliding window on every layer, untied
    "mistral": dict(model_type="mistral", sliding_window=6, tie_word_embeddings=False),
    # gemma-2-2b-it: attention + final-logit soft-capping, scaled embeddings, sandwich
    # norms, alternating sliding/full layers, query_pre_attn_scalar, gelu-tanh
    "gemma2": dict(model_type="gemma2", sliding_window=5, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                   hidden_activation="gelu_pytorch_tanh"),
    # gemma-3-1b-it: per-layer-type rotary (1e6 full, 1e4 sliding), 5 sliding : 1 full,
    # q/k norms, scaled embeddings, sandwich norms
    "gemma3": dict(model_type="gemma3_text", sliding_window=5, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, query_pre_attn_scalar=16,
                   final_logit_softcapping=None, attn_logit_softcapping=None,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention", "sliding_attention", "full_attention"]),
    # Phi-3.5-mini-instruct: fused qkv / gate_up, longrope scaling, sliding window, untied
    "phi3": dict(model_type="phi3", sliding_window=7, tie_word_embeddings=False,
                 original_max_position_embeddings=64, rope_scaling={
                     "type": "longrope", "long_factor": [1.0 + i / 8 for i in range(8)],
                     "short_factor": [1.0 + i / 16 for i in range(8)]}),
}


TINY_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 50000, "tie_word_embeddings": False,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
              "torch_dtype": "bfloat16"}
"""A tiny Qwen2 config.json for `write_synthetic` (models written in bf16, as `synth` does)."""

def tiny_config(family: str, *, layers: int = 6, vocab_size: int = 49152,
                head_dim: int = 16, max_positions: int = 2048) -> Any:
    """The scaled-down transformers config of `family`."""
    from transformers import AutoConfig

    kw = dict(FAMILIES[family])
    model_type = kw.pop("model_type")
    kw.setdefault("tie_word_embeddings", family != "qwen3")
    # 2,048 positions: room for prompts past 1,000 tokens (the wire was found wanting
    # on a real Gemma-3 at token 7 of a 1,006-token prompt)
    kw.setdefault("max_position_embeddings", max_positions)
    if "layer_types" in kw:
        kw["layer_types"] = (kw["layer_types"] * layers)[:layers]
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)


OVERFLOW_GAIN = 40000.0


def make_tiny_model(family: str, out: Path, tokenizer_from: Path, *, layers: int = 6,
                    seed: int = 0, overflow_from: int | None = None, head_dim: int = 16,
                    vocab_size: int = 49152, max_positions: int = 2048) -> Path:
    """A `family` model with random weights and SmolLM2's tokenizer, written to `out`.

    `overflow_from` (Gemma families): layer whose post-feed-forward norm gets a gain of
    `OVERFLOW_GAIN`, so that the residual stream from that layer on exceeds fp16's 65,504
    at every position — as a real Gemma-3's does (issue 11 §2).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, layers=layers, head_dim=head_dim, vocab_size=vocab_size,
                      max_positions=max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # larger weights than the init so layers really mix positions
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name and p.dim() == 1:  # norms away from their identity init
                p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.1)
        if overflow_from is not None:
            norm = model.model.layers[overflow_from].post_feedforward_layernorm
            norm.weight.fill_(OVERFLOW_GAIN)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, out / f)
    return out


OVERFLOW_ALIAS = "gemma-overflow"


def overflow_model(store: Any, root: Path, tokenizer_from: Path) -> Any:
    """The Gemma-3-like model whose residual stream passes 65,504 from layer 2 on, in
    `store` (imported once per store)."""
    from hearthnet.models.importer import import_folder

    found = store.find(OVERFLOW_ALIAS)
    if found is not None:
        return found
    src = make_tiny_model("gemma3", root / OVERFLOW_ALIAS, tokenizer_from, seed=2,
                          overflow_from=2)
    return import_folder(store, src, alias=OVERFLOW_ALIAS)
