"""Calling a node's capabilities from the command line."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hearthnet.errors import ConnectionLost
from hearthnet.frames import Done, ErrorFrame, OtherFrame, StreamFrame, TokenDelta, read_frame
from hearthnet.node.admin import node_uri

if TYPE_CHECKING:
    from hearthnet.distributed_inference.engine.sampling import SamplingParams


def http_get_json(uri: str, path: str, timeout: float = 5.0) -> Any:
    url = uri.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise ConnectionLost(f"cannot reach the node at {uri}: {e}. Is it running "
                             f"(`hearthnet node --config ...`)?") from e


def check_node_config(config_path: str) -> None:
    """Refuse a missing or broken node config at once (`ConfigError`: exit code 2)."""
    node_uri(config_path)


def chat_via_node(args: argparse.Namespace, messages: list[dict[str, str]],
                  params: SamplingParams,
                  emit: Callable[[StreamFrame | OtherFrame, bool], None]) -> int:
    """Stream a chat through the running node of ``args.config``, handing every frame to
    ``emit(frame, as_json)`` (the chat command's printer, handed in so that this module
    need not import the command that imports it)."""
    from hearthnet.loop import run
    from hearthnet.mesh.bus import bus_call
    from hearthnet.node.capabilities import CHAT_CAPABILITY, chat_args

    uri = node_uri(args.config)
    call = chat_args(messages, args.model, params, wire_dtype=args.wire_dtype,
                     weights=args.weights, speculate=getattr(args, "speculate", None))

    async def go() -> int:
        ended: str | None = None
        tokens = 0
        try:
            async for raw in bus_call(uri, CHAT_CAPABILITY, call):
                frame = read_frame(raw)  # a malformed frame: PeerDataError, exit code 1
                emit(frame, args.json)
                tokens += isinstance(frame, TokenDelta)
                if isinstance(frame, (Done, ErrorFrame)):
                    ended = ended or frame.TYPE
        except ConnectionLost as e:  # orchestrator died: the loss the mesh can't hide
            emit(ErrorFrame.of(e, tokens_so_far=tokens), args.json)
            return 1
        if ended is None:  # the stream stopped without `done` or `error`
            emit(ErrorFrame("connection_lost", f"the node at {uri} ended the call without "
                            "done or error", tokens_so_far=tokens), args.json)
        return 0 if ended == "done" else 1

    return run(go())

