"""`hearthnet demo`: the README's first command — stream a real answer."""

from __future__ import annotations

import argparse

DEFAULT_PROMPT = "In two sentences, why is it useful to share one computer's work across several?"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="stream a real answer (three-node mesh on 127.0.0.1)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch

    from hearthnet.commands.chat import emit
    from hearthnet.distributed_inference.generation import SamplingParams
    from hearthnet.distributed_inference.local import LocalEngine
    from hearthnet.models import ModelStore

    torch.set_num_threads(2)
    engine = LocalEngine(ModelStore().get("smollm2"))
    n = 0
    for ev in engine.generate([{"role": "user", "content": args.prompt}],
                              SamplingParams(max_tokens=args.max_tokens)):
        n += 1
        emit({"type": "token_delta", "text": ev.text, "token_id": ev.token_id}, args.json)
    emit({"type": "done", "usage": {"completion_tokens": n},
          "timings": {"first_token_ms": engine.timings.first_token_ms,
                      "tokens_per_second": engine.timings.decode_tokens_per_s}}, args.json)
    return 0
