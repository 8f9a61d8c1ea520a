"""`hearthnet models serve|unserve|served MODEL --config FILE`: the served-model list.

The community's list of models it serves lives in the event log
(`hearthnet.distributed_inference.placement.community`); automatic hosts (``shards = "auto"``)
cover the models on it. Only a node whose member list gives it trust ``steward`` may edit
it; the command asks the configured node through its loopback admin listener.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def register_served(msub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve``, ``unserve`` and ``served`` under ``hearthnet models``."""
    for op, text in (("serve", "add a model to the community's served-model list (steward)"),
                     ("unserve", "remove a model from the served-model list (steward)")):
        p = msub.add_parser(op, help=text)
        p.add_argument("model", help="alias or model id in the node's model store")
        _common(p, op)
    p = msub.add_parser("served", help="show the community's served-model list")
    _common(p, "list")


def _common(p: argparse.ArgumentParser, op: str) -> None:
    p.add_argument("--config", required=True, help="the node to ask (its TOML)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run, served_op=op)


def _run(args: argparse.Namespace) -> int:
    from hearthnet.errors import error_from_code
    from hearthnet.loop import run
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.admin import node_uri
    from hearthnet.node.capabilities import SERVED_MODELS_CAPABILITY

    uri = node_uri(args.config)
    call = {"op": args.served_op, "model": getattr(args, "model", None)}

    async def go() -> list[dict[str, Any]]:
        return [f async for f in bus_call(uri, SERVED_MODELS_CAPABILITY, call)]

    frames = run(go())
    for f in frames:
        if f.get("type") == "error":
            code, message = str(f.get("code")), str(f.get("message"))
            if code == "auth_failed" and "not a steward" in message:
                # a steward is a trust level in the member lists (DESIGN.md decision 14), not a flag
                message += ("; a steward is a member with trust \"steward\": set it in the "
                            "community's [[community.members]] lists (`hearthnet keys "
                            "provision` gives a node's own entry the trust the folder's "
                            f"other files give it), then `hearthnet node --reload --config "
                            f"{args.config}`")
            raise error_from_code(code, message)
    final = frames[-1] if frames else {"models": []}
    if args.json:
        print(json.dumps(final))
        return 0
    print(render(final))
    return 0


def render(st: dict[str, Any]) -> str:
    """The served-model list for a person."""
    models = st.get("models", [])
    if not models:
        return "no models are served yet; a steward adds one with `hearthnet models serve`"
    at = st.get("at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "?"
    lines = [f"served models (set by {st.get('set_by')} at {when}):"]
    lines += [f"  {m['alias'] or '-':<12} {m['model_id']:<40} {m['weights_sha256'][:16]}…"
              for m in models]
    return "\n".join(lines)
