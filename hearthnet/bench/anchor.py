"""`hearthnet bench anchor`: HearthNet against llama.cpp on the same GGUF, machine and
threads, in one run (DESIGN.md decision 15: the engine is as fast as the best local engine).

llama.cpp is built once from the `llama-cpp-python` source distribution into a cache
outside the repository (`hearthnet.bench.llamacpp`). Then, for each model:

- **local**: llama.cpp's prefill and decode tokens/s (``llama-bench -p P -n N -t T``, P the
  prompt length HearthNet measured, median of the repetitions) beside HearthNet's
  (`hearthnet bench local`'s ``full`` part in a fresh process: decode and prefill, peak
  RSS), the store's size against the GGUF's, and the ratios;
- **two shards**: llama.cpp's RPC mode (two ``rpc-server`` processes on 127.0.0.1, one
  thread each, every layer offloaded, split evenly) beside HearthNet's two-shard mesh
  (`hearthnet bench pipeline`'s `LocalMesh`: an orchestrator and two shard nodes on
  127.0.0.1, one torch thread each): decode tokens/s and the ratio.

The models: (a) the bundled SmolLM2-135M Q4_1 GGUF, (b) a Qwen2.5-1.5B-shaped GGUF in
Q4_0 written from the synthetic model (`models synth`) by llama.cpp's converter and
``llama-quantize``, (c) every ``--gguf PATH``. Each is imported into the store under an
``anchor-…-<import dtype>`` alias (``anchor-smollm2-q4_1-gguf``,
``anchor-qwen2.5-1.5b-q4_0-gguf``, ``anchor-<file stem>-gguf``), so both engines read the
same weights. The goals (`GOALS`) are checked and printed, and written with every figure to
``bench-results/anchor.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hearthnet.argtypes import decode_tokens, positive
from hearthnet.bench import PROMPTS, goals_text, machine, median, table, write_results
from hearthnet.bench import llamacpp as lc
from hearthnet.distributed_inference.directory.formats import FORMATS, HELD_FORMATS
from hearthnet.errors import BadRequest, HearthNetError

MODELS = ("smollm2", "qwen1.5b")
"""The built-in models: (a) the bundled SmolLM2 Q4_1 GGUF, (b) the Qwen2.5-1.5B shape."""
QWEN_SHAPE = "qwen2.5-1.5b"
QWEN_ALIAS = "anchor-qwen2.5-1.5b-q4_0"
REPO = Path(__file__).resolve().parents[2]

FASTEST_FORMATS = ("q4", "gguf", "int4", "int8")
"""The default held format: the first of these the engine knows, the GGUF's blocks held
exactly where it has such a format, else its fastest compact one."""

GOALS: dict[str, tuple[str, float]] = {
    "decode_ratio": (">=", 0.8), "prefill_ratio": (">=", 0.7), "store_ratio": ("<=", 1.1)}
"""Goals every checked model shares: HearthNet local decode ≥ 0.8 × llama.cpp's, prefill
≥ 0.7 ×, the store ≤ 1.1 × the GGUF's size."""
MESH_GOALS = {"smollm2": 2.0, "qwen1.5b": 1.0}
"""HearthNet's two-shard mesh against llama.cpp RPC with two servers, decode tokens/s."""
RESTART_GOALS = {"smollm2": 5.0}
"""Seconds until a restarted engine's compiled decode step is ready (loaded, not compiled;
decode is eager until then)."""


@dataclass(frozen=True, slots=True)
class Subject:
    """One model benchmarked: its key in the results, its store alias and its GGUF."""

    key: str
    alias: str
    gguf: Path


