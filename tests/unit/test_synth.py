"""`hearthnet models synth` (issue 12 §3) and the streaming safetensors writer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hearthnet.errors import BadRequest
from hearthnet.models.synth import SHAPES, shape_config, tensor_plan


def test_every_shape_has_its_real_layer_count_and_vocab():
    expect = {"qwen2.5-1.5b": (28, 1536, 151936), "qwen2.5-3b": (36, 2048, 151936),
              "qwen2.5-7b": (28, 3584, 152064), "llama-3.2-1b": (16, 2048, 128256),
              "llama-3.2-3b": (28, 3072, 128256)}
    assert set(expect) == set(SHAPES)
    for shape, (layers, hidden, vocab) in expect.items():
        _, cfg = shape_config(shape)
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == \
            (layers, hidden, vocab)
    # 7B: ~7.6 G parameters, 15.2 GB in bf16 — from the plan, nothing allocated
    n = sum(t.nbytes for t in tensor_plan(shape_config("qwen2.5-7b")[1])) / 2
    assert 7.5e9 < n < 7.7e9


def test_unknown_shape_is_one_line_error(tmp_path):
    with pytest.raises(BadRequest, match="known shapes: qwen2"):
        shape_config("gpt-5")
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "--models-dir",
                        str(tmp_path), "synth", "gpt-5"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "known shapes" in r.stderr
    assert not list(tmp_path.iterdir())
