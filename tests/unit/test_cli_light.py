"""The command line and the client library answer without loading torch or transformers.

Loading them costs about 3 s of CPU on a 2-core machine: before, every `hearthnet` command
(`--help`, `status`, `models list`, a chat through a node) and every host app importing
`HearthNetClient` paid it. Only commands that run a model (`node`, `chat --local`, `demo`,
`bench`, `models import|synth`) need them. Each case runs the real entry point in a fresh
interpreter where importing either one fails, naming the importer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A fresh interpreter that refuses torch and transformers, then runs `hearthnet ARGV…`.
_BLOCKED = """
import json, sys, traceback

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} imported by:\\n" + "".join(traceback.format_stack()))
        return None

sys.meta_path.insert(0, Refuse())
if sys.argv[1] == "client":
    from hearthnet.client import HearthNetClient  # a host app's import (issue 15 §3)
    print(HearthNetClient.__name__)
    raise SystemExit(0)
from hearthnet.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCKED, *argv], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


@pytest.fixture
def node_toml(tmp_path: Path) -> Path:
    """A node's config; the node is not running."""
    cfg = tmp_path / "node.toml"
    cfg.write_text(f'[node]\nid = "node-x"\ndata_dir = "{tmp_path / "data"}"\n'
                   f'models_dir = "{tmp_path / "models"}"\n')
    return cfg


def test_help_lists_every_command_without_torch():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for command in ("models", "chat", "bench", "node", "status", "demo", "keys"):
        assert command in r.stdout


def test_models_list_without_torch(tmp_path):
    r = _run("models", "--models-dir", str(tmp_path), "list", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_status_of_a_stopped_node_without_torch(node_toml):
    r = _run("status", "--config", str(node_toml))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == (
        f"hearthnet: connection_lost: node node-x is not running (no admin address in "
        f"{node_toml.parent / 'data' / 'node.json'}); start it with `hearthnet node "
        f"--config {node_toml}`")


def test_chat_through_a_node_checks_and_calls_without_torch(node_toml):
    bad = _run("chat", "--config", str(node_toml), "--json", "--max-tokens", "0", "hi")
    assert bad.returncode == 1, bad.stderr
    assert json.loads(bad.stdout) == {"type": "error", "code": "bad_request",
                                      "message": "max_tokens must be in 1..8192, got 0"}
    r = _run("chat", "--config", str(node_toml), "--json", "hi")  # as far as the node
    assert r.returncode == 1, r.stderr
    err = json.loads(r.stdout)
    assert err["type"] == "error" and err["code"] == "connection_lost", err
    assert err["message"].startswith("node node-x is not running"), err


def test_the_client_library_imports_without_torch():
    r = _run("client")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "HearthNetClient"


def test_the_block_itself_works():
    """The same interpreter refuses a command that needs the model runtime."""
    r = _run("chat", "--local", "hi")
    assert r.returncode != 0 and "torch imported by" in r.stderr
