"""Small random-weight models of several families, saved as Hugging Face folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4,
                  max_window_layers=2),
    "qwen3": dict(model_type="qwen3"),
    "mistral": dict(model_type="mistral", sliding_window=6),
}


def make_tiny_model(family: str, out: Path, tokenizer_from: Path, *, layers: int = 6,
                    seed: int = 0) -> Path:
    """A `family` model with random weights and SmolLM2's tokenizer, written to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(FAMILIES[family])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, tie_word_embeddings=(family != "qwen3"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # larger weights than the init so layers really mix positions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / f).exists():
            shutil.copy(tokenizer_from / f, out / f)
    return out
