"""What a newcomer tripped over (issue 15 §6): start-up errors, `--version`."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "hearthnet.cli"]


def test_version(capsys):
    from hearthnet import __version__
    from hearthnet.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"hearthnet {__version__}\n"


@pytest.mark.parametrize("taken", ["node"])  # "api" goes through the same `binding`
def test_port_in_use_is_one_line(tmp_path: Path, taken: str):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        node_port = port if taken == "node" else 0
        cfg = tmp_path / "n.toml"
        cfg.write_text(f'[node]\nid = "node-x"\nlisten_port = {node_port}\n'
                       f'data_dir = "{tmp_path / "d"}"\n[api]\nlisten_port = '
                       f'{port if taken == "api" else 0}\n')
        r = subprocess.run([*CLI, "node", "--config", str(cfg)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    key = "[node] listen_port" if taken == "node" else "[api] listen_port"
    assert last.startswith("hearthnet: port_in_use: ") and f"127.0.0.1:{port}" in last, last
    assert key in last


def test_bench_transport_writes_bench_results(tmp_path: Path):
    """Every benchmark writes its figures to bench-results/ — transport too."""
    r = subprocess.run([*CLI, "bench", "transport", "--steps", "12", "--warmup", "2",
                        "--prefill-reps", "1", "--idle-gap-ms", "1",
                        "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    figures = json.loads((tmp_path / "transport.json").read_text())
    assert figures["decode_576"]["n"] == 12 and figures["decode_576"]["p50_ms"] > 0
    # a pipeline's hop follows an idle wait: a quarter of the steps timed after the gap
    idle = figures["decode_576_after_idle"]
    assert idle["n"] == 3 and idle["idle_gap_ms"] == 1.0 and idle["p50_ms"] > 0
    assert idle["ratio_p50"] == round(idle["p50_ms"] / figures["decode_576"]["p50_ms"], 2)
    assert "after 1 ms idle" in r.stdout + r.stderr
    assert figures["machine"]["cpus"] >= 1


@pytest.mark.parametrize("argv", [
    ["bench", "transport", "--idle-gap-ms", "0"],
    ["bench", "pipeline", "--node-threads", "0"],  # was: three nodes started, then a node's
    ["bench", "reach", "--tokens", "-3"],          # config error; the others ran to a
    ["bench", "local", "--runs", "0"],             # check labelled `internal`
    ["bench", "failover", "--tokens", "x"],
    ["chat", "--local", "--threads", "0", "hi"],   # was: torch's RuntimeError, a traceback
])
def test_a_count_below_one_is_a_usage_error_before_anything_starts(argv, capsys):
    from hearthnet.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(f"hearthnet {argv[0]}"), err
    assert f"argument {argv[-2] if argv[0] == 'bench' else '--threads'}" in err, err


def test_more_shards_than_layers_is_bad_request(smollm2):
    from hearthnet.bench.pipeline import split_layers
    from hearthnet.errors import BadRequest

    with pytest.raises(BadRequest, match=r"--shards must be in 1\.\.30"):
        split_layers(30, 31)


def test_the_command_line_is_parsed_without_importing_torch():
    """`hearthnet --help` and a bad argument answer at once: building the parser (every
    command's and benchmark's options) imports no torch (seconds on a small machine)."""
    code = ("import sys, hearthnet.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
