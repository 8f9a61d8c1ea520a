"""`hearthnet bench failover`: a shard host dies mid-answer (M26 §5.4, §8.2).

A four-node mesh of separate processes on 127.0.0.1: node A orchestrates, B hosts layers
0–14, C hosts 15–29 and D is a spare (15–29 by default, or ``--spare 10-29``). Per run:

1. an unfaulted greedy chat through A — its tokens, wall time, inter-token gaps, and from
   its `done` frame which node serves the last stage;
2. the same chat again; after ``--kill-after`` tokens have reached the client, that node's
   process group is killed with SIGKILL (a host losing power: no goodbye, no withdrawal).

Measured: kill → next token (the first `token_delta` after the `shard_failover` frame,
so tokens already in flight before the kill do not count), the orchestrator's own failover
time, the faulted call's wall time against the unfaulted one, and whether the tokens are
identical. Between runs the killed node is started again.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hearthnet.argtypes import positive
from hearthnet.bench import PROMPTS, machine, median, table, write_results
from hearthnet.constants import WIRE_DTYPES
from hearthnet.errors import BadRequest, HearthNetError


def add_args(p: argparse.ArgumentParser) -> None:
    """Options of `hearthnet bench failover`."""
    p.add_argument("--model", default="smollm2", help="model alias in the store")
    p.add_argument("--tokens", type=positive, default=64, help="tokens generated per chat")
    p.add_argument("--kill-after", type=int, default=16,
                   help="kill after this many tokens reached the client (default 16)")
    p.add_argument("--runs", type=positive, default=1, help="faulted runs (default 1)")
    p.add_argument("--spare", default="15-29", help="layers of the spare node D (LO-HI)")
    p.add_argument("--node-threads", type=positive, default=1, help="torch threads per node")
    p.add_argument("--wire", choices=list(WIRE_DTYPES), default="fp16")
    p.add_argument("--prompt", default=PROMPTS[0])
    p.add_argument("--results-dir", default="bench-results",
                   help="folder for failover.json (default bench-results)")


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Start the mesh, run unfaulted and faulted chats, stop it; returns (figures, report)."""
    from hearthnet.bench.pipeline import split_layers
    from hearthnet.mesh.launcher import LocalMesh, NodeSpec
    from hearthnet.models import ModelStore

    if not 1 <= args.kill_after <= args.tokens - 8:
        raise BadRequest("--kill-after must be in 1..tokens-8 and --runs ≥ 1")
    entry = ModelStore().get(args.model)
    lower, upper = split_layers(entry.num_layers, 2)
    try:
        lo, hi = (int(x) for x in args.spare.split("-"))
    except ValueError as e:
        raise BadRequest(f"--spare must be LO-HI, not {args.spare!r}") from e
    specs = [NodeSpec("node-a"), NodeSpec("node-b", [lower]), NodeSpec("node-c", [upper]),
             NodeSpec("node-d", [(lo, hi)])]
    figures: dict[str, Any] = {
        "benchmark": "failover", "model": args.model, "model_id": entry.model_id,
        "tokens": args.tokens, "kill_after_tokens": args.kill_after, "machine": machine(),
        "nodes": {s.node_id: [list(r) for r in s.shards] for s in specs},
        "settings": {"node_torch_threads": args.node_threads, "wire_dtype": args.wire,
                     "sampling": "greedy", "prompt": args.prompt, "signal": "SIGKILL",
                     "victim": "the node serving the faulted call's last stage when it is killed"}}
    root = Path(tempfile.mkdtemp(prefix="hearthnet-bench-"))
    try:
        with LocalMesh(specs, root=root, model=args.model, threads=args.node_threads) as mesh:
            runs = asyncio.run(_runs(mesh, args))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures["runs_detail"] = runs
    figures.update(_summary(runs))
    figures["results_file"] = str(write_results("failover", figures, Path(args.results_dir)))
    return figures, report(figures)


async def _stream(uri: str, a: argparse.Namespace, on_token: Any = None
                  ) -> tuple[list[tuple[float, dict[str, Any]]], float]:
    """One chat; (frames with their arrival times, start time). `on_token(n, frames)` after
    each token, with the frames so far."""
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    args = chat_args(a.prompt, a.model, SamplingParams(max_tokens=a.tokens),
                     wire_dtype=a.wire)
    out: list[tuple[float, dict[str, Any]]] = []
    n = 0
    t0 = time.perf_counter()
    async for f in bus_call(uri, CHAT_CAPABILITY, args):
        out.append((time.perf_counter(), f))
        if f.get("type") == "token_delta":
            n += 1
            if on_token is not None:
                on_token(n, out)
    return out, t0


def _tokens(frames: list[tuple[float, dict[str, Any]]]) -> list[int]:
    return [int(f["token_id"]) for _, f in frames if f.get("type") == "token_delta"]


async def _runs(mesh: Any, a: argparse.Namespace) -> list[dict[str, Any]]:
    uri = mesh.nodes["node-a"].uri
    await _stream(uri, argparse.Namespace(**{**vars(a), "tokens": 8}))  # warm-up
    out = []
    for i in range(a.runs):
        if i:
            await asyncio.to_thread(mesh.wait_covered, "node-a", 60.0, 3)
        out.append(await _one(mesh, uri, a))
        victim = out[-1]["victim"]
        if i + 1 < a.runs:
            await asyncio.to_thread(mesh.start_node, victim)
    return out


