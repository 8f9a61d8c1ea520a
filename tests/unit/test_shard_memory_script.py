"""`scripts/shard_memory.py` (where a shard's resident memory goes) runs and prints what
docs/benchmarks.md quotes: each stage's resident memory, and the loaded layers' weights
against every live tensor storage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_shard_memory_prints_each_stage_and_the_tensors_beside_the_weights(
        repo_root: Path, smollm2):
    r = subprocess.run([sys.executable, str(repo_root / "scripts" / "shard_memory.py"),
                        "--model", "smollm2", "--weights", "int8", "--layers", "0", "1"],
                       capture_output=True, text=True, timeout=300, cwd=repo_root,
                       env={**os.environ, "HEARTHNET_COMPILE": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    fig = json.loads(r.stdout)
    stages = {s["stage"]: s for s in fig["stages"]}
    assert list(stages)[:2] == ["interpreter", "torch imported"]
    loaded = stages["layers loaded"]
    # two int8 SmolLM2 layers: their weights are every tensor alive after loading
    assert 0 < loaded["weights_mb"] <= loaded["tensors_mb"] < loaded["weights_mb"] + 1
    assert loaded["rss_mb"] > stages["torch imported"]["rss_mb"] > stages["interpreter"]["rss_mb"]
    assert all(s["rss_mb"] >= s["rss_anon_mb"] > 0 for s in fig["stages"])
    assert "decode step and round compiled" not in stages and fig["steps"] == {}


def test_shard_memory_refuses_an_unknown_model_in_one_line(repo_root: Path, smollm2):
    r = subprocess.run([sys.executable, str(repo_root / "scripts" / "shard_memory.py"),
                        "--model", "no-such-model"],
                       capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("shard_memory: unknown model")
    assert "Traceback" not in r.stderr
