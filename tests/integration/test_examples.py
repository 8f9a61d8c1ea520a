"""The shipped example folders, as a user runs them: the files of `config/`, never members
built in code.

`config/mesh3`, `config/mesh4` and `config/auto3` run on this machine and `make keys`
provisions them together into one data dir; `config/compose` runs in docker compose, whose
`init` service provisions a copy. So: every node config loads, the folders share no node
id, port or data dir, after `make keys` (its own line, from the Makefile) every node of
every folder has the keys and members it needs to start (the checks `hearthnet node` makes
before it serves), compose's `init` gives its nodes an API key and compose publishes each
node's API on the host's loopback under a name the API accepts, and the auto3 flow of
docs/operations.md runs as printed: three node processes from the shipped TOMLs, `models
serve smollm2` on the steward, a chat answered through the mesh.

Node state goes to a temporary `HEARTHNET_DATA_DIR` whose `models/` is the test run's model
store (the TOMLs leave data dirs to that base), so nothing touches the user's data and the
committed TOMLs stay as they are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hearthnet.api.server import HostPolicy, split_host
from hearthnet.commands.node import preflight
from hearthnet.config import NodeConfig, load_config
from hearthnet.mesh.launcher import free_port, wait_node_ready
from hearthnet.node.guard import NodeGuard
from hearthnet.observability import Metrics
from hearthnet.security.keys import KEY_FILE_NAME
from tests.helpers.processes import alive, wait_all_gone
from tests.helpers.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
HOST_FOLDERS = ("mesh3", "mesh4", "auto3")  # run on this machine: `make keys` provisions them
COMPOSE = CONFIG / "compose"
COMPOSE_FILE = REPO / "docker-compose.yml"
_WILDCARDS = ("0.0.0.0", "::")


def _configs(folder: Path) -> dict[Path, NodeConfig]:
    return {p: load_config(p) for p in sorted(folder.glob("*.toml"))}


def _ports(cfg: NodeConfig) -> dict[str, int]:
    """The fixed ports a node binds on this machine, by key (0 = any free port)."""
    ports = {"node.listen_port": cfg.node.listen_port, "node.metrics_port": cfg.node.metrics_port,
             "security.admin_port": cfg.security.admin_port}
    if cfg.api.enabled:
        ports["api.listen_port"] = cfg.api.listen_port
    return {k: p for k, p in ports.items() if p > 0}


def _compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


def _compose_nodes() -> dict[str, dict[str, Any]]:
    """{service: its definition} of the services that run `hearthnet node --config F`."""
    return {name: svc for name, svc in _compose()["services"].items()
            if "hearthnet node --config" in " ".join(svc.get("command", []))}


def _published(svc: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """{container port: (host address, host port)} of a service's `ports`."""
    out = {}
    for spec in svc.get("ports", []):
        host, host_port, container = str(spec).rsplit(":", 2)
        out[int(container)] = (host, int(host_port))
    return out


