"""`hearthnet demo`: the README's first command — a real answer through a real mesh.

Starts three `hearthnet node` processes on 127.0.0.1 (`LocalMesh`): node A orchestrates,
node B hosts layers 0–14 and node C layers 15–29 of SmolLM2, each with its node state in a
fresh temporary folder and the shared model store. It waits until A sees the model fully
covered, streams a greedy answer through A's `experimental.distributed_llm.chat`
capability, prints a per-shard latency summary, and stops every process it started — also
on Ctrl-C, SIGTERM or an error — then deletes the temporary folder.

With ``--serve`` the mesh stays up after the answer until Ctrl-C (or SIGTERM), and the
demo prints node A's ``api: http://127.0.0.1:PORT/v1`` and ``status page:
http://127.0.0.1:PORT/`` (``--api-port``, default 8080) — point a chat front-end there.

With ``--json`` every line on stdout is one JSON object: ``demo_mesh`` (the nodes, their
pids and the temporary folder), then the chat's frames as the node sends them
(``shard_status``, ``token_delta``, ``done`` …), then ``demo_stopped``. Between
``demo_mesh`` and the frames, ``demo_decode_steps``: what each shard's decode steps run as
(the first demo on a machine waits for them to compile; later ones load them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from hearthnet.distributed_inference.directory.formats import FORMATS, head_format, policy_for
from hearthnet.frames import (
    Done,
    ErrorFrame,
    OtherFrame,
    PipelineAborted,
    ShardFailover,
    StreamFrame,
    TokenDelta,
    read_frame,
)

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams

DEFAULT_PROMPT = "In two sentences, why is it useful to share one computer's work across several?"
MODEL = "smollm2"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="stream a real answer (three-node mesh on 127.0.0.1)",
                       description="Start a three-node mesh on 127.0.0.1, stream an answer "
                                   "through it, print per-shard latencies, stop the mesh.")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--weights", default=None, choices=FORMATS,
                   help="how the shards (and node A's head) hold their weights (default: a "
                        "host's own — a GGUF's Q4 blocks as they are, else fp32)")
    p.add_argument("--json", action="store_true", help="one JSON object per frame on stdout")
    p.add_argument("--serve", action="store_true",
                   help="after the answer keep the mesh running until Ctrl-C, with node A's "
                        "OpenAI-compatible API and status page on --api-port")
    p.add_argument("--api-port", type=int, default=8080,
                   help="node A's HTTP port with --serve (default 8080; 0 = any free port)")
    p.set_defaults(func=_run)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM / SIGHUP: the same clean stop as Ctrl-C


def _say(text: str, as_json: bool) -> None:
    if not as_json:
        print(text, flush=True)


def _run(args: argparse.Namespace) -> int:
    import torch

    from hearthnet.distributed_inference.engine.generation import PromptLimits
    from hearthnet.distributed_inference.engine.sampling import SamplingParams
    from hearthnet.mesh.launcher import LocalMesh, NodeSpec
    from hearthnet.models import ModelStore

    torch.set_num_threads(1)  # this process only relays frames; the nodes compute
    entry = ModelStore().get(MODEL)  # a clear error now if the model is not imported
    # a bad_request before any node starts: the sampling parameters, and the prompt's size
    # and max_tokens against the limits the demo's nodes run with (their defaults)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    PromptLimits().check_request([{"role": "user", "content": args.prompt}], sampling)
    half = entry.num_layers // 2
    api = {"listen_port": args.api_port} if args.serve else {}
    host = {"weights": args.weights} if args.weights else {}
    # the shards hold --weights: the orchestrator's calls accept it (a compact one asked
    # for); by default the nodes' own defaults (lossless)
    di = {"head_weights": head_format(args.weights), "weights": policy_for(args.weights)} \
        if args.weights else {}
    specs = [NodeSpec("node-a", api=api, extra_di=di),
             NodeSpec("node-b", [(0, half - 1)], extra_host=host),
             NodeSpec("node-c", [(half, entry.num_layers - 1)], extra_host=host)]
    root = Path(tempfile.mkdtemp(prefix="hearthnet-demo-"))
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    mesh: LocalMesh | None = None
    try:
        _say(f"HearthNet demo: starting 3 node processes on 127.0.0.1 (node state in {root})",
             args.json)
        t0 = time.perf_counter()
        mesh = LocalMesh(specs, root=root, model=MODEL, threads=1)
        mesh.start()
        _announce(mesh, specs, root, time.perf_counter() - t0, args.json)
        _decode_steps(mesh, args.json)
        rc = asyncio.run(_chat(mesh.nodes["node-a"].uri, args, sampling))
        if args.serve and rc == 0:
            _serve(mesh.nodes["node-a"].api, args.json)
        return rc
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up
        pids = _stop(mesh)
        shutil.rmtree(root, ignore_errors=True)
        if args.json:
            print(json.dumps({"type": "demo_stopped", "pids": pids}), flush=True)
        else:
            print(f"stopped {len(pids)} node processes", flush=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, h in old.items():
            signal.signal(s, h)


def _decode_steps(mesh: Any, as_json: bool) -> None:
    """Wait for the shards' compiled decode steps (M26 §5.7): compiled once into the model
    store by the first demo on a machine (about a minute), loaded in seconds by every
    later one; say what each shard's steps run as."""
    states = mesh.decode_steps()
    if any("compiling" in v for v in states.values()):  # a decode step, or its passes
        _say("waiting for the shards' compiled decode steps (compiled by the first run on a "
             "machine, loaded by later ones) …", as_json)
        states = mesh.wait_decode_steps()
    if as_json:
        print(json.dumps({"type": "demo_decode_steps", "shards": states}), flush=True)
        return
    for shard_id, state in states.items():
        print(f"  {shard_id.rsplit(':', 1)[-1]}: decode step {state}")
    print(flush=True)


