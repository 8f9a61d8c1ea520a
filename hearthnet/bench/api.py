"""`hearthnet bench api`: the OpenAI-compatible API's cost over the bus (DESIGN.md decision 13).

Starts the demo's mesh (node A orchestrates, two shard nodes split the layers) with
`LocalMesh`, then alternates the same greedy chat through node A's capability bus (as
`hearthnet chat --config` and `HearthNetClient` do) and through its HTTP API as a
streaming OpenAI client sees it (``POST /v1/chat/completions``, ``stream: true``, read
with aiohttp's client). Per path, the median over ``--runs`` of: first-token ms (request
sent → first token text received), decode tokens/s seen by the client, and the p50 / p95
gap between two token chunks. Alternating runs share the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import decode_tokens, positive
from hearthnet.bench import PROMPTS, machine, median, percentile, table, write_results
from hearthnet.errors import HearthNetError


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench api`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store")
    p.add_argument("--tokens", type=decode_tokens, default=64, help="tokens per chat (default 64)")
    p.add_argument("--runs", type=positive, default=3, help="measured runs per path (median)")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for api.json (default bench-results)")


def _figures(t0: float, arrivals: list[float]) -> dict[str, float]:
    """First-token ms, decode tokens/s and inter-token gaps from token arrival times."""
    if len(arrivals) < 2:
        raise HearthNetError("the chat streamed fewer than two tokens")
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    return {"first_token_ms": (arrivals[0] - t0) * 1000,
            "tokens_per_second": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]),
            "gap_p50_ms": percentile(gaps, 50), "gap_p95_ms": percentile(gaps, 95),
            "tokens": float(len(arrivals))}


async def _via_bus(uri: str, args: argparse.Namespace) -> dict[str, float]:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    call = chat_args(args.prompt, args.model, SamplingParams(max_tokens=args.tokens))
    t0, arrivals = time.perf_counter(), []
    async for f in bus_call(uri, CHAT_CAPABILITY, call):
        if f.get("type") == "token_delta":
            arrivals.append(time.perf_counter())
    return _figures(t0, arrivals)


async def _via_api(api: str, args: argparse.Namespace) -> dict[str, float]:
    import aiohttp

    body = {"model": args.model, "stream": True, "temperature": 0, "max_tokens": args.tokens,
            "messages": [{"role": "user", "content": args.prompt}]}
    t0, arrivals = time.perf_counter(), []
    async with aiohttp.ClientSession() as s, \
            s.post(api + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise HearthNetError(f"the API answered {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    return _figures(t0, arrivals)


async def _measure(bus: str, api: str, args: argparse.Namespace
                   ) -> dict[str, list[dict[str, float]]]:
    await _via_bus(bus, args)  # warm-up: sessions, caches, the first-call costs
    await _via_api(api, args)
    runs: dict[str, list[dict[str, float]]] = {"bus": [], "api": []}
    for _ in range(args.runs):
        runs["bus"].append(await _via_bus(bus, args))
        runs["api"].append(await _via_api(api, args))
    return runs


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Start the mesh, measure both paths, stop it; returns (figures, report)."""
    import shutil
    import tempfile

    import torch

    from hearthnet.mesh.launcher import LocalMesh, NodeSpec
    from hearthnet.models import ModelStore

    torch.set_num_threads(1)  # this process only reads streams
    entry = ModelStore().get(args.model)
    half = entry.num_layers // 2
    root = Path(tempfile.mkdtemp(prefix="hearthnet-bench-api-"))
    try:
        with LocalMesh([NodeSpec("node-a"), NodeSpec("node-b", [(0, half - 1)]),
                        NodeSpec("node-c", [(half, entry.num_layers - 1)])],
                       root=root, model=args.model) as mesh:
            a = mesh.nodes["node-a"]
            runs = asyncio.run(_measure(a.uri, a.api, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = ("first_token_ms", "tokens_per_second", "gap_p50_ms", "gap_p95_ms")
    med = {path: {k: round(median([r[k] for r in rs]), 2) for k in keys}
           for path, rs in runs.items()}
    ratio = round(med["api"]["tokens_per_second"] / med["bus"]["tokens_per_second"], 3)
    figures = {"machine": machine(), "settings": {k: getattr(args, k) for k in
                                                  ("model", "tokens", "runs", "prompt")},
               "median": med, "api_to_bus_tokens_per_second": ratio, "runs": runs}
    figures["results_file"] = str(write_results("api", figures, Path(args.results_dir)))
    report = table(["path", "first token ms", "tokens/s", "gap p50 ms", "gap p95 ms"],
                   [[p, *(med[p][k] for k in keys)] for p in ("bus", "api")])
    return figures, report + f"\nHTTP API / bus decode tokens/s: {ratio}"
