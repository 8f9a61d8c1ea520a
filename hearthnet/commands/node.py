"""`hearthnet node --config FILE`: run one node daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearthnet.node.daemon import Node


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run a node daemon")
    p.add_argument("--config", required=True, help="node TOML file")
    p.add_argument("--port", type=int, default=None, help="override [node] listen_port")
    p.add_argument("--reload", action="store_true",
                   help="tell the running node of this config to re-read its member list "
                        "(sends SIGHUP to the pid in <data_dir>/node.json)")
    p.set_defaults(func=_run)


def _reload(config: str) -> int:
    """Signal the running node of `config` to reload: member changes apply without a restart."""
    import os
    import signal
    import sys

    from hearthnet.config import load_config
    from hearthnet.errors import NotRunning
    from hearthnet.node.guard import STATE_FILE, read_state

    cfg = load_config(config)  # refuse a broken file here, before signalling
    data = cfg.effective_data_dir()
    state = read_state(data)
    pid = state.get("pid") if state else None
    if not isinstance(pid, int) or pid <= 0:
        raise NotRunning(f"node {cfg.node.id} is not running (no pid in "
                         f"{data / STATE_FILE})")
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise NotRunning(f"node {cfg.node.id} (pid {pid}) is not running; remove the "
                         f"stale {data / STATE_FILE}") from None
    print(f"asked node {cfg.node.id} (pid {pid}) to reload {config}", file=sys.stderr)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.reload:
        return _reload(args.config)
    from hearthnet.config import load_config
    from hearthnet.node.daemon import Node
    from hearthnet.observability import configure_logging

    cfg = load_config(args.config)  # ConfigError → exit 2 naming file, key, reason
    if args.port is not None:  # the settings are frozen: a copy with the port replaced
        cfg = cfg.model_copy(update={"node": cfg.node.model_copy(
            update={"listen_port": args.port})})
    configure_logging(cfg.node.log_level, node=cfg.node.id)
    run_node(Node(cfg))
    return 0


def run_node(node: Node) -> None:
    """Serve `node` until it is told to stop, then end the process promptly."""
    from hearthnet.loop import run

    run(node.run())
    exit_promptly()


def exit_promptly(grace_s: float = 2.0) -> None:
    """End the process within `grace_s` of the node stopping, whatever compute threads do
    (SIGTERM must work mid-prefill): the interpreter would otherwise join a busy executor thread
    for as long as its forward runs. Threads still busy after the grace are logged, then
    `os._exit`."""
    import os
    import sys
    import threading
    import time

    from hearthnet.observability import get_logger

    deadline = time.monotonic() + grace_s
    others = [t for t in threading.enumerate()
              if t is not threading.main_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    busy = [t.name for t in others if t.is_alive()]
    if busy:
        get_logger("node").warning("exit_with_busy_threads", threads=busy, grace_s=grace_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
