"""`hearthnet bench local`: one machine's figures for a model (M26 §8.2's baseline).

Prefill time and decode tokens/s of the whole model in one process (`LocalEngine`, greedy,
median of ``--runs`` runs after a warm-up), and the peak resident memory of the processes a
mesh is made of: the whole model, each half of the layers (what a two-shard node holds),
the head alone (what an orchestrator holds: tokenizer, embeddings, final norm, lm_head) and
the bare runtime (Python, torch, transformers; nothing loaded).

Every part is measured in its own fresh child process (``python -m hearthnet.bench.local
--part PART``) that loads only that part, runs it, and reports its peak RSS (VmHWM from
/proc/self/status), so no figure includes memory another part left behind. The halves and
the head run on synthetic hidden states of the prompt's length: their compute time does
not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import decode_tokens, positive
from hearthnet.bench import (
    PROMPTS,
    goals_text,
    machine,
    median,
    percentile,
    proc_memory,
    table,
    write_results,
)
from hearthnet.config import compile_decode_enabled
from hearthnet.distributed_inference.directory.formats import FORMATS, head_format
from hearthnet.errors import HearthNetError

PARTS = ("runtime", "head", "lower", "upper", "full")


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench local`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store (any stored "
                   "or synthetic model)")
    p.add_argument("--weights", default="fp32", choices=FORMATS,
                   help="held format of layers and head (default fp32; int4: head int8)")
    p.add_argument("--against", choices=FORMATS, default=None,
                   help="also run the whole model held in this format, in its own fresh "
                        "process, and report the decode speed-up over it (e.g. "
                        "--weights int8 --against fp32)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="which parts to measure (default all; `full` is always measured)")
    p.add_argument("--tokens", type=decode_tokens, default=64, help="tokens generated per run")
    p.add_argument("--runs", type=positive, default=3, help="measured runs (median; default 3)")
    p.add_argument("--threads", type=positive, default=2, help="torch threads per process")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--device", default="cpu",
                   help="auto | cpu | cuda | cuda:N | mps (default cpu)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="compute dtype (default fp32)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode steps eager on CUDA (to measure what the graphs give)")
    p.add_argument("--no-compile", action="store_true",
                   help="CPU decode steps eager (default: compiled, as a node runs them; "
                        "the first start compiles into a fresh folder, a second start "
                        "loads from it, and both times are reported)")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for local.json (default bench-results)")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Measure every part in a fresh child process; returns (figures, report)."""
    from hearthnet.models import ModelStore

    ModelStore().get(args.model)  # an unknown model: its one-line error here, not a child's
    from hearthnet.distributed_inference.engine.quant import dense_setting, kernel_settings

    dense_setting()  # a bad HEARTHNET_INT4_DENSE_ROWS likewise, before any child starts
    kernel_settings()  # and a HEARTHNET_INT8_KERNEL / HEARTHNET_INT4_KERNEL naming no kernel
    args.weights = weights_of(args)
    figures: dict[str, Any] = {
        "benchmark": "local", "model": args.model, "tokens": args.tokens, "runs": args.runs,
        "weights": args.weights,
        "settings": {"torch_threads_per_process": args.threads, "weights": args.weights,
                     "device": args.device, "cuda_graphs": not args.no_cuda_graphs,
                     "sampling": "greedy", "prompt": args.prompt,
                     "memory": "peak RSS (VmHWM) of a fresh process per part"},
        "machine": machine(args.device)}
    try:
        full, starts = full_with_compile(args)
        if starts:
            figures["compile"] = starts
        parts = {"full": full}
        for part in ("lower", "upper", "head", "runtime"):
            if part in args.parts:
                parts[part] = _child(args, part, prompt_tokens=full["prompt_tokens"])
    finally:
        if getattr(args, "compile_dir", ""):
            shutil.rmtree(args.compile_dir, ignore_errors=True)
    figures.update({
        "model_id": full["model_id"], "num_layers": full["num_layers"],
        "prompt_tokens": full["prompt_tokens"],
        "prefill_ms": round(median(full["prefill_ms"]), 2),
        "first_token_ms": round(median(full["first_token_ms"]), 2),
        "decode_tokens_per_s": round(median(full["decode_tokens_per_s"]), 2),
        "runs_detail": {k: full[k] for k in ("prefill_ms", "first_token_ms",
                                             "decode_tokens_per_s", "completion_tokens")},
        "memory_mb": {_label(p, parts[p]): parts[p]["memory"] for p in PARTS if p in parts},
        "parts": parts})
    figures["device_name"] = full.get("device_name", "cpu")
    figures["int8_kernel"] = full["int8_kernel"]
    figures["amx"] = full.get("amx", "")
    figures["kernel"] = full.get("kernel", "")  # the held format's (`quant.kernel_of`)
    figures["int4_dense_rows"] = full.get("int4_dense_rows")  # int4 prefills' fp32 path
    if args.against:
        other = _child(args, "full", weights=args.against)
        tps = round(median(other["decode_tokens_per_s"]), 2)
        figures["against"] = {"weights": args.against, "decode_tokens_per_s": tps,
                              "runs_detail": other["decode_tokens_per_s"],
                              "param_mb": other["param_mb"],
                              "peak_rss_mb": other["memory"]["peak_rss_mb"]}
        figures["decode_speedup"] = round(figures["decode_tokens_per_s"] / tps, 2) \
            if tps else None
    source, goals = goals_for(args.model, args.weights, args.against, args.device)
    figures["goals_source"] = source
    figures["goals"] = {k: {"measured": figures.get(k), "goal": g,  # each at least g
                            "met": (figures.get(k) or 0.0) >= g} for k, g in goals.items()}
    name = "local" if args.device == "cpu" else f"local-{args.device.replace(':', '')}"
    figures["results_file"] = str(write_results(name, figures, Path(args.results_dir)))
    return figures, report(figures)