def default_weights(formats: Iterable[str] = FORMATS) -> str:
    """The first of `FASTEST_FORMATS` in `formats` (the engine's known formats)."""
    known = set(formats)
    return next((f for f in FASTEST_FORMATS if f in known), "native")


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench anchor`."""
    p.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS),
                   help="built-in models to run: smollm2 (the bundled Q4_1 GGUF), qwen1.5b "
                        "(a Qwen2.5-1.5B-shaped Q4_0 GGUF written from the synthetic model); "
                        "default both; none with `--models` alone")
    p.add_argument("--gguf", type=Path, action="append", default=[], metavar="PATH",
                   help="also run this GGUF (imported into the store as "
                        "anchor-<stem>-<import dtype>); repeatable")
    p.add_argument("--weights", choices=FORMATS, default=default_weights(),
                   help=f"HearthNet's held format (default {default_weights()})")
    p.add_argument("--tokens", type=decode_tokens, default=64,
                   help="decode tokens per run (default 64)")
    p.add_argument("--runs", type=positive, default=3, help="measured runs (median; default 3)")
    p.add_argument("--threads", type=positive, default=2,
                   help="threads of each engine on one machine (default 2)")
    p.add_argument("--prompt", default=PROMPTS[0],
                   help="HearthNet's prompt; llama-bench prefills as many tokens")
    p.add_argument("--no-rpc", action="store_true",
                   help="skip llama.cpp's RPC mode and HearthNet's two-shard mesh")
    p.add_argument("--skip-build", action="store_true",
                   help="never download or build llama.cpp: use the cached build")
    p.add_argument("--llama-cpp-version", default=lc.LLAMA_CPP_PYTHON_VERSION,
                   help=f"the {lc.PACKAGE} source distribution to build "
                        f"(default {lc.LLAMA_CPP_PYTHON_VERSION})")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"llama.cpp build cache, outside the repository (default "
                        f"{lc.default_cache_root()})")
    p.add_argument("--import-dtype", default=None, metavar="DTYPE",
                   help="how the GGUFs are imported into the store (`models import "
                        "--dtype`; default gguf: keep the GGUF's own blocks)")
    p.add_argument("--reimport", action="store_true",
                   help="remove the benchmarked models from the store and import their "
                        "GGUFs again (after a change to the importer)")
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for anchor.json (default bench-results)")


def check_args(args: argparse.Namespace) -> None:
    """Every argument error, as one `BadRequest` line, before any work."""
    if not args.models and not args.gguf:
        raise BadRequest("nothing to run: give --models smollm2 qwen1.5b and/or --gguf PATH")
    for g in args.gguf:
        if g.suffix != ".gguf":
            raise BadRequest(f"--gguf {g}: not a .gguf file")
        if not g.is_file():
            raise BadRequest(f"--gguf {g}: no such file")
    keys = [gguf_alias(g) for g in args.gguf]
    if len(set(keys)) != len(keys):
        raise BadRequest("--gguf: two files with the same name; rename one (the store alias "
                         "is anchor-<file stem>)")
    from hearthnet.models.importer import IMPORT_DTYPES

    if args.import_dtype is not None and args.import_dtype not in IMPORT_DTYPES:
        raise BadRequest(f"--import-dtype must be one of {', '.join(IMPORT_DTYPES)}, "
                         f"not {args.import_dtype!r}")
    lc.check_cache_root(cache_root(args), REPO)
    if args.skip_build and lc.cached(cache_root(args), args.llama_cpp_version,
                                     cmake_opts()) is None:
        raise BadRequest(f"--skip-build: no llama.cpp {args.llama_cpp_version} build for this "
                         f"CPU in {cache_root(args)}; run once without --skip-build")


def cache_root(args: argparse.Namespace) -> Path:
    return Path(args.cache_dir).expanduser() if args.cache_dir else lc.default_cache_root()


def cmake_opts() -> list[str]:
    return lc.cmake_options(lc.cpu_flags())


def gguf_alias(path: Path) -> str:
    """The store alias of a `--gguf` file: ``anchor-<stem>``, lower case, [a-z0-9._-]."""
    return "anchor-" + re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Build (or reuse) llama.cpp, measure both engines per model; (figures, report)."""
    check_args(args)
    root = cache_root(args)
    options = cmake_opts()
    built = lc.cached(root, args.llama_cpp_version, options) if args.skip_build else \
        lc.ensure_build(root, args.llama_cpp_version, options, say=_say)
    if built is None:
        raise BadRequest(f"--skip-build: the llama.cpp build in {root} went away")
    figures: dict[str, Any] = {
        "benchmark": "anchor", "weights": args.weights, "import_dtype": import_dtype(args),
        "tokens": args.tokens,
        "runs": args.runs, "machine": {**machine(), "cpu_flags": relevant_flags(lc.cpu_flags())},
        "llama_cpp": built.describe(),
        "settings": {"threads": args.threads, "prompt": args.prompt, "sampling": "greedy",
                     "rpc": None if args.no_rpc else
                     "2 rpc-servers on 127.0.0.1 (1 thread each) vs a HearthNet mesh of an "
                     "orchestrator and 2 shard nodes on 127.0.0.1 (1 torch thread each)"},
        "models": {}}
    logs = Path(tempfile.mkdtemp(prefix="hearthnet-anchor-"))
    for subject in subjects(args, built, logs):
        _say(f"{subject.key}: {subject.gguf.name} as store alias {subject.alias}")
        figures["models"][subject.key] = measure(subject, built, args, logs)
    figures["goals"] = evaluate_goals(figures["models"])
    figures["logs"] = str(logs)
    figures["results_file"] = str(write_results("anchor", figures, Path(args.results_dir)))
    return figures, report(figures)


def _say(message: str) -> None:
    print(f"bench anchor: {message}", file=sys.stderr, flush=True)


def relevant_flags(flags: frozenset[str]) -> list[str]:
    """The CPU's flags that decide the build and the kernels: AVX*, FMA, F16C, BMI2, AMX."""
    return sorted(f for f in flags if f.startswith(("avx", "amx")) or f in
                  ("fma", "f16c", "bmi2", "sse4_2"))


