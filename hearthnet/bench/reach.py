"""`hearthnet bench reach`: the mission's headline — a model no single process holds (M26 §1).

Starts a mesh on 127.0.0.1 (node A orchestrates with the head; ``--shards`` shard nodes
hold an even split of the layers, every process in ``--weights``), streams one greedy
answer and reports: the whole model's size in that format (planned from the safetensors
headers: what one process would have to hold), each process's peak RSS (VmHWM), decode
tokens/s, and whether every shard process stayed under half of the whole model. Then,
unless ``--no-local``, a local engine with the same formats answers the same prompt in a
fresh child process (`bench local`'s), and the tokens are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.bench import (
    PROMPTS,
    machine,
    pid_memory,
    single_model_dir,
    table,
    write_results,
)
from hearthnet.distributed_inference.directory.formats import FORMATS, head_format, policy_for


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench reach`."""
    p.add_argument("--model", default="qwen2.5-7b", help="model alias in the store")
    p.add_argument("--shards", type=positive, default=2, help="shard nodes (even layer split)")
    p.add_argument("--weights", default="int8", choices=FORMATS, help="held format")
    p.add_argument("--tokens", type=positive, default=16, help="tokens generated")
    p.add_argument("--node-threads", type=positive, default=1, help="torch threads per node")
    p.add_argument("--no-local", action="store_true",
                   help="skip the local reference (when one process cannot hold the model)")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for reach.json (default bench-results)")