SCALE_GOALS = {"decode_speedup": 2.5}
"""The int8 goal: decode of the qwen2.5-1.5b shape at least 2.5× the fp32 decode."""


def goals_for(model: str, weights: str, against: str | None, device: str
              ) -> tuple[str, dict[str, float]]:
    """The goals a run is checked against and the scene they were set for; ("", {}) where
    none was set."""
    if (model, weights, against, device) == ("qwen2.5-1.5b", "int8", "fp32", "cpu"):
        return "int8 vs fp32 decode, 1.5B on CPU", SCALE_GOALS
    return "", {}


def weights_of(args: argparse.Namespace) -> str:
    """The held format: `--weights`, or (left at fp32) the compute `--dtype`."""
    return str(args.weights if args.weights != "fp32" else getattr(args, "dtype", "fp32"))


def _label(part: str, res: dict[str, Any]) -> str:
    if part in ("lower", "upper"):
        lo, hi = res["layers"]
        return f"layers_{lo}_{hi}"
    return part


def full_with_compile(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model measured in a fresh process, as a node runs it: on the CPU with its
    decode step compiled. A first start compiles into a fresh folder (a short run), the
    measured start loads from it, as a restarted node does; ({figures}, {first_start,
    restart: what the step ran as and when it was ready}), ({figures}, {}) when eager.
    The folder stays in ``args.compile_dir`` for the halves' processes: the caller
    removes it."""
    compiling = args.device == "cpu" and not getattr(args, "no_compile", False) \
        and compile_decode_enabled()
    if not compiling:
        return _child(args, "full"), {}
    import tempfile

    args.compile_dir = tempfile.mkdtemp(prefix="hearthnet-bench-compile-")
    first = _child(args, "full", runs=1, tokens=4)
    full = _child(args, "full")
    return full, {"first_start": first["compile"], "restart": full["compile"]}


def _child(args: argparse.Namespace, part: str, prompt_tokens: int = 0,
           weights: str | None = None, runs: int = 0, tokens: int = 0) -> dict[str, Any]:
    """Measure `part` in a fresh process, with the run's format or `weights` (and
    `runs` × `tokens`, default the run's)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "hearthnet.bench.local", "--part", part,
           "--model", args.model, "--weights", weights or weights_of(args),
           "--tokens", str(tokens or args.tokens), "--runs", str(runs or args.runs),
           "--threads", str(args.threads), "--prompt", args.prompt,
           "--prompt-tokens", str(prompt_tokens), "--device", args.device,
           "--dtype", args.dtype] + (["--no-cuda-graphs"] if args.no_cuda_graphs else []) \
        + (["--compile-dir", args.compile_dir] if getattr(args, "compile_dir", "") else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise HearthNetError(f"bench child for part {part!r} failed ({r.returncode}): "
                             f"{r.stderr.strip()[-2000:]}")
    return dict(json.loads(lines[-1]))


def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result."""
    rows = [["full model", f"0-{f['num_layers'] - 1}", f["parts"]["full"]["memory"]
             ["peak_rss_mb"], f["prefill_ms"], f["decode_tokens_per_s"],
             round(1000 / f["decode_tokens_per_s"], 2) if f["decode_tokens_per_s"] else None]]
    for part, name in (("lower", "first half"), ("upper", "second half")):
        if part not in f["parts"]:
            continue
        r = f["parts"][part]
        rows.append([name, f"{r['layers'][0]}-{r['layers'][1]}", r["memory"]["peak_rss_mb"],
                     median(r["prefill_ms"]), None, median(r["decode_step_ms_p50"])])
    if "head" in f["parts"]:
        h = f["parts"]["head"]
        rows.append(["head only", "-", h["memory"]["peak_rss_mb"], None, None,
                     median(h["decode_step_ms_p50"])])
    if "runtime" in f["parts"]:
        rows.append(["runtime only", "-", f["parts"]["runtime"]["memory"]["peak_rss_mb"],
                     None, None, None])
    t = table(["part (own process)", "layers", "peak RSS MiB", "prefill ms", "decode tok/s",
               "step ms p50"], rows)
    st = f["settings"]
    return (f"bench local: {f['model_id']}, {f['tokens']} tokens × {f['runs']} runs "
            f"(median), prompt {f['prompt_tokens']} tokens, "
            f"{st['torch_threads_per_process']} torch threads, weights {f['weights']}"
            f"{' (' + f['kernel'] + ' kernel)' if f.get('kernel') else ''}"
            f"{_dense_note(f)} "
            f"({f['parts']['full']['param_mb']} MB held) on "
            f"{f.get('device_name', 'cpu')}\n{t}\n"
            f"first token {f['first_token_ms']:.1f} ms; written to {f['results_file']}"
            f"{_compile_line(f)}{_against_line(f)}")


def _dense_note(f: dict[str, Any]) -> str:
    """From how many rows int4 products ran in fp32 GEMMs of de-quantised tiles."""
    if f.get("weights") != "int4":
        return ""
    rows = f.get("int4_dense_rows")
    return f", prefill rows ≥ {rows} in fp32 tiles" if rows else ", no fp32 tiles"


def _compile_line(f: dict[str, Any]) -> str:
    """When the compiled decode step was ready, at a first start and after a restart."""
    c = f.get("compile")
    if not c:
        return ""
    return (f"\ncompiled decode step: first start {c['first_start']['state']}; restart "
            f"{c['restart']['state']} (decode eager until then)"
            + "".join(f"\ncompiled head {kind}: first start {state}; restart "
                      f"{c['restart'].get('head', {}).get(kind)}"
                      for kind, state in c["first_start"].get("head", {}).items()))


def _against_line(f: dict[str, Any]) -> str:
    """The `--against` comparison and its goal, if any, for the report."""
    if "against" not in f:
        return ""
    a = f["against"]
    line = (f"\nagainst {a['weights']} (own process, {a['param_mb']} MB held, peak RSS "
            f"{a['peak_rss_mb']} MiB): {a['decode_tokens_per_s']} tok/s; decode "
            f"{f['decode_speedup']}× {a['weights']}")
    return line + (f"; goals ({f['goals_source']}): {goals_text(f['goals'])}"
                   if f["goals"] else "")


# ---------------------------------------------------------------------------------------
# The child process: load one part, run it, report.


def _compiled_ready(stack: Any, lo: int, hi: int, head: Any = None) -> dict[str, Any]:
    """Wait for the stack's compiled decode step and `head`'s compiled steps (a node runs
    them eagerly meanwhile); what they run as and how long each took to be ready (built
    side by side: the later of the two is when the whole token runs compiled)."""
    out: dict[str, Any] = {"state": "eager", "seconds": None}
    if stack.compiled is not None:
        stack.compiled.start(lo, hi)
        out = {"state": stack.compiled.wait(lo, hi),
               "seconds": stack.compiled.seconds.get((lo, hi))}
    compiled_head = getattr(head, "compiled", None)
    if compiled_head is not None:
        out["head"] = compiled_head.wait()
        out["head_seconds"] = round(compiled_head.seconds, 2)
    return out


def _dense_rows(a: argparse.Namespace) -> int | None:
    """With int4, wait for the probe that chooses from how many rows a product runs in
    fp32 GEMMs of de-quantised tiles (`quant.int4_dense_rows`), so that every measured
    prefill runs in one path; that count (None: never, or not int4)."""
    from hearthnet.distributed_inference.engine import quant

    if a.weights != "int4":
        return None
    rows = quant.int4_dense_rows(wait=True)
    return None if math.isinf(rows) else int(rows)


def _measure_full(entry: Any, a: argparse.Namespace) -> dict[str, Any]:
    from hearthnet.distributed_inference.engine import q4vnni, quant
    from hearthnet.distributed_inference.engine.device import device_info
    from hearthnet.distributed_inference.engine.local import LocalEngine, LocalTimings
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

    engine = LocalEngine(entry, a.weights, head_weights=head_format(a.weights),
                         device=a.device, cuda_graphs=not a.no_cuda_graphs,
                         compile_decode=bool(a.compile_dir),
                         compile_dir=Path(a.compile_dir) if a.compile_dir else None)
    compile_state = _compiled_ready(engine.stack, 0, entry.num_layers - 1, engine.head)
    out: dict[str, Any] = {"compile": compile_state, "int4_dense_rows": _dense_rows(a),
                           "device_name": device_info(engine.stack.device)["name"],
                           "param_mb": round((engine.stack.param_bytes()
                                              + engine.head.param_bytes()) / 2**20, 1),
                           "int8_kernel": quant.INT8_KERNEL,
                           "amx": q4vnni.amx_state(),  # "" where the kernel is not loaded
                           "kernel": quant.kernel_of(a.weights, bool(entry.ggml_types))}
    msgs = [{"role": "user", "content": a.prompt}]
    list(engine.generate(msgs, SamplingParams(max_tokens=4)))  # warm-up
    keys = ("prefill_ms", "first_token_ms", "decode_tokens_per_s", "completion_tokens")
    runs: dict[str, list[Any]] = {k: [] for k in keys}
    for _ in range(a.runs):
        t = LocalTimings()
        ids = [ev.token_id for ev in engine.generate(msgs, SamplingParams(max_tokens=a.tokens),
                                                      t)]
        n = len(ids)
        out["token_ids"] = ids  # the last run's answer (bench reach compares it)
        runs["prefill_ms"].append(round(t.prefill_ms, 2))
        runs["first_token_ms"].append(round(t.first_token_ms, 2))
        runs["decode_tokens_per_s"].append(round(t.decode_tokens_per_s, 2))
        runs["completion_tokens"].append(n)
    out.update(runs)
    out["prompt_tokens"] = len(engine.head.chat_prompt_ids(msgs))
    out["memory"] = _memory(engine.stack.device)  # while the model is alive
    return out


def _memory(device: Any) -> dict[str, float]:
    """Peak RSS, and on a GPU the peak of this process's device allocations."""
    import torch

    out = proc_memory()
    if device.type == "cuda":
        out["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


def _measure_layers(entry: Any, lo: int, hi: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hearthnet.distributed_inference.engine.device import sync
    from hearthnet.distributed_inference.engine.layers import LayeredStack

    stack = LayeredStack(entry, lo, hi, a.weights, device=a.device,
                         cuda_graphs=not a.no_cuda_graphs, compile_decode=bool(a.compile_dir),
                         compile_dir=Path(a.compile_dir) if a.compile_dir else None)
    dev = stack.device
    out: dict[str, Any] = {"layers": [lo, hi], "compile": _compiled_ready(stack, lo, hi),
                           "int4_dense_rows": _dense_rows(a),
                           "param_mb": round(stack.param_bytes() / 2**20, 1)}
    t_prompt = max(1, a.prompt_tokens)
    gen = torch.Generator().manual_seed(0)
    prefill, steps = [], []
    for _ in range(a.runs + 1):  # the first is the warm-up
        s = stack.open_session(lo, hi, t_prompt + a.tokens + 1)
        x = torch.randn(1, t_prompt, stack.hidden_size, generator=gen).to(dev)  # (1, T, H)
        sync(dev)
        t0 = time.perf_counter()
        s.forward(x, 0)
        sync(dev)
        prefill.append((time.perf_counter() - t0) * 1000)
        run_steps = []
        for pos in range(t_prompt, t_prompt + a.tokens - 1):
            x = torch.randn(1, 1, stack.hidden_size, generator=gen).to(dev)  # (1, 1, H)
            sync(dev)
            t0 = time.perf_counter()
            s.forward(x, pos)
            sync(dev)
            run_steps.append((time.perf_counter() - t0) * 1000)
        steps.append(run_steps)
        s.close()
    out["prefill_ms"] = [round(x, 2) for x in prefill[1:]]
    out["decode_step_ms_p50"] = [round(percentile(r, 50), 3) for r in steps[1:]]
    out["decode_step_ms_p95"] = [round(percentile(r, 95), 3) for r in steps[1:]]
    out["memory"] = _memory(dev)  # while the layers are alive
    return out


def _measure_head(entry: Any, a: argparse.Namespace) -> dict[str, Any]:
    from hearthnet.distributed_inference.engine.head import LayeredHead

    head = LayeredHead(entry, head_format(a.weights), a.device,
                       compile_dir=Path(a.compile_dir) if a.compile_dir else None)
    out: dict[str, Any] = {"param_mb": round(head.param_bytes() / 2**20, 1),
                           "compile": head.compiled.wait() if head.compiled else {}}
    ids = head.chat_prompt_ids([{"role": "user", "content": a.prompt}])
    steps: list[list[float]] = []
    for _ in range(a.runs + 1):
        run_steps = []
        tok = ids[-1]
        for _ in range(a.tokens):
            t0 = time.perf_counter()
            h = head.embed([tok])  # (1, 1, H): the hidden state is the embedding itself
            tok = int(head.logits(h).argmax())
            run_steps.append((time.perf_counter() - t0) * 1000)
        steps.append(run_steps)
    out["decode_step_ms_p50"] = [round(percentile(r, 50), 3) for r in steps[1:]]
    out["memory"] = _memory(head.device)  # while the head is alive
    return out


def child_main(argv: list[str] | None = None) -> int:
    """Entry point of one measuring child; prints one JSON line."""
    p = argparse.ArgumentParser(prog="python -m hearthnet.bench.local")
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="fp32", choices=FORMATS)
    p.add_argument("--tokens", type=positive, default=64)
    p.add_argument("--runs", type=positive, default=3)
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--prompt-tokens", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--compile-dir", default="",
                   help="compile decode steps (CPU), saved in and loaded from this folder")
    a = p.parse_args(argv)
    import torch

    import hearthnet.distributed_inference.engine.layers  # noqa: F401
    from hearthnet.distributed_inference.engine.device import resolve_device
    from hearthnet.models import ModelStore

    torch.set_num_threads(a.threads)
    entry = ModelStore().get(a.model)
    n = entry.num_layers
    if a.part == "full":
        out = _measure_full(entry, a)
    elif a.part == "lower":
        out = _measure_layers(entry, 0, n // 2 - 1, a)
    elif a.part == "upper":
        out = _measure_layers(entry, n // 2, n - 1, a)
    elif a.part == "head":
        out = _measure_head(entry, a)
    else:
        import transformers  # noqa: F401  (the runtime every part pays for)

        out = {"memory": _memory(resolve_device(a.device))}
    out.update({"part": a.part, "model_id": entry.model_id,
                "num_layers": n, "threads": torch.get_num_threads(), "pid": os.getpid()})
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
