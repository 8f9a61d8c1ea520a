"""Every command in README.md is run, so the README cannot rot.

The fenced shell blocks of the README (```bash, ```console, ```sh) are read, and each
command line in them is either

* run here, as written, in the README's order, with its exit code and output checked
  (`RUN`: the exact command → what its output must show), or
* listed in `ELSEWHERE` with the test (or CI entry point) that runs it — `make demo` and
  `make test` install and run for minutes, so other tests and CI run them.

A command in neither table fails `test_every_readme_command_is_run_or_listed`, and a
command of `RUN` that the README no longer has fails it too, so the two stay in step.

The walk-through starts the real `config/mesh3` nodes (`hearthnet node --config …`, the
README's background `&` lines) on their fixed ports with `HEARTHNET_DATA_DIR` pointing to a
temporary folder whose `models/` is the test run's model store, so keys and node state
never touch the user's data directory and the committed TOMLs stay as they are.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.processes import alive, wait_all_gone
from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SHELL_LANGS = ("bash", "console", "sh")

# The ports config/mesh3 binds: node listeners, metrics, HTTP API.
MESH3_PORTS = (7701, 7702, 7703, 9701, 9702, 9703, 8080, 8081, 8082)
MESH3_API = "http://127.0.0.1:8080"


def _json(out: str) -> dict:
    return dict(json.loads(out))


def _models_list(out: str) -> bool:
    return re.search(r"^smollm2\s+HuggingFaceTB/SmolLM2-135M-Instruct\s+layers=30", out,
                     re.M) is not None


def _status(out: str) -> bool:
    # whole shard ids (the SHARD column is as wide as the longest), every node listed
    return ("FULLY COVERED" in out and re.search(r"0-14@mesh3-b\s+0-14\s+mesh3-b\s+online",
                                                 out) is not None
            and re.search(r"15-29@mesh3-c\s+15-29\s+mesh3-c\s+online", out) is not None
            and "  mesh3-a (this node): online" in out)


def _v1_models(out: str) -> bool:
    m = _json(out)["data"][0]
    return m["id"] == "smollm2" and m["hearthnet"]["fully_covered"] is True


def _completion(out: str) -> bool:
    r = _json(out)
    return (bool(r["choices"][0]["message"]["content"].strip())
            and r["choices"][0]["finish_reason"] in ("stop", "length")
            and len(r["hearthnet"]["pipeline"]) == 2 and r["hearthnet"]["fallback"] is False)


def _api_status(out: str) -> bool:
    st = _json(out)
    return st["node_id"] == "mesh3-a" and {s["host"] for s in st["shards"]} == {"mesh3-b",
                                                                                "mesh3-c"}


def _provisioned(out: str) -> bool:
    # config/mesh3's node ids are its own (mesh3-a…), so other example folders never share
    # their data dirs
    return all(re.search(rf"^{n}\s.*members: ", out, re.M) for n in ("mesh3-a", "mesh3-b",
                                                                     "mesh3-c"))


# Commands run here, exactly as the README prints them → a check of their stdout (exit
# code 0 is always required). `source` is checked by `_activate`; `&` lines start nodes.
RUN: dict[str, Callable[[str], bool] | None] = {
    "source .venv/bin/activate": None,
    "hearthnet --help": lambda out: out.startswith("usage: hearthnet")
    and all(c in out for c in ("models", "chat", "node", "status", "demo", "keys")),
    "hearthnet models list": _models_list,
    'hearthnet chat --local --max-tokens 32 "What is the capital of France?"':
        lambda out: "Paris" in out,
    "hearthnet keys provision config/mesh3": _provisioned,
    "hearthnet node --config config/mesh3/node-b.toml &": None,
    "hearthnet node --config config/mesh3/node-c.toml &": None,
    "hearthnet node --config config/mesh3/node-a.toml &": None,
    "hearthnet status --config config/mesh3/node-a.toml": _status,
    'hearthnet chat --config config/mesh3/node-a.toml "What is the capital of France?"':
        lambda out: "Paris" in out,
    "curl -s http://127.0.0.1:8080/v1/models": _v1_models,
    "curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' "
    "-d '{\"model\": \"smollm2\", \"max_tokens\": 32, \"messages\": [{\"role\": \"user\", "
    "\"content\": \"Hi\"}]}'": _completion,
    "curl -s http://127.0.0.1:8080/api/status": _api_status,
    "curl -s http://127.0.0.1:9701/metrics": lambda out: "hearthnet_build_info{" in out,
}

# Commands another test or CI runs: the command → where ("path::function" or a CI script).
ELSEWHERE: dict[str, list[str]] = {
    # the install, then `hearthnet demo`: CI's `make test` installs the same way, and the
    # demo tests run `hearthnet demo` through a real three-process mesh
    "make demo": [
        ".ci/run",
        "tests/integration/test_demo_bench.py::"
        "test_demo_json_streams_through_the_mesh_and_stops_every_node",
        "tests/integration/test_demo_bench.py::test_demo_ctrl_c_stops_every_node",
    ],
    "make test": [".ci/run"],  # CI itself
    # two machines joining: the user's own config folder and a second machine, so the
    # join tests run the same commands with temporary folders: a second node on this one,
    # and two network namespaces where the short code finds the inviter by mDNS
    **{cmd: ["tests/integration/test_join.py::"
             "test_invite_join_then_b_is_a_member_and_chats_through_a",
             "tests/netns/test_join_netns.py::"
             "test_init_invite_join_by_mdns_then_a_chat_runs_through_both"]
       for cmd in ("hearthnet init",
                   "hearthnet node --config ~/.config/hearthnet/node.toml &",
                   "hearthnet invite --config ~/.config/hearthnet/node.toml",
                   "hearthnet join 7KQ2M-XD4RA --config ~/.config/hearthnet/node.toml")},
}


def readme_commands(text: str) -> list[str]:
    """The command lines of the shell blocks of `text`: continuations joined, comments and
    blank lines dropped, a `console` block's `$ ` prompt removed (other lines are output)."""
    commands = []
    for lang, body in re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M):
        if lang not in SHELL_LANGS:
            continue
        lines = body.splitlines()
        if lang == "console":
            lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
        pending = ""
        for ln in lines:
            if ln.rstrip().endswith("\\"):
                pending += ln.rstrip()[:-1].rstrip() + " "
                continue
            cmd = _strip_comment(pending + ln.strip()).strip()
            pending = ""
            if cmd:
                commands.append(cmd)
    return commands


