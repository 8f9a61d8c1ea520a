"""Compact store (issue 12 §1): GGUF → bf16 streamed, folders at own precision, resumable
imports, nothing half-written listed, one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hearthnet.errors import BadRequest, ModelStoreError
from hearthnet.models import ModelStore
from hearthnet.models.importer import import_gguf


def _gguf(path, arch: str, tensor: np.ndarray) -> str:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(("arch", "tensor", "error", "says"), [
    # an architecture we do not import is the caller's bad request (issue 11 §4)
    ("bert", np.zeros((4, 8), np.float32), BadRequest, "architecture 'bert' is not supported"),
    ("llama", np.zeros((4, 8), np.int32), ModelStoreError,
     "quantisation type(s) I32 cannot be de-quantised"),
])
def test_bad_gguf_is_one_line_and_leaves_nothing(tmp_path, arch, tensor, error, says):
    f = _gguf(tmp_path / "m.gguf", arch, tensor)
    with pytest.raises(error, match=re_escape(says)):
        import_gguf(ModelStore(tmp_path / "store"), tmp_path / "m.gguf", alias="m")
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "--models-dir",
                        str(tmp_path / "s2"), "import", f], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and says in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert list((tmp_path / "s2").iterdir()) == []  # no staging folder, no model


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF" + bytes(range(256)) * 8,
                                     b"PK\x03\x04 not a gguf at all"])
def test_a_file_that_is_not_a_gguf_is_one_line_bad_request(tmp_path, content):
    """Empty, truncated after the magic, garbage after it, another format: gguf-py fails
    in several ways (IndexError, ValueError …); each is the caller's bad_request, and
    nothing is staged."""
    f = tmp_path / "m.gguf"
    f.write_bytes(content)
    store = ModelStore(tmp_path / "store")
    with pytest.raises(BadRequest, match=r"m\.gguf: not a readable GGUF file"):
        import_gguf(store, f, alias="m")
    assert list((tmp_path / "store").iterdir()) == []


def test_a_missing_gguf_is_one_line_bad_request(tmp_path):
    with pytest.raises(BadRequest, match=r"gone\.gguf: cannot read the GGUF file"):
        import_gguf(ModelStore(tmp_path / "store"), tmp_path / "gone.gguf", alias="m")


def re_escape(s: str) -> str:
    import re

    return re.escape(s)
