"""`hearthnet models pull NAME` with the real SmolLM2 from every source a household keeps
models in: an Ollama store, LM Studio's folder, the Hugging Face cache, a stand-in for the
hub (`HF_ENDPOINT`) and a URL whose first download is cut half way. Each pulled model has
the `weights_sha256` of the same weights imported by path with `models import`.

The fake trees and the HTTP server are those of tests/unit/test_models_pull.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hearthnet.cli import main
from hearthnet.models import ModelEntry, ModelStore
from hearthnet.models.importer import import_model, smollm2_gguf_path
from hearthnet.models.pull import DOWNLOADS
from tests.helpers.marks import IN_MAKE_BENCH
from tests.unit.test_models_pull import FakeServer, fake_hf_cache, fake_lmstudio, fake_ollama

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
# the files of a Hugging Face folder, as a store folder holds them
FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ModelEntry:
    """The bundled GGUF imported by path, as `models import FILE.gguf` does (once)."""
    store = ModelStore(tmp_path_factory.mktemp("reference"))
    return import_model(store, str(smollm2_gguf_path()), alias="ref")


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer()
    yield s
    s.close()


def _pull(store: Path, *args: str) -> int:
    return main(["models", "--models-dir", str(store), "pull", *args])


def _folder(reference: ModelEntry) -> dict[str, Path]:
    return {n: reference.path / n for n in FOLDER_FILES if (reference.path / n).is_file()}


def test_ollama_blob_is_checked_and_imported(reference, home, tmp_path, capsys):
    fake_ollama(home / ".ollama" / "models", "smollm2", "135m", smollm2_gguf_path())
    assert _pull(tmp_path / "s", "smollm2:135m") == 0
    e = ModelStore(tmp_path / "s").get("smollm2-135m")
    assert e.weights_sha256 == reference.weights_sha256 and e.source == "ollama:smollm2:135m"
    assert e.model_id == "smollm2:135m" and e.ggml_types == reference.ggml_types
    assert f"weights_sha256={e.weights_sha256}" in capsys.readouterr().out
    assert _pull(tmp_path / "s", "smollm2:135m") == 0  # there already: at once


@IN_MAKE_BENCH  # each source's lookup and download: tests/unit/test_models_pull.py
def test_lmstudio_gguf_is_imported(reference, home, tmp_path):
    fake_lmstudio(home / ".lmstudio" / "models", "bartowski/SmolLM2-135M-Instruct-GGUF",
                  {"SmolLM2-135M-Instruct-Q4_1.gguf": smollm2_gguf_path()})
    assert _pull(tmp_path / "s", "bartowski/SmolLM2-135M-Instruct-GGUF", "--alias", "lm") == 0
    e = ModelStore(tmp_path / "s").get("lm")
    assert e.weights_sha256 == reference.weights_sha256
    assert e.model_id == "bartowski/SmolLM2-135M-Instruct-GGUF"


@IN_MAKE_BENCH  # each source's lookup and download: tests/unit/test_models_pull.py
def test_hf_cache_snapshot_is_imported(reference, home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    fake_hf_cache(tmp_path / "hf" / "hub", REPO, _folder(reference))
    assert _pull(tmp_path / "s", REPO) == 0
    e = ModelStore(tmp_path / "s").get("smollm2-135m-instruct")
    assert e.weights_sha256 == reference.weights_sha256 and e.model_id == REPO
    assert e.source == f"hf-cache:{REPO}"
    assert (e.path / "tokenizer.json").read_bytes() == (reference.path / "tokenizer.json"
                                                        ).read_bytes()


@IN_MAKE_BENCH  # each source's lookup and download: tests/unit/test_models_pull.py
def test_hub_repo_is_downloaded_through_hf_endpoint(reference, home, tmp_path, server,
                                                    monkeypatch):
    server.repos[REPO] = {n: p.read_bytes() for n, p in _folder(reference).items()}
    server.repos[REPO]["README.md"] = b"# not downloaded"
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    assert _pull(tmp_path / "s", REPO, "--alias", "hub") == 0
    e = ModelStore(tmp_path / "s").get("hub")
    assert e.weights_sha256 == reference.weights_sha256 and e.model_id == REPO
    assert e.source == f"hub:{REPO}"
    got = [p for m, p, _ in server.log if m == "GET" and "/resolve/" in p]
    assert not any(p.endswith("README.md") for p in got)
    assert not (tmp_path / "s" / DOWNLOADS / "hub" / REPO.replace("/", "--")).exists()


@IN_MAKE_BENCH  # each source's lookup and download: tests/unit/test_models_pull.py
def test_url_download_is_resumed_after_a_cut_then_imported(reference, home, tmp_path,
                                                           server, capsys):
    gguf = smollm2_gguf_path()
    server.files["m/" + gguf.name] = gguf.read_bytes()
    server.cut.add("m/" + gguf.name)
    url = f"{server.url}/m/{gguf.name}"
    assert _pull(tmp_path / "s", url) == 1  # the server cut the first download half way
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run the same command again to resume" in err
    assert _pull(tmp_path / "s", url) == 0
    ranges = [r for m, _, r in server.log if m == "GET"]
    assert ranges == [None, f"bytes={gguf.stat().st_size // 2}-"]  # only the rest, again
    e = ModelStore(tmp_path / "s").get("smollm2-135m-instruct.q4_1")
    assert e.weights_sha256 == reference.weights_sha256 and e.source == f"url:{url}"
    assert e.model_id == gguf.stem
    assert not list((tmp_path / "s" / DOWNLOADS / "url").iterdir())  # spent: removed
