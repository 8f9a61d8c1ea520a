"""The `hearthnet` command: node, chat, demo, status, models, keys, bench, init, invite, join.

Each command group lives with the code it drives and exposes `register(subparsers)`; this
module only assembles them and turns HearthNet errors into a one-line message and an exit
code (1 for errors, 2 for bad usage or config), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Modules providing `register(subparsers: argparse._SubParsersAction) -> None`.
_COMMAND_MODULES = (
    "hearthnet.commands.models",
    "hearthnet.commands.chat",
    "hearthnet.commands.bench",
    "hearthnet.commands.node",
    "hearthnet.commands.status",
    "hearthnet.commands.plan",
    "hearthnet.commands.demo",
    "hearthnet.commands.keys",
    "hearthnet.commands.init",
    "hearthnet.commands.join",
)


def _version() -> str:
    """The installed distribution's version, else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hearthnet")
    except PackageNotFoundError:
        from hearthnet import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hearthnet", description="HearthNet: one language model across your LAN.")
    parser.add_argument("--version", action="version", version=f"hearthnet {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue  # command group not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    from hearthnet.errors import ConfigError, HearthNetError, one_line

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"hearthnet: config error: {e.message}", file=sys.stderr)
        return 2
    except HearthNetError as e:
        print(one_line(e.code, e.message), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hearthnet: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def run() -> None:
    """The console script (and ``python -m hearthnet.cli``): `main`, then exit.

    A decode step still compiling in a background thread (`engine/compiled.py`) cannot be
    stopped, and an interpreter that tears such a thread down aborts (a C++ terminate,
    exit 134, after the answer was printed). Its artefact is written atomically and
    checked again when loaded, so the process then ends at once, its output flushed.
    """
    rc = main()
    compiled = sys.modules.get("hearthnet.distributed_inference.engine.compiled")
    if compiled is not None and compiled.compiling():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    run()
