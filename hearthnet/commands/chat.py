"""`hearthnet chat`: stream an answer, locally (`--local`) or through the mesh (`--config`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hearthnet.commands import positive
from hearthnet.constants import CALL_WIRE_DTYPES
from hearthnet.distributed_inference.directory.formats import EXACT, HELD_FORMATS
from hearthnet.distributed_inference.engine.sampling import SamplingParams


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("chat", help="ask the model something and stream the answer")
    p.add_argument("prompt")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run every layer in this process")
    where.add_argument("--config", help="node TOML: call that node's distributed chat")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--wire-dtype", choices=list(CALL_WIRE_DTYPES), default=None,
                   help="hidden-state wire dtype (default: the node's activation_dtype, auto)")
    p.add_argument("--weights", choices=[*HELD_FORMATS, EXACT], default=None,
                   help="which shard formats the call accepts: a minimum format, or exact "
                        "(only the node's own head format); default int8 (issue 12)")
    p.add_argument("--json", action="store_true", help="one JSON object per frame")
    p.add_argument("--threads", type=positive, default=2, help="torch threads in this process")
    p.set_defaults(func=_run)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop=tuple(args.stop))


def emit(frame: dict[str, Any], as_json: bool) -> None:
    """Print one stream frame: JSON lines, or text for a person."""
    if as_json:
        print(json.dumps(frame), flush=True)
        return
    kind = frame.get("type")
    if kind == "token_delta":
        sys.stdout.write(frame["text"])
        sys.stdout.flush()
    elif kind == "done":
        sys.stdout.write("\n")
        t = frame.get("timings", {})
        u = frame.get("usage", {})
        print(f"[{u.get('completion_tokens', 0)} tokens, first token "
              f"{t.get('first_token_ms', 0):.0f} ms, {t.get('tokens_per_second', 0):.1f} tok/s]",
              file=sys.stderr)
    elif kind == "shard_status" and frame.get("status") == "ok":
        return  # routine; `--json` shows it
    elif kind in ("shard_status", "shard_failover", "pipeline_aborted", "error"):
        print("\n" + describe(frame), file=sys.stderr)


def _short(shard_id: Any) -> str:
    return str(shard_id).rsplit(":", 1)[-1]  # "0-14@node-b"


def describe(frame: dict[str, Any]) -> str:
    """A diagnostic frame as one line for a person; an error reads as the CLI's own."""
    from hearthnet.errors import one_line

    kind = frame.get("type")
    if kind == "error":
        return one_line(str(frame.get("code")), str(frame.get("message")))
    if kind == "pipeline_aborted":
        then = "; continuing on the local engine" if frame.get("continuing") == "local" else ""
        return f"[pipeline_aborted] {frame.get('reason')}{then}"
    if kind == "shard_failover":
        new = ", ".join(_short(s) for s in frame.get("replacement", [])) or "?"
        return (f"[failover] {_short(frame.get('failed'))} → {new} in {frame.get('ms')} ms, "
                f"{frame.get('replayed_positions')} positions replayed")
    return (f"[{frame.get('status', kind)}] {_short(frame.get('shard_id'))}: "
            f"{frame.get('code')}: {frame.get('message')}")


def _run(args: argparse.Namespace) -> int:
    """Exit 0 only for a call that ended with `done` (issue 14 §3); every failure is an
    `error` frame in `--json` mode (a lost node included) and exit code 1."""
    from hearthnet.errors import ConfigError, HearthNetError

    try:
        params = sampling_from_args(args)
        messages = [{"role": "user", "content": args.prompt}]
        if args.local:  # the only path that runs the model in this process
            import torch

            torch.set_num_threads(args.threads)
            return _run_local(args, messages, params)
        from hearthnet.commands.remote import chat_via_node

        return chat_via_node(args, messages, params)
    except ConfigError:
        raise  # exit code 2 (cli.main)
    except HearthNetError as e:
        emit({"type": "error", "code": e.code, "message": e.message}, args.json)
        return 1


def _run_local(args: argparse.Namespace, messages: list[dict[str, str]],
               params: SamplingParams) -> int:
    from hearthnet.distributed_inference.engine.local import LocalEngine, LocalTimings
    from hearthnet.models import ModelStore

    engine = LocalEngine(ModelStore().get(args.model))
    timings = LocalTimings()
    t0 = time.perf_counter()
    n = 0
    for ev in engine.generate(messages, params, timings):
        n += 1
        emit({"type": "token_delta", "text": ev.text, "token_id": ev.token_id}, args.json)
    total = time.perf_counter() - t0
    emit({"type": "done", "usage": {"completion_tokens": n},
          "timings": {"first_token_ms": timings.first_token_ms,
                      "tokens_per_second": timings.decode_tokens_per_s,
                      "total_ms": total * 1000}}, args.json)
    return 0