@pytest.fixture
def data_home(model_store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh `HEARTHNET_DATA_DIR` (for this process and the commands it runs) whose
    `models/` is the test run's model store."""
    home = tmp_path / "hearthnet"
    home.mkdir()
    (home / "models").symlink_to(Path(model_store.root).resolve(), target_is_directory=True)
    monkeypatch.setenv("HEARTHNET_DATA_DIR", str(home))
    return home


@pytest.fixture
def cli_env(data_home: Path) -> dict[str, str]:
    """What a user has after `make demo`: `hearthnet` on PATH (this venv's), and the data
    dir above; one OpenMP thread per process (each TOML sets its torch threads)."""
    bindir = Path(sys.executable).parent
    if not (bindir / "hearthnet").exists():
        pytest.fail(f"no `hearthnet` next to {sys.executable}: install the project (make demo)")
    return {**os.environ, "HEARTHNET_DATA_DIR": str(data_home), "OMP_NUM_THREADS": "1",
            "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def _sh(cmd: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---- the files ----------------------------------------------------------------------------


@pytest.mark.parametrize("folder", [*HOST_FOLDERS, "compose"])
def test_each_folder_is_one_community_of_its_own_nodes(folder: str) -> None:
    cfgs = _configs(CONFIG / folder)
    assert len(cfgs) >= 3, cfgs
    ids = {c.node.id for c in cfgs.values()}
    listen = {c.node.listen_port: c.node.id for c in cfgs.values()}
    for path, cfg in cfgs.items():
        listed = {m.node_id for m in cfg.community.members}
        assert listed - {cfg.node.id} == ids - {cfg.node.id}, path  # every other node, no stranger
        for uri in cfg.node.peers:  # a peer is a node of this folder
            host, port = uri.split("://")[1].rsplit(":", 1)
            if folder == "compose":  # by service name (the node id) and its listen port
                assert host in ids and cfgs[COMPOSE / f"{host}.toml"].node.listen_port == \
                    int(port), (path, uri)
            else:
                assert host == "127.0.0.1" and listen.get(int(port)) in ids - {cfg.node.id}, \
                    (path, uri)


def test_the_folders_share_no_node_id_port_or_data_dir(data_home: Path) -> None:
    """`make keys` provisions mesh3, mesh4 and auto3 into one data dir, and a user may run
    two of them (or one beside `docker compose up`) at once."""
    ids: dict[str, str] = {}
    dirs: dict[Path, str] = {}
    ports: dict[int, str] = {}

    def claim(seen: dict[Any, str], value: Any, who: str) -> None:
        assert value not in seen, f"{who} and {seen[value]} share {value}"
        seen[value] = who

    for folder in HOST_FOLDERS:
        for path, cfg in _configs(CONFIG / folder).items():
            who = str(path.relative_to(REPO))
            claim(ids, cfg.node.id, who)
            claim(dirs, cfg.effective_data_dir(), who)
            assert cfg.effective_data_dir().is_relative_to(data_home), who  # the overridable base
            for key, port in _ports(cfg).items():
                claim(ports, port, f"{who} {key}")
    # compose: node ids of its own too, and the ports it publishes on this machine
    for name, svc in _compose_nodes().items():
        claim(ids, load_config(COMPOSE / f"{name}.toml").node.id, f"config/compose/{name}.toml")
        for _, port in _published(svc).values():
            claim(ports, port, f"docker-compose.yml {name}")
    for svc in _compose()["services"].values():  # every published port: host loopback only
        assert all(host == "127.0.0.1" for host, _ in _published(svc).values()), svc


def test_compose_publishes_each_nodes_api_on_the_hosts_loopback() -> None:
    """The OpenAI API and status page of every compose node are reachable from the host:
    the API listens on the container's interfaces (docker forwards a published port there,
    never to the container's loopback), compose publishes it on 127.0.0.1, and the name a
    client on the host uses is one the API's Host check accepts (else every call is a 403)."""
    for name, svc in _compose_nodes().items():
        cfg = load_config(COMPOSE / f"{name}.toml")
        assert cfg.api.enabled and cfg.api.listen_host in _WILDCARDS, name
        assert cfg.api.key_file and not cfg.api.loopback, name  # off loopback: a key
        host, port = _published(svc)[cfg.api.listen_port]
        assert host == "127.0.0.1", name
        policy = HostPolicy.build(cfg.api.listen_host, cfg.api.listen_port,
                                  cfg.api.allowed_hosts, cfg.api.allowed_origins)
        for sent in (f"127.0.0.1:{port}", f"localhost:{port}"):
            parsed = split_host(sent)
            assert parsed is not None and policy.host_ok(*parsed), (name, sent)
            assert policy.origin_ok(f"http://{sent}", sent)  # its own status page
        assert cfg.node.listen_port in _published(svc)  # /metrics and /health, as before


# ---- provisioning ---------------------------------------------------------------------------


def _startable(path: Path, cfg: NodeConfig) -> NodeGuard:
    """What `hearthnet node` checks before it serves anything: its own key, every member's
    key (`NodeGuard`: the member list it enforces), the shard ranges against the model and
    the API key file (`preflight`; ports are the machine's business, not the files')."""
    assert (cfg.effective_data_dir() / KEY_FILE_NAME).is_file(), f"{path}: no node key"
    guard = NodeGuard(cfg, Metrics())
    preflight(cfg, str(path), ports=False)
    return guard


def _make_keys_line() -> str:
    """The recipe of the Makefile's `keys:` target, with `$(HN)` as the user's `hearthnet`."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^keys:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "no keys: target in the Makefile"
    lines = [ln.strip() for ln in recipe.group(1).splitlines()]
    assert len(lines) == 1, lines
    return lines[0].replace("$(HN)", "hearthnet")


def test_make_keys_makes_every_node_of_every_folder_startable(data_home: Path,
                                                              cli_env: dict[str, str]) -> None:
    line = _make_keys_line()
    assert all(f"config/{f}" in line.split() for f in HOST_FOLDERS), line
    tomls = {p: p.read_bytes() for f in HOST_FOLDERS for p in (CONFIG / f).glob("*.toml")}
    r = _sh(line, cli_env)
    assert r.returncode == 0, r.stderr
    for folder in HOST_FOLDERS:
        cfgs = _configs(CONFIG / folder)
        ids = {c.node.id for c in cfgs.values()}
        for path, cfg in cfgs.items():
            assert re.search(rf"^{cfg.node.id}\s.*members: ", r.stdout, re.M), r.stdout
            guard = _startable(path, cfg)
            assert {m.node_id for m in guard.directory} == ids, path  # one community per folder
            # auto3's comments: node-a is the steward (`models serve`), in every list
            stewards = {n for n in ids if guard.is_steward(n)}
            assert stewards == ({"auto3-a"} if folder == "auto3" else set()), (path, stewards)
    assert {p: p.read_bytes() for p in tomls} == tomls  # the committed files as they were
    again = _sh(line, cli_env)  # idempotent: the same keys
    assert again.returncode == 0 and "new key" not in again.stdout, again.stdout


def test_compose_init_gives_every_node_its_keys_members_and_an_api_key(
        data_home: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    """compose's `init`, step by step from docker-compose.yml (model import aside: the
    test's store is already there), with /config in a temporary folder."""
    steps = [s.strip() for s in _compose()["services"]["init"]["command"][-1].split("&&")]
    folder = tmp_path / "config"
    folder.mkdir()
    for step in steps:
        if step == "hearthnet models import smollm2":
            continue
        r = _sh(_in(step, folder), cli_env)
        assert r.returncode == 0, (step, r.stderr)
    key_file = folder / "api-keys.txt"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_text().strip()
    assert len(key) >= 32 and "\n" not in key
    for step in steps[2:]:  # `init` again (a restart of the stack) keeps keys and API key
        r = _sh(_in(step, folder), cli_env)
        assert r.returncode == 0 and "new key" not in r.stdout, (step, r.stdout, r.stderr)
    assert key_file.read_text().strip() == key
    for name in _compose_nodes():
        path = folder / f"{name}.toml"
        cfg = load_config(path)
        guard = _startable(path, cfg)
        assert {m.node_id for m in guard.directory} == set(_compose_nodes()), name
        assert cfg.api_keys() == [key], name


def _in(step: str, folder: Path) -> str:
    """An `init` step with the container's /config-src and /config made this machine's."""
    step = step.replace("/config-src/", "\0")
    return re.sub(r"/config(?=[/ ]|$)", str(folder), step).replace("\0", f"{COMPOSE}/")


# ---- what `hearthnet node` refuses before it starts anything ------------------------------


def test_a_shard_range_outside_the_model_names_the_file_and_key(
        data_home: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "mesh3"
    shutil.copytree(CONFIG / "mesh3", folder)
    path = folder / "node-b.toml"
    path.write_text(path.read_text().replace("layers = [0, 14]", "layers = [0, 99]"))
    r = _sh(f"hearthnet node --config {path}", cli_env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"hearthnet: config error: {path}: shards[0] = [0, 99]: smollm2 has 30 layers (0-29)"]


def test_a_metrics_port_in_use_is_one_line_before_any_link(
        data_home: Path, cli_env: dict[str, str], tmp_path: Path) -> None:
    """mesh3's node-a, provisioned, with its metrics port taken: one line and exit 1 before
    the node listens or dials (no TLS session torn down mid-handshake), as for its listen
    port. Its other ports are made free ones: mesh3's own may be in use by another test."""
    folder = tmp_path / "mesh3"
    shutil.copytree(CONFIG / "mesh3", folder)
    path = folder / "node-a.toml"
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = path.read_text()
        for old, new in ((r"\nlisten_port = 7701\n", f"\nlisten_port = {free_port()}\n"),
                         (r"\nmetrics_port = 9701 ", f"\nmetrics_port = {port} "),
                         (r"\nlisten_port = 8080\n", f"\nlisten_port = {free_port()}\n")):
            text, n = re.subn(old, new, text)
            assert n == 1, old
        path.write_text(text)
        assert _sh(f"hearthnet keys provision {folder}", cli_env).returncode == 0
        r = _sh(f"hearthnet node --config {path}", cli_env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [
        f"hearthnet: port_in_use: the metrics listener cannot listen on 127.0.0.1:{port}: the "
        "port is in use (another node, or another program?); stop it or change [node] "
        "metrics_port"]


# ---- the auto3 flow of docs/operations.md, end to end --------------------------------------


def _auto3_commands() -> list[str]:
    """The shell lines docs/operations.md prints for config/auto3 (comments dropped)."""
    text = (REPO / "docs" / "operations.md").read_text()
    at = text.index("`config/auto3/` is a three-node example")
    block = re.search(r"^```sh\n(.*?)^```", text[at:], re.S | re.M)
    assert block, "no ```sh block after the config/auto3 paragraph"
    return [ln.split("  #")[0].strip() for ln in block.group(1).splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def _covered(api: str) -> bool:
    try:
        with urllib.request.urlopen(api + "/v1/models", timeout=5) as r:
            models = json.loads(r.read())["data"]
    except (OSError, ValueError, KeyError):
        return False
    return any(m["id"] == "smollm2" and m["hearthnet"]["fully_covered"] for m in models)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Node processes a test starts; stopped (SIGTERM, then SIGKILL) however it ends."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    try:
        wait_all_gone([p.pid for p in procs], "auto3 nodes stopping after SIGTERM", timeout=60)
    finally:
        for p in procs:
            if alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.slow
def test_auto3_runs_as_docs_operations_md_prints_it(
        cli_env: dict[str, str], tmp_path: Path, started: list[subprocess.Popen[str]]) -> None:
    cfgs = _configs(CONFIG / "auto3")
    taken = []
    for cfg in cfgs.values():
        for port in _ports(cfg).values():
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    taken.append(port)
    if taken:
        pytest.fail(f"config/auto3's ports {taken} are in use on 127.0.0.1: stop whatever "
                    "holds them (your own auto3 nodes?) and run this test again")
    commands = _auto3_commands()
    b = load_config(CONFIG / "auto3" / "node-b.toml")
    api_b = f"http://127.0.0.1:{b.api.listen_port}"  # what `status`/`chat` ask, as a page
    nodes = [c for c in commands if c.endswith("&")]
    assert [c.split()[-2] for c in nodes] == [f"config/auto3/{p.name}" for p in cfgs], nodes
    out: dict[str, subprocess.CompletedProcess[str]] = {}
    for cmd in commands:
        if cmd.endswith("&"):
            name = Path(cmd.split()[-2]).stem
            log = (tmp_path / f"{name}.log").open("w")
            started.append(subprocess.Popen(["bash", "-c", "exec " + cmd[:-1].strip()],
                                            cwd=REPO, env=cli_env, stdout=subprocess.PIPE,
                                            stderr=log, text=True, start_new_session=True))
            if len(started) == len(nodes):  # the next line asks node-a: all three are up
                for p, c in zip(started, nodes, strict=True):
                    wait_node_ready(p, 120, c, lambda: _logs(tmp_path))
            continue
        if cmd.startswith(("hearthnet status", "hearthnet chat")):
            # the automatic hosts place and load their layers after `models serve`; a
            # reader waits for coverage too (`status` says FULLY COVERED)
            wait_for(lambda: _covered(api_b), "smollm2 covered by the auto3 hosts",
                     timeout=150, every=0.5)
        r = _sh(cmd, cli_env, timeout=180)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:], _logs(tmp_path))
        out[cmd.split(" --")[0]] = r
    provisioned = out["hearthnet keys provision config/auto3"].stdout
    assert all(re.search(rf"^{n}\s.*members: ", provisioned, re.M)
               for n in ("auto3-a", "auto3-b", "auto3-c")), provisioned
    assert "smollm2" in out["hearthnet models serve smollm2"].stdout  # the steward's list
    status = out["hearthnet status"].stdout
    assert "FULLY COVERED" in status and "served models: smollm2 (set by auto3-a)" in status
    assert all(re.search(rf"^\s+layers\s+\d+-\d+\s+{n}$", status, re.M)
               for n in ("auto3-a", "auto3-b", "auto3-c")), status  # each took a range
    chat = out["hearthnet chat"]
    assert "Paris" in chat.stdout, chat.stdout
    assert ", wire " in chat.stderr, chat.stderr  # hidden states crossed the mesh: not local


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("*.log")))
