"""`hearthnet bench <name>`: the benchmark command group.

Each benchmark is one entry of `BENCHMARKS`: a help line, a function adding its options
to its sub-parser, and a function running it and returning the figures as a
JSON-serialisable dict plus a human-readable report. Adding a benchmark (``local``,
``pipeline``, ``failover``) is adding an entry. Every benchmark gets ``--json`` (print the
figures as JSON on stdout; the human report goes to stderr) and ``--output FILE`` (also
write the JSON to FILE).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

AddArgs = Callable[[argparse.ArgumentParser], None]
RunBench = Callable[[argparse.Namespace], tuple[dict[str, Any], str]]


def _transport_args(p: argparse.ArgumentParser) -> None:
    from hearthnet.argtypes import number_in
    from hearthnet.constants import (
        TENSOR_CHUNK_BYTES,
        TENSOR_FLOW_CONTROL_WINDOW,
        TRANSPORT_IDLE_GAP_MS,
    )

    p.add_argument("--steps", type=int, default=2000,
                   help="decode round trips measured per tensor size (default 2000)")
    p.add_argument("--warmup", type=int, default=200, help="unmeasured round trips first")
    p.add_argument("--prefill-reps", type=int, default=20,
                   help="prefill round trips measured per size (default 20)")
    p.add_argument("--idle-gap-ms", type=number_in(0, 1000, "ms"), default=TRANSPORT_IDLE_GAP_MS,
                   help=f"also time a quarter of the decode steps each after this long idle, "
                        f"as a pipeline's hop follows the other stages' compute (default "
                        f"{TRANSPORT_IDLE_GAP_MS:g})")
    p.add_argument("--window", type=int, default=TENSOR_FLOW_CONTROL_WINDOW,
                   help="credit window in chunks")
    p.add_argument("--chunk-bytes", type=int, default=TENSOR_CHUNK_BYTES,
                   help="largest chunk payload in bytes")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for transport.json (default bench-results)")


def _transport_run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from hearthnet.bench import machine, write_results
    from hearthnet.transport.bench import format_report, run_transport_bench

    res = run_transport_bench(steps=args.steps, warmup=args.warmup,
                              prefill_reps=args.prefill_reps, window=args.window,
                              chunk_bytes=args.chunk_bytes, idle_gap_ms=args.idle_gap_ms)
    res.setdefault("machine", machine())
    res["results_file"] = str(write_results("transport", res, Path(args.results_dir)))
    return res, format_report(res)


def _lazy(module: str) -> tuple[AddArgs, RunBench]:
    """`add_args` and `run` of ``hearthnet.bench.<module>``, imported when used."""
    import importlib

    def add_args(p: argparse.ArgumentParser) -> None:
        importlib.import_module(f"hearthnet.bench.{module}").add_args(p)

    def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
        res: tuple[dict[str, Any], str] = importlib.import_module(
            f"hearthnet.bench.{module}").run(args)
        return res

    return add_args, run


BENCHMARKS: dict[str, tuple[str, AddArgs, RunBench]] = {
    "transport": ("tensor transport round trips against an echo peer process on 127.0.0.1",
                  _transport_args, _transport_run),
    "local": ("one machine: prefill, decode tokens/s, peak RSS of the whole model, each half "
              "and the head (each in a fresh process)", *_lazy("local")),
    "pipeline": ("distributed vs local tokens/s, per-hop overhead, first token, concurrency "
                 "(shards in separate processes on 127.0.0.1)", *_lazy("pipeline")),
    "quality": ("each weight format against each model's exact format (--model a b …): "
                "text top-1 agreement and KL, and first divergence along the exact "
                "format's greedy answers; --gguf: a GGUF's kept blocks against "
                "transformers' fp32 de-quantisation", *_lazy("quality")),
    "reach": ("the mission's headline: a model split over shard processes that each hold "
              "under half of it; peak RSS per process, tok/s, tokens vs local",
              *_lazy("reach")),
    "api": ("the OpenAI-compatible HTTP API against the capability bus: first token, "
            "tokens/s, gap between token chunks (shards in separate processes)",
            *_lazy("api")),
    "failover": ("kill -9 the last-stage shard mid-answer: time to the next token, total "
                 "time and tokens against an unfaulted run", *_lazy("failover")),
    "chaos": ("fault scenarios on fresh meshes (kill -9, SIGSTOP, restart, int8 restart, "
              "gossip partition, flood, orchestrator kill): answers lost, wrong-format uses, "
              "re-cover time", *_lazy("chaos")),
    "placement": ("automatic vs equal layer split on three hosts with different threads "
                  "and memory budgets", *_lazy("placement")),
    "household": ("a household on an emulated home network: nodes in network namespaces "
                  "on shaped links (gigabit, wifi, mixed), budgets below the model, "
                  "coverage, first token, tok/s, 8 chats, a node killed mid-answer",
                  *_lazy("household")),
    "anchor": ("HearthNet against llama.cpp (built once into a cache) on the same GGUF, "
               "machine and threads: local decode, prefill, RSS, store size; two shards vs "
               "llama.cpp RPC", *_lazy("anchor")),
}
"""name → (help, add_args, run). ``run`` returns (figures as a JSON-able dict, report)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` and one sub-command per entry of `BENCHMARKS`."""
    p = subparsers.add_parser("bench", help="measure HearthNet's performance",
                              description="Run a benchmark and print its figures.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (help_text, add_args, run_bench) in BENCHMARKS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        add_args(sp)
        sp.add_argument("--json", action="store_true",
                        help="print the figures as JSON on stdout (report on stderr)")
        sp.add_argument("--output", type=Path, metavar="FILE",
                        help="also write the figures as JSON to FILE")
        sp.set_defaults(func=_runner(run_bench))


def _runner(run_bench: RunBench) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from hearthnet.observability import configure_logging

        configure_logging("warning", json=False)  # logs to stderr: stdout is for figures
        figures, report = run_bench(args)
        text = json.dumps(figures, indent=2, sort_keys=True)
        if args.output is not None:
            args.output.write_text(text + "\n")
        if args.json:
            print(report, file=sys.stderr)
            print(text)
        else:
            print(report)
        return 0

    return run
