"""CUDA tests (issue 13 §5): marked `cuda`, skipped with a reason where torch sees no GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """SmolLM2's tokenizer files: `HEARTHNET_TEST_TOKENIZER`, else the store's smollm2."""
    env = os.environ.get("HEARTHNET_TEST_TOKENIZER")
    if env:
        return Path(env)
    from hearthnet.models import ModelStore

    entry = ModelStore().find("smollm2")
    if entry is None:
        pytest.skip("no tokenizer: set HEARTHNET_TEST_TOKENIZER or import smollm2")
    return entry.path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """`tiny(family)`: a small random-weight model of `family` in a temporary store."""
    from hearthnet.models import ModelStore
    from tests.helpers.tiny_models import make_tiny_model

    store = ModelStore(tmp_path_factory.mktemp("cuda-models"))
    made: dict[str, object] = {}

    def get(family: str):
        if family not in made:
            folder = make_tiny_model(family, store.root / family, tokenizer_dir)
            made[family] = store.write_manifest(folder, model_id=f"tiny/{family}",
                                                alias=family, source="test")
        return made[family]

    return get