# ---------------------------------------------------------------------------------------
# The models


def subjects(args: argparse.Namespace, built: lc.LlamaCpp, logs: Path) -> list[Subject]:
    """(a), (b) and every (c) of the run, each imported into the store once under its
    own alias (the import format in the alias, so a run never measures another's)."""
    from hearthnet.models import ModelStore
    from hearthnet.models.importer import smollm2_gguf_path

    store = ModelStore()
    dtype = import_dtype(args)
    out = []
    if "smollm2" in args.models:
        out.append(Subject("smollm2", f"anchor-smollm2-q4_1-{dtype}", smollm2_gguf_path()))
    if "qwen1.5b" in args.models:
        out.append(Subject("qwen1.5b", f"{QWEN_ALIAS}-{dtype}",
                           _qwen_gguf(store, built, logs, f"{QWEN_ALIAS}-{dtype}")))
    out += [Subject(f"gguf:{g.name}", f"{gguf_alias(g)}-{dtype}", g.resolve())
            for g in args.gguf]
    for s in out:
        if args.reimport and store.find(s.alias) is not None:
            store.remove(s.alias)
        if store.find(s.alias) is None:
            _import(store, s, dtype)
    return out


def import_dtype(args: argparse.Namespace) -> str:
    """`--import-dtype`, else the importer's format that keeps a GGUF's own blocks
    (DESIGN.md decision 15: the comparison is with weights held as the GGUF has them)."""
    from hearthnet.models.importer import KEEP_BLOCKS

    return str(args.import_dtype or KEEP_BLOCKS)


def _import(store: Any, s: Subject, dtype: str) -> None:
    """Import `s` with the model id its GGUF gives (for the bundled one its file name,
    never the store's `smollm2` id: a lookup by model id must keep finding that one)."""
    from hearthnet.models.importer import import_gguf

    _say(f"importing {s.gguf} as {s.alias} (--dtype {dtype})")
    import_gguf(store, s.gguf, alias=s.alias, dtype=dtype)


def _qwen_gguf(store: Any, built: lc.LlamaCpp, logs: Path, alias: str) -> Path:
    """The Qwen2.5-1.5B-shaped Q4_0 GGUF, written once per llama.cpp build from the
    synthetic model (seed 0); a newly written file replaces the store's import of an
    older one."""
    from hearthnet.models.synth import synth_model

    out = built.folder / "models" / f"{QWEN_SHAPE}-synthetic-seed0-q4_0.gguf"
    if out.is_file():
        return out
    entry = store.find(QWEN_SHAPE)
    if entry is None:
        _say(f"writing the synthetic {QWEN_SHAPE} model (models synth)")
        entry = synth_model(store, QWEN_SHAPE)
    _say(f"converting {entry.path} to f16 GGUF, then Q4_0 (llama-quantize) into {out}")
    lc.write_q4_0(built, entry.path, out, logs / "convert.log")
    if store.find(alias) is not None:
        store.remove(alias)  # imported from an earlier file
    return out


