"""How long `hearthnet` commands take as a person runs them, against a running node.

    .venv/bin/python scripts/cli_latency.py [--runs 3] [--results-dir bench-results]

Starts one node holding the whole model (the stored `smollm2`), then runs each command
`--runs` times as a fresh process and prints the median wall time; writes
`cli_latency.json`. The commands run from the current directory's checkout, so running it
from two checkouts compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hearthnet.mesh.launcher import LocalMesh, NodeSpec

CLI = [sys.executable, "-m", "hearthnet.cli"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--results-dir", default="bench-results")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    spec = NodeSpec("node-a", [(0, 29)], extra_di={"allow_self_as_shard": True})
    figures: dict[str, dict[str, float | list[float]]] = {}
    with LocalMesh([spec]) as mesh:
        cfg = str(mesh.nodes["node-a"].config)
        commands = {
            "hearthnet --help": ["--help"],
            "hearthnet status": ["status", "--config", cfg],
            "hearthnet status --json": ["status", "--json", "--config", cfg],
            "hearthnet models list": ["models", "list"],
            "hearthnet chat --config (8 tokens)": ["chat", "--config", cfg,
                                                   "--max-tokens", "8", "Hi"],
        }
        for name, argv in commands.items():
            runs = []
            for _ in range(args.runs):
                t = time.perf_counter()
                r = subprocess.run(CLI + argv, capture_output=True, text=True, env=env)
                runs.append(round(time.perf_counter() - t, 3))
                if r.returncode != 0:
                    print(f"{name}: exit {r.returncode}: {r.stderr[-500:]}", file=sys.stderr)
                    return 1
            figures[name] = {"median_s": statistics.median(runs), "runs_s": runs}
            print(f"{name:<36} {statistics.median(runs):6.2f} s  (runs {runs})")
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli_latency.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {out / 'cli_latency.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
