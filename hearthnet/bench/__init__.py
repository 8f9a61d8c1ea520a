"""Benchmarks behind `hearthnet bench local|pipeline|failover` (M26 §8.2, §8.4).

Each module exposes ``add_args(parser)`` and ``run(args) -> (figures, report)`` for the
`BENCHMARKS` table of `hearthnet.commands.bench`. This module holds what they share:
the prompts, a plain-text table, the machine description every result carries, and
writing the figures to ``bench-results/<name>.json``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hearthnet.stats import median, percentile

__all__ = ["PROMPTS", "RESULTS_DIR", "goals_text", "machine", "median", "percentile",
           "table", "write_results"]

RESULTS_DIR = Path("bench-results")

# Prompts that make SmolLM2 write at length (greedy answers of 64+ tokens).
PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain in detail how a refrigerator keeps food cold.",
           "Describe a walk through a busy market on a summer morning.",
           "Write a letter to a friend about learning to bake bread.")


def machine(device: str = "cpu") -> dict[str, Any]:
    """Where and when a figure was measured (every result carries it); with the GPU, its
    driver and CUDA versions when `device` is not the CPU."""
    import torch

    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "host": platform.node(),
            "cpus": os.cpu_count(), "cpu": _cpu_model(), "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_at_start": [round(x, 2) for x in load],
            **_accelerator(device)}


def _accelerator(device: str) -> dict[str, Any]:
    if device == "cpu":
        return {}
    import torch
    import transformers

    from hearthnet.distributed_inference.engine.device import device_info, resolve_device

    info = device_info(resolve_device(device))
    return {"device": info, "cuda": torch.version.cuda, "transformers": transformers.__version__}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def goals_text(goals: dict[str, Any]) -> str:
    """A report's line of checked goals: ``name measured (met|MISSED, goal g), …``."""
    return ", ".join(f"{k} {g['measured']} ({'met' if g['met'] else 'MISSED'}, goal "
                     f"{g['goal']})" for k, g in goals.items())


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with columns padded to fit."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return "-" if v is None else str(v)


def write_results(name: str, figures: dict[str, Any], directory: Path = RESULTS_DIR) -> Path:
    """Write `figures` to ``<directory>/<name>.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    return path


def proc_memory() -> dict[str, float]:
    """This process's memory in MiB from /proc/self/status: peak (VmHWM) and current RSS.

    Falls back to ``getrusage`` (peak only) where /proc is missing.
    """
    return pid_memory("self")


def pid_memory(pid: int | str) -> dict[str, float]:
    """Memory of process `pid` ("self": this one) in MiB, as `proc_memory`."""
    out: dict[str, float] = {}
    keys = {"VmHWM": "peak_rss_mb", "VmRSS": "rss_mb", "RssAnon": "rss_anon_mb",
            "RssFile": "rss_file_mb"}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in keys:
                out[keys[k]] = round(int(v.split()[0]) / 1024, 1)  # kB
    except OSError:
        import resource

        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def single_model_dir(entry: Any, root: Path, share_compiled: bool = False) -> Path:
    """A models folder under `root` holding only `entry` (a symlink; or each of a list of
    entries: a model and its draft): the mesh's nodes then prepare only the benchmarked
    model, not every model of the store.

    With `share_compiled` its compiled steps' folder is the store's own (a symlink), so a
    benchmark that waits for warm steps loads them as a restarted node does instead of
    compiling every step afresh in a folder that is deleted with `root` (a 1.5B shard's
    decode, round and verify steps: ~2.5 min of both cores per run, measured). Where the
    store's folder cannot be made (a read-only store), the nodes compile into `root`."""
    d = root / "models"
    d.mkdir(parents=True, exist_ok=True)
    entries = entry if isinstance(entry, list) else [entry]
    for e in entries:
        if not (d / e.alias).exists():
            (d / e.alias).symlink_to(e.path, target_is_directory=True)
    if share_compiled and entries:
        from hearthnet.distributed_inference.engine.compiled import compile_dir_of

        store = compile_dir_of(entries[0])
        try:
            store.mkdir(parents=True, exist_ok=True)
        except OSError:
            return d
        if not (d / store.name).exists():
            (d / store.name).symlink_to(store, target_is_directory=True)
    return d
