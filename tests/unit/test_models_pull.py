"""`hearthnet models pull NAME`: each local source's layout resolved by name, a URL
downloaded with HTTP Range and resumed, a Hugging Face repo fetched through `HF_ENDPOINT`
from a local stand-in for the hub, and a wrong name answered with the nearest one.

No model is imported here (tests/integration/test_models_pull.py imports the real SmolLM2
from every source); the files are small byte strings.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hearthnet.cli import main
from hearthnet.errors import ModelStoreError, WeightsMismatch
from hearthnet.models.pull import (
    check_sha256,
    default_alias,
    download_url,
    find_local,
    hf_cache_models,
    hub_download,
    lmstudio_models,
    local_models,
    ollama_models,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


# -- fake trees -------------------------------------------------------------------------------

def fake_ollama(root: Path, name: str, tag: str, blob: Path, ns: str = "library") -> str:
    """Ollama's layout: a manifest naming the model layer's blob by its sha256."""
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    dst = root / "blobs" / f"sha256-{digest}"
    if not dst.exists():
        dst.symlink_to(blob)
    m = root / "manifests" / "registry.ollama.ai" / ns / name / tag
    m.parent.mkdir(parents=True, exist_ok=True)
    m.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
         "size": blob.stat().st_size}]}))
    return digest


def fake_hf_cache(root: Path, repo: str, files: dict[str, Path]) -> Path:
    """The hub cache's layout: blobs by hash, a snapshot of symlinks, refs/main."""
    d = root / ("models--" + repo.replace("/", "--"))
    snap = d / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (d / "blobs").mkdir()
    for name, src in files.items():
        blob = d / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.write_bytes(src.read_bytes())
        (snap / name).symlink_to(Path("../..") / "blobs" / blob.name)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(COMMIT)
    return snap


def fake_lmstudio(root: Path, repo: str, files: dict[str, Path]) -> Path:
    d = root / repo
    d.mkdir(parents=True)
    for name, src in files.items():
        (d / name).symlink_to(src)
    return d


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    out = {}
    for name, data in {"a.gguf": b"GGUF-a" * 100, "b.gguf": b"GGUF-b" * 100,
                       "config.json": b"{}", "model.safetensors": b"st" * 100}.items():
        p = tmp_path / "src" / name
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data)
        out[name] = p
    return out


# -- local sources ----------------------------------------------------------------------------

def test_each_local_source_is_found_by_its_own_names(home, files):
    digest = fake_ollama(home / ".ollama" / "models", "qwen2.5", "0.5b", files["a.gguf"])
    fake_ollama(home / ".ollama" / "models", "smol", "latest", files["b.gguf"], ns="someone")
    fake_hf_cache(home / ".cache" / "huggingface" / "hub", "Org/Folder",
                  {"config.json": files["config.json"],
                   "model.safetensors": files["model.safetensors"]})
    fake_hf_cache(home / ".cache" / "huggingface" / "hub", "org/only-gguf",
                  {"m-Q4_0.gguf": files["a.gguf"]})
    fake_lmstudio(home / ".lmstudio" / "models", "pub/two-GGUF",
                  {"x-Q4_0.gguf": files["a.gguf"], "x-Q8_0.gguf": files["b.gguf"],
                   "mmproj-x.gguf": files["b.gguf"]})
    fake_lmstudio(home / ".cache" / "lm-studio" / "models", "old/one", {"y.gguf": files["b.gguf"]})

    o = {f.name: f for f in ollama_models()}
    assert set(o) == {"qwen2.5:0.5b", "someone/smol:latest"}
    assert o["qwen2.5:0.5b"].sha256 == digest and o["qwen2.5:0.5b"].gguf
    h = {f.name: f for f in hf_cache_models()}
    assert set(h) == {"Org/Folder", "org/only-gguf", "org/only-gguf:m-Q4_0.gguf"}
    assert not h["Org/Folder"].gguf and (h["Org/Folder"].path / "config.json").is_file()
    assert h["org/only-gguf"].path.read_bytes() == files["a.gguf"].read_bytes()
    lm = {f.name for f in lmstudio_models()}
    # several files: only by file name; one file: by the repo too; projectors are no model
    assert lm == {"pub/two-GGUF:x-Q4_0.gguf", "pub/two-GGUF:x-Q8_0.gguf", "old/one",
                  "old/one:y.gguf"}

    assert find_local("qwen2.5:0.5b").source == "ollama"
    assert find_local("someone/smol").name == "someone/smol:latest"
    assert find_local("org/folder").name == "Org/Folder"  # hub ids are case-insensitive
    assert find_local("old/one").path.name == "y.gguf"
    assert find_local("pub/two-GGUF") is None