def store_bytes(folder: Path) -> int:
    """Bytes of every file of a store folder (a linked file counted at its target's size)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------
# Measuring one model


def measure(s: Subject, built: lc.LlamaCpp, args: argparse.Namespace, logs: Path
            ) -> dict[str, Any]:
    """Local and (unless --no-rpc) two-shard figures of `s`; a part that fails is recorded
    as ``error`` and the run goes on with the next."""
    from hearthnet.models import ModelStore

    entry = ModelStore().get(s.alias)
    gguf_b, store_b = s.gguf.stat().st_size, store_bytes(entry.path)
    out: dict[str, Any] = {
        "alias": s.alias, "gguf": str(s.gguf), "model_id": entry.model_id,
        "num_layers": entry.num_layers, "stored_dtype": entry.dtype,
        "gguf_mb": round(gguf_b / 2**20, 1), "store_mb": round(store_b / 2**20, 1),
        "store_ratio": round(store_b / gguf_b, 3)}
    try:
        out["local"] = measure_local(s, built, args, logs)
    except HearthNetError as e:
        out["local"] = {"error": e.message}
    if not args.no_rpc:
        try:
            out["two_shards"] = measure_two_shards(s, entry, built, args, logs)
        except HearthNetError as e:
            out["two_shards"] = {"error": e.message}
    return out


def measure_local(s: Subject, built: lc.LlamaCpp, args: argparse.Namespace, logs: Path
                  ) -> dict[str, Any]:
    """HearthNet local (a fresh `bench local` child), then llama-bench on as many prompt
    tokens; their figures and ratios."""
    from hearthnet.bench.local import full_with_compile

    ns = argparse.Namespace(model=s.alias, weights=args.weights, tokens=args.tokens,
                            runs=args.runs, threads=args.threads, prompt=args.prompt,
                            device="cpu", dtype="fp32", no_cuda_graphs=False)
    _say(f"{s.key}: HearthNet local, {args.weights}, {args.threads} threads")
    try:
        full, starts = full_with_compile(ns)
    finally:
        if getattr(ns, "compile_dir", ""):
            shutil.rmtree(ns.compile_dir, ignore_errors=True)
    prefill_ms = median(full["prefill_ms"])
    hn = {"decode_tokens_per_s": round(median(full["decode_tokens_per_s"]), 2),
          "prefill_tokens_per_s": round(full["prompt_tokens"] * 1000 / prefill_ms, 1)
          if prefill_ms else None,
          "prefill_ms": round(prefill_ms, 2), "prompt_tokens": full["prompt_tokens"],
          "decode_runs": full["decode_tokens_per_s"],
          "completion_tokens": full["completion_tokens"],
          "peak_rss_mb": full["memory"]["peak_rss_mb"], "param_mb": full["param_mb"],
          "weights": args.weights, "kernel": full.get("kernel", full.get("int8_kernel")),
          "int4_dense_rows": full.get("int4_dense_rows"),  # fp32-tile products from these rows
          "compile": starts}
    _say(f"{s.key}: llama-bench, {args.threads} threads")
    ref = lc.run_llama_bench(lc.llama_bench_argv(
        built.tool("llama-bench"), s.gguf, prompt_tokens=full["prompt_tokens"],
        tokens=args.tokens, threads=args.threads, runs=args.runs),
        logs / f"llama-bench-{_slug(s.key)}.log")
    return {"hearthnet": hn, "llama_cpp": ref,
            "decode_ratio": _ratio(hn["decode_tokens_per_s"], ref.get("decode_tokens_per_s")),
            "prefill_ratio": _ratio(hn["prefill_tokens_per_s"],
                                    ref.get("prefill_tokens_per_s"))}


def measure_two_shards(s: Subject, entry: Any, built: lc.LlamaCpp, args: argparse.Namespace,
                       logs: Path) -> dict[str, Any]:
    """llama.cpp RPC with two one-thread servers, then HearthNet's two-shard mesh."""
    _say(f"{s.key}: llama.cpp RPC, 2 rpc-servers × 1 thread on 127.0.0.1")
    with lc.rpc_servers(built.tool("rpc-server"), 2, 1, logs) as servers:
        ref = lc.run_llama_bench(lc.llama_bench_argv(
            built.tool("llama-bench"), s.gguf, prompt_tokens=0, tokens=args.tokens,
            threads=1, runs=args.runs, rpc=[a for a, _ in servers]),
            logs / f"llama-bench-rpc-{_slug(s.key)}.log")
        ref["server_peak_rss_mb"] = lc.server_memory([p for _, p in servers])
    # one chat's token passes the 1-thread stages one after the other, so no such pipeline
    # decodes faster than one thread running every layer with no network at all: that
    # figure, beside RPC's, is the ceiling of the mesh-vs-RPC ratio on this machine
    _say(f"{s.key}: llama-bench, 1 thread, no network (a 1-thread pipeline's ceiling)")
    one = lc.run_llama_bench(lc.llama_bench_argv(
        built.tool("llama-bench"), s.gguf, prompt_tokens=0, tokens=args.tokens, threads=1,
        runs=args.runs), logs / f"llama-bench-1-thread-{_slug(s.key)}.log")
    ceiling = {"llama_cpp_one_thread": one,
               "ceiling_ratio": _ratio(one.get("decode_tokens_per_s"),
                                       ref.get("decode_tokens_per_s"))}
    _say(f"{s.key}: HearthNet mesh, 2 shard nodes × 1 thread on 127.0.0.1")
    try:
        hn = mesh_decode(entry, args)
    except HearthNetError as e:  # llama.cpp's figure stands without it
        return {"llama_cpp_rpc": ref, "hearthnet_mesh": {"error": e.message},
                "decode_ratio": None, "error": e.message, **ceiling}
    return {"llama_cpp_rpc": ref, "hearthnet_mesh": hn, **ceiling,
            "decode_ratio": _ratio(hn["decode_tokens_per_s"], ref.get("decode_tokens_per_s"))}


