"""The real model shapes `hearthnet models synth SHAPE` writes (M26 §5.7's models): each one's
model id and published config.json.

Plain data, no torch: the command line lists the shapes in its help without loading torch.
"""

from __future__ import annotations

from typing import Any

_QWEN_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "use_cache": True,
}
_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "use_cache": True, "vocab_size": 128256,
}

# The published config.json of each shape (Instruct variants), keyed by SHAPE.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", {
        **_QWEN_COMMON, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_window_layers": 21, "tie_word_embeddings": True, "vocab_size": 151936}),
    "qwen2.5-3b": ("Qwen/Qwen2.5-3B-Instruct", {
        **_QWEN_COMMON, "hidden_size": 2048, "intermediate_size": 11008,
        "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 2,
        "max_window_layers": 70, "tie_word_embeddings": True, "vocab_size": 151936}),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", {
        **_QWEN_COMMON, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_window_layers": 28, "tie_word_embeddings": False, "vocab_size": 152064}),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", {
        **_LLAMA_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8}),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", {
        **_LLAMA_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "head_dim": 128,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8}),
}
