"""`hearthnet bench pipeline --netem DELAY` on real namespaces (`hearthnet.bench.netem`): the
benchmark's mesh with every node in its own namespace, the links shaped by the shaper the
benchmark picks here (netem where the kernel has it, else the user-space emulator).

In `make test`: bench pipeline's own mesh (`pipeline._on_mesh`, SmolLM2; one shard node
beside the orchestrator, two processes being quicker to start than three) on ``--netem
"8ms 1ms"``; one chat through it, whose stage's round trip pays the hop twice — at least
2 × (8 − 1) ms more than the shard's compute, and less than 28 ms, which a delay paid on
both links of a hop (the sender's and the receiver's) would cost at the least; then a
Ctrl-C in the middle of the measurement, after which no node process, emulator, namespace
or folder of the run is left.

In `make bench` (``HEARTHNET_BENCH_TESTS=1``): the command as a user runs it, in its plain,
``--speculate`` and ``--flow`` modes, leaving nothing behind. Skipped with the reason where
namespaces, or both netem and ``/dev/net/tun``, cannot be used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hearthnet.bench import lan, netem, pipeline
from hearthnet.bench.chats import chat_frames
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.processes import alive
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.netns

DELAY, JITTER = 8.0, 1.0
NETEM = f"{DELAY:g}ms {JITTER:g}ms"


@pytest.fixture(scope="module")
def shaped() -> netem.Choice:
    choice = netem.choose(NETEM)
    if choice.why_not is not None:
        pytest.skip(choice.why_not)
    return choice


def _leftovers(tag: str) -> str:
    """This run's namespaces, veths and bridge still there (`Lan`'s names: `tag`, then
    n<i>, v<i> or br — so that hnh12 does not match hnh123's)."""
    out = ""
    for cmd in (["ip", "netns", "list"], ["ip", "link"]):
        out += subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    mine = re.compile(rf"\b{tag}(n\d|v\d|br)")
    return "\n".join(line for line in out.splitlines() if mine.search(line))