def model_bytes(entry: Any, weights: str) -> int:
    """Bytes of the whole model held as `weights` (layers in `weights`, head as a head)."""
    from hearthnet.distributed_inference.directory.formats import resolve_format
    from hearthnet.distributed_inference.engine.memory import layer_weight_bytes
    from hearthnet.distributed_inference.engine.quant import held_nbytes
    from hearthnet.models.hashing import ggml_tensors, read_safetensors_header_and_metadata

    fmt = resolve_format(weights, entry.dtype)
    head = resolve_format(head_format(weights), entry.dtype)
    total = layer_weight_bytes(entry, 0, entry.num_layers - 1, fmt)
    for f in sorted(entry.path.glob("*.safetensors")):
        header, _, metadata = read_safetensors_header_and_metadata(f)
        blocks = ggml_tensors(metadata)  # kept GGUF blocks: their values' shape
        for name, info in header.items():
            if ".layers." not in name:
                shape = blocks[name][1] if name in blocks else tuple(
                    int(d) for d in info["shape"])  # type: ignore[attr-defined]
                total += held_nbytes(shape, head, len(shape) == 2)
    return total


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Start the mesh, stream one answer, measure, stop; then the local reference."""
    from hearthnet.bench.chats import chat_frames, token_ids
    from hearthnet.bench.local import _child
    from hearthnet.bench.pipeline import split_layers
    from hearthnet.mesh.launcher import LocalMesh, NodeSpec
    from hearthnet.models import ModelStore

    entry = ModelStore().get(args.model)
    ranges = split_layers(entry.num_layers, args.shards)
    whole = model_bytes(entry, args.weights) / 2**20
    specs = [NodeSpec("node-a", extra_di={"head_weights": head_format(args.weights),
                                          "weights": policy_for(args.weights)})] + [
        NodeSpec(f"node-{chr(ord('b') + i)}", [r], extra_host={"weights": args.weights},
                 extra_di={"prepare_heads_at_start": False})  # a shard host: layers only
        for i, r in enumerate(ranges)]
    f: dict[str, Any] = {
        "benchmark": "reach", "model": args.model, "model_id": entry.model_id,
        "synthetic": entry.synthetic, "weights": args.weights, "shards": args.shards,
        "layer_split": [list(r) for r in ranges], "tokens": args.tokens,
        "whole_model_mb": round(whole, 1), "machine": machine(),
        "settings": {"node_torch_threads": args.node_threads, "prompt": args.prompt,
                     "sampling": "greedy", "wire_dtype": "fp32",
                     "memory": "peak RSS (VmHWM) of each node process"}}
    root = Path(tempfile.mkdtemp(prefix="hearthnet-reach-"))
    t0 = time.perf_counter()
    mesh = LocalMesh(specs, root=root, model=args.model, threads=args.node_threads,
                     models=single_model_dir(entry, root), timeout_s=120.0)
    try:
        mesh.start(timeout=1800.0)  # multi-GB shards take minutes to load and quantise
        f["mesh_start_s"] = round(time.perf_counter() - t0, 1)
        uri = mesh.nodes["node-a"].uri
        asyncio.run(chat_frames(uri, args.prompt, args.model, 2, wire_dtype="fp32"))
        frames, wall = asyncio.run(chat_frames(uri, args.prompt, args.model, args.tokens,
                                               wire_dtype="fp32"))
        f["nodes"] = {n: {"layers": [list(r) for r in p.spec.shards],
                          **pid_memory(p.proc.pid)}
                      for n, p in mesh.nodes.items() if p.proc is not None}
    finally:
        mesh.stop()
        shutil.rmtree(root, ignore_errors=True)
    done = frames[-1]
    f["distributed"] = {"tokens_per_second": done["timings"]["tokens_per_second"],
                        "first_token_ms": done["timings"]["first_token_ms"],
                        "wall_s": round(wall, 2), "formats": done.get("formats"),
                        "kernels": {sid: s.get("kernel", "") for sid, s in
                                    done["timings"]["per_shard"].items()},
                        "token_ids": token_ids(frames)}
    shard_peaks = [n["peak_rss_mb"] for n in f["nodes"].values() if n["layers"]]
    f["max_shard_peak_rss_mb"] = max(shard_peaks)
    f["every_shard_under_half_the_model"] = max(shard_peaks) < whole / 2  # weights alone
    if not args.no_local:
        ns = argparse.Namespace(model=args.model, weights=args.weights, tokens=args.tokens,
                                runs=1, threads=2, prompt=args.prompt, device="cpu",
                                dtype="fp32", no_cuda_graphs=False)
        loc = _child(ns, "full")
        f["local"] = {"tokens_per_second": loc["decode_tokens_per_s"][0],
                      "peak_rss_mb": loc["memory"]["peak_rss_mb"],
                      "token_ids": loc["token_ids"]}
        f["tokens_identical_to_local"] = loc["token_ids"] == f["distributed"]["token_ids"]
        # what one process needs to run the whole model (weights + runtime + cache): the
        # headline's measure when the local reference could run
        f["every_shard_under_half_one_process"] = \
            max(shard_peaks) < f["local"]["peak_rss_mb"] / 2
    f["results_file"] = str(write_results("reach", f, Path(args.results_dir)))
    return f, report(f)


def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result."""
    rows = [[n, "-" if not v["layers"] else f"{v['layers'][0][0]}-{v['layers'][0][1]}",
             v["peak_rss_mb"], round(100 * v["peak_rss_mb"] / f["whole_model_mb"], 1)]
            for n, v in f["nodes"].items()]
    if "local" in f:
        rows.append(["local reference", "all", f["local"]["peak_rss_mb"],
                     round(100 * f["local"]["peak_rss_mb"] / f["whole_model_mb"], 1)])
    t = table(["process", "layers", "peak RSS MiB", "% of whole model"], rows)
    d = f["distributed"]
    lines = [f"bench reach: {f['model_id']}{' (synthetic)' if f['synthetic'] else ''}, "
             f"{f['shards']} shards, weights {f['weights']}: whole model "
             f"{f['whole_model_mb']:.0f} MiB in that format", t,
             f"distributed decode {d['tokens_per_second']} tok/s, first token "
             f"{d['first_token_ms']} ms; formats {d['formats']}; shard kernels "
             f"{', '.join(sorted(set(d['kernels'].values()) - {''})) or 'none (float)'}",
             f"every shard process under half the whole model: "
             f"{f['every_shard_under_half_the_model']} (largest {f['max_shard_peak_rss_mb']} MiB)"]
    if "local" in f:
        lines.append(f"local reference {f['local']['tokens_per_second']} tok/s; tokens "
                     f"identical: {f['tokens_identical_to_local']}; every shard process under "
                     f"half of the one process that holds the whole model: "
                     f"{f['every_shard_under_half_one_process']}")
    lines.append(f"written to {f['results_file']}")
    return "\n".join(lines)


