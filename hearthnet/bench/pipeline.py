"""`hearthnet bench pipeline`: distributed against local on one machine (M26 §8.2, §8.4).

Starts a mesh of separate `hearthnet node` processes on 127.0.0.1 (`LanMesh`; with
``--netem DELAY``, each in its own network namespace a household link apart,
`hearthnet.bench.netem`): node A orchestrates, and N shard nodes host an even split of the
layers (N=2: 0–14/15–29; N=3: 0–9/10–19/20–29). After a warm-up call on each side it
measures, per run and reported as the median of ``--runs``:

- local decode tokens/s: `LocalEngine` in this process, greedy, with ``--local-threads``
  and with one thread (on a small model and a shared 2-core machine one thread can be the
  faster); ratios are given to both, and the goal uses the faster of the two;
- distributed decode tokens/s through node A over the bus, with the wire dtype of
  ``--wire`` (fp16 by default) and, unless ``--no-fp32``, fp32 too; their ratios to local;
- per-hop overhead (a stage's round trip minus the shard's own compute), first-token ms
  and construction ms, from the `done` frame's timings;
- at each ``--concurrency`` level, that many chats at once through the same mesh
  (continuous batching, `hearthnet.bench.concurrency`): aggregate and per-chat tokens/s, inter-token
  latency, the shards' and the head's batch sizes, tokens against each prompt run alone.
  ``--concurrency-only`` measures just that (no local baseline, no wire comparison).

Local and distributed runs alternate so a change in the machine's load hits both. Every
node process runs ``--node-threads`` torch threads. The goals checked are those set for the
run's scene (`goals_for`): SmolLM2's on CPU (`GOALS`), qwen2.5-3b's over two shards on CPU
(`SCALE_GOALS`), the 3B shape's on a GPU (`GPU_GOALS`); none for any other model or split.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import decode_tokens, positive
from hearthnet.bench import (
    PROMPTS,
    concurrency,
    goals_text,
    machine,
    median,
    netem,
    pid_memory,
    proc_memory,
    single_model_dir,
    table,
    write_results,
)
from hearthnet.bench.chats import chat_frames, token_ids
from hearthnet.bench.lan import add_shaper_arg, lan_mesh, terminate_as_interrupt
from hearthnet.bench.local import weights_of
from hearthnet.constants import WIRE_DTYPES
from hearthnet.distributed_inference.directory.formats import FORMATS, head_format, policy_for
from hearthnet.errors import BadRequest, HearthNetError
from hearthnet.mesh.launcher import log_tails

GOALS = {"ratio_min": 0.85, "first_token_ms_max": 300.0, "construction_ms_max": 100.0,
         "overhead_p95_ms_max": 2.0}
"""Goals of the default SmolLM2 split over shard nodes on CPU, tighter than M26 §8.4's."""
SCALE_GOALS = {"ratio_min": 0.95}
"""Goal of qwen2.5-3b over two shards on CPU, where compute dominates and the hop
must not show."""
GPU_GOALS = {"ratio_min": 0.7, "first_token_ms_max": 100.0, "construction_ms_max": 50.0,
             "overhead_p95_ms_max": 1.0, "tokens_per_second_min": 100.0}
"""Goals on one H100 with the shard processes sharing the GPU (3B shape)."""


