"""`hearthnet init`: a new node's config with sane defaults, and its key.

The node is named after the machine (the host name cut to the node-id rule of
`hearthnet.ids`), listens for the mesh on every interface (mutual TLS, members only) and
finds its peers by mDNS, serves the OpenAI-compatible API on loopback port 11435, and
hosts layers automatically (``shards = "auto"``, DESIGN.md decision 14) within half the
memory free now, and computes on the machine's physical cores (``torch_threads``; the
config's own default is one thread, for several nodes on one machine). Its key is made as
``hearthnet keys init`` makes it. An existing config is never overwritten. Then
``hearthnet invite`` on a member and ``hearthnet join CODE`` here make it a member
(docs/security.md: Joining with a code).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
from pathlib import Path

import psutil

from hearthnet.commands.keys import NODE_ID_FILE
from hearthnet.config import parse_config
from hearthnet.errors import ConfigError
from hearthnet.ids import NODE_ID_RULE, valid_node_id
from hearthnet.security.joining import lan_address
from hearthnet.security.keys import NodeKey

DEFAULT_API_PORT = 11435  # one well-known port per machine, next to Ollama's 11434
DEFAULT_LISTEN_PORT = 7700
CONFIG_NAME = "node.toml"
MIN_BUDGET_MB = 256


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("init", help="write this machine's node config and key")
    p.add_argument("--dir", default=None,
                   help="folder for node.toml (default: $XDG_CONFIG_HOME/hearthnet)")
    p.add_argument("--name", default=None,
                   help="node id (default: from the host name)")
    p.add_argument("--listen-host", default="0.0.0.0",
                   help="mesh listener address (default: every interface; mutual TLS)")
    p.add_argument("--port", type=int, default=DEFAULT_LISTEN_PORT,
                   help=f"mesh listener port (default {DEFAULT_LISTEN_PORT}; 0 = any free)")
    p.add_argument("--api-port", type=int, default=DEFAULT_API_PORT,
                   help=f"loopback API port (default {DEFAULT_API_PORT}; 0 = any free)")
    p.add_argument("--data-dir", default=None,
                   help="node data folder (default: <HEARTHNET_DATA_DIR>/nodes/<id>)")
    p.set_defaults(func=_init)


def node_id_from_hostname(hostname: str) -> str:
    """A legal node id from a host name: lowercase, first label, other characters as
    ``-``, at most 63 long; ``node`` when nothing usable is left."""
    label = hostname.strip().split(".", 1)[0].lower()
    text = re.sub(r"[^a-z0-9-]+", "-", label)
    text = re.sub(r"-{2,}", "-", text).strip("-")[:63].rstrip("-")
    return text if valid_node_id(text) else "node"


def free_memory_mb() -> int | None:
    """Memory available now, in MiB: ``MemAvailable`` (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    except (ValueError, OSError, AttributeError):
        return None


def budget_mb() -> int:
    """The automatic-hosting layer budget: half the memory free at init (the rest stays
    for the head, the sessions' caches and the machine's own work)."""
    free = free_memory_mb()
    return max(MIN_BUDGET_MB, free // 2) if free else MIN_BUDGET_MB


def compute_threads() -> int:
    """Threads for the node's compute: the physical cores this process may run on, as
    llama.cpp's and torch's own defaults take (a second hardware thread of a core shares
    its vector units: no faster for products bound by them or by memory)."""
    try:
        usable = len(os.sched_getaffinity(0))  # a container's or taskset's share (Linux)
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or usable
    return max(1, min(usable, physical))


def default_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "hearthnet"


def render_config(node_id: str, *, listen_host: str, port: int, api_port: int,
                  data_dir: str, memory_mb: int, threads: int) -> str:
    """The TOML `init` writes (validated by the caller before it is written)."""
    wildcard = listen_host in ("0.0.0.0", "::")
    advertise = lan_address() if wildcard else ""
    loopback = listen_host.startswith("127.") or listen_host in ("::1", "localhost")
    q = json.dumps
    rows: list[tuple[str, str]] = [
        ("# HearthNet node " + node_id + ": written by `hearthnet init`; edit freely "
         "(docs/operations.md).", ""),
        ("# Join a community: `hearthnet invite` on a member prints a code, then here", ""),
        ("#   hearthnet join CODE --config THIS_FILE", ""),
        ('shards = "auto"', "automatic hosting: the node picks its own layer ranges"),
        ("", ""), ("[node]", ""),
        (f"id = {q(node_id)}", "this node's name in the community"),
        (f"listen_host = {q(listen_host)}", "the mesh listener: mutual TLS, members only"),
        (f"advertise_host = {q(advertise)}", 'how others reach it ("" = listen_host)'),
        (f"listen_port = {port}", ""),
        (f"data_dir = {q(data_dir)}", f'"" = <HEARTHNET_DATA_DIR>/nodes/{node_id}'),
        (f"discovery = {q('off' if loopback else 'mdns')}", "find members on the LAN"),
        (f"torch_threads = {threads}", "compute threads: this machine's cores at init"),
        ("peers = []", "`hearthnet join` adds the node that invited this one"),
        ("", ""), ("[research]", ""), ("enable = true", ""),
        ("", ""), ("[research.distributed_inference]", ""), ("enabled = true", ""),
        ("allow_self_as_shard = true", "its own layers count for its own chats"),
        ("", ""), ("[research.distributed_inference.host]", ""), ("serve_shards = true", ""),
        ("", ""), ("[research.distributed_inference.auto]", ""),
        (f"memory_mb = {memory_mb}", "layer budget: half the memory free at init"),
        ("", ""), ("[community]", ""), ('min_trust = "trusted"', ""),
        ("", ""), ("[api]", "OpenAI-compatible API and status page"),
        ('listen_host = "127.0.0.1"', "loopback: no API key needed (docs/api.md)"),
        (f"listen_port = {api_port}", ""),
    ]
    return "".join(f"{text:<30} # {note}\n" if note else f"{text}\n" for text, note in rows)


def _init(args: argparse.Namespace) -> int:
    folder = Path(args.dir).expanduser() if args.dir else default_dir()
    path = folder / CONFIG_NAME
    node_id = args.name if args.name is not None else node_id_from_hostname(
        socket.gethostname())
    if not valid_node_id(node_id):
        raise ConfigError(f"invalid node name {node_id!r}: use {NODE_ID_RULE}",
                          key="node.id", reason="invalid node id")
    data_dir = str(Path(args.data_dir).expanduser().resolve()) if args.data_dir else ""
    text = render_config(node_id, listen_host=args.listen_host, port=args.port,
                         api_port=args.api_port, data_dir=data_dir, memory_mb=budget_mb(),
                         threads=compute_threads())
    cfg = parse_config(text, source=path)  # never write a config the node would refuse
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(path, "x", encoding="utf-8") as f:  # O_EXCL: never overwrite
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{path} exists already: `hearthnet init` never overwrites a "
                          "config; edit it, or pass --dir for another folder",
                          file=str(path), reason="exists") from None
    except OSError as e:  # a folder that cannot be made or written: one line, no traceback
        raise ConfigError(f"cannot write {path}: {e.strerror or e}", file=str(path),
                          reason="unwritable") from None
    data = cfg.effective_data_dir()
    try:
        key = NodeKey.load_or_create(data)  # as `hearthnet keys init` does
        (data / NODE_ID_FILE).write_text(node_id + "\n", encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot write the node's data dir {data}: {e.strerror or e}",
                          key="node.data_dir", reason="unwritable") from None
    print(f"wrote {path}")
    print(f"node_id     {node_id}")
    print(f"fingerprint {key.fingerprint}")
    print(f"key_file    {key.path}")
    print(f"budget      {cfg.di.auto.memory_mb} MiB of layers, "
          f"{cfg.node.torch_threads} compute threads; API http://127.0.0.1:{args.api_port}/")
    print("\nnext steps:")
    print("  on a machine already in the community:  hearthnet invite --config ITS_CONFIG")
    print(f"  then here:                              hearthnet join CODE --config {path}")
    print(f"  and start this node:                    hearthnet node --config {path}")
    print(f"  (the first machine of a community just starts: hearthnet node --config {path})")
    return 0
