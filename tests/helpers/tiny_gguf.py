"""Tiny GGUF files of the supported families, written with the `gguf` package (issue 11 §4).

The tensors of a tiny Hugging Face model (tests/helpers/tiny_models.py) are written under
llama.cpp's names (`gguf.get_tensor_name_map`) with the family's hyperparameters and a
tiny byte-level BPE tokenizer. What matters for the tests is
that transformers reads the file and that our import of it computes what transformers'
own load of the same file computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# family -> (GGUF architecture, general.name)
GGUF_ARCH = {"llama": ("llama", "tiny-llama"), "llama3": ("llama", "tiny-llama3"),
             "mistral": ("llama", "tiny-mistral"), "qwen2": ("qwen2", "tiny-qwen2"),
             "qwen3": ("qwen3", "tiny-qwen3"), "gemma2": ("gemma2", "tiny-gemma2"),
             "gemma3": ("gemma3", "tiny-gemma3"), "phi3": ("phi3", "tiny-phi3")}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet (one printable character per byte)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


SPECIAL = ("<|im_start|>", "<|im_end|>", "<unk>")
GGUF_VOCAB = 256 + 2 + len(SPECIAL)  # the models written as GGUF have this vocabulary


def _tiny_tokenizer(writer: Any) -> None:
    """A byte-level BPE tokenizer of 261 tokens (fast to write and to read back)."""
    tokens = [*_bytes_to_unicode(), "Ġt", "he", *SPECIAL]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3] * len(SPECIAL))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_pad_token_id(tokens.index("<unk>"))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_gguf(family: str, hf_folder: Path, out: Path, arch: str | None = None,
                    quant: str | None = None) -> Path:
    """A GGUF file of the tiny model in `hf_folder`; `arch` overrides the architecture;
    `quant` (a GGML type gguf-py quantises, e.g. "Q4_0") quantises every matrix with it
    (as llama.cpp's `llama-quantize` does; 1-D tensors stay F32)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_folder / "config.json").read_text())
    arch_name, name = GGUF_ARCH.get(family, (family, f"tiny-{family}"))
    arch_name = arch or arch_name
    w = gguf.GGUFWriter(str(out), arch_name)
    w.add_name(name)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 256))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("full_attention", rope).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_rope_freq_base(float(theta))
    if cfg.get("sliding_window"):
        w.add_sliding_window(int(cfg["sliding_window"]))
    _tiny_tokenizer(w)
    tensors = load_file(str(hf_folder / "model.safetensors"))
    try:
        model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
        names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    except StopIteration:
        names = None
    for hf_name, t in tensors.items():
        mapped = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) if names else None
        values = np.ascontiguousarray(t.astype(np.float32))
        if quant and values.ndim == 2:
            kind = gguf.GGMLQuantizationType[quant]
            w.add_tensor(mapped or hf_name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            w.add_tensor(mapped or hf_name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