def _strip_comment(line: str) -> str:
    """`line` without a trailing shell comment: a `#` outside quotes, after a blank."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _test_exists(ref: str) -> bool:
    """`path::function` names a test function defined in that file; a plain path is a CI
    script that must exist."""
    path, _, func = ref.partition("::")
    file = REPO / path
    if not file.is_file():
        return False
    if not func:
        return True
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == func
               for n in tree.body)


def test_every_readme_command_is_run_or_listed():
    commands = readme_commands(README.read_text())
    assert "make demo" in commands and "make test" in commands
    unknown = [c for c in commands if c not in RUN and c not in ELSEWHERE]
    assert not unknown, (
        f"README commands neither run by {__name__} (add them to RUN with a check) nor "
        f"listed in ELSEWHERE with the test that runs them: {unknown}")
    gone = [c for c in [*RUN, *ELSEWHERE] if c not in commands]
    assert not gone, f"commands this test covers that the README no longer has: {gone}"
    for cmd, refs in ELSEWHERE.items():
        missing = [r for r in refs if not _test_exists(r)]
        assert refs and not missing, f"{cmd!r}: listed tests do not exist: {missing}"
        ci = [r for r in refs if "::" not in r]
        assert all(cmd in (REPO / r).read_text() or "make test" in (REPO / r).read_text()
                   for r in ci), (cmd, ci)


def test_comments_and_continuations_are_parsed():
    text = ("```bash\nmake demo   # a comment\ncurl -s x \\\n  -d '{\"a\": 1}'\n```\n"
            "```\nnot a shell block\n```\n```console\n$ hearthnet --help\nusage: …\n```\n")
    assert readme_commands(text) == ["make demo", "curl -s x -d '{\"a\": 1}'",
                                     "hearthnet --help"]


# -- the walk-through ---------------------------------------------------------------------


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.fixture
def readme_env(model_store, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment a reader has after `make demo`: `hearthnet` on PATH (the venv that
    runs this test), the model imported; a data dir of its own under tmp_path."""
    data = tmp_path / "hearthnet"
    data.mkdir()
    (data / "models").symlink_to(Path(model_store.root).resolve(), target_is_directory=True)
    bindir = str(Path(sys.executable).parent)
    if not Path(bindir, "hearthnet").exists():
        pytest.fail(f"no `hearthnet` next to {sys.executable}: install the project (make demo)")
    env = {**os.environ, "HEARTHNET_DATA_DIR": str(data),
           "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    env.pop("VIRTUAL_ENV", None)
    yield env


def _run(cmd: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _activate(cmd: str, env: dict[str, str]) -> None:
    """`source .venv/bin/activate` puts the venv's `hearthnet` first on PATH."""
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.fail("README says `source .venv/bin/activate`, but there is no .venv here: "
                    "run `make demo` (or `make test`) first")
    r = _run(f"{cmd} && command -v hearthnet && hearthnet --version", env)
    assert r.returncode == 0, r.stderr
    where, version = r.stdout.splitlines()[-2:]
    assert Path(where) == REPO / ".venv" / "bin" / "hearthnet", where
    assert version.startswith("hearthnet "), version


def _mesh3_covered() -> bool:
    try:
        with urllib.request.urlopen(MESH3_API + "/v1/models", timeout=5) as r:
            return bool(json.loads(r.read())["data"][0]["hearthnet"]["fully_covered"])
    except (OSError, ValueError, KeyError, IndexError):
        return False


def _stop(nodes: list[subprocess.Popen[bytes]]) -> None:
    for p in nodes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    try:
        wait_all_gone([p.pid for p in nodes], "mesh3 nodes stopping after SIGTERM", timeout=60)
    finally:
        for p in nodes:
            if alive(p.pid):
                p.kill()
            p.wait()


@pytest.mark.slow
def test_readme_walkthrough_runs_as_written(readme_env, tmp_path: Path):
    if shutil.which("curl") is None:
        pytest.fail("the README's API examples use curl: install it (apt-get install curl)")
    taken = [p for p in MESH3_PORTS if _port_taken(p)]
    if taken:
        pytest.fail(f"config/mesh3's ports {taken} are in use on 127.0.0.1: stop whatever "
                    "holds them (your own mesh3 nodes?) and run this test again")
    tomls = {p: p.read_bytes() for p in (REPO / "config" / "mesh3").glob("*.toml")}
    nodes: list[subprocess.Popen[bytes]] = []
    ran: list[str] = []
    try:
        for cmd in readme_commands(README.read_text()):
            if cmd in ELSEWHERE:
                continue
            assert cmd in RUN, cmd  # test_every_readme_command_is_run_or_listed says more
            if cmd.startswith("source "):
                _activate(cmd, readme_env)
            elif cmd.endswith("&"):
                name = cmd.split("/")[-1].split(".")[0]
                log = (tmp_path / f"{name}.log").open("wb")
                nodes.append(subprocess.Popen(["bash", "-c", "exec " + cmd[:-1].strip()],
                                              cwd=REPO, env=readme_env, stdout=log,
                                              stderr=subprocess.STDOUT))
            else:
                if nodes and not _mesh3_covered():
                    # the README: "after a few seconds"; a reader waits too
                    wait_for(lambda: _mesh3_covered() or _died(nodes, tmp_path),
                             "config/mesh3 fully covered", timeout=180)
                    assert _mesh3_covered(), _died(nodes, tmp_path)
                r = _run(cmd, readme_env)
                assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
                check = RUN[cmd]
                assert check is None or check(r.stdout), (cmd, r.stdout[-3000:])
            ran.append(cmd)
    finally:
        _stop(nodes)
    assert set(ran) == set(RUN), set(RUN) - set(ran)
    assert len(nodes) == 3
    # `keys provision` left the committed TOMLs as they were
    assert {p: p.read_bytes() for p in tomls} == tomls


def _died(nodes: list[subprocess.Popen[bytes]], tmp_path: Path) -> str | None:
    """The logs of nodes that exited early, or None while all run."""
    dead = [p for p in nodes if p.poll() is not None]
    if not dead:
        return None
    return "\n".join(f"{log.name}:\n{log.read_text()[-2000:]}"
                     for log in sorted(tmp_path.glob("*.log")))