async def _one(mesh: Any, uri: str, a: argparse.Namespace) -> dict[str, Any]:
    base, b0 = await _stream(uri, a)
    done = base[-1][1]
    if done.get("type") != "done":
        raise HearthNetError(f"the unfaulted chat did not finish: {done}")
    kill: dict[str, Any] = {"t": 0.0, "pid": 0, "sid": ""}

    def on_token(n: int, frames: list[tuple[float, dict[str, Any]]]) -> None:
        # the faulted call's own last stage: with a spare of the same range the router
        # may pick another host than in the unfaulted call
        if n == a.kill_after:
            stages = [f for _, f in frames if f.get("type") == "shard_status"
                      and f.get("status") == "ok"]
            sid = str(max(stages, key=lambda f: f["layers"][0])["shard_id"])
            node = sid.rsplit("@", 1)[-1]
            if node not in mesh.nodes:
                raise HearthNetError(f"cannot tell which node serves {sid}")
            kill.update(pid=mesh.nodes[node].proc.pid, t=time.perf_counter(), sid=sid)
            mesh.kill(node)

    faulted, f0 = await _stream(uri, a, on_token)
    if not kill["t"]:
        raise HearthNetError("the chat ended before the kill")
    last_sid = str(kill["sid"])
    victim = last_sid.rsplit("@", 1)[-1]
    gaps = [t2 - t1 for (t1, f1), (t2, f2) in itertools.pairwise(base)
            if f1.get("type") == f2.get("type") == "token_delta"]
    kinds = [f.get("type") for _, f in faulted]
    fo = next(((t, f) for t, f in faulted if f.get("type") in ("shard_failover",
                                                              "pipeline_aborted")), None)
    after = next((t for t, f in faulted if fo is not None and t >= fo[0]
                  and f.get("type") == "token_delta"), None)
    fdone = faulted[-1][1]
    return {
        "victim": victim, "victim_pid": kill["pid"], "victim_shard": last_sid,
        "pipeline_before": done["pipeline"], "pipeline_after": fdone.get("pipeline"),
        "kill_to_failover_frame_ms": round((fo[0] - kill["t"]) * 1000, 1) if fo else None,
        "kill_to_next_token_ms": round((after - kill["t"]) * 1000, 1) if after else None,
        "orchestrator_failover_ms": fdone.get("timings", {}).get("failover_ms"),
        "failover_frame": fo[1] if fo else None,
        "fallback_to_local": bool(fdone.get("fallback")),
        "unfaulted_wall_ms": round((base[-1][0] - b0) * 1000, 1),
        "faulted_wall_ms": round((faulted[-1][0] - f0) * 1000, 1),
        "unfaulted_token_gap_ms_p50": round(median(gaps) * 1000, 2),
        "tokens_identical": _tokens(faulted) == _tokens(base),
        "completion_tokens": len(_tokens(faulted)),
        "frames": {k: kinds.count(k) for k in sorted({str(x) for x in kinds})},
        "victim_exit": mesh.nodes[victim].proc.returncode}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        xs = [r[key] for r in runs if r[key] is not None]
        return round(median(xs), 1) if xs else None

    penalty = [r["faulted_wall_ms"] - r["unfaulted_wall_ms"] for r in runs]
    return {"kill_to_next_token_ms": med("kill_to_next_token_ms"),
            "kill_to_failover_frame_ms": med("kill_to_failover_frame_ms"),
            "unfaulted_wall_ms": med("unfaulted_wall_ms"),
            "faulted_wall_ms": med("faulted_wall_ms"),
            "penalty_ms": round(median(penalty), 1),
            "unfaulted_token_gap_ms_p50": med("unfaulted_token_gap_ms_p50"),
            "tokens_identical": all(r["tokens_identical"] for r in runs),
            "failovers": sum(r["frames"].get("shard_failover", 0) for r in runs),
            "fallbacks": sum(r["fallback_to_local"] for r in runs)}


def report(f: dict[str, Any]) -> str:
    """The human-readable table of a `run` result."""
    def short(sid: str) -> str:
        return sid.rsplit(":", 1)[-1]  # "15-29@node-c"

    rows = [[i + 1, short(r["victim_shard"]), r["kill_to_next_token_ms"],
             r["kill_to_failover_frame_ms"], r["orchestrator_failover_ms"],
             r["unfaulted_wall_ms"], r["faulted_wall_ms"], r["unfaulted_token_gap_ms_p50"],
             "yes" if r["tokens_identical"] else "NO",
             "local" if r["fallback_to_local"] else " → ".join(
                 short(x) for x in r["pipeline_after"] or [])]
            for i, r in enumerate(f["runs_detail"])]
    t = table(["run", "killed (SIGKILL)", "kill→next token ms", "kill→failover frame ms",
               "orch. failover ms", "unfaulted ms", "faulted ms", "token gap p50 ms",
               "same tokens", "pipeline after"], rows)
    return (f"bench failover: {f['model_id']}, {f['tokens']} tokens, kill after "
            f"{f['kill_after_tokens']}, nodes {f['nodes']}\n{t}\n"
            f"median kill→next token {f['kill_to_next_token_ms']} ms; call penalty "
            f"{f['penalty_ms']} ms; tokens identical: {f['tokens_identical']}\n"
            f"written to {f['results_file']}")