@IN_MAKE_BENCH  # 40 s: the benchmark's own harness, checked where the benchmarks run
def test_the_benchmarks_mesh_pays_the_delay_once_per_hop_and_a_ctrl_c_leaves_nothing(
        shaped: netem.Choice, smollm2: Any, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    pipeline.add_args(parser)
    args = parser.parse_args(["--netem", NETEM, "--wire", "fp32", "--tokens", "8",
                              "--shards", "1"])
    args.net = shaped
    figures: dict[str, Any] = {"settings": {"netem": shaped.settings()}}
    seen: dict[str, Any] = {}

    def measure(mesh: Any) -> None:
        seen["pids"] = [n.proc.pid for n in mesh.nodes.values() if n.proc is not None]
        seen["root"] = mesh.root
        seen["emulator"] = mesh.lan.emulator.pid if mesh.lan.emulator else None
        seen["hosts"] = {nid: mesh.host(nid) for nid in mesh.nodes}
        frames, _ = asyncio.run(chat_frames(mesh.nodes["node-a"].uri, "Name three birds.",
                                            "smollm2", args.tokens, wire_dtype="fp32"))
        seen["done"] = frames[-1]
        raise KeyboardInterrupt  # a Ctrl-C while the benchmark measures

    with pytest.raises(KeyboardInterrupt):
        pipeline._on_mesh(args, pipeline.split_layers(smollm2.num_layers, 1), figures,
                          [smollm2], [], measure)
    # every node listened on its own namespace's address
    assert len(set(seen["hosts"].values())) == 2
    assert all(h.startswith(lan.SUBNET) for h in seen["hosts"].values())
    stages = seen["done"]["timings"]["per_shard"]
    assert len(stages) == 1
    for sid, st in stages.items():
        # a stage's round trip pays the hop there and back: ≥ 2 × (delay − jitter) beyond
        # the shard's compute; paid on both of a hop's links it would be ≥ 28 ms
        assert 2 * (DELAY - JITTER) <= st["overhead_p50_ms"] < 4 * (DELAY - JITTER), (sid, st)
    with capsys.disabled():
        print(f"\n--netem {NETEM} ({shaped.shaper}): the stage's overhead p50 "
              f"{[st['overhead_p50_ms'] for st in stages.values()]} ms per round trip")
    # nothing of the run is left
    assert not any(alive(p) for p in seen["pids"]), seen["pids"]
    if seen["emulator"] is not None:
        assert not alive(seen["emulator"])
        assert figures["settings"]["netem"]["emulator"]["delivered"] > 0
    assert not Path(seen["root"]).exists()
    assert _leftovers(f"hnh{os.getpid()}") == ""


# ---- the command, in make bench ----------------------------------------------------------


def _start(tmp_path: Path, *mode: str) -> tuple[subprocess.Popen[str], Path]:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TMPDIR=str(scratch))  # the run's folders go here: checked after
    p = subprocess.Popen([sys.executable, "-m", "hearthnet.cli", "bench", "pipeline",
                          "--netem", "2ms 0.5ms", "--runs", "1", "--tokens", "8",
                          "--wire", "fp32", *mode, "--json", "--results-dir",
                          str(tmp_path / "results")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return p, scratch


def _assert_nothing_left(p: subprocess.Popen[str], scratch: Path) -> None:
    assert [x.name for x in scratch.iterdir() if x.name.startswith("hearthnet-")] == []
    assert _leftovers(f"hnh{p.pid}") == ""  # namespaces (their processes die with them)
    assert not any(f"hnh{p.pid}" in " ".join(c) for c in _command_lines())  # the emulator


def _command_lines() -> list[list[str]]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and alive(int(d.name)):
            try:
                out.append((d / "cmdline").read_bytes().decode(errors="replace").split("\0"))
            except OSError:
                continue
    return out


def _run_bench(tmp_path: Path, *mode: str) -> tuple[dict[str, Any], int]:
    p, scratch = _start(tmp_path, *mode)
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    _assert_nothing_left(p, scratch)
    f = json.loads(out)
    net = f["settings"]["netem"]
    assert net["applied"] and net["delay"] == "2ms 0.5ms"
    assert net["shaper"] == lan.pick_shaper().name
    assert net["per_link"]["delay_ms"] == 1.0 and net["per_link"]["jitter_ms"] == 0.25
    assert f["results_file"].endswith("-netem.json")
    return f, p.pid


@IN_MAKE_BENCH
@pytest.mark.parametrize("mode", [["--speculate", "lookup"], ["--flow", "300"],
                                  ["--concurrency", "1", "--no-fp32"]],
                         ids=["speculate", "flow", "plain"])
def test_every_mode_of_bench_pipeline_runs_on_the_shaped_links(shaped, smollm2, tmp_path,
                                                               mode):
    f, _ = _run_bench(tmp_path, *mode)
    if mode[0] == "--speculate":
        edit = f["speculative"]["prompts"]["edit"]
        assert edit["lookup"]["identical_to_off"] and edit["lookup"]["tokens_per_pass"] > 1
        assert edit["off"]["hops_overhead_p50_ms"] >= 2 * 2 * (2.0 - 0.5)  # two stages
    elif mode[0] == "--flow":
        assert f["flow"]["same_tokens"]
    else:
        assert f["distributed"]["hops"]["overhead_p50_ms_max"] >= 2 * (2.0 - 0.5)


def _node_in(ns: str) -> int | None:
    """A node process in namespace `ns`, or None (also while `ns` does not exist: `ip`
    then writes its complaint on stdout)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                       check=False)
    for pid in r.stdout.split() if r.returncode == 0 else []:
        try:
            if "hearthnet.cli\0node" in Path(f"/proc/{pid}/cmdline").read_text():
                return int(pid)
        except OSError:
            continue
    return None


@IN_MAKE_BENCH
def test_a_sigterm_mid_run_leaves_nothing_behind(shaped, smollm2, tmp_path):
    p, scratch = _start(tmp_path, "--speculate", "lookup")
    try:  # the last node runs in its namespace: the mesh is being started
        wait_for(lambda: _node_in(f"hnh{p.pid}n2"), "the last node in its namespace",
                 timeout=300)
        p.terminate()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # ended by the signal's cleanup (the CLI's own exit), not killed by it outright
    assert p.returncode > 0 and "Traceback" not in err, (p.returncode, err[-3000:])
    _assert_nothing_left(p, scratch)
