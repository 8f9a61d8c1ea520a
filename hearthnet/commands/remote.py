"""Calling a node's capabilities from the command line."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from hearthnet.errors import ConnectionLost

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams


def node_uri(config_path: str) -> str:
    """Where the CLI reaches its own node: the loopback admin listener (issue 7).

    The running node writes its admin URI to ``<data_dir>/node.json``; the main listener
    is mutual TLS for members only, so the CLI does not use it. A node configured with
    ``insecure_plaintext = true`` and no admin listener is reached on its main port.
    """
    from hearthnet.config import load_config
    from hearthnet.node.guard import STATE_FILE, read_state

    cfg = load_config(config_path)
    data = cfg.effective_data_dir()
    state = read_state(data)
    if state and isinstance(state.get("admin"), str) and state["admin"]:
        return str(state["admin"])
    if cfg.security.insecure_plaintext:
        return f"ws://{cfg.advertise_host()}:{cfg.node.listen_port}"
    raise ConnectionLost(f"node {cfg.node.id} is not running (no admin address in "
                         f"{data / STATE_FILE}); start it with `hearthnet node --config "
                         f"{config_path}`")


def http_get_json(uri: str, path: str, timeout: float = 5.0) -> Any:
    url = uri.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ConnectionLost(f"cannot reach the node at {uri}: {e}. Is it running "
                             f"(`hearthnet node --config ...`)?") from e


def chat_via_node(args: argparse.Namespace, messages: list[dict[str, str]],
                  params: SamplingParams) -> int:
    from hearthnet.commands.chat import emit
    from hearthnet.loop import run
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    uri = node_uri(args.config)
    call = chat_args(messages[-1]["content"], args.model, params, wire_dtype=args.wire_dtype,
                     weights=args.weights)

    async def go() -> int:
        ended: str | None = None
        tokens = 0
        try:
            async for frame in bus_call(uri, CHAT_CAPABILITY, call):
                emit(frame, args.json)
                kind = frame.get("type")
                tokens += kind == "token_delta"
                if kind in ("done", "error"):
                    ended = ended or str(kind)
        except ConnectionLost as e:  # the orchestrating node died mid-answer (issue 14 §9)
            emit({"type": "error", "code": e.code, "message": e.message,
                  "tokens_so_far": tokens}, args.json)
            return 1
        if ended is None:  # the stream stopped without `done` or `error`
            emit({"type": "error", "code": "connection_lost", "tokens_so_far": tokens,
                  "message": f"the node at {uri} ended the call without done or error"},
                 args.json)
        return 0 if ended == "done" else 1

    return run(go())