def mesh_decode(entry: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of a chat through an orchestrator and two shard nodes on 127.0.0.1
    (`bench pipeline`'s mesh; median of ``--runs`` after a warm-up chat)."""
    from hearthnet.bench import pid_memory, single_model_dir
    from hearthnet.bench.pipeline import _specs, split_layers
    from hearthnet.distributed_inference.directory.formats import head_format
    from hearthnet.mesh.launcher import LocalMesh, log_tails

    ranges = split_layers(entry.num_layers, 2)
    ns = argparse.Namespace(concurrency=[1], batch_window_ms=None, mixed_prefill_tokens=None,
                            device="cpu", weights=args.weights)
    root = Path(tempfile.mkdtemp(prefix="hearthnet-anchor-mesh-"))
    try:
        models = single_model_dir(entry, root, share_compiled=True)  # warm steps, loaded
        mesh = LocalMesh(_specs(ns, ranges, head_format(args.weights)), root=root,
                         model=entry.alias, threads=1, models=models)
        try:
            t0 = time.perf_counter()
            mesh.start(timeout=1800.0)
            start_s = round(time.perf_counter() - t0, 1)
            steps = mesh.wait_decode_steps()  # measured as a warm node runs (M26 §5.7)
            runs = asyncio.run(_chats(mesh.nodes["node-a"].uri, entry.alias, args))
            memory = {n: pid_memory(p.proc.pid)["peak_rss_mb"] for n, p in mesh.nodes.items()
                      if p.proc is not None}
        finally:
            mesh.stop()
    except HearthNetError as e:
        raise HearthNetError(f"{e.message}\n{log_tails(root)}") from e
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"decode_tokens_per_s": round(median([r["tokens_per_second"] for r in runs]), 2),
            "decode_runs": [r["tokens_per_second"] for r in runs],
            "completion_tokens": [r["completion_tokens"] for r in runs],
            "formats": runs[-1]["formats"], "layer_split": [list(r) for r in ranges],
            "mesh_start_s": start_s, "node_peak_rss_mb": memory, "decode_steps": steps}


async def _chats(uri: str, alias: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from hearthnet.bench.chats import chat_frames

    # a call's `weights` is a minimum precision: the shards' own format admits them
    policy = args.weights if args.weights in HELD_FORMATS else None
    # never the orchestrator's local fallback: the figure is the shards'; the longest
    # deadline a call may set, since a 1.5B prefill on one thread of a shared 2-core
    # machine can outlast the 30 s default (a speed figure, not a liveness check)
    params = {"weights": policy, "fallback_to_local": False, "timeout_s": 600.0}
    await chat_frames(uri, args.prompt, alias, 8, **params)  # warm-up
    out = []
    for _ in range(args.runs):
        frames, _ = await chat_frames(uri, args.prompt, alias, args.tokens, **params)
        done = frames[-1]
        out.append({"tokens_per_second": round(float(done["timings"]["tokens_per_second"]), 2),
                    "completion_tokens": done["usage"]["completion_tokens"],
                    "formats": done.get("formats")})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", key)


# ---------------------------------------------------------------------------------------
# Goals and report


def evaluate_goals(models: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each goal against the figures: ``{"<model> <figure>": {measured, goal, met}}``.

    Decode, prefill and two-shard goals are checked on the built-in models; the store goal
    on every model. A figure that was not measured (a failed or skipped part) is missed,
    with ``measured`` None; a skipped two-shard part (``--no-rpc``) is not checked.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, m in models.items():
        checked = ["store_ratio"] + (["decode_ratio", "prefill_ratio"] if key in MODELS else [])
        for name in checked:
            op, goal = GOALS[name]
            value = m.get(name) if name == "store_ratio" else m.get("local", {}).get(name)
            out[f"{key} {name}"] = _goal(value, op, goal)
        ready = (m.get("local", {}).get("hearthnet", {}).get("compile") or {}).get("restart")
        if key in RESTART_GOALS and ready is not None:
            seconds = [v for v in (ready.get("seconds"), ready.get("head_seconds"))
                       if v is not None]  # the layers' step and the head's, side by side
            out[f"{key} restart_compiled_step_s"] = _goal(max(seconds, default=None), "<=",
                                                          RESTART_GOALS[key])
        if key in MESH_GOALS and "two_shards" in m:
            out[f"{key} mesh_vs_rpc_ratio"] = _goal(m["two_shards"].get("decode_ratio"), ">=",
                                                    MESH_GOALS[key])
    return out


def _goal(value: float | None, op: str, goal: float) -> dict[str, Any]:
    met = value is not None and (value >= goal if op == ">=" else value <= goal)
    return {"measured": value, "goal": f"{'≥' if op == '>=' else '≤'} {goal}", "met": met}


def report(f: dict[str, Any]) -> str:
    """The human-readable tables of a `run` result."""
    rows, mesh_rows, errors = [], [], []
    for key, m in f["models"].items():
        lo = m.get("local", {})
        hn, ref = lo.get("hearthnet", {}), lo.get("llama_cpp", {})
        rows.append([key, m["gguf_mb"], f"{m['store_mb']} ({m['store_ratio']}×)",
                     ref.get("decode_tokens_per_s"), hn.get("decode_tokens_per_s"),
                     lo.get("decode_ratio"), ref.get("prefill_tokens_per_s"),
                     hn.get("prefill_tokens_per_s"), lo.get("prefill_ratio"),
                     ref.get("peak_rss_mb"), hn.get("peak_rss_mb")])
        if "error" in lo:
            errors.append(f"{key} local: {lo['error']}")
        two = m.get("two_shards")
        if two is not None:
            mesh_rows.append([key, two.get("llama_cpp_rpc", {}).get("decode_tokens_per_s"),
                              two.get("hearthnet_mesh", {}).get("decode_tokens_per_s"),
                              two.get("decode_ratio"),
                              two.get("llama_cpp_one_thread", {}).get("decode_tokens_per_s"),
                              two.get("ceiling_ratio")])
            if "error" in two:
                errors.append(f"{key} two shards: {two['error']}")
    steps = [f"{key}: first start {c['first_start']['state']}, restart "
             f"{c['restart']['state']}" + "".join(
                 f"; head {kind}: {c['first_start']['head'][kind]}, restart {state}"
                 for kind, state in (c["restart"].get("head") or {}).items())
             for key, m in f["models"].items()
             if (c := m.get("local", {}).get("hearthnet", {}).get("compile"))]
    t1 = table(["model", "GGUF MB", "store MB (×)", "llama.cpp decode", "HearthNet decode",
                "ratio", "llama.cpp prefill", "HearthNet prefill", "ratio",
                "llama.cpp RSS MiB", "HearthNet RSS MiB"], rows)
    t2 = table(["model", "llama.cpp RPC decode", "HearthNet mesh decode", "ratio",
                "llama.cpp 1 thread, no network", "its ratio (a 1-thread pipeline's ceiling)"],
               mesh_rows) \
        if mesh_rows else "two shards: skipped (--no-rpc)"
    ll = f["llama_cpp"]
    return (f"bench anchor: tok/s, {f['tokens']} decode tokens × {f['runs']} runs (median), "
            f"{f['settings']['threads']} threads each; HearthNet weights {f['weights']} "
            f"(store imported --dtype {f['import_dtype']}); "
            f"{ll['version']} ({' '.join(ll['instruction_sets'])}) from {ll['folder']}\n"
            f"{t1}\n"
            + "".join(f"compiled decode step, {s}\n" for s in steps)
            + f"\ntwo shards on 127.0.0.1, 1 thread each:\n{t2}\n"
            + "".join(f"error: {e}\n" for e in errors)
            + f"goals: {goals_text(f['goals'])}\nwritten to {f['results_file']}")
