"""A minimal gossiping node for tests: ``python -m tests.helpers.gossip_testnode``.

It runs an `EventLog` (SQLite at ``--db``), serves ``/gossip`` on ``--host:--port``, dials
each ``--peer``, and folds a `ShardStore` (rebuilt from the log at start, then live) — the
same wiring the node daemon does, without models. It is driven by JSON lines:

stdin commands::

    {"cmd": "append", "type": "...", "payload": {...}}
    {"cmd": "vector"}     {"cmd": "store"}     {"cmd": "quit"}

stdout reports::

    {"ev": "ready", "node": id, "port": bound port, "vector": {...}, "store": [shard ids]}
    {"ev": "appended", "origin": ..., "seq": ..., "type": ...}
    {"ev": "event", "origin": ..., "seq": ..., "type": ...}   (every stored event)
    {"ev": "vector", "vector": {...}}    {"ev": "store", "shards": [...]}
    {"ev": "peer", "peer": id, "up": bool}
    {"ev": "error", "message": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

from hearthnet.distributed_inference.directory.store import ShardStore
from hearthnet.errors import HearthNetError
from hearthnet.mesh.eventlog import Event, EventLog
from hearthnet.mesh.gossip import (
    GOSSIP_PATH,
    MAX_MESSAGE_BYTES,
    GossipPeerLink,
    handle_gossip_connection,
)
from hearthnet.observability import Metrics, configure_logging


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields, sort_keys=True) + "\n")
    sys.stdout.flush()


async def _main(args: argparse.Namespace) -> int:
    metrics = Metrics()
    log = EventLog(args.db, args.node_id, metrics=metrics,
                   compact_retain_s=args.expiry)
    store = ShardStore(args.expiry, metrics=metrics)
    store.rebuild(log.all_events())

    def on_event(ev: Event) -> None:
        store.apply(ev)
        _emit(ev="event", origin=ev.origin, seq=ev.seq, type=ev.type)

    log.subscribe(on_event)

    def on_peer(peer: str, up: bool) -> None:
        _emit(ev="peer", peer=peer, up=up)

    async def handler(ws: ServerConnection) -> None:
        path = ws.request.path if ws.request is not None else ""
        if path != GOSSIP_PATH:
            await ws.close(1008, "unknown path")
            return
        await handle_gossip_connection(log, ws, on_peer=on_peer)

    async with serve(handler, args.host, args.port, max_size=MAX_MESSAGE_BYTES,
                     compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        links = [GossipPeerLink(log, uri, min_backoff=0.05, max_backoff=args.max_backoff,
                                on_peer=on_peer) for uri in args.peer]
        for link in links:
            link.start()
        _emit(ev="ready", node=args.node_id, port=port, vector=log.vector(),
              store=[a.shard_id for a in store.live()])
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if not _command(line, log, store):
                    break
        finally:
            for link in links:
                await link.stop()
            log.close()
    return 0


def _command(line: bytes, log: EventLog, store: ShardStore) -> bool:
    try:
        cmd = json.loads(line)
        op = cmd.get("cmd")
        if op == "append":
            ev = log.append(cmd["type"], cmd.get("payload", {}))
            _emit(ev="appended", origin=ev.origin, seq=ev.seq, type=ev.type)
        elif op == "vector":
            _emit(ev="vector", vector=log.vector())
        elif op == "store":
            _emit(ev="store", shards=[a.shard_id for a in store.live()])
        elif op == "quit":
            return False
        else:
            _emit(ev="error", message=f"unknown command {op!r}")
    except (ValueError, KeyError, AttributeError, HearthNetError) as e:
        _emit(ev="error", message=str(e))
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.helpers.gossip_testnode")
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--db", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--peer", action="append", default=[])
    ap.add_argument("--expiry", type=float, default=120.0)
    ap.add_argument("--max-backoff", type=float, default=0.5)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    configure_logging(args.log_level, node=args.node_id)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
