"""`hearthnet bench placement`: automatic split vs equal split on unequal hosts (M26 §10).

Two meshes of separate node processes on 127.0.0.1, one after the other, each with an
orchestrator (``node-o``, no shards) and three hosts that differ in torch threads and
memory budget (``--threads``, ``--budgets-mb``):

1. **equal**: the layers split by hand into three equal ranges, host 1 first;
2. **auto**: every host says ``shards = "auto"`` with its budget; ``node-o`` (the steward)
   puts the model on the served-model list and the hosts choose their ranges from their
   measured speeds (`hearthnet.distributed_inference.placement.planner`).

Per mesh: one warm-up chat, then ``--runs`` greedy chats of ``--tokens`` tokens through
``node-o``; reported: the split, each host's measured speed (automatic mesh) and the median
decode tokens/s of each, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.bench import PROMPTS, machine, median, table, write_results
from hearthnet.errors import BadRequest, HearthNetError

HOSTS = ("host-1", "host-2", "host-3")


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench placement`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store")
    p.add_argument("--tokens", type=positive, default=48, help="tokens per chat")
    p.add_argument("--runs", type=positive, default=3, help="measured chats per split")
    p.add_argument("--threads", default="2,1,1", help="torch threads of the three hosts")
    p.add_argument("--budgets-mb", default="450,250,250",
                   help="memory budgets of the three hosts (auto split)")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for placement.json (default bench-results)")


def _three(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 3 or min(vals) < 1:
        raise BadRequest(f"--{what} must be three positive integers, not {text!r}")
    return vals


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Run both meshes; returns (figures, report)."""
    from hearthnet.bench.pipeline import split_layers
    from hearthnet.mesh.launcher import NodeSpec
    from hearthnet.models import ModelStore

    threads, budgets = _three(args.threads, "threads"), _three(args.budgets_mb, "budgets-mb")
    entry = ModelStore().get(args.model)
    equal = [NodeSpec(h, [r], threads=t)
             for h, r, t in zip(HOSTS, split_layers(entry.num_layers, 3), threads,
                                strict=True)]
    auto = [NodeSpec(h, auto={"memory_mb": b}, threads=t)
            for h, b, t in zip(HOSTS, budgets, threads, strict=True)]
    figures: dict[str, Any] = {
        "benchmark": "placement", "model": args.model, "tokens": args.tokens,
        "runs": args.runs, "machine": machine(),
        "hosts": {h: {"torch_threads": t, "budget_mb": b}
                  for h, t, b in zip(HOSTS, threads, budgets, strict=True)}}
    for name, specs in (("equal", equal), ("auto", auto)):
        figures[name] = _measure(args, specs, serve=name == "auto")
    figures["auto_over_equal"] = round(figures["auto"]["tokens_per_s"] /
                                       max(1e-9, figures["equal"]["tokens_per_s"]), 3)
    figures["results_file"] = str(write_results("placement", figures, Path(args.results_dir)))
    return figures, report(figures)


def _measure(args: argparse.Namespace, hosts: list[Any], *, serve: bool) -> dict[str, Any]:
    from hearthnet.mesh.launcher import LocalMesh, NodeSpec

    specs = [NodeSpec("node-o", trust="steward"), *hosts]
    root = Path(tempfile.mkdtemp(prefix="hearthnet-bench-"))
    mesh = LocalMesh(specs, root=root, model=args.model)
    try:
        mesh.start(wait_cover=not serve)  # automatic hosts cover nothing before `serve`
        if serve:
            _serve(mesh, args.model)
        split = _wait_split(mesh)
        speeds = {h: _speed(mesh, h) for h in HOSTS} if serve else None
        rates, failures = asyncio.run(_chats(mesh.nodes["node-o"].uri, args))
    finally:
        mesh.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"split": split, "measured_speed": speeds, "tokens_per_s": round(median(rates), 2),
            "runs_tokens_per_s": [round(r, 2) for r in rates], "failed_chats": failures}


def _speed(mesh: Any, host: str) -> float | None:
    """The layer steps/s `host` measured for itself (its automatic-hosting status)."""
    me = mesh.status(host)["placement"]["this_node"] or {}
    return next((m["speed"] for m in me.get("models", {}).values()), None)


def _serve(mesh: Any, model: str) -> None:
    r = subprocess.run([sys.executable, "-m", "hearthnet.cli", "models", "serve", model,
                        "--config", str(mesh.nodes["node-o"].config)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise HearthNetError(f"models serve failed: {r.stderr.strip()}")


def _wait_split(mesh: Any, timeout: float = 180.0) -> dict[str, list[list[int]]]:
    """Wait until the hosts cover the model and the split holds still for 5 s; the ranges
    (a host whose share of the model rounds to no layer hosts nothing)."""
    deadline = time.monotonic() + timeout
    last: dict[str, list[list[int]]] = {}
    since = time.monotonic()
    while time.monotonic() < deadline:
        st = mesh.status("node-o")
        split: dict[str, list[list[int]]] = {}
        for s in st["shards"]:
            split.setdefault(s["host"], []).append(s["layers"])
        split = {h: sorted(split[h]) for h in sorted(split)}
        covered = all(m["fully_covered"] for m in st["models"] if m["alias"] == mesh.model)
        if not covered or split != last:
            last, since = split, time.monotonic()
        elif time.monotonic() - since >= 5.0:
            return split
        time.sleep(0.5)
    raise HearthNetError(f"the hosts did not cover {mesh.model} within {timeout:.0f} s")


async def _chats(uri: str, a: argparse.Namespace) -> tuple[list[float], list[str]]:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    rates: list[float] = []
    failures: list[str] = []
    for i in range(a.runs + 1):  # the first is a warm-up
        args = chat_args(a.prompt, a.model, SamplingParams(max_tokens=a.tokens),
                         fallback_to_local=False)
        try:
            frames = [f async for f in bus_call(uri, CHAT_CAPABILITY, args)]
        except HearthNetError as e:  # e.g. a keepalive lost on an overloaded machine
            failures.append(f"{e.code}: {e.message}"[:200])
            continue
        done = frames[-1]
        if done.get("type") != "done" or done.get("fallback"):
            failures.append(str(done)[:200])
        elif i:
            rates.append(float(done["timings"]["tokens_per_second"]))
    if not rates:
        raise HearthNetError(f"no chat ran through the mesh: {failures}")
    return rates, failures


def report(f: dict[str, Any]) -> str:
    rows = [[name, ", ".join(f"{h} {'+'.join(f'{a}-{b}' for a, b in r)}"
                             for h, r in f[name]["split"].items()),
             f[name]["tokens_per_s"]] for name in ("equal", "auto")]
    speeds = f["auto"].get("measured_speed") or {}
    hosts = "; ".join(f"{h}: {v['torch_threads']} threads, {v['budget_mb']} MB, measured "
                      f"{speeds.get(h)} layer steps/s" for h, v in f["hosts"].items())
    return (f"placement on unequal hosts ({hosts}), {f['model']}, {f['tokens']} tokens, "
            f"median of {f['runs']}\n" + table(["split", "ranges", "tok/s"], rows) +
            f"\nauto / equal = {f['auto_over_equal']}")
