"""`hearthnet bench household` as a user runs it: a two-node SmolLM2 household (`make bench`).

The real command as a subprocess: two node processes (each in a shaped namespace where
netem exists, else on the loopback, said on stderr), budgets below the model, the model
covered by the two automatic hosts, chats, and a node killed mid-answer. No timing is
asserted — only that the figures are there and consistent, and that nothing is left behind
(processes, namespaces, temporary folders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hearthnet.bench import lan
from tests.helpers.marks import IN_MAKE_BENCH
from tests.helpers.processes import INTERRUPTIBLE, alive, interrupt, wait_all_gone
from tests.helpers.waiting import wait_for


def _running_under(folder: Path, word: str = "") -> list[int]:
    """Processes whose command line names `folder` (the household's node configs) and
    holds `word`."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(folder) in cmd and word in cmd and alive(int(p.name)):
                out.append(int(p.name))
    return out


def _start(scratch: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TMPDIR=str(scratch))  # the household's folders go here: checked after
    return subprocess.Popen([sys.executable, "-m", "hearthnet.cli", "bench", "household",
                             "--nodes", "2", "--budget-fraction", "0.6", "--profile", "wifi",
                             "--import-on", "all", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **INTERRUPTIBLE)


def _assert_nothing_left(scratch: Path, pid: int) -> None:
    """No node process, namespace, link or temporary folder of bench process `pid`."""
    assert _running_under(scratch) == []
    assert [p.name for p in scratch.iterdir() if p.name.startswith("hearthnet-")] == []
    assert _running_under(Path(f"hnh{pid}"), "hearthnet.bench.linkem") == []  # no emulator
    if lan.unavailable() is None:
        for cmd in (["ip", "netns", "list"], ["ip", "link"]):
            out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
            assert f"hnh{pid}" not in out, out


@IN_MAKE_BENCH
def test_a_two_node_household_covers_answers_and_survives_a_kill(smollm2, tmp_path):
    results, scratch = tmp_path / "results", tmp_path / "tmp"
    scratch.mkdir()
    shaper = lan.pick_shaper()
    why = None if shaper.name else shaper.note
    p = _start(scratch, "--tokens", "12", "--runs", "1", "--concurrency", "1", "2",
               "--kill-after", "4", "--json", "--results-dir", str(results))
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    f = json.loads(out)
    assert json.loads(Path(f["results_file"]).read_text()) == {
        k: v for k, v in f.items() if k != "results_file"}
    # the profile applied where namespaces can be shaped (netem, else the user-space
    # emulator); elsewhere the output says why not
    assert f["link"]["applied"] is (why is None)
    assert f["link"]["shaper"] == shaper.name
    if why is not None:
        assert f"--profile wifi: {why}; running on the plain loopback" in err
        assert f["link"]["why_not"] == why
    # both hosts hold a part, within their budgets, and together every layer
    nodes = f["coverage"]["nodes"]
    assert set(nodes) == {"node-1", "node-2"} and f["coverage"]["covered"]
    per_layer = f["layers_held_bytes"] / smollm2.num_layers
    layers = set()
    for n in nodes.values():
        assert 0 < n["layer_count"] <= n["budget_mb"] * 2**20 // per_layer
        assert n["imported"] and n["bytes_fetched"] in (None, 0)  # every store imported
        layers |= {i for lo, hi in n["layers"] for i in range(lo, hi + 1)}
    assert layers == set(range(smollm2.num_layers))
    assert f["budget_fraction_of_layers"] <= 0.6
    s = f["single"]
    assert s["tokens_per_second"] > 0 and s["completion_tokens"] == 12
    assert [lv["concurrency"] for lv in f["concurrency"]] == [1, 2]
    assert all(lv["local_fallbacks"] == 0 for lv in f["concurrency"])
    # the killed node's layers are held by no live node, and node-1's budget cannot hold
    # the whole model: the chat ends with an error that says so, after the same tokens
    k = f["kill"]
    assert k["node"] == "node-2" and not k["completed"] and 4 <= k["completion_tokens"] < 12
    assert k["tokens_identical"]
    assert k["how"] == "ended with an error: shard_unavailable"
    assert "over this node's budget" in k["error"]
    assert f["goals"]["covered"]["met"] and f["goals"]["chat_answered"]["met"]
    _assert_nothing_left(scratch, p.pid)


@IN_MAKE_BENCH
def test_ctrl_c_mid_household_leaves_nothing_behind(smollm2, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = _start(scratch, "--results-dir", str(tmp_path / "results"))
    try:
        # both node processes are up (the household is being built) before the Ctrl-C
        wait_for(lambda: len(_running_under(scratch, "node")) >= 2,
                 "the household's two node processes", timeout=300)
    finally:
        _, err = interrupt(p)
    assert p.returncode != 0 and "Traceback" not in err, err[-3000:]
    wait_all_gone(_running_under(scratch), "the household's processes")
    _assert_nothing_left(scratch, p.pid)


@IN_MAKE_BENCH
def test_one_import_covers_the_household_by_fetching_only_each_nodes_layers(smollm2,
                                                                           tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = _start(scratch, "--import-on", "one", "--cover-timeout", "300", "--tokens", "8",
               "--runs", "1", "--concurrency", "1", "--kill-after", "3", "--json",
               "--results-dir", str(tmp_path / "results"))
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-3000:]
    f = json.loads(out)
    first, other = f["coverage"]["nodes"]["node-1"], f["coverage"]["nodes"]["node-2"]
    assert first["imported"] and not other["imported"] and other["layer_count"] > 0
    # node-2 started with an empty store: it fetched its layers, and little more
    assert f["coverage"]["fetch_reported"] and other["bytes_fetched"] > 0
    assert 1.0 <= other["fetch_ratio"] <= 1.1 and f["goals"]["fetch_ratio"]["met"]
    assert f["single"]["completion_tokens"] == 8 and f["kill"]["completed"]
    _assert_nothing_left(scratch, p.pid)
