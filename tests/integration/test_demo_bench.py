"""`hearthnet demo` as a user runs it (the benchmarks' runs: test_bench_runs.py).

Each test runs the real command as a subprocess: real node processes on 127.0.0.1, the
real model. No timing is asserted — only that the figures exist, are consistent, and that
no process is left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hearthnet.bench.pipeline import split_layers
from tests.helpers.processes import INTERRUPTIBLE, alive, interrupt, wait_all_gone

CLI = [sys.executable, "-m", "hearthnet.cli"]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def _procs_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions `text` (e.g. the demo's temporary folder)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    out.append(int(d.name))
            except OSError:
                continue
    return [p for p in out if alive(p)]


def _frames(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# ---- pure helpers --------------------------------------------------------------------


def test_split_layers_is_an_even_contiguous_cover():
    assert split_layers(30, 2) == [(0, 14), (15, 29)]
    assert split_layers(30, 3) == [(0, 9), (10, 19), (20, 29)]
    assert split_layers(30, 4) == [(0, 7), (8, 15), (16, 22), (23, 29)]
    assert split_layers(30, 1) == [(0, 29)]


# ---- demo ------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "error"), [
    (["--max-tokens", "0"], "max_tokens must be in 1..8192, got 0"),
    (["--max-tokens", "4000"],  # within the sampler's range, over the nodes' limit
     "max_tokens 4000 is over this node's limit max_completion_tokens = 2048"),
    (["--prompt", "word " * 8000],
     "the prompt is 40000 bytes; this node's limit is max_prompt_bytes = 32768"),
])
def test_demo_refuses_bad_input_before_starting_any_node(smollm2, args, error):
    r = subprocess.run([*CLI, "demo", *args, "--json"], capture_output=True,
                       text=True, timeout=120, env=_env())
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == f"hearthnet: bad_request: {error}"
    assert r.stdout == ""  # no `demo_mesh` line: not one node process was started


def test_demo_json_streams_through_the_mesh_and_stops_every_node(smollm2):
    r = subprocess.run([*CLI, "demo", "--max-tokens", "16", "--json"], capture_output=True,
                       text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    frames = _frames(r.stdout)
    assert frames[0]["type"] == "demo_mesh" and frames[-1]["type"] == "demo_stopped"
    mesh = frames[0]
    assert {n: v["layers"] for n, v in mesh["nodes"].items()} == {
        "node-a": [], "node-b": [[0, 14]], "node-c": [[15, 29]]}
    kinds = [f["type"] for f in frames]
    assert kinds.count("shard_status") == 2
    # what each shard's decode steps run as (the suite turns compiled steps off)
    steps = frames[1]
    assert steps["type"] == "demo_decode_steps" and len(steps["shards"]) == 2
    assert set(steps["shards"].values()) == {"eager: HEARTHNET_COMPILE=0"}
    tokens = [f for f in frames if f["type"] == "token_delta"]
    assert 1 <= len(tokens) <= 16 and "".join(t["text"] for t in tokens).strip()
    done = next(f for f in frames if f["type"] == "done")
    assert done["usage"]["completion_tokens"] == len(tokens) and not done.get("fallback")
    assert [s.rsplit("@", 1)[1] for s in done["pipeline"]] == ["node-b", "node-c"]
    for s in done["timings"]["per_shard"].values():
        assert 0 < s["p50_ms"] <= s["p95_ms"]
    pids = [n["pid"] for n in mesh["nodes"].values()]
    assert sorted(frames[-1]["pids"]) == sorted(pids)
    assert not [p for p in pids if alive(p)]
    assert not _procs_mentioning(mesh["root"])
    assert not Path(mesh["root"]).exists()


def test_demo_ctrl_c_stops_every_node(smollm2):
    p = subprocess.Popen([*CLI, "demo", "--max-tokens", "400", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                         **INTERRUPTIBLE)
    try:
        assert p.stdout is not None
        mesh = json.loads(p.stdout.readline())
        assert mesh["type"] == "demo_mesh"
        line = p.stdout.readline()  # the chat is under way
        assert line, p.stderr.read() if p.stderr else ""
    finally:
        out, err = interrupt(p)
    assert p.returncode == 130, (out[-2000:], err[-2000:])
    assert _frames(out)[-1]["type"] == "demo_stopped"
    wait_all_gone([n["pid"] for n in mesh["nodes"].values()], "the demo's nodes to exit")
    assert not _procs_mentioning(mesh["root"])