def _serve(api: str, as_json: bool) -> None:
    """Keep the mesh up until Ctrl-C / SIGTERM (`_interrupt` raises KeyboardInterrupt)."""
    if as_json:
        print(json.dumps({"type": "demo_serving", "api": api + "/v1", "status_page": api + "/"}),
              flush=True)
    else:
        print(f"\napi: {api}/v1\nstatus page: {api}/\n(Ctrl-C stops the mesh)", flush=True)
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:  # the way to stop a serving demo: not an error
        return


def _stop(mesh: Any) -> list[int]:
    if mesh is None:
        return []
    pids = [n.proc.pid for n in mesh.nodes.values() if n.proc is not None]
    mesh.stop()
    return pids


def _announce(mesh: Any, specs: list[Any], root: Path, start_s: float, as_json: bool) -> None:
    nodes = {s.node_id: {"pid": mesh.nodes[s.node_id].proc.pid, "uri": mesh.nodes[s.node_id].uri,
                         "layers": [list(r) for r in s.shards]} for s in specs}
    if as_json:
        print(json.dumps({"type": "demo_mesh", "root": str(root), "model": MODEL,
                          "nodes": nodes, "start_s": round(start_s, 1)}), flush=True)
        return
    for node_id, n in nodes.items():
        role = "orchestrator" if not n["layers"] else \
            "layers " + ", ".join(f"{lo}–{hi}" for lo, hi in n["layers"])
        print(f"  {node_id}  {role:<14} pid {n['pid']}")
    print(f"model {MODEL} fully covered after {start_s:.1f} s\n", flush=True)


async def _chat(uri: str, args: argparse.Namespace, sampling: SamplingParams) -> int:
    from hearthnet.commands.chat import emit
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    call = chat_args(args.prompt, MODEL, sampling)
    _say(f"> {args.prompt}\n", args.json)
    last: StreamFrame | OtherFrame | None = None
    async for raw in bus_call(uri, CHAT_CAPABILITY, call):
        last = frame = read_frame(raw)
        if args.json or isinstance(frame, (TokenDelta, ShardFailover, PipelineAborted,
                                           ErrorFrame)):
            emit(frame, args.json)
    if not isinstance(last, Done):
        return 1
    if not args.json:
        print("\n\n" + summary(last), flush=True)
    return 0


def summary(done: Done) -> str:
    """The per-shard latency summary of a `done` frame, for a person."""
    t = done.timings
    rows = [f"{'shard':<28} {'layers':>7} {'p50 ms':>8} {'p95 ms':>8} {'overhead p50/p95 ms':>20}"]
    for sid, s in t.get("per_shard", {}).items():
        name = sid.rsplit(":", 1)[-1]  # "0-14@node-b"
        rows.append(f"{name:<28} {s['layers'][0]:>3}–{s['layers'][1]:<3} {s['p50_ms']:>8.1f} "
                    f"{s['p95_ms']:>8.1f} {s['overhead_p50_ms']:>9.2f} / "
                    f"{s['overhead_p95_ms']:<8.2f}")
    n = done.text_tokens
    via = "local fallback" if done.fallback else " → ".join(
        s.rsplit(":", 1)[-1] for s in done.pipeline)
    rows.append(f"{n} tokens via {via}: first token {t.get('first_token_ms', 0):.0f} ms, "
                f"{t.get('tokens_per_second', 0):.1f} tokens/s, pipeline construction "
                f"{t.get('construction_ms', 0):.0f} ms, total {t.get('total_ms', 0):.0f} ms")
    return "\n".join(r.rstrip() for r in rows)
