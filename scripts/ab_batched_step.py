"""A/B of a shard stack's batched decode step on the CPU: 8 sessions' rows in one forward
against the same 8 steps run one by one, at short and long cached contexts.

Run from two checkouts in turn (before/after a change), on one machine, one process each:
    PYTHONPATH=<checkout> HEARTHNET_COMPILE=0 python scripts/ab_batched_step.py \
        --model qwen2.5-1.5b --weights int8 --layers 4
(`hearthnet models synth qwen2.5-1.5b` makes the model). Prints JSON: per context and
batch size, the median ms of a batched step (`decode_batch`) and of the rows run solo.
With ``--compiled`` (and ``HEARTHNET_COMPILE=1``) the stack's decode step and decode
round are compiled first (saved in the model store's ``.compiled/``, loaded on the next
run), so the figures are those of a warm node's compiled steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from hearthnet.distributed_inference.engine.compiled import compile_dir_of
from hearthnet.distributed_inference.engine.layers import LayeredStack
from hearthnet.models import ModelStore


def _ms(f: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times[1:]), 2)


def _solo(sessions: list[Any], xs: list[torch.Tensor], at: int) -> None:
    for s, x in zip(sessions, xs, strict=True):
        s.forward(x, at)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--weights", default="int8")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--contexts", type=int, nargs="+", default=[110, 2000])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true",
                   help="compile the decode step and round first (HEARTHNET_COMPILE=1)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    entry = ModelStore().get(a.model)
    stack = LayeredStack(entry, 0, a.layers - 1, a.weights, compile_decode=a.compiled,
                         compile_dir=compile_dir_of(entry))
    steps: dict[str, str] = {}
    if stack.compiled is not None:
        stack.compiled.after_decode = ("round",)
        stack.compiled.start(0, a.layers - 1)
        steps = {"decode": stack.compiled.wait(0, a.layers - 1),
                 "round": stack.compiled.wait_extra("round", 0, a.layers - 1)}
    g = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for ctx in a.contexts:
        sessions = [stack.open_session(0, a.layers - 1, ctx + 64) for _ in range(a.sessions)]
        for s in sessions:
            s.forward(torch.randn(1, ctx, stack.hidden_size, generator=g) * 0.1, 0)
        xs = [torch.randn(1, 1, stack.hidden_size, generator=g) * 0.1 for _ in sessions]
        starts = [ctx] * len(sessions)  # a redo at `ctx` each time
        out[f"context_{ctx}"] = {
            "batched_ms": _ms(partial(stack.decode_batch, sessions, xs, starts), a.runs),
            "solo_rows_ms": _ms(partial(_solo, sessions, xs, ctx), a.runs)}
        for s in sessions:
            s.close()
    print(json.dumps({"model": a.model, "weights": a.weights, "layers": a.layers,
                      "sessions": a.sessions, "threads": a.threads, "steps": steps,
                      "figures": out}))


if __name__ == "__main__":
    main()