def goals_for(model: str, shards: int, gpu: bool) -> tuple[str, dict[str, float]]:
    """The goals a run is checked against and the scene they were set for: ("", {}) for a
    scene without goals (SmolLM2's 300 ms first token, say, is no goal for a 3B on a
    2-core CPU)."""
    if gpu:
        return "3B shape on a GPU", GPU_GOALS
    if model == "qwen2.5-3b" and shards == 2:
        return "3B over two CPU shards", SCALE_GOALS
    if model == "smollm2":
        return "SmolLM2 on CPU", GOALS
    return "", {}


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench pipeline`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store (any stored "
                   "or synthetic model)")
    p.add_argument("--weights", default="fp32", choices=FORMATS,
                   help="held format of the shards, the orchestrator's head and the local "
                        "baseline (default fp32)")
    p.add_argument("--shards", type=positive, default=2, help="shard nodes (even layer split)")
    p.add_argument("--tokens", type=decode_tokens, default=64, help="tokens generated per chat")
    p.add_argument("--runs", type=positive, default=3, help="measured runs (median; default 3)")
    p.add_argument("--concurrency", type=positive, nargs="+", default=[1, 2, 4],
                   help="concurrent chats for the aggregate figure (default 1 2 4; the "
                        "batching goals compare 8 with 1)")
    p.add_argument("--context", type=positive, default=None, metavar="TOKENS",
                   help="the concurrency levels' prompts made about TOKENS tokens long (a "
                        "text before each), so every chat decodes over a long cache")
    p.add_argument("--concurrency-only", action="store_true",
                   help="only the concurrency levels: no local baseline, no wire comparison")
    p.add_argument("--batch-window-ms", type=float, default=None,
                   help="every node's batch_window_ms (default: the config default)")
    p.add_argument("--mixed-prefill-tokens", type=int, default=None,
                   help="every node's mixed_prefill_tokens (default: the config default)")
    p.add_argument("--lanes", type=int, default=None, choices=range(9), metavar="{0..8}",
                   help="the orchestrator's pipeline_lanes (0: one per stage; default: the "
                        "config default, 1)")
    p.add_argument("--no-prefix-sharing", action="store_true",
                   help="chats compute every prompt position, also those they share with "
                        "another running chat (prefix_sharing = false)")
    p.add_argument("--local-threads", type=positive, default=2,
                   help="torch threads of the local baseline (this process)")
    p.add_argument("--node-threads", type=positive, default=1, help="torch threads per node")
    p.add_argument("--wire", choices=list(WIRE_DTYPES), default="fp16")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32-wire comparison")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--device", default="cpu",
                   help="auto | cpu | cuda | cuda:N | mps: every shard node, the "
                        "orchestrator's head and the local baseline (default cpu)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype of shards, head and local baseline (default fp32)")
    p.add_argument("--goals", choices=["cpu", "gpu"], default=None,
                   help="which goals to check (default: gpu unless --device cpu)")
    p.add_argument("--speculate", nargs="+", choices=["off", "lookup", "draft"], default=None,
                   help="measure speculative passes instead (DESIGN.md decision 16): these "
                        "modes beside off, on an edit prompt and a plain one")
    p.add_argument("--draft", default=None,
                   help="the draft model (an alias in the store) for --speculate draft")
    p.add_argument("--flow", type=positive, default=None, metavar="TOKENS",
                   help="measure instead the first token of a prompt of about TOKENS tokens "
                        "whose chunks flow through the stages, against the prompt sent whole")
    p.add_argument("--netem", default=None, metavar="DELAY",
                   help='every node process in its own network namespace, each hop between '
                        'two of them delayed DELAY each way (tc netem delay arguments "TIME '
                        '[JITTER] [loss PCT%%]", e.g. "2ms 0.5ms": a household Wi-Fi; root); '
                        'without namespaces it says why and runs on the plain loopback')
    add_shaper_arg(p, "with --netem, ")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="copy the mesh nodes' logs into DIR before the mesh's folder is "
                        "removed (node-<id>.log: why a round was slow, what compiled)")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for pipeline-<N>.json (default bench-results)")


MEMORY_GOAL = {"cache_factor": 1.2}
"""A shard's peak RSS at 8 × 2,000-token sessions ≤ its weights + 1.2 × its caches."""


def reset_peak_rss(pid: int) -> bool:
    """Reset process `pid`'s peak RSS (VmHWM) to its RSS now (Linux ``clear_refs`` 5), so
    that the peak read later is that of the work since, not loading's conversion
    temporaries; whether it could be reset."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then includes the load
        return False
    return True


def shard_memory(held: dict[str, Any], loaded: dict[str, float] | None = None,
                 reset: bool = False) -> dict[str, Any]:
    """A shard node's memory (its status's ``memory``, `engine.memory.process_memory`) in
    MiB, and the memory goal checked two ways: the peak RSS against weights + 1.2 × the
    caches' peak (allocated slots, each preallocated at its session's capacity) as the
    goal is written — the runtime (interpreter, torch, transformers) counted — and the
    peak RSS less the runtime baseline (the RSS before the shard's weights were read).
    `loaded`: the node's `pid_memory` once its weights were loaded, before the chats;
    `reset`: whether its peak was reset then (the peak is then the chats' alone)."""
    def mib(key: str) -> float | None:
        v = held.get(key)
        return None if v is None else round(v / 2**20, 1)

    peak, base = mib("peak_rss_bytes"), mib("runtime_baseline_bytes")
    weights, kv = mib("weights_bytes") or 0.0, mib("kv_peak_bytes") or 0.0
    limit = round(weights + MEMORY_GOAL["cache_factor"] * kv, 1)
    slots = int(held.get("kv_peak_slots", 0))
    out: dict[str, Any] = {
        "peak_rss_mb": peak, "rss_mb": mib("rss_bytes"), "weights_mb": weights,
        "kv_peak_mb": kv, "kv_peak_sessions": slots,
        "kv_per_session_mb": round(kv / slots, 1) if slots else None,
        "kv_now_mb": mib("kv_bytes"), "kv_allocation": held.get("kv_allocation"),
        "runtime_baseline_mb": base, "limit_mb": limit,
        "peak_rss_since": "the chats began (reset after loading)" if reset else "start",
        "goal": f"peak RSS ≤ weights + {MEMORY_GOAL['cache_factor']} × caches"}
    if loaded:
        out["loaded_rss_mb"] = loaded.get("rss_mb")
        out["loaded_peak_rss_mb"] = loaded.get("peak_rss_mb")  # loading's, with its temporaries
    if peak is not None:
        out["met_counting_runtime"] = peak <= limit
        out["margin_counting_runtime_mb"] = round(limit - peak, 1)
        if base is not None:
            out["above_runtime_mb"] = round(peak - base, 1)
            out["met_above_runtime"] = peak - base <= limit
            out["margin_above_runtime_mb"] = round(limit - (peak - base), 1)
    return out


def shard_memory_report(shards: dict[str, dict[str, Any]]) -> str:
    """One line per shard node: peak RSS beside weights, caches and the runtime, and the
    goal both ways."""
    lines = []
    for n, m in shards.items():
        line = (f"  {n}: peak RSS {m['peak_rss_mb']} MiB since {m['peak_rss_since']}"
                + (f" (loaded: RSS {m['loaded_rss_mb']} MiB, peak while loading "
                   f"{m['loaded_peak_rss_mb']} MiB)" if "loaded_rss_mb" in m else "")
                + f"; weights {m['weights_mb']} MiB + "
                f"KV caches at their peak {m['kv_peak_mb']} MiB ({m['kv_peak_sessions']} "
                f"sessions' slots, {m['kv_per_session_mb']} MiB each, allocated) → limit "
                f"{m['limit_mb']} MiB; runtime baseline {m['runtime_baseline_mb']} MiB")
        if "met_counting_runtime" in m:
            line += (f"; runtime counted (as the goal is written): "
                     f"{'met' if m['met_counting_runtime'] else 'MISSED'} "
                     f"({m['margin_counting_runtime_mb']:+} MiB)")
        if "met_above_runtime" in m:
            line += (f"; above the runtime ({m['above_runtime_mb']} MiB): "
                     f"{'met' if m['met_above_runtime'] else 'MISSED'} "
                     f"({m['margin_above_runtime_mb']:+} MiB)")
        lines.append(line)
    if not lines:
        return ""
    return (f"shard memory (goal: peak RSS ≤ weights + {MEMORY_GOAL['cache_factor']} × "
            f"caches):\n" + "\n".join(lines))


def split_layers(num_layers: int, n: int) -> list[tuple[int, int]]:
    """`n` contiguous inclusive ranges covering ``0..num_layers-1``, as even as possible."""
    if not 1 <= n <= num_layers:
        raise BadRequest(f"cannot split {num_layers} layers into {n} shards; --shards must be "
                         f"in 1..{num_layers}")
    base, extra = divmod(num_layers, n)
    out, lo = [], 0
    for i in range(n):
        hi = lo + base + (1 if i < extra else 0) - 1
        out.append((lo, hi))
        lo = hi + 1
    return out


def head_step_ms(entry: Any, weights: str, *, steps: int = 24, threads: int | None = None
                 ) -> float:
    """The orchestrator's own part of a decode step, timed: embed a token, norm + lm_head
    of a hidden state, greedy pick (median of `steps`, ms)."""
    import torch

    from hearthnet.distributed_inference.engine.head import LayeredHead

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        head = LayeredHead(entry, weights)
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            head.embed([i])
            int(head.logits(torch.randn(1, 1, entry.hidden_size)).argmax())
            times.append(time.perf_counter() - t0)
        return float(median(times[1:]) * 1000)
    finally:
        torch.set_num_threads(before)


def predict_run(entry: Any, args: argparse.Namespace, ranges: list[tuple[int, int]],
                hop: Any = None) -> dict[str, Any]:
    """The plan's prediction for this run's mesh (node A orchestrates, one shard node per
    range), before it starts: every node is this machine at ``--node-threads`` threads,
    timed two ways — a real decoder layer in the engine, and the matrix-vector probe the
    automatic hosts advertise — with `hop` (a `predict.Sourced` per-hop cost measured on
    this mesh) or else the default hop cost. The head: its real step timed (embed, norm +
    lm_head, greedy pick) beside the engine's layers, the probe's matmul beside the
    probe's."""
    from hearthnet.distributed_inference.engine.quant import compute_dtype_of
    from hearthnet.distributed_inference.placement import predict
    from hearthnet.distributed_inference.placement.planner import (
        measure_batch_factor,
        measure_layer_speed,
        measure_speed,
        timed_window,
    )
    from hearthnet.models.sizes import safetensors_sizes

    costs = predict.layer_costs(safetensors_sizes(entry.path, entry.alias), args.weights)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(args.node_threads)
    try:
        probe = measure_speed(costs.params_per_layer, entry.hidden_size,
                              dtype=compute_dtype_of(costs.fmt))
    finally:
        torch.set_num_threads(before)
    window = timed_window(entry, costs.fmt, None)  # loaded once for both timings
    engine = measure_layer_speed(entry, costs.fmt, threads=args.node_threads, window=window)
    factor = measure_batch_factor(entry, costs.fmt, rows=predict.CHATS,
                                  threads=args.node_threads, window=window)
    del window
    head_ms = head_step_ms(entry, costs.head_fmt, threads=args.node_threads)
    # the timed head step as layer steps per second of the head's matmul
    head_speed = costs.head_matmul_params / max(1, costs.params_per_layer) / (head_ms / 1000)
    out: dict[str, Any] = {"layer_steps_per_s": {"engine": round(engine, 1),
                                                 "probe": round(probe, 1)},
                           "head_step_ms": round(head_ms, 3),
                           "batch_factor": round(factor, 3)}
    batched = predict.Sourced(factor, f"measured here: {predict.CHATS} rows of a real decoder "
                                      f"layer step as one forward against one row "
                                      f"({factor:.2f}x the one-row rate)")
    for name, speed, source in (
            ("engine", engine, "a real decoder layer, one-token steps, eager"),
            ("probe", probe, "matrix-vector probe (as automatic hosts advertise)")):
        s = predict.Sourced(speed, f"measured here, {args.node_threads} thread(s): {source}")
        nodes = [predict.NodeFacts("node-a", s, orchestrator=True, head_held=True,
                                   head_speed=head_speed if name == "engine" else probe)] + [
            predict.NodeFacts(f"node-{chr(ord('b') + i)}", s, holds=(r,))
            for i, r in enumerate(ranges)]
        out[name] = predict.plan(costs, nodes, hop,
                                 batched if name == "engine" else None).to_dict()
    return out


def predicted_beside_measured(pred: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
    """Predicted single-chat (and 8-chat where measured) tok/s beside the run's, and the
    ratio predicted / measured (the goal: within ±25 %)."""
    from hearthnet.distributed_inference.placement.predict import CHATS

    out = dict(pred)
    d = f.get("distributed")
    levels = {c["concurrency"]: c for c in f.get("concurrency", [])}
    for name in ("engine", "probe"):
        p = pred[name]
        row: dict[str, Any] = {"predicted_single": p["single_chat_tokens_per_s"]}
        if d is not None and p["single_chat_tokens_per_s"]:
            row["measured_single"] = d["tokens_per_second"]
            row["ratio_single"] = round(p["single_chat_tokens_per_s"] /
                                        max(d["tokens_per_second"], 1e-9), 3)
            row["within_25_percent"] = abs(row["ratio_single"] - 1) <= 0.25
            # the same formula with this run's measured hop overhead instead of the default
            hops = d["hops"]
            hop_ms = hops["overhead_p50_ms_max"]
            step = p["step_ms"] - len(p["stages"]) * p["hop_ms"] + len(p["stages"]) * hop_ms
            row["predicted_single_with_measured_hop"] = round(1000 / step, 2)
            row["measured_hop_ms"] = hop_ms
        if CHATS in levels and p[f"chats_{CHATS}_tokens_per_s"]:
            m = levels[CHATS]["aggregate_tokens_per_second"]
            row[f"predicted_{CHATS}_chats"] = p[f"chats_{CHATS}_tokens_per_s"]
            row[f"measured_{CHATS}_chats"] = m
            row[f"ratio_{CHATS}_chats"] = round(p[f"chats_{CHATS}_tokens_per_s"] /
                                                max(m, 1e-9), 3)
        out[f"{name}_vs_measured"] = row
    return out


def prediction_report(pred: dict[str, Any] | None) -> str:
    """Predicted beside measured, one line per way of timing a layer."""
    if not pred:
        return ""
    lines = ["plan's prediction (hearthnet plan) beside this run:"]
    for name in ("engine", "probe"):
        r = pred.get(f"{name}_vs_measured", {})
        speed = pred["layer_steps_per_s"][name]
        line = (f"  {name} speed {speed} layer steps/s: predicted single chat "
                f"{r.get('predicted_single')} tok/s")
        if "measured_single" in r:
            line += (f", measured {r['measured_single']} (ratio {r['ratio_single']}, "
                     f"{'within' if r['within_25_percent'] else 'NOT within'} ±25 %); "
                     f"with this run's hop {r['measured_hop_ms']} ms: "
                     f"{r['predicted_single_with_measured_hop']}")
        if "predicted_8_chats" in r:
            line += (f"; 8 chats predicted {r['predicted_8_chats']} vs measured "
                     f"{r['measured_8_chats']} (ratio {r['ratio_8_chats']})")
        lines.append(line)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Start the mesh, measure, stop it; returns (figures, report). With ``--netem``, every
    node in its own namespace on shaped links (`bench.netem`), removed again however the
    run ends (a SIGTERM is taken as Ctrl-C meanwhile).

    Raises:
        BadRequest: a bad ``--netem`` or ``--shaper``, before any work.
    """
    args.net = netem.choose(args.netem, args.shaper) if args.netem else None
    if args.net is not None and args.net.why_not is not None:
        print(f"--netem {args.netem}: {args.net.why_not}; measuring on the plain loopback",
              file=sys.stderr)
    with terminate_as_interrupt():
        return _run(args)


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import torch

    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.distributed_inference.engine.local import LocalEngine
    from hearthnet.models import ModelStore

    entry = ModelStore().get(args.model)
    args.weights = weights_of(args)
    ranges = split_layers(entry.num_layers, args.shards)
    choice = getattr(args, "net", None)  # `run`'s netem.Choice, if --netem
    net = choice.settings() if choice is not None else dict(netem.NOT_ASKED)
    figures: dict[str, Any] = {
        "benchmark": "pipeline", "model": args.model, "model_id": entry.model_id,
        "shards": args.shards, "layer_split": [list(r) for r in ranges],
        "tokens": args.tokens, "runs": args.runs, "machine": machine(args.device),
        "settings": {"local_torch_threads": args.local_threads,
                     "node_torch_threads": args.node_threads,
                     "processes": f"1 orchestrator node + {args.shards} shard nodes, "
                                  + ("each its own process in its own network namespace"
                                     if net["applied"] else
                                     "each its own process on 127.0.0.1"),
                     "wire_dtype": args.wire, "weights": args.weights,
                     "device": args.device, "batch_window_ms": args.batch_window_ms,
                     "mixed_prefill_tokens": args.mixed_prefill_tokens,
                     "pipeline_lanes": args.lanes,
                     "prefix_sharing": not args.no_prefix_sharing,
                     "sampling": "greedy", "prompt": args.prompt, "warmup_calls": 1,
                     "netem": net}}
    torch.set_num_threads(args.local_threads)
    head = head_format(args.weights)
    if args.speculate:
        return _run_speculative(args, entry, ranges, figures)
    if args.flow:
        return _run_flow(args, entry, ranges, figures)
    args.level_prompts = concurrency.level_prompts(
        LayeredHead(entry, lm_head=False).tokenizer if args.context else None, args.context)
    figures["settings"]["context_tokens"] = args.context
    # the plan's prediction, made before the mesh starts (`hearthnet plan`, M26 §10)
    predicted = predict_run(entry, args, ranges) if args.device == "cpu" else None
    engine = None if args.concurrency_only else LocalEngine(
        entry, args.weights, head_weights=head, device=args.device)
    figures["local_memory"] = proc_memory()  # this process: the local baseline's model

    def measure(mesh: Any) -> None:
        figures["decode_steps"]["local"] = engine.wait_compiled() if engine else None

        def scrape() -> dict[str, str]:
            return {n: mesh.metrics(n) for n in mesh.nodes}

        uri = mesh.nodes["node-a"].uri
        if engine is not None:
            figures.update(asyncio.run(_measure(uri, engine, args)))
        shards = {n: p.proc.pid for n, p in mesh.nodes.items()
                  if n != "node-a" and p.proc is not None}
        loaded = {n: pid_memory(pid) for n, pid in shards.items()}  # the peak: loading's
        reset = {n: reset_peak_rss(pid) for n, pid in shards.items()}
        figures.update(asyncio.run(concurrency.measure(uri, args, scrape)))
        figures["node_memory"] = {n: pid_memory(p.proc.pid) for n, p in mesh.nodes.items()
                                  if p.proc is not None}
        figures["shard_memory"] = {n: shard_memory(mesh.status(n)["memory"], loaded[n],
                                                   reset[n]) for n in shards}

    _on_mesh(args, ranges, figures, [entry], [], measure)
    if predicted is not None:
        figures["prediction"] = predicted_beside_measured(predicted, figures)
    gpu = args.goals == "gpu" if args.goals else args.device != "cpu"
    source, goals = goals_for(args.model, args.shards, gpu)
    figures["goals_source"] = source
    figures["goals"] = {} if engine is None else _goals(figures, goals)
    name = f"pipeline-{args.shards}" if args.device == "cpu" else \
        f"pipeline-{args.device.replace(':', '')}-{args.shards}"
    if engine is None:  # not the full benchmark's file
        name = f"pipeline-concurrency-{args.model}-{args.weights}-{args.shards}"
    name += _netem_suffix(figures)
    figures["results_file"] = str(write_results(name, figures, Path(args.results_dir)))
    return figures, report(figures)


def _run_speculative(args: argparse.Namespace, entry: Any, ranges: list[tuple[int, int]],
                     figures: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`bench pipeline --speculate`: `hearthnet.bench.speculative` on this mesh."""
    from hearthnet.bench import speculative
    from hearthnet.models import ModelStore

    if "draft" in args.speculate and not args.draft:
        raise BadRequest("--speculate draft needs --draft MODEL (a model of the same "
                         "tokenizer in the store)")
    entries = [entry] + ([ModelStore().get(args.draft)] if args.draft else [])
    figures["settings"].update(speculate=args.speculate, draft=args.draft)
    figures["speculative"] = _on_mesh(
        args, ranges, figures, entries, [],
        lambda mesh: speculative.run_in(mesh.nodes["node-a"].uri, args,
                                        mesh.wait_decode_steps))
    name = f"pipeline-speculative-{args.model}-{args.shards}" + _netem_suffix(figures)
    figures["results_file"] = str(write_results(name, figures, Path(args.results_dir)))
    return figures, _speculative_report(figures)


def _run_flow(args: argparse.Namespace, entry: Any, ranges: list[tuple[int, int]],
              figures: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`bench pipeline --flow N`: `hearthnet.bench.flow` on this mesh, with a second
    orchestrator that sends the prompt whole."""
    from hearthnet.bench import flow
    from hearthnet.distributed_inference.engine.head import LayeredHead
    from hearthnet.mesh.launcher import NodeSpec

    prompt = flow.long_prompt(LayeredHead(entry, lm_head=False).tokenizer, args.flow)
    whole = NodeSpec(flow.UNCHUNKED, extra_di={
        "head_device": args.device, "head_weights": head_format(args.weights),
        "speculate": "off", "weights": policy_for(args.weights),
        "prefill_chunk_tokens": 4 * args.flow, "max_prompt_tokens": 4 * args.flow})
    figures["settings"].update(flow_prompt_tokens=args.flow)

    def measure(mesh: Any) -> dict[str, Any]:
        mesh.wait_covered(flow.UNCHUNKED)
        return flow.run_in({"flow": mesh.nodes["node-a"].uri,
                            "whole": mesh.nodes[flow.UNCHUNKED].uri}, prompt, args)

    figures["flow"] = _on_mesh(args, ranges, figures, [entry], [whole], measure)
    name = f"pipeline-flow-{args.model}-{args.shards}" + _netem_suffix(figures)
    figures["results_file"] = str(write_results(name, figures, Path(args.results_dir)))
    f = figures
    return figures, (f"bench pipeline --flow: {f['model_id']}, {f['shards']} shards "
                     f"{f['layer_split']}, weights {f['settings']['weights']}, "
                     f"{netem.describe(f['settings']['netem'])}, a prompt of "
                     f"about {args.flow} tokens in chunks of the node's prefill_chunk_tokens "
                     f"(flowing) or whole, median of {args.runs} runs\n"
                     f"{flow.report(f['flow'])}\nwritten to {f['results_file']}")


def _on_mesh(args: argparse.Namespace, ranges: list[tuple[int, int]],
             figures: dict[str, Any], entries: list[Any], extra: list[Any],
             measure: Any) -> Any:
    """`measure(mesh)` on a fresh mesh of `_specs` (plus the `extra` node specs) holding
    `entries` — with ``--netem`` applied, each node in its own namespace on a `Lan` of
    `args.net`'s links, else all on 127.0.0.1 —; the node logs' ends on a start failure.
    Nodes, the emulator, namespaces and folders are removed however it ends."""
    t0 = time.perf_counter()
    specs = _specs(args, ranges, head_format(args.weights)) + extra
    choice = getattr(args, "net", None)
    lan = choice.lan(len(specs)) if choice is not None else None
    root = Path(tempfile.mkdtemp(prefix="hearthnet-bench-"))
    try:
        models = single_model_dir(entries, root, share_compiled=True)
        with lan_mesh(specs, lan=lan, root=root, model=args.model,
                      models_dirs={s.node_id: models for s in specs},
                      threads=args.node_threads, what="the namespaces for --netem") as mesh:
            mesh.start(timeout=1800.0)  # multi-GB shards take minutes to load
            figures["mesh_start_s"] = round(time.perf_counter() - t0, 1)
            figures["decode_steps"] = {"mesh": mesh.wait_decode_steps()}
            return measure(mesh)
    except HearthNetError as e:  # a node that did not start: say why before its logs go
        raise HearthNetError(f"{e.message}\n{log_tails(root)}") from e
    finally:
        if lan is not None and lan.emulator_stats:  # what the emulator switched, how late
            figures["settings"]["netem"]["emulator"] = lan.emulator_stats
        keep = getattr(args, "keep_logs", None)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for log_file in root.glob("*.log"):
                shutil.copy2(log_file, keep / log_file.name)
        shutil.rmtree(root, ignore_errors=True)


def _netem_suffix(figures: dict[str, Any]) -> str:
    """The results file's suffix of a run on shaped links (its loopback figures stay)."""
    return "-netem" if figures["settings"]["netem"]["applied"] else ""


def _speculative_report(f: dict[str, Any]) -> str:
    from hearthnet.bench import speculative

    st = f["settings"]
    link = netem.describe(st["netem"])
    return (f"bench pipeline --speculate: {f['model_id']}, {f['shards']} shards "
            f"{f['layer_split']}, weights {st['weights']}, wire {st['wire_dtype']}, {link}, "
            f"{f['tokens']} tokens, median of {f['runs']} runs\n"
            f"{speculative.report(f['speculative'])}\nwritten to {f['results_file']}")


def _specs(args: argparse.Namespace, ranges: list[tuple[int, int]], head: str
           ) -> list[Any]:
    """Node A (orchestrator, as many concurrent pipelines as the largest level) and one
    shard node per range (as many sessions as that, and at least the default 8)."""
    from hearthnet.mesh.launcher import NodeSpec

    most = max(args.concurrency)
    # plain passes unless a call asks (the engine and hop figures); the draft, if any
    di: dict[str, Any] = {"head_device": args.device, "head_weights": head,
                          "speculate": "off"}
    if getattr(args, "draft", None):
        di["draft_models"] = {args.model: args.draft}
    if args.batch_window_ms is not None:
        di["batch_window_ms"] = args.batch_window_ms
    if args.mixed_prefill_tokens is not None:
        di["mixed_prefill_tokens"] = args.mixed_prefill_tokens
    if getattr(args, "lanes", None) is not None:
        di["pipeline_lanes"] = args.lanes
    if getattr(args, "no_prefix_sharing", False):
        di["prefix_sharing"] = False
    host = {"device": args.device, "weights": args.weights}
    if getattr(args, "context", None):  # room for the long prompts and their answers
        di["max_prompt_tokens"] = max(4096, args.context + 256)
        host["max_session_tokens"] = max(8192, args.context + args.tokens + 256)
    return [NodeSpec("node-a", extra_host=host,
                     extra_di={**di, "max_concurrent_pipelines": max(4, most),
                               "weights": policy_for(args.weights)})] + [
        NodeSpec(f"node-{chr(ord('b') + i)}", [r], extra_host=host,
                 extra_di={**di, "prepare_heads_at_start": False},
                 max_streams=max(8, most)) for i, r in enumerate(ranges)]


def _local_run(engine: Any, prompt: str, tokens: int) -> tuple[list[int], dict[str, float]]:
    from hearthnet.distributed_inference.engine.local import LocalTimings
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

    t = LocalTimings()
    ids = [ev.token_id for ev in engine.generate([{"role": "user", "content": prompt}],
                                                 SamplingParams(max_tokens=tokens), t)]
    return ids, {"tokens_per_second": t.decode_tokens_per_s, "first_token_ms": t.first_token_ms}


async def _measure(uri: str, engine: Any, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    wires = [a.wire] + ([] if a.no_fp32 or a.wire == "fp32" else ["fp32"])
    _local_run(engine, a.prompt, 8)  # warm-ups
    for w in wires:
        await chat_frames(uri, a.prompt, a.model, 8, wire_dtype=w)
    local: list[dict[str, float]] = []
    local_1t: list[float] = []
    dist: dict[str, list[dict[str, Any]]] = {w: [] for w in wires}
    local_ids: list[int] = []
    match: dict[str, bool] = {w: True for w in wires}
    for _ in range(a.runs):  # interleaved, so a change in the machine's load hits all
        local_ids, lt = _local_run(engine, a.prompt, a.tokens)
        local.append(lt)
        torch.set_num_threads(1)  # the same baseline on one thread
        try:
            local_1t.append(_local_run(engine, a.prompt, a.tokens)[1]["tokens_per_second"])
        finally:
            torch.set_num_threads(a.local_threads)
        for w in wires:
            frames, wall = await chat_frames(uri, a.prompt, a.model, a.tokens, wire_dtype=w)
            done = frames[-1]
            dist[w].append({**done["timings"], "wall_ms": wall * 1000,
                            "pipeline": done["pipeline"], "formats": done.get("formats"),
                            "completion_tokens": done["usage"]["completion_tokens"]})
            match[w] = match[w] and token_ids(frames) == local_ids
    out: dict[str, Any] = _summarise(local, dist, a.wire, local_1t)
    out["tokens_match_local"] = match
    out["completion_tokens"] = len(local_ids)
    return out


def _summarise(local: list[dict[str, float]], dist: dict[str, list[dict[str, Any]]],
               wire: str, local_1t_runs: list[float]) -> dict[str, Any]:
    ltps = median([r["tokens_per_second"] for r in local])
    local_1t = median(local_1t_runs)
    best = max(ltps, local_1t)
    out: dict[str, Any] = {
        "local": {"tokens_per_second": round(ltps, 2),
                  "tokens_per_second_runs": [round(r["tokens_per_second"], 2) for r in local],
                  "first_token_ms": round(median([r["first_token_ms"] for r in local]), 1),
                  "tokens_per_second_1_thread": round(local_1t, 2),
                  "tokens_per_second_1_thread_runs": [round(x, 2) for x in local_1t_runs],
                  "best_tokens_per_second": round(best, 2)}}
    for w, runs in dist.items():
        tps = median([r["tokens_per_second"] for r in runs])
        out[f"distributed_{w}"] = {
            "tokens_per_second": round(tps, 2),
            "tokens_per_second_runs": [r["tokens_per_second"] for r in runs],
            "ratio_to_local": round(tps / ltps, 3) if ltps else None,
            "ratio_to_local_1_thread": round(tps / local_1t, 3) if local_1t else None,
            # the goal's ratio: against the faster local setting, so never flattering
            "ratio_to_best_local": round(tps / best, 3) if best else None,
            "first_token_ms": round(median([r["first_token_ms"] for r in runs]), 1),
            "construction_ms": round(median([r["construction_ms"] for r in runs]), 1),
            "wall_ms": round(median([r["wall_ms"] for r in runs]), 1),
            "pipeline": runs[-1]["pipeline"], "formats": runs[-1]["formats"],
            "hops": _hops(runs, tps)}
    out["distributed"] = out[f"distributed_{wire}"]
    return out


def _hops(runs: list[dict[str, Any]], tps: float) -> dict[str, Any]:
    """Per-stage round trip and overhead (median over runs of each run's p50/p95)."""
    stages: dict[str, dict[str, Any]] = {}
    for sid in runs[-1]["per_shard"]:
        per = [r["per_shard"][sid] for r in runs if sid in r["per_shard"]]
        stages[sid] = {"layers": per[-1]["layers"],
                       "weights_format": per[-1].get("weights_format"),
                       "kernel": per[-1].get("kernel", ""),
                       **{k: round(median([p[k] for p in per]), 3)
                          for k in ("p50_ms", "p95_ms", "overhead_p50_ms", "overhead_p95_ms")}}
    rtt = sum(s["p50_ms"] for s in stages.values())
    step_ms = 1000 / tps if tps else 0.0
    return {"stages": stages,
            "overhead_p50_ms_max": max((s["overhead_p50_ms"] for s in stages.values()),
                                       default=0.0),
            "overhead_p95_ms_max": max((s["overhead_p95_ms"] for s in stages.values()),
                                       default=0.0),
            "step_ms": round(step_ms, 3),
            "stages_rtt_p50_ms_sum": round(rtt, 3),
            # what is left of a decode step: embed, norm + lm_head, sampling, frame out
            "orchestrator_ms_per_step_est": round(step_ms - rtt, 3)}


def _goals(f: dict[str, Any], goals: dict[str, float]) -> dict[str, Any]:
    """Each goal in `goals` against the run's figures: measured, goal, met."""
    d = f["distributed"]
    measured = {"ratio_min": ("ratio_to_best_local", d["ratio_to_best_local"] or 0.0, True),
                "first_token_ms_max": ("first_token_ms", d["first_token_ms"], False),
                "construction_ms_max": ("construction_ms", d["construction_ms"], False),
                "overhead_p95_ms_max": ("overhead_p95_ms", d["hops"]["overhead_p95_ms_max"],
                                        False),
                "tokens_per_second_min": ("tokens_per_second", d["tokens_per_second"], True)}
    out = {}
    for key, goal in goals.items():
        name, value, at_least = measured[key]
        out[name] = {"measured": value, "goal": goal,
                     "met": value >= goal if at_least else value <= goal}
    return out


def report(f: dict[str, Any]) -> str:
    """The human-readable tables of a `run` result."""
    conc = concurrency.report(f["concurrency"], f["concurrency_goals"])
    if "local" not in f:  # --concurrency-only
        mem = ", ".join(f"{n} {m['peak_rss_mb']} MiB" for n, m in f["node_memory"].items())
        ctx = f["settings"].get("context_tokens")
        return (f"bench pipeline --concurrency-only: {f['model_id']}, {f['shards']} shards "
                f"{f['layer_split']}, weights {f['settings']['weights']}, "
                f"{f'prompts of about {ctx} tokens, ' if ctx else ''}{f['tokens']} tokens "
                f"per chat, median of {f['runs']} runs, on {f['machine']['cpu']} "
                f"({f['machine']['cpus']} CPUs)\n{conc}\npeak RSS: nodes {mem}"
                f"\n{shard_memory_report(f.get('shard_memory', {}))}"
                f"\n{prediction_report(f.get('prediction'))}"
                f"\nwritten to {f['results_file']}")
    lo = f["local"]
    rows = [["local (1 process)", f["settings"]["local_torch_threads"],
             lo["tokens_per_second"], None, lo["first_token_ms"], None, None, None],
            ["local (1 process)", 1, lo["tokens_per_second_1_thread"], None, None, None,
             None, None]]
    for key in sorted(k for k in f if k.startswith("distributed_")):
        d = f[key]
        rows.append([f"mesh, {key.split('_', 1)[1]} wire", f["settings"]["node_torch_threads"],
                     d["tokens_per_second"], d["ratio_to_best_local"], d["first_token_ms"],
                     d["construction_ms"], d["hops"]["overhead_p50_ms_max"],
                     d["hops"]["overhead_p95_ms_max"]])
    t1 = table(["run", "threads", "decode tok/s", "ratio to best local", "first ms",
                "construct ms", "hop ovh p50", "hop ovh p95"], rows)
    d = f["distributed"]
    t2 = table(["stage", "layers", "rtt p50 ms", "rtt p95 ms", "ovh p50 ms", "ovh p95 ms"],
               [[sid, f"{s['layers'][0]}-{s['layers'][1]}", s["p50_ms"], s["p95_ms"],
                 s["overhead_p50_ms"], s["overhead_p95_ms"]]
                for sid, s in d["hops"]["stages"].items()])
    goals = f"none set for {f['model']} over {f['shards']} shards on this device"
    if f["goals"]:
        goals = f"({f['goals_source']}) {goals_text(f['goals'])}"
    mem = ", ".join(f"{n} {m['peak_rss_mb']} MiB" for n, m in f["node_memory"].items())
    return (f"bench pipeline: {f['model_id']}, {f['shards']} shards {f['layer_split']}, "
            f"weights {f['settings']['weights']} (done frame: {d['formats']}), "
            f"{netem.describe(f['settings'].get('netem', netem.NOT_ASKED))}, "
            f"{f['tokens']} tokens, median of {f['runs']} runs\n{t1}\n\n{t2}\n"
            f"peak RSS: local baseline {f['local_memory']['peak_rss_mb']} MiB; nodes {mem}\n"
            f"{shard_memory_report(f.get('shard_memory', {}))}\n"
            f"decode step {d['hops']['step_ms']} ms = stages {d['hops']['stages_rtt_p50_ms_sum']}"
            f" ms + orchestrator ≈{d['hops']['orchestrator_ms_per_step_est']} ms\n\n{conc}\n\n"
            f"tokens identical to local: {f['tokens_match_local']}\ngoals: {goals}\n"
            f"{prediction_report(f.get('prediction'))}\n"
            f"written to {f['results_file']}")
