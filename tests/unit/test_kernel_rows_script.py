"""`scripts/kernel_rows.py` (the int8 product's cost by activation rows) runs and writes
what docs/benchmarks.md quotes: a row count, hot and cold times, and the cold GB/s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_kernel_rows_prints_and_writes_each_row_count(repo_root: Path, tmp_path: Path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(repo_root / "scripts" / "kernel_rows.py"),
                        "--out", "512", "--in", "512", "--rows", "1", "3", "--matrices", "2",
                        "--runs", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert r.returncode == 0, r.stderr[-2000:]
    fig = json.loads(out.read_text())
    assert [row["rows"] for row in fig["rows"]] == [1, 3]
    assert all(row["hot_ms"] > 0 and row["cold_ms"] > 0 and row["cold_gb_s"] > 0
               for row in fig["rows"])
    assert fig["kernel"] in r.stdout and "512 × 512" in r.stdout
