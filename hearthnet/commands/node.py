"""`hearthnet node --config FILE`: run one node daemon until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hearthnet.config import NodeConfig
    from hearthnet.node.daemon import Node


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="run a node daemon")
    p.add_argument("--config", required=True, help="node TOML file")
    p.add_argument("--port", type=int, default=None, help="override [node] listen_port")
    p.add_argument("--log-format", choices=("auto", "json", "human"), default="auto",
                   help="human: short lines; json: one JSON object per line; auto (the "
                        "default): human on a terminal, JSON into a file or pipe")
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

    cfg = load_config(args.config)  # ConfigError → exit 2 naming file, key, reason
    if args.port is not None:  # the settings are frozen: a copy with the port replaced
        cfg = cfg.model_copy(update={"node": cfg.node.model_copy(
            update={"listen_port": args.port})})
    preflight(cfg, args.config)
    from hearthnet.distributed_inference.engine.memory import large_blocks_setting
    from hearthnet.distributed_inference.engine.quant import dense_setting, kernel_settings
    from hearthnet.node.daemon import Node  # the model runtime: only for a node that starts

    dense_setting()  # a bad HEARTHNET_INT4_DENSE_ROWS: one line before the node starts
    large_blocks_setting()  # and a bad HEARTHNET_LARGE_BLOCKS_MIB
    kernel_settings()  # and a HEARTHNET_INT8_KERNEL / HEARTHNET_INT4_KERNEL naming no kernel
    from hearthnet.observability import configure_logging, logs_as_json

    configure_logging(cfg.node.log_level, json=logs_as_json(args.log_format), node=cfg.node.id)
    run_node(Node(cfg))
    return 0


def preflight(cfg: NodeConfig, name: str | None = None, *, ports: bool = True) -> None:
    """Refuse, before anything starts, what would otherwise stop the node part-way through
    its start (links dialled, TLS sessions open): a ``[[shards]]`` range past its model's
    last layer (`hearthnet.config.check_shard_layers`), an unreadable ``[api] key_file``,
    and with `ports` a fixed port another program holds. Each is one line and a nonzero
    exit from the CLI: 2 for the config (file, key, reason), 1 for a port in use.

    Raises:
        ConfigError: the shard range or the key file.
        PortInUse: a listener's port is taken (`hearthnet.node.daemon.binding`'s words).
    """
    from hearthnet.config import check_shard_layers
    from hearthnet.models import ModelStore

    store = ModelStore(cfg.effective_models_dir())

    def num_layers(model: str) -> int | None:
        entry = store.find(model)
        return entry.num_layers if entry is not None else None

    check_shard_layers(cfg, num_layers, name=name)
    if cfg.api.enabled:
        cfg.api_keys()
    if ports:
        check_ports_free(cfg)


def check_ports_free(cfg: NodeConfig) -> None:
    """Raise `PortInUse` for the first fixed port of `cfg`'s listeners that is taken."""
    from hearthnet.node.daemon import binding

    listeners = [("the node listener", "[node] listen_port", cfg.node.listen_host,
                  cfg.node.listen_port),
                 ("the admin listener", "[security] admin_port", "127.0.0.1",
                  cfg.security.admin_port),
                 ("the metrics listener", "[node] metrics_port", cfg.node.listen_host,
                  cfg.node.metrics_port)]
    if cfg.api.enabled:
        listeners.append(("the HTTP API", "[api] listen_port", cfg.api.listen_host,
                          cfg.api.listen_port))
    for what, key, host, port in listeners:
        if port > 0:  # 0: any free port; -1: off
            with binding(what, key, host, port):
                _probe_bind(host, port)


def _probe_bind(host: str, port: int) -> None:
    """Bind and release `host:port` as the node's listeners would (every address `host`
    names, with SO_REUSEADDR); raise the OSError only for a port in use — any other
    failure is left to the real bind, which reports it in context."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise


def run_node(node: Node) -> None:
    """Serve `node` until it is told to stop, then end the process promptly."""
    from hearthnet.loop import run

    run(node.run())
    exit_promptly()


def exit_promptly(grace_s: float = 2.0) -> None:
    """End the process within `grace_s` of the node stopping, whatever compute threads do
    (SIGTERM must work mid-prefill): the interpreter would otherwise join a busy executor thread
    for as long as its forward runs. Threads still busy after the grace are logged.

    Then the exit handlers run and the process ends with `os._exit`, without the
    interpreter's teardown: with torch, a shard's weights and its modules loaded, that
    teardown frees object by object for 1-1.6 s of CPU after the node has stopped and
    its log is flushed (measured on a 2-core VM), time a service manager waits and a
    machine that hosts the next shard pays for."""
    import atexit
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
    else:
        # what a normal exit runs before its teardown (logging's flush, temporary
        # folders' finalizers); with a thread still busy they could wait on it
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
