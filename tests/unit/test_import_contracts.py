"""The import contracts of `pyproject.toml` hold (DESIGN.md "Layout"), and they can fail:
each deliberate upward import below, made in a copy of the package, breaks its contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs import-linter on the `hearthnet` package in the folder it runs in (import-linter
# puts the working directory first on sys.path); the editable install's finder is dropped
# so that a copy of the package in a temporary folder is the one analysed.
_LINT = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in type(f).__name__]\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))\n"
)


def _lint(package_parent: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LINT, str(package_parent),
                           str(ROOT / "pyproject.toml")],
                          cwd=package_parent, capture_output=True, text=True, timeout=120,
                          check=False)


def test_the_project_keeps_every_import_contract() -> None:
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout
    assert "BROKEN" not in r.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("distributed_inference/directory/formats.py", "import torch",
     "directory/ imports no torch"),
    ("distributed_inference/engine/kv_cache.py", "import hearthnet.transport.codec",
     "engine/ knows nothing of the network"),
    ("distributed_inference/engine/local.py",
     "import hearthnet.distributed_inference.orchestrator.pipeline",
     "distributed_inference's rooms open one way"),
    ("models/store.py", "import hearthnet.commands.chat",
     "Packages import only downward"),
    ("client.py", "import hearthnet.commands.remote",
     "The host-app client imports no CLI code"),
    ("commands/remote.py", "import hearthnet.commands.chat", "No import circles"),
    ("errors.py", "import hearthnet.mesh.bus", "The ground-floor modules import no package"),
])
def test_an_upward_import_breaks_its_contract(tmp_path: Path, module: str, line: str,
                                              contract: str) -> None:
    shutil.copytree(ROOT / "hearthnet", tmp_path / "hearthnet",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "hearthnet" / module
    target.write_text(target.read_text() + f"\n{line}  # an upward import\n")
    r = _lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    broken = [ln for ln in r.stdout.splitlines() if "BROKEN" in ln]
    assert broken, r.stdout
    # the contract's name may wrap over two lines in import-linter's report
    assert contract.split()[0] in r.stdout and contract in " ".join(r.stdout.split()), r.stdout