def test_source_locations_follow_their_environment_variables(home, files, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ol"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    fake_ollama(tmp_path / "ol", "tiny", "latest", files["a.gguf"])
    fake_hf_cache(tmp_path / "hfhome" / "hub", "o/r", {"r.gguf": files["b.gguf"]})
    assert find_local("tiny").name == "tiny:latest"  # no tag: Ollama's `latest`
    assert find_local("o/r").source == "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # wins over HF_HOME
    assert find_local("o/r") is None


def test_ollama_comes_first_and_a_damaged_blob_is_refused(home, files):
    fake_ollama(home / ".ollama" / "models", "org", "r", files["a.gguf"])  # ollama's `org:r`
    fake_lmstudio(home / ".lmstudio" / "models", "org/r", {"z.gguf": files["b.gguf"]})
    assert find_local("org/r").source == "lmstudio"
    assert find_local("org:r").source == "ollama"
    f = find_local("org:r")
    check_sha256(f.path, f.sha256, f.name)
    with pytest.raises(WeightsMismatch, match="ollama pull"):
        check_sha256(files["b.gguf"], f.sha256, f.name)


def test_default_aliases():
    assert default_alias("qwen2.5:0.5b") == "qwen2.5-0.5b"
    assert default_alias("qwen2.5") == "qwen2.5"
    assert default_alias("llama3:latest") == "llama3"
    assert default_alias("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert default_alias("org/repo:Model-Q4_0.gguf") == "model-q4_0"
    assert default_alias("http://h:1/d/Smol.Q4_1.gguf?x=1") == "smol.q4_1"


def test_wrong_name_is_one_line_with_the_nearest_name(home, files, tmp_path, capsys):
    fake_ollama(home / ".ollama" / "models", "qwen2.5", "0.5b", files["a.gguf"])
    fake_lmstudio(home / ".lmstudio" / "models", "pub/two", {"x-Q4_0.gguf": files["a.gguf"],
                                                            "x-Q8_0.gguf": files["b.gguf"]})
    store = ["models", "--models-dir", str(tmp_path / "store")]
    assert main([*store, "pull", "qwen2.5:05b"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("hearthnet: bad_request:")
    assert "did you mean 'qwen2.5:0.5b'?" in err
    assert main([*store, "pull", "pub/two"]) == 1  # ambiguous: the files it holds
    err = capsys.readouterr().err
    assert "name one: pub/two:x-Q4_0.gguf, pub/two:x-Q8_0.gguf" in err
    assert main([*store, "pull", "zzzzzz"]) == 1
    assert "models pull --list" in capsys.readouterr().err


def test_list_shows_what_each_local_source_offers(home, files, tmp_path, capsys):
    fake_ollama(home / ".ollama" / "models", "qwen2.5", "0.5b", files["a.gguf"])
    fake_hf_cache(home / ".cache" / "huggingface" / "hub", "o/f",
                  {"config.json": files["config.json"],
                   "model.safetensors": files["model.safetensors"]})
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ollama (") and "qwen2.5:0.5b" in out[1] and "gguf" in out[1]
    assert out[2].startswith("hf-cache (") and "o/f" in out[3] and "safetensors" in out[3]
    assert out[4].startswith("lmstudio (") and out[5] == "  (none)"
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull"]) == 0  # no NAME
    assert capsys.readouterr().out.splitlines() == out
    assert set(local_models()) == {"ollama", "hf-cache", "lmstudio"}


# -- a file server with Range, and a stand-in for the hub -------------------------------------

class FakeServer:
    """A threaded HTTP server on 127.0.0.1 serving `files` at `/<name>` (with Range) and
    `repos` as the Hugging Face hub's API does for `huggingface_hub` (the routes it was
    seen to request: repo info, at a revision or not, its file tree, and HEAD/GET of
    `<repo>/resolve/<rev>/<file>`; anything else is a 404, as the hub's unknown routes).

    `cut` names files whose first whole-file GET is cut half way (the connection closed).
    """

    def __init__(self, files: dict[str, bytes] | None = None,
                 repos: dict[str, dict[str, bytes]] | None = None,
                 cut: set[str] | None = None) -> None:
        self.files = files or {}
        self.repos = repos or {}
        self.cut = set(cut or ())
        self.log: list[tuple[str, str, str | None]] = []  # method, path, Range
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.answer(self, body=True)

            def do_HEAD(self) -> None:
                server.answer(self, body=False)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def answer(self, h: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.log.append((h.command, path, h.headers.get("Range")))
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            for repo, files in self.repos.items():
                if rest.startswith(repo + "/tree/"):
                    return self.json(h, [{"type": "file", "path": f, "size": len(b),
                                          "oid": hashlib.sha1(b).hexdigest()}
                                         for f, b in files.items()], body)
                if rest == repo or rest.startswith(repo + "/revision/"):
                    return self.json(h, {"id": repo, "sha": COMMIT, "siblings": [
                        {"rfilename": f} for f in files]}, body)
            return self.missing(h, "RepoNotFound")
        for repo, files in self.repos.items():
            if path.startswith(f"/{repo}/resolve/"):
                name = path[len(f"/{repo}/resolve/"):].split("/", 1)[1]
                if name not in files:
                    return self.missing(h, "EntryNotFound")
                return self.send(h, name, files[name], body, {"X-Repo-Commit": COMMIT})
        name = path.lstrip("/")
        if name not in self.files:
            return self.missing(h, None)
        return self.send(h, name, self.files[name], body, {})

    def json(self, h: http.server.BaseHTTPRequestHandler, obj: object, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def missing(self, h: http.server.BaseHTTPRequestHandler, code: str | None) -> None:
        h.send_response(404)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def send(self, h: http.server.BaseHTTPRequestHandler, name: str, data: bytes,
             body: bool, extra: dict[str, str]) -> None:
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        rng = h.headers.get("Range")
        start = 0
        if rng and rng.startswith("bytes=") and h.headers.get("If-Range", etag) == etag:
            start = int(rng[len("bytes="):].split("-")[0])
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            h.send_response(200)
        h.send_header("Content-Length", str(len(data) - start))
        h.send_header("ETag", etag)
        h.send_header("Accept-Ranges", "bytes")
        for k, v in extra.items():
            h.send_header(k, v)
        h.end_headers()
        if not body:
            return
        if name in self.cut and start == 0:  # the first whole-file GET: cut half way
            self.cut.discard(name)
            h.wfile.write(data[:len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(data[start:])


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.close()


def test_url_download_resumes_with_range_after_a_cut(server, tmp_path):
    data = bytes(range(256)) * 9000  # 2.3 MB: several read chunks
    server.files["d/Model.Q4_0.gguf"] = data
    server.cut.add("d/Model.Q4_0.gguf")
    url = f"{server.url}/d/Model.Q4_0.gguf"
    with pytest.raises(ModelStoreError, match="run the same command again to resume"):
        download_url(url, tmp_path)
    partial = list(tmp_path.glob("*.partial"))
    assert len(partial) == 1 and partial[0].stat().st_size == len(data) // 2
    got = download_url(url, tmp_path)
    assert got.read_bytes() == data and not list(tmp_path.glob("*.partial"))
    gets = [r for m, p, r in server.log if m == "GET"]
    assert gets == [None, f"bytes={len(data) // 2}-"]  # the second asked only for the rest
    assert download_url(url, tmp_path) == got and len(server.log) == 2  # done: no request


def test_url_changed_on_the_server_is_fetched_whole_and_a_404_is_one_line(server, tmp_path):
    server.files["m.gguf"] = b"new" * 1000
    url = f"{server.url}/m.gguf"
    # a partial file of an older version: If-Range fails, the server sends the whole file
    key = hashlib.sha256(url.encode()).hexdigest()[:12]
    (tmp_path / f"{key}-m.gguf.partial").write_bytes(b"old" * 10)
    (tmp_path / f"{key}-m.gguf.validator").write_text('"stale"')
    assert download_url(url, tmp_path).read_bytes() == b"new" * 1000
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull",
                 f"{server.url}/nothing.gguf"]) == 1


def test_hub_repo_is_fetched_through_hf_endpoint(server, tmp_path, monkeypatch, home, capsys):
    server.repos["org/folder"] = {"config.json": b"{}", "model.safetensors": b"w" * 5000,
                                  "tokenizer.json": b"{}", "README.md": b"no",
                                  "model.gguf": b"not wanted"}
    server.cut.add("model.safetensors")  # cut half way: huggingface_hub resumes it itself
    server.repos["org/ggufs"] = {"a-Q4_0.gguf": b"a" * 3000, "a-Q8_0.gguf": b"b" * 3000,
                                 "README.md": b"no"}
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    f = hub_download("org/folder", tmp_path / "hub")
    assert f is not None and not f.gguf
    assert sorted(p.name for p in f.path.iterdir() if p.is_file()) == [
        "config.json", "model.safetensors", "tokenizer.json"]  # only what the store keeps
    assert (f.path / "model.safetensors").read_bytes() == b"w" * 5000
    g = hub_download("org/ggufs:a-Q8_0.gguf", tmp_path / "hub")
    assert g is not None and g.gguf and g.path.read_bytes() == b"b" * 3000
    assert hub_download("org/nothing", tmp_path / "hub") is None
    paths = {p for _, p, _ in server.log}
    assert "/api/models/org/folder" in paths  # the hub really was asked
    # several GGUFs and no safetensors: the command names them
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull", "org/ggufs"]) == 1
    assert "name one: org/ggufs:a-Q4_0.gguf, org/ggufs:a-Q8_0.gguf" in capsys.readouterr().err


def test_unknown_hub_repo_suggests_the_nearest_local_name(server, tmp_path, monkeypatch,
                                                          home, files, capsys):
    fake_hf_cache(home / ".cache" / "huggingface" / "hub", "HuggingFaceTB/SmolLM2-135M",
                  {"m.gguf": files["a.gguf"]})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull",
                 "HuggingFaceTB/SmolLM2-135"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "did you mean 'HuggingFaceTB/SmolLM2-135M'?" in err
    # the hub unreachable (a port nothing listens on): said so, and the name still suggested
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{sock.getsockname()[1]}")
    assert main(["models", "--models-dir", str(tmp_path / "s"), "pull",
                 "HuggingFaceTB/SmolLM2-135"]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot reach" in err and "did you mean 'HuggingFaceTB/SmolLM2-135M'?" in err


def test_list_and_a_wrong_name_answer_without_torch(home, files, tmp_path):
    """As `models list`: only an import needs the model runtime (3 s of CPU to load)."""
    from tests.unit.test_cli_light import _BLOCKED

    fake_ollama(home / ".ollama" / "models", "qwen2.5", "0.5b", files["a.gguf"])
    env = {**os.environ, "HOME": str(home)}
    for argv, rc, says in ((["--list"], 0, "qwen2.5:0.5b"), (["qwen2.5:05b"], 1, "did you mean")):
        r = subprocess.run([sys.executable, "-c", _BLOCKED, "models", "--models-dir",
                            str(tmp_path / "s"), "pull", *argv], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == rc, r.stderr
        assert says in r.stdout + r.stderr
