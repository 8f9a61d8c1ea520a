"""`layer_params` (automatic hosting, issue 15) reads a layer's size from SmolLM2's header."""

from __future__ import annotations

from hearthnet.distributed_inference.placement.autohost import layer_params


def test_layer_params_reads_the_safetensors_header(smollm2):
    # SmolLM2-135M: 576 hidden, 1536 MLP, 9 heads of 64, 3 KV heads; norms 2 × 576
    want = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3 + 576 * 2
    assert layer_params(smollm2) == want
