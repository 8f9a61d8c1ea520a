"""Shared fixtures: one imported SmolLM2 per test run, torch threads set deliberately."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Under `make test` the xdist workers share the two cores with the node processes they
# start (one compute thread each): two threads per worker would only oversubscribe them.
# One thread per worker; a lone run keeps two.
torch.set_num_threads(1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# compiled decode steps (engine/compiled.py) take 30-70 s of both cores to build: off for
# the suite (nodes it starts inherit this), on in the tests of compiled steps themselves
os.environ.setdefault("HEARTHNET_COMPILE", "0")
# inductor's kernels for the suite's compiled steps in one cache shared by its runs (as
# inductor's /tmp default is): each test's store would otherwise build them all again
# and built in this process, not in a pool of compile workers that each import torch
# first: on two cores shared with another test file that only adds load
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path.home() / ".cache" / "hearthnet" / "test-suite-inductor"))


@pytest.fixture(scope="session")
def model_store():
    """The model store of `HEARTHNET_DATA_DIR` with SmolLM2 imported (`make test` imports it)."""
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import import_smollm2

    store = ModelStore()
    entry = import_smollm2(store, "bf16")
    if entry.ggml_types:  # a store the default import wrote (the demo's): not the reference
        pytest.exit(f"{entry.path} keeps the GGUF's blocks; the suite's reference is SmolLM2 "
                    f"de-quantised to bf16: run `make test` (its own data dir) or set "
                    f"HEARTHNET_DATA_DIR to a fresh folder", returncode=2)
    return store


@pytest.fixture(scope="session")
def smollm2(model_store):
    return model_store.get("smollm2")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def local_answer(smollm2):
    """`local_answer(prompt, n)`: the local engine's greedy token ids — the reference every
    distributed answer must match. One engine and one answer per (prompt, n) per run."""
    from hearthnet.distributed_inference.engine.local import LocalEngine
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

    engine = LocalEngine(smollm2)
    cache: dict[tuple[str, int], list[int]] = {}

    def answer(prompt: str, n: int) -> list[int]:
        if (prompt, n) not in cache:
            cache[(prompt, n)] = [e.token_id for e in engine.generate(
                [{"role": "user", "content": prompt}], SamplingParams(max_tokens=n))]
        return cache[(prompt, n)]

    return answer


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, smollm2):
    """One store with a tiny random-weight model of every supported family (issue 11).

    Returns `(store, {family: entry})`; shared by the backend tests and the mesh tests.
    """
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import import_folder
    from tests.helpers.tiny_models import FAMILIES, make_tiny_model

    root = tmp_path_factory.mktemp("families")
    store = ModelStore(root / "models")
    # a seed per family: same-shaped families must not share weights (nor weights_sha256)
    entries = {fam: import_folder(store, make_tiny_model(fam, root / "src" / fam, smollm2.path,
                                                         layers=6, seed=1 + i), alias=fam)
               for i, fam in enumerate(FAMILIES)}
    return store, entries


@pytest.fixture(scope="session")
def family_reference():
    """`family_reference(entry)`: the whole transformers model of a stored model, loaded
    once per run — the reference every family test compares with."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def get(entry):
        if entry.weights_sha256 not in cache:
            cache[entry.weights_sha256] = AutoModelForCausalLM.from_pretrained(
                str(entry.path), dtype=torch.float32).eval()
        return cache[entry.weights_sha256]

    return get


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home of its own (`models pull`'s tests): every model source's default location is
    under it, and no environment variable points elsewhere."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    return h
