"""`hearthnet node --config FILE`: run one node daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run a node daemon")
    p.add_argument("--config", required=True, help="node TOML file")
    p.add_argument("--port", type=int, default=None, help="override [node] listen_port")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hearthnet.config import load_config
    from hearthnet.mesh.node import Node
    from hearthnet.observability import configure_logging
    from hearthnet.transport.websocket import run

    cfg = load_config(args.config)  # ConfigError → exit 2 naming file, key, reason
    if args.port is not None:
        cfg.node.listen_port = args.port
    configure_logging(cfg.node.log_level, node=cfg.node.id)
    run(Node(cfg).run())
    return 0
