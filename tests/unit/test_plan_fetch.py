"""`hearthnet plan URL` reads a remote model's header alone: HTTP Range requests against a
local server that counts every byte it serves (the plan must not download the weights)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hearthnet.commands.plan import remote_sizes
from hearthnet.errors import BadRequest
from hearthnet.models.sizes import safetensors_sizes
from tests.unit.test_plan import write_gguf

MB = 2**20


class _Counting(http.server.ThreadingHTTPServer):
    served = 0
    ranged = 0


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files with ``Range: bytes=a-b`` (206), counting the body bytes it sends."""

    server: _Counting

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        size = path.stat().st_size
        rng = self.headers.get("Range", "")
        lo, hi = 0, size - 1
        if rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            lo, hi = int(a), min(size - 1, int(b) if b else size - 1)
            self.server.ranged += 1
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(hi - lo + 1))
        self.end_headers()
        with path.open("rb") as f:
            f.seek(lo)
            body = f.read(hi - lo + 1)
        self.wfile.write(body)
        self.server.served += len(body)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, _Counting, Path]]:
    root = tmp_path / "www"
    root.mkdir()

    def handler(*a: object) -> _RangeHandler:
        return _RangeHandler(*a, directory=str(root))  # type: ignore[arg-type]

    server = _Counting(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server, root
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def test_remote_gguf_reads_only_its_header(served: tuple[str, _Counting, Path]) -> None:
    url, server, root = served
    # a header of ~110 KB (a 5k-token vocabulary: more than the first 64 KiB read, as a
    # 150k-token vocabulary is more than the command's first MiB) before ~8 MB of tensors
    f = write_gguf(root / "big.gguf", layers=4, hidden=1024, vocab=1024, tokens=5000,
                   quant=False)
    size = f.stat().st_size
    assert size > 8 * MB
    s = remote_sizes(f"{url}/big.gguf", first_read=64 << 10)
    assert s.num_layers == 4 and s.hidden_size == 1024 and s.container == "gguf"
    # F16 attention matrix + F32 norm per layer; F32 embedding + norm in the head
    assert s.layer_stored_bytes() == [1024 * 1024 * 2 + 1024 * 4] * 4
    assert s.head_stored_bytes() == (1024 * 1024 + 1024) * 4
    assert server.ranged >= 2  # the first read was not enough: it asked for more
    assert server.served <= 512 << 10, f"{server.served} bytes served of {size}"


def test_remote_safetensors_reads_only_its_header(served: tuple[str, _Counting, Path]
                                                  ) -> None:
    import torch
    from safetensors.torch import save_file

    url, server, root = served
    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(1024, 1024)
               for i in range(6)} | {"model.embed_tokens.weight": torch.zeros(1000, 1024)},
              str(root / "model.safetensors"))
    size = (root / "model.safetensors").stat().st_size
    s = remote_sizes(f"{url}/model.safetensors")
    assert s.layer_stored_bytes() == safetensors_sizes(root / "model.safetensors"
                                                       ).layer_stored_bytes()
    assert s.num_layers == 6 and size > 24 * MB
    assert server.served <= MB + 4096  # one read of the first MiB (no config.json there)


def test_remote_errors_are_one_clear_line(served: tuple[str, _Counting, Path]) -> None:
    url, _, root = served
    with pytest.raises(BadRequest, match="HTTP 404"):
        remote_sizes(f"{url}/absent.gguf")
    (root / "fake.gguf").write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(BadRequest, match="no GGUF magic"):
        remote_sizes(f"{url}/fake.gguf")
    with pytest.raises(BadRequest, match="not a model file URL"):
        remote_sizes(f"{url}/index.html")
