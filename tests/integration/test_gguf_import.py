"""`hearthnet models import FILE.gguf` for every family transformers can read (issue 11 §4).

Each family's tiny model is written as a GGUF file (tests/helpers/tiny_gguf.py), imported,
and run through the layered backend; its logits equal transformers' own load of the same
GGUF file. Other architectures are refused with one line naming the architecture.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hearthnet.distributed_inference.engine.head import LayeredHead
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.errors import BadRequest
from hearthnet.models import ModelStore
from hearthnet.models.importer import import_model
from tests.helpers.tiny_gguf import GGUF_ARCH, GGUF_VOCAB, write_tiny_gguf
from tests.helpers.tiny_models import make_tiny_model

IDS = list(range(40, 52))  # inside the tiny GGUF tokenizer's vocabulary


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, smollm2):
    root = tmp_path_factory.mktemp("gguf")
    for fam in GGUF_ARCH:
        # transformers' GGUF reader takes Qwen3's head_dim from its default (128, as real)
        src = make_tiny_model(fam, root / "src" / fam, smollm2.path, seed=20,
                              head_dim=128 if fam == "qwen3" else 16, vocab_size=GGUF_VOCAB)
        write_tiny_gguf(fam, src, root / f"tiny-{fam}.gguf")
    return root


@pytest.mark.parametrize("family", sorted(GGUF_ARCH))
def test_gguf_of_each_family_imports_and_runs(family, gguf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = gguf_dir / f"tiny-{family}.gguf"
    entry = import_model(ModelStore(tmp_path / "store"), str(path), dtype="fp32")
    head, stack = LayeredHead(entry), LayeredStack(entry, 0, entry.num_layers - 1)
    h = stack.open_session(0, entry.num_layers - 1, 16).forward(head.embed(IDS), 0)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=path.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0, -1]
    assert (head.logits(h) - expected).abs().max().item() < 1e-4
    assert head.chat_prompt_ids([{"role": "user", "content": "hi"}])  # tokenizer came along


def test_other_architectures_are_refused_in_one_line(gguf_dir, tmp_path):
    src = gguf_dir / "src" / "llama"
    bloom = write_tiny_gguf("llama", src, tmp_path / "tiny-bloom.gguf", arch="bloom")
    with pytest.raises(BadRequest, match="'bloom'"):
        import_model(ModelStore(tmp_path / "store"), str(bloom))
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "--models-dir",
                        str(tmp_path / "store"), "import", str(bloom)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "bloom" in lines[0], r.stderr
    assert not (tmp_path / "store" / "tiny-bloom").exists()
